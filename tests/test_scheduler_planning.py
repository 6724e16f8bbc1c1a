"""solve_many's planning path at scale: per-call estimate memo, and the W2-large balance over two GPUs."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import LinearSystem
from managed_solve import scheduler as sched
from managed_solve.manager import DeviceManager


def poisson2d(m: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 4.0, -1.0], [-1, 0, 1], shape=(m, m))
    S = sp.diags([-1.0, -1.0], [-1, 1], shape=(m, m))
    return (sp.kron(sp.identity(m), T) + sp.kron(S, sp.identity(m))).tocsr()


def shared_matrix_systems() -> list[LinearSystem]:
    """Systems sharing a few matrices, with every option the estimate depends on varied."""
    rng = np.random.default_rng(21)
    P = poisson2d(9)
    U = sp.diags([0.5], [1], shape=P.shape)
    mats = {
        "poisson": P,
        "convection": (P + U - U.T).tocsr(),  # non-symmetric: BiCGStab
        "heat": (sp.identity(81) * 10.0 + P * 0.1).tocsr(),  # easy for CG: no host LU
        "indefinite": (P - sp.identity(81) * 4.5).tocsr(),
    }
    mats["poisson32"] = mats["poisson"].astype(np.float32)
    out = []
    for k in range(200):
        name = list(mats)[k % len(mats)]
        A = mats[name]
        n = A.shape[0]
        out.append(LinearSystem(
            A, rng.standard_normal(n), x0=rng.standard_normal(n) if k % 7 == 0 else None,
            rtol=10.0 ** -(6 + k % 3), maxiter=[None, 30, 5000][k % 3 if k % 11 == 0 else 0],
            method=["auto", "auto", "cg", "bicgstab", "gmres"][k % 5 if k % 4 == 0 else 0],
            M="jacobi" if k % 6 == 0 else None, name=f"{name}{k}"))
    return out


@pytest.mark.parametrize("host_only", [False, True])
def test_estimate_memo_gives_the_estimates_computed_one_by_one(host_only):
    dm = DeviceManager(simulate="2x1GiB")
    systems = shared_matrix_systems()
    cache: dict = {}
    memoised = [sched.estimate(s, i, host_only=host_only, manager=dm, cache=cache)
                for i, s in enumerate(systems)]
    alone = [sched.estimate(s, i, host_only=host_only, manager=dm) for i, s in enumerate(systems)]
    assert memoised == alone
    assert {e.route for e in alone} >= ({"batch", "single", "direct"} if host_only else {"batch", "single"})
    assert len({e.group for e in alone}) >= 4
    # The memo keys on the matrix object: an equal copy is estimated on its own, the same.
    one = systems[1]
    twin = LinearSystem(one.A.copy(), one.b, rtol=one.rtol, name="twin")
    assert sched.estimate(twin, 1, host_only=host_only, manager=dm, cache=cache) == alone[1]
