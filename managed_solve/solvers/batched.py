"""Batched CG and BiCGStab: every system of a :class:`PackedBatch` with its own scalars.

One Krylov core for ``solve`` (a batch of one), ``solve_many`` (many packed
systems) and the sharded solver. Each system ``s`` has its own alpha, beta,
rho (and omega), its own stopping rule ``||r_s|| <= max(rtol_s ||b_s||, atol_s)``
(SciPy's rule), its own ``maxiter`` and status; a finished system stops
changing and stops costing work.

- CPU (``numpy`` batches): Numba kernels in :mod:`managed_solve.kernels.krylov`,
  parallel over systems, or over rows for one large system.
- GPU (``cupy`` batches): fused CUDA kernels in
  :mod:`managed_solve.solvers._cuda_krylov`, scalars and convergence flags kept
  on the device, read by the host only at geometrically spaced checkpoints.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import krylov as _k
from .batch import PackedBatch

CONVERGED, MAXITER, BREAKDOWN = 0, 1, 2

# One system on the CPU: below this many rows the three (CG) or five
# (BiCGStab) thread starts per iteration of the row-parallel layout cost more
# than they save; the serial layout runs instead. Measured on the 2-core
# development machine, 2D Poisson float64 CG, ms per iteration (rows / serial
# / scipy cg): 16k 0.16 / 0.26 / 0.15, 65k 0.35 / 0.84 / 0.77, 1M 6.8 / 15.4 / 13.1.
ROWS_LAYOUT_MIN = 10_000


@dataclass
class BatchOutcome:
    """What a batched solve returns.

    Attributes
    ----------
    x : xp array, shape (n,)
        Packed solutions (``batch.unpack(x)`` gives per-system views).
    iterations : numpy int64 array, shape (nsys,)
    residual_norms : numpy float64 array, shape (nsys,)
        Recurrence residual ``||r_s||`` when system ``s`` stopped.
    status : numpy int8 array, shape (nsys,)
        0 converged, 1 maxiter, 2 breakdown.
    host_syncs : int
        Waits of the host on the GPU with no work queued behind them (GPU:
        0 or 1 a solve, 1 when ``maxiter`` is reached; 0 on the CPU).
    checkpoints : int
        Status reads by the host (GPU; each overlaps queued iterations).
    compactions : int
        Times the kernels' row set shrank to the running systems (GPU).
    gpu_seconds : float or None
        Device time from the solve's first kernel to the checkpoint that saw
        every system finished (CUDA events; None on the CPU). Wall time far
        above it means the host kept the GPU waiting.
    """

    x: Any
    iterations: np.ndarray
    residual_norms: np.ndarray
    status: np.ndarray
    host_syncs: int = 0
    checkpoints: int = 0
    compactions: int = 0
    gpu_seconds: float | None = None

    @property
    def converged(self) -> np.ndarray:
        return self.status == CONVERGED


def _check_first(call: str, first_check: int | None) -> None:
    if first_check is not None and (int(first_check) != first_check or first_check < 1):
        raise ValueError(f"{call}: first_check must be a positive integer or None, got {first_check!r}")


def _check(batch: Any, call: str, check_every: int | None) -> None:
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"{call}: batch must be a PackedBatch, got {type(batch).__name__}; "
                        "build one with PackedBatch.pack(systems) or PackedBatch.from_csr(A, b)")
    if check_every is not None and int(check_every) < 1:
        raise ValueError(f"{call}: check_every must be a positive integer or None, got {check_every!r}")


def cg_batched(batch: PackedBatch, *, check_every: int | None = None,
               first_check: int | None = None) -> BatchOutcome:
    """Conjugate gradients on every system of a batch (SPD systems).

    Parameters
    ----------
    batch : PackedBatch
        On the CPU (NumPy) or a GPU (CuPy); Jacobi preconditioning when
        ``batch.dinv`` is set.
    check_every : int, optional
        GPU only: iterations between checkpoints (copies of the convergence
        flags to the host, read while later iterations stay queued). Default:
        24 (one CUDA graph chunk), 8 for systems of over 1M rows.
    first_check : int, optional
        GPU only: iterations queued before the host's first read, for a
        caller that predicts the iteration count (``solve`` passes the count
        its DeviceManager learned for the same kind of system).

    Returns
    -------
    BatchOutcome
        Status 2 (breakdown) for a system where ``p . A p <= 0`` (A not
        positive definite) or ``r . z == 0``.

    See Also
    --------
    scipy.sparse.linalg.cg : the same iterates, one system at a time.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> from managed_solve.solvers.batch import PackedBatch
    >>> from managed_solve.solvers.batched import cg_batched
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
    >>> batch = PackedBatch.pack([LinearSystem(A, np.ones(5)), LinearSystem(2 * A, np.ones(5))])
    >>> out = cg_batched(batch)
    >>> out.status.tolist(), out.iterations.tolist()
    ([0, 0], [3, 3])
    >>> bool(np.allclose(A @ batch.unpack(out.x)[0], 1.0))
    True
    """
    _check(batch, "cg_batched(batch)", check_every)
    _check_first("cg_batched(batch)", first_check)
    if batch.xp is not np:
        from . import _cuda_krylov

        return BatchOutcome(*_cuda_krylov.solve(batch, "cg", check_every, first_check))
    return _cpu_solve(batch, "cg")


def bicgstab_batched(batch: PackedBatch, *, check_every: int | None = None,
                     first_check: int | None = None) -> BatchOutcome:
    """BiCGStab on every system of a batch (general non-singular systems).

    Parameters and returns as :func:`cg_batched`; status 2 (breakdown) when
    ``rho``, ``r~ . v`` or ``omega`` vanish. A system that converges at the
    half step counts that half step as an iteration (SciPy stops there too).

    See Also
    --------
    scipy.sparse.linalg.bicgstab : the same iterates, one system at a time.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.batch import PackedBatch
    >>> from managed_solve.solvers.batched import bicgstab_batched
    >>> A = sp.diags([-1.5, 2.0, -0.5], [-1, 0, 1], shape=(6, 6), format="csr")
    >>> out = bicgstab_batched(PackedBatch.from_csr(A, np.ones(6), rtol=1e-10))
    >>> int(out.status[0]), bool(np.allclose(A @ out.x, 1.0))
    (0, True)
    """
    _check(batch, "bicgstab_batched(batch)", check_every)
    _check_first("bicgstab_batched(batch)", first_check)
    if batch.xp is not np:
        from . import _cuda_krylov

        return BatchOutcome(*_cuda_krylov.solve(batch, "bicgstab", check_every, first_check))
    return _cpu_solve(batch, "bicgstab")


def _cpu_solve(batch: PackedBatch, method: str) -> BatchOutcome:
    """Allocate the workspace once and run the Numba kernels of the right layout."""
    n, dt, nsys = batch.n, batch.dtype, batch.nsys
    x = batch.x0.copy() if batch.x0 is not None else np.zeros(n, dtype=dt)
    has_x0 = batch.x0 is not None
    jac = batch.dinv is not None
    dinv = batch.dinv if jac else _k.empty_dinv(dt)
    A = (batch.indptr, batch.indices, batch.data)
    its = np.zeros(nsys, dtype=np.int64)
    rr = np.zeros(nsys, dtype=np.float64)
    st = np.zeros(nsys, dtype=np.int8)
    rows = nsys == 1 and n >= ROWS_LAYOUT_MIN
    if method == "cg":
        r, p, q = (np.empty(n, dtype=dt) for _ in range(3))
        z = np.empty(n, dtype=dt) if jac else r
        vecs = (batch.b, x, dinv, r, z, p, q)
        kernel_rows, kernel_sys = _k.cg_rows, _k.cg_systems
    else:
        r, rt, p, v, t = (np.empty(n, dtype=dt) for _ in range(5))
        z = np.empty(n, dtype=dt) if jac else p
        vecs = (batch.b, x, dinv, r, rt, p, v, t, z)
        kernel_rows, kernel_sys = _k.bicgstab_rows, _k.bicgstab_systems
    if rows:
        its[0], rr[0], st[0] = kernel_rows(*A, *vecs, float(batch.rtol[0]), float(batch.atol[0]),
                                           int(batch.maxiter[0]), has_x0)
    else:
        _k.run_systems(kernel_sys, *A, *vecs, batch.offsets, batch.rtol, batch.atol,
                       batch.maxiter, has_x0, its, rr, st)
    return BatchOutcome(x=x, iterations=its, residual_norms=np.sqrt(rr), status=st, host_syncs=0)


# Krylov vectors kept before a restart (as ``solve``'s GMRES).
GMRES_RESTART = 30
# Arnoldi steps between host reads of the new Hessenberg columns (each read
# waits for the device); a system stops at the step its estimate first meets
# its tolerance whatever the spacing, later steps of its cycle are masked out.
GMRES_CHECK_EVERY = 8
# Basis vectors one dot-product kernel launch covers (its per-system partial
# sums live in registers: 8 of them).
GMRES_BLOCK = 8
# GPU: chunks of check_every Arnoldi steps queued beyond the one the host reads.
GMRES_AHEAD = 1
# GPU: a chunk of Arnoldi steps seen in an earlier restart cycle is replayed as
# a CUDA graph (one launch instead of about 14 a step; the host holds the GIL
# for less, and a small system's step is no longer launch-bound).
GMRES_GRAPHS = True


def gmres_batched(batch: PackedBatch, *, restart: int = GMRES_RESTART,
                  check_every: int | None = None) -> BatchOutcome:
    """Restarted GMRES on every system of a batch (any non-singular systems).

    Every system has its own Krylov basis (its rows of the shared basis
    vectors), its own Hessenberg matrix and Givens rotations, its own stopping
    rule, ``maxiter`` (total inner iterations) and status. Each cycle starts
    from the true residual, which also decides the final status, so a system
    never reports convergence its true residual does not show.

    - GPU: the Arnoldi steps run for all systems at once: one SpMV of the
      block-diagonal matrix and segmented products (classical Gram-Schmidt,
      applied twice). Every ``check_every`` steps the host reads the new
      Hessenberg columns and rotates them per system
      (:func:`managed_solve.kernels.krylov.givens_columns`); a system is done
      for the cycle at the step its residual estimate meets its tolerance,
      the cycle ends when every system is, and each system's solution is
      updated with its own number of basis vectors.
    - CPU: the same algorithm per system in Numba
      (:func:`managed_solve.kernels.krylov.gmres_systems`), in parallel over
      systems, each system's vectors in cache.

    Jacobi preconditioning (``batch.dinv``) is applied on the right, so the
    residuals are those of the original systems.

    Parameters
    ----------
    batch : PackedBatch
        On the CPU (NumPy) or a GPU (CuPy).
    restart : int
        Krylov vectors kept before a restart (default 30).
    check_every : int, optional
        GPU: Arnoldi steps between host reads of the Hessenberg columns
        (default 8).

    Returns
    -------
    BatchOutcome
        ``residual_norms`` are true residual norms ``||b_s - A_s x_s||``;
        status 2 (breakdown) when a residual is not finite (NaN or Inf in A,
        b or the preconditioner). ``host_syncs`` counts the host's reads.

    See Also
    --------
    scipy.sparse.linalg.gmres : one system at a time (SciPy counts
        ``maxiter`` in restart cycles; here it counts inner iterations).
    managed_solve.solvers.gmres.gmres : the single-system GMRES.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> rot = sp.csr_matrix(np.array([[0.0, 1.0], [-1.0, 0.0]]))  # BiCGStab breaks down on it
    >>> A = sp.diags([-1.5, 2.5, -0.5], [-1, 0, 1], shape=(40, 40), format="csr")
    >>> from managed_solve.solvers.batch import PackedBatch
    >>> batch = PackedBatch.pack([LinearSystem(rot, np.ones(2)), LinearSystem(A, np.ones(40))])
    >>> from managed_solve.solvers.batched import gmres_batched
    >>> out = gmres_batched(batch)
    >>> out.status.tolist(), out.iterations.tolist()[0]
    ([0, 0], 2)
    >>> x = batch.unpack(out.x)
    >>> bool(np.allclose(rot @ x[0], 1.0)) and bool(np.allclose(A @ x[1], 1.0))
    True
    """
    call = "gmres_batched(batch)"
    _check(batch, call, check_every)
    if isinstance(restart, bool) or not isinstance(restart, (int, np.integer)) or restart < 1:
        raise ValueError(f"{call}: restart must be a positive integer, e.g. 30; got {restart!r}")
    if batch.xp is np and not GMRES_VECTORISED_ON_HOST:
        return _cpu_gmres(batch, int(restart))
    return _Gmres(batch, int(restart), int(check_every or GMRES_CHECK_EVERY)).run()


# The CPU runs one Numba GMRES per system (prange over systems; each system's
# vectors stay in cache). The device path below, whole-batch array operations,
# also runs on NumPy when this is True (tests check it there). On the
# development machine, 40 of W2n's systems: 15.0 s vectorised against about
# 1.3 s for a loop of SciPy's gmres, whose vectors fit in cache.
GMRES_VECTORISED_ON_HOST = False


def _cpu_gmres(batch: PackedBatch, restart: int) -> BatchOutcome:
    n, dt, nsys = batch.n, batch.dtype, batch.nsys
    if nsys == 1 and n >= ROWS_LAYOUT_MIN:
        return _cpu_gmres_one(batch, restart)
    x = batch.x0.copy() if batch.x0 is not None else np.zeros(n, dtype=dt)
    dinv = batch.dinv if batch.dinv is not None else _k.empty_dinv(dt)
    its = np.zeros(nsys, dtype=np.int64)
    res = np.zeros(nsys, dtype=np.float64)
    st = np.zeros(nsys, dtype=np.int8)
    _k.run_systems(_k.gmres_systems, batch.indptr, batch.indices, batch.data, batch.b, x, dinv,
                   batch.offsets, batch.rtol, batch.atol, batch.maxiter, restart,
                   batch.x0 is not None, its, res, st)
    return BatchOutcome(x=x, iterations=its, residual_norms=res, status=st, host_syncs=0)


def _cpu_gmres_one(batch: PackedBatch, restart: int) -> BatchOutcome:
    """One large system on the CPU: the generic GMRES, whose basis products are BLAS calls.

    Same algorithm and iterates as the per-system kernel (shared rotations);
    2-core development machine, upwind N = 65,536: 409 ms against 778 ms.
    """
    import scipy.sparse as sps

    from .gmres import gmres

    A = sps.csr_matrix((batch.data, batch.indices, batch.indptr), shape=(batch.n, batch.n))
    dinv = batch.dinv
    M = (lambda v: dinv * v) if dinv is not None else None
    out = gmres(A, batch.b, x0=batch.x0, rtol=float(batch.rtol[0]), atol=float(batch.atol[0]),
                restart=restart, maxiter=int(batch.maxiter[0]), M=M)
    x = out.x.astype(batch.dtype, copy=False)
    res = float(np.linalg.norm(batch.b - A @ x))  # the true residual, as the kernels report
    code = out.code if np.isfinite(res) else BREAKDOWN
    return BatchOutcome(x=x, iterations=np.array([out.iterations], dtype=np.int64),
                        residual_norms=np.array([res]), status=np.array([code], dtype=np.int8))


class _Gmres:
    """Workspace and loop of one :func:`gmres_batched` call on a device (or, for tests, NumPy).

    The loop (cycles, checkpoints, Givens on the host, coefficients) is
    shared; four primitives differ: the product ``w = A (dinv v)``, the
    per-system dot products with up to GMRES_BLOCK basis vectors, the
    combination ``y += sign sum_a c[a, s] V[a]`` and the scaling of ``w`` into
    the next basis vector. On a GPU they are the fused kernels of
    :mod:`managed_solve.solvers._cuda_krylov` (one pass each, float64 sums,
    no temporaries); on NumPy, array operations. All workspace is allocated
    before the loop.

    Device layouts: the basis ``V`` (restart + 1, n); the Hessenberg columns
    ``H`` (restart, restart + 1, nsys), column j in ``H[j]``, [row][system].
    """

    def __init__(self, batch: PackedBatch, restart: int, every: int):
        from .. import _backend

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
            from . import _cuda_krylov

            dev = int(batch.data.device.id)
            self.k = _cuda_krylov.kernels(dev, dt, batch.index_dtype)
            self.grid = (_cuda_krylov._grid_rows(n, dev),)
            self.block = (_cuda_krylov.THREADS,)
            self.nn, self.nsys32 = np.int64(n), np.int32(ns)
            self.dinv = batch.dinv if self.jac else self.w  # never read without Jacobi
            # Compaction (at a restart): the kernels walk act[:nn], the rows of the
            # systems still running, once those are at most half the rows walked.
            self.act, self.compact = xp.empty(0, dtype=np.int64), np.int32(0)
            # Page-locked landing buffers of the column copies, one per chunk that
            # can be in flight (reused in turn; stream order keeps them apart).
            from .. import _backend as be

            size = every * (m + 1) * ns
            self._pinned_keep: list = []
            self.landing = [be.pinned_empty(size, np.float64, self._pinned_keep)
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

    # -- the four primitives ---------------------------------------------------------
    def _matvec(self, v: Any, w: Any) -> None:
        """``w = A (dinv v)``."""
        b = self.batch
        if self.gpu:
            self.k[f"gmres_spmv{int(self.jac)}"](self.grid, self.block, (
                b.indptr, b.indices, b.data, v, self.dinv, w, self.nn, self.act, self.compact))
        else:
            w[...] = self.A @ (v * b.dinv if self.jac else v)

    def _dots(self, a0: int, k: int, w: Any, out: Any) -> None:
        """``out[a, s] += V[a0 + a] . w`` over system s's rows, for a < k <= GMRES_BLOCK."""
        if self.gpu:
            src = self.V if a0 >= 0 else w  # a0 < 0: w . w
            self.k[f"gmres_dots{int(self.ns == 1)}"](self.grid, self.block, (
                src, np.int64(self.n), w, self.batch.row_sys, out, np.int32(max(a0, 0)),
                np.int32(k), self.nsys32, self.nn, self.act, self.compact))
        else:
            src = self.V[a0: a0 + k] if a0 >= 0 else w[None]
            out[:k] += (self.seg @ (src * w).T).T

    def _combine(self, k: int, coef: Any, y: Any, sign: float, jac: bool) -> None:
        """``y += sign (dinv) sum_{a<k} coef[a, s(i)] V[a, i]``."""
        if k == 0:
            return
        if self.gpu:
            self.k[f"gmres_combine{int(jac)}"](self.grid, self.block, (
                self.V, np.int64(self.n), coef, self.batch.row_sys, self.dinv, y, np.int32(k),
                np.float64(sign), self.nsys32, self.nn, self.act, self.compact))
        else:
            acc = (self.V[:k] * coef[:k][:, self.batch.row_sys]).sum(axis=0)
            y += (sign * acc * self.batch.dinv if jac else sign * acc).astype(self.dt, copy=False)

    def _scale(self, w: Any, norm: Any, v: Any) -> None:
        """``v = w / norm[s(i)]`` (0 where the norm is 0)."""
        if self.gpu:
            self.k["gmres_scale"](self.grid, self.block, (w, v, norm, self.batch.row_sys, self.nn,
                                                          self.act, self.compact))
        else:
            safe = np.where(norm > 0, norm, 1.0)
            v[...] = w * np.where(norm > 0, 1.0 / safe, 0.0)[self.batch.row_sys]

    def _norms(self, v: Any) -> np.ndarray:
        """Per-system ``||v_s||`` on the host (one read)."""
        self.nrm[...] = 0
        self._dots(-1, 1, v, self.nrm)
        self.syncs += 1
        return np.sqrt(np.asarray(self.to_host(self.nrm[0]), dtype=np.float64))  # sync

    def _orthogonalise(self, w: Any, j: int, out: Any) -> None:
        """One classical Gram-Schmidt pass of w against V[:j+1]; coefficients into out[:j+1]."""
        for a in range(0, j + 1, GMRES_BLOCK):
            k = min(GMRES_BLOCK, j + 1 - a)
            self._dots(a, k, w, out[a:])
        self._combine(j + 1, out, w, -1.0, False)

    # -- the loop ----------------------------------------------------------------------
    def run(self) -> BatchOutcome:
        """The solve; on a GPU on a stream of its own (graph capture needs one)."""
        if not self.gpu:
            return self._run()
        from ._cuda_krylov import _retire

        cp = self.xp
        caller = cp.cuda.get_current_stream()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.stream.wait_event(caller.record())  # the batch was written on the caller's stream
        try:
            with self.stream:
                out = self._run()
        finally:
            caller.wait_event(self.stream.record())  # x, for the caller's later work
            # Steps queued past the last read still run: the workspace, graphs and
            # row lists live until they end.
            _retire(self.stream.record(), [self, *self._old])
        return out

    def _launch_chunk(self, lo: int, hi: int) -> None:
        """Arnoldi steps lo..hi-1: directly the first time, then as a replayed CUDA graph."""
        if not (self.gpu and GMRES_GRAPHS):
            for j in range(lo, hi):
                self._step(j)
            return
        key = (lo, hi)
        graph = self.graphs.get(key)
        if graph is None and key in self.seen:
            stream = self.stream
            stream.begin_capture()
            try:
                for j in range(lo, hi):
                    self._step(j)
            finally:
                graph = stream.end_capture()
            self.graphs[key] = graph
        if graph is None:
            self.seen.add(key)
            for j in range(lo, hi):
                self._step(j)
        else:
            graph.launch(self.stream)

    def _run(self) -> BatchOutcome:
        from ..kernels import krylov as _kk

        xp, batch, m, ns = self.xp, self.batch, self.m, self.ns
        V, H, w, b = self.V, self.H, self.w, batch.b
        x = batch.x0.astype(self.dt, copy=True) if batch.x0 is not None else xp.zeros(self.n, self.dt)
        bn = self._norms(b)
        tol = np.maximum(batch.rtol * bn, batch.atol)
        total = np.zeros(ns, dtype=np.int64)
        status = np.full(ns, -1, dtype=np.int8)
        res = np.zeros(ns)
        started = batch.x0 is not None
        checkpoints = 0
        r = V[0]  # the residual is formed in place of the first basis vector
        while True:
            if started:
                self._matvec_plain(x, w)
                xp.subtract(b, w, out=r)
            else:
                r[...] = b
            started = True
            beta = self._norms(r)
            run = status < 0
            res[run] = beta[run]
            status[run & ~np.isfinite(beta)] = BREAKDOWN
            status[(status < 0) & (beta <= tol)] = CONVERGED
            status[(status < 0) & (total >= batch.maxiter)] = MAXITER
            run = status < 0
            if not run.any():
                break
            self._compact(run)
            limit = np.where(run, np.minimum(m, batch.maxiter - total), 0)
            scale = np.where(run & (beta > 0), beta, 0.0)  # a finished system's basis is zero
            self._scale(r, xp.asarray(scale), V[0])
            R = np.zeros((ns, m, m))
            cs, sn = np.zeros((ns, m)), np.zeros((ns, m))
            g = np.zeros((ns, m + 1))
            g[:, 0] = scale
            used = np.where(run, -1, 0)  # basis vectors each system keeps this cycle
            steps = int(limit.max())
            H[...] = 0
            added = 0  # columns the host has rotated
            launched = 0  # Arnoldi steps queued
            pending: deque = deque()  # (first column, end column, host copy) per chunk
            while added < steps:
                # Keep GMRES_AHEAD chunks queued beyond the one the host reads next:
                # the Arnoldi steps do not depend on the rotations.
                while launched < steps and len(pending) <= GMRES_AHEAD:
                    end = min(steps, launched + self.every)
                    self._launch_chunk(launched, end)
                    pending.append((launched, end, self._read_columns(launched, end)))
                    launched = end
                lo, hi, read = pending.popleft()
                cols = read()  # sync: this chunk's Hessenberg columns; later chunks stay queued
                self.syncs += 1
                checkpoints += 1
                est = np.empty((ns, hi - lo))
                _kk.givens_columns(cols, R, cs, sn, g, lo, est)
                for c in range(hi - lo):
                    k = lo + c + 1
                    stop = (used < 0) & ((est[:, c] <= tol) | (k >= limit))
                    used[stop] = k
                added = hi
                if (used >= 0).all():
                    break  # steps still queued run on; they write later columns only
            used[used < 0] = added
            y = np.zeros((ns, m))
            _kk.gmres_coefficients(R, g, used, y)
            kmax = int(used.max())
            if kmax:
                self._combine(kmax, xp.asarray(np.ascontiguousarray(y[:, :kmax].T)), x, 1.0, self.jac)
            total += used
        return BatchOutcome(x=x, iterations=total, residual_norms=res, status=status,
                            host_syncs=self.syncs, checkpoints=checkpoints,
                            compactions=self.compactions)

    def _step(self, j: int) -> None:
        """Arnoldi step j: column j of the Hessenberg matrix into H[j], V[j+1]."""
        xp, V, H, w = self.xp, self.V, self.H, self.w
        self._matvec(V[j], w)
        self._orthogonalise(w, j, H[j])
        self.h2[...] = 0
        self._orthogonalise(w, j, self.h2)  # twice: one classical pass loses orthogonality
        H[j, : j + 1] += self.h2[: j + 1]
        self._dots(-1, 1, w, H[j, j + 1:])
        xp.sqrt(H[j, j + 1], out=H[j, j + 1])
        self._scale(w, H[j, j + 1], V[j + 1])

    def _read_columns(self, lo: int, hi: int) -> Any:
        """Start copying columns lo..hi-1 of H to the host; the returned call waits for them.

        The call gives them as (nsys, restart + 1, hi - lo) float64, C order.
        On a GPU the copy is asynchronous (page-locked buffer, event): the
        host waits for this chunk while later chunks stay queued.
        """
        part = self.H[lo:hi]  # contiguous: whole columns
        if not self.gpu:
            cols = np.ascontiguousarray(part.transpose(2, 1, 0))
            return lambda: cols
        cp = self.xp
        buf = self.landing[self.chunks % len(self.landing)][: part.size]
        self.chunks += 1
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(buf.ctypes.data, part.data.ptr, part.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        done = stream.record()

        def read() -> np.ndarray:
            done.synchronize()
            return np.ascontiguousarray(buf.reshape(part.shape).transpose(2, 1, 0))

        return read

    def _compact(self, run: np.ndarray) -> None:
        """GPU: walk only the running systems' rows from now on, when that halves the rows.

        Finished systems' rows of x, w and the basis are then left alone (the
        matrix is block-diagonal: no running row reads them).
        """
        from . import _cuda_krylov as ck

        if not self.gpu or self.ns == 1 or int(self.nn) < ck.COMPACT_MIN_ROWS:
            return
        sizes = self.batch.sizes
        rows = int(sizes[run].sum())
        if rows > ck.COMPACT_FRACTION * int(self.nn):
            return
        from ..kernels.packing import active_rows

        host = np.empty(rows, dtype=np.int64)
        active_rows(self.batch.offsets[:-1][run].astype(np.int64), sizes[run].astype(np.int64), host)
        # Graphs hold the old row list and count: captured again on the next use.
        self._old += [self.act, *self.graphs.values()]
        self.graphs.clear()
        self.seen.clear()
        self.act = self.xp.asarray(host)
        self.nn, self.compact = np.int64(rows), np.int32(1)
        self.compactions += 1

    def _matvec_plain(self, v: Any, w: Any) -> None:
        """``w = A v`` (the residual's product: no preconditioner)."""
        b = self.batch
        if self.gpu:
            self.k["gmres_spmv0"](self.grid, self.block, (
                b.indptr, b.indices, b.data, v, self.dinv, w, self.nn, self.act, self.compact))
        else:
            w[...] = self.A @ v
