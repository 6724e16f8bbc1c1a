"""Singular and semi-definite systems: consistent ones solve, inconsistent ones say so.

The cotangent Laplacian of a closed surface and every pure-Neumann problem
are singular (constants span the null space).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import DeviceManager, LinearSystem, Solver, Status, solve, solve_many
from managed_solve.solvers.minres import minres
from tests._problems import laplacian1d, neumann2d

RNG = np.random.default_rng(11)


def consistent(A):
    return A @ RNG.standard_normal(A.shape[0])


def inconsistent(A):
    return RNG.standard_normal(A.shape[0]) + 0.5  # a part along the constants


@pytest.mark.parametrize("method", ["auto", "cg", "minres", "gmres"])
def test_a_consistent_singular_system_converges(method):
    A = neumann2d(12)
    b = consistent(A)
    res = solve(A, b, method=method, device="cpu", rtol=1e-9)
    assert res.converged, res.message
    assert np.linalg.norm(b - A @ res.x) <= 1e-9 * np.linalg.norm(b)


def test_auto_falls_back_from_a_singular_factorisation_on_the_cpu():
    """An exactly singular LU (a zero row) under "auto": the Krylov fallback solves it."""
    A = laplacian1d(30).tolil()
    A[7, :] = 0.0
    A[:, 7] = 0.0
    A = A.tocsr()
    A.eliminate_zeros()
    b = consistent(A)
    res = solve(A, b, device="cpu")
    assert res.converged and res.info.get("fallback_from") == "direct", res.message
    assert np.linalg.norm(b - A @ res.x) <= 1e-8 * np.linalg.norm(b)


def test_minres_residual_never_grows_on_an_inconsistent_system():
    """MINRES stops at the least-squares solution (SciPy's minres reaches the same residual)."""
    A = laplacian1d(50, neumann=True)
    b = np.random.default_rng(0).standard_normal(50)
    out = minres(A, b, rtol=1e-10, maxiter=500)
    ours = np.linalg.norm(b - A @ out.x)
    x_ref, _ = sla.minres(A, b, rtol=1e-10, maxiter=500)
    best = abs(b.mean()) * np.sqrt(50)  # the least-squares residual: b's constant part
    assert ours <= 1.001 * best
    assert ours <= 1.001 * np.linalg.norm(b - A @ x_ref)


@pytest.mark.parametrize("method", ["auto", "minres"])
def test_an_inconsistent_system_is_least_squares_not_converged(method):
    A = laplacian1d(40, neumann=True)
    b = inconsistent(A)
    res = solve(A, b, method=method, device="cpu")
    assert res.status is Status.LEAST_SQUARES, (res.status, res.message)
    assert "not in the range" in res.message and res.x is not None
    # As SciPy's minres, x drifts along the null space: its residual is SciPy's, near the best.
    x_ref, _ = sla.minres(A, b, rtol=1e-8, maxiter=400)
    assert np.linalg.norm(b - A @ res.x) <= 1.05 * np.linalg.norm(b - A @ x_ref)


def test_a_failed_cg_hands_back_nothing_worse_than_its_start():
    A = laplacian1d(40, neumann=True)
    b = inconsistent(A)
    res = solve(A, b, method="cg", device="cpu", maxiter=400)
    assert not res.converged
    assert np.linalg.norm(b - A @ res.x) <= np.linalg.norm(b) * (1 + 1e-12)


@pytest.mark.parametrize("method", ["auto", "cg", "minres", "direct"])
def test_nullspace_constant_projects_b_and_x(method):
    A = neumann2d(10)
    x_true = RNG.standard_normal(100)
    x_true -= x_true.mean()
    b = A @ x_true
    res = solve(A, b + 3.0, method=method, nullspace="constant", device="cpu", rtol=1e-10)
    # b + 3 has a constant part no x reaches: least squares, x orthogonal to the constants.
    assert res.status is Status.LEAST_SQUARES and "outside the range" in res.message
    assert abs(res.x.sum()) <= 1e-8 * np.abs(res.x).sum()
    np.testing.assert_allclose(res.x, x_true, rtol=1e-6, atol=1e-8)
    ok = solve(A, b, method=method, nullspace="constant", device="cpu", rtol=1e-10)
    assert ok.converged and abs(ok.x.sum()) <= 1e-8 * np.abs(ok.x).sum()
    np.testing.assert_allclose(ok.x, x_true, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("device", ["cpu", "sim:0"])
@pytest.mark.parametrize("method", ["cg", "minres", "bicgstab", "gmres"])
def test_nullspace_least_squares_only_when_the_projected_system_converged(method, device):
    """Out of iterations on P b is MAXITER: x is then not the least-squares answer."""
    dm = DeviceManager(simulate="2x1GiB")
    A = laplacian1d(60, neumann=True)
    b = np.random.default_rng(3).standard_normal(60)  # a constant part: inconsistent
    x_ls = np.linalg.lstsq(A.toarray(), b, rcond=None)[0]  # orthogonal to the constants
    short = solve(A, b, method=method, nullspace="constant", device=device, maxiter=10,
                  manager=dm)
    assert short.status is Status.MAXITER, (short.status, short.message)
    assert "projected system" in short.message
    assert np.linalg.norm(short.x - x_ls) > 1e-2 * np.linalg.norm(x_ls)
    full = solve(A, b, method=method, nullspace="constant", device=device, maxiter=5000,
                 manager=dm)
    assert full.status is Status.LEAST_SQUARES, (full.status, full.message)
    np.testing.assert_allclose(full.x, x_ls, rtol=1e-5, atol=1e-6 * np.abs(x_ls).max())


def test_nullspace_vectors_in_a_solver_and_solve_many():
    A = laplacian1d(30, neumann=True)
    N = np.ones(30)
    b = consistent(A)
    with Solver(A, method="cg", nullspace=N) as solver:
        res = solver.solve(np.stack([b, 2 * b], axis=1))
    assert res.converged and np.allclose(res.x.sum(axis=0), 0.0, atol=1e-9)
    systems = [LinearSystem(A, b, nullspace="constant"), LinearSystem(A, b + 1.0,
                                                                      nullspace="constant")]
    out = solve_many(systems, manager=DeviceManager(simulate="1x64MiB"))
    assert out[0].converged and out[1].status is Status.LEAST_SQUARES


def test_bad_nullspace_names_the_argument():
    A = laplacian1d(5, neumann=True)
    with pytest.raises(ValueError, match="nullspace"):
        solve(A, np.ones(5), nullspace="linear")
    with pytest.raises(ValueError, match="nullspace must have shape"):
        solve(A, np.ones(5), nullspace=np.ones(4))
    with pytest.raises(ValueError, match="linearly dependent"):
        solve(A, np.ones(5), nullspace=np.ones((5, 2)))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["cg", "minres", "direct"])
def test_nullspace_on_a_gpu(method):
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = neumann2d(10)
    x_true = RNG.standard_normal(100)
    x_true -= x_true.mean()
    b = A @ x_true
    with Solver(csp.csr_matrix(A), method=method, nullspace="constant", device="cuda:0",
                rtol=1e-10) as solver:
        ok = solver.solve(cp.asarray(b))
        off = solver.solve(cp.asarray(np.stack([b + 3.0, b], axis=1)))
    assert ok.converged
    np.testing.assert_allclose(ok.to_numpy(), x_true, rtol=1e-6, atol=1e-8)
    assert off.column_status == (Status.LEAST_SQUARES, Status.CONVERGED)
    np.testing.assert_allclose(off.to_numpy()[:, 0], x_true, rtol=1e-6, atol=1e-8)
