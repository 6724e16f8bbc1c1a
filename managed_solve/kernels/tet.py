"""Numeric assembly on tetrahedra: P1 stiffness and mass, CPU and CUDA twins.

Same scheme as ``cotan.py``: one pass writes ``data = a*K + b*M + c*D`` into
the CSR pattern from ``pattern.py``, where ``K_ij = vol * grad(phi_i) .
grad(phi_j)`` is the P1 stiffness (positive semi-definite, zero row sums),
``M`` the consistent mass (``vol/20 * (1 + delta_ij)``) and ``D`` the lumped
mass (``vol/4`` per vertex, on the diagonal). Thread ``i`` gathers the
tetrahedra around vertex ``i``, so writes never race.
"""

from __future__ import annotations  # noqa: I001  (the shim must run before numba.cuda is imported)

from . import _compat  # noqa: F401  (must precede numba.cuda)

import math  # noqa: E402

import numba  # noqa: E402
from numba import cuda, prange  # noqa: E402


@numba.njit(inline="always")
def tetra_row(l, x0, y0, z0, x1, y1, z1, x2, y2, z2, x3, y3, z3):
    """Row ``l`` (0..3) of the P1 stiffness of tetrahedron (p0, p1, p2, p3), and its volume.

    Returns ``(k0, k1, k2, k3, vol)``, ``kj = vol * grad(phi_l) . grad(phi_j)``.
    Gradients: with ``e_j = p_j - p0`` and ``det = e1 . (e2 x e3)``,
    ``grad(phi_1) = (e2 x e3)/det`` (cyclically) and ``grad(phi_0) = -sum``.
    A ``@numba.njit`` function called from both the CPU twin and the CUDA kernel.

    The edges are first divided by the power of two nearest their largest
    component (exact), so the products (fourth powers of the edge length in
    ``g_l . g_j``) neither overflow nor underflow at any coordinate scale;
    ``kj`` (which scales as a length) and ``vol`` are scaled back last, so the
    results equal the unscaled formulas bit for bit wherever those stay in range.
    """
    e1x = x1 - x0
    e1y = y1 - y0
    e1z = z1 - z0
    e2x = x2 - x0
    e2y = y2 - y0
    e2z = z2 - z0
    e3x = x3 - x0
    e3y = y3 - y0
    e3z = z3 - z0
    big = max(abs(e1x), abs(e1y), abs(e1z), abs(e2x), abs(e2y), abs(e2z),
              abs(e3x), abs(e3y), abs(e3z))
    q = math.frexp(big)[1]
    e1x = math.ldexp(e1x, -q)
    e1y = math.ldexp(e1y, -q)
    e1z = math.ldexp(e1z, -q)
    e2x = math.ldexp(e2x, -q)
    e2y = math.ldexp(e2y, -q)
    e2z = math.ldexp(e2z, -q)
    e3x = math.ldexp(e3x, -q)
    e3y = math.ldexp(e3y, -q)
    e3z = math.ldexp(e3z, -q)
    g1x = e2y * e3z - e2z * e3y
    g1y = e2z * e3x - e2x * e3z
    g1z = e2x * e3y - e2y * e3x
    g2x = e3y * e1z - e3z * e1y
    g2y = e3z * e1x - e3x * e1z
    g2z = e3x * e1y - e3y * e1x
    g3x = e1y * e2z - e1z * e2y
    g3y = e1z * e2x - e1x * e2z
    g3z = e1x * e2y - e1y * e2x
    det = e1x * g1x + e1y * g1y + e1z * g1z
    g0x = -(g1x + g2x + g3x)
    g0y = -(g1y + g2y + g3y)
    g0z = -(g1z + g2z + g3z)
    if l == 0:
        gx, gy, gz = g0x, g0y, g0z
    elif l == 1:
        gx, gy, gz = g1x, g1y, g1z
    elif l == 2:
        gx, gy, gz = g2x, g2y, g2z
    else:
        gx, gy, gz = g3x, g3y, g3z
    vol = math.ldexp(abs(det) / 6.0, 3 * q)
    # vol * (g_l / det) . (g_j / det) = (g_l . g_j) / (6 |det|)
    s = 1.0 / (6.0 * abs(det))
    k0 = math.ldexp(s * (gx * g0x + gy * g0y + gz * g0z), q)
    k1 = math.ldexp(s * (gx * g1x + gy * g1y + gz * g1z), q)
    k2 = math.ldexp(s * (gx * g2x + gy * g2y + gz * g2z), q)
    k3 = math.ldexp(s * (gx * g3x + gy * g3y + gz * g3z), q)
    return k0, k1, k2, k3, vol


def _assemble_row(i, vertices, tets, inc_ptr, inc_elem, inc_local, inc_slot, indptr,
                  a, b, c, data):
    for s in range(indptr[i], indptr[i + 1]):
        data[s] = 0
    for p in range(inc_ptr[i], inc_ptr[i + 1]):
        e = inc_elem[p]
        l = inc_local[p]
        v0 = tets[e, 0]
        v1 = tets[e, 1]
        v2 = tets[e, 2]
        v3 = tets[e, 3]
        k0, k1, k2, k3, vol = tetra_row(
            l,
            vertices[v0, 0], vertices[v0, 1], vertices[v0, 2],
            vertices[v1, 0], vertices[v1, 1], vertices[v1, 2],
            vertices[v2, 0], vertices[v2, 1], vertices[v2, 2],
            vertices[v3, 0], vertices[v3, 1], vertices[v3, 2])
        off = b * vol / 20.0
        data[inc_slot[p, 0]] += a * k0 + off
        data[inc_slot[p, 1]] += a * k1 + off
        data[inc_slot[p, 2]] += a * k2 + off
        data[inc_slot[p, 3]] += a * k3 + off
        data[inc_slot[p, l]] += (b / 20.0 + c / 4.0) * vol


def _lumped_row(i, vertices, tets, inc_ptr, inc_elem, inc_local, out):
    acc = 0.0
    for p in range(inc_ptr[i], inc_ptr[i + 1]):
        e = inc_elem[p]
        v0 = tets[e, 0]
        v1 = tets[e, 1]
        v2 = tets[e, 2]
        v3 = tets[e, 3]
        _, _, _, _, vol = tetra_row(
            0,
            vertices[v0, 0], vertices[v0, 1], vertices[v0, 2],
            vertices[v1, 0], vertices[v1, 1], vertices[v1, 2],
            vertices[v2, 0], vertices[v2, 1], vertices[v2, 2],
            vertices[v3, 0], vertices[v3, 1], vertices[v3, 2])
        acc += vol / 4.0
    out[i] = acc


_assemble_row_cpu = numba.njit(_assemble_row, cache=True)
_assemble_row_dev = cuda.jit(device=True)(_assemble_row)
_lumped_row_cpu = numba.njit(_lumped_row, cache=True)
_lumped_row_dev = cuda.jit(device=True)(_lumped_row)


@numba.njit(parallel=True, cache=True)
def assemble_cpu(vertices, tets, inc_ptr, inc_elem, inc_local, inc_slot, indptr, a, b, c, data):
    """``data = a*K + b*M + c*D`` in the CSR pattern (CPU twin; rows in parallel)."""
    for i in prange(inc_ptr.shape[0] - 1):
        _assemble_row_cpu(i, vertices, tets, inc_ptr, inc_elem, inc_local, inc_slot, indptr,
                          a, b, c, data)


@cuda.jit(cache=True)
def assemble_cuda(vertices, tets, inc_ptr, inc_elem, inc_local, inc_slot, indptr, a, b, c, data):
    """CUDA twin of :func:`assemble_cpu` (one thread per row)."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _assemble_row_dev(i, vertices, tets, inc_ptr, inc_elem, inc_local, inc_slot, indptr,
                          a, b, c, data)


@numba.njit(parallel=True, cache=True)
def lumped_mass_cpu(vertices, tets, inc_ptr, inc_elem, inc_local, out):
    """``out[i]`` = lumped mass of vertex i (a quarter of the volume around it)."""
    for i in prange(inc_ptr.shape[0] - 1):
        _lumped_row_cpu(i, vertices, tets, inc_ptr, inc_elem, inc_local, out)


@cuda.jit(cache=True)
def lumped_mass_cuda(vertices, tets, inc_ptr, inc_elem, inc_local, out):
    """CUDA twin of :func:`lumped_mass_cpu`."""
    i = cuda.grid(1)
    if i < inc_ptr.shape[0] - 1:
        _lumped_row_dev(i, vertices, tets, inc_ptr, inc_elem, inc_local, out)
