"""Input conversion and validation: what arrives (SciPy, CuPy, torch, operators) becomes arrays.

Inputs are taken where they lie: SciPy sparse stays on the host, cupyx sparse
and CuPy arrays stay on their GPU, torch tensors come through DLPack without
copies (CPU tensors as NumPy views, CUDA tensors as CuPy views). Errors name
the argument, what was expected, what arrived and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _backend
from ..devices import warn_mps
from ..kernels.compressed import BAD_INDEX, BAD_POINTERS, CANONICAL, compressed_pattern

#: The dtypes a solve runs in.
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


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


#: The torch dtypes NumPy and CuPy have a counterpart for (by torch's name).
_NUMPY_DTYPES = frozenset({"float16", "float32", "float64", "complex64", "complex128", "bool",
                           "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                           "uint64"})


def check_torch_dtype(t: Any, *, call: str, arg: str) -> None:
    """Refuse a torch dtype NumPy and CuPy have no counterpart for (bfloat16, float8, complex32, ...).

    Neither DLPack nor ``Tensor.numpy()`` can hand such a tensor over, and
    torch's own error names no argument.
    """
    name = str(t.dtype).removeprefix("torch.")
    if name not in _NUMPY_DTYPES:  # what NumPy has a type for; torch adds new ones often
        raise TypeError(f"{call}: {arg} is a torch tensor of dtype {t.dtype}, which NumPy and CuPy "
                        f"cannot represent; convert it first, e.g. {arg}.to(torch.float32) "
                        "(or torch.float64 for full precision).")


def torch_to_array(t: Any, *, call: str, arg: str) -> Any:
    """A torch tensor as a NumPy (CPU) or CuPy (CUDA) view, through DLPack.

    An ``mps`` tensor is copied to the CPU (one warning per process); a
    ``meta`` tensor is refused.

    The arrays are detached from autograd; the tensors that require grad are
    recorded beforehand by :func:`grad_source`, and the layer that solves
    attaches the solution to the graph (:mod:`managed_solve.autograd`).
    """
    check_torch_dtype(t, call=call, arg=arg)
    if t.requires_grad:
        t = t.detach()
    if t.device.type == "cpu":
        return t.resolve_conj().numpy()
    if t.device.type == "cuda":
        cp = _backend.cupy()
        return cp.from_dlpack(t)
    if t.device.type == "mps":  # no Metal backend: the CPU, which shares a Mac's memory
        warn_mps(f"{call}: {arg}")
        return t.cpu().resolve_conj().numpy()
    if t.device.type == "meta":
        raise TypeError(f"{call}: {arg} is a tensor on the meta device: it has a shape but no "
                        "values, so it can be sized and planned (DeviceManager.size_of) but not "
                        "solved. Build it on 'cpu' or 'cuda'.")
    raise TypeError(f"{call}: {arg} is a torch tensor on {t.device}; expected a CPU or CUDA tensor")


def _torch_sparse(t: Any, *, call: str) -> Any:
    layout = str(t.layout)
    if layout == "torch.sparse_coo":
        t = t.coalesce().to_sparse_csr()
    elif layout != "torch.sparse_csr":
        raise TypeError(f"{call}: A is a torch tensor with layout {layout}; expected dense, sparse_coo or sparse_csr")
    shape = tuple(t.shape)
    crow = torch_to_array(t.crow_indices(), call=call, arg="A.crow_indices()")
    col = torch_to_array(t.col_indices(), call=call, arg="A.col_indices()")
    val = torch_to_array(t.values(), call=call, arg="A.values()")
    xp = _backend.array_module(val)
    if xp is not np:
        if shape[0] == shape[1]:
            return _checked_gpu_csr(val, col, crow, shape[0], call=call)
        return _backend.sparse_module(xp).csr_matrix((val, col, crow), shape=shape)
    return _checked_host_csr(val, col, crow, shape, call=call)


def _csr_triple(A: Any, *, call: str) -> Any:
    """``(crow, col, values)`` (NumPy, CuPy or torch) as a CSR matrix of n = len(crow) - 1 rows."""
    crow, col, val = (torch_to_array(v, call=call, arg=f"A[{i}]") if _backend.is_torch_tensor(v)
                      else v for i, v in enumerate(A))
    xp = _backend.array_module(val) if not isinstance(val, (list, tuple)) else np
    crow, col, val = xp.asarray(crow), xp.asarray(col), xp.asarray(val)
    if crow.ndim != 1 or col.ndim != 1 or val.ndim != 1 or col.shape != val.shape or crow.size < 2:
        raise ValueError(f"{call}: A as (crow, col, values) needs three 1-D arrays with "
                         f"len(col) == len(values) and len(crow) = n + 1 >= 2; got shapes "
                         f"{tuple(crow.shape)}, {tuple(col.shape)}, {tuple(val.shape)}")
    n = int(crow.shape[0]) - 1
    if xp is not np:
        return _checked_gpu_csr(val, col, crow, n, call=call)
    return _checked_host_csr(val, col, crow, (n, n), call=call)


def _checked_gpu_csr(val: Any, col: Any, crow: Any, n: int, *, call: str) -> Any:
    """A cupyx CSR matrix over GPU arrays, its pattern checked in one pass (one host read).

    The pattern is checked in the wider of the two index widths, then kept
    in 32 bits where its size allows (torch's int64 indices, as CuPy keeps
    them); a pattern that is not canonical is sorted and its duplicates
    summed, as SciPy's ``sum_duplicates`` does.
    """
    from . import device_checks

    if col.dtype.kind not in "iu" or crow.dtype.kind not in "iu":
        raise TypeError(f"{call}: A's index arrays must be integers, got {crow.dtype} and {col.dtype}")
    wide = np.dtype(np.int64) if max(col.dtype.itemsize, crow.dtype.itemsize) > 4 \
        else np.dtype(np.int32)
    crow, col = crow.astype(wide, copy=False), col.astype(wide, copy=False)
    flags = _gpu_pattern_flags(crow, col, n, call=call)
    if wide.itemsize > 4 and max(n, int(col.shape[0])) < np.iinfo(np.int32).max:
        # Checked to lie in [0, n] and [0, nnz]: 32 bits hold them, as CuPy keeps them.
        crow, col = crow.astype(np.int32), col.astype(np.int32)
    A = device_checks.csr_from_parts(val, col, crow, n,
                                     canonical=not flags & device_checks.FLAG_NOT_CANONICAL)
    if flags & device_checks.FLAG_NOT_CANONICAL:
        A.sum_duplicates()
    return A


def _gpu_pattern_flags(indptr: Any, indices: Any, n: int, *, call: str,
                       what: str = "column") -> int:
    """:func:`device_checks.csr_structure`'s flags; raises on a pattern that is not CSR.

    ``what``: the indices' axis, named in the error (a CSC pattern's are rows).
    """
    from . import device_checks

    flags = device_checks.csr_structure(indptr, indices, n)
    if flags & device_checks.FLAG_BAD_INDPTR:
        raise _bad_indptr(call, int(indices.shape[0]))
    if flags & device_checks.FLAG_BAD_INDEX:
        raise _bad_index(call, n, what, "indices" if what != "column" else "col_indices / indices")
    return flags


def _bad_indptr(call: str, nnz: int) -> ValueError:
    return ValueError(f"{call}: A's row pointers (crow_indices / indptr) are not a CSR index: "
                      f"they must start at 0, never decrease and end at the number of stored "
                      f"entries ({nnz}); rebuild A from valid arrays")


def _bad_index(call: str, n: int, what: str = "column",
               fix: str = "col_indices / indices") -> ValueError:
    return ValueError(f"{call}: A has {what} indices outside [0, {n}); fix the matrix's {fix}")


#: :func:`host_csr_pattern`'s codes beyond the kernel's: index arrays that are
#: not integers, and ``data`` of another length than ``indices``.
BAD_DTYPE, BAD_DATA = -3, -4


def host_csr_pattern(A: Any) -> int:
    """Check a SciPy CSR matrix's pattern; the code of :mod:`managed_solve.kernels.compressed`.

    Negative codes are errors (:func:`pattern_error` builds them). Where
    SciPy does not know yet whether A is canonical, the same pass finds it,
    and a canonical A is marked so (SciPy's ``has_canonical_format``): A's
    ``sum_duplicates`` after this then makes no pass of its own. One that is
    not is left unmarked: ``sum_duplicates`` sorts it, and its own test costs
    little beside that. A flag SciPy already holds is kept but does not
    stand for this check: SciPy's canonical test reads no bounds.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> bad = sp.csr_matrix((np.ones(2), np.array([0, 3]), np.array([0, 1, 2])), shape=(2, 2))
    >>> good = sp.csr_matrix((np.ones(2), np.array([1, 0]), np.array([0, 1, 2])), shape=(2, 2))
    >>> host_csr_pattern(bad) < 0, host_csr_pattern(good), good.has_canonical_format
    (True, 1, True)
    """
    indptr, indices = A.indptr, A.indices
    if indices.dtype.kind not in "iu" or indptr.dtype.kind not in "iu":
        return BAD_DTYPE
    if indices.shape[0] != A.data.shape[0]:
        return BAD_DATA
    rows, cols = A.shape
    if indptr.shape[0] != rows + 1:
        return BAD_POINTERS
    known = getattr(A, "_has_canonical_format", None)
    code = int(compressed_pattern(indptr, indices, cols, known is None))
    if code == CANONICAL and known is None:
        A.has_canonical_format = True
    return code


def pattern_error(code: int, call: str, A: Any) -> Exception:
    """The error of a negative :func:`host_csr_pattern` code for CSR matrix ``A`` (naming ``call``)."""
    if code == BAD_DTYPE:
        return TypeError(f"{call}: A's index arrays must be integers, got {A.indptr.dtype} and "
                         f"{A.indices.dtype}")
    if code == BAD_DATA:
        return ValueError(f"{call}: A.data holds {A.data.shape[0]} entries but A.indices "
                          f"{A.indices.shape[0]}; rebuild A from arrays of one length")
    if code == BAD_INDEX:
        return _bad_index(call, A.shape[1])
    return _bad_indptr(call, int(A.indices.shape[0]))


def _checked_host_csr(val: np.ndarray, col: np.ndarray, crow: np.ndarray, shape: tuple[int, int],
                      *, call: str) -> Any:
    """A SciPy CSR matrix over host arrays whose pattern was checked first.

    SciPy's constructor checks only the arrays' lengths, and torch builds
    CSR tensors without checking their indices: an index outside the
    matrix would be read out of bounds by every kernel after this.
    """
    if col.dtype.kind not in "iu" or crow.dtype.kind not in "iu":
        raise TypeError(f"{call}: A's index arrays must be integers, got {crow.dtype} and {col.dtype}")
    nnz = int(col.shape[0])
    code = BAD_POINTERS if crow.shape[0] != shape[0] + 1 else \
        int(compressed_pattern(crow, col, shape[1], True))
    if code == BAD_POINTERS:
        raise _bad_indptr(call, nnz)
    if code == BAD_INDEX:
        raise _bad_index(call, shape[1])
    A = _backend.sparse_module(np).csr_matrix((val, col, crow), shape=shape)
    if code == CANONICAL:  # found by the same pass: sum_duplicates makes none of its own
        A.has_canonical_format = True
    return A


def _checked_compressed(A: Any, major: int, bound: int, *, call: str, what: str) -> None:
    """Check a SciPy CSC or BSR matrix's pattern before its conversion to CSR scatters by it."""
    if A.indices.dtype.kind not in "iu" or A.indptr.dtype.kind not in "iu":
        raise TypeError(f"{call}: A's index arrays must be integers, got {A.indptr.dtype} and "
                        f"{A.indices.dtype}")
    nnz = int(A.indices.shape[0])
    if A.data.shape[0] != nnz:
        raise ValueError(f"{call}: A.data holds {A.data.shape[0]} entries but A.indices {nnz}; "
                         "rebuild A from arrays of one length")
    code = BAD_POINTERS if A.indptr.shape[0] != major + 1 else \
        int(compressed_pattern(A.indptr, A.indices, bound, False))
    if code == BAD_POINTERS:
        raise ValueError(f"{call}: A's {A.format.upper()} index pointers (indptr) must start at "
                         f"0, never decrease and end at the number of stored entries ({nnz}); "
                         "rebuild A from valid arrays")
    if code == BAD_INDEX:
        raise _bad_index(call, bound, what, "indices")


def _checked_coo(A: Any, *, call: str) -> None:
    """Check a SciPy COO matrix's coordinates (checked at its construction, not after a change)."""
    row, col = A.row, A.col
    if row.shape != col.shape or row.shape[0] != A.data.shape[0]:
        raise ValueError(f"{call}: A.row, A.col and A.data hold {row.shape[0]}, {col.shape[0]} "
                         f"and {A.data.shape[0]} entries; rebuild A from arrays of one length")
    for what, idx, bound in (("row", row, A.shape[0]), ("column", col, A.shape[1])):
        if idx.dtype.kind not in "iu":
            raise TypeError(f"{call}: A's {what} indices must be integers, got {idx.dtype}")
        if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= bound):
            raise _bad_index(call, bound, what, "coordinates (row, col)")


def _scipy_csr(A: Any, *, call: str) -> Any:
    """A SciPy sparse matrix as a CSR matrix whose pattern was checked.

    SciPy checks indices only where a matrix is built from coordinates; the
    compressed formats' constructors and every later change of their arrays
    go unchecked, and a conversion to CSR scatters entries by those indices
    (an out-of-range one writes out of bounds). So the compressed and COO
    forms are checked before their conversion, and the CSR matrix after it
    (the CSR form in the same pass finds whether it is canonical).
    """
    fmt = A.format
    if fmt == "csc":
        _checked_compressed(A, A.shape[1], A.shape[0], call=call, what="row")
    elif fmt == "bsr":
        rows, cols = A.blocksize
        _checked_compressed(A, A.shape[0] // rows, A.shape[1] // cols, call=call,
                            what="block column")
    elif fmt == "coo":
        _checked_coo(A, call=call)
    A = A.tocsr()
    code = host_csr_pattern(A)
    if code < 0:
        raise pattern_error(code, call, A)
    return A


def _cupy_csr(A: Any, *, call: str) -> Any:
    """A cupyx sparse matrix as a CSR matrix whose pattern was checked on its GPU (a square one).

    One pass checks the pattern and finds whether it is canonical, where
    CuPy's own test would read back one property at a time; a flag CuPy
    already holds does not stand for it (its canonical test reads no
    bounds). A CSC matrix is checked before its conversion, which scatters
    entries by its row indices. A matrix that is not square is refused by
    the caller.
    """
    from .device_checks import FLAG_NOT_CANONICAL

    square = A.shape[0] == A.shape[1]
    if square and A.format == "csc":
        _gpu_pattern_flags(A.indptr, A.indices, A.shape[0], call=call, what="row")
    A = A.tocsr()
    if square:
        flags = _gpu_pattern_flags(A.indptr, A.indices, A.shape[0], call=call)
        A.has_canonical_format = not flags & FLAG_NOT_CANONICAL
    return A


def as_operator(A: Any, *, call: str = "solve") -> tuple[Any, str]:
    """Normalise A: (matrix, kind) with kind in {"csr", "dense", "operator"}.

    A tuple ``(crow, col, values)`` is a square CSR matrix (the form whose
    ``values`` a torch model often produces).
    """
    if A is None:
        raise TypeError(f"{call}: A is None; expected a sparse matrix, a dense array or an operator")
    if isinstance(A, tuple) and len(A) == 3:
        A = _csr_triple(A, call=call)
        if _backend.is_scipy_sparse(A):  # its pattern checked, and whether canonical, already
            A.sum_duplicates()
            return A, "csr"
    if _backend.is_torch_tensor(A):
        if A.layout != __import__("torch").strided:
            return _torch_sparse(A, call=call), "csr"
        A = torch_to_array(A, call=call, arg="A")
    if _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A):
        if A.ndim != 2:
            raise ValueError(f"{call}: A must be 2-D, got {A.ndim}-D")
        A = _scipy_csr(A, call=call) if _backend.is_scipy_sparse(A) else _cupy_csr(A, call=call)
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
        "matrix, a torch sparse CSR/COO tensor, a (crow, col, values) tuple, a dense "
        "NumPy/CuPy/torch array, or an object with `shape` and `matvec`."
    )


@dataclass(frozen=True)
class GradSource:
    """The torch tensors of one system that require grad, as the caller gave them.

    Conversion to arrays detaches (:func:`as_operator`, :func:`as_vector`);
    this record is what lets the layer that solves attach the solution to
    the autograd graph (:mod:`managed_solve.autograd`).

    Attributes
    ----------
    A : torch.Tensor or None
        The tensor that receives A's gradient: a sparse CSR or COO tensor, the
        ``values`` of a ``(crow, col, values)`` tuple, or a dense matrix.
    form : {"csr", "coo", "values", "dense", ""}
        How ``A`` holds A's entries ("" when A needs no gradient).
    pattern : tuple of torch.Tensor or None
        ``(crow, col)`` of the "values" form, in the order of ``values``.
    b : torch.Tensor or None
        The right-hand side, when it requires grad.
    """

    A: Any = None
    form: str = ""
    pattern: Any = None
    b: Any = None


def _requires_grad(t: Any) -> bool:
    return _backend.is_torch_tensor(t) and t.requires_grad


def grad_source(A: Any, b: Any, *, call: str) -> GradSource | None:
    """What of ``A`` and ``b`` requires grad (None: nothing, or torch's grad mode is off).

    Raises
    ------
    TypeError
        A gradient is asked for where none can be given: an operator whose
        values require grad, or a torch sparse layout other than CSR and COO.
    """
    torch = __import__("sys").modules.get("torch")
    if torch is None or not torch.is_grad_enabled():
        return None
    source = {}
    if _requires_grad(A):
        layout = {torch.sparse_csr: "csr", torch.sparse_coo: "coo", torch.strided: "dense"}
        form = layout.get(A.layout)
        if form is None:
            raise TypeError(f"{call}: A is a torch tensor with layout {A.layout} that requires "
                            "grad; gradients are given for sparse CSR, sparse COO and dense A.")
        source.update(A=A, form=form)
    elif isinstance(A, tuple) and len(A) == 3 and _requires_grad(A[2]):
        source.update(A=A[2], form="values", pattern=(A[0], A[1]))
    elif hasattr(A, "matvec") or isinstance(A, torch.nn.Module):  # an operator
        held = getattr(A, "__dict__", {}).values()
        params = A.parameters() if isinstance(A, torch.nn.Module) else ()
        if any(_requires_grad(v) for v in held) or any(p.requires_grad for p in params):
            raise TypeError(
                f"{call}: A is an operator ({type(A).__name__}) holding torch tensors that require "
                "grad; a gradient cannot be given through an operator's values. Pass A as a torch "
                "sparse CSR/COO tensor, a (crow, col, values) tuple or a dense tensor, or detach "
                "its tensors.")
    if _requires_grad(b):
        source["b"] = b
    return GradSource(**source) if source else None


def as_vector(v: Any, n: int, *, call: str, arg: str, xp: Any = None) -> Any:
    """A 1-D array of length n, on the device v lies on."""
    if _backend.is_torch_tensor(v):
        v = torch_to_array(v, call=call, arg=arg)
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
            f"{tuple(v.shape)}. For several right-hand sides with one A, pass them as the "
            f"columns of a ({n}, k) array to solve() or a Solver; for systems with their own "
            "A, use solve_many."
        )
    check_dtype(v.dtype, call=call, arg=arg)
    return v


def all_finite(a: Any) -> bool:
    """Whether every entry of a float array is finite (no NaN, no Inf), on its device.

    Fast path: one reduction, ``a.sum()`` (reads ``a`` once, allocates
    nothing). A NaN or an Inf anywhere makes the sum non-finite, so a finite
    sum proves every entry finite; a non-finite sum may also be an overflow of
    huge finite entries, so only then the exact elementwise test decides.
    NumPy's sum runs on the calling thread; a BLAS dot would be as fast on
    one core but may wake the BLAS thread pool for long vectors, which on a
    many-core host costs more than the check itself.
    """
    if a.size == 0:
        return True
    with np.errstate(over="ignore", invalid="ignore"):  # huge entries are decided below
        fast = a.sum()
    if math.isfinite(float(fast)):  # sync: one host read at validation
        return True
    xp = _backend.array_module(a)
    return bool(xp.isfinite(a).all())  # sync: as above, only after an overflow, NaN or Inf


def checked_finite(a: Any, memo: dict | None) -> bool:
    """:func:`all_finite`, remembering arrays found finite in ``memo`` (by object)."""
    if memo is not None:
        hit = memo.get(id(a))
        if hit is not None and hit is a:
            return True
    ok = all_finite(a)
    if ok and memo is not None:
        memo[id(a)] = a
    return ok


def host_nonfinite(data: np.ndarray | None, b: np.ndarray, memo: dict | None) -> np.ndarray | None:
    """The first of a host CSR system's arrays holding a NaN or an Inf (None: both finite).

    ``data`` (A's stored entries; None when it stores none), then ``b``, each
    by :func:`checked_finite`. ``solve_many`` checks its inputs' arrays in one
    pass first, so both are usually found in ``memo``.
    """
    if data is not None and not checked_finite(data, memo):
        return data
    return None if checked_finite(b, memo) else b


def first_nonfinite(arrays: list, memo: dict | None) -> int | None:
    """The index of the first array holding a NaN or an Inf (None: all finite).

    Host arrays are read one by one (:func:`checked_finite`); arrays on a GPU
    are checked together with one host read
    (:func:`managed_solve.system.device_checks.nonfinite`). Arrays found
    finite go into ``memo`` (by object), as :func:`checked_finite` keeps them.
    """
    on_gpu = [k for k, a in enumerate(arrays) if _backend.is_cupy_array(a) and a.ndim == 1
              and not (memo is not None and memo.get(id(a)) is a)]
    bad_gpu: set[int] = set()
    if len(on_gpu) > 1:
        from .device_checks import nonfinite

        found = nonfinite([arrays[k] for k in on_gpu])
        bad_gpu = {k for k, bad in zip(on_gpu, found, strict=True) if bad}
        if memo is not None:
            for k in on_gpu:
                if k not in bad_gpu:
                    memo[id(arrays[k])] = arrays[k]
    else:
        on_gpu = []
    for k, a in enumerate(arrays):
        if k in bad_gpu:
            return k
        if k not in on_gpu and not checked_finite(a, memo):
            return k
    return None
