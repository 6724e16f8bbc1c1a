"""NumPy twins of the fused V-cycle kernels (``cycle.cu``): the same functions, the same math.

Each function has the signature of the kernel of the same name in
``cycle.cu`` (less the launch geometry) and writes into its output arrays as
the kernel does, so :class:`~.fused.FusedCycle` runs on either
(:class:`TwinOps` here, :class:`~.kernels.CudaOps` on a GPU). The tests pin
the twins against the smoothers and the V-cycle of :mod:`.smoothers` and
:mod:`.cycle`, and the CUDA kernels against the twins.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp


def _csr(indptr: Any, indices: Any, data: Any, n: int, m: int) -> Any:
    return sp.csr_matrix((data, indices, indptr), shape=(n, m))


def amg_scale(n: int, b: Any, dinv: Any, s: float, x: Any, d: Any, write_d: int) -> None:
    """``x = d = s dinv b`` (``d`` only where ``write_d``)."""
    v = (b.dtype.type(s) * dinv[:n]) * b[:n]
    x[:n] = v
    if write_d:
        d[:n] = v


def amg_step(n: int, indptr: Any, indices: Any, data: Any, dinv: Any, b: Any, x_old: Any,
             x_new: Any, d: Any, a: float, c: float, write_d: int, prev: int) -> None:
    """One smoothing step: ``r = dinv (b - A x_old)``, ``dn = a p + c r``, ``x_new = x_old + dn``.

    ``p`` by ``prev``: 0 none, 1 ``d``, 2 ``x_old - x_new`` (x_new's buffer
    still holds the iterate before x_old).
    """
    t = data.dtype.type
    ax = _csr(indptr, indices, data, n, x_old.shape[0]) @ x_old
    r = dinv[:n] * (b[:n] - ax)
    if prev == 0:
        dn = t(c) * r
    else:
        p = d[:n] if prev == 1 else x_old[:n] - x_new[:n]
        dn = t(a) * p + t(c) * r
    dn = dn.astype(data.dtype, copy=False)
    if write_d:
        d[:n] = dn
    x_new[:n] = x_old[:n] + dn


def amg_first(n: int, indptr: Any, indices: Any, data: Any, dinv: Any, b: Any, s: float,
              x_new: Any, d: Any, a: float, c: float, write_d: int) -> None:
    """:func:`amg_scale` then :func:`amg_step` in one: ``x0 = d0 = s dinv b``, one step from it."""
    t = data.dtype.type
    x0 = (t(s) * dinv[:n]) * b[:n]
    r = dinv[:n] * (b[:n] - _csr(indptr, indices, data, n, n) @ x0)
    dn = (t(c) * r if a == 0 else t(a) * x0 + t(c) * r).astype(data.dtype, copy=False)
    if write_d:
        d[:n] = dn
    x_new[:n] = x0 + dn


def amg_restrict(n: int, indptr: Any, indices: Any, data: Any, b: Any, x: Any, p_indptr: Any,
                 p_indices: Any, p_data: Any, bc: Any) -> None:
    """``bc += P^T (b - A x)`` (``bc`` zeroed by the caller, as before the kernel's atomics)."""
    r = b[:n] - _csr(indptr, indices, data, n, x.shape[0]) @ x
    bc += _csr(p_indptr, p_indices, p_data, n, bc.shape[0]).T @ r


def amg_prolong(n: int, p_indptr: Any, p_indices: Any, p_data: Any, xc: Any, x: Any) -> None:
    """``x += P xc``."""
    x[:n] += _csr(p_indptr, p_indices, p_data, n, xc.shape[0]) @ xc


def amg_dense(m: int, inv: Any, b: Any, x: Any) -> None:
    """``x = inv b`` with ``inv`` dense m x m."""
    np.dot(inv, b[:m], out=x[:m])


def amg_zero(n: int, v: Any) -> None:
    """``v = 0``."""
    v[:n] = 0


class TwinOps:
    """The kernels' interface on NumPy arrays (see :class:`~.kernels.CudaOps`)."""

    scale = staticmethod(amg_scale)
    first = staticmethod(amg_first)
    step = staticmethod(amg_step)
    restrict = staticmethod(amg_restrict)
    prolong = staticmethod(amg_prolong)
    dense = staticmethod(amg_dense)
    zero = staticmethod(amg_zero)


# ---------------------------------------------------------------- the CG loop (pcg.cu)

#: Slots of the loop's scalar array ``s`` (float64), as in ``pcg.cu``.
RZ, PQ, RR, RZN, BETA, RNORM, BAD, TOL = range(8)
NSCALARS = 8


def _same(a: Any, b: Any) -> bool:
    return a is b or (a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def pcg_spmv_dot(n: int, indptr: Any, indices: Any, data: Any, p: Any, q: Any, s: Any) -> None:
    """``q = A p``, ``s[PQ] += p.q``."""
    q[:n] = _csr(indptr, indices, data, n, p.shape[0]) @ p
    s[PQ] += float(np.dot(p[:n].astype(np.float64), q[:n].astype(np.float64)))


def pcg_residual(n: int, indptr: Any, indices: Any, data: Any, b: Any, x: Any, r: Any, rc: Any,
                 s: Any) -> None:
    """``r = b - A x``, ``rc = r`` (the cycle's dtype), ``s[RR] += r.r``."""
    r[:n] = b[:n] - _csr(indptr, indices, data, n, x.shape[0]) @ x
    if not _same(r, rc):
        rc[:n] = r[:n]
    s[RR] += float(np.dot(r[:n].astype(np.float64), r[:n].astype(np.float64)))


def pcg_update(n: int, x: Any, p: Any, r: Any, rc: Any, q: Any, s: Any) -> None:
    """``alpha = s[RZ] / s[PQ]`` (0 where 0); ``x += alpha p``; ``r -= alpha q``; ``rc = r``; ``s[RR] += r.r``."""
    alpha = x.dtype.type(s[RZ] / s[PQ] if s[PQ] != 0.0 else 0.0)
    x[:n] += alpha * p[:n]
    r[:n] -= alpha * q[:n]
    if not _same(r, rc):
        rc[:n] = r[:n]
    s[RR] += float(np.dot(r[:n].astype(np.float64), r[:n].astype(np.float64)))


def pcg_dot(n: int, r: Any, z: Any, s: Any) -> None:
    """``s[RZN] += r.z``."""
    s[RZN] += float(np.dot(r[:n].astype(np.float64), z[:n].astype(r.dtype).astype(np.float64)))


def pcg_scalars(s: Any) -> None:
    """The breakdown flag, ``beta``, ``rz``, ``||r||``; the sums zeroed."""
    if s[PQ] <= 0.0 and s[RNORM] > s[TOL]:
        s[BAD] = 1.0
    s[BETA] = s[RZN] / s[RZ] if s[RZ] != 0.0 else 0.0
    s[RZ] = s[RZN]
    s[RNORM] = np.sqrt(s[RR])
    s[PQ] = s[RR] = s[RZN] = 0.0


def pcg_pupdate(n: int, z: Any, p: Any, s: Any) -> None:
    """``p = z + beta p``."""
    p[:n] = z[:n].astype(p.dtype) + p.dtype.type(s[BETA]) * p[:n]


class LoopTwinOps:
    """The CG loop's kernels on NumPy arrays (see :class:`~.kernels.LoopCudaOps`)."""

    spmv_dot = staticmethod(pcg_spmv_dot)
    residual = staticmethod(pcg_residual)
    update = staticmethod(pcg_update)
    dot = staticmethod(pcg_dot)
    scalars = staticmethod(pcg_scalars)
    pupdate = staticmethod(pcg_pupdate)
