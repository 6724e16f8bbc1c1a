"""Symmetry of a host CSR matrix in one pass, without building the transpose.

``managed_solve.system.is_symmetric`` decides between CG and BiCGStab for
every distinct matrix ``solve`` and ``solve_many`` meet. Building the
transpose and comparing allocates a second matrix and sorts it; for a matrix
in canonical form (sorted indices, no duplicates) this kernel matches each
stored ``(i, j)`` with row ``j``'s entries in one O(nnz) pass (one cursor
per row, the GIL released). Matrices on a GPU have a kernel of their own
(``ms_symmetry_many`` in ``system/checks.cu``).

The symmetry rule
-----------------
Every symmetry test of the package applies this one rule: the kernels
here, their GPU twin and the array version for dense matrices and for patterns these kernels leave
(:func:`managed_solve.system.properties.symmetric_pairs`). A counts as
symmetric when every pair ``i != j`` has::

    |a_ij - a_ji| <= rel * max(|a_ij|, |a_ji|, sqrt(r_i) * sqrt(r_j)),   r_i = max_k |a_ik|

with ``rel = symmetry_rtol(A.dtype)`` (``SYMMETRY_RTOL``, 1e-12, for
float64; 128 eps, about 1.5e-5, for float32), an unstored entry read as 0
(duplicates summed), the arithmetic in float64 whatever the dtype, a NaN
left out of ``r_i``, and a comparison with a NaN counting as no difference
(validation refuses NaN and Inf).

``rel`` follows the dtype because the entries' rounding does: a float32
matrix assembled from triplets sums the duplicates of ``(i, j)`` and of
``(j, i)`` in different orders, and its mirrors differ by a few float32
ulps, which 1e-12 would call an asymmetry.

Each pair is judged against its own size and its own two rows, not against
``max |a|`` of the whole matrix: one large entry, such as a 1e15 penalty on
the diagonal for a Dirichlet condition, would otherwise excuse differences
of 1e3 everywhere else, and CG, Cholesky and the adjoint of a gradient
would treat a non-symmetric A as symmetric. Here a large entry widens only
the pairs of its own row (and their mirrors), and by its square root. The
rows' largest entries give a pair a size when its two sides cancelled to
rounding level in assembly (1e-17 against a 0, stored or not): that
rounding is relative to the contributions that cancelled, which are about
the size of the rows' other entries. The floor scales with the matrix, and
rows with a zero diagonal (saddle-point matrices, MINRES's case) have one
too.

Cost: the first two terms need only the pair's two values; the two rows are
read for their largest entries only for a pair that fails them, which in a
symmetric matrix is rare (mirrors are mostly equal bit for bit), and no
pair is compared after the first that fails.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload
from numpy.typing import DTypeLike

__all__ = ["ASSEMBLY_ULPS", "NOT_CANONICAL", "SYMMETRY_RTOL", "csr_gershgorin", "csr_mirror",
           "csr_mirror_gershgorin", "csr_positive_diagonal", "csr_symmetry",
           "csr_symmetry_gershgorin", "csr_symmetry_rows", "csr_symmetry_rows_search",
           "csr_symmetry_rows_window", "csr_symmetry_scaled", "symmetry_gershgorin",
           "symmetry_gershgorin_rows",
           "symmetry_rtol"]

#: ``rel`` of the symmetry rule (module docstring) for float64: far above
#: float64's rounding (1.1e-16) of an assembly, far below any asymmetry a method must heed.
SYMMETRY_RTOL = 1e-12
#: ``rel`` of a coarser dtype, in its eps. Summing an entry's ``k``
#: contributions in two orders leaves the two sums at most about
#: ``(k - 1) eps`` of the contributions' absolute sum apart (each partial
#: sum rounded by eps / 2), and that sum is about the size the rule measures
#: a pair by: the pair's own, or, where contributions cancelled, the rows'
#: largest entries (the diagonal, which gathers contributions of that size).
#: FE and COO assembly with up to 30 contributions an entry is thus within
#: 29 eps at worst (random roundings stay near 5: measured on shuffled
#: triplets), so 128 eps (1.5e-5 for float32) accepts them with room to
#: spare, while an asymmetry that matters, a convection-diffusion matrix's
#: 1e-3 or a single skewed pair, is refused by a factor of 60 and more.
#: Below this, the asymmetry is of the size of the rounding the dtype gives
#: every entry anyway.
ASSEMBLY_ULPS = 128


def _rtol(dtype: np.dtype) -> float:
    """:func:`symmetry_rtol` computed (the float dtypes' are kept in ``_RTOLS``)."""
    if dtype.kind in "fc":
        return max(SYMMETRY_RTOL, ASSEMBLY_ULPS * float(np.finfo(dtype).eps))
    return SYMMETRY_RTOL  # integers: exact entries, compared in float64


_RTOLS = {np.dtype(t): _rtol(np.dtype(t)) for t in (np.float64, np.float32)}


def symmetry_rtol(dtype: DTypeLike) -> float:
    """``rel`` of the symmetry rule (module docstring) for a matrix of ``dtype``.

    ``SYMMETRY_RTOL`` (1e-12) for float64 and integers, ``ASSEMBLY_ULPS``
    eps of a coarser float (about 1.5e-5 for float32): the mirrors of a
    matrix assembled in that dtype differ by its rounding, not float64's.

    Examples
    --------
    >>> import numpy as np
    >>> symmetry_rtol(np.float64), round(symmetry_rtol(np.float32), 7)
    (1e-12, 1.53e-05)
    """
    rel = _RTOLS.get(dtype)  # a matrix's dtype is found as it is, without np.dtype()
    return rel if rel is not None else _rtol(np.dtype(dtype))

SYMMETRIC, DIFFERENT_VALUES, DIFFERENT_PATTERN = 1, 0, -1
#: :func:`symmetry_gershgorin`'s code for a pattern not in canonical form (a
#: row's columns not strictly increasing, or a column out of range).
NOT_CANONICAL = -2


@numba.njit(nogil=True, cache=True)
def _beyond_values(a, b, rel):
    """Whether ``|a - b| > rel * max(|a|, |b|)``, in float64: the rule's first, cheap test."""
    x, y = np.float64(a), np.float64(b)
    return abs(x - y) > rel * max(abs(x), abs(y))


@numba.njit(nogil=True, cache=True)
def _row_scale(indptr, data, i):
    """``max |a_ik|`` over row ``i``'s stored entries, as float64 (NaN left out; 0.0 for an empty row)."""
    scale = 0.0
    for p in range(indptr[i], indptr[i + 1]):
        v = abs(np.float64(data[p]))
        if v > scale:
            scale = v
    return scale


@numba.njit(nogil=True, cache=True)
def _beyond_rows(indptr, data, i, j, a, b, rel):
    """Whether ``|a - b| > rel * sqrt(r_i) * sqrt(r_j)``: the rule's last test, for a pair that failed the first.

    Reads rows ``i`` and ``j`` within their pointers only (their columns'
    order does not matter).
    """
    ri = _row_scale(indptr, data, i)
    rj = _row_scale(indptr, data, j)
    return abs(np.float64(a) - np.float64(b)) > rel * (np.sqrt(ri) * np.sqrt(rj))


@numba.njit(nogil=True, cache=True)
def csr_symmetry(indptr, indices, data, rel):
    """1 if every stored pair meets the symmetry rule (module docstring) with ``rel``, 0 if one does not,
    -1 if some stored ``(i, j)`` has no stored ``(j, i)`` (the caller then applies the rule
    with the missing entries read as zeros: a small stored value may still pass).

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
            if _beyond_values(data[p], data[q], rel) and \
                    _beyond_rows(indptr, data, i, j, data[p], data[q], rel):
                return DIFFERENT_VALUES
    return SYMMETRIC


@numba.njit(nogil=True, cache=True)
def csr_symmetry_scaled(indptr, indices, data, rel):
    """:func:`csr_symmetry` (the rule is scale-invariant pair by pair: nothing to find first)."""
    return csr_symmetry(indptr, indices, data, rel)


@numba.njit(nogil=True, cache=True)
def csr_symmetry_rows(indptr, indices, data, rel, lo, hi):
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
        return csr_symmetry_rows_window(indptr, indices, data, rel, lo, hi, jmin, jmax)
    return csr_symmetry_rows_search(indptr, indices, data, rel, lo, hi)


@numba.njit(nogil=True, cache=True)
def csr_symmetry_rows_window(indptr, indices, data, rel, lo, hi, jmin, jmax):
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
            if _beyond_values(data[p], data[q], rel) and \
                    _beyond_rows(indptr, data, i, j, data[p], data[q], rel):
                return DIFFERENT_VALUES
    return SYMMETRIC


@numba.njit(nogil=True, cache=True)
def csr_symmetry_rows_search(indptr, indices, data, rel, lo, hi):
    """Rows ``lo:hi``, each ``(i, j)`` looked up in row ``j`` by binary search."""
    for i in range(lo, hi):
        for p in range(indptr[i], indptr[i + 1]):
            j = indices[p]
            a = _first_at_least(indices, indptr[j], indptr[j + 1], i)
            if a == indptr[j + 1] or indices[a] != i:
                return DIFFERENT_PATTERN
            if _beyond_values(data[p], data[a], rel) and \
                    _beyond_rows(indptr, data, i, j, data[p], data[a], rel):
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
    ``NOT_CANONICAL`` and zeros. A matrix whose values differ is still read
    whole (its Gershgorin bounds are wanted too, and a pattern miss after
    the first differing pair still gives ``DIFFERENT_PATTERN``), but
    compares no pair after that one; one whose pattern differs stops
    comparing mirrors at the first miss.
    """
    return symmetry_gershgorin(indptr, indices, data, rel)


@numba.njit(nogil=True, cache=True)
def symmetry_gershgorin_rows(indptr, indices, data, rel):
    """The walk of :func:`csr_symmetry_gershgorin`, the one body of both symmetry kernels.

    Returns :func:`symmetry_gershgorin`'s ``(code, lo, hi, dmin, dmax)``
    and whether every row's diagonal and sum of off-diagonal magnitudes came
    out finite: then every entry the walk read is finite (a NaN or an
    infinity makes its row's sums so), and a caller that needs the finite
    check of the entries (validation) need not read them again. False
    (rare: an infinity, a NaN, sums that overflow from finite entries, or a
    pattern not canonical, whose walk stops early) leaves it to that check.

    :func:`managed_solve.kernels.checks.csr_symmetry_gershgorin_many` runs it
    on many matrices in one call, so one matrix gets the same answer, bit
    for bit, either way.

    Only the entries left of the diagonal look up their mirrors (the cursor
    look-ups dominate the walk): row ``j``'s cursor starts right of its
    diagonal, and the mirrors ``(j, i)`` of rows ``i = j+1, j+2, ...`` meet
    row ``j``'s entries there in order. Each pair is compared once, from
    its lower entry (the rule is the same either way); the pattern is
    symmetric when every lower entry found its mirror and every cursor
    reached its row's end (no upper entry left without one). A pair that
    fails the rule's value test reads its two rows for their largest
    entries, within their pointers (row ``i``'s were checked at its start).

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
    same_values = True
    lo, hi = np.inf, -np.inf
    dmin, dmax = np.inf, -np.inf
    nan = False
    rows_finite = True
    p = np.uint64(ptr[0])  # rows follow one another: row i ends where row i + 1 starts
    un, nnz = np.uint64(n), np.uint64(idx.shape[0])
    if p != 0:
        return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0, False
    for i in range(un):
        end = np.uint64(ptr[i + one])
        if end < p or end > nnz:  # row pointers that fall back or run past the entries
            return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0, False
        r = 0.0
        least = np.uint64(0)  # the smallest column the row's next entry may have
        while p < end:  # left of the diagonal: each entry looks its mirror up
            j = idx[p]
            if j >= i:
                break
            if j < least:  # rows before were canonical: the look-ups so far stayed in them
                return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0, False
            least = j + one
            a = data[p]
            r += abs(a)
            if same_pattern:
                q = cursor[j]
                if q == ptr[j + one] or idx[q] != i:
                    same_pattern = False
                else:
                    cursor[j] = q + one
                    b = data[q]
                    if a != b and same_values and _beyond_values(a, b, rel) and _beyond_rows(
                            indptr, data, np.int64(i), np.int64(j), a, b, rel):
                        same_values = False
            p += one
        d = 0.0
        if p < end and idx[p] == i:
            a = data[p]
            d += a
            p += one
            least = i + one
        cursor[i] = p
        while p < end:  # right of the diagonal: the mirrors are met from below
            j = idx[p]
            if j < least or j >= un:
                return NOT_CANONICAL, 0.0, 0.0, 0.0, 0.0, False
            least = j + one
            r += abs(data[p])
            p += one
        nan = nan or d != d
        rows_finite &= (r < np.inf) & (abs(d) < np.inf)  # False for a NaN too: no branch
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
        code = SYMMETRIC if same_values else DIFFERENT_VALUES
    if n == 0:
        return code, 0.0, 0.0, 0.0, 0.0, rows_finite
    if nan:
        return code, np.nan, np.nan, np.nan, np.nan, rows_finite
    return code, lo, hi, dmin, dmax, rows_finite


@numba.njit(nogil=True, cache=True)
def symmetry_gershgorin(indptr, indices, data, rel):
    """``(code, lo, hi, dmin, dmax)`` of :func:`symmetry_gershgorin_rows` (its walk)."""
    code, lo, hi, dmin, dmax, _finite = symmetry_gershgorin_rows(indptr, indices, data, rel)
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
    same_values = True
    lo, hi = np.inf, -np.inf
    dmin, dmax = np.inf, -np.inf
    nan = False
    for i in range(n):
        d = 0.0
        r = 0.0
        for p in range(indptr[i], indptr[i + 1]):
            a = data[p]
            b = data[mirror[p]]
            if a != b and same_values and _beyond_values(a, b, rel) and \
                    _beyond_rows(indptr, data, i, indices[p], a, b, rel):
                same_values = False
            if indices[p] == i:
                d += a
            else:
                r += abs(a)
        nan = nan or d != d
        lo = min(lo, d - r)
        hi = max(hi, d + r)
        dmin = min(dmin, d)
        dmax = max(dmax, d)
    code = SYMMETRIC if same_values else DIFFERENT_VALUES
    if n == 0:
        return code, 0.0, 0.0, 0.0, 0.0
    if nan:
        return code, np.nan, np.nan, np.nan, np.nan
    return code, lo, hi, dmin, dmax
