"""benchmarks/jax_anchor.py: JAX's ``jit(vmap(cg))`` over padded CSR systems, against SciPy.

The W2 benchmark's JAX anchor must solve every system to its own rtol; here it
runs on JAX's CPU device over a few small W2-like systems of different sizes
and patterns. Skipped where JAX is not installed (it is not a dependency).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import scipy.sparse.linalg as spla

from tests._problems import laplacian1d, poisson2d, random_spd

pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ja():
    spec = importlib.util.spec_from_file_location("jax_anchor", ROOT / "benchmarks" / "jax_anchor.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    if mod.jax_device("cpu") is None:
        pytest.skip("JAX has no CPU device")
    return mod


def systems():
    """Different sizes and patterns (so every padding case occurs), random right-hand sides."""
    rng = np.random.default_rng(0)
    mats = [poisson2d(6), poisson2d(11), laplacian1d(40), random_spd(90, seed=3), poisson2d(16)]
    return [(A, rng.standard_normal(A.shape[0])) for A in mats]


def test_padding_layout(ja):
    pairs = systems()
    p = ja.pad_systems(pairs, 1e-8)
    n_max, nnz_max = max(A.shape[0] for A, _ in pairs), max(A.nnz for A, _ in pairs)
    assert p.values.shape == p.cols.shape == p.rows.shape == (len(pairs), nnz_max)
    assert p.b.shape == p.pad.shape == (len(pairs), n_max)
    assert p.values.dtype == np.float64 and p.cols.dtype == p.rows.dtype == np.int32
    for i, (A, b) in enumerate(pairs):
        n, nnz = A.shape[0], A.nnz
        assert np.all(np.diff(p.rows[i]) >= 0)  # sorted, as segment_sum is told
        assert np.all(p.values[i, nnz:] == 0)
        np.testing.assert_array_equal(p.b[i, :n], b)
        assert np.all(p.b[i, n:] == 0) and np.all(p.pad[i, n:] == 1) and np.all(p.pad[i, :n] == 0)
        # The padded triplets rebuild A exactly.
        dense = np.zeros((n_max, n_max))
        np.add.at(dense, (p.rows[i], p.cols[i]), p.values[i])
        np.testing.assert_array_equal(dense[:n, :n], A.toarray())
    np.testing.assert_array_equal(p.tol, np.full(len(pairs), 1e-8))


def test_each_system_meets_its_own_rtol_against_spsolve(ja):
    pairs = systems()
    rtol = np.array([1e-6, 1e-8, 1e-10, 1e-9, 1e-7])
    p = ja.pad_systems(pairs, rtol)
    _run, _args, x, timings = ja.solve_padded(p, ja.jax_device("cpu"))
    assert x.dtype == np.float64  # jax_enable_x64 took effect
    assert timings["first_call_s"] > 0 and timings["transfer_s"] >= 0
    xs = ja.unpad(p, x)
    relres = ja.relative_residuals(pairs, xs)
    assert np.all(relres <= rtol), relres / rtol
    for (A, b), xi, tol in zip(pairs, xs, rtol, strict=True):
        ref = spla.spsolve(A.tocsc(), b)
        # ||x - x*|| / ||x*|| <= cond(A) * ||b - A x|| / ||b||
        bound = np.linalg.cond(A.toarray()) * tol
        assert np.linalg.norm(xi - ref) <= bound * np.linalg.norm(ref)


def test_loose_systems_stop_at_their_own_tolerance(ja):
    """A batched tol: the loose system stops early instead of following the tightest."""
    A = poisson2d(16)
    b = np.ones(A.shape[0])
    pairs = [(A, b), (A, b)]
    p = ja.pad_systems(pairs, [1e-2, 1e-11])
    _run, _args, x, _t = ja.solve_padded(p, ja.jax_device("cpu"))
    loose, tight = ja.relative_residuals(pairs, ja.unpad(p, x))
    assert 1e-6 < loose <= 1e-2
    assert tight <= 1e-11
    iters = ja.scipy_cg_iterations(pairs, p.tol)
    assert iters[0] < iters[1]


def test_warm_call_repeats_the_first(ja):
    pairs = systems()[:3]
    p = ja.pad_systems(pairs, 1e-8)
    run, _args, x, _t = ja.solve_padded(p, ja.jax_device("cpu"))
    np.testing.assert_array_equal(np.asarray(run()), x)


def test_bad_input_names_the_system(ja):
    A = poisson2d(4)
    with pytest.raises(ValueError, match=r"pairs\[1\].*length 16"):
        ja.pad_systems([(A, np.ones(16)), (A, np.ones(15))], 1e-8)
    with pytest.raises(ValueError, match=r"pairs\[0\].*not square"):
        ja.pad_systems([(A[:, :10], np.ones(16))], 1e-8)
    with pytest.raises(ValueError, match="empty"):
        ja.pad_systems([], 1e-8)
