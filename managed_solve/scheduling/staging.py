"""What a device's stage thread does: the host -> device copy of its next batch.

Each accelerator's worker stages batch k+1 (packs it into one block-diagonal
CSR on its device through the batched engine, and on a GPU builds its
solver workspace) before it computes batch k. The runner submits
:func:`stage` to the device's stage thread; on a GPU the copy runs on a
second CUDA stream (:func:`copy_stream`), so it overlaps the compute; on
simulated devices the same code runs with the pack on the host (there is no
stream), so the pipeline is tested on CPUs. The CPU packs its batches on its
worker (:func:`pack_batch`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .. import _backend
from ..devices import Device
from ..system import LinearSystem
from .plan import Batch


@dataclass
class Staged:
    """A batch whose bytes are reserved and whose copy to the device is under way."""

    batch: Batch
    reservation: Any
    packed: Future | None  # the batched engine's prepared batch on its device (BATCH route only)


def pack_batch(systems: list[LinearSystem], jacobi: bool, dev: Device,
               method: str | Callable[[], str]) -> Any:
    """A batch prepared on its device by the batched engine (``BatchedEngine.prepare_batch``).

    Host systems go over in bulk. On a GPU the solver's workspace is built
    here too (its bytes are in the batch's reservation), off the worker's
    path between two batches. ``method`` is the batch's method, or a
    function that finds it (a deferred method: waited for there, after the
    copy). Simulated devices (``"sim:k"``) get their batches on the host.
    """
    from ..solvers.batched import BatchedEngine

    return BatchedEngine().prepare_batch(systems, str(dev), jacobi=jacobi, method=method)


def stage(systems: list[LinearSystem], jacobi: bool, dev: Device,
          method: str | Callable[[], str]) -> Any:
    """:func:`pack_batch` on a device's stage thread; on a GPU on its copy stream, complete on return."""
    if not dev.is_cuda:
        return pack_batch(systems, jacobi, dev, method)
    cp = _backend.cupy()
    with dev.context():
        stream = copy_stream(cp, dev)
        with stream:
            out = pack_batch(systems, jacobi, dev, method)
        stream.synchronize()  # sync: the copy is complete before the compute stream reads it
        return out


_COPY_STREAMS: dict[str, Any] = {}
_COPY_STREAMS_LOCK = threading.Lock()


def copy_stream(cp: Any, dev: Device) -> Any:
    """One copy stream per GPU for the process (called inside the device's context).

    CuPy's memory pool keeps freed blocks per stream: a stream that lives
    across batches and calls gets its batches' memory back instead of
    allocating anew for each fresh stream.
    """
    key = str(dev)
    with _COPY_STREAMS_LOCK:
        stream = _COPY_STREAMS.get(key)
        if stream is None:
            stream = _COPY_STREAMS[key] = cp.cuda.Stream(non_blocking=True)
        return stream
