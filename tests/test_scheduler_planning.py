"""solve_many's planning path at scale: per-call estimate memo, and the W2-large balance over two GPUs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem
from managed_solve import scheduler as sched
from managed_solve.devices import Device
from managed_solve.manager import DeviceManager
from managed_solve.packing import (
    BATCH,
    Estimate,
    Slot,
    bytes_per_iteration,
    pack,
    predict_iterations,
    solve_bytes,
)
from tests._problems import poisson2d


def shared_matrix_systems() -> list[LinearSystem]:
    """Systems sharing a few matrices, with every option the estimate depends on varied."""
    rng = np.random.default_rng(21)
    P = poisson2d(9)
    U = sp.diags([0.5], [1], shape=P.shape)
    mats = {
        "poisson": P,
        "convection": (P + U - U.T).tocsr(),  # non-symmetric: BiCGStab
        "heat": (sp.identity(81) * 10.0 + P * 0.1).tocsr(),  # easy for CG: no host LU
        "indefinite": (P - sp.identity(81) * 4.5).tocsr(),
    }
    mats["poisson32"] = mats["poisson"].astype(np.float32)
    out = []
    for k in range(200):
        name = list(mats)[k % len(mats)]
        A = mats[name]
        n = A.shape[0]
        out.append(LinearSystem(
            A, rng.standard_normal(n), x0=rng.standard_normal(n) if k % 7 == 0 else None,
            rtol=10.0 ** -(6 + k % 3), maxiter=[None, 30, 5000][k % 3 if k % 11 == 0 else 0],
            method=["auto", "gmres", "cg", "bicgstab", "minres"][k % 5 if k % 4 == 0 else 0],
            M="jacobi" if k % 6 == 0 else None, name=f"{name}{k}"))
    return out


@pytest.mark.parametrize("host_only", [False, True])
def test_estimate_memo_gives_the_estimates_computed_one_by_one(host_only):
    dm = DeviceManager(simulate="2x1GiB")
    systems = shared_matrix_systems()
    cache: dict = {}
    memoised = [sched.estimate(s, i, host_only=host_only, manager=dm, cache=cache)
                for i, s in enumerate(systems)]
    alone = [sched.estimate(s, i, host_only=host_only, manager=dm) for i, s in enumerate(systems)]
    assert memoised == alone
    assert {e.route for e in alone} >= ({"batch", "single", "direct"} if host_only else {"batch", "single"})
    assert len({e.group for e in alone}) >= 4
    # The memo keys on the matrix object: an equal copy is estimated on its own, the same.
    one = systems[1]
    twin = LinearSystem(one.A.copy(), one.b, rtol=one.rtol, name="twin")
    assert sched.estimate(twin, 1, host_only=host_only, manager=dm, cache=cache) == alone[1]


# ----------------------------------------------------------------------------- W2-large balance
def w2_large_estimates(n_small: int) -> list[Estimate]:
    """W2-large as the planner sees it: small 2D Poisson systems (32^2..96^2) + four of 1024^2."""
    rng = np.random.default_rng(1)
    sizes = [int(m) for m in rng.integers(32, 97, size=n_small)] + [1024] * 4
    out = []
    for i, m in enumerate(sizes):
        n, nnz = m * m, 5 * m * m - 4 * m
        its = predict_iterations(n, rtol=1e-8)
        out.append(Estimate(i, n, nnz, solve_bytes(n, nnz), bytes_per_iteration(n, nnz) * its,
                            BATCH, ("cg", "float64", False), None, its))
    return out


def check_w2_large_plan(plan, es) -> None:
    large = {e.index for e in es if e.n >= 1 << 20}
    where = {name: [i for b in q for i in b.indices if i in large] for name, q in plan.queues.items()}
    assert sorted(len(v) for v in where.values() if v) == [2, 2], where
    for q in plan.queues.values():
        for b in q:
            assert b.nsys == 1 or not large & set(b.indices), "a large system shares its batch"
    finish = [t for t in plan.finish_times().values() if t > 0]
    assert len(finish) == 2 and max(finish) <= 1.15 * min(finish), plan.finish_times()
    placed = sorted(i for q in plan.queues.values() for b in q for i in b.indices)
    assert placed == [e.index for e in es]


@pytest.mark.parametrize("n_small", [2_000, 10_000])
def test_w2_large_on_two_gpus_splits_the_large_systems_and_balances(n_small):
    """The planner with GPU-sized batches (kind "cuda"): the 2xH200 W2-large case.

    Nothing runs: the devices are CUDA-kind descriptions with hand-made slots
    (room, and the learned speed of two simulated 80 GiB GPUs).
    """
    dm = DeviceManager(simulate="2x80GiB")
    gpus = [Device("cuda", d.index, "GPU (planning only)", d.total_bytes, bandwidth=d.bandwidth)
            for d in dm.accelerators]
    slots = [Slot(str(g), dm.available_bytes(d), dm.speed(d), 0.0, "cuda")
             for g, d in zip(gpus, dm.accelerators, strict=True)]
    es = w2_large_estimates(n_small)
    plan = sched.plan_work(es, gpus, dm, slots=slots)
    assert plan.rows >= 1 << 20  # GPU-sized batches: the case where the large ones were lumped
    check_w2_large_plan(plan, es)


def test_w2_large_on_two_simulated_gpus_splits_the_large_systems_and_balances():
    dm = DeviceManager(simulate="2x80GiB")
    es = w2_large_estimates(2_000)
    check_w2_large_plan(sched.plan_work(es, dm.accelerators, dm), es)


def test_a_long_system_is_not_lumped_with_many_short_ones():
    """Below the alone threshold, a system of many more iterations gets a batch of its own band."""
    es = [Estimate(i, 1024, 5000, 100_000, 1e6, BATCH, ("cg", "float64", False), None, 60.0)
          for i in range(200)]
    es.append(Estimate(200, 40_000, 200_000, 4_000_000, 1e9, BATCH, ("cg", "float64", False),
                       None, 900.0))
    batches, _ = pack(es, rows=400_000, max_bytes=1 << 40)  # alone only from 100,000 rows
    long = next(b for b in batches if 200 in b.indices)
    assert long.indices == [200]
    assert sum(b.nsys for b in batches) == 201
