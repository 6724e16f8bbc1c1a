"""``solve_many``: many independent systems, batched, dispersed over every device, nothing lost.

The data flow of DESIGN.md, one function per step:

1. :func:`_validate` turns each input into a :class:`LinearSystem` (a bad one
   becomes an ``INVALID_INPUT`` result, the rest go on);
2. :func:`estimate` predicts bytes and cost per system and picks its route
   (batched Krylov core, ``solve()`` alone, or a host LU);
3. :func:`plan_work` packs batches and disperses them longest-first over the
   devices (pure planning in :mod:`managed_solve.packing`);
4. :class:`_Runner` runs one worker per device, reserving each batch's bytes
   in the DeviceManager's ledger while it runs, splitting a batch that hits an
   out-of-memory or device error and retrying the halves elsewhere, finally
   on the CPU, and records measured times so the next call balances better;
5. results come back in input order.

The scheduler is the one place solvers meet devices: solvers get arrays
already on their device; the manager knows nothing about CG.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _backend, config
from .devices import Device
from .manager import DeviceManager, default_manager
from .packing import (
    ALONE_ROWS,
    BATCH,
    DIRECT,
    SINGLE,
    Batch,
    Estimate,
    Slot,
    bytes_per_iteration,
    choose_slot,
    disperse,
    pack,
    predict_iterations,
    solve_bytes,
    split,
    target_rows,
)
from .result import SolveError, SolveResult, Status, _SlicedResult
from .sharded import choose_shard_count
from .system import FALLBACK, METHODS, PRECONDITIONERS, LinearSystem, is_symmetric, prefers_cg
from .system.method import krylov_method

log = logging.getLogger("managed_solve")

RETURN_ON = ("device", "host")
ON_ERROR = ("return", "raise")

# Largest system solved by a sparse LU on the host instead of CG, when the
# CPU is the only device and the method is "auto". Measured on the 2-core
# development machine over 100 systems of W2 (2D Poisson, 32..96 squared
# unknowns, rtol 1e-8): a loop of scipy spsolve (COLAMD) 1.21-1.31 s; splu
# with the MMD(A^T+A) ordering in symmetric mode, serial 0.86-1.10 s, in two
# threads 0.58-0.66 s (SuperLU releases the GIL while factorising); SciPy's
# CG needs 60-180 iterations each and is slower still. A 2D LU's fill grows
# like n log n, a 3D one like n^(4/3): past ~200k unknowns CG wins on memory.
DIRECT_MAX_N = 200_000

# Numba's default (workqueue) threading layer aborts when two threads launch
# parallel kernels at once, so host-side Krylov work (CPU and simulated
# devices, which compute with NumPy/Numba on the host) runs one batch at a time.
_HOST_KERNEL_LOCK = threading.Lock()


def _host_kernels(dev: Device) -> Any:
    """The host-kernel lock for work on a host or simulated device; nothing on a GPU."""
    return _HOST_KERNEL_LOCK if dev.kind != "cuda" else nullcontext()


# GPU batches get their solver workspace built in the stager thread, with the
# packing, while the device computes the batch before (see _Runner._start).
PREPARE_WORKSPACE = True
# On accelerators, a batch's results are built on a thread of their own while
# the worker computes the next batch (see _Runner._finish_split).
FINISH_BESIDE = True


class SolveManyError(SolveError):
    """Raised by ``solve_many(..., on_error="raise")`` after every system finished.

    Attributes
    ----------
    results : list of SolveResult
        All results, in input order (the converged ones too).
    failed : list of int
        Input positions of the systems that did not converge.
    """

    def __init__(self, message: str, results: list[SolveResult], failed: list[int]):
        super().__init__(message, results[failed[0]] if failed else None)
        self.results = results
        self.failed = failed


# --------------------------------------------------------------------------- validation
def _check_arguments(method: str, M: Any, rtol: float | None, return_on: str, on_error: str,
                     progress: bool) -> None:
    call = "solve_many"
    if method not in METHODS:
        raise ValueError(f"{call}(method={method!r}): expected one of {', '.join(METHODS)}")
    if isinstance(M, str) and M not in PRECONDITIONERS:
        raise ValueError(f"{call}(M={M!r}): expected one of {', '.join(PRECONDITIONERS)}, "
                         "an operator, or None")
    if rtol is not None and not (isinstance(rtol, (int, float)) and math.isfinite(rtol) and rtol >= 0):
        raise ValueError(f"{call}(rtol={rtol!r}): expected a finite number >= 0, e.g. 1e-8, or None "
                         "to keep each system's own")
    if return_on not in RETURN_ON:
        raise ValueError(f"{call}(return_on={return_on!r}): expected 'device' (x stays where it "
                         "was solved) or 'host' (NumPy arrays)")
    if on_error not in ON_ERROR:
        raise ValueError(f"{call}(on_error={on_error!r}): expected 'return' (failed systems come "
                         "back with their status) or 'raise'")
    if not isinstance(progress, bool):
        raise TypeError(f"{call}(progress={progress!r}): expected True or False")


def _validate(item: Any, i: int, *, method: str, M: Any, rtol: float | None,
              memo: dict | None = None) -> LinearSystem:
    """One input as a LinearSystem with solve_many's overrides applied; raises on bad input.

    ``memo`` (one dict per call) remembers the arrays already found finite, so
    a matrix shared by many ``(A, b)`` pairs is scanned for NaN and Inf once.
    """
    if isinstance(item, LinearSystem):
        if method == "auto" and M is None and rtol is None:
            return item
        s = object.__new__(LinearSystem)
        s.__dict__.update(item.__dict__)
        if method != "auto":
            if s.kind == "operator" and method == "direct":
                raise ValueError(f"solve_many(systems[{i}]): method='direct' needs the matrix "
                                 "entries; this system's A is an operator")
            s.method = method
        if M is not None:
            s.M = M
        if rtol is not None:
            if rtol == 0 and s.atol == 0:
                raise ValueError(f"solve_many(rtol=0): systems[{i}] has atol=0 too, so nothing "
                                 "can converge; give a positive rtol")
            s.rtol = float(rtol)
        return s
    if isinstance(item, (tuple, list)) and len(item) == 2:
        A, b = item
        return LinearSystem(A, b, rtol=1e-8 if rtol is None else rtol, method=method, M=M,
                            name=f"systems[{i}]", _finite_memo=memo)
    raise TypeError(
        f"solve_many(systems[{i}]): expected a LinearSystem or an (A, b) pair, got "
        f"{type(item).__name__}. Build one with managed_solve.LinearSystem(A, b)."
    )


def _invalid(exc: Exception, i: int, item: Any) -> SolveResult:
    name = getattr(item, "name", None) or f"systems[{i}]"
    return SolveResult(None, Status.INVALID_INPUT, name=name, method="",
                       message=f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- estimation
def _krylov_method(s: LinearSystem, cache: dict | None) -> str:
    """CG for symmetric matrices with a positive diagonal, else BiCGStab ("auto")."""
    if s.method in ("cg", "bicgstab", "gmres"):
        return s.method
    if not is_symmetric(s.A, cache):
        return "bicgstab"
    key = ("diag>0", id(s.A))
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is s.A:
        return hit[1]
    method = krylov_method(s.A, True)  # sync: one read per matrix
    method = "bicgstab" if method == "minres" else method  # the batched core has no MINRES
    if cache is not None:
        cache[key] = (s.A, method)
    return method


_DTYPE_NAMES: dict[np.dtype, str] = {}


# The method choice ("auto": symmetry test, then the diagonal) of host matrices
# runs on helper threads while the estimate loop goes through the systems (the
# symmetry kernels release the GIL). On a host of PREFETCH_ALL_CORES cores or
# more every distinct matrix of at least PREFETCH_SMALL_NNZ stored entries goes
# there, largest first; on fewer cores only those of PREFETCH_MIN_NNZ entries
# or more (two cores gain nothing from running the small tests beside the
# loop). W2-large on the development machine: the 1M-row matrix took 35 ms of
# the 55 ms of estimates; on a 2 x H200 host the 65 small matrices took
# 9-12 ms of the main thread before the first GPU started.
PREFETCH_MIN_NNZ = 1 << 20
PREFETCH_SMALL_NNZ = 1 << 12
PREFETCH_ALL_CORES = 4
PREFETCH_WORKERS = max(2, min(8, (os.cpu_count() or 1) // 2))


def _prefetch_methods(systems: Sequence[LinearSystem | None], cache: dict) -> dict[int, Future]:
    """Start the method choice of host matrices on helper threads (see PREFETCH_MIN_NNZ)."""
    floor = PREFETCH_SMALL_NNZ if (os.cpu_count() or 1) >= PREFETCH_ALL_CORES else PREFETCH_MIN_NNZ
    floor = min(floor, PREFETCH_MIN_NNZ)
    found: dict[int, LinearSystem] = {}
    seen: set[int] = set()
    for s in systems:
        # Cheap tests first, each matrix once: 10,004 systems cost 5-10 ms otherwise.
        if s is None or s.kind != "csr" or s.method != "auto":
            continue
        key = id(s.A)
        if key in seen:
            continue
        seen.add(key)
        if isinstance(s.b, np.ndarray) and s.nnz >= floor:  # host matrices only
            found[key] = s
    if not found:
        return {}
    pool = _backend.thread_pool("prefetch", PREFETCH_WORKERS)
    large = [(key, s) for key, s in found.items() if s.nnz >= PREFETCH_MIN_NNZ]
    small = [(key, s) for key, s in found.items() if s.nnz < PREFETCH_MIN_NNZ]
    out = {key: pool.submit(_krylov_method, s, cache) for key, s in large}
    if not small:
        return out
    if not large:
        out.update((key, pool.submit(_krylov_method, s, cache)) for key, s in small)
        return out
    # The large tests run alone first (each spreads over the symmetry threads,
    # and their result gates the first batches: see HEAD_START_SYSTEMS); the
    # small ones start when the last large one is done. Beside 65 small tests
    # the 1M-row one took 18-27 ms on an H200 host. Each small matrix gets
    # its future now, fulfilled from the test's own when it runs.
    later = {key: Future() for key, _s in small}
    left = [len(large)]
    lock = threading.Lock()

    def start_small(_done: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for key, s in small:
            pool.submit(_krylov_method, s, cache).add_done_callback(
                functools.partial(_fulfil, later[key]))

    for f in list(out.values()):
        f.add_done_callback(start_small)
    out.update(later)
    return out


def _fulfil(target: Future, done: Future) -> None:
    """Hand a finished future's result (or exception) to another future."""
    exc = done.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(done.result())


def _dtype_name(dt: np.dtype) -> str:
    # str(dtype) costs about 18 us (numpy builds the name each time): 0.18 s per
    # 10,000 systems on the planning path, so names are cached.
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt)
    return name


def _jacobi(M: Any) -> bool:
    """Whether ``M`` is the Jacobi preconditioner named by string."""
    return isinstance(M, str) and M == "jacobi"


def _batched_preconditioner(s: LinearSystem) -> bool:
    """Whether the batched core takes the system's preconditioner (none, or Jacobi)."""
    return s.M is None or _jacobi(s.M)


def _route(s: LinearSystem, *, host_only: bool, cache: dict | None = None) -> tuple[str, tuple]:
    """(route, group) of a system; batches mix systems of one group only."""
    if s.kind != "csr" or s.method in ("minres", "direct") or not _batched_preconditioner(s):
        return SINGLE, (s.method, _dtype_name(s.dtype))
    if host_only and s.method == "auto" and s.M is None and s.n <= DIRECT_MAX_N:
        symmetric = is_symmetric(s.A, cache)
        if not prefers_cg(s.A, s.rtol, symmetric):
            return DIRECT, ("direct", _dtype_name(s.dtype), symmetric)
    return BATCH, (_krylov_method(s, cache), _dtype_name(s.dtype), _jacobi(s.M))


def estimate(s: LinearSystem, i: int, *, host_only: bool, manager: DeviceManager | None = None,
             reference: Device | None = None, cache: dict | None = None) -> Estimate:
    """Route, device bytes and cost (bytes streamed) of one system.

    A signature measured before (``manager.record``) refines the cost of
    systems that run alone: its time on the ``reference`` device, times that
    device's learned speed.

    ``cache`` (one dict per call, shared with the symmetry tests) also keeps
    each batched or host-LU estimate by matrix object and options: systems
    sharing a matrix (W2-large: 10,004 systems, 66 matrices) cost a dict
    look-up each, not a route and a cost model (2.5 instead of 15 us per
    system on the development machine).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> e = estimate(LinearSystem(sp.identity(100, format="csr"), np.ones(100)), 0, host_only=False)
    >>> e.route, e.n, e.nnz, round(e.iterations)
    ('batch', 100, 100, 19)
    """
    if cache is None or s.kind != "csr" or not _batched_preconditioner(s):
        return _estimate(s, i, host_only=host_only, manager=manager, reference=reference, cache=cache)
    # What a batched or host-LU estimate depends on besides the matrix (x0 counts in
    # a host LU's bytes); other routes are not kept (they ask the manager's hints).
    x0 = s.x0
    key = ("estimate", id(s.A), s.method, s.M, s.dtype, s.rtol, s.maxiter, host_only,
           None if x0 is None else x0.nbytes)
    hit = cache.get(key)
    if hit is not None and hit[0] is s.A:
        e = hit[1]
        home = None if type(s.b) is np.ndarray else _home(s)
        return Estimate(i, e.n, e.nnz, e.nbytes, e.cost, e.route, e.group, home, e.iterations)
    e = _estimate(s, i, host_only=host_only, manager=manager, reference=reference, cache=cache)
    if e.route != SINGLE:
        cache[key] = (s.A, e)
    return e


# The group method of a batch whose "auto" method is still being found (a
# head-start system: see HEAD_START_SYSTEMS); the runner resolves it when the
# batch is staged, after its copy to the device has started.
DEFERRED = "auto"


def _deferred_estimate(s: LinearSystem, i: int) -> Estimate:
    """A batched system's estimate before its method is known (the costlier bytes reserved)."""
    n, nnz = s.n, s.nnz
    w, iw = s.dtype.itemsize, s.index_dtype.itemsize
    jac = _jacobi(s.M)
    its = predict_iterations(n, rtol=s.rtol, method="cg", maxiter=s.maxiter)
    cost = bytes_per_iteration(n, nnz, itemsize=w, index_itemsize=iw, method="cg", jacobi=jac) * its
    nbytes = solve_bytes(n, nnz, itemsize=w, index_itemsize=iw, method="bicgstab", jacobi=jac)
    return Estimate(i, n, nnz, nbytes, cost, BATCH, (DEFERRED, _dtype_name(s.dtype), jac),
                    _home(s), its)


def _home(s: LinearSystem) -> str | None:
    """The GPU a system's arrays already lie on, None on the host."""
    dev = s.device
    return dev if dev != "cpu" else None


def _estimate(s: LinearSystem, i: int, *, host_only: bool, manager: DeviceManager | None,
              reference: Device | None, cache: dict | None) -> Estimate:
    """:func:`estimate` without its per-call memo."""
    route, group = _route(s, host_only=host_only, cache=cache)
    n, nnz = s.n, s.nnz
    w = s.dtype.itemsize
    iw = s.index_dtype.itemsize if s.kind == "csr" else 8
    home = _home(s)
    if route == BATCH:
        method, _dt, jac = group
        its = predict_iterations(n, rtol=s.rtol, method=method, maxiter=s.maxiter)
        cost = bytes_per_iteration(n, nnz, itemsize=w, index_itemsize=iw, method=method,
                                   jacobi=jac) * its
        nbytes = solve_bytes(n, nnz, itemsize=w, index_itemsize=iw, method=method, jacobi=jac)
        return Estimate(i, n, nnz, nbytes, cost, BATCH, group, home, its)
    if route == DIRECT:
        fill = s.workspace_bytes("direct")
        # An LU streams its factors a few times; the fill bound stands in for that.
        return Estimate(i, n, nnz, s.nbytes + fill, float(fill), DIRECT, group, home)
    method = s.method if s.method != "auto" else "gmres"
    its = predict_iterations(n, rtol=s.rtol, method="bicgstab", maxiter=s.maxiter)
    cost = bytes_per_iteration(n, max(nnz, n), itemsize=w, index_itemsize=iw,
                               method="bicgstab") * its
    nbytes = s.nbytes + s.workspace_bytes(method)
    if manager is not None:
        ref = reference or (manager.accelerators or [manager.cpu])[0]
        p = manager.predict(s.signature, nbytes=nbytes, cost=cost, device=ref)
        if p.source == "measured":
            cost, nbytes = p.seconds * manager.speed(ref), p.nbytes
    return Estimate(i, n, nnz, nbytes, cost, SINGLE, group, home, its)


# --------------------------------------------------------------------------- planning
@dataclass
class Plan:
    """Batches per device in run order, plus what the planner predicted."""

    queues: dict[str, list[Batch]]
    slots: list[Slot]
    estimates: dict[int, Estimate]
    next_id: int
    rows: int
    oversized: list[int]  # input positions too large for any one device's room
    sharded: list[int] = field(default_factory=list)  # of those, solved over several GPUs

    def finish_times(self) -> dict[str, float]:
        return {s.name: s.busy for s in self.slots}


def make_slots(devices: Sequence[Device], manager: DeviceManager) -> list[Slot]:
    """The planner's view of devices: room for one batch, learned speed, work already reserved."""
    return [Slot(str(d), manager.available_bytes(d), manager.speed(d), manager.predicted_finish(d),
                 d.kind) for d in devices]


def plan_work(estimates: Iterable[Estimate], devices: Sequence[Device], manager: DeviceManager, *,
              batch_bytes: Callable[[Sequence[Estimate]], int] | None = None,
              slots: list[Slot] | None = None, packed_rows: int | None = None,
              first_id: int = 0) -> Plan:
    """Pack estimates into batches and disperse them over ``devices`` (nothing runs).

    A Krylov system too large for every device's room is sharded over the
    accelerators when two or more of them can hold it together
    (``Plan.sharded``; solved by ``managed_solve.sharded`` once the batches
    are done); otherwise it goes to the CPU.

    A call planned in parts (see ``HEAD_START_SYSTEMS``) passes the rows that all
    its batched systems hold (``packed_rows``, which sets the batch size), the
    slots of the part before (whose ``busy`` holds that part's work) and the
    first free batch id.

    Examples
    --------
    >>> from managed_solve.manager import DeviceManager
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> es = [Estimate(i, 1000, 5000, 100_000, 1e6) for i in range(40)]
    >>> p = plan_work(es, dm.accelerators, dm)
    >>> sorted(p.queues), sum(b.nsys for q in p.queues.values() for b in q)
    (['sim:0', 'sim:1'], 40)
    """
    ests = {e.index: e for e in estimates}
    slots = slots if slots is not None else make_slots(devices, manager)
    kind = devices[0].kind if devices else "cpu"
    if packed_rows is None:
        packed_rows = sum(e.n for e in ests.values() if e.route != SINGLE)
    rows = target_rows(packed_rows, len(devices), kind)
    if any(e.route == DIRECT for e in ests.values()):
        # Host LU batches run one per core: several per core balance the tail.
        rows = target_rows(packed_rows, os.cpu_count() or 1, "cpu")
    max_bytes = max((s.room for s in slots), default=0)
    batches, too_big = pack(ests.values(), rows=rows, max_bytes=max_bytes, batch_bytes=batch_bytes,
                            first_id=first_id)
    queues, unplaced = disperse(batches, slots)
    next_id = max((b.id for b in batches), default=first_id - 1) + 1
    cpu = str(manager.cpu)
    extra: list[Batch] = []
    sharded: list[int] = []
    rooms = [s.room for s in slots if s.kind != "cpu"]
    for e in too_big:
        # The sharded solver runs CG and BiCGStab ("auto" resolves to one of them).
        shardable = e.route == BATCH and e.group[0] in ("cg", "bicgstab", DEFERRED)
        if shardable and len(rooms) >= 2 and choose_shard_count(e.nbytes, rooms) >= 2:
            sharded.append(e.index)
            continue
        extra.append(_place_oversized(e, next_id, batch_bytes))
        next_id += 1
    extra += unplaced
    if extra:
        queues.setdefault(cpu, [])
        for b in extra:
            queues[cpu].append(b)
            for s in slots:
                if s.name == cpu:
                    s.busy += b.cost / s.speed
    return Plan(queues, slots, ests, next_id, rows, [e.index for e in too_big], sharded)


def _run_sharded(s: LinearSystem, devs: Sequence[Device], mgr: DeviceManager) -> SolveResult:
    """One system over every accelerator; a device failure falls back to the CPU.

    Any other failure becomes this system's DEVICE_ERROR result (as for a
    batch), so it never sinks the other systems' results.
    """
    from ._solve import solve

    gpus = [str(d) for d in devs if d.kind != "cpu"]
    where = ", ".join(gpus)
    try:
        try:
            res = solve(s, devices=gpus, manager=mgr)
        except Exception as exc:
            if not is_device_error(exc):
                raise
            log.warning("managed_solve: sharded solve over %s failed (%s); solving on the CPU",
                        where, exc)
            where = str(mgr.cpu)
            res = solve(s, device=mgr.cpu, manager=mgr)
            res.info["sharded_failure"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - every failure must end in results
        log.error("solve_many: sharded solve of %s on %s failed: %r", s.name, where, exc)
        return SolveResult(None, Status.DEVICE_ERROR, device=where, name=s.name,
                           message=f"solve_many: the sharded solve on {where} raised "
                                   f"{type(exc).__name__}: {exc} (not a device error, so not retried)")
    res.name = s.name
    return res


def _place_oversized(e: Estimate, batch_id: int, batch_bytes: Callable | None) -> Batch:
    """A system larger than any one device's room that cannot be sharded: alone on the CPU."""
    log.info("managed_solve: systems[%d] (%d unknowns) fits on no device, nor sharded over the "
             "accelerators; solving on the CPU", e.index, e.n)
    nbytes = int(batch_bytes([e])) if batch_bytes is not None else e.nbytes
    return Batch(batch_id, [e.index], e.route, e.group, e.n, e.nnz, nbytes, e.cost)


# --------------------------------------------------------------------------- device errors
def is_device_error(exc: BaseException) -> bool:
    """Out-of-memory and CUDA runtime/driver errors: worth retrying on another device.

    ``MemoryError`` covers :class:`~managed_solve.devices.SimulatedOutOfMemory`
    and CuPy's ``OutOfMemoryError`` (a ``MemoryError`` subclass); CuPy's
    ``CUDARuntimeError``/``CUDADriverError`` and cuSPARSE/cuBLAS errors are
    recognised by their module, so cupy need not be imported to ask.
    """
    if isinstance(exc, MemoryError):
        return True
    for cls in type(exc).__mro__:
        mod = cls.__module__ or ""
        if mod.startswith(("cupy_backends", "cupy.cuda", "numba.cuda")) and cls is not Exception:
            return True
    return False


# --------------------------------------------------------------------------- running
def _core():
    """The batched Krylov core: (PackedBatch, {method: batched solver})."""
    from .solvers.batched import PackedBatch, bicgstab_batched, cg_batched, gmres_batched

    return PackedBatch, {"cg": cg_batched, "bicgstab": bicgstab_batched, "gmres": gmres_batched}


_AHEAD = object()  # _Runner._pop: a batch was staged for this worker; take it


class _InvalidInput(Exception):
    """A system found invalid after its batch was planned (a deferred method's test failed)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _Runner:
    """Executes a plan: one worker per device, recovery, results in input order."""

    def __init__(self, systems: list[LinearSystem | None], plan: Plan, devices: Sequence[Device],
                 manager: DeviceManager, results: list[SolveResult | None], *, bar: Any,
                 batch_bytes: Callable | None, more: bool = False,
                 method_of: Callable[[LinearSystem], str] | None = None):
        self.systems = systems
        self.plan = plan
        self.manager = manager
        self.results = results
        self.bar = bar
        self.batch_bytes = batch_bytes
        self.devices = list(devices)
        cpu = manager.cpu
        self.all_devices = self.devices + ([cpu] if cpu not in self.devices else [])
        self.by_name = {str(d): d for d in self.all_devices}
        self.cond = threading.Condition()
        self.queues: dict[str, deque[Batch]] = {str(d): deque(plan.queues.get(str(d), []))
                                                for d in self.all_devices}
        self.queued_seconds = {s.name: s.busy for s in plan.slots}
        # ``more``: a further part of the plan will come (:meth:`extend`); it
        # counts as one outstanding batch, so no worker stops before it came.
        self.outstanding = sum(len(q) for q in self.queues.values()) + int(more)
        self.more = more
        self.method_of = method_of  # resolves DEFERRED methods (see _batch_method)
        self.next_id = plan.next_id
        self.threads: list[threading.Thread] = []
        # Per accelerator: its stager while its worker runs, and the batch staged
        # next (its copy under way beside the current batch's compute).
        self.stage_lock = threading.Lock()
        self.stagers: dict[str, _Stager] = {}
        self.ahead: dict[str, _Staged | None] = {}
        # Per accelerator, while its worker runs: the thread that builds its
        # batches' results (see _finish_split), when FINISH_BESIDE.
        self.finishers: dict[str, ThreadPoolExecutor] = {}
        self.delivered = 0
        self.batches_run: list[tuple[str, int, int]] = []  # (device, batch id, nsys), for tests
        self.stolen: list[tuple[str, str, int]] = []  # (thief, victim, batch id)

    # ---------------------------------------------------------------- queue
    def _pop(self, name: str) -> Batch | None | object:
        """The device's next batch, None when all is done, ``_AHEAD`` when one was staged for it."""
        with self.cond:
            while True:
                if self.ahead.get(name) is not None:
                    return _AHEAD
                if self.queues[name]:
                    return self.queues[name].popleft()
                stolen = self._steal(name)
                if stolen is not None:
                    return stolen
                if self.outstanding <= 0:
                    return None
                self.cond.wait()

    def _steal(self, name: str) -> Batch | None:
        """A batch queued on another device of the same kind, for an idle one (lock held).

        The plan balances predicted times; measured times differ (a learned
        hint off, a device shared with other work), so a device whose queue
        runs dry takes the last (shortest) batch of the device with the most
        predicted work left, if it fits here and did not fail here. Batches
        whose systems already lie on their device stay there.
        """
        dev = self.by_name[name]
        if dev.kind == "cpu" or not config.current().work_stealing:
            return None

        def left(q: str) -> float:  # predicted seconds of the batches still queued there
            return sum(b.cost for b in self.queues[q]) / self.manager.speed(self.by_name[q])

        victims = sorted((q for q in self.queues if q != name and self.queues[q]
                          and self.by_name[q].kind == dev.kind), key=lambda q: -left(q))
        for victim in victims:
            b = self.queues[victim][-1]
            if name in b.tried or b.route == DIRECT:
                continue
            if any(self.plan.estimates[i].home == victim for i in b.indices
                   if i in self.plan.estimates):
                continue
            if self.manager.available_bytes(dev) < b.nbytes:
                continue
            self.queues[victim].pop()
            speed_v = self.manager.speed(self.by_name[victim])
            speed_me = self.manager.speed(dev)
            self.queued_seconds[victim] = max(0.0, self.queued_seconds.get(victim, 0.0) - b.cost / speed_v)
            self.queued_seconds[name] = self.queued_seconds.get(name, 0.0) + b.cost / speed_me
            self.stolen.append((name, victim, b.id))
            return b
        return None

    def _batch_method(self, b: Batch) -> str:
        """The batch's Krylov method, found now if it was deferred (then kept in its group)."""
        group = b.group
        if group[0] != DEFERRED:
            return group[0]
        if self.method_of is None:
            raise RuntimeError("solve_many: internal error, a deferred method without a resolver")
        try:
            methods = {self.method_of(self.systems[i]) for i in b.indices}
        except (TypeError, ValueError) as exc:  # as the estimate loop would have: bad input
            raise _InvalidInput(exc) from exc
        if len(methods) != 1:  # head-start batches hold one system each
            raise RuntimeError(f"solve_many: internal error, batch {b.id} mixes methods {methods}")
        method = methods.pop()
        with self.cond:
            b.group = (method, *group[1:])
            for i in b.indices:
                e = self.plan.estimates.get(i)
                if e is not None:
                    e.group = b.group
        return method

    def _done(self, new: Sequence[tuple[str, Batch]] = ()) -> None:
        with self.cond:
            for name, b in new:
                self.queues[name].append(b)
                self.outstanding += 1
            self.outstanding -= 1
            self.cond.notify_all()

    def _deliver_many(self, indices: Sequence[int], out: Sequence[SolveResult]) -> None:
        """:meth:`_deliver` for a whole batch, under one lock."""
        if len(indices) != len(out):
            raise RuntimeError(f"solve_many: internal error, {len(out)} results for a batch of "
                               f"{len(indices)} systems")
        results = self.results
        with self.cond:
            twice = [i for i in indices if results[i] is not None]
            if twice:
                raise RuntimeError(f"solve_many: internal error, systems {twice[:10]} were solved twice")
            for i, res in zip(indices, out, strict=True):
                results[i] = res
            self.delivered += len(indices)
        if self.bar is not None:
            self.bar.update(len(indices))

    def _deliver(self, i: int, res: SolveResult) -> None:
        with self.cond:
            if self.results[i] is not None:
                raise RuntimeError(f"solve_many: internal error, systems[{i}] was solved twice")
            self.results[i] = res
            self.delivered += 1
        if self.bar is not None:
            self.bar.update(1)

    # ---------------------------------------------------------------- workers
    def run(self) -> None:
        self.start()
        self.join()

    def start(self) -> None:
        """Start one worker per device (the host's LU batches: one per core)."""
        direct = any(b.route == DIRECT for q in self.queues.values() for b in q)
        for d in self.all_devices:
            count = (os.cpu_count() or 1) if d.kind == "cpu" and direct else 1
            for k in range(count):
                t = threading.Thread(target=self._worker, args=(d,), daemon=True,
                                     name=f"solve_many-{d}-{k}")
                self.threads.append(t)
                t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def extend(self, plan: Plan | None) -> None:
        """Add the rest of the plan (None: nothing more comes) while the workers run.

        A worker computing a batch with nothing staged behind it gets its next
        batch staged at once, so its copy overlaps that compute.
        """
        with self.cond:
            if not self.more:
                raise RuntimeError("solve_many: internal error, a plan extended twice")
            self.more = False
            if plan is not None:
                self.plan.estimates.update(plan.estimates)
                self.plan.sharded.extend(plan.sharded)
                self.plan.oversized.extend(plan.oversized)
                self.next_id = max(self.next_id, plan.next_id)
                for name, q in plan.queues.items():
                    self.plan.queues.setdefault(name, []).extend(q)
                    self.queues.setdefault(name, deque()).extend(q)
                    self.outstanding += len(q)
                for s in plan.slots:
                    self.queued_seconds[s.name] = s.busy
            self.outstanding -= 1  # the part that was to come
            self.cond.notify_all()
        for name in list(self.stagers):
            self._stage_next(name)

    def _pop_nowait(self, name: str) -> Batch | None:
        with self.cond:
            return self.queues[name].popleft() if self.queues[name] else self._steal(name)

    def _stage_next(self, name: str) -> None:
        """Stage the device's next batch unless one is staged already (or none is queued)."""
        with self.stage_lock:
            stager = self.stagers.get(name)
            if stager is None or self.ahead.get(name) is not None:
                return
            nb = self._pop_nowait(name)
            if nb is None:
                return
            self.ahead[name] = self._start(nb, self.by_name[name], stager)
        with self.cond:  # its worker may be waiting for work: this is work
            self.cond.notify_all()

    def _take_ahead(self, name: str) -> _Staged | None:
        with self.stage_lock:
            st = self.ahead.get(name)
            self.ahead[name] = None
            return st

    def _worker(self, dev: Device) -> None:
        """Run a device's queue; on accelerators, stage the next batch while this one computes."""
        name = str(dev)
        stager = _Stager(dev) if dev.kind != "cpu" else None
        if stager is not None:
            with self.stage_lock:
                self.stagers[name] = stager
            if FINISH_BESIDE:
                self.finishers[name] = ThreadPoolExecutor(1, thread_name_prefix=f"finish-{dev}")
        try:
            while True:
                cur = self._take_ahead(name) if stager is not None else None
                if cur is None:
                    b = self._pop(name)
                    if b is None:
                        return
                    if b is _AHEAD:
                        continue
                    cur = self._start(b, dev, stager)
                    if cur is None:
                        continue
                if stager is not None:
                    self._stage_next(name)
                self._finish(cur, dev)
        finally:
            if stager is not None:
                with self.stage_lock:
                    del self.stagers[name]
                stager.close()
            finisher = self.finishers.pop(name, None)
            if finisher is not None:
                finisher.shutdown(wait=True)

    def _start(self, b: Batch, dev: Device, stager: _Stager | None) -> _Staged | None:
        """Reserve the batch's bytes, ask the fault hook, start its host->device copy."""
        res = None
        try:
            # solve() reserves its own bytes on this manager for a SINGLE system;
            # the batch then holds only its predicted time here (no double count).
            nbytes = 0 if b.route == SINGLE else b.nbytes
            res = self.manager.reserve(nbytes, device=dev, cost=b.cost,
                                       signature=("solve_many", b.route, b.group))
            dev.check_fault(b.nbytes)
            fut = None
            if b.route == BATCH:
                systems = [self.systems[i] for i in b.indices]
                _method, _dt, jacobi = b.group
                target = str(dev)  # PackedBatch puts "sim:k" batches on the host

                def stage(systems=systems, jacobi=jacobi, target=target, dev=dev, b=b):
                    packed = _pack(systems, jacobi, target, dev)
                    if dev.kind == "cuda" and PREPARE_WORKSPACE:
                        # The solver's workspace too (its bytes are in the batch's
                        # reservation): off the worker's path between two batches.
                        # A deferred method is waited for here, after the copy.
                        from .solvers.batched import prepare

                        method = self._batch_method(b)
                        if method in ("cg", "bicgstab"):  # the fused core's; GMRES has none
                            prepare(packed, method)
                    return packed

                fut = stager.submit(stage) if stager is not None else _now(stage)
            return _Staged(b, res, fut)
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            if res is not None:
                res.release()
            self._done(self._recover(b, dev, exc))
            return None

    def _finish(self, st: _Staged, dev: Device) -> None:
        """Compute a staged batch, deliver its results, release its bytes, learn its time."""
        b = st.batch
        batch_info = {"batch": b.id, "batch_size": b.nsys, "reserved_bytes": b.nbytes}
        finisher = self.finishers.get(str(dev)) if b.route == BATCH else None
        if finisher is not None:
            self._finish_split(st, dev, finisher, batch_info)
            return
        try:
            t0 = time.perf_counter()
            with st.reservation, dev.context():
                if b.route == BATCH:
                    packed = st.packed.result()
                    method = self._batch_method(b)
                    systems = [self.systems[i] for i in b.indices]
                    with _host_kernels(dev):
                        out = _solve_packed(systems, packed, method, dev, self.manager,
                                            info=batch_info)
                elif b.route == DIRECT:
                    symmetric = bool(b.group[2])
                    out = [_direct_solve(self.systems[i], symmetric) for i in b.indices]
                else:
                    out = [self._run_single(i, dev) for i in b.indices]
            seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            self._failed(st, dev, exc)
            return
        self._deliver_batch(b, dev, out, seconds, batch_info)

    def _finish_split(self, st: _Staged, dev: Device, finisher: ThreadPoolExecutor,
                      batch_info: dict) -> None:
        """:meth:`_finish` of a batch on an accelerator: the device part here, its results beside.

        The worker computes the batch and its true residuals, then goes on to
        its next batch while the device's finisher thread builds this one's
        results (Python per system: 4-13 ms a batch of 1,300-4,800 systems on
        an H200 host, time in which the GPU had no work queued), delivers
        them and releases the batch's bytes.
        """
        b = st.batch
        try:
            t0 = time.perf_counter()
            with dev.context():
                packed = st.packed.result()
                method = self._batch_method(b)
                with _host_kernels(dev):
                    solved = _run_packed(packed, method)
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            self._failed(st, dev, exc)
            return
        finisher.submit(self._complete, st, dev, packed, method, solved, batch_info, t0)

    def _complete(self, st: _Staged, dev: Device, packed: Any, method: str, solved: tuple,
                  batch_info: dict, t0: float) -> None:
        """The results of a batch computed by :meth:`_finish_split` (on the finisher thread)."""
        b = st.batch
        try:
            systems = [self.systems[i] for i in b.indices]
            # On the host, restarts and polishes hold the host-kernel lock (not the
            # building of results, so the worker's next batch computes meanwhile).
            with st.reservation, dev.context():
                out = _results(systems, packed, method, dev, self.manager, solved, info=batch_info,
                               guard=_host_kernels(dev))
            seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            self._failed(st, dev, exc)
            return
        self._deliver_batch(b, dev, out, seconds, batch_info)

    def _failed(self, st: _Staged, dev: Device, exc: BaseException) -> None:
        """A staged batch that failed: its bytes released, its systems split and retried."""
        st.reservation.release()
        self._done(self._recover(st.batch, dev, exc))

    def _deliver_batch(self, b: Batch, dev: Device, out: list[SolveResult], seconds: float,
                       batch_info: dict) -> None:
        """Learn a finished batch's time, hand out its results, let the queue go on."""
        self.manager.record(("solve_many", b.route, b.group), seconds, b.nbytes, device=dev,
                            cost=b.cost, device_seconds=_device_seconds(out))
        with self.cond:
            self.batches_run.append((str(dev), b.id, b.nsys))
        dname = str(dev)
        for res in out:
            res.device = dname
            if not res.seconds:
                res.seconds = seconds
            if "batch" not in res.info:  # results not made by the batched core
                for key, value in batch_info.items():
                    res.info.setdefault(key, value)
        self._deliver_many(b.indices, out)
        self._done()

    def _recover(self, b: Batch, dev: Device, exc: BaseException) -> list[tuple[str, Batch]]:
        """Split a failed batch and send the halves elsewhere, finally to the CPU."""
        if isinstance(exc, _InvalidInput):
            for i in b.indices:
                self._deliver(i, _invalid(exc.error, i, self.systems[i]))
            return []
        if not is_device_error(exc):
            log.error("solve_many: batch %d on %s failed: %r", b.id, dev, exc)
            msg = (f"solve_many: solving on {dev} raised {type(exc).__name__}: {exc} "
                   "(not a device error, so not retried)")
            for i in b.indices:
                self._fail(i, dev, msg)
            return []
        log.info("solve_many: batch %d (%d systems) hit %s on %s; splitting and retrying elsewhere",
                 b.id, b.nsys, type(exc).__name__, dev)
        b.tried = b.tried | {str(dev)}
        with self.cond:
            halves = split(b, self.plan.estimates, next_id=self.next_id, batch_bytes=self.batch_bytes)
            self.next_id += len(halves)
        out = []
        for h in halves:
            slots = [Slot(str(d), self.manager.available_bytes(d), self.manager.speed(d),
                          self.queued_seconds.get(str(d), 0.0), d.kind) for d in self.devices]
            target = choose_slot(h, slots)
            name = target.name if target is not None else str(self.manager.cpu)
            if name in h.tried:
                msg = (f"solve_many: {type(exc).__name__} on every device tried "
                       f"({', '.join(sorted(h.tried))}): {exc}")
                for i in h.indices:
                    self._fail(i, dev, msg)
                continue
            with self.cond:
                speed = self.manager.speed(self.by_name[name])
                self.queued_seconds[name] = self.queued_seconds.get(name, 0.0) + h.cost / speed
            out.append((name, h))
        return out

    def _fail(self, i: int, dev: Device, msg: str) -> None:
        s = self.systems[i]
        self._deliver(i, SolveResult(None, Status.DEVICE_ERROR, device=str(dev), message=msg,
                                     name=s.name if s is not None else None))

    # ---------------------------------------------------------------- routes
    def _run_single(self, i: int, dev: Device) -> SolveResult:
        from ._solve import solve

        with _host_kernels(dev):
            return solve(self.systems[i], device=dev, manager=self.manager)


def _device_seconds(results: Sequence[SolveResult]) -> float | None:
    """The GPU time of a batch's solve (CUDA events), from a result the batch itself gave."""
    for r in results:
        info = r.info
        gpu = info.get("gpu_seconds")
        if gpu and not info.get("restarted") and not info.get("polished"):
            return float(gpu)
    return None


@dataclass
class _Staged:
    """A batch whose bytes are reserved and whose copy to the device is under way."""

    batch: Batch
    reservation: Any
    packed: Future | None


def _now(fn: Callable[[], Any]) -> Future:
    fut: Future = Future()
    fut.set_result(fn())
    return fut


class _Stager:
    """Packs batches (the host -> device copies) in a helper thread, on a second CUDA stream.

    The worker stages batch k+1 before computing batch k, so on a GPU the copy
    overlaps the compute. On simulated devices the same code runs with the
    pack on the host (there is no stream), so the pipeline is tested on CPUs.
    """

    def __init__(self, dev: Device):
        self.dev = dev
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{dev}")

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self.dev.kind != "cuda":
            return self.pool.submit(fn)

        def staged():
            cp = _backend.cupy()
            with self.dev.context():
                stream = _stager_stream(cp, self.dev)
                with stream:
                    out = fn()
                stream.synchronize()  # sync: the copy is complete before the compute stream reads it
                return out

        return self.pool.submit(staged)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


_STAGER_STREAMS: dict[str, Any] = {}
_STAGER_STREAMS_LOCK = threading.Lock()


def _stager_stream(cp: Any, dev: Device) -> Any:
    """One copy stream per GPU for the process (called inside the device's context).

    CuPy's memory pool keeps freed blocks per stream: a stream that lives
    across batches and calls gets its batches' memory back instead of
    allocating anew for each fresh stream.
    """
    key = str(dev)
    with _STAGER_STREAMS_LOCK:
        stream = _STAGER_STREAMS.get(key)
        if stream is None:
            stream = _STAGER_STREAMS[key] = cp.cuda.Stream(non_blocking=True)
        return stream


def _pack(systems: list[LinearSystem], jacobi: bool, target: str, dev: Device) -> Any:
    """A batch on its device (host systems go over in bulk: see ``PackedBatch.pack``)."""
    return _core()[0].pack(systems, device=target, jacobi=jacobi)


def _solve_packed(systems: list[LinearSystem], packed: Any, method: str, device: Device,
                  manager: DeviceManager, *, restart: bool = True,
                  info: dict | None = None) -> list[SolveResult]:
    """One packed batch through the batched core, with each system's true residual checked.

    ``info`` entries go into every result's ``info``.

    Systems whose recurrence residual converged while the true one misses
    the tolerance (rounding drift) run again as one warm-started batch
    (``restart``); any still missing it, and "auto" systems on which CG broke
    down, finish alone through ``solve()``.
    """
    return _results(systems, packed, method, device, manager, _run_packed(packed, method),
                    restart=restart, info=info)


def _run_packed(packed: Any, method: str) -> tuple:
    """The device part of :func:`_solve_packed`: the batched core, then the true residuals."""
    core = _core()[1][method]
    t0 = time.perf_counter()
    out = core(packed)
    seconds = time.perf_counter() - t0
    xp = packed.xp
    if xp is np:
        N = int(packed.n)
        A = _backend.sparse_module(xp).csr_matrix((packed.data, packed.indices, packed.indptr),
                                                  shape=(N, N))
        r = packed.b - A @ out.x
        seg = packed.row_sys
        rn = np.sqrt(np.bincount(seg, weights=r * r, minlength=packed.nsys))
        bn = np.sqrt(np.bincount(seg, weights=packed.b * packed.b, minlength=packed.nsys))
    else:
        from .solvers.batched import residual_norms

        rn, bn = residual_norms(packed, out.x)  # sync: one host read of per-system norms
    return out, rn, bn, seconds


def _results(systems: list[LinearSystem], packed: Any, method: str, device: Device,
             manager: DeviceManager, solved: tuple, *, restart: bool = True,
             info: dict | None = None, guard: Any = None) -> list[SolveResult]:
    """The host part of :func:`_solve_packed`: each system's result, drifted ones solved again.

    ``guard`` (a lock) is held around the solves made here (restarts,
    polishes), for a caller that does not hold it already: host kernels run
    one batch at a time (``_HOST_KERNEL_LOCK``).
    """
    guard = guard if guard is not None else nullcontext()
    PackedBatch = _core()[0]
    out, rn, bn, seconds = solved
    offsets = packed.offsets.tolist()
    results: list[SolveResult] = []
    drifted: list[int] = []
    broken: list[int] = []  # "auto" systems on which BiCGStab broke down: GMRES, batched
    # Python work per system (thousands a batch, while the GPU waits for the
    # next batch): plain lists read once, one shared message, info dicts copied.
    common = {"host_syncs": int(out.host_syncs), "checkpoints": int(out.checkpoints),
              "compactions": int(out.compactions), "gpu_seconds": out.gpu_seconds,
              **(info or {})}
    converged_msg = Status.CONVERGED.message
    dname = str(device)
    for k, (s, code, its, r, bnorm) in enumerate(zip(
            systems, out.status.tolist(), out.iterations.tolist(), np.asarray(rn).tolist(),
            np.asarray(bn).tolist(), strict=True)):
        # x is sliced from the batch's solution when first read (_SlicedResult).
        res = _SlicedResult.cut_from(out.x, offsets[k], offsets[k + 1], _STATUS[code], its, r, bnorm,
                                     dname, seconds, method, "", s.name, common.copy())
        if not LAZY_X:
            res.x  # noqa: B018 (the view made now, as before: for paired profiles)
        if code == 0 and not r <= max(s.rtol * bnorm, s.atol):
            drifted.append(k)
        elif code == 2 and s.method == "auto" and method == "bicgstab":
            broken.append(k)
        elif code == 2 and s.method == "auto" and method in FALLBACK:
            # "auto" chose CG from symmetry and a positive diagonal, but the matrix is
            # indefinite: MINRES alone, as solve() would after its own attempt (not
            # repeated here).
            with guard:
                res = _polish(s, None, FALLBACK[method], device, manager)
            res.iterations += its
            res.info["fallback_from"] = method
        elif code == 0:
            res.message = converged_msg
        results.append(res)
    def again(ks: list[int], subset: list[LinearSystem], how: str, restart: bool, note: tuple) -> None:
        """Solve ``subset`` (systems ks, changed) as one more batch; their results replace the first."""
        sub = PackedBatch.pack(subset, device=str(device), jacobi=packed.dinv is not None)
        with guard:
            redo = _solve_packed(subset, sub, how, device, manager, restart=restart, info=info)
        for k, res in zip(ks, redo, strict=True):
            res.iterations += results[k].iterations
            res.info[note[0]] = note[1]
            results[k] = res

    if drifted and restart:
        again(drifted, [_with_x0(systems[k], results[k].x) for k in drifted], method, False,
              ("restarted", True))
    elif drifted:
        for k in drifted:
            with guard:
                results[k] = _polish(systems[k], results[k].x, method, device, manager)
    if broken:
        # BiCGStab breaks down on spectra it cannot handle (eigenvalues near the
        # imaginary axis); GMRES cannot break down this way. One batch, from their own x0.
        again(broken, [systems[k] for k in broken], FALLBACK[method], restart,
              ("fallback_from", method))
    return results


def _with_x0(s: LinearSystem, x0: Any) -> LinearSystem:
    t = object.__new__(LinearSystem)
    t.__dict__.update(s.__dict__)
    t.x0 = x0
    return t


_STATUS = {0: Status.CONVERGED, 1: Status.MAXITER, 2: Status.BREAKDOWN}
# Each result's x is a view cut from its batch's solution when first read
# (False: on the worker, as each result is made).
LAZY_X = True


def _polish(s: LinearSystem, x0: Any, method: str, device: Device,
            manager: DeviceManager) -> SolveResult:
    from ._solve import solve

    t = _with_x0(s, x0) if x0 is not None else _with_x0(s, s.x0)
    t.method = method
    res = solve(t, device=device, manager=manager)
    res.info["polished"] = True
    return res


def _direct_solve(s: LinearSystem, symmetric: bool) -> SolveResult:
    """Sparse LU on the host, one refinement step if the residual misses the tolerance."""
    import scipy.sparse as sps
    import scipy.sparse.linalg as spla

    t0 = time.perf_counter()
    A = _backend.to_host(s.A)
    b = np.asarray(_backend.to_host(s.b))
    bn = float(np.linalg.norm(b))
    tol = max(s.rtol * bn, s.atol)
    try:
        if symmetric:
            # A symmetric CSR matrix is its own CSC: reuse the arrays, no transpose.
            At = sps.csc_matrix((A.data, A.indices, A.indptr), shape=A.shape)
            lu = spla.splu(At, permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.1,
                           options={"SymmetricMode": True})
        else:
            lu = spla.splu(A.tocsc())
    except RuntimeError as exc:  # "Factor is exactly singular"
        return SolveResult(None, Status.BREAKDOWN, 0, float("nan"), bn, seconds=time.perf_counter() - t0,
                           method="direct", name=s.name,
                           message=f"sparse LU failed ({exc}); the matrix is singular. "
                           "Check the boundary conditions, or use method='minres'.")
    x = lu.solve(b)
    r = b - A @ x
    rn = float(np.linalg.norm(r))
    steps = 1
    if not rn <= tol:
        x += lu.solve(r)
        rn = float(np.linalg.norm(b - A @ x))
        steps = 2
    ok = rn <= tol
    return SolveResult(x, Status.CONVERGED if ok else Status.BREAKDOWN, steps, rn, bn,
                       seconds=time.perf_counter() - t0, method="direct", name=s.name,
                       message=Status.CONVERGED.message if ok else
                       f"the LU solution's residual {rn:.3g} misses the tolerance {tol:.3g} "
                       "after one refinement step (ill-conditioned matrix); try method='gmres' "
                       "with M='jacobi'.")


# --------------------------------------------------------------------------- public
def _select_devices(manager: DeviceManager, devices: Any, disperse: bool,
                    systems: Sequence[LinearSystem | None]) -> list[Device]:
    if devices is not None:
        names = devices.split(",") if isinstance(devices, str) else list(devices)
        devs = []
        for d in names:
            dev = manager.get_device(d.strip() if isinstance(d, str) else d)
            if dev not in devs:
                devs.append(dev)
        if not devs:
            raise ValueError(f"solve_many(devices={devices!r}): selects no device; e.g. 'cuda:0,cuda:1'")
    else:
        devs = manager.accelerators or [manager.cpu]
    if disperse or len(devs) == 1:
        return devs
    # One device: where most of the input bytes already lie, else the one with most room.
    held = {str(d): 0 for d in devs}
    for s in systems:
        if s is not None and s.device in held:
            held[s.device] += s.nbytes
    best = max(devs, key=lambda d: (held[str(d)], manager.available_bytes(d)))
    return [best]


def _packed_bytes(manager: DeviceManager, systems: Sequence[LinearSystem | None]) -> Callable:
    """Bytes to reserve for a batch: the batched core's own prediction, through the heuristic."""
    try:
        PackedBatch = _core()[0]
    except ImportError:  # the core is not installed: the planner's own model
        PackedBatch = None

    def nbytes(members: Sequence[Estimate]) -> int:
        e0 = members[0]
        if e0.route != BATCH:
            return manager.size_of(int(sum(e.nbytes for e in members)))
        method, dt, jacobi = e0.group
        method = "bicgstab" if method == DEFERRED else method  # the larger workspace of the two
        n = sum(e.n for e in members)
        nnz = sum(e.nnz for e in members)
        idx = np.int32 if max(n, nnz) < 2**31 - 1 else np.int64
        if PackedBatch is not None:
            x0 = any(systems[e.index].x0 is not None for e in members)
            raw = PackedBatch.predict_bytes(n, nnz, len(members), np.dtype(dt), np.dtype(idx), method,
                                            jacobi=bool(jacobi), x0=x0)
            raw += 8 * n  # the true-residual check's product A @ x
        else:
            raw = sum(e.nbytes for e in members)
        return manager.size_of(int(raw))

    return nbytes


def solve_many(systems: Iterable[Any], *, disperse: bool = True, devices: Any = None,
               method: str = "auto", M: Any = None, rtol: float | None = None,
               progress: bool = False, return_on: str = "device", on_error: str = "return",
               manager: DeviceManager | None = None, backend: str = "local",
               **cluster_options: Any) -> list[SolveResult]:
    """Solve many independent linear systems, batched and dispersed over every device.

    Small systems are packed into block-diagonal batches solved by the
    batched Krylov core, in which every system keeps its own scalars and its
    own convergence test; large systems run alone; batches go longest-first
    to the device predicted to finish them earliest. An out-of-memory or
    device error splits a batch and retries the halves elsewhere, finally on
    the CPU: every system comes back exactly once, in input order.

    Parameters
    ----------
    systems : iterable of LinearSystem or (A, b) pairs
        Any mix of sizes, dtypes and array types (SciPy, CuPy, torch; on the
        host or already on a GPU).
    disperse : bool
        Spread the work over all ``devices``; False keeps it on one device
        (the one already holding most of the inputs, else the one with most room).
    devices : str or list, optional
        Devices to use (``"cuda:0,cuda:1"``); default: every accelerator of
        ``manager``, else the CPU.
    method : {"auto", "cg", "bicgstab", "gmres", "minres", "direct"}
        Overrides each system's method when not "auto". "auto" picks CG for
        symmetric matrices with a positive diagonal, BiCGStab otherwise, and
        on a CPU-only run a sparse LU for systems up to ``DIRECT_MAX_N``
        unknowns (faster than CG there, measured). CG, BiCGStab and GMRES(30)
        systems are batched; an "auto" system on which CG breaks down (an
        indefinite matrix) is solved again alone with MINRES, one on which
        BiCGStab breaks down (eigenvalues near the imaginary axis) again in a
        GMRES batch, and its result says ``info["fallback_from"]``.
    M : {"jacobi", ...} or operator, optional
        Preconditioner for every system (overrides theirs when given).
    rtol : float, optional
        Relative tolerance for every system; default: each system's own
        (1e-8 for pairs).
    progress : bool
        Show a tqdm progress bar of systems done, with throughput.
    return_on : {"device", "host"}
        Leave each ``x`` where it was solved, or return NumPy arrays.
    on_error : {"return", "raise"}
        "raise" raises :class:`SolveManyError` after all systems finished if any
        did not converge, listing which and why.
    manager : DeviceManager, optional
        Default: ``managed_solve.device_manager``.
    backend : {"local", "ray"}
        ``"ray"`` runs the same call over the nodes of a Ray cluster
        (:func:`managed_solve.cluster.solve_many_ray`; ``return_on`` is then
        "host" or "refs", "device" meaning "host"); ``cluster_options``
        (``address``, ``num_nodes_hint``, ...) go there.

    Returns
    -------
    list of SolveResult
        In input order. Each has ``status``, ``iterations``, the true
        ``residual_norm``, the ``device`` it was solved on, and ``info``
        (``batch`` id and ``batch_size``). In a batch, ``x`` is a view into the
        batch's solution vector (no copy), cut when ``x`` is first read; a
        result keeps the batch's vector alive until then.

    Raises
    ------
    SolveManyError
        With ``on_error="raise"``, when some system did not converge.

    Notes
    -----
    While a call runs, automatic (cyclic) garbage collection is paused, and
    with two or more GPUs the interpreter's GIL switch interval is 0.5 ms
    (0.1 ms while the call plans beside workers already started, on any
    number of GPUs); all are restored when the last concurrent call returns
    (``scheduler.PAUSE_GC`` and ``SWITCH_INTERVAL`` / ``HEAD_SWITCH_INTERVAL =
    None`` leave them alone). One process feeds every GPU: a full collection
    or a 5 ms GIL hand-off stalls all of them (``docs/performance.md``).

    With many systems (``HEAD_START_SYSTEMS``), the large ones (which run
    alone) start computing before the others are estimated and planned.

    See Also
    --------
    managed_solve.solve : one system on one device.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> import managed_solve as ms
    >>> A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> dm = ms.DeviceManager(["cpu"])
    >>> res = solve_many([(A, np.ones(50)), (2 * A, np.ones(50))], manager=dm)
    >>> [r.converged for r in res]
    [True, True]
    >>> bool(np.allclose(2 * A @ res[1].x, 1.0))
    True
    """
    if backend == "ray":
        if manager is not None:
            raise TypeError("solve_many(backend='ray', manager=...): a manager cannot travel to "
                            "other nodes; each node makes its own. Drop manager=.")
        from .cluster import solve_many_ray  # the Ray backend sits beside, imported on demand

        return solve_many_ray(systems, return_on="host" if return_on == "device" else return_on,
                              disperse=disperse, devices=devices, method=method, M=M, rtol=rtol,
                              progress=progress, on_error=on_error, **cluster_options)
    if backend != "local":
        raise ValueError(f"solve_many(backend={backend!r}): expected 'local' (this machine) or "
                         "'ray' (a Ray cluster)")
    if cluster_options:
        raise TypeError(f"solve_many: unexpected argument(s) {sorted(cluster_options)}; options "
                        "other than solve_many's own apply to backend='ray' only")
    _check_arguments(method, M, rtol, return_on, on_error, progress)
    with _GC.held(False, active=PAUSE_GC):
        return _solve_many_local(systems, disperse=disperse, devices=devices, method=method, M=M,
                                 rtol=rtol, progress=progress, return_on=return_on,
                                 on_error=on_error, manager=manager)


# While solve_many runs, two interpreter settings are changed for the whole
# process, and restored (as the caller had them) when the last concurrent
# call returns:
#
# - automatic (cyclic) garbage collection is paused (PAUSE_GC): a call makes
#   tens of thousands of objects (estimates, batches, results) that survive
#   it, which sets off full collections of the process; each held the GIL for
#   70-100 ms with 10,000 results alive (H200 host), stalling every GPU's
#   worker at once. Reference counting frees everything acyclic as usual.
# - with two or more GPUs, the GIL switch interval is shortened
#   (SWITCH_INTERVAL, seconds; None leaves it): each GPU's worker wakes on
#   CUDA events and must take the GIL back from the stager threads running
#   Python, which with the default 5 ms made it see convergence late. W2-large
#   on 2 x H200, paired runs in one process (medians of 3): 591 and 626 ms
#   with 0.5 ms, 609 and 645 ms with 5 ms: a small gain, in both pairs.
PAUSE_GC = True
SWITCH_INTERVAL: float | None = 5e-4


class _ProcessSetting:
    """An interpreter setting held while any solve_many call needs it.

    Calls (and nested phases of one call) may ask for different values: the
    smallest one asked for holds (a shorter GIL switch interval; collection
    off, False < True); the caller's own value comes back when the last
    request ends.
    """

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], None]):
        self.get, self.put = get, put
        self.lock = threading.Lock()
        self.requests: list[Any] = []
        self.saved: Any = None

    @contextmanager
    def held(self, value: Any, active: bool = True) -> Iterator[None]:
        if not active:
            yield
            return
        with self.lock:
            if not self.requests:
                self.saved = self.get()
            self.requests.append(value)
            self.put(min(self.requests))
        try:
            yield
        finally:
            with self.lock:
                self.requests.remove(value)
                self.put(min(self.requests) if self.requests else self.saved)


def _set_gc(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()


_GC = _ProcessSetting(gc.isenabled, _set_gc)
_SWITCH = _ProcessSetting(sys.getswitchinterval, sys.setswitchinterval)


# A call holding many systems and a few large ones (which run alone: see
# packing.ALONE_ROWS) estimates, plans and starts the large ones first; the
# others are estimated and planned while the devices compute those, and their
# batches join the queues (planned against the same slots, so the dispersal
# is the one a single plan makes when the large batches are the longest).
# The estimate loop is Python over every system (10,004 systems: 20-60 ms on
# a 2 x H200 host), time in which no GPU had work. Used from HEAD_START_SYSTEMS
# other systems on, with accelerators (simulated ones too) only.
HEAD_START_SYSTEMS = 256
# The GIL switch interval (seconds; None leaves it) while the rest is
# estimated beside the started workers. One H200, W2-large: with the
# estimate loop holding the GIL, the first 1M-row batch's graph capture took
# 10-14 ms instead of 1-2 and its packing 19 ms instead of 10, each CUDA call
# of the stager waiting out the 0.5 ms interval to take the GIL back.
HEAD_SWITCH_INTERVAL: float | None = 1e-4
# A large system whose "auto" method test (symmetry, diagonal) is still running
# is staged at once, the method found after its copy (see DEFERRED).
HEAD_DEFER_METHOD = True


def _head_start(valid: Sequence[LinearSystem | None], devs: Sequence[Device],
                host_only: bool) -> tuple[list[int], list[int], int]:
    """(positions started first, the others, a bound on the rows batches will hold).

    A system is started first when it has at least the rows that make a
    system run alone under the largest batch size the call can plan (from
    the rows of every CSR system, a bound on those the batches will hold), so
    it runs alone in the full plan too.
    """
    idx = [i for i, s in enumerate(valid) if s is not None]
    if host_only or len(idx) <= HEAD_START_SYSTEMS:
        return [], idx, 0
    n = np.fromiter((valid[i].n if valid[i].kind == "csr" else 0 for i in idx), np.int64, len(idx))
    bound = int(n.sum())
    alone = min(ALONE_ROWS, max(1, target_rows(bound, len(devs), devs[0].kind) // 4))
    big = n >= alone
    if not big.any() or len(idx) - int(big.sum()) < HEAD_START_SYSTEMS:
        return [], idx, 0
    pos = np.asarray(idx, dtype=np.int64)
    return pos[big].tolist(), pos[~big].tolist(), bound


def _solve_many_local(systems: Iterable[Any], *, disperse: bool, devices: Any, method: str, M: Any,
                      rtol: float | None, progress: bool, return_on: str, on_error: str,
                      manager: DeviceManager | None) -> list[SolveResult]:
    """:func:`solve_many` on this machine (arguments checked)."""
    items = list(systems)
    mgr = manager if manager is not None else default_manager()
    results: list[SolveResult | None] = [None] * len(items)
    valid: list[LinearSystem | None] = [None] * len(items)
    memo: dict = {}  # arrays found finite, for this call
    for i, item in enumerate(items):
        try:
            valid[i] = _validate(item, i, method=method, M=M, rtol=rtol, memo=memo)
        except (TypeError, ValueError) as exc:
            results[i] = _invalid(exc, i, item)
    del memo

    devs = _select_devices(mgr, devices, disperse, valid)
    host_only = all(d.kind == "cpu" for d in devs)
    ref = devs[0]
    cache: dict = {}  # symmetry per matrix object, for this call
    early = _prefetch_methods(valid, cache)

    def estimates(indices: Iterable[int], defer: bool = False) -> list[Estimate]:
        out = []
        for i in indices:
            s = valid[i]
            try:
                if early and s.kind == "csr":
                    pending = early.get(id(s.A))
                    if pending is not None and defer and not pending.done() and s.method == "auto" \
                            and _batched_preconditioner(s):
                        out.append(_deferred_estimate(s, i))  # its method found while it is copied
                        continue
                    if pending is not None:
                        pending.result()  # the large matrix's method, found beside this loop
                out.append(estimate(s, i, host_only=host_only, manager=mgr, reference=ref,
                                    cache=cache))
            except (TypeError, ValueError) as exc:
                valid[i] = None
                results[i] = _invalid(exc, i, s)
        return out

    bar = None
    if progress:
        tqdm = _backend.require("tqdm", "solve_many(progress=True)")
        bar = tqdm.tqdm(total=len(items), unit="system", desc="solve_many", smoothing=0.1)
        bar.update(sum(r is not None for r in results))
    try:
        batch_bytes = _packed_bytes(mgr, valid)
        head, rest, rows_bound = _head_start(valid, devs, host_only)
        gpus = sum(d.is_gpu for d in devs)  # simulated GPUs too: the same threads
        with _SWITCH.held(SWITCH_INTERVAL, active=SWITCH_INTERVAL is not None and gpus >= 2):
            if head:
                # The systems that run alone start now; the others are
                # estimated and planned while they compute (HEAD_START_SYSTEMS).
                ests = estimates(head, defer=HEAD_DEFER_METHOD)

                def method_of(s: LinearSystem) -> str:
                    pending = early.get(id(s.A))
                    if pending is not None:
                        pending.result()
                    return _krylov_method(s, cache)

                first = plan_work(ests, devs, mgr, batch_bytes=batch_bytes, packed_rows=rows_bound)
                runner = _Runner(valid, first, devs, mgr, results, bar=bar,
                                 batch_bytes=batch_bytes, more=True, method_of=method_of)
                runner.start()
                try:
                    # The loop below is Python beside the workers' first copies and
                    # graph captures, which take the GIL back after each of their
                    # many CUDA calls: with the loop holding it, each waited out the
                    # switch interval (see HEAD_SWITCH_INTERVAL).
                    with _SWITCH.held(HEAD_SWITCH_INTERVAL, active=HEAD_SWITCH_INTERVAL is not None):
                        ests_rest = estimates(rest)
                    packed = sum(e.n for e in ests + ests_rest if e.route != SINGLE)
                    runner.extend(plan_work(ests_rest, devs, mgr, batch_bytes=batch_bytes,
                                            slots=first.slots, packed_rows=packed,
                                            first_id=first.next_id))
                except BaseException:
                    if runner.more:
                        runner.extend(None)  # the workers finish what they have, then stop
                    runner.join()
                    raise
                plan = runner.plan
            else:
                plan = plan_work(estimates(rest), devs, mgr, batch_bytes=batch_bytes)
                runner = _Runner(valid, plan, devs, mgr, results, bar=bar, batch_bytes=batch_bytes)
                runner.start()
            runner.join()
        # Sharded systems use every accelerator at once: after the batches.
        for i in plan.sharded:
            results[i] = _run_sharded(valid[i], devs, mgr)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    missing = [i for i, r in enumerate(results) if r is None]
    if missing:  # every path above delivers; this guards the promise "nothing lost"
        raise RuntimeError(f"solve_many: internal error, no result for systems {missing[:10]}")
    out: list[SolveResult] = results  # type: ignore[assignment]
    if return_on == "host":
        for r in out:
            if r.x is not None:
                r.x = np.asarray(_backend.to_host(r.x))  # sync: copies each x to the host
    if on_error == "raise":
        failed = [i for i, r in enumerate(out) if not r.converged]
        if failed:
            lines = [f"systems[{i}] ({out[i].name or 'unnamed'}): {out[i].status.name}: "
                     f"{out[i].message or out[i].status.message}" for i in failed[:20]]
            more = f"\n... and {len(failed) - 20} more" if len(failed) > 20 else ""
            raise SolveManyError(
                f"solve_many: {len(failed)} of {len(out)} systems did not converge:\n"
                + "\n".join(lines) + more + "\nPass on_error='return' to get them back with "
                "their status instead.", out, failed)
    return out
