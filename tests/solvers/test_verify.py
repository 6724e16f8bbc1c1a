"""The verify-and-fall-back rule: its batch form agrees with the rule system by system."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem, Status, solve
from managed_solve.solvers.engine import BREAKDOWN, CONVERGED, MAXITER, Outcome
from managed_solve.solvers.verify import (
    ACCEPT,
    STATUS,
    accepted,
    fallback_for,
    no_worse_than_the_start,
    status_of,
    verdict,
)
from tests._problems import host, laplacian1d, neumann2d, poisson2d


@pytest.mark.filterwarnings("error")
def test_accepted_is_verdicts_accept_by_the_true_residual_whatever_the_code():
    A = laplacian1d(4)
    tolerances = [(1e-8, 0.0), (0.0, 1e-3), (1e-6, 1e-3), (0.5, 0.0)]
    systems = [LinearSystem(A, np.ones(4), rtol=rtol, atol=atol) for rtol, atol in tolerances]
    values = [0.0, 1e-12, 1e-7, 1e-3, 1.0, np.inf, np.nan]
    cases = list(itertools.product(range(len(systems)), (CONVERGED, MAXITER, BREAKDOWN),
                                   values, values))
    picked = [systems[k] for k, *_rest in cases]
    codes = np.array([c[1] for c in cases])
    residuals = np.array([c[2] for c in cases])
    b_norms = np.array([c[3] for c in cases])
    got = accepted(picked, codes, residuals, b_norms).tolist()
    # verdict's first rule: the true residual within the tolerance, whatever the code
    want = [verdict(s, "cg", CONVERGED, r, bn) == ACCEPT
            for s, (_k, code, r, bn) in zip(picked, cases, strict=True)]
    assert got == want
    assert any(got) and not all(got)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_b_whose_norm_overflows_is_never_reported_converged(device):
    """Finite entries, ||b|| past float64's range: every bound reads inf <= inf, which proves nothing."""
    import scipy.sparse as sp

    import managed_solve as ms

    n = 100
    A = sp.diags(np.full(n, 10.0)).tocsr()
    b = np.full(n, 1e308)  # ||b|| = 1e309; the answer, 1e307, is a float64
    dm = _manager(device)
    for method in ("auto", "cg", "bicgstab", "gmres", "minres"):
        r = ms.solve(A, b, method=method, device=device, manager=dm)
        # The verify rule's message, or the engine's own where it stopped on the
        # non-finite norm itself (GMRES on a GPU).
        assert r.status is ms.Status.BREAKDOWN, (method, r)
        assert "overflows float64" in r.message or "GMRES overflowed" in r.message, r.message
    direct = ms.solve(A, b, method="direct", device=device, manager=dm)
    if device == "cuda:0" and direct.status is ms.Status.BREAKDOWN:
        assert direct.x is None  # cuSOLVER's QR overflows on its own: no answer, honestly
    else:
        assert direct.status is ms.Status.CONVERGED  # SuperLU's x is exact
        np.testing.assert_allclose(host(direct.x), 1e307, rtol=1e-14)
    many = ms.solve_many([(A, b), (A, b / 1e10)], manager=dm)
    assert many[0].status is ms.Status.BREAKDOWN and "overflows float64" in many[0].message
    assert many[1].status is ms.Status.CONVERGED
    np.testing.assert_allclose(host(many[1].x), 1e297, rtol=1e-8)


def _float32_system(n: int, seed: int):
    """A well-conditioned nonsymmetric float32 system (diagonally dominant) and its right-hand side."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    R = sp.random(n, n, density=0.3, random_state=rng)
    A = (R + sp.diags(np.asarray(abs(R).sum(axis=1)).ravel() + 1.0)).tocsr().astype(np.float32)
    return A, rng.standard_normal(n).astype(np.float32)


def _residual64(A, b, x):
    return float(np.linalg.norm(b.astype(np.float64) - A.astype(np.float64) @ host(x).astype(np.float64)))


def _manager(device: str):
    import managed_solve as ms

    if device.startswith("sim"):
        return ms.DeviceManager([device], simulate="1x1GiB")
    return ms.DeviceManager([device])


@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_float32_answer_is_judged_by_its_float64_residual(device):
    """Products of float32 values are exact in float64: the residual the tolerance is about.

    In float32 the residual of a good answer rounds to about 1e-7 ||b|| (or to
    0), so rtol=1e-12 passed; measured in float64 it does not, and a
    tolerance float32 can meet still does.
    """
    import managed_solve as ms

    A, b = _float32_system(7, 12)
    dm = _manager(device)
    bn = float(np.linalg.norm(b.astype(np.float64)))
    for method in ("bicgstab", "gmres", "direct"):
        hard = ms.solve(A, b, method=method, rtol=1e-12, device=device, manager=dm)
        true = _residual64(A, b, hard.x)
        assert true > 1e-12 * bn and hard.status is ms.Status.MAXITER, (method, hard)
        assert hard.residual_norm == pytest.approx(true, rel=1e-6)
        easy = ms.solve(A, b, method=method, rtol=1e-5, device=device, manager=dm)
        assert easy.status is ms.Status.CONVERGED, (method, easy)
        assert _residual64(A, b, easy.x) <= 1e-5 * bn
    # Transposed, the matrix is A^T (a CSC view of the CSR): widened by column blocks.
    with ms.Solver(A, method="gmres", rtol=1e-12, device=device, manager=dm) as solver:
        back = solver.solve_transpose(b)
    true = _residual64(A.T.tocsr(), b, back.x)
    assert back.status is ms.Status.MAXITER and back.residual_norm == pytest.approx(true, rel=1e-6)
    systems = [ms.LinearSystem(*_float32_system(7 + k, k), rtol=1e-12, method=m)
               for k, m in enumerate(("bicgstab", "gmres", "direct", "cg"))]
    for s, r in zip(systems, ms.solve_many(systems, manager=dm), strict=True):
        true = _residual64(s.A, s.b, r.x)
        assert r.status is ms.Status.MAXITER and true > 1e-12 * np.linalg.norm(s.b), (s.method, r)
        assert r.residual_norm == pytest.approx(true, rel=1e-6)


def test_a_float32_block_is_judged_column_by_column_in_float64():
    import managed_solve as ms

    A, _ = _float32_system(9, 4)
    B = np.random.default_rng(4).standard_normal((9, 3)).astype(np.float32)
    with ms.Solver(A, method="direct", rtol=1e-12, device="cpu") as solver:
        r = solver.solve(B)
    for j in range(3):
        assert r.column_status[j] is ms.Status.MAXITER
    with ms.Solver(A, method="direct", rtol=1e-5, device="cpu") as solver:
        r = solver.solve(B)
    assert all(s is ms.Status.CONVERGED for s in r.column_status)
    for j in range(3):
        assert _residual64(A, B[:, j], np.asarray(r.x)[:, j]) <= 1e-5 * np.linalg.norm(B[:, j])


@pytest.mark.parametrize("device", ["cpu", "sim:0", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_a_restart_after_drift_from_a_hopeless_start_begins_at_zero(device):
    # CG from x0 = 1e150 (the products stay finite): its recurrence meets the
    # tolerance while x keeps rounding of about 1e134, and restarts from that x
    # drifted again: MAXITER, "float64 may not resolve rtol=1e-08". A drifted x
    # whose residual exceeds ||b|| by more than rounding resolves is no start.
    import managed_solve as ms

    A = poisson2d(8)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    r = ms.solve(A, b, method="cg", x0=np.full(b.size, 1e150), device=device, manager=_manager(device))
    assert r.status is ms.Status.CONVERGED, r.message
    x = host(r.x)
    assert np.linalg.norm(b - A @ x) <= 1e-8 * np.linalg.norm(b)
    assert r.info["dropped_start"] > 1e30 and "was dropped" in r.message


def test_an_overflowed_iterate_hands_back_the_start():
    # A NaN end residual compared false against everything, so the NaN iterate was kept.
    A = laplacian1d(5)
    b, x0 = np.ones(5), np.full(5, 2.0)
    out = no_worse_than_the_start(A, b, x0, Outcome(np.full(5, np.nan), BREAKDOWN, 1, np.nan), 1e-8)
    np.testing.assert_array_equal(out.x, x0)
    assert out.x is not x0 and "initial guess" in out.info["returned"]


def test_the_start_is_judged_by_the_callers_norm_of_b_and_from_zero_without_x0():
    # From x = 0 the start's residual is ||b||: the caller's reading is used as it is
    # (it read ||b|| already, a GPU synchronisation each), and the start handed back is 0.
    A = laplacian1d(5)
    b = np.ones(5)
    worse = np.full(5, 100.0)  # a residual far above the start's
    end = float(np.linalg.norm(b - A @ worse))
    assert end > np.linalg.norm(b)

    def failed():
        return Outcome(worse.copy(), MAXITER, 3, end)

    kept = no_worse_than_the_start(A, b, None, failed(), 1e-8, b_norm=2 * end)
    np.testing.assert_array_equal(kept.x, worse)
    assert "returned" not in kept.info and kept.checked_residual(kept.x) == pytest.approx(end)
    back = no_worse_than_the_start(A, b, None, failed(), 1e-8)  # ||b|| read here
    np.testing.assert_array_equal(back.x, np.zeros(5))
    assert back.checked_residual(back.x) == pytest.approx(np.linalg.norm(b))


@pytest.mark.parametrize("code", [BREAKDOWN, MAXITER])
def test_a_true_residual_within_the_tolerance_is_converged_whatever_the_method_said(code):
    s = LinearSystem(sp.identity(4, format="csr"), np.ones(4), rtol=1e-8)
    out = Outcome(np.ones(4), code, 7, 1e-3, "cg: p.Ap <= 0: A is not positive definite")
    status, message = status_of(out, "cg", 1e-9, 2e-8, s)
    assert status is Status.CONVERGED and "by the true residual" in message
    assert "not positive definite" in message  # what the method said is kept
    status, _ = status_of(out, "cg", 1e-7, 2e-8, s)
    assert status is STATUS[code]
    status, _ = status_of(Outcome(None, code, 7, float("nan"), "no x"), "cg", float("nan"), 2e-8, s)
    assert status is STATUS[code]


def test_cg_that_breaks_down_after_meeting_the_tolerance_is_converged():
    """A symmetric indefinite A (one negative diagonal entry) under AMG-preconditioned CG: the
    curvature test fails one step after the iterate met the tolerance."""
    A = poisson2d(30).tolil()
    A[7, 7] = -4.0
    A = A.tocsr()
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    res = solve(A, b, method="cg", M="amg", device="cpu")
    assert np.linalg.norm(b - A @ res.x) <= 1e-8 * np.linalg.norm(b)
    assert res.status is Status.CONVERGED, res.message


def test_a_float64_true_residual_short_of_its_tolerance_does_not_advise_float64():
    s = LinearSystem(sp.identity(4, format="csr"), np.ones(4), rtol=1e-15)
    out = Outcome(np.ones(4), CONVERGED, 4, 1e-16)
    _, message = status_of(out, "cg", 1e-12, 1e-15, s)
    assert "dtype='float64'" not in message and "loosen rtol" in message
    s32 = LinearSystem(sp.identity(4, format="csr", dtype=np.float32), np.ones(4, np.float32),
                       rtol=1e-7)
    _, message = status_of(out, "cg", 1e-5, 1e-7, s32)
    assert "dtype='float64'" in message


def test_the_fallback_chain_goes_on_to_gmres_where_minres_cannot_take_the_preconditioner():
    """CG with AMG breaks down on an indefinite matrix with a positive diagonal; MINRES needs a
    positive definite preconditioner and breaks down too; GMRES takes any and converges."""
    L = poisson2d(30)
    H = (L - 0.5 * sp.identity(L.shape[0])).tocsr()  # diagonal 3.5 > 0, indefinite
    b = np.random.default_rng(0).standard_normal(L.shape[0])
    res = solve(H, b, M="amg", device="cpu")
    assert res.status == Status.CONVERGED and res.method == "gmres"
    assert res.info["fallback_from"] == "minres"
    assert np.linalg.norm(b - H @ res.x) <= 1e-8 * np.linalg.norm(b)
    s = LinearSystem(H, b, method="auto")
    assert fallback_for(s, "minres") == "gmres"
    assert fallback_for(s, "cg") == "minres" and fallback_for(s, "cg", False) == "bicgstab"
    assert fallback_for(s, "minres", False) == "bicgstab"


def test_a_drifted_x_worse_than_the_start_is_not_returned_and_the_message_names_nullspace():
    """GMRES with AMG on a pure Neumann matrix and a b outside its range: the preconditioned
    recurrence met the tolerance while x grew to 5e8 along the null space (||b - A x|| 5e8
    times ||b||). The start (x = 0) is handed back instead, and the message points at a
    singular A (nullspace=) or the preconditioner, not at float64's conditioning."""
    A = neumann2d(20)
    b = np.random.default_rng(0).standard_normal(400)
    res = solve(A, b, method="gmres", M="amg", device="cpu")
    assert res.status == Status.MAXITER
    assert np.linalg.norm(b - A @ res.x) <= np.linalg.norm(b)
    assert "nullspace=" in res.message
    # With the null space named the same call gives the least-squares answer.
    ls = solve(A, b, method="gmres", M="amg", device="cpu", nullspace="constant")
    assert ls.status == Status.LEAST_SQUARES
    x_ls = np.linalg.lstsq(A.toarray(), b, rcond=None)[0]
    assert np.linalg.norm(b - A @ ls.x) <= np.linalg.norm(b - A @ x_ls) * (1 + 1e-6)
