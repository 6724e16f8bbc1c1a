"""Array-module generic set-up pieces: row maxima, row indices, hashes (managed_solve/solvers/amg/segments.py)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve.solvers.amg.segments import csr_rows, hash64, random_ranks, row_max, uniform
from tests._problems import BACKENDS, host, on


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def xp_of(backend):
    if backend == "cpu":
        return np
    import cupy

    return cupy


def test_row_max_and_rows_match_a_loop(backend):
    A = sp.random(50, 40, density=0.1, random_state=3, format="csr")
    A = (sp.diags((np.arange(50) % 7 != 0).astype(float)) @ A).tocsr()  # empty rows
    A.eliminate_zeros()
    xp = xp_of(backend)
    indptr, indices = on(backend, A.indptr, A.indices)
    rows = csr_rows(xp, indptr, A.nnz)
    assert host(rows).tolist() == A.tocoo().row.tolist()
    vals = on(backend, np.random.default_rng(0).standard_normal(A.nnz))
    got = host(row_max(xp, indptr, rows, vals, -7.0))
    v = host(vals)
    want = [v[A.indptr[i]:A.indptr[i + 1]].max() if A.indptr[i + 1] > A.indptr[i] else -7.0
            for i in range(50)]
    np.testing.assert_array_equal(got, want)
    assert (np.diff(A.indptr) == 0).any()  # the empty-row branch was exercised


def test_hash_is_distinct_and_ranks_are_a_permutation(backend):
    xp = xp_of(backend)
    h = host(hash64(xp, 10_000, 5))
    assert np.unique(h).size == 10_000
    r = host(random_ranks(xp, 10_000, 5))
    assert sorted(r.tolist()) == list(range(10_000))
    u = host(uniform(xp, 1000, 1))
    assert 0 <= u.min() and u.max() < 1 and 0.4 < u.mean() < 0.6


def test_the_hash_is_the_same_on_every_backend(backend):
    # Fixed values: a GPU run must reproduce the CPU's priorities exactly.
    xp = xp_of(backend)
    np.testing.assert_array_equal(host(hash64(xp, 3, 0)), hash64(np, 3, 0))
    assert hash64(np, 2, 0).tolist() != hash64(np, 2, 1).tolist()
