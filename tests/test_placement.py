"""Placement of one system: which pin places it (``pinned_input``), and ``solve`` obeying it."""

from __future__ import annotations

import numpy as np
import pytest

import managed_solve as ms
from managed_solve.manager import DeviceManager
from managed_solve.placement import pinned_input
from tests._problems import poisson2d


def test_a_system_is_placed_by_its_own_pin_else_its_matrix_else_its_right_hand_side():
    dm = DeviceManager(simulate="2x64MiB")
    A, b = poisson2d(6), np.ones(36)
    s = ms.LinearSystem(A, b)
    assert pinned_input(dm, s, s.A, s.b) is None
    dm.pin(b, "sim:0")
    assert pinned_input(dm, s, s.A, s.b) is b
    dm.pin(A, "sim:1")
    assert pinned_input(dm, s, s.A, s.b) is A
    dm.pin(s, "cpu")
    assert pinned_input(dm, s, s.A, s.b) is s
    assert pinned_input(dm, None, s) is s


def test_solve_of_a_pinned_matrix_runs_on_its_device_and_names_it_when_full():
    dm = DeviceManager(simulate="2x64MiB", reserved=0.0)
    A, b = poisson2d(8), np.arange(64.0)
    assert ms.solve(A, b, manager=dm).device == "sim:0"  # the manager's choice
    dm.pin(A, "sim:1")
    r = ms.solve(A, b, manager=dm)
    assert r.device == "sim:1" and r.converged
    np.testing.assert_allclose(r.to_numpy(), np.linalg.solve(A.toarray(), b), rtol=1e-6)
    assert ms.solve(A, b, device="sim:0", manager=dm).device == "sim:0"  # an explicit device wins
    held = dm.reserve(dm.available_bytes(dm.accelerators[1]) - 100, "sim:1")
    try:
        with pytest.raises(MemoryError, match="pinned to sim:1.*unpin the object"):
            ms.solve(A, b, manager=dm)
    finally:
        held.release()
