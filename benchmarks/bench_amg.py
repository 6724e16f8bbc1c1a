"""M="amg": smoothed-aggregation AMG + CG on 2D Poisson, set-up and solve timed apart.

Cases (fp64, rtol 1e-8 on the true residual, anchors in the same run):

- CPU, N = 511^2: ``Solver(A, method="cg", M="amg")`` (PyAMG set-up, our
  V-cycle and CG; ``amg-native``: our own set-up) against our CG without a
  preconditioner and PyAMG's ``smoothed_aggregation_solver(A)`` with its
  V-cycle inside SciPy's CG.
- GPU, 2D N = 2048^2 and 4096^2, 3D 7-point 256^3: our set-up on the device
  and the fused V-cycle (a CUDA graph) against our CG without a
  preconditioner and, at 2048^2, ``cupyx``'s CG and PyAMG on the host. Each
  problem is prepared once and shared by its cases; large ones time one
  round. ``amg32`` (a float32 hierarchy inside the float64 CG) and
  ``amg-1e10`` (the float64 hierarchy) both solve to rtol 1e-10, so the
  float32 option's gain is read at equal accuracy.

``phase`` is ``setup`` (building the hierarchy, ``amg(A)``), ``solve`` (one
right-hand side on a prepared ``Solver``, the residual check included) or
``update`` (numeric re-setup with new values of the same pattern). ``extra_info`` records the
iterations, the true residual, operator and grid complexity, the hierarchy's
bytes against the fine matrix's and, on the GPU, the time of one V-cycle and
its bytes per second on a streamed-bytes model against the copy bandwidth.
"""

from __future__ import annotations

import functools
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
    """Bytes one fused V-cycle streams at least, each array read or written once per kernel.

    Per level (Chebyshev of degree k): the matrix in 2k + 2 kernels (k
    pre-smoothing steps, the residual-restriction, k + 1 post-smoothing
    steps), P twice (restriction, prolongation), and the vectors: the first
    pre-smoothing step reads b and dinv and writes x (and d for k >= 2), every
    other step reads b, dinv, x and writes x, and all but the first
    post-smoothing step also read the previous iterate (or d); the
    restriction reads b and x, the prolongation reads and writes x. Jacobi:
    about 4 vectors a step. The coarse inverse once.
    """
    total = 0
    c = M._cycle  # noqa: SLF001 - the arrays the cycle runs on
    cheb = M.smoother == "chebyshev"
    steps = 2 * M.degree + 1 if cheb else 2 * M.sweeps - 1
    if cheb:
        k = M.degree
        vectors = (3 + (k >= 2)) + 5 * (k - 1) + 2 + 2 + 4 + 5 * k
    else:
        vectors = 4 * steps + (0 if steps > 1 else 5) + 2 + 2
    for A, P in c.mats:
        if P is None:
            total += c.coarse_inv.nbytes
            continue
        item = A[2].itemsize
        n = A[0].shape[0] - 1
        total += (steps + 1) * sum(a.nbytes for a in A) + 2 * sum(a.nbytes for a in P)
        total += vectors * n * item
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


def pyamg_cg(ml, A, b):
    """PyAMG's hierarchy and V-cycle inside SciPy's CG (to RTOL): ``(x, iterations)``.

    SciPy's ``cg`` rather than ``ml.solve(accel="cg")``: PyAMG's own Krylov
    module does not run against recent SciPy releases (``make_system``
    changed), and SciPy's CG is the host's reference loop anyway.
    """
    import scipy.sparse.linalg as sla

    count = [0]
    x, info = sla.cg(A, b, rtol=RTOL, atol=0.0, M=ml.aspreconditioner(cycle="V"),
                     callback=lambda _xk: count.__setitem__(0, count[0] + 1))
    assert info == 0
    return x, count[0]


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
        x, its = pyamg_cg(ml, A, b)
        assert relres(A, b, x) <= 1.0001 * RTOL
        extra.update(iterations=its, relres=relres(A, b, x),
                     operator_complexity=ml.operator_complexity())
        fn = {"setup": lambda: pyamg.smoothed_aggregation_solver(A),
              "solve": lambda: pyamg_cg(ml, A, b)}[phase]
    benchmark.group = f"amg-cpu-{m}"
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=0)
    machine_info(benchmark, "cpu", n=A.shape[0], nnz=A.nnz, dtype="float64", who=who,
                 phase=phase, role="anchor" if who in ("cg", "pyamg") else "candidate", **extra)


# ---------------------------------------------------------------- GPU

# (problem, who, phase): 2D Poisson 2048^2 and 4096^2, 3D 7-point Poisson 256^3.
# Each problem's matrix, preconditioner and solver are prepared once and shared by
# its cases (functools.cache), so a large hierarchy is set up once for the solve,
# update and cycle figures; the "setup" case times fresh set-ups.
GPU_CASES = (
    [("2d-2048", w, p) for w, p in [("amg", "setup"), ("amg", "solve"), ("amg", "update"),
                                     ("amg-d2", "solve"), ("amg-generic", "solve"),
                                     ("amg32", "solve"), ("amg-1e10", "solve"), ("cg", "solve"),
                                     ("cupyx", "solve"),
                                     ("pyamg", "setup"), ("pyamg", "solve")]]
    + [("2d-4096", w, p) for w, p in [("amg", "setup"), ("amg", "solve"), ("amg", "update"),
                                       ("amg-d2", "solve"), ("amg-generic", "solve"),
                                       ("amg32", "solve"), ("amg-1e10", "solve"), ("cg", "solve")]]
    + [("3d-256", w, p) for w, p in [("amg", "setup"), ("amg", "solve"), ("cg", "solve")]])


def poisson3d(m):
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    return sp.kronsum(sp.kronsum(t, t), t).tocsr()


@functools.cache
def gpu_problem(problem):
    """(A and b on the host, A and b on the GPU) of a problem name."""
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp

    kind, m = problem.split("-")
    A_h = poisson2d(int(m)) if kind == "2d" else poisson3d(int(m))
    b_h = np.random.default_rng(0).standard_normal(A_h.shape[0])
    return A_h, b_h, csp.csr_matrix(A_h), cp.asarray(b_h)


@functools.cache
def gpu_prepared(problem, who):
    """A solver (and its AMG preconditioner) for a problem, its first solve checked; extras."""
    cp = _backend.cupy()
    from managed_solve.solvers.amg import amg

    A_h, b_h, A, b = gpu_problem(problem)
    M = None if who == "cg" else amg(A, dtype="float32" if who == "amg32" else None,
                                     degree=2 if who == "amg-d2" else None)
    if who == "amg-generic":  # the generic CG loop around the same cycle (M's copies in and out)
        solver = GenericCG(A, M)
    else:
        solver = ms.Solver(A, method="cg", M=M, rtol=1e-10 if who in ("amg32", "amg-1e10") else RTOL)
    res = solver.solve(b)
    cp.cuda.Device().synchronize()
    assert res.status == ms.Status.CONVERGED
    extra = {"iterations": int(res.iterations), "relres": relres(A_h, b_h, cp.asnumpy(res.x)),
             "fine_matrix_bytes": matrix_bytes(A_h), "degree": getattr(M, "degree", None)}
    if M is not None:
        extra.update(cycle_figures(cp, M, b))
    return M, solver, extra


class GenericCG:
    """``solve(b)`` through the generic CG loop (:func:`managed_solve.solvers.cg.cg`), residual read every iteration."""

    def __init__(self, A, M):
        self.A, self.M = A, M

    def solve(self, b):
        from managed_solve.solvers.cg import cg

        out = cg(self.A, b, rtol=RTOL, M=self.M, check_every=1)
        out.status = ms.Status.CONVERGED if out.code == 0 else out.code
        out.iterations = out.info.get("converged_at", out.iterations)
        return out


def cycle_figures(cp, M, b):
    """Time of one V-cycle (20 back to back), its GB/s on the streamed-bytes model, memory."""
    def sync():
        cp.cuda.Device().synchronize()

    M(b)
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        M(b)
    sync()
    per = (time.perf_counter() - t0) / 20
    return dict(operator_complexity=M.operator_complexity, grid_complexity=M.grid_complexity,
                hierarchy_bytes=M.nbytes, levels=len(M.levels), cycle_seconds=per,
                cycle_GBs=cycle_bytes(M) / per / 1e9, copy_GBs=copy_bandwidth(cp, sync) / 1e9,
                cuda_graph=M._cycle.graph is not None)  # noqa: SLF001


@pytest.mark.gpu
@pytest.mark.parametrize("problem,who,phase", GPU_CASES, ids=["-".join(c) for c in GPU_CASES])
def bench_amg_gpu(benchmark, machine_info, problem, who, phase):
    cp = _backend.cupy()
    import cupyx.scipy.sparse as csp
    import cupyx.scipy.sparse.linalg as cspla

    from managed_solve.solvers.amg import amg

    def sync():
        cp.cuda.Device().synchronize()

    A_h, b_h, A, b = gpu_problem(problem)
    large = A_h.shape[0] > 5_000_000
    rounds = 1 if large else 3
    extra = {"fine_matrix_bytes": matrix_bytes(A_h)}
    if who in ("amg", "amg32", "amg-1e10", "amg-d2", "amg-generic", "cg"):
        if phase == "setup":
            def fn():  # the set-up: the hierarchy (the Solver prepares its engine lazily)
                h = amg(A)
                sync()
                return h

            M, _, extra = gpu_prepared(problem, who)
        else:
            M, solver, extra = gpu_prepared(problem, who)
            A2 = csp.csr_matrix((A.data * 1.001, A.indices, A.indptr), shape=A.shape)

            def one():
                out = solver.solve(b)
                sync()
                return out

            def upd():
                M.update(A2.data)
                sync()

            fn = {"solve": one, "update": upd}[phase]
    elif who == "cupyx":
        def fn():
            out = cspla.cg(A, b, tol=RTOL, maxiter=20 * A_h.shape[0]) if _accepts_tol(cspla) \
                else cspla.cg(A, b, rtol=RTOL, maxiter=20 * A_h.shape[0])
            sync()
            return out

        x, info = fn()
        assert info == 0
        extra.update(relres=relres(A_h, b_h, cp.asnumpy(x)))
        rounds = 1
    else:
        pyamg = pytest.importorskip("pyamg")
        ml = pyamg_prepared(problem)
        x, its = pyamg_cg(ml, A_h, b_h)
        extra.update(iterations=its, relres=relres(A_h, b_h, x))
        fn = {"setup": lambda: pyamg.smoothed_aggregation_solver(A_h),
              "solve": lambda: pyamg_cg(ml, A_h, b_h)}[phase]
        rounds = 1
    benchmark.group = f"amg-gpu-{problem}"
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)
    if phase == "solve" and extra.get("iterations"):
        extra["iteration_ms"] = 1e3 * benchmark.stats.stats.mean / extra["iterations"]
    machine_info(benchmark, "cpu" if who == "pyamg" else "cuda", n=A_h.shape[0], nnz=A_h.nnz,
                 dtype="float64", who=who, phase=phase,
                 role="candidate" if who.startswith("amg") else "anchor", **extra)


@functools.cache
def pyamg_prepared(problem):
    import pyamg

    return pyamg.smoothed_aggregation_solver(gpu_problem(problem)[0])


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
