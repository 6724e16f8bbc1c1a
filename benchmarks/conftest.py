"""Benchmark fixtures: GPU availability, synchronisation, machine facts in extra_info."""

from __future__ import annotations

import os
import platform

import pytest

from managed_solve import _backend

GPU_COUNT = _backend.cuda_probe()[0]



@pytest.fixture(autouse=True)
def _pack_chunk_nnz():
    """Packing piece size from BENCH_COPY_CHUNK_NNZ, to compare settings between runs."""
    if not os.environ.get("BENCH_COPY_CHUNK_NNZ"):
        yield
        return
    from managed_solve import config

    with config.override(pack_chunk_nnz=int(os.environ["BENCH_COPY_CHUNK_NNZ"])):
        yield


def pytest_report_header(config):
    return [f"benchmarks: {GPU_COUNT} usable CUDA GPU(s); CPU {platform.processor() or platform.machine()} "
            f"x{os.cpu_count()}"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multi_gpu" in item.keywords and GPU_COUNT < 2:
            item.add_marker(pytest.mark.skip(reason="needs two usable CUDA GPUs"))
        elif "gpu" in item.keywords and GPU_COUNT < 1:
            item.add_marker(pytest.mark.skip(reason="needs a usable CUDA GPU"))


@pytest.fixture(scope="session")
def gpu_available() -> bool:
    return GPU_COUNT > 0


def sync() -> None:
    """Wait for all queued GPU work on the current device (no-op without a GPU)."""
    if GPU_COUNT:
        _backend.cupy().cuda.Device().synchronize()


def device_name(kind: str = "cpu") -> str:
    if kind == "cpu":
        return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"
    cp = _backend.cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


@pytest.fixture
def machine_info():
    """Fill benchmark.extra_info with the device name and library versions."""

    def fill(benchmark, kind="cpu", **extra):
        benchmark.extra_info["device"] = device_name(kind)
        for mod in ("numpy", "scipy", "cupy", "torch"):
            try:
                benchmark.extra_info[mod] = __import__(mod).__version__
            except Exception:
                pass
        benchmark.extra_info.update(extra)

    return fill
