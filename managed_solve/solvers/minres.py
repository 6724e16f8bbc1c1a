"""MINRES for symmetric (possibly indefinite) systems, written once for NumPy and CuPy.

The Lanczos recurrence with Givens rotations of Paige and Saunders (1975).
Every scalar of the recurrence stays a 0-d array on the device, so the loop
reads the host only at checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    identity,
    initial_iterate,
    krylov_setup,
    norm,
    overflow_message,
    read_checkpoint,
    safe_div,
)

# The least-squares watch (see minres): the relative drop of the true
# residual that shows b is still being reached, and the fewest iterations a
# watch runs before it may conclude.
LS_PROGRESS = 1e-3
LS_WINDOW = 10

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
    x, r1 = initial_iterate(xp, matvec, b, x0)
    y = precond(r1)
    beta1_sq = float(xp.dot(r1, y))  # sync: checks M once before the loop
    syncs += 1
    r0 = float(norm(xp, r1))  # sync: an initial guess may already solve the system
    if beta1_sq < 0:
        # The same breakdown as one met in the loop: whether r.M r < 0 shows at
        # the start or later depends on b, and the outcome must not.
        return Outcome(x, BREAKDOWN, 0, r0, INDEFINITE_M, host_syncs=syncs)
    if r0 <= tol or beta1_sq == 0:
        return Outcome(x, CONVERGED, 0, r0, host_syncs=syncs)

    dt = b.dtype
    one = xp.ones((), dtype=dt)
    zero = xp.zeros((), dtype=dt)
    beta = xp.sqrt(xp.asarray(beta1_sq, dtype=dt))
    oldb, dbar, epsln = zero, zero, zero
    phibar = beta
    cs, sn = -one, zero
    w = xp.zeros_like(b)
    w2 = xp.zeros_like(b)
    r2 = r1
    hist = xp.empty(every, dtype=xp.float64)
    # ||A r|| / (||A|| ||r||) per iteration (SciPy's test2), ||A|| estimated
    # from the Lanczos tridiagonal. Near zero while ||r|| stays large, b may
    # not be in A's range, but this alone does not tell a singular A from a
    # badly scaled one: with cond(A) > 1 / rtol the ratio falls below rtol
    # while the residual still shrinks (A = diag(1e10, 1, ..., 1) does at the
    # second step and converges at the third). So a hit only starts a watch
    # that keeps x: it is the least-squares answer when the true residual has
    # not shrunk by the time the iteration count has doubled (no x reaches
    # b's part outside the range), else the iteration goes on. The
    # recurrence's own estimate is no witness there: once Lanczos has
    # exhausted the range it falls below the true residual while x grows
    # along the null space, which is also why the kept x is the answer.
    normal = xp.empty(every, dtype=xp.float64)
    tnorm2 = zero
    ls_tol = max(float(rtol), 10 * float(np.finfo(dt).eps))
    aim = tol  # the target of the recurrence's estimate (lowered with M: see the checkpoint)
    watch: tuple[int, float, Any] | None = None  # iteration, true ||r|| and x of the last hit
    bad = xp.zeros((), dtype=bool)
    start = 1
    for it in range(1, maxiter + 1):
        v = y * safe_div(xp, one, beta)
        y = matvec(v)
        if it >= 2:
            y -= safe_div(xp, beta, oldb) * r1
        alfa = xp.dot(v, y)
        y -= safe_div(xp, alfa, beta) * r2
        r1, r2 = r2, y
        y = precond(r2)
        oldb = beta
        beta_sq = xp.dot(r2, y)
        bad = bad | (beta_sq < 0)  # M not positive definite on this vector
        beta = xp.sqrt(xp.maximum(beta_sq, 0))
        # Apply the previous rotation, then make the one that zeroes beta.
        oldeps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        root = xp.sqrt(gbar * gbar + dbar * dbar)
        tnorm2 = tnorm2 + alfa * alfa + oldb * oldb + beta * beta
        normal[it - start] = safe_div(xp, root, xp.sqrt(tnorm2))
        gamma = xp.sqrt(gbar * gbar + beta * beta)
        cs = safe_div(xp, gbar, gamma)
        # gamma = 0: Lanczos stopped (beta = 0) on a singular projection (A v = 0 for a
        # zero A, say). No step reduces the residual: sn = 1 keeps phibar, the estimate,
        # where it is (it read 0, a false convergence, with sn = 0); an exact solve's
        # phibar is already 0 and stays so.
        sn = xp.where(gamma == 0, one, safe_div(xp, beta, gamma))
        phi = cs * phibar
        phibar = sn * phibar
        w1, w2 = w2, w
        w = (v - oldeps * w1 - delta * w2) * safe_div(xp, one, gamma)
        x += phi * w
        hist[it - start] = xp.abs(phibar)
        if callback is not None:
            callback(x)
        if it - start + 1 == every or it == maxiter:
            # sync: reads the residual-estimate history and the flag on the host
            h, broke, k = read_checkpoint(hist, it - start + 1, bad, aim)
            syncs += 1
            if broke:
                return Outcome(x, BREAKDOWN, it, float(h[-1]), INDEFINITE_M, host_syncs=syncs)
            if k is not None and M is None:
                return Outcome(x, CONVERGED, it, float(h[k]), host_syncs=syncs,
                               info={"converged_at": start + k})
            if k is not None:
                # Preconditioned, the recurrence tracks sqrt(r.M r), not ||r||: with
                # M = Jacobi on a diagonal of 600 it reads ||r|| / 24. The true
                # residual decides; short of the tolerance, the estimate's target is
                # lowered by the ratio just seen (with a margin) and the loop goes on.
                rtrue = float(norm(xp, b - matvec(x)))  # sync: the true residual, at a hit only
                syncs += 1
                if rtrue <= tol:
                    return Outcome(x, CONVERGED, it, rtrue, host_syncs=syncs,
                                   info={"converged_at": it}, true_residual=(x, rtrue))
                aim = min(0.5 * aim, 0.9 * tol * float(h[-1]) / rtrue)
            hit = first_below(_backend.to_host(normal[:it - start + 1]), ls_tol) is not None  # sync: a second read at the checkpoint
            if watch is not None and (it - watch[0] >= max(watch[0], LS_WINDOW) or it == maxiter):
                rnorm = float(norm(xp, b - matvec(x)))  # sync: the watch's second true residual
                syncs += 1
                if rnorm >= (1 - LS_PROGRESS) * watch[1] and it - watch[0] >= LS_WINDOW:
                    return Outcome(watch[2], LEAST_SQUARES, it, watch[1], NOT_IN_RANGE,
                                   host_syncs=syncs, info={"least_squares_at": watch[0]})
                if it == maxiter and rnorm > watch[1]:  # hand back the better of the two
                    return Outcome(watch[2], MAXITER, it, watch[1], host_syncs=syncs)
                watch = (it, rnorm, x.copy()) if hit else None
            elif watch is None and hit:
                # sync: the true residual at the hit
                watch = (it, float(norm(xp, b - matvec(x))), x.copy())
                syncs += 1
            if not math.isfinite(float(h[-1])):  # NaN, or an overflowed estimate
                return Outcome(x, BREAKDOWN, it, float(h[-1]), overflow_message("MINRES"),
                               host_syncs=syncs)
            start = it + 1
    return Outcome(x, MAXITER, maxiter, float(_backend.to_host(xp.abs(phibar))), host_syncs=syncs)
