"""solve() learns iteration counts: a repeated solve places its first convergence read there."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

import managed_solve.solvers.batched as batched
from managed_solve import DeviceManager, solve


def test_repeated_solve_passes_the_learned_iteration_count(monkeypatch):
    seen = []
    real = batched.cg_batched

    def spy(batch, **kw):
        seen.append(kw.get("first_check"))
        return real(batch, **kw)

    monkeypatch.setattr(batched, "cg_batched", spy)
    n = 30
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    A = (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()
    dm = DeviceManager(simulate="1x1GiB")
    first = solve(A, np.ones(n * n), method="cg", device="sim:0", manager=dm)
    second = solve(A, np.arange(n * n, dtype=float), method="cg", device="sim:0", manager=dm)
    assert first.converged and second.converged
    assert seen[0] is None and seen[1] == first.iterations
    # another tolerance is another kind of solve: no hint
    solve(A, np.ones(n * n), method="cg", device="sim:0", manager=dm, rtol=1e-4)
    assert seen[2] is None


def test_a_solve_that_reached_maxiter_teaches_maxiter(monkeypatch):
    seen = []
    real = batched.cg_batched

    def spy(batch, **kw):
        seen.append(kw.get("first_check"))
        return real(batch, **kw)

    monkeypatch.setattr(batched, "cg_batched", spy)
    n = 30
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    A = (sp.kron(sp.eye(n), T) + sp.kron(T, sp.eye(n))).tocsr()
    dm = DeviceManager(simulate="1x1GiB")
    for _ in range(2):
        r = solve(A, np.ones(n * n), method="cg", device="sim:0", manager=dm, maxiter=7)
        assert r.status.name == "MAXITER" and r.iterations == 7
    assert seen == [None, 7]  # the second solve reads the host once, at maxiter, on a GPU
