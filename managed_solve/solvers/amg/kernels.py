"""The fused V-cycle kernels on a GPU: ``cycle.cu`` compiled through CuPy, and their launches.

:class:`CudaOps` has the interface of :class:`~.twins.TwinOps` (the NumPy
twins), so :class:`~.fused.FusedCycle` queues the same sequence on either.
The source is compiled once per device through the batched core's loader
(:func:`managed_solve._backend.raw_kernels`), instantiated for
float and double and for every row-group width.

Launch geometry: row kernels give a row ``G`` lanes (:func:`group_size`,
from the mean row length and the value width) and loop over rows
grid-stride, with at most :data:`WAVES` waves of blocks (a wave: 8 blocks
of 256 threads per multiprocessor), so any ``n`` (17M rows and beyond) is
covered by a bounded grid. Eight waves rather than one: the block
scheduler then evens out rows of unequal cost and the last, partial pass
over the rows; more waves gain on the cycle's kernels but lose on the
loop's sums (one atomic addition a block). The figures behind both
choices: ``docs/performance.md``, "Tuning constants".
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from ... import _backend
from ..batched import cuda

#: Threads per block.
THREADS = 256
#: Waves of blocks a launch covers at most (see the module's docstring).
WAVES = 8
#: Row-group widths instantiated (lanes a row).
GROUPS = (1, 2, 4, 8, 16, 32)
_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


@functools.cache
def source() -> str:
    """The CUDA C++ text of the fused cycle kernels."""
    return Path(__file__).with_name("cycle.cu").read_text(encoding="utf-8")


def instantiations(T: str) -> dict[str, str]:  # noqa: N803 - the C++ template's name
    """Kernel key -> C++ name expression for value type ``T``."""
    names = {"scale": f"amg_scale<{T}>", "dense": f"amg_dense<{T}>", "zero": f"amg_zero<{T}>"}
    for g in GROUPS:
        names[f"step{g}"] = f"amg_step<{T}, {g}>"
        names[f"first{g}"] = f"amg_first<{T}, {g}>"
        names[f"restrict{g}"] = f"amg_restrict<{T}, {g}>"
        names[f"prolong{g}"] = f"amg_prolong<{T}, {g}>"
    return names


def group_size(n: int, nnz: int, itemsize: int = 8) -> int:
    """Lanes a row for a CSR matrix of ``itemsize``-byte values: 1 to 32, a power of two.

    Few lanes a row: a row's scalar work (its b, dinv and x, the write of
    the result) is done by one lane of its group, so narrow groups keep more
    lanes loading. The cycle's kernels were fastest with 2 lanes up to 16
    entries a row in float64, and in float32 with 1 lane below 8 entries and
    2 from 8 (``docs/performance.md``, "Tuning constants"); longer rows get
    about one lane per 5 entries, up to a warp.
    """
    mean = nnz / max(n, 1)
    if mean < (8.0 if itemsize <= 4 else 4.0):
        return 1
    if mean < 16.0:
        return 2
    return int(min(32, 2 ** math.floor(math.log2(mean / 5.0))))


def kernels(device_id: int, dtype: Any) -> dict[str, Any]:
    """The compiled kernels for one device and value dtype (float32 or float64)."""
    return _backend.raw_kernels(device_id, source(), instantiations(_TYPES[np.dtype(dtype)]))


class CudaOps:
    """Launches of the fused kernels on CuPy arrays of one dtype (the current stream)."""

    def __init__(self, dtype: Any, device_id: int):
        self.t = np.dtype(dtype).type
        self.k = kernels(device_id, dtype)
        self.blocks = cuda.sm_count(device_id) * 8 * WAVES

    def _grid(self, threads: int) -> tuple[int]:
        return (max(1, min(math.ceil(threads / THREADS), self.blocks)),)

    def scale(self, n: int, b: Any, dinv: Any, s: float, x: Any, d: Any, write_d: int) -> None:
        self.k["scale"](self._grid(n), (THREADS,),
                        (np.int64(n), b, dinv, self.t(s), x, d, np.int32(write_d)))

    def step(self, n: int, indptr: Any, indices: Any, data: Any, dinv: Any, b: Any, x_old: Any,
             x_new: Any, d: Any, a: float, c: float, write_d: int, prev: int) -> None:
        g = group_size(n, data.shape[0], data.dtype.itemsize)
        self.k[f"step{g}"](self._grid(n * g), (THREADS,),
                           (np.int64(n), indptr, indices, data, dinv, b, x_old, x_new, d,
                            self.t(a), self.t(c), np.int32(write_d), np.int32(prev)))

    def first(self, n: int, indptr: Any, indices: Any, data: Any, dinv: Any, b: Any, s: float,
              x_new: Any, d: Any, a: float, c: float, write_d: int) -> None:
        g = group_size(n, data.shape[0], data.dtype.itemsize)
        self.k[f"first{g}"](self._grid(n * g), (THREADS,),
                            (np.int64(n), indptr, indices, data, dinv, b, self.t(s), x_new, d,
                             self.t(a), self.t(c), np.int32(write_d)))

    def restrict(self, n: int, indptr: Any, indices: Any, data: Any, b: Any, x: Any,
                 p_indptr: Any, p_indices: Any, p_data: Any, bc: Any) -> None:
        g = group_size(n, data.shape[0], data.dtype.itemsize)
        self.k[f"restrict{g}"](self._grid(n * g), (THREADS,),
                               (np.int64(n), indptr, indices, data, b, x, p_indptr, p_indices,
                                p_data, bc))

    def prolong(self, n: int, p_indptr: Any, p_indices: Any, p_data: Any, xc: Any,
                x: Any) -> None:
        g = group_size(n, p_data.shape[0], p_data.dtype.itemsize)
        self.k[f"prolong{g}"](self._grid(n * g), (THREADS,),
                              (np.int64(n), p_indptr, p_indices, p_data, xc, x))

    def dense(self, m: int, inv: Any, b: Any, x: Any) -> None:
        self.k["dense"](self._grid(m * 32), (THREADS,), (np.int64(m), inv, b, x))

    def zero(self, n: int, v: Any) -> None:
        self.k["zero"](self._grid(n), (THREADS,), (np.int64(n), v))


# ---------------------------------------------------------------- the CG loop's kernels

@functools.cache
def loop_source() -> str:
    """``cycle.cu`` (its row helpers) followed by the CG loop's ``pcg.cu``."""
    return source() + Path(__file__).with_name("pcg.cu").read_text(encoding="utf-8")


def loop_instantiations(T: str, C: str) -> dict[str, str]:  # noqa: N803 - the C++ names
    """Kernel key -> C++ name of the loop's kernels, loop type ``T`` and cycle type ``C``."""
    names = {"update": f"pcg_update<{T}, {C}>", "dot": f"pcg_dot<{T}, {C}>",
             "pupdate": f"pcg_pupdate<{T}, {C}>", "scalars": "pcg_scalars"}
    for g in GROUPS:
        names[f"spmv_dot{g}"] = f"pcg_spmv_dot<{T}, {g}>"
        names[f"residual{g}"] = f"pcg_residual<{T}, {C}, {g}>"
    return names


class LoopCudaOps:
    """Launches of the CG loop's kernels (``pcg.cu``), loop dtype ``dtype``, cycle dtype ``cdtype``.

    The interface of :class:`~.twins.LoopTwinOps`; ``s`` is the loop's float64
    scalar array on the device.
    """

    def __init__(self, dtype: Any, cdtype: Any, device_id: int):
        names = loop_instantiations(_TYPES[np.dtype(dtype)], _TYPES[np.dtype(cdtype)])
        self.k = _backend.raw_kernels(device_id, loop_source(), names)
        self.blocks = cuda.sm_count(device_id) * 8 * WAVES

    def _grid(self, threads: int) -> tuple[int]:
        return (max(1, min(math.ceil(threads / THREADS), self.blocks)),)

    def spmv_dot(self, n: int, indptr: Any, indices: Any, data: Any, p: Any, q: Any,
                 s: Any) -> None:
        g = group_size(n, data.shape[0], data.dtype.itemsize)
        self.k[f"spmv_dot{g}"](self._grid(n * g), (THREADS,),
                               (np.int64(n), indptr, indices, data, p, q, s))

    def residual(self, n: int, indptr: Any, indices: Any, data: Any, b: Any, x: Any, r: Any,
                 rc: Any, s: Any) -> None:
        g = group_size(n, data.shape[0], data.dtype.itemsize)
        self.k[f"residual{g}"](self._grid(n * g), (THREADS,),
                               (np.int64(n), indptr, indices, data, b, x, r, rc, s))

    def update(self, n: int, x: Any, p: Any, r: Any, rc: Any, q: Any, s: Any) -> None:
        self.k["update"](self._grid(n), (THREADS,), (np.int64(n), x, p, r, rc, q, s))

    def dot(self, n: int, r: Any, z: Any, s: Any) -> None:
        self.k["dot"](self._grid(n), (THREADS,), (np.int64(n), r, z, s))

    def scalars(self, s: Any) -> None:
        self.k["scalars"]((1,), (32,), (s,))

    def pupdate(self, n: int, z: Any, p: Any, s: Any) -> None:
        self.k["pupdate"](self._grid(n), (THREADS,), (np.int64(n), z, p, s))
