"""How ``solve_many``'s runner changes its queues while it runs, off the common path.

:class:`Adjustments` is one of :class:`.runner.Runner`'s bases and works on
the runner's queues, plan and manager:

- the rest of a plan arriving while the first part computes (a head start,
  :meth:`Adjustments.extend`);
- a batch that hit an out-of-memory or device error, split and its halves
  placed on other devices, finally on the CPU (:meth:`Adjustments.recover`);
  a system no device could take delivered with ``DEVICE_ERROR``; a batch of
  pinned systems split on its own device instead (:meth:`Adjustments.keep_pinned`);
- a batch that failed on one system's input, split on its device until that
  system is alone (:meth:`Adjustments.isolate`);
- a deferred batch whose systems need different methods, one batch per
  method (:meth:`Adjustments.regroup`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from ..devices import Device
from ..result import SolveResult, Status
from .errors import Regroup, is_device_error
from .estimate import BATCHED_METHODS
from .plan import BATCH, SINGLE, Batch, Plan, choose_slot, make_slots, report_spill, split
from .validate import invalid_result

log = logging.getLogger("managed_solve")


class Adjustments:
    """The runner's queue changes off the common path (a base of :class:`.runner.Runner`, on its state)."""

    systems: list
    plan: Any
    manager: Any
    cond: Any
    devices: list
    by_name: dict
    queued_seconds: dict
    next_id: int
    batch_bytes: Any

    more: bool
    outstanding: int
    queues: dict
    stagers: dict

    def deliver(self, i: int, res: SolveResult) -> None:  # the runner's
        raise NotImplementedError

    def stage_next(self, name: str) -> None:  # the runner's
        raise NotImplementedError

    def extend(self, plan: Plan | None) -> None:
        """Add the rest of the plan (None: nothing more comes) while the workers run.

        A worker computing a batch with nothing staged behind it gets its next
        batch staged at once, so its copy overlaps that compute.
        """
        with self.cond:
            if not self.more:
                raise RuntimeError("solve_many: internal error, a plan extended twice")
            self.more = False
            if plan is not None:
                self.plan.estimates.update(plan.estimates)
                self.plan.sharded.extend(plan.sharded)
                self.plan.oversized.extend(plan.oversized)
                self.next_id = max(self.next_id, plan.next_id)
                for name, q in plan.queues.items():
                    self.plan.queues.setdefault(name, []).extend(q)
                    self.queues.setdefault(name, deque()).extend(q)
                    self.outstanding += len(q)
                for s in plan.slots:
                    self.queued_seconds[s.name] = s.busy
            self.outstanding -= 1  # the part that was to come
            self.cond.notify_all()
        for name in list(self.stagers):
            self.stage_next(name)

    def recover(self, b: Batch, dev: Device, exc: BaseException) -> list[tuple[str, Batch]]:
        """Split a failed batch and send the halves elsewhere, finally to the CPU."""
        if isinstance(exc, Regroup):
            return self.regroup(b, dev, exc)
        # Device errors and plain RuntimeErrors (a driver or library failing
        # once) are retried on other devices, each device once, then the CPU.
        if not (is_device_error(exc) or type(exc) is RuntimeError):
            if isinstance(exc, Exception):
                return self.isolate(b, dev, exc)
            log.error("solve_many: batch %d on %s failed: %r", b.id, dev, exc)
            msg = (f"solve_many: solving on {dev} raised {type(exc).__name__}: {exc} "
                   "(not a device error, so not retried)")
            for i in b.indices:
                self.fail(i, dev, msg)
            return []
        if b.pin is not None:
            return self.keep_pinned(b, dev, exc)
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
            if target is None and isinstance(exc, MemoryError):  # a spill: said as the plan's are
                report_spill(self.manager, self.devices, h.nbytes)
            with self.cond:
                speed = self.manager.speed(self.by_name[name])
                self.queued_seconds[name] = self.queued_seconds.get(name, 0.0) + h.cost / speed
            out.append((name, h))
        return out

    def keep_pinned(self, b: Batch, dev: Device, exc: BaseException) -> list[tuple[str, Batch]]:
        """A batch of pinned systems that hit a device error: split on its device, never moved.

        A pinned object always goes to its device (``solve`` raises a
        ``MemoryError`` there rather than move it), so the halves stay there
        (smaller ones may fit) until one system is alone; that one comes back
        ``DEVICE_ERROR``, its message naming the device and the fix.
        """
        if b.nsys > 1:
            log.info("solve_many: batch %d (%d systems pinned to %s) hit %s; splitting it there",
                     b.id, b.nsys, dev, type(exc).__name__)
            with self.cond:
                halves = split(b, self.plan.estimates, next_id=self.next_id,
                               batch_bytes=self.batch_bytes)
                self.next_id += len(halves)
            return [(b.pin, h) for h in halves]
        why = str(exc).rstrip(".")
        self.fail(b.indices[0], dev, f"solve_many: {type(exc).__name__} on {dev}, where this system "
                                     f"is pinned (DeviceManager.pin): {why}. A pinned system is not "
                                     f"moved elsewhere: free memory on {dev}, or unpin it "
                                     "(manager.unpin) to let solve_many place it.")
        return []

    def isolate(self, b: Batch, dev: Device, exc: Exception) -> list[tuple[str, Batch]]:
        """A batch that failed on what one of its systems holds: that system alone gets the error.

        Validation cannot see everything a solve finds (a zero on the
        diagonal Jacobi divides by, a preconditioner MINRES finds
        indefinite); ``solve()`` raises such an error for its one system.
        Here the batch is split in halves, on the same device, until the
        failing system is alone; the others are solved. The failing system
        gets ``INVALID_INPUT`` for a ``ValueError`` or ``TypeError`` (what
        ``solve()`` raises for its input), else ``DEVICE_ERROR`` with the
        error.
        """
        if b.nsys > 1:
            log.info("solve_many: batch %d (%d systems) on %s raised %s; splitting it to find the "
                     "system", b.id, b.nsys, dev, type(exc).__name__)
            with self.cond:
                halves = split(b, self.plan.estimates, next_id=self.next_id,
                               batch_bytes=self.batch_bytes)
                self.next_id += len(halves)
            return [(str(dev), h) for h in halves]
        i = b.indices[0]
        if isinstance(exc, (ValueError, TypeError)):
            self.deliver(i, invalid_result(exc, i, self.systems[i]))
            return []
        log.error("solve_many: batch %d on %s failed: %r", b.id, dev, exc)
        self.fail(i, dev, f"solve_many: solving on {dev} raised {type(exc).__name__}: {exc} "
                          "(not a device error, so not retried)")
        return []

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
                            float(sum(e.cost for e in ests)), tried=b.tried, pin=b.pin)
                self.next_id += 1
            out.append((str(dev), sub))
        return out
