"""System properties (system/properties.py): symmetry with its fallback and chunks, the positive diagonal."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import system
from managed_solve.kernels.symmetry import DIFFERENT_PATTERN, csr_symmetry
from managed_solve.system import is_symmetric
from tests._problems import poisson2d


def reference(A, limit):
    d = (A - A.T).tocsr()
    return d.nnz == 0 or abs(d).max() <= limit


def test_tiny_stored_entry_without_partner_is_still_symmetric():
    """A stored 1e-20 facing an unstored zero is within the tolerance: the fallback decides."""
    A = sp.csr_matrix(np.array([[2.0, 1e-20], [0.0, 2.0]]))
    assert csr_symmetry(A.indptr, A.indices, A.data, 1e-12) == DIFFERENT_PATTERN
    assert is_symmetric(A)


@pytest.mark.parametrize("asym", [None, "value", "pattern"])
def test_large_matrices_are_tested_in_chunks(monkeypatch, settings, asym):
    """is_symmetric's chunked path (helper threads) against the transpose test."""
    settings(symmetry_parallel_nnz=1000, symmetry_workers=4)
    A = poisson2d(40)  # 1,600 rows, 7,840 entries
    A.sort_indices()
    if asym == "value":
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
    assert is_symmetric(A) == reference(A, 1e-12 * float(abs(A.data).max())) == (asym is None)
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
