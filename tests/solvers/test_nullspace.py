"""The grounded matrix of a singular A with a known null space: pins, pattern, values, solutions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve.solvers.nullspace import Grounding
from tests._problems import BACKENDS, array_modules, host, laplacian1d, on


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def two_components():
    """Two pure Neumann chains side by side: one constant each spans the null space."""
    L = laplacian1d(6, neumann=True)
    A = sp.block_diag([L, 3.0 * L], format="csr")
    N = np.zeros((12, 2))
    N[:6, 0] = N[6:, 1] = 1.0 / np.sqrt(6.0)
    return A, N


def saddle():
    """``[[K, B^T], [B, 0]]`` with ``1^T B = 0``: its null space is the constant pressure.

    The pressure rows store no diagonal entry, so the pinned one needs one inserted.
    """
    K = laplacian1d(5)
    B = sp.diags([np.ones(5), -np.ones(5)], [0, -1], shape=(6, 5))
    S = sp.bmat([[K, B.T], [B, None]], format="csr")
    N = np.r_[np.zeros(5), np.ones(6) / np.sqrt(6.0)][:, None]
    return S, N


def grounded_reference(A, pins, alpha):
    G = A.toarray()
    G[pins, :] = 0.0
    G[:, pins] = 0.0
    G[pins, pins] = alpha
    return G


def test_one_pin_per_component_and_the_pattern_kept(backend):
    A, N = two_components()
    Ad, Nd = on(backend, A, N)
    g = Grounding(Ad, Nd)
    pins = host(g.pins)
    assert sorted(p // 6 for p in pins) == [0, 1]  # N[pins] regular: one row of each component
    G = g.matrix(Ad)
    assert np.array_equal(host(G.indptr), A.indptr) and np.array_equal(host(G.indices), A.indices)
    np.testing.assert_array_equal(host(G.toarray()), grounded_reference(A, pins, 6.0))
    xp, _sparse = array_modules(backend)
    D = Grounding(xp.asarray(A.toarray()), Nd).matrix(xp.asarray(A.toarray()))
    np.testing.assert_array_equal(host(D), grounded_reference(A, pins, 6.0))
    # New values of the same pattern map onto the grounded pattern.
    A2 = A.copy()
    A2.data = 2.0 * A.data
    np.testing.assert_array_equal(host(g.matrix(on(backend, A2)).toarray()),
                                  grounded_reference(A2, pins, 12.0))


def test_a_pinned_row_without_a_diagonal_entry_gets_one(backend):
    S, N = saddle()
    assert S[5:, 5:].nnz == 0
    Sd, Nd = on(backend, S, N)
    g = Grounding(Sd, Nd)
    pins = host(g.pins)
    assert pins.shape == (1,) and pins[0] >= 5  # a pressure row: N vanishes elsewhere
    G = g.matrix(Sd)
    assert G.nnz == S.nnz + 1
    Gh = sp.csr_matrix((host(G.data), host(G.indices), host(G.indptr)), shape=S.shape)
    assert Gh.has_canonical_format
    alpha = np.abs(S.data).max()
    np.testing.assert_array_equal(Gh.toarray(), grounded_reference(S, pins, alpha))
    S2 = S.copy()
    S2.data = S.data * np.linspace(1.0, 2.0, S.nnz)
    G2 = g.matrix(on(backend, S2))
    np.testing.assert_array_equal(host(G2.toarray()),
                                  grounded_reference(S2, pins, np.abs(S2.data).max()))


@pytest.mark.parametrize("trans", [False, True])
def test_solutions_orthogonal_to_the_null_space(trans):
    """With exact factors of the grounded matrix: A's and A^T's solutions orthogonal to N."""
    n = 12
    upwind = sp.diags([-np.ones(n - 1), np.r_[0.0, np.ones(n - 1)]], [-1, 0], format="csr")
    A = (laplacian1d(n, neumann=True) + 0.5 * upwind).tocsr()  # A 1 = 0; A^T's null space another
    N = np.ones((n, 1)) / np.sqrt(n)
    g = Grounding(A, N)
    lu = sla.splu(g.matrix(A).tocsc())
    factors = lambda r, t: lu.solve(r, trans="T" if t else "N")  # noqa: E731
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 2))
    x -= x.mean(axis=0)
    M = A.T if trans else A
    b = M @ x
    if not trans:  # b must sum to zero as well as lie in A's range: one solution x + c 1 moved
        v = A @ np.eye(n)[0]
        b = b - np.outer(v, b.sum(axis=0) / v.sum())
        x = np.linalg.lstsq(np.vstack([A.toarray(), N.T]), np.vstack([b, np.zeros((1, 2))]),
                            rcond=None)[0]
    got = g.solve(factors, b, trans, A, symmetric=False)
    np.testing.assert_allclose(M @ got, b, atol=1e-12)
    np.testing.assert_allclose(N.T @ got, 0.0, atol=1e-12)
    np.testing.assert_allclose(got, x, rtol=1e-10, atol=1e-12)


def test_direct_solve_of_a_saddle_point_system_with_its_pressure_constant(backend):
    """The pinned pressure row had no diagonal entry; x matches the pseudo-inverse's."""
    from managed_solve import Status, solve

    S, N = saddle()
    rng = np.random.default_rng(3)
    b = S @ rng.standard_normal(S.shape[0])
    pinv = np.linalg.pinv(S.toarray(), rcond=1e-10)  # a zero singular value dropped
    for rhs, status in ((b, Status.CONVERGED), (b + N[:, 0], Status.LEAST_SQUARES)):
        Sd, bd = on(backend, S, rhs)
        res = solve(Sd, bd, method="direct", nullspace=N[:, 0] * 3.0, rtol=1e-10)
        assert res.status is status and res.method == "direct", res.message
        np.testing.assert_allclose(host(res.x), pinv @ rhs, rtol=1e-9, atol=1e-12)
