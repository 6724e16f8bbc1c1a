"""Page-locked host memory: batches' staging blocks and the small buffers of read-backs.

Copies between host and GPU run asynchronously only from page-locked
memory, and pinning pages is slow (``cudaHostAlloc``, about 1 GB/s): a
batch's arrays are carved from one block (:func:`pinned_arrays`), blocks
are reused best-fit and pinned off the critical path
(:class:`StagingPool`), and small buffers share slabs (:class:`PinnedArena`).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import numpy as np

from . import _backend

#: Byte alignment of the arrays carved from one page-locked block (DMA- and
#: vector-friendly for every dtype).
CARVE_ALIGN = 256


def carve_layout(specs: Sequence[tuple[int, Any]]) -> tuple[list[int], int]:
    """Byte offsets of arrays of ``specs`` (``(count, dtype)`` each) laid end to end, and the total.

    Each array starts at a multiple of :data:`CARVE_ALIGN`.

    Examples
    --------
    >>> carve_layout([(3, "float64"), (10, "int32")])
    ([0, 256], 296)
    """
    offsets, end = [], 0
    for count, dtype in specs:
        start = -(-end // CARVE_ALIGN) * CARVE_ALIGN
        offsets.append(start)
        end = start + int(count) * np.dtype(dtype).itemsize
    return offsets, end


def carve(buffer: Any, specs: Sequence[tuple[int, Any]]) -> list[np.ndarray]:
    """Arrays of ``specs`` (``(count, dtype)`` each) over one ``buffer`` (:func:`carve_layout`'s bytes)."""
    offsets, _total = carve_layout(specs)
    return [np.frombuffer(buffer, dtype=np.dtype(dt), count=int(count), offset=off)
            for (count, dt), off in zip(specs, offsets, strict=True)]


def _alloc_pinned(nbytes: int) -> Any:
    return _backend.cupy().cuda.alloc_pinned_memory(max(1, int(nbytes)))


def block_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a size class: an eighth of its power of two, at least 64 KiB.

    Requests of nearby sizes share a class, so a block serves them all; at
    most an eighth of a block is rounding.

    Examples
    --------
    >>> block_class(1), block_class(56_000_000), block_class(1 << 26)
    (65536, 58720256, 67108864)
    """
    nbytes = max(1, int(nbytes))
    step = max(1 << 16, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class StagingPool:
    """Page-locked blocks for batches' staging, reused best-fit, pinned off the critical path.

    Pinning is slow (``cudaHostAlloc`` pins pages at about 1 GB/s, see
    ``docs/performance.md``), and CuPy's pinned pool hands a freed block only to
    a later request of the same rounded size. Here :meth:`lend` gives the
    smallest free block that holds a request and is at most ``slack`` times
    its size. When none does, the caller stages in pageable memory this
    time and :meth:`pin_later` pins a block of the request's
    :func:`block_class` on a helper thread, for the batches after it: a
    process's first batches never wait for pinning. A block is free again
    once every array carved from it is gone; at most ``keep_free`` free
    blocks are kept, beyond that the smallest goes back to ``alloc``'s pool,
    and at most ``max_pending`` pins wait at once.

    Examples
    --------
    >>> pool = StagingPool(bytearray)
    >>> pool.lend(90_000) is None  # nothing pinned yet
    True
    >>> pool.pin_later(90_000); pool.settle()
    >>> a = pool.lend(90_000); a.nbytes, pool.allocations
    (90000, 1)
    >>> del a
    >>> b = pool.lend(50_000); pool.allocations  # 131,072 bytes is within 2x of 50,000: reused
    1
    """

    def __init__(self, alloc: Callable[[int], Any], *, slack: float = 2.0, keep_free: int = 8,
                 max_pending: int = 4):
        self.alloc, self.slack, self.keep_free = alloc, float(slack), int(keep_free)
        self.max_pending = int(max_pending)
        self.allocations = 0  # blocks pinned so far
        self._free: list[tuple[int, Any]] = []  # (size, block), smallest first
        self._pending: list[Future] = []
        # Re-entrant: a block may come back (its last array collected) while this thread holds it.
        self._lock = threading.RLock()

    @property
    def free_blocks(self) -> int:
        """Blocks free now (pinned and not in use)."""
        with self._lock:
            return len(self._free)

    def lend(self, nbytes: int) -> np.ndarray | None:
        """A ``uint8`` array of ``nbytes`` over a free block (free again when it is gone), or None."""
        nbytes = max(1, int(nbytes))
        with self._lock:
            pick = next((j for j, (size, _) in enumerate(self._free)
                         if nbytes <= size <= self.slack * nbytes + (1 << 16)), None)
            if pick is None:
                return None
            size, mem = self._free.pop(pick)
        base = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
        weakref.finalize(base, self._give, size, mem)
        return base

    def _give(self, size: int, mem: Any) -> None:
        with self._lock:
            bisect.insort(self._free, (size, mem), key=lambda item: item[0])
            if len(self._free) > self.keep_free:
                self._free.pop(0)

    def pin(self, nbytes: int) -> None:
        """Pin a free block of ``nbytes``' :func:`block_class` now."""
        size = block_class(nbytes)
        mem = self.alloc(size)
        with self._lock:
            self.allocations += 1
        self._give(size, mem)

    def pin_later(self, nbytes: int) -> None:
        """Pin a free block for ``nbytes`` on the pool's helper thread (without the GIL while it pins).

        At most ``max_pending`` pins wait at once: a burst of batches staged
        before the first block is pinned (many batches, one call) stages the
        rest in pageable memory instead of pinning a block for each.
        """
        with self._lock:
            # Failed pins stay until settle() reports them; finished ones go.
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
            if sum(not f.done() for f in self._pending) >= self.max_pending:
                return
            self._pending.append(_backend.thread_pool("staging-pin", 1).submit(self.pin, nbytes))

    def settle(self) -> None:
        """Wait for the blocks :meth:`pin_later` was asked for (their errors are raised here)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()


_STAGING_LOCK = threading.Lock()
_STAGING: list[StagingPool] = []  # the process's staging pool over CuPy's pinned pool


def staging_pool() -> StagingPool:
    """The process's :class:`StagingPool` of page-locked batch blocks (made on first use)."""
    with _STAGING_LOCK:
        if not _STAGING:
            _STAGING.append(StagingPool(_alloc_pinned))
        return _STAGING[0]


@contextmanager
def staging_pool_scope(pool: StagingPool) -> Iterator[StagingPool]:
    """Stage the process's batches in ``pool`` while the block runs (a fresh pool: as a new process would)."""
    with _STAGING_LOCK:
        before = list(_STAGING)
        _STAGING[:] = [pool]
    try:
        yield pool
    finally:
        with _STAGING_LOCK:
            _STAGING[:] = before


def staging_block(nbytes: int) -> np.ndarray:
    """A block of ``nbytes`` to stage a batch in: page-locked when the pool has one free.

    Otherwise pageable memory for this batch (its copies to the GPU then
    return once the data has left it, a few milliseconds more than from
    page-locked memory) and a page-locked block pinned for later batches on
    a helper thread.
    """
    pool = staging_pool()
    block = pool.lend(nbytes)
    if block is None:
        pool.pin_later(nbytes)
        block = np.empty(max(1, int(nbytes)), dtype=np.uint8)
    return block


def pinned_arrays(specs: Sequence[tuple[int, Any]], keep: list,
                  alloc: Callable[[int], Any] | None = None) -> list[np.ndarray]:
    """Arrays of ``specs`` (``(count, dtype)`` each) over ONE page-locked block.

    Each page-locked allocation a process makes costs milliseconds
    (``cudaHostAlloc`` pins its pages); the arrays of one batch come from one
    block instead of one each (:func:`staging_block`: a free block of the
    staging pool, else pageable memory this once). ``keep`` holds the block
    until the caller's copies are done (see :func:`pinned_empty`);
    ``alloc(nbytes)`` gives a block instead (any object with the buffer
    protocol).
    """
    _offsets, total = carve_layout(specs)
    mem = (alloc or staging_block)(total)
    keep.append(mem)
    return carve(mem, specs)


class PinnedArena:
    """Small page-locked buffers carved in turn from shared slabs.

    Buffers of at most ``largest`` bytes (status read-backs, row lists) come
    from the current slab of ``slab_bytes``; when it is used up a new one is
    taken. A slab goes back to ``alloc``'s pool once no buffer carved from it
    is held (each holder's ``keep`` list holds the slab), so a process pays
    one allocation per slab instead of one per buffer. ``alloc(nbytes)``
    returns the slab (an object with the buffer protocol).

    Examples
    --------
    >>> arena = PinnedArena(bytearray, slab_bytes=4096, largest=1024)
    >>> keep = []
    >>> a, b = arena.empty(8, "float64", keep), arena.empty(4, "int32", keep)
    >>> arena.slabs, len(keep), a.nbytes, b.nbytes
    (1, 2, 64, 16)
    """

    def __init__(self, alloc: Callable[[int], Any], *, slab_bytes: int = 1 << 21,
                 largest: int = 1 << 16):
        self.alloc, self.slab_bytes, self.largest = alloc, int(slab_bytes), int(largest)
        self.slabs = 0  # slabs taken so far
        self._lock = threading.Lock()
        self._slab: Any = None
        self._used = 0

    def empty(self, count: int, dtype: Any, keep: list) -> np.ndarray:
        """An array of ``count`` elements; ``keep`` holds its block until the caller drops it."""
        dt = np.dtype(dtype)
        nbytes = max(1, int(count) * dt.itemsize)
        if nbytes > self.largest:
            mem = self.alloc(nbytes)
            keep.append(mem)
            return np.frombuffer(mem, dtype=dt, count=int(count))
        with self._lock:
            start = -(-self._used // CARVE_ALIGN) * CARVE_ALIGN
            if self._slab is None or start + nbytes > self.slab_bytes:
                self._slab, start = self.alloc(self.slab_bytes), 0
                self.slabs += 1
            slab = self._slab
            self._used = start + nbytes
        keep.append(slab)
        return np.frombuffer(slab, dtype=dt, count=int(count), offset=start)


_ARENA_LOCK = threading.Lock()
_ARENA: list[PinnedArena] = []  # the process's arena over CuPy's pinned pool, made on first use


def pinned_empty(count: int, dtype: Any, keep: list) -> np.ndarray:
    """A NumPy array of ``count`` elements over page-locked memory from CuPy's pinned pool.

    The pool hands a block out again as soon as its owner is freed, even while
    an asynchronous copy from or to it is still queued: ``keep`` (a list the
    caller holds until its copies are done) keeps the block alive. Small
    arrays share slabs (:class:`PinnedArena`): a fresh process would
    otherwise pay one ``cudaHostAlloc`` for each.
    """
    with _ARENA_LOCK:
        if not _ARENA:
            _ARENA.append(PinnedArena(_alloc_pinned))
        arena = _ARENA[0]
    return arena.empty(count, dtype, keep)
