"""Host -> device copies of the next batch while the current one computes.

Each accelerator's worker stages batch k+1 (packs it into one block-diagonal
CSR on its device, and on a GPU builds its solver workspace) before it
computes batch k. On a GPU the copy runs on a second CUDA stream from a
helper thread, so it overlaps the compute; on simulated devices the same code
runs with the pack on the host (there is no stream), so the pipeline is
tested on CPUs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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
    packed: Future | None  # the PackedBatch on its device (BATCH route only)


def pack_batch(systems: list[LinearSystem], jacobi: bool, dev: Device,
               method: str | Callable[[], str]) -> Any:
    """A batch on its device (host systems go over in bulk: see ``PackedBatch.pack``).

    On a GPU the solver's workspace is built here too (its bytes are in the
    batch's reservation), off the worker's path between two batches.
    ``method`` is the batch's method, or a function that finds it (a
    deferred method: waited for here, after the copy). Simulated devices
    (``"sim:k"``) get their batches on the host.
    """
    from ..solvers.batched import PackedBatch, prepare

    packed = PackedBatch.pack(systems, device=str(dev), jacobi=jacobi)
    if dev.is_cuda:
        method = method() if callable(method) else method
        if method in ("cg", "bicgstab"):  # the fused core's; GMRES has none
            prepare(packed, method)
    return packed


def done_future(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` run now, as a finished future (staging without a stager: the CPU)."""
    fut: Future = Future()
    fut.set_result(fn(*args))
    return fut


class Stager:
    """Runs the packing of batches (the host -> device copies) on a helper thread.

    On a GPU the work runs on the device's copy stream (:func:`copy_stream`)
    and is complete when its future is.
    """

    def __init__(self, dev: Device):
        self.dev = dev
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{dev}")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on the helper thread (on a GPU: on its copy stream)."""
        if not self.dev.is_cuda:
            return self.pool.submit(fn, *args)

        def staged():
            cp = _backend.cupy()
            with self.dev.context():
                stream = copy_stream(cp, self.dev)
                with stream:
                    out = fn(*args)
                stream.synchronize()  # sync: the copy is complete before the compute stream reads it
                return out

        return self.pool.submit(staged)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


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
