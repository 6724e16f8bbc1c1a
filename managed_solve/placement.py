"""Placement of one system: the device a name means, the reservation, the move there.

One home for device-name resolution of a single solve (``solve(device=...)``,
``Solver(device=...)``): a name the manager knows, else a CUDA GPU this
process can use, else the CPU.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _backend
from .devices import Device, parse_device_name
from .system import LinearSystem

log = logging.getLogger("managed_solve")


def named_device(device: Any, mgr: Any) -> Device:
    """The Device ``device`` names (a Device, "cpu", "cuda:1", "sim:0"), for one solve."""
    if isinstance(device, Device):
        return device
    kind, idx = parse_device_name(str(device), what="solve(device=...)")
    try:
        return mgr.get_device(device)
    except ValueError:
        pass
    if kind == "cuda":
        n, why = _backend.cuda_probe()
        if idx >= n:
            raise RuntimeError(
                f"solve(device={device!r}): no such CUDA GPU here ({n} usable"
                f"{'; ' + why if why else ''}). Use device='cpu' or device=None."
            )
        from .devices import discover_cuda

        for d in discover_cuda()[0]:
            if d.index == idx:
                return d
    if kind == "cpu":
        from .devices import cpu_device

        return cpu_device()
    raise RuntimeError(f"solve(device={device!r}): the manager has no such device "
                       f"({', '.join(str(d) for d in mgr.devices)}); pass manager=... or "
                       "device=None.")


def reserve_for(mgr: Any, nbytes: int, dev: Device | None, system: LinearSystem, method: str):
    """The manager's reservation for one solve (None for a device it does not manage)."""
    sig = (*system.signature[:3], method, system.kind)
    if dev is None:
        return mgr.reserve(nbytes, disperse=True, signature=sig, obj=system)
    try:
        return mgr.reserve(nbytes, dev, signature=sig)
    except ValueError:  # a device this manager does not manage: run unreserved
        return None
    except MemoryError as exc:  # the caller asked for this device: obey, but say so
        log.warning("managed_solve: solve(device=%s) runs beyond the ledger: %s", dev, exc)
        return None


def move_to(system: LinearSystem, dev: Device) -> LinearSystem:
    """``system`` with its arrays on ``dev`` (no copy when they lie there already)."""
    if dev.is_cuda:
        if system.device != str(dev):
            system = system.to(str(dev))
        return system
    return system if system.device == "cpu" else system.to("cpu")
