"""The batched solves' workspaces and their memory model, side by side.

Every array a solve allocates is allocated here, before its loop, and
counted here: :func:`workspace_bytes` mirrors the allocations of
:class:`FusedWorkspace` (CG and BiCGStab on a GPU) and
:class:`GmresWorkspace` (GMRES), :func:`array_bytes` those of the packed
batch, and :func:`predict_bytes` adds both and the memory pool's rounding.
A test holds the two together.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ... import _backend, _pinned, config
from . import cuda

# Krylov vectors GMRES keeps before a restart, by default (as ``solve``'s GMRES).
GMRES_RESTART = 30
# GPU: GMRES chunks of check_every Arnoldi steps queued beyond the one the host reads.
GMRES_AHEAD = 1
# Slots of the rotating accumulators (CG 3, BiCGStab 4) and dot products per slot.
CG_SLOTS, BICG_SLOTS = 3, 4
CG_ACCS, BICG_ACCS = 3, 6  # CG: pq, rz, rr.  BiCGStab: rho, rr, rv, ss, tt, ts.

# Work vectors beyond A, b and x0 that each method allocates once per solve
# (x itself is counted separately): CG r, p, q (+ z with Jacobi); BiCGStab
# r, r~, p, v, t (+ z, holding p-hat then s-hat, with Jacobi); GMRES (restart
# GMRES_RESTART) its basis of 31 vectors (the residual lives in the first) and w.
WORK_VECTORS = {"cg": 3, "bicgstab": 5, "gmres": GMRES_RESTART + 1 + 1}
# GMRES per system: its Hessenberg columns on the device (30 x 31 float64), the
# second Gram-Schmidt pass's coefficients (31) and a norm.
GMRES_PER_SYSTEM_BYTES = 8 * (GMRES_RESTART * (GMRES_RESTART + 1) + GMRES_RESTART + 1 + 1)
# Per-system device scalars: rtol, atol, tol^2, maxiter, iterations, status,
# final rr, accumulators (up to 6 dot products x 4 rotating slots), offsets.
PER_SYSTEM_BYTES = 8 * (8 + 6 * 4)
# Per-system device scalars of a batch solved with a block per system:
# rtol, atol, tol^2, b.b, maxiter, offsets, the status buffer (20), the claim
# order (4) and the two true norms (16), rounded up.
BLOCK_PER_SYSTEM_BYTES = 8 * 12
# CuPy's memory pool rounds every allocation up to this many bytes.
POOL_ROUND = 512
# Allocations of one solve at most (each rounded up by the pool).
ARRAYS_PER_SOLVE = 24


def block_route(method: str, nsys: int, max_rows: int | None) -> bool:
    """Whether a GPU batch runs CG with a thread block per system (``cg_blocks.cu``).

    CG on several systems, the largest of at most the setting
    ``batched_block_max_rows`` rows (None: unknown, so no).
    """
    return (method == "cg" and int(nsys) > 1 and max_rows is not None
            and 0 < int(max_rows) <= config.current().batched_block_max_rows)


def workspace_bytes(method: str, n: int, nsys: int, dtype: Any, index_dtype: Any, *,
                    jacobi: bool, max_rows: int | None = None) -> int:
    """Device bytes of one solve's workspace: x, the work vectors, the per-system scalars.

    Counts what :class:`FusedWorkspace` / :class:`GmresWorkspace` allocate
    (``z`` with Jacobi, the compaction row list for several systems).
    ``max_rows``: rows of the batch's largest system, which decides
    whether CG takes a block per system (:func:`block_route`: no
    compaction list, no accumulators).
    """
    if method not in WORK_VECTORS:
        raise ValueError(f"predict_bytes: method={method!r}; expected 'cg', "
                         "'bicgstab' or 'gmres'")
    w = np.dtype(dtype).itemsize
    iw = np.dtype(index_dtype).itemsize
    n, nsys = int(n), int(nsys)
    work = (1 + WORK_VECTORS[method] + (1 if jacobi else 0)) * n * w
    if block_route(method, nsys, max_rows):
        return int(work + nsys * BLOCK_PER_SYSTEM_BYTES)
    work += n * iw if nsys > 1 else 0  # the compaction row list
    scalars = nsys * PER_SYSTEM_BYTES
    if method == "gmres":
        scalars += nsys * GMRES_PER_SYSTEM_BYTES
    return int(work + scalars)


def array_bytes(n: int, nnz: int, dtype: Any, index_dtype: Any = np.int32, *,
                jacobi: bool = True, x0: bool = True) -> int:
    """Device bytes of a packed batch's own arrays (what ``PackedBatch.pack`` allocates).

    The packed CSR, ``b``, ``row_sys`` (int32), and ``x0`` and ``dinv``
    when present.
    """
    w = np.dtype(dtype).itemsize
    iw = np.dtype(index_dtype).itemsize
    n, nnz = int(n), int(nnz)
    nbytes = nnz * (w + iw) + (n + 1) * iw + n * w + 4 * n
    nbytes += n * w if x0 else 0
    nbytes += n * w if jacobi else 0
    return nbytes


def predict_bytes(n: int, nnz: int, nsys: int, dtype: Any, index_dtype: Any = np.int32,
                  method: str = "cg", *, jacobi: bool = True, x0: bool = True,
                  max_rows: int | None = None, residual_check: bool = False) -> int:
    """Upper bound of the device bytes a batch plus one solve's workspace takes.

    Counts the packed CSR, ``b``, ``x0`` (when ``x0``), ``row_sys``,
    ``dinv`` (when ``jacobi``) (:func:`array_bytes`), the solution ``x``,
    the method's work vectors and the per-system scalars
    (:func:`workspace_bytes`; ``max_rows`` as there), and the memory
    pool's 512-byte rounding of each allocation. The planner's model of a
    batch (``solve_many`` reserves this for it, with ``residual_check``:
    a vector's room for the true-residual check after the solve, its sums
    and the scaled recomputation of a system whose sums overflowed, which a
    batch with a block per system does not need, its kernel computing the
    norms).

    Examples
    --------
    >>> from managed_solve.solvers.batched import predict_bytes
    >>> predict_bytes(1000, 5000, 1, "float64", "int32", "cg") > 5000 * 12
    True
    """
    arrays = array_bytes(n, nnz, dtype, index_dtype, jacobi=jacobi, x0=x0)
    check = 0
    if residual_check and not block_route(method, nsys, max_rows):
        check = int(n) * np.dtype(np.float64).itemsize
    return int(arrays + workspace_bytes(method, n, nsys, dtype, index_dtype, jacobi=jacobi,
                                        max_rows=max_rows)
               + check + ARRAYS_PER_SOLVE * POOL_ROUND)


class FusedWorkspace:
    """Device arrays and launch geometry of one fused CG or BiCGStab solve (CuPy batch).

    Everything the loop touches is allocated here; the loop itself is
    :class:`managed_solve.solvers.batched.gpu.FusedSolve`. ``batch`` is set
    to None while a workspace prepared ahead waits for its solve (no
    batch <-> workspace cycle), and ``graph`` holds a CUDA graph of the
    first iterations captured ahead.
    """

    def __init__(self, cp: Any, batch: Any, method: str, dev: int):
        settings = config.current()
        self.cp, self.batch, self.method, self.dev = cp, batch, method, dev
        n, nsys, dt = batch.n, batch.nsys, batch.dtype
        self.n, self.nsys = n, nsys
        # CG's or BiCGStab's module, and the row kernels' grid
        self.k, self.grid = cuda.row_launch(dev, dt, batch.index_dtype, method, n)
        self.single = int(nsys == 1)
        self.jac = int(batch.dinv is not None)
        # A warp per row once rows are long enough to give most lanes work.
        self.vspmv = int(batch.nnz >= settings.batched_vector_min_nnz_per_row * max(n, 1))
        self.sgrid = max(1, math.ceil(nsys / 128))
        cg = method == "cg"
        self.nslot = CG_SLOTS if cg else BICG_SLOTS
        nacc = CG_ACCS if cg else BICG_ACCS
        empty = cp.empty
        self.sizes = np.diff(batch.offsets).astype(np.int64)
        # CG on several small systems: a thread block per system, one launch
        # (gpu.FusedSolve._run_blocks); no accumulators, compaction or graphs.
        self.blocks = block_route(method, nsys, int(self.sizes.max()) if nsys else None)
        if self.blocks:
            nacc = 0
            # Systems in the order blocks claim them (largest first), then the
            # claim counter; the per-system squared norms ||b - A x||, ||b||.
            order = np.empty(nsys + 1, dtype=np.int32)
            order[:nsys] = np.argsort(-self.sizes, kind="stable")
            order[nsys] = 0
            self.order = cp.asarray(order)
            self.norms2 = empty(2 * nsys, dtype=np.float64)
        self.x = empty(n, dtype=dt)
        nvec = 3 if cg else 5
        self.vec = [empty(n, dtype=dt) for _ in range(nvec)]
        self.z = empty(n, dtype=dt) if self.jac else None
        self.acc = cp.zeros(nacc * self.nslot * nsys, dtype=np.float64)
        self.bb = cp.zeros(nsys, dtype=np.float64)
        self.tol2 = empty(nsys, dtype=np.float64)
        self.rtol = cp.asarray(batch.rtol)
        self.atol = cp.asarray(batch.atol)
        self.maxiter = cp.asarray(batch.maxiter.astype(np.int64))
        self.offs = cp.asarray(batch.offsets.astype(np.int64))
        # status (int32), iterations (int64) and final r.r (float64) share one
        # buffer, so a checkpoint is a single device -> host copy.
        self.info = cp.zeros(nsys * 20, dtype=np.uint8)
        self.res2 = self.info[: 8 * nsys].view(np.float64)
        self.iters = self.info[8 * nsys: 16 * nsys].view(np.int64)
        self.status = self.info[16 * nsys:].view(np.int32)
        self.nn = np.int64(n)
        self.ns = np.int32(nsys)
        # Compaction: the iteration kernels walk ``act[:nact]`` (rows of running
        # systems) once most rows belong to finished systems. They read the
        # count and the switch from ``ctl`` on the device, so a compaction
        # is two copies on the stream and the captured graph stays valid.
        self.act = cp.empty(n if nsys > 1 and not self.blocks else 0, dtype=batch.index_dtype)
        self.nact = np.int64(n)
        self.ctl = cp.asarray(np.array([n, 0], dtype=np.int64))  # [rows walked, compacted]
        self.compactions = 0
        self.maxmax = int(batch.maxiter.max()) if nsys else 0
        # Batches of several systems replay graphs at every size: the host then
        # needs the GIL once per graph chunk instead of three launches an iteration.
        self.uses_graph = self.maxmax > 0 and not self.blocks and (
            n <= settings.batched_graph_max_rows or (nsys > 1 and settings.batched_graph_batches))
        self.graph = None  # captured ahead by gpu.prepare()


class GmresWorkspace:
    """Workspace of one :func:`~managed_solve.solvers.batched.gmres.gmres_batched` call.

    On a device (or, for tests, NumPy). Device layouts: the basis ``V``
    (restart + 1, n); the Hessenberg columns ``H`` (restart, restart + 1,
    nsys), column j in ``H[j]``, [row][system]. On a GPU also the compiled
    kernels, the compaction row list and the page-locked landing buffers of
    the column copies; on NumPy the block-diagonal matrix and the segment-sum
    matrix. The loop is :class:`managed_solve.solvers.batched.gmres.BatchedGmres`.
    """

    def __init__(self, batch: Any, restart: int, every: int):
        xp = batch.xp
        self.xp, self.batch, self.every = xp, batch, every
        n, ns, dt = batch.n, batch.nsys, batch.dtype
        self.n, self.ns, self.dt = n, ns, dt
        self.m = m = max(1, min(int(restart), int(batch.sizes.max()) if ns else 1))
        self.to_host = _backend.to_host
        self.gpu = xp is not np
        self.jac = batch.dinv is not None
        self.V = xp.empty((m + 1, n), dtype=dt)
        self.w = xp.empty(n, dtype=dt)
        self.H = xp.zeros((m, m + 1, ns), dtype=np.float64)
        self.h2 = xp.zeros((m + 1, ns), dtype=np.float64)  # the second Gram-Schmidt pass
        self.nrm = xp.zeros((1, ns), dtype=np.float64)
        self.syncs = 0
        self.compactions = 0
        if self.gpu:
            dev = int(batch.data.device.id)
            self.k, grid = cuda.row_launch(dev, dt, batch.index_dtype, "gmres", n)
            self.grid = (grid,)
            self.block = (cuda.THREADS,)
            self.nn, self.nsys32 = np.int64(n), np.int32(ns)
            self.dinv = batch.dinv if self.jac else self.w  # never read without Jacobi
            # Compaction (at a restart): the kernels walk act[:nn], the rows of the
            # systems still running, once those are at most half the rows walked.
            self.act, self.compact = xp.empty(0, dtype=np.int64), np.int32(0)
            # Page-locked landing buffers of the column copies, one per chunk that
            # can be in flight (reused in turn; stream order keeps them apart).
            size = every * (m + 1) * ns
            self._pinned_keep: list = []
            self.landing = [_pinned.pinned_empty(size, np.float64, self._pinned_keep)
                            for _ in range(GMRES_AHEAD + 1)]
            self.chunks = 0
            self.graphs: dict = {}  # (first step, end step) -> captured chunk
            self.seen: set = set()  # chunks launched once directly (kernels loaded)
            self._old: list = []  # graphs and row lists replaced while still queued
        else:
            sps = _backend.sparse_module(xp)
            self.A = sps.csr_matrix((batch.data, batch.indices, batch.indptr), shape=(n, n))
            # Segment sums (per-system dot products) as one sparse product: row s
            # of `seg` holds ones over system s's rows.
            idx = np.int32 if n < 2**31 - 1 else np.int64
            self.seg = sps.csr_matrix((np.ones(n, dtype=dt), np.arange(n, dtype=idx),
                                       batch.offsets.astype(idx)), shape=(ns, n))

    @property
    def nbytes(self) -> int:
        """Bytes of the basis, w, the Hessenberg columns and the per-system sums."""
        return int(sum(a.nbytes for a in (self.V, self.w, self.H, self.h2, self.nrm)))
