"""``solve_many`` on this machine: validate -> estimate -> plan -> run, each step entered once.

Each step is one function of its module, which hands the next a plain
object:

1. :func:`.validate.validate_call` checks the call's arguments and turns each
   input into a :class:`LinearSystem` (a bad one becomes an
   ``INVALID_INPUT`` result, the rest go on): :class:`.validate.Checked`;
   :func:`.plan.select_devices` then names the devices the call uses;
2. :func:`.estimate.estimate_call` finds each system's route, bytes and cost
   on them: :class:`.plan.Work`;
3. :func:`.plan.plan_call` packs batches and disperses them longest-first
   over the devices: :class:`.plan.Plan`;
4. :func:`.runner.run_call` runs one worker per device, staging copies
   beside compute (:mod:`.staging`), handing each batch to its route
   (:mod:`.routes`), splitting and retrying what fails; the results come
   back in input order.

With many systems and a few large ones (setting ``head_start_systems``), the
large ones start computing before the others are estimated and planned
(``Work.rest``, ``Plan.more``). Systems whose inputs require grad keep what
their routes prepared (:mod:`.adjoint`), and their results are attached to
autograd.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .. import _backend, config
from ..manager import DeviceManager, default_manager
from ..result import SolveResult
from . import adjoint, process
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
    mgr = manager if manager is not None else default_manager()
    # A GPU run's contexts and CUDA modules start first, on helper threads,
    # beside validation's host checks.
    estimation.start_cuda(items, mgr, devices, disperse, method)
    with process.COLLECTION.held(False, active=settings.pause_gc):
        checked = validation.validate_call(items, method=method, M=M, rtol=rtol,
                                           return_on=return_on, on_error=on_error,
                                           progress=progress)
        if checked.grad:  # the routes keep what the adjoints reuse, released with the graph
            kept = adjoint.keep(checked.systems, mgr)
        try:
            devs = planning.select_devices(mgr, devices, disperse, checked.systems)
            gpus = sum(d.is_gpu for d in devs)  # simulated GPUs too: the same threads
            switch = settings.switch_interval
            blas = settings.host_blas_threads
            with process.SWITCH_INTERVAL.held(switch, active=switch is not None and gpus >= 2), \
                    process.BLAS_THREADS.held(blas, active=blas is not None):
                work = estimation.estimate_call(checked, mgr, devs, method)
                plan = planning.plan_call(work, mgr)
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
