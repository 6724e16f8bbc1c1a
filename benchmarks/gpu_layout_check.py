"""Per-iteration time of the batched CUDA core under its two row layouts (a diagnostic).

The kernels with sums walk rows as a contiguous run per warp (the library's
layout, ``-DMS_CONTIGUOUS=1``) or in grid-stride steps (``-DMS_CONTIGUOUS=0``).
This compiles both, times a fixed number of CG iterations for W2-like batches
and single systems under each, with compaction off, and prints microseconds
per iteration. GPU only:

    python3 benchmarks/gpu_layout_check.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
from bench_w2_many import poisson2d, w2_sizes  # noqa: E402

from managed_solve import LinearSystem, _backend, config  # noqa: E402
from managed_solve.solvers.batched import PackedBatch, cg_batched, cuda  # noqa: E402

K = 96  # iterations timed (a multiple of the 24-iteration graph chunk)


def cases():
    sizes = sorted(w2_sizes(), reverse=True)
    mats = {m: poisson2d(m) for m in set(sizes)}
    w2 = [LinearSystem(mats[m], np.ones(m * m), rtol=1e-30, maxiter=K) for m in sizes]
    yield "W2 largest 120 systems", w2[:120]
    yield "W2 all 400 systems", w2
    for m in (256, 2048):
        yield f"one system, n={m * m:,}", [LinearSystem(poisson2d(m), np.ones(m * m), rtol=1e-30, maxiter=K)]


def use_layout(contiguous: bool) -> None:
    """Make the solver load kernels compiled with this row layout (this script's experiment)."""
    cache: dict = {}

    def kernels(device_id, dtype, index_dtype):
        key = (int(device_id), np.dtype(dtype).str, np.dtype(index_dtype).str)
        if key not in cache:
            cache[key] = cuda.compile_module(device_id, dtype, index_dtype, contiguous_rows=contiguous)
        return cache[key]

    cuda.kernels = kernels


def main():
    cp = _backend.cupy()
    rows = []
    with config.override(batched_compact_min_rows=1 << 62):
        for name, systems in cases():
            batch = PackedBatch.pack(systems, device="cuda:0")
            line = [name, f"{batch.n:,}"]
            for layout in (True, False):
                use_layout(layout)
                cg_batched(batch)  # compile, warm up
                times = []
                for _ in range(5):
                    cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    out = cg_batched(batch)
                    cp.cuda.Device().synchronize()
                    times.append(time.perf_counter() - t0)
                assert int(out.iterations.max()) == K
                line.append(f"{np.median(times) / K * 1e6:.1f}")
            rows.append(line)
    print(f"{'case':28s} {'rows':>11s} {'contiguous us/it':>17s} {'grid-stride us/it':>18s}")
    for r in rows:
        print(f"{r[0]:28s} {r[1]:>11s} {r[2]:>17s} {r[3]:>18s}")


if __name__ == "__main__":
    main()
