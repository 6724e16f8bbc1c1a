"""Geodesic distance on a surface by the heat method, two operators set up once for many sources.

The heat method (Crane, Weischedel and Wardetzky, "Geodesics in Heat", 2013)
turns a distance computation into two sparse solves with fixed matrices:

1. heat: ``(M + t L) u = delta_source`` with ``M`` the lumped mass, ``L`` the
   cotangent Laplacian (positive semi-definite) and ``t = h**2`` (``h`` the
   mean edge length);
2. per face, the unit field ``X = -grad u / |grad u|`` (pointing away from
   the source);
3. Poisson: ``L phi = G^T (area * X)``, the weak form of ``Laplace(phi) =
   div X`` (``G`` is the face-gradient operator, and ``L = G^T diag(area) G``
   exactly); the distance is ``phi - phi(source)``.

Both matrices depend on the mesh only, so each becomes one
:class:`managed_solve.Solver` (factorisation or preconditioner made once) and
every source costs two solves; several sources go through as one ``(n, k)``
block. On a fine mesh give the Poisson solve ``poisson_method="direct"``
too: "auto" factorises up to 200k unknowns on the CPU and runs CG beyond,
and at 655k vertices CG with AMG to ``rtol=1e-10`` cost about 30 times the
factor's two triangular solves a source (``benchmarks/bench_geodesic.py``).

Three choices matter for the answer:

- The heat solve is ``method="direct"`` by default. ``u`` decays by a
  constant factor per edge hop away from the source (about ``1e-40`` across
  the sphere at ``icosphere(5)``), and only its direction per face is used:
  a Krylov solve stopped at ``rtol`` leaves absolute errors near
  ``rtol * |u|`` everywhere, which swamp those tiny values and scramble the
  far-field directions. A triangular solve of this M-matrix keeps every
  entry's relative accuracy.
- ``L`` has the constants in its null space. One vertex (vertex 0) is
  pinned to zero (its row and column replaced by the identity) rather than
  regularised as ``L + eps M``: the right-hand side ``G^T (area * X)`` sums
  to zero, so the pinned system's solution solves the singular one exactly
  (the dropped equation follows from the others), while ``eps M`` would bias
  the distance by ``O(eps)`` and make the matrix ill-conditioned like
  ``1/eps``. The pinned matrix keeps the pattern, stays SPD (Cholesky-like
  LU, CG) and serves every source; ``phi - phi(source)`` removes the pin.
- ``|grad u|`` is taken by ``hypot``, which scales: at ``icosphere(8)``
  (655k vertices) u falls to about ``1e-277`` at the antipode, and squaring
  gradients below ``1e-154`` underflows; a plain norm there loses the far
  half's directions (mean error 0.17 instead of 0.008).

On the unit sphere the exact distance is ``arccos(x . x_source)``; the
script prints the error for ``icosphere(3)``, ``icosphere(4)`` and
``icosphere(5)`` (it shrinks with refinement), the set-up time and the
time per source (one at a time and as a block), and compares with
potpourri3d's ``MeshHeatMethodDistanceSolver`` when it is importable.

Run: ``python examples/geodesic_heat.py [--small] [--device cpu|cuda:0]
[--levels 3 4 5] [--sources 8]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import scipy.sparse as sp

import managed_solve as ms
from managed_solve.assembly import assemble
from managed_solve.mesh import Mesh, icosphere

PIN = 0  # the vertex whose value the Poisson solve fixes (any vertex does)


def face_gradient(mesh: Mesh) -> tuple[sp.csr_matrix, np.ndarray]:
    """``G`` (3F x n, rows ``3f + c``) with ``(G u)[f]`` the gradient of the P1 function ``u`` on face f.

    The hat function of corner i of a triangle has the constant gradient
    ``N x e_i / (2 area)``, ``e_i`` the opposite edge in counter-clockwise
    order and ``N`` the unit normal. Also returns the face areas.
    """
    v, f = mesh.vertices, mesh.faces
    p = v[f]  # (F, 3 corners, 3 coords)
    cross = np.cross(p[:, 1] - p[:, 0], p[:, 2] - p[:, 0])
    area2 = np.linalg.norm(cross, axis=1)
    normal = cross / area2[:, None]
    rows, vals = [], []
    for i in range(3):
        edge = p[:, (i + 2) % 3] - p[:, (i + 1) % 3]  # opposite corner i, counter-clockwise
        vals.append(np.cross(normal, edge) / area2[:, None])  # (F, 3)
        rows.append(3 * np.arange(len(f))[:, None] + np.arange(3))
    cols = np.repeat(f.T[:, :, None], 3, axis=2)  # (3 corners, F, 3 coords)
    G = sp.csr_matrix((np.concatenate(vals).ravel(), (np.concatenate(rows).ravel(), cols.ravel())),
                      shape=(3 * len(f), len(v)))
    return G, area2 / 2


def weighted_directions(grad, area, xp=np):
    """``grad`` (F, 3, k) overwritten with ``area * X``, ``X = -grad / |grad|`` per face and column.

    ``|grad|`` comes from ``hypot``, which scales: far from the source u
    (and its gradient) falls below 1e-154, whose square underflows, and a
    plain ``sqrt(gx**2 + gy**2 + gz**2)`` would lose the direction there.
    Where u underflowed to zero (very far, on very fine meshes) there is no
    direction: X = 0.
    """
    size = xp.hypot(xp.hypot(grad[:, 0], grad[:, 1]), grad[:, 2])  # (F, k)
    weight = area[:, None] / xp.where(size > 0, size, xp.inf)
    grad *= -weight[:, None, :]
    return grad


def pinned(L: sp.csr_matrix, i: int) -> sp.csr_matrix:
    """``L`` with row and column ``i`` replaced by the identity's (explicit zeros keep the pattern)."""
    L = L.tocsr(copy=True)
    L.data[L.indptr[i]:L.indptr[i + 1]] = 0.0
    L.data[L.indices == i] = 0.0
    L[i, i] = 1.0  # the diagonal is in the pattern: no structural change
    return L


class HeatGeodesics:
    """Heat-method distances on one mesh: the heat and Poisson solvers made once, reused per source.

    Parameters
    ----------
    mesh : Mesh
        A triangle surface (closed, or with a boundary: then the Poisson
        problem takes natural boundary conditions).
    device : str
        ``"cpu"`` or ``"cuda:i"``; both solvers and the per-face algebra
        live there.
    heat_method, poisson_method : str
        Methods for the two solvers (see the module docstring for why the
        heat solve is direct).
    poisson_M : str or None
        The Poisson solve's preconditioner when it is iterative (``"amg"``
        suits this Laplacian at any size; ``"auto"``: the library's choice).
    t_coef : float
        ``t = t_coef * h**2``.
    """

    def __init__(self, mesh: Mesh, *, device: str = "cpu", heat_method: str = "direct",
                 poisson_method: str = "auto", poisson_M: str | None = "auto",
                 t_coef: float = 1.0, rtol: float = 1e-10):
        t0 = time.perf_counter()
        self.n = mesh.n_vertices
        t = t_coef * mesh.mean_edge_length() ** 2
        heat = assemble(mesh, stiffness=t, lumped_mass=1.0)  # M + t L in one pass
        L = assemble(mesh)
        G, area = face_gradient(mesh)
        self.assembly_seconds = time.perf_counter() - t0
        self.cuda = str(device).startswith("cuda")
        if self.cuda:
            import cupy as cp
            import cupyx.scipy.sparse as csp

            self.xp = cp
            with cp.cuda.Device(int(str(device).partition(":")[2] or 0)):
                self.G, self.area = csp.csr_matrix(G), cp.asarray(area)
                self.GT = self.G.T.tocsr()
        else:
            self.xp = np
            self.G, self.GT, self.area = G, G.T.tocsr(), area
        self.heat = ms.Solver(heat, method=heat_method, rtol=rtol, device=device, name="heat")
        self.poisson = ms.Solver(pinned(L, PIN), method=poisson_method, M=poisson_M, rtol=rtol,
                                 device=device, name="poisson")
        self.info: dict[str, dict] = {}  # the last solve's info, by solver name
        # The first solve of each finishes lazy set-up (a factorisation, a
        # preconditioner); count it with the set-up.
        self.distance(np.array([0]))
        self.setup_seconds = time.perf_counter() - t0 - self.assembly_seconds

    def distance(self, sources) -> np.ndarray:
        """Distances from each vertex in ``sources``: shape (n,) for one source, (n, k) for k."""
        xp = self.xp
        src = np.atleast_1d(np.asarray(sources))
        k = len(src)
        delta = xp.zeros((self.n, k))
        delta[xp.asarray(src), xp.arange(k)] = 1.0
        u = self._solve(self.heat, delta)
        grad = (self.G @ u).reshape(-1, 3, k)
        weighted_directions(grad, self.area, xp)  # in place: area * X
        rhs = self.GT @ grad.reshape(-1, k)
        rhs[PIN] = 0.0
        phi = self._solve(self.poisson, rhs)
        d = phi - phi[xp.asarray(src), xp.arange(k)]
        d = d.get() if self.cuda else d
        return d[:, 0] if np.ndim(sources) == 0 else d

    def _solve(self, solver: ms.Solver, B):
        res = solver.solve(B if B.shape[1] > 1 else B[:, 0]).raise_for_status()
        # A block's info leaves out what a single solve names (the factorisation):
        # merged, the last of each is kept.
        self.info.setdefault(solver.system.name, {}).update(
            {**res.info, "iterations": res.iterations, "device": res.device})
        return res.x.reshape(B.shape)

    def close(self) -> None:
        self.heat.close()
        self.poisson.close()

    def __enter__(self) -> HeatGeodesics:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sphere_error(mesh: Mesh, d: np.ndarray, sources: np.ndarray) -> tuple[float, float]:
    """Mean and largest absolute error against ``arccos(x . x_source)`` on the unit sphere."""
    v = mesh.vertices
    exact = np.arccos(np.clip(v @ v[sources].T, -1.0, 1.0))
    err = np.abs(d.reshape(exact.shape) - exact)
    return float(err.mean()), float(err.max())


def compare_potpourri3d(mesh: Mesh, sources: np.ndarray, ours: np.ndarray) -> None:
    """Distances and times against potpourri3d's heat method on the same mesh (if importable)."""
    try:
        import potpourri3d as pp3d
    except ImportError:
        print("  potpourri3d: not installed (pip install potpourri3d) - comparison skipped")
        return
    t0 = time.perf_counter()
    # use_robust=False: the plain cotangent operators, as ours (an icosphere is Delaunay anyway).
    solver = pp3d.MeshHeatMethodDistanceSolver(mesh.vertices, mesh.faces, t_coef=1.0,
                                               use_robust=False)
    solver.compute_distance(int(sources[0]))  # geometry-central factors lazily, on first use
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    theirs = np.stack([solver.compute_distance(int(s)) for s in sources], axis=1)
    per = (time.perf_counter() - t0) / len(sources)
    diff = float(np.abs(theirs - ours).max())
    print(f"  potpourri3d: set-up {setup:.3f} s, {per * 1e3:.2f} ms per source; "
          f"largest |ours - theirs| = {diff:.2e}")


def run_level(level: int, sources: int, device: str, heat_method: str, poisson_method: str,
              compare: bool = True, seed: int = 0) -> tuple[float, float]:
    mesh = icosphere(level)
    src = np.random.default_rng(seed).choice(mesh.n_vertices, size=sources, replace=False)
    with HeatGeodesics(mesh, device=device, heat_method=heat_method,
                       poisson_method=poisson_method) as geo:
        t0 = time.perf_counter()
        one = np.stack([geo.distance(s) for s in src], axis=1)
        per_one = (time.perf_counter() - t0) / sources
        t0 = time.perf_counter()
        block = geo.distance(src)
        per_block = (time.perf_counter() - t0) / sources
        assembly, setup = geo.assembly_seconds, geo.setup_seconds
        methods = f"heat {geo.heat.method}, Poisson {geo.poisson.method}"
    assert np.allclose(one, block, atol=1e-8), "a block of sources must give the columns' answers"
    mean_err, max_err = sphere_error(mesh, block, src)
    print(f"icosphere({level}): {mesh.n_vertices:,} vertices, h = {mesh.mean_edge_length():.4f}; "
          f"{methods} on {device}")
    print(f"  assembly {assembly:.3f} s, solver set-up {setup:.3f} s; per source {per_one * 1e3:.2f} ms one at a time, "
          f"{per_block * 1e3:.2f} ms in a block of {sources}")
    print(f"  error vs arccos: mean {mean_err:.3e}, max {max_err:.3e}")
    if compare:
        compare_potpourri3d(mesh, src, block)
    return mean_err, max_err


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a quick run (tests): levels 2 3 4")
    p.add_argument("--device", default="cpu", help="cpu or cuda:i")
    p.add_argument("--levels", type=int, nargs="+", default=None,
                   help="icosphere subdivisions to run (default 3 4 5)")
    p.add_argument("--sources", type=int, default=8, help="sources per level")
    p.add_argument("--heat-method", default="direct", help="method of the heat solve")
    p.add_argument("--poisson-method", default="auto", help="method of the Poisson solve")
    p.add_argument("--no-compare", action="store_true", help="skip potpourri3d")
    args = p.parse_args(argv)
    levels = args.levels or ([2, 3, 4] if args.small else [3, 4, 5])
    assemble(icosphere(0))  # compile (or load) the assembly kernels before any timing
    errors = [run_level(k, args.sources, args.device, args.heat_method, args.poisson_method,
                        compare=not args.no_compare)[0] for k in levels]
    print("mean_errors=" + ",".join(f"{e:.4e}" for e in errors))
    return errors


if __name__ == "__main__":
    main()
