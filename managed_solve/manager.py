"""DeviceManager: a thread-safe ledger of reserved memory, placement, pinning, spill, hints.

The manager knows devices and predicted costs, never solvers. Placement is
deterministic (no random choice):

* ``disperse=True``: the device with the earliest predicted finish (work
  already reserved there plus this work, over the device's learned speed)
  among those where the bytes fit;
* ``disperse=False``: the device already holding the most reserved bytes where
  the bytes fit (pack), else the one with the most room.

Bytes fit on a device when they are at most
``min(total * (1 - reserved) - ledger, live free bytes)``: the ledger stops
two placements from promising the same memory, the live reading sees what
other processes and not-yet-released allocations hold.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import device_args as args
from . import hints as hints_file
from .device_args import device_list, resolve_device
from .devices import Device, discover, format_bytes, warn_spill
from .hints import Hint
from .sizes import is_count, reserve_size
from .sizes import tensor_bytes as tensor_bytes  # re-exported: manager.tensor_bytes

log = logging.getLogger("managed_solve")

_EMA = 0.5  # weight of the newest measurement in learned hints


@dataclass
class Prediction:
    """Predicted cost of a piece of work on one device."""

    seconds: float
    nbytes: int
    source: str  # "model" (size-based) or "measured" (from hints)
    iterations: int | None = None  # iterations the last solve of this kind took, if recorded


@dataclass
class Placement:
    """Where ``plan`` would put an item."""

    item: Any
    device: Device
    nbytes: int
    seconds: float
    spilled: bool = False


@dataclass
class _Ledger:
    reserved_bytes: int = 0
    busy_seconds: float = 0.0  # predicted seconds of work reserved and not released
    active: int = 0
    placed: int = 0  # cumulative
    predicted_total: float = 0.0  # cumulative predicted seconds
    measured_total: float = 0.0  # cumulative measured seconds (record(device=...))


class Reservation:
    """Bytes (and predicted seconds) held on a device until released.

    Use as a context manager; release happens on exit, also on exceptions.
    ``drawn`` of its bytes came from ``lender`` (:meth:`DeviceManager.lend`),
    ``own`` from the ledger; ``lent`` of them are drawn by reservations still
    held; ``refused`` counts the requests its ``lend`` block had refused.
    """

    def __init__(self, manager: DeviceManager, device: Device, nbytes: int, seconds: float,
                 signature: Any = None, lender: Reservation | None = None, drawn: int = 0):
        self.manager, self.device, self.signature, self.released = manager, device, signature, False
        self.nbytes, self.seconds = int(nbytes), float(seconds)
        self.lender, self.drawn, self.lent, self.refused = lender, int(drawn), 0, 0
        self.own = self.nbytes - self.drawn
        self._t0 = time.perf_counter()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False

    def release(self) -> None:
        """Return the bytes to the ledger (idempotent)."""
        self.manager._release(self)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"Reservation({self.device}, {format_bytes(self.nbytes)}, {state})"


class DeviceManager:
    """Knows the devices, reserves memory for placed work, places it, learns from it.

    Parameters
    ----------
    devices : list of Device, str or torch.device, optional
        Inventory to manage; default: :func:`managed_solve.devices.discover`
        (environment variables ``MANAGED_SOLVE_DEVICES``, ``MANAGED_SOLVE_SIMULATE``).
        Items other than :class:`Device` are found by name, so
        ``[torch.device("cuda:0"), "cpu"]`` works.
        The CPU is always kept as the spill target.
    reserved : float
        Fraction of each device's memory never promised to work (head room for
        libraries, fragmentation, other processes).
    wait_timeout : float
        Seconds ``reserve`` waits for a release when nothing fits, before
        spilling to the CPU: a finite number >= 0 (0 spills at once).
    hints_path : str, optional
        JSON file hints are loaded from (if it exists) and saved to by
        :meth:`save_hints`. A file that is not a valid hints file is ignored
        with a warning naming it and the problem, and the manager starts
        with no hints (the next save replaces the file).
    max_hints : int
        Bound on remembered work signatures (least recently used dropped); 0 keeps none.

    Examples
    --------
    >>> from managed_solve.manager import DeviceManager
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> with dm.reserve(100 << 20, disperse=True) as r:
    ...     str(r.device)
    'sim:0'
    """

    def __init__(self, devices: Sequence[Device | str] | str | None = None, *,
                 reserved: float = 0.1, wait_timeout: float = 0.0,
                 simulate: str | None = None, hints_path: str | None = None,
                 max_hints: int = 4096):
        args.manager_settings(reserved, wait_timeout, simulate, max_hints)
        if devices is None or isinstance(devices, str):
            inv = discover(devices, simulate=simulate)
        else:
            given = device_list(devices, what="DeviceManager(devices=...)")
            if not given:
                raise ValueError("DeviceManager(devices=[]): give at least one device, or None to discover")
            if all(isinstance(d, Device) for d in given):
                inv = given
            else:  # names, torch.device objects, or a mix with Devices: found by name
                inv = discover([str(d) for d in given], simulate=simulate)
        if not any(d.kind == "cpu" for d in inv):
            from .devices import cpu_device

            self._cpu = cpu_device()
        else:
            self._cpu = next(d for d in inv if d.kind == "cpu")
        self.devices: list[Device] = inv
        self.reserved = float(reserved)
        self.wait_timeout = float(wait_timeout)
        self.hints_path = hints_path
        self.max_hints = int(max_hints)
        self._cond = threading.Condition(threading.RLock())
        self._ledger: dict[Device, _Ledger] = {d: _Ledger() for d in [*inv, self._cpu]}
        self._speed: dict[str, float] = {str(d): d.bandwidth for d in [*inv, self._cpu]}
        self._hints: OrderedDict[str, Hint] = OrderedDict()
        self._pins: dict[int, tuple[Device, Any]] = {}
        self._lending = threading.local()  # per thread: the reservations it lends (lend)
        if hints_path:
            try:
                self.load_hints(hints_path)
            except FileNotFoundError:
                pass  # nothing learned yet; save_hints creates it
            except (OSError, ValueError) as exc:  # hints only speed placement up: never fatal
                warnings.warn(f"DeviceManager(hints_path={hints_path!r}): ignoring the hints file, "
                              f"starting with no hints ({exc})", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ inventory
    @property
    def accelerators(self) -> list[Device]:
        """The GPUs (real or simulated) work is dispersed over."""
        return [d for d in self.devices if d.is_gpu]

    @property
    def cpu(self) -> Device:
        return self._cpu

    @property
    def inventory(self) -> list[Device]:
        """Every device names are looked up in: the managed ones and the CPU, each once."""
        return self.devices if self._cpu in self.devices else [*self.devices, self._cpu]

    def get_device(self, device: Device | str) -> Device:
        """The managed :class:`Device` for ``"cuda:1"``, ``"cpu"`` or a Device."""
        return resolve_device(device, self.inventory, call=None)

    # ------------------------------------------------------------------ sizing
    def size_of(self, obj: Any) -> int:
        """Bytes to reserve for ``obj``: its stored size, through the heuristic if enabled.

        ``managed_solve.USE_HEURISTIC`` and ``managed_solve.HEURISTIC_FUNCTION``
        are read at every call (:func:`managed_solve.sizes.reserve_size`).
        """
        return reserve_size(obj)

    # ------------------------------------------------------------------ capacity
    def capacity(self, device: Device) -> int:
        """Bytes the manager may promise on a device: total less the reserved fraction."""
        return int(device.total_bytes * (1.0 - self.reserved))

    def available_bytes(self, device: Device) -> int:
        """Bytes a new reservation may take on ``device`` now."""
        with self._cond:
            led = self._ledger[device]
            return max(0, min(self.capacity(device) - led.reserved_bytes, device.free_bytes()))

    def speed(self, device: Device) -> float:
        """Learned throughput of a device, in cost units (bytes streamed) per second."""
        return self._speed[str(device)]

    def predicted_finish(self, device: Device, seconds: float = 0.0) -> float:
        with self._cond:
            return self._ledger[device].busy_seconds + seconds

    def plan_view(self, devices: Sequence[Device]) -> list[tuple[int, float, float]]:
        """``(available bytes, speed, predicted finish)`` of each device: a planner's one question.

        :meth:`available_bytes`, :meth:`speed`, :meth:`predicted_finish`, read in one hold of the ledger."""
        with self._cond:
            return [(self.available_bytes(d), self._speed[str(d)], self._ledger[d].busy_seconds)
                    for d in devices]

    # ------------------------------------------------------------------ hints
    def predict(self, signature: Any = None, *, nbytes: int = 0, cost: float | None = None,
                device: Device | str | None = None) -> Prediction:
        """Predicted seconds and peak bytes of a piece of work on a device.

        ``cost`` is the work in bytes streamed (for a Krylov solve: bytes per
        iteration times expected iterations); without measurements the time is
        ``cost / speed(device)``. A signature recorded before overrides it with
        the measured time (scaled to the device's speed) and raises ``nbytes``
        to the measured peak.
        """
        nbytes = args.work_args("predict", nbytes, None, cost)
        dev = self.get_device(device) if device is not None else (self.accelerators or [self._cpu])[0]
        if cost is None:
            cost = float(nbytes)
        key = _sig_key(signature) if signature is not None else None
        with self._cond:
            hint = self._hints.get(key) if key is not None else None
            if hint is not None:
                self._hints.move_to_end(key)
                scale = self._speed.get(hint.device, self._speed[str(dev)]) / self._speed[str(dev)]
                return Prediction(hint.seconds * scale, max(int(nbytes), hint.peak_bytes), "measured",
                                  hint.iterations or None)
            return Prediction(float(cost) / self._speed[str(dev)], int(nbytes), "model")

    def record(self, signature: Any, seconds: float, peak_bytes: int = 0, *,
               device: Device | str | None = None, cost: float | None = None,
               iterations: int | None = None, device_seconds: float | None = None) -> None:
        """Learn from a finished piece of work.

        Updates the hint for ``signature`` (time, peak memory, and for an
        iterative solve its iteration count, which places the next solve's
        first convergence check) and, given the device and the work's
        ``cost``, that device's learned speed, which generalises to work never
        seen before.

        ``device_seconds``, when known (a GPU's own time for the work, from
        CUDA events), is what the speed is learned from; ``seconds`` (wall
        time) also holds host work and waits that do not depend on the device:
        on two identical GPUs fed by one process, wall times of small batches
        made one look half as fast as the other, and the next plan gave it
        half the work.
        """
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"record(seconds={seconds}): expected a finite time >= 0")
        if cost is not None and not (cost >= 0 and math.isfinite(cost)):
            raise ValueError(f"record(cost={cost}): expected finite bytes streamed >= 0, or None")
        if peak_bytes < 0:
            raise ValueError(f"record(peak_bytes={peak_bytes}): expected bytes >= 0")
        if device_seconds is not None and not (device_seconds >= 0 and math.isfinite(device_seconds)):
            raise ValueError(f"record(device_seconds={device_seconds}): expected a finite time >= 0 "
                             "or None")
        dev = self.get_device(device) if device is not None else None
        key = _sig_key(signature)
        with self._cond:
            hint = self._hints.get(key)
            dname = str(dev) if dev is not None else (hint.device if hint else str(self._cpu))
            its = int(iterations) if iterations else 0
            if hint is None:
                self._hints[key] = Hint(float(seconds), int(peak_bytes), 1, dname, its)
            else:
                hint.iterations = its or hint.iterations
                if hint.device != dname:  # rescale the old estimate to the new device
                    hint.seconds *= self._speed.get(hint.device, 1.0) / self._speed.get(dname, 1.0)
                    hint.device = dname
                hint.seconds = (1 - _EMA) * hint.seconds + _EMA * float(seconds)
                hint.peak_bytes = max(hint.peak_bytes, int(peak_bytes))
                hint.count += 1
                self._hints.move_to_end(key)
            while len(self._hints) > self.max_hints:
                self._hints.popitem(last=False)
            if dev is not None:
                self._ledger[dev].measured_total += float(seconds)
                busy = device_seconds if device_seconds else seconds
                if cost is not None and busy > 0:
                    observed = float(cost) / float(busy)
                    self._speed[str(dev)] = (1 - _EMA) * self._speed[str(dev)] + _EMA * observed

    def hints(self) -> dict[str, dict]:
        """A copy of the learned hints (signature -> seconds, peak_bytes, count, device)."""
        with self._cond:
            return {k: vars(h).copy() for k, h in self._hints.items()}

    def save_hints(self, path: str | None = None) -> None:
        """Write hints and learned device speeds to a JSON file, atomically.

        Readers (other processes too) see the old file or the new one, never
        a mix; a failed save leaves the old file intact (:mod:`managed_solve.hints`).
        """
        path = path or self.hints_path
        if not path:
            raise ValueError("save_hints(path=None): give a path or DeviceManager(hints_path=...)")
        with self._cond:
            hints = {k: Hint(**vars(h)) for k, h in self._hints.items()}
            speeds = dict(self._speed)
        hints_file.write(path, hints, speeds)

    def load_hints(self, path: str) -> None:
        """Read hints saved by :meth:`save_hints` (unknown devices' speeds are ignored).

        Raises
        ------
        ValueError
            Not a valid hints file (validated as a whole first); the message
            names the file and the first problem. The hints held are unchanged.
        """
        try:
            hints, speeds = hints_file.read(path)
        except ValueError as exc:
            raise ValueError(f"load_hints(path={path!r}): not a hints file written by save_hints: "
                             f"{exc}. Delete it, or save hints again to replace it.") from None
        with self._cond:
            self._hints.update(hints)
            for k, v in speeds.items():
                if k in self._speed:
                    self._speed[k] = v
            while len(self._hints) > self.max_hints:
                self._hints.popitem(last=False)

    # ------------------------------------------------------------------ pinning
    def pin(self, obj: Any, device: Device | str) -> Device:
        """Always place ``obj`` on ``device`` from now on."""
        dev = self.get_device(device)
        key = id(obj)
        try:
            ref = weakref.ref(obj, lambda _r, k=key: self._pins.pop(k, None))
        except TypeError:  # not weak-referenceable: hold it
            ref = obj
        with self._cond:
            self._pins[key] = (dev, ref)
        return dev

    def unpin(self, obj: Any) -> None:
        with self._cond:
            self._pins.pop(id(obj), None)

    @property
    def pins(self) -> list[Device]:
        """The devices of the objects pinned now (an object collected is unpinned with it)."""
        with self._cond:
            return [dev for dev, ref in self._pins.values()
                    if not isinstance(ref, weakref.ref) or ref() is not None]

    def pinned(self, obj: Any) -> Device | None:
        """The device ``obj`` is pinned to, or None."""
        with self._cond:
            entry = self._pins.get(id(obj))
        if entry is None:
            return None
        dev, ref = entry
        target = ref() if isinstance(ref, weakref.ref) else ref
        return dev if target is obj else None

    # ------------------------------------------------------------------ placement
    def _choose(self, nbytes: int, seconds: float | None, cost: float | None, disperse: bool,
                exclude: Iterable[Device | str], candidates: Sequence[Device] | None = None,
                ledger: dict[Device, _Ledger] | None = None) -> Device | None:
        excl = {str(e) for e in exclude}
        cands = [d for d in (candidates if candidates is not None else self.accelerators)
                 if str(d) not in excl]
        led = ledger if ledger is not None else self._ledger
        fits = []
        for d in cands:
            room = min(self.capacity(d) - led[d].reserved_bytes, d.free_bytes())
            if nbytes <= room:
                fits.append((d, room))
        if not fits:
            return None
        order = {str(d): i for i, d in enumerate(self.devices)}
        if disperse:
            def finish(dr):
                d, room = dr
                t = seconds if seconds is not None else (cost if cost is not None else nbytes) / self._speed[str(d)]
                return (led[d].busy_seconds + t, -room, order.get(str(d), 0))
            return min(fits, key=finish)[0]
        return min(fits, key=lambda dr: (-led[dr[0]].reserved_bytes, -dr[1], order.get(str(dr[0]), 0)))[0]

    def find_device(self, nbytes: int | Any = 0, *, disperse: bool = False,
                    exclude: Iterable[Device | str] = (), seconds: float | None = None,
                    cost: float | None = None, obj: Any = None) -> Device:
        """The device new work of ``nbytes`` should go to (nothing is reserved).

        A pinned ``obj`` goes to its pinned device. When no accelerator fits,
        the CPU is returned (the spill warned about once, see ``DeviceWarning``).
        """
        n = int(nbytes) if is_count(nbytes) else self.size_of(nbytes)
        n = args.work_args("find_device", n, seconds, cost)
        pinned = self.pinned(obj) if obj is not None else None
        with self._cond:
            if pinned is not None:
                return pinned
            dev = self._choose(n, seconds, cost, disperse, exclude)
        if dev is None:
            self._warn_spill(n)
            return self._cpu
        return dev

    def _warn_spill(self, n: int, verb: str = "placing on") -> None:
        """Log every spill; warn once per process when GPUs exist but none could take the work."""
        log.info("managed_solve: %s fit on no accelerator; %s the CPU", format_bytes(n), verb)
        if self.accelerators:
            warn_spill(n, {str(d): self.available_bytes(d) for d in self.accelerators})

    def reserve(self, nbytes: int | Any, device: Device | str | None = None, *,
                disperse: bool = True, exclude: Iterable[Device | str] = (),
                seconds: float | None = None, cost: float | None = None,
                signature: Any = None, timeout: float | None = None, obj: Any = None,
                spill: bool = True) -> Reservation:
        """Reserve memory on a device (given, pinned, or chosen) until released.

        Parameters
        ----------
        nbytes : int or object
            Bytes, or anything :meth:`size_of` can size.
        device : Device or str, optional
            Reserve there (error if it cannot give the bytes after waiting).
        disperse : bool
            Placement policy when ``device`` is None (see the module docstring).
        seconds, cost : float, optional
            Predicted time (or cost in bytes streamed) of the work, for dispersal.
        timeout : float, optional
            Seconds (finite, >= 0) to wait for a release when nothing fits; default ``wait_timeout``.
        spill : bool
            When nothing fits after waiting: True places on the CPU (warned once),
            False raises ``MemoryError``.

        Raises
        ------
        MemoryError
            A given or pinned device cannot give the bytes, or nothing fits and
            ``spill`` is False.
        """
        n = int(nbytes) if is_count(nbytes) else self.size_of(nbytes)
        n = args.work_args("reserve", n, seconds, cost)
        wait = self.wait_timeout if timeout is None else args.timeout_arg("reserve", timeout)
        target = self.get_device(device) if device is not None else (self.pinned(obj) if obj is not None else None)
        lender = self.lender(target) if target is not None else None
        deadline = time.monotonic() + wait
        with self._cond:
            # What a reservation this thread lends (lend) has left covers the request first.
            drawn = min(n, lender.nbytes - lender.lent) if lender and not lender.released else 0
            while True:
                if target is not None:
                    dev = self._choose(n - drawn, seconds, cost, True, (), candidates=[target])
                else:
                    dev = self._choose(n, seconds, cost, disperse, exclude)
                if dev is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, threading.TIMEOUT_MAX))  # a longer wait overflows
            if dev is None:
                if target is not None:
                    why = "pinned to" if device is None else "asked for"
                    if lender is not None:
                        lender.refused += 1
                    raise MemoryError(
                        f"reserve(nbytes={format_bytes(n)}): {why} {target}, which can give only "
                        f"{format_bytes(self.available_bytes(target) + drawn)} now. Free memory there, "
                        "unpin the object, or let the manager choose (device=None)."
                    )
                room = min(self.capacity(self._cpu) - self._ledger[self._cpu].reserved_bytes,
                           self._cpu.free_bytes())
                if not spill or n > room:
                    have = ", ".join(f"{d}: {format_bytes(self.available_bytes(d))}" for d in self.devices)
                    raise MemoryError(
                        f"reserve(nbytes={format_bytes(n)}): no device can give that much ({have}). "
                        "Split the work, wait for running work (timeout=...), or free memory."
                    )
                self._warn_spill(n, "spilling to")
                dev = self._cpu
            t = seconds if seconds is not None else (cost if cost is not None else n) / self._speed[str(dev)]
            t = 0.0 if drawn else t  # a draw is part of the lender's work, timed there
            led = self._ledger[dev]
            led.reserved_bytes += n - drawn
            led.busy_seconds += t
            led.active += 1
            led.placed += 1
            led.predicted_total += t
            if drawn:
                lender.lent += drawn
            return Reservation(self, dev, n, t, signature, lender if drawn else None, drawn)

    @contextmanager
    def lend(self, reservation: Reservation) -> Iterator[Reservation]:
        """A block in which this thread's reservations on its device draw on ``reservation``.

        Bytes held for a solve that reserves its own (``solve_many`` holds a
        system's, then ``solve()`` asks there) count once: a request in the
        block naming that device takes what ``reservation`` has not lent, the
        rest from the ledger (refused as usual, counted in ``refused``). A
        draw's bytes go back to it when released (on, once it is released).
        """
        held = self._lending.__dict__.setdefault("held", [])
        held.append(reservation)
        try:
            yield reservation
        finally:
            held.pop()

    def lender(self, device: Device | str) -> Reservation | None:
        """The innermost reservation this thread lends (:meth:`lend`) on ``device``, if any."""
        for r in reversed(getattr(self._lending, "held", ())):
            if r.device == device and not r.released:
                return r
        return None

    def grow(self, reservation: Reservation, nbytes: int) -> None:
        """Add ``nbytes`` from the ledger to a held reservation, at once or ``MemoryError``."""
        n = args.work_args("grow", nbytes, None, None)
        dev = reservation.device
        with self._cond:
            if reservation.released or self._choose(n, None, None, True, (), [dev]) is None:
                raise MemoryError(f"grow(nbytes={format_bytes(n)}): {dev} can give only "
                                  f"{format_bytes(self.available_bytes(dev))} now, to a "
                                  f"{'released' if reservation.released else 'held'} reservation.")
            self._ledger[dev].reserved_bytes += n
            reservation.nbytes += n
            reservation.own += n

    def _release(self, r: Reservation) -> None:
        with self._cond:
            if r.released:
                return
            r.released = True
            self._give_back(r, r.own + r.drawn - r.lent)  # what it lent stays with the draws
            led = self._ledger[r.device]
            led.busy_seconds = max(0.0, led.busy_seconds - r.seconds)
            led.active -= 1
            self._cond.notify_all()

    def _give_back(self, r: Reservation, k: int) -> None:
        """``k`` bytes ``r`` holds go back: its own to the ledger first, then those it drew."""
        own = min(k, r.own)
        r.own -= own
        self._ledger[r.device].reserved_bytes -= own
        if k > own:
            r.drawn -= k - own
            r.lender.lent -= k - own
            if r.lender.released:  # it kept them for r's draw alone: they go on back
                self._give_back(r.lender, k - own)

    def reserved_bytes(self, device: Device | str) -> int:
        with self._cond:
            return self._ledger[self.get_device(device)].reserved_bytes

    # ------------------------------------------------------------------ planning
    def plan(self, items: Any, *, disperse: bool = True,
             seconds: Sequence[float] | None = None) -> list[Placement] | Placement:
        """Where each item would go, in order, without reserving or allocating.

        Items are anything :meth:`size_of` sizes (a module built on the meta
        device is sized from shapes alone). Later items see the earlier ones'
        bytes and predicted time, as real reservations would.

        ``items`` is a list, tuple or iterator of items (returns a list of
        :class:`Placement`), or one item, such as a module (returns its
        :class:`Placement`).

        Examples
        --------
        >>> import torch
        >>> dm = DeviceManager(simulate="2x1GiB")
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(1024, 1024)
        >>> place = dm.plan(net)  # sized from shapes, nothing allocated
        >>> str(place.device), place.nbytes >= 2 * 4 * (1024 * 1024 + 1024)  # weights and gradients
        ('sim:0', True)
        """
        if not isinstance(items, (list, tuple, Iterator)):
            (one,) = self.plan([items], disperse=disperse, seconds=seconds)
            return one
        items = list(items)
        args.seconds_per_item(seconds, len(items), call="plan")
        with self._cond:
            ledger = {d: _Ledger(l.reserved_bytes, l.busy_seconds) for d, l in self._ledger.items()}
        out = []
        for i, item in enumerate(items):
            n = self.size_of(item)
            s = seconds[i] if seconds is not None else None
            pinned = self.pinned(item)
            dev = pinned or self._choose(n, s, None, disperse, (), ledger=ledger)
            spilled = dev is None
            dev = dev or self._cpu
            t = s if s is not None else n / self._speed[str(dev)]
            ledger[dev].reserved_bytes += n
            ledger[dev].busy_seconds += t
            out.append(Placement(item, dev, n, t, spilled))
        return out

    def report(self) -> str:
        """A text table: device, name, total, free, reserved, items placed, busy seconds."""
        rows = [("device", "name", "total", "free", "reserved", "placed", "pred. busy s", "meas. s")]
        with self._cond:
            for d in [*self.devices] + ([] if self._cpu in self.devices else [self._cpu]):
                led = self._ledger[d]
                try:
                    free = format_bytes(d.free_bytes())
                except Exception as exc:  # a device that stopped answering still gets a row
                    free = f"? ({type(exc).__name__})"
                rows.append((str(d), d.name[:28], format_bytes(d.total_bytes), free,
                             format_bytes(led.reserved_bytes), str(led.placed),
                             f"{led.predicted_total:.3g}", f"{led.measured_total:.3g}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"DeviceManager(devices={[str(d) for d in self.devices]}, reserved={self.reserved})"


def _sig_key(signature: Any) -> str:
    return signature if isinstance(signature, str) else repr(signature)


_default: DeviceManager | None = None
_default_lock = threading.Lock()


def default_manager() -> DeviceManager:
    """The process-wide manager (``managed_solve.device_manager``), made on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = DeviceManager()
        return _default


def check_manager(manager: Any, call: str) -> DeviceManager | None:
    """``manager=`` of a public call: a DeviceManager, or None (the default manager); returned as is.

    Anything else is refused here, naming the call and the argument, not later
    on a missing method (``manager="cpu"`` usually meant ``device="cpu"``).
    """
    if manager is not None and not isinstance(manager, DeviceManager):
        raise TypeError(
            f"{call}(manager={manager!r}): expected a DeviceManager or None (the default manager), "
            f"got {type(manager).__name__}. To choose a device pass device='cpu' or 'cuda:0'; "
            "to manage other devices pass manager=DeviceManager(devices=[...])."
        )
    return manager


def manager_or_default(manager: Any, call: str) -> DeviceManager:
    """The manager a call with ``manager=`` uses: the one given (checked), else :func:`default_manager`."""
    return check_manager(manager, call) or default_manager()


def set_default_manager(manager: DeviceManager | None) -> DeviceManager | None:
    """Replace the process-wide manager (None: rediscover on next use); returns the one replaced.

    The one replaced may be None (none made yet): giving it back restores
    the state exactly, which a test that swaps managers needs.
    """
    global _default
    with _default_lock:
        previous, _default = _default, manager
    return previous
