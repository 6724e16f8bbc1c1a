"""The single-system Krylov engine: CG, BiCGStab, GMRES or MINRES on one prepared operator.

``prepare`` builds what depends on the operator alone (the preconditioner,
and for a CSR matrix with no or a Jacobi preconditioner the fused core's
packed form); ``solve`` then runs the method for each right-hand side. A CSR
matrix with no or a Jacobi preconditioner and no callback takes the fused
batched core (a batch of one system); dense matrices, operators, polynomial
or user preconditioners and callbacks take the generic loops, written once
in ``xp.`` operations for NumPy and CuPy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend
from .batched import BatchedEngine, BatchedPrepared
from .bicgstab import bicgstab, bicgstab_fused
from .cg import cg, cg_fused
from .engine import Options, Outcome, Prepared, default_maxiter
from .gmres import gmres, gmres_fused
from .minres import minres
from .preconditioners import make_preconditioner

_GENERIC: dict[str, Callable[..., Outcome]] = {
    "cg": cg, "bicgstab": bicgstab, "gmres": gmres, "minres": minres}
_FUSED: dict[str, Callable[..., Outcome]] = {
    "cg": cg_fused, "bicgstab": bicgstab_fused, "gmres": gmres_fused}


def is_jacobi(M: Any) -> bool:
    """Whether ``M`` names the Jacobi preconditioner."""
    return isinstance(M, str) and M == "jacobi"


def takes_fused_core(A: Any, kind: str, method: str, M: Any, callback: Any, xp: Any) -> bool:
    """Whether the fused batched core solves this system (CSR, no or Jacobi M, no callback).

    The generic loops are kept for what the fused core cannot do (dense A,
    operators, polynomial or user M, callbacks), not for speed. GMRES takes
    the fused core on a GPU only: on the CPU the generic GMRES's BLAS
    products beat the per-system kernel for one large system.
    """
    if kind != "csr" or method not in _FUSED or callback is not None:
        return False
    if method == "gmres" and xp is np:
        return False
    return M is None or is_jacobi(M)


class KrylovEngine:
    """``prepare(A, options, device)`` for CG, BiCGStab, GMRES and MINRES on one device."""

    name = "krylov"

    def prepare(self, A: Any, options: Options, device: Any, *, kind: str = "csr") -> PreparedKrylov:
        if options.method not in _GENERIC:
            raise ValueError(f"KrylovEngine.prepare(options.method={options.method!r}): expected "
                             f"one of {', '.join(_GENERIC)}.")
        return PreparedKrylov(A, options, device, kind)


class PreparedKrylov(Prepared):
    """A Krylov method with its preconditioner set up for one operator."""

    engine = "krylov"

    def __init__(self, A: Any, options: Options, device: Any, kind: str):
        super().__init__(device, options, A.shape[0])
        self.kind = kind
        self._set_operator(A)
        self._transposed: PreparedKrylov | None = None

    def _set_operator(self, A: Any) -> None:
        self.A = A
        xp = _backend.array_module(A.data if self.kind == "csr" else A) if self.kind != "operator" \
            else None
        self.fused = xp is not None and takes_fused_core(
            A, self.kind, self.options.method, self.options.M, self.options.callback, xp)
        # The fused core builds its Jacobi scaling itself; the generic loops get
        # the preconditioner built once here and reused by every solve.
        self.M = None if self.fused else make_preconditioner(self.options.M, A)
        self._block: BatchedPrepared | None = None  # the fused core for (n, k) blocks, made on use

    def solve(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """``A x = rhs``; on the fused core a (n, k) block is one batch of k systems sharing A.

        The batch reads A once per iteration for all k columns, each column with
        its own scalars and stopping test.
        """
        if self.fused and getattr(rhs, "ndim", 1) == 2:
            self._check_open()
            return self._batched().solve(rhs, x0)
        return super().solve(rhs, x0)

    def _batched(self) -> BatchedPrepared:
        if self._block is None:
            self._block = BatchedEngine().prepare(self.A, self.options)
        return self._block

    def close(self) -> None:
        if self._block is not None:
            self._block.close()
            self._block = None
        super().close()

    @property
    def maxiter(self) -> int:
        o = self.options
        return o.maxiter if o.maxiter is not None else default_maxiter(self.n)

    def _solve_vector(self, b: Any, x0: Any, *, maxiter: int | None = None,
                      first_check: int | None = None) -> Outcome:
        o = self.options
        limit = self.maxiter if maxiter is None else maxiter
        if self.fused:
            kw = {"first_check": first_check if first_check is not None else o.first_check} \
                if o.method != "gmres" else {}
            return _FUSED[o.method](self.A, b, x0=x0, rtol=o.rtol, atol=o.atol, maxiter=limit,
                                    jacobi=is_jacobi(o.M), **kw)
        return _GENERIC[o.method](self.A, b, x0=x0, rtol=o.rtol, atol=o.atol, maxiter=limit,
                                  M=self.M, callback=o.callback)

    def solve_limited(self, b: Any, x0: Any, maxiter: int, *, transpose: bool = False) -> Outcome:
        """One right-hand side with an iteration limit of its own (restarts after drift)."""
        self._check_open()
        if transpose and not self.options.symmetric:
            self._solve_transpose_vector(b, None)  # makes the transposed set-up once
            return self._transposed._solve_vector(b, x0, maxiter=maxiter)
        return self._solve_vector(b, x0, maxiter=maxiter)

    def _solve_transpose_vector(self, b: Any, x0: Any) -> Outcome:
        if self.options.symmetric:
            return self._solve_vector(b, x0)
        if self.kind == "operator":
            if not hasattr(self.A, "rmatvec"):
                raise NotImplementedError(
                    "krylov engine: solve_transpose needs A.T; this operator has no rmatvec. "
                    "Give an operator with rmatvec (scipy.sparse.linalg.LinearOperator).")
        if self._transposed is None:
            AT = self.A.T if self.kind != "operator" else self.A.H
            if self.kind == "csr":
                AT = AT.tocsr()
            self._transposed = PreparedKrylov(AT, self.options, self.device, self.kind)
        return self._transposed._solve_vector(b, x0)

    def update(self, values: Any) -> None:
        """New values of a CSR matrix on the same pattern (``values`` as ``A.data``, or a matrix)."""
        self._check_open()
        if self._block is not None:
            self._block.close()
            self._block = None
        A = same_pattern(self.A, values, self.kind, call="update")
        if isinstance(self.options.M, str) and hasattr(self.M, "update"):
            # M="amg": numeric re-setup of the hierarchy (its aggregates are kept).
            self.A = A
            self.M.update(A)
        else:
            self._set_operator(A)
        self._transposed = None


def same_pattern(A: Any, values: Any, kind: str, *, call: str) -> Any:
    """A new CSR matrix with A's pattern and ``values`` (an array of A.nnz values or a matrix).

    A matrix of another pattern is a ValueError naming the fix.
    """
    if kind != "csr":
        raise ValueError(f"{call}(values): only a sparse (CSR) operator can take new values on "
                         "its pattern; prepare a new solver for this operator.")
    xp = _backend.array_module(A.data)
    if hasattr(values, "indptr"):
        B = values.tocsr()
        if B.shape != A.shape or B.nnz != A.nnz or not (
                bool(xp.array_equal(xp.asarray(B.indptr), A.indptr))  # sync: pattern check, once
                and bool(xp.array_equal(xp.asarray(B.indices), A.indices))):  # sync: as above
            raise ValueError(
                f"{call}(A2): A2 has another sparsity pattern than the prepared matrix "
                f"(shape {B.shape}, {B.nnz} stored entries against {A.shape}, {A.nnz}); "
                "only values may change. Prepare a new solver for a new pattern.")
        data = xp.asarray(B.data)
    else:
        data = xp.asarray(values)
        if data.shape != A.data.shape:
            raise ValueError(f"{call}(values): expected {A.nnz} values (A.data's shape "
                             f"{tuple(A.data.shape)}), got shape {tuple(data.shape)}.")
    data = data.astype(A.dtype, copy=False)
    sparse = _backend.sparse_module(xp)
    return sparse.csr_matrix((data, A.indices, A.indptr), shape=A.shape)
