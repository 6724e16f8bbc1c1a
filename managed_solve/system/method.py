"""The auto policy: which method solves a system, and what to try when it breaks down.

The one home of ``method="auto"``. :func:`managed_solve.solve`,
:class:`managed_solve.Solver` and :func:`managed_solve.solve_many` all call
:func:`choose_method`, so they always agree on the method for a system.

The rule, in order:

1. A method given by the caller is kept.
2. On the CPU, a sparse matrix of at most :data:`DIRECT_MAX_N` unknowns with
   2D-like sparsity (at most :data:`DIRECT_MAX_ROW_NNZ` entries a row on
   average) and no preconditioner goes to the sparse LU, unless CG's
   Gershgorin bound says CG is cheap (:func:`prefers_cg`); a dense matrix of at
   most :data:`DIRECT_MAX_DENSE_N` unknowns goes to LAPACK's LU.
3. Otherwise a Krylov method (:func:`krylov_method`): CG for a symmetric
   matrix with a positive diagonal, MINRES for another symmetric one,
   BiCGStab for the rest (and for operators, whose symmetry is unknown).
4. When "auto"'s choice breaks down, :data:`FALLBACK` names the robust
   method to run next.

``M="auto"`` (:func:`choose_preconditioner`) gives CG smoothed-aggregation
AMG on a large sparse symmetric matrix with a positive diagonal whose CG
iteration bound is high (an elliptic operator: Poisson, diffusion, the
Laplacian of a fine mesh), from :data:`AMG_MIN_N` unknowns on the device's
kind. Everything else keeps no preconditioner on the generic Krylov loops
(the batched core's Jacobi is asked for with ``M="jacobi"``).
"""

from __future__ import annotations

from typing import Any

from .properties import cg_iteration_bound, is_symmetric, positive_diagonal

METHODS = ("auto", "cg", "bicgstab", "gmres", "minres", "direct")
PRECONDITIONERS = ("auto", "jacobi", "neumann", "amg")
#: Preconditioner names other libraries offer that we do not, with the reason
#: and what to use instead (see docs/guide/preconditioners.md). A Chebyshev
#: polynomial in ``D^-1 A`` cannot make CG take fewer matrix-vector products
#: than Jacobi-CG (CG is optimal over the same Krylov space), and our
#: Jacobi-CG runs in fused kernels that a polynomial's extra vector passes
#: cannot beat; on non-normal matrices it can stall GMRES altogether.
NOT_OFFERED = {
    "chebyshev": (
        "a Chebyshev polynomial preconditioner is not offered: with CG it cannot need "
        "fewer matrix-vector products than M='jacobi' and only adds work per product. "
        "Use M='jacobi' (a cheap scaling, fused kernels), M='amg' for large elliptic "
        "problems whose iteration count grows with the mesh, or pass your own operator as M"
    ),
}


def check_preconditioner(M: Any, call: str) -> None:
    """A ValueError naming ``call``, the argument and the alternatives for an unknown name ``M``.

    Operators, callables and None pass; so do the names in :data:`PRECONDITIONERS`.

    Examples
    --------
    >>> check_preconditioner("jacobi", "solve")
    >>> check_preconditioner("ilu", "solve")
    Traceback (most recent call last):
    ...
    ValueError: solve: M='ilu' is not a known preconditioner; use one of auto, jacobi, neumann, amg, an operator, or None
    """
    if not isinstance(M, str) or M in PRECONDITIONERS:
        return
    if M in NOT_OFFERED:
        raise ValueError(f"{call}: M={M!r}: {NOT_OFFERED[M]}.")
    raise ValueError(f"{call}: M={M!r} is not a known preconditioner; use one of "
                     f"{', '.join(PRECONDITIONERS)}, an operator, or None")
# What "auto" turns to when its guess breaks down: MINRES for a symmetric matrix
# that is not definite, GMRES for a spectrum BiCGStab cannot handle.
FALLBACK = {"cg": "minres", "bicgstab": "gmres"}

#: Largest sparse system "auto" factorises on the CPU. A 2D LU's fill grows
#: like n log n, a 3D one like n^(4/3); past this size CG's few vectors win
#: on memory, and on 2D Poisson grids the LU still wins on time up to here.
DIRECT_MAX_N = 200_000
#: Average stored entries a row up to which a matrix counts as 2D-like (a 3D
#: 7-point stencil has 7, a 27-point one 27; fill-in grows with the stencil).
DIRECT_MAX_ROW_NNZ = 12
#: Largest dense matrix "auto" factorises with LAPACK's LU on the CPU.
DIRECT_MAX_DENSE_N = 4_000
#: Below this Gershgorin bound on CG's iterations, CG is preferred to a
#: sparse LU on the CPU: the bound overestimates easy systems (a heat step, a
#: screened Poisson problem) about tenfold, and CG then takes milliseconds
#: where the LU's fill-in takes far longer.
CG_PREFERRED_BOUND = 2000.0
#: Unknowns from which ``M="auto"`` sets up AMG for CG, by device kind. On
#: the CPU it takes over where the sparse LU stops; on a GPU, where a
#: Jacobi-CG iteration costs tens of microseconds, the hierarchy's set-up pays
#: from about two million unknowns of a 2D Poisson problem (its iterations
#: drop from thousands to about 20; docs/performance.md gives the figures).
AMG_MIN_N = {"cpu": DIRECT_MAX_N + 1, "cuda": 2_000_000}


def amg_min_n(device_kind: str) -> int:
    """:data:`AMG_MIN_N` for a device kind (simulated GPUs take the GPU's figure)."""
    return AMG_MIN_N["cpu" if device_kind == "cpu" else "cuda"]


def may_take_amg(kind: str, n: int, method: str) -> bool:
    """Whether ``M="auto"`` could give AMG on some device: the cheap, device-free part of the rule.

    :class:`~managed_solve.LinearSystem` turns ``"auto"`` into None at once
    for every other system, so everything downstream of validation sees a
    plain preconditioner for them.
    """
    return kind == "csr" and method in ("auto", "cg") and n >= min(AMG_MIN_N.values())


def settle_auto(M: Any, kind: str, n: int, method: str) -> Any:
    """``M`` with ``"auto"`` turned into None where :func:`may_take_amg` rules AMG out."""
    if isinstance(M, str) and M == "auto" and not may_take_amg(kind, n, method):
        return None
    return M


def choose_preconditioner(system: Any, device_kind: str, method: str, *,
                          symmetric: bool | None = None) -> Any:
    """The preconditioner for ``system`` solved by ``method`` on ``device_kind``.

    ``system.M`` is returned unless it is ``"auto"``; ``"auto"`` gives
    ``"amg"`` for CG on a sparse matrix of at least :func:`amg_min_n`
    unknowns whose CG iteration bound exceeds :data:`CG_PREFERRED_BOUND`
    (an easy system, a heat step, converges faster than AMG is set up), and
    None otherwise.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> print(choose_preconditioner(LinearSystem(A, np.ones(50)), "cuda", "cg"))
    None
    """
    M = system.M
    if not (isinstance(M, str) and M == "auto"):
        return M
    if method != "cg" or system.kind != "csr" or system.n < amg_min_n(device_kind):
        return None
    if symmetric is None:
        symmetric = is_symmetric(system.A)
    if not symmetric or prefers_cg(system.A, system.rtol, symmetric):
        return None
    return "amg"


def prefers_cg(A: Any, rtol: float, symmetric: bool | None) -> bool:
    """Whether CG's Gershgorin iteration bound is low enough to skip a sparse LU on the CPU."""
    return bool(symmetric) and cg_iteration_bound(A, rtol) <= CG_PREFERRED_BOUND


def krylov_method(A: Any, symmetric: bool | None, *, cache: dict | None = None) -> str:
    """The Krylov method for a matrix: CG, MINRES or BiCGStab.

    Parameters
    ----------
    A : sparse matrix or dense array
        Only its diagonal is read, and only when ``symmetric`` is true.
    symmetric : bool or None
        Whether A is symmetric (None: unknown, treated as not symmetric).
    cache : dict, optional
        Remembers the diagonal test by matrix object (one read per matrix
        within a call that meets the same matrix many times).

    Returns
    -------
    str
        ``"cg"`` for a symmetric A with a positive diagonal, ``"minres"`` for
        another symmetric A, ``"bicgstab"`` otherwise.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(4, 4), format="csr")
    >>> krylov_method(A, True), krylov_method(-A, True), krylov_method(A, False)
    ('cg', 'minres', 'bicgstab')
    """
    if not symmetric:
        return "bicgstab"
    key = ("diag>0", id(A))
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is A:
        positive = hit[1]
    else:
        positive = positive_diagonal(A)  # sync: one read per matrix
        if cache is not None:
            cache[key] = (A, positive)
    return "cg" if positive else "minres"


def wants_direct(kind: str, n: int, nnz: int, *, A: Any = None, rtol: float = 1e-8,
                 M: Any = None, symmetric: bool | None = None) -> bool:
    """Whether "auto" on the CPU factorises this system (rule 2 of the module docstring)."""
    if M is not None:  # a preconditioner asks for an iterative solve
        return False
    if kind == "dense":
        return n <= DIRECT_MAX_DENSE_N
    if kind != "csr":
        return False
    return n <= DIRECT_MAX_N and nnz <= DIRECT_MAX_ROW_NNZ * n \
        and not (A is not None and prefers_cg(A, rtol, symmetric))


def choose_method(system: Any, device_kind: str, *, symmetric: bool | None = None,
                  cache: dict | None = None) -> str:
    """The method that solves ``system`` on a device of ``device_kind`` ("cpu", "cuda", "sim").

    Parameters
    ----------
    system : LinearSystem
        Its ``method`` is returned unless it is ``"auto"``.
    device_kind : str
        Simulated GPUs ("sim") take the GPU's choice: they stand for GPUs.
    symmetric : bool, optional
        A's symmetry when the caller knows it; else it is tested here (CSR)
        or taken as unknown (dense matrices and operators).
    cache : dict, optional
        Per-call memo of symmetry and diagonal tests, by matrix object.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> s = LinearSystem(A, np.ones(50))
    >>> choose_method(s, "cpu"), choose_method(s, "cuda")
    ('direct', 'cg')
    """
    if system.method != "auto":
        return system.method
    if symmetric is None:
        symmetric = matrix_symmetry(system, cache)
    if device_kind == "cpu" and wants_direct(system.kind, system.n, system.nnz,
                                             A=system.A if system.kind == "csr" else None,
                                             rtol=system.rtol, M=system.M, symmetric=symmetric):
        return "direct"
    return krylov_method(system.A, symmetric, cache=cache) if system.kind != "operator" \
        else "bicgstab"


def matrix_symmetry(system: Any, cache: dict | None = None) -> bool | None:
    """A's symmetry (CSR and dense; None for an operator), on the device A lies on."""
    if system.kind == "csr":
        return is_symmetric(system.A, cache)
    if system.kind == "dense":
        from .. import _backend

        xp = _backend.array_module(system.A)
        A = system.A
        scale = float(xp.abs(A).max())  # sync: once, choosing the method
        return bool(xp.abs(A - A.T).max() <= 1e-12 * scale)  # sync: once
    return None
