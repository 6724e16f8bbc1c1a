"""Meshes: validation messages, generators, file input."""

from __future__ import annotations

import numpy as np
import pytest

from managed_solve.mesh import Mesh, grid, icosphere, read, torus

TRI = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]], float)


@pytest.mark.parametrize(
    ("vertices", "faces", "error", "match"),
    [
        (TRI, [[0, 1, 4]], ValueError, r"face 0 = \[0, 1, 4\] has a vertex index outside \[0, 4\)"),
        (TRI, [[0, 1, 2], [1, 3, -1]], ValueError, r"face 1 .* outside"),
        (TRI, [[0, 1, 2], [1, 3, 3]], ValueError, r"face 1 = \[1, 3, 3\] repeats a vertex"),
        (TRI, [[0, 1, 2], [1, 3, 2], [2, 0, 1]], ValueError, r"faces 0 and 2 use the same vertices"),
        (np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0], [0, 1, 0]], float), [[0, 3, 1], [0, 1, 2]],
         ValueError, r"face 1 = \[0, 1, 2\] has zero area"),
        (np.where(np.arange(12).reshape(4, 3) == 7, np.nan, TRI), [[0, 1, 2], [1, 3, 2]], ValueError,
         r"vertex 2 has non-finite coordinates"),
        (TRI, [[0, 1, 2]], ValueError, r"vertex 3 is used by no face"),
        (TRI, np.array([[0, 1, 2]], float), TypeError, r"faces must be an integer array.*got dtype float64"),
        (TRI.astype(complex), [[0, 1, 2]], TypeError, r"vertices must be a real numeric array"),
        (TRI[:, :1], [[0, 1, 2]], ValueError, r"vertices must have shape \(n, 3\) or \(n, 2\)"),
        (TRI, [[0, 1]], ValueError, r"faces must have shape \(m, 3\).*got shape \(1, 2\)"),
        (np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]], float), [[0, 1, 2, 3]], ValueError,
         r"face 0 = \[0, 1, 2, 3\] has zero volume"),
    ],
)
def test_validation_names_the_culprit(vertices, faces, error, match):
    with pytest.raises(error, match=match):
        Mesh(vertices, faces)


def test_mesh_is_read_only_and_2d_points_are_padded():
    m = Mesh(TRI[:, :2], [[0, 1, 2], [1, 3, 2]])
    assert m.vertices.shape == (4, 3) and m.faces.dtype == np.int32
    with pytest.raises(ValueError):
        m.vertices[0, 0] = 5.0
    assert m.area() == pytest.approx(1.0)
    assert len(m.boundary_faces()) == 4 and not m.is_closed()


@pytest.mark.parametrize("k", [0, 1, 3])
def test_icosphere(k):
    m = icosphere(k)
    assert m.n_vertices == 10 * 4**k + 2 and m.n_faces == 20 * 4**k
    np.testing.assert_allclose(np.linalg.norm(m.vertices, axis=1), 1.0, rtol=1e-15)
    assert m.is_closed() and m.n_vertices - len(m.edges()) + m.n_faces == 2
    v, f = m.vertices, m.faces
    normals = np.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]])
    assert (np.einsum("ij,ij->i", normals, v[f].mean(axis=1)) > 0).all()  # outward
    assert np.abs(m.vertex_normals() - v).max() < 0.05  # the sphere normal is the position
    assert m.area() < 4 * np.pi


def test_icosphere_area_tends_to_4pi():
    gaps = [4 * np.pi - icosphere(k).area() for k in (2, 3, 4)]
    assert gaps[1] / gaps[2] == pytest.approx(4.0, rel=0.05)  # O(h^2)


def test_grid_and_torus():
    g = grid(5, 4)
    assert g.n_vertices == 20 and g.area() == pytest.approx(1.0)
    np.testing.assert_allclose(g.vertices[7], [0.25, 1.0, 0.0])  # index (i*ny + j) = 1*4 + 3
    c = grid(3, 4, 5)
    assert c.kind == "tetra" and c.n_faces == 6 * 2 * 3 * 4 and c.volume() == pytest.approx(1.0)
    assert c.area() == pytest.approx(6.0)
    assert len(c.boundary_vertices()) == 3 * 4 * 5 - 1 * 2 * 3
    t = torus(2.0, 0.5, nu=64, nv=32)
    assert t.is_closed() and t.n_vertices - len(t.edges()) + t.n_faces == 0
    assert t.area() == pytest.approx(4 * np.pi**2 * 2.0 * 0.5, rel=5e-3)
    with pytest.raises(ValueError, match="minor < major"):
        torus(1.0, 2.0)
    with pytest.raises(ValueError, match="ny must be an integer >= 2"):
        grid(3, 1)
    with pytest.raises(ValueError, match="subdivisions"):
        icosphere(-1)
    with pytest.raises(ValueError, match="triangle surface"):
        icosphere(0).volume()


def test_read_round_trip_and_errors(tmp_path):
    meshio = pytest.importorskip("meshio")
    m = icosphere(1)
    extra = np.vstack([m.vertices, [[5.0, 5.0, 5.0]]])  # an unused vertex is dropped on read
    path = tmp_path / "sphere.vtk"
    meshio.write_points_cells(str(path), extra, [("triangle", m.faces)])
    r = read(str(path))
    assert r.n_vertices == m.n_vertices and r.n_faces == m.n_faces
    assert r.area() == pytest.approx(m.area(), rel=1e-12)
    g = grid(3, 3, 3)
    meshio.write_points_cells(str(tmp_path / "cube.vtu"), g.vertices, [("tetra", g.faces)])
    assert read(str(tmp_path / "cube.vtu")).volume() == pytest.approx(1.0)
    meshio.write_points_cells(str(tmp_path / "lines.vtk"), g.vertices[:3], [("line", np.array([[0, 1], [1, 2]]))])
    with pytest.raises(ValueError, match=r"no triangles or tetrahedra \(cell types found: \['line'\]\)"):
        read(str(tmp_path / "lines.vtk"))
