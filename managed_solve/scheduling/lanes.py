"""Lanes: several batches of one ``solve_many`` call computing at once on one accelerator.

A batch of small systems does not keep a GPU busy from its first
iteration to its last: each iteration is a few short kernels, the host
reads statuses between them, and the batch's last iterations run the few
systems that converge last. Each accelerator therefore runs
``lanes_per_device`` workers (a setting), each computing its batch on its
own CUDA stream (:func:`lane`), so a batch staged while another computes
starts at once instead of after it. This module holds what that asks of
the runner:

- :func:`device_stream`: the process's streams per GPU and role (the stage
  thread's copies, each lane's compute);
- :class:`ShareClock`: a batch's own share of its device while others ran
  beside it, so the device's learned speed counts each batch's time once;
- :class:`Held`: a batch's reservation counted per device, so a
  reservation that finds no room while other batches of the call hold
  bytes there waits for them (the plan leaves room for two batches a
  device, not for one more per lane).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import _backend
from ..devices import Device

_STREAMS: dict[tuple[str, str], Any] = {}
_STREAMS_LOCK = threading.Lock()


def device_stream(cp: Any, dev: Device, role: str) -> Any:
    """One non-blocking stream per GPU and ``role`` for the process (called inside the device's context).

    CuPy's memory pool keeps freed blocks per stream: a stream that lives
    across batches and calls gets its batches' memory back instead of
    allocating anew for each fresh stream.
    """
    key = (str(dev), role)
    with _STREAMS_LOCK:
        stream = _STREAMS.get(key)
        if stream is None:
            stream = _STREAMS[key] = cp.cuda.Stream(non_blocking=True)
        return stream


@contextmanager
def lane(dev: Device, k: int) -> Iterator[None]:
    """Lane ``k`` of ``dev``: on a GPU its stream is the current one while the block runs.

    The batched engine's solve makes its caller's stream wait for its own
    and the true residuals are read on the caller's stream, so two lanes'
    batches share nothing but the GPU. Elsewhere (the host, simulated
    devices) there is no stream and this does nothing.
    """
    if not dev.is_cuda:
        yield
        return
    cp = _backend.cupy()
    with dev.context(), device_stream(cp, dev, f"lane {k}"):
        yield


class ShareClock:
    """Each batch's own share of its device while other batches computed beside it.

    Between two events on a device (a batch starting or ending there) each
    of the ``k`` batches running gets ``1/k`` of the time passed. A batch's
    share over its wall time is the part of the device time measured for it
    (its CUDA events span the other batches' work too) that was its own.

    Examples
    --------
    >>> ticks = iter([0.0, 1.0, 3.0, 4.0])
    >>> clock = ShareClock(lambda: next(ticks))
    >>> clock.begin("cuda:0", "a"); clock.begin("cuda:0", "b")  # at 0 and at 1
    >>> round(clock.end("cuda:0", "a"), 3)  # alone for 1, shared for 2: its own 2 of 3
    0.667
    >>> clock.end("cuda:0", "b")  # shared for 2, alone for 1: its own 2 of 3
    0.6666666666666666
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self._lock = threading.Lock()
        self._running: dict[str, dict[Any, list[float]]] = {}  # device -> key -> [start, own]
        self._last: dict[str, float] = {}

    def _advance(self, device: str, t: float) -> dict[Any, list[float]]:
        running = self._running.setdefault(device, {})
        if running:
            each = (t - self._last[device]) / len(running)
            for rec in running.values():
                rec[1] += each
        self._last[device] = t
        return running

    def begin(self, device: str, key: Any) -> None:
        """``key`` starts computing on ``device`` now."""
        with self._lock:
            t = self.now()
            self._advance(device, t)[key] = [t, 0.0]

    def end(self, device: str, key: Any) -> float:
        """``key`` ended; returns its own share of its wall time there (1.0 when it ran alone)."""
        with self._lock:
            t = self.now()
            start, own = self._advance(device, t).pop(key)
        wall = t - start
        return own / wall if wall > 0 else 1.0


class Held:
    """A batch's reservation, counted in ``counts[name]`` until released.

    Releasing it (also on leaving a ``with`` block) returns the bytes to the
    ledger, then counts the release in ``releases[name]`` and wakes the
    waiters on ``cond``: a worker waiting for room retries then.
    """

    def __init__(self, reservation: Any, name: str, counts: dict[str, int],
                 releases: dict[str, int], cond: threading.Condition):
        self.reservation, self.name = reservation, name
        self.counts, self.releases, self.cond = counts, releases, cond
        self.done = False
        with cond:
            counts[name] = counts.get(name, 0) + 1

    def __enter__(self) -> Held:
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.release()
        return False

    def release(self) -> None:
        self.reservation.release()
        with self.cond:
            if self.done:
                return
            self.done = True
            self.counts[self.name] -= 1
            self.releases[self.name] = self.releases.get(self.name, 0) + 1
            self.cond.notify_all()
