"""One large linear system sharded over several GPUs (or simulated GPUs).

:func:`solve_sharded` partitions the rows of ``A`` into contiguous blocks
(:mod:`managed_solve.partition`: optional reverse Cuthill-McKee, blocks
balanced by nnz, interior rows before boundary rows), places one block per
device, and runs distributed CG (Chronopoulos-Gear: one all-reduce per
iteration) or BiCGStab. Each product ``A v``:

1. packs the entries neighbours need and starts the halo copies on a
   dedicated copy stream (peer-to-peer between GPUs);
2. multiplies the interior rows meanwhile (they read owned entries only);
3. waits for the halo and multiplies the boundary rows.

Dot products are reduced across shards by an all-to-all copy of each shard's
partial sums followed by the same summation on every device, so every shard
computes bit-identical scalars without a host round trip. The host reads the
residual only every ``check_every`` iterations.

Simulated devices (``DeviceManager(simulate="3x1GiB")``) run the same loop on
NumPy arrays: the exchange is an array copy, events and streams are no-ops.

The set-up (partition, halo maps, arrays on the devices) is a
:class:`ShardedSystem`, cached per matrix object, so a second solve with a
new right-hand side skips it.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from . import _backend, partition
from .devices import Device
from .result import SolveResult, Status

__all__ = [
    "DistributedVector",
    "ShardedSystem",
    "clear_cache",
    "needs_sharding",
    "resolve_devices",
    "sharded_system",
    "solve_sharded",
]

needs_sharding = partition.needs_sharding

# Host reads of the residual, every this many iterations, on GPUs: each read
# drains every device's queue (tens of microseconds), the iterations in
# between cost nothing extra; on simulated devices a read is free.
GPU_CHECK_EVERY = 8

_CONVERGED, _MAXITER, _BREAKDOWN = 0, 1, 2


# ====================================================================== devices
def resolve_devices(devices: Any, *, manager: Any = None, call: str = "solve_sharded") -> list[Device]:
    """The list of accelerators a sharded solve runs on, validated.

    Parameters
    ----------
    devices : "all", int, or sequence of str / Device
        ``"all"``: every accelerator of the manager; an int ``k``: its first
        ``k``; a sequence: those devices (``["cuda:0", "cuda:1"]``, ``"sim:0"``
        or :class:`~managed_solve.devices.Device` objects).
    manager : DeviceManager, optional
        Resolves names (default: the package's default manager).

    Examples
    --------
    >>> from managed_solve.manager import DeviceManager
    >>> dm = DeviceManager(simulate="3x1GiB")
    >>> [str(d) for d in resolve_devices(2, manager=dm)]
    ['sim:0', 'sim:1']
    """
    def mgr():
        if manager is not None:
            return manager
        from .manager import default_manager

        return default_manager()

    if devices is None:
        raise ValueError(
            f"{call}(devices=None): name the devices to shard over, e.g. devices='all', "
            "devices=2 or devices=['cuda:0', 'cuda:1']."
        )
    if isinstance(devices, bool) or isinstance(devices, float):
        raise TypeError(
            f"{call}(devices={devices!r}): expected 'all', a number of devices or a list of "
            "device names such as ['cuda:0', 'cuda:1']."
        )
    if isinstance(devices, str):
        if devices.strip().lower() == "all":
            chosen = list(mgr().accelerators)
            if not chosen:
                raise RuntimeError(
                    f"{call}(devices='all'): no GPU (real or simulated) is available here. "
                    "Solve on the CPU with solve(A, b, device='cpu'), or simulate GPUs with "
                    "MANAGED_SOLVE_SIMULATE='2x1GiB' / DeviceManager(simulate='2x1GiB')."
                )
            return chosen
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (int, np.integer)):
        acc = list(mgr().accelerators)
        if devices < 1 or devices > len(acc):
            raise ValueError(
                f"{call}(devices={devices}): expected between 1 and {len(acc)} (the "
                f"accelerators available: {[str(d) for d in acc]}); pass devices='all' for every one."
            )
        return acc[: int(devices)]
    try:
        items = list(devices)
    except TypeError:
        raise TypeError(
            f"{call}(devices=...): got a {type(devices).__name__}; expected 'all', a number of "
            "devices or a list of device names such as ['cuda:0', 'cuda:1']."
        ) from None
    if not items:
        raise ValueError(
            f"{call}(devices=[]): the list is empty; give at least one device, e.g. "
            "devices=['cuda:0', 'cuda:1'] or devices='all'."
        )
    chosen = []
    for d in items:
        if isinstance(d, Device):
            dev = d
        elif isinstance(d, str):
            try:
                dev = mgr().get_device(d.strip())
            except ValueError as exc:
                raise ValueError(
                    f"{call}(devices={items!r}): {exc} Use names of this machine's GPUs, or pass "
                    "manager=DeviceManager(simulate='2x1GiB') for simulated ones."
                ) from None
        else:
            raise TypeError(
                f"{call}(devices=...): entry {d!r} is a {type(d).__name__}; expected a device "
                "name ('cuda:0') or a Device."
            )
        if not dev.is_gpu:
            raise ValueError(
                f"{call}(devices={[str(x) for x in items]!r}): {dev} is not a GPU; shards run on "
                "GPUs (real or simulated). For the CPU use solve(A, b, device='cpu')."
            )
        if dev in chosen:
            raise ValueError(
                f"{call}(devices={[str(x) for x in items]!r}): {dev} appears twice; name each "
                "device once."
            )
        chosen.append(dev)
    if len({d.kind for d in chosen}) > 1:
        raise ValueError(
            f"{call}(devices={[str(x) for x in chosen]!r}): mixes real and simulated GPUs; "
            "shard over one kind only."
        )
    return chosen


# ====================================================================== transports
class _HostComm:
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


class _CudaComm:
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
class _HostOps:
    """NumPy twins of the CUDA kernels in ``solvers/_cuda_sharded.py``."""

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
        _cg_scalars_xp(np, sc, tot, tol2, hist, pos)


class _CudaOps:
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
        from .solvers import _cuda_sharded

        _cuda_sharded.update_xr(alpha, p, s, x, r)

    @staticmethod
    def update_ps(beta, u, w, p, s) -> None:
        from .solvers import _cuda_sharded

        _cuda_sharded.update_ps(beta, u, w, p, s)

    @staticmethod
    def dots3(r, u, w, out) -> None:
        if r.dtype == np.float64:
            from .solvers import _cuda_sharded

            _cuda_sharded.dots3(r, u, w, out)
        else:
            cp = _backend.cupy()
            out[0] = cp.dot(r, u)
            out[1] = cp.dot(w, u)
            out[2] = cp.dot(r, r)

    @staticmethod
    def cg_scalars(sc, tot, tol2, hist, pos) -> None:
        if sc.dtype == np.float64:
            from .solvers import _cuda_sharded

            _cuda_sharded.cg_scalars(sc, tot, tol2, hist, pos)
        else:
            _cg_scalars_xp(_backend.cupy(), sc, tot, tol2, hist, pos)


def _cg_scalars_xp(xp, sc, tot, tol2, hist, pos) -> None:
    """CG's scalar recurrences on 1-element arrays (the twin of ``ms_sharded_cg_scalars``).

    ``sc = [gamma, alpha, beta, bad]``; ``tot = [(r,u), (Au,u), (r,r)]``.
    """
    g, delta, rr = tot[0:1], tot[1:2], tot[2:3]
    beta = _safe_div(xp, g, sc[0:1])
    # (p, A p) of textbook CG, from the fused reduction.
    curv = delta - beta * _safe_div(xp, g, sc[1:2])
    sc[3:4] = xp.where((curv <= 0) & (rr > tol2), 1, sc[3:4])
    sc[1:2] = _safe_div(xp, g, curv)
    sc[2:3] = beta
    sc[0:1] = g
    if pos >= 0:
        hist[pos] = rr[0]


# ====================================================================== shards
class _Shard:
    """One block on one device: matrices, halo buffers, send lists."""

    def __init__(self, layout: partition.ShardLayout, device: Device, dtype, comm):
        self.layout = layout
        self.device = device
        self.index = layout.index
        self.nloc, self.nhalo, self.n_int = layout.nloc, layout.nhalo, layout.n_interior
        xp = device.backend
        self.xp = xp
        with comm.on(self.index):
            spm = _backend.sparse_module(xp)
            self.A_int = self._upload(spm, layout.interior, dtype)
            self.A_bnd = self._upload(spm, layout.boundary, dtype)
            self.send = [(t, xp.asarray(idx.astype(np.int32 if self.nloc < 2**31 else np.int64)),
                          xp.empty(idx.size, dtype=dtype)) for t, idx in layout.send]
            diag = np.concatenate([layout.interior.diagonal()[: self.n_int],
                                   layout.boundary.diagonal(k=self.n_int)])
            self.diag = xp.asarray(diag.astype(dtype))

    @staticmethod
    def _upload(spm, M, dtype):
        idx = np.int32 if M.shape[1] < 2**31 and M.nnz < 2**31 else np.int64
        data = M.data.astype(dtype)
        return spm.csr_matrix((spm_array(spm, data), spm_array(spm, M.indices.astype(idx)),
                               spm_array(spm, M.indptr.astype(idx))), shape=M.shape)

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(M, a).nbytes for M in (self.A_int, self.A_bnd)
                       for a in ("data", "indices", "indptr")))


def spm_array(spm, a):
    xp = np if spm is sp else _backend.cupy()
    return xp.asarray(a)


class DistributedVector:
    """A vector split over the shards of a :class:`ShardedSystem` (partition order).

    ``pieces[s]`` lives on shard ``s``'s device. :meth:`gather` brings it back
    into the original ordering on one device.
    """

    def __init__(self, system: ShardedSystem, pieces: list):
        self.system = system
        self.pieces = pieces

    @property
    def shape(self) -> tuple[int]:
        return (self.system.n,)

    def gather(self, device: Device | str | None = None):
        """The whole vector, original ordering, on ``device`` (default: the first shard's)."""
        return self.system.gather(self.pieces, device)


# ====================================================================== the system
class ShardedSystem:
    """A matrix partitioned over devices, ready for repeated solves.

    Parameters
    ----------
    A : scipy or cupyx sparse matrix, or dense array, shape (n, n)
    devices : "all", int or sequence of device names / Devices
        See :func:`resolve_devices`.
    reorder : {"rcm", "metis", None}
        Bandwidth-reducing reordering before splitting rows.
    weights : sequence of float, optional
        Relative nnz share per device (default: equal).
    offsets : sequence of int, optional
        Explicit row offsets of the blocks (after reordering).
    dtype : numpy dtype, optional
        Value type on the devices (default: A's, floats only).
    manager : DeviceManager, optional

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.manager import DeviceManager
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(40, 40)).tocsr()
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> S = ShardedSystem(A, devices="all", manager=dm)
    >>> r = S.solve(np.ones(40), rtol=1e-10)
    >>> r.converged, bool(np.allclose(A @ r.x, 1.0))
    (True, True)
    """

    def __init__(self, A: Any, devices: Any = "all", *, reorder: str | None = "rcm",
                 weights: Sequence[float] | None = None, offsets: Sequence[int] | None = None,
                 dtype: Any = None, manager: Any = None):
        t0 = time.perf_counter()
        A = _host_csr(A, "ShardedSystem")
        self.devices = resolve_devices(devices, manager=manager, call="ShardedSystem")
        n = A.shape[0]
        if len(self.devices) > n:
            raise ValueError(
                f"ShardedSystem(devices=...): {len(self.devices)} devices for a system of {n} "
                "rows; use at most one device per row (far fewer in practice)."
            )
        self.dtype = np.dtype(dtype or (A.dtype if A.dtype.kind == "f" else np.float64))
        if self.dtype.kind != "f":
            raise TypeError(
                f"ShardedSystem(dtype={self.dtype}): expected float32 or float64; complex and "
                "integer systems are not supported by the sharded solver."
            )
        self.n = n
        self.partition = partition.build_partition(A, len(self.devices), reorder=reorder,
                                                   weights=weights, offsets=offsets)
        self.comm = (_CudaComm(self.devices) if self.devices[0].kind == "cuda"
                     else _HostComm(self.devices))
        self.ops = _CudaOps if self.comm.is_cuda else _HostOps
        self.shards = [_Shard(lay, dev, self.dtype, self.comm)
                       for lay, dev in zip(self.partition.shards, self.devices, strict=True)]
        for sh in self.shards:
            need = sh.nbytes + 8 * (sh.nloc + sh.nhalo) * sh.xp.dtype(self.dtype).itemsize
            if sh.device.kind == "sim" and need > sh.device.total_bytes:
                raise RuntimeError(
                    f"ShardedSystem: shard {sh.index} needs about {need} bytes but "
                    f"{sh.device} holds {sh.device.total_bytes}; shard over more devices."
                )
        self._perm_on: dict[str, Any] = {}
        self._profile: dict[str, list] | None = None
        self.setup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------ vectors
    def _xp(self, s: int):
        return self.shards[s].xp

    def _ext_empty(self, s: int):
        """A local vector with room for the halo after its owned entries."""
        sh = self.shards[s]
        with self.comm.on(s):
            return sh.xp.zeros(sh.nloc + sh.nhalo, dtype=self.dtype)

    def _perm(self, device: Device | None):
        key = "host" if device is None or not device.kind == "cuda" else str(device)
        if key not in self._perm_on:
            if key == "host":
                self._perm_on[key] = self.partition.perm
            else:
                cp = _backend.cupy()
                with cp.cuda.Device(device.index):
                    self._perm_on[key] = cp.asarray(self.partition.perm)
        return self._perm_on[key]

    def scatter(self, v: Any) -> list:
        """Split a global vector (original ordering, host or GPU) into shard pieces."""
        v = _as_vector(v, self.n, "ShardedSystem.scatter", "v")
        src_dev = _device_of(v)
        perm = self._perm(src_dev)
        if src_dev is not None:
            with src_dev.context():
                vp = v[perm].astype(self.dtype, copy=False)
                # sync: the shards copy vp on their own (non-blocking) streams
                _backend.cupy().cuda.get_current_stream().synchronize()
        else:
            vp = np.asarray(v)[perm].astype(self.dtype, copy=False)
        pieces = []
        for s, sh in enumerate(self.shards):
            lo, hi = sh.layout.row_start, sh.layout.row_stop
            with self.comm.on(s):
                pieces.append(sh.xp.array(vp[lo:hi], dtype=self.dtype))
        self.comm.synchronize()
        return pieces

    def gather(self, pieces: Sequence[Any], device: Device | str | None = None):
        """Assemble shard pieces (partition order) into one vector, original ordering."""
        dev = self.devices[0] if device is None else _as_target(device, self.devices)
        self.comm.synchronize()
        if dev is not None and dev.kind == "cuda":
            cp = _backend.cupy()
            with cp.cuda.Device(dev.index):
                flat = cp.concatenate([cp.asarray(p[: self.shards[s].nloc])
                                       for s, p in enumerate(pieces)])
                out = cp.empty_like(flat)
                out[self._perm(dev)] = flat
            return out
        flat = np.concatenate([_backend.to_host(p[: self.shards[s].nloc])
                               for s, p in enumerate(pieces)])
        out = np.empty_like(flat)
        out[self.partition.perm] = flat
        return out

    # ------------------------------------------------------------ distributed kernels
    def _exchange_and_spmv(self, ve: list, y: list) -> None:
        """``y = A v`` where ``ve[s]`` holds v's owned entries (halo filled here)."""
        comm, ops = self.comm, self.ops
        prof = self._profile if comm.is_cuda else None
        if prof is not None:
            t_start = comm.timing_event(0)
        for s, sh in enumerate(self.shards):
            comm.before_pack(s)
            with comm.on(s):
                for t, idx, buf in sh.send:
                    ops.take(ve[s], idx, buf)
                    lay = self.shards[t].layout
                    a, b = next((a, b) for src, a, b in lay.recv if src == s)
                    nloc_t = self.shards[t].nloc
                    comm.copy(ve[t][nloc_t + a: nloc_t + b], t, buf, s, via_copy_stream=True)
        if prof is not None and self.shards[0].send:
            prof["halo"].append((t_start, comm.timing_event(0, copier=True)))
        for s, sh in enumerate(self.shards):
            with comm.on(s):
                # Interior rows read owned entries only: they run while the halo travels.
                ops.spmv(sh.A_int, ve[s], y[s][: sh.n_int])
        for s, sh in enumerate(self.shards):
            comm.wait_incoming(s)
            with comm.on(s):
                ops.spmv(sh.A_bnd, ve[s], y[s][sh.n_int:])

    def _allreduce(self, parts: list, red: list, tot: list, slot: int) -> list:
        """Sum ``parts`` (one small vector per shard) onto every shard.

        Each shard receives every partial and sums them in shard order, so all
        shards hold bit-identical sums. Two buffers alternate (``slot``): a
        shard writes slot k again only after it has received the next
        reduction's partials from every other shard, which those queued after
        summing slot k, so no sum can be overwritten before it is read.
        """
        comm = self.comm
        P = len(self.shards)
        prof = self._profile if comm.is_cuda else None
        if prof is not None:
            t_start = comm.timing_event(0)
        for s in range(P):
            for t in range(P):
                comm.copy(red[t][slot][s], t, parts[s], s)
        for t in range(P):
            comm.wait_incoming(t)
            with comm.on(t):
                self.shards[t].xp.sum(red[t][slot], axis=0, out=tot[t][slot])
        if prof is not None:
            prof["reduce"].append((t_start, comm.timing_event(0)))
        return [tot[t][slot] for t in range(P)]

    def matvec(self, x: Any, device: Device | str | None = None):
        """``A @ x`` through the distributed product (the halo exchange included).

        Examples
        --------
        >>> import numpy as np, scipy.sparse as sp
        >>> from managed_solve.manager import DeviceManager
        >>> A = sp.random(30, 30, density=0.2, random_state=0, format="csr") + sp.eye(30)
        >>> S = ShardedSystem(A, devices=3, manager=DeviceManager(simulate="3x1GiB"))
        >>> x = np.arange(30.0)
        >>> bool(np.allclose(S.matvec(x), A @ x))
        True
        """
        pieces = self.scatter(x)
        ve = [self._ext_empty(s) for s in range(len(self.shards))]
        y = []
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                ve[s][: sh.nloc] = pieces[s]
                y.append(sh.xp.empty(sh.nloc, dtype=self.dtype))
        self._exchange_and_spmv(ve, y)
        return self.gather(y, device)

    # ------------------------------------------------------------ solve
    def solve(self, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
              maxiter: int | None = None, method: str = "cg", M: Any = None,
              gather_to: Any = None, check_every: int | None = None,
              profile: bool = False) -> SolveResult:
        """Solve ``A x = b`` over the shards; see :func:`solve_sharded`.

        ``profile=True`` (CUDA only) records timing events around every halo
        exchange (packing to the last copy landing, on the first shard) and
        every all-reduce, and reports their totals in ``info["profile"]``
        (milliseconds). The events themselves cost a little: time solves
        without it.
        """
        call = "solve_sharded"
        method = str(method).lower()
        if method not in ("cg", "bicgstab"):
            raise ValueError(
                f"{call}(method={method!r}): the sharded solver runs 'cg' (symmetric positive "
                "definite A) or 'bicgstab' (general A)."
            )
        if M is not None and not (isinstance(M, str) and M.lower() == "jacobi"):
            raise ValueError(
                f"{call}(M={M!r}): the sharded solver supports M=None or M='jacobi'; other "
                "preconditioners need the whole matrix on one device (solve(A, b, M=...))."
            )
        jacobi = M is not None
        if not (rtol >= 0 and atol >= 0):
            raise ValueError(f"{call}(rtol={rtol}, atol={atol}): tolerances must be >= 0, e.g. rtol=1e-8.")
        maxiter = max(100, 10 * self.n) if maxiter is None else int(maxiter)
        if maxiter < 0:
            raise ValueError(f"{call}(maxiter={maxiter}): expected a count >= 0 or None.")
        if check_every is None:
            check_every = GPU_CHECK_EVERY if self.comm.is_cuda else 1
        distributed = gather_to is False
        target = None if distributed else (
            self.devices[0] if gather_to is None else _as_target(gather_to, self.devices))
        if jacobi:
            for k, sh in enumerate(self.shards):
                with self.comm.on(k):
                    zero = (sh.diag == 0).any()
                # sync: once per solve, validating the preconditioner
                if bool(self.comm.read(k, zero)):
                    raise ValueError(
                        f"{call}(M='jacobi'): A has a zero on its diagonal; Jacobi needs a "
                        "non-zero diagonal. Use M=None."
                    )
        t0 = time.perf_counter()
        bp = self.scatter(b)
        xp0 = self.scatter(x0) if x0 is not None else None
        loop = self._cg if method == "cg" else self._bicgstab
        self._profile = {"halo": [], "reduce": []} if profile else None
        try:
            x, code, its, syncs, info = loop(bp, xp0, rtol, atol, maxiter, jacobi, check_every)
        finally:
            prof, self._profile = self._profile, None
        if prof is not None:
            self.comm.synchronize()
            info["profile"] = {
                f"{k}_ms": float(sum(self.comm.cp.cuda.get_elapsed_time(a, b) for a, b in v))
                for k, v in prof.items()
            } if self.comm.is_cuda else {}
            info["profile"].update({f"{k}_count": len(v) for k, v in prof.items()})
        # True residual, through the same distributed product.
        rnorm, bnorm = self._true_residual(bp, x)
        syncs += 1
        self.comm.synchronize()
        seconds = time.perf_counter() - t0
        xg = DistributedVector(self, x) if distributed else self.gather(x, target or "cpu")
        status = {_CONVERGED: Status.CONVERGED, _MAXITER: Status.MAXITER,
                  _BREAKDOWN: Status.BREAKDOWN}[code]
        msg = info.pop("message", "") or status.message
        info.update(shards=len(self.shards), host_syncs=syncs, setup_seconds=self.setup_seconds,
                    halo_sizes=self.partition.halo_sizes().tolist(),
                    nnz_per_shard=self.partition.nnz_per_shard().tolist(),
                    reorder=self.partition.reorder, devices=[str(d) for d in self.devices])
        return SolveResult(xg, status, its, rnorm, bnorm,
                           device="distributed" if distributed else str(target or "cpu"),
                           seconds=seconds, method=method, message=msg, info=info)

    def _true_residual(self, bp: list, x: list) -> tuple[float, float]:
        P = len(self.shards)
        xe = [self._ext_empty(s) for s in range(P)]
        y = []
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                xe[s][: sh.nloc] = x[s]
                y.append(sh.xp.empty(sh.nloc, dtype=self.dtype))
        self._exchange_and_spmv(xe, y)
        parts = []
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                r = bp[s] - y[s]
                parts.append(sh.xp.stack([sh.xp.dot(r, r), sh.xp.dot(bp[s], bp[s])]))
        # sync: one host read of the final residual and ||b|| per solve
        h = np.sum([self.comm.read(s, p) for s, p in enumerate(parts)], axis=0)
        return float(np.sqrt(h[0])), float(np.sqrt(h[1]))

    def _reduction_buffers(self, k: int):
        red, tot = [], []
        P = len(self.shards)
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                red.append([sh.xp.zeros((P, k), dtype=self.dtype) for _ in range(2)])
                tot.append([sh.xp.zeros(k, dtype=self.dtype) for _ in range(2)])
        return red, tot

    def _cg(self, bp, x0p, rtol, atol, maxiter, jacobi, every):
        """Chronopoulos-Gear CG: one all-reduce of (r,u), (Au,u), (r,r) per iteration.

        Equal to CG in exact arithmetic (Chronopoulos & Gear 1989; Ghysels &
        Vanroose 2014, Alg. 2): ``s = A p`` is carried by its own recurrence,
        so the two dot products of textbook CG become one reduction, at the
        cost of two more vectors (``s``, ``w``).
        """
        P, ops, comm = len(self.shards), self.ops, self.comm
        sh_ = self.shards
        xs, r, ue, w, p, s_, dinv, parts = [], [], [], [], [], [], [], []
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                xs.append(xp.zeros(sh.nloc, self.dtype) if x0p is None else x0p[k].copy())
                ue.append(xp.zeros(sh.nloc + sh.nhalo, self.dtype))
                w.append(xp.empty(sh.nloc, self.dtype))
                p.append(xp.empty(sh.nloc, self.dtype))
                s_.append(xp.empty(sh.nloc, self.dtype))
                parts.append(xp.zeros(4, self.dtype))
                dinv.append(1.0 / sh.diag if jacobi else None)
                # Without a preconditioner u = r: r lives in the owned part of
                # the halo-extended buffer, saving a vector and a copy.
                r.append(xp.empty(sh.nloc, self.dtype) if jacobi else ue[k][: sh.nloc])
        red, tot = self._reduction_buffers(4)
        # r0 = b - A x0
        if x0p is not None:
            xe = [self._ext_empty(k) for k in range(P)]
            for k, sh in enumerate(sh_):
                with comm.on(k):
                    xe[k][: sh.nloc] = xs[k]
            self._exchange_and_spmv(xe, w)
            for k in range(P):
                with comm.on(k):
                    r[k][...] = bp[k] - w[k]
        else:
            for k in range(P):
                with comm.on(k):
                    r[k][...] = bp[k]

        def precondition():
            if jacobi:
                for k, sh in enumerate(sh_):
                    with comm.on(k):
                        sh.xp.multiply(dinv[k], r[k], out=ue[k][: sh.nloc])

        precondition()
        self._exchange_and_spmv(ue, w)
        for k, sh in enumerate(sh_):
            with comm.on(k):
                ops.dots3(r[k], ue[k][: sh.nloc], w[k], parts[k])
                parts[k][3] = sh.xp.dot(bp[k], bp[k])
        slot = 0
        tt = self._allreduce(parts, red, tot, slot)
        # sync: ||b|| and ||r0|| once per solve, for the stopping threshold
        t0h = self.comm.read(0, tt[0])
        syncs = 1
        b_norm, r0 = float(np.sqrt(t0h[3])), float(np.sqrt(max(t0h[2], 0.0)))
        tol = max(float(rtol) * b_norm, float(atol))
        if r0 <= tol or maxiter == 0:
            return xs, (_CONVERGED if r0 <= tol else _MAXITER), 0, syncs, {}

        # sc = [gamma, alpha, beta, bad] per shard, kept on its device.
        sc = []
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                v = xp.zeros(4, self.dtype)
                v[0:1] = tt[k][0:1]
                v[1:2] = _safe_div(xp, tt[k][0:1], tt[k][1:2])
                v[3:4] = (tt[k][1:2] <= 0).astype(self.dtype)
                sc.append(v)
                p[k][...] = ue[k][: sh.nloc]
                s_[k][...] = w[k]
        with comm.on(0):
            hist = sh_[0].xp.empty(every, dtype=self.dtype)
        tol2 = tol * tol
        start = 1
        for it in range(1, maxiter + 1):
            for k in range(P):
                with comm.on(k):
                    ops.update_xr(sc[k][1:2], p[k], s_[k], xs[k], r[k])
            precondition()
            self._exchange_and_spmv(ue, w)
            for k, sh in enumerate(sh_):
                with comm.on(k):
                    ops.dots3(r[k], ue[k][: sh.nloc], w[k], parts[k])
            slot ^= 1
            tt = self._allreduce(parts, red, tot, slot)
            for k, sh in enumerate(sh_):
                with comm.on(k):
                    ops.cg_scalars(sc[k], tt[k], tol2, hist, it - start if k == 0 else -1)
                    ops.update_ps(sc[k][2:3], ue[k][: sh.nloc], w[k], p[k], s_[k])
            if it - start + 1 == every or it == maxiter:
                # sync: reads the residual history and the breakdown flag on the host
                h = np.sqrt(np.maximum(comm.read(0, hist[: it - start + 1]), 0.0))
                broke = bool(comm.read(0, sc[0][3:4])[0])
                syncs += 1
                hit = np.flatnonzero(h <= tol)
                if broke:
                    return xs, _BREAKDOWN, it, syncs, {"message": (
                        "CG met non-positive curvature: A is not symmetric positive definite. "
                        "Use method='bicgstab' for a general matrix.")}
                if not np.all(np.isfinite(h)):
                    return xs, _BREAKDOWN, it, syncs, {"message": (
                        "CG produced a non-finite residual; A may be singular or not positive "
                        "definite.")}
                if hit.size:
                    return xs, _CONVERGED, it, syncs, {"converged_at": start + int(hit[0])}
                start = it + 1
        return xs, _MAXITER, maxiter, syncs, {}

    def _bicgstab(self, bp, x0p, rtol, atol, maxiter, jacobi, every):
        """BiCGStab (van der Vorst 1992), right-preconditioned by Jacobi when asked.

        Three all-reduces per iteration: (rhat, v); (t, s) with (t, t); and
        (rhat, r) with (r, r), the last also giving the residual norm.
        """
        P, comm = len(self.shards), self.comm
        sh_ = self.shards
        X = {name: [] for name in ("x", "r", "rhat", "p", "v", "s", "t", "ph", "sh")}
        dinv = []
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                X["x"].append(xp.zeros(sh.nloc, self.dtype) if x0p is None else x0p[k].copy())
                for name in ("r", "p", "v", "s", "t"):
                    X[name].append(xp.zeros(sh.nloc, self.dtype))
                # The vectors multiplied by A carry room for the halo.
                X["ph"].append(xp.zeros(sh.nloc + sh.nhalo, self.dtype))
                X["sh"].append(xp.zeros(sh.nloc + sh.nhalo, self.dtype))
                dinv.append(1.0 / sh.diag if jacobi else None)
        red, tot = self._reduction_buffers(3)
        x, r, rhat, p, v, s, t, ph, shv = (X[k] for k in ("x", "r", "rhat", "p", "v", "s", "t",
                                                          "ph", "sh"))
        if x0p is not None:
            for k, sh in enumerate(sh_):
                with comm.on(k):
                    ph[k][: sh.nloc] = x[k]
            self._exchange_and_spmv(ph, v)
            for k in range(P):
                with comm.on(k):
                    r[k][...] = bp[k] - v[k]
        else:
            for k in range(P):
                with comm.on(k):
                    r[k][...] = bp[k]
        parts = []
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                rhat.append(r[k].copy())
                parts.append(xp.stack([xp.dot(r[k], r[k]), xp.dot(bp[k], bp[k]),
                                       xp.zeros((), self.dtype)]))
        slot = 0
        tt = self._allreduce(parts, red, tot, slot)
        # sync: ||b|| and ||r0|| once per solve, for the stopping threshold
        t0h = self.comm.read(0, tt[0])
        syncs = 1
        b_norm, r0 = float(np.sqrt(t0h[1])), float(np.sqrt(t0h[0]))
        tol = max(float(rtol) * b_norm, float(atol))
        if r0 <= tol or maxiter == 0:
            return x, (_CONVERGED if r0 <= tol else _MAXITER), 0, syncs, {}
        rho = []
        for k in range(P):
            with comm.on(k):
                rho.append(tt[k][0:1].copy())
        alpha = [None] * P
        omega = [None] * P
        bad = [None] * P
        for k, sh in enumerate(sh_):
            with comm.on(k):
                p[k][...] = r[k]
                bad[k] = sh.xp.zeros(1, dtype=bool)
        hist = None
        with comm.on(0):
            hist = sh_[0].xp.empty(every, dtype=np.float64)

        def apply(src, ext, out):
            for k, sh in enumerate(sh_):
                with comm.on(k):
                    if jacobi:
                        sh.xp.multiply(dinv[k], src[k], out=ext[k][: sh.nloc])
                    else:
                        ext[k][: sh.nloc] = src[k]
            self._exchange_and_spmv(ext, out)

        start = 1
        for it in range(1, maxiter + 1):
            apply(p, ph, v)  # v = A M p
            for k, sh in enumerate(sh_):
                xp = sh.xp
                with comm.on(k):
                    parts[k][0] = xp.dot(rhat[k], v[k])
            slot ^= 1
            tt = self._allreduce(parts, red, tot, slot)
            for k, sh in enumerate(sh_):
                xp = sh.xp
                with comm.on(k):
                    alpha[k] = _safe_div(xp, rho[k], tt[k][0:1])
                    bad[k] = bad[k] | (tt[k][0:1] == 0)
                    xp.subtract(r[k], alpha[k] * v[k], out=s[k])
            apply(s, shv, t)  # t = A M s
            for k, sh in enumerate(sh_):
                xp = sh.xp
                with comm.on(k):
                    parts[k][0] = xp.dot(t[k], s[k])
                    parts[k][1] = xp.dot(t[k], t[k])
            slot ^= 1
            tt = self._allreduce(parts, red, tot, slot)
            for k, sh in enumerate(sh_):
                xp = sh.xp
                with comm.on(k):
                    omega[k] = _safe_div(xp, tt[k][0:1], tt[k][1:2])
                    # x += alpha M p + omega M s; the M-applied vectors are in ph, sh.
                    x[k] += alpha[k] * ph[k][: sh.nloc] + omega[k] * shv[k][: sh.nloc]
                    xp.subtract(s[k], omega[k] * t[k], out=r[k])
                    parts[k][0] = xp.dot(rhat[k], r[k])
                    parts[k][1] = xp.dot(r[k], r[k])
            slot ^= 1
            tt = self._allreduce(parts, red, tot, slot)
            for k, sh in enumerate(sh_):
                xp = sh.xp
                with comm.on(k):
                    rho_new = tt[k][0:1]
                    unconv = tt[k][1:2] > tol * tol
                    bad[k] = bad[k] | (((rho_new == 0) | (omega[k] == 0)) & unconv)
                    beta = _safe_div(xp, rho_new, rho[k]) * _safe_div(xp, alpha[k], omega[k])
                    rho[k] = rho_new.copy()
                    # p = r + beta (p - omega v)
                    p[k] -= omega[k] * v[k]
                    p[k] *= beta
                    p[k] += r[k]
                    if k == 0:
                        hist[it - start] = tt[0][1]
            if it - start + 1 == every or it == maxiter:
                # sync: reads the residual history and the breakdown flag on the host
                h = np.sqrt(np.maximum(comm.read(0, hist[: it - start + 1]), 0.0))
                broke = bool(comm.read(0, bad[0])[0])
                syncs += 1
                hit = np.flatnonzero(h <= tol)
                if hit.size:
                    return x, _CONVERGED, it, syncs, {"converged_at": start + int(hit[0])}
                if broke or not np.all(np.isfinite(h)):
                    return x, _BREAKDOWN, it, syncs, {"message": (
                        "BiCGStab broke down (a vanishing inner product); try M='jacobi' or "
                        "solve(A, b, method='gmres') on one device.")}
                start = it + 1
        return x, _MAXITER, maxiter, syncs, {}


def _safe_div(xp, num, den):
    """``num / den`` where ``den != 0``, else 0 (iterating past convergence divides 0 by 0)."""
    nz = den != 0
    return xp.where(nz, num / xp.where(nz, den, 1), 0).astype(num.dtype, copy=False)


# ====================================================================== helpers
def _host_csr(A: Any, call: str) -> sp.csr_matrix:
    if _backend.is_cupy_sparse(A):
        A = A.get()
    elif _backend.is_cupy_array(A):
        A = _backend.to_host(A)
    if sp.issparse(A):
        A = sp.csr_matrix(A)
    elif isinstance(A, np.ndarray) and A.ndim == 2:
        A = sp.csr_matrix(A)
    else:
        raise TypeError(
            f"{call}(A=...): got a {type(A).__name__}; expected a SciPy or cupyx sparse matrix "
            "or a 2-D array. Convert torch tensors with LinearSystem or .numpy() first."
        )
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{call}(A=...): A must be square, got shape {A.shape}.")
    if A.shape[0] == 0:
        raise ValueError(f"{call}(A=...): A is empty (shape {A.shape}); nothing to solve.")
    return A


def _device_of(v: Any) -> Device | None:
    if _backend.is_cupy_array(v):
        return Device("cuda", int(v.device.id), "", 0)
    return None


def _as_vector(v: Any, n: int, call: str, name: str):
    if _backend.is_torch_tensor(v):
        raise TypeError(f"{call}({name}=...): got a torch tensor; pass a NumPy or CuPy array "
                        "(torch.Tensor.numpy() or cupy.from_dlpack).")
    if not _backend.is_cupy_array(v):
        v = np.asarray(v)
    if v.ndim == 2 and v.shape[1] == 1:
        v = v[:, 0]
    if v.shape != (n,):
        raise ValueError(f"{call}({name}=...): expected shape ({n},) to match A, got {v.shape}.")
    if v.dtype.kind not in "fiu":
        raise TypeError(f"{call}({name}=...): expected real numbers, got dtype {v.dtype}.")
    return v


def _as_target(device: Any, devices: Sequence[Device]) -> Device | None:
    """Where ``gather_to`` puts x: a shard's device, or the host ("cpu") as None-device."""
    if isinstance(device, Device):
        if device.kind == "cpu":
            return None
        return device
    name = str(device).strip().lower()
    if name in ("cpu", "host"):
        return None
    for d in devices:
        if str(d) == name:
            return d
    raise ValueError(
        f"solve_sharded(gather_to={device!r}): expected one of the shard devices "
        f"{[str(d) for d in devices]}, 'cpu', or False to leave x distributed."
    )


# ====================================================================== cache and entry point
_CACHE: dict[int, tuple[Any, tuple, ShardedSystem]] = {}


def clear_cache() -> None:
    """Forget every cached :class:`ShardedSystem` (after modifying a matrix in place)."""
    _CACHE.clear()


def sharded_system(A: Any, devices: Any, *, reorder: str | None = "rcm",
                   weights: Sequence[float] | None = None, manager: Any = None) -> ShardedSystem:
    """The cached :class:`ShardedSystem` of ``A`` on ``devices`` (built on first use).

    The cache is keyed by the matrix object (held weakly) and the devices,
    reordering and weights; a matrix modified in place is not noticed: call
    :func:`clear_cache` or build a :class:`ShardedSystem` yourself.
    """
    devs = resolve_devices(devices, manager=manager)
    wkey = None if weights is None else tuple(float(w) for w in weights)
    key = (tuple(str(d) for d in devs), reorder, wkey, getattr(A, "shape", None),
           getattr(A, "nnz", None))
    hit = _CACHE.get(id(A))
    if hit is not None:
        ref, k, system = hit
        if ref() is A and k == key:
            return system
    system = ShardedSystem(A, devs, reorder=reorder, weights=weights, manager=manager)
    try:
        ref = weakref.ref(A)
        weakref.finalize(A, _CACHE.pop, id(A), None)
    except TypeError:  # objects without weak references are not cached
        return system
    _CACHE[id(A)] = (ref, key, system)
    return system


def solve_sharded(A: Any, b: Any, *, devices: Any, x0: Any = None, rtol: float = 1e-8,
                  atol: float = 0.0, maxiter: int | None = None, method: str = "cg",
                  M: Any = None, reorder: str | None = "rcm", gather_to: Any = None,
                  weights: Sequence[float] | None = None, manager: Any = None,
                  check_every: int | None = None) -> SolveResult:
    """Solve one linear system with its rows sharded over several GPUs.

    Parameters
    ----------
    A : scipy or cupyx sparse matrix, shape (n, n)
        SPD for ``method="cg"``; any non-singular matrix for ``"bicgstab"``.
    b : array, shape (n,)
        NumPy or CuPy.
    devices : "all", int, or sequence of device names / Devices
        GPUs (or simulated GPUs) to shard over; see :func:`resolve_devices`.
    x0 : array, optional
        Initial guess (zeros by default).
    rtol, atol : float
        Converged when ``||r|| <= max(rtol * ||b||, atol)`` (SciPy's rule).
    maxiter : int, optional
        Default ``10 * n`` (at least 100).
    method : {"cg", "bicgstab"}
    M : None or "jacobi"
    reorder : {"rcm", "metis", None}
        Reordering before the row split (the returned x is in A's ordering).
    gather_to : device name, "cpu" or False, optional
        Where x is gathered: the first shard's device by default; ``False``
        leaves it distributed (a :class:`DistributedVector`).
    weights : sequence of float, optional
        Relative nnz share per device (uneven devices).
    manager : DeviceManager, optional
        Resolves device names (default: the package's default manager).
    check_every : int, optional
        Iterations between host reads of the residual (8 on GPUs, 1 simulated).

    Returns
    -------
    SolveResult
        ``residual_norm`` is the true residual ``||b - A x||``; ``info``
        holds ``shards``, ``host_syncs``, ``halo_sizes``, ``nnz_per_shard``.

    Raises
    ------
    ValueError, TypeError, RuntimeError
        Bad ``devices`` (empty, duplicated, the CPU, unknown names, none
        available), shapes, dtypes or options.

    See Also
    --------
    scipy.sparse.linalg.cg : the same argument names.
    ShardedSystem : the cached set-up, for repeated solves.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.manager import DeviceManager
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(16, 16))
    >>> A = (sp.kron(sp.eye(16), T) + sp.kron(T, sp.eye(16))).tocsr()
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> res = solve_sharded(A, np.ones(256), devices="all", manager=dm, rtol=1e-10)
    >>> res.converged, res.info["shards"], res.relative_residual < 1e-9
    (True, 2, True)
    """
    system = sharded_system(A, devices, reorder=reorder, weights=weights, manager=manager)
    return system.solve(b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter, method=method, M=M,
                        gather_to=gather_to, check_every=check_every)
