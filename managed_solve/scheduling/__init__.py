"""``solve_many`` on this machine: validate -> estimate -> plan -> run -> gather (re-exports only).

- ``validate``: the call's arguments; each input as a LinearSystem or an INVALID_INPUT result.
- ``estimate``: each system's route (the auto policy), bytes and cost (the cost model).
- ``plan``: Estimate/Batch/Slot, packing, longest-first dispersal, the plan of a call.
- ``runner``: one worker per device, queues, work stealing, split-and-retry recovery.
- ``staging``: host -> device copies of the next batch beside the current compute.
- ``routes``: how each route runs (batched core, ``solve()``, host LU, sharded).
- ``verify``: the verify-and-fall-back rule every route applies.
- ``process``: interpreter settings held while a call runs, when the caller opts in.
- ``many``: the ``solve_many`` entry, each step entered once.
"""

from .errors import SolveManyError as SolveManyError
from .errors import is_device_error as is_device_error
from .many import solve_many as solve_many
from .plan import Batch as Batch
from .plan import Estimate as Estimate
from .plan import Plan as Plan
from .plan import Slot as Slot
from .plan import plan_work as plan_work
