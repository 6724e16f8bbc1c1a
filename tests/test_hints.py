"""The hints file: atomic writes that fail cleanly, and reads that validate everything."""

from __future__ import annotations

import json
import os
import stat

import pytest

from managed_solve import hints as hints_file
from managed_solve.hints import FORMAT_VERSION, Hint


def test_round_trip_with_version(tmp_path):
    path = tmp_path / "h.json"
    hints = {"a": Hint(1.5, 100, 2, "sim:0", 17), "b": Hint(0.0, 0, 1, "cpu")}
    hints_file.write(path, hints, {"cpu": 1e10})
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION
    assert hints_file.read(path) == (hints, {"cpu": 1e10})


@pytest.mark.parametrize(
    ("hints", "speeds", "error"),
    [
        ({"a": Hint(object(), 1, 1, "cpu")}, {}, TypeError),  # cannot be serialised
        ({"a": Hint(float("nan"), 1, 1, "cpu")}, {}, ValueError),  # JSON has no NaN
        ({}, {"cpu": float("inf")}, ValueError),
    ],
)
def test_a_value_that_cannot_be_written_leaves_the_file_intact(tmp_path, hints, speeds, error):
    path = tmp_path / "h.json"
    hints_file.write(path, {"good": Hint(1.0, 1, 1, "cpu")}, {"cpu": 1e10})
    before = path.read_bytes()
    with pytest.raises(error):
        hints_file.write(path, hints, speeds)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["h.json"]


def test_write_keeps_the_file_permissions(tmp_path):
    path = tmp_path / "h.json"
    hints_file.write(path, {}, {})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not the temporary file's 0o600
    path.chmod(0o640)
    hints_file.write(path, {}, {})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_read_errors_name_the_problem(tmp_path):
    path = tmp_path / "h.json"
    with pytest.raises(FileNotFoundError):
        hints_file.read(path)
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="not text"):
        hints_file.read(path)
    path.write_text('{"hints": {"a": {"seconds": 1e400, "peak_bytes": 1, "count": 1, "device": "cpu"}}}')
    with pytest.raises(ValueError, match=r"hints\['a'\]\.seconds = inf: expected a finite number"):
        hints_file.read(path)
