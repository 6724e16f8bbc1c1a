"""The check of a compressed sparse pattern (CSR rows, or CSC columns) before anything indexes with it.

SciPy's constructors check only the arrays' lengths, and torch builds sparse
tensors without looking at their indices; every kernel after validation
(SciPy's, SuperLU, the batched loops, the block-diagonal packing) reads
``x[indices[k]]`` and the entries between two row pointers without a bounds
check, so one index outside the matrix is a read or a write out of bounds:
a crash, or silently wrong answers.

:func:`compressed_pattern` reads the row pointers once and the indices once.
Asked, it also says whether the pattern is canonical (SciPy's
``has_canonical_format``: each row's indices strictly increasing), in the
same pass over the indices, so the caller can spare SciPy's own pass of
that test: a pattern is canonical exactly when every place where an index
does not exceed the one before it is the first entry of a row.
"""

from __future__ import annotations

import numba

__all__ = ["BAD_INDEX", "BAD_POINTERS", "CANONICAL", "VALID", "compressed_pattern"]

#: :func:`compressed_pattern`'s codes. ``VALID``: every index in range, the
#: row pointers a CSR index (canonical form not known, or not canonical when
#: asked); ``CANONICAL``: that, and each row's indices strictly increasing.
VALID, CANONICAL = 0, 1
#: An index below 0 or not below the bound.
BAD_INDEX = -1
#: Row pointers that do not start at 0, decrease, or do not end at the
#: number of indices.
BAD_POINTERS = -2


@numba.njit(nogil=True, cache=True)
def compressed_pattern(indptr, indices, bound, canonical):
    """Whether ``(indptr, indices)`` is a compressed pattern with indices in ``[0, bound)``.

    Parameters
    ----------
    indptr : integer array
        Row pointers (column pointers of a CSC pattern), one per row plus one.
    indices : integer array
        Each stored entry's column (row of a CSC pattern).
    bound : int
        The number of columns (rows of a CSC pattern).
    canonical : bool
        Also find whether each row's indices are strictly increasing.

    Returns
    -------
    int
        ``BAD_POINTERS`` (tested first: the indices are then not read),
        ``BAD_INDEX``, else ``CANONICAL`` where asked and found, else ``VALID``.

    Examples
    --------
    >>> import numpy as np
    >>> ptr = np.array([0, 1, 3])
    >>> compressed_pattern(ptr, np.array([0, 0, 1]), 2, True) == CANONICAL
    True
    >>> compressed_pattern(ptr, np.array([0, 1, 0]), 2, True) == VALID
    True
    >>> compressed_pattern(ptr, np.array([0, 2, 1]), 2, False) == BAD_INDEX
    True
    >>> compressed_pattern(np.array([0, 3, 1]), np.array([0, 0, 1]), 2, False) == BAD_POINTERS
    True
    """
    if indptr.shape[0] == 0:
        return BAD_POINTERS
    rows = indptr.shape[0] - 1
    nnz = indices.shape[0]
    if indptr[0] != 0 or indptr[rows] != nnz:
        return BAD_POINTERS
    fall = False
    for i in range(rows):  # no early exit: the loop vectorises
        fall |= indptr[i + 1] < indptr[i]
    if fall:
        return BAD_POINTERS
    bad = False
    if not canonical:
        for k in range(nnz):
            v = indices[k]
            bad |= (v < 0) | (v >= bound)
        return BAD_INDEX if bad else VALID
    descents = 0  # positions k where indices[k] <= indices[k - 1]
    if nnz:
        v = indices[0]
        bad = (v < 0) | (v >= bound)
    for k in range(1, nnz):
        v = indices[k]
        bad |= (v < 0) | (v >= bound)
        descents += v <= indices[k - 1]
    if bad:
        return BAD_INDEX
    at_starts = 0  # those that are a row's first entry (each non-empty row starts at its own k)
    for i in range(1, rows):
        k = indptr[i]
        if 0 < k < indptr[i + 1]:
            at_starts += indices[k] <= indices[k - 1]
    return CANONICAL if descents == at_starts else VALID

