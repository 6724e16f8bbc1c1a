"""Planning for solve_many: cost model against SciPy, packing, longest-first dispersal, split."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve.packing import (
    BATCH,
    SINGLE,
    Batch,
    Estimate,
    Slot,
    bytes_per_iteration,
    choose_slot,
    disperse,
    imbalance,
    pack,
    predict_iterations,
    solve_bytes,
    split,
    target_rows,
)


def poisson2d(m: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 4.0, -1.0], [-1, 0, 1], shape=(m, m))
    S = sp.diags([-1.0, -1.0], [-1, 1], shape=(m, m))
    return (sp.kron(sp.identity(m), T) + sp.kron(S, sp.identity(m))).tocsr()


def krylov_estimate(i: int, m: int, method: str = "cg", group=("cg", "float64", False)) -> Estimate:
    n, nnz = m * m, 5 * m * m - 4 * m
    cost = bytes_per_iteration(n, nnz, method=method) * predict_iterations(n, method=method)
    return Estimate(i, n, nnz, solve_bytes(n, nnz, method=method), cost, BATCH, group)


@pytest.mark.parametrize("m", [24, 48])
def test_predicted_iterations_match_scipy_cg(m):
    A, b = poisson2d(m), np.ones(m * m)
    count = [0]
    spla.cg(A, b, rtol=1e-8, callback=lambda _x: count.__setitem__(0, count[0] + 1))
    assert 0.8 < predict_iterations(m * m, rtol=1e-8) / count[0] < 1.25


def test_bytes_per_iteration_is_the_benchmark_floor():
    # BENCHMARKS.md: nnz*(w+4) + 4n + 11*n*w, about 152 bytes a row for the 5-point stencil.
    m = 512
    A = poisson2d(m)
    per_row = bytes_per_iteration(A.shape[0], A.nnz) / A.shape[0]
    assert 150 < per_row <= 152


def test_solve_bytes_cover_the_arrays():
    A = poisson2d(20)
    stored = A.data.nbytes + A.indices.astype(np.int32).nbytes + A.indptr.astype(np.int32).nbytes
    vectors = 6 * A.shape[0] * 8  # b, x and CG's four work vectors
    assert solve_bytes(A.shape[0], A.nnz, method="cg") >= stored + vectors


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
    """The array path of _pack_band (no batch near max_bytes) cuts where the plain loop does."""
    from managed_solve.packing import _pack_band

    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 400))
    members = [Estimate(int(i), int(n), 5 * int(n), int(rng.integers(1, 1000)), float(rng.random()))
               for i, n in zip(rng.permutation(count), rng.integers(1, 5000, count), strict=True)]
    rows = int(rng.choice([100, 2000, 50_000, 10**7]))
    # max_bytes: every batch far below it (the array path), or near it (the loop throughout).
    for max_bytes in (1 << 40, 3000):
        loop, arrays = [], []
        _pack_band(members, rows, max_bytes, lambda m: sum(e.nbytes for e in m),
                   lambda m, sums=None, out=loop: out.append([e.index for e in m]))
        _pack_band(members, rows, max_bytes, lambda m: sum(e.nbytes for e in m),
                   lambda m, sums=None, out=arrays: out.append(([e.index for e in m], sums)),
                   np.array([e.n for e in members]))
        assert [ix for ix, _ in arrays] == loop
        for ix, sums in arrays:
            if sums is not None:  # the array path's sums are the batch's own
                mine = [e for e in members if e.index in set(ix)]
                assert sums == (ix, sum(e.n for e in mine), sum(e.nnz for e in mine),
                                sum(e.cost for e in mine))
        assert sorted(i for ix in loop for i in ix) == sorted(e.index for e in members)
