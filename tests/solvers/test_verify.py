"""The verify-and-fall-back rule: its batch form agrees with the rule system by system."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from managed_solve import LinearSystem
from managed_solve.solvers.engine import BREAKDOWN, CONVERGED, MAXITER
from managed_solve.solvers.verify import ACCEPT, accepted, verdict
from tests._problems import laplacian1d


@pytest.mark.filterwarnings("error")
def test_accepted_is_verdicts_accept_of_converged_systems():
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
    want = [code == CONVERGED and verdict(s, "cg", code, r, bn) == ACCEPT
            for s, (_k, code, r, bn) in zip(picked, cases, strict=True)]
    assert got == want
    assert any(got) and not all(got)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("device", ["cpu", "sim:0"])
def test_a_b_whose_norm_overflows_is_never_reported_converged(device):
    """Finite entries, ||b|| past float64's range: every bound reads inf <= inf, which proves nothing."""
    import scipy.sparse as sp

    import managed_solve as ms

    n = 100
    A = sp.diags(np.full(n, 10.0)).tocsr()
    b = np.full(n, 1e308)  # ||b|| = 1e309; the answer, 1e307, is a float64
    dm = ms.DeviceManager([device], simulate="1x1GiB") if device != "cpu" else ms.DeviceManager(["cpu"])
    for method in ("auto", "cg", "bicgstab", "gmres", "minres"):
        r = ms.solve(A, b, method=method, device=device, manager=dm)
        assert r.status is ms.Status.BREAKDOWN and "overflows float64" in r.message, (method, r)
    direct = ms.solve(A, b, method="direct", device=device, manager=dm)
    assert direct.status is ms.Status.CONVERGED
    np.testing.assert_allclose(np.asarray(direct.x), 1e307, rtol=1e-14)
    many = ms.solve_many([(A, b), (A, b / 1e10)], manager=dm)
    assert many[0].status is ms.Status.BREAKDOWN and "overflows float64" in many[0].message
    assert many[1].status is ms.Status.CONVERGED
    np.testing.assert_allclose(np.asarray(many[1].x), 1e297, rtol=1e-8)
