"""Block-diagonal packing on the CPU: the index fix-up pass of ``pack_host``.

``managed_solve.solvers.batched.pack_host`` packs many CSR systems into one
block-diagonal CSR. It first concatenates each system's arrays into the
batch's buffers with NumPy (plain copies, the GIL released), so that system
``k`` owns rows ``offsets[k]:offsets[k+1]`` and entries
``nnz_off[k]:nnz_off[k+1]`` but its column indices and row pointers are still
its own (local, starting at 0). One pass of these kernels then makes them
global, in place and without temporaries:

- ``indices[nnz_off[k]:nnz_off[k+1]] += offsets[k]`` (columns of the block);
- ``indptr[offsets[k]:offsets[k+1]] += nnz_off[k]`` (where its rows start);
- ``row_sys[offsets[k]:offsets[k+1]] = k`` (the row-to-system map);
- with Jacobi, ``dinv[i] = 1 / a_ii`` from the packed entries, in the same
  sweep over the rows (replacing one ``A.diagonal()`` per system).

The kernels are serial over the systems ``lo:hi`` they are given and release
the GIL (``nogil=True``): ``pack_host`` runs pieces of a batch on its copy
thread pool, each piece's copies followed by its fix-up while the piece is
still in cache. Parallelism comes from that pool rather than from
``parallel=True``: two GPU stager threads pack at once, and Numba's
workqueue threading layer (used where neither OpenMP nor TBB is installed)
aborts the process when two threads launch parallel kernels concurrently,
which no caller here can rule out.

Results are bit-identical to the NumPy formulation (``np.repeat`` of the
offsets, ``1.0 / A.diagonal()``): integer additions are exact, and
``1 / d`` for float32 ``d`` computed in float64 and rounded to float32 equals
float32 division (double rounding is innocuous for division when the wider
format has at least ``2p + 2`` bits).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["active_rows", "address_pointer", "addresses", "gather", "gather_blocks", "inverse_diagonal_rows", "shift_blocks",
           "shift_blocks_jacobi"]


@intrinsic
def address_pointer(typingctx, address):
    """An integer address as a ``void*`` (for ``numba.carray``), in jitted code only."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


def addresses(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The data addresses of C-contiguous NumPy arrays, as int64 (the tables these kernels read).

    Through a ctypes view of each array's buffer (about 0.2 us an array)
    rather than ``a.ctypes.data`` (about 1 us): callers read several arrays
    of each of hundreds of systems, holding the GIL. A read-only or empty
    array has no such view and takes ``a.ctypes.data``.
    """
    view, address = ctypes.c_char.from_buffer, ctypes.addressof
    try:  # one list, one conversion: no NumPy item assignment per array
        return np.array([address(view(a)) for a in arrays], dtype=np.int64)
    except (TypeError, ValueError):
        pass
    out = np.empty(len(arrays), dtype=np.int64)
    for k, a in enumerate(arrays):
        try:
            out[k] = address(view(a))
        except (TypeError, ValueError):
            out[k] = a.ctypes.data
    return out


@numba.njit(nogil=True, cache=True)
def gather(addresses, lengths, out):
    """Concatenate arrays given by address into ``out``, in one call without the GIL.

    ``np.concatenate`` releases and re-takes the GIL around every input array
    it copies. With thousands of small systems a batch, each re-take waits
    for whatever other Python thread holds the GIL (up to the interpreter's
    switch interval), so packing beside one busy Python thread can take a
    hundred times longer than alone. Here the caller reads each array's
    address once (holding the GIL briefly) and the copies run in one
    GIL-free call.

    Parameters
    ----------
    addresses : int64 array, shape (k,)
        Data addresses of C-contiguous arrays of ``out``'s dtype, alive for the call.
    lengths : int64 array, shape (k,)
        Their lengths; ``out`` holds ``lengths.sum()`` elements.
    out : 1-D array
    """
    pos = 0
    for k in range(addresses.shape[0]):
        n = lengths[k]
        src = numba.carray(address_pointer(addresses[k]), (n,), out.dtype)
        # An element loop rather than ``out[pos:pos + n] = src``: the same machine
        # code (a vectorised copy), but a slice assignment also compiles its
        # shape-mismatch error message (string formatting), which made this
        # small kernel take about two seconds to compile on a cold cache.
        dst = out[pos:pos + n]
        for i in range(n):
            dst[i] = src[i]
        pos += n


@numba.njit(nogil=True, cache=True)
def gather_blocks(lo, hi, idx_addresses, ptr_addresses, offsets, nnz_off, indptr, indices,
                  row_sys):
    """:func:`gather` of systems ``lo:hi``'s indices and row pointers fused with :func:`shift_blocks`.

    One pass writes the block-diagonal arrays straight from each system's
    own: ``indices`` gets its column indices plus ``offsets[k]``, ``indptr``
    its row pointers (without the last) plus ``nnz_off[k]``, and ``row_sys``
    is filled with ``k``. The separate copy-then-shift formulation reads and
    writes the index arrays twice; on two GPUs' stagers packing at once the
    host's memory traffic is what limits packing.

    Parameters
    ----------
    lo, hi : int
        The systems to pack (``hi`` excluded).
    idx_addresses, ptr_addresses : int64 arrays, shape (nsys,)
        Data addresses of each system's ``indices`` and ``indptr[:-1]``,
        C-contiguous and of ``indices``' and ``indptr``'s dtypes, alive for the call.
    offsets, nnz_off : int64 arrays, shape (nsys + 1,)
        First row and first stored entry of each system in the batch.
    indptr, indices, row_sys : arrays
        The batch's outputs, as in :func:`shift_blocks`.
    """
    for k in range(lo, hi):
        r0, r1, z0, z1 = offsets[k], offsets[k + 1], nnz_off[k], nnz_off[k + 1]
        ix, ip, rs = indices[z0:z1], indptr[r0:r1], row_sys[r0:r1]
        src_ix = numba.carray(address_pointer(idx_addresses[k]), (z1 - z0,), indices.dtype)
        src_ip = numba.carray(address_pointer(ptr_addresses[k]), (r1 - r0,), indptr.dtype)
        col = indices.dtype.type(r0)
        start = indptr.dtype.type(z0)
        for j in range(ix.shape[0]):
            ix[j] = src_ix[j] + col
        for i in range(ip.shape[0]):
            ip[i] = src_ip[i] + start
        for i in range(rs.shape[0]):
            rs[i] = k


@numba.njit(nogil=True, cache=True)
def shift_blocks(lo, hi, offsets, nnz_off, indptr, indices, row_sys):
    """Make systems ``lo:hi`` of concatenated CSR arrays block-diagonal, in place.

    Parameters
    ----------
    lo, hi : int
        The systems to fix (``hi`` excluded); other parts of the arrays are not touched.
    offsets, nnz_off : int64 arrays, shape (nsys + 1,)
        First row and first stored entry of each system in the batch.
    indptr : int32 or int64 array, shape (n + 1,)
        Rows ``offsets[k]:offsets[k+1]`` hold system ``k``'s own ``indptr[:-1]``;
        ``nnz_off[k]`` is added to them.
    indices : int32 or int64 array, shape (nnz,)
        Entries ``nnz_off[k]:nnz_off[k+1]`` hold system ``k``'s own column
        indices; ``offsets[k]`` is added to them.
    row_sys : int32 array, shape (n,)
        Filled with ``k`` on system ``k``'s rows.
    """
    for k in range(lo, hi):
        r0, r1, z0, z1 = offsets[k], offsets[k + 1], nnz_off[k], nnz_off[k + 1]
        # Loops over per-system views from 0: Numba drops its wrap-around
        # checks and vectorises them (2.0 instead of 5.1 ns a row for W2).
        ix, ip, rs = indices[z0:z1], indptr[r0:r1], row_sys[r0:r1]
        if r0 != 0:  # the first system's indices are already global
            for j in range(ix.shape[0]):
                ix[j] += r0
        if z0 != 0:
            for i in range(ip.shape[0]):
                ip[i] += z0
        for i in range(rs.shape[0]):
            rs[i] = k


# error_model="numpy": 1 / 0 gives inf (the caller reports it) instead of raising.
@numba.njit(nogil=True, cache=True, error_model="numpy")
def shift_blocks_jacobi(lo, hi, offsets, nnz_off, indptr, indices, row_sys, data, dinv):
    """:func:`shift_blocks` plus the inverse diagonal ``dinv[i] = 1 / a_ii`` of each row.

    ``data`` holds the packed values (``data[nnz_off[k]:nnz_off[k+1]]`` are
    system ``k``'s entries); ``a_ii`` is the sum of row ``i``'s entries in
    column ``i`` (zero when none is stored), as ``scipy.sparse``'s
    ``diagonal()`` gives it.

    Returns
    -------
    int
        The first row (global) of systems ``lo:hi`` whose diagonal entry has
        no finite reciprocal in ``dinv``'s dtype (zero, or so small that
        ``1 / a_ii`` overflows), or -1 when there is none; the caller reports
        the system.
    """
    first_zero = -1
    zero = np.zeros(1, dtype=data.dtype)[0]  # sums in the values' dtype, as scipy's diagonal()
    for k in range(lo, hi):
        r0, r1, z0, z1 = offsets[k], offsets[k + 1], nnz_off[k], nnz_off[k + 1]
        ix, dv, ip = indices[z0:z1], data[z0:z1], indptr[r0:r1]
        rs, di = row_sys[r0:r1], dinv[r0:r1]
        m, nz = ip.shape[0], ix.shape[0]
        for i in range(m):
            # Local row pointers: the next row's is not shifted yet; the last
            # row ends at the system's stored-entry count. Unsigned loop
            # bounds spare Numba's wrap-around checks.
            start = np.uint64(ip[i])
            stop = np.uint64(ip[i + 1]) if i + 1 < m else np.uint64(nz)
            d = zero
            for j in range(start, stop):
                c = ix[j]
                if c == i:
                    d += dv[j]
                ix[j] = c + r0
            ip[i] += z0
            rs[i] = k
            di[i] = 1.0 / d
            if not np.isfinite(di[i]) and first_zero < 0:
                first_zero = r0 + i
    return first_zero


@numba.njit(nogil=True, cache=True, error_model="numpy")
def inverse_diagonal_rows(ra, rb, indptr, indices, data, col0, out):
    """``out[i - ra] = 1 / a_ii`` for rows ``ra:rb`` of one system, from its packed entries.

    ``pack_host`` splits a system too large for one copy piece into row
    ranges, copied in parallel; each range's Jacobi diagonal is read here
    from the entries it has just packed (cast to the batch's dtype, so the
    result is the same as :func:`shift_blocks_jacobi`'s).

    Parameters
    ----------
    ra, rb : int
        Rows of the system (its own numbering).
    indptr : int array
        The system's own row pointers (row ``i`` holds entries ``indptr[i]:indptr[i+1]``).
    indices, data : arrays
        The system's packed column indices (already shifted by ``col0``) and values.
    col0 : int
        The system's first row in the batch (its column shift).
    out : array, shape (rb - ra,)

    Returns
    -------
    int
        The first row of ``ra:rb`` (own numbering) whose diagonal entry has no
        finite reciprocal in ``out``'s dtype (as :func:`shift_blocks_jacobi`), or -1.
    """
    first_zero = -1
    zero = np.zeros(1, dtype=data.dtype)[0]  # sums in the values' dtype, as scipy's diagonal()
    for i in range(ra, rb):
        d = zero
        for j in range(indptr[i], indptr[i + 1]):
            if indices[j] == i + col0:
                d += data[j]
        out[i - ra] = 1.0 / d
        if not np.isfinite(out[i - ra]) and first_zero < 0:
            first_zero = i
    return first_zero


@numba.njit(nogil=True, cache=True)
def active_rows(starts, lens, out):
    """The rows ``starts[j] .. starts[j] + lens[j] - 1`` of each system ``j``, one after another.

    The batched CUDA solver's compaction list (rows of the systems still
    running), written straight into its page-locked upload buffer without
    the GIL: NumPy's ``arange + repeat`` formulation holds the GIL for the
    whole list, which at millions of rows stalls the other GPUs' threads.

    Parameters
    ----------
    starts, lens : int64 arrays, shape (k,)
        First row (in the batch) and row count of each running system.
    out : int32 or int64 array, shape (lens.sum(),)
    """
    pos = 0
    for j in range(starts.shape[0]):
        s, n = starts[j], lens[j]
        seg = out[pos:pos + n]
        for i in range(n):
            seg[i] = s + i
        pos += n
