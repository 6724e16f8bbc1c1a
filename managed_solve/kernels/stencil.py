"""Finite-difference Laplacians on structured grids: 5-point (2-D) and 7-point (3-D).

Discretises ``-div(c grad u)`` on the nodes of an ``nx x ny x nz`` grid with
homogeneous Dirichlet values just outside it (the boundary nodes are
eliminated), with the coefficient given on cell faces:

    (A u)_i = sum over the 2d faces f of node i of c_f / h_f**2 * (u_i - u_neighbour(f))

where a neighbour outside the grid contributes ``u = 0``. ``cx`` has shape
``(nx+1, ny, nz)`` (``cx[ix]`` is the face between nodes ``ix-1`` and
``ix``), likewise ``cy``, ``cz``. A 2-D grid is ``nz = 1`` with ``cz = 0``:
the z terms vanish and the stencil is the 5-point one. Nodes are numbered in
C order, ``idx = (ix*ny + iy)*nz + iz``, and each row's columns come out
sorted. The matrix is symmetric positive definite.
"""

from __future__ import annotations  # noqa: I001  (the shim must run before numba.cuda is imported)

from . import _compat  # noqa: F401  (must precede numba.cuda)

import numba  # noqa: E402
from numba import cuda, prange  # noqa: E402


@numba.njit(inline="always")
def node_index(idx, ny, nz):
    """``(ix, iy, iz)`` of C-order node ``idx``."""
    iz = idx % nz
    t = idx // nz
    return t // ny, t % ny, iz


def _count_row(i, nx, ny, nz, row_nnz):
    ix, iy, iz = node_index(i, ny, nz)
    c = 1
    if ix > 0:
        c += 1
    if ix < nx - 1:
        c += 1
    if iy > 0:
        c += 1
    if iy < ny - 1:
        c += 1
    if iz > 0:
        c += 1
    if iz < nz - 1:
        c += 1
    row_nnz[i] = c


def _fill_row(i, nx, ny, nz, cx, cy, cz, ihx2, ihy2, ihz2, indptr, indices, data):
    ix, iy, iz = node_index(i, ny, nz)
    wxm = cx[ix, iy, iz] * ihx2
    wxp = cx[ix + 1, iy, iz] * ihx2
    wym = cy[ix, iy, iz] * ihy2
    wyp = cy[ix, iy + 1, iz] * ihy2
    wzm = cz[ix, iy, iz] * ihz2
    wzp = cz[ix, iy, iz + 1] * ihz2
    s = indptr[i]
    # Columns in increasing order: x-1, y-1, z-1, self, z+1, y+1, x+1.
    if ix > 0:
        indices[s] = i - ny * nz
        data[s] = -wxm
        s += 1
    if iy > 0:
        indices[s] = i - nz
        data[s] = -wym
        s += 1
    if iz > 0:
        indices[s] = i - 1
        data[s] = -wzm
        s += 1
    indices[s] = i
    data[s] = wxm + wxp + wym + wyp + wzm + wzp
    s += 1
    if iz < nz - 1:
        indices[s] = i + 1
        data[s] = -wzp
        s += 1
    if iy < ny - 1:
        indices[s] = i + nz
        data[s] = -wyp
        s += 1
    if ix < nx - 1:
        indices[s] = i + ny * nz
        data[s] = -wxp


_count_row_cpu = numba.njit(_count_row, cache=True)
_count_row_dev = cuda.jit(device=True)(_count_row)
_fill_row_cpu = numba.njit(_fill_row, cache=True)
_fill_row_dev = cuda.jit(device=True)(_fill_row)


@numba.njit(parallel=True, cache=True)
def row_counts_cpu(nx, ny, nz, row_nnz):
    """Entries per row of the stencil matrix (symbolic phase; ``indptr`` is their cumsum)."""
    for i in prange(nx * ny * nz):
        _count_row_cpu(i, nx, ny, nz, row_nnz)


@cuda.jit(cache=True)
def row_counts_cuda(nx, ny, nz, row_nnz):
    """CUDA twin of :func:`row_counts_cpu`."""
    i = cuda.grid(1)
    if i < nx * ny * nz:
        _count_row_dev(i, nx, ny, nz, row_nnz)


@numba.njit(parallel=True, cache=True)
def fill_cpu(nx, ny, nz, cx, cy, cz, ihx2, ihy2, ihz2, indptr, indices, data):
    """Write the column indices and values of every row (CPU twin)."""
    for i in prange(nx * ny * nz):
        _fill_row_cpu(i, nx, ny, nz, cx, cy, cz, ihx2, ihy2, ihz2, indptr, indices, data)


@cuda.jit(cache=True)
def fill_cuda(nx, ny, nz, cx, cy, cz, ihx2, ihy2, ihz2, indptr, indices, data):
    """CUDA twin of :func:`fill_cpu` (one thread per row)."""
    i = cuda.grid(1)
    if i < nx * ny * nz:
        _fill_row_dev(i, nx, ny, nz, cx, cy, cz, ihx2, ihy2, ihz2, indptr, indices, data)
