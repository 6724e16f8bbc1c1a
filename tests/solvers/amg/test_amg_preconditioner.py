"""AMGPreconditioner and M="amg": against PyAMG, inside solve/Solver, update, float32.

Covers managed_solve/solvers/amg/preconditioner.py and pyamg_setup.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

import managed_solve as ms
from managed_solve.solvers.amg import AMGPreconditioner, amg, hierarchy, hierarchy_bytes_estimate
from managed_solve.solvers.cg import cg
from managed_solve.solvers.gmres import gmres
from tests._problems import (
    BACKENDS,
    assert_matches_spsolve,
    convection_diffusion,
    elasticity,
    high_contrast_poisson,
    host,
    on,
    poisson2d,
    poisson3d,
    rotated_anisotropic,
    symmetrically_scaled,
)

pyamg = pytest.importorskip("pyamg")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def rhs(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n)


PROBLEMS = {
    "poisson2d-255": lambda: (poisson2d(255), None),
    "poisson3d-24": lambda: (poisson3d(24), None),
    "rotated-anisotropic-95": lambda: (rotated_anisotropic(95), None),
    "elasticity-60": lambda: elasticity(60),
}


@functools.lru_cache
def problem(name):
    """(A, B, b, PyAMG's CG iterations to rtol 1e-8, PyAMG's operator complexity)."""
    A, B = PROBLEMS[name]()
    b = rhs(A.shape[0])
    ml = pyamg.smoothed_aggregation_solver(A, B=B)
    # PyAMG's V-cycle inside SciPy's CG (PyAMG's own Krylov module does not
    # run with every SciPy release), iterations counted by the callback.
    its = []
    x, info = spla.cg(A, b, rtol=1e-8, maxiter=500, M=ml.aspreconditioner(cycle="V"),
                      callback=lambda xk: its.append(1))
    assert info == 0
    return A, B, b, len(its), ml.operator_complexity()


@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("setup", ["native", "pyamg"])
def test_cg_iterations_are_within_a_few_of_pyamg(name, setup):
    A, B, b, ref, ref_complexity = problem(name)
    M = amg(A, setup=setup, nullspace=B)
    out = cg(A.tocsr(), b, rtol=1e-8, M=M, maxiter=500)
    assert out.code == 0
    assert out.iterations <= 1.15 * ref + 3, (out.iterations, ref)
    assert np.linalg.norm(b - A @ out.x) <= 1e-8 * np.linalg.norm(b) * 1.0001
    assert 0.7 * ref_complexity <= M.operator_complexity <= 1.3 * ref_complexity
    assert 1.0 < M.grid_complexity < 1.5


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_gpu_cg_iterations_are_within_a_few_of_pyamg(name):
    # The hierarchy set up on the GPU (aggregation, smoothing, Galerkin
    # products there) against PyAMG's on the host, rigid-body modes given.
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A, B, b, ref, ref_complexity = problem(name)
    Ad, bd = csp.csr_matrix(A.tocsr()), cp.asarray(b)
    # CuPy has no BSR: elasticity's 2 x 2 node blocks are named (as PyAMG reads them off its BSR).
    blocksize = A.blocksize[0] if A.format == "bsr" else 1
    M = amg(Ad, nullspace=None if B is None else cp.asarray(B), blocksize=blocksize)
    res = ms.solve(Ad, bd, method="cg", M=M, rtol=1e-8, maxiter=500)
    assert res.status == ms.Status.CONVERGED
    assert res.iterations <= 1.15 * ref + 3, (res.iterations, ref)
    assert np.linalg.norm(b - A @ host(res.x)) <= 1e-8 * np.linalg.norm(b) * 1.0001
    assert 0.7 * ref_complexity <= M.operator_complexity <= 1.3 * ref_complexity


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gmres", "bicgstab"])
def test_gpu_non_symmetric_krylov_with_amg_beats_no_preconditioner(method):
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = convection_diffusion(127)
    b = rhs(A.shape[0])
    Ad, bd = csp.csr_matrix(A), cp.asarray(b)
    plain = ms.solve(Ad, bd, method=method, M=None, rtol=1e-8, maxiter=20_000)
    res = ms.solve(Ad, bd, method=method, M="amg", rtol=1e-8)
    assert res.status == ms.Status.CONVERGED
    assert res.iterations * 4 < plain.iterations, (res.iterations, plain.iterations)
    assert np.linalg.norm(b - A @ host(res.x)) <= 1.0001e-8 * np.linalg.norm(b)


@pytest.mark.gpu
@pytest.mark.parametrize("problem_name", ["poisson2d", "poisson3d"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gpu_memory_estimate_matches_the_pools_growth(problem_name, dtype):
    # What the planner reserves for a hierarchy (the estimate from n and nnz)
    # against what the set-up really leaves allocated in CuPy's pool.
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = poisson2d(511) if problem_name == "poisson2d" else poisson3d(64)
    Ad = csp.csr_matrix(A)
    amg(Ad, dtype=dtype)  # kernels compiled and library handles made before measuring
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    base = pool.used_bytes()
    M = amg(Ad, dtype=dtype)
    cp.cuda.Device().synchronize()
    grown = pool.used_bytes() - base
    est = hierarchy_bytes_estimate(A.shape[0], A.nnz, cycle_itemsize=np.dtype(dtype).itemsize,
                                   fused=True)
    assert grown == pytest.approx(est, rel=0.15), (grown, est, M.nbytes)
    assert grown == pytest.approx(M.nbytes, rel=0.15), (grown, M.nbytes)


def test_v_cycle_convergence_factor_is_close_to_pyamgs():
    A = poisson2d(127)
    b = rhs(A.shape[0])
    res = []
    pyamg.smoothed_aggregation_solver(A).solve(b, tol=1e-12, residuals=res, maxiter=10)
    ref = (res[-1] / res[2]) ** (1 / (len(res) - 3))
    for setup in ("native", "pyamg"):
        M = amg(A, setup=setup)
        x = np.zeros_like(b)
        norms = []
        for _ in range(10):
            x += M(b - A @ x)
            norms.append(np.linalg.norm(b - A @ x))
        ours = (norms[-1] / norms[1]) ** (1 / 8)
        assert ours <= ref + 0.15, (setup, ours, ref)


def test_solve_with_amg_converges_in_far_fewer_iterations(backend):
    A = poisson2d(127)
    b = rhs(A.shape[0])
    Ad, bd = on(backend, A, b)
    plain = ms.solve(Ad, bd, method="cg", rtol=1e-8)
    res = ms.solve(Ad, bd, method="cg", M="amg", rtol=1e-8)
    assert res.status == ms.Status.CONVERGED
    assert res.iterations <= 15 and res.iterations * 10 < plain.iterations
    x = host(res.x)
    assert np.linalg.norm(b - A @ x) <= 1e-8 * np.linalg.norm(b) * 1.0001


def test_poisson_511_converges_in_at_most_30_iterations():
    A = poisson2d(511)
    b = rhs(A.shape[0])
    res = ms.solve(A, b, M="amg", rtol=1e-8)
    assert res.status == ms.Status.CONVERGED and res.iterations <= 30
    assert np.linalg.norm(b - A @ res.x) <= 1e-8 * np.linalg.norm(b) * 1.0001


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_block_cycle_equals_one_cycle_per_column(backend, dtype):
    # A block (one cycle of SpMMs over its columns on the host, a fused cycle
    # a column on a GPU): each column gets what the one-vector cycle gives it,
    # before and after new values.
    A = poisson2d(63)
    R = np.random.default_rng(3).standard_normal((A.shape[0], 5))
    Ad, Rd = on(backend, A, R)
    M = amg(Ad, setup="native", dtype=dtype)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for _ in range(2):
        Z = host(M(Rd))
        assert Z.shape == R.shape and Z.dtype == np.float64
        cols = np.stack([host(M(Rd[:, j].copy())) for j in range(R.shape[1])], axis=1)
        assert np.abs(Z - cols).max() <= tol * np.abs(cols).max()
        M.update(on(backend, (A + sp.identity(A.shape[0])).tocsr()))
    assert host(M(Rd[:, :3])).shape == (A.shape[0], 3)  # another width: a cycle of its own


def test_solver_with_amg_takes_a_block_of_right_hand_sides(backend):
    A = poisson2d(63)
    B = np.random.default_rng(2).standard_normal((A.shape[0], 3))
    Ad, Bd = on(backend, A, B)
    with ms.Solver(Ad, M="amg", rtol=1e-8) as solver:
        out = solver.solve(Bd)
    X = host(out.x)
    assert X.shape == B.shape
    for j in range(3):
        assert np.linalg.norm(B[:, j] - A @ X[:, j]) <= 1.0001e-8 * np.linalg.norm(B[:, j])
    assert max(np.atleast_1d(out.iterations)) <= 15


# PyAMG estimates rho(D^-1 A) from a random start, so two PyAMG set-ups of one
# matrix differ slightly; ours is deterministic.
@pytest.mark.parametrize("setup,tol", [("native", 1e-10), ("pyamg", 1e-2)])
def test_update_equals_a_fresh_set_up(setup, tol):
    A = poisson2d(63)
    A2 = (A + sp.diags(np.linspace(0.0, 1.0, A.shape[0]))).tocsr()
    r = rhs(A.shape[0])
    # theta 0: aggregates follow the pattern alone, so a fresh set-up on the
    # new values finds the ones update() keeps (a threshold measures the values).
    M = amg(A, setup=setup, theta=0.0)
    M.update(A2.data)
    fresh = amg(A2, setup=setup, theta=0.0)
    assert [lev.A.shape for lev in M.levels] == [lev.A.shape for lev in fresh.levels]
    z = fresh(r)
    np.testing.assert_allclose(M(r), z, atol=tol * abs(z).max())
    M.update(A2)  # a matrix of the same pattern works too
    np.testing.assert_allclose(M(r), z, atol=tol * abs(z).max())
    with pytest.raises(ValueError, match="pattern"):
        M.update(poisson2d(10))


def test_update_with_pyamgs_own_cycle_keeps_its_aggregates():
    A = poisson2d(63)
    A2 = (A + sp.diags(np.linspace(0.0, 1.0, A.shape[0]))).tocsr()
    M = amg(A, cycle="pyamg")
    sizes = [lev.A.shape for lev in M.levels]
    M.update(A2.data)
    assert [lev.A.shape for lev in M.levels] == sizes
    x = cg(A2, rhs(A.shape[0]), rtol=1e-8, M=M)
    assert x.code == 0 and x.iterations <= 15


def test_solver_update_reuses_the_hierarchy(backend):
    A = poisson2d(63)
    A2 = (A + sp.diags(np.linspace(0.0, 1.0, A.shape[0]))).tocsr()
    b = rhs(A.shape[0])
    Ad, A2d, bd = on(backend, A, A2, b)
    with ms.Solver(Ad, method="cg", M="amg") as solver:
        solver.solve(bd)
        solver.update(A2d)
        x = host(solver.solve(bd).x)
    assert np.linalg.norm(b - A2 @ x) <= 1.0001e-8 * np.linalg.norm(b)


def new_values(case, m=32):
    """``(A, A2)``, one pattern: 2D Poisson and new values of it.

    ``"scaled"``: ``D A D`` with d over three decades (the strength graph
    kept, the near-null space ``D^-1 1`` instead of the constants);
    ``"jump"``: the coefficient jumping by 10^6 across the middle (the
    couplings across the jump weak).
    """
    A = poisson2d(m)
    if case == "scaled":
        return A, symmetrically_scaled(A, 10.0 ** np.random.default_rng(1).uniform(0, 3, m * m))
    return A, high_contrast_poisson(m)


@pytest.mark.parametrize("case", ["scaled", "jump"])
def test_solver_update_iterates_as_a_fresh_set_up(backend, case):
    # M="amg" (PyAMG's set-up on the CPU, ours on a GPU) after Solver.update
    # against a Solver made on the new values (PyAMG's eigenvalue estimate
    # starts at random: its count varies by one).
    A, A2 = new_values(case)
    b = rhs(A.shape[0])
    Ad, A2d, bd = on(backend, A, A2, b)
    with ms.Solver(Ad, method="cg", M="amg", rtol=1e-8) as solver:
        solver.solve(bd)
        solver.update(A2d)
        out = solver.solve(bd)
    with ms.Solver(A2d, method="cg", M="amg", rtol=1e-8) as fresh:
        ref = fresh.solve(bd)
    assert out.status == ms.Status.CONVERGED
    assert abs(out.iterations - ref.iterations) <= 2, (out.iterations, ref.iterations)
    assert_matches_spsolve(out.x, A2, b, np.float64)


@pytest.mark.parametrize("case", ["scaled", "jump"])
def test_native_update_equals_a_fresh_set_up_on_new_coefficients(backend, case):
    # Our set-up is deterministic: the refreshed hierarchy is the fresh one,
    # and both relax the constants towards D A D's near-null space.
    A, A2 = new_values(case)
    b = rhs(A.shape[0])
    Ad, A2d, bd = on(backend, A, A2, b)
    M = amg(Ad, setup="native")
    M.update(A2d)
    fresh = amg(A2d, setup="native")
    out, ref = cg(A2d, bd, rtol=1e-10, M=M), cg(A2d, bd, rtol=1e-10, M=fresh)
    # (A GPU loop reads its residual in batches: the count it converged at.)
    its, ref_its = (o.info.get("converged_at", o.iterations) for o in (out, ref))
    assert out.code == 0 and its == ref_its <= 14, (its, ref_its)
    assert_matches_spsolve(out.x, A2, b, np.float64)


@pytest.mark.parametrize("setup", ["native", "pyamg"])
def test_update_with_products_in_row_blocks_iterates_as_a_fresh_set_up(backend, setup,
                                                                       monkeypatch):
    # The re-setup takes the Galerkin products' row blocks from the set-up (the
    # patterns are the kept aggregates'); with several blocks a product, update()
    # on D A D still gives a fresh set-up's iterations, and a pattern change is refused.
    if backend != "cpu" and setup == "pyamg":
        pytest.skip("PyAMG sets up on the host only")
    monkeypatch.setattr(hierarchy, "SPGEMM_PRODUCTS", 3000)
    A, A2 = new_values("scaled")
    b = rhs(A.shape[0])
    Ad, A2d, bd = on(backend, A, A2, b)
    M = amg(Ad, setup=setup)
    M.update(A2d)
    assert len(M.levels[0].plans["AP"][1]) > 2
    fresh = amg(A2d, setup=setup)
    out, ref = cg(A2d, bd, rtol=1e-10, M=M), cg(A2d, bd, rtol=1e-10, M=fresh)
    its, ref_its = (o.info.get("converged_at", o.iterations) for o in (out, ref))
    # (PyAMG's eigenvalue estimate starts at random: its count varies by one.)
    assert out.code == 0 and abs(its - ref_its) <= (0 if setup == "native" else 1), (its, ref_its)
    assert_matches_spsolve(out.x, A2, b, np.float64)
    with pytest.raises(ValueError, match="pattern"):
        M.update(on(backend, poisson2d(20)))


@pytest.mark.parametrize("setup", ["native", "pyamg"])
def test_update_keeps_the_aggregates_until_new_values_split_one(backend, setup):
    if backend != "cpu" and setup == "pyamg":
        pytest.skip("PyAMG sets up on the host only")
    A, A2 = new_values("scaled")
    _, A3 = new_values("jump")
    Ad, A2d, A3d = on(backend, A, A2, A3)
    M = amg(Ad, setup=setup)
    sizes = [lev.A.shape for lev in M.levels]
    kept = [lev.agg for lev in M.levels[:-1]]
    assert all(agg is not None for agg in kept)
    M.update(A2d)  # D A D: the strength graph as it was, a numeric re-setup
    assert all(lev.agg is agg for lev, agg in zip(M.levels, kept, strict=False))
    assert [lev.A.shape for lev in M.levels] == sizes
    M.update(A3d)  # couplings inside aggregates weakened: the set-up is redone
    fresh = amg(A3d, setup=setup)
    assert len(M.levels) == len(fresh.levels)
    for lev, ref in zip(M.levels[:-1], fresh.levels, strict=False):
        np.testing.assert_array_equal(host(lev.agg), host(ref.agg))
    kept = [lev.agg for lev in M.levels[:-1]]
    M.update(A2d)  # no coupling weakened now (those across the jump strengthen): kept
    assert all(lev.agg is agg for lev, agg in zip(M.levels, kept, strict=False))


def same_pattern_forms(A):
    """``A`` stored three other ways, one pattern: unsorted rows, a split entry, int64 indices."""
    rev = A.copy()
    for r in range(A.shape[0]):  # each row's entries in reverse column order
        lo, hi = A.indptr[r], A.indptr[r + 1]
        rev.indices[lo:hi], rev.data[lo:hi] = A.indices[lo:hi][::-1], A.data[lo:hi][::-1]
    rev = sp.csr_matrix((rev.data, rev.indices, rev.indptr), shape=A.shape)
    assert not rev.has_sorted_indices
    # A[0, 0] stored as two halves: one stored entry more, the same pattern once summed.
    data = np.concatenate([[A.data[0] / 2, A.data[0] / 2], A.data[1:]])
    indices = np.concatenate([[A.indices[0]], A.indices])
    indptr = A.indptr + 1
    indptr[0] = 0
    dup = sp.csr_matrix((data, indices, indptr), shape=A.shape)
    wide = sp.csr_matrix((A.data.copy(), A.indices.astype(np.int64), A.indptr.astype(np.int64)),
                         shape=A.shape)
    return {"unsorted": rev, "duplicate": dup, "int64": wide}


def cg_iterations(A, b, M):
    out = cg(A, b, rtol=1e-10, M=M)
    assert out.code == 0, out.code
    return out, out.info.get("converged_at", out.iterations)


@pytest.mark.parametrize("setup", ["native", "pyamg"])
def test_update_refuses_a_matrix_of_as_many_entries_in_other_places(backend, setup):
    # P A P^T has A's shape and stored-entry count but not its pattern: its values
    # on the kept pattern would be another matrix (wrong Galerkin products, silently).
    if backend != "cpu" and setup == "pyamg":
        pytest.skip("PyAMG sets up on the host only")
    A, A2 = new_values("scaled")
    perm = np.random.default_rng(5).permutation(A.shape[0])
    P = A2[perm][:, perm].tocsr()
    assert P.nnz == A.nnz and P.shape == A.shape
    b = rhs(A.shape[0])
    Ad, Pd, bd = on(backend, A, P, b)
    M = amg(Ad, setup=setup)
    with pytest.raises(ValueError, match=r"update\(A2\).*pattern.*amg\(A2\)"):
        M.update(Pd)
    np.testing.assert_array_equal(host(M.levels[0].A.data), A.data)  # nothing changed
    out, its = cg_iterations(Ad, bd, M)
    _, ref_its = cg_iterations(Ad, bd, amg(Ad, setup=setup))
    assert abs(its - ref_its) <= 2, (its, ref_its)
    assert_matches_spsolve(out.x, A, b, np.float64)


@pytest.mark.parametrize("form", ["unsorted", "duplicate", "int64"])
@pytest.mark.parametrize("setup", ["native", "pyamg"])
def test_update_takes_the_same_pattern_stored_another_way(backend, setup, form):
    if backend != "cpu" and setup == "pyamg":
        pytest.skip("PyAMG sets up on the host only")
    A, A2 = new_values("scaled")
    b = rhs(A.shape[0])
    Ad, A2d, Fd, bd = on(backend, A, A2, same_pattern_forms(A2)[form], b)
    M = amg(Ad, setup=setup)
    M.update(Fd)
    np.testing.assert_allclose(host(M.levels[0].A.data), A2.data, rtol=1e-15)
    out, its = cg_iterations(A2d, bd, M)
    _, ref_its = cg_iterations(A2d, bd, amg(A2d, setup=setup))
    assert abs(its - ref_its) <= 2, (its, ref_its)
    assert_matches_spsolve(out.x, A2, b, np.float64)


def test_pyamg_update_with_unknowns_outside_every_aggregate():
    # PyAMG leaves unknowns without couplings out of its aggregates; the
    # re-setup refits T with zero rows there, as PyAMG's set-up has them.
    A = sp.block_diag([poisson2d(24), sp.identity(6)]).tocsr()
    A2 = symmetrically_scaled(A, 10.0 ** np.random.default_rng(2).uniform(0, 2, A.shape[0]))
    M = amg(A, setup="pyamg", max_coarse=20)
    assert (M.levels[0].agg < 0).sum() == 6
    M.update(A2)
    b = rhs(A.shape[0])
    out, ref = cg(A2, b, rtol=1e-8, M=M), cg(A2, b, rtol=1e-8, M=amg(A2, setup="pyamg", max_coarse=20))
    assert out.code == 0 and abs(out.iterations - ref.iterations) <= 2, (out.iterations,
                                                                          ref.iterations)
    assert_matches_spsolve(out.x, A2, b, np.float64)


def test_solver_update_leaves_a_preconditioner_object_to_its_owner(backend):
    # An AMGPreconditioner passed as M= is the caller's (it may serve other
    # solvers on the old matrix): Solver.update leaves it, and its own
    # update() refreshes it for every solver that holds it.
    A, A2 = new_values("scaled")
    b = rhs(A.shape[0])
    Ad, A2d, bd = on(backend, A, A2, b)
    M = amg(Ad)
    with ms.Solver(Ad, method="cg", M=M, rtol=1e-10) as solver:
        with pytest.warns(RuntimeWarning, match=r"M is the caller's AMGPreconditioner.*M\.update"):
            solver.update(A2d)
        np.testing.assert_array_equal(host(M.levels[0].A.data), A.data)
        M.update(A2d)
        out = solver.solve(bd)
    assert out.status == ms.Status.CONVERGED and out.iterations <= 14, out.iterations
    assert_matches_spsolve(out.x, A2, b, np.float64)


@pytest.mark.parametrize("setup", ["native", "pyamg"])
def test_float32_hierarchy_inside_float64_cg(backend, setup):
    if backend != "cpu" and setup == "pyamg":
        pytest.skip("PyAMG sets up on the host only")
    A = poisson2d(127)
    b = rhs(A.shape[0])
    Ad, bd = on(backend, A, b)
    full = cg(Ad, bd, rtol=1e-10, M=amg(Ad, setup=setup))
    M32 = amg(Ad, setup=setup, dtype="float32")
    half = cg(Ad, bd, rtol=1e-10, M=M32)
    assert half.code == 0 and host(half.x).dtype == np.float64
    assert half.iterations <= 1.1 * full.iterations + 1
    assert np.linalg.norm(b - A @ host(half.x)) <= 1.0001e-10 * np.linalg.norm(b)
    assert M32._cycle.x[0].dtype == np.float32  # noqa: SLF001 - the cycle runs in float32


def test_gmres_with_amg_on_a_non_symmetric_problem(backend):
    A = convection_diffusion(63)
    b = rhs(A.shape[0])
    Ad, bd = on(backend, A, b)
    plain = gmres(Ad, bd, rtol=1e-8, maxiter=5000)
    out = gmres(Ad, bd, rtol=1e-8, M=amg(Ad, setup="native"))
    assert out.code == 0 and out.iterations * 4 < plain.iterations
    assert np.linalg.norm(b - A @ host(out.x)) <= 1.0001e-8 * np.linalg.norm(b)


def test_reports_and_memory():
    A = poisson2d(127)
    M = amg(A, setup="native")
    assert isinstance(M, AMGPreconditioner) and "levels" in repr(M)
    fine = A.data.nbytes + A.indices.nbytes + A.indptr.nbytes
    assert 0 < M.nbytes < 3 * fine  # the 264 x 264 coarse inverse is half of A here
    M32 = amg(A, setup="native", dtype=np.float32)
    assert M32.nbytes < 0.85 * M.nbytes  # the coarse levels are kept in float32 only


@pytest.mark.parametrize("problem", ["poisson2d", "poisson3d"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_memory_estimate_matches_the_hierarchy(problem, dtype):
    # nbytes counts every array held beyond A; the planning estimate models
    # the same layout (coarse A, P, int32 aggregates, four vectors and the
    # scaling a level) from n and nnz alone.
    A = poisson2d(255) if problem == "poisson2d" else poisson3d(40)
    M = amg(A, setup="native", dtype=dtype)
    est = hierarchy_bytes_estimate(A.shape[0], A.nnz,
                                   cycle_itemsize=np.dtype(dtype).itemsize)
    assert est == pytest.approx(M.nbytes, rel=0.1)
    held = sum(a.nbytes for lev in M.levels[1:] for a in lev.arrays())
    assert held < M.nbytes  # the cycle's vectors and scaling come on top


def test_default_set_up_is_pyamg_on_the_cpu():
    assert amg(poisson2d(20)).setup == "pyamg"
    assert amg(poisson2d(20), cycle="pyamg")(np.ones(400)).shape == (400,)


def test_errors_name_the_argument():
    A = poisson2d(10)
    with pytest.raises(TypeError, match="sparse"):
        amg(A.toarray())
    with pytest.raises(ValueError, match="setup"):
        amg(A, setup="gpu")
    with pytest.raises(ValueError, match="smoother"):
        amg(A, smoother="sor")
    with pytest.raises(ValueError, match="nullspace"):
        amg(A, nullspace=np.ones((3, 1)))
    with pytest.raises(ValueError, match="setup='pyamg'"):
        amg(A, setup="native", cycle="pyamg")
    with pytest.raises(ValueError, match="square"):
        amg(sp.random(4, 5, density=0.5, format="csr"))


def test_pyamg_update_with_a_multi_vector_near_null_space():
    """PyAMG aggregates nodes of ``blocksize`` unknowns on the coarse levels of a rigid-body
    near-null space; the re-setup fitted T per unknown and broke on the third level."""
    pyamg = pytest.importorskip("pyamg")
    A, B = pyamg.gallery.linear_elasticity((40, 40))
    A = A.tocsr()
    M = amg(A, nullspace=B, setup="pyamg", max_coarse=50)
    assert len(M.levels) >= 3 and M.levels[1].blocksize == 3
    A2 = (2.0 * A).tocsr()
    M.update(A2.data)
    b = rhs(A.shape[0])
    out = cg(A2, b, rtol=1e-8, M=M)
    ref = cg(A2, b, rtol=1e-8, M=amg(A2, nullspace=B, setup="pyamg", max_coarse=50))
    assert out.code == 0 and abs(out.iterations - ref.iterations) <= 2
    assert_matches_spsolve(out.x, A2, b, np.float64)
