"""Moving data between shards: halo copies, all-reduces, and the per-device vector operations.

Two transports share one interface, so the Krylov loops never ask where they
run: :class:`CudaComm` (one compute and one copy stream per GPU, peer-to-peer
copies, events between streams) and :class:`HostComm` (simulated devices:
NumPy arrays, a copy is an assignment, order is program order). Likewise
:class:`CudaOps` and :class:`HostOps` hold the few per-shard operations the
loops need (product, gather, fused updates and dot products), with the
fused CUDA kernels in :mod:`managed_solve.sharded.cuda`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _backend
from ..devices import Device
from . import cuda

__all__ = ["CudaComm", "CudaOps", "HostComm", "HostOps", "cg_scalars_xp", "safe_div"]


class HostComm:
    """Simulated devices: arrays are NumPy, copies are assignments, order is program order."""

    is_cuda = False

    def __init__(self, devices: Sequence[Device]):
        self.devices = list(devices)

    def on(self, s: int):
        return contextlib.nullcontext()

    def copy(self, dst, dst_s: int, src, src_s: int, *, via_copy_stream: bool = False) -> None:
        dst[...] = src

    def wait_incoming(self, s: int) -> None:
        pass

    def before_pack(self, s: int) -> None:
        pass

    def read(self, s: int, arr) -> np.ndarray:
        return np.array(arr)

    def synchronize(self) -> None:
        pass


class CudaComm:
    """CUDA GPUs: one compute and one copy stream per device, peer copies, events."""

    is_cuda = True

    def __init__(self, devices: Sequence[Device]):
        cp = _backend.cupy()
        self.cp = cp
        self.devices = list(devices)
        self.ids = [d.index for d in devices]
        self.compute, self.copier = [], []
        for i in self.ids:
            with cp.cuda.Device(i):
                self.compute.append(cp.cuda.Stream(non_blocking=True))
                self.copier.append(cp.cuda.Stream(non_blocking=True))
                for j in self.ids:
                    if j != i and cp.cuda.runtime.deviceCanAccessPeer(i, j):
                        try:
                            cp.cuda.runtime.deviceEnablePeerAccess(j)
                        except cp.cuda.runtime.CUDARuntimeError:
                            pass  # already enabled by an earlier plan
        self._events: dict[tuple, Any] = {}
        self._pending: list[list[Any]] = [[] for _ in self.ids]
        self._in_flight: list[list[Any]] = [[] for _ in self.ids]

    @contextlib.contextmanager
    def on(self, s: int):
        with self.cp.cuda.Device(self.ids[s]), self.compute[s]:
            yield

    def _event(self, key):
        ev = self._events.get(key)
        if ev is None:
            with self.cp.cuda.Device(self.ids[key[0]]):
                ev = self._events[key] = self.cp.cuda.Event(disable_timing=True)
        return ev

    def copy(self, dst, dst_s: int, src, src_s: int, *, via_copy_stream: bool = False) -> None:
        """Enqueue ``dst[...] = src`` after what ``src_s`` queued; ``dst_s`` waits at wait_incoming.

        Reusing one event per (src, dst, stream) is safe: the waiting side
        enqueues its wait (in :meth:`wait_incoming`) before the next record.
        """
        cp = self.cp
        nbytes = src.nbytes
        if nbytes == 0:
            return
        stream = self.compute[src_s]
        with cp.cuda.Device(self.ids[src_s]):
            if via_copy_stream:
                go = self._event((src_s, dst_s, "go"))
                go.record(self.compute[src_s])
                self.copier[src_s].wait_event(go)
                stream = self.copier[src_s]
            cp.cuda.runtime.memcpyPeerAsync(dst.data.ptr, self.ids[dst_s], src.data.ptr,
                                            self.ids[src_s], nbytes, stream.ptr)
            if src_s != dst_s or via_copy_stream:
                done = self._event((src_s, dst_s, "copy" if via_copy_stream else "red"))
                done.record(stream)
                self._pending[dst_s].append(done)
                if via_copy_stream:
                    self._in_flight[src_s].append(done)

    def before_pack(self, s: int) -> None:
        """Make shard ``s`` wait until its last halo copies have read its send buffers."""
        for ev in self._in_flight[s]:
            self.compute[s].wait_event(ev)
        self._in_flight[s].clear()

    def read(self, s: int, arr) -> np.ndarray:
        """``arr`` on the host, after the work queued on shard ``s``'s compute stream.

        A plain ``.get()`` would copy on the legacy default stream, which does
        not wait for our non-blocking streams.
        """
        with self.cp.cuda.Device(self.ids[s]):
            return arr.get(stream=self.compute[s])

    def timing_event(self, s: int, copier: bool = False):
        """A timing event recorded now on shard ``s``'s compute (or copy) stream."""
        with self.cp.cuda.Device(self.ids[s]):
            ev = self.cp.cuda.Event()
            ev.record(self.copier[s] if copier else self.compute[s])
        return ev

    def wait_incoming(self, s: int) -> None:
        for ev in self._pending[s]:
            self.compute[s].wait_event(ev)
        self._pending[s].clear()

    def synchronize(self) -> None:
        for i, st in zip(self.ids, self.compute, strict=True):
            with self.cp.cuda.Device(i):
                st.synchronize()


# ====================================================================== per-xp operations
class HostOps:
    """NumPy twins of the CUDA kernels in :mod:`managed_solve.sharded.cuda`."""

    @staticmethod
    def spmv(A, x, y) -> None:
        if A.shape[0]:
            y[...] = A @ x

    @staticmethod
    def take(v, idx, out) -> None:
        np.take(v, idx, out=out)

    @staticmethod
    def update_xr(alpha, p, s, x, r) -> None:
        x += alpha[0] * p
        r -= alpha[0] * s

    @staticmethod
    def update_ps(beta, u, w, p, s) -> None:
        p *= beta[0]
        p += u
        s *= beta[0]
        s += w

    @staticmethod
    def dots3(r, u, w, out) -> None:
        out[0] = np.dot(r, u)
        out[1] = np.dot(w, u)
        out[2] = np.dot(r, r)

    @staticmethod
    def cg_scalars(sc, tot, tol2, hist, pos) -> None:
        cg_scalars_xp(np, sc, tot, tol2, hist, pos)


class CudaOps:
    """The same operations on CuPy arrays: fused kernels for float64, CuPy calls otherwise."""

    @staticmethod
    def spmv(A, x, y) -> None:
        if not A.shape[0]:
            return
        from cupyx import cusparse

        if A.nnz and cusparse.check_availability("spmv"):
            cusparse.spmv(A, x, y=y)
        else:
            y[...] = A @ x

    @staticmethod
    def take(v, idx, out) -> None:
        _backend.cupy().take(v, idx, out=out)

    @staticmethod
    def update_xr(alpha, p, s, x, r) -> None:
        cuda.update_xr(alpha, p, s, x, r)

    @staticmethod
    def update_ps(beta, u, w, p, s) -> None:
        cuda.update_ps(beta, u, w, p, s)

    @staticmethod
    def dots3(r, u, w, out) -> None:
        if r.dtype == np.float64:
            cuda.dots3(r, u, w, out)
        else:
            cp = _backend.cupy()
            out[0] = cp.dot(r, u)
            out[1] = cp.dot(w, u)
            out[2] = cp.dot(r, r)

    @staticmethod
    def cg_scalars(sc, tot, tol2, hist, pos) -> None:
        if sc.dtype == np.float64:
            cuda.cg_scalars(sc, tot, tol2, hist, pos)
        else:
            cg_scalars_xp(_backend.cupy(), sc, tot, tol2, hist, pos)


def cg_scalars_xp(xp, sc, tot, tol2, hist, pos) -> None:
    """CG's scalar recurrences on 1-element arrays (the twin of ``ms_sharded_cg_scalars``).

    ``sc = [gamma, alpha, beta, bad]``; ``tot = [(r,u), (Au,u), (r,r)]``.
    """
    g, delta, rr = tot[0:1], tot[1:2], tot[2:3]
    beta = safe_div(xp, g, sc[0:1])
    # (p, A p) of textbook CG, from the fused reduction.
    curv = delta - beta * safe_div(xp, g, sc[1:2])
    sc[3:4] = xp.where((curv <= 0) & (rr > tol2), 1, sc[3:4])
    sc[1:2] = safe_div(xp, g, curv)
    sc[2:3] = beta
    sc[0:1] = g
    if pos >= 0:
        hist[pos] = rr[0]


def safe_div(xp, num, den):
    """``num / den`` where ``den != 0``, else 0 (iterating past convergence divides 0 by 0)."""
    nz = den != 0
    return xp.where(nz, num / xp.where(nz, den, 1), 0).astype(num.dtype, copy=False)
