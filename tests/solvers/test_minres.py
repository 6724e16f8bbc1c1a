"""MINRES on symmetric indefinite systems, against SciPy and known solutions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import DeviceManager, Status, _backend, solve, solve_many
from managed_solve.solvers._common import checkpoint_interval
from managed_solve.solvers.engine import BREAKDOWN, LEAST_SQUARES, MAXITER
from managed_solve.solvers.minres import LS_WINDOW, minres
from tests._problems import (
    BACKENDS,
    assert_solves,
    helmholtz2d,
    host,
    laplacian1d,
    neumann2d,
    on,
    one_large_eigenvalue,
    poisson2d,
)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_minres_matches_scipy_on_indefinite(backend, dtype, rtol):
    A = helmholtz2d(14, dtype=dtype)  # symmetric, indefinite, nonsingular
    ev = np.linalg.eigvalsh(A.toarray().astype(np.float64))
    assert ev[0] < 0 < ev[-1]
    x_true = np.random.default_rng(3).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    count = [0]
    x_ref, info = sla.minres(A.astype(np.float64), b.astype(np.float64), rtol=1e-12,
                             callback=lambda _x: count.__setitem__(0, count[0] + 1))
    assert info == 0
    Ad, bd = on(backend, A, b)
    out = minres(Ad, bd, rtol=rtol)
    assert out.code == 0
    assert_solves(out.x, A, b, dtype, rtol, x_true=x_true, x_ref=x_ref, residual_factor=10)
    # Same Krylov space, minimal residual: never needs more steps than SciPy's
    # (stricter-stopping) run, and not far fewer.
    assert 0.5 * count[0] <= out.iterations <= count[0] + 1


def test_cg_breaks_down_where_minres_converges():
    A = helmholtz2d(12)
    b = np.ones(A.shape[0])
    assert solve(A, b, method="cg").status.name == "BREAKDOWN"
    res = solve(A, b, method="minres", rtol=1e-10)
    assert res.converged and res.relative_residual <= 1e-10
    np.testing.assert_allclose(res.x, sla.spsolve(A.tocsc(), b), rtol=1e-7)


def test_minres_preconditioned_dense_and_callback():
    A = helmholtz2d(10, shift=-0.5)  # SPD, so Jacobi is SPD too
    b = np.ones(A.shape[0])
    seen = []
    res = solve(A.toarray(), b, method="minres", M="jacobi", rtol=1e-10, callback=seen.append)
    assert res.converged and res.relative_residual <= 1e-10
    assert len(seen) >= res.iterations  # refinement restarts call back too
    np.testing.assert_allclose(res.x, np.linalg.solve(A.toarray(), b), rtol=1e-8)


def test_an_indefinite_preconditioner_is_a_breakdown_whenever_it_shows():
    """r.M r < 0 at the start or later in the loop: the same BREAKDOWN and message either way
    (which one happens depends on b, and the outcome must not)."""
    A = helmholtz2d(6)
    at_start = minres(A, np.ones(36), M=lambda r: -r)
    assert at_start.code == BREAKDOWN and at_start.iterations == 0
    d = np.where(np.arange(36) % 2 == 0, 1.0, -1.0)  # indefinite: r.M r of either sign
    for seed in range(8):
        out = minres(A, np.random.default_rng(seed).standard_normal(36), M=lambda r: d * r)
        assert out.code == BREAKDOWN and out.message == at_start.message
        assert "positive definite" in out.message


def test_a_badly_scaled_nonsingular_matrix_is_not_least_squares(backend):
    """cond(A) = 1e10 > 1 / rtol puts ||A r|| / (||A|| ||r||) below rtol at the second step
    while the residual still shrinks: MINRES goes on to converge, as SciPy's minres does."""
    A = one_large_eigenvalue(10)
    b = np.random.default_rng(0).standard_normal(10)
    x_ref = sla.spsolve(A.tocsc(), b)
    Ad, bd = on(backend, A, b)
    out = minres(Ad, bd, rtol=1e-8)
    assert out.code == 0, (out.code, out.message)
    x = out.x.get() if hasattr(out.x, "get") else out.x
    np.testing.assert_allclose(x, x_ref, rtol=1e-6, atol=1e-8 * np.linalg.norm(x_ref))


def test_solve_does_not_call_a_badly_scaled_matrix_singular():
    """minres on the CPU and a simulated GPU, and "auto" where it picks MINRES (a negative diagonal)."""
    dm = DeviceManager(simulate="2x1GiB")
    b = np.random.default_rng(0).standard_normal(10)
    runs = [(one_large_eigenvalue(10), "minres", "cpu"), (one_large_eigenvalue(10), "minres", "sim:0"),
            (one_large_eigenvalue(10, -1e10), "auto", "sim:0")]
    for A, method, device in runs:
        res = solve(A, b, method=method, device=device, manager=dm)
        assert res.status is Status.CONVERGED and res.method == "minres", (res.status, res.message)
        assert np.linalg.norm(b - A @ res.x) <= 1e-8 * np.linalg.norm(b)
        x_ref = sla.spsolve(A.tocsc(), b)
        np.testing.assert_allclose(res.x, x_ref, rtol=1e-6, atol=1e-8 * np.linalg.norm(x_ref))
    A = one_large_eigenvalue(10, -1e10)
    assert [r.status for r in solve_many([(A, b), (A, b)], manager=dm)] == [Status.CONVERGED] * 2



@pytest.mark.parametrize("scale", [600.0, 1.0 / 600.0])
def test_a_preconditioned_minres_stops_on_the_true_residual(scale, backend):
    """With M, the recurrence tracks sqrt(r.M r): Jacobi on a diagonal of 2400 reads ||r|| / 49.
    Stopping on that left the true residual short of a tolerance float64 meets easily (and the
    verify rule's restarts stopped as early). The true residual now decides."""
    A = (scale * poisson2d(12)).tocsr()
    b = np.random.default_rng(1).standard_normal(A.shape[0])
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="minres", M="jacobi", rtol=1e-6)
    assert res.status is Status.CONVERGED, res.message
    true = np.linalg.norm(b - A @ host(res.x))
    assert true <= 1e-6 * np.linalg.norm(b)
    assert res.residual_norm == pytest.approx(true, rel=1e-8)
    plain = solve(Ad, bd, method="minres", rtol=1e-6)
    assert res.iterations <= 2 * plain.iterations  # the same work as without M, give or take


@pytest.mark.parametrize("n", [1, 50])
def test_a_zero_matrix_is_least_squares_not_a_false_convergence(n, backend):
    """A = 0: Lanczos stops at once on a singular projection; the residual estimate read 0 and
    the true residual ||b|| made it MAXITER ("the recurrence met the tolerance")."""
    A = sp.csr_matrix((n, n))
    b = np.ones(n)
    Ad, bd = on(backend, A, b)
    out = minres(Ad, bd)
    assert out.code == LEAST_SQUARES and float(np.abs(host(out.x)).max()) == 0.0
    res = solve(Ad, bd)
    assert res.status is Status.LEAST_SQUARES and res.method == "minres", res.message


def _inconsistent(A, seed=0):
    """A right-hand side with a part along the constants, the null space of a Neumann Laplacian."""
    return np.random.default_rng(seed).standard_normal(A.shape[0]) + 0.3


def _normal_ratio(A, b, x, norm_A=None):
    """||A r|| / (||A||_2 ||r||) of the true residual: the least-squares test, measured densely."""
    r = b - A @ x
    norm_A = np.linalg.norm(A.toarray(), 2) if norm_A is None else norm_A
    return np.linalg.norm(A @ r) / (norm_A * np.linalg.norm(r))


def _scipy_iterations(A, b, rtol):
    """SciPy's MINRES steps until its iterate meets the least-squares test on the true residual."""
    norm_A, ratios = np.linalg.norm(A.toarray(), 2), []

    class Met(Exception):
        pass

    def check(x):
        ratios.append(_normal_ratio(A, b, x, norm_A))
        if ratios[-1] <= rtol:
            raise Met

    with pytest.raises(Met):
        sla.minres(A, b, rtol=1e-15, maxiter=2 * A.shape[0], callback=check)
    return len(ratios)


@pytest.mark.parametrize("every", [None, 8])  # 8: the checkpoint interval of a GPU
@pytest.mark.parametrize("A", [laplacian1d(50, neumann=True), neumann2d(20)],
                         ids=["neumann1d", "neumann2d"])
def test_least_squares_stops_soon_after_the_normal_equations_hold(A, every, backend):
    """A Neumann Laplacian and a b with a part along the constants: least squares. The watch
    waited until the iteration count had doubled (100 steps where 49 meet the test) and handed
    back the iterate of a step after the one the test spoke of: on the 1D problem, once Lanczos
    had exhausted the range, that step had sent x along the null space (||A r|| / (||A|| ||r||)
    1e-2; 0.8 and ||r|| 224 times the least-squares one with a checkpoint every 8 steps)."""
    rtol = 1e-8
    b = _inconsistent(A)
    x_ls = np.linalg.lstsq(A.toarray(), b, rcond=None)[0]
    best = np.linalg.norm(b - A @ x_ls)
    Ad, bd = on(backend, A, b)
    out = minres(Ad, bd, rtol=rtol, check_every=every)
    assert out.code == LEAST_SQUARES, (out.code, out.message)
    x = host(out.x)
    assert _normal_ratio(A, b, x) <= rtol
    assert np.linalg.norm(b - A @ x) <= best * (1 + 1e-10)
    needed = _scipy_iterations(A, b, rtol)
    step = checkpoint_interval(np if backend == "cpu" else _backend.cupy(), every)
    assert out.info["least_squares_at"] <= needed + step
    # A watch of LS_WINDOW steps, and one more in a recurrence started again from the candidate.
    assert out.iterations <= needed + 2 * LS_WINDOW + 2 * step


def test_least_squares_does_not_depend_on_the_scale_of_b():
    """The estimate of ||A|| took in ||b||^2 (the first Lanczos step's beta_1): with b scaled by
    1e8 it read ||A|| as 1e8, the test met at once, and x came back 44 steps in, 3% short of the
    least-squares residual."""
    A = laplacian1d(40, neumann=True)
    b = _inconsistent(A)
    x_ls = np.linalg.lstsq(A.toarray(), b, rcond=None)[0]
    outs = [minres(A, scale * b, rtol=1e-8) for scale in (1.0, 1e8)]
    for scale, out in zip((1.0, 1e8), outs, strict=True):
        assert out.code == LEAST_SQUARES
        r = scale * b - A @ out.x
        assert np.linalg.norm(r) <= scale * np.linalg.norm(b - A @ x_ls) * (1 + 1e-10)
    assert outs[0].iterations == outs[1].iterations


def test_least_squares_past_what_rounding_allows_stops_at_its_best_x():
    """rtol = 1e-12 on a 2D Neumann problem: rounding keeps ||A r|| / (||A|| ||r||) above
    about 5e-9, and past that low x grows along the null space. The solve ran to maxiter (4000
    steps) and handed back x after that growth (the ratio 0.7, ||r|| 1e16 times the
    least-squares one); it now stops at the low and says how far the test got."""
    A = neumann2d(20)
    b = _inconsistent(A)
    best = np.linalg.norm(b - A @ np.linalg.lstsq(A.toarray(), b, rcond=None)[0])
    out = minres(A, b, rtol=1e-12)
    assert out.code == LEAST_SQUARES, (out.code, out.message)
    assert _normal_ratio(A, b, out.x) <= 1e-7
    assert np.linalg.norm(b - A @ out.x) <= best * (1 + 1e-10)
    assert out.info["least_squares_ratio"] > 1e-12 and "Rounding held" in out.message
    assert out.iterations <= _scipy_iterations(A, b, 1e-8) + 4 * LS_WINDOW


@pytest.mark.parametrize("value", [1e6, 1e10])
def test_a_badly_scaled_block_is_solved_not_called_singular(value):
    """One large eigenvalue beside a 1D Laplacian, nonsingular: ||A r|| / (||A|| ||r||) falls
    below rtol while the residual is large, and the recurrence stalls at its own rounding. A
    watch must not call that least squares: a recurrence started again from the candidate goes
    on, as the solve's restarts do."""
    A = sp.block_diag([sp.csr_matrix([[value]]), laplacian1d(200)]).tocsr()
    b = np.random.default_rng(1).standard_normal(A.shape[0])
    res = solve(A, b, method="minres", rtol=1e-8, device="cpu")
    assert res.status is Status.CONVERGED, res.message
    assert np.linalg.norm(b - A @ res.x) <= 1e-8 * np.linalg.norm(b)
    np.testing.assert_allclose(res.x, sla.spsolve(A.tocsc(), b), rtol=1e-5)


def test_a_hopeless_start_stops_at_once_and_solve_starts_from_zero():
    """x0 = 1e150 on a nonsingular A: the residual carries rounding of 1e134, far above the
    tolerance, and no iterate from there gets closer. MINRES ran 22 steps and called b outside
    A's range (LEAST_SQUARES); it now stops before the first, naming x0, and solve() goes on
    from x = 0."""
    A = poisson2d(8)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    x0 = np.full(A.shape[0], 1e150)
    out = minres(A, b, x0=x0)
    assert out.code == MAXITER and out.iterations == 0 and "x0=None" in out.message
    res = solve(A, b, x0=x0, method="minres", M="jacobi", device="cpu")
    plain = solve(A, b, method="minres", M="jacobi", device="cpu")
    assert res.status is Status.CONVERGED and res.iterations == plain.iterations
    np.testing.assert_allclose(res.x, plain.x, rtol=1e-12)

