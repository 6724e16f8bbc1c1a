"""The batched core's CUDA sources: loading, compilation (CuPy ``RawModule``), launch geometry.

The kernels live in ``common.cuh`` (device helpers), ``cg_bicgstab.cu`` (the
row kernels), ``cg_blocks.cu`` (CG with a block per system) and ``gmres.cu``
beside this module; they are compiled as one translation unit,
once per device, (value, index) dtype pair and method family ("cg",
"bicgstab" or "gmres"), so a call compiles only the templates its method
launches. C++ templates are instantiated through CuPy's name expressions
(:func:`instantiations`); CuPy keeps each compiled module in its on-disk
cache (``CUPY_CACHE_DIR``, by default ``~/.cupy/kernel_cache``), so a later
process loads it instead of compiling. :func:`prefetch_kernels` compiles (or loads)
on a helper thread: NVRTC runs without the GIL, beside the caller's
validation and packing.

Also here: what a GPU solve keeps alive for work still queued when it
returns (:class:`RetiredQueue`, :func:`release_done`).
"""

from __future__ import annotations

import functools
import math
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ... import _backend

#: Source files, in the order they are concatenated into one translation unit.
SOURCE_FILES = ("common.cuh", "cg_bicgstab.cu", "cg_blocks.cu", "gmres.cu")
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


#: The method families, each compiled as its own module (:func:`instantiations`),
#: and the block-per-system CG kernels that keep their vectors in device
#: memory ("cg_blocks": compiled only when a batch's largest system does not
#: fit in shared memory; the "cg" module holds the shared-memory ones).
FAMILIES = ("cg", "bicgstab", "gmres", "cg_blocks")


def family_of(method: str) -> str:
    """The module family whose kernels a batched ``method`` launches ("cg" for unknown ones)."""
    return method if method in FAMILIES else "cg"


def instantiations(T: str, I: str, family: str | None = None) -> dict[str, str]:  # noqa: E741
    """Kernel name -> C++ name expression for one (value, index) type pair.

    ``family`` ("cg", "bicgstab" or "gmres") keeps the kernels that method
    launches, plus the residual kernel every batch's check uses; None keeps
    all of them. NVRTC compiles only the templates named here, so one
    family costs a fraction of the whole set.
    """
    names: dict[str, str] = {}
    for s in (0, 1):
        for j in (0, 1):
            for x in (0, 1):
                names[f"init{s}{j}{x}"] = f"ms_init<{T}, {I}, {_B[s]}, {_B[j]}, {_B[x]}>"
            names[f"cg_update{s}{j}"] = f"ms_cg_update<{T}, {I}, {_B[s]}, {_B[j]}>"
            # (s here: whether the systems have x0; one block per system, its
            # vectors in device memory or, h, in shared memory)
            for h in (0, 1):
                names[f"cg_blocks{j}{s}{h}"] = f"ms_cg_blocks<{T}, {I}, {_B[j]}, {_B[s]}, {_B[h]}>"
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
    if family is None:
        return names
    if family not in FAMILIES:
        raise ValueError(f"instantiations(family={family!r}): expected one of {FAMILIES} or None")
    in_memory = {k for k in names if k.startswith("cg_blocks") and k.endswith("0")}
    if family == "cg_blocks":
        return {k: names[k] for k in sorted(in_memory)}
    prefixes = {"cg": ("init", "cg_", "zero_x", "residual"),
                "bicgstab": ("init", "bicg_", "zero_x", "residual"),
                "gmres": ("gmres_", "residual")}[family]
    return {k: v for k, v in names.items() if k.startswith(prefixes) and k not in in_memory}


def type_names(dtype: Any, index_dtype: Any) -> tuple[str, str]:
    """The C++ names of a (value, index) dtype pair, e.g. ``("double", "int")``."""
    return _TYPES[np.dtype(dtype)], _TYPES[np.dtype(index_dtype)]


def compile_module(device_id: int, dtype: Any, index_dtype: Any, *,
                   contiguous_rows: bool = True, family: str | None = None) -> dict[str, Any]:
    """Compile the kernels for one device and dtype pair (uncached; see :func:`kernels`).

    ``family`` as in :func:`instantiations` (None: every kernel).
    """
    cp = _backend.cupy()
    names = instantiations(*type_names(dtype, index_dtype), family)
    with cp.cuda.Device(device_id):
        mod = cp.RawModule(code=source(), options=compile_options(contiguous_rows=contiguous_rows),
                           name_expressions=list(names.values()))
        return {k: mod.get_function(v) for k, v in names.items()}


def _key(device_id: int, dtype: Any, index_dtype: Any, family: str) -> tuple:
    if family not in FAMILIES:
        raise ValueError(f"kernels(family={family!r}): expected one of {FAMILIES}")
    return (int(device_id), np.dtype(dtype).str, np.dtype(index_dtype).str, family)


class ModuleCache:
    """Compiled modules, one per (device, dtype, index dtype, family), each compiled once.

    A thread asking for a module another thread is compiling waits for that
    compilation only (one future per key). ``compiler`` is called as
    ``compiler(device_id, dtype, index_dtype, family=family)`` and returns
    the module's kernels by key (by default :func:`compile_module`). The
    process keeps one cache, behind :func:`kernels`, :func:`loaded`,
    :func:`loaded_modules` and :func:`prefetch_kernels`; a cache of one's
    own, with another ``compiler``, shows the caching without a GPU.

    Examples
    --------
    >>> cache = ModuleCache(lambda dev, dt, it, *, family: {"family": family})
    >>> cache.kernels(0, "float64", "int32", "cg"), cache.loaded_modules()
    ({'family': 'cg'}, ['cg double/int on cuda:0'])
    """

    def __init__(self, compiler: Callable[..., dict[str, Any]] = compile_module):
        self.compiler = compiler
        self._lock = threading.Lock()
        self._futures: dict[tuple, Future] = {}

    def kernels(self, device_id: int, dtype: Any, index_dtype: Any, family: str = "cg") -> dict[str, Any]:
        """The module's kernels, compiled at the first call; a failed compilation is not kept."""
        key = _key(device_id, dtype, index_dtype, family)
        with self._lock:
            fut = self._futures.get(key)
            owner = fut is None
            if owner:
                fut = self._futures[key] = Future()
        if owner:
            try:
                fut.set_result(self.compiler(device_id, dtype, index_dtype, family=family))
            except BaseException as exc:
                with self._lock:
                    self._futures.pop(key, None)
                fut.set_exception(exc)
                raise
        return fut.result()

    def loaded(self, device_id: int, dtype: Any, index_dtype: Any, family: str) -> bool:
        """Whether the module is here already (compiled or loaded, not in progress)."""
        with self._lock:
            fut = self._futures.get(_key(device_id, dtype, index_dtype, family))
        return fut is not None and fut.done() and fut.exception() is None

    def loaded_modules(self) -> list[str]:
        """The modules here, as ``"cg double/int on cuda:0"``."""
        names = {"<f4": "float", "<f8": "double", "<i4": "int", "<i8": "long long"}
        with self._lock:
            done = [k for k, f in self._futures.items() if f.done() and f.exception() is None]
        return sorted(f"{fam} {names.get(dt, dt)}/{names.get(it, it)} on cuda:{dev}"
                      for dev, dt, it, fam in done)

    def prefetch(self, device_ids: Any, dtype: Any, index_dtype: Any,
                 families: tuple[str, ...] = ("cg",)) -> threading.Thread | None:
        """Compile (or load) modules on a helper thread; see :func:`prefetch_kernels`."""
        ids = [int(device_ids)] if np.ndim(device_ids) == 0 else [int(d) for d in device_ids]
        wanted = [(d, f) for d in ids for f in families if not self.loaded(d, dtype, index_dtype, f)]
        if not wanted:
            return None

        def run() -> None:
            for d, f in wanted:
                try:
                    self.kernels(d, dtype, index_dtype, f)
                except Exception:  # reported by the solve that needs it
                    continue

        t = threading.Thread(target=run, name="managed_solve-cuda-prefetch", daemon=True)
        t.start()
        return t


# The process's modules: compiled once per process (CuPy's disk cache then
# spares later processes the compilation).
_MODULES = ModuleCache()


def kernels(device_id: int, dtype: Any, index_dtype: Any, family: str = "cg") -> dict[str, Any]:
    """Compiled kernels of one method family for one device and (value, index) dtype pair.

    Compiled (or loaded from CuPy's disk cache) once per process; a thread
    asking while another compiles the same module waits for it. A failed
    compilation is not kept: the next call tries again and raises.
    """
    return _MODULES.kernels(device_id, dtype, index_dtype, family)


def loaded(device_id: int, dtype: Any, index_dtype: Any, family: str) -> bool:
    """Whether this process has the module already (compiled or loaded, not in progress)."""
    return _MODULES.loaded(device_id, dtype, index_dtype, family)


def loaded_modules() -> list[str]:
    """The modules this process has, as ``"cg double/int on cuda:0"``."""
    return _MODULES.loaded_modules()


def prefetch_kernels(device_ids: Any, dtype: Any, index_dtype: Any,
                     families: tuple[str, ...] = ("cg",)) -> threading.Thread | None:
    """Compile (or load) modules on a helper thread, so a later :func:`kernels` finds them ready.

    NVRTC and the module load run without the GIL, so the caller's
    validation, symmetry tests and packing go on meanwhile. Devices (an id
    or a list) go one after another: the first compiles, the others (of the
    same architecture) load what CuPy's disk cache then holds. Errors are
    dropped here: the solve that needs the module compiles it again and
    reports them. Returns the thread, or None when every module is loaded.
    """
    return _MODULES.prefetch(device_ids, dtype, index_dtype, families)


@functools.cache
def sm_count(device_id: int) -> int:
    """Streaming multiprocessors of a GPU."""
    cp = _backend.cupy()
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.cache
def shared_bytes_optin(device_id: int) -> int:
    """Shared memory one block may ask for on a GPU (static and dynamic together)."""
    cp = _backend.cupy()
    return int(cp.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"])


#: Shared memory a block per system declares itself (its sums and its claim),
#: with room to spare, on top of the dynamic part holding the system's vectors.
BLOCK_STATIC_SHARED = 2048


def block_shared_bytes(max_rows: int, itemsize: int, device_id: int) -> int:
    """Dynamic shared memory for a block per system to keep p, q and x there, or 0 when they do not fit."""
    need = 3 * int(max_rows) * int(itemsize)
    return need if need + BLOCK_STATIC_SHARED <= shared_bytes_optin(device_id) else 0


def grid_rows(n: int, device_id: int) -> int:
    """Blocks for a grid-stride row kernel: one full wave (8 blocks of 256 per SM) at most."""
    return max(1, min(math.ceil(n / THREADS), sm_count(device_id) * 8))


def row_launch(device_id: int, dtype: Any, index_dtype: Any, family: str, n: int
               ) -> tuple[dict[str, Any], int]:
    """What a sequence of row kernels over ``n`` rows needs: the family's kernels and the grid.

    :func:`kernels` and :func:`grid_rows` in one call (a workspace asks for both).
    """
    return kernels(device_id, dtype, index_dtype, family), grid_rows(n, device_id)


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
