"""cuDSS (through nvmath-python) for GPU direct solves, with its analysis kept between calls.

Of a cuDSS solve, the plan phase (ordering and symbolic analysis, on the
host) dominates: it costs tens of times the numeric factorisation and the
solve together (``benchmarks/profile_direct.py`` shows the phases). So, per
device:

- one cuDSS handle, made once, with cuDSS's OpenMP threading layer for the
  host phases where it lies beside the library (the plan is the host's work,
  and it parallelises);
- the last ``CACHE_SIZE`` analysed matrices, each with its own copy of the
  matrix (cuDSS keeps pointers into it), while the GPU keeps a quarter of its
  memory free. A later solve with the same sparsity pattern skips the plan;
  with the same values too, it skips the factorisation and only solves. One
  device-side comparison (one host read) tells which.

A device's handle and cache are used under its lock: direct solves on one
GPU run one at a time (they would share the GPU anyway), on different GPUs
side by side.
"""

from __future__ import annotations

import logging
import os
import threading as threading_module
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend, config

log = logging.getLogger("managed_solve")
# nvmath-python logs each phase (INFO) to the logger it is given, the root
# logger by default: ours keeps them under managed_solve.cudss.
_log = logging.getLogger("managed_solve.cudss")
# Without the threading layer nvmath warns on every solve; we say it once.
_log.addFilter(lambda record: "multithreading interface library" not in record.getMessage())

CACHE_SIZE = 2  # analysed matrices kept per device (0: none, every solve plans)
# A solve's analysis and factors are kept only while the GPU keeps at least
# this fraction of its memory free: kept factors must not crowd out the work
# the DeviceManager places next.
KEEP_MIN_FREE_FRACTION = 0.25


class Cudss:
    """cuDSS solves with their analyses kept: one handle and one cache per GPU.

    The process keeps one (:func:`default`), which ``solve(method="direct")``
    uses on a GPU; a test or a benchmark makes its own, with stand-ins for the
    library or other limits, and passes it where a ``cudss=`` is taken
    (:func:`managed_solve.solvers.direct.gpu_sparse_solve`).

    Parameters
    ----------
    nvmath : module, optional
        ``nvmath.sparse.advanced`` or a stand-in; default: imported at each
        solve when installed (:attr:`available` says whether it is).
    make_handle : callable, optional
        ``make_handle(device)`` -> a cuDSS handle on that GPU, made once a GPU.
    threading_lib : callable, optional
        ``threading_lib()`` -> the path of cuDSS's OpenMP threading layer, or
        None; asked once (default: :func:`find_threading_lib`).
    cache_size : int
        Analysed matrices kept per device (0: none, every solve plans).
    keep_min_free_fraction : float
        Analyses are kept only while the GPU keeps this fraction of its memory free.
    threading : bool
        Use the threading layer when found.

    Examples
    --------
    >>> Cudss(cache_size=0).release()  # nothing kept yet
    0
    """

    def __init__(self, nvmath: Any = None, *, make_handle: Callable[[int], Any] | None = None,
                 threading_lib: Callable[[], str | None] | None = None, cache_size: int = CACHE_SIZE,
                 keep_min_free_fraction: float = KEEP_MIN_FREE_FRACTION, threading: bool = True):
        self._nvmath = nvmath
        self.make_handle = make_handle if make_handle is not None else _make_handle
        self._find_threading_lib = threading_lib if threading_lib is not None else find_threading_lib
        self._threading_lib: list = []  # [path or None], found once
        self.cache_size = cache_size
        self.keep_min_free_fraction = keep_min_free_fraction
        self.threading = threading
        self._devices: dict[int, _Device] = {}
        self._lock = threading_module.Lock()

    @property
    def nvmath(self) -> Any:
        """``nvmath.sparse.advanced`` (or the stand-in given), None when not installed."""
        return self._nvmath if self._nvmath is not None else _backend.optional_module("nvmath.sparse.advanced")

    def threading_lib(self) -> str | None:
        """cuDSS's OpenMP threading layer (looked for once)."""
        if not self._threading_lib:
            self._threading_lib.append(self._find_threading_lib())
        return self._threading_lib[0]

    def solve(self, A: Any, b: Any, symmetric: bool | None) -> tuple[Any, str]:
        """``x`` with ``A x = b`` on ``b``'s device, and what was reused: "none", "plan" or "factors".

        A symmetric A is declared ``SYMMETRIC`` (LDL^T with pivoting; positive
        definiteness is not known here, so not ``SPD``). cuDSS reports a zero
        pivot as a non-finite or wrong ``x``, which the caller's residual check
        turns into ``BREAKDOWN``.

        ``b`` may be an (n, k) block: cuDSS solves its columns together (one
        pass of the triangular solves). nvmath binds a solver to its
        right-hand side's shape, so a block of k columns is analysed once per
        k and kept apart from the single vectors'.
        """
        b = _dense_rhs(b)
        dev, key, xp = self._where(A, b, symmetric)
        with dev.lock:
            entry, reused = self._take(dev, key, A, b, symmetric, xp)
            try:
                x = entry.solve(b)
            except Exception:  # a failed solve: nothing half-made is kept
                entry.free()
                raise
            self._keep(dev, key, entry, xp)
        return x, reused

    def hold(self, A: Any, b: Any, symmetric: bool | None) -> Held:
        """A's analysis and factors for one owner, out of the cache until :meth:`Held.release`.

        A prepared direct solver (a :class:`~managed_solve.Solver`'s) solves
        with its own factors: two Solvers whose matrices share a pattern (the
        heat and Poisson matrices of one mesh) would otherwise take turns
        refactorising one cache entry. ``b`` gives the shape of the
        right-hand sides the factors will solve (a vector). What a kept
        analysis can save is saved as in :meth:`solve` (``Held.reused``).
        """
        b = _dense_rhs(b)
        dev, key, xp = self._where(A, b, symmetric)
        with dev.lock:
            entry, reused = self._take(dev, key, A, b, symmetric, xp)
        return Held(self, dev, key, entry, reused, xp)

    def _where(self, A: Any, b: Any, symmetric: bool | None) -> tuple[_Device, tuple, Any]:
        dev = self._device(getattr(getattr(b, "device", None), "id", -1))
        key = (A.shape[0], int(A.nnz), A.dtype.str, A.indices.dtype.str, A.indptr.dtype.str,
               bool(symmetric), b.shape[1:])
        return dev, key, _backend.array_module(b)

    def _take(self, dev: _Device, key: tuple, A: Any, b: Any, symmetric: bool | None,
              xp: Any) -> tuple[_Entry, str]:
        """A kept entry for A (out of the cache), refactorised if its values changed, or a new one.

        The caller holds ``dev.lock``.
        """
        entry = dev.cache.pop(key, None)  # out of the cache until it is given back
        reused = "none"
        try:
            if entry is not None:
                same_pattern, same_values = entry.compare(A, xp)  # sync: one host read
                if not same_pattern:
                    entry.free()
                    entry = None
                elif same_values:
                    reused = "factors"
                else:
                    entry.refactor(A, xp)
                    reused = "plan"
            if entry is None:
                lib = self.threading_lib() if self.threading else None
                entry = _Entry(self.nvmath, A, b, symmetric, dev, lib)
        except Exception:
            if entry is not None:  # a failed factorisation: nothing half-made is kept
                entry.free()
            raise
        return entry, reused

    def _keep(self, dev: _Device, key: tuple, entry: _Entry, xp: Any) -> None:
        """Put ``entry`` back in the cache (the most recent), or free it. The caller holds ``dev.lock``."""
        if self.cache_size > 0 and _room_left(xp, self.keep_min_free_fraction):
            older = dev.cache.pop(key, None)  # one of the same pattern came back first
            if older is not None and older is not entry:
                older.free()
            dev.cache[key] = entry  # the most recent last
            while len(dev.cache) > self.cache_size:
                dev.cache.popitem(last=False)[1].free()
        else:
            entry.free()

    def release(self, device: int | str | None = None) -> int:
        """Free the kept analyses and factors (of one GPU, or all); returns how many.

        ``device``: ``1``, ``"cuda:1"`` or a Device; None: every GPU.
        """
        device = _ordinal(device)
        freed = 0
        with self._lock:
            devs = [d for i, d in self._devices.items() if device is None or i == device]
        for d in devs:
            with d.lock:
                while d.cache:
                    d.cache.popitem()[1].free()
                    freed += 1
        return freed

    def reset(self) -> int:
        """:meth:`release` everything and forget the handles: the next solve makes new ones.

        A handle keeps the threading layer it was given, so a benchmark
        comparing ``threading`` on and off resets between the two.
        """
        freed = self.release()
        with self._lock:
            self._devices.clear()
        return freed

    def _device(self, device: int) -> _Device:
        with self._lock:
            d = self._devices.get(device)
            if d is None:
                d = self._devices[device] = _Device(self.make_handle(device))
            return d


_default: Cudss | None = None
_default_lock = threading_module.Lock()


def default() -> Cudss:
    """The process's cuDSS state (handles live as long as the process), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Cudss()
        return _default


def release_factorisations(device: int | str | None = None) -> int:
    """Free the kept cuDSS analyses and factors (of one GPU, or all); returns how many.

    Parameters
    ----------
    device : int, str or Device, optional
        ``1``, ``"cuda:1"`` or a Device; None: every GPU.

    Examples
    --------
    >>> from managed_solve.solvers import release_factorisations
    >>> release_factorisations()  # nothing kept on a machine that never ran cuDSS
    0
    >>> release_factorisations("cuda:0")
    0
    """
    return default().release(device)


def _ordinal(device: int | str | None) -> int | None:
    if device is None or isinstance(device, int):
        return device
    from ..device_args import cuda_ordinal

    ordinal = cuda_ordinal(device, what="release_factorisations(device)")
    if ordinal is None:
        raise ValueError(f"release_factorisations(device={str(device)!r}): cuDSS keeps factors on "
                         "CUDA GPUs only; pass 'cuda:0', 'cuda:1', ... or None for every GPU")
    return ordinal


class _Device:
    def __init__(self, handle: Any):
        self.lock = threading_module.Lock()
        self.cache: OrderedDict = OrderedDict()
        self.handle = handle  # lives as long as the process


class Held:
    """Factors held by one owner (:meth:`Cudss.hold`): solve with them, then release them.

    Attributes
    ----------
    reused : str
        What :meth:`Cudss.hold` found kept: "none", "plan" or "factors".
    """

    def __init__(self, cudss: Cudss, dev: _Device, key: tuple, entry: _Entry, reused: str,
                 xp: Any):
        self._cudss, self._dev, self._key, self._xp = cudss, dev, key, xp
        self._entry: _Entry | None = entry
        self.reused = reused

    def solve(self, b: Any) -> Any:
        """``x`` with ``A x = b`` for ``b`` of the shape the factors were made with (a vector or a block)."""
        b = _dense_rhs(b)
        with self._dev.lock:  # the device's handle is shared
            return self._live().solve(b)

    def release(self) -> None:
        """Give the factors back to the cache (kept while there is room, as after a solve)."""
        entry, self._entry = self._entry, None
        if entry is not None:
            with self._dev.lock:
                self._cudss._keep(self._dev, self._key, entry, self._xp)

    def discard(self) -> None:
        """Free the factors (after a failed solve: nothing half-made goes back to the cache)."""
        entry, self._entry = self._entry, None
        if entry is not None:
            with self._dev.lock:
                entry.free()

    def _live(self) -> _Entry:
        if self._entry is None:
            raise RuntimeError("cuDSS factors were released; hold them again to solve.")
        return self._entry


def _dense_rhs(b: Any) -> Any:
    """``b`` as nvmath takes it: a unit-stride vector, or a block in column-major order."""
    xp = _backend.array_module(b)
    if b.ndim == 2:
        return xp.asfortranarray(b)  # cuDSS reads a block column by column
    return xp.ascontiguousarray(b)  # a column of a block is strided


def _make_handle(device: int) -> int:
    from nvmath.bindings import cudss

    with _backend.cupy().cuda.Device(device):
        return cudss.create()


class _Entry:
    """One analysed matrix: nvmath's DirectSolver over our own copy of A."""

    def __init__(self, nvmath: Any, A: Any, b: Any, symmetric: bool | None, dev: _Device,
                 lib: str | None):
        kind = nvmath.DirectSolverMatrixType
        extra = {}
        if lib is not None:
            extra["multithreading_lib"] = lib
        options = nvmath.DirectSolverOptions(
            sparse_system_type=kind.SYMMETRIC if symmetric else kind.GENERAL, handle=dev.handle,
            logger=_log, **extra)
        self.A = A.copy()  # cuDSS keeps pointers into it: later solves must not see the caller's change
        self.done = None  # the event of the last solve (None: none yet)
        self.solver = nvmath.DirectSolver(self.A, b, options=options)
        try:
            self.solver.plan()
            self.solver.factorize()
        except Exception:
            self.free()
            raise

    def compare(self, A: Any, xp: Any) -> tuple[bool, bool]:
        stream = _stream(xp)
        if stream is not None and self.done is not None:  # the last solve may have run on another stream
            stream.wait_event(self.done)
        pattern = xp.array_equal(A.indptr, self.A.indptr) & xp.array_equal(A.indices, self.A.indices)
        values = xp.array_equal(A.data, self.A.data)
        flags = xp.stack([xp.asarray(pattern), xp.asarray(values)])
        flags = flags.get() if stream is not None else flags  # sync: both answers in one read
        return bool(flags[0]), bool(flags[0] and flags[1])

    def refactor(self, A: Any, xp: Any) -> None:
        xp.copyto(self.A.data, A.data)  # the buffer cuDSS points to, on the current stream
        self.solver.factorize()

    def solve(self, b: Any) -> Any:
        self.solver.reset_operands(b=b)
        x = self.solver.solve()
        stream = _stream(_backend.array_module(b))
        self.done = stream.record() if stream is not None else None
        return x

    def free(self) -> None:
        solver, self.solver = getattr(self, "solver", None), None
        if solver is not None:
            solver.free()


def _room_left(xp: Any, min_free_fraction: float) -> bool:
    if xp is np:  # the host stand-in of the tests
        return True
    free, total = xp.cuda.runtime.memGetInfo()
    return free >= min_free_fraction * total


def _stream(xp: Any) -> Any:
    """The current CUDA stream (None for host arrays)."""
    return None if xp is np else xp.cuda.get_current_stream()


def find_threading_lib() -> str | None:
    """cuDSS's OpenMP threading layer: $CUDSS_THREADING_LIB, else the one beside libcudss."""
    path = config.environment(config.ENV_CUDSS_THREADING_LIB)
    if not path:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib

            lib = load_nvidia_dynamic_lib("cudss").abs_path
            path = os.path.join(os.path.dirname(lib), "libcudss_mtlayer_gomp.so.0") if lib else None
        except Exception:  # an older pathfinder, or cuDSS found another way
            path = None
    found = path if path and os.path.isfile(path) else None
    if found is None:
        log.info("managed_solve: cuDSS's threading layer was not found (set CUDSS_THREADING_LIB); "
                 "its host phases run on one thread")
    return found


def threading_lib() -> str | None:
    """The threading layer the process's cuDSS state uses (see :func:`find_threading_lib`)."""
    return default().threading_lib()
