"""Device arguments read one way: ``"cuda:1"``, ``"all"``, ``2``, a Device, a torch.device, lists.

Every public call that takes a device (``solve(device=)``, ``Solver``,
``solve_many(devices=)``, the sharded solves, ``DeviceManager.get_device``)
turns it into Devices of a manager here, so they accept the same names and
word their errors alike: the call and argument, what arrived, the fix. What a
caller then requires of the devices (GPUs only, each once) stays with it.
The name grammar itself is :func:`managed_solve.devices.parse_device_name`.

The DeviceManager's other arguments (seconds, byte counts, its settings) are
checked here too, where the call is made, so the error names the argument
rather than the arithmetic that would go wrong later (a NaN timeout waits
forever, a negative byte count widens a device's room).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from . import _backend
from .devices import Device, discover_cuda, is_cuda_kind, parse_device_name

__all__ = ["NOT_MANAGED_FIX", "cuda_ordinal", "device_list", "manager_settings", "resolve_device",
           "resolve_devices", "seconds_arg", "seconds_per_item", "timeout_arg", "work_args"]


def cuda_ordinal(device: Any, *, what: str = "device") -> int | None:
    """The CUDA GPU ``device`` names, or None when it names the host.

    ``device`` is a Device, a name (``"cuda:1"``, ``"gpu"``, ``"cpu"``,
    ``"sim:0"``, ``"mps"``) or anything whose str() is one (a
    ``torch.device``). Simulated GPUs compute on the host, so they give None.
    It answers the question code off the backend asks of a device argument:
    do the arrays go to a GPU, and to which.

    Examples
    --------
    >>> cuda_ordinal("cuda:1"), cuda_ordinal("sim:1"), cuda_ordinal("cpu")
    (1, None, None)
    """
    if isinstance(device, Device):
        return device.index if device.is_cuda else None
    kind, idx = parse_device_name(str(device), what=what)
    return idx if is_cuda_kind(kind) else None


def _where(call: str | None, arg: str, spec: Any = ...) -> str:
    """The head of a message: ``solve(device='sim:7')``, ``solve_many(devices=...)``."""
    shown = "..." if spec is ... else repr(spec)
    return f"{call}({arg}={shown})" if call else f"{arg}={shown}"


def _item_name(item: Any, where: str, position: int | None) -> str:
    """The device name of one item: a Device, a name, or anything whose str() is a name."""
    if isinstance(item, (Device, str)):
        return str(item).strip()
    name = str(item)
    try:
        parse_device_name(name, what="device")
    except ValueError:
        which = f"item {position}, " if position is not None else ""
        raise TypeError(
            f"{where}: {which}{item!r} ({type(item).__name__}), names no device "
            "managed_solve can use; pass Device objects (managed_solve.devices.discover()), "
            "names such as 'cuda:0' or 'cpu', or torch.device objects."
        ) from None
    return name


def device_list(devices: Any, *, what: str = "devices") -> list:
    """``devices=`` as a list of Devices and device names; anything whose str() is a name counts.

    A ``torch.device("cuda:1")`` prints as ``cuda:1``, so it is accepted by its
    name, as is a single device given without a list.

    Raises
    ------
    TypeError
        An item whose str() is no device name; the message names ``what``.
    """
    items = list(devices) if isinstance(devices, Iterable) and not isinstance(devices, str) else [devices]
    for i, d in enumerate(items):
        _item_name(d, what, i)
    return items


#: What to do about a device name the inventory lacks.
NOT_MANAGED_FIX = ("name one of those, or pass manager=DeviceManager(devices=[...]) that has it "
                   "(DeviceManager(simulate='2x1GiB') for simulated GPUs)")


def resolve_device(spec: Any, inventory: Sequence[Device], *, call: str | None, arg: str = "device",
                   fix: str = NOT_MANAGED_FIX, as_given: bool = False,
                   any_cuda: bool = False) -> Device:
    """The Device of ``inventory`` that ``spec`` names (a Device, ``"cuda:1"``, a torch.device).

    With :func:`resolve_devices`, the one reading of a device argument:
    ``solve``, ``Solver``, ``solve_many``, the sharded solves and
    ``DeviceManager.get_device`` accept the same names and word their errors
    alike. Names: ``"cpu"``, ``"cuda"`` (``cuda:0``), ``"cuda:1"``,
    ``"gpu:1"``, ``"sim:0"``, ``"mps"`` (the CPU); anything whose str() is one.

    Parameters
    ----------
    inventory : sequence of Device
        Where names are looked up: a manager's devices and its CPU.
    call, arg : str
        The call and argument the user wrote; every message starts with them.
    fix : str
        What to do about a name ``inventory`` lacks.
    as_given : bool
        Use a Device object as it is, in ``inventory`` or not (the caller's
        explicit choice runs unreserved); otherwise it must be in ``inventory``.
    any_cuda : bool
        A CUDA GPU named but outside ``inventory`` is found by discovery when
        this process can use it; a name found nowhere then raises
        RuntimeError (a device this process cannot use), not ValueError.

    Raises
    ------
    TypeError
        ``spec`` names no device (an int, a float).
    ValueError
        An unreadable name, or one ``inventory`` lacks (the message lists it).

    Examples
    --------
    >>> from managed_solve.devices import discover
    >>> inv = discover(simulate="2x1GiB")
    >>> str(resolve_device("sim:1", inv, call="solve"))
    'sim:1'
    """
    return _find(spec, inventory, call=call, arg=arg, fix=fix, as_given=as_given,
                 any_cuda=any_cuda, position=None)


def resolve_devices(spec: Any, inventory: Sequence[Device], *, call: str | None, arg: str = "devices",
                    fix: str = NOT_MANAGED_FIX, as_given: bool = False,
                    any_cuda: bool = False) -> list[Device]:
    """The Devices of ``inventory`` that ``spec`` names, in order (one named twice appears twice).

    ``spec``: ``"all"`` (every GPU, real or simulated, of ``inventory``), an
    int ``k`` (its first ``k``), a comma-separated string, or one device or a
    sequence of them, each read as by :func:`resolve_device` (which see for
    the other parameters). An empty list, a count outside 1 to the number of
    GPUs or an unknown name is a ValueError, an item naming no device a
    TypeError, ``"all"`` without a GPU a RuntimeError.

    Examples
    --------
    >>> from managed_solve.devices import discover
    >>> inv = discover(simulate="3x1GiB")
    >>> [str(d) for d in resolve_devices(2, inv, call="solve_sharded")]
    ['sim:0', 'sim:1']
    >>> [str(d) for d in resolve_devices("sim:2, cpu", inv, call="solve_many")]
    ['sim:2', 'cpu']
    """
    gpus = [d for d in inventory if d.is_gpu]
    if isinstance(spec, str) and spec.strip().lower() == "all":
        if not gpus:
            raise RuntimeError(
                f"{_where(call, arg, 'all')}: no GPU (real or simulated) is available here. "
                "Solve on the CPU with device='cpu', or simulate GPUs with "
                "MANAGED_SOLVE_SIMULATE='2x1GiB' / DeviceManager(simulate='2x1GiB')."
            )
        return gpus
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if not 1 <= spec <= len(gpus):
            raise ValueError(
                f"{_where(call, arg, int(spec))}: expected between 1 and {len(gpus)} (the GPUs "
                f"available: {[str(d) for d in gpus]}); pass {arg}='all' for every one."
            )
        return gpus[: int(spec)]
    if isinstance(spec, str):
        items = [s for s in spec.split(",") if s.strip()]
    elif isinstance(spec, Device):
        items = [spec]
    elif isinstance(spec, Iterable):
        items = list(spec)
    else:
        try:  # one device given without a list (a torch.device)
            _item_name(spec, _where(call, arg, spec), None)
        except TypeError:
            raise TypeError(
                f"{_where(call, arg, spec)}: expected 'all', a number of GPUs, a device name such "
                "as 'cuda:0', a Device, or a list of these such as ['cuda:0', 'cuda:1']."
            ) from None
        items = [spec]
    if not items:
        raise ValueError(
            f"{_where(call, arg, spec)}: the list is empty; give at least one device, e.g. "
            f"{arg}=['cuda:0', 'cuda:1'] or {arg}='all'."
        )
    return [_find(d, inventory, call=call, arg=arg, fix=fix, as_given=as_given,
                  any_cuda=any_cuda, position=i) for i, d in enumerate(items)]


def _find(item: Any, inventory: Sequence[Device], *, call: str | None, arg: str, fix: str,
          as_given: bool, any_cuda: bool, position: int | None) -> Device:
    if isinstance(item, Device):
        if as_given:
            return item
        for d in inventory:
            if d is item:
                return d
    where = _where(call, arg) if position is not None else _where(call, arg, item)
    name = _item_name(item, where, position)
    kind, idx = parse_device_name(name, what=_where(call, arg))
    key = "cpu" if kind == "cpu" else f"{kind}:{idx}"
    for d in inventory:
        if str(d) == key:
            return d
    here = _where(call, arg, item if isinstance(item, (str, Device)) else name)
    if any_cuda and is_cuda_kind(kind):
        n, why = _backend.cuda_probe()
        if idx >= n:
            raise RuntimeError(f"{here}: no such CUDA GPU here ({n} usable{'; ' + why if why else ''}). "
                               f"Use {arg}='cpu' or {arg}=None.")
        for d in discover_cuda()[0]:
            if d.index == idx:
                return d
    have = ", ".join(str(d) for d in inventory)
    means = f" ({name.strip()!r} means {key})" if name.strip().lower() != key else ""
    raise (RuntimeError if any_cuda else ValueError)(
        f"{here}: {key}{means} is not managed here (devices: {have}); {fix}.")


# ---------------------------------------------------------------- manager arguments
def _real(value: Any) -> bool:
    """A plain real number: an int, a float or a numpy scalar; not a bool or a string."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def seconds_arg(value: Any, where: str, example: str) -> float:
    """``value`` as finite seconds >= 0, else an error naming ``where`` (``reserve(timeout=nan)``).

    NaN passes every ``< 0`` test and, as a wait, never ends; inf is no time a
    prediction can hold and overflows a lock's wait. Both are refused here,
    where the caller still sees which argument carried them.
    """
    if not _real(value):
        raise TypeError(f"{where}: expected a number of seconds >= 0, got {type(value).__name__}; "
                        f"e.g. {example}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{where}: expected a finite number of seconds >= 0; e.g. {example}")
    return float(value)


def timeout_arg(call: str, timeout: Any) -> float:
    """``timeout=`` of a call that waits for memory: finite seconds >= 0 (None is the caller's default)."""
    return seconds_arg(timeout, f"{call}(timeout={timeout!r})",
                       "timeout=1.0, or timeout=None for the manager's wait_timeout")


def work_args(call: str, nbytes: Any, seconds: Any, cost: Any) -> int:
    """``nbytes`` (returned as an int), ``seconds`` and ``cost`` of a placement, checked.

    Bytes must be >= 0, and seconds and cost None or finite and >= 0: they
    are summed into a device's room and predicted busy time, where one NaN
    makes every later comparison false and one negative value makes a busy
    device look idle.
    """
    if not _real(nbytes):
        raise TypeError(f"{call}(nbytes={nbytes!r}): expected a byte count, got "
                        f"{type(nbytes).__name__}; pass the bytes the work needs, an integer >= 0")
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"{call}(nbytes={nbytes!r}): expected a byte count >= 0; pass the bytes "
                         "the work needs, or 0 when it needs none")
    if seconds is not None:
        seconds_arg(seconds, f"{call}(seconds={seconds!r})", "seconds=1.5, or None to predict from the bytes")
    if cost is not None and not (_real(cost) and math.isfinite(cost) and cost >= 0):
        raise ValueError(f"{call}(cost={cost!r}): expected finite bytes streamed >= 0, e.g. "
                         "cost=1e9, or None to use the bytes")
    return int(nbytes)


def seconds_per_item(seconds: Any, n: int, *, call: str) -> None:
    """``seconds=`` of a call placing ``n`` items: None, or one finite time >= 0 per item."""
    if seconds is None:
        return
    if not isinstance(seconds, Sequence) or isinstance(seconds, str):
        raise TypeError(f"{call}(seconds={seconds!r}): expected a list of {n} predicted times, one "
                        "per item, or seconds=None to predict from the bytes")
    if len(seconds) != n:
        raise ValueError(f"{call}(seconds=...): {len(seconds)} times for {n} items; give one "
                         "predicted time per item, or seconds=None to predict from the bytes")
    for i, s in enumerate(seconds):
        seconds_arg(s, f"{call}(seconds[{i}]={s!r})", "seconds=[1.0, 2.5]")


def manager_settings(reserved: Any, wait_timeout: Any, simulate: Any, max_hints: Any) -> None:
    """The settings of ``DeviceManager(...)``, checked before any device is discovered."""
    if not _real(reserved):
        raise TypeError(f"DeviceManager(reserved={reserved!r}): expected a number, got "
                        f"{type(reserved).__name__}; a fraction in [0, 1), e.g. reserved=0.1")
    if not 0.0 <= reserved < 1.0:
        raise ValueError(f"DeviceManager(reserved={reserved}): expected a fraction in [0, 1), e.g. 0.1")
    seconds_arg(wait_timeout, f"DeviceManager(wait_timeout={wait_timeout!r})",
                "wait_timeout=1.0, or 0 to spill at once")
    if simulate is not None and not isinstance(simulate, str):
        raise TypeError(f"DeviceManager(simulate={simulate!r}): expected a string of GPU sizes with "
                        f"units, got {type(simulate).__name__}; e.g. simulate='2x1GiB' (two GPUs "
                        "of 1 GiB) or simulate='2GiB,1GiB'")
    # A negative bound made every hint trim pop from an empty table (KeyError in each solve).
    if not (isinstance(max_hints, (int, np.integer)) and not isinstance(max_hints, bool)) or max_hints < 0:
        raise (ValueError if _real(max_hints) else TypeError)(
            f"DeviceManager(max_hints={max_hints!r}): expected an integer >= 0 (the number of work "
            "signatures remembered; 0 keeps none), e.g. max_hints=4096")
