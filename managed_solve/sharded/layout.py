"""A matrix partitioned over devices: the shards, distributed vectors and the distributed product.

:class:`ShardedSystem` places one row block of a :class:`~managed_solve.sharded.partition.Partition`
per device and provides what the Krylov loops (:mod:`managed_solve.sharded.krylov`) run on.
Each product ``A v``:

1. packs the entries neighbours need and starts the halo copies on a
   dedicated copy stream (peer-to-peer between GPUs);
2. multiplies the interior rows meanwhile (they read owned entries only);
3. waits for the halo and multiplies the boundary rows.

Dot products are reduced across shards by an all-to-all copy of each shard's
partial sums followed by the same summation on every device, so every shard
computes bit-identical scalars without a host round trip.

Simulated devices (``DeviceManager(simulate="3x1GiB")``) run the same code on
NumPy arrays: the exchange is an array copy, events and streams are no-ops.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import _backend, config
from ..devices import Device, SimulatedOutOfMemory
from ..result import SolveResult, Status
from ..solvers._common import refuse_unscalable_diagonal, wide_residual
from ..solvers.engine import BREAKDOWN, CONVERGED, MAXITER, Outcome
from ..solvers.verify import status_of
from . import krylov, partition
from .comm import CudaComm, CudaOps, HostComm, HostOps
from .inputs import as_vector, device_of, gather_target, host_csr, resolve_devices

__all__ = ["DistributedVector", "Shard", "ShardedOutcome", "ShardedSystem", "check_options"]

_STATUS = {CONVERGED: Status.CONVERGED, MAXITER: Status.MAXITER, BREAKDOWN: Status.BREAKDOWN}
_CODE = {status: code for code, status in _STATUS.items()}

#: What a sharded solve takes instead of Jacobi (its only other preconditioner is none).
SHARDED_INSTEAD = "M=None"


# ====================================================================== shards
class Shard:
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

    def with_values(self, layout: partition.ShardLayout, dtype, comm) -> Shard:
        """A shard sharing this one's indices and buffers, holding ``layout``'s values."""
        other = copy.copy(self)
        other.layout = layout
        xp = self.xp
        with comm.on(self.index):
            spm = _backend.sparse_module(xp)
            other.A_int = spm.csr_matrix(
                (spm_array(spm, layout.interior.data.astype(dtype)), self.A_int.indices,
                 self.A_int.indptr), shape=self.A_int.shape)
            other.A_bnd = spm.csr_matrix(
                (spm_array(spm, layout.boundary.data.astype(dtype)), self.A_bnd.indices,
                 self.A_bnd.indptr), shape=self.A_bnd.shape)
            diag = np.concatenate([layout.interior.diagonal()[: self.n_int],
                                   layout.boundary.diagonal(k=self.n_int)])
            other.diag = xp.asarray(diag.astype(dtype))
        return other

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
        A = host_csr(A, "ShardedSystem")
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
        self.comm = (CudaComm(self.devices) if self.devices[0].is_cuda
                     else HostComm(self.devices))
        self.ops = CudaOps if self.comm.is_cuda else HostOps
        self.shards = [Shard(lay, dev, self.dtype, self.comm)
                       for lay, dev in zip(self.partition.shards, self.devices, strict=True)]
        for sh in self.shards:
            need = sh.nbytes + 8 * (sh.nloc + sh.nhalo) * sh.xp.dtype(self.dtype).itemsize
            if sh.device.is_simulated and need > sh.device.total_bytes:
                raise SimulatedOutOfMemory(
                    f"ShardedSystem: shard {sh.index} needs about {need} bytes but "
                    f"{sh.device} holds {sh.device.total_bytes}; shard over more devices."
                )
        self._perm_on: dict[str, Any] = {}
        self._profile: dict[str, list] | None = None
        self.setup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------ vectors
    def _xp(self, s: int):
        return self.shards[s].xp

    def ext_empty(self, s: int):
        """A local vector with room for the halo after its owned entries."""
        sh = self.shards[s]
        with self.comm.on(s):
            return sh.xp.zeros(sh.nloc + sh.nhalo, dtype=self.dtype)

    def _perm(self, device: Device | None):
        key = "host" if device is None or not device.is_cuda else str(device)
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
        v = as_vector(v, self.n, "ShardedSystem.scatter", "v")
        src_dev = device_of(v)
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
        dev = self.devices[0] if device is None else gather_target(device, self.devices)
        self.comm.synchronize()
        if dev is not None and dev.is_cuda:
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
    def exchange_and_spmv(self, ve: list, y: list) -> None:
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

    def allreduce(self, parts: list, red: list, tot: list, slot: int) -> list:
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
        ve = [self.ext_empty(s) for s in range(len(self.shards))]
        y = []
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                ve[s][: sh.nloc] = pieces[s]
                y.append(sh.xp.empty(sh.nloc, dtype=self.dtype))
        self.exchange_and_spmv(ve, y)
        return self.gather(y, device)

    # ------------------------------------------------------------ solve
    def solve(self, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
              maxiter: int | None = None, method: str = "cg", M: Any = None,
              gather_to: Any = None, check_every: int | None = None,
              profile: bool = False) -> SolveResult:
        """Solve ``A x = b`` over the shards; see :func:`~managed_solve.sharded.solve_sharded`.

        ``profile=True`` (CUDA only) records timing events around every halo
        exchange (packing to the last copy landing, on the first shard) and
        every all-reduce, and reports their totals in ``info["profile"]``
        (milliseconds). The events themselves cost a little: time solves
        without it.
        """
        call = "solve_sharded"
        method, jacobi, maxiter = check_options(call, method, M, rtol, atol, maxiter, self.n)
        distributed = gather_to is False
        target = None if distributed else (
            self.devices[0] if gather_to is None else gather_target(gather_to, self.devices))
        if jacobi:
            self.check_jacobi(call)
        return self.run(b, x0, rtol=rtol, atol=atol, maxiter=maxiter, method=method,
                        jacobi=jacobi, check_every=check_every, target=target,
                        distributed=distributed, profile=profile).to_result()

    def check_jacobi(self, call: str) -> None:
        """Refuse a diagonal Jacobi cannot divide by, by the rule every solve follows.

        :func:`~managed_solve.solvers._common.refuse_unscalable_diagonal` on each shard's
        diagonal, where the loops divide by it (a GPU's arithmetic); where one is refused, on
        the diagonal gathered in A's own order, so that the error names A's rows, not a
        shard's local ones.
        """
        label = f"{call}(M='jacobi')"
        for k, sh in enumerate(self.shards):
            with self.comm.on(k):
                try:
                    # sync: once per shard and solve
                    refuse_unscalable_diagonal(sh.diag, label, SHARDED_INSTEAD)
                    continue
                except ValueError as exc:
                    local = exc
            refuse_unscalable_diagonal(self.gather([s.diag for s in self.shards]), label,
                                       SHARDED_INSTEAD)
            raise local  # not reached unless the gathered copy reads otherwise: the shard's error

    def run(self, b: Any, x0: Any, *, rtol: float, atol: float, maxiter: int, method: str,
            jacobi: bool, check_every: int | None, target: Device | None,
            distributed: bool = False, profile: bool = False) -> ShardedOutcome:
        """One solve with checked options (:func:`check_options`): scatter, iterate, verify, gather.

        ``target`` is where x is gathered (None: the host); ``distributed``
        leaves it on the shards as a :class:`DistributedVector`.
        """
        if check_every is None:
            check_every = config.current().sharded_check_every if self.comm.is_cuda else 1
        t0 = time.perf_counter()
        bp = self.scatter(b)
        xp0 = self.scatter(x0) if x0 is not None else None
        loop = krylov.cg if method == "cg" else krylov.bicgstab
        self._profile = {"halo": [], "reduce": []} if profile else None
        try:
            x, code, its, syncs, info = loop(self, bp, xp0, rtol, atol, maxiter, jacobi,
                                             check_every)
        finally:
            prof, self._profile = self._profile, None
        if prof is not None:
            self.comm.synchronize()
            info["profile"] = {
                f"{k}_ms": float(sum(self.comm.cp.cuda.get_elapsed_time(a, b) for a, b in v))
                for k, v in prof.items()
            } if self.comm.is_cuda else {}
            info["profile"].update({f"{k}_count": len(v) for k, v in prof.items()})
        # True residual, through the same distributed product, judged by the
        # verify rule: the recurrence's convergence is not the answer's (float32
        # drifts), and no restart follows here.
        rnorm, bnorm = self._true_residual(bp, x)
        syncs += 1
        if code == CONVERGED:
            tol = max(float(rtol) * bnorm, float(atol))
            status, text = status_of(Outcome(None, code, its, rnorm), method, rnorm, tol,
                                     SimpleNamespace(rtol=rtol, dtype=np.dtype(self.dtype)),
                                     restarts=0)
            if status is not Status.CONVERGED:
                code, info["message"] = _CODE[status], text
        self.comm.synchronize()
        seconds = time.perf_counter() - t0
        xg = DistributedVector(self, x) if distributed else self.gather(x, target or "cpu")
        msg = info.pop("message", "") or _STATUS[code].message
        info.update(shards=len(self.shards), host_syncs=syncs, setup_seconds=self.setup_seconds,
                    halo_sizes=self.partition.halo_sizes().tolist(),
                    nnz_per_shard=self.partition.nnz_per_shard().tolist(),
                    reorder=self.partition.reorder, devices=[str(d) for d in self.devices])
        return ShardedOutcome(xg, code, its, rnorm, msg, syncs, info, b_norm=bnorm,
                              seconds=seconds, method=method,
                              where="distributed" if distributed else str(target or "cpu"))

    def _true_residual(self, bp: list, x: list) -> tuple[float, float]:
        P = len(self.shards)
        xe = [self.ext_empty(s) for s in range(P)]
        y = []
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                xe[s][: sh.nloc] = x[s]
                y.append(sh.xp.empty(sh.nloc, dtype=self.dtype))
        self.exchange_and_spmv(xe, y)
        parts = []
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                b64 = bp[s].astype(np.float64)
                if self.dtype == np.float32:
                    # In float64 from the products on (each exact there): a float32
                    # product's rounding would blur the residual the tolerance is about.
                    # The halo of xe[s] came with the exchange above.
                    r = sh.xp.concatenate([
                        wide_residual(sh.A_int, bp[s][: sh.n_int], xe[s], sh.xp),
                        wide_residual(sh.A_bnd, bp[s][sh.n_int:], xe[s], sh.xp)])
                else:
                    r = b64 - y[s]
                parts.append(sh.xp.stack([sh.xp.dot(r, r), sh.xp.dot(b64, b64)]))
        # sync: one host read of the final residual and ||b|| per solve
        h = np.sum([self.comm.read(s, p) for s, p in enumerate(parts)], axis=0)
        return float(np.sqrt(h[0])), float(np.sqrt(h[1]))

    def reduction_buffers(self, k: int):
        red, tot = [], []
        P = len(self.shards)
        for s, sh in enumerate(self.shards):
            with self.comm.on(s):
                red.append([sh.xp.zeros((P, k), dtype=self.dtype) for _ in range(2)])
                tot.append([sh.xp.zeros(k, dtype=self.dtype) for _ in range(2)])
        return red, tot

    # ------------------------------------------------------------ new values
    def with_values(self, A: Any) -> ShardedSystem:
        """This system with ``A``'s values: same pattern, same devices, nothing partitioned again.

        Only the values travel to the devices; the index arrays, halo maps
        and buffers are shared with ``self``, which keeps its own values (so
        a cached set-up stays valid for the matrix it was built from).

        Raises
        ------
        ValueError
            ``A`` has another shape or sparsity pattern.
        """
        t0 = time.perf_counter()
        new_partition = self.partition.with_values(host_csr(A, "ShardedSystem.with_values"))
        other = copy.copy(self)
        other.partition = new_partition
        other.shards = [sh.with_values(lay, self.dtype, self.comm)
                        for sh, lay in zip(self.shards, new_partition.shards, strict=True)]
        other._profile = None
        other.setup_seconds = time.perf_counter() - t0
        return other


# ====================================================================== options and outcome
def check_options(call: str, method: str, M: Any, rtol: float, atol: float,
                  maxiter: int | None, n: int) -> tuple[str, bool, int]:
    """``(method, jacobi, maxiter)`` from a sharded solve's options, or a ValueError naming the fix."""
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
    maxiter = max(100, 10 * n) if maxiter is None else int(maxiter)
    if maxiter < 0:
        raise ValueError(f"{call}(maxiter={maxiter}): expected a count >= 0 or None.")
    return method, jacobi, maxiter


@dataclass
class ShardedOutcome(Outcome):
    """An engine :class:`~managed_solve.solvers.engine.Outcome` plus what a sharded solve knows.

    ``residual_norm`` is the true residual ``||b - A x||`` (computed through
    the distributed product: the caller cannot check it without the shards).
    """

    b_norm: float = float("nan")
    seconds: float = 0.0
    method: str = ""
    where: str = ""  # the device x was gathered to, "cpu" or "distributed"

    @property
    def status(self) -> Status:
        return _STATUS[self.code]

    def to_result(self) -> SolveResult:
        """The user-facing :class:`~managed_solve.result.SolveResult` of this outcome."""
        return SolveResult(self.x, self.status, self.iterations, self.residual_norm, self.b_norm,
                           device=self.where, seconds=self.seconds, method=self.method,
                           message=self.message, info=self.info)
