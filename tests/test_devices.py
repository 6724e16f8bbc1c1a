"""Devices and discovery: parsing, selection, never-crashing discovery, device-wide free memory."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import types
import warnings
from concurrent.futures import Future

import numpy as np
import pytest

from managed_solve import _backend
from managed_solve.devices import (
    ENV_DEVICES,
    ENV_SIMULATE,
    Device,
    DeviceWarning,
    Discovery,
    MemoryQuery,
    cpu_device,
    discover,
    discover_cuda,
    forget_warnings,
    format_bytes,
    nvidia_gpu_present,
    parse_bytes,
    parse_device_name,
    parse_simulate,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GiB", 2 << 30), ("512MiB", 512 << 20), ("4GB", 4 * 10**9), ("1.5KiB", 1536), ("100", 100),
     ("3 gib", 3 << 30)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 parsecs", "-1GiB", "1e3GiB?"])
def test_parse_bytes_rejects_with_example(text):
    with pytest.raises(ValueError, match="2GiB"):
        parse_bytes(text)


def test_format_bytes_round_trip():
    assert format_bytes(2 << 30) == "2.0 GiB"
    assert format_bytes(512) == "512 B"


def test_parse_simulate_counts_and_sizes():
    devs = parse_simulate("4x2GiB")
    assert [str(d) for d in devs] == ["sim:0", "sim:1", "sim:2", "sim:3"]
    assert all(d.total_bytes == 2 << 30 and d.kind == "sim" and d.is_gpu for d in devs)
    mixed = parse_simulate("2GiB, 1x512MiB")
    assert [d.total_bytes for d in mixed] == [2 << 30, 512 << 20]


@pytest.mark.parametrize("spec", ["", "4x", "x2GiB", "0x2GiB", "four GPUs", "4x2Gibibytes"])
def test_parse_simulate_malformed_names_variable_and_example(spec):
    with pytest.raises(ValueError) as err:
        parse_simulate(spec)
    assert ENV_SIMULATE in str(err.value) and "4x2GiB" in str(err.value)


@pytest.mark.parametrize("spec", ["4x2", "2", "2GiB,1", "4 x 2.5"])
def test_parse_simulate_requires_a_unit(spec):
    # "4x2" once meant four GPUs of 2 bytes: nothing fit anywhere, silently.
    with pytest.raises(ValueError, match="has no unit") as err:
        parse_simulate(spec)
    assert f"{ENV_SIMULATE}=4x2GiB" in str(err.value)


def test_env_simulate_without_unit_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_SIMULATE, "4x2")
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    with pytest.raises(ValueError, match=rf"{ENV_SIMULATE}='4x2': the size '2' has no unit.*"
                                         rf"{ENV_SIMULATE}=4x2GiB"):
        discover()


def test_an_empty_simulate_argument_is_refused_and_an_empty_variable_means_unset(monkeypatch):
    """DeviceManager(simulate="") asked for simulated GPUs and got none, silently; an empty
    environment variable is the shell's way of leaving it unset."""
    from managed_solve import DeviceManager

    with pytest.raises(ValueError, match="simulate is empty"):
        DeviceManager(simulate="")
    monkeypatch.setenv(ENV_SIMULATE, "")
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    assert not [d for d in discover() if d.kind == "sim"]


def test_parse_simulate_explicit_bytes_and_other_units():
    assert [d.total_bytes for d in parse_simulate("2x512B")] == [512, 512]
    assert [d.total_bytes for d in parse_simulate("1x1.5KiB, 1MB, 1x2G")] == [1536, 10**6, 2 << 30]


def test_env_simulate_is_read(monkeypatch):
    monkeypatch.setenv(ENV_SIMULATE, "3x1GiB")
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    inv = discover()
    assert [str(d) for d in inv] == ["sim:0", "sim:1", "sim:2", "cpu"]


def test_env_simulate_malformed(monkeypatch):
    monkeypatch.setenv(ENV_SIMULATE, "lots")
    with pytest.raises(ValueError, match=ENV_SIMULATE):
        discover()


def test_env_devices_selects_subset_in_order(monkeypatch):
    monkeypatch.setenv(ENV_SIMULATE, "3x1GiB")
    monkeypatch.setenv(ENV_DEVICES, "sim:2, cpu,sim:0")
    assert [str(d) for d in discover()] == ["sim:2", "cpu", "sim:0"]


@pytest.mark.parametrize("value", ["cuda:7", "tpu:0", "cuda:x", ","])
def test_env_devices_invalid_value(monkeypatch, value):
    monkeypatch.delenv(ENV_SIMULATE, raising=False)
    monkeypatch.setenv(ENV_DEVICES, value)
    with pytest.raises(ValueError) as err:
        discover()
    assert ENV_DEVICES in str(err.value)
    assert "cuda:0" in str(err.value)  # an example of a valid value


def test_argument_overrides_environment(monkeypatch):
    monkeypatch.setenv(ENV_SIMULATE, "garbage")
    inv = discover(devices="cpu", simulate="1x1GiB")
    assert [str(d) for d in inv] == ["cpu"]


def test_parse_device_name():
    assert parse_device_name("cuda:1") == ("cuda", 1)
    assert parse_device_name("CPU") == ("cpu", 0)
    assert parse_device_name("gpu:2") == ("cuda", 2)
    assert parse_device_name("cuda") == ("cuda", 0)
    with pytest.raises(ValueError, match="'cuda:0'"):
        parse_device_name("cuda1")


def test_cpu_device_facts():
    cpu = cpu_device()
    assert str(cpu) == "cpu" and not cpu.is_gpu
    assert cpu.backend is np
    assert 0 < cpu.free_bytes() <= cpu.total_bytes


def test_sim_device_free_bytes_follow_usage():
    dev = parse_simulate("1x1GiB")[0]
    assert dev.free_bytes() == 1 << 30
    dev.sim_used_bytes = 300 << 20
    assert dev.free_bytes() == (1 << 30) - (300 << 20)
    assert dev.backend is np


def test_device_equality_and_hash():
    a, b = parse_simulate("1GiB")[0], parse_simulate("1GiB")[0]
    assert a == b and hash(a) == hash(b) and a == "sim:0"
    assert {a: 1}[b] == 1
    assert Device("cuda", 1, "x", 1) == "cuda:1"


# -------------------------------------------------------------- never-crashing discovery
# Discovery takes the machine it looks at as a Discovery: an importer of the
# optional packages and a "is an NVIDIA GPU present" test, stand-ins here.
def _importer(cupy=None, fail=()):
    """``import_module`` of a machine with ``cupy`` (None: not installed) whose ``fail`` imports raise."""
    def import_module(name):
        if name == "cupy" and cupy is not None:
            return cupy
        if name.startswith(tuple(fail)) or name in ("cupy", "pynvml"):
            raise ImportError(f"No module named {name!r}")
        return importlib.import_module(name)

    return import_module


def _cupy_with(get_count):
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=get_count)))


def _broken_driver():
    raise RuntimeError("cudaErrorInsufficientDriver")


def test_discovery_without_cupy(monkeypatch, caplog):
    monkeypatch.delenv(ENV_SIMULATE, raising=False)
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    machine = Discovery(import_module=_importer(), gpu_present=lambda: False)
    with caplog.at_level("INFO", logger="managed_solve"):
        inv = discover(discovery=machine)
    assert [str(d) for d in inv] == ["cpu"]
    assert any("CuPy is not installed" in r.getMessage() for r in caplog.records)


def test_discovery_with_broken_driver(monkeypatch):
    machine = Discovery(import_module=_importer(_cupy_with(_broken_driver)), gpu_present=lambda: False)
    n, why = machine.probe()
    assert n == 0 and "cudaErrorInsufficientDriver" in why
    monkeypatch.delenv(ENV_SIMULATE, raising=False)
    monkeypatch.delenv(ENV_DEVICES, raising=False)
    assert [str(d) for d in discover(discovery=machine)] == ["cpu"]


def test_discovery_with_failing_cupyx():
    machine = Discovery(import_module=_importer(_cupy_with(lambda: 2), fail=("cupyx",)))
    n, why = machine.probe()
    assert n == 0 and "cupyx" in why
    assert discover_cuda(machine) == ([], why)


def test_discovery_with_no_cuda_devices():
    n, why = Discovery(import_module=_importer(_cupy_with(lambda: 0))).probe()
    assert n == 0 and "no CUDA devices" in why


def test_optional_dependency_error_names_extra():
    with pytest.raises(ModuleNotFoundError, match=r"managed-solve\[mesh\]"):
        _backend.require("meshio._no_such_module")


# -------------------------------------------------------------- real GPUs
@pytest.mark.gpu
def test_cuda_discovery_reports_real_devices():
    inv = discover(devices=None, simulate=None)
    gpus = [d for d in inv if d.kind == "cuda"]
    assert gpus, "a usable GPU exists but discovery found none"
    cp = _backend.cupy()
    for d in gpus:
        with cp.cuda.Device(d.index):
            free, total = cp.cuda.runtime.memGetInfo()
        assert d.total_bytes == total
        assert abs(d.free_bytes() - free) < (512 << 20)
        assert d.backend is cp


@pytest.mark.gpu
def test_free_bytes_are_device_wide():
    """Memory another process allocates on the GPU must show in free_bytes (NVML / cudaMemGetInfo)."""
    gpus = [d for d in discover(devices=None, simulate=None) if d.kind == "cuda"]
    dev = gpus[-1]
    before = dev.free_bytes()
    code = (
        "import cupy, sys, time\n"
        f"cupy.cuda.Device({dev.index}).use()\n"
        "a = cupy.empty(2 << 30, dtype=cupy.uint8); a.fill(1)\n"
        "cupy.cuda.Device().synchronize(); print('ready', flush=True); sys.stdin.readline()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        during = dev.free_bytes()
    finally:
        proc.communicate("done\n", timeout=60)
    assert before - during >= (2 << 30) * 0.95, (before, during)


@pytest.mark.gpu
def test_array_module_of_cupyx_sparse():
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp

    A = csp.identity(4, format="csr")
    assert not _backend.is_cupy_array(A) and _backend.is_cupy_sparse(A)
    assert _backend.array_module(A) is cp
    assert _backend.is_cupy_array(cp.zeros(3))
    assert _backend.to_host(A).nnz == 4


# -------------------------------------------------------------- warnings: a GPU is present, we run on the CPU
@pytest.fixture
def fresh_warnings():
    forget_warnings()
    yield
    forget_warnings()


def _no_env(monkeypatch):
    monkeypatch.delenv(ENV_SIMULATE, raising=False)
    monkeypatch.delenv(ENV_DEVICES, raising=False)


def test_gpu_present_without_cupy_warns_once_with_the_fix(monkeypatch, fresh_warnings):
    _no_env(monkeypatch)
    machine = Discovery(import_module=_importer(), gpu_present=lambda: True)
    with pytest.warns(DeviceWarning, match=r"NVIDIA GPU is present.*CuPy is not installed.*cuda12"):
        assert [str(d) for d in discover(discovery=machine)] == ["cpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        discover(discovery=machine)  # once per process: the second inventory is quiet


def test_gpu_present_with_broken_cupy_warns(monkeypatch, fresh_warnings):
    _no_env(monkeypatch)
    machine = Discovery(import_module=_importer(_cupy_with(_broken_driver)), gpu_present=lambda: True)
    with pytest.warns(DeviceWarning, match=r"cudaErrorInsufficientDriver.*Fix: check that `nvidia-smi`"):
        discover(discovery=machine)


def test_no_warning_without_an_nvidia_gpu_or_when_the_cpu_is_asked_for(monkeypatch, fresh_warnings):
    _no_env(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        discover(discovery=Discovery(import_module=_importer(), gpu_present=lambda: False))
        discover("cpu", discovery=Discovery(import_module=_importer(), gpu_present=lambda: True))


def test_nvidia_gpu_present_is_a_bool():
    assert isinstance(nvidia_gpu_present(), bool)


def test_mps_means_the_cpu_with_one_warning_and_meta_is_refused(fresh_warnings):
    with pytest.warns(DeviceWarning, match="mps"):
        assert parse_device_name("mps") == ("cpu", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_device_name("mps:0") == ("cpu", 0)  # once per process
    with pytest.raises(ValueError, match="meta device holds shapes"):
        parse_device_name("meta")


# -------------------------------------------------------------- free memory of a CUDA GPU
def _query(context, asked, *, nvml=None):
    """A MemoryQuery over stand-ins that record which source answered."""
    def runtime_free(index):
        asked.append(("runtime", index))
        return 1000 + index

    def nvml_free(handle):
        asked.append(("nvml", handle))
        if nvml is not None:
            raise nvml
        return 500

    return MemoryQuery(context=context, runtime_free=runtime_free, nvml_free=nvml_free)


def _future(result=None, exc=None):
    fut = Future()
    fut.set_exception(exc) if exc is not None else fut.set_result(result)
    return fut


def test_free_bytes_of_a_gpu_with_a_context_come_from_the_runtime_not_nvml():
    asked = []
    dev = Device("cuda", 1, "stand-in GPU", 1 << 30, _nvml_handle="h1",
                 memory=_query(lambda i: _future(i) if i == 1 else None, asked))
    assert dev.free_bytes() == 1001
    assert asked == [("runtime", 1)]


def test_free_bytes_of_a_gpu_without_a_context_come_from_nvml_and_make_none():
    asked = []
    dev = Device("cuda", 0, "stand-in GPU", 1 << 30, _nvml_handle="h0",
                 memory=_query(lambda i: None, asked))
    assert dev.free_bytes() == 500
    assert asked == [("nvml", "h0")]


def test_free_bytes_fall_back_to_the_runtime_without_nvml_or_when_it_fails():
    asked = []
    no_handle = Device("cuda", 0, "stand-in GPU", 1 << 30, memory=_query(lambda i: None, asked))
    assert no_handle.free_bytes() == 1000 and asked == [("runtime", 0)]
    asked.clear()
    broken = Device("cuda", 2, "stand-in GPU", 1 << 30, _nvml_handle="h2",
                    memory=_query(lambda i: None, asked, nvml=RuntimeError("NVML gone")))
    assert broken.free_bytes() == 1002 and asked == [("nvml", "h2"), ("runtime", 2)]


def test_free_bytes_ask_nvml_when_making_the_context_failed():
    asked = []
    failed = _future(exc=RuntimeError("cudaErrorDevicesUnavailable"))
    dev = Device("cuda", 0, "stand-in GPU", 1 << 30, _nvml_handle="h0",
                 memory=_query(lambda i: failed, asked))
    assert dev.free_bytes() == 500 and asked == [("nvml", "h0")]


def test_free_bytes_wait_for_a_context_being_made():
    import threading

    asked, making = [], Future()
    dev = Device("cuda", 0, "stand-in GPU", 1 << 30, _nvml_handle="h0",
                 memory=_query(lambda i: making, asked))
    out = []
    reader = threading.Thread(target=lambda: out.append(dev.free_bytes()))
    reader.start()
    reader.join(timeout=0.2)
    assert reader.is_alive() and not asked  # neither source asked while the context is made
    making.set_result(0)
    reader.join(timeout=30)
    assert out == [1000] and asked == [("runtime", 0)]


@pytest.mark.gpu
def test_opening_a_context_makes_free_bytes_come_from_the_runtime():
    gpus = [d for d in discover(devices=None, simulate=None) if d.kind == "cuda"]
    dev = gpus[0]
    assert _backend.open_cuda_context(dev.index).result(timeout=60) == dev.index
    assert _backend.open_cuda_context(dev.index) is _backend.cuda_context(dev.index)  # once
    cp = _backend.cupy()
    with cp.cuda.Device(dev.index):
        free, _total = cp.cuda.runtime.memGetInfo()
    assert abs(dev.free_bytes() - free) < (512 << 20)


@pytest.mark.gpu
def test_a_gpu_solve_many_reads_free_memory_through_its_context_not_nvml():
    import dataclasses

    import managed_solve as ms
    from tests._problems import poisson2d

    real = next(d for d in discover(devices=None, simulate=None) if d.kind == "cuda")
    asked = []

    def nvml_free(handle):
        asked.append(handle)
        return MemoryQuery().nvml_free(handle)

    dev = dataclasses.replace(real, memory=MemoryQuery(nvml_free=nvml_free))
    pairs = [(poisson2d(m), np.ones(m * m)) for m in (8, 9, 10) * 8]
    res = ms.solve_many(pairs, manager=ms.DeviceManager([dev]))
    assert all(r.converged and str(r.device) == str(dev) for r in res)
    assert _backend.cuda_context(dev.index) is not None
    assert asked == []
