"""Numeric assembly on triangle surfaces: cotangent Laplacian and mass, CPU and CUDA twins.

One pass writes ``data = a*L + b*M + c*D`` into a CSR pattern from
``pattern.py``, where ``L`` is the cotangent Laplace-Beltrami matrix in its
positive semi-definite form (the P1 stiffness matrix, ``L = -Laplacian``):

    L_ij = -(cot alpha_ij + cot beta_ij) / 2   for an edge ij,
    L_ii = -sum_j L_ij                         (zero row sums),

``M`` the consistent P1 mass (``area/12 * (1 + delta_ij)`` per triangle) and
``D`` the lumped (row-sum) mass (``area/3`` per triangle and vertex, on the
diagonal). ``heat_step`` and ``screened_poisson`` thus cost one pass, not
three plus two sparse additions.

Race-free gather: thread (or ``prange`` iteration) ``i`` zeroes row ``i``
and adds the contributions of the triangles around vertex ``i``; each
triangle's cotangents are recomputed by its three vertices' threads, which
costs arithmetic (cheap) instead of atomics or a COO sort (memory traffic).
"""

from __future__ import annotations  # noqa: I001  (the shim must run before numba.cuda is imported)

from . import _compat  # noqa: F401  (must precede numba.cuda)

import math  # noqa: E402

import numba  # noqa: E402
from numba import cuda, prange  # noqa: E402


@numba.njit(inline="always")
def triangle_row(x0, y0, z0, x1, y1, z1, x2, y2, z2):
    """Cotangent weights and area of triangle (p0, p1, p2), seen from p0.

    Returns ``(w01, w02, area)`` with ``w01 = cot(angle at p2) / 2`` and
    ``w02 = cot(angle at p1) / 2``: the stiffness entries of row p0 are
    ``-w01`` (column p1), ``-w02`` (column p2) and ``w01 + w02`` (diagonal).
    A ``@numba.njit`` function called from both the CPU twin and the CUDA
    kernel (Numba compiles it for the calling target).

    The edges are first divided by the power of two nearest their largest
    component (exact), so the cross and dot products neither overflow nor
    underflow at any coordinate scale (coordinates near 1e80 would square
    past float64's range); the cotangents are scale-free and the area is
    scaled back last, so the results equal the unscaled formulas bit for bit
    wherever those stay in range.
    """
    ax = x1 - x0
    ay = y1 - y0
    az = z1 - z0
    bx = x2 - x0
    by = y2 - y0
    bz = z2 - z0
    big = max(abs(ax), abs(ay), abs(az), abs(bx), abs(by), abs(bz))
    q = math.frexp(big)[1]
    ax = math.ldexp(ax, -q)
    ay = math.ldexp(ay, -q)
    az = math.ldexp(az, -q)
    bx = math.ldexp(bx, -q)
    by = math.ldexp(by, -q)
    bz = math.ldexp(bz, -q)
    cx = math.ldexp(x2 - x1, -q)
    cy = math.ldexp(y2 - y1, -q)
    cz = math.ldexp(z2 - z1, -q)
    nx = ay * bz - az * by
    ny = az * bx - ax * bz
    nz = ax * by - ay * bx
    dbl = math.sqrt(nx * nx + ny * ny + nz * nz)  # twice the (scaled) area
    # cot of the angle between u and v is (u . v) / |u x v|; |u x v| = dbl for any two edges.
    w01 = 0.5 * (bx * cx + by * cy + bz * cz) / dbl
    w02 = -0.5 * (ax * cx + ay * cy + az * cz) / dbl
    return w01, w02, math.ldexp(0.5 * dbl, 2 * q)


def _assemble_row(i, vertices, faces, inc_ptr, inc_elem, inc_local, inc_slot, indptr,
                  a, b, c, data):
    for s in range(indptr[i], indptr[i + 1]):
        data[s] = 0
    diag = 0.0
    for p in range(inc_ptr[i], inc_ptr[i + 1]):
        e = inc_elem[p]
        l0 = inc_local[p]
        l1 = (l0 + 1) % 3
        l2 = (l0 + 2) % 3
        v0 = faces[e, l0]
        v1 = faces[e, l1]
        v2 = faces[e, l2]
        w01, w02, area = triangle_row(
            vertices[v0, 0], vertices[v0, 1], vertices[v0, 2],
            vertices[v1, 0], vertices[v1, 1], vertices[v1, 2],
            vertices[v2, 0], vertices[v2, 1], vertices[v2, 2])
        diag += a * (w01 + w02) + (b / 6.0 + c / 3.0) * area
        data[inc_slot[p, l1]] += -a * w01 + b * area / 12.0
        data[inc_slot[p, l2]] += -a * w02 + b * area / 12.0
    if inc_ptr[i + 1] > inc_ptr[i]:
        data[inc_slot[inc_ptr[i], inc_local[inc_ptr[i]]]] += diag


def _lumped_row(i, vertices, faces, inc_ptr, inc_elem, inc_local, out):
    acc = 0.0
    for p in range(inc_ptr[i], inc_ptr[i + 1]):
        e = inc_elem[p]
        v0 = faces[e, 0]
        v1 = faces[e, 1]
        v2 = faces[e, 2]
        _, _, area = triangle_row(
            vertices[v0, 0], vertices[v0, 1], vertices[v0, 2],
            vertices[v1, 0], vertices[v1, 1], vertices[v1, 2],
            vertices[v2, 0], vertices[v2, 1], vertices[v2, 2])
        acc += area / 3.0
    out[i] = acc


_assemble_row_cpu = numba.njit(_assemble_row, cache=True)
_assemble_row_dev = cuda.jit(device=True)(_assemble_row)
_lumped_row_cpu = numba.njit(_lumped_row, cache=True)
_lumped_row_dev = cuda.jit(device=True)(_lumped_row)


@numba.njit(parallel=True, cache=True)
def assemble_cpu(vertices, faces, inc_ptr, inc_elem, inc_local, inc_slot, indptr, a, b, c, data):
    """``data = a*L + b*M + c*D`` in the CSR pattern (CPU twin; rows in parallel)."""
    for i in prange(inc_ptr.shape[0] - 1):
        _assemble_row_cpu(i, vertices, faces, inc_ptr, inc_elem, inc_local, inc_slot, indptr,
                          a, b, c, data)


@cuda.jit(cache=True)
def assemble_cuda(vertices, faces, inc_ptr, inc_elem, inc_local, inc_slot, indptr, a, b, c, data):
    """CUDA twin of :func:`assemble_cpu` (one thread per row)."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _assemble_row_dev(i, vertices, faces, inc_ptr, inc_elem, inc_local, inc_slot, indptr,
                          a, b, c, data)


@numba.njit(parallel=True, cache=True)
def lumped_mass_cpu(vertices, faces, inc_ptr, inc_elem, inc_local, out):
    """``out[i]`` = lumped mass of vertex i (a third of the area around it)."""
    for i in prange(inc_ptr.shape[0] - 1):
        _lumped_row_cpu(i, vertices, faces, inc_ptr, inc_elem, inc_local, out)


@cuda.jit(cache=True)
def lumped_mass_cuda(vertices, faces, inc_ptr, inc_elem, inc_local, out):
    """CUDA twin of :func:`lumped_mass_cpu`."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _lumped_row_dev(i, vertices, faces, inc_ptr, inc_elem, inc_local, out)
