"""``warmup``: compile (or load from the disk caches) what the default solve paths run, ahead of need.

The first ``solve_many`` of a process pays for compilation: the host
kernels (Numba, kept in Numba's on-disk cache afterwards) and, on a GPU, the
batched core's CUDA modules and CuPy's own kernels (kept in CuPy's cache).
A container image or a cluster worker can pay it once at start with
:func:`warmup` (or ``managed-solve warmup``); later processes on the same
caches load instead of compiling.

Also here: which of the package's Numba kernels a piece of work compiled
and which it loaded from the cache (:func:`jit_snapshot`,
:func:`compiled_since`), read from the dispatchers' cache statistics.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from . import _backend, config
from ._solve_many import solve_many
from ._threads import row_threads
from .manager import DeviceManager
from .scheduling.validate import MIN_ARRAYS
from .system import LinearSystem

#: The methods whose batched kernels :func:`warmup` prepares by default.
METHODS = ("cg", "bicgstab", "gmres")
#: Those with a row-parallel layout for one large system on the CPU.
ROW_LAYOUT_METHODS = ("cg", "bicgstab")


# ------------------------------------------------------------------ Numba bookkeeping
def _jit_functions() -> dict:
    """The package's Numba dispatchers by ``module.name`` (among the modules imported)."""
    out = {}
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("managed_solve") or mod is None:
            continue
        for name, obj in list(vars(mod).items()):
            if hasattr(obj, "py_func") and hasattr(obj, "signatures") and hasattr(obj, "stats"):
                out[f"{modname.rsplit('.', 1)[-1]}.{name}"] = obj
    return out


def jit_snapshot() -> dict[str, tuple[int, int]]:
    """``{kernel: (compiled signatures, cache hits)}`` for the package's Numba kernels now."""
    counts = {}
    for name, d in _jit_functions().items():
        counts[name] = (len(d.signatures), sum(d.stats.cache_hits.values()))
    return counts


def compiled_since(before: dict[str, tuple[int, int]]) -> dict[str, list[str]]:
    """The package's Numba kernels typed since ``before``: compiled, or loaded from Numba's cache.

    Numba compiles a kernel for its argument types on first use and keeps the
    machine code in its on-disk cache (``cache=True``), so a later process
    loads it instead; the dispatchers' cache statistics tell the two apart.
    """
    compiled, loaded = [], []
    for name, (sigs, hits) in jit_snapshot().items():
        sigs0, hits0 = before.get(name, (0, 0))
        if sigs > sigs0:
            (loaded if hits > hits0 else compiled).append(name)
    return {"compiled": sorted(compiled), "loaded_from_cache": sorted(loaded)}


def numba_cache_dir() -> str | None:
    """Where Numba keeps the package's compiled kernels (None before any is cached)."""
    from .kernels import krylov

    cache = getattr(krylov.cg_some, "_cache", None)
    return getattr(cache, "_cache_path", None)


def cupy_cache_dir() -> str:
    """Where CuPy keeps compiled CUDA modules (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``)."""
    return config.environment(config.ENV_CUPY_CACHE_DIR) or os.path.join(os.path.expanduser("~"), ".cupy",
                                                            "kernel_cache")


def _files(path: str) -> int:
    return sum(len(f) for _, _, f in os.walk(path)) if os.path.isdir(path) else 0


# ------------------------------------------------------------------ model systems
def _poisson(m: int, dtype: Any) -> Any:
    """The 5-point Laplacian on an m x m grid (SPD): the auto policy sends it to CG."""
    import scipy.sparse as sp

    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return sp.kronsum(T, T, format="csr").astype(dtype)


def _convection(m: int, dtype: Any) -> Any:
    """The Laplacian plus an upwind convection term (non-symmetric): BiCGStab's and GMRES's case."""

    A = _poisson(m, np.float64).tolil()
    n = m * m
    for i in range(1, n):
        A[i, i - 1] -= 0.3
        A[i, i] += 0.3
    return A.tocsr().astype(dtype)


def _systems(method: str, dtype: Any) -> list:
    """Systems with a matrix each, enough that validation and the auto policy take their
    many-matrix kernels (``scheduling.validate``), as a call of many systems does."""
    make = _poisson if method == "cg" else _convection
    count = -(-MIN_ARRAYS // 2)  # each system brings two arrays (A's entries, b)
    return [(make(m, dtype), np.ones(m * m, dtype=dtype)) for m in (40, 44) * (-(-count // 2))]


# ------------------------------------------------------------------ warmup
def _devices(device: Any) -> list[str]:
    """Device names to warm: None -> the CPU and every usable GPU."""
    if device is None or device == "all":
        names = ["cpu"]
        n, _ = _backend.cuda_probe()
        names += [f"cuda:{i}" for i in range(n)] if _backend.cuda_usable() else []
        return names
    if isinstance(device, str) and device == "cuda":
        n, why = _backend.cuda_probe()
        if n == 0:  # asked for the GPUs: none is nothing warmed, not success
            raise ValueError(f"warmup(device='cuda'): no usable CUDA GPU here ({why or 'none found'}); "
                             "warm the CPU with device='cpu', or leave device out.")
        return [f"cuda:{i}" for i in range(n)]
    if isinstance(device, str):
        names = [s.strip() for s in device.split(",") if s.strip()]
    elif isinstance(device, Iterable):
        names = [str(d) for d in device]
    else:
        names = [str(device)]
    if not names:
        raise ValueError(f"warmup(device={device!r}): names no device; give 'cpu', 'cuda', "
                         "'cuda:i' or a list of them, or leave device out (the CPU and every GPU).")
    return names


def warmup(device: Any = None, methods: Iterable[str] = METHODS, *,
           dtypes: Iterable[Any] = (np.float64,), progress: Any = None) -> list[dict]:
    """Compile, or load from the disk caches, the kernels the default solve paths use.

    For each device, a few small systems go through :func:`solve_many` with
    each method in ``methods`` (the "auto" policy's symmetry tests, the
    packing, the batched kernels, the true-residual check, and, on hosts
    where large systems sweep their rows on several threads, that layout);
    on a GPU the
    batched core's CUDA modules of those methods are compiled first, then
    CuPy's kernels through the same calls. What is compiled stays in Numba's
    and CuPy's on-disk caches, so later processes on this machine (or image)
    load it instead of compiling.

    Parameters
    ----------
    device : str, list of str or None
        ``"cpu"``, ``"cuda:1"``, ``"cuda"`` (every GPU), a comma-separated
        list or a list; None or ``"all"``: the CPU and every usable GPU.
    methods : iterable of {"cg", "bicgstab", "gmres"}
        The batched methods to prepare ("auto" ends in CG for symmetric
        matrices with a positive diagonal, in BiCGStab otherwise).
    dtypes : iterable of dtypes
        Value dtypes (float64, float32) to compile for.
    progress : callable, optional
        Called with each step's record as it finishes (the CLI prints them).

    Returns
    -------
    list of dict
        One record per step: ``device``, ``step``, ``seconds``, ``compiled``
        and ``loaded_from_cache`` (the Numba kernels by name), and for a CUDA
        module ``cuda_module`` ("compiled" or "loaded from cache").

    Raises
    ------
    ValueError
        An unknown method or device.

    Examples
    --------
    >>> import managed_solve as ms
    >>> steps = ms.warmup("cpu", methods=["cg"])
    >>> [s["step"] for s in steps]
    ['cg (float64)']
    >>> steps[0]["seconds"] >= 0.0
    True
    """
    methods, dtypes = list(methods), list(dtypes)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"warmup(methods={methods!r}): {f'unknown {bad}' if bad else 'names nothing'}; "
                         f"expected some of {METHODS}")
    floats = (np.dtype(np.float32), np.dtype(np.float64))
    try:
        dts = [np.dtype(d) for d in dtypes]
    except TypeError:
        dts = []
    if not dts or any(d not in floats for d in dts):
        raise ValueError(f"warmup(dtypes={dtypes!r}): expected float64 and/or float32")
    steps: list[dict] = []

    def record(**step: Any) -> None:
        steps.append(step)
        if progress is not None:
            progress(step)

    for name in _devices(device):
        manager = DeviceManager([name] if name == "cpu" else [name, "cpu"])
        dev = manager.get_device(name)
        if dev.is_cuda:
            from .solvers.batched import cuda

            cache = cupy_cache_dir()
            for dt in dts:
                # CG's block kernels for systems too large for shared memory come too.
                families = [(m, cuda.family_of(m)) for m in methods]
                families += [("cg, larger blocks", "cg_blocks")] if "cg" in methods else []
                for m, family in families:
                    files, t0 = _files(cache), time.perf_counter()
                    cuda.kernels(dev.index, dt, np.int32, family)
                    fresh = _files(cache) > files
                    record(device=name, step=f"CUDA module {m} ({dt.name})",
                           seconds=time.perf_counter() - t0, compiled=[], loaded_from_cache=[],
                           cuda_module="compiled" if fresh else "loaded from cache")
            # The compaction list of a GPU batch whose systems finish at different
            # iterations: the small systems below all finish together, so never build it.
            from .kernels.packing import active_rows

            before, t0 = jit_snapshot(), time.perf_counter()
            active_rows(np.zeros(1, np.int64), np.ones(1, np.int64), np.empty(1, np.int32))
            record(device=name, step="compaction rows", seconds=time.perf_counter() - t0,
                   **compiled_since(before))
        for dt in dts:
            for m in methods:
                before, t0 = jit_snapshot(), time.perf_counter()
                systems = _systems(m, dt)
                # "auto" first (its symmetry tests; on the CPU it may pick an LU),
                # then the method itself, batched.
                for how in ("auto", m) if m != "gmres" else (m,):
                    solve_many(systems, manager=manager, devices=name, method=how,
                               return_on="host")
                if dev.kind == "cpu" and m in ROW_LAYOUT_METHODS and row_threads(1 << 40) > 1:
                    # On this host one large system alone sweeps its rows on
                    # several threads: that layout's kernel too.
                    from .solvers.batched.cpu import warm_row_layout

                    warm_row_layout(LinearSystem(*systems[0], method=m), m)
                record(device=name, step=f"{m} ({dt.name})", seconds=time.perf_counter() - t0,
                       **compiled_since(before))
    return steps


def describe(step: dict) -> str:
    """One line of text for a step of :func:`warmup`."""
    what = []
    if step.get("cuda_module"):
        what.append(step["cuda_module"])
    if step["compiled"]:
        what.append(f"compiled {len(step['compiled'])} Numba kernels ({', '.join(step['compiled'])})")
    if step["loaded_from_cache"]:
        what.append(f"loaded {len(step['loaded_from_cache'])} from Numba's cache")
    if not what:
        what.append("nothing new to compile")
    return f"{step['device']:8s} {step['step']:28s} {step['seconds']:6.2f} s  " + "; ".join(what)
