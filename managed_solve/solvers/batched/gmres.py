"""Batched restarted GMRES: every system its own Krylov basis, Hessenberg matrix and rotations.

The loop (cycles, checkpoints, Givens rotations on the host, coefficients)
is written once for a device batch and, for tests, NumPy arrays
(:class:`BatchedGmres`); CPU batches run the per-system Numba kernel instead
(:func:`managed_solve.solvers.batched.cpu.solve_gmres`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from ... import config
from ...kernels import krylov as _kk
from ..engine import BREAKDOWN, CONVERGED, MAXITER
from . import cuda
from .arguments import check_batch, check_restart
from .cpu import solve_gmres
from .outcome import BatchOutcome
from .packed import PackedBatch
from .workspace import GMRES_AHEAD, GMRES_RESTART, GmresWorkspace

# Arnoldi steps between host reads of the new Hessenberg columns (each read
# waits for the device); a system stops at the step its estimate first meets
# its tolerance whatever the spacing, later steps of its cycle are masked out.
GMRES_CHECK_EVERY = 8
# Basis vectors one dot-product kernel launch covers (its per-system partial
# sums live in registers: 8 of them).
GMRES_BLOCK = 8


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
      systems, each system's vectors in cache; one large system through
      :func:`managed_solve.solvers.batched.cpu.gmres_one`.

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
    managed_solve.config.Settings : ``batched_gmres_vectorised_on_host`` runs
        the device loop on NumPy batches (tests compare it with the kernel).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> rot = sp.csr_matrix(np.array([[0.0, 1.0], [-1.0, 0.0]]))  # BiCGStab breaks down on it
    >>> A = sp.diags([-1.5, 2.5, -0.5], [-1, 0, 1], shape=(40, 40), format="csr")
    >>> from managed_solve.solvers.batched import PackedBatch
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
    check_batch(batch, call, check_every)
    restart = check_restart(call, restart)
    if batch.xp is np and not config.current().batched_gmres_vectorised_on_host:
        return solve_gmres(batch, restart)
    return BatchedGmres(batch, restart, int(check_every or GMRES_CHECK_EVERY)).run()



class BatchedGmres(GmresWorkspace):
    """The loop of one :func:`gmres_batched` call on a device (or, for tests, NumPy).

    The loop (cycles, checkpoints, Givens on the host, coefficients) is
    shared; four primitives differ: the product ``w = A (dinv v)``, the
    per-system dot products with up to GMRES_BLOCK basis vectors, the
    combination ``y += sign sum_a c[a, s] V[a]`` and the scaling of ``w`` into
    the next basis vector. On a GPU they are the fused kernels of
    ``gmres.cu`` (one pass each, float64 sums, no temporaries); on NumPy,
    array operations. All workspace is allocated before the loop
    (:class:`~managed_solve.solvers.batched.workspace.GmresWorkspace`).
    """

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
            cuda.retire(self.stream.record(), [self, *self._old])
        return out

    def _launch_chunk(self, lo: int, hi: int) -> None:
        """Arnoldi steps lo..hi-1: directly the first time, then as a replayed CUDA graph."""
        if not (self.gpu and config.current().batched_gmres_graphs):
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
        settings = config.current()
        if not self.gpu or self.ns == 1 or int(self.nn) < settings.batched_compact_min_rows:
            return
        sizes = self.batch.sizes
        rows = int(sizes[run].sum())
        if rows > settings.batched_compact_fraction * int(self.nn):
            return
        from ...kernels.packing import active_rows

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
