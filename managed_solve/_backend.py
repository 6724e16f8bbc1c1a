"""Array backends: NumPy/SciPy on the host, CuPy/cupyx on CUDA GPUs.

This is the only module that imports cupy (and the one place that imports
torch and ray lazily for the rest of the package). Solvers ask
:func:`array_module` for ``xp`` and never branch on "is this cupy" in their
bodies, as CuPy's ``get_array_module`` does.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

log = logging.getLogger("managed_solve")

_EXTRA_FOR = {
    "cupy": 'pip install "managed-solve[cuda12]" (or [cuda13] for CUDA 13 drivers)',
    "cupyx": 'pip install "managed-solve[cuda12]" (or [cuda13] for CUDA 13 drivers)',
    "torch": 'pip install "managed-solve[torch]"',
    "ray": 'pip install "managed-solve[ray]"',
    "meshio": 'pip install "managed-solve[mesh]"',
    "pynvml": 'pip install "managed-solve[nvml]"',
    "matplotlib": 'pip install "managed-solve[plot]"',
    "tqdm": 'pip install "managed-solve[progress]"',
    "pyamg": 'pip install "managed-solve[amg]"',
}


def require(name: str, what: str = "this call") -> ModuleType:
    """Import an optional dependency or raise ``ModuleNotFoundError`` naming the extra."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        root = name.split(".")[0]
        hint = _EXTRA_FOR.get(root, f"pip install {root}")
        raise ModuleNotFoundError(
            f"{what} needs the optional package '{root}', which could not be imported "
            f"({exc}). Install it with: {hint}"
        ) from exc


def optional_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except Exception:  # ImportError, or a broken CUDA library raising at import
        return None


def probe_cuda(import_module: Callable[[str], ModuleType] = importlib.import_module
               ) -> tuple[int, str]:
    """(number of usable CUDA GPUs, reason when 0), asked now. Never raises.

    CuPy installs and imports on machines without a driver: then
    ``getDeviceCount`` raises ``CUDARuntimeError`` and
    ``import cupyx.scipy.sparse.linalg`` raises ImportError. Both mean "no GPU".
    ``import_module`` imports ``cupy`` and ``cupyx`` by name (a stand-in
    simulates a machine: no CuPy, a broken driver, a broken CUDA library).
    """
    try:
        cp = import_module("cupy")
    except Exception:  # ImportError, or a broken CUDA library raising at import
        return 0, "CuPy is not installed"
    try:
        n = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError without a driver
        return 0, f"CuPy found no usable CUDA driver ({type(exc).__name__}: {exc})"
    if n == 0:
        return 0, "CuPy reports no CUDA devices"
    try:
        import_module("cupyx.scipy.sparse.linalg")
    except Exception as exc:
        return 0, f"cupyx.scipy.sparse.linalg failed to import ({exc})"
    return n, ""


@functools.lru_cache(maxsize=1)
def cuda_probe() -> tuple[int, str]:
    """:func:`probe_cuda` of this machine, asked once per process."""
    return probe_cuda()


def cuda_usable() -> bool:
    """True when CuPy can run kernels on at least one CUDA GPU."""
    return cuda_probe()[0] > 0


def cupy() -> ModuleType:
    """The cupy module, or ``ModuleNotFoundError`` naming the extra."""
    return require("cupy", "running on a CUDA GPU")


def cupyx_sparse() -> ModuleType:
    return require("cupyx.scipy.sparse", "a sparse matrix on a CUDA GPU")


def torch_module() -> ModuleType:
    return require("torch", "torch interop")


def is_cupy_array(x: Any) -> bool:
    # By type name, not attributes: cupyx sparse matrices raise NotImplementedError
    # from their `.device` property, which hasattr() does not catch.
    return type(x).__name__ == "ndarray" and type(x).__module__.startswith("cupy")


def is_cupy_sparse(x: Any) -> bool:
    return type(x).__module__.startswith("cupyx.scipy.sparse")


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def thread_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process-wide helper-thread pool ``name``, made on first use.

    For work that releases the GIL (Numba ``nogil`` kernels, copies): the
    batch packer's pieces, the scheduler's early symmetry tests. Threads are
    named ``managed_solve-<name>``.
    """
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = ThreadPoolExecutor(max(1, int(workers)),
                                                     thread_name_prefix=f"managed_solve-{name}")
        return pool


# CUDA sources' kernels (raw_kernels), by device, source, names and options.
_RAW_LOCK = threading.Lock()
_RAW_MODULES: dict[tuple, dict[str, Any]] = {}


def raw_kernels(device_id: int, code: str, names: dict[str, str],
                options: tuple[str, ...] = ("-std=c++17",)) -> dict[str, Any]:
    """Kernels of a CUDA C++ source, compiled once per device (or loaded from CuPy's disk cache).

    ``names`` maps a key to a C++ name expression (template instantiations
    included); the result maps the same keys to CuPy ``RawKernel`` objects.
    For the small modules beside the code that launches them (the AMG
    cycle's, the input checks', the batch gather's).
    """
    key = (int(device_id), code, tuple(sorted(names.items())), tuple(options))
    with _RAW_LOCK:
        if key not in _RAW_MODULES:
            cp = cupy()
            with cp.cuda.Device(device_id):
                mod = cp.RawModule(code=code, options=options,
                                   name_expressions=list(names.values()))
                _RAW_MODULES[key] = {k: mod.get_function(v) for k, v in names.items()}
        return _RAW_MODULES[key]


_LANES = threading.local()  # per calling thread: its lane of each name
_LANES_TAKEN: dict[str, int] = {}


def thread_lane(name: str, lanes: int) -> ThreadPoolExecutor:
    """The calling thread's lane of ``name``: a process-wide one-thread pool that lives on.

    Lane k of ``lanes`` is given to threads in turn at their first call, so
    threads that run at the same time mostly get lanes of their own. For
    libraries that tie memory to the thread that allocated it: SciPy's
    SuperLU releases a factor's memory only on the thread that made it (a
    factor made on a worker thread that has since ended, or freed on another
    thread, is never released), so its factors are made and freed on a lane.
    """
    pool = getattr(_LANES, name, None)
    if pool is None:
        with _POOLS_LOCK:
            k = _LANES_TAKEN.get(name, 0)
            _LANES_TAKEN[name] = k + 1
        pool = thread_pool(f"{name}-{k % max(1, int(lanes))}", 1)
        setattr(_LANES, name, pool)
    return pool


def pinned_empty(count: int, dtype: Any, keep: list) -> np.ndarray:
    """A NumPy array of ``count`` elements over page-locked memory from CuPy's pinned pool.

    The pool hands a block out again as soon as its owner is freed, even while
    an asynchronous copy from or to it is still queued: ``keep`` (a list the
    caller holds until its copies are done) keeps the block alive.
    """
    dt = np.dtype(dtype)
    mem = cupy().cuda.alloc_pinned_memory(max(1, int(count) * dt.itemsize))
    keep.append(mem)
    return np.frombuffer(mem, dtype=dt, count=int(count))


def is_torch_tensor(x: Any) -> bool:
    if type(x) is np.ndarray:  # the common case, without a module look-up
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_scipy_sparse(x: Any) -> bool:
    # A SciPy sparse object exists only once scipy.sparse is imported: no
    # import statement per call (this runs several times an input).
    sp = sys.modules.get("scipy.sparse")
    return sp is not None and sp.issparse(x)


def array_module(*arrays: Any) -> ModuleType:
    """``numpy`` or ``cupy``, from the arrays given (CuPy's ``get_array_module``)."""
    for a in arrays:
        if type(a) is np.ndarray:  # the common case: no type-name tests
            continue
        if is_cupy_array(a) or is_cupy_sparse(a):
            return cupy()
    return np


def sparse_module(xp: ModuleType) -> ModuleType:
    """``scipy.sparse`` for numpy, ``cupyx.scipy.sparse`` for cupy."""
    if xp is np:
        import scipy.sparse

        return scipy.sparse
    return cupyx_sparse()


def to_host(x: Any) -> Any:
    """A NumPy array (or SciPy sparse matrix) holding x; copies only from a GPU."""
    if is_cupy_array(x):
        return x.get()  # sync: copies device -> host
    if is_cupy_sparse(x):
        return x.get()
    if is_torch_tensor(x):
        return x.detach().cpu().numpy()
    return x


def synchronize(device: Any = None) -> None:
    """Wait for queued GPU work (no-op on the CPU)."""
    if cuda_usable():
        cp = cupy()
        if device is None:
            cp.cuda.get_current_stream().synchronize()
        else:
            with cp.cuda.Device(device):
                cp.cuda.get_current_stream().synchronize()


@functools.lru_cache(maxsize=1)
def cpu_count() -> int:
    """Cores of this machine, read once (``os.cpu_count()`` reads the system each call)."""
    return os.cpu_count() or 1
