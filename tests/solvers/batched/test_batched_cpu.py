"""Host threads of the batched CPU kernels (``solvers/batched/cpu.py``): the policy and the claims.

Two threads must never make a batch slower than one. That is shown here by
what each thread does, not by timing: a helper that the operating system
leaves unscheduled claims nothing and the caller runs every task itself
without waiting for it; a batch too small to pay a helper's wake-up runs on
the calling thread alone; and the answers do not depend on the thread count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from managed_solve import LinearSystem, config
from managed_solve.solvers.batched import (
    PackedBatch,
    bicgstab_batched,
    cg_batched,
    cpu,
    gmres_batched,
)
from tests._problems import poisson2d, upwind


def test_policy_one_thread_for_small_work_or_one_task_else_a_thread_per_core():
    least = config.current().host_parallel_min_work
    assert cpu.threads_for(least / 2, 100, cores=2) == 1
    assert cpu.threads_for(least * 10, 1, cores=2) == 1
    assert cpu.threads_for(least * 10, 100, cores=2) == 2
    assert cpu.threads_for(least * 10, 3, cores=16) == 3  # no more threads than tasks
    with config.override(host_threads=1):
        assert cpu.threads_for(least * 10, 100) == 1
    with config.override(host_threads=3):
        assert cpu.host_cores() == 3


def test_host_cores_keep_to_numba_s_thread_limit(monkeypatch):
    """A process told to keep Numba to one thread (one of several on a host) is not oversubscribed."""
    import numba

    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    assert cpu.host_cores() == 1
    assert cpu.threads_for(1e12, 100) == 1
    with config.override(host_threads=2):  # the setting says so explicitly
        assert cpu.host_cores() == 2


def test_policy_one_system_sweeps_serially_on_small_hosts():
    settings = config.current()
    big = settings.host_row_parallel_min_rows
    assert cpu.row_threads(big, cores=2) == 1  # barriers on a shared 2-core host: never
    assert cpu.row_threads(big - 1, cores=64) == 1
    assert cpu.row_threads(big, cores=settings.host_row_parallel_min_cores) \
        == settings.host_row_parallel_min_cores


def test_a_batch_of_small_systems_stays_on_the_calling_thread():
    """W2's smallest systems, a few of them: less work than a helper's wake-up is worth."""
    systems = [LinearSystem(poisson2d(m), np.ones(m * m), rtol=1e-8) for m in (4, 5, 6, 7)]
    batch = PackedBatch.pack(systems)
    work = cpu.system_work(batch.offsets, batch.indptr, batch.rtol, batch.maxiter, "cg")
    order, bounds = cpu.claim_order(work)
    assert cpu.threads_for(float(work.sum()), len(bounds) - 1) == 1
    assert len(bounds) == 2  # and the four are one task: one kernel call


def test_claims_go_largest_first_and_group_tiny_systems():
    least = cpu.TASK_FRACTION * config.current().host_parallel_min_work
    work = np.array([least / 10] * 30 + [least * 5, least * 2])
    order, bounds = cpu.claim_order(work)
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

    ran = cpu.run_claimed(task, 50, 2)
    assert sorted(seen) == list(range(50))
    assert sum(ran) == 50 and len(ran) == 2
    assert cpu.run_claimed(task, 0, 4) == [0]
    assert cpu.run_claimed(task, 3, 1) == [3]


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
        ran = cpu.run_claimed(lambda k: who.append(threading.current_thread().name), 20, 2, pool)
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
        cpu.run_claimed(task, 8, 2)
    assert sorted(done) == [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("solve", [cg_batched, bicgstab_batched, gmres_batched])
def test_answers_do_not_depend_on_the_thread_count(solve):
    """Each system runs serially on one thread: one or two threads give the same bits."""
    rng = np.random.default_rng(3)
    systems = []
    for k, m in enumerate(rng.integers(6, 30, size=24).tolist()):
        A = poisson2d(m) if solve is cg_batched or k % 2 else upwind(m)
        systems.append(LinearSystem(A, rng.standard_normal(m * m), rtol=1e-9))
    batch = PackedBatch.pack(systems)
    outs = {}
    for count in (1, 2):
        with config.override(host_threads=count, host_parallel_min_work=0.0):
            outs[count] = solve(batch)
    one, two = outs[1], outs[2]
    np.testing.assert_array_equal(one.x, two.x)
    assert one.iterations.tolist() == two.iterations.tolist()
    assert one.status.tolist() == two.status.tolist() and (one.status == 0).all()
    # The true residuals the kernels hand the verify rule are those of the answers.
    rn, bn = one.true_norms
    for k, (s, x) in enumerate(zip(systems, batch.unpack(one.x), strict=True)):
        assert rn[k] == pytest.approx(np.linalg.norm(s.b - s.A @ x), rel=1e-9, abs=1e-14)
        assert bn[k] == pytest.approx(np.linalg.norm(s.b), rel=1e-12)


def test_run_systems_uses_the_threads_the_policy_grants(monkeypatch):
    granted = []
    real = cpu.run_claimed

    def spy(task, count, n):
        granted.append((count, n))
        return real(task, count, n)

    monkeypatch.setattr(cpu, "run_claimed", spy)
    small = PackedBatch.pack([LinearSystem(poisson2d(5), np.ones(25)) for _ in range(4)])
    big = PackedBatch.pack([LinearSystem(poisson2d(40), np.ones(1600)) for _ in range(6)])
    with config.override(host_threads=2):
        cg_batched(small)
        cg_batched(big)
    assert granted[0][1] == 1  # too little work for a helper
    assert granted[1] == (6, 2)  # six tasks over two threads


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
        used = cpu.run_kernels([(kernel, ("a", 0), weights_a), (kernel, ("b", 100), weights_b)],
                           work=1e9, count=10)
    assert used == 2
    assert sorted(seen["a"]) == list(range(7)) and sorted(seen["b"]) == [100, 101, 102]
    assert cpu.run_kernels([], work=0.0, count=0) == 0
    for count in (1, 2, 3, 16):
        ranges = cpu.work_ranges(weights_a, count)
        assert [k for lo, hi in ranges for k in range(lo, hi)] == list(range(7))
        assert len(ranges) <= 4 * count
