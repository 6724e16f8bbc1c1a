"""The assembly dispatcher: caching of the symbolic phase, targets, CUDA launch on CuPy's stream."""

from __future__ import annotations

import re

import numpy as np
import pytest

from managed_solve import assembly
from managed_solve.mesh import Mesh, icosphere


def test_symbolic_phase_is_cached_and_shared_by_numeric_sweeps():
    m = icosphere(2)
    p = assembly.symbolic(m)
    assert assembly.symbolic(m) is p
    mats = [assembly.assemble(m, stiffness=dt, lumped_mass=1.0) for dt in (0.1, 0.2, 0.4)]
    assert sum(1 for k in m.cache if k[0] == "pattern") == 1
    for A in mats:  # the CSR arrays reuse the pattern: no copies, no COO
        assert A.indices is p.indices and A.indptr is p.indptr
    # linear in the coefficient, and the data arrays are fresh per call
    np.testing.assert_allclose((mats[2] - mats[1]).data, (mats[1] - mats[0]).data * 2, rtol=1e-12)
    assert mats[0].data is not mats[1].data


def test_targets_and_errors():
    assert assembly.resolve_target(None) == assembly.Target("cpu", "cpu", 0)
    assert assembly.resolve_target("sim:3").backend == "cpu"
    assert assembly.resolve_target("cuda:1") == assembly.Target("cuda", "cuda:1", 1)
    with pytest.raises(ValueError, match="backend='cuda' needs a CUDA device"):
        assembly.resolve_target("cpu", "cuda")
    with pytest.raises(ValueError, match="expected one of cpu, cuda, cudasim"):
        assembly.resolve_target("cpu", "opencl")
    m = icosphere(0)
    with pytest.raises(TypeError, match="expected np.float32 or np.float64"):
        assembly.assemble(m, dtype=np.int32)
    with pytest.raises(TypeError, match="expected np.int32, np.int64"):
        assembly.symbolic(m, index_dtype=np.int16)
    with pytest.raises(TypeError, match="expected a managed_solve.mesh.Mesh"):
        assembly.assemble(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="stiffness=nan"):
        assembly.assemble(m, stiffness=float("nan"))


@pytest.mark.cudasim
def test_cudasim_numeric_float32_int64():
    m = icosphere(1)
    A = assembly.assemble(m, stiffness=1.0, mass=0.5, dtype=np.float32, index_dtype=np.int64)
    B = assembly.assemble(m, stiffness=1.0, mass=0.5, dtype=np.float32, index_dtype=np.int64,
                          backend="cudasim")
    assert B.dtype == np.float32 and B.indices.dtype == np.int64
    assert np.abs(A.data - B.data).max() <= 1e-6 * np.abs(A.data).max()


@pytest.mark.gpu
def test_cuda_assembly_on_a_non_default_stream_matches_cpu():
    import cupy as cp
    import cupyx.scipy.sparse as csp

    m = icosphere(3)
    ref = assembly.assemble(m, stiffness=1.0, lumped_mass=2.0)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        A = assembly.assemble(m, stiffness=1.0, lumped_mass=2.0, device="cuda:0")
        # consumed on the same stream, without a synchronisation in between
        y = A @ cp.ones(m.n_vertices)
    stream.synchronize()
    assert isinstance(A, csp.csr_matrix)
    assert abs(A.get() - ref).max() <= 1e-12 * abs(ref).max()
    np.testing.assert_allclose(y.get(), ref @ np.ones(m.n_vertices), rtol=1e-12, atol=1e-12)
    A64 = assembly.assemble(m, stiffness=1.0, lumped_mass=2.0, device="cuda:0", index_dtype=np.int64)
    assert A64.indices.dtype == np.int64 and A64.indptr.dtype == np.int64
    assert abs(A64.get() - ref).max() <= 1e-12 * abs(ref).max()
    np.testing.assert_allclose((A64 @ cp.ones(m.n_vertices)).get(), ref @ np.ones(m.n_vertices),
                               rtol=1e-12, atol=1e-12)
    w = assembly.lumped_mass(m, device="cuda:0")
    assert isinstance(w, cp.ndarray)
    np.testing.assert_allclose(w.get(), assembly.lumped_mass(m), rtol=1e-14)
    G = assembly.assemble_grid((20, 30), coefficient=lambda x, y: 1 + x * y, device="cuda:0",
                               dtype=np.float32)
    R = assembly.assemble_grid((20, 30), coefficient=lambda x, y: 1 + x * y, dtype=np.float32)
    assert isinstance(G, csp.csr_matrix) and G.dtype == np.float32
    assert abs(G.get() - R).max() <= 1e-6 * abs(R).max()


def test_grid_shape_and_lengths_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"assemble_grid\(shape=4\): expected a tuple of 2 or 3 positive"):
        assembly.assemble_grid(4)
    with pytest.raises(ValueError, match=r"assemble_grid\(shape=\(4, 0\)\): expected 2 or 3 positive"):
        assembly.assemble_grid((4, 0))
    with pytest.raises(ValueError, match=r"assemble_grid\(lengths=0\): side lengths must be finite and > 0"):
        assembly.assemble_grid((3, 3), lengths=0)
    with pytest.raises(ValueError, match=r"grid_spacing\(lengths=\[1.0, 1.0\]\): a 3-D grid needs one number or 3"):
        assembly.grid_spacing((3, 3, 3), [1.0, 1.0])
    with pytest.raises(TypeError, match=r"assemble_grid\(coefficient=...\): expected None, a real number.*complex"):
        assembly.assemble_grid((3, 3), coefficient=1 + 1j)
    assert assembly.grid_spacing((3, 1), (2.0, 4.0)) == (0.5, 2.0)


def hexagon_fan(radius: float):
    """Six triangles around vertex 0: each vertex's lumped mass sums up to six areas."""
    t = np.arange(6) * np.pi / 3
    V = np.vstack([[0.0, 0.0, 0.0], np.column_stack([np.cos(t), np.sin(t), np.zeros(6)])]) * radius
    return Mesh(V, [[0, 1 + j, 1 + (j + 1) % 6] for j in range(6)])


BACKENDS = [
    "cpu",
    pytest.param("cudasim", marks=pytest.mark.cudasim),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_beyond_the_value_type_are_refused_naming_the_scale_and_the_fix(backend):
    device = "cuda:0" if backend == "cuda" else "cpu"
    # Areas near 1e40 are finite float64 but past float32's 3.4e38; the Laplacian
    # (scale-free) still assembles in float32.
    m = icosphere(1)
    big = Mesh(m.vertices * 1e20, m.faces)
    L = assembly.assemble(big, dtype=np.float32, device=device, backend=backend)
    assert L.dtype == np.float32 and bool(np.isfinite(L.data).all())
    match = (r"assemble\(mesh=...\): the matrix 0\*L \+ 0\*M \+ 1\*D has entries beyond float32's "
             r"range at this mesh's scale \(largest \|coordinate\| 1e\+20.*Rescale the mesh, e.g. "
             r"Mesh\(mesh.vertices / 1e\+20, mesh.faces\).*or use dtype=np.float64")
    with pytest.raises(ValueError, match=match):
        assembly.assemble(big, stiffness=0.0, lumped_mass=1.0, dtype=np.float32, device=device,
                          backend=backend)
    with pytest.raises(ValueError, match=r"lumped_mass\(mesh=...\): the lumped mass has entries beyond "
                                         r"float32's range"):
        assembly.lumped_mass(big, dtype=np.float32, device=device, backend=backend)
    # Each triangle's area (about 1e308) is a float64, the six around vertex 0 are not.
    fan = hexagon_fan(1.52e154)
    assert np.isfinite(fan.element_measures()).all()
    with pytest.raises(ValueError, match=r"beyond float64's range.*Rescale the mesh"):
        assembly.assemble(fan, stiffness=0.0, lumped_mass=1.0, device=device, backend=backend)
    with pytest.raises(ValueError, match=r"the lumped mass has entries beyond float64's range"):
        assembly.lumped_mass(fan, device=device, backend=backend)
    L = assembly.assemble(fan, device=device, backend=backend)  # cotangents: as on the unit fan
    L = L.get() if backend == "cuda" else L
    ref = assembly.assemble(hexagon_fan(1.0))
    assert abs(L - ref).max() <= 1e-14 * abs(ref).max()
    # Within range nothing is refused: the same fan at half the radius.
    w = assembly.lumped_mass(hexagon_fan(0.76e154), device=device, backend=backend)
    w = w.get() if backend == "cuda" else w
    np.testing.assert_allclose(w, assembly.lumped_mass(hexagon_fan(1.0)) * 0.76e154**2, rtol=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entries_below_the_value_types_normal_range_are_refused_naming_the_scale_and_the_fix(backend):
    """Triangles near 1e-20 have areas near 1e-40, below float32's smallest normal number
    (1.2e-38): their mass came out as subnormal numbers or zeros, silently, and the system
    solved with it was singular or wrong. Refused as pde's builders refuse it."""
    device = "cuda:0" if backend == "cuda" else "cpu"
    on = {"device": device, "backend": backend}
    unit = icosphere(2)
    tiny = Mesh(unit.vertices * 1e-20, unit.faces)

    def host(A):
        return A.get() if backend == "cuda" else A

    scale = (r"\(mesh=\.\.\., dtype=float32\): {what} has entries down to about \S+, below "
             r"float32's smallest normal number 1\.18e-38, where they would lose their digits or "
             r"vanish; the smallest element area is \S+: scale the mesh up, e\.g\. "
             r"Mesh\(mesh\.vertices / 1e-20, mesh\.faces\), or use dtype=np\.float64$")
    for kwargs, what in (({"stiffness": 0.0, "lumped_mass": 1.0}, "the lumped mass D"),
                         ({"stiffness": 1.0, "mass": 1.0}, "the mass matrix M")):
        with pytest.raises(ValueError, match="^assemble" + scale.format(what=what)):
            assembly.assemble(tiny, dtype=np.float32, **kwargs, **on)
    with pytest.raises(ValueError, match="^assemble" + scale.format(what="the lumped mass D")):
        assembly.assemble_mass(tiny, dtype=np.float32, **on)
    with pytest.raises(ValueError, match="^lumped_mass" + scale.format(what="the lumped mass D")):
        assembly.lumped_mass(tiny, dtype=np.float32, **on)
    # A coefficient can push a term below the range on a mesh of any scale: it is named.
    with pytest.raises(ValueError, match=r"^assemble\(stiffness=1e-40, dtype=float32\): stiffness "
                                         r"\* L has entries down to about .*; use a larger "
                                         r"stiffness, or dtype=np\.float64$"):
        assembly.assemble(unit, stiffness=1e-40, dtype=np.float32, **on)
    with pytest.raises(ValueError, match=r"^assemble\(mass=1e-320, dtype=float64\): mass \* M "
                                         r".*below float64's smallest normal.*; use a larger mass$"):
        assembly.assemble(unit, mass=1e-320, **on)
    # What float32 holds is assembled, and matches the float64 assembly to float32's precision:
    # the cotangent Laplacian is scale-free, areas near 1e-30 are normal float32s, and a
    # coefficient that lifts a term into the range is read with it.
    for mesh, kwargs in ((tiny, {}), (tiny, {"stiffness": 0.0, "lumped_mass": 1e20}),
                         (Mesh(unit.vertices * 1e-15, unit.faces),
                          {"stiffness": 1.0, "mass": 1e30, "lumped_mass": 1e30})):
        A32 = host(assembly.assemble(mesh, dtype=np.float32, **kwargs, **on))
        A64 = assembly.assemble(mesh, **kwargs)
        assert A32.dtype == np.float32
        assert abs(A32 - A64).max() <= 1e-6 * abs(A64).max(), kwargs
        assert (A32.data != 0).sum() == (A64.data != 0).sum(), kwargs  # nothing vanished
    small = Mesh(unit.vertices * 1e-15, unit.faces)
    w = assembly.lumped_mass(small, dtype=np.float32, **on)
    w = w.get() if backend == "cuda" else w
    np.testing.assert_allclose(w, assembly.lumped_mass(small), rtol=1e-6)


def test_coefficients_and_flags_that_are_not_numbers_name_the_argument():
    m = icosphere(1)
    for kwargs, found in (({"stiffness": "1"}, "str"), ({"mass": None}, "NoneType"),
                          ({"lumped_mass": True}, "dtype bool"), ({"stiffness": [1.0, 2.0]}, "list")):
        (name, value), = kwargs.items()
        said = re.escape(f"assemble({name}={value!r}): expected a real number (the coefficient of ")
        with pytest.raises(TypeError, match=said + rf"[LMD]\), got {found}; pass e\.g\. {name}=1\.0"):
            assembly.assemble(m, **kwargs)
    with pytest.raises(ValueError, match=r"assemble\(mass=nan\): expected a finite number"):
        assembly.assemble(m, mass=float("nan"))
    # NumPy scalars are numbers: the same matrix as the Python float.
    ref = assembly.assemble(m, stiffness=2.0, lumped_mass=0.5)
    got = assembly.assemble(m, stiffness=np.float32(2), lumped_mass=np.asarray(0.5))
    assert abs(got - ref).max() == 0
    with pytest.raises(TypeError, match=r"assemble_mass\(lumped='no'\): expected True or False, got str"):
        assembly.assemble_mass(m, lumped="no")
    np.testing.assert_array_equal(assembly.assemble_mass(m, lumped=np.False_).toarray(),
                                  assembly.assemble(m, stiffness=0.0, mass=1.0).toarray())


@pytest.mark.parametrize("lengths,dtype,words", [
    (1e25, np.float32, "down to about 8.1e-49, below float32's smallest normal"),
    (1e160, np.float64, "below float64's smallest normal"),
    (1e-20, np.float32, "beyond float32's largest"),
    (1e-170, np.float64, "beyond float64's largest"),
])
def test_a_grid_whose_entries_leave_the_value_type_is_refused_naming_lengths(lengths, dtype, words):
    """A grid's entries are c / h**2: a box far from unit size puts them below the value type's
    normal range (every entry 0.0 or subnormal, the solve then MAXITER on a 'singular' A) or
    beyond it. assemble_grid and poisson_grid refuse it, naming lengths and the fix."""
    from managed_solve import pde
    from managed_solve.assembly import assemble_grid

    given = re.escape(repr(lengths))
    with pytest.raises(ValueError, match=rf"^assemble_grid\(lengths={given}, "
                                         rf"dtype={np.dtype(dtype).name}\): .*{words}.*scale the box"):
        assemble_grid((8, 8), lengths=lengths, dtype=dtype)
    with pytest.raises(ValueError, match=rf"^poisson_grid\(lengths={given}.*{words}"):
        pde.poisson_grid((8, 8), np.ones(64, dtype=dtype), lengths=lengths, dtype=dtype)


def test_a_grid_within_the_value_type_is_assembled_as_in_float64():
    from managed_solve.assembly import assemble_grid

    c = np.exp(np.random.default_rng(1).uniform(-1.0, 1.0, (8, 8)))
    for lengths in (1e15, 1e-15, (2.0, 3e-3)):
        ref = assemble_grid((8, 8), coefficient=c, lengths=lengths, dtype=np.float64)
        got = assemble_grid((8, 8), coefficient=c, lengths=lengths, dtype=np.float32)
        assert (got != 0).nnz == ref.nnz
        np.testing.assert_allclose(got.toarray(), ref.toarray(), rtol=1e-6)
