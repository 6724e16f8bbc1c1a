"""The batched CPU kernels' host threads (``solvers/batched/cpu.py``): a batch's tasks and its answers.

A batch's systems go out as tasks by their predicted work: a batch too
small to pay a helper's wake-up runs on the calling thread alone, the
threads are those the policy grants, and the answers do not depend on the
thread count. The policy and the claims themselves (``managed_solve._threads``)
are tested in ``tests/test_threads.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from managed_solve import LinearSystem, _threads, config
from managed_solve.solvers.batched import (
    PackedBatch,
    bicgstab_batched,
    cg_batched,
    cpu,
    gmres_batched,
)
from tests._problems import poisson2d, upwind


def test_a_batch_of_small_systems_stays_on_the_calling_thread():
    """W2's smallest systems, a few of them: less work than a helper's wake-up is worth."""
    systems = [LinearSystem(poisson2d(m), np.ones(m * m), rtol=1e-8) for m in (4, 5, 6, 7)]
    batch = PackedBatch.pack(systems)
    work = cpu.system_work(batch.offsets, batch.indptr, batch.rtol, batch.maxiter, "cg")
    order, bounds = _threads.claim_order(work)
    assert _threads.threads_for(float(work.sum()), len(bounds) - 1) == 1
    assert len(bounds) == 2  # and the four are one task: one kernel call


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
    real = _threads.run_claimed

    def spy(task, count, n):
        granted.append((count, n))
        return real(task, count, n)

    monkeypatch.setattr(_threads, "run_claimed", spy)  # cpu.py calls it through _threads
    small = PackedBatch.pack([LinearSystem(poisson2d(5), np.ones(25)) for _ in range(4)])
    big = PackedBatch.pack([LinearSystem(poisson2d(40), np.ones(1600)) for _ in range(6)])
    with config.override(host_threads=2):
        cg_batched(small)
        cg_batched(big)
    assert granted[0][1] == 1  # too little work for a helper
    assert granted[1] == (6, 2)  # six tasks over two threads
