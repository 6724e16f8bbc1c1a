"""Meshes: validated triangle surfaces and tetrahedral volumes, generators, file input.

A :class:`Mesh` is immutable after construction (its arrays are read-only),
so the symbolic phase of assembly (the CSR pattern and the slot map, see
:mod:`managed_solve.assembly`) can be cached on it and reused by every
numeric assembly: a sweep over ``dt`` or ``alpha`` only redoes the numbers.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from . import _backend, meshfile

__all__ = ["Mesh", "icosphere", "grid", "torus", "read", "MAX_ICOSPHERE_SUBDIVISIONS"]

_KIND = {3: "triangle", 4: "tetra"}
# A face whose area (volume) is below this fraction of its edge length squared
# (cubed) is treated as degenerate: cotangents and gradients blow up there.
_DEGENERATE = 1e-12


class Mesh:
    """A triangle surface or a tetrahedral volume, validated once.

    Parameters
    ----------
    vertices : array_like, shape (n, 3) or (n, 2)
        Coordinates (2-D coordinates are padded with z = 0). Integer or
        floating dtype; stored as float64.
    faces : array_like of int, shape (m, 3) or (m, 4)
        Triangles (surface) or tetrahedra (volume), as vertex indices.

    Raises
    ------
    TypeError
        Non-numeric vertices, or faces that are not integers.
    ValueError
        Wrong shapes, non-finite coordinates, indices out of range, a face
        repeating a vertex, duplicate faces, faces of zero area (volume) at
        any coordinate scale, an area (volume) float64 cannot hold at this
        scale (rescale the vertices), or vertices used by no face; the
        message names the face or vertex.

    Examples
    --------
    >>> import numpy as np
    >>> from managed_solve.mesh import Mesh
    >>> m = Mesh([[0, 0, 0], [1, 0, 0], [0, 1, 0]], [[0, 1, 2]])
    >>> m.kind, m.n_vertices, m.n_faces, float(m.area())
    ('triangle', 3, 1, 0.5)
    """

    def __init__(self, vertices: Any, faces: Any):
        call = "Mesh(vertices, faces)"
        v = np.asarray(vertices)
        if v.dtype.kind not in "iuf":
            raise TypeError(
                f"{call}: vertices must be a real numeric array, got dtype {v.dtype}; "
                "pass coordinates as floats, e.g. np.asarray(vertices, dtype=float)."
            )
        if v.ndim != 2 or v.shape[1] not in (2, 3) or v.shape[0] == 0:
            raise ValueError(f"{call}: vertices must have shape (n, 3) or (n, 2) with n >= 1, "
                             f"got shape {v.shape}.")
        v = v.astype(np.float64)
        if v.shape[1] == 2:
            v = np.column_stack([v, np.zeros(len(v))])
        bad = ~np.isfinite(v).all(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{call}: vertex {i} has non-finite coordinates {v[i].tolist()} "
                             f"({int(bad.sum())} such vertices); remove or repair them.")
        f = np.asarray(faces)
        if f.dtype.kind not in "iu":
            raise TypeError(
                f"{call}: faces must be an integer array of vertex indices, got dtype {f.dtype}; "
                "convert with faces.astype(np.int64) if the values are whole numbers."
            )
        if f.ndim != 2 or f.shape[1] not in (3, 4) or f.shape[0] == 0:
            raise ValueError(f"{call}: faces must have shape (m, 3) for triangles or (m, 4) for "
                             f"tetrahedra with m >= 1, got shape {f.shape}.")
        n, k = len(v), f.shape[1]
        out = (f < 0) | (f >= n)
        if out.any():
            e = int(np.flatnonzero(out.any(axis=1))[0])
            raise ValueError(f"{call}: face {e} = {f[e].tolist()} has a vertex index outside "
                             f"[0, {n}); the mesh has {n} vertices.")
        # int32 indices halve the memory traffic of assembly; int64 only when needed.
        f = f.astype(np.int32 if n < 2**31 - 1 else np.int64)
        s = np.sort(f, axis=1)
        rep = (s[:, 1:] == s[:, :-1]).any(axis=1)
        if rep.any():
            e = int(np.flatnonzero(rep)[0])
            raise ValueError(f"{call}: face {e} = {f[e].tolist()} repeats a vertex; "
                             "drop degenerate faces before building the mesh.")
        order = np.lexsort(s.T[::-1])
        dup = (s[order[1:]] == s[order[:-1]]).all(axis=1)
        if dup.any():
            j = int(np.flatnonzero(dup)[0])
            a, b = sorted((int(order[j]), int(order[j + 1])))
            raise ValueError(f"{call}: faces {a} and {b} use the same vertices "
                             f"{sorted(f[a].tolist())}; remove the duplicate face.")
        used = np.zeros(n, dtype=bool)
        used[f.ravel()] = True
        if not used.all():
            i = int(np.flatnonzero(~used)[0])
            raise ValueError(f"{call}: vertex {i} is used by no face ({int((~used).sum())} unused "
                             "vertices); their rows would be empty and the system singular. "
                             "Drop them (mesh.read() does this for files).")
        self._vertices, self._faces = v, f
        measure, shape = _measures(v, f)
        tiny = shape <= _DEGENERATE
        what = "area" if k == 3 else "volume"
        if tiny.any():
            e = int(np.flatnonzero(tiny)[0])
            raise ValueError(f"{call}: face {e} = {f[e].tolist()} has zero {what} "
                             f"({what} / longest edge**{k - 1} = {shape[e]:.3g} <= {_DEGENERATE:g}); its "
                             "vertices are collinear or coplanar. Remove or repair degenerate faces.")
        # A well-shaped element whose measure is still not a normal float64 lies
        # beyond what float64 can represent at this coordinate scale.
        bad = ~(np.isfinite(measure) & (measure >= np.finfo(np.float64).tiny))
        if bad.any():
            e = int(np.flatnonzero(bad)[0])
            top = float(np.abs(v).max())
            way = "overflows" if not np.isfinite(measure[e]) else "underflows"
            raise ValueError(f"{call}: face {e} = {f[e].tolist()} is a valid element, but its {what} "
                             f"{way} float64 at this coordinate scale (largest |coordinate| "
                             f"{top:.3g}). Rescale the vertices, e.g. vertices / {top:.3g}.")
        v.setflags(write=False)
        f.setflags(write=False)
        measure.setflags(write=False)
        shape.setflags(write=False)
        self._measure, self._shape = measure, shape
        self._cache: dict = {}

    # ------------------------------------------------------------------ facts
    @property
    def cache(self) -> dict:
        """Data derived from this mesh and kept with it: assembly patterns, device copies, components.

        The mesh is immutable, so whatever is derived from it once serves
        every later call (:func:`managed_solve.assembly.symbolic` keys its
        patterns by target and index dtype).
        """
        return self._cache

    @property
    def vertices(self) -> np.ndarray:
        """Coordinates, float64 (n, 3), read-only."""
        return self._vertices

    @property
    def faces(self) -> np.ndarray:
        """Triangles (m, 3) or tetrahedra (m, 4), int32 (int64 beyond 2**31 vertices), read-only."""
        return self._faces

    elements = faces

    @property
    def kind(self) -> str:
        """``"triangle"`` or ``"tetra"``."""
        return _KIND[self._faces.shape[1]]

    @property
    def n_vertices(self) -> int:
        return int(self._vertices.shape[0])

    @property
    def n_faces(self) -> int:
        return int(self._faces.shape[0])

    def element_measures(self) -> np.ndarray:
        """Area of each triangle or volume of each tetrahedron (read-only)."""
        return self._measure

    def element_shapes(self) -> np.ndarray:
        """Each element's area (volume) over its longest edge squared (cubed), read-only.

        Scale-free; above 1e-12 for every element (smaller is refused as
        degenerate). It bounds the angles: a triangle's smallest sine is at
        least twice it, so no cotangent exceeds its inverse.
        """
        return self._shape

    def area(self) -> float:
        """Total surface area (triangles) or boundary area (tetrahedra)."""
        if self.kind == "triangle":
            return float(self._measure.sum())
        return float(_measures(self._vertices, self.boundary_faces())[0].sum())

    def volume(self) -> float:
        """Total volume of a tetrahedral mesh.

        Raises
        ------
        ValueError
            On a triangle surface (it has no volume of its own).
        """
        if self.kind != "tetra":
            raise ValueError("Mesh.volume(): this is a triangle surface; use Mesh.area()")
        return float(self._measure.sum())

    def edges(self) -> np.ndarray:
        """Unique undirected edges, int64 (e, 2), each with its smaller index first."""
        f = self._faces.astype(np.int64)
        k = f.shape[1]
        pairs = np.concatenate([f[:, [a, b]] for a in range(k) for b in range(a + 1, k)])
        pairs.sort(axis=1)
        keys = np.unique(pairs[:, 0] * self.n_vertices + pairs[:, 1])
        return np.stack(np.divmod(keys, self.n_vertices), axis=1)

    def mean_edge_length(self) -> float:
        """Mean length of the unique edges: the mesh size ``h`` in convergence studies."""
        e = self.edges()
        return float(np.linalg.norm(self._vertices[e[:, 1]] - self._vertices[e[:, 0]], axis=1).mean())

    def boundary_faces(self) -> np.ndarray:
        """Boundary edges (e, 2) of a surface, or boundary triangles (b, 3) of a volume."""
        f = self._faces.astype(np.int64)
        k = f.shape[1]
        if k == 3:
            sub = np.concatenate([f[:, [0, 1]], f[:, [1, 2]], f[:, [2, 0]]])
        else:
            sub = np.concatenate([f[:, [0, 1, 2]], f[:, [0, 1, 3]], f[:, [0, 2, 3]], f[:, [1, 2, 3]]])
        key = np.sort(sub, axis=1)
        _, first, counts = np.unique(key, axis=0, return_index=True, return_counts=True)
        return sub[np.sort(first[counts == 1])]

    def boundary_vertices(self) -> np.ndarray:
        """Sorted indices of vertices on the boundary (empty for a closed surface)."""
        return np.unique(self.boundary_faces())

    def is_closed(self) -> bool:
        """True for a surface without boundary edges (tetrahedral meshes always have a boundary)."""
        return self.kind == "triangle" and len(self.boundary_faces()) == 0

    def connected_components(self) -> np.ndarray:
        """The connected component of every vertex, int64 (n,), numbered 0, 1, ... in vertex order.

        Faces sharing a vertex are connected (a P1 function is continuous
        there). The Laplacian of a mesh has one null vector per component,
        the component's indicator: see :func:`managed_solve.pde.laplacian_nullspace`.

        Examples
        --------
        >>> import numpy as np
        >>> from managed_solve.mesh import Mesh
        >>> two = Mesh(np.eye(3).tolist() * 2, [[0, 1, 2], [3, 4, 5]])  # two triangles, apart
        >>> two.connected_components().tolist()
        [0, 0, 0, 1, 1, 1]
        """
        labels = self._cache.get("components")
        if labels is None:
            import scipy.sparse as sp
            from scipy.sparse.csgraph import connected_components

            f = self._faces.astype(np.int64)
            n = self.n_vertices
            # Each face joins its first vertex to the others: enough for connectivity.
            rows = np.repeat(f[:, 0], f.shape[1] - 1)
            cols = f[:, 1:].ravel()
            graph = sp.csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(n, n))
            _, raw = connected_components(graph, directed=False)
            # Renumber by first vertex, so component 0 holds vertex 0.
            _, first, inverse = np.unique(raw, return_index=True, return_inverse=True)
            order = np.argsort(np.argsort(first))
            labels = order[inverse].astype(np.int64)
            labels.setflags(write=False)
            self._cache["components"] = labels
        return labels

    def vertex_normals(self) -> np.ndarray:
        """Unit normals of a surface at its vertices: area-weighted face normals, oriented consistently.

        The faces are first oriented consistently across every edge two of
        them share (:meth:`face_orientation`), so a surface stored with some
        triangles flipped still gets normals that vary continuously over it;
        a surface stored consistently keeps its own orientation (outwards for
        :func:`icosphere`).

        Returns
        -------
        numpy array (n, 3)
            One unit vector per vertex.

        Raises
        ------
        ValueError
            On tetrahedra; on a non-orientable surface (no consistent
            orientation exists, see :meth:`face_orientation`); and where the
            face normals around a vertex cancel (two sheets of opposite
            orientation meeting only at that vertex, or a surface folded
            flat onto itself there), which leaves no normal direction.

        Examples
        --------
        >>> from managed_solve.mesh import Mesh
        >>> square = Mesh([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]], [[0, 1, 2], [1, 2, 3]])
        >>> square.vertex_normals().tolist()   # the second triangle is stored flipped
        [[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]]
        """
        if self.kind != "triangle":
            raise ValueError("Mesh.vertex_normals(): needs a triangle surface, this mesh holds tetrahedra")
        v, f = self._vertices, self._faces
        # A power-of-two rescaling (exact) keeps the cross products and norms finite at any scale.
        top = float(np.abs(v).max())
        v = np.ldexp(v, -int(np.frexp(top)[1])) if top > 0 else v
        fn = np.cross(v[f[:, 1]] - v[f[:, 0]], v[f[:, 2]] - v[f[:, 0]])  # length = 2 * scaled area
        fn *= self._oriented("Mesh.vertex_normals()")[:, None]
        vn = np.zeros_like(v)
        total = np.zeros(len(v))
        size = np.linalg.norm(fn, axis=1)
        for j in range(3):
            np.add.at(vn, f[:, j], fn)
            np.add.at(total, f[:, j], size)
        norm = np.linalg.norm(vn, axis=1)
        # Below this the summed direction is rounding noise of normals that cancel.
        flat = norm <= 64 * np.finfo(np.float64).eps * total
        if flat.any():
            i = int(np.flatnonzero(flat)[0])
            raise ValueError(f"Mesh.vertex_normals(): the face normals around vertex {i} cancel "
                             f"({int(flat.sum())} such vertices): sheets of opposite orientation "
                             "meet there, or the surface folds flat onto itself, so no normal "
                             "direction is defined. Separate the sheets (or repair the fold).")
        return vn / norm[:, None]

    def face_orientation(self) -> np.ndarray:
        """+1 or -1 per triangle: the flips that orient the surface consistently, int8 (m,), read-only.

        Two triangles sharing an edge are consistently oriented when they
        run through it in opposite directions. Orientation spreads across
        every edge shared by exactly two triangles (not across an edge of
        three or more); each piece held together that way keeps the
        orientation of most of its triangles (of its first triangle on a
        tie), so a consistently stored surface gets all +1.

        Raises
        ------
        ValueError
            On tetrahedra, and on a non-orientable surface such as a Moebius
            strip, where no consistent orientation exists; the message names
            a triangle of the offending piece.

        Examples
        --------
        >>> from managed_solve.mesh import Mesh
        >>> square = Mesh([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]], [[0, 1, 2], [1, 2, 3]])
        >>> square.face_orientation().tolist()
        [1, -1]
        """
        if self.kind != "triangle":
            raise ValueError("Mesh.face_orientation(): needs a triangle surface, this mesh holds "
                             "tetrahedra")
        return self._oriented("Mesh.face_orientation()")

    def _oriented(self, call: str) -> np.ndarray:
        hit = self._cache.get("face_orientation")
        if hit is None:
            hit = _orientation(self._faces.astype(np.int64), self.n_vertices, call)
            hit.setflags(write=False)
            self._cache["face_orientation"] = hit
        return hit

    def __repr__(self) -> str:
        return f"Mesh({self.kind}, n_vertices={self.n_vertices}, n_faces={self.n_faces})"


def _measures(v: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each element's area (volume), and that measure over its longest edge squared (cubed).

    The second is the scale-free shape test for degeneracy. Each element's
    edges are divided by a power of two near their largest component
    (exact), so no difference, cross product or norm overflows or
    underflows at any coordinate scale; the measure is scaled back last,
    and is inf or 0 only where the true value lies beyond float64.
    """
    k = f.shape[1]
    top = float(np.abs(v).max())
    p = int(np.frexp(top)[1]) if top > 0 else 0
    u = np.ldexp(v, -p)  # |u| < 1: differences below stay finite
    e = np.stack([u[f[:, j]] - u[f[:, 0]] for j in range(1, k)], axis=1)  # (m, k-1, 3)
    big = np.abs(e).max(axis=(1, 2))
    q = np.frexp(big)[1]  # 0 for an element whose vertices coincide
    e = np.ldexp(e, -q[:, None, None])  # largest component in [0.5, 1)
    pairs = [e[:, j] for j in range(k - 1)] + [e[:, j] - e[:, i] for i in range(k - 1)
                                               for j in range(i + 1, k - 1)]
    h = np.max([np.linalg.norm(d, axis=1) for d in pairs], axis=0)
    if k == 3:
        unit = 0.5 * np.linalg.norm(np.cross(e[:, 0], e[:, 1]), axis=1)
    else:
        unit = np.abs(np.einsum("ij,ij->i", e[:, 0], np.cross(e[:, 1], e[:, 2]))) / 6.0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        shape = np.where(h > 0, unit / h ** (k - 1), 0.0)
        measure = np.ldexp(unit, (k - 1) * (q + p))
    return measure, shape


def _orientation(f: np.ndarray, n: int, call: str) -> np.ndarray:
    """The +1/-1 flips of :meth:`Mesh.face_orientation` for triangles ``f`` over ``n`` vertices.

    A two-colouring with parities: each triangle is two nodes (kept,
    flipped), and a shared edge joins the nodes that agree across it. A
    piece is orientable exactly when no triangle's two nodes end up in one
    connected component; then each piece has two components, one per
    consistent orientation.
    """
    import scipy.sparse as sp
    from scipy.sparse.csgraph import connected_components

    m = len(f)
    start, end = f.ravel(), f[:, [1, 2, 0]].ravel()  # half-edges, three per triangle
    face = np.repeat(np.arange(m), 3)
    key = np.minimum(start, end) * n + np.maximum(start, end)
    order = np.argsort(key, kind="stable")
    _, first, counts = np.unique(key[order], return_index=True, return_counts=True)
    pair = first[counts == 2]
    h1, h2 = order[pair], order[pair + 1]
    f1, f2 = face[h1], face[h2]
    same = (start[h1] == start[h2]).astype(np.int64)  # same direction: one of the two must flip
    rows = np.concatenate([f1, f1 + m])
    cols = np.concatenate([f2 + m * same, f2 + m * (1 - same)])
    graph = sp.csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(2 * m, 2 * m))
    _, label = connected_components(graph, directed=False)
    kept, flipped = label[:m], label[m:]
    bad = kept == flipped
    if bad.any():
        e = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{call}: the surface is not orientable (like a Moebius strip): face {e} = "
                         f"{f[e].tolist()} cannot be oriented consistently with its neighbours, so "
                         "no continuous unit normal exists. Cut the surface into orientable pieces.")
    piece = np.minimum(kept, flipped)
    flip = kept != piece
    _, head, inverse = np.unique(piece, return_index=True, return_inverse=True)
    flips, sizes = np.bincount(inverse, weights=flip), np.bincount(inverse)
    swap = (2 * flips > sizes) | ((2 * flips == sizes) & flip[head])
    flip ^= swap[inverse]
    return np.where(flip, -1, 1).astype(np.int8)


def real_scalar(value: Any) -> np.ndarray | None:
    """``value`` as a 0-d real NumPy array, or None when it is not one real number.

    Python, NumPy, CuPy and torch scalars (a GPU's read to the host); None,
    strings, bools (flags, not numbers), arrays of other shapes and dtypes
    NumPy lacks are not. The callers word their own errors.
    """
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        a = np.asarray(_backend.to_host(value))
    except (TypeError, RuntimeError):  # a torch dtype NumPy has no counterpart for
        return None
    return a if a.ndim == 0 and a.dtype.kind in "iuf" else None


def scalar_kind(value: Any) -> str:
    """What a value :func:`real_scalar` refused is, for a message: a scalar's dtype, else its type."""
    try:
        plain = value is None or isinstance(value, (str, bytes))
        a = None if plain else np.asarray(_backend.to_host(value))
    except (TypeError, RuntimeError):
        a = None
    return f"dtype {a.dtype}" if a is not None and a.ndim == 0 else type(value).__name__


def _count(value: Any, least: int, call: str, name: str) -> int:
    """``value`` as an int >= ``least``; a TypeError or ValueError naming ``call`` and ``name`` otherwise.

    An integer, or a float holding one (``3.0``); a bool is a flag, not a
    count, so it is refused like any other non-number.
    """
    a = real_scalar(value)
    if a is None:
        found = "a bool" if np.asarray(value).dtype.kind == "b" else type(value).__name__
        raise TypeError(f"{call}: {name} must be an integer >= {least}, got {value!r} ({found}); "
                        f"pass e.g. {name}={least + 1}")
    if not (np.isfinite(a) and float(a) == int(a) and int(a) >= least):
        raise ValueError(f"{call}: {name} must be an integer >= {least}, got {value!r}")
    return int(a)


# ---------------------------------------------------------------- generators
#: The most subdivisions :func:`icosphere` makes. Building peaks near 650 bytes
#: of host memory per vertex (measured at 6 to 9 subdivisions): 1.6 GiB at 9,
#: so about 6.3 GiB at 10 and 25 GiB at 11 (42M vertices); 12 would need about
#: 100 GiB before any system is assembled on the mesh.
MAX_ICOSPHERE_SUBDIVISIONS = 11
_ICOSPHERE_BYTES_PER_VERTEX = 650


def icosphere(subdivisions: int = 3) -> Mesh:
    """The unit sphere: an icosahedron subdivided ``subdivisions`` times.

    Each subdivision splits every triangle into four and projects the new
    vertices onto the sphere; there are exactly ``10 * 4**k + 2`` vertices and
    ``20 * 4**k`` triangles, oriented outwards. Vectorised (edge midpoints are
    found with ``np.unique``), so 9 subdivisions (5.2M triangles) take seconds.
    At most :data:`MAX_ICOSPHERE_SUBDIVISIONS` (11): each level quadruples the
    memory the build needs (about 25 GiB at 11), so more is refused at once
    with a ValueError rather than failing in NumPy after minutes of work.

    Examples
    --------
    >>> from managed_solve.mesh import icosphere
    >>> m = icosphere(2)
    >>> m.n_vertices, m.n_faces, m.is_closed()
    (162, 320, True)
    """
    call = f"icosphere(subdivisions={subdivisions!r})"
    k = _count(subdivisions, 0, call, "subdivisions")
    if k > MAX_ICOSPHERE_SUBDIVISIONS:
        n, top = 10 * 4**k + 2, 10 * 4**MAX_ICOSPHERE_SUBDIVISIONS + 2
        size = (f"{n:,} vertices and {n * 2 - 4:,} triangles (about "
                f"{n * _ICOSPHERE_BYTES_PER_VERTEX // 2**30:,} GiB to build)" if k <= 30
                else f"about 10**{len(str(n)) - 1} vertices")
        raise ValueError(f"{call}: would make {size}; at most {MAX_ICOSPHERE_SUBDIVISIONS} "
                         f"subdivisions ({top:,} vertices, about "
                         f"{top * _ICOSPHERE_BYTES_PER_VERTEX / 2**30:.0f} GiB to build); pass subdivisions <= "
                         f"{MAX_ICOSPHERE_SUBDIVISIONS}")
    t = (1.0 + 5.0**0.5) / 2.0
    v = np.array([[-1, t, 0], [1, t, 0], [-1, -t, 0], [1, -t, 0], [0, -1, t], [0, 1, t],
                  [0, -1, -t], [0, 1, -t], [t, 0, -1], [t, 0, 1], [-t, 0, -1], [-t, 0, 1]], float)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    f = np.array([[0, 11, 5], [0, 5, 1], [0, 1, 7], [0, 7, 10], [0, 10, 11], [1, 5, 9],
                  [5, 11, 4], [11, 10, 2], [10, 7, 6], [7, 1, 8], [3, 9, 4], [3, 4, 2],
                  [3, 2, 6], [3, 6, 8], [3, 8, 9], [4, 9, 5], [2, 4, 11], [6, 2, 10],
                  [8, 6, 7], [9, 8, 1]], dtype=np.int64)
    for _ in range(k):
        n = len(v)
        a, b, c = f[:, 0], f[:, 1], f[:, 2]
        e = np.stack([np.stack([a, b], 1), np.stack([b, c], 1), np.stack([c, a], 1)])  # (3, m, 2)
        lo, hi = e.min(axis=2), e.max(axis=2)
        keys, inv = np.unique((lo * n + hi).ravel(), return_inverse=True)
        mid = v[keys // n] + v[keys % n]
        v = np.concatenate([v, mid / np.linalg.norm(mid, axis=1, keepdims=True)])
        m_ab, m_bc, m_ca = (inv.reshape(3, -1) + n)
        f = np.concatenate([np.stack([a, m_ab, m_ca], 1), np.stack([b, m_bc, m_ab], 1),
                            np.stack([c, m_ca, m_bc], 1), np.stack([m_ab, m_bc, m_ca], 1)])
    return Mesh(v, f)


def grid(nx: int, ny: int, nz: int | None = None) -> Mesh:
    """The unit square (cube) with ``nx x ny (x nz)`` vertices, triangulated (tetrahedralised).

    Vertex ``(i, j[, l])`` sits at ``(i/(nx-1), j/(ny-1)[, l/(nz-1)])`` and has
    index ``(i*ny + j)*nz + l`` (C order). Squares are split into two
    triangles; cubes into six tetrahedra around their main diagonal (Kuhn), so
    neighbouring cells match. For finite differences on the same lattice use
    :func:`managed_solve.pde.poisson_grid`.

    Examples
    --------
    >>> from managed_solve.mesh import grid
    >>> m = grid(3, 3)
    >>> m.n_vertices, m.n_faces, round(m.area(), 12)
    (9, 8, 1.0)
    >>> round(grid(3, 3, 3).volume(), 12)
    1.0
    """
    dims = (nx, ny) if nz is None else (nx, ny, nz)
    call = f"grid({', '.join(map(repr, dims))})"
    dims = tuple(_count(d, 2, call, name) for name, d in zip(("nx", "ny", "nz"), dims, strict=False))
    axes = [np.linspace(0.0, 1.0, d) for d in dims]
    pts = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(dims))
    idx = np.arange(pts.shape[0]).reshape(dims)
    if len(dims) == 2:
        p00, p10 = idx[:-1, :-1].ravel(), idx[1:, :-1].ravel()
        p01, p11 = idx[:-1, 1:].ravel(), idx[1:, 1:].ravel()
        f = np.concatenate([np.stack([p00, p10, p11], 1), np.stack([p00, p11, p01], 1)])
        return Mesh(pts, f)
    corner = {(a, b, c): idx[a:dims[0] - 1 + a, b:dims[1] - 1 + b, c:dims[2] - 1 + c].ravel()
              for a in (0, 1) for b in (0, 1) for c in (0, 1)}
    tets = []
    # Six tetrahedra per cube, one per monotone path from (0,0,0) to (1,1,1).
    for perm in ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)):
        p = [0, 0, 0]
        path = [corner[tuple(p)]]
        for axis in perm:
            p[axis] = 1
            path.append(corner[tuple(p)])
        tets.append(np.stack(path, 1))
    return Mesh(pts, np.concatenate(tets))


def torus(major: float = 1.0, minor: float = 0.4, nu: int = 48, nv: int = 24) -> Mesh:
    """A closed torus (genus one): ``nu`` steps around the axis, ``nv`` around the tube.

    Examples
    --------
    >>> from managed_solve.mesh import torus
    >>> m = torus(nu=16, nv=8)
    >>> m.n_vertices - len(m.edges()) + m.n_faces   # Euler characteristic of a torus
    0
    """
    call = f"torus(major={major!r}, minor={minor!r}, nu={nu!r}, nv={nv!r})"
    for name, x in (("major", major), ("minor", minor)):
        if real_scalar(x) is None:
            raise TypeError(f"{call}: {name} must be a real number, got {type(x).__name__}")
    if not (np.isfinite(major) and 0 < minor < major):
        raise ValueError(f"{call}: expected finite radii with 0 < minor < major")
    nu, nv = _count(nu, 3, call, "nu"), _count(nv, 3, call, "nv")
    u = 2 * np.pi * np.arange(nu) / nu
    w = 2 * np.pi * np.arange(nv) / nv
    U, W = np.meshgrid(u, w, indexing="ij")
    r = major + minor * np.cos(W)
    v = np.stack([r * np.cos(U), r * np.sin(U), minor * np.sin(W)], -1).reshape(-1, 3)
    i, j = np.meshgrid(np.arange(nu), np.arange(nv), indexing="ij")
    a = (i * nv + j).ravel()
    b = (((i + 1) % nu) * nv + j).ravel()
    c = (((i + 1) % nu) * nv + (j + 1) % nv).ravel()
    d = (i * nv + (j + 1) % nv).ravel()
    return Mesh(v, np.concatenate([np.stack([a, b, c], 1), np.stack([a, c, d], 1)]))


def read(path: str) -> Mesh:
    """Read a triangle surface or a tetrahedral mesh from a file.

    Formats: OBJ and OFF (read here), and whatever meshio reads (ply, stl,
    msh, vtk, vtu, ...; optional extra ``mesh``). Tetrahedra are used when the file
    has any, else its surface faces: quads and larger polygons are
    fan-triangulated (keeping their orientation; a non-convex polygon is
    refused). Lines and points are ignored, and vertices used by no face are
    dropped. Files are checked before they are parsed (see
    :mod:`managed_solve.meshfile`), so a truncated or corrupt file is an error,
    not a hang.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    ModuleNotFoundError
        meshio is needed for the format and not installed
        (``pip install "managed-solve[mesh]"``).
    ValueError
        Anything wrong with the file: corrupt, truncated, no faces, face
        indices out of range (or 0 in an OBJ), cells other than tetrahedra in
        a volume, degenerate faces. The message names the file, where in it,
        and the fix.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = pathlib.Path(folder) / "square.obj"
    ...     _ = path.write_text("v 0 0 0\\nv 1 0 0\\nv 1 1 0\\nv 0 1 0\\nf 1 2 3 4\\n")
    ...     m = read(str(path))  # the quad becomes two triangles
    >>> m.n_faces, float(m.area())
    (2, 1.0)
    """
    call = f"managed_solve.mesh.read({str(path)!r})"
    data = meshfile.load(path, call=call)
    used, f = np.unique(data.faces, return_inverse=True)
    try:
        return Mesh(data.points[used], f.reshape(data.faces.shape))
    except ValueError as exc:
        # Mesh numbers faces and vertices after triangulation and dropping
        # unused vertices: say which of the file's they are.
        msg = str(exc).replace("Mesh(vertices, faces): ", "")
        where = []
        m = re.search(r"\bfaces? (\d+)(?: and (\d+))?", msg)
        for e in (m.groups() if m else ()):
            if e is not None:
                where.append(f"face {e} is {data.face_label(int(e))}")
        m = re.search(r"\bvertex (\d+)", msg)
        if m:
            where.append(f"vertex {m.group(1)} is {data.vertex_label(int(used[int(m.group(1))]))}")
        raise ValueError(f"{call}: {msg}" + (f" ({'; '.join(where)})" if where else "")) from None
