"""Batched Krylov kernels on the CPU: CG and BiCGStab over a block-diagonal CSR (and GMRES's host half).

The CPU twins of the fused CUDA kernels in
``managed_solve/solvers/batched/cg_bicgstab.cu``. Every system ``s`` owns the rows
``offsets[s]:offsets[s+1]`` of one block-diagonal CSR (column indices are
global), its own scalars and its own stopping rule
``||r_s|| <= max(rtol_s * ||b_s||, atol_s)`` (SciPy's rule).

Two layouts, chosen by the caller:

- ``*_some``: systems one after another, each system's rows serially,
  without the GIL. Host threads each run it on the systems they claim, so
  many systems keep every core busy with no thread start or barrier while
  they iterate.
- ``*_rows``: one system, ``prange`` over rows with reductions, three (CG)
  or five (BiCGStab) parallel sweeps per iteration, each ending at a
  barrier. Only worth its thread starts for large systems on idle cores.

Status codes: 0 converged, 1 maxiter, 2 breakdown. Scalars (alpha, beta,
rho, omega and every dot product) are accumulated in float64 whatever the
vector dtype, so float32 systems lose precision only in the stored vectors.

Preconditioning: ``dinv`` is the inverse diagonal (Jacobi) or an empty array
for none; without it the caller passes ``z`` aliased to ``r`` (CG) or to
``p`` (BiCGStab), so no extra vector is touched.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

__all__ = [
    "bicgstab_rows",
    "bicgstab_some",
    "cg_rows",
    "cg_some",
    "back_substitute",
    "gmres_coefficients",
    "givens_columns",
    "gmres_some",
    "rotate_column",
    "row_product",
]


# ---------------------------------------------------------------------------
# Per-element math shared by both layouts (plain njit: callable from either).


@numba.njit(cache=True, inline="always")
def row_product(indptr, indices, data, v, i):
    """``(A v)_i`` for CSR row ``i``, accumulated in float64.

    Indices go through unsigned integers: Numba then drops its check for
    negative (wrap-around) indices, the larger part of this loop's cost,
    which brings it to the speed of SciPy's C SpMV.
    """
    acc = 0.0
    for j in range(np.uint64(indptr[i]), np.uint64(indptr[i + 1])):
        acc += data[j] * v[np.uint64(indices[j])]
    return acc


@numba.njit(cache=True, inline="always")
def precondition(dinv, v, i):
    """``(M^-1 v)_i`` for Jacobi, or ``v_i`` when ``dinv`` is empty."""
    if dinv.shape[0] > 0:
        return dinv[i] * v[i]
    return v[i] * 1.0


@numba.njit(cache=True, inline="always")
def residual_sums(lo, hi, indptr, indices, data, b, x):
    """``(||b - A x||^2, ||b||^2)`` over rows ``lo:hi``, in float64 throughout.

    The true residual of a system just solved, while its rows are still in
    cache (the check the verify rule reads). Each product is formed in
    float64 (exact for float32 values), not in the system's dtype: a
    float32 product's rounding would blur a residual below it.
    """
    rr = 0.0
    bb = 0.0
    for i in range(np.uint64(lo), np.uint64(hi)):
        bi = np.float64(b[i])
        acc = 0.0
        for j in range(np.uint64(indptr[i]), np.uint64(indptr[i + 1])):
            acc += np.float64(data[j]) * np.float64(x[np.uint64(indices[j])])
        ri = bi - acc
        rr += ri * ri
        bb += bi * bi
    return rr, bb


@numba.njit(cache=True)
def stop_tolerance2(bb, rtol, atol):
    """Squared stopping tolerance ``max(rtol * ||b||, atol)**2`` (SciPy's rule)."""
    tol = max(rtol * math.sqrt(bb), atol)
    return tol * tol


@numba.njit(cache=True)
def cg_initial_status(rr, tol2, rz, maxiter):
    """Status before the first CG iteration: -1 running, else 0/1/2."""
    if rr <= tol2:
        return 0
    if maxiter <= 0:
        return 1
    if rz == 0.0 or not math.isfinite(rz):
        return 2
    return -1


# ---------------------------------------------------------------------------
# CG


@numba.njit(cache=True)
def _cg_segment(lo, hi, indptr, indices, data, b, x, dinv, r, z, p, q,
                rtol, atol, maxiter, has_x0):
    """Serial preconditioned CG on rows ``lo:hi``; returns (iterations, rr, status)."""
    bb = 0.0
    rr = 0.0
    rz = 0.0
    for i in range(np.uint64(lo), np.uint64(hi)):
        bi = b[i] * 1.0
        bb += bi * bi
        ri = bi - row_product(indptr, indices, data, x, i) if has_x0 else bi
        r[i] = ri
        zi = precondition(dinv, r, i)
        z[i] = zi
        p[i] = zi
        rr += ri * ri
        rz += ri * zi
    if bb == 0.0:  # b = 0: x = 0 is the exact answer (SciPy returns b)
        for i in range(np.uint64(lo), np.uint64(hi)):
            x[i] = 0.0
        return 0, 0.0, 0
    tol2 = stop_tolerance2(bb, rtol, atol)
    it = 0
    while True:
        st = cg_initial_status(rr, tol2, rz, maxiter - it)
        if st >= 0:
            return it, rr, st
        pq = 0.0
        for i in range(np.uint64(lo), np.uint64(hi)):
            qi = row_product(indptr, indices, data, p, i)
            q[i] = qi
            pq += p[i] * qi
        if not pq > 0.0:  # indefinite (or NaN): CG cannot go on
            return it, rr, 2
        alpha = rz / pq
        rr = 0.0
        rz_new = 0.0
        for i in range(np.uint64(lo), np.uint64(hi)):
            x[i] += alpha * p[i]
            ri = r[i] - alpha * q[i]
            r[i] = ri
            zi = precondition(dinv, r, i)
            z[i] = zi
            rr += ri * ri
            rz_new += ri * zi
        beta = rz_new / rz
        rz = rz_new
        for i in range(np.uint64(lo), np.uint64(hi)):
            p[i] = z[i] + beta * p[i]
        it += 1


@numba.njit(nogil=True, cache=True)
def cg_some(order, start, stop, indptr, indices, data, b, x, dinv, r, z, p, q, offsets,
            rtol, atol, maxiter, has_x0, out_iterations, out_rr, out_status, out_true, out_bb):
    """CG on systems ``order[start:stop]`` of a packed batch, one after another.

    Serial and without the GIL: host threads each call it on the systems
    they claim (:mod:`managed_solve.solvers.batched.cpu`). Besides the
    recurrence's ``out_rr``, each system's true ``||b - A x||^2`` and
    ``||b||^2`` go to ``out_true`` and ``out_bb`` (:func:`residual_sums`).
    """
    for k in range(start, stop):
        s = order[k]
        lo, hi = offsets[s], offsets[s + 1]
        it, rr, st = _cg_segment(lo, hi, indptr, indices, data, b, x,
                                 dinv, r, z, p, q, rtol[s], atol[s], maxiter[s], has_x0)
        out_iterations[s] = it
        out_rr[s] = rr
        out_status[s] = st
        out_true[s], out_bb[s] = residual_sums(lo, hi, indptr, indices, data, b, x)


@numba.njit(parallel=True, cache=True)
def cg_rows(indptr, indices, data, b, x, dinv, r, z, p, q, rtol, atol, maxiter, has_x0):
    """CG on one system, each sweep parallel over rows; returns (iterations, rr, status)."""
    n = b.shape[0]
    bb = 0.0
    rr = 0.0
    rz = 0.0
    for i in prange(n):
        bi = b[i] * 1.0
        ri = bi - row_product(indptr, indices, data, x, i) if has_x0 else bi
        r[i] = ri
        zi = precondition(dinv, r, i)
        z[i] = zi
        p[i] = zi
        bb += bi * bi
        rr += ri * ri
        rz += ri * zi
    if bb == 0.0:
        for i in prange(n):
            x[i] = 0.0
        return 0, 0.0, 0
    tol2 = stop_tolerance2(bb, rtol, atol)
    it = 0
    while True:
        st = cg_initial_status(rr, tol2, rz, maxiter - it)
        if st >= 0:
            return it, rr, st
        pq = 0.0
        for i in prange(n):
            qi = row_product(indptr, indices, data, p, i)
            q[i] = qi
            pq += p[i] * qi
        if not pq > 0.0:
            return it, rr, 2
        alpha = rz / pq
        rr = 0.0
        rz_new = 0.0
        for i in prange(n):
            x[i] += alpha * p[i]
            ri = r[i] - alpha * q[i]
            r[i] = ri
            zi = precondition(dinv, r, i)
            z[i] = zi
            rr += ri * ri
            rz_new += ri * zi
        beta = rz_new / rz
        rz = rz_new
        for i in prange(n):
            p[i] = z[i] + beta * p[i]
        it += 1


# ---------------------------------------------------------------------------
# BiCGStab (the same iterates as scipy.sparse.linalg.bicgstab, right-preconditioned)


@numba.njit(cache=True)
def _bicgstab_segment(lo, hi, indptr, indices, data, b, x, dinv, r, rt, p, v, t, z,
                      rtol, atol, maxiter, has_x0):
    """Serial BiCGStab on rows ``lo:hi``; returns (iterations, rr, status).

    ``z`` holds p-hat, then s-hat (Jacobi); without Jacobi it aliases ``p`` and
    s-hat is ``r`` itself (s overwrites r in place, as SciPy's ``s[:] = r``).
    """
    jac = dinv.shape[0] > 0
    bb = 0.0
    rr = 0.0
    for i in range(np.uint64(lo), np.uint64(hi)):
        bi = b[i] * 1.0
        bb += bi * bi
        ri = bi - row_product(indptr, indices, data, x, i) if has_x0 else bi
        r[i] = ri
        rt[i] = ri
        rr += ri * ri
    if bb == 0.0:
        for i in range(np.uint64(lo), np.uint64(hi)):
            x[i] = 0.0
        return 0, 0.0, 0
    tol2 = stop_tolerance2(bb, rtol, atol)
    rho = rr  # rt . r with rt = r
    rho_prev = 1.0
    alpha = 1.0
    omega = 1.0
    it = 0
    while True:
        if rr <= tol2:
            return it, rr, 0
        if it >= maxiter:
            return it, rr, 1
        if rho == 0.0 or not math.isfinite(rho):
            return it, rr, 2
        if it > 0:
            if omega == 0.0:
                return it, rr, 2
            beta = (rho / rho_prev) * (alpha / omega)
            for i in range(np.uint64(lo), np.uint64(hi)):
                pi = r[i] + beta * (p[i] - omega * v[i])
                p[i] = pi
                if jac:
                    z[i] = dinv[i] * pi
        else:
            for i in range(np.uint64(lo), np.uint64(hi)):
                p[i] = r[i]
                if jac:
                    z[i] = dinv[i] * r[i]
        rv = 0.0
        for i in range(np.uint64(lo), np.uint64(hi)):
            vi = row_product(indptr, indices, data, z, i)
            v[i] = vi
            rv += rt[i] * vi
        if rv == 0.0 or not math.isfinite(rv):
            return it, rr, 2
        alpha = rho / rv
        ss = 0.0
        for i in range(np.uint64(lo), np.uint64(hi)):
            x[i] += alpha * z[i]
            si = r[i] - alpha * v[i]
            r[i] = si
            ss += si * si
            if jac:
                z[i] = dinv[i] * si
        if ss <= tol2:  # converged at the half step (SciPy stops here too)
            return it + 1, ss, 0
        tt = 0.0
        ts = 0.0
        for i in range(np.uint64(lo), np.uint64(hi)):
            if jac:
                ti = row_product(indptr, indices, data, z, i)
            else:
                ti = row_product(indptr, indices, data, r, i)
            t[i] = ti
            tt += ti * ti
            ts += ti * r[i]
        if tt == 0.0 or not math.isfinite(tt):
            return it + 1, ss, 2
        omega = ts / tt
        rr = 0.0
        rho_prev = rho
        rho = 0.0
        for i in range(np.uint64(lo), np.uint64(hi)):
            if jac:
                x[i] += omega * z[i]
            else:
                x[i] += omega * r[i]
            ri = r[i] - omega * t[i]
            r[i] = ri
            rr += ri * ri
            rho += rt[i] * ri
        it += 1


@numba.njit(nogil=True, cache=True)
def bicgstab_some(order, start, stop, indptr, indices, data, b, x, dinv, r, rt, p, v, t, z,
                  offsets, rtol, atol, maxiter, has_x0, out_iterations, out_rr, out_status,
                  out_true, out_bb):
    """BiCGStab on systems ``order[start:stop]`` of a packed batch (serial, without the GIL).

    The true residual sums as in :func:`cg_some`.
    """
    for k in range(start, stop):
        s = order[k]
        lo, hi = offsets[s], offsets[s + 1]
        it, rr, st = _bicgstab_segment(lo, hi, indptr, indices, data, b, x,
                                       dinv, r, rt, p, v, t, z, rtol[s], atol[s], maxiter[s],
                                       has_x0)
        out_iterations[s] = it
        out_rr[s] = rr
        out_status[s] = st
        out_true[s], out_bb[s] = residual_sums(lo, hi, indptr, indices, data, b, x)


@numba.njit(parallel=True, cache=True)
def bicgstab_rows(indptr, indices, data, b, x, dinv, r, rt, p, v, t, z,
                  rtol, atol, maxiter, has_x0):
    """BiCGStab on one system, each sweep parallel over rows; returns (iterations, rr, status)."""
    n = b.shape[0]
    jac = dinv.shape[0] > 0
    bb = 0.0
    rr = 0.0
    for i in prange(n):
        bi = b[i] * 1.0
        ri = bi - row_product(indptr, indices, data, x, i) if has_x0 else bi
        r[i] = ri
        rt[i] = ri
        bb += bi * bi
        rr += ri * ri
    if bb == 0.0:
        for i in prange(n):
            x[i] = 0.0
        return 0, 0.0, 0
    tol2 = stop_tolerance2(bb, rtol, atol)
    rho = rr
    rho_prev = 1.0
    alpha = 1.0
    omega = 1.0
    it = 0
    while True:
        if rr <= tol2:
            return it, rr, 0
        if it >= maxiter:
            return it, rr, 1
        if rho == 0.0 or not math.isfinite(rho):
            return it, rr, 2
        beta = 0.0
        if it > 0:
            if omega == 0.0:
                return it, rr, 2
            beta = (rho / rho_prev) * (alpha / omega)
        for i in prange(n):
            pi = r[i] + beta * (p[i] - omega * v[i]) if it > 0 else r[i] * 1.0
            p[i] = pi
            if jac:
                z[i] = dinv[i] * pi
        rv = 0.0
        for i in prange(n):
            vi = row_product(indptr, indices, data, z, i)
            v[i] = vi
            rv += rt[i] * vi
        if rv == 0.0 or not math.isfinite(rv):
            return it, rr, 2
        alpha = rho / rv
        ss = 0.0
        for i in prange(n):
            x[i] += alpha * z[i]
            si = r[i] - alpha * v[i]
            r[i] = si
            ss += si * si
            if jac:
                z[i] = dinv[i] * si
        if ss <= tol2:
            return it + 1, ss, 0
        tt = 0.0
        ts = 0.0
        for i in prange(n):
            if jac:
                ti = row_product(indptr, indices, data, z, i)
            else:
                ti = row_product(indptr, indices, data, r, i)
            t[i] = ti
            tt += ti * ti
            ts += ti * r[i]
        if tt == 0.0 or not math.isfinite(tt):
            return it + 1, ss, 2
        omega = ts / tt
        rr = 0.0
        rho_prev = rho
        rho = 0.0
        for i in prange(n):
            if jac:
                x[i] += omega * z[i]
            else:
                x[i] += omega * r[i]
            ri = r[i] - omega * t[i]
            r[i] = ri
            rr += ri * ri
            rho += rt[i] * ri
        it += 1


def empty_dinv(dtype) -> np.ndarray:
    """The "no preconditioner" marker: an empty array of the vector dtype."""
    return np.empty(0, dtype=dtype)


# ---------------------------------------------------------------------------
# Batched GMRES: the host half (see ``managed_solve.solvers.batched.gmres.BatchedGmres``).
# The Arnoldi process runs on the batch's device; these turn each system's new
# Hessenberg columns into its triangular factor (Givens rotations) and, at the
# end of a restart cycle, its least-squares coefficients. A loop over systems
# here costs microseconds where NumPy over systems would launch O(restart)
# array operations per column.


@numba.njit(cache=True, inline="always")
def rotate_column(h, j, R, cs, sn, g):
    """Apply the previous rotations to Hessenberg column ``h`` (length j+2), add the new one.

    Writes column ``j`` of the triangular factor ``R`` and updates ``g``;
    returns the residual estimate ``|g[j+1]|``.
    """
    for i in range(j):
        t = cs[i] * h[i] + sn[i] * h[i + 1]
        h[i + 1] = -sn[i] * h[i] + cs[i] * h[i + 1]
        h[i] = t
    rr = math.hypot(h[j], h[j + 1])
    if rr == 0.0:
        cj, sj = 1.0, 0.0
    else:
        cj, sj = h[j] / rr, h[j + 1] / rr
    cs[j] = cj
    sn[j] = sj
    for i in range(j):
        R[i, j] = h[i]
    R[j, j] = rr
    gj = g[j]
    g[j + 1] = -sj * gj
    g[j] = cj * gj
    return abs(g[j + 1])


@numba.njit(cache=True, inline="always")
def back_substitute(R, g, k, y):
    """``y[:k] = R[:k, :k]^-1 g[:k]``, the rest zero; cut at a vanishing diagonal.

    A vanishing diagonal (the basis stalled) cuts the system to its leading
    well-posed part, as a least-squares solve would.
    """
    ks = 0
    while ks < k and abs(R[ks, ks]) > 1e-300:
        ks += 1
    for i in range(ks, y.shape[0]):
        y[i] = 0.0
    for i in range(ks - 1, -1, -1):
        acc = g[i]
        for j in range(i + 1, ks):
            acc -= R[i, j] * y[j]
        y[i] = acc / R[i, i]


@numba.njit(nogil=True, cache=True)  # called by GPU workers: other threads run meanwhile
def givens_columns(H, R, cs, sn, g, j0, est):
    """Rotate new Hessenberg columns ``j0..j0+c-1`` of every system into ``R`` and ``g``.

    ``H[s, :j+2, c]`` holds column ``j = j0 + c`` of system ``s`` (float64);
    ``R`` (nsys, m, m), ``cs``, ``sn`` (nsys, m) and ``g`` (nsys, m + 1) carry
    the factorisation from column to column. ``est[s, c]`` receives the
    residual estimate ``|g[j+1]|`` after column ``j``.
    """
    nsys, rows, ncol = H.shape
    h = np.empty(rows)
    for s in range(nsys):
        for c in range(ncol):
            j = j0 + c
            for i in range(j + 2):
                h[i] = H[s, i, c]
            est[s, c] = rotate_column(h, j, R[s], cs[s], sn[s], g[s])


@numba.njit(nogil=True, cache=True)  # called by GPU workers: other threads run meanwhile
def gmres_coefficients(R, g, k, y):
    """``y[s, :k[s]]`` solving ``R[s, :k, :k] y = g[s, :k]`` for every system; the rest zero."""
    for s in range(y.shape[0]):
        back_substitute(R[s], g[s], k[s], y[s])


@numba.njit(cache=True)
def _local_product(indptr, indices, data, v, i, lo):
    """Row ``i`` of A times ``v``, where ``v`` holds the segment's entries from ``lo`` on."""
    acc = 0.0
    for k in range(indptr[i], indptr[i + 1]):
        acc += data[k] * v[indices[k] - lo]
    return acc


# Reassociation lets LLVM vectorise the dot products and updates (the sums'
# order changes, by rounding only); NaN and Inf keep their IEEE meaning, so
# the finiteness test below still sees them.
_GMRES_FASTMATH = {"reassoc", "contract"}


@numba.njit(cache=True, fastmath=_GMRES_FASTMATH)
def _gmres_segment(lo, hi, indptr, indices, data, b, x, dinv, rtol, atol, maxiter, restart,
                   has_x0):
    """Restarted GMRES on rows ``lo:hi`` (one system): (iterations, ||r||, status).

    The same algorithm as the GPU path of ``gmres_batched``: classical
    Gram-Schmidt twice, Givens rotations, Jacobi on the right, the true
    residual at every restart deciding the status. Vectors are the
    segment's own (cache-resident for W2's sizes).
    """
    n = hi - lo
    m = max(1, min(restart, n))
    jac = dinv.size > 0
    V = np.empty((m + 1, n))
    R = np.zeros((m, m))
    cs = np.zeros(m)
    sn = np.zeros(m)
    g = np.zeros(m + 1)
    h = np.empty(m + 1)
    hp = np.empty(m + 1)
    y = np.zeros(m)
    w = np.empty(n)
    z = np.empty(n)
    bb = 0.0
    for i in range(n):
        bb += float(b[lo + i]) ** 2
    tol = max(rtol * math.sqrt(bb), atol)
    if not has_x0:
        for i in range(n):
            x[lo + i] = 0.0
    for i in range(n):
        z[i] = x[lo + i]
    total = 0
    while True:
        beta2 = 0.0
        for i in range(n):
            ri = float(b[lo + i]) - _local_product(indptr, indices, data, z, lo + i, lo)
            V[0, i] = ri
            beta2 += ri * ri
        beta = math.sqrt(beta2)
        if not math.isfinite(beta):
            return total, beta, 2
        if beta <= tol:
            return total, beta, 0
        if total >= maxiter:
            return total, beta, 1
        for i in range(n):
            V[0, i] /= beta
        g[:] = 0.0
        g[0] = beta
        steps = min(m, maxiter - total)
        k = steps
        for j in range(steps):
            for i in range(n):
                z[i] = V[j, i] * dinv[lo + i] if jac else V[j, i]
            for i in range(n):
                w[i] = _local_product(indptr, indices, data, z, lo + i, lo)
            for a in range(j + 1):
                h[a] = 0.0
            for _pass in range(2):
                for a in range(j + 1):
                    acc = 0.0
                    for i in range(n):
                        acc += V[a, i] * w[i]
                    hp[a] = acc
                for a in range(j + 1):
                    ca = hp[a]
                    h[a] += ca
                    for i in range(n):
                        w[i] -= ca * V[a, i]
            hn = 0.0
            for i in range(n):
                hn += w[i] * w[i]
            hn = math.sqrt(hn)
            inv = 1.0 / hn if hn > 0.0 else 0.0
            for i in range(n):
                V[j + 1, i] = w[i] * inv
            h[j + 1] = hn
            if rotate_column(h, j, R, cs, sn, g) <= tol:
                k = j + 1
                break
        back_substitute(R, g, k, y)
        for i in range(n):
            acc = 0.0
            for a in range(k):
                acc += V[a, i] * y[a]
            if jac:
                acc *= dinv[lo + i]
            x[lo + i] = x[lo + i] + acc
            z[i] = x[lo + i]
        total += k


@numba.njit(nogil=True, cache=True)
def gmres_some(order, start, stop, indptr, indices, data, b, x, dinv, offsets, rtol, atol,
               maxiter, restart, has_x0, its, res, st, out_true, out_bb):
    """Restarted GMRES on systems ``order[start:stop]`` of a batch (serial, without the GIL).

    The true residual sums as in :func:`cg_some`.
    """
    for k in range(start, stop):
        s = order[k]
        lo, hi = offsets[s], offsets[s + 1]
        its[s], res[s], st[s] = _gmres_segment(lo, hi, indptr, indices, data,
                                               b, x, dinv, rtol[s], atol[s], maxiter[s], restart,
                                               has_x0)
        out_true[s], out_bb[s] = residual_sums(lo, hi, indptr, indices, data, b, x)
