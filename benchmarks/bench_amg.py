"""M="amg": smoothed-aggregation AMG + CG on 2D Poisson, set-up and solve timed apart.

Cases (fp64, rtol 1e-8 on the true residual, anchors in the same run):

- CPU, N = 511^2: ``Solver(A, method="cg", M="amg")`` (PyAMG set-up, our
  V-cycle and CG; ``amg-native``: our own set-up) against our CG without a
  preconditioner and PyAMG's own ``smoothed_aggregation_solver(A).solve(b,
  accel="cg")``.
- GPU, N = 2048^2 and 4096^2: our set-up on the device and the V-cycle (a
  CUDA graph) against our CG without a preconditioner, ``cupyx``'s CG and,
  at 2048^2, PyAMG on the host.

``phase`` is ``setup`` (building the hierarchy, ``amg(A)``), ``solve`` (one
right-hand side on a prepared ``Solver``, the residual check included) or
``update`` (numeric re-setup with new values of the same pattern). ``extra_info`` records the
iterations, the true residual, operator and grid complexity, the hierarchy's
bytes against the fine matrix's and, on the GPU, the time of one V-cycle and
its bytes per second on a streamed-bytes model against the copy bandwidth.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve as ms
from managed_solve import _backend

RTOL = 1e-8


def poisson2d(m):
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return (sp.kron(sp.eye(m), t) + sp.kron(t, sp.eye(m))).tocsr()


def matrix_bytes(A):
    return A.data.nbytes + A.indices.nbytes + A.indptr.nbytes


def cycle_bytes(M):
    """Bytes one V-cycle streams: each level's matrix once per SpMV, P and R once, ~12 vectors."""
    total = 0
    spmvs = 2 * M.degree + 2 if M.smoother == "chebyshev" else 2 * M.sweeps + 1
    for A, P, R in M._cycle.mats:  # noqa: SLF001 - the matrices the cycle runs on
        if P is None:
            total += M._cycle.coarse_inv.nbytes  # noqa: SLF001
            continue
        total += spmvs * matrix_bytes(A) + matrix_bytes(P) + matrix_bytes(R)
        total += 12 * A.shape[0] * A.data.itemsize
    return total


def copy_bandwidth(xp, sync, nbytes=1 << 28):
    a = xp.ones(nbytes // 8)
    b = xp.empty_like(a)
    xp.copyto(b, a)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        xp.copyto(b, a)
    sync()
    return 2 * a.nbytes * 5 / (time.perf_counter() - t0)


def relres(A, b, x):
    return float(np.linalg.norm(b - A @ x) / np.linalg.norm(b))


# ---------------------------------------------------------------- CPU

CPU_CASES = [("amg", "setup"), ("amg", "solve"), ("amg", "update"), ("amg-native", "setup"),
             ("amg-native", "solve"), ("cg", "solve"), ("pyamg", "setup"), ("pyamg", "solve")]


@pytest.mark.parametrize("who,phase", CPU_CASES, ids=[f"{w}-{p}" for w, p in CPU_CASES])
def bench_amg_cpu(benchmark, machine_info, who, phase):
    m = 511
    A = poisson2d(m)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    A2 = (A + sp.diags(np.full(A.shape[0], 1e-3))).tocsr()
    extra = {}
    if who in ("amg", "amg-native", "cg"):
        from managed_solve.solvers.amg import amg

        setup = "native" if who == "amg-native" else "auto"
        M = None if who == "cg" else "amg" if who == "amg" else amg(A, setup="native")

        def make():  # the set-up: the hierarchy (the Solver prepares its engine lazily)
            return amg(A, setup=setup)

        solver = ms.Solver(A, method="cg", M=M)
        res = solver.solve(b)
        assert res.status == ms.Status.CONVERGED and relres(A, b, res.x) <= 1.0001 * RTOL
        extra.update(iterations=int(res.iterations), relres=relres(A, b, res.x))
        fn = {"setup": make, "solve": lambda: solver.solve(b),
              "update": lambda: solver.update(A2)}[phase]
    else:
        pyamg = pytest.importorskip("pyamg")
        ml = pyamg.smoothed_aggregation_solver(A)
        resid = []
        x = ml.solve(b, tol=RTOL, accel="cg", residuals=resid)
        assert relres(A, b, x) <= 1.0001 * RTOL
        extra.update(iterations=len(resid) - 1, relres=relres(A, b, x),
                     operator_complexity=ml.operator_complexity())
        fn = {"setup": lambda: pyamg.smoothed_aggregation_solver(A),
              "solve": lambda: ml.solve(b, tol=RTOL, accel="cg")}[phase]
    benchmark.group = f"amg-cpu-{m}"
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", n=A.shape[0], nnz=A.nnz, dtype="float64", who=who,
                 phase=phase, role="anchor" if who in ("cg", "pyamg") else "candidate", **extra)


# ---------------------------------------------------------------- GPU

GPU_CASES = [(w, p, m) for m in (2048, 4096) for w, p in
             [("amg", "setup"), ("amg", "solve"), ("amg", "update"), ("amg32", "solve"),
              ("cg", "solve"), ("cupyx", "solve")]] + [("pyamg", "setup", 2048),
                                                       ("pyamg", "solve", 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("who,phase,m", GPU_CASES, ids=[f"{w}-{p}-{m}" for w, p, m in GPU_CASES])
def bench_amg_gpu(benchmark, machine_info, who, phase, m):
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp
    import cupyx.scipy.sparse.linalg as cspla

    from managed_solve.solvers.amg import amg

    def sync():
        cp.cuda.Device().synchronize()

    A_h = poisson2d(m)
    b_h = np.random.default_rng(0).standard_normal(A_h.shape[0])
    A, b = csp.csr_matrix(A_h), cp.asarray(b_h)
    A2 = csp.csr_matrix((A.data * 1.001, A.indices, A.indptr), shape=A.shape)
    extra = {"fine_matrix_bytes": matrix_bytes(A_h)}
    rounds = 3 if m <= 2048 else 2

    if who in ("amg", "amg32", "cg"):
        M = None if who == "cg" else amg(A, dtype="float32" if who == "amg32" else None)
        solver = ms.Solver(A, method="cg", M=M, rtol=RTOL if who != "amg32" else 1e-10)
        res = solver.solve(b)
        sync()
        x = cp.asnumpy(res.x)
        assert res.status == ms.Status.CONVERGED
        extra.update(iterations=int(res.iterations), relres=relres(A_h, b_h, x))
        if M is not None:
            r = cp.asarray(b_h)
            M(r)
            sync()
            t0 = time.perf_counter()
            for _ in range(20):
                M(r)
            sync()
            per = (time.perf_counter() - t0) / 20
            bw = copy_bandwidth(cp, sync)
            extra.update(operator_complexity=M.operator_complexity,
                         grid_complexity=M.grid_complexity, hierarchy_bytes=M.nbytes,
                         levels=len(M.levels), cycle_seconds=per,
                         cycle_GBs=cycle_bytes(M) / per / 1e9, copy_GBs=bw / 1e9,
                         cuda_graph=M._cycle.graph is not None)  # noqa: SLF001

        def make():  # the set-up: the hierarchy (the Solver prepares its engine lazily)
            h = amg(A)
            sync()
            return h

        def one():
            out = solver.solve(b)
            sync()
            return out

        def upd():
            M.update(A2.data)
            sync()

        fn = {"setup": make, "solve": one, "update": upd}[phase]
    elif who == "cupyx":
        x, info = cspla.cg(A, b, tol=RTOL, maxiter=20 * m) if _accepts_tol(cspla) else \
            cspla.cg(A, b, rtol=RTOL, maxiter=20 * m)
        sync()
        assert info == 0
        extra.update(relres=relres(A_h, b_h, cp.asnumpy(x)))

        def fn():
            out = cspla.cg(A, b, tol=RTOL, maxiter=20 * m) if _accepts_tol(cspla) else \
                cspla.cg(A, b, rtol=RTOL, maxiter=20 * m)
            sync()
            return out
    else:
        pyamg = pytest.importorskip("pyamg")
        ml = pyamg.smoothed_aggregation_solver(A_h)
        resid = []
        x = ml.solve(b_h, tol=RTOL, accel="cg", residuals=resid)
        extra.update(iterations=len(resid) - 1, relres=relres(A_h, b_h, x))
        fn = {"setup": lambda: pyamg.smoothed_aggregation_solver(A_h),
              "solve": lambda: ml.solve(b_h, tol=RTOL, accel="cg")}[phase]
        rounds = 1
    benchmark.group = f"amg-gpu-{m}"
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu" if who == "pyamg" else "cuda", n=A_h.shape[0], nnz=A_h.nnz,
                 dtype="float64", who=who, phase=phase,
                 role="candidate" if who.startswith("amg") else "anchor", **extra)


def _accepts_tol(cspla):
    import inspect

    return "tol" in inspect.signature(cspla.cg).parameters


# ------------------------------------------------ defaults: one call, set-up included

AUTO_CASES = [(w, m) for m in (1024, 2048) for w in ("auto", "none")]


@pytest.mark.gpu
@pytest.mark.parametrize("who,m", AUTO_CASES, ids=[f"{w}-{m}" for w, m in AUTO_CASES])
def bench_auto_gpu(benchmark, machine_info, who, m):
    """``ms.solve(A, b)`` as a user calls it (``M="auto"``) against ``M=None``, set-up included.

    ``M="auto"`` sets up AMG from ``AMG_MIN_N["cuda"]`` unknowns: at 1024^2
    both calls run Jacobi-free CG, at 2048^2 "auto" runs AMG-PCG.
    """
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp

    A_h = poisson2d(m)
    b_h = np.random.default_rng(0).standard_normal(A_h.shape[0])
    A, b = csp.csr_matrix(A_h), cp.asarray(b_h)
    M = "auto" if who == "auto" else None

    def one():
        out = ms.solve(A, b, M=M)
        cp.cuda.Device().synchronize()
        return out

    res = one()  # warm-up (compiles the kernels once)
    assert res.status == ms.Status.CONVERGED
    benchmark.group = f"auto-gpu-{m}"
    benchmark.pedantic(one, rounds=3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cuda", n=A_h.shape[0], nnz=A_h.nnz, dtype="float64", who=who,
                 iterations=int(res.iterations), preconditioner=res.info.get("preconditioner"),
                 relres=relres(A_h, b_h, cp.asnumpy(res.x)),
                 role="candidate" if who == "auto" else "anchor")
