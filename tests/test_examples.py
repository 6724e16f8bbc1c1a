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


def test_heat_on_surface_conserves_heat(tmp_path):
    drift = _load("heat_on_surface").main(["--small", "--out", str(tmp_path / "heat.png")])
    assert drift < 1e-9
    assert (tmp_path / "heat.png").stat().st_size > 1000


def test_surrogate_training_learns():
    pytest.importorskip("torch")
    err = _load("surrogate_training").main(["--small", "--simulate", "2x1GiB"])
    assert math.isfinite(err) and err < 0.25


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
