"""Step 2 of ``solve_many``: the route, device bytes and cost of each system on the call's devices.

:func:`estimate_call` is the step: it starts what runs beside the rest of
the call (the batched CUDA modules' compilation, large matrices' tests) and
hands the plan step a :class:`.plan.Work`. The method comes from the one
auto policy (:func:`managed_solve.system.method.choose_method`, the one
``solve()`` uses), the bytes and cost from the one cost model
(:mod:`managed_solve.system.cost`). The route follows from the method:

- ``BATCH``: CG, BiCGStab or GMRES on a CSR matrix with no or a Jacobi
  preconditioner, packed with other systems into the batched core;
- ``DIRECT``: "auto" systems the policy factorises on the CPU, many at once
  over the host's cores;
- ``SINGLE``: everything else (MINRES, dense matrices, operators, other
  preconditioners, ``method="direct"`` given by the caller) through
  ``solve()``, one system each.

The auto method's tests (symmetry, Gershgorin bounds) of the inputs' host
matrices run in validation's pass, many matrices a GIL-free kernel call on
every core (:func:`.validate.check_inputs`). Those of matrices
validation replaced run after it (:func:`check_host_matrices`; on a call
with accelerators on a helper thread, :func:`start_host_matrices`, their
systems' methods deferred to their batches: :func:`deferred_estimate`).
Large matrices' chunked tests run on helper threads beside the estimate
loop (:func:`prefetch_methods`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Collection, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from .. import _backend, config
from ..devices import Device
from ..manager import DeviceManager
from ..system import LinearSystem, is_symmetric
from ..system.cost import bytes_per_iteration, krylov_cost, predict_iterations, solve_bytes
from ..system.method import amg_min_n, choose_method, choose_preconditioner, matrix_symmetry
from . import validate as validation
from .plan import ALONE_ROWS, BATCH, DEFERRED, DIRECT, SINGLE, Estimate, Work, target_rows
from .validate import Checked, invalid_result

#: Methods the batched core runs (an "auto" system whose method is another runs alone).
BATCHED_METHODS = ("cg", "bicgstab", "gmres")

_DTYPE_NAMES: dict[np.dtype, str] = {}


def resolve_method(s: LinearSystem, device_kind: str, cache: dict | None) -> str:
    """The method that solves ``s`` on devices of ``device_kind``: the auto policy's choice.

    The same as ``solve()`` makes for that system on such a device (the
    policy is :func:`managed_solve.system.method.choose_method`), except
    that the systems of the call sharing its matrix (:func:`count_shared`)
    count as right-hand sides of one factorisation; ``cache`` (one dict per
    call) keeps the symmetry and diagonal tests by matrix.
    """
    return choose_method(s, device_kind, cache=cache, rhs=shared_count(s, cache))


def count_shared(systems: Sequence[LinearSystem | None], cache: dict) -> None:
    """Count, into ``cache``, the "auto" CSR systems without a preconditioner that share each matrix.

    Systems sharing a matrix object share its host LU (:class:`.routes.FactorCache`),
    so the auto policy weighs one factorisation against their CG solves.
    """
    counts: dict[int, list] = {}
    for s in systems:
        if s is not None and s.kind == "csr" and s.method == "auto" and s.M is None:
            entry = counts.get(id(s.A))
            if entry is None:
                counts[id(s.A)] = [s.A, 1]
            else:
                entry[1] += 1
    shared = {key: entry for key, entry in counts.items() if entry[1] > 1}
    if shared:  # one entry for the call: calls without it find none at once (shared_count)
        cache.setdefault("rhs", {}).update(shared)


def host_matrices(systems: Sequence[LinearSystem | None], cache: dict, least: int | None = None,
                  skip: Collection[int] = ()) -> list:
    """The distinct matrices :func:`check_host_matrices` tests (untested, :func:`.validate.pass_tested`).

    ``least``: default :func:`.validate.pass_least`. Matrices whose ids
    are in ``skip`` (under test already) are left out.
    """
    least = validation.pass_least() if least is None else least
    found: dict[int, Any] = {}
    for s in systems:
        if s is None:
            continue
        key = id(s.A)
        if key in found or key in skip:
            continue
        hit = cache.get(key)  # tested already (the input pass): the common case, cheap first
        if (hit is None or hit[0] is not s.A) and validation.pass_tested(s, least):
            found[key] = s.A
    return list(found.values())


def check_host_matrices(systems: Sequence[LinearSystem | None], cache: dict,
                       least: int | None = None) -> int:
    """Run the auto policy's matrix tests on every core, before the estimates.

    Each distinct host CSR matrix of an "auto" system below ``least``
    stored entries (default :func:`.validate.pass_least`) gets its
    one-pass symmetry and Gershgorin test, many matrices a GIL-free kernel
    call (:func:`.validate.check_symmetry`), shared out largest first over
    the calling thread and the host-kernel helpers. The estimate loop then
    finds every answer in ``cache``; :func:`prefetch_methods` leaves these
    matrices alone. Returns the number of matrices tested.
    """
    mats = host_matrices(systems, cache, least)
    validation.check_symmetry(mats, cache)
    return len(mats)


def check_gpu_matrices(systems: Sequence[LinearSystem | None], cache: dict) -> int:
    """The auto policy's matrix tests of the systems' GPU matrices, all at once.

    Each distinct cupyx CSR matrix of an "auto" system gets its symmetry code
    and Gershgorin bounds from one launch per GPU and dtype pair, read back
    in one copy (:func:`managed_solve.system.device_checks.symmetry_many`),
    into ``cache`` as :func:`.validate.check_symmetry` leaves the host
    matrices'. Tested one by one, each would cost a transpose and several
    host reads. A matrix whose rows are not canonical is left to the
    per-matrix test. Returns the number of matrices tested.
    """
    from ..kernels.symmetry import DIFFERENT_PATTERN
    from ..system.device_checks import symmetry_many

    found: dict[int, Any] = {}
    for s in systems:
        if s is None or s.kind != "csr" or s.method != "auto" or id(s.A) in found:
            continue
        A = s.A
        if not _backend.is_cupy_sparse(A) or A.nnz == 0:
            continue
        hit = cache.get(id(A))
        if hit is None or hit[0] is not A:
            found[id(A)] = A
    mats = list(found.values())
    for A, res in zip(mats, symmetry_many(mats) if mats else [], strict=True):
        if res is None:
            continue
        code, bounds = res
        if code != DIFFERENT_PATTERN:
            cache[id(A)] = (A, bool(code))
        cache[("gershgorin", id(A))] = (A, bounds)
    return len(mats)


def start_host_matrices(mats: Sequence[Any], cache: dict) -> dict[int, Future]:
    """:func:`check_host_matrices` of ``mats`` (:func:`host_matrices`) on a helper thread.

    Returns one future, by the id of each matrix. A call with accelerators
    defers these systems' methods (:func:`deferred_estimate`): its plan is
    made and its first batch packed while the tests run; the runner reads
    each batch's method when it needs it (``Runner.method_of``, which waits
    for this future). The address tables are read here, on the calling
    thread: the helper then needs the GIL only around its kernel calls.
    """
    if not mats:
        return {}
    work = validation.symmetry_pass(mats)
    pool = _backend.thread_pool("prefetch", max(2, min(8, _backend.cpu_count() // 2)))
    fut = pool.submit(work.run, cache)
    return {id(A): fut for A in mats}


def shared_count(s: LinearSystem, cache: dict | None) -> int:
    """The systems sharing ``s``'s matrix (:func:`count_shared`), 1 when not counted."""
    counts = cache.get("rhs") if cache is not None else None
    hit = counts.get(id(s.A)) if counts is not None else None
    return hit[1] if hit is not None and hit[0] is s.A else 1


def is_jacobi(M: Any) -> bool:
    """Whether ``M`` is the Jacobi preconditioner named by string."""
    return isinstance(M, str) and M == "jacobi"


def batched_preconditioner(s: LinearSystem, device_kind: str) -> bool:
    """Whether the batched core takes the system's preconditioner (none, or Jacobi).

    ``M="auto"`` below the AMG threshold of ``device_kind`` means none
    (:func:`managed_solve.system.method.choose_preconditioner`); above it the
    system is solved alone, where the policy may set up AMG.
    """
    M = s.M
    if M is None:  # the commonest: settled at validation
        return True
    if isinstance(M, str) and M == "auto":
        return s.n < amg_min_n(device_kind)
    return is_jacobi(M)


def deferrable(s: LinearSystem, device_kind: str) -> bool:
    """Whether an "auto" system takes the batched route whatever its method (:func:`route`).

    Its method may then be found after the plan (:func:`deferred_estimate`):
    a CSR matrix, a preconditioner the batched core takes, no null space.
    """
    return s.kind == "csr" and s.method == "auto" and s.nullspace is None \
        and batched_preconditioner(s, device_kind)


def dtype_name(dt: np.dtype) -> str:
    """``str(dt)``, cached: numpy builds the name on each call, 10,000 times a call otherwise."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = _DTYPE_NAMES[dt] = str(dt)
    return name


def route(s: LinearSystem, device_kind: str, cache: dict | None = None) -> tuple[str, tuple]:
    """(route, group) of a system; batches mix systems of one group only."""
    dt = _DTYPE_NAMES.get(s.dtype) or dtype_name(s.dtype)
    M = s.M
    if s.kind != "csr" or s.method in ("minres", "direct") \
            or not (M is None or batched_preconditioner(s, device_kind)) \
            or s.nullspace is not None:  # a projected singular system: solve() handles it
        return SINGLE, (s.method, dt)
    method = resolve_method(s, device_kind, cache)
    if method == "direct":  # "auto" on the host: a sparse LU, many of them over the cores
        return DIRECT, ("direct", dt, is_symmetric(s.A, cache))
    if method not in BATCHED_METHODS:  # MINRES: the batched core has none
        return SINGLE, (s.method, dt)
    return BATCH, (method, dt, M is not None and is_jacobi(M))


def home(s: LinearSystem) -> str | None:
    """The GPU a system's arrays already lie on, None on the host."""
    dev = s.device
    return dev if dev != "cpu" else None


def estimate_system(s: LinearSystem, i: int, *, device_kind: str,
                    manager: DeviceManager | None = None, reference: Device | None = None,
                    cache: dict | None = None, memo: bool = True) -> Estimate:
    """Route, device bytes and cost (bytes streamed) of one system.

    ``device_kind`` is the kind of device the call runs on (``"cpu"`` for a
    CPU-only call: the auto policy then factorises small 2D-like systems).
    A signature measured before (``manager.record``) refines the cost of
    systems that run alone: its time on the ``reference`` device, times that
    device's learned speed.

    ``cache`` (one dict per call, shared with the symmetry tests) also keeps
    each batched or host-LU estimate by matrix object and options: systems
    sharing a matrix cost a dict look-up each, not a route and a cost model.
    ``memo=False`` leaves that memo alone, for a call whose systems each
    have their own matrix (:func:`shares_matrices`), where it would only cost.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> e = estimate_system(LinearSystem(sp.identity(100, format="csr"), np.ones(100)), 0,
    ...                     device_kind="cuda")
    >>> e.route, e.n, e.nnz, round(e.iterations)
    ('batch', 100, 100, 19)
    """
    if not memo or cache is None or s.kind != "csr" or not batched_preconditioner(s, device_kind):
        return _estimate(s, i, device_kind, manager, reference, cache)
    # What a batched or host-LU estimate depends on besides the matrix (x0 counts in
    # a host LU's bytes); other routes are not kept (they ask the manager's hints).
    x0 = s.x0
    key = ("estimate", id(s.A), s.method, s.M, s.dtype, s.rtol, s.maxiter, device_kind == "cpu",
           None if x0 is None else x0.nbytes)
    hit = cache.get(key)
    if hit is not None and hit[0] is s.A:
        e = hit[1]
        where = None if type(s.b) is np.ndarray else home(s)
        return Estimate(i, e.n, e.nnz, e.nbytes, e.cost, e.route, e.group, where, e.iterations)
    e = _estimate(s, i, device_kind, manager, reference, cache)
    if e.route != SINGLE:
        cache[key] = (s.A, e)
    return e


def single_bytes(s: LinearSystem, device_kind: str, cache: dict | None = None,
                 rhs: int | None = None) -> int:
    """Bytes ``solve()`` reserves for ``s`` alone on a device of ``device_kind`` (before the heuristic).

    A ``Solver`` opened there reserves the system's arrays and the workspace
    of the method and preconditioner the auto policy chooses there (an AMG
    hierarchy counted; on the CPU "auto" may choose an LU and its fill), for
    ``rhs`` right-hand sides (None: unknown, as ``solve_many`` opens it).
    ``solve_many`` holds these bytes for a system it solves alone, and the
    solver draws on them (:meth:`managed_solve.manager.DeviceManager.lend`).
    ``cache``: the call's matrix tests.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> s = LinearSystem(sp.identity(100, format="csr"), np.ones(100), method="minres")
    >>> single_bytes(s, "cuda") == s.nbytes + s.workspace_bytes("minres")
    True
    """
    symmetric = matrix_symmetry(s, cache) if s.method == "auto" else None
    method = choose_method(s, device_kind, symmetric=symmetric, cache=cache, rhs=rhs)
    M = choose_preconditioner(s, device_kind, method, symmetric=symmetric)
    return s.nbytes + s.workspace_bytes(method, M)


def shares_matrices(systems: Sequence[LinearSystem | None]) -> bool:
    """Whether two of the systems (None: invalid inputs, left out) hold one matrix object."""
    held = [id(s.A) for s in systems if s is not None]
    return len(set(held)) < len(held)


def deferred_estimate(s: LinearSystem, i: int) -> Estimate:
    """A batched system's estimate before its method is known (the costlier bytes reserved)."""
    n, nnz = s.n, s.nnz
    w, iw = s.dtype.itemsize, s.index_dtype.itemsize
    jac = is_jacobi(s.M)
    its = predict_iterations(n, rtol=s.rtol, method="cg", maxiter=s.maxiter)
    cost = bytes_per_iteration(n, nnz, itemsize=w, index_itemsize=iw, method="cg", jacobi=jac) * its
    nbytes = solve_bytes(n, nnz, itemsize=w, index_itemsize=iw, method="bicgstab", jacobi=jac)
    return Estimate(i, n, nnz, nbytes, cost, BATCH, (DEFERRED, dtype_name(s.dtype), jac),
                    home(s), its)


def _estimate(s: LinearSystem, i: int, device_kind: str, manager: DeviceManager | None,
              reference: Device | None, cache: dict | None) -> Estimate:
    """:func:`estimate_system` without its per-call memo."""
    how, group = route(s, device_kind, cache)
    if s.kind == "csr":  # s.n, s.nnz and s.index_dtype without their properties' tests
        A = s.A
        n, nnz, iw = int(A.shape[0]), int(A.nnz), A.indices.dtype.itemsize
    else:
        n, nnz, iw = s.n, s.nnz, 8
    w = s.dtype.itemsize
    where = None if type(s.b) is np.ndarray else home(s)
    if how == BATCH:
        method, _dt, jac = group
        # The same numbers for every system of one size and options (a call's
        # systems often repeat a few sizes): kept in the call's cache.
        key = ("batch cost", method, jac, n, nnz, w, iw, s.rtol, s.maxiter)
        hit = cache.get(key) if cache is not None else None
        if hit is None:
            hit = krylov_cost(n, nnz, rtol=s.rtol, maxiter=s.maxiter, method=method, itemsize=w,
                              index_itemsize=iw, jacobi=jac)
            if cache is not None:
                cache[key] = hit
        its, cost, nbytes = hit
        return Estimate(i, n, nnz, nbytes, cost, BATCH, group, where, its)
    if how == DIRECT:
        fill = s.workspace_bytes("direct")
        # An LU streams its factors a few times; the fill bound stands in for that.
        return Estimate(i, n, nnz, s.nbytes + fill, float(fill), DIRECT, group, where)
    its = predict_iterations(n, rtol=s.rtol, method="bicgstab", maxiter=s.maxiter)
    cost = bytes_per_iteration(n, max(nnz, n), itemsize=w, index_itemsize=iw,
                               method="bicgstab") * its
    nbytes = single_bytes(s, device_kind, cache)
    if manager is not None:
        ref = reference or (manager.accelerators or [manager.cpu])[0]
        p = manager.predict(s.signature, nbytes=nbytes, cost=cost, device=ref)
        if p.source == "measured":
            cost, nbytes = p.seconds * manager.speed(ref), p.nbytes
    return Estimate(i, n, nnz, nbytes, cost, SINGLE, group, where, its)


# --------------------------------------------------------------------------- prefetch
def prefetch_methods(systems: Sequence[LinearSystem | None], device_kind: str,
                     cache: dict, skip: Collection[int] = ()) -> dict[int, Future]:
    """Start the method choice of host matrices on helper threads, by matrix id.

    The tests release the GIL, so they run beside the estimate loop. On a
    host of ``prefetch_all_cores`` cores or more (settings) every distinct
    matrix of at least ``prefetch_small_nnz`` stored entries goes there,
    largest first; on fewer cores only those of ``prefetch_min_nnz`` or more
    (two cores gain nothing from running the small tests beside the loop).
    Matrices whose ids are in ``skip`` (those :func:`check_host_matrices`
    takes: :func:`host_matrices`) are left alone.
    """
    settings = config.current()
    cores = _backend.cpu_count()
    least = settings.prefetch_small_nnz if cores >= settings.prefetch_all_cores \
        else settings.prefetch_min_nnz
    least = min(least, settings.prefetch_min_nnz)
    found: dict[int, LinearSystem] = {}
    seen: set[int] = set()
    for s in systems:
        # Cheap tests first, each matrix once: 10,000 systems cost milliseconds otherwise.
        if s is None or s.kind != "csr" or s.method != "auto":
            continue
        key = id(s.A)
        if key in seen:
            continue
        seen.add(key)
        if key in skip:  # under test by check_host_matrices, many a kernel call
            continue
        hit = cache.get(key)
        if hit is not None and hit[0] is s.A:  # tested already
            continue
        if isinstance(s.b, np.ndarray) and s.nnz >= least:  # host matrices only
            found[key] = s
    if not found:
        return {}
    workers = settings.prefetch_workers or max(2, min(8, cores // 2))
    pool = _backend.thread_pool("prefetch", workers)
    large = [(key, s) for key, s in found.items() if s.nnz >= settings.prefetch_min_nnz]
    small = [(key, s) for key, s in found.items() if s.nnz < settings.prefetch_min_nnz]
    out = {key: pool.submit(resolve_method, s, device_kind, cache) for key, s in large}
    if not small:
        return out
    if not large:
        out.update((key, pool.submit(resolve_method, s, device_kind, cache)) for key, s in small)
        return out
    # The large tests run alone first (each spreads over the symmetry threads,
    # and their result gates the first batches: see plan.head_start); the
    # small ones start when the last large one is done. Each small matrix
    # gets its future now, fulfilled from the test's own when it runs.
    later = {key: Future() for key, _s in small}
    left = [len(large)]
    lock = threading.Lock()

    def start_small(_done: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for key, s in small:
            pool.submit(resolve_method, s, device_kind, cache).add_done_callback(
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


# --------------------------------------------------------------------------- the step
def estimate_call(checked: Checked, manager: DeviceManager, devs: Sequence[Device],
                  method: str, *, prefetched: Collection[np.dtype] = ()) -> Work:
    """Each valid system's route, bytes and cost on the call's devices ``devs``.

    ``checked`` is validation's answer (its cache holds the inputs' matrix
    tests); ``method`` the call's. The auto policy's tests still missing run first: GPU matrices
    in one read (:func:`check_gpu_matrices`), host matrices that validation
    replaced on every core (or, with accelerators, on a helper thread, their
    systems' methods deferred to their batches: :func:`deferred_estimate`),
    large ones beside the estimate loop (:func:`prefetch_methods`). A system
    whose estimate raises ``TypeError``/``ValueError`` becomes an
    ``INVALID_INPUT`` result. With many systems and a few large ones
    (:func:`head_start`), only the large ones are estimated now; the others
    when the plan asks (``Work.rest``), while those compute.
    ``prefetched``: value dtypes whose modules the call started already
    on ``devs`` (``many.start_cuda``).
    """
    valid, results, cache = checked.systems, checked.results, checked.cache
    check_gpu_matrices(valid, cache)  # systems already on a GPU: one read for all
    devs = list(devs)
    host_only = all(d.kind == "cpu" for d in devs)
    if not host_only:
        prefetch_cuda_modules(valid, devs, method, skip=prefetched)  # compiles beside what follows
    kind = "cpu" if host_only else next(d.kind for d in devs if d.kind != "cpu")
    ref = devs[0]
    if host_only:
        count_shared(valid, cache)  # one LU serves every system of a shared matrix
    # The large host matrices' tests start on helper threads (their results
    # gate a head start); small ones not tested in validation's pass (it
    # replaced the object: a dtype conversion) run on every core, many a
    # kernel call.
    mats = host_matrices(valid, cache, checked.least)
    early = prefetch_methods(valid, kind, cache, skip={id(A) for A in mats})
    if host_only:  # the method decides the route (a host LU or a batch): known before the plan
        validation.check_symmetry(mats, cache)
        passed: dict = {}
    else:  # beside the estimates, the plan and the first batch's packing
        passed = start_host_matrices(mats, cache)
        early.update(passed)

    def method_of(s: LinearSystem) -> str:
        """A deferred system's method (its test may still run on a helper thread)."""
        pending = early.get(id(s.A))
        if pending is not None:
            pending.result()
        return resolve_method(s, kind, cache)

    memo = shares_matrices(valid)  # estimates kept by matrix: worth it when systems share one

    def estimates(indices: Iterable[int], defer: bool = False) -> list[Estimate]:
        out = []
        for i in indices:
            s = valid[i]
            try:
                if early and s.kind == "csr":
                    pending = early.get(id(s.A))
                    # Deferred: the method is found while the batch is packed and
                    # copied. Every system of the pass (whether or not it ended
                    # yet: the plan must not depend on timing); a large matrix
                    # whose own test is still running, in a head start.
                    if pending is not None and deferrable(s, kind) \
                            and (id(s.A) in passed or (defer and not pending.done())):
                        out.append(deferred_estimate(s, i))
                        continue
                    if pending is not None:
                        pending.result()  # the large matrix's method, found beside this loop
                out.append(estimate_system(s, i, device_kind=kind, manager=manager,
                                           reference=ref, cache=cache, memo=memo))
            except (TypeError, ValueError) as exc:
                valid[i] = None
                results[i] = invalid_result(exc, i, s)
        return out

    rows = [None if s is None else (s.n if s.kind == "csr" else 0) for s in valid]
    head, rest, rows_bound = head_start(rows, devs, host_only)
    if not head:
        return Work(valid, results, devs, estimates(rest), method_of, cache=cache)

    def later() -> list[Estimate]:
        # Python beside the workers' first copies and graph captures, which take
        # the GIL back after each of their many CUDA calls (setting head_switch_interval).
        beside = config.current().head_switch_interval
        with _backend.SWITCH_INTERVAL.held(beside, active=beside is not None):
            return estimates(rest)

    return Work(valid, results, devs, estimates(head, defer=True), method_of, later, rows_bound,
                cache)


def head_start(ns: Sequence[int | None], devices: Sequence[Device],
               host_only: bool) -> tuple[list[int], list[int], int]:
    """(positions estimated and started first, the others, a bound on the rows batches will hold).

    ``ns``: the rows of each valid system, by position (0 for those that are
    not CSR, None for invalid ones). A call holding many systems (the
    setting ``head_start_systems``) and a few large ones estimates, plans and
    starts the large ones first; the others are estimated and planned while
    the devices compute those, and their batches join the queues (planned
    against the same slots, so the dispersal is the one a single plan makes
    when the large batches are the longest). A system is started first when
    it has at least the rows that make a system run alone under the largest
    batch size the call can plan (from the rows of every CSR system, a bound
    on those the batches will hold), so it runs alone in the full plan too.
    Accelerators (simulated ones too) only.
    """
    positions = [i for i, n in enumerate(ns) if n is not None]
    least = config.current().head_start_systems
    if host_only or len(positions) <= least:
        return [], positions, 0
    n = np.fromiter((ns[i] for i in positions), np.int64, len(positions))
    bound = int(n.sum())
    alone = min(ALONE_ROWS, max(1, target_rows(bound, len(devices), devices[0].kind) // 4))
    big = n >= alone
    if not big.any() or len(positions) - int(big.sum()) < least:
        return [], positions, 0
    pos = np.asarray(positions, dtype=np.int64)
    return pos[big].tolist(), pos[~big].tolist(), bound


#: The module family a call's ``method`` launches first, for the methods
#: with one ("auto" mostly ends in CG: its module first, BiCGStab's when a
#: system turns out non-symmetric).
PREFETCH_FAMILY = {"auto": "cg", "cg": "cg", "bicgstab": "bicgstab", "gmres": "gmres"}


def prefetch_cuda_modules(systems: Sequence[LinearSystem | None], devs: Sequence[Device],
                          method: str, *, skip: Collection[np.dtype] = ()) -> None:
    """Start compiling (or loading) the batched CUDA modules this call will launch, on helper threads.

    On a cold cache the modules take seconds to compile; NVRTC runs without
    the GIL, so the call's estimates, plan and packing go on meanwhile. The
    family follows ``method`` (:data:`PREFETCH_FAMILY`); systems' value
    dtypes with int32 indices (a batch's unless it has more than 2**31
    rows or entries; others compile when met), but for those in ``skip``
    (started already).
    """
    family = PREFETCH_FAMILY.get(method)
    gpus = [d.index for d in devs if d.is_cuda]
    if family is None or not gpus:
        return
    floats = (np.dtype(np.float32), np.dtype(np.float64))
    dtypes = {s.dtype for s in systems if s is not None and s.kind == "csr" and s.dtype in floats}
    dtypes.difference_update(skip)
    if not dtypes:
        return
    from ..solvers.batched import prefetch_kernels

    for dt in sorted(dtypes, key=str):
        prefetch_kernels(gpus, dt, np.int32, (family,))
