"""Strength of connection and the distance-2 MIS aggregation (solvers/amg/strength.py, aggregate.py)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve.solvers.amg.aggregate import aggregate, mis2
from managed_solve.solvers.amg.strength import symmetric_strength
from tests._problems import (
    BACKENDS,
    array_modules,
    elasticity,
    host,
    laplacian1d,
    on,
    poisson2d,
    poisson3d,
    random_spd,
)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def graph_matrix(G):
    n = G.n
    S = sp.csr_matrix((np.ones(host(G.indices).size), host(G.indices), host(G.indptr)),
                      shape=(n, n))
    return S


def test_strength_with_theta_zero_is_the_off_diagonal_pattern(backend):
    A = poisson2d(12)
    xp, sparse = array_modules(backend)
    S = graph_matrix(symmetric_strength(on(backend, A), 0.0, 1, xp, sparse))
    want = (A - sp.diags(A.diagonal())).tocsr()
    want.eliminate_zeros()
    assert (S != (want != 0)).nnz == 0


def test_strength_threshold_drops_weak_couplings(backend):
    T = laplacian1d(8)
    A = (sp.kron(T, sp.eye(8)) + 0.01 * sp.kron(sp.eye(8), T)).tocsr()  # y couplings weak
    xp, sparse = array_modules(backend)
    S = graph_matrix(symmetric_strength(on(backend, A), 0.25, 1, xp, sparse))
    assert S.nnz == 2 * 7 * 8  # only the strong x couplings remain
    assert (S != S.T).nnz == 0


def test_block_strength_amalgamates_nodes(backend):
    A, _ = elasticity(6)
    xp, sparse = array_modules(backend)
    G = symmetric_strength(on(backend, A.tocsr()), 0.0, 2, xp, sparse)
    assert G.n == A.shape[0] // 2


def distance(S, k):
    """Pattern of nodes within distance k (including the node itself)."""
    I = sp.eye(S.shape[0], format="csr")
    R = I.copy()
    for _ in range(k):
        R = ((R @ (S + I)) != 0).astype(float)
    return R


@pytest.mark.parametrize("make", [lambda: poisson2d(30), lambda: poisson3d(9),
                                  lambda: random_spd(600, seed=2)])
def test_roots_are_a_maximal_distance_2_independent_set(backend, make):
    A = make()
    xp, sparse = array_modules(backend)
    G = symmetric_strength(on(backend, A), 0.0, 1, xp, sparse)
    roots = host(mis2(xp, G, seed=4))
    S = graph_matrix(G)
    D2 = distance(S, 2)
    r = np.flatnonzero(roots)
    # Independent: no other root within distance 2 of a root.
    assert (D2[r][:, r] - sp.eye(r.size)).nnz == 0
    # Maximal: every node has a root within distance 2.
    assert (D2 @ roots.astype(float) > 0).all()


@pytest.mark.parametrize("make", [lambda: poisson2d(40), lambda: poisson3d(10),
                                  lambda: random_spd(800, seed=1)])
def test_every_node_is_aggregated_and_aggregates_are_connected(backend, make):
    A = make()
    xp, sparse = array_modules(backend)
    G = symmetric_strength(on(backend, A), 0.0, 1, xp, sparse)
    agg, count = aggregate(xp, G, seed=0)
    agg = host(agg)
    assert agg.min() == 0 and agg.max() == count - 1
    assert np.unique(agg).size == count  # no empty aggregate
    # Connected: the strength graph restricted to one aggregate is connected.
    C = graph_matrix(G).tocoo()
    keep = agg[C.row] == agg[C.col]
    same = sp.csr_matrix((C.data[keep], (C.row[keep], C.col[keep])), shape=C.shape)
    ncomp, _ = sp.csgraph.connected_components(same, directed=False)
    assert ncomp == count
    # Coarsening: a 2D/3D stencil shrinks by a factor of 4 or more.
    assert count <= A.shape[0] / 4


def test_isolated_nodes_are_aggregates_of_their_own(backend):
    A = sp.block_diag([poisson2d(6), sp.eye(5)]).tocsr()
    xp, sparse = array_modules(backend)
    agg, count = aggregate(xp, symmetric_strength(on(backend, A), 0.0, 1, xp, sparse))
    agg = host(agg)
    tail = agg[-5:]
    assert np.unique(tail).size == 5 and not np.isin(tail, agg[:-5]).any()


def test_aggregates_are_reproducible_and_seeded(backend):
    A = poisson2d(25)
    xp, sparse = array_modules(backend)
    G = symmetric_strength(on(backend, A), 0.0, 1, xp, sparse)
    a1, _ = aggregate(xp, G, seed=0)
    a2, _ = aggregate(xp, G, seed=0)
    a3, _ = aggregate(xp, G, seed=9)
    assert host(a1).tolist() == host(a2).tolist()
    assert host(a1).tolist() != host(a3).tolist()
    # The CPU set-up of the same matrix gives the same aggregates on every backend.
    ref, _ = aggregate(np, symmetric_strength(A, 0.0, 1, np, sp), seed=0)
    assert host(a1).tolist() == ref.tolist()
