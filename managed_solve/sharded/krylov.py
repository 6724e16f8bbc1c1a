"""The sharded Krylov loops: CG (Chronopoulos-Gear) and BiCGStab over a ShardedSystem.

Each loop runs on every shard at once, through the system's distributed
product (:meth:`ShardedSystem.exchange_and_spmv`) and all-reduce
(:meth:`ShardedSystem.allreduce`); scalars stay on the devices (every shard
computes bit-identical ones), and the host reads the residual only every
``every`` iterations. Both return ``(x pieces, status code, iterations, host
syncs, info)`` with the status codes of :mod:`managed_solve.solvers.engine`.
"""

from __future__ import annotations

import numpy as np

from ..solvers.engine import BREAKDOWN, CONVERGED, MAXITER
from .comm import safe_div

__all__ = ["bicgstab", "cg"]


def cg(system, bp, x0p, rtol, atol, maxiter, jacobi, every):
    """Chronopoulos-Gear CG: one all-reduce of (r,u), (Au,u), (r,r) per iteration.

    Equal to CG in exact arithmetic (Chronopoulos & Gear 1989; Ghysels &
    Vanroose 2014, Alg. 2): ``s = A p`` is carried by its own recurrence,
    so the two dot products of textbook CG become one reduction, at the
    cost of two more vectors (``s``, ``w``).
    """
    P, ops, comm = len(system.shards), system.ops, system.comm
    sh_ = system.shards
    xs, r, ue, w, p, s_, dinv, parts = [], [], [], [], [], [], [], []
    for k, sh in enumerate(sh_):
        xp = sh.xp
        with comm.on(k):
            xs.append(xp.zeros(sh.nloc, system.dtype) if x0p is None else x0p[k].copy())
            ue.append(xp.zeros(sh.nloc + sh.nhalo, system.dtype))
            w.append(xp.empty(sh.nloc, system.dtype))
            p.append(xp.empty(sh.nloc, system.dtype))
            s_.append(xp.empty(sh.nloc, system.dtype))
            parts.append(xp.zeros(4, system.dtype))
            dinv.append(1.0 / sh.diag if jacobi else None)
            # Without a preconditioner u = r: r lives in the owned part of
            # the halo-extended buffer, saving a vector and a copy.
            r.append(xp.empty(sh.nloc, system.dtype) if jacobi else ue[k][: sh.nloc])
    red, tot = system.reduction_buffers(4)
    # r0 = b - A x0
    if x0p is not None:
        xe = [system.ext_empty(k) for k in range(P)]
        for k, sh in enumerate(sh_):
            with comm.on(k):
                xe[k][: sh.nloc] = xs[k]
        system.exchange_and_spmv(xe, w)
        for k in range(P):
            with comm.on(k):
                r[k][...] = bp[k] - w[k]
    else:
        for k in range(P):
            with comm.on(k):
                r[k][...] = bp[k]

    def precondition():
        if jacobi:
            for k, sh in enumerate(sh_):
                with comm.on(k):
                    sh.xp.multiply(dinv[k], r[k], out=ue[k][: sh.nloc])

    precondition()
    system.exchange_and_spmv(ue, w)
    for k, sh in enumerate(sh_):
        with comm.on(k):
            ops.dots3(r[k], ue[k][: sh.nloc], w[k], parts[k])
            parts[k][3] = sh.xp.dot(bp[k], bp[k])
    slot = 0
    tt = system.allreduce(parts, red, tot, slot)
    # sync: ||b|| and ||r0|| once per solve, for the stopping threshold
    t0h = system.comm.read(0, tt[0])
    syncs = 1
    b_norm, r0 = float(np.sqrt(t0h[3])), float(np.sqrt(max(t0h[2], 0.0)))
    tol = max(float(rtol) * b_norm, float(atol))
    if r0 <= tol or maxiter == 0:
        return xs, (CONVERGED if r0 <= tol else MAXITER), 0, syncs, {}

    # sc = [gamma, alpha, beta, bad] per shard, kept on its device.
    sc = []
    for k, sh in enumerate(sh_):
        xp = sh.xp
        with comm.on(k):
            v = xp.zeros(4, system.dtype)
            v[0:1] = tt[k][0:1]
            v[1:2] = safe_div(xp, tt[k][0:1], tt[k][1:2])
            v[3:4] = (tt[k][1:2] <= 0).astype(system.dtype)
            sc.append(v)
            p[k][...] = ue[k][: sh.nloc]
            s_[k][...] = w[k]
    with comm.on(0):
        hist = sh_[0].xp.empty(every, dtype=system.dtype)
    tol2 = tol * tol
    start = 1
    for it in range(1, maxiter + 1):
        for k in range(P):
            with comm.on(k):
                ops.update_xr(sc[k][1:2], p[k], s_[k], xs[k], r[k])
        precondition()
        system.exchange_and_spmv(ue, w)
        for k, sh in enumerate(sh_):
            with comm.on(k):
                ops.dots3(r[k], ue[k][: sh.nloc], w[k], parts[k])
        slot ^= 1
        tt = system.allreduce(parts, red, tot, slot)
        for k, sh in enumerate(sh_):
            with comm.on(k):
                ops.cg_scalars(sc[k], tt[k], tol2, hist, it - start if k == 0 else -1)
                ops.update_ps(sc[k][2:3], ue[k][: sh.nloc], w[k], p[k], s_[k])
        if it - start + 1 == every or it == maxiter:
            # sync: reads the residual history and the breakdown flag on the host
            h = np.sqrt(np.maximum(comm.read(0, hist[: it - start + 1]), 0.0))
            broke = bool(comm.read(0, sc[0][3:4])[0])
            syncs += 1
            hit = np.flatnonzero(h <= tol)
            if broke:
                return xs, BREAKDOWN, it, syncs, {"message": (
                    "CG met non-positive curvature: A is not symmetric positive definite. "
                    "Use method='bicgstab' for a general matrix.")}
            if not np.all(np.isfinite(h)):
                return xs, BREAKDOWN, it, syncs, {"message": (
                    "CG produced a non-finite residual; A may be singular or not positive "
                    "definite.")}
            if hit.size:
                return xs, CONVERGED, it, syncs, {"converged_at": start + int(hit[0])}
            start = it + 1
    return xs, MAXITER, maxiter, syncs, {}

def bicgstab(system, bp, x0p, rtol, atol, maxiter, jacobi, every):
    """BiCGStab (van der Vorst 1992), right-preconditioned by Jacobi when asked.

    Three all-reduces per iteration: (rhat, v); (t, s) with (t, t); and
    (rhat, r) with (r, r), the last also giving the residual norm.
    """
    P, comm = len(system.shards), system.comm
    sh_ = system.shards
    X = {name: [] for name in ("x", "r", "rhat", "p", "v", "s", "t", "ph", "sh")}
    dinv = []
    for k, sh in enumerate(sh_):
        xp = sh.xp
        with comm.on(k):
            X["x"].append(xp.zeros(sh.nloc, system.dtype) if x0p is None else x0p[k].copy())
            for name in ("r", "p", "v", "s", "t"):
                X[name].append(xp.zeros(sh.nloc, system.dtype))
            # The vectors multiplied by A carry room for the halo.
            X["ph"].append(xp.zeros(sh.nloc + sh.nhalo, system.dtype))
            X["sh"].append(xp.zeros(sh.nloc + sh.nhalo, system.dtype))
            dinv.append(1.0 / sh.diag if jacobi else None)
    red, tot = system.reduction_buffers(3)
    x, r, rhat, p, v, s, t, ph, shv = (X[k] for k in ("x", "r", "rhat", "p", "v", "s", "t",
                                                      "ph", "sh"))
    if x0p is not None:
        for k, sh in enumerate(sh_):
            with comm.on(k):
                ph[k][: sh.nloc] = x[k]
        system.exchange_and_spmv(ph, v)
        for k in range(P):
            with comm.on(k):
                r[k][...] = bp[k] - v[k]
    else:
        for k in range(P):
            with comm.on(k):
                r[k][...] = bp[k]
    parts = []
    for k, sh in enumerate(sh_):
        xp = sh.xp
        with comm.on(k):
            rhat.append(r[k].copy())
            parts.append(xp.stack([xp.dot(r[k], r[k]), xp.dot(bp[k], bp[k]),
                                   xp.zeros((), system.dtype)]))
    slot = 0
    tt = system.allreduce(parts, red, tot, slot)
    # sync: ||b|| and ||r0|| once per solve, for the stopping threshold
    t0h = system.comm.read(0, tt[0])
    syncs = 1
    b_norm, r0 = float(np.sqrt(t0h[1])), float(np.sqrt(t0h[0]))
    tol = max(float(rtol) * b_norm, float(atol))
    if r0 <= tol or maxiter == 0:
        return x, (CONVERGED if r0 <= tol else MAXITER), 0, syncs, {}
    rho = []
    for k in range(P):
        with comm.on(k):
            rho.append(tt[k][0:1].copy())
    alpha = [None] * P
    omega = [None] * P
    bad = [None] * P
    for k, sh in enumerate(sh_):
        with comm.on(k):
            p[k][...] = r[k]
            bad[k] = sh.xp.zeros(1, dtype=bool)
    hist = None
    with comm.on(0):
        hist = sh_[0].xp.empty(every, dtype=np.float64)

    def apply(src, ext, out):
        for k, sh in enumerate(sh_):
            with comm.on(k):
                if jacobi:
                    sh.xp.multiply(dinv[k], src[k], out=ext[k][: sh.nloc])
                else:
                    ext[k][: sh.nloc] = src[k]
        system.exchange_and_spmv(ext, out)

    start = 1
    for it in range(1, maxiter + 1):
        apply(p, ph, v)  # v = A M p
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                parts[k][0] = xp.dot(rhat[k], v[k])
        slot ^= 1
        tt = system.allreduce(parts, red, tot, slot)
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                alpha[k] = safe_div(xp, rho[k], tt[k][0:1])
                bad[k] = bad[k] | (tt[k][0:1] == 0)
                xp.subtract(r[k], alpha[k] * v[k], out=s[k])
        apply(s, shv, t)  # t = A M s
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                parts[k][0] = xp.dot(t[k], s[k])
                parts[k][1] = xp.dot(t[k], t[k])
        slot ^= 1
        tt = system.allreduce(parts, red, tot, slot)
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                omega[k] = safe_div(xp, tt[k][0:1], tt[k][1:2])
                # x += alpha M p + omega M s; the M-applied vectors are in ph, sh.
                x[k] += alpha[k] * ph[k][: sh.nloc] + omega[k] * shv[k][: sh.nloc]
                xp.subtract(s[k], omega[k] * t[k], out=r[k])
                parts[k][0] = xp.dot(rhat[k], r[k])
                parts[k][1] = xp.dot(r[k], r[k])
        slot ^= 1
        tt = system.allreduce(parts, red, tot, slot)
        for k, sh in enumerate(sh_):
            xp = sh.xp
            with comm.on(k):
                rho_new = tt[k][0:1]
                unconv = tt[k][1:2] > tol * tol
                bad[k] = bad[k] | (((rho_new == 0) | (omega[k] == 0)) & unconv)
                beta = safe_div(xp, rho_new, rho[k]) * safe_div(xp, alpha[k], omega[k])
                rho[k] = rho_new.copy()
                # p = r + beta (p - omega v)
                p[k] -= omega[k] * v[k]
                p[k] *= beta
                p[k] += r[k]
                if k == 0:
                    hist[it - start] = tt[0][1]
        if it - start + 1 == every or it == maxiter:
            # sync: reads the residual history and the breakdown flag on the host
            h = np.sqrt(np.maximum(comm.read(0, hist[: it - start + 1]), 0.0))
            broke = bool(comm.read(0, bad[0])[0])
            syncs += 1
            hit = np.flatnonzero(h <= tol)
            if hit.size:
                return x, CONVERGED, it, syncs, {"converged_at": start + int(hit[0])}
            if broke or not np.all(np.isfinite(h)):
                return x, BREAKDOWN, it, syncs, {"message": (
                    "BiCGStab broke down (a vanishing inner product); try M='jacobi' or "
                    "solve(A, b, method='gmres') on one device.")}
            start = it + 1
    return x, MAXITER, maxiter, syncs, {}
