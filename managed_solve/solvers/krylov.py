"""The single-system Krylov engine: CG, BiCGStab, GMRES or MINRES on one prepared operator.

``prepare`` builds what depends on the operator alone (the preconditioner,
and for a CSR matrix with no or a Jacobi preconditioner the fused core's
packed form); ``solve`` then runs the method for each right-hand side. A CSR
matrix with no or a Jacobi preconditioner and no callback takes the fused
batched core (a batch of one system); dense matrices, operators, polynomial
or user preconditioners and callbacks take the generic loops, written once
in ``xp.`` operations for NumPy and CuPy.

Several right-hand sides, an (n, k) block, go through the block Krylov loop
(:mod:`managed_solve.solvers.block`: one SpMM per product for all columns)
for CG and BiCGStab where :func:`takes_block_loop` says so; on the host the
fused core keeps a block of a CSR matrix with no or a Jacobi preconditioner
(its per-system Numba loops, each column's vectors in cache, beat the block
passes there).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend
from ..system.inputs import check_dtype
from ..system.linear_system import default_maxiter
from ._common import (
    CONVERGED,
    DROPPED_START,
    HOPELESS_START,
    hopeless_start,
    stable_norm,
    start_residual_norm,
    stop_threshold,
    transposed_operator,
)
from .amg.pcg import BoundCG, amg_of, bind, takes_bound_loop
from .batched import BatchedEngine, BatchedPrepared
from .bicgstab import bicgstab, bicgstab_fused
from .block import METHODS as BLOCK_METHODS
from .block import block_solve
from .cg import cg, cg_fused
from .engine import Options, Outcome, Prepared
from .gmres import gmres, gmres_fused
from .minres import minres
from .preconditioners import (
    block_preconditioner,
    check_jacobi_diagonal,
    inverse_diagonal,
    make_preconditioner,
)

_GENERIC: dict[str, Callable[..., Outcome]] = {
    "cg": cg, "bicgstab": bicgstab, "gmres": gmres, "minres": minres}
_FUSED: dict[str, Callable[..., Outcome]] = {
    "cg": cg_fused, "bicgstab": bicgstab_fused, "gmres": gmres_fused}


def is_jacobi(M: Any) -> bool:
    """Whether ``M`` names the Jacobi preconditioner."""
    return isinstance(M, str) and M == "jacobi"


def check_hint(M: Any) -> int | None:
    """A preconditioner's ``check_every`` (on it, or on the object of its bound ``matvec``)."""
    hint = getattr(M, "check_every", None)
    return hint if hint is not None else getattr(getattr(M, "__self__", None), "check_every", None)


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


def takes_block_loop(kind: str, method: str, callback: Any, xp: Any, fused: bool) -> bool:
    """Whether an (n, k) right-hand side runs as one block Krylov loop (CG, BiCGStab).

    A sparse or dense matrix (the product with a block is one SpMM or GEMM)
    and no callback (it would need each column's iterate alone). On the
    host a CSR matrix that the fused core takes stays there: its per-column
    Numba loops keep each column's vectors in cache and beat the block's
    passes over the whole (n, k) block.
    """
    if method not in BLOCK_METHODS or callback is not None or kind not in ("csr", "dense"):
        return False
    return xp is not np or not fused


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
        """Take ``A`` and what depends on it; where that raises (a preconditioner A cannot
        have, such as Jacobi's on a zero diagonal) the engine keeps its previous operator."""
        xp = _backend.array_module(A.data if self.kind == "csr" else A) if self.kind != "operator" \
            else None
        o = self.options
        fused = xp is not None and takes_fused_core(A, self.kind, o.method, o.M, o.callback, xp)
        # The fused core builds its Jacobi scaling itself; the generic loops get
        # the preconditioner built once here and reused by every solve.
        M = None if fused else make_preconditioner(o.M, A)
        if fused and is_jacobi(o.M):
            check_jacobi_diagonal(A)
        block_loop = xp is not None and takes_block_loop(self.kind, o.method, o.callback, xp, fused)
        # CG with an AMG preconditioner on a GPU: the cycle bound to the loop's
        # vectors, an iteration one CUDA graph (made on the first solve).
        bound = not fused and takes_bound_loop(A, self.kind, o.method, M, o.callback)
        self.A, self.fused, self.M, self.block_loop, self.bound = A, fused, M, block_loop, bound
        self._block: BatchedPrepared | None = None  # the fused core for (n, k) blocks, made on use
        self._block_M: tuple[Any, Any] | None = None  # (M on blocks, Jacobi's dinv), made on use
        self._bound: BoundCG | None = None

    def solve(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """``A x = rhs``; a (n, k) block is solved together, k outcomes back.

        The block Krylov loop (or the fused core's batch of k systems sharing
        A) reads A once per iteration for all k columns, each column with its
        own scalars and stopping test.
        """
        if getattr(rhs, "ndim", 1) == 2:
            self._check_open()
            if self.block_loop:
                return self._columns_from_zero(rhs, x0, self._solve_block(rhs, x0))
            if self.fused:
                return self._columns_from_zero(rhs, x0, self._batched().solve(rhs, x0))
        return super().solve(rhs, x0)

    def _columns_from_zero(self, B: Any, X0: Any, outs: list[Outcome]) -> list[Outcome]:
        """The block's columns that failed from a hopeless start, solved again from x = 0.

        As :meth:`_solve_vector` does for one right-hand side; a new answer
        is written into the block's ``x`` too, which the caller may hand on whole.
        """
        if X0 is None or all(out.code == CONVERGED for out in outs):
            return outs
        xp = _backend.array_module(B)
        for j, out in enumerate(outs):
            b = xp.ascontiguousarray(B[:, j])
            again = self._from_zero_if_hopeless(b, xp.ascontiguousarray(X0[:, j]), out,
                                                self.maxiter, None)
            if again is out:
                continue
            block = getattr(outs, "x", None)
            if block is not None:
                block[:, j] = again.x
                again.x = block[:, j]
            outs[j] = again
        return outs

    def solve_transpose(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """``A^T x = rhs``; a block on the transpose prepared once, solved together."""
        if getattr(rhs, "ndim", 1) == 2 and not self.options.symmetric and \
                (self.block_loop or self.fused):
            self._check_open()
            return self._transpose().solve(rhs, x0)
        return super().solve_transpose(rhs, x0)

    def _solve_block(self, B: Any, X0: Any) -> list[Outcome]:
        o = self.options
        if self._block_M is None:
            if is_jacobi(o.M):
                self._block_M = (None, inverse_diagonal(self.A))
            else:
                self._block_M = (block_preconditioner(o.M, self.M), None)
        M, dinv = self._block_M
        return block_solve(o.method, self.A, B, X0=X0, rtol=o.rtol, atol=o.atol,
                           maxiter=self.maxiter, M=M, dinv=dinv)

    def _batched(self) -> BatchedPrepared:
        if self._block is None:
            self._block = BatchedEngine().prepare(self.A, self.options)
        return self._block

    def close(self) -> None:
        self._bound = None
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
        """One right-hand side; a failure from a hopeless ``x0`` is solved again from x = 0.

        An initial guess whose residual overflows, or lies beyond ``||b||``
        and past what float rounding resolves toward the tolerance
        (:func:`~managed_solve.solvers._common.hopeless_start`), breaks every
        method down in ways that read as properties of A (non-positive
        curvature, a vanishing inner product, b outside the range). The
        guess is judged only after a failure, so a solve that converges pays
        nothing for the test; the retry starts from x = 0 with the iterations
        left, and its outcome records the dropped guess's residual (or, with
        none left, the failed outcome records the hopeless one).
        """
        limit = self.maxiter if maxiter is None else maxiter
        return self._from_zero_if_hopeless(b, x0, self._run(b, x0, limit, first_check), limit,
                                           first_check)

    def _from_zero_if_hopeless(self, b: Any, x0: Any, out: Outcome, limit: int,
                               first_check: int | None) -> Outcome:
        """``out``, or where it failed from a hopeless ``x0``, the solve again from x = 0."""
        if x0 is None or out.code == CONVERGED:
            return out
        o = self.options
        r0 = start_residual_norm(self.A, b, x0)
        bn = stable_norm(_backend.array_module(b), b)  # sync: after a failure from an x0 only
        if not hopeless_start(r0, bn, stop_threshold(o.rtol, o.atol, bn), b.dtype):
            return out
        if out.iterations >= limit:  # no iterations left to try x = 0: the status says why
            out.info[HOPELESS_START] = r0
            return out
        again = self._run(b, None, limit - out.iterations, first_check)
        again.iterations += out.iterations
        again.host_syncs += out.host_syncs + 2
        again.info[DROPPED_START] = r0
        return again

    def _run(self, b: Any, x0: Any, limit: int, first_check: int | None) -> Outcome:
        o = self.options
        if self.fused:
            kw = {"first_check": first_check if first_check is not None else o.first_check} \
                if o.method != "gmres" else {}
            return _FUSED[o.method](self.A, b, x0=x0, rtol=o.rtol, atol=o.atol, maxiter=limit,
                                    jacobi=is_jacobi(o.M), **kw)
        if self.bound:
            return self._bound_loop().solve(b, x0, rtol=o.rtol, atol=o.atol, maxiter=limit)
        # A preconditioner that costs milliseconds an application (an AMG cycle)
        # says so with ``check_every``: a host read every iteration then costs
        # little beside it, and no iterations run past convergence.
        return _GENERIC[o.method](self.A, b, x0=x0, rtol=o.rtol, atol=o.atol, maxiter=limit,
                                  M=self.M, callback=o.callback,
                                  check_every=check_hint(self.M))

    def _bound_loop(self) -> BoundCG:
        """The bound AMG-CG loop, made again when A or the hierarchy's cycle changed."""
        loop, cycle = self._bound, amg_of(self.M).fused_cycle
        if loop is None or loop.cycle is not cycle or loop.A3[2] is not self.A.data:
            self._bound = None  # the old loop's vectors and graph go before the new ones come
            self._bound = bind(self.A, self.M)
        return self._bound

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
        return self._transpose()._solve_vector(b, x0)

    def _transpose(self) -> PreparedKrylov:
        """The method prepared on A^T (made once)."""
        if self._transposed is None:
            AT = self.A.T if self.kind != "operator" else transposed_operator(self.A)
            if self.kind == "csr":
                AT = AT.tocsr()
            self._transposed = PreparedKrylov(AT, self.options, self.device, self.kind)
        return self._transposed

    def update(self, values: Any) -> None:
        """New values: a CSR matrix's on its pattern (``A.data``'s form, or a matrix), or a
        dense matrix of A's shape.

        Where the new values are refused (a matrix of another pattern, a
        preconditioner they cannot have) the engine keeps its previous
        operator and set-up.
        """
        self._check_open()
        A = same_pattern(self.A, values, self.kind, call="update")
        block = self._block
        if isinstance(self.options.M, str) and hasattr(self.M, "update"):
            # M="amg": numeric re-setup of the hierarchy (its aggregates are kept).
            self.M.update(A)
            self.A = A
            self._block, self._block_M, self._bound = None, None, None
        else:
            if self.options.M is not None and hasattr(self.options.M, "update"):
                # The caller's own preconditioner object (an AMG hierarchy, say) stays
                # theirs: others may share it. Left on the old values it may cost
                # thousands of iterations, so say so once per update.
                warnings.warn(
                    f"update: M is the caller's {type(self.options.M).__name__}, built on the "
                    "previous values and not refreshed here; call M.update(A) with the new "
                    "matrix too, or pass M='amg' to let the solver refresh its own.",
                    RuntimeWarning, stacklevel=3)
            self._set_operator(A)
        if block is not None:
            block.close()
        self._transposed = None


def same_pattern(A: Any, values: Any, kind: str, *, call: str, arg: str = "A2") -> Any:
    """A new CSR matrix with A's pattern and ``values`` (an array of A.nnz values or a matrix).

    A dense A's pattern is its shape: ``values`` is then a matrix of that
    shape. A matrix of another pattern is a ValueError naming the fix, and
    the new matrix as the caller's argument ``arg`` (``Solver.update(A)``).
    """
    if kind == "dense":
        xp = _backend.array_module(A)
        new = xp.asarray(values) if xp is not np else np.asarray(_backend.to_host(values))
        if new.shape != A.shape:
            raise ValueError(f"{call}({arg}): expected a matrix of shape {A.shape}, got "
                             f"{tuple(new.shape)}; prepare a new solver for a new shape.")
        check_dtype(new.dtype, call=f"{call}({arg})", arg=arg)
        return new.astype(A.dtype, copy=False)
    if kind != "csr":
        raise ValueError(f"{call}(values): an operator has no values to update; prepare a new "
                         "solver for the new operator.")
    xp = _backend.array_module(A.data)
    if hasattr(values, "indptr"):
        B = values.tocsr()
        if B.shape != A.shape or B.nnz != A.nnz or not (
                bool(xp.array_equal(xp.asarray(B.indptr), A.indptr))  # sync: pattern check, once
                and bool(xp.array_equal(xp.asarray(B.indices), A.indices))):  # sync: as above
            raise ValueError(
                f"{call}({arg}): {arg} has another sparsity pattern than the prepared matrix "
                f"(shape {B.shape}, {B.nnz} stored entries against {A.shape}, {A.nnz}); "
                "only values may change. Prepare a new solver for a new pattern.")
        data = xp.asarray(B.data)
    else:
        data = xp.asarray(values)
        if data.shape != A.data.shape:
            raise ValueError(f"{call}(values): expected {A.nnz} values (A.data's shape "
                             f"{tuple(A.data.shape)}), got shape {tuple(data.shape)}.")
    check_dtype(data.dtype, call=f"{call}(values)", arg="the new values")
    data = data.astype(A.dtype, copy=False)
    sparse = _backend.sparse_module(xp)
    return sparse.csr_matrix((data, A.indices, A.indptr), shape=A.shape)
