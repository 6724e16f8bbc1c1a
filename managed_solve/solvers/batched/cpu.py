"""The batched methods on the CPU: serial Numba kernels shared out over host threads.

CG and BiCGStab run the kernels of :mod:`managed_solve.kernels.krylov`: many
systems are claimed one by one (largest first) by the calling thread and
helpers, each solving its systems serially without the GIL; one large
system on a large host sweeps its rows in parallel. GMRES runs one Numba GMRES per
system the same way, or for one large system a loop whose basis products
are BLAS calls (:func:`gmres_one`). All workspace is allocated before the
kernels run.

Host threads: the kernels' systems are claimed in tasks by the calling
thread and helpers, as :mod:`managed_solve._threads` says (how many
threads a batch uses, :func:`~managed_solve._threads.threads_for` and
:func:`~managed_solve._threads.row_threads`; how they claim its systems,
largest first, :func:`~managed_solve._threads.run_ordered`). Here only
the systems' predicted work (:func:`system_work`) and the hand-out of a
``*_some`` kernel over them (:func:`run_systems`).

No thread count is changed process-wide and BLAS is not called by these
kernels, so they never compete with BLAS threads of their own.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ... import _threads
from ...kernels import krylov as _k
from ...system.cost import predict_iterations_array
from ..engine import BREAKDOWN, CONVERGED, MAXITER
from .outcome import BatchOutcome
from .packed import PackedBatch

# GMRES of one system on the CPU: from this many rows its basis products go
# to BLAS (:func:`gmres_one`), below it the per-system kernel runs.
ROWS_LAYOUT_MIN = 10_000


def solve_fused(batch: PackedBatch, method: str, rows: int | None = None) -> BatchOutcome:
    """CG or BiCGStab: allocate the workspace once and run the Numba kernels of the right layout.

    ``rows``: the threads one system's rows are swept on (None: the host's
    rule, :func:`~managed_solve._threads.row_threads`; several systems
    always run one thread each).
    """
    n, dt, nsys = batch.n, batch.dtype, batch.nsys
    x = batch.x0.copy() if batch.x0 is not None else np.zeros(n, dtype=dt)
    has_x0 = batch.x0 is not None
    jac = batch.dinv is not None
    dinv = batch.dinv if jac else _k.empty_dinv(dt)
    A = (batch.indptr, batch.indices, batch.data)
    its = np.zeros(nsys, dtype=np.int64)
    rr = np.zeros(nsys, dtype=np.float64)
    st = np.zeros(nsys, dtype=np.int8)
    true, bb = np.zeros(nsys), np.zeros(nsys)
    rows = 1 if nsys > 1 else _threads.row_threads(n) if rows is None else rows
    if method == "cg":
        r, p, q = (np.empty(n, dtype=dt) for _ in range(3))
        z = np.empty(n, dtype=dt) if jac else r
        vecs = (batch.b, x, dinv, r, z, p, q)
        kernel_rows, kernel_some = _k.cg_rows, _k.cg_some
    else:
        r, rt, p, v, t = (np.empty(n, dtype=dt) for _ in range(5))
        z = np.empty(n, dtype=dt) if jac else p
        vecs = (batch.b, x, dinv, r, rt, p, v, t, z)
        kernel_rows, kernel_some = _k.bicgstab_rows, _k.bicgstab_some
    if rows > 1:
        before = numba.get_num_threads()
        numba.set_num_threads(min(rows, numba.config.NUMBA_NUM_THREADS))  # this thread's launches
        try:
            its[0], rr[0], st[0] = kernel_rows(*A, *vecs, float(batch.rtol[0]),
                                               float(batch.atol[0]), int(batch.maxiter[0]), has_x0)
        finally:
            numba.set_num_threads(before)
        norms = None
    else:
        run_systems(kernel_some, batch, method, (*A, *vecs, batch.offsets, batch.rtol, batch.atol,
                                                 batch.maxiter, has_x0, its, rr, st, true, bb))
        norms = (np.sqrt(true), np.sqrt(bb))
    return BatchOutcome(x=x, iterations=its, residual_norms=np.sqrt(rr), status=st, host_syncs=0,
                        true_norms=norms)


def warm_row_layout(system: Any, method: str) -> None:
    """Compile (or load from Numba's cache) the row-parallel kernels of ``method`` ("cg", "bicgstab").

    ``system`` (a small CSR LinearSystem) is solved with its rows swept on
    two threads, the layout one large system alone takes on a host of many
    cores, so that such a system's first solve does not compile them. A call
    of its own rather than a settings override, which every thread of the
    process would read while it lasted.
    """
    solve_fused(PackedBatch.pack([system], device="cpu"), method, rows=2)


def solve_gmres(batch: PackedBatch, restart: int) -> BatchOutcome:
    """GMRES: one Numba GMRES per system (systems shared out over host threads), or :func:`gmres_one`."""
    n, dt, nsys = batch.n, batch.dtype, batch.nsys
    if nsys == 1 and n >= ROWS_LAYOUT_MIN:
        return _gmres_large(batch, restart)
    x = batch.x0.copy() if batch.x0 is not None else np.zeros(n, dtype=dt)
    dinv = batch.dinv if batch.dinv is not None else _k.empty_dinv(dt)
    its = np.zeros(nsys, dtype=np.int64)
    res = np.zeros(nsys, dtype=np.float64)
    st = np.zeros(nsys, dtype=np.int8)
    true, bb = np.zeros(nsys), np.zeros(nsys)
    run_systems(_k.gmres_some, batch, "gmres",
                (batch.indptr, batch.indices, batch.data, batch.b, x, dinv, batch.offsets,
                 batch.rtol, batch.atol, batch.maxiter, restart, batch.x0 is not None, its, res, st,
                 true, bb))
    return BatchOutcome(x=x, iterations=its, residual_norms=res, status=st, host_syncs=0,
                        true_norms=(np.sqrt(true), np.sqrt(bb)))


def _gmres_large(batch: PackedBatch, restart: int) -> BatchOutcome:
    """One large system: :func:`gmres_one`, whose basis products are BLAS calls."""
    import scipy.sparse as sps

    A = sps.csr_matrix((batch.data, batch.indices, batch.indptr), shape=(batch.n, batch.n))
    x, code, iterations = gmres_one(A, batch.b, x0=batch.x0, rtol=float(batch.rtol[0]),
                                    atol=float(batch.atol[0]), restart=restart,
                                    maxiter=int(batch.maxiter[0]), dinv=batch.dinv)
    x = x.astype(batch.dtype, copy=False)
    res = float(np.linalg.norm(batch.b - A @ x))  # the true residual, as the kernels report
    code = code if np.isfinite(res) else BREAKDOWN
    return BatchOutcome(x=x, iterations=np.array([iterations], dtype=np.int64),
                        residual_norms=np.array([res]), status=np.array([code], dtype=np.int8))


def gmres_one(A: Any, b: np.ndarray, *, x0: np.ndarray | None, rtol: float, atol: float,
              restart: int, maxiter: int, dinv: np.ndarray | None) -> tuple[np.ndarray, int, int]:
    """Restarted GMRES of one system on the host; returns ``(x, status, iterations)``.

    The per-system kernel's algorithm (classical Gram-Schmidt applied twice,
    Givens rotations of :mod:`managed_solve.kernels.krylov`, right Jacobi
    preconditioning with ``dinv``) and the generic
    :func:`managed_solve.solvers.gmres.gmres`'s arithmetic with a host read
    every step: the same iterates, with the basis products as BLAS calls.
    """
    n = b.shape[0]
    tol = max(float(rtol) * float(np.sqrt(np.dot(b, b))), float(atol))
    m = min(int(restart), n)

    def precond(v: np.ndarray) -> np.ndarray:
        return dinv * v if dinv is not None else v

    x = np.zeros_like(b) if x0 is None else x0.astype(b.dtype, copy=True)
    V = np.empty((m + 1, n), dtype=b.dtype)
    H = np.zeros((m + 1, m), dtype=b.dtype)  # columns rounded to b's dtype, as on a device
    one = np.ones((), dtype=b.dtype)
    total = 0
    while True:
        r = b - A @ x if (x0 is not None or total) else b.copy()
        beta = float(np.sqrt(np.dot(r, r)))
        if beta <= tol:
            return x, CONVERGED, total
        if not np.isfinite(beta):
            return x, BREAKDOWN, total
        if total >= maxiter:
            return x, MAXITER, total
        V[0] = r / beta
        H[...] = 0
        R, cs, sn, g = np.zeros((m, m)), np.zeros(m), np.zeros(m), np.zeros(m + 1)
        g[0] = beta
        done_k = None
        steps = min(m, maxiter - total)
        for j in range(steps):
            w = A @ precond(V[j])
            Vj = V[: j + 1]
            h = Vj @ w
            w -= Vj.T @ h
            h2 = Vj @ w  # second pass: classical Gram-Schmidt alone loses orthogonality
            w -= Vj.T @ h2
            h += h2
            hn = np.sqrt(np.dot(w, w))
            nz = hn != 0
            V[j + 1] = w * np.where(nz, one / np.where(nz, hn, 1), 0)
            H[: j + 1, j] = h
            H[j + 1, j] = hn
            est = _k.rotate_column(np.array(H[: j + 2, j], dtype=np.float64), j, R, cs, sn, g)
            if est <= tol:
                done_k = j + 1
                break
        k = done_k if done_k is not None else steps
        total += k
        y = np.zeros(k)
        if k:
            _k.back_substitute(R, g, k, y)
        x += precond(V[:k].T @ y.astype(b.dtype, copy=False))
        if done_k is not None:
            return x, CONVERGED, total
        if total >= maxiter:
            return x, MAXITER, total


# --------------------------------------------------------------------------- host threads
def system_work(offsets: np.ndarray, indptr: np.ndarray, rtol: np.ndarray, maxiter: np.ndarray,
                method: str) -> np.ndarray:
    """Predicted work of each system of a host batch: stored entries times predicted iterations."""
    n = np.diff(offsets)
    nnz = np.diff(np.asarray(indptr)[offsets]).astype(np.float64)
    its = predict_iterations_array(n, rtol, method=method, maxiter=maxiter)
    return (nnz + n) * its


def run_systems(kernel: Any, batch: Any, method: str, args: tuple) -> int:
    """Run a ``*_some`` kernel over every system of a host batch; returns the threads used.

    ``args`` are the kernel's arguments after ``(order, start, stop)``. The
    systems are claimed largest predicted work first
    (:func:`managed_solve._threads.run_ordered`).
    """
    work = system_work(batch.offsets, batch.indptr, batch.rtol, batch.maxiter, method)
    return _threads.run_ordered(kernel, work, args)
