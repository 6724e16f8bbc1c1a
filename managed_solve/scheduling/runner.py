"""Step 4 of ``solve_many``: run a plan, workers per device, and recover from failures.

:func:`run_call` is the step: it takes the plan step's :class:`.plan.Plan`
and returns every system's result in input order. Each device's workers
(on an accelerator one per lane, setting ``lanes_per_device``: a batch
staged while another computes starts at once, on its lane's own CUDA
stream) take batches from its queue (an idle accelerator takes queued batches of a
busier one of the same kind: work stealing), reserves each batch's bytes in
the DeviceManager's ledger while it runs, has its stage thread copy the next
batch while the current one computes (:func:`stage`, below), and hands each
batch to its route once (:mod:`.routes`; on an accelerator the results are
built on its finish thread, beside the next batch's compute). A batch that hits an out-of-memory or
device error is split and its halves retried elsewhere, finally on the CPU;
measured times are recorded so the next call balances better. Every system
is delivered exactly once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from .. import _backend, config
from .._threads import host_cores
from ..devices import Device
from ..manager import DeviceManager
from ..result import SolveResult, Status
from ..system import LinearSystem
from . import routes
from .adjust import Adjustments
from .errors import Regroup
from .estimate import BATCHED_METHODS
from .plan import BATCH, DEFERRED, DIRECT, SINGLE, Batch, Plan, Work

log = logging.getLogger("managed_solve")

_AHEAD = object()  # Runner._pop: a batch was staged for this worker; take it
_LATER = object()  # Runner._start: no room on the device now beside the call's other batches


def run_call(plan: Plan, work: Work, manager: DeviceManager, *, progress: bool = False,
             kept: Any = None) -> list[SolveResult]:
    """Run the plan (and the part ``plan.more`` plans, while this one computes); results in input order.

    ``work`` holds the call's systems, devices and the results already
    known (invalid inputs); ``kept`` (:class:`.adjoint.Kept`) receives what
    the routes prepared for systems whose inputs require grad. Sharded
    systems run after the batches, over every accelerator at once.
    """
    results = work.results
    bar = None
    if progress:
        tqdm = _backend.require("tqdm", "solve_many(progress=True)")
        bar = tqdm.tqdm(total=len(results), unit="system", desc="solve_many", smoothing=0.1)
        bar.update(sum(r is not None for r in results))
    try:
        runner = Runner(work.systems, plan, work.devices, manager, results, bar=bar,
                        more=plan.more is not None, method_of=work.method_of, kept=kept,
                        tests=work.cache)
        runner.start()
        if plan.more is not None:
            try:
                runner.extend(plan.more())  # planned while the first part computes
            except BaseException:
                if runner.more:
                    runner.extend(None)  # the workers finish what they have, then stop
                runner.join()
                raise
        runner.join()
        # Sharded systems use every accelerator at once: after the batches.
        for i in plan.sharded:
            results[i] = routes.run_sharded(work.systems[i], work.devices, manager, work.cache)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:  # every path above delivers; this guards the promise "nothing lost"
        raise RuntimeError(f"solve_many: internal error, no result for systems {missing[:10]}")
    return results


def done_future(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` run now, as a finished future (staging without a stage thread: the CPU)."""
    fut: Future = Future()
    fut.set_result(fn(*args))
    return fut


def device_seconds(results: Sequence[SolveResult]) -> float | None:
    """The GPU time of a batch's solve (CUDA events), from a result the batch itself gave."""
    for r in results:
        info = r.info
        gpu = info.get("gpu_seconds")
        if gpu and not info.get("restarted") and not info.get("polished"):
            return float(gpu)
    return None


# --------------------------------------------------------------------------- staging
# Each accelerator's worker stages batch k+1 (packs it into one block-diagonal
# CSR on its device through the batched engine, and on a GPU builds its
# solver workspace) before it computes batch k: the worker submits
# :func:`stage` to the device's stage thread; on a GPU the copy runs on a
# second CUDA stream (:func:`managed_solve._backend.device_stream`), so it overlaps the compute; on
# simulated devices the same code runs with the pack on the host (there is
# no stream), so the pipeline is tested on CPUs. The CPU packs its batches
# on its worker (:func:`pack_batch`).


@dataclass
class Staged:
    """A batch whose bytes are reserved and whose copy to the device is under way."""

    batch: Batch
    reservation: Any  # the manager's Reservation, released through Runner.held
    packed: Future | None  # the batched engine's prepared batch on its device (BATCH route only)
    share: float = 1.0  # its own part of the device time measured for it (ShareClock)


def pack_batch(systems: list[LinearSystem], jacobi: bool, dev: Device,
               method: str | Callable[[], str]) -> Any:
    """A batch prepared on its device by the batched engine (``BatchedEngine.prepare_batch``).

    Host systems go over in bulk. On a GPU the solver's workspace is built
    here too (its bytes are in the batch's reservation), off the worker's
    path between two batches. ``method`` is the batch's method, or a
    function that finds it (a deferred method: waited for there, after the
    copy). Simulated devices (``"sim:k"``) get their batches on the host.
    """
    from ..solvers.batched import BatchedEngine

    return BatchedEngine().prepare_batch(systems, str(dev), jacobi=jacobi, method=method)


def stage(systems: list[LinearSystem], jacobi: bool, dev: Device,
          method: str | Callable[[], str]) -> Any:
    """:func:`pack_batch` on a device's stage thread; on a GPU on its copy stream, complete on return."""
    if not dev.is_cuda:
        return pack_batch(systems, jacobi, dev, method)
    time.sleep(0)  # the GIL to the worker the batch staged before woke, not after this pack's Python
    with _backend.device_stream(dev.index, "copy") as stream:
        out = pack_batch(systems, jacobi, dev, method)
        stream.synchronize()  # sync: the copy is complete before the compute stream reads it
        return out


class ShareClock:
    """Each batch's own share of its device while other batches computed beside it.

    Between two events on a device (a batch starting or ending there) each
    of the ``k`` batches running gets ``1/k`` of the time passed. A batch's
    share over its wall time is the part of the device time measured for it
    (its CUDA events span the other lanes' work too) that was its own: the
    device's learned speed counts each moment once.

    Examples
    --------
    >>> ticks = iter([0.0, 1.0, 3.0, 4.0])
    >>> clock = ShareClock(lambda: next(ticks))
    >>> clock.begin("cuda:0", "a"); clock.begin("cuda:0", "b")  # at 0 and at 1
    >>> round(clock.end("cuda:0", "a"), 3)  # alone for 1, shared for 2: its own 2 of 3
    0.667
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self.lock = threading.Lock()
        self.running: dict[str, dict[Any, list[float]]] = {}  # device -> key -> [start, own]
        self.last: dict[str, float] = {}

    def advance(self, device: str, t: float) -> dict[Any, list[float]]:
        running = self.running.setdefault(device, {})
        for rec in running.values():
            rec[1] += (t - self.last[device]) / len(running)
        self.last[device] = t
        return running

    def begin(self, device: str, key: Any) -> None:
        with self.lock:
            t = self.now()
            self.advance(device, t)[key] = [t, 0.0]

    def end(self, device: str, key: Any) -> float:
        """``key`` ended now; its own share of its wall time (1.0 when it ran alone)."""
        with self.lock:
            t = self.now()
            start, own = self.advance(device, t).pop(key)
        return own / (t - start) if t > start else 1.0


class Runner(Adjustments):
    """Executes a plan: workers per device (lanes on accelerators), recovery, results in input order.

    ``method_of`` resolves the method of a batch planned before it was known
    (``DEFERRED``: a head-start system); ``more`` says a further part of the
    plan will come through :meth:`extend`.
    """

    def __init__(self, systems: list[LinearSystem | None], plan: Plan, devices: Sequence[Device],
                 manager: DeviceManager, results: list[SolveResult | None], *, bar: Any = None,
                 batch_bytes: Callable | None = None, more: bool = False, tests: dict | None = None,
                 method_of: Callable[[LinearSystem], str] | None = None, kept: Any = None):
        self.systems = systems
        self.plan = plan
        self.manager = manager
        self.results = results
        self.bar = bar
        self.batch_bytes = batch_bytes if batch_bytes is not None else plan.batch_bytes
        self.devices = list(devices)
        self.all_devices = list(dict.fromkeys([*self.devices, *plan.pins.values(), manager.cpu]))
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
        self.tests = tests if tests is not None else {}  # the call's matrix tests (single_bytes)
        # What the routes prepared for systems whose inputs require grad
        # (scheduling.adjoint.Kept): their adjoints reuse it.
        self.kept = kept
        # LU factors shared by the call's systems with one matrix (host LU route),
        # made when a host LU batch first runs (:meth:`_factors`).
        self.factors: routes.FactorCache | None = None
        self.next_id = plan.next_id
        self.threads: list[threading.Thread] = []
        # Per accelerator: its stage thread while its workers run, and the batch
        # staged next (its copy under way beside the current batches' compute).
        self.stage_lock = threading.Lock()
        self.stagers: dict[str, ThreadPoolExecutor] = {}
        self.ahead: dict[str, Staged | None] = {}
        # Per accelerator, while its workers run: the thread that builds its
        # batches' results (see _finish_split), and how many workers are left.
        self.finishers: dict[str, ThreadPoolExecutor] = {}
        self.live: dict[str, int] = {}
        # Per device: the call's batches holding bytes there, and releases so
        # far (see _reserve and held).
        self.holding: dict[str, int] = {}
        self.releases: dict[str, int] = {}
        self.clock = ShareClock()
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
                stolen = self.steal(name)
                if stolen is not None:
                    return stolen
                if self.outstanding <= 0:
                    return None
                self.cond.wait()

    def steal(self, name: str) -> Batch | None:
        """A batch queued on another device of the same kind, for an idle one (lock held).

        The plan balances predicted times; measured times differ (a learned
        hint off, a device shared with other work), so a device whose queue
        runs dry takes the last (shortest) batch of the device with the most
        predicted work left, if it fits here and did not fail here. Batches
        whose systems already lie on their device, or are pinned there, stay;
        a device only pinned systems brought into the call (``all_devices``) takes none.
        """
        dev = self.by_name[name]
        if dev.kind == "cpu" or dev not in self.devices or not config.current().work_stealing:
            return None

        def left(q: str) -> float:  # predicted seconds of the batches still queued there
            return sum(b.cost for b in self.queues[q]) / self.manager.speed(self.by_name[q])

        victims = sorted((q for q in self.queues if q != name and self.queues[q]
                          and self.by_name[q].kind == dev.kind), key=lambda q: -left(q))
        for victim in victims:
            b = self.queues[victim][-1]
            if name in b.tried or b.route == DIRECT or b.pin is not None:
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
        """The batch's Krylov method, found now if it was deferred (then kept in its group).

        A deferred batch whose systems turn out to need different methods,
        or some of whose tests failed, raises :class:`.errors.Regroup`
        (:meth:`recover` then runs it as one batch per method).
        """
        group = b.group
        if group[0] != DEFERRED:
            return group[0]
        if self.method_of is None:
            raise RuntimeError("solve_many: internal error, a deferred method without a resolver")
        by_method: dict[str, list[int]] = {}
        bad: list[tuple[int, Exception]] = []
        for i in b.indices:
            try:
                method = self.method_of(self.systems[i])
            except (TypeError, ValueError) as exc:  # as the estimate loop would have: bad input
                bad.append((i, exc))
                continue
            by_method.setdefault(method, []).append(i)
        if bad or len(by_method) != 1:
            raise Regroup(by_method, bad)
        (method,) = by_method
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

    def deliver_many(self, indices: Sequence[int], out: Sequence[SolveResult]) -> None:
        """:meth:`deliver` for a whole batch, under one lock."""
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

    def deliver(self, i: int, res: SolveResult) -> None:
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
        """Start the workers: one per lane on accelerators, else one (host LU batches: one per host thread).

        The LU workers keep to the host kernels' thread budget
        (:func:`~managed_solve._threads.host_cores`: the setting
        ``host_threads``, the process's CPU affinity, ``NUMBA_NUM_THREADS``), so
        a caller who holds the host to one thread gets one. An accelerator's
        lanes (setting ``lanes_per_device``) share its stage and finish threads.
        """
        direct = any(b.route == DIRECT for q in self.queues.values() for b in q)
        lanes = config.current().lanes_per_device
        for d in self.all_devices:
            if d.kind == "cpu":
                count = host_cores() if direct else 1
            else:
                count = lanes
                name = str(d)
                with self.stage_lock:
                    self.stagers[name] = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{d}")
                    self.finishers[name] = ThreadPoolExecutor(1, thread_name_prefix=f"finish-{d}")
                    self.live[name] = count
            for k in range(count):
                t = threading.Thread(target=self._worker, args=(d, k), daemon=True,
                                     name=f"solve_many-{d}-{k}")
                self.threads.append(t)
                t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join()
        if self.factors is not None:
            self.factors.close(keep=self.kept.engines() if self.kept is not None else ())

    def _factors(self) -> routes.FactorCache:
        """The call's LU factors by matrix (made on first use, shared by the workers)."""
        with self.cond:
            if self.factors is None:
                self.factors = routes.FactorCache()
            return self.factors

    def _pop_nowait(self, name: str) -> Batch | None:
        with self.cond:
            return self.queues[name].popleft() if self.queues[name] else self.steal(name)

    def stage_next(self, name: str) -> None:
        """Stage the device's next batch unless one is staged already (or none is queued).

        One that finds no room there beside the call's other batches goes
        back to the front of the queue: a worker takes it when it is free
        and waits for the room then (:meth:`_reserve`).
        """
        with self.stage_lock:
            stager = self.stagers.get(name)
            if stager is None or self.ahead.get(name) is not None:
                return
            nb = self._pop_nowait(name)
            if nb is None:
                return
            st = self._start(nb, self.by_name[name], stager, wait=False)
            if st is _LATER:
                with self.cond:
                    self.queues[name].appendleft(nb)
                return
            self.ahead[name] = st
        with self.cond:  # its worker may be waiting for work: this is work
            self.cond.notify_all()

    def _take_ahead(self, name: str) -> Staged | None:
        with self.stage_lock:
            st = self.ahead.get(name)
            self.ahead[name] = None
            return st

    def _worker(self, dev: Device, k: int = 0) -> None:
        """Run a device's queue (lane ``k`` of it); on accelerators, stage the next batch while this one computes."""
        name = str(dev)
        stager = self.stagers.get(name) if dev.kind != "cpu" else None
        try:
            lane = _backend.device_stream(dev.index, f"lane {k}") if dev.is_cuda else nullcontext()
            with lane:  # on a GPU, each lane's batches compute on its own stream
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
                        self.stage_next(name)
                    self.finish(cur, dev)
        finally:
            if stager is not None:
                with self.stage_lock:
                    self.live[name] -= 1
                    last = self.live[name] == 0
                    if last:
                        del self.stagers[name]
                if last:  # the device's last lane: its stage and finish threads end with it
                    stager.shutdown(wait=True)
                    self.finishers.pop(name).shutdown(wait=True)

    def _reserve(self, b: Batch, dev: Device, nbytes: int, *, wait: bool) -> Any:
        """The batch's bytes on ``dev``, waiting for room there while the call's other batches hold some.

        Without ``wait``, None instead of waiting. A device with no batch of
        the call holding bytes raises ``MemoryError`` as the manager does
        (the batch is then split).
        """
        name = str(dev)
        while True:
            with self.cond:
                seen = self.releases.get(name, 0)
            try:
                res = self.manager.reserve(nbytes, device=dev, cost=b.cost,
                                           signature=("solve_many", b.route, b.group))
            except MemoryError:
                with self.cond:
                    if not self.holding.get(name):
                        raise
                    if not wait:
                        return None
                    while self.releases.get(name, 0) == seen and self.holding.get(name):
                        self.cond.wait()
                continue
            with self.cond:
                self.holding[name] = self.holding.get(name, 0) + 1
            return res

    def release(self, res: Any) -> None:
        """Release a batch's reservation (once), waking the workers waiting for room there."""
        with self.cond:
            if res.released:
                return
            res.release()
            name = str(res.device)
            self.holding[name] -= 1
            self.releases[name] = self.releases.get(name, 0) + 1
            self.cond.notify_all()

    @contextmanager
    def held(self, res: Any) -> Iterator[None]:
        """The block runs holding the batch's reservation ``res``, released at its end."""
        try:
            yield
        finally:
            self.release(res)

    def _start(self, b: Batch, dev: Device, stager: ThreadPoolExecutor | None,
               wait: bool = True) -> Staged | None | object:
        """Reserve the batch's bytes, ask the fault hook, start its host->device copy.

        None when it failed (its systems were sent elsewhere); ``_LATER``
        when there is no room now and ``wait`` is False (:meth:`_reserve`).
        """
        res = None
        try:
            nbytes = b.nbytes if b.route != SINGLE else routes.single_held_bytes(
                [self.systems[i] for i in b.indices], dev, self.manager, b.nbytes, self.tests)
            res = self._reserve(b, dev, nbytes, wait=wait)
            if res is None:
                return _LATER
            dev.check_fault(nbytes)
            fut = None
            if b.route == BATCH:
                method, _dt, jacobi = b.group
                systems = routes.packing_systems(self.systems, b.indices, bool(jacobi))
                if method == DEFERRED:
                    method = functools.partial(self._batch_method, b)
                args = (systems, jacobi, dev, method)
                fut = stager.submit(stage, *args) if stager is not None \
                    else done_future(pack_batch, *args)
            return Staged(b, res, fut)
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            if res is not None:
                self.release(res)
            self._done(self.recover(b, dev, exc))
            return None

    def finish(self, st: Staged, dev: Device) -> None:
        """Compute a staged batch, deliver its results, release its bytes, learn its time."""
        b = st.batch
        batch_info = {"batch": b.id, "batch_size": b.nsys, "reserved_bytes": b.nbytes}
        if b.route == BATCH and b.group[0] == DEFERRED:
            try:
                method = self._batch_method(b)
            except BaseException as exc:  # noqa: BLE001 - every failure must end in results
                self._failed(st, dev, exc)
                return
            if method not in BATCHED_METHODS:  # MINRES: the batched core has none
                b.route = SINGLE
        finisher = self.finishers.get(str(dev)) if b.route == BATCH else None
        if finisher is not None:
            self._finish_split(st, dev, finisher, batch_info)
            return
        kept = self.kept
        try:
            t0 = time.perf_counter()
            with self.held(st.reservation), self.manager.lend(st.reservation), dev.context():
                if b.route == BATCH:
                    prepared = st.packed.result()
                    method = self._batch_method(b)
                    systems = [self.systems[i] for i in b.indices]
                    out = routes.run_batch(systems, prepared, method, dev, self.manager,
                                           batch_info)
                elif b.route == DIRECT:
                    symmetric = bool(b.group[2])
                    out = routes.host_lus([self.systems[i] for i in b.indices], symmetric,
                                          self.manager, self._factors(),
                                          [self._keeper(i, kept and kept.add_factors)
                                           for i in b.indices])
                else:
                    out = [routes.run_single(self.systems[i], dev, self.manager, i, tests=self.tests,
                                             keep=self._keeper(i, kept and kept.add_solver))
                           for i in b.indices]
            seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            self._failed(st, dev, exc)
            return
        if b.route == BATCH and kept is not None:
            kept.add_batch(b.indices, prepared.batch, method, dev, out)
        self._deliver_batch(b, dev, out, seconds, batch_info)

    def _keeper(self, i: int, add: Any) -> Callable[[Any], None] | None:
        """``add(i, state)`` as a one-argument callback for system i, if it wants a gradient."""
        if not add or i not in self.kept.wanted:
            return None
        return lambda state: add(i, state)

    def _finish_split(self, st: Staged, dev: Device, finisher: ThreadPoolExecutor,
                      batch_info: dict) -> None:
        """:meth:`finish` of a batch on an accelerator: the device part here, its results beside.

        The worker computes the batch and its true residuals, then goes on to
        its next batch while the device's finisher thread builds this one's
        results (Python per system, time in which the GPU would otherwise
        have no work queued), delivers them and releases the batch's bytes.
        """
        b = st.batch
        name = str(dev)
        try:
            t0 = time.perf_counter()
            with dev.context():
                prepared = st.packed.result()
                method = self._batch_method(b)
                self.clock.begin(name, b.id)
                try:
                    solved = routes.compute_batch(prepared, method, dev)
                finally:
                    st.share = self.clock.end(name, b.id)
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            self._failed(st, dev, exc)
            return
        finisher.submit(self.complete, st, dev, prepared, method, solved, batch_info, t0)

    def complete(self, st: Staged, dev: Device, prepared: Any, method: str, solved: tuple,
                 batch_info: dict, t0: float) -> None:
        """The results of a batch computed by :meth:`_finish_split` (on the finisher thread)."""
        b = st.batch
        try:
            systems = [self.systems[i] for i in b.indices]
            # On the host, restarts and polishes hold the host-kernel lock (not the
            # building of results, so the worker's next batch computes meanwhile).
            with self.held(st.reservation), self.manager.lend(st.reservation), dev.context():
                out = routes.batch_results(systems, prepared, method, dev, self.manager, solved,
                                           batch_info)
            seconds = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - every failure must end in results
            self._failed(st, dev, exc)
            return
        if self.kept is not None:
            self.kept.add_batch(b.indices, prepared.batch, method, dev, out)
        self._deliver_batch(b, dev, out, seconds, batch_info, st.share)

    def _failed(self, st: Staged, dev: Device, exc: BaseException) -> None:
        """A staged batch that failed: its bytes released, its systems split and retried."""
        self.release(st.reservation)
        self._done(self.recover(st.batch, dev, exc))

    def _deliver_batch(self, b: Batch, dev: Device, out: list[SolveResult], seconds: float,
                       batch_info: dict, share: float = 1.0) -> None:
        """Learn a finished batch's time, hand out its results, let the queue go on.

        ``share``: the batch's own part of its measured device time, the rest
        being other lanes' batches computing beside it (:class:`ShareClock`).
        """
        gpu = device_seconds(out)
        self.manager.record(("solve_many", b.route, b.group), seconds, b.nbytes, device=dev,
                            cost=b.cost, device_seconds=gpu * share if gpu is not None else None)
        with self.cond:
            self.batches_run.append((str(dev), b.id, b.nsys))
        dname, error = str(dev), Status.DEVICE_ERROR  # an enum member's look-up is not free
        for res in out:
            if res.status is not error:
                res.device = dname
            if not res.seconds:
                res.seconds = seconds
            if "batch" not in res.info:  # results not made by the batched core
                for key, value in batch_info.items():
                    res.info.setdefault(key, value)
        # A system that ran out of memory inside a route (a solve() alone, a
        # restart) is retried elsewhere like a failed batch, finally on the CPU.
        retry = [k for k, r in enumerate(out) if r.status is error]
        if not retry:
            self.deliver_many(b.indices, out)
            self._done()
            return
        keep = [k for k in range(len(out)) if k not in set(retry)]
        self.deliver_many([b.indices[k] for k in keep], [out[k] for k in keep])
        ests = [self.plan.estimates[b.indices[k]] for k in retry]
        with self.cond:
            sub = Batch(self.next_id, [e.index for e in ests], b.route, b.group,
                        sum(e.n for e in ests), sum(e.nnz for e in ests),
                        sum(e.nbytes for e in ests), float(sum(e.cost for e in ests)),
                        tried=b.tried, pin=b.pin)
            self.next_id += 1
        self._done(self.recover(sub, dev, MemoryError(out[retry[0]].message)))
