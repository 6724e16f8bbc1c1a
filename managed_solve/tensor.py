"""ManagedTensor: a torch.Tensor whose operations run on one device the manager picks.

The operands of one operation are brought to one device before it runs:

1. a pinned operand's device wins (two operands pinned to different devices
   is an error naming both);
2. an in-place operation (``add_``, ``out=``) runs where the tensor it writes
   lives, since moving that tensor would write into a copy;
3. otherwise the device already holding the most operand bytes, if the bytes
   that would move there fit; else where the :class:`DeviceManager` finds room.

Moves are out-of-place ``.to()`` copies, differentiable like any torch op, so
autograd records ordinary graphs: gradients flow back across devices and land
on each leaf's own device. (The bridgesign/managed prototype swapped
``.data`` in place, which torch rejects in backward for mixed devices; that
is why it needed ``pin()``. Here pinning is only for explicit control.)

Simulated GPUs (``sim:k``) have no torch device: their tensors live on the
CPU and carry the placement as :attr:`ManagedTensor.placement`, so placement
logic is testable on machines without GPUs.

Fast path: when every operand already sits on one device and none is pinned
elsewhere, the operation runs with no lock, no sizing and no manager call.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from . import _backend
from .device_args import resolve_device
from .devices import Device, warn_once
from .manager import DeviceManager, check_manager, default_manager

# Stored bytes of one tensor (sparse: values + indices). raw_size_of dispatches on the
# type's module name, which misses tensor subclasses, so the tensor sizer is used directly.
from .manager import tensor_bytes as raw_size_of

torch = _backend.torch_module()

log = logging.getLogger("managed_solve")

__all__ = ["ManagedTensor", "hold_reservation", "managed", "placement_of", "torch_device"]

_DisableSubclass = torch._C.DisableTorchFunctionSubclass
_Tensor = torch.Tensor
_base_to = torch.Tensor.to
_ATTR_FUNCS = ("__get__", "__set__", "__delete__")
_KIND_OP, _KIND_PLAIN, _KIND_ATTR = 0, 1, 2
# Functions that never compute on operands: no placement, plain torch behaviour.
_NO_PLACEMENT = frozenset({
    _Tensor.__repr__, _Tensor.__format__, _Tensor.__reduce_ex__,
    _Tensor.numel, _Tensor.dim, _Tensor.size, _Tensor.element_size,
    _Tensor.data_ptr, _Tensor.is_contiguous, _Tensor.register_hook, _Tensor.backward,
    _Tensor.storage_offset, _Tensor.stride, _Tensor.get_device, _Tensor.untyped_storage,
    _Tensor.__len__, _Tensor.__hash__, _Tensor.__bool__, _Tensor.item, _Tensor.tolist,
    _Tensor.numpy, _Tensor.__dlpack__, _Tensor.__dlpack_device__, _Tensor.as_subclass,
    _Tensor.requires_grad_, _Tensor.retain_grad, _Tensor.is_floating_point,
    _Tensor.is_complex, _Tensor.__array__,
})


_FUNC_KIND: dict = {}


def _func_kind(func: Any) -> int:
    """How __torch_function__ treats ``func`` (cached: one dict lookup per call after the first)."""
    if func in _NO_PLACEMENT:
        kind = _KIND_PLAIN
    elif getattr(func, "__name__", None) in _ATTR_FUNCS:
        kind = _KIND_ATTR
    else:
        kind = _KIND_OP
    try:
        _FUNC_KIND[func] = kind
    except TypeError:  # unhashable callables are classified every time
        pass
    return kind


def torch_device(device: Device | str | Any) -> Any:
    """The torch device holding tensors placed on ``device`` (``sim:k`` -> ``cpu``)."""
    name = str(device)
    if name.startswith("sim"):
        return torch.device("cpu")
    return torch.device(name)


def is_simulated_key(key: str | None) -> bool:
    return key is not None and key.startswith("sim")


def _is_managed_device_arg(dev: Any) -> bool:
    return isinstance(dev, Device) or (isinstance(dev, str) and dev.strip().lower().startswith("sim"))


#: What to do about a simulated device the tensor's manager lacks.
_TENSOR_FIX = ("name one of those, or give the tensor a manager that has it: "
               "managed(t, manager=DeviceManager(simulate='2x1GiB'))")


def simulated_name(device: Any, mgr: DeviceManager, *, call: str, fix: str = _TENSOR_FIX) -> str:
    """The manager's name of a simulated device argument (``"sim:1"``, ``"SIM:1"``, a Device).

    A simulated GPU exists only in a manager's inventory: its tensors sit on
    the CPU, so torch never checks the name. It is looked up as the manager
    looks up any device name, so an unknown one (``"sim:5"``, ``"simx"``)
    raises the manager's ValueError instead of labelling a tensor with a
    device nothing can run on.
    """
    return str(resolve_device(device, mgr.inventory, call=call, fix=fix))


def placement_of(t: Any) -> str:
    """Where a tensor lives for placement: ``"sim:1"``, ``"cuda:0"``, ``"cpu"``, ...

    Works for plain tensors too (their torch device).
    """
    with _DisableSubclass():
        dev = t.device
        sim = getattr(t, "_ms_sim", None)
    if sim is not None and dev.type == "cpu":
        return sim
    return str(dev)


def _placement_arg(device: Any) -> Any:
    """A device argument with a tensor read as where that tensor is placed (:func:`placement_of`).

    A simulated GPU's tensor lives on the CPU, so its torch ``.device`` says
    ``cpu``; every method of :class:`ManagedTensor` that takes a device
    reads a tensor given for one through this, so ``sim:1`` stays ``sim:1``.
    Anything else is returned as it is.
    """
    return placement_of(device) if isinstance(device, torch.Tensor) else device


def _collect(args: Any, kwargs: dict, out: list) -> None:
    # One level into lists and tuples covers torch.stack/cat and foreach ops;
    # deeper nesting never carries tensors in torch's API.
    for a in args:
        if isinstance(a, _Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, _Tensor):
                    out.append(b)
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, _Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, _Tensor):
                        out.append(b)


_PIN_KEYS: dict[str, Any] = {}


def _pin_key(pin: str) -> Any:
    """A pin ("cuda:0", "sim:1") in the form the fast path compares devices in.

    torch.device objects for real devices, the string for simulated ones:
    comparing them costs a dict lookup, where formatting ``str(t.device)``
    for every pinned operand of every operation cost about a microsecond.
    """
    key = _PIN_KEYS.get(pin)
    if key is None:
        key = pin if is_simulated_key(pin) else torch.device(pin)
        _PIN_KEYS[pin] = key
    return key


def _key(t: Any) -> tuple[str, str | None]:
    """(placement, pinned placement or None); call with subclass dispatch disabled."""
    dev = t.device
    sim = getattr(t, "_ms_sim", None)
    key = sim if (sim is not None and dev.type == "cpu") else str(dev)
    return key, getattr(t, "_ms_pin", None)


def _carried_manager(tensors: list) -> DeviceManager | None:
    """The first operand's own manager (:func:`managed` with ``manager=``), or None."""
    for t in tensors:
        m = getattr(t, "_ms_manager", None)
        if m is not None:
            return m
    return None


def _manager_of(tensors: list, cls: type) -> DeviceManager:
    return _carried_manager(tensors) or getattr(cls, "manager", None) or default_manager()


def _is_inplace(func: Any, kwargs: dict) -> bool:
    if kwargs and kwargs.get("out") is not None:
        return True
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or (name.startswith("__i") and name.endswith("__")):  # t[i] = v, __iadd__
        return True
    return name.endswith("_") and not name.endswith("__")


def _describe(t: Any, key: str) -> str:
    return f"tensor of shape {tuple(t.shape)} on {key}"


def _choose(func: Any, tensors: list, keys: list, kwargs: dict, cls: type) -> str:
    """The placement the operation runs on (slow path: operands disagree)."""
    pins = [(t, p) for t, (_k, p) in zip(tensors, keys, strict=True) if p is not None]
    pinned = {p for _t, p in pins}
    name = getattr(func, "__name__", repr(func))
    if len(pinned) > 1:
        (t0, p0), (t1, p1) = pins[0], next(tp for tp in pins if tp[1] != pins[0][1])
        raise RuntimeError(
            f"ManagedTensor {name}: operands are pinned to different devices: a "
            f"{_describe(t0, p0)} and a {_describe(t1, p1)}. Unpin one (tensor.unpin()) or move "
            "it explicitly with .to(device) before the operation."
        )
    if _is_inplace(func, kwargs):
        out = kwargs.get("out") if kwargs else None
        written = out if isinstance(out, _Tensor) else (
            out[0] if isinstance(out, (list, tuple)) and out else tensors[0])
        target = placement_of(written)
        if pinned and target not in pinned:
            p = next(iter(pinned))
            raise RuntimeError(
                f"ManagedTensor {name}: the in-place operation writes a {_describe(written, target)} "
                f"but another operand is pinned to {p}. Move the written tensor to {p} first, "
                "or unpin the other operand."
            )
        return target
    if pinned:
        return next(iter(pinned))
    by_key: dict[str, int] = {}
    sizes = []
    for t, (k, _p) in zip(tensors, keys, strict=True):
        n = raw_size_of(t)
        sizes.append(n)
        by_key[k] = by_key.get(k, 0) + n
    # Most bytes first; ties go to the first operand's device (deterministic).
    order = {k: i for i, (k, _p) in reversed(list(enumerate(keys)))}
    best = max(by_key, key=lambda k: (by_key[k], -order[k]))
    total = sum(sizes)
    moving = total - by_key[best]
    mgr = _manager_of(tensors, cls)
    if best.split(":")[0] in ("mps", "meta"):  # devices torch runs that no manager ledgers
        return best
    try:
        dev = mgr.get_device(best)
    except ValueError:  # a device this manager does not manage (meta, another GPU): trust torch
        return best
    if moving <= mgr.available_bytes(dev):
        return best
    chosen = mgr.find_device(total)
    log.info("managed_solve: %s: %d bytes do not fit on %s; running on %s", name, moving, best, chosen)
    return str(chosen)


def _move(x: Any, target: str, tdev: Any) -> Any:
    if isinstance(x, _Tensor):
        if _key(x)[0] == target:
            return x
        return _base_to(x, tdev)  # differentiable copy (no-op alias for sim -> cpu)
    if isinstance(x, (list, tuple)) and any(isinstance(b, _Tensor) for b in x):
        moved = [_move(b, target, tdev) for b in x]
        return type(x)(moved) if isinstance(x, tuple) and type(x) is tuple else (
            moved if isinstance(x, list) else type(x)(*moved))
    return x


def _wrap(t: Any, cls: type) -> Any:
    """``t`` as ``cls``, sharing memory and autograd history where torch allows."""
    try:
        return t.as_subclass(cls)
    except NotImplementedError:  # sparse layouts
        pass
    # torch cannot as_subclass sparse tensors; _make_subclass can but detaches,
    # so a sparse result that carries autograd history stays a plain tensor.
    if t.requires_grad:
        return t
    return torch.Tensor._make_subclass(cls, t, False)


def _label(ret: Any, sim: str | None, cls: type, mgr: DeviceManager | None = None) -> Any:
    """Wrap results as ``cls``, label CPU results with ``sim``, give those without a manager ``mgr``.

    Results keep their operands' manager: it knows the devices of their own moves (``.to("sim:1")``).
    """
    if isinstance(ret, _Tensor):
        if not isinstance(ret, cls):
            ret = _wrap(ret, cls)
            if not isinstance(ret, cls):
                return ret
        if sim is not None and ret.device.type == "cpu":
            ret._ms_sim = sim
        if mgr is not None and ret._ms_manager is None:
            ret._ms_manager = mgr
        return ret
    if isinstance(ret, (list, tuple)):
        items = [_label(r, sim, cls, mgr) for r in ret]
        if type(ret) is tuple:
            return tuple(items)
        if type(ret) is list:
            return items
        try:  # namedtuples (torch.return_types.max, ...)
            return type(ret)(items)
        except TypeError:
            return ret
    return ret


def _give_back(dev: Device, n: int) -> None:
    with dev._lock:
        dev.sim_used_bytes = max(0, dev.sim_used_bytes - n)


def account_placement(t: Any, dev_key: str, mgr: DeviceManager) -> None:
    """Count ``t``'s bytes on the simulated GPU ``dev_key``, and nowhere else, until it is freed.

    Real GPUs report their own free memory; a simulated one only knows what
    we tell it, so dispersal over ``sim:k`` devices sees earlier placements.
    Tensors placed explicitly are counted (``to``, ``pin``, ``cuda``, a
    ManagedModule's parameters and buffers), not results of operations. A
    tensor holds one count: moved in place (a module's ``.to`` keeps its
    parameter objects), it gives back what it counted where it was, and
    only gives back for a ``dev_key`` that is no simulated GPU (``"cpu"``).
    """
    try:
        dev = mgr.get_device(dev_key)
    except ValueError:
        dev = None
    if dev is not None and not dev.is_simulated:
        dev = None
    n = raw_size_of(t) if dev is not None else 0
    old = t.__dict__.pop("_ms_account", None)
    held = old.peek() if old is not None else None  # None once given back
    if held is not None:
        counted_on, counted = held[2]
        if counted_on is dev and counted == n:
            t.__dict__["_ms_account"] = old
            return
        old()  # gives back the old count now, once
    if dev is None:
        return
    with dev._lock:
        dev.sim_used_bytes += n
    t.__dict__["_ms_account"] = weakref.finalize(t, _give_back, dev, n)


class ManagedTensor(torch.Tensor):
    """A torch tensor whose operations run on one device chosen by a DeviceManager.

    Make one with ``torch.randn(3).as_subclass(ManagedTensor)`` or
    :func:`managed`. Results of operations on ManagedTensors are
    ManagedTensors; plain tensors mixed in are moved like any operand.

    Attributes
    ----------
    manager : DeviceManager or None
        Class-level manager; None means ``managed_solve.device_manager``. A
        tensor made by :func:`managed` with ``manager=`` carries its own, and so do its results.

    Examples
    --------
    >>> import torch
    >>> from managed_solve.manager import DeviceManager
    >>> from managed_solve.tensor import managed
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> a = managed(torch.ones(4), manager=dm).to("sim:0")
    >>> b = managed(torch.ones(1000), manager=dm).to("sim:1")
    >>> (a.sum() + b[:4]).placement       # most bytes are on sim:1
    'sim:1'
    >>> b.pin("sim:1").placement
    'sim:1'
    """

    manager: DeviceManager | None = None
    _ms_sim: str | None = None
    _ms_pin: str | None = None
    _ms_manager: DeviceManager | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        kind = _FUNC_KIND.get(func)
        if kind is None:
            kind = _func_kind(func)
        if kind == _KIND_PLAIN:
            with _DisableSubclass():
                return func(*args, **kwargs)
        if kind == _KIND_ATTR:
            with _DisableSubclass():
                ret = func(*args, **kwargs)
                # t.grad, t.data, t.T of a tensor on a simulated GPU stay there, with its manager.
                if isinstance(ret, _Tensor) and args and isinstance(args[0], _Tensor):
                    sim = getattr(args[0], "_ms_sim", None)
                    return _label(ret, sim if ret.device.type == "cpu" else None, cls,
                                  getattr(args[0], "_ms_manager", None))
            return ret
        tensors: list = []
        _collect(args, kwargs, tensors)
        with _DisableSubclass():
            # Fast path: every operand on one device, none pinned elsewhere. Keys
            # are torch.device objects (or a "sim:k" string) and are compared
            # without formatting; no lock, no sizing, no manager.
            first = None
            same = True
            for t in tensors:
                dev = t.device
                sim = getattr(t, "_ms_sim", None)
                k = sim if (sim is not None and dev.type == "cpu") else dev
                if first is None:
                    first = k
                elif k != first:
                    same = False
                    break
                pin = getattr(t, "_ms_pin", None)
                if pin is not None and _pin_key(pin) != k:
                    same = False
                    break
            if same:
                sim_target = first if isinstance(first, str) else None
            else:
                keys = [_key(t) for t in tensors]
                target = _choose(func, tensors, keys, kwargs, cls)
                tdev = torch_device(target)
                args = tuple(_move(a, target, tdev) for a in args)
                if kwargs:
                    kwargs = {k: _move(v, target, tdev) for k, v in kwargs.items()}
                sim_target = target if is_simulated_key(target) else None
            ret = func(*args, **kwargs)
            mgr = _carried_manager(tensors)
            if type(ret) is _Tensor and sim_target is None:  # the common case, inlined
                try:
                    ret = ret.as_subclass(cls)
                except NotImplementedError:  # sparse layouts
                    pass
                else:
                    if mgr is not None:
                        ret._ms_manager = mgr
                    return ret
            return _label(ret, sim_target, cls, mgr)

    # ------------------------------------------------------------------ copying
    def __deepcopy__(self, memo: dict) -> ManagedTensor:
        if id(self) in memo:
            return memo[id(self)]
        new = self.detach().clone()  # keeps the placement (also a simulated one)
        if self.requires_grad:
            new.requires_grad_()
        if self.grad is not None:
            new.grad = self.grad.detach().clone()
        for name in ("_is_param", "_ms_manager"):
            if name in self.__dict__:
                setattr(new, name, self.__dict__[name])  # the manager is shared, never copied
        memo[id(self)] = new
        counted = self.__dict__.get("_ms_account")
        if counted is not None and counted.alive:  # the copy takes as much room on the simulated GPU
            account_placement(new, new.placement, new._manager())
        if self._ms_pin is not None:
            new.pin(self._ms_pin)
        return new

    def __getstate__(self) -> dict:
        # Pickling (torch.save) keeps the placement label and pin, not the
        # manager, a reservation or a simulated GPU's count: they belong to this process.
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_ms_manager", "_ms_reservation", "_ms_account")}

    # ------------------------------------------------------------------ placement
    def _manager(self) -> DeviceManager:
        return self._ms_manager or type(self).manager or default_manager()

    @property
    def placement(self) -> str:
        """Where this tensor lives for placement (``"sim:1"`` for a simulated GPU)."""
        return placement_of(self)

    @property
    def managed_device(self) -> Device | None:
        """The manager's :class:`Device` this tensor lives on (None if it manages no such device)."""
        try:
            return self._manager().get_device(self.placement)
        except ValueError:
            return None

    @property
    def pinned(self) -> Device | None:
        """The device this tensor is pinned to, or None."""
        if self._ms_pin is None:
            return None
        mgr = self._manager()
        try:
            return mgr.pinned(self) or mgr.get_device(self._ms_pin)
        except ValueError:  # pinned by attribute to a device the manager does not know
            return None

    def pin(self, device: Device | str | torch.Tensor | None = None) -> ManagedTensor:
        """Pin to ``device`` (default: where it is): operations with it run there.

        ``device`` may be a tensor: where it is placed (``"sim:1"`` for a
        tensor on a simulated GPU, though torch holds it on the CPU). Returns
        this tensor when it is already on ``device``, else a pinned copy there
        (moves are out-of-place, as for ``.to()``).
        """
        if device is None:
            key = self.placement
        else:
            key = str(_placement_arg(device))
            if key == "cuda":
                key = "cuda:0"
            if is_simulated_key(key.strip().lower()):
                key = simulated_name(key, self._manager(), call="ManagedTensor.pin")
        t = self if key == self.placement else self.to(key)
        mgr = t._manager()
        try:
            mgr.pin(t, key)
        except ValueError:  # a real device this manager does not manage: pin by attribute only
            pass
        t._ms_pin = key
        return t

    def unpin(self) -> ManagedTensor:
        """Remove the pin (the tensor stays where it is)."""
        self._manager().unpin(self)
        self._ms_pin = None
        return self

    def to(self, *args, **kwargs) -> ManagedTensor:
        """``torch.Tensor.to``, also accepting managed devices (``"sim:1"``, a :class:`Device`).

        A tensor ``other`` goes where it is placed: ``to(other)`` takes its
        placement and dtype (torch's rule, with a simulated GPU's tensor's
        placement rather than the CPU torch holds it on), ``to(device=other)``
        its placement alone, as :meth:`pin` and :meth:`cuda` read one.
        """
        if args and isinstance(args[0], torch.Tensor):
            args = (_placement_arg(args[0]), args[0].dtype, *args[1:])
        if isinstance(kwargs.get("device"), torch.Tensor):
            kwargs = {**kwargs, "device": _placement_arg(kwargs["device"])}
        dev = kwargs.get("device", args[0] if args else None)
        if _is_managed_device_arg(dev):
            key = str(dev)
            if is_simulated_key(key.strip().lower()):
                key = simulated_name(dev, self._manager(), call="ManagedTensor.to")
            tdev = torch_device(key)
            if "device" in kwargs:
                kwargs = {**kwargs, "device": tdev}
            else:
                args = (tdev, *args[1:])
            if is_simulated_key(key):
                if key != self.placement:
                    kwargs = {**kwargs, "copy": True}  # a move is a copy, also sim -> sim
                with _DisableSubclass():
                    out = _base_to(self, *args, **kwargs)
                return self._placed(out, key)
            # A real device named by a Device object: torch's own rules from here.
        parsed = torch._C._nn._parse_to(*args, **kwargs)
        with _DisableSubclass():
            out = _base_to(self, *args, **kwargs)
            if parsed[0] is None:  # dtype/format change only: placement kept
                sim = self._ms_sim if out.device.type == "cpu" else None
                return self._placed(out, sim)
            if out is self:
                if self._ms_sim is None:
                    return self
                out = _base_to(self, *args, **{**kwargs, "copy": True})  # sim -> real cpu: a copy
        return self._placed(out, None)

    def _placed(self, out: Any, sim: str | None) -> ManagedTensor:
        """``out`` of :meth:`to` (every branch, dtype changes too): labelled, managed, counted on ``sim``."""
        out = _label(out, sim, type(self), self._ms_manager)
        if sim is not None and out is not self:
            account_placement(out, sim, self._manager())
        return out

    def cpu(self, memory_format: Any = None) -> ManagedTensor:
        """A copy on the host CPU (also from a simulated GPU)."""
        if memory_format is None:
            return self.to("cpu")
        return self.to("cpu", memory_format=memory_format)

    def cuda(self, device: Any = None, non_blocking: bool = False,
             memory_format: Any = None, *, disperse: bool = False) -> ManagedTensor:
        """Move to a GPU: ``device`` given is obeyed, else the manager chooses.

        Parameters
        ----------
        device : int, str, torch.device, Device or tensor, optional
            Where to go (a tensor: where it is placed). Default: the pinned
            device, else ``manager.find_device(bytes, disperse=disperse)``.
        disperse : bool
            Spread tensors over GPUs (earliest predicted finish) instead of
            packing them.

        Notes
        -----
        Without any GPU (real or simulated) the tensor stays on the CPU, with
        one :class:`~managed_solve.devices.DeviceWarning` per process saying why.
        """
        kw: dict = {"non_blocking": non_blocking}
        if memory_format is not None:
            kw["memory_format"] = memory_format
        if device is not None:
            if isinstance(device, int):
                device = f"cuda:{device}"
            return self.to(_placement_arg(device), **kw)
        mgr = self._manager()
        pinned = self._ms_pin
        if pinned is not None:
            return self.to(pinned, **kw)
        if not mgr.accelerators:
            log.info("managed_solve: ManagedTensor.cuda(): no GPU is managed here; the tensor stays on %s",
                     self.placement)
            why = _backend.cuda_probe()[1] or "the manager's devices include no GPU"
            warn_once("tensor-cuda",
                      f"managed_solve: ManagedTensor.cuda(): no GPU is managed here ({why}); the "
                      f"tensor stays on {self.placement}. Fix: install CuPy for your CUDA driver "
                      '(pip install "managed-solve[cuda12]" or [cuda13]), check `managed-solve '
                      "info`, or call .to('cpu') to say the CPU is intended.", stacklevel=3)
            return self
        # The bytes stay reserved in the manager's ledger while the moved tensor
        # lives, so the next .cuda(disperse=True) sees this one and goes elsewhere.
        r = mgr.reserve(mgr.size_of(raw_size_of(self)), disperse=disperse)
        out = self.to(r.device, **kw)
        hold_reservation(out, r)
        return out


def hold_reservation(obj: Any, reservation: Any) -> None:
    """Keep ``reservation`` until ``obj`` is garbage-collected (or released earlier)."""
    old = obj.__dict__.get("_ms_reservation")
    if old is not None:
        old.release()
    obj.__dict__["_ms_reservation"] = reservation
    weakref.finalize(obj, reservation.release)


def managed(tensor: Any, *, manager: DeviceManager | None = None) -> ManagedTensor:
    """``tensor`` as a :class:`ManagedTensor` sharing its memory (no copy).

    Parameters
    ----------
    tensor : torch.Tensor
    manager : DeviceManager, optional
        The manager placing operations on this tensor and its results' moves;
        default: the class's, else ``managed_solve.device_manager``.
        Results of operations on the tensor, and its copies, carry it too.

    Notes
    -----
    A leaf that requires grad (a weight) gives a leaf on the same memory, as
    ``nn.Parameter(t)`` does (a Parameter stays one): backward fills its own
    ``.grad``, optimizers take it. Any other tensor keeps its autograd history.

    Examples
    --------
    >>> import torch
    >>> from managed_solve.tensor import managed
    >>> t = managed(torch.arange(3.0))
    >>> type(t * 2).__name__
    'ManagedTensor'
    >>> w = managed(torch.ones(3, requires_grad=True))
    >>> (w * 2).sum().backward()
    >>> w.is_leaf, w.grad
    (True, ManagedTensor([2., 2., 2.]))
    """
    if not isinstance(tensor, _Tensor):
        raise TypeError(f"managed(tensor=...): expected a torch.Tensor, got {type(tensor).__name__}")
    if isinstance(tensor, ManagedTensor):
        t = tensor
    elif tensor.is_leaf and tensor.requires_grad:
        # as_subclass would record an alias of the leaf (a non-leaf whose .grad
        # stays None and that optimizers refuse); a leaf stays a leaf, on the same memory.
        t = _wrap(tensor.detach(), ManagedTensor).requires_grad_()
        if isinstance(tensor, torch.nn.Parameter):
            t._is_param = True  # as nn.Parameter marks a parameter of a tensor subclass
    else:
        t = _wrap(tensor, ManagedTensor)
    if not isinstance(t, ManagedTensor):
        raise TypeError(
            f"managed(tensor=...): a sparse ({tensor.layout}) tensor that requires grad cannot be "
            "wrapped without losing its autograd history; use it as a plain tensor (operations "
            "with ManagedTensors still place it, sized by its stored bytes)."
        )
    if check_manager(manager, "managed") is not None:
        t._ms_manager = manager
    return t
