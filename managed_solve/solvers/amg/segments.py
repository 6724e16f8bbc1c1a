"""Array-module generic building blocks of the AMG set-up: row indices, row maxima, hashes.

Everything here runs unchanged on NumPy and on CuPy. The one operation the
two libraries spell differently, a maximum over the stored entries of each
CSR row, lives in :func:`row_max`: NumPy reduces contiguous segments with
``maximum.reduceat``; CuPy has no ``reduceat`` (nor ``maximum.at``), so a small
elementwise kernel walks each row's segment.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# splitmix64's constants: a bijection of 64-bit integers that mixes every bit.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def csr_rows(xp: Any, indptr: Any, nnz: int) -> Any:
    """The row index of every stored entry of a CSR matrix (its COO rows), as ``indptr``'s dtype."""
    if xp is np:  # one pass on the host; a search an entry is what parallelises on a GPU
        n = indptr.shape[0] - 1
        return np.repeat(np.arange(n, dtype=indptr.dtype), np.diff(indptr)[:n])[:nnz]
    k = xp.arange(nnz, dtype=indptr.dtype)
    return (xp.searchsorted(indptr, k, side="right") - 1).astype(indptr.dtype, copy=False)


def row_max(xp: Any, indptr: Any, rows: Any, values: Any, empty: float) -> Any:
    """``max(values[indptr[i]:indptr[i + 1]])`` for every row ``i``; ``empty`` for empty rows.

    ``values`` float32 or float64. ``rows`` (:func:`csr_rows` of the same
    matrix) is not needed by either path; it is accepted for callers that
    hold it.
    """
    n = indptr.shape[0] - 1
    out = xp.full(n, empty, dtype=values.dtype)
    if values.shape[0] == 0:
        return out
    if xp is np:
        nonempty = indptr[:-1] < indptr[1:]
        out[nonempty] = np.maximum.reduceat(values, indptr[:-1][nonempty])
        return out
    # One thread a row walks its own segment: exact in every dtype (a scatter
    # maximum through atomics rounds float64 on some CuPy versions).
    _row_max_kernel(xp)(indptr, values, values.dtype.type(empty), out)
    return out


_KERNELS: dict = {}


def _row_max_kernel(cp: Any) -> Any:
    kernel = _KERNELS.get("row_max")
    if kernel is None:
        kernel = cp.ElementwiseKernel(
            "raw I indptr, raw T v, T empty", "T out",
            """
            const I a = indptr[i], z = indptr[i + 1];
            T m = empty;
            if (a < z) {
                m = v[a];
                for (I p = a + 1; p < z; ++p) { if (v[p] > m) m = v[p]; }
            }
            out = m;
            """, "managed_solve_row_max")
        _KERNELS["row_max"] = kernel
    return kernel


def hash64(xp: Any, n: int, seed: int) -> Any:
    """splitmix64 of ``0 .. n-1`` (uint64): distinct values, identical on NumPy and CuPy.

    Fixed pseudo-random weights for the parallel aggregation, so a CPU and a
    GPU set-up of the same matrix choose the same aggregates.
    """
    u = xp.uint64
    z = xp.arange(n, dtype=xp.uint64) + u((int(seed) * _GOLDEN + _GOLDEN) % (1 << 64))
    z = (z ^ (z >> u(30))) * u(_MIX1)
    z = (z ^ (z >> u(27))) * u(_MIX2)
    return z ^ (z >> u(31))


def random_ranks(xp: Any, n: int, seed: int) -> Any:
    """A pseudo-random permutation of ``0 .. n-1`` (float64), the rank of each node's hash."""
    order = xp.argsort(hash64(xp, n, seed))
    ranks = xp.empty(n, dtype=xp.float64)
    ranks[order] = xp.arange(n, dtype=xp.float64)
    return ranks


def uniform(xp: Any, n: int, seed: int, dtype: Any = np.float64) -> Any:
    """``n`` pseudo-random numbers in [0, 1) from :func:`hash64` (the same on both backends)."""
    h = hash64(xp, n, seed) >> xp.uint64(11)  # 53 bits: exact in float64
    return (h.astype(xp.float64) * (1.0 / (1 << 53))).astype(dtype, copy=False)
