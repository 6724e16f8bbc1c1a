"""The CPU set-up through PyAMG: ``smoothed_aggregation_solver`` builds the levels.

PyAMG is the well-kept smoothed-aggregation library on the host; its
hierarchy is copied into our :class:`~.hierarchy.Level` objects, its
tentative prolongators included (fitted by PyAMG to near-null-space vectors
it first improves by relaxation, so not refitted from the aggregates), so
the same V-cycle and Krylov loops apply it and the numeric re-setup is ours
(:func:`~.hierarchy.refresh`: PyAMG's aggregates and ``T`` kept). Where PyAMG's own cycle applies the hierarchy,
the re-setup hands PyAMG the first set-up's aggregates instead
(``aggregate=('predefined', ...)``).
"""

from __future__ import annotations

from typing import Any

from ... import _backend
from .hierarchy import Level, as_csr, damping


def pyamg_solver(A: Any, B: Any, *, theta: float, max_coarse: int, max_levels: int,
                 aggregates: list | None = None) -> Any:
    """PyAMG's ``smoothed_aggregation_solver`` with our strength measure and sizes."""
    pyamg = _backend.require("pyamg", "amg(setup='pyamg')")
    kw: dict[str, Any] = {}
    if aggregates is not None:
        kw["aggregate"] = [("predefined", {"AggOp": agg}) for agg in aggregates]
        max_levels = len(aggregates) + 1
    return pyamg.smoothed_aggregation_solver(
        A, B=B, strength=("symmetric", {"theta": float(theta)}), max_coarse=int(max_coarse),
        max_levels=int(max_levels), keep=True, **kw)


def levels_of(ml: Any, xp: Any) -> list[Level]:
    """Our levels from a PyAMG multilevel solver (CSR matrices, damping estimated)."""
    levels = []
    for lev in ml.levels:
        level = Level(as_csr(lev.A), blocksize=lev.A.blocksize[0] if hasattr(lev.A, "blocksize")
                      else 1)
        if hasattr(lev, "P"):
            level.P, level.T = as_csr(lev.P), as_csr(lev.T)
        damping(level, xp)
        levels.append(level)
    return levels


def aggregates_of(ml: Any) -> list:
    """The aggregation operators of every level but the coarsest (for the numeric re-setup)."""
    return [lev.AggOp for lev in ml.levels[:-1]]
