"""Supernodal sparse Cholesky of a host SPD matrix, its analysis kept for new values.

The direct engine (:mod:`managed_solve.solvers.direct`) factorises symmetric
positive definite host matrices with this rather than SuperLU: half the
factor (no U), no pivoting, and above all a symbolic phase apart from the
numeric one, so that :meth:`Cholesky.refactor` with new values on the same
pattern costs only the numeric factorisation (SuperLU has no numeric-only
refactorisation). The kernels are :mod:`managed_solve.kernels.cholesky_symbolic`
and :mod:`managed_solve.kernels.cholesky`.

A matrix that turns out not positive definite (a pivot not positive, or not
finite), or is not exactly what a Cholesky factorisation needs (values not
symmetric, a non-canonical CSR, a dtype other than float32/float64), raises
:class:`NotPositiveDefinite`; the engine then uses SuperLU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Nested dissection stops splitting pieces of this many vertices: on 2-D
#: grids of 16k to 260k rows, 16 to 32 fill in less than 64 (and than
#: minimum degree at 16k rows) and factorise faster by as much as a third,
#: for a few milliseconds more ordering.
LEAF = 24
#: Columns of a block solved a call (calls spread over the cores).
SOLVE_COLUMNS = 16


class NotPositiveDefinite(Exception):
    """The matrix cannot be factorised as ``L L^T`` here (the message says why)."""


def eligible(A: Any) -> str | None:
    """Why a host CSR matrix cannot take a Cholesky factorisation, or None when it may."""
    from ..kernels.symmetry import SYMMETRIC, csr_symmetry_scaled, symmetry_rtol

    if np.dtype(A.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        return f"dtype {np.dtype(A.dtype)}"
    if A.shape[0] == 0 or A.nnz == 0:
        return "an empty matrix"
    if not A.has_canonical_format:
        return "unsorted or duplicate CSR entries"
    # The package's one symmetry rule, as "auto" applies it (its tolerance the dtype's).
    if csr_symmetry_scaled(A.indptr, A.indices, A.data, symmetry_rtol(A.dtype)) != SYMMETRIC:
        return "values not symmetric"
    return None


class Cholesky:
    """``L L^T = P A P^T`` of a host CSR matrix: the symbolic analysis and the numeric factor.

    Parameters
    ----------
    A : scipy.sparse CSR matrix
        Symmetric positive definite, float32 or float64, canonical (sorted
        indices, no duplicates).

    Raises
    ------
    NotPositiveDefinite
        A is not (numerically) SPD, or not eligible (:func:`eligible`).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5)).tocsr()
    >>> chol = Cholesky(A)
    >>> np.round(chol.solve(np.ones(5)), 6).tolist()
    [2.5, 4.0, 4.5, 4.0, 2.5]
    >>> chol.refactor((2 * A).data)
    >>> np.round(chol.solve(np.ones(5)), 6).tolist()
    [1.25, 2.0, 2.25, 2.0, 1.25]
    """

    def __init__(self, A: Any):
        from ..kernels.blas import routines
        from ..kernels.cholesky_symbolic import analyse
        from ..kernels.ordering import nested_dissection

        why = eligible(A)
        if why is not None:
            raise NotPositiveDefinite(f"not a Cholesky candidate: {why}")
        perm = nested_dissection(A.indptr, A.indices, leaf=LEAF)
        if perm is None:
            raise NotPositiveDefinite("the pattern did not split by nested dissection")
        self.n = A.shape[0]
        self.symbolic = analyse(A.indptr, A.indices, perm)
        self.dtype = np.dtype(A.dtype)
        self._blas = routines(self.dtype)
        self.L = np.empty(self.symbolic["nnz"], dtype=self.dtype)
        self.refactor(A.data)

    def refactor(self, data: np.ndarray) -> None:
        """New values (CSR ``data`` of the analysed pattern): the numeric factorisation only.

        Raises :class:`NotPositiveDefinite` when a pivot is not positive or
        not finite; the factor is then unusable.
        """
        from ..kernels.cholesky import factor

        s = self.symbolic
        data = np.asarray(data)
        if data.dtype != self.dtype:
            data = data.astype(self.dtype)
        info = factor(s["first"], s["row_ptr"], s["sparent"], s["value_ptr"], s["rel"], s["stack"],
                      s["col_ptr"], s["source"], s["target"], data, self.L, self._blas)
        if info != 0:
            self.L = np.empty(0, dtype=self.dtype)
            raise NotPositiveDefinite(f"pivot {info} of {self.n} is not positive: the matrix is "
                                      "not positive definite")

    @property
    def nnz(self) -> int:
        """Stored factor entries (each supernode's dense block, its upper triangle included)."""
        return int(self.symbolic["nnz"])

    @property
    def nbytes(self) -> int:
        """Host bytes of the factor and of the analysis kept for :meth:`refactor`."""
        return int(self.L.nbytes + sum(v.nbytes for v in self.symbolic.values()
                                       if isinstance(v, np.ndarray)))

    def solve(self, b: Any, trans: str = "N") -> np.ndarray:
        """``A^-1 b`` for b of shape (n,) or (n, k) (``trans`` is ignored: A is symmetric).

        Every call of the kernel solves exactly :data:`SOLVE_COLUMNS` columns
        (a vector, or a block's last piece, padded with zeros): BLAS then
        makes the same calls for every column, so a column of a block is bit
        for bit its solve alone (a block and its columns are judged alike),
        and the supernodes' products are BLAS-3 even for one vector, at
        about the cost of loops over that one.
        """
        from ..kernels.cholesky import solve

        if self.L.shape[0] != self.symbolic["nnz"]:
            raise NotPositiveDefinite("the last factorisation failed")
        s = self.symbolic
        perm = s["perm"]
        vector = b.ndim == 1
        k = 1 if vector else b.shape[1]
        b = np.asarray(b).reshape(self.n, k)
        out = np.empty((self.n, k), dtype=self.dtype)
        starts = range(0, k, SOLVE_COLUMNS)

        def piece(i: int) -> None:
            lo = starts[i]
            hi = min(lo + SOLVE_COLUMNS, k)
            x = np.zeros((self.n, SOLVE_COLUMNS), dtype=self.dtype)  # a narrower piece padded
            x[:, :hi - lo] = b[perm, lo:hi]
            solve(s["first"], s["row_ptr"], s["rows"], s["value_ptr"], self.L, x.reshape(-1),
                  SOLVE_COLUMNS, self._blas)
            out[perm, lo:hi] = x[:, :hi - lo]

        # One piece after another on this thread: BLAS spreads a large
        # supernode's product over the cores itself, and pieces on threads of
        # their own would contend for them (several times slower on two cores).
        for i in range(len(starts)):
            piece(i)
        return out.reshape(-1) if vector else out
