"""W4: handing a solution to PyTorch. DLPack view vs the host round trip, same run.

GPU: 1 GiB of float64 in CuPy; ``as_torch`` (target: same data pointer,
under 50 us, zero bytes allocated) against ``.get()`` then
``torch.as_tensor(..., device="cuda")`` (about 416 ms on an H200).
CPU: 256 MiB of float64 in NumPy; ``as_torch`` against a copy into a new
torch tensor. Also ``from_torch`` (torch -> array) both ways.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import sync  # noqa: E402
from managed_solve.dlpack import as_torch, from_torch  # noqa: E402

GPU_BYTES = 1 << 30
CPU_BYTES = 256 << 20
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _array(device):
    if device == "cpu":
        return np.arange(CPU_BYTES // 8, dtype=np.float64)
    import cupy

    a = cupy.arange(GPU_BYTES // 8, dtype=cupy.float64)
    cupy.cuda.Device().synchronize()
    return a


def _ptr(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def _host_round_trip(a, device):
    if device == "cpu":
        return torch.tensor(a)  # copies
    return torch.as_tensor(a.get(), device="cuda")  # sync: device -> host -> device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["dlpack", "host_round_trip"])
def bench_w4_as_torch(benchmark, machine_info, device, how):
    a = _array(device)
    benchmark.group = f"w4-handoff-{device}"
    machine_info(benchmark, device, nbytes=int(a.nbytes), dtype="float64",
                 role="anchor" if how == "host_round_trip" else "candidate")
    if how == "dlpack":
        t = as_torch(a)
        assert t.data_ptr() == _ptr(a)  # zero-copy, checked before timing
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        pool_before = _pool_used(device)

        def run():
            out = as_torch(a)
            sync()
            return out

        benchmark(run)
        if device == "cuda":
            benchmark.extra_info["bytes_allocated"] = int(
                torch.cuda.memory_allocated() - before + _pool_used(device) - pool_before)
    else:
        t = _host_round_trip(a, device)
        assert t.data_ptr() != _ptr(a) and float(t[-1]) == float(a[-1])

        def run():
            out = _host_round_trip(a, device)
            sync()
            return out

        benchmark.pedantic(run, rounds=3 if device == "cuda" else 5, iterations=1, warmup_rounds=1)


def _pool_used(device):
    if device != "cuda":
        return 0
    import cupy

    return int(cupy.get_default_memory_pool().used_bytes())


@pytest.mark.parametrize("device", DEVICES)
def bench_w4_from_torch(benchmark, machine_info, device):
    t = torch.arange((CPU_BYTES if device == "cpu" else GPU_BYTES) // 8, dtype=torch.float64,
                     device=device)
    a = from_torch(t)
    assert _ptr(a) == t.data_ptr()
    benchmark.group = f"w4-from-torch-{device}"
    machine_info(benchmark, device, nbytes=int(t.numel() * 8), dtype="float64", role="candidate")
    benchmark(from_torch, t)
