"""solve(): one linear system on one device, with a SciPy-like call.

The flow: validate once (:class:`~managed_solve.system.LinearSystem`), choose
the device (the caller's, the GPU the arrays already lie on, or the
DeviceManager's choice with the bytes reserved for the solve), choose the
method, run it there, check the true residual, and learn the measured time
for the next placement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _backend
from .devices import Device, parse_device_name
from .result import SolveResult, Status
from .solvers import _common, batched
from .solvers.bicgstab import bicgstab, bicgstab_fused
from .solvers.cg import cg, cg_fused
from .solvers.direct import direct
from .solvers.gmres import gmres, gmres_fused
from .solvers.minres import minres
from .solvers.preconditioners import make_preconditioner
from .system import FALLBACK, LinearSystem, positive_diagonal, prefers_cg

log = logging.getLogger("managed_solve")

# method="auto" picks the direct solver on the CPU up to this many unknowns
# for 2D-like sparsity (at most _DIRECT_MAX_ROW_NNZ entries a row). Measured
# 2026-11-22 on the 2-core development machine (shared, so +-30%), 2D
# 5-point Poisson, b = ones, float64, rtol 1e-8, SuperLU (MMD_AT_PLUS_A) vs
# the fused batched CG and the generic CG:
#   n =  2,500: direct 0.014 s, CG 0.011-0.012 s (93 iterations)
#   n = 10,000: direct 0.039 s, CG 0.017-0.065 s (187)
#   n = 40,000: direct 0.25 s,  CG 1.2-1.5 s (369)
#   n = 90,000: direct 0.57 s,  CG 7.6-12 s (550)
# Direct wins from about 10k up to 90k and beyond; 100k is where we stop
# trusting it: 3D problems (more fill) are excluded by the row-length test,
# and SuperLU's memory grows faster than CG's five vectors.
DIRECT_MAX_N = 100_000
_DIRECT_MAX_ROW_NNZ = 12
# Dense matrices: LAPACK's LU beats any Krylov method at these sizes.
DIRECT_MAX_DENSE_N = 4_000
# Extra Krylov restarts from the current x when the recurrence residual met
# the tolerance but the true residual did not (drift, mostly in float32).
_REFINEMENTS = 2


def solve(A_or_system: Any, b: Any = None, *, x0: Any = None, rtol: float = 1e-8,
          atol: float = 0.0, maxiter: int | None = None, method: str = "auto", M: Any = None,
          callback: Callable[[Any], None] | None = None, device: Any = None,
          dtype: Any = None, manager: Any = None, devices: Any = None) -> SolveResult:
    """Solve one sparse (or dense, or operator) linear system ``A x = b``.

    Parameters
    ----------
    A_or_system : matrix, operator or LinearSystem
        SciPy or cupyx sparse, torch sparse CSR/COO, dense NumPy/CuPy/torch,
        an object with ``shape`` and ``matvec``, or a :class:`LinearSystem`
        (then ``b`` is omitted and the system's own options are used, except
        those given here with a non-default value).
    b : array, shape (n,)
        NumPy, CuPy or torch. Torch tensors are used through DLPack, without
        copies.
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
    M : {"jacobi", "chebyshev", "neumann"}, operator or callable, optional
        Preconditioner (an approximation of ``A^-1``).
    callback : callable, optional
        ``callback(xk)`` after each iteration (gmres: each restart cycle;
        direct: once). A callback moves a CSR solve off the fused batched
        path, which has no per-iteration hook, to the generic one.
    device : str or Device, optional
        ``"cpu"``, ``"cuda:1"``, ``"sim:0"`` (a simulated GPU: runs on the
        CPU backend, but "auto" chooses methods as for a GPU). None: inputs already on a GPU stay there; host inputs
        go where the DeviceManager places them, with ``nbytes +
        workspace_bytes(method)`` reserved for the duration of the solve.
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
    >>> from managed_solve.solve import solve
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(100, 100)).tocsr()
    >>> res = solve(A, np.ones(100), method="cg", device="cpu")
    >>> res.converged, res.device, res.relative_residual < 1e-8
    (True, 'cpu', True)
    """
    system = _as_system(A_or_system, b, x0=x0, rtol=rtol, atol=atol, maxiter=maxiter,
                        method=method, M=M, dtype=dtype)
    from .manager import default_manager  # the manager sits below; default made on demand

    mgr = manager if manager is not None else default_manager()
    many = devices if devices is not None else (
        device if (isinstance(device, str) and device == "all") or isinstance(device, (list, tuple)) else None)
    if many is not None:
        return _sharded(system, many, mgr)
    on_gpu = system.device.startswith("cuda")

    if device is not None:
        dev = _named_device(device, mgr)
    elif on_gpu:
        dev = _named_device(system.device, mgr)
    else:
        dev = None

    # The method decides the workspace; "auto" on a device still unknown is
    # resolved as for an accelerator (no direct), then again once placed.
    symmetric = _is_symmetric(system) if system.method in ("auto", "direct") else None
    planned = _choose_method(system, dev.kind if dev is not None else "cuda", symmetric)
    # Through the manager's size heuristic (managed_solve.USE_HEURISTIC), as
    # every reservation of an object is.
    nbytes = mgr.size_of(system.nbytes + system.workspace_bytes(planned))
    reservation = _reserve(mgr, nbytes, dev, system, planned)
    try:
        if dev is None:
            dev = reservation.device
        system = _move(system, dev)
        chosen = _choose_method(system, dev.kind, symmetric)
        return _run(system, chosen, symmetric, dev, callback, mgr, reservation)
    finally:
        if reservation is not None:
            reservation.release()


# ---------------------------------------------------------------------- set-up

def _sharded(system: LinearSystem, devices: Any, mgr: Any) -> SolveResult:
    """One system over several devices (sharded.py); the same options as one device."""
    from .sharded import solve_sharded  # sharded sits beside solve: imported on use

    if system.kind != "csr":
        raise ValueError("solve(A, b, devices=...): sharding needs A as a sparse matrix; "
                         f"A arrived as {system.kind}. Convert it with scipy.sparse.csr_matrix(A).")
    method = system.method
    if method == "auto":
        method = krylov_method(system.A, _is_symmetric(system), indefinite="bicgstab")
    if method not in ("cg", "bicgstab"):
        raise ValueError(f"solve(A, b, devices=...): method={method!r} cannot be sharded; "
                         "use method='cg' (SPD) or 'bicgstab', or solve on one device.")
    if system.M not in (None, "jacobi"):
        raise ValueError("solve(A, b, devices=...): sharded solves take M=None or M='jacobi', "
                         f"got {system.M!r}.")
    return solve_sharded(system.A, system.b, devices=devices, x0=system.x0, rtol=system.rtol,
                         atol=system.atol, maxiter=system.maxiter, method=method, M=system.M,
                         manager=mgr)


def _as_system(A: Any, b: Any, **opts: Any) -> LinearSystem:
    if isinstance(A, LinearSystem):
        if b is not None:
            raise ValueError(
                "solve(system, b): a LinearSystem already holds b; call solve(system) or "
                "solve(A, b)."
            )
        defaults = {"x0": None, "rtol": 1e-8, "atol": 0.0, "maxiter": None, "method": "auto",
                    "M": None, "dtype": None}
        changed = {k: v for k, v in opts.items() if not _is_default(v, defaults[k])}
        if not changed:
            return A
        kw = {"x0": A.x0, "rtol": A.rtol, "atol": A.atol, "maxiter": A.maxiter,
              "method": A.method, "M": A.M, "dtype": A.dtype}
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


def _named_device(device: Any, mgr: Any) -> Device:
    if isinstance(device, Device):
        return device
    kind, idx = parse_device_name(str(device), what="solve(device=...)")
    try:
        return mgr.get_device(device)
    except ValueError:
        pass
    if kind == "cuda":
        n, why = _backend.cuda_probe()
        if idx >= n:
            raise RuntimeError(
                f"solve(device={device!r}): no such CUDA GPU here ({n} usable"
                f"{'; ' + why if why else ''}). Use device='cpu' or device=None."
            )
        from .devices import discover_cuda

        for d in discover_cuda()[0]:
            if d.index == idx:
                return d
    if kind == "cpu":
        from .devices import cpu_device

        return cpu_device()
    raise RuntimeError(f"solve(device={device!r}): the manager has no such device "
                       f"({', '.join(str(d) for d in mgr.devices)}); pass manager=... or "
                       "device=None.")


def _reserve(mgr: Any, nbytes: int, dev: Device | None, system: LinearSystem, method: str):
    sig = (*system.signature[:3], method, system.kind)
    if dev is None:
        return mgr.reserve(nbytes, disperse=True, signature=sig, obj=system)
    try:
        return mgr.reserve(nbytes, dev, signature=sig)
    except ValueError:  # a device this manager does not manage: run unreserved
        return None
    except MemoryError as exc:  # the caller asked for this device: obey, but say so
        log.warning("managed_solve: solve(device=%s) runs beyond the ledger: %s", dev, exc)
        return None


def _move(system: LinearSystem, dev: Device) -> LinearSystem:
    if dev.kind == "cuda":
        if system.device != str(dev):
            system = system.to(str(dev))
        return system
    return system if system.device == "cpu" else system.to("cpu")


def _is_symmetric(system: LinearSystem) -> bool | None:
    if system.kind == "csr":
        return system.is_symmetric_hint
    if system.kind == "dense":
        xp = _backend.array_module(system.A)
        A = system.A
        scale = float(xp.abs(A).max())  # sync: once, choosing the method
        return bool(xp.abs(A - A.T).max() <= 1e-12 * max(scale, 1.0))  # sync: once
    return None


def _choose_method(system: LinearSystem, device_kind: str, symmetric: bool | None) -> str:
    """The method for ``method="auto"`` on a device of ``device_kind``; the given one otherwise."""
    method = system.method
    if method != "auto":
        return method
    # Simulated GPUs run on the CPU backend but stand for GPUs: they take the
    # GPU's choice, so tests on them exercise the iterative paths.
    host = device_kind == "cpu"
    if host and system.kind == "csr" and system.n <= DIRECT_MAX_N \
            and system.nnz <= _DIRECT_MAX_ROW_NNZ * system.n \
            and not prefers_cg(system.A, system.rtol, symmetric):
        return "direct"
    if host and system.kind == "dense" and system.n <= DIRECT_MAX_DENSE_N:
        return "direct"
    return krylov_method(system.A, symmetric)


def krylov_method(A: Any, symmetric: bool | None, *, indefinite: str = "minres") -> str:
    """The Krylov method for a matrix: the package's one rule, also used by ``solve_many``.

    Parameters
    ----------
    A : sparse matrix or dense array
        Only its diagonal is read, and only when ``symmetric`` is true.
    symmetric : bool or None
        Whether A is symmetric (None: unknown, treated as not symmetric).
    indefinite : str
        The method for a symmetric A whose diagonal is not all positive:
        ``"minres"`` for :func:`solve`; ``"bicgstab"`` where only CG and
        BiCGStab exist (the batched core, sharded solves).

    Returns
    -------
    str
        ``"cg"`` for a symmetric A with a positive diagonal, ``indefinite``
        for another symmetric A, ``"bicgstab"`` otherwise.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(4, 4), format="csr")
    >>> krylov_method(A, True), krylov_method(-A, True), krylov_method(A, False)
    ('cg', 'minres', 'bicgstab')
    """
    if not symmetric:
        return "bicgstab"
    return "cg" if positive_diagonal(A) else indefinite


# ---------------------------------------------------------------------- running

def _run(system: LinearSystem, method: str, symmetric: bool | None, dev: Device,
         callback: Any, mgr: Any, reservation: Any) -> SolveResult:
    A, b = system.A, system.b
    xp = _backend.array_module(b)
    b_norm = float(_common.norm(xp, b))  # sync: once, for the result
    tol = _common.stop_threshold(system.rtol, system.atol, b_norm)
    maxiter = system.maxiter if system.maxiter is not None else _common.default_maxiter(system.n)
    # Iterations the manager saw for this kind of system: the fused loop's first
    # convergence read goes there, so a repeated solve syncs with the host once.
    sig = (*system.signature[:3], method, system.kind, system.rtol)
    first_check = mgr.predict(sig, device=dev).iterations if mgr is not None else None
    t0 = time.perf_counter()
    try:
        dev.check_fault(system.nbytes)
        with dev.context():
            out = _dispatch(system, method, symmetric, callback, maxiter, first_check=first_check)
            if system.method == "auto" and out.code == _common.BREAKDOWN and method in FALLBACK:
                # "auto" guessed from cheap tests (a positive diagonal does not
                # make a symmetric matrix definite): retry with the robust method.
                log.info("managed_solve: %s broke down (%s); auto falls back to %s",
                         method, out.message, FALLBACK[method])
                spent, tried = out.iterations, method
                method = FALLBACK[method]
                out = _dispatch(system, method, symmetric, callback, maxiter)
                out.iterations += spent
                out.info["fallback_from"] = tried
            if method != "direct":
                out = _refine(system, method, callback, out, tol, maxiter)
            _backend.synchronize() if dev.kind == "cuda" else None
    except MemoryError as exc:  # SimulatedOutOfMemory, cupy's OutOfMemoryError
        seconds = time.perf_counter() - t0
        return SolveResult(None, Status.DEVICE_ERROR, 0, float("nan"), b_norm, str(dev), seconds,
                           method, f"out of memory on {dev}: {exc}. Free memory there or let the "
                           "manager choose (device=None).", system.name)
    seconds = time.perf_counter() - t0

    x = out.x
    if x is not None:
        residual = _common.true_residual_norm(A, b, x)
        # That read waited for the solve's queued masked iterations: free what
        # the fused GPU core kept alive for them (nothing on other paths).
        batched.release_done()
    else:
        residual = out.residual_norm
    status, message = _status(out, method, residual, tol, system)
    if mgr is not None:
        cost = float(system.nbytes + system.workspace_bytes(method)) * max(out.iterations, 1)
        mgr.record(sig, seconds, peak_bytes=system.nbytes + system.workspace_bytes(method),
                   device=dev, cost=cost,
                   iterations=out.iterations if status in (Status.CONVERGED, Status.MAXITER) else None)
    info = dict(out.info)
    info.setdefault("path", "generic" if method != "direct" else "direct")
    info["host_syncs"] = out.host_syncs
    return SolveResult(x, status, out.iterations, residual, b_norm, str(dev), seconds, method,
                       message, system.name, info)


def _status(out: _common.Outcome, method: str, residual: float, tol: float,
            system: LinearSystem) -> tuple[Status, str]:
    if out.code == _common.BREAKDOWN:
        return Status.BREAKDOWN, out.message or Status.BREAKDOWN.message
    if out.code == _common.MAXITER:
        return Status.MAXITER, (f"{method}: {out.iterations} iterations did not reach the "
                                f"tolerance (||b - A x|| = {residual:.3g} > {tol:.3g}); raise "
                                "maxiter, loosen rtol, or add a preconditioner (M='jacobi').")
    if method == "direct":
        return Status.CONVERGED, f"solved by {out.info.get('factorisation', 'LU')}"
    if not residual <= tol * (1 + 1e-6):
        return Status.MAXITER, (
            f"{method}: the recurrence met the tolerance but the true residual "
            f"||b - A x|| = {residual:.3g} exceeds {tol:.3g} after {_REFINEMENTS} restarts; "
            f"{system.dtype} may not resolve rtol={system.rtol:g} (use dtype='float64' or a "
            "looser rtol).")
    return Status.CONVERGED, f"{method}: converged in {out.iterations} iterations"


def _fused_ok(system: LinearSystem, method: str, callback: Any) -> bool:
    """The batched core applies: CSR, CG/BiCGStab (GMRES on a GPU), no or Jacobi M, no callback.

    The generic path is kept only for what the fused core cannot do (dense A,
    operators, polynomial or user M, callbacks), not for speed. Measured on
    one H200, 2D Poisson, float64, rtol 1e-8: n = 16k, fused 18 us/iteration,
    cupyx cg 241, generic CuPy CG 575 (Python dispatch of ~25 small CuPy
    operations per iteration); n = 1M, fused 55, cupyx 200, generic 456.

    GMRES(30) takes the batched core on a GPU only. One H100, upwind
    convection-diffusion, rtol 1e-8, same iterations both ways: n = 65k,
    batched 60 ms (chunks replayed as CUDA graphs), generic 344; n = 1M,
    batched 782, generic 1,188. On the
    CPU the generic GMRES's BLAS products beat the per-system Numba kernel
    for one large system (2-core development machine, n = 65k: 409 against
    778 ms); many systems (``solve_many``) take the kernel, in parallel.
    """
    if system.kind != "csr" or method not in ("cg", "bicgstab", "gmres") or callback is not None:
        return False
    if method == "gmres" and _backend.array_module(system.b) is np:
        return False
    if not (system.M is None or _is_jacobi(system.M)):
        return False
    try:
        from .solvers import batched  # noqa: F401
    except ImportError:  # the fused core is an optional part during development
        log.info("managed_solve: the batched core is not importable; using the generic %s", method)
        return False
    return True


def _is_jacobi(M: Any) -> bool:
    return isinstance(M, str) and M == "jacobi"


def _dispatch(system: LinearSystem, method: str, symmetric: bool | None, callback: Any,
              maxiter: int, x0: Any = None, first_check: int | None = None) -> _common.Outcome:
    A, b = system.A, system.b
    x0 = system.x0 if x0 is None else x0
    if method == "direct":
        if system.kind == "operator":
            raise ValueError("solve(method='direct'): A is an operator without entries; use "
                             "method='gmres' or pass A as a sparse matrix.")
        out = direct(A, b, symmetric=symmetric)
        if callback is not None and out.x is not None:
            callback(out.x)
        return out
    if _fused_ok(system, method, callback):
        if method == "gmres":
            return gmres_fused(A, b, x0=x0, rtol=system.rtol, atol=system.atol, maxiter=maxiter,
                               jacobi=_is_jacobi(system.M))
        fused = cg_fused if method == "cg" else bicgstab_fused
        return fused(A, b, x0=x0, rtol=system.rtol, atol=system.atol, maxiter=maxiter,
                     jacobi=_is_jacobi(system.M), first_check=first_check)
    M = make_preconditioner(system.M, A)
    solver = {"cg": cg, "bicgstab": bicgstab, "gmres": gmres, "minres": minres}[method]
    return solver(A, b, x0=x0, rtol=system.rtol, atol=system.atol, maxiter=maxiter, M=M,
                  callback=callback)


def _refine(system: LinearSystem, method: str, callback: Any, out: _common.Outcome,
            tol: float, maxiter: int) -> _common.Outcome:
    """Restart from x while the recurrence converged but the true residual did not."""
    total, syncs = out.iterations, out.host_syncs
    for _ in range(_REFINEMENTS):
        if out.code != _common.CONVERGED or out.x is None:
            break
        if _common.true_residual_norm(system.A, system.b, out.x) <= tol:
            break
        left = maxiter - total
        if left <= 0:
            break
        nxt = _dispatch(system, method, None, callback, left, x0=out.x)
        total += nxt.iterations
        syncs += nxt.host_syncs
        out = nxt
    out.iterations, out.host_syncs = total, syncs
    return out
