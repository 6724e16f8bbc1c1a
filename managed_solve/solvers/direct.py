"""Direct sparse solves: SciPy SuperLU on the CPU, cuDSS or cuSOLVER on a GPU.

A singular matrix is reported as a ``BREAKDOWN`` outcome with a message
naming the fix, never as a crash: SuperLU raises on an exactly zero pivot,
and GPU factorisations return non-finite or wrong solutions, which the final
residual check catches.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .. import _backend
from ._common import BREAKDOWN, CONVERGED, Outcome, norm

log = logging.getLogger("managed_solve")

SINGULAR = (
    "A is singular (or numerically singular): the LU factorisation met a zero pivot or gave a "
    "non-finite solution. Check the boundary conditions (a pure Neumann problem needs one "
    "fixed value), or use method='gmres'/'minres' for a least-squares-like solution."
)

# A direct solve is exact up to rounding; a residual above this multiple of
# eps * (||A|| ||x|| + ||b||) means the factorisation hid a singularity.
_BACKWARD_ERROR_LIMIT = 1e6


def direct(A: Any, b: Any, *, symmetric: bool | None = None) -> Outcome:
    """Solve ``A x = b`` by sparse LU (dense LU for a dense A).

    Parameters
    ----------
    A : sparse CSR matrix or dense array
        On the device of ``b``.
    b : array, shape (n,)
    symmetric : bool, optional
        Structurally and numerically symmetric A: SuperLU then orders columns
        by minimum degree on ``A^T + A`` and prefers diagonal pivots (less
        fill for PDE matrices than COLAMD); cuDSS is told the matrix type.
        On a GPU, cuDSS keeps the analysis of recent matrices: a later solve
        with the same sparsity pattern skips it, one with the same matrix
        only solves (``info["cudss_reused"]``: "none", "plan" or "factors";
        :func:`managed_solve.solvers.release_factorisations` frees them).

    Returns
    -------
    Outcome
        ``code`` 0 solved, 2 singular (``x`` is None then).

    See Also
    --------
    scipy.sparse.linalg.splu : the CPU factorisation used.
    managed_solve.solve : the public entry point (``method="direct"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.direct import direct
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5)).tocsr()
    >>> out = direct(A, np.ones(5), symmetric=True)
    >>> out.code, np.round(out.x, 6).tolist()
    (0, [2.5, 4.0, 4.5, 4.0, 2.5])
    """
    xp = _backend.array_module(b)
    sparse = _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)
    extra: dict = {}
    try:
        if xp is np:
            x, how = (_superlu(A, b, symmetric) if sparse else (_dense_lu(A, b), "numpy.linalg.solve"))
        elif sparse:
            x, how, extra = _gpu_sparse(A, b, symmetric)
        else:
            x, how = _dense_lu(A, b), "cupy.linalg.solve"
    except _Singular as exc:
        return Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
    info = {"factorisation": how, **extra}
    r = b - A @ x
    rn = float(norm(xp, r))  # sync: one host read to check the factorisation
    if not np.isfinite(rn) or not _backward_stable(A, x, b, rn, xp):
        return Outcome(None, BREAKDOWN, 1, rn, SINGULAR, info=info)
    return Outcome(x, CONVERGED, 1, rn, info=info)


class _Singular(Exception):
    pass


def _superlu(A: Any, b: np.ndarray, symmetric: bool | None) -> tuple[np.ndarray, str]:
    import scipy.sparse.linalg as sla

    if symmetric:
        # Minimum degree on A^T + A with diagonal pivoting preferred: the
        # ordering SuperLU recommends for (nearly) symmetric matrices.
        spec, opts = "MMD_AT_PLUS_A", {"SymmetricMode": True, "DiagPivotThresh": 0.01}
    else:
        spec, opts = "COLAMD", {}
    try:
        lu = sla.splu(A.tocsc(), permc_spec=spec, options=opts)
    except RuntimeError as exc:  # "Factor is exactly singular"
        raise _Singular(str(exc)) from exc
    # A numerically singular matrix factors with a pivot at rounding level
    # (a pure Neumann Laplacian gives 4e-16 against 4): no solution to trust.
    piv = np.abs(lu.U.diagonal())
    if piv.min() <= A.shape[0] * np.finfo(lu.U.dtype).eps * piv.max():
        raise _Singular(f"smallest LU pivot {piv.min():.2g} against largest {piv.max():.2g}")
    x = lu.solve(b)
    return x.astype(b.dtype, copy=False), f"SuperLU ({spec})"


def _dense_lu(A: Any, b: Any) -> Any:
    xp = _backend.array_module(b)
    try:
        return xp.linalg.solve(A, b)
    except np.linalg.LinAlgError as exc:
        raise _Singular(str(exc)) from exc
    except Exception as exc:  # cupy's LinAlgError is numpy's; other errors pass on
        if type(exc).__name__ == "LinAlgError":
            raise _Singular(str(exc)) from exc
        raise


def _gpu_sparse(A: Any, b: Any, symmetric: bool | None) -> tuple[Any, str, dict]:
    nvmath = _backend._maybe("nvmath.sparse.advanced")
    if nvmath is not None:
        from . import _cudss

        try:
            x, reused = _cudss.solve(nvmath, A, b, symmetric)
            return x, "cuDSS (nvmath-python)", {"cudss_reused": reused}
        except Exception as exc:  # an unsupported type or version: CuPy's path still works
            log.info("managed_solve: cuDSS through nvmath failed (%s); using cupyx spsolve", exc)
    import cupyx.scipy.sparse.linalg as csla

    try:
        x = csla.spsolve(A, b)
    except Exception as exc:
        if "singular" in str(exc).lower():
            raise _Singular(str(exc)) from exc
        raise
    return x, "cuSOLVER (cupyx spsolve)", {}


def _backward_stable(A: Any, x: Any, b: Any, rn: float, xp: Any) -> bool:
    """False when ``||b - A x||`` is far above rounding: a hidden singularity.

    Two tests: the backward error against ``||A|| ||x|| + ||b||`` (a
    factorisation that went wrong), and the residual against
    ``sqrt(eps) ||b||`` (a singular A solved through a tiny pivot has a small
    backward error only because ``x`` is huge).
    """
    eps = float(np.finfo(np.dtype(b.dtype)).eps)
    b_norm = float(norm(xp, b))  # sync: once
    if rn > np.sqrt(eps) * b_norm:
        return False
    if _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A):
        a_norm = float(abs(A).sum(axis=1).max())  # sync: infinity norm, once
    else:
        a_norm = float(xp.abs(A).sum(axis=1).max())  # sync: infinity norm, once
    scale = a_norm * float(norm(xp, x)) + b_norm  # sync: once
    return rn <= _BACKWARD_ERROR_LIMIT * eps * max(scale, np.finfo(np.float64).tiny) * np.sqrt(b.shape[0])
