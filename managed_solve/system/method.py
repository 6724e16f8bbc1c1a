"""The auto policy: which method solves a system, and what to try when it breaks down.

The one home of ``method="auto"``. :func:`managed_solve.solve`,
:class:`managed_solve.Solver` and :func:`managed_solve.solve_many` all call
:func:`choose_method`, so they always agree on the method for a system.

The rule, in order:

1. A method given by the caller is kept.
2. On the CPU, a sparse matrix of at most :data:`DIRECT_MAX_N` unknowns with
   2D-like sparsity (at most :data:`DIRECT_MAX_ROW_NNZ` entries a row on
   average) and no preconditioner goes to the sparse LU, unless it is a CG
   matrix (symmetric, positive diagonal) that CG is predicted to solve
   sooner (:func:`cg_beats_lu`: predicted times, not a size; where the
   count of right-hand sides is unknown, a reused ``Solver``, unless CG's
   Gershgorin bound is low); a dense matrix of at most
   :data:`DIRECT_MAX_DENSE_N` unknowns goes to LAPACK's LU.
3. Otherwise a Krylov method (:func:`krylov_method`): CG for a symmetric
   matrix with a positive diagonal, MINRES for another symmetric one,
   BiCGStab for the rest (and for operators, whose symmetry is unknown).
4. When "auto"'s choice breaks down, :data:`FALLBACK` names the robust
   method to run next.

The times of rule 2 come from models measured on the 2-core development
machine (the host's serial CG kernel and SciPy's SuperLU with a
minimum-degree ordering, on 2D Poisson grids and triangle meshes of 1,000
to 65,000 unknowns): on such systems at rtol 1e-8 CG took a third of the
LU's time, so CG is chosen wherever its iteration count is predictable,
and the LU where it is not or where its factors serve many right-hand
sides (``solve_many``'s systems sharing one matrix).

``M="auto"`` (:func:`choose_preconditioner`) gives CG smoothed-aggregation
AMG on a large sparse symmetric matrix with a positive diagonal whose CG
iteration bound is high (an elliptic operator: Poisson, diffusion, the
Laplacian of a fine mesh), from :data:`AMG_MIN_N` unknowns on the device's
kind. Everything else keeps no preconditioner on the generic Krylov loops
(the batched core's Jacobi is asked for with ``M="jacobi"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cost import predict_iterations
from .properties import cg_iteration_bound, gershgorin, is_symmetric, positive_diagonal

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
# that is not definite, GMRES for a spectrum BiCGStab cannot handle and for a
# preconditioner MINRES cannot take (one that is not positive definite, an AMG
# or Jacobi of an indefinite matrix), a chain CG, MINRES, GMRES.
FALLBACK = {"cg": "minres", "bicgstab": "gmres", "minres": "gmres"}

#: Largest sparse system "auto" factorises on the CPU. A 2D LU's fill grows
#: like n log n, a 3D one like n^(4/3); past this size CG's few vectors win
#: on memory, and on 2D Poisson grids the LU still wins on time up to here.
DIRECT_MAX_N = 200_000
#: Average stored entries a row up to which a matrix counts as 2D-like (a 3D
#: 7-point stencil has 7, a 27-point one 27; fill-in grows with the stencil).
DIRECT_MAX_ROW_NNZ = 12
#: Largest dense matrix "auto" factorises with LAPACK's LU on the CPU.
DIRECT_MAX_DENSE_N = 4_000
#: Below this Gershgorin bound on CG's iterations ``M="auto"`` keeps plain CG
#: rather than setting up AMG: the bound overestimates easy systems (a heat
#: step, a screened Poisson problem) about tenfold, and CG then converges
#: sooner than a hierarchy is built.
CG_PREFERRED_BOUND = 2000.0
#: Seconds per (stored entry + row) and iteration of the host's serial CG
#: kernel (0.75 ns measured on 2D grids and triangle meshes held in cache).
HOST_CG_SECONDS = 0.75e-9
#: SuperLU on the host: a fixed cost per factorisation, and seconds per unit
#: of ``nnz * n**0.25`` (a 2D-like matrix's factors hold about 0.75 of that
#: many entries) to factorise and, per right-hand side, to solve with them.
HOST_LU_FIXED_SECONDS = 60e-6
HOST_LU_SECONDS = 45e-9
HOST_LU_SOLVE_SECONDS = 1.0e-9
#: Average entries a row up to which a matrix counts as a chain (1D-like):
#: its LU has no fill, and CG's iterations grow like n.
CHAIN_MAX_ROW_NNZ = 3
#: Unknowns from which ``M="auto"`` sets up AMG for CG, by device kind. On
#: the CPU it takes over where the sparse LU stops. On a GPU, where a
#: Jacobi-CG iteration costs tens of microseconds and the hierarchy's set-up
#: about a hundred milliseconds at any size, AMG pays from about a million
#: unknowns of a 2D Poisson problem (set-up included: 1.3 times faster at
#: 1M, 5 times at 4.2M; 0.8 times at 0.5M: docs/performance.md).
AMG_MIN_N = {"cpu": DIRECT_MAX_N + 1, "cuda": 1_000_000}


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


def prefers_cg(A: Any, rtol: float, symmetric: bool | None, cache: dict | None = None) -> bool:
    """Whether CG's Gershgorin iteration bound is low: an easy system for plain CG (no AMG)."""
    return bool(symmetric) and cg_iteration_bound(A, rtol, cache) <= CG_PREFERRED_BOUND


def predict_cg_iterations(A: Any, rtol: float, cache: dict | None = None) -> float:
    """CG's predicted iterations on a symmetric CSR matrix with a positive diagonal.

    The smaller of Gershgorin's bound (:func:`cg_iteration_bound`, finite for
    a strictly diagonally dominant A) and, for a weakly diagonally dominant
    A (a second-order PDE operator: Poisson, diffusion, a cotangent
    Laplacian, a heat step), the cost model's Poisson-like count
    (:func:`~managed_solve.system.cost.predict_iterations`) scaled by
    ``sqrt(dmax / dmin)`` (a badly scaled diagonal slows CG down), or ``n``
    for a chain (1D-like, :data:`CHAIN_MAX_ROW_NNZ`). Infinite for other
    matrices (a fourth-order operator, an indefinite one): nothing predicts
    their count.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(30, 30))
    >>> A = sp.kronsum(T, T, format="csr")  # 2D Poisson, 900 unknowns
    >>> round(predict_cg_iterations(A, 1e-8))
    57
    """
    from ..kernels.symmetry import symmetry_rtol

    n, nnz = A.shape[0], A.nnz
    lo, _hi, dmin, dmax = gershgorin(A, cache)
    its = cg_iteration_bound(A, rtol, cache)
    # Weakly dominant to the rounding of an assembly in A's dtype (a row sum that cancels
    # leaves a few ulps of its diagonal): the rule that judges symmetry in that dtype.
    if not dmin > 0 or not lo >= -symmetry_rtol(A.dtype) * abs(dmax):
        return its
    if nnz <= CHAIN_MAX_ROW_NNZ * n:
        return min(its, float(n))
    return min(its, predict_iterations(n, rtol=rtol) * float(np.sqrt(dmax / dmin)))


def cg_beats_lu(A: Any, rtol: float, *, rhs: int = 1, cache: dict | None = None) -> bool:
    """Whether CG is predicted to solve ``rhs`` systems of the symmetric CSR ``A`` sooner than a sparse LU.

    Host times (:data:`HOST_CG_SECONDS`, :data:`HOST_LU_SECONDS` and
    friends): CG's predicted iterations (:func:`predict_cg_iterations`)
    times its work per iteration, for each right-hand side, against one
    factorisation plus a solve with the factors for each. A chain's LU has
    no fill. A matrix without a positive diagonal is not CG's.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(64, 64))
    >>> A = sp.kronsum(T, T, format="csr")  # 2D Poisson, 4,096 unknowns
    >>> cg_beats_lu(A, 1e-8), cg_beats_lu(A, 1e-8, rhs=50)
    (True, False)
    """
    n, nnz = A.shape[0], A.nnz
    if n == 0:
        return False
    its = predict_cg_iterations(A, rtol, cache)
    if not np.isfinite(its):
        return False
    cg = rhs * HOST_CG_SECONDS * its * (nnz + n)
    factors = nnz if nnz <= CHAIN_MAX_ROW_NNZ * n else nnz * n ** 0.25
    lu = HOST_LU_FIXED_SECONDS + (HOST_LU_SECONDS + rhs * HOST_LU_SOLVE_SECONDS) * factors
    return cg < lu


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
    if cache is None:
        return "cg" if positive_diagonal(A) else "minres"  # sync: one read
    # The symmetry tests read the diagonal already (their bounds keep its least
    # entry): the commonest hit, looked up first.
    seen = cache.get(("gershgorin", id(A)))
    if seen is not None and seen[0] is A:
        positive = bool(seen[1][2] > 0)
    else:
        key = ("diag>0", id(A))
        hit = cache.get(key)
        if hit is not None and hit[0] is A:
            positive = hit[1]
        else:
            positive = positive_diagonal(A)  # sync: one read per matrix
            cache[key] = (A, positive)
    return "cg" if positive else "minres"


def wants_direct(kind: str, n: int, nnz: int, *, A: Any = None, rtol: float = 1e-8,
                 M: Any = None, symmetric: bool | None = None, rhs: int | None = 1,
                 cache: dict | None = None) -> bool:
    """Whether "auto" on the CPU factorises this system (rule 2 of the module docstring).

    ``rhs``: the right-hand sides one factorisation would serve; None when
    unknown (a :class:`~managed_solve.Solver` kept for reuse), where the LU
    is kept unless CG's Gershgorin bound is low (:func:`prefers_cg`).
    """
    if M is not None:  # a preconditioner asks for an iterative solve
        return False
    if kind == "dense":
        return n <= DIRECT_MAX_DENSE_N
    if kind != "csr":
        return False
    if not (n <= DIRECT_MAX_N and nnz <= DIRECT_MAX_ROW_NNZ * n):
        return False
    if A is None or not symmetric:
        return True
    if rhs is None:
        return not prefers_cg(A, rtol, symmetric, cache)
    return not cg_beats_lu(A, rtol, rhs=rhs, cache=cache)


def choose_method(system: Any, device_kind: str, *, symmetric: bool | None = None,
                  cache: dict | None = None, rhs: int | None = 1) -> str:
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
    rhs : int or None
        Right-hand sides one factorisation would serve (``solve_many`` counts
        the systems sharing a matrix; 1 for ``solve``): the LU's set-up is
        paid once for all of them. None: unknown (a ``Solver`` kept for
        reuse; see :func:`wants_direct`).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(40, 40))
    >>> s = LinearSystem(sp.kronsum(T, T, format="csr"), np.ones(1600))  # 2D Poisson
    >>> choose_method(s, "cpu"), choose_method(s, "cpu", rhs=40), choose_method(s, "cuda")
    ('cg', 'direct', 'cg')
    >>> chain = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(2000, 2000), format="csr")
    >>> choose_method(LinearSystem(chain, np.ones(2000)), "cpu")  # 1D: an LU without fill
    'direct'
    """
    if system.method != "auto":
        return system.method
    if symmetric is None:
        symmetric = matrix_symmetry(system, cache)
    if device_kind == "cpu" and wants_direct(system.kind, system.n, system.nnz,
                                             A=system.A if system.kind == "csr" else None,
                                             rtol=system.rtol, M=system.M, symmetric=symmetric,
                                             rhs=rhs, cache=cache):
        return "direct"
    return krylov_method(system.A, symmetric, cache=cache) if system.kind != "operator" \
        else "bicgstab"


def matrix_symmetry(system: Any, cache: dict | None = None, *, exact: bool = False) -> bool | None:
    """A's symmetry (CSR and dense; None for an operator), on the device A lies on.

    ``exact``: by float64's rule whatever the dtype (:func:`is_symmetric`): whether A
    may stand for ``A^T``, as an adjoint asks, not whether a symmetric method suits it.
    """
    if system.kind == "csr":
        return is_symmetric(system.A, cache, exact=exact)
    if system.kind == "dense":
        from .. import _backend
        from ..kernels.symmetry import SYMMETRY_RTOL, symmetry_rtol
        from .properties import symmetric_pairs

        xp = _backend.array_module(system.A)
        A = system.A
        i = xp.arange(A.shape[0])

        def row_max() -> Any:
            size = xp.abs(A)
            return xp.where(size == size, size, 0).max(axis=1)  # a NaN left out

        # The rule of kernels.symmetry: each pair against its own size and rows (not max |a|),
        # within the rounding of A's dtype.
        rel = SYMMETRY_RTOL if exact else symmetry_rtol(A.dtype)
        return symmetric_pairs(xp, A, A.T, i[:, None], i[None, :], row_max, rel)
    return None
