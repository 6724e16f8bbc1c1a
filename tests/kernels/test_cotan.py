"""Cotangent Laplacian and triangle mass kernels against a vectorised NumPy/SciPy reference."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from managed_solve import assembly
from managed_solve.mesh import Mesh, icosphere, torus

BACKENDS = [
    "cpu",
    pytest.param("cudasim", marks=pytest.mark.cudasim),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def reference_cotan(V: np.ndarray, F: np.ndarray) -> sp.csr_matrix:
    """L = D - W with W_ij = (cot a_ij + cot b_ij)/2, from COO triplets (the textbook way)."""
    n = len(V)
    i, j, k = F.T

    def cot(a, b, c):  # angle at a in triangle (a, b, c)
        u, v = V[b] - V[a], V[c] - V[a]
        return (u * v).sum(1) / np.linalg.norm(np.cross(u, v), axis=1)

    ci, cj, ck = cot(i, j, k), cot(j, k, i), cot(k, i, j)
    rows = np.concatenate([i, j, j, k, k, i])
    cols = np.concatenate([j, i, k, j, i, k])
    w = 0.5 * np.concatenate([ck, ck, ci, ci, cj, cj])
    W = sp.coo_matrix((w, (rows, cols)), shape=(n, n)).tocsr()
    return (sp.diags(np.asarray(W.sum(axis=1)).ravel()) - W).tocsr()


def reference_mass(V: np.ndarray, F: np.ndarray) -> sp.csr_matrix:
    n = len(V)
    area = 0.5 * np.linalg.norm(np.cross(V[F[:, 1]] - V[F[:, 0]], V[F[:, 2]] - V[F[:, 0]]), axis=1)
    rows = np.repeat(F, 3, axis=1).ravel()
    cols = np.tile(F, (1, 3)).ravel()
    local = (np.ones((3, 3)) + np.eye(3)).ravel() / 12.0
    return sp.coo_matrix(((area[:, None] * local).ravel(), (rows, cols)), shape=(n, n)).tocsr()


def perturbed_icosphere(k: int, seed: int) -> Mesh:
    rng = np.random.default_rng(seed)
    m = icosphere(k)
    h = m.mean_edge_length()
    V = m.vertices * (1 + 0.2 * rng.uniform(-1, 1, (m.n_vertices, 1)))
    return Mesh(V + 0.2 * h * rng.standard_normal(V.shape), m.faces)


def run(backend: str, mesh: Mesh, **kwargs):
    device = "cuda:0" if backend == "cuda" else "cpu"
    A = assembly.assemble(mesh, device=device, backend=backend, **kwargs)
    if backend == "cuda":
        import cupyx.scipy.sparse as csp

        assert isinstance(A, csp.csr_matrix)
        A = A.get()
    assert isinstance(A, sp.csr_matrix)
    return A


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_laplacian_matches_reference(backend, seed):
    m = perturbed_icosphere(2, seed)
    L = run(backend, m)
    R = reference_cotan(m.vertices, m.faces)
    assert L.has_sorted_indices
    assert L.nnz == R.nnz == m.n_vertices + 2 * len(m.edges())
    assert abs(L - R).max() <= 1e-12 * abs(R).max()
    assert abs(L - L.T).max() <= 1e-13 * abs(R).max()
    assert np.abs(np.asarray(L.sum(axis=1))).max() <= 1e-12 * abs(R).max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mass_and_combination_match_reference(backend):
    m = perturbed_icosphere(2, 3)
    M = reference_mass(m.vertices, m.faces)
    L = reference_cotan(m.vertices, m.faces)
    D = sp.diags(np.asarray(M.sum(axis=1)).ravel())
    A = run(backend, m, stiffness=0.3, mass=2.0, lumped_mass=-0.5)
    assert abs(A - (0.3 * L + 2.0 * M - 0.5 * D)).max() <= 1e-12 * abs(L).max()
    Ml = run(backend, m, stiffness=0.0, lumped_mass=1.0)
    assert abs(Ml - D).max() <= 1e-15
    assert Ml.sum() == pytest.approx(m.area(), rel=1e-13)


def test_float32_values_round_from_float64():
    m = torus(nu=20, nv=10)
    L64 = assembly.assemble(m)
    L32 = assembly.assemble(m, dtype=np.float32)
    assert L32.dtype == np.float32 and L64.dtype == np.float64
    assert np.array_equal(L32.indices, L64.indices)
    assert np.abs(L32.data - L64.data).max() <= 4 * np.finfo(np.float32).eps * np.abs(L64.data).max()


def test_lumped_mass_vector_is_row_sum_of_consistent_mass():
    m = perturbed_icosphere(1, 4)
    w = assembly.lumped_mass(m)
    M = reference_mass(m.vertices, m.faces)
    np.testing.assert_allclose(w, np.asarray(M.sum(axis=1)).ravel(), rtol=1e-14)


@pytest.mark.cudasim
def test_lumped_mass_vector_cudasim_matches_cpu():
    m = perturbed_icosphere(1, 5)
    np.testing.assert_allclose(assembly.lumped_mass(m, backend="cudasim"), assembly.lumped_mass(m),
                               rtol=1e-14)


def test_laplacian_of_linear_function_on_flat_grid_vanishes_inside():
    from managed_solve.mesh import grid

    m = grid(7, 6)
    L = assembly.assemble(m)
    x = m.vertices[:, 0] + 2 * m.vertices[:, 1]
    inner = np.setdiff1d(np.arange(m.n_vertices), m.boundary_vertices())
    assert np.abs((L @ x)[inner]).max() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [2.0**266, 2.0**-266], ids=["1e80", "1e-80"])
def test_extreme_coordinate_scales_give_the_unit_values_scaled(backend, scale):
    # |e1 x e2| of edges near 1e80 squares past float64 (the Laplacian came out NaN,
    # "NaN or Inf entries" for a finite mesh), near 1e-80 into subnormals. A power
    # of two scales exactly: L is scale-free, the masses scale with the area.
    m = perturbed_icosphere(1, 6)
    big = Mesh(m.vertices * scale, m.faces)
    L = run(backend, big)
    np.testing.assert_array_equal(L.data, run(backend, m).data)
    R = reference_cotan(m.vertices, m.faces)
    assert abs(L - R).max() <= 1e-12 * abs(R).max()
    M = run(backend, big, stiffness=0.0, mass=1.0, lumped_mass=0.5)
    np.testing.assert_array_equal(M.data, run(backend, m, stiffness=0.0, mass=1.0, lumped_mass=0.5).data
                                  * scale**2)
    device = "cuda:0" if backend == "cuda" else "cpu"
    w = assembly.lumped_mass(big, device=device, backend=backend)
    w = w.get() if backend == "cuda" else w
    np.testing.assert_allclose(w, np.asarray(reference_mass(m.vertices, m.faces).sum(axis=1)).ravel()
                               * scale**2, rtol=1e-14)
