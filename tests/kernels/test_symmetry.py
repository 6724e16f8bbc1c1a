"""The one-pass CSR symmetry kernels (kernels/symmetry.py) against the symmetry rule on the dense matrix."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve.kernels.symmetry import (
    DIFFERENT_PATTERN,
    DIFFERENT_VALUES,
    SYMMETRIC,
    csr_symmetry,
    csr_symmetry_rows,
    csr_symmetry_rows_search,
    csr_symmetry_rows_window,
    symmetry_rtol,
)
from managed_solve.system import is_symmetric
from tests._problems import BACKENDS, laplacian1d, on, poisson2d, tridiagonal


def reference(A, rel=1e-12):
    """The symmetry rule on the dense float64 matrix (duplicates summed, NaN as no difference).

    Every pair within ``rel`` of the larger of its two sides, or of
    ``sqrt(r_i) * sqrt(r_j)`` with ``r_i`` row ``i``'s largest ``|a_ik|`` (NaN left out).
    """
    D = A.toarray().astype(np.float64)
    root = np.sqrt(np.fmax.reduce(np.abs(D), axis=1, initial=0.0))
    with np.errstate(invalid="ignore"):
        diff = np.abs(D - D.T)
        beyond = (diff > rel * np.maximum(np.abs(D), np.abs(D.T))) & \
            (diff > rel * (root[:, None] * root[None, :]))
    return not beyond.any()


def same_pattern(A):
    P = sp.csr_matrix((np.ones(A.nnz), A.indices, A.indptr), shape=A.shape)  # stored entries
    return (P != P.T).nnz == 0


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_random_matrices_agree_with_the_transpose(dtype, index_dtype):
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(1, 60))
        R = sp.random(n, n, density=rng.uniform(0.05, 0.5), random_state=rng, format="csr")
        A = (R + R.T).tocsr() if trial % 2 == 0 else R.tocsr()
        if trial % 4 == 0 and A.nnz:
            A = A.copy()
            A.data[int(rng.integers(A.nnz))] += 1e-3  # a small asymmetry in the values
        A = A.astype(dtype)
        A.indices = A.indices.astype(index_dtype)
        A.indptr = A.indptr.astype(index_dtype)
        A.sort_indices()
        code = csr_symmetry(A.indptr, A.indices, A.data, 1e-12)
        if code == DIFFERENT_PATTERN:
            assert not same_pattern(A)
        else:
            assert (code == SYMMETRIC) == reference(A)
        assert is_symmetric(A) == reference(A, symmetry_rtol(dtype))


def test_the_rules_tolerance_is_the_dtypes():
    """float64 keeps 1e-12; float32 allows summation-order rounding, far below a real asymmetry."""
    eps32 = float(np.finfo(np.float32).eps)
    assert symmetry_rtol(np.float64) == symmetry_rtol(np.dtype("float64")) == 1e-12
    assert 30 * eps32 < symmetry_rtol(np.float32) <= 1e-4
    assert symmetry_rtol(np.int64) == 1e-12  # integers are exact (promoted to float64)


def test_codes():
    sym = laplacian1d(5)
    assert csr_symmetry(sym.indptr, sym.indices, sym.data, 0.0) == SYMMETRIC
    vals = sym.copy()
    vals[0, 1] = -2.0
    assert csr_symmetry(vals.indptr, vals.indices, vals.data, 0.0) == DIFFERENT_VALUES
    upper = sp.diags([2.0, -1.0], [0, 1], shape=(5, 5), format="csr")
    assert csr_symmetry(upper.indptr, upper.indices, upper.data, 0.0) == DIFFERENT_PATTERN


def test_a_pair_is_judged_by_its_own_size_or_its_rows():
    from managed_solve.kernels.symmetry import csr_symmetry_scaled

    # The rows' largest entries: rel * sqrt(1e6 * 1e6) = 1e-6 for the pair (2, 2 + d).
    A = sp.csr_matrix(np.array([[1e6, 2.0], [2.0 + 1e-5, 1e6]]))
    assert csr_symmetry_scaled(A.indptr, A.indices, A.data, 1e-12) == DIFFERENT_VALUES
    C = sp.csr_matrix(np.array([[1e6, 2.0], [2.0 + 1e-7, 1e6]]))
    assert csr_symmetry_scaled(C.indptr, C.indices, C.data, 1e-12) == SYMMETRIC
    assert csr_symmetry_scaled(A.indptr, A.indices, A.data, 1e-12 * 1e3) == SYMMETRIC
    # Scale-invariant: with rows of 1e-3 the floor is 1e-15, so 2e-13 against a
    # missing entry is an asymmetry (no absolute floor of 1e-12).
    B = sp.csr_matrix(np.array([[1e-3, 2e-13], [0.0, 1e-3]]))
    assert csr_symmetry_scaled(B.indptr, B.indices, B.data, 1e-12) == DIFFERENT_PATTERN
    assert not is_symmetric(B)
    D = sp.csr_matrix(np.array([[1e-3, 2e-19], [0.0, 1e-3]]))  # 2e-19 < 1e-15: symmetric
    assert is_symmetric(D)
    # Without diagonals: the pair's own size (here also its rows' largest).
    E = sp.csr_matrix(np.array([[0.0, 1e8], [1e8 + 1e-5, 0.0]]))
    assert csr_symmetry(E.indptr, E.indices, E.data, 1e-12) == SYMMETRIC  # 1e-5 <= 1e-12 * 1e8
    F = sp.csr_matrix(np.array([[0.0, 1e8], [1e8 + 1e-3, 0.0]]))
    assert csr_symmetry(F.indptr, F.indices, F.data, 1e-12) == DIFFERENT_VALUES


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_chunks_give_the_one_pass_codes(dtype):
    """Any split of the rows gives, combined by min, a code the one-pass kernel agrees with."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        n = int(rng.integers(2, 80))
        R = sp.random(n, n, density=rng.uniform(0.05, 0.4), random_state=rng, format="csr")
        A = (R + R.T).tocsr() if trial % 3 else R.tocsr()
        if trial % 5 == 0 and A.nnz:
            A.data[int(rng.integers(A.nnz))] += 1e-3
        A = A.astype(dtype)
        A.sort_indices()
        cuts = np.unique(np.r_[0, rng.integers(0, n, 3), n])
        whole = csr_symmetry(A.indptr, A.indices, A.data, 1e-9)
        pieces = list(zip(cuts[:-1], cuts[1:], strict=True))
        chunked = [  # the dispatcher, then each way of looking mirrors up
            [csr_symmetry_rows(A.indptr, A.indices, A.data, 1e-9, lo, hi) for lo, hi in pieces],
            [csr_symmetry_rows_search(A.indptr, A.indices, A.data, 1e-9, lo, hi) for lo, hi in pieces],
            [csr_symmetry_rows_window(A.indptr, A.indices, A.data, 1e-9, lo, hi, 0, max(n - 1, 0))
             for lo, hi in pieces]]
        for codes in chunked:
            if DIFFERENT_PATTERN in (whole, min(codes)):  # the first failure met may differ
                assert not (whole == SYMMETRIC or min(codes) == SYMMETRIC)
            else:
                assert min(codes) == whole
                assert (whole == SYMMETRIC) == reference(A, 1e-9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_symmetry_and_gershgorin_in_one_pass_give_the_two_kernels_answers(dtype):
    from managed_solve.kernels.symmetry import (
        csr_gershgorin,
        csr_symmetry_gershgorin,
        csr_symmetry_scaled,
    )

    rng = np.random.default_rng(4)
    for trial in range(60):
        n = int(rng.integers(1, 50))
        R = sp.random(n, n, density=rng.uniform(0.05, 0.6), random_state=rng, format="csr")
        A = (R + R.T + sp.diags(rng.uniform(-1, 3, n))).tocsr() if trial % 3 else R.tocsr()
        if trial % 5 == 0 and A.nnz:
            A = A.copy()
            A.data[int(rng.integers(A.nnz))] += 1e-3 * (1 + trial % 2)
        A = A.astype(dtype)
        A.sort_indices()
        code, *bounds = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, 1e-12)
        scaled = csr_symmetry_scaled(A.indptr, A.indices, A.data, 1e-12)
        # The scaled kernel stops at the first difference it meets; the fused one
        # reads on (for the bounds), and may meet a pattern miss after it.
        assert code == scaled or (scaled == DIFFERENT_VALUES and code == DIFFERENT_PATTERN)
        np.testing.assert_allclose(bounds, csr_gershgorin(A.indptr, A.indices, A.data), rtol=1e-12)
        d = A.diagonal().astype(np.float64)
        off = np.asarray(abs(A).sum(axis=1), dtype=np.float64).ravel() - np.abs(d)
        np.testing.assert_allclose(bounds, [(d - off).min(), (d + off).max(), d.min(), d.max()],
                                   rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)


def test_gershgorin_of_an_empty_matrix_and_a_nan_diagonal():
    from managed_solve.kernels.symmetry import csr_gershgorin, csr_symmetry_gershgorin

    E = sp.csr_matrix((0, 0))
    assert csr_gershgorin(E.indptr, E.indices, E.data) == (0.0, 0.0, 0.0, 0.0)
    A = laplacian1d(4).astype(np.float64)
    A.data[0] = np.nan
    assert all(np.isnan(csr_gershgorin(A.indptr, A.indices, A.data)))
    assert all(np.isnan(csr_symmetry_gershgorin(A.indptr, A.indices, A.data, 1e-12)[1:]))


def test_matrices_sharing_a_pattern_are_checked_through_its_mirror_map():
    """A sweep's matrices share index arrays: the answers equal the one-pass kernel's, by matrix."""
    from managed_solve.kernels.symmetry import (
        csr_mirror,
        csr_mirror_gershgorin,
        csr_symmetry_gershgorin,
    )

    rng = np.random.default_rng(9)
    P = (sp.random(40, 40, density=0.2, random_state=rng) + sp.identity(40)).tocsr()
    P = (P + P.T).tocsr()
    P.sort_indices()
    mirror = csr_mirror(P.indptr, P.indices)
    assert mirror.size == P.nnz
    np.testing.assert_array_equal(P.indices[mirror], np.repeat(np.arange(40), np.diff(P.indptr)))
    cache: dict = {}
    for k in range(5):
        values = P.data * rng.uniform(0.5, 2.0) + (k == 3) * rng.uniform(0, 1e-3, P.nnz)
        A = P.copy()  # new values on the same index arrays, as the assembly's numeric phase makes
        A.data, A.indices, A.indptr = values, P.indices, P.indptr
        want = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, 1e-12)
        got = csr_mirror_gershgorin(A.indptr, A.indices, A.data, mirror, 1e-12)
        assert got[0] == want[0] == (DIFFERENT_VALUES if k == 3 else SYMMETRIC)
        np.testing.assert_allclose(got[1:], want[1:], rtol=1e-14)
        assert is_symmetric(A, cache) == (k != 3)  # the third and later go through the map
    upper = sp.diags([2.0, -1.0], [0, 1], shape=(5, 5), format="csr")
    assert csr_mirror(upper.indptr, upper.indices).size == 0
    cache = {}
    for _ in range(3):  # a non-symmetric pattern shared: every matrix still answered right
        B = upper.copy()
        B.indices, B.indptr = upper.indices, upper.indptr
        assert not is_symmetric(B, cache)


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_walk_codes_match_the_transpose_and_bounds_the_gershgorin_kernel(dtype, index_dtype):
    """Each pair compared once from its lower entry: the code is the transpose test's, exactly.

    Patterns symmetric or not (a triangle, one entry more above or below the
    diagonal, empty rows, missing diagonals), values equal or not, a NaN.
    """
    from managed_solve.kernels.symmetry import csr_gershgorin, csr_symmetry_gershgorin

    rng = np.random.default_rng(7)
    for trial in range(120):
        n = int(rng.integers(1, 40))
        R = sp.random(n, n, density=rng.uniform(0.02, 0.5), random_state=rng, format="csr")
        shape = trial % 6
        A = (R + R.T).tocsr() if shape < 4 else (sp.triu(R) if shape == 4 else sp.tril(R)).tocsr()
        A = A.tolil()
        i, j = (int(v) for v in rng.integers(0, n, 2))
        if shape == 1:
            A[i, j] = A[i, j] + 1.0  # one more stored entry: its mirror may be missing
        elif shape == 2:
            A[i, j] = A[i, j] + 1e-3  # values differ (or the pattern, if (j, i) is not stored)
        elif shape == 3 and trial % 12 == 3:
            A[i, j] = np.nan
        A = A.tocsr().astype(dtype)
        A.sum_duplicates()
        A.indices = A.indices.astype(index_dtype)
        A.indptr = A.indptr.astype(index_dtype)
        code, *bounds = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, 1e-12)
        if not same_pattern(A):
            assert code == DIFFERENT_PATTERN, trial
        else:
            assert code == (SYMMETRIC if reference(A) else DIFFERENT_VALUES), trial
        np.testing.assert_array_equal(bounds, csr_gershgorin(A.indptr, A.indices, A.data))


def reference_walk(A, rel):
    """Code, Gershgorin bounds and finite flag of a canonical CSR from SciPy and NumPy.

    The code from the stored patterns, then the symmetry rule on the dense
    matrix (:func:`reference`); the
    bounds from the diagonal and each row's absolute off-diagonal sum,
    added in the stored order (the rows padded with zeros and summed a
    column at a time), so they can be compared bit for bit.
    """
    n = A.shape[0]
    if n == 0:
        return SYMMETRIC, (0.0, 0.0, 0.0, 0.0), True
    finite = bool(np.isfinite(A.data).all())
    if not same_pattern(A):
        code = DIFFERENT_PATTERN
    else:
        code = SYMMETRIC if reference(A, rel) else DIFFERENT_VALUES
    d = 0.0 + A.diagonal().astype(np.float64)  # 0.0 + -0.0 is 0.0, as a sum from 0.0 gives
    rows = np.repeat(np.arange(n), np.diff(A.indptr))
    padded = np.zeros((n, max(int(np.diff(A.indptr).max()), 1)))
    padded[rows, np.arange(A.nnz) - A.indptr[rows]] = np.where(
        A.indices == rows, 0.0, np.abs(A.data.astype(np.float64)))
    if np.isnan(d).any():
        return code, (np.nan,) * 4, finite
    r = np.zeros(n)
    with np.errstate(over="ignore", invalid="ignore"):  # sums of 1e308s, inf - inf
        for k in range(padded.shape[1]):  # in the stored order; + 0.0 leaves a sum unchanged
            r = r + padded[:, k]
        bounds = (np.fmin.reduce(d - r, initial=np.inf), np.fmax.reduce(d + r, initial=-np.inf),
                  d.min(), d.max())
    return code, tuple(float(b) for b in bounds), finite


def walk_gallery():
    """Canonical CSR matrices, fixed seed: symmetric or not (values, pattern), empty rows, NaN, Inf."""
    rng = np.random.default_rng(11)
    out = [sp.csr_matrix((0, 0)), sp.csr_matrix((5, 5)), poisson2d(7)]
    for trial in range(48):
        n = int(rng.integers(1, 40))
        R = sp.random(n, n, density=rng.uniform(0.05, 0.6), random_state=rng, format="csr")
        A = (R + R.T + sp.diags(rng.uniform(-1, 3, n))).tocsr().tolil()
        i, j = (int(v) for v in rng.integers(0, n, 2))
        kind = trial % 8
        if kind == 0 and trial % 16 == 8 and i != j and A[j, i] == 0:
            A[i, j] = 1.0  # one stored entry without its mirror
        elif kind == 1:
            i, j = sorted(int(v) for v in rng.choice(n, 2, replace=False)) if n > 1 else (0, 0)
            A[i, j] = A[j, i] = 1.0 + rng.uniform()
            A[i, j] = A[i, j] * (1 + (1e-3 if trial % 16 == 1 else 1e-14))  # beyond or within rel
        elif kind == 2:
            A = sp.triu(A.tocsr()).tolil() if trial % 16 == 2 else sp.tril(A.tocsr()).tolil()
        elif kind == 3:
            A[i, :] = 0.0  # an empty row and column
            A[:, i] = 0.0
        elif kind == 4:
            A[i, j] = A[j, i] = np.nan
        elif kind == 5:
            A[i, i] = np.nan if trial % 16 == 5 else -np.inf
        elif kind == 6:
            A[i, j] = A[j, i] = np.inf
            A[j, j] = 1e308  # a row sum overflows from finite entries too
            A[j, (j + 1) % n] = A[(j + 1) % n, j] = 1e308
        A = A.tocsr()
        A.eliminate_zeros()
        A.sum_duplicates()
        if kind == 7:
            A.data[A.indices == np.repeat(np.arange(n), np.diff(A.indptr))] = -0.0
        out.append(A)
    return out


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_walk_matches_a_scipy_reference_bit_for_bit(dtype, index_dtype):
    """The walk's code, bounds and finite flag, one matrix and many at once, against :func:`reference_walk`."""
    from managed_solve.kernels.checks import csr_symmetry_gershgorin_many
    from managed_solve.kernels.packing import addresses
    from managed_solve.kernels.symmetry import csr_symmetry_gershgorin

    mats = []
    for A in walk_gallery():
        with np.errstate(over="ignore"):
            A = A.astype(dtype)
        A.indices, A.indptr = A.indices.astype(index_dtype), A.indptr.astype(index_dtype)
        assert A.has_canonical_format
        mats.append(A)
    codes = np.full(len(mats), 9, np.int8)
    bounds = np.zeros((len(mats), 4))
    finite = np.full(len(mats), 9, np.uint8)
    like = mats[2]
    csr_symmetry_gershgorin_many(
        0, len(mats), addresses([A.indptr for A in mats]), addresses([A.indices for A in mats]),
        addresses([A.data for A in mats]), np.array([A.shape[0] for A in mats]),
        np.array([A.nnz for A in mats]), like.indptr, like.indices, like.data, 1e-12,
        codes, bounds, finite)
    seen = set()
    for k, A in enumerate(mats):
        code, want, ok = reference_walk(A, 1e-12)
        got = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, 1e-12)
        assert got[0] == codes[k] == code, k
        np.testing.assert_array_equal(np.array(got[1:]).view(np.int64), np.array(want).view(np.int64))
        np.testing.assert_array_equal(bounds[k].view(np.int64), np.array(want).view(np.int64))
        assert finite[k] == ok, k
        seen.add((code, ok, bool(np.isnan(want[0]))))
    assert {(SYMMETRIC, True, False), (DIFFERENT_VALUES, True, False),
            (DIFFERENT_PATTERN, True, False), (SYMMETRIC, False, True)} <= seen
    assert any(not ok and not nan for _code, ok, nan in seen)  # an infinity, bounds not NaN


def _raw_csr(n, rows, dtype=np.float64, index_dtype=np.int32):
    """A SciPy CSR matrix of ``n`` rows with exactly the stored ``rows`` (lists of (column, value)), unchecked."""
    indptr = np.zeros(n + 1, dtype=index_dtype)
    indptr[1:] = np.cumsum([len(r) for r in rows])
    indices = np.array([j for r in rows for j, _v in r], dtype=index_dtype)
    data = np.array([v for r in rows for _j, v in r], dtype=dtype)
    A = sp.csr_matrix((data, indices, indptr), shape=(n, n))
    A.indices, A.indptr, A.data = indices, indptr, data  # as given: no sorting, no checks
    return A


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_walk_reports_a_pattern_out_of_canonical_form(index_dtype):
    """Unsorted or repeated columns, one out of range, or row pointers that fall back or run past
    the entries give NOT_CANONICAL (one matrix and many),
    whatever row they are in; the many-matrix kernel's finite flag still holds."""
    from managed_solve.kernels.checks import csr_symmetry_gershgorin_many
    from managed_solve.kernels.packing import addresses
    from managed_solve.kernels.symmetry import NOT_CANONICAL, csr_symmetry_gershgorin

    good = [[(0, 4.0), (1, -1.0)], [(0, -1.0), (1, 4.0), (2, -1.0)], [(1, -1.0), (2, 4.0), (3, -1.0)],
            [(2, -1.0), (3, 4.0)]]
    bad_rows = {
        "lower unsorted": (2, [(1, -1.0), (0, 0.5), (2, 4.0), (3, -1.0)]),
        "upper unsorted": (1, [(0, -1.0), (1, 4.0), (3, 0.5), (2, -1.0)]),
        "upper before the diagonal": (1, [(2, -1.0), (0, -1.0), (1, 4.0)]),
        "repeated diagonal": (3, [(2, -1.0), (3, 2.0), (3, 2.0)]),
        "repeated lower": (2, [(1, -1.0), (1, 0.0), (2, 4.0), (3, -1.0)]),
        "column n": (0, [(0, 4.0), (1, -1.0), (4, 1.0)]),
        "negative column": (3, [(-1, 1.0), (2, -1.0), (3, 4.0)]),
    }
    mats = [_raw_csr(4, good, index_dtype=index_dtype)]
    for k, (row, entries) in enumerate(bad_rows.values()):
        rows = [list(r) for r in good]
        rows[row] = entries
        if k == 0:
            rows[0][0] = (0, np.nan)  # a NaN beside the bad pattern: the finite flag still sees it
        mats.append(_raw_csr(4, rows, index_dtype=index_dtype))
    # Row pointers that fall back, or run past the entries (the next matrix's are not read).
    falls = _raw_csr(4, good, index_dtype=index_dtype)
    falls.indptr = falls.indptr.copy()
    falls.indptr[2] = falls.indptr[1] - 1
    past = _raw_csr(4, good, index_dtype=index_dtype)
    past.indptr = past.indptr.copy()
    past.indptr[3] = past.indptr[4] + 5
    mats += [falls, past]
    bad_rows["pointers falling back"] = bad_rows["pointers past the entries"] = None
    codes = np.full(len(mats), 9, np.int8)
    bounds = np.full((len(mats), 4), 7.0)
    finite = np.full(len(mats), 9, np.uint8)
    like = mats[0]
    csr_symmetry_gershgorin_many(
        0, len(mats), addresses([A.indptr for A in mats]), addresses([A.indices for A in mats]),
        addresses([A.data for A in mats]), np.array([A.shape[0] for A in mats]),
        np.array([A.indptr[-1] for A in mats]), like.indptr, like.indices, like.data, 1e-12,
        codes, bounds, finite)
    assert codes[0] == SYMMETRIC and finite[0] == 1
    for k, name in enumerate(bad_rows, start=1):
        assert codes[k] == NOT_CANONICAL, name
        assert csr_symmetry_gershgorin(mats[k].indptr, mats[k].indices, mats[k].data, 1e-12)[0] \
            == NOT_CANONICAL, name
        assert finite[k] == (0 if k == 1 else 1), name
        if "column" not in name and "pointers" not in name:  # SciPy agrees (it checks the order)
            assert not mats[k].has_canonical_format, name


def _penalised(A, entries):
    """A copy of CSR ``A`` with the given diagonal entries set, ``{row: value}``."""
    B = A.tolil()
    for i, v in entries.items():
        B[i, i] = v
    return B.tocsr()


def _with(A, pairs, unstored=()):
    """A canonical copy of CSR ``A`` (its dtype) with entries stored, ``{(i, j): value}`` (a 0.0
    too), and the positions ``unstored`` left out."""
    C = A.tocoo()
    gone = set(pairs) | set(unstored)
    keep = np.array([(i, j) not in gone for i, j in zip(C.row.tolist(), C.col.tolist(), strict=True)])
    rows = np.r_[C.row[keep], [i for i, _j in pairs]]
    cols = np.r_[C.col[keep], [j for _i, j in pairs]]
    values = np.r_[C.data[keep], np.array(list(pairs.values()), dtype=A.dtype)]
    B = sp.csr_matrix((values, (rows, cols)), shape=A.shape)
    B.sort_indices()
    return B


def _ulps(value, k):
    """The float32 ``k`` steps above ``value`` (away from zero)."""
    x = np.float32(value)
    for _ in range(k):
        x = np.nextafter(x, np.float32(np.copysign(np.inf, x)))
    return x


def rule_gallery():
    """Matrices that probe the symmetry rule, by name: (A, whether A counts as symmetric)."""
    n = 50
    convection = tridiagonal(n, -1.5, 2.0, -0.5)  # mirrors differ by 1.0
    scaled = (sp.diags(np.logspace(-6, 6, n)) @ laplacian1d(n) @ sp.diags(np.logspace(-6, 6, n))).tocsr()
    saddle = sp.csr_matrix(np.array([[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 2.0]]))
    f32 = poisson2d(6, np.float32)
    out = {
        # One large entry must not excuse differences elsewhere (the penalty Dirichlet of FEM).
        "penalty, convection": (_penalised(convection, {0: 1e15, n - 1: 1e15}), False),
        "penalty, one end": (_penalised(tridiagonal(12, -0.5, 4.0, -1.0), {11: 1e12}), False),
        "penalty, Laplacian": (_penalised(laplacian1d(n), {0: 1e15, n - 1: 1e15}), True),
        "penalty 1e300, Laplacian": (_penalised(laplacian1d(n), {0: 1e300}), True),
        "penalty, tiny matrix": (_penalised(laplacian1d(n) * 1e-300, {0: 1e-285}), True),
        "penalty, tiny convection": (_penalised(convection * 1e-300, {0: 1e-285}), False),
        # A symmetric scaling D A D keeps symmetry, whatever the rows' sizes (mirrors rounded apart).
        "D A D": (scaled, True),
        "D A D, one pair 1e-9 apart": (_with(scaled, {(30, 31): scaled[30, 31] * (1 + 1e-9)}), False),
        # Rounding against a zero: within the rows' largest entries, stored or not.
        "cancelled pair": (_with(laplacian1d(6), {(2, 4): 1e-17, (4, 2): -1e-17}), True),
        "cancelled, mirror unstored": (_with(laplacian1d(6), {(2, 4): 3e-17}), True),
        "beyond the rows": (_with(laplacian1d(6), {(2, 4): 1e-11}), False),
        "beyond the rows, a stored zero": (_with(laplacian1d(6), {(2, 4): 1e-11, (4, 2): 0.0}), False),
        "cancelled, a stored zero": (_with(laplacian1d(6), {(2, 4): 3e-17, (4, 2): 0.0}), True),
        # Rows with a zero diagonal (a saddle point: MINRES's case) have the floor too.
        "zero diagonal, rounding": (_with(saddle, {(0, 1): 1e-17, (1, 0): -1e-17}), True),
        "zero diagonal, unstored": (_with(saddle, {(0, 1): 1e-17}, unstored=[(1, 0)]), True),
        "zero diagonal, beyond": (_with(saddle, {(0, 1): 1e-11, (1, 0): -1e-11}), False),
        "zero diagonal, within its size": (_with(saddle, {(1, 0): 1.0 + 2e-16}), True),
        # float32: rounded from a symmetric float64 matrix it stays symmetric.
        "float32 penalty Laplacian": (_penalised(poisson2d(6), {0: 1e15}).astype(np.float32), True),
        "float32 penalty convection": (_penalised(convection, {0: 1e15}).astype(np.float32), False),
        # float32: mirrors summed in two orders (a few ulps apart) are symmetric; 1e-3 apart are not.
        "float32, a pair 8 ulps apart": (_with(f32, {(7, 8): _ulps(f32[7, 8], 8)}), True),
        "float32, rounding against a zero": (_with(f32, {(2, 4): 3e-7, (4, 2): -3e-7}), True),
        "float32, a pair 1e-3 apart": (_with(f32, {(7, 8): f32[7, 8] * np.float32(1 + 1e-3)}), False),
        "float32, beyond the rows": (_with(f32, {(2, 4): 1e-3}), False),
        "float64, a pair float32's 8 ulps apart": (_with(poisson2d(6), {(7, 8): _ulps(f32[7, 8], 8)}),
                                                   False),
    }
    for name, (A, _want) in out.items():
        A.sort_indices()
        assert A.has_canonical_format, name
    return out


def unsorted(A):
    """A copy of CSR ``A`` with each row's entries in reverse order (not canonical)."""
    data, indices = A.data.copy(), A.indices.copy()
    for i in range(A.shape[0]):
        lo, hi = A.indptr[i], A.indptr[i + 1]
        data[lo:hi], indices[lo:hi] = data[lo:hi][::-1].copy(), indices[lo:hi][::-1].copy()
    B = sp.csr_matrix((data, indices, A.indptr.copy()), shape=A.shape)
    assert not B.has_canonical_format or B.nnz == B.shape[0]
    return B


@pytest.mark.parametrize("name", list(rule_gallery()))
def test_every_host_kernel_applies_the_one_rule(name):
    """Each pair against its own size or its rows, by every kernel and the array version alike."""
    from managed_solve.kernels.checks import csr_symmetry_gershgorin_many
    from managed_solve.kernels.packing import addresses
    from managed_solve.kernels.symmetry import (
        csr_mirror,
        csr_mirror_gershgorin,
        csr_symmetry_gershgorin,
        csr_symmetry_scaled,
    )

    A, want = rule_gallery()[name]
    n, rel = A.shape[0], symmetry_rtol(A.dtype)
    assert reference(A, rel) == want
    assert is_symmetric(A) == want
    assert is_symmetric(unsorted(A)) == want  # not canonical: the array version of the rule
    if not same_pattern(A):
        assert csr_symmetry(A.indptr, A.indices, A.data, rel) == DIFFERENT_PATTERN
        return
    code = SYMMETRIC if want else DIFFERENT_VALUES
    assert csr_symmetry(A.indptr, A.indices, A.data, rel) == code
    assert csr_symmetry_scaled(A.indptr, A.indices, A.data, rel) == code
    assert csr_symmetry_gershgorin(A.indptr, A.indices, A.data, rel)[0] == code
    mirror = csr_mirror(A.indptr, A.indices)
    assert csr_mirror_gershgorin(A.indptr, A.indices, A.data, mirror, rel)[0] == code
    for pieces in ([(0, n)], [(0, n // 3), (n // 3, n)]):
        assert min(csr_symmetry_rows(A.indptr, A.indices, A.data, rel, lo, hi) for lo, hi in pieces) == code
        assert min(csr_symmetry_rows_search(A.indptr, A.indices, A.data, rel, lo, hi)
                   for lo, hi in pieces) == code
        assert min(csr_symmetry_rows_window(A.indptr, A.indices, A.data, rel, lo, hi, 0, n - 1)
                   for lo, hi in pieces) == code
    codes, bounds, finite = np.full(1, 9, np.int8), np.zeros((1, 4)), np.zeros(1, np.uint8)
    csr_symmetry_gershgorin_many(0, 1, addresses([A.indptr]), addresses([A.indices]),
                                 addresses([A.data]), np.array([n]), np.array([A.nnz]),
                                 A.indptr, A.indices, A.data, rel, codes, bounds, finite)
    assert codes[0] == code


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_symmetric_applies_the_one_rule_on_each_device(backend):
    """The GPU's one-launch kernel and its array fallback give the host's answers."""
    gallery = rule_gallery()
    for name, (A, want) in gallery.items():
        assert is_symmetric(on(backend, A)) == want, name
        assert is_symmetric(on(backend, unsorted(A))) == want, name
    if backend == "cuda":
        from managed_solve.kernels.symmetry import csr_symmetry_gershgorin
        from managed_solve.system.device_checks import symmetry_many

        mats = list(gallery.values())
        for (A, _want), found in zip(mats, symmetry_many([on(backend, A) for A, _w in mats]),
                                     strict=True):
            assert found is not None and found[0] == csr_symmetry_gershgorin(
                A.indptr, A.indices, A.data, symmetry_rtol(A.dtype))[0]
