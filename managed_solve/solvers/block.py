"""Block Krylov loops: CG and BiCGStab over an n x k block of right-hand sides sharing A.

One product ``A @ P`` (an SpMM: A read once for all k columns) per matrix
product of the method, and a few fused passes over the block
(:mod:`managed_solve.solvers.block_ops`), instead of k separate loops. Each
column keeps its own scalars (alpha, beta, rho, omega as length-k float64
vectors from column reductions), its own stopping test
``||r_j|| <= max(rtol_j ||b_j||, atol_j)`` (the rule of the single-vector
engines and of the true-residual check that follows), its own iteration
limit, count and status. A column that converges, runs out of iterations or
breaks down stops changing at once (the passes skip it) and is compacted out
of the block at the next checkpoint once enough columns have stopped, so the
SpMM shrinks with the work left; a breakdown in one column does not touch
the others.

The iterates are those of the single-vector engines
(:mod:`managed_solve.kernels.krylov`): preconditioned CG, and right-
preconditioned BiCGStab that stops at the half step as SciPy does.
Checkpoints (host reads of which columns still run) come every iteration on
the host and every :data:`~managed_solve.solvers._common.GPU_CHECK_EVERY`
iterations on a GPU; a column that stops between two checkpoints is frozen
on the device, so reading late costs idle passes, never a wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend
from ._common import SAFE_NORM_RANGE, checkpoint_interval, stable_norm
from .block_ops import NumpyBlockOps, block_ops
from .engine import BREAKDOWN, CONVERGED, MAXITER, Outcome, default_maxiter

METHODS = ("cg", "bicgstab")
RUNNING = -1
#: Blocks every iteration rewrites before reading (not copied when the block is compacted).
SCRATCH = ("Q", "T")
#: Columns solved in one block; a wider (n, k) right-hand side is solved in slices.
MAX_WIDTH = 4096

MESSAGES = {
    "cg": "CG broke down (p.Ap <= 0 or r.z = 0): A may not be symmetric positive definite "
          "(try method='minres' or 'gmres').",
    "bicgstab": "BiCGStab broke down (rho, r~.v or omega vanished); try method='gmres'.",
}


def block_cg(A: Any, B: Any, **kw: Any) -> list[Outcome]:
    """Preconditioned CG on every column of B at once (A symmetric positive definite).

    Parameters: see :func:`block_solve`.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.block import block_cg
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(50, 50)).tocsr()
    >>> B = np.stack([np.ones(50), np.zeros(50), np.arange(50.0)], axis=1)
    >>> outs = block_cg(A, B, rtol=1e-10)
    >>> [o.code for o in outs], [o.iterations for o in outs]
    ([0, 0, 0], [25, 0, 50])
    >>> bool(np.allclose(A @ outs[2].x, B[:, 2]))
    True
    """
    return block_solve("cg", A, B, **kw)


def block_bicgstab(A: Any, B: Any, **kw: Any) -> list[Outcome]:
    """Right-preconditioned BiCGStab on every column of B at once (any nonsingular A).

    Parameters: see :func:`block_solve`.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.block import block_bicgstab
    >>> A = sp.diags([-1.5, 2.5, -0.5], [-1, 0, 1], shape=(40, 40)).tocsr()
    >>> outs = block_bicgstab(A, np.ones((40, 2)), rtol=1e-10)
    >>> [o.code for o in outs], bool(np.allclose(A @ outs[1].x, 1.0))
    ([0, 0], True)
    """
    return block_solve("bicgstab", A, B, **kw)


def block_solve(method: str, A: Any, B: Any, *, X0: Any = None, rtol: Any = 1e-8,
                atol: Any = 0.0, maxiter: Any = None, M: Callable[[Any], Any] | None = None,
                dinv: Any = None, check_every: int | None = None,
                ops: NumpyBlockOps | None = None) -> list[Outcome]:
    """``method`` ("cg" or "bicgstab") on the columns of B together; one Outcome per column.

    Parameters
    ----------
    method : {"cg", "bicgstab"}
    A : sparse matrix or dense array, shape (n, n)
        On B's device (SciPy/NumPy or cupyx/CuPy).
    B : array, shape (n, k)
        The right-hand sides, of A's dtype (float32 or float64).
    X0 : array, shape (n, k), optional
        Initial guesses (zeros by default).
    rtol, atol : float or sequence of k floats
        Column j stops when ``||r_j|| <= max(rtol_j ||b_j||, atol_j)``.
    maxiter : int or sequence of k ints, optional
        Default ``10 n`` (at least 100).
    M : callable, optional
        ``R -> M R`` applied to a block (n, m) at once.
    dinv : array, shape (n,), optional
        The inverse diagonal: Jacobi preconditioning fused into the passes
        (instead of ``M``).
    check_every : int, optional
        Iterations between checkpoints (1 on the host, 8 on a GPU).
    ops : NumpyBlockOps, optional
        The block passes (default: :func:`~managed_solve.solvers.block_ops.block_ops`
        of B's array module); a test runs the GPU's policy on host arrays with it.

    Returns
    -------
    list of Outcome
        ``x`` (n,) of each column, its code (0 converged, 1 iteration
        limit, 2 breakdown), iterations and recurrence residual norm. The
        block's host reads are counted once, on the first column.
    """
    if method not in METHODS:
        raise ValueError(f"block_solve(method={method!r}): expected one of {', '.join(METHODS)}.")
    if M is not None and dinv is not None:
        raise ValueError("block_solve: give M or dinv (the Jacobi scaling), not both.")
    if B.ndim != 2 or B.shape[0] != A.shape[0]:
        raise ValueError(f"block_solve(B): expected shape ({A.shape[0]}, k), got {tuple(B.shape)}.")
    if X0 is not None and tuple(X0.shape) != tuple(B.shape):
        raise ValueError(f"block_solve(X0): expected B's shape {tuple(B.shape)}, got "
                         f"{tuple(X0.shape)}.")
    n, k = int(B.shape[0]), int(B.shape[1])
    rtols = np.broadcast_to(np.asarray(rtol, dtype=np.float64), (k,))
    atols = np.broadcast_to(np.asarray(atol, dtype=np.float64), (k,))
    limit = default_maxiter(n) if maxiter is None else maxiter
    maxiters = np.broadcast_to(np.asarray(limit, dtype=np.int64), (k,))
    outs: list[Outcome] = []
    for lo in range(0, k, MAX_WIDTH):
        hi = min(k, lo + MAX_WIDTH)
        outs += _solve_slice(method, A, B[:, lo:hi], None if X0 is None else X0[:, lo:hi],
                             rtols[lo:hi], atols[lo:hi], maxiters[lo:hi], M, dinv, check_every,
                             ops)
    return outs


# ------------------------------------------------------------------------------ the working block
class _Working:
    """The running columns: their vectors (n x m blocks) and scalars (length m), compacted as they stop.

    ``cols`` maps each working column to its column of B (host); finished
    columns' figures are kept on the host, their x in ``x_out`` (made at the
    first compaction; until then the working X is the answer).
    """

    def __init__(self, ops: NumpyBlockOps, k: int):
        self.ops, self.xp = ops, ops.xp
        self.cols = np.arange(k)
        self.blocks: dict[str, Any] = {}
        self.scalars: dict[str, Any] = {}
        self.x_out: Any = None
        self.iterations = np.zeros(k, dtype=np.int64)
        self.codes = np.full(k, RUNNING, dtype=np.int64)
        self.rr = np.zeros(k)
        self.compactions = 0

    def _record(self, local: np.ndarray) -> None:
        s = self.scalars
        # sync: the stopped columns' figures, read at a checkpoint
        its, codes, rr = (_backend.to_host(s[name]) for name in ("it", "code", "rr"))
        cols = self.cols[local]
        self.iterations[cols] = its[local]
        self.codes[cols] = codes[local]
        self.rr[cols] = rr[local]

    def compact(self, live: np.ndarray) -> None:
        """Keep the running columns (host mask ``live``); record the stopped ones and their x."""
        done, keep = np.flatnonzero(~live), np.flatnonzero(live)
        self._record(done)
        X = self.blocks["X"]
        if self.x_out is None:
            self.x_out = self.ops.copy(X)
        else:
            self._store(X, done)
        keep_d = keep if self.xp is np else self.xp.asarray(keep)
        for name, a in self.blocks.items():
            if name in SCRATCH:  # rewritten before it is read
                self.blocks[name] = self.ops.zeros(a.shape[0], keep.size, a.dtype)
            elif a is not None:
                self.blocks[name] = self.ops.take(a, keep)
        for name, a in self.scalars.items():
            self.scalars[name] = a[keep_d]
        self.cols = self.cols[keep]
        self.compactions += 1

    def _store(self, X: Any, local: np.ndarray) -> None:
        if local.size:
            dst = self.cols[local]
            if self.xp is not np:
                local, dst = self.xp.asarray(local), self.xp.asarray(dst)
            self.x_out[:, dst] = X[:, local]

    def finish(self) -> Any:
        """The (n, k) solution block, every column's figures recorded."""
        everything = np.arange(self.cols.size)
        self._record(everything)
        if self.x_out is None:
            return self.blocks["X"]
        self._store(self.blocks["X"], everything)
        return self.x_out


def _stop(xp: Any, s: dict, bad: Any) -> None:
    """The running columns' status before their next iteration (the single-vector kernels' order).

    Converged first (``rr <= tol^2``), then the iteration limit, then ``bad``
    (a breakdown of the method).
    """
    live = s["live"]
    conv = live & (s["rr"] <= s["tol2"])
    over = live & ~conv & (s["it"] >= s["maxit"])
    broke = live & ~conv & ~over & bad
    s["code"] = xp.where(conv, CONVERGED, xp.where(over, MAXITER,
                                                   xp.where(broke, BREAKDOWN, s["code"])))
    s["live"] = live & ~(conv | over | broke)


def _not_zero(xp: Any, v: Any) -> Any:
    """Where a column scalar is usable as a divisor: finite and nonzero."""
    return xp.isfinite(v) & (v != 0)


# ------------------------------------------------------------------------------ the loops
def _solve_slice(method: str, A: Any, B: Any, X0: Any, rtols: np.ndarray, atols: np.ndarray,
                 maxiters: np.ndarray, M: Any, dinv: Any, check_every: int | None,
                 ops: NumpyBlockOps | None) -> list[Outcome]:
    xp = _backend.array_module(B)
    n, k = int(B.shape[0]), int(B.shape[1])
    if k == 0:
        return []
    ops = ops if ops is not None else block_ops(xp, B)
    dt = np.dtype(B.dtype)
    every = checkpoint_interval(xp, check_every)
    w = _Working(ops, k)
    B = ops.asblock(B, dt)
    everyone = xp.ones(k, dtype=bool)
    # sync: ||b_j|| for the stopping thresholds, once a solve
    bnorm = np.sqrt(_backend.to_host(ops.dots(B, B, None, everyone)[0]))
    lo, hi = SAFE_NORM_RANGE
    for j in np.flatnonzero(~((bnorm > lo) & (bnorm < hi)) & (bnorm != 0)):
        bnorm[j] = stable_norm(xp, ops.column(B, int(j)))  # sync: extreme magnitudes only
    tol = np.maximum(rtols * bnorm, atols)
    zero = np.flatnonzero(bnorm == 0)

    X = ops.zeros(n, k, dt) if X0 is None else ops.copy(ops.asblock(X0, dt))
    if X0 is None:
        R = ops.copy(B)
    else:
        R = ops.asblock(B - ops.matmul(A, X, ops.zeros(n, k, dt)), dt)
    if zero.size:  # b = 0: x = 0 exactly (the single-vector kernels do the same)
        z = zero if xp is np else xp.asarray(zero)
        X[:, z] = 0
        R[:, z] = 0
    live = np.ones(k, dtype=bool)
    live[zero] = False
    s = w.scalars
    s["live"] = xp.asarray(live)
    s["it"] = xp.zeros(k, dtype=np.int64)
    s["code"] = xp.asarray(np.where(live, RUNNING, CONVERGED).astype(np.int64))
    s["tol2"] = xp.asarray(tol * tol)
    s["maxit"] = xp.asarray(np.ascontiguousarray(maxiters))
    s["rr"] = xp.where(s["live"], ops.dots(R, R, None, s["live"])[0], 0.0)
    w.blocks.update(X=X, R=R)
    if method == "cg":
        _cg_start(w, dinv, M)
        step = _cg_step
    else:
        _bicg_start(w, dinv)
        step = _bicg_step

    syncs, checkpoints = 1, 0
    it = 0
    while True:
        if it % every == 0:
            running = _backend.to_host(w.scalars["live"])  # sync: which columns still run
            syncs += 1
            checkpoints += 1
            count = int(running.sum())
            if count == 0:
                break
            if count < running.size and count <= ops.compact_at * running.size:
                w.compact(running)
        step(w, A, M, dinv)
        it += 1
    X = w.finish()
    outs = []
    for j in range(k):
        code = int(w.codes[j])
        code = MAXITER if code == RUNNING else code
        outs.append(Outcome(ops.column(X, j), code, int(w.iterations[j]),
                            math.sqrt(float(w.rr[j])), MESSAGES[method] if code == BREAKDOWN else "",
                            host_syncs=syncs if j == 0 else 0,
                            info={"path": "block", "columns": k, "checkpoints": checkpoints,
                                  "compactions": w.compactions}))
    return outs


def _apply(ops: NumpyBlockOps, M: Any, V: Any) -> Any:
    """``M V`` for a block preconditioner, in the block's layout and dtype."""
    return ops.asblock(M(V), V.dtype)


def _cg_start(w: _Working, dinv: Any, M: Any) -> None:
    ops, xp, s, b = w.ops, w.xp, w.scalars, w.blocks
    R = b["R"]
    if M is not None:
        P = _apply(ops, M, R)
    elif dinv is not None:
        P = ops.asblock(dinv[:, None] * R, R.dtype)
    else:
        P = ops.copy(R)
    s["rz"] = ops.dots(R, P, None, s["live"])[0] if (M is not None or dinv is not None) \
        else s["rr"].copy()
    # Zeros, not empty: the SpMM writes Q with beta = 0, and stale NaN bits must never count.
    b.update(P=P, Q=ops.zeros(*R.shape, R.dtype))
    _stop(xp, s, ~_not_zero(xp, s["rz"]))


def _cg_step(w: _Working, A: Any, M: Any, dinv: Any) -> None:
    ops, xp, s, b = w.ops, w.xp, w.scalars, w.blocks
    X, R, P = b["X"], b["R"], b["P"]
    Q = b["Q"] = ops.matmul(A, P, b["Q"])
    pq = ops.dots(P, Q, None, s["live"])[0]
    ok = s["live"] & (pq > 0)  # not positive (or NaN): A is not positive definite
    s["code"] = xp.where(s["live"] & ~ok, BREAKDOWN, s["code"])
    alpha = xp.where(ok, s["rz"] / xp.where(ok, pq, 1.0), 0.0)
    Z = None
    if M is None:
        rr, rz = ops.update(X, R, P, Q, alpha, ok, second="dinv" if dinv is not None else None,
                            dinv=dinv)
        rz = rr if dinv is None else rz
    else:
        rr = ops.update(X, R, P, Q, alpha, ok)[0]
        Z = _apply(ops, M, R)
        rz = ops.dots(R, Z, None, ok)[0]
    s["live"] = ok
    s["rr"] = xp.where(ok, rr, s["rr"])
    s["it"] = s["it"] + ok
    beta = xp.where(ok, rz / xp.where(ok, s["rz"], 1.0), 0.0)
    _stop(xp, s, ~_not_zero(xp, rz))
    s["rz"] = xp.where(s["live"], rz, s["rz"])
    ops.cg_direction(P, R, dinv if Z is None else None, Z, beta, s["live"])


def _bicg_start(w: _Working, dinv: Any) -> None:
    ops, xp, s, b = w.ops, w.xp, w.scalars, w.blocks
    R = b["R"]
    n, k = R.shape
    b.update(Rt=ops.copy(R), P=ops.zeros(n, k, R.dtype), V=ops.zeros(n, k, R.dtype),
             T=ops.zeros(n, k, R.dtype), Z=ops.zeros(n, k, R.dtype) if dinv is not None else None)
    s["rho"] = s["rr"].copy()  # rt . r with rt = r
    s["rho_prev"] = xp.ones(k)
    s["alpha"] = xp.ones(k)
    s["omega"] = xp.ones(k)
    _stop(xp, s, ~_not_zero(xp, s["rho"]))


def _bicg_step(w: _Working, A: Any, M: Any, dinv: Any) -> None:
    ops, xp, s, b = w.ops, w.xp, w.scalars, w.blocks
    X, R, P, Rt, Z = b["X"], b["R"], b["P"], b["Rt"], b["Z"]
    live = s["live"]
    later = live & (s["it"] > 0)
    beta = xp.where(later, (s["rho"] / xp.where(later, s["rho_prev"], 1.0))
                    * (s["alpha"] / xp.where(later, s["omega"], 1.0)), 0.0)
    ops.bicg_direction(P, R, b["V"], dinv, Z, beta, s["omega"], live)
    phat = Z if dinv is not None else (_apply(ops, M, P) if M is not None else P)
    V = b["V"] = ops.matmul(A, phat, b["V"])
    rv = ops.dots(Rt, V, None, live)[0]
    ok = live & _not_zero(xp, rv)
    s["code"] = xp.where(live & ~ok, BREAKDOWN, s["code"])
    s["alpha"] = xp.where(ok, s["rho"] / xp.where(ok, rv, 1.0), s["alpha"])
    # s = r - alpha v overwrites R; Z becomes s-hat (Jacobi).
    ss = ops.update(X, R, phat, V, s["alpha"], ok, dinv=dinv, Z=Z)[0]
    half = ok & (ss <= s["tol2"])  # converged at the half step (SciPy stops here too)
    live = ok & ~half
    shat = Z if dinv is not None else (_apply(ops, M, R) if M is not None else R)
    T = b["T"] = ops.matmul(A, shat, b["T"])
    tt, ts = ops.dots(T, T, R, live)
    ok2 = live & _not_zero(xp, tt)
    stopped = half | (live & ~ok2)  # both count the half step as an iteration
    s["code"] = xp.where(half, CONVERGED, xp.where(live & ~ok2, BREAKDOWN, s["code"]))
    s["rr"] = xp.where(stopped, ss, s["rr"])
    s["omega"] = xp.where(ok2, ts / xp.where(ok2, tt, 1.0), s["omega"])
    rr, rho = ops.update(X, R, shat, T, s["omega"], ok2, second="rt", Rt=Rt)
    s["it"] = s["it"] + stopped + ok2
    s["rr"] = xp.where(ok2, rr, s["rr"])
    s["rho_prev"] = xp.where(ok2, s["rho"], s["rho_prev"])
    s["rho"] = xp.where(ok2, rho, s["rho"])
    s["live"] = ok2
    _stop(xp, s, ~_not_zero(xp, s["rho"]) | (s["omega"] == 0))

