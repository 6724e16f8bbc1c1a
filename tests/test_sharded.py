"""One system sharded over several devices: simulated GPUs here, real ones with multi_gpu.

Every test runs the same code path on simulated devices (NumPy arrays, copies
for the exchange) and, marked ``multi_gpu``, on two real GPUs (CuPy, peer
copies on copy streams, events).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import partition, sharded
from managed_solve.manager import DeviceManager
from managed_solve.result import Status


# ---------------------------------------------------------------- matrices
def poisson2d(n: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    return (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()


def poisson3d(n: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    I = sp.eye(n)
    return (sp.kron(sp.kron(I, I), T) + sp.kron(sp.kron(I, T), I)
            + sp.kron(sp.kron(T, I), I)).tocsr()


def random_spd(n: int, seed: int = 0) -> sp.csr_matrix:
    """Random sparse SPD: symmetric pattern, strictly diagonally dominant, varied diagonal."""
    R = sp.random(n, n, density=4.0 / n, random_state=seed, format="csr")
    S = R + R.T
    d = np.asarray(abs(S).sum(axis=1)).ravel() + np.random.default_rng(seed).uniform(0.5, 5, n)
    return (S + sp.diags(d)).tocsr()


def convection_diffusion(n: int) -> sp.csr_matrix:
    """2D diffusion plus upwind convection: non-symmetric, non-singular."""
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    C = sp.diags([-1.0, 1.0], [-1, 0], shape=(n, n))
    I = sp.eye(n)
    return (sp.kron(I, T) + sp.kron(T, I) + 0.8 * sp.kron(I, C) + 0.3 * sp.kron(C, I)).tocsr()


MATRICES = {
    "poisson2d": lambda: poisson2d(20),
    "poisson3d": lambda: poisson3d(8),
    "random_spd": lambda: random_spd(300, seed=1),
}


# ---------------------------------------------------------------- devices
def _real_gpu_manager():
    from managed_solve import _backend

    if _backend.cuda_probe()[0] < 2:
        pytest.skip("needs two usable CUDA GPUs")
    return DeviceManager()


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.multi_gpu)])
def kind(request):
    return request.param


def devices_for(kind: str, nshards: int):
    """(devices, manager): ``nshards`` simulated GPUs, or that many real ones."""
    if kind == "sim":
        dm = DeviceManager(simulate="3x1GiB")
    else:
        dm = _real_gpu_manager()
    if len(dm.accelerators) < nshards:
        pytest.skip(f"needs {nshards} devices of kind {kind}")
    return dm.accelerators[:nshards], dm


def host(x):
    from managed_solve import _backend

    return np.asarray(_backend.to_host(x))


@pytest.fixture(autouse=True)
def _fresh_cache():
    sharded.clear_cache()
    yield
    sharded.clear_cache()


# ---------------------------------------------------------------- solutions
@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("nshards", [2, 3])
@pytest.mark.parametrize("reorder", ["rcm", None])
def test_cg_matches_single_device(kind, name, nshards, reorder):
    A = MATRICES[name]()
    devs, dm = devices_for(kind, nshards)
    rng = np.random.default_rng(7)
    b = rng.standard_normal(A.shape[0])
    ref = spla.spsolve(A.tocsc(), b)
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-10, reorder=reorder)
    assert res.status is Status.CONVERGED, res.message
    assert res.info["shards"] == nshards
    assert res.device == str(devs[0])
    x = host(res.x)
    assert np.linalg.norm(x - ref) <= 1e-7 * np.linalg.norm(ref)
    assert res.relative_residual <= 1e-10 * 1.01
    # Chronopoulos-Gear CG converges like textbook CG (scipy's) on these systems.
    its = []
    spla.cg(A, b, rtol=1e-10, callback=lambda xk: its.append(1))
    assert abs(res.info["converged_at"] - len(its)) <= max(2, 0.05 * len(its))


@pytest.mark.parametrize("weights, offsets", [([1.0, 3.0], None), (None, [0, 37, 400])])
def test_uneven_partitions(kind, weights, offsets):
    A = poisson2d(20)
    devs, dm = devices_for(kind, 2)
    b = np.ones(A.shape[0])
    if offsets is None:
        S = sharded.ShardedSystem(A, devs, manager=dm, weights=weights)
        nnz = S.partition.nnz_per_shard()
        assert abs(nnz[1] / nnz.sum() - 0.75) < 0.02
    else:
        S = sharded.ShardedSystem(A, devs, manager=dm, reorder=None, offsets=offsets)
        assert S.partition.offsets.tolist() == offsets
    res = S.solve(b, rtol=1e-10)
    assert res.converged
    assert np.allclose(host(res.x), spla.spsolve(A.tocsc(), b), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("nshards", [2, 3])
def test_distributed_spmv_is_exact(kind, nshards):
    # Integer entries and vector: every partial sum is exact in float64, so
    # the split product (interior, then boundary after the halo) must equal
    # A @ x bit for bit if the halo maps are right.
    rng = np.random.default_rng(5)
    A = sp.random(200, 200, density=0.05, random_state=2, format="csr",
                  data_rvs=lambda k: rng.integers(-9, 10, k).astype(float))
    A = (A + sp.eye(200)).tocsr()
    x = rng.integers(-50, 50, 200).astype(float)
    devs, dm = devices_for(kind, nshards)
    for reorder in ("rcm", None):
        S = sharded.ShardedSystem(A, devs, manager=dm, reorder=reorder)
        assert S.partition.halo_sizes().sum() > 0
        assert np.array_equal(host(S.matvec(x)), A @ x)


def test_bicgstab_nonsymmetric(kind):
    A = convection_diffusion(16)
    devs, dm = devices_for(kind, 2)
    b = np.random.default_rng(2).standard_normal(A.shape[0])
    ref = spla.spsolve(A.tocsc(), b)
    for M in (None, "jacobi"):
        res = sharded.solve_sharded(A, b, devices=devs, manager=dm, method="bicgstab",
                                    rtol=1e-10, M=M)
        assert res.converged, res.message
        assert np.linalg.norm(host(res.x) - ref) <= 1e-7 * np.linalg.norm(ref)


def test_jacobi_cg_on_varied_diagonal(kind):
    A = random_spd(300, seed=4)
    devs, dm = devices_for(kind, 2)
    b = np.random.default_rng(1).standard_normal(300)
    plain = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-10)
    jac = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-10, M="jacobi")
    assert plain.converged and jac.converged
    ref = spla.spsolve(A.tocsc(), b)
    assert np.linalg.norm(host(jac.x) - ref) <= 1e-8 * np.linalg.norm(ref)
    # Same iteration count as scipy's Jacobi-preconditioned CG.
    its = []
    dinv = 1.0 / A.diagonal()
    spla.cg(A, b, rtol=1e-10, M=sp.diags(dinv), callback=lambda xk: its.append(1))
    assert abs(jac.info["converged_at"] - len(its)) <= 2


def test_x0_exact_solution_takes_no_iteration(kind):
    A = poisson2d(12)
    devs, dm = devices_for(kind, 2)
    x_true = np.linspace(0, 1, A.shape[0])
    b = A @ x_true
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, x0=x_true, rtol=1e-8)
    assert res.converged and res.iterations == 0
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, x0=0.5 * x_true, rtol=1e-10)
    assert res.converged and res.iterations > 0
    assert np.allclose(host(res.x), x_true, atol=1e-8)


def test_cached_setup_is_reused(kind, monkeypatch):
    A = poisson2d(15)
    devs, dm = devices_for(kind, 2)
    calls = []
    real = partition.build_partition
    monkeypatch.setattr(partition, "build_partition",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    r1 = sharded.solve_sharded(A, np.ones(225), devices=devs, manager=dm, rtol=1e-10)
    r2 = sharded.solve_sharded(A, np.arange(225.0), devices=devs, manager=dm, rtol=1e-10)
    assert len(calls) == 1
    assert np.allclose(A @ host(r2.x), np.arange(225.0), atol=1e-7)
    assert r1.converged and r2.converged
    # Another reordering is another set-up; another matrix object too.
    sharded.solve_sharded(A, np.ones(225), devices=devs, manager=dm, reorder=None)
    assert len(calls) == 2
    sharded.solve_sharded(A.copy(), np.ones(225), devices=devs, manager=dm, reorder=None)
    assert len(calls) == 3


def test_gather_targets(kind):
    A = poisson2d(10)
    devs, dm = devices_for(kind, 2)
    b = np.ones(100)
    ref = spla.spsolve(A.tocsc(), b)
    S = sharded.ShardedSystem(A, devs, manager=dm)
    dist = S.solve(b, rtol=1e-10, gather_to=False)
    assert dist.device == "distributed"
    assert isinstance(dist.x, sharded.DistributedVector)
    assert np.allclose(host(dist.x.gather()), ref, atol=1e-8)
    on_host = S.solve(b, rtol=1e-10, gather_to="cpu")
    assert isinstance(on_host.x, np.ndarray) and on_host.device == "cpu"
    assert np.allclose(on_host.x, ref, atol=1e-8)
    last = S.solve(b, rtol=1e-10, gather_to=devs[-1])
    assert last.device == str(devs[-1])
    if kind == "cuda":
        assert int(last.x.device.id) == devs[-1].index


def test_statuses(kind):
    A = poisson2d(12)
    devs, dm = devices_for(kind, 2)
    b = np.ones(144)
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, maxiter=3, check_every=1)
    assert res.status is Status.MAXITER and res.iterations == 3
    assert res.relative_residual > 1e-3
    neg = sharded.solve_sharded(-A, b, devices=devs, manager=dm, check_every=1)
    assert neg.status is Status.BREAKDOWN
    assert "positive definite" in neg.message


# ---------------------------------------------------------------- GPU-only checks
@pytest.mark.multi_gpu
def test_gpu_result_location_and_host_syncs():
    cp = pytest.importorskip("cupy")
    devs, dm = devices_for("cuda", 2)
    A = poisson2d(64)
    b = cp.ones(A.shape[0])  # b on the GPU: scattered by peer copies
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-9)
    assert res.converged
    assert isinstance(res.x, cp.ndarray) and res.x.device.id == devs[0].index
    ref = spla.spsolve(A.tocsc(), np.ones(A.shape[0]))
    assert np.allclose(res.x.get(), ref, rtol=1e-7)
    # One read every GPU_CHECK_EVERY iterations, plus the start and the true residual.
    assert res.info["host_syncs"] <= res.iterations // sharded.GPU_CHECK_EVERY + 3


# ---------------------------------------------------------------- errors
def test_device_argument_errors():
    dm = DeviceManager(simulate="2x1GiB")
    A, b = poisson2d(6), np.ones(36)
    with pytest.raises(ValueError, match=r"devices=\[\].*at least one device"):
        sharded.solve_sharded(A, b, devices=[], manager=dm)
    with pytest.raises(ValueError, match="name the devices"):
        sharded.solve_sharded(A, b, devices=None, manager=dm)
    with pytest.raises(ValueError, match="appears twice"):
        sharded.solve_sharded(A, b, devices=["sim:0", "sim:0"], manager=dm)
    with pytest.raises(ValueError, match="not a GPU.*device='cpu'"):
        sharded.solve_sharded(A, b, devices=["sim:0", "cpu"], manager=dm)
    with pytest.raises(ValueError, match="sim:7.*simulate"):
        sharded.solve_sharded(A, b, devices=["sim:0", "sim:7"], manager=dm)
    with pytest.raises(ValueError, match="between 1 and 2"):
        sharded.solve_sharded(A, b, devices=5, manager=dm)
    with pytest.raises(TypeError, match="expected 'all'"):
        sharded.solve_sharded(A, b, devices=1.5, manager=dm)
    with pytest.raises(TypeError, match="entry 3"):
        sharded.solve_sharded(A, b, devices=[3], manager=dm)
    cpu_only = DeviceManager(devices=["cpu"])
    with pytest.raises(RuntimeError, match="no GPU.*MANAGED_SOLVE_SIMULATE"):
        sharded.solve_sharded(A, b, devices="all", manager=cpu_only)
    # The string forms work: "all" and a comma list.
    assert sharded.solve_sharded(A, b, devices="sim:0,sim:1", manager=dm).converged
    assert sharded.solve_sharded(A, b, devices="all", manager=dm).info["shards"] == 2


def test_input_errors():
    dm = DeviceManager(simulate="2x1GiB")
    A, b = poisson2d(6), np.ones(36)
    with pytest.raises(ValueError, match=r"shape \(36,\)"):
        sharded.solve_sharded(A, np.ones(35), devices="all", manager=dm)
    with pytest.raises(ValueError, match="method='gmres'"):
        sharded.solve_sharded(A, b, devices="all", manager=dm, method="gmres")
    with pytest.raises(ValueError, match="M=None or M='jacobi'"):
        sharded.solve_sharded(A, b, devices="all", manager=dm, M="ilu")
    with pytest.raises(ValueError, match="square"):
        sharded.solve_sharded(sp.random(4, 5, density=0.5, format="csr"), np.ones(4),
                              devices="all", manager=dm)
    with pytest.raises(TypeError, match="sparse matrix"):
        sharded.solve_sharded([[1.0]], np.ones(1), devices="all", manager=dm)
    with pytest.raises(ValueError, match="at most one device per row"):
        sharded.solve_sharded(sp.eye(1, format="csr"), np.ones(1), devices="all", manager=dm)
    with pytest.raises(ValueError, match="gather_to"):
        sharded.solve_sharded(A, b, devices="all", manager=dm, gather_to="sim:9")
    Z = poisson2d(6).tolil()
    Z[3, 3] = 0.0
    with pytest.raises(ValueError, match="zero on its diagonal"):
        sharded.solve_sharded(Z.tocsr(), b, devices="all", manager=dm, M="jacobi")


def test_simulated_device_too_small():
    dm = DeviceManager(simulate="2x64KiB")
    A = poisson2d(40)
    with pytest.raises(RuntimeError, match="shard over more devices"):
        sharded.ShardedSystem(A, "all", manager=dm)


def test_float32_system(kind):
    # float32 takes the generic (non-fused) scalar and dot path on GPUs.
    A = poisson2d(16)
    devs, dm = devices_for(kind, 2)
    b = np.ones(256)
    S = sharded.ShardedSystem(A, devs, manager=dm, dtype=np.float32)
    res = S.solve(b, rtol=1e-5)
    assert res.converged and host(res.x).dtype == np.float32
    ref = spla.spsolve(A.tocsc(), b)
    assert np.linalg.norm(host(res.x) - ref) <= 1e-4 * np.linalg.norm(ref)
    with pytest.raises(TypeError, match="float32 or float64"):
        sharded.ShardedSystem(A, devs, manager=dm, dtype=np.int64)
