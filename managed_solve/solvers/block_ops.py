"""The passes over an n x k block of the block Krylov loops: NumPy forms and their CUDA twins.

:mod:`managed_solve.solvers.block` writes CG and BiCGStab once over ``xp``;
what touches the whole block (the product with A, column dot products, the
fused vector updates) goes through a :class:`BlockOps` of the block's array
module. Each operation has a NumPy form and a CUDA form of the same
arithmetic: values in the vectors' dtype, every sum and every scalar in
float64, as the single-vector engines do.

Layout: a block is C-ordered (rows contiguous) on the host, where SciPy's
SpMM walks rows, and F-ordered (columns contiguous) on a GPU, where
cuSPARSE's SpMM takes it as it is and each column is one stretch of memory
for the kernels below. The CUDA kernels put one column on each ``blockIdx.y``
and return at once for a column that has stopped, so a finished column costs
no memory traffic there; the NumPy forms restrict themselves to the running
columns by indexing (the loop compacts the block there as soon as a column
finishes, see :attr:`BlockOps.compact_at`). Column sums go through
per-thread-block partial sums added in a fixed order, so a solve repeats
bit for bit.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _backend

log = logging.getLogger("managed_solve")
# ------------------------------------------------------------------------------ CUDA
#: The CUDA twins of :class:`NumpyBlockOps`'s passes (compiled with NVRTC by CuPy).
CUDA_SOURCE = r"""
// Blocks are column-major n x m: column j starts at j * n. grid.y is the
// column, the blocks of grid.x stride its rows; a stopped column returns at
// once. Each thread block writes its partial sums to part[j * gridDim.x + bx].

__device__ __forceinline__ double msb_block_sum(double v) {
    __shared__ double warp_sums[32];
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    __syncthreads();  // an earlier sum's reads of warp_sums are done
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    const unsigned warps = (blockDim.x + 31u) >> 5;
    v = threadIdx.x < warps ? warp_sums[threadIdx.x] : 0.0;
    if (warp == 0) {
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;  // the block's sum, in thread 0
}

// part1 = U . V and (TWO) part2 = U . W, per column.
template <typename T, bool TWO>
__global__ void msb_dots(const long long n, const T* U, const T* V, const T* W,
                         const bool* __restrict__ live, double* part1, double* part2) {
    const long long j = blockIdx.y;
    if (!live[j]) return;
    const long long off = j * n;
    double s1 = 0.0, s2 = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const double u = U[off + i];
        s1 += u * (double)V[off + i];
        if (TWO) s2 += u * (double)W[off + i];
    }
    s1 = msb_block_sum(s1);
    if (TWO) s2 = msb_block_sum(s2);
    if (threadIdx.x == 0) {
        part1[j * gridDim.x + blockIdx.x] = s1;
        if (TWO) part2[j * gridDim.x + blockIdx.x] = s2;
    }
}

// X += a P, R -= a Q (per-column a); part1 = r . r; SECOND 1: part2 = r . (dinv r),
// SECOND 2: part2 = rt . r; ZOUT: Z = dinv r. P may be R or Z (read before written).
template <typename T, int SECOND, bool ZOUT>
__global__ void msb_update(const long long n, T* X, T* R, const T* P, const T* Q,
                           const double* __restrict__ a, const bool* __restrict__ live,
                           const T* __restrict__ dinv, const T* __restrict__ Rt, T* Z,
                           double* part1, double* part2) {
    const long long j = blockIdx.y;
    if (!live[j]) return;
    const double aj = a[j];
    const long long off = j * n;
    double s1 = 0.0, s2 = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = off + i;
        const double p = P[e];
        const double q = Q[e];
        X[e] = (T)((double)X[e] + aj * p);
        const double r = (double)R[e] - aj * q;
        R[e] = (T)r;
        s1 += r * r;
        if (SECOND == 1) s2 += r * ((double)dinv[i] * r);
        if (SECOND == 2) s2 += (double)Rt[e] * r;
        if (ZOUT) Z[e] = (T)((double)dinv[i] * r);
    }
    s1 = msb_block_sum(s1);
    if (SECOND != 0) s2 = msb_block_sum(s2);
    if (threadIdx.x == 0) {
        part1[j * gridDim.x + blockIdx.x] = s1;
        if (SECOND != 0) part2[j * gridDim.x + blockIdx.x] = s2;
    }
}

// CG's direction P = z + beta P with z = R (ZMODE 0), dinv R (1) or Z (2).
template <typename T, int ZMODE>
__global__ void msb_cg_direction(const long long n, T* P, const T* R, const T* __restrict__ dinv,
                                 const T* Z, const double* __restrict__ beta,
                                 const bool* __restrict__ live) {
    const long long j = blockIdx.y;
    if (!live[j]) return;
    const double bj = beta[j];
    const long long off = j * n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = off + i;
        double z;
        if (ZMODE == 0) z = R[e];
        else if (ZMODE == 1) z = (double)dinv[i] * (double)R[e];
        else z = Z[e];
        P[e] = (T)(z + bj * (double)P[e]);
    }
}

// BiCGStab's direction P = R + beta (P - omega V); JAC: Z = dinv P.
template <typename T, bool JAC>
__global__ void msb_bicg_direction(const long long n, T* P, const T* R, const T* V,
                                   const T* __restrict__ dinv, T* Z,
                                   const double* __restrict__ beta,
                                   const double* __restrict__ omega,
                                   const bool* __restrict__ live) {
    const long long j = blockIdx.y;
    if (!live[j]) return;
    const double bj = beta[j];
    const double wj = omega[j];
    const long long off = j * n;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long e = off + i;
        const double p = (double)R[e] + bj * ((double)P[e] - wj * (double)V[e]);
        P[e] = (T)p;
        if (JAC) Z[e] = (T)((double)dinv[i] * p);
    }
}
"""

THREADS = 256
ROWS_PER_THREAD = 8
#: gridDim.y's limit: at most this many columns in one launch.
MAX_COLUMNS = 65535
_CTYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_SECOND = {None: 0, "dinv": 1, "rt": 2}


def _names(T: str) -> dict[str, str]:
    names = {}
    for two in (0, 1):
        names[f"dots{two}"] = f"msb_dots<{T}, {'true' if two else 'false'}>"
    for second in (0, 1, 2):
        for zout in (0, 1):
            names[f"update{second}{zout}"] = f"msb_update<{T}, {second}, {'true' if zout else 'false'}>"
    for zmode in (0, 1, 2):
        names[f"cg_direction{zmode}"] = f"msb_cg_direction<{T}, {zmode}>"
    for jac in (0, 1):
        names[f"bicg_direction{jac}"] = f"msb_bicg_direction<{T}, {'true' if jac else 'false'}>"
    return names


_lock = threading.Lock()  # the fused functions' cache below


def cuda_kernels(device_id: int, dtype: Any) -> dict[str, Any]:
    """The block kernels for one device and value dtype, compiled once and cached."""
    return _backend.raw_kernels(device_id, CUDA_SOURCE, _names(_CTYPES[np.dtype(dtype)]))


class FusedOrPlain:
    """``cupy.fuse(fn)``; ``fn`` itself, one kernel an operation, where CuPy cannot fuse it.

    The fused form is an optimisation only (the operations and their order
    are the same), so a CuPy that fails to compile it runs the plain form.
    """

    def __init__(self, fn: Callable[..., Any], cp: Any):
        self.fn = fn
        self.fused = cp.fuse()(fn)
        self.works: bool | None = None

    def __call__(self, *args: Any) -> Any:
        if self.works is not False:
            try:
                out = self.fused(*args)
            except Exception as exc:
                if self.works:  # it ran before: a real error, not one of fusing
                    raise
                self.works = False
                log.warning("managed_solve: cupy.fuse could not compile %s (%s); running its "
                            "operations one kernel each", self.fn.__name__, exc)
            else:
                self.works = True
                return out
        return self.fn(*args)


_FUSED: dict[Callable[..., Any], FusedOrPlain] = {}


@functools.cache
def _sm_count(device_id: int) -> int:
    cp = _backend.cupy()
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


# ------------------------------------------------------------------------------ NumPy
class NumpyBlockOps:
    """The block passes on the host (C-ordered blocks).

    ``compact_at``: the loop compacts the block once its running columns are
    at most this fraction of its width. Here a stopped column still costs
    indexing work, so the block is compacted as soon as one stops.
    """

    order = "C"
    compact_at = 1.0

    def __init__(self) -> None:
        self.xp = np

    # -- layout
    def empty(self, n: int, m: int, dtype: Any) -> np.ndarray:
        return np.empty((n, m), dtype=dtype, order=self.order)

    def zeros(self, n: int, m: int, dtype: Any) -> np.ndarray:
        return np.zeros((n, m), dtype=dtype, order=self.order)

    def asblock(self, a: Any, dtype: Any) -> np.ndarray:
        """``a`` in this layout and dtype (a copy only where needed)."""
        return np.asarray(a, dtype=dtype, order=self.order)

    def copy(self, a: np.ndarray) -> np.ndarray:
        return a.copy(order=self.order)

    def take(self, a: np.ndarray, cols: Any) -> np.ndarray:
        """Columns ``cols`` of ``a`` as a new block."""
        return np.asarray(a[:, cols], order=self.order)

    def column(self, a: np.ndarray, j: int) -> np.ndarray:
        return np.ascontiguousarray(a[:, j])

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (elementwise operations on k-vectors) as this device runs it best: as it is here."""
        return fn

    # -- products
    def matmul(self, A: Any, P: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``A @ P`` (SciPy's SpMM walks P's rows; a dense A goes to BLAS, into ``out``)."""
        if isinstance(A, np.ndarray):
            return np.matmul(A, P, out=out)
        return np.asarray(A @ P, dtype=P.dtype, order=self.order)

    @staticmethod
    def _running(live: np.ndarray) -> Any:
        return slice(None) if live.all() else np.flatnonzero(live)

    @staticmethod
    def _coldot(U: np.ndarray, V: np.ndarray) -> np.ndarray:
        return np.einsum("ij,ij->j", U, V, dtype=np.float64)

    def dots(self, U: np.ndarray, V: np.ndarray, W: np.ndarray | None,
             live: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``U . V`` (and ``U . W``) per running column, float64 (0 for stopped ones)."""
        c = self._running(live)
        m = U.shape[1]
        s1 = np.zeros(m)
        s1[c] = self._coldot(U[:, c], V[:, c])
        s2 = None
        if W is not None:
            s2 = np.zeros(m)
            s2[c] = self._coldot(U[:, c], W[:, c])
        return s1, s2

    def update(self, X: np.ndarray, R: np.ndarray, P: np.ndarray, Q: np.ndarray, a: np.ndarray,
               live: np.ndarray, *, second: str | None = None, dinv: Any = None, Rt: Any = None,
               Z: Any = None) -> tuple[np.ndarray, np.ndarray | None]:
        """``X += a P``, ``R -= a Q`` on the running columns; ``r . r`` and the second sum.

        ``second``: None, ``"dinv"`` (``r . D^-1 r``) or ``"rt"`` (``rt . r``).
        ``Z`` given: ``Z = D^-1 R`` afterwards. ``P`` may be ``R`` or ``Z``.
        """
        c = self._running(live)
        m = X.shape[1]
        s1 = np.zeros(m)
        s2 = np.zeros(m) if second is not None else None
        whole = isinstance(c, slice)
        ac = a[c]
        p = P[:, c]
        upd = p * ac
        if whole:
            X += upd.astype(X.dtype, copy=False)
            R -= (Q[:, c] * ac).astype(R.dtype, copy=False)
            r = R
        else:
            X[:, c] = X[:, c] + upd
            r = R[:, c] - Q[:, c] * ac
            R[:, c] = r
            r = R[:, c]
        s1[c] = self._coldot(r, r)
        if second == "dinv":
            s2[c] = self._coldot(r, dinv[:, None] * r)
        elif second == "rt":
            s2[c] = self._coldot(Rt[:, c], r)
        if Z is not None:
            Z[:, c] = dinv[:, None] * r
        return s1, s2

    def cg_direction(self, P: np.ndarray, R: np.ndarray, dinv: Any, Z: Any, beta: np.ndarray,
                     live: np.ndarray) -> None:
        """``P = z + beta P`` on the running columns, z = R, ``D^-1 R`` (dinv) or Z."""
        c = self._running(live)
        if Z is not None:
            z = Z[:, c]
        elif dinv is not None:
            z = dinv[:, None] * R[:, c]
        else:
            z = R[:, c]
        if isinstance(c, slice):
            P *= beta.astype(P.dtype)
            P += z
        else:
            P[:, c] = z + beta[c] * P[:, c]

    def bicg_direction(self, P: np.ndarray, R: np.ndarray, V: np.ndarray, dinv: Any, Z: Any,
                       beta: np.ndarray, omega: np.ndarray, live: np.ndarray) -> None:
        """``P = R + beta (P - omega V)`` on the running columns; ``Z = D^-1 P`` when dinv."""
        c = self._running(live)
        p = R[:, c] + beta[c] * (P[:, c] - omega[c] * V[:, c])
        P[:, c] = p
        if dinv is not None:
            Z[:, c] = dinv[:, None] * P[:, c]


# ------------------------------------------------------------------------------ CuPy
class CupyBlockOps(NumpyBlockOps):
    """The block passes on one GPU (F-ordered blocks, the kernels of :data:`CUDA_SOURCE`).

    A stopped column costs nothing in the kernels, only in the SpMM, so the
    block is compacted once a quarter of its columns have stopped.
    """

    order = "F"
    compact_at = 0.75

    def __init__(self, device_id: int) -> None:
        self.xp = _backend.cupy()
        self.device_id = int(device_id)
        self._sms = _sm_count(self.device_id)
        self._parts: dict[tuple[int, int], tuple[Any, Any]] = {}

    # -- layout
    def empty(self, n: int, m: int, dtype: Any) -> Any:
        return self.xp.empty((n, m), dtype=dtype, order="F")

    def zeros(self, n: int, m: int, dtype: Any) -> Any:
        return self.xp.zeros((n, m), dtype=dtype, order="F")

    def asblock(self, a: Any, dtype: Any) -> Any:
        return self.xp.asfortranarray(self.xp.asarray(a, dtype=dtype))

    def copy(self, a: Any) -> Any:
        return a.copy(order="F")

    def take(self, a: Any, cols: Any) -> Any:
        return self.xp.asfortranarray(a[:, self.xp.asarray(cols)])

    def column(self, a: Any, j: int) -> Any:
        return a[:, j]  # contiguous: a column of an F-ordered block

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` compiled by ``cupy.fuse`` into one kernel (a dozen launches saved an iteration)."""
        with _lock:
            got = _FUSED.get(fn)
            if got is None:
                got = _FUSED[fn] = FusedOrPlain(fn, self.xp)
            return got

    # -- products
    def matmul(self, A: Any, P: Any, out: Any) -> Any:
        """``A @ P``: cuSPARSE's SpMM into ``out`` for a sparse A (no zero fill), cuBLAS for a dense one."""
        if isinstance(A, self.xp.ndarray):
            return self.xp.asfortranarray(A @ P)
        from cupyx import cusparse

        if not A.has_canonical_format:
            A.sum_duplicates()  # what A @ P does first; SpMM needs sorted, summed entries
        if A.format == "csr" and cusparse.check_availability("spmm"):
            return cusparse.spmm(A, P, c=out)
        return self.xp.asfortranarray(A @ P)

    # -- launches
    def _grid(self, n: int, m: int) -> tuple[int, int]:
        # About ROWS_PER_THREAD rows a thread: many waves of blocks, so the last
        # wave's idle multiprocessors cost little whatever the kernel's occupancy;
        # at least a wave in all when the block is thin.
        per_column = max(math.ceil(n / (THREADS * ROWS_PER_THREAD)), math.ceil(self._sms * 8 / m))
        return max(1, min(per_column, math.ceil(n / THREADS), 65535)), m

    def _partials(self, gx: int, m: int) -> tuple[Any, Any]:
        key = (gx, m)
        got = self._parts.get(key)
        if got is None:
            got = (self.xp.zeros((m, gx)), self.xp.zeros((m, gx)))
            self._parts[key] = got
        return got

    def _k(self, name: str, dtype: Any) -> Any:
        return cuda_kernels(self.device_id, dtype)[name]

    @staticmethod
    def _or(a: Any, fallback: Any) -> Any:
        return a if a is not None else fallback

    def dots(self, U: Any, V: Any, W: Any, live: Any) -> tuple[Any, Any]:
        n, m = U.shape
        gx, gy = self._grid(n, m)
        p1, p2 = self._partials(gx, m)
        two = W is not None
        self._k(f"dots{int(two)}", U.dtype)((gx, gy), (THREADS,),
                                           (np.int64(n), U, V, self._or(W, U), live, p1, p2))
        return p1.sum(axis=1), (p2.sum(axis=1) if two else None)

    def update(self, X: Any, R: Any, P: Any, Q: Any, a: Any, live: Any, *,
               second: str | None = None, dinv: Any = None, Rt: Any = None,
               Z: Any = None) -> tuple[Any, Any]:
        n, m = X.shape
        gx, gy = self._grid(n, m)
        p1, p2 = self._partials(gx, m)
        code = _SECOND[second]
        kernel = self._k(f"update{code}{int(Z is not None)}", X.dtype)
        kernel((gx, gy), (THREADS,), (np.int64(n), X, R, P, Q, a, live, self._or(dinv, X),
                                      self._or(Rt, X), self._or(Z, X), p1, p2))
        return p1.sum(axis=1), (p2.sum(axis=1) if code else None)

    def cg_direction(self, P: Any, R: Any, dinv: Any, Z: Any, beta: Any, live: Any) -> None:
        n, m = P.shape
        zmode = 2 if Z is not None else (1 if dinv is not None else 0)
        self._k(f"cg_direction{zmode}", P.dtype)(
            self._grid(n, m), (THREADS,),
            (np.int64(n), P, R, self._or(dinv, P), self._or(Z, P), beta, live))

    def bicg_direction(self, P: Any, R: Any, V: Any, dinv: Any, Z: Any, beta: Any, omega: Any,
                       live: Any) -> None:
        n, m = P.shape
        jac = dinv is not None
        self._k(f"bicg_direction{int(jac)}", P.dtype)(
            self._grid(n, m), (THREADS,),
            (np.int64(n), P, R, V, self._or(dinv, P), self._or(Z, P), beta, omega, live))


def block_ops(xp: Any, like: Any = None) -> NumpyBlockOps:
    """The block passes of array module ``xp`` (for CuPy, on the device of array ``like``)."""
    if xp is np:
        return NumpyBlockOps()
    return CupyBlockOps(like.device.id if like is not None else xp.cuda.Device().id)
