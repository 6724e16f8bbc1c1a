"""PDE builders: convergence against known solutions, SPD systems, placement, errors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import assembly, pde
from managed_solve.manager import DeviceManager
from managed_solve.mesh import grid, icosphere, torus
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


@pytest.mark.parametrize("device", DEVICES)
def test_poisson_on_closed_surface_pins_the_null_space(device):
    m = icosphere(4)
    z = m.vertices[:, 2]
    s = pde.poisson(m, lambda v: v[:, 2] + 3.0, device=device)  # the constant 3 is incompatible
    A = host(s.A)
    assert abs(A - A.T).max() <= 1e-14 * abs(A).max()
    assert sla.eigsh(A, k=1, which="SA", return_eigenvectors=False)[0] > 0  # SPD after pinning
    u = solve(s)
    assert abs(u[0]) < 1e-12
    w = assembly.lumped_mass(m)
    u0 = u - (w @ u) / w.sum()
    assert np.abs(u0 - z / 2).max() < 2e-3  # -Laplace(z) = 2 z on the unit sphere


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
