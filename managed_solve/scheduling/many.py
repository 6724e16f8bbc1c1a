"""``solve_many`` on this machine: validate -> estimate -> plan -> run -> gather.

1. :mod:`.validate` turns each input into a :class:`LinearSystem` (a bad one
   becomes an ``INVALID_INPUT`` result, the rest go on);
2. :mod:`.estimate` picks each system's route and predicts its bytes and cost;
3. :mod:`.plan` packs batches and disperses them longest-first over the devices;
4. :mod:`.runner` runs one worker per device, staging copies beside compute
   (:mod:`.staging`), running each route (:mod:`.routes`), splitting and
   retrying what fails;
5. results come back in input order.

With many systems and a few large ones (setting ``head_start_systems``), the
large ones start computing before the others are estimated and planned. The
auto policy's tests of small host matrices and validation's finite check run
first, many matrices a kernel call on every core (:mod:`.host_checks`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import _backend, autograd, config
from ..manager import DeviceManager, default_manager
from ..result import SolveResult
from ..system import LinearSystem
from . import adjoint, host_checks, process
from . import estimate as estimation
from .errors import raise_for_failures
from .plan import SINGLE, Estimate, head_start, plan_work, select_devices
from .routes import prefetch_cuda_modules, run_sharded, start_cuda
from .runner import Runner
from .validate import check_arguments, finite_candidates, invalid_result, validate_all


def solve_many(systems: Iterable[Any], *, disperse: bool = True, devices: Any = None,
               method: str = "auto", M: Any = None, rtol: float | None = None,
               progress: bool = False, return_on: str = "device", on_error: str = "return",
               manager: DeviceManager | None = None) -> list[SolveResult]:
    """Solve many independent linear systems on this machine's devices.

    :func:`managed_solve.solve_many` with ``backend="local"``: the parameters,
    returns and errors are documented there.

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
    check_arguments(method, M, rtol, return_on, on_error, progress)
    settings = config.current()
    validated: list[LinearSystem | None] = []
    # Inputs that require grad (grad mode is the caller's thread's): the routes
    # keep what the adjoints reuse (.adjoint), released with the graph.
    kept = adjoint.Kept(manager if manager is not None else default_manager()) \
        if autograd.recording() else None
    try:
        with process.COLLECTION.held(False, active=settings.pause_gc):
            out = _solve(systems, disperse=disperse, devices=devices, method=method, M=M,
                         rtol=rtol, progress=progress, manager=manager, validated=validated,
                         kept=kept)
    except BaseException:
        if kept is not None:
            kept.release()
        raise
    if return_on == "host":
        for r in out:
            if r.x is not None:
                r.x = np.asarray(_backend.to_host(r.x))  # sync: copies each x to the host
    # Inputs that require grad: their results are attached. Backward solves
    # all the adjoints at once on what this call kept; any other adjoint
    # through one more call, placed and batched as this one was.
    adjoint.attach(out, validated, kept, lambda adjoints: solve_many(
        adjoints, disperse=disperse, devices=devices, manager=manager))
    if on_error == "raise":
        raise_for_failures(out)
    return out


def _solve(systems: Iterable[Any], *, disperse: bool, devices: Any, method: str, M: Any,
           rtol: float | None, progress: bool, manager: DeviceManager | None,
           validated: list | None = None, kept: adjoint.Kept | None = None) -> list[SolveResult]:
    """Validate, estimate, plan and run (arguments checked); the results in input order.

    ``validated`` (a list) receives each input's LinearSystem (None where
    invalid); ``kept`` receives what the routes prepared for the systems
    whose inputs require grad.
    """
    items = list(systems)
    mgr = manager if manager is not None else default_manager()
    # A GPU run's contexts and CUDA modules start first, on helper threads,
    # beside the host checks below.
    start_cuda(items, mgr, devices, disperse, method)
    # Validation's finite check and the auto policy's tests of the inputs'
    # host matrices: one pass on every core, this thread among the workers
    # (helpers waiting for the GIL would otherwise wait on the loops below).
    cache: dict = {}  # symmetry per matrix object, for this call
    least = estimation.pass_least()
    tests = host_checks.symmetry_pass(estimation.input_matrices(items, method, least))
    # The tested matrices' entries are checked for NaN and Inf by the same kernel calls.
    finite = host_checks.FinitePass(finite_candidates(items, tests.covered()))
    host_checks.run_all([tests, finite])
    tests.store(cache)
    memo = {id(a): a for a in finite.finite()}
    memo.update((id(a), a) for a in tests.finite_data())
    results, checked = validate_all(items, method=method, M=M, rtol=rtol, memo=memo)
    valid: list[LinearSystem | None] = [checked.get(i) for i in range(len(items))]
    estimation.test_gpu_matrices(valid, cache)  # systems already on a GPU: one read for all
    if validated is not None:
        validated[:] = valid
    if kept is not None:
        kept.wanted = {i for i, s in enumerate(valid) if s is not None and s.grad is not None}
        if not kept.wanted:
            kept = None

    held: dict[str, int] = {}
    for s in valid:
        if s is not None:
            held[s.device] = held.get(s.device, 0) + s.nbytes
    devs = select_devices(mgr, devices, disperse, held)
    host_only = all(d.kind == "cpu" for d in devs)
    if not host_only:
        prefetch_cuda_modules(valid, devs, method)  # compiles beside what follows
    kind = "cpu" if host_only else next(d.kind for d in devs if d.kind != "cpu")
    ref = devs[0]
    if host_only:
        estimation.count_shared(valid, cache)  # one LU serves every system of a shared matrix
    # The large host matrices' tests start on helper threads (their results
    # gate a head start); small ones not tested above (validation replaced
    # the object: a dtype conversion) run on every core, many a kernel call.
    mats = estimation.host_matrices(valid, cache, least)
    early = estimation.prefetch_methods(valid, kind, cache, skip={id(A) for A in mats})
    if host_only:  # the method decides the route (a host LU or a batch): known before the plan
        host_checks.test_symmetry(mats, cache)
        passed: dict = {}
    else:  # beside the estimates, the plan and the first batch's packing
        passed = estimation.start_host_matrices(mats, cache)
        early.update(passed)

    def method_of(s: LinearSystem) -> str:
        """A deferred system's method (its test may still run on a helper thread)."""
        pending = early.get(id(s.A))
        if pending is not None:
            pending.result()
        return estimation.resolve_method(s, kind, cache)

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
                    if pending is not None and estimation.deferrable(s, kind) \
                            and (id(s.A) in passed or (defer and not pending.done())):
                        out.append(estimation.deferred_estimate(s, i))
                        continue
                    if pending is not None:
                        pending.result()  # the large matrix's method, found beside this loop
                out.append(estimation.estimate_system(s, i, device_kind=kind, manager=mgr,
                                                      reference=ref, cache=cache))
            except (TypeError, ValueError) as exc:
                valid[i] = None
                results[i] = invalid_result(exc, i, s)
        return out

    bar = None
    if progress:
        tqdm = _backend.require("tqdm", "solve_many(progress=True)")
        bar = tqdm.tqdm(total=len(items), unit="system", desc="solve_many", smoothing=0.1)
        bar.update(sum(r is not None for r in results))
    settings = config.current()
    try:
        batch_bytes = estimation.packed_bytes(mgr, valid)
        rows = [None if s is None else (s.n if s.kind == "csr" else 0) for s in valid]
        head, rest, rows_bound = head_start(rows, devs, host_only)
        gpus = sum(d.is_gpu for d in devs)  # simulated GPUs too: the same threads
        switch = settings.switch_interval
        with process.SWITCH_INTERVAL.held(switch, active=switch is not None and gpus >= 2):
            if head:
                # The systems that run alone start now; the others are
                # estimated and planned while they compute.
                ests = estimates(head, defer=True)
                first = plan_work(ests, devs, mgr, batch_bytes=batch_bytes, packed_rows=rows_bound)
                runner = Runner(valid, first, devs, mgr, results, bar=bar, batch_bytes=batch_bytes,
                                more=True, method_of=method_of, kept=kept)
                runner.start()
                try:
                    # The loop below is Python beside the workers' first copies and
                    # graph captures, which take the GIL back after each of their
                    # many CUDA calls (see the setting head_switch_interval).
                    beside = settings.head_switch_interval
                    with process.SWITCH_INTERVAL.held(beside, active=beside is not None):
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
                runner = Runner(valid, plan, devs, mgr, results, bar=bar, batch_bytes=batch_bytes,
                                method_of=method_of, kept=kept)
                runner.start()
            runner.join()
        # Sharded systems use every accelerator at once: after the batches.
        for i in plan.sharded:
            results[i] = run_sharded(valid[i], devs, mgr)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    missing = [i for i, r in enumerate(results) if r is None]
    if missing:  # every path above delivers; this guards the promise "nothing lost"
        raise RuntimeError(f"solve_many: internal error, no result for systems {missing[:10]}")
    return results  # type: ignore[return-value]
