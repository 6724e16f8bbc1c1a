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


def test_version(capsys):
    import managed_solve

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"managed-solve {managed_solve.__version__}"


def test_help_is_plain_text_and_lists_only_existing_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "`" not in out and "bench" not in out
    assert "info" in out and "demo" in out and "--version" in out
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "`" not in out and "--json" in out and "--repeat" in out
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    assert exc.value.code == 2


@pytest.mark.parametrize("command", ["info", "demo"])
def test_bad_devices_variable_is_named(monkeypatch, capsys, command):
    monkeypatch.setenv("MANAGED_SOLVE_DEVICES", "cuda:7")
    monkeypatch.delenv("MANAGED_SOLVE_SIMULATE", raising=False)
    assert main([command]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "MANAGED_SOLVE_DEVICES" in err
    assert "--simulate" not in err and "None" not in err


def test_bad_simulate_variable_is_named(monkeypatch, capsys):
    monkeypatch.setenv("MANAGED_SOLVE_SIMULATE", "lots")
    assert main(["demo", "--small"]) == 2
    err = capsys.readouterr().err
    assert "MANAGED_SOLVE_SIMULATE" in err and "--simulate" not in err


def test_bad_options_are_named(capsys):
    assert main(["demo", "--simulate", "lots"]) == 2
    assert "--simulate lots" in capsys.readouterr().err
    assert main(["demo", "--device", "cuda:9", "--simulate", "1x1GiB"]) == 2
    assert "--device cuda:9" in capsys.readouterr().err
    assert main(["demo", "--systems", "0"]) == 2
    assert "--systems 0" in capsys.readouterr().err


def test_demo_small_json(tmp_path, capsys):
    import json

    rc = main(["demo", "--small", "--systems", "4", "--repeat", "3", "--json",
               "--out", str(tmp_path / "demo.png")])
    assert rc == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["systems"] == 4 and len(summary["solve_many"]["runs_s"]) == 3
    assert len(summary["naive"]["runs_s"]) == 3 and "scipy" in summary["naive"]["what"]
    assert summary["verdict"].endswith(("x faster", "x slower"))
    assert summary["largest_relative_residual"] < 1e-6
    assert "first run" in captured.err and summary["verdict"] in captured.err


def test_demo_device_missing_names_the_option_and_what_the_machine_has(capsys):
    assert main(["demo", "--device", "cuda:0", "--simulate", "1x1GiB", "--small"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "--device cuda:0: this machine has no cuda:0 (simulated mode: sim:0, cpu)" in err
    assert "Give one of sim:0, cpu" in err
    # Not the list the demo builds from the option, nor an example naming the missing device.
    assert "devices=" not in err and "'cpu']" not in err and "'cuda:0,cpu'" not in err
    assert main(["demo", "--device", "foo", "--small"]) == 2
    assert "--device foo: not a device name; give cpu, cuda:0" in capsys.readouterr().err


class _ClosedPipe:
    """Standard output whose reader has gone (``managed-solve info | head -1``)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_pipe_ends_the_command_quietly(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["info", "--simulate", "1x1GiB"]) == 141  # 128 + SIGPIPE, as a shell reports it
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_closed_pipe_leaves_no_traceback_in_a_real_process():
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written: every write fails
    try:
        proc = subprocess.run([sys.executable, "-m", "managed_solve", "info", "--simulate", "1x1GiB"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == ""


@pytest.mark.parametrize(("option", "value", "accepted"), [
    ("--methods", "", "cg, bicgstab, gmres"),
    ("--methods", " , ", "cg, bicgstab, gmres"),
    ("--dtypes", "", "float64, float32"),
    ("--device", ",", "cpu, cuda:N, cuda"),
])
def test_warmup_with_an_empty_list_is_a_usage_error(capsys, option, value, accepted):
    args = ["warmup", "--device", "cpu", "--methods", "cg", option, value]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "compiling" not in captured.out + captured.err  # refused before any work
    assert f"{option} {value!r}: names nothing; give one or more of {accepted}" in captured.err
