// Fused kernels of the AMG V-cycle on a GPU (loaded by managed_solve/solvers/amg/kernels.py).
//
// Every kernel does one pass over its rows: a sparse row product and the
// vector updates that use it, so a smoothing step streams the matrix and each
// vector once. NumPy twins of the same math: managed_solve/solvers/amg/twins.py.
//
// Row kernels give each row a group of G lanes (G a power of two <= 32,
// chosen from the mean row length): the group's lanes stride over the row,
// a butterfly inside the group leaves the sum on all of them. The loop over
// rows is warp-uniform (the condition depends on the warp alone), so the
// shuffles always run with every lane of the warp; lanes past the last row
// compute nothing and write nothing.
//
// T: float or double. Indices: int (cuSPARSE's CSR index type); row numbers
// and thread numbers are 64-bit.

typedef long long amg_ll;

template <int G, typename T>
__device__ __forceinline__ T amg_group_sum(T v) {
    #pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// (A v)_row from the lanes of one group (lane = this thread's rank in the group).
// U > 1: a lane takes its entries U at a time, the indices and values of a
// round loaded before the first gather and the gathers before the first
// product, so a lane keeps several loads in flight. That pays in a kernel
// with little else to load (the CG loop's product, U = 4); in the smoothing
// steps, which also read four vectors a row, the extra registers cost more
// than the overlap gains (U = 1).
template <int G, int U = 1, typename T>
__device__ __forceinline__ T amg_row_dot(const int* __restrict__ indptr,
                                         const int* __restrict__ indices,
                                         const T* __restrict__ data, const T* __restrict__ v,
                                         amg_ll row, bool active, int lane) {
    T sum = (T)0;
    if (active) {
        const int end = indptr[row + 1];
        if constexpr (U == 1) {
            for (int j = indptr[row] + lane; j < end; j += G) sum += data[j] * v[indices[j]];
        } else {
            for (int j = indptr[row] + lane; j < end; j += U * G) {
                int k[U];
                T a[U], w[U];
                #pragma unroll
                for (int u = 0; u < U; ++u) {
                    const bool in = j + u * G < end;
                    k[u] = in ? indices[j + u * G] : 0;
                    a[u] = in ? data[j + u * G] : (T)0;
                }
                #pragma unroll
                for (int u = 0; u < U; ++u) w[u] = j + u * G < end ? v[k[u]] : (T)0;
                #pragma unroll
                for (int u = 0; u < U; ++u) sum += a[u] * w[u];
            }
        }
    }
    return amg_group_sum<G>(sum);
}

// (A (s dinv b))_row: the product with the first smoothing's iterate from a
// zero guess, x = s dinv b, formed as it is read rather than stored.
template <int G, typename T>
__device__ __forceinline__ T amg_row_dot_scaled(const int* __restrict__ indptr,
                                                const int* __restrict__ indices,
                                                const T* __restrict__ data,
                                                const T* __restrict__ dinv, const T* __restrict__ b,
                                                T s, amg_ll row, bool active, int lane) {
    T sum = (T)0;
    if (active) {
        const int end = indptr[row + 1];
        for (int j = indptr[row] + lane; j < end; j += G) {
            const int k = indices[j];
            sum += data[j] * (s * dinv[k] * b[k]);
        }
    }
    return amg_group_sum<G>(sum);
}

// Warp-uniform loop over rows, G lanes a row: defines row, active, lane.
#define AMG_ROWS(n)                                                                      \
    const amg_ll tid_ = (amg_ll)blockIdx.x * blockDim.x + threadIdx.x;                  \
    const amg_ll nthreads_ = (amg_ll)gridDim.x * blockDim.x;                            \
    const int lane = (int)(threadIdx.x & (G - 1));                                       \
    for (amg_ll base_ = (tid_ >> 5) * (32 / G), step_ = (nthreads_ >> 5) * (32 / G);     \
         base_ < (n); base_ += step_) {                                                  \
        const amg_ll row = base_ + ((threadIdx.x & 31) / G);                             \
        const bool active = row < (n);

#define AMG_ROWS_END }

// Smoothing from a zero guess, first step: x = d = s * dinv * b (elementwise).
// write_d == 0: d is not written (Jacobi).
template <typename T>
__global__ void amg_scale(amg_ll n, const T* __restrict__ b, const T* __restrict__ dinv, T s,
                          T* __restrict__ x, T* __restrict__ d, int write_d) {
    const amg_ll stride = (amg_ll)gridDim.x * blockDim.x;
    for (amg_ll i = (amg_ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T v = s * dinv[i] * b[i];
        x[i] = v;
        if (write_d) d[i] = v;
    }
}

// One smoothing step from x_old (read by every row's neighbours, so written
// to x_new, never in place):
//   r = dinv_i (b_i - (A x_old)_i);  dn = a p_i + c r;  x_new_i = x_old_i + dn;
//   d_i = dn (write_d).
// p_i, the previous step's update, by ``prev``: 0 none (a == 0: the first
// step after a correction, Jacobi); 1 d_i (stored by the step before);
// 2 x_old_i - x_new_i, read before x_new_i is written: the two buffers
// alternate, so x_new's still holds the iterate before x_old. Mode 2 stores
// no d, and a degree-1 Chebyshev smoothing needs no d vector at all.
// Chebyshev: (a, c) of the recurrence; its first step after a correction
// a = 0, c = 1 / theta. Jacobi: a = 0, c = 1.
template <typename T, int G>
__global__ void amg_step(amg_ll n, const int* __restrict__ indptr, const int* __restrict__ indices,
                         const T* __restrict__ data, const T* __restrict__ dinv,
                         const T* __restrict__ b, const T* __restrict__ x_old,
                         T* __restrict__ x_new, T* __restrict__ d, T a, T c, int write_d,
                         int prev) {
    AMG_ROWS(n)
        const T ax = amg_row_dot<G>(indptr, indices, data, x_old, row, active, lane);
        if (active && lane == 0) {
            const T r = dinv[row] * (b[row] - ax);
            const T xo = x_old[row];
            const T p = prev == 1 ? d[row] : (prev == 2 ? xo - x_new[row] : (T)0);
            const T dn = a * p + c * r;
            if (write_d) d[row] = dn;
            x_new[row] = xo + dn;
        }
    AMG_ROWS_END
}

// The first two steps of a smoothing from a zero guess in one pass: the
// scaling x0 = d0 = s dinv b (never stored) and one step from it,
//   r = dinv_i (b_i - (A x0)_i);  dn = a d0_i + c r;  d_i = dn (write_d);
//   x_new_i = x0_i + dn.
// The scaling's pass (b and dinv read, x and d written) is saved; the
// neighbours' b and dinv are read instead of their x.
template <typename T, int G>
__global__ void amg_first(amg_ll n, const int* __restrict__ indptr, const int* __restrict__ indices,
                          const T* __restrict__ data, const T* __restrict__ dinv,
                          const T* __restrict__ b, T s, T* __restrict__ x_new, T* __restrict__ d,
                          T a, T c, int write_d) {
    AMG_ROWS(n)
        const T ax = amg_row_dot_scaled<G>(indptr, indices, data, dinv, b, s, row, active, lane);
        if (active && lane == 0) {
            const T x0 = s * dinv[row] * b[row];
            const T r = dinv[row] * (b[row] - ax);
            const T dn = (a == (T)0 ? (T)0 : a * x0) + c * r;
            if (write_d) d[row] = dn;
            x_new[row] = x0 + dn;
        }
    AMG_ROWS_END
}

// Residual and restriction in one pass: r_i = b_i - (A x)_i, then
// bc[J] += P_iJ r_i for the entries of P's row i (atomics; bc zeroed before).
// R = P^T is never stored: P's rows are read here and by the prolongation.
template <typename T, int G>
__global__ void amg_restrict(amg_ll n, const int* __restrict__ indptr,
                             const int* __restrict__ indices, const T* __restrict__ data,
                             const T* __restrict__ b, const T* __restrict__ x,
                             const int* __restrict__ p_indptr, const int* __restrict__ p_indices,
                             const T* __restrict__ p_data, T* __restrict__ bc) {
    AMG_ROWS(n)
        const T ax = amg_row_dot<G>(indptr, indices, data, x, row, active, lane);
        if (active) {
            const T r = b[row] - ax;
            const int end = p_indptr[row + 1];
            for (int j = p_indptr[row] + lane; j < end; j += G) atomicAdd(bc + p_indices[j], p_data[j] * r);
        }
    AMG_ROWS_END
}

// Prolongation with the correction: x_i += (P xc)_i.
template <typename T, int G>
__global__ void amg_prolong(amg_ll n, const int* __restrict__ p_indptr,
                            const int* __restrict__ p_indices, const T* __restrict__ p_data,
                            const T* __restrict__ xc, T* __restrict__ x) {
    AMG_ROWS(n)
        const T px = amg_row_dot<G>(p_indptr, p_indices, p_data, xc, row, active, lane);
        if (active && lane == 0) x[row] += px;
    AMG_ROWS_END
}

// The coarsest solve: x = inv b, inv dense m x m row-major; a warp a row.
template <typename T>
__global__ void amg_dense(amg_ll m, const T* __restrict__ inv, const T* __restrict__ b,
                          T* __restrict__ x) {
    constexpr int G = 32;
    AMG_ROWS(m)
        T sum = (T)0;
        if (active) {
            const T* rowp = inv + row * m;
            for (amg_ll j = lane; j < m; j += 32) sum += rowp[j] * b[j];
        }
        sum = amg_group_sum<32>(sum);
        if (active && lane == 0) x[row] = sum;
    AMG_ROWS_END
}

// bc = 0 before the restriction's atomics.
template <typename T>
__global__ void amg_zero(amg_ll n, T* __restrict__ v) {
    const amg_ll stride = (amg_ll)gridDim.x * blockDim.x;
    for (amg_ll i = (amg_ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) v[i] = (T)0;
}
