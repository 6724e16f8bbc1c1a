"""ShardedSystem: shards on devices, the distributed product, scatter and gather, new values."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import sharded
from managed_solve.manager import DeviceManager
from tests._problems import host, poisson2d


@pytest.mark.parametrize("weights, offsets", [([1.0, 3.0], None), (None, [0, 37, 400])])
def test_uneven_partitions(kind, devices_for, weights, offsets):
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


def _integer_matrix(rng):
    A = sp.random(200, 200, density=0.05, random_state=2, format="csr",
                  data_rvs=lambda k: rng.integers(-9, 10, k).astype(float))
    return (A + sp.eye(200)).tocsr()


@pytest.mark.parametrize("nshards", [2, 3])
def test_distributed_spmv_is_exact(kind, devices_for, nshards):
    # Integer entries and vector: every partial sum is exact in float64, so
    # the split product (interior, then boundary after the halo) must equal
    # A @ x bit for bit if the halo maps are right.
    rng = np.random.default_rng(5)
    A = _integer_matrix(rng)
    x = rng.integers(-50, 50, 200).astype(float)
    devs, dm = devices_for(kind, nshards)
    for reorder in ("rcm", None):
        S = sharded.ShardedSystem(A, devs, manager=dm, reorder=reorder)
        assert S.partition.halo_sizes().sum() > 0
        assert np.array_equal(host(S.matvec(x)), A @ x)


def test_with_values_keeps_the_layout_and_the_original(kind, devices_for):
    rng = np.random.default_rng(8)
    A = _integer_matrix(rng)
    A2 = A.copy()
    A2.data = rng.integers(-9, 10, A2.nnz).astype(float)
    x = rng.integers(-50, 50, 200).astype(float)
    devs, dm = devices_for(kind, 3)
    S = sharded.ShardedSystem(A, devs, manager=dm)
    S2 = S.with_values(A2)
    assert np.array_equal(host(S2.matvec(x)), A2 @ x)
    assert np.array_equal(host(S.matvec(x)), A @ x)
    assert S2.partition.perm is S.partition.perm
    with pytest.raises(ValueError, match="pattern differs"):
        S.with_values((A + sp.eye(200, k=150)).tocsr())


def test_gather_targets(kind, devices_for):
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


def test_simulated_device_too_small():
    dm = DeviceManager(simulate="2x64KiB")
    A = poisson2d(40)
    with pytest.raises(MemoryError, match="shard over more devices"):
        sharded.ShardedSystem(A, "all", manager=dm)


def test_float32_system(kind, devices_for):
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
