"""solve_many's entry point (managed_solve/_solve_many.py): what it takes as ``systems``."""

from __future__ import annotations

import numpy as np
import pytest

import managed_solve as ms
from tests._problems import laplacian1d


def test_one_system_or_a_number_is_a_type_error_naming_the_fix():
    """A bare (A, b) pair would be iterated as two broken systems (A's rows, then b)."""
    A, b = laplacian1d(20), np.ones(20)
    dm = ms.DeviceManager(["cpu"])
    for one in ((A, b), (A.toarray(), b), ms.LinearSystem(A, b)):
        with pytest.raises(TypeError, match=r"got one system; wrap it in a list"):
            ms.solve_many(one, manager=dm)
    with pytest.raises(TypeError, match=r"solve_many\(systems=...\): expected an iterable.*got int"):
        ms.solve_many(5, manager=dm)
    assert len(ms.solve_many(((A, b), (A, b)), manager=dm)) == 2  # a tuple of pairs is two
    assert len(ms.solve_many(iter([(A, b)]), manager=dm)) == 1
