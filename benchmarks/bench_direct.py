"""Direct sparse solves on the GPU: ``solve(method="direct")`` through cuDSS against the anchors.

One 2D 5-point Poisson system, factorisation and solve in every call (the
public ``solve()``, its final residual check included):

- N = 40k: ours (cuDSS through nvmath-python) vs ``cupyx.scipy.sparse.linalg.spsolve``
  (cuSOLVER's sparse QR), both on the GPU;
- N = 250k: ours vs ``scipy.sparse.linalg.spsolve`` (SuperLU, COLAMD) on the host
  CPU, where cupyx's QR is too slow to time.

``cudss`` analyses the matrix in every call (the kept analyses are released
before each round, untimed); ``cudss_kept`` solves a matrix solved before,
whose analysis and factors cuDSS kept (a new right-hand side each round, as
in time stepping), so only the solve phase and the residual check remain.

Skipped where nvmath-python (and cuDSS) is not installed: ``solve`` would then
take cupyx's path, which is the anchor itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import _backend, solve
from managed_solve.solvers import release_factorisations

CASES = [("cudss", 200), ("cudss_kept", 200), ("cupyx", 200),
         ("cudss", 500), ("cudss_kept", 500), ("scipy", 500)]


def poisson2d(m):
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr()


@pytest.mark.gpu
@pytest.mark.parametrize("who,m", CASES, ids=[f"{w}-{m}" for w, m in CASES])
def bench_direct_gpu(benchmark, machine_info, who, m):
    pytest.importorskip("nvmath.sparse.advanced", reason="cuDSS needs nvmath-python")
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp
    import cupyx.scipy.sparse.linalg as cspla

    A_h = poisson2d(m)
    x_true = np.random.default_rng(0).standard_normal(A_h.shape[0])
    b_h = A_h @ x_true
    A, b = csp.csr_matrix(A_h), cp.asarray(b_h)

    def ours():
        res = solve(A, b, method="direct")
        cp.cuda.Device().synchronize()
        return res

    def cupyx():
        x = cspla.spsolve(A, b)
        cp.cuda.Device().synchronize()
        return x

    def scipy():
        return spla.spsolve(A_h.tocsc(), b_h)

    ours_ = who.startswith("cudss")
    fn = ours if ours_ else {"cupyx": cupyx, "scipy": scipy}[who]
    release_factorisations()
    out = fn()  # warm-up, and the answer checked once
    x = out.x if ours_ else out
    if ours_:
        assert out.info["factorisation"] == "cuDSS (nvmath-python)", out.info
        assert fn().info["cudss_reused"] == "factors"  # the same matrix: kept
    x = cp.asnumpy(x) if not isinstance(x, np.ndarray) else x
    np.testing.assert_allclose(x, x_true, rtol=1e-6, atol=1e-6)
    benchmark.group = f"direct-{A_h.shape[0] // 1000}k"  # set before timing: read when it starts

    def fresh():  # untimed: every round analyses the matrix again
        release_factorisations()

    setup = fresh if who == "cudss" else None
    benchmark.pedantic(fn, setup=setup, rounds=5 if m <= 200 else 3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu" if who == "scipy" else "cuda", n=A_h.shape[0], nnz=A_h.nnz,
                 role="candidate" if ours_ else "anchor", who=who)


# ------------------------------------------------------------------------------ CPU
# A prepared direct Solver on the host: its set-up (ordering, symbolic analysis
# and numeric factorisation of our supernodal Cholesky) against update() with
# new values on the same pattern (numeric factorisation only; target at most
# 40 % of the set-up), and SciPy's splu (SuperLU, its default COLAMD) as the
# anchor of the same run.
CPU_SIZES = [127, 255, 511]
CPU_ROUNDS = 5
# Medians of this run by (entry, m), so later entries record their ratios.
CPU_MEDIANS: dict[tuple[str, int], float] = {}


def _cpu_record(benchmark, who: str, m: int, anchor: str | None = None, **extra) -> None:
    median = benchmark.stats.stats.median
    CPU_MEDIANS[(who, m)] = median
    benchmark.extra_info.update(extra)
    if anchor is not None and (anchor, m) in CPU_MEDIANS:
        benchmark.extra_info[f"ratio_vs_{anchor}"] = median / CPU_MEDIANS[(anchor, m)]


@pytest.mark.benchmark(group="direct-cpu")
@pytest.mark.parametrize("m", CPU_SIZES)
def bench_direct_cpu_splu_anchor(benchmark, machine_info, m):
    A = poisson2d(m)
    benchmark.pedantic(lambda: spla.splu(A.tocsc()), rounds=CPU_ROUNDS, iterations=1,
                       warmup_rounds=1)
    machine_info(benchmark, "cpu", role="anchor", n=A.shape[0], note="scipy splu(A) (COLAMD)")
    _cpu_record(benchmark, "splu", m)


@pytest.mark.benchmark(group="direct-cpu")
@pytest.mark.parametrize("m", CPU_SIZES)
def bench_direct_cpu_setup(benchmark, machine_info, m):
    from managed_solve import Solver

    A = poisson2d(m)

    def run():
        solver = Solver(A, method="direct", device="cpu")
        solver.close()
        return solver

    benchmark.pedantic(run, rounds=CPU_ROUNDS, iterations=1, warmup_rounds=1)
    with Solver(A, method="direct", device="cpu") as solver:
        res = solver.solve(np.ones(A.shape[0]))
        assert res.converged
    machine_info(benchmark, "cpu", role="ours", n=A.shape[0],
                 factorisation=res.info["factorisation"], note="Solver(A, method='direct')")
    _cpu_record(benchmark, "setup", m, anchor="splu")


@pytest.mark.benchmark(group="direct-cpu")
@pytest.mark.parametrize("m", CPU_SIZES)
def bench_direct_cpu_update(benchmark, machine_info, m):
    from managed_solve import Solver

    A = poisson2d(m)
    A2 = A.copy()
    A2.setdiag(A.diagonal() + np.linspace(0.1, 1.0, A.shape[0]))  # new values, same pattern
    assert np.array_equal(A2.indices, A.indices)
    with Solver(A, method="direct", device="cpu") as solver:
        values = [A2, A]  # alternate, so that each round's values are new
        turn = iter(range(1 << 30))
        benchmark.pedantic(lambda: solver.update(values[next(turn) % 2]), rounds=CPU_ROUNDS,
                           iterations=1, warmup_rounds=1)
        solver.update(A2)
        b = np.ones(A.shape[0])
        res = solver.solve(b)
        assert res.converged and np.linalg.norm(b - A2 @ res.x) <= 1e-8 * np.linalg.norm(b)
    machine_info(benchmark, "cpu", role="ours", n=A.shape[0],
                 factorisation=res.info["factorisation"], target="<= 0.4 x the set-up",
                 note="solver.update(A2): same pattern, new values")
    _cpu_record(benchmark, "update", m, anchor="splu")
    if ("setup", m) in CPU_MEDIANS:
        benchmark.extra_info["ratio_vs_setup"] = CPU_MEDIANS[("update", m)] / CPU_MEDIANS[("setup", m)]
