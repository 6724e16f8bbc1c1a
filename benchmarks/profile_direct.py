"""Where a GPU direct solve spends its time: a diagnostic for the cuDSS settings, not a benchmark.

For 2D Poisson systems of N = m^2 unknowns, on one GPU with nvmath-python and
cuDSS installed:

- ``solve(A, b, method="direct")`` with every solve planning (cuDSS's OpenMP
  threading layer off, then on), and with the analysis kept from an earlier
  solve (same pattern, new values: factorise and solve; the same matrix:
  solve only), settings interleaved, medians of rounds;
- the phases of one solve through nvmath's stateful ``DirectSolver``
  (handle creation, plan = ordering and symbolic, factorize, solve).

Run: ``python3 benchmarks/profile_direct.py [--sizes 200 500 1000] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import scipy.sparse as sp


def poisson2d(m):
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 500, 1000])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import importlib

    import cupy as cp
    import cupyx.scipy.sparse as csp
    import nvmath.sparse.advanced as nva
    from nvmath.bindings import cudss

    from managed_solve import solve

    cd = importlib.import_module("managed_solve.solvers._cudss")

    state = cd.default()  # the process's cuDSS state, which solve(method="direct") uses
    print("threading layer:", state.threading_lib())
    # Each setting: (threading layer, kept analyses, what the timed solve gets).
    settings = {"plan, 1 thread": (False, 0, "A"), "plan, threads": (True, 0, "A"),
                "kept: same pattern": (True, 2, "A2"), "kept: same matrix": (True, 2, "A")}
    rows = []
    for m in args.sizes:
        A_h = poisson2d(m)
        x_true = np.random.default_rng(0).standard_normal(A_h.shape[0])
        A, b = csp.csr_matrix(A_h), cp.asarray(A_h @ x_true)
        mats = {"A": A, "A2": csp.csr_matrix(A_h * 2.0)}
        rhs = {"A": b, "A2": b * 2.0}
        times: dict[str, list[float]] = {k: [] for k in settings}
        for r in range(args.rounds + 1):  # the first round warms up
            for name, (threads, kept, which) in settings.items():
                state.threading, state.cache_size = threads, kept
                state.release()
                if not threads:
                    state.reset()  # a new handle: the layer, once set, stays on a handle
                if kept:
                    solve(A, b, method="direct")  # analysed (and factorised) before the timed call
                cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                res = solve(mats[which], rhs[which], method="direct")
                cp.cuda.Device().synchronize()
                dt = time.perf_counter() - t0
                assert res.info["factorisation"] == "cuDSS (nvmath-python)", res.info
                want = {"plan, 1 thread": "none", "plan, threads": "none",
                        "kept: same pattern": "plan", "kept: same matrix": "factors"}[name]
                assert res.info["cudss_reused"] == want, (name, res.info)
                err = float(cp.abs(res.x - cp.asarray(x_true)).max())
                assert err < 1e-6, err
                if r:
                    times[name].append(dt)
        for name, ts in times.items():
            rows.append((A_h.shape[0], name, statistics.median(ts), min(ts), max(ts)))
        state.threading, state.cache_size = True, cd.CACHE_SIZE
        state.release()

        # The phases, through the stateful API (threading layer on, a handle made here).
        lib = state.threading_lib()
        phases: dict[str, list[float]] = {"create handle": [], "plan": [], "factorize": [], "solve": []}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            h = cudss.create()
            phases["create handle"].append(time.perf_counter() - t0)
            opts = nva.DirectSolverOptions(sparse_system_type=nva.DirectSolverMatrixType.SYMMETRIC, handle=h,
                                           multithreading_lib=lib,
                                           logger=logging.getLogger("managed_solve.cudss"))
            with nva.DirectSolver(A, b, options=opts) as s:
                for phase in ("plan", "factorize", "solve"):
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    getattr(s, phase)()
                    cp.cuda.Device().synchronize()
                    phases[phase].append(time.perf_counter() - t0)
            cudss.destroy(h)
        for name, ts in phases.items():
            rows.append((A_h.shape[0], "phase: " + name, statistics.median(ts), min(ts), max(ts)))

    print(f"{'N':>9}  {'setting':<26} {'median':>10} {'min':>10} {'max':>10}")
    for n, name, med, lo, hi in rows:
        print(f"{n:>9,}  {name:<26} {med * 1e3:>8.1f}ms {lo * 1e3:>8.1f}ms {hi * 1e3:>8.1f}ms")


if __name__ == "__main__":
    main()
