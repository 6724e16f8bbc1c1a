"""W2n: W2's sizes with non-symmetric convection-diffusion operators, solved with GMRES.

Defined in benchmarks/README.md (W2 is Poisson, where CG applies); it follows W2's
method. 400 upwind convection-diffusion systems of 32^2..96^2 unknowns, each
to rtol 1e-8, GMRES(30) everywhere, seconds per system compared in one run:

- ``w2n-cpu``: ``solve_many(method="gmres")`` on the CPU only vs a loop of
  ``scipy.sparse.linalg.gmres`` (timed on every tenth system);
- ``w2n-gpu``: ``solve_many(method="gmres")`` on one GPU vs a loop of cupyx
  ``gmres`` (every tenth system), and ``solve_many`` with ``method="auto"``
  (batched BiCGStab) for reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from bench_w2_many import ROUNDS, RTOL, per_system, time_solver_loop, w2_sizes

from conftest import sync
from managed_solve import solve_many
from managed_solve.manager import DeviceManager

RESTART = 30
SUBSET = 10  # the loops time every tenth system


def upwind(m: int, peclet: float) -> sp.csr_matrix:
    """First-order upwind convection-diffusion on an m x m grid (non-symmetric)."""
    T = sp.diags([-1.0 - peclet, 2.0, -1.0 + peclet], [-1, 0, 1], shape=(m, m))
    A = (sp.kron(sp.identity(m), T) + sp.kron(T, sp.identity(m))).tocsr()
    A.indices = A.indices.astype(np.int32)
    A.indptr = A.indptr.astype(np.int32)
    return A


@pytest.fixture(scope="module")
def w2n():
    sizes = w2_sizes()
    rng = np.random.default_rng(2)
    cache: dict[tuple[int, float], sp.csr_matrix] = {}
    pairs = []
    for m in sizes:
        pe = float(rng.choice([0.3, 0.6, 0.9]))
        if (m, pe) not in cache:
            cache[m, pe] = upwind(m, pe)
        pairs.append((cache[m, pe], np.ones(m * m)))
    return sizes, pairs


def check(pairs, results) -> None:
    for (A, b), r in zip(pairs, results, strict=True):
        assert r.converged, r
        assert np.linalg.norm(b - A @ r.to_numpy()) <= RTOL * np.linalg.norm(b)


@pytest.mark.benchmark(group="w2n-cpu")
def bench_w2n_cpu_scipy_gmres_loop(benchmark, w2n, machine_info):
    _sizes, pairs = w2n
    subset = pairs[::SUBSET]

    def loop():
        return [spla.gmres(A, b, rtol=RTOL, restart=RESTART, maxiter=1000) for A, b in subset]

    time_solver_loop(benchmark, machine_info, "cpu", loop, len(pairs), len(subset))


@pytest.mark.benchmark(group="w2n-cpu")
def bench_w2n_cpu_solve_many(benchmark, w2n, machine_info):
    _sizes, pairs = w2n
    dm = DeviceManager(["cpu"])
    check(pairs, solve_many(pairs, manager=dm, rtol=RTOL, method="gmres"))  # also warms up
    benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL, method="gmres"),
                       rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", role="ours", dtype="float64", systems=len(pairs))
    per_system(benchmark, len(pairs))


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2n-gpu")
def bench_w2n_gpu_cupyx_gmres_loop(benchmark, w2n, machine_info):
    from bench_w2_many import _gpu_modules

    cp, csp, cspla = _gpu_modules()
    _sizes, pairs = w2n
    with cp.cuda.Device(0):
        subset = [(csp.csr_matrix(A), cp.asarray(b)) for A, b in pairs[::SUBSET]]

    def loop():
        with cp.cuda.Device(0):
            out = [cspla.gmres(A, b, rtol=RTOL, restart=RESTART, maxiter=1000) for A, b in subset]
            sync()
        return out

    time_solver_loop(benchmark, machine_info, "cuda", loop, len(pairs), len(subset))


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["gmres", "auto"])
@pytest.mark.benchmark(group="w2n-gpu")
def bench_w2n_gpu_solve_many(benchmark, w2n, method, machine_info):
    _sizes, pairs = w2n
    dm = DeviceManager(["cuda:0"])
    check(pairs, solve_many(pairs, manager=dm, rtol=RTOL, method=method))  # warm-up, answers

    def run():
        out = solve_many(pairs, manager=dm, rtol=RTOL, method=method)
        sync()
        return out

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    res = run()
    machine_info(benchmark, "cuda", role="ours", dtype="float64", systems=len(pairs),
                 methods=sorted({r.method for r in res}),
                 batches=len({r.info.get("batch") for r in res}))
    per_system(benchmark, len(pairs))
