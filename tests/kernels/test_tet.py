"""P1 stiffness and mass on tetrahedra against a vectorised NumPy/SciPy reference."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from scipy.spatial import Delaunay

from managed_solve import assembly
from managed_solve.mesh import Mesh, grid

BACKENDS = [
    "cpu",
    pytest.param("cudasim", marks=pytest.mark.cudasim),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def reference_p1(V: np.ndarray, T: np.ndarray) -> tuple[sp.csr_matrix, sp.csr_matrix]:
    """Stiffness and consistent mass from batched 4x4 inverses and COO triplets."""
    n, m = len(V), len(T)
    P = np.concatenate([np.ones((m, 4, 1)), V[T]], axis=2)  # rows [1, x, y, z]
    C = np.linalg.inv(P)  # column j: coefficients of basis function j
    G = np.transpose(C[:, 1:, :], (0, 2, 1))  # (m, 4, 3) gradients
    vol = np.abs(np.linalg.det(P)) / 6.0
    K = vol[:, None, None] * np.einsum("eid,ejd->eij", G, G)
    Me = vol[:, None, None] * (np.ones((4, 4)) + np.eye(4)) / 20.0
    rows = np.repeat(T, 4, axis=1).ravel()
    cols = np.tile(T, (1, 4)).ravel()
    return (sp.coo_matrix((K.ravel(), (rows, cols)), shape=(n, n)).tocsr(),
            sp.coo_matrix((Me.ravel(), (rows, cols)), shape=(n, n)).tocsr())


def random_tets(npts: int, seed: int) -> Mesh:
    rng = np.random.default_rng(seed)
    pts = rng.uniform(0, 1, (npts, 3))
    return Mesh(pts, Delaunay(pts).simplices)


def run(backend: str, mesh: Mesh, **kwargs):
    device = "cuda:0" if backend == "cuda" else "cpu"
    A = assembly.assemble(mesh, device=device, backend=backend, **kwargs)
    if backend == "cuda":
        import cupyx.scipy.sparse as csp

        assert isinstance(A, csp.csr_matrix)
        A = A.get()
    return A


@pytest.mark.parametrize("backend", BACKENDS)
def test_stiffness_and_mass_match_reference(backend):
    m = random_tets(60, seed=0)
    K, M = reference_p1(m.vertices, m.faces)
    A = run(backend, m)
    assert A.nnz == m.n_vertices + 2 * len(m.edges())
    assert abs(A - K).max() <= 1e-11 * abs(K).max()
    assert abs(A - A.T).max() <= 1e-12 * abs(K).max()
    assert np.abs(np.asarray(A.sum(axis=1))).max() <= 1e-11 * abs(K).max()
    B = run(backend, m, stiffness=0.0, mass=1.0)
    assert abs(B - M).max() <= 1e-14
    D = run(backend, m, stiffness=0.0, lumped_mass=1.0)
    assert D.sum() == pytest.approx(m.volume(), rel=1e-13)


def test_larger_random_mesh_and_unit_cube_volume():
    m = random_tets(2000, seed=1)
    K, _ = reference_p1(m.vertices, m.faces)
    assert abs(assembly.assemble(m) - K).max() <= 1e-11 * abs(K).max()
    cube = grid(5, 4, 6)
    assert assembly.lumped_mass(cube).sum() == pytest.approx(1.0, rel=1e-13)
    # P1 reproduces linear functions: K x = 0 at interior vertices.
    x = cube.vertices @ np.array([1.0, -2.0, 0.5])
    inner = np.setdiff1d(np.arange(cube.n_vertices), cube.boundary_vertices())
    assert np.abs((assembly.assemble(cube) @ x)[inner]).max() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [2.0**266, 2.0**-300], ids=["1e80", "1e-90"])
def test_extreme_coordinate_scales_give_the_unit_values_scaled(backend, scale):
    # g_l . g_j holds fourth powers of the edges (past float64 near 1e80, subnormal
    # near 1e-80). A power of two scales exactly: K scales as a length, M as a volume.
    m = random_tets(30, seed=2)
    big = Mesh(m.vertices * scale, m.faces)
    K, M = reference_p1(m.vertices, m.faces)
    A = run(backend, big)
    np.testing.assert_array_equal(A.data, run(backend, m).data * scale)
    assert abs(A / scale - K).max() <= 1e-11 * abs(K).max()
    B = run(backend, big, stiffness=0.0, mass=1.0, lumped_mass=0.5)
    np.testing.assert_array_equal(B.data, run(backend, m, stiffness=0.0, mass=1.0, lumped_mass=0.5).data
                                  * scale**3)
    assert abs(B / scale**3 - (M + 0.5 * sp.diags(np.asarray(M.sum(axis=1)).ravel()))).max() <= 1e-14
