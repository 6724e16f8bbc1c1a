"""Numeric supernodal Cholesky factorisation and triangular solves (CPU only).

With the symbolic analysis of :mod:`managed_solve.kernels.cholesky_symbolic`
(once per pattern), :func:`factor` computes ``L`` with ``L L^T = P A P^T`` by
the multifrontal method: supernodes in postorder, each one's columns of A
scattered into its block, its children's update matrices added in
(extend-add), then a dense partial factorisation: ``potrf`` of the diagonal
block, ``trsm`` for the rows below, ``syrk`` for its own update matrix,
pushed on a stack its parent pops. Large blocks go to BLAS/LAPACK
(:mod:`managed_solve.kernels.blas`); small ones, where a call's overhead
exceeds the arithmetic, to loops here.

:func:`solve` does the forward and backward substitutions for a block of
right-hand sides (n x k, C order) in place, each supernode as a triangular
solve and a product over all k columns.

A pivot that is not positive (or not finite) stops the factorisation: the
matrix is not positive definite (to working precision) and the caller
factorises it another way.
"""

from __future__ import annotations

import numba
import numpy as np

from .blas import GEMM, POTRF, SYRK, TRSM, call, pointer

__all__ = ["factor", "solve"]

#: Blocks with fewer entries (rows x columns) are factorised by loops, not BLAS.
SMALL_BLOCK = 64
#: Supernodes whose work in a solve (rows x columns x right-hand sides) is below this use loops.
SMALL_SOLVE = 2048


@numba.njit(nogil=True, cache=True)
def _small_front(L, base, m, n, U, ubase):
    """Dense partial Cholesky of a small ``m x n`` block (column-major at ``L[base:]``), by loops.

    Returns 0, or the 1-based column whose pivot is not positive. The update
    ``-L21 L21^T`` is added into the ``u x u`` block at ``U[ubase:]``.
    """
    for j in range(n):
        cj = base + j * m
        d = L[cj + j]
        if not d > 0.0 or not np.isfinite(d):
            return j + 1
        d = np.sqrt(d)
        L[cj + j] = d
        for i in range(j + 1, m):
            L[cj + i] /= d
        for k in range(j + 1, n):
            ck = base + k * m
            ljk = L[cj + k]
            if ljk != 0.0:
                for i in range(k, m):
                    L[ck + i] -= L[cj + i] * ljk
    u = m - n
    for j in range(n):
        cj = base + j * m + n
        for k in range(u):
            lkj = L[cj + k]
            if lkj != 0.0:
                uk = ubase + k * u
                for i in range(k, u):
                    U[uk + i] -= L[cj + i] * lkj
    return 0


@numba.njit(nogil=True, cache=True)
def factor(first, row_ptr, sparent, value_ptr, rel, stack, col_ptr, source, target, data,
           L, blas):
    """Numeric factorisation into ``L`` (the values, laid out by ``value_ptr``).

    ``data`` are A's stored values (CSR order), ``source``/``target`` their
    map into the factor, the other arrays the symbolic analysis'. ``blas``
    are the addresses of :func:`managed_solve.kernels.blas.routines` for
    ``L``'s dtype. Returns 0, or the 1-based column (of ``P A P^T``) whose
    pivot was not positive or not finite.
    """
    ns = first.shape[0] - 1
    U = np.empty(max(stack, 1), L.dtype)
    uoff = np.zeros(ns, np.int64)
    head = np.full(ns, -1, np.int64)  # children lists, in increasing order
    sibling = np.full(ns, -1, np.int64)
    for s in range(ns - 1, -1, -1):
        p = sparent[s]
        if p != -1:
            sibling[s] = head[p]
            head[p] = s
    chars = np.array([ord("L"), ord("R"), ord("T"), ord("N")], np.uint8)
    ints = np.zeros(4, np.int32)
    scal = np.array([1.0, -1.0], L.dtype)
    top = 0
    for s in range(ns):
        f, l = first[s], first[s + 1]
        n = l - f
        m = row_ptr[s + 1] - row_ptr[s]
        u = m - n
        base = value_ptr[s]
        for t in range(base, base + m * n):
            L[t] = 0.0
        for j in range(f, l):
            for t in range(col_ptr[j], col_ptr[j + 1]):
                L[target[t]] += data[source[t]]
        # This supernode's update matrix goes above its children's, which sit
        # at the top of the stack in order; after the extend-add it moves down.
        c0 = head[s]
        below = uoff[c0] if c0 != -1 else top
        ubase = top
        for t in range(ubase, ubase + u * u):
            U[t] = 0.0
        c = c0
        while c != -1:
            uc = row_ptr[c + 1] - row_ptr[c] - (first[c + 1] - first[c])
            cb = uoff[c]
            r0 = row_ptr[c] + first[c + 1] - first[c]
            for jj in range(uc):
                cj = rel[r0 + jj]
                col = cb + jj * uc
                if cj < n:
                    dst = base + cj * m
                    for ii in range(jj, uc):
                        L[dst + rel[r0 + ii]] += U[col + ii]
                else:
                    dst = ubase + (cj - n) * u - n
                    for ii in range(jj, uc):
                        U[dst + rel[r0 + ii]] += U[col + ii]
            c = sibling[c]
        if m * n <= SMALL_BLOCK:
            info = _small_front(L, base, m, n, U, ubase)
            if info != 0:
                return f + info
        else:
            ints[0], ints[1], ints[2], ints[3] = n, m, u, 0
            call(blas[POTRF], (pointer(chars, 0), pointer(ints, 0), pointer(L, base),
                               pointer(ints, 1), pointer(ints, 3)))
            if ints[3] != 0:
                return f + ints[3]
            for j in range(n):  # LAPACK passes a NaN on the diagonal in some builds
                if not np.isfinite(L[base + j * m + j]):
                    return f + j + 1
            if u > 0:
                call(blas[TRSM], (pointer(chars, 1), pointer(chars, 0), pointer(chars, 2),
                                  pointer(chars, 3), pointer(ints, 2), pointer(ints, 0),
                                  pointer(scal, 0), pointer(L, base), pointer(ints, 1),
                                  pointer(L, base + n), pointer(ints, 1)))
                call(blas[SYRK], (pointer(chars, 0), pointer(chars, 3), pointer(ints, 2),
                                  pointer(ints, 0), pointer(scal, 1), pointer(L, base + n),
                                  pointer(ints, 1), pointer(scal, 0), pointer(U, ubase),
                                  pointer(ints, 2)))
        if below != ubase:
            for t in range(u * u):
                U[below + t] = U[ubase + t]
        uoff[s] = below
        top = below + u * u
        if sparent[s] == -1:
            top = below
    return 0


@numba.njit(nogil=True, cache=True)
def solve(first, row_ptr, rows, value_ptr, L, x, k, blas):
    """Overwrite ``x`` (an ``n x k`` block in C order, raveled; rows in the factor's order) with ``(L L^T)^-1 x``.

    A row-major ``n x k`` block is the column-major ``k x n`` block ``X^T``,
    so each supernode's substitutions are BLAS calls on the right:
    ``Y L11^-T`` and ``Y L21^T`` forward, ``Y - Z L21`` and ``Y L11^-1``
    backward, with ``Y`` its own rows of ``X^T``.
    """
    ns = first.shape[0] - 1
    width = 1
    for s in range(ns):
        width = max(width, row_ptr[s + 1] - row_ptr[s])
    W = np.empty(width * k, x.dtype)
    chars = np.array([ord("L"), ord("R"), ord("T"), ord("N")], np.uint8)
    ints = np.zeros(4, np.int32)
    scal = np.array([1.0, -1.0, 0.0], x.dtype)
    for s in range(ns):
        f, l = first[s], first[s + 1]
        n = l - f
        m = row_ptr[s + 1] - row_ptr[s]
        u = m - n
        base = value_ptr[s]
        r0 = row_ptr[s] + n
        if m * n * k <= SMALL_SOLVE:
            for j in range(n):
                cj = base + j * m
                d = L[cj + j]
                xj = (f + j) * k
                for c in range(k):
                    x[xj + c] /= d
                for i in range(j + 1, n):
                    lij = L[cj + i]
                    xi = (f + i) * k
                    for c in range(k):
                        x[xi + c] -= lij * x[xj + c]
                for i in range(u):
                    lij = L[cj + n + i]
                    xi = rows[r0 + i] * k
                    for c in range(k):
                        x[xi + c] -= lij * x[xj + c]
            continue
        ints[0], ints[1], ints[2], ints[3] = k, n, u, m
        call(blas[TRSM], (pointer(chars, 1), pointer(chars, 0), pointer(chars, 2),
                          pointer(chars, 3), pointer(ints, 0), pointer(ints, 1),
                          pointer(scal, 0), pointer(L, base), pointer(ints, 3),
                          pointer(x, f * k), pointer(ints, 0)))
        if u > 0:
            call(blas[GEMM], (pointer(chars, 3), pointer(chars, 2), pointer(ints, 0),
                              pointer(ints, 2), pointer(ints, 1), pointer(scal, 0),
                              pointer(x, f * k), pointer(ints, 0), pointer(L, base + n),
                              pointer(ints, 3), pointer(scal, 2), pointer(W, 0),
                              pointer(ints, 0)))
            for i in range(u):
                xi = rows[r0 + i] * k
                for c in range(k):
                    x[xi + c] -= W[i * k + c]
    for s in range(ns - 1, -1, -1):
        f, l = first[s], first[s + 1]
        n = l - f
        m = row_ptr[s + 1] - row_ptr[s]
        u = m - n
        base = value_ptr[s]
        r0 = row_ptr[s] + n
        if m * n * k <= SMALL_SOLVE:
            for j in range(n - 1, -1, -1):
                cj = base + j * m
                xj = (f + j) * k
                for i in range(u):
                    lij = L[cj + n + i]
                    xi = rows[r0 + i] * k
                    for c in range(k):
                        x[xj + c] -= lij * x[xi + c]
                for i in range(j + 1, n):
                    lij = L[cj + i]
                    xi = (f + i) * k
                    for c in range(k):
                        x[xj + c] -= lij * x[xi + c]
                d = L[cj + j]
                for c in range(k):
                    x[xj + c] /= d
            continue
        ints[0], ints[1], ints[2], ints[3] = k, n, u, m
        if u > 0:
            for i in range(u):
                xi = rows[r0 + i] * k
                for c in range(k):
                    W[i * k + c] = x[xi + c]
            call(blas[GEMM], (pointer(chars, 3), pointer(chars, 3), pointer(ints, 0),
                              pointer(ints, 1), pointer(ints, 2), pointer(scal, 1),
                              pointer(W, 0), pointer(ints, 0), pointer(L, base + n),
                              pointer(ints, 3), pointer(scal, 0), pointer(x, f * k),
                              pointer(ints, 0)))
        call(blas[TRSM], (pointer(chars, 1), pointer(chars, 0), pointer(chars, 3),
                          pointer(chars, 3), pointer(ints, 0), pointer(ints, 1),
                          pointer(scal, 0), pointer(L, base), pointer(ints, 3),
                          pointer(x, f * k), pointer(ints, 0)))
