"""What ``solve_many``'s runner does with a batch that failed: split it, send the halves elsewhere.

:class:`Recovery` holds the :class:`.runner.Runner`'s failure paths (it is
one of the runner's bases and reads the runner's queues, plan and manager):
a batch that hit an out-of-memory or device error is split and its halves
placed on other devices, finally on the CPU; a system no device could take
is delivered with ``DEVICE_ERROR``; a deferred batch whose systems need
different methods becomes one batch per method.
"""

from __future__ import annotations

import logging
from typing import Any

from ..devices import Device
from ..result import SolveResult, Status
from .errors import Regroup, is_device_error
from .estimate import BATCHED_METHODS
from .plan import BATCH, SINGLE, Batch, choose_slot, make_slots, split
from .validate import invalid_result

log = logging.getLogger("managed_solve")


class Recovery:
    """The runner's failure paths (a base of :class:`.runner.Runner`, on its state)."""

    systems: list
    plan: Any
    manager: Any
    cond: Any
    devices: list
    by_name: dict
    queued_seconds: dict
    next_id: int
    batch_bytes: Any

    def deliver(self, i: int, res: SolveResult) -> None:  # the runner's
        raise NotImplementedError

    def recover(self, b: Batch, dev: Device, exc: BaseException) -> list[tuple[str, Batch]]:
        """Split a failed batch and send the halves elsewhere, finally to the CPU."""
        if isinstance(exc, Regroup):
            return self.regroup(b, dev, exc)
        # Device errors and plain RuntimeErrors (a driver or library failing
        # once) are retried on other devices, each device once, then the CPU.
        if not (is_device_error(exc) or type(exc) is RuntimeError):
            log.error("solve_many: batch %d on %s failed: %r", b.id, dev, exc)
            msg = (f"solve_many: solving on {dev} raised {type(exc).__name__}: {exc} "
                   "(not a device error, so not retried)")
            for i in b.indices:
                self.fail(i, dev, msg)
            return []
        log.info("solve_many: batch %d (%d systems) hit %s on %s; splitting and retrying elsewhere",
                 b.id, b.nsys, type(exc).__name__, dev)
        b.tried = b.tried | {str(dev)}
        with self.cond:
            halves = split(b, self.plan.estimates, next_id=self.next_id, batch_bytes=self.batch_bytes)
            self.next_id += len(halves)
        out = []
        for h in halves:
            slots = make_slots(self.devices, self.manager, busy=self.queued_seconds)
            target = choose_slot(h, slots)
            name = target.name if target is not None else str(self.manager.cpu)
            if name in h.tried:
                msg = (f"solve_many: {type(exc).__name__} on every device tried "
                       f"({', '.join(sorted(h.tried))}): {exc}")
                for i in h.indices:
                    self.fail(i, dev, msg)
                continue
            with self.cond:
                speed = self.manager.speed(self.by_name[name])
                self.queued_seconds[name] = self.queued_seconds.get(name, 0.0) + h.cost / speed
            out.append((name, h))
        return out

    def fail(self, i: int, dev: Device, msg: str) -> None:
        s = self.systems[i]
        self.deliver(i, SolveResult(None, Status.DEVICE_ERROR, device=str(dev), message=msg,
                                     name=s.name if s is not None else None))

    def regroup(self, b: Batch, dev: Device, exc: Regroup) -> list[tuple[str, Batch]]:
        """A deferred batch of several methods: its invalid systems delivered, one batch per method.

        Returns the new batches, each with the device whose queue it joins;
        ``exc`` holds the systems of each method and those that failed.
        """
        for i, error in exc.bad:
            self.deliver(i, invalid_result(error, i, self.systems[i]))
        out = []
        for method, indices in exc.by_method.items():
            route = BATCH if method in BATCHED_METHODS else SINGLE
            group = (method, *b.group[1:]) if route == BATCH else (method, b.group[1])
            with self.cond:
                ests = [self.plan.estimates[i] for i in indices]
                for e in ests:
                    e.route, e.group = route, group
                sub = Batch(self.next_id, list(indices), route, group, sum(e.n for e in ests),
                            sum(e.nnz for e in ests), sum(e.nbytes for e in ests),
                            float(sum(e.cost for e in ests)), tried=b.tried)
                self.next_id += 1
            out.append((str(dev), sub))
        return out
