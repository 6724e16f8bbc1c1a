"""A singular matrix with a known null space made regular for a factorisation, by pinning unknowns.

``nullspace=`` says that ``A N = 0`` for an orthonormal ``N`` of shape
(n, k). A factorisation of A itself meets a zero pivot, or a rounded tiny
one that turns rounding into a huge null-space part, so the direct engine
(:mod:`managed_solve.solvers.direct`) factorises the *grounded* matrix G:
A with the rows and columns of k unknowns ``I`` cleared and ``alpha`` on
their diagonal, ``alpha`` the largest magnitude of A (inside A's spectrum,
so G is no worse conditioned than A is on the rest). Pinning a vertex of a
pure Neumann problem is the classical form of this; the choice of ``I``
makes it work for any null space.

Why it solves the system: for a b in A's range, the solutions of
``A x = b`` are ``x* + N c``, and exactly one of them vanishes on ``I``
when the k rows ``N[I]`` are independent (``I`` comes from a pivoted QR of
``N^T``, which makes them as independent as the rows of N allow). That one
solves ``G y = b`` with ``b[I]`` set to zero, and ``y - N N^T y`` is the
solution orthogonal to the null space (for a symmetric A the one of least
norm, the pseudo-inverse's). G is regular when no non-zero vector of A's
range vanishes off ``I``, which holds whenever the left null space is N
(a symmetric A). For a non-symmetric A whose left null space is another, a
b projected orthogonally to N may leave A's range: its residual at the rows
``I`` shows it, and the engine says so (:data:`NOT_SOLVED`). Its transposed
solve ``A^T x = b`` is always consistent for such a b (A^T's range is
orthogonal to N); its solutions differ by A^T's null space Z, found from
the same factors once (k solves), and the one orthogonal to N is
``y - Z (N^T Z)^+ N^T y``.

Cleared entries stay stored, as zeros: G has A's sparsity pattern (plus a
diagonal entry where a pinned row had none), so the factorisation orders
and analyses it as it would A, and new values of A map onto G's values by
one gather (:meth:`Grounding.matrix`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend
from .amg.segments import csr_rows

#: The direct engine's message when the grounded matrix is singular.
INCOMPLETE = (
    "with the null space given by nullspace= pinned, A is still singular: nullspace= does not "
    "span all of A's null space; give every null-space vector (one per connected component for "
    "a Laplacian)."
)

#: The direct engine's message when ``A x = P b`` has no solution orthogonal to the null space.
NOT_SOLVED = (
    "A x = b (b projected orthogonally to nullspace=) has no solution: b is not in A's range. "
    "nullspace= must span all of A's null space (a vector per connected component of a "
    "Laplacian) and A^T's, as it does for a symmetric A; for a non-symmetric A whose A^T has "
    "another null space, make b consistent, or solve a pinned (regular) system instead."
)


class Grounding:
    """A singular A with the orthonormal null-space basis ``N``: k unknowns pinned, as described above.

    Parameters
    ----------
    A : CSR matrix (SciPy or cupyx) or dense array
        The matrix whose pattern the grounded matrices share.
    N : array, shape (n, k)
        An orthonormal basis of A's null space, on A's device.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp, scipy.sparse.linalg as sla
    >>> A = sp.csr_matrix(np.array([[1.0, -1.0, 0.0], [-1.0, 2.0, -1.0], [0.0, -1.0, 1.0]]))
    >>> g = Grounding(A, np.ones((3, 1)) / np.sqrt(3.0))
    >>> g.matrix(A).toarray().tolist()
    [[2.0, 0.0, 0.0], [0.0, 2.0, -1.0], [0.0, -1.0, 1.0]]
    >>> b = np.array([1.0, 0.0, -1.0])  # in A's range: orthogonal to the constants
    >>> x = g.orthogonal(sla.spsolve(g.matrix(A).tocsc(), g.rhs(b)))
    >>> bool(np.allclose(A @ x, b)), bool(abs(x.sum()) < 1e-12)
    (True, True)
    """

    def __init__(self, A: Any, N: Any):
        import scipy.linalg

        sparse = _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)
        xp = _backend.array_module(A.data if sparse else A)
        n, k = int(A.shape[0]), int(N.shape[1])
        # The k rows of N farthest from dependent: a pivoted QR of N^T (n * k^2 work, once).
        _r, order = scipy.linalg.qr(np.asarray(_backend.to_host(N), dtype=np.float64).T,
                                    mode="r", pivoting=True)
        self.N, self.sparse = N, sparse
        self.left: tuple | None = None  # (A, Z, (N^T Z)^+) of a transposed solve
        self.pins = xp.asarray(np.sort(order[:k]))
        self.pinned = xp.zeros(n, dtype=bool)
        self.pinned[self.pins] = True
        if not sparse:
            return
        indptr, indices = A.indptr, A.indices
        rows = csr_rows(xp, indptr, indices.shape[0])
        self.cleared = self.pinned[rows] | self.pinned[indices]
        self.diagonal = self.cleared & (rows == indices)
        stored = xp.zeros(n, dtype=bool)
        stored[rows[self.diagonal]] = True
        missing = self.pins[~stored[self.pins]]
        self.added = int(missing.shape[0])  # sync: once, a pinned row without a diagonal entry
        self.order = None
        self.indptr, self.indices = indptr, indices
        if self.added:
            # The pattern with those diagonal entries inserted, rows and columns in order.
            r = xp.concatenate([rows.astype(np.int64), missing.astype(np.int64)])
            c = xp.concatenate([indices, missing.astype(indices.dtype)])
            self.order = xp.argsort(r * n + c)
            self.indices = c[self.order]
            counts = xp.cumsum(xp.bincount(r, minlength=n)).astype(indptr.dtype)
            self.indptr = xp.concatenate([xp.zeros(1, dtype=indptr.dtype), counts])

    def matrix(self, A: Any) -> Any:
        """The grounded matrix of ``A`` (this pattern, any values), of A's type and device."""
        sparse = self.sparse
        xp = _backend.array_module(A.data if sparse else A)
        values = A.data if sparse else A
        amax = float(xp.abs(values).max()) if values.size else 0.0  # sync: once a factorisation
        alpha = xp.asarray(amax if amax > 0 else 1.0, dtype=values.dtype)
        if not sparse:
            G = A.copy()
            G[self.pins, :] = 0
            G[:, self.pins] = 0
            G[self.pins, self.pins] = alpha
            return G
        data = xp.where(self.diagonal, alpha, xp.where(self.cleared, xp.zeros((), values.dtype),
                                                       values))
        if self.order is not None:
            data = xp.concatenate([data, xp.full(self.added, alpha, dtype=values.dtype)])[self.order]
        return A.__class__((data, self.indices, self.indptr), shape=A.shape)

    def rhs(self, b: Any) -> Any:
        """``b`` with its pinned rows set to zero (a new array; (n,) or (n, k))."""
        xp = _backend.array_module(b)
        mask = self.pinned if b.ndim == 1 else self.pinned[:, None]
        return xp.where(mask, xp.zeros((), dtype=b.dtype), b)

    def orthogonal(self, y: Any) -> Any:
        """``y - N N^T y``: the part of y orthogonal to the null space ((n,) or (n, k))."""
        N = self.N
        return y - N @ (N.T @ y)

    def solve(self, factors: Callable[[Any, bool], Any], b: Any, trans: bool, A: Any,
              symmetric: bool | None) -> Any:
        """The solution orthogonal to N of ``A x = b`` (``A^T x = b`` with ``trans``), b in the range.

        ``factors(rhs, trans)`` applies the inverse of the grounded matrix
        of ``A`` (or of its transpose); rhs is (n,) or (n, k).
        """
        y = factors(self.rhs(b), trans)
        if not trans or symmetric:
            return self.orthogonal(y)
        if self.left is None or self.left[0] is not A:  # made again for new values
            self.left = (A, *self._left_null(A, factors))
        _A, Z, W = self.left
        return y - Z @ (W @ (self.N.T @ y))

    def _left_null(self, A: Any, factors: Callable[[Any, bool], Any]) -> tuple[Any, Any]:
        """A basis Z of A^T's null space with ``Z[I]`` the identity, and ``(N^T Z)^+``.

        ``A^T Z = 0`` on the rows off ``I`` gives ``Z[J] = -(A^T)[J, J]^-1
        (A^T)[J, I]``: one transposed solve with the grounded factors per pin.
        """
        N = self.N
        xp = _backend.array_module(N)
        k = N.shape[1]
        E = xp.zeros(N.shape, dtype=N.dtype)
        E[self.pins, xp.arange(k)] = 1
        Z = E - factors(self.rhs(xp.asarray(A.T @ E)), True)
        return Z, xp.linalg.pinv(N.T @ Z)
