"""Where W2's time goes, one build at a time: cProfile of solve_many on 400 systems with one matrix each.

    PYTHONPATH=<checkout> python benchmarks/profile_w2_builds.py --label new
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import scipy.sparse as sp


def poisson2d(m: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return sp.kronsum(T, T).tocsr()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    import cupy as cp

    import managed_solve as ms

    sizes = [int(m) for m in np.random.default_rng(0).integers(32, 97, size=400)]
    pairs = [(poisson2d(m), np.ones(m * m)) for m in sizes]
    dm = ms.DeviceManager(["cuda:0"])
    for _ in range(3):
        ms.solve_many(pairs, rtol=1e-8, manager=dm)
    cp.cuda.Device(0).synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(3):
        ms.solve_many(pairs, rtol=1e-8, manager=dm)
    cp.cuda.Device(0).synchronize()
    prof.disable()
    print(f"== {args.label}: {(time.perf_counter() - t0) / 3 * 1e3:.1f} ms per call (profiled)")
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
