"""One system sharded over two GPUs vs one GPU (issue 7), same run, same code.

Per CG iteration on the 2D 5-point Poisson matrix (N = 64M, n = 8192) and a 3D
7-point one (N = 64M, n = 400): ``ShardedSystem`` on one GPU (one shard: no
halo, the reduction a local copy) against two GPUs; the target is two GPUs at
most 0.55 x one GPU. An instrumented run (CUDA events) gives the time spent in
halo exchanges and all-reduces. Weak scaling: N/2 on one GPU vs N on two.
Anchor: cupyx.scipy.sparse.linalg.cg on one GPU, per iteration.

Measured 2026-11-22 on 2 x H200 (NVLink NV18), CuPy 14.2, float64, 40
iterations (per-iteration times from differenced solves):

| case | cupyx cg, 1 GPU | ours, 1 GPU | ours, 2 GPUs | 2 / 1 | halo, each | all-reduce, each |
| --- | --- | --- | --- | --- | --- | --- |
| 2D 5-pt, N = 67.1M | 4.76 ms | 3.70 ms | 1.90 ms | 0.514 | 12 us | 24 us |
| 3D 7-pt, N = 32.8M | 2.64 ms | 2.11 ms | 1.14 ms | 0.538 | 18 us | 30 us |
| 3D 7-pt, N = 64.0M | 5.06 ms | 4.08 ms | 2.10 ms | 0.514 | 16 us | 25 us |

Weak scaling, 2D, 33.6M rows per GPU: 1.881 ms on one GPU, 1.904 ms on two
(efficiency 0.988). Halo and all-reduce times are per call (one of each per
CG iteration), from CUDA events on the first GPU's streams in an instrumented
solve; the halo copy overlaps the interior product.

Sizes are set by ``MS_BENCH_SHARDED_N2D`` / ``MS_BENCH_SHARDED_N3D`` (grid
side), to run smaller on smaller cards. Run: ``cd benchmarks && python -m
pytest bench_sharded.py``.
"""

from __future__ import annotations

import functools
import gc
import os
import time

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import _backend
from managed_solve.sharded import ShardedSystem

pytestmark = pytest.mark.multi_gpu

N2D = int(os.environ.get("MS_BENCH_SHARDED_N2D", "8192"))
N3D = int(os.environ.get("MS_BENCH_SHARDED_N3D", "400"))
ITERS = int(os.environ.get("MS_BENCH_SHARDED_ITERS", "40"))


@functools.lru_cache(maxsize=3)
def grid_laplacian(shape: tuple[int, ...]) -> sp.csr_matrix:
    """5-point (2D) or 7-point (3D) Dirichlet Laplacian, built row by row without kron.

    kron at N = 64M builds int64 COO triplets (~8 GB) first; this builds the
    CSR arrays directly (int32 candidates, one mask).
    """
    N = int(np.prod(shape))
    strides = np.cumprod((1,) + shape[::-1][:-1])[::-1]  # C order: last axis fastest
    idx = np.arange(N, dtype=np.int64)
    coords = np.unravel_index(idx, shape)
    offs, masks = [], []
    for ax in range(len(shape) - 1, -1, -1):  # farthest neighbours first, so columns ascend
        offs.append(-int(strides[ax]))
        masks.append(coords[ax] > 0)
    offs.append(0)
    masks.append(np.ones(N, dtype=bool))
    for ax in range(len(shape)):
        offs.append(int(strides[ax]))
        masks.append(coords[ax] < shape[ax] - 1)
    order = np.argsort(offs)
    offs = [offs[i] for i in order]
    masks = np.stack([masks[i] for i in order], axis=1)  # (N, 2d+1)
    del coords
    cols = idx[:, None].astype(np.int32) + np.asarray(offs, dtype=np.int32)[None, :]
    vals = np.where(np.asarray(offs)[None, :] == 0, 2.0 * len(shape), -1.0)
    indptr = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(masks.sum(axis=1), out=indptr[1:])
    indices = cols[masks]
    data = np.broadcast_to(vals, masks.shape)[masks]
    return sp.csr_matrix((data, indices, indptr.astype(np.int32)), shape=(N, N))


def _free_gpu_memory():
    gc.collect()
    cp = _backend.cupy()
    for i in range(_backend.cuda_probe()[0]):
        with cp.cuda.Device(i):
            cp.get_default_memory_pool().free_all_blocks()


@pytest.fixture(autouse=True)
def _release_between_cases():
    yield
    if _backend.cuda_probe()[0]:
        _free_gpu_memory()


def _gpus():
    n = _backend.cuda_probe()[0]
    if n < 2:
        pytest.skip("needs two usable CUDA GPUs")
    from managed_solve.manager import DeviceManager

    return DeviceManager()


def _timed_solve(system: ShardedSystem, b, iters: int, profile: bool = False):
    t0 = time.perf_counter()
    res = system.solve(b, rtol=0.0, maxiter=iters, check_every=iters, gather_to=False,
                       profile=profile)
    return time.perf_counter() - t0, res  # solve() ends with a synchronise of every device


def _per_iteration(system: ShardedSystem, b, iters: int, *, profile: bool = False):
    """Seconds per CG iteration (rtol 0: never stops early).

    The difference of a solve of ``10 + iters`` and one of 10 iterations, so
    the per-solve work (scattering b, the true residual) cancels out.
    """
    system.solve(b, rtol=0.0, maxiter=2, check_every=2)  # warm: kernels, cuSPARSE handles
    short, _ = _timed_solve(system, b, 10)
    long, res = _timed_solve(system, b, 10 + iters, profile=profile)
    return (long - short) / iters, res


def _cupyx_anchor(A, iters: int) -> float:
    cp = _backend.cupy()
    from cupyx.scipy.sparse import csr_matrix
    from cupyx.scipy.sparse.linalg import cg

    with cp.cuda.Device(0):
        Ad = csr_matrix(A)
        bd = cp.ones(A.shape[0])
        def timed(k):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            cg(Ad, bd, rtol=0.0, maxiter=k)
            cp.cuda.Device().synchronize()
            return time.perf_counter() - t0

        timed(2)
        out = (timed(10 + iters) - timed(10)) / iters
        del timed
    _free_gpu_memory()
    return out


@pytest.mark.parametrize("case", ["2d5pt", "3d7pt"])
def bench_sharded_cg_two_gpus(benchmark, case):
    dm = _gpus()
    shape = (N2D, N2D) if case == "2d5pt" else (N3D, N3D, N3D)
    A = grid_laplacian(shape)
    N = A.shape[0]
    cp = _backend.cupy()
    with cp.cuda.Device(0):
        b = cp.ones(N)  # on the first GPU: scattered by device copies, not from the host

    # Check the answer once before timing, on a small copy of the problem.
    small = grid_laplacian(tuple(min(s, 40) for s in shape))
    Ss = ShardedSystem(small, dm.accelerators[:2], reorder=None, manager=dm)
    rs = Ss.solve(np.ones(small.shape[0]), rtol=1e-8)
    assert rs.converged and rs.relative_residual <= 1e-8

    info = {"N": N, "nnz": int(A.nnz), "dtype": "float64", "iters": ITERS,
            "device": dm.accelerators[0].name}
    anchor = _cupyx_anchor(A, ITERS)
    info["cupyx_cg_1gpu_ms_per_iter"] = anchor * 1e3

    one = ShardedSystem(A, dm.accelerators[:1], reorder=None, manager=dm)
    t1, _ = _per_iteration(one, b, ITERS)
    info["ours_1gpu_ms_per_iter"] = t1 * 1e3
    del one
    _free_gpu_memory()

    two = ShardedSystem(A, dm.accelerators[:2], reorder=None, manager=dm)
    info["setup_seconds_2gpu"] = two.setup_seconds
    info["halo_sizes"] = two.partition.halo_sizes().tolist()
    t2, _ = _per_iteration(two, b, ITERS)
    _, prof = _timed_solve(two, b, ITERS, profile=True)
    info["ours_2gpu_ms_per_iter"] = t2 * 1e3
    info["ratio_2gpu_over_1gpu"] = t2 / t1
    info["target_ratio"] = 0.55
    p = prof.info["profile"]
    # Per exchange / per all-reduce (CG makes one of each per iteration).
    info["halo_ms_each"] = p["halo_ms"] / max(p["halo_count"], 1)
    info["reduce_ms_each"] = p["reduce_ms"] / max(p["reduce_count"], 1)

    def run():
        two.solve(b, rtol=0.0, maxiter=ITERS, check_every=ITERS, gather_to=False)

    benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info.update(info)
    print(f"\n{case}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in info.items()))


@pytest.mark.parametrize("case", ["2d5pt"])
def bench_sharded_weak_scaling(benchmark, case):
    """N/2 on one GPU vs N on two: per-iteration times should match within 10%."""
    dm = _gpus()
    cp = _backend.cupy()
    half = grid_laplacian((N2D // 2, N2D))
    full = grid_laplacian((N2D, N2D))
    one = ShardedSystem(half, dm.accelerators[:1], reorder=None, manager=dm)
    with cp.cuda.Device(0):
        bh = cp.ones(half.shape[0])
        bf = cp.ones(full.shape[0])
    t1, _ = _per_iteration(one, bh, ITERS)
    del one
    _free_gpu_memory()
    two = ShardedSystem(full, dm.accelerators[:2], reorder=None, manager=dm)
    t2, _ = _per_iteration(two, bf, ITERS)
    info = {"N_per_gpu": half.shape[0], "ms_per_iter_1gpu": t1 * 1e3,
            "ms_per_iter_2gpu": t2 * 1e3, "weak_efficiency": t1 / t2, "target": 0.9,
            "device": dm.accelerators[0].name}

    def run():
        two.solve(bf, rtol=0.0, maxiter=ITERS, check_every=ITERS, gather_to=False)

    benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info.update(info)
    print(f"\nweak {case}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in info.items()))
