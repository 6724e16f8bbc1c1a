"""CG: generic xp implementation and the fused CSR path through solve(), against SciPy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import solve
from managed_solve.solvers.cg import cg
from tests._problems import BACKENDS, assert_matches_spsolve, assert_solves, on, poisson2d

# On CuPy the generic loop reads the residual every 8 iterations, so it may
# run up to 7 iterations past SciPy's stopping point.
GPU_SLACK = 8


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def scipy_iterations(solver, A, b, **kw):
    count = [0]

    def cb(_xk):
        count[0] += 1

    x, info = solver(A, b, callback=cb, **kw)
    return x, info, count[0]


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_generic_cg_matches_scipy(backend, dtype, rtol):
    A = poisson2d(16, dtype)
    rng = np.random.default_rng(0)
    x_true = rng.standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    x_ref, info, its_ref = scipy_iterations(sla.cg, A, b, rtol=rtol)
    assert info == 0
    Ad, bd = on(backend, A, b)
    out = cg(Ad, bd, rtol=rtol)
    assert out.code == 0
    slack = 2 if backend == "cpu" else GPU_SLACK
    assert its_ref - 2 <= out.iterations <= its_ref + slack
    assert_solves(out.x, A, b, dtype, rtol, x_true=x_true, x_ref=x_ref)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_solve_cg_csr_uses_fused_core(backend, dtype, rtol):
    A = poisson2d(20, dtype)
    b = np.ones(A.shape[0], dtype=dtype)
    _, _, its_ref = scipy_iterations(sla.cg, A, b, rtol=rtol)
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="cg", rtol=rtol)
    assert res.converged, res.message
    assert res.info["path"] == "batched"
    assert res.method == "cg"
    assert res.device == ("cpu" if backend == "cpu" else "cuda:0")
    assert abs(res.iterations - its_ref) <= (3 if backend == "cpu" else GPU_SLACK + 24)
    assert res.relative_residual <= rtol
    assert_matches_spsolve(res.x, A, b, dtype)


def test_cg_dense_and_operator_give_the_same_iterates():
    A = poisson2d(10)
    b = np.arange(A.shape[0], dtype=np.float64)
    ref = cg(A, b, rtol=1e-10)
    dense = cg(A.toarray(), b, rtol=1e-10)
    op = cg(sla.aslinearoperator(A), b, rtol=1e-10)
    assert ref.iterations == dense.iterations == op.iterations
    np.testing.assert_allclose(dense.x, ref.x, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(op.x, ref.x, rtol=1e-12, atol=1e-12)


def test_cg_callback_sees_every_iterate_and_solve_keeps_it_generic():
    A = poisson2d(12)
    b = np.ones(A.shape[0])
    seen = []
    res = solve(A, b, method="cg", callback=lambda xk: seen.append(np.linalg.norm(b - A @ xk)))
    assert res.converged
    assert res.info["path"] == "generic"  # the fused core has no per-iteration hook
    assert len(seen) == res.iterations
    assert seen[-1] == pytest.approx(res.residual_norm, rel=1e-6)


def test_cg_exact_initial_guess_takes_no_iteration():
    A = poisson2d(8)
    x_true = np.linspace(0, 1, A.shape[0])
    out = cg(A, A @ x_true, x0=x_true)
    assert out.code == 0 and out.iterations == 0


@pytest.mark.parametrize("path", ["fused", "generic"])
def test_cg_indefinite_matrix_reports_breakdown(path):
    d = np.linspace(-1.0, 1.0, 60) + 0.005
    A = (sp.diags(d) + 0.01 * (sp.eye(60, k=1) + sp.eye(60, k=-1))).tocsr()  # symmetric indefinite
    b = np.ones(60)
    cb = (lambda xk: None) if path == "generic" else None
    res = solve(A, b, method="cg", callback=cb)
    assert res.status.name == "BREAKDOWN"
    assert "minres" in res.message and "gmres" in res.message
    assert res.info["path"] == ("batched" if path == "fused" else "generic")


def test_cg_maxiter_is_a_status():
    A = poisson2d(20)
    res = solve(A, np.ones(A.shape[0]), method="cg", maxiter=5)
    assert res.status.name == "MAXITER"
    assert res.iterations == 5
    assert "maxiter" in res.message


@pytest.mark.gpu
def test_generic_cg_reads_the_host_only_at_checkpoints():
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = poisson2d(24)
    out = cg(csp.csr_matrix(A), cp.ones(A.shape[0]), rtol=1e-8)
    assert out.code == 0
    # two set-up reads plus one every GPU_SLACK iterations
    assert out.host_syncs <= 2 + -(-out.iterations // GPU_SLACK)
    assert isinstance(out.x, cp.ndarray)
