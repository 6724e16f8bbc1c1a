"""The batched core's CUDA sources: loading, compilation (CuPy ``RawModule``), launch geometry.

The kernels live in ``common.cuh`` (device helpers), ``cg_bicgstab.cu`` and
``gmres.cu`` beside this module; they are compiled as one translation unit,
once per device and (value, index) dtype pair. C++ templates are
instantiated through CuPy's name expressions (:func:`instantiations`).

Also here: what a GPU solve keeps alive for work still queued when it
returns (:class:`RetiredQueue`, :func:`release_done`).
"""

from __future__ import annotations

import functools
import math
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from ... import _backend

#: Source files, in the order they are concatenated into one translation unit.
SOURCE_FILES = ("common.cuh", "cg_bicgstab.cu", "gmres.cu")
#: Threads per block of the row kernels.
THREADS = 256

_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
_B = ("false", "true")


@functools.cache
def source() -> str:
    """The CUDA C++ text of the batched kernels (the files of SOURCE_FILES, joined)."""
    here = Path(__file__)
    return "".join(here.with_name(name).read_text(encoding="utf-8") for name in SOURCE_FILES)


def compile_options(*, contiguous_rows: bool = True) -> tuple[str, ...]:
    """NVRTC options: C++17 and the row layout of the kernels with sums.

    ``contiguous_rows`` (the library's layout): several systems' row loops
    give each warp a contiguous run of rows; off, grid-stride steps (kept
    for the layout diagnostic in ``benchmarks/``).
    """
    return ("-std=c++17", f"-DMS_CONTIGUOUS={int(contiguous_rows)}")


def instantiations(T: str, I: str) -> dict[str, str]:  # noqa: E741 - the C++ template's name
    """Kernel name -> C++ name expression for one (value, index) type pair."""
    names: dict[str, str] = {}
    for s in (0, 1):
        for j in (0, 1):
            for x in (0, 1):
                names[f"init{s}{j}{x}"] = f"ms_init<{T}, {I}, {_B[s]}, {_B[j]}, {_B[x]}>"
            names[f"cg_update{s}{j}"] = f"ms_cg_update<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_direction{s}{j}"] = f"ms_bicg_direction<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_update_s{s}{j}"] = f"ms_bicg_update_s<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_update_r{s}{j}"] = f"ms_bicg_update_r<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"cg_spmv{s}{j}"] = f"ms_cg_spmv<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_spmv_v{s}{j}"] = f"ms_bicg_spmv_v<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_spmv_t{s}{j}"] = f"ms_bicg_spmv_t<{T}, {I}, {_B[s]}, {_B[j]}>"
        names[f"cg_direction{s}"] = f"ms_cg_direction<{T}, {I}, {_B[s]}>"
        names[f"residual{s}"] = f"ms_residual<{T}, {I}, {_B[s]}>"
    names["zero_x"] = f"ms_zero_x<{T}>"
    for j in (0, 1):
        names[f"gmres_spmv{j}"] = f"ms_gmres_spmv<{T}, {I}, {_B[j]}>"
        names[f"gmres_combine{j}"] = f"ms_gmres_combine<{T}, {_B[j]}>"
        names[f"gmres_dots{j}"] = f"ms_gmres_dots<{T}, {_B[j]}>"
    names["gmres_scale"] = f"ms_gmres_scale<{T}>"
    # extern "C" kernels go through name expressions too: their lowered name is their own.
    names["init_status"] = "ms_init_status"
    names["bicg_check"] = "ms_bicg_check"
    return names


def type_names(dtype: Any, index_dtype: Any) -> tuple[str, str]:
    """The C++ names of a (value, index) dtype pair, e.g. ``("double", "int")``."""
    return _TYPES[np.dtype(dtype)], _TYPES[np.dtype(index_dtype)]


def compile_module(device_id: int, dtype: Any, index_dtype: Any, *,
                   contiguous_rows: bool = True) -> dict[str, Any]:
    """Compile the kernels for one device and dtype pair (uncached; see :func:`kernels`)."""
    cp = _backend.cupy()
    names = instantiations(*type_names(dtype, index_dtype))
    with cp.cuda.Device(device_id):
        mod = cp.RawModule(code=source(), options=compile_options(contiguous_rows=contiguous_rows),
                           name_expressions=list(names.values()))
        return {k: mod.get_function(v) for k, v in names.items()}


_lock = threading.Lock()
_modules: dict[tuple, dict[str, Any]] = {}


def raw_kernels(device_id: int, code: str, names: dict[str, str],
                options: tuple[str, ...] = ("-std=c++17",)) -> dict[str, Any]:
    """Kernels of another CUDA source (e.g. the AMG cycle's), compiled once per device, cached.

    ``names`` maps a key to a C++ name expression (template instantiations
    included); the result maps the same keys to CuPy ``RawKernel`` objects.
    """
    key = (int(device_id), code, tuple(sorted(names.items())), tuple(options))
    with _lock:
        if key not in _modules:
            cp = _backend.cupy()
            with cp.cuda.Device(device_id):
                mod = cp.RawModule(code=code, options=options,
                                   name_expressions=list(names.values()))
                _modules[key] = {k: mod.get_function(v) for k, v in names.items()}
        return _modules[key]


def kernels(device_id: int, dtype: Any, index_dtype: Any) -> dict[str, Any]:
    """Compiled kernels for one device and (value, index) dtype pair; compiled once, cached."""
    key = (int(device_id), np.dtype(dtype).str, np.dtype(index_dtype).str)
    with _lock:
        if key not in _modules:
            _modules[key] = compile_module(device_id, dtype, index_dtype)
        return _modules[key]


@functools.cache
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a GPU."""
    cp = _backend.cupy()
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


def grid_rows(n: int, device_id: int) -> int:
    """Blocks for a grid-stride row kernel: one full wave (8 blocks of 256 per SM) at most."""
    return max(1, min(math.ceil(n / THREADS), sm_count(device_id) * 8))


def pinned(nbytes: int, dtype: Any, keep: list) -> np.ndarray:
    """A NumPy array over ``nbytes`` of page-locked memory (kept alive by ``keep``)."""
    return _backend.pinned_empty(nbytes // np.dtype(dtype).itemsize, dtype, keep)


class RetiredQueue:
    """Objects kept alive until the GPU work queued before an event has finished.

    A solve that returns with masked iterations still queued (after
    convergence) hands its workspace, graphs and page-locked buffers here;
    they are dropped once the event recorded after that work is done.
    ``event`` needs only a ``done`` attribute.
    """

    def __init__(self) -> None:
        self._items: deque = deque()
        self._lock = threading.Lock()

    def retire(self, event: Any, keep: list) -> None:
        """Keep ``keep`` alive until ``event`` is done."""
        with self._lock:
            self._drop_done()
            self._items.append((event, keep))

    def release_done(self) -> None:
        """Drop what was kept for work that has finished (in any order of completion)."""
        if self._items:
            with self._lock:
                self._drop_done()

    def held(self) -> list:
        """What is still kept (one list per retirement, oldest first)."""
        with self._lock:
            return [keep for _event, keep in self._items]

    def __len__(self) -> int:
        return len(self._items)

    def _drop_done(self) -> None:
        live = [(e, k) for e, k in self._items if not e.done]
        self._items.clear()
        self._items.extend(live)


#: The process's queue: every GPU solve of the batched core retires into it.
RETIRED = RetiredQueue()


def retire(event: Any, keep: list) -> None:
    """Keep ``keep`` alive until ``event`` (recorded after queued work) is done."""
    RETIRED.retire(event, keep)


def release_done() -> None:
    """Drop what GPU solves kept alive for work that has finished (cheap when nothing is kept).

    Called at each solve's start, and by callers after a read that waited
    for a solve's stream (the queued masked iterations are then done).
    """
    RETIRED.release_done()
