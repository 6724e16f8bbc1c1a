"""Preconditioners: Jacobi, a Neumann polynomial, AMG, user operators.

All of them are built once before the solve and applied with ``xp.``
operations and sparse matrix-vector products only, so they run unchanged on
NumPy and CuPy and need no host read when applied. The named ones apply to
a vector (n,) or to a block (n, k) of vectors at once (the block Krylov
loop's preconditioner, :func:`block_preconditioner`). The Neumann polynomial is
a fixed polynomial ``p(D^-1 A) D^-1`` of the Jacobi-scaled matrix: symmetric
when A is, and positive on the spectrum (see :func:`neumann`), so it is
valid for CG.

No Chebyshev polynomial is offered as ``M``: with CG a polynomial in
``D^-1 A`` cannot need fewer matrix-vector products than Jacobi-CG, since CG
is optimal over the same Krylov space (see docs/guide/preconditioners.md and
``benchmarks/bench_polynomial.py``). The Chebyshev recurrence serves as the
AMG smoother (:mod:`managed_solve.solvers.amg.smoothers`), where damping the
upper half of the spectrum is the whole job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import _backend
from ..system.method import check_preconditioner
from ._common import as_matvec, as_preconditioner, refuse_unscalable_diagonal, set_up_call
from .amg import amg


def diagonal(A: Any, *, call: str | None = None) -> Any:
    """The main diagonal of a sparse matrix, dense array or operator with ``diagonal()``.

    ``call``: what an error names; by default the call setting up Jacobi
    (:func:`~managed_solve.solvers._common.set_up_call`).
    """
    if hasattr(A, "diagonal"):
        return A.diagonal()
    call = call or set_up_call("M='jacobi'")
    raise ValueError(
        f"{call}: this preconditioner is built from A's diagonal, but A "
        f"({type(A).__name__}) has no diagonal(); pass M as an operator (an object with "
        "matvec) instead."
    )


def inverse_diagonal(A: Any, *, call: str | None = None) -> Any:
    """``1 / diag(A)`` on A's device; a ValueError names the rows it cannot be taken at.

    A zero entry, and one whose reciprocal is not finite (NaN, infinite, or
    so small that ``1 / d`` overflows: see :func:`refuse_unscalable_diagonal`).
    ``call``: what the error names; by default the call setting up Jacobi
    (:func:`~managed_solve.solvers._common.set_up_call`).

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> from managed_solve.solvers.preconditioners import inverse_diagonal
    >>> inverse_diagonal(sp.diags([2.0, 4.0]).tocsr()).tolist()
    [0.5, 0.25]
    """
    call = call or set_up_call("M='jacobi'")
    return refuse_unscalable_diagonal(diagonal(A, call=call), call)


def check_jacobi_diagonal(A: Any) -> None:
    """Refuse, at set-up, a diagonal that the fused core's Jacobi scaling cannot divide by.

    The fused core scales by the diagonal at each solve; refused here, the
    matrix is refused by the solver's set-up (or its update, which then
    keeps the previous matrix), with :func:`refuse_unscalable_diagonal`'s
    message.
    """
    inverse_diagonal(A)


def scale_rows(d: Any, v: Any) -> Any:
    """``diag(d) v`` for a vector (n,) or a block (n, k)."""
    return d[:, None] * v if v.ndim == 2 else d * v


def jacobi(A: Any) -> Callable[[Any], Any]:
    """``r -> D^-1 r``: the inverse diagonal of A.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.preconditioners import jacobi
    >>> jacobi(sp.diags([2.0, 4.0]).tocsr())(np.ones(2)).tolist()
    [0.5, 0.25]
    """
    dinv = inverse_diagonal(A)
    return lambda r: scale_rows(dinv, r)


def spectral_radius_bound(A: Any, dinv: Any, *, steps: int = 12) -> float:
    """An upper estimate of the largest eigenvalue of ``D^-1 A`` (host float).

    Power iteration (``steps`` SpMVs, one host read at the end) times 1.1 for
    safety, capped by the Gershgorin bound ``max_i sum_j |a_ij / a_ii|`` when
    A's entries are available. Overestimating only costs a little convergence
    speed; any estimate above half the largest eigenvalue keeps
    :func:`neumann` positive definite.
    """
    xp = _backend.array_module(dinv)
    n = dinv.shape[0]
    matvec = as_matvec(A)
    # A start vector with every frequency in it (a constant one is an
    # eigenvector of many PDE matrices away from the boundary).
    v = xp.cos(xp.arange(n, dtype=dinv.dtype) * 1.3) + 1.5
    v /= xp.sqrt(xp.dot(v, v))
    lam = xp.zeros((), dtype=dinv.dtype)
    for _ in range(steps):
        w = dinv * matvec(v)
        lam = xp.sqrt(xp.dot(w, w))
        v = w / xp.where(lam > 0, lam, 1)
    est = 1.1 * float(lam)  # sync: one host read when the preconditioner is built
    gersh = math.inf
    if _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A):
        gersh = float((abs(A) @ xp.ones(n, dtype=dinv.dtype) * abs(dinv)).max())  # sync: once
    elif hasattr(A, "ndim") and getattr(A, "ndim", 0) == 2:
        gersh = float((xp.abs(A).sum(axis=1) * xp.abs(dinv)).max())  # sync: once
    bound = min(est, gersh) if est > 0 else gersh
    if not math.isfinite(bound) or bound <= 0:
        bound = 2.0  # D^-1 A of a diagonally dominant matrix lies in (0, 2]
    return bound


def neumann(A: Any, *, degree: int = 3) -> Callable[[Any], Any]:
    """Truncated Neumann series ``w sum_j (I - w D^-1 A)^j D^-1`` with ``w = 1 / lmax``.

    ``degree`` SpMVs per application. Positive for eigenvalues of ``D^-1 A``
    in ``(0, 2 lmax)``, which holds since ``lmax`` overestimates the largest.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.preconditioners import neumann
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(20, 20)).tocsr()
    >>> bool(np.ones(20) @ neumann(A)(np.ones(20)) > 0)
    True
    """
    if int(degree) < 0:
        raise ValueError(f"neumann(degree={degree!r}): expected an integer >= 0, e.g. 3")
    dinv = inverse_diagonal(A, call=set_up_call("M='neumann'"))
    matvec = as_matvec(A)
    omega = 1.0 / spectral_radius_bound(A, dinv)

    def apply(r: Any) -> Any:
        f = omega * scale_rows(dinv, r)
        z = f.copy()
        for _ in range(int(degree)):  # Horner: z <- f + (I - w D^-1 A) z
            z = f + z - omega * scale_rows(dinv, matvec(z))
        return z

    return apply


def make_preconditioner(M: Any, A: Any) -> Callable[[Any], Any] | None:
    """``r -> M r`` from a name (``"jacobi"``, ``"neumann"``, ``"amg"``), an operator or None.

    ``"amg"`` is a smoothed-aggregation V-cycle (:func:`managed_solve.solvers.amg.amg`),
    symmetric for a symmetric A, so CG may use it. Another name is a
    ValueError naming the alternatives (:func:`managed_solve.system.method.check_preconditioner`).
    """
    if M is None or (isinstance(M, str) and M == "auto"):
        # "auto" is resolved where the device is known (system.method.choose_preconditioner);
        # an engine prepared without that step takes no preconditioner.
        return None
    if isinstance(M, str):
        check_preconditioner(M, "solve")
        if M == "jacobi":
            return jacobi(A)
        if M == "neumann":
            return neumann(A)
        return amg(A)
    shape = getattr(M, "shape", None)
    if shape is not None and tuple(shape) != tuple(A.shape):
        raise ValueError(f"{set_up_call('M=...')}: M has shape {tuple(shape)}, A has "
                         f"{tuple(A.shape)}; M approximates A's inverse and must have A's shape.")
    return as_preconditioner(M)


def block_preconditioner(M: Any, built: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """``R -> M R`` for a block R of shape (n, k), from the option ``M`` and its built form.

    The named preconditioners take blocks as they are; an operator with
    ``matmat`` and a matrix apply to the block in one product; any other
    callable (which may expect a vector) is applied column by column.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.diags([2.0, 4.0]).tocsr()
    >>> M = block_preconditioner("jacobi", make_preconditioner("jacobi", A))
    >>> M(np.ones((2, 3)))[:, 0].tolist()
    [0.5, 0.25]
    >>> by_columns = block_preconditioner(lambda r: r[::-1].copy(), lambda r: r[::-1].copy())
    >>> by_columns(np.arange(4.0).reshape(2, 2)).tolist()
    [[2.0, 3.0], [0.0, 1.0]]
    """
    if built is None:
        return None
    if isinstance(M, str):
        return built
    if hasattr(M, "matmat"):
        return M.matmat
    if hasattr(M, "shape") and hasattr(M, "__matmul__"):
        return lambda R: M @ R

    def by_columns(R: Any) -> Any:
        xp = _backend.array_module(R)
        return xp.stack([built(R[:, j]) for j in range(R.shape[1])], axis=1)

    return by_columns
