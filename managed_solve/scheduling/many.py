"""``solve_many`` on this machine: validate -> estimate -> plan -> run, each step entered once.

Each step is one function of its module, which hands the next a plain
object:

1. :func:`.validate.validate_call` checks the call's arguments, runs the
   host checks of the inputs (NaN and Inf, the auto policy's matrix tests)
   in one pass over the cores, and turns each input into a
   :class:`LinearSystem` (a bad one becomes an ``INVALID_INPUT`` result,
   the rest go on): :class:`.validate.Checked`;
   :func:`select_devices`, here, then names the devices the call uses
   (:func:`start_cuda`, before validation, has started their CUDA side);
2. :func:`.estimate.estimate_call` finds each system's route, bytes and cost
   on them: :class:`.plan.Work`;
3. :func:`.plan.plan_call` packs batches and disperses them longest-first
   over the devices, systems pinned with the manager
   (:func:`pinned_systems`, here) on their own: :class:`.plan.Plan`;
4. :func:`.runner.run_call` runs workers per device (on an accelerator one
   per lane, setting ``lanes_per_device``), its stage thread copying the
   next batch beside the current compute, handing each batch to
   its route (:mod:`.routes`), splitting and retrying what fails; the
   results come back in input order.

The interpreter settings a call may hold while it runs (when the caller opts
in) are the process's, in :mod:`managed_solve._backend`.

With many systems and a few large ones (setting ``head_start_systems``), the
large ones start computing before the others are estimated and planned
(``Work.rest``, ``Plan.more``). Systems whose inputs require grad keep what
their routes prepared (:mod:`.adjoint`), and their results are attached to
autograd.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .. import _backend, config
from ..device_args import resolve_devices
from ..devices import Device
from ..manager import DeviceManager, manager_or_default
from ..placement import pinned_input, warn_pin_passed_over
from ..result import SolveResult
from ..system import LinearSystem
from . import adjoint
from . import estimate as estimation
from . import plan as planning
from . import runner as running
from . import validate as validation
from .errors import raise_for_failures


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
    settings = config.current()
    kept = None
    items = list(systems)
    mgr = manager_or_default(manager, "solve_many")
    # A GPU run's contexts and CUDA modules start first, on helper threads,
    # beside validation's host checks.
    started = start_cuda(items, mgr, devices, disperse, method)
    with _backend.COLLECTION.held(False, active=settings.pause_gc):
        checked = validation.validate_call(items, method=method, M=M, rtol=rtol,
                                           return_on=return_on, on_error=on_error,
                                           progress=progress)
        if checked.grad:  # the routes keep what the adjoints reuse, released with the graph
            kept = adjoint.keep(checked.systems, mgr)
        try:
            devs = select_devices(mgr, devices, disperse, checked.systems)
            gpus = sum(d.is_gpu for d in devs)  # simulated GPUs too: the same threads
            switch = settings.switch_interval
            blas = settings.host_blas_threads
            with _backend.SWITCH_INTERVAL.held(switch, active=switch is not None and gpus >= 2), \
                    _backend.BLAS_THREADS.held(blas, active=blas is not None):
                work = estimation.estimate_call(checked, mgr, devs, method, prefetched=started)
                pins = pinned_systems(items, work.systems, mgr, devices) if mgr.pins else None
                plan = planning.plan_call(work, mgr, pins)
                out = running.run_call(plan, work, mgr, progress=progress, kept=kept)
        except BaseException:
            if kept is not None:
                kept.release()
            raise
    if return_on == "host":
        for r in out:
            if r.x is not None:
                r.x = np.asarray(_backend.to_host(r.x))  # sync: copies each x to the host
    if checked.grad:
        # Their results are attached. Backward solves all the adjoints at once
        # on what this call kept; any other adjoint through one more call,
        # placed and batched as this one was.
        adjoint.attach(out, checked.systems, kept, lambda adjoints: solve_many(
            adjoints, disperse=disperse, devices=devices, manager=manager))
    if on_error == "raise":
        raise_for_failures(out)
    return out


def select_devices(manager: DeviceManager, devices: object, disperse: bool,
                   systems: Sequence[LinearSystem | None]) -> list[Device]:
    """The devices a call uses: those named (or every accelerator, else the CPU).

    Without ``disperse``, one of them: the one already holding most of the
    bytes of ``systems`` (the call's, None for invalid ones), else the one
    with most room.
    """
    if devices is not None:  # each once, in the order named; the manager's own (it keeps the ledger)
        devs = list(dict.fromkeys(resolve_devices(devices, manager.inventory,
                                                  call="solve_many", arg="devices")))
    else:
        devs = manager.accelerators or [manager.cpu]
    if disperse or len(devs) == 1:
        return devs
    held_bytes: dict[str, int] = {}
    for s in systems:
        if s is not None:
            held_bytes[s.device] = held_bytes.get(s.device, 0) + s.nbytes
    best = max(devs, key=lambda d: (held_bytes.get(str(d), 0), manager.available_bytes(d)))
    return [best]


def pinned_systems(items: Sequence[Any], systems: Sequence[LinearSystem | None],
                   manager: DeviceManager, devices: Any) -> dict[int, Device]:
    """The device each pinned input goes to, by position (asked only of a manager with pins).

    An input is pinned as ``solve`` reads it (:func:`managed_solve.placement.pinned_input`):
    a LinearSystem by its own pin, else its A's, else its b's; an ``(A, b)``
    pair by A's, else b's (the objects given, whatever validation made of
    them). Invalid inputs are left out. The call's ``devices``, when given,
    win over a pin to a device they leave out, as ``solve(device=)`` does:
    that system is placed on them like any other, with a warning naming it
    and the fix.
    """
    named = None if devices is None else set(resolve_devices(devices, manager.inventory,
                                                              call="solve_many", arg="devices"))
    out: dict[int, Device] = {}
    left_out: list[str] = []
    for i, (item, s) in enumerate(zip(items, systems, strict=True)):
        if s is None:
            continue
        objs = (item, item.A, item.b) if isinstance(item, LinearSystem) else tuple(item)
        obj = pinned_input(manager, *objs)
        dev = manager.pinned(obj) if obj is not None else None
        if dev is None:
            continue
        if named is not None and dev not in named:
            left_out.append(f"systems[{i}] (pinned to {dev})")
            continue
        out[i] = dev
    if left_out:
        shown = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        warn_pin_passed_over(f"solve_many(devices={devices!r})", shown, "the devices named",
                             arg="devices")
    return out


def start_cuda(items: Sequence[Any], manager: DeviceManager, devices: Any, disperse: bool,
               method: str) -> frozenset[np.dtype]:
    """Start a GPU run's CUDA side before its host work: the GPUs' contexts and the batched modules.

    Both run on helper threads without the GIL (a context takes about a
    tenth of a second to make; a module loads from CuPy's cache or compiles),
    beside the host checks, whose first call in a process sets Numba up
    (a quarter of a second of Python). Only where the GPUs are known before
    validation: every accelerator (``disperse``, the default) or those
    named in ``devices``, which are then the devices the call uses. The
    modules' dtypes are read off the raw inputs (:func:`input_dtypes`);
    returned, so that :func:`.estimate.prefetch_cuda_modules`, after
    validation, adds only those this missed.
    """
    if devices is None:
        devs = manager.accelerators
    else:
        try:
            devs = resolve_devices(devices, manager.inventory, call="solve_many", arg="devices")
        except (TypeError, ValueError):
            return frozenset()  # the call's own device selection reports it
    gpus = [d.index for d in devs if d.is_cuda]
    if not gpus or (not disperse and len(devs) > 1):  # the one GPU used is chosen later
        return frozenset()
    for index in gpus:
        _backend.open_cuda_context(index)
    family = estimation.PREFETCH_FAMILY.get(method)
    if family is None:
        return frozenset()
    from ..solvers.batched import prefetch_kernels

    dtypes = input_dtypes(items)
    for dt in sorted(dtypes, key=str):
        prefetch_kernels(gpus, dt, np.int32, (family,))
    return frozenset(dtypes)


_F32 = np.dtype(np.float32)


def input_dtypes(items: Sequence[Any]) -> set[np.dtype]:
    """The value dtypes validation will give ``solve_many``'s raw inputs, as far as read without it.

    A LinearSystem's own; an ``(A, b)`` pair's float32 when both are
    float32, float64 when both are real numbers otherwise (the rule of
    :mod:`managed_solve.system.inputs`). Inputs that are neither, or whose
    dtypes are not NumPy's (torch tensors), are left out.
    """
    out: set[np.dtype] = set()
    for item in items:
        try:
            if isinstance(item, LinearSystem):
                if item.kind == "csr":
                    out.add(np.dtype(item.dtype))
            elif isinstance(item, (tuple, list)) and len(item) == 2:
                dts = {np.dtype(item[0].dtype), np.dtype(item[1].dtype)}
                if dts == {_F32}:
                    out.add(_F32)
                elif all(dt.kind in "fiub" for dt in dts):
                    out.add(np.dtype(np.float64))
        except (AttributeError, TypeError):
            continue
    return out
