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
the module never ends up split parameter by parameter: tensors added after
placement (assigned, ``register_buffer``, ``register_parameter``) join it.
On a simulated GPU its parameters and buffers count against the device's
free bytes while they are on it; moving the module gives them back.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from . import _backend
from .devices import Device
from .manager import DeviceManager, check_manager, default_manager
from .tensor import (
    ManagedTensor,
    account_placement,
    hold_reservation,
    is_simulated_key,
    managed,
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

    # A new layer or tensor, however it is added, marks the module: it is
    # converted and placed with the others at its next use (forward,
    # parameters(), buffers(), placement) or attribute read, once for many
    # additions (a module registering many tensors is not walked for each).
    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, (nn.Module, torch.Tensor)):
            self.__dict__["_ms_managed"] = False
        super().__setattr__(name, value)

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        super().register_buffer(name, tensor, persistent)
        self.__dict__["_ms_managed"] = False

    def register_parameter(self, name: str, param: Any) -> None:
        super().register_parameter(name, param)
        self.__dict__["_ms_managed"] = False

    def add_module(self, name: str, module: Any) -> None:  # register_module too
        super().add_module(name, module)
        self.__dict__["_ms_managed"] = False

    def __getattr__(self, name: str) -> Any:
        # Reached for what nn.Module keeps in its dicts (layers, parameters,
        # buffers). A missing name raises first: register_* ask hasattr about
        # the new name, which must not convert the module once per registration.
        value = super().__getattr__(name)
        if self.__dict__.get("_ms_managed", True) is False:
            self.manage()
            value = super().__getattr__(name)
        return value

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

        Called for you before the first forward, ``parameters()``, placement
        or attribute read after layers or tensors were added to this module
        (assigned, ``register_buffer``, ``register_parameter``,
        ``add_module``). Once the module was placed (``to``, ``cuda``,
        ``pin``), tensors added later join it there, pinned with it if it is
        pinned, so the module stays in one piece.
        """
        self.__dict__["_ms_managed"] = True
        mgr = self.__dict__.get("manager")
        done: dict[int, tuple] = {}  # a tensor held twice (tied weights) stays one tensor
        for sub in self.modules():
            for slots, convert in ((sub._parameters, _as_managed_param), (sub._buffers, managed)):
                for name, t in list(slots.items()):
                    if t is not None and not isinstance(t, ManagedTensor):
                        if id(t) not in done:
                            done[id(t)] = (t, convert(t))  # t held: its id is not reused meanwhile
                        slots[name] = done[id(t)][1]
            if mgr is not None:
                for t in [*sub._parameters.values(), *sub._buffers.values()]:
                    if t is not None:
                        t._ms_manager = mgr
        home = self.__dict__.get("_ms_place")
        if home is not None:
            self._gather(home)
        return self

    def _gather(self, home: str) -> None:
        """Bring tensors added after placement to ``home``, counted there, pinned as the module is."""
        if any(placement_of(t) != home for t in self._own_tensors()):
            self._move(home)  # buffers moved are new objects, as nn.Module.to makes them
        else:
            self._account()
        mgr = self._manager()
        pin = mgr.pinned(self)
        if pin is not None:
            for t in self._own_tensors():
                t._ms_pin = str(pin)
                mgr.pin(t, pin)

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

    def _own_tensors(self) -> list:
        """The ManagedTensor parameters and buffers, each once, read without converting anything."""
        seen: dict[int, Any] = {}
        for sub in self.modules():
            for t in (*sub._parameters.values(), *sub._buffers.values()):
                if isinstance(t, ManagedTensor):
                    seen.setdefault(id(t), t)
        return list(seen.values())

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

    def _place(self, key: str) -> ManagedModule:
        """Move every parameter, buffer and gradient to ``key`` (in place, as nn.Module.to)."""
        old = self.__dict__.pop("_ms_reservation", None)
        if old is not None:
            old.release()
        self.__dict__.pop("_ms_place", None)  # manage() converts without gathering anywhere
        self.manage()
        self._move(key)
        return self

    def _move(self, key: str) -> None:
        self.__dict__.pop("_ms_place", None)  # not re-read from stale labels by _apply
        self.__dict__["_ms_moving"] = True  # _apply's count would read the stale labels
        try:
            nn.Module.to(self, torch_device(key))
        finally:
            self.__dict__.pop("_ms_moving", None)
        sim = key if is_simulated_key(key) else None
        for t in self._own_tensors():
            # nn.Module.to swaps .data in place, so the objects keep stale labels: reset them.
            t._ms_sim = sim
            g = t.grad if t.is_leaf else None
            if g is not None:
                g._ms_sim = sim
        self._account()
        self.__dict__["_ms_place"] = key  # where tensors added later go (manage)

    def _account(self) -> None:
        """Count each tensor on the simulated GPU it is on now and on no other: the manager's ledger."""
        mgr = self._manager()
        for t in self._own_tensors():
            account_placement(t, placement_of(t), mgr)

    def _apply(self, *args: Any, **kwargs: Any) -> ManagedModule:
        # Every conversion of nn.Module (to, half, double, to_empty, ...) runs
        # through here: the ledger follows the bytes and the devices.
        super()._apply(*args, **kwargs)
        own = self._own_tensors()
        if own and "_ms_place" in self.__dict__:  # moved by nn.Module itself (to_empty): home follows
            self.__dict__["_ms_place"] = placement_of(own[0])
        if not self.__dict__.get("_ms_moving"):  # a move counts once, after its labels are set
            self._account()
        return self

    def to(self, *args: Any, **kwargs: Any) -> ManagedModule:
        """``nn.Module.to``, also accepting managed devices (``"sim:1"``, a :class:`Device`).

        A tensor given for the device means where it is placed (``sim:1``
        for a tensor on a simulated GPU, though torch holds it on the CPU) and
        its dtype, as ``ManagedTensor.to`` reads one.
        """
        if args and isinstance(args[0], torch.Tensor):
            args = (placement_of(args[0]), args[0].dtype, *args[1:])
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
            nn.Module.to(self, *rest, **kwargs)  # dtype, non_blocking
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
