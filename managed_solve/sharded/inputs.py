"""The arguments of a sharded solve, checked once: devices, matrix, vectors, gather target.

Every message names the call and the argument, says what was expected and
how to fix it (see STYLE: errors a user can act on).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import _backend
from ..device_args import resolve_devices as resolve_devices_of
from ..devices import Device
from ..manager import check_manager, default_manager

__all__ = ["as_vector", "device_of", "gather_target", "host_csr", "resolve_devices"]


def resolve_devices(devices: Any, *, manager: Any = None, call: str = "solve_sharded") -> list[Device]:
    """The list of accelerators a sharded solve runs on, validated.

    Parameters
    ----------
    devices : "all", int, or sequence of str / Device
        ``"all"``: every accelerator of the manager; an int ``k``: its first
        ``k``; a sequence: those devices (``["cuda:0", "cuda:1"]``, ``"sim:0"``
        or :class:`~managed_solve.devices.Device` objects).
    manager : DeviceManager, optional
        Resolves names (default: the package's default manager).

    Examples
    --------
    >>> from managed_solve.manager import DeviceManager
    >>> dm = DeviceManager(simulate="3x1GiB")
    >>> [str(d) for d in resolve_devices(2, manager=dm)]
    ['sim:0', 'sim:1']
    """
    if devices is None:
        raise ValueError(
            f"{call}(devices=None): name the devices to shard over, e.g. devices='all', "
            "devices=2 or devices=['cuda:0', 'cuda:1']."
        )
    # Device objects are the caller's choice, used as given; names are the manager's
    # (the default manager is not made for a list of Devices).
    given = isinstance(devices, (list, tuple)) and all(isinstance(d, Device) for d in devices)
    mgr = check_manager(manager, call) if manager is not None or given else default_manager()
    inventory = mgr.inventory if mgr is not None else []
    chosen = resolve_devices_of(devices, inventory, call=call, arg="devices", as_given=True)
    named = [str(d) for d in chosen]
    for i, dev in enumerate(chosen):
        if not dev.is_gpu:
            raise ValueError(
                f"{call}(devices={named!r}): {dev} is not a GPU; shards run on "
                "GPUs (real or simulated). For the CPU use solve(A, b, device='cpu')."
            )
        if dev in chosen[:i]:
            raise ValueError(f"{call}(devices={named!r}): {dev} appears twice; name each device once.")
    if len({d.kind for d in chosen}) > 1:
        raise ValueError(
            f"{call}(devices={named!r}): mixes real and simulated GPUs; shard over one kind only."
        )
    return chosen


def host_csr(A: Any, call: str) -> sp.csr_matrix:
    """``A`` as a square, non-empty SciPy CSR matrix on the host (sharing A's arrays where it can)."""
    if _backend.is_cupy_sparse(A):
        A = A.get()
    elif _backend.is_cupy_array(A):
        A = _backend.to_host(A)
    if sp.issparse(A):
        A = sp.csr_matrix(A)
    elif isinstance(A, np.ndarray) and A.ndim == 2:
        A = sp.csr_matrix(A)
    else:
        raise TypeError(
            f"{call}(A=...): got a {type(A).__name__}; expected a SciPy or cupyx sparse matrix "
            "or a 2-D array. Convert torch tensors with LinearSystem or .numpy() first."
        )
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{call}(A=...): A must be square, got shape {A.shape}.")
    if A.shape[0] == 0:
        raise ValueError(f"{call}(A=...): A is empty (shape {A.shape}); nothing to solve.")
    return A


def device_of(v: Any) -> Device | None:
    """The CUDA device a CuPy array lives on; None for host arrays."""
    if _backend.is_cupy_array(v):
        return Device("cuda", int(v.device.id), "", 0)
    return None


def as_vector(v: Any, n: int, call: str, name: str):
    """``v`` as a real vector of shape (n,) (NumPy or CuPy; a single column is accepted)."""
    if _backend.is_torch_tensor(v):
        raise TypeError(f"{call}({name}=...): got a torch tensor; pass a NumPy or CuPy array "
                        "(torch.Tensor.numpy() or cupy.from_dlpack).")
    if not _backend.is_cupy_array(v):
        v = np.asarray(v)
    if v.ndim == 2 and v.shape[1] == 1:
        v = v[:, 0]
    if v.shape != (n,):
        raise ValueError(f"{call}({name}=...): expected shape ({n},) to match A, got {v.shape}.")
    if v.dtype.kind not in "fiu":
        raise TypeError(f"{call}({name}=...): expected real numbers, got dtype {v.dtype}.")
    return v


def gather_target(device: Any, devices: Sequence[Device]) -> Device | None:
    """Where ``gather_to`` puts x: a shard's device, or the host ("cpu") as None-device."""
    if isinstance(device, Device):
        if device.kind == "cpu":
            return None
        return device
    name = str(device).strip().lower()
    if name in ("cpu", "host"):
        return None
    for d in devices:
        if str(d) == name:
            return d
    raise ValueError(
        f"solve_sharded(gather_to={device!r}): expected one of the shard devices "
        f"{[str(d) for d in devices]}, 'cpu', or False to leave x distributed."
    )

