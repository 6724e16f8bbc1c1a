"""The single-system Krylov engine: an initial guess too far off to iterate from gives way to x = 0."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import Status, solve
from managed_solve.solvers._common import DROPPED_START, HOPELESS_START
from tests._problems import BACKENDS, convection_diffusion, host, on, poisson2d

OVERFLOWS = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                       "ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def _problem():
    A = poisson2d(8)  # SPD
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    return A, b, sla.spsolve(A.tocsc(), b)


@OVERFLOWS
@pytest.mark.parametrize("big", [1e300, 1e150])
@pytest.mark.parametrize("kind", ["csr", "dense"])
@pytest.mark.parametrize("M", [None, "jacobi"])
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres", "minres", "auto"])
def test_an_x0_far_beyond_the_solution_is_dropped_not_read_as_a_property_of_A(backend, method, M,
                                                                               kind, big):
    # From x0 = 1e300 the curvature p.Ap overflowed: CG said "not positive definite",
    # BiCGStab "a vanishing inner product", MINRES "check A for NaN/Inf" (and auto's
    # fallback returned NaN). From 1e150 the products stay finite, but the iterate
    # x0 + d keeps rounding of 1e134: MAXITER ("float64 may not resolve rtol"), or
    # MINRES's "b is not in the range of A" of a nonsingular A.
    A, b, ref = _problem()
    Ad, bd, x0 = on(backend, A if kind == "csr" else A.toarray(), b, np.full(b.size, big))
    r = solve(Ad, bd, method=method, M=M, x0=x0)
    assert r.status == Status.CONVERGED, r.message
    x = host(r.x)
    assert np.linalg.norm(b - A @ x) <= 1e-8 * np.linalg.norm(b)
    np.testing.assert_allclose(x, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    # (GMRES recomputes its residual each restart cycle and may get there from 1e150.)
    if r.method != "direct" and big == 1e300:  # auto on a small dense matrix factorises
        assert r.info[DROPPED_START] > 1e300
        assert "started from x = 0" in r.message and "was dropped" in r.message


@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres", "minres"])
def test_a_useful_x0_is_kept(backend, method):
    A, b, ref = _problem()
    near = ref + 1e-3 * np.random.default_rng(1).standard_normal(b.size)
    Ad, bd, x0 = on(backend, A, b, near)
    kept, cold = solve(Ad, bd, method=method, x0=x0), solve(Ad, bd, method=method)
    assert kept.status == cold.status == Status.CONVERGED
    assert DROPPED_START not in kept.info and "dropped" not in kept.message
    assert kept.iterations < cold.iterations
    # A guess worse than none, but within what float64 resolves, is iterated from too.
    far = on(backend, ref + 100.0)
    r = solve(Ad, bd, method=method, x0=far)
    assert r.status == Status.CONVERGED and DROPPED_START not in r.info


@OVERFLOWS
def test_a_hopeless_x0_with_no_iterations_left_is_named_with_the_fix():
    A, b, _ = _problem()
    r = solve(A, b, method="gmres", x0=np.full(b.size, 1e150), maxiter=3)
    assert r.status == Status.MAXITER
    assert r.info[HOPELESS_START] > 1e150
    assert "The initial guess x0 has ||b - A x0|| = " in r.message
    assert "solve without x0" in r.message


@OVERFLOWS
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres", "minres"])
def test_a_block_column_with_a_hopeless_start_is_solved_from_zero(backend, method):
    # CG and BiCGStab blocks run as one batch (host) or one block loop (GPU), whose
    # breakdown read "A may not be symmetric positive definite".
    from managed_solve import Solver

    A, _, _ = _problem()
    B = np.random.default_rng(2).standard_normal((A.shape[0], 2))
    X0 = np.zeros_like(B)
    X0[:, 0] = 1e300
    Ad, Bd, X0d = on(backend, A, B, X0)
    r = Solver(Ad, method=method).solve(Bd, x0=X0d)
    assert r.status == Status.CONVERGED, r.message
    np.testing.assert_allclose(host(r.x), sla.spsolve(A.tocsc(), B), rtol=0, atol=1e-6)


def _loops(name):
    """The loops of a method that take an x0: the generic one and the fused one where it has one."""
    module = importlib.import_module(f"managed_solve.solvers.{name}")
    return [getattr(module, f) for f in (name, f"{name}_fused") if hasattr(module, f)]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("method,wrong", [("cg", "positive definite"), ("bicgstab", "vanishing"),
                                          ("gmres", "check A"), ("minres", "check A")])
def test_each_loop_names_an_overflow_as_one_with_its_fix(method, wrong, backend):
    """From x0 = 1e300 the products overflow: each loop says so and names the fix, not a
    property of A it does not have (CG said "not positive definite", BiCGStab "a vanishing
    inner product", MINRES "check A for NaN/Inf"). solve() drops such an x0 (above)."""
    A = poisson2d(8) if method in ("cg", "minres") else convection_diffusion(8)
    Ad, b, x0 = on(backend, A, np.ones(A.shape[0]), np.full(A.shape[0], 1e300))
    outs = [loop(Ad, b, x0=x0) for loop in _loops(method)]
    if method == "cg":
        outs.append(_loops("cg")[0](Ad.toarray(), b, x0=x0))  # the dense operator too
    for out in outs:
        assert out.code == 2  # BREAKDOWN
        assert f"{method.upper() if method != 'bicgstab' else 'BiCGStab'} overflowed" in out.message
        assert "drop x0" in out.message and wrong not in out.message
