"""Gradients through solves: a solution attached to torch's autograd graph.

For ``x = A^-1 b`` and a loss L with ``g = dL/dx``, one adjoint solve
``A^T lam = g`` gives both gradients::

    dL/db = lam
    dL/dA = -lam x^T, wanted on A's stored entries only:
    dL/dA_values[k] = -lam[row[k]] * x[col[k]]        (a gather, O(nnz))

so backward costs one solve and keeps nothing of the forward's iterations:
the graph holds x, the inputs' tensors and whatever solves the adjoint
(memory O(nnz + n)). The layer that solved decides how the adjoint is solved
and passes it in: ``solve`` (and :class:`~managed_solve.solver.Solver`) on the
forward's prepared engine, ``solve_many`` on what each system's route
prepared (:mod:`managed_solve.scheduling.adjoint`: kept factors, packed
batches and solvers, all the adjoints of one backward at once). This module
only wires the graph and computes the gradients.

The adjoint solver is released when torch frees the node's saved state:
after a backward without ``retain_graph``, or when the graph is dropped
unused. It is tied to the node through a saved-tensor hook, whose packed
object torch frees exactly then.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _backend
from .dlpack import as_torch
from .result import SolveResult, Status
from .solvers._common import transposed_operator
from .system import LinearSystem
from .system.inputs import GradSource
from .system.method import matrix_symmetry

#: Methods that need a symmetric A: their systems are their own adjoints.
SYMMETRIC_METHODS = ("cg", "minres")


class Link:
    """What backward needs for the systems of one attachment.

    ``adjoints(rhs)`` takes a list of (system index, adjoint right-hand side
    as an array on the solution's device) and returns one
    :class:`SolveResult` per entry, whose ``x`` is ``lam``. ``release`` runs
    once, when torch frees the node's saved state.
    """

    def __init__(self, sources: Sequence[GradSource], results: Sequence[SolveResult],
                 adjoints: Callable[[list], list], *, transpose: bool = False):
        self.sources = list(sources)
        self.xs = [r.x for r in results]
        self.names = [r.name for r in results]
        self.adjoints = adjoints
        self.transpose = transpose


def attach(result: SolveResult, source: GradSource | None, adjoint: Callable[[Any], SolveResult],
           *, release: Callable[[], None] | None = None, transpose: bool = False) -> SolveResult:
    """Make ``result.to_torch()`` a tensor attached to autograd through ``source``'s tensors.

    Parameters
    ----------
    result : SolveResult
        The forward solve (x of shape (n,) or (n, k)).
    source : GradSource or None
        The tensors that require grad; None attaches nothing.
    adjoint : callable
        ``adjoint(g) -> SolveResult`` solves ``A^T lam = g`` (``A lam = g``
        when ``transpose``) for g shaped as x, on x's device.
    release : callable, optional
        Runs once when the graph no longer needs ``adjoint`` (at once when
        nothing is attached).
    transpose : bool
        The forward solved ``A^T x = b``: then ``dL/dA = -x lam^T``.
    """
    attached = _attach([result], [source], lambda rhs: [adjoint(g) for _, g in rhs],
                       release=release, transpose=transpose)
    return attached[0]


def attach_many(results: list[SolveResult], systems: Sequence[LinearSystem | None],
                solve_adjoints: Callable[[list], list[SolveResult]], *,
                release: Callable[[], None] | None = None) -> None:
    """Attach every result whose system has inputs requiring grad, with one node for them all.

    Backward calls ``solve_adjoints`` once with a list of (system index,
    ``g``) for the results that received a gradient; it returns their
    adjoint solutions in that order (see :func:`adjoint_system` for what each
    solves). ``release`` runs once, when the graph no longer needs what the
    adjoints use (at once when nothing is attached).
    """
    picked = [i for i, s in enumerate(systems)
              if s is not None and s.grad is not None and results[i].x is not None]
    if not picked:
        if release is not None:
            release()
        return

    def adjoints(rhs: list) -> list[SolveResult]:
        return solve_adjoints([(picked[j], g) for j, g in rhs])

    _attach([results[i] for i in picked], [systems[i].grad for i in picked], adjoints,
            release=release)


def recording() -> bool:
    """Whether torch records operations here (grad mode is per thread; False without torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.is_grad_enabled())


def adjoint_system(system: LinearSystem, forward: Any, g: Any) -> LinearSystem:
    """``A^T lam = g`` for the system that ``forward`` solved (A itself when symmetric).

    ``forward``: the forward's result, or anything with its ``method`` and ``name``.

    A symmetric A with a null space (``nullspace=``) is its own adjoint, null
    space included: g is projected onto A's range and lam returned orthogonal
    to the null space, so lam is the pseudo-inverse's ``A^+ g`` (the gradient of
    ``x = A^+ b``), ``LEAST_SQUARES`` where g has a part along the null space.

    Raises
    ------
    NotImplementedError
        A non-symmetric A with a null space: A^T's (the left null space)
        differs from A's and is not known, and without it the adjoint of a
        singular A^T fails or drifts along it. A :class:`~managed_solve.solver.Solver`
        (``solve``, and ``solve_many`` where it keeps the forward's solver)
        solves the adjoint on the forward's own set-up instead, whose
        transposed solve needs only A's null space.
    """
    method = forward.method if forward.method in ("cg", "bicgstab", "gmres", "minres",
                                                  "direct") else system.method
    # A stands for A^T only where they are equal by float64's rule (float32's looser one picks
    # methods, but the adjoint would carry the asymmetry it allows); an operator by its method.
    exact = matrix_symmetry(system, exact=True)
    symmetric = method in SYMMETRIC_METHODS if exact is None else bool(exact)
    if system.nullspace is not None and not symmetric and not matrix_symmetry(system):
        raise NotImplementedError(
            f"gradient of {system.name or 'a system'}: A is not symmetric and has a null space "
            "(nullspace=), and the adjoint system A^T lam = g needs A^T's null space, which "
            "nullspace= does not give. Solve it with solve() or a Solver, whose adjoint is the "
            "transposed solve on the forward's own set-up; or give a symmetric A, or a "
            "nonsingular one (a Dirichlet row) without nullspace=.")
    A = system.A if symmetric else transposed(system)
    # A user preconditioner approximates A^-1; only a named one is rebuilt for A^T.
    M = system.M if symmetric or system.M is None or isinstance(system.M, str) else None
    xp = _backend.array_module(system.b)
    rhs = xp.asarray(g) if xp is not np else np.asarray(_backend.to_host(g))
    adjoint = LinearSystem(A, rhs, rtol=system.rtol, atol=system.atol, maxiter=system.maxiter,
                           method=method, M=M, dtype=system.dtype,
                           name=f"adjoint of {forward.name}", check_finite=False)
    # The basis as the forward's system holds it (checked against this A already).
    return adjoint if system.nullspace is None else adjoint.replaced(nullspace=system.nullspace)


def transposed(system: LinearSystem) -> Any:
    """A^T of a CSR, dense or operator A (an operator needs ``rmatvec``: its ``.T``)."""
    if system.kind == "csr":
        return system.A.T.tocsr()
    if system.kind == "dense":
        return system.A.T
    if not hasattr(system.A, "rmatvec"):
        raise NotImplementedError(
            f"gradient of {system.name or 'a system'}: the adjoint needs A^T; this operator has no "
            "rmatvec. Give a scipy.sparse.linalg.LinearOperator with rmatvec.")
    return transposed_operator(system.A)  # its .T, else one made of rmatvec


class Generation:
    """Which solver the backward of a graph made by a solve uses: its solver, or a frozen copy
    holding the set-up it was computed with (:meth:`~managed_solve.solver.Solver.update` while
    graphs live)."""

    __slots__ = ("lock", "solver")

    def __init__(self, solver: Any, lock: Any):
        # ``lock``: the solver's, shared with its frozen copies; an update swaps ``solver`` under it.
        self.solver, self.lock = solver, lock

    def graph_freed(self) -> None:
        with self.lock:
            self.solver.graph_freed()


# ---------------------------------------------------------------------- wiring


def _attach(results: list[SolveResult], sources: list[GradSource | None],
            adjoints: Callable[[list], list], *, release: Callable[[], None] | None = None,
            transpose: bool = False) -> list[SolveResult]:
    torch = _backend.require("torch", "gradients through a solve")
    live = [i for i, (r, s) in enumerate(zip(results, sources, strict=True))
            if s is not None and r.x is not None]
    if not live or not torch.is_grad_enabled():
        if release is not None:
            release()
        return results
    link = Link([sources[i] for i in live], [results[i] for i in live], adjoints,
                transpose=transpose)
    if release is not None:
        weakref.finalize(link, release)
    flat = []
    for i in live:
        flat += [sources[i].A, sources[i].b]
    try:
        # The link lives as long as the node's saved state (see the module docstring).
        with torch.autograd.graph.saved_tensors_hooks(lambda _t: link, _unpack):
            outs = _function().apply(weakref.ref(link), *flat)
    except RuntimeError:  # saved-tensor hooks disabled by the caller: live as long as the graph
        outs = _function().apply(lambda: link, *flat)
    for i, out in zip(live, outs, strict=True):
        results[i].attach(out)
    return results


def _unpack(_link: Any) -> Any:
    import torch

    return torch.empty(0)


@functools.cache
def _function() -> Any:
    """The autograd Function (made on first use: torch is optional)."""
    import torch

    class Solve(torch.autograd.Function):
        """x_i = solve(A_i, b_i) for the systems of one link; backward: their adjoints at once."""

        @staticmethod
        def forward(ctx: Any, link_ref: Any, *flat: Any) -> tuple:
            link = link_ref()
            ctx.link_ref = link_ref
            ctx.set_materialize_grads(False)
            xs = tuple(as_torch(x) for x in link.xs)
            # The empty tensor ties the link to the saved state; the inputs that
            # require grad are kept for a second differentiation's trap (:func:`_trap`).
            ctx.save_for_backward(torch.empty(0), *[t for t in flat if torch.is_tensor(t)
                                                    and t.requires_grad])
            # The gradient of A's values reads x, which the outputs share. The
            # saved-tensor hooks that tie the link's lifetime skip torch's own
            # version check, so it is made here (weakly: a reference would tie
            # each output to its own node in a cycle).
            ctx.outputs = [(weakref.ref(x), x._version) for x in xs]
            return xs

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> tuple:
            _, *inputs = ctx.saved_tensors  # torch's own error once a backward freed the graph
            _refuse_changed_outputs(ctx.outputs, ctx.needs_input_grad[1::2])
            link = ctx.link_ref()
            rhs = [(j, _array(g)) for j, g in enumerate(grads) if g is not None]
            out: list[Any] = [None] * (2 * len(link.xs))
            if not rhs:
                return (None, *out)
            solved = link.adjoints(rhs)
            for (j, _), adj in zip(rhs, solved, strict=True):
                lam = _lambda(adj, link.names[j])
                if lam is None:
                    continue
                x = as_torch(link.xs[j])
                src = link.sources[j]
                if src.A is not None and ctx.needs_input_grad[1 + 2 * j]:
                    u, v = (x, lam) if link.transpose else (lam, x)
                    out[2 * j] = matrix_grad(src, u, v)
                if src.b is not None and ctx.needs_input_grad[2 + 2 * j]:
                    out[2 * j + 1] = lam.to(src.b.device, src.b.dtype).reshape(src.b.shape)
            if torch.is_grad_enabled():  # create_graph=True: the gradients may be differentiated
                # They depend on A and b (through x and the adjoint) and on the incoming
                # gradients: a second differentiation reaches the trap by any of them.
                traps = [g for g in grads if g is not None and g.requires_grad] + inputs
                if traps:
                    out = [o if o is None else o + _trap()(o, *traps) for o in out]
            return (None, *out)

    return Solve


def _refuse_changed_outputs(outputs: list, reads: Sequence[bool]) -> None:
    """torch's error for a saved tensor changed in place, for the outputs a backward reads.

    An in-place change of x (``x.mul_(2)``, ``x[0] = 0``) between the solve
    and backward would give a silently wrong gradient of A's values, which
    is formed from x; ``torch.linalg.solve`` raises here too. ``reads[k]``:
    whether output k is read (its A needs a gradient); b's gradient is the
    adjoint alone, whatever became of x.
    """
    for k, ((ref, version), read) in enumerate(zip(outputs, reads, strict=True)):
        x = ref() if read else None
        if x is not None and x._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: output {k} of a managed_solve solve (x from to_torch(), "
                f"shape {tuple(x.shape)}) is at version {x._version}; expected version "
                f"{version} instead. The gradient of A reads x: change a copy "
                f"(x = x.clone()) or use out-of-place operations (x = 2 * x).")


@functools.cache
def _trap() -> Any:
    """A zero on the graph of a solve's gradient whose own gradient is an error.

    The adjoint solve runs outside torch's graph, so a gradient of a solve's
    gradient (a Hessian-vector product through ``create_graph=True``) would
    silently leave out the solve's part. Added to each gradient the backward
    returns, tied to the incoming gradients (which lead back to the inputs),
    it makes that second differentiation raise instead. torch's
    ``once_differentiable`` does not: its error node is not on the path to
    the inputs ``torch.autograd.grad`` asks for, so it is skipped.
    """
    import torch

    class SecondDerivative(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, like: Any, *tied: Any) -> Any:
            return torch.zeros_like(like)

        @staticmethod
        def backward(ctx: Any, *_grads: Any) -> tuple:
            raise RuntimeError(
                "managed_solve: second derivatives through a solve are not supported: its "
                "gradient is computed by an adjoint solve outside torch's graph, so a gradient "
                "of that gradient (create_graph=True, a Hessian-vector product) would leave out "
                "the solve's part. Differentiate once, or use torch.linalg.solve on a dense A "
                "for second derivatives.")

    return SecondDerivative.apply


def _array(g: Any) -> Any:
    """A gradient tensor as a NumPy or CuPy array on its device (DLPack, no copy)."""
    g = g.detach().contiguous()
    if g.device.type == "cuda":
        return _backend.cupy().from_dlpack(g)
    return g.numpy()


def _lambda(adj: SolveResult, name: str | None) -> Any:
    """The adjoint solution as a tensor; a warning naming the system when it did not converge."""
    who = name or "the system"
    # With a null space the gradient of x = A^+ b is A^+ applied to dL/dx, which
    # seldom lies in A's range: the adjoint's least-squares answer is that exact
    # gradient, not a failure.
    exact = adj.status is Status.LEAST_SQUARES and adj.x is not None
    if not adj.converged and not exact:
        warnings.warn(f"managed_solve: the adjoint solve of {who} did not converge "
                      f"({adj.status.name}: {adj.message or adj.status.message}); its gradient is "
                      f"{'inaccurate' if adj.x is not None else 'not given'}.",
                      RuntimeWarning, stacklevel=3)
    return None if adj.x is None else as_torch(adj.x)


def matrix_grad(source: GradSource, u: Any, v: Any) -> Any:
    """``-u v^T`` on A's stored entries, shaped as the tensor that receives it.

    u and v are (n,) or (n, k) tensors (k columns are summed). Computed on
    A's device: u and v move there (O(n)), the pattern never moves. The
    gather runs in NumPy on the CPU (torch's CPU indexing is many times
    slower) and in torch on a GPU.
    """
    import torch

    A = source.A
    u = u.to(A.device, A.dtype)
    v = v.to(A.device, A.dtype)
    if source.form == "dense":
        return -(u @ v.T if u.ndim == 2 else torch.outer(u, v))
    if source.form == "coo":
        C = A.detach().coalesce()
        idx = C.indices()
        vals = _gather(u, v, idx[0], idx[1])
        return torch.sparse_coo_tensor(idx, vals, A.shape, is_coalesced=True)
    if source.form == "csr":
        crow, col = A.crow_indices(), A.col_indices()
    else:  # "values": (crow, col) as the caller gave them
        crow, col = (torch.as_tensor(p, device=A.device) for p in source.pattern)
    rows = _rows(crow, col.numel())
    vals = _gather(u, v, rows, col)
    if source.form == "csr":
        return torch.sparse_csr_tensor(crow, col, vals, A.shape)
    return vals.reshape(A.shape)


def _rows(crow: Any, nnz: int) -> Any:
    """The row of each stored entry of a CSR pattern of ``nnz`` entries."""
    import torch

    n = crow.numel() - 1
    if crow.device.type == "cpu":
        c = crow.numpy()
        return torch.from_numpy(np.repeat(np.arange(n), np.diff(c)))
    crow = crow.long()
    # The output's size given: no host read of the counts' sum (one a system).
    return torch.repeat_interleave(torch.arange(n, device=crow.device), crow[1:] - crow[:-1],
                                   output_size=nnz)


def _gather(u: Any, v: Any, rows: Any, cols: Any) -> Any:
    """``-u[rows] * v[cols]`` (summed over columns for (n, k) u and v)."""
    import torch

    if u.device.type == "cpu":
        un, vn = u.detach().numpy(), v.detach().numpy()
        prod = un[rows.numpy()] * vn[cols.numpy()]
        return torch.from_numpy(-(prod.sum(axis=1) if prod.ndim == 2 else prod))
    prod = u[rows] * v[cols.long()]
    return -(prod.sum(dim=1) if prod.ndim == 2 else prod)
