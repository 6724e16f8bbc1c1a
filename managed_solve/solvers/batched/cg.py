"""Batched conjugate gradients: every system of a :class:`PackedBatch` with its own scalars.

Each system ``s`` has its own alpha, beta and rho, its own stopping rule
``||r_s|| <= max(rtol_s ||b_s||, atol_s)`` (SciPy's rule), its own
``maxiter`` and status; a finished system stops changing and stops costing
work. CPU batches run the Numba kernels (:mod:`.cpu`), CuPy batches the fused
CUDA kernels (:mod:`.gpu`).
"""

from __future__ import annotations

import numpy as np

from . import gpu
from .arguments import check_batch
from .cpu import solve_fused
from .outcome import BatchOutcome
from .packed import PackedBatch


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
        24 (one CUDA graph chunk), 8 for systems of over 1M rows. A batch of
        several small systems (a thread block per system, see
        ``batched_block_max_rows`` in :mod:`managed_solve.config`) has no
        checkpoints and ignores it.
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
    >>> from managed_solve.solvers.batched import PackedBatch
    >>> from managed_solve.solvers.batched import cg_batched
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
    >>> batch = PackedBatch.pack([LinearSystem(A, np.ones(5)), LinearSystem(2 * A, np.ones(5))])
    >>> out = cg_batched(batch)
    >>> out.status.tolist(), out.iterations.tolist()
    ([0, 0], [3, 3])
    >>> bool(np.allclose(A @ batch.unpack(out.x)[0], 1.0))
    True
    """
    check_batch(batch, "cg_batched(batch)", check_every, first_check)
    if batch.xp is not np:
        return BatchOutcome(*gpu.solve(batch, "cg", check_every, first_check))
    return solve_fused(batch, "cg")
