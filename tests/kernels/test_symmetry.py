"""The one-pass CSR symmetry kernel against the transpose test."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve.kernels.symmetry import (
    DIFFERENT_PATTERN,
    DIFFERENT_VALUES,
    SYMMETRIC,
    abs_max,
    csr_symmetry,
    csr_symmetry_rows,
    csr_symmetry_rows_search,
    csr_symmetry_rows_window,
)
from managed_solve.system import is_symmetric


def reference(A, limit):
    d = (A - A.T).tocsr()
    return d.nnz == 0 or abs(d).max() <= limit


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
            assert A.nnz != (A + A.T).nnz or not reference(A, 1e-12)
        else:
            assert (code == SYMMETRIC) == reference(A, 1e-12)
        assert is_symmetric(A) == reference(A, 1e-12 * max(float(abs(A.data).max(initial=0)), 1.0))


def test_codes():
    sym = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
    assert csr_symmetry(sym.indptr, sym.indices, sym.data, 0.0) == SYMMETRIC
    vals = sym.copy()
    vals[0, 1] = -2.0
    assert csr_symmetry(vals.indptr, vals.indices, vals.data, 0.0) == DIFFERENT_VALUES
    upper = sp.diags([2.0, -1.0], [0, 1], shape=(5, 5), format="csr")
    assert csr_symmetry(upper.indptr, upper.indices, upper.data, 0.0) == DIFFERENT_PATTERN


def test_tiny_stored_entry_without_partner_is_still_symmetric():
    """A stored 1e-20 facing an unstored zero is within the tolerance: the fallback decides."""
    A = sp.csr_matrix(np.array([[2.0, 1e-20], [0.0, 2.0]]))
    assert csr_symmetry(A.indptr, A.indices, A.data, 1e-12) == DIFFERENT_PATTERN
    assert is_symmetric(A)


def test_scaled_variant_finds_the_scale_itself():
    from managed_solve.kernels.symmetry import csr_symmetry_scaled

    A = sp.csr_matrix(np.array([[1e6, 2.0], [2.0 + 1e-5, 1e6]]))  # limit 1e-12 * 1e6 = 1e-6
    assert csr_symmetry_scaled(A.indptr, A.indices, A.data, 1e-12) == DIFFERENT_VALUES
    C = sp.csr_matrix(np.array([[1e6, 2.0], [2.0 + 1e-7, 1e6]]))
    assert csr_symmetry_scaled(C.indptr, C.indices, C.data, 1e-12) == SYMMETRIC
    assert csr_symmetry_scaled(A.indptr, A.indices, A.data, 1e-12 * 1e3) == SYMMETRIC
    B = sp.csr_matrix(np.array([[1e-3, 2e-13], [0.0, 1e-3]]))  # scale below 1: limit 1e-12 absolute
    assert csr_symmetry_scaled(B.indptr, B.indices, B.data, 1e-12) == DIFFERENT_PATTERN
    assert is_symmetric(B)


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
        assert abs_max(A.data, 0, A.nnz) == (abs(A.data).max() if A.nnz else 0.0)


@pytest.mark.parametrize("asym", [None, "value", "pattern"])
def test_large_matrices_are_tested_in_chunks(monkeypatch, asym):
    """is_symmetric's chunked path (helper threads) against the transpose test."""
    from managed_solve import system

    monkeypatch.setattr(system, "SYMMETRY_PARALLEL_NNZ", 1000)
    monkeypatch.setattr(system, "SYMMETRY_WORKERS", 4)
    m = 40
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    A = sp.kronsum(T, T).tocsr()  # 1,600 rows, 7,840 entries
    A.sort_indices()
    if asym == "value":
        A.data[A.nnz - 3] += 1e-6  # near the last row: in the last chunk
    elif asym == "pattern":
        A = (A + sp.csr_matrix(([0.5], ([1500], [3])), shape=A.shape)).tocsr()
        A.sort_indices()
    calls = []
    real = system._backend.thread_pool
    monkeypatch.setattr(system._backend, "thread_pool",
                        lambda name, workers: calls.append(name) or real(name, workers))
    assert is_symmetric(A) == reference(A, 1e-12 * float(abs(A.data).max())) == (asym is None)
    assert calls == ["symmetry"]


@pytest.mark.parametrize("workers", [1, 8])
def test_positive_diagonal_matches_scipy_diagonal(monkeypatch, workers):
    """Against SciPy's ``diagonal()`` (duplicates summed), on small and chunked large matrices."""
    from managed_solve import system

    monkeypatch.setattr(system, "SYMMETRY_WORKERS", workers)
    monkeypatch.setattr(system, "SYMMETRY_PARALLEL_NNZ", 64)
    rng = np.random.default_rng(3)
    for trial in range(40):
        n = int(rng.integers(1, 60))
        A = sp.random(n, n, density=0.2, random_state=int(rng.integers(1 << 30)), format="csr")
        A = A + sp.diags(rng.uniform(-0.2, 1.0, n))
        A = sp.csr_matrix(A)
        if trial % 4 == 1:  # unsorted indices and a duplicate diagonal entry split in two
            end = A.indptr[1]  # after row 0's entries: column 0 again, out of order
            indptr = A.indptr.copy()
            indptr[1:] += 1
            A = sp.csr_matrix((np.insert(A.data, end, -0.5), np.insert(A.indices, end, 0), indptr),
                              shape=A.shape)
            assert not A.has_canonical_format
        if trial % 4 == 2:  # a missing diagonal entry
            A = A.tolil()
            A[n // 2, n // 2] = 0.0
            A = A.tocsr()
            A.eliminate_zeros()
        expected = bool((A.diagonal() > 0).all())
        assert system.positive_diagonal(A) is expected, trial
    assert system.positive_diagonal(np.eye(3)) is True
    assert system.positive_diagonal(sp.csr_matrix(np.diag([1.0, np.nan]))) is False
