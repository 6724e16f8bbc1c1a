"""Mesh files: their raw content (points and faces), checked before and after reading.

:func:`managed_solve.mesh.read` builds a :class:`~managed_solve.mesh.Mesh`
from what :func:`load` returns. Every problem is a ``ValueError`` naming the
file and what to do (``FileNotFoundError`` for a missing file), never an
``IndexError`` or ``UnicodeDecodeError`` from deep inside a reader, and never
a hang:

* OBJ is read here, not by meshio: meshio's reader drops quads mixed with
  triangles, wraps index 0 and relative (negative) indices silently, and
  fails on ``f 1/1/1`` faces that have texture coordinates.
* STL and PLY are sniffed before meshio sees them: a binary STL's triangle
  count must match the file size, an ASCII one must be text; a PLY must end
  its header within :data:`PLY_HEADER_LIMIT` bytes (meshio loops forever on a
  header cut short) and its body must be able to hold the elements the
  header announces.
* Polygons (quads and larger, from any format) are fan-triangulated from
  their first vertex, which keeps their orientation and is exact for convex
  polygons; a non-convex polygon is refused, since its fan would overlap.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from . import _backend

__all__ = ["MeshData", "PLY_HEADER_LIMIT", "load", "triangulate"]

PLY_HEADER_LIMIT = 1 << 16
_PLY_SIZES = {"char": 1, "uchar": 1, "int8": 1, "uint8": 1, "short": 2, "ushort": 2, "int16": 2,
              "uint16": 2, "int": 4, "uint": 4, "int32": 4, "uint32": 4, "float": 4, "float32": 4,
              "int64": 8, "uint64": 8, "double": 8, "float64": 8}
_VOLUME = ("tetra", "hexahedron", "wedge", "pyramid", "polyhedron")
_SURFACE = ("triangle", "quad", "polygon")


@dataclass
class MeshData:
    """What a mesh file holds, before :class:`~managed_solve.mesh.Mesh` validates it.

    ``faces`` are triangles (m, 3) or tetrahedra (m, 4), 0-based indices into
    ``points``, all in range. ``source[e]`` is the file's face (cell) that
    face ``e`` came from, ``lines[source[e]]`` its line for text formats.
    """

    points: np.ndarray
    faces: np.ndarray
    source: np.ndarray
    lines: np.ndarray | None = None
    one_based: bool = False

    def face_label(self, e: int) -> str:
        """Where face ``e`` comes from in the file, in the file's own terms."""
        k = int(self.source[e])
        where = f"the file's face {k + 1}" if self.one_based else f"the file's cell {k}"
        if self.lines is not None:
            where += f" (line {int(self.lines[k])})"
        if np.count_nonzero(self.source == k) > 1:
            where += ", triangulated"
        return where

    def vertex_label(self, i: int) -> str:
        return f"the file's vertex {i + 1}" if self.one_based else f"the file's point {i}"


def load(path: str | os.PathLike, *, call: str) -> MeshData:
    """The points and faces of a mesh file (tetrahedra if it has any, else triangles).

    ``call`` starts every message (``managed_solve.mesh.read('x.obj')``).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{call}: no such file (looked in {os.path.abspath(path)!r}).")
    if os.path.isdir(path):
        raise ValueError(f"{call}: this is a directory; give the path of a mesh file.")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{call}: the file is empty; it holds no mesh. Export it again.")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".obj":
        return _read_obj(path, call)
    if ext == ".off":
        return _read_off(path, call)
    if ext == ".stl":
        _sniff_stl(path, call)
    elif ext == ".ply":
        header = _sniff_ply(path, call)
    meshio = _backend.require("meshio", call)
    try:
        with np.errstate(over="ignore"):  # meshio sizes an ASCII STL as binary first, in uint32
            m = meshio.read(path)
    except (Exception, SystemExit) as exc:  # whatever its parsers hit (some call sys.exit)
        raise ValueError(f"{call}: meshio could not read the file ({type(exc).__name__}: {exc}). "
                         "Check that it is a complete, valid mesh file of the format its "
                         "extension says, or export it again.") from exc
    points = np.asarray(m.points, dtype=float)
    blocks = [(b.type, np.asarray(b.data)) for b in m.cells]
    if ext == ".ply":
        _check_ply_content(points, blocks, header, call)
    return _from_cells(points, blocks, call)


def triangulate(polygons: np.ndarray) -> np.ndarray:
    """Fan triangles ``(p0, pj, pj+1)`` of polygons (m, k): (m * (k - 2), 3), face by face.

    The fan keeps each polygon's orientation (winding).

    Examples
    --------
    >>> triangulate(np.array([[0, 1, 2, 3]])).tolist()
    [[0, 1, 2], [0, 2, 3]]
    """
    p = np.asarray(polygons)
    k = p.shape[1]
    if k == 3:
        return p
    j = np.arange(1, k - 1)
    return np.stack([np.repeat(p[:, :1], k - 2, axis=1), p[:, j], p[:, j + 1]], axis=2).reshape(-1, 3)


def _from_cells(points: np.ndarray, blocks: list[tuple[str, np.ndarray]], call: str,
                ids: list[np.ndarray] | None = None, lines: np.ndarray | None = None,
                one_based: bool = False) -> MeshData:
    """Faces from meshio-style cell blocks; ``ids[b]`` numbers block ``b``'s cells in the file."""
    if ids is None:
        sizes = np.cumsum([0] + [len(d) for _, d in blocks])
        ids = [np.arange(sizes[i], sizes[i + 1]) for i in range(len(blocks))]
    types = sorted({t for t, _ in blocks})
    volume = [t for t in types if t.startswith(_VOLUME)]
    if volume:
        other = [t for t in volume if t != "tetra"]
        if other:
            raise ValueError(f"{call}: the file holds {other} cells; only linear tetrahedra ('tetra') "
                             "are supported for volumes, and dropping the others would leave holes in "
                             "the domain. Convert the mesh to tetrahedra first (e.g. with gmsh).")
        keep = ("tetra",)
    else:
        higher = [t for t in types if t.startswith(_SURFACE) and t not in _SURFACE]
        if higher:
            raise ValueError(f"{call}: the file holds higher-order faces {higher}; only linear "
                             "triangles and polygons are supported. Export a linear mesh.")
        keep = _SURFACE
    kept = [(np.asarray(d).astype(np.int64).reshape(len(d), -1), i)
            for (t, d), i in zip(blocks, ids, strict=True) if t in keep and len(d)]
    if not kept:
        raise ValueError(f"{call}: the file has no triangles or tetrahedra (cell types found: "
                         f"{types or 'none'}); polygons would have been triangulated, so it holds "
                         "no faces at all. Export the surface (or volume) itself.")
    for cells, i in kept:
        bad = (cells < 0) | (cells >= len(points))
        if bad.any():
            r = int(np.flatnonzero(bad.any(axis=1))[0])
            raise ValueError(f"{call}: cell {int(i[r])} refers to point {int(cells[r][bad[r]][0])}, but "
                             f"the file has {len(points)} points; the file is corrupt or truncated.")
    faces = [cells if keep == ("tetra",) else triangulate(cells) for cells, _ in kept]
    source = [np.repeat(i, max(cells.shape[1] - 2, 1) if keep != ("tetra",) else 1) for cells, i in kept]
    source = np.concatenate(source)
    order = np.argsort(source, kind="stable")  # faces in the file's order
    data = MeshData(points, np.concatenate(faces)[order], source[order], lines, one_based)
    for cells, i in kept:
        if cells.shape[1] > 3 and keep != ("tetra",):
            _check_convex(data, cells, i, call)
    return data


def _check_convex(data: MeshData, cells: np.ndarray, ids: np.ndarray, call: str) -> None:
    """Refuse polygons whose fan triangles turn against the polygon: they are not convex."""
    p = data.points[cells]  # (m, k, 3)
    normal = np.cross(p, np.roll(p, -1, axis=1)).sum(axis=1)  # Newell's polygon normal
    fan = np.cross(p[:, 1:-1] - p[:, :1], p[:, 2:] - p[:, :1])  # (m, k - 2, 3)
    turned = np.einsum("mjc,mc->mj", fan, normal) < 0
    if turned.any():
        r = int(np.flatnonzero(turned.any(axis=1))[0])
        e = int(np.flatnonzero(data.source == ids[r])[0])
        raise ValueError(f"{call}: {data.face_label(e).replace(', triangulated', '')} is a non-convex "
                         f"polygon of {cells.shape[1]} vertices; a fan of triangles from its first vertex "
                         "would overlap. Triangulate it in a mesh tool first (e.g. trimesh, or "
                         "Blender's Triangulate).")


# ------------------------------------------------------------------ OBJ
def _read_obj(path: str, call: str) -> MeshData:
    with open(path, "rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")  # names and comments may be in any encoding
    verts: list[list[float]] = []
    faces: list[list[int]] = []
    lines: list[int] = []
    pending, start = "", 0
    for number, part in enumerate(text.splitlines(), 1):
        if part.endswith("\\"):  # a trailing backslash continues the statement on the next line
            pending, start = pending + part[:-1] + " ", start or number
            continue
        line, lineno, pending, start = pending + part, start or number, "", 0
        tokens = line.split()
        if not tokens or tokens[0] not in ("v", "f", "fo"):
            continue  # comments, vt, vn, groups, materials, lines, points: not geometry we use
        where = f"{call}: line {lineno}"
        if tokens[0] == "v":
            try:
                verts.append([float(x) for x in tokens[1:4]])
            except ValueError:
                raise ValueError(f"{where}: cannot read vertex coordinates from {line.strip()!r}; "
                                 "expected 'v x y z'.") from None
            if len(verts[-1]) != 3:
                raise ValueError(f"{where}: a vertex needs three coordinates, got {line.strip()!r}.")
            continue
        face = []
        for ref in tokens[1:]:
            try:
                i = int(ref.split("/")[0])
            except ValueError:
                raise ValueError(f"{where}: cannot read the vertex index in {ref!r}; expected "
                                 "'f 1 2 3' or 'f 1/1/1 2/2/2 3/3/3'.") from None
            if i == 0:
                raise ValueError(f"{where}: face {len(faces) + 1} uses vertex index 0, but OBJ counts "
                                 "vertices from 1 (and -1 is the last one defined). If the file was "
                                 "written 0-based, add 1 to every face index.")
            face.append(i - 1 if i > 0 else len(verts) + i)  # negative: counted back from here
            if i < 0 and face[-1] < 0:
                raise ValueError(f"{where}: face {len(faces) + 1} uses vertex index {i}, but only "
                                 f"{len(verts)} vertices are defined before this line.")
        if len(face) < 3:
            raise ValueError(f"{where}: face {len(faces) + 1} has {len(face)} vertices; a face needs "
                             "at least 3. Remove it, or write it as a line ('l').")
        faces.append(face)
        lines.append(lineno)
    n = len(verts)
    for k, face in enumerate(faces):
        if max(face) >= n:
            raise ValueError(f"{call}: line {lines[k]}: face {k + 1} uses vertex index {max(face) + 1}, "
                             f"but the file defines {n} vertices (OBJ indices run from 1 to {n}). "
                             "Fix or remove that face.")
    if not faces:
        raise ValueError(f"{call}: the file has no faces ('f' lines); it holds {n} vertices. "
                         "Export the surface with its faces.")
    blocks, ids = _polygon_blocks(faces)
    return _from_cells(np.array(verts, dtype=float).reshape(-1, 3), blocks, call, ids=ids,
                       lines=np.array(lines), one_based=True)


def _polygon_blocks(faces: list[list[int]]) -> tuple[list, list]:
    """One cell block per face size, each with its faces' numbers in the file (their order)."""
    sizes = np.array([len(f) for f in faces])
    blocks, ids = [], []
    for size in np.unique(sizes):
        members = np.flatnonzero(sizes == size)
        blocks.append(("triangle" if size == 3 else "polygon", np.array([faces[k] for k in members])))
        ids.append(members)
    return blocks, ids


# ------------------------------------------------------------------ OFF
def _read_off(path: str, call: str) -> MeshData:
    """An OFF file: a header line (OFF, or COFF/NOFF/CNOFF with per-vertex extras), the counts,
    the vertices, then faces ``k i0 ... ik-1`` (0-based; polygons fan-triangulated)."""
    with open(path, "rb") as fh:
        text = fh.read().decode("utf-8", errors="replace")
    rows = [(k, line.split("#", 1)[0].split()) for k, line in enumerate(text.splitlines(), 1)]
    rows = [(k, tokens) for k, tokens in rows if tokens]
    # OFF with per-vertex colours, normals or texture coordinates (ST, C, N prefixes);
    # nOFF and 4OFF have other than three coordinates and are refused.
    if not rows or re.fullmatch(r"(ST)?C?N?OFF", rows[0][1][0].upper()) is None:
        raise ValueError(f"{call}: an OFF file starts with the keyword OFF (or COFF, NOFF, CNOFF, "
                         f"STOFF), for 3D vertices; this one starts with "
                         f"{rows[0][1][0] if rows else 'nothing'!r}. Export it again.")
    head = rows[0][1][1:] or (rows[1][1] if len(rows) > 1 else [])
    body = rows[1:] if rows[0][1][1:] else rows[2:]
    try:
        nv, nf = int(head[0]), int(head[1])
    except (IndexError, ValueError):
        raise ValueError(f"{call}: the OFF header must give the numbers of vertices and faces "
                         f"('nv nf ne'), got {' '.join(head)!r}.") from None
    if len(body) < nv + nf:
        raise ValueError(f"{call}: the OFF header announces {nv} vertices and {nf} faces, but the "
                         f"file holds {len(body)} lines of them; it is truncated. Export it again.")
    try:
        verts = np.array([[float(x) for x in tokens[:3]] for _, tokens in body[:nv]])
        faces = [[int(i) for i in tokens[1:1 + int(tokens[0])]] for _, tokens in body[nv:nv + nf]]
    except ValueError as exc:
        raise ValueError(f"{call}: cannot read the OFF body ({exc}); expected 'x y z' vertex "
                         "lines, then 'k i0 ... ik-1' face lines.") from None
    lines = np.array([k for k, _ in body[nv:nv + nf]])
    for k, face in enumerate(faces):
        if len(face) < 3 or len(face) != int(body[nv + k][1][0]):
            raise ValueError(f"{call}: line {lines[k]}: face {k} needs at least 3 vertex indices, "
                             f"as many as it announces; got {' '.join(body[nv + k][1])!r}.")
    if verts.shape != (nv, 3):
        raise ValueError(f"{call}: every OFF vertex needs three coordinates.")
    blocks, ids = _polygon_blocks(faces)
    return _from_cells(verts.reshape(-1, 3), blocks, call, ids=ids, lines=lines)


# ------------------------------------------------------------------ STL
def _sniff_stl(path: str, call: str) -> None:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(84)
    if size >= 84:
        count = int.from_bytes(head[80:84], "little")
        if 84 + 50 * count == size:
            return  # binary, and whole
    with open(path, "rb") as fh:
        body = fh.read()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        binary = (f"its header announces {count} triangles, which take {84 + 50 * count} bytes, "
                  f"but the file has {size}" if size >= 84 else f"too short: {size} bytes")
        raise ValueError(f"{call}: neither a binary STL ({binary}) nor an ASCII STL (byte "
                         f"{exc.start} is not text). The file is truncated or corrupt; export "
                         "it again.") from None
    if not text.lstrip().startswith("solid"):
        raise ValueError(f"{call}: not an STL file: an ASCII STL starts with 'solid', and as binary "
                         "STL its triangle count does not match its size. Export it again.")


# ------------------------------------------------------------------ PLY
def _sniff_ply(path: str, call: str) -> dict:
    """The header's format and elements, once the body is seen to be able to hold them."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(PLY_HEADER_LIMIT)
    m = re.search(rb"(\r?\n)end_header[ \t]*\r?\n", head)
    if not head.startswith(b"ply") or m is None:
        what = "does not start with 'ply'" if not head.startswith(b"ply") else \
            f"has no 'end_header' line in its first {len(head)} bytes"
        raise ValueError(f"{call}: not a complete PLY file: it {what}. The file is truncated or "
                         "corrupt; export it again.")
    body = size - m.end()
    fmt, elements = None, []
    for raw in head[:m.start()].decode("ascii", errors="replace").splitlines()[1:]:
        tok = raw.split()
        if not tok or tok[0] in ("comment", "obj_info"):
            continue
        if tok[0] == "format" and len(tok) >= 2:
            fmt = tok[1]
        elif tok[0] == "element" and len(tok) == 3 and tok[2].isdigit():
            elements.append([tok[1], int(tok[2]), 0])  # name, count, least bytes per row
        elif tok[0] == "property" and elements and len(tok) >= 3:
            if tok[1] == "list" and len(tok) == 5 and tok[2] in _PLY_SIZES and tok[3] in _PLY_SIZES:
                least = 3 if tok[4] in ("vertex_indices", "vertex_index") else 0  # a face has 3 or more
                elements[-1][2] += _PLY_SIZES[tok[2]] + least * _PLY_SIZES[tok[3]]
            elif tok[1] in _PLY_SIZES and len(tok) == 3:
                elements[-1][2] += _PLY_SIZES[tok[1]]
            else:
                raise ValueError(f"{call}: cannot read the PLY header line {raw.strip()!r}.")
        else:
            raise ValueError(f"{call}: cannot read the PLY header line {raw.strip()!r}.")
    if fmt not in ("ascii", "binary_little_endian", "binary_big_endian"):
        raise ValueError(f"{call}: the PLY format {fmt!r} is not ascii, binary_little_endian or "
                         "binary_big_endian.")
    announced = ", ".join(f"{n} {name}" for name, n, _ in elements) + " elements"
    if fmt == "ascii":
        with open(path, "rb") as fh:
            fh.seek(m.end())
            rows = sum(1 for row in fh if row.strip())
        need = sum(n for _, n, _ in elements)
        if rows < need:
            raise ValueError(f"{call}: the PLY file is truncated: its header announces {announced} "
                             f"({need} rows) but the body holds {rows}. Export it again.")
    else:
        need = sum(n * least for _, n, least in elements)
        if body < need:
            raise ValueError(f"{call}: the PLY file is truncated: its header announces {announced}, "
                             f"at least {need} bytes, but the body holds {body}. Export it again.")
    return {name: n for name, n, _ in elements}


def _check_ply_content(points: np.ndarray, blocks, header: dict, call: str) -> None:
    """What meshio read must be what the header announced (it reads past a short body silently)."""
    faces = sum(len(d) for t, d in blocks if t in ("vertex", "line", *_SURFACE))
    narrow = [t for t, d in blocks if t in ("vertex", "line") or (t in _SURFACE and d.ndim == 2
                                                                  and d.shape[1] < 3)]
    if len(points) != header.get("vertex", 0) or faces != header.get("face", 0) or narrow:
        raise ValueError(f"{call}: the PLY file is truncated or corrupt: its header announces "
                         f"{header.get('vertex', 0)} vertices and {header.get('face', 0)} faces, "
                         f"the body gave {len(points)} vertices and {faces} faces"
                         + (" (some with fewer than 3 vertices)" if narrow else "") + ". Export it again.")
