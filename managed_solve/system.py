"""LinearSystem: one validated ``A x = b`` with its solver options.

Inputs are taken where they lie: SciPy sparse stays on the host, cupyx sparse
and CuPy arrays stay on their GPU, torch tensors come through DLPack without
copies (CPU tensors as NumPy views, CUDA tensors as CuPy views). Validation
happens once, here, with errors naming the argument, what was expected, what
arrived and the fix.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from . import _backend

METHODS = ("auto", "cg", "bicgstab", "gmres", "minres", "direct")
PRECONDITIONERS = ("jacobi", "chebyshev", "neumann")
# What "auto" turns to when its guess breaks down: MINRES for a symmetric matrix
# that is not definite, GMRES for a spectrum BiCGStab cannot handle.
FALLBACK = {"cg": "minres", "bicgstab": "gmres"}
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _where(what: str) -> str:
    return f"{what}(...)"


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def result_dtype(*dtypes: Any) -> np.dtype:
    """float32 only when every input is float32; integers promote to float64."""
    found = False
    for d in dtypes:
        if d is None:
            continue
        if np.dtype(d) != _F32:  # a dtype against a dtype: no conversion per comparison
            return _F64
        found = True
    return _F32 if found else _F64


def check_dtype(dtype: Any, *, call: str, arg: str) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind == "c":
        raise TypeError(
            f"{call}: {arg} has complex dtype {dt}; managed-solve solves real systems "
            "(float32 or float64). Split a complex system into its real 2x2 block form."
        )
    if dt.kind not in "fiub" or dt.itemsize > 8:
        raise TypeError(
            f"{call}: {arg} has dtype {dt}; expected float32 or float64 "
            "(integers are promoted to float64)."
        )
    return dt


def _torch_to_array(t: Any, *, call: str, arg: str) -> Any:
    """A torch tensor as a NumPy (CPU) or CuPy (CUDA) view, through DLPack."""
    if t.requires_grad:
        t = t.detach()  # the solver does not differentiate through A or b
    if t.device.type == "cpu":
        return t.resolve_conj().numpy()
    if t.device.type == "cuda":
        cp = _backend.cupy()
        return cp.from_dlpack(t)
    raise TypeError(f"{call}: {arg} is a torch tensor on {t.device}; expected a CPU or CUDA tensor")


def _torch_sparse(t: Any, *, call: str) -> Any:
    layout = str(t.layout)
    if layout == "torch.sparse_coo":
        t = t.coalesce().to_sparse_csr()
    elif layout != "torch.sparse_csr":
        raise TypeError(f"{call}: A is a torch tensor with layout {layout}; expected dense, sparse_coo or sparse_csr")
    shape = tuple(t.shape)
    crow = _torch_to_array(t.crow_indices(), call=call, arg="A.crow_indices()")
    col = _torch_to_array(t.col_indices(), call=call, arg="A.col_indices()")
    val = _torch_to_array(t.values(), call=call, arg="A.values()")
    xp = _backend.array_module(val)
    sparse = _backend.sparse_module(xp)
    return sparse.csr_matrix((val, col, crow), shape=shape)


def as_operator(A: Any, *, call: str = "solve") -> tuple[Any, str]:
    """Normalise A: (matrix, kind) with kind in {"csr", "dense", "operator"}."""
    if A is None:
        raise TypeError(f"{call}: A is None; expected a sparse matrix, a dense array or an operator")
    if _backend.is_torch_tensor(A):
        if A.layout != __import__("torch").strided:
            return _torch_sparse(A, call=call), "csr"
        A = _torch_to_array(A, call=call, arg="A")
    if _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A):
        if A.ndim != 2:
            raise ValueError(f"{call}: A must be 2-D, got {A.ndim}-D")
        A = A.tocsr()
        A.sum_duplicates()
        return A, "csr"
    if isinstance(A, np.ndarray) or _backend.is_cupy_array(A):
        if A.ndim != 2:
            raise ValueError(f"{call}: A must be a 2-D matrix, got an array of shape {A.shape}")
        return A, "dense"
    if hasattr(A, "shape") and (hasattr(A, "matvec") or hasattr(A, "__matmul__")):
        if len(A.shape) != 2:
            raise ValueError(f"{call}: A.shape must have two entries, got {A.shape}")
        return A, "operator"
    raise TypeError(
        f"{call}: A is a {type(A).__module__}.{type(A).__name__}; expected a SciPy or cupyx sparse "
        "matrix, a torch sparse CSR/COO tensor, a dense NumPy/CuPy/torch array, or an object "
        "with `shape` and `matvec`."
    )


def as_vector(v: Any, n: int, *, call: str, arg: str, xp: Any = None) -> Any:
    """A 1-D array of length n, on the device v lies on."""
    if _backend.is_torch_tensor(v):
        v = _torch_to_array(v, call=call, arg=arg)
    elif not (isinstance(v, np.ndarray) or _backend.is_cupy_array(v)):
        try:
            v = np.asarray(v)
        except Exception as exc:
            raise TypeError(f"{call}: {arg} must be an array, got {type(v).__name__}") from exc
    if v.ndim == 2 and v.shape[1] == 1:
        v = v.reshape(-1)
    if v.ndim != 1 or v.shape[0] != n:
        raise ValueError(
            f"{call}: {arg} must have shape ({n},) to match A of shape ({n}, {n}), got shape "
            f"{tuple(v.shape)}. For several right-hand sides, solve them as separate systems "
            "with solve_many."
        )
    check_dtype(v.dtype, call=call, arg=arg)
    return v


def _all_finite(a: Any) -> bool:
    """Whether every entry of a float array is finite (no NaN, no Inf), on its device.

    Fast path: one reduction, ``a.sum()`` (reads ``a`` once, allocates
    nothing). A NaN or an Inf anywhere makes the sum non-finite, so a finite
    sum proves every entry finite; a non-finite sum may also be an overflow of
    huge finite entries, so only then the exact elementwise test decides.
    NumPy's sum runs on the calling thread. A BLAS dot (used before) was as
    fast on one core but may wake the BLAS thread pool for long vectors; on a
    32-core GPU host, W2 given as (A, b) pairs (validated in the call) ran at
    148 ms against 78 ms for prebuilt systems while it was a dot.
    """
    if a.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):  # huge entries are decided below
        fast = a.sum()
    if math.isfinite(float(fast)):  # sync: one host read at validation
        return True
    xp = _backend.array_module(a)
    return bool(xp.isfinite(a).all())  # sync: as above, only after an overflow, NaN or Inf


def _checked_finite(a: Any, memo: dict | None) -> bool:
    """:func:`_all_finite`, remembering arrays found finite in ``memo`` (by object)."""
    if memo is not None:
        hit = memo.get(id(a))
        if hit is not None and hit is a:
            return True
    ok = _all_finite(a)
    if ok and memo is not None:
        memo[id(a)] = a
    return ok


def _nonnegative_finite(v: Any) -> bool:
    """``v`` is a finite number >= 0 (Python numbers without a NumPy call)."""
    if type(v) is float or type(v) is int:
        return math.isfinite(v) and v >= 0
    return bool(np.isfinite(v) and v >= 0)


# On the CPU a sparse LU beats CG on ill-conditioned systems (W2's Poisson
# grids: spsolve 4.7-5.2 s vs CG far slower), but not on systems CG finds easy:
# on icosphere meshes (642..10,242 vertices) SuperLU took 4-900 ms while CG
# converged in 5-122 iterations (0.1-16 ms), with this bound at 12-1,228, about
# ten times the true count. Below this bound, CG is preferred (measured on the
# 2-core development machine, 2026-11-22).
CG_PREFERRED_BOUND = 2000.0


def prefers_cg(A: Any, rtol: float, symmetric: bool | None) -> bool:
    """Whether CG's Gershgorin iteration bound is low enough to skip a sparse LU on the CPU."""
    return bool(symmetric) and cg_iteration_bound(A, rtol) <= CG_PREFERRED_BOUND


def cg_iteration_bound(A: Any, rtol: float) -> float:
    """Upper bound on the CG iterations a symmetric CSR matrix needs, from Gershgorin discs.

    The eigenvalues of A lie in ``[min(a_ii - r_i), max(a_ii + r_i)]`` with
    ``r_i`` the absolute off-diagonal row sums, so for a strictly diagonally
    dominant A with a positive diagonal ``kappa <= hi / lo`` and CG needs at
    most about ``0.5 * sqrt(kappa) * ln(2 / rtol)`` iterations. Infinite when
    A is not strictly diagonally dominant (a Poisson matrix: its bound says
    nothing). Used to prefer CG over a sparse LU on the CPU for systems that are
    easy for CG (a heat step with a small time step, a strongly screened
    Poisson problem), where the LU's fill-in costs more than a few sweeps.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> heat = sp.diags([-0.1, 1.2, -0.1], [-1, 0, 1], shape=(50, 50), format="csr")
    >>> round(cg_iteration_bound(heat, 1e-8), 1)
    11.3
    >>> cg_iteration_bound(sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(50, 50), format="csr"), 1e-8)
    inf
    """
    xp = _backend.array_module(A.data)
    d = xp.asarray(A.diagonal())
    rows = xp.asarray(abs(A).sum(axis=1)).ravel()
    off = rows - xp.abs(d)
    lo = float((d - off).min())  # sync: one read for the bound
    if not lo > 0:
        return float("inf")
    hi = float((d + off).max())  # sync: as above
    return 0.5 * float(np.sqrt(hi / lo)) * float(np.log(2.0 / max(rtol, 1e-300)))


def is_symmetric(A: Any, cache: dict | None = None) -> bool:
    """Whether a CSR matrix equals its transpose (to 1e-12 relative), on the device A lies on.

    The one symmetry test of the package (``solve``'s method choice, the
    ``LinearSystem.is_symmetric_hint`` property, ``solve_many``'s routing).
    With sorted indices and a symmetric pattern the test is one transpose and
    three comparisons (about half the cost of ``abs(A - A.T).max()``);
    otherwise, or when the stored patterns differ (stored values below the
    tolerance may still make A symmetric), the difference ``A - A.T`` decides.

    Parameters
    ----------
    A : scipy.sparse or cupyx.scipy.sparse CSR matrix
    cache : dict, optional
        Answers by matrix object, for callers that meet one matrix many times
        within a call (``solve_many``); an entry is reused for the same object only.

    Returns
    -------
    bool

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> is_symmetric(sp.diags([1.0, 2.0, 1.0], [-1, 0, 1], shape=(4, 4), format="csr"))
    True
    >>> is_symmetric(sp.diags([1.0, 2.0], [0, 1], shape=(4, 4), format="csr"))
    False
    """
    if cache is not None:
        hit = cache.get(id(A))
        if hit is not None and hit[0] is A:
            return hit[1]
    if A.nnz == 0:
        result = True
    else:
        xp = _backend.array_module(A.data)
        result = None
        if xp is np and A.has_canonical_format:
            from .kernels.symmetry import DIFFERENT_PATTERN

            code = _host_symmetry(A, 1e-12)
            result = None if code == DIFFERENT_PATTERN else bool(code)
        if result is None:
            scale = float(xp.abs(A.data).max())  # sync: one read per distinct matrix
            limit = 1e-12 * max(scale, 1.0)
            if xp is not np and A.has_sorted_indices:
                T = A.T.tocsr()  # sorted indices, like A
                if bool(xp.array_equal(T.indptr, A.indptr)) and bool(  # sync: as above
                        xp.array_equal(T.indices, A.indices)):
                    result = bool(float(xp.abs(T.data - A.data).max()) <= limit)  # sync: as above
            if result is None:
                d = A - A.T
                result = bool(d.nnz == 0 or float(abs(d).max()) <= limit)  # sync: as above
    if cache is not None:
        cache[id(A)] = (A, result)
    return result


# Host matrices with at least this many stored entries are tested in row
# chunks on helper threads (a 1M-row 2D Poisson matrix, 5M entries, took
# 44 ms on one thread of an H200 host).
SYMMETRY_PARALLEL_NNZ = 1 << 20
SYMMETRY_WORKERS = min(8, os.cpu_count() or 1)


def _host_symmetry(A: Any, rel: float) -> int:
    """The symmetry code of a canonical host CSR matrix (``kernels.symmetry``), chunked when large."""
    from .kernels.symmetry import abs_max, csr_symmetry_rows, csr_symmetry_scaled

    workers = SYMMETRY_WORKERS
    # Chunks cost about 1.6 x the one-pass kernel in all (banded matrices, with
    # a cursor window per chunk; 2.2 x with a binary search per entry; 1M-row
    # 2D Poisson on the 2-core host): only worth it with several cores.
    if A.nnz < SYMMETRY_PARALLEL_NNZ or workers < 4:
        return int(csr_symmetry_scaled(A.indptr, A.indices, A.data, rel))
    pool = _backend.thread_pool("symmetry", workers)
    nnz = A.nnz
    chunks = _row_chunks(A, 2 * workers)
    step = -(-nnz // (2 * workers))
    scale = max(f.result() for f in [pool.submit(abs_max, A.data, k, min(k + step, nnz))
                                     for k in range(0, nnz, step)])
    limit = rel * max(scale, 1.0)
    codes = [f.result() for f in [pool.submit(csr_symmetry_rows, A.indptr, A.indices, A.data, limit, lo, hi)
                                  for lo, hi in chunks]]
    return min(codes)  # DIFFERENT_PATTERN (-1) < DIFFERENT_VALUES (0) < SYMMETRIC (1)


def _row_chunks(A: Any, parts: int) -> list[tuple[int, int]]:
    """Row ranges of a CSR matrix holding about equal numbers of stored entries."""
    n, nnz = A.shape[0], A.nnz
    cuts = [0, *np.searchsorted(A.indptr, np.linspace(0, nnz, parts + 1)[1:-1]).tolist(), n]
    return [(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True) if hi > lo]


def positive_diagonal(A: Any) -> bool:
    """Whether every diagonal entry of a square matrix is positive (CG's half of ``method="auto"``).

    Large host CSR matrices (``SYMMETRY_PARALLEL_NNZ``, with four cores or
    more) are read by a Numba kernel in row ranges on helper threads: a
    1M-row matrix's ``A.diagonal()`` took about 9 ms of one thread on an
    H200 host, on the path before ``solve_many``'s first GPU batch. Other
    matrices use their own ``diagonal()`` (SciPy's is faster than the kernel
    on one thread).

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(4, 4), format="csr")
    >>> positive_diagonal(A), positive_diagonal(-A)
    (True, False)
    """
    if _backend.is_scipy_sparse(A) and A.format == "csr" and A.nnz >= SYMMETRY_PARALLEL_NNZ \
            and SYMMETRY_WORKERS >= 4:
        from .kernels.symmetry import csr_positive_diagonal

        pool = _backend.thread_pool("symmetry", SYMMETRY_WORKERS)
        return all(f.result() for f in [
            pool.submit(csr_positive_diagonal, A.indptr, A.indices, A.data, lo, hi)
            for lo, hi in _row_chunks(A, 2 * SYMMETRY_WORKERS)])
    return bool((A.diagonal() > 0).all())  # sync: once, choosing the method


class LinearSystem:
    """One linear system ``A x = b`` with its solver options, validated once.

    Parameters
    ----------
    A : sparse matrix, dense array, torch tensor or operator
        SciPy/cupyx sparse, torch sparse CSR/COO, dense NumPy/CuPy/torch, or an
        object with ``shape`` and ``matvec``. Square.
    b : array
        NumPy, CuPy or torch, shape ``(n,)``.
    x0 : array, optional
        Initial guess, shape ``(n,)``.
    rtol, atol : float
        Converged when ``||b - A x|| <= max(rtol * ||b||, atol)`` (SciPy's rule).
    maxiter : int, optional
        Iteration limit; default ``10 * n`` (at least 100).
    method : {"auto", "cg", "bicgstab", "gmres", "minres", "direct"}
    M : {"jacobi", "chebyshev", "neumann"} or operator, optional
        Preconditioner.
    name : str, optional
        Shown in results and errors.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> A = sp.diags([2.0, 3.0, 4.0]).tocsr()
    >>> s = LinearSystem(A, np.ones(3))
    >>> s.n, s.nnz, str(s.dtype)
    (3, 3, 'float64')
    """

    def __init__(self, A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
                 maxiter: int | None = None, method: str = "auto", M: Any = None,
                 name: str | None = None, dtype: Any = None, check_finite: bool = True,
                 _call: str | None = None, _finite_memo: dict | None = None):
        # _call: the public call to name in errors (solve() passes "solve(A, b)").
        # _finite_memo: arrays already found finite, by object, for a caller that
        # validates many systems sharing matrices within one call (solve_many).
        call = _call or (f"LinearSystem({name!r})" if name else "LinearSystem(A, b)")
        A, kind = as_operator(A, call=call)
        shape = tuple(int(s) for s in A.shape)
        if shape[0] != shape[1]:
            raise ValueError(
                f"{call}: A must be square, got shape {shape}. For a least-squares problem, "
                "solve the normal equations (A.T @ A) x = A.T @ b."
            )
        n = shape[0]
        if n == 0:
            raise ValueError(f"{call}: A is empty (shape {shape}); there is nothing to solve")
        a_dtype = check_dtype(getattr(A, "dtype", np.float64), call=call, arg="A")
        b = as_vector(b, n, call=call, arg="b")
        if x0 is not None:
            x0 = as_vector(x0, n, call=call, arg="x0")
        if not _nonnegative_finite(rtol):
            raise ValueError(f"{call}: rtol must be a finite number >= 0, got {rtol}")
        if not _nonnegative_finite(atol):
            raise ValueError(f"{call}: atol must be a finite number >= 0, got {atol}")
        if rtol == 0 and atol == 0:
            raise ValueError(f"{call}: rtol and atol are both 0, so no iterate can converge; set rtol=1e-8")
        if maxiter is not None and (int(maxiter) != maxiter or maxiter < 1):
            raise ValueError(f"{call}: maxiter must be a positive integer, got {maxiter!r}")
        if method not in METHODS:
            raise ValueError(f"{call}: method={method!r} is not known; choose one of {', '.join(METHODS)}")
        if isinstance(M, str) and M not in PRECONDITIONERS:
            raise ValueError(f"{call}: M={M!r} is not a known preconditioner; use one of "
                             f"{', '.join(PRECONDITIONERS)}, an operator, or None")
        if kind == "operator" and method == "direct":
            raise ValueError(f"{call}: method='direct' needs the matrix entries; A is an operator. "
                             "Use method='gmres' or pass A as a sparse matrix.")
        if kind == "operator" and M == "jacobi" and not hasattr(A, "diagonal"):
            raise ValueError(f"{call}: M='jacobi' needs A's diagonal; A is an operator without "
                             "diagonal(). Pass M as an operator instead.")

        dt = check_dtype(dtype, call=call, arg="dtype") if dtype is not None else result_dtype(a_dtype, b.dtype)
        if dt not in _FLOATS:
            raise TypeError(f"{call}: dtype={dt} is not supported; use float32 or float64")
        xp = _backend.array_module(b)
        # A CSR's data array, not the matrix: cupyx sparse matrices raise
        # NotImplementedError from `.device`, which the array test probes.
        a_xp = _backend.array_module(A.data if kind == "csr" else A) if kind != "operator" else xp
        if a_xp is not xp:
            raise ValueError(
                f"{call}: A is on {'a GPU' if a_xp is not np else 'the host'} but b is on "
                f"{'a GPU' if xp is not np else 'the host'}; put both on one device "
                "(LinearSystem(...).to(device) moves both)."
            )
        if kind == "csr":
            if A.dtype != dt:
                A = A.astype(dt)
            if check_finite and A.nnz and not _checked_finite(A.data, _finite_memo):
                raise ValueError(f"{call}: A has NaN or Inf entries; clean the matrix before solving")
        elif kind == "dense":
            A = A.astype(dt, copy=False)
            if check_finite and not _checked_finite(A, _finite_memo):
                raise ValueError(f"{call}: A has NaN or Inf entries; clean the matrix before solving")
        b = b.astype(dt, copy=False)
        if check_finite and not _checked_finite(b, _finite_memo):
            raise ValueError(f"{call}: b has NaN or Inf entries")
        if x0 is not None:
            x0 = xp.asarray(x0).astype(dt, copy=False)
            if check_finite and not _checked_finite(x0, _finite_memo):
                raise ValueError(f"{call}: x0 has NaN or Inf entries")

        self.A, self.kind, self.b, self.x0 = A, kind, b, x0
        self.rtol, self.atol = float(rtol), float(atol)
        self.maxiter = int(maxiter) if maxiter is not None else None
        self.method, self.M, self.name = method, M, name
        self.dtype = dt

    # ------------------------------------------------------------------ facts
    @property
    def n(self) -> int:
        return int(self.A.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    @property
    def nnz(self) -> int:
        if self.kind == "csr":
            return int(self.A.nnz)
        if self.kind == "dense":
            return self.n * self.n
        return 0

    @property
    def index_dtype(self) -> np.dtype:
        return np.dtype(self.A.indices.dtype) if self.kind == "csr" else np.dtype(np.int64)

    @property
    def nbytes(self) -> int:
        """Stored bytes of A, b and x0 (sparse A by its stored entries, never dense shape)."""
        if self.kind == "csr":
            a = self.A.data.nbytes + self.A.indices.nbytes + self.A.indptr.nbytes
        elif self.kind == "dense":
            a = self.A.nbytes
        else:
            a = 0
        return int(a + self.b.nbytes + (self.x0.nbytes if self.x0 is not None else 0))

    def workspace_bytes(self, method: str | None = None) -> int:
        """Extra bytes a Krylov solve needs: x plus the method's work vectors."""
        method = method or self.method
        vectors = {"cg": 4, "bicgstab": 7, "gmres": 30 + 3, "minres": 8, "direct": 0}.get(method, 7)
        extra = 1 if self.M is not None else 0
        if method == "direct":  # fill-in of a sparse LU: a rough bound of 20 x nnz
            return int(20 * self.nnz * (self.dtype.itemsize + 4))
        return int((vectors + extra) * self.n * self.dtype.itemsize)

    @property
    def device(self) -> str:
        """Where the arrays lie: ``"cpu"`` or ``"cuda:i"``."""
        if _backend.is_cupy_array(self.b):
            return f"cuda:{self.b.device.id}"
        return "cpu"

    @property
    def signature(self) -> tuple:
        """What predicts cost: (n, nnz, dtype, method, kind)."""
        return (self.n, self.nnz, str(self.dtype), self.method, self.kind)

    @property
    def is_symmetric_hint(self) -> bool | None:
        """Symmetry of a sparse A (:func:`is_symmetric`); None for a dense A or an operator.

        Not cached on the system: A is the caller's matrix (not a copy) and may
        be changed in place between two solves.
        """
        if self.kind != "csr":
            return None
        return is_symmetric(self.A)

    def to(self, device: Any) -> LinearSystem:
        """The same system with its arrays on ``device`` (``"cpu"``, ``"cuda:1"``, a Device)."""
        from .devices import parse_device_name

        kind, idx = parse_device_name(str(device), what="device")
        if kind in ("cpu", "sim"):
            if self.kind == "operator":
                A = self.A
            elif _backend.is_cupy_sparse(self.A):  # before to_host: see the note in __init__
                A = self.A.get()
            else:
                A = _backend.to_host(self.A)
            b, x0 = _backend.to_host(self.b), _backend.to_host(self.x0) if self.x0 is not None else None
        else:
            cp = _backend.cupy()
            with cp.cuda.Device(idx):
                if self.kind == "csr":
                    A = _backend.cupyx_sparse().csr_matrix(self.A) if not (
                        _backend.is_cupy_sparse(self.A) and self.A.data.device.id == idx) else self.A
                elif self.kind == "dense":
                    A = cp.asarray(self.A)
                else:
                    A = self.A
                b = cp.asarray(self.b)
                x0 = cp.asarray(self.x0) if self.x0 is not None else None
        out = object.__new__(LinearSystem)
        out.__dict__.update(self.__dict__)
        out.A, out.b, out.x0 = A, b, x0
        return out

    def __repr__(self) -> str:
        nm = f"{self.name!r}, " if self.name else ""
        return (f"LinearSystem({nm}n={self.n}, nnz={self.nnz}, dtype={self.dtype}, "
                f"method={self.method!r}, device={self.device!r})")
