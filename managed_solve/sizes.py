"""Bytes an object occupies, and the bytes a placement reserves for it.

:func:`raw_size_of` sizes arrays, sparse matrices, torch tensors and
modules, sequences of these; torch is only asked about objects when it is
already imported. :func:`reserve_size` passes that through the package's
size heuristic (:meth:`managed_solve.manager.DeviceManager.size_of`).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np


def is_count(nbytes: Any) -> bool:
    """Whether ``nbytes`` is a byte count as given (a Python or NumPy integer, not a bool)."""
    return isinstance(nbytes, numbers.Integral) and not isinstance(nbytes, (bool, np.bool_))


def default_heuristic(size: int) -> int:
    """The default sizing rule: bytes plus a margin growing like sqrt(bytes)."""
    return size + int(1.5 * size**0.5)


def _package_setting(name: str, default: Any) -> Any:
    # Users set `managed_solve.USE_HEURISTIC = False` on the package itself, so the
    # value is read from the package module at call time (an upward lookup by
    # name through sys.modules, not an import, so no cycle).
    pkg = sys.modules.get("managed_solve")
    return getattr(pkg, name, default) if pkg is not None else default


def reserve_size(obj: Any) -> int:
    """Bytes to reserve for ``obj``: :func:`raw_size_of`, through the heuristic if enabled.

    ``managed_solve.USE_HEURISTIC`` and ``managed_solve.HEURISTIC_FUNCTION``
    are read at every call, so setting them takes effect at once.
    """
    size = raw_size_of(obj)
    if _package_setting("USE_HEURISTIC", True):
        size = int(_package_setting("HEURISTIC_FUNCTION", default_heuristic)(size))
    return size


def raw_size_of(obj: Any) -> int:
    """Bytes an object occupies: stored bytes for sparse data, never dense shape.

    Accepts ints (taken as bytes), NumPy/CuPy arrays, SciPy/cupyx sparse
    matrices, torch tensors (dense, sparse COO/CSR, meta), torch modules
    (parameters, buffers and as many bytes again for gradients), objects with
    ``nbytes`` (``LinearSystem``), and sequences of these.
    """
    if isinstance(obj, (bool, np.bool_)):
        raise TypeError(f"size_of(obj={obj}): expected bytes, an array, a tensor or a module")
    if isinstance(obj, numbers.Integral):  # NumPy integers too: a count, not a 0-d array
        if obj < 0:
            raise ValueError(f"size_of(obj={obj}): a byte count cannot be negative")
        return int(obj)
    if isinstance(obj, numbers.Real) and not isinstance(obj, np.ndarray):
        if not (obj >= 0 and math.isfinite(obj)):
            raise ValueError(f"size_of(obj={obj}): a byte count must be finite and >= 0")
        return int(obj)
    torch = sys.modules.get("torch")  # only sized as torch when torch is already in use
    if torch is not None and isinstance(obj, (torch.Tensor, torch.nn.Module)):
        return _torch_size(obj)  # subclasses (ManagedTensor) included
    if hasattr(obj, "parameters") and hasattr(obj, "buffers"):
        return _torch_size(obj)
    if hasattr(obj, "indptr") and hasattr(obj, "indices") and hasattr(obj, "data"):
        return int(obj.data.nbytes + obj.indices.nbytes + obj.indptr.nbytes)
    if hasattr(obj, "row") and hasattr(obj, "col") and hasattr(obj, "data"):
        return int(obj.data.nbytes + obj.row.nbytes + obj.col.nbytes)
    nb = getattr(obj, "nbytes", None)
    if nb is not None:
        return int(nb)
    if isinstance(obj, (list, tuple)):
        return sum(raw_size_of(o) for o in obj)
    raise TypeError(
        f"size_of(obj=...): cannot size a {type(obj).__name__}; pass a byte count, an array, "
        "a sparse matrix, a tensor, a module or a LinearSystem."
    )


def tensor_bytes(t: Any) -> int:
    """Bytes a torch tensor stores: values and indices for sparse layouts, elements for dense."""
    layout = str(getattr(t, "layout", "torch.strided"))
    if layout == "torch.sparse_coo":
        t = t.coalesce() if not t.is_coalesced() else t
        return int(t._values().numel() * t.element_size() + t._indices().numel() * 8)
    if layout in ("torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr", "torch.sparse_bsc"):
        comp = t.crow_indices() if layout in ("torch.sparse_csr", "torch.sparse_bsr") else t.ccol_indices()
        plain = t.col_indices() if layout in ("torch.sparse_csr", "torch.sparse_bsr") else t.row_indices()
        return int(
            t.values().numel() * t.element_size()
            + comp.numel() * comp.element_size()
            + plain.numel() * plain.element_size()
        )
    return int(t.numel() * t.element_size())


def _torch_size(obj: Any) -> int:
    if hasattr(obj, "parameters") and hasattr(obj, "buffers"):
        params = sum(tensor_bytes(p) for p in obj.parameters())
        grads = sum(tensor_bytes(p) for p in obj.parameters() if p.requires_grad)
        return params + grads + sum(tensor_bytes(b) for b in obj.buffers())
    return tensor_bytes(obj)
