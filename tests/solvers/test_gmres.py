"""Restarted GMRES against SciPy's (same inner iteration counts) and known solutions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import solve
from managed_solve.solvers.gmres import gmres
from tests._problems import BACKENDS, assert_solves, on
from tests._problems import convection_diffusion as _convection_diffusion

GPU_SLACK = 8


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def convection_diffusion(m, dtype=np.float64):
    """The shared convection-diffusion problem with a stronger wind (0.8)."""
    return _convection_diffusion(m, dtype, wind=0.8)


def scipy_inner_iterations(A, b, **kw):
    count = [0]
    x, info = sla.gmres(A, b, callback=lambda _r: count.__setitem__(0, count[0] + 1),
                        callback_type="pr_norm", **kw)
    return x, info, count[0]


@pytest.mark.parametrize("restart", [30, 7])
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_gmres_matches_scipy(backend, dtype, rtol, restart):
    A = convection_diffusion(14, dtype)
    x_true = np.random.default_rng(2).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    x_ref, info, its_ref = scipy_inner_iterations(A, b, rtol=rtol, restart=restart, maxiter=1000)
    assert info == 0
    Ad, bd = on(backend, A, b)
    out = gmres(Ad, bd, rtol=rtol, restart=restart)
    assert out.code == 0
    # Same algorithm (right residual estimate, same restarts): same count;
    # float32 rounding may move the crossing by an iteration or two.
    slack = 0 if dtype == np.float64 else 2
    assert abs(out.iterations - its_ref) <= slack
    assert_solves(out.x, A, b, dtype, rtol, x_true=x_true, x_ref=x_ref)


def test_gmres_through_solve_with_preconditioner_and_operator():
    A = convection_diffusion(16)
    b = np.ones(A.shape[0])
    plain = solve(A, b, method="gmres", rtol=1e-10)
    pre = solve(A, b, method="gmres", M="jacobi", rtol=1e-10)
    op = solve(sla.aslinearoperator(A), b, method="gmres", rtol=1e-10)
    for r in (plain, pre, op):
        assert r.converged, r.message
        assert r.relative_residual <= 1e-10
    assert op.iterations == plain.iterations
    x_direct = sla.spsolve(A.tocsc(), b)
    np.testing.assert_allclose(pre.x, x_direct, rtol=1e-7)


def test_gmres_callback_once_per_restart_cycle():
    A = convection_diffusion(12)
    b = np.ones(A.shape[0])
    xs = []
    out = gmres(A, b, rtol=1e-10, restart=5, callback=xs.append)
    assert out.code == 0
    assert len(xs) == -(-out.iterations // 5)
    np.testing.assert_array_equal(xs[-1], out.x)


def test_gmres_maxiter_counts_inner_iterations():
    A = convection_diffusion(20)
    res = solve(A, np.ones(A.shape[0]), method="gmres", maxiter=12)
    assert res.status.name == "MAXITER"
    assert res.iterations == 12


def test_gmres_bad_restart():
    with pytest.raises(ValueError, match="restart"):
        gmres(convection_diffusion(4), np.ones(16), restart=0)


@pytest.mark.gpu
def test_gmres_gpu_reads_host_at_checkpoints():
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = convection_diffusion(20)
    out = gmres(csp.csr_matrix(A), cp.ones(A.shape[0]), rtol=1e-8, restart=30)
    assert out.code == 0 and isinstance(out.x, cp.ndarray)
    cycles = -(-out.iterations // 30)
    assert out.host_syncs <= 1 + cycles * (1 + -(-30 // GPU_SLACK))


def _prepared(A, M):
    from managed_solve.solvers.engine import Options
    from managed_solve.solvers.krylov import KrylovEngine

    return KrylovEngine().prepare(A, Options("gmres", M=M, rtol=1e-10), None,
                                  kind="csr" if hasattr(A, "indptr") else "dense")


@pytest.mark.parametrize("dense", [False, True])
def test_an_update_the_preconditioner_refuses_leaves_the_engine_as_it_was(dense):
    A = convection_diffusion(8)
    Z = A.copy()
    Z.setdiag(0.0)  # the same pattern, a diagonal Jacobi cannot scale by
    A, Z = (A.toarray(), Z.toarray()) if dense else (A, Z.tocsr())
    b = np.linspace(1.0, 2.0, A.shape[0])
    with _prepared(A, "jacobi") as engine:
        with pytest.raises(ValueError, match="zero diagonal"):
            engine.update(Z if dense else Z.data)
        out = engine.solve(b)
    np.testing.assert_allclose(out.x, sla.spsolve(sp.csc_matrix(A), b), rtol=1e-7)


def test_a_dense_engine_takes_new_values_of_its_shape():
    A = convection_diffusion(6).toarray()
    b = np.linspace(1.0, 2.0, A.shape[0])
    with _prepared(A, None) as engine:
        engine.update(3.0 * A)
        out = engine.solve(b)
        back = engine.solve_transpose(b)
        with pytest.raises(TypeError, match="complex"):
            engine.update(A * (1 + 1j))
    np.testing.assert_allclose(out.x, sla.spsolve(sp.csc_matrix(3.0 * A), b), rtol=1e-7)
    np.testing.assert_allclose(back.x, sla.spsolve(sp.csc_matrix(3.0 * A.T), b), rtol=1e-7)
