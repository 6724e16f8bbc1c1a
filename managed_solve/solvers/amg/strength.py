"""Symmetric strength of connection: which couplings the aggregation follows.

Node ``j`` is strongly connected to ``i`` when ``|a_ij| >= theta sqrt(|a_ii a_jj|)``
(PyAMG's ``'symmetric'`` measure; ``theta = 0`` keeps every stored
off-diagonal coupling, PyAMG's default for smoothed aggregation). For a
system with ``blocksize`` unknowns a node (elasticity: the displacement
components of one mesh vertex), each ``blocksize x blocksize`` block is
measured by its Frobenius norm, as PyAMG does for BSR matrices, so that all
unknowns of a vertex land in one aggregate.

A scaling ``D A D`` by a positive diagonal leaves the measure as it is
(both sides scale by ``d_i d_j``), so new values of that kind keep the
aggregates valid (:func:`~.hierarchy.refresh`); :func:`strong_entries` is
the per-entry test that the numeric re-setup compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .segments import csr_rows


@dataclass
class Graph:
    """A symmetric adjacency pattern in CSR form without its diagonal."""

    indptr: Any
    indices: Any
    rows: Any  # the row of every stored entry (csr_rows)

    @property
    def n(self) -> int:
        return self.indptr.shape[0] - 1


def node_matrix(A: Any, blocksize: int, xp: Any, sparse: Any) -> Any:
    """``A`` itself (``blocksize`` 1), else the matrix of block Frobenius norms."""
    if blocksize == 1:
        return A
    C = A.tocoo()
    nn = A.shape[0] // blocksize
    M = sparse.coo_matrix((abs(C.data) ** 2, (C.row // blocksize, C.col // blocksize)),
                          shape=(nn, nn)).tocsr()  # sums the entries of each block
    M.sum_duplicates()
    return sparse.csr_matrix((xp.sqrt(M.data), M.indices, M.indptr), shape=M.shape)


def strong_entries(M: Any, theta: float, xp: Any) -> tuple[Any, Any]:
    """``(rows, strong)``: the row of every stored entry of the CSR ``M``, and whether it is a
    strong coupling (off the diagonal, nonzero, ``|m_ij| >= theta sqrt(|m_ii m_jj|)``)."""
    rows = csr_rows(xp, M.indptr, M.indices.shape[0])
    cols = M.indices
    mag = abs(M.data)
    d = abs(M.diagonal())
    keep = (rows != cols) & (mag > 0)
    if theta > 0:
        keep &= mag >= theta * xp.sqrt(d[rows] * d[cols])
    return rows, keep


def symmetric_strength(A: Any, theta: float, blocksize: int, xp: Any, sparse: Any) -> Graph:
    """The strength graph of a CSR matrix ``A`` (``n / blocksize`` nodes), symmetrised.

    The pattern is made symmetric (``S + S^T``) so that the distance-2
    aggregation sees an undirected graph even for a non-symmetric ``A``.
    """
    M = node_matrix(A, blocksize, xp, sparse).tocsr()
    n = M.shape[0]
    rows, keep = strong_entries(M, theta, xp)
    r, c = rows[keep], M.indices[keep]
    one = xp.ones(r.shape[0], dtype=xp.float64)
    S = sparse.coo_matrix((one, (r, c)), shape=(n, n)).tocsr()
    S = (S + S.T.tocsr()).tocsr()
    S.sum_duplicates()
    S.sort_indices()
    return Graph(S.indptr, S.indices, csr_rows(xp, S.indptr, S.indices.shape[0]))

