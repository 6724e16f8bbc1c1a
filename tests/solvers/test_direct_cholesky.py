"""The direct engine's Cholesky path: SPD host matrices, update() with new values, fallbacks to SuperLU."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import Solver
from managed_solve.solvers.direct import CHOLESKY, DirectEngine
from managed_solve.solvers.engine import Options
from tests._problems import helmholtz2d, neumann2d, poisson2d, poisson3d


def _engine(A, rtol=1e-10, symmetric=True):
    return DirectEngine().prepare(A, Options("direct", rtol=rtol, symmetric=symmetric), None)


def test_spd_matrices_take_a_cholesky_factor_and_solve_blocks():
    A = poisson3d(10)
    B = np.random.default_rng(0).standard_normal((A.shape[0], 6))
    with Solver(A, method="direct", rtol=1e-10, device="cpu") as solver:
        res = solver.solve(B)
        assert res.converged and res.info["path"] == "direct"
        assert solver.solve(B[:, 0]).info["factorisation"] == CHOLESKY
        np.testing.assert_allclose(res.x, sla.splu(A.tocsc()).solve(B), rtol=1e-9, atol=1e-12)
        for j in range(6):
            assert np.linalg.norm(B[:, j] - A @ res.x[:, j]) <= 1e-10 * np.linalg.norm(B[:, j])
        t = solver.solve_transpose(B[:, 0])
        np.testing.assert_allclose(t.x, res.x[:, 0], rtol=1e-12)


def test_update_refactors_on_the_kept_analysis():
    A = poisson2d(25)
    A2 = A.copy()
    A2.setdiag(A.diagonal() + np.linspace(0.1, 2.0, A.shape[0]))
    b = np.ones(A.shape[0])
    engine = _engine(A)
    before = engine.factor_bytes
    engine.update(A2.data)
    got = engine.solve(b)
    assert got.code == 0 and got.info["factorisation"] == CHOLESKY
    fresh = _engine(A2).solve(b)
    np.testing.assert_array_equal(got.x, fresh.x)  # numeric work on the kept analysis = fresh
    np.testing.assert_allclose(got.x, sla.spsolve(A2.tocsc(), b), rtol=1e-10)
    assert engine.factor_bytes == before > 0
    engine.close()


def test_update_with_a_wrong_pattern_is_a_clear_error():
    A = poisson2d(6)
    with Solver(A, method="direct", device="cpu") as solver:
        with pytest.raises(ValueError, match="pattern"):
            solver.update(poisson2d(6) + helmholtz2d(6, 0.1).T @ helmholtz2d(6, 0.1))


def test_update_to_indefinite_values_falls_back_to_superlu():
    A = poisson2d(12)
    H = helmholtz2d(12, shift=1.0)  # the same pattern, symmetric indefinite
    assert np.array_equal(H.indices, A.indices)
    b = np.arange(A.shape[0], dtype=float)
    with Solver(A, method="direct", rtol=1e-10, device="cpu") as solver:
        assert solver.solve(b).info["factorisation"] == CHOLESKY
        solver.update(H)
        res = solver.solve(b)
        assert res.converged and "SuperLU" in res.info["factorisation"]
        np.testing.assert_allclose(res.x, sla.spsolve(H.tocsc(), b), rtol=1e-9)
        solver.update(A)  # back to SPD values: Cholesky again
        res = solver.solve(b)
        assert res.converged and res.info["factorisation"] == CHOLESKY


def test_update_to_non_symmetric_values_keeps_the_right_answer():
    A = poisson2d(10)
    N = A.copy()
    N.data = N.data * (1.0 + 0.1 * np.sin(np.arange(N.nnz)))  # the pattern kept, symmetry lost
    b = np.ones(A.shape[0])
    with Solver(A, method="direct", rtol=1e-10, device="cpu") as solver:
        solver.update(N)
        res = solver.solve(b)
        assert res.converged and "SuperLU" in res.info["factorisation"]
        np.testing.assert_allclose(res.x, sla.spsolve(N.tocsc(), b), rtol=1e-9)


def test_indefinite_symmetric_matrix_falls_back_with_the_right_answer():
    H = helmholtz2d(20, shift=0.7)
    b = np.random.default_rng(1).standard_normal(H.shape[0])
    out = _engine(H).solve(b)
    assert out.code == 0 and "SuperLU" in out.info["factorisation"]
    np.testing.assert_allclose(out.x, sla.spsolve(H.tocsc(), b), rtol=1e-8)


def test_singular_neumann_matrix_is_an_honest_breakdown():
    A = neumann2d(12)
    b = np.arange(1.0, A.shape[0] + 1)  # not in the range
    with Solver(A, method="direct", device="cpu") as solver:
        res = solver.solve(b)
    assert res.status.name == "BREAKDOWN" and res.x is None
    assert "singular" in res.message


def test_float32_spd_solve():
    A = poisson2d(20, np.float32)
    b = np.ones(A.shape[0], np.float32)
    out = _engine(A, rtol=1e-5).solve(b)
    assert out.code == 0 and out.x.dtype == np.float32
    assert out.info["factorisation"] == CHOLESKY
    np.testing.assert_allclose(out.x, sla.spsolve(A.astype(np.float64).tocsc(), b), rtol=1e-4)


def test_float32_mirrors_a_few_ulps_apart_take_the_cholesky_factor():
    """float32 summation-order rounding between mirrors is symmetric for Cholesky as for ``auto``.

    Judged with float64's tolerance (1e-12) the factorisation was refused
    ("values not symmetric") and SuperLU ran; a 1e-3 asymmetry still is.
    """
    from managed_solve.solvers.cholesky import eligible

    A = poisson2d(20, np.float32).tolil()
    A[5, 6] = np.float32(-1.0) - 8 * np.finfo(np.float32).eps  # 8 ulps from its mirror (6, 5)
    A = A.tocsr()
    b = np.ones(A.shape[0], np.float32)
    assert eligible(A) is None
    out = _engine(A, rtol=1e-5).solve(b)
    assert out.code == 0 and out.info["factorisation"] == CHOLESKY
    np.testing.assert_allclose(out.x, sla.spsolve(A.astype(np.float64).tocsc(), b), rtol=1e-4)
    A[5, 6] = np.float32(-1.001)
    assert eligible(A) == "values not symmetric"
    out = _engine(A, rtol=1e-5).solve(b)
    assert out.code == 0 and out.info["factorisation"] != CHOLESKY
    np.testing.assert_allclose(out.x, sla.spsolve(A.astype(np.float64).tocsc(), b), rtol=1e-4)
