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
             x_new: Any, d: Any, a: float, c: float, write_d: int) -> None:
    """One smoothing step: ``r = dinv (b - A x_old)``, ``d = a d + c r``, ``x_new = x_old + d``."""
    t = data.dtype.type
    ax = _csr(indptr, indices, data, n, x_old.shape[0]) @ x_old
    r = dinv[:n] * (b[:n] - ax)
    dn = t(c) * r if a == 0 else t(a) * d[:n] + t(c) * r
    dn = dn.astype(data.dtype, copy=False)
    if write_d:
        d[:n] = dn
    x_new[:n] = x_old[:n] + dn


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
    step = staticmethod(amg_step)
    restrict = staticmethod(amg_restrict)
    prolong = staticmethod(amg_prolong)
    dense = staticmethod(amg_dense)
    zero = staticmethod(amg_zero)
