"""W2 through the Ray backend vs the local backend on the same machine: the cost of the Ray path.

One local Ray instance (all cores, the machine's GPUs) is started outside the
timed calls; each timed Ray call includes what a user pays per call: starting
one actor per node, shipping the systems through the object store, the
node's local ``solve_many``, and fetching every ``x`` back to the driver.

Groups (seconds per system in ``extra_info["per_iteration_s"]``, as in
``bench_w2_many.py``):

- ``w2-ray-cpu``: the first 100 systems of W2 (the CPU solves the 400 in
  about 5 s a round on the 2-core development machine), local backend (anchor)
  vs the Ray backend, with a fresh actor per call and with a kept one
  (``keep_actors=True``: the steady-state cost of the path);
- ``w2-ray-gpu``: all 400 systems on one GPU, local vs Ray (the actor asks
  for the GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from bench_w2_many import RTOL, check_own_rtol, per_system, w2_pairs, w2_sizes

from conftest import GPU_COUNT, sync
from managed_solve import solve_many
from managed_solve.manager import DeviceManager

ray = pytest.importorskip("ray")
cluster = pytest.importorskip("managed_solve.cluster")

ROUNDS = 3
CPU_SYSTEMS = 100


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=os.cpu_count() or 1, num_gpus=GPU_COUNT, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def w2_cpu():
    sizes = w2_sizes()[:CPU_SYSTEMS]
    return sizes, w2_pairs(sizes)


def _ray_round(pairs, keep=False):
    # One actor on this node; with GPUs it asks for them as a real node would.
    (node,) = cluster.discover_nodes(ray)
    return cluster.solve_many_ray(pairs, rtol=RTOL, nodes=[node], keep_actors=keep)


@pytest.mark.benchmark(group="w2-ray-cpu")
def bench_w2_cpu_local_backend(benchmark, w2_cpu, machine_info):
    sizes, pairs = w2_cpu
    dm = DeviceManager(["cpu"])
    check_own_rtol(pairs, solve_many(pairs, manager=dm, rtol=RTOL, return_on="host"))
    benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL, return_on="host"),
                       rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", role="anchor", backend="local", dtype="float64",
                 systems=len(pairs), unknowns=int(sum(m * m for m in sizes)))
    per_system(benchmark, len(pairs))


@pytest.mark.benchmark(group="w2-ray-cpu")
def bench_w2_cpu_ray_backend(benchmark, ray_local, w2_cpu, machine_info):
    if GPU_COUNT:
        pytest.skip("the node's actor would take the GPU: see w2-ray-gpu")
    sizes, pairs = w2_cpu
    check_own_rtol(pairs, _ray_round(pairs))  # answer check; warms the worker start
    benchmark.pedantic(lambda: _ray_round(pairs), rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", role="ours", backend="ray", dtype="float64",
                 systems=len(pairs), unknowns=int(sum(m * m for m in sizes)),
                 note="per call: actor start + object-store transfers + local solve_many")
    per_system(benchmark, len(pairs))


@pytest.mark.benchmark(group="w2-ray-cpu")
def bench_w2_cpu_ray_backend_kept_actor(benchmark, ray_local, w2_cpu, machine_info):
    if GPU_COUNT:
        pytest.skip("the node's actor would take the GPU: see w2-ray-gpu")
    sizes, pairs = w2_cpu
    check_own_rtol(pairs, _ray_round(pairs, keep=True))  # starts the actor, warms it
    try:
        benchmark.pedantic(lambda: _ray_round(pairs, keep=True), rounds=ROUNDS, iterations=1,
                           warmup_rounds=0)
    finally:
        cluster.release_actors()
    machine_info(benchmark, "cpu", role="ours", backend="ray", dtype="float64",
                 systems=len(pairs), unknowns=int(sum(m * m for m in sizes)),
                 note="keep_actors=True: a warm actor, transfers + local solve_many only")
    per_system(benchmark, len(pairs))


@pytest.fixture(scope="module")
def w2_full():
    sizes = w2_sizes()
    return sizes, w2_pairs(sizes)


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-ray-gpu")
def bench_w2_gpu_local_backend(benchmark, w2_full, machine_info):
    sizes, pairs = w2_full
    dm = DeviceManager(["cuda:0"])
    check_own_rtol(pairs, solve_many(pairs, manager=dm, rtol=RTOL, return_on="host"))

    def run():
        out = solve_many(pairs, manager=dm, rtol=RTOL, return_on="host")
        sync()
        return out

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    machine_info(benchmark, "cuda", role="anchor", backend="local", dtype="float64",
                 systems=len(pairs), unknowns=int(sum(m * m for m in sizes)))
    per_system(benchmark, len(pairs))


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-ray-gpu")
def bench_w2_gpu_ray_backend(benchmark, ray_local, w2_full, machine_info):
    sizes, pairs = w2_full
    res = _ray_round(pairs)
    check_own_rtol(pairs, res)
    assert all(r.device.startswith("cuda:") for r in res), {r.device for r in res}
    benchmark.pedantic(lambda: _ray_round(pairs), rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cuda", role="ours", backend="ray", dtype="float64",
                 systems=len(pairs), unknowns=int(sum(m * m for m in sizes)),
                 note="per call: actor start + object-store transfers + local solve_many")
    per_system(benchmark, len(pairs))


def test_answers_agree(ray_local, w2_cpu):
    """The two backends give the same solutions on the benchmark's systems."""
    _sizes, pairs = w2_cpu
    local = solve_many(pairs[:20], manager=DeviceManager(["cpu"]), rtol=RTOL, return_on="host")
    remote = cluster.solve_many_ray(pairs[:20], rtol=RTOL)
    for a, b in zip(local, remote, strict=True):
        assert np.allclose(a.x, b.x, rtol=1e-8, atol=1e-10)
