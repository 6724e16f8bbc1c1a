"""The verify-and-fall-back rule: what ``solve``, ``Solver`` and every route of ``solve_many`` do with an outcome.

An engine's own convergence test reads its recurrence residual; the route
then checks the true residual ``||b - A x||`` against the system's tolerance
and decides, by one rule for every route (:func:`verdict`):

- ``ACCEPT``: converged by the true residual, or failed for good (its status says how);
- ``RESTART``: the recurrence converged but the true residual misses the
  tolerance (rounding drift): go again from this ``x`` (a Krylov restart, or
  one refinement step of an LU);
- ``FALL_BACK``: "auto" chose a method from cheap tests and it broke down
  (or a factorisation found A singular for this b): run
  :func:`fallback_for`'s method instead.
"""

from __future__ import annotations

from typing import Any

from ..result import Status
from ..system import FALLBACK, LinearSystem
from ..system.method import krylov_method
from .engine import BREAKDOWN, CONVERGED, LEAST_SQUARES, MAXITER

ACCEPT, RESTART, FALL_BACK = "accept", "restart", "fall back"

#: The result status of each engine status code.
STATUS = {CONVERGED: Status.CONVERGED, MAXITER: Status.MAXITER, BREAKDOWN: Status.BREAKDOWN,
          LEAST_SQUARES: Status.LEAST_SQUARES}


def tolerance(s: LinearSystem, b_norm: float) -> float:
    """The true-residual bound of ``s``: ``max(rtol * ||b||, atol)`` (SciPy's rule)."""
    return max(s.rtol * b_norm, s.atol)


def verdict(s: LinearSystem, method: str, code: int, residual: float, b_norm: float) -> str:
    """What to do with one system's outcome (``code``, true ``residual``) of ``method``.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> s = LinearSystem(sp.identity(3, format="csr"), np.ones(3), rtol=1e-8)
    >>> verdict(s, "cg", CONVERGED, 1e-12, 1.0), verdict(s, "cg", CONVERGED, 1e-3, 1.0)
    ('accept', 'restart')
    >>> verdict(s, "bicgstab", BREAKDOWN, 1.0, 1.0), verdict(s, "gmres", BREAKDOWN, 1.0, 1.0)
    ('fall back', 'accept')
    """
    if code == CONVERGED:
        # Written so that a NaN residual is drift too.
        return ACCEPT if residual <= tolerance(s, b_norm) else RESTART
    if code == BREAKDOWN and s.method == "auto" and (
            method in FALLBACK or (method == "direct" and s.kind != "operator")):
        return FALL_BACK
    return ACCEPT


def fallback_for(s: LinearSystem, method: str, symmetric: bool | None = None,
                 cache: dict | None = None) -> str:
    """The method "auto" runs after ``method`` broke down on ``s``.

    A Krylov method goes to :data:`~managed_solve.system.method.FALLBACK`
    (CG to MINRES, BiCGStab to GMRES); a factorisation that found A singular
    for this b goes to the auto policy's Krylov method (CG and MINRES
    converge on a consistent singular system).
    """
    if method == "direct":
        return krylov_method(s.A, symmetric, cache=cache)
    return FALLBACK[method]


def fall_back(s: LinearSystem, method: str, code: int, symmetric: bool | None = None) -> Any:
    """The method to run next after an outcome of ``code``, or None (breakdowns only)."""
    if code == BREAKDOWN and verdict(s, method, code, float("nan"), 1.0) == FALL_BACK:
        return fallback_for(s, method, symmetric)
    return None
