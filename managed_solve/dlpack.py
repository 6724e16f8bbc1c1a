"""DLPack handoff between NumPy/CuPy arrays and torch tensors, without copies.

The only place (with tensor.py and module.py) that imports torch.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _backend

log = logging.getLogger("managed_solve")


def as_torch(array: Any):
    """A torch tensor sharing memory with a NumPy or CuPy array (same device, same pointer).

    CuPy arrays go through DLPack on the current stream (the consumer waits for
    the producer's queued work); NumPy arrays become CPU tensors with
    ``torch.from_numpy``.

    Examples
    --------
    >>> import numpy as np
    >>> from managed_solve.dlpack import as_torch
    >>> a = np.arange(3.0)
    >>> t = as_torch(a)
    >>> t.data_ptr() == a.ctypes.data
    True
    """
    torch = _backend.torch_module()
    if _backend.is_torch_tensor(array):
        return array
    if _backend.is_cupy_array(array):
        return torch.from_dlpack(array)
    import numpy as np

    if isinstance(array, np.ndarray):
        if not array.flags.writeable:
            array = array.copy()  # torch.from_numpy refuses read-only arrays
        return torch.from_numpy(array)
    raise TypeError(f"as_torch(array=...): expected a NumPy or CuPy array, got {type(array).__name__}")


def from_torch(tensor: Any):
    """A NumPy (CPU) or CuPy (CUDA) view of a torch tensor, or a SciPy/cupyx CSR for sparse CSR.

    A tensor that requires grad is detached (the view does not carry autograd).
    """
    from .system import _torch_sparse, _torch_to_array

    if not _backend.is_torch_tensor(tensor):
        raise TypeError(f"from_torch(tensor=...): expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.requires_grad:
        log.info("managed_solve: from_torch detached a tensor that requires grad (no copy made)")
    if str(tensor.layout) != "torch.strided":
        return _torch_sparse(tensor.detach(), call="from_torch(tensor)")
    return _torch_to_array(tensor, call="from_torch(tensor)", arg="tensor")
