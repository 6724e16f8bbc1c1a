// Device helpers of the batched Krylov kernels: status codes, the accumulator
// layout, row loops (with compaction) and per-system segmented sums.
// Loaded by managed_solve/solvers/batched/cuda.py, before cg_bicgstab.cu and gmres.cu.

#define MS_RUNNING (-1)
#define MS_CONVERGED 0
#define MS_MAXITER 1
#define MS_BREAKDOWN 2

typedef long long ll;

// acc[a][slot][s], a = which dot product, s = system
#define ACC(a, sl) (acc + ((ll)(a) * nslot + (sl)) * nsys)

__device__ __forceinline__ double ms_warp_sum(double v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

template <typename T, typename I>
__device__ __forceinline__ double ms_row_dot(const I* __restrict__ indptr, const I* __restrict__ indices,
                                             const T* __restrict__ data, const T* v, ll i) {
    double sum = 0.0;
    const I end = indptr[i + 1];
    for (I j = indptr[i]; j < end; ++j) sum += (double)data[j] * (double)v[indices[j]];
    return sum;
}

// The same product with a warp per row (long rows): lanes stride over the row,
// a butterfly leaves the sum on every lane.
template <typename T, typename I>
__device__ __forceinline__ double ms_row_dot_warp(const I* __restrict__ indptr,
                                                  const I* __restrict__ indices,
                                                  const T* __restrict__ data, const T* v, ll i) {
    double sum = 0.0;
    const I end = indptr[i + 1];
    for (I j = indptr[i] + (I)(threadIdx.x & 31); j < end; j += 32)
        sum += (double)data[j] * (double)v[indices[j]];
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    return sum;
}

// Warp-per-row loop: warp w takes rows w, w + W, ... (every lane the same rows).
// Row of loop position t: after compaction (compact != 0) the list act of the
// rows of the systems still running, otherwise t itself.
#define MS_ROW(t) (compact ? (ll)act[t] : (ll)(t))
// Warp-per-row loop. Several systems (and MS_CONTIGUOUS): warp w takes a
// contiguous run of rows, so consecutive steps mostly stay in one system and
// SegSum flushes (atomics) about once per warp; one system: grid-stride.
#define MS_VEC_ROWS(i) \
    const bool vrun_ = MS_CONTIGUOUS && !SINGLE; \
    const ll vper_ = vrun_ ? (n + (G >> 5) - 1) / (G >> 5) : 0; \
    const ll vlo_ = vrun_ ? (tid >> 5) * vper_ : (tid >> 5); \
    const ll vhi_ = vrun_ ? min(n, vlo_ + vper_) : n; \
    const ll vstep_ = vrun_ ? 1 : (G >> 5); \
    for (ll w_ = vlo_; w_ < vhi_; w_ += vstep_) { const ll i = MS_ROW(w_);

// One block's view of system 0's status (SINGLE): read once, so that every
// thread of the block takes the same branch before the block reduction.
template <bool SINGLE>
__device__ __forceinline__ bool ms_block_running(const int* status) {
    if (!SINGLE) return true;
    __shared__ int st;
    if (threadIdx.x == 0) st = status[0];
    __syncthreads();
    return st == MS_RUNNING;
}

// Per-system sums of K values over rows sorted by system.
template <int K, bool SINGLE>
struct SegSum {
    double part[K];
    int cur;
    __device__ __forceinline__ SegSum() : cur(-1) {
        #pragma unroll
        for (int k = 0; k < K; ++k) part[k] = 0.0;
    }
    __device__ __forceinline__ void flush_lane(double* const (&out)[K]) {
        if (cur >= 0) {
            #pragma unroll
            for (int k = 0; k < K; ++k) { atomicAdd(out[k] + cur, part[k]); part[k] = 0.0; }
        }
    }
    // Called by all 32 lanes of a warp together, once per step; s < 0: no contribution.
    __device__ __forceinline__ void add(int s, const double (&c)[K], double* const (&out)[K]) {
        if (SINGLE) {
            if (s >= 0) {
                #pragma unroll
                for (int k = 0; k < K; ++k) part[k] += c[k];
            }
            return;
        }
        const unsigned full = 0xffffffffu;
        const int s0 = __shfl_sync(full, s, 0);
        if (__all_sync(full, s == s0)) {
            if (s0 < 0) return;
            double w[K];
            #pragma unroll
            for (int k = 0; k < K; ++k) w[k] = ms_warp_sum(c[k]);
            if ((threadIdx.x & 31) == 0) {
                if (s0 != cur) { flush_lane(out); cur = s0; }
                #pragma unroll
                for (int k = 0; k < K; ++k) part[k] += w[k];
            }
        } else if (s >= 0) {
            #pragma unroll
            for (int k = 0; k < K; ++k) atomicAdd(out[k] + s, c[k]);
        }
    }
    // Called once by every thread of the block, at the end.
    __device__ __forceinline__ void finish(double* const (&out)[K]) {
        if (!SINGLE) {
            if ((threadIdx.x & 31) == 0) flush_lane(out);
            return;
        }
        __shared__ double sh[K][32];
        const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
        #pragma unroll
        for (int k = 0; k < K; ++k) {
            const double w = ms_warp_sum(part[k]);
            if (lane == 0) sh[k][wid] = w;
        }
        __syncthreads();
        if (wid == 0) {
            const int nw = blockDim.x >> 5;
            #pragma unroll
            for (int k = 0; k < K; ++k) {
                double w = lane < nw ? sh[k][lane] : 0.0;
                w = ms_warp_sum(w);
                if (lane == 0) atomicAdd(out[k], w);
            }
        }
    }
};

#define MS_GRID_STRIDE const ll G = (ll)gridDim.x * blockDim.x; \
    const ll tid = (ll)blockIdx.x * blockDim.x + threadIdx.x;
// Warp-uniform row loop: every lane runs the same number of steps (for
// SegSum), 32 consecutive rows a step. Several systems (and MS_CONTIGUOUS):
// warp w takes rows [w * per, (w + 1) * per) (per a multiple of 32), so SegSum
// flushes about once per warp instead of once per step (grid-stride steps
// land in a different system each time). One system: grid-stride.
#define MS_WARP_ROWS(i) \
    const bool run_ = MS_CONTIGUOUS && !SINGLE; \
    const ll per_ = run_ ? ((((n + (G >> 5) - 1) / (G >> 5)) + 31) & ~31LL) : 0; \
    const ll lo_ = run_ ? (tid >> 5) * per_ : tid - (threadIdx.x & 31); \
    const ll hi_ = run_ ? min(n, lo_ + per_) : n; \
    const ll step_ = run_ ? 32 : G; \
    for (ll base_ = lo_; base_ < hi_; base_ += step_) { \
    const ll t_ = base_ + (threadIdx.x & 31); \
    const bool in_ = t_ < n; \
    const ll i = in_ ? MS_ROW(t_) : t_;

