"""The one shape every engine has: ``prepare`` once, then ``solve`` / ``update`` / ``solve_transpose``.

An *engine* turns an operator into a :class:`Prepared` object on one device
(or, for the sharded engine, a set of devices). Preparing does all the work
that depends on the operator alone (validation of the pattern, factorisation,
preconditioner or hierarchy set-up, workspace, a transpose where one is
needed); solving then depends on the right-hand side alone, so one matrix
with many right-hand sides, and the adjoint solve of a gradient, pay the
set-up once.

::

    prepared = engine.prepare(operator, options, device)
    outcome  = prepared.solve(rhs, x0=None)      # rhs (n,) or (n, k)
    prepared.update(values)                      # same pattern, new values
    outcome  = prepared.solve_transpose(rhs)     # A^T y = rhs
    prepared.close()                             # workspace released

An engine never chooses where it runs (the caller passes the device) and
never chooses its method (``options.method`` is already resolved by
:mod:`managed_solve.system.method`). Results are :class:`Outcome` objects:
host scalars plus ``x`` on the engine's device; the caller checks the true
residual and builds the user-facing :class:`~managed_solve.result.SolveResult`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .. import _backend

# Status codes of every engine (and of the batched core's per-system arrays,
# which use the first three).
CONVERGED, MAXITER, BREAKDOWN, LEAST_SQUARES = 0, 1, 2, 3

NOT_IN_RANGE = (
    "b is not in the range of A (A is singular and the system inconsistent): x is a "
    "least-squares solution. For a pure Neumann or closed-surface problem, make b sum to zero "
    "(or pass nullspace='constant', which projects b onto A's range)."
)


@dataclass
class Outcome:
    """What an engine reports for one right-hand side (host values, except ``x``)."""

    x: Any
    code: int
    iterations: int
    residual_norm: float  # the engine's own (recurrence or estimated) residual norm
    message: str = ""
    host_syncs: int = 0
    info: dict = field(default_factory=dict)
    #: ``(x, ||b - A x||)`` where the engine computed the true residual of the
    #: ``x`` it returns from scratch (a fused product and sum, read on the host):
    #: the verify rule then reads that instead of forming ``b - A x`` again.
    #: Valid only while ``x`` is that same array.
    true_residual: tuple | None = None

    def checked_residual(self, x: Any) -> float | None:
        """The engine's true residual norm of ``x`` (the same array it returned), else None."""
        got = self.true_residual
        return got[1] if got is not None and got[0] is x else None


class BlockOutcomes(list):
    """The k outcomes of one (n, k) block solve whose ``x`` are the columns of one new block.

    ``x`` is that (n, k) block, made by this solve and owned by the caller
    (never an engine's workspace): a caller whose columns all kept their
    ``x`` can hand the block on as it is instead of stacking k columns again.
    """

    def __init__(self, x: Any, outcomes: Any = ()):
        super().__init__(outcomes)
        self.x = x


@dataclass(frozen=True)
class Options:
    """What a prepared engine needs besides the operator: method, preconditioner, stopping rule.

    ``method`` is resolved (never ``"auto"``); ``M`` is None, a preconditioner
    name or a user operator; ``maxiter`` None means the default limit
    (:func:`managed_solve.system.linear_system.default_maxiter`).
    """

    method: str
    M: Any = None
    rtol: float = 1e-8
    atol: float = 0.0
    maxiter: int | None = None
    callback: Callable[[Any], None] | None = None
    symmetric: bool | None = None
    first_check: int | None = None  # iterations before the first host read (a learned hint)


class Prepared(ABC):
    """An operator set up on a device by an engine; solve as often as needed.

    Subclasses implement :meth:`_solve_vector` (one right-hand side) and may
    override :meth:`solve` for a block of right-hand sides solved together.
    ``update`` and ``solve_transpose`` raise ``NotImplementedError`` naming the
    engine where an engine cannot do them.
    """

    #: the engine's name ("krylov", "batched", "direct", "sharded", ...)
    engine: str = "engine"

    def __init__(self, device: Any, options: Options, n: int):
        self.device = device
        self.options = options
        self.n = int(n)
        self.closed = False

    # ------------------------------------------------------------------ solving
    def solve(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """Solve ``A x = rhs``; a (n, k) ``rhs`` gives a list of k outcomes (one per column)."""
        return self._columns(rhs, x0, self._solve_vector)

    def solve_transpose(self, rhs: Any, x0: Any = None) -> Outcome | list[Outcome]:
        """Solve ``A^T x = rhs`` on the same set-up (the adjoint of a gradient)."""
        return self._columns(rhs, x0, self._solve_transpose_vector)

    @abstractmethod
    def _solve_vector(self, b: Any, x0: Any) -> Outcome:
        """One right-hand side of shape (n,), on this engine's device."""

    def _solve_transpose_vector(self, b: Any, x0: Any) -> Outcome:
        if self.options.symmetric:
            return self._solve_vector(b, x0)
        raise NotImplementedError(
            f"{self.engine} engine: solve_transpose of a non-symmetric operator is not available "
            "for this engine; prepare the transposed matrix instead.")

    def _columns(self, rhs: Any, x0: Any, one: Callable[[Any, Any], Outcome]) -> Any:
        self._check_open()
        if getattr(rhs, "ndim", 1) == 1:
            return one(rhs, x0)
        xp = _backend.array_module(rhs)
        # Contiguous columns: GPU kernels read a vector as one stretch of memory.
        return [one(xp.ascontiguousarray(rhs[:, j]),
                    None if x0 is None else xp.ascontiguousarray(x0[:, j]))
                for j in range(rhs.shape[1])]

    # ------------------------------------------------------------------ set-up
    def update(self, values: Any) -> None:
        """New values on the same sparsity pattern: redo only the numeric set-up."""
        raise NotImplementedError(f"{self.engine} engine: update() is not available; prepare again.")

    def close(self) -> None:
        """Release the workspace (idempotent); the object cannot solve afterwards."""
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.engine} engine: this prepared solver was closed; "
                               "prepare a new one.")

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Engine(Protocol):
    """Anything with ``prepare(operator, options, device) -> Prepared``."""

    name: str

    def prepare(self, operator: Any, options: Options, device: Any) -> Prepared: ...


def on_device_of(*arrays: Any) -> Any:
    """The array module of the given arrays (NumPy or CuPy): engines compute with ``xp.``."""
    return _backend.array_module(*arrays)
