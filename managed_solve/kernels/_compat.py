"""Compatibility shims needed before ``numba.cuda`` is imported. Import this first.

numba-cuda 0.30.4 registers an overload for ``np.row_stack`` when it compiles
its first kernel; NumPy 2.5 removed ``row_stack`` (an alias of ``vstack``),
so every CUDA compilation fails with ``AttributeError: module 'numpy' has no
attribute 'row_stack'``. Restoring the alias is harmless on older NumPy
(where it exists and this does nothing). Kept in this one place; every module
of ``managed_solve/kernels/`` that uses ``numba.cuda`` imports it before ``numba.cuda``.
"""

from __future__ import annotations

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # noqa: NPY201

# Threads per block for the one-thread-per-row kernels: a multiple of the warp
# size that keeps enough blocks resident for latency hiding on the gathers.
THREADS_PER_BLOCK = 128
