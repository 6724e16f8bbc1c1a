"""Step 3 of ``solve_many``: pack batches and disperse them over the devices (nothing runs).

:func:`plan_call` is the step: it takes the estimate step's :class:`Work`
and hands the run step a :class:`Plan`. Pure functions over plain numbers
and a device inventory (:class:`Slot`): no arrays are touched, no device is
asked anything, so the plan is tested with simulated devices on any machine.
A batch's bytes come from the batched engine's own model
(:func:`packed_bytes`). The cost of each system comes from
:mod:`managed_solve.system.cost` (bytes streamed), which the DeviceManager
turns into seconds with each device's learned speed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _backend, config
from ..devices import Device, is_cuda_kind, warn_spill
from ..manager import DeviceManager
from ..sharded import choose_shard_count
from ..sizes import reserve_size
from ..system.cost import predict_iterations
from ..system.linear_system import LinearSystem

log = logging.getLogger("managed_solve")

# Routes a system can take through solve_many.
BATCH = "batch"  # batched Krylov core (CG, BiCGStab, GMRES), many systems in one block-diagonal CSR
SINGLE = "single"  # solve() on one device, one system (minres, direct, dense, operators, other M)
DIRECT = "direct"  # sparse LU on the host, many systems over a thread pool (CPU only)

# The group method of a batch whose "auto" method is still being found (a
# head-start system: see the setting ``head_start_systems``); the runner
# resolves it when the batch is staged, after its copy to the device started.
DEFERRED = "auto"

# Rows per batch that keep a device busy. On a GPU a 2D 5-point product of 1M
# rows is long enough that kernel launch latency stops dominating. Simulated
# devices run NumPy/Numba on a few cores, where smaller batches balance
# better. The CPU shares each batch's systems out over its cores, one system
# per thread at a time: a batch should hold many systems (a 10,000-row mesh
# system must not run alone, on one core), and fewer batches leave fewer
# tails where one thread finishes before the other.
TARGET_ROWS = {"cuda": 1 << 20, "sim": 1 << 15, "cpu": 1 << 18}
# A system of at least this many rows, or a quarter of the target batch rows,
# is a batch of its own: a batch cannot be split between devices, so one
# large system must be free to go to any of them (lumped with many small
# ones, it left one GPU running that batch while the other ran the rest).
ALONE_ROWS = 1_000_000
# Systems share a batch only within a factor of this in predicted iterations:
# the batch runs until its slowest system converges, and one long system
# among many short ones makes a batch both long and hard to balance. 2D
# Poisson systems of 32^2..96^2 unknowns (60-180 iterations) stay together.
ITERATION_SPREAD = 4.0


@dataclass(slots=True)
class Estimate:
    """What the planner knows about one input system."""

    index: int  # position in solve_many's input
    n: int
    nnz: int
    nbytes: int  # device bytes to solve it alone
    cost: float  # bytes streamed by the whole solve (time = cost / device speed)
    route: str = BATCH
    group: tuple = ()  # systems share a batch only within one group (method, dtype, jacobi)
    home: str | None = None  # device the arrays already lie on
    iterations: float = 0.0  # predicted Krylov iterations (0: not predicted; pack() uses n)


@dataclass
class Work:
    """What the estimate step hands to the plan step: the call's systems, devices and estimates."""

    systems: list  # each input's LinearSystem, by position (None: invalid)
    results: list  # INVALID_INPUT results by position (None elsewhere), filled in as the call runs
    devices: list[Device]
    estimates: list[Estimate]  # every valid system's; with a head start, the large ones'
    method_of: Callable[[Any], str]  # a deferred system's method, found when its batch needs it
    # Head start: the other systems' estimates, made when called (while the
    # large ones compute), and a bound on the rows the batches will hold.
    rest: Callable[[], list[Estimate]] | None = None
    packed_rows: int = 0
    cache: dict | None = None  # the call's matrix tests (symmetry), by matrix object


@dataclass(slots=True)
class Batch:
    """Systems that run together on one device (one block-diagonal CSR for ``BATCH``)."""

    id: int
    indices: list[int]
    route: str
    group: tuple
    n: int
    nnz: int
    nbytes: int
    cost: float
    tried: frozenset = field(default_factory=frozenset)  # devices it failed on
    pin: str | None = None  # the device its systems are pinned to (DeviceManager.pin): it runs there

    @property
    def nsys(self) -> int:
        return len(self.indices)


@dataclass(slots=True)
class Slot:
    """A device as the planner sees it."""

    name: str
    room: int  # bytes one batch may take there (capacity less the ledger, live free memory)
    speed: float  # cost units (bytes streamed) per second, learned by the DeviceManager
    busy: float = 0.0  # predicted seconds of work already queued there
    kind: str = "sim"


def sum_bytes(members: Sequence[Estimate]) -> int:
    return int(sum(e.nbytes for e in members))


def target_rows(total_rows: int, ndevices: int, kind: str = "cuda", *,
                batches_per_device: int | None = None) -> int:
    """Rows per batch: enough to fill a device, small enough for several per device.

    ``batches_per_device`` defaults to the setting of that name
    (:class:`managed_solve.config.Settings`); the setting ``batch_rows``, when
    given, replaces the whole rule.

    Examples
    --------
    >>> target_rows(1_870_000, 1, "cuda")  # W2 on one GPU: two batches of ~0.94M rows
    1048576
    >>> target_rows(200_000, 2, "cpu")
    25000
    """
    settings = config.current()
    if settings.batch_rows is not None:
        return max(1, int(settings.batch_rows))
    if batches_per_device is None:
        batches_per_device = settings.batches_per_device
    floor = TARGET_ROWS.get(kind, TARGET_ROWS["cuda"])
    share = total_rows // max(1, ndevices * batches_per_device)
    if is_cuda_kind(kind):
        # A GPU batch below ~1M rows is launch-bound; fewer, fuller batches win there.
        return max(floor, share)
    return max(1024, min(floor, share))


def pack(estimates: Iterable[Estimate], *, rows: int, max_bytes: int,
         batch_bytes: Callable[[Sequence[Estimate]], int] | None = None,
         first_id: int = 0, alone_rows: int | None = None) -> tuple[list[Batch], list[Estimate]]:
    """Pack systems into batches of about ``rows`` rows and at most ``max_bytes``.

    Systems of route ``BATCH`` are packed per group. A system of at least
    ``alone_rows`` rows (default: ``ALONE_ROWS`` or a quarter of ``rows``,
    whichever is smaller) runs alone, so dispersal can send large systems to
    different devices. The others are sorted by predicted iterations
    (``Estimate.iterations``, else from ``n``) and cut into bands within a
    factor ``ITERATION_SPREAD`` of each other, so a batch holds systems that
    finish together (the masked-out work of converged systems stays small);
    each band is spread evenly over the batches it needs. ``SINGLE`` systems
    become batches of one; ``DIRECT`` systems are grouped like ``BATCH``
    ones (each then solves on its own host thread).

    Returns the batches and the systems that fit in no batch of
    ``max_bytes`` (too large for any single device: the caller decides).

    Examples
    --------
    >>> es = [Estimate(i, 100, 460, 10_000, 1e6) for i in range(10)]
    >>> batches, too_big = pack(es, rows=450, max_bytes=1 << 30)
    >>> [b.nsys for b in batches], too_big  # 1,000 rows: three even batches, no remainder
    ([3, 4, 3], [])
    >>> es.append(Estimate(10, 400, 1840, 40_000, 1e7))  # a quarter of 450 rows or more: alone
    >>> [b.nsys for b in pack(es, rows=450, max_bytes=1 << 30)[0]]
    [1, 3, 4, 3]
    """
    batch_bytes = batch_bytes or sum_bytes
    rows = max(1, int(rows))
    alone = int(alone_rows) if alone_rows is not None else min(ALONE_ROWS, max(1, rows // 4))
    out: list[Batch] = []
    too_big: list[Estimate] = []
    groups: dict[tuple, list[Estimate]] = {}
    next_id = first_id

    def emit(members: list[Estimate], route: str, group: tuple, sums: tuple | None = None) -> None:
        nonlocal next_id
        if sums is None:
            sums = ([e.index for e in members], sum(e.n for e in members),
                    sum(e.nnz for e in members), sum(e.cost for e in members))
        indices, n, nnz, cost = sums
        out.append(Batch(next_id, indices, route, group, n, nnz, int(batch_bytes(members)),
                         float(cost)))
        next_id += 1

    for e in estimates:
        if e.nbytes > max_bytes:
            too_big.append(e)
        elif e.route == SINGLE:
            emit([e], SINGLE, e.group)
        else:
            groups.setdefault((e.route, e.group), []).append(e)

    for (route, group), members in groups.items():
        # Columns of the group (the loops below are NumPy's: 10,000 systems
        # planned in a few milliseconds instead of 20-30).
        its = np.array([e.iterations or predict_iterations(e.n) for e in members], np.float64)
        n = np.array([e.n for e in members], np.int64)
        index = np.array([e.index for e in members], np.int64)
        # Most iterations first (then largest, then input order: a deterministic plan).
        order = np.lexsort((index, -n, -its))
        members = [members[j] for j in order.tolist()]
        its, n = its[order], n[order]
        big = n >= alone
        for j in np.flatnonzero(big).tolist():
            emit([members[j]], route, group)
        rest = np.flatnonzero(~big)
        # Bands: a system joins the current band while its iterations times
        # ITERATION_SPREAD reach the band's first (largest) count.
        reach = -(its[rest] * ITERATION_SPREAD)  # non-decreasing
        start = 0
        while start < len(rest):
            stop = int(np.searchsorted(reach, -its[rest[start]], side="right"))
            band = rest[start:stop]
            pack_band([members[j] for j in band.tolist()], rows, max_bytes, batch_bytes,
                       lambda m, sums=None, r=route, g=group: emit(m, r, g, sums), n[band])
            start = stop
    return out, too_big


def pack_band(members: list[Estimate], rows: int, max_bytes: int,
               batch_bytes: Callable[[Sequence[Estimate]], int],
               emit: Callable[..., None], n: np.ndarray | None = None) -> None:
    """Systems of similar iteration counts, in order, spread evenly over the batches they need.

    ``n`` (the members' row counts as an array) takes the common case, no
    batch near ``max_bytes``, through NumPy in one pass.
    """
    total = sum(e.n for e in members) if n is None else int(n.sum())
    # Spread the rows evenly over the number of batches needed, so no
    # small remainder batch is left at the end.
    nb = max(1, math.ceil(total / rows))
    per = total / nb
    if n is not None and len(members):
        # Each system goes to the batch its midpoint row falls in (as below).
        before = np.cumsum(n) - n
        k = np.minimum(nb - 1, ((before + n / 2) // per).astype(np.int64))
        cuts = [0, *(np.flatnonzero(np.diff(k)) + 1).tolist(), len(members)]
        nbytes = [e.nbytes for e in members]
        if all(sum(nbytes[a:b]) <= max_bytes // 2 for a, b in zip(cuts[:-1], cuts[1:], strict=True)):
            index = [e.index for e in members]
            nnz = [e.nnz for e in members]
            cost = [e.cost for e in members]
            rows_of = n.tolist()
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                emit(members[a:b], (index[a:b], sum(rows_of[a:b]), sum(nnz[a:b]), sum(cost[a:b])))
            return
    # Each system goes to the batch its midpoint row falls in, so batches
    # get about `per` rows each and no small remainder is left at the end.
    cur: list[Estimate] = []
    cur_k, cum, cur_sum = 0, 0, 0
    for e in members:
        k = min(nb - 1, int((cum + e.n / 2) // per))
        # The exact (callback) size is asked only near the limit: asking at
        # every step would cost O(batch size squared).
        full = (cur_sum + e.nbytes > max_bytes // 2
                and batch_bytes([*cur, e]) > max_bytes)
        if cur and (k > cur_k or full):
            emit(cur)
            cur, cur_sum = [], 0
        cur_k = max(cur_k, k)
        cur.append(e)
        cur_sum += e.nbytes
        cum += e.n
    if cur:
        emit(cur)


def split(batch: Batch, estimates: dict[int, Estimate], *, next_id: int,
          batch_bytes: Callable[[Sequence[Estimate]], int] | None = None) -> list[Batch]:
    """Two halves of a batch (by rows), remembering the devices it failed on and its pin.

    A batch of one system is returned unchanged in a list of one.
    """
    if batch.nsys < 2:
        return [batch]
    batch_bytes = batch_bytes or sum_bytes
    members = [estimates[i] for i in batch.indices]
    total = sum(e.n for e in members)
    acc, cut = 0, 1
    for k, e in enumerate(members[:-1], start=1):
        acc += e.n
        cut = k
        if acc >= total / 2:
            break
    halves = []
    for j, part in enumerate((members[:cut], members[cut:])):
        halves.append(Batch(next_id + j, [e.index for e in part], batch.route, batch.group,
                            sum(e.n for e in part), sum(e.nnz for e in part),
                            int(batch_bytes(part)), float(sum(e.cost for e in part)),
                            tried=batch.tried, pin=batch.pin))
    return halves


def choose_slot(batch: Batch, slots: Sequence[Slot]) -> Slot | None:
    """The slot whose predicted finish is earliest among those the batch fits and did not fail on.

    A batch whose arrays already lie on a device (``home``) is not moved
    here: that preference is applied by the caller through ``Slot.busy``.
    """
    best, best_key = None, None
    for pos, s in enumerate(slots):
        if s.name in batch.tried or batch.nbytes > s.room:
            continue
        key = (s.busy + batch.cost / s.speed, -s.room, pos)
        if best_key is None or key < best_key:
            best, best_key = s, key
    return best


def disperse(batches: Sequence[Batch], slots: Sequence[Slot]) -> tuple[dict[str, list[Batch]], list[Batch]]:
    """Assign batches longest-predicted-first to the slot that finishes them earliest.

    ``slots`` are updated in place (their ``busy`` grows by each batch's
    predicted seconds). Returns the queue of each slot, in the order it
    should run them (longest first, so the short ones fill the tail), and the
    batches that fit no slot.

    Examples
    --------
    >>> slots = [Slot("sim:0", 1 << 30, 1e9), Slot("sim:1", 1 << 30, 1e9)]
    >>> bs = [Batch(i, [i], BATCH, (), 100, 460, 1000, c) for i, c in enumerate([4e9, 3e9, 2e9, 2e9])]
    >>> queues, left = disperse(bs, slots)
    >>> {k: [b.id for b in v] for k, v in queues.items()}, [s.busy for s in slots]
    ({'sim:0': [0, 3], 'sim:1': [1, 2]}, [6.0, 5.0])
    """
    ref = max((s.speed for s in slots), default=1.0)
    order = sorted(batches, key=lambda b: (-b.cost / ref, b.id))
    queues: dict[str, list[Batch]] = {s.name: [] for s in slots}
    unplaced: list[Batch] = []
    for b in order:
        s = choose_slot(b, slots)
        if s is None:
            unplaced.append(b)
            continue
        s.busy += b.cost / s.speed
        queues[s.name].append(b)
    return queues, unplaced


def imbalance(slots: Sequence[Slot]) -> float:
    """``max(busy) / mean(busy) - 1``: 0 for perfectly even finish times."""
    busy = [s.busy for s in slots]
    mean = sum(busy) / max(1, len(busy))
    return max(busy) / mean - 1.0 if mean > 0 else 0.0


# --------------------------------------------------------------------------- the plan
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
    batch_bytes: Callable[[Sequence[Estimate]], int] | None = None  # bytes to reserve for a batch
    # The rest of the call's plan, planned when called (a head start: while
    # this part computes); None when this part is the whole plan.
    more: Callable[[], Plan] | None = None
    # The call's pinned systems (input position -> device; :func:`place_pinned`),
    # both parts' of a head start: the runner starts workers on their devices.
    pins: dict[int, Device] = field(default_factory=dict)

    def finish_times(self) -> dict[str, float]:
        return {s.name: s.busy for s in self.slots}


def make_slots(devices: Sequence[Device], manager: DeviceManager,
               busy: dict[str, float] | None = None) -> list[Slot]:
    """The planner's view of devices: room for one batch, learned speed, work already reserved.

    ``busy`` (predicted seconds queued per device name) replaces the
    manager's prediction where given: a runner re-placing a failed batch
    knows its own queues.
    """
    view = manager.plan_view(devices)
    return [Slot(str(d), room, speed, busy.get(str(d), 0.0) if busy is not None else finish, d.kind)
            for d, (room, speed, finish) in zip(devices, view, strict=True)]


def plan_work(estimates: Iterable[Estimate], devices: Sequence[Device], manager: DeviceManager, *,
              batch_bytes: Callable[[Sequence[Estimate]], int] | None = None,
              slots: list[Slot] | None = None, packed_rows: int | None = None,
              first_id: int = 0, pins: dict[int, Device] | None = None) -> Plan:
    """Pack estimates into batches and disperse them over ``devices`` (nothing runs).

    A Krylov system too large for every device's room is sharded over the
    accelerators when two or more of them can hold it together
    (``Plan.sharded``; solved by the sharded solver once the batches are
    done); otherwise it goes to the CPU: a spill, reported as the manager
    reports its own (:func:`report_spill`).

    ``pins`` (input position -> device) holds the systems pinned with the
    manager: they are batched apart, on their own device (:func:`place_pinned`),
    and the others dispersed around them.

    A call planned in parts (see :func:`.estimate.head_start`) passes the rows that all
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
    >>> p = plan_work(es, dm.accelerators, dm, pins={3: dm.accelerators[1]})  # systems[3] pinned
    >>> [(name, b.indices, b.pin) for name, q in p.queues.items() for b in q if 3 in b.indices]
    [('sim:1', [3], 'sim:1')]
    """
    ests = {e.index: e for e in estimates}
    slots = slots if slots is not None else make_slots(devices, manager)
    pins = pins or {}
    free = [e for e in ests.values() if e.index not in pins] if pins else list(ests.values())
    kind = devices[0].kind if devices else "cpu"
    if packed_rows is None:
        packed_rows = sum([e.n for e in free if e.route != SINGLE])
    rows = batch_rows(free, packed_rows, len(devices), kind)
    max_bytes = max((s.room for s in slots), default=0)
    batches, too_big = pack(free, rows=rows, max_bytes=max_bytes, batch_bytes=batch_bytes,
                            first_id=first_id)
    next_id = max((b.id for b in batches), default=first_id - 1) + 1
    pinned, next_id = place_pinned([e for e in ests.values() if e.index in pins], pins, slots,
                                   manager, batch_bytes, next_id) if pins else ({}, next_id)
    queues, unplaced = disperse(batches, slots)
    for name, q in pinned.items():  # beside the dispersed ones, longest first
        queues[name] = sorted([*queues.get(name, []), *q], key=lambda b: (-b.cost, b.id))
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
        extra.append(place_oversized(e, next_id, batch_bytes))
        next_id += 1
    for b in unplaced:
        log.info("managed_solve: a batch of %d systems (%d unknowns) fits on none of the call's "
                 "devices; solving on the CPU", b.nsys, b.n)
    extra += unplaced
    if extra:
        report_spill(manager, devices, max(b.nbytes for b in extra))
        queues.setdefault(cpu, [])
        for b in extra:
            queues[cpu].append(b)
            for s in slots:
                if s.name == cpu:
                    s.busy += b.cost / s.speed
    return Plan(queues, slots, ests, next_id, rows, [e.index for e in too_big], sharded,
                batch_bytes, pins=pins)


def batch_rows(estimates: Sequence[Estimate], packed_rows: int, ndevices: int, kind: str) -> int:
    """Rows per batch of ``estimates`` over ``ndevices`` devices of ``kind`` (:func:`target_rows`)."""
    if DIRECT in [e.route for e in estimates]:
        # Host LU batches run one per core: several per core balance the tail.
        return target_rows(packed_rows, _backend.cpu_count(), "cpu")
    return target_rows(packed_rows, ndevices, kind)


def place_pinned(estimates: Sequence[Estimate], pins: dict[int, Device], slots: Sequence[Slot],
                 manager: DeviceManager, batch_bytes: Callable | None,
                 first_id: int) -> tuple[dict[str, list[Batch]], int]:
    """The batches of the pinned systems, each device's apart, with the next free batch id.

    A pinned object always goes to its device (the manager's rule, which
    ``solve`` obeys): its systems are packed together there, in batches that
    fit its room now, and marked (``Batch.pin``) so that neither work stealing
    nor recovery moves them. One larger than the device can give runs alone
    there: its reservation fails and its result names the device and the fix
    (:meth:`.adjust.Adjustments.keep_pinned`). A slot of the device, when
    the call disperses over it, counts their predicted time.
    """
    by_device: dict[Device, list[Estimate]] = {}
    for e in estimates:
        by_device.setdefault(pins[e.index], []).append(e)
    by_name = {s.name: s for s in slots}
    queues: dict[str, list[Batch]] = {}
    next_id = first_id
    for dev, members in by_device.items():
        name = str(dev)
        slot = by_name.get(name)
        room = slot.room if slot is not None else manager.available_bytes(dev)
        rows = batch_rows(members, sum(e.n for e in members if e.route != SINGLE), 1, dev.kind)
        batches, too_big = pack(members, rows=rows, max_bytes=room, batch_bytes=batch_bytes,
                                first_id=next_id)
        next_id += len(batches)
        for e in too_big:
            nbytes = int(batch_bytes([e])) if batch_bytes is not None else e.nbytes
            batches.append(Batch(next_id, [e.index], e.route, e.group, e.n, e.nnz, nbytes, e.cost))
            next_id += 1
        for b in batches:
            b.pin = name
            if slot is not None:
                slot.busy += b.cost / slot.speed
        queues[name] = batches
    return queues, next_id


def report_spill(manager: DeviceManager, devices: Sequence[Device], nbytes: int) -> None:
    """Work of ``nbytes`` that fits on none of the call's accelerators goes to the CPU: said once.

    The manager's own spills (``reserve``, ``find_device``) warn through the
    same once-per-process :class:`~managed_solve.devices.DeviceWarning`, so
    a process hears of the first spill whichever call made it. A call on
    the CPU alone spills nothing.
    """
    gpus = [d for d in devices if d.is_gpu]
    if gpus:
        warn_spill(nbytes, {str(d): manager.available_bytes(d) for d in gpus},
                   fix="or pin a system to a GPU (manager.pin) to get DEVICE_ERROR instead")


def place_oversized(e: Estimate, batch_id: int, batch_bytes: Callable | None) -> Batch:
    """A system larger than any one device's room that cannot be sharded: alone on the CPU."""
    log.info("managed_solve: systems[%d] (%d unknowns) fits on no device, nor sharded over the "
             "accelerators; solving on the CPU", e.index, e.n)
    nbytes = int(batch_bytes([e])) if batch_bytes is not None else e.nbytes
    return Batch(batch_id, [e.index], e.route, e.group, e.n, e.nnz, nbytes, e.cost)


def plan_call(work: Work, manager: DeviceManager, pins: dict[int, Device] | None = None) -> Plan:
    """The plan of a call: its batches packed and dispersed over ``work.devices`` (nothing runs).

    With a head start (``work.rest``), the plan of the large systems, whose
    ``more`` plans the others (estimated then) against the same slots.
    ``pins``: the pinned systems' devices, by input position (:func:`place_pinned`).
    """
    batch_bytes = packed_bytes(work.systems)
    if work.rest is None:
        return plan_work(work.estimates, work.devices, manager, batch_bytes=batch_bytes, pins=pins)
    first = plan_work(work.estimates, work.devices, manager, batch_bytes=batch_bytes,
                      packed_rows=work.packed_rows, pins=pins)
    rest = work.rest

    def more() -> Plan:
        ests = rest()
        packed = sum(e.n for e in work.estimates + ests if e.route != SINGLE)
        return plan_work(ests, work.devices, manager, batch_bytes=batch_bytes, slots=first.slots,
                         packed_rows=packed, first_id=first.next_id, pins=pins)

    first.more = more
    return first


def packed_bytes(systems: Sequence[LinearSystem | None]) -> Callable[[Sequence[Estimate]], int]:
    """Bytes to reserve for a batch: the batched engine's own prediction, through the heuristic.

    The heuristic is the ledger's (:func:`managed_solve.sizes.reserve_size`).

    Returns the function the planner calls with a batch's estimates
    (``plan_work(..., batch_bytes=...)``); routes other than ``BATCH`` sum
    their systems' estimates.
    """
    try:
        from ..solvers.batched import predict_bytes
    except ImportError:  # the core is not installed: the planner's own model
        predict_bytes = None
    with_x0 = {i for i, s in enumerate(systems) if s is not None and s.x0 is not None}

    def nbytes(members: Sequence[Estimate]) -> int:
        e0 = members[0]
        if e0.route != BATCH:
            return reserve_size(int(sum(e.nbytes for e in members)))
        method, dt, jacobi = e0.group
        method = "bicgstab" if method == DEFERRED else method  # the larger workspace of the two
        n = sum([e.n for e in members])
        nnz = sum([e.nnz for e in members])
        idx = np.int32 if max(n, nnz) < 2**31 - 1 else np.int64
        if predict_bytes is not None:
            x0 = bool(with_x0) and any(e.index in with_x0 for e in members)
            raw = predict_bytes(n, nnz, len(members), np.dtype(dt), np.dtype(idx), method,
                                jacobi=bool(jacobi), x0=x0, max_rows=max([e.n for e in members]),
                                residual_check=True)
        else:
            raw = sum(e.nbytes for e in members)
        return reserve_size(int(raw))

    return nbytes
