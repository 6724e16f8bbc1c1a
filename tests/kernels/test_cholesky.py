"""Supernodal Cholesky (kernels.cholesky_symbolic, kernels.cholesky, solvers.cholesky) against SciPy and dense numpy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve.kernels.cholesky_symbolic import (
    analyse,
    column_counts,
    elimination_tree,
    lower_pattern,
)
from managed_solve.solvers.cholesky import Cholesky, NotPositiveDefinite
from tests._problems import (
    anisotropic_badly_scaled,
    helmholtz2d,
    neumann2d,
    poisson2d,
    poisson3d,
    random_gram_spd,
    random_spd,
    rotated_anisotropic,
)

GALLERY = {
    "poisson2d": lambda: poisson2d(23),
    "poisson3d": lambda: poisson3d(9),
    "anisotropic": lambda: anisotropic_badly_scaled(20),
    "rotated": lambda: rotated_anisotropic(21),
    "random_spd": lambda: random_spd(300, seed=3),
    "random_gram": lambda: random_gram_spd(120, np.random.default_rng(5), density=0.05),
}


def _dense_factor(chol):
    """The factor as a dense lower-triangular matrix (n x n, in the factor's order)."""
    s = chol.symbolic
    n = chol.n
    L = np.zeros((n, n))
    for k in range(len(s["first"]) - 1):
        f, l = s["first"][k], s["first"][k + 1]
        rows = s["rows"][s["row_ptr"][k]:s["row_ptr"][k + 1]]
        m = len(rows)
        block = chol.L[s["value_ptr"][k]:s["value_ptr"][k + 1]].reshape(l - f, m).T
        for j in range(l - f):
            L[rows[j:], f + j] = block[j:, j]
    return L


@pytest.mark.parametrize("name", sorted(GALLERY))
def test_factor_reproduces_the_permuted_matrix(name):
    """``L L^T == P A P^T`` to rounding, L lower triangular with a positive diagonal."""
    A = sp.csr_matrix(GALLERY[name]())
    A.sum_duplicates()
    chol = Cholesky(A)
    L = _dense_factor(chol)
    perm = chol.symbolic["perm"]
    assert sorted(perm.tolist()) == list(range(A.shape[0]))
    PAP = A.toarray()[np.ix_(perm, perm)]
    assert np.all(np.triu(L, 1) == 0) and np.all(np.diag(L) > 0)
    np.testing.assert_allclose(L @ L.T, PAP, atol=1e-12 * np.abs(PAP).max())
    np.testing.assert_allclose(L, np.linalg.cholesky(PAP), rtol=1e-8,
                               atol=1e-10 * np.abs(L).max())


def test_column_counts_match_the_dense_factor():
    """Counts of the analysis' final (postordered) order equal a dense factor's structure."""
    A = poisson2d(12)
    n = A.shape[0]
    sym = analyse(A.indptr, A.indices, np.random.default_rng(1).permutation(n))
    perm = sym["perm"]
    inverse = np.empty(n, np.int64)
    inverse[perm] = np.arange(n)
    colptr, rowidx = lower_pattern(A.indptr.astype(np.int64), A.indices.astype(np.int64), inverse)
    parent = elimination_tree(colptr, rowidx, n)
    assert all(parent[j] == -1 or parent[j] > j for j in range(n))  # postordered
    counts = column_counts(colptr, rowidx, parent)
    structure = np.linalg.cholesky(_pattern_spd(A, perm)) != 0
    np.testing.assert_array_equal(counts, structure.sum(axis=0))
    assert sym["nnz"] >= counts.sum()  # supernodes store their blocks whole


def _pattern_spd(A, perm):
    """A matrix of A's pattern whose Cholesky factor has no cancellation (random positive entries)."""
    B = A.copy()
    B.data = -np.random.default_rng(2).uniform(0.1, 1.0, B.nnz)
    B = (B + B.T) / 2
    B = B + sp.diags(np.asarray(abs(B).sum(axis=1)).ravel() + 1.0)
    return B.toarray()[np.ix_(perm, perm)]


@pytest.mark.parametrize("name", sorted(GALLERY))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_solves_match_spsolve(name, dtype):
    A = sp.csr_matrix(GALLERY[name]()).astype(dtype)
    A.sum_duplicates()
    n = A.shape[0]
    rng = np.random.default_rng(7)
    B = rng.standard_normal((n, 5)).astype(dtype)
    chol = Cholesky(A)
    X = chol.solve(B)
    x = chol.solve(B[:, 2].copy())
    assert X.dtype == dtype and X.shape == B.shape and x.shape == (n,)
    ref = sla.spsolve(A.astype(np.float64).tocsc(), B.astype(np.float64))
    tol = 1e-9 if dtype == np.float64 else 2e-3
    scale = np.abs(ref).max()
    np.testing.assert_allclose(X, ref, rtol=tol, atol=tol * scale)
    np.testing.assert_array_equal(x, X[:, 2])  # a block's column is its solve alone
    eps = np.finfo(dtype).eps
    for j in range(5):  # per-column residuals
        r = np.linalg.norm(B[:, j] - A @ X[:, j]) / np.linalg.norm(B[:, j])
        assert r <= 1e3 * eps * np.sqrt(n)


def test_a_wide_block_matches_column_solves():
    A = poisson2d(31)
    B = np.random.default_rng(0).standard_normal((A.shape[0], 37))  # more than one piece
    chol = Cholesky(A)
    X = chol.solve(B)
    for j in (0, 16, 36):
        np.testing.assert_array_equal(X[:, j], chol.solve(B[:, j].copy()))
    np.testing.assert_allclose(X, sla.splu(A.tocsc()).solve(B), rtol=1e-9, atol=1e-12)


def test_refactor_with_new_values_equals_a_fresh_factorisation():
    A = poisson2d(20)
    A2 = A.copy()
    A2.setdiag(A.diagonal() + np.linspace(0.5, 3.0, A.shape[0]))
    chol = Cholesky(A)
    chol.refactor(A2.data)
    fresh = Cholesky(A2)
    np.testing.assert_array_equal(chol.L, fresh.L)
    b = np.ones(A.shape[0])
    np.testing.assert_allclose(chol.solve(b), sla.spsolve(A2.tocsc(), b), rtol=1e-10)


@pytest.mark.parametrize("A", [helmholtz2d(12, shift=1.0), -poisson2d(6), neumann2d(1) * 0 + sp.eye(1) * -1.0],
                         ids=["indefinite", "negative", "one-negative"])
def test_not_positive_definite_raises(A):
    with pytest.raises(NotPositiveDefinite, match="not positive definite"):
        Cholesky(sp.csr_matrix(A))


def test_ineligible_matrices_raise():
    A = poisson2d(5)
    with pytest.raises(NotPositiveDefinite, match="values not symmetric"):
        Cholesky((A + sp.diags([0.3], [2], shape=A.shape)).tocsr())
    with pytest.raises(NotPositiveDefinite, match="dtype"):
        Cholesky(A.astype(np.complex128))


def test_a_failed_refactor_leaves_no_usable_factor():
    A = poisson2d(8)
    chol = Cholesky(A)
    with pytest.raises(NotPositiveDefinite):
        chol.refactor(-A.data)
    with pytest.raises(NotPositiveDefinite, match="failed"):
        chol.solve(np.ones(A.shape[0]))
