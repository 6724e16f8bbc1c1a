"""Validation and property checks of inputs that lie on a GPU, one host read per pass.

Checked one property at a time with CuPy's reductions, a matrix on a GPU
costs a kernel and a synchronisation per property: the pattern's pointers,
its column range and order (CuPy's constructor and ``has_canonical_format``),
NaN and Inf in A and in b, then the auto policy's symmetry (a transpose and
three comparisons) and diagonal. Each synchronisation is tens of
microseconds on a busy host, so with hundreds of systems that lived on the
GPU already (torch tensors, CuPy arrays) the checks cost more than the
solves. The kernels in ``checks.cu`` read the arrays once and leave their
answers in a few words of device memory, read back in one copy:

- :func:`csr_structure`: the pattern of one matrix (pointers, column range,
  canonical order);
- :func:`nonfinite`: NaN or Inf in any of several arrays;
- :func:`symmetry_many`: the symmetry code and Gershgorin bounds of many
  matrices in one launch, the GPU twin of
  :func:`managed_solve.kernels.symmetry.csr_symmetry_gershgorin`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _backend

__all__ = ["FLAG_BAD_INDEX", "FLAG_BAD_INDPTR", "FLAG_NOT_CANONICAL", "csr_from_parts",
           "csr_structure", "nonfinite", "symmetry_many"]

#: Bits of the structure and symmetry flags (the MS_* constants of ``checks.cu``).
FLAG_BAD_INDPTR, FLAG_BAD_INDEX, FLAG_NOT_CANONICAL = 1, 2, 4
FLAG_MIRROR_MISSING, FLAG_NAN_DIAGONAL, FLAG_VALUES_DIFFER = 8, 16, 32

#: Threads per block; grid-stride kernels use at most MAX_BLOCKS blocks.
THREADS, MAX_BLOCKS = 256, 2048

_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


_NAMES = (*(f"ms_nonfinite<{t}>" for t in ("float", "double")),
          *(f"ms_csr_structure<{i}>" for i in ("int", "long long")),
          *(f"ms_symmetry_many<{i}, {t}>" for i in ("int", "long long")
            for t in ("float", "double")))


@functools.cache
def _kernels(device_id: int) -> dict[str, Any]:
    source = Path(__file__).with_name("checks.cu").read_text(encoding="utf-8")
    return _backend.raw_kernels(device_id, source, {name: name for name in _NAMES})


def _kernel(device_id: int, name: str) -> Any:
    return _kernels(device_id)[name]


def _blocks(count: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-count // THREADS)))


def _type(dtype: Any) -> str:
    t = _TYPES.get(np.dtype(dtype))
    if t is None:
        raise TypeError(f"no GPU check for dtype {np.dtype(dtype)}")
    return t


def csr_structure(indptr: Any, indices: Any, n: int) -> int:
    """The flags of one CSR pattern on a GPU (0: valid and canonical); one host read.

    ``FLAG_BAD_INDPTR``: the row pointers do not start at 0, decrease, or do
    not end at ``len(indices)``; ``FLAG_BAD_INDEX``: a column index outside
    ``[0, n)``; ``FLAG_NOT_CANONICAL``: some row's columns are not strictly
    increasing (unsorted, or duplicates).
    """
    cp = _backend.cupy()
    nnz = int(indices.shape[0])
    if indptr.dtype != indices.dtype:  # read both in the wider type: nothing wraps
        wide = max(indptr.dtype, indices.dtype, key=lambda d: d.itemsize)
        indptr, indices = indptr.astype(wide), indices.astype(wide)
    flags = cp.zeros(1, dtype=np.int32)
    kernel = _kernel(indptr.device.id, f"ms_csr_structure<{_type(indptr.dtype)}>")
    kernel((_blocks(max(n + 1, nnz)),), (THREADS,),
           (np.int64(n), np.int64(nnz), indptr, indices, flags))
    return int(flags.get()[0])  # sync: the one read of the pattern's checks


def nonfinite(arrays: Sequence[Any]) -> list[bool]:
    """For each 1-D float array on one GPU, whether it holds a NaN or an Inf; one host read for all."""
    cp = _backend.cupy()
    if not arrays:
        return []
    if len(arrays) > 30:
        raise ValueError("nonfinite: at most 30 arrays a call (one flag bit each)")
    flags = cp.zeros(1, dtype=np.int32)
    for k, a in enumerate(arrays):
        if a.size == 0:
            continue
        a = a if a.flags.c_contiguous else cp.ascontiguousarray(a)
        kernel = _kernel(a.device.id, f"ms_nonfinite<{_type(a.dtype)}>")
        kernel((_blocks(a.size),), (THREADS,), (np.int64(a.size), a, flags, np.int32(1 << k)))
    bits = int(flags.get()[0])  # sync: one read for every array
    return [bool(bits >> k & 1) for k in range(len(arrays))]


def csr_from_parts(data: Any, indices: Any, indptr: Any, n: int, *, canonical: bool) -> Any:
    """A cupyx CSR matrix over already checked arrays, without the constructor's own reads.

    CuPy's public constructor reads the pointers' ends back to the host and
    re-derives the index width (synchronisations); CuPy 14's ``_from_parts``
    takes checked arrays as they are. Older CuPy takes the public path.
    """
    sparse = _backend.sparse_module(_backend.cupy())
    if hasattr(sparse.csr_matrix, "_from_parts"):
        return sparse.csr_matrix._from_parts(data, indices, indptr, (n, n),
                                             has_canonical_format=canonical)
    A = sparse.csr_matrix((data, indices, indptr), shape=(n, n), copy=False)
    if canonical:
        A.has_canonical_format = True
    return A


def _decode(words: np.ndarray) -> np.ndarray:
    """The doubles behind ``ms_order`` words (its inverse)."""
    words = words.astype(np.uint64, copy=False)
    sign = np.uint64(1 << 63)
    bits = np.where(words & sign, words & ~sign, ~words)
    return bits.view(np.float64)


def _encode(x: float) -> np.uint64:
    b = np.array([x], dtype=np.float64).view(np.uint64)[0]
    return np.uint64(~b) if b >> np.uint64(63) else np.uint64(b | np.uint64(1 << 63))


def symmetry_many(mats: Sequence[Any], rel: float | None = None) -> list[tuple[int | None, tuple]]:
    """The symmetry code and Gershgorin bounds of cupyx CSR matrices on one GPU, one launch a dtype pair.

    For each matrix ``(code, (lo, hi, dmin, dmax))`` as
    :func:`managed_solve.kernels.symmetry.csr_symmetry_gershgorin` gives on
    the host: ``code`` is ``SYMMETRIC`` when every stored ``(i, j)`` has its
    mirror stored and each pair meets the symmetry rule of
    :mod:`managed_solve.kernels.symmetry` with ``rel`` (default each
    dtype's ``symmetry_rtol``), ``DIFFERENT_VALUES`` when some pair does not, and
    ``DIFFERENT_PATTERN`` when some mirror is not stored; None when a row's
    columns are not strictly increasing (the caller's general test
    decides), as for a matrix whose pointers and indices differ in type. The
    matrices must have valid patterns (:func:`csr_structure`) and at least
    one row.
    """
    from ..kernels.symmetry import DIFFERENT_PATTERN, DIFFERENT_VALUES, SYMMETRIC, symmetry_rtol

    cp = _backend.cupy()
    results: list[Any] = [None] * len(mats)
    groups: dict[tuple, list[int]] = {}
    for k, A in enumerate(mats):
        groups.setdefault((A.data.device.id, np.dtype(A.indptr.dtype), np.dtype(A.indices.dtype),
                           np.dtype(A.data.dtype)), []).append(k)
    for (dev, pdt, idt, ddt), members in groups.items():
        if pdt != idt:  # the kernel reads both with one index type: the general test decides
            continue
        group = [mats[k] for k in members]
        rows = np.fromiter((A.shape[0] for A in group), np.int64, len(group))
        per = -(-rows // THREADS)
        block_matrix = np.repeat(np.arange(len(group), dtype=np.int32), per)
        starts = np.zeros(len(group) + 1, dtype=np.int64)
        np.cumsum(per, out=starts[1:])
        block_row0 = (np.arange(int(starts[-1]), dtype=np.int64)
                      - np.repeat(starts[:-1], per)) * THREADS
        tables = np.concatenate([
            np.fromiter((A.indptr.data.ptr for A in group), np.uint64, len(group)),
            np.fromiter((A.indices.data.ptr for A in group), np.uint64, len(group)),
            np.fromiter((A.data.data.ptr for A in group), np.uint64, len(group)),
            rows.view(np.uint64)])
        init = np.zeros((len(group), 8), dtype=np.uint64)  # flags, lo, hi, dmin, dmax, unused
        init[:, 1] = init[:, 3] = _encode(np.inf)
        init[:, 2] = init[:, 4] = _encode(-np.inf)
        with cp.cuda.Device(dev):
            d_tables = cp.asarray(tables)
            d_blocks = cp.asarray(block_matrix)
            d_row0 = cp.asarray(block_row0)
            out = cp.asarray(init)
            m = len(group)
            kernel = _kernel(dev, f"ms_symmetry_many<{_type(idt)}, {_type(ddt)}>")
            kernel((len(block_matrix),), (THREADS,),
                   (d_blocks, d_row0, d_tables[:m], d_tables[m:2 * m], d_tables[2 * m:3 * m],
                    d_tables[3 * m:].view(np.int64),
                    np.float64(symmetry_rtol(ddt) if rel is None else rel), out))
            words = out.get()  # sync: one read for the group's matrices
        flags = words[:, 0]
        bounds = np.stack([_decode(words[:, c]) for c in (1, 2, 3, 4)], axis=1)
        for j, k in enumerate(members):
            f = int(flags[j])
            if f & FLAG_NOT_CANONICAL:
                continue
            if f & FLAG_MIRROR_MISSING:
                code = DIFFERENT_PATTERN
            else:
                code = DIFFERENT_VALUES if f & FLAG_VALUES_DIFFER else SYMMETRIC
            b = (float("nan"),) * 4 if f & FLAG_NAN_DIAGONAL \
                else tuple(float(v) for v in bounds[j])
            results[k] = (int(code), b)
    return results
