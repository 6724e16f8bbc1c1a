"""Direct sparse solves: supernodal Cholesky or SciPy SuperLU on the CPU, cuDSS or cuSOLVER on a GPU.

Symmetric positive definite host matrices are factorised by our supernodal
Cholesky (:mod:`managed_solve.solvers.cholesky`), whose analysis is kept so
that :meth:`PreparedDirect.update` redoes only the numeric work; others (and
one that proves indefinite) by SuperLU.

A singular matrix is reported as a ``BREAKDOWN`` outcome with a message
naming the fix, never as a crash: SuperLU raises on an exactly zero pivot,
and GPU factorisations return non-finite or wrong solutions, which the final
residual check catches.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any

import numpy as np

from .. import _backend, config
from .._threads import run_claimed, threads_for
from ._common import (
    BREAKDOWN,
    CONVERGED,
    MAXITER,
    Outcome,
    column_norms,
    stable_norm,
    wide_residual,
)
from .cholesky import Cholesky, NotPositiveDefinite, eligible
from .engine import BlockOutcomes, Options, Prepared
from .nullspace import INCOMPLETE, NOT_SOLVED, Grounding

log = logging.getLogger("managed_solve")

SINGULAR = (
    "A is singular (or numerically singular): the LU factorisation met a zero pivot or gave a "
    "non-finite solution. Check the boundary conditions (a pure Neumann problem needs one "
    "fixed value), or use method='gmres'/'minres' for a least-squares-like solution."
)

# A direct solve is exact up to rounding; a residual above this multiple of
# eps * (||A|| ||x|| + ||b||) means the factorisation hid a singularity. So does
# ||A|| ||x|| above 1 / (64 eps) ||b|| (a pivot of rounding size) where
# refinement leaves the residual above sqrt(eps) ||b||.
_BACKWARD_ERROR_LIMIT, SINGULAR_GROWTH_EPS = 1e6, 1 / 64


def direct(A: Any, b: Any, *, symmetric: bool | None = None, rtol: float | None = None,
           atol: float = 0.0) -> Outcome:
    """Solve ``A x = b`` by sparse LU (dense LU for a dense A).

    Parameters
    ----------
    A : sparse CSR matrix or dense array
        On the device of ``b``.
    b : array, shape (n,)
    symmetric : bool, optional
        Structurally and numerically symmetric A: SuperLU then prefers
        diagonal pivots and orders by nested dissection from
        ``NESTED_DISSECTION_MIN_ROWS`` rows (minimum degree on ``A^T + A``
        below): less fill for PDE matrices than COLAMD. cuDSS is told the
        matrix type.
        On a GPU, cuDSS keeps the analysis of recent matrices: a later solve
        with the same sparsity pattern skips it, one with the same matrix
        only solves (``info["cudss_reused"]``: "none", "plan" or "factors";
        :func:`managed_solve.solvers.release_factorisations` frees them).
    rtol, atol : float, optional
        When given, the answer is refined (a few steps of iterative
        refinement on the same factors) until ``||b - A x|| <= max(rtol
        ||b||, atol)``; ``info["refinements"]`` counts the steps.

    Returns
    -------
    Outcome
        ``code`` 0 solved, 2 singular (``x`` is None then).

    See Also
    --------
    scipy.sparse.linalg.splu : the CPU factorisation used.
    managed_solve.solve : the public entry point (``method="direct"``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.direct import direct
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5)).tocsr()
    >>> out = direct(A, np.ones(5), symmetric=True)
    >>> out.code, np.round(out.x, 6).tolist()
    (0, [2.5, 4.0, 4.5, 4.0, 2.5])
    """
    options = Options("direct", rtol=rtol if rtol is not None else float("nan"), atol=atol,
                      symmetric=symmetric)
    try:
        prepared = DirectEngine().prepare(A, options, None)
    except Singular as exc:
        return Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
    try:
        return prepared.solve(b)
    finally:
        prepared.close()  # one solve: the factors go (on a GPU, back to cuDSS's cache)


#: Steps of iterative refinement on the same factors before a direct solve
#: reports that it could not meet the tolerance.
REFINEMENT_STEPS = 3


class Singular(Exception):
    """A factorisation met an exactly zero pivot (or the dense LU reported a singular matrix)."""


class DirectEngine:
    """``prepare(A, options, device)``: factorise once; solve, transpose-solve and refactor after.

    ``nullspace``: an orthonormal (n, k) basis of A's null space, on A's device
    (:mod:`managed_solve.solvers.nullspace`): x is then the solution orthogonal to it.
    """

    name = "direct"

    def prepare(self, A: Any, options: Options, device: Any, *,
                nullspace: Any = None) -> PreparedDirect:
        return PreparedDirect(A, options, device, nullspace=nullspace)


class PreparedDirect(Prepared):
    """The factors of one matrix (SuperLU or dense LU on the CPU; cuDSS or cuSOLVER on a GPU).

    The answer is judged by its true residual and backward error, never by a
    pivot heuristic: a badly scaled but solvable matrix (a high-contrast
    coefficient, a sliver element) keeps its correct solution.
    """

    engine = "direct"

    def __init__(self, A: Any, options: Options, device: Any, *, nullspace: Any = None):
        super().__init__(device, options, A.shape[0])
        self.grounding = Grounding(A, nullspace) if nullspace is not None else None
        self._factor(A)

    def _factor(self, A: Any, cholesky: bool = True) -> None:
        """Factors of A, or of A grounded (the matrix factorised, ``self.factored``) for a null space."""
        try:
            self._factor_matrix(A, cholesky)
        except Singular as exc:
            if self.grounding is None:
                raise
            raise Singular(f"{exc}; {INCOMPLETE}") from exc

    def _factor_matrix(self, A: Any, cholesky: bool) -> None:
        self._release_held()
        self.A = A  # residuals are A's; the factors are of A grounded where a null space is given
        self.factored = A if self.grounding is None else self.grounding.matrix(A)
        A = self.factored
        xp = _backend.array_module(A.data if _is_sparse(A) else A)
        self.xp = xp
        self.how = ""
        self._lu: Any = None
        # On a GPU, cuDSS's factors of A held for this engine (made at the first
        # solve, which has the right-hand side nvmath needs); False: not to be had.
        self._held: Any = None
        if xp is np:
            if _is_sparse(A):
                self._lu, self.how = host_factor(A, self.options.symmetric, cholesky=cholesky)
            else:
                from scipy.linalg import get_lapack_funcs

                # LAPACK's getrf itself, as scipy.linalg.lu_factor calls it, but with
                # its info read here: a zero pivot is this engine's Singular, not a
                # LinAlgWarning for the caller (warning filters are process-wide).
                a = np.array(A, order="F")
                (getrf,) = get_lapack_funcs(("getrf",), (a,))
                with np.errstate(all="ignore"):
                    lu, piv, info = getrf(a, overwrite_a=True)
                if info < 0:
                    raise ValueError(f"LAPACK getrf: argument {-info} is invalid")
                if info > 0 or not np.all(np.diagonal(lu)):
                    raise Singular("the dense LU met an exactly zero pivot")
                self._lu = (lu, piv)
                self.how = "LAPACK LU (getrf, as scipy.linalg.lu_factor)"

    @property
    def factor_bytes(self) -> int:
        """Host bytes the factors hold (0 on a GPU, whose libraries factorise per solve)."""
        lu = self._lu
        if lu is None:
            return 0
        if isinstance(lu, tuple):  # dense LU: the packed factors and the pivots
            return int(sum(np.asarray(a).nbytes for a in lu))
        if isinstance(lu, Cholesky):
            return lu.nbytes
        item = np.dtype(self.A.dtype).itemsize
        return int(lu.nnz * (item + 4) + 24 * self.n)  # L and U in CSC, permutations

    def close(self) -> None:
        """Release the factors now (SuperLU's on the thread that made them; cuDSS's to its cache)."""
        if isinstance(self._lu, _OnLane):
            self._lu.free()
        self._lu = None
        self._release_held()
        super().close()

    def _release_held(self) -> None:
        held, self._held = getattr(self, "_held", None), None
        for h in (held or {}).values():
            if h:
                h.release()

    def _held_solve(self, b: Any) -> Any:
        """``A^-1 b`` with cuDSS factors this engine holds (None where cuDSS cannot be had).

        Held rather than looked up in the process's cache at each solve: two
        open solvers whose matrices share a pattern (a heat and a Poisson
        matrix of one mesh) would otherwise refactorise one cache entry in
        turn. nvmath binds factors to a right-hand side's shape, so a vector
        and each block width have their own. Closing the engine gives them
        back to the cache.
        """
        from . import _cudss

        if self._held is None:
            self._held = {}
        shape = b.shape[1:]
        held = self._held.get(shape)
        reused = "factors"
        if held is None:
            cudss = _cudss.default()
            if cudss.nvmath is None:
                self._held[shape] = False
                return None
            try:
                held = cudss.hold(self.factored.tocsr(), b, self.options.symmetric)
            except Exception as exc:  # an unsupported type or version: the per-solve path
                log.info("managed_solve: cuDSS through nvmath failed (%s); solving per call", exc)
                self._held[shape] = False
                return None
            self._held[shape] = held
            reused = held.reused
        if held is False:
            return None
        try:
            x = held.solve(b)
        except Exception as exc:
            log.info("managed_solve: a held cuDSS solve failed (%s); solving per call", exc)
            held.discard()
            self._held[shape] = False
            return None
        self.how, self._extra = "cuDSS (nvmath-python)", {"cudss_reused": reused}
        return x

    def _apply(self, b: Any, trans: bool = False) -> Any:
        """``A^-1 b`` (``A^-T b`` with ``trans``); with a null space, the solution orthogonal to it."""
        if self.grounding is None:
            return self._apply_factors(b, trans)
        return self.grounding.solve(self._apply_factors, b, trans, self.A, self.options.symmetric)

    def _apply_factors(self, b: Any, trans: bool) -> Any:
        A, xp = self.factored, self.xp
        if xp is np:
            if _is_sparse(A):
                return self._lu.solve(b, trans="T" if trans else "N")
            import scipy.linalg as sla

            return sla.lu_solve(self._lu, b, trans=1 if trans else 0, check_finite=False)
        M = A.T if trans else A
        if _is_sparse(M):
            x = None if trans else self._held_solve(b)
            if x is None:
                x, self.how, self._extra = gpu_sparse_solve(M.tocsr(), b, self.options.symmetric)
            return x
        self.how = "cupy.linalg.solve"
        return _dense_lu(M, b)

    def solve(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """``A x = rhs``; a (n, k) block is solved with the factors in one call, then checked per column."""
        return self._block(rhs, trans=False)

    def solve_transpose(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        return self._block(rhs, trans=True)

    def _block(self, rhs: Any, trans: bool) -> Outcome | list[Outcome]:
        self._check_open()
        self._extra: dict = {}
        if rhs.ndim == 1:
            return self._solve_vector(rhs, None, trans)
        try:
            X = self._apply(rhs, trans).astype(rhs.dtype, copy=False)
        except Singular as exc:
            return [Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
                    for _ in range(rhs.shape[1])]
        return self._judge_block(rhs, X, trans)

    def _solve_vector(self, b: Any, x0: Any, trans: bool = False) -> Outcome:
        self._extra = {}
        try:
            x = self._apply(b, trans).astype(b.dtype, copy=False)
        except Singular as exc:
            return Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
        return self._judge(b, x, trans)

    def solve_to(self, b: Any, rtol: Any, atol: Any = 0.0, *,
                 trans: bool = False) -> Outcome | BlockOutcomes:
        """One right-hand side with a tolerance of its own (systems sharing these factors).

        An (n, k) host block takes k tolerances (sequences ``rtol`` and
        ``atol``, one a column) and gives k outcomes, as :meth:`solve` does.
        ``trans`` solves ``A^T x = b`` on the same factors (an adjoint).
        """
        self._check_open()
        block = b.ndim == 2
        self._extra = {}
        try:
            x = self._apply(b, trans).astype(b.dtype, copy=False)
        except Singular as exc:
            failed = Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
            return BlockOutcomes(None, [replace(failed) for _ in range(b.shape[1])]) if block \
                else failed
        if block:
            return self._judge_block(b, x, trans, rtols=rtol, atols=atol)
        return self._judge(b, x, trans, rtol=rtol, atol=atol)

    def _judge(self, b: Any, x: Any, trans: bool, *, rtol: float | None = None,
               atol: float | None = None) -> Outcome:
        """Refine ``x`` toward the tolerance and judge it by its residual and backward error."""
        xp = self.xp
        A = self.A.T if trans else self.A
        b_norm = stable_norm(xp, b)  # sync: once, for the tolerance
        tol = self._tolerance(b_norm, b.dtype, rtol, atol)
        r = _residual(A, b, x, xp)
        rn = stable_norm(xp, r)  # sync: one host read to check the factorisation
        return self._settle(A, b, x, r, rn, b_norm, tol, trans)

    def _judge_block(self, B: Any, X: Any, trans: bool, *, rtols: Any = None,
                     atols: Any = None) -> BlockOutcomes:
        """:meth:`_judge` for every column of a block at once, one outcome a column.

        One sparse product gives every column's residual ``B - A X`` and one
        pass its k norms, read back together (k matrix-vector products and
        3k reductions, on a GPU 2k host reads, otherwise); each column is
        then judged by its own residual exactly
        as :meth:`_judge` judges a vector, and only a column that misses its
        tolerance is refined, on its own. The outcomes' ``x`` are the columns
        of the returned block's ``x``, in C order as the caller's columns are
        stacked (the product reads C order fastest). ``rtols`` and ``atols``
        give each column a tolerance of its own (default: the options').
        """
        xp = self.xp
        A = self.A.T if trans else self.A
        X = xp.ascontiguousarray(X)
        b_norms = column_norms(xp, B)  # one pass (one host read) for all k columns
        if B.dtype == np.float32:
            R = wide_residual(A, B, X, xp)
        else:
            R = A @ X
            xp.subtract(B, R, out=R)  # R = B - A X without a second block
        r_norms = column_norms(xp, R)
        outs = BlockOutcomes(X)
        for j in range(B.shape[1]):
            b_norm = float(b_norms[j])
            tol = self._tolerance(b_norm, B.dtype, None if rtols is None else rtols[j],
                                  None if atols is None else atols[j])
            outs.append(self._settle(A, B[:, j], X[:, j], R[:, j], float(r_norms[j]), b_norm,
                                     tol, trans))
        return outs

    def _tolerance(self, b_norm: float, dtype: Any, rtol: float | None,
                   atol: float | None) -> float:
        """``max(rtol ||b||, atol)``: the options' tolerance unless a caller's is given."""
        rtol = self.options.rtol if rtol is None else rtol
        atol = self.options.atol if atol is None else atol
        # Without a tolerance of the caller's, sqrt(eps) ||b|| stands in: an
        # answer worse than that is no direct solution worth the name.
        eps = float(np.finfo(np.dtype(dtype)).eps)
        return max((rtol if rtol == rtol else np.sqrt(eps)) * b_norm, atol)

    def _settle(self, A: Any, b: Any, x: Any, r: Any, rn: float, b_norm: float, tol: float,
                trans: bool) -> Outcome:
        """The outcome of ``x`` with residual ``r = b - A x`` (norm ``rn``): refined, then judged.

        A refinement step that helps is written into ``x`` in place: a column of a block is the
        block's own, refined, whatever the judgement (the residual reported is its own).
        """
        xp = self.xp
        eps = float(np.finfo(np.dtype(b.dtype)).eps)
        steps = 0
        # Iterative refinement on the same factors: a float32 solve, or a badly
        # scaled one, gains digits at the cost of one triangular solve a step.
        while np.isfinite(rn) and rn > tol and steps < REFINEMENT_STEPS:
            # r may be wider than the factors (float64 for float32): rounded for the solve.
            dx = self._apply(r.astype(b.dtype, copy=False), trans)
            x_new = x + dx.astype(x.dtype, copy=False)
            r_new = _residual(A, b, x_new, xp)
            rn_new = stable_norm(xp, r_new)  # sync: one read a refinement step
            steps += 1
            if not rn_new < rn:
                break
            x[...] = x_new
            r, rn = r_new, rn_new
        info = {"factorisation": self.how, "refinements": steps, **self._extra}
        if np.isfinite(rn) and rn <= tol:
            return Outcome(x, CONVERGED, 1, rn, info=info)
        # b not (numerically) in A's range, or a factorisation that went wrong (see
        # SINGULAR_GROWTH_EPS); else a regular A too ill-conditioned for the dtype (MAXITER).
        stable, growth = _backward_stable(A, x, b, rn, xp) if np.isfinite(rn) else (False, 0.0)
        if not stable or (rn > np.sqrt(eps) * b_norm and growth * eps > SINGULAR_GROWTH_EPS):
            return Outcome(None, BREAKDOWN, 1, rn, SINGULAR if self.grounding is None
                           else NOT_SOLVED, info=info)
        # Backward stable, yet the residual misses the tolerance: x is kept, the status says why.
        return Outcome(x, MAXITER, 1, rn, (
            f"the LU solution's residual {rn:.3g} exceeds the tolerance {tol:.3g} after {steps} "
            f"refinement steps: A is too ill-conditioned for rtol in {np.dtype(b.dtype)} "
            "(use float64, a looser rtol, or scale the equations)."), info=info)

    def update(self, values: Any) -> None:
        """New values on the same pattern: only the numeric work where the factor is a Cholesky one.

        The Cholesky factor's analysis (ordering, elimination tree,
        supernodes) is kept and only the numeric factorisation is redone;
        new values that are not symmetric positive definite, and every other
        factor (SuperLU keeps no symbolic phase), factorise again from the
        start. ``options.symmetric`` is trusted as for :meth:`prepare`.
        """
        self._check_open()
        from .krylov import same_pattern

        if _is_sparse(self.A):
            new = same_pattern(self.A, values, "csr", call="update")
            if isinstance(self._lu, Cholesky):
                grounded = new if self.grounding is None else self.grounding.matrix(new)
                try:
                    if self.options.symmetric and eligible(grounded) is None:
                        self._lu.refactor(grounded.data)
                        self.A, self.factored = new, grounded
                        return
                except NotPositiveDefinite as exc:
                    log.info("managed_solve: new values not positive definite (%s); using SuperLU",
                             exc)
                self._factor(new, cholesky=False)
                return
            self._factor(new)
        else:
            self._factor(same_pattern(self.A, values, "dense", call="update"))


def _is_sparse(A: Any) -> bool:
    return _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)


class _OnLane:
    """A SuperLU factor made, and freed, on one long-lived thread (:func:`_backend.thread_lane`).

    SciPy's SuperLU frees a factor's memory only on the thread that made it:
    factors made on ``solve_many``'s short-lived workers, or kept for a
    gradient and freed by whichever thread frees the graph, would never be
    released. Solves run on any thread (their work arrays come and go within
    the call); only the factor's last reference is dropped on its lane.
    """

    __slots__ = ("_box", "_lane")

    def __init__(self, lu: Any, lane: Any):
        self._box = [lu]  # the only reference to the factor
        self._lane = lane

    @classmethod
    def factorise(cls, A: Any, symmetric: bool | None) -> tuple[_OnLane, str]:
        lane = _backend.thread_lane("superlu", _backend.cpu_count())
        lu, how = _backend.on_lane(lane, superlu, A, symmetric).result()
        return cls(lu, lane), how

    @property
    def nnz(self) -> int:
        return int(self._box[0].nnz)

    def solve(self, b: Any, trans: str = "N") -> Any:
        """``A^-1 b`` (``trans="T"``: ``A^-T b``); an (n, k) block a few columns a call, in C order.

        SuperLU hands every supernode of a block solve to BLAS, a triangular
        solve and a product over the block's columns. From about six columns
        OpenBLAS splits these small products over its threads, and their
        hand-offs cost more than the products, far more on cores shared with
        other work: 50 columns of 2D Poisson 127^2 on two cores, one of them
        busy elsewhere, took 420 ms (median) in one call and 26 ms four
        columns a call; on one thread 28-53 ms and 25-28 ms. So a block goes
        ``lu_solve_columns`` columns a call, the calls claimed by the
        calling thread and helpers, one per core (SuperLU solves without
        the GIL, each call with work arrays of its own): a helper the
        operating system leaves unscheduled claims nothing, and the caller
        solves what it would have.
        """
        lu = self._box[0]
        step = config.current().lu_solve_columns
        if b.ndim == 1 or b.shape[1] <= step:
            return lu.solve(b, trans=trans)
        k = b.shape[1]
        starts = range(0, k, step)
        pieces: list[Any] = [None] * len(starts)

        def piece(i: int) -> None:
            pieces[i] = lu.solve(b[:, starts[i]:starts[i] + step], trans=trans)

        # Work as the batched kernels count it: about a nanosecond an entry a column.
        run_claimed(piece, len(starts), threads_for(float(lu.nnz) * k, len(starts)))
        x = np.empty(b.shape, dtype=pieces[0].dtype)
        return np.concatenate(pieces, axis=1, out=x)

    def free(self) -> None:
        if self._box:
            try:
                _backend.on_lane(self._lane, self._box.clear)  # from __del__ too
            except RuntimeError:  # the interpreter is shutting down: nothing to keep
                pass

    def __del__(self) -> None:
        self.free()


#: Symmetric matrices with at least this many rows are ordered by nested
#: dissection (:mod:`managed_solve.kernels.ordering`) before SuperLU. On
#: unstructured meshes (and 3-D grids) it fills in less than SuperLU's
#: minimum degree from a few thousand rows, and the gap grows with n (a
#: sphere mesh of 164k vertices: 19M factor entries against 94M); on 2-D
#: grids minimum degree fills in a little less up to some 50k rows.
NESTED_DISSECTION_MIN_ROWS = 20_000


def host_factor(A: Any, symmetric: bool | None, *, cholesky: bool = True) -> tuple[Any, str]:
    """Factors of a host CSR matrix: supernodal Cholesky when it is SPD, else SuperLU.

    A symmetric matrix (``symmetric`` True, values checked again) is tried
    by :class:`~managed_solve.solvers.cholesky.Cholesky` when its diagonal
    is positive (a cheap test that spares an indefinite one the analysis);
    one that proves not positive definite, and every other, goes to
    :func:`superlu` on its lane. Returns the factors (``solve(b, trans)``
    and ``nnz``) and how they were made.
    """
    if cholesky and symmetric and A.shape[0] > 0 and bool(np.all(A.diagonal() > 0)):
        try:
            return Cholesky(A), CHOLESKY
        except NotPositiveDefinite as exc:
            log.info("managed_solve: no Cholesky factorisation (%s); using SuperLU", exc)
    return _OnLane.factorise(A, symmetric)


#: ``info["factorisation"]`` of a Cholesky factor.
CHOLESKY = "Cholesky (supernodal, nested dissection)"


def superlu(A: Any, symmetric: bool | None) -> tuple[Any, str]:
    """SuperLU's factors of a host CSR matrix, with the ordering and pivoting this engine uses.

    Symmetric matrices: diagonal pivoting and a symmetric ordering (nested
    dissection from :data:`NESTED_DISSECTION_MIN_ROWS` rows); others: COLAMD.
    Returns the factors (``solve(b, trans)`` and ``nnz``) and how they were
    made. :class:`PreparedDirect` calls it on a long-lived SuperLU lane,
    the thread that must also free the factors.
    Raises :class:`Singular` when SuperLU meets an exactly zero pivot.
    """
    import scipy.sparse.linalg as sla

    perm = None
    if symmetric:
        # Diagonal pivoting preferred, and the column order mirrored on the rows:
        # what SuperLU recommends for (nearly) symmetric matrices.
        opts = {"SymmetricMode": True, "DiagPivotThresh": 0.01}
        if A.shape[0] >= NESTED_DISSECTION_MIN_ROWS:
            from ..kernels.ordering import nested_dissection

            perm = nested_dissection(A.indptr, A.indices)
        spec = "NATURAL" if perm is not None else "MMD_AT_PLUS_A"
    else:
        spec, opts = "COLAMD", {}
    try:
        if perm is None:
            return sla.splu(A.tocsc(), permc_spec=spec, options=opts), f"SuperLU ({spec})"
        lu = sla.splu(permuted(A, perm).tocsc(), permc_spec=spec, options=opts)
    except RuntimeError as exc:  # "Factor is exactly singular"
        raise Singular(str(exc)) from exc
    return _PermutedLU(lu, perm), "SuperLU (nested dissection)"


def permuted(A: Any, perm: np.ndarray) -> Any:
    """``A[perm][:, perm]`` of a host CSR matrix (rows gathered, columns renumbered; unsorted)."""
    inverse = np.empty_like(perm)
    inverse[perm] = np.arange(perm.shape[0], dtype=perm.dtype)
    B = A[perm]
    B.indices = inverse[B.indices].astype(B.indices.dtype, copy=False)
    B.has_sorted_indices = False
    return B


class _PermutedLU:
    """SuperLU's factors of ``A[perm][:, perm]``, solving with A: ``x[perm] = LU^-1 b[perm]``."""

    __slots__ = ("lu", "perm")

    def __init__(self, lu: Any, perm: np.ndarray):
        self.lu, self.perm = lu, perm

    @property
    def nnz(self) -> int:
        return int(self.lu.nnz)

    def solve(self, b: Any, trans: str = "N") -> Any:
        y = self.lu.solve(np.ascontiguousarray(b[self.perm]), trans=trans)
        x = np.empty_like(y)
        x[self.perm] = y
        return x


def _dense_lu(A: Any, b: Any) -> Any:
    xp = _backend.array_module(b)
    try:
        return xp.linalg.solve(A, b)
    except np.linalg.LinAlgError as exc:
        raise Singular(str(exc)) from exc
    except Exception as exc:  # cupy's LinAlgError is numpy's; other errors pass on
        if type(exc).__name__ == "LinAlgError":
            raise Singular(str(exc)) from exc
        raise


def gpu_sparse_solve(A: Any, b: Any, symmetric: bool | None, *,
                     cudss: Any = None) -> tuple[Any, str, dict]:
    """``x`` with ``A x = b`` for a cupyx CSR ``A``: cuDSS where nvmath-python is installed, else cuSOLVER.

    Returns ``(x, how, info)``: the library used and what cuDSS reused.
    ``cudss`` is the :class:`~managed_solve.solvers._cudss.Cudss` state to use
    (default: the process's); a stand-in runs this path on the host.
    """
    from . import _cudss

    cudss = cudss if cudss is not None else _cudss.default()
    if cudss.nvmath is not None:
        try:
            x, reused = cudss.solve(A, b, symmetric)
            return x, "cuDSS (nvmath-python)", {"cudss_reused": reused}
        except Exception as exc:  # an unsupported type or version: CuPy's path still works
            log.info("managed_solve: cuDSS through nvmath failed (%s); using cupyx spsolve", exc)
    if b.ndim == 2:  # cuSOLVER's spsolve takes one vector a call
        xp = _backend.array_module(b)
        X = xp.stack([_cusolver_spsolve(A, xp.ascontiguousarray(b[:, j])) for j in range(b.shape[1])],
                     axis=1)
        return X, "cuSOLVER (cupyx spsolve)", {}
    return _cusolver_spsolve(A, b), "cuSOLVER (cupyx spsolve)", {}


def _cusolver_spsolve(A: Any, b: Any) -> Any:
    import cupyx.scipy.sparse.linalg as csla

    try:
        with warnings.catch_warnings():
            # cuSOLVER's QR reports a singular A by a warning; the caller's
            # backward-error check turns that into BREAKDOWN with its fix, so the
            # warning would only say it twice. Only that message is ignored.
            warnings.filterwarnings("ignore", message="A is not positive definite or near singular",
                                    category=UserWarning)
            return csla.spsolve(A, b)
    except Exception as exc:
        if "singular" in str(exc).lower():
            raise Singular(str(exc)) from exc
        raise


def _residual(A: Any, b: Any, x: Any, xp: Any) -> Any:
    """``b - A x``; for float32, in float64 (:func:`~._common.wide_residual`).

    Judging a float32 answer by a float32 residual reads rounding as the
    answer's error, or hides it: a residual computed in the wider type is
    the one the tolerance is about, and it makes each refinement step gain
    the digits mixed-precision refinement gains.
    """
    if b.dtype == np.float32:  # the engine's A is always a matrix
        return wide_residual(A, b, x, xp)
    return b - A @ x


def _backward_stable(A: Any, x: Any, b: Any, rn: float, xp: Any) -> tuple[bool, float]:
    """(False when the backward error ``||b - A x|| / (||A|| ||x|| + ||b||)`` is far above
    rounding, the growth ``||A|| ||x|| / ||b||``: at most cond(A), about 1/eps if singular).

    A factorisation that went wrong (a singular matrix, a breakdown inside
    the GPU library) leaves a large backward error; an ill-conditioned but
    regular matrix does not, whatever its residual.
    """
    eps = float(np.finfo(np.dtype(b.dtype)).eps)
    b_norm = stable_norm(xp, b)  # sync: once
    if _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A):
        a_norm = float(abs(A).sum(axis=1).max())  # sync: infinity norm, once
    else:
        a_norm = float(xp.abs(A).sum(axis=1).max())  # sync: infinity norm, once
    ax = a_norm * stable_norm(xp, x)  # sync: once
    tiny = np.finfo(np.float64).tiny
    stable = rn <= _BACKWARD_ERROR_LIMIT * eps * max(ax + b_norm, tiny) * np.sqrt(b.shape[0])
    return bool(stable), ax / max(b_norm, tiny)
