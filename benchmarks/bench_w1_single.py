"""W1: one large 2D Poisson system, per-iteration time of our batched CG against the anchors.

GPU: ours vs ``cupyx.scipy.sparse.linalg.cg`` at N = 16k, 65k, 4.2M, 16.8M,
float64 and float32. CPU: ours vs ``scipy.sparse.linalg.cg`` at N = 1M (and
65k). Each case runs a fixed number of iterations (tiny rtol, ``maxiter=K``)
and records time per iteration and the fraction of copy bandwidth on the
152-bytes-per-row model (benchmarks/README.md) in ``benchmark.extra_info``; the
copy bandwidth is measured in the same run.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import _backend
from managed_solve.solvers.batched import PackedBatch, cg_batched

TINY = 1e-30  # never reached: every run does exactly maxiter iterations


def poisson2d(m, dtype=np.float64):
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr().astype(dtype)


def model_bytes(n, nnz, itemsize, index_itemsize=4):
    """Fewest bytes one unpreconditioned CG iteration streams (benchmarks/README.md)."""
    return nnz * (itemsize + index_itemsize) + 4 * n + 11 * n * itemsize


def _copy_bandwidth(xp, sync, nbytes=1 << 28):
    a = xp.ones(nbytes // 8)
    b = xp.empty_like(a)
    xp.copyto(b, a)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        xp.copyto(b, a)
    sync()
    return 2 * a.nbytes * 5 / (time.perf_counter() - t0)  # bytes read + written per second


def _gpu_sync():
    _backend.cupy().cuda.Device().synchronize()


def _record(benchmark, *, who, n, nnz, dtype, K, bandwidth, device):
    per_it = benchmark.stats.stats.median / K
    w = np.dtype(dtype).itemsize
    benchmark.extra_info.update(
        who=who, n=n, nnz=nnz, dtype=str(np.dtype(dtype)), iterations=K, device=device,
        seconds_per_iteration=per_it,
        bandwidth_fraction=model_bytes(n, nnz, w) / per_it / bandwidth,
        copy_bandwidth_GBs=bandwidth / 1e9)


# ---------------------------------------------------------------- CPU

CPU_SIZES = [256, 1024]  # N = 65k, 1M


@pytest.fixture(scope="module")
def cpu_bandwidth():
    return _copy_bandwidth(np, lambda: None)


@pytest.mark.parametrize("m", CPU_SIZES)
@pytest.mark.parametrize("who", ["ours", "scipy"])
def bench_w1_cpu(benchmark, cpu_bandwidth, who, m):
    A = poisson2d(m)
    b = np.ones(A.shape[0])
    K = 30
    batch = PackedBatch.from_csr(A, b, rtol=TINY, maxiter=K)
    # Check the answer once (a converged solve), and compile, before timing.
    check = cg_batched(PackedBatch.from_csr(A, b, rtol=1e-6, maxiter=20 * m))
    assert check.status[0] == 0
    assert np.linalg.norm(b - A @ check.x) <= 1.01e-6 * np.linalg.norm(b)
    if who == "ours":
        out = benchmark.pedantic(cg_batched, args=(batch,), rounds=3, iterations=1, warmup_rounds=1)
        assert out.iterations[0] == K
    else:
        benchmark.pedantic(lambda: spla.cg(A, b, rtol=TINY, maxiter=K), rounds=3, iterations=1,
                           warmup_rounds=1)
    import platform

    _record(benchmark, who=who, n=A.shape[0], nnz=A.nnz, dtype=np.float64, K=K,
            bandwidth=cpu_bandwidth, device=platform.processor() or platform.machine())


# ---------------------------------------------------------------- GPU

GPU_SIZES = [128, 256, 2048, 4096]  # N = 16k, 65k, 4.2M, 16.8M


@pytest.fixture(scope="module")
def gpu_bandwidth():
    if not _backend.cuda_usable():
        pytest.skip("needs a usable CUDA GPU")
    return _copy_bandwidth(_backend.cupy(), _gpu_sync)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("m", GPU_SIZES)
@pytest.mark.parametrize("who", ["ours", "ours_solve", "cupyx"])
def bench_w1_gpu(benchmark, gpu_bandwidth, who, m, dtype):
    """``ours``: the batched core; ``ours_solve``: the public ``solve()`` (small sizes),
    whose DeviceManager learns the iteration count in the warm-up round, so the
    timed rounds read the host once (at maxiter)."""
    if who == "ours_solve" and m > 256:
        pytest.skip("solve() is timed at the launch-bound sizes only")
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp
    import cupyx.scipy.sparse.linalg as cspla

    A_h = poisson2d(m, dtype)
    A = csp.csr_matrix(A_h)
    b = cp.ones(A.shape[0], dtype=dtype)
    K = 200 if m <= 256 else 50
    batch = PackedBatch.from_csr(A, b, rtol=TINY, maxiter=K)
    # Check once: the same algorithm, so after K iterations both hold the same iterate.
    x_ours = cg_batched(batch).x
    x_ref = cspla.cg(A, b, rtol=TINY, maxiter=K)[0]
    diff = float(cp.linalg.norm(x_ours - x_ref) / cp.linalg.norm(x_ref))
    assert diff <= (1e-8 if dtype == np.float64 else 1e-2), diff

    def ours():
        out = cg_batched(batch)
        _gpu_sync()
        return out

    def anchor():
        x = cspla.cg(A, b, rtol=TINY, maxiter=K)[0]
        _gpu_sync()
        return x

    from managed_solve import DeviceManager, solve

    dm = DeviceManager(devices=["cuda:0", "cpu"])

    def ours_solve():
        res = solve(A, b, rtol=TINY, maxiter=K, method="cg", device="cuda:0", manager=dm)
        _gpu_sync()
        return res

    fn = {"ours": ours, "ours_solve": ours_solve, "cupyx": anchor}[who]
    out = benchmark.pedantic(fn, rounds=5, iterations=1, warmup_rounds=1)
    if who == "ours":
        assert out.iterations[0] == K
        benchmark.extra_info["host_syncs"] = out.host_syncs
        benchmark.extra_info["checkpoints"] = out.checkpoints
    elif who == "ours_solve":
        assert out.iterations == K
        benchmark.extra_info["host_syncs"] = out.info["host_syncs"]
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    _record(benchmark, who=who, n=A.shape[0], nnz=int(A.nnz), dtype=dtype, K=K,
            bandwidth=gpu_bandwidth, device=name)
