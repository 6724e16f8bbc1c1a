"""Devices and discovery: CUDA GPUs (CuPy, NVML), the CPU, simulated GPUs.

Discovery never crashes: no CuPy, no driver, no NVML or a broken CUDA library
each give a CPU-only inventory. On a machine where an NVIDIA GPU is present
that is a surprise, so it warns once (:class:`DeviceWarning`) with the reason
and the fix; elsewhere it logs the reason at INFO. Free memory is
read device-wide (NVML, else ``cudaMemGetInfo``), not from this process's
allocator pool, so memory held by other processes counts.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from . import _backend
from .config import ENV_DEVICES, ENV_SIMULATE, environment

log = logging.getLogger("managed_solve")

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1000,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1000**2,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1000**3,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1000**4,
    "TIB": 1 << 40,
}

# Relative speed used to predict time before anything has been measured:
# bytes per second a memory-bound sparse solve streams. Learned hints refine it.
_DEFAULT_CPU_BANDWIDTH = 10e9
_DEFAULT_GPU_BANDWIDTH = 2.0e12


class DeviceWarning(UserWarning):
    """Work runs somewhere other than where the user likely expects it (the CPU instead of a GPU)."""


_WARNED: set[str] = set()  # keys already warned about in this process
_WARNED_LOCK = threading.Lock()


def caller_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` called from here that names the first frame
    outside this package: the user's line, whatever depth the library reached it from (a
    worker thread has none: its outermost frame is named)."""
    package = __name__.rsplit(".", 1)[0] + "."
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> bool:
    """Issue ``message`` as a :class:`DeviceWarning` the first time ``key`` is seen in this process.

    A fallback that repeats on every call (each spill, each ``.cuda()``) would
    bury the first, useful warning; one per cause is enough to act on.
    Returns True when the warning was issued.
    """
    with _WARNED_LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    warnings.warn(message, DeviceWarning, stacklevel=stacklevel)
    return True


def forget_warnings() -> None:
    """Let every :func:`warn_once` key warn again (tests; a long-lived process after a fix)."""
    with _WARNED_LOCK:
        _WARNED.clear()


def nvidia_gpu_present() -> bool:
    """True when the machine has an NVIDIA GPU, whether or not CUDA is usable from here.

    Cheap and import-free: the kernel driver's ``/proc/driver/nvidia/gpus``
    entries, else ``nvidia-smi`` on ``PATH``.
    """
    try:
        if os.listdir("/proc/driver/nvidia/gpus"):
            return True
    except OSError:
        pass
    return shutil.which("nvidia-smi") is not None


def cpu_fallback_fix(why: str) -> str:
    """What to do about ``why`` (a :func:`managed_solve._backend.cuda_probe` reason)."""
    if "not installed" in why:
        return ('install CuPy for your CUDA driver: pip install "managed-solve[cuda12]" '
                '(or "managed-solve[cuda13]"; `nvidia-smi` shows the driver\'s CUDA version)')
    if "driver" in why or "no CUDA devices" in why:
        return ("check that `nvidia-smi` lists the GPU, that CUDA_VISIBLE_DEVICES does not hide it, "
                "and that the CuPy package matches the driver's CUDA major version "
                "(cupy-cuda12x or cupy-cuda13x)")
    return ("reinstall CuPy for your CUDA version (pip install --force-reinstall cupy-cuda12x, "
            "or cupy-cuda13x) and check `python -c \"import cupyx.scipy.sparse.linalg\"`")


def warn_cpu_fallback(why: str) -> None:
    """Warn once that an NVIDIA GPU is present but work runs on the CPU, with the fix."""
    warn_once("cpu-fallback",
              f"managed_solve: an NVIDIA GPU is present but every solve runs on the CPU: {why}. "
              f"Fix: {cpu_fallback_fix(why)}. `managed-solve info` shows the devices found.",
              stacklevel=4)


def parse_bytes(text: str, *, what: str = "size") -> int:
    """``"2GiB"`` -> 2147483648. Binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units; a bare number is bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(
            f"{what}: cannot read {text!r} as a size; write a number with a unit, "
            "for example '2GiB', '512MiB' or '4GB'."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _nvml_free_bytes(handle: Any) -> int:
    nvml = _nvml()
    if nvml is None:
        raise RuntimeError("NVML is unavailable")
    return int(nvml.nvmlDeviceGetMemoryInfo(handle).free)


@dataclass(frozen=True)
class MemoryQuery:
    """How a CUDA GPU's free memory is read: the CUDA runtime where this process has a context, else NVML.

    Both read device-wide free memory (other processes' allocations count).
    ``cudaMemGetInfo`` answers in microseconds but needs a CUDA context on the
    device; NVML needs none, but its first query in a process takes a tenth
    of a second. So the runtime answers once this process opened the
    device's context (:func:`managed_solve._backend.open_cuda_context`, which
    a GPU run of ``solve_many`` starts first), waiting for a context still
    being made; NVML answers elsewhere, so asking never makes a context on a
    GPU the process does not use.

    Parameters
    ----------
    context : callable
        ``context(index)``: the future of the device's context, or None when
        this process never opened it.
    runtime_free : callable
        ``runtime_free(index)``: ``cudaMemGetInfo``'s free bytes.
    nvml_free : callable
        ``nvml_free(handle)``: NVML's free bytes for a device handle.

    Examples
    --------
    >>> from concurrent.futures import Future
    >>> opened = Future(); opened.set_result(0)
    >>> asked = []
    >>> query = MemoryQuery(context=lambda i: opened, runtime_free=lambda i: asked.append("runtime") or 7,
    ...                     nvml_free=lambda h: asked.append("nvml") or 5)
    >>> query.free_bytes(0, "handle"), asked
    (7, ['runtime'])
    """

    context: Callable[[int], Any] = _backend.cuda_context
    runtime_free: Callable[[int], int] = _backend.cuda_free_bytes
    nvml_free: Callable[[Any], int] = _nvml_free_bytes

    def free_bytes(self, index: int, nvml_handle: Any = None) -> int:
        """Free bytes of GPU ``index`` (``nvml_handle``: its NVML handle, None without NVML)."""
        opened = self.context(index)
        if opened is not None:
            try:
                opened.result()  # a context still being made: its query would wait as long
            except Exception as exc:  # the context failed: NVML can still answer
                log.debug("no CUDA context on cuda:%d (%s); asking NVML", index, exc)
            else:
                return int(self.runtime_free(index))
        if nvml_handle is not None:
            try:
                return int(self.nvml_free(nvml_handle))
            except Exception as exc:
                log.debug("NVML memory query failed on cuda:%d: %s", index, exc)
        return int(self.runtime_free(index))


@dataclass(eq=False)
class Device:
    """One place where arrays live and solvers run.

    Parameters
    ----------
    kind : {"cpu", "cuda", "sim"}
        ``"sim"`` devices are simulated GPUs: they run on the CPU backend with a
        memory budget, so placement, dispersal, spill and out-of-memory handling
        can be tested on machines without GPUs.
    index : int
        CUDA ordinal for ``"cuda"``; position for ``"sim"``; 0 for the CPU.
    name : str
        Human-readable name (the driver's, e.g. ``"NVIDIA A100-SXM4-80GB"``).
    total_bytes : int
        Memory capacity.
    bandwidth : float
        Bytes per second a memory-bound solve streams; used to predict time
        before measurements exist.

    Examples
    --------
    >>> from managed_solve.devices import cpu_device
    >>> str(cpu_device())
    'cpu'
    """

    kind: str
    index: int
    name: str
    total_bytes: int
    bandwidth: float = _DEFAULT_CPU_BANDWIDTH
    pci_bus_id: str | None = None
    _nvml_handle: object = field(default=None, repr=False)
    #: How free memory is read on a CUDA GPU (tests give stand-ins).
    memory: MemoryQuery = field(default_factory=MemoryQuery, repr=False)
    # Simulated devices: bytes "allocated" on them (tests set it), and an
    # optional fault hook called before each piece of work placed there.
    sim_used_bytes: int = 0
    fault: Callable[[Device, int], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"Device({str(self)!r}, {self.name!r}, total={format_bytes(self.total_bytes)})"

    def __hash__(self) -> int:
        return hash(str(self))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Device):
            return str(self) == str(other)
        if isinstance(other, str):
            return str(self) == other
        return NotImplemented

    @property
    def is_gpu(self) -> bool:
        """True for CUDA and simulated GPUs (the devices work is dispersed over)."""
        return self.kind in ("cuda", "sim")

    @property
    def is_cuda(self) -> bool:
        """True for a real CUDA GPU: its arrays live in device memory, work runs on its streams."""
        return is_cuda_kind(self.kind)

    @property
    def is_simulated(self) -> bool:
        """True for a simulated GPU (placed like a GPU, computed on the host)."""
        return self.kind == "sim"

    def synchronize(self) -> None:
        """Wait for the work queued on this device (a no-op off CUDA)."""
        if self.kind == "cuda":
            _backend.cupy().cuda.Device(self.index).synchronize()

    @property
    def backend(self) -> ModuleType:
        """The array module: numpy for cpu and sim, cupy for cuda."""
        return _backend.cupy() if self.kind == "cuda" else np

    def free_bytes(self) -> int:
        """Device-wide free memory now (other processes' allocations count)."""
        if self.kind == "cpu":
            return _host_available_bytes()
        if self.kind == "sim":
            return max(0, self.total_bytes - self.sim_used_bytes)
        return self.memory.free_bytes(self.index, self._nvml_handle)

    def context(self):
        """A context manager making this device current (a no-op off CUDA)."""
        if self.kind == "cuda":
            return _backend.cupy().cuda.Device(self.index)
        return _NullContext()

    def check_fault(self, nbytes: int) -> None:
        """Raise the injected fault, if any (simulated devices only)."""
        if self.fault is not None:
            self.fault(self, nbytes)


def is_cuda_kind(kind: str) -> bool:
    """True when devices of ``kind`` ("cpu", "cuda", "sim") are real CUDA GPUs.

    Their arrays are CuPy arrays in device memory and work there is launched
    as CUDA kernels; ``"sim"`` devices are placed like GPUs but compute on
    the host. Code off the backend asks this instead of comparing names.
    """
    return kind == "cuda"


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class SimulatedOutOfMemory(MemoryError):
    """Raised by simulated devices to mimic a GPU allocation failure."""


def _host_total_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return _host_total_bytes() // 2


_cpu_singleton: Device | None = None


def cpu_device() -> Device:
    """The host CPU (always present)."""
    global _cpu_singleton
    if _cpu_singleton is None:
        import platform

        name = platform.processor() or platform.machine() or "CPU"
        _cpu_singleton = Device(
            "cpu", 0, f"{name} ({os.cpu_count()} cores)", _host_total_bytes(),
            bandwidth=_DEFAULT_CPU_BANDWIDTH,
        )
    return _cpu_singleton


def _nvml(import_module: Callable[[str], ModuleType] = importlib.import_module):
    """pynvml initialised, or None (no package, no driver)."""
    try:
        mod = import_module("pynvml")
    except Exception:  # ImportError, or a broken library raising at import
        return None
    try:
        mod.nvmlInit()
    except Exception as exc:
        log.debug("NVML unavailable: %s", exc)
        return None
    return mod


def cuda_free_bytes_including_pool(dev: Device) -> int:
    """Free bytes plus what CuPy's pool holds cached on that device (reusable by us)."""
    free = dev.free_bytes()
    cp = _backend.cupy()
    with cp.cuda.Device(dev.index):
        return free + int(cp.get_default_memory_pool().free_bytes())


@dataclass(frozen=True)
class Discovery:
    """Where device discovery looks: this machine by default, stand-ins in tests.

    Parameters
    ----------
    import_module : callable
        ``import_module(name)`` imports ``cupy``, ``cupyx`` and ``pynvml``,
        raising when one cannot be imported (default: :func:`importlib.import_module`).
    gpu_present : callable
        ``gpu_present()`` says whether the machine has an NVIDIA GPU, usable
        or not (default: :func:`nvidia_gpu_present`); then a CPU-only
        inventory warns.

    Examples
    --------
    >>> def no_cupy(name):
    ...     raise ImportError(name)
    >>> Discovery(import_module=no_cupy).probe()
    (0, 'CuPy is not installed')
    >>> [str(d) for d in discover(discovery=Discovery(import_module=no_cupy))]
    ['cpu']
    """

    import_module: Callable[[str], ModuleType] = importlib.import_module
    gpu_present: Callable[[], bool] = nvidia_gpu_present

    def probe(self) -> tuple[int, str]:
        """(usable CUDA GPUs, reason when 0); this machine's is asked once per process."""
        if self.import_module is importlib.import_module:
            return _backend.cuda_probe()
        return _backend.probe_cuda(self.import_module)


def discover_cuda(discovery: Discovery | None = None) -> tuple[list[Device], str]:
    """CUDA GPUs visible to CuPy, with names, memory and NVML handles. Never raises."""
    discovery = discovery if discovery is not None else Discovery()
    n, why = discovery.probe()
    if n == 0:
        return [], why
    cp = discovery.import_module("cupy")
    nvml = _nvml(discovery.import_module)
    out = []
    for i in range(n):
        try:
            props = cp.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            total = int(props["totalGlobalMem"])
            bw = _DEFAULT_GPU_BANDWIDTH
            clock, width = props.get("memoryClockRate", 0), props.get("memoryBusWidth", 0)
            if clock and width:  # kHz, bits; DDR: two transfers a clock
                bw = 2.0 * clock * 1e3 * width / 8 * 0.8
            pci = None
            handle = None
            try:
                pci = cp.cuda.Device(i).pci_bus_id
                if nvml is not None:
                    handle = nvml.nvmlDeviceGetHandleByPciBusId(pci.encode())
            except Exception as exc:  # NVML and CUDA may disagree on order: match by bus id
                log.debug("no NVML handle for cuda:%d: %s", i, exc)
            out.append(Device("cuda", i, name, total, bandwidth=bw, pci_bus_id=pci,
                              _nvml_handle=handle))
        except Exception as exc:
            log.warning("managed_solve: skipping cuda:%d (%s)", i, exc)
    return out, ""


def parse_simulate(spec: str, *, var: str = ENV_SIMULATE) -> list[Device]:
    """``"4x2GiB"`` -> four simulated GPUs of 2 GiB; ``"2GiB,1GiB"`` -> two of those sizes.

    Every size needs its unit (``"4x512B"`` for bytes): ``"4x2"`` is refused
    rather than read as four GPUs of 2 bytes.
    """
    spec = spec.strip()
    example = "for example '4x2GiB' (four GPUs of 2 GiB) or '2GiB,1GiB'"
    if not spec:
        raise ValueError(f"{var} is empty; {example}.")
    sizes: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*[xX*]\s*(.+)", part)
        size_text = m.group(2) if m else part
        if re.fullmatch(r"[0-9]*\.?[0-9]+", size_text.strip()):
            # "4x2" reads naturally as four GPUs of 2 GiB; as bytes it would
            # simulate GPUs nothing fits on. Ask for the unit instead of guessing.
            raise ValueError(
                f"{var}={spec!r}: the size {size_text.strip()!r} has no unit; write one, e.g. "
                f"{var}=4x2GiB (four GPUs of 2 GiB). Units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB."
            )
        try:
            if m:
                count, size = int(m.group(1)), parse_bytes(m.group(2), what=var)
                if count < 1:
                    raise ValueError
                sizes += [size] * count
            else:
                sizes.append(parse_bytes(part, what=var))
        except ValueError:
            raise ValueError(f"{var}={spec!r} is not a valid device simulation; {example}.") from None
    if any(s <= 0 for s in sizes):
        raise ValueError(f"{var}={spec!r}: sizes must be positive; {example}.")
    return [
        Device("sim", i, f"simulated GPU {i}", s, bandwidth=_DEFAULT_GPU_BANDWIDTH)
        for i, s in enumerate(sizes)
    ]


#: How a caller of ``reserve``/``solve`` gets an error instead of a spill.
RESERVE_FIX = "or pass spill=False (reserve) or device='cuda:i' to get an error instead"


def warn_spill(nbytes: int, free: dict[str, int], *, fix: str = RESERVE_FIX) -> None:
    """Warn once that work of ``nbytes`` fit on no GPU (``free``: name -> bytes) and runs on the CPU.

    ``fix``: the end of the advice, the caller's own way out (``solve_many`` has no ``spill=``).
    """
    have = ", ".join(f"{d}: {format_bytes(b)} free" for d, b in free.items())
    warn_once("spill", f"managed_solve: work of {format_bytes(nbytes)} fit on no GPU ({have}), so it "
                       "runs on the CPU, slower. Fix: free GPU memory or wait for running work, "
                       f"split large systems, {fix}.", stacklevel=caller_stacklevel() + 1)


def warn_mps(what: str) -> None:
    """Warn once that an ``mps`` device or tensor runs on the CPU, and why."""
    warn_once("mps", f"managed_solve: {what} is on Apple's mps device; managed_solve has no Metal "
                     "backend, so it solves on the CPU (the same unified memory on a Mac) and "
                     "returns CPU arrays. Move a solution back with .to('mps') when needed.",
              stacklevel=5)


def parse_device_name(name: str, *, what: str = "device") -> tuple[str, int]:
    """``"cuda:1"`` -> ("cuda", 1); ``"cpu"`` -> ("cpu", 0); ``"sim:2"`` -> ("sim", 2).

    ``"mps"`` (Apple's Metal device in torch) means the CPU, with one
    :class:`DeviceWarning`: there is no Metal backend, and the CPU shares
    the Mac's unified memory. ``"meta"`` is refused: nothing can run there.
    """
    s = str(name).strip().lower()
    # "solve_many(devices=...)" already names the argument: the item follows it
    head = f"{what}: {name!r}" if what.endswith(")") else f"{what}={name!r}"
    if s == "cpu":
        return "cpu", 0
    if s == "mps" or s.startswith("mps:"):
        warn_mps(head)
        return "cpu", 0
    if s == "meta" or s.startswith("meta:"):
        raise ValueError(f"{head}: the meta device holds shapes, not values; nothing can "
                         "be solved there. Size and plan with meta tensors (DeviceManager.size_of), "
                         "solve on 'cpu' or 'cuda:i'.")
    if s in ("cuda", "gpu"):
        return "cuda", 0
    m = re.fullmatch(r"(cuda|sim|gpu|cpu):(\d+)", s)
    if not m:
        alone = " ('all' stands alone: devices='all', not among other names)" if s == "all" else ""
        raise ValueError(
            f"{head} is not a device name{alone}; use 'cpu', 'cuda:0', 'cuda:1', ... "
            "or 'sim:0' for a simulated GPU."
        )
    kind = "cuda" if m.group(1) == "gpu" else m.group(1)
    return kind, int(m.group(2))


def discover(devices: str | Sequence[str] | None = None, simulate: str | None = None, *,
             discovery: Discovery | None = None) -> list[Device]:
    """The device inventory: accelerators first, the CPU last (always present).

    Parameters
    ----------
    devices : str or list of str, optional
        Subset to use (``"cuda:1,cpu"``). Default: ``$MANAGED_SOLVE_DEVICES``, else all.
    simulate : str, optional
        Simulated GPUs (``"4x2GiB"``) instead of real ones. Default:
        ``$MANAGED_SOLVE_SIMULATE``.
    discovery : Discovery, optional
        Where to look for GPUs; default: this machine.

    Examples
    --------
    >>> [str(d) for d in discover(simulate="2x1GiB")]
    ['sim:0', 'sim:1', 'cpu']
    """
    var_dev = "devices" if devices is not None else ENV_DEVICES
    if devices is None:
        devices = environment(ENV_DEVICES)
    var_sim = "simulate" if simulate is not None else ENV_SIMULATE
    if simulate is None:
        simulate = environment(ENV_SIMULATE)

    if simulate is not None:  # the variable read empty is None; simulate="" given is refused
        accel = parse_simulate(simulate, var=var_sim)
        mode = "simulated"
    else:
        discovery = discovery if discovery is not None else Discovery()
        accel, why = discover_cuda(discovery)
        mode = "GPU" if accel else "CPU-only"
        if not accel:
            log.info("managed_solve: CPU-only inventory: %s", why)
            if _wants_gpu(devices) and discovery.gpu_present():
                warn_cpu_fallback(why)
    cpu = cpu_device()
    inventory = [*accel, cpu]
    if devices is None:
        return inventory

    names = devices.split(",") if isinstance(devices, str) else list(devices)
    chosen: list[Device] = []
    by_name = {str(d): d for d in inventory}
    for raw in names:
        raw = str(raw).strip()
        if not raw:
            continue
        kind, idx = parse_device_name(raw, what=var_dev)
        key = "cpu" if kind == "cpu" else f"{kind}:{idx}"
        if key not in by_name:
            have = ", ".join(by_name) or "none"
            raise ValueError(
                f"{var_dev}={devices!r} names {key!r}, which this machine does not have "
                f"({mode} inventory: {have}). Example of a valid value: 'cuda:0,cpu'."
            )
        if by_name[key] not in chosen:
            chosen.append(by_name[key])
    if not chosen:
        raise ValueError(f"{var_dev}={devices!r} selects no device; example: 'cuda:0,cpu'.")
    return chosen


def _wants_gpu(devices: Any) -> bool:
    """False when ``devices`` asks for the CPU only (then running there is no surprise)."""
    if devices is None:
        return True
    names = devices.split(",") if isinstance(devices, str) else [str(d) for d in devices]
    return any(n.strip().lower() not in ("", "cpu") for n in names)


def inventory_mode(devices: Sequence[Device]) -> str:
    kinds = {d.kind for d in devices}
    if "sim" in kinds:
        return "simulated"
    if "cuda" in kinds:
        return "GPU"
    return "CPU-only"
