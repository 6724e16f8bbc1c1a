"""Staging: the host pack of a batch (one block-diagonal CSR) that the stagers copy to devices."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem
from tests._problems import poisson2d
from tests._problems import poisson2d_skew as convection


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 40])  # one piece; many pieces on the pool
@pytest.mark.parametrize("jacobi", [False, True])
def test_vectorised_host_pack_matches_block_diagonal(jacobi, chunk_nnz):
    from managed_solve.solvers.batched import pack_host
    from managed_solve.system.linear_system import default_maxiter

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
        from managed_solve._pinned import carve, carve_layout

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

    with pytest.raises(ValueError, match=r"^zero-diagonal \(M='jacobi'\): .*\(rows \[2\]; "
                                         r"A\[2, 2\] = 0, zero\)\. Use M=None"):
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


def test_pinned_arrays_carve_one_block_into_aligned_disjoint_arrays():
    from managed_solve._pinned import CARVE_ALIGN, pinned_arrays

    made, keep = [], []
    specs = [(1001, np.float64), (1001, np.int32), (3, np.int64), (0, np.float32), (17, np.uint8)]
    arrays = pinned_arrays(specs, keep, alloc=_counting_alloc(made))
    assert len(made) == 1 and keep == made  # one block, held by the caller's list
    base = _span(np.frombuffer(made[0], np.uint8))[0]
    spans = []
    for a, (count, dt) in zip(arrays, specs, strict=True):
        assert a.shape == (count,) and a.dtype == dt and a.flags.writeable
        lo, hi = _span(a)
        assert (lo - base) % CARVE_ALIGN == 0
        spans.append((lo, hi))
    spans.sort()
    assert all(h1 <= l2 for (_l1, h1), (l2, _h2) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= base + len(made[0])
    for k, a in enumerate(arrays):  # writes land in their own array only
        a[...] = k + 1
    for k, a in enumerate(arrays):
        assert (a == k + 1).all()


def test_pinned_arena_serves_small_buffers_from_shared_slabs():
    from managed_solve._pinned import CARVE_ALIGN, PinnedArena

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


def test_staging_pool_lends_the_smallest_fitting_block_once_its_arrays_are_gone():
    from managed_solve._pinned import StagingPool, block_class

    made = []
    pool = StagingPool(_counting_alloc(made), keep_free=2)
    assert pool.lend(300_000) is None and pool.allocations == 0  # nothing pinned: the caller stages
    pool.pin(300_000)
    assert len(made) == pool.allocations == 1 and len(made[0]) == block_class(300_000)
    a = pool.lend(300_000)
    assert a.nbytes == 300_000 and a.dtype == np.uint8 and pool.free_blocks == 0
    views = [np.frombuffer(a, np.float64, count=10), np.frombuffer(a, np.int32, count=4, offset=256)]
    del a
    assert pool.free_blocks == 0 and pool.lend(200_000) is None  # its views still hold the block
    pool.pin(200_000)
    b = pool.lend(200_000)
    views.clear()
    assert pool.free_blocks == 1
    del b
    assert pool.free_blocks == 2
    c = pool.lend(150_000)  # both fit within 2x: the smaller one
    assert c.__array_interface__["data"][0] == \
        np.frombuffer(made[1], np.uint8).__array_interface__["data"][0]
    assert pool.lend(40_000) is None  # the 327,680-byte block is more than twice 40,000 (+64 KiB)
    pool.pin(40_000)
    del c
    assert pool.free_blocks == 2 and pool.allocations == 3  # keep_free: the smallest of three left
    assert sorted(len(m) for m in made) == [block_class(40_000), block_class(200_000),
                                            block_class(300_000)]


def test_staging_pool_pins_later_on_its_helper_thread_and_reports_failures():
    from managed_solve._pinned import StagingPool

    made, threads = [], []

    def alloc(nbytes):
        threads.append(threading.current_thread().name)
        return _counting_alloc(made)(nbytes)

    pool = StagingPool(alloc)
    for nbytes in (1_000_000, 1_000_000, 5_000_000):  # one block a request, even of one class
        pool.pin_later(nbytes)
    pool.settle()
    assert pool.allocations == 3 and pool.free_blocks == 3
    assert all(name.startswith("managed_solve-staging-pin") for name in threads)
    held = [pool.lend(950_000), pool.lend(950_000), pool.lend(4_000_000)]
    assert [h.nbytes for h in held] == [950_000, 950_000, 4_000_000] and pool.free_blocks == 0

    gate, started = threading.Event(), []

    def slow(nbytes):
        started.append(nbytes)
        gate.wait(10)
        return bytearray(nbytes)

    bursty = StagingPool(slow, max_pending=2)
    for nbytes in range(100_000, 600_000, 100_000):  # five misses while nothing is pinned yet
        bursty.pin_later(nbytes)
    gate.set()
    bursty.settle()
    assert bursty.allocations == 2 and bursty.free_blocks == 2  # the other three staged unpinned
    bursty.pin_later(700_000)  # nothing pending now: pinned
    bursty.settle()
    assert bursty.allocations == 3

    def broken(nbytes):
        raise MemoryError("no page-locked memory left")

    failing = StagingPool(broken)
    failing.pin_later(100)
    failing.pin_later(200)  # the first one's failure, done or not by now, is kept for settle()
    with pytest.raises(MemoryError, match="page-locked"):
        failing.settle()
    failing.settle()  # reported once


def test_staging_block_stages_in_pageable_memory_until_a_block_is_pinned():
    from managed_solve import _pinned

    made = []
    pool = _pinned.StagingPool(_counting_alloc(made))
    with _pinned.staging_pool_scope(pool):
        keep: list = []
        specs = [(5000, np.float64), (5000, np.int32), (101, np.int32)]
        first = _pinned.pinned_arrays(specs, keep)
        assert made == [] or len(made) == 1  # its block is being pinned on the helper thread
        assert all(a.base is not None for a in first) and len(keep) == 1
        assert not any(np.shares_memory(keep[0], np.frombuffer(m, np.uint8)) for m in made)
        pool.settle()
        assert pool.allocations == 1 and pool.free_blocks == 1
        keep2: list = []
        second = _pinned.pinned_arrays(specs, keep2)  # the pinned block, carved as before
        assert pool.allocations == 1 and pool.free_blocks == 0
        assert np.shares_memory(keep2[0], np.frombuffer(made[0], np.uint8))
        for k, part in enumerate(second):
            part[...] = k + 1
        assert all((part == k + 1).all() for k, part in enumerate(second))
        del second, keep2, part
        assert pool.free_blocks == 1


@pytest.mark.gpu
def test_a_first_batch_stages_in_pageable_memory_and_later_ones_in_the_block_pinned_for_them():
    import cupy as cp

    from managed_solve import _pinned
    from managed_solve.manager import DeviceManager
    from managed_solve.scheduling import solve_many

    rng = np.random.default_rng(2)
    # One size: one iteration band, so one batch (of 27,000 rows).
    items = [(poisson2d(30), rng.standard_normal(900)) for _ in range(30)]
    mgr = DeviceManager(["cuda:0"])

    def check(res):
        assert all(r.converged for r in res)
        for r, (A, b) in zip(res, items, strict=True):
            x = cp.asnumpy(r.x)
            assert np.linalg.norm(b - A @ x) <= 1e-8 * np.linalg.norm(b) * (1 + 1e-6)

    with _pinned.staging_pool_scope(_pinned.StagingPool(cp.cuda.alloc_pinned_memory)) as pool:
        check(solve_many(items, manager=mgr, rtol=1e-8))  # pageable staging, a block pinned for later
        pool.settle()
        assert pool.allocations == 1
        block = pool.lend(1_500_000)  # the batch's ~2.1 MB block
        attrs = cp.cuda.runtime.pointerGetAttributes(block.__array_interface__["data"][0])
        assert attrs.type == cp.cuda.runtime.memoryTypeHost  # page-locked
        del block
        check(solve_many(items, manager=mgr, rtol=1e-8))
        check(solve_many(items, manager=mgr, rtol=1e-8))
        pool.settle()
        assert pool.allocations == 1  # the later batches were staged in that block


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
