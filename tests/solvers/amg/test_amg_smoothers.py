"""The Chebyshev smoother's polynomial (managed_solve/solvers/amg/smoothers.py).

From a zero guess the smoother is the fixed operator ``M r = p(D^-1 A) D^-1 r``
(``degree`` products, no inner products). These tests check that operator
against the properties a CG preconditioner needs, and show why the library
offers it only inside AMG: as a CG preconditioner it needs fewer iterations
than Jacobi but never fewer matrix-vector products.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import LinearSystem, Solver, solve, solve_many
from managed_solve.solvers.amg.smoothers import chebyshev_coefficients, make_smoother
from managed_solve.solvers.amg.spectral import spectral_radius
from managed_solve.solvers.cg import cg
from managed_solve.solvers.preconditioners import jacobi, make_preconditioner
from tests._problems import BACKENDS, array_modules, host, on, poisson2d


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def polynomial(A, backend, degree, *, ratio=None, rho_factor=1.0):
    """``r -> p(D^-1 A) D^-1 r``: the smoother applied to ``A z = r`` from ``z = 0``.

    ``rho_factor`` scales the estimate of the largest eigenvalue of ``D^-1 A``
    (below 1: an underestimate, as a few power-iteration steps give).
    """
    xp, _ = array_modules(backend)
    Ad = on(backend, A)
    dinv = 1.0 / Ad.diagonal()
    rho = rho_factor * spectral_radius(Ad, dinv, xp)
    sm = make_smoother("chebyshev", Ad, dinv, rho, xp, degree=degree, ratio=ratio)
    x, res, d = (xp.empty(A.shape[0]) for _ in range(3))

    def apply(r):
        sm.apply(Ad, r, x, res, d, zero=True)
        return x.copy()

    return apply


def test_coefficients_reproduce_the_chebyshev_residual_polynomial():
    # Scalar run of the recurrence on D^-1 A = lam: the residual 1 - lam p(lam)
    # must equal T_{k+1}((theta - lam) / delta) / T_{k+1}(theta / delta).
    lower, upper, degree = 0.1, 2.0, 4
    theta, coeffs = chebyshev_coefficients(lower, upper, degree)
    delta = 0.5 * (upper - lower)
    lam = np.linspace(0.0, 2.2, 23)
    d = np.full_like(lam, 1.0 / theta)
    z, res = d.copy(), 1.0 - lam * d
    for a, c in coeffs:
        d = a * d + c * res
        z += d
        res = res - lam * d
    T = np.polynomial.chebyshev.Chebyshev.basis(degree + 1)
    np.testing.assert_allclose(1.0 - lam * z, T((theta - lam) / delta) / T(theta / delta),
                               atol=1e-12)


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_polynomial_is_symmetric_positive_definite(backend, degree):
    A = poisson2d(24)
    M = polynomial(A, backend, degree, ratio=30.0)
    rng = np.random.default_rng(degree)
    for _ in range(5):
        x, y = (rng.standard_normal(A.shape[0]) for _ in range(2))
        xd, yd = on(backend, x, y)
        xMy, yMx = float(x @ host(M(yd))), float(y @ host(M(xd)))
        assert xMy == pytest.approx(yMx, rel=1e-11, abs=1e-12 * np.linalg.norm(x) ** 2)
        assert float(x @ host(M(xd))) > 0


@pytest.mark.parametrize("degree", [1, 3])
def test_margin_keeps_odd_degrees_definite_under_a_low_estimate(degree):
    # With an even residual degree (odd `degree`) the polynomial turns negative
    # above upper * (1 + 1/ratio); the smoother's 10% margin on the estimate
    # keeps a 15% underestimate inside that, so M stays definite.
    A = poisson2d(10)
    M = polynomial(A, "cpu", degree, rho_factor=0.85)
    P = np.column_stack([M(e) for e in np.eye(A.shape[0])])
    np.testing.assert_allclose(P, P.T, atol=1e-12 * abs(P).max())
    assert np.linalg.eigvalsh(0.5 * (P + P.T)).min() > 0


def cg_counts(A, b, M, rtol):
    """CG's outcome, ``iterations`` set to the one that converged (a GPU reads every 8)."""
    out = cg(A, b, rtol=rtol, maxiter=20_000, M=M)
    assert out.code == 0
    out.iterations = out.info.get("converged_at", out.iterations)
    return out


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_cg_needs_fewer_iterations_but_no_fewer_products_than_jacobi(backend, degree):
    A = poisson2d(63)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    Ad, bd = on(backend, A, b)
    rtol = 1e-10
    ref = cg_counts(Ad, bd, jacobi(Ad), rtol)
    out = cg_counts(Ad, bd, polynomial(A, backend, degree, ratio=1.2 * (degree + 1) ** 2), rtol)
    x = host(out.x)
    assert np.linalg.norm(b - A @ x) <= 2 * rtol * np.linalg.norm(b)
    np.testing.assert_allclose(x, sla.spsolve(A.tocsc(), b), rtol=1e-7, atol=1e-9)
    # Fewer iterations: the interval covers D^-1 A's spectrum, the polynomial
    # shrinks its condition number about (degree + 1)^2 times ...
    assert out.iterations * (degree + 1) <= 1.5 * ref.iterations
    assert out.iterations < ref.iterations
    # ... but CG with Jacobi is optimal over the same Krylov space, so the
    # products (degree per application plus CG's own) never drop below its count.
    assert out.iterations * (degree + 1) >= 0.95 * ref.iterations


def test_an_interval_below_the_top_of_the_spectrum_wastes_the_polynomial():
    # A power-iteration estimate 28% low (12 steps from a smooth start on 2D
    # Poisson) leaves the top eigenvalues where the polynomial grows: the
    # polynomial then barely beats Jacobi-CG's iteration count.
    A = poisson2d(63)
    b = np.ones(A.shape[0])
    good = cg_counts(A, b, polynomial(A, "cpu", 4, ratio=30.0), 1e-8).iterations
    low = cg_counts(A, b, polynomial(A, "cpu", 4, ratio=30.0, rho_factor=0.72), 1e-8).iterations
    assert low >= 2.5 * good


@pytest.mark.parametrize("call", ["solve", "Solver", "LinearSystem", "solve_many",
                                  "make_preconditioner"])
def test_chebyshev_preconditioner_is_not_offered(call):
    A = poisson2d(8)
    b = np.ones(A.shape[0])
    run = {
        "solve": lambda: solve(A, b, method="cg", M="chebyshev"),
        "Solver": lambda: Solver(A, method="cg", M="chebyshev"),
        "LinearSystem": lambda: LinearSystem(A, b, M="chebyshev"),
        "solve_many": lambda: solve_many([LinearSystem(A, b)], M="chebyshev"),
        "make_preconditioner": lambda: make_preconditioner("chebyshev", A),
    }[call]
    with pytest.raises(ValueError, match=r"M='chebyshev'.*not offered.*M='jacobi'.*M='amg'"):
        run()
