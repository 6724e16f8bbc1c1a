"""Planning for ``solve_many``: predict each system, pack batches, disperse them over devices.

Pure functions over plain numbers and a device inventory (:class:`Slot`): no
arrays are touched, no device is asked anything, so the plan is tested with
simulated devices on any machine, and ``solve_many`` only executes it.

Cost model (``benchmarks`` W1): one unpreconditioned CG iteration streams at
least ``nnz*(w+i) + 4n + 11*n*w`` bytes (w value width, i index width). CG on
a 2D Poisson-like matrix needs about ``0.1 * ln(2/rtol) * sqrt(n)``
iterations (measured with SciPy's cg on 16..128 squared grids at rtol 1e-8:
1.75..1.87 sqrt(n)); BiCGStab about 0.7 times as many, with two products each.
The product (bytes per iteration x iterations) is the predicted cost in bytes
streamed, which the DeviceManager turns into seconds with each device's
learned speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Routes a system can take through solve_many.
BATCH = "batch"  # batched Krylov core (CG or BiCGStab), many systems in one block-diagonal CSR
SINGLE = "single"  # solve() on one device, one system (gmres, minres, direct, dense, operators)
DIRECT = "direct"  # sparse LU on the host, many systems over a thread pool (CPU only)

# Rows per batch that keep a device busy. On a GPU a 2D 5-point SpMV of 1M
# rows streams about 150 MB, some 40 us on an H200: long enough that launch
# latency (about 5 us a kernel) stops dominating. Host and simulated devices
# run NumPy/Numba on a few cores, where smaller batches balance better and
# cost nothing in efficiency. Measured on an H200, W2 (1.87M rows): two batches
# of ~0.94M rows 100 ms per solve_many, one batch of 1.87M rows 106-110 ms (the
# second batch's copy overlaps the first one's compute).
TARGET_ROWS = {"cuda": 1 << 20, "sim": 1 << 15, "cpu": 1 << 15}
# Batches each device should get at least, so longest-first dispersal has
# small pieces left to even out the finish times.
BATCHES_PER_DEVICE = 4
# A system of at least this many rows, or a quarter of the target batch rows,
# is a batch of its own: a batch cannot be split between devices, so one
# large system must be free to go to any of them. On a 2xH200 host, W2-large's
# four 1024^2 systems (about 1,900 CG iterations each, the small ones 60-180)
# went into one 5.4M-row batch with 133 small systems: one GPU ran 551 ms of it
# while the other ran everything else (1.38x from two GPUs, not 1.8x).
ALONE_ROWS = 1_000_000
# Systems share a batch only within a factor of this in predicted iterations:
# the batch runs until its slowest system converges, and one long system
# among many short ones makes a batch both long and hard to balance. W2's
# systems (32^2..96^2 unknowns, 60-180 iterations) stay together.
ITERATION_SPREAD = 4.0


def predict_iterations(n: int, *, rtol: float = 1e-8, method: str = "cg",
                       maxiter: int | None = None) -> float:
    """Expected Krylov iterations for an ``n``-unknown Poisson-like system.

    Examples
    --------
    >>> round(predict_iterations(96 * 96, rtol=1e-8))
    183
    """
    rtol = min(max(float(rtol), 1e-16), 0.5)
    its = 0.1 * math.log(2.0 / rtol) * math.sqrt(max(int(n), 1))
    if method == "bicgstab":
        its *= 0.7
    its = max(its, 1.0)
    if maxiter is not None:
        its = min(its, float(maxiter))
    return its


def bytes_per_iteration(n: int, nnz: int, *, itemsize: int = 8, index_itemsize: int = 4,
                        method: str = "cg", jacobi: bool = False) -> float:
    """Fewest bytes one iteration streams (CSR product plus vector updates).

    Examples
    --------
    >>> bytes_per_iteration(100, 460)  # 5-point stencil: about 150 bytes a row
    14720.0
    """
    spmv = nnz * (itemsize + index_itemsize) + 4 * n
    if method == "bicgstab":
        return float(2 * spmv + (20 + 2 * jacobi) * n * itemsize)
    if method == "gmres":
        # Classical Gram-Schmidt twice against 15 basis vectors on average
        # (restart 30): each pass reads them twice (dot products, then the
        # update), plus w's reads and writes and the new vector.
        return float(spmv + (4 * 15 + 10 + 2 * jacobi) * n * itemsize)
    return float(spmv + (11 + 2 * jacobi) * n * itemsize)


def solve_bytes(n: int, nnz: int, *, itemsize: int = 8, index_itemsize: int = 4,
                method: str = "cg", nsys: int = 1, jacobi: bool = False) -> int:
    """Device bytes to hold a (packed) system and solve it: CSR, b, x, work vectors.

    Used until the batched core's own ``PackedBatch.predict_bytes`` is given
    (``solve_many`` passes that one). Vectors: b, x, the method's workspace,
    the inverse diagonal with Jacobi, a row-to-system map and per-system scalars.
    """
    vectors = {"cg": 4, "bicgstab": 7, "gmres": 33}.get(method, 7) + 2 + (1 if jacobi else 0)
    csr = nnz * (itemsize + index_itemsize) + (n + 1) * index_itemsize
    per_system = 64 + (7_700 if method == "gmres" else 0)  # GMRES: its Hessenberg columns
    return int(csr + vectors * n * itemsize + 4 * n + per_system * nsys)


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


def _sum_bytes(members: Sequence[Estimate]) -> int:
    return int(sum(e.nbytes for e in members))


def target_rows(total_rows: int, ndevices: int, kind: str = "cuda", *,
                batches_per_device: int = BATCHES_PER_DEVICE) -> int:
    """Rows per batch: enough to fill a device, small enough for several per device.

    Examples
    --------
    >>> target_rows(1_870_000, 1, "cuda")  # W2 on one GPU: two batches of ~0.94M rows
    1048576
    >>> target_rows(200_000, 2, "cpu")
    25000
    """
    floor = TARGET_ROWS.get(kind, TARGET_ROWS["cuda"])
    share = total_rows // max(1, ndevices * batches_per_device)
    if kind == "cuda":
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
    batch_bytes = batch_bytes or _sum_bytes
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
        count = len(members)
        its = np.fromiter((e.iterations or predict_iterations(e.n) for e in members), np.float64, count)
        n = np.fromiter((e.n for e in members), np.int64, count)
        index = np.fromiter((e.index for e in members), np.int64, count)
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
            _pack_band([members[j] for j in band.tolist()], rows, max_bytes, batch_bytes,
                       lambda m, sums=None, r=route, g=group: emit(m, r, g, sums), n[band])
            start = stop
    return out, too_big


def _pack_band(members: list[Estimate], rows: int, max_bytes: int,
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
    """Two halves of a batch (by rows), remembering the devices it failed on.

    A batch of one system is returned unchanged in a list of one.
    """
    if batch.nsys < 2:
        return [batch]
    batch_bytes = batch_bytes or _sum_bytes
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
                            tried=batch.tried))
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
