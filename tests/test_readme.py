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

    previous = manager.set_default_manager(None)
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


def test_readme_gradients_section_runs(capsys):
    pytest.importorskip("torch")
    text = (ROOT / "README.md").read_text()
    section = text.split("## Gradients", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    scope: dict = {}
    exec(compile(code, "README.md gradients", "exec"), scope)
    A = scope["A"]
    assert scope["values"].grad.shape == (A.nnz,) and scope["b"].grad.shape == (A.shape[0],)
    # dL/db = A^-T dL/dx with dL/dx = 2 x
    x = scope["x"].detach().numpy()
    np.testing.assert_allclose(A.T @ scope["b"].grad.numpy(), 2 * x, rtol=1e-6, atol=1e-9)
    assert "torch.Size" in capsys.readouterr().out
