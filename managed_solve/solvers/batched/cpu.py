"""The batched methods on the CPU: serial Numba kernels shared out over host threads.

CG and BiCGStab run the kernels of :mod:`managed_solve.kernels.krylov`: many
systems are claimed one by one (largest first) by the calling thread and
helpers, each solving its systems serially without the GIL; one large
system on a large host sweeps its rows in parallel. GMRES runs one Numba GMRES per
system the same way, or for one large system a loop whose basis products
are BLAS calls (:func:`gmres_one`). All workspace is allocated before the
kernels run.

How many host threads a batch uses, and how they share its systems
(:func:`threads_for`, :func:`row_threads`; ``solve_many``'s input checks
and the host LUs share their kernel calls out through :func:`run_kernels`
and :func:`run_claimed` too):

- Many systems: the calling thread and up to ``threads_for(...) - 1``
  helpers each take the next system (largest predicted work first) and
  solve it with a serial kernel that releases the GIL
  (:func:`run_claimed`). Nothing waits at a barrier while systems iterate:
  a helper the operating system leaves unscheduled (other processes on
  the cores) claims nothing, and the caller solves what it would have. So
  a batch on two threads never takes longer than on one, beyond the one
  system each helper has in hand when the caller runs out of work, and
  systems are claimed largest first, so that tail is the shortest.
- A batch whose predicted work is below the setting
  ``host_parallel_min_work`` (stored entries times predicted iterations,
  about a nanosecond each on one core) stays on the calling thread: a
  helper's wake-up costs tens of microseconds.
- One system: serial sweeps, unless the host has at least
  ``host_row_parallel_min_cores`` cores and the system at least
  ``host_row_parallel_min_rows`` rows. The row-parallel layout ends each
  of its three (CG) or five (BiCGStab) sweeps an iteration at a barrier
  that waits for the slowest thread; on the 2-core development machine,
  with other processes running, two threads took 1.8 to 12 times as long
  per iteration as one, at every size from 10,000 to 1M rows.

No thread count is changed process-wide and BLAS is not called by these
kernels, so they never compete with BLAS threads of their own.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import numba
import numpy as np

from ... import _backend, config
from ...kernels import krylov as _k
from ...system.cost import predict_iterations_array
from ..engine import BREAKDOWN, CONVERGED, MAXITER
from .outcome import BatchOutcome
from .packed import PackedBatch

# GMRES of one system on the CPU: from this many rows its basis products go
# to BLAS (:func:`gmres_one`), below it the per-system kernel runs.
ROWS_LAYOUT_MIN = 10_000


def solve_fused(batch: PackedBatch, method: str) -> BatchOutcome:
    """CG or BiCGStab: allocate the workspace once and run the Numba kernels of the right layout."""
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
    rows = row_threads(n) if nsys == 1 else 1
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
#: A task (one claim) holds systems until their predicted work reaches this
#: fraction of ``host_parallel_min_work``: tiny systems are claimed a few at a
#: time, so a kernel call's dispatch (microseconds) stays a small part of it.
TASK_FRACTION = 0.25


def host_cores() -> int:
    """Threads the host kernels may use: the setting ``host_threads``, else every core allowed.

    Without the setting: the cores this process may run on (its CPU
    affinity), and no more than ``NUMBA_NUM_THREADS`` (a process told to
    keep Numba to fewer threads, one of several on a host, is not
    oversubscribed here either).
    """
    limit = config.current().host_threads
    if limit:
        return max(1, int(limit))
    cores = _backend.cpu_count()
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        cores = min(cores, len(affinity(0)))
    return max(1, min(cores, int(numba.config.NUMBA_NUM_THREADS)))


def threads_for(work: float, tasks: int, *, cores: int | None = None) -> int:
    """Threads for a batch of predicted ``work`` (entries x iterations) split into ``tasks`` claims.

    One below the setting ``host_parallel_min_work`` or with a single task;
    otherwise as many as there are cores (``cores``, default
    :func:`host_cores`) and tasks.

    Examples
    --------
    >>> threads_for(1e9, 40, cores=2), threads_for(1e9, 1, cores=2), threads_for(10.0, 40, cores=2)
    (2, 1, 1)
    """
    cores = host_cores() if cores is None else max(1, int(cores))
    if tasks < 2 or work < config.current().host_parallel_min_work:
        return 1
    return min(cores, tasks)


def row_threads(n: int, *, cores: int | None = None) -> int:
    """Threads for one system's row-parallel sweeps: 1 (serial) unless the host and system are large.

    Examples
    --------
    >>> row_threads(1 << 20, cores=2), row_threads(1 << 20, cores=16), row_threads(10_000, cores=16)
    (1, 16, 1)
    """
    settings = config.current()
    cores = host_cores() if cores is None else max(1, int(cores))
    if cores < settings.host_row_parallel_min_cores or n < settings.host_row_parallel_min_rows:
        return 1
    return cores


def system_work(offsets: np.ndarray, indptr: np.ndarray, rtol: np.ndarray, maxiter: np.ndarray,
                method: str) -> np.ndarray:
    """Predicted work of each system of a host batch: stored entries times predicted iterations."""
    n = np.diff(offsets)
    nnz = np.diff(np.asarray(indptr)[offsets]).astype(np.float64)
    its = predict_iterations_array(n, rtol, method=method, maxiter=maxiter)
    return (nnz + n) * its


def claim_order(work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(systems largest work first, task boundaries in that order) for :func:`run_claimed`.

    A task holds one system, or several small ones until their work reaches
    ``TASK_FRACTION`` of ``host_parallel_min_work``.

    Examples
    --------
    >>> order, bounds = claim_order(np.array([1e3, 1e9, 2e3, 5e8]))
    >>> order.tolist(), bounds.tolist()
    ([1, 3, 2, 0], [0, 1, 2, 4])
    """
    order = np.argsort(-work, kind="stable")
    least = TASK_FRACTION * config.current().host_parallel_min_work
    bounds = [0]
    acc = 0.0
    for k, w in enumerate(work[order].tolist()):
        acc += w
        if acc >= least:
            bounds.append(k + 1)
            acc = 0.0
    if bounds[-1] != len(order):
        bounds.append(len(order))
    return order, np.asarray(bounds, dtype=np.int64)


def run_claimed(task: Callable[[int], None], count: int, threads: int,
                pool: Executor | None = None) -> list[int]:
    """Run ``task(k)`` for every ``k`` in ``range(count)`` on the caller and up to ``threads - 1`` helpers.

    Each participant claims the next ``k`` when it is free; the caller
    works too and then waits only for tasks already claimed. A helper that
    never runs (busy cores) costs nothing but its hand-off, so the call is
    never slower than the caller alone by more than the tasks helpers hold
    when the last one is claimed. ``task`` should release the GIL (a Numba
    ``nogil`` kernel) for the threads to overlap.

    Returns the number of tasks each participant ran, the caller's first.
    The first exception a task raised is raised again after every claimed
    task finished.

    ``pool`` is the executor the helpers are submitted to; by default the
    process-wide ``host-kernels`` pool (:func:`managed_solve._backend.thread_pool`),
    which other callers share, so a helper may wait behind their work.

    Examples
    --------
    >>> seen = []
    >>> sum(run_claimed(seen.append, 5, 2)), sorted(seen)
    (5, [0, 1, 2, 3, 4])
    """
    helpers = max(0, min(int(threads), count) - 1)
    if helpers == 0:
        for k in range(count):
            task(k)
        return [count]
    claims = itertools.count()  # next() is atomic under the GIL
    ran = [0] * (helpers + 1)
    left = [count]
    lock = threading.Lock()
    finished = threading.Event()
    errors: list[BaseException] = []

    def work(slot: int) -> None:
        while True:
            k = next(claims)
            if k >= count:
                return
            try:
                task(k)
            except BaseException as exc:  # noqa: BLE001 - raised again by the caller
                errors.append(exc)
            finally:
                ran[slot] += 1
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        finished.set()

    if pool is None:
        pool = _backend.thread_pool("host-kernels", max(1, _backend.cpu_count() - 1))
    for slot in range(1, helpers + 1):
        pool.submit(work, slot)
    work(0)
    finished.wait()
    if errors:
        raise errors[0]
    return ran


def work_ranges(work: np.ndarray, threads: int, per_thread: int = 4) -> list[tuple[int, int]]:
    """Consecutive ranges of about equal ``work``, about ``per_thread`` per thread.

    Examples
    --------
    >>> work_ranges(np.ones(8), 1), work_ranges(np.ones(8), 2, per_thread=2)
    ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)])
    """
    count = len(work)
    parts = max(1, min(count, per_thread * threads))
    if parts == 1:
        return [(0, count)]
    edges = np.cumsum(work)
    cuts = np.searchsorted(edges, np.linspace(0.0, float(edges[-1]), parts + 1)[1:-1], side="right")
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < count)), count]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def run_kernels(jobs: Sequence[tuple[Any, tuple, np.ndarray]], work: float, count: int,
                per_thread: int = 4) -> int:
    """Run ``kernel(lo, hi, *args)`` over ranges of each job's items, on the caller and helpers.

    ``jobs``: ``(kernel, args, weights)`` with one weight per item of the
    job (its predicted work); each job's items are cut into ranges of about
    equal weight, about ``per_thread`` per thread, claimed by the calling
    thread and the helpers (:func:`run_claimed`). ``work`` (predicted
    nanoseconds, about) and ``count`` (items in all) decide the threads, by
    :func:`threads_for`. The kernels are called here, so the caller hands
    over no callback. Returns the threads used.
    """
    if not count:
        return 0
    threads = threads_for(work, count)
    tasks = [(kernel, lo, hi, args) for kernel, args, weights in jobs
             for lo, hi in work_ranges(weights, threads, per_thread)]

    def task(k: int) -> None:
        kernel, lo, hi, args = tasks[k]
        kernel(lo, hi, *args)

    run_claimed(task, len(tasks), threads)
    return threads


def run_systems(kernel: Any, batch: Any, method: str, args: tuple) -> int:
    """Run a ``*_some`` kernel over every system of a host batch; returns the threads used.

    ``args`` are the kernel's arguments after ``(order, start, stop)``. Tasks
    are claimed largest predicted work first (:func:`claim_order`), over the
    threads :func:`threads_for` grants (:func:`run_claimed`).
    """
    work = system_work(batch.offsets, batch.indptr, batch.rtol, batch.maxiter, method)
    order, bounds = claim_order(work)
    tasks = len(bounds) - 1
    threads = threads_for(float(work.sum()), tasks)
    starts, stops = bounds[:-1].tolist(), bounds[1:].tolist()
    run_claimed(lambda k: kernel(order, starts[k], stops[k], *args), tasks, threads)
    return threads
