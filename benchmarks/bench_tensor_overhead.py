"""ManagedTensor overhead per operation when nothing moves, against the same op on plain tensors.

Target (issue 6): at most 10 us median per op over the plain-tensor op. Each
timed call runs 100 ops and synchronises once, so ``per_iteration_s`` is the
time per op; ``report.py`` gives the ratio to the plain anchor of the same run,
and ``overhead_per_op_s`` (managed minus plain, both measured in this call's
process) is recorded for the target.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from managed_solve.manager import DeviceManager  # noqa: E402
from managed_solve.tensor import managed  # noqa: E402

OPS_PER_CALL = 100
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _operands(device, kind, op):
    g = torch.Generator().manual_seed(0)
    if op == "add":
        a, b = torch.randn(1024, generator=g), torch.randn(1024, generator=g)
    else:  # a small linear layer: x (32 x 64) @ W^T (64 x 64) + bias
        a, b = torch.randn(32, 64, generator=g), torch.randn(64, 64, generator=g)
    a, b = a.to(device), b.to(device)
    if kind == "plain":
        return a, b
    dm = DeviceManager(devices=["cpu"]) if device == "cpu" else DeviceManager()
    a, b = managed(a, manager=dm), managed(b, manager=dm)
    if kind == "managed_pinned":
        a, b = a.pin(), b.pin()
    return a, b


def _loop(op, a, b, device):
    if op == "add":
        def run():
            for _ in range(OPS_PER_CALL):
                out = a + b
            _sync(device)
            return out
    else:
        def run():
            for _ in range(OPS_PER_CALL):
                out = torch.nn.functional.linear(a, b)
            _sync(device)
            return out
    return run


def _median_per_op(run, repeats=31):
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] / OPS_PER_CALL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["add", "linear"])
@pytest.mark.parametrize("kind", ["plain", "managed", "managed_pinned"])
def bench_op_overhead(benchmark, machine_info, device, op, kind):
    a, b = _operands(device, kind, op)
    run = _loop(op, a, b, device)
    ref = _loop(op, *_operands(device, "plain", op), device)()
    out = run()
    assert torch.equal(out.as_subclass(torch.Tensor), ref)  # same answer before timing
    if kind != "plain":
        assert type(out).__name__ == "ManagedTensor"
    benchmark.group = f"tensor-overhead-{op}-{device}"
    machine_info(benchmark, "cuda" if device == "cuda" else "cpu", shape=list(a.shape),
                 dtype=str(a.dtype), ops_per_call=OPS_PER_CALL,
                 role="anchor" if kind == "plain" else "candidate")
    benchmark(run)
    benchmark.extra_info["per_iteration_s"] = benchmark.stats.stats.median / OPS_PER_CALL
    if kind != "plain":
        plain_run = _loop(op, *_operands(device, "plain", op), device)
        overhead = _median_per_op(run) - _median_per_op(plain_run)
        benchmark.extra_info["overhead_per_op_s"] = overhead
        benchmark.extra_info["overhead_target_s"] = 10e-6


@pytest.mark.parametrize("kind", ["plain_same_device", "managed_sim_move"])
def bench_slow_path_sim_move(benchmark, machine_info, kind):
    """The decision cost when operands disagree (two simulated GPUs: no bytes are copied)."""
    dm = DeviceManager(simulate="2x1GiB")
    a, b = torch.randn(1024), torch.randn(4096)[:1024]
    if kind == "managed_sim_move":
        a, b = managed(a, manager=dm).to("sim:0"), managed(b, manager=dm).to("sim:1")
    run = _loop("add", a, b, "cpu")
    out = run()
    if kind == "managed_sim_move":
        assert out.placement == "sim:0"  # equal bytes: the first operand's device
    benchmark.group = "tensor-slow-path-cpu"
    machine_info(benchmark, "cpu", role="anchor" if kind.startswith("plain") else "candidate",
                 ops_per_call=OPS_PER_CALL)
    benchmark(run)
    benchmark.extra_info["per_iteration_s"] = benchmark.stats.stats.median / OPS_PER_CALL
