"""Block Krylov loops: CG and BiCGStab over an n x k block of right-hand sides sharing A.

One product ``A @ P`` (an SpMM: A read once for all k columns) per matrix
product of the method, and a few fused passes over the block
(:mod:`managed_solve.solvers.block_ops`), instead of k separate loops. Each
column keeps its own scalars (alpha, beta, rho, omega as length-k float64
vectors from column reductions), its own stopping test
``||r_j|| <= max(rtol_j ||b_j||, atol_j)`` (the rule of the single-vector
engines and of the true-residual check that follows), its own iteration
limit, count and status (:func:`scalar_steps`: elementwise operations on
k-vectors, one kernel each on a GPU). A column that converges, runs out of
iterations or breaks down stops changing at once (the passes skip it) and
is compacted out of the block at the next checkpoint once enough columns
have stopped, so the SpMM shrinks with the work left; a breakdown in one
column does not touch the others.

The iterates are those of the single-vector engines
(:mod:`managed_solve.kernels.krylov`): preconditioned CG, and right-
preconditioned BiCGStab that stops at the half step as SciPy does.
Checkpoints (host reads of which columns still run) come every iteration on
the host and every :data:`~managed_solve.solvers._common.GPU_CHECK_EVERY`
iterations on a GPU; a column that stops between two checkpoints is frozen
on the device, so reading late costs idle passes, never a wrong answer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _backend
from ..system.linear_system import default_maxiter
from ._common import SAFE_NORM_RANGE, checkpoint_interval, stable_norm
from .block_ops import NumpyBlockOps, block_ops
from .engine import BREAKDOWN, CONVERGED, MAXITER, Outcome

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


@functools.cache
def scalar_steps(xp: Any) -> SimpleNamespace:
    """The per-column scalar updates of both loops, as functions of length-k arrays only.

    ``code`` is each column's status (:data:`RUNNING` while it runs); each
    step returns the new status and, where passes follow, the mask of the
    columns still running for them. Every step is a few elementwise
    operations on k-vectors, so on a GPU each compiles to one kernel
    (:meth:`~managed_solve.solvers.block_ops.CupyBlockOps.fuse`). Divisions
    take their divisor through ``where``, so a stopped column's stale
    figures never raise or leak into a running one.
    """
    where, isfinite = xp.where, xp.isfinite

    def usable(v: Any) -> Any:  # finite and nonzero: a divisor
        return isfinite(v) & (v != 0)

    def stop(code: Any, rr: Any, it: Any, tol2: Any, maxit: Any, bad: Any) -> Any:
        # The single-vector kernels' order: converged, then the limit, then a breakdown.
        new = where(rr <= tol2, CONVERGED,
                    where(it >= maxit, MAXITER, where(bad, BREAKDOWN, RUNNING)))
        return where(code < 0, new, code)

    def start(code: Any, rr: Any, it: Any, tol2: Any, maxit: Any, first: Any) -> tuple:
        code = stop(code, rr, it, tol2, maxit, ~usable(first))
        return code, code < 0

    def cg_alpha(code: Any, rz: Any, pq: Any) -> tuple:
        running = code < 0
        ok = running & (pq > 0)  # not positive (or NaN): A is not positive definite
        return where(running & ~ok, BREAKDOWN, code), ok, where(ok, rz / where(ok, pq, 1.0), 0.0)

    def cg_next(code: Any, rr_new: Any, rz_new: Any, rr: Any, rz: Any, it: Any, tol2: Any,
                maxit: Any) -> tuple:
        running = code < 0
        rr = where(running, rr_new, rr)
        it = it + running
        beta = where(running, rz_new / where(running, rz, 1.0), 0.0)
        code = stop(code, rr, it, tol2, maxit, ~usable(rz_new))
        live = code < 0
        return code, live, rr, it, where(live, rz_new, rz), beta

    def bicg_beta(code: Any, it: Any, rho: Any, rho_prev: Any, alpha: Any, omega: Any) -> Any:
        later = (code < 0) & (it > 0)
        return where(later, (rho / where(later, rho_prev, 1.0))
                     * (alpha / where(later, omega, 1.0)), 0.0)

    def bicg_alpha(code: Any, rho: Any, rv: Any, alpha: Any) -> tuple:
        running = code < 0
        ok = running & usable(rv)
        return where(running & ~ok, BREAKDOWN, code), ok, where(ok, rho / where(ok, rv, 1.0), alpha)

    def bicg_half(code: Any, ss: Any, tol2: Any, it: Any, rr: Any) -> tuple:
        half = (code < 0) & (ss <= tol2)  # converged at the half step (SciPy stops here too)
        code = where(half, CONVERGED, code)
        return code, code < 0, it + half, where(half, ss, rr)

    def bicg_omega(code: Any, tt: Any, ts: Any, ss: Any, it: Any, rr: Any, omega: Any) -> tuple:
        running = code < 0
        ok = running & usable(tt)
        broke = running & ~ok  # counts its half step, as the single-vector kernels do
        return (where(broke, BREAKDOWN, code), ok, it + broke, where(broke, ss, rr),
                where(ok, ts / where(ok, tt, 1.0), omega))

    def bicg_next(code: Any, rr_new: Any, rho_new: Any, rr: Any, rho: Any, rho_prev: Any,
                  it: Any, omega: Any, tol2: Any, maxit: Any) -> tuple:
        running = code < 0
        it = it + running
        rr = where(running, rr_new, rr)
        rho_prev = where(running, rho, rho_prev)
        rho = where(running, rho_new, rho)
        code = stop(code, rr, it, tol2, maxit, ~usable(rho) | (omega == 0))
        return code, code < 0, rr, rho, rho_prev, it

    return SimpleNamespace(start=start, cg_alpha=cg_alpha, cg_next=cg_next, bicg_beta=bicg_beta,
                           bicg_alpha=bicg_alpha, bicg_half=bicg_half, bicg_omega=bicg_omega,
                           bicg_next=bicg_next)


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


def _step(w: _Working, name: str) -> Callable[..., Any]:
    """Scalar step ``name``, fused for the block's device."""
    return w.ops.fuse(getattr(scalar_steps(w.xp), name))


def _cg_start(w: _Working, dinv: Any, M: Any) -> None:
    ops, s, b = w.ops, w.scalars, w.blocks
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
    s["code"], s["live"] = _step(w, "start")(s["code"], s["rr"], s["it"], s["tol2"], s["maxit"],
                                             s["rz"])


def _cg_step(w: _Working, A: Any, M: Any, dinv: Any) -> None:
    ops, s, b = w.ops, w.scalars, w.blocks
    X, R, P = b["X"], b["R"], b["P"]
    Q = b["Q"] = ops.matmul(A, P, b["Q"])
    pq = ops.dots(P, Q, None, s["live"])[0]
    s["code"], ok, alpha = _step(w, "cg_alpha")(s["code"], s["rz"], pq)
    Z = None
    if M is None:
        rr, rz = ops.update(X, R, P, Q, alpha, ok, second="dinv" if dinv is not None else None,
                            dinv=dinv)
        rz = rr if dinv is None else rz
    else:
        rr = ops.update(X, R, P, Q, alpha, ok)[0]
        Z = _apply(ops, M, R)
        rz = ops.dots(R, Z, None, ok)[0]
    s["code"], s["live"], s["rr"], s["it"], s["rz"], beta = _step(w, "cg_next")(
        s["code"], rr, rz, s["rr"], s["rz"], s["it"], s["tol2"], s["maxit"])
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
    s["code"], s["live"] = _step(w, "start")(s["code"], s["rr"], s["it"], s["tol2"], s["maxit"],
                                             s["rho"])


def _bicg_step(w: _Working, A: Any, M: Any, dinv: Any) -> None:
    ops, s, b = w.ops, w.scalars, w.blocks
    X, R, P, Rt, Z = b["X"], b["R"], b["P"], b["Rt"], b["Z"]
    beta = _step(w, "bicg_beta")(s["code"], s["it"], s["rho"], s["rho_prev"], s["alpha"],
                                 s["omega"])
    ops.bicg_direction(P, R, b["V"], dinv, Z, beta, s["omega"], s["live"])
    phat = Z if dinv is not None else (_apply(ops, M, P) if M is not None else P)
    V = b["V"] = ops.matmul(A, phat, b["V"])
    rv = ops.dots(Rt, V, None, s["live"])[0]
    s["code"], ok, s["alpha"] = _step(w, "bicg_alpha")(s["code"], s["rho"], rv, s["alpha"])
    # s = r - alpha v overwrites R; Z becomes s-hat (Jacobi).
    ss = ops.update(X, R, phat, V, s["alpha"], ok, dinv=dinv, Z=Z)[0]
    s["code"], live, s["it"], s["rr"] = _step(w, "bicg_half")(s["code"], ss, s["tol2"], s["it"],
                                                              s["rr"])
    shat = Z if dinv is not None else (_apply(ops, M, R) if M is not None else R)
    T = b["T"] = ops.matmul(A, shat, b["T"])
    tt, ts = ops.dots(T, T, R, live)
    s["code"], ok, s["it"], s["rr"], s["omega"] = _step(w, "bicg_omega")(
        s["code"], tt, ts, ss, s["it"], s["rr"], s["omega"])
    rr, rho = ops.update(X, R, shat, T, s["omega"], ok, second="rt", Rt=Rt)
    s["code"], s["live"], s["rr"], s["rho"], s["rho_prev"], s["it"] = _step(w, "bicg_next")(
        s["code"], rr, rho, s["rr"], s["rho"], s["rho_prev"], s["it"], s["omega"], s["tol2"],
        s["maxit"])
