"""Polynomial preconditioning of CG: time to solution against Jacobi-CG (why ``M="chebyshev"`` is refused).

2D Poisson (``bench_w2_many.poisson2d``), b all ones, rtol 1e-8, float64.
The polynomial is the Chebyshev one of the AMG smoother
(``solvers.amg.smoothers.make_smoother``) applied from a zero guess,
``p(D^-1 A) D^-1`` of degree d on ``[rho / ratio, rho]`` with rho from
Lanczos (plus the smoother's 10% margin) and ratio ``1.2 (d + 1)^2``, which
keeps about 90% of the best condition-number reduction ``(d + 1)^2``. It
runs inside the library's generic CG loop (``solvers.cg.cg``), the loop any
user preconditioner runs in.

Groups (anchors timed in the same run; ``extra_info`` records iterations,
matrix-vector products, and each entry's ratio to the anchors' medians):

- ``polynomial-cpu``: m = 255 (n = 65,025). Anchor: ``scipy.sparse.linalg.cg``
  with a Jacobi ``LinearOperator``. Also ours: ``solve(M="jacobi")`` (the
  fused core), the generic loop with Jacobi (the same loop as the
  polynomial's, so the polynomial's own effect shows), and the polynomial
  at d = 2, 4, 8, 16.
- ``polynomial-gpu``: m = 2048 (n = 4.2M), the size at which the
  polynomial was reported slow. Anchor: ``cupyx.scipy.sparse.linalg.cg``
  with Jacobi. Also ours: ``solve(M="jacobi")``, the generic loop with
  Jacobi, the polynomial at d = 4 and 16.

What to read: CG with Jacobi is optimal over the Krylov space the polynomial
draws from, so ``products`` of a polynomial entry is never below Jacobi-CG's
iteration count; its time can drop only if a product is cheaper than a CG
iteration, which the fused Jacobi core rules out. ``ratio_vs_ours_fused``
above 1 means ``M="jacobi"`` wins.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import scipy.sparse.linalg as spla
from bench_w2_many import poisson2d

from conftest import sync
from managed_solve import solve
from managed_solve.solvers.amg.smoothers import make_smoother
from managed_solve.solvers.amg.spectral import spectral_radius
from managed_solve.solvers.cg import cg
from managed_solve.solvers.preconditioners import jacobi

RTOL = 1e-8
ROUNDS = 3
CPU_M, CPU_DEGREES = 255, (2, 4, 8, 16)
GPU_M, GPU_DEGREES = 2048, (4, 16)

MEDIANS: dict[str, float] = {}


def chebyshev_polynomial(A, degree: int, xp):
    """``r -> p(D^-1 A) D^-1 r``: the Chebyshev smoother from a zero guess (degree products)."""
    dinv = 1.0 / A.diagonal()
    rho = spectral_radius(A, dinv, xp)
    sm = make_smoother("chebyshev", A, dinv, rho, xp, degree=degree,
                       ratio=1.2 * (degree + 1) ** 2)
    x, res, d = (xp.empty(A.shape[0], dtype=A.dtype) for _ in range(3))

    def apply(r):
        sm.apply(A, r, x, res, d, zero=True)
        return x.copy()

    return apply


def check(A, b, x, xp) -> None:
    """The true residual meets the tolerance (a generic-loop stop on the recurrence may lag a little)."""
    r = float(xp.linalg.norm(b - A @ x))
    assert r <= 2 * RTOL * float(xp.linalg.norm(b)), r


def record(benchmark, key: str, *, anchors: tuple[str, ...] = (), **extra) -> None:
    median = benchmark.stats.stats.median
    MEDIANS[key] = median
    benchmark.extra_info.update(extra)
    for a in anchors:
        if a in MEDIANS:
            benchmark.extra_info[f"ratio_vs_{a}"] = median / MEDIANS[a]


def time_it(benchmark, run):
    def timed():
        out = run()
        sync()
        return out

    return benchmark.pedantic(timed, rounds=ROUNDS, iterations=1, warmup_rounds=1)


# ------------------------------------------------------------------------------ CPU
@pytest.fixture(scope="module")
def cpu_problem():
    A = poisson2d(CPU_M)
    return A, np.ones(A.shape[0])


@pytest.mark.benchmark(group="polynomial-cpu")
def bench_poly_cpu_scipy_anchor(benchmark, cpu_problem, machine_info):
    A, b = cpu_problem
    d = A.diagonal()
    M = spla.LinearOperator(A.shape, matvec=lambda v: v / d, dtype=A.dtype)
    count = [0]

    def run():
        count[0] = 0
        x, info = spla.cg(A, b, rtol=RTOL, M=M, callback=lambda xk: count.__setitem__(0, count[0] + 1))
        assert info == 0
        return x

    check(A, b, run(), np)
    time_it(benchmark, run)
    machine_info(benchmark, "cpu", role="anchor", n=A.shape[0], iterations=count[0],
                 products=count[0], note="scipy.sparse.linalg.cg, M = D^-1")
    record(benchmark, "scipy")


@pytest.mark.benchmark(group="polynomial-cpu")
def bench_poly_cpu_ours_fused_jacobi(benchmark, cpu_problem, machine_info):
    A, b = cpu_problem
    res = solve(A, b, method="cg", M="jacobi", rtol=RTOL)
    assert res.converged and res.info["path"] == "batched"
    time_it(benchmark, lambda: solve(A, b, method="cg", M="jacobi", rtol=RTOL))
    machine_info(benchmark, "cpu", role="ours", n=A.shape[0], iterations=res.iterations,
                 products=res.iterations, note='solve(A, b, method="cg", M="jacobi")')
    record(benchmark, "ours_fused", anchors=("scipy",))


@pytest.mark.benchmark(group="polynomial-cpu")
def bench_poly_cpu_generic_jacobi(benchmark, cpu_problem, machine_info):
    A, b = cpu_problem
    M = jacobi(A)
    out = cg(A, b, rtol=RTOL, M=M)
    check(A, b, out.x, np)
    time_it(benchmark, lambda: cg(A, b, rtol=RTOL, M=M))
    machine_info(benchmark, "cpu", role="ours", n=A.shape[0], iterations=out.iterations,
                 products=out.iterations, note="solvers.cg.cg (generic loop), M = D^-1")
    record(benchmark, "generic_jacobi", anchors=("scipy", "ours_fused"))


@pytest.mark.benchmark(group="polynomial-cpu")
@pytest.mark.parametrize("degree", CPU_DEGREES)
def bench_poly_cpu_chebyshev(benchmark, cpu_problem, machine_info, degree):
    A, b = cpu_problem
    M = chebyshev_polynomial(A, degree, np)
    out = cg(A, b, rtol=RTOL, M=M)
    check(A, b, out.x, np)
    time_it(benchmark, lambda: cg(A, b, rtol=RTOL, M=M))
    machine_info(benchmark, "cpu", role="experiment", n=A.shape[0], degree=degree,
                 iterations=out.iterations, products=out.iterations * (degree + 1),
                 note="solvers.cg.cg (generic loop), M = Chebyshev p(D^-1 A) D^-1")
    record(benchmark, f"chebyshev{degree}", anchors=("scipy", "ours_fused", "generic_jacobi"))


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def gpu_problem():
    import cupy as cp
    import cupyx.scipy.sparse as csp

    A = csp.csr_matrix(poisson2d(GPU_M))
    return A, cp.ones(A.shape[0])


@pytest.mark.gpu
@pytest.mark.benchmark(group="polynomial-gpu")
def bench_poly_gpu_cupyx_anchor(benchmark, gpu_problem, machine_info):
    import cupy as cp
    import cupyx.scipy.sparse.linalg as cspla

    A, b = gpu_problem
    d = A.diagonal()
    M = cspla.LinearOperator(A.shape, matvec=lambda v: v / d, dtype=A.dtype)

    # cupy's cg takes ``tol`` in older releases, ``rtol`` in newer ones.
    tol = {"tol" if "tol" in inspect.signature(cspla.cg).parameters else "rtol": RTOL}

    def run():
        x, info = cspla.cg(A, b, M=M, maxiter=100_000, **tol)
        assert info == 0
        return x

    check(A, b, run(), cp)
    time_it(benchmark, run)
    machine_info(benchmark, "cuda", role="anchor", n=A.shape[0],
                 note="cupyx.scipy.sparse.linalg.cg, M = D^-1")
    record(benchmark, "cupyx")


@pytest.mark.gpu
@pytest.mark.benchmark(group="polynomial-gpu")
def bench_poly_gpu_ours_fused_jacobi(benchmark, gpu_problem, machine_info):
    A, b = gpu_problem
    res = solve(A, b, method="cg", M="jacobi", rtol=RTOL)
    assert res.converged and res.info["path"] == "batched"
    time_it(benchmark, lambda: solve(A, b, method="cg", M="jacobi", rtol=RTOL))
    machine_info(benchmark, "cuda", role="ours", n=A.shape[0], iterations=res.iterations,
                 products=res.iterations, note='solve(A, b, method="cg", M="jacobi")')
    record(benchmark, "gpu_ours_fused", anchors=("cupyx",))


@pytest.mark.gpu
@pytest.mark.benchmark(group="polynomial-gpu")
def bench_poly_gpu_generic_jacobi(benchmark, gpu_problem, machine_info):
    import cupy as cp

    A, b = gpu_problem
    M = jacobi(A)
    out = cg(A, b, rtol=RTOL, M=M)
    check(A, b, out.x, cp)
    time_it(benchmark, lambda: cg(A, b, rtol=RTOL, M=M))
    machine_info(benchmark, "cuda", role="ours", n=A.shape[0], iterations=out.iterations,
                 products=out.iterations, note="solvers.cg.cg (generic loop), M = D^-1")
    record(benchmark, "gpu_generic_jacobi", anchors=("cupyx", "gpu_ours_fused"))


@pytest.mark.gpu
@pytest.mark.benchmark(group="polynomial-gpu")
@pytest.mark.parametrize("degree", GPU_DEGREES)
def bench_poly_gpu_chebyshev(benchmark, gpu_problem, machine_info, degree):
    import cupy as cp

    A, b = gpu_problem
    M = chebyshev_polynomial(A, degree, cp)
    out = cg(A, b, rtol=RTOL, M=M)
    check(A, b, out.x, cp)
    time_it(benchmark, lambda: cg(A, b, rtol=RTOL, M=M))
    machine_info(benchmark, "cuda", role="experiment", n=A.shape[0], degree=degree,
                 iterations=out.iterations, products=out.iterations * (degree + 1),
                 note="solvers.cg.cg (generic loop), M = Chebyshev p(D^-1 A) D^-1")
    record(benchmark, f"gpu_chebyshev{degree}",
           anchors=("cupyx", "gpu_ours_fused", "gpu_generic_jacobi"))
