"""Array-module generic building blocks of the AMG set-up: row indices, row maxima, hashes.

Everything here runs unchanged on NumPy and on CuPy. The one operation the
two libraries spell differently, a maximum over the stored entries of each
CSR row, lives in :func:`row_max`: NumPy reduces contiguous segments with
``maximum.reduceat``; CuPy has no ``reduceat`` (nor ``maximum.at``), so it
scatters with ``cupyx.scatter_max`` by row index.
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
    k = xp.arange(nnz, dtype=indptr.dtype)
    return (xp.searchsorted(indptr, k, side="right") - 1).astype(indptr.dtype, copy=False)


def row_max(xp: Any, indptr: Any, rows: Any, values: Any, empty: float) -> Any:
    """``max(values[indptr[i]:indptr[i + 1]])`` for every row ``i``; ``empty`` for empty rows.

    ``values`` are float64 (CuPy's scatter maximum takes no int64); ``rows``
    is :func:`csr_rows` of the same matrix (used on CuPy only).
    """
    n = indptr.shape[0] - 1
    out = xp.full(n, empty, dtype=values.dtype)
    if values.shape[0] == 0:
        return out
    if xp is np:
        nonempty = indptr[:-1] < indptr[1:]
        out[nonempty] = np.maximum.reduceat(values, indptr[:-1][nonempty])
        return out
    import cupyx  # CuPy is the array module here, so cupyx imports

    cupyx.scatter_max(out, rows, values)
    return out


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
