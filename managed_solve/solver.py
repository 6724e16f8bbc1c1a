"""Solver: one matrix set up once on one device, then solved for any number of right-hand sides.

The flow: validate once, choose the device (the caller's, the GPU the arrays
lie on, or the DeviceManager's, bytes reserved until :meth:`Solver.close`),
choose the method (:mod:`managed_solve.system.method`), prepare its engine
there; then solve each right-hand side, check the true residual, fall back
where "auto" guessed wrong, and learn the time for the next placement.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from . import _backend, autograd
from .device_args import cuda_ordinal
from .devices import Device
from .placement import block_passes, move_to, named_device, pin_placing, reserve_for
from .result import SolveResult, Status
from .solvers import batched, verify
from .solvers._common import (
    column_norms,
    oriented,
    power_of_two_scale,
    set_up_by,
    set_up_call,
    stable_norm,
    stop_threshold,
    true_residual_norm,
)
from .solvers.direct import SINGULAR, DirectEngine, Singular
from .solvers.engine import BREAKDOWN, BlockOutcomes, Options, Outcome, Prepared
from .solvers.krylov import KrylovEngine
from .solvers.new_values import new_matrix, update_grad
from .solvers.verify import check_representable, failed_setup, run_rule, status_of
from .system import LinearSystem
from .system.inputs import (
    GradSource,
    as_operator,
    check_dtype,
    checked_finite,
    grad_source,
    torch_to_array,
)
from .system.linear_system import check_nullspace
from .system.method import choose_method, choose_preconditioner, matrix_symmetry


def prepare(system: LinearSystem, method: str, device: Device, *, symmetric: bool | None = None,
            callback: Any = None, first_check: int | None = None) -> Prepared:
    """The engine for ``method`` prepared on ``system.A`` (already on ``device``): ``"direct"``
    factorises (:class:`~managed_solve.solvers.direct.DirectEngine`), the Krylov methods build
    their preconditioner (:class:`~managed_solve.solvers.krylov.KrylovEngine`)."""
    options = Options(method, M=system.M, rtol=system.rtol, atol=system.atol,
                      maxiter=system.maxiter, callback=callback, symmetric=symmetric,
                      first_check=first_check)
    if method == "direct":
        if system.kind == "operator":
            call = set_up_call("method='direct'")
            raise ValueError(f"{call}: A is an operator without entries; use method='gmres' or "
                             "pass A as a sparse matrix.")
        return DirectEngine().prepare(system.A, options, device, nullspace=system.nullspace)
    return KrylovEngine().prepare(system.A, options, device, kind=system.kind)


def _frozen_copy(solver: Solver) -> Solver:
    """A copy of ``solver`` as it is now, for the graphs alive: it closes when they are freed.
    It shares the engines (the solver takes new ones) and the lock, not the reservation."""
    frozen = copy.copy(solver)
    frozen._reservation = None
    frozen._closing = True
    return frozen


class Solver:
    """A matrix set up once on one device; solve it for any number of right-hand sides.

    Parameters
    ----------
    A : matrix or operator
        As :func:`managed_solve.solve` takes it (SciPy/cupyx sparse, torch
        sparse, dense NumPy/CuPy/torch, an operator with ``matvec``).
    method, M, rtol, atol, maxiter, callback, device, dtype, manager
        As for :func:`managed_solve.solve`.
    name : str, optional
        Shown in results.
    rhs : int, optional
        Right-hand sides this solver is expected to solve, for ``method="auto"`` on the CPU
        (:func:`managed_solve.system.method.choose_method`): with a count, a factorisation is
        weighed against that many CG solves by predicted time (``solve`` passes 1); without one,
        the solver is taken to be reused, and a small 2D-like matrix is factorised unless CG's
        Gershgorin bound says it is easy.

    Notes
    -----
    Set-up (a factorisation, a preconditioner, the method choice, the transfer of A to its
    device) happens here, once. ``solve`` then costs only the solve; ``update`` replaces A's
    values on the same pattern and redoes only the numeric set-up; ``solve_transpose`` solves
    ``A^T x = b`` on the same set-up. The manager's reservation and the device memory are held
    until :meth:`close` (or the end of a ``with`` block).

    When A's values or b are torch tensors that require grad, a result's ``to_torch()`` is
    attached to autograd; its backward is one adjoint solve on this solver (:meth:`adjoint`),
    which must then still be open.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> import managed_solve as ms
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(100, 100)).tocsr()
    >>> with ms.Solver(A, device="cpu") as solver:
    ...     one = solver.solve(np.ones(100))
    ...     many = solver.solve(np.ones((100, 3)))
    >>> one.converged, many.x.shape, bool(many.converged)
    (True, (100, 3), True)
    """

    def __init__(self, A: Any, *, method: str = "auto", M: Any = "auto", rtol: float = 1e-8,
                 atol: float = 0.0, maxiter: int | None = None,
                 callback: Callable[[Any], None] | None = None, device: Any = None,
                 dtype: Any = None, manager: Any = None, name: str | None = None,
                 nullspace: Any = None, rhs: int | None = None, _call: str | None = None,
                 _given: tuple = ()):
        # _call: the call every error names (solve() passes "solve(A, B)"); _given: more of the
        # caller's inputs whose pins place the solver (solve's B, or its inputs as given).
        call = _call or "Solver(A)"
        grad = grad_source(A, None, call=call)
        op, kind = as_operator(A, call=call)
        n = int(op.shape[0]) if len(op.shape) == 2 else 0
        data = op.data if kind == "csr" else op
        xp = _backend.array_module(data) if kind != "operator" else np
        dt = check_dtype(getattr(op, "dtype", np.float64), call=call, arg="A")
        zeros = xp.zeros(max(n, 1), dtype=dt if dt.kind == "f" else np.float64)
        # A LinearSystem with a zero b validates A and the options once.
        system = LinearSystem(op, zeros[:n] if n else zeros, rtol=rtol, atol=atol,
                              maxiter=maxiter, method=method, M=M, name=name, dtype=dtype,
                              nullspace=nullspace, _call=call)
        self._call, self._label = _call, (call.split("(", 1)[0], True)
        self._open(system, device=device, manager=manager, callback=callback, rhs=rhs,
                   call=self._label[0], given=(A, *_given))
        self.grad = grad

    @classmethod
    def from_system(cls, system: LinearSystem, *, device: Any = None, manager: Any = None,
                    callback: Callable[[Any], None] | None = None, rhs: int | None = None,
                    _call: str | None = None, _given: tuple = ()) -> Solver:
        """A Solver for a validated :class:`LinearSystem` (its b and x0 count in the reservation).

        Without ``_call``, errors name Solver's own calls; set-up errors a named system's name.
        """
        self = object.__new__(cls)
        self._call, call = _call, (_call or "Solver.from_system").split("(", 1)[0]
        self._label = (system.name, False) if _call is None and system.name else (call, True)
        self._open(system, device=device, manager=manager, callback=callback, rhs=rhs,
                   call=call, given=_given)
        return self

    # ------------------------------------------------------------------ set-up
    def _open(self, system: LinearSystem, *, device: Any, manager: Any, callback: Any,
              rhs: int | None = None, call: str = "Solver", given: tuple = ()) -> None:
        from .manager import manager_or_default

        # Calls take turns: the engines work in workspaces of their own.
        self._lock = threading.RLock()
        mgr = manager_or_default(manager, call)
        # Without device=, a pin on what the caller gave (else on what validation made of it)
        # places the system, arrays on another GPU moved, as solve_many does; else GPU arrays stay.
        pinned = pin_placing(mgr, device, *given, system, system.A, system.b, call=call)
        on = device if device is not None else (system.device if pinned is None and
                                                 cuda_ordinal(system.device) is not None else None)
        dev = named_device(on, mgr, call=call) if on is not None else None
        # The method and M decide the workspace (an AMG hierarchy counted); "auto" on a device
        # still unknown is resolved as for an accelerator (or the pinned one), again once placed.
        symmetric = matrix_symmetry(system) if system.method in ("auto", "direct") else None
        target = dev if pinned is None else mgr.pinned(pinned)
        kind = target.kind if target is not None else "cuda"
        planned = choose_method(system, kind, symmetric=symmetric, rhs=rhs)
        M = choose_preconditioner(system, kind, planned, symmetric=symmetric)
        # Through the manager's size heuristic (USE_HEURISTIC), as every reservation of an object.
        nbytes = mgr.size_of(system.nbytes + system.workspace_bytes(planned, M))
        self._reservation = reserve_for(mgr, nbytes, dev, system, planned, pinned, call)
        self.closed = False
        try:
            placed_here = dev is not None  # the plan above already saw this device's kind
            dev = dev if dev is not None else self._reservation.device
            self.system = move_to(system, dev)
            self.device, self.manager, self.symmetric, self.callback = dev, mgr, symmetric, callback
            self.method = planned if placed_here and self.system is system else \
                choose_method(self.system, dev.kind, symmetric=symmetric, rhs=rhs)
            if dev.kind != kind or self.method != planned:
                M = choose_preconditioner(self.system, dev.kind, self.method, symmetric=symmetric)
            if M is not self.system.M:
                self.system = self.system.replaced(M=M)
            self._engines: dict[str, Prepared | Outcome] = {}
            self._scale_matrix()
            self._set_up_now()
            # A's tensor that requires grad (b's comes with each solve); graphs that need this
            # solver for their backward, and whether it closes once they are freed (release()).
            source = system.grad
            self.grad = replace(source, b=None) if source is not None and source.A is not None \
                else None
            self._graphs, self._closing, self._symmetric_adjoint = 0, False, None
            self._generation = autograd.Generation(self, self._lock)
        except BaseException:
            self.close()
            raise

    def _scale_matrix(self) -> None:
        """Scale a matrix of extreme magnitude by a power of two for its engines (exact).

        Krylov scalars (``p . A p``, ``r . r``) overflow or underflow for entries far from 1;
        the engines then see ``A / a_scale`` (and right-hand sides scaled alike, see
        :meth:`_run`), and answers are scaled back. Residuals and statuses are always those of
        the caller's A and b.
        """
        system = self.system
        self.a_scale = 1.0
        self._engine_system = system
        if system.kind == "operator" or system.nnz == 0:
            return
        data = system.A.data if system.kind == "csr" else system.A
        xp = _backend.array_module(data)
        self.a_scale = power_of_two_scale(float(xp.abs(data).max()))  # sync: once a set-up
        if self.a_scale != 1.0:
            scaled = system.A / self.a_scale
            self._engine_system = system.replaced(A=scaled.tocsr() if system.kind == "csr"
                                                  else scaled)

    def _set_up_now(self) -> None:
        """Prepare the chosen method's engine here, so that every solve costs the solve only (an
        out-of-memory error is left to the first solve: its result's DEVICE_ERROR status)."""
        system, mgr = self.system, self.manager
        sig = (*system.signature[:3], self.method, system.kind, system.rtol)
        first_check = mgr.predict(sig, device=self.device).iterations if mgr is not None else None
        try:
            with self.device.context():
                self._engine(self.method, first_check)
        except MemoryError:
            self._engines.pop(self.method, None)

    def _engine(self, method: str, first_check: int | None = None) -> Prepared | Outcome:
        """The prepared engine of ``method`` (made once), or the Outcome of a failed set-up."""
        got = self._engines.get(method)
        if got is None:
            try:
                with set_up_by(*self._label):  # set-up errors name the caller
                    got = prepare(self._engine_system, method, self.device,
                                  symmetric=self.symmetric, callback=self.callback,
                                  first_check=first_check)
            except Singular as exc:
                got = Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
            self._engines[method] = got
        return got

    @property
    def n(self) -> int:
        return self.system.n

    # ------------------------------------------------------------------ solving
    def solve(self, b: Any, x0: Any = None) -> SolveResult:
        """Solve ``A x = b`` for b of shape (n,) or (n, k) (each column converging on its own).

        For a 2-D b the result's ``x`` is (n, k); ``iterations``,
        ``residual_norm`` and ``b_norm`` are arrays of k entries,
        ``column_status`` holds each column's status and ``status`` is
        CONVERGED only when every column converged.
        """
        call = self._call or "Solver.solve"
        return self.attach(self._solve(b, x0, call, transpose=False), self._source(b, call))

    def solve_transpose(self, b: Any, x0: Any = None) -> SolveResult:
        """Solve ``A^T x = b`` on the same set-up (the adjoint solve of a gradient)."""
        call = self._call or "Solver.solve_transpose"
        return self.attach(self._solve(b, x0, call, transpose=True), self._source(b, call),
                           transpose=True)

    # ------------------------------------------------------------------ gradients
    def attach(self, result: SolveResult, source: GradSource | None, *,
               transpose: bool = False) -> SolveResult:
        """Attach ``result`` (a solve by this solver) to autograd through ``source``'s tensors.

        Backward is one :meth:`adjoint` solve on this solver's engines; the solver counts the
        graph as a user until torch frees it (:meth:`release`). None: nothing to attach.
        """
        if source is None or result.x is None:
            return result
        self._graphs += 1
        # Through the generation: an update while this graph lives hands the
        # set-up it was computed with to a frozen copy, which its backward uses.
        gen = self._generation
        return autograd.attach(result, source,
                               lambda g: gen.solver.adjoint(g, transpose=transpose),
                               release=gen.graph_freed, transpose=transpose)

    def adjoint(self, g: Any, *, transpose: bool = False) -> SolveResult:
        """Solve the adjoint of a gradient: ``A^T y = g`` (``A y = g`` when the forward was transposed).

        On this solver's set-up: a symmetric A is solved as it is; another uses the engines'
        transposed solve (the factors' transpose, or the Krylov method on A^T, prepared once).
        """
        return self._solve(g, None, "Solver.adjoint", arg="g",
                           transpose=not (transpose or self._symmetric()))

    def release(self) -> None:
        """Close now or, while autograd graphs still need this solver, when the last is freed."""
        if self._graphs:
            self._closing = True
        else:
            self.close()

    def graph_freed(self) -> None:
        """One graph that needed this solver was freed (closing it if :meth:`release` asked)."""
        self._graphs -= 1
        if self._closing and not self._graphs:
            self.close()

    def _symmetric(self) -> bool:
        # The adjoint solves A itself only where A = A^T by float64's rule: float32's looser one
        # picks methods, but a gradient through A for A^T would carry the asymmetry it allows.
        if self._symmetric_adjoint is None:
            exact = matrix_symmetry(self.system, exact=True)  # None: an operator, as its method says
            self._symmetric_adjoint = self.method in autograd.SYMMETRIC_METHODS if exact is None \
                else bool(exact)
        return self._symmetric_adjoint

    def _source(self, b: Any, call: str) -> GradSource | None:
        """A's and b's tensors that require grad for a solve of b (None: nothing to attach)."""
        source = grad_source(None, b, call=call)
        if self.grad is None:
            return source
        return self.grad if source is None else replace(self.grad, b=source.b)

    def update(self, A: Any) -> None:
        """New values of the prepared matrix, all or nothing.

        A sparse solver takes A's stored values in ``A.data``'s order (a 1-D NumPy, CuPy or
        torch array) or a matrix of the same pattern (SciPy or cupyx sparse, torch sparse
        CSR/COO, a ``(crow, col, values)`` tuple); a dense solver takes a dense matrix of its
        shape. Only the numeric set-up is redone (a new factorisation, a new preconditioner).
        Values of another form, pattern, shape or dtype are refused before anything changes;
        where the new set-up raises (Jacobi on a zero diagonal) the solver keeps its previous
        matrix and set-up.

        Results of earlier solves still attached to autograd keep the matrix and set-up they
        were solved with: their backward solves the adjoint of *that* matrix (as a Newton or
        time-stepping loss over several steps needs). The solver then sets up afresh for the new
        values instead of updating in place, and the earlier set-up is released when the last
        of those graphs is freed.
        """
        with self._lock, set_up_by("Solver.update(A)", False):  # set-up errors name it
            self._check_open()
            new = new_matrix(self.system, A, call="Solver.update(A)")
            grad = update_grad(self.system, A, call="Solver.update(A)")
            if self.system.nullspace is not None:  # given for the values it replaces
                with self.device.context():
                    check_nullspace(new, self.system.kind, None, None, self.system.nullspace,
                                    call="Solver.update(A)")
            kept = (self.system, self._engine_system, self.a_scale, self.symmetric, self.method)
            frozen = _frozen_copy(self) if self._graphs else None
            touched: list[str] = []
            try:
                self.system = self.system.replaced(A=new)
                if self.system.method == "auto" or self.system.method == "direct":
                    self.symmetric = matrix_symmetry(self.system)
                if self.system.method == "auto" and self.symmetric is False \
                        and self.method in ("cg", "minres"):  # chosen for symmetric values
                    self.method = verify.fallback_for(self.system, self.method, False)
                self._scale_matrix()
                if frozen is not None:  # the live graphs keep the engines; new ones here
                    self._engines = {}
                    self._set_up_now()
                engine_A = self._engine_system.A
                for method, prepared in list(self._engines.items() if frozen is None else ()):
                    if not isinstance(prepared, Prepared):  # a failed set-up: tried again on use
                        del self._engines[method]
                        continue
                    touched.append(method)
                    if prepared.engine == "direct" and self.symmetric is not None:
                        # New values may break (or make) symmetry, which a Cholesky factor needs.
                        prepared.options = replace(prepared.options, symmetric=self.symmetric)
                    try:
                        prepared.update(engine_A.data if self.system.kind == "csr" else engine_A)
                    except Singular:
                        prepared.close()
                        del self._engines[method]
            except BaseException:
                # Back to the previous matrix: the engines that took (or half took) the
                # new values are made again from it, the method's own one now.
                self.system, self._engine_system, self.a_scale, self.symmetric, self.method = kept
                if frozen is not None:  # the previous engines were never touched
                    for prepared in self._engines.values():
                        if isinstance(prepared, Prepared):
                            prepared.close()
                    self._engines = frozen._engines
                    raise
                for method in touched:
                    prepared = self._engines.pop(method, None)
                    if isinstance(prepared, Prepared):
                        prepared.close()
                self._set_up_now()
                raise
            if frozen is not None:  # under the lock: a graph freed meanwhile counted here
                frozen._graphs, self._graphs = self._graphs, 0
                self._generation.solver = frozen
                self._generation = autograd.Generation(self, self._lock)
            self.grad = grad
            self._symmetric_adjoint = None

    def close(self) -> None:
        """Release the engines' workspace and the manager's reservation (idempotent)."""
        with self._lock:
            for prepared in getattr(self, "_engines", {}).values():
                if isinstance(prepared, Prepared):
                    prepared.close()
            self._engines = {}
            if getattr(self, "_reservation", None) is not None:
                self._reservation.release()
                self._reservation = None
            self.closed = True

    def __enter__(self) -> Solver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        device, state = getattr(self, "device", None), "closed" if self.closed else "open"
        return f"Solver(n={self.system.n}, method={self.method!r}, device={str(device)!r}, {state})"

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Solver: this solver was closed; make a new one.")

    def _rhs(self, v: Any, what: str, call: str, like: tuple | None = None) -> Any:
        """b (or x0, of b's shape ``like``): an (n,) or (n, k) array of the solver's dtype there."""
        system, n = self.system, self.system.n
        if _backend.is_torch_tensor(v):  # a view through DLPack (mps copied, meta refused)
            v = torch_to_array(v, call=call, arg=what)
        elif not (isinstance(v, np.ndarray) or _backend.is_cupy_array(v)):
            try:
                v = np.asarray(v)
            except (TypeError, ValueError) as exc:  # ragged lists
                raise TypeError(f"{call}: {what} must be a numeric array ({exc})") from exc
        shape, column = tuple(v.shape), ((n,), (n, 1))
        if like is not None and shape != like and shape in column and like in column:
            v = v.reshape(like)  # one guess for one right-hand side, as (n,) or (n, 1)
        elif like is not None and shape != like:
            raise ValueError(f"{call}: {what} must have shape {like}, b's: one initial guess per "
                             f"right-hand side; got shape {shape}.")
        elif v.ndim not in (1, 2) or shape[0] != n or (v.ndim == 2 and shape[1] < 1):
            raise ValueError(f"{call}: {what} must have shape ({n},) or ({n}, k) with k >= 1, "
                             f"got shape {shape}; A has shape ({n}, {n}).")
        check_dtype(v.dtype, call=call, arg=what)
        xp = _backend.array_module(system.b)
        if _backend.array_module(v) is not xp:
            v = xp.asarray(v) if xp is not np else _backend.to_host(v)
        elif xp is not np and v.device.id != system.b.device.id:
            with _backend.cupy().cuda.Device(system.b.device.id):
                v = xp.asarray(v)
        v = v.astype(system.dtype, copy=False)
        if not checked_finite(v, None):
            where = ""
            if v.ndim == 2:  # name the columns: the others may be solved alone
                bad = _backend.to_host(xp.flatnonzero(~xp.isfinite(v).all(axis=0))).tolist()
                where = f" in column{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:10]))}" \
                    + (" and more" if len(bad) > 10 else "")
            raise ValueError(f"{call}: {what} has NaN or Inf entries{where}; replace them with "
                             "finite values.")
        return v

    def _solve(self, b: Any, x0: Any, call: str, *, transpose: bool,
               arg: str = "b") -> SolveResult:
        with self._lock:
            self._check_open()
            B = self._rhs(b, arg, call)
            X0 = self._rhs(x0, "x0", call, tuple(B.shape)) if x0 is not None else None
            if B.ndim == 1:
                return self.solve_one(B, X0, transpose=transpose)
            return self._solve_block(B, X0, transpose=transpose)

    def solve_one(self, b: Any, x0: Any = None, *, transpose: bool = False,
                  name: str | None = None) -> SolveResult:
        """One right-hand side already of the solver's dtype on its device (no validation)."""
        with self._lock:
            self._check_open()
            return self._run([b], None if x0 is None else [x0], transpose, name)[0][0]

    @property
    def block_column_bytes(self) -> int:
        """Bytes each column of a block beyond the first needs while it is solved (b, x, work vectors).

        A block solve reserves them through the manager for as long as it
        runs; where the device cannot hold them all, the block is solved in
        passes of as many columns as it can (``result.info["passes"]``).
        """
        system = self.system
        vector = system.n * system.dtype.itemsize
        if self.method == "direct":  # the factors serve every column
            return 2 * vector
        return vector + system.workspace_bytes(self.method)

    def _solve_block(self, B: Any, X0: Any, *, transpose: bool) -> SolveResult:
        """k right-hand sides solved together: one result with (n, k) x and per-column figures."""
        k = B.shape[1]
        t0 = time.perf_counter()
        xp = _backend.array_module(B)
        # Contiguous columns for GPU kernels and Krylov restarts; a host factorisation
        # takes the block whole and reads a column only where one needs more.
        views = xp is np and self.method == "direct"

        def columns(M: Any) -> list:
            return [M[:, j] if views else xp.ascontiguousarray(M[:, j]) for j in range(M.shape[1])]

        width, extra = block_passes(self.manager, self.device, self._reservation, k,
                                    self.block_column_bytes)
        cols, parts = [], []
        try:
            for lo in range(0, k, width):
                Bp = B if width >= k else B[:, lo:lo + width]
                X0p = None if X0 is None else (X0 if width >= k else X0[:, lo:lo + width])
                got, Xp = self._run(columns(Bp), None if X0p is None else columns(X0p),
                                    transpose, None, block=(Bp, X0p))
                cols += got
                parts.append(Xp)
        finally:
            if extra is not None:
                extra.release()
        seconds = time.perf_counter() - t0
        X = parts[0] if len(parts) == 1 else None
        if X is None and all(c.x is not None for c in cols):
            X = xp.stack([c.x for c in cols], axis=1)
        statuses = tuple(c.status for c in cols)
        bad = [j for j, st in enumerate(statuses) if st is not Status.CONVERGED]
        status = Status.CONVERGED if not bad else statuses[bad[0]]
        if bad:
            message = (f"{len(bad)} of {k} columns did not converge (first: column {bad[0]}, "
                       f"{cols[bad[0]].message})")
        else:
            message = f"{self.method}: all {k} columns converged"
        methods = {c.method for c in cols}
        info = {"columns": k, "host_syncs": sum(c.info.get("host_syncs", 0) for c in cols),
                "path": cols[0].info.get("path"), "passes": len(parts)}
        if "preconditioner" in cols[0].info:  # what "auto" chose, as a vector's result says
            info["preconditioner"] = cols[0].info["preconditioner"]
        if X is None:
            info["column_x"] = [c.x for c in cols]
        return SolveResult(X, status, np.array([c.iterations for c in cols]),
                           np.array([c.residual_norm for c in cols]),
                           np.array([c.b_norm for c in cols]), str(self.device), seconds,
                           methods.pop() if len(methods) == 1 else "mixed", message,
                           self.system.name, info, column_status=statuses)

    def _run(self, bs: list, x0s: list | None, transpose: bool, name: str | None, *,
             block: tuple | None = None) -> tuple[list[SolveResult], Any]:
        """Solve the columns ``bs`` (one engine call for a block), verify and fall back per column.

        Returns the results and, for a ``block`` whose engine answered with one new (n, k)
        array (:class:`~managed_solve.solvers.engine.BlockOutcomes`) that every column's answer
        still is, that array (else None: the caller stacks the columns).
        """
        system, dev, mgr = self.system, self.device, self.manager
        method = self.method
        A = oriented(system.kind, system.A, transpose)
        xp = _backend.array_module(bs[0])
        if block is not None and xp is np:  # one pass over the block for every column
            b_norms = column_norms(xp, block[0]).tolist()
        else:
            b_norms = [stable_norm(xp, b) for b in bs]  # sync: once, for the result
        tols = [stop_threshold(system.rtol, system.atol, bn) for bn in b_norms]
        if x0s is not None and 0.0 in b_norms:  # b = 0: x = 0 exactly, whatever x0 (see solve)
            x0s = [xp.zeros_like(b) if bn == 0.0 else x0 for b, x0, bn in zip(bs, x0s, b_norms,
                                                                              strict=True)]
            block = block if block is None else (block[0], xp.stack(x0s, axis=1))
        # A singular A with a known null space: solve for b's part in A's range
        # (the rest is what no x can reach), return x orthogonal to the null space.
        N = system.nullspace
        outside = [0.0] * len(bs)
        if N is not None:
            cut = [N @ (N.T @ b) for b in bs]
            outside = [stable_norm(xp, c) for c in cut]  # sync: once a column
            bs = [b - c for b, c in zip(bs, cut, strict=True)]
            # A b (all but rounding) in the null space: x = 0 meets the projected system
            # to the caller's tolerance. The engine would chase the rounding-level rest
            # relative to itself (BREAKDOWN, or MAXITER after 10 n iterations).
            lost = [stable_norm(xp, b) <= tol for b, tol in zip(bs, tols, strict=True)]
            if any(lost):  # sync: once a column, as for the cut
                bs = [xp.zeros_like(b) if gone else b for b, gone in zip(bs, lost, strict=True)]
                if x0s is not None:
                    x0s = [xp.zeros_like(x0) if gone else x0
                           for x0, gone in zip(x0s, lost, strict=True)]
            if block is not None:
                block = (xp.stack(bs, axis=1), block[1] if x0s is None else xp.stack(x0s, axis=1))
        # Extreme magnitudes are solved scaled (exactly, by powers of two): the
        # engine sees A / a_scale and b / b_scale, its x is scaled back.
        b_scales = [power_of_two_scale(bn) for bn in b_norms]
        scaled = self.a_scale != 1.0 or any(s != 1.0 for s in b_scales)
        user_bs = [b + c for b, c in zip(bs, cut, strict=True)] if N is not None else bs
        if scaled:
            A = oriented(system.kind, self._engine_system.A, transpose)
            bs = [b / sb for b, sb in zip(bs, b_scales, strict=True)]
            if x0s is not None:
                x0s = [x0 * (self.a_scale / sb) for x0, sb in zip(x0s, b_scales, strict=True)]
            if block is not None:
                block = (xp.stack(bs, axis=1), None if x0s is None else xp.stack(x0s, axis=1))
            tols = [tol / sb for tol, sb in zip(tols, b_scales, strict=True)]
        # Iterations the manager saw for this kind of system: the fused loop's first
        # convergence read goes there, so a repeated solve syncs with the host once.
        sig = (*system.signature[:3], method, system.kind, system.rtol)
        first_check = mgr.predict(sig, device=dev).iterations if mgr is not None else None
        results: list[SolveResult] = []
        outs: Any = None
        kept: list | None = None
        t0 = time.perf_counter()
        try:
            dev.check_fault(system.nbytes)
            with dev.context():
                prepared = self._engine(method, first_check)
                if isinstance(prepared, Outcome):  # the set-up failed (a singular factorisation)
                    outs = [failed_setup(prepared) for _ in bs]
                elif block is not None:
                    B, X0 = block
                    outs = prepared.solve_transpose(B, X0) if transpose else prepared.solve(B, X0)
                    if isinstance(outs, BlockOutcomes):
                        kept = [out.x for out in outs]
                else:
                    x0 = None if x0s is None else x0s[0]
                    outs = [prepared.solve_transpose(bs[0], x0) if transpose
                            else prepared.solve(bs[0], x0)]
                finished = []
                for j, (b, out) in enumerate(zip(bs, outs, strict=True)):
                    x0 = None if x0s is None else x0s[j]
                    finished.append(run_rule(  # ||b|| as the engine saw it (a projected b's: unread)
                        self.system, method, prepared, b, x0, out, tols[j], transpose, A,
                        symmetric=self.symmetric, engine=self._engine, callback=self.callback,
                        b_norm=b_norms[j] / b_scales[j] if N is None else None))
                dev.synchronize()
        except MemoryError as exc:  # SimulatedOutOfMemory, cupy's OutOfMemoryError
            seconds = time.perf_counter() - t0
            return [SolveResult(None, Status.DEVICE_ERROR, 0, float("nan"), bn, str(dev), seconds,
                                method, f"out of memory on {dev}: {exc}. Free memory there or let "
                                "the manager choose (device=None).", name or system.name)
                    for bn in b_norms], None
        seconds = (time.perf_counter() - t0) / len(bs)
        if scaled:
            A = oriented(system.kind, system.A, transpose)
            tols = [stop_threshold(system.rtol, system.atol, bn) for bn in b_norms]
            for (_used, out), sb in zip(finished, b_scales, strict=True):
                if out.x is not None:
                    xs = out.x
                    with np.errstate(over="ignore", under="ignore"):  # judged just below
                        out.x = xs * (sb / self.a_scale)
                    check_representable(out, xs)
                out.residual_norm *= sb
        peaks: dict[str, int] = {}  # bytes a solve by each method holds (the same every column)
        for (used, out), b, bn, tol, off, c in zip(finished, user_bs, b_norms, tols, outside,
                                                   cut if N is not None else bs, strict=True):
            x = out.x
            if x is not None and N is not None:
                x = out.x = x - N @ (N.T @ x)
            if x is not None and used == "direct" and N is None and not scaled \
                    and "refinements" in out.info:  # the factorisation read the true residual
                residual = out.residual_norm
            elif x is not None:  # the engine's own true residual of this x, where it made one
                known = None if scaled or N is not None else out.checked_residual(x)
                residual = known if known is not None else true_residual_norm(A, b, x)
                # That read waited for the fused core's masked iterations: free what they kept.
                batched.release_done()
            else:
                residual = out.residual_norm
            if off > tol and x is not None:  # judged by b's part in the range, b - c
                status, message = verify.status_outside_range(
                    out, used, residual, true_residual_norm(A, b - c, x), off, tol, system)
            else:
                status, message = status_of(out, used, residual, tol, system)
            if mgr is not None:
                peak = peaks.get(used)
                if peak is None:
                    peak = peaks[used] = system.nbytes + system.workspace_bytes(used)
                mgr.record(sig, seconds, peak_bytes=peak, device=dev,
                           cost=float(peak) * max(out.iterations, 1), iterations=out.iterations
                           if status in (Status.CONVERGED, Status.MAXITER) else None)
            info = dict(out.info)
            info.setdefault("path", "generic" if used != "direct" else "direct")
            if used != "direct":
                M = system.M
                info.setdefault("preconditioner", M if M is None or isinstance(M, str)
                                else type(M).__name__)
            info["host_syncs"] = out.host_syncs
            results.append(SolveResult(x, status, out.iterations, residual, bn, str(dev), seconds,
                                       used, message, name or system.name, info))
        whole = kept is not None and all(
            r.x is x for r, x in zip(results, kept, strict=True)) and outs.x is not None
        return results, outs.x if whole else None
