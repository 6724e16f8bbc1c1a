"""What ``Solver.update`` takes as a matrix's new values, checked and converted before any change.

A sparse (CSR) solver takes its matrix's stored values in ``A.data``'s order
(a 1-D NumPy, CuPy or torch array) or a matrix of the same pattern (SciPy or
cupyx sparse, torch sparse CSR/COO, a ``(crow, col, values)`` tuple); a
dense solver takes a dense matrix of its shape (NumPy, CuPy, torch). All of
it is checked here (form, pattern, shape, dtype, finiteness), so that a
refused update changes nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _backend
from ..system.inputs import (
    GradSource,
    as_operator,
    check_dtype,
    checked_finite,
    grad_source,
    torch_to_array,
)
from .krylov import same_pattern

SPARSE_FORMS = ("A's stored values in A.data's order (a 1-D NumPy, CuPy or torch array) or a "
                "matrix of the same pattern (SciPy/cupyx sparse, torch sparse CSR/COO, a "
                "(crow, col, values) tuple)")


def new_matrix(system: Any, A: Any, *, call: str) -> Any:
    """The prepared matrix of ``system`` with the new values ``A`` (its kind, dtype and module).

    Raises
    ------
    ValueError
        ``A`` is not one of the accepted forms, has another pattern or shape,
        or holds NaN or Inf; the message names the forms and the fix.
    TypeError
        ``A`` is complex (or of another non-real dtype), as ``solve`` refuses it.
    """
    if system.kind == "operator":
        raise ValueError(f"{call}: an operator has no values to update; prepare a new Solver for "
                         "the new operator.")
    new = _dense(system, A, call) if system.kind == "dense" else _sparse(system, A, call)
    if not checked_finite(new.data if system.kind == "csr" else new, None):
        raise ValueError(f"{call}: the new values have NaN or Inf entries.")
    return new


def update_grad(system: Any, A: Any, *, call: str) -> GradSource | None:
    """The tensor of ``A`` that requires grad (1-D values: on the prepared pattern), else None."""
    if _backend.is_torch_tensor(A) and _strided(A) and A.ndim == 1:
        return grad_source((system.A.indptr, system.A.indices, A), None, call=call)
    return grad_source(A, None, call=call)


def _strided(t: Any) -> bool:
    return str(t.layout) == "torch.strided"


def _sparse(system: Any, A: Any, call: str) -> Any:
    def refuse(got: str) -> ValueError:
        return ValueError(f"{call}: A is {got}; this solver was prepared on a sparse matrix of "
                          f"{system.A.nnz} stored entries and takes {SPARSE_FORMS}. Prepare a new "
                          "Solver for a matrix of another pattern or a dense one.")

    if _backend.is_torch_tensor(A) and _strided(A):
        if A.ndim != 1:
            raise refuse(f"a dense torch tensor of shape {tuple(A.shape)}")
        values = torch_to_array(A, call=call, arg="A")
    elif isinstance(A, tuple) or _backend.is_torch_tensor(A) or _backend.is_scipy_sparse(A) \
            or _backend.is_cupy_sparse(A):
        if isinstance(A, tuple) and len(A) != 3:
            raise refuse(f"a tuple of {len(A)} items")
        values, _kind = as_operator(A, call=call)
    else:
        values = A if isinstance(A, np.ndarray) or _backend.is_cupy_array(A) else np.asarray(A)
        if values.ndim != 1:
            raise refuse(f"an array of shape {tuple(values.shape)}")
    check_dtype(values.dtype, call=call, arg="A")
    xp = _backend.array_module(system.A.data)
    sparse = hasattr(values, "indptr")
    if _backend.array_module(values.data if sparse else values) is not xp:
        if xp is np:
            values = _backend.to_host(values)
        elif sparse:
            values = _backend.sparse_module(xp).csr_matrix(values)
    return same_pattern(system.A, values, "csr", call="Solver.update", arg="A")


def _dense(system: Any, A: Any, call: str) -> Any:
    if isinstance(A, tuple) or _backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A) or \
            (_backend.is_torch_tensor(A) and not _strided(A)):
        raise ValueError(f"{call}: A is sparse; this solver was prepared on a dense matrix and "
                         f"takes a dense matrix of shape {system.A.shape} (NumPy, CuPy or torch). "
                         "Prepare a new Solver for a sparse matrix.")
    if _backend.is_torch_tensor(A):
        A = torch_to_array(A, call=call, arg="A")
    elif not (isinstance(A, np.ndarray) or _backend.is_cupy_array(A)):
        A = np.asarray(A)
    check_dtype(A.dtype, call=call, arg="A")
    if A.shape != system.A.shape:
        raise ValueError(f"{call}: expected a matrix of shape {system.A.shape}, got "
                         f"{tuple(A.shape)}; prepare a new Solver for a new shape.")
    return same_pattern(system.A, A, "dense", call="Solver.update", arg="A")
