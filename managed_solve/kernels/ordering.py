"""Fill-reducing ordering of a symmetric sparse pattern by nested dissection (CPU only).

A direct solve's cost is its factors' fill. For the matrices of 2-D and 3-D
meshes the orderings SciPy's SuperLU offers (minimum degree on ``A^T + A``,
COLAMD) fill in several times more than nested dissection does (on a sphere
mesh of 41k vertices, 11.8M stored factor entries by minimum degree against
4.2M; at 164k, 94M against 19M, and a factorisation of 84 s against 0.8 s). Nested dissection orders a small set of vertices that splits the
graph in two (a *separator*) last, then the two halves the same way,
recursively: eliminating one half then never fills into the other.

The separators here are breadth-first level sets (George and Liu's automatic
nested dissection): from a pseudo-peripheral vertex of a connected piece,
the smallest level among those leaving at least 30% of the piece on each
side (else the level where the running count passes half), less the
vertices with no neighbour on one side (they join that side). On a mesh a level set is a ring or a front
of O(sqrt(n)) vertices in 2-D, O(n^(2/3)) in 3-D, which is what nested
dissection needs; no coordinates are used.

Rows far denser than the rest (a constraint coupling every unknown) would
make every level set contain them; they are set aside and ordered last, as
AMD does. A pattern that still will not split (the work passes a budget of
passes over the pattern) returns None, and the caller keeps its default
ordering.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["dissection_order", "nested_dissection"]

#: Pieces of at most this many vertices are not split further.
LEAF = 64
#: Edge visits allowed, as a multiple of the stored entries (balanced splits
#: make a few breadth-first passes a level of the recursion: 40 to 80 times
#: the entries in all on meshes and grids of 200k to 1M rows); past it the
#: ordering gives up.
WORK_BUDGET = 400


def nested_dissection(indptr: np.ndarray, indices: np.ndarray, *, leaf: int = LEAF,
                      budget: int = WORK_BUDGET) -> np.ndarray | None:
    """A nested-dissection permutation of the symmetric pattern ``(indptr, indices)``.

    Parameters
    ----------
    indptr, indices : ndarray
        A CSR pattern whose ``(i, j)`` is stored exactly when ``(j, i)`` is
        (a matrix structurally symmetric; the diagonal may be there or not).
    leaf : int
        Pieces of at most this many vertices are not split.
    budget : int
        Edge visits allowed, as a multiple of ``len(indices)``.

    Returns
    -------
    ndarray or None
        ``perm`` (int64) with ``perm[k]`` the row placed k-th: ``A[perm][:,
        perm]`` factors with little fill in its natural order. None when the
        pattern did not split within the budget.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(7, 7)).tocsr()
    >>> perm = nested_dissection(A.indptr, A.indices, leaf=1)
    >>> perm.tolist()  # the middle vertex last, each half's middle last within it
    [0, 2, 1, 4, 6, 5, 3]
    """
    n = int(indptr.shape[0]) - 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    # Rows denser than ten times the square root of n (and the mean, many times)
    # are ordered last and left out of the splitting.
    degree = np.diff(indptr).astype(np.int64)
    dense_limit = max(16.0, 10.0 * np.sqrt(n), 10.0 * float(degree.mean()))
    perm = np.empty(n, dtype=np.int64)
    ok = dissection_order(indptr, indices, degree > dense_limit, max(int(leaf), 1),
                          int(budget) * max(int(indices.shape[0]), n), perm)
    return perm if ok else None


@numba.njit(nogil=True, cache=True)
def dissection_order(indptr, indices, dense, leaf, budget, perm):
    """Fill ``perm`` with a nested-dissection order; False when ``budget`` edge visits did not do.

    ``dense[v]`` marks rows set aside (ordered last). Pieces are contiguous
    ranges of ``perm``, split in place into ``[left | right | separator]``
    and processed depth first from an explicit stack; ``owner[v]`` names the
    piece ``v`` is in while it is processed (``-1``: set aside, or in a
    separator already ordered).
    """
    n = indptr.shape[0] - 1
    owner = np.zeros(n, np.int64)
    level = np.zeros(n, np.int64)
    seen = np.zeros(n, np.int64)
    queue = np.empty(n, np.int64)
    side = np.zeros(n, np.int8)
    count = np.zeros(n + 1, np.int64)
    stack_lo = np.empty(n + 1, np.int64)
    stack_hi = np.empty(n + 1, np.int64)
    m = 0
    for v in range(n):  # the splittable vertices first, the dense ones last
        if not dense[v]:
            perm[m] = v
            m += 1
    tail = m
    for v in range(n):
        if dense[v]:
            perm[tail] = v
            owner[v] = -1
            tail += 1
    work = np.zeros(1, np.int64)
    stamp = np.zeros(1, np.int64)
    top = 0
    if m > 0:
        stack_lo[0], stack_hi[0] = 0, m
        top = 1
    piece = 0
    while top > 0:
        top -= 1
        lo, hi = stack_lo[top], stack_hi[top]
        size = hi - lo
        if size <= leaf:
            continue
        piece += 1
        for p in range(lo, hi):
            owner[perm[p]] = piece
        # A pseudo-peripheral root: the far end of a breadth-first pass, again
        # while that lengthens the eccentricity.
        root = perm[lo]
        reached, ecc = _bfs(indptr, indices, owner, piece, root, level, seen, queue, stamp, work)
        for _ in range(8):
            best, best_deg = -1, n + 1
            for q in range(reached - 1, -1, -1):
                v = queue[q]
                if level[v] != ecc:
                    break
                d = indptr[v + 1] - indptr[v]
                if d < best_deg:
                    best, best_deg = v, d
            r2, e2 = _bfs(indptr, indices, owner, piece, best, level, seen, queue, stamp, work)
            if e2 <= ecc:
                reached, ecc = _bfs(indptr, indices, owner, piece, root, level, seen, queue,
                                    stamp, work)
                break
            root, reached, ecc = best, r2, e2
        if work[0] > budget:
            return False
        if reached < size:  # not connected: the piece reached, and the rest
            k = reached
            for p in range(lo, hi):
                if seen[perm[p]] != stamp[0]:
                    queue[k] = perm[p]
                    k += 1
            for q in range(size):
                perm[lo + q] = queue[q]
            stack_lo[top], stack_hi[top] = lo, lo + reached
            stack_lo[top + 1], stack_hi[top + 1] = lo + reached, hi
            top += 2
            continue
        if ecc < 2:  # a clique: any order fills it completely
            continue
        # The separating level: the smallest of those leaving at least 30% of the
        # piece on each side, else the one where the running count passes half.
        for j in range(ecc + 1):
            count[j] = 0
        for q in range(reached):
            count[level[queue[q]]] += 1
        sep, sep_size, before, middle = -1, size + 1, 0, -1
        for j in range(ecc + 1):
            after = size - before - count[j]
            if middle < 0 and before + count[j] >= size // 2 and 0 < j < ecc:
                middle = j
            if 0 < j < ecc and 10 * before >= 3 * size and 10 * after >= 3 * size \
                    and count[j] < sep_size:
                sep, sep_size = j, count[j]
            before += count[j]
        if sep < 0:
            sep = middle if middle > 0 else 1
        # Sides: 0 left (levels below), 1 right, 2 separator. A separator vertex
        # with no neighbour above joins the left; then one with none on the left
        # joins the right.
        for q in range(reached):
            v = queue[q]
            side[v] = 0 if level[v] < sep else (1 if level[v] > sep else 2)
        for q in range(reached):
            v = queue[q]
            if side[v] == 2 and not _touches(indptr, indices, owner, piece, v, side, 1):
                side[v] = 0
        for q in range(reached):
            v = queue[q]
            if side[v] == 2 and not _touches(indptr, indices, owner, piece, v, side, 0):
                side[v] = 1
        k, mid, end = lo, lo, lo
        for s in range(3):
            for q in range(reached):
                v = queue[q]
                if side[v] == s:
                    perm[k] = v
                    k += 1
            if s == 0:
                mid = k
            elif s == 1:
                end = k
        for p in range(end, hi):
            owner[perm[p]] = -1
        stack_lo[top], stack_hi[top] = lo, mid
        stack_lo[top + 1], stack_hi[top + 1] = mid, end
        top += 2
    return True


@numba.njit(nogil=True, cache=True)
def _bfs(indptr, indices, owner, piece, root, level, seen, queue, stamp, work):
    """Breadth-first levels from ``root`` within piece ``piece``: (vertices reached, last level)."""
    stamp[0] += 1
    mark = stamp[0]
    seen[root] = mark
    level[root] = 0
    queue[0] = root
    head, tail = 0, 1
    while head < tail:
        v = queue[head]
        head += 1
        lv = level[v] + 1
        for p in range(indptr[v], indptr[v + 1]):
            w = indices[p]
            if seen[w] != mark and owner[w] == piece:
                seen[w] = mark
                level[w] = lv
                queue[tail] = w
                tail += 1
        work[0] += indptr[v + 1] - indptr[v]
    return tail, level[queue[tail - 1]]


@numba.njit(nogil=True, cache=True)
def _touches(indptr, indices, owner, piece, v, side, s):
    """Whether ``v`` has a neighbour in the piece on side ``s``."""
    for p in range(indptr[v], indptr[v + 1]):
        w = indices[p]
        if owner[w] == piece and w != v and side[w] == s:
            return True
    return False
