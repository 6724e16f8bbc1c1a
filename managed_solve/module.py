"""ManagedModule: a torch module placed as one piece by the DeviceManager.

Parameters and buffers are :class:`~managed_solve.tensor.ManagedTensor`
objects (parameters stay ``nn.Parameter``, so optimizers and ``state_dict``
work unchanged): inputs from any device are brought to the module's device
by the tensors' own placement rule: an operation runs where most of its
operand bytes are, so a batch larger than a layer's parameters pulls that
layer's computation to the batch's device (parameters copied, differentiably,
gradients landing back on the module's device). ``pin()`` the module to keep
every operation on its device. ``.cuda()`` sizes the whole module
(parameters, buffers and gradients) and asks the manager for one device;
the module never ends up split parameter by parameter.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from . import _backend
from .devices import Device
from .manager import DeviceManager, default_manager
from .placement import check_manager
from .tensor import (
    ManagedTensor,
    account_placement,
    hold_reservation,
    is_simulated_key,
    placement_of,
    raw_size_of,
    simulated_name,
    torch_device,
)

torch = _backend.torch_module()
nn = torch.nn

log = logging.getLogger("managed_solve")

__all__ = ["ManagedModule"]

_managed_classes: dict[type, type] = {}


def _as_managed_param(p: Any) -> Any:
    if isinstance(p, ManagedTensor):
        return p
    data = p.detach().as_subclass(ManagedTensor)  # shares memory with p
    return nn.Parameter(data, requires_grad=p.requires_grad)


def _device_key(dev: Any) -> str | None:
    """``"sim:1"``, ``"cuda:0"``, ``"cpu"`` for anything naming a device, else None (a dtype, ...)."""
    if isinstance(dev, Device):
        return str(dev)
    if isinstance(dev, int) and not isinstance(dev, bool):
        return f"cuda:{dev}"
    if isinstance(dev, str) and dev.strip().lower().startswith("sim"):
        return dev.strip().lower()
    if isinstance(dev, (str, torch.device)):
        try:
            d = torch.device(dev)
        except RuntimeError:
            return None
        return f"cuda:{d.index or 0}" if d.type == "cuda" else str(d)
    return None


#: What to do about a simulated device the module's manager lacks.
_MODULE_FIX = ("name one of those, or give the module a manager that has it: "
               "ManagedModule.from_module(m, manager=DeviceManager(simulate='2x1GiB'))")


class ManagedModule(nn.Module):
    """A module whose parameters and buffers are ManagedTensors, placed as a whole.

    Subclass it like ``nn.Module`` (parameters registered in ``__init__`` are
    converted on first placement or by :meth:`manage`), or wrap an existing
    module with :meth:`from_module`.

    Attributes
    ----------
    manager : DeviceManager or None
        The manager placing this module; None: ``managed_solve.device_manager``.

    Examples
    --------
    >>> import torch
    >>> from managed_solve.manager import DeviceManager
    >>> from managed_solve.module import ManagedModule
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> m = ManagedModule.from_module(torch.nn.Linear(4, 2), manager=dm)
    >>> type(m.weight).__name__, isinstance(m.weight, torch.nn.Parameter)
    ('ManagedTensor', True)
    >>> m.cuda().placement
    'sim:0'
    >>> m(torch.ones(1, 4)).placement      # a small CPU input goes to the module
    'sim:0'
    """

    manager: DeviceManager | None = None

    # ------------------------------------------------------------------ wrapping
    @classmethod
    def from_module(cls, module: Any, *, manager: DeviceManager | None = None) -> ManagedModule:
        """Make ``module`` (in place) a ManagedModule; returns it.

        Its class becomes a subclass of both its own class and ManagedModule,
        so ``forward``, attributes and ``state_dict`` keys are unchanged; its
        parameters and buffers become ManagedTensors sharing their memory.
        Build optimizers after wrapping: parameters are new ``nn.Parameter``
        objects (same storage).

        Parameters
        ----------
        module : torch.nn.Module
        manager : DeviceManager, optional
        """
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"ManagedModule.from_module(module=...): expected a torch.nn.Module, got "
                f"{type(module).__name__}"
            )
        check_manager(manager, "ManagedModule.from_module")  # before the module is changed
        if not isinstance(module, ManagedModule):
            base = type(module)
            sub = _managed_classes.get(base)
            if sub is None:
                sub = type(f"Managed{base.__name__}", (cls, base), {"__module__": base.__module__})
                _managed_classes[base] = sub
            module.__class__ = sub
        if manager is not None:
            module.manager = manager
        module.manage()
        return module

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (nn.Module, torch.Tensor)):
            self.__dict__["_ms_managed"] = False  # a new layer or tensor: convert on next use
        super().__setattr__(name, value)

    def _ensure_managed(self) -> None:
        if not self.__dict__.get("_ms_managed", False):
            self.manage()

    def named_parameters(self, *args: Any, **kwargs: Any):
        # Conversion happens before anyone (an optimizer) holds the parameter objects.
        self._ensure_managed()
        return super().named_parameters(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any):
        self._ensure_managed()
        return super().named_buffers(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._ensure_managed()
        return super().__call__(*args, **kwargs)

    def manage(self) -> ManagedModule:
        """Convert every parameter and buffer (all submodules) to ManagedTensors, in place.

        Called for you before the first forward, ``parameters()`` or placement
        after layers or tensors were assigned to this module.
        """
        self.__dict__["_ms_managed"] = True
        mgr = self.__dict__.get("manager")
        for sub in self.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and not isinstance(p, ManagedTensor):
                    sub._parameters[name] = _as_managed_param(p)
            for name, b in list(sub._buffers.items()):
                if b is not None and not isinstance(b, ManagedTensor):
                    sub._buffers[name] = b.as_subclass(ManagedTensor)
            if mgr is not None:
                for t in [*sub._parameters.values(), *sub._buffers.values()]:
                    if t is not None:
                        t._ms_manager = mgr
        return self

    def state_dict(self, *args: Any, **kwargs: Any):
        """``nn.Module.state_dict`` with plain tensors (same memory), so checkpoints load anywhere.

        ``torch.load(..., weights_only=True)`` refuses tensor subclasses, and a
        checkpoint should not need managed_solve to be read. With
        ``keep_vars=True`` the ManagedTensor parameters themselves are returned.
        """
        sd = super().state_dict(*args, **kwargs)
        if kwargs.get("keep_vars", False):
            return sd
        for k, v in sd.items():
            if isinstance(v, ManagedTensor):
                sd[k] = v.as_subclass(torch.Tensor)
        return sd

    def __deepcopy__(self, memo: dict) -> ManagedModule:
        # The manager is shared by the copy, never copied (it holds locks and
        # the process's ledger); a reservation belongs to the original only.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k == "_ms_reservation":
                continue
            new.__dict__[k] = v if k == "manager" else copy.deepcopy(v, memo)
        return new

    def _manager(self) -> DeviceManager:
        return self.__dict__.get("manager") or type(self).manager or default_manager()

    def _known(self, key: str, call: str) -> str:
        """``key`` as its manager names it; a simulated device it lacks raises its ValueError."""
        if is_simulated_key(key):
            return simulated_name(key, self._manager(), call=call, fix=_MODULE_FIX)
        return key

    def _tensors(self) -> list:
        return [*self.parameters(), *self.buffers()]

    # ------------------------------------------------------------------ placement
    @property
    def placement(self) -> str:
        """Where the module lives (``"sim:1"``, ``"cuda:0"``, ``"cpu"``; the first parameter's)."""
        for t in self._tensors():
            return placement_of(t)
        return "cpu"

    @property
    def managed_device(self) -> Device | None:
        try:
            return self._manager().get_device(self.placement)
        except ValueError:
            return None

    def _place(self, key: str, **kw: Any) -> ManagedModule:
        """Move every parameter, buffer and gradient to ``key`` (in place, as nn.Module.to)."""
        old = self.__dict__.pop("_ms_reservation", None)
        if old is not None:
            old.release()
        self.manage()
        nn.Module.to(self, torch_device(key), **kw)
        sim = key if is_simulated_key(key) else None
        mgr = self._manager()
        for t in self._tensors():
            # nn.Module.to swaps .data in place, so the objects keep stale labels: reset them.
            old = t.__dict__.get("_ms_sim")
            t._ms_sim = sim
            if sim is not None and old != sim:
                account_placement(t, sim, mgr)
        return self

    def to(self, *args: Any, **kwargs: Any) -> ManagedModule:
        """``nn.Module.to``, also accepting managed devices (``"sim:1"``, a :class:`Device`)."""
        if "device" in kwargs:
            key = _device_key(kwargs.pop("device"))
            rest = args
        else:
            key = _device_key(args[0]) if args else None
            rest = args[1:] if key is not None else args
        if key is not None:
            self._place(self._known(key, "ManagedModule.to"))
        else:
            self.manage()
        if rest or kwargs:
            nn.Module.to(self, *rest, **kwargs)  # dtype, non_blocking, a tensor's device and dtype
        return self

    def cpu(self) -> ManagedModule:
        return self._place("cpu")

    def cuda(self, device: Any = None, *, disperse: bool = False) -> ManagedModule:
        """Place the whole module on one GPU: ``device`` is obeyed, else the manager chooses.

        The manager sizes parameters, buffers and gradients together
        (``manager.size_of(module)``) and returns the pinned device, or
        ``find_device(bytes, disperse=disperse)``. Without any GPU the module
        stays where it is, with one log line.
        """
        if device is not None:
            return self.to(device)
        mgr = self._manager()
        pinned = mgr.pinned(self)
        if pinned is not None:
            return self._place(str(pinned))
        if not mgr.accelerators:
            log.info("managed_solve: ManagedModule.cuda(): no GPU is managed here; the module stays on %s",
                     self.placement)
            return self
        # Held while the module lives (or until it is placed again), so later
        # placements see it in the manager's ledger.
        r = mgr.reserve(self._planned_bytes(mgr), disperse=disperse)
        self._place(str(r.device))
        hold_reservation(self, r)
        return self

    def _planned_bytes(self, mgr: DeviceManager) -> int:
        """Parameters + gradients + buffers, through the manager's size heuristic."""
        raw = sum(raw_size_of(p) for p in self.parameters())
        raw += sum(raw_size_of(p) for p in self.parameters() if p.requires_grad)
        raw += sum(raw_size_of(b) for b in self.buffers())
        return mgr.size_of(raw)

    def pin(self, device: Device | str | None = None) -> ManagedModule:
        """Pin the module and every parameter and buffer to ``device`` (default: where it is).

        The module moves there first when needed (a module on the meta device
        is only pinned, for :meth:`DeviceManager.plan`).
        """
        mgr = self._manager()
        key = self.placement if device is None else _device_key(device)
        if key is None:
            raise TypeError(f"ManagedModule.pin(device={device!r}): expected a device such as 'cuda:1' or 'sim:0'")
        if device is not None:
            key = self._known(key, "ManagedModule.pin")
        on_meta = any(t.is_meta for t in self._tensors())
        if key != self.placement and not on_meta:
            self._place(key)
        else:
            self.manage()
        mgr.pin(self, key)
        for t in self._tensors():
            t._ms_pin = key
            mgr.pin(t, key)
        return self

    def unpin(self) -> ManagedModule:
        """Remove the pins of the module and of its parameters and buffers."""
        mgr = self._manager()
        mgr.unpin(self)
        for t in self._tensors():
            if isinstance(t, ManagedTensor):
                t.unpin()
        return self

    @property
    def pinned(self) -> Device | None:
        """The device the module is pinned to, or None."""
        return self._manager().pinned(self)
