"""managed-solve: sparse linear systems from PDEs on every GPU of a machine.

Re-exports only. ``device_manager`` (the default DeviceManager) is made on
first use, so importing the package never touches a GPU driver.
"""

from __future__ import annotations

from . import config as config
from ._solve import solve as solve
from ._solve_many import solve_many as solve_many
from ._warmup import warmup as warmup
from .devices import Device as Device
from .devices import discover as discover
from .manager import DeviceManager as DeviceManager
from .result import SolveError as SolveError
from .result import SolveResult as SolveResult
from .result import Status as Status
from .sizes import default_heuristic as _default_heuristic
from .solver import Solver as Solver
from .system import LinearSystem as LinearSystem

__version__ = "0.1.0"

# The prototype's names: read by the manager at every call, so setting them works.
USE_HEURISTIC = True
HEURISTIC_FUNCTION = _default_heuristic

# Submodules loaded on first attribute access (they import numba, torch, ...).
_LAZY_MODULES = {"mesh", "pde", "assembly", "kernels", "solvers", "dlpack", "tensor", "module"}
_LAZY_NAMES = {
    "ManagedTensor": ("tensor", "ManagedTensor"),
    "ManagedModule": ("module", "ManagedModule"),
    "as_torch": ("dlpack", "as_torch"),
    "from_torch": ("dlpack", "from_torch"),
}


def __getattr__(name: str):
    import importlib

    if name == "device_manager":
        from .manager import default_manager

        return default_manager()
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_NAMES:
        mod, attr = _LAZY_NAMES[name]
        return getattr(importlib.import_module(f".{mod}", __name__), attr)
    raise AttributeError(f"module 'managed_solve' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), "device_manager", *_LAZY_MODULES, *_LAZY_NAMES])
