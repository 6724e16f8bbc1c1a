"""The smoothed-aggregation hierarchy, built with ``xp`` and ``sparse`` operations only.

The same functions run with NumPy + scipy.sparse on the CPU and CuPy +
cupyx.scipy.sparse on a GPU. Per level: strength of connection
(:mod:`.strength`), aggregation (:mod:`.aggregate`), the tentative
prolongator (:mod:`.tentative`), one damped-Jacobi smoothing step of it,
``P = (I - omega D^-1 A) T`` with ``omega = 4 / (3 rho(D^-1 A))``, and the
Galerkin product ``A_c = P^T A P`` by two SpGEMMs; the coarsest matrix is
inverted densely.

A level keeps what the cycle and the numeric re-setup need, and no more:
``A``, ``P`` (no ``R = P^T``: the cycles apply ``P^T`` through P), the
aggregates as int32 and the near-null space (None on the finest level for
the default constants); the finest level also keeps which of its couplings
held an aggregate together (one bit each), and every level the row blocks
of its two Galerkin products (a few integers). The tentative prolongator,
``P^T`` and ``D^-1`` are set-up temporaries.

:func:`refresh` is the numeric re-setup: the aggregates are kept (they
follow the strength graph, which scaling ``D A D`` by a positive diagonal
leaves as it is) and everything numeric is redone on the new values: the
near-null space relaxed on the new matrix where the set-up relaxes it
(PyAMG's), the tentative prolongators refitted to it level by level, the
damping ``omega`` from the new ``rho(D^-1 A)``, the smoothing of ``P`` and
the Galerkin products (their row blocks, which follow the patterns, kept). Where
the new values weaken a coupling that held an aggregate together (:func:`weakened_inside`: a coefficient jump across it, a
new anisotropy direction), the kept aggregates no longer follow the matrix
and the caller sets up anew.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import _backend
from .aggregate import aggregate
from .segments import csr_rows
from .smoothers import chebyshev_coefficients
from .spectral import safe_inverse, spectral_radius
from .strength import node_matrix, strong_entries, symmetric_strength
from .tentative import fit_candidates

#: Default strength threshold. Galerkin operators below the finest level hold
#: many small couplings; aggregating along them (threshold 0) makes poor
#: coarse levels. 0.04 gave the fewest CG iterations over 2D and 3D Poisson,
#: a rotated anisotropic problem and elasticity, at an operator complexity
#: 2-17% above threshold 0's (the figures: ``docs/performance.md``, "Tuning
#: constants").
THETA = 0.04
#: Prolongator damping over rho(D^-1 A) (PyAMG's and the literature's 4/3).
PROLONGATOR_OMEGA = 4.0 / 3.0
#: Degree of the Chebyshev polynomial that relaxes the near-null space on the
#: finest level, and ``rho / lower end`` of the interval it damps. CG
#: iterations with degree 0 / 8 (ratio 30): 2D Poisson 64^2 8 / 8, 3D 20^3
#: 6 / 6, elasticity 40^2 8 / 8, rotated anisotropic 80^2 35 / 35; 2D
#: Poisson scaled ``D A D`` (d over 3 and 6 decades) 49 / 11 and 64 / 16,
#: anisotropic and badly scaled 64^2 77 / 14. Degree 4 (ratio 8) gives
#: 13 / 19 / 20 on the last three; degree 32 (ratio 300) loses 3 on 3D.
CANDIDATE_DEGREE = 8
CANDIDATE_RATIO = 30.0
#: Coarse unknowns per fine unknown above which a strength threshold has cut
#: too many couplings (isolated nodes become aggregates of their own): the
#: level is aggregated again over all its couplings.
WEAK_COARSENING = 0.5
#: Coarsest size the dense inverse is meant for: coarsening goes on past
#: ``max_levels`` while the coarsest is larger (its inverse is read every cycle).
DENSE_COARSEST = 4096
#: Coarsest size beyond which the dense inverse is refused (8 n^2 bytes).
DENSE_LIMIT = 20000
#: Intermediate products one sparse product forms at once (:func:`product`).
SPGEMM_PRODUCTS = 1 << 28


@dataclass
class Level:
    """One level: its matrix, and the transfer to the next coarser level (None on the coarsest)."""

    A: Any
    blocksize: int = 1
    P: Any = None
    B: Any = None  # the near-null space on this level (None: the constants)
    agg: Any = None  # the aggregate of every unknown (int32; -1: none)
    count: int = 0  # the number of aggregates
    dinv: Any = None  # set-up temporary (the smoothers keep their own scaling)
    rho: float = 0.0  # estimate of rho(D^-1 A) (levels with a P: the coarsest has no smoother)
    strong: Any = None  # finest level: its couplings that held an aggregate together (held_bits)
    # The row blocks of the Galerkin products A P and P^T (A P), by name, with the entry
    # counts of the operands they were sized for (:func:`smooth_and_coarsen`).
    plans: dict = field(default_factory=dict)

    def arrays(self) -> list:
        """The arrays this level holds (matrices as their three arrays)."""
        out = []
        for M in (self.A, self.P):
            if M is not None:
                out += [M.data, M.indices, M.indptr]
        return out + [v for v in (self.B, self.agg, self.dinv, self.strong) if v is not None]

    def nbytes(self) -> int:
        return int(sum(v.nbytes for v in self.arrays()))


def as_csr(A: Any) -> Any:
    """CSR with duplicates summed and indices sorted; a copy only where A is not so already."""
    A = A.tocsr()
    if not A.has_canonical_format:
        A = A.copy()  # never reorder the caller's matrix in place
        A.sum_duplicates()
        A.sort_indices()
    return A


def canonical(M: Any) -> Any:
    """:func:`as_csr` in place, for a matrix the set-up made itself (a product, a difference):
    no one else holds it, so it is sorted where it lies rather than copied first."""
    M = M.tocsr()
    M.sum_duplicates()  # sorts the indices first (both libraries); nothing where canonical
    return M


def damping(level: Level, xp: Any) -> None:
    """Fill ``dinv`` and ``rho`` of a level from its matrix."""
    level.dinv = safe_inverse(xp, level.A.diagonal())
    level.rho = spectral_radius(level.A, level.dinv, xp)


def relax_candidates(level: Level, B: Any) -> Any:
    """``B`` (n, K) relaxed on ``A x = 0``: a Chebyshev polynomial in ``D^-1 A`` of degree
    :data:`CANDIDATE_DEGREE` (``level``'s ``dinv`` and ``rho`` filled by :func:`damping`).

    A badly scaled matrix's near-null space is far from the given candidates
    (``D^-1 1`` rather than the constants for ``D A D``); the polynomial damps
    what of them A does not nearly annihilate, so that the tentative
    prolongator interpolates A's smooth vectors. The candidates of a
    well-scaled Laplacian or elasticity operator are nearly left as they are.
    """
    xp = _backend.array_module(B)
    upper = 1.1 * level.rho
    theta, coeffs = chebyshev_coefficients(upper / CANDIDATE_RATIO, upper, CANDIDATE_DEGREE)
    x = B.astype(xp.float64, copy=True)
    # One candidate (the constants by default) as a vector: a matrix-vector product a step
    # rather than a product with an (n, 1) block (an SpMM on a GPU).
    one = x.shape[1] == 1
    A, dinv = level.A, level.dinv if one else level.dinv[:, None]
    if one:
        x = x[:, 0]
    res = -dinv * (A @ x)
    d = res / theta
    x += d
    for a, c in coeffs:
        t = A @ d
        t *= dinv
        res -= t
        d *= a
        d += c * res  # a d + c res, the previous d not read again
        x += d
    return x[:, None] if one else x


def smooth_and_coarsen(level: Level, xp: Any, sparse: Any, T: Any) -> Any:
    """``P = (I - omega D^-1 A) T`` and the Galerkin coarse matrix ``P^T A P`` (``level``'s
    damping filled by :func:`damping`)."""
    A = level.A
    AT = (A @ T).tocsr()
    scale = (PROLONGATOR_OMEGA / level.rho) * level.dinv
    AT.data *= scale[csr_rows(xp, AT.indptr, AT.data.shape[0])]
    level.P = canonical(T - AT)
    R = as_csr(level.P.T)  # a temporary: SpGEMM wants CSR operands
    # A P only feeds the next product, which reads its rows in any order: it is not sorted
    # (the host's SpGEMM leaves its indices unsorted; a GPU's comes sorted).
    AP = product(A, level.P, xp, sparse, blocks=planned(level, "AP", A, level.P, xp), sort=False)
    return product(R, AP, xp, sparse, blocks=planned(level, "RAP", R, AP, xp))


def planned(level: Level, name: str, X: Any, Y: Any, xp: Any) -> tuple[int, ...]:
    """The row blocks of ``level``'s product ``name``, ``X @ Y``: :func:`row_blocks` at set-up,
    kept for a re-setup while the operands hold as many entries as then.

    The operands' patterns follow the kept aggregates, so a re-setup meets
    the same products and skips their sizing (a pass over ``X``'s entries
    and a host read each). On the host, entries that cancel to zero are
    dropped and the counts can move: the blocks are sized again.
    """
    key = (int(X.nnz), int(Y.nnz))
    kept = level.plans.get(name)
    if kept is None or kept[0] != key:
        kept = level.plans[name] = (key, row_blocks(X, Y, xp))
    return kept[1]


def row_blocks(X: Any, Y: Any, xp: Any, limit: int | None = None) -> tuple[int, ...]:
    """Bounds of the row blocks of ``X`` in which ``X @ Y`` forms at most ``limit``
    (:data:`SPGEMM_PRODUCTS` where None) intermediate products each (``(0, rows)``: one
    block), for :func:`product`."""
    limit = SPGEMM_PRODUCTS if limit is None else int(limit)
    counts = xp.diff(Y.indptr).astype(xp.int64)[X.indices]
    cumulative = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(counts)])
    ends = cumulative[X.indptr[1:].astype(xp.int64)]  # products up to the end of each row
    total = int(ends[-1]) if ends.shape[0] else 0  # sync: once a product, set-up only
    if total <= limit:
        return (0, X.shape[0])
    marks = xp.arange(1, -(-total // limit), dtype=xp.int64) * limit
    cuts = _backend.to_host(xp.searchsorted(ends, marks, side="right"))
    return tuple(sorted({0, X.shape[0], *(int(c) for c in cuts if 0 < c < X.shape[0])}))


def product(X: Any, Y: Any, xp: Any, sparse: Any, limit: int | None = None, *,
            blocks: tuple[int, ...] | None = None, sort: bool = True) -> Any:
    """``X @ Y`` (CSR), in row blocks of X of at most ``limit`` intermediate products each
    (:data:`SPGEMM_PRODUCTS` where None).

    A library SpGEMM holds workspace for every intermediate product (an entry
    of X times a row of Y) at once: 20-25 bytes each on a GPU, 37 GB for one
    Galerkin product of a 3D 7-point 256^3 hierarchy. Row blocks bound that
    peak; their rows are the rows of the whole product. ``blocks``: their
    bounds, from :func:`row_blocks` where None. ``sort=False`` leaves the
    indices in the order the SpGEMM gives them (for a product that only
    feeds another).
    """
    if blocks is None:
        blocks = row_blocks(X, Y, xp, limit)
    done = canonical if sort else (lambda M: M.tocsr())
    if len(blocks) <= 2:
        return done(X @ Y)
    parts = [done(X[a:b] @ Y) for a, b in zip(blocks[:-1], blocks[1:], strict=True)]
    return done(sparse.vstack(parts, format="csr"))


def build(A: Any, B: Any, xp: Any, sparse: Any, *, theta: float = THETA, blocksize: int = 1,
          max_coarse: int = 500, max_levels: int = 10, seed: int = 0) -> list[Level]:
    """The levels of a smoothed-aggregation hierarchy for the CSR matrix ``A``.

    ``B`` (n, K) is the near-null space, relaxed on ``A`` before the finest
    level's tentative prolongator is fitted to it (:func:`relax_candidates`).
    Coarsening stops at ``max_coarse`` unknowns, at ``max_levels`` levels
    (unless the coarsest is still larger than :data:`DENSE_COARSEST`), or
    where aggregation no longer reduces the size. A level whose strength threshold leaves too little to aggregate
    (:data:`WEAK_COARSENING`) is aggregated over all its couplings.
    """
    levels = [Level(as_csr(A), blocksize=int(blocksize), B=B)]
    while True:
        level = levels[-1]
        n = level.A.shape[0]
        if n <= max_coarse or (len(levels) >= max_levels and n <= DENSE_COARSEST):
            break
        bs = level.blocksize
        K = level.B.shape[1]
        agg_nodes, count = aggregate(xp, symmetric_strength(level.A, theta, bs, xp, sparse), seed)
        if theta > 0 and count * K > WEAK_COARSENING * n:
            agg_nodes, count = aggregate(xp, symmetric_strength(level.A, 0.0, bs, xp, sparse),
                                         seed)
        if count == 0 or count * K >= n:
            break  # aggregation stalls (e.g. a diagonal matrix): this level is the coarsest
        agg = agg_nodes if bs == 1 else agg_nodes[xp.arange(n) // bs]
        level.agg, level.count = agg.astype(xp.int32), int(count)
        damping(level, xp)
        B = relax_candidates(level, level.B) if len(levels) == 1 else level.B
        T, Bc = fit_candidates(xp, sparse, level.agg, count, B)
        Ac = smooth_and_coarsen(level, xp, sparse, T)
        levels.append(Level(Ac, blocksize=K, B=Bc))
    levels[0].strong = held_bits(levels[0], theta, xp, sparse)
    return levels


def refresh(levels: list[Level], A: Any, xp: Any, sparse: Any, *,
            improve: Callable[[Level, Any], Any] = relax_candidates) -> None:
    """Numeric re-setup for new values ``A`` of the fine matrix, the aggregates kept.

    The near-null space of the finest level (its ``B``, the constants where
    None) is relaxed on ``A`` by ``improve(level, B)`` as the set-up relaxed
    it (:func:`relax_candidates` for :func:`build`'s levels), then every
    level's tentative prolongator is refitted to the candidates the level
    above hands down, smoothed with the new damping, and the Galerkin
    products are redone.
    """
    fine0 = levels[0]
    fine0.A = as_csr(A)
    B = fine0.B if fine0.B is not None else xp.ones((A.shape[0], 1), dtype=xp.float64)
    for i, (fine, coarse) in enumerate(zip(levels[:-1], levels[1:], strict=True)):
        damping(fine, xp)
        T, B = fit_candidates(xp, sparse, fine.agg, fine.count, improve(fine, B) if i == 0 else B)
        coarse.A = smooth_and_coarsen(fine, xp, sparse, T)
        coarse.B = B


def held_bits(level: Level, theta: float, xp: Any, sparse: Any) -> Any:
    """Which stored couplings of ``level``'s A (of its block norms) hold one of its aggregates
    together: strong, and between two nodes of one aggregate. Packed 8 to a byte; None where
    nothing is aggregated (one level)."""
    if level.agg is None:
        return None
    M = node_matrix(level.A, level.blocksize, xp, sparse).tocsr()
    rows, strong = strong_entries(M, theta, xp)
    agg = level.agg[::level.blocksize]  # the aggregate of every node
    inside = (agg[rows] == agg[M.indices]) & (agg[rows] >= 0)
    return xp.packbits(strong & inside)


def weakened_inside(level: Level, A: Any, theta: float, xp: Any, sparse: Any) -> int:
    """How many couplings inside an aggregate of ``level`` were strong at set-up and are weak
    in ``A`` (the finest level's new values, on its pattern).

    Such an aggregate straddles what the new values separate (a coefficient
    jump, the weak direction of an anisotropy), and a fresh set-up would
    split it: kept aggregates then cost iterations (2D Poisson 64^2 made
    anisotropic, 1 : 0.01: 31 CG iterations against 6 (PyAMG's set-up) and
    9 (ours) with new aggregates; a jump of 10^6 appearing across the
    middle: 10 against 7 with PyAMG's). Couplings that new values strengthen
    leave every aggregate connected, and kept aggregates then cost at most
    two iterations; scaling ``D A D`` changes no coupling's strength. The
    set-up kept those couplings (:func:`held_bits`), so only A's strength
    is measured here.
    """
    if level.agg is None or level.strong is None:
        return 0  # one level: nothing aggregated
    M = node_matrix(as_csr(A), level.blocksize, xp, sparse).tocsr()
    _, strong = strong_entries(M, theta, xp)
    held = xp.unpackbits(level.strong)[:strong.shape[0]].view(bool)
    return int(xp.count_nonzero(held & ~strong))  # sync: one read an update


#: Condition number (1-norm) of the coarsest matrix above which it is taken as
#: singular, and inverted on its modes above ``1 / COARSE_CONDITION_LIMIT``
#: of its largest singular value.
COARSE_CONDITION_LIMIT = 1e12


def coarse_inverse(A: Any, xp: Any) -> Any:
    """The dense inverse of the coarsest matrix (its pseudo-inverse if singular).

    Rows and columns emptied by a dropped near-null-space vector get a unit
    diagonal first; their right-hand side is always zero. A coarsest matrix
    of more than :data:`DENSE_LIMIT` unknowns (coarsening stalled: few
    couplings to aggregate along) is refused with ``ValueError``.
    """
    n = A.shape[0]
    if n > DENSE_LIMIT:
        raise ValueError(
            f"amg(A): coarsening stalled at {n} unknowns, too many for the dense coarsest "
            f"solve (at most {DENSE_LIMIT}). A matrix with few off-diagonal couplings is "
            "solved well with M='jacobi'; a near-null space (nullspace=) with more vectors "
            "than an aggregate's unknowns also stalls it.")
    D = A.toarray().astype(xp.float64)
    empty = (abs(D).sum(axis=1) == 0) & (abs(D).sum(axis=0) == 0)
    idx = xp.flatnonzero(empty)
    D[idx, idx] = 1.0
    try:
        inv = xp.linalg.inv(D)
        # A numerically singular matrix (the coarsest of a singular A, such as a
        # pure Neumann problem's) inverts through rounding-sized pivots: its inverse
        # is huge along the null space, and every cycle's output drowns in it.
        norm1 = float(abs(D).sum(axis=0).max()) * float(abs(inv).sum(axis=0).max())  # sync
        regular = norm1 <= COARSE_CONDITION_LIMIT  # NaN (an inf entry) is not regular
    except np.linalg.LinAlgError:
        regular = False
    if regular:
        return inv
    U, sv, Vt = xp.linalg.svd(D)  # the pseudo-inverse on the modes above the limit
    keep = sv > sv[0] / COARSE_CONDITION_LIMIT
    return (Vt[keep].T / sv[keep]) @ U[:, keep].T
