"""The set-up cache: one ShardedSystem per live matrix object and set-up arguments."""

from __future__ import annotations

import numpy as np

from managed_solve import config, sharded
from tests._problems import host, poisson2d


def test_cached_setup_is_reused(kind, devices_for):
    A = poisson2d(15)
    devs, dm = devices_for(kind, 2)
    r1 = sharded.solve_sharded(A, np.ones(225), devices=devs, manager=dm, rtol=1e-10)
    r2 = sharded.solve_sharded(A, np.arange(225.0), devices=devs, manager=dm, rtol=1e-10)
    assert sharded.cache_info() == (1, 1, 1)  # one set-up (one partition), reused once
    assert np.allclose(A @ host(r2.x), np.arange(225.0), atol=1e-7)
    assert r1.converged and r2.converged
    # Another reordering is another set-up; another matrix object too.
    sharded.solve_sharded(A, np.ones(225), devices=devs, manager=dm, reorder=None)
    assert sharded.cache_info().misses == 2
    sharded.solve_sharded(A.copy(), np.ones(225), devices=devs, manager=dm, reorder=None)
    assert sharded.cache_info().misses == 3


def test_the_cache_can_be_turned_off_and_forgets_dead_matrices(devices_for):
    devs, dm = devices_for("sim", 2)
    A = poisson2d(8)
    with config.override(sharded_cache=False):
        first = sharded.sharded_system(A, devs, manager=dm)
        assert sharded.sharded_system(A, devs, manager=dm) is not first
    assert sharded.cache_info() == (0, 0, 0)
    sharded.solve_sharded(A, np.ones(64), devices=devs, manager=dm)
    assert sharded.cache_info().size == 1
    del A
    assert sharded.cache_info().size == 0
    sharded.clear_cache()
    assert sharded.cache_info() == (0, 0, 0)
