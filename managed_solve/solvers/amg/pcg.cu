// CG preconditioned by the fused V-cycle: the loop's own kernels (loaded by
// managed_solve/solvers/amg/pcg.py after cycle.cu, whose row helpers they use).
//
// One iteration is a fixed sequence, captured with the V-cycle as one CUDA
// graph: every scalar stays on the device in s[] (doubles, whatever T), each
// reduction is a block sum and one atomic addition per block into s[], and
// the coefficients are read from s[] by the kernels that use them.
//
//   pcg_spmv_dot   q = A p,               s[PQ] += p.q
//   pcg_update     alpha = s[RZ] / s[PQ]; x += alpha p; r -= alpha q; rc = r;
//                  s[RR] += r.r
//   (V-cycle)      z = M rc
//   pcg_dot        s[RZN] += r.z
//   pcg_scalars    breakdown flag, beta, rz, ||r||; the sums zeroed (one thread)
//   pcg_pupdate    p = z + beta p
//
// T: the loop's value type; C: the cycle's (rc and z; rc is r itself when
// C == T). NumPy twins of the same math: managed_solve/solvers/amg/twins.py.

#define PCG_RZ 0
#define PCG_PQ 1
#define PCG_RR 2
#define PCG_RZN 3
#define PCG_BETA 4
#define PCG_RNORM 5
#define PCG_BAD 6
#define PCG_TOL 7

// Adds v of every thread of the block to *acc: a warp sum, the warps' sums
// in shared memory, one atomic addition. Every thread of the block calls it.
__device__ __forceinline__ void pcg_block_add(double v, double* acc) {
    __shared__ double part[32];
    v = amg_group_sum<32>(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
        v = amg_group_sum<32>(v);
        if (lane == 0) atomicAdd(acc, v);
    }
}

// q = A p and s[PQ] += p.q.
template <typename T, int G>
__global__ void pcg_spmv_dot(amg_ll n, const int* __restrict__ indptr,
                             const int* __restrict__ indices, const T* __restrict__ data,
                             const T* __restrict__ p, T* __restrict__ q, double* s) {
    double part = 0.0;
    AMG_ROWS(n)
        const T ax = amg_row_dot<G, 4>(indptr, indices, data, p, row, active, lane);
        if (active && lane == 0) {
            q[row] = ax;
            part += (double)p[row] * (double)ax;
        }
    AMG_ROWS_END
    pcg_block_add(part, s + PCG_PQ);
}

// The initial residual: r = b - A x, rc = r, s[RR] += r.r.
template <typename T, typename C, int G>
__global__ void pcg_residual(amg_ll n, const int* __restrict__ indptr,
                             const int* __restrict__ indices, const T* __restrict__ data,
                             const T* __restrict__ b, const T* __restrict__ x, T* r, C* rc,
                             double* s) {
    double part = 0.0;
    AMG_ROWS(n)
        const T ax = amg_row_dot<G>(indptr, indices, data, x, row, active, lane);
        if (active && lane == 0) {
            const T v = b[row] - ax;
            r[row] = v;
            if ((void*)rc != (void*)r) rc[row] = (C)v;
            part += (double)v * (double)v;
        }
    AMG_ROWS_END
    pcg_block_add(part, s + PCG_RR);
}

// alpha = s[RZ] / s[PQ] (0 where s[PQ] == 0); x += alpha p; r -= alpha q; rc = r; s[RR] += r.r.
template <typename T, typename C>
__global__ void pcg_update(amg_ll n, T* __restrict__ x, const T* __restrict__ p, T* r, C* rc,
                           const T* __restrict__ q, double* s) {
    const double pq = s[PCG_PQ];
    const T alpha = (T)(pq != 0.0 ? s[PCG_RZ] / pq : 0.0);
    double part = 0.0;
    const amg_ll stride = (amg_ll)gridDim.x * blockDim.x;
    for (amg_ll i = (amg_ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] += alpha * p[i];
        const T v = r[i] - alpha * q[i];
        r[i] = v;
        if ((void*)rc != (void*)r) rc[i] = (C)v;
        part += (double)v * (double)v;
    }
    pcg_block_add(part, s + PCG_RR);
}

// s[RZN] += r.z.
template <typename T, typename C>
__global__ void pcg_dot(amg_ll n, const T* __restrict__ r, const C* __restrict__ z, double* s) {
    double part = 0.0;
    const amg_ll stride = (amg_ll)gridDim.x * blockDim.x;
    for (amg_ll i = (amg_ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        part += (double)r[i] * (double)(T)z[i];
    pcg_block_add(part, s + PCG_RZN);
}

// One thread, between the sums and their users: the breakdown flag
// (non-positive curvature while unconverged, judged on the previous ||r||),
// beta = rz_new / rz (0 where rz == 0), rz = rz_new, ||r||; the sums zeroed
// for the next iteration.
__global__ void pcg_scalars(double* s) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (s[PCG_PQ] <= 0.0 && s[PCG_RNORM] > s[PCG_TOL]) s[PCG_BAD] = 1.0;
    const double rz = s[PCG_RZ], rzn = s[PCG_RZN];
    s[PCG_BETA] = rz != 0.0 ? rzn / rz : 0.0;
    s[PCG_RZ] = rzn;
    s[PCG_RNORM] = sqrt(s[PCG_RR]);
    s[PCG_PQ] = 0.0;
    s[PCG_RR] = 0.0;
    s[PCG_RZN] = 0.0;
}

// p = z + beta p.
template <typename T, typename C>
__global__ void pcg_pupdate(amg_ll n, const C* __restrict__ z, T* __restrict__ p,
                            const double* s) {
    const T beta = (T)s[PCG_BETA];
    const amg_ll stride = (amg_ll)gridDim.x * blockDim.x;
    for (amg_ll i = (amg_ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        p[i] = (T)z[i] + beta * p[i];
}
