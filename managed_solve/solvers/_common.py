"""Shared pieces of the single-system solvers: operators, norms, the stopping rule, outcomes.

Every generic solver (``cg``, ``bicgstab``, ``gmres``, ``minres``) works on
``xp`` arrays through :func:`as_matvec` and returns an :class:`Outcome`;
``solve()`` turns that into a :class:`~managed_solve.result.SolveResult`
after checking the true residual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _backend
from ..system.linear_system import default_maxiter
from .engine import BREAKDOWN as BREAKDOWN
from .engine import CONVERGED as CONVERGED
from .engine import LEAST_SQUARES as LEAST_SQUARES
from .engine import MAXITER as MAXITER
from .engine import NOT_IN_RANGE as NOT_IN_RANGE
from .engine import Outcome as Outcome

# How often a generic solver reads its residual on the host when xp is CuPy:
# each read is a device synchronisation that also drains the launch queue,
# so reading every 8 iterations keeps the loop launch-bound
# instead of sync-bound while overshooting convergence by at most 7 iterations.
GPU_CHECK_EVERY = 8


def checkpoint_interval(xp: Any, requested: int | None = None) -> int:
    """Iterations between host reads of the residual: 1 on NumPy (a read is free)."""
    if requested is not None:
        if int(requested) < 1:
            raise ValueError(f"check_every={requested!r}: expected a positive integer, e.g. 8")
        return int(requested)
    return 1 if xp is np else GPU_CHECK_EVERY


def stop_threshold(rtol: float, atol: float, b_norm: float) -> float:
    """SciPy's rule: converged when ``||r|| <= max(rtol * ||b||, atol)``."""
    return max(float(rtol) * float(b_norm), float(atol))


def norm(xp: Any, v: Any) -> Any:
    """2-norm as a 0-d array on v's device (no host read); see :func:`stable_norm` for extremes."""
    return xp.sqrt(xp.dot(v, v))


#: Inside this range ``sqrt(v . v)`` neither overflows nor loses digits to
#: underflow, whatever the vector's length; outside it the norm is rescaled.
SAFE_NORM_RANGE = (1e-140, 1e140)


def stable_norm(xp: Any, v: Any) -> float:
    """``||v||`` on the host, correct from 1e-300 to 1e300 (scaled as BLAS ``nrm2`` is).

    The plain ``sqrt(v . v)`` overflows to inf past about 1e154 and
    underflows to 0 below about 1e-162; then the vector is scaled by its
    largest entry first (a second pass, only in that case).

    Examples
    --------
    >>> import numpy as np
    >>> v = np.array([3.0, 4.0])
    >>> [float(f"{stable_norm(np, v * s):.12g}") for s in (1e200, 1e-200)]
    [5e+200, 5e-200]
    """
    with np.errstate(over="ignore", under="ignore"):  # extremes are handled below
        # On the host a sum of squares, not BLAS: a BLAS dot of a long vector
        # wakes every BLAS thread of a many-core host, for one read.
        sq = xp.dot(v, v) if xp is not np else np.add.reduce(v * v)
        n = float(xp.sqrt(sq))  # sync: one host read
    lo, hi = SAFE_NORM_RANGE
    if lo < n < hi or v.size == 0:
        return n
    s = float(xp.abs(v).max())  # sync: the rescaling pass, extremes only
    if s == 0.0 or not math.isfinite(s):
        return s
    w = v / s
    return s * float(xp.sqrt(xp.dot(w, w) if xp is not np else np.add.reduce(w * w)))


def column_norms(xp: Any, V: Any) -> np.ndarray:
    """Every column's ``||V[:, j]||`` of an (n, k) block, on the host (float64, k entries).

    One pass over a host block (on a GPU one dot a column) and one host read
    for all k columns, instead of k reads; a column whose norm lies outside
    :data:`SAFE_NORM_RANGE` (overflowed, underflowed, or zero) is measured
    again by :func:`stable_norm`, so every entry is what :func:`stable_norm`
    of that column gives, to rounding.

    Examples
    --------
    >>> import numpy as np
    >>> V = np.array([[3.0, 3e200, 0.0], [4.0, 4e200, 0.0]])
    >>> [float(f"{v:.12g}") for v in column_norms(np, V)]
    [5.0, 5e+200, 0.0]
    """
    with np.errstate(over="ignore", under="ignore"):  # extremes are handled below
        # einsum reads the block once without a temporary of its size; its sums
        # run in float64 (a float32 column of many rows keeps its digits).
        if xp is np:
            sq = np.einsum("ij,ij->j", V, V, dtype=np.float64)
        else:  # a dot a column, read together: no temporary of the block's size on the device
            sq = xp.stack([xp.dot(V[:, j], V[:, j]) for j in range(V.shape[1])])
        norms = np.asarray(_backend.to_host(xp.sqrt(sq)), dtype=np.float64)  # sync: one read
    lo, hi = SAFE_NORM_RANGE
    for j in np.flatnonzero(~((norms > lo) & (norms < hi))):  # extremes or zero columns only
        norms[j] = stable_norm(xp, V[:, j])
    return norms


def power_of_two_scale(amax: float) -> float:
    """1.0 for a magnitude inside :data:`SAFE_NORM_RANGE`, else the power of two nearest it.

    Dividing by a power of two is exact, so a system scaled by it has the
    same solution digits.
    """
    lo, hi = SAFE_NORM_RANGE
    if not math.isfinite(amax) or amax == 0.0 or lo < amax < hi:
        return 1.0
    return 2.0 ** round(math.log2(amax))


def safe_div(xp: Any, num: Any, den: Any) -> Any:
    """``num / den`` where ``den != 0``, else 0, on the device.

    Loops that read the residual only every few iterations keep iterating past
    convergence; when the residual is exactly zero the textbook update divides
    0 by 0. Freezing the update to 0 keeps the iterate instead of turning it
    into NaN.
    """
    nz = den != 0
    return xp.where(nz, num / xp.where(nz, den, 1), 0)


def as_matvec(A: Any) -> Callable[[Any], Any]:
    """``v -> A @ v`` for a sparse matrix, a dense array or an operator with ``matvec``."""
    if hasattr(A, "matvec"):
        return A.matvec
    return lambda v: A @ v


class TransposedOperator:
    """``A^T`` of an operator that has ``rmatvec`` but no ``.T`` (its products swapped)."""

    def __init__(self, A: Any):
        self.A = A
        self.shape = (A.shape[1], A.shape[0])
        self.dtype = getattr(A, "dtype", None)

    def matvec(self, v: Any) -> Any:
        return self.A.rmatvec(v)

    def rmatvec(self, v: Any) -> Any:
        return self.A.matvec(v) if hasattr(self.A, "matvec") else self.A @ v

    def __matmul__(self, v: Any) -> Any:
        return self.matvec(v)

    @property
    def T(self) -> Any:
        return self.A

    H = T


def oriented(kind: str, A: Any, transpose: bool) -> Any:
    """A, or A^T for a transposed solve of a system of ``kind`` (an operator's from rmatvec).

    An operator without rmatvec is returned as it is: its engine refuses
    the transposed solve with the message that names the fix.
    """
    if transpose and kind != "operator":
        return A.T
    return transposed_operator(A) if transpose and hasattr(A, "rmatvec") else A


def transposed_operator(A: Any) -> Any:
    """``A^T`` of an operator: its own ``.T`` (a LinearOperator's), else one made of ``rmatvec``.

    The transpose messages ask users for an operator with ``rmatvec``; an
    object with only that (no ``.T``) is as good for a transposed solve.
    """
    T = getattr(A, "T", None)
    if T is not None:
        return T
    if not hasattr(A, "rmatvec"):
        raise NotImplementedError(
            f"the transposed solve needs A^T; this operator ({type(A).__name__}) has neither .T "
            "nor rmatvec. Give an operator with rmatvec (scipy.sparse.linalg.LinearOperator).")
    return TransposedOperator(A)


def as_preconditioner(M: Any) -> Callable[[Any], Any] | None:
    """``r -> M r`` for an operator (``matvec``), a matrix or a callable; None stays None."""
    if M is None:
        return None
    if hasattr(M, "matvec"):
        return M.matvec
    if hasattr(M, "shape") and hasattr(M, "__matmul__"):
        return lambda v: M @ v
    if callable(M):
        return M
    raise TypeError(
        f"M is a {type(M).__name__}; expected 'jacobi', 'neumann', 'amg', an object with "
        "matvec, a matrix, or a callable r -> M r."
    )


# Who set-up errors name (see set_up_by): the engines are prepared through interfaces that
# carry no call, so the caller that prepares them says who it is around the set-up.
_SET_UP_BY: ContextVar[tuple[str, bool] | None] = ContextVar("managed_solve_set_up_by",
                                                            default=None)


@contextmanager
def set_up_by(who: str, arguments: bool = True) -> Iterator[None]:
    """Set-up errors raised in the block (a preconditioner A cannot have) name ``who``.

    ``arguments``: ``who`` is a function that takes the option, named as
    ``Solver(M='jacobi')``; else the option follows in parentheses, as in
    ``Solver.update(A) (M='jacobi')`` or ``systems[3] (M='jacobi')``. The
    outermost block names them (the call the user made: an update that sets
    up a solver's engines again), and outside any, ``solve``. Per thread
    (a context variable).
    """
    token = _SET_UP_BY.set((who, arguments)) if _SET_UP_BY.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _SET_UP_BY.reset(token)


def set_up_call(option: str) -> str:
    """How a set-up error names its call and the option that asked for the set-up.

    Examples
    --------
    >>> set_up_call("M='jacobi'")
    "solve(M='jacobi')"
    >>> with set_up_by("Solver.update(A)", False):
    ...     set_up_call("M='jacobi'")
    "Solver.update(A) (M='jacobi')"
    """
    who, arguments = _SET_UP_BY.get() or ("solve", True)
    return f"{who}({option})" if arguments else f"{who} ({option})"


def refuse_unscalable_diagonal(d: Any, call: str,
                               instead: str = "M=None or a user operator") -> Any:
    """``1 / d`` for Jacobi, or a ValueError naming ``call``, the rows and the fix.

    ``instead``: the preconditioners the caller could take instead (the
    fix names them).

    Refused: a zero entry, and one whose reciprocal is not finite: NaN or
    infinite (an operator's ``diagonal()``; a matrix with one is refused
    before), or so small that ``1 / d`` overflows (below about 5.6e-309 in
    float64, 2.9e-39 in float32). The scaling would otherwise carry inf or
    NaN into the first iteration, which reads as a breakdown of the method
    or an overflow of x0 instead. A GPU may flush a float32 subnormal to
    zero: it is refused alike, as a zero or by its reciprocal.

    Examples
    --------
    >>> import numpy as np
    >>> refuse_unscalable_diagonal(np.array([2.0, 4.0]), "solve(M='jacobi')").tolist()
    [0.5, 0.25]
    >>> refuse_unscalable_diagonal(np.array([2.0, 1e-320]), "solve(M='jacobi')")
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: solve(M='jacobi'): ... (rows [1]; A[1, 1] = 1e-320, whose reciprocal overflows ...
    """
    xp = _backend.array_module(d)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = 1.0 / d
    bad = (d == 0) | ~(xp.isfinite(d) & xp.isfinite(inv))
    if not bool(bad.any()):  # sync: one host read when the preconditioner is built
        return inv
    rows = _backend.to_host(xp.flatnonzero(bad)[:5]).tolist()
    count = int(bad.sum())  # sync: the error's count, once
    first = rows[0]
    value = float(d[first])  # sync: as above
    why = ("zero" if value == 0 else "not a number" if value != value else
           "infinite" if math.isinf(value) else f"whose reciprocal overflows {np.dtype(d.dtype)}")
    raise ValueError(
        f"{call}: Jacobi scaling divides by A's diagonal, so it needs a non-zero diagonal with "
        f"finite reciprocals, but A has {count} diagonal entr{'y' if count == 1 else 'ies'} it "
        f"cannot divide by (rows {rows}{', ...' if count > 5 else ''}; A[{first}, {first}] = "
        f"{value:.3g}, {why}). Use {instead}, or reorder or scale the system so "
        "that its diagonal is finite and well away from zero."
    )


def true_residual_norm(A: Any, b: Any, x: Any) -> float:
    """``||b - A x||`` computed from scratch (not the recurrence), read on the host.

    A float32 system held as a matrix (sparse or dense) is measured in
    float64 (:func:`wide_residual`): in float32 the products' rounding,
    about 6e-8 of ``||A|| ||x||``, would hide a residual below it, or read
    one above it as 0, and a tolerance float32 cannot meet would pass.
    """
    xp = _backend.array_module(b, x)
    if b.dtype == np.float32 and not hasattr(A, "matvec") and getattr(A, "ndim", 0) == 2:
        return stable_norm(xp, wide_residual(A, b, x, xp))  # sync: one host read per solve
    r = b - as_matvec(A)(x)
    return stable_norm(xp, r)  # sync: one host read per solve


#: Stored entries :func:`wide_residual` widens to float64 at a time (a 32 MiB
#: copy at most, beside a matrix that may fill most of a device).
WIDE_RESIDUAL_ENTRIES = 1 << 22


def wide_residual(A: Any, b: Any, x: Any, xp: Any) -> Any:
    """``b - A x`` in float64 for a float32 matrix (``b`` and ``x`` vectors or blocks of columns).

    Each product of two float32 values is exact in float64, so the result
    is right to float64's rounding. The matrix is widened a slice of at
    most :data:`WIDE_RESIDUAL_ENTRIES` entries at a time, never whole: row
    blocks of a CSR or dense matrix, column blocks of a CSC one (a CSR
    matrix's transpose).
    """
    x64 = x.astype(np.float64)
    r = b.astype(np.float64)
    n, m = A.shape
    sparse = _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)
    if sparse and A.format not in ("csr", "csc"):
        A = A.tocsr()
    by_cols = sparse and A.format == "csc"
    lines = m if by_cols else n  # the rows of a CSR or dense matrix, the columns of a CSC one
    nnz = int(A.nnz) if sparse else n * m
    step = max(1, WIDE_RESIDUAL_ENTRIES * lines // max(nnz, 1))
    if sparse:
        cls = type(A)
        ptr = A.indptr
        cuts = ptr[::step]
        cuts = (cuts if xp is np else cuts.get()).tolist() + [nnz]  # sync: the slices' bounds
    for k, a in enumerate(range(0, lines, step)):
        z = min(lines, a + step)
        if not sparse:
            r[a:z] -= A[a:z].astype(np.float64) @ x64
            continue
        p0, p1 = int(cuts[k]), int(cuts[k + 1])
        part = (A.data[p0:p1].astype(np.float64), A.indices[p0:p1], ptr[a:z + 1] - p0)
        if by_cols:
            r -= cls(part, shape=(n, z - a)) @ x64[a:z]
        else:
            r[a:z] -= cls(part, shape=(z - a, m)) @ x64
    return r


#: ``Outcome.info`` key of a solve that left its initial guess for x = 0
#: (:func:`hopeless_start`); the value is the guess's residual norm.
DROPPED_START = "dropped_start"
#: ``Outcome.info`` key of a failed solve whose initial guess was hopeless but
#: whose iteration limit left no room to start again from x = 0.
HOPELESS_START = "hopeless_start"


def hopeless_start(r0: float, b_norm: float, tol: float, dtype: Any) -> bool:
    """Whether a guess whose residual ``||b - A x0||`` is ``r0`` is worse than none and out of reach.

    Two facts together: ``r0 > ||b||``, so x = 0 (whose residual is ``b``)
    starts closer; and ``eps * r0 > tol``, so a Krylov recurrence from the
    guess cannot resolve the tolerance (its residual carries the rounding of
    the first one, about ``eps * r0``, and drifts from the true residual by
    that much, while ``x0 + d`` loses the solution's digits to cancellation).
    A residual that is not finite (``A x0`` overflows) is hopeless too: no
    iteration can start from it. Only such a guess, one that could not
    have led to the tolerance, is replaced by x = 0.

    Examples
    --------
    >>> import numpy as np
    >>> hopeless_start(1e301, 8.0, 8e-8, np.float64), hopeless_start(float("inf"), 8.0, 8e-8, np.float64)
    (True, True)
    >>> hopeless_start(4.0, 8.0, 8e-8, np.float64), hopeless_start(1e3, 8.0, 8e-8, np.float64)
    (False, False)
    """
    return not (r0 <= b_norm or float(np.finfo(dtype).eps) * r0 <= tol)


def start_residual_norm(A: Any, b: Any, x0: Any) -> float:
    """``||b - A x0||`` on the host, inf where the product overflows (a hopeless start, not an error)."""
    xp = _backend.array_module(b)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the answer here
        return stable_norm(xp, b - as_matvec(A)(x0))  # sync: one read, after a failed solve only


def overflow_message(method: str) -> str:
    """The breakdown message of a residual that became NaN or Inf: an overflow, not a property of A.

    With finite A, b and x0 (what ``solve`` accepts), a residual stops being
    finite only where a product or an inner product leaves the float range;
    that says nothing about definiteness or singularity, so the message names
    the overflow and its usual cause instead of a curvature.
    """
    return (f"{method} overflowed: its residual became NaN or Inf, which with finite A, b and x0 "
            "means a value beyond the float range (not a sign that A is indefinite or "
            "singular). The usual cause is an x0 or b many orders of magnitude from the "
            "solution's scale: drop x0 (x0=None), or scale x0 and b toward the solution's size.")


def initial_iterate(xp: Any, matvec: Callable[[Any], Any], b: Any, x0: Any) -> tuple[Any, Any]:
    """``(x, r)``: a copy of ``x0`` in b's dtype (zeros if None) and its residual ``b - A x``."""
    if x0 is None:
        return xp.zeros_like(b), b.copy()
    x = x0.astype(b.dtype, copy=True)
    return x, b - matvec(x)


@dataclass
class KrylovSetup:
    """What every generic Krylov loop derives from its arguments before iterating."""

    xp: Any
    n: int
    maxiter: int
    every: int
    matvec: Callable[[Any], Any]
    tol: float
    host_syncs: int


def krylov_setup(A: Any, b: Any, rtol: float, atol: float, maxiter: int | None,
                 check_every: int | None) -> KrylovSetup:
    """The array module, iteration limit, checkpoint interval, operator and stopping threshold.

    Reads ``||b||`` on the host once (counted in ``host_syncs``).
    """
    xp = _backend.array_module(b)
    n = b.shape[0]
    maxiter = default_maxiter(n) if maxiter is None else int(maxiter)
    every = checkpoint_interval(xp, check_every)
    matvec = as_matvec(A)
    b_norm = stable_norm(xp, b)  # sync: the stopping threshold needs ||b|| once
    return KrylovSetup(xp, n, maxiter, every, matvec, stop_threshold(rtol, atol, b_norm), 1)


def identity(v: Any) -> Any:
    """The preconditioner of an unpreconditioned solve."""
    return v


def read_checkpoint(history: Any, count: int, flag: Any, tol: float) -> tuple[Any, bool, int | None]:
    """The host copy of the last ``count`` residual norms, the breakdown flag, the first converged one.

    Called at a loop's checkpoint; the caller counts it as one host synchronisation.
    """
    h = _backend.to_host(history[:count])  # sync: the residual history, read by the caller's loop
    broke = bool(flag)  # sync: the breakdown flag, in the same checkpoint
    return h, broke, first_below(h, tol)


def is_finite(v: float) -> bool:
    """A host float that is neither NaN nor infinite."""
    return v == v and abs(v) != float("inf")


def first_below(history: Any, tol: float) -> int | None:
    """Index of the first entry of a host array at or below ``tol`` (None if none)."""
    hits = np.flatnonzero(np.asarray(history) <= tol)
    return int(hits[0]) if hits.size else None


def outcome_from_batch(out: Any, breakdown_message: str, method: str) -> Outcome:
    """An :class:`Outcome` from the batched core's ``BatchOutcome`` of one system.

    A breakdown with a residual that is not finite is an overflow
    (:func:`overflow_message`), whatever ``breakdown_message`` says of the
    method's own breakdowns.
    """
    code = int(out.status[0])
    msg = "" if code != BREAKDOWN else breakdown_message if is_finite(
        float(out.residual_norms[0])) else overflow_message(method)
    return Outcome(out.x, code, int(out.iterations[0]), float(out.residual_norms[0]), msg,
                   host_syncs=int(out.host_syncs),
                   info={"path": "batched", "checkpoints": int(out.checkpoints),
                         "gpu_seconds": out.gpu_seconds})

