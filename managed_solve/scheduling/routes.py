"""How each route of ``solve_many`` runs its systems on one device.

- ``BATCH``: one batch prepared by the batched engine
  (``BatchedEngine.prepare_batch``, on the stage thread) and solved by it:
  :func:`compute_batch` on the device, then :func:`batch_results` builds each
  system's result, checking its true residual (:func:`run_batch`: both);
- ``DIRECT``: a sparse LU on the host (:func:`host_lu`), one system per core;
- ``SINGLE``: ``solve()`` on the device (:func:`run_single`);
- sharded: one system too large for any device, over every accelerator
  (:func:`run_sharded`).

Every route applies the one verify-and-fall-back rule of
:mod:`managed_solve.solvers.verify`.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import numpy as np

from .. import _backend, _solve
from ..devices import Device
from ..manager import DeviceManager
from ..result import SlicedResult, SolveResult, Status
from ..sharded import predict_shard_bytes
from ..solver import Solver
from ..solvers._common import SAFE_NORM_RANGE, column_norms, set_up_by, stable_norm
from ..solvers.direct import SINGULAR, DirectEngine, Singular, direct
from ..solvers.engine import BREAKDOWN, CONVERGED, Options, Outcome
from ..solvers.verify import (
    FALL_BACK,
    RESTART,
    STATUS,
    accepted,
    fallback_for,
    status_of,
    tolerance,
    verdict,
)
from ..system import FALLBACK, LinearSystem
from ..system.method import choose_method
from .errors import is_device_error
from .estimate import BATCHED_METHODS, is_jacobi, single_bytes
from .validate import with_x0

log = logging.getLogger("managed_solve")

# Host-side Krylov work (CPU and simulated devices, which compute with
# NumPy/Numba on the host) runs one batch at a time: each batch already
# shares its systems out over every core (solvers/batched/cpu.py), and
# Numba's workqueue threading layer aborts when two threads launch parallel
# kernels (one large system's row-parallel sweeps) at once.
_HOST_KERNEL_LOCK = threading.Lock()


def host_kernels(dev: Device) -> Any:
    """The host-kernel lock for work on a host or simulated device; nothing on a GPU."""
    return _HOST_KERNEL_LOCK if not dev.is_cuda else nullcontext()


# --------------------------------------------------------------------------- BATCH
def packing_systems(systems: Sequence[LinearSystem | None], indices: Sequence[int],
                    jacobi: bool) -> list[LinearSystem]:
    """The systems ``indices`` of the call, as the batched engine packs them.

    With Jacobi, packing refuses a diagonal it cannot divide by, naming the
    system by its name or else by its place in the batch, which after a
    split (or in any batch but the first) is not the caller's. An unnamed
    system is therefore packed as a shallow copy (arrays shared) named
    ``systems[i]``, its position in the caller's list; results are built
    from the caller's systems, so their names stay as given.
    """
    picked = [systems[i] for i in indices]
    if not jacobi:  # nothing in packing names a system then
        return picked
    return [s if s.name else _labelled(s, f"systems[{i}]")
            for i, s in zip(indices, picked, strict=True)]


def _labelled(s: LinearSystem, name: str) -> LinearSystem:
    t = copy.copy(s)  # shallow: the arrays are shared
    t.name = name
    return t


def compute_batch(prepared: Any, method: str, dev: Device) -> tuple:
    """The device part of a batch on ``dev`` (:func:`run_packed`), under the host-kernel lock there."""
    with host_kernels(dev):
        return run_packed(prepared, method)


def batch_results(systems: list[LinearSystem], prepared: Any, method: str, dev: Device,
                  manager: DeviceManager, solved: tuple, info: dict) -> list[SolveResult]:
    """The host part of a batch computed by :func:`compute_batch` (:func:`packed_results`).

    Built beside the device's next batch: the host-kernel lock is taken
    only around the restarts and fallbacks it solves.
    """
    return packed_results(systems, prepared, method, dev, manager, solved, info=info,
                          guard=host_kernels(dev))


def run_batch(systems: list[LinearSystem], prepared: Any, method: str, dev: Device,
              manager: DeviceManager, info: dict) -> list[SolveResult]:
    """Both parts of a batch in one piece (:func:`solve_packed`), under the host-kernel lock."""
    with host_kernels(dev):
        return solve_packed(systems, prepared, method, dev, manager, info=info)


def run_packed(prepared: Any, method: str) -> tuple:
    """The device part of a batch: the batched engine's solve, with each system's true residual norm.

    ``prepared``: the batch as the batched engine prepared it
    (``BatchedEngine.prepare_batch``), whose solve returns the true norms.
    Returns ``(outcome, residual norms, b norms, seconds)``, the norms on
    the host.
    """
    t0 = time.perf_counter()
    out = prepared.solve(method=method)
    seconds = time.perf_counter() - t0
    rn, bn = out.true_norms
    rescale_extreme_norms(prepared.batch, out.x, rn, bn)
    return out, rn, bn, seconds


def rescale_extreme_norms(packed: Any, x: Any, rn: np.ndarray, bn: np.ndarray) -> None:
    """Per-system norms whose sums of squares overflowed or underflowed, computed again scaled.

    The batched sums of squares lose systems of extreme magnitude (entries
    past about 1e154 overflow, below about 1e-162 underflow); those few
    systems are recomputed one by one with a scaled norm, so the verify rule
    never accepts a system whose residual only looked small.
    """
    lo, hi = SAFE_NORM_RANGE
    # A residual below the range is fine when b is well inside it (the
    # system converged); any other norm outside the range is recomputed (a
    # b of zero norm too: its squares may have underflowed).
    ok_b = (bn > lo) & (bn < hi)
    ok_r = (rn < hi) & ((rn > lo) | (ok_b & (rn <= lo)))
    bad = np.flatnonzero(~(ok_b & ok_r))
    if not bad.size:
        return
    xp = packed.xp
    sparse = _backend.sparse_module(xp)
    offsets = packed.offsets.tolist()
    indptr = packed.indptr
    for k in bad.tolist():
        a, z = offsets[k], offsets[k + 1]
        p0 = int(indptr[a])  # sync: extreme systems only
        ptr = indptr[a:z + 1] - p0
        nnz = int(ptr[-1])  # sync: as above
        A = sparse.csr_matrix((packed.data[p0:p0 + nnz], packed.indices[p0:p0 + nnz] - a, ptr),
                              shape=(z - a, z - a))
        b = packed.b[a:z]
        bn[k] = stable_norm(xp, b)
        rn[k] = stable_norm(xp, b - A @ x[a:z])


def solve_packed(systems: list[LinearSystem], prepared: Any, method: str, device: Device,
                 manager: DeviceManager, *, restart: bool = True,
                 info: dict | None = None) -> list[SolveResult]:
    """One prepared batch through the batched engine, each system's true residual checked.

    ``info`` entries go into every result's ``info``. See :func:`packed_results`.
    """
    return packed_results(systems, prepared, method, device, manager,
                          run_packed(prepared, method), restart=restart, info=info)


def packed_results(systems: list[LinearSystem], prepared: Any, method: str, device: Device,
                   manager: DeviceManager, solved: tuple, *, restart: bool = True,
                   info: dict | None = None, guard: Any = None) -> list[SolveResult]:
    """The host part of a batch: each system's result, by the verify-and-fall-back rule.

    Systems that drifted (the recurrence converged, the true residual
    misses) run again as one warm-started batch (``restart``); any still
    missing it finish alone through ``solve()``. "auto" systems whose method
    broke down go to the fallback method: as one more batch where the
    batched core has it (BiCGStab -> GMRES), else alone (CG -> MINRES).

    ``guard`` (a lock) is held around the solves made here (restarts,
    fallbacks), for a caller that does not hold it already: host kernels run
    one batch at a time (:func:`host_kernels`).
    """
    from ..solvers.batched import BatchedEngine

    guard = guard if guard is not None else nullcontext()
    packed = prepared.batch
    out, rn, bn, seconds = solved
    offsets = packed.offsets.tolist()
    drifted: list[int] = []
    broken: list[int] = []  # "auto" systems to solve again as a batch of the fallback method
    # Python work per system (thousands a batch, while the GPU waits for the
    # next batch): plain lists read once, one shared message, info dicts copied.
    common = {"host_syncs": int(out.host_syncs), "checkpoints": int(out.checkpoints),
              "compactions": int(out.compactions), "gpu_seconds": out.gpu_seconds,
              **(info or {})}
    converged, converged_msg = Status.CONVERGED, Status.CONVERGED.message
    codes, its_of = out.status.tolist(), out.iterations.tolist()
    rns, bns = np.asarray(rn).tolist(), np.asarray(bn).tolist()
    ok = accepted(systems, out.status, rn, bn)  # the common verdict, for all at once
    oks = ok.tolist()
    # x is sliced from the batch's solution when first read.
    results = SlicedResult.cut_many(
        out.x, offsets, [converged if a else STATUS[c] for c, a in zip(codes, oks, strict=True)],
        its_of, rns, bns, str(device), seconds,
        method, [converged_msg if a else "" for a in oks], [s.name for s in systems], common)
    for k in np.flatnonzero(~ok).tolist():
        s, res, code, its, r, bnorm = systems[k], results[k], codes[k], its_of[k], rns[k], bns[k]
        action = verdict(s, method, code, r, bnorm)
        if action == RESTART:
            drifted.append(k)
        elif action == FALL_BACK and FALLBACK[method] in BATCHED_METHODS:
            broken.append(k)
        elif action == FALL_BACK:
            # "auto" chose CG from symmetry and a positive diagonal, but the matrix is
            # indefinite: MINRES alone, as solve() would after its own attempt (not
            # repeated here).
            with guard:
                res = solve_alone(s, None, FALLBACK[method], device, manager)
            res.iterations += its
            res.info["fallback_from"] = method
        elif code == 0:
            res.message = converged_msg
        elif s.x0 is not None and (code == BREAKDOWN or not r <= bnorm):
            # A failure from the caller's start that left x worse than x = 0 (or
            # none: an overflow): solve() judges the start, dropping one that
            # could not have led to the tolerance, and says so.
            with guard:
                res = solve_alone(s, None, method, device, manager)
            res.iterations += its
        else:  # the batched core's codes carry no message: the one solve() gives
            res.message = status_of(Outcome(None, code, its, r), method, r,
                                    tolerance(s, bnorm), s)[1]
        results[k] = res

    def again(ks: list[int], subset: list[LinearSystem], how: str, restart: bool, note: tuple) -> None:
        """Solve ``subset`` (systems ks, changed) as one more batch; their results replace the first."""
        sub = BatchedEngine().prepare_batch(subset, str(device), jacobi=packed.dinv is not None)
        with guard:
            redo = solve_packed(subset, sub, how, device, manager, restart=restart, info=info)
        for k, res in zip(ks, redo, strict=True):
            res.iterations += results[k].iterations
            res.info[note[0]] = note[1]
            results[k] = res

    if drifted and restart:
        again(drifted, [with_x0(systems[k], results[k].x) for k in drifted], method, False,
              ("restarted", True))
    elif drifted:
        for k in drifted:
            with guard:
                results[k] = solve_alone(systems[k], results[k].x, method, device, manager)
    if broken:
        # BiCGStab breaks down on spectra it cannot handle (eigenvalues near the
        # imaginary axis); GMRES cannot break down this way. One batch, from their own x0.
        again(broken, [systems[k] for k in broken], FALLBACK[method], restart,
              ("fallback_from", method))
    return results


def solve_alone(s: LinearSystem, x0: Any, method: str, device: Device,
                manager: DeviceManager) -> SolveResult:
    """``s`` as ``solve()`` solves it, with ``method``, from ``x0`` (None: its own); ``info["polished"]``.

    Inside the bytes the caller holds on ``device`` (:func:`held_solve`).
    Never attached to autograd here: ``solve_many`` attaches its results itself.
    """
    t = with_x0(s, x0 if x0 is not None else s.x0)
    t.method = method
    t.grad = None
    res = held_solve(t, device, manager, rhs=1)
    res.info["polished"] = True
    return res


def held_solve(s: LinearSystem, device: Device, manager: DeviceManager | None, *,
               rhs: int | None = None, keep: Callable[[Solver], None] | None = None,
               tests: dict | None = None) -> SolveResult:
    """``s`` through a :class:`~managed_solve.solver.Solver` on ``device``, within the caller's bytes.

    The runner lends the reservation it holds for the work there
    (:meth:`~managed_solve.manager.DeviceManager.lend`), and the solver's own
    reservation draws on it. What it lacks of the bytes the solver will
    reserve (:func:`.estimate.single_bytes`: a fallback's method needs more
    than its batch's) is added to it from the ledger first; where the ledger
    cannot give that, the solver is not opened (``solve()`` on a device it
    is given would run beyond the ledger) and the result is ``DEVICE_ERROR``,
    which the runner retries on another device, finally the CPU. ``keep``
    receives the open solver of a solved system (the caller then closes
    it); ``rhs``: as ``Solver`` takes it; ``tests``: the call's matrix tests.
    """
    lender = manager.lender(device) if manager is not None else None
    if lender is not None:
        free = lender.nbytes - lender.lent
        short = manager.size_of(single_bytes(s, device.kind, tests, rhs)) - free
        try:
            if short > 0:
                manager.grow(lender, short)
        except MemoryError as exc:
            return SolveResult(None, Status.DEVICE_ERROR, device=str(device), name=s.name,
                               message=f"out of memory on {device}: {exc} Retried on another "
                                       "device, finally the CPU.")
    refused = lender.refused if lender is not None else 0
    solver = Solver.from_system(s, device=device, manager=manager, rhs=rhs)
    try:
        if lender is not None and lender.refused > refused:  # it reserved more than foreseen
            solver.close()
            return SolveResult(None, Status.DEVICE_ERROR, device=str(device), name=s.name,
                               message=f"out of memory on {device}: the solver's bytes exceed "
                                       "those held for it; retried on another device, finally "
                                       "the CPU.")
        res = solver.solve_one(solver.system.b, solver.system.x0)
    except BaseException:
        solver.close()
        raise
    if keep is not None and res.x is not None:
        keep(solver)
    else:
        solver.close()
    return res


# --------------------------------------------------------------------------- DIRECT
class FactorCache:
    """The LU factors of each matrix object one ``solve_many`` call meets (shared by its threads).

    Systems that share a matrix (one operator, many right-hand sides: time
    steps, sweeps over sources) are factorised once; a thread that needs
    factors another thread is computing waits for them.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple, tuple[Any, threading.Lock, list]] = {}

    def prepared(self, A: Any, symmetric: bool) -> Any:
        """The prepared direct engine of host matrix ``A`` (a ``Singular`` exception re-raised)."""
        key = (id(A), bool(symmetric))
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] is not A:
                entry = (A, threading.Lock(), [])
                self._entries[key] = entry
        _A, lock, slot = entry
        with lock:
            if not slot:
                try:
                    slot.append(DirectEngine().prepare(A, Options("direct", symmetric=symmetric),
                                                       None))
                except Singular as exc:
                    slot.append(exc)
        got = slot[0]
        if isinstance(got, Singular):
            raise got
        return got

    def close(self, keep: Any = ()) -> None:
        """Close the factors, except those in ``keep`` (ids of engines kept for adjoints)."""
        with self._lock:
            entries, self._entries = self._entries, {}
        for _A, _lock, slot in entries.values():
            if slot and not isinstance(slot[0], Singular) and id(slot[0]) not in keep:
                slot[0].close()


def host_lu(s: LinearSystem, symmetric: bool, manager: DeviceManager | None = None,
            factors: FactorCache | None = None,
            keep: Callable[[Any], None] | None = None) -> SolveResult:
    """Sparse LU on the host (the package's one, :func:`~managed_solve.solvers.direct.direct`).

    The LU refines its answer toward the system's tolerance; one that still
    misses it says so (MAXITER, x kept). A matrix singular for this b goes,
    under "auto", to the auto policy's Krylov method (the verify rule).
    ``factors`` shares the factorisation among systems with the same matrix;
    ``keep`` then receives the factors that gave the answer (for the adjoint
    of a gradient: the caller closes them).
    """
    t0 = time.perf_counter()
    A = _backend.to_host(s.A)
    b = np.asarray(_backend.to_host(s.b))
    bn = float(np.linalg.norm(b))
    engine = None
    if factors is not None:
        try:
            engine = factors.prepared(A, symmetric)
            out = engine.solve_to(b, s.rtol, s.atol)
        except Singular as exc:
            out = Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
    else:
        out = direct(A, b, symmetric=symmetric, rtol=s.rtol, atol=s.atol)
    seconds = time.perf_counter() - t0
    if out.x is None and verdict(s, "direct", out.code, out.residual_norm, bn) == FALL_BACK:
        then = fallback_for(s, "direct", symmetric)
        res = solve_alone(s, None, then, manager.cpu if manager is not None else "cpu", manager)
        res.info["fallback_from"] = "direct"
        return res
    if out.x is not None and engine is not None and keep is not None:
        keep(engine)
    return lu_result(out, s.name, bn, seconds)


def host_lus(systems: Sequence[LinearSystem], symmetric: bool,
             manager: DeviceManager | None, factors: FactorCache,
             keeps: Sequence[Callable[[Any], None] | None]) -> list[SolveResult]:
    """:func:`host_lu` of each system; those sharing a matrix object solved as one block.

    The systems of a matrix object are the columns of one (n, k) block on
    its factors (:meth:`~managed_solve.solvers.direct.PreparedDirect.solve_to`),
    each judged by its own tolerance: one call a few columns at a time
    instead of k one-column solves, whose BLAS matrix-vector products go to
    BLAS threads that on shared cores cost more than the products.
    ``keeps[j]`` is system j's ``keep`` of :func:`host_lu`.
    """
    by_matrix: dict[int, list[int]] = {}
    for j, s in enumerate(systems):
        by_matrix.setdefault(id(s.A), []).append(j)
    out: list[Any] = [None] * len(systems)
    for members in by_matrix.values():
        if len(members) == 1:
            j = members[0]
            out[j] = host_lu(systems[j], symmetric, manager, factors, keep=keeps[j])
            continue
        for j, res in zip(members, _host_lu_block([systems[j] for j in members], symmetric,
                                                  manager, factors,
                                                  [keeps[j] for j in members]), strict=True):
            out[j] = res
    return out


def _host_lu_block(systems: list[LinearSystem], symmetric: bool,
                   manager: DeviceManager | None, factors: FactorCache,
                   keeps: list) -> list[SolveResult]:
    """:func:`host_lu` of systems sharing one matrix object, their b the columns of one block."""
    t0 = time.perf_counter()
    A = _backend.to_host(systems[0].A)
    B = np.stack([np.asarray(_backend.to_host(s.b)) for s in systems], axis=1)
    b_norms = column_norms(np, B).tolist()
    engine = None
    try:
        engine = factors.prepared(A, symmetric)
        outs = engine.solve_to(B, [s.rtol for s in systems], [s.atol for s in systems])
    except Singular as exc:
        outs = [Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
                for _ in systems]
    seconds = (time.perf_counter() - t0) / len(systems)
    results = []
    for s, out, bn, keep in zip(systems, outs, b_norms, keeps, strict=True):
        if out.x is None and verdict(s, "direct", out.code, out.residual_norm, bn) == FALL_BACK:
            then = fallback_for(s, "direct", symmetric)
            res = solve_alone(s, None, then, manager.cpu if manager is not None else "cpu",
                              manager)
            res.info["fallback_from"] = "direct"
            results.append(res)
            continue
        if out.x is not None:
            out.x = np.ascontiguousarray(out.x)  # its own vector, as a system solved alone has
            if engine is not None and keep is not None:
                keep(engine)
        results.append(lu_result(out, s.name, bn, seconds))
    return results


def lu_result(out: Outcome, name: str | None, b_norm: float, seconds: float) -> SolveResult:
    """The result of a host LU's outcome (singular: x None, the message names the fix)."""
    if out.x is None:
        return SolveResult(None, Status.BREAKDOWN, 0, out.residual_norm, b_norm, seconds=seconds,
                           method="direct", name=name, message=out.message, info=dict(out.info))
    ok = out.code == CONVERGED
    return SolveResult(out.x, STATUS[out.code], 1, out.residual_norm, b_norm, seconds=seconds,
                       method="direct", name=name,
                       message=Status.CONVERGED.message if ok else out.message,
                       info=dict(out.info))


# --------------------------------------------------------------------------- SINGLE
def single_held_bytes(systems: Sequence[LinearSystem], dev: Device, manager: DeviceManager,
                      planned: int, tests: dict | None = None) -> int:
    """Bytes a batch of systems solved alone (route ``SINGLE``) holds on ``dev`` while it runs.

    Each system opens a ``Solver``, which reserves its bytes on the manager
    and draws them on what the batch holds (:func:`held_solve`): the batch
    holds what the largest of them reserves on a device of this kind
    (:func:`.estimate.single_bytes`), or the plan's figure ``planned`` when
    larger (a measured peak, another kind of device). So such systems are
    admitted like any batch (waiting for room, or sent elsewhere) rather
    than run beyond the ledger where it is full. ``tests``: the call's
    matrix tests.
    """
    need = max(single_bytes(s, dev.kind, tests) for s in systems)
    return max(int(planned), manager.size_of(need))


def run_single(s: LinearSystem, dev: Device, manager: DeviceManager, index: int | None = None,
               keep: Callable[[Solver], None] | None = None,
               tests: dict | None = None) -> SolveResult:
    """One system on ``dev`` as ``solve()`` solves it (its method chosen there, by the same policy).

    ``keep`` receives the open :class:`~managed_solve.solver.Solver` (for the
    adjoint of a gradient: the caller releases it); without it the solver
    closes here. Its bytes are those the runner holds for the system there
    (:func:`held_solve`). Never attached to autograd here: ``solve_many``
    attaches its results itself. ``index``: the system's position in the
    call, which set-up errors of an unnamed system name (``systems[i]``).
    """
    label = s.name or (f"systems[{index}]" if index is not None else None)
    with host_kernels(dev), set_up_by(label, False) if label else nullcontext():
        return held_solve(s, dev, manager, keep=keep, tests=tests)


def run_sharded(s: LinearSystem, devs: Sequence[Device], mgr: DeviceManager,
                tests: dict | None = None) -> SolveResult:
    """One system over every accelerator; a device failure falls back to the CPU.

    Each accelerator's shard holds its bytes in the ledger while it runs
    (:func:`held_shards`); one that cannot give them is a device failure
    too, so the system never runs beyond the ledger. Any other failure
    becomes this system's DEVICE_ERROR result (as for a batch), so it never
    sinks the other systems' results. ``tests``: the call's matrix tests.
    """
    gpus = [d for d in devs if d.kind != "cpu"]
    where = ", ".join(str(d) for d in gpus)
    if s.grad is not None:  # solve_many attaches the result; its adjoint is solved like this one
        s = with_x0(s, s.x0)
        s.grad = None
    try:
        try:
            with held_shards(s, gpus, mgr, tests):
                res = _solve.solve(s, devices=[str(d) for d in gpus], manager=mgr)
        except Exception as exc:
            if not is_device_error(exc):
                raise
            log.warning("managed_solve: sharded solve over %s failed (%s); solving on the CPU",
                        where, exc)
            where = str(mgr.cpu)
            res = _solve.solve(s, device=mgr.cpu, manager=mgr)
            res.info["sharded_failure"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - every failure must end in results
        log.error("solve_many: sharded solve of %s on %s failed: %r", s.name, where, exc)
        return SolveResult(None, Status.DEVICE_ERROR, device=where, name=s.name,
                           message=f"solve_many: the sharded solve on {where} raised "
                                   f"{type(exc).__name__}: {exc} (not a device error, so not retried)")
    res.name = s.name
    return res


@contextmanager
def held_shards(s: LinearSystem, gpus: Sequence[Device], mgr: DeviceManager,
                tests: dict | None = None) -> Iterator[None]:
    """Each device's shard of ``s`` reserved in the ledger (and its fault hook asked) for the block.

    The bytes are the sharded solver's own model of its largest shard
    (:func:`~managed_solve.sharded.predict_shard_bytes`) for the method it
    runs: CG where "auto" chooses it, else BiCGStab. ``MemoryError`` where a
    device cannot give them, every reservation taken released.
    """
    method = choose_method(s, gpus[0].kind, cache=tests)
    method = method if method == "cg" else "bicgstab"
    per = mgr.size_of(predict_shard_bytes(s.n, s.nnz, len(gpus), itemsize=s.dtype.itemsize,
                                          method=method, jacobi=is_jacobi(s.M)))
    with ExitStack() as held:
        for d in gpus:
            held.enter_context(mgr.reserve(per, d, signature=("solve_many", "sharded", method)))
            d.check_fault(per)
        yield
