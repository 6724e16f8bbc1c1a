"""The backward of ``solve_many``: every adjoint on what its forward prepared.

When systems' inputs require grad, the forward keeps, per system, what its
route prepared and the adjoint ``A^T lam = g`` can reuse (:class:`Kept`):

- ``DIRECT``: the LU factors, solved with ``trans`` (the same triangular
  factors, no factorisation);
- ``BATCH``: the packed batch on its device (matrices, Jacobi diagonal,
  offsets, each system's tolerance); the adjoints of one batch are one
  batched solve of it with the gradients as right-hand sides (A^T packed
  by one transpose of the batch unless it is a CG batch of exactly symmetric matrices);
- ``SINGLE``: the open :class:`~managed_solve.solver.Solver` (engines,
  preconditioner, hierarchy or factors), through its adjoint solve.

The adjoints of one backward run together: the batches and solvers of each
device in order on a thread of their own, the LU solves one per core. No
input is validated, no method or route estimated, nothing packed from the
host or factorised again. A system with nothing kept (a sharded one, a
fallback, a batch the ledger had no room to keep) is solved as before: one
batched ``solve_many`` of its adjoint system. What is kept is released once,
when torch frees the graph (after a backward without ``retain_graph``, or
when the graph is dropped); kept batches and factors hold their bytes in
the manager's ledger until then (a solver holds its own reservation). The
Ray backend keeps nothing on its nodes: its adjoints take the second way.

A singular system (``nullspace=``) is solved alone (``SINGLE``), and so is
its adjoint: on its kept solver, whose transposed solve needs only A's null
space; from its system, a symmetric A keeps its null space and a
non-symmetric one is refused (:func:`~managed_solve.autograd.adjoint_system`:
A^T's null space is not known).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _backend, autograd
from ..devices import Device
from ..manager import DeviceManager
from ..result import SolveResult, Status
from ..system import LinearSystem, is_symmetric
from . import routes
from .validate import with_x0

log = logging.getLogger("managed_solve")


@dataclass(frozen=True)
class Forward:
    """What an adjoint needs of its forward result: never the result itself.

    A result holds the tensor that autograd's node outputs, and the node
    holds the adjoints' closure: a reference back to the result would make a
    cycle through torch's graph that Python's collector cannot see, and
    what the forward kept would never be released.
    """

    name: str | None
    method: str
    device: str

    @classmethod
    def of(cls, result: SolveResult | None) -> Forward | None:
        return None if result is None else cls(result.name, result.method, result.device)


class KeptBatch:
    """A forward batch's arrays, kept for its systems' adjoints (no right-hand side, no x0)."""

    def __init__(self, indices: Sequence[int], packed: Any, method: str, device: Device,
                 reservation: Any):
        from ..solvers.batched import PackedBatch

        self.indices = list(indices)
        self.method = method
        self._symmetric: bool | None = None
        self.device = device
        self.reservation = reservation
        # The operator part only: the forward's b, x0, workspace and pinned
        # host buffers are not kept.
        self.packed = PackedBatch(indptr=packed.indptr, indices=packed.indices, data=packed.data,
                                  b=None, x0=None, offsets=packed.offsets, row_sys=packed.row_sys,
                                  rtol=packed.rtol, atol=packed.atol, maxiter=packed.maxiter,
                                  dinv=packed.dinv, device=packed.device, names=packed.names)

    @staticmethod
    def nbytes(packed: Any) -> int:
        """Device bytes a kept batch holds (the packed CSR, row ids and Jacobi diagonal)."""
        arrays = (packed.indptr, packed.indices, packed.data, packed.row_sys, packed.dinv)
        return int(sum(a.nbytes for a in arrays if a is not None))

    @property
    def symmetric(self) -> bool:
        """Whether the batch is its own adjoint: a CG batch whose matrices equal their transposes
        by float64's rule, whatever the dtype (float32's looser rule let them into a CG batch,
        but a gradient through A for A^T would carry the asymmetry it allows). Tested once,
        on the block-diagonal matrix."""
        if self._symmetric is None:
            self._symmetric = self.method in autograd.SYMMETRIC_METHODS and self._exact()
        return self._symmetric

    def _exact(self) -> bool:
        p = self.packed
        arrays, xp = (p.data, p.indices, p.indptr), p.xp
        if xp is not np and p.index_dtype != np.int32:  # cuSPARSE's CSR takes int32 indices only
            arrays, xp = tuple(_backend.to_host(a) for a in arrays), np
        A = _backend.sparse_module(xp).csr_matrix(arrays, shape=(p.n, p.n))
        return is_symmetric(A, exact=True)

    def operator(self) -> Any:
        """The packed batch of the adjoints' matrices: A itself, or A^T (block-diagonal too)."""
        p = self.packed
        if self.symmetric:
            return p
        from ..solvers.batched import PackedBatch

        idt = p.index_dtype
        if p.xp is not np and idt != np.int32:  # cuSPARSE transposes int32 indices only
            raise NotImplementedError("a batch with int64 indices is transposed on the host")
        sparse = _backend.sparse_module(p.xp)
        N = p.n
        T = sparse.csr_matrix((p.data, p.indices, p.indptr), shape=(N, N)).T.tocsr()
        return PackedBatch(indptr=T.indptr.astype(idt, copy=False),
                           indices=T.indices.astype(idt, copy=False), data=T.data, b=None,
                           x0=None, offsets=p.offsets, row_sys=p.row_sys, rtol=p.rtol,
                           atol=p.atol, maxiter=p.maxiter, dinv=p.dinv, device=p.device,
                           names=p.names)

    def release(self) -> None:
        self.packed = None
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None


class Kept:
    """What one ``solve_many`` call prepared that its systems' adjoints reuse (thread-safe).

    ``wanted`` holds the indices of the systems whose inputs require grad:
    the runner keeps their routes' state through :meth:`add_factors`,
    :meth:`add_batch` and :meth:`add_solver`.
    """

    def __init__(self, manager: DeviceManager, wanted: set[int] | None = None):
        self.manager = manager
        self.wanted: set[int] = set(wanted or ())
        self._lock = threading.Lock()
        self._factors: dict[int, Any] = {}
        self._batches: dict[int, tuple[KeptBatch, int]] = {}
        self._solvers: dict[int, Any] = {}
        self._held: dict[int, Any] = {}  # the ledger's reservation of each kept engine's factors
        self._released = False

    def __contains__(self, i: int) -> bool:
        return i in self._factors or i in self._batches or i in self._solvers

    def add_factors(self, i: int, engine: Any) -> None:
        """Keep LU factors (shared by systems with one matrix) and their bytes in the ledger.

        When the host has no room for them now, they are not kept: the
        runner closes them and the adjoint factorises its matrix again.
        """
        with self._lock:
            if self._released:
                return
            if id(engine) not in self._held:
                try:
                    self._held[id(engine)] = self.manager.reserve(
                        engine.factor_bytes, device=self.manager.cpu, seconds=0.0, timeout=0.0,
                        spill=False)
                except MemoryError:
                    return
            self._factors[i] = engine

    def add_solver(self, i: int, solver: Any) -> None:
        """Keep an open solver (it holds its own reservation); released with the rest."""
        with self._lock:
            if not self._released:
                self._solvers[i] = solver
                return
        solver.release()

    def add_batch(self, indices: Sequence[int], packed: Any, method: str, device: Device,
                  results: Sequence[Forward]) -> None:
        """Keep a solved batch for those of its systems that want gradients.

        Systems that fell back to another method are left out (their adjoint
        would break down the same way). The batch's bytes are reserved in the
        ledger without waiting: when the device has no room, nothing is kept
        and those adjoints are solved from their systems.
        """
        mine = [k for k, i in enumerate(indices) if i in self.wanted and results[k].x is not None
                and "fallback_from" not in results[k].info]
        if not mine:
            return
        try:
            reservation = self.manager.reserve(KeptBatch.nbytes(packed), device=device,
                                               seconds=0.0, timeout=0.0, spill=False)
        except MemoryError:
            return
        kb = KeptBatch(indices, packed, method, device, reservation)
        with self._lock:
            if not self._released:
                for k in mine:
                    self._batches[indices[k]] = (kb, k)
                return
        kb.release()

    def engines(self) -> set[int]:
        """Ids of the kept LU factors (the runner's cache closes the others)."""
        with self._lock:
            return {id(e) for e in self._factors.values()}

    def release(self) -> None:
        """Close every kept engine and batch once (idempotent)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            factors, self._factors = self._factors, {}
            batches, self._batches = self._batches, {}
            solvers, self._solvers = self._solvers, {}
            held, self._held = self._held, {}
        for engine in {id(e): e for e in factors.values()}.values():
            engine.close()
        for reservation in held.values():
            reservation.release()
        for kb in {id(kb): kb for kb, _ in batches.values()}.values():
            kb.release()
        for solver in solvers.values():
            solver.release()

    # ---------------------------------------------------------------- backward
    def solve(self, systems: Sequence[LinearSystem | None], results: Sequence[Forward],
              rhs: list[tuple[int, Any]]) -> dict[int, SolveResult]:
        """The adjoints of ``rhs`` ((system index, g) pairs) that have kept state, by index.

        An adjoint that fails here (a device error, singular factors) is
        left out: the caller solves it from its system.
        """
        with self._lock:
            if self._released:
                return {}
            lus = [(i, g, self._factors[i]) for i, g in rhs if i in self._factors]
            per_device: dict[str, list[Callable[[], dict]]] = {}
            groups: dict[int, tuple[KeptBatch, dict[int, tuple[int, Any]]]] = {}
            for i, g in rhs:
                if i in self._batches:
                    kb, k = self._batches[i]
                    groups.setdefault(id(kb), (kb, {}))[1][k] = (i, g)
                elif i in self._solvers:
                    solver = self._solvers[i]
                    per_device.setdefault(str(solver.device), []).append(
                        lambda i=i, g=g, solver=solver: {i: _solver_adjoint(solver, g, results[i])})
            for kb, items in groups.values():
                per_device.setdefault(str(kb.device), []).append(
                    lambda kb=kb, items=items: _batch_adjoints(kb, items, systems, results,
                                                               self.manager))
        got: dict[int, SolveResult] = {}
        lock = threading.Lock()

        def keep(out: dict[int, SolveResult]) -> None:
            # A device error (out of memory) is retried from the system, placed anew.
            with lock:
                got.update((i, r) for i, r in out.items() if r.status is not Status.DEVICE_ERROR)

        def run_device(tasks: list[Callable[[], dict]]) -> None:
            for task in tasks:
                try:
                    keep(task())
                except Exception as exc:  # noqa: BLE001 - solved from its system instead
                    log.info("solve_many: an adjoint on kept state failed (%r); solving it from "
                             "its system", exc)

        def run_lu(i: int, g: Any, engine: Any) -> None:
            try:
                res = _lu_adjoint(engine, systems[i], g, results[i])
            except Exception as exc:  # noqa: BLE001 - solved from its system instead
                log.info("solve_many: an adjoint on kept factors failed (%r); solving it from "
                         "its system", exc)
                return
            if res is not None:
                keep({i: res})

        workers = len(per_device) + (min(_backend.cpu_count(), len(lus)) if lus else 0)
        if workers <= 1:  # one task list or one LU: no thread needed
            for tasks in per_device.values():
                run_device(tasks)
            for lu in lus:
                run_lu(*lu)
            return got
        with ThreadPoolExecutor(workers, thread_name_prefix="solve_many-adjoint") as pool:
            futures = [pool.submit(run_device, tasks) for tasks in per_device.values()]
            futures += [pool.submit(run_lu, *lu) for lu in lus]
            for f in futures:
                f.result()
        return got


def keep(systems: Sequence[LinearSystem | None], manager: DeviceManager) -> Kept | None:
    """Where the routes keep what the adjoints of a call's systems reuse; None if nothing is wanted.

    Something is kept for the systems whose inputs require grad, when the
    caller's thread records gradients (grad mode is per thread: read here,
    on the caller's).
    """
    if not autograd.recording():
        return None
    wanted = {i for i, s in enumerate(systems) if s is not None and s.grad is not None}
    return Kept(manager, wanted) if wanted else None


def attach(results: list[SolveResult], validated: Sequence[LinearSystem | None],
           kept: Kept | None, solve_batch: Callable[[list[LinearSystem]], list[SolveResult]]
           ) -> None:
    """Attach the results whose systems' inputs require grad; backward is :func:`solve_adjoints`.

    ``kept`` (what the forward prepared, or None) is released with the
    graph, at once when nothing is attached.
    """
    if not any(s is not None and s.grad is not None for s in validated):
        if kept is not None:
            kept.release()
        return
    forward = [Forward.of(r) for r in results]  # not the results: see Forward
    autograd.attach_many(results, validated, lambda rhs: solve_adjoints(
        kept, validated, forward, rhs, solve_batch),
        release=kept.release if kept is not None else None)


def solve_adjoints(kept: Kept | None, systems: Sequence[LinearSystem | None],
                   results: Sequence[Forward], rhs: list[tuple[int, Any]],
                   solve_batch: Callable[[list[LinearSystem]], list[SolveResult]]
                   ) -> list[SolveResult]:
    """One backward's adjoints: on the kept state, the rest through one ``solve_batch`` call."""
    got = kept.solve(systems, results, rhs) if kept is not None else {}
    rest = [(i, g) for i, g in rhs if i not in got]
    if rest:
        redo = solve_batch([autograd.adjoint_system(systems[i], results[i], g) for i, g in rest])
        got.update(zip((i for i, _ in rest), redo, strict=True))
    return [got[i] for i, _ in rhs]


def _adjoint_name(forward: Forward) -> str:
    return f"adjoint of {forward.name}"


def _lu_adjoint(engine: Any, s: LinearSystem, g: Any, forward: Forward) -> SolveResult | None:
    """``A^T lam = g`` on the forward's LU factors (None: singular, solved from the system)."""
    t0 = time.perf_counter()
    b = np.ascontiguousarray(_backend.to_host(g), dtype=s.dtype).reshape(-1)
    out = engine.solve_to(b, s.rtol, s.atol, trans=True)
    if out.x is None:
        return None
    res = routes.lu_result(out, _adjoint_name(forward), float(np.linalg.norm(b)),
                           time.perf_counter() - t0)
    res.device = forward.device
    return res


def _solver_adjoint(solver: Any, g: Any, forward: Forward) -> SolveResult:
    """``A^T lam = g`` on the forward's open solver (its engines prepared once)."""
    with routes.host_kernels(solver.device):
        res = solver.adjoint(g)
    res.name = _adjoint_name(forward)
    return res


def _batch_adjoints(kb: KeptBatch, items: dict[int, tuple[int, Any]],
                    systems: Sequence[LinearSystem | None], results: Sequence[Forward],
                    manager: DeviceManager) -> dict[int, SolveResult]:
    """The adjoints of one kept batch as one batched solve (systems without a gradient: b = 0).

    Each adjoint keeps its system's tolerance, method and iteration limit;
    the verify-and-fall-back rule of the forward applies (restarts, fallbacks
    on the adjoint systems).
    """
    from ..solvers.batched import BatchedEngine, PackedBatch

    dev = kb.device
    with dev.context(), routes.host_kernels(dev):
        op = kb.operator()
        xp = op.xp
        dt = op.dtype
        offsets = op.offsets.tolist()
        adjoints = []
        for k, i in enumerate(kb.indices):
            s = systems[i]
            item = items.get(k)
            if item is None:  # converges at once to x = 0; its result is dropped
                part = xp.zeros(offsets[k + 1] - offsets[k], dtype=dt)
                adjoints.append(_adjoint_copy(s, s.A, part, s.name, s.M))
                continue
            part = xp.asarray(item[1]).reshape(-1).astype(dt, copy=False)
            A = s.A if kb.symmetric else autograd.transposed(s)
            M = s.M if kb.symmetric or s.M is None or isinstance(s.M, str) else None
            adjoints.append(_adjoint_copy(s, A, part, _adjoint_name(results[i]), M))
        b = xp.concatenate([a.b for a in adjoints])
        batch = PackedBatch(indptr=op.indptr, indices=op.indices, data=op.data, b=b, x0=None,
                            offsets=op.offsets, row_sys=op.row_sys, rtol=op.rtol, atol=op.atol,
                            maxiter=op.maxiter, dinv=op.dinv, device=op.device,
                            names=[a.name for a in adjoints])
        out = routes.solve_packed(adjoints, BatchedEngine().prepare_batch(batch), kb.method, dev,
                                  manager)
    return {i: out[k] for k, (i, _g) in items.items()}


def _adjoint_copy(s: LinearSystem, A: Any, b: Any, name: str | None, M: Any) -> LinearSystem:
    """``s`` with another matrix and right-hand side, no x0, nothing requiring grad (no validation)."""
    t = with_x0(s, None)
    t.A, t.b, t.name, t.M, t.grad = A, b, name, M, None
    return t
