"""The same job written as a competent NumPy/SciPy user would, without managed-solve.

Vectorised NumPy throughout: the icosphere is subdivided with array
operations (edge midpoints found with ``np.unique``), the cotangent
Laplacian and lumped mass are assembled per corner for all triangles at once
and summed by SciPy's COO -> CSR conversion. Then one solve per system, on
one device: a sparse LU (``splu``, factorised once per matrix and applied to
its right-hand side) on the CPU, cupyx's ``cg`` when a GPU is usable (cupyx
has no fast sparse LU).

Problem: backward-Euler heat steps on the unit sphere,
``(M + dt L) u = M u0`` for several ``dt``, with ``L`` the cotangent
Laplacian (positive semi-definite) and ``M`` the lumped (barycentric) mass.
Each ``dt`` gives another matrix, so each system needs its own factorisation.

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
import scipy.sparse.linalg as sla


def icosphere(subdivisions: int) -> tuple[np.ndarray, np.ndarray]:
    """Unit icosphere: each subdivision splits every triangle into four, vectorised."""
    t = (1.0 + 5 ** 0.5) / 2.0
    V = np.array([(-1, t, 0), (1, t, 0), (-1, -t, 0), (1, -t, 0), (0, -1, t), (0, 1, t), (0, -1, -t),
                  (0, 1, -t), (t, 0, -1), (t, 0, 1), (-t, 0, -1), (-t, 0, 1)], dtype=float)
    V /= np.linalg.norm(V, axis=1)[:, None]
    F = np.array([(0, 11, 5), (0, 5, 1), (0, 1, 7), (0, 7, 10), (0, 10, 11), (1, 5, 9), (5, 11, 4),
                  (11, 10, 2), (10, 7, 6), (7, 1, 8), (3, 9, 4), (3, 4, 2), (3, 2, 6), (3, 6, 8),
                  (3, 8, 9), (4, 9, 5), (2, 4, 11), (6, 2, 10), (8, 6, 7), (9, 8, 1)])
    for _ in range(subdivisions):
        edges = np.sort(np.concatenate([F[:, [0, 1]], F[:, [1, 2]], F[:, [2, 0]]]), axis=1)
        unique, inverse = np.unique(edges, axis=0, return_inverse=True)
        mid = V[unique].mean(axis=1)
        V = np.vstack([V, mid / np.linalg.norm(mid, axis=1)[:, None]])
        m = len(V) - len(unique) + inverse.reshape(3, -1)  # (ab, bc, ca) for every face
        a, b, c = F.T
        F = np.concatenate([np.stack(q, axis=1) for q in
                            ((a, m[0], m[2]), (b, m[1], m[0]), (c, m[2], m[1]), (m[0], m[1], m[2]))])
    return V, F


def assemble(V: np.ndarray, F: np.ndarray) -> tuple[sp.csr_matrix, np.ndarray]:
    """Cotangent Laplacian and lumped mass, all triangles at once."""
    n = len(V)
    rows, cols, vals = [], [], []
    for k in range(3):  # the corner o opposite the edge (i, j)
        i, j, o = F[:, k], F[:, (k + 1) % 3], F[:, (k + 2) % 3]
        u, v = V[i] - V[o], V[j] - V[o]
        w = 0.5 * np.einsum("ij,ij->i", u, v) / np.linalg.norm(np.cross(u, v), axis=1)
        rows += [i, j, i, j]
        cols += [j, i, i, j]
        vals += [-w, -w, w, w]
    L = sp.coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(n, n)).tocsr()  # duplicates are summed
    area = 0.5 * np.linalg.norm(np.cross(V[F[:, 1]] - V[F[:, 0]], V[F[:, 2]] - V[F[:, 0]]), axis=1)
    mass = np.bincount(F.ravel(), weights=np.repeat(area / 3.0, 3), minlength=n)
    return L, mass


def solve_one(A, b, rtol):
    """One system on one device: cupyx cg on a usable GPU, a sparse LU (SuperLU) otherwise."""
    try:
        import cupy as cp
        import cupyx.scipy.sparse as csp
        import cupyx.scipy.sparse.linalg as cla

        cp.cuda.runtime.getDeviceCount()
    except Exception:
        return sla.splu(A.tocsc()).solve(b), 0
    x, info = cla.cg(csp.csr_matrix(A), cp.asarray(b), rtol=rtol, maxiter=10 * A.shape[0])
    return cp.asnumpy(x), info


def run(subdivisions: int, n_systems: int, rtol: float = 1e-10) -> float:
    V, F = icosphere(subdivisions)
    L, mass = assemble(V, F)
    u0 = np.cos(3.0 * V[:, 2]) + V[:, 0]
    M = sp.diags(mass)
    checksum = 0.0
    for dt in np.geomspace(1e-3, 1e-1, n_systems):
        A = (M + dt * L).tocsr()
        x, info = solve_one(A, mass * u0, rtol)
        assert info == 0, f"the solve did not converge for dt={dt}"
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
