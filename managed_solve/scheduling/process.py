"""Interpreter settings ``solve_many`` may hold while it runs, when the caller opts in.

One process feeds every GPU: a full garbage collection, or a GIL hand-off
that waits out the interpreter's switch interval, stalls all of them. The
caller may ask ``solve_many`` to pause the cyclic collector and shorten the
switch interval (settings ``pause_gc``, ``switch_interval``,
``head_switch_interval`` of :mod:`managed_solve.config`); by default it
changes neither.

On the CPU, the host LU workers each call SciPy's BLAS beside the batched
kernels' threads; a threaded BLAS then puts more threads on the cores than
there are cores. The caller may ask ``solve_many`` to hold SciPy's OpenBLAS
to fewer threads while it runs (setting ``host_blas_threads``); by default
it leaves them as they are.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import _backend


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


def _get_blas_threads() -> int | None:
    found = _backend.scipy_blas_threads()
    return found[0]() if found is not None else None


def _set_blas_threads(threads: int | None) -> None:
    found = _backend.scipy_blas_threads()
    if found is not None and threads is not None:
        found[1](threads)


#: The threads of the OpenBLAS behind SciPy's BLAS (no-op where none is found).
BLAS_THREADS = ProcessSetting(_get_blas_threads, _set_blas_threads)
