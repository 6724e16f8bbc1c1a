"""The symbolic phase of a supernodal sparse Cholesky factorisation (CPU only).

Everything about ``L L^T = P A P^T`` that depends on A's pattern alone, done
once per pattern so that new values (:func:`managed_solve.kernels.cholesky.factor`)
cost only the numeric work:

1. the lower triangle of ``P A P^T`` by columns (each stored entry of either
   triangle counts: a pattern stored on one side only is symmetrised);
2. the elimination tree, and a postorder of it folded into the permutation
   (a postordered tree keeps every subtree a contiguous range of columns,
   which supernodes and the multifrontal stack need);
3. the column counts of L (Gilbert, Ng and Peyton's algorithm, in time
   nearly linear in A's entries, no pass over L's);
4. fundamental supernodes (columns with nested structure along a chain of
   the tree), merged with their parents while the explicit zeros this adds
   stay few (relaxed amalgamation, thresholds as CHOLMOD's): larger dense
   blocks for BLAS-3 at the cost of a little extra storage and work;
5. each supernode's row structure, where each child's update lands in its
   parent (the extend-add map), the multifrontal stack's peak, and where each
   of A's stored entries goes in the factor.

A supernode ``s`` holds columns ``first[s]:first[s + 1]`` and rows
``rows[row_ptr[s]:row_ptr[s + 1]]`` (its own columns first, then the rows
below, ascending); its values are the column-major ``m x n`` block at
``value_ptr[s]`` of the factor's value array.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["analyse", "elimination_tree", "postorder", "column_counts"]

# Relaxed amalgamation (CHOLMOD's defaults): a merged supernode of at most
# RELAX[i] columns is kept when its explicit zeros are below ZEROS[i] of its
# entries; any merge that adds no zeros is kept.
RELAX = (4, 16, 48)
ZEROS = (0.8, 0.1, 0.05)


@numba.njit(nogil=True, cache=True)
def lower_pattern(indptr, indices, inverse):
    """Columns of the strict lower triangle of ``P A P^T``: ``(colptr, rowidx)``, rows unsorted.

    ``inverse[v]`` is the new index of A's row ``v``. Both ``(i, j)`` and
    ``(j, i)`` of a stored entry give ``(max, min)``, so an entry stored on
    both sides appears twice (the algorithms below tolerate duplicates).
    """
    n = indptr.shape[0] - 1
    count = np.zeros(n + 1, np.int64)
    for r in range(n):
        for p in range(indptr[r], indptr[r + 1]):
            i, j = inverse[r], inverse[indices[p]]
            if i != j:
                count[min(i, j) + 1] += 1
    for j in range(n):
        count[j + 1] += count[j]
    rowidx = np.empty(count[n], np.int64)
    fill = count[:n].copy()
    for r in range(n):
        for p in range(indptr[r], indptr[r + 1]):
            i, j = inverse[r], inverse[indices[p]]
            if i != j:
                lo = min(i, j)
                rowidx[fill[lo]] = max(i, j)
                fill[lo] += 1
    return count, rowidx


@numba.njit(nogil=True, cache=True)
def elimination_tree(colptr, rowidx, n):
    """Parent of each column in the elimination tree of the lower pattern (``-1``: a root).

    Liu's algorithm with path compression, reading the pattern by rows: the
    strict lower pattern by columns is the strict upper one by rows.
    """
    parent = np.full(n, -1, np.int64)
    ancestor = np.full(n, -1, np.int64)
    # Row k of the lower triangle: the columns j < k with (k, j) stored.
    rptr = np.zeros(n + 1, np.int64)
    for p in range(colptr[n]):
        rptr[rowidx[p] + 1] += 1
    for k in range(n):
        rptr[k + 1] += rptr[k]
    rcol = np.empty(colptr[n], np.int64)
    fill = rptr[:n].copy()
    for j in range(n):
        for p in range(colptr[j], colptr[j + 1]):
            rcol[fill[rowidx[p]]] = j
            fill[rowidx[p]] += 1
    for k in range(n):
        for p in range(rptr[k], rptr[k + 1]):
            i = rcol[p]
            while i != -1 and i < k:
                nxt = ancestor[i]
                ancestor[i] = k
                if nxt == -1:
                    parent[i] = k
                i = nxt
    return parent


@numba.njit(nogil=True, cache=True)
def postorder(parent):
    """``post[k]``: the k-th column of a depth-first postorder of the forest ``parent``.

    Children are visited in increasing order, so a tree already postordered
    (``parent[j] > j`` and subtrees contiguous) gives the identity.
    """
    n = parent.shape[0]
    head = np.full(n, -1, np.int64)
    nxt = np.full(n, -1, np.int64)
    for j in range(n - 1, -1, -1):  # children lists in increasing order
        p = parent[j]
        if p != -1:
            nxt[j] = head[p]
            head[p] = j
    post = np.empty(n, np.int64)
    stack = np.empty(n, np.int64)
    k = 0
    for root in range(n):
        if parent[root] != -1:
            continue
        top = 0
        stack[0] = root
        while top >= 0:
            v = stack[top]
            c = head[v]
            if c == -1:
                post[k] = v
                k += 1
                top -= 1
            else:
                head[v] = nxt[c]
                top += 1
                stack[top] = c
    return post


@numba.njit(nogil=True, cache=True)
def column_counts(colptr, rowidx, parent):
    """Entries of each column of L, the diagonal included, for a postordered tree.

    Gilbert, Ng and Peyton: column j's count is the number of row subtrees
    it lies in; each row's subtree is found from its leaves (the columns
    where the row first appears in a subtree) with a disjoint-set ancestor.
    """
    n = parent.shape[0]
    first = np.full(n, -1, np.int64)
    delta = np.zeros(n, np.int64)
    for k in range(n):  # postorder is the identity: first descendant of each column
        j = k
        delta[j] = 1 if first[j] == -1 else 0
        while j != -1 and first[j] == -1:
            first[j] = k
            j = parent[j]
    ancestor = np.arange(n)
    maxfirst = np.full(n, -1, np.int64)
    prevleaf = np.full(n, -1, np.int64)
    for j in range(n):
        if parent[j] != -1:
            delta[parent[j]] -= 1
        for p in range(colptr[j], colptr[j + 1]):
            i = rowidx[p]
            if first[j] <= maxfirst[i]:  # j is not a leaf of row i's subtree
                continue
            maxfirst[i] = first[j]
            jprev = prevleaf[i]
            prevleaf[i] = j
            delta[j] += 1
            if jprev != -1:  # the least common ancestor of jprev and j loses one
                q = jprev
                while q != ancestor[q]:
                    q = ancestor[q]
                s = jprev
                while s != q:
                    up = ancestor[s]
                    ancestor[s] = q
                    s = up
                delta[q] -= 1
        if parent[j] != -1:
            ancestor[j] = parent[j]
    for j in range(n):
        if parent[j] != -1:
            delta[parent[j]] += delta[j]
    return delta


@numba.njit(nogil=True, cache=True)
def supernodes(parent, counts, relax, zeros):
    """First columns of the relaxed supernodes (``first``, with ``n`` appended)."""
    n = parent.shape[0]
    children = np.zeros(n, np.int64)
    for j in range(n):
        if parent[j] != -1:
            children[parent[j]] += 1
    # Fundamental supernodes: j + 1 joins j's when it is j's parent, its only
    # child, and its column is j's less the diagonal.
    fstart = np.empty(n + 1, np.int64)
    nf = 0
    for j in range(n):
        if j == 0 or not (parent[j - 1] == j and children[j] == 1
                          and counts[j - 1] == counts[j] + 1):
            fstart[nf] = j
            nf += 1
    fstart[nf] = n
    of = np.empty(n, np.int64)
    for s in range(nf):
        for j in range(fstart[s], fstart[s + 1]):
            of[j] = s
    ncols = np.empty(nf, np.int64)
    nrows = np.empty(nf, np.int64)
    nzeros = np.zeros(nf, np.float64)
    sparent = np.full(nf, -1, np.int64)
    top = np.arange(nf)  # the supernode whose group each one is merged into
    group_first = np.arange(nf)
    for s in range(nf):
        ncols[s] = fstart[s + 1] - fstart[s]
        nrows[s] = counts[fstart[s]]
        last = fstart[s + 1] - 1
        if parent[last] != -1:
            sparent[s] = of[parent[last]]
    # Merge from the roots down, each supernode into its parent's group when
    # that group starts right after it (then the merged columns are contiguous).
    for s in range(nf - 2, -1, -1):
        p = sparent[s]
        if p == -1:
            continue
        t = top[p]
        if group_first[t] != s + 1:
            continue
        nc = ncols[t] + ncols[s]
        m = ncols[s] + nrows[t]
        extra = ncols[s] * (ncols[s] + nrows[t] - nrows[s])
        total_zeros = nzeros[s] + nzeros[t] + extra
        entries = nc * m - nc * (nc - 1) / 2
        frac = total_zeros / entries
        merge = extra == 0 or nc <= relax[0] or (nc <= relax[1] and frac < zeros[0]) \
            or (nc <= relax[2] and frac < zeros[1]) or frac < zeros[2]
        if merge:
            top[s] = t
            group_first[t] = s
            ncols[t] = nc
            nrows[t] = m
            nzeros[t] = total_zeros
    first = np.empty(nf + 1, np.int64)
    k = 0
    for s in range(nf):
        if s == 0 or top[s] != top[s - 1]:
            first[k] = fstart[s]
            k += 1
    first[k] = n
    return first[:k + 1].copy()


@numba.njit(nogil=True, cache=True)
def structure(first, colptr, rowidx, parent):
    """Row structure of each supernode: ``(row_ptr, rows, sparent)``, rows ascending."""
    ns = first.shape[0] - 1
    n = parent.shape[0]
    of = np.empty(n, np.int64)
    for s in range(ns):
        for j in range(first[s], first[s + 1]):
            of[j] = s
    sparent = np.full(ns, -1, np.int64)
    for s in range(ns):
        last = first[s + 1] - 1
        if parent[last] != -1:
            sparent[s] = of[parent[last]]
    # Children lists, for gathering their rows into the parent's.
    head = np.full(ns, -1, np.int64)
    nxt = np.full(ns, -1, np.int64)
    for s in range(ns - 1, -1, -1):
        p = sparent[s]
        if p != -1:
            nxt[s] = head[p]
            head[p] = s
    mark = np.full(n, -1, np.int64)
    capacity = max(colptr[n] + n, 16)
    rows = np.empty(capacity, np.int64)
    row_ptr = np.zeros(ns + 1, np.int64)
    for s in range(ns):
        f, l = first[s], first[s + 1]
        start = row_ptr[s]
        # Children first (their rows below l are all ancestors of them),
        # then A's own entries below l.
        need = start + (l - f)
        c = head[s]
        while c != -1:
            need += row_ptr[c + 1] - row_ptr[c]
            c = nxt[c]
        for j in range(f, l):
            need += colptr[j + 1] - colptr[j]
        if need > rows.shape[0]:
            grown = np.empty(max(need, 2 * rows.shape[0]), np.int64)
            grown[:start] = rows[:start]
            rows = grown
        k = start
        for j in range(f, l):
            rows[k] = j
            k += 1
        below = k
        c = head[s]
        while c != -1:
            for p in range(row_ptr[c], row_ptr[c + 1]):
                i = rows[p]
                if i >= l and mark[i] != s:
                    mark[i] = s
                    rows[k] = i
                    k += 1
            c = nxt[c]
        for j in range(f, l):
            for p in range(colptr[j], colptr[j + 1]):
                i = rowidx[p]
                if i >= l and mark[i] != s:
                    mark[i] = s
                    rows[k] = i
                    k += 1
        rows[below:k].sort()
        row_ptr[s + 1] = k
    return row_ptr, rows[:row_ptr[ns]].copy(), sparent


@numba.njit(nogil=True, cache=True)
def placement(first, row_ptr, rows, sparent, indptr, indices, inverse):
    """Where values go: the factor's layout, the extend-add map, the stack peak, A's entries.

    Returns ``value_ptr`` (offset of each supernode's block), ``rel`` (for
    supernode ``c``, ``rel[row_ptr[c] + t]`` is the position in its parent's
    rows of its t-th row below its columns; ``-1`` for its own columns),
    ``stack`` (the multifrontal stack's peak, in entries), ``col_ptr``,
    ``source`` and ``target`` (column j's entries of A are
    ``data[source[col_ptr[j]:col_ptr[j + 1]]]``, landing at ``target``).
    """
    ns = first.shape[0] - 1
    n = indptr.shape[0] - 1
    value_ptr = np.zeros(ns + 1, np.int64)
    for s in range(ns):
        m = row_ptr[s + 1] - row_ptr[s]
        value_ptr[s + 1] = value_ptr[s] + m * (first[s + 1] - first[s])
    pos = np.empty(n, np.int64)
    rel = np.full(row_ptr[ns], -1, np.int64)
    for c in range(ns):
        p = sparent[c]
        if p == -1:
            continue
        for t in range(row_ptr[p], row_ptr[p + 1]):
            pos[rows[t]] = t - row_ptr[p]
        ncol = first[c + 1] - first[c]
        for t in range(row_ptr[c] + ncol, row_ptr[c + 1]):
            rel[t] = pos[rows[t]]
    # The multifrontal stack: a supernode's update matrix (u x u, u the rows
    # below its columns) is pushed above its children's, which are then
    # popped, and it moves down into their place.
    used, peak = 0, 0
    child_sum = np.zeros(ns, np.int64)
    for s in range(ns):
        u = row_ptr[s + 1] - row_ptr[s] - (first[s + 1] - first[s])
        peak = max(peak, used + u * u)
        used += u * u - child_sum[s]
        if sparent[s] != -1:
            child_sum[sparent[s]] += u * u
        else:
            used -= u * u
    # A's entries on or below the diagonal of P A P^T, by column of the factor.
    col_ptr = np.zeros(n + 1, np.int64)
    for r in range(n):
        for q in range(indptr[r], indptr[r + 1]):
            i, j = inverse[r], inverse[indices[q]]
            if i >= j:
                col_ptr[j + 1] += 1
    for j in range(n):
        col_ptr[j + 1] += col_ptr[j]
    source = np.empty(col_ptr[n], np.int64)
    target = np.empty(col_ptr[n], np.int64)
    fill = col_ptr[:n].copy()
    for r in range(n):
        for q in range(indptr[r], indptr[r + 1]):
            i, j = inverse[r], inverse[indices[q]]
            if i >= j:
                source[fill[j]] = q
                target[fill[j]] = i  # the row, for now
                fill[j] += 1
    for s in range(ns):
        m = row_ptr[s + 1] - row_ptr[s]
        for t in range(row_ptr[s], row_ptr[s + 1]):
            pos[rows[t]] = t - row_ptr[s]
        for j in range(first[s], first[s + 1]):
            base = value_ptr[s] + (j - first[s]) * m
            for t in range(col_ptr[j], col_ptr[j + 1]):
                target[t] = base + pos[target[t]]
    return value_ptr, rel, peak, col_ptr, source, target


def analyse(indptr: np.ndarray, indices: np.ndarray, perm: np.ndarray) -> dict:
    """The symbolic factorisation of the symmetric pattern ``(indptr, indices)`` ordered by ``perm``.

    Parameters
    ----------
    indptr, indices : ndarray
        A CSR pattern (both triangles, or either: it is symmetrised).
    perm : ndarray
        A fill-reducing order (``perm[k]``: the row placed k-th); it is
        refined by the elimination tree's postorder.

    Returns
    -------
    dict
        ``perm`` (the final order), ``first``, ``row_ptr``, ``rows``,
        ``sparent``, ``value_ptr``, ``rel``, ``stack``, ``col_ptr``,
        ``source``, ``target`` (see the module docstring and
        :func:`placement`), ``n`` and ``nnz`` (stored factor entries).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(6, 6)).tocsr()
    >>> sym = analyse(A.indptr, A.indices, np.arange(6))
    >>> sym["first"].tolist()  # small supernodes merge: one dense block of 6 columns
    [0, 6]
    >>> int(sym["nnz"])
    36
    """
    n = int(indptr.shape[0]) - 1
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    perm = np.asarray(perm, dtype=np.int64)
    inverse = np.empty(n, np.int64)
    inverse[perm] = np.arange(n)
    colptr, rowidx = lower_pattern(indptr, indices, inverse)
    post = postorder(elimination_tree(colptr, rowidx, n))
    if not np.array_equal(post, np.arange(n)):
        perm = perm[post]
        inverse[perm] = np.arange(n)
        colptr, rowidx = lower_pattern(indptr, indices, inverse)
    parent = elimination_tree(colptr, rowidx, n)
    counts = column_counts(colptr, rowidx, parent)
    first = supernodes(parent, counts, np.array(RELAX, np.int64), np.array(ZEROS))
    row_ptr, rows, sparent = structure(first, colptr, rowidx, parent)
    value_ptr, rel, stack, col_ptr, source, target = placement(
        first, row_ptr, rows, sparent, indptr, indices, inverse)
    return {"n": n, "perm": perm, "first": first, "row_ptr": row_ptr, "rows": rows,
            "sparent": sparent, "value_ptr": value_ptr, "rel": rel, "stack": int(stack),
            "col_ptr": col_ptr, "source": source, "target": target,
            "nnz": int(value_ptr[-1])}
