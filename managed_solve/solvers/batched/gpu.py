"""The fused CG and BiCGStab loop on a GPU: launches, graphs, checkpoints, compaction.

Design (the GPU half of :mod:`managed_solve.solvers.batched`):

- Per-system scalars never leave the device. Dot products accumulate into
  ``acc[a, slot, s]`` (float64, whatever the vector dtype) and every thread
  computes alpha, beta, omega for its row's system from them. Slots rotate
  with the iteration (3 for CG, 4 for BiCGStab): the slot the next iteration
  accumulates into is zeroed during the current one, when nobody reads it.
- Sums over rows: one system (``SINGLE``) sums in registers, then a block
  reduction and one atomic per block. Many systems: rows are sorted by
  system, so a warp whose 32 rows share a system reduces with shuffles and
  lane 0 keeps a running partial (one atomic per system change); a warp
  straddling a boundary falls back to per-lane atomics.
- Status per system lives on the device (-1 running, 0 converged, 1 maxiter,
  2 breakdown). Threads of finished systems skip their rows; the thread of a
  system's first row writes its status, iteration count and final residual.
  Every thread derives the same decision from the same complete scalars, so
  a thread that sees the new status early only skips work that no longer
  matters.
- Statuses go to the host by asynchronous copies into page-locked buffers
  at checkpoints (every 24-iteration graph chunk, or every 8 iterations for
  large systems). The host keeps two checkpoints' worth of iterations queued
  beyond the last one it read, so its reads never leave the GPU idle; the
  only wait with nothing queued behind it comes when ``maxiter`` is reached
  (``host_syncs`` counts those: 0 or 1 a solve). Small systems replay a CUDA
  graph of 24 iterations, so launch overhead is paid once per chunk.
- Compaction: once the running systems hold at most half the rows the
  kernels walk, the kernels walk a list of those rows only (same iterates;
  finished systems stop costing even the masked pass). The kernels read
  the row count and the switch from the device (``ctl``), so a compaction
  is two copies queued on the stream and the captured graph replays as it
  is: no capture (a millisecond of Python) near a batch's end.
- All workspace is allocated before the loop (:class:`FusedWorkspace`);
  nothing is allocated inside it.

- CG on several systems of at most ``batched_block_max_rows`` rows each
  (the setting) takes another route, :meth:`FusedSolve._run_blocks`: a
  thread block per system iterates it to its end inside one launch
  (``cg_blocks.cu``), claiming systems largest first, and returns each
  system's true residual norm with its status. No graph, checkpoint or
  compaction is needed there: the host waits once, for the end.

The kernels (``cg_bicgstab.cu``, ``cg_blocks.cu``) compute the same iterates
as the Numba twins in :mod:`managed_solve.kernels.krylov` (tests compare
them).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

import numpy as np

from ... import _backend, _pinned, config
from . import cuda
from .workspace import FusedWorkspace

# A kernel's shared-memory limit only grows: two lanes launching the same
# kernel for batches of different sizes must not lower it under each other.
_SHARED_LIMIT_LOCK = threading.Lock()

RUNNING = -1
# Iterations per captured CUDA graph: a multiple of the CG (3) and BiCGStab
# (4) slot counts, so every replay starts at slot 0.
GRAPH_CHUNK = 24
# The same for one system: its graph is captured while the GPU waits (nothing
# else is queued; a batch's is captured ahead, beside another batch's
# compute), so a shorter graph starts the GPU sooner. Checkpoints stay
# GRAPH_CHUNK apart.
SINGLE_GRAPH_CHUNK = 12
# Checkpoint spacing without graphs (large systems: one iteration is long).
CHECK_EVERY = 8
# Checkpoints' worth of iterations the host keeps queued beyond the last it read.
AHEAD = 2
# Once the host is seen running behind (a checkpoint the GPU passed before the
# host came to read it), at least this much GPU time, from the measured time
# of an iteration, but at most AHEAD_FRACTION of the GPU time the solve has
# taken so far: a worker thread may wait for the GIL up to the interpreter's
# switch interval behind another thread, so a short queue can run dry.
# Iterations queued past convergence run masked (a few microseconds each),
# and later work on the caller's stream waits for them, hence the fraction:
# a short solve is not lengthened by a long tail.
AHEAD_SECONDS = 0.012
AHEAD_FRACTION = 0.2


def residual_norms(batch: Any, x: Any, method: str = "cg") -> tuple[np.ndarray, np.ndarray]:
    """Per-system ``||b_s - A_s x_s||`` and ``||b_s||`` of a CuPy batch, as host float64 arrays.

    ``method``: the batch's method, whose kernel module (already loaded by
    its solve) holds the residual kernel too. A fused solve asked for its
    true norms (:func:`solve`) runs the same kernel itself, on its workspace.

    One fused pass (products, squares and per-system sums in float64) and one
    device -> host copy, instead of a cuSPARSE product, two weighted bincounts
    and their temporaries.
    """
    cp = _backend.cupy()
    dev = batch.data.device.id
    with cp.cuda.Device(dev):
        k, grid = cuda.row_launch(dev, batch.dtype, batch.index_dtype, cuda.family_of(method),
                                  batch.n)
        norms = _true_norms(cp, k, grid, batch, x)
    # The caller's stream waited for the solve's stream, masked iterations included:
    # the batch and workspace kept for them can go now, not at the next solve.
    cuda.release_done()
    return norms


def _true_norms(cp: Any, k: dict, grid: int, batch: Any, x: Any) -> tuple[np.ndarray, np.ndarray]:
    """The residual kernel over every row of ``batch`` on the current stream, then one read."""
    ns = batch.nsys
    sums = cp.zeros(2 * ns, dtype=np.float64)
    k[f"residual{int(ns == 1)}"]((grid,), (cuda.THREADS,), (
        batch.indptr, batch.indices, batch.data, batch.b, x, batch.row_sys, sums[:ns],
        sums[ns:], np.int64(batch.n)))
    h = sums.get()  # sync: one read of the per-system norms
    return np.sqrt(h[:ns]), np.sqrt(h[ns:])


def solve(batch: Any, method: str, check_every: int | None, first_check: int | None = None, *,
          true_norms: bool = False) -> tuple:
    """Run batched CG or BiCGStab on a CuPy batch; returns BatchOutcome's fields.

    A workspace made beforehand by :func:`prepare` for this batch and method
    is used (once); otherwise it is built here. ``true_norms``: each
    system's ``(||b_s - A_s x_s||, ||b_s||)`` too, computed on the device
    after the solve (with a block per system the kernel computes them
    anyway).
    """
    cp = _backend.cupy()
    dev = batch.data.device.id
    ready, batch.workspace = batch.workspace, None  # used once
    cuda.release_done()
    with cp.cuda.Device(dev):
        if ready is not None and ready.method == method:
            solver, solver.batch = ready, batch
        else:
            solver = FusedSolve(cp, batch, method, dev)
        return solver.run(check_every, first_check, true_norms=true_norms)


def prepare(batch: Any, method: str) -> None:
    """Build a CuPy batch's solver workspace now, for the next :func:`solve` of it.

    ``solve_many`` calls this in a device's stager thread right after
    packing, so the workspace's allocations and small copies happen beside
    the previous batch's compute instead of before this one's. The work goes on the
    current stream; the caller synchronises it before the batch is solved.
    """
    cp = _backend.cupy()
    dev = batch.data.device.id
    with cp.cuda.Device(dev):
        solver = FusedSolve(cp, batch, method, dev)
        stream = cp.cuda.get_current_stream()
        # The CUDA graph of the first iterations too: its capture launches every
        # kernel of a chunk of iterations from Python, slow while other threads
        # hold the GIL. Capture needs a stream other than the default ones.
        if solver.uses_graph and stream.ptr not in (0, 1, 2):
            solver.graph = solver._capture(stream)
    solver.batch = None  # no cycle: a batch dropped unsolved frees its workspace at once
    batch.workspace = solver


class FusedSolve(FusedWorkspace):
    """The launch sequence and loop of one fused solve on its :class:`FusedWorkspace`."""

    # -- launches ---------------------------------------------------------------------
    def _rows(self, fn: Any, *args: Any) -> None:
        fn((self.grid,), (cuda.THREADS,), args)

    def _setup(self) -> None:
        cp, b, k = self.cp, self.batch, self.k
        has_x0 = int(b.x0 is not None)
        if has_x0:
            cp.copyto(self.x, b.x0)
        else:
            self.x.fill(0)
        dinv = b.dinv if self.jac else self.x  # never read without Jacobi
        last = np.int32(self.nslot - 1)
        if self.method == "cg":
            r, p, _ = self.vec
            z = self.z if self.jac else r
            rr_id, rz_id, copy, jac = 2, 1, p, self.jac
        else:
            r, rt = self.vec[0], self.vec[1]
            z, rr_id, rz_id, copy, jac = r, 1, 0, rt, 0  # r~ = r; rho = r.r
        self._rows(k[f"init{self.single}{jac}{has_x0}"], b.indptr, b.indices, b.data, b.b, self.x,
                   dinv, r, z, copy, b.row_sys, self.bb, self.acc, self.ns, last,
                   np.int32(self.nslot), np.int32(rr_id), np.int32(rz_id), self.nn)
        if has_x0:
            self._rows(k["zero_x"], self.x, b.row_sys, self.bb, self.nn)
        k["init_status"]((self.sgrid,), (128,), (
            self.acc, self.ns, last, np.int32(self.nslot), np.int32(rr_id), np.int32(rz_id),
            self.bb, self.rtol, self.atol, self.maxiter, self.tol2, self.status, self.iters,
            self.res2))

    def _iteration(self, it: int) -> None:
        slot = np.int32(it % self.nslot)
        b, k, s, j = self.batch, self.k, self.single, self.jac
        A = (b.indptr, b.indices, b.data)
        dinv = b.dinv if j else self.x
        if self.method == "cg":
            r, p, q = self.vec
            z = self.z if j else r
            self._rows(k[f"cg_spmv{s}{self.vspmv}"], *A, p, q, b.row_sys, self.status, self.acc, self.ns,
                       slot, self.ctl, self.act)
            self._rows(k[f"cg_update{s}{j}"], self.x, r, z, p, q, dinv, b.row_sys, self.status,
                       self.offs, self.res2, self.acc, self.ns, slot, self.ctl, self.act)
            self._rows(k[f"cg_direction{s}"], p, z, b.row_sys, self.status, self.iters,
                       self.maxiter, self.tol2, self.offs, self.res2, self.acc, self.ns, slot,
                       self.ctl, self.act)
        else:
            r, rt, p, v, t = self.vec
            z = self.z if j else p
            ph = z if j else p
            sh = z if j else r
            self._rows(k[f"bicg_direction{s}{j}"], p, z, r, v, dinv, b.row_sys, self.status,
                       self.iters, self.maxiter, self.tol2, self.offs, self.res2, self.acc,
                       self.ns, slot, self.ctl, self.act)
            self._rows(k[f"bicg_spmv_v{s}{self.vspmv}"], *A, ph, v, rt, b.row_sys, self.status, self.acc,
                       self.ns, slot, self.ctl, self.act)
            self._rows(k[f"bicg_update_s{s}{j}"], self.x, r, z, p, v, dinv, b.row_sys,
                       self.status, self.offs, self.res2, self.acc, self.ns, slot, self.ctl, self.act)
            self._rows(k[f"bicg_spmv_t{s}{self.vspmv}"], *A, sh, r, t, b.row_sys, self.status, self.iters,
                       self.tol2, self.offs, self.res2, self.acc, self.ns, slot, self.ctl, self.act)
            self._rows(k[f"bicg_update_r{s}{j}"], self.x, r, z, t, rt, b.row_sys, self.status,
                       self.iters, self.offs, self.res2, self.acc, self.ns, slot, self.ctl, self.act)

    def _before_read(self, it: int) -> None:
        """BiCGStab applies its stopping tests at the start of an iteration; run them now."""
        if self.method != "cg":
            self.k["bicg_check"]((self.sgrid,), (128,), (
                self.acc, self.ns, np.int32(it % self.nslot), self.status, self.iters,
                self.maxiter, self.tol2, self.res2))

    # -- the loop -------------------------------------------------------------------
    @property
    def chunk(self) -> int:
        """Iterations a captured graph replays."""
        return SINGLE_GRAPH_CHUNK if self.nsys == 1 else GRAPH_CHUNK

    def _capture(self, stream: Any) -> Any:
        """A CUDA graph of :meth:`chunk` iterations with the current row set."""
        stream.begin_capture()
        try:
            for it in range(self.chunk):
                self._iteration(it)
        finally:
            graph = stream.end_capture()
        return graph

    def _compact(self, status: np.ndarray, stream: Any) -> bool:
        """Restrict the iteration kernels to running systems' rows, when that halves the work.

        Called at a checkpoint with the statuses the host just read. Systems
        finished since then are still in the list (masked, as before); the
        list only shrinks. The rows go up through a page-locked buffer on the
        solver's stream; ``act`` was allocated with the workspace.
        """
        settings = config.current()
        if self.nsys == 1 or int(self.nact) < settings.batched_compact_min_rows:
            return False
        running = np.flatnonzero(status == RUNNING)
        lens = self.sizes[running]
        m = int(lens.sum())
        if m == 0 or m > settings.batched_compact_fraction * int(self.nact):
            return False
        from ...kernels.packing import active_rows

        starts = self.batch.offsets[:-1][running].astype(np.int64)
        host = _pinned.pinned_empty(m * self.act.itemsize + 16, np.uint8, self._keep)
        rows = host[16:].view(self.act.dtype)
        active_rows(starts, lens, rows)  # without the GIL
        host[:16].view(np.int64)[:] = (m, 1)
        # Stream order: the iterations queued before these copies walk the old
        # rows, those queued after the new ones (the same graph reads ctl).
        runtime = self.cp.cuda.runtime
        runtime.memcpyAsync(self.act.data.ptr, rows.ctypes.data, rows.nbytes,
                            runtime.memcpyHostToDevice, stream.ptr)
        runtime.memcpyAsync(self.ctl.data.ptr, host.ctypes.data, 16, runtime.memcpyHostToDevice,
                            stream.ptr)
        self.nact = np.int64(m)
        self.compactions += 1
        return True

    def _run_blocks(self) -> tuple:
        """CG with a thread block per system (``cg_blocks.cu``): one launch, one read.

        Blocks claim systems largest first and iterate each to its end, so
        the host has nothing to watch: it queues the launch and the copies
        of the statuses and of each system's true residual norm (computed by
        the kernel in float64), then waits once, for the end of the work.
        Returns :meth:`run`'s fields and the true norms (no checkpoint
        overlaps queued work, and none needs to: ``host_syncs`` stays 0).
        """
        cp, b, settings = self.cp, self.batch, config.current()
        caller = cp.cuda.get_current_stream()
        stream = cp.cuda.Stream(non_blocking=True)
        stream.wait_event(caller.record())
        threads = settings.batched_block_threads
        # Blocks beyond those resident at once only queue for the claim counter.
        grid = max(1, min(self.nsys, cuda.sm_count(self.dev) * max(1, 2048 // threads)))
        has_x0 = int(b.x0 is not None)
        r, p, q = self.vec
        z = self.z if self.jac else r  # never written without Jacobi
        dinv = b.dinv if self.jac else self.x  # never read without Jacobi
        x0 = b.x0 if has_x0 else self.x  # never read without x0
        ns = self.nsys
        # p, q and x in shared memory when the largest system's fit there.
        shared = cuda.block_shared_bytes(int(self.sizes.max()), self.x.itemsize, self.dev) \
            if settings.batched_block_shared_memory else 0
        name = f"cg_blocks{self.jac}{has_x0}{int(shared > 0)}"
        # The device-memory kernels are a module of their own, compiled when first needed.
        kernel = self.k[name] if shared else \
            cuda.kernels(self.dev, b.dtype, b.index_dtype, "cg_blocks")[name]
        with _SHARED_LIMIT_LOCK:
            if shared > kernel.max_dynamic_shared_size_bytes:
                kernel.max_dynamic_shared_size_bytes = shared
        keep: list = []
        host = _pinned.pinned_empty(self.norms2.nbytes + self.info.nbytes, np.uint8, keep)
        runtime = cp.cuda.runtime
        counter = self.order[ns:]
        with stream:
            started = stream.record()
            runtime.memsetAsync(counter.data.ptr, 0, counter.nbytes, stream.ptr)
            kernel((grid,), (threads,), (
                b.indptr, b.indices, b.data, b.b, x0, dinv, self.x, r, z, p, q, self.offs,
                self.order, counter, self.ns, self.rtol, self.atol, self.maxiter, self.res2,
                self.iters, self.status, self.norms2), shared_mem=shared)
            runtime.memcpyAsync(host.ctypes.data, self.norms2.data.ptr, self.norms2.nbytes,
                                runtime.memcpyDeviceToHost, stream.ptr)
            runtime.memcpyAsync(host.ctypes.data + self.norms2.nbytes, self.info.data.ptr,
                                self.info.nbytes, runtime.memcpyDeviceToHost, stream.ptr)
            done = stream.record()
        done.synchronize()  # sync: the batch's end (statuses and norms)
        caller.wait_event(done)
        gpu_seconds = cp.cuda.get_elapsed_time(started, done) / 1e3
        norms = np.sqrt(host[: 16 * ns].view(np.float64))
        h = host[16 * ns:]
        return (self.x, h[8 * ns:16 * ns].view(np.int64).copy(),
                np.sqrt(h[:8 * ns].view(np.float64)), h[16 * ns:].view(np.int32).astype(np.int8),
                0, 1, 0, gpu_seconds, (norms[:ns].copy(), norms[ns:].copy()))

    def run(self, check_every: int | None, first_check: int | None = None, *,
            true_norms: bool = False) -> tuple:
        """Launch iterations ahead of the host; read statuses without draining the GPU.

        After every ``spacing`` iterations the statuses go to a page-locked
        host buffer (an asynchronous copy) and an event is recorded. The host
        keeps up to AHEAD checkpoints' worth of iterations queued beyond the
        last one it has read, and waits on the oldest checkpoint's event while
        later work is still queued, so the GPU never idles on the host; the
        extra iterations queued after convergence run masked (threads of
        finished systems skip their rows). The only wait with nothing queued
        behind it is the last one when ``maxiter`` is reached: that count is
        returned as ``host_syncs`` (0 or 1), the checkpoint count as
        ``checkpoints``. ``first_check`` (a predicted iteration count) lets
        the host queue that many iterations before its first read.
        """
        if self.blocks:
            return self._run_blocks()
        cp = self.cp
        caller = cp.cuda.get_current_stream()
        stream = cp.cuda.Stream(non_blocking=True)
        # The batch was written on the caller's stream; ours must see it.
        stream.wait_event(caller.record())
        use_graph = self.uses_graph
        unit = self.chunk if use_graph else 1
        maxmax = self.maxmax
        last = -(-maxmax // unit) * unit  # iterations launched at most
        spacing = int(check_every) if check_every is not None else (GRAPH_CHUNK if use_graph else CHECK_EVERY)
        spacing = max(unit, -(-spacing // unit) * unit)
        ahead = max(AHEAD * spacing, int(first_check or 0))
        self._keep: list = []  # page-locked buffers, alive until their copies are done
        free: list[np.ndarray] = []
        pending: deque = deque()  # (iterations at the checkpoint, event, host buffer)
        syncs = checkpoints = 0
        launched = seen = 0
        final = None
        per_it = math.inf  # GPU milliseconds an iteration, measured at checkpoints
        behind = False  # the host came late to a checkpoint (the GPU had passed it)
        with stream:
            started = stream.record()  # GPU time of the solve, read once it is over
            last_event = started
            self._setup()
            graph, self.graph = self.graph, None
            if graph is None and use_graph:
                graph = self._capture(stream)
            while True:
                while launched < last and (launched - seen < ahead or not pending):
                    target = min(launched + spacing, last)
                    while launched < target:
                        if graph is not None:
                            graph.launch(stream)
                            launched += unit
                        else:
                            self._iteration(launched)
                            launched += 1
                    self._before_read(launched)
                    buf = free.pop() if free else _pinned.pinned_empty(self.info.nbytes, np.uint8,
                                                                          self._keep)
                    cp.cuda.runtime.memcpyAsync(buf.ctypes.data, self.info.data.ptr, self.info.nbytes,
                                                cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                    pending.append((launched, stream.record(), buf))
                if not pending:  # maxmax == 0: set-up decided every system
                    buf = _pinned.pinned_empty(self.info.nbytes, np.uint8, self._keep)
                    done = stream.record()
                    self.info.get(out=buf)  # sync: the statuses set-up wrote, nothing queued behind
                    syncs += 1
                    final = buf
                    break
                at, event, buf = pending.popleft()
                # A host running behind (waiting for the GIL behind other threads)
                # goes straight to the newest checkpoint the GPU has passed instead
                # of waking once per checkpoint: each wake-up can cost up to the
                # interpreter's switch interval.
                while pending and pending[0][1].done:
                    free.append(buf)  # complete: an event after it is
                    at, event, buf = pending.popleft()
                    checkpoints += 1  # passed (and counted) without a wake-up of its own
                    behind = True
                if not pending:
                    syncs += 1  # this wait drains the queue (maxiter reached, or check_every)
                event.synchronize()  # sync: checkpoint `at`; later iterations stay queued
                checkpoints += 1
                # The fastest stretch between checkpoints is closest to the GPU's own
                # time per iteration (a stretch may include idling on the host).
                ms = cp.cuda.get_elapsed_time(last_event, event)  # both events are complete
                if at > seen and ms > 0:
                    per_it = min(per_it, ms / (at - seen))
                last_event = event
                seen = at
                status = buf[16 * self.nsys:].view(np.int32)
                if not (status == RUNNING).any():
                    final, done = buf, event
                    break
                if at >= last:
                    raise RuntimeError(
                        f"{self.method}_batched: {int((status == RUNNING).sum())} systems still "
                        f"running after {at} iterations with maxiter <= {maxmax}; this is a bug "
                        "in managed_solve's CUDA Krylov kernels, please report it")
                ahead = AHEAD * spacing
                if behind and per_it < math.inf:
                    spent = cp.cuda.get_elapsed_time(started, event)  # ms, both complete
                    want = min(AHEAD_SECONDS * 1e3, AHEAD_FRACTION * spent)
                    ahead = max(ahead, -(-int(want / per_it) // spacing) * spacing)
                self._compact(status, stream)
                free.append(buf)
        # Later work on the caller's stream must see x; masked iterations still queued
        # on ours finish first, and the workspace is only reused after them.
        caller.wait_event(stream.record())
        norms = None
        try:
            if true_norms:  # its read waits for the masked iterations too
                norms = _true_norms(cp, self.k, self.grid, self.batch, self.x)
        finally:
            if pending and norms is None:
                # The batch and this workspace too: their memory may have come from
                # another stream's pool arena (the stager's), which must not hand it
                # out again while masked iterations still read it.
                cuda.retire(stream.record(), self._keep + [graph, self])
        ns = self.nsys
        h = final
        gpu_seconds = cp.cuda.get_elapsed_time(started, done) / 1e3  # both events are complete
        return (self.x, h[8 * ns:16 * ns].view(np.int64).copy(),
                np.sqrt(h[:8 * ns].view(np.float64)), h[16 * ns:].view(np.int32).astype(np.int8),
                syncs, checkpoints, self.compactions, gpu_seconds, norms)


