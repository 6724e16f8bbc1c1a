"""The smoothed-aggregation hierarchy: tentative prolongator, damping, Galerkin levels, re-setup.

Covers managed_solve/solvers/amg/tentative.py, spectral.py and hierarchy.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve.solvers.amg import hierarchy
from managed_solve.solvers.amg.spectral import safe_inverse, spectral_radius
from managed_solve.solvers.amg.tentative import fit_candidates
from tests._problems import (
    BACKENDS,
    array_modules,
    elasticity,
    high_contrast_poisson,
    host,
    laplacian1d,
    neumann2d,
    on,
    poisson2d,
    poisson3d,
    symmetrically_scaled,
)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def hostm(M):
    return M.get() if hasattr(M, "get") else M


@pytest.mark.parametrize("K", [1, 3])
def test_tentative_prolongator_is_orthonormal_per_aggregate_and_reproduces_B(backend, K):
    xp, sparse = array_modules(backend)
    rng = np.random.default_rng(0)
    n, count = 200, 30
    agg = np.concatenate([np.arange(count), rng.integers(0, count, n - count)])
    B = rng.standard_normal((n, K))
    T, Bc = fit_candidates(xp, sparse, on(backend, agg), count, on(backend, B))
    T, Bc = hostm(T).toarray(), host(Bc)
    assert T.shape == (n, count * K) and Bc.shape == (count * K, K)
    np.testing.assert_allclose(T @ Bc, B, atol=1e-12)
    # Columns live on their aggregate only; T^T T = I (one block per aggregate).
    col_agg = np.repeat(np.arange(count), K)
    assert not (T[agg[:, None] != col_agg[None, :]]).any()
    gram = T.T @ T
    sizes = np.bincount(agg, minlength=count)
    full = np.repeat(sizes >= K, K)  # aggregates with at least K unknowns keep all columns
    np.testing.assert_allclose(gram[np.ix_(full, full)], np.eye(full.sum()), atol=1e-12)


def test_a_vector_dependent_on_an_aggregate_gives_a_zero_column(backend):
    xp, sparse = array_modules(backend)
    agg = np.array([0, 0, 1, 1, 1])
    B = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 0.0], [1.0, 1.0], [1.0, 5.0]])
    T, Bc = fit_candidates(xp, sparse, on(backend, agg), 2, on(backend, B))
    T = hostm(T).toarray()
    np.testing.assert_allclose(T[:, 1], 0.0, atol=1e-14)  # aggregate 0: B[:, 1] = 2 B[:, 0]
    np.testing.assert_allclose(T @ host(Bc), B, atol=1e-12)


def test_an_unknown_outside_every_aggregate_gets_an_empty_row(backend):
    # PyAMG's aggregation leaves nodes without strong couplings out (-1).
    xp, sparse = array_modules(backend)
    agg = np.array([0, 0, -1, 1, 1])
    B = np.array([[1.0], [2.0], [3.0], [1.0], [1.0]])
    T, Bc = fit_candidates(xp, sparse, on(backend, agg), 2, on(backend, B))
    T = hostm(T).toarray()
    assert T.shape == (5, 2) and not T[2].any()
    np.testing.assert_allclose((T @ host(Bc))[agg >= 0], B[agg >= 0], atol=1e-12)
    np.testing.assert_allclose(T.T @ T, np.eye(2), atol=1e-12)


def test_spectral_radius_estimate(backend):
    xp, _ = array_modules(backend)
    A = poisson2d(20)
    dinv = 1.0 / A.diagonal()
    exact = sla.eigsh(sp.diags(np.sqrt(dinv)) @ A @ sp.diags(np.sqrt(dinv)), k=1,
                      which="LA", return_eigenvectors=False)[0]
    est = spectral_radius(on(backend, A), on(backend, dinv), xp)
    assert 0.95 * exact <= est <= 2.0  # Lanczos from below, Gershgorin (2) from above
    assert host(safe_inverse(xp, on(backend, np.array([2.0, 0.0])))).tolist() == [0.5, 0.0]


def build(backend, A, B=None, **kw):
    xp, sparse = array_modules(backend)
    B = np.ones((A.shape[0], 1)) if B is None else B
    return hierarchy.build(on(backend, A.tocsr()), on(backend, np.asarray(B, dtype=float)), xp,
                           sparse, **kw)


@pytest.mark.parametrize("which", ["poisson2d", "poisson3d", "elasticity"])
def test_galerkin_levels_are_symmetric_and_coarsen(backend, which):
    bs, B = 1, None
    if which == "poisson2d":
        A = poisson2d(45)
    elif which == "poisson3d":
        A = poisson3d(14)
    else:
        A, B = elasticity(24)
        bs = 2
    levels = build(backend, A, B, blocksize=bs, max_coarse=50)
    assert len(levels) >= 3
    sizes = [lev.A.shape[0] for lev in levels]
    assert all(c < f / 2.5 for f, c in zip(sizes, sizes[1:], strict=False))
    for fine, coarse in zip(levels, levels[1:], strict=False):
        Ac = hostm(coarse.A)
        asym = abs(Ac - Ac.T).max()
        assert asym <= 1e-12 * abs(Ac).max()
        P, A_ = hostm(fine.P), hostm(fine.A)
        np.testing.assert_allclose((P.T @ A_ @ P).toarray(), Ac.toarray(), atol=1e-10)
        # The smoothed prolongator keeps full column rank.
        if P.shape[1] <= 300:
            assert np.linalg.matrix_rank(P.toarray()) == P.shape[1]
        assert host(fine.agg).min() >= 0  # every unknown aggregated
    ocx = sum(lev.A.nnz for lev in levels) / levels[0].A.nnz
    assert ocx < 2.0


def test_refresh_equals_a_fresh_set_up_on_the_same_aggregates(backend):
    xp, sparse = array_modules(backend)
    A = poisson2d(40)
    A2 = (A + sp.diags(np.linspace(0.1, 2.0, A.shape[0]))).tocsr()
    A2.sort_indices()
    # theta 0: aggregates follow the pattern alone, so a fresh set-up on the
    # new values finds the same ones (a threshold measures the values).
    levels = build(backend, A, max_coarse=40, theta=0.0)
    assert all(lev.agg.dtype == np.int32 for lev in levels[:-1])
    hierarchy.refresh(levels, on(backend, A2), xp, sparse)
    fresh = build(backend, A2, max_coarse=40, theta=0.0)
    assert len(levels) == len(fresh)
    for a, b in zip(levels, fresh, strict=True):
        np.testing.assert_allclose(hostm(a.A).toarray(), hostm(b.A).toarray(), atol=1e-12)


def scaled(A, seed=1, decades=3):
    """``D A D`` with d spread over ``decades``: the same strength graph, another near-null space."""
    d = 10.0 ** np.random.default_rng(seed).uniform(0, decades, A.shape[0])
    return symmetrically_scaled(A, d)


def test_refresh_on_scaled_values_equals_a_fresh_set_up(backend):
    # |a_ij| >= theta sqrt(a_ii a_jj) holds for D A D where it holds for A, so
    # a fresh set-up finds the kept finest aggregates; everything numeric
    # there (the relaxed candidates, T, the damping, P, the Galerkin product)
    # must then be what the fresh set-up computes. (Coarser Galerkin levels
    # are no diagonal scaling of the old ones: a fresh set-up may aggregate
    # them otherwise.)
    xp, sparse = array_modules(backend)
    A = poisson2d(32)
    A2 = scaled(A)
    levels = build(backend, A, max_coarse=40)
    kept = [lev.agg for lev in levels[:-1]]
    hierarchy.refresh(levels, on(backend, A2), xp, sparse)
    fresh = build(backend, A2, max_coarse=40)
    assert all(lev.agg is agg for lev, agg in zip(levels, kept, strict=False))
    np.testing.assert_array_equal(host(levels[0].agg), host(fresh[0].agg))
    P, Pf = hostm(levels[0].P).toarray(), hostm(fresh[0].P).toarray()
    np.testing.assert_allclose(P, Pf, atol=1e-10 * abs(Pf).max())
    Ac, Af = hostm(levels[1].A).toarray(), hostm(fresh[1].A).toarray()
    np.testing.assert_allclose(Ac, Af, atol=1e-10 * abs(Af).max())


def test_relaxed_candidates_find_the_near_null_space_of_a_scaled_matrix(backend):
    # D A D annihilates D^-1 1 as nearly as A annihilates the constants; the
    # constants themselves are far from that (energy over the diagonal's).
    xp, _ = array_modules(backend)
    A = poisson2d(32)
    n = A.shape[0]

    def relaxed(M):
        level = hierarchy.Level(on(backend, M))
        hierarchy.damping(level, xp)
        return host(hierarchy.relax_candidates(level, on(backend, np.ones((n, 1)))))[:, 0]

    def energy(M, v):
        return (v @ (M @ v)) / (v @ (M.diagonal() * v))

    A2 = scaled(A)
    ones = np.ones(n)
    assert energy(A2, relaxed(A2)) < 0.05 * energy(A2, ones)
    B = relaxed(A)  # a Laplacian's candidates stay near the constants
    assert B @ ones / (np.linalg.norm(B) * np.sqrt(n)) > 0.9


def test_weakened_inside_counts_couplings_that_split_an_aggregate(backend):
    xp, sparse = array_modules(backend)
    A = poisson2d(32)
    jump = high_contrast_poisson(32)  # A's pattern, the couplings across the jump weak

    def weakened(levels, M):
        return hierarchy.weakened_inside(levels[0], on(backend, M), hierarchy.THETA, xp, sparse)

    levels = build(backend, A, max_coarse=40)
    assert weakened(levels, scaled(A, decades=6)) == 0
    assert weakened(levels, jump) > 0
    # Couplings that new values strengthen leave every aggregate connected.
    assert weakened(build(backend, jump, max_coarse=40), A) == 0


def test_the_finest_level_keeps_the_strong_couplings_inside_its_aggregates(backend):
    # What update() tests new values against: the couplings that held an aggregate
    # together at set-up (strong and inside one), one bit a stored entry in CSR order.
    A = high_contrast_poisson(32)  # the couplings across the jump weak
    levels = build(backend, A, max_coarse=40)
    agg = host(levels[0].agg)
    C = A.tocoo()
    d = abs(A.diagonal())
    strong = (C.row != C.col) & (C.data != 0) & (
        abs(C.data) >= hierarchy.THETA * np.sqrt(d[C.row] * d[C.col]))
    inside = agg[C.row] == agg[C.col]
    held = np.unpackbits(host(levels[0].strong))[:A.nnz].astype(bool)
    assert (strong & ~inside).any()  # strong couplings between aggregates are not kept
    np.testing.assert_array_equal(held, strong & inside)


def test_refresh_reuses_the_row_blocks_of_its_products(backend, monkeypatch):
    # The Galerkin products' row blocks follow the operands' patterns, which the kept
    # aggregates fix: sized at set-up, a re-setup on new values takes them as they are,
    # and its products are still those of the new values.
    monkeypatch.setattr(hierarchy, "SPGEMM_PRODUCTS", 2000)  # several blocks a product
    xp, sparse = array_modules(backend)
    A = poisson2d(32)
    A2, A3 = scaled(A, seed=1), scaled(A, seed=2)
    levels = build(backend, A2, max_coarse=40)
    plans = dict(levels[0].plans)
    assert set(plans) == {"AP", "RAP"} and all(len(blocks) > 2 for _, blocks in plans.values())
    hierarchy.refresh(levels, on(backend, A3), xp, sparse)
    assert all(levels[0].plans[name] is plan for name, plan in plans.items())  # not sized again
    P = hostm(levels[0].P)
    want = (P.T @ A3 @ P).toarray()
    np.testing.assert_allclose(hostm(levels[1].A).toarray(), want, atol=1e-12 * abs(want).max())
    fresh = build(backend, A3, max_coarse=40)
    np.testing.assert_allclose(P.toarray(), hostm(fresh[0].P).toarray(),
                               atol=1e-10 * abs(P).max())
    # New values whose products hold other counts of entries are sized again.
    levels[0].plans["AP"] = ((-1, -1), (0, levels[0].A.shape[0]))
    hierarchy.refresh(levels, on(backend, A3), xp, sparse)
    assert levels[0].plans["AP"] == plans["AP"]


@pytest.mark.parametrize("limit", [1, 50, 10_000, 1 << 40])
def test_a_product_in_row_blocks_equals_the_whole_product(backend, limit):
    xp, sparse = array_modules(backend)
    X = sp.random(120, 90, density=0.05, random_state=3, format="csr")
    X = (sp.diags((np.arange(120) % 7 != 2).astype(float)) @ X).tocsr()  # empty rows
    X.eliminate_zeros()
    Y = sp.random(90, 70, density=0.1, random_state=4, format="csr")
    Z = hierarchy.product(on(backend, X), on(backend, Y), xp, sparse, limit=limit)
    assert Z.shape == (120, 70) and Z.has_canonical_format
    np.testing.assert_allclose(hostm(Z).toarray(), (X @ Y).toarray(), rtol=1e-13, atol=1e-15)


def test_coarse_inverse_handles_singular_and_empty_rows(backend):
    xp, sparse = array_modules(backend)
    L = laplacian1d(5, neumann=True)  # singular, constants in the null space
    A = sp.block_diag([L, sp.csr_matrix((1, 1))]).tocsr()
    inv = host(hierarchy.coarse_inverse(on(backend, A), xp))
    assert np.isfinite(inv).all()
    b = np.array([1.0, -1.0, 0.5, 0.0, -0.5, 0.0])  # consistent: orthogonal to constants
    x = inv @ b
    np.testing.assert_allclose(A @ x, b, atol=1e-10)


def test_a_numerically_singular_coarsest_matrix_gets_its_pseudo_inverse(backend):
    """A pure Neumann Laplacian is singular, but rounding leaves every LU pivot nonzero: its
    plain inverse is about 1e16 along the constants. The coarse solve is the pseudo-inverse."""
    xp, sparse = array_modules(backend)
    A = neumann2d(8)
    inv = hostm(hierarchy.coarse_inverse(sparse.csr_matrix(A), xp))
    D = A.toarray()
    U, s, Vt = np.linalg.svd(D)
    want = (Vt[:-1].T / s[:-1]) @ U[:, :-1].T  # the one zero singular value dropped
    assert np.abs(inv - want).max() <= 1e-8 * np.abs(want).max()
    regular = hostm(hierarchy.coarse_inverse(sparse.csr_matrix(poisson2d(8)), xp))
    np.testing.assert_allclose(regular @ poisson2d(8).toarray(), np.eye(64), atol=1e-12)


@pytest.mark.parametrize("m", [6, 12, 40])
def test_amg_cg_solves_a_pure_neumann_problem_whose_hierarchy_is_one_level_or_more(m, backend):
    """A hierarchy of one level is the coarse solve alone: CG with it converges at once."""
    A = neumann2d(m)
    n = A.shape[0]
    b = np.random.default_rng(0).standard_normal(n)
    b -= b.mean()
    Ad, bd = on(backend, A, b)
    res = ms.solve(Ad, bd, method="cg", M="amg", nullspace="constant", rtol=1e-10)
    assert res.status is ms.Status.CONVERGED and res.iterations <= 12, res.message
    want = np.linalg.lstsq(A.toarray(), b, rcond=None)[0]
    want -= want.mean()
    assert np.linalg.norm(host(res.x) - want) <= 1e-7 * np.linalg.norm(want)
