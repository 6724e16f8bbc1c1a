"""examples/ddp_solve_train.py: two gloo ranks under torchrun equal one process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ddp_solve_train.py"


def _value(lines, key):
    return float(next(line for line in lines if line.startswith(key + "=")).split("=")[1])


def test_two_ranks_equal_one_process_and_loss_drops(capsys, monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on the CPU
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(EXAMPLE), "--small"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = proc.stdout.strip().splitlines()
    assert two[-1].startswith("final_loss=") and "ranks=2" in two[0]

    spec = importlib.util.spec_from_file_location("example_ddp_solve_train", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    one_final = mod.main(["--small"])
    one = capsys.readouterr().out.strip().splitlines()
    assert "ranks=1" in one[0] and _value(one, "final_loss") == pytest.approx(one_final, rel=1e-9)

    # Averaged DDP gradients equal the full-batch gradient: the same training, up to rounding.
    assert _value(two, "initial_loss") == pytest.approx(_value(one, "initial_loss"), rel=1e-12)
    assert _value(two, "final_loss") == pytest.approx(one_final, rel=1e-9)
    assert one_final < 0.25 * _value(one, "initial_loss")  # and it did learn
