"""Inputs taken where they lie (system/inputs.py), through LinearSystem: kinds, dtypes, finiteness, views."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

import managed_solve as ms
from managed_solve import LinearSystem
from tests._problems import laplacian1d


def test_accepts_sparse_dense_and_operator():
    A = laplacian1d(6)
    assert LinearSystem(A, np.ones(6)).kind == "csr"
    assert LinearSystem(A.tocoo(), np.ones(6)).kind == "csr"
    assert LinearSystem(sp.csr_array(A), np.ones(6)).kind == "csr"
    assert LinearSystem(A.toarray(), np.ones(6)).kind == "dense"
    assert LinearSystem(sla.aslinearoperator(A), np.ones(6)).kind == "operator"
    col = LinearSystem(A, np.ones((6, 1)))
    assert col.b.shape == (6,)


def test_dtypes():
    A32 = laplacian1d(6, np.float32)
    assert LinearSystem(A32, np.ones(6, np.float32)).dtype == np.float32
    assert LinearSystem(A32, np.ones(6)).dtype == np.float64  # mixed -> float64
    s = LinearSystem(laplacian1d(6).astype(np.int64), np.ones(6, dtype=np.int32))
    assert s.dtype == np.float64 and s.A.dtype == np.float64 and s.b.dtype == np.float64
    s = LinearSystem(laplacian1d(6), np.ones(6), dtype="float32")
    assert s.A.dtype == np.float32 and s.b.dtype == np.float32


@pytest.mark.parametrize("where", ["A", "b", "x0", "dense A"])
def test_nan_and_inf_are_rejected(where):
    A, b, x0 = laplacian1d(6), np.ones(6), np.zeros(6)
    if where == "A":
        A = A.copy()
        A.data[2] = np.nan
    elif where == "dense A":
        A = A.toarray()
        A[1, 1] = np.inf
    elif where == "b":
        b[3] = np.inf
    else:
        x0[0] = np.nan
    with pytest.raises(ValueError, match=f"{where.split()[-1]} has NaN or Inf"):
        LinearSystem(A, b, x0=x0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finiteness_check_huge_finite_entries_pass_nan_and_inf_still_fail(dtype):
    """The fast check (one reduction) overflows on huge finite entries: the exact test decides."""
    big = np.finfo(dtype).max / 2
    A = laplacian1d(6, dtype) * big  # every sum and dot of these overflows to inf
    b = np.full(6, big, dtype=dtype)
    x0 = np.full(6, -big, dtype=dtype)
    dense = A.toarray()
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.dot(b, b)) and not np.isfinite(dense.sum() + big * 6)
    s = LinearSystem(A, b, x0=x0)
    assert s.dtype == dtype
    LinearSystem(dense, b, x0=x0)
    for bad in (np.nan, np.inf, -np.inf):
        for where in ("A", "dense A", "b", "x0"):
            A2, d2, b2, x2 = A.copy(), dense.copy(), b.copy(), x0.copy()
            if where == "A":
                A2.data[3] = bad
            elif where == "dense A":
                d2[2, 4] = bad
            elif where == "b":
                b2[5] = bad
            else:
                x2[1] = bad
            with pytest.raises(ValueError, match=f"{where.split()[-1]} has NaN or Inf"):
                LinearSystem(d2 if where == "dense A" else A2, b2, x0=x2)


def test_finiteness_memo_skips_arrays_already_checked_only():
    A, b = laplacian1d(6), np.ones(6)
    memo: dict = {}
    LinearSystem(A, b, _finite_memo=memo)
    assert memo[id(A.data)] is A.data and memo[id(b)] is b
    b2 = b.copy()
    b2[0] = np.nan
    with pytest.raises(ValueError, match="b has NaN or Inf"):
        LinearSystem(A, b2, _finite_memo=memo)  # a new array is checked
    assert id(b2) not in memo


@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")
def test_torch_inputs_are_views_not_copies():
    torch = pytest.importorskip("torch")
    A = laplacian1d(8)
    tb = torch.arange(8, dtype=torch.float64)
    s = LinearSystem(torch.tensor(A.toarray()), tb)
    assert s.kind == "dense"
    assert np.shares_memory(s.b, tb.numpy())
    crow = torch.from_numpy(A.indptr.astype(np.int64))
    col = torch.from_numpy(A.indices.astype(np.int64))
    vals = torch.from_numpy(A.data.copy())
    tA = torch.sparse_csr_tensor(crow, col, vals, size=A.shape)
    s = LinearSystem(tA, tb)
    assert s.kind == "csr"
    assert np.shares_memory(s.A.data, vals.numpy())
    assert (s.A != A).nnz == 0
    s = LinearSystem(tA.to_sparse_coo(), tb)
    assert s.kind == "csr" and (s.A != A).nnz == 0
    grad_b = torch.ones(8, dtype=torch.float64, requires_grad=True)
    assert LinearSystem(A, grad_b).b.dtype == np.float64


@pytest.mark.gpu
def test_mixed_devices_rejected_on_gpu():
    import cupy as cp

    with pytest.raises(ValueError, match="one device"):
        LinearSystem(laplacian1d(6), cp.ones(6))


def test_a_crow_col_values_tuple_is_a_csr_matrix():
    from managed_solve.system.inputs import as_operator

    A = laplacian1d(6)
    M, kind = as_operator((A.indptr, A.indices, A.data))
    assert kind == "csr" and M.shape == (6, 6) and (M != A).nnz == 0
    with pytest.raises(ValueError, match=r"\(crow, col, values\)"):
        as_operator((A.indptr, A.indices, A.data[:-1]))


def _spoiled(A, how):
    """A's (crow, col, values) with one index spoiled: a column out of range or a decreasing crow."""
    crow, col = A.indptr.copy(), A.indices.copy()
    if how == "col_high":
        col[-1] = A.shape[0] + 91
    elif how == "col_negative":
        col[-1] = -1
    elif how == "col_huge":
        col[0] = 10**8
    elif how == "crow_decreasing":
        crow[2], crow[3] = crow[3], crow[2]
    elif how == "crow_short":
        crow[-1] -= 1
    return crow, col, A.data.copy()


@pytest.mark.parametrize("how", ["col_high", "col_negative", "col_huge", "crow_decreasing",
                                 "crow_short"])
def test_a_csr_pattern_out_of_range_is_refused_before_any_kernel_reads_it(how):
    """Neither SciPy's constructor nor torch checks the indices; every kernel would read out of bounds."""
    import managed_solve as ms

    A, b = laplacian1d(8), np.ones(8)
    match = "column indices outside" if how.startswith("col") else "row pointers"
    with pytest.raises(ValueError, match=rf"solve\(A, b\): A.*{match}"):
        ms.solve(_spoiled(A, how), b)
    res = ms.solve_many([(A, b), (_spoiled(A, how), b), (A, 2 * b)], devices=["cpu"])
    assert [r.status for r in res] == [ms.Status.CONVERGED, ms.Status.INVALID_INPUT,
                                       ms.Status.CONVERGED]
    assert match in res[1].message
    torch = pytest.importorskip("torch")
    crow, col, val = (torch.tensor(a) for a in _spoiled(A, how))
    if how.startswith("col"):  # torch refuses a decreasing crow itself
        t = torch.sparse_csr_tensor(crow, col, val, size=(8, 8), check_invariants=False)
        with pytest.raises(ValueError, match=match):
            ms.solve(t, torch.ones(8, dtype=torch.float64))


def _spoiled_scipy(A, how):
    """A SciPy matrix equal to A but for one index out of range or broken row pointers.

    Built as a user builds one (SciPy's constructor checks neither) or changed
    after it was built (SciPy checks nothing then); its error's words.
    """
    n, nnz = A.shape[0], A.nnz
    crow, col, val = A.indptr.copy(), A.indices.copy(), A.data.copy()
    if how == "csr_col_high":
        col[-1] = n + 91
    elif how == "csr_col_negative":
        col[4] = -1
    elif how == "csr_col_int64":
        crow, col = crow.astype(np.int64), col.astype(np.int64)
        col[0] = 2**40
    elif how == "csr_crow_decreasing":
        crow[2], crow[3] = crow[3], crow[2]
    if how in ("csr_col_high", "csr_col_negative", "csr_col_int64", "csr_crow_decreasing"):
        B = sp.csr_matrix((val, col, crow), shape=A.shape)
        return B, "column indices outside" if "_col_" in how else "row pointers"
    if how == "csr_array_changed":  # indptr[-1] below len(indices), after construction
        B = sp.csr_array(A, copy=True)
        B.indptr[-1] = nnz - 1
        return B, "row pointers"
    if how == "csr_crow_negative_known_canonical":  # a flag SciPy holds is not a bounds check
        B = A.copy()
        assert B.has_canonical_format
        B.indptr[1] = -3
        return B, "row pointers"
    if how == "csr_col_known_canonical":
        B = sp.csr_matrix((val, col, crow), shape=A.shape)
        B.indices[-1] = n  # still sorted in its row: SciPy's own check finds it canonical
        assert B.has_canonical_format
        return B, "column indices outside"
    if how == "csc_row_high":
        C = A.tocsc()
        return sp.csc_matrix((C.data, np.where(C.indices == n - 1, n, C.indices), C.indptr),
                             shape=A.shape), "row indices outside"
    if how == "coo_changed":
        C = A.tocoo(copy=True)
        C.col[3] = n
        return C, "column indices outside"
    if how == "bsr_block_col_high":
        return sp.bsr_matrix((np.ones((2, 2, 2)), np.array([0, n // 2]), np.array([0, 1, 2, 2, 2])),
                             shape=A.shape), "block column indices outside"
    if how == "lil_changed":  # a LIL matrix converts without a check
        L = A.tolil()
        L.rows[2], L.data[2] = [1, n + 1], [-1.0, 2.0]
        return L, "column indices outside"
    raise AssertionError(how)


SCIPY_SPOILED = ["csr_col_high", "csr_col_negative", "csr_col_int64", "csr_crow_decreasing",
                 "csr_array_changed", "csr_crow_negative_known_canonical",
                 "csr_col_known_canonical", "csc_row_high", "coo_changed", "bsr_block_col_high",
                 "lil_changed"]


@pytest.mark.parametrize("how", SCIPY_SPOILED)
def test_a_scipy_matrix_out_of_range_is_refused_by_every_entry(how):
    """SciPy builds compressed matrices without reading their indices: each entry point checks them."""
    import managed_solve as ms

    A, b = laplacian1d(8), np.arange(1.0, 9.0)
    B, words = _spoiled_scipy(A, how)
    with pytest.raises(ValueError, match=rf"solve\(A, b\): A.*{words}"):
        ms.solve(B, b, device="cpu")
    with pytest.raises(ValueError, match=words):
        ms.solve(B, b, x0=np.zeros(8), device="cpu")  # the general path, not the quick one
    with pytest.raises(ValueError, match=rf"Solver\(A\): A.*{words}"):
        ms.Solver(B, device="cpu")
    x_ref = sla.spsolve(A.tocsc(), b)
    for method in ("auto", "cg"):
        res = ms.solve_many([(A, b), (B, b), (A, 2 * b)], devices=["cpu"], method=method)
        assert [r.status for r in res] == [ms.Status.CONVERGED, ms.Status.INVALID_INPUT,
                                           ms.Status.CONVERGED]
        assert words in res[1].message and res[1].x is None
        np.testing.assert_allclose(np.asarray(res[0].x), x_ref, rtol=1e-7)
        np.testing.assert_allclose(np.asarray(res[2].x), 2 * x_ref, rtol=1e-7)
    solver = ms.Solver(A, device="cpu")
    with pytest.raises(ValueError, match=rf"Solver.update\(A\): A.*{words}"):
        solver.update(B)
    np.testing.assert_allclose(np.asarray(solver.solve(b).x), x_ref, rtol=1e-7)  # unchanged


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_unsorted_and_duplicate_columns_are_legal_csr_and_solved(where):
    """Only the bounds are required: rows out of order, or with duplicates (summed), solve as SciPy reads them."""
    import managed_solve as ms
    from tests._problems import on

    A, b = laplacian1d(8), np.arange(1.0, 9.0)
    crow, col, val = A.indptr, A.indices.copy(), A.data.copy()
    row1 = slice(crow[1], crow[2])
    col[row1], val[row1] = col[row1][::-1].copy(), val[row1][::-1].copy()  # row 1 reversed
    unsorted = sp.csr_matrix((val, col, crow), shape=A.shape)
    # Row 0's diagonal split into two stored entries of the same column.
    dup = sp.csr_matrix((np.concatenate([A.data[:1] / 2, A.data[:1] / 2, A.data[1:]]),
                         np.concatenate([[0, 0], A.indices[1:]]),
                         np.concatenate([[0], A.indptr[1:] + 1])), shape=A.shape)
    assert not unsorted.has_canonical_format and not dup.has_canonical_format
    x_ref = sla.spsolve(A.tocsc(), b)
    for M in (unsorted, dup):
        x = ms.solve(on(where, M.copy()), on(where, b), device=where).x
        np.testing.assert_allclose(x.get() if hasattr(x, "get") else np.asarray(x), x_ref,
                                   rtol=1e-7)
        res = ms.solve_many([(on(where, M.copy()), on(where, b))] * 2, devices=[where])
        assert all(r.status is ms.Status.CONVERGED for r in res)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["csr_col_high", "csr_col_negative", "csr_crow_decreasing",
                                 "csr_col_known_canonical", "csc_row_high"])
def test_a_cupyx_matrix_out_of_range_is_refused_on_the_gpu(how):
    """The GPU path checks a cupyx matrix's pattern in one pass (its own message, the same words).

    Also where CuPy found the matrix canonical already (its test reads no
    bounds), and a CSC matrix before its conversion scatters by its rows.
    """
    import cupy as cp
    import cupyx.scipy.sparse as csp

    import managed_solve as ms
    from tests._problems import on

    A, b = laplacian1d(8), np.arange(1.0, 9.0)
    B, words = _spoiled_scipy(A, how)
    form = csp.csc_matrix if B.format == "csc" else csp.csr_matrix
    B = form((cp.asarray(B.data), cp.asarray(B.indices), cp.asarray(B.indptr)), shape=B.shape)
    if how == "csr_col_known_canonical":
        assert B.has_canonical_format  # CuPy's own test, as a user's sum_duplicates runs it
    Ag, bg = on("cuda", A, b)
    with pytest.raises(ValueError, match=rf"solve\(A, b\): A.*{words}"):
        ms.solve(B, bg, device="cuda")
    res = ms.solve_many([(Ag, bg), (B, bg), (Ag, 2 * bg)], devices=["cuda"])
    assert [r.status for r in res] == [ms.Status.CONVERGED, ms.Status.INVALID_INPUT,
                                       ms.Status.CONVERGED]
    assert words in res[1].message


def _many_patterns():
    """SciPy CSR matrices of both index widths: valid ones (canonical or not), each kind of bad one."""
    out = []
    for k in range(30):
        A = laplacian1d(5 + k % 7)
        crow, col = A.indptr.copy(), A.indices.copy()
        if k % 5 == 1:
            col[crow[1]:crow[2]] = col[crow[1]:crow[2]][::-1].copy()  # unsorted: valid
        elif k % 5 == 2:
            col[k % A.nnz] = A.shape[1] + k if k % 2 else -k
        elif k % 5 == 3:
            crow[2], crow[3] = crow[3], crow[2]
        if k % 3 == 0:
            crow, col = crow.astype(np.int64), col.astype(np.int64)
        if k % 11 == 4:  # indices as a strided view
            col = np.repeat(col, 2)[::2]
        out.append(sp.csr_matrix((A.data.copy(), col, crow), shape=A.shape))
    return out


def test_solve_many_refuses_each_bad_pattern_among_many():
    import managed_solve as ms

    mats = _many_patterns()
    pairs = [(A, np.arange(1.0, A.shape[0] + 1)) for A in mats]
    res = ms.solve_many(pairs, devices=["cpu"])
    for k, (r, (A, b)) in enumerate(zip(res, pairs, strict=True)):
        if k % 5 in (2, 3):
            assert r.status is ms.Status.INVALID_INPUT and f"systems[{k}]" in r.message
            assert ("column indices outside" if k % 5 == 2 else "row pointers") in r.message
        else:
            assert r.status is ms.Status.CONVERGED
            np.testing.assert_allclose(r.x, sla.spsolve(A.tocsc(), b), rtol=1e-7)


def test_host_csr_pattern_marks_a_canonical_matrix_for_scipy_only_where_unknown():
    from managed_solve.system.inputs import host_csr_pattern

    A = laplacian1d(6)
    fresh = sp.csr_matrix((A.data, A.indices, A.indptr), shape=A.shape)
    assert "_has_canonical_format" not in vars(fresh)
    assert host_csr_pattern(fresh) == 1 and fresh._has_canonical_format is True
    col = A.indices.copy()
    col[A.indptr[1]:A.indptr[2]] = col[A.indptr[1]:A.indptr[2]][::-1].copy()  # row 1 reversed
    unsorted = sp.csr_matrix((A.data, col, A.indptr), shape=A.shape)
    assert host_csr_pattern(unsorted) == 0 and "_has_canonical_format" not in vars(unsorted)
    assert not unsorted.has_canonical_format  # left to SciPy, which sorts it
    known = A.copy()
    assert known.has_canonical_format
    assert host_csr_pattern(known) == 0  # bounds read; SciPy's flag kept
    col[1] = 6
    bad = sp.csr_matrix((A.data, col, A.indptr), shape=A.shape)
    assert host_csr_pattern(bad) < 0 and "_has_canonical_format" not in vars(bad)


def test_grad_source_records_what_requires_grad_and_refuses_what_cannot_have_one():
    torch = pytest.importorskip("torch")
    from managed_solve.system.inputs import grad_source

    A = laplacian1d(4)
    crow, col = torch.tensor(A.indptr), torch.tensor(A.indices)
    vals = torch.tensor(A.data, requires_grad=True)
    b = torch.ones(4, dtype=torch.float64, requires_grad=True)
    assert grad_source(A, np.ones(4), call="t") is None
    assert grad_source(A, torch.ones(4), call="t") is None
    csr = torch.sparse_csr_tensor(crow, col, vals, (4, 4))
    assert grad_source(csr, b, call="t").form == "csr"
    assert grad_source(csr, b, call="t").b is b
    assert grad_source(csr.to_sparse_coo(), None, call="t").form == "coo"
    got = grad_source((crow, col, vals), None, call="t")
    assert got.form == "values" and got.A is vals and got.b is None
    assert grad_source(torch.eye(4, requires_grad=True), None, call="t").form == "dense"
    with torch.no_grad():
        assert grad_source(csr, b, call="t") is None
    with pytest.raises(TypeError, match="layout"):
        grad_source(torch.eye(4).to_sparse_bsr((2, 2)).requires_grad_(), None, call="t")
    assert LinearSystem(csr, b).grad.A is csr


# ------------------------------------------------------------------ torch device kinds
def _mps_tensor(torch, values):
    class OnMps(torch.Tensor):  # Linux has no mps device: a tensor that reports one
        @property
        def device(self):
            return torch.device("mps")

    return torch.as_tensor(values).as_subclass(OnMps)


def test_mps_tensor_and_device_run_on_the_cpu_with_one_warning():
    torch = pytest.importorskip("torch")
    import warnings

    import managed_solve as ms
    from managed_solve.devices import DeviceWarning, forget_warnings

    A = laplacian1d(40)
    forget_warnings()
    b = _mps_tensor(torch, np.ones(40))
    assert b.device.type == "mps"
    with pytest.warns(DeviceWarning, match="mps device.*solves on the CPU") as rec:
        r = ms.solve(A, b, rtol=1e-10)
    assert len([w for w in rec if issubclass(w.category, DeviceWarning)]) == 1
    assert r.converged and r.device == "cpu"
    np.testing.assert_allclose(A @ r.to_numpy(), np.ones(40), atol=1e-8)
    forget_warnings()
    with pytest.warns(DeviceWarning, match="mps"):
        out = ms.solve_many([LinearSystem(A, _mps_tensor(torch, np.ones(40)))])
    assert out[0].converged and out[0].device == "cpu"
    forget_warnings()
    with pytest.warns(DeviceWarning, match="mps"):
        assert ms.solve(A, np.ones(40), device="mps").device == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ms.solve(A, np.ones(40), device=torch.device("mps")).device == "cpu"  # once
    forget_warnings()


def test_meta_tensor_is_a_clear_error_never_solved():
    torch = pytest.importorskip("torch")
    import managed_solve as ms

    A = laplacian1d(40)
    b = torch.ones(40, dtype=torch.float64, device="meta")
    with pytest.raises(TypeError, match="meta device.*not solved"):
        ms.solve(A, b)
    (r,) = ms.solve_many([(A, b)])  # solve_many reports a bad system instead of raising
    assert r.status is ms.Status.INVALID_INPUT and r.x is None and "meta device" in r.message
    with pytest.raises(ValueError, match="meta device holds shapes"):
        ms.solve(A, np.ones(40), device="meta")


def test_host_nonfinite_names_the_first_bad_array_and_remembers_the_good_ones():
    from managed_solve.system.inputs import host_nonfinite

    good, bad = np.ones(5), np.array([1.0, np.nan, 2.0])
    memo: dict = {}
    assert host_nonfinite(bad, good, memo) is bad
    assert memo == {}  # b not read after A's entries failed
    assert host_nonfinite(good, bad, memo) is bad
    assert memo == {id(good): good}  # found finite, kept; the bad one is not
    assert host_nonfinite(None, good, memo) is None and host_nonfinite(good, good, None) is None


def test_torch_dtypes_without_a_numpy_counterpart_are_refused_naming_the_argument():
    torch = pytest.importorskip("torch")
    import managed_solve as ms

    A = laplacian1d(8)
    with pytest.raises(TypeError, match=r"b is a torch tensor of dtype torch.bfloat16.*b.to\(torch.float32\)"):
        ms.solve(A, torch.ones(8, dtype=torch.bfloat16), device="cpu")
    with pytest.raises(TypeError, match=r"A is a torch tensor of dtype torch.bfloat16"):
        ms.solve(torch.tensor(A.toarray(), dtype=torch.bfloat16), np.ones(8), device="cpu")
    # float16 has a NumPy counterpart and is solved (in float64: the system's dtype rule).
    x = ms.solve(A, torch.ones(8, dtype=torch.float16), device="cpu").x
    np.testing.assert_allclose(np.asarray(x), sla.spsolve(A.tocsc(), np.ones(8)), rtol=1e-10)


def test_a_torch_dtype_numpy_lacks_is_refused_naming_the_argument_whatever_its_name():
    """A list of bad names misses each new torch dtype (float4 packed, say): torch's own error
    named no argument."""
    torch = pytest.importorskip("torch")
    odd = [getattr(torch, n) for n in ("bfloat16", "float4_e2m1fn_x2", "float8_e4m3fn", "bits8")
           if hasattr(torch, n)]
    for dt in odd:
        with pytest.raises(TypeError, match=r"solve\(A, b\): b is a torch tensor of dtype .* "
                                            r"NumPy and CuPy cannot represent"):
            ms.solve(np.eye(4), torch.zeros(4, dtype=dt))
