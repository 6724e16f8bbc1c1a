"""W2's systems given as arrays already on a GPU: validation and ``solve_many``, a diagnostic.

The 400 2D Poisson systems of W2 (one matrix each), made on the GPU as a
model would hand them over: torch sparse CSR tensors, ``(crow, col,
values)`` torch triples, and cupyx CSR matrices with CuPy right-hand sides.
Prints the median milliseconds of making 400 ``LinearSystem`` objects from
each (validation: the pattern, NaN and Inf) and of ``solve_many`` over
them. Compare two checkouts by running it under each
(``PYTHONPATH=<checkout>``) on the same machine, one after the other.

Run on a GPU machine: ``python3 benchmarks/gpu_inputs.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_w2_many import RTOL, poisson2d, w2_sizes  # noqa: E402

from managed_solve import LinearSystem, solve_many  # noqa: E402
from managed_solve.manager import DeviceManager  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import cupy as cp
    import cupyx.scipy.sparse as csp
    import torch

    mats = [poisson2d(m) for m in w2_sizes()]

    def tensors(A):
        crow = torch.tensor(A.indptr, dtype=torch.int64, device="cuda")
        col = torch.tensor(A.indices, dtype=torch.int64, device="cuda")
        return crow, col, torch.tensor(A.data, device="cuda")

    triples = [(tensors(A), torch.ones(A.shape[0], dtype=torch.float64, device="cuda"))
               for A in mats]
    inputs = {
        "torch sparse CSR": [(torch.sparse_csr_tensor(*t, size=A.shape), b)
                             for (t, b), A in zip(triples, mats, strict=True)],
        "torch (crow, col, values)": triples,
        "cupyx CSR, CuPy b": [(csp.csr_matrix(A), cp.ones(A.shape[0])) for A in mats],
    }
    dm = DeviceManager(["cuda:0"])

    def timed(fn):
        times = []
        for _ in range(args.rounds + 1):  # the first round warms up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times[1:]), out

    print(f"W2, {len(mats)} systems on the GPU, median ms over {args.rounds} rounds")
    for name, pairs in inputs.items():
        ms_build, systems = timed(lambda pairs=pairs: [LinearSystem(A, b, rtol=RTOL)
                                                        for A, b in pairs])
        ms_solve, results = timed(lambda systems=systems: solve_many(systems, manager=dm))
        assert all(r.converged for r in results)
        print(f"  {name:28s} 400 LinearSystem {ms_build:8.1f} ms   solve_many {ms_solve:8.1f} ms")
    pairs = inputs["cupyx CSR, CuPy b"]
    ms_pairs, results = timed(lambda: solve_many(pairs, rtol=RTOL, manager=dm))
    assert all(r.converged for r in results)
    print(f"  {'(A, b) pairs, cupyx CSR':28s} solve_many with validation {ms_pairs:8.1f} ms")


if __name__ == "__main__":
    main()
