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
the default constants). The tentative prolongator, ``P^T`` and ``D^-1`` are
set-up temporaries.

:func:`refresh` is the numeric re-setup: the aggregates and the tentative
prolongators depend on the pattern and on the near-null space only, so new
values of the fine matrix redo the damping, the smoothing of ``P`` and the
Galerkin products, not the aggregation (``T`` is refitted from the kept
aggregates, a cheap segmented pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import _backend
from .aggregate import aggregate
from .segments import csr_rows
from .spectral import safe_inverse, spectral_radius
from .strength import symmetric_strength
from .tentative import fit_candidates

#: Default strength threshold. Galerkin operators below the finest level hold
#: many small couplings; aggregating along them (threshold 0) makes poor
#: coarse levels. CG iterations to rtol 1e-8 with our set-up, threshold
#: 0 / 0.04 / 0.08 / 0.12: 2D Poisson 2048^2 18 / 11 / 11 / 18, 4096^2
#: 20 / 12 / 12 / 18; 3D 7-point 128^3 11 / 9 / 11 / 11; rotated anisotropic
#: 512^2 134 / 82 / 80 / 78; elasticity 256^2 with rigid-body modes
#: 14 / 11 / 11 / 13 (H100). The operator complexity grows by 2% (2D) to 17% (3D) at 0.04.
THETA = 0.04
#: Prolongator damping over rho(D^-1 A) (PyAMG's and the literature's 4/3).
PROLONGATOR_OMEGA = 4.0 / 3.0
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
    T: Any = None  # the tentative prolongator: only where no aggregates are kept (see tentative)
    B: Any = None  # the near-null space on this level (None: the constants)
    agg: Any = None  # the aggregate of every unknown (int32)
    count: int = 0  # the number of aggregates
    dinv: Any = None  # set-up temporary (the smoothers keep their own scaling)
    rho: float = 0.0  # estimate of rho(D^-1 A)

    def arrays(self) -> list:
        """The arrays this level holds (matrices as their three arrays)."""
        out = []
        for M in (self.A, self.P, self.T):
            if M is not None:
                out += [M.data, M.indices, M.indptr]
        return out + [v for v in (self.B, self.agg, self.dinv) if v is not None]

    def nbytes(self) -> int:
        return int(sum(v.nbytes for v in self.arrays()))

    def tentative(self, xp: Any, sparse: Any) -> Any:
        """The tentative prolongator: kept, or refitted from the aggregates and ``B``."""
        if self.T is not None:
            return self.T
        n = self.A.shape[0]
        B = self.B if self.B is not None else xp.ones((n, 1), dtype=xp.float64)
        return fit_candidates(xp, sparse, self.agg, self.count, B)[0]


def as_csr(A: Any) -> Any:
    """CSR with duplicates summed and indices sorted; a copy only where A is not so already."""
    A = A.tocsr()
    if not A.has_canonical_format:
        A = A.copy()  # never reorder the caller's matrix in place
        A.sum_duplicates()
        A.sort_indices()
    return A


def damping(level: Level, xp: Any) -> None:
    """Fill ``dinv`` and ``rho`` of a level from its matrix."""
    level.dinv = safe_inverse(xp, level.A.diagonal())
    level.rho = spectral_radius(level.A, level.dinv, xp)


def smooth_and_coarsen(level: Level, xp: Any, sparse: Any, T: Any = None) -> Any:
    """``P = (I - omega D^-1 A) T`` and the Galerkin coarse matrix ``P^T A P``."""
    damping(level, xp)
    A = level.A
    T = level.tentative(xp, sparse) if T is None else T
    AT = (A @ T).tocsr()
    scale = (PROLONGATOR_OMEGA / level.rho) * level.dinv
    AT.data *= scale[csr_rows(xp, AT.indptr, AT.data.shape[0])]
    level.P = as_csr(T - AT)
    R = as_csr(level.P.T)  # a temporary: SpGEMM wants CSR operands
    return product(R, product(A, level.P, xp, sparse), xp, sparse)


def product(X: Any, Y: Any, xp: Any, sparse: Any, limit: int = SPGEMM_PRODUCTS) -> Any:
    """``X @ Y`` (CSR), in row blocks of X of at most ``limit`` intermediate products each.

    A library SpGEMM holds workspace for every intermediate product (an entry
    of X times a row of Y) at once: 20-25 bytes each on a GPU, 37 GB for one
    Galerkin product of a 3D 7-point 256^3 hierarchy. Row blocks bound that
    peak; their rows are the rows of the whole product.
    """
    counts = xp.diff(Y.indptr).astype(xp.int64)[X.indices]
    cumulative = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(counts)])
    ends = cumulative[X.indptr[1:].astype(xp.int64)]  # products up to the end of each row
    total = int(ends[-1]) if ends.shape[0] else 0  # sync: once a product, set-up only
    if total <= limit:
        return as_csr(X @ Y)
    marks = xp.arange(1, -(-total // limit), dtype=xp.int64) * limit
    cuts = _backend.to_host(xp.searchsorted(ends, marks, side="right"))
    bounds = sorted({0, X.shape[0], *(int(c) for c in cuts if 0 < c < X.shape[0])})
    parts = [as_csr(X[a:b] @ Y) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return as_csr(sparse.vstack(parts, format="csr"))


def build(A: Any, B: Any, xp: Any, sparse: Any, *, theta: float = THETA, blocksize: int = 1,
          max_coarse: int = 500, max_levels: int = 10, seed: int = 0) -> list[Level]:
    """The levels of a smoothed-aggregation hierarchy for the CSR matrix ``A``.

    ``B`` (n, K) is the near-null space. Coarsening stops at ``max_coarse``
    unknowns, at ``max_levels`` levels (unless the coarsest is still larger
    than :data:`DENSE_COARSEST`), or where aggregation no longer reduces the
    size. A level whose strength threshold leaves too little to aggregate
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
        T, Bc = fit_candidates(xp, sparse, level.agg, count, level.B)
        Ac = smooth_and_coarsen(level, xp, sparse, T)
        levels.append(Level(Ac, blocksize=K, B=Bc))
    damping(levels[-1], xp)
    return levels


def refresh(levels: list[Level], A: Any, xp: Any, sparse: Any) -> None:
    """Numeric re-setup for new values of the fine matrix: the aggregates (and so ``T``) kept."""
    levels[0].A = as_csr(A)
    for fine, coarse in zip(levels[:-1], levels[1:], strict=True):
        coarse.A = smooth_and_coarsen(fine, xp, sparse)
    damping(levels[-1], xp)


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
        if not bool(xp.isfinite(inv).all()):  # sync: once a set-up
            raise np.linalg.LinAlgError("singular coarse matrix")
    except np.linalg.LinAlgError:
        inv = xp.linalg.pinv(D)
    return inv
