"""Conjugate gradients for symmetric positive definite systems.

A CSR matrix goes through the batched fused core (a batch of one:
:func:`managed_solve.solvers.batched.cg_batched`), the fast path on both the
GPU and the CPU. A dense matrix, an operator, a polynomial or user
preconditioner, or a ``callback`` (which needs every iterate) use the generic
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

_INDEFINITE = (
    "CG met non-positive curvature (p.A p <= 0): A is not positive definite. "
    "Use method='minres' for a symmetric indefinite matrix or method='gmres' for a general one."
)


def cg(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
       maxiter: int | None = None, M: Callable[[Any], Any] | None = None,
       callback: Callable[[Any], None] | None = None,
       check_every: int | None = None) -> Outcome:
    """Preconditioned conjugate gradients, written once for NumPy and CuPy.

    Parameters
    ----------
    A : sparse matrix, dense array or operator with ``matvec``
        Symmetric positive definite, on the same device as ``b``.
    b : array, shape (n,)
    x0 : array, optional
        Initial guess (zeros by default).
    rtol, atol : float
        Converged when ``||r|| <= max(rtol * ||b||, atol)`` (SciPy's rule).
    maxiter : int, optional
        Default ``10 * n`` (at least 100).
    M : callable, optional
        ``r -> M r``, an approximation of ``A^-1`` (SPD).
    callback : callable, optional
        Called as ``callback(xk)`` after every iteration.
    check_every : int, optional
        Iterations between host reads of the residual (1 on NumPy, 8 on CuPy).

    Returns
    -------
    Outcome
        ``code`` 0 converged, 1 iteration limit, 2 breakdown (non-positive
        curvature: A is not SPD).

    See Also
    --------
    scipy.sparse.linalg.cg : the same method and argument names.
    managed_solve.solve : the public entry point (``method="cg"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.cg import cg
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(50, 50)).tocsr()
    >>> out = cg(A, np.ones(50), rtol=1e-10)
    >>> out.code, bool(np.linalg.norm(np.ones(50) - A @ out.x) < 1e-8)
    (0, True)
    """
    st = krylov_setup(A, b, rtol, atol, maxiter, check_every)
    xp, maxiter, every, matvec, tol, syncs = st.xp, st.maxiter, st.every, st.matvec, st.tol, st.host_syncs
    precond = M if M is not None else identity
    x, r = initial_iterate(xp, matvec, b, x0)
    z = precond(r)
    p = z.copy()
    rz = xp.dot(r, z)
    rnorm = norm(xp, r)
    r0 = float(rnorm)  # sync: an initial guess may already solve the system
    syncs += 1
    if r0 <= tol:
        return Outcome(x, CONVERGED, 0, r0, host_syncs=syncs)

    hist = xp.empty(every, dtype=xp.float64)
    bad = xp.zeros((), dtype=bool)
    start = 1
    for it in range(1, maxiter + 1):
        q = matvec(p)
        pq = xp.dot(p, q)
        # Flag negative curvature only while unconverged: past convergence r
        # (and so p) may be exactly 0, which is not a breakdown. An overflowed
        # curvature (-inf) is no evidence either: the residual then stops being
        # finite, and the overflow is reported as such.
        bad = bad | ((pq <= 0) & (rnorm > tol) & xp.isfinite(pq))
        alpha = safe_div(xp, rz, pq)
        x += alpha * p
        r -= alpha * q
        z = precond(r)
        rz_new = xp.dot(r, z)
        beta = safe_div(xp, rz_new, rz)
        p *= beta
        p += z
        rz = rz_new
        rnorm = norm(xp, r)
        hist[it - start] = rnorm
        if callback is not None:
            callback(x)
        if it - start + 1 == every or it == maxiter:
            # sync: reads the residual history and the breakdown flag on the host
            h, broke, k = read_checkpoint(hist, it - start + 1, bad, tol)
            syncs += 1
            if broke:
                return Outcome(x, BREAKDOWN, it, float(h[-1]), _INDEFINITE, host_syncs=syncs)
            if k is not None or not is_finite(h[-1]):
                if k is None:
                    return Outcome(x, BREAKDOWN, it, float(h[-1]), overflow_message("CG"),
                                   host_syncs=syncs)
                return Outcome(x, CONVERGED, it, float(h[k]), host_syncs=syncs,
                               info={"converged_at": start + k})
            start = it + 1
    return Outcome(x, MAXITER, maxiter, float(_backend.to_host(rnorm)), host_syncs=syncs)


def cg_fused(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
             maxiter: int | None = None, jacobi: bool = False,
             check_every: int | None = None, first_check: int | None = None) -> Outcome:
    """CG on a CSR matrix through the batched fused core (a batch of one system).

    The fused loop reads the residual on the host only at its checkpoints and
    calls no per-iteration callback.
    """
    # Function-level import: the batched core imports this package's _common,
    # and is built alongside; importing it here keeps `solvers` importable alone.
    from .batched import PackedBatch, cg_batched

    batch = PackedBatch.from_csr(A, b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter, jacobi=jacobi)
    out = cg_batched(batch, check_every=check_every, first_check=first_check)
    return outcome_from_batch(out, _INDEFINITE, "CG")

