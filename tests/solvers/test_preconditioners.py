"""Jacobi and Neumann preconditioners: correctness and fewer iterations."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import solve
from managed_solve.solvers.cg import cg
from managed_solve.solvers.preconditioners import (
    inverse_diagonal,
    jacobi,
    make_preconditioner,
    neumann,
    spectral_radius_bound,
)
from tests._problems import BACKENDS, anisotropic_badly_scaled, host, laplacian1d, on, poisson2d


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def as_matrix(apply, n):
    return np.column_stack([host(apply(e)) for e in np.eye(n)])


def test_jacobi_is_the_inverse_diagonal():
    A = anisotropic_badly_scaled(4)
    r = np.random.default_rng(1).standard_normal(16)
    np.testing.assert_allclose(jacobi(A)(r), r / A.diagonal())


def test_zero_diagonal_is_a_clear_value_error():
    A = sp.csr_matrix(np.array([[0.0, 1.0], [1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"^solve\(M='jacobi'\): .* 1 diagonal entry .*"
                                         r"\(rows \[0\]; A\[0, 0\] = 0, zero\)\. Use M=None"):
        inverse_diagonal(A)
    with pytest.raises(ValueError, match="zero diagonal"):
        solve(A, np.ones(2), method="gmres", M="jacobi")


def test_neumann_polynomial_is_spd():
    A = anisotropic_badly_scaled(6)
    P = as_matrix(neumann(A), A.shape[0])
    np.testing.assert_allclose(P, P.T, rtol=1e-9, atol=1e-9 * np.abs(P).max())
    assert np.linalg.eigvalsh(0.5 * (P + P.T)).min() > 0


def test_spectral_radius_bound_is_an_upper_bound():
    A = anisotropic_badly_scaled(8)
    dinv = 1.0 / A.diagonal()
    lam = np.abs(np.linalg.eigvals((sp.diags(dinv) @ A).toarray())).max()
    bound = spectral_radius_bound(A, dinv)
    assert lam <= bound <= 2.0 * lam


def test_preconditioners_reduce_iterations(backend):
    A = anisotropic_badly_scaled(24)
    b = A @ np.ones(A.shape[0])
    Ad, bd = on(backend, A, b)
    its = {}
    for name in (None, "jacobi", "neumann"):
        out = cg(Ad, bd, rtol=1e-8, maxiter=20_000, M=make_preconditioner(name, Ad))
        assert out.code == 0, name
        x = host(out.x)
        # The raw solver stops on its recurrence residual; on this cond ~ 1e6
        # problem the true one may lag by a few times (solve() restarts then).
        assert np.linalg.norm(b - A @ x) <= 1e-7 * np.linalg.norm(b)
        its[name] = out.iterations
    # Measured here: about 1700 unpreconditioned, 150 Jacobi, 75 Neumann.
    assert its["jacobi"] < its[None] / 5
    assert its["neumann"] < its["jacobi"]


def test_neumann_through_solve():
    M = "neumann"
    A = anisotropic_badly_scaled(16)
    b = np.ones(A.shape[0])
    res = solve(A, b, method="cg", M=M, rtol=1e-10)
    assert res.converged and res.relative_residual <= 1e-10
    assert res.info["path"] == "generic"
    np.testing.assert_allclose(res.x, sla.spsolve(A.tocsc(), b), rtol=1e-6)


@pytest.mark.parametrize("kind", ["linear_operator", "callable", "matrix"])
def test_user_preconditioner(kind):
    A = anisotropic_badly_scaled(12)
    b = np.ones(A.shape[0])
    dinv = 1.0 / A.diagonal()
    if kind == "linear_operator":
        M = sla.LinearOperator(A.shape, matvec=lambda r: dinv * r)
    elif kind == "callable":
        M = lambda r: dinv * r  # noqa: E731
    else:
        M = sp.diags(dinv).tocsr()
    res = solve(A, b, method="cg", M=M, rtol=1e-10)
    ref = solve(A, b, method="cg", M="jacobi", rtol=1e-10, callback=lambda xk: None)
    assert res.converged
    assert res.iterations == ref.iterations
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-10)


def test_bad_preconditioner_type():
    A = anisotropic_badly_scaled(3)
    with pytest.raises(TypeError, match="expected 'jacobi'"):
        make_preconditioner(3.0, A)
    with pytest.raises(ValueError, match="degree"):
        neumann(A, degree=-1)
    with pytest.raises(ValueError, match=r"M='ilu' is not a known preconditioner.*jacobi, neumann, amg"):
        make_preconditioner("ilu", A)


def test_an_expensive_preconditioner_asks_for_a_residual_check_every_iteration():
    from managed_solve.solvers.krylov import check_hint

    class Cycle:
        check_every = 1

        def matvec(self, r):
            return r

    cycle = Cycle()
    assert check_hint(cycle) == 1 and check_hint(cycle.matvec) == 1  # as given, or through matvec
    assert check_hint(lambda r: r) is None and check_hint(None) is None


def test_a_diagonal_preconditioner_on_an_operator_names_itself_and_a_wrong_shape_m_is_named():
    A = poisson2d(5)
    b = np.ones(A.shape[0])
    with pytest.raises(ValueError, match=r"solve\(M='neumann'\): this preconditioner is built "
                                         r"from A's diagonal.*MatrixLinearOperator"):
        solve(sla.aslinearoperator(A), b, M="neumann", method="cg", device="cpu")
    with pytest.raises(ValueError, match=r"M has shape \(26, 26\), A has \(25, 25\)"):
        solve(A, b, M=sp.identity(26, format="csr"), method="cg", device="cpu")


@pytest.mark.parametrize("dtype,tiny", [(np.float64, 1e-320), (np.float32, 1e-40)])
@pytest.mark.parametrize("method", ["cg", "bicgstab", "gmres", "minres"])
def test_a_diagonal_entry_whose_reciprocal_overflows_is_named(method, dtype, tiny, backend):
    """A non-zero diagonal entry below 1 / max of its float: 1 / d is inf. It went into the
    scaling, and each method reported a breakdown of its own (CG "A is not positive definite",
    GMRES and MINRES an overflow blamed on x0 or b) instead of the entry Jacobi cannot take."""
    A = laplacian1d(6).tolil()
    A[2, 2] = tiny
    A = A.tocsr().astype(dtype)
    Ad, bd = on(backend, A, np.ones(6, dtype=dtype))
    # A GPU may read a float32 subnormal as zero (flush to zero): the same refusal, of a zero.
    value = rf"{tiny:.3g}, whose reciprocal overflows {np.dtype(dtype)}"
    if backend != "cpu" and dtype == np.float32:
        value = rf"({value}|0, zero)"
    with pytest.raises(ValueError, match=rf"^solve\(M='jacobi'\): .* 1 diagonal entry .*"
                                         rf"\(rows \[2\]; A\[2, 2\] = {value}\)\. Use M=None"):
        solve(Ad, bd, method=method, M="jacobi")


class _DiagonalOperator:
    """A symmetric operator with ``matvec`` and ``diagonal()``, the latter as given."""

    def __init__(self, A, diagonal):
        self.A, self._diagonal = A, diagonal
        self.shape, self.dtype = A.shape, A.dtype

    def matvec(self, v):
        return self.A @ v

    def diagonal(self):
        return self._diagonal


@pytest.mark.parametrize("value,why", [(np.nan, "not a number"), (np.inf, "infinite")])
@pytest.mark.parametrize("M", ["jacobi", "neumann"])
def test_an_operator_diagonal_that_is_not_finite_is_named(value, why, M):
    """An operator's diagonal() is not checked as a matrix's entries are. 1 / NaN went into the
    scaling and GMRES ended in a NaN residual, read as an overflow of x0 or b; 1 / inf = 0 made
    M singular, and GMRES stopped at MAXITER blaming A's conditioning."""
    A = poisson2d(4)
    d = A.diagonal().copy()
    d[5] = value
    with pytest.raises(ValueError, match=rf"^solve\(M='{M}'\): .*\(rows \[5\]; "
                                         rf"A\[5, 5\] = {value}, {why}\)\. Use M=None"):
        solve(_DiagonalOperator(A, d), np.ones(16), method="gmres", M=M, device="cpu")
    with pytest.raises(ValueError, match=r"rows \[5\]"):
        inverse_diagonal(_DiagonalOperator(A, d))



def _holey(n=10):
    """A 1D Laplacian with an explicit zero at A[3, 3] (the pattern of ``laplacian1d(n)``)."""
    A = laplacian1d(n).tocsr()
    A[3, 3] = 0.0  # an entry of the pattern: stored as an explicit zero
    return A


@pytest.mark.parametrize("M", ["jacobi", "neumann"])
def test_set_up_errors_name_the_call_that_set_up(M):
    """A diagonal preconditioner on a zero diagonal is refused when the engine is set up, where
    no call was known: every entry point was named solve(M=...). Each names its own call."""
    from managed_solve import Solver, Status, solve_many

    A, n = _holey(), 10
    b = np.ones(n)
    refusal = rf"\(M='{M}'\): Jacobi scaling divides by A's diagonal.*\(rows \[3\]"
    with pytest.raises(ValueError, match=rf"^solve{refusal}"):
        solve(A, b, method="cg", M=M, device="cpu")
    with pytest.raises(ValueError, match=rf"^solve{refusal}"):
        solve(A, np.ones((n, 2)), method="cg", M=M, device="cpu")
    with pytest.raises(ValueError, match=rf"^Solver{refusal}"):
        Solver(A, method="cg", M=M, device="cpu")
    good = laplacian1d(n).tocsr()
    with Solver(good, method="gmres", M=M, device="cpu", rtol=1e-10) as solver:
        for values in (A, A.data):
            with pytest.raises(ValueError, match=rf"^Solver\.update\(A\) {refusal}"):
                solver.update(values)
        res = solver.solve(b)  # refused: the previous matrix and set-up stay
        assert res.converged
        np.testing.assert_allclose(res.x, sla.spsolve(good.tocsc(), b), rtol=1e-8)
    # MINRES is solved alone (the batched core has none): a Solver names the system as
    # solve_many names it, as the batched route's Jacobi does.
    for method in ("minres", "gmres"):
        res = solve_many([(good, b), (A, b)], method=method, M=M)
        assert res[0].converged and res[1].status is Status.INVALID_INPUT
        assert re.search(rf"^ValueError: systems\[1\] {refusal}", res[1].message), res[1].message
    named = solve_many([ms_system(A, b, M=M, method="minres", name="beam")])[0]
    assert re.search(rf"^ValueError: beam {refusal}", named.message), named.message
    # An unnamed LinearSystem solved alone is named by its place in the call too.
    unnamed = solve_many([ms_system(good, b, M=M, method="minres"),
                          ms_system(A, b, M=M, method="minres")])
    assert unnamed[0].converged and unnamed[1].status is Status.INVALID_INPUT
    assert re.search(rf"^ValueError: systems\[1\] {refusal}", unnamed[1].message), unnamed[1].message


def ms_system(A, b, **kw):
    from managed_solve import LinearSystem

    return LinearSystem(A, b, **kw)


def test_a_wrong_shaped_m_and_direct_on_an_operator_name_the_caller():
    from managed_solve import Solver, Status, solve_many

    A = poisson2d(4)
    b = np.ones(16)
    wrong = sp.identity(17, format="csr")
    shape = r"\(M=\.\.\.\): M has shape \(17, 17\), A has \(16, 16\)"
    with pytest.raises(ValueError, match=rf"^solve{shape}"):
        solve(A, b, M=wrong, method="cg", device="cpu")
    with pytest.raises(ValueError, match=rf"^solve{shape}"):
        solve(A, np.ones((16, 3)), M=wrong, method="cg", device="cpu")
    with pytest.raises(ValueError, match=rf"^Solver{shape}"):
        Solver(A, M=wrong, method="cg", device="cpu")
    res = solve_many([(A, b), ms_system(A, b, M=wrong, method="cg", name="beam")])
    assert res[0].converged and res[1].status is Status.INVALID_INPUT
    assert re.search(rf"^ValueError: beam {shape}", res[1].message), res[1].message
    # method='direct' needs entries: refused by each call's validation, naming that call.
    op = sla.aslinearoperator(A)
    direct = r"method='direct' needs the matrix entries; A is an operator"
    with pytest.raises(ValueError, match=rf"^solve\(A, b\): {direct}"):
        solve(op, b, method="direct", device="cpu")
    with pytest.raises(ValueError, match=rf"^Solver\(A\): {direct}"):
        Solver(op, method="direct", device="cpu")
    got = solve_many([(A, b), (op, b)], method="direct")
    assert got[0].converged and got[1].status is Status.INVALID_INPUT
    assert "systems[1]" in got[1].message and direct in got[1].message
    assert "solve(" not in got[1].message, got[1].message
