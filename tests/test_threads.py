"""Host threads (``managed_solve/_threads.py``): the policy and the claims.

Two threads must never make host work slower than one. That is shown here
by what each thread does, not by timing: a helper that the operating system
leaves unscheduled claims nothing and the caller runs every task itself
without waiting for it; work too small to pay a helper's wake-up runs on
the calling thread alone. (That the batched kernels' answers do not depend
on the thread count is in ``tests/solvers/batched/test_batched_cpu.py``.)
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from managed_solve import _threads, config


def test_policy_one_thread_for_small_work_or_one_task_else_a_thread_per_core():
    least = config.current().host_parallel_min_work
    assert _threads.threads_for(least / 2, 100, cores=2) == 1
    assert _threads.threads_for(least * 10, 1, cores=2) == 1
    assert _threads.threads_for(least * 10, 100, cores=2) == 2
    assert _threads.threads_for(least * 10, 3, cores=16) == 3  # no more threads than tasks
    with config.override(host_threads=1):
        assert _threads.threads_for(least * 10, 100) == 1
    with config.override(host_threads=3):
        assert _threads.host_cores() == 3


def test_host_cores_keep_to_numba_s_thread_limit(monkeypatch):
    """A process told to keep Numba to one thread (one of several on a host) is not oversubscribed."""
    import numba

    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    assert _threads.host_cores() == 1
    assert _threads.threads_for(1e12, 100) == 1
    with config.override(host_threads=2):  # the setting says so explicitly
        assert _threads.host_cores() == 2


def test_policy_one_system_sweeps_serially_on_small_hosts():
    settings = config.current()
    big = settings.host_row_parallel_min_rows
    assert _threads.row_threads(big, cores=2) == 1  # barriers on a shared 2-core host: never
    assert _threads.row_threads(big - 1, cores=64) == 1
    assert _threads.row_threads(big, cores=settings.host_row_parallel_min_cores) \
        == settings.host_row_parallel_min_cores


def test_claims_go_largest_first_and_group_tiny_systems():
    least = _threads.TASK_FRACTION * config.current().host_parallel_min_work
    work = np.array([least / 10] * 30 + [least * 5, least * 2])
    order, bounds = _threads.claim_order(work)
    assert order[:2].tolist() == [30, 31]
    sizes = np.diff(bounds).tolist()
    assert sizes[:2] == [1, 1] and sum(sizes) == 32
    assert all(size <= 10 for size in sizes[2:])  # ten tiny systems reach a task's work
    assert sorted(order.tolist()) == list(range(32))


def test_every_task_runs_once_and_the_counts_add_up():
    seen: list[int] = []
    lock = threading.Lock()

    def task(k):
        with lock:
            seen.append(k)

    ran = _threads.run_claimed(task, 50, 2)
    assert sorted(seen) == list(range(50))
    assert sum(ran) == 50 and len(ran) == 2
    assert _threads.run_claimed(task, 0, 4) == [0]
    assert _threads.run_claimed(task, 3, 1) == [3]


def test_a_helper_that_never_runs_costs_the_caller_no_wait():
    """Busy cores: the helper is queued behind other work and does not start.

    The caller claims and runs every task itself and returns at once; the
    helper, when it finally runs, finds nothing left.
    """
    pool = ThreadPoolExecutor(1)
    release = threading.Event()
    pool.submit(release.wait)  # the pool's only thread is taken
    who: list[str] = []
    try:
        ran = _threads.run_claimed(lambda k: who.append(threading.current_thread().name), 20, 2, pool)
        assert ran == [20, 0]
        assert set(who) == {threading.current_thread().name}
    finally:
        release.set()
        pool.shutdown(wait=True)


def test_a_task_error_is_raised_after_the_other_tasks_ran():
    done: list[int] = []

    def task(k):
        if k == 3:
            raise ValueError("task 3")
        done.append(k)

    with pytest.raises(ValueError, match="task 3"):
        _threads.run_claimed(task, 8, 2)
    assert sorted(done) == [0, 1, 2, 4, 5, 6, 7]


def test_run_kernels_calls_each_kernel_over_ranges_covering_its_items_once():
    """The kernels run here over ranges of about equal weight; the caller hands over no callback."""
    seen: dict[str, list[int]] = {"a": [], "b": []}
    lock = threading.Lock()

    def kernel(lo, hi, name, offset):
        with lock:
            seen[name].extend(range(lo + offset, hi + offset))

    weights_a = np.array([5.0, 1.0, 1.0, 1.0, 8.0, 2.0, 2.0])
    weights_b = np.ones(3)
    with config.override(host_threads=2, host_parallel_min_work=0.0):
        used = _threads.run_kernels([(kernel, ("a", 0), weights_a), (kernel, ("b", 100), weights_b)],
                                    work=1e9, count=10)
    assert used == 2
    assert sorted(seen["a"]) == list(range(7)) and sorted(seen["b"]) == [100, 101, 102]
    assert _threads.run_kernels([], work=0.0, count=0) == 0
    for count in (1, 2, 3, 16):
        ranges = _threads.work_ranges(weights_a, count)
        assert [k for lo, hi in ranges for k in range(lo, hi)] == list(range(7))
        assert len(ranges) <= 4 * count


def test_run_ordered_calls_the_kernel_over_every_item_largest_work_first():
    """Each item once, in tasks of the claim order; the kernel is called here (no callback)."""
    least = _threads.TASK_FRACTION * config.current().host_parallel_min_work
    work = np.array([least / 10] * 12 + [least * 5, least * 3])
    slices: list[list[int]] = []
    lock = threading.Lock()

    def kernel(order, start, stop, out):
        with lock:
            out.append(order[start:stop].tolist())

    with config.override(host_threads=2):
        used = _threads.run_ordered(kernel, work, (slices,))
    assert used == 2
    assert sorted(k for part in slices for k in part) == list(range(14))
    order, bounds = _threads.claim_order(work)
    assert sorted(slices) == sorted(order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    assert [12] in slices and [13] in slices  # the two large items are tasks of their own


def test_a_submit_from_a_finaliser_inside_a_submit_is_deferred_not_deadlocked():
    """The garbage collector may run a finaliser (a SuperLU factor's free) inside a submit on
    the same thread, which holds the executor's non-re-entrant lock; the finaliser's own submit
    through on_lane is queued and made once the outer submit returns."""
    from managed_solve import _backend

    ran: list[str] = []

    class Lane(ThreadPoolExecutor):
        """An executor whose submit holds a plain lock, and runs a hook inside it (the GC)."""

        def __init__(self):
            super().__init__(1)
            self.lock, self.hook = threading.Lock(), None

        def submit(self, fn, *args):
            if not self.lock.acquire(timeout=5):
                raise AssertionError("a submit waited on its own thread's lock")
            try:
                hook, self.hook = self.hook, None
                if hook is not None:
                    hook()
                return super().submit(fn, *args)
            finally:
                self.lock.release()

    lane = Lane()
    try:
        lane.hook = lambda: _backend.on_lane(lane, ran.append, "finaliser")
        _backend.on_lane(lane, ran.append, "caller").result()
        lane.submit(lambda: None).result()  # the lane runs in order: both done by now
        assert ran == ["caller", "finaliser"]
    finally:
        lane.shutdown()
