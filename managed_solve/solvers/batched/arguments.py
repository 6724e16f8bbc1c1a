"""Validation of the batched drivers' arguments, at their public boundary."""

from __future__ import annotations

from typing import Any

import numpy as np

from .packed import PackedBatch


def check_batch(batch: Any, call: str, check_every: int | None,
                first_check: int | None = None) -> None:
    """``batch`` a :class:`PackedBatch`; ``check_every`` and ``first_check`` None or positive."""
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"{call}: batch must be a PackedBatch, got {type(batch).__name__}; "
                        "build one with PackedBatch.pack(systems) or PackedBatch.from_csr(A, b)")
    if check_every is not None and int(check_every) < 1:
        raise ValueError(f"{call}: check_every must be a positive integer or None, got {check_every!r}")
    if first_check is not None and (int(first_check) != first_check or first_check < 1):
        raise ValueError(f"{call}: first_check must be a positive integer or None, got {first_check!r}")


def check_restart(call: str, restart: Any) -> int:
    """GMRES's ``restart`` as an int (a positive integer; not a bool, float or string)."""
    if isinstance(restart, bool) or not isinstance(restart, (int, np.integer)) or restart < 1:
        raise ValueError(f"{call}: restart must be a positive integer, e.g. 30; got {restart!r}")
    return int(restart)
