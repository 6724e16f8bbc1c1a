"""CuPy kernels of the sharded Krylov loop (fused vector updates and partial dots).

Compiled lazily on first use and cached per dtype by CuPy. The NumPy twins of
these operations live in :mod:`managed_solve.sharded.comm` (``HostOps``); both
compute the same thing, so the simulated-device tests check the numerics and
the GPU tests check these kernels.

Scalars (``alpha``, ``beta``) are 0-d device arrays read inside the kernels
(``raw T a`` then ``a[0]``): the loop never reads them on the host.
"""

from __future__ import annotations

import functools

from .. import _backend

_DOTS_SRC = r"""
extern "C" __global__ void ms_sharded_dots3(const double* __restrict__ r,
                                            const double* __restrict__ u,
                                            const double* __restrict__ w,
                                            long long n, double* __restrict__ out) {
    // out[0] += (r,u), out[1] += (w,u), out[2] += (r,r); out zeroed by the caller.
    __shared__ double s0[256], s1[256], s2[256];
    double a0 = 0.0, a1 = 0.0, a2 = 0.0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const double ri = r[i], ui = u[i];
        a0 += ri * ui;
        a1 += w[i] * ui;
        a2 += ri * ri;
    }
    s0[threadIdx.x] = a0; s1[threadIdx.x] = a1; s2[threadIdx.x] = a2;
    __syncthreads();
    for (int k = blockDim.x / 2; k > 0; k >>= 1) {
        if (threadIdx.x < k) {
            s0[threadIdx.x] += s0[threadIdx.x + k];
            s1[threadIdx.x] += s1[threadIdx.x + k];
            s2[threadIdx.x] += s2[threadIdx.x + k];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        atomicAdd(out, s0[0]); atomicAdd(out + 1, s1[0]); atomicAdd(out + 2, s2[0]);
    }
}
"""


_SCALARS_SRC = r"""
extern "C" __global__ void ms_sharded_cg_scalars(double* sc, const double* __restrict__ tot,
                                                 double tol2, double* hist, long long pos) {
    // sc = [gamma, alpha, beta, bad]; tot = [(r,u), (Au,u), (r,r)] summed over shards.
    const double g = tot[0], delta = tot[1], rr = tot[2];
    const double beta = sc[0] != 0.0 ? g / sc[0] : 0.0;
    const double ga = sc[1] != 0.0 ? g / sc[1] : 0.0;
    const double curv = delta - beta * ga;  // (p, A p) of textbook CG
    if (curv <= 0.0 && rr > tol2) sc[3] = 1.0;
    sc[1] = curv != 0.0 ? g / curv : 0.0;
    sc[2] = beta;
    sc[0] = g;
    if (pos >= 0) hist[pos] = rr;
}
"""


@functools.cache
def _kernels():
    cp = _backend.cupy()
    update_xr = cp.ElementwiseKernel(
        "raw T a, T p, T s", "T x, T r",
        "const T al = a[0]; x += al * p; r -= al * s;",
        "ms_sharded_update_xr",
    )
    update_ps = cp.ElementwiseKernel(
        "raw T b, T u, T w", "T p, T s",
        "const T be = b[0]; p = u + be * p; s = w + be * s;",
        "ms_sharded_update_ps",
    )
    dots3 = cp.RawKernel(_DOTS_SRC, "ms_sharded_dots3")
    scalars = cp.RawKernel(_SCALARS_SRC, "ms_sharded_cg_scalars")
    return update_xr, update_ps, dots3, scalars


def update_xr(alpha, p, s, x, r) -> None:
    """``x += alpha p; r -= alpha s`` in one pass (alpha a 1-element device array)."""
    _kernels()[0](alpha, p, s, x, r)


def update_ps(beta, u, w, p, s) -> None:
    """``p = u + beta p; s = w + beta s`` in one pass."""
    _kernels()[1](beta, u, w, p, s)


def dots3(r, u, w, out) -> None:
    """``out[:3] = [(r, u), (w, u), (r, r)]`` reading each vector once (float64 only)."""
    cp = _backend.cupy()
    out[:3] = 0
    n = r.size
    if n == 0:
        return
    threads = 256
    # Enough blocks to fill a large GPU (about 1,000: a hundred-odd SMs, 8
    # blocks each) without a long tail of atomics.
    blocks = int(min(1024, (n + threads - 1) // threads))
    _kernels()[2]((blocks,), (threads,), (r, u, w, cp.int64(n), out))


def cg_scalars(sc, tot, tol2, hist, pos) -> None:
    """One thread updates CG's scalars from the reduced sums (float64 only).

    Replaces about twenty 1-element array operations (each a launch) per
    shard and iteration; ``hist[pos] = (r, r)`` when ``pos >= 0``.
    """
    cp = _backend.cupy()
    h = sc if hist is None else hist
    _kernels()[3]((1,), (1,), (sc, tot, cp.float64(tol2), h, cp.int64(pos)))
