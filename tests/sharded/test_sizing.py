"""How many devices a system needs, and the bytes of each shard."""

from __future__ import annotations

import pytest

from managed_solve import sharded
from managed_solve.manager import DeviceManager
from managed_solve.sharded import sizing
from tests._problems import poisson2d


def test_choose_shard_count_and_needs_sharding():
    G = 1 << 30
    assert sizing.choose_shard_count(G, [4 * G, 4 * G]) == 1
    assert sizing.choose_shard_count(5 * G, [4 * G, 4 * G, 4 * G]) == 2
    assert sizing.choose_shard_count(9 * G, [4 * G, 4 * G, 4 * G]) == 3
    assert sizing.choose_shard_count(13 * G, [4 * G, 4 * G, 4 * G]) == 0
    # The halo margin: exactly the sum of two devices does not fit on two.
    assert sizing.choose_shard_count(8 * G, [4 * G, 4 * G, 4 * G]) == 3
    assert sizing.needs_sharding(5 * G, [4 * G, 4 * G])
    assert not sizing.needs_sharding(3 * G, [4 * G, 4 * G])
    assert not sizing.needs_sharding(5 * G, [4 * G])  # one device: nothing to shard over


def test_predict_shard_bytes_matches_the_solver_arrays():
    A = poisson2d(40)
    S = sharded.ShardedSystem(A, "all", reorder=None, manager=DeviceManager(simulate="2x1GiB"))
    csr = max(s.nbytes for s in S.shards)
    vectors = 6 * max(s.nloc for s in S.shards) * 8
    pred = sizing.predict_shard_bytes(A.shape[0], A.nnz, 2)
    assert csr + vectors <= pred <= 1.1 * (csr + vectors)
    assert sizing.predict_shard_bytes(A.shape[0], A.nnz, 2, method="bicgstab") > pred
    with pytest.raises(ValueError, match="method"):
        sizing.predict_shard_bytes(10, 10, 2, method="gmres")
