"""The JAX anchor for W2: ``jax.jit(jax.vmap(jax.scipy.sparse.linalg.cg))`` over padded CSR systems.

What a JAX user writes for many sparse systems of different sizes: pad every
system to the largest, store each as coordinate triplets of one common length,
multiply with a segment sum, and map SciPy-style ``cg`` over the systems with
``vmap``, each system with its own tolerance.

- Layout: ``values``, ``cols``, ``rows`` of shape ``(S, nnz_max)`` and ``b`` of
  shape ``(S, n_max)``. Padded entries hold the value 0 at column 0 of the last
  row, so each system's row indices stay sorted (``indices_are_sorted`` holds)
  and they add nothing. Padded unknowns (rows ``n_i..n_max-1``) get a unit
  diagonal through a mask and a zero right-hand side: from the zero start their
  residual, search direction and solution stay exactly zero, so they change no
  inner product and the padded operator stays symmetric positive definite.
- Tolerance: ``cg``'s ``tol`` is traced, so a batched ``tol`` of shape ``(S,)``
  goes through ``vmap``; ``cg`` stops a system when its recursive residual
  meets ``tol * ||b||`` (SciPy's rule), and ``vmap`` of its ``while_loop`` keeps
  stepping until the last system has stopped while freezing the ones done.
- Precision: float64 through ``jax_enable_x64``, set before any array is built.
  Without it JAX silently makes every array float32, and CG cannot reach an
  rtol of 1e-8 there; the flag is process-wide, which is harmless in a
  benchmark or test process that uses JAX for nothing else.
- GPU memory: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless already set, read
  when JAX first starts its GPU backend: by default JAX reserves 75% of the
  GPU at start, which would starve the CuPy benchmarks run after it in the same
  process.
- Counts: JAX's ``cg`` returns no iteration count, so :func:`scipy_cg_iterations`
  counts SciPy's unpreconditioned CG from zero with the same stopping rule.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla


def jax_x64():
    """Import JAX with float64 enabled (and GPU preallocation off); ``ImportError`` without JAX."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.config.update("jax_enable_x64", True)
    return jax


def jax_device(kind: str):
    """The first JAX device of ``kind`` ("cpu" or "gpu"), or None when JAX has none."""
    jax = jax_x64()
    try:
        devices = jax.devices(kind)
    except RuntimeError:  # no backend of that kind (no CUDA plugin, no driver)
        return None
    return devices[0] if devices else None


@dataclass(frozen=True)
class Padded:
    """Every system padded to the largest: host arrays, ready for ``jax.device_put``."""

    values: np.ndarray  # (S, nnz_max) float64
    cols: np.ndarray  # (S, nnz_max) int32
    rows: np.ndarray  # (S, nnz_max) int32, sorted within each system
    pad: np.ndarray  # (S, n_max) float64: 1.0 on padded unknowns (their unit diagonal)
    b: np.ndarray  # (S, n_max) float64, zero on padded unknowns
    tol: np.ndarray  # (S,) float64: each system's rtol
    sizes: tuple[int, ...]  # each system's n

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.values, self.cols, self.rows, self.pad, self.b, self.tol


def pad_systems(pairs, rtol) -> Padded:
    """Pad ``[(A, b), ...]`` (square CSR-convertible A) to ``(S, nnz_max)`` / ``(S, n_max)``.

    ``rtol`` is one float or one per system.
    """
    mats = [sp.csr_matrix(A) for A, _b in pairs]
    if not mats:
        raise ValueError("pairs is empty: pass at least one (A, b) system")
    for i, A in enumerate(mats):
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"pairs[{i}]: A is {A.shape}, not square; pass square matrices")
    S = len(mats)
    n_max = max(A.shape[0] for A in mats)
    nnz_max = max(A.nnz for A in mats)
    tol = np.broadcast_to(np.asarray(rtol, dtype=np.float64), (S,)).copy()
    values = np.zeros((S, nnz_max))
    cols = np.zeros((S, nnz_max), dtype=np.int32)
    rows = np.full((S, nnz_max), n_max - 1, dtype=np.int32)
    pad = np.ones((S, n_max))
    b = np.zeros((S, n_max))
    for i, (A, (_A, bi)) in enumerate(zip(mats, pairs, strict=True)):
        n, nnz = A.shape[0], A.nnz
        bi = np.asarray(bi, dtype=np.float64).ravel()
        if bi.shape != (n,):
            raise ValueError(f"pairs[{i}]: b has shape {bi.shape}, A has {n} rows; pass b of length {n}")
        values[i, :nnz] = A.data
        cols[i, :nnz] = A.indices
        rows[i, :nnz] = np.repeat(np.arange(n, dtype=np.int32), np.diff(A.indptr))
        pad[i, :n] = 0.0
        b[i, :n] = bi
    return Padded(values, cols, rows, pad, b, tol, tuple(A.shape[0] for A in mats))


def build_vmap_cg(n_max: int, maxiter: int | None = None):
    """``jax.jit(jax.vmap(cg))`` for systems padded to ``n_max`` unknowns.

    The returned function takes ``Padded.arrays()`` (on any one device) and
    returns the solutions, shape ``(S, n_max)``, on that device. ``maxiter``
    defaults to ``10 * n_max`` (SciPy's and JAX's default for ``cg``).
    """
    jax = jax_x64()
    from jax.scipy.sparse.linalg import cg

    maxiter = 10 * n_max if maxiter is None else int(maxiter)

    def one(values, cols, rows, pad, b, tol):
        def matvec(x):
            y = jax.ops.segment_sum(values * x[cols], rows, num_segments=n_max,
                                    indices_are_sorted=True)
            return y + pad * x

        x, _info = cg(matvec, b, tol=tol, maxiter=maxiter)  # info is always None in JAX
        return x

    return jax.jit(jax.vmap(one))


def solve_padded(padded: Padded, device, maxiter: int | None = None):
    """Pad, transfer, compile and solve once; return the pieces a benchmark times apart.

    Returns ``(run, args, x, timings)``: ``run(*args)`` is the warm call on the
    device-resident ``args`` (blocks until done), ``x`` the first call's
    solutions on the host, ``timings`` the seconds of the transfer and of the
    first call (tracing and XLA compilation included).
    """
    jax = jax_x64()
    fn = build_vmap_cg(padded.b.shape[1], maxiter)
    t0 = time.perf_counter()
    args = jax.block_until_ready(jax.device_put(padded.arrays(), device))
    t1 = time.perf_counter()
    x = jax.block_until_ready(fn(*args))
    t2 = time.perf_counter()

    def run():
        return jax.block_until_ready(fn(*args))

    return run, args, np.asarray(x), {"transfer_s": t1 - t0, "first_call_s": t2 - t1}


def unpad(padded: Padded, x: np.ndarray) -> list[np.ndarray]:
    """Each system's solution from the padded ``(S, n_max)`` result."""
    return [np.asarray(x[i, :n]) for i, n in enumerate(padded.sizes)]


def relative_residuals(pairs, xs) -> np.ndarray:
    """``||b - A x|| / ||b||`` per system, in float64 on the host (0 where b is 0 and x solves it)."""
    out = []
    for (A, b), x in zip(pairs, xs, strict=True):
        b = np.asarray(b, dtype=np.float64).ravel()
        r = np.linalg.norm(b - sp.csr_matrix(A) @ x)
        nb = np.linalg.norm(b)
        out.append(r / nb if nb > 0 else r)
    return np.asarray(out)


def scipy_cg_iterations(pairs, rtol) -> np.ndarray:
    """Iterations of SciPy's unpreconditioned CG from zero to each system's rtol (JAX's cg counts none)."""
    tols = np.broadcast_to(np.asarray(rtol, dtype=np.float64), (len(pairs),))
    counts = []
    for (A, b), tol in zip(pairs, tols, strict=True):
        k = [0]

        def tick(_xk, k=k):
            k[0] += 1

        spla.cg(A, b, rtol=float(tol), callback=tick)
        counts.append(k[0])
    return np.asarray(counts)
