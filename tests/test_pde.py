"""PDE builders: convergence against known solutions, SPD systems, placement, errors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve import Status, assembly, pde
from managed_solve.manager import DeviceManager
from managed_solve.mesh import Mesh, grid, icosphere, torus
from managed_solve.system import LinearSystem

DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)]


def host(x):
    return x.get() if hasattr(x, "get") else x


def solve(system: LinearSystem) -> np.ndarray:
    return sla.spsolve(host(system.A).tocsc(), host(system.b))


def rates(errors, hs):
    e, h = np.asarray(errors), np.asarray(hs)
    return np.log(e[:-1] / e[1:]) / np.log(h[:-1] / h[1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lumped", [True, False])
def test_screened_poisson_on_sphere_converges_at_second_order(device, lumped):
    # Y = xy is a spherical harmonic of degree 2: -Laplace(Y) = 6 Y on the unit sphere.
    alpha, errors, hs = 1.0, [], []
    for k in range(2, 7):
        m = icosphere(k)
        Y = m.vertices[:, 0] * m.vertices[:, 1]
        s = pde.screened_poisson(m, lambda v: v[:, 0] * v[:, 1], alpha, lumped=lumped, device=device)
        assert s.device == ("cpu" if device == "cpu" else "cuda:0")
        u = solve(s)
        w = assembly.lumped_mass(m)
        errors.append(np.sqrt(w @ (u - Y / (6 + alpha)) ** 2))
        hs.append(m.mean_edge_length())
    r = rates(errors, hs)
    assert (r > 1.8).all(), (errors, r)


def grid_problem(c_kind):
    def u(x, y):
        return np.sin(np.pi * x) * np.sin(2 * np.pi * y)

    if c_kind == "constant":
        return u, None, lambda x, y: 5 * np.pi**2 * u(x, y)

    def c(x, y):
        return 1.0 + x + 2.0 * y

    def f(x, y):  # -div(c grad u) = c * 5 pi^2 u - (c_x u_x + c_y u_y)
        ux = np.pi * np.cos(np.pi * x) * np.sin(2 * np.pi * y)
        uy = 2 * np.pi * np.sin(np.pi * x) * np.cos(2 * np.pi * y)
        return c(x, y) * 5 * np.pi**2 * u(x, y) - (ux + 2.0 * uy)

    return u, c, f


@pytest.mark.parametrize("c_kind", ["constant", "variable"])
@pytest.mark.parametrize("device", DEVICES)
def test_poisson_grid_converges_at_second_order(c_kind, device):
    u, c, f = grid_problem(c_kind)
    errors, hs = [], []
    for n in (15, 31, 63, 127):
        s = pde.poisson_grid((n, n), f, coefficient=c, device=device)
        x = np.arange(1, n + 1) / (n + 1)
        X, Y = np.meshgrid(x, x, indexing="ij")
        errors.append(np.abs(solve(s) - u(X, Y).ravel()).max())
        hs.append(1.0 / (n + 1))
    r = rates(errors, hs)
    assert (r > 1.8).all(), (errors, r)


def test_poisson_grid_3d_with_array_rhs():
    n = 9
    s = pde.poisson_grid((n, n, n), np.ones((n, n, n)), device="cpu")
    v = solve(s).reshape(n, n, n)
    assert s.n == n**3 and s.nnz == n**3 + 6 * (n - 1) * n * n
    assert np.allclose(v, v[::-1]) and np.allclose(v, v.transpose(1, 0, 2))  # symmetric box
    assert 0 < v.max() < 0.0563  # below the 3-D torsion-function bound 1/(2*d) * (1/2)^2 * ...


def two_pieces(a, b, shift=3.0):
    """One mesh holding meshes ``a`` and ``b`` side by side, apart (two connected components)."""
    return Mesh(np.vstack([a.vertices, b.vertices + shift]), np.vstack([a.faces, b.faces + a.n_vertices]))


def pinv_solution(A, b):
    """The least-squares solution of least norm (orthogonal to A's null space), dense."""
    return np.linalg.pinv(host(A).toarray(), hermitian=True) @ host(b)


@pytest.mark.parametrize("device", DEVICES)
def test_poisson_on_closed_surface_carries_the_null_space(device):
    m = icosphere(4)
    z = m.vertices[:, 2]
    s = pde.poisson(m, lambda v: v[:, 2] + 3.0, device=device)  # the constant 3 is incompatible
    assert s.nullspace.shape == (m.n_vertices, 1)
    A = host(s.A)
    assert abs(A - A.T).max() <= 1e-14 * abs(A).max()
    assert abs(host(s.b).sum()) <= 1e-12 * abs(host(s.b)).sum()  # b made compatible
    r = ms.solve(s)
    assert r.status is Status.CONVERGED, r.message
    u = host(r.x)
    assert abs(u.sum()) <= 1e-10 * abs(u).sum()  # orthogonal to the constants
    assert np.abs(u - z / 2).max() < 2e-3  # -Laplace(z) = 2 z on the unit sphere


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["auto", "cg", "minres", "direct"])
def test_pure_neumann_poisson_matches_the_pseudo_inverse(device, method):
    m = grid(14, 12)  # open square: natural (Neumann) boundary everywhere
    s = pde.poisson(m, lambda v: np.cos(np.pi * v[:, 0]) + v[:, 1], device=device)
    assert s.nullspace.shape == (m.n_vertices, 1)
    r = ms.solve(s, method=method, rtol=1e-10)
    assert r.status is Status.CONVERGED, r.message
    np.testing.assert_allclose(host(r.x), pinv_solution(s.A, s.b), atol=1e-8)


@pytest.mark.parametrize("device", DEVICES)
def test_laplacian_solves_consistent_and_inconsistent_b(device):
    m = torus(nu=16, nv=8)
    rng = np.random.default_rng(3)
    g = rng.standard_normal(m.n_vertices)
    for b, status in ((g - g.mean(), Status.CONVERGED), (g + 1.0, Status.LEAST_SQUARES)):
        s = pde.laplacian(m, b=b, device=device)
        r = ms.solve(s, rtol=1e-10)
        assert r.status is status, r.message
        np.testing.assert_allclose(host(r.x), pinv_solution(s.A, b), atol=1e-8)
        x_lsqr = sla.lsqr(host(s.A), b, atol=1e-14, btol=1e-14, iter_lim=20_000)[0]
        np.testing.assert_allclose(host(r.x), x_lsqr, atol=1e-6)


def test_every_connected_component_is_in_the_null_space():
    m = two_pieces(icosphere(2), grid(6, 5))
    n1 = icosphere(2).n_vertices
    s = pde.laplacian(m, device="cpu")
    N = s.nullspace
    assert N.shape == (m.n_vertices, 2)
    np.testing.assert_allclose(s.A @ N, 0, atol=1e-12)
    # A b summing to zero over the whole mesh but not on each piece is inconsistent.
    b = np.r_[np.ones(n1), -np.ones(m.n_vertices - n1) * n1 / (m.n_vertices - n1)]
    assert ms.solve(pde.laplacian(m, b=b, device="cpu")).status is Status.LEAST_SQUARES
    # Poisson makes f compatible piece by piece: each piece's solution sums to zero.
    f = lambda v: v[:, 0] + 2.0  # noqa: E731
    p = pde.poisson(m, f, device="cpu")
    r = ms.solve(p, method="cg", rtol=1e-10)
    assert r.status is Status.CONVERGED, r.message
    x = r.x
    assert abs(x[:n1].sum()) < 1e-9 and abs(x[n1:].sum()) < 1e-9
    np.testing.assert_allclose(x, pinv_solution(p.A, p.b), atol=1e-8)


def test_dirichlet_on_one_component_leaves_the_other_singular():
    a, b = grid(7, 7), icosphere(2)
    m = two_pieces(a, b)
    bnd = a.boundary_vertices()
    s = pde.poisson(m, 1.0, dirichlet=(bnd, 0.0), device="cpu")
    ind = s.nullspace[:, 0] != 0
    assert s.nullspace.shape == (m.n_vertices, 1) and ind.tolist() == [False] * a.n_vertices + [True] * b.n_vertices
    r = ms.solve(s, rtol=1e-10)
    assert r.status is Status.CONVERGED, r.message
    alone = pde.poisson(a, 1.0, dirichlet=(bnd, 0.0), device="cpu")
    assert alone.nullspace is None  # every component has a Dirichlet vertex: SPD
    np.testing.assert_allclose(r.x[: a.n_vertices], ms.solve(alone).x, atol=1e-9)
    np.testing.assert_allclose(r.x[a.n_vertices:], 0.0, atol=1e-9)  # f = 1 made compatible: 0


def test_singular_builders_through_solve_many_and_a_sharded_refusal():
    m = icosphere(3)
    z = m.vertices[:, 2]
    systems = [pde.poisson(m, k * z, device="cpu") for k in (1.0, 2.0, 4.0)]
    results = ms.solve_many(systems, manager=DeviceManager(simulate="2x1GiB"))
    for k, r in zip((1.0, 2.0, 4.0), results, strict=True):
        assert r.status is Status.CONVERGED, r.message
        u = host(r.x)
        assert abs(u.sum()) < 1e-8 and np.abs(u - k * z / 2).max() < 1e-2
    with pytest.raises(ValueError, match="null space.*cannot be sharded"):
        ms.solve(systems[0], devices="all", manager=DeviceManager(simulate="2x1GiB"))


def test_poisson_dirichlet_reproduces_linear_functions_on_grids():
    for m in (grid(6, 7), grid(4, 4, 5)):
        exact = m.vertices @ np.array([1.0, 2.0, -0.5])
        bnd = m.boundary_vertices()
        s = pde.poisson(m, 0.0, dirichlet=(bnd, exact[bnd]), device="cpu")
        np.testing.assert_allclose(solve(s), exact, atol=1e-12)
        mask = np.zeros(m.n_vertices, bool)
        mask[bnd] = True
        s2 = pde.poisson(m, 0.0, dirichlet=(mask, exact[bnd]), lumped=False, device="cpu")
        np.testing.assert_allclose(solve(s2), exact, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_heat_step_conserves_heat_and_matches_direct_formula(device):
    m = torus(nu=24, nv=12)
    rng = np.random.default_rng(0)
    u0 = rng.standard_normal(m.n_vertices)
    s = pde.heat_step(m, u0, dt=0.05, kappa=2.0, device=device)
    assert s.x0 is not None
    u1 = solve(s)
    w = assembly.lumped_mass(m)
    assert w @ u1 == pytest.approx(w @ u0, rel=1e-10, abs=1e-10)
    L = assembly.assemble(m)
    np.testing.assert_allclose(w * u1 + 0.1 * (L @ u1), w * u0, atol=1e-10)
    assert np.std(u1) < np.std(u0)


def test_float32_and_index_width_pass_through():
    m = icosphere(2)
    s = pde.screened_poisson(m, 1.0, 2.0, dtype=np.float32, index_dtype=np.int64, device="cpu")
    assert s.dtype == np.float32 and s.A.dtype == np.float32 and s.b.dtype == np.float32
    assert s.A.indices.dtype == np.int64
    np.testing.assert_allclose(solve(s), 0.5, rtol=1e-4)  # constant f: u = f / alpha


def test_device_none_asks_the_manager():
    mgr = DeviceManager(simulate="2x1GiB")
    m = icosphere(2)
    s = pde.laplacian(m, manager=mgr)
    assert s.device == "cpu" and type(s.A).__module__.startswith("scipy")
    ms = pde.mass(m, lumped=False, manager=mgr)
    assert ms.A.sum() == pytest.approx(m.area(), rel=1e-12)


@pytest.mark.cudasim
def test_builders_run_the_cuda_launch_code():
    m = icosphere(1)
    a = pde.heat_step(m, m.vertices[:, 0], 0.1, device="cpu")
    b = pde.heat_step(m, m.vertices[:, 0], 0.1, backend="cudasim")
    assert abs(a.A - b.A).max() <= 1e-14 and np.allclose(a.b, b.b, rtol=1e-14)


def test_errors_name_the_argument():
    m = icosphere(1)
    with pytest.raises(ValueError, match=r"alpha=0"):
        pde.screened_poisson(m, 1.0, 0.0, device="cpu")
    with pytest.raises(ValueError, match=r"dt=-1"):
        pde.heat_step(m, 0.0, -1, device="cpu")
    with pytest.raises(ValueError, match=r"shape \(42,\)"):
        pde.poisson(m, np.ones(5), device="cpu")
    with pytest.raises(ValueError, match=r"\[0, 42\)"):
        pde.poisson(m, 1.0, dirichlet=([0, 99], 0.0), device="cpu")
    with pytest.raises(TypeError, match="pair"):
        pde.poisson(m, 1.0, dirichlet=5, device="cpu")
    with pytest.raises(TypeError, match="Mesh"):
        pde.laplacian("sphere.obj", device="cpu")


def test_dirichlet_is_checked_before_it_changes_the_problem():
    m = grid(5, 5)  # 25 vertices, 16 on the boundary
    bnd = m.boundary_vertices()
    with pytest.raises(ValueError, match=r"boolean mask must have one entry per vertex, length 25, got length 3"):
        pde.poisson(m, 1.0, dirichlet=(np.array([True, True, True]), 5.0), device="cpu")
    with pytest.raises(ValueError, match=r"vertex 0 is given twice with different values \(1.0 and 2.0\)"):
        pde.poisson(m, 1.0, dirichlet=([0, 0], [1.0, 2.0]), device="cpu")
    with pytest.raises(ValueError, match=r"dirichlet=\(indices, values\)\): got 2 values for 16 vertex indices"):
        pde.poisson(m, 1.0, dirichlet=(bnd, [1.0, 2.0]), device="cpu")
    with pytest.raises(TypeError, match=r"dirichlet=\(indices, values\)\): values must be real.*complex"):
        pde.poisson(m, 1.0, dirichlet=(bnd, 1j), device="cpu")
    with pytest.raises(ValueError, match=r"values must be finite"):
        pde.poisson(m, 1.0, dirichlet=(bnd, np.nan), device="cpu")
    # A vertex given twice with one value poses the problem it poses given once.
    once = solve(pde.poisson(m, 1.0, dirichlet=(bnd, 2.0), device="cpu"))
    twice = solve(pde.poisson(m, 1.0, dirichlet=(np.r_[bnd, bnd[:3]], 2.0), device="cpu"))
    np.testing.assert_allclose(twice, once, rtol=1e-14)
    np.testing.assert_allclose(once[bnd], 2.0)


def test_vertex_indices_outside_the_mesh_are_refused_not_wrapped():
    m = grid(5, 5)
    L = pde.laplacian(m, device="cpu").A
    with pytest.raises(ValueError, match=r"apply_dirichlet\(index=...\): vertex indices must lie in \[0, 25\), got \[28, 28\]"):
        pde.apply_dirichlet(L.copy(), np.ones(25), [28], 1.0)
    with pytest.raises(ValueError, match=r"apply_dirichlet\(values=...\): got 2 values for 1 vertex"):
        pde.apply_dirichlet(L.copy(), np.ones(25), [3], [1.0, 2.0])
    for fixed in ([25], [-1]):
        with pytest.raises(ValueError, match=r"laplacian_nullspace\(fixed=...\): vertex indices must lie in \[0, 25\)"):
            pde.laplacian_nullspace(m, fixed=fixed)
    assert pde.laplacian_nullspace(m, fixed=[24]) is None
    assert pde.laplacian_nullspace(m, fixed=np.zeros(25, bool)) == "constant"


def test_poisson_grid_refuses_complex_f_and_bad_shape_or_lengths():
    with pytest.raises(TypeError, match=r"poisson_grid\(f=...\): expected real values, got dtype complex128"):
        pde.poisson_grid((4, 4), np.full((4, 4), 1 + 5j), device="cpu")
    with pytest.raises(TypeError, match=r"poisson_grid\(f=...\): expected real values"):
        pde.poisson_grid((4, 4), lambda x, y: x + 1j * y, device="cpu")
    for lengths in (0.0, -1.0, np.nan, (1.0, np.inf)):
        with pytest.raises(ValueError, match=r"poisson_grid\(lengths=.*\): side lengths must be finite and > 0"):
            pde.poisson_grid((4, 4), 1.0, lengths=lengths, device="cpu")
    with pytest.raises(ValueError, match=r"a 2-D grid needs one number or 2 side lengths, got shape \(3,\)"):
        pde.poisson_grid((4, 4), 1.0, lengths=(1.0, 2.0, 3.0), device="cpu")
    with pytest.raises(TypeError, match=r"poisson_grid\(lengths='1'\): expected a number or 2 real side lengths"):
        pde.poisson_grid((4, 4), 1.0, lengths="1", device="cpu")
    with pytest.raises(TypeError, match=r"poisson_grid\(shape=5\): expected a tuple.*shape=\(5, 5\)"):
        pde.poisson_grid(5, 1.0, device="cpu")
    with pytest.raises(TypeError, match=r"poisson_grid\(f=None\): expected a real number"):
        pde.poisson_grid((4, 4), None, device="cpu")
    # Per-axis lengths still set h = L / (n + 1) per axis: the centre row is 2/hx^2 + 2/hy^2.
    s = pde.poisson_grid((3, 3), lambda x, y: x, lengths=(2.0, 4.0), device="cpu")
    assert s.A[4, 4] == pytest.approx(2 / 0.5**2 + 2 / 1.0**2, rel=1e-15)
    np.testing.assert_allclose(s.b.reshape(3, 3)[:, 0], [0.5, 1.0, 1.5], rtol=1e-15)


def test_scalar_arguments_of_the_wrong_type_name_the_argument():
    m = icosphere(1)
    with pytest.raises(TypeError, match=r"heat_step\(dt=None\): expected a real number, got NoneType"):
        pde.heat_step(m, np.ones(m.n_vertices), None, device="cpu")
    with pytest.raises(TypeError, match=r"heat_step\(kappa='2'\): expected a real number, got str"):
        pde.heat_step(m, np.ones(m.n_vertices), 0.1, kappa="2", device="cpu")
    with pytest.raises(TypeError, match=r"screened_poisson\(alpha='1'\): expected a real number"):
        pde.screened_poisson(m, 1.0, "1", device="cpu")
    with pytest.raises(TypeError, match=r"poisson\(f=None\): expected a real number, one value per vertex"):
        pde.poisson(m, None, device="cpu")
    with pytest.raises(TypeError, match=r"poisson\(f=1j\): expected a real number.*got dtype complex128"):
        pde.poisson(m, 1j, device="cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1e80, 1e-80])
def test_builders_at_extreme_coordinate_scales_solve_the_scaled_problem(device, scale):
    # Coordinates near 1e80 are a valid mesh (areas near 1e160 are float64s); its
    # systems were refused with "A has NaN or Inf entries". -Laplace(u) = 2z on a
    # sphere of radius R has u = R^2 z; a heat step with dt scaled by R^2 is the unit one.
    m = icosphere(2)
    big = Mesh(m.vertices * scale, m.faces)
    z = m.vertices[:, 2]
    unit = host(ms.solve(pde.poisson(m, 2 * z, device="cpu"), device="cpu").x)  # orthogonal to the constants
    s = pde.poisson(big, 2 * z, device=device)
    np.testing.assert_allclose(host(s.A).toarray(), pde.poisson(m, 2 * z, device="cpu").A.toarray(),
                               rtol=1e-12, atol=1e-12)
    r = ms.solve(s)
    assert r.status == Status.CONVERGED
    np.testing.assert_allclose(host(r.x) / scale**2, unit, rtol=1e-6, atol=1e-8)
    h = pde.heat_step(big, z, dt=0.1 * scale**2, device=device)
    np.testing.assert_allclose(solve(h), solve(pde.heat_step(m, z, dt=0.1, device="cpu")), rtol=1e-10,
                               atol=1e-12)


def test_values_a_value_type_cannot_hold_name_the_builder_and_the_fix():
    big = Mesh(icosphere(1).vertices * 1e20, icosphere(1).faces)  # areas near 1e40
    with pytest.raises(ValueError, match=r"heat_step\(mesh=...\).*beyond float32's range.*Rescale the "
                                         r"mesh.*dtype=np.float64"):
        pde.heat_step(big, 1.0, dt=1.0, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match=r"poisson\(mesh=...\): the lumped mass has entries beyond float32"):
        pde.poisson(big, 1.0, dtype=np.float32, device="cpu")
    with pytest.raises(ValueError, match=r"heat_step\(dt=1e\+200, kappa=1e\+200\): dt \* kappa overflows"):
        pde.heat_step(icosphere(1), 1.0, dt=1e200, kappa=1e200, device="cpu")


def test_an_empty_dirichlet_set_is_named_as_such():
    m = grid(4, 4)
    for index in ([], np.array([], dtype=float), np.array([], dtype=np.int64)):
        with pytest.raises(ValueError, match=r"poisson\(dirichlet=...\): no vertices given"):
            pde.poisson(m, 1.0, dirichlet=(index, []), device="cpu")
    # Elsewhere an empty index selects nothing: the problem is left as it was.
    L = pde.laplacian(m, device="cpu").A
    A, b = pde.apply_dirichlet(L.copy(), np.ones(16), [], [])
    assert abs(A - L).max() == 0 and (b == 1.0).all()
    assert pde.laplacian_nullspace(m, fixed=[]) == "constant"


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_vertex_values_name_the_builders_argument(device):
    m = icosphere(1)
    u = np.ones(m.n_vertices)
    u[[3, 7]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=r"heat_step\(u=...\): vertex 3 has nan; expected finite "
                                         r"values \(2 of the 42 are not\)"):
        pde.heat_step(m, u, dt=0.1, device=device)
    with pytest.raises(ValueError, match=r"poisson\(f=...\): vertex 0 has -inf"):
        pde.poisson(m, lambda v: np.full(len(v), -np.inf), device=device)
    with pytest.raises(ValueError, match=r"screened_poisson\(f=nan\): expected a finite value$"):
        pde.screened_poisson(m, float("nan"), 1.0, device=device)
    with pytest.raises(ValueError, match=r"laplacian\(b=...\): vertex 7 has inf"):
        pde.laplacian(m, device=device, b=np.where(np.isnan(u), 1.0, u))
    # Finite, but beyond the value type: the range and the fix.
    with pytest.raises(ValueError, match=r"poisson\(f=1e\+300\): expected a finite value; 1e\+300 is "
                                         r"beyond float32's range \(use dtype=np.float64\)"):
        pde.poisson(m, 1e300, dtype=np.float32, device=device)
    with pytest.raises(ValueError, match=r"poisson_grid\(f=...\): node \(1, 2\) has nan"):
        pde.poisson_grid((3, 4), np.where(np.arange(12).reshape(3, 4) == 6, np.nan, 1.0), device=device)


def test_lumped_is_a_flag_not_a_truth_value():
    m = icosphere(1)
    for build in (lambda lumped: pde.mass(m, lumped=lumped, device="cpu"),
                  lambda lumped: pde.poisson(m, 1.0, lumped=lumped, device="cpu"),
                  lambda lumped: pde.screened_poisson(m, 1.0, 1.0, lumped=lumped, device="cpu"),
                  lambda lumped: pde.heat_step(m, 1.0, 0.1, lumped=lumped, device="cpu")):
        for bad in ("no", 0, None):
            with pytest.raises(TypeError, match=rf"\(lumped={bad!r}\): expected True or False, got "
                                                rf"{type(bad).__name__}"):
                build(bad)
    consistent = pde.mass(m, lumped=np.False_, device="cpu")
    assert consistent.name == "mass(consistent)"
    np.testing.assert_array_equal(consistent.A.toarray(),
                                  assembly.assemble(m, stiffness=0.0, mass=1.0).toarray())


def test_rtol_is_checked_by_the_builder_and_named_there():
    # Refused only after the assembly, by the LinearSystem (naming it, not the builder's
    # argument), or with a bare NumPy TypeError for None and strings.
    m = icosphere(1)
    builders = {"poisson": lambda rtol: pde.poisson(m, 1.0, device="cpu", rtol=rtol),
                "screened_poisson": lambda rtol: pde.screened_poisson(m, 1.0, 1.0, device="cpu", rtol=rtol),
                "heat_step": lambda rtol: pde.heat_step(m, 1.0, 0.1, device="cpu", rtol=rtol),
                "poisson_grid": lambda rtol: pde.poisson_grid((4, 4), 1.0, device="cpu", rtol=rtol)}
    for call, build in builders.items():
        for bad in (None, "1e-8", True):
            with pytest.raises(TypeError, match=rf"^{call}\(rtol={bad!r}\): expected a real number.*rtol=1e-08"):
                build(bad)
        for bad in (-1.0, float("nan"), float("inf"), 0.0):
            with pytest.raises(ValueError, match=rf"^{call}\(rtol={bad!r}\): expected a finite number > 0"):
                build(bad)
        assert build(np.float32(1e-4)).rtol == pytest.approx(1e-4)


def test_float32_builders_keep_the_package_tolerance_and_say_when_it_is_out_of_reach():
    # One rule for the whole package: rtol defaults to 1e-8 whatever the dtype, and a
    # float32 solve that cannot resolve it ends in MAXITER naming rtol and the fix. No
    # fixed float32 default would do: the attainable residual grows with the condition
    # number (about 1e-5 at 600 vertices, 1e-4 at 10,000, 1e-3 at 40,000).
    m = icosphere(3)
    z = m.vertices[:, 2]
    s = pde.screened_poisson(m, z, 1.0, dtype=np.float32, device="cpu")
    assert s.rtol == 1e-8
    r = ms.solve(s, method="cg")
    assert r.status == Status.MAXITER and "rtol=1e-08" in r.message and "float64" in r.message
    r = ms.solve(pde.screened_poisson(m, z, 1.0, dtype=np.float32, device="cpu", rtol=1e-4), method="cg")
    assert r.status == Status.CONVERGED
    np.testing.assert_allclose(host(r.x), solve(pde.screened_poisson(m, z, 1.0, device="cpu")), atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_values_a_tiny_mesh_would_lose_are_refused(device):
    # Triangles near 1e-20 have areas near 1e-40, below float32's smallest normal number
    # (1.2e-38): the mass matrix came out as subnormal garbage or zeros (b = M f of zeros
    # solves to x = 0) and poisson failed with "b has NaN or Inf entries".
    unit = icosphere(2)
    tiny = Mesh(unit.vertices * 1e-20, unit.faces)
    z = unit.vertices[:, 2]
    refused = r"\(mesh=..., dtype=float32\): .*below float32's smallest normal number .*Mesh\(mesh.vertices / 1e-20, mesh.faces\).*dtype=np.float64"
    for call, build in {"mass": lambda: pde.mass(tiny, dtype=np.float32, device=device),
                        "poisson": lambda: pde.poisson(tiny, z, dtype=np.float32, device=device),
                        "screened_poisson": lambda: pde.screened_poisson(tiny, z, 1e40, dtype=np.float32,
                                                                         device=device),
                        "heat_step": lambda: pde.heat_step(tiny, z, 1e-41, dtype=np.float32, device=device)}.items():
        with pytest.raises(ValueError, match=rf"^{call}{refused}"):
            build()
    # Tetrahedra scale their stiffness with the mesh too: volumes near 1e-60 lose both mass and L.
    cube = grid(3, 3, 3)
    with pytest.raises(ValueError, match=rf"^mass{refused.replace('1e-20', '1e-40')}"):
        pde.mass(Mesh(cube.vertices * 1e-40, cube.faces), lumped=False, dtype=np.float32, device=device)
    with pytest.raises(ValueError, match=rf"^laplacian{refused.replace('1e-20', '1e-40')}"):
        pde.laplacian(Mesh(cube.vertices * 1e-40, cube.faces), dtype=np.float32, device=device)
    # A coefficient can push a term below the range on a mesh of any scale: it is named.
    with pytest.raises(ValueError, match=r"^heat_step\(dt=1e-45, kappa=1.0, dtype=float32\): dt \* kappa \* L "
                                         r"has entries down to .*use a larger dt \* kappa, or dtype=np.float64"):
        pde.heat_step(unit, z, 1e-45, dtype=np.float32, device=device)
    with pytest.raises(ValueError, match=r"^screened_poisson\(alpha=1e-40, dtype=float32\): alpha \* M"):
        pde.screened_poisson(unit, z, 1e-40, lumped=False, dtype=np.float32, device=device)
    # What float32 holds is built as before, and matches float64 to float32's precision:
    # the cotangent Laplacian is scale-free, and areas near 1e-30 are normal float32s.
    L32 = host(pde.laplacian(tiny, dtype=np.float32, device=device).A).toarray()
    np.testing.assert_allclose(L32, pde.laplacian(unit, device="cpu").A.toarray(), rtol=1e-6, atol=1e-6)
    small = Mesh(unit.vertices * 1e-15, unit.faces)
    s32 = pde.screened_poisson(small, z, 1e30, dtype=np.float32, device=device)
    s64 = pde.screened_poisson(small, z, 1e30, device="cpu")
    np.testing.assert_allclose(host(s32.A).toarray(), s64.A.toarray(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(host(s32.b), s64.b, rtol=1e-6, atol=1e-6 * np.abs(s64.b).max())
