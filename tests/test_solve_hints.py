"""solve() learns iteration counts: a repeated solve places its first convergence read there."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve.solvers.batched as batched
from managed_solve import DeviceManager, solve


@pytest.fixture
def first_checks(monkeypatch):
    """The first_check each fused CG solve received, in order."""
    seen = []
    real = batched.cg_batched

    def spy(batch, **kw):
        seen.append(kw.get("first_check"))
        return real(batch, **kw)

    monkeypatch.setattr(batched, "cg_batched", spy)
    return seen


@pytest.fixture
def poisson():
    n = 30
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    return (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()


def test_repeated_solve_passes_the_learned_iteration_count(first_checks, poisson):
    n = poisson.shape[0]
    dm = DeviceManager(simulate="1x1GiB")
    first = solve(poisson, np.ones(n), method="cg", device="sim:0", manager=dm)
    second = solve(poisson, np.arange(n, dtype=float), method="cg", device="sim:0", manager=dm)
    assert first.converged and second.converged
    assert first_checks[0] is None and first_checks[1] == first.iterations
    # another tolerance is another kind of solve: no hint
    solve(poisson, np.ones(n), method="cg", device="sim:0", manager=dm, rtol=1e-4)
    assert first_checks[2] is None


def test_a_solve_that_reached_maxiter_teaches_maxiter(first_checks, poisson):
    dm = DeviceManager(simulate="1x1GiB")
    for _ in range(2):
        r = solve(poisson, np.ones(poisson.shape[0]), method="cg", device="sim:0", manager=dm, maxiter=7)
        assert r.status.name == "MAXITER" and r.iterations == 7
    assert first_checks == [None, 7]  # the second solve reads the host once, at maxiter, on a GPU
