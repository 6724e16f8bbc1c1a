"""Batched CG and BiCGStab: every system of a :class:`PackedBatch` with its own scalars.

One Krylov core for ``solve`` (a batch of one), ``solve_many`` (many packed
systems) and the sharded solver. Each system ``s`` has its own alpha, beta,
rho (and omega), its own stopping rule ``||r_s|| <= max(rtol_s ||b_s||, atol_s)``
(SciPy's rule), its own ``maxiter`` and status; a finished system stops
changing and stops costing work.

- CPU (``numpy`` batches): Numba kernels in :mod:`managed_solve.kernels.krylov`,
  parallel over systems, or over rows for one large system.
- GPU (``cupy`` batches): fused CUDA kernels in
  :mod:`managed_solve.solvers._cuda_krylov`, scalars and convergence flags kept
  on the device, read by the host only at geometrically spaced checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels import krylov as _k
from .batch import PackedBatch

CONVERGED, MAXITER, BREAKDOWN = 0, 1, 2

# One system on the CPU: below this many rows the three (CG) or five
# (BiCGStab) thread starts per iteration of the row-parallel layout cost more
# than they save; the serial layout runs instead. Measured on the 2-core
# development machine, 2D Poisson float64 CG, ms per iteration (rows / serial
# / scipy cg): 16k 0.16 / 0.26 / 0.15, 65k 0.35 / 0.84 / 0.77, 1M 6.8 / 15.4 / 13.1.
ROWS_LAYOUT_MIN = 10_000


@dataclass
class BatchOutcome:
    """What a batched solve returns.

    Attributes
    ----------
    x : xp array, shape (n,)
        Packed solutions (``batch.unpack(x)`` gives per-system views).
    iterations : numpy int64 array, shape (nsys,)
    residual_norms : numpy float64 array, shape (nsys,)
        Recurrence residual ``||r_s||`` when system ``s`` stopped.
    status : numpy int8 array, shape (nsys,)
        0 converged, 1 maxiter, 2 breakdown.
    host_syncs : int
        Waits of the host on the GPU with no work queued behind them (GPU:
        0 or 1 a solve, 1 when ``maxiter`` is reached; 0 on the CPU).
    checkpoints : int
        Status reads by the host (GPU; each overlaps queued iterations).
    compactions : int
        Times the kernels' row set shrank to the running systems (GPU).
    gpu_seconds : float or None
        Device time from the solve's first kernel to the checkpoint that saw
        every system finished (CUDA events; None on the CPU). Wall time far
        above it means the host kept the GPU waiting.
    """

    x: Any
    iterations: np.ndarray
    residual_norms: np.ndarray
    status: np.ndarray
    host_syncs: int = 0
    checkpoints: int = 0
    compactions: int = 0
    gpu_seconds: float | None = None

    @property
    def converged(self) -> np.ndarray:
        return self.status == CONVERGED


def _check_first(call: str, first_check: int | None) -> None:
    if first_check is not None and (int(first_check) != first_check or first_check < 1):
        raise ValueError(f"{call}: first_check must be a positive integer or None, got {first_check!r}")


def _check(batch: Any, call: str, check_every: int | None) -> None:
    if not isinstance(batch, PackedBatch):
        raise TypeError(f"{call}: batch must be a PackedBatch, got {type(batch).__name__}; "
                        "build one with PackedBatch.pack(systems) or PackedBatch.from_csr(A, b)")
    if check_every is not None and int(check_every) < 1:
        raise ValueError(f"{call}: check_every must be a positive integer or None, got {check_every!r}")


def cg_batched(batch: PackedBatch, *, check_every: int | None = None,
               first_check: int | None = None) -> BatchOutcome:
    """Conjugate gradients on every system of a batch (SPD systems).

    Parameters
    ----------
    batch : PackedBatch
        On the CPU (NumPy) or a GPU (CuPy); Jacobi preconditioning when
        ``batch.dinv`` is set.
    check_every : int, optional
        GPU only: iterations between checkpoints (copies of the convergence
        flags to the host, read while later iterations stay queued). Default:
        24 (one CUDA graph chunk), 8 for systems of over 1M rows.
    first_check : int, optional
        GPU only: iterations queued before the host's first read, for a
        caller that predicts the iteration count (``solve`` passes the count
        its DeviceManager learned for the same kind of system).

    Returns
    -------
    BatchOutcome
        Status 2 (breakdown) for a system where ``p . A p <= 0`` (A not
        positive definite) or ``r . z == 0``.

    See Also
    --------
    scipy.sparse.linalg.cg : the same iterates, one system at a time.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> from managed_solve.solvers.batch import PackedBatch
    >>> from managed_solve.solvers.batched import cg_batched
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
    >>> batch = PackedBatch.pack([LinearSystem(A, np.ones(5)), LinearSystem(2 * A, np.ones(5))])
    >>> out = cg_batched(batch)
    >>> out.status.tolist(), out.iterations.tolist()
    ([0, 0], [3, 3])
    >>> bool(np.allclose(A @ batch.unpack(out.x)[0], 1.0))
    True
    """
    _check(batch, "cg_batched(batch)", check_every)
    _check_first("cg_batched(batch)", first_check)
    if batch.xp is not np:
        from . import _cuda_krylov

        return BatchOutcome(*_cuda_krylov.solve(batch, "cg", check_every, first_check))
    return _cpu_solve(batch, "cg")


def bicgstab_batched(batch: PackedBatch, *, check_every: int | None = None,
                     first_check: int | None = None) -> BatchOutcome:
    """BiCGStab on every system of a batch (general non-singular systems).

    Parameters and returns as :func:`cg_batched`; status 2 (breakdown) when
    ``rho``, ``r~ . v`` or ``omega`` vanish. A system that converges at the
    half step counts that half step as an iteration (SciPy stops there too).

    See Also
    --------
    scipy.sparse.linalg.bicgstab : the same iterates, one system at a time.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.batch import PackedBatch
    >>> from managed_solve.solvers.batched import bicgstab_batched
    >>> A = sp.diags([-1.5, 2.0, -0.5], [-1, 0, 1], shape=(6, 6), format="csr")
    >>> out = bicgstab_batched(PackedBatch.from_csr(A, np.ones(6), rtol=1e-10))
    >>> int(out.status[0]), bool(np.allclose(A @ out.x, 1.0))
    (0, True)
    """
    _check(batch, "bicgstab_batched(batch)", check_every)
    _check_first("bicgstab_batched(batch)", first_check)
    if batch.xp is not np:
        from . import _cuda_krylov

        return BatchOutcome(*_cuda_krylov.solve(batch, "bicgstab", check_every, first_check))
    return _cpu_solve(batch, "bicgstab")


def _cpu_solve(batch: PackedBatch, method: str) -> BatchOutcome:
    """Allocate the workspace once and run the Numba kernels of the right layout."""
    n, dt, nsys = batch.n, batch.dtype, batch.nsys
    x = batch.x0.copy() if batch.x0 is not None else np.zeros(n, dtype=dt)
    has_x0 = batch.x0 is not None
    jac = batch.dinv is not None
    dinv = batch.dinv if jac else _k.empty_dinv(dt)
    A = (batch.indptr, batch.indices, batch.data)
    its = np.zeros(nsys, dtype=np.int64)
    rr = np.zeros(nsys, dtype=np.float64)
    st = np.zeros(nsys, dtype=np.int8)
    rows = nsys == 1 and n >= ROWS_LAYOUT_MIN
    if method == "cg":
        r, p, q = (np.empty(n, dtype=dt) for _ in range(3))
        z = np.empty(n, dtype=dt) if jac else r
        vecs = (batch.b, x, dinv, r, z, p, q)
        kernel_rows, kernel_sys = _k.cg_rows, _k.cg_systems
    else:
        r, rt, p, v, t = (np.empty(n, dtype=dt) for _ in range(5))
        z = np.empty(n, dtype=dt) if jac else p
        vecs = (batch.b, x, dinv, r, rt, p, v, t, z)
        kernel_rows, kernel_sys = _k.bicgstab_rows, _k.bicgstab_systems
    if rows:
        its[0], rr[0], st[0] = kernel_rows(*A, *vecs, float(batch.rtol[0]), float(batch.atol[0]),
                                           int(batch.maxiter[0]), has_x0)
    else:
        _k.run_systems(kernel_sys, *A, *vecs, batch.offsets, batch.rtol, batch.atol,
                       batch.maxiter, has_x0, its, rr, st)
    return BatchOutcome(x=x, iterations=its, residual_norms=np.sqrt(rr), status=st, host_syncs=0)
