"""BiCGStab for general (non-symmetric) systems.

A CSR matrix goes through the batched fused core (a batch of one:
:func:`managed_solve.solvers.batched.bicgstab_batched`). Dense matrices,
operators, polynomial or user preconditioners and callbacks use the generic
implementation below, written once in ``xp.`` operations for NumPy and CuPy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _backend
from ._common import (
    BREAKDOWN,
    CONVERGED,
    MAXITER,
    Outcome,
    identity,
    initial_iterate,
    is_finite,
    krylov_setup,
    norm,
    outcome_from_batch,
    overflow_message,
    read_checkpoint,
    safe_div,
)

_BREAKDOWN = (
    "BiCGStab broke down (a vanishing inner product rho or omega). "
    "Use method='gmres', which cannot break down this way, or add a preconditioner."
)


def bicgstab(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
             maxiter: int | None = None, M: Callable[[Any], Any] | None = None,
             callback: Callable[[Any], None] | None = None,
             check_every: int | None = None) -> Outcome:
    """Preconditioned BiCGStab (van der Vorst), written once for NumPy and CuPy.

    Parameters
    ----------
    A : sparse matrix, dense array or operator with ``matvec``
        Square, on the same device as ``b``.
    b : array, shape (n,)
    x0 : array, optional
    rtol, atol : float
        Converged when ``||r|| <= max(rtol * ||b||, atol)`` (SciPy's rule).
    maxiter : int, optional
        Default ``10 * n`` (at least 100).
    M : callable, optional
        Right preconditioner ``r -> M r``.
    callback : callable, optional
        ``callback(xk)`` after every iteration.
    check_every : int, optional
        Iterations between host reads of the residual (1 on NumPy, 8 on CuPy).
        With 1 the half-step residual ``s`` is also checked, as SciPy does, so
        iteration counts match SciPy's; with more, only full steps are checked.

    Returns
    -------
    Outcome

    See Also
    --------
    scipy.sparse.linalg.bicgstab : the same method and argument names.
    managed_solve.solve : the public entry point (``method="bicgstab"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.bicgstab import bicgstab
    >>> A = sp.diags([-1.5, 2.5, -0.5], [-1, 0, 1], shape=(40, 40)).tocsr()
    >>> out = bicgstab(A, np.ones(40), rtol=1e-10)
    >>> out.code, bool(np.linalg.norm(np.ones(40) - A @ out.x) < 1e-8)
    (0, True)
    """
    st = krylov_setup(A, b, rtol, atol, maxiter, check_every)
    xp, maxiter, every, matvec, tol, syncs = st.xp, st.maxiter, st.every, st.matvec, st.tol, st.host_syncs
    precond = M if M is not None else identity
    x, r = initial_iterate(xp, matvec, b, x0)
    rnorm = norm(xp, r)
    r0 = float(rnorm)  # sync: an initial guess may already solve the system
    syncs += 1
    if r0 <= tol:
        return Outcome(x, CONVERGED, 0, r0, host_syncs=syncs)

    rhat = r.copy()
    p = xp.zeros_like(b)
    v = xp.zeros_like(b)
    one = xp.ones((), dtype=b.dtype)
    rho_prev, alpha, omega = one, one, one
    hist = xp.empty(every, dtype=xp.float64)
    bad = xp.zeros((), dtype=bool)
    start = 1
    for it in range(1, maxiter + 1):
        live = rnorm > tol
        rho = xp.dot(rhat, r)
        bad = bad | ((rho == 0) & live)
        beta = safe_div(xp, rho, rho_prev) * safe_div(xp, alpha, omega)
        p -= omega * v
        p *= beta
        p += r
        phat = precond(p)
        v = matvec(phat)
        rv = xp.dot(rhat, v)
        bad = bad | ((rv == 0) & live)
        alpha = safe_div(xp, rho, rv)
        s = r - alpha * v
        if every == 1:
            snorm = float(norm(xp, s))  # NumPy only (every == 1): a free host read
            if snorm <= tol:
                x += alpha * phat
                if callback is not None:
                    callback(x)
                return Outcome(x, CONVERGED, it, snorm, host_syncs=syncs)
        shat = precond(s)
        t = matvec(shat)
        omega = safe_div(xp, xp.dot(t, s), xp.dot(t, t))
        bad = bad | ((omega == 0) & live & (norm(xp, s) > tol))
        x += alpha * phat
        x += omega * shat
        r = s - omega * t
        rho_prev = rho
        rnorm = norm(xp, r)
        hist[it - start] = rnorm
        if callback is not None:
            callback(x)
        if it - start + 1 == every or it == maxiter:
            # sync: reads the residual history and the breakdown flag on the host
            h, broke, k = read_checkpoint(hist, it - start + 1, bad, tol)
            syncs += 1
            if k is not None:
                return Outcome(x, CONVERGED, it, float(h[k]), host_syncs=syncs,
                               info={"converged_at": start + k})
            if not is_finite(h[-1]):
                return Outcome(x, BREAKDOWN, it, float(h[-1]), overflow_message("BiCGStab"),
                               host_syncs=syncs)
            if broke:
                return Outcome(x, BREAKDOWN, it, float(h[-1]), _BREAKDOWN, host_syncs=syncs)
            start = it + 1
    return Outcome(x, MAXITER, maxiter, float(_backend.to_host(rnorm)), host_syncs=syncs)


def bicgstab_fused(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
                   maxiter: int | None = None, jacobi: bool = False,
                   check_every: int | None = None, first_check: int | None = None) -> Outcome:
    """BiCGStab on a CSR matrix through the batched fused core (a batch of one system)."""
    # Function-level import: see cg.cg_fused.
    from .batched import PackedBatch, bicgstab_batched

    batch = PackedBatch.from_csr(A, b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter, jacobi=jacobi)
    return outcome_from_batch(bicgstab_batched(batch, check_every=check_every, first_check=first_check), _BREAKDOWN,
                              "BiCGStab")
