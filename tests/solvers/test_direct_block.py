"""A block of right-hand sides on host LU factors: solved a few columns a call, judged as one block.

Every column must come out as the vector path would have it (the same
status, refinements and residual) and as SciPy's ``splu(A).solve(B)`` has it.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as sla

from managed_solve import config
from managed_solve.solvers._common import column_norms, stable_norm
from managed_solve.solvers.direct import DirectEngine
from managed_solve.solvers.engine import CONVERGED, MAXITER, BlockOutcomes, Options
from tests._problems import convection_diffusion, poisson2d


def _engine(A, rtol, symmetric):
    return DirectEngine().prepare(A, Options("direct", rtol=rtol, symmetric=symmetric), None)


def _block(n, k, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(dtype)


def test_column_norms_equal_stable_norm_of_every_column_extremes_included():
    V = _block(300, 7, seed=1)
    V[:, 1] *= 1e200  # sqrt(v . v) overflows
    V[:, 2] *= 1e-200  # and underflows
    V[:, 3] = 0.0
    V[5, 4] = np.inf
    V[6, 5] = np.nan
    got = column_norms(np, V)
    want = [stable_norm(np, V[:, j].copy()) for j in range(7)]
    assert got.dtype == np.float64 and got.shape == (7,)
    np.testing.assert_allclose(got[[0, 1, 2, 6]], np.array(want)[[0, 1, 2, 6]], rtol=1e-13)
    assert got[3] == 0.0 and got[4] == np.inf and np.isnan(got[5])
    assert got[1] == pytest.approx(1e200 * np.linalg.norm(V[:, 1] / 1e200), rel=1e-13)
    V32 = _block(300, 3, seed=2, dtype=np.float32)
    np.testing.assert_allclose(column_norms(np, V32), np.linalg.norm(V32.astype(np.float64), axis=0),
                               rtol=1e-5)


@pytest.mark.gpu
def test_column_norms_on_a_gpu_equal_stable_norm_of_every_column():
    import cupy as cp

    V = _block(5000, 6, seed=9)
    V[:, 1] *= 1e200
    V[:, 2] = 0.0
    got = column_norms(cp, cp.asarray(V))
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_allclose(got, [stable_norm(np, V[:, j].copy()) for j in range(6)],
                               rtol=1e-12)


@pytest.mark.parametrize("step", [1, 3, 4, 64])
@pytest.mark.parametrize("trans", [False, True])
def test_a_block_in_pieces_matches_splu_on_the_whole_block(step, trans):
    A = convection_diffusion(14)  # non-symmetric: the transposed solve differs
    B = _block(A.shape[0], 11, seed=3)
    ref = sla.splu((A.T if trans else A).tocsc()).solve(B)
    engine = _engine(A, 1e-10, symmetric=False)
    with config.override(lu_solve_columns=step):
        outs = engine.solve_transpose(B) if trans else engine.solve(B)
    assert isinstance(outs, BlockOutcomes) and len(outs) == 11
    X = outs.x
    assert X.shape == B.shape and X.flags.c_contiguous and not np.shares_memory(X, B)
    np.testing.assert_allclose(X, ref, rtol=1e-10, atol=1e-13 * np.abs(ref).max())
    M = A.T if trans else A
    for j, out in enumerate(outs):
        assert out.code == CONVERGED and np.shares_memory(out.x, X)
        np.testing.assert_array_equal(out.x, X[:, j])
        r = np.linalg.norm(B[:, j] - M @ X[:, j])
        assert r <= 1e-10 * np.linalg.norm(B[:, j])
        assert out.residual_norm == pytest.approx(r, rel=1e-6, abs=1e-15)
    engine.close()


@pytest.mark.parametrize("case", ["split", "unreachable"])
def test_every_column_is_judged_as_its_vector_would_be(case):
    """float32 factors at an rtol half the columns meet at once (the others are refined, alone),
    or at one that float32 cannot meet.

    The block judgement keeps each column's own status, refinement count
    and residual; a converged column's residual is its true residual and
    meets its tolerance; one that cannot keeps x and says MAXITER.
    """
    A = poisson2d(15, np.float32)
    B = _block(A.shape[0], 8, seed=4, dtype=np.float32)
    b_norms = np.linalg.norm(B.astype(np.float64), axis=0)
    loose = _engine(A, 1e-3, symmetric=True)
    first = np.array([o.residual_norm for o in loose.solve(B)]) / b_norms  # before refinement
    loose.close()
    order = np.sort(first)
    # Between two columns' first residuals, or far below float32's reach.
    rtol = float(np.sqrt(order[3] * order[4])) if case == "split" else 1e-9
    engine = _engine(A, rtol, symmetric=True)
    block = engine.solve(B)
    alone = [engine.solve(B[:, j].copy()) for j in range(8)]
    assert [o.code for o in block] == [o.code for o in alone]
    assert [o.info["refinements"] for o in block] == [o.info["refinements"] for o in alone]
    assert sum(o.info["refinements"] > 0 for o in block) >= 4  # the refined path ran
    assert all(o.code == (CONVERGED if case == "split" else MAXITER) for o in block)
    for j, (got, want) in enumerate(zip(block, alone, strict=True)):
        assert got.residual_norm == pytest.approx(want.residual_norm, rel=1e-3)
        np.testing.assert_allclose(got.x, want.x, rtol=1e-4, atol=1e-6)
        # The true residual of the float32 data, in float64 (each product exact).
        true = np.linalg.norm(B[:, j].astype(np.float64) - A.astype(np.float64) @ got.x.astype(np.float64))
        assert got.residual_norm == pytest.approx(true, rel=1e-6)
        tol = rtol * b_norms[j]
        if got.code == CONVERGED:
            assert got.residual_norm <= tol
        else:
            assert got.code == MAXITER and got.x is not None and got.residual_norm > tol
    engine.close()



def _badly_scaled(n, seed):
    """A sparse matrix with rows and columns scaled over decades: LU needs refinement."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    d1, d2 = 10.0 ** rng.uniform(-3, 3, n), 10.0 ** rng.uniform(-3, 3, n)
    core = sp.random(n, n, density=0.03, random_state=seed) + sp.eye(n)
    return (sp.diags(d1) @ core @ sp.diags(d2)).tocsr(), rng.standard_normal((n, 3))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_refined_column_is_the_x_returned_and_judged(dtype):
    """A column that needed iterative refinement comes back refined: the block's x, the
    residual reported and the status are all of the same x (the true residual, in float64)."""
    import managed_solve as ms

    A, B = _badly_scaled(300, 1)
    A, B = A.astype(dtype), B.astype(dtype)
    rtol = 1e-13 if dtype == np.float64 else 1e-6
    res = ms.solve(A, B, method="direct", rtol=rtol, device="cpu")
    true = np.linalg.norm(B.astype(np.float64) - A.astype(np.float64) @ res.x.astype(np.float64),
                          axis=0)
    np.testing.assert_allclose(np.asarray(res.residual_norm), true, rtol=1e-6)
    for j in range(B.shape[1]):
        if res.column_status[j] == ms.Status.CONVERGED:
            assert true[j] <= rtol * np.linalg.norm(B[:, j].astype(np.float64))
        vector = ms.solve(A, B[:, j], method="direct", rtol=rtol, device="cpu")
        assert vector.status == res.column_status[j]
        if vector.x is not None:
            np.testing.assert_allclose(res.x[:, j], vector.x, rtol=0, atol=0)
