"""The hints file: learned times and device speeds, saved as JSON and read back validated.

A hints file is shared by every run that names it, often by several at once
(a pool of workers, two notebooks). So a save never leaves a half-written file
where a reader can see it: the JSON goes to a temporary file in the same
directory, is flushed to disk, and replaces the old file in one
``os.replace`` (atomic on POSIX and Windows). A save that fails part way
leaves the previous file as it was. Saves in one process are serialised by a
lock; between processes the atomic replace is enough, the last save wins.

Reading checks everything (known fields, types, finite non-negative numbers)
before any of it is used: a file that fails is refused as a whole, with the
entry and the problem named.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMAT_VERSION", "Hint", "read", "write"]

FORMAT_VERSION = 1

_SAVE_LOCK = threading.Lock()
_TOP_FIELDS = {"version", "hints", "speed"}
_HINT_FIELDS = {"seconds", "peak_bytes", "count", "device", "iterations"}
_HINT_REQUIRED = _HINT_FIELDS - {"iterations"}  # files from before iteration counts lack it


@dataclass
class Hint:
    """What was learned about one kind of work: its time, peak memory and iterations."""

    seconds: float
    peak_bytes: int
    count: int
    device: str
    iterations: int = 0


def write(path: str | os.PathLike, hints: Mapping[str, Hint], speeds: Mapping[str, float]) -> None:
    """Save hints and device speeds to ``path`` atomically.

    Raises
    ------
    ValueError
        A value that JSON cannot hold (NaN, infinity); the file is untouched.
    OSError
        The directory cannot be written; the previous file is untouched.
    """
    data = {"version": FORMAT_VERSION,
            "hints": {k: vars(h) for k, h in hints.items()},
            "speed": dict(speeds)}
    # Serialise before touching the disk: what cannot be written fails here.
    text = json.dumps(data, indent=1, allow_nan=False)
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    with _SAVE_LOCK:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            try:  # keep the permissions the file had (mkstemp makes it private)
                os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
            except FileNotFoundError:
                os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


def read(path: str | os.PathLike) -> tuple[dict[str, Hint], dict[str, float]]:
    """Hints and device speeds from a file written by :func:`write`.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    ValueError
        The file is not valid JSON or not a hints file; the message names the
        first entry that fails and why.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not text ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    return _validate(data)


def _validate(data: Any) -> tuple[dict[str, Hint], dict[str, float]]:
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object at the top, found {type(data).__name__}")
    unknown = sorted(set(data) - _TOP_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} at the top (known: {sorted(_TOP_FIELDS)})")
    version = data.get("version", FORMAT_VERSION)
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise ValueError(f"version {version!r} is not {FORMAT_VERSION}, the version this library reads")
    raw_hints, raw_speeds = data.get("hints", {}), data.get("speed", {})
    for field, value in (("hints", raw_hints), ("speed", raw_speeds)):
        if not isinstance(value, dict):
            raise ValueError(f"{field!r} must be an object, found {type(value).__name__}")
    hints = {}
    for key, entry in raw_hints.items():
        where = f"hints[{key!r}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object, found {type(entry).__name__}")
        unknown = sorted(set(entry) - _HINT_FIELDS)
        missing = sorted(_HINT_REQUIRED - set(entry))
        if unknown or missing:
            raise ValueError(f"{where} has " + "; ".join(
                [f"unknown field(s) {unknown}"] * bool(unknown) + [f"missing field(s) {missing}"] * bool(missing)))
        device = entry["device"]
        if not isinstance(device, str) or not device:
            raise ValueError(f"{where}.device = {device!r}: expected a device name such as 'cuda:0'")
        hints[key] = Hint(_number(entry["seconds"], f"{where}.seconds"),
                          _count(entry["peak_bytes"], f"{where}.peak_bytes"),
                          _count(entry["count"], f"{where}.count"),
                          device,
                          _count(entry.get("iterations", 0), f"{where}.iterations"))
    speeds = {}
    for name, value in raw_speeds.items():
        speed = _number(value, f"speed[{name!r}]")
        if speed <= 0:
            raise ValueError(f"speed[{name!r}] = {value!r}: expected a speed > 0")
        speeds[name] = speed
    return hints, speeds


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} = {value!r}: expected a finite number >= 0")
    return float(value)


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where} = {value!r}: expected a whole number >= 0")
    return value
