"""What a batched solve returns: per-system iterations, residuals and statuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine import CONVERGED


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
    true_norms : tuple of two numpy float64 arrays, or None
        ``(||b_s - A_s x_s||, ||b_s||)`` of each system: computed by the host
        kernels as each system stopped, by the GPU kernel of a block per
        system, and by every solve of a ``PreparedBatch`` (None elsewhere:
        the drivers' GPU row loops, one large system alone on the host).
    """

    x: Any
    iterations: np.ndarray
    residual_norms: np.ndarray
    status: np.ndarray
    host_syncs: int = 0
    checkpoints: int = 0
    compactions: int = 0
    gpu_seconds: float | None = None
    true_norms: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def converged(self) -> np.ndarray:
        return self.status == CONVERGED
