"""BiCGStab: generic xp implementation and the fused CSR path, against SciPy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import solve
from managed_solve.solvers.bicgstab import bicgstab
from tests._problems import (
    BACKENDS,
    assert_matches_spsolve,
    assert_solves,
    convection_diffusion,
    on,
)

GPU_SLACK = 8  # the CuPy loop reads the residual every 8 iterations


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_generic_bicgstab_matches_scipy(backend, dtype, rtol):
    A = convection_diffusion(16, dtype)
    assert abs(A - A.T).max() > 0.1
    x_true = np.random.default_rng(1).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    count = [0]
    x_ref, info = sla.bicgstab(A, b, rtol=rtol, callback=lambda _x: count.__setitem__(0, count[0] + 1))
    assert info == 0
    Ad, bd = on(backend, A, b)
    out = bicgstab(Ad, bd, rtol=rtol)
    assert out.code == 0
    # SciPy does not call back on its half-step exit, hence one more here at most.
    hi = count[0] + (1 if backend == "cpu" else GPU_SLACK + 1)
    assert count[0] - 2 <= out.iterations <= hi
    assert_solves(out.x, A, b, dtype, rtol, x_true=x_true, x_ref=x_ref)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-8), (np.float32, 1e-4)])
def test_solve_bicgstab_csr_uses_fused_core(backend, dtype, rtol):
    A = convection_diffusion(18, dtype)
    b = np.ones(A.shape[0], dtype=dtype)
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="bicgstab", rtol=rtol)
    assert res.converged, res.message
    assert res.info["path"] == "batched"
    assert res.relative_residual <= rtol
    assert_matches_spsolve(res.x, A, b, dtype)


def test_bicgstab_dense_operator_and_jacobi():
    A = convection_diffusion(10)
    b = np.linspace(1, 2, A.shape[0])
    ref = bicgstab(A, b, rtol=1e-10)
    dense = bicgstab(A.toarray(), b, rtol=1e-10)
    assert abs(dense.iterations - ref.iterations) <= 1
    np.testing.assert_allclose(dense.x, ref.x, rtol=1e-8, atol=1e-10)
    res = solve(sla.aslinearoperator(A), b, method="bicgstab", rtol=1e-10)
    assert res.converged and res.info["path"] == "generic"
    np.testing.assert_allclose(res.x, ref.x, rtol=1e-8, atol=1e-10)
    pre = solve(A, b, method="bicgstab", M="jacobi", rtol=1e-10)
    assert pre.converged and pre.relative_residual <= 1e-10


def test_bicgstab_breakdown_is_a_status_not_a_crash():
    # A rotation: rhat.A r = 0 at the first step, the classic BiCGStab breakdown.
    A = sp.csr_matrix(np.array([[0.0, 1.0], [-1.0, 0.0]]))
    res = solve(A, np.array([1.0, 0.0]), method="bicgstab", callback=lambda xk: None)
    assert res.status.name == "BREAKDOWN"
    assert "gmres" in res.message
    fused = solve(A, np.array([1.0, 0.0]), method="bicgstab")
    assert fused.status.name in ("BREAKDOWN", "MAXITER")
    assert not fused.converged
