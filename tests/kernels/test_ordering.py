"""Nested-dissection ordering: a permutation, separators that separate, less fill than minimum degree."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve.assembly import assemble
from managed_solve.kernels.ordering import nested_dissection
from managed_solve.mesh import icosphere
from managed_solve.solvers.direct import permuted
from tests._problems import laplacian1d, poisson2d, poisson3d, random_spd

SYMMETRIC = {"SymmetricMode": True, "DiagPivotThresh": 0.01}


def _is_permutation(perm, n):
    return perm is not None and perm.shape == (n,) and np.array_equal(np.sort(perm), np.arange(n))


@pytest.mark.parametrize("A", [
    laplacian1d(500), poisson2d(40), poisson3d(12), random_spd(300, seed=2),
    sp.block_diag([poisson2d(20), laplacian1d(90), poisson2d(7)], format="csr"),  # disconnected
    sp.csr_matrix((1, 1)), sp.identity(200, format="csr"),  # one row; no edges at all
], ids=["chain", "grid", "cube", "random", "pieces", "one", "diagonal"])
def test_ordering_is_a_permutation(A):
    A = sp.csr_matrix(A)
    assert _is_permutation(nested_dissection(A.indptr, A.indices), A.shape[0])


def test_empty_pattern():
    assert nested_dissection(np.zeros(1, np.int32), np.zeros(0, np.int32)).shape == (0,)


def test_first_separator_splits_the_grid_into_unconnected_halves():
    """Ordered last, the top separator leaves two pieces with no edge between them."""
    m = 30
    A = poisson2d(m)
    perm = nested_dissection(A.indptr, A.indices, leaf=m * m // 2)  # one split only
    B = permuted(A, perm).tocsr()
    # The largest cut: the vertices ordered before the separator, split where
    # the first piece ends (no connection across).
    n = m * m
    G = B[: n - m, : n - m]  # a straight separator of a grid is at most a row or column
    n_parts, labels = sp.csgraph.connected_components(G, directed=False)
    assert n_parts >= 2
    sizes = np.bincount(labels)
    assert sizes.min() >= 0.3 * n and sizes.sum() >= n - 2 * m


def test_chain_orders_middles_last():
    A = laplacian1d(7)
    assert nested_dissection(A.indptr, A.indices, leaf=1).tolist() == [0, 2, 1, 4, 6, 5, 3]


@pytest.mark.parametrize("name", ["sphere", "cube"])
def test_less_fill_than_minimum_degree(name):
    """On an unstructured surface and a 3-D grid, SuperLU fills in less after this ordering."""
    if name == "sphere":
        A = (assemble(icosphere(5)) + sp.identity(10242)).tocsr()
    else:
        A = poisson3d(20)
    perm = nested_dissection(A.indptr, A.indices)
    assert _is_permutation(perm, A.shape[0])
    mmd = sla.splu(A.tocsc(), permc_spec="MMD_AT_PLUS_A", options=SYMMETRIC).nnz
    nd = sla.splu(permuted(A, perm).tocsc(), permc_spec="NATURAL", options=SYMMETRIC).nnz
    assert nd < 0.9 * mmd, (nd, mmd)


def test_dense_row_is_set_aside_and_ordered_last():
    """An arrow matrix (one row coupling all): the hub goes last, the rest splits as a chain."""
    n = 4000
    A = laplacian1d(n).tolil()
    A[0, :] = 1.0
    A[:, 0] = 1.0
    A[0, 0] = float(n)
    A = A.tocsr()
    perm = nested_dissection(A.indptr, A.indices)
    assert _is_permutation(perm, n) and perm[-1] == 0
    lu = sla.splu(permuted(A, perm).tocsc(), permc_spec="NATURAL", options=SYMMETRIC)
    assert lu.nnz < 20 * n  # a chain and one full row and column: no other fill


def test_gives_up_past_its_budget():
    A = poisson2d(40)
    assert nested_dissection(A.indptr, A.indices, budget=1) is None
