"""Mesh systems on the CPU: the demo's sweep on ``icosphere(5)`` through ``solve_many``, anchors in the same run.

Group ``mesh-cpu``: 40 heat steps and screened Poisson problems on
``icosphere(5)`` (10,242 unknowns each, each its own matrix: one assembly
per time step or screening weight), built as ``managed-solve demo`` builds
its sweep, each to its own rtol (1e-8). Entries:

- anchor ``cg_loop``: a loop of ``scipy.sparse.linalg.cg`` (the loop the demo
  prints against), with OpenBLAS's default threads;
- anchor ``cg_loop_one_blas_thread``: the same loop with OpenBLAS held to one
  thread (SciPy's vector operations at 10,242 entries are threaded by
  OpenBLAS, which on a 2-core host shared with other work costs more than it
  gives; this is the faster, stricter anchor where it is);
- ours ``solve_many`` (target: at least 1.5 x faster than the faster cg loop),
  and ours on one host thread (``threads_speedup``: the second thread's gain).

``extra_info`` records each entry's ratio to the anchors' medians of this
run, the methods chosen and the machine's load average when it ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os

import numpy as np
import pytest
import scipy.sparse.linalg as spla

from managed_solve import config, solve_many
from managed_solve.demo import build_sweep
from managed_solve.manager import DeviceManager
from managed_solve.mesh import icosphere

ROUNDS = 5
SYSTEMS = 40
LEVEL = 5
MEDIANS: dict[str, float] = {}


@pytest.fixture(scope="module")
def sweep():
    systems, _labels = build_sweep([icosphere(LEVEL)], SYSTEMS)
    return systems, [(s.A.tocsr(), np.asarray(s.b), s.rtol, s.n) for s in systems]


@contextlib.contextmanager
def one_blas_thread():
    """NumPy's OpenBLAS on one thread while the block runs (skips where it cannot be set)."""
    import numpy

    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs",
                                  "libscipy_openblas64_*.so"))
    if not libs:
        pytest.skip("NumPy's OpenBLAS library was not found: its threads cannot be set")
    blas = ctypes.CDLL(libs[0])
    get = getattr(blas, "scipy_openblas_get_num_threads64_", None)
    put = getattr(blas, "scipy_openblas_set_num_threads64_", None)
    if get is None or put is None:
        pytest.skip("NumPy's OpenBLAS does not export its thread setters")
    before = get()
    put(1)
    try:
        yield
    finally:
        put(before)


def entry(benchmark, machine_info, key: str, role: str, **extra) -> None:
    median = benchmark.stats.stats.median
    MEDIANS[key] = median
    ratios = {f"ratio_vs_{a}": median / MEDIANS[a] for a in ("cg_loop", "cg_loop_one_blas_thread")
              if a in MEDIANS and a != key}
    machine_info(benchmark, "cpu", role=role, dtype="float64", systems=SYSTEMS,
                 unknowns_each=int(10 * 4 ** LEVEL + 2), load_average=os.getloadavg(),
                 **ratios, **extra)


def scipy_loop(mats):
    return [spla.cg(A, b, rtol=rtol, maxiter=10 * n) for A, b, rtol, n in mats]


@pytest.mark.benchmark(group="mesh-cpu")
def bench_mesh_cpu_cg_loop(benchmark, sweep, machine_info):
    _systems, mats = sweep
    assert all(info == 0 for _x, info in scipy_loop(mats))
    benchmark.pedantic(lambda: scipy_loop(mats), rounds=ROUNDS, iterations=1, warmup_rounds=0)
    entry(benchmark, machine_info, "cg_loop", "anchor")


@pytest.mark.benchmark(group="mesh-cpu")
def bench_mesh_cpu_cg_loop_one_blas_thread(benchmark, sweep, machine_info):
    _systems, mats = sweep
    with one_blas_thread():
        benchmark.pedantic(lambda: scipy_loop(mats), rounds=ROUNDS, iterations=1, warmup_rounds=1)
    entry(benchmark, machine_info, "cg_loop_one_blas_thread", "anchor")


def check(systems, results) -> None:
    for s, r in zip(systems, results, strict=True):
        assert r.converged, r
        b = np.asarray(s.b)
        assert np.linalg.norm(b - s.A @ r.to_numpy()) <= s.rtol * np.linalg.norm(b)


@pytest.mark.benchmark(group="mesh-cpu")
def bench_mesh_cpu_solve_many(benchmark, sweep, machine_info):
    systems, _mats = sweep
    dm = DeviceManager(["cpu"])
    first = solve_many(systems, manager=dm)
    check(systems, first)
    benchmark.pedantic(lambda: solve_many(systems, manager=dm), rounds=ROUNDS, iterations=1,
                       warmup_rounds=0)
    entry(benchmark, machine_info, "ours", "ours", methods=sorted({r.method for r in first}),
          target="<= 1/1.5 of the faster cg loop")


@pytest.mark.benchmark(group="mesh-cpu")
def bench_mesh_cpu_solve_many_one_thread(benchmark, sweep, machine_info):
    systems, _mats = sweep
    dm = DeviceManager(["cpu"])
    with config.override(host_threads=1):
        check(systems, solve_many(systems, manager=dm))
        benchmark.pedantic(lambda: solve_many(systems, manager=dm), rounds=ROUNDS, iterations=1,
                           warmup_rounds=0)
    extra = {}
    if "ours" in MEDIANS:
        extra["threads_speedup"] = benchmark.stats.stats.median / MEDIANS["ours"]
    entry(benchmark, machine_info, "ours_one_thread", "ours, one thread", **extra)
