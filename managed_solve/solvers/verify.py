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

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _backend
from ..result import Status
from ..system import FALLBACK, LinearSystem
from ..system.method import krylov_method
from ._common import DROPPED_START, HOPELESS_START, hopeless_start, stable_norm, true_residual_norm
from .engine import BREAKDOWN, CONVERGED, LEAST_SQUARES, MAXITER, Outcome, Prepared

ACCEPT, RESTART, FALL_BACK = "accept", "restart", "fall back"

#: ``Outcome.info`` key of an x scaled back into subnormal numbers (the float's ``tiny``).
SUBNORMAL = "subnormal_below"

log = logging.getLogger("managed_solve")

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
    >>> verdict(s, "bicgstab", BREAKDOWN, 1e-12, 1.0)  # x met the tolerance all the same
    'accept'
    """
    # The true residual decides first, whatever the method's own test said.
    # Written so that a NaN residual is not converged (drift, for a converged
    # code); an infinite one (a b whose norm overflows, against an infinite
    # bound) never is.
    if residual <= tolerance(s, b_norm) and residual < math.inf:
        return ACCEPT
    if code == CONVERGED:
        return RESTART
    if code == BREAKDOWN and s.method == "auto" and (
            method in FALLBACK or (method == "direct" and s.kind != "operator")):
        return FALL_BACK
    return ACCEPT


def accepted(systems: Sequence[LinearSystem], codes: np.ndarray, residuals: np.ndarray,
             b_norms: np.ndarray) -> np.ndarray:
    """Which systems :func:`verdict` accepts as converged, for a batch at once (a boolean array).

    The first rule of :func:`verdict` over arrays by system (engine codes,
    true residual norms, norms of b): the residual within :func:`tolerance`,
    whatever the code. The others are left to :func:`verdict`, one by one.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> s = LinearSystem(sp.identity(3, format="csr"), np.ones(3), rtol=1e-8)
    >>> accepted([s, s, s], np.array([CONVERGED, CONVERGED, MAXITER]), np.array([1e-12, 1e-3, 1.0]),
    ...          np.ones(3)).tolist()
    [True, False, False]
    """
    rtol = np.array([s.rtol for s in systems], dtype=np.float64)
    atol = np.array([s.atol for s in systems], dtype=np.float64)
    # Written so that a NaN residual or bound is not accepted, as in verdict; an
    # rtol of 0 times an infinite ||b|| is such a NaN, not a warning for the caller.
    residuals = np.asarray(residuals)
    with np.errstate(invalid="ignore"):
        return (residuals <= np.maximum(rtol * np.asarray(b_norms, dtype=np.float64), atol)) \
            & (residuals < np.inf)


def fallback_for(s: LinearSystem, method: str, symmetric: bool | None = None,
                 cache: dict | None = None) -> str:
    """The method "auto" runs after ``method`` broke down on ``s``.

    A Krylov method goes to :data:`~managed_solve.system.method.FALLBACK`
    (CG to MINRES, MINRES and BiCGStab to GMRES); CG or MINRES on a matrix
    known not to be symmetric (``symmetric=False``: values changed since the
    method was chosen, ``Solver.update``) to the non-symmetric choice; a
    factorisation that found A singular for this b goes to the auto policy's
    Krylov method (CG and MINRES converge on a consistent singular system).
    """
    if method == "direct":
        return krylov_method(s.A, symmetric, cache=cache)
    if method in ("cg", "minres") and symmetric is False:
        return krylov_method(s.A, False)
    return FALLBACK[method]


def fall_back(s: LinearSystem, method: str, code: int, symmetric: bool | None = None) -> Any:
    """The method to run next after an outcome of ``code``, or None (breakdowns only)."""
    if code == BREAKDOWN and verdict(s, method, code, float("nan"), 1.0) == FALL_BACK:
        return fallback_for(s, method, symmetric)
    return None


# Extra Krylov restarts from the current x when the recurrence residual met
# the tolerance but the true residual did not (drift, mostly in float32).
REFINEMENTS = 2


def status_of(out: Outcome, method: str, residual: float, tol: float, system: Any, *,
              restarts: int = REFINEMENTS) -> tuple[Status, str]:
    """The result status of ``out`` and its message, judged by the true ``residual`` against ``tol``.

    ``system``: the :class:`LinearSystem` solved, or anything with its
    ``rtol`` and ``dtype`` (the messages name them). ``restarts``: the
    restarts made after the recurrence converged (:func:`refine`), for the
    message of a true residual that still misses the tolerance. A solve
    that dropped a hopeless start for x = 0 (``out.info``'s
    :data:`~managed_solve.solvers._common.DROPPED_START`) says so, and a
    failure from a hopeless x0 (:data:`~managed_solve.solvers._common.HOPELESS_START`)
    names it and the fix.
    """
    status, message = _judged(out, method, residual, tol, system, restarts)
    far = f"above ||b|| and too far for {np.dtype(system.dtype).name} rounding to reach the tolerance from"
    dropped, hopeless = out.info.get(DROPPED_START), out.info.get(HOPELESS_START)
    if dropped is not None:
        message += (f" (it started from x = 0: a start with ||b - A x|| = {dropped:.3g}, {far}, "
                    "was dropped)")
    elif hopeless is not None and status is not Status.CONVERGED:
        message += (f" The initial guess x0 has ||b - A x0|| = {hopeless:.3g}, {far}: solve "
                    "without x0 (x = 0 starts closer), or with a closer guess.")
    return status, message


def _judged(out: Outcome, method: str, residual: float, tol: float, system: Any,
            restarts: int) -> tuple[Status, str]:
    if out.code in (BREAKDOWN, MAXITER) and out.x is not None and residual <= tol * (1 + 1e-6) \
            and residual < math.inf:
        # The true residual decides, whatever the method's own test said (a
        # breakdown one step after x met the tolerance, an estimate lagging it).
        said = (out.message or STATUS[out.code].message).rstrip(".")
        return Status.CONVERGED, (f"{method}: converged in {out.iterations} iterations by the "
                                  f"true residual ({residual:.3g} <= {tol:.3g}; the method's own "
                                  f"test said: {said})")
    if out.code == BREAKDOWN:
        return Status.BREAKDOWN, out.message or Status.BREAKDOWN.message
    if residual == math.inf and out.code in (CONVERGED, LEAST_SQUARES):
        # Finite entries whose norms overflow (||b|| past 1.8e308): every
        # tolerance test reads inf <= inf, so nothing here shows convergence.
        return Status.BREAKDOWN, (
            f"{method}: ||b - A x|| overflows float64 (past {np.finfo(np.float64).max:.3g}), so "
            "convergence cannot be measured; scale the equations (divide A and b by a common "
            "factor such as max|b|) and solve again.")
    if out.code == LEAST_SQUARES:
        if residual <= tol * (1 + 1e-6):  # b was in the range after all
            return Status.CONVERGED, f"{method}: converged in {out.iterations} iterations"
        return Status.LEAST_SQUARES, (f"{out.message} ||b - A x|| = {residual:.3g} against the "
                                      f"tolerance {tol:.3g}.")
    if out.code == MAXITER:
        if method == "direct":
            return Status.MAXITER, out.message
        return Status.MAXITER, (f"{method}: {out.iterations} iterations did not reach the "
                                f"tolerance (||b - A x|| = {residual:.3g} > {tol:.3g}); raise "
                                "maxiter, loosen rtol, or add a preconditioner (M='jacobi').")
    if not residual <= tol * (1 + 1e-6):
        if SUBNORMAL in out.info:
            return Status.BREAKDOWN, (
                f"{method}: ||b - A x|| = {residual:.3g} exceeds {tol:.3g} because x has entries "
                f"below {out.info[SUBNORMAL]:.3g} (subnormal numbers, with fewer digits): solve "
                "for scaled unknowns x * s.")
        if method == "direct":
            return Status.MAXITER, (
                f"direct: the true residual ||b - A x|| = {residual:.3g} exceeds {tol:.3g}; "
                f"A is too ill-conditioned for rtol={system.rtol:g} in {system.dtype}.")
        if "returned" in out.info:  # every iterate was worse than the start
            return Status.MAXITER, (
                f"{method}: the recurrence met the tolerance but its x was worse than the "
                f"initial guess, which is returned (||b - A x|| = {residual:.3g} > {tol:.3g}): "
                "A may be singular with b outside its range (pass nullspace= for a "
                "least-squares answer), or the preconditioner may not suit A (try M=None).")
        return Status.MAXITER, (
            f"{method}: the recurrence met the tolerance but the true residual "
            f"||b - A x|| = {residual:.3g} exceeds {tol:.3g} after {restarts} restarts; "
            + (f"float32 may not resolve rtol={system.rtol:g} (use dtype='float64' or a looser "
               "rtol)." if np.dtype(system.dtype) == np.float32 else
               f"A's conditioning in {system.dtype} may not allow rtol={system.rtol:g} "
               "(loosen rtol)."))
    if method == "direct":
        return Status.CONVERGED, f"solved by {out.info.get('factorisation', 'LU')}"
    return Status.CONVERGED, f"{method}: converged in {out.iterations} iterations"


def status_outside_range(out: Outcome, method: str, residual: float, projected: float, off: float,
                         tol: float, system: LinearSystem) -> tuple[Status, str]:
    """The status of a solve whose b has a part of norm ``off > tol`` outside A's known range.

    That part is in every residual, so the status is that of the projected
    system P b (``projected = ||P b - A x||``): solved, x is the least-squares
    answer (``LEAST_SQUARES``); not solved, x is no such answer (``MAXITER``
    or ``BREAKDOWN``, as :func:`status_of` says of P b).
    """
    status, message = status_of(out, method, projected, tol, system)
    outside = f"b has a part of norm {off:.3g} outside the range of A"
    if status is Status.CONVERGED:
        return Status.LEAST_SQUARES, (
            f"{outside} (tolerance {tol:.3g}): no x solves the system; x is the least-squares "
            f"solution orthogonal to the null space (||b - A x|| = {residual:.3g}).")
    if status is Status.MAXITER:
        return status, (
            f"{outside} and {method} did not solve the projected system P b for the rest: "
            f"||P b - A x|| = {projected:.3g} > {tol:.3g} after {out.iterations} iterations, so x "
            "is not the least-squares solution; raise maxiter, loosen rtol, or add a "
            "preconditioner (M='jacobi').")
    return status, f"{outside}; {message}"


def refine(A: Any, b: Any, prepared: Any, out: Outcome, tol: float, transpose: bool,
           b_norm: float | None = None) -> Outcome:
    """Restart from x while the recurrence converged but the true residual did not.

    An x as far off as a hopeless guess (its residual above ``||b||`` and
    beyond what rounding resolves toward ``tol``: :func:`hopeless_start`),
    left by a recurrence that ran from such a guess, is no start for a
    restart: x = 0 is. ``b_norm``: ``||b||`` where the caller has read it.
    """
    total, syncs = out.iterations, out.host_syncs
    maxiter = prepared.maxiter
    restarted = False
    for _ in range(REFINEMENTS):
        if out.code != CONVERGED or out.x is None:
            break
        known = out.checked_residual(out.x)
        residual = known if known is not None else true_residual_norm(A, b, out.x)
        if residual <= tol:
            break
        left = maxiter - total
        if left <= 0:
            break
        if b_norm is None:
            b_norm = stable_norm(_backend.array_module(b), b)  # sync: once, on drift only
        restarted = True
        start = None if hopeless_start(residual, b_norm, tol, b.dtype) else out.x
        nxt = prepared.solve_limited(b, start, left, transpose=transpose)
        if start is None:
            nxt.info[DROPPED_START] = residual
        total += nxt.iterations
        syncs += nxt.host_syncs
        out = nxt
    if restarted and out.code == CONVERGED and out.x is not None \
            and out.checked_residual(out.x) is None:
        # Drifted: the last restart's x is measured too (the status and the
        # choice of start or end read it).
        out.true_residual = (out.x, true_residual_norm(A, b, out.x))
    out.iterations, out.host_syncs = total, syncs
    return out


def stagnated(A: Any, b: Any, x0: Any, out: Outcome, b_norm: float | None = None) -> bool:
    """Whether ``out`` left the true residual at 90% of the start's or above."""
    start = _start_norm(A, b, x0, b_norm)
    end = out.checked_residual(out.x)
    if end is None:  # measured once: the rule's last step and the status read it again
        end = true_residual_norm(A, b, out.x)
        out.true_residual = (out.x, end)
    return not end < 0.9 * start


def _start_norm(A: Any, b: Any, x0: Any, b_norm: float | None) -> float:
    """``||b - A x0||`` (``||b||`` for x0 = None: the caller's reading where it has one)."""
    if x0 is not None:
        return true_residual_norm(A, b, x0)
    return b_norm if b_norm is not None else stable_norm(_backend.array_module(b), b)


def no_worse_than_the_start(A: Any, b: Any, x0: Any, out: Outcome, tol: float,
                            b_norm: float | None = None) -> Outcome:
    """A failed solve whose x is worse than its initial guess hands back the initial guess.

    A breakdown or an exhausted iteration limit can leave an iterate far
    from any solution (CG on an inconsistent singular system grows x along
    the null space), and so can a recurrence that met the tolerance where the
    true residual, already measured, did not (a preconditioned GMRES on such
    a system); the caller then gets the better of start and end. ``b_norm``:
    ``||b||`` where the caller has read it (the start's residual for x0 = None).
    """
    if out.x is None:
        return out
    end = out.checked_residual(out.x)
    if end is None and out.code == CONVERGED:  # the recurrence's word, not checked: kept
        return out
    if end is None:  # measured once: the caller's status reads it (checked_residual)
        end = true_residual_norm(A, b, out.x)
        out.true_residual = (out.x, end)
    if end <= tol:
        return out
    start = _start_norm(A, b, x0, b_norm)
    if not end <= start:  # a NaN end (an overflowed iterate) is worse than any start
        out.x = _backend.array_module(b).zeros_like(b) if x0 is None else x0.copy()
        out.true_residual = (out.x, start)
        out.info["returned"] = "initial guess (the last iterate was worse)"
    return out


def run_rule(system: LinearSystem, method: str, prepared: Any, b: Any, x0: Any, out: Outcome,
             tol: float, transpose: bool, A: Any, *, symmetric: bool | None,
             engine: Callable[[str], Any], callback: Callable[[Any], None] | None = None,
             b_norm: float | None = None) -> tuple[str, Outcome]:
    """The verify rule for one column of one system: restart after drift, fall back ("auto").

    ``prepared`` is ``method``'s prepared engine (or the Outcome of its failed
    set-up), ``out`` its answer for ``b`` from ``x0``, ``A`` the matrix
    solved (transposed for a transposed solve); ``engine(method)`` gives the
    prepared engine of a fall-back method. ``b_norm``: ``||b||`` where the
    caller has read it (each host read costs a synchronisation on a GPU).
    Returns the method that answered and its outcome, its iterations
    counting every method tried.
    """
    if method == "direct":
        if callback is not None and out.x is not None:
            callback(out.x)
    elif isinstance(prepared, Prepared):
        out = refine(A, b, prepared, out, tol, transpose, b_norm)
    tried = [method]
    while True:
        fallback = fall_back(system, method, out.code, symmetric)
        if fallback is None and system.method == "auto" and out.code == MAXITER \
                and method in ("cg", "bicgstab") and out.x is not None \
                and stagnated(A, b, x0, out, b_norm):
            # The iteration limit with the residual where it started: the
            # method does not suit this matrix (singular, indefinite), not
            # merely slow; the robust method may (MINRES is the robust one
            # of a symmetric matrix: its own stall is an answer).
            fallback = fallback_for(system, method, symmetric)
        if fallback is None or fallback in tried:
            return method, no_worse_than_the_start(A, b, x0, out, tol, b_norm)
        # "auto" guessed from cheap tests (a positive diagonal does not make a
        # symmetric matrix definite; a factorisation may meet a singular
        # matrix): retry with the robust method (a chain: LU, CG, MINRES).
        log.info("managed_solve: %s did not solve (%s); auto falls back to %s",
                 method, out.message, fallback)
        spent = out.iterations
        # The engines read a right-hand side as one stretch of memory.
        xp = _backend.array_module(b)
        b = xp.ascontiguousarray(b)
        x0 = None if x0 is None else xp.ascontiguousarray(x0)
        then = engine(fallback)
        if isinstance(then, Outcome):
            again = failed_setup(then)
        else:
            again = then.solve_transpose(b, x0) if transpose else then.solve(b, x0)
            if fallback != "direct":
                again = refine(A, b, then, again, tol, transpose, b_norm)
        again.iterations += spent
        again.info["fallback_from"] = method
        method, out = fallback, again
        tried.append(method)


def check_representable(out: Outcome, scaled_x: Any) -> None:
    """A solution scaled back past float's range is reported, not returned as inf or 0."""
    xp = _backend.array_module(out.x)
    if not bool(xp.isfinite(out.x).all()):  # sync: once, extreme scales only
        out.x, out.code = None, BREAKDOWN
        out.message = ("the solution overflows the float range (|x| would exceed "
                       f"{np.finfo(scaled_x.dtype).max:.3g}): solve for scaled unknowns x / s.")
    elif bool((out.x == 0).all()) and bool((scaled_x != 0).any()):  # sync: as above
        out.code = BREAKDOWN
        out.message = ("the solution underflows the float range (its entries are below "
                       f"{np.finfo(scaled_x.dtype).tiny:.3g}): solve for scaled unknowns x * s.")
    else:
        tiny = float(np.finfo(scaled_x.dtype).tiny)
        if bool(((out.x != 0) & (xp.abs(out.x) < tiny)).any()):  # sync: as above
            # Subnormal entries hold fewer digits: the true residual, read from
            # this x, says whether the tolerance is still met (SUBNORMAL's message).
            out.info[SUBNORMAL] = tiny


def failed_setup(setup: Outcome) -> Outcome:
    """The outcome of a solve whose engine could not be set up (a copy per column)."""
    return Outcome(None, setup.code, 0, setup.residual_norm, setup.message)
