"""DLPack handoff between NumPy/SciPy/CuPy arrays and torch tensors, without copies.

Dense arrays and CSR matrices go both ways sharing memory (same data
pointers, same device). On CUDA the handoff is ordered after the producer's
queued work: torch's current stream waits for the stream that produced the
array (an event wait on the GPU, no host synchronisation), so a solution
computed on a CuPy stream can be used by torch at once.

With ``tensor.py`` and ``module.py``, the only modules importing torch.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from . import _backend

log = logging.getLogger("managed_solve")

__all__ = ["as_torch", "from_torch"]


def _torch_stream_wait(torch: Any, cp: Any, device_index: int, stream: Any) -> None:
    """Make torch's current stream on ``device_index`` wait for CuPy's ``stream``.

    ``torch.from_dlpack`` passes torch's stream to ``__dlpack__``, and CuPy
    then orders it after CuPy's *current* stream only; a solver that worked on
    another stream must name it, which is what this wait is for.
    """
    if stream is None:
        stream = cp.cuda.get_current_stream()
    consumer = torch.cuda.current_stream(device_index)
    if int(stream.ptr) == int(consumer.cuda_stream):
        return
    producer = torch.cuda.ExternalStream(int(stream.ptr), device=device_index)
    consumer.wait_stream(producer)  # GPU-side event wait, no host synchronisation


def as_torch(array: Any, *, stream: Any = None):
    """A torch tensor sharing memory with a NumPy/CuPy array or a SciPy/cupyx CSR matrix.

    Parameters
    ----------
    array : numpy.ndarray, cupy.ndarray, scipy.sparse CSR, cupyx.scipy.sparse CSR, or torch.Tensor
        Torch tensors are returned unchanged.
    stream : cupy.cuda.Stream, optional
        The CUDA stream that produced ``array`` (default: CuPy's current
        stream). Torch's current stream waits for it on the GPU before the
        tensor is used.

    Returns
    -------
    torch.Tensor
        Same device, same data pointer (dense; a read-only NumPy array is
        copied, as torch has no read-only tensors); for CSR a ``torch.sparse_csr``
        tensor whose ``crow_indices``, ``col_indices`` and ``values`` share the
        matrix's ``indptr``, ``indices`` and ``data``.

    Raises
    ------
    TypeError
        Not an array, a CSR matrix or a tensor; a CSR matrix whose ``indptr``
        and ``indices`` dtypes differ (torch needs one index dtype).

    Examples
    --------
    >>> import numpy as np
    >>> from managed_solve.dlpack import as_torch
    >>> a = np.arange(3.0)
    >>> t = as_torch(a)
    >>> t.data_ptr() == a.ctypes.data
    True
    >>> import scipy.sparse as sp
    >>> A = sp.eye(3, format="csr")
    >>> T = as_torch(A)
    >>> T.layout, T.values().data_ptr() == A.data.ctypes.data
    (torch.sparse_csr, True)
    """
    torch = _backend.torch_module()
    if _backend.is_torch_tensor(array):
        return array
    if _backend.is_cupy_sparse(array) or _backend.is_scipy_sparse(array):
        return _csr_as_torch(torch, array, stream)
    if _backend.is_cupy_array(array):
        cp = _backend.cupy()
        _torch_stream_wait(torch, cp, int(array.device.id), stream)
        return torch.from_dlpack(array)
    if isinstance(array, np.ndarray):
        if not array.flags.writeable:
            # torch has no read-only tensors: a tensor over this memory would let any
            # in-place operation write into it (an immutable bytes object, a Mesh's
            # vertices behind its cached facts). A copy keeps the array as it is.
            return torch.from_numpy(array.copy())
        return torch.from_numpy(array)
    raise TypeError(
        f"as_torch(array=...): expected a NumPy or CuPy array, a SciPy or cupyx CSR matrix, or a "
        f"torch tensor, got {type(array).__name__}. Convert it with numpy.asarray first."
    )


def _csr_as_torch(torch: Any, A: Any, stream: Any):
    if A.format != "csr":
        raise TypeError(
            f"as_torch(array=...): expected a CSR sparse matrix, got format {A.format!r}. "
            "Convert with A.tocsr() (this copies once)."
        )
    if A.indptr.dtype != A.indices.dtype:
        raise TypeError(
            f"as_torch(array=...): torch sparse CSR needs one index dtype, got indptr "
            f"{A.indptr.dtype} and indices {A.indices.dtype}. Cast both to int32 or int64."
        )
    crow = as_torch(A.indptr, stream=stream)
    col = as_torch(A.indices, stream=stream)
    val = as_torch(A.data, stream=stream)
    return torch.sparse_csr_tensor(crow, col, val, size=tuple(A.shape), check_invariants=False)


def _note_detach(tensor: Any, call: str) -> Any:
    if tensor.requires_grad:
        warnings.warn(
            f"{call}: the tensor requires grad; the array shares its memory but carries no autograd "
            "history (detached, not copied). Call .detach() first to silence this note.",
            UserWarning,
            stacklevel=3,
        )
    return tensor.detach()


def _plain(tensor: Any, torch: Any) -> Any:
    # A ManagedTensor would route .numpy() and friends through its placement
    # logic; the plain alias shares the memory and skips that.
    return tensor.as_subclass(torch.Tensor) if type(tensor) is not torch.Tensor else tensor


def _dense_from_torch(t: Any, call: str) -> Any:
    if t.device.type == "cpu":
        if t.is_conj() or t.is_neg():
            raise ValueError(
                f"{call}: the tensor has a lazy conjugate/negation bit; call .resolve_conj() / "
                ".resolve_neg() first (that copies) to get an array."
            )
        return t.numpy()
    if t.device.type == "cuda":
        return _backend.cupy().from_dlpack(t)
    raise TypeError(f"{call}: the tensor is on {t.device}; expected a CPU or CUDA tensor")


def from_torch(tensor: Any):
    """An array sharing memory with a torch tensor: NumPy (CPU), CuPy (CUDA), or CSR.

    Parameters
    ----------
    tensor : torch.Tensor
        Dense (any strides), or ``torch.sparse_csr`` (COO is converted to CSR
        first, which copies, since CSR is what the solvers use).

    Returns
    -------
    numpy.ndarray, cupy.ndarray, scipy.sparse.csr_matrix or cupyx.scipy.sparse.csr_matrix
        Same data pointers. A SciPy CSR keeps torch's index dtype (SciPy's
        constructor would downcast int64 indices to int32 with a copy; this
        does not). cupyx keeps int32 indices only: int64 index arrays of a
        CUDA tensor are copied to int32 (values are shared); build the torch
        CSR with int32 indices for a handoff without any copy.

    Notes
    -----
    A tensor that requires grad is detached with a ``UserWarning`` (the array
    holds no autograd history); it is never copied to hide that. On CUDA,
    CuPy's current stream is ordered after torch's current stream by the
    DLPack protocol.

    Examples
    --------
    >>> import torch
    >>> from managed_solve.dlpack import from_torch
    >>> t = torch.arange(4.0)
    >>> a = from_torch(t)
    >>> a.ctypes.data == t.data_ptr()
    True
    """
    torch = _backend.torch_module()
    call = "from_torch(tensor)"
    if not _backend.is_torch_tensor(tensor):
        raise TypeError(f"{call}: expected a torch.Tensor, got {type(tensor).__name__}")
    t = _note_detach(_plain(tensor, torch), call)
    layout = t.layout
    if layout == torch.strided:
        return _dense_from_torch(t, call)
    if layout == torch.sparse_coo:
        log.info("managed_solve: from_torch converts a sparse COO tensor to CSR (one copy)")
        t = t.coalesce().to_sparse_csr()
        layout = t.layout
    if layout != torch.sparse_csr:
        raise TypeError(f"{call}: layout {layout} is not supported; expected strided, sparse_coo or sparse_csr")
    crow = _dense_from_torch(t.crow_indices(), call)
    col = _dense_from_torch(t.col_indices(), call)
    val = _dense_from_torch(t.values(), call)
    xp = _backend.array_module(val)
    sparse = _backend.sparse_module(xp)
    shape = tuple(t.shape)
    # Built empty, then given the arrays: the (data, indices, indptr) constructor
    # would downcast int64 indices to int32, which copies.
    if xp is not np:
        if crow.dtype != xp.int32:
            # cupyx (cuSPARSE) keeps int32 indices only: the two index arrays are copied.
            log.info("managed_solve: from_torch casts int64 CSR indices to int32 for cupyx (copy of indices)")
        return sparse.csr_matrix((val, col, crow), shape=shape, copy=False)
    A = sparse.csr_matrix(shape, dtype=val.dtype)
    A.data, A.indices, A.indptr = val, col, crow
    A.check_format(full_check=False)
    return A
