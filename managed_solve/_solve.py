"""solve(): one linear system, with a SciPy-like call.

A :class:`~managed_solve.solver.Solver` is made for the system, used once and
closed: validation, placement, the method choice, the engine's set-up, the
true-residual check and the fall-back rule are the Solver's. Several GPUs
(``devices=``) go to the sharded engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from .manager import manager_or_default
from .result import SolveResult
from .solver import Solver
from .system import LinearSystem
from .system.method import krylov_method, matrix_symmetry


def solve(A_or_system: Any, b: Any = None, *, x0: Any = None, rtol: float = 1e-8,
          atol: float = 0.0, maxiter: int | None = None, method: str = "auto", M: Any = "auto",
          callback: Callable[[Any], None] | None = None, device: Any = None,
          dtype: Any = None, manager: Any = None, devices: Any = None,
          nullspace: Any = None) -> SolveResult:
    """Solve one sparse (or dense, or operator) linear system ``A x = b``.

    Parameters
    ----------
    A_or_system : matrix, operator or LinearSystem
        SciPy or cupyx sparse, torch sparse CSR/COO, a ``(crow, col, values)``
        tuple, dense NumPy/CuPy/torch, an object with ``shape`` and ``matvec``,
        or a :class:`LinearSystem` (then ``b`` is omitted and the system's own
        options are used, except those given here with a non-default value).
    b : array, shape (n,) or (n, k)
        NumPy, CuPy or torch. Torch tensors are used through DLPack, without
        copies. With k columns, A is set up once (a :class:`Solver`) and each
        column converges on its own; the result holds x of shape (n, k) and
        per-column figures (see :meth:`Solver.solve`). When A's values or b
        are torch tensors that require grad, ``result.to_torch()`` is attached
        to autograd; its backward is one adjoint solve on this solve's
        prepared engine (:mod:`managed_solve.autograd`).
    x0 : array, optional
        Initial guess.
    rtol, atol : float
        Converged when ``||b - A x|| <= max(rtol * ||b||, atol)``, checked on
        the true residual at the end.
    maxiter : int, optional
        Iteration limit (for gmres: total inner iterations); default ``10 * n``.
    method : {"auto", "cg", "bicgstab", "gmres", "minres", "direct"}
        ``"auto"``: the direct solver for small 2D-like sparse systems on the
        CPU (n <= 100,000) and dense ones (n <= 4,000); else CG for a symmetric
        matrix with a positive diagonal, MINRES for another symmetric one,
        BiCGStab otherwise (also for operators, whose symmetry is unknown).
        When that choice breaks down (CG on an indefinite matrix), "auto"
        retries with MINRES (after CG) or GMRES (after BiCGStab).
        ``"direct"``: SuperLU on the CPU; on a GPU cuDSS when nvmath-python is
        installed (it keeps the analysis of recent matrices: a matrix solved
        before costs only the solve, see ``info["cudss_reused"]`` and
        :func:`managed_solve.solvers.release_factorisations`), else cupyx's
        sparse QR.
    M : {"auto", "jacobi", "neumann", "amg"}, operator, callable or None
        Preconditioner (an approximation of ``A^-1``). ``"auto"`` (default)
        sets up smoothed-aggregation AMG for CG on a large elliptic system (a
        sparse symmetric matrix with a positive diagonal, at least
        :data:`~managed_solve.system.method.AMG_MIN_N` unknowns for the
        device's kind, whose CG iteration bound is high) and takes no
        preconditioner otherwise; None asks for none. The preconditioner
        guide says which to pick (and why ``"chebyshev"`` is refused).
    callback : callable, optional
        ``callback(xk)`` after each iteration (gmres: each restart cycle;
        direct: once). A callback moves a CSR solve off the fused batched
        path, which has no per-iteration hook, to the generic one.
    device : str or Device, optional
        ``"cpu"``, ``"cuda:1"``, ``"sim:0"`` (a simulated GPU: runs on the
        CPU backend, but "auto" chooses methods as for a GPU), obeyed over a pin
        to another device with a UserWarning naming the fix. None: an input
        pinned with the manager (:meth:`DeviceManager.pin`: the LinearSystem,
        else A, else b, as given or as converted) goes to its device, moved
        there from another GPU if need be (as in ``solve_many``); other inputs
        already on a GPU stay there; host inputs go where the DeviceManager
        places them, with ``nbytes + workspace_bytes(method)`` reserved for
        the duration of the solve.
        ``"all"`` (or a list of names) shards the system over every GPU
        (see ``devices``).
    dtype : {float32, float64}, optional
        Precision of the solve (default: float32 only when A and b are).
    manager : DeviceManager, optional
        Default: ``managed_solve.device_manager``.
    devices : "all", int or list of device names, optional
        Shard one large system over several GPUs (real or simulated): rows are
        split into nnz-balanced blocks after a reverse Cuthill-McKee
        reordering, halos are exchanged each iteration, and x is gathered on
        the first device (:func:`managed_solve.sharded.solve_sharded`). CG or
        BiCGStab, optionally with ``M="jacobi"``.

    nullspace : "constant" or array of shape (n,) or (n, k), optional
        A basis of the null space of a singular symmetric A (``"constant"``
        for a pure Neumann problem or a closed surface's Laplacian): b is
        projected onto A's range, x returned orthogonal to the null space, and
        a b outside the range gets the least-squares answer with the status
        ``LEAST_SQUARES``.

    Returns
    -------
    SolveResult
        ``x`` on the device it was solved on, ``status``, ``iterations``,
        ``residual_norm`` (true residual), ``device``, ``seconds``,
        ``method``. Not converging is a status, not an exception.

    Raises
    ------
    ValueError, TypeError
        Invalid input (shapes, NaN/Inf, dtypes, options), naming the argument.
    RuntimeError
        A device named in ``device`` cannot be used.

    See Also
    --------
    scipy.sparse.linalg.cg, scipy.sparse.linalg.gmres : the argument names used.
    managed_solve.solve_many : many systems, batched over every GPU.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import solve
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(100, 100)).tocsr()
    >>> res = solve(A, np.ones(100), method="cg", device="cpu")
    >>> res.converged, res.device, res.relative_residual < 1e-8
    (True, 'cpu', True)
    """
    if not isinstance(A_or_system, LinearSystem) and b is not None and _is_block(b):
        if devices is not None or _names_several(device):
            if np.shape(b)[1] == 1:  # one column: the sharded solve of the vector, as a column
                return _as_column(solve(
                    A_or_system, _column(b), x0=None if x0 is None else _column(x0), rtol=rtol,
                    atol=atol, maxiter=maxiter, method=method, M=M, callback=callback,
                    device=device, dtype=dtype, manager=manager, devices=devices,
                    nullspace=nullspace))
            raise ValueError("solve(A, B, devices=...): a sharded solve takes one right-hand side; "
                             "solve the columns one by one, or on one device.")
        if dtype is None and not _is_float32(b):
            dtype = np.float64  # float32 only when A and b both are, as for a vector b
        # Every error names this call (and the argument), not the Solver doing the work.
        solver = Solver(A_or_system, method=method, M=M, rtol=rtol, atol=atol, maxiter=maxiter,
                        callback=callback, device=device, dtype=dtype,
                        manager=manager_or_default(manager, "solve"), nullspace=nullspace,
                        rhs=int(np.shape(b)[1]), _call="solve(A, B)", _given=(b,))
        try:
            return solver.solve(b, x0)
        finally:
            solver.release()  # now, or when the autograd graph of the result is freed
    system = _as_system(A_or_system, b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter,
                        method=method, M=M, dtype=dtype, nullspace=nullspace)
    mgr = manager_or_default(manager, "solve")
    many = devices if devices is not None else (device if _names_several(device) else None)
    if many is not None:
        if system.grad is not None:
            raise ValueError("solve(A, b, devices=...): a sharded solve gives no gradient, and A "
                             "or b requires grad; solve on one device, or detach the inputs.")
        return _sharded(system, many, mgr)
    # Pins are looked for on the inputs as given (validation may have converted them) first.
    given = (A_or_system, A_or_system.A, A_or_system.b) if isinstance(A_or_system, LinearSystem) \
        else (A_or_system, b)
    solver = Solver.from_system(system, device=device, manager=mgr, callback=callback, rhs=1,
                                _call="solve", _given=given)
    try:
        # Attached to autograd when A's values or b require grad: the solver
        # then stays open for the one adjoint solve of backward.
        return solver.attach(solver.solve_one(solver.system.b, solver.system.x0), system.grad)
    finally:
        solver.release()


def _names_several(device: Any) -> bool:
    return (isinstance(device, str) and device == "all") or isinstance(device, (list, tuple))


def _is_float32(b: Any) -> bool:
    """Whether ``b`` (NumPy, CuPy or torch) holds float32 values."""
    dt = getattr(b, "dtype", None)
    return dt is not None and str(dt).rsplit(".", 1)[-1] == "float32"


def _is_block(b: Any) -> bool:
    """A 2-D right-hand side, (n, 1) included: its x and figures are per column."""
    shape = getattr(b, "shape", None)
    if shape is None:
        try:
            shape = np.shape(b)
        except (TypeError, ValueError):  # ragged lists: validation reports them
            return False
    return len(shape) == 2


def _column(v: Any) -> Any:
    """The one column of an (n, 1) array (NumPy, CuPy, torch or nested lists) as a vector; else v."""
    if not hasattr(v, "shape"):
        v = np.asarray(v)
    return v[:, 0] if len(v.shape) == 2 and v.shape[1] == 1 else v


def _as_column(res: SolveResult) -> SolveResult:
    """A one-vector result in the form of a one-column block's: x (n, 1), figures per column."""
    x = None if res.x is None else res.x.reshape(-1, 1)
    return replace(res, x=x, iterations=np.array([res.iterations]),
                   residual_norm=np.array([res.residual_norm]), b_norm=np.array([res.b_norm]),
                   info={**res.info, "columns": 1}, column_status=(res.status,))


def _sharded(system: LinearSystem, devices: Any, mgr: Any) -> SolveResult:
    """One system over several devices (sharded.py); the same options as one device."""
    from .sharded import solve_sharded  # sharded sits beside solve: imported on use

    if system.kind != "csr":
        raise ValueError("solve(A, b, devices=...): sharding needs A as a sparse matrix; "
                         f"A arrived as {system.kind}. Convert it with scipy.sparse.csr_matrix(A).")
    method = system.method
    if method == "auto":
        # The sharded solver runs CG and BiCGStab: a symmetric indefinite
        # matrix ("minres" on one device) takes BiCGStab there.
        method = krylov_method(system.A, matrix_symmetry(system))
        method = "bicgstab" if method == "minres" else method
    if method not in ("cg", "bicgstab"):
        raise ValueError(f"solve(A, b, devices=...): method={method!r} cannot be sharded; "
                         "use method='cg' (SPD) or 'bicgstab', or solve on one device.")
    M = None if isinstance(system.M, str) and system.M == "auto" else system.M
    if M not in (None, "jacobi"):
        raise ValueError("solve(A, b, devices=...): sharded solves take M=None or M='jacobi', "
                         f"got {system.M!r}.")
    if system.nullspace is not None:
        # The sharded loops neither project b nor x: a singular system there
        # would come back with an arbitrary null-space part, or not converge.
        raise ValueError("solve(A, b, devices=...): a singular system with a null space "
                         "(nullspace=, set by pde.laplacian and pde.poisson without Dirichlet "
                         "vertices) cannot be sharded; solve it on one device, or give every "
                         "connected component a Dirichlet vertex.")
    return solve_sharded(system.A, system.b, devices=devices, x0=system.x0, rtol=system.rtol,
                         atol=system.atol, maxiter=system.maxiter, method=method, M=M,
                         manager=mgr)


def _as_system(A: Any, b: Any, **opts: Any) -> LinearSystem:
    if isinstance(A, LinearSystem):
        if b is not None:
            raise ValueError(
                "solve(system, b): a LinearSystem already holds b; call solve(system) or "
                "solve(A, b)."
            )
        defaults = {"x0": None, "rtol": 1e-8, "atol": 0.0, "maxiter": None, "method": "auto",
                    "M": "auto", "dtype": None, "nullspace": None}
        changed = {k: v for k, v in opts.items() if not _is_default(v, defaults[k])}
        if not changed:
            return A
        kw = {"x0": A.x0, "rtol": A.rtol, "atol": A.atol, "maxiter": A.maxiter,
              "method": A.method, "M": A.M, "dtype": A.dtype, "nullspace": A.nullspace}
        kw.update(changed)
        return LinearSystem(A.A, A.b, name=A.name, _call="solve(system)", **kw)
    if b is None:
        raise TypeError("solve(A, b=None): b is missing; pass the right-hand side, "
                        "or a LinearSystem as the only argument.")
    return LinearSystem(A, b, _call="solve(A, b)", **opts)


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, (int, float, str)) and isinstance(default, (int, float, str)):
        return value == default
    return False
