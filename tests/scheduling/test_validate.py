"""solve_many's validation: the per-matrix host checks, many matrices a kernel call, and the inputs as systems (scheduling/validate.py)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import managed_solve as ms
from managed_solve import LinearSystem, Status, _threads
from managed_solve.kernels import checks
from managed_solve.kernels.symmetry import NOT_CANONICAL, csr_symmetry_gershgorin
from managed_solve.manager import DeviceManager
from managed_solve.scheduling import solve_many, validate
from managed_solve.system import inputs, is_symmetric
from managed_solve.system.properties import gershgorin
from tests._problems import helmholtz2d, poisson2d
from tests._problems import poisson2d_skew as convection
from tests.scheduling._helpers import assert_converged


def mixed_matrices():
    """Symmetric, non-symmetric values, a non-symmetric pattern, float32, int64 indices, a NaN diagonal."""
    rng = np.random.default_rng(3)
    out = [poisson2d(m) for m in (3, 7, 12)] + [convection(6), helmholtz2d(5)]
    R = sp.random(30, 30, density=0.2, random_state=rng, format="csr")
    out.append((R + R.T + sp.identity(30)).tocsr())
    out.append((R + sp.identity(30)).tocsr())  # its pattern is not symmetric
    out.append(poisson2d(9).astype(np.float32))
    wide = poisson2d(8)
    wide.indices, wide.indptr = wide.indices.astype(np.int64), wide.indptr.astype(np.int64)
    out.append(wide)
    nan = poisson2d(4).copy()
    nan.data[0] = np.nan
    out.append(nan)
    for A in out:
        A.sum_duplicates()
    return out


def test_many_matrix_kernel_agrees_with_the_one_matrix_kernel():
    mats = [A for A in mixed_matrices() if A.dtype == np.float64 and A.indices.dtype == np.int32]
    addr = lambda arrays: np.array([a.ctypes.data for a in arrays], np.int64)  # noqa: E731
    codes = np.full(len(mats), 9, np.int8)
    bounds = np.zeros((len(mats), 4))
    finite = np.full(len(mats), 9, np.uint8)
    checks.csr_symmetry_gershgorin_many(
        0, len(mats), addr([A.indptr for A in mats]), addr([A.indices for A in mats]),
        addr([A.data for A in mats]), np.array([A.shape[0] for A in mats]),
        np.array([A.nnz for A in mats]), mats[0].indptr, mats[0].indices, mats[0].data, 1e-12,
        codes, bounds, finite)
    for k, A in enumerate(mats):
        code, *ref = csr_symmetry_gershgorin(A.indptr, A.indices, A.data, 1e-12)
        assert codes[k] == code
        np.testing.assert_array_equal(bounds[k], ref)  # bit for bit, NaN where NaN
        assert finite[k] == np.isfinite(A.data).all()
    assert 0 in finite.tolist()  # the matrix with a NaN


def test_the_many_matrix_kernels_finite_flag_is_numpys_for_every_kind_of_bad_entry():
    """The flag comes from the walk's row sums where they are all finite, else from a read of the
    entries: each bad entry (NaN or infinity, off or on the diagonal), finite entries whose row sum
    overflows, and a pattern whose walk stops early give NumPy's answer."""
    def spoiled(how):
        A = poisson2d(5).copy()
        A.sum_duplicates()
        if how == "nan_off":
            A.data[1] = np.nan
        elif how == "inf_off":
            A.data[A.indices.tolist().index(0, 3)] = np.inf  # a lower entry (row 1, column 0)
        elif how == "minus_inf_diagonal":
            A.data[0] = -np.inf
        elif how == "nan_diagonal_last_row":
            A.data[-1] = np.nan
        elif how == "overflowing_row":
            A.data[:] = 1e308  # every entry finite, every row's sum infinite
        elif how == "unsorted_then_nan":  # the walk stops at row 0; a NaN past it
            A.indices[[0, 1]] = A.indices[[1, 0]]
            A.data[-2] = np.nan
        elif how == "unsorted_finite":
            A.indices[[0, 1]] = A.indices[[1, 0]]
        return A

    hows = ["clean", "nan_off", "inf_off", "minus_inf_diagonal", "nan_diagonal_last_row",
            "overflowing_row", "unsorted_then_nan", "unsorted_finite"]
    mats = [spoiled(h) for h in hows]
    addr = lambda arrays: np.array([a.ctypes.data for a in arrays], np.int64)  # noqa: E731
    codes = np.zeros(len(mats), np.int8)
    finite = np.full(len(mats), 9, np.uint8)
    checks.csr_symmetry_gershgorin_many(
        0, len(mats), addr([A.indptr for A in mats]), addr([A.indices for A in mats]),
        addr([A.data for A in mats]), np.array([A.shape[0] for A in mats]),
        np.array([A.data.shape[0] for A in mats]), mats[0].indptr, mats[0].indices,
        mats[0].data, 1e-12, codes, np.zeros((len(mats), 4)), finite)
    with np.errstate(over="ignore"):
        assert finite.tolist() == [int(np.isfinite(A.data).all()) for A in mats], hows
    assert codes[hows.index("unsorted_finite")] == NOT_CANONICAL


def test_symmetry_pass_checks_its_matrices_entries_and_the_finite_pass_leaves_them():
    mats = mixed_matrices()
    inf = poisson2d(6).copy()
    inf.data[5] = -np.inf
    longer = poisson2d(7)  # data longer than its stored entries: left to the whole-array check
    longer.data = np.r_[longer.data, np.nan]
    longer.indices = np.r_[longer.indices, 0].astype(longer.indices.dtype)
    mats += [inf, longer]
    pairs = [(A, np.ones(A.shape[0], dtype=A.dtype)) for A in mats]
    pairs += [(poisson2d(5), np.ones(25)) for _ in range(16)]
    work = validate.symmetry_pass(mats)
    covered = work.covered()
    assert id(longer.data) not in covered and id(inf.data) in covered
    assert covered == {id(A.data) for A in mats if A.data.shape[0] == A.nnz}
    arrays = validate.finite_candidates(pairs, covered)
    assert not {id(a) for a in arrays} & covered and any(a is longer.data for a in arrays)
    finite = validate.FinitePass(arrays)
    with ms.config.override(host_threads=2, host_parallel_min_work=0.0):
        validate.run_all([work, finite])
    found = {id(a) for a in work.finite_data()} | {id(a) for a in finite.finite()}
    for A, b in pairs:
        assert (id(A.data) in found) == bool(np.isfinite(A.data).all()), A
        assert id(b) in found


def test_pass_fills_the_cache_as_the_per_matrix_tests_do():
    mats = mixed_matrices()
    cache: dict = {}
    with ms.config.override(host_threads=2, host_parallel_min_work=0.0):
        validate.check_symmetry(mats, cache)
    assert cache.get(id(mats[6])) is None  # R + I: its pattern is not symmetric
    for A in mats:
        hit = cache.get(id(A))
        if hit is not None:  # absent only where the pattern is not symmetric: is_symmetric decides
            assert hit[0] is A and hit[1] == is_symmetric(A)
        assert is_symmetric(A, cache) == is_symmetric(A)
        got = cache[("gershgorin", id(A))][1]
        np.testing.assert_array_equal(got, gershgorin(A))
    assert is_symmetric(mats[5], cache) and not is_symmetric(mats[3], cache)


def test_ranges_cover_every_matrix_once():
    work = np.array([5.0, 1.0, 1.0, 1.0, 8.0, 2.0, 2.0])
    for count in (1, 2, 3, 16):
        ranges = _threads.work_ranges(work, count, validate.RANGES_PER_THREAD)
        covered = [k for lo, hi in ranges for k in range(lo, hi)]
        assert covered == list(range(len(work)))
        assert len(ranges) <= validate.RANGES_PER_THREAD * count


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finite_arrays_agree_with_all_finite(dtype):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(int(rng.integers(0, 50))).astype(dtype) for _ in range(40)]
    for k, bad in ((3, np.nan), (7, np.inf), (11, -np.inf)):
        arrays[k][0] = bad
    arrays.append(np.full(4, np.finfo(dtype).max, dtype))  # finite, though its sum overflows
    with ms.config.override(host_threads=2, host_parallel_min_work=0.0):
        found = validate.finite_arrays(arrays)
    assert [id(a) for a in found] == [id(a) for a in arrays if inputs.all_finite(a)]
    assert len(found) == len(arrays) - 3


def test_validation_reads_each_array_in_the_pass_and_still_names_a_bad_one(monkeypatch):
    """Many pairs: no per-array finite check for the arrays the pass cleared; a NaN matrix is named."""
    calls = []
    real = inputs.all_finite

    def spy(a):
        calls.append(a)
        return real(a)

    monkeypatch.setattr(inputs, "all_finite", spy)
    mats = [poisson2d(m) for m in range(3, 23)]
    pairs = [(A, np.ones(A.shape[0])) for A in mats]
    bad = poisson2d(5).copy()
    bad.data[3] = np.nan
    pairs.insert(4, (bad, np.ones(25)))
    memo: dict = {}
    assert validate.prefill_finite(pairs, memo) == 2 * len(mats) + 1  # all but bad.data
    results, valid = validate.validate_all(pairs, method="auto", M=None, rtol=1e-8)
    assert [id(a) for a in calls] == [id(bad.data)]  # only the array the pass did not clear
    assert results[4].status is Status.INVALID_INPUT and "A has NaN or Inf" in results[4].message
    assert len(valid) == len(mats)


def test_few_pairs_skip_the_pass():
    pairs = [(poisson2d(4), np.ones(16)) for _ in range(3)]
    assert validate.prefill_finite(pairs, {}) == 0


def test_one_matrix_per_system_solves_as_shared_matrices_do():
    """The W2 shape, small: each system its own matrix, the same methods and answers as shared ones."""
    sizes = [4, 6, 5, 4, 7, 6] * 4
    own = [(poisson2d(m) if k % 3 else convection(m), np.ones(m * m)) for k, m in enumerate(sizes)]
    shared_mats = {}
    shared = []
    for k, m in enumerate(sizes):
        key = (m, bool(k % 3))
        if key not in shared_mats:
            shared_mats[key] = poisson2d(m) if k % 3 else convection(m)
        shared.append((shared_mats[key], np.ones(m * m)))
    dm = DeviceManager(simulate="1x1GiB")
    a = solve_many(own, rtol=1e-8, manager=dm)
    b = solve_many(shared, rtol=1e-8, manager=dm)
    assert [r.method for r in a] == [r.method for r in b]
    assert {r.method for r in a} == {"cg", "bicgstab"}
    for r, s in zip(a, b, strict=True):
        np.testing.assert_allclose(r.to_numpy(), s.to_numpy(), rtol=1e-12, atol=0)
    assert_converged([LinearSystem(A, b_) for A, b_ in own], a)


def test_a_deferred_batch_of_two_methods_runs_as_one_batch_per_method(monkeypatch):
    """Methods found after the plan: a batch holding CG and BiCGStab systems is split by method.

    (Inputs' own matrices are tested before validation; deferred are those
    validation replaced.)
    """
    from managed_solve.scheduling.runner import Runner
    from managed_solve.system.method import choose_method

    regrouped = []
    real = Runner.regroup

    def spy(self, b, dev, exc):
        regrouped.append({m: len(ix) for m, ix in exc.by_method.items()})
        return real(self, b, dev, exc)

    monkeypatch.setattr(Runner, "regroup", spy)
    # float32 matrices with float64 right-hand sides: validation makes new
    # (float64) matrices, whose tests run beside the plan, their methods deferred.
    mats = [(poisson2d(m) if k % 2 else convection(m)).astype(np.float32)
            for k, m in enumerate(range(4, 24))]
    pairs = [(A, np.ones(A.shape[0])) for A in mats]
    results = solve_many(pairs, rtol=1e-8, manager=DeviceManager(simulate="1x1GiB"))
    systems = [LinearSystem(A, b) for A, b in pairs]
    assert regrouped and all(set(r) == {"cg", "bicgstab"} for r in regrouped)
    assert sum(sum(r.values()) for r in regrouped) <= len(systems)  # others: batches of one method
    assert [r.method for r in results] == [choose_method(s, "cuda") for s in systems]
    assert_converged(systems, results)


def test_the_pass_starts_on_the_raw_inputs_and_converted_matrices_are_tested_again(monkeypatch):
    """Inputs' matrices are tested before validation; one that validation replaces is tested under its new object."""
    from managed_solve.system.method import choose_method

    passes = []
    real = validate.symmetry_pass

    def spy(mats, *args):
        passes.append(len(mats))
        return real(mats, *args)

    monkeypatch.setattr(validate, "symmetry_pass", spy)
    mats = [poisson2d(m) for m in range(4, 20)] + [convection(8)]
    pairs = [(A, np.ones(A.shape[0])) for A in mats]
    pairs.append((poisson2d(6).astype(np.float32), np.ones(36)))  # A becomes float64: a new object
    pairs.append((convection(5).astype(np.int64), np.ones(25)))  # integers: not read before validation
    assert len(validate.input_matrices(pairs, "auto", validate.pass_least())) == len(mats) + 1
    assert validate.input_matrices(pairs, "cg", validate.pass_least()) == []
    results = solve_many(pairs, rtol=1e-8, manager=DeviceManager(simulate="1x1GiB"))
    assert passes == [len(mats) + 1, 2]  # the inputs', then the two validation made
    systems = [LinearSystem(A, b) for A, b in pairs]
    assert [r.method for r in results] == [choose_method(s, "cuda") for s in systems]
    assert_converged(systems, results)


def test_systems_with_a_null_space_are_not_deferred():
    """A null space sends an "auto" system through solve() alone: its route is known before its method."""
    from tests._problems import laplacian1d

    A = laplacian1d(30, neumann=True)
    b = A @ np.random.default_rng(0).standard_normal(30)
    others = [(poisson2d(m), np.ones(m * m)) for m in range(4, 14)]
    systems = [LinearSystem(A, b, nullspace="constant"), LinearSystem(A, b + 1.0, nullspace="constant")]
    out = solve_many(systems + [LinearSystem(*p) for p in others],
                     manager=DeviceManager(simulate="1x64MiB"))
    assert out[0].converged and out[1].status is Status.LEAST_SQUARES
    assert all(r.converged for r in out[2:])


def test_finite_check_and_symmetry_tests_share_one_hand_out_before_validation(monkeypatch):
    """One run_all for both passes, then no per-array finite check and no per-matrix test."""
    handed = []
    real = validate.run_all
    finite_calls = []
    real_finite = inputs.all_finite

    def spy(passes):
        handed.append([type(p).__name__ + f":{p.count}" for p in passes])
        return real(passes)

    def spy_finite(a):
        finite_calls.append(a)
        return real_finite(a)

    monkeypatch.setattr(validate, "run_all", spy)
    monkeypatch.setattr(inputs, "all_finite", spy_finite)
    mats = [poisson2d(m) for m in range(4, 24)]
    pairs = [(A, np.ones(A.shape[0])) for A in mats]
    results = solve_many(pairs, rtol=1e-8, manager=DeviceManager(simulate="1x1GiB"))
    # The symmetry kernels check the matrices' entries; the finite pass the b's.
    assert handed[0] == [f"SymmetryPass:{len(mats)}", f"FinitePass:{len(mats)}"]
    assert not finite_calls
    assert all(r.converged and r.method == "cg" for r in results)


def _shuffled_rows(A, seed):
    """``A`` with each row's stored entries in a random order and one entry split in two: not canonical."""
    rng = np.random.default_rng(seed)
    A = A.tocsr(copy=True)
    indices, data = A.indices.copy(), A.data.copy()
    for i in range(A.shape[0]):
        a, b = A.indptr[i], A.indptr[i + 1]
        order = a + rng.permutation(b - a)
        indices[a:b], data[a:b] = indices[order], data[order]
    indptr = A.indptr.copy()
    # Split row 0's first entry into two halves: a duplicate SciPy sums.
    indices = np.insert(indices, 0, indices[0])
    data = np.insert(data, 0, data[0] / 2)
    data[1] /= 2
    indptr[1:] += 1
    B = sp.csr_matrix((data, indices, indptr), shape=A.shape)
    assert not B.has_canonical_format
    for flag in ("_has_canonical_format", "_has_sorted_indices"):  # as fresh: nothing known
        B.__dict__.pop(flag, None)
    return B


def test_the_symmetry_pass_checks_the_pattern_so_scipy_need_not(monkeypatch):
    """Fresh canonical matrices get SciPy's flag from the walk (no SciPy pass over their pattern);
    a matrix out of canonical form is left to the per-matrix test, and solved right."""
    import scipy.sparse._compressed as compressed

    calls = []
    real = compressed.csr_has_canonical_format

    def counting(*args):
        calls.append(id(args[1]))  # the pattern's row pointers
        return real(*args)

    monkeypatch.setattr(compressed, "csr_has_canonical_format", counting)
    fresh = [poisson2d(m) for m in (5, 9, 14)] + [convection(7)]
    for A in fresh:  # as a user builds them: SciPy has not looked at the pattern yet
        A.__dict__.pop("_has_canonical_format", None)
        A.__dict__.pop("_has_sorted_indices", None)
    messy = _shuffled_rows(poisson2d(6), seed=5)
    calls.clear()
    pairs = [(A, np.ones(A.shape[0])) for A in fresh + [messy]]
    res = solve_many(pairs, manager=DeviceManager(["cpu"]), rtol=1e-10)
    for (A, b), r in zip(pairs, res, strict=True):
        assert r.converged and np.linalg.norm(b - A @ r.x) <= 1e-10 * np.linalg.norm(b)
    # Of the inputs, only the matrix out of canonical form (derived matrices may be checked).
    assert id(messy.indptr) in calls and not {id(A.indptr) for A in fresh} & set(calls)
    assert all(A.__dict__.get("_has_canonical_format") is True for A in fresh)
    # The auto policy chooses as for the same matrices in canonical form, SciPy's flags known.
    known = [poisson2d(m) for m in (5, 9, 14)] + [convection(7), poisson2d(6)]
    assert all(A.has_canonical_format for A in known)
    ref = solve_many([(A, np.ones(A.shape[0])) for A in known], manager=DeviceManager(["cpu"]),
                     rtol=1e-10)
    assert [r.method for r in res] == [r.method for r in ref]
    assert res[0].method == "cg"
    # The summed matrix is the one solved: the same answer as SciPy's for it.
    np.testing.assert_allclose(res[-1].x, spla_spsolve(poisson2d(6), np.ones(36)), rtol=1e-8)


def spla_spsolve(A, b):
    import scipy.sparse.linalg as spla

    return spla.spsolve(A.tocsc(), b)


@pytest.mark.parametrize("change", ["short data", "short indptr"])
def test_a_matrix_whose_arrays_were_changed_is_refused_not_walked(change):
    """The symmetry pass walks indptr, indices and data without bounds checks: a SciPy CSR whose
    arrays no longer agree in length goes to the full check, which refuses it."""
    good = poisson2d(40).tocsr()
    bad = good.copy()
    if change == "short data":
        bad.data = bad.data[:-50]
    else:
        bad.indptr = bad.indptr[:-1]
    assert validate.symmetry_candidate(good) and not validate.symmetry_candidate(bad)
    res = solve_many([(good, np.ones(1600)), (bad, np.ones(1600))], manager=DeviceManager(["cpu"]))
    assert res[0].status is Status.CONVERGED
    assert res[1].status is Status.INVALID_INPUT and "rebuild A" in res[1].message


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_zero_b_drops_x0_and_solves_to_zero_exactly(where):
    """b = 0 with an x0: x = 0 exactly, on the host and for a GPU b (read with the others at once)."""
    A = poisson2d(6)
    n = A.shape[0]
    rng = np.random.default_rng(3)
    b = rng.standard_normal(n)
    x0 = rng.standard_normal(n)
    if where == "cuda":
        import cupy as cp
        import cupyx.scipy.sparse as csp

        A, b, x0, zero = csp.csr_matrix(A), cp.asarray(b), cp.asarray(x0), cp.zeros(n)
        dm = DeviceManager(["cuda:0"])
    else:
        zero = np.zeros(n)
        dm = DeviceManager(["cpu"])
    items = [LinearSystem(A, zero, x0=x0), LinearSystem(A, b, x0=x0), LinearSystem(A, zero, x0=x0)]
    _, valid = validate.validate_all(items, method="auto", M=None, rtol=None)
    assert [valid[i].x0 is None for i in range(3)] == [True, False, True]
    assert all(s.x0 is x0 for s in items)  # the caller's systems are left as they were
    out = solve_many(items, manager=dm, return_on="host")
    assert [r.status for r in out] == [Status.CONVERGED] * 3
    assert not out[0].x.any() and not out[2].x.any()
    assert out[0].iterations == 0 == out[2].iterations
    ref = np.linalg.solve(poisson2d(6).toarray(), np.asarray(b.get() if where == "cuda" else b))
    np.testing.assert_allclose(out[1].x, ref, rtol=1e-6, atol=1e-8)
