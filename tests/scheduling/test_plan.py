"""Planning for solve_many: packing, longest-first dispersal, split, the plan of a call, its balance."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from managed_solve.devices import Device, DeviceWarning, forget_warnings
from managed_solve.manager import DeviceManager
from managed_solve.scheduling.plan import (
    BATCH,
    SINGLE,
    Batch,
    Estimate,
    Slot,
    choose_slot,
    disperse,
    imbalance,
    pack,
    pack_band,
    plan_work,
    split,
    target_rows,
)
from managed_solve.system.cost import bytes_per_iteration, predict_iterations, solve_bytes


def krylov_estimate(i: int, m: int, method: str = "cg", group=("cg", "float64", False)) -> Estimate:
    n, nnz = m * m, 5 * m * m - 4 * m
    cost = bytes_per_iteration(n, nnz, method=method) * predict_iterations(n, method=method)
    return Estimate(i, n, nnz, solve_bytes(n, nnz, method=method), cost, BATCH, group)


def test_pack_keeps_every_system_once_groups_apart_and_large_alone():
    rng = np.random.default_rng(3)
    es = [krylov_estimate(i, int(m)) for i, m in enumerate(rng.integers(4, 30, size=300))]
    es += [krylov_estimate(300 + i, int(m), "bicgstab", ("bicgstab", "float64", False))
           for i, m in enumerate(rng.integers(4, 30, size=50))]
    es.append(krylov_estimate(350, 200))  # 40,000 rows: more than a batch, alone
    es.append(Estimate(351, 10, 10, 1000, 1e4, SINGLE, ("gmres", "float64")))
    rows = 8192
    batches, too_big = pack(es, rows=rows, max_bytes=1 << 30)
    assert not too_big
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(len(es)))
    by_index = {e.index: e for e in es}
    for b in batches:
        assert len({by_index[i].group for i in b.indices}) == 1
        assert b.n == sum(by_index[i].n for i in b.indices)
        assert b.cost == pytest.approx(sum(by_index[i].cost for i in b.indices))
        if b.nsys > 1:
            biggest = max(by_index[i].n for i in b.indices)
            assert b.n <= rows + biggest
    alone = [b for b in batches if 350 in b.indices or 351 in b.indices]
    assert [b.nsys for b in alone] == [1, 1]
    assert next(b for b in alone if 351 in b.indices).route == SINGLE


def test_pack_spreads_rows_evenly():
    es = [krylov_estimate(i, 10) for i in range(1000)]  # 100,000 rows
    batches, _ = pack(es, rows=30_000, max_bytes=1 << 30)
    assert len(batches) == 4  # ceil(100k / 30k), no remainder batch
    assert {b.n for b in batches} == {25_000}


def test_pack_respects_max_bytes_and_reports_what_fits_nowhere():
    es = [krylov_estimate(i, 10) for i in range(100)]
    es.append(krylov_estimate(100, 300))
    cap = 20 * es[0].nbytes
    batches, too_big = pack(es, rows=1 << 20, max_bytes=cap)
    assert [e.index for e in too_big] == [100]
    assert all(b.nbytes <= cap for b in batches)
    assert sum(b.nsys for b in batches) == 100


def test_target_rows_fills_a_gpu_and_leaves_several_batches_elsewhere():
    assert target_rows(1_870_000, 1, "cuda") == 1 << 20
    assert target_rows(100_000_000, 2, "cuda") == 100_000_000 // 8
    assert target_rows(200_000, 2, "sim") == 25_000


def skewed_mix() -> list[Estimate]:
    """10 large systems (200^2 unknowns, each alone) and 2,000 tiny ones (16^2..64^2).

    The large ones carry a third of the predicted work, each about 3% of it.
    """
    rng = np.random.default_rng(7)
    es = [krylov_estimate(i, 200) for i in range(10)]
    es += [krylov_estimate(10 + i, int(m)) for i, m in enumerate(rng.integers(16, 65, size=2000))]
    return es


@pytest.mark.parametrize("speeds", [(1.0, 1.0, 1.0, 1.0), (2.0, 1.0, 1.0, 0.5)])
def test_dispersal_of_a_skewed_mix_is_balanced(speeds):
    es = skewed_mix()
    slots = [Slot(f"sim:{k}", 8 << 30, 1e11 * s) for k, s in enumerate(speeds)]
    rows = target_rows(sum(e.n for e in es), len(slots), "sim")
    batches, too_big = pack(es, rows=rows, max_bytes=8 << 30)
    assert not too_big
    assert all(b.nsys == 1 for b in batches if any(i < 10 for i in b.indices))
    queues, unplaced = disperse(batches, slots)
    assert not unplaced
    total_seconds = sum(e.cost for e in es) / sum(s.speed for s in slots)  # ideal finish
    for s in slots:
        assert abs(s.busy - total_seconds) <= 0.10 * total_seconds, (s.name, s.busy, total_seconds)
        assert sum(b.cost for b in queues[s.name]) / s.speed == pytest.approx(s.busy)
    placed = sorted(i for q in queues.values() for b in q for i in b.indices)
    assert placed == list(range(len(es)))
    # Longest first: each queue runs its longest batch first.
    for q in queues.values():
        costs = [b.cost for b in q]
        assert costs == sorted(costs, reverse=True)


def test_dispersal_skips_devices_without_room_and_reports_unplaced():
    slots = [Slot("sim:0", 1000, 1e9), Slot("sim:1", 10_000, 1e9)]
    bs = [Batch(0, [0], BATCH, (), 10, 10, 5000, 1e9), Batch(1, [1], BATCH, (), 10, 10, 50_000, 1e9),
          Batch(2, [2], BATCH, (), 10, 10, 500, 1e9)]
    queues, unplaced = disperse(bs, slots)
    assert [b.id for b in queues["sim:1"]] == [0]
    assert [b.id for b in queues["sim:0"]] == [2]
    assert [b.id for b in unplaced] == [1]
    assert imbalance(slots) == 0.0


def test_choose_slot_avoids_devices_the_batch_failed_on():
    slots = [Slot("sim:0", 1 << 20, 1e9), Slot("sim:1", 1 << 20, 1e9, busy=5.0)]
    b = Batch(0, [0, 1], BATCH, (), 10, 10, 100, 1e9)
    assert choose_slot(b, slots).name == "sim:0"
    b.tried = frozenset({"sim:0"})
    assert choose_slot(b, slots).name == "sim:1"
    b.tried = frozenset({"sim:0", "sim:1"})
    assert choose_slot(b, slots) is None


def test_split_halves_partition_by_rows_and_remember_failures():
    es = {i: krylov_estimate(i, m) for i, m in enumerate([30, 10, 10, 10, 5, 5])}
    b = Batch(0, list(es), BATCH, es[0].group, sum(e.n for e in es.values()),
              sum(e.nnz for e in es.values()), sum(e.nbytes for e in es.values()),
              sum(e.cost for e in es.values()), tried=frozenset({"sim:0"}))
    halves = split(b, es, next_id=7)
    assert [h.id for h in halves] == [7, 8]
    assert halves[0].indices + halves[1].indices == b.indices
    assert halves[0].indices == [0]  # 900 of 1,250 rows: past half at once
    assert all(h.tried == {"sim:0"} for h in halves)
    assert sum(h.nbytes for h in halves) == b.nbytes
    one = Batch(9, [0], BATCH, (), 900, 4380, 10, 1.0)
    assert split(one, es, next_id=10) == [one]


@pytest.mark.parametrize("seed", range(6))
def test_band_cuts_by_numpy_equal_the_system_by_system_loop(seed):
    """The array path of pack_band (no batch near max_bytes) cuts where the plain loop does."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 400))
    members = [Estimate(int(i), int(n), 5 * int(n), int(rng.integers(1, 1000)), float(rng.random()))
               for i, n in zip(rng.permutation(count), rng.integers(1, 5000, count), strict=True)]
    rows = int(rng.choice([100, 2000, 50_000, 10**7]))
    # max_bytes: every batch far below it (the array path), or near it (the loop throughout).
    for max_bytes in (1 << 40, 3000):
        loop, arrays = [], []
        pack_band(members, rows, max_bytes, lambda m: sum(e.nbytes for e in m),
                   lambda m, sums=None, out=loop: out.append([e.index for e in m]))
        pack_band(members, rows, max_bytes, lambda m: sum(e.nbytes for e in m),
                   lambda m, sums=None, out=arrays: out.append(([e.index for e in m], sums)),
                   np.array([e.n for e in members]))
        assert [ix for ix, _ in arrays] == loop
        for ix, sums in arrays:
            if sums is not None:  # the array path's sums are the batch's own
                mine = [e for e in members if e.index in set(ix)]
                assert sums == (ix, sum(e.n for e in mine), sum(e.nnz for e in mine),
                                sum(e.cost for e in mine))
        assert sorted(i for ix in loop for i in ix) == sorted(e.index for e in members)


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
    plan = plan_work(es, gpus, dm, slots=slots)
    assert plan.rows >= 1 << 20  # GPU-sized batches: the case where the large ones were lumped
    check_w2_large_plan(plan, es)


def test_w2_large_on_two_simulated_gpus_splits_the_large_systems_and_balances():
    dm = DeviceManager(simulate="2x80GiB")
    es = w2_large_estimates(2_000)
    check_w2_large_plan(plan_work(es, dm.accelerators, dm), es)


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


def skewed_estimates(n_large=10, n_tiny=2000):
    rng = np.random.default_rng(13)
    sizes = [200] * n_large + [int(m) for m in rng.integers(16, 65, size=n_tiny)]
    out = []
    for i, m in enumerate(sizes):
        n, nnz = m * m, 5 * m * m - 4 * m
        cost = bytes_per_iteration(n, nnz) * predict_iterations(n)
        out.append(Estimate(i, n, nnz, solve_bytes(n, nnz), cost, "batch", ("cg", "float64", False)))
    return out


def test_plan_of_a_skewed_mix_is_balanced_over_four_devices():
    dm = DeviceManager(simulate="4x8GiB")
    es = skewed_estimates()
    plan = plan_work(es, dm.accelerators, dm)
    ideal = sum(e.cost for e in es) / sum(dm.speed(d) for d in dm.accelerators)
    for name, t in plan.finish_times().items():
        assert abs(t - ideal) <= 0.10 * ideal, (name, t, ideal)
    assert sorted(i for q in plan.queues.values() for b in q for i in b.indices) == list(range(len(es)))


def true_finish(plan, true_speed):
    return {name: sum(b.cost for b in q) / true_speed[name] for name, q in plan.queues.items()}


def test_learned_speeds_balance_the_second_call_better():
    """sim:1 is 2x slower than predicted; after one call's records the plan shifts work off it."""
    dm = DeviceManager(simulate="2x8GiB")
    true_speed = {"sim:0": dm.speed(dm.accelerators[0]), "sim:1": dm.speed(dm.accelerators[1]) / 2}
    es = skewed_estimates(4, 400)

    def run(plan):
        # What the workers do after each batch: record its measured time, here
        # the time the batch takes at the device's true speed.
        for name, q in plan.queues.items():
            for b in q:
                dm.record(("solve_many", b.route, b.group), b.cost / true_speed[name], b.nbytes,
                          device=name, cost=b.cost)
        t = true_finish(plan, true_speed)
        return max(t.values()) / (sum(t.values()) / len(t)) - 1.0

    first = run(plan_work(es, dm.accelerators, dm))
    second = run(plan_work(es, dm.accelerators, dm))
    assert first > 0.25  # the naive plan gives both devices the same work
    assert second < 0.05 < first
    assert dm.speed(dm.accelerators[1]) == pytest.approx(true_speed["sim:1"], rel=0.01)


def placed_on(plan) -> dict[int, str]:
    """Each planned system's device, checking that it is planned once."""
    where: dict[int, str] = {}
    for name, q in plan.queues.items():
        for b in q:
            for i in b.indices:
                assert i not in where, f"systems[{i}] planned twice"
                where[i] = name
    return where


def test_pinned_systems_are_batched_apart_on_their_devices_and_the_rest_dispersed_around_them():
    """A pinned system goes to its device (the CPU too), in batches of pinned systems only."""
    dm = DeviceManager(simulate="2x1GiB")
    sim0, sim1 = dm.accelerators
    es = [krylov_estimate(i, 12) for i in range(40)]
    pins = {i: sim1 for i in range(0, 40, 4)} | {1: dm.cpu, 2: sim0}
    plan = plan_work(es, dm.accelerators, dm, pins=pins)
    where = placed_on(plan)
    assert sorted(where) == list(range(40))
    assert {i: where[i] for i in pins} == {i: str(d) for i, d in pins.items()}
    for name, q in plan.queues.items():
        for b in q:
            pinned = [i in pins for i in b.indices]
            assert all(pinned) or not any(pinned)  # never mixed with unpinned systems
            assert b.pin == (name if pinned[0] else None)
        costs = [b.cost for b in q]
        assert costs == sorted(costs, reverse=True)  # longest first, pinned ones among the rest
    # The unpinned ones are dispersed over both devices (never onto the CPU), around the pinned work.
    assert {where[i] for i in range(40) if i not in pins} == {"sim:0", "sim:1"}
    assert plan.pins == pins
    assert sum(b.nsys for b in plan.queues["sim:1"] if b.pin) == 10
    without = plan_work(es, dm.accelerators, dm)  # no pins: every system dispersed
    assert all(b.pin is None for q in without.queues.values() for b in q)
    assert "cpu" not in without.queues


def test_a_pinned_system_too_large_for_its_device_stays_there_and_is_neither_sharded_nor_spilled():
    dm = DeviceManager(simulate="2x8MiB")
    sim1 = dm.accelerators[1]
    es = [krylov_estimate(0, 300), krylov_estimate(1, 10), krylov_estimate(2, 10)]  # 0: ~10 MB
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing spills: no DeviceWarning
        plan = plan_work(es, dm.accelerators, dm, pins={0: sim1})
    assert placed_on(plan)[0] == "sim:1" and plan.sharded == []
    (big,) = [b for b in plan.queues["sim:1"] if 0 in b.indices]
    assert big.indices == [0] and big.pin == "sim:1" and big.nbytes > dm.available_bytes(sim1)
    unpinned = plan_work(es, dm.accelerators, dm)  # the same system unpinned is sharded
    assert unpinned.sharded == [0]


def test_a_system_that_fits_on_no_gpu_spills_to_the_cpu_with_one_device_warning_a_process():
    """The plan's spills warn as the manager's do: a DeviceWarning, once per process."""
    dm = DeviceManager(simulate="1x1MiB")
    es = [krylov_estimate(0, 300), krylov_estimate(1, 10)]  # 0: ~10 MB, one GPU: not sharded
    forget_warnings()
    try:
        with pytest.warns(DeviceWarning, match=r"fit on no GPU \(sim:0: .* free\).*Fix: "):
            plan = plan_work(es, dm.accelerators, dm)
        assert [b.indices for b in plan.queues["cpu"]] == [[0]]
        assert placed_on(plan)[1] == "sim:0"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plan_work(es, dm.accelerators, dm)  # once per process
            dm.reserve(10 << 20).release()  # the manager's own spills share the once
        forget_warnings()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a call on the CPU alone spills nothing
            cpu_only = DeviceManager(devices=["cpu"])
            plan_work(es, [cpu_only.cpu], cpu_only)
    finally:
        forget_warnings()
