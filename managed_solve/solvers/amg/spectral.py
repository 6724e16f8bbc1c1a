"""The largest eigenvalue of ``D^-1 A``, for the prolongator's and the smoothers' damping.

A few Lanczos steps on the symmetric form ``D^-1/2 A D^-1/2`` (the same
spectrum as ``D^-1 A``) from a fixed pseudo-random start, as PyAMG's
``approximate_spectral_radius`` does, capped by the Gershgorin bound
``max_i sum_j |a_ij / a_ii|``. The scalars stay on the device until one
host read at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .segments import uniform

LANCZOS_STEPS = 15


def safe_inverse(xp: Any, d: Any) -> Any:
    """``1 / d`` where ``d != 0``, else 0 (rows a dropped null-space vector emptied)."""
    nz = d != 0
    return xp.where(nz, 1.0 / xp.where(nz, d, 1.0), 0.0)


def spectral_radius(A: Any, dinv: Any, xp: Any, *, steps: int = LANCZOS_STEPS) -> float:
    """An estimate of ``rho(D^-1 A)`` (host float) for a CSR matrix ``A``."""
    n = A.shape[0]
    k = max(1, min(int(steps), n))
    s = xp.sqrt(abs(dinv))
    v = uniform(xp, n, 7, xp.float64) + 0.5
    v /= xp.sqrt(xp.dot(v, v))
    v_prev = xp.zeros_like(v)
    u = xp.empty_like(v)
    beta = xp.zeros((), dtype=xp.float64)
    alphas, betas = [], []
    # The step's arithmetic in place where a vector is not read again (v_prev
    # becomes beta v_prev, w the next v): two new vectors a step, not seven.
    for _ in range(k):
        xp.multiply(s, v, out=u)
        w = (A @ u).astype(xp.float64, copy=False)
        w *= s
        alpha = xp.dot(w, v)
        t = alpha * v
        v_prev *= beta
        t += v_prev
        w -= t  # w - (alpha v + beta v_prev)
        beta = xp.sqrt(xp.dot(w, w))
        alphas.append(alpha)
        betas.append(beta)
        w /= xp.where(beta > 0, beta, 1.0)
        v_prev, v = v, w
    # |A| shares A's pattern: only its values are new (abs(A) copies the indices too).
    absA = type(A)((abs(A.data), A.indices, A.indptr), shape=A.shape)
    # sync: the tridiagonal's entries and the Gershgorin bound, one read at set-up
    a = np.asarray(_host(xp, xp.stack(alphas)), dtype=np.float64)
    b = np.asarray(_host(xp, xp.stack(betas)), dtype=np.float64)
    gersh = float(_host(xp, (absA @ xp.ones(n, dtype=A.dtype) * abs(dinv)).max()))
    # Stop at the first (near) breakdown: the Krylov space is invariant there.
    tiny = np.flatnonzero(b[:-1] <= 1e-12 * max(1.0, abs(a).max()))
    m = int(tiny[0]) + 1 if tiny.size else k
    T = np.diag(a[:m]) + np.diag(b[:m - 1], 1) + np.diag(b[:m - 1], -1)
    ritz = float(np.linalg.eigvalsh(T).max()) if m else 0.0
    est = min(ritz, gersh) if ritz > 0 else gersh
    return est if np.isfinite(est) and est > 0 else 1.0


def _host(xp: Any, x: Any) -> Any:
    return x if xp is np else x.get()
