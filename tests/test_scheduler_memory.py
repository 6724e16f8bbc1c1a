"""solve_many's device memory against what the DeviceManager reserved (BENCHMARKS.md memory targets)."""

from __future__ import annotations

import numpy as np
import pytest

from managed_solve import LinearSystem
from managed_solve.manager import DeviceManager
from managed_solve.scheduler import solve_many
from tests._problems import poisson2d


def test_results_carry_the_reserved_bytes():
    systems = [LinearSystem(poisson2d(m), np.ones(m * m)) for m in (4, 5, 6)]
    dm = DeviceManager(["cpu"])
    res = solve_many(systems, manager=dm, method="cg")
    assert all(r.converged for r in res)
    assert all(r.info["reserved_bytes"] > 8 * r.x.size for r in res)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_gpu_peak_memory_within_10_percent_of_the_reservation(method):
    """Peak pool bytes while one batch is staged, solved and checked vs its reservation."""
    import cupy as cp

    rng = np.random.default_rng(4)
    sizes = rng.integers(32, 65, size=60)
    mats = {int(m): poisson2d(int(m)) for m in set(sizes.tolist())}
    systems = [LinearSystem(mats[int(m)], np.ones(int(m) ** 2), rtol=1e-8, method=method)
               for m in sizes]
    dm = DeviceManager(["cuda:0"])
    solve_many(systems, manager=dm)  # compiles the kernels, creates library handles
    cp.cuda.Device(0).synchronize()
    pool = cp.get_default_memory_pool()
    base = pool.used_bytes()
    peak = [base]

    def tracking_malloc(size):
        mem = pool.malloc(size)
        peak[0] = max(peak[0], pool.used_bytes())
        return mem

    cp.cuda.set_allocator(tracking_malloc)
    try:
        res = solve_many(systems, manager=dm)
        cp.cuda.Device(0).synchronize()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    assert all(r.converged for r in res)
    assert len({r.info["batch"] for r in res}) == 1  # one batch: its reservation is the whole call
    reserved = res[0].info["reserved_bytes"]
    used = peak[0] - base
    assert 0.9 * reserved <= used <= 1.1 * reserved, (used, reserved)
