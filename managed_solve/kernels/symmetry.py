"""Symmetry of a host CSR matrix in one pass, without building the transpose.

``managed_solve.system.is_symmetric`` decides between CG and BiCGStab for
every distinct matrix ``solve`` and ``solve_many`` meet. Building the
transpose and comparing allocates a second matrix and sorts it; for a matrix
in canonical form (sorted indices, no duplicates) this kernel matches each
stored ``(i, j)`` with row ``j``'s entries in one O(nnz) pass (one cursor
per row, the GIL released). CPU only: GPU matrices keep the
transpose path on the device.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

__all__ = ["NOT_CANONICAL", "abs_max", "csr_gershgorin", "csr_mirror", "csr_mirror_gershgorin",
           "csr_positive_diagonal", "csr_symmetry", "csr_symmetry_gershgorin", "csr_symmetry_rows",
           "csr_symmetry_rows_search", "csr_symmetry_rows_window", "csr_symmetry_scaled",
           "symmetry_gershgorin"]

SYMMETRIC, DIFFERENT_VALUES, DIFFERENT_PATTERN = 1, 0, -1
#: :func:`symmetry_gershgorin`'s code for a pattern not in canonical form (a
#: row's columns not strictly increasing, or a column out of range).
NOT_CANONICAL = -2


@numba.njit(nogil=True, cache=True)
def csr_symmetry(indptr, indices, data, limit):
    """1 if ``|a_ij - a_ji| <= limit`` for every stored entry, 0 if some pair differs by more,
    -1 if some stored ``(i, j)`` has no stored ``(j, i)`` (the caller then compares ``A - A.T``,
    since an unstored entry is a zero and a small stored value may still match it).

    ``indices`` must be sorted within each row, without duplicates. Rows are
    walked in order while a cursor per row ``j`` steps through row ``j``'s
    columns: with a symmetric pattern, the entries ``(i, j)`` of rows
    ``i = 0, 1, ...`` meet row ``j``'s columns exactly in order.
    """
    n = indptr.shape[0] - 1
    cursor = indptr[:-1].copy()
    for i in range(n):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            q = cursor[j]
            if q == indptr[j + 1] or indices[q] != i:
                return DIFFERENT_PATTERN
            cursor[j] = q + 1
            if abs(data[p] - data[q]) > limit:
                return DIFFERENT_VALUES
    return SYMMETRIC


@numba.njit(nogil=True, cache=True)
def csr_symmetry_scaled(indptr, indices, data, rel):
    """:func:`csr_symmetry` with ``limit = rel * max |a_ij|`` (scale-invariant), the scale found in the same call."""
    return csr_symmetry(indptr, indices, data, rel * abs_max(data, 0, data.shape[0]))


@numba.njit(nogil=True, cache=True)
def csr_symmetry_rows(indptr, indices, data, limit, lo, hi):
    """:func:`csr_symmetry` for the stored entries of rows ``lo:hi`` only (the same codes).

    Row ranges are independent, so chunks of one matrix run side by side on
    helper threads (the GIL released), and together they check every entry
    against its mirror. A chunk whose columns span a window of at most
    ``4 x`` its rows (plus 64; banded and mesh matrices) keeps one cursor per
    row of that window (:func:`csr_symmetry_rows_window`); a wider one looks
    each entry up by binary search (:func:`csr_symmetry_rows_search`, slower:
    a search per entry instead of a cursor step).
    """
    if indptr[lo] == indptr[hi]:
        return SYMMETRIC
    jmin, jmax = indptr.shape[0], -1
    for i in range(lo, hi):  # sorted rows: their first and last columns bound the window
        a, b = indptr[i], indptr[i + 1]
        if a < b:
            jmin = min(jmin, indices[a])
            jmax = max(jmax, indices[b - 1])
    if jmax - jmin + 1 <= 4 * (hi - lo) + 64:
        return csr_symmetry_rows_window(indptr, indices, data, limit, lo, hi, jmin, jmax)
    return csr_symmetry_rows_search(indptr, indices, data, limit, lo, hi)


@numba.njit(nogil=True, cache=True)
def csr_symmetry_rows_window(indptr, indices, data, limit, lo, hi, jmin, jmax):
    """Rows ``lo:hi`` whose columns lie in ``jmin..jmax``: one cursor per row of that window.

    As in :func:`csr_symmetry`, the mirrors ``(j, i)`` of rows ``i = lo, lo+1, ...``
    meet row ``j``'s columns in order; a row's cursor starts, at its first
    use, at its first column ``>= lo`` (one binary search per row of the
    window, not per entry, so a long row reaching below ``lo`` costs its log).
    """
    cursor = np.full(jmax - jmin + 1, -1, dtype=indptr.dtype)
    for i in range(lo, hi):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            q = cursor[j - jmin]
            if q < 0:  # first use: row j's first column >= lo
                q = _first_at_least(indices, indptr[j], indptr[j + 1], lo)
            if q == indptr[j + 1] or indices[q] != i:
                return DIFFERENT_PATTERN
            cursor[j - jmin] = q + 1
            if abs(data[p] - data[q]) > limit:
                return DIFFERENT_VALUES
    return SYMMETRIC


@numba.njit(nogil=True, cache=True)
def csr_symmetry_rows_search(indptr, indices, data, limit, lo, hi):
    """Rows ``lo:hi``, each ``(i, j)`` looked up in row ``j`` by binary search."""
    for i in range(lo, hi):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            a = _first_at_least(indices, indptr[j], indptr[j + 1], i)
            if a == indptr[j + 1] or indices[a] != i:
                return DIFFERENT_PATTERN
            if abs(data[p] - data[a]) > limit:
                return DIFFERENT_VALUES
    return SYMMETRIC


@numba.njit(nogil=True, cache=True)
def _first_at_least(indices, a, b, value):
    """The first position of the sorted ``indices[a:b]`` holding ``value`` or more (``b``: none)."""
    while a < b:
        m = (a + b) >> 1
        if indices[m] < value:
            a = m + 1
        else:
            b = m
    return a


@numba.njit(nogil=True, cache=True)
def abs_max(data, lo, hi):
    """``max |data[lo:hi]|`` (0 for an empty range), without a temporary array."""
    scale = 0.0
    for k in range(lo, hi):
        a = abs(data[k])
        if a > scale:
            scale = a
    return scale


@numba.njit(nogil=True, cache=True)
def csr_positive_diagonal(indptr, indices, data, lo, hi):
    """Whether every row of ``lo:hi`` has a positive diagonal (duplicates summed, as SciPy does).

    The half of CG's admission test that :func:`csr_symmetry` leaves (a
    symmetric matrix with a positive diagonal goes to CG): one pass over the
    rows' columns, no temporary, the GIL released, so row ranges of a large
    matrix run side by side like the symmetry chunks.
    """
    for i in range(lo, hi):
        d = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            if indices[p] == i:
                d += data[p]
        if not d > 0.0:  # also a NaN
            return False
    return True


@numba.njit(nogil=True, cache=True)
def csr_gershgorin(indptr, indices, data):
    """``(lo, hi, dmin, dmax)`` of a square CSR matrix in one pass (duplicates summed, as SciPy does).

    ``lo = min(a_ii - r_i)`` and ``hi = max(a_ii + r_i)`` with ``r_i`` the
    absolute off-diagonal sum of row ``i`` bound the eigenvalues of a
    symmetric A (Gershgorin); ``dmin``, ``dmax`` are the extreme diagonal
    entries. A NaN diagonal makes ``dmin`` NaN (every comparison with it fails).
    """
    n = indptr.shape[0] - 1
    lo, hi = np.inf, -np.inf
    dmin, dmax = np.inf, -np.inf
    nan = False
    for i in range(n):
        d = 0.0
        r = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            if indices[p] == i:
                d += data[p]
            else:
                r += abs(data[p])
        nan = nan or d != d
        lo = min(lo, d - r)
        hi = max(hi, d + r)
        dmin = min(dmin, d)
        dmax = max(dmax, d)
    if n == 0:
        return 0.0, 0.0, 0.0, 0.0
    if nan:
        return np.nan, np.nan, np.nan, np.nan
    return lo, hi, dmin, dmax


@numba.njit(nogil=True, cache=True)
def csr_symmetry_gershgorin(indptr, indices, data, rel):
    """:func:`csr_symmetry_scaled`'s code and :func:`csr_gershgorin`'s bounds in one pass.

    Returns ``(code, lo, hi, dmin, dmax)``. The auto policy needs both for
    every distinct matrix; one walk over the entries reads each once (the
    mirror look-ups of the cursors dominate either pass). A pattern not in
    canonical form (sorted rows, no duplicates) gets the code
    ``NOT_CANONICAL`` and zeros. The largest mirror
    difference and ``max |a_ij|`` are tracked to the end, so a matrix whose
    values differ is read whole (its Gershgorin bounds are wanted too); one
    whose pattern differs stops comparing mirrors at the first miss.
    """
    return symmetry_gershgorin(indptr, indices, data, rel)


@numba.njit(nogil=True, cache=True)
def symmetry_gershgorin(indptr, indices, data, rel):
    """The walk of :func:`csr_symmetry_gershgorin`, the one body of both symmetry kernels.

    :func:`managed_solve.kernels.checks.csr_symmetry_gershgorin_many` runs it
    on many matrices in one call, so one matrix gets the same answer, bit
    for bit, either way.

    Only the entries left of the diagonal look up their mirrors (the cursor
    look-ups dominate the walk): row ``j``'s cursor starts right of its
    diagonal, and the mirrors ``(j, i)`` of rows ``i = j+1, j+2, ...`` meet
    row ``j``'s entries there in order. Each pair is compared once, from
    its lower entry (``|a - b|`` is the same either way); the pattern is
    symmetric when every lower entry found its mirror and every cursor
    reached its row's end (no upper entry left without one). ``max`` skips
    a NaN (it keeps the running value), so the largest difference and
    scale do not depend on the order either.

    A sorted row is its lower entries, then at most one diagonal entry, then
    its upper entries: three loops, one after the other, rather than a test
    of each column against the diagonal. Positions and columns are read as
    unsigned integers (a negative column reads as too large): Numba then
    indexes with them directly instead of first testing each for a negative
    index counted from the end. Each row's sums still add its entries in
    their stored order, so the bounds are those of a plain loop over the row.

    The walk also checks that the pattern is canonical (row pointers from 0,
    non-decreasing and within the entries; each row's columns strictly
    increasing and below ``n``): at the first row that is not, it
    returns ``NOT_CANONICAL`` (and zeros), before any look-up leaves the
    rows checked so far. Callers then need not run SciPy's own check of
    the pattern (another pass over every matrix) first.
    """
    n = indptr.shape[0] - 1
    ptr = _unsigned(indptr)
    idx = _unsigned(indices)
    one = np.uint64(1)  # an unsigned position plus a plain int would be a float in Numba
    cursor = np.empty(n, dtype=ptr.dtype)  # row j's first entry right of the diagonal not yet met
    same_pattern = True
    worst = 0.0
    scale = 0.0
    lo, hi = np.inf, -np.inf
    dmin, dmax = np.inf, -np.inf
    nan = False
    p = np.uint64(ptr[0])  # rows follow one another: row i ends where row i + 1 starts
    un, nnz = np.uint64(n), np.uint64(idx.shape[0])
    if p != 0:
        return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0
    for i in range(un):
        end = np.uint64(ptr[i + one])
        if end < p or end > nnz:  # row pointers that fall back or run past the entries
            return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0
        r = 0.0
        least = np.uint64(0)  # the smallest column the row's next entry may have
        while p < end:  # left of the diagonal: each entry looks its mirror up
            j = idx[p]
            if j >= i:
                break
            if j < least:  # rows before were canonical: the look-ups so far stayed in them
                return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0
            least = j + one
            a = data[p]
            scale = max(scale, abs(a))
            r += abs(a)
            if same_pattern:
                q = cursor[j]
                if q == ptr[j + one] or idx[q] != i:
                    same_pattern = False
                else:
                    cursor[j] = q + one
                    worst = max(worst, abs(a - data[q]))
            p += one
        d = 0.0
        if p < end and idx[p] == i:
            a = data[p]
            scale = max(scale, abs(a))
            d += a
            p += one
            least = i + one
        cursor[i] = p
        while p < end:  # right of the diagonal: the mirrors are met from below
            j = idx[p]
            if j < least or j >= un:
                return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0
            least = j + one
            a = data[p]
            scale = max(scale, abs(a))
            r += abs(a)
            p += one
        nan = nan or d != d
        lo = min(lo, d - r)
        hi = max(hi, d + r)
        dmin = min(dmin, d)
        dmax = max(dmax, d)
    if same_pattern:
        for j in range(np.uint64(n)):
            if cursor[j] != ptr[j + one]:
                same_pattern = False
                break
    if not same_pattern:
        code = DIFFERENT_PATTERN
    else:
        code = SYMMETRIC if worst <= rel * scale else DIFFERENT_VALUES
    if n == 0:
        return code, 0.0, 0.0, 0.0, 0.0
    if nan:
        return code, np.nan, np.nan, np.nan, np.nan
    return code, lo, hi, dmin, dmax


def _unsigned(a):
    """An integer array viewed as the unsigned integers of its width (no copy)."""
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@overload(_unsigned)
def _unsigned_jit(a):
    """:func:`_unsigned` in jitted code."""
    unsigned = np.dtype(f"u{a.dtype.bitwidth // 8}")
    return lambda a: a.view(unsigned)


@numba.njit(nogil=True, cache=True)
def csr_mirror(indptr, indices):
    """The position of each stored entry's mirror: ``mirror[p]`` holds ``(j, i)`` for ``(i, j)`` at ``p``.

    An empty array when some mirror is not stored (a non-symmetric pattern).
    ``indices`` sorted within each row, without duplicates. Matrices sharing
    one pattern (a sweep over time steps on one mesh) share this map, and
    each then checks its values in one pass without the cursors
    (:func:`csr_mirror_gershgorin`).
    """
    n = indptr.shape[0] - 1
    cursor = indptr[:-1].copy()
    mirror = np.empty(indices.shape[0], dtype=np.int64)
    for i in range(n):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            q = cursor[j]
            if q == indptr[j + 1] or indices[q] != i:
                return np.empty(0, dtype=np.int64)
            cursor[j] = q + 1
            mirror[p] = q
    return mirror


@numba.njit(nogil=True, cache=True)
def csr_mirror_gershgorin(indptr, indices, data, mirror, rel):
    """:func:`csr_symmetry_gershgorin`'s answer for a pattern whose :func:`csr_mirror` map is known.

    The pattern is symmetric (the map exists), so the code is
    ``SYMMETRIC`` or ``DIFFERENT_VALUES``.
    """
    n = indptr.shape[0] - 1
    worst = 0.0
    scale = 0.0
    lo, hi = np.inf, -np.inf
    dmin, dmax = np.inf, -np.inf
    nan = False
    for i in range(n):
        d = 0.0
        r = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            a = data[p]
            scale = max(scale, abs(a))
            worst = max(worst, abs(a - data[mirror[p]]))
            if indices[p] == i:
                d += a
            else:
                r += abs(a)
        nan = nan or d != d
        lo = min(lo, d - r)
        hi = max(hi, d + r)
        dmin = min(dmin, d)
        dmax = max(dmax, d)
    code = SYMMETRIC if worst <= rel * scale else DIFFERENT_VALUES
    if n == 0:
        return code, 0.0, 0.0, 0.0, 0.0
    if nan:
        return code, np.nan, np.nan, np.nan, np.nan
    return code, lo, hi, dmin, dmax
