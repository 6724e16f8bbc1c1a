"""Array backends: NumPy/SciPy on the host, CuPy/cupyx on CUDA GPUs.

This is the only module that imports cupy (and the one place that imports
torch and ray lazily for the rest of the package). Solvers ask
:func:`array_module` for ``xp`` and never branch on "is this cupy" in their
bodies, as CuPy's ``get_array_module`` does.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
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


_SUBMITTING = threading.local()  # set while this thread is inside on_lane's submit
_DEFERRED: queue.SimpleQueue = queue.SimpleQueue()  # (lane, fn, args) met inside a submit


def on_lane(lane: ThreadPoolExecutor, fn: Callable, *args: Any) -> Future | None:
    """``lane.submit(fn, *args)``, safe to call from a finaliser (``__del__``).

    The garbage collector may run a finaliser on a thread that is inside a
    submit, which holds the executor's lock (not re-entrant): a finaliser
    that submits there waits for itself for ever. So a call made inside one
    of this thread's submits is queued (returning None) and submitted once
    that submit has returned.
    """
    if getattr(_SUBMITTING, "active", False):
        _DEFERRED.put((lane, fn, args))
        return None
    _SUBMITTING.active = True
    try:
        future = lane.submit(fn, *args)
        while not _DEFERRED.empty():
            later, f, a = _DEFERRED.get_nowait()
            later.submit(f, *a)
    finally:
        _SUBMITTING.active = False
    return future


# Streams the process keeps per GPU and role (see device_stream).
_STREAMS: dict[tuple[int, str], Any] = {}
_STREAMS_LOCK = threading.Lock()


@contextmanager
def device_stream(device_id: int, role: str) -> Iterator[Any]:
    """GPU ``device_id`` current, with the process's stream for ``role`` current on it; yields the stream.

    One non-blocking stream per GPU and role for the process (``"copy"``: a
    device's stage thread; ``"lane 0"``, ``"lane 1"``: the workers computing
    ``solve_many``'s batches side by side). CuPy's memory pool keeps freed
    blocks per stream: a stream that lives across batches and calls gets
    its batches' memory back instead of allocating anew for a fresh stream.
    """
    cp = cupy()
    with cp.cuda.Device(int(device_id)):
        key = (int(device_id), role)
        with _STREAMS_LOCK:
            stream = _STREAMS.get(key)
            if stream is None:
                stream = _STREAMS[key] = cp.cuda.Stream(non_blocking=True)
        with stream:
            yield stream


# CUDA primary contexts this process opened (or is opening), by device id.
_CONTEXTS_LOCK = threading.Lock()
_CONTEXTS: dict[int, Future] = {}


def open_cuda_context(device_id: int) -> Future:
    """Make GPU ``device_id``'s CUDA context on a helper thread (once per process); its future.

    Making a context takes about a tenth of a second, without the GIL
    (``cudaFree(0)``): a call that will run on the GPU starts it first, beside
    its host work. Once asked, :func:`cuda_context` reports it, and free
    memory is read through it (``cudaMemGetInfo``) rather than through NVML,
    whose first query in a process is as slow.
    """
    did = int(device_id)
    with _CONTEXTS_LOCK:
        fut = _CONTEXTS.get(did)
        if fut is not None:
            return fut
        fut = _CONTEXTS[did] = Future()

    def make() -> None:
        try:
            cp = cupy()
            with cp.cuda.Device(did):
                cp.cuda.runtime.free(0)  # makes the context
        except BaseException as exc:  # reported by whoever waits for it
            fut.set_exception(exc)
        else:
            fut.set_result(did)

    threading.Thread(target=make, name=f"managed_solve-context-{did}", daemon=True).start()
    return fut


def cuda_context(device_id: int) -> Future | None:
    """The future of :func:`open_cuda_context` for ``device_id``, or None when never asked."""
    with _CONTEXTS_LOCK:
        return _CONTEXTS.get(int(device_id))


def cuda_free_bytes(device_id: int) -> int:
    """``cudaMemGetInfo``'s free bytes on a GPU (device-wide: other processes' memory counts)."""
    cp = cupy()
    with cp.cuda.Device(int(device_id)):
        free, _total = cp.cuda.runtime.memGetInfo()
    return int(free)


def is_torch_tensor(x: Any) -> bool:
    if type(x) is np.ndarray:  # the common case, without a module look-up
        return False
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def scipy_csr_types() -> tuple:
    """SciPy's two CSR types, to test an input's exact type by identity (none before ``scipy.sparse`` is imported).

    Hundreds of inputs a call are tested; ``type(A) in scipy_csr_types()``
    costs no ``issparse`` (an ABC's isinstance) and no import statement.
    """
    sp = sys.modules.get("scipy.sparse")
    return (sp.csr_matrix, sp.csr_array) if sp is not None else ()


def is_scipy_sparse(x: Any) -> bool:
    # A SciPy sparse object exists only once scipy.sparse is imported: no
    # import statement per call (this runs several times an input).
    sp = sys.modules.get("scipy.sparse")
    if sp is None:
        return False
    # The commonest inputs by their exact type first: issparse is an ABC's isinstance.
    return type(x) in scipy_csr_types() or sp.issparse(x)


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


# --------------------------------------------------------------------------- interpreter settings
# One process feeds every GPU: a full garbage collection, or a GIL hand-off
# that waits out the interpreter's switch interval, stalls all of them. The
# caller may ask ``solve_many`` to pause the cyclic collector and shorten the
# switch interval (settings ``pause_gc``, ``switch_interval``,
# ``head_switch_interval`` of :mod:`managed_solve.config`); by default it
# changes neither.
class ProcessSetting:
    """An interpreter setting held while any solve_many call needs it.

    Calls (and nested phases of one call) may ask for different values: the
    smallest one asked for holds (a shorter GIL switch interval; collection
    off, False < True); the caller's own value comes back when the last
    request ends.

    Examples
    --------
    >>> values = [7.0]
    >>> setting = ProcessSetting(lambda: values[-1], values.append)
    >>> with setting.held(5.0):
    ...     with setting.held(1.0):
    ...         values[-1]
    1.0
    >>> values[-1]
    7.0
    """

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]):
        self.get, self.put = get, put
        self.lock = threading.Lock()
        self.requests: list[Any] = []
        self.saved: Any = None

    @contextmanager
    def held(self, value: Any, active: bool = True) -> Iterator[None]:
        """Hold ``value`` for the block (nothing when ``active`` is false)."""
        if not active:
            yield
            return
        with self.lock:
            if not self.requests:
                self.saved = self.get()
            self.requests.append(value)
            self.put(min(self.requests))
        try:
            yield
        finally:
            with self.lock:
                self.requests.remove(value)
                self.put(min(self.requests) if self.requests else self.saved)


def _set_gc(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()


#: Automatic (cyclic) garbage collection, held off with ``held(False)``.
COLLECTION = ProcessSetting(gc.isenabled, _set_gc)
#: The GIL switch interval in seconds.
SWITCH_INTERVAL = ProcessSetting(sys.getswitchinterval, sys.setswitchinterval)


@functools.lru_cache(maxsize=1)
def scipy_blas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """Getter and setter of the threads of the OpenBLAS behind SciPy's BLAS, or None where none is found.

    The host Cholesky calls SciPy's BLAS (``scipy.linalg.cython_blas``).
    SciPy's wheels carry their own OpenBLAS (``scipy.libs``, symbols
    prefixed ``scipy_openblas_``); other builds may load a system OpenBLAS
    whose symbols are global. MKL, Accelerate and the like are not found:
    None, and nothing is changed.
    """
    import ctypes
    import glob

    import scipy

    root = os.path.dirname(scipy.__file__)
    paths = sorted(glob.glob(os.path.join(root, os.pardir, "scipy.libs", "*openblas*"))
                   + glob.glob(os.path.join(root, ".dylibs", "*openblas*")))
    for path in [*paths, None]:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            get = getattr(lib, prefix + "get_num_threads", None)
            put = getattr(lib, prefix + "set_num_threads", None)
            if get is not None and put is not None:
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                return get, put
    return None


def _get_blas_threads() -> int | None:
    found = scipy_blas_threads()
    return found[0]() if found is not None else None


def _set_blas_threads(threads: int | None) -> None:
    found = scipy_blas_threads()
    if found is not None and threads is not None:
        found[1](threads)


#: The threads of the OpenBLAS behind SciPy's BLAS (no-op where none is found).
#: On the CPU the host LU workers each call SciPy's BLAS beside the batched
#: kernels' threads; a threaded BLAS then puts more threads on the cores than
#: there are cores. The caller may ask ``solve_many`` to hold it to fewer
#: threads while it runs (setting ``host_blas_threads``); by default it is
#: left as it is.
BLAS_THREADS = ProcessSetting(_get_blas_threads, _set_blas_threads)
