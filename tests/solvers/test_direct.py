"""Direct solves against SciPy's spsolve; singular matrices give a status, not a crash."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve.solve import solve
from managed_solve.solvers.direct import direct
from tests._problems import BACKENDS, host, on, poisson2d


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_direct_matches_spsolve(backend, dtype, symmetric):
    A = poisson2d(15, dtype)
    if not symmetric:
        A = (A + sp.diags([0.7], [3], shape=A.shape)).tocsr().astype(dtype)
    x_true = np.random.default_rng(4).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    ref = sla.spsolve(A.astype(np.float64).tocsc(), b.astype(np.float64))
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="direct")
    assert res.converged, res.message
    x = host(res.x)
    assert x.dtype == dtype
    tol = 1e-10 if dtype == np.float64 else 1e-3
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(x, x_true, rtol=tol * 10, atol=tol * 10)
    assert res.iterations == 1


def test_direct_orders_symmetric_matrices_for_symmetry():
    A = poisson2d(10)
    out = direct(A, np.ones(100), symmetric=True)
    assert "MMD_AT_PLUS_A" in out.info["factorisation"]
    out = direct(A, np.ones(100), symmetric=False)
    assert "COLAMD" in out.info["factorisation"]


def test_direct_dense():
    A = poisson2d(6).toarray()
    b = np.arange(36.0)
    res = solve(A, b, method="direct")
    assert res.converged
    np.testing.assert_allclose(res.x, np.linalg.solve(A, b), rtol=1e-12)


@pytest.mark.parametrize("kind", ["exact", "numerical", "dense"])
def test_singular_matrix_gives_breakdown_with_fix(backend, kind):
    if kind == "exact":  # a zero row
        A = poisson2d(5).tolil()
        A[3, :] = 0
        A = A.tocsr()
        A.eliminate_zeros()
    elif kind == "numerical":  # pure Neumann Laplacian: rows sum to zero
        T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5)).tolil()
        T[0, 0] = T[4, 4] = 1.0
        A = sp.kronsum(T.tocsr(), T.tocsr()).tocsr()
    else:
        A = np.ones((4, 4))
    b = np.arange(1.0, A.shape[0] + 1)
    Ad, bd = on(backend, A, b)
    res = solve(Ad, bd, method="direct")
    assert res.status.name == "BREAKDOWN"
    assert res.x is None
    assert "singular" in res.message and "boundary" in res.message
    with pytest.raises(Exception, match="singular"):
        res.raise_for_status()


def test_gpu_sparse_path_prefers_cudss_when_nvmath_is_installed(monkeypatch):
    """The cuDSS branch's wiring (nvmath-python is not on the GPU image: a stand-in module)."""
    import importlib
    import types

    from managed_solve import _backend

    direct_mod = importlib.import_module("managed_solve.solvers.direct")  # the module, not the function

    calls, options = [], []

    def direct_solver(a, b, /, **kwargs):
        calls.append((a, b, kwargs["options"].sparse_system_type))
        options.append(kwargs["options"])
        return sla.spsolve(a.tocsc(), b)

    fake = types.SimpleNamespace(
        direct_solver=direct_solver,
        DirectSolverMatrixType=types.SimpleNamespace(GENERAL="general", SYMMETRIC="symmetric"),
        DirectSolverOptions=lambda **kw: types.SimpleNamespace(**kw))
    # No cuDSS library here: no handle to make, no threading layer to find.
    monkeypatch.setattr(direct_mod, "CUDSS_REUSE_HANDLE", False)
    monkeypatch.setattr(direct_mod, "CUDSS_THREADING", False)
    real = _backend._maybe
    monkeypatch.setattr(_backend, "_maybe",
                        lambda name: fake if name == "nvmath.sparse.advanced" else real(name))
    A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(30, 30), format="csr")
    b = np.ones(30)
    x, how = direct_mod._gpu_sparse(A, b, None)
    assert how == "cuDSS (nvmath-python)" and len(calls) == 1 and calls[0][0] is A
    assert calls[0][2] == "general"
    assert options[0].logger.name == "managed_solve.cudss"  # nvmath's phase logs under ours
    np.testing.assert_allclose(A @ x, b, rtol=1e-12)
    direct_mod._gpu_sparse(A, b, True)
    assert calls[1][2] == "symmetric"  # cuDSS is told the matrix type


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_cudss_solves_like_scipy(dtype, symmetric):
    """The real cuDSS path (runs where nvmath-python and cuDSS are installed)."""
    pytest.importorskip("nvmath.sparse.advanced")
    A = poisson2d(120, dtype)  # 14,400 unknowns: fill-in matters
    if not symmetric:
        A = (A + sp.diags([0.7], [3], shape=A.shape)).tocsr().astype(dtype)
    x_true = np.random.default_rng(5).standard_normal(A.shape[0]).astype(dtype)
    b = (A @ x_true).astype(dtype)
    ref = sla.spsolve(A.astype(np.float64).tocsc(), b.astype(np.float64))
    Ad, bd = on("cuda", A, b)
    res = solve(Ad, bd, method="direct")
    assert res.converged, res.message
    assert res.info["factorisation"] == "cuDSS (nvmath-python)"
    x = host(res.x)
    assert x.dtype == dtype
    tol = 1e-9 if dtype == np.float64 else 2e-3
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cudss_singular_matrix_is_breakdown():
    pytest.importorskip("nvmath.sparse.advanced")
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(8, 8)).tolil()
    T[0, 0] = T[7, 7] = 1.0  # pure Neumann: singular
    A = sp.kronsum(T.tocsr(), T.tocsr()).tocsr()
    Ad, bd = on("cuda", A, np.arange(1.0, 65.0))
    res = solve(Ad, bd, method="direct")
    assert res.status.name == "BREAKDOWN" and res.x is None
    assert "singular" in res.message


@pytest.mark.gpu
def test_cudss_handle_made_once_per_thread():
    """One cuDSS handle per thread and device, reused by later solves; threads get their own."""
    pytest.importorskip("nvmath.sparse.advanced")
    import importlib
    import threading

    direct_mod = importlib.import_module("managed_solve.solvers.direct")
    A = poisson2d(40)
    Ad, bd = on("cuda", A, np.ones(A.shape[0]))
    solve(Ad, bd, method="direct")
    dev = int(bd.device.id)
    h = direct_mod._cudss_local.handles[dev]
    res = solve(Ad, bd, method="direct")
    assert res.converged and direct_mod._cudss_local.handles[dev] == h
    seen = {}

    def other():
        r = solve(Ad, bd, method="direct")
        seen["handle"], seen["ok"] = direct_mod._cudss_local.handles[dev], r.converged

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen["ok"] and seen["handle"] != h
    assert res.info["factorisation"] == "cuDSS (nvmath-python)"
