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
