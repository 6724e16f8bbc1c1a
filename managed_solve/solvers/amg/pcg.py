"""CG preconditioned by the fused V-cycle, one CUDA graph an iteration.

The generic CG (:mod:`managed_solve.solvers.cg`) spends a dozen array
operations an iteration around the preconditioner, and copies the residual
into the cycle and its result out. Here the cycle is bound to the loop's
own vectors: the residual *is* the cycle's right-hand side ``b[0]`` (a
second buffer in the cycle's precision only when it differs from the
loop's) and ``z`` is the buffer the cycle leaves its result in, so nothing
is copied. An iteration is six kernels of ``pcg.cu`` around the cycle's
(the product fused with ``p.q``, the two vector updates with ``r.r``, the
dot ``r.z``, one thread for the scalars, ``p = z + beta p``), every scalar
kept on the device, and is captured, the cycle's kernels included, as one
CUDA graph. The host launches it and reads ``||r||`` and the breakdown flag
from pinned memory once an iteration: a V-cycle costs milliseconds, the
read microseconds, and no iteration runs past convergence. The loop ends
with the true residual of the ``x`` it returns, ``b - A x`` and its sum in
one pass of the residual kernel, which the verify rule then reads instead
of forming ``b - A x`` again (at 4.2M unknowns a from-scratch residual
through cuSPARSE and a norm costs 0.4 ms, which the verify rule and the
result would otherwise each pay).

The same sequence runs on the NumPy twins (:class:`~.twins.LoopTwinOps`)
over a host :class:`~.fused.FusedCycle`, where the tests pin it against the
generic CG. The stopping rule, statuses and messages are the generic CG's.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ... import _backend
from .._common import SAFE_NORM_RANGE, stable_norm, stop_threshold
from ..engine import BREAKDOWN, CONVERGED, MAXITER, Outcome
from .fused import FusedCycle
from .preconditioner import AMGPreconditioner
from .twins import BAD, NSCALARS, RNORM, RR, RZ, RZN, TOL

log = logging.getLogger("managed_solve")

INDEFINITE = (
    "CG met non-positive curvature (p.A p <= 0): A is not positive definite. "
    "Use method='minres' for a symmetric indefinite matrix or method='gmres' for a general one."
)
NONFINITE = ("CG produced a non-finite residual; A may be singular or not positive definite "
             "(try method='minres' or 'gmres').")


class BoundCG:
    """CG on CSR arrays ``A3 = (indptr, indices, data)`` with ``cycle`` bound to the loop's vectors.

    ``ops``: :class:`~.kernels.LoopCudaOps` or :class:`~.twins.LoopTwinOps`;
    ``graph``: capture an iteration as a CUDA graph (CuPy only).
    """

    def __init__(self, xp: Any, ops: Any, A3: tuple, dtype: Any, cycle: FusedCycle, *,
                 graph: bool = False):
        self.xp, self.ops, self.A3, self.cycle = xp, ops, A3, cycle
        self.n = int(A3[0].shape[0] - 1)
        self.dtype = np.dtype(dtype)
        self.rc = cycle.b[0]
        cycle.run()  # fixes the buffer the cycle leaves its result in (the same on every run)
        self.z = cycle.result()
        n, dt = self.n, self.dtype
        self.r = self.rc if self.rc.dtype == dt else xp.zeros(n, dtype=dt)
        self.x, self.p, self.q = (xp.zeros(n, dtype=dt) for _ in range(3))
        self.s = xp.zeros(NSCALARS, dtype=np.float64)
        self.s_check = xp.zeros(NSCALARS, dtype=np.float64)  # the closing residual's sum
        self.graph: Any = None
        self._keep: tuple = ()
        self.pinned: Any = None
        if graph:
            self._capture()

    def iteration(self) -> None:
        """One CG iteration, queued: the sequence of ``pcg.cu``."""
        ops, n, s = self.ops, self.n, self.s
        ops.spmv_dot(n, *self.A3, self.p, self.q, s)
        ops.update(n, self.x, self.p, self.r, self.rc, self.q, s)
        self.cycle.run()
        ops.dot(n, self.r, self.z, s)
        ops.scalars(s)
        ops.pupdate(n, self.z, self.p, s)

    def _capture(self) -> None:
        cp = self.xp
        import cupyx

        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        pinned = cupyx.empty_pinned((2,), dtype=np.float64)
        # sync: the capture stream does not wait for the set-up, queued on the
        # current stream (a device-wide wait fails while another thread captures).
        cp.cuda.get_current_stream().synchronize()
        try:
            with cp.cuda.using_allocator(pool.malloc), stream:
                stream.begin_capture()
                try:
                    self.iteration()
                    # ||r|| and the breakdown flag (adjacent slots) into pinned memory
                    cp.cuda.runtime.memcpyAsync(
                        pinned.ctypes.data, self.s.data.ptr + RNORM * 8, 16,
                        cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                finally:
                    graph = stream.end_capture()
        except Exception as exc:  # capture unsupported here: the same sequence runs eagerly
            log.info("managed_solve: AMG-CG iteration not captured as a CUDA graph (%s)", exc)
            return
        self.graph, self.pinned, self._keep = graph, pinned, (pool, stream)

    def _step(self) -> tuple[float, bool]:
        """One iteration and its ``(||r||, breakdown)`` on the host (one synchronisation)."""
        if self.graph is not None:
            self.graph.launch()
            self.xp.cuda.get_current_stream().synchronize()  # sync: the pinned read below
            return float(self.pinned[0]), bool(self.pinned[1])
        self.iteration()
        h = _backend.to_host(self.s[RNORM:BAD + 1])  # sync: ||r|| and the flag
        return float(h[0]), bool(h[1])

    def solve(self, b: Any, x0: Any = None, *, rtol: float = 1e-8, atol: float = 0.0,
              maxiter: int = 1000) -> Outcome:
        """``A x = b`` to ``||r|| <= max(rtol ||b||, atol)`` in at most ``maxiter`` iterations.

        ``x`` of the outcome is a new array (the loop's own is reused by the next solve).
        The loop runs in the cycle's buffers: solves sharing the cycle take turns.
        """
        with self.cycle.lock:
            out = self._solve(b, x0, rtol=rtol, atol=atol, maxiter=maxiter)
            out.x = self.x.copy()
            out.true_residual = (out.x, self._true_residual(b))
            out.host_syncs += 1
            return out

    def _true_residual(self, b: Any) -> float:
        """``||b - A x||`` of the loop's ``x`` from scratch: one fused pass (product, sum), one read.

        The verify rule's check, made here where the loop's kernel and a
        scratch vector are at hand (``q``, free once the loop ends).
        """
        xp, s = self.xp, self.s_check
        b = xp.ascontiguousarray(b, dtype=self.dtype)
        s.fill(0)
        self.ops.residual(self.n, *self.A3, b, self.x, self.q, self.q, s)
        got = float(np.sqrt(float(_backend.to_host(s[RR]))))  # sync: the true residual
        lo, hi = SAFE_NORM_RANGE
        return got if lo < got < hi else stable_norm(xp, self.q)  # extremes: rescaled

    def _solve(self, b: Any, x0: Any, *, rtol: float, atol: float, maxiter: int) -> Outcome:
        xp, ops, n, s = self.xp, self.ops, self.n, self.s
        b = xp.ascontiguousarray(b, dtype=self.dtype)
        tol = stop_threshold(rtol, atol, stable_norm(xp, b))  # sync: ||b||, once
        s.fill(0)
        if x0 is None:
            self.x.fill(0)
            xp.copyto(self.r, b)
            if self.rc is not self.r:
                xp.copyto(self.rc, self.r, casting="unsafe")
        else:
            xp.copyto(self.x, xp.asarray(x0).reshape(n), casting="unsafe")
            ops.residual(n, *self.A3, b, self.x, self.r, self.rc, s)
        syncs = 2
        r0 = float(np.sqrt(float(_backend.to_host(xp.dot(self.r, self.r)))))  # sync: r0
        if r0 <= tol:
            return Outcome(None, CONVERGED, 0, r0, host_syncs=syncs,
                           info={"path": "amg-cg"})
        if self.cycle.graph is not None:  # z = M r: the preconditioner's own graph
            self.cycle.graph.launch()
        else:
            self.cycle.run()
        s.fill(0)
        ops.dot(n, self.r, self.z, s)
        s[RZ] = s[RZN]
        s[RZN] = 0
        s[RNORM] = r0
        s[TOL] = tol
        xp.copyto(self.p, self.z, casting="unsafe")
        info = {"path": "amg-cg", "graph": self.graph is not None}
        rnorm = r0
        for it in range(1, maxiter + 1):
            rnorm, bad = self._step()
            syncs += 1
            if bad:
                return Outcome(None, BREAKDOWN, it, rnorm, INDEFINITE,
                               host_syncs=syncs, info=info)
            if rnorm <= tol:
                return Outcome(None, CONVERGED, it, rnorm, host_syncs=syncs,
                               info={**info, "converged_at": it})
            if not (rnorm == rnorm and rnorm != float("inf")):
                return Outcome(None, BREAKDOWN, it, rnorm, NONFINITE,
                               host_syncs=syncs, info=info)
        return Outcome(None, MAXITER, maxiter, rnorm, host_syncs=syncs, info=info)


def amg_of(M: Any) -> Any:
    """The :class:`~.preconditioner.AMGPreconditioner` behind ``M`` (itself or its bound matvec)."""
    for obj in (M, getattr(M, "__self__", None)):
        if isinstance(obj, AMGPreconditioner):
            return obj
    return None


def takes_bound_loop(A: Any, kind: str, method: str, M: Any, callback: Any) -> bool:
    """Whether ``A x = b`` runs in :class:`BoundCG`.

    CG with no callback on a cupyx CSR matrix with int32 indices, float32 or
    float64 values, and an AMG preconditioner whose cycle is the fused one
    (on a GPU), of A's shape, on A's device.
    """
    if method != "cg" or kind != "csr" or callback is not None:
        return False
    if not _backend.is_cupy_sparse(A) or getattr(A, "format", "") != "csr":
        return False
    amg = amg_of(M)
    if amg is None or amg.fused_cycle is None or tuple(amg.shape) != tuple(A.shape):
        return False
    if A.dtype not in (np.float32, np.float64) or A.indices.dtype != np.int32 or \
            A.indptr.dtype != np.int32:
        return False
    return A.data.device.id == amg.fused_cycle.b[0].device.id


def bind(A: Any, M: Any) -> BoundCG:
    """The loop for a cupyx CSR ``A`` and an AMG preconditioner ``M`` (:func:`takes_bound_loop`)."""
    from .kernels import LoopCudaOps  # CuPy only

    amg = amg_of(M)
    cycle = amg.fused_cycle
    xp = _backend.array_module(A.data)
    ops = LoopCudaOps(A.dtype, cycle.b[0].dtype, A.data.device.id)
    with cycle.lock:  # the capture runs one iteration in the cycle's buffers
        return BoundCG(xp, ops, (A.indptr, A.indices, A.data), A.dtype, cycle, graph=amg.graph)
