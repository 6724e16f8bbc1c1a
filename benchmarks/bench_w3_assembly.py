"""W3: numeric assembly of the cotangent Laplacian + lumped mass on an icosphere.

Ours (one kernel pass into a cached CSR pattern) against the vectorised
anchor a user would write (triplets in NumPy/CuPy, then COO -> CSR in
SciPy/cupyx), timed in the same run; the symbolic phase is timed apart.
Sizes: ``MANAGED_SOLVE_W3_CPU_K`` (default 7; 8 is the 1.31M-triangle
figure of benchmarks/README.md) and ``MANAGED_SOLVE_W3_GPU_K`` (default 9, 5.24M
triangles). The matrix assembled is ``A = L + D`` (stiffness plus lumped
mass), float64, int32 indices.
"""

from __future__ import annotations

import os
import platform

import numpy as np
import pytest

from managed_solve import assembly
from managed_solve.mesh import icosphere

CPU_K = int(os.environ.get("MANAGED_SOLVE_W3_CPU_K", "7"))
GPU_K = int(os.environ.get("MANAGED_SOLVE_W3_GPU_K", "9"))
_meshes: dict = {}
_times: dict = {}


def _mesh(k):
    if k not in _meshes:
        _meshes[k] = icosphere(k)
    return _meshes[k]


def anchor_assemble(xp, sparse, V, F):
    """L + D from 15 triplets per triangle and one COO -> CSR conversion (vectorised, the usual way)."""
    i, j, k = F[:, 0], F[:, 1], F[:, 2]

    def cot(a, b, c):
        u, v = V[b] - V[a], V[c] - V[a]
        cr = xp.cross(u, v)
        return (u * v).sum(axis=1) / xp.sqrt((cr * cr).sum(axis=1))

    wk, wi, wj = 0.5 * cot(k, i, j), 0.5 * cot(i, j, k), 0.5 * cot(j, k, i)
    cr = xp.cross(V[j] - V[i], V[k] - V[i])
    third = xp.sqrt((cr * cr).sum(axis=1)) / 6.0
    rows = xp.concatenate([i, j, j, k, k, i, i, j, j, k, k, i, i, j, k])
    cols = xp.concatenate([j, i, k, j, i, k, i, j, j, k, k, i, i, j, k])
    vals = xp.concatenate([-wk, -wk, -wi, -wi, -wj, -wj, wk, wk, wi, wi, wj, wj, third, third, third])
    n = V.shape[0]
    return sparse.coo_matrix((vals, (rows, cols)), shape=(n, n)).tocsr()


def _record(benchmark, name, k, device):
    m = _mesh(k)
    role = "anchor" if "anchor" in name else ("reported" if "symbolic" in name else "ours")
    benchmark.extra_info.update(
        n_vertices=m.n_vertices, n_triangles=m.n_faces, dtype="float64", index_dtype="int32",
        device=device, subdivisions=k, role=role,
    )
    _times[name] = benchmark


def _gpu():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        import cupyx.scipy.sparse  # noqa: F401
    except Exception as exc:  # CUDARuntimeError without a driver, a broken cupyx
        pytest.skip(f"no usable CUDA GPU ({exc})")
    return cp


# ------------------------------------------------------------------- CPU
@pytest.mark.benchmark(group="w3-cpu")
def test_cpu_symbolic(benchmark):
    m = _mesh(CPU_K)
    assembly.symbolic(m)  # JIT warm-up

    def setup():
        m._cache.clear()
        return (), {}

    benchmark.pedantic(lambda: assembly.symbolic(m), setup=setup, rounds=5)
    _record(benchmark, "cpu_symbolic", CPU_K, f"cpu ({platform.processor() or 'host'}, {os.cpu_count()} cores)")


@pytest.mark.benchmark(group="w3-cpu")
def test_cpu_numeric_ours(benchmark):
    m = _mesh(CPU_K)
    ref = anchor_assemble(np, __import__("scipy.sparse").sparse, m.vertices, m.faces)
    A = assembly.assemble(m, stiffness=1.0, lumped_mass=1.0)  # warm-up and check
    assert abs(A - ref).max() <= 1e-12 * abs(ref).max()
    benchmark(lambda: assembly.assemble(m, stiffness=1.0, lumped_mass=1.0))
    _record(benchmark, "cpu_ours", CPU_K, "cpu")


@pytest.mark.benchmark(group="w3-cpu")
def test_cpu_anchor_numpy_scipy(benchmark):
    import scipy.sparse as sp

    m = _mesh(CPU_K)
    V, F = m.vertices, m.faces
    benchmark.pedantic(lambda: anchor_assemble(np, sp, V, F), rounds=3, warmup_rounds=1)
    _record(benchmark, "cpu_anchor", CPU_K, "cpu")
    ours = _times.get("cpu_ours")
    if ours is not None:
        ratio = benchmark.stats.stats.median / ours.stats.stats.median
        benchmark.extra_info["speedup_ours_vs_anchor"] = ratio
        print(f"\nW3 CPU k={CPU_K}: ours {ours.stats.stats.median * 1e3:.1f} ms, anchor "
              f"{benchmark.stats.stats.median * 1e3:.1f} ms, speed-up {ratio:.1f}x (target >= 10x)")


# ------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.benchmark(group="w3-gpu")
def test_gpu_symbolic(benchmark):
    cp = _gpu()
    m = _mesh(GPU_K)
    assembly.symbolic(m, device="cuda:0")

    def setup():
        m._cache.clear()
        return (), {}

    def run():
        assembly.symbolic(m, device="cuda:0")
        cp.cuda.get_current_stream().synchronize()

    benchmark.pedantic(run, setup=setup, rounds=3)
    _record(benchmark, "gpu_symbolic", GPU_K, cp.cuda.runtime.getDeviceProperties(0)["name"].decode())


@pytest.mark.gpu
@pytest.mark.benchmark(group="w3-gpu")
def test_gpu_numeric_ours(benchmark):
    cp = _gpu()
    m = _mesh(GPU_K)
    A = assembly.assemble(m, stiffness=1.0, lumped_mass=1.0, device="cuda:0")
    import cupyx.scipy.sparse as csp

    ref = anchor_assemble(cp, csp, cp.asarray(m.vertices), cp.asarray(m.faces))
    ref.sort_indices()
    assert cp.array_equal(ref.indices, A.indices)
    assert float(cp.abs(ref.data - A.data).max()) <= 1e-12 * float(cp.abs(ref.data).max())
    del ref

    def run():
        assembly.assemble(m, stiffness=1.0, lumped_mass=1.0, device="cuda:0")
        cp.cuda.get_current_stream().synchronize()  # sync: end of the timed call

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    _record(benchmark, "gpu_ours", GPU_K, cp.cuda.runtime.getDeviceProperties(0)["name"].decode())


@pytest.mark.gpu
@pytest.mark.benchmark(group="w3-gpu")
def test_gpu_anchor_cupy(benchmark):
    cp = _gpu()
    import cupyx.scipy.sparse as csp

    m = _mesh(GPU_K)
    V, F = cp.asarray(m.vertices), cp.asarray(m.faces)

    def run():
        anchor_assemble(cp, csp, V, F)
        cp.cuda.get_current_stream().synchronize()  # sync: end of the timed call

    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    _record(benchmark, "gpu_anchor", GPU_K, cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    ours = _times.get("gpu_ours")
    if ours is not None:
        ratio = ours.stats.stats.median / benchmark.stats.stats.median
        benchmark.extra_info["time_ratio_ours_over_anchor"] = ratio
        print(f"\nW3 GPU k={GPU_K}: ours {ours.stats.stats.median * 1e3:.2f} ms, anchor "
              f"{benchmark.stats.stats.median * 1e3:.2f} ms, ratio {ratio:.3f} (target <= 0.1)")
