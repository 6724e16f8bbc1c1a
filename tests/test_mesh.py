"""Meshes: validation messages, generators, file input."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from managed_solve.mesh import MAX_ICOSPHERE_SUBDIVISIONS, Mesh, grid, icosphere, read, torus

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


def test_connected_components_against_scipy_on_the_edge_graph():
    import scipy.sparse as sp
    from scipy.sparse.csgraph import connected_components

    a, b, c = icosphere(2), grid(4, 5), grid(2, 3, 2)
    m = Mesh(np.vstack([a.vertices, b.vertices + 3.0]), np.vstack([a.faces, b.faces + a.n_vertices]))
    labels = m.connected_components()
    assert labels.tolist() == [0] * a.n_vertices + [1] * b.n_vertices
    assert not labels.flags.writeable and m.connected_components() is labels  # cached
    # Against SciPy on the edge graph, with three pieces (shuffled vertex order).
    m4 = Mesh(np.vstack([a.vertices, b.vertices + 3, a.vertices - 5]),
              np.vstack([a.faces, b.faces + a.n_vertices, a.faces + a.n_vertices + b.n_vertices]))
    perm = np.random.default_rng(0).permutation(m4.n_vertices)
    inv = np.argsort(perm)
    shuffled = Mesh(m4.vertices[perm], inv[m4.faces])
    e = shuffled.edges()
    g = sp.coo_matrix((np.ones(len(e)), (e[:, 0], e[:, 1])), shape=(shuffled.n_vertices,) * 2)
    count, ref = connected_components(g, directed=False)
    got = shuffled.connected_components()
    assert count == 3 and got.max() == 2 and got[0] == 0
    # The same partition: labels agree up to renaming.
    assert len(set(zip(got.tolist(), ref.tolist(), strict=True))) == 3
    assert c.connected_components().tolist() == [0] * c.n_vertices  # tetrahedra


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


# ---------------------------------------------------------------- file input: hostile files
SQUARE = "v 0 0 0\nv 1 0 0\nv 1 1 0\nv 0 1 0\n"


def _write(tmp_path, name, content):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return str(path)


def _normals(m):
    v, f = m.vertices, m.faces
    return np.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]])


def test_obj_quads_mixed_with_triangles_are_triangulated(tmp_path):
    # meshio's reader dropped the quad: a third of the domain vanished and the solve "converged".
    path = _write(tmp_path, "mixed.obj", SQUARE + "v 2 0 0\nf 1 2 3 4\nf 2 5 3\n")
    m = read(path)
    assert m.n_faces == 3 and m.n_vertices == 5 and m.area() == pytest.approx(1.5)
    assert (_normals(m)[:, 2] > 0).all()  # the quad's counter-clockwise winding is kept
    assert m.faces[:2].tolist() == [[0, 1, 2], [0, 2, 3]] and m.faces[2].tolist() == [1, 4, 2]


def test_obj_polygons_keep_orientation_and_area(tmp_path):
    clockwise = read(_write(tmp_path, "cw.obj", SQUARE + "f 4 3 2 1\n"))
    assert clockwise.n_faces == 2 and (_normals(clockwise)[:, 2] < 0).all()
    t = 2 * np.pi * np.arange(6) / 6
    hexagon = "".join(f"v {float(np.cos(a))!r} {float(np.sin(a))!r} 0\n" for a in t) + "f 1 2 3 4 5 6\n"
    m = read(_write(tmp_path, "hex.obj", hexagon))
    assert m.n_faces == 4 and m.area() == pytest.approx(3 * np.sqrt(3) / 2)


def test_obj_index_forms(tmp_path):
    text = ("# comment\nmtllib x.mtl\no thing\n" + SQUARE + "vt 0 0\nvn 0 0 1\ng side\ns off\n"
            "usemtl red\nf 1/1/1 2/1/1 \\\n 3/1/1\nf -4//1 -2//1 -1//1\nl 1 2\nf 1 2 \\\n 9\n")
    with pytest.raises(ValueError, match=r"line 17: face 3 uses vertex index 9"):  # continued lines count
        read(_write(tmp_path, "forms.obj", text))
    text = text[: text.index("f 1 2 \\\n 9")]
    m = read(_write(tmp_path, "forms.obj", text))
    assert m.faces.tolist() == [[0, 1, 2], [0, 2, 3]] and m.area() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (SQUARE + "f 1 2 7\n", r"line 5: face 1 uses vertex index 7, but the file defines 4 vertices"),
        (SQUARE + "f 1 2 3\nf 0 1 2\n", r"line 6: face 2 uses vertex index 0, but OBJ counts vertices from 1"),
        ("v 0 0 0\nf -1 -2 -3\n" + SQUARE, r"line 2: face 1 uses vertex index -2, but only 1 vertices"),
        (SQUARE + "f 1 2\n", r"line 5: face 1 has 2 vertices; a face needs at least 3"),
        (SQUARE + "f 1 two 3\n", r"line 5: cannot read the vertex index in 'two'"),
        ("v 0 0 zero\n", r"line 1: cannot read vertex coordinates"),
        ("v 0 0\n", r"line 1: a vertex needs three coordinates"),
        (SQUARE, r"no faces \('f' lines\); it holds 4 vertices"),
        ("v 0 0 0\nv 2 0 0\nv 1 2 0\nv 1 0.5 0\nf 1 2 3 4\n",  # a dart: its fan would overlap
         r"the file's face 1 \(line 5\) is a non-convex polygon of 4 vertices"),
        ("v 0 0 0\nv 1 0 0\nv 2 0 0\nv 1 1 0\nf 1 2 3 4\n",
         r"face 0 = \[0, 1, 2\] has zero area .*face 0 is the file's face 1 \(line 5\), triangulated"),
        (SQUARE + "v nan 0 0\nf 1 2 5\n",
         r"vertex 2 has non-finite.*vertex 2 is the file's vertex 5"),
        (SQUARE + "f 1 2 3\nf 3 1 2\n", r"faces 0 and 1 use the same.*file's face 1 \(line 5\).*face 2 \(line 6\)"),
    ],
)
def test_bad_obj_files_name_the_file_the_line_and_the_fix(tmp_path, text, match):
    path = _write(tmp_path, "bad.obj", text)
    with pytest.raises(ValueError, match=match) as err:
        read(path)
    assert str(err.value).startswith(f"managed_solve.mesh.read({path!r}): ")


def test_triangulated_faces_still_meet_the_degeneracy_test(tmp_path):
    # A sliver of area 1e-14 against edges of length 1: under _DEGENERATE, refused as before.
    text = "v 0 0 0\nv 1 0 0\nv 1 1e-14 0\nv 0 1e-14 0\nf 1 2 3 4\n"
    with pytest.raises(ValueError, match="has zero area"):
        read(_write(tmp_path, "sliver.obj", text))
    assert read(_write(tmp_path, "thin.obj", text.replace("e-14", "e-3"))).n_faces == 2


def _stl_bytes(tmp_path, binary):
    meshio = pytest.importorskip("meshio")
    path = tmp_path / ("b.stl" if binary else "a.stl")
    m = icosphere(1)
    meshio.write_points_cells(str(path), m.vertices, [("triangle", m.faces)], binary=binary)
    return path.read_bytes()


def _ply_bytes(tmp_path, binary):
    meshio = pytest.importorskip("meshio")
    path = tmp_path / ("b.ply" if binary else "a.ply")
    m = icosphere(1)
    meshio.write_points_cells(str(path), m.vertices, [("triangle", m.faces)], binary=binary)
    return path.read_bytes()


@pytest.mark.parametrize("binary", [True, False])
def test_stl_and_ply_round_trip(tmp_path, binary):
    for name, data in (("ok.stl", _stl_bytes(tmp_path, binary)), ("ok.ply", _ply_bytes(tmp_path, binary))):
        m = read(_write(tmp_path, name, data))
        assert m.n_vertices == 42 and m.n_faces == 80 and m.is_closed()


def test_ply_quads_are_triangulated(tmp_path):
    pytest.importorskip("meshio")
    text = ("ply\nformat ascii 1.0\nelement vertex 5\nproperty float x\nproperty float y\n"
            "property float z\nelement face 2\nproperty list uchar int vertex_indices\nend_header\n"
            "0 0 0\n1 0 0\n1 1 0\n0 1 0\n2 0 0\n4 0 1 2 3\n3 1 4 2\n")
    m = read(_write(tmp_path, "mixed.ply", text))
    assert m.n_faces == 3 and m.area() == pytest.approx(1.5) and (_normals(m)[:, 2] > 0).all()


def _quad_ply_bytes(tmp_path):
    meshio = pytest.importorskip("meshio")
    path = tmp_path / "quads.ply"  # quads take more bytes than the header's least (triangles)
    quads = np.array([[0, 3, 4, 1], [1, 4, 5, 2], [3, 6, 7, 4], [4, 7, 8, 5]])
    meshio.write_points_cells(str(path), grid(3, 3).vertices, [("quad", quads)], binary=True)
    assert read(str(path)).n_faces == 8
    return path.read_bytes()


def _bad_files(tmp_path):
    stl_b, stl_a = _stl_bytes(tmp_path, True), _stl_bytes(tmp_path, False)
    ply_b, ply_a = _ply_bytes(tmp_path, True), _ply_bytes(tmp_path, False)
    header_end = ply_b.index(b"end_header") + len(b"end_header\n")
    return [
        ("corrupt.stl", b"solid x\nfacet normal 0 0 1\n\xff\xfe\x00garbage", r"neither a binary STL .* "
         r"nor an ASCII STL \(byte \d+ is not text\)"),
        ("random.stl", bytes(range(256)) * 2, r"announces \d+ triangles, which take \d+ bytes, but the file has 512"),
        ("truncated.stl", stl_b[:-70], r"announces 80 triangles, which take 4084 bytes, but the file has 4014"),
        ("notstl.stl", b"hello world, this is no STL file at all" * 3, r"not an STL file"),
        ("broken-ascii.stl", stl_a[: len(stl_a) // 2], r"meshio could not read the file"),
        ("header.ply", ply_b[: header_end - 12], r"no 'end_header' line in its first \d+ bytes"),
        ("header-a.ply", ply_a[:60], r"no 'end_header' line"),
        ("body.ply", ply_b[: (header_end + len(ply_b)) // 2], r"truncated: .*42 vertex, 80 face elements, "
         r"at least 2048 bytes, but the body holds"),
        ("body-a.ply", ply_a[: len(ply_a) // 2], r"truncated: .*\(122 rows\) but the body holds"),
        ("faces.ply", _quad_ply_bytes(tmp_path)[:-10], r"meshio could not read the file \(ValueError: buffer"),
        ("edge.ply", "ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\n"
         "property float z\nelement face 1\nproperty list uchar int vertex_indices\nend_header\n"
         "0 0 0\n1 0 0\n0 1 0\n2 0 1\n", r"PLY file is truncated or corrupt: its header announces 3 "
         r"vertices and 1 faces, the body gave 3 vertices and 1 faces \(some with fewer than 3 vertices\)"),
        ("notply.ply", b"plyx\n" + b"\x00" * 100, r"no 'end_header'"),
        ("empty.obj", b"", r"the file is empty"),
        ("empty.stl", b"", r"the file is empty"),
        ("binary.obj", bytes(range(256)), r"no faces"),
        ("unknown.xyz", b"1 2 3\n", r"meshio could not read the file"),
    ]


def test_hostile_files_are_value_errors_naming_the_file_never_hangs(tmp_path):
    # meshio raised UnicodeDecodeError on a corrupt STL and looped forever on a PLY header cut short.
    for name, data, match in _bad_files(tmp_path):
        path = _write(tmp_path, name, data)
        outcome = []

        def attempt(path=path, outcome=outcome):
            try:
                read(path)
            except Exception as error:
                outcome.append(error)

        worker = threading.Thread(target=attempt, daemon=True)
        worker.start()
        worker.join(timeout=10.0)  # milliseconds when the sniffing works; generous for a loaded CI machine
        assert not worker.is_alive(), f"{name}: read() hangs"
        (exc,) = outcome
        assert type(exc) is ValueError, (name, exc)
        assert str(exc).startswith(f"managed_solve.mesh.read({path!r}): "), name
        assert re.search(match, str(exc)), (name, str(exc))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file"):
        read(str(tmp_path / "nope.obj"))
    with pytest.raises(ValueError, match=r"this is a directory"):
        read(str(tmp_path))


def test_volume_cells_other_than_tetrahedra_are_refused(tmp_path):
    meshio = pytest.importorskip("meshio")
    g = grid(3, 3, 3)
    cube = np.array([[0, 1, 4, 3, 9, 10, 13, 12]])  # a hexahedron on the grid's first cell
    path = str(tmp_path / "mixed.vtu")
    meshio.write_points_cells(path, g.vertices, [("tetra", g.faces[:6]), ("hexahedron", cube)])
    with pytest.raises(ValueError, match=r"holds \['hexahedron'\] cells; only linear tetrahedra"):
        read(path)
    # Quads alone (a VTK surface) are triangulated, like OBJ and PLY polygons.
    quads = np.array([[0, 2, 3, 1], [2, 4, 5, 3]])
    meshio.write_points_cells(str(tmp_path / "quads.vtk"), grid(3, 2).vertices, [("quad", quads)])
    m = read(str(tmp_path / "quads.vtk"))
    assert m.n_faces == 4 and m.area() == pytest.approx(1.0)


def test_cli_reports_a_bad_mesh_in_one_line(tmp_path, capsys):
    from managed_solve import cli

    path = _write(tmp_path, "bad.obj", SQUARE + "f 1 2 9\n")
    assert cli.main(["demo", "--mesh", path, "--small", "--simulate", "1x1GiB"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert path in err and "vertex index 9" in err


def test_degeneracy_test_is_scale_invariant_and_never_overflows():
    tri = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0]], float)
    for scale in (1e-150, 1e150):
        m = Mesh(tri * scale, [[0, 1, 2]])
        assert m.area() == pytest.approx(0.5 * scale**2, rel=1e-15)
        np.testing.assert_array_equal(m.vertex_normals(), [[0, 0, 1]] * 3)
    tet = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], float)
    big = Mesh(tet * 1e100, [[0, 1, 2, 3]])
    assert big.volume() == pytest.approx(1e300 / 6, rel=1e-15)
    assert big.area() == pytest.approx((1.5 + np.sqrt(3) / 2) * 1e200, rel=1e-15)
    # A valid element whose measure float64 cannot hold: the cause and the fix, not "collinear".
    for vertices, way in ((tri * 1e160, "overflows"), (tri * 1e-170, "underflows"),
                          (np.array([[-1, 0, 0], [1, 0, 0], [0, 1, 0]]) * 1.5e308, "overflows")):
        with pytest.raises(ValueError, match=rf"face 0 = \[0, 1, 2\] is a valid element, but its area "
                                             rf"{way} float64.*Rescale the vertices"):
            Mesh(vertices, [[0, 1, 2]])
    # Collinear vertices are degenerate at every scale, also where squared edges overflow.
    line = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 1e-14]], float)
    for scale in (1e-170, 1.0, 1e160, 4e307):
        with pytest.raises(ValueError, match=r"face 0 = \[0, 1, 2\] has zero area.*collinear"):
            Mesh(line * scale, [[0, 1, 2]])


def test_element_shapes_are_scale_free():
    tri = np.array([[0, 0, 0], [1, 0, 0], [0.5, np.sqrt(3) / 2, 0]])  # equilateral: area / edge**2
    tet = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], float)  # (1/6) / sqrt(2)**3
    for scale in (2.0**-300, 1.0, 2.0**300):
        np.testing.assert_allclose(Mesh(tri * scale, [[0, 1, 2]]).element_shapes(), [np.sqrt(3) / 4],
                                   rtol=1e-15)
        np.testing.assert_allclose(Mesh(tet * scale, [[0, 1, 2, 3]]).element_shapes(),
                                   [1 / (6 * 2**1.5)], rtol=1e-15)


def test_an_off_file_of_polygons_is_read_and_fan_triangulated(tmp_path):
    """OFF faces are polygons ('k i0 ... ik-1', colours may follow); comments and a header with
    its counts on the keyword's line are OFF too."""
    path = tmp_path / "shapes.off"
    path.write_text("OFF 9 2 0  # a unit square and a pentagon of area 2\n"
                    "0 0 0\n1 0 0\n1 1 0\n0 1 0\n"
                    "3 0 0\n4 0 0\n4.5 1 0\n3.5 1.5 0\n2.5 1 0\n"
                    "4 0 1 2 3\n5 4 5 6 7 8 255 0 0\n")
    m = read(path)
    assert m.faces.shape == (5, 3)
    assert m.area() == pytest.approx(3.0, rel=1e-12)


@pytest.mark.parametrize("text,match", [
    ("OFX\n3 1 0\n", "starts with the keyword OFF"),
    ("4OFF\n3 1 0\n0 0 0 1\n1 0 0 1\n1 1 0 1\n3 0 1 2\n", "for 3D vertices"),
    ("OFF\n4 2 0\n0 0 0\n1 0 0\n1 1 0\n0 1 0\n4 0 1 2 3\n", "truncated"),
    ("OFF\n3 1 0\n0 0 0\n1 0 0\n1 1 0\n3 0 1 7\n", "refers to point 7"),
    ("OFF\nthree 1 0\n", "numbers of vertices and faces"),
    ("OFF\n3 1 0\n0 0 0\n1 0 0\n1 1 0\n4 0 1 2\n", "as many as it announces"),
])
def test_a_bad_off_file_is_a_value_error_naming_the_problem(tmp_path, text, match):
    path = tmp_path / "bad.off"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read(path)


def test_a_file_meshio_exits_on_is_a_value_error_not_the_end_of_the_process(tmp_path):
    pytest.importorskip("meshio")
    path = tmp_path / "corrupt.vtu"
    path.write_text("<VTKFile type='UnstructuredGrid'><garbage")
    with pytest.raises(ValueError, match="meshio could not read the file"):
        read(path)


def test_counts_name_the_call_and_the_argument_and_bools_are_not_counts():
    with pytest.raises(TypeError, match=r"icosphere\(subdivisions=None\): subdivisions must be an "
                                        r"integer >= 0, got None \(NoneType\)"):
        icosphere(None)
    # A bool is a flag, refused alike by every generator (grid(True, 3) was refused as 1 < 2).
    for make, name in ((lambda: icosphere(True), "subdivisions"), (lambda: grid(True, 3), "nx"),
                       (lambda: grid(3, 3, np.True_), "nz"), (lambda: torus(nu=True), "nu")):
        with pytest.raises(TypeError, match=rf"{name} must be an integer >= \d, got (np\.)?True_? \(a bool\)"):
            make()
    with pytest.raises(ValueError, match=r"grid\(nan, 3\): nx must be an integer >= 2, got nan"):
        grid(float("nan"), 3)
    with pytest.raises(ValueError, match=r"torus\(major=inf, .*\): expected finite radii"):
        torus(major=float("inf"))
    with pytest.raises(TypeError, match=r"torus\(major='2'.*major must be a real number, got str"):
        torus(major="2")
    # Whole numbers of any numeric type still count.
    assert grid(3.0, np.int64(3)).n_vertices == 9 and icosphere(np.uint8(1)).n_faces == 80


def _moebius(n=12, radius=2.0, width=0.5):
    u = 2 * np.pi * np.arange(n) / n
    s = np.array([-width, width])
    r = radius + s[None, :] * np.cos(u / 2)[:, None]
    v = np.stack([r * np.cos(u)[:, None], r * np.sin(u)[:, None], s[None, :] * np.sin(u / 2)[:, None]], -1)
    i = np.arange(n)
    a, b = 2 * i, 2 * i + 1
    c, d = 2 * ((i + 1) % n), 2 * ((i + 1) % n) + 1
    c[-1], d[-1] = d[-1], c[-1]  # the half twist: the strip closes with its edges swapped
    return Mesh(v.reshape(-1, 3), np.concatenate([np.stack([a, c, b], 1), np.stack([b, c, d], 1)]))


def test_vertex_normals_orient_the_surface_first_and_refuse_where_no_normal_exists():
    square = Mesh(TRI, [[0, 1, 2], [1, 2, 3]])  # the second triangle is stored flipped
    assert square.face_orientation().tolist() == [1, -1]
    np.testing.assert_array_equal(square.vertex_normals(), [[0, 0, 1]] * 4)
    # An icosphere with a third of its triangles flipped: the outward normals of the stored one.
    sphere = icosphere(2)
    flipped = np.random.default_rng(0).random(sphere.n_faces) < 1 / 3
    faces = np.where(flipped[:, None], sphere.faces[:, ::-1], sphere.faces)
    scrambled = Mesh(sphere.vertices, faces)
    assert (scrambled.face_orientation() == np.where(flipped, -1, 1)).all()
    np.testing.assert_allclose(scrambled.vertex_normals(), sphere.vertex_normals(), atol=1e-14)
    np.testing.assert_allclose(np.linalg.norm(scrambled.vertex_normals(), axis=1), 1.0, rtol=1e-15)
    assert (sphere.face_orientation() == 1).all()
    # No consistent orientation exists on a Moebius strip, so no continuous unit normal.
    with pytest.raises(ValueError, match=r"vertex_normals\(\): the surface is not orientable"):
        _moebius().vertex_normals()
    # Two sheets of opposite orientation meeting at one vertex: their normals cancel there.
    bowtie = Mesh([[0, 0, 0], [1, 0, 0], [0, 1, 0], [-1, 0, 0], [0, -1, 0]], [[0, 1, 2], [0, 4, 3]])
    with pytest.raises(ValueError, match=r"the face normals around vertex 0 cancel"):
        bowtie.vertex_normals()


def test_icosphere_refuses_sizes_beyond_its_memory_bound():
    # Each subdivision quadruples the mesh; a large count used to build level after level
    # for minutes and then die in NumPy with a MemoryError (or be killed by the system).
    k = MAX_ICOSPHERE_SUBDIVISIONS
    with pytest.raises(ValueError, match=rf"^icosphere\(subdivisions={k + 1}\): would make "
                                         rf"{10 * 4 ** (k + 1) + 2:,} vertices and {20 * 4 ** (k + 1):,} "
                                         rf"triangles \(about \d+ GiB to build\); at most {k} "
                                         rf"subdivisions \({10 * 4**k + 2:,} vertices, about \d+ GiB to build\); "
                                         rf"pass subdivisions <= {k}$"):
        icosphere(k + 1)
    with pytest.raises(ValueError, match=r"^icosphere\(subdivisions=1000\): would make about 10\*\*603 vertices"):
        icosphere(1000)
