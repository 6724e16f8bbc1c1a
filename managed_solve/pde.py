"""PDE builders: meshes and grids in, :class:`~managed_solve.system.LinearSystem` out.

Sign conventions (every matrix here is symmetric positive (semi-)definite,
so CG applies):

- ``L`` is the cotangent Laplacian (P1 stiffness on tetrahedra) with
  ``L = -Laplacian``: positive semi-definite, zero row sums, constants in
  its null space (one constant per connected component). ``L u = M f``
  discretises ``-Laplace(u) = f``. The builders whose matrix keeps that null
  space (:func:`laplacian`, :func:`poisson` without enough Dirichlet
  vertices) give it to their :class:`~managed_solve.system.LinearSystem`
  (``nullspace=``), so ``solve`` needs no more from the caller.
- ``M`` is the mass matrix: lumped (diagonal, the default, what the
  cotangent literature uses) or consistent (``lumped=False``).

Placement: ``device=None`` asks the DeviceManager (``manager=`` or the
process default) for a device with ``find_device(nbytes, disperse=True)``;
``"cuda:i"`` assembles there with the CUDA kernels (cupyx CSR, CuPy
vectors), ``"cpu"`` and simulated ``"sim:i"`` devices with the CPU twins
(SciPy CSR, NumPy vectors). The symbolic phase is cached on the mesh, so a
sweep over ``dt`` or ``alpha`` repeats only the numeric pass.

``rtol`` (> 0) is 1e-8 whatever the dtype, as for ``LinearSystem`` and
``solve``: a float32 solve that cannot resolve it ends in ``MAXITER``, saying
so. No fixed float32 tolerance suits every mesh (the attainable residual grows
with the condition number: on icosphere Poisson problems about 1e-5 at 600
vertices, 1e-4 at 10,000, 1e-3 at 40,000), so pass a looser ``rtol`` with
``dtype=np.float32``. Each term asked for (``L``, ``M``, ``M`` in ``b``, with
its coefficient) must lie in the value type's normal range: a float32 mass of
a mesh near 1e-20 would be subnormal numbers or zeros, so it is refused,
naming the mesh's scale or the coefficient.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _backend
from .assembly import (
    Target,
    assemble,
    assemble_grid,
    check_flag,
    grid_shape,
    grid_spacing,
    lumped_mass,
    resolve_target,
)
from .mesh import Mesh, real_scalar, scalar_kind
from .system import LinearSystem
from .system.inputs import all_finite, check_torch_dtype
from .value_range import check_floors

__all__ = ["laplacian", "laplacian_nullspace", "mass", "poisson", "screened_poisson", "heat_step",
           "poisson_grid"]


# ----------------------------------------------------------------- helpers
def estimate_nbytes(mesh: Mesh, dtype: Any = np.float64) -> int:
    """Bytes a mesh system takes on its device: CSR, slot map, mesh copy and two vectors.

    An estimate made before the symbolic phase (each edge is shared by about
    2 triangles or 5 tetrahedra); the manager only needs the order of magnitude.
    """
    n, m, k = mesh.n_vertices, mesh.n_faces, mesh.faces.shape[1]
    w = np.dtype(dtype).itemsize
    share = 2.0 if k == 3 else 5.0
    nnz = n + int(k * (k - 1) * m / share)
    return int(nnz * (w + 4) + 4 * (n + 1) + 4 * m * k * (k + 1) + 8 * (m * k + n) + 24 * n + 2 * n * w)


def _target(device: Any, manager: Any, nbytes: int, backend: str | None, call: str) -> Target:
    if device is None and backend != "cudasim":
        if manager is None:
            from .manager import default_manager

            manager = default_manager()
        device = manager.find_device(int(nbytes), disperse=True)
    return resolve_target(device, backend, call=call)


def _check_mesh(mesh: Any, call: str) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{call}(mesh=...): expected a managed_solve.mesh.Mesh (see mesh.icosphere, "
                        f"mesh.read), got {type(mesh).__name__}")
    return mesh


def _vertex_values(f: Any, mesh: Mesh, t: Target, dtype: np.dtype, call: str, arg: str) -> Any:
    """``f`` at the vertices, on the target: a number, an array (n,), or a callable of (n, 3) points."""
    xp, n = t.xp, mesh.n_vertices
    if callable(f):
        f = f(mesh.vertices)
    if _backend.is_torch_tensor(f):
        check_torch_dtype(f, call=call, arg=arg)
        f = f.detach()
        f = f.cpu().numpy() if t.backend != "cuda" else _backend.cupy().from_dlpack(f)
    if f is None or isinstance(f, (str, bytes)) or np.ndim(f) == 0:
        given = _real_number(f, call, arg, f"a real number, one value per vertex (shape ({n},)) "
                                           "or a callable of the (n, 3) vertices")
        with np.errstate(over="ignore"):  # a value beyond the value type is refused just below
            stored = np.asarray(given).astype(dtype)
        _check_finite(stored, given, call, arg)
        return xp.full(n, stored, dtype=dtype)
    if t.backend != "cuda":
        f = _backend.to_host(f)
    f = xp.asarray(f)
    if f.shape != (n,):
        raise ValueError(f"{call}({arg}=...): expected one value per vertex, shape ({n},), got "
                         f"shape {tuple(f.shape)}")
    if f.dtype.kind not in "iuf":
        raise TypeError(f"{call}({arg}=...): expected real values, got dtype {f.dtype}")
    with np.errstate(over="ignore"):
        out = f.astype(dtype, copy=False)
    _check_finite(out, f, call, arg, where="vertex")
    return out


def _check_finite(values: Any, given: Any, call: str, arg: str, where: str = "entry",
                 shape: tuple[int, ...] | None = None) -> None:
    """Refuse NaN or Inf in ``values`` (``given`` cast to the value type), naming ``arg``.

    Without it the error would come from the :class:`LinearSystem` built
    later, naming its ``b`` rather than the argument the caller gave. The
    message names the first bad ``where`` (its index, or its position in
    ``shape``) and, for a value finite before the cast, the value type's range.
    """
    if all_finite(values):  # sync: one host read, as the LinearSystem's own check makes
        return
    xp = _backend.array_module(values)
    wider = f" beyond {values.dtype.name}'s range (use dtype=np.float64)"
    if np.ndim(given) == 0:
        was = float(given)
        raise ValueError(f"{call}({arg}={given!r}): expected a finite value"
                         + (f"; {was:.3g} is{wider}" if np.isfinite(was) else ""))
    bad = xp.flatnonzero(~xp.isfinite(values.reshape(-1)))
    i = int(bad[0])
    was = float(np.asarray(_backend.to_host(given)).reshape(-1)[i])  # the error path only
    at = f"{where} {i}" if shape is None else f"{where} {tuple(int(j) for j in np.unravel_index(i, shape))}"
    raise ValueError(f"{call}({arg}=...): {at} has {was!r}" + (f",{wider}" if np.isfinite(was) else "")
                     + f"; expected finite values ({int(bad.size)} of the {values.size} are not)")


def _real_number(value: Any, call: str, arg: str, expected: str = "a real number") -> float:
    """``value`` as a float when it is one real number; a TypeError naming ``arg`` otherwise."""
    if _backend.is_torch_tensor(value):
        check_torch_dtype(value, call=call, arg=arg)
    a = real_scalar(value)
    if a is None:
        found = scalar_kind(value)
        raise TypeError(f"{call}({arg}={value!r}): expected {expected}, got {found}; pass e.g. "
                        f"{arg}=1.0")
    return float(a)


def _positive(value: Any, call: str, arg: str, hint: str) -> float:
    """``value`` as a finite float > 0; a TypeError or ValueError naming ``arg`` otherwise."""
    x = _real_number(value, call, arg)
    if not (np.isfinite(x) and x > 0):
        raise ValueError(f"{call}({arg}={value!r}): expected a finite {hint}")
    return x


def _tolerance(rtol: Any, call: str) -> float:
    """``rtol`` as a float > 0, checked before any assembly (the builders set no ``atol``)."""
    a = real_scalar(rtol)
    if a is None:
        raise TypeError(f"{call}(rtol={rtol!r}): expected a real number, got {scalar_kind(rtol)}; "
                        "pass e.g. rtol=1e-08 (the default)")
    if not (np.isfinite(a) and a > 0):
        raise ValueError(f"{call}(rtol={rtol!r}): expected a finite number > 0, e.g. rtol=1e-08")
    return float(a)


def _vertex_index(index: Any, n: int, where: str) -> np.ndarray:
    """Vertex indices (integers in [0, n), or a boolean mask of length n) as int64 on the host.

    A mask of another length would silently select the wrong vertices, and a
    negative index would wrap to the far end, so both are refused.
    """
    if _backend.is_torch_tensor(index) or _backend.is_cupy_array(index):
        index = _backend.to_host(index)
    try:
        idx = np.asarray(index)
    except Exception:  # a ragged sequence
        idx = np.asarray(None)
    if idx.size == 0 and idx.dtype != object:
        return np.empty(0, dtype=np.int64)  # [] reads as float64, yet selects no vertex either way
    if idx.dtype == bool:
        if idx.size != n:
            raise ValueError(f"{where}: a boolean mask must have one entry per vertex, length {n}, "
                             f"got length {idx.size}; or give the vertex indices")
        return np.flatnonzero(idx.reshape(-1)).astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{where}: vertex indices must be integers or a boolean mask, got "
                        f"{f'dtype {idx.dtype}' if idx.dtype != object else type(index).__name__}")
    idx = idx.reshape(-1).astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"{where}: vertex indices must lie in [0, {n}), got "
                         f"[{idx.min()}, {idx.max()}]; there are {n} vertices")
    return idx


def _index_values(idx: np.ndarray, values: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as float64, one per index; duplicate indices keep one entry, and must agree."""
    if _backend.is_torch_tensor(values):
        check_torch_dtype(values, call=where, arg="values")
    try:
        v = np.asarray(_backend.to_host(values))
    except Exception:  # a ragged sequence
        v = np.asarray(None)
    if v.dtype.kind not in "iuf":
        raise TypeError(f"{where}: values must be real numbers (one number, or one per vertex "
                        f"index), got {f'dtype {v.dtype}' if v.dtype != object else type(values).__name__}")
    if v.ndim == 0:
        v = np.full(idx.shape, float(v))
    elif v.size != idx.size:
        raise ValueError(f"{where}: got {v.size} values for {idx.size} vertex indices; give one "
                         "value per index, or a single number for all of them")
    v = v.reshape(-1).astype(np.float64)
    if not np.isfinite(v).all():
        raise ValueError(f"{where}: values must be finite, got {v[~np.isfinite(v)][0]!r}")
    uniq, first, inverse = np.unique(idx, return_index=True, return_inverse=True)
    if uniq.size < idx.size:
        clash = v != v[first][inverse]
        if clash.any():
            j = int(np.flatnonzero(clash)[0])
            raise ValueError(f"{where}: vertex {idx[j]} is given twice with different values "
                             f"({float(v[first][inverse][j])!r} and {float(v[j])!r}); give each vertex once")
        idx, v = uniq, v[first]
    return idx, v


def _mass_times(mesh: Mesh, u: Any, lumped: bool, t: Target, dtype: np.dtype, backend: Any,
                call: str) -> Any:
    if lumped:
        return lumped_mass(mesh, device=t.device, dtype=dtype, backend=backend, call=call) * u
    M = assemble(mesh, stiffness=0.0, mass=1.0, device=t.device, dtype=dtype, backend=backend,
                 call=call)
    return M @ u


def apply_dirichlet(A: Any, b: Any, index: Any, values: Any) -> tuple[Any, Any]:
    """Impose ``u[index] = values`` by symmetric elimination, in place on ``A.data``; returns (A, b).

    ``b`` loses the known columns (``b -= A[:, index] @ values``), then rows
    and columns of ``index`` become identity rows with ``b[index] = values``.
    The matrix stays symmetric, and positive definite when the remaining
    block is, so CG still applies. Works on SciPy and cupyx CSR alike.
    ``index`` holds integers in [0, n) or is a boolean mask of length n;
    ``values`` is one number or one per index (a vertex given twice must
    get the same value twice).
    """
    xp = _backend.array_module(b)
    n = A.shape[0]
    idx, vals = _index_values(_vertex_index(index, n, "apply_dirichlet(index=...)"), values,
                              "apply_dirichlet(values=...)")
    idx = xp.asarray(idx)
    g = xp.asarray(vals, dtype=b.dtype)
    full = xp.zeros(n, dtype=b.dtype)
    full[idx] = g
    b = b - A @ full
    mask = xp.zeros(n, dtype=bool)
    mask[idx] = True
    rows = xp.searchsorted(A.indptr, xp.arange(A.nnz), side="right") - 1
    hit_row = mask[rows]
    A.data[hit_row | mask[A.indices]] = 0
    A.data[hit_row & (rows == A.indices)] = 1
    b[idx] = g
    return A, b


def _dirichlet(dirichlet: Any, n: int, call: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        index, values = dirichlet
    except (TypeError, ValueError):
        raise TypeError(f"{call}(dirichlet=...): expected a pair (vertex_indices, values), got "
                        f"{type(dirichlet).__name__}") from None
    where = f"{call}(dirichlet=(indices, values))"
    index = _vertex_index(index, n, where)
    if index.size == 0:
        raise ValueError(f"{call}(dirichlet=...): no vertices given; pass dirichlet=None to pin the "
                         "constant instead")
    return _index_values(index, values, where)


def laplacian_nullspace(mesh: Mesh, fixed: Any = None) -> Any:
    """The null space of the mesh Laplacian ``L``, as :class:`LinearSystem`'s ``nullspace=`` takes it.

    ``L`` annihilates the functions that are constant on each connected
    component (:meth:`Mesh.connected_components`). With ``fixed`` vertices
    (Dirichlet ones, eliminated by :func:`apply_dirichlet`) a component
    holding one of them is no longer singular.

    Parameters
    ----------
    mesh : Mesh
    fixed : array of int, optional
        Vertex indices (in [0, n), or a boolean mask of length n) whose
        values are prescribed.

    Returns
    -------
    None, "constant" or numpy array (n, k)
        None when no component is free, ``"constant"`` for one free component
        covering the mesh, else the indicator vectors of the free components.

    Examples
    --------
    >>> from managed_solve import mesh, pde
    >>> m = mesh.grid(4, 4)
    >>> pde.laplacian_nullspace(m), pde.laplacian_nullspace(m, fixed=[0])
    ('constant', None)
    """
    _check_mesh(mesh, "laplacian_nullspace")
    labels = mesh.connected_components()
    count = int(labels.max()) + 1
    free = np.ones(count, dtype=bool)
    if fixed is not None:
        free[labels[_vertex_index(fixed, mesh.n_vertices, "laplacian_nullspace(fixed=...)")]] = False
    if not free.any():
        return None
    if count == 1:
        return "constant"
    ids = np.flatnonzero(free)
    return (labels[:, None] == ids[None, :]).astype(np.float64)


def _compatible(b: Any, w: Any, nullspace: Any, xp: Any) -> Any:
    """``b`` minus a multiple of the lumped mass ``w`` on each free component, so it sums to 0 there.

    The discrete form of the compatibility condition of a pure Neumann
    problem (``f`` with zero mean on each closed piece): ``f`` loses its
    area-weighted mean, so ``b = M f`` lies in the range of ``L``.
    """
    if nullspace is None:
        return b
    if isinstance(nullspace, str):
        return b - w * (b.sum() / w.sum())
    N = xp.asarray(nullspace, dtype=b.dtype)
    return b - w * (N @ ((N.T @ b) / (N.T @ w)))


def _system(A: Any, b: Any, dt: np.dtype, name: str, checked: tuple = (), **kwargs: Any) -> LinearSystem:
    """The LinearSystem; ``checked``: arrays of it found finite already, which it does not read again."""
    return LinearSystem(A, b, dtype=dt, name=name, _finite_memo={id(a): a for a in checked}, **kwargs)


# ---------------------------------------------------------------- builders
def laplacian(mesh: Mesh, *, device: Any = None, dtype: Any = np.float64, manager: Any = None,
              index_dtype: Any = None, backend: str | None = None, b: Any = None) -> LinearSystem:
    """The cotangent Laplacian ``L`` (positive semi-definite) as ``LinearSystem(L, b)``.

    ``b`` defaults to zeros: take ``.A`` for the matrix. Singular: the
    system carries its null space (:func:`laplacian_nullspace`: the constants,
    one per connected component), so solving it projects ``b`` onto the
    range of ``L`` and returns the solution orthogonal to the null space;
    a ``b`` that does not sum to zero on each component gets the
    least-squares answer and the status ``LEAST_SQUARES``. For the Poisson
    problem with ``f`` made compatible use :func:`poisson`.

    Examples
    --------
    >>> import numpy as np
    >>> from managed_solve import mesh, pde, solve
    >>> m = mesh.icosphere(2)
    >>> s = pde.laplacian(m, device="cpu", b=m.vertices[:, 2])
    >>> s.n, s.nnz, s.nullspace.shape, round(float(abs(s.A.sum(axis=1)).max()), 12)
    (162, 1122, (162, 1), 0.0)
    >>> r = solve(s, method="cg")
    >>> r.status.name, bool(abs(r.x.sum()) < 1e-10)
    ('CONVERGED', True)
    """
    call = "laplacian"
    _check_mesh(mesh, call)
    dt = np.dtype(dtype)
    check_floors(mesh, dt, call, [("L", 1.0, None)])
    t = _target(device, manager, estimate_nbytes(mesh, dt), backend, call)
    A = assemble(mesh, device=t.device, dtype=dt, index_dtype=index_dtype, backend=t.backend,
                 call=call)
    rhs = t.xp.zeros(mesh.n_vertices, dtype=dt) if b is None else _vertex_values(b, mesh, t, dt, call, "b")
    return _system(A, rhs, dt, "laplacian", checked=(rhs,), nullspace=laplacian_nullspace(mesh))


def mass(mesh: Mesh, lumped: bool = True, *, device: Any = None, dtype: Any = np.float64,
         manager: Any = None, index_dtype: Any = None, backend: str | None = None,
         b: Any = None) -> LinearSystem:
    """The mass matrix (lumped diagonal by default, or consistent) as ``LinearSystem(M, b)``.

    Examples
    --------
    >>> from managed_solve import mesh, pde
    >>> m = mesh.icosphere(2)
    >>> s = pde.mass(m, device="cpu")
    >>> bool(abs(s.A.sum() - m.area()) < 1e-12)
    True
    """
    call = "mass"
    _check_mesh(mesh, call)
    check_flag(lumped, call, "lumped")
    dt = np.dtype(dtype)
    check_floors(mesh, dt, call, [("D" if lumped else "M", 1.0, None)])
    t = _target(device, manager, estimate_nbytes(mesh, dt), backend, call)
    A = assemble(mesh, stiffness=0.0, mass=0.0 if lumped else 1.0, lumped_mass=1.0 if lumped else 0.0,
                 device=t.device, dtype=dt, index_dtype=index_dtype, backend=t.backend, call=call)
    rhs = t.xp.zeros(mesh.n_vertices, dtype=dt) if b is None else _vertex_values(b, mesh, t, dt, call, "b")
    return _system(A, rhs, dt, "mass" if lumped else "mass(consistent)", checked=(rhs,))


def poisson(mesh: Mesh, f: Any, *, dirichlet: Any = None, lumped: bool = True, device: Any = None,
            dtype: Any = np.float64, manager: Any = None, index_dtype: Any = None,
            backend: str | None = None, rtol: float = 1e-8) -> LinearSystem:
    """``-Laplace(u) = f``: the system ``L u = M f``, made solvable.

    SPD when every connected component has a Dirichlet vertex; otherwise
    positive semi-definite, with ``f`` made compatible and the null space
    carried by the system (see ``dirichlet``).

    Parameters
    ----------
    mesh : Mesh
    f : float, array (n,) or callable
        Right-hand side at the vertices; a callable gets the (n, 3) vertices.
    dirichlet : (indices, values), optional
        Vertices (indices or a boolean mask) where ``u = values`` (a number
        or one value per index); eliminated symmetrically, so A stays SPD.
        Without it (closed surfaces, or a pure Neumann problem), and on any
        connected component without a Dirichlet vertex, ``L`` keeps the
        constants in its null space: ``f`` is replaced by ``f - mean(f)``
        there (area-weighted; the compatibility condition of the singular
        problem) and the system carries the null space
        (:func:`laplacian_nullspace`), so ``solve`` returns the solution
        orthogonal to it: vertex values summing to zero on each free
        component.
    lumped : bool
        Lumped (default) or consistent mass on the right-hand side.
    device, manager, dtype, index_dtype, backend, rtol
        See the module docstring and :func:`managed_solve.assembly.assemble`.

    Returns
    -------
    LinearSystem

    Examples
    --------
    >>> import numpy as np, scipy.sparse.linalg as sla
    >>> from managed_solve import mesh, pde
    >>> m = mesh.grid(9, 9)
    >>> s = pde.poisson(m, 0.0, dirichlet=(m.boundary_vertices(), 1.0), device="cpu")
    >>> bool(np.allclose(sla.spsolve(s.A.tocsc(), s.b), 1.0))   # harmonic: constant
    True

    A closed surface (pure Neumann): ``-Laplace(z) = 2 z`` on the unit sphere.

    >>> from managed_solve import solve
    >>> sphere = mesh.icosphere(4)
    >>> z = sphere.vertices[:, 2]
    >>> r = solve(pde.poisson(sphere, 2 * z + 3.0, device="cpu"))  # the constant 3 is dropped
    >>> r.status.name, bool(np.abs(r.x - z).max() < 5e-3)
    ('CONVERGED', True)
    """
    call = "poisson"
    _check_mesh(mesh, call)
    check_flag(lumped, call, "lumped")
    rtol = _tolerance(rtol, call)
    dt = np.dtype(dtype)
    check_floors(mesh, dt, call, [("L", 1.0, None), ("D" if lumped else "M", 1.0, None)])
    t = _target(device, manager, estimate_nbytes(mesh, dt), backend, call)
    with _ctx(t):
        A = assemble(mesh, device=t.device, dtype=dt, index_dtype=index_dtype, backend=t.backend,
                     call=call)
        fv = _vertex_values(f, mesh, t, dt, call, "f")
        b = _mass_times(mesh, fv, lumped, t, dt, t.backend, call)
        index = None
        if dirichlet is not None:
            index, values = _dirichlet(dirichlet, mesh.n_vertices, call)
            A, b = apply_dirichlet(A, b, index, values)
        nullspace = laplacian_nullspace(mesh, fixed=index)
        if nullspace is not None:
            w = lumped_mass(mesh, device=t.device, dtype=dt, backend=t.backend, call=call)
            b = _compatible(b, w, nullspace, t.xp)
        return _system(A, b, dt, "poisson", rtol=rtol, nullspace=nullspace)


def screened_poisson(mesh: Mesh, f: Any, alpha: float, *, lumped: bool = True, device: Any = None,
                     dtype: Any = np.float64, manager: Any = None, index_dtype: Any = None,
                     backend: str | None = None, rtol: float = 1e-8) -> LinearSystem:
    """``-Laplace(u) + alpha u = f``: the SPD system ``(L + alpha M) u = M f`` (alpha > 0).

    On the unit sphere, spherical harmonics of degree l are eigenfunctions
    with ``-Laplace(Y) = l(l+1) Y``, so ``f = Y`` gives ``u = Y / (l(l+1) + alpha)``.

    Examples
    --------
    >>> import numpy as np, scipy.sparse.linalg as sla
    >>> from managed_solve import mesh, pde
    >>> m = mesh.icosphere(3)
    >>> z = m.vertices[:, 2]
    >>> s = pde.screened_poisson(m, z, alpha=1.0, device="cpu")
    >>> u = sla.spsolve(s.A.tocsc(), s.b)
    >>> bool(np.abs(u - z / 3.0).max() < 1e-2)    # l = 1: u = z / (2 + 1)
    True
    """
    call = "screened_poisson"
    _check_mesh(mesh, call)
    check_flag(lumped, call, "lumped")
    alpha = _positive(alpha, call, "alpha", "alpha > 0 (alpha = 0 is singular: use poisson())")
    rtol = _tolerance(rtol, call)
    dt = np.dtype(dtype)
    term = "D" if lumped else "M"
    check_floors(mesh, dt, call, [("L", 1.0, None), (term, 1.0, None),
                                  (term, alpha, "alpha", f"alpha={alpha!r}")])
    t = _target(device, manager, estimate_nbytes(mesh, dt), backend, call)
    with _ctx(t):
        A = assemble(mesh, stiffness=1.0, mass=0.0 if lumped else alpha,
                     lumped_mass=alpha if lumped else 0.0, device=t.device, dtype=dt,
                     index_dtype=index_dtype, backend=t.backend, call=call)
        fv = _vertex_values(f, mesh, t, dt, call, "f")
        b = _mass_times(mesh, fv, lumped, t, dt, t.backend, call)
        return _system(A, b, dt, f"screened_poisson(alpha={alpha:g})", rtol=rtol)


def heat_step(mesh: Mesh, u: Any, dt: float, kappa: float = 1.0, *, lumped: bool = True,
              device: Any = None, dtype: Any = np.float64, manager: Any = None,
              index_dtype: Any = None, backend: str | None = None,
              rtol: float = 1e-8) -> LinearSystem:
    """One backward-Euler step of ``u_t = kappa Laplace(u)``: ``(M + dt kappa L) u_new = M u``.

    SPD for ``dt * kappa > 0``; ``x0`` is set to ``u`` (a good first guess).

    Examples
    --------
    >>> import numpy as np, scipy.sparse.linalg as sla
    >>> from managed_solve import mesh, pde
    >>> m = mesh.icosphere(2)
    >>> u0 = m.vertices[:, 2]
    >>> s = pde.heat_step(m, u0, dt=0.1, device="cpu")
    >>> u1 = sla.spsolve(s.A.tocsc(), s.b)
    >>> w = pde.mass(m, device="cpu").A.diagonal()
    >>> bool(np.isclose(w @ u1, w @ u0)), bool(np.abs(u1).max() < np.abs(u0).max())  # heat conserved, peaks decay
    (True, True)
    """
    call = "heat_step"
    _check_mesh(mesh, call)
    check_flag(lumped, call, "lumped")
    dt = _positive(dt, call, "dt", "time step > 0")
    kappa = _positive(kappa, call, "kappa", "diffusivity > 0")
    if not np.isfinite(dt * kappa):
        raise ValueError(f"{call}(dt={dt!r}, kappa={kappa!r}): dt * kappa overflows float64; "
                         "rescale time (a smaller dt) or the diffusivity")
    rtol = _tolerance(rtol, call)
    vt = np.dtype(dtype)
    check_floors(mesh, vt, call, [("D" if lumped else "M", 1.0, None),
                                  ("L", dt * kappa, "dt * kappa", f"dt={dt!r}, kappa={kappa!r}")])
    t = _target(device, manager, estimate_nbytes(mesh, vt), backend, call)
    with _ctx(t):
        A = assemble(mesh, stiffness=dt * kappa, mass=0.0 if lumped else 1.0,
                     lumped_mass=1.0 if lumped else 0.0, device=t.device, dtype=vt,
                     index_dtype=index_dtype, backend=t.backend, call=call)
        uv = _vertex_values(u, mesh, t, vt, call, "u")
        b = _mass_times(mesh, uv, lumped, t, vt, t.backend, call)
        return _system(A, b, vt, f"heat_step(dt={dt:g})", checked=(uv,), x0=uv, rtol=rtol)


def poisson_grid(shape: tuple[int, ...], f: Any, coefficient: Any = None, *, lengths: Any = 1.0,
                 device: Any = None, dtype: Any = np.float64, manager: Any = None,
                 index_dtype: Any = None, backend: str | None = None,
                 rtol: float = 1e-8) -> LinearSystem:
    """``-div(c grad u) = f`` on a box, ``u = 0`` on its boundary; 5-point (2-D) or 7-point (3-D).

    Parameters
    ----------
    shape : tuple of 2 or 3 ints
        Interior nodes per axis; node ``i`` lies at ``(i+1) h``, ``h = L/(n+1)``.
    f : float, array of ``shape``, or callable ``f(x, y[, z])``
        Right-hand side at the nodes.
    coefficient : None, float, array of ``shape`` or callable
        ``c > 0``; see :func:`managed_solve.assembly.face_coefficients`.
    lengths : float or sequence
        Side lengths of the box (default the unit square/cube).

    Returns
    -------
    LinearSystem
        ``A`` scaled by ``1/h**2`` (SPD), ``b = f`` flattened in C order.

    Examples
    --------
    >>> import numpy as np, scipy.sparse.linalg as sla
    >>> from managed_solve import pde
    >>> s = pde.poisson_grid((31, 31), lambda x, y: 2 * np.pi**2 * np.sin(np.pi * x) * np.sin(np.pi * y),
    ...                      device="cpu")
    >>> x = np.linspace(0, 1, 33)[1:-1]
    >>> exact = np.outer(np.sin(np.pi * x), np.sin(np.pi * x)).ravel()
    >>> bool(np.abs(sla.spsolve(s.A.tocsc(), s.b) - exact).max() < 1e-3)
    True
    """
    call = "poisson_grid"
    rtol = _tolerance(rtol, call)
    shape = grid_shape(shape, call=call)
    h = grid_spacing(shape, lengths, call=call)
    n = int(np.prod(shape))
    if callable(f):
        coords = np.meshgrid(*[(np.arange(s) + 1.0) * hh for s, hh in zip(shape, h, strict=True)],
                             indexing="ij")
        f = f(*coords)
        if np.ndim(f) not in (0, len(shape)):
            raise ValueError(f"{call}(f=...): the callable must return an array of shape {shape}, "
                             f"got shape {np.shape(f)}")
        if np.ndim(f) == len(shape) and np.shape(f) != shape:
            f = np.broadcast_to(f, shape)  # a function constant along an axis
    if _backend.is_torch_tensor(f):
        check_torch_dtype(f, call=call, arg="f")
    if f is None or isinstance(f, (str, bytes)) or np.ndim(f) == 0:
        fv = np.full(n, _real_number(f, call, "f", f"a real number, an array of shape {shape} or a "
                                                   "callable f(x, y[, z])"))
    else:
        fv = np.asarray(_backend.to_host(f))
        if fv.dtype.kind not in "iuf":
            raise TypeError(f"{call}(f=...): expected real values, got dtype {fv.dtype}")
        if fv.shape != shape and fv.shape != (n,):
            raise ValueError(f"{call}(f=...): expected an array of shape {shape} (or ({n},)), got "
                             f"{fv.shape}")
        fv = fv.reshape(-1).astype(float)
    vt = np.dtype(dtype)
    with np.errstate(over="ignore"):  # a value beyond the value type is refused just below
        fv = fv.astype(vt)
    _check_finite(fv, f, call, "f", where="node", shape=shape)
    nbytes = n * (2 * len(shape) + 1) * (vt.itemsize + 4) + 3 * n * vt.itemsize
    t = _target(device, manager, nbytes, backend, call)
    with _ctx(t):
        A = assemble_grid(shape, coefficient=coefficient, lengths=lengths, device=t.device,
                          dtype=vt, index_dtype=index_dtype, backend=t.backend, call=call)
        b = t.xp.asarray(fv)  # a copy of fv on a GPU: finite as fv was
        return _system(A, b, vt, f"poisson_grid({'x'.join(map(str, shape))})", checked=(b,), rtol=rtol)


def _ctx(t: Target):
    import contextlib

    return _backend.cupy().cuda.Device(t.index) if t.backend == "cuda" else contextlib.nullcontext()
