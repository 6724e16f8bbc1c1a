"""Set-ups of sharded systems kept per matrix object, so a new right-hand side skips them.

Partitioning and uploading a matrix costs far more than one solve with it;
:func:`sharded_system` keeps the :class:`~managed_solve.sharded.layout.ShardedSystem`
of each matrix object while that object lives (it is held weakly), keyed by the
devices, the reordering and the weights. A matrix modified in place is not
noticed: call :func:`clear_cache`, or build a ``ShardedSystem`` directly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .. import config
from .inputs import resolve_devices
from .layout import ShardedSystem

__all__ = ["CacheInfo", "SystemCache", "cache_info", "clear_cache", "sharded_system"]


class CacheInfo(NamedTuple):
    """Hits and misses since the last clear, and the set-ups held now (as ``functools.lru_cache``)."""

    hits: int
    misses: int
    size: int


class SystemCache:
    """One :class:`ShardedSystem` per live matrix object (the newest set-up of each)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, tuple, ShardedSystem]] = {}
        self._hits = 0
        self._misses = 0

    def get(self, A: Any, key: tuple, build: Callable[[], ShardedSystem]) -> ShardedSystem:
        """The cached set-up of ``A`` under ``key``, or ``build()`` (then kept while ``A`` lives)."""
        hit = self._entries.get(id(A))
        if hit is not None:
            ref, k, system = hit
            if ref() is A and k == key:
                self._hits += 1
                return system
        self._misses += 1
        system = build()
        try:
            ref = weakref.ref(A)
            weakref.finalize(A, self._entries.pop, id(A), None)
        except TypeError:  # objects without weak references are not cached
            return system
        self._entries[id(A)] = (ref, key, system)
        return system

    def clear(self) -> None:
        """Forget every set-up and reset the counts."""
        self._entries.clear()
        self._hits = self._misses = 0

    def info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, len(self._entries))


# The process's cache of set-ups (state, not configuration: config.sharded_cache turns it off).
_cache = SystemCache()


def clear_cache() -> None:
    """Forget every cached :class:`ShardedSystem` (after modifying a matrix in place)."""
    _cache.clear()


def cache_info() -> CacheInfo:
    """Hits, misses and size of the set-up cache of :func:`sharded_system`.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> from managed_solve.manager import DeviceManager
    >>> clear_cache()
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(40, 40)).tocsr()
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> sharded_system(A, "all", manager=dm) is sharded_system(A, "all", manager=dm)
    True
    >>> cache_info()
    CacheInfo(hits=1, misses=1, size=1)
    """
    return _cache.info()


def sharded_system(A: Any, devices: Any, *, reorder: str | None = "rcm",
                   weights: Sequence[float] | None = None, manager: Any = None) -> ShardedSystem:
    """The cached :class:`ShardedSystem` of ``A`` on ``devices`` (built on first use).

    The cache is keyed by the matrix object (held weakly) and the devices,
    reordering and weights; a matrix modified in place is not noticed: call
    :func:`clear_cache` or build a :class:`ShardedSystem` yourself. With
    ``config.override(sharded_cache=False)`` every call builds a new one.
    """
    devs = resolve_devices(devices, manager=manager)

    def build() -> ShardedSystem:
        return ShardedSystem(A, devs, reorder=reorder, weights=weights, manager=manager)

    if not config.current().sharded_cache:
        return build()
    wkey = None if weights is None else tuple(float(w) for w in weights)
    key = (tuple(str(d) for d in devs), reorder, wkey, getattr(A, "shape", None),
           getattr(A, "nnz", None))
    return _cache.get(A, key, build)
