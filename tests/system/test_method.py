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
from tests._problems import convection_diffusion, poisson2d  # noqa: E402


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
