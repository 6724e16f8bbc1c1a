"""Time the CPU workloads (W2 with one matrix per system, the mesh sweep) through whichever ``managed_solve`` is importable.

The CPU counterpart of ``compare_builds.py``: run it once per build
(``PYTHONPATH`` pointing at each checkout), in alternation, and compare the
medians; each run also times the anchors (SciPy loops), so every figure has
its ratio to an anchor of the same process. Prints one JSON line per figure.

    python benchmarks/compare_builds_cpu.py --label new --rounds 7

Figures: W2 (``--systems`` of W2's sizes, 120 by default, each with its own
matrix) through ``solve_many``, a loop of SciPy's ``cg`` and a loop of
``spsolve``; the demo's sweep of 40 heat and screened-Poisson systems on
``icosphere(5)`` through ``solve_many`` and a loop of SciPy's ``cg`` (with
OpenBLAS's default threads, and held to one thread where it can be). For
``solve_many`` on one thread, run it with ``NUMBA_NUM_THREADS=1`` (read by
either build).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import os
import statistics
import time

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla


def poisson2d(m: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 4.0, -1.0], [-1, 0, 1], shape=(m, m))
    S = sp.diags([-1.0, -1.0], [-1, 1], shape=(m, m))
    A = (sp.kron(sp.identity(m), T) + sp.kron(S, sp.identity(m))).tocsr()
    A.indices = A.indices.astype(np.int32)
    A.indptr = A.indptr.astype(np.int32)
    return A


def timed(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


@contextlib.contextmanager
def one_blas_thread():
    """NumPy's OpenBLAS on one thread inside the block (nothing where it cannot be set)."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs",
                                  "libscipy_openblas64_*.so"))
    blas = ctypes.CDLL(libs[0]) if libs else None
    put = getattr(blas, "scipy_openblas_set_num_threads64_", None)
    get = getattr(blas, "scipy_openblas_get_num_threads64_", None)
    if put is None or get is None:
        yield False
        return
    before = get()
    put(1)
    try:
        yield True
    finally:
        put(before)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--systems", type=int, default=120)
    ap.add_argument("--only", default="W2,MESH", help="comma-separated workloads to time")
    args = ap.parse_args()
    only = set(args.only.split(","))

    import managed_solve as ms

    dm = ms.DeviceManager(["cpu"])

    def emit(name, seconds, **extra):
        print(json.dumps({"label": args.label, "figure": name, "median_s": statistics.median(seconds),
                          "min_s": min(seconds), "load": os.getloadavg(), "module": ms.__file__,
                          "numba_threads": os.environ.get("NUMBA_NUM_THREADS"), **extra}),
              flush=True)

    if "W2" in only:
        sizes = [int(m) for m in np.random.default_rng(0).integers(32, 97, size=400)][:args.systems]
        pairs = [(poisson2d(m), np.ones(m * m)) for m in sizes]

        def ours():
            out = ms.solve_many(pairs, rtol=1e-8, manager=dm)
            assert all(r.converged for r in out)
            return out

        methods = sorted({r.method for r in ours()})
        ours()
        emit(f"W2 {len(pairs)} systems, one matrix each: solve_many", timed(ours, args.rounds),
             methods=methods)
        emit(f"W2 {len(pairs)} systems: scipy cg loop",
             timed(lambda: [spla.cg(A, b, rtol=1e-8) for A, b in pairs], args.rounds))
        emit(f"W2 {len(pairs)} systems: spsolve loop",
             timed(lambda: [spla.spsolve(A, b) for A, b in pairs], max(3, args.rounds // 2)))
    if "MESH" in only:
        from managed_solve.demo import build_sweep
        from managed_solve.mesh import icosphere

        systems, _labels = build_sweep([icosphere(5)], 40)
        mats = [(s.A.tocsr(), np.asarray(s.b), s.rtol, s.n) for s in systems]

        def ours():
            out = ms.solve_many(systems, manager=dm)
            assert all(r.converged for r in out)
            return out

        methods = sorted({r.method for r in ours()})
        ours()
        emit("mesh 40 systems on icosphere(5): solve_many", timed(ours, args.rounds),
             methods=methods)

        def loop():
            return [spla.cg(A, b, rtol=rtol, maxiter=10 * n) for A, b, rtol, n in mats]

        emit("mesh 40 systems: scipy cg loop", timed(loop, args.rounds))
        with one_blas_thread() as held:
            if held:
                loop()
                emit("mesh 40 systems: scipy cg loop, OpenBLAS on one thread",
                     timed(loop, args.rounds))


if __name__ == "__main__":
    main()
