"""The ``backend`` fixture of the solver tests (problems live in ``tests/_problems.py``)."""

from __future__ import annotations

import pytest

from tests._problems import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request):
    """"cpu", and "cuda" (marked gpu) for the same test on a GPU."""
    return request.param
