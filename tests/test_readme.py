"""The README's tour runs as written (on simulated GPUs), so it stays true."""

from __future__ import annotations

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_tour_runs(monkeypatch, capsys):
    from managed_solve import manager

    monkeypatch.setenv("MANAGED_SOLVE_SIMULATE", "2x1GiB")
    monkeypatch.setattr(manager, "_default", None)  # the tour uses ms.device_manager
    text = (ROOT / "README.md").read_text()
    tour = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    scope: dict = {}
    exec(compile(tour, "README.md tour", "exec"), scope)
    assert all(r.converged for r in scope["results"]) and len(scope["results"]) == 100
    assert all(r.converged for r in scope["out"])
    t = scope["t"]
    assert np.shares_memory(t.numpy(), scope["out"][0].x)
    assert "sim:0" in capsys.readouterr().out
