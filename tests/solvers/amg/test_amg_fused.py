"""The fused V-cycle: NumPy twins (twins.py), their sequence (fused.py), the CUDA kernels (cycle.cu).

On the CPU the twins are pinned against the smoothers and the V-cycle of
smoothers.py and cycle.py; on a GPU the kernels against the twins, the
whole GPU cycle against the host cycle on the same hierarchy, the CUDA
graph capture, and CG's iteration counts against the host path.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve as ms
from managed_solve.solvers.amg import amg
from managed_solve.solvers.amg import twins as tw
from managed_solve.solvers.amg.cycle import VCycle
from managed_solve.solvers.amg.fused import FusedCycle
from managed_solve.solvers.amg.preconditioner import csr_arrays
from managed_solve.solvers.amg.smoothers import Smoother, make_smoother
from managed_solve.solvers.amg.spectral import spectral_radius
from managed_solve.solvers.cg import cg
from tests._problems import host, laplacian1d, poisson2d, poisson3d

SMOOTHERS = ["chebyshev", "jacobi", "l1_jacobi"]


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def triple(M, dtype=np.float64):
    return (M.indptr.astype(np.int32), M.indices.astype(np.int32), M.data.astype(dtype))


# ---------------------------------------------------------------- CPU: the twins' math


@pytest.mark.parametrize("kind", SMOOTHERS)
@pytest.mark.parametrize("zero", [True, False])
def test_twin_steps_reproduce_the_smoother(kind, zero):
    A = poisson2d(20)
    n = A.shape[0]
    rng = np.random.default_rng(1)
    b, x0 = rng.standard_normal(n), rng.standard_normal(n)
    dinv = 1.0 / A.diagonal()
    sm = make_smoother(kind, A, dinv, spectral_radius(A, dinv, np), np, degree=3, sweeps=3)
    x, res, d = x0.copy() * (not zero), np.empty(n), np.empty(n)
    sm.apply(A, b, x, res, d, zero=zero)
    # the same smoothing through the twins, x in two buffers
    X, dd, cheb = [x0.copy() * (not zero), np.full(n, np.nan)], np.full(n, np.nan), kind == "chebyshev"
    first = ((0.0, 1.0 / sm.theta),) if cheb else ((0.0, 1.0),)
    steps = (first + sm.coeffs) if cheb else first * sm.steps
    if zero:
        tw.amg_scale(n, b, sm.dinv, 1.0 / sm.theta if cheb else 1.0, X[0], dd, int(cheb))
        steps = steps[1:]
    # the previous update: from d after the scaling, else from the two x buffers
    cur, prev = 0, (1 if zero else 0)
    for a, c in steps:
        tw.amg_step(n, *triple(A), sm.dinv, b, X[cur], X[1 - cur], dd, a, c, 0,
                    prev if cheb else 0)
        cur, prev = 1 - cur, 2
    assert rel(X[cur], x) < 1e-13


@pytest.mark.parametrize("a,c,write_d", [(0.0, 0.7, 1), (0.4, 1.3, 1), (0.0, 1.0, 0)])
def test_twin_first_step_is_the_scaling_then_a_step(a, c, write_d):
    A = poisson2d(15)
    n = A.shape[0]
    rng = np.random.default_rng(7)
    b, dinv = rng.standard_normal(n), 1.0 / A.diagonal()
    x0, d0, x1 = np.empty(n), np.empty(n), np.empty(n)
    tw.amg_scale(n, b, dinv, 0.3, x0, d0, 1)
    tw.amg_step(n, *triple(A), dinv, b, x0, x1, d0, a, c, write_d, 1)
    xf, df = np.full(n, np.nan), np.full(n, np.nan)
    tw.amg_first(n, *triple(A), dinv, b, 0.3, xf, df, a, c, write_d)
    assert rel(xf, x1) < 1e-15
    if write_d:
        assert rel(df, d0) < 1e-15
    else:
        assert np.isnan(df).all()


def test_twin_transfers_are_p_transpose_and_p():
    A = poisson2d(16)
    M = amg(A, setup="native", max_coarse=30)
    P = M.levels[0].P
    rng = np.random.default_rng(2)
    b, x, xc = rng.standard_normal(A.shape[0]), rng.standard_normal(A.shape[0]), \
        rng.standard_normal(P.shape[1])
    bc = np.zeros(P.shape[1])
    tw.amg_restrict(A.shape[0], *triple(A), b, x, *triple(P), bc)
    assert rel(bc, P.T @ (b - A @ x)) < 1e-14
    y = x.copy()
    tw.amg_prolong(A.shape[0], *triple(P), xc, y)
    assert rel(y, x + P @ xc) < 1e-14
    inv = np.random.default_rng(3).standard_normal((7, 7))
    out = np.full(7, np.nan)
    tw.amg_dense(7, inv, b[:7], out)
    assert rel(out, inv @ b[:7]) < 1e-14


@pytest.mark.parametrize("kind", SMOOTHERS)
@pytest.mark.parametrize("which", ["poisson2d", "poisson3d"])
def test_fused_sequence_on_twins_equals_the_host_cycle(kind, which):
    A = poisson2d(40) if which == "poisson2d" else poisson3d(12)
    for dtype, tol in [(np.float64, 1e-12), (np.float32, 1e-5)]:
        M = amg(A, setup="native", smoother=kind, sweeps=2, max_coarse=40, dtype=dtype)
        assert isinstance(M._cycle, VCycle)  # noqa: SLF001 - the host's reference cycle
        c = M._cycle  # noqa: SLF001
        F = FusedCycle(np, tw.TwinOps, csr_arrays(M.levels, dtype, np), c.smoothers,
                       c.coarse_inv, dtype)
        r = np.random.default_rng(4).standard_normal(A.shape[0])
        z = M(r)
        assert rel(F.apply(r, np.float64), z) < tol
        assert rel(F.apply(r, np.float64), z) < tol  # a second run: the same buffers again
        assert F.result() is F.result() and F.result().dtype == dtype


# ---------------------------------------------------------------- GPU: the CUDA kernels


@pytest.fixture
def cp():
    import cupy

    return cupy


def kernel_matrices():
    """Row lengths that pick every group width, and an empty row."""
    rng = np.random.default_rng(5)
    R = sp.random(300, 300, density=0.2, random_state=6, format="csr") + sp.eye(300)
    R = (sp.diags((np.arange(300) % 17 != 3).astype(float)) @ R).tocsr()  # rows 3, 20, ... empty
    R.eliminate_zeros()
    out = {"poisson2d": poisson2d(30), "poisson3d": poisson3d(9), "dense-rows": R,
           "tridiagonal": laplacian1d(500),
           "diagonal": sp.diags(np.linspace(1.0, 2.0, 100)).tocsr(),
           "wide": sp.random(64, 64, density=0.9, random_state=7, format="csr"),
           "mid": sp.random(300, 300, density=0.1, random_state=8, format="csr"),
           "very-wide": sp.random(300, 300, density=0.8, random_state=9, format="csr")}
    for M in out.values():
        M.sort_indices()
    return out, rng


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-13), (np.float32, 1e-5)])
def test_cuda_kernels_match_their_twins(cp, dtype, tol):
    from managed_solve.solvers.amg.kernels import CudaOps, group_size

    ops = CudaOps(dtype, cp.cuda.Device().id)
    mats, rng = kernel_matrices()
    widths = set()
    for name, A in mats.items():
        n = A.shape[0]
        widths.add(group_size(n, A.nnz, np.dtype(dtype).itemsize))
        P = sp.random(n, max(n // 5, 1), density=min(1.0, 3.0 / max(n // 5, 1)), random_state=8,
                      format="csr").astype(dtype)
        h = {k: rng.standard_normal(n).astype(dtype) for k in ("b", "x", "d", "dinv")}
        xc = rng.standard_normal(P.shape[1]).astype(dtype)
        At, Pt = triple(A, dtype), triple(P, dtype)
        Ad, Pd = tuple(cp.asarray(a) for a in At), tuple(cp.asarray(a) for a in Pt)
        g = {k: cp.asarray(v) for k, v in h.items()}

        def poisoned(m):
            return np.full(m, np.nan, dtype=dtype), cp.full(m, cp.nan, dtype=dtype)

        for a, c, wd, prev in [(0.0, 0.7, 1, 0), (0.4, 1.3, 1, 1), (0.0, 1.0, 0, 0),
                               (0.4, 1.3, 0, 2), (0.4, 1.3, 1, 2)]:
            # prev 2: the previous update is x - x_new, x_new's buffer read before it is written
            xn, xn_d = (h["d"].copy(), g["d"].copy()) if prev == 2 else poisoned(n)
            d_h, d_d = (h["d"].copy(), g["d"].copy()) if prev == 1 else poisoned(n)
            tw.amg_step(n, *At, h["dinv"], h["b"], h["x"], xn, d_h, a, c, wd, prev)
            ops.step(n, *Ad, g["dinv"], g["b"], g["x"], xn_d, d_d, a, c, wd, prev)
            assert np.isfinite(xn).all()
            assert rel(host(xn_d), xn) < tol, (name, "step x", a, c, prev)
            if wd:
                assert rel(host(d_d), d_h) < tol, (name, "step d", a, c, prev)
        for a, c, wd in [(0.0, 0.7, 1), (0.4, 1.3, 1), (0.0, 1.0, 0)]:
            (xn, xn_d), (d_h, d_d) = poisoned(n), poisoned(n)
            tw.amg_first(n, *At, h["dinv"], h["b"], 0.3, xn, d_h, a, c, wd)
            ops.first(n, *Ad, g["dinv"], g["b"], 0.3, xn_d, d_d, a, c, wd)
            assert rel(host(xn_d), xn) < tol, (name, "first x", a, c)
            if wd:
                assert rel(host(d_d), d_h) < tol, (name, "first d", a, c)
        (xs, xs_d), (ds, ds_d) = poisoned(n), poisoned(n)
        tw.amg_scale(n, h["b"], h["dinv"], 0.3, xs, ds, 1)
        ops.scale(n, g["b"], g["dinv"], 0.3, xs_d, ds_d, 1)
        assert rel(host(xs_d), xs) < tol and rel(host(ds_d), ds) < tol, (name, "scale")
        bc, bc_d = np.zeros(P.shape[1], dtype), cp.full(P.shape[1], cp.nan, dtype=dtype)
        ops.zero(P.shape[1], bc_d)
        tw.amg_restrict(n, *At, h["b"], h["x"], *Pt, bc)
        ops.restrict(n, *Ad, g["b"], g["x"], *Pd, bc_d)
        assert rel(host(bc_d), bc) < tol, (name, "restrict")
        y, y_d = h["x"].copy(), g["x"].copy()
        tw.amg_prolong(n, *Pt, xc, y)
        ops.prolong(n, *Pd, cp.asarray(xc), y_d)
        assert rel(host(y_d), y) < tol, (name, "prolong")
    assert widths >= {1, 4, 8, 32}  # tridiagonal, 30, 57 and 240 entries a row
    for m in (1, 31, 33, 300):
        inv = rng.standard_normal((m, m)).astype(dtype)
        b = rng.standard_normal(m).astype(dtype)
        x_d = cp.full(m, cp.nan, dtype=dtype)
        ops.dense(m, cp.asarray(inv), cp.asarray(b), x_d)
        assert rel(host(x_d), inv.astype(np.float64) @ b) < tol * 10, ("dense", m)


def host_twin_of(M, dtype):
    """The fused cycle on the host (twins) over a copy of a GPU preconditioner's hierarchy."""
    c = M._cycle  # noqa: SLF001 - the GPU cycle's own smoothers and matrices
    mats = [tuple(None if T is None else tuple(host(a) for a in T) for T in pair)
            for pair in c.mats]
    sms = [Smoother(s.kind, np, host(s.dinv), s.steps, s.theta, s.coeffs) for s in c.smoothers]
    return FusedCycle(np, tw.TwinOps, mats, sms, host(c.coarse_inv), dtype), mats, sms


@pytest.mark.gpu
@pytest.mark.parametrize("kind", SMOOTHERS)
def test_gpu_cycle_is_captured_and_equals_the_host_cycle(cp, kind):
    import cupyx.scipy.sparse as csp

    from managed_solve.solvers.amg.fused import FusedCycle as F

    A = poisson2d(200)
    M = amg(csp.csr_matrix(A), setup="native", smoother=kind, sweeps=2)
    assert isinstance(M._cycle, F)  # noqa: SLF001
    assert M._cycle.graph is not None  # noqa: SLF001 - captured as one CUDA graph
    r = np.random.default_rng(9).standard_normal(A.shape[0])
    z = host(M(cp.asarray(r)))
    twin, mats, sms = host_twin_of(M, np.float64)
    assert rel(z, twin.apply(r, np.float64)) < 1e-12
    # ... and the host's reference V-cycle on the same hierarchy
    sizes = [a[0].shape[0] - 1 for a, _ in mats]
    csr = [(sp.csr_matrix((a[2], a[1], a[0]), shape=(sizes[i], sizes[i])),
            None if p is None else sp.csr_matrix((p[2], p[1], p[0]),
                                                 shape=(sizes[i], sizes[i + 1])))
           for i, (a, p) in enumerate(mats)]
    ref = VCycle(np, csr, sms, host(M._cycle.coarse_inv), np.float64)  # noqa: SLF001
    assert rel(z, ref.apply(r)) < 1e-12
    # the replayed graph and the eager sequence agree
    graph, M._cycle.graph = M._cycle.graph, None  # noqa: SLF001
    eager = host(M(cp.asarray(r)))
    M._cycle.graph = graph  # noqa: SLF001
    assert rel(z, eager) < 1e-13


@pytest.mark.gpu
@pytest.mark.parametrize("problem", ["poisson2d", "poisson3d"])
def test_gpu_iterations_equal_the_host_path(cp, problem):
    import cupyx.scipy.sparse as csp

    A = poisson2d(255) if problem == "poisson2d" else poisson3d(40)
    b = np.random.default_rng(10).standard_normal(A.shape[0])
    Mg = amg(csp.csr_matrix(A), setup="native")
    host_out = cg(A, b, rtol=1e-8, M=amg(A, setup="native", degree=Mg.degree))
    dev = cg(csp.csr_matrix(A), cp.asarray(b), rtol=1e-8, M=Mg)
    its = dev.info.get("converged_at", dev.iterations)
    assert host_out.code == 0 and dev.code == 0
    assert abs(its - host_out.iterations) <= 1, (its, host_out.iterations)
    x = host(dev.x)
    assert np.linalg.norm(b - A @ x) <= 1.0001e-8 * np.linalg.norm(b)
    assert [lev.A.shape for lev in Mg.levels] == [lev.A.shape for lev in amg(
        A, setup="native").levels]
    # Through the engine the cycle's check_every hint reads the residual every
    # iteration: the reported count is the converged one, not a checkpoint's.
    res = ms.solve(csp.csr_matrix(A), cp.asarray(b), method="cg", M=Mg, rtol=1e-8)
    assert res.converged and abs(res.iterations - host_out.iterations) <= 1, res


@pytest.mark.gpu
def test_gpu_float32_hierarchy(cp):
    import cupyx.scipy.sparse as csp

    A = poisson2d(255)
    b = np.random.default_rng(11).standard_normal(A.shape[0])
    Ad, bd = csp.csr_matrix(A), cp.asarray(b)
    M64, M32 = amg(Ad, setup="native"), amg(Ad, setup="native", dtype="float32")
    assert M32._cycle.graph is not None and M32._cycle.result().dtype == np.float32  # noqa: SLF001
    r = np.random.default_rng(12).standard_normal(A.shape[0])
    twin, _, _ = host_twin_of(M32, np.float32)
    assert rel(host(M32(cp.asarray(r))), twin.apply(r, np.float64)) < 1e-5
    full = cg(Ad, bd, rtol=1e-10, M=M64)
    half = cg(Ad, bd, rtol=1e-10, M=M32)
    f_its = full.info.get("converged_at", full.iterations)
    h_its = half.info.get("converged_at", half.iterations)
    assert half.code == 0 and h_its <= 1.1 * f_its + 1, (h_its, f_its)
    assert np.linalg.norm(b - A @ host(half.x)) <= 1.0001e-10 * np.linalg.norm(b)
    assert M32.nbytes < 0.85 * M64.nbytes
