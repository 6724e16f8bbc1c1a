"""LinearSystem (system/linear_system.py): validation once at construction, facts, moves."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from managed_solve import LinearSystem, Solver, mesh, pde, solve, solve_many
from managed_solve.system.linear_system import host_csr_systems
from tests._problems import BACKENDS, host, laplacian1d, neumann2d, on, poisson2d


def test_facts():
    A = laplacian1d(10)
    s = LinearSystem(A, np.ones(10), x0=np.zeros(10), name="lap")
    assert (s.n, s.nnz, s.shape) == (10, 28, (10, 10))
    assert s.nbytes == A.data.nbytes + A.indices.nbytes + A.indptr.nbytes + 2 * 80
    assert s.workspace_bytes("cg") == 4 * 10 * 8
    assert s.signature == (10, 28, "float64", "auto", "csr")
    assert s.device == "cpu"
    assert s.is_symmetric_hint is True
    assert LinearSystem(A + sp.eye(10, k=2), np.ones(10)).is_symmetric_hint is False
    assert "lap" in repr(s)


@pytest.mark.parametrize(
    "make,exc,words",
    [
        (lambda: LinearSystem(sp.random(4, 5, density=0.5, format="csr"), np.ones(4)),
         ValueError, ["square", "(4, 5)"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(5)), ValueError, ["b must have shape (6,)", "(5,)"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones((6, 2))), ValueError, ["b must have shape", "solve_many"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), x0=np.ones(3)), ValueError, ["x0 must have shape (6,)"]),
        (lambda: LinearSystem(sp.csr_matrix((0, 0)), np.ones(0)), ValueError, ["empty"]),
        (lambda: LinearSystem(laplacian1d(6).astype(np.complex128), np.ones(6)), TypeError, ["complex", "real"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6, dtype=np.complex64)), TypeError, ["b", "complex"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), dtype=np.float16), TypeError, ["float16", "float32"]),
        (lambda: LinearSystem(laplacian1d(6), np.array(["a"] * 6)), TypeError, ["b", "float32 or float64"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), rtol=-1), ValueError, ["rtol"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), rtol=0, atol=0), ValueError, ["rtol and atol"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), maxiter=0), ValueError, ["maxiter"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), method="lu"), ValueError, ["method='lu'", "gmres"]),
        (lambda: LinearSystem(laplacian1d(6), np.ones(6), M="ilu"), ValueError, ["M='ilu'", "jacobi"]),
        (lambda: LinearSystem(sla.aslinearoperator(laplacian1d(6)), np.ones(6), method="direct"),
         ValueError, ["direct", "operator"]),
        (lambda: LinearSystem("A", np.ones(6)), TypeError, ["str", "sparse"]),
        (lambda: LinearSystem(None, np.ones(6)), TypeError, ["A is None"]),
    ],
)
def test_bad_input_names_the_argument(make, exc, words):
    with pytest.raises(exc) as info:
        make()
    for w in words:
        assert w in str(info.value)
    assert "LinearSystem" in str(info.value)


def test_to_cpu_keeps_options():
    s = LinearSystem(laplacian1d(6), np.ones(6), rtol=1e-6, method="cg", M="jacobi", name="n")
    t = s.to("cpu")
    assert (t.rtol, t.method, t.M, t.name) == (1e-6, "cg", "jacobi", "n")
    assert t.A is s.A  # already on the host: no copy
    assert s.to("sim:0").device == "cpu"


def test_replaced_keeps_the_system_and_refuses_unknown_fields():
    A = laplacian1d(6)
    s = LinearSystem(A, np.ones(6), rtol=1e-9)
    t = s.replaced(A=(2.0 * A).tocsr(), M="jacobi")
    assert t is not s and t.M == "jacobi" and t.rtol == 1e-9 and t.b is s.b
    np.testing.assert_allclose(t.A.toarray(), 2.0 * A.toarray())
    assert s.A is A and s.M != "jacobi"  # the original is untouched
    with pytest.raises(TypeError, match=r"replaced\(m=\.\.\.\).*expected one of"):
        s.replaced(m="jacobi")


def _fields(s):
    return {k: (id(v) if isinstance(v, (np.ndarray, sp.spmatrix, sp.sparray)) else v)
            for k, v in vars(s).items()}


@pytest.mark.parametrize("form", [sp.csr_matrix, sp.csr_array])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_host_csr_and_a_vector_of_its_dtype_give_the_general_path_fields(form, dtype):
    """The commonest input's quick path sets what the full checks set (dtype= takes those)."""
    A = form(laplacian1d(300).astype(dtype))
    b = np.ones(300, dtype=dtype)
    for options in [{}, {"rtol": 0, "atol": 1e-3}, {"rtol": np.float64(1e-6), "maxiter": 7},
                    {"method": "cg", "M": "jacobi"}, {"M": None, "name": "s"},
                    {"method": "direct", "M": "auto"}, {"M": "amg", "check_finite": False}]:
        quick = LinearSystem(A, b, **options)
        full = LinearSystem(A, b, dtype=dtype, **options)
        assert _fields(quick) == _fields(full), options
        assert list(vars(quick)) == list(vars(full))
        assert quick.dtype is np.dtype(dtype) or quick.dtype == np.dtype(dtype)
        assert quick.A is A and quick.b is b and quick.grad is None
    # A pattern that is not canonical is summed in place, as the full path does.
    C = form((np.array([1.0, 2.0, 3.0], dtype), np.array([0, 0, 1]), np.array([0, 2, 3])),
             shape=(2, 2))
    s = LinearSystem(C, np.ones(2, dtype))
    assert s.A is C and C.has_canonical_format and C.nnz == 2
    np.testing.assert_array_equal(C.toarray(), [[3.0, 0.0], [0.0, 3.0]])


@pytest.mark.parametrize("options", [{"rtol": 1e-6, "method": "auto", "M": "auto"},
                                     {"rtol": 0.5, "method": "cg", "M": "jacobi"},
                                     {"rtol": 1, "method": "gmres", "M": None}])
def test_host_csr_systems_builds_what_the_constructor_builds(options):
    A = laplacian1d(300)
    memo: dict = {}

    def build(A, b):
        return host_csr_systems([(A, b)], memo=memo, label="s", **options)[0]

    for form in (sp.csr_matrix, sp.csr_array):
        for dtype in (np.float32, np.float64):
            B, b = form(A.astype(dtype)), np.ones(300, dtype=dtype)
            quick = build(B, b)
            assert _fields(quick) == _fields(LinearSystem(B, b, name="s[0]", **options))
            assert list(vars(quick)) == list(vars(LinearSystem(B, b, name="s[0]", **options)))
    # Other inputs are the constructor's; a NaN gives the constructor's error.
    assert build(A.tocoo(), np.ones(300)) is None and build(A, [1.0] * 300) is None
    assert build(A, np.ones(300, dtype=np.float32)) is None
    assert host_csr_systems([A, [A, np.ones(300)]], memo=memo, **options) == [None, None]
    bad = np.ones(300)
    bad[7] = np.nan
    quick = build(A, bad)
    assert isinstance(quick, ValueError)
    with pytest.raises(ValueError) as full:
        LinearSystem(A, bad, name="s[0]", **options)
    assert str(quick) == str(full.value)


def test_host_csr_systems_leaves_options_that_fail_to_the_constructor():
    items = [(laplacian1d(3), np.ones(3))]
    assert host_csr_systems(items, rtol=0, method="auto", M="auto", memo=None) == [None]  # atol is 0 too
    assert host_csr_systems(items, rtol=1e-8, method="lu", M="auto", memo=None) == [None]
    assert host_csr_systems(items, rtol=1e-8, method="auto", M=np.eye(3), memo=None) == [None]
    assert host_csr_systems(items, rtol="tight", method="auto", M="auto", memo=None) == [None]
    assert host_csr_systems(items, rtol=1e-8, method="auto", M="auto", memo=None)[0] is not None


def _out_of_range(A):
    """A with its last column index one past the matrix (SciPy's constructor takes it)."""
    col = A.indices.copy()
    col[-1] = A.shape[1]
    return sp.csr_matrix((A.data, col, A.indptr), shape=A.shape)


def _falling_pointers(A):
    ptr = A.indptr.copy()
    ptr[2], ptr[3] = ptr[3], ptr[2]
    return sp.csr_matrix((A.data, A.indices, ptr), shape=A.shape)


def test_host_csr_systems_refuses_a_bad_pattern_and_remembers_the_good_ones():
    """The quick path checks each matrix's pattern once a call: the memo keeps the valid ones."""
    A, b = laplacian1d(6), np.ones(6)
    bad = _out_of_range(A)
    memo: dict = {}
    out = host_csr_systems([(A, b), (bad, b), (A, 2 * b)], rtol=1e-8, method="auto", M="auto",
                           memo=memo, label="s")
    assert isinstance(out[0], LinearSystem) and isinstance(out[2], LinearSystem)
    assert isinstance(out[1], ValueError)
    assert str(out[1]) == ("LinearSystem('s[1]'): A has column indices outside [0, 6); fix the "
                           "matrix's col_indices / indices")
    assert memo[id(A)] is A and id(bad) not in memo


@pytest.mark.parametrize(
    "A,b,options,words",
    [
        (laplacian1d(6), np.r_[np.ones(5), np.nan], {}, "b has NaN or Inf entries"),
        (laplacian1d(6) * np.inf, np.ones(6), {}, "A has NaN or Inf entries"),
        (laplacian1d(6), np.ones(6), {"rtol": -1.0}, "rtol must be a finite number >= 0"),
        (laplacian1d(6), np.ones(6), {"atol": np.nan}, "atol must be a finite number >= 0"),
        (laplacian1d(6), np.ones(6), {"rtol": 0, "atol": 0}, "rtol and atol are both 0"),
        (laplacian1d(6), np.ones(6), {"maxiter": 2.5}, "maxiter must be a positive integer"),
        (laplacian1d(6), np.ones(6), {"method": "lu"}, "method='lu' is not known"),
        (laplacian1d(6), np.ones(6), {"M": "ilu"}, "M='ilu' is not a known preconditioner"),
        (laplacian1d(6), np.ones(7), {}, "b must have shape (6,)"),
        (_out_of_range(laplacian1d(6)), np.ones(6), {}, "A has column indices outside [0, 6)"),
        (_falling_pointers(laplacian1d(6)), np.ones(6), {}, "A's row pointers"),
    ],
)
def test_a_host_csr_with_a_bad_option_or_entry_gets_the_full_checks_error(A, b, options, words):
    with pytest.raises(ValueError) as quick:
        LinearSystem(A, b, **options)
    with pytest.raises(ValueError) as full:
        LinearSystem(A, b, dtype=np.float64, **options)
    assert str(quick.value) == str(full.value) and words in str(quick.value)


@pytest.mark.parametrize("form", ["sparse", "dense"])
def test_an_operator_takes_a_matrix_preconditioner(form):
    """M given as a matrix (an approximate inverse) with an operator A: the constructor compared
    M with "jacobi" and raised NumPy's ambiguous-truth or isnan error."""
    import managed_solve as ms

    A = poisson2d(8)
    n = A.shape[0]
    Minv = sp.diags(1.0 / A.diagonal()).tocsr()
    M = Minv if form == "sparse" else Minv.toarray()
    b = np.linspace(1.0, 2.0, n)
    s = LinearSystem(sla.aslinearoperator(A), b, M=M, method="cg")
    res = ms.solve(s, device="cpu")
    many = ms.solve_many([(sla.aslinearoperator(A), b)], M=M, method="cg",
                         manager=ms.DeviceManager(["cpu"]))[0]
    want = sla.spsolve(A.tocsc(), b)
    for r in (res, many):
        assert r.converged, r.message
        assert np.linalg.norm(r.to_numpy() - want) <= 1e-6 * np.linalg.norm(want)


# -- nullspace= checked against A, once, where the system is made
def null_ratio(A, v):
    """``||A v|| / (||A||_est ||v||)``, ``||A||_est`` the larger absolute row or column sum (dense NumPy)."""
    D = np.abs(A.toarray())
    return np.linalg.norm(A @ v) / (max(D.sum(axis=1).max(), D.sum(axis=0).max()) * np.linalg.norm(v))


def measured(err):
    """The ratio an error message reports."""
    return float(re.search(r"\|\|A v\|\| / \(\|\|A\|\| \|\|v\|\|\) = ([0-9.e+-]+),", str(err)).group(1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_nullspace_that_A_does_not_annihilate_is_refused_by_every_entry_point(backend, dtype):
    # A Dirichlet Laplacian is nonsingular: the constant is not in its null space (ratio 0.078).
    A = poisson2d(12)
    b = np.random.default_rng(0).standard_normal(144)
    expected = null_ratio(A, np.ones(144))
    Ad, bd = on(backend, A.astype(dtype), b.astype(dtype))
    device = "cpu" if backend == "cpu" else "cuda:0"
    calls = {
        "LinearSystem(A, b)": lambda: LinearSystem(Ad, bd, nullspace="constant"),
        "solve(A, b)": lambda: solve(Ad, bd, method="cg", nullspace="constant", device=device),
        "solve(A, b) ": lambda: solve(Ad, bd, method="direct", nullspace="constant", device=device),
        "solve(A, B)": lambda: solve(Ad, bd.reshape(-1, 1).repeat(2, axis=1), nullspace="constant",
                                     device=device),
        "Solver(A)": lambda: Solver(Ad, method="cg", nullspace="constant", device=device),
    }
    for call, make in calls.items():
        with pytest.raises(ValueError) as err:
            make()
        message = str(err.value)
        assert message.startswith(f"{call.strip()}: nullspace= is not A's null space"), message
        assert "nullspace='constant'" in message and "drop nullspace=" in message
        assert measured(err.value) == pytest.approx(expected, rel=1e-2)
    # The constants of the pure Neumann Laplacian are its null space: accepted, and solved.
    N = neumann2d(12)
    rhs = b - b.mean()
    Nd, rd = on(backend, N.astype(dtype), rhs.astype(dtype))
    res = solve(Nd, rd, method="cg", nullspace="constant", device=device, rtol=1e-4)
    assert res.converged
    assert np.linalg.norm(N @ host(res.x) - rhs) <= 1e-3 * np.linalg.norm(rhs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_refused_vector_is_named_by_its_index_for_sparse_and_dense_matrices(backend):
    L = neumann2d(6)
    A = sp.block_diag([L, 3.0 * L], format="csr")  # two components: one constant each
    N = np.zeros((72, 2))
    N[:36, 0] = N[36:, 1] = 1.0
    bad = N.copy()
    bad[:, 1] = np.arange(72.0)  # not annihilated
    b = np.zeros(72)
    for matrix in (A, A.toarray()):
        Ad, bd = on(backend, matrix, b)
        LinearSystem(Ad, bd, nullspace=N)  # the true null space passes, unnormalised
        with pytest.raises(ValueError, match=re.escape("nullspace[:, 1] gives")) as err:
            LinearSystem(Ad, bd, nullspace=bad)
        assert measured(err.value) == pytest.approx(null_ratio(A, bad[:, 1]), rel=1e-2)
        with pytest.raises(ValueError, match="nullspace gives") as err:
            LinearSystem(Ad, bd, nullspace=bad[:, 1])
        assert measured(err.value) == pytest.approx(null_ratio(A, bad[:, 1]), rel=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [1.0, 6e37, 1e-30])
def test_the_check_holds_at_the_ends_of_the_float_range(backend, dtype, scale):
    # 6e37: float32 row sums overflow (8 * 6e37); 1e-30: products near float32's underflow.
    b = np.zeros(144)
    singular, regular = on(backend, (neumann2d(12) * scale).astype(dtype),
                           (poisson2d(12) * scale).astype(dtype))
    bd = on(backend, b.astype(dtype))
    LinearSystem(singular, bd, nullspace="constant")
    with pytest.raises(ValueError, match="nullspace='constant'") as err:
        LinearSystem(regular, bd, nullspace="constant")
    assert measured(err.value) == pytest.approx(null_ratio(poisson2d(12), np.ones(144)), rel=1e-2)


def test_a_rescaled_singular_matrix_and_mesh_laplacians_keep_their_null_space_in_float32():
    # S N S annihilates S^-1 1, entries spanning e^+-6: rounding stays far below the tolerance.
    s = np.exp(np.random.default_rng(1).uniform(-3.0, 3.0, 400))
    A = (sp.diags(s) @ neumann2d(20) @ sp.diags(s)).tocsr().astype(np.float32)
    LinearSystem(A, np.zeros(400, dtype=np.float32), nullspace=1.0 / s)
    for m in (mesh.icosphere(3), mesh.grid(12, 12, 4)):
        f = np.cos(3.0 * m.vertices[:, 0])
        for dtype in (np.float32, np.float64):
            # Pure Neumann: the builder sets nullspace=.
            system = pde.poisson(m, f, dtype=dtype, device="cpu",
                                 rtol=1e-5 if dtype == np.float32 else 1e-8)
            assert system.nullspace is not None
            assert solve(system).converged


def test_solve_many_solves_singular_systems_beside_regular_ones_and_a_bad_one_is_refused_where_made():
    L, P = neumann2d(10), poisson2d(10)
    b = np.random.default_rng(2).standard_normal(100)
    with pytest.raises(ValueError, match="LinearSystem\\('bad'\\): nullspace= is not A's null space"):
        LinearSystem(P, b, nullspace="constant", name="bad")
    out = solve_many([LinearSystem(L, b - b.mean(), nullspace="constant"), (P, b),
                      LinearSystem(L, b, nullspace=np.ones(100))], devices="cpu")
    assert [r.status.name for r in out] == ["CONVERGED", "CONVERGED", "LEAST_SQUARES"]


class CountingMatrix(np.ndarray):
    """A dense matrix that counts its products with one (n, 1) column: the null-space check's."""

    def __matmul__(self, other):
        if getattr(other, "ndim", 1) == 2 and other.shape[1] == 1:
            self.checks.append(other.shape)
        return np.asarray(self) @ other


def test_the_nullspace_is_checked_once_per_system_not_per_solve():
    A = neumann2d(6).toarray().view(CountingMatrix)
    A.checks = []
    b = np.random.default_rng(3).standard_normal(36)
    b -= b.mean()
    with Solver(A, method="cg", nullspace="constant", device="cpu") as solver:
        for _ in range(3):
            assert solver.solve(b).converged
        assert solver.solve(np.stack([b, 2.0 * b], axis=1)).converged
    assert A.checks == [(36, 1)]
    A.checks.clear()
    assert solve(A, b, method="gmres", nullspace="constant", device="cpu").converged
    assert A.checks == [(36, 1)]
