"""Smoothers and the V-cycle (managed_solve/solvers/amg/smoothers.py, cycle.py)."""

from __future__ import annotations

import numpy as np
import pytest

from managed_solve.solvers.amg import amg
from tests._problems import BACKENDS, host, on, poisson2d


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def as_matrix(M, n):
    return np.column_stack([host(M(on("cpu", e))) for e in np.eye(n)])


@pytest.mark.parametrize("smoother", ["chebyshev", "jacobi", "l1_jacobi"])
def test_v_cycle_is_symmetric_positive_definite(smoother):
    A = poisson2d(14)
    M = amg(A, setup="native", smoother=smoother, sweeps=2, max_coarse=20)
    assert len(M.levels) >= 2
    Mm = as_matrix(M, A.shape[0])
    np.testing.assert_allclose(Mm, Mm.T, atol=1e-12 * abs(Mm).max())
    assert np.linalg.eigvalsh(0.5 * (Mm + Mm.T)).min() > 0


@pytest.mark.parametrize("smoother,factor", [("chebyshev", 0.4), ("jacobi", 0.5),
                                             ("l1_jacobi", 0.65)])
def test_stationary_v_cycle_converges(backend, smoother, factor):
    A = poisson2d(63)
    x_true = np.random.default_rng(0).standard_normal(A.shape[0])
    b = A @ x_true
    Ad, bd = on(backend, A, b)
    M = amg(Ad, setup="native", smoother=smoother, sweeps=2)
    x = 0 * bd
    norms = []
    for _ in range(8):
        x = x + M(bd - Ad @ x)
        norms.append(float(np.linalg.norm(host(bd - Ad @ x))))
    rate = (norms[-1] / norms[2]) ** (1 / 5)
    assert rate < factor


def test_cycle_reuses_its_vectors_and_returns_fresh_arrays(backend):
    A = poisson2d(30)
    M = amg(on(backend, A), setup="native")
    r = on(backend, np.ones(A.shape[0]))
    z1 = M(r)
    z2 = M(2 * r)
    assert z1 is not z2
    np.testing.assert_allclose(2 * host(z1), host(z2), rtol=1e-12)
    before = [id(v) for v in M._cycle.x]  # noqa: SLF001 - the vectors are allocated once
    M(r)
    assert [id(v) for v in M._cycle.x] == before
