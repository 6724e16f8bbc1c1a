"""The device argument of a sharded solve: every wrong form gets a message naming the fix."""

from __future__ import annotations

import numpy as np
import pytest

from managed_solve import sharded
from managed_solve.manager import DeviceManager
from tests._problems import poisson2d


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
    with pytest.raises(TypeError, match=r"item 0, 3 \(int\), names no device"):
        sharded.solve_sharded(A, b, devices=[3], manager=dm)
    cpu_only = DeviceManager(devices=["cpu"])
    with pytest.raises(RuntimeError, match="no GPU.*MANAGED_SOLVE_SIMULATE"):
        sharded.solve_sharded(A, b, devices="all", manager=cpu_only)
    # The string forms work: "all" and a comma list.
    assert sharded.solve_sharded(A, b, devices="sim:0,sim:1", manager=dm).converged
    assert sharded.solve_sharded(A, b, devices="all", manager=dm).info["shards"] == 2
