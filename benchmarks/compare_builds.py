"""Time W1, W2 and W3 through the public API of whichever ``managed_solve`` is importable.

Used to compare two builds of the package on one GPU, back to back: run it
once per build (``PYTHONPATH`` pointing at each checkout) in alternation and
compare the medians. Prints one JSON line per figure.

    python benchmarks/compare_builds.py --label new --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import scipy.sparse as sp


def poisson2d(m: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    A = sp.kronsum(T, T).tocsr()
    A.indices = A.indices.astype(np.int32)
    A.indptr = A.indptr.astype(np.int32)
    return A


def timed(fn, rounds: int, sync) -> list[float]:
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--opt-in", action="store_true",
                    help="run under the process-wide settings solve_many may opt in to "
                         "(GC paused, a short switch interval), where the build has them")
    ap.add_argument("--only", default="W1,W2,W3", help="comma-separated workloads to time")
    args = ap.parse_args()
    only = set(args.only.split(","))

    import contextlib

    import cupy as cp
    import cupyx.scipy.sparse as csp

    import managed_solve as ms
    from managed_solve import assembly
    from managed_solve.mesh import icosphere

    settings = contextlib.nullcontext()
    if args.opt_in and hasattr(ms, "config"):
        settings = ms.config.override(pause_gc=True, switch_interval=5e-4,
                                      head_switch_interval=1e-4)
    with settings:
        run(args, only, ms, assembly, icosphere, cp, csp)


def run(args, only, ms, assembly, icosphere, cp, csp) -> None:
    def sync():
        cp.cuda.Device(0).synchronize()

    def emit(name, seconds, **extra):
        print(json.dumps({"label": args.label + (" opt-in" if args.opt_in else ""), "figure": name,
                          "median_s": statistics.median(seconds), "min_s": min(seconds),
                          "module": ms.__file__, **extra}), flush=True)

    dm = ms.DeviceManager(["cuda:0"])
    if "W1" in only:
        w1_figures(args, ms, cp, csp, dm, sync, emit)
    if "W2" in only:
        w2_figures(args, ms, dm, sync, emit)
    if "W3" in only:
        w3_figures(args, assembly, icosphere, sync, emit)


def w1_figures(args, ms, cp, csp, dm, sync, emit) -> None:
    """One 2D Poisson system on the GPU: time per iteration at two sizes, time to rtol 1e-8 at 1M.

    CG without a preconditioner (``M=None``, every build's meaning), so the
    builds run the same iterations whatever their default preconditioner.
    """
    for m, its in ((256, 200), (2048, 200)):
        A = csp.csr_matrix(poisson2d(m))
        b = cp.ones(m * m)

        def w1(A=A, b=b, its=its):
            return ms.solve(A, b, rtol=1e-30, maxiter=its, method="cg", M=None,
                            device="cuda:0", manager=dm)

        w1()
        w1()
        emit(f"W1 CG per iteration, N={m * m}", [t / its for t in timed(w1, args.rounds, sync)])
    A = csp.csr_matrix(poisson2d(1024))
    b = cp.ones(1024 * 1024)

    def w1_answer():
        return ms.solve(A, b, rtol=1e-8, method="cg", M=None, device="cuda:0", manager=dm)

    res = w1_answer()
    emit("W1 CG to rtol 1e-8, N=1048576", timed(w1_answer, max(3, args.rounds // 2), sync),
         iterations=int(res.iterations), converged=bool(res.converged))



def w2_figures(args, ms, dm, sync, emit) -> None:
    """400 systems, one matrix per system (as users have them), and shared matrices."""
    sizes = [int(m) for m in np.random.default_rng(0).integers(32, 97, size=400)]
    own = [(poisson2d(m), np.ones(m * m)) for m in sizes]
    cache: dict[int, sp.csr_matrix] = {}
    shared = [(cache.setdefault(m, poisson2d(m)), np.ones(m * m)) for m in sizes]
    for label, pairs in (("one matrix per system", own), ("shared matrices", shared)):
        def w2(pairs=pairs):
            out = ms.solve_many(pairs, rtol=1e-8, manager=dm)
            assert all(r.converged for r in out)
            return out

        w2()
        w2()
        emit(f"W2 solve_many 400 systems, {label}", timed(w2, args.rounds, sync))



def w3_figures(args, assembly, icosphere, sync, emit) -> None:
    """Cotangent Laplacian + lumped mass of icosphere(9), numeric phase."""
    mesh = icosphere(9)
    assembly.symbolic(mesh, device="cuda:0")

    def w3():
        return assembly.assemble(mesh, stiffness=1.0, lumped_mass=1.0, device="cuda:0")

    w3()
    w3()
    emit("W3 assembly numeric phase, icosphere(9)", timed(w3, args.rounds * 3, sync))


if __name__ == "__main__":
    main()
