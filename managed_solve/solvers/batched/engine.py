"""The batched engine in the engine shape: prepare once on a device, then solve.

Two entries, one shape (``prepare(...) -> prepared``, ``prepared.solve(...)``),
one core (:func:`run_core`):

- ``BatchedEngine().prepare(A, options, device)`` packs one operator
  (pattern, values, Jacobi diagonal) on the device once; each ``solve(b)``
  then packs only the right-hand side. A block of k right-hand sides, ``b``
  of shape (n, k), is solved as one batch of k systems sharing the matrix
  (its blocks are tiled once per k on the device and kept), so the columns
  converge, stop and report independently. ``solve()`` takes this entry.
- ``BatchedEngine().prepare_batch(systems, device)`` packs many systems
  (each its own matrix, right-hand side, tolerance and limit) into one
  block-diagonal batch; on a GPU the fused core's workspace is built then
  too. ``solve(method=...)`` solves every system of it. ``solve_many``'s
  batched route takes this entry.

Examples
--------
>>> import numpy as np, scipy.sparse as sp
>>> from managed_solve.solvers.engine import Options
>>> from managed_solve.solvers.batched import BatchedEngine
>>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
>>> prepared = BatchedEngine().prepare(A, Options(method="cg", rtol=1e-10), "cpu")
>>> out = prepared.solve(np.ones(5))
>>> out.code, out.iterations, bool(np.allclose(A @ out.x, 1.0))
(0, 3, True)
>>> [o.iterations for o in prepared.solve(np.stack([np.ones(5), np.arange(5.0)], axis=1))]
[3, 5]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ... import _backend
from ...device_args import cuda_ordinal
from ...system.linear_system import default_maxiter
from ..engine import BREAKDOWN, Options, Outcome, Prepared
from . import gpu
from .arguments import check_batch
from .cpu import solve_fused
from .gmres import gmres_batched
from .gpu import prepare as prepare_workspace
from .outcome import BatchOutcome
from .packed import PackedBatch
from .workspace import GMRES_RESTART

METHODS = ("cg", "bicgstab", "gmres")

_BREAKDOWN_MESSAGES = {
    "cg": "CG broke down (p.Ap <= 0 or r.z = 0): A may not be symmetric positive definite "
          "(try method='bicgstab' or 'gmres').",
    "bicgstab": "BiCGStab broke down (rho, r~.v or omega vanished); try method='gmres'.",
    "gmres": "GMRES produced a non-finite residual; check A, b and the preconditioner for NaN/Inf.",
}


class BatchedEngine:
    """The batched Krylov core (CG, BiCGStab, GMRES; Jacobi or no preconditioner) as an engine."""

    name = "batched"

    def prepare(self, operator: Any, options: Options, device: Any = None) -> BatchedPrepared:
        """Pack ``operator`` (a SciPy or cupyx sparse matrix) on ``device`` for repeated solves.

        Parameters
        ----------
        operator : sparse matrix, shape (n, n)
            Converted to CSR; float32 or float64.
        options : Options
            ``method`` one of 'cg', 'bicgstab', 'gmres'; ``M`` None or
            ``"jacobi"``; no ``callback`` (the fused loops call none).
        device : str, optional
            ``"cpu"`` (or ``"sim:k"``: host arrays) or ``"cuda:i"``; None
            keeps the operator where it lies.

        Raises
        ------
        ValueError
            An unsupported method, preconditioner or callback, or a non-square matrix.
        TypeError
            An operator that is not a sparse matrix, or an unsupported dtype.
        """
        return BatchedPrepared(operator, options, device)

    def prepare_batch(self, systems: Any, device: Any = "cpu", *, jacobi: bool = False,
                      method: str | Callable[[], str] | None = None) -> PreparedBatch:
        """Pack many systems into one block-diagonal batch on ``device``, for :meth:`PreparedBatch.solve`.

        Parameters
        ----------
        systems : sequence of LinearSystem, or PackedBatch
            CSR systems (packed here, host systems in bulk:
            :meth:`PackedBatch.pack`), or a batch packed already.
        device : str
            ``"cpu"``, ``"sim:k"`` (host arrays) or ``"cuda:i"``.
        jacobi : bool
            Pack each system's inverse diagonal (Jacobi preconditioning).
        method : str or callable, optional
            The batch's method, or a function that finds it (called only
            where a workspace is built). On a GPU, for CG and BiCGStab, the
            fused core's workspace and first CUDA graph are built now, on the
            current stream (the caller synchronises it before solving).

        Examples
        --------
        >>> import numpy as np, scipy.sparse as sp
        >>> from managed_solve import LinearSystem
        >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
        >>> prepared = BatchedEngine().prepare_batch([LinearSystem(A, np.ones(5)),
        ...                                           LinearSystem(2 * A, np.ones(5))])
        >>> out = prepared.solve(method="cg")
        >>> out.status.tolist(), out.iterations.tolist()
        ([0, 0], [3, 3])
        """
        return PreparedBatch(systems, device, jacobi=jacobi, method=method)


class PreparedBatch:
    """Many systems packed on one device (:meth:`BatchedEngine.prepare_batch`); ``solve`` runs them all."""

    engine = "batched"

    def __init__(self, systems: Any, device: Any = "cpu", *, jacobi: bool = False,
                 method: str | Callable[[], str] | None = None):
        batch = systems if isinstance(systems, PackedBatch) else \
            PackedBatch.pack(systems, device=str(device), jacobi=jacobi)
        if batch.xp is not np and method is not None:
            method = method() if callable(method) else method
            if method in ("cg", "bicgstab"):  # the fused core's; GMRES has none
                prepare_workspace(batch, method)
        self.batch = batch
        self.method = method if isinstance(method, str) else None

    def solve(self, rhs: Any = None, x0: Any = None, *, method: str | None = None) -> BatchOutcome:
        """Solve every system of the batch; each keeps its own scalars, stopping rule and status.

        The outcome carries each system's true residual and right-hand side
        norms (``BatchOutcome.true_norms``), the figures a caller verifies.

        ``rhs``/``x0``: packed vectors of the batch's rows replacing the
        systems' own (None: theirs). ``method``: default the one given to
        ``prepare_batch``.
        """
        method = method or self.method
        if method is None:
            raise ValueError("PreparedBatch.solve(method=None): give the method ('cg', "
                             "'bicgstab' or 'gmres'); prepare_batch was given none.")
        batch = self.batch
        if rhs is not None or x0 is not None:
            batch = PackedBatch(indptr=batch.indptr, indices=batch.indices, data=batch.data,
                                b=batch.b if rhs is None else rhs,
                                x0=batch.x0 if x0 is None else x0, offsets=batch.offsets,
                                row_sys=batch.row_sys, rtol=batch.rtol, atol=batch.atol,
                                maxiter=batch.maxiter, dinv=batch.dinv, device=batch.device,
                                names=batch.names)
        return run_core(batch, method, true_norms=True)


def run_core(batch: PackedBatch, method: str, *, first_check: int | None = None,
             true_norms: bool = False) -> BatchOutcome:
    """The batched core of ``method`` ("cg", "bicgstab" or "gmres") on a packed batch.

    CG and BiCGStab go straight to their loop on the batch's device (the
    fused CUDA loop of :mod:`.gpu`, or the host kernels of :mod:`.cpu`): the
    engine packed the batch itself, so the public drivers' argument checks
    (:func:`.cg.cg_batched`) have nothing to check but a learned
    ``first_check``. ``true_norms``: the outcome carries each system's
    ``(||b_s - A_s x_s||, ||b_s||)`` (``BatchOutcome.true_norms``),
    computed where the core did not compute them already.
    """
    if method == "gmres":
        out = gmres_batched(batch, restart=GMRES_RESTART)
    elif method not in ("cg", "bicgstab"):
        raise ValueError(f"the batched engine runs 'cg', 'bicgstab' or 'gmres', not {method!r}")
    else:
        if first_check is not None:
            check_batch(batch, f"{method}_batched(batch)", None, first_check)
        if batch.xp is not np:
            out = BatchOutcome(*gpu.solve(batch, method, None, first_check, true_norms=true_norms))
        else:
            out = solve_fused(batch, method)
    if true_norms and out.true_norms is None:
        out.true_norms = system_norms(batch, out.x, method)
    return out


def system_norms(batch: PackedBatch, x: Any, method: str = "cg") -> tuple[np.ndarray, np.ndarray]:
    """Per-system ``||b_s - A_s x_s||`` and ``||b_s||`` of a batch and its solution, on the host.

    On a GPU one fused kernel of ``method``'s module
    (:func:`.gpu.residual_norms`); on the host one product and two bincounts.
    """
    if batch.xp is not np:
        return gpu.residual_norms(batch, x, method)
    n = int(batch.n)
    A = _backend.sparse_module(np).csr_matrix((batch.data, batch.indices, batch.indptr), shape=(n, n))
    r = batch.b - A @ x
    seg = batch.row_sys
    return (np.sqrt(np.bincount(seg, weights=r * r, minlength=batch.nsys)),
            np.sqrt(np.bincount(seg, weights=batch.b * batch.b, minlength=batch.nsys)))


class BatchedPrepared(Prepared):
    """A CSR matrix packed on one device; ``solve`` packs only the right-hand sides."""

    engine = "batched"

    def __init__(self, operator: Any, options: Options, device: Any = None):
        call = "BatchedEngine.prepare"
        if options.method not in METHODS:
            raise ValueError(f"{call}(options.method={options.method!r}): the batched engine runs "
                             "'cg', 'bicgstab' or 'gmres'; use the generic Krylov engine for others.")
        if not (options.M is None or (isinstance(options.M, str) and options.M == "jacobi")):
            raise ValueError(f"{call}(options.M={options.M!r}): the batched engine takes M=None or "
                             "M='jacobi'; use the generic Krylov engine for other preconditioners.")
        if options.callback is not None:
            raise ValueError(f"{call}(options.callback=...): the batched engine calls no callback; "
                             "use the generic Krylov engine to observe iterates.")
        A = _on_device(operator, device, call)
        super().__init__(_device_name(A), options, A.shape[0])
        self.A = A
        self.jacobi = isinstance(options.M, str) and options.M == "jacobi"
        self._pack(A)

    # ------------------------------------------------------------------ set-up
    def _pack(self, A: Any) -> None:
        """The batch of one system whose arrays every solve shares (the right-hand side aside)."""
        xp = _backend.array_module(A.data)
        self.base = PackedBatch.from_csr(A, xp.zeros(self.n, dtype=A.dtype), jacobi=self.jacobi)
        self._tiled: dict[int, PackedBatch] = {}
        self._transpose: BatchedPrepared | None = None

    def update(self, values: Any) -> None:
        """New values on the same pattern: a sparse matrix with this pattern, or its ``data`` array.

        Raises
        ------
        ValueError
            A matrix with another sparsity pattern, or a values array of the wrong length.
        """
        self._check_open()
        call = "BatchedPrepared.update(values)"
        A = self.A
        if _backend.is_scipy_sparse(values) or _backend.is_cupy_sparse(values):
            new = _on_device(values, self.device, call)
            if new.shape != A.shape or not _same_pattern(new, A):
                raise ValueError(f"{call}: the matrix has another sparsity pattern than the one "
                                 "prepared (update() re-uses the pattern); prepare the new matrix "
                                 "with BatchedEngine().prepare(A, options, device) instead.")
            data = new.data
        else:
            data = values
            if tuple(getattr(data, "shape", ())) != (A.nnz,):
                raise ValueError(f"{call}: expected {A.nnz} values (one per stored entry of the "
                                 f"prepared pattern), got shape {tuple(getattr(data, 'shape', ()))}; "
                                 "for another pattern prepare the new matrix instead.")
        xp = _backend.array_module(A.data)
        data = xp.asarray(data).astype(A.dtype, copy=True)
        sps = _backend.sparse_module(xp)
        self.A = sps.csr_matrix((data, A.indices, A.indptr), shape=A.shape)
        self._pack(self.A)

    # ------------------------------------------------------------------ solving
    def solve(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """Solve ``A x = rhs``; a (n, k) ``rhs`` is one batch of k systems, k outcomes back."""
        self._check_open()
        return self._solve_block(rhs, x0)

    def solve_transpose(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """Solve ``A^T x = rhs``: the same set-up when symmetric, else the transpose prepared once."""
        self._check_open()
        if self.options.symmetric:
            return self._solve_block(rhs, x0)
        if self._transpose is None:
            self._transpose = BatchedPrepared(self.A.T.tocsr(), self.options, self.device)
        return self._transpose.solve(rhs, x0)

    @property
    def transposed(self) -> BatchedPrepared | None:
        """The transpose prepared by :meth:`solve_transpose` (None until needed, or when symmetric)."""
        return self._transpose

    def _solve_vector(self, b: Any, x0: Any) -> Outcome:
        return self._solve_block(b, x0)

    def _solve_block(self, rhs: Any, x0: Any) -> Outcome | list[Outcome]:
        xp = _backend.array_module(self.A.data)
        b = xp.asarray(rhs)
        one = b.ndim == 1
        if b.ndim not in (1, 2) or b.shape[0] != self.n:
            raise ValueError(f"BatchedPrepared.solve(rhs): rhs must have shape ({self.n},) or "
                             f"({self.n}, k), got {tuple(b.shape)}")
        k = 1 if one else int(b.shape[1])
        if x0 is not None and tuple(x0.shape) != tuple(b.shape):
            raise ValueError(f"BatchedPrepared.solve(x0=...): x0 must have rhs's shape "
                             f"{tuple(b.shape)}, got {tuple(x0.shape)}")
        if k == 0:
            return []
        dt = self.base.dtype
        # Column-major flattening: system s's rows are column s.
        packed_b = (b if one else b.T).reshape(-1).astype(dt, copy=True)
        packed_x0 = None
        if x0 is not None:
            x0 = xp.asarray(x0)
            packed_x0 = (x0 if one else x0.T).reshape(-1).astype(dt, copy=True)
        batch = self._batch(k, packed_b, packed_x0)
        out = self._run(batch)
        outcomes = [self._outcome(out, s, out.x[s * self.n:(s + 1) * self.n]) for s in range(k)]
        return outcomes[0] if one else outcomes

    def _batch(self, k: int, b: Any, x0: Any) -> PackedBatch:
        """A batch of k copies of the prepared system with these right-hand sides (arrays shared)."""
        base = self._tiled.get(k)
        if base is None:
            base = self.base if k == 1 else _tile(self.base, k)
            self._tiled[k] = base
        opts = self.options
        maxiter = default_maxiter(self.n) if opts.maxiter is None else int(opts.maxiter)
        return PackedBatch(indptr=base.indptr, indices=base.indices, data=base.data, b=b, x0=x0,
                           offsets=base.offsets, row_sys=base.row_sys,
                           rtol=np.full(k, float(opts.rtol)), atol=np.full(k, float(opts.atol)),
                           maxiter=np.full(k, maxiter, dtype=np.int64), dinv=base.dinv,
                           device=base.device)

    def _run(self, batch: PackedBatch) -> BatchOutcome:
        return run_core(batch, self.options.method, first_check=self.options.first_check)

    def _outcome(self, out: BatchOutcome, s: int, x: Any) -> Outcome:
        code = int(out.status[s])
        msg = _BREAKDOWN_MESSAGES[self.options.method] if code == BREAKDOWN else ""
        return Outcome(x, code, int(out.iterations[s]), float(out.residual_norms[s]), msg,
                       host_syncs=int(out.host_syncs),
                       info={"path": "batched", "checkpoints": int(out.checkpoints),
                             "gpu_seconds": out.gpu_seconds, "systems": int(out.status.shape[0])})

    def close(self) -> None:
        """Drop the packed operator and its tilings (idempotent)."""
        if self._transpose is not None:
            self._transpose.close()
        self._tiled = {}
        self._transpose = None
        super().close()


def _tile(base: PackedBatch, k: int) -> PackedBatch:
    """k copies of a one-system batch as one block-diagonal batch, built on its device."""
    xp = base.xp
    n, nnz = base.n, base.nnz
    idt = base.index_dtype
    if max(k * n, k * nnz) > np.iinfo(np.int32).max and idt == np.int32:
        idt = np.dtype(np.int64)
    shift = xp.arange(k, dtype=idt)
    indptr = xp.empty(k * n + 1, dtype=idt)
    indptr[:-1] = (base.indptr[:-1].astype(idt)[None, :] + (shift * nnz)[:, None]).reshape(-1)
    indptr[-1] = k * nnz
    indices = (base.indices.astype(idt)[None, :] + (shift * n)[:, None]).reshape(-1)
    data = xp.tile(base.data, k)
    dinv = None if base.dinv is None else xp.tile(base.dinv, k)
    row_sys = xp.repeat(xp.arange(k, dtype=np.int32), n)
    offsets = np.arange(k + 1, dtype=np.int64) * n
    return PackedBatch(indptr=indptr, indices=indices, data=data, b=None, x0=None,
                       offsets=offsets, row_sys=row_sys, rtol=np.zeros(k), atol=np.zeros(k),
                       maxiter=np.zeros(k, dtype=np.int64), dinv=dinv, device=base.device)


def _on_device(A: Any, device: Any, call: str) -> Any:
    """A as a CSR matrix on ``device`` (None: where it lies)."""
    if not (_backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)):
        raise TypeError(f"{call}: expected a SciPy or cupyx sparse matrix, got {type(A).__name__}; "
                        "convert it with scipy.sparse.csr_matrix(A).")
    if A.shape[0] != A.shape[1]:
        raise ValueError(f"{call}: A must be square, got shape {A.shape}.")
    A = A if A.format == "csr" else A.tocsr()
    if device is None:
        return A
    idx = cuda_ordinal(device, what=f"{call}(device=...)")
    if idx is not None:
        cp = _backend.cupy()
        if _backend.is_cupy_sparse(A) and A.data.device.id == idx:
            return A
        with cp.cuda.Device(idx):
            return _backend.cupyx_sparse().csr_matrix(_backend.to_host(A))
    return _backend.to_host(A) if _backend.is_cupy_sparse(A) else A


def _device_name(A: Any) -> str:
    return f"cuda:{A.data.device.id}" if _backend.is_cupy_sparse(A) else "cpu"


def _same_pattern(new: Any, old: Any) -> bool:
    xp = _backend.array_module(old.data)
    return (new.nnz == old.nnz
            and bool(xp.array_equal(new.indptr, old.indptr))  # sync: one read at update
            and bool(xp.array_equal(new.indices, old.indices)))  # sync: one read at update
