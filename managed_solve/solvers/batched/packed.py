"""PackedBatch: many CSR systems as one block-diagonal CSR on one device.

The batched Krylov core (:mod:`managed_solve.solvers.batched`) runs on this
layout: rows of system ``s`` are ``offsets[s]:offsets[s+1]``, its column
indices are shifted by the same offset (so the whole batch is one
block-diagonal matrix and one SpMV serves every system), and ``row_sys``
maps each row to its system for the per-system scalars of the GPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ... import _backend, _pinned, config
from ...system.linear_system import default_maxiter
from .._common import refuse_unscalable_diagonal
from . import gather

__all__ = ["PackedBatch", "pack_host"]

_INT32_MAX = np.iinfo(np.int32).max
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

def _index_dtype(n: int, nnz: int, index_dtype: Any = None) -> np.dtype:
    if index_dtype is not None:
        dt = np.dtype(index_dtype)
        if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
            raise TypeError(f"PackedBatch: index_dtype must be int32 or int64, got {dt}")
        if dt == np.int32 and max(n, nnz) > _INT32_MAX:
            raise ValueError(
                f"PackedBatch: index_dtype=int32 cannot address n={n}, nnz={nnz} "
                "(more than 2**31 - 1); use index_dtype=int64 or leave it None."
            )
        return dt
    return np.dtype(np.int64) if max(n, nnz) > _INT32_MAX else np.dtype(np.int32)


def _target(device: Any) -> int | None:
    """The CUDA GPU a batch packed for ``device`` goes to (None: host arrays)."""
    from ...device_args import cuda_ordinal

    return cuda_ordinal(device, what="PackedBatch.pack(device=...)")


def _on_cuda(a: Any, idx: int) -> bool:
    return _backend.is_cupy_array(a) and a.device.id == idx


class PackedBatch:
    """Block-diagonal CSR of ``nsys`` systems on one device, with per-system options.

    Build it with :meth:`pack` (many :class:`~managed_solve.system.LinearSystem`)
    or :meth:`from_csr` (one matrix); solve it with
    :func:`~managed_solve.solvers.batched.cg_batched`,
    :func:`~managed_solve.solvers.batched.bicgstab_batched` or
    :func:`~managed_solve.solvers.batched.gmres_batched`.

    Attributes
    ----------
    xp : module
        ``numpy`` or ``cupy``: where the arrays lie.
    indptr, indices, data : xp arrays
        The block-diagonal CSR; int32 indices unless ``n`` or ``nnz`` exceed int32.
    b, x0 : xp arrays, shape (n,)
        Right-hand sides and initial guesses (``x0`` None means zeros).
    offsets : numpy int64 array, shape (nsys + 1,)
        Row offsets of each system (on the host).
    row_sys : xp int32 array, shape (n,)
        System id of each row.
    rtol, atol : numpy float64 arrays, shape (nsys,)
    maxiter : numpy int64 array, shape (nsys,)
    dinv : xp array or None
        Inverse diagonal (Jacobi preconditioner) when packed with ``jacobi=True``.
    device : str
        ``"cpu"``, ``"sim:k"`` or ``"cuda:i"``.
    workspace : FusedWorkspace or None
        A GPU solve's workspace built ahead by
        :func:`managed_solve.solvers.batched.gpu.prepare`; the next CG or
        BiCGStab solve of the batch takes it (once).
    host_buffers : tuple
        Page-locked host buffers the batch's arrays were copied from, kept as
        long as the batch (their asynchronous copies may still be queued).

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from managed_solve.solvers.batched import PackedBatch
    >>> A = sp.diags([2.0, 4.0]).tocsr()
    >>> batch = PackedBatch.from_csr(A, np.ones(2))
    >>> batch.nsys, batch.n, batch.nnz, str(batch.indices.dtype)
    (1, 2, 2, 'int32')
    """

    def __init__(self, *, indptr: Any, indices: Any, data: Any, b: Any, x0: Any,
                 offsets: np.ndarray, row_sys: Any, rtol: np.ndarray, atol: np.ndarray,
                 maxiter: np.ndarray, dinv: Any = None, device: str = "cpu",
                 names: Sequence[Any] | None = None, host_buffers: tuple = ()):
        self.indptr, self.indices, self.data = indptr, indices, data
        self.b, self.x0 = b, x0
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.row_sys = row_sys
        self.rtol = np.asarray(rtol, dtype=np.float64)
        self.atol = np.asarray(atol, dtype=np.float64)
        self.maxiter = np.asarray(maxiter, dtype=np.int64)
        self.dinv = dinv
        self.device = str(device)
        self.names = list(names) if names is not None else [None] * (len(self.offsets) - 1)
        self.host_buffers = host_buffers
        self.workspace: Any = None

    # -- facts --------------------------------------------------------------
    @property
    def xp(self):
        return _backend.array_module(self.data)

    @property
    def nsys(self) -> int:
        return len(self.offsets) - 1

    @property
    def n(self) -> int:
        return int(self.offsets[-1])

    @property
    def nnz(self) -> int:
        return int(self.data.shape[0])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data.dtype)

    @property
    def index_dtype(self) -> np.dtype:
        return np.dtype(self.indices.dtype)

    @property
    def sizes(self) -> np.ndarray:
        """Rows of each system (host int64)."""
        return np.diff(self.offsets)

    @property
    def nbytes(self) -> int:
        """Bytes the batch's arrays hold on its device."""
        arrays = (self.indptr, self.indices, self.data, self.b, self.x0, self.row_sys, self.dinv)
        return int(sum(a.nbytes for a in arrays if a is not None))

    def __repr__(self) -> str:
        return (f"PackedBatch(nsys={self.nsys}, n={self.n}, nnz={self.nnz}, dtype={self.dtype}, "
                f"index_dtype={self.index_dtype}, device={self.device!r}, "
                f"jacobi={self.dinv is not None})")

    # -- construction ----------------------------------------------------------
    @classmethod
    def pack(cls, systems: Sequence[Any], *, device: Any = "cpu", jacobi: bool = False,
             dtype: Any = None, index_dtype: Any = None) -> PackedBatch:
        """Pack :class:`~managed_solve.system.LinearSystem` objects into one batch on ``device``.

        Parameters
        ----------
        systems : sequence of LinearSystem
            Each with ``kind == "csr"``; on any device (moved to ``device``).
        device : str or Device
            ``"cpu"``, ``"sim:k"`` (host arrays) or ``"cuda:i"`` (CuPy arrays on GPU i).
        jacobi : bool
            Also build the inverse diagonal for Jacobi preconditioning.
        dtype : float32 or float64, optional
            Value dtype of the batch; default float32 only when every system is float32.
        index_dtype : int32 or int64, optional
            Force the index width (default: int32 unless ``n`` or ``nnz`` exceed it).

        Returns
        -------
        PackedBatch

        Raises
        ------
        ValueError
            An empty list, or a system that is not a sparse CSR matrix.
        TypeError
            An unsupported dtype.

        Examples
        --------
        >>> import numpy as np, scipy.sparse as sp
        >>> from managed_solve import LinearSystem
        >>> from managed_solve.solvers.batched import PackedBatch
        >>> s1 = LinearSystem(sp.diags([2.0, 2.0]).tocsr(), np.ones(2), rtol=1e-6)
        >>> s2 = LinearSystem(sp.diags([4.0]).tocsr(), np.ones(1))
        >>> batch = PackedBatch.pack([s1, s2])
        >>> batch.offsets.tolist(), batch.row_sys.tolist(), batch.indices.tolist()
        ([0, 2, 3], [0, 0, 1], [0, 1, 2])
        """
        systems = list(systems)
        if not systems:
            raise ValueError("PackedBatch.pack(systems=[]): nothing to pack; pass at least one LinearSystem")
        for k, s in enumerate(systems):
            kind = getattr(s, "kind", None)
            if kind != "csr":
                what = f"kind={kind!r}" if kind is not None else f"a {type(s).__name__}"
                raise ValueError(
                    f"PackedBatch.pack(systems[{k}]): expected a LinearSystem with a sparse CSR "
                    f"matrix (kind='csr'), got {what}. Solve dense or operator systems with "
                    "solve(), or pass A as a scipy/cupyx sparse matrix."
                )
        if dtype is None:
            dt = (np.dtype(np.float32) if all(np.dtype(s.dtype) == np.float32 for s in systems)
                  else np.dtype(np.float64))
        else:
            dt = np.dtype(dtype)
        if dt not in _FLOATS:
            raise TypeError(f"PackedBatch.pack(dtype={dt}): expected float32 or float64")
        if all(getattr(s, "device", "cpu") == "cpu"
               and not _backend.is_cupy_array(getattr(s, "x0", None)) for s in systems):
            # Host inputs: one vectorised pass into the batch's arrays (pinned
            # ones when bound for a GPU, then one asynchronous copy per array).
            # A system's device follows A and b; an x0 on a GPU (solve_many's
            # warm restart of host systems solved there) takes the path below.
            idx = _target(device)
            if idx is not None:
                return _pack_host_to_gpu(systems, jacobi=jacobi, device_id=idx, dtype=dt,
                                         index_dtype=index_dtype)
            return pack_host(systems, jacobi=jacobi, device=str(device), dtype=dt,
                             index_dtype=index_dtype)
        # Some inputs already on a GPU: fill slice by slice, each where it lies.
        sizes = np.array([s.n for s in systems], dtype=np.int64)
        nnzs = np.array([s.nnz for s in systems], dtype=np.int64)
        offsets = np.zeros(len(systems) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        nnz_off = np.zeros(len(systems) + 1, dtype=np.int64)
        np.cumsum(nnzs, out=nnz_off[1:])
        n, nnz = int(offsets[-1]), int(nnz_off[-1])
        idt = _index_dtype(n, nnz, index_dtype)
        idx = _target(device)
        if idx is not None:
            xp = _backend.cupy()
            ctx = xp.cuda.Device(idx)
        else:
            xp, ctx = np, _NullCtx()
        any_x0 = any(s.x0 is not None for s in systems)
        if idx is not None and not jacobi and gather.gatherable(systems, idx, dt):
            # Every array on the target GPU already: one launch packs them all.
            indptr, indices, data, b, x0 = gather.pack_gather(
                systems, offsets, nnz_off, device_id=idx, dtype=dt, index_dtype=idt, x0=any_x0)
            with ctx:
                row_sys = xp.asarray(np.repeat(np.arange(len(systems), dtype=np.int32), sizes))
            return cls._of(systems, indptr, indices, data, b, x0, offsets, row_sys, None,
                           f"cuda:{idx}")
        with ctx:
            # Fill preallocated outputs slice by slice, so the device holds the
            # batch plus at most one system's temporary, never two copies.
            indptr = xp.empty(n + 1, dtype=idt)
            indices = xp.empty(nnz, dtype=idt)
            data = xp.empty(nnz, dtype=dt)
            b = xp.empty(n, dtype=dt)
            x0 = xp.zeros(n, dtype=dt) if any_x0 else None
            dinv = xp.empty(n, dtype=dt) if jacobi else None
            indptr[-1:] = nnz
            for k, s in enumerate(systems):
                lo, hi, jlo, jhi = offsets[k], offsets[k + 1], nnz_off[k], nnz_off[k + 1]
                A = s.A
                mod = xp if (idx is not None and _on_cuda(A.data, idx)) else np
                if mod is np:
                    A = _backend.to_host(A)
                ip = A.indptr[:-1].astype(np.int64) + jlo if mod is np else A.indptr[:-1].astype(idt) + idt.type(jlo)
                _put(indptr, lo, hi, ip.astype(idt, copy=False), xp)
                ci = A.indices.astype(np.int64) + lo if mod is np else A.indices.astype(idt) + idt.type(lo)
                _put(indices, jlo, jhi, ci.astype(idt, copy=False), xp)
                _put(data, jlo, jhi, A.data.astype(dt, copy=False), xp)
                bb = s.b if (idx is not None and _on_cuda(s.b, idx)) else _backend.to_host(s.b)
                _put(b, lo, hi, bb.astype(dt, copy=False), xp)
                if s.x0 is not None:
                    xx = s.x0 if (idx is not None and _on_cuda(s.x0, idx)) else _backend.to_host(s.x0)
                    _put(x0, lo, hi, xx.astype(dt, copy=False), xp)
                if jacobi:
                    _put(dinv, lo, hi, _inverse_diagonal(A, dt, call=_jacobi_call(s, k)), xp)
            row_sys = xp.asarray(np.repeat(np.arange(len(systems), dtype=np.int32), sizes))
        return cls._of(systems, indptr, indices, data, b, x0, offsets, row_sys, dinv,
                       f"cuda:{idx}" if idx is not None else str(device))

    @classmethod
    def _of(cls, systems: Sequence[Any], indptr: Any, indices: Any, data: Any, b: Any, x0: Any,
            offsets: np.ndarray, row_sys: Any, dinv: Any, device: str) -> PackedBatch:
        """The batch over packed arrays, with the systems' tolerances, limits and names."""
        rtol = np.array([s.rtol for s in systems], dtype=np.float64)
        atol = np.array([s.atol for s in systems], dtype=np.float64)
        maxiter = np.array([s.iteration_limit for s in systems], dtype=np.int64)
        return cls(indptr=indptr, indices=indices, data=data, b=b, x0=x0, offsets=offsets,
                   row_sys=row_sys, rtol=rtol, atol=atol, maxiter=maxiter, dinv=dinv,
                   device=device, names=[getattr(s, "name", None) for s in systems])

    @classmethod
    def from_csr(cls, A: Any, b: Any, *, x0: Any = None, rtol: float = 1e-8, atol: float = 0.0,
                 maxiter: int | None = None, jacobi: bool = False,
                 index_dtype: Any = None) -> PackedBatch:
        """One system as a batch of one; arrays stay where they are.

        ``A`` is a SciPy or cupyx CSR matrix (other sparse formats are
        converted); no copy is made when A's arrays already have the batch's
        dtypes. ``index_dtype`` forces int32 or int64 indices (a copy of the
        index arrays when they differ).

        Examples
        --------
        >>> import numpy as np, scipy.sparse as sp
        >>> from managed_solve.solvers.batched import PackedBatch
        >>> A = sp.diags([2.0, 4.0]).tocsr()
        >>> batch = PackedBatch.from_csr(A, np.ones(2), index_dtype=np.int64)
        >>> str(batch.indptr.dtype), batch.maxiter.tolist()
        ('int64', [100])
        """
        call = "PackedBatch.from_csr(A, b)"
        if not (_backend.is_scipy_sparse(A) or _backend.is_cupy_sparse(A)):
            raise TypeError(f"{call}: A must be a SciPy or cupyx sparse matrix, got {type(A).__name__}; "
                            "wrap dense or torch inputs in LinearSystem and use PackedBatch.pack")
        if A.format != "csr":
            A = A.tocsr()
        if A.shape[0] != A.shape[1]:
            raise ValueError(f"{call}: A must be square, got shape {A.shape}")
        n = int(A.shape[0])
        dt = np.dtype(A.dtype)
        if dt not in _FLOATS:
            raise TypeError(f"{call}: A has dtype {dt}; expected float32 or float64 (use A.astype)")
        xp = _backend.array_module(A.data)
        if _backend.array_module(b) is not xp or (x0 is not None and _backend.array_module(x0) is not xp):
            raise ValueError(f"{call}: A, b and x0 must lie on one device (all NumPy or all CuPy)")
        if tuple(b.shape) != (n,):
            raise ValueError(f"{call}: b must have shape ({n},), got {tuple(b.shape)}")
        if x0 is not None and tuple(x0.shape) != (n,):
            raise ValueError(f"{call}: x0 must have shape ({n},), got {tuple(x0.shape)}")
        if maxiter is not None and int(maxiter) < 0:
            raise ValueError(f"{call}: maxiter must be >= 0, got {maxiter}")
        idt = _index_dtype(n, int(A.nnz), index_dtype)
        indptr = A.indptr if A.indptr.dtype == idt else A.indptr.astype(idt)
        indices = A.indices if A.indices.dtype == idt else A.indices.astype(idt)
        device = f"cuda:{A.data.device.id}" if xp is not np else "cpu"
        # Contiguous vectors: the kernels read each as one stretch of memory
        # (a column of a block, or any strided view, is copied here).
        return cls(indptr=indptr, indices=indices, data=A.data,
                   b=xp.ascontiguousarray(b, dtype=dt),
                   x0=None if x0 is None else xp.ascontiguousarray(x0, dtype=dt),
                   offsets=np.array([0, n], dtype=np.int64),
                   row_sys=xp.zeros(n, dtype=np.int32),
                   rtol=np.array([rtol], dtype=np.float64), atol=np.array([atol], dtype=np.float64),
                   maxiter=np.array([default_maxiter(n) if maxiter is None else int(maxiter)]),
                   dinv=_inverse_diagonal(A, dt, call=call) if jacobi else None, device=device)

    # -- results ---------------------------------------------------------------
    def unpack(self, x: Any) -> list:
        """Per-system views of a packed vector (no copies).

        Examples
        --------
        >>> import numpy as np, scipy.sparse as sp
        >>> from managed_solve import LinearSystem
        >>> from managed_solve.solvers.batched import PackedBatch
        >>> ss = [LinearSystem(sp.eye(k, format="csr"), np.ones(k)) for k in (1, 2)]
        >>> [v.tolist() for v in PackedBatch.pack(ss).unpack(np.arange(3.0))]
        [[0.0], [1.0, 2.0]]
        """
        if tuple(x.shape) != (self.n,):
            raise ValueError(f"PackedBatch.unpack(x): x must have shape ({self.n},), got {tuple(x.shape)}")
        o = self.offsets
        return [x[o[k]:o[k + 1]] for k in range(self.nsys)]


class _NullCtx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _put(out: Any, lo: int, hi: int, part: Any, xp: Any) -> None:
    """out[lo:hi] = part, uploading a host part straight into the slice."""
    if xp is np or _backend.is_cupy_array(part):
        out[lo:hi] = part
    else:
        out[lo:hi].set(np.ascontiguousarray(part))


def _inverse_diagonal(A: Any, dt: np.dtype, *, call: str) -> Any:
    """1 / diag(A) for Jacobi, on A's device; an entry without a finite reciprocal is refused."""
    return refuse_unscalable_diagonal(A.diagonal().astype(dt, copy=False), call).astype(dt, copy=False)


def _jacobi_call(system: Any, k: int) -> str:
    """How a Jacobi refusal names system ``k`` of a batch: by its name (solve_many names an
    ``(A, b)`` pair ``systems[i]``), and the option that asked for the scaling."""
    return f"{getattr(system, 'name', None) or f'systems[{k}]'} (M='jacobi')"


# Systems are copied into a batch in pieces of about ``config.pack_chunk_nnz``
# stored entries, one piece per thread: the copies are memory-bound and run
# without the GIL, so several cores move the bytes of a large batch together.
# Threads that copy one batch's pieces (a pool per GPU, so stagers of
# different GPUs do not queue behind each other).
PACK_WORKERS = 8


def pack_host(systems: Sequence[Any], *, jacobi: bool = False, device: str = "cpu",
              dtype: Any = None, index_dtype: Any = None,
              allocate: Callable[[list[tuple[int, Any]]], list[np.ndarray]] | None = None,
              chunk_nnz: int | None = None, pool: str = "pack") -> PackedBatch:
    """:meth:`PackedBatch.pack` of host CSR systems: copied in parallel pieces, one fix-up pass each.

    Each piece of about ``chunk_nnz`` stored entries (cut at system
    boundaries) is one GIL-free copy per array straight into the batch's
    buffers (:func:`managed_solve.kernels.packing.gather` by address; an
    ``np.concatenate`` that casts where dtypes differ), then one pass of :func:`managed_solve.kernels.packing.shift_blocks` that makes
    the indices and row pointers global and fills ``row_sys`` (with Jacobi,
    the inverse diagonal too), in place with no temporaries; without Jacobi
    the index arrays are copied and shifted in the same pass
    (:func:`~managed_solve.kernels.packing.gather_blocks`). Pieces run on the
    thread pool named ``pool`` (:func:`managed_solve._backend.thread_pool`).
    ``allocate(specs)`` allocates the outputs at once, one array per
    ``(size, dtype)`` of ``specs`` (towards a GPU: one page-locked block,
    :func:`managed_solve._pinned.pinned_arrays`).
    ``chunk_nnz`` defaults to ``config.current().pack_chunk_nnz``.
    """
    from ...kernels.packing import (
        gather_blocks,
        inverse_diagonal_rows,
        shift_blocks,
        shift_blocks_jacobi,
    )

    allocate = allocate or (lambda specs: [np.empty(size, dtype=dt) for size, dt in specs])
    chunk_nnz = int(chunk_nnz or config.current().pack_chunk_nnz)
    k = len(systems)
    # The per-system attributes are read once, here: every later step slices these lists.
    mats = [s.A for s in systems]
    # Systems often share a matrix (one mesh, many right-hand sides): each
    # distinct matrix's arrays are read once and ``which`` maps every system to
    # its matrix (reading an array's address is Python holding the GIL, beside
    # the GPU workers).
    uniq: dict[int, Any] = {}
    for A in mats:
        uniq.setdefault(id(A), A)
    pos = {key: j for j, key in enumerate(uniq)}
    which = np.fromiter((pos[id(A)] for A in mats), np.int64, k)
    distinct = list(uniq.values())
    datas = [A.data for A in distinct]
    idxs = [A.indices for A in distinct]
    ptrs = [A.indptr[:-1] for A in distinct]
    bs = [s.b for s in systems]
    if dtype is not None:
        dt = np.dtype(dtype)
    else:
        dt = np.dtype(np.float32) if all(s.dtype == np.float32 for s in systems) else np.dtype(np.float64)
    sizes = np.fromiter((p.shape[0] for p in ptrs), np.int64, len(ptrs))[which]
    nnzs = np.fromiter((a.shape[0] for a in idxs), np.int64, len(idxs))[which]
    offsets = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    nnz_off = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(nnzs, out=nnz_off[1:])
    n, nnz = int(offsets[-1]), int(nnz_off[-1])
    idt = _index_dtype(n, nnz, index_dtype)
    x0s = [s.x0 for s in systems]
    any_x0 = any(v is not None for v in x0s)
    specs = [(nnz, dt), (nnz, idt), (n + 1, idt), (n, dt), (n, np.dtype(np.int32))]
    specs += [(n, dt)] * (int(any_x0) + int(jacobi))
    data, indices, indptr, b, row_sys, *more = allocate(specs)
    x0 = more.pop(0) if any_x0 else None
    dinv = more.pop(0) if jacobi else None
    if any_x0:
        zeros = np.zeros(int(sizes.max()), dtype=dt)  # one buffer, sliced for systems without x0
        x0s = [v if v is not None else zeros[:m] for v, m in zip(x0s, sizes.tolist(), strict=True)]
    indptr[-1] = nnz

    # Families whose arrays all have the batch's dtype are copied by address in
    # one GIL-free call per piece (see kernels.packing.gather); others (mixed
    # dtypes, strided views) by np.concatenate, which casts on the way.
    index_families = [_Family(idxs, nnzs, nnz_off, indices, which),
                      _Family(ptrs, sizes, offsets, indptr, which)]
    copies = [_Family(datas, nnzs, nnz_off, data, which), _Family(bs, sizes, offsets, b)]
    if x0 is not None:
        copies.append(_Family(x0s, sizes, offsets, x0))
    # Without Jacobi, index arrays of the batch's index dtype are copied and
    # shifted in one pass (kernels.packing.gather_blocks); otherwise copied,
    # then fixed by the pass that also reads the diagonal.
    fused = dinv is None and all(f.addresses is not None for f in index_families)
    if not fused:
        copies = index_families + copies

    def fill(lo: int, hi: int) -> None:
        # Copies (casting to the batch's dtypes where needed), then one in-place pass.
        for fam in copies:
            fam.copy(lo, hi)
        if fused:
            gather_blocks(lo, hi, index_families[0].addresses, index_families[1].addresses,
                          offsets, nnz_off, indptr, indices, row_sys)
            return
        if dinv is None:
            shift_blocks(lo, hi, offsets, nnz_off, indptr, indices, row_sys)
            return
        row = shift_blocks_jacobi(lo, hi, offsets, nnz_off, indptr, indices, row_sys, data, dinv)
        if row >= 0:
            refuse_unscalable(row)

    def refuse_unscalable(row: int) -> None:
        # The kernels found a diagonal entry without a finite reciprocal (a zero,
        # or one so small that 1 / d overflows) in the batch's row ``row``: its
        # system's diagonal is refused as solve(M='jacobi') refuses it.
        j = int(np.searchsorted(offsets, row, side="right")) - 1
        d = mats[j].diagonal().astype(dt)
        refuse_unscalable_diagonal(d, _jacobi_call(systems[j], j))
        # Duplicates summed in the batch's dtype can cancel where scipy's sum does not.
        d[row - int(offsets[j])] = 0
        refuse_unscalable_diagonal(d, _jacobi_call(systems[j], j))

    def fill_rows(j: int, ra: int, rb: int) -> None:
        # Rows ra:rb of system j alone (a system larger than two pieces is split).
        r0, z0 = int(offsets[j]), int(nnz_off[j])
        A, ptr = mats[j], mats[j].indptr
        za, zb = int(ptr[ra]), int(ptr[rb])
        ix = indices[z0 + za:z0 + zb]
        np.copyto(ix, A.indices[za:zb], casting="unsafe")
        if r0:
            ix += r0
        np.copyto(data[z0 + za:z0 + zb], A.data[za:zb], casting="unsafe")
        np.add(ptr[ra:rb], z0, out=indptr[r0 + ra:r0 + rb], casting="unsafe")
        np.copyto(b[r0 + ra:r0 + rb], bs[j][ra:rb], casting="unsafe")
        if x0 is not None:
            np.copyto(x0[r0 + ra:r0 + rb], x0s[j][ra:rb], casting="unsafe")
        row_sys[r0 + ra:r0 + rb] = j
        if dinv is not None:
            z1 = int(nnz_off[j + 1])
            row = inverse_diagonal_rows(ra, rb, ptr, indices[z0:z1], data[z0:z1], r0,
                                        dinv[r0 + ra:r0 + rb])
            if row >= 0:
                refuse_unscalable(r0 + row)

    # Pieces of about chunk_nnz entries: runs of systems cut at system
    # boundaries, and a system of two pieces or more cut into row ranges (a
    # large system is otherwise one serial copy).
    tasks: list[tuple] = []
    split = np.flatnonzero(nnzs >= 2 * chunk_nnz).tolist() if k else []
    start = 0
    for j in split + [k]:
        if j > start:  # the run of systems start:j
            targets = np.arange(int(nnz_off[start]) + chunk_nnz, int(nnz_off[j]), chunk_nnz)
            cuts = [start] + sorted({int(c) for c in np.searchsorted(nnz_off, targets)}
                                    - {start, j}) + [j]
            tasks += [(fill, lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]
        if j < k:
            ptr = mats[j].indptr
            rows = np.searchsorted(ptr, np.arange(0, int(nnzs[j]), chunk_nnz), side="right") - 1
            bounds = sorted({int(r) for r in rows} | {0, int(sizes[j])})
            tasks += [(fill_rows, j, ra, rb) for ra, rb in zip(bounds[:-1], bounds[1:], strict=True)]
        start = j + 1
    if len(tasks) > 1:
        workers = _backend.thread_pool(pool, min(PACK_WORKERS, _backend.cpu_count()))
        for f in [workers.submit(*t) for t in tasks]:
            f.result()  # re-raises a piece's error here, the first piece's first
    elif tasks:
        tasks[0][0](*tasks[0][1:])
    return PackedBatch(
        indptr=indptr, indices=indices, data=data, b=b, x0=x0, offsets=offsets, row_sys=row_sys,
        rtol=np.array([s.rtol for s in systems], dtype=np.float64),
        atol=np.array([s.atol for s in systems], dtype=np.float64),
        maxiter=np.array([s.iteration_limit for s in systems], dtype=np.int64),
        dinv=dinv, device=device, names=[s.name for s in systems])


class _Family:
    """One array of every system (their ``data``, say) and where it goes in the batch.

    ``parts`` holds one array per system, or with ``which`` one per distinct
    source (a matrix shared by several systems), system ``j`` reading
    ``parts[which[j]]``.
    """

    def __init__(self, parts: list, lengths: np.ndarray, starts: np.ndarray, out: np.ndarray,
                 which: np.ndarray | None = None):
        self.parts, self.lengths, self.starts, self.out = parts, lengths, starts, out
        self.which = which
        dt = out.dtype
        self.addresses = None
        if all(p.dtype == dt and p.flags.c_contiguous for p in parts):
            from ...kernels.packing import addresses

            self.addresses = addresses(parts)
            if which is not None:
                self.addresses = self.addresses[which]

    def copy(self, lo: int, hi: int) -> None:
        out = self.out[self.starts[lo]:self.starts[hi]]
        if self.addresses is None:
            parts = self.parts[lo:hi] if self.which is None else \
                [self.parts[w] for w in self.which[lo:hi].tolist()]
            np.concatenate(parts, out=out)
        else:
            from ...kernels.packing import gather

            gather(self.addresses[lo:hi], self.lengths[lo:hi], out)


def _pack_host_to_gpu(systems: Sequence[Any], *, jacobi: bool, device_id: int, dtype: Any,
                      index_dtype: Any) -> PackedBatch:
    """Host systems packed into one page-locked block, then one asynchronous copy per array.

    Copying each system's arrays on its own would cost 4 small synchronous
    copies a system; here the copies go on the current stream, so a caller staging on a second stream overlaps them with
    the compute of another batch.
    """
    cp = _backend.cupy()
    # The batch's page-locked block lives as long as the batch (its copy may be in flight).
    keep: list = []

    def pinned(specs: list) -> list[np.ndarray]:
        return _pinned.pinned_arrays(specs, keep)

    # A pool per GPU: two GPUs' stagers packing at once each get their own
    # threads (one shared pool made each wait behind the other's pieces).
    host = pack_host(systems, jacobi=jacobi, device="cpu", dtype=dtype, index_dtype=index_dtype,
                     allocate=pinned, pool=f"pack-cuda:{device_id}")
    stream = cp.cuda.get_current_stream()

    def up(a: Any) -> Any:
        if a is None:
            return None
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        out = cp.empty(a.shape, dtype=a.dtype)
        out.set(a, stream=stream)
        return out

    with cp.cuda.Device(device_id):
        batch = PackedBatch(indptr=up(host.indptr), indices=up(host.indices), data=up(host.data),
                            b=up(host.b), x0=up(host.x0), offsets=host.offsets,
                            row_sys=up(host.row_sys), rtol=host.rtol, atol=host.atol,
                            maxiter=host.maxiter, dinv=up(host.dinv), device=f"cuda:{device_id}",
                            names=host.names, host_buffers=(keep, host))
    return batch
