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

from . import _backend
from .devices import Device, parse_device_name
from .result import SolveResult, Status
from .solvers import batched
from .solvers._common import norm, stop_threshold, true_residual_norm
from .solvers.direct import SINGULAR, DirectEngine, Singular
from .solvers.engine import BREAKDOWN, CONVERGED, MAXITER, Options, Outcome, Prepared
from .solvers.krylov import KrylovEngine, PreparedKrylov
from .system import FALLBACK, LinearSystem
from .system.method import choose_method, krylov_method, matrix_symmetry

log = logging.getLogger("managed_solve")

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
    >>> from managed_solve import solve
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
    symmetric = matrix_symmetry(system) if system.method in ("auto", "direct") else None
    planned = choose_method(system, dev.kind if dev is not None else "cuda", symmetric=symmetric)
    # Through the manager's size heuristic (managed_solve.USE_HEURISTIC), as
    # every reservation of an object is.
    nbytes = mgr.size_of(system.nbytes + system.workspace_bytes(planned))
    reservation = _reserve(mgr, nbytes, dev, system, planned)
    try:
        if dev is None:
            dev = reservation.device
        system = _move(system, dev)
        chosen = choose_method(system, dev.kind, symmetric=symmetric)
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
        # The sharded solver runs CG and BiCGStab: a symmetric indefinite
        # matrix ("minres" on one device) takes BiCGStab there.
        method = krylov_method(system.A, matrix_symmetry(system))
        method = "bicgstab" if method == "minres" else method
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


# ---------------------------------------------------------------------- running

def prepare(system: LinearSystem, method: str, device: Device, *, symmetric: bool | None = None,
            callback: Any = None, first_check: int | None = None) -> Prepared:
    """The engine for ``method`` prepared on ``system.A`` (already on ``device``).

    ``"direct"`` factorises (:class:`~managed_solve.solvers.direct.DirectEngine`);
    the Krylov methods build their preconditioner
    (:class:`~managed_solve.solvers.krylov.KrylovEngine`).
    """
    options = Options(method, M=system.M, rtol=system.rtol, atol=system.atol,
                      maxiter=system.maxiter, callback=callback, symmetric=symmetric,
                      first_check=first_check)
    if method == "direct":
        if system.kind == "operator":
            raise ValueError("solve(method='direct'): A is an operator without entries; use "
                             "method='gmres' or pass A as a sparse matrix.")
        return DirectEngine().prepare(system.A, options, device)
    return KrylovEngine().prepare(system.A, options, device, kind=system.kind)


def _attempt(system: LinearSystem, method: str, symmetric: bool | None, callback: Any,
             dev: Device, first_check: int | None) -> Outcome:
    """Prepare ``method`` and solve the system's b once (direct: factors, then one solve)."""
    try:
        prepared = prepare(system, method, dev, symmetric=symmetric, callback=callback,
                           first_check=first_check)
    except Singular as exc:
        return Outcome(None, BREAKDOWN, 0, float("nan"), f"{SINGULAR} ({exc})")
    with prepared:
        out = prepared.solve(system.b, system.x0)
        if method == "direct":
            if callback is not None and out.x is not None:
                callback(out.x)
        else:
            tol = stop_threshold(system.rtol, system.atol, float(norm(_backend.array_module(
                system.b), system.b)))  # sync: once, the restart threshold
            out = _refine(system, prepared, out, tol)
    return out


def _run(system: LinearSystem, method: str, symmetric: bool | None, dev: Device,
         callback: Any, mgr: Any, reservation: Any) -> SolveResult:
    A, b = system.A, system.b
    xp = _backend.array_module(b)
    b_norm = float(norm(xp, b))  # sync: once, for the result
    tol = stop_threshold(system.rtol, system.atol, b_norm)
    # Iterations the manager saw for this kind of system: the fused loop's first
    # convergence read goes there, so a repeated solve syncs with the host once.
    sig = (*system.signature[:3], method, system.kind, system.rtol)
    first_check = mgr.predict(sig, device=dev).iterations if mgr is not None else None
    t0 = time.perf_counter()
    try:
        dev.check_fault(system.nbytes)
        with dev.context():
            out = _attempt(system, method, symmetric, callback, dev, first_check)
            fallback = fallback_method(system, method, out, symmetric)
            if fallback is not None:
                # "auto" guessed from cheap tests (a positive diagonal does not
                # make a symmetric matrix definite; a factorisation may meet a
                # singular matrix): retry with the robust method.
                log.info("managed_solve: %s did not solve (%s); auto falls back to %s",
                         method, out.message, fallback)
                spent, tried = out.iterations, method
                method = fallback
                out = _attempt(system, method, symmetric, callback, dev, None)
                out.iterations += spent
                out.info["fallback_from"] = tried
            _backend.synchronize() if dev.kind == "cuda" else None
    except MemoryError as exc:  # SimulatedOutOfMemory, cupy's OutOfMemoryError
        seconds = time.perf_counter() - t0
        return SolveResult(None, Status.DEVICE_ERROR, 0, float("nan"), b_norm, str(dev), seconds,
                           method, f"out of memory on {dev}: {exc}. Free memory there or let the "
                           "manager choose (device=None).", system.name)
    seconds = time.perf_counter() - t0

    x = out.x
    if x is not None:
        residual = true_residual_norm(A, b, x)
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


def fallback_method(system: LinearSystem, method: str, out: Outcome,
                    symmetric: bool | None) -> str | None:
    """The method "auto" tries next after ``out``, or None (the verify-and-fall-back rule).

    A Krylov method that broke down goes to :data:`FALLBACK` (CG to MINRES,
    BiCGStab to GMRES); a factorisation that found A singular goes to the
    Krylov method of the auto policy (CG or MINRES converge on a consistent
    singular system).
    """
    if system.method != "auto":
        return None
    if method == "direct" and out.code == BREAKDOWN and system.kind != "operator":
        return krylov_method(system.A, symmetric)
    if out.code == BREAKDOWN and method in FALLBACK:
        return FALLBACK[method]
    return None


def _status(out: Outcome, method: str, residual: float, tol: float,
            system: LinearSystem) -> tuple[Status, str]:
    if out.code == BREAKDOWN:
        return Status.BREAKDOWN, out.message or Status.BREAKDOWN.message
    if out.code == MAXITER:
        if method == "direct":
            return Status.MAXITER, out.message
        return Status.MAXITER, (f"{method}: {out.iterations} iterations did not reach the "
                                f"tolerance (||b - A x|| = {residual:.3g} > {tol:.3g}); raise "
                                "maxiter, loosen rtol, or add a preconditioner (M='jacobi').")
    if not residual <= tol * (1 + 1e-6):
        if method == "direct":
            return Status.MAXITER, (
                f"direct: the true residual ||b - A x|| = {residual:.3g} exceeds {tol:.3g}; "
                f"A is too ill-conditioned for rtol={system.rtol:g} in {system.dtype}.")
        return Status.MAXITER, (
            f"{method}: the recurrence met the tolerance but the true residual "
            f"||b - A x|| = {residual:.3g} exceeds {tol:.3g} after {_REFINEMENTS} restarts; "
            f"{system.dtype} may not resolve rtol={system.rtol:g} (use dtype='float64' or a "
            "looser rtol).")
    if method == "direct":
        return Status.CONVERGED, f"solved by {out.info.get('factorisation', 'LU')}"
    return Status.CONVERGED, f"{method}: converged in {out.iterations} iterations"


def _refine(system: LinearSystem, prepared: PreparedKrylov, out: Outcome, tol: float) -> Outcome:
    """Restart from x while the recurrence converged but the true residual did not."""
    total, syncs = out.iterations, out.host_syncs
    maxiter = prepared.maxiter
    for _ in range(_REFINEMENTS):
        if out.code != CONVERGED or out.x is None:
            break
        if true_residual_norm(system.A, system.b, out.x) <= tol:
            break
        left = maxiter - total
        if left <= 0:
            break
        nxt = prepared.solve_limited(system.b, out.x, left)
        total += nxt.iterations
        syncs += nxt.host_syncs
        out = nxt
    out.iterations, out.host_syncs = total, syncs
    return out
