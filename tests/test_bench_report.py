"""benchmarks/report.py: ratios against the anchor of the same run, markdown and plot."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench(name, group, median, **extra):
    return {"name": name, "group": group, "stats": {"median": median}, "extra_info": extra}


def test_ratios_markdown_and_plot(tmp_path):
    report = _load()
    data = {
        "datetime": "2026-11-22",
        "machine_info": {"node": "box"},
        "benchmarks": [
            _bench("bench_ours_cg", "W1", 9.0, per_iteration_s=0.5e-3, role="ours"),
            _bench("bench_cupyx_cg", "W1", 9.0, per_iteration_s=1.0e-3, role="anchor"),
            _bench("bench_solve_many", "W2", 0.02),
            _bench("bench_scipy_loop", "W2", 2.0),
        ],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    assert report.main([str(path), "--out", str(tmp_path)]) == 0
    rows = {r["name"]: r for r in report.build_rows(data)}
    assert rows["bench_ours_cg"]["ratio"] == 0.5
    assert rows["bench_solve_many"]["ratio"] == 0.01
    assert rows["bench_cupyx_cg"]["is_anchor"]
    md = (tmp_path / "report.md").read_text()
    assert "| W1 | bench_ours_cg | 500 us | per iteration | 0.5 x | bench_cupyx_cg |" in md
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_unreadable_json(tmp_path, capsys):
    report = _load()
    bad = tmp_path / "x.json"
    bad.write_text("{")
    assert report.main([str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err
