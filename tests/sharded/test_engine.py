"""solve_sharded and ShardedEngine: one system over several devices, against SciPy."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from managed_solve import config, sharded
from managed_solve.manager import DeviceManager
from managed_solve.result import Status
from managed_solve.solvers.engine import BREAKDOWN, CONVERGED, MAXITER, Options
from tests._problems import convection_diffusion, host, poisson2d, poisson3d, random_spd

MATRICES = {
    "poisson2d": lambda: poisson2d(20),
    "poisson3d": lambda: poisson3d(8),
    "random_spd": lambda: random_spd(300, seed=1),
}


# ---------------------------------------------------------------- solve_sharded
@pytest.mark.parametrize("name", sorted(MATRICES))
@pytest.mark.parametrize("nshards", [2, 3])
@pytest.mark.parametrize("reorder", ["rcm", None])
def test_cg_matches_single_device(kind, devices_for, name, nshards, reorder):
    A = MATRICES[name]()
    devs, dm = devices_for(kind, nshards)
    rng = np.random.default_rng(7)
    b = rng.standard_normal(A.shape[0])
    ref = spla.spsolve(A.tocsc(), b)
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-10, reorder=reorder)
    assert res.status is Status.CONVERGED, res.message
    assert res.info["shards"] == nshards
    assert res.device == str(devs[0])
    x = host(res.x)
    assert np.linalg.norm(x - ref) <= 1e-7 * np.linalg.norm(ref)
    assert res.relative_residual <= 1e-10 * 1.01
    # Chronopoulos-Gear CG converges like textbook CG (scipy's) on these systems.
    its = []
    spla.cg(A, b, rtol=1e-10, callback=lambda xk: its.append(1))
    assert abs(res.info["converged_at"] - len(its)) <= max(2, 0.05 * len(its))


def test_bicgstab_nonsymmetric(kind, devices_for):
    A = convection_diffusion(16, wind=0.8)
    devs, dm = devices_for(kind, 2)
    b = np.random.default_rng(2).standard_normal(A.shape[0])
    ref = spla.spsolve(A.tocsc(), b)
    for M in (None, "jacobi"):
        res = sharded.solve_sharded(A, b, devices=devs, manager=dm, method="bicgstab",
                                    rtol=1e-10, M=M)
        assert res.converged, res.message
        assert np.linalg.norm(host(res.x) - ref) <= 1e-7 * np.linalg.norm(ref)


def test_jacobi_cg_on_varied_diagonal(kind, devices_for):
    A = random_spd(300, seed=4)
    devs, dm = devices_for(kind, 2)
    b = np.random.default_rng(1).standard_normal(300)
    plain = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-10)
    jac = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-10, M="jacobi")
    assert plain.converged and jac.converged
    ref = spla.spsolve(A.tocsc(), b)
    assert np.linalg.norm(host(jac.x) - ref) <= 1e-8 * np.linalg.norm(ref)
    # Same iteration count as scipy's Jacobi-preconditioned CG.
    its = []
    dinv = 1.0 / A.diagonal()
    spla.cg(A, b, rtol=1e-10, M=sp.diags(dinv), callback=lambda xk: its.append(1))
    assert abs(jac.info["converged_at"] - len(its)) <= 2


def test_x0_exact_solution_takes_no_iteration(kind, devices_for):
    A = poisson2d(12)
    devs, dm = devices_for(kind, 2)
    x_true = np.linspace(0, 1, A.shape[0])
    b = A @ x_true
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, x0=x_true, rtol=1e-8)
    assert res.converged and res.iterations == 0
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, x0=0.5 * x_true, rtol=1e-10)
    assert res.converged and res.iterations > 0
    assert np.allclose(host(res.x), x_true, atol=1e-8)


def test_statuses(kind, devices_for):
    A = poisson2d(12)
    devs, dm = devices_for(kind, 2)
    b = np.ones(144)
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, maxiter=3, check_every=1)
    assert res.status is Status.MAXITER and res.iterations == 3
    assert res.relative_residual > 1e-3
    neg = sharded.solve_sharded(-A, b, devices=devs, manager=dm, check_every=1)
    assert neg.status is Status.BREAKDOWN
    assert "positive definite" in neg.message


@pytest.mark.parametrize("method", ["cg", "bicgstab"])
def test_float32_convergence_is_the_true_residuals(kind, devices_for, method):
    """The recurrence of a float32 solve meets rtol=1e-12 by drifting from the true residual:
    the verify rule, applied to the distributed true residual, says MAXITER; a tolerance
    float32 can meet stays CONVERGED, its x within it by a float64 check."""
    A = poisson2d(40, np.float32)
    b = np.random.default_rng(0).standard_normal(A.shape[0]).astype(np.float32)
    devs, dm = devices_for(kind, 2)
    bn = float(np.linalg.norm(b.astype(np.float64)))
    hard = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-12, method=method)
    true = np.linalg.norm(b.astype(np.float64) - A.astype(np.float64) @ host(hard.x).astype(np.float64))
    assert true > 1e-12 * bn
    assert hard.status is Status.MAXITER and "the true residual" in hard.message
    assert hard.residual_norm == pytest.approx(true, rel=1e-6)
    easy = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-4, method=method)
    x = host(easy.x).astype(np.float64)
    assert easy.status is Status.CONVERGED
    assert np.linalg.norm(b.astype(np.float64) - A.astype(np.float64) @ x) <= 1e-4 * bn


def test_a_single_column_right_hand_side_is_a_vector():
    dm = DeviceManager(simulate="2x1GiB")
    A = poisson2d(6)
    res = sharded.solve_sharded(A, np.ones((36, 1)), devices="all", manager=dm, rtol=1e-10,
                                x0=np.zeros((36, 1)))
    assert res.converged and res.x.shape == (36,)


def test_input_errors():
    dm = DeviceManager(simulate="2x1GiB")
    A, b = poisson2d(6), np.ones(36)
    with pytest.raises(ValueError, match=r"shape \(36,\)"):
        sharded.solve_sharded(A, np.ones(35), devices="all", manager=dm)
    with pytest.raises(ValueError, match="method='gmres'"):
        sharded.solve_sharded(A, b, devices="all", manager=dm, method="gmres")
    with pytest.raises(ValueError, match="M=None or M='jacobi'"):
        sharded.solve_sharded(A, b, devices="all", manager=dm, M="ilu")
    with pytest.raises(ValueError, match="square"):
        sharded.solve_sharded(sp.random(4, 5, density=0.5, format="csr"), np.ones(4),
                              devices="all", manager=dm)
    with pytest.raises(TypeError, match="sparse matrix"):
        sharded.solve_sharded([[1.0]], np.ones(1), devices="all", manager=dm)
    with pytest.raises(ValueError, match="at most one device per row"):
        sharded.solve_sharded(sp.eye(1, format="csr"), np.ones(1), devices="all", manager=dm)
    with pytest.raises(ValueError, match="gather_to"):
        sharded.solve_sharded(A, b, devices="all", manager=dm, gather_to="sim:9")


def _with_diagonal(A, values):
    """``A`` with the diagonal entries ``values`` ({row: value}) put in."""
    A = A.tolil()
    for row, value in values.items():
        A[row, row] = value
    return A.tocsr()


def _jacobi_refused(call, values, why):
    """The message of refuse_unscalable_diagonal for the entries ``values`` ({row: value})."""
    rows, first = sorted(values), min(values)
    return (rf"^{call}\(M='jacobi'\): Jacobi scaling divides by A's diagonal, so it needs a "
            rf"non-zero diagonal with finite reciprocals, but A has {len(rows)} diagonal entr\w+ it "
            rf"cannot divide by \(rows {re.escape(str(rows))}; A\[{first}, {first}\] = "
            rf"{values[first]:.3g}, {why}\)\. Use M=None, or reorder")  # none other to offer


@pytest.mark.parametrize("reorder", ["rcm", None])
def test_jacobi_refuses_a_diagonal_it_cannot_divide_by_as_every_solve_does(kind, devices_for,
                                                                           reorder):
    """The package's one rule and message (refuse_unscalable_diagonal): a zero entry, and one
    whose reciprocal overflows, naming A's own rows (not a shard's or the reordering's)."""
    devs, dm = devices_for(kind, 3)
    A, b = poisson2d(6), np.ones(36)
    for values, why in (({17: 0.0}, "zero"), ({3: 0.0, 30: 1e-320}, "zero"),
                        ({30: 1e-320}, "whose reciprocal overflows float64")):
        with pytest.raises(ValueError, match=_jacobi_refused("solve_sharded", values, why)):
            sharded.solve_sharded(_with_diagonal(A, values), b, devices=devs, manager=dm,
                                  M="jacobi", reorder=reorder)
    engine, _ = _engine(kind, devices_for, nshards=3, reorder=reorder)
    values = A.data.copy()  # new values in A's pattern: A[17, 17] = 0
    values[A.indptr[17] + np.flatnonzero(A.indices[A.indptr[17]:A.indptr[18]] == 17)[0]] = 0.0
    with engine.prepare(A, Options(method="cg", M="jacobi"), devs) as prepared:
        with pytest.raises(ValueError, match=_jacobi_refused("update", {17: 0.0}, "zero")):
            prepared.update(values)


# ---------------------------------------------------------------- GPU-only checks
@pytest.mark.multi_gpu
def test_gpu_result_location_and_host_syncs(devices_for):
    cp = pytest.importorskip("cupy")
    devs, dm = devices_for("cuda", 2)
    A = poisson2d(64)
    b = cp.ones(A.shape[0])  # b on the GPU: scattered by peer copies
    res = sharded.solve_sharded(A, b, devices=devs, manager=dm, rtol=1e-9)
    assert res.converged
    assert isinstance(res.x, cp.ndarray) and res.x.device.id == devs[0].index
    ref = spla.spsolve(A.tocsc(), np.ones(A.shape[0]))
    assert np.allclose(res.x.get(), ref, rtol=1e-7)
    # One read every sharded_check_every iterations, plus the start and the true residual.
    every = config.current().sharded_check_every
    assert res.info["host_syncs"] <= res.iterations // every + 3


# ---------------------------------------------------------------- the engine
def _engine(kind, devices_for, nshards=2, **kw):
    devs, dm = devices_for(kind, nshards)
    return sharded.ShardedEngine(manager=dm, **kw), devs


@pytest.mark.parametrize("method, make", [("cg", lambda: random_spd(200, seed=3)),
                                          ("bicgstab", lambda: convection_diffusion(14))])
def test_engine_solves_like_spsolve(kind, devices_for, method, make):
    A = make()
    engine, devs = _engine(kind, devices_for)
    b = np.random.default_rng(0).standard_normal(A.shape[0])
    with engine.prepare(A, Options(method=method, rtol=1e-10), devs) as prepared:
        assert prepared.engine == engine.name == "sharded"
        assert prepared.device == list(devs) and prepared.n == A.shape[0]
        out = prepared.solve(b)
    assert out.code == CONVERGED and out.iterations > 0 and out.host_syncs >= 2
    assert out.info["shards"] == 2 and out.where == str(devs[0])
    ref = spla.spsolve(A.tocsc(), b)
    assert np.linalg.norm(host(out.x) - ref) <= 1e-7 * np.linalg.norm(ref)
    assert out.residual_norm <= 1e-10 * 1.01 * np.linalg.norm(b)
    assert out.to_result().converged and out.to_result().method == method


def test_engine_block_of_right_hand_sides_has_per_column_outcomes(kind, devices_for):
    A = poisson2d(12)
    engine, devs = _engine(kind, devices_for)
    B = np.random.default_rng(3).standard_normal((A.shape[0], 3))
    B[:, 1] = 0.0  # a zero column converges at once
    with engine.prepare(A, Options(method="cg", rtol=1e-10, maxiter=500), devs) as prepared:
        outs = prepared.solve(B)
        few = prepared.solve(B, x0=np.zeros_like(B))
    assert len(outs) == 3 and len(few) == 3
    assert [o.code for o in outs] == [CONVERGED] * 3
    assert outs[1].iterations == 0 and outs[0].iterations > 0
    for j, o in enumerate(outs):
        ref = spla.spsolve(A.tocsc(), B[:, j])
        assert np.allclose(host(o.x), ref, atol=1e-8)
        assert np.allclose(host(few[j].x), ref, atol=1e-8)
    with engine.prepare(A, Options(method="cg", rtol=1e-12, maxiter=2), devs) as prepared:
        capped = prepared.solve(B)
    assert [o.code for o in capped] == [MAXITER, CONVERGED, MAXITER]


def test_engine_update_redistributes_values_only(kind, devices_for):
    A = random_spd(200, seed=5)
    engine, devs = _engine(kind, devices_for)
    b = np.random.default_rng(4).standard_normal(200)
    with engine.prepare(A, Options(method="cg", rtol=1e-10, M="jacobi"), devs) as prepared:
        first = host(prepared.solve(b).x)
        before = sharded.cache_info()
        A2 = A.copy()
        A2.data = A2.data * np.linspace(1.0, 3.0, A2.nnz)  # same pattern, new values
        A2 = ((A2 + A2.T) / 2 + sp.diags(np.full(200, 10.0))).tocsr()
        prepared.update(A2)
        second = prepared.solve(b)
        assert sharded.cache_info() == before  # no partition, no new set-up
        prepared.update(A2.data * 2)  # the values alone, in CSR order
        third = prepared.solve(b)
    assert np.allclose(first, spla.spsolve(A.tocsc(), b), atol=1e-8)
    assert second.code == CONVERGED
    assert np.allclose(host(second.x), spla.spsolve(A2.tocsc(), b), atol=1e-8)
    assert np.allclose(host(third.x), spla.spsolve(2 * A2.tocsc(), b), atol=1e-8)
    # The cached set-up still belongs to A: a new solve with A is unchanged.
    again = sharded.solve_sharded(A, b, devices=devs, manager=engine.manager, rtol=1e-10)
    assert np.allclose(host(again.x), first, atol=1e-8)


def test_engine_update_rejects_another_pattern(devices_for):
    A = poisson2d(8)
    engine, devs = _engine("sim", devices_for)
    with engine.prepare(A, Options(method="cg"), devs) as prepared:
        with pytest.raises(ValueError, match="pattern differs.*build_partition"):
            prepared.update((A + sp.eye(64, k=9)).tocsr())
        with pytest.raises(ValueError, match="expected shape"):
            prepared.update(poisson2d(9))
        with pytest.raises(ValueError, match="stored values.*prepare the new matrix"):
            prepared.update(np.ones(A.nnz + 1))
        prepared.update(A)  # the same values again are fine
        assert prepared.solve(np.ones(64)).code == CONVERGED
    with engine.prepare(A, Options(method="cg", M="jacobi"), devs) as prepared:
        with pytest.raises(ValueError, match=r"update\(M='jacobi'\): Jacobi scaling divides by "
                                             r"A's diagonal.*but A has 64 diagonal entries"):
            prepared.update(A.data * (A.indices != np.repeat(np.arange(64), np.diff(A.indptr))))


def test_engine_solve_transpose(kind, devices_for):
    A = convection_diffusion(12)
    engine, devs = _engine(kind, devices_for)
    b = np.random.default_rng(6).standard_normal(A.shape[0])
    with engine.prepare(A, Options(method="bicgstab", rtol=1e-10), devs) as prepared:
        out = prepared.solve_transpose(b)
        block = prepared.solve_transpose(np.stack([b, 2 * b], axis=1))
        prepared.update(2 * A)
        scaled = prepared.solve_transpose(b)
    ref = spla.spsolve(A.T.tocsc(), b)
    assert out.code == CONVERGED
    assert np.linalg.norm(host(out.x) - ref) <= 1e-7 * np.linalg.norm(ref)
    assert np.allclose(host(block[1].x), 2 * ref, atol=1e-7)
    assert np.allclose(2 * host(scaled.x), ref, atol=1e-7)
    # CG's matrices are symmetric: the transpose solve is the solve.
    S = poisson2d(10)
    with engine.prepare(S, Options(method="cg", rtol=1e-10), devs) as prepared:
        t = prepared.solve_transpose(np.ones(100))
    assert np.allclose(host(t.x), spla.spsolve(S.tocsc(), np.ones(100)), atol=1e-8)


def test_engine_statuses_and_close(devices_for):
    engine, devs = _engine("sim", devices_for)
    A = poisson2d(12)
    prepared = engine.prepare(-A, Options(method="cg"), devs)
    out = prepared.solve(np.ones(144))
    assert out.code == BREAKDOWN and "positive definite" in out.message
    assert out.to_result().status is Status.BREAKDOWN
    prepared.close()
    prepared.close()
    with pytest.raises(RuntimeError, match="closed"):
        prepared.solve(np.ones(144))
    with pytest.raises(ValueError, match="callback"):
        engine.prepare(A, Options(method="cg", callback=print), devs)
    with pytest.raises(ValueError, match="method='gmres'"):
        engine.prepare(A, Options(method="gmres"), devs)


def test_engine_gather_targets(devices_for):
    A = poisson2d(10)
    devs, dm = devices_for("sim", 2)
    b = np.ones(100)
    ref = spla.spsolve(A.tocsc(), b)
    kept = sharded.ShardedEngine(manager=dm, gather_to=False)
    with kept.prepare(A, Options(method="cg", rtol=1e-10), devs) as prepared:
        dist = prepared.solve(b)
    assert dist.where == "distributed" and isinstance(dist.x, sharded.DistributedVector)
    assert np.allclose(dist.x.gather(), ref, atol=1e-8)
    on_host = sharded.ShardedEngine(manager=dm, gather_to="cpu")
    with on_host.prepare(A, Options(method="cg", rtol=1e-10), devs) as prepared:
        assert prepared.solve(b).where == "cpu"
