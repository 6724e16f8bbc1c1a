"""Placement of one system: the device a name means, the reservation, the move there.

A single solve (``solve(device=...)``, ``Solver(device=...)``) reads its
device as every call does (:mod:`managed_solve.device_args`), obeying the caller's
explicit choice where this process can: a name the manager knows, else a
CUDA GPU this process can use.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from .device_args import NOT_MANAGED_FIX, resolve_device
from .devices import Device, caller_stacklevel
from .system import LinearSystem

log = logging.getLogger("managed_solve")


def named_device(device: Any, mgr: Any, *, call: str) -> Device:
    """The Device ``device`` names (a Device, "cpu", "cuda:1", "sim:0"), for one solve.

    The caller's explicit choice is obeyed where this process can: a Device
    object as given, a CUDA GPU the manager does not manage (it then runs
    unreserved); a name that is nowhere is a RuntimeError naming the fix.
    Errors name ``call``, the function the user called (``"solve"``,
    ``"Solver"``): ``Solver(device='tpu:0')``.
    """
    return resolve_device(device, mgr.inventory, call=call, arg="device",
                          fix=f"{NOT_MANAGED_FIX}; or device=None to let the manager choose",
                          as_given=True, any_cuda=True)


def pinned_input(mgr: Any, *objs: Any) -> Any:
    """The first of ``objs`` pinned with ``mgr`` (:meth:`DeviceManager.pin`), else None.

    A system the manager places goes where it is pinned, else where its
    matrix is, else where its right-hand side is. ``solve`` and ``Solver``
    ask it of the inputs as the caller gave them (a LinearSystem, its A, its
    b; else A, then b), then of the validated system, its A and its b;
    ``solve_many`` of each input as given: a pinned matrix is found even
    where validation converted it (a COO matrix, a torch tensor). A pin wins
    over where the arrays lie (an input on one GPU pinned to another moves
    there); an explicit ``device=`` wins over a pin (:func:`pin_placing`).
    """
    for obj in objs:
        if obj is not None and mgr.pinned(obj) is not None:
            return obj
    return None


def pin_placing(mgr: Any, device: Any, *objs: Any, call: str) -> Any:
    """The input among ``objs`` whose pin places a solve (:func:`pinned_input`), else None.

    An explicit ``device`` wins over a pin (None is returned), as
    ``solve_many(devices=)`` does; where it names another device than the
    pin's, :func:`warn_pin_passed_over` says so, naming ``call``.
    """
    obj = pinned_input(mgr, *objs)
    if obj is None or device is None:
        return obj
    pin = mgr.pinned(obj)
    used = named_device(device, mgr, call=call)
    if used != pin:
        shown = device if isinstance(device, str) else str(device)
        warn_pin_passed_over(f"{call}(device={shown!r})", f"an input (pinned to {pin})",
                             str(used), arg="device")
    return None


def warn_pin_passed_over(call: str, what: str, used: str, *, arg: str) -> None:
    """Warn that ``arg=`` (``device`` of solve and Solver, ``devices`` of solve_many) left out
    the device ``what`` is pinned to: the caller's explicit choice wins over a pin, but not
    silently, since a pin says where the caller wanted that input to run."""
    warnings.warn(f"{call}: {what} left out by {arg}=, so solved on {used} instead. Name the "
                  f"pinned device in {arg}= (or pass {arg}=None) to solve there, or unpin the "
                  "object (manager.unpin).", UserWarning, stacklevel=caller_stacklevel())


def reserve_for(mgr: Any, nbytes: int, dev: Device | None, system: LinearSystem, method: str,
                pinned: Any = None, call: str = "solve"):
    """The manager's reservation for one solve (None for a device it does not manage).

    Without ``dev`` the manager chooses, unless ``pinned`` (the input
    :func:`pinned_input` found pinned) is given: then its device, or a
    ``MemoryError`` naming the device and the fix. A ``dev`` that cannot give
    the bytes is used all the same, with a warning naming ``call``.
    """
    sig = (*system.signature[:3], method, system.kind)
    if dev is None:
        return mgr.reserve(nbytes, disperse=True, signature=sig,
                           obj=system if pinned is None else pinned)
    try:
        return mgr.reserve(nbytes, dev, signature=sig)
    except ValueError:  # a device this manager does not manage: run unreserved
        return None
    except MemoryError as exc:  # the caller asked for this device: obey, but say so
        log.warning("managed_solve: %s(device=%s) runs beyond the ledger: %s", call, dev, exc)
        return None


def block_passes(mgr: Any, dev: Device, reservation: Any, k: int,
                 column_bytes: int) -> tuple[int, Any]:
    """Columns a pass of a k-column block and the reservation of their extra bytes.

    A solver's reservation covers one right-hand side; a block's other
    columns need ``column_bytes`` each for as long as they are solved. Where
    the device cannot hold them all now, the block is solved in passes of as
    many columns as it can (at least one, then unreserved beyond the solver's
    own). Unmanaged devices (no ``reservation``) take the block whole.
    """
    if reservation is None or k <= 1:
        return k, None
    per = max(1, mgr.size_of(column_bytes))
    width = max(1, min(k, 1 + mgr.available_bytes(dev) // per))
    if width == 1:
        return 1, None
    try:
        return width, mgr.reserve((width - 1) * per, dev, timeout=0.0)
    except MemoryError as exc:  # taken since the look: one column a pass
        log.info("managed_solve: a block of %d columns solved one at a time (%s)", k, exc)
        return 1, None


def move_to(system: LinearSystem, dev: Device) -> LinearSystem:
    """``system`` with its arrays on ``dev`` (no copy when they lie there already)."""
    if dev.is_cuda:
        if system.device != str(dev):
            system = system.to(str(dev))
        return system
    return system if system.device == "cpu" else system.to("cpu")
