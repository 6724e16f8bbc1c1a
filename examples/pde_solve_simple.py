"""The usual single-GPU code, point by point: neighbours, system, solve, one at a time.

This is what users write before managed-solve (and what it replaces): Python
loops over triangles to find neighbours and cotangent weights, a COO -> CSR
conversion, then one solver call per system in a loop, on one device
(cupyx's cg when a GPU is usable, SciPy's otherwise).

Problem: backward-Euler heat steps on the unit sphere,
``(M + dt L) u = M u0`` for several ``dt``, with ``L`` the cotangent
Laplacian (positive semi-definite) and ``M`` the lumped (barycentric) mass.

Run: ``python examples/pde_solve_simple.py [--small]``; prints ``checksum=...``
(the sum over systems of the mass-weighted L2 norm of u), which
``pde_solve_managed.py`` reproduces.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import scipy.sparse as sp


def icosphere_naive(subdivisions: int):
    """Unit icosphere, subdividing with a Python dict of edge midpoints."""
    t = (1.0 + 5 ** 0.5) / 2.0
    verts = [(-1, t, 0), (1, t, 0), (-1, -t, 0), (1, -t, 0), (0, -1, t), (0, 1, t), (0, -1, -t), (0, 1, -t),
             (t, 0, -1), (t, 0, 1), (-t, 0, -1), (-t, 0, 1)]
    verts = [tuple(np.array(v) / np.linalg.norm(v)) for v in verts]
    faces = [(0, 11, 5), (0, 5, 1), (0, 1, 7), (0, 7, 10), (0, 10, 11), (1, 5, 9), (5, 11, 4), (11, 10, 2),
             (10, 7, 6), (7, 1, 8), (3, 9, 4), (3, 4, 2), (3, 2, 6), (3, 6, 8), (3, 8, 9), (4, 9, 5),
             (2, 4, 11), (6, 2, 10), (8, 6, 7), (9, 8, 1)]
    for _ in range(subdivisions):
        mid: dict = {}

        def midpoint(a, b, mid=mid):
            key = (min(a, b), max(a, b))
            if key not in mid:
                p = (np.array(verts[a]) + np.array(verts[b])) / 2.0
                verts.append(tuple(p / np.linalg.norm(p)))
                mid[key] = len(verts) - 1
            return mid[key]

        new = []
        for a, b, c in faces:
            ab, bc, ca = midpoint(a, b), midpoint(b, c), midpoint(c, a)
            new += [(a, ab, ca), (b, bc, ab), (c, ca, bc), (ab, bc, ca)]
        faces = new
    return np.array(verts), np.array(faces)


def assemble_naive(V, F):
    """Cotangent Laplacian and lumped mass, one triangle at a time."""
    neighbours = [set() for _ in range(len(V))]
    rows, cols, vals = [], [], []
    mass = np.zeros(len(V))
    for tri in F:
        for k in range(3):
            i, j, o = tri[k], tri[(k + 1) % 3], tri[(k + 2) % 3]
            neighbours[i].add(j)
            neighbours[j].add(i)
            u, v = V[i] - V[o], V[j] - V[o]
            cot = float(np.dot(u, v) / np.linalg.norm(np.cross(u, v)))
            w = 0.5 * cot
            rows += [i, j, i, j]
            cols += [j, i, i, j]
            vals += [-w, -w, w, w]
        area = 0.5 * np.linalg.norm(np.cross(V[tri[1]] - V[tri[0]], V[tri[2]] - V[tri[0]]))
        for k in range(3):
            mass[tri[k]] += area / 3.0
    L = sp.coo_matrix((vals, (rows, cols)), shape=(len(V), len(V))).tocsr()
    return L, mass, neighbours


def solve_one(A, b, rtol):
    """One system on one device: cupyx cg on a usable GPU, SciPy cg otherwise."""
    try:
        import cupy as cp
        import cupyx.scipy.sparse as csp
        import cupyx.scipy.sparse.linalg as cla

        cp.cuda.runtime.getDeviceCount()
        x, info = cla.cg(csp.csr_matrix(A), cp.asarray(b), rtol=rtol, maxiter=10 * A.shape[0])
        return cp.asnumpy(x), info
    except Exception:
        import scipy.sparse.linalg as sla

        return sla.cg(A, b, rtol=rtol, maxiter=10 * A.shape[0])


def run(subdivisions: int, n_systems: int, rtol: float = 1e-10) -> float:
    V, F = icosphere_naive(subdivisions)
    L, mass, _ = assemble_naive(V, F)
    u0 = np.cos(3.0 * V[:, 2]) + V[:, 0]
    M = sp.diags(mass)
    checksum = 0.0
    for dt in np.geomspace(1e-3, 1e-1, n_systems):
        A = (M + dt * L).tocsr()
        x, info = solve_one(A, mass * u0, rtol)
        assert info == 0, f"cg did not converge for dt={dt}"
        checksum += math.sqrt(float(x @ (mass * x)))
    return checksum


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a quick run (tests)")
    args = p.parse_args(argv)
    sub, k = (2, 4) if args.small else (5, 16)
    t0 = time.perf_counter()
    checksum = run(sub, k)
    print(f"{k} systems on icosphere({sub}) in {time.perf_counter() - t0:.2f} s")
    print(f"checksum={checksum:.10f}")
    assert math.isfinite(checksum)
    return checksum


if __name__ == "__main__":
    main()
