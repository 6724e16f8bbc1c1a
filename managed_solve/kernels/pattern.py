"""Symbolic phase of mesh assembly: vertex incidence, CSR pattern, slot map.

Run once per mesh (the result is cached by :mod:`managed_solve.assembly`);
the numeric kernels of ``cotan.py`` and ``tet.py`` then write values straight
into CSR ``data`` through the slot map, with no COO triplets and no sort.

Layout (``n`` vertices, ``m`` elements of ``k`` vertices):

- incidence, vertex-major: ``inc_ptr`` (n+1,) int64; for ``p`` in
  ``inc_ptr[i]:inc_ptr[i+1]``, ``inc_elem[p]`` is an element holding vertex
  ``i`` and ``inc_local[p]`` the position (0..k-1) of ``i`` in it. Elements of
  a row appear in increasing order, so results are deterministic.
- CSR pattern of vertex adjacency, ``indptr`` (n+1,), ``indices`` (nnz,),
  columns sorted in each row, the diagonal always present.
- slot map ``inc_slot`` (m*k, k): ``inc_slot[p, j]`` is the position in
  ``data`` of entry ``(i, elements[inc_elem[p], j])``. All slots of incidence
  ``p`` lie in row ``i``, so a thread owning row ``i`` owns every write it
  makes: the numeric phase is race-free without atomics.

Each kernel takes arrays and writes into arrays its caller allocated. The
per-row bodies are plain Python functions compiled twice, by ``numba.njit``
for the CPU twin (``prange`` over rows) and by ``numba.cuda.jit(device=True)``
for the CUDA kernel (one thread per row); the incidence is built on the GPU
with atomics and then sorted per vertex. Per-element math (``cotan.triangle_row``,
``tet.tetra_row``) is a ``@numba.njit`` function called from both: Numba
compiles an njit function for whichever target calls it, and the CUDA
simulator calls it as a normal function (numba-cuda with recent NumPy goes
through the ``_compat`` shim). Under the simulator, device functions receive wrapped arrays an
njit function cannot type, so only scalars cross into njit functions; the
row bodies, which index arrays, are therefore compiled twice instead of
being njit functions themselves. On the CPU the incidence is one serial
counting sort (tens of ms for millions of elements); every other pass is
parallel on both targets.
"""

from __future__ import annotations  # noqa: I001  (the shim must run before numba.cuda is imported)

from . import _compat  # noqa: F401  (must precede numba.cuda)

import numba  # noqa: E402
from numba import cuda, prange  # noqa: E402

TPB = _compat.THREADS_PER_BLOCK


@numba.njit(cache=True)
def incidence_cpu(elements, inc_ptr, inc_elem, inc_local):
    """Fill the vertex-to-element incidence (serial; counting sort by vertex).

    ``inc_ptr`` (n+1,) must hold zeros on entry; ``inc_elem``, ``inc_local``
    have ``m*k`` entries.
    """
    m, k = elements.shape
    n = inc_ptr.shape[0] - 1
    for e in range(m):
        for j in range(k):
            inc_ptr[elements[e, j] + 1] += 1
    for i in range(n):
        inc_ptr[i + 1] += inc_ptr[i]
    cursor = inc_ptr[:-1].copy()
    for e in range(m):
        for j in range(k):
            v = elements[e, j]
            p = cursor[v]
            inc_elem[p] = e
            inc_local[p] = j
            cursor[v] = p + 1


@cuda.jit(cache=True)
def incidence_count_cuda(elements, inc_ptr):
    """Counting pass of the incidence on the GPU (one thread per element, atomics).

    ``inc_ptr`` (n+1,) holds zeros on entry and the counts, shifted by one,
    on exit; its cumulative sum (``cupy.cumsum``) is the incidence pointer.
    Together with :func:`incidence_fill_cuda` and :func:`incidence_sort_cuda`
    the CUDA twin of :func:`incidence_cpu`.
    """
    e = cuda.grid(1)
    if e < elements.shape[0]:
        for j in range(elements.shape[1]):
            cuda.atomic.add(inc_ptr, elements[e, j] + 1, 1)


@cuda.jit(cache=True)
def incidence_fill_cuda(elements, cursor, inc_elem, inc_local):
    """Scatter (element, local index) into each vertex's range; ``cursor`` starts at ``inc_ptr[:-1]``."""
    e = cuda.grid(1)
    if e < elements.shape[0]:
        for j in range(elements.shape[1]):
            p = cuda.atomic.add(cursor, elements[e, j], 1)
            inc_elem[p] = e
            inc_local[p] = j


def _sort_incidence_row(i, inc_ptr, inc_elem, inc_local):
    # Atomics scatter in arbitrary order; sorting by element restores the
    # order of the serial CPU pass, so results do not depend on scheduling.
    for a in range(inc_ptr[i] + 1, inc_ptr[i + 1]):
        e = inc_elem[a]
        l = inc_local[a]
        b = a - 1
        while b >= inc_ptr[i] and inc_elem[b] > e:
            inc_elem[b + 1] = inc_elem[b]
            inc_local[b + 1] = inc_local[b]
            b -= 1
        inc_elem[b + 1] = e
        inc_local[b + 1] = l


_sort_incidence_row_dev = cuda.jit(device=True)(_sort_incidence_row)


@cuda.jit(cache=True)
def incidence_sort_cuda(inc_ptr, inc_elem, inc_local):
    """Sort each vertex's incidences by element (one thread per vertex)."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _sort_incidence_row_dev(i, inc_ptr, inc_elem, inc_local)


def _unique_neighbours_row(i, elements, inc_ptr, inc_elem, cand, row_nnz):
    """Collect the vertices of the elements around vertex i, sort and deduplicate in place."""
    k = elements.shape[1]
    start = inc_ptr[i] * k
    c = start
    for p in range(inc_ptr[i], inc_ptr[i + 1]):
        e = inc_elem[p]
        for j in range(k):
            cand[c] = elements[e, j]
            c += 1
    # Insertion sort: rows hold tens of candidates (about 18 on a triangle
    # surface, about 100 in a tetrahedral volume), where it beats anything fancier.
    for a in range(start + 1, c):
        x = cand[a]
        b = a - 1
        while b >= start and cand[b] > x:
            cand[b + 1] = cand[b]
            b -= 1
        cand[b + 1] = x
    u = 0
    for a in range(start, c):
        if a == start or cand[a] != cand[a - 1]:
            cand[start + u] = cand[a]
            u += 1
    row_nnz[i] = u


def _copy_row(i, inc_ptr, k, cand, indptr, indices):
    src = inc_ptr[i] * k
    for q in range(indptr[i + 1] - indptr[i]):
        indices[indptr[i] + q] = cand[src + q]


def _slots_row(i, elements, inc_ptr, inc_elem, indptr, indices, inc_slot):
    k = elements.shape[1]
    lo0 = indptr[i]
    hi0 = indptr[i + 1]
    for p in range(inc_ptr[i], inc_ptr[i + 1]):
        e = inc_elem[p]
        for j in range(k):
            col = elements[e, j]
            lo = lo0
            hi = hi0
            while hi - lo > 1:  # binary search: the column is present by construction
                mid = (lo + hi) // 2
                if indices[mid] <= col:
                    lo = mid
                else:
                    hi = mid
            inc_slot[p, j] = lo


_unique_neighbours_row_cpu = numba.njit(_unique_neighbours_row, cache=True)
_copy_row_cpu = numba.njit(_copy_row, cache=True)
_slots_row_cpu = numba.njit(_slots_row, cache=True)
_unique_neighbours_row_dev = cuda.jit(device=True)(_unique_neighbours_row)
_copy_row_dev = cuda.jit(device=True)(_copy_row)
_slots_row_dev = cuda.jit(device=True)(_slots_row)


@numba.njit(parallel=True, cache=True)
def unique_neighbours_cpu(elements, inc_ptr, inc_elem, cand, row_nnz):
    """Per row: sorted unique neighbours (the vertex itself included) into ``cand``; counts into ``row_nnz``.

    ``cand`` has ``m*k*k`` entries (row ``i`` uses ``cand[inc_ptr[i]*k:]``).
    """
    for i in prange(inc_ptr.shape[0] - 1):
        _unique_neighbours_row_cpu(i, elements, inc_ptr, inc_elem, cand, row_nnz)


@numba.njit(parallel=True, cache=True)
def copy_pattern_cpu(inc_ptr, k, cand, indptr, indices):
    """Copy each row's unique neighbours from ``cand`` into CSR ``indices``."""
    for i in prange(inc_ptr.shape[0] - 1):
        _copy_row_cpu(i, inc_ptr, k, cand, indptr, indices)


@numba.njit(parallel=True, cache=True)
def slot_map_cpu(elements, inc_ptr, inc_elem, indptr, indices, inc_slot):
    """``inc_slot[p, j]``: the CSR position of entry (row of p, elements[inc_elem[p], j])."""
    for i in prange(inc_ptr.shape[0] - 1):
        _slots_row_cpu(i, elements, inc_ptr, inc_elem, indptr, indices, inc_slot)


@cuda.jit(cache=True)
def unique_neighbours_cuda(elements, inc_ptr, inc_elem, cand, row_nnz):
    """CUDA twin of :func:`unique_neighbours_cpu` (one thread per row)."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _unique_neighbours_row_dev(i, elements, inc_ptr, inc_elem, cand, row_nnz)


@cuda.jit(cache=True)
def copy_pattern_cuda(inc_ptr, k, cand, indptr, indices):
    """CUDA twin of :func:`copy_pattern_cpu`."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _copy_row_dev(i, inc_ptr, k, cand, indptr, indices)


@cuda.jit(cache=True)
def slot_map_cuda(elements, inc_ptr, inc_elem, indptr, indices, inc_slot):
    """CUDA twin of :func:`slot_map_cpu`."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _slots_row_dev(i, elements, inc_ptr, inc_elem, indptr, indices, inc_slot)
