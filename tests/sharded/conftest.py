"""Devices for the sharded tests: simulated GPUs everywhere, two real ones with ``multi_gpu``.

Every test taking ``kind`` runs the same code path on simulated devices (NumPy
arrays, copies for the exchange) and, marked ``multi_gpu``, on real GPUs
(CuPy, peer copies on copy streams, events). ``tests/sharded`` is a package,
so this conftest does not shadow the root one.
"""

from __future__ import annotations

import pytest

from managed_solve import sharded
from managed_solve.manager import DeviceManager


def _real_gpu_manager():
    from managed_solve import _backend

    if _backend.cuda_probe()[0] < 2:
        pytest.skip("needs two usable CUDA GPUs")
    return DeviceManager()


@pytest.fixture(params=["sim", pytest.param("cuda", marks=pytest.mark.multi_gpu)])
def kind(request):
    return request.param


@pytest.fixture
def devices_for():
    """``devices_for(kind, nshards)`` -> (devices, manager): simulated GPUs or real ones."""

    def make(kind: str, nshards: int):
        dm = DeviceManager(simulate="3x1GiB") if kind == "sim" else _real_gpu_manager()
        if len(dm.accelerators) < nshards:
            pytest.skip(f"needs {nshards} devices of kind {kind}")
        return dm.accelerators[:nshards], dm

    return make


@pytest.fixture(autouse=True)
def _fresh_cache():
    sharded.clear_cache()
    yield
    sharded.clear_cache()
