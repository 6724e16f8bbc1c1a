"""System properties (system/properties.py): symmetry with its fallback and chunks, the positive diagonal."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve import system
from managed_solve.kernels.symmetry import DIFFERENT_PATTERN, csr_symmetry
from managed_solve.system import is_symmetric
from tests._problems import BACKENDS, host, laplacian1d, on, poisson2d, tridiagonal


def reference(A, rel=1e-12):
    """The symmetry rule of kernels/symmetry.py on the dense float64 matrix."""
    D = A.toarray().astype(np.float64)
    root = np.sqrt(np.abs(D).max(axis=1))
    diff = np.abs(D - D.T)
    return not ((diff > rel * np.maximum(np.abs(D), np.abs(D.T)))
                & (diff > rel * (root[:, None] * root[None, :]))).any()


def penalised(A, value, rows):
    """A copy of CSR ``A`` with ``value`` on the diagonal of ``rows`` (a penalty Dirichlet condition)."""
    B = A.tolil()
    for i in rows:
        B[i, i] = value
    B = B.tocsr()
    B.sort_indices()
    return B


def test_tiny_stored_entry_without_partner_is_still_symmetric():
    """A stored 1e-20 facing an unstored zero is within the tolerance: the fallback decides."""
    A = sp.csr_matrix(np.array([[2.0, 1e-20], [0.0, 2.0]]))
    assert csr_symmetry(A.indptr, A.indices, A.data, 1e-12) == DIFFERENT_PATTERN
    assert is_symmetric(A)


@pytest.mark.parametrize("asym", [None, "value", "pattern", "penalty", "penalty and value"])
def test_large_matrices_are_tested_in_chunks(monkeypatch, settings, asym):
    """is_symmetric's chunked path (helper threads) against the symmetry rule."""
    settings(symmetry_parallel_nnz=1000, symmetry_workers=4)
    A = poisson2d(40)  # 1,600 rows, 7,840 entries
    A.sort_indices()
    if asym in ("penalty", "penalty and value"):
        A = penalised(A, 1e15, [0, 1599])  # symmetric still; the second also has a pair 1.0 apart
        if asym == "penalty and value":
            A.data[A.nnz - 3] += 1.0
    elif asym == "value":
        A.data[A.nnz - 3] += 1e-6  # near the last row: in the last chunk
    elif asym == "pattern":
        A = (A + sp.csr_matrix(([0.5], ([1500], [3])), shape=A.shape)).tocsr()
        A.sort_indices()
    ran_on = []  # the thread each submitted piece of work ran on
    real_submit = concurrent.futures.ThreadPoolExecutor.submit

    def submit(self, fn, *a, **k):
        def run(*a, **k):
            ran_on.append(threading.current_thread().name)
            return fn(*a, **k)

        return real_submit(self, run, *a, **k)

    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit)
    assert is_symmetric(A) == reference(A) == (asym in (None, "penalty"))
    # the pieces ran on the "symmetry" helper pool's threads, and on no other pool's
    assert len(ran_on) > 1 and {t.rsplit("_", 1)[0] for t in ran_on} == {"managed_solve-symmetry"}


@pytest.mark.parametrize("workers", [1, 8])
def test_positive_diagonal_matches_scipy_diagonal(settings, workers):
    """Against SciPy's ``diagonal()`` (duplicates summed), on small and chunked large matrices."""
    settings(symmetry_parallel_nnz=64, symmetry_workers=workers)
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


@pytest.mark.parametrize("scale", [1e-300, 1e-13, 1.0, 1e13, 1e300])
def test_symmetry_is_judged_relative_to_the_matrix_scale(scale):
    """A matrix around 1e-13 whose transpose differs by 10% is not symmetric (it once counted as so)."""
    from tests._problems import poisson2d

    A = (poisson2d(6) * scale).tocsr()
    assert is_symmetric(A)
    B = A.tolil()
    B[0, 1] = B[0, 1] * 1.1
    assert not is_symmetric(B.tocsr())


def test_tiny_stored_entry_without_partner_is_judged_by_its_rows():
    """A stored entry facing an unstored zero: within ``1e-12 sqrt(r_i r_j)`` (rows' largest) or not, at any scale."""
    for scale in (1e-300, 1.0, 1e300):
        assert is_symmetric(sp.csr_matrix(np.array([[2.0, 1e-13], [0.0, 2.0]]) * scale))
        assert not is_symmetric(sp.csr_matrix(np.array([[2.0, 1e-11], [0.0, 2.0]]) * scale))
    # One penalty row's floor does not reach a pair of two ordinary rows.
    A = penalised(laplacian1d(5), 1e15, [0]).tolil()
    A[2, 3] = -1.0 + 1e-9
    assert not is_symmetric(A.tocsr())


def convection_with_penalties(n=50, value=1e15):
    """Upwind convection-diffusion (mirrors 1.0 apart) with penalty Dirichlet rows at both ends."""
    return penalised(tridiagonal(n, -1.5, 2.0, -0.5), value, [0, n - 1])


def test_a_penalty_diagonal_does_not_make_a_non_symmetric_matrix_symmetric():
    """One 1e15 entry once set the tolerance for every pair (1e-12 * 1e15): 1.0 passed as rounding."""
    from managed_solve import LinearSystem
    from managed_solve.system.method import krylov_method, matrix_symmetry

    A = convection_with_penalties()
    assert not is_symmetric(A)
    assert krylov_method(A, is_symmetric(A)) == "bicgstab"
    b = np.ones(50)
    assert matrix_symmetry(LinearSystem(A.toarray(), b)) is False  # the dense test: the same rule
    S = penalised(laplacian1d(50), 1e15, [0, 49])  # a symmetric matrix with the same penalties
    assert is_symmetric(S) and matrix_symmetry(LinearSystem(S.toarray(), b)) is True
    assert krylov_method(S, is_symmetric(S)) == "cg"


@pytest.mark.parametrize("dense", [False, True])
def test_auto_solves_a_penalised_non_symmetric_matrix(dense):
    """"auto" once took MINRES for it (LEAST_SQUARES, "A is singular"): now CONVERGED.

    On the CPU, where "auto" factorises it; a GPU's "auto" runs BiCGStab
    without a preconditioner on it (the symmetry tests there are
    ``test_is_symmetric_applies_the_one_rule_on_each_device``).
    """
    A = convection_with_penalties()
    b = np.ones(50)
    b[0] = b[-1] = 0.0
    res = ms.solve(A.toarray() if dense else A, b, rtol=1e-8, device="cpu")
    assert res.status == ms.Status.CONVERGED, res.message
    assert res.method not in ("cg", "minres")
    assert np.linalg.norm(b - A @ res.x) <= 1e-8 * np.linalg.norm(b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,value,ends", [(50, 1e15, "both"), (12, 1e12, "last")])
def test_direct_solves_a_penalised_non_symmetric_matrix_as_spsolve_does(backend, n, value, ends):
    """method="direct" once factorised it as symmetric (Cholesky) and gave BREAKDOWN "A is singular"."""
    if ends == "both":
        A = convection_with_penalties(n, value)
    else:
        A = penalised(tridiagonal(n, -0.5, 4.0, -1.0), value, [n - 1])
    b = np.arange(1.0, n + 1)
    want = sla.spsolve(A.tocsc(), b)
    res = ms.solve(*on(backend, A, b), method="direct")
    assert res.status == ms.Status.CONVERGED, res.message
    np.testing.assert_allclose(host(res.x), want, rtol=1e-10, atol=1e-14 * np.abs(want).max())
    with ms.Solver(on(backend, A), method="direct") as solver:
        again = solver.solve(on(backend, b))
        assert again.status == ms.Status.CONVERGED, again.message
        np.testing.assert_allclose(host(again.x), want, rtol=1e-10, atol=1e-14 * np.abs(want).max())
