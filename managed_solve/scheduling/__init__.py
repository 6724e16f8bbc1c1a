"""``solve_many`` on this machine: validate -> estimate -> plan -> run (re-exports only).

- ``many``: the ``solve_many`` entry, each step entered once from it; the
  call's devices and the early start of their CUDA side.
- ``validate``: the call's arguments; the host checks of the inputs (NaN and
  Inf, the auto policy's matrix tests) in one pass over the cores; each input
  as a LinearSystem or an INVALID_INPUT result.
- ``estimate``: each system's route (the auto policy), bytes and cost (the cost model).
- ``plan``: Estimate/Batch/Slot, packing, longest-first dispersal, the plan of a call.
- ``runner``: workers per device (lanes: several batches computing at once
  on an accelerator, each on its own stream), queues, work stealing, the
  stage threads' host -> device copies of the next batch beside the current
  compute.
- ``adjust``: the runner's queue changes off the common path: the rest of a
  head-start plan, split-and-retry recovery, deferred batches regrouped.
- ``routes``: how each route runs (batched core, ``solve()``, host LU,
  sharded), each applying the verify-and-fall-back rule of ``solvers.verify``.
- ``adjoint``: what the routes keep for the adjoints of systems that require grad.
"""

from .errors import SolveManyError as SolveManyError
from .errors import is_device_error as is_device_error
from .many import solve_many as solve_many
from .plan import Batch as Batch
from .plan import Estimate as Estimate
from .plan import Plan as Plan
from .plan import Slot as Slot
from .plan import plan_work as plan_work
