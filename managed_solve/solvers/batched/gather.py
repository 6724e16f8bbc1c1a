"""Systems already on a GPU packed into one batch by one kernel launch (``gather.cu``).

Copied slice by slice, each system costs a few small copies and index
shifts, each a kernel launch from Python: with hundreds of systems (torch
tensors or CuPy arrays a model produced) the launches cost more than the
bytes. The gather kernel reads every system's arrays through a table of
addresses and writes the batch's arrays in one pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ... import _backend

__all__ = ["gatherable", "pack_gather"]

THREADS, MAX_BLOCKS = 256, 4096
_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


_NAMES = tuple(f"ms_pack_gather<{t}, {i}, {o}>" for t in ("float", "double")
               for i in ("int", "long long") for o in ("int", "long long"))


@functools.cache
def _kernels(device_id: int) -> dict[str, Any]:
    source = Path(__file__).with_name("gather.cu").read_text(encoding="utf-8")
    return _backend.raw_kernels(device_id, source, {name: name for name in _NAMES})


def _on(a: Any, device_id: int, dtype: Any) -> bool:
    return (_backend.is_cupy_array(a) and a.device.id == device_id and a.dtype == dtype
            and a.flags.c_contiguous)


def gatherable(systems: Sequence[Any], device_id: int, dtype: Any) -> bool:
    """Whether :func:`pack_gather` takes the systems: every array on GPU ``device_id``, C-contiguous, of the batch's dtype, one index dtype."""
    if not systems:
        return False
    index = systems[0].A.indices.dtype
    if index not in (np.dtype(np.int32), np.dtype(np.int64)):
        return False
    for s in systems:
        A = s.A
        if not (_on(A.data, device_id, dtype) and _on(A.indices, device_id, index)
                and _on(A.indptr, device_id, index) and _on(s.b, device_id, dtype)
                and (s.x0 is None or _on(s.x0, device_id, dtype))):
            return False
    return True


def pack_gather(systems: Sequence[Any], offsets: np.ndarray, nnz_off: np.ndarray, *,
                device_id: int, dtype: Any, index_dtype: Any, x0: bool) -> tuple:
    """The batch's ``(indptr, indices, data, b, x0)`` on GPU ``device_id``, from :func:`gatherable` systems.

    ``offsets`` and ``nnz_off`` (length ``len(systems) + 1``) are the
    systems' first rows and first entries in the batch. ``x0``: also the
    batch's starting guess (zeros where a system has none); else None.
    """
    cp = _backend.cupy()
    count = len(systems)
    n, nnz = int(offsets[-1]), int(nnz_off[-1])
    dt, idt = np.dtype(dtype), np.dtype(index_dtype)
    src = np.dtype(systems[0].A.indices.dtype)

    def addresses(arrays: Any) -> np.ndarray:
        return np.fromiter((0 if a is None else a.data.ptr for a in arrays), np.uint64, count)

    table = np.concatenate([
        offsets.astype(np.int64).view(np.uint64), nnz_off.astype(np.int64).view(np.uint64),
        addresses(s.A.indptr for s in systems), addresses(s.A.indices for s in systems),
        addresses(s.A.data for s in systems), addresses(s.b for s in systems),
        addresses(s.x0 for s in systems)])
    kernel = _kernels(device_id)[f"ms_pack_gather<{_TYPES[dt]}, {_TYPES[src]}, {_TYPES[idt]}>"]
    with cp.cuda.Device(device_id):
        d = cp.asarray(table)
        c1 = count + 1
        parts = [d[:c1].view(np.int64), d[c1:2 * c1].view(np.int64)]
        parts += [d[2 * c1 + k * count:2 * c1 + (k + 1) * count] for k in range(5)]
        indptr = cp.empty(n + 1, dtype=idt)
        indices = cp.empty(nnz, dtype=idt)
        data = cp.empty(nnz, dtype=dt)
        b = cp.empty(n, dtype=dt)
        x = cp.empty(n, dtype=dt) if x0 else None
        blocks = max(1, min(MAX_BLOCKS, -(-max(n, nnz) // THREADS)))
        kernel((blocks,), (THREADS,), (np.int32(count), np.int64(n), np.int64(nnz), *parts,
                                       indptr, indices, data, b, x if x is not None else np.uint64(0)))
    return indptr, indices, data, b, x
