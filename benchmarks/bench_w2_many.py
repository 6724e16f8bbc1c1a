"""W2: many small 2D Poisson systems through ``solve_many`` (benchmarks/README.md), anchors in the same run.

Groups (each compares seconds per system, so an anchor timed on a subset
compares fairly; ``report.py`` reads ``per_iteration_s``, which here holds
seconds per system, and ``extra_info["metric"]`` says so):

- ``w2-cpu``: ``solve_many`` on the CPU only, over 120 of the systems
  (``BENCH_W2_CPU_SYSTEMS``), each with its own matrix object, vs a loop of
  ``scipy.sparse.linalg.spsolve`` and a loop of ``scipy.sparse.linalg.cg``
  to the same rtol (target: at least 2 x faster than both); also ours on one
  host thread (``extra_info["threads_speedup"]``: the second thread's gain,
  never below 1), ours with new matrix objects each round (as a user's next
  call brings them) and, labelled, ours with one matrix object per size (where
  "auto" factorises the sizes that several systems share), also with the
  setting ``host_blas_threads=1``; each
  entry records the machine's load average when it ran (ours uses both
  cores, the loops one: another process on a 2-core host moves the ratios);
- ``w2-gpu``: ``solve_many`` on one GPU, each system with its own matrix
  object (and, labelled, one matrix object per size), vs a loop of cupyx
  ``cg`` (timed on 40 of the 400 systems, every tenth, and scaled; target at
  most 1/100), vs one cupyx ``cg`` over the block-diagonal matrix of all 400
  (one global residual, the matrix built and moved before timing; target at
  most 0.25 x, ``extra_info["ours_vs_block_diagonal"]``), the same anchor
  timed from users' inputs (block-diagonal assembly, transfer and the split
  of x timed too, ``ours_vs_block_diagonal_from_inputs``) and vs JAX's
  ``jax.jit(jax.vmap(cg))`` over the systems padded to the largest, each at its
  own rtol (``jax_anchor.py``; target at most 0.2 x, recorded as
  ``extra_info["ours_vs_jax"]``). The CPU group runs the same JAX code on
  JAX's CPU device, so the anchor's path runs without a GPU;
- ``w2-large``: 10,000 systems plus four of 1M unknowns on one GPU vs two
  (target: two at least 1.8 x faster).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from jax_anchor import (
    jax_device,
    pad_systems,
    relative_residuals,
    scipy_cg_iterations,
    solve_padded,
    unpad,
)

from conftest import GPU_COUNT, sync
from managed_solve import LinearSystem, config, solve_many
from managed_solve.manager import DeviceManager

RTOL = 1e-8
# Medians of five rounds: GPU machines' hosts vary by 10-30% from round to round.
ROUNDS = 5


def poisson2d(m: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 4.0, -1.0], [-1, 0, 1], shape=(m, m))
    S = sp.diags([-1.0, -1.0], [-1, 1], shape=(m, m))
    A = (sp.kron(sp.identity(m), T) + sp.kron(S, sp.identity(m))).tocsr()
    A.indices = A.indices.astype(np.int32)
    A.indptr = A.indptr.astype(np.int32)
    return A


def w2_sizes(count: int = 400, seed: int = 0) -> list[int]:
    return [int(m) for m in np.random.default_rng(seed).integers(32, 97, size=count)]


def w2_pairs(sizes: list[int]) -> list[tuple[sp.csr_matrix, np.ndarray]]:
    cache: dict[int, sp.csr_matrix] = {}
    out = []
    for m in sizes:
        if m not in cache:
            cache[m] = poisson2d(m)
        out.append((cache[m], np.ones(m * m)))
    return out


def per_system(benchmark, count: int, **extra) -> None:
    """Record seconds per system (the report's comparable metric) and the sizes."""
    benchmark.extra_info["per_iteration_s"] = benchmark.stats.stats.median / count
    benchmark.extra_info["metric"] = "per_iteration_s holds seconds per system"
    benchmark.extra_info["systems_timed"] = count
    benchmark.extra_info.update(extra)


def time_solver_loop(benchmark, machine_info, kind: str, loop, systems: int, timed: int) -> None:
    """An anchor that loops a library solver over every tenth system (``loop() -> [(x, info)]``).

    The first call checks the solver converged (info 0) and warms it up;
    seconds per system make it comparable with ours over all ``systems``.
    """
    x, info = loop()[0]
    assert info == 0
    benchmark.pedantic(loop, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, kind, role="anchor", dtype="float64", systems=systems,
                 note=f"timed on every tenth system ({timed}) and compared per system")
    per_system(benchmark, timed)


def check_own_rtol(pairs, results) -> None:
    for (A, b), r in zip(pairs, results, strict=True):
        x = r.to_numpy()
        assert r.converged, r
        assert np.linalg.norm(b - A @ x) <= RTOL * np.linalg.norm(b)


# ------------------------------------------------------------------------------ CPU
# The CPU group solves W2_CPU_SYSTEMS of W2's systems (the first of the same
# draw), each with its own matrix object, as users have them; the shared
# variant (one matrix object per size) is kept apart and labelled.
W2_CPU_SYSTEMS = int(os.environ.get("BENCH_W2_CPU_SYSTEMS", "120"))
# Medians of this run by entry, so later entries record their ratio to the
# anchors timed before them in the same run (benchmarks run in file order).
MEDIANS: dict[str, float] = {}


@pytest.fixture(scope="module")
def w2():
    sizes = w2_sizes()
    return sizes, w2_pairs(sizes)


@pytest.fixture(scope="module")
def w2_cpu():
    sizes = w2_sizes()[:W2_CPU_SYSTEMS]
    return sizes, [(poisson2d(m), np.ones(m * m)) for m in sizes]


def cpu_entry(benchmark, machine_info, key: str, pairs, sizes, role: str, **extra) -> None:
    """Record a CPU entry: seconds per system, its median for later entries, ratios to the anchors."""
    median = benchmark.stats.stats.median
    MEDIANS[key] = median
    ratios = {f"ratio_vs_{a}": median / MEDIANS[a] for a in ("spsolve_loop", "cg_loop") if a in MEDIANS
              and a != key}
    machine_info(benchmark, "cpu", role=role, dtype="float64", systems=len(pairs),
                 unknowns=int(sum(m * m for m in sizes)), load_average=os.getloadavg(),
                 **ratios, **extra)
    per_system(benchmark, len(pairs))


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_spsolve_loop(benchmark, w2_cpu, machine_info):
    sizes, pairs = w2_cpu
    x = spla.spsolve(pairs[0][0], pairs[0][1])
    assert np.linalg.norm(pairs[0][1] - pairs[0][0] @ x) <= RTOL * np.linalg.norm(pairs[0][1])
    benchmark.pedantic(lambda: [spla.spsolve(A, b) for A, b in pairs], rounds=ROUNDS,
                       iterations=1, warmup_rounds=1)
    cpu_entry(benchmark, machine_info, "spsolve_loop", pairs, sizes, "anchor")


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_cg_loop(benchmark, w2_cpu, machine_info):
    """The other loop users write: SciPy's cg, one system at a time, to the same rtol."""
    sizes, pairs = w2_cpu
    benchmark.pedantic(lambda: [spla.cg(A, b, rtol=RTOL) for A, b in pairs], rounds=ROUNDS,
                       iterations=1, warmup_rounds=1)
    cpu_entry(benchmark, machine_info, "cg_loop", pairs, sizes, "anchor")


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_solve_many(benchmark, w2_cpu, machine_info):
    """Ours, one matrix per system (target: at most half of either loop)."""
    sizes, pairs = w2_cpu
    dm = DeviceManager(["cpu"])
    first = solve_many(pairs, manager=dm, rtol=RTOL)
    check_own_rtol(pairs, first)  # also warms up
    benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL), rounds=ROUNDS,
                       iterations=1, warmup_rounds=0)
    methods = sorted({r.method for r in first})
    cpu_entry(benchmark, machine_info, "ours", pairs, sizes, "ours", methods=methods,
              host_threads=config.current().host_threads or os.cpu_count(),
              target="<= 0.5 of the spsolve loop and <= 0.5 of the cg loop")


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_solve_many_fresh_objects(benchmark, w2_cpu, machine_info):
    """Ours with new matrix objects every round, as a user's next call brings them: nothing is
    cached on them (SciPy's pattern flags) from an earlier round. Their making is not timed."""
    sizes, pairs = w2_cpu
    dm = DeviceManager(["cpu"])
    check_own_rtol(pairs, solve_many(pairs, manager=dm, rtol=RTOL))

    def fresh():
        made = [(sp.csr_matrix((A.data.copy(), A.indices.copy(), A.indptr.copy()), shape=A.shape), b)
                for A, b in pairs]
        return (made,), {}

    benchmark.pedantic(lambda new: solve_many(new, manager=dm, rtol=RTOL), setup=fresh,
                       rounds=ROUNDS, iterations=1, warmup_rounds=0)
    extra = {}
    if "ours" in MEDIANS:
        extra["vs_same_objects"] = benchmark.stats.stats.median / MEDIANS["ours"]
    cpu_entry(benchmark, machine_info, "ours_fresh", pairs, sizes,
              "ours, new matrix objects each round", **extra)


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_solve_many_one_thread(benchmark, w2_cpu, machine_info):
    """Ours on one host thread: the threads' gain in the same run (never below 1)."""
    sizes, pairs = w2_cpu
    dm = DeviceManager(["cpu"])
    with config.override(host_threads=1):
        check_own_rtol(pairs, solve_many(pairs, manager=dm, rtol=RTOL))
        benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL), rounds=ROUNDS,
                           iterations=1, warmup_rounds=0)
    extra = {}
    if "ours" in MEDIANS:
        extra["threads_speedup"] = benchmark.stats.stats.median / MEDIANS["ours"]
    cpu_entry(benchmark, machine_info, "ours_one_thread", pairs, sizes, "ours, one thread", **extra)


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_solve_many_shared_matrices(benchmark, w2_cpu, machine_info):
    """The same systems with one matrix object per size: measures a cache, not users' inputs."""
    sizes, _pairs = w2_cpu
    pairs = w2_pairs(sizes)
    dm = DeviceManager(["cpu"])
    first = solve_many(pairs, manager=dm, rtol=RTOL)
    check_own_rtol(pairs, first)
    benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL), rounds=ROUNDS,
                       iterations=1, warmup_rounds=0)
    cpu_entry(benchmark, machine_info, "ours_shared", pairs, sizes,
              "ours, shared matrices (labelled variant)", methods=sorted({r.method for r in first}))


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_solve_many_shared_matrices_one_blas_thread(benchmark, w2_cpu, machine_info):
    """The shared variant with ``host_blas_threads=1``: the host LUs' BLAS off the batched kernels' cores."""
    sizes, _pairs = w2_cpu
    pairs = w2_pairs(sizes)
    dm = DeviceManager(["cpu"])
    with config.override(host_blas_threads=1):
        first = solve_many(pairs, manager=dm, rtol=RTOL)
        check_own_rtol(pairs, first)
        benchmark.pedantic(lambda: solve_many(pairs, manager=dm, rtol=RTOL), rounds=ROUNDS,
                           iterations=1, warmup_rounds=0)
    extra = {}
    if "ours_shared" in MEDIANS:
        extra["vs_default_blas_threads"] = benchmark.stats.stats.median / MEDIANS["ours_shared"]
    cpu_entry(benchmark, machine_info, "ours_shared_one_blas_thread", pairs, sizes,
              "ours, shared matrices, host_blas_threads=1 (labelled variant)",
              methods=sorted({r.method for r in first}), **extra)


def time_jax_vmap_cg(benchmark, pairs, kind: str) -> dict:
    """Time JAX's ``jit(vmap(cg))`` anchor on ``pairs`` (each at RTOL) on JAX's first ``kind`` device.

    Counted like the cupyx anchors: set-up is not timed. Padding on the host
    (``pad_s``), the host-to-device transfer of the padded arrays
    (``transfer_s``) and the first call, with tracing and XLA compilation
    (``first_call_s``), are recorded apart; the timed call is the jitted solve
    on device-resident arrays, solutions left on the device. Afterwards every
    system's true relative residual, in float64 with SciPy on the host, must
    meet its own rtol. Returns the extra_info entries.
    """
    jax = pytest.importorskip("jax")
    device = jax_device(kind)
    if device is None:
        pytest.skip(f"JAX has no {kind} device")
    t0 = time.perf_counter()
    padded = pad_systems(pairs, RTOL)
    pad_s = time.perf_counter() - t0
    run, _args, _x, timings = solve_padded(padded, device)
    x = benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    relres = relative_residuals(pairs, unpad(padded, np.asarray(x)))
    worst = int(np.argmax(relres / padded.tol))
    assert np.all(relres <= padded.tol), (
        f"system {worst} (n={padded.sizes[worst]}): relres {relres[worst]:.3e} > rtol {padded.tol[worst]:.1e}")
    iters = scipy_cg_iterations(pairs, padded.tol)
    S, nnz_max = padded.values.shape
    return {
        "jax": jax.__version__, "jax_device": str(device), "pad_s": pad_s, **timings,
        "first_call_minus_warm_s": timings["first_call_s"] - benchmark.stats.stats.median,
        "max_relres": float(relres.max()), "max_relres_over_rtol": float(relres[worst] / padded.tol[worst]),
        "iterations_max": int(iters.max()), "iterations_min": int(iters.min()),
        "iterations_source": "SciPy cg from zero with the same stopping rule (JAX's cg returns no count); "
                             "vmap steps every system until the last one stops",
        "n_max": int(padded.b.shape[1]), "nnz_max": int(nnz_max),
        "padded_fraction": float(1 - sum(sp.csr_matrix(A).nnz for A, _b in pairs) / (S * nnz_max)),
        "timed": "jit(vmap(cg)) on device-resident padded arrays; padding, transfer, compilation apart",
    }


@pytest.mark.benchmark(group="w2-cpu")
def bench_w2_cpu_jax_vmap_cg(benchmark, w2_cpu, machine_info):
    """JAX's ``jit(vmap(cg))`` on JAX's CPU device: the GPU anchor's code, run where it can be tested."""
    sizes, pairs = w2_cpu
    extra = time_jax_vmap_cg(benchmark, pairs, "cpu")
    if "ours" in MEDIANS:
        extra["ours_vs_jax"] = MEDIANS["ours"] / benchmark.stats.stats.median
    cpu_entry(benchmark, machine_info, "jax_vmap_cg", pairs, sizes, "jax-vmap-cg", **extra)


# ------------------------------------------------------------------------------ one GPU
def _gpu_modules():
    from managed_solve import _backend

    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp
    import cupyx.scipy.sparse.linalg as cspla

    return cp, csp, cspla


@pytest.fixture(scope="module")
def w2_gpu(w2):
    cp, csp, _ = _gpu_modules()
    sizes, pairs = w2
    with cp.cuda.Device(0):
        return sizes, pairs, [(csp.csr_matrix(A), cp.asarray(b)) for A, b in pairs]


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-gpu")
def bench_w2_gpu_cupyx_cg_loop(benchmark, w2_gpu, machine_info):
    cp, _csp, cspla = _gpu_modules()
    sizes, _pairs, dev_pairs = w2_gpu
    subset = dev_pairs[::10]  # 40 of 400: the full loop takes ~12 s a round

    def loop():
        with cp.cuda.Device(0):
            out = [cspla.cg(A, b, rtol=RTOL) for A, b in subset]
            sync()
        return out

    time_solver_loop(benchmark, machine_info, "cuda", loop, len(dev_pairs), len(subset))


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-gpu")
def bench_w2_gpu_cupyx_cg_block_diagonal(benchmark, w2_gpu, machine_info):
    cp, csp, cspla = _gpu_modules()
    _sizes, pairs, _dev = w2_gpu
    with cp.cuda.Device(0):
        A = csp.csr_matrix(sp.block_diag([A for A, _b in pairs], format="csr"))
        b = cp.ones(A.shape[0])

    def run():
        with cp.cuda.Device(0):
            out = cspla.cg(A, b, rtol=RTOL)
            sync()
        return out

    assert run()[1] == 0
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    MEDIANS["gpu_block_diagonal"] = benchmark.stats.stats.median
    machine_info(benchmark, "cuda", role="block-diagonal", dtype="float64", systems=len(pairs),
                 note="one global residual: systems do not converge individually; "
                      "the matrix built and moved before timing")
    per_system(benchmark, len(pairs))


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-gpu")
def bench_w2_gpu_cupyx_cg_block_diagonal_from_inputs(benchmark, w2_own, machine_info):
    """The block-diagonal anchor from the systems as users have them, timed like ours.

    From the 400 (A, b) pairs on the host to 400 solutions on the GPU: the
    block-diagonal matrix and the stacked b built (SciPy) and moved, one
    cupyx ``cg`` (one global residual), the solution split back into
    per-system views. Ours is timed over the same span.
    """
    cp, csp, cspla = _gpu_modules()
    _sizes, pairs = w2_own
    bounds = np.cumsum([0] + [A.shape[0] for A, _b in pairs])

    def run():
        with cp.cuda.Device(0):
            A = csp.csr_matrix(sp.block_diag([A for A, _b in pairs], format="csr"))
            b = cp.asarray(np.concatenate([b for _A, b in pairs]))
            x, info = cspla.cg(A, b, rtol=RTOL)
            xs = [x[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
            sync()
        return xs, info

    xs, info = run()
    assert info == 0 and len(xs) == len(pairs)
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    MEDIANS["gpu_block_diagonal_from_inputs"] = benchmark.stats.stats.median
    machine_info(benchmark, "cuda", role="block-diagonal, from users' inputs", dtype="float64",
                 systems=len(pairs), note="assembly, transfer, one global cg, split: as ours is timed")
    per_system(benchmark, len(pairs))


@pytest.fixture(scope="module")
def w2_own(w2):
    """W2's systems, each with its own matrix object, as users have them."""
    sizes, _shared = w2
    return sizes, [(poisson2d(m), np.ones(m * m)) for m in sizes]


@pytest.mark.gpu
@pytest.mark.parametrize("matrices", ["per-system", "shared"])
@pytest.mark.benchmark(group="w2-gpu")
def bench_w2_gpu_solve_many(benchmark, w2, w2_own, matrices, machine_info):
    """Ours; "shared" (one matrix object per size) measures a cache, not users' inputs, and is labelled."""
    sizes, pairs = w2_own if matrices == "per-system" else w2
    dm = DeviceManager(["cuda:0"])
    check_own_rtol(pairs, solve_many(pairs, manager=dm, rtol=RTOL))  # warm-up and answer check

    def run():
        out = solve_many(pairs, manager=dm, rtol=RTOL)
        sync()
        return out

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    MEDIANS[f"gpu_ours_{matrices}"] = median = benchmark.stats.stats.median
    res = run()
    ratios = {f"ours_vs_{a}": median / MEDIANS[f"gpu_{a}"]
              for a in ("block_diagonal", "block_diagonal_from_inputs") if f"gpu_{a}" in MEDIANS}
    machine_info(benchmark, "cuda", role="ours" if matrices == "per-system" else "ours, shared matrices",
                 dtype="float64", systems=len(pairs), matrices=matrices,
                 batches=len({r.info["batch"] for r in res}), **ratios,
                 target="<= 1/100 of the cupyx loop, <= 0.25 x block-diagonal cupyx cg, <= 0.2 x JAX vmap(cg)")
    per_system(benchmark, len(pairs))


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-gpu")
def bench_w2_gpu_jax_vmap_cg(benchmark, w2_own, machine_info):
    """JAX's ``jax.jit(jax.vmap(cg))`` over the 400 systems padded to 96^2, each at its own rtol.

    Skipped without JAX or a JAX GPU device. Set-up is counted as for the
    block-diagonal cupyx anchor (matrix built and moved before timing):
    padding, transfer and the first call with XLA compilation are in
    extra_info, the timed call is the jitted solve on the device. Ours, timed
    before it in this run, is recorded as ``ours_vs_jax`` (target <= 0.2).
    """
    _sizes, pairs = w2_own
    extra = time_jax_vmap_cg(benchmark, pairs, "gpu")
    median = benchmark.stats.stats.median
    for matrices, key in (("per-system", "ours_vs_jax"), ("shared", "ours_shared_vs_jax")):
        if f"gpu_ours_{matrices}" in MEDIANS:
            extra[key] = MEDIANS[f"gpu_ours_{matrices}"] / median
    machine_info(benchmark, "cuda", role="jax-vmap-cg", dtype="float64", systems=len(pairs),
                 target="ours <= 0.2 x this", **extra)
    per_system(benchmark, len(pairs))


@pytest.mark.gpu
@pytest.mark.benchmark(group="w2-gpu")
def bench_w2_gpu_cudss_batch(benchmark, w2_own, machine_info):
    """cuDSS's non-uniform batch (nvmath-python's ``DirectSolver`` over the 400 matrices at once).

    Skipped without nvmath-python and cuDSS. The matrices and right-hand
    sides are on the GPU before timing (as for the block-diagonal anchor);
    the timed call is one batched direct solve: analysis, factorisation and
    solve of every system, as a first solve of new matrices needs. The
    solutions are checked against each system's rtol before timing. Ours,
    timed before it in this run, is recorded as ``ours_vs_cudss``.
    """
    advanced = pytest.importorskip("nvmath.sparse.advanced")
    cp, csp, _ = _gpu_modules()
    _sizes, pairs = w2_own
    with cp.cuda.Device(0):
        mats = [csp.csr_matrix(A) for A, _b in pairs]
        rhs = [cp.asarray(b) for _A, b in pairs]
    kind = advanced.DirectSolverMatrixType
    options = advanced.DirectSolverOptions(sparse_system_type=kind.SPD,
                                           logger=logging.getLogger("bench.cudss"))

    def run():
        with cp.cuda.Device(0):
            xs = advanced.direct_solver(mats, rhs, options=options)
            sync()
        return xs

    xs = run()
    for (A, b), x in zip(pairs, xs, strict=True):
        assert np.linalg.norm(b - A @ cp.asnumpy(x)) <= RTOL * np.linalg.norm(b)
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    median = benchmark.stats.stats.median
    extra = {}
    for matrices, key in (("per-system", "ours_vs_cudss"), ("shared", "ours_shared_vs_cudss")):
        if f"gpu_ours_{matrices}" in MEDIANS:
            extra[key] = MEDIANS[f"gpu_ours_{matrices}"] / median
    machine_info(benchmark, "cuda", role="cudss-batch", dtype="float64", systems=len(pairs),
                 note="one nvmath DirectSolver over the 400 matrices (SPD), operands on the GPU "
                      "before timing; analysis, factorisation and solve timed", **extra)
    per_system(benchmark, len(pairs))


# ------------------------------------------------------------------------------ two GPUs
@pytest.fixture(scope="module")
def w2_large():
    sizes = w2_sizes(10_000, seed=1)
    systems = [LinearSystem(A, b, rtol=RTOL) for A, b in w2_pairs(sizes)]
    big = poisson2d(1024)
    systems += [LinearSystem(big, np.ones(1024 * 1024), rtol=RTOL) for _ in range(4)]
    return systems


# One GPU runs on any GPU machine (a figure to follow between two-GPU runs);
# with two GPUs both runs share one manager holding both, as the target's
# ratio was always measured.
@pytest.mark.parametrize("ngpus", [pytest.param(1, marks=pytest.mark.gpu),
                                   pytest.param(2, marks=pytest.mark.multi_gpu)])
def bench_w2_large_gpus(benchmark, w2_large, ngpus, machine_info):
    dm = DeviceManager(["cuda:0", "cuda:1"][:max(ngpus, min(GPU_COUNT, 2))])
    devices = ["cuda:0", "cuda:1"][:ngpus]
    first = solve_many(w2_large, devices=devices, manager=dm)  # warm-up; teaches the hints
    assert all(r.converged for r in first)

    def run():
        out = solve_many(w2_large, devices=devices, manager=dm)
        for d in devices:
            from managed_solve import _backend

            _backend.synchronize(int(d.split(":")[1]))
        return out

    benchmark.group = "w2-large"
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cuda", role="anchor" if ngpus == 1 else "ours", gpus=ngpus,
                 systems=len(w2_large), target="two GPUs >= 1.8 x one")
    per_system(benchmark, len(w2_large))
