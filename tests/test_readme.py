"""The README's tour runs as written (on simulated GPUs), so it stays true."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_default_manager():
    """The process-wide manager made anew on first use (from ``MANAGED_SOLVE_SIMULATE``), then restored."""
    from managed_solve import manager

    previous = manager.default_manager()
    manager.set_default_manager(None)
    try:
        yield
    finally:
        manager.set_default_manager(previous)


def test_readme_tour_runs(monkeypatch, capsys, fresh_default_manager):
    monkeypatch.setenv("MANAGED_SOLVE_SIMULATE", "2x1GiB")  # the tour uses ms.device_manager
    text = (ROOT / "README.md").read_text()
    tour = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    scope: dict = {}
    exec(compile(tour, "README.md tour", "exec"), scope)
    assert all(r.converged for r in scope["results"]) and len(scope["results"]) == 100
    assert all(r.converged for r in scope["out"])
    t = scope["t"]
    assert np.shares_memory(t.numpy(), scope["out"][0].x)
    assert "sim:0" in capsys.readouterr().out
