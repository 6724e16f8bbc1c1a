"""The demo as a new user meets it: a fresh virtual environment, `pip install`, `managed-solve demo`."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest

from managed_solve.demo import speedup_text

ROOT = Path(__file__).resolve().parents[1]
# pip's answers when the package index cannot be reached (no network): skip, not fail.
OFFLINE = ("Could not find a version", "No matching distribution", "Failed to establish a new connection",
           "Temporary failure in name resolution", "Network is unreachable")


def test_speedup_text_says_faster_or_slower():
    assert speedup_text(0.5, 1.0) == "2.0x faster"
    assert speedup_text(1.0, 0.25) == "4.0x slower"


@pytest.mark.slow
def test_plain_install_runs_the_demo(tmp_path):
    """No extras: numpy, scipy and numba from the index, then `managed-solve demo --small`."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    py = bindir / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MANAGED_SOLVE_", "NUMBA_"))}
    install = subprocess.run([str(py), "-m", "pip", "install", "-v", "--disable-pip-version-check",
                              str(ROOT)],
                             capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    if install.returncode != 0 and any(s in install.stdout + install.stderr for s in OFFLINE):
        pytest.skip("the package index cannot be reached: " + install.stderr.strip().splitlines()[-1])
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    # Our packaging adds no warnings of its own (-v shows the build backend's output).
    for warning in ("SetuptoolsDeprecationWarning", "SetuptoolsWarning", "project.license"):
        assert warning not in install.stdout + install.stderr
    demo = subprocess.run([str(bindir / "managed-solve"), "demo", "--small", "--out", str(tmp_path / "d.png")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    out = demo.stdout
    assert "first run:" in out and "median of 3" in out
    assert "x faster than the naive way" in out or "x slower than the naive way" in out
    assert "picture skipped: matplotlib is not installed" in out  # no extras: no matplotlib
    assert "Traceback" not in demo.stderr
    version = subprocess.run([str(bindir / "managed-solve"), "--version"], capture_output=True, text=True,
                             timeout=120, env=env)
    assert version.returncode == 0 and version.stdout.startswith("managed-solve ")


def test_a_tetrahedral_mesh_is_pictured_by_its_boundary(tmp_path):
    pytest.importorskip("matplotlib")
    import numpy as np

    from managed_solve.demo import picture
    from managed_solve.mesh import grid

    cube = grid(3, 3, 3)
    path = tmp_path / "cube.png"
    assert picture(cube, [(cube.vertices[:, 0], "x"), (np.ones(cube.n_vertices), "one")], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
