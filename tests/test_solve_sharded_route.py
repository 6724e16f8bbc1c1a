"""solve(A, b, devices=...) / device="all" shards one system (same answer as one device)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import DeviceManager, solve
from tests._problems import poisson2d


@pytest.mark.parametrize("how", ["all", "list"])
def test_sharded_route_matches_direct_solve(how):
    dm = DeviceManager(simulate="3x1GiB")
    A = poisson2d(24)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    kw = {"device": "all"} if how == "all" else {"devices": ["sim:0", "sim:2"]}
    res = solve(A, b, rtol=1e-10, manager=dm, **kw)
    assert res.converged and res.method == "cg"
    np.testing.assert_allclose(res.to_numpy(), spla.spsolve(A.tocsc(), b), rtol=1e-7, atol=1e-9)


def test_sharded_route_nonsymmetric_picks_bicgstab():
    dm = DeviceManager(simulate="2x1GiB")
    A = (poisson2d(16) + sp.diags([0.3], [1], shape=(256, 256))).tocsr()
    b = np.ones(256)
    res = solve(A, b, devices="all", manager=dm, rtol=1e-10)
    assert res.converged and res.method == "bicgstab"
    assert np.linalg.norm(A @ res.to_numpy() - b) <= 1e-8 * np.linalg.norm(b)


def test_sharded_route_rejects_unshardable_method():
    dm = DeviceManager(simulate="2x1GiB")
    with pytest.raises(ValueError, match="cannot be sharded"):
        solve(poisson2d(8), np.ones(64), devices="all", method="gmres", manager=dm)
