"""Every example runs at a small size and one number it prints is asserted (scikit-fem style).

The torch examples (different_device_tensors, multiple_models, ddp_solve_train)
are run by tests/test_tensor.py, tests/test_module.py and tests/test_ddp_example.py.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_simple_and_managed_agree():
    """The managed version reproduces the point-by-point user code."""
    simple = _load("pde_solve_simple").main(["--small"])
    managed = _load("pde_solve_managed").main(["--small"])
    assert managed == pytest.approx(simple, rel=1e-8)
    # Mass-weighted norm of backward-Euler heat steps: below the initial state's norm.
    assert 0 < simple < 4 * 3.6


def test_managed_on_simulated_gpus_agrees(capsys):
    mod = _load("pde_solve_managed")
    a = mod.main(["--small"])
    b = mod.main(["--small", "--simulate", "2x1GiB"])
    assert b == pytest.approx(a, rel=1e-8)
    assert "sim:" in capsys.readouterr().out


def test_heat_on_surface_conserves_heat(tmp_path, capsys):
    drift = _load("heat_on_surface").main(["--small", "--out", str(tmp_path / "heat.png")])
    assert drift < 1e-9
    assert (tmp_path / "heat.png").stat().st_size > 1000
    # The Solver's steps agree with the factor-once SciPy loop.
    out = capsys.readouterr().out
    assert float(re.search(r"^scipy_diff=(\S+)$", out, re.M).group(1)) < 1e-10


def test_heat_on_surface_krylov_steps_agree(capsys):
    """The same steps on the Solver's Krylov path (what a GPU runs) conserve heat too."""
    drift = _load("heat_on_surface").main(["--small", "--method", "cg"])
    assert drift < 1e-9
    out = capsys.readouterr().out
    assert "(cg on cpu)" in out
    assert float(re.search(r"^scipy_diff=(\S+)$", out, re.M).group(1)) < 1e-9


def test_geodesic_heat_converges_on_the_sphere(capsys):
    """Heat-method distances approach arccos(x . x_s) as the icosphere is refined."""
    errors = _load("geodesic_heat").main(["--small", "--sources", "3", "--no-compare"])
    assert len(errors) == 3
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 0.03  # icosphere(4): mean error about 0.013 (distances up to pi)
    out = capsys.readouterr().out
    assert "per source" in out and "in a block of 3" in out


def test_geodesic_heat_operators():
    """G^T diag(area) G is the cotangent Laplacian; the pinned Laplacian keeps its pattern."""
    from managed_solve.assembly import assemble
    from managed_solve.mesh import icosphere

    geo = _load("geodesic_heat")
    mesh = icosphere(2)
    G, area = geo.face_gradient(mesh)
    L = assemble(mesh)
    assert abs(G.T @ (G.multiply(np.repeat(area, 3)[:, None])) - L).max() < 1e-12
    assert abs(G @ np.ones(mesh.n_vertices)).max() < 1e-12  # constants have no gradient
    P = geo.pinned(L, 5)
    assert P.nnz == L.nnz and (P.indices == L.indices).all()
    assert P[5, 5] == 1.0 and abs(P[5]).sum() == 1.0 and abs(P[:, 5]).sum() == 1.0


def test_geodesic_heat_directions_survive_tiny_gradients():
    """|grad u| by hypot: a gradient of 1e-200 keeps its direction (its square would underflow)."""
    geo = _load("geodesic_heat")
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((50, 3, 2))
    area = rng.uniform(0.5, 1.0, 50)
    ref = geo.weighted_directions(grad.copy(), area)
    size = np.linalg.norm(grad, axis=1, keepdims=True)
    np.testing.assert_allclose(ref, -area[:, None, None] * grad / size, rtol=1e-14)
    np.testing.assert_allclose(geo.weighted_directions(grad * 1e-200, area), ref, rtol=1e-14)
    assert (geo.weighted_directions(np.zeros((4, 3, 1)), np.ones(4)) == 0).all()  # no direction


def test_geodesic_heat_block_matches_one_source_at_a_time():
    from managed_solve.mesh import icosphere

    geo = _load("geodesic_heat")
    mesh = icosphere(2)
    with geo.HeatGeodesics(mesh, device="cpu") as solver:
        block = solver.distance(np.array([3, 40, 100]))
        one = solver.distance(40)
    assert block.shape == (mesh.n_vertices, 3) and one.shape == (mesh.n_vertices,)
    np.testing.assert_allclose(block[:, 1], one, atol=1e-10)
    assert block[40, 1] == 0.0 and (block >= -1e-12).all()


def test_surrogate_training_learns():
    pytest.importorskip("torch")
    err = _load("surrogate_training").main(["--small", "--simulate", "2x1GiB"])
    assert math.isfinite(err) and err < 0.25


def test_inverse_coefficient_recovers_kappa(capsys):
    """Gradient descent through solve_many: the misfit falls and kappa approaches the truth."""
    pytest.importorskip("torch")
    err0, err1, loss0, loss1 = _load("inverse_coefficient").main(["--small"])
    assert err1 < 0.5 * err0, (err0, err1)  # about 0.16 -> 0.05
    assert loss1 < 0.2 * loss0, (loss0, loss1)  # down to the noise's floor, about 1e-4
    out = capsys.readouterr().out
    assert f"rel_error_end={err1:.4f}" in out and "64 solves and their adjoints" in out


@pytest.mark.slow
def test_examples_run_as_scripts():
    out = subprocess.run([sys.executable, str(EXAMPLES / "pde_solve_managed.py"), "--small"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^checksum=\d+\.\d+$", out.stdout, re.M)


def test_demo_small(tmp_path, capsys):
    from managed_solve.cli import main

    png = tmp_path / "demo.png"
    rc = main(["demo", "--small", "--simulate", "2x1GiB", "--out", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    resid = float(re.search(r"largest relative residual: ([0-9.e+-]+)", out).group(1))
    assert resid < 1e-7
    assert "sim:0" in out and png.stat().st_size > 1000


def test_demo_missing_mesh_is_one_line(capsys):
    from managed_solve.cli import main

    assert main(["demo", "--mesh", "/no/such/mesh.obj"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file" in err and "Traceback" not in err


def test_demo_on_a_user_mesh_file(tmp_path, capsys):
    meshio = pytest.importorskip("meshio")
    from managed_solve.cli import main
    from managed_solve.mesh import torus

    m = torus(1.0, 0.4, nu=24, nv=12)
    path = tmp_path / "part.obj"
    meshio.write_points_cells(str(path), m.vertices, [("triangle", m.faces)])
    rc = main(["demo", "--mesh", str(path), "--systems", "6", "--device", "cpu",
               "--out", str(tmp_path / "d.png")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"6 systems on 1 mesh(es), {6 * m.n_vertices:,} unknowns" in out
    assert float(re.search(r"largest relative residual: ([0-9.e+-]+)", out).group(1)) < 1e-7


def test_demo_unknown_device_names_the_flag(capsys):
    from managed_solve.cli import main

    assert main(["demo", "--device", "cuda:7", "--small"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device cuda:7" in err and "Traceback" not in err
