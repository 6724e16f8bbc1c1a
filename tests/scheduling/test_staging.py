"""Staging: the host pack of a batch (one block-diagonal CSR) that the stagers copy to devices."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem
from tests._problems import poisson2d
from tests._problems import poisson2d_skew as convection


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 40])  # one piece; many pieces on the pool
@pytest.mark.parametrize("jacobi", [False, True])
def test_vectorised_host_pack_matches_block_diagonal(jacobi, chunk_nnz):
    from managed_solve.solvers.batched import default_maxiter, pack_host

    rng = np.random.default_rng(30)
    systems = []
    for k, m in enumerate(rng.integers(2, 9, size=7)):
        m = int(m)
        x0 = rng.standard_normal(m * m) if k % 3 == 0 else None
        systems.append(LinearSystem(convection(m) if k % 2 else poisson2d(m), rng.standard_normal(m * m),
                                    x0=x0, rtol=1e-6 * (k + 1), maxiter=50 if k == 2 else None,
                                    name=f"h{k}"))
    # Matrices shared by several systems (read once by the packer), one of them
    # with 64-bit indices (that family is then concatenated, casting).
    wide = poisson2d(4)
    wide.indices, wide.indptr = wide.indices.astype(np.int64), wide.indptr.astype(np.int64)
    for k, A in enumerate([systems[1].A, wide, systems[0].A, wide, systems[1].A]):
        systems.append(LinearSystem(A, rng.standard_normal(A.shape[0]), name=f"shared{k}"))
    assert systems[-1].A is systems[1].A and systems[-2].A is systems[-4].A
    assert systems[-2].A.indices.dtype == np.int64
    blocks = []

    def allocate(specs):  # stands in for the page-locked block used towards GPUs
        from managed_solve._backend import carve, carve_layout

        blocks.append(bytearray(b"\xff" * carve_layout(specs)[1]))  # no zeros to lean on
        return carve(blocks[-1], specs)

    ours = pack_host(systems, jacobi=jacobi, allocate=allocate, chunk_nnz=chunk_nnz)
    assert len(blocks) == 1  # every array of the batch in one block
    for attr in ("indptr", "indices", "data", "b", "x0", "row_sys") + (("dinv",) if jacobi else ()):
        assert getattr(ours, attr).base is not None, attr
        assert np.shares_memory(getattr(ours, attr), np.frombuffer(blocks[0], np.uint8)), attr
    # Reference: SciPy's block diagonal and plain concatenations.
    ref = sp.block_diag([s.A for s in systems], format="csr")
    np.testing.assert_array_equal(ours.indptr, ref.indptr)
    np.testing.assert_array_equal(ours.indices, ref.indices)
    np.testing.assert_array_equal(ours.data, ref.data)
    assert ours.indptr.dtype == ours.indices.dtype == np.int32
    np.testing.assert_array_equal(ours.b, np.concatenate([s.b for s in systems]))
    np.testing.assert_array_equal(
        ours.x0, np.concatenate([s.x0 if s.x0 is not None else np.zeros(s.n) for s in systems]))
    sizes = [s.n for s in systems]
    np.testing.assert_array_equal(ours.offsets, np.concatenate([[0], np.cumsum(sizes)]))
    np.testing.assert_array_equal(ours.row_sys, np.repeat(np.arange(len(systems)), sizes))
    np.testing.assert_array_equal(ours.rtol, [s.rtol for s in systems])
    np.testing.assert_array_equal(ours.maxiter, [s.maxiter or default_maxiter(s.n) for s in systems])
    if jacobi:
        np.testing.assert_allclose(ours.dinv, 1.0 / ref.diagonal())
    else:
        assert ours.dinv is None
    assert ours.names == [s.name for s in systems]


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 30])
def test_host_pack_names_a_system_jacobi_cannot_scale(chunk_nnz):
    systems = [LinearSystem(poisson2d(4), np.ones(16), name=f"z{k}") for k in range(5)]
    A = poisson2d(4).tolil()
    A[2, 2] = 0.0
    systems[3] = LinearSystem(A.tocsr(), np.ones(16), name="zero-diagonal")
    from managed_solve.solvers.batched import pack_host

    with pytest.raises(ValueError, match="zero-diagonal has a zero on its diagonal"):
        pack_host(systems, jacobi=True, chunk_nnz=chunk_nnz)


# -------------------------------------------------------------- page-locked staging blocks
def _counting_alloc(made):
    def alloc(nbytes):
        made.append(bytearray(nbytes))
        return made[-1]
    return alloc


def _span(a):
    """(first byte, end byte) of an array's memory."""
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


def _check_carved(arrays, specs, block):
    """Arrays of ``specs`` aligned, disjoint, inside ``block``, each written on its own."""
    from managed_solve._backend import CARVE_ALIGN

    base = _span(np.frombuffer(block, np.uint8))[0]
    spans = []
    for a, (count, dt) in zip(arrays, specs, strict=True):
        assert a.shape == (count,) and a.dtype == dt and a.flags.writeable
        lo, hi = _span(a)
        assert (lo - base) % CARVE_ALIGN == 0
        spans.append((lo, hi))
    spans.sort()
    assert all(h1 <= l2 for (_l1, h1), (l2, _h2) in zip(spans, spans[1:], strict=False))
    assert spans[0][0] >= base and spans[-1][1] <= base + len(np.frombuffer(block, np.uint8))
    for k, a in enumerate(arrays):  # writes land in their own array only
        a[...] = k + 1
    for k, a in enumerate(arrays):
        assert (a == k + 1).all()


SPECS = [(1001, np.float64), (1001, np.int32), (3, np.int64), (0, np.float32), (17, np.uint8)]


def test_staging_pool_stages_a_miss_in_ordinary_memory_then_reuses_a_page_locked_block():
    from managed_solve._backend import StagingPool, carve_layout, staging_bucket

    made, keep = [], []
    pool = StagingPool(_counting_alloc(made), limit=1 << 20)
    arrays, pinned = pool.arrays(SPECS, keep)
    assert not pinned and made == [] and len(keep) == 2  # no allocation on the call's path
    _check_carved(arrays, SPECS, keep[0])
    total = carve_layout(SPECS)[1]
    assert pool.refill(wait=True) == 1 and [len(b) for b in made] == [staging_bucket(total)]
    assert pool.refill(wait=True) == 0  # nothing missed since
    keep2 = []
    arrays, pinned = pool.arrays(SPECS, keep2)
    assert pinned and pool.free_bytes() == 0
    _check_carved(arrays, SPECS, made[0])
    again, pinned = pool.arrays(SPECS, [])  # the block is out: not handed out twice
    assert not pinned and not np.shares_memory(again[0], arrays[0])
    del keep2[:], arrays
    assert pool.free_bytes() == len(made[0])  # back once its holder lets go


def test_staging_pool_makes_blocks_for_the_requests_out_at_once_and_serves_by_best_fit():
    from managed_solve._backend import StagingPool, staging_bucket

    made = []
    pool = StagingPool(_counting_alloc(made), limit=1 << 20)
    held = [[], [], []]
    for n, keep in zip((1000, 4000, 16000), held, strict=True):  # three out at once
        assert not pool.arrays([(n, np.uint8)], keep)[1]
    del held
    assert pool.refill(wait=True) == 3
    keep = []
    for n, block in ((3000, 4000), (5000, 16000), (500, 1000)):  # the smallest free block that fits
        assert pool.arrays([(n, np.uint8)], keep)[1]
        assert len(np.frombuffer(keep[-1].block, np.uint8)) == staging_bucket(block)
    assert not pool.arrays([(100, np.uint8)], [])[1]  # every block out

    made = []
    pool = StagingPool(_counting_alloc(made), limit=1 << 20)
    for n in (1000, 4000, 16000):  # one at a time: one block, of the largest size, serves them all
        assert not pool.arrays([(n, np.uint8)], [])[1]
    assert pool.refill(wait=True) == 1 and [len(b) for b in made] == [staging_bucket(16000)]
    for n in (16000, 1000, 4000):
        assert pool.arrays([(n, np.uint8)], [])[1]


def test_staging_pool_holds_at_most_its_limit_the_smallest_free_block_giving_way():
    from managed_solve._backend import StagingPool, staging_bucket

    made = []
    limit = staging_bucket(6000) + staging_bucket(3000)
    pool = StagingPool(_counting_alloc(made), limit=limit)
    held = [[], []]
    for n, keep in zip((3000, 6000), held, strict=True):
        pool.arrays([(n, np.uint8)], keep)
    del held
    assert pool.refill(wait=True) == 2 and pool.held == limit
    k1, k2 = [], []
    assert pool.arrays([(1000, np.uint8)], k1)[1] and pool.arrays([(1000, np.uint8)], k2)[1]
    assert not pool.arrays([(1000, np.uint8)], [])[1]  # both blocks out: a miss
    del k1, k2
    assert pool.refill(wait=True) == 1  # 1000's made once 3000's free block gave way
    assert pool.held == staging_bucket(6000) + staging_bucket(1000) <= limit
    k1 = []
    pool.arrays([(6000, np.uint8)], k1)
    pool.arrays([(50_000, np.uint8)], [])  # larger than the limit: never made, nothing gives way
    del k1
    assert pool.refill(wait=True) == 0 and pool.free_bytes() == pool.held
    pool.limit = staging_bucket(6000)  # a lower limit: free blocks give way at the next refill
    assert pool.refill(wait=True) == 0 and pool.held == pool.free_bytes() == staging_bucket(6000)


def test_staging_pool_survives_a_failed_allocation_and_refills_on_a_helper_thread():
    import threading

    from managed_solve._backend import StagingPool

    made, ready = [], threading.Event()

    def alloc(nbytes):
        if nbytes > 5000:
            raise MemoryError("no page-locked memory left")
        made.append(bytearray(nbytes))
        ready.set()
        return made[-1]

    pool = StagingPool(alloc, limit=1 << 20)
    pool.arrays([(8000, np.uint8)], [])
    assert pool.refill(wait=True) == 1 and pool.held == 0 and made == []  # given up, not counted
    pool.arrays([(1000, np.uint8)], [])
    assert pool.refill() == 1  # on a helper thread
    assert ready.wait(30)
    hit = False
    for _ in range(3000):  # the block joins the pool just after alloc returns
        hit = pool.arrays([(1000, np.uint8)], [])[1]
        if hit:
            break
        threading.Event().wait(0.01)
    assert hit and len(made) == 1


@pytest.mark.gpu
def test_gpu_batches_staged_in_ordinary_memory_then_in_the_page_locked_block_made_after():
    """The first call of new sizes stages in ordinary memory; the next finds a page-locked block."""
    import time

    from managed_solve import _backend, config, solve_many
    from managed_solve._backend import carve_layout
    from managed_solve.manager import DeviceManager

    limit = config.current().staging_bytes
    _backend.staging_pool(0).refill(wait=True)  # the free blocks other tests left given back
    pool = _backend.staging_pool(limit)
    flags, totals = [], []
    arrays = pool.arrays

    def spy(specs, keep, device_id=0):
        out = arrays(specs, keep, device_id)
        flags.append(out[1])
        totals.append(carve_layout(specs)[1])
        return out

    pool.arrays = spy
    try:
        rng = np.random.default_rng(11)
        sizes = [int(m) for m in rng.integers(97, 131, size=9)]
        pairs = [(poisson2d(m), rng.standard_normal(m * m)) for m in sizes]
        dm = DeviceManager(["cuda:0"])
        first = solve_many(pairs, manager=dm, return_on="host")
        assert flags == [False]  # one batch, in ordinary memory
        for _ in range(600):  # its block is made on a helper thread after the call
            if pool.free_bytes() >= totals[0]:
                break
            time.sleep(0.05)
        second = solve_many(pairs, manager=dm, return_on="host")
        assert flags == [False, True] and totals[0] == totals[1]
    finally:
        del pool.arrays
    for (A, b), r1, r2 in zip(pairs, first, second, strict=True):
        assert r1.converged and r2.converged
        for r in (r1, r2):
            assert np.linalg.norm(b - A @ r.x) <= 1e-8 * np.linalg.norm(b) * 1.0001
        # The same systems reached the GPU (the per-system sums' atomics vary the last bits).
        np.testing.assert_allclose(r2.x, r1.x, rtol=1e-9, atol=1e-12)
        assert abs(r1.iterations - r2.iterations) <= 1  # rounding may move the last test


def test_pinned_arena_serves_small_buffers_from_shared_slabs():
    from managed_solve._backend import CARVE_ALIGN, PinnedArena

    made = []
    arena = PinnedArena(_counting_alloc(made), slab_bytes=4096, largest=1024)
    holders = [[] for _ in range(12)]
    small = [arena.empty(100, np.float64 if k % 2 else np.int32, keep)
             for k, keep in enumerate(holders)]
    # 12 buffers of <= 800 bytes, 1024-byte steps at most: three 4 KiB slabs, not twelve blocks.
    assert arena.slabs == len(made) == 3
    assert all(len(keep) == 1 and keep[0] in made for keep in holders)  # each holds its slab
    spans = sorted(_span(a) for a in small)
    assert all(h1 <= l2 for (_l1, h1), (l2, _h2) in zip(spans, spans[1:], strict=False))
    slabs = [_span(np.frombuffer(m, np.uint8)) for m in made]
    for lo, hi in spans:  # inside one slab, at an aligned offset
        (base, _end), = [(b, e) for b, e in slabs if b <= lo and hi <= e]
        assert (lo - base) % CARVE_ALIGN == 0
    for k, a in enumerate(small):
        a[...] = k
    assert all((a == k).all() for k, a in enumerate(small))
    big_keep = []
    big = arena.empty(2048, np.uint8, big_keep)  # past `largest`: a block of its own
    assert len(made) == 4 and big_keep == [made[-1]] and big.nbytes == 2048
    assert arena.slabs == 3


@pytest.mark.gpu
def test_a_batch_bound_for_a_gpu_is_staged_in_one_page_locked_block():
    from managed_solve.solvers.batched import PackedBatch

    rng = np.random.default_rng(5)
    systems = [LinearSystem(poisson2d(int(m)), rng.standard_normal(int(m) ** 2))
               for m in rng.integers(3, 12, size=9)]
    batch = PackedBatch.pack(systems, device="cuda:0", jacobi=True)
    keep, host = batch.host_buffers
    assert len(keep) == 1  # data, indices, indptr, b, row_sys and dinv: one block
    ref = sp.block_diag([s.A for s in systems], format="csr")
    np.testing.assert_array_equal(batch.indptr.get(), ref.indptr)
    np.testing.assert_array_equal(batch.data.get(), ref.data)
    np.testing.assert_allclose(batch.dinv.get(), 1.0 / ref.diagonal())
    np.testing.assert_array_equal(batch.b.get(), np.concatenate([s.b for s in systems]))
