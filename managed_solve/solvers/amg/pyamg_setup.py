"""The CPU set-up through PyAMG: ``smoothed_aggregation_solver`` builds the levels.

PyAMG is the well-kept smoothed-aggregation library on the host; its
hierarchy is copied into our :class:`~.hierarchy.Level` objects (its
matrices, smoothed prolongators and aggregates), so the same V-cycle and
Krylov loops apply it. The numeric re-setup is ours
(:func:`~.hierarchy.refresh` with :func:`improve_candidates`): PyAMG fits its
tentative prolongators to near-null-space vectors it first relaxes on the
matrix (:data:`IMPROVE`), so new values relax the candidates again before
the prolongators are refitted to the kept aggregates. Where PyAMG's own
cycle applies the hierarchy, the re-setup hands PyAMG the kept aggregates
instead (``aggregate=('predefined', ...)``, :func:`aggregation_operators`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from ... import _backend
from .hierarchy import Level, as_csr, damping
from .segments import csr_rows

#: How the near-null-space candidates are relaxed on ``A x = 0`` before the
#: finest level's tentative prolongator is fitted to them (PyAMG's default,
#: named here so that the re-setup relaxes them alike): a badly scaled
#: matrix's near-null space is far from the constants (``D^-1 1`` for
#: ``D A D``), and relaxation finds it.
IMPROVE = ("block_gauss_seidel", {"sweep": "symmetric", "iterations": 4})


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
        max_levels=int(max_levels), improve_candidates=[IMPROVE, None], keep=True, **kw)


def improve_candidates(level: Level, B: Any) -> Any:
    """``B`` relaxed on the level's ``A x = 0`` as :func:`pyamg_solver`'s set-up relaxes it
    (:data:`IMPROVE`)."""
    relaxation = _backend.require("pyamg", "amg(setup='pyamg')").relaxation.utils
    A = level.A
    B = np.asarray(B, dtype=A.dtype)
    zero = np.zeros((A.shape[0], 1), dtype=A.dtype)
    return np.asarray(relaxation.relaxation_as_linear_operator(IMPROVE, sp.csr_array(A), zero) @ B)


def levels_of(ml: Any, xp: Any) -> list[Level]:
    """Our levels from a PyAMG multilevel solver (CSR matrices, aggregates, damping estimated)."""
    levels = []
    for lev in ml.levels:
        level = Level(as_csr(lev.A), blocksize=lev.A.blocksize[0] if hasattr(lev.A, "blocksize")
                      else 1)
        if hasattr(lev, "P"):
            level.P = as_csr(lev.P)
            agg, level.count = aggregates_from(lev.AggOp)
            # PyAMG aggregates nodes (blocks of ``blocksize`` unknowns on coarse levels
            # of a multi-vector near-null space); our levels keep one entry per unknown.
            level.agg = agg[np.arange(level.A.shape[0]) // level.blocksize]
            damping(level, xp)  # for its smoother (the coarsest has none: its inverse)
        levels.append(level)
    return levels


def aggregates_from(AggOp: Any) -> tuple[Any, int]:
    """``(agg, count)``: the aggregate of every node of a PyAMG aggregation operator (-1: none)."""
    AggOp = sp.csr_matrix(AggOp)
    agg = np.full(AggOp.shape[0], -1, dtype=np.int32)
    agg[csr_rows(np, AggOp.indptr, AggOp.indices.shape[0])] = AggOp.indices
    return agg, int(AggOp.shape[1])


def aggregation_operators(levels: list[Level]) -> list:
    """PyAMG's aggregation operators of every level but the coarsest, from our aggregates."""
    ops = []
    for lev in levels[:-1]:
        agg = lev.agg[::lev.blocksize]  # one entry per node, as PyAMG aggregates
        inside = np.flatnonzero(agg >= 0)
        ops.append(sp.csr_array((np.ones(inside.shape[0], dtype=np.int8),
                                 (inside, agg[inside])), shape=(agg.shape[0], lev.count)))
    return ops
