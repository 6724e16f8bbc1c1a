"""Assembly dispatcher: symbolic phase (cached per mesh), numeric phase, grid stencils.

Picks the kernel twin from ``managed_solve.kernels`` by where the result
should live:

- ``device="cpu"`` (or a simulated ``sim:i``): the ``@njit(parallel=True)``
  CPU twins on NumPy arrays; the result is a SciPy CSR matrix.
- ``device="cuda:i"``: the ``numba.cuda`` kernels on CuPy arrays, launched on
  CuPy's current stream (``numba.cuda.external_stream``), so a solve queued
  after the assembly is ordered behind it without a host synchronisation;
  the result is a ``cupyx.scipy.sparse`` CSR matrix.
- ``backend="cudasim"`` (a test hook): the CUDA kernels launched with NumPy
  arrays, which run under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)
  or, on a machine with a GPU, on the GPU with Numba copying the arrays.
  Keep such meshes small (the simulator runs each thread in Python).

Symbolic phase (:func:`symbolic`): vertex incidence, CSR pattern and slot
map, computed once per mesh, device and index width, and cached on the
:class:`~managed_solve.mesh.Mesh`. Numeric phase (:func:`assemble`): one
kernel pass writes ``a*L + b*M + c*D`` straight into a fresh CSR ``data``
array through the slots (no COO triplets, no sort); peak memory is the CSR
arrays, the mesh and the slot map.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from . import _backend
from .mesh import Mesh, real_scalar, scalar_kind
from .value_range import check_floors, check_grid_range

_INT32_MAX = np.iinfo(np.int32).max
BACKENDS = ("cpu", "cuda", "cudasim")
_TERMS = {"stiffness": "L", "mass": "M", "lumped_mass": "D"}


@dataclass(frozen=True)
class Target:
    """Where assembly runs: ``backend`` in {"cpu", "cuda", "cudasim"}, ``device`` "cpu" or "cuda:i"."""

    backend: str
    device: str
    index: int = 0

    @property
    def xp(self) -> ModuleType:
        return _backend.cupy() if self.backend == "cuda" else np


def resolve_target(device: Any = "cpu", backend: str | None = None, *, call: str = "assemble") -> Target:
    """Normalise ``device`` (None, "cpu", "sim:1", "cuda:0", a Device) and ``backend``.

    Raises
    ------
    ValueError
        An unknown backend, or ``backend="cuda"`` with a host device (and vice versa).
    """
    from .device_args import cuda_ordinal

    name = "cpu" if device is None else str(device)
    idx = cuda_ordinal(name, what=f"{call}(device=...)")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"{call}(backend={backend!r}): expected one of {', '.join(BACKENDS)} or None")
    if idx is not None:
        if backend not in (None, "cuda"):
            raise ValueError(f"{call}(device={name!r}, backend={backend!r}): a CUDA device "
                             "assembles with backend='cuda' (or None)")
        return Target("cuda", f"cuda:{idx}", idx)
    if backend == "cuda":
        raise ValueError(f"{call}(device={name!r}, backend='cuda'): backend='cuda' needs a "
                         "CUDA device such as device='cuda:0'")
    return Target(backend or "cpu", "cpu", 0)


def _device_context(t: Target):
    import contextlib

    return _backend.cupy().cuda.Device(t.index) if t.backend == "cuda" else contextlib.nullcontext()


def _launch(kernel: Any, nthreads: int, args: tuple, t: Target) -> None:
    """Launch a CUDA kernel, one thread per item, on CuPy's current stream (or with host arrays)."""
    # The np.row_stack shim must run before numba.cuda is imported.
    from .kernels import _compat  # noqa: I001
    from numba import cuda

    tpb = _compat.THREADS_PER_BLOCK
    blocks = max(1, math.ceil(nthreads / tpb))
    if t.backend == "cudasim":
        # Numba copies host arrays in and back out; read-only inputs (mesh
        # arrays) cannot be written back into, so pass writable copies.
        args = tuple(np.array(a) if isinstance(a, np.ndarray) and not a.flags.writeable else a
                     for a in args)
        # The simulator stores through NumPy, which warns where a GPU stores an
        # inf silently; the caller checks the values' range either way.
        with np.errstate(over="ignore"):
            kernel[blocks, tpb](*args)
        return
    cp = _backend.cupy()
    ptr = cp.cuda.get_current_stream().ptr
    stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
    # sync=False: Numba would otherwise synchronise the stream each CuPy array
    # was exported on (CUDA Array Interface v3); ordering comes from the shared stream.
    args = tuple(cuda.as_cuda_array(a, sync=False) if hasattr(a, "__cuda_array_interface__") else a
                 for a in args)
    with warnings.catch_warnings():
        # A small mesh gives a grid too small to fill the GPU; that is expected
        # here, and Numba's low-occupancy warning would only alarm the user.
        warnings.filterwarnings("ignore", message=".*under-utilization.*")
        kernel[blocks, tpb, stream](*args)


def _kernels_for(mesh: Mesh) -> ModuleType:
    from .kernels import cotan, tet

    return cotan if mesh.kind == "triangle" else tet


def _check_index_dtype(index_dtype: Any, call: str) -> np.dtype | None:
    if index_dtype is None:
        return None
    dt = np.dtype(index_dtype)
    if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise TypeError(f"{call}(index_dtype={index_dtype!r}): expected np.int32, np.int64 or None")
    return dt


def _entry_bounds(mesh: Mesh) -> tuple[float, float]:
    """``(S, W)``: no entry of ``a*L + b*M + c*D`` exceeds ``|a|*S + (|b|/6 + |c|/3)*W`` in magnitude.

    ``W`` is the largest total measure of the elements around a vertex (it
    bounds every mass entry of that row); ``S`` sums over the same elements a
    bound of each one's stiffness entries, from its shape ``s``: a triangle's
    cotangents are at most ``1/(2s)`` (its smallest sine is at least ``2s``),
    a tetrahedron's entries ``|g_l . g_j| / (36 vol)`` at most ``h/(36s)``
    (each gradient numerator is twice a face area, at most ``h**2``). Host
    arithmetic on the mesh's own facts, cached on it: assembly decides from
    it, without reading the result back from a GPU, whether the values can
    leave the value type's range at all.
    """
    hit = mesh.cache.get("entry_bounds")
    if hit is None:
        measure, shape, faces = mesh.element_measures(), mesh.element_shapes(), mesh.faces
        k = faces.shape[1]
        with np.errstate(over="ignore"):  # a bound past float64 is inf: the exact test decides
            per = 0.5 / shape if k == 3 else np.cbrt(measure / shape) / (36.0 * shape)
            S = float(np.bincount(faces.ravel(), weights=np.repeat(per, k)).max())
            W = float(np.bincount(faces.ravel(), weights=np.repeat(measure, k)).max())
        hit = mesh.cache["entry_bounds"] = (S, W)
    return hit


def _check_range(values: Any, bound: float, dt: np.dtype, mesh: Mesh, call: str, what: str) -> None:
    """Refuse assembled values that overflowed ``dt``: the mesh is valid, the scale is not representable.

    ``bound`` (from :func:`_entry_bounds`) decides on the host; only where it
    comes within a factor 2 of the type's largest value are the values read.
    """
    with np.errstate(over="ignore"):
        safe = 2.0 * bound <= float(np.finfo(dt).max)
    if safe:
        return
    from .system.inputs import all_finite

    if all_finite(values):  # sync: only where the bound leaves the value type's range
        return
    top = float(np.abs(mesh.vertices).max())
    kind = "area" if mesh.kind == "triangle" else "volume"
    wider = ", or use dtype=np.float64" if dt == np.float32 else ""
    raise ValueError(f"{call}(mesh=...): {what} has entries beyond {dt.name}'s range at this mesh's scale "
                     f"(largest |coordinate| {top:.3g}, largest element {kind} "
                     f"{float(mesh.element_measures().max()):.3g}); the mesh is valid, but these "
                     f"values cannot be stored. Rescale the mesh, e.g. "
                     f"Mesh(mesh.vertices / {top:.3g}, mesh.faces), or the coefficients{wider}.")


def check_flag(value: Any, call: str, name: str) -> bool:
    """``value`` as a bool when it is one (Python's or NumPy's); a TypeError naming ``name`` otherwise.

    A string such as ``"no"`` is truthy: reading flags by truth value would
    turn it into the opposite of what was meant.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{call}({name}={value!r}): expected True or False, got "
                        f"{type(value).__name__}")
    return bool(value)


def _check_dtype(dtype: Any, call: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"{call}(dtype={dtype!r}): expected np.float32 or np.float64")
    return dt


@dataclass
class Pattern:
    """The symbolic phase of one mesh on one target: CSR pattern and slot map.

    Arrays live where the target computes (NumPy or CuPy). ``inc_*`` describe
    the vertex-to-element incidence; ``inc_slot[p, j]`` is the position in
    CSR ``data`` of entry (vertex of ``p``, ``j``-th vertex of element
    ``inc_elem[p]``). See ``managed_solve.kernels.pattern``.
    """

    target: Target
    n: int
    nnz: int
    index_dtype: np.dtype
    indptr: Any
    indices: Any
    inc_ptr: Any
    inc_elem: Any
    inc_local: Any
    inc_slot: Any
    vertices: Any
    faces: Any

    @property
    def nbytes(self) -> int:
        """Bytes held: pattern, incidence, slot map and the mesh copy."""
        return int(sum(a.nbytes for a in (self.indptr, self.indices, self.inc_ptr, self.inc_elem,
                                          self.inc_local, self.inc_slot, self.vertices, self.faces)))


def symbolic(mesh: Mesh, *, device: Any = "cpu", index_dtype: Any = None,
             backend: str | None = None) -> Pattern:
    """The CSR pattern of vertex adjacency and the slot map of ``mesh`` (cached on the mesh).

    Parameters
    ----------
    mesh : Mesh
    device : str or Device
        ``"cpu"``, ``"sim:i"`` (CPU twins) or ``"cuda:i"`` (CUDA kernels).
    index_dtype : {None, np.int32, np.int64}
        Width of ``indptr``/``indices``/slots: int32 unless the counts need
        int64 (None), or forced.
    backend : {None, "cpu", "cuda", "cudasim"}
        See the module docstring; None follows ``device``.

    Returns
    -------
    Pattern

    Examples
    --------
    >>> from managed_solve.mesh import icosphere
    >>> from managed_solve.assembly import symbolic
    >>> p = symbolic(icosphere(1))
    >>> p.n, p.nnz          # 42 vertices, 120 edges: 42 + 2 * 120 entries
    (42, 282)
    >>> symbolic(icosphere(1)) is p, symbolic(m := icosphere(1)) is symbolic(m)
    (False, True)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"symbolic(mesh=...): expected a managed_solve.mesh.Mesh, got {type(mesh).__name__}")
    t = resolve_target(device, backend, call="symbolic")
    idt = _check_index_dtype(index_dtype, "symbolic")
    key = ("pattern", t, None if idt is None else idt.str)
    hit = mesh.cache.get(key)
    if hit is not None:
        return hit
    from .kernels import pattern as kp

    faces = mesh.faces
    m, k = faces.shape
    n = mesh.n_vertices
    xp = t.xp
    with _device_context(t):
        if t.backend == "cuda":
            vertices, dfaces = xp.asarray(mesh.vertices), xp.asarray(faces)
        else:
            vertices, dfaces = mesh.vertices, faces
        inc_ptr = xp.zeros(n + 1, dtype=np.int64)
        inc_elem = xp.empty(m * k, dtype=faces.dtype)
        inc_local = xp.empty(m * k, dtype=np.int8)
        if t.backend == "cpu":
            kp.incidence_cpu(dfaces, inc_ptr, inc_elem, inc_local)
        else:
            _launch(kp.incidence_count_cuda, m, (dfaces, inc_ptr), t)
            inc_ptr = xp.cumsum(inc_ptr)
            cursor = inc_ptr[:-1].copy()
            _launch(kp.incidence_fill_cuda, m, (dfaces, cursor, inc_elem, inc_local), t)
            _launch(kp.incidence_sort_cuda, n, (inc_ptr, inc_elem, inc_local), t)
            del cursor
        cand = xp.empty(m * k * k, dtype=faces.dtype)
        row_nnz = xp.empty(n, dtype=np.int64)
        if t.backend == "cpu":
            kp.unique_neighbours_cpu(dfaces, inc_ptr, inc_elem, cand, row_nnz)
        else:
            _launch(kp.unique_neighbours_cuda, n, (dfaces, inc_ptr, inc_elem, cand, row_nnz), t)
        indptr64 = xp.zeros(n + 1, dtype=np.int64)
        xp.cumsum(row_nnz, out=indptr64[1:])
        nnz = int(indptr64[-1])  # sync: the pattern size, once per mesh
        if idt is None:
            idt = np.dtype(np.int64 if max(nnz, n) > _INT32_MAX else np.int32)
        elif idt == np.int32 and max(nnz, n) > _INT32_MAX:
            raise ValueError(f"symbolic(index_dtype=np.int32): the pattern has {nnz} entries, more "
                             "than int32 can index; use index_dtype=np.int64 or None")
        indptr = indptr64.astype(idt, copy=False)
        indices = xp.empty(nnz, dtype=idt)
        inc_slot = xp.empty((m * k, k), dtype=idt)
        if t.backend == "cpu":
            kp.copy_pattern_cpu(inc_ptr, k, cand, indptr, indices)
            kp.slot_map_cpu(dfaces, inc_ptr, inc_elem, indptr, indices, inc_slot)
        else:
            _launch(kp.copy_pattern_cuda, n, (inc_ptr, k, cand, indptr, indices), t)
            _launch(kp.slot_map_cuda, n, (dfaces, inc_ptr, inc_elem, indptr, indices, inc_slot), t)
        del cand
    p = Pattern(t, n, nnz, idt, indptr, indices, inc_ptr, inc_elem, inc_local, inc_slot, vertices, dfaces)
    mesh.cache[key] = p
    return p


def _csr(data: Any, indices: Any, indptr: Any, n: int, t: Target) -> Any:
    """A CSR matrix over the given arrays, without copies or re-checks of the pattern."""
    if t.backend == "cuda":  # columns sorted and unique by construction
        from .system.device_checks import csr_from_parts

        return csr_from_parts(data, indices, indptr, n, canonical=True)
    A = _backend.sparse_module(t.xp).csr_matrix((data, indices, indptr), shape=(n, n), copy=False)
    # SciPy narrows int64 indices that fit into int32; keep the width asked for.
    A.indices, A.indptr = indices, indptr
    A.has_canonical_format = True  # sorted and unique: spare SciPy's O(nnz) check
    return A


def assemble(mesh: Mesh, *, stiffness: float = 1.0, mass: float = 0.0, lumped_mass: float = 0.0,
             device: Any = "cpu", dtype: Any = np.float64, index_dtype: Any = None,
             backend: str | None = None, call: str = "assemble") -> Any:
    """``stiffness*L + mass*M + lumped_mass*D`` as a CSR matrix, in one kernel pass.

    ``L`` is the cotangent Laplacian of a triangle surface (the P1 stiffness of
    a tetrahedral mesh) in its positive semi-definite sign convention
    (``L = -Laplacian``, zero row sums), ``M`` the consistent P1 mass and ``D``
    the lumped (row-sum) mass, diagonal.

    Parameters
    ----------
    mesh : Mesh
    stiffness, mass, lumped_mass : float
        Coefficients of ``L``, ``M`` and ``D``: finite real numbers (a
        TypeError or ValueError names the one that is not).
    device : str or Device
        ``"cpu"``/``"sim:i"`` (SciPy CSR) or ``"cuda:i"`` (cupyx CSR).
    dtype : {np.float64, np.float32}
        Value type (the geometry is read in float64 either way).
    index_dtype : {None, np.int32, np.int64}
        See :func:`symbolic`.
    backend : {None, "cpu", "cuda", "cudasim"}
        See the module docstring.
    call : str
        The name errors give the call (the builders of
        :mod:`managed_solve.pde` pass their own).

    Returns
    -------
    scipy.sparse.csr_matrix or cupyx.scipy.sparse.csr_matrix

    Raises
    ------
    ValueError
        Values that ``dtype`` cannot hold at this mesh's scale (e.g. areas
        near 1e160 in float32, or with huge coefficients); the message names
        the scale and the fix (rescale the vertices). The geometry itself is
        computed scale-free, so any mesh :class:`Mesh` accepts assembles
        whenever its values are representable. A term asked for whose entries
        would fall below ``dtype``'s normal range (a float32 mass of a mesh near
        1e-20, or a tiny coefficient) is refused alike, naming the mesh's
        scale or the coefficient: stored as subnormal numbers or zeros, they
        would make the system solved later singular or wrong.

    Examples
    --------
    >>> import numpy as np
    >>> from managed_solve.mesh import icosphere
    >>> from managed_solve.assembly import assemble
    >>> m = icosphere(2)
    >>> L = assemble(m)
    >>> bool(abs(L.sum(axis=1)).max() < 1e-12), bool(abs(L - L.T).max() < 1e-12)
    (True, True)
    >>> D = assemble(m, stiffness=0.0, lumped_mass=1.0)
    >>> bool(np.isclose(D.sum(), m.area()))
    True
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{call}(mesh=...): expected a managed_solve.mesh.Mesh, got {type(mesh).__name__}")
    dt = _check_dtype(dtype, call)
    for name, val in (("stiffness", stiffness), ("mass", mass), ("lumped_mass", lumped_mass)):
        a = real_scalar(val)
        if a is None:
            found = scalar_kind(val)
            raise TypeError(f"{call}({name}={val!r}): expected a real number (the coefficient of "
                            f"{_TERMS[name]}), got {found}; pass e.g. {name}=1.0, or 0.0 to leave "
                            "the term out")
        if not np.isfinite(a):
            raise ValueError(f"{call}({name}={val!r}): expected a finite number")
    stiffness, mass, lumped_mass = (float(_backend.to_host(c)) for c in (stiffness, mass, lumped_mass))
    check_floors(mesh, dt, call, [("L", stiffness, "stiffness"), ("M", mass, "mass"),
                                  ("D", lumped_mass, "lumped_mass")])
    p = symbolic(mesh, device=device, index_dtype=index_dtype, backend=backend)
    t = p.target
    kern = _kernels_for(mesh)
    with _device_context(t):
        data = t.xp.empty(p.nnz, dtype=dt)
        args = (p.vertices, p.faces, p.inc_ptr, p.inc_elem, p.inc_local, p.inc_slot, p.indptr,
                float(stiffness), float(mass), float(lumped_mass), data)
        if t.backend == "cpu":
            kern.assemble_cpu(*args)
        else:
            _launch(kern.assemble_cuda, p.n, args, t)
        S, W = _entry_bounds(mesh)
        with np.errstate(over="ignore"):
            bound = abs(stiffness) * S + (abs(mass) / 6.0 + abs(lumped_mass) / 3.0) * W
        _check_range(data, bound, dt, mesh, call,
                     f"the matrix {stiffness:g}*L + {mass:g}*M + {lumped_mass:g}*D")
        return _csr(data, p.indices, p.indptr, p.n, t)


def assemble_laplacian(mesh: Mesh, **kwargs: Any) -> Any:
    """The cotangent Laplacian (P1 stiffness on tetrahedra), positive semi-definite; see :func:`assemble`.

    Singular: the constants (one per connected component) are its null
    space. Solve with it through ``solve(L, b, nullspace="constant")`` (a
    connected mesh) or ``nullspace=managed_solve.pde.laplacian_nullspace(mesh)``,
    or build the system with :func:`managed_solve.pde.laplacian`, which
    carries it.

    Examples
    --------
    >>> import numpy as np
    >>> from managed_solve import mesh, solve
    >>> from managed_solve.assembly import assemble_laplacian, lumped_mass
    >>> m = mesh.icosphere(3)
    >>> z = m.vertices[:, 2]
    >>> r = solve(assemble_laplacian(m), lumped_mass(m) * 2 * z, nullspace="constant")
    >>> r.status.name, bool(np.abs(r.x - z).max() < 1e-2)    # -Laplace(z) = 2 z on the sphere
    ('CONVERGED', True)
    """
    return assemble(mesh, stiffness=1.0, **kwargs)


def assemble_mass(mesh: Mesh, lumped: bool = True, **kwargs: Any) -> Any:
    """The lumped (diagonal, in the full pattern) or consistent mass matrix; see :func:`assemble`.

    ``lumped`` is a bool (another value is a TypeError, not read as true or false).
    """
    check_flag(lumped, kwargs.get("call", "assemble_mass"), "lumped")
    if lumped:
        return assemble(mesh, stiffness=0.0, lumped_mass=1.0, **kwargs)
    return assemble(mesh, stiffness=0.0, mass=1.0, **kwargs)


def lumped_mass(mesh: Mesh, *, device: Any = "cpu", dtype: Any = np.float64,
                backend: str | None = None, call: str = "lumped_mass") -> Any:
    """The lumped mass of each vertex (a third of the surrounding area, a quarter of the volume).

    A ValueError names the scale and the fix (rescale the vertices) where
    ``dtype`` cannot hold these masses, too large or below its normal range;
    ``call`` names the caller in it.

    Examples
    --------
    >>> from managed_solve.mesh import grid
    >>> from managed_solve.assembly import lumped_mass
    >>> round(float(lumped_mass(grid(4, 4)).sum()), 12)
    1.0
    """
    dt = _check_dtype(dtype, call)
    check_floors(mesh, dt, call, [("D", 1.0, None)])
    p = symbolic(mesh, device=device, backend=backend)
    t = p.target
    kern = _kernels_for(mesh)
    with _device_context(t):
        out = t.xp.empty(p.n, dtype=dt)
        args = (p.vertices, p.faces, p.inc_ptr, p.inc_elem, p.inc_local, out)
        if t.backend == "cpu":
            kern.lumped_mass_cpu(*args)
        else:
            _launch(kern.lumped_mass_cuda, p.n, args, t)
        _check_range(out, _entry_bounds(mesh)[1] / 3.0, dt, mesh, call, "the lumped mass")
        return out


# ------------------------------------------------------------------- grids
def grid_shape(shape: Any, *, call: str = "grid_shape") -> tuple[int, ...]:
    """``shape`` as a tuple of 2 or 3 positive ints; a TypeError or ValueError naming ``call`` otherwise."""
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(f"{call}(shape={shape!r}): expected a tuple of 2 or 3 positive integers "
                        f"(interior nodes per axis), got {type(shape).__name__}; e.g. "
                        f"shape=({shape!r}, {shape!r}) for a square grid") from None
    ok = len(items) in (2, 3)
    for s in items if ok else ():
        a = real_scalar(s)
        ok = ok and a is not None and bool(np.isfinite(a)) and int(a) == a and a >= 1
    if not ok:
        raise ValueError(f"{call}(shape={shape!r}): expected 2 or 3 positive integers (interior nodes "
                         "per axis), e.g. shape=(31, 31)")
    return tuple(int(s) for s in items)


def grid_spacing(shape: tuple[int, ...], lengths: Any = 1.0, *,
                 call: str = "grid_spacing") -> tuple[float, ...]:
    """Node spacing of an interior grid of ``shape`` nodes on a box of ``lengths``: ``L/(n+1)``.

    ``lengths`` is one number (a cube) or one per axis, each finite and > 0;
    anything else is a TypeError or ValueError naming ``call``.
    """
    d = len(shape)
    try:
        a = np.asarray(_backend.to_host(lengths))
    except Exception:  # a ragged sequence, or an object NumPy cannot read
        a = np.asarray(None)
    if a.dtype.kind not in "iuf":
        raise TypeError(f"{call}(lengths={lengths!r}): expected a number or {d} real side lengths, "
                        f"e.g. lengths={(1.0,) * d}")
    if not (a.ndim == 0 or a.shape == (d,)):
        raise ValueError(f"{call}(lengths={lengths!r}): a {d}-D grid needs one number or {d} side "
                         f"lengths, got shape {a.shape}; e.g. lengths={(1.0,) * d}")
    a = np.broadcast_to(a.astype(float), (d,))
    if not (np.isfinite(a) & (a > 0)).all():
        raise ValueError(f"{call}(lengths={lengths!r}): side lengths must be finite and > 0, got "
                         f"{a.tolist()}")
    return tuple(float(L) / (s + 1) for L, s in zip(a, shape, strict=True))


def face_coefficients(shape: tuple[int, ...], coefficient: Any, spacing: tuple[float, ...],
                      *, call: str = "assemble_grid") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The coefficient on cell faces, ``(cx, cy, cz)`` as the stencil kernels take them.

    ``coefficient`` is None (1), a positive number, an array of node values
    of ``shape`` (faces take the mean of their two nodes; boundary faces the
    value of their one interior node), or a callable of the coordinates
    (``c(x, y)`` or ``c(x, y, z)``, NumPy arrays) evaluated at face midpoints,
    node ``i`` lying at ``(i+1)*h``.
    """
    d = len(shape)
    shp3 = tuple(shape) + (1,) * (3 - d)
    faces = []
    for ax in range(3):
        fshape = list(shp3)
        fshape[ax] += 1
        if ax >= d:
            faces.append(np.zeros(fshape))
            continue
        if coefficient is None:
            faces.append(np.ones(fshape))
        elif callable(coefficient):
            coords = [(np.arange(fshape[j]) + (0.5 if j == ax else 1.0)) * spacing[j] for j in range(d)]
            mesh_ = np.meshgrid(*coords, indexing="ij")
            c = np.asarray(coefficient(*mesh_))
            if c.dtype.kind not in "iuf":
                raise TypeError(f"{call}(coefficient=...): the callable returned dtype {c.dtype}; "
                                "it must return real values")
            c = np.broadcast_to(c.astype(float), tuple(fshape[:d]))
            faces.append(np.ascontiguousarray(c).reshape(fshape))
        elif np.asarray(coefficient).dtype.kind not in "iuf":
            raise TypeError(f"{call}(coefficient=...): expected None, a real number, an array of "
                            f"the grid's shape or a callable, got dtype {np.asarray(coefficient).dtype}")
        elif np.ndim(coefficient) == 0:
            faces.append(np.full(fshape, float(coefficient)))
        else:
            c = np.asarray(coefficient, dtype=float)
            if c.shape != tuple(shape):
                raise ValueError(f"{call}(coefficient=...): an array coefficient must have the grid's "
                                 f"shape {tuple(shape)} (node values), got {c.shape}")
            c = c.reshape(shp3)
            lo = np.take(c, [0], axis=ax)
            hi = np.take(c, [shp3[ax] - 1], axis=ax)
            inner = 0.5 * (np.take(c, range(1, shp3[ax]), axis=ax) + np.take(c, range(shp3[ax] - 1), axis=ax))
            faces.append(np.concatenate([lo, inner, hi], axis=ax))
    for name, f in zip("xyz"[:d], faces[:d], strict=True):
        if not (np.isfinite(f).all() and (f > 0).all()):
            raise ValueError(f"{call}(coefficient=...): the coefficient must be finite and > 0 on "
                             f"every face; the {name}-faces have min {f.min():.3g}. A non-positive "
                             "coefficient makes the operator indefinite.")
    return faces[0], faces[1], faces[2]


def assemble_grid(shape: tuple[int, ...], *, coefficient: Any = None, lengths: Any = 1.0,
                  device: Any = "cpu", dtype: Any = np.float64, index_dtype: Any = None,
                  backend: str | None = None, call: str = "assemble_grid") -> Any:
    """The 5-point (2-D) or 7-point (3-D) matrix of ``-div(c grad u)``, Dirichlet u = 0 outside.

    The unknowns are the ``prod(shape)`` interior nodes of a box of side
    ``lengths`` (default the unit square/cube), spacing ``h = L/(n+1)`` per
    axis, numbered in C order; the matrix is symmetric positive definite.
    Its entries are ``c / h**2``: a box or coefficient that puts them
    outside ``dtype``'s normal range (below its smallest normal number,
    where they lose their digits or vanish, or beyond its largest) is a
    ValueError naming ``lengths`` and the fix, before any kernel runs.
    ``call``: the name errors give the call (:func:`managed_solve.pde.poisson_grid`
    passes its own).

    Examples
    --------
    >>> from managed_solve.assembly import assemble_grid
    >>> A = assemble_grid((3, 3))
    >>> A.shape, A.nnz, float(A[4, 4])   # h = 1/4: centre 4/h^2, neighbours -1/h^2
    ((9, 9), 33, 64.0)
    """
    shape = grid_shape(shape, call=call)
    dt = _check_dtype(dtype, call)
    idt = _check_index_dtype(index_dtype, call)
    t = resolve_target(device, backend, call=call)
    h = grid_spacing(shape, lengths, call=call)
    cx, cy, cz = face_coefficients(shape, coefficient, h, call=call)
    nx, ny, nz = shape + (1,) * (3 - len(shape))
    n = nx * ny * nz
    with np.errstate(over="ignore", under="ignore", divide="ignore"):  # refused just below
        ih = [float(1.0 / np.float64(s) ** 2) for s in h] + [1.0] * (3 - len(shape))
    check_grid_range((cx, cy, cz)[:len(shape)], ih, dt, call, lengths)
    from .kernels import stencil as ks

    xp = t.xp
    with _device_context(t):
        row_nnz = xp.empty(n, dtype=np.int64)
        if t.backend == "cpu":
            ks.row_counts_cpu(nx, ny, nz, row_nnz)
        else:
            _launch(ks.row_counts_cuda, n, (nx, ny, nz, row_nnz), t)
        # nnz has a closed form, so no host read of the counts is needed.
        nnz = n + 2 * ((nx - 1) * ny * nz + nx * (ny - 1) * nz + nx * ny * (nz - 1))
        if idt is None:
            idt = np.dtype(np.int64 if max(n, nnz) > _INT32_MAX else np.int32)
        indptr = xp.zeros(n + 1, dtype=idt)
        indptr[1:] = xp.cumsum(row_nnz)
        indices = xp.empty(nnz, dtype=idt)
        data = xp.empty(nnz, dtype=dt)
        cx, cy, cz = (xp.asarray(c) for c in (cx, cy, cz))
        args = (nx, ny, nz, cx, cy, cz, ih[0], ih[1], ih[2], indptr, indices, data)
        if t.backend == "cpu":
            ks.fill_cpu(*args)
        else:
            _launch(ks.fill_cuda, n, args, t)
        return _csr(data, indices, indptr, n, t)
