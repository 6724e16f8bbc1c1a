"""MINRES for symmetric (possibly indefinite) systems, written once for NumPy and CuPy.

The Lanczos recurrence with Givens rotations of Paige and Saunders (1975).
Every scalar of the recurrence stays a 0-d array on the device, so the loop
reads the host only at checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _backend
from ._common import (
    BREAKDOWN,
    CONVERGED,
    LEAST_SQUARES,
    MAXITER,
    NOT_IN_RANGE,
    Outcome,
    first_below,
    hopeless_start,
    identity,
    initial_iterate,
    krylov_setup,
    norm,
    overflow_message,
    read_checkpoint,
    safe_div,
    stable_norm,
)

# The least-squares watch (see minres): the relative drop of the residual's
# M-norm that shows b is still being reached, and the iterations a watch runs
# (one after progress, twice the one before).
LS_PROGRESS = 1e-3
LS_WINDOW = 10
# How far the ratio's estimate may rise from a low below sqrt(rtol) it reached
# short of rtol before the low is taken as the best this solve gets.
LS_RISE = 4.0
# How far above x's own rounding a candidate's residual must be (see _Test.resolved).
LS_NOISE = 100.0

STALLED = ("MINRES: the residual of x is above ||b|| and beyond what rounding resolves toward the "
           "tolerance, so no iterate from it gets there (an x0 many orders beyond the solution "
           "leaves one): start from x = 0 (x0=None) or from a closer guess.")

INDEFINITE_M = ("MINRES: the preconditioner M is not positive definite (r.M r < 0 for a residual "
                "r); MINRES needs a symmetric positive definite M: use M='jacobi' on a matrix "
                "with a positive diagonal, or no preconditioner.")


def minres(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
           maxiter: int | None = None, M: Callable[[Any], Any] | None = None,
           callback: Callable[[Any], None] | None = None,
           check_every: int | None = None) -> Outcome:
    """Preconditioned MINRES for a symmetric A (definite or not) and an SPD M.

    Parameters
    ----------
    A : sparse matrix, dense array or operator with ``matvec``
        Symmetric.
    b : array, shape (n,)
    x0 : array, optional
    rtol, atol : float
        Stops when the recurrence's residual estimate is at most
        ``max(rtol * ||b||, atol)``. Unlike SciPy's minres, which scales its
        test by an estimate of ``||A|| ||x||``, this is the same rule as the
        other methods. With a preconditioner the estimate is the ``M``-norm of
        the residual; ``solve()`` checks the true residual afterwards.
        On a singular A with b outside its range no x meets that; MINRES
        then stops with ``LEAST_SQUARES`` at an x whose true residual r has
        ``||A r|| <= rtol ||A|| ||r||`` (the normal equations, in the
        preconditioned inner product with M), where rounding lets x get
        there (``info["least_squares_ratio"]`` says how close it got).
    maxiter : int, optional
        Default ``10 * n`` (at least 100).
    M : callable, optional
        Symmetric positive definite preconditioner ``r -> M r``.
    callback : callable, optional
        ``callback(xk)`` after every iteration.
    check_every : int, optional
        Iterations between host reads (1 on NumPy, 8 on CuPy).

    Returns
    -------
    Outcome

    See Also
    --------
    scipy.sparse.linalg.minres : the same method and argument names.
    managed_solve.solve : the public entry point (``method="minres"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.minres import minres
    >>> A = sp.diags(np.linspace(-2.0, 2.0, 41) + 0.05).tocsr()  # indefinite
    >>> out = minres(A, np.ones(41), rtol=1e-10)
    >>> out.code, bool(np.linalg.norm(np.ones(41) - A @ out.x) < 1e-8)
    (0, True)
    """
    st = krylov_setup(A, b, rtol, atol, maxiter, check_every)
    xp, maxiter, every, matvec, tol, syncs = st.xp, st.maxiter, st.every, st.matvec, st.tol, st.host_syncs
    precond = M if M is not None else identity
    x, r = initial_iterate(xp, matvec, b, x0)
    y = precond(r)
    beta1_sq = float(xp.dot(r, y))  # sync: checks M once before the loop
    syncs += 1
    r0 = float(norm(xp, r))  # sync: an initial guess may already solve the system
    if beta1_sq < 0:
        # The same breakdown as one met in the loop: whether r.M r < 0 shows at
        # the start or later depends on b, and the outcome must not.
        return Outcome(x, BREAKDOWN, 0, r0, INDEFINITE_M, host_syncs=syncs)
    if r0 <= tol or beta1_sq == 0:
        return Outcome(x, CONVERGED, 0, r0, host_syncs=syncs)
    if math.isfinite(r0) and _stalled(xp, b, r0, tol):
        # Without restarts the recurrence's residual keeps the rounding of the first
        # one and no iterate gets closer: every iteration would be spent for nothing.
        # (A residual that overflows goes into the loop, whose overflow names the fix.)
        return Outcome(x, MAXITER, 0, r0, STALLED, host_syncs=syncs + 1)

    dt = b.dtype
    one = xp.ones((), dtype=dt)
    zero = xp.zeros((), dtype=dt)
    run = _Recurrence(xp, r, y, beta1_sq)
    hist = xp.empty(every, dtype=xp.float64)
    # The least-squares watch. Each step estimates ||A r|| / (||A|| ||r||) of
    # the iterate before it (preconditioned, in M's inner product), ||A||
    # estimated from below by the largest column of the Lanczos tridiagonal,
    # so the estimate does not read below the true ratio. Near zero while
    # ||r|| stays large, b may not be in A's range. The first step whose
    # estimate meets rtol keeps x where it is (``live``): once Lanczos has
    # exhausted A's range its next step divides by a rounding-sized pivot and
    # sends x along the null space. Short of rtol, the estimate turning back
    # up (LS_RISE) from a low marks the same place: rounding feeds x's null
    # space part and every later iterate is worse. That x is the candidate,
    # its ratio measured on its true residual. A low ratio alone does not
    # tell a singular A from a badly scaled one (A = diag(1e10, 1, ..., 1)
    # meets it at the second step with rtol = 1e-8 and converges at the
    # third), so a watch of LS_WINDOW iterations follows: a candidate is the
    # least-squares answer when the residual's M-norm has not fallen by
    # LS_PROGRESS, twice, the second time in a recurrence started again from
    # it (a recurrence may stall at its own rounding, a fresh one goes on).
    # After progress the next watch is twice as long, so only a solve still
    # progressing pays for watches. A candidate's residual must also stand
    # above the rounding x itself leaves in it (_Test.resolved): a badly
    # scaled A leaves its residual there at its attainable accuracy, and that
    # shows nothing out of reach.
    normal = xp.empty(every, dtype=xp.float64)
    anorm = zero
    ls_tol = max(float(rtol), 10 * float(np.finfo(dt).eps))
    aim = tol  # the target of the recurrence's estimate (lowered with M: see the checkpoint)
    armed = True  # looking for a candidate
    hold, live = True, one  # whether a hit keeps x (the first search only); 0 once one has
    low, best = math.inf, None  # the lowest estimate while armed; (iteration, x) there
    cand: _Candidate | None = None
    # No search before iteration ``quiet``: after a search found only rounding, or a
    # watch saw b still being reached, the next waits ``backoff``, twice as long each time.
    quiet, backoff = 0, LS_WINDOW
    fresh = False  # whether the candidate's watch runs in a recurrence started from it
    window = window_end = LS_WINDOW
    bad = xp.zeros((), dtype=bool)
    start = 1
    for it in range(1, maxiter + 1):
        phi, w, root, column, negative = run.step(xp, matvec, precond)
        bad = bad | negative  # M not positive definite on this vector
        anorm = xp.maximum(anorm, column)
        ratio = safe_div(xp, root, anorm)
        normal[it - start] = ratio
        if hold and it >= quiet:
            live = xp.where(ratio <= ls_tol, zero, live)
            x += (phi * live) * w
        else:
            x += phi * w
        hist[it - start] = xp.abs(run.phibar)
        if callback is not None:
            callback(x)
        if it - start + 1 != every and it != maxiter:
            continue
        count = it - start + 1
        start = it + 1
        # sync: reads the residual-estimate history and the flag on the host
        h, broke, k = read_checkpoint(hist, count, bad, aim)
        syncs += 1
        if broke:
            return Outcome(x, BREAKDOWN, it, float(h[-1]), INDEFINITE_M, host_syncs=syncs)
        j, rising = None, False
        if armed and it >= quiet:
            est = _backend.to_host(normal[:count])  # sync: a second read at the checkpoint
            syncs += 1
            j = first_below(est, ls_tol)
            if j is None and not np.isnan(est).all():
                low = min(low, float(np.nanmin(est)))
                rising = low <= math.sqrt(ls_tol) and float(est[-1]) >= LS_RISE * low
                if float(est[-1]) <= min(low, math.sqrt(ls_tol)):
                    # The rise shows a step or a checkpoint late, and the step after
                    # Lanczos's end sends x far (see above): the low's x is kept, the
                    # iterate before this checkpoint's last step.
                    best = (it - 1, x - phi * w)
        if k is not None and (j is None or k < j):
            done, aim, syncs = _converged(xp, matvec, b, x, h, k, it, count, tol, aim,
                                          M is None and cand is None, syncs)
            if done is not None:
                return done
        if j is not None:
            # Held, x is the iterate before step it - count + 1 + j, the one the
            # estimate spoke of. Later searches (after a watch saw progress) take x
            # as it is: a restart at each would slow a badly scaled solve.
            test = _least_squares_test(xp, matvec, precond, b, x, anorm)
            syncs += 1
            if test.resolved:
                cand = _Candidate(it - count + j if hold else it, test.m_norm, test.norm,
                                  test.ratio, x.copy())
                if test.ratio == 0:  # A M r = 0: the normal equations hold exactly
                    return _least_squares(cand, it, syncs, ls_tol)
                armed, window, window_end, fresh = False, LS_WINDOW, it + LS_WINDOW, False
            else:
                quiet, backoff = it + backoff, 2 * backoff
            if it == maxiter:
                return Outcome(x, MAXITER, it, test.norm, host_syncs=syncs)
            if hold and j == count - 1:
                x += phi * w  # the one step held back: the recurrence goes on as it was
                if k is not None:  # and it met the tolerance
                    done, aim, syncs = _converged(xp, matvec, b, x, h, k, it, count, tol, aim,
                                                  M is None and cand is None, syncs)
                    if done is not None:
                        return done
            elif hold:  # steps held back (a checkpoint every few): a new recurrence from x
                run, fresh = _Recurrence(xp, test.r, test.z, test.m_norm ** 2), cand is not None
            hold = False
        elif rising:
            test, at, kept = _least_squares_test(xp, matvec, precond, b, x, anorm), it, x.copy()
            if best is not None:
                then = _least_squares_test(xp, matvec, precond, b, best[1], anorm)
                if then.resolved and then.ratio < test.ratio:
                    test, (at, kept) = then, best
                syncs += 1
            syncs += 1
            if test.resolved:
                cand = _Candidate(at, test.m_norm, test.norm, test.ratio, kept)
                armed, hold, fresh, window, window_end = False, False, False, LS_WINDOW, it + LS_WINDOW
            else:
                quiet, backoff = it + backoff, 2 * backoff
            low, best = math.inf, None
        elif cand is not None and (it >= window_end or it == maxiter):
            test = _least_squares_test(xp, matvec, precond, b, x, anorm)
            syncs += 1
            if test.m_norm < (1 - LS_PROGRESS) * cand.m_norm:  # b is still being reached
                if it == maxiter:
                    return Outcome(x, MAXITER, it, test.norm, host_syncs=syncs)
                if test.resolved and test.ratio <= max(ls_tol, cand.ratio):  # watch longer
                    cand = _Candidate(it, test.m_norm, test.norm, test.ratio, x.copy())
                    window *= 2
                    window_end, fresh = it + window, False
                else:  # out of the least-squares test's reach: search again, later
                    cand, armed, low, best = None, True, math.inf, None
                    quiet, backoff = it + backoff, 2 * backoff
            elif fresh and it - cand.iteration >= LS_WINDOW:
                return _least_squares(cand, it, syncs, ls_tol)
            elif it == maxiter:
                return Outcome(cand.x, MAXITER, it, cand.norm, host_syncs=syncs)
            else:  # no progress in this recurrence: a new one from the candidate decides
                x = cand.x.copy()
                again = _least_squares_test(xp, matvec, precond, b, x, anorm)
                syncs += 1
                if again.m_norm == 0:
                    return Outcome(x, CONVERGED, it, 0.0, host_syncs=syncs)
                run, fresh = _Recurrence(xp, again.r, again.z, again.m_norm ** 2), True
                window_end = it + LS_WINDOW
        if not math.isfinite(float(h[-1])):  # NaN, or an overflowed estimate
            return Outcome(x, BREAKDOWN, it, float(h[-1]), overflow_message("MINRES"),
                           host_syncs=syncs)
    return Outcome(x, MAXITER, maxiter, float(_backend.to_host(xp.abs(run.phibar))), host_syncs=syncs)


def _converged(xp: Any, matvec: Callable[[Any], Any], b: Any, x: Any, h: Any, k: int, it: int,
               count: int, tol: float, aim: float, trust: bool,
               syncs: int) -> tuple[Outcome | None, float, int]:
    """``(outcome, aim, syncs)`` at a checkpoint whose residual estimate met ``aim`` at ``h[k]``.

    ``trust``: the estimate alone decides (no M, no candidate). Otherwise the
    true residual does: preconditioned, the recurrence tracks sqrt(r.M r),
    not ||r|| (with M = Jacobi on a diagonal of 600 it reads ||r|| / 24); in
    a watch it may have run past Lanczos's end. Short of the tolerance, the
    estimate's target is lowered by the ratio just seen (with a margin) and
    the outcome is None.
    """
    if trust:
        return Outcome(x, CONVERGED, it, float(h[k]), host_syncs=syncs,
                       info={"converged_at": it - count + 1 + k}), aim, syncs
    rtrue = float(norm(xp, b - matvec(x)))  # sync: the true residual, at a hit only
    syncs += 1
    if rtrue <= tol:
        return Outcome(x, CONVERGED, it, rtrue, host_syncs=syncs, info={"converged_at": it},
                       true_residual=(x, rtrue)), aim, syncs
    if _stalled(xp, b, rtrue, tol):  # going on would spend every iteration left
        return Outcome(x, MAXITER, it, rtrue, STALLED, host_syncs=syncs + 1), aim, syncs
    return None, min(0.5 * aim, 0.9 * tol * float(h[-1]) / rtrue), syncs


def _stalled(xp: Any, b: Any, residual: float, tol: float) -> bool:
    """Whether an x of true residual norm ``residual`` is hopeless (:func:`hopeless_start`).

    ``||b||`` is read (one synchronisation) only where rounding alone, ``eps * residual``,
    is above the tolerance.
    """
    return residual * float(np.finfo(b.dtype).eps) > tol and hopeless_start(
        residual, stable_norm(xp, b), tol, b.dtype)  # sync: ||b||, rarely


class _Recurrence:
    """Paige and Saunders's MINRES recurrence from a residual ``r`` (``z = M r``, ``r.M r > 0``).

    The Lanczos process with the Givens rotations of its tridiagonal's QR;
    every scalar a 0-d array on the device.
    """

    def __init__(self, xp: Any, r: Any, z: Any, m_norm_sq: float):
        dt = r.dtype
        self.one = xp.ones((), dtype=dt)
        zero = xp.zeros((), dtype=dt)
        self.beta = xp.sqrt(xp.asarray(m_norm_sq, dtype=dt))
        self.oldb, self.dbar, self.epsln, self.phibar = zero, zero, zero, self.beta
        self.cs, self.sn = -self.one, zero
        self.w, self.w2 = xp.zeros_like(r), xp.zeros_like(r)
        self.r1 = self.r2 = r
        self.y = z
        self.first = True

    def step(self, xp: Any, matvec: Callable[[Any], Any],
             precond: Callable[[Any], Any]) -> tuple[Any, Any, Any, Any, Any]:
        """One step: ``(phi, w, root, column, negative)``; x moves by ``phi * w``.

        ``root / ||A||`` is the ratio ||A r|| / (||A|| ||r||) of the iterate
        before this step; ``column`` is the norm of the tridiagonal's new
        column, a lower bound of ||A|| (of the preconditioned operator);
        ``negative`` says r.M r < 0 (M not positive definite).
        """
        one = self.one
        v = self.y * safe_div(xp, one, self.beta)
        y = matvec(v)
        if not self.first:
            y -= safe_div(xp, self.beta, self.oldb) * self.r1
        alfa = xp.dot(v, y)
        y -= safe_div(xp, alfa, self.beta) * self.r2
        self.r1, self.r2 = self.r2, y
        self.y = precond(y)
        # The column is (beta_k, alfa_k, beta_k+1); the first step's has no beta_1 (||b||).
        upper = self.beta * self.beta if not self.first else xp.zeros((), dtype=alfa.dtype)
        self.oldb = self.beta
        beta_sq = xp.dot(y, self.y)
        beta = self.beta = xp.sqrt(xp.maximum(beta_sq, 0))
        self.first = False
        # Apply the previous rotation, then make the one that zeroes beta.
        cs, sn, dbar = self.cs, self.sn, self.dbar
        oldeps = self.epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        self.epsln = sn * beta
        self.dbar = -cs * beta
        root = xp.sqrt(gbar * gbar + self.dbar * self.dbar)
        column = xp.sqrt(alfa * alfa + upper + beta * beta)
        gamma = xp.sqrt(gbar * gbar + beta * beta)
        self.cs = safe_div(xp, gbar, gamma)
        # gamma = 0: Lanczos stopped (beta = 0) on a singular projection (A v = 0 for a
        # zero A, say). No step reduces the residual: sn = 1 keeps phibar, the estimate,
        # where it is (it read 0, a false convergence, with sn = 0); an exact solve's
        # phibar is already 0 and stays so.
        self.sn = xp.where(gamma == 0, one, safe_div(xp, beta, gamma))
        phi = self.cs * self.phibar
        self.phibar = self.sn * self.phibar
        w1, self.w2 = self.w2, self.w
        self.w = (v - oldeps * w1 - delta * self.w2) * safe_div(xp, one, gamma)
        return phi, self.w, root, column, beta_sq < 0


@dataclass
class _Candidate:
    """An iterate the least-squares watch holds: where, its residual and its ratio."""

    iteration: int
    m_norm: float  # sqrt(r.M r), what MINRES minimises
    norm: float  # ||r||
    ratio: float  # its least-squares ratio (_Test.ratio)
    x: Any


@dataclass
class _Test:
    """The true residual of an iterate and its least-squares ratio (host floats)."""

    r: Any
    z: Any  # M r
    m_norm: float
    norm: float
    ratio: float  # ||A M r||_M / (||A|| ||r||_M), ||A|| the recurrence's estimate
    # ||r|| above what rounding x alone leaves in it, LS_NOISE * eps (||b|| + ||A|| ||x||): a
    # residual at that level (a nonsingular A, badly scaled, at its attainable accuracy)
    # shows no part of b out of reach, and its ratio is rounding's.
    resolved: bool


def _least_squares_test(xp: Any, matvec: Callable[[Any], Any], precond: Callable[[Any], Any],
                        b: Any, x: Any, anorm: Any) -> _Test:
    """``x``'s true residual and least-squares ratio, read on the host in one synchronisation.

    Unpreconditioned, the ratio is ``||A r|| / (||A|| ||r||)``, the
    normal equations' relative residual; with M it is that of the
    preconditioned system (SPD M = L L^T, its residual L^T r).
    """
    r = b - matvec(x)
    z = precond(r)
    q = matvec(z)
    # sync: six numbers at once, at a least-squares checkpoint only
    rz, qq, rr, an, xx, bb = (float(v) for v in _backend.to_host(xp.stack([
        xp.dot(r, z), xp.dot(q, precond(q)), xp.dot(r, r), anorm.astype(r.dtype), xp.dot(x, x),
        xp.dot(b, b)])))
    m_norm = math.sqrt(max(rz, 0.0))
    num = math.sqrt(max(qq, 0.0))
    ratio = 0.0 if num == 0 else (num / (an * m_norm) if an * m_norm > 0 else math.inf)
    noise = LS_NOISE * float(np.finfo(r.dtype).eps) * (math.sqrt(bb) + an * math.sqrt(xx))
    return _Test(r, z, m_norm, math.sqrt(rr), ratio, math.sqrt(rr) > noise)


def _least_squares(cand: _Candidate, it: int, syncs: int, ls_tol: float) -> Outcome:
    """The LEAST_SQUARES outcome of a candidate; where rounding held its ratio above the
    tolerance, the message says how far it got."""
    message = NOT_IN_RANGE
    if cand.ratio > ls_tol:
        message += (f" Rounding held this x's least-squares test ||A r|| / (||A|| ||r||) at "
                    f"{cand.ratio:.1e}, above rtol = {ls_tol:.1e}; projecting b onto the range "
                    "(nullspace=) leaves a consistent system that meets it.")
    return Outcome(cand.x, LEAST_SQUARES, it, cand.norm, message, host_syncs=syncs,
                   info={"least_squares_at": cand.iteration, "least_squares_ratio": cand.ratio})
