"""The command line: `managed-solve info` in every mode, errors as one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from managed_solve.cli import main


def test_info_simulated(capsys):
    assert main(["info", "--simulate", "2x1GiB"]) == 0
    out = capsys.readouterr().out
    assert "simulated mode" in out
    assert "sim:0" in out and "sim:1" in out and "cpu" in out
    for lib in ("numpy", "numba", "cupy", "torch"):
        assert lib in out


def test_info_bad_simulation_is_one_line(capsys):
    assert main(["info", "--simulate", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "4x2GiB" in err and "Traceback" not in err


@pytest.mark.slow
def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "managed_solve", "info", "--simulate", "1x1GiB"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sim:0" in proc.stdout
