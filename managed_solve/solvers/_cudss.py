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
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .. import _backend

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
THREADING = True  # use the OpenMP threading layer when found

_devices: dict[int, _Device] = {}
_devices_lock = threading.Lock()


def solve(nvmath: Any, A: Any, b: Any, symmetric: bool | None) -> tuple[Any, str]:
    """``x`` with ``A x = b`` on ``b``'s device, and what was reused: "none", "plan" or "factors".

    A symmetric A is declared ``SYMMETRIC`` (LDL^T with pivoting; positive
    definiteness is not known here, so not ``SPD``). cuDSS reports a zero
    pivot as a non-finite or wrong ``x``, which the caller's residual check
    turns into ``BREAKDOWN``.
    """
    dev = _device(getattr(getattr(b, "device", None), "id", -1))
    xp = _backend.array_module(b)
    key = (A.shape[0], int(A.nnz), A.dtype.str, A.indices.dtype.str, A.indptr.dtype.str, bool(symmetric))
    with dev.lock:
        entry = dev.cache.pop(key, None)  # out of the cache until it solved this system
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
                entry = _Entry(nvmath, A, b, symmetric, dev)
            x = entry.solve(b)
        except Exception:
            if entry is not None:  # a failed factorisation or solve: nothing half-made is kept
                entry.free()
            raise
        if CACHE_SIZE > 0 and _room_left(xp):
            dev.cache[key] = entry  # the most recent last
            while len(dev.cache) > CACHE_SIZE:
                dev.cache.popitem(last=False)[1].free()
        else:
            entry.free()
    return x, reused


def release_factorisations(device: int | str | None = None) -> int:
    """Free the kept cuDSS analyses and factors (of one GPU, or all); returns how many.

    Parameters
    ----------
    device : int, str or Device, optional
        ``1``, ``"cuda:1"`` or a Device; None: every GPU.

    Examples
    --------
    >>> from managed_solve.solvers import _cudss
    >>> _cudss.release_factorisations()  # nothing kept on a machine that never ran cuDSS
    0
    >>> _cudss.release_factorisations("cuda:0")
    0
    """
    if device is not None and not isinstance(device, int):
        from ..device_args import cuda_ordinal

        ordinal = cuda_ordinal(device, what="release_factorisations(device)")
        if ordinal is None:
            raise ValueError(f"release_factorisations(device={str(device)!r}): cuDSS keeps factors on "
                             "CUDA GPUs only; pass 'cuda:0', 'cuda:1', ... or None for every GPU")
        device = ordinal
    freed = 0
    with _devices_lock:
        devs = [d for i, d in _devices.items() if device is None or i == device]
    for d in devs:
        with d.lock:
            while d.cache:
                d.cache.popitem()[1].free()
                freed += 1
    return freed


class _Device:
    def __init__(self, device: int):
        self.lock = threading.Lock()
        self.cache: OrderedDict = OrderedDict()
        self.handle = _make_handle(device)  # lives as long as the process


def _make_handle(device: int) -> int:
    from nvmath.bindings import cudss

    with _backend.cupy().cuda.Device(device):
        return cudss.create()


def _device(device: int) -> _Device:
    with _devices_lock:
        d = _devices.get(device)
        if d is None:
            d = _devices[device] = _Device(device)
        return d


class _Entry:
    """One analysed matrix: nvmath's DirectSolver over our own copy of A."""

    def __init__(self, nvmath: Any, A: Any, b: Any, symmetric: bool | None, dev: _Device):
        kind = nvmath.DirectSolverMatrixType
        extra = {}
        lib = threading_lib() if THREADING else None
        if lib is not None:
            extra["multithreading_lib"] = lib
        options = nvmath.DirectSolverOptions(
            sparse_system_type=kind.SYMMETRIC if symmetric else kind.GENERAL, handle=dev.handle,
            logger=_log, **extra)
        self.A = A.copy()  # cuDSS keeps pointers into it: later solves must not see the caller's change
        self.solver = nvmath.DirectSolver(self.A, b, options=options)
        try:
            self.solver.plan()
            self.solver.factorize()
        except Exception:
            self.free()
            raise

    def compare(self, A: Any, xp: Any) -> tuple[bool, bool]:
        stream = _stream(xp)
        if stream is not None:  # the last solve may have run on another stream: wait for it
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


def _room_left(xp: Any) -> bool:
    if xp is np:  # the host stand-in of the tests
        return True
    free, total = xp.cuda.runtime.memGetInfo()
    return free >= KEEP_MIN_FREE_FRACTION * total


def _stream(xp: Any) -> Any:
    """The current CUDA stream (None for host arrays)."""
    return None if xp is np else xp.cuda.get_current_stream()


_THREADING_LIB: list = []  # [path or None], found once


def threading_lib() -> str | None:
    """cuDSS's OpenMP threading layer: $CUDSS_THREADING_LIB, else the one beside libcudss."""
    if not _THREADING_LIB:
        path = os.environ.get("CUDSS_THREADING_LIB")
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
        _THREADING_LIB.append(found)
    return _THREADING_LIB[0]
