"""The tentative prolongator: near-null-space vectors made orthonormal on each aggregate.

For ``K`` near-null-space vectors ``B`` (n x K; the constant by default,
rigid-body modes for elasticity), the rows of ``B`` that belong to one
aggregate are factored ``B_agg = Q_agg R_agg``; ``T`` holds the ``Q`` blocks
(column ``agg * K + c`` is the c-th orthonormal vector of aggregate ``agg``)
and the coarse near-null space is the stack of the ``R`` blocks, so that
``B = T B_coarse`` exactly (PyAMG's ``fit_candidates``).

The QR of all aggregates at once is modified Gram-Schmidt over the ``K``
columns, with every inner product a segmented sum (``bincount`` by
aggregate), run twice for stability. A column that vanishes on an aggregate
(fewer unknowns there than vectors) becomes zero, as in PyAMG; the coarse
operator then has a zero row and column there, which the smoothers and the
coarse solve tolerate. An unknown outside every aggregate (``agg`` -1:
PyAMG leaves nodes without strong couplings out) gets a zero row of ``T``.
"""

from __future__ import annotations

from typing import Any

# A column whose norm on an aggregate drops below this fraction of the
# aggregate's norm of B is dependent on the others there: dropped.
_DEPENDENT = 1e-10


def fit_candidates(xp: Any, sparse: Any, agg: Any, count: int, B: Any) -> tuple[Any, Any]:
    """``(T, B_coarse)`` for aggregates ``agg`` (n,) and candidates ``B`` (n, K).

    ``T`` is CSR, n x (count * K), with K stored entries a row (explicit
    zeros in the rows of unknowns outside every aggregate, ``agg < 0``);
    ``B_coarse`` is (count * K, K).
    """
    n, K = B.shape
    inside = agg >= 0
    # The unaggregated form one more segment, which is then dropped.
    seg = xp.where(inside, agg, count)
    Q = B.astype(xp.float64, copy=True) * inside[:, None]
    R = xp.zeros((count + 1, K, K), dtype=xp.float64)
    scale = xp.sqrt(xp.bincount(seg, weights=(Q * Q).sum(axis=1), minlength=count + 1))
    for c in range(K):
        for _ in range(2):  # Gram-Schmidt twice ("twice is enough")
            for d in range(c):
                r = xp.bincount(seg, weights=Q[:, d] * Q[:, c], minlength=count + 1)
                R[:, d, c] += r
                Q[:, c] -= r[seg] * Q[:, d]
        nrm = xp.sqrt(xp.bincount(seg, weights=Q[:, c] * Q[:, c], minlength=count + 1))
        ok = nrm > _DEPENDENT * scale
        R[:, c, c] = xp.where(ok, nrm, 0.0)
        Q[:, c] *= xp.where(ok, 1.0 / xp.where(ok, nrm, 1.0), 0.0)[seg]
    # int32 indices: cupyx's sparse matrices (cuSPARSE) index with int32.
    home = xp.where(inside, agg, 0).astype(xp.int64)
    cols = (home[:, None] * K + xp.arange(K, dtype=xp.int64)[None, :]).ravel().astype(xp.int32)
    indptr = xp.arange(0, n * K + 1, K, dtype=xp.int32)
    T = sparse.csr_matrix((Q.ravel().astype(B.dtype), cols, indptr), shape=(n, count * K))
    return T, R[:count].reshape(count * K, K).astype(B.dtype)
