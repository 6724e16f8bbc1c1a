"""Batched BiCGStab: every system of a :class:`PackedBatch` with its own scalars.

As :mod:`.cg` (own alpha, beta, rho and omega per system, own stopping rule,
``maxiter`` and status), for general non-singular systems.
"""

from __future__ import annotations

import numpy as np

from . import gpu
from .arguments import check_batch
from .cpu import solve_fused
from .outcome import BatchOutcome
from .packed import PackedBatch


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
    >>> from managed_solve.solvers.batched import PackedBatch
    >>> from managed_solve.solvers.batched import bicgstab_batched
    >>> A = sp.diags([-1.5, 2.0, -0.5], [-1, 0, 1], shape=(6, 6), format="csr")
    >>> out = bicgstab_batched(PackedBatch.from_csr(A, np.ones(6), rtol=1e-10))
    >>> int(out.status[0]), bool(np.allclose(A @ out.x, 1.0))
    (0, True)
    """
    check_batch(batch, "bicgstab_batched(batch)", check_every, first_check)
    if batch.xp is not np:
        return BatchOutcome(*gpu.solve(batch, "bicgstab", check_every, first_check))
    return solve_fused(batch, "bicgstab")
