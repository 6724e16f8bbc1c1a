"""The auto policy (system/method.py): which systems the CPU factorises."""

from __future__ import annotations

from managed_solve.system import method as method_policy


def test_large_and_3d_like_systems_are_not_factorised():
    big = method_policy.DIRECT_MAX_N + 1
    assert not method_policy.wants_direct("csr", big, 5 * big)
    assert not method_policy.wants_direct("csr", 1000, 27 * 1000)  # 3D-like: too much fill


# -- M="auto": AMG for large elliptic systems
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.sparse as sp  # noqa: E402

import managed_solve as ms  # noqa: E402
from tests._problems import convection_diffusion, laplacian1d, poisson2d  # noqa: E402


def _system(A, **kw):
    return ms.LinearSystem(A, np.ones(A.shape[0]), **kw)


def test_auto_preconditioner_is_amg_for_a_large_poisson_and_none_below_the_threshold():
    big = poisson2d(450)  # 202,500 unknowns: past the CPU's sparse LU
    assert big.shape[0] >= method_policy.amg_min_n("cpu")
    s = _system(big)
    assert s.M == "auto"
    assert method_policy.choose_preconditioner(s, "cpu", "cg") == "amg"
    # On a GPU a Jacobi-CG iteration is cheap: AMG from AMG_MIN_N["cuda"] only.
    assert method_policy.choose_preconditioner(s, "cuda", "cg") is None
    assert method_policy.choose_preconditioner(s, "sim", "cg") is None
    # Not CG (an indefinite or non-symmetric matrix): no AMG.
    assert method_policy.choose_preconditioner(s, "cpu", "minres") is None
    # Small systems resolve "auto" to None when validated: nothing downstream sees "auto".
    assert _system(poisson2d(20)).M is None


def test_auto_preconditioner_keeps_an_explicit_choice_and_skips_easy_and_unsymmetric_systems():
    big = poisson2d(450)
    assert method_policy.choose_preconditioner(_system(big, M="jacobi"), "cpu", "cg") == "jacobi"
    assert method_policy.choose_preconditioner(_system(big, M=None), "cpu", "cg") is None
    # A heat step (identity plus a small multiple of the Laplacian): CG's bound is low.
    heat = (sp.identity(big.shape[0], format="csr") + 0.05 * big).tocsr()
    assert method_policy.cg_iteration_bound(heat, 1e-8) <= method_policy.CG_PREFERRED_BOUND
    assert method_policy.choose_preconditioner(_system(heat), "cpu", "cg") is None
    cd = convection_diffusion(450)
    assert method_policy.choose_preconditioner(_system(cd), "cpu", "cg") is None


def test_auto_gives_amg_in_solve_solver_and_solve_many_with_fewer_iterations(monkeypatch):
    # The threshold is lowered so that the policy's path runs at a test's size.
    monkeypatch.setitem(method_policy.AMG_MIN_N, "cpu", 3000)
    A = poisson2d(64)
    rng = np.random.default_rng(0)
    x_true = rng.standard_normal(A.shape[0])
    b = A @ x_true
    auto = ms.solve(A, b, method="cg", device="cpu")
    plain = ms.solve(A, b, method="cg", M=None, device="cpu")
    assert auto.converged and plain.converged
    assert auto.info["preconditioner"] == "amg" and plain.info["preconditioner"] is None
    assert auto.iterations <= 20 < plain.iterations
    np.testing.assert_allclose(auto.x, x_true, rtol=0, atol=1e-6 * np.abs(x_true).max())
    with ms.Solver(A, method="cg", device="cpu") as solver:
        assert solver.solve(b).info["preconditioner"] == "amg"
    # solve_many: the large system is solved on its own with AMG; a small one batches.
    small = poisson2d(8)
    out = ms.solve_many([(A, b), (small, np.ones(64))], devices=["cpu"], method="cg")
    assert [r.converged for r in out] == [True, True]
    assert out[0].info["preconditioner"] == "amg"
    assert out[0].iterations == pytest.approx(auto.iterations, abs=1)


def test_solve_many_m_auto_on_small_systems_batches_as_none():
    from managed_solve.scheduling.validate import validate_all

    A = poisson2d(8)
    items = [(A, np.ones(64)), ms.LinearSystem(A, np.ones(64), M="jacobi")]
    _, valid = validate_all(items, method="cg", M="auto", rtol=None)
    assert [valid[i].M for i in range(2)] == [None, None]  # both batch, unpreconditioned
    out = ms.solve_many(items, devices=["cpu"], method="cg", M="auto")
    assert [r.converged for r in out] == [True, True]


# -- the CPU's CG-or-LU choice by predicted time
def test_cpu_policy_weighs_cg_against_the_lu_by_predicted_time_and_right_hand_sides():
    A = poisson2d(40)
    s = _system(A)
    assert method_policy.choose_method(s, "cpu") == "cg"  # one solve: CG, predicted sooner
    assert method_policy.choose_method(s, "cpu", rhs=50) == "direct"  # one LU serves fifty
    assert method_policy.choose_method(s, "cpu", rhs=None) == "direct"  # a reused Solver
    assert method_policy.choose_method(s, "cuda", rhs=50) == "cg"  # never the LU off the CPU
    # What is not predictable stays with the LU: non-symmetric, a negative diagonal,
    # not diagonally dominant (a fourth-order operator), a long chain.
    assert method_policy.choose_method(_system(convection_diffusion(40)), "cpu") == "direct"
    assert method_policy.choose_method(_system((-A).tocsr()), "cpu") == "direct"
    biharmonic = (A @ A).tocsr()  # 13 entries a row: Krylov (past the 2D-like row test) anyway
    assert method_policy.predict_cg_iterations(biharmonic, 1e-8) == np.inf
    chain = laplacian1d(3000)
    assert method_policy.choose_method(_system(chain), "cpu") == "direct"
    # An easy system (a heat step) is CG's even for a reused Solver.
    heat = (sp.identity(A.shape[0], format="csr") + 0.05 * A).tocsr()
    assert method_policy.choose_method(_system(heat), "cpu", rhs=None) == "cg"


def variable_diffusion(m: int, contrast: float, seed: int = 2) -> sp.csr_matrix:
    """2D diffusion with a random coefficient on each grid edge (1 to ``contrast``), Dirichlet sides."""
    P = poisson2d(m).tocoo()
    upper = P.row < P.col
    w = np.random.default_rng(seed).uniform(1.0, contrast, int(upper.sum()))
    off = sp.coo_matrix((-w, (P.row[upper], P.col[upper])), shape=P.shape)
    off = (off + off.T).tocsr()
    degree = np.diff(sp.triu(P, 1).tocsr().indptr) + np.diff(sp.tril(P, -1).tocsr().indptr)
    return (off + sp.diags(-np.asarray(off.sum(axis=1)).ravel() + (4 - degree))).tocsr()


def test_predicted_cg_iterations_follow_2d_problems_within_a_factor_two():
    """SciPy's count on Poisson grids and high-contrast diffusion, within a factor 2 (CG's lead
    over the LU on such systems is 3x or more); infinite where nothing predicts it."""
    import scipy.sparse.linalg as spla

    from tests._problems import symmetrically_scaled

    for A in (poisson2d(24), poisson2d(48), variable_diffusion(32, 2.0),
              variable_diffusion(48, 100.0), variable_diffusion(48, 1000.0)):
        iterates: list = []
        spla.cg(A, np.ones(A.shape[0]), rtol=1e-8, maxiter=10_000, callback=iterates.append)
        predicted = method_policy.predict_cg_iterations(A, 1e-8)
        assert len(iterates) / 2 <= predicted <= 2 * len(iterates), (len(iterates), predicted)
    # D A D with a spread-out D is not diagonally dominant: no prediction, so the LU.
    rng = np.random.default_rng(2)
    scaled = symmetrically_scaled(poisson2d(32), rng.uniform(1, 10, 32 * 32))
    assert method_policy.predict_cg_iterations(scaled, 1e-8) == np.inf
    assert method_policy.choose_method(_system(scaled), "cpu") == "direct"


def test_solve_and_solver_pass_their_right_hand_side_counts():
    A = poisson2d(30)
    n = A.shape[0]
    assert ms.solve(A, np.ones(n), device="cpu").method == "cg"
    B = np.ones((n, 40))
    assert ms.solve(A, B, device="cpu").method == "direct"  # 40 columns: one LU
    with ms.Solver(A, device="cpu") as solver:  # reused: the LU, as before
        assert solver.method == "direct"
    with ms.Solver(A, device="cpu", rhs=1) as solver:
        assert solver.method == "cg"
