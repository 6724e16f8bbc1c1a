"""Host threads: how many a piece of host work uses, and how the caller and helpers claim it.

Host work that can be cut into pieces which release the GIL (Numba
``nogil`` kernels, SuperLU's solves) runs here: the batched Krylov kernels
on the CPU (:mod:`managed_solve.solvers.batched.cpu`), ``solve_many``'s
input checks (:mod:`managed_solve.scheduling.validate`), the columns of a
host LU's solves (:mod:`managed_solve.solvers.direct`) and the LU workers
of a run (:mod:`managed_solve.scheduling.runner`). :func:`threads_for` and
:func:`row_threads` say how many threads a piece of work uses
(:func:`host_cores` the most); :func:`run_claimed` shares tasks out over
the calling thread and helpers, :func:`claim_order` orders systems into
tasks and :func:`run_kernels` (with :func:`work_ranges`) calls kernels over
ranges of items, :func:`run_ordered` over systems claimed largest first.

- Many tasks: the calling thread and up to ``threads_for(...) - 1``
  helpers each take the next task (largest predicted work first) and run
  it, a serial kernel that releases the GIL (:func:`run_claimed`).
  Nothing waits at a barrier while tasks run: a helper the operating
  system leaves unscheduled (other processes on the cores) claims
  nothing, and the caller runs what it would have. So work on two threads
  never takes longer than on one, beyond the one task each helper has in
  hand when the caller runs out of work, and tasks are claimed largest
  first, so that tail is the shortest.
- Work whose prediction is below the setting ``host_parallel_min_work``
  (stored entries times predicted iterations, about a nanosecond each on
  one core) stays on the calling thread: a helper's wake-up costs tens of
  microseconds.
- One system: serial sweeps, unless the host has at least
  ``host_row_parallel_min_cores`` cores and the system at least
  ``host_row_parallel_min_rows`` rows (:func:`row_threads`). The
  row-parallel layout ends each of its three (CG) or five (BiCGStab)
  sweeps an iteration at a barrier that waits for the slowest thread, so
  on a small host with other processes running it loses more than the
  threads gain (measured in the CPU section of ``docs/performance.md``).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numba
import numpy as np

from . import _backend, config

#: A task (one claim) holds systems until their predicted work reaches this
#: fraction of ``host_parallel_min_work``: tiny systems are claimed a few at a
#: time, so a kernel call's dispatch (microseconds) stays a small part of it.
TASK_FRACTION = 0.25


def host_cores() -> int:
    """Threads host work may use: the setting ``host_threads``, else every core allowed.

    Without the setting: the cores this process may run on (its CPU
    affinity), and no more than ``NUMBA_NUM_THREADS`` (a process told to
    keep Numba to fewer threads, one of several on a host, is not
    oversubscribed here either).
    """
    limit = config.current().host_threads
    if limit:
        return max(1, int(limit))
    cores = _backend.cpu_count()
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        cores = min(cores, len(affinity(0)))
    return max(1, min(cores, int(numba.config.NUMBA_NUM_THREADS)))


def threads_for(work: float, tasks: int, *, cores: int | None = None) -> int:
    """Threads for host work of predicted ``work`` (entries x iterations) in ``tasks`` claims.

    One below the setting ``host_parallel_min_work`` or with a single task;
    otherwise as many as there are cores (``cores``, default
    :func:`host_cores`) and tasks.

    Examples
    --------
    >>> threads_for(1e9, 40, cores=2), threads_for(1e9, 1, cores=2), threads_for(10.0, 40, cores=2)
    (2, 1, 1)
    """
    cores = host_cores() if cores is None else max(1, int(cores))
    if tasks < 2 or work < config.current().host_parallel_min_work:
        return 1
    return min(cores, tasks)


def row_threads(n: int, *, cores: int | None = None) -> int:
    """Threads for one system's row-parallel sweeps: 1 (serial) unless the host and system are large.

    Examples
    --------
    >>> row_threads(1 << 20, cores=2), row_threads(1 << 20, cores=16), row_threads(10_000, cores=16)
    (1, 16, 1)
    """
    settings = config.current()
    cores = host_cores() if cores is None else max(1, int(cores))
    if cores < settings.host_row_parallel_min_cores or n < settings.host_row_parallel_min_rows:
        return 1
    return cores


def claim_order(work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(systems largest ``work`` first, task boundaries in that order) for :func:`run_claimed`.

    A task holds one system, or several small ones until their work reaches
    ``TASK_FRACTION`` of ``host_parallel_min_work``.

    Examples
    --------
    >>> order, bounds = claim_order(np.array([1e3, 1e9, 2e3, 5e8]))
    >>> order.tolist(), bounds.tolist()
    ([1, 3, 2, 0], [0, 1, 2, 4])
    """
    order = np.argsort(-work, kind="stable")
    least = TASK_FRACTION * config.current().host_parallel_min_work
    bounds = [0]
    acc = 0.0
    for k, w in enumerate(work[order].tolist()):
        acc += w
        if acc >= least:
            bounds.append(k + 1)
            acc = 0.0
    if bounds[-1] != len(order):
        bounds.append(len(order))
    return order, np.asarray(bounds, dtype=np.int64)


def run_claimed(task: Callable[[int], None], count: int, threads: int,
                pool: Executor | None = None) -> list[int]:
    """Run ``task(k)`` for every ``k`` in ``range(count)`` on the caller and up to ``threads - 1`` helpers.

    Each participant claims the next ``k`` when it is free; the caller
    works too and then waits only for tasks already claimed. A helper that
    never runs (busy cores) costs nothing but its hand-off, so the call is
    never slower than the caller alone by more than the tasks helpers hold
    when the last one is claimed. ``task`` should release the GIL (a Numba
    ``nogil`` kernel) for the threads to overlap.

    Returns the number of tasks each participant ran, the caller's first.
    The first exception a task raised is raised again after every claimed
    task finished.

    ``pool`` is the executor the helpers are submitted to; by default the
    process-wide ``host-kernels`` pool (:func:`managed_solve._backend.thread_pool`),
    which other callers share, so a helper may wait behind their work.

    Examples
    --------
    >>> seen = []
    >>> sum(run_claimed(seen.append, 5, 2)), sorted(seen)
    (5, [0, 1, 2, 3, 4])
    """
    helpers = max(0, min(int(threads), count) - 1)
    if helpers == 0:
        for k in range(count):
            task(k)
        return [count]
    claims = itertools.count()  # next() is atomic under the GIL
    ran = [0] * (helpers + 1)
    left = [count]
    lock = threading.Lock()
    finished = threading.Event()
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        while True:
            k = next(claims)
            if k >= count:
                return
            try:
                task(k)
            except BaseException as exc:  # noqa: BLE001 - raised again by the caller
                errors.append(exc)
            finally:
                ran[slot] += 1
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        finished.set()

    if pool is None:
        pool = _backend.thread_pool("host-kernels", max(1, _backend.cpu_count() - 1))
    for slot in range(1, helpers + 1):
        pool.submit(work, slot)
    work(0)
    finished.wait()
    if errors:
        raise errors[0]
    return ran


def work_ranges(work: np.ndarray, threads: int, per_thread: int = 4) -> list[tuple[int, int]]:
    """Consecutive ranges of about equal ``work``, about ``per_thread`` per thread.

    Examples
    --------
    >>> work_ranges(np.ones(8), 1), work_ranges(np.ones(8), 2, per_thread=2)
    ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)])
    """
    count = len(work)
    parts = max(1, min(count, per_thread * threads))
    if parts == 1:
        return [(0, count)]
    edges = np.cumsum(work)
    cuts = np.searchsorted(edges, np.linspace(0.0, float(edges[-1]), parts + 1)[1:-1], side="right")
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < count)), count]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def run_kernels(jobs: Sequence[tuple[Any, tuple, np.ndarray]], work: float, count: int,
                per_thread: int = 4) -> int:
    """Run ``kernel(lo, hi, *args)`` over ranges of each job's items, on the caller and helpers.

    ``jobs``: ``(kernel, args, weights)`` with one weight per item of the
    job (its predicted work); each job's items are cut into ranges of about
    equal weight, about ``per_thread`` per thread, claimed by the calling
    thread and the helpers (:func:`run_claimed`). ``work`` (predicted
    nanoseconds, about) and ``count`` (items in all) decide the threads, by
    :func:`threads_for`. The kernels are called here, so the caller hands
    over no callback. Returns the threads used.
    """
    if not count:
        return 0
    threads = threads_for(work, count)
    tasks = [(kernel, lo, hi, args) for kernel, args, weights in jobs
             for lo, hi in work_ranges(weights, threads, per_thread)]

    def task(k: int) -> None:
        kernel, lo, hi, args = tasks[k]
        kernel(lo, hi, *args)

    run_claimed(task, len(tasks), threads)
    return threads


def run_ordered(kernel: Any, work: np.ndarray, args: tuple) -> int:
    """Run ``kernel(order, start, stop, *args)`` over items claimed largest ``work`` first.

    ``order`` lists the items by decreasing work and each task is the slice
    ``order[start:stop]``, one item or several small ones
    (:func:`claim_order`), claimed by the calling thread and the helpers
    (:func:`run_claimed`) over the threads :func:`threads_for` grants. The
    kernel is called here, so the caller hands over no callback. Returns the
    threads used.

    Examples
    --------
    >>> seen = []
    >>> run_ordered(lambda order, a, b, out: out.extend(order[a:b].tolist()), np.array([1.0, 3.0]),
    ...             (seen,)), seen
    (1, [1, 0])
    """
    order, bounds = claim_order(work)
    tasks = len(bounds) - 1
    threads = threads_for(float(work.sum()), tasks)
    starts, stops = bounds[:-1].tolist(), bounds[1:].tolist()
    run_claimed(lambda k: kernel(order, starts[k], stops[k], *args), tasks, threads)
    return threads
