"""LinearSystem: one validated ``A x = b`` with its solver options.

Validation happens once, here (see :mod:`managed_solve.system.inputs`), with
errors naming the argument, what was expected, what arrived and the fix.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _backend
from .cost import workspace_bytes
from .inputs import (
    FLOAT_DTYPES,
    as_operator,
    as_vector,
    check_dtype,
    first_nonfinite,
    grad_source,
    host_csr_pattern,
    host_nonfinite,
    pattern_error,
    result_dtype,
)
from .method import METHODS, PRECONDITIONERS, check_preconditioner, settle_auto
from .properties import is_symmetric

_F32, _F64 = FLOAT_DTYPES

A_NONFINITE = "A has NaN or Inf entries; clean the matrix before solving"
B_NONFINITE = "b has NaN or Inf entries"


def default_maxiter(n: int) -> int:
    """The iteration limit of a system given none (``maxiter=None``): SciPy's for CG-like methods.

    ``10 * n``, and at least 100. Every engine and the batched core read it
    here, so a system's limit is the same on every route.
    """
    return max(100, 10 * int(n))


def nonnegative_finite(v: Any) -> bool:
    """``v`` is a finite number >= 0 (Python numbers without a NumPy call)."""
    if type(v) is float or type(v) is int:
        return math.isfinite(v) and v >= 0
    return bool(np.isfinite(v) and v >= 0)


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
        Iteration limit; default ``10 * n``, at least 100 (:func:`default_maxiter`).
    method : {"auto", "cg", "bicgstab", "gmres", "minres", "direct"}
    M : {"auto", "jacobi", "neumann", "amg"}, operator or None
        Preconditioner, as :func:`managed_solve.solve` takes it.
    name : str, optional
        Shown in results and errors.
    nullspace : "constant", array of shape (n,) or (n, k), optional
        A basis of A's null space, for a singular symmetric A (a pure Neumann
        problem, the Laplacian of a closed surface: ``"constant"``). The
        solve projects b onto A's range and returns the x orthogonal to the
        null space; a b with a part outside the range gets the
        least-squares answer and the status ``LEAST_SQUARES`` saying so.
        Checked against A once, here: a vector that A does not annihilate to
        rounding (:func:`check_nullspace`) is a ValueError naming it.

    Attributes
    ----------
    grad : GradSource or None
        The torch tensors among A and b that require grad
        (:func:`managed_solve.system.inputs.grad_source`); ``solve`` and
        ``solve_many`` attach the solution to the autograd graph through them.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve import LinearSystem
    >>> A = sp.diags([2.0, 3.0, 4.0]).tocsr()
    >>> s = LinearSystem(A, np.ones(3))
    >>> s.n, s.nnz, str(s.dtype)
    (3, 3, 'float64')
    """

    grad = None  # copies made with object.__new__ that skip __init__ see None

    def __init__(self, A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
                 maxiter: int | None = None, method: str = "auto", M: Any = "auto",
                 name: str | None = None, dtype: Any = None, check_finite: bool = True,
                 nullspace: Any = None, _call: str | None = None,
                 _finite_memo: dict | None = None):
        # _call: the public call to name in errors (solve() passes "solve(A, b)").
        # _finite_memo: arrays already found finite (and matrices whose pattern was
        # found valid), by object, for a caller that validates many systems sharing
        # matrices within one call (solve_many).
        if x0 is None and dtype is None and nullspace is None and type(b) is np.ndarray \
                and self._host_csr(A, b, rtol, atol, maxiter, method, M, name, check_finite,
                                   _finite_memo, _call):
            return
        call = _call or (f"LinearSystem({name!r})" if name else "LinearSystem(A, b)")
        grad = grad_source(A, b, call=call)
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
        if not nonnegative_finite(rtol):
            raise ValueError(f"{call}: rtol must be a finite number >= 0, got {rtol}")
        if not nonnegative_finite(atol):
            raise ValueError(f"{call}: atol must be a finite number >= 0, got {atol}")
        if rtol == 0 and atol == 0:
            raise ValueError(f"{call}: rtol and atol are both 0, so no iterate can converge; set rtol=1e-8")
        if maxiter is not None and (int(maxiter) != maxiter or maxiter < 1):
            raise ValueError(f"{call}: maxiter must be a positive integer, got {maxiter!r}")
        if method not in METHODS:
            raise ValueError(f"{call}: method={method!r} is not known; choose one of {', '.join(METHODS)}")
        check_preconditioner(M, call)
        if kind == "operator" and method == "direct":
            raise ValueError(f"{call}: method='direct' needs the matrix entries; A is an operator. "
                             "Use method='gmres' or pass A as a sparse matrix.")
        if kind == "operator" and isinstance(M, str) and M == "jacobi" and not hasattr(A, "diagonal"):
            raise ValueError(f"{call}: M='jacobi' needs A's diagonal; A is an operator without "
                             "diagonal(). Pass M as an operator instead.")

        dt = check_dtype(dtype, call=call, arg="dtype") if dtype is not None else result_dtype(a_dtype, b.dtype)
        if dt not in FLOAT_DTYPES:
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
        checks = []  # (array, what is wrong when it holds a NaN or an Inf)
        if kind == "csr":
            if A.dtype != dt:
                A = A.astype(dt)
            if A.nnz:
                checks.append((A.data, A_NONFINITE))
        elif kind == "dense":
            A = A.astype(dt, copy=False)
            checks.append((A, A_NONFINITE))
        b = b.astype(dt, copy=False)
        checks.append((b, B_NONFINITE))
        if x0 is not None:
            x0 = xp.asarray(x0).astype(dt, copy=False)
            checks.append((x0, "x0 has NaN or Inf entries"))
        if check_finite:
            bad = first_nonfinite([a for a, _ in checks], _finite_memo)
            if bad is not None:
                raise ValueError(f"{call}: {checks[bad][1]}")

        self.A, self.kind, self.b, self.x0 = A, kind, b, x0
        self.grad = grad
        self.rtol, self.atol = float(rtol), float(atol)
        self.maxiter = int(maxiter) if maxiter is not None else None
        # "auto" resolves to no preconditioner at once for all but large CSR systems.
        M = settle_auto(M, kind, n, method)
        self.method, self.M, self.name = method, M, name
        # On b's GPU (A's too), not the current one: the check multiplies A by the basis.
        with b.device if xp is not np else contextlib.nullcontext():
            N = null_vectors(nullspace, n, call=call)  # read once: the basis and the check
            self.nullspace = None if N is None else nullspace_basis(N, dt, xp, call=call)
            if N is not None:
                check_nullspace(A, kind, nullspace, N, self.nullspace, call=call)
        self.dtype = dt

    def _host_csr(self, A: Any, b: np.ndarray, rtol: Any, atol: Any, maxiter: Any, method: Any,
                  M: Any, name: Any, check_finite: bool, memo: dict | None,
                  call: str | None, options_passed: bool = False) -> bool:
        """Set the fields for the commonest input, if it is one; False leaves it to ``__init__``.

        A SciPy CSR matrix (exactly that type) of float32 or float64 entries,
        a 1-D NumPy ``b`` of the same dtype, options that pass every check:
        the fields ``__init__`` would set, through a few attribute reads (with
        one matrix per system, ``solve_many`` validates hundreds of these).
        Anything else, any check that fails, returns False before a field is
        set, and ``__init__`` then raises its own error; a NaN or an Inf, or
        a pattern that is not a CSR pattern of A's shape
        (:func:`~managed_solve.system.inputs.host_csr_pattern`), raises
        ``__init__``'s error here (its other checks all passed), so the
        arrays are not read twice. ``memo`` also holds the matrices whose
        pattern was found valid (by object), so a matrix shared by many
        systems of a call is checked once.
        Nothing of such an input can require grad (no torch tensor, no
        ``matvec``), so its ``grad`` is None. ``options_passed``: the caller
        found the options pass (:func:`quick_options`) already.
        """
        if type(A) not in _backend.scipy_csr_types():
            return False
        dt, data = b.dtype, A.data
        # The dtypes by identity first (NumPy's float dtypes are singletons): hundreds of
        # systems a call pass here.
        if dt is _F64 or dt is _F32:
            dtype = dt
        elif dt in FLOAT_DTYPES:
            dtype = _F32 if dt == _F32 else _F64
        else:
            return False
        if b.ndim != 1 or type(data) is not np.ndarray or (data.dtype is not dt and data.dtype != dt):
            return False
        n, m = A.shape
        if n != m or n == 0 or b.shape[0] != n:
            return False
        if not options_passed and not quick_options(rtol, atol, maxiter, method, M):
            return False
        if memo is None or memo.get(id(A)) is not A:
            # SciPy's constructor reads no index: one out of range would be read out of
            # bounds by every kernel after this (solve_many: once per matrix of the call).
            code = host_csr_pattern(A)
            if code < 0:
                call = call or (f"LinearSystem({name!r})" if name else "LinearSystem(A, b)")
                raise pattern_error(code, call, A)
            if memo is not None:
                memo[id(A)] = A
        A.sum_duplicates()  # canonical form, in place, as as_operator leaves it
        if check_finite and not (memo is not None and memo.get(id(b)) is b
                                 and (memo.get(id(A.data)) is A.data or not A.indptr[-1])):
            # Not both found finite already (solve_many's pass finds most): read them.
            bad = host_nonfinite(A.data if A.indptr[-1] else None, b, memo)  # indptr[-1]: A.nnz
            if bad is not None:
                call = call or (f"LinearSystem({name!r})" if name else "LinearSystem(A, b)")
                raise ValueError(f"{call}: {B_NONFINITE if bad is b else A_NONFINITE}")
        self.A, self.kind, self.b, self.x0 = A, "csr", b, None
        self.grad = None
        self.rtol, self.atol = float(rtol), float(atol)
        self.maxiter = maxiter
        # Only "auto" needs settling; the commonest M, None, is kept without a call.
        self.method, self.M, self.name = \
            method, M if M is None else settle_auto(M, "csr", n, method), name
        self.nullspace = None
        self.dtype = dtype
        return True

    # ------------------------------------------------------------------ facts
    @property
    def n(self) -> int:
        return int(self.A.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.n)

    @property
    def iteration_limit(self) -> int:
        """``maxiter``, or :func:`default_maxiter` of ``n`` where none was given."""
        return default_maxiter(self.n) if self.maxiter is None else self.maxiter

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

    def workspace_bytes(self, method: str | None = None, M: Any = None) -> int:
        """Extra bytes a solve needs: x plus the method's work vectors (see :mod:`.cost`).

        ``M``: the preconditioner chosen for the solve (``self.M`` by default);
        ``"amg"`` counts its hierarchy.
        """
        M = self.M if M is None else M
        return workspace_bytes(method or self.method, self.n, self.nnz,
                               itemsize=self.dtype.itemsize, preconditioned=M is not None,
                               amg=isinstance(M, str) and M == "amg")

    @property
    def device(self) -> str:
        """Where the arrays lie: ``"cpu"`` or ``"cuda:i"``."""
        if type(self.b) is np.ndarray:  # the common case, without a type-name test
            return "cpu"
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

    def replaced(self, **fields: Any) -> LinearSystem:
        """The same validated system with ``fields`` (such as ``A`` or ``M``) replaced.

        Not validated again: the caller keeps A's shape, pattern and dtype
        (a rescaled matrix, new values of the same pattern, a resolved
        preconditioner).
        """
        unknown = sorted(set(fields) - set(self.__dict__))
        if unknown:
            raise TypeError(f"LinearSystem.replaced({unknown[0]}=...): not a field of a "
                            f"LinearSystem; expected one of {', '.join(sorted(self.__dict__))}.")
        out = object.__new__(LinearSystem)
        out.__dict__.update(self.__dict__)
        out.__dict__.update(fields)
        return out

    def to(self, device: Any) -> LinearSystem:
        """The same system with its arrays on ``device`` (``"cpu"``, ``"cuda:1"``, a Device)."""
        from ..device_args import cuda_ordinal

        idx = cuda_ordinal(device, what="device")
        if idx is None:  # the host: the CPU, or a simulated GPU
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
        if self.nullspace is not None:
            out.nullspace = _backend.to_host(self.nullspace) if idx is None \
                else _backend.cupy().asarray(self.nullspace)
        return out

    def __repr__(self) -> str:
        nm = f"{self.name!r}, " if self.name else ""
        return (f"LinearSystem({nm}n={self.n}, nnz={self.nnz}, dtype={self.dtype}, "
                f"method={self.method!r}, device={self.device!r})")


def quick_options(rtol: Any, atol: Any, maxiter: Any, method: Any, M: Any) -> bool:
    """Whether options pass every check of ``LinearSystem``'s, by plain comparisons (its quick path's test)."""
    if not (nonnegative_finite(rtol) and nonnegative_finite(atol)) or (rtol == 0 and atol == 0):
        return False
    if maxiter is not None and not (type(maxiter) is int and maxiter >= 1):
        return False
    return method in METHODS and (M is None or (type(M) is str and M in PRECONDITIONERS))


def host_csr_systems(items: Sequence[Any], *, rtol: Any, method: Any, M: Any,
                     memo: dict | None, label: str = "systems") -> list:
    """The constructor's quick path over many inputs that share their options, checked once here.

    Item ``i``, an ``(A, b)`` tuple of the quick path (a SciPy CSR ``A``, a
    NumPy ``b`` of its dtype), becomes ``LinearSystem(A, b, rtol=rtol,
    method=method, M=M, name=f"{label}[{i}]", _finite_memo=memo)``, or the
    error the constructor raises for it (a NaN or an Inf), returned as the
    exception object; None for every other item (the constructor then
    decides), and for every item where the options do not pass the quick
    path (:func:`quick_options`). ``solve_many`` validates hundreds of
    systems of one call's options.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> A = sp.identity(2, format="csr")
    >>> out = host_csr_systems([(A, np.ones(2)), (A, np.array([1.0, np.nan])), A, (A, [1.0, 1.0])],
    ...                        rtol=1e-6, method="auto", M="auto", memo=None)
    >>> out[0].name, out[0].rtol, type(out[1]).__name__, out[2], out[3]
    ('systems[0]', 1e-06, 'ValueError', None, None)
    """
    out: list = [None] * len(items)
    try:
        if not quick_options(rtol, 0.0, None, method, M):
            return out
    except (TypeError, ValueError):  # not numbers: the constructor's own checks name them
        return out
    new = object.__new__
    for i, item in enumerate(items):
        if type(item) is not tuple or len(item) != 2 or type(item[1]) is not np.ndarray:
            continue
        s = new(LinearSystem)
        try:
            if s._host_csr(item[0], item[1], rtol, 0.0, None, method, M, f"{label}[{i}]", True,
                           memo, None, options_passed=True):
                out[i] = s
        except (TypeError, ValueError) as exc:
            out[i] = exc
    return out


def null_vectors(nullspace: Any, n: int, *, call: str) -> np.ndarray | None:
    """``nullspace=`` as an (n, k) host float64 array, checked (None stays None)."""
    if nullspace is None:
        return None
    if isinstance(nullspace, str):
        if nullspace != "constant":
            raise ValueError(f"{call}: nullspace={nullspace!r} is not known; give 'constant' or "
                             "an array of null-space vectors of shape (n,) or (n, k).")
        N = np.ones((n, 1))
    else:
        N = np.asarray(_backend.to_host(nullspace), dtype=np.float64)
        if N.ndim == 1:
            N = N[:, None]
        if N.ndim != 2 or N.shape[0] != n or N.shape[1] < 1 or N.shape[1] >= n:
            raise ValueError(f"{call}: nullspace must have shape ({n},) or ({n}, k) with "
                             f"1 <= k < {n}, got shape {tuple(np.shape(nullspace))}.")
        if not np.all(np.isfinite(N)):
            raise ValueError(f"{call}: nullspace has NaN or Inf entries.")
    return N


def nullspace_basis(N: np.ndarray, dtype: Any, xp: Any, *, call: str) -> Any:
    """An orthonormal basis of the columns of ``N`` (:func:`null_vectors`) on b's device."""
    Q, R = np.linalg.qr(N)
    d = np.abs(np.diag(R))
    if d.min() <= 1e-10 * max(d.max(), 1e-300):
        raise ValueError(f"{call}: the nullspace vectors are linearly dependent (or zero); give "
                         "independent vectors.")
    return xp.asarray(Q.astype(dtype))


#: A null vector ``v`` of unit norm passes when ``||A v|| <= NULL_TOLERANCE * eps * ||A||_est``,
#: eps the system's dtype's. Rounding alone leaves ``A v`` at a few eps ``||A||`` for an
#: exact null vector: the product in the dtype (row lengths' worth of additions), entries
#: rounded to float32, a finite-element assembly whose row sums cancel (each entry a sum
#: of element terms of both signs); measured on mesh Laplacians, under 1 eps. 512 eps
#: (6.1e-5 in float32, 1.1e-13 in float64) leaves room for all of these, while a vector
#: that A does not annihilate lies far above: the constant of a Dirichlet grid Laplacian
#: gives about 1e-2 at a million unknowns. The closest call is a Laplacian with a single
#: Dirichlet vertex, about 0.28 / sqrt(n): float32 tells it from rounding up to some 2e7
#: unknowns, float64 always.
NULL_TOLERANCE = 512


def check_nullspace(A: Any, kind: str, given: Any, N: np.ndarray | None, Q: Any, *,
                    call: str) -> None:
    """Raise ValueError when a vector of ``nullspace=`` is not (to rounding) in A's null space.

    ``given``: the argument as the caller passed it, ``N`` its vectors
    (:func:`null_vectors`); ``Q``: their orthonormal basis
    (:func:`nullspace_basis`), on A's device in the system's dtype.
    ``given`` None: the null space was given with an earlier matrix that
    ``A`` replaces (``Solver.update``), ``Q`` its basis (``N`` unused),
    whose vectors are checked; the error then speaks of the new A and of
    a solver's fix. The first basis vector that fails names the given
    vector of its index: each is the part of that vector orthogonal to the
    ones before it.
    Each given vector ``v``, scaled to unit norm, needs ``||A v|| <=
    NULL_TOLERANCE * eps * ||A||_est`` with ``||A||_est`` the larger of A's
    largest absolute row sum and column sum (a bound on ``||A||_2``, and on
    the rounding of ``A v`` for a non-symmetric A too). One product ``A V``
    on A's device and one read of the k ratios and the estimate. An
    operator has no entries to estimate ``||A||`` from: its ``nullspace=``
    is taken as given.
    """
    if kind == "operator":
        return
    k = int(Q.shape[1])
    if k == 1 or given is None:  # one vector: Q is it, scaled to unit norm
        V = Q
    else:
        V = _backend.array_module(Q).asarray((N / np.linalg.norm(N, axis=0)).astype(Q.dtype))
    ratios, est = _null_ratios(A, kind, V)
    if not (np.all(ratios <= NULL_TOLERANCE) and (est == 0.0 or 2.0 ** -60 < est < 2.0 ** 60)):
        # A vector that fails, or an A whose products may have overflowed or underflowed
        # (in float32): measured again on A scaled by a power of two to ||A||_est near 1
        # (exact), the verdict.
        ratios, _ = _null_ratios(A, kind, V, rescale=True)
    bad = np.flatnonzero(~(ratios <= NULL_TOLERANCE))
    if bad.size == 0:
        return
    j = int(bad[0])
    eps = float(np.finfo(Q.dtype).eps)
    which = "nullspace='constant'" if isinstance(given, str) else \
        ("nullspace" if k == 1 else f"nullspace[:, {j}]")
    fix = ("For a nonsingular A drop nullspace=; else pass the vectors A actually annihilates "
           "(pde.laplacian_nullspace(mesh) for a mesh Laplacian: one constant per connected "
           "component without Dirichlet vertices).") if given is not None else \
        ("The solver keeps its previous matrix. Pass values that annihilate the null space given "
         "at construction, or make a new Solver(A, nullspace=...) with the new A's null space "
         "(no nullspace= for a nonsingular A).")
    raise ValueError(
        f"{call}: nullspace= is not {'A' if given is not None else 'the new A'}'s null space: "
        f"{which} gives ||A v|| / (||A|| ||v||) = {ratios[j] * eps:.3g}, above the "
        f"{NULL_TOLERANCE * eps:.3g} that rounding explains "
        f"({NULL_TOLERANCE} eps of {Q.dtype}; ||A|| the largest absolute row or column sum). "
        + fix)


def _null_ratios(A: Any, kind: str, V: Any, rescale: bool = False) -> tuple[np.ndarray, float]:
    """``||A v_j|| / (eps ||A||_est)`` for the unit columns ``v_j`` of V, and ``||A||_est``.

    Host float64, from one read. A zero A annihilates everything (ratio 0);
    an estimate that overflowed gives NaN ratios. ``rescale``: A is scaled by a
    power of two first, which the ratios do not depend on but the range of
    the float32 products does.
    """
    xp = _backend.array_module(V)
    k = int(V.shape[1])
    if rescale:
        values = A.data if kind == "csr" else A
        amax = float(xp.abs(values).max()) if values.size else 0.0  # sync: the rare second pass
        if amax == 0.0:
            return np.zeros(k), 0.0
        e = -math.frexp(amax)[1]
        # In two factors: 2**e alone leaves float32's range for subnormal entries.
        A = (A * values.dtype.type(2.0 ** (e // 2))) * values.dtype.type(2.0 ** (e - e // 2))
    absA = abs(A)
    with np.errstate(over="ignore", invalid="ignore"):  # float32 overflow: the second pass's case
        if kind == "csr":
            n = int(A.shape[0])
            rows = absA @ xp.ones(n, dtype=absA.dtype)
            cols = xp.bincount(absA.indices, weights=absA.data, minlength=n)
        else:
            rows, cols = absA.sum(axis=1), absA.sum(axis=0)
        est = xp.maximum(rows.max().astype(np.float64), cols.max().astype(np.float64))
        norms = xp.linalg.norm(A @ V, axis=0).astype(np.float64)
    got = _backend.to_host(xp.concatenate([norms, est.reshape(1)]))  # sync: one for every vector
    est = float(got[-1])
    if est == 0.0:
        return np.zeros(k), 0.0
    eps = float(np.finfo(V.dtype).eps)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return (got[:-1] / (eps * est) if est < math.inf else np.full(k, math.nan)), est
