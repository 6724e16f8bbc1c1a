"""The V-cycle: ``r -> M r`` over a hierarchy, on preallocated vectors, without host reads.

Every level owns its solution, right-hand side and two work vectors,
allocated once; the cycle writes into them with ``out=`` forms, so only
the sparse products allocate (NumPy and cupyx give them no output
argument). The restriction is ``P^T`` applied through the transposed view
of ``P`` (no ``R`` is stored). This is the host's cycle and the reference of
the GPU's fused one (:mod:`.fused`), which allocates nothing and is captured
as a CUDA graph (:meth:`CapturedCycle.capture`), replayed by one launch.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("managed_solve")

# Largest difference, relative to the result, between a captured cycle's
# replay and the same cycle run eagerly before the graph is trusted, in units
# of the cycle's machine epsilon: the restriction's atomic additions run in
# no fixed order, so two runs differ by rounding (float32: about 1e-7 a level).
_GRAPH_CHECK_EPS = 1000.0


class CapturedCycle:
    """What a cycle needs to be captured as a CUDA graph: ``run``, ``b[0]``, ``result``.

    Subclasses set ``xp``, ``b`` (right-hand sides, ``b[0]`` the input),
    ``graph`` and ``_graph_keep``, and define :meth:`run` and :meth:`result`.
    """

    xp: Any
    b: list
    graph: Any = None
    _graph_keep: tuple = ()

    def run(self) -> None:  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    def result(self) -> Any:  # pragma: no cover - defined by the subclasses
        raise NotImplementedError

    @property
    def lock(self) -> threading.RLock:
        """Held while the cycle's buffers are in use: solves sharing this cycle take turns."""
        lock = self.__dict__.get("_lock")
        if lock is None:  # dict.setdefault is atomic: one lock, whichever thread comes first
            lock = self.__dict__.setdefault("_lock", threading.RLock())
        return lock

    def apply(self, r: Any, dtype: Any = None) -> Any:
        """``M r`` for one vector (or the block a block cycle takes), as a new array of ``dtype``.

        The cycle works in buffers of its own, so two threads applying one
        preconditioner (two solvers sharing it) take turns.
        """
        xp = self.xp
        with self.lock:
            xp.copyto(self.b[0], r, casting="unsafe")
            if self.graph is not None:
                self.graph.launch()  # on the current stream, after the copy above
            else:
                self.run()
            out = self.result()
            return out.astype(dtype if dtype is not None else out.dtype)  # a copy: one kernel

    def capture(self, cp: Any, *, check: bool = True) -> bool:
        """Capture one cycle as a CUDA graph (CuPy only); False, logged, where that fails.

        Anything the cycle allocates inside the capture (library sparse
        products do) must stay the graph's alone: such blocks come from a
        private memory pool, kept with the graph and never used by anything
        else, warmed by one eager cycle so that the capture itself allocates
        from cached blocks. The replay is then checked once against an eager
        cycle. ``check=False`` skips that check and its host reads (it waits
        only for the warm-up on its own stream): for a copy of a cycle whose
        own capture was checked, the same kernels on vectors of its own.
        """
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        if not check:
            try:
                with cp.cuda.using_allocator(pool.malloc), stream:
                    self.run()  # warms the private pool; the data are never read
                    stream.begin_capture()
                    try:
                        self.run()
                    finally:
                        graph = stream.end_capture()
                stream.synchronize()  # the warm-up wrote the vectors the graph will use
            except Exception as exc:
                log.info("managed_solve: AMG V-cycle not captured as a CUDA graph (%s)", exc)
                return False
            self.graph, self._graph_keep = graph, (pool, stream)
            return True
        probe = cp.cos(cp.arange(self.b[0].shape[0], dtype=self.b[0].dtype) * 0.7)
        # sync: the capture stream is non-blocking, so it would not wait for the
        # set-up's work and the probe still queued on the current stream. That
        # stream only: a device-wide wait fails while another thread captures.
        cp.cuda.get_current_stream().synchronize()
        try:
            with cp.cuda.using_allocator(pool.malloc), stream:
                cp.copyto(self.b[0], probe)
                self.run()
                expect = self.result().copy()
                stream.synchronize()
                stream.begin_capture()
                try:
                    self.run()
                finally:
                    graph = stream.end_capture()
                self.result().fill(0)
                cp.copyto(self.b[0], probe)
                graph.launch(stream)
                err = cp.linalg.norm(self.result() - expect) / max(
                    float(cp.linalg.norm(expect)), 1e-300)
                tol = max(1e-9, _GRAPH_CHECK_EPS * float(cp.finfo(self.b[0].dtype).eps))
                ok = float(err) <= tol  # sync: once, when the graph is made
        except Exception as exc:  # capture unsupported by a library call: run eagerly
            log.info("managed_solve: AMG V-cycle not captured as a CUDA graph (%s)", exc)
            return False
        if not ok:
            log.warning("managed_solve: the captured AMG V-cycle disagrees with the eager one "
                        "(relative difference %.2e); running it eagerly", float(err))
            return False
        self.graph = graph
        self._graph_keep = (pool, stream)
        return True


class VCycle(CapturedCycle):
    """One V-cycle over ``levels`` (matrices ``A`` and ``P`` in ``dtype``) and smoothers."""

    def __init__(self, xp: Any, mats: list[tuple[Any, Any]], smoothers: list[Any],
                 coarse_inv: Any, dtype: Any, columns: int | None = None):
        self.xp = xp
        self.mats = mats  # (A, P) per level; P is None on the coarsest
        self.smoothers = smoothers  # one per level but the coarsest
        self.coarse_inv = coarse_inv
        # ``columns``: a block cycle on (n, k) right-hand sides, every sparse
        # product one SpMM over the k columns (the smoothers' scalings then
        # have shape (n, 1)).
        tail = () if columns is None else (int(columns),)
        sizes = [A.shape[0] for A, _ in mats]

        def zeros(n: int) -> Any:
            return xp.zeros((n, *tail), dtype=dtype)

        self.x = [zeros(n) for n in sizes]
        self.b = [zeros(n) for n in sizes]
        self.res = [zeros(n) for n in sizes]
        self.d = [zeros(n) for n in sizes]
        self.graph = None
        self._graph_keep: tuple = ()

    def run(self) -> None:
        """``x[0] = M b[0]``: pre-smooth from zero, restrict, recurse, correct, post-smooth."""
        xp = self.xp
        last = len(self.mats) - 1
        for lv in range(last):
            A, P = self.mats[lv]
            self.smoothers[lv].apply(A, self.b[lv], self.x[lv], self.res[lv], self.d[lv],
                                     zero=True)
            xp.subtract(self.b[lv], A @ self.x[lv], out=self.res[lv])
            xp.copyto(self.b[lv + 1], P.T @ self.res[lv])
        xp.dot(self.coarse_inv, self.b[last], out=self.x[last])
        for lv in range(last - 1, -1, -1):
            A, P = self.mats[lv]
            self.x[lv] += P @ self.x[lv + 1]
            self.smoothers[lv].apply(A, self.b[lv], self.x[lv], self.res[lv], self.d[lv],
                                     zero=False)

    def result(self) -> Any:
        """The vector that holds ``M b[0]`` after :meth:`run`."""
        return self.x[0]

    def nbytes(self) -> int:
        """Bytes of the cycle's own vectors and coarse inverse."""
        return int(self.coarse_inv.nbytes + sum(v.nbytes for v in (*self.x, *self.b, *self.res,
                                                                       *self.d)))
