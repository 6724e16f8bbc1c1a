"""The sharded engine: one system over several GPUs, in the shape every engine has.

``ShardedEngine().prepare(A, options, devices)`` partitions ``A`` and uploads
its row blocks once (the set-up is cached per matrix object, see
:mod:`managed_solve.sharded.cache`); the prepared object then solves as often
as needed with distributed CG or BiCGStab (``options.method``), takes new
values on the same pattern (:meth:`ShardedPrepared.update`) and solves with
the transpose (:meth:`~managed_solve.solvers.engine.Prepared.solve_transpose`).
:func:`solve_sharded` is the one-call form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from .. import _backend
from ..result import SolveResult
from ..solvers.engine import Options, Prepared
from .cache import sharded_system
from .inputs import as_vector, gather_target, host_csr
from .layout import ShardedOutcome, ShardedSystem, check_options

__all__ = ["ShardedEngine", "ShardedPrepared", "solve_sharded"]


class ShardedEngine:
    """Prepares one matrix sharded by rows over several GPUs (real or simulated).

    Parameters
    ----------
    reorder : {"rcm", "metis", None}
        Reordering before the row split (x is always in A's ordering).
    weights : sequence of float, optional
        Relative nnz share per device (uneven devices).
    manager : DeviceManager, optional
        Resolves device names (default: the package's default manager).
    gather_to : device name, "cpu" or False, optional
        Where solutions are gathered: the first device by default; ``False``
        leaves them distributed (a :class:`~managed_solve.sharded.DistributedVector`).
    check_every : int, optional
        Iterations between host reads of the residual (default
        ``config.current().sharded_check_every`` on GPUs, 1 on simulated ones).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.manager import DeviceManager
    >>> from managed_solve.solvers.engine import Options
    >>> A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(50, 50)).tocsr()
    >>> engine = ShardedEngine(manager=DeviceManager(simulate="2x1GiB"))
    >>> with engine.prepare(A, Options(method="cg", rtol=1e-10), "all") as prepared:
    ...     out = prepared.solve(np.ones(50))
    ...     prepared.update(2 * A)
    ...     half = prepared.solve(np.ones(50))
    >>> out.code, bool(np.allclose(2 * half.x, out.x))
    (0, True)
    """

    name = "sharded"

    def __init__(self, *, reorder: str | None = "rcm", weights: Sequence[float] | None = None,
                 manager: Any = None, gather_to: Any = None, check_every: int | None = None):
        self.reorder = reorder
        self.weights = weights
        self.manager = manager
        self.gather_to = gather_to
        self.check_every = check_every

    def prepare(self, operator: Any, options: Options, devices: Any) -> ShardedPrepared:
        """Partition ``operator`` over ``devices`` and check ``options`` (see :class:`ShardedPrepared`).

        Raises
        ------
        ValueError, TypeError, RuntimeError
            Bad devices, matrix or options (``method`` other than "cg" or
            "bicgstab", ``M`` other than None or "jacobi", a callback).
        """
        system = sharded_system(operator, devices, reorder=self.reorder, weights=self.weights,
                                manager=self.manager)
        return self._prepared(system, options, operator)

    def _prepared(self, system: ShardedSystem, options: Options, operator: Any) -> ShardedPrepared:
        call = "solve_sharded"
        method, jacobi, maxiter = check_options(call, options.method, options.M, options.rtol,
                                                options.atol, options.maxiter, system.n)
        if options.callback is not None:
            raise ValueError(f"{call}(callback=...): the sharded solver keeps x on the devices "
                             "between host reads and calls no callback; solve on one device "
                             "for a callback.")
        distributed = self.gather_to is False
        target = None if distributed else (
            system.devices[0] if self.gather_to is None
            else gather_target(self.gather_to, system.devices))
        if jacobi:
            system.check_jacobi(call)
        return ShardedPrepared(self, system, options, operator, method=method, jacobi=jacobi,
                               maxiter=maxiter, target=target, distributed=distributed)


class ShardedPrepared(Prepared):
    """A matrix sharded over devices, ready for any number of right-hand sides.

    ``device`` is the list of devices; :meth:`solve` gives
    :class:`~managed_solve.sharded.layout.ShardedOutcome` objects (one per
    column of a (n, k) right-hand side), with x gathered where the engine's
    ``gather_to`` says (the first device by default) and ``residual_norm``
    the true residual.
    """

    engine = "sharded"

    def __init__(self, engine: ShardedEngine, system: ShardedSystem, options: Options,
                 operator: Any, *, method: str, jacobi: bool, maxiter: int, target: Any,
                 distributed: bool):
        super().__init__(list(system.devices), options, system.n)
        self.system = system
        self.method = method
        self.jacobi = jacobi
        self.maxiter = maxiter
        self._engine = engine
        self._target = target
        self._distributed = distributed
        self._operator = operator  # the matrix with the current values (transpose, update)
        self._symmetric = options.symmetric if options.symmetric is not None else (
            True if method == "cg" else None)  # CG's contract: A is SPD
        self._transposed: ShardedPrepared | None = None

    def _solve_vector(self, b: Any, x0: Any) -> ShardedOutcome:
        o = self.options
        return self.system.run(b, x0, rtol=o.rtol, atol=o.atol, maxiter=self.maxiter,
                               method=self.method, jacobi=self.jacobi,
                               check_every=self._engine.check_every, target=self._target,
                               distributed=self._distributed)

    def _solve_transpose_vector(self, b: Any, x0: Any) -> ShardedOutcome:
        if self._symmetric is None:
            A = host_csr(self._operator, "solve_transpose")
            self._symmetric = (A != A.T).nnz == 0
        if self._symmetric:
            return self._solve_vector(b, x0)
        if self._transposed is None:
            At = host_csr(self._operator, "solve_transpose").T.tocsr()
            e = self._engine
            system = ShardedSystem(At, self.system.devices, reorder=e.reorder, weights=e.weights,
                                   manager=e.manager)
            self._transposed = e._prepared(system, self.options, At)
        return self._transposed._solve_vector(b, x0)

    def update(self, values: Any) -> None:
        """New values on the same pattern: only the values travel to the devices.

        Parameters
        ----------
        values : sparse matrix or array
            The new matrix (same shape and sparsity pattern), or its stored
            values in CSR order (``A.tocsr().data`` of the prepared matrix's
            pattern).

        Raises
        ------
        ValueError
            Another shape or pattern (prepare the new matrix instead), or a
            zero diagonal entry with ``M="jacobi"``.
        """
        self._check_open()
        A = self._matrix(values)
        system = self.system.with_values(A)
        if self.jacobi:
            system.check_jacobi("update")
        self.system, self._operator = system, A
        if self._transposed is not None:
            self._transposed.close()
            self._transposed = None
        if self.options.symmetric is None and self.method != "cg":
            self._symmetric = None

    def _matrix(self, values: Any) -> sp.csr_matrix:
        call = "ShardedPrepared.update"
        if _backend.is_torch_tensor(values):
            raise TypeError(f"{call}(values=...): got a torch tensor; pass a NumPy or CuPy array "
                            "or a sparse matrix.")
        if sp.issparse(values) or _backend.is_cupy_sparse(values) or getattr(values, "ndim", 1) == 2:
            return host_csr(values, call)
        pattern = host_csr(self._operator, call)
        data = np.asarray(_backend.to_host(values))
        if data.shape != (pattern.nnz,):
            raise ValueError(
                f"{call}(values=...): expected the {pattern.nnz} stored values of the prepared "
                f"matrix (CSR order) or a matrix of shape {pattern.shape}, got shape {data.shape}. "
                "For another pattern, prepare the new matrix with ShardedEngine().prepare.")
        return sp.csr_matrix((data, pattern.indices, pattern.indptr), shape=pattern.shape)

    def close(self) -> None:
        if self._transposed is not None:
            self._transposed.close()
            self._transposed = None
        self.system = None
        self._operator = None
        super().close()


def solve_sharded(A: Any, b: Any, *, devices: Any, x0: Any = None, rtol: float = 1e-8,
                  atol: float = 0.0, maxiter: int | None = None, method: str = "cg",
                  M: Any = None, reorder: str | None = "rcm", gather_to: Any = None,
                  weights: Sequence[float] | None = None, manager: Any = None,
                  check_every: int | None = None) -> SolveResult:
    """Solve one linear system with its rows sharded over several GPUs.

    Parameters
    ----------
    A : scipy or cupyx sparse matrix, shape (n, n)
        SPD for ``method="cg"``; any non-singular matrix for ``"bicgstab"``.
    b : array, shape (n,)
        NumPy or CuPy.
    devices : "all", int, or sequence of device names / Devices
        GPUs (or simulated GPUs) to shard over; see :func:`~managed_solve.sharded.resolve_devices`.
    x0 : array, optional
        Initial guess (zeros by default).
    rtol, atol : float
        Converged when ``||r|| <= max(rtol * ||b||, atol)`` (SciPy's rule).
    maxiter : int, optional
        Default ``10 * n`` (at least 100).
    method : {"cg", "bicgstab"}
    M : None or "jacobi"
    reorder : {"rcm", "metis", None}
        Reordering before the row split (the returned x is in A's ordering).
    gather_to : device name, "cpu" or False, optional
        Where x is gathered: the first shard's device by default; ``False``
        leaves it distributed (a :class:`~managed_solve.sharded.DistributedVector`).
    weights : sequence of float, optional
        Relative nnz share per device (uneven devices).
    manager : DeviceManager, optional
        Resolves device names (default: the package's default manager).
    check_every : int, optional
        Iterations between host reads of the residual
        (``config.current().sharded_check_every`` on GPUs, 1 simulated).

    Returns
    -------
    SolveResult
        ``residual_norm`` is the true residual ``||b - A x||``; ``info``
        holds ``shards``, ``host_syncs``, ``halo_sizes``, ``nnz_per_shard``.

    Raises
    ------
    ValueError, TypeError, RuntimeError
        Bad ``devices`` (empty, duplicated, the CPU, unknown names, none
        available), shapes, dtypes or options.

    See Also
    --------
    scipy.sparse.linalg.cg : the same argument names.
    ShardedEngine : the prepared form, for many right-hand sides and new values.
    ShardedSystem : the set-up itself (cached per matrix, see ``sharded_system``).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.manager import DeviceManager
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(16, 16))
    >>> A = (sp.kron(sp.eye(16), T) + sp.kron(T, sp.eye(16))).tocsr()
    >>> dm = DeviceManager(simulate="2x1GiB")
    >>> res = solve_sharded(A, np.ones(256), devices="all", manager=dm, rtol=1e-10)
    >>> res.converged, res.info["shards"], res.relative_residual < 1e-9
    (True, 2, True)
    """
    engine = ShardedEngine(reorder=reorder, weights=weights, manager=manager,
                           gather_to=gather_to, check_every=check_every)
    options = Options(method=method, M=M, rtol=rtol, atol=atol, maxiter=maxiter)
    with engine.prepare(A, options, devices) as prepared:
        b = as_vector(b, prepared.n, "solve_sharded", "b")
        if x0 is not None:
            x0 = as_vector(x0, prepared.n, "solve_sharded", "x0")
        return prepared.solve(b, x0).to_result()
