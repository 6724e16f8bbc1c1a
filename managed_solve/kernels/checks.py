"""The per-matrix checks of ``solve_many`` over many host arrays at once, by address.

``solve_many`` validates every input (no NaN or Inf in A, b, x0) and the
auto policy tests every distinct matrix (symmetry and Gershgorin bounds:
:func:`managed_solve.kernels.symmetry.csr_symmetry_gershgorin`). With one
matrix per system that is hundreds of small kernel calls, each of which
takes the GIL back when it returns; beside other Python threads (the
stager packing a batch, the estimate loop) each re-take waits up to the
interpreter's switch interval. These kernels run a whole range of arrays
in one GIL-free call: the caller reads each array's address once (holding
the GIL briefly) and hands out ranges to the host-kernel threads.

Every address must be that of a C-contiguous array of the dtype of the
``like`` argument of the call, alive for the call.

Numba's on-disk cache of these kernels is checked against this file only
(a hash of its text), not against :mod:`.symmetry` whose walk they inline:
a change of that walk must come with a change of this file's text (a new
timestamp alone does not recompile them).
"""

from __future__ import annotations

import numba

from .packing import address_pointer
from .symmetry import symmetry_gershgorin_rows

__all__ = ["all_finite_many", "csr_symmetry_gershgorin_many"]


@numba.njit(nogil=True, cache=True)
def _all_finite(a):
    """1 when every entry of ``a`` is finite (no NaN, no Inf), else 0.

    ``v - v`` is 0 for a finite ``v`` and NaN for a NaN or an infinity; the
    test ORs ``v - v != 0`` over the array, a reduction without branches
    that vectorises. A function of its own rather than a loop written into
    the kernels that use it: written after the symmetry walk in one body,
    the loop compiled to code about 2.5 times slower.
    """
    bad = False
    for i in range(a.shape[0]):
        v = a[i]
        bad |= (v - v) != 0
    return 0 if bad else 1


@numba.njit(nogil=True, cache=True)
def all_finite_many(lo, hi, addresses, lengths, like, out):
    """``out[k] = 1`` when every entry of array ``k`` is finite (no NaN, no Inf), else 0, for ``k`` in ``lo:hi``.

    Each array by :func:`_all_finite`.

    Parameters
    ----------
    lo, hi : int
        The arrays to check (``hi`` excluded).
    addresses, lengths : int64 arrays
        Data addresses and lengths of the arrays.
    like : array
        Any array of the arrays' dtype (only its dtype is read).
    out : uint8 array
        One flag per array.
    """
    for k in range(lo, hi):
        a = numba.carray(address_pointer(addresses[k]), (lengths[k],), like.dtype)
        out[k] = _all_finite(a)


@numba.njit(nogil=True, cache=True)
def csr_symmetry_gershgorin_many(lo, hi, ptr_addresses, idx_addresses, data_addresses, rows,
                                 nnzs, ptr_like, idx_like, data_like, rel, codes, bounds, finite):
    """:func:`~managed_solve.kernels.symmetry.csr_symmetry_gershgorin` of matrices ``lo:hi``, in one call.

    Parameters
    ----------
    lo, hi : int
        The matrices to test (``hi`` excluded).
    ptr_addresses, idx_addresses, data_addresses : int64 arrays
        Data addresses of each matrix's ``indptr`` (``rows + 1`` entries),
        ``indices`` and ``data`` (``nnzs`` entries).
    rows, nnzs : int64 arrays
        Rows and stored entries of each matrix.
    ptr_like, idx_like, data_like : arrays
        Any arrays of the dtypes of ``indptr``, ``indices`` and ``data``.
    rel : float
        ``rel`` of the symmetry rule (:mod:`managed_solve.kernels.symmetry`:
        each pair against its own size and its two rows' largest entries).
    codes : int8 array
        Each matrix's code (``SYMMETRIC``, ``DIFFERENT_VALUES``, ``DIFFERENT_PATTERN``;
        ``NOT_CANONICAL`` where the row pointers do not start at 0, fall
        back or run past ``nnzs``, or a row's columns are not strictly
        increasing or one is out of range: its bounds are then zeros, its
        finite flag still holds).
    bounds : float64 array, shape (count, 4)
        Each matrix's ``(lo, hi, dmin, dmax)``.
    finite : uint8 array
        1 where every stored entry of the matrix is finite, else 0
        (:func:`all_finite_many`'s answer, so validation need not read them
        again). The walk reads every entry into its rows' sums, so rows
        whose sums are all finite answer it without another read (that
        read was about a tenth of the kernel's time); where one is not (a
        NaN, an infinity, sums that overflow from finite entries) or the
        walk stopped early, :func:`_all_finite` reads the entries.
    """
    for k in range(lo, hi):
        indptr = numba.carray(address_pointer(ptr_addresses[k]), (rows[k] + 1,), ptr_like.dtype)
        indices = numba.carray(address_pointer(idx_addresses[k]), (nnzs[k],), idx_like.dtype)
        data = numba.carray(address_pointer(data_addresses[k]), (nnzs[k],), data_like.dtype)
        code, g_lo, g_hi, d_min, d_max, rows_finite = symmetry_gershgorin_rows(indptr, indices,
                                                                                data, rel)
        codes[k] = code
        bounds[k, 0] = g_lo
        bounds[k, 1] = g_hi
        bounds[k, 2] = d_min
        bounds[k, 3] = d_max
        # Finite rows of a walk that read every entry: all finite, no second read.
        whole = rows_finite and indptr[rows[k]] == nnzs[k]
        finite[k] = 1 if whole else _all_finite(data)
