"""Block-diagonal packing (kernels/packing.py): the fix-up kernels and ``pack_host`` against a plain-NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem
from managed_solve.kernels.packing import shift_blocks, shift_blocks_jacobi
from managed_solve.solvers.batched import pack_host
from managed_solve.system.linear_system import default_maxiter


def random_matrix(rng: np.random.Generator, n: int, dtype, index_dtype) -> sp.csr_matrix:
    """A random n x n CSR matrix with a non-zero diagonal (values of both signs, wide range)."""
    A = sp.random(n, n, density=min(1.0, 4.0 / n), random_state=rng, format="csr")
    A.data = rng.standard_normal(A.nnz) * 10.0 ** rng.integers(-3, 4, A.nnz)
    A = (A + sp.diags(rng.uniform(0.5, 3.0, n) * rng.choice([-1.0, 1.0], n))).tocsr().astype(dtype)
    A.indices = A.indices.astype(index_dtype)
    A.indptr = A.indptr.astype(index_dtype)
    return A


def random_systems(seed: int, dtypes, index_dtype, with_x0: bool) -> list[LinearSystem]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(int(rng.integers(12, 30))):
        n = int(rng.integers(1, 60))
        dt = dtypes[k % len(dtypes)]
        A = random_matrix(rng, n, dt, index_dtype)
        x0 = rng.standard_normal(n).astype(dt) if with_x0 and k % 3 != 1 else None
        out.append(LinearSystem(A, rng.standard_normal(n).astype(dt), x0=x0, rtol=10.0 ** -(k % 9 + 1),
                                atol=1e-12 * (k % 2), maxiter=None if k % 4 else 7 + k,
                                name=f"r{k}" if k % 5 else None))
    return out


def reference_pack(systems, dt, idt, jacobi: bool) -> dict:
    """What pack_host must produce, the plain-NumPy way (repeat, concatenate, 1 / diagonal)."""
    sizes = np.array([s.n for s in systems])
    nnzs = np.array([s.nnz for s in systems])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    nnz_off = np.concatenate([[0], np.cumsum(nnzs)]).astype(np.int64)
    indices = np.concatenate([s.A.indices.astype(np.int64) for s in systems])
    indices += np.repeat(offsets[:-1], nnzs)
    indptr = np.concatenate([s.A.indptr[:-1].astype(np.int64) for s in systems] + [[nnz_off[-1]]])
    indptr[:-1] += np.repeat(nnz_off[:-1], sizes)
    out = {
        "indptr": indptr.astype(idt), "indices": indices.astype(idt), "offsets": offsets,
        "data": np.concatenate([s.A.data.astype(dt) for s in systems]),
        "b": np.concatenate([s.b.astype(dt) for s in systems]),
        "row_sys": np.repeat(np.arange(len(systems), dtype=np.int32), sizes),
        "rtol": np.array([s.rtol for s in systems]), "atol": np.array([s.atol for s in systems]),
        "maxiter": np.array([s.maxiter or default_maxiter(s.n) for s in systems], dtype=np.int64),
        "x0": None, "dinv": None,
    }
    if any(s.x0 is not None for s in systems):
        out["x0"] = np.concatenate([s.x0.astype(dt) if s.x0 is not None else np.zeros(s.n, dt)
                                    for s in systems])
    if jacobi:
        d = np.concatenate([s.A.diagonal() for s in systems]).astype(dt)
        out["dinv"] = np.divide(1.0, d).astype(dt)
    return out


DTYPES = {"float64": [np.float64], "float32": [np.float32], "mixed": [np.float32, np.float64]}


# One piece; pieces on the pool, the larger systems cut into row ranges; nearly all cut.
@pytest.mark.parametrize("chunk_nnz", [1 << 21, 50, 8])
@pytest.mark.parametrize("jacobi", [False, True])
@pytest.mark.parametrize("with_x0", [False, True])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtypes", sorted(DTYPES))
def test_pack_host_matches_the_numpy_reference_bit_for_bit(dtypes, index_dtype, with_x0, jacobi,
                                                           chunk_nnz):
    for seed in range(3):
        # Sources with int32 indices too when the batch is forced to int64, and vice versa.
        src_idt = index_dtype if seed != 1 else (np.int64 if index_dtype == np.int32 else np.int32)
        systems = random_systems(seed, DTYPES[dtypes], src_idt, with_x0)
        dt = np.float32 if dtypes == "float32" else np.float64
        ours = pack_host(systems, jacobi=jacobi, index_dtype=index_dtype, chunk_nnz=chunk_nnz)
        ref = reference_pack(systems, dt, index_dtype, jacobi)
        for name, want in ref.items():
            got = getattr(ours, name)
            if want is None:
                assert got is None, name
                continue
            assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=f"{name} (seed {seed})")
        assert ours.names == [s.name for s in systems]


def test_pack_host_casts_into_a_forced_dtype():
    systems = random_systems(5, [np.float64], np.int32, with_x0=True)
    ours = pack_host(systems, jacobi=True, dtype=np.float32, chunk_nnz=40)
    ref = reference_pack(systems, np.float32, np.int32, jacobi=True)
    for name in ("data", "b", "x0", "dinv", "indices", "indptr", "row_sys"):
        assert getattr(ours, name).dtype == ref[name].dtype
        np.testing.assert_array_equal(getattr(ours, name), ref[name])


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernels_on_unsorted_rows_and_partial_ranges(dtype, index_dtype):
    """The kernels alone: unsorted column order, and only systems lo:hi touched."""
    rng = np.random.default_rng(11)
    mats = []
    for _ in range(6):
        A = random_matrix(rng, int(rng.integers(2, 30)), dtype, index_dtype)
        for i in range(A.shape[0]):  # shuffle each row's entries (scipy allows any order)
            sl = slice(A.indptr[i], A.indptr[i + 1])
            perm = rng.permutation(sl.stop - sl.start)
            A.indices[sl], A.data[sl] = A.indices[sl][perm], A.data[sl][perm]
        A.has_sorted_indices = False
        mats.append(A)
    sizes = [A.shape[0] for A in mats]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    nnz_off = np.concatenate([[0], np.cumsum([A.nnz for A in mats])]).astype(np.int64)
    diagonal = np.concatenate([A.diagonal() for A in mats])
    lo, hi = 2, 5
    for jacobi in (False, True):
        indptr = np.concatenate([A.indptr[:-1] for A in mats] + [[nnz_off[-1]]]).astype(index_dtype)
        indices = np.concatenate([A.indices for A in mats]).astype(index_dtype)
        data = np.concatenate([A.data for A in mats])
        before_ptr, before_idx = indptr.copy(), indices.copy()
        row_sys = np.full(offsets[-1], -1, dtype=np.int32)
        dinv = np.zeros(offsets[-1], dtype=dtype)
        if jacobi:
            assert shift_blocks_jacobi(lo, hi, offsets, nnz_off, indptr, indices, row_sys, data,
                                       dinv) == -1
        else:
            shift_blocks(lo, hi, offsets, nnz_off, indptr, indices, row_sys)
        rows = slice(offsets[lo], offsets[hi])
        ents = slice(nnz_off[lo], nnz_off[hi])
        want_ptr = before_ptr[:-1] + np.repeat(nnz_off[:-1], sizes)
        want_idx = before_idx + np.repeat(offsets[:-1], np.diff(nnz_off))
        np.testing.assert_array_equal(indptr[rows], want_ptr[rows])
        np.testing.assert_array_equal(indices[ents], want_idx[ents])
        np.testing.assert_array_equal(row_sys[rows], np.repeat(np.arange(lo, hi), sizes[lo:hi]))
        if jacobi:
            want = np.divide(1.0, diagonal[rows].astype(dtype)).astype(dtype)
            np.testing.assert_array_equal(dinv[rows], want)
        # Nothing outside lo:hi moved.
        outside_rows = np.r_[0:offsets[lo], offsets[hi]:offsets[-1]]
        outside_ents = np.r_[0:nnz_off[lo], nnz_off[hi]:nnz_off[-1]]
        np.testing.assert_array_equal(indptr[outside_rows], before_ptr[outside_rows])
        np.testing.assert_array_equal(indices[outside_ents], before_idx[outside_ents])
        assert (row_sys[outside_rows] == -1).all()


def test_jacobi_kernel_reports_the_first_zero_diagonal_row():
    A = sp.diags([1.0, 2.0, 3.0, 4.0]).tocsr()
    B = sp.csr_matrix(np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))  # rows 1, 2: zero
    offsets = np.array([0, 4, 7], dtype=np.int64)
    nnz_off = np.array([0, A.nnz, A.nnz + B.nnz], dtype=np.int64)
    indptr = np.concatenate([A.indptr[:-1], B.indptr[:-1], [nnz_off[-1]]]).astype(np.int32)
    indices = np.concatenate([A.indices, B.indices]).astype(np.int32)
    data = np.concatenate([A.data, B.data])
    row_sys = np.empty(7, dtype=np.int32)
    dinv = np.empty(7)
    assert shift_blocks_jacobi(0, 2, offsets, nnz_off, indptr, indices, row_sys, data, dinv) == 5
    assert np.isinf(dinv[5:]).all() and np.isfinite(dinv[:5]).all()


@pytest.mark.parametrize("dtype,tiny", [(np.float64, 1e-320), (np.float32, 1e-40)])
def test_jacobi_kernels_report_a_diagonal_entry_whose_reciprocal_overflows(dtype, tiny):
    """Not zero, yet 1 / a_ii overflows the batch's dtype: the kernels name its row, in the
    pass that computes the reciprocals."""
    from managed_solve.kernels.packing import inverse_diagonal_rows

    A = sp.diags(np.array([1.0, 2.0, tiny, 4.0], dtype=dtype)).tocsr()
    offsets = np.array([0, 4], dtype=np.int64)
    nnz_off = np.array([0, A.nnz], dtype=np.int64)
    indptr = np.concatenate([A.indptr[:-1], [A.nnz]]).astype(np.int32)
    indices, data = A.indices.astype(np.int32), A.data.copy()
    dinv = np.empty(4, dtype=dtype)
    assert shift_blocks_jacobi(0, 1, offsets, nnz_off, indptr, indices, np.empty(4, np.int32),
                               data, dinv) == 2
    out = np.empty(4, dtype=dtype)
    assert inverse_diagonal_rows(0, 4, A.indptr, A.indices, A.data, 0, out) == 2
    np.testing.assert_array_equal(out[[0, 1, 3]], np.array([1.0, 0.5, 0.25], dtype=dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_gather_by_address_equals_concatenate(dtype):
    from managed_solve.kernels.packing import gather

    rng = np.random.default_rng(5)
    parts = [(rng.random(int(rng.integers(0, 40))) * 100).astype(dtype) for _ in range(50)]
    addresses = np.fromiter((p.ctypes.data for p in parts), np.int64, len(parts))
    lengths = np.fromiter((p.size for p in parts), np.int64, len(parts))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    gather(addresses, lengths, out)
    np.testing.assert_array_equal(out, np.concatenate(parts))


@pytest.mark.parametrize("chunk_nnz", [1 << 21, 16])  # whole systems; the large one in row ranges
def test_zero_diagonal_named_whether_or_not_the_system_is_split(chunk_nnz):
    rng = np.random.default_rng(3)
    small = LinearSystem(random_matrix(rng, 5, np.float64, np.int32), np.ones(5), name="small")
    A = random_matrix(rng, 40, np.float64, np.int32).tolil()
    A[17, 17] = 0.0
    bad = LinearSystem(A.tocsr(), np.ones(40), name="holey")
    assert bad.nnz >= 2 * 16
    with pytest.raises(ValueError, match=r"^holey \(M='jacobi'\): .*\(rows \[17\]; A\[17, 17\] = 0, "
                                         r"zero\)\. Use M=None"):
        pack_host([small, bad, small], jacobi=True, chunk_nnz=chunk_nnz)


def test_inverse_diagonal_rows_against_scipy():
    from managed_solve.kernels.packing import inverse_diagonal_rows

    rng = np.random.default_rng(4)
    A = random_matrix(rng, 50, np.float32, np.int64)
    out = np.empty(20, np.float32)
    # Columns shifted by 7, as a system starting at row 7 of a batch has them.
    assert inverse_diagonal_rows(10, 30, A.indptr, A.indices + 7, A.data, 7, out) == -1
    np.testing.assert_array_equal(out, np.divide(1.0, A.diagonal()[10:30]).astype(np.float32))


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_gather_blocks_copies_and_shifts_only_its_systems(index_dtype):
    """The fused copy-and-shift writes systems lo:hi exactly as block_diag has them, nothing else."""
    from managed_solve.kernels.packing import gather_blocks

    rng = np.random.default_rng(8)
    mats = [random_matrix(rng, int(rng.integers(1, 40)), np.float64, index_dtype) for _ in range(9)]
    sizes = np.array([A.shape[0] for A in mats])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    nnz_off = np.concatenate([[0], np.cumsum([A.nnz for A in mats])]).astype(np.int64)
    ptrs = [A.indptr[:-1] for A in mats]
    idx_addr = np.fromiter((A.indices.ctypes.data for A in mats), np.int64, len(mats))
    ptr_addr = np.fromiter((p.ctypes.data for p in ptrs), np.int64, len(mats))
    indices = np.full(nnz_off[-1], -5, dtype=index_dtype)
    indptr = np.full(offsets[-1] + 1, -5, dtype=index_dtype)
    row_sys = np.full(offsets[-1], -5, dtype=np.int32)
    want = sp.block_diag(mats, format="csr")
    lo, hi = 3, 7
    gather_blocks(lo, hi, idx_addr, ptr_addr, offsets, nnz_off, indptr, indices, row_sys)
    rows, ents = slice(offsets[lo], offsets[hi]), slice(nnz_off[lo], nnz_off[hi])
    np.testing.assert_array_equal(indices[ents], want.indices[ents])
    np.testing.assert_array_equal(indptr[rows], want.indptr[rows])
    np.testing.assert_array_equal(row_sys[rows], np.repeat(np.arange(lo, hi), sizes[lo:hi]))
    assert (indices[:nnz_off[lo]] == -5).all() and (indices[nnz_off[hi]:] == -5).all()
    assert (indptr[:offsets[lo]] == -5).all() and (indptr[offsets[hi]:] == -5).all()
    assert (row_sys[:offsets[lo]] == -5).all() and (row_sys[offsets[hi]:] == -5).all()
    # The rest, then the whole batch equals SciPy's block-diagonal matrix.
    gather_blocks(0, lo, idx_addr, ptr_addr, offsets, nnz_off, indptr, indices, row_sys)
    gather_blocks(hi, len(mats), idx_addr, ptr_addr, offsets, nnz_off, indptr, indices, row_sys)
    indptr[-1] = nnz_off[-1]
    np.testing.assert_array_equal(indices, want.indices)
    np.testing.assert_array_equal(indptr, want.indptr)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_active_rows_lists_each_running_systems_rows(dtype):
    from managed_solve.kernels.packing import active_rows

    offsets = np.array([0, 4, 4, 9, 12, 20], dtype=np.int64)  # an empty system too
    running = np.array([0, 1, 3, 4])
    starts, lens = offsets[:-1][running], np.diff(offsets)[running]
    out = np.full(int(lens.sum()), -1, dtype=dtype)
    active_rows(starts, lens, out)
    want = np.concatenate([np.arange(offsets[j], offsets[j + 1]) for j in running])
    np.testing.assert_array_equal(out, want.astype(dtype))


def test_addresses_are_the_arrays_data_addresses_read_only_and_empty_ones_too():
    from managed_solve.kernels.packing import addresses

    a = np.arange(10.0)
    frozen = np.arange(4, dtype=np.int32)
    frozen.flags.writeable = False
    arrays = [a, a[3:], frozen, np.empty(0), np.ones(5, dtype=np.float32)]
    assert addresses(arrays).tolist() == [x.ctypes.data for x in arrays]
    assert addresses([]).shape == (0,)
