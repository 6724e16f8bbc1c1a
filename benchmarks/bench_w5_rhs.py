"""W5: one matrix, many right-hand sides (``Solver``, 2-D b, ``solve_many`` over a shared A).

Groups (anchors timed in the same run; ``extra_info`` records each entry's
ratio to its anchor's median from this run, and the target):

- ``w5-cpu``: 2D Poisson 127^2, 50 right-hand sides, on the CPU.
  Anchor: SciPy's ``splu(A)`` once and ``.solve(B)``. Ours:
  ``Solver(A).solve(B)`` with its set-up (target at most 1.2 x the anchor),
  the same prepared Solver's repeated ``solve(B)`` alone, and ``solve_many``
  over 50 systems sharing the one matrix object (target at most 1.5 x).
- ``w5-cpu-block``: the Krylov route for a block on the CPU, 2D Poisson
  63^2, k = 16: a prepared ``Solver(A, method="cg", M=...)``'s ``solve(B)``
  against k ``solve(b)`` calls on it. With ``M="neumann"`` (the generic
  path) B runs as one block Krylov loop; with no M the fused core's Numba
  loops solve the k columns as one batch.
- ``w5-gpu``: 2D Poisson 1024^2, k = 32 right-hand sides, on one GPU.
  Anchor: 32 separate ``solve(A, b, method="cg")`` calls. Ours:
  ``Solver(A, method="cg").solve(B)``, set-up included (one block Krylov
  loop over the n x k block: one SpMM an iteration; target at least 8 x the
  anchor's throughput), and a prepared Solver's repeated ``solve(B)``. Each
  entry's first call (kernel compilation, cuSPARSE handles) is timed apart
  as ``cold_first_call_s``; the rounds are warm.
- ``w5-direct``: the direct path on the GPU (cuDSS; skipped where
  nvmath-python is not installed): a Solver's first solve (analysis and
  factorisation) against its repeated solve (target at most 5 % of the first).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse.linalg as spla
from bench_w2_many import poisson2d

from conftest import sync
from managed_solve import Solver, solve, solve_many
from managed_solve.manager import DeviceManager

RTOL = 1e-8
ROUNDS = 5
CPU_M, CPU_K = 127, 50
BLOCK_M, BLOCK_K = 63, 16
GPU_M, GPU_K = 1024, 32

# Medians of this run, by entry, so later entries record their ratio to an
# anchor timed in the same run (benchmarks run in file order).
MEDIANS: dict[str, float] = {}




def rhs_block(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k))


def check_columns(A, B, X, rtol: float = RTOL) -> None:
    """Every column's own relative residual meets ``rtol`` (host arrays)."""
    R = B - A @ X
    assert (np.linalg.norm(R, axis=0) <= rtol * np.linalg.norm(B, axis=0) * (1 + 1e-6)).all()


def record(benchmark, key: str, anchor: str | None = None, **extra) -> None:
    """Keep this entry's median for later entries; add its ratio to ``anchor`` (same run)."""
    median = benchmark.stats.stats.median
    MEDIANS[key] = median
    benchmark.extra_info.update(extra)
    if anchor is not None and anchor in MEDIANS:
        benchmark.extra_info[f"ratio_vs_{anchor}"] = median / MEDIANS[anchor]


# ------------------------------------------------------------------------------ CPU
@pytest.fixture(scope="module")
def w5_cpu():
    A = poisson2d(CPU_M)
    return A, rhs_block(A.shape[0], CPU_K)


@pytest.mark.benchmark(group="w5-cpu")
def bench_w5_cpu_splu_anchor(benchmark, w5_cpu, machine_info):
    A, B = w5_cpu

    def run():
        return spla.splu(A.tocsc()).solve(B)

    check_columns(A, B, run())
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    machine_info(benchmark, "cpu", role="anchor", n=A.shape[0], k=CPU_K,
                 note="scipy.sparse.linalg.splu(A) once, then .solve(B)")
    record(benchmark, "splu")


@pytest.mark.benchmark(group="w5-cpu")
def bench_w5_cpu_solver_with_setup(benchmark, w5_cpu, machine_info):
    A, B = w5_cpu

    def run():
        with Solver(A, rtol=RTOL, device="cpu") as solver:
            return solver.solve(B), solver.method

    res, method = run()
    assert res.converged and res.x.shape == B.shape
    check_columns(A, B, res.x)
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", role="ours", n=A.shape[0], k=CPU_K, method=method,
                 target="<= 1.2 x splu once + solve(B)")
    record(benchmark, "solver_with_setup", anchor="splu")


@pytest.mark.benchmark(group="w5-cpu")
def bench_w5_cpu_solver_repeat(benchmark, w5_cpu, machine_info):
    A, B = w5_cpu
    with Solver(A, rtol=RTOL, device="cpu") as solver:
        first = solver.solve(B)  # the set-up, untimed (made at the first solve)
        assert first.converged
        res = benchmark.pedantic(lambda: solver.solve(B), rounds=ROUNDS, iterations=1,
                                 warmup_rounds=0)
        method = solver.method
    check_columns(A, B, res.x)
    machine_info(benchmark, "cpu", role="repeat", n=A.shape[0], k=CPU_K, method=method,
                 note="a prepared Solver's solve(B) alone")
    record(benchmark, "solver_repeat", anchor="splu")
    if "solver_with_setup" in MEDIANS:
        benchmark.extra_info["fraction_of_with_setup"] = \
            MEDIANS["solver_repeat"] / MEDIANS["solver_with_setup"]


@pytest.mark.benchmark(group="w5-cpu")
def bench_w5_cpu_solve_many_shared(benchmark, w5_cpu, machine_info):
    A, B = w5_cpu
    pairs = [(A, B[:, j].copy()) for j in range(CPU_K)]  # one matrix object, 50 systems
    dm = DeviceManager(["cpu"])

    def run():
        return solve_many(pairs, manager=dm, rtol=RTOL)

    res = run()  # also teaches the manager's hints, as a repeated call would have them
    assert all(r.converged for r in res)
    check_columns(A, B, np.stack([r.to_numpy() for r in res], axis=1))
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", role="ours", n=A.shape[0], k=CPU_K,
                 methods=sorted({r.method for r in res}),
                 target="<= 1.5 x splu once + solve(B)")
    record(benchmark, "solve_many_shared", anchor="splu")


# ------------------------------------------------------------------------------ CPU, Krylov
@pytest.fixture(scope="module")
def w5_cpu_block():
    A = poisson2d(BLOCK_M)
    return A, rhs_block(A.shape[0], BLOCK_K, seed=1)


@pytest.mark.parametrize("M", [None, "neumann"])
@pytest.mark.parametrize("how", ["columns", "block"])
@pytest.mark.benchmark(group="w5-cpu-block")
def bench_w5_cpu_krylov_block(benchmark, w5_cpu_block, machine_info, M, how):
    A, B = w5_cpu_block
    with Solver(A, method="cg", M=M, rtol=RTOL, device="cpu") as solver:
        if how == "block":
            def run():
                return solver.solve(B).x
        else:
            def run():
                return np.stack([solver.solve(B[:, j]).x for j in range(BLOCK_K)], axis=1)
        t0 = time.perf_counter()
        X = run()
        cold = time.perf_counter() - t0
        check_columns(A, B, X)
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
        path = solver.solve(B).info.get("path")
    key = f"cpu_{M}_{how}"
    machine_info(benchmark, "cpu", role="anchor" if how == "columns" else "ours", n=A.shape[0],
                 k=BLOCK_K, M=M, path=path if how == "block" else "one column a call",
                 cold_first_call_s=cold)
    record(benchmark, key, anchor=f"cpu_{M}_columns" if how == "block" else None)


# ------------------------------------------------------------------------------ one GPU
def _cupy():
    from managed_solve import _backend

    return _backend.cupy()


@pytest.fixture(scope="module")
def w5_gpu():
    cp = _cupy()
    import cupyx.scipy.sparse as csp

    A_h = poisson2d(GPU_M)
    B_h = rhs_block(A_h.shape[0], GPU_K)
    with cp.cuda.Device(0):
        return A_h, B_h, csp.csr_matrix(A_h), cp.asarray(B_h)


def _check_gpu(A_h, B_h, X) -> None:
    check_columns(A_h, B_h, _cupy().asnumpy(X), rtol=RTOL * 1.01)


@pytest.mark.gpu
@pytest.mark.benchmark(group="w5-gpu")
def bench_w5_gpu_separate_solves_anchor(benchmark, w5_gpu, machine_info):
    A_h, B_h, A, B = w5_gpu
    cp = _cupy()

    def run():
        with cp.cuda.Device(0):
            out = [solve(A, B[:, j], method="cg", rtol=RTOL, device="cuda:0")
                   for j in range(GPU_K)]
            sync()
        return out

    t0 = time.perf_counter()
    res = run()  # warm-up (kernels compiled) and answer check
    cold = time.perf_counter() - t0
    assert all(r.converged for r in res)
    _check_gpu(A_h, B_h, cp.stack([r.x for r in res], axis=1))
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cuda", role="anchor", n=A_h.shape[0], k=GPU_K,
                 iterations=[int(r.iterations) for r in res][:4], cold_first_call_s=cold,
                 note=f"{GPU_K} separate solve() calls, method='cg'")
    record(benchmark, "separate")


@pytest.mark.gpu
@pytest.mark.benchmark(group="w5-gpu")
def bench_w5_gpu_solver_block(benchmark, w5_gpu, machine_info):
    A_h, B_h, A, B = w5_gpu
    cp = _cupy()

    def run():
        with cp.cuda.Device(0), Solver(A, method="cg", rtol=RTOL, device="cuda:0") as solver:
            out = solver.solve(B)
            sync()
        return out

    t0 = time.perf_counter()
    res = run()
    cold = time.perf_counter() - t0
    assert res.converged and res.x.shape == B.shape
    _check_gpu(A_h, B_h, res.x)
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cuda", role="ours", n=A_h.shape[0], k=GPU_K,
                 iterations=[int(i) for i in res.iterations][:4], path=res.info.get("path"),
                 host_syncs=res.info.get("host_syncs"), cold_first_call_s=cold,
                 target=f">= 8 x the throughput of {GPU_K} separate solve() calls")
    record(benchmark, "block", anchor="separate")
    if "separate" in MEDIANS:
        benchmark.extra_info["throughput_ratio"] = MEDIANS["separate"] / MEDIANS["block"]


@pytest.mark.gpu
@pytest.mark.benchmark(group="w5-gpu")
def bench_w5_gpu_solver_block_repeat(benchmark, w5_gpu, machine_info):
    A_h, B_h, A, B = w5_gpu
    cp = _cupy()
    with cp.cuda.Device(0), Solver(A, method="cg", rtol=RTOL, device="cuda:0") as solver:
        def run():
            out = solver.solve(B)
            sync()
            return out

        t0 = time.perf_counter()
        res = run()
        cold = time.perf_counter() - t0
        assert res.converged
        _check_gpu(A_h, B_h, res.x)
        benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cuda", role="repeat", n=A_h.shape[0], k=GPU_K,
                 path=res.info.get("path"), cold_first_call_s=cold,
                 note="a prepared Solver's solve(B) alone")
    record(benchmark, "block_repeat", anchor="separate")
    if "separate" in MEDIANS:
        benchmark.extra_info["throughput_ratio"] = MEDIANS["separate"] / MEDIANS["block_repeat"]


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["first", "repeat"])
@pytest.mark.benchmark(group="w5-direct")
def bench_w5_gpu_direct(benchmark, w5_gpu, machine_info, which):
    pytest.importorskip("nvmath.sparse.advanced", reason="cuDSS needs nvmath-python")
    from managed_solve.solvers import release_factorisations

    A_h, B_h, A, B = w5_gpu
    cp = _cupy()
    b = B[:, 0].copy()
    held: list[Solver] = []

    def fresh():  # untimed: a new Solver, no factorisation kept from before
        for s in held:
            s.close()
        held.clear()
        release_factorisations()
        held.append(Solver(A, method="direct", rtol=RTOL, device="cuda:0"))

    def run():
        with cp.cuda.Device(0):
            out = held[-1].solve(b)
            sync()
        return out

    fresh()
    res = run()
    assert res.converged, res
    _check_gpu(A_h, B_h[:, :1], res.x[:, None])
    if which == "first":
        benchmark.pedantic(run, setup=fresh, rounds=3, iterations=1, warmup_rounds=0)
    else:
        benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    info = dict(res.info)
    for s in held:
        s.close()
    release_factorisations()
    machine_info(benchmark, "cuda", role="anchor" if which == "first" else "ours",
                 n=A_h.shape[0], factorisation=info.get("factorisation"),
                 target="repeat <= 5 % of first")
    record(benchmark, f"direct_{which}", anchor="direct_first" if which == "repeat" else None)
