"""Singular and semi-definite systems: consistent ones solve, inconsistent ones say so.

The cotangent Laplacian of a closed surface and every pure-Neumann problem
are singular (constants span the null space).
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import DeviceManager, LinearSystem, Solver, Status, solve, solve_many
from managed_solve.solvers.minres import minres
from tests._problems import BACKENDS, array_modules, host, laplacian1d, neumann2d, on

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


# -- method="direct" with nullspace=: the factors of A with null-space unknowns pinned


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def pinv_solution(A, b):
    """The minimum-norm least-squares solution (the pseudo-inverse's), column by column.

    The cut-off is explicit: the default (1e-15 relative) keeps a rounded zero
    singular value on some LAPACK builds, and the answer then has a huge null part.
    """
    return np.linalg.pinv(A.toarray() if sp.issparse(A) else A, rcond=1e-10) @ b


def test_direct_with_nullspace_matches_the_pseudo_inverse_and_the_krylov_methods(backend):
    """A 1D pure Neumann matrix has an exactly zero LU pivot: direct used to give BREAKDOWN."""
    n = 50
    A = laplacian1d(n, neumann=True)
    b = np.random.default_rng(0).standard_normal(n)
    b -= b.mean()  # consistent
    for rhs, status in ((b, Status.CONVERGED), (b + 0.3, Status.LEAST_SQUARES)):
        ref = pinv_solution(A, rhs)
        Ad, bd = on(backend, A, rhs)
        res = solve(Ad, bd, method="direct", nullspace=np.ones(n))
        assert res.status is status and res.method == "direct", res.message
        x = host(res.x)
        np.testing.assert_allclose(x, ref, rtol=1e-9, atol=1e-9 * np.abs(ref).max())
        assert abs(x.sum()) <= 1e-10 * np.abs(x).sum()
        # The Krylov methods' contract: the same x, status and residual.
        cg = solve(A, rhs, method="cg", nullspace=np.ones(n), device="cpu", rtol=1e-12)
        assert cg.status is status
        np.testing.assert_allclose(x, cg.x, rtol=1e-8, atol=1e-8 * np.abs(ref).max())
        np.testing.assert_allclose(res.residual_norm, cg.residual_norm, rtol=1e-6, atol=1e-12)
    assert np.linalg.norm(b - A @ x) <= 1e-8 * np.linalg.norm(b + 0.3)


def test_direct_solver_with_nullspace_blocks_transposes_and_updates(backend):
    n = 40
    A = laplacian1d(n, neumann=True)
    rng = np.random.default_rng(5)
    b = A @ rng.standard_normal(n)
    B = np.stack([b, b + 1.0, -2.0 * b], axis=1)
    xp, _sparse = array_modules(backend)
    with Solver(on(backend, A), method="direct", nullspace="constant", rtol=1e-10) as solver:
        res = solver.solve(xp.asarray(B))
        assert res.column_status == (Status.CONVERGED, Status.LEAST_SQUARES, Status.CONVERGED)
        np.testing.assert_allclose(host(res.x), pinv_solution(A, B), rtol=1e-9, atol=1e-10)
        t = solver.solve_transpose(xp.asarray(b + 1.0))
        assert t.status is Status.LEAST_SQUARES
        np.testing.assert_allclose(host(t.x), pinv_solution(A, b + 1.0), rtol=1e-9, atol=1e-10)
        # New values, the same pattern and null space: a variable coefficient (D^T W D).
        D = sp.diags([-np.ones(n - 1), np.ones(n - 1)], [0, 1], shape=(n - 1, n))
        A2 = (D.T @ sp.diags(np.linspace(1.0, 3.0, n - 1)) @ D).tocsr()
        A2.sort_indices()
        assert np.array_equal(A2.indptr, A.indptr) and np.array_equal(A2.indices, A.indices)
        solver.update(on(backend, A2))
        b2 = A2 @ rng.standard_normal(n)
        res2 = solver.solve(xp.asarray(b2))
        assert res2.converged, res2.message
        np.testing.assert_allclose(host(res2.x), pinv_solution(A2, b2), rtol=1e-9, atol=1e-10)


def test_direct_with_nullspace_keeps_the_cholesky_factor_on_the_host():
    """A semi-definite A pinned is definite: Cholesky, not SuperLU on a matrix that is singular."""
    A = neumann2d(10)
    b = A @ np.random.default_rng(2).standard_normal(A.shape[0])
    res = solve(A, b, method="direct", nullspace="constant", device="cpu", rtol=1e-12)
    assert res.converged and res.info["factorisation"].startswith("Cholesky")
    np.testing.assert_allclose(res.x, pinv_solution(A, b), rtol=1e-10, atol=1e-12)


def test_direct_with_nullspace_of_two_components_and_a_dense_matrix():
    L = laplacian1d(15, neumann=True)
    A = sp.block_diag([L, 2.0 * L], format="csr")  # two components: one constant each
    N = np.zeros((30, 2))
    N[:15, 0] = N[15:, 1] = 1.0
    b = A @ np.random.default_rng(4).standard_normal(30) + N @ [1.0, -2.0]  # inconsistent
    for matrix in (A, A.toarray()):
        res = solve(matrix, b, method="direct", nullspace=N, device="cpu")
        assert res.status is Status.LEAST_SQUARES, res.message
        np.testing.assert_allclose(res.x, pinv_solution(A, b), rtol=1e-9, atol=1e-12)
    # One constant for both components leaves A singular: said so, naming nullspace=.
    short = solve(A, b, method="direct", nullspace="constant", device="cpu")
    assert short.status is Status.BREAKDOWN and short.x is None
    assert "nullspace=" in short.message and "all of A's null space" in short.message


def test_direct_with_nullspace_of_a_non_symmetric_matrix():
    """Convection makes A non-symmetric: A 1 = 0, but 1^T A != 0 (A^T has another null space).

    A b in A's range and orthogonal to the constants is solved, x orthogonal
    to them; so is every transposed solve (A^T's range is orthogonal to the
    constants), as GMRES solves it. A b whose projection leaves A's range
    has no answer: direct says so, where GMRES runs out of iterations.
    """
    n = 30
    upwind = sp.diags([-np.ones(n - 1), np.r_[0.0, np.ones(n - 1)]], [-1, 0], format="csr")
    A = (laplacian1d(n, neumann=True) + 0.4 * upwind).tocsr()
    assert np.abs(A @ np.ones(n)).max() < 1e-14 and np.abs(np.ones(n) @ A).max() > 0.1
    rng = np.random.default_rng(8)
    y = A @ rng.standard_normal(n)
    v = A @ np.eye(n)[0]
    b = y - (y.sum() / v.sum()) * v  # A (x - t e_0): in the range, and it sums to zero
    x = rng.standard_normal(n)
    x -= x.mean()
    with Solver(A, method="direct", nullspace="constant", device="cpu", rtol=1e-10) as solver:
        res = solver.solve(b)
        tr = solver.solve_transpose(np.stack([A.T @ x, A.T @ (2.0 * x)], axis=1))
    assert res.converged, res.message
    np.testing.assert_allclose(res.x, pinv_solution(A, b), rtol=1e-9, atol=1e-12)
    assert tr.column_status == (Status.CONVERGED, Status.CONVERGED), tr.message
    np.testing.assert_allclose(tr.x, np.stack([x, 2.0 * x], axis=1), rtol=1e-9, atol=1e-12)
    with Solver(A, method="gmres", nullspace="constant", device="cpu", rtol=1e-10) as solver:
        gm = solver.solve_transpose(A.T @ x)
    assert gm.converged
    np.testing.assert_allclose(tr.x[:, 0], gm.x, rtol=1e-7, atol=1e-9)
    bad = solve(A, y, method="direct", nullspace="constant", device="cpu")
    assert bad.status is Status.BREAKDOWN and bad.x is None
    assert "A^T" in bad.message and "nullspace=" in bad.message
    gm = solve(A, y, method="gmres", nullspace="constant", device="cpu", maxiter=300)
    assert gm.status is not Status.CONVERGED


def test_auto_and_solve_many_with_nullspace_on_the_cpu():
    A = laplacian1d(40, neumann=True)
    b = consistent(A)
    with Solver(A, nullspace="constant", device="cpu") as solver:  # kept: "auto" factorises
        assert solver.method == "direct"
        res = solver.solve(np.stack([b, b + 1.0], axis=1))
    assert res.column_status == (Status.CONVERGED, Status.LEAST_SQUARES)
    np.testing.assert_allclose(res.x, pinv_solution(A, np.stack([b, b + 1.0], axis=1)),
                               rtol=1e-9, atol=1e-10)
    systems = [LinearSystem(A, b, method="direct", nullspace="constant"),
               LinearSystem(A, b + 1.0, method="direct", nullspace=np.ones(40))]
    out = solve_many(systems, manager=DeviceManager(simulate="1x64MiB"))
    assert [o.status for o in out] == [Status.CONVERGED, Status.LEAST_SQUARES]
    assert all(o.method == "direct" for o in out)
    np.testing.assert_allclose(out[1].x, pinv_solution(A, b + 1.0), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("method", ["cg", "minres", "direct"])
def test_an_update_whose_matrix_leaves_the_null_space_is_refused_and_changes_nothing(method,
                                                                                  backend):
    """nullspace= was checked against A once, at construction: an update to values that no
    longer annihilate it was taken, and the solve then projected the wrong space (a wrong x, or
    MAXITER blamed on A). The update checks it as the constructor does, and a refusal leaves
    the solver as it was."""
    n = 30
    A = laplacian1d(n, neumann=True)
    b = consistent(A)
    grounded = A.tolil()
    grounded[0, 0] += 1.0  # a Dirichlet row: nonsingular, the constants no longer a null space
    grounded = grounded.tocsr()
    assert np.array_equal(grounded.indices, A.indices)
    xp, _sparse = array_modules(backend)
    with Solver(on(backend, A), method=method, nullspace="constant", rtol=1e-10) as solver:
        before = solver.solve(xp.asarray(b))
        for values in (on(backend, grounded), xp.asarray(grounded.data)):
            with pytest.raises(ValueError, match=r"^Solver\.update\(A\): nullspace= is not the "
                                                 r"new A's null space: nullspace gives"
                                                 r".*Solver\(A, nullspace=\.\.\.\)"):
                solver.update(values)
        after = solver.solve(xp.asarray(b))
        assert after.converged, after.message
        np.testing.assert_array_equal(host(after.x), host(before.x))
        np.testing.assert_allclose(host(after.x), pinv_solution(A, b), rtol=1e-7, atol=1e-9)
        solver.update(on(backend, (3.0 * A).tocsr()))  # the same null space: taken
        scaled = solver.solve(xp.asarray(b))
        np.testing.assert_allclose(host(scaled.x), pinv_solution(A, b) / 3.0, rtol=1e-7,
                                   atol=1e-9)


def test_an_update_names_the_failing_vector_of_several():
    L = laplacian1d(15, neumann=True)
    A = sp.block_diag([L, 2.0 * L], format="csr")
    N = np.zeros((30, 2))
    N[:15, 0] = N[15:, 1] = 1.0
    coupled = A.tolil()
    coupled[20, 20] += 1.0  # the second component grounded: its constant leaves the null space
    with Solver(A, method="cg", nullspace=N, device="cpu") as solver:
        with pytest.raises(ValueError, match=r"^Solver\.update\(A\): .*nullspace\[:, 1\] gives"):
            solver.update(coupled.tocsr())
