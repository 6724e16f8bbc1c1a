"""``solve_many``: this machine (:mod:`managed_solve.scheduling`) or a Ray cluster (:mod:`managed_solve.cluster`).

The public entry point with its ``backend`` argument. It sits above both
backends, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .manager import DeviceManager
from .result import SolveResult
from .scheduling import solve_many as solve_many_local
from .system import LinearSystem


def solve_many(systems: Iterable[Any], *, disperse: bool = True, devices: Any = None,
               method: str = "auto", M: Any = None, rtol: float | None = None,
               progress: bool = False, return_on: str = "device", on_error: str = "return",
               manager: DeviceManager | None = None, backend: str = "local",
               **cluster_options: Any) -> list[SolveResult]:
    """Solve many independent linear systems, batched and dispersed over every device.

    Small systems are packed into block-diagonal batches solved by the
    batched Krylov core, in which every system keeps its own scalars and its
    own convergence test; large systems run alone; batches go longest-first
    to the device predicted to finish them earliest. An out-of-memory or
    device error splits a batch and retries the halves elsewhere, finally on
    the CPU: every system comes back exactly once, in input order.

    Parameters
    ----------
    systems : iterable of LinearSystem or (A, b) pairs
        Any mix of sizes, dtypes and array types (SciPy, CuPy, torch; on the
        host or already on a GPU).
    disperse : bool
        Spread the work over all ``devices``; False keeps it on one device
        (the one already holding most of the inputs, else the one with most room).
    devices : str, int or list, optional
        Devices to use: names (``"cuda:0,cuda:1"``, a list of names, Devices
        or torch.devices), ``"all"`` (every GPU) or a number of GPUs;
        default: every accelerator of ``manager``, else the CPU.
    method : {"auto", "cg", "bicgstab", "gmres", "minres", "direct"}
        Overrides each system's method when not "auto". "auto" picks CG for
        symmetric matrices with a positive diagonal, BiCGStab otherwise, and
        on a CPU-only run a sparse LU for small 2D-like systems: the same
        choice as :func:`solve` makes on those devices
        (:func:`managed_solve.system.method.choose_method`). CG, BiCGStab
        and GMRES(30) systems are batched; "auto" systems for which it picks
        MINRES (symmetric, not all of the diagonal positive) are solved one
        by one through :func:`solve`. An "auto" system on which CG breaks down (an
        indefinite matrix) is solved again alone with MINRES, one on which
        BiCGStab breaks down (eigenvalues near the imaginary axis) again in a
        GMRES batch, and its result says ``info["fallback_from"]``.
    M : {"auto", "jacobi", ...} or operator, optional
        Preconditioner for every system (overrides theirs when given). An
        ``(A, b)`` pair without it takes ``"auto"`` as :func:`solve` does:
        AMG for a large elliptic system, solved on its own; none for the
        systems that batch.
    rtol : float, optional
        Relative tolerance for every system; default: each system's own
        (1e-8 for pairs).
    progress : bool
        Show a tqdm progress bar of systems done, with throughput.
    return_on : {"device", "host"}
        Leave each ``x`` where it was solved, or return NumPy arrays.
    on_error : {"return", "raise"}
        "raise" raises :class:`SolveManyError` after all systems finished if any
        did not converge, listing which and why.
    manager : DeviceManager, optional
        Default: ``managed_solve.device_manager``.
    backend : {"local", "ray"}
        ``"ray"`` runs the same call over the nodes of a Ray cluster
        (:func:`managed_solve.cluster.solve_many_ray`; ``return_on`` is then
        "host" or "refs", "device" meaning "host"); ``cluster_options``
        (``address``, ``num_nodes_hint``, ...) go there.

    Returns
    -------
    list of SolveResult
        In input order. Each has ``status``, ``iterations``, the true
        ``residual_norm``, the ``device`` it was solved on, and ``info``
        (``batch`` id and ``batch_size``). In a batch, ``x`` is a view into the
        batch's solution vector (no copy), cut when ``x`` is first read; a
        result keeps the batch's vector alive until then. Where a system's A
        values or b are torch tensors that require grad, its ``to_torch()``
        is attached to autograd; one backward solves every adjoint at once
        on what this call prepared (LU factors, packed batches, solvers;
        released with the graph), each system with its own tolerance. With
        ``backend="ray"`` the backward is one more call over the cluster
        (and ``return_on="refs"`` is refused for such systems).

    Raises
    ------
    SolveManyError
        With ``on_error="raise"``, when some system did not converge.

    Notes
    -----
    One process feeds every GPU: a full garbage collection or a slow GIL
    hand-off stalls all of them at once. A caller may let a
    call pause automatic (cyclic) collection and shorten the interpreter's
    GIL switch interval while it runs, e.g.
    ``ms.config.override(pause_gc=True, switch_interval=5e-4,
    head_switch_interval=1e-4)``; both are restored when the last concurrent
    call returns. By default neither is changed.

    With many systems (setting ``head_start_systems``), the large ones (which
    run alone) start computing before the others are estimated and planned.

    See Also
    --------
    managed_solve.solve : one system on one device.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> import managed_solve as ms
    >>> A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> dm = ms.DeviceManager(["cpu"])
    >>> res = ms.solve_many([(A, np.ones(50)), (2 * A, np.ones(50))], manager=dm)
    >>> [r.converged for r in res]
    [True, True]
    >>> bool(np.allclose(2 * A @ res[1].x, 1.0))
    True
    """
    _check_iterable(systems)
    if backend == "ray":
        if manager is not None:
            raise TypeError("solve_many(backend='ray', manager=...): a manager cannot travel to "
                            "other nodes; each node makes its own. Drop manager=.")
        from .cluster import solve_many_ray  # imports ray's glue on demand

        return solve_many_ray(systems, return_on="host" if return_on == "device" else return_on,
                              disperse=disperse, devices=devices, method=method, M=M, rtol=rtol,
                              progress=progress, on_error=on_error, **cluster_options)
    if backend != "local":
        raise ValueError(f"solve_many(backend={backend!r}): expected 'local' (this machine) or "
                         "'ray' (a Ray cluster)")
    if cluster_options:
        raise TypeError(f"solve_many: unexpected argument(s) {sorted(cluster_options)}; options "
                        "other than solve_many's own apply to backend='ray' only")
    return solve_many_local(systems, disperse=disperse, devices=devices, method=method, M=M,
                            rtol=rtol, progress=progress, return_on=return_on, on_error=on_error,
                            manager=manager)


def _check_iterable(systems: Any) -> None:
    """``systems`` must hold systems: one system, or a number, is a TypeError naming the fix."""
    pair = isinstance(systems, tuple) and len(systems) == 2 and not any(
        isinstance(item, (LinearSystem, tuple, list)) for item in systems) and all(
        len(getattr(item, "shape", ())) == k for item, k in zip(systems, (2, 1), strict=True))
    if isinstance(systems, LinearSystem) or pair:  # (A, b) would be read as two systems
        raise TypeError("solve_many(systems=...): expected an iterable of systems, got one "
                        "system; wrap it in a list (solve_many([(A, b)])) or call solve(A, b).")
    try:
        iter(systems)
    except TypeError:
        raise TypeError(f"solve_many(systems=...): expected an iterable of LinearSystem or "
                        f"(A, b) pairs, got {type(systems).__name__}.") from None
