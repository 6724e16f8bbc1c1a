"""DLPack handoff: same memory both ways, dense and CSR, CPU here and CUDA on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

torch = pytest.importorskip("torch")

from managed_solve.dlpack import as_torch, from_torch  # noqa: E402
from managed_solve.result import SolveResult, Status  # noqa: E402
from managed_solve.tensor import managed  # noqa: E402


def _csr(n=30, seed=0, index_dtype=np.int32):
    A = sp.random(n, n, density=0.2, format="csr", random_state=seed) + sp.eye(n, format="csr")
    A = A.tocsr()
    A.indptr = A.indptr.astype(index_dtype)
    A.indices = A.indices.astype(index_dtype)
    return A


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "cpu":
        return np
    import cupy

    return cupy


def _ptr(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def test_as_torch_dense_shares_memory(xp):
    a = xp.arange(12.0).reshape(3, 4)
    t = as_torch(a)
    assert t.data_ptr() == _ptr(a)
    assert tuple(t.shape) == (3, 4) and t.dtype == torch.float64
    assert t.device.type == ("cpu" if xp is np else "cuda")
    t[1, 2] = -7.0  # a write through torch is seen by the array: same memory
    assert float(a[1, 2]) == -7.0


def test_as_torch_noncontiguous_view_shares_memory():
    a = np.arange(20.0).reshape(4, 5)[:, ::2]
    t = as_torch(a)
    assert t.data_ptr() == a.ctypes.data
    np.testing.assert_array_equal(t.numpy(), a)


def test_as_torch_csr_shares_all_three_arrays(xp):
    A = _csr()
    if xp is not np:
        import cupyx.scipy.sparse as csp

        A = csp.csr_matrix(A)
    T = as_torch(A)
    assert T.layout == torch.sparse_csr
    assert T.values().data_ptr() == _ptr(A.data)
    assert T.col_indices().data_ptr() == _ptr(A.indices)
    assert T.crow_indices().data_ptr() == _ptr(A.indptr)
    x = np.linspace(0.0, 1.0, A.shape[0])
    ref = (A.get() if xp is not np else A) @ x
    got = (T @ torch.as_tensor(x, device=T.device)).cpu().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-13)


def test_as_torch_rejects_other_sparse_formats_and_types():
    with pytest.raises(TypeError, match=r"as_torch\(array=...\).*A.tocsr\(\)"):
        as_torch(sp.eye(3, format="coo"))
    with pytest.raises(TypeError, match=r"as_torch\(array=...\).*list"):
        as_torch([1.0, 2.0])


def test_from_torch_dense_shares_memory(xp):
    dev = "cpu" if xp is np else "cuda"
    t = torch.arange(10.0, device=dev)
    a = from_torch(t)
    assert _ptr(a) == t.data_ptr()
    assert type(a).__module__.split(".")[0] == xp.__name__


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_from_torch_csr_keeps_memory_and_index_dtype_on_cpu(index_dtype):
    A = _csr(index_dtype=np.int64)
    T = torch.sparse_csr_tensor(
        torch.from_numpy(A.indptr).to(index_dtype), torch.from_numpy(A.indices).to(index_dtype),
        torch.from_numpy(A.data), size=A.shape,
    )
    B = from_torch(T)
    assert sp.issparse(B) and B.format == "csr"
    assert B.indptr.dtype == np.dtype(str(index_dtype).split(".")[1])  # no downcast copy
    assert B.data.ctypes.data == T.values().data_ptr()
    assert B.indices.ctypes.data == T.col_indices().data_ptr()
    assert B.indptr.ctypes.data == T.crow_indices().data_ptr()
    x = np.arange(A.shape[0], dtype=np.float64)
    np.testing.assert_allclose(B @ x, A @ x, rtol=1e-14)


@pytest.mark.gpu
def test_from_torch_csr_int32_on_gpu_shares_memory():
    A = _csr()
    T = as_torch(A).to("cuda")  # int32 indices: cupyx can share them
    B = from_torch(T)
    assert B.data.data.ptr == T.values().data_ptr()
    assert B.indices.data.ptr == T.col_indices().data_ptr()
    assert B.indptr.data.ptr == T.crow_indices().data_ptr()
    x = np.arange(A.shape[0], dtype=np.float64)
    import cupy

    np.testing.assert_allclose((B @ cupy.asarray(x)).get(), A @ x, rtol=1e-13)


def test_from_torch_coo_converts_to_csr():
    A = _csr()
    T = torch.from_numpy(A.toarray()).to_sparse_coo()
    B = from_torch(T)
    assert B.format == "csr"
    np.testing.assert_allclose(B.toarray(), A.toarray())


def test_from_torch_requires_grad_detaches_with_a_note_never_copies():
    t = torch.arange(5.0, requires_grad=True)
    with pytest.warns(UserWarning, match=r"from_torch\(tensor\): the tensor requires grad.*not copied"):
        a = from_torch(t)
    assert a.ctypes.data == t.data_ptr()


def test_from_torch_managed_tensor_shares_memory():
    t = managed(torch.arange(6.0))
    a = from_torch(t)
    assert a.ctypes.data == t.data_ptr()
    assert type(a) is np.ndarray


def test_from_torch_rejects_non_tensors():
    with pytest.raises(TypeError, match=r"from_torch\(tensor\): expected a torch.Tensor, got ndarray"):
        from_torch(np.ones(3))


def test_round_trip_identity_of_pointers(xp):
    a = xp.linspace(0.0, 1.0, 7)
    b = from_torch(as_torch(a))
    assert _ptr(b) == _ptr(a)


def test_solve_result_to_torch_shares_x(xp):
    x = xp.arange(5.0)
    r = SolveResult(x=x, status=Status.CONVERGED, iterations=1, residual_norm=0.0, b_norm=1.0,
                    device="cpu" if xp is np else "cuda:0")
    t = r.to_torch()
    assert t.data_ptr() == _ptr(x)


@pytest.mark.gpu
def test_as_torch_waits_for_the_producing_cupy_stream():
    """A result written on a side stream is complete when torch reads it on its own stream."""
    import cupy

    n = 1 << 24
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        a = cupy.zeros(n)
        for _ in range(20):  # enough queued work that a missing wait would read zeros
            a += 1.0
    t = as_torch(a, stream=side)
    total = float(t.sum())  # runs on torch's current stream, ordered after `side`
    assert total == 20.0 * n


@pytest.mark.gpu
def test_as_torch_keeps_the_gpu_index():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cupy.cuda.Device(1):
        a = cupy.arange(4.0)
    t = as_torch(a)
    assert t.device == torch.device("cuda:1") and t.data_ptr() == a.data.ptr


def test_a_read_only_array_is_copied_so_no_in_place_change_reaches_it():
    """torch has no read-only tensors: a view of read-only memory would let mul_() write into
    an immutable bytes object or a Mesh's vertices (behind its cached area)."""
    from managed_solve import mesh

    raw = bytes(16)
    t = as_torch(np.frombuffer(raw, dtype=np.float64))
    t[0] = 5.0
    assert raw == bytes(16) and float(t[0]) == 5.0
    m = mesh.icosphere(1)
    before = m.vertices.copy()
    as_torch(m.vertices).mul_(2.0)
    np.testing.assert_array_equal(m.vertices, before)
    writable = np.arange(3.0)
    assert as_torch(writable).data_ptr() == writable.ctypes.data  # zero-copy where writable
