"""W2n: W2's sizes with non-symmetric convection-diffusion operators, solved with GMRES.

Defined in benchmarks/README.md (W2 is Poisson, where CG applies); it follows W2's
method. 400 upwind convection-diffusion systems of 32^2..96^2 unknowns, each
with its own matrix object and to rtol 1e-8, GMRES(30) everywhere, seconds per
system compared in one run (``solve_many`` also, labelled "shared", with one
matrix object per size and Peclet number, which measures a cache rather than
users' inputs):

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


def w2n_draw() -> list[tuple[int, float]]:
    """W2's sizes, each with its cell Peclet number (seed 2)."""
    rng = np.random.default_rng(2)
    return [(m, float(rng.choice([0.3, 0.6, 0.9]))) for m in w2_sizes()]


@pytest.fixture(scope="module")
def w2n():
    """Each system with its own matrix object, as users have them."""
    draw = w2n_draw()
    return [m for m, _pe in draw], [(upwind(m, pe), np.ones(m * m)) for m, pe in draw]


@pytest.fixture(scope="module")
def w2n_shared():
    """The same systems with one matrix object per (size, Peclet): the labelled variant."""
    draw = w2n_draw()
    cache: dict[tuple[int, float], sp.csr_matrix] = {}
    pairs = []
    for m, pe in draw:
        if (m, pe) not in cache:
            cache[m, pe] = upwind(m, pe)
        pairs.append((cache[m, pe], np.ones(m * m)))
    return [m for m, _pe in draw], pairs


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


@pytest.mark.parametrize("matrices", ["per-system", "shared"])
@pytest.mark.benchmark(group="w2n-cpu")
def bench_w2n_cpu_solve_many(benchmark, w2n, w2n_shared, matrices, machine_info):
    """Ours; "shared" (one matrix object per size and Peclet number) measures a cache and is labelled."""
    _sizes, pairs = w2n if matrices == "per-system" else w2n_shared
    dm = DeviceManager(["cpu"])
    check(pairs, solve_many(pairs, manager=dm, rtol=RTOL, method="gmres"))  # also warms up
    benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL, method="gmres"),
                       rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", role="ours" if matrices == "per-system" else "ours, shared matrices",
                 dtype="float64", systems=len(pairs), matrices=matrices)
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
@pytest.mark.parametrize("method, matrices", [("gmres", "per-system"), ("auto", "per-system"),
                                              ("gmres", "shared")])
@pytest.mark.benchmark(group="w2n-gpu")
def bench_w2n_gpu_solve_many(benchmark, w2n, w2n_shared, method, matrices, machine_info):
    """Ours; "shared" (one matrix object per size and Peclet number) measures a cache and is labelled."""
    _sizes, pairs = w2n if matrices == "per-system" else w2n_shared
    dm = DeviceManager(["cuda:0"])
    check(pairs, solve_many(pairs, manager=dm, rtol=RTOL, method=method))  # warm-up, answers

    def run():
        out = solve_many(pairs, manager=dm, rtol=RTOL, method=method)
        sync()
        return out

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    res = run()
    machine_info(benchmark, "cuda", role="ours" if matrices == "per-system" else "ours, shared matrices",
                 dtype="float64", systems=len(pairs), matrices=matrices,
                 methods=sorted({r.method for r in res}),
                 batches=len({r.info.get("batch") for r in res}))
    per_system(benchmark, len(pairs))
