"""Restarted GMRES with Givens rotations, written once for NumPy and CuPy.

The Krylov basis and the matrix-vector work stay on the device; the small
Hessenberg matrix is built on the device too and read by the host only at
checkpoints (every iteration on NumPy, every few on CuPy), where the Givens
rotations turn it into the triangular factor and the residual estimate
``|g[j+1]|``. Rotations on a (restart+1) x restart matrix cost microseconds
on the host, while doing them on a GPU would launch O(restart) tiny kernels
per iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend
from ._common import (
    BREAKDOWN,
    CONVERGED,
    MAXITER,
    Outcome,
    identity,
    krylov_setup,
    norm,
    outcome_from_batch,
    overflow_message,
    safe_div,
)

_NOT_FINITE = ("GMRES produced a non-finite residual; check A, b and M for NaN/Inf "
               "or a singular preconditioner.")


class _Givens:
    """Host-side QR of the Hessenberg matrix, one column at a time (the batched core's kernels)."""

    def __init__(self, m: int, beta: float):
        self.R = np.zeros((m, m))
        self.cs = np.zeros(m)
        self.sn = np.zeros(m)
        self.g = np.zeros(m + 1)
        self.g[0] = beta
        self.k = 0  # columns added

    def add(self, h: np.ndarray) -> float:
        """Add column ``h`` (length k+2); return the residual estimate after it."""
        from ..kernels import krylov as _kk

        est = _kk.rotate_column(np.array(h, dtype=np.float64), self.k, self.R, self.cs, self.sn, self.g)
        self.k += 1
        return float(est)

    def coefficients(self, k: int) -> np.ndarray:
        """Least-squares coefficients y of the first ``k`` basis vectors (zero past a stall)."""
        from ..kernels import krylov as _kk

        y = np.zeros(k)
        if k:
            _kk.back_substitute(self.R, self.g, k, y)
        return y


def gmres(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
          restart: int = 30, maxiter: int | None = None,
          M: Callable[[Any], Any] | None = None,
          callback: Callable[[Any], None] | None = None,
          check_every: int | None = None) -> Outcome:
    """Restarted GMRES(m) with classical Gram-Schmidt (twice) and Givens rotations.

    Parameters
    ----------
    A : sparse matrix, dense array or operator with ``matvec``
    b : array, shape (n,)
    x0 : array, optional
    rtol, atol : float
        Converged when ``||r|| <= max(rtol * ||b||, atol)``. With right
        preconditioning the residual estimate is the true residual's norm.
    restart : int
        Krylov vectors kept before a restart (SciPy's default 20; ours 30).
    maxiter : int, optional
        Total inner iterations (matrix-vector products), default ``10 * n``.
        SciPy counts restart cycles instead.
    M : callable, optional
        Right preconditioner ``v -> M v``.
    callback : callable, optional
        ``callback(xk)`` at the end of each restart cycle (x is only formed
        there), SciPy's ``callback_type="x"``.
    check_every : int, optional
        Inner iterations between host reads (1 on NumPy, 8 on CuPy).

    Returns
    -------
    Outcome

    See Also
    --------
    scipy.sparse.linalg.gmres : the same method (ours orthogonalises with
        classical Gram-Schmidt applied twice: two matrix-vector products with
        the basis instead of j dot products, which suits GPUs).
    managed_solve.solve : the public entry point (``method="gmres"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.gmres import gmres
    >>> A = sp.diags([-1.5, 2.5, -0.5], [-1, 0, 1], shape=(40, 40)).tocsr()
    >>> out = gmres(A, np.ones(40), rtol=1e-10)
    >>> out.code, bool(np.linalg.norm(np.ones(40) - A @ out.x) < 1e-8)
    (0, True)
    """
    if int(restart) < 1:
        raise ValueError(f"gmres(restart={restart!r}): expected a positive integer, e.g. 30")
    st = krylov_setup(A, b, rtol, atol, maxiter, check_every)
    xp, n, maxiter, every, matvec, tol, syncs = (st.xp, st.n, st.maxiter, st.every, st.matvec,
                                                 st.tol, st.host_syncs)
    m = min(int(restart), n)
    precond = M if M is not None else identity
    x = xp.zeros_like(b) if x0 is None else x0.astype(b.dtype, copy=True)
    V = xp.empty((m + 1, n), dtype=b.dtype)
    H = xp.zeros((m + 1, m), dtype=b.dtype)
    total = 0
    last = float("nan")
    while True:
        r = b - matvec(x) if (x0 is not None or total) else b.copy()
        beta = float(norm(xp, r))  # sync: once per restart cycle, the true residual
        syncs += 1
        last = beta
        if beta <= tol:
            return Outcome(x, CONVERGED, total, beta, host_syncs=syncs)
        if not np.isfinite(beta):
            return Outcome(x, BREAKDOWN, total, beta, overflow_message("GMRES"), host_syncs=syncs)
        if total >= maxiter:
            return Outcome(x, MAXITER, total, beta, host_syncs=syncs)
        V[0] = r / beta
        H[...] = 0
        giv = _Givens(m, beta)
        done_k = None
        added = 0
        steps = min(m, maxiter - total)
        for j in range(steps):
            w = matvec(precond(V[j]))
            Vj = V[: j + 1]
            h = Vj @ w
            w -= Vj.T @ h
            h2 = Vj @ w  # second pass: classical Gram-Schmidt alone loses orthogonality
            w -= Vj.T @ h2
            h += h2
            hn = norm(xp, w)
            V[j + 1] = w * safe_div(xp, xp.ones((), dtype=b.dtype), hn)
            H[: j + 1, j] = h
            H[j + 1, j] = hn
            if (j + 1 - added) == every or j == steps - 1:
                # sync: reads the new Hessenberg columns on the host
                Hh = _backend.to_host(H[: j + 2, added: j + 1])
                syncs += 1
                for c in range(Hh.shape[1]):
                    est = giv.add(Hh[: added + c + 2, c])
                    if done_k is None:
                        last = est
                        if est <= tol:
                            done_k = added + c + 1
                added = j + 1
                if done_k is not None:
                    break
        k = done_k if done_k is not None else added
        total += k
        y = xp.asarray(giv.coefficients(k).astype(b.dtype, copy=False))
        x += precond(V[:k].T @ y)
        if callback is not None:
            callback(x)
        if done_k is not None:
            return Outcome(x, CONVERGED, total, float(last), host_syncs=syncs)
        if total >= maxiter:
            return Outcome(x, MAXITER, total, float(last), host_syncs=syncs)


def gmres_fused(A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
                maxiter: int | None = None, jacobi: bool = False, restart: int = 30) -> Outcome:
    """GMRES on a CSR matrix through the batched core (a batch of one system).

    The same algorithm as :func:`gmres` (classical Gram-Schmidt twice, Givens
    rotations on the host, right preconditioning), with the GPU's fused
    kernels and the CPU's Numba kernel; no callback.
    """
    from .batched import PackedBatch, gmres_batched  # see cg_fused

    batch = PackedBatch.from_csr(A, b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter, jacobi=jacobi)
    return outcome_from_batch(gmres_batched(batch, restart=restart), _NOT_FINITE, "GMRES")
