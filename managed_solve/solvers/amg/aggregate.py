"""Parallel aggregation: distance-2 maximal independent sets and their neighbourhoods.

The roots of the aggregates are a maximal independent set of the strength
graph's square (no two roots within distance 2), found by Luby's method
with fixed pseudo-random priorities (Bell, Dalton and Olson, "Exposing
fine-grained parallelism in algebraic multigrid methods", SIAM J. Sci.
Comput. 34, 2012). Each round is a few whole-array operations: every
undecided node whose priority is the largest within distance 2 joins the
set; every undecided node with a member within distance 2 leaves.

Aggregates are then formed in three passes, as PyAMG's serial "standard"
aggregation does in its own order:

1. each root with its neighbours;
2. a second distance-2 independent set among the nodes left over, restricted
   to nodes with at least :data:`SECOND_PASS_MIN` left-over neighbours,
   again each with its left-over neighbours. Random priorities pack roots
   less densely than PyAMG's sequential sweep; without this pass the
   left-over rim makes ragged aggregates and costs about 40% more
   iterations on 2D Poisson;
3. every node still left joins the aggregate of a neighbour (maximality
   guarantees one).

Unlike PyAMG, isolated nodes (no strong neighbour) become aggregates of
their own, so every node is aggregated. The priorities come from a hash of
the node index (:func:`~.segments.random_ranks`), so NumPy and CuPy choose
the same aggregates.
"""

from __future__ import annotations

from typing import Any

from .segments import random_ranks, row_max
from .strength import Graph

#: Left-over neighbours a node needs to root an aggregate in the second pass
#: (so those aggregates have at least 4 nodes).
SECOND_PASS_MIN = 3

# Node states, the leading "digit" of a priority key (key = state * n + rank).
_OUT, _UNDECIDED, _ROOT = 0.0, 1.0, 2.0


def _neighbour_max(xp: Any, G: Graph, v: Any) -> Any:
    """``max(v_i, max_{j ~ i} v_j)`` for every node (float64)."""
    return xp.maximum(v, row_max(xp, G.indptr, G.rows, v[G.indices], -1.0))


def mis2(xp: Any, G: Graph, seed: int = 0, candidates: Any = None) -> Any:
    """A boolean mask of roots: a maximal independent set of ``G``'s square among ``candidates``.

    Distances are measured in all of ``G``. One host read a round (whether
    any node is still undecided); Luby's method finishes in O(log n) rounds.
    """
    n = G.n
    rank = random_ranks(xp, n, seed)
    state = xp.full(n, _UNDECIDED, dtype=xp.float64)
    if candidates is not None:
        state[~candidates] = _OUT
    while bool((state == _UNDECIDED).any()):  # sync: one read a round, set-up only
        key = state * n + rank
        m2 = _neighbour_max(xp, G, _neighbour_max(xp, G, key))
        undecided = state == _UNDECIDED
        joins = undecided & (m2 == key)
        leaves = undecided & ~joins & (m2 >= _ROOT * n)
        state[joins] = _ROOT
        state[leaves] = _OUT
    return state == _ROOT


def _grow(xp: Any, G: Graph, agg: Any, roots: Any, first: int) -> int:
    """Number ``roots`` ``first, first + 1, ...``; their unaggregated neighbours join them."""
    agg[roots] = first + xp.cumsum(roots)[roots] - 1
    node = xp.arange(G.n, dtype=xp.float64)
    near = row_max(xp, G.indptr, G.rows, xp.where(roots, node, -1.0)[G.indices], -1.0)
    joins = (agg < 0) & (near >= 0)  # roots are 3 apart: at most one root next to a node
    agg[joins] = agg[near[joins].astype(xp.int64)]
    return first + int(roots.sum())  # sync: the number of aggregates so far


def aggregate(xp: Any, G: Graph, seed: int = 0) -> tuple[Any, int]:
    """``(agg, count)``: the aggregate of every node (int64, 0 .. count-1) and their number."""
    n = G.n
    agg = xp.full(n, -1, dtype=xp.int64)
    count = _grow(xp, G, agg, mis2(xp, G, seed), 0)
    left = agg < 0
    if bool(left.any()):  # sync: set-up only
        room = xp.bincount(G.rows, weights=left[G.indices].astype(xp.float64), minlength=n)
        count = _grow(xp, G, agg, mis2(xp, G, seed + 1, left & (room >= SECOND_PASS_MIN)), count)
    placed = xp.where(agg >= 0, agg.astype(xp.float64), -1.0)
    via = row_max(xp, G.indptr, G.rows, placed[G.indices], -1.0)
    last = (agg < 0) & (via >= 0)
    agg[last] = via[last].astype(xp.int64)
    return agg, count
