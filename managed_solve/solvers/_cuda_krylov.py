"""Fused CUDA kernels of the batched Krylov core (CuPy ``RawModule``) and their launcher.

Design (the GPU half of :mod:`managed_solve.solvers.batched`):

- Per-system scalars never leave the device. Dot products accumulate into
  ``acc[a, slot, s]`` (float64, whatever the vector dtype) and every thread
  computes alpha, beta, omega for its row's system from them. Slots rotate
  with the iteration (3 for CG, 4 for BiCGStab): the slot the next iteration
  accumulates into is zeroed during the current one, when nobody reads it.
- Sums over rows: one system (``SINGLE``) sums in registers, then a block
  reduction and one atomic per block. Many systems: rows are sorted by
  system, so a warp whose 32 rows share a system reduces with shuffles and
  lane 0 keeps a running partial (one atomic per system change); a warp
  straddling a boundary falls back to per-lane atomics.
- Status per system lives on the device (-1 running, 0 converged, 1 maxiter,
  2 breakdown). Threads of finished systems skip their rows; the thread of a
  system's first row writes its status, iteration count and final residual.
  Every thread derives the same decision from the same complete scalars, so
  a thread that sees the new status early only skips work that no longer
  matters.
- Statuses go to the host by asynchronous copies into page-locked buffers
  at checkpoints (every 24-iteration graph chunk, or every 8 iterations for
  large systems). The host keeps two checkpoints' worth of iterations queued
  beyond the last one it read, so its reads never leave the GPU idle; the
  only wait with nothing queued behind it comes when ``maxiter`` is reached
  (``host_syncs`` counts those: 0 or 1 a solve). Small systems replay a CUDA
  graph of 24 iterations, so launch overhead is paid once per chunk.
- Compaction: once the running systems hold at most half the rows the
  kernels walk, the kernels walk a list of those rows only (same iterates;
  finished systems stop costing even the masked pass).
- All workspace is allocated before the loop; nothing is allocated inside it.

The kernels compute the same iterates as the Numba twins in
``managed_solve.kernels.krylov`` (tests compare them).
"""

from __future__ import annotations

import functools
import math
import threading
from collections import deque
from typing import Any

import numpy as np

from .. import _backend

RUNNING = -1
THREADS = 256
# Iterations per captured CUDA graph: a multiple of the CG (3) and BiCGStab
# (4) slot counts, so every replay starts at slot 0.
GRAPH_CHUNK = 24
# Above this many rows one iteration's kernels run long enough (about 10 us
# per kernel at 1M rows on an H100) that launch latency is hidden; graphs
# only pay off below it for a single system.
GRAPH_MAX_ROWS = 1 << 20
# Batches of several systems use graphs at every size (GRAPH_BATCHES): then
# the host needs the GIL once per GRAPH_CHUNK iterations instead of three
# launches per iteration. With one worker thread per GPU plus stagers in one
# process, a launch loop that waits for the GIL (up to the 5 ms switch
# interval behind a busy thread) lets a GPU run dry.
GRAPH_BATCHES = True
# prepare() captures a batch's first graph beside the previous batch's compute.
PREPARE_GRAPH = True
# Row loops of the kernels with sums: a contiguous run of rows per warp (True)
# or grid-stride steps (False); see MS_WARP_ROWS.
CONTIGUOUS_ROWS = True
# Checkpoint spacing without graphs (large systems: one iteration is long).
CHECK_EVERY = 8
# Checkpoints' worth of iterations the host keeps queued beyond the last it read.
AHEAD = 2
# Once the host is seen running behind (a checkpoint the GPU passed before the
# host came to read it), at least this much GPU time, from the measured time
# of an iteration, but at most AHEAD_FRACTION of the GPU time the solve has
# taken so far: a worker thread may wait for the GIL up to the interpreter's
# switch interval behind another thread, and a queue of 48 iterations of 56 us
# (one 1M-row system on an H200) ran dry while two GPUs' stagers packed beside
# it (120 instead of 107 ms). Iterations queued past convergence run masked
# (a few microseconds each), and later work on the caller's stream waits for
# them, hence the fraction: a short solve is not lengthened by a long tail.
AHEAD_SECONDS = 0.012
AHEAD_FRACTION = 0.2
# Compaction: once the running systems hold at most this fraction of the rows
# the kernels walk, and those are at least COMPACT_MIN_ROWS, the kernels walk
# only the running systems' rows.
COMPACT_FRACTION = 0.5
COMPACT_MIN_ROWS = 1 << 15
# Mean stored entries per row from which the products use a warp per row
# instead of a thread per row (PDE stencils, 5-27 per row, stay on threads).
VECTOR_MIN_NNZ_PER_ROW = 32
CG_SLOTS, BICG_SLOTS = 3, 4
CG_ACCS, BICG_ACCS = 3, 6  # CG: pq, rz, rr.  BiCGStab: rho, rr, rv, ss, tt, ts.

SOURCE = r"""
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
// Warp-uniform row loop: every lane runs the same number of steps (for SegSum).
// Warp-uniform row loop: every lane runs the same number of steps (for
// SegSum), 32 consecutive rows a step. Several systems (and MS_CONTIGUOUS):
// warp w takes rows [w * per, (w + 1) * per) (per a multiple of 32), so SegSum
// flushes about once per warp instead of once per step (grid-stride steps
// land in a different system each time; 73 vs 82 us an iteration for W2's
// largest 120 systems on an H200). One system: grid-stride (slightly faster).
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

// ---------------------------------------------------------------- set-up

// r = b - A x0 (or b), z = dinv r, copy = z (CG: p; BiCGStab: r~); sums b.b, r.r, r.z.
template <typename T, typename I, bool SINGLE, bool JAC, bool HASX0>
__global__ void ms_init(const I* __restrict__ indptr, const I* __restrict__ indices,
                        const T* __restrict__ data, const T* __restrict__ b, const T* x,
                        const T* __restrict__ dinv, T* r, T* z, T* copy,
                        const int* __restrict__ row_sys, double* bb, double* acc,
                        int nsys, int slot, int nslot, int rr_id, int rz_id, ll n) {
    const int compact = 0;  // set-up covers every row
    const I* act = nullptr;
    MS_GRID_STRIDE
    SegSum<3, SINGLE> sum;
    double* const out[3] = {bb, ACC(rr_id, slot), ACC(rz_id, slot)};
    MS_WARP_ROWS(i)
        int s = -1;
        double c[3] = {0.0, 0.0, 0.0};
        if (in_) {
            s = SINGLE ? 0 : row_sys[i];
            const double bi = (double)b[i];
            const T ri = (T)(HASX0 ? bi - ms_row_dot(indptr, indices, data, x, i) : bi);
            const T zi = JAC ? (T)((double)dinv[i] * (double)ri) : ri;
            r[i] = ri;
            if (JAC) z[i] = zi;
            copy[i] = zi;
            c[0] = bi * bi; c[1] = (double)ri * (double)ri; c[2] = (double)ri * (double)zi;
        }
        sum.add(s, c, out);
    }
    sum.finish(out);
}

// Per-system squared norms of b - A x and of b, in float64 (the true-residual
// check after a batched solve): one pass over the rows, no temporaries.
template <typename T, typename I, bool SINGLE>
__global__ void ms_residual(const I* __restrict__ indptr, const I* __restrict__ indices,
                            const T* __restrict__ data, const T* __restrict__ b,
                            const T* __restrict__ x, const int* __restrict__ row_sys, double* rr,
                            double* bb, ll n) {
    const int compact = 0;  // every row
    const I* act = nullptr;
    MS_GRID_STRIDE
    SegSum<2, SINGLE> sum;
    double* const out[2] = {rr, bb};
    MS_WARP_ROWS(i)
        int s = -1;
        double c[2] = {0.0, 0.0};
        if (in_) {
            s = SINGLE ? 0 : row_sys[i];
            const double bi = (double)b[i];
            const double ri = bi - ms_row_dot(indptr, indices, data, x, i);
            c[0] = ri * ri; c[1] = bi * bi;
        }
        sum.add(s, c, out);
    }
    sum.finish(out);
}

// b_s = 0: x_s = 0 whatever x0 (SciPy returns b).
template <typename T>
__global__ void ms_zero_x(T* x, const int* __restrict__ row_sys, const double* bb, ll n) {
    MS_GRID_STRIDE
    for (ll i = tid; i < n; i += G) if (bb[row_sys[i]] == 0.0) x[i] = (T)0;
}

extern "C" __global__ void ms_init_status(const double* acc, int nsys, int slot, int nslot,
                                          int rr_id, int rz_id, const double* bb,
                                          const double* rtol, const double* atol,
                                          const ll* maxiter, double* tol2, int* status,
                                          ll* iters, double* res2) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nsys) return;
    const double tol = fmax(rtol[s] * sqrt(bb[s]), atol[s]);
    const double t2 = tol * tol;
    const double rr = ACC(rr_id, slot)[s], rz = ACC(rz_id, slot)[s];
    int st = MS_RUNNING;
    double res = rr;
    if (bb[s] == 0.0) { st = MS_CONVERGED; res = 0.0; }
    else if (rr <= t2) st = MS_CONVERGED;
    else if (maxiter[s] <= 0) st = MS_MAXITER;
    else if (rz == 0.0 || !isfinite(rz)) st = MS_BREAKDOWN;
    tol2[s] = t2; iters[s] = 0; status[s] = st; res2[s] = res;
}

// ---------------------------------------------------------------- CG (acc: 0 pq, 1 rz, 2 rr)

// q = A p and p.q; zeroes the next slot.
template <typename T, typename I, bool SINGLE, bool VEC>
__global__ void ms_cg_spmv(const I* __restrict__ indptr, const I* __restrict__ indices,
                           const T* __restrict__ data, const T* __restrict__ p, T* __restrict__ q,
                           const int* __restrict__ row_sys, const int* status, double* acc,
                           int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 3, next = (slot + 1) % 3;
    MS_GRID_STRIDE
    for (ll s = tid; s < nsys; s += G) {
        ACC(0, next)[s] = 0.0; ACC(1, next)[s] = 0.0; ACC(2, next)[s] = 0.0;
    }
    if (!ms_block_running<SINGLE>(status)) return;
    SegSum<1, SINGLE> sum;
    double* const out[1] = {ACC(0, slot)};
    if (VEC) {
        MS_VEC_ROWS(i)
            int s = -1;
            double c[1] = {0.0};
            const int si = SINGLE ? 0 : row_sys[i];
            if (SINGLE || status[si] == MS_RUNNING) {
                const double qi = ms_row_dot_warp(indptr, indices, data, p, i);
                if ((threadIdx.x & 31) == 0) { q[i] = (T)qi; c[0] = (double)p[i] * qi; }
                s = si;
            }
            sum.add(s, c, out);
        }
    } else {
        MS_WARP_ROWS(i)
            int s = -1;
            double c[1] = {0.0};
            if (in_) {
                const int si = SINGLE ? 0 : row_sys[i];
                if (SINGLE || status[si] == MS_RUNNING) {
                    const double qi = ms_row_dot(indptr, indices, data, p, i);
                    q[i] = (T)qi;
                    c[0] = (double)p[i] * qi;
                    s = si;
                }
            }
            sum.add(s, c, out);
        }
    }
    sum.finish(out);
}

// alpha = rz / pq; x += alpha p; r -= alpha q; z = dinv r; sums r.z and r.r.
template <typename T, typename I, bool SINGLE, bool JAC>
__global__ void ms_cg_update(T* x, T* r, T* z, const T* p, const T* q, const T* __restrict__ dinv,
                             const int* __restrict__ row_sys, int* status, const ll* offs,
                             double* res2, double* acc, int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 3, prev = (slot + 2) % 3;
    MS_GRID_STRIDE
    if (!ms_block_running<SINGLE>(status)) return;
    SegSum<2, SINGLE> sum;
    double* const out[2] = {ACC(1, slot), ACC(2, slot)};
    MS_WARP_ROWS(i)
        int s = -1;
        double c[2] = {0.0, 0.0};
        if (in_) {
            const int si = SINGLE ? 0 : row_sys[i];
            if (SINGLE || status[si] == MS_RUNNING) {
                const double pq = ACC(0, slot)[si];
                if (!(pq > 0.0)) {  // not positive definite (or NaN): CG breaks down
                    if (i == offs[si]) { status[si] = MS_BREAKDOWN; res2[si] = ACC(2, prev)[si]; }
                } else {
                    const double alpha = ACC(1, prev)[si] / pq;
                    x[i] = (T)((double)x[i] + alpha * (double)p[i]);
                    const T ri = (T)((double)r[i] - alpha * (double)q[i]);
                    r[i] = ri;
                    const T zi = JAC ? (T)((double)dinv[i] * (double)ri) : ri;
                    if (JAC) z[i] = zi;
                    c[0] = (double)ri * (double)zi; c[1] = (double)ri * (double)ri;
                    s = si;
                }
            }
        }
        sum.add(s, c, out);
    }
    sum.finish(out);
}

// Status of each system after its update; p = z + beta p for those still running.
template <typename T, typename I, bool SINGLE>
__global__ void ms_cg_direction(T* p, const T* z, const int* __restrict__ row_sys, int* status,
                                ll* iters, const ll* maxiter, const double* tol2, const ll* offs,
                                double* res2, const double* acc, int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 3, prev = (slot + 2) % 3;
    MS_GRID_STRIDE
    if (!ms_block_running<SINGLE>(status)) return;
    for (ll t_ = tid; t_ < n; t_ += G) {
        const ll i = MS_ROW(t_);
        const int si = SINGLE ? 0 : row_sys[i];
        if (!SINGLE && status[si] != MS_RUNNING) continue;
        const double rr = ACC(2, slot)[si], rz = ACC(1, slot)[si];
        const bool done = rr <= tol2[si];
        if (i == offs[si]) {
            const ll it = iters[si] + 1;
            iters[si] = it;
            int st = MS_RUNNING;
            if (done) st = MS_CONVERGED;
            else if (it >= maxiter[si]) st = MS_MAXITER;
            else if (rz == 0.0 || !isfinite(rz)) st = MS_BREAKDOWN;
            if (st != MS_RUNNING) { status[si] = st; res2[si] = rr; }
        }
        if (done) continue;
        const double beta = rz / ACC(1, prev)[si];
        p[i] = (T)((double)z[i] + beta * (double)p[i]);
    }
}

// ------------------------------------------- BiCGStab (acc: 0 rho, 1 rr, 2 rv, 3 ss, 4 tt, 5 ts)

// Stopping tests at the start of an iteration (SciPy's order); -1 means go on.
__device__ __forceinline__ int ms_bicg_state(const double* acc, int nsys, int slot, int s,
                                             ll it, ll maxit, double t2) {
    const int nslot = 4, prev = (slot + 3) % 4;
    const double rr = ACC(1, prev)[s], rho = ACC(0, prev)[s];
    if (rr <= t2) return MS_CONVERGED;
    if (it >= maxit) return MS_MAXITER;
    if (rho == 0.0 || !isfinite(rho)) return MS_BREAKDOWN;
    if (it > 0) {
        const double omega = ACC(5, prev)[s] / ACC(4, prev)[s];
        if (omega == 0.0) return MS_BREAKDOWN;
    }
    return -1;
}

// The same tests, one thread per system, run by the host before it reads statuses.
extern "C" __global__ void ms_bicg_check(const double* acc, int nsys, int slot, int* status,
                                         const ll* iters, const ll* maxiter, const double* tol2,
                                         double* res2) {
    const int nslot = 4, prev = (slot + 3) % 4;
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= nsys || status[s] != MS_RUNNING) return;
    const int st = ms_bicg_state(acc, nsys, slot, s, iters[s], maxiter[s], tol2[s]);
    if (st >= 0) { status[s] = st; res2[s] = ACC(1, prev)[s]; }
}

// p = r + beta (p - omega v); z = dinv p; zeroes the next slot.
template <typename T, typename I, bool SINGLE, bool JAC>
__global__ void ms_bicg_direction(T* p, T* z, const T* r, const T* v, const T* __restrict__ dinv,
                                  const int* __restrict__ row_sys, int* status, const ll* iters,
                                  const ll* maxiter, const double* tol2, const ll* offs,
                                  double* res2, double* acc, int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 4, next = (slot + 1) % 4, prev = (slot + 3) % 4, prev2 = (slot + 2) % 4;
    MS_GRID_STRIDE
    for (ll s = tid; s < nsys; s += G) {
        #pragma unroll
        for (int a = 0; a < 6; ++a) ACC(a, next)[s] = 0.0;
    }
    if (!ms_block_running<SINGLE>(status)) return;
    for (ll t_ = tid; t_ < n; t_ += G) {
        const ll i = MS_ROW(t_);
        const int si = SINGLE ? 0 : row_sys[i];
        if (!SINGLE && status[si] != MS_RUNNING) continue;
        const ll it = iters[si];
        const int st = ms_bicg_state(acc, nsys, slot, si, it, maxiter[si], tol2[si]);
        if (st >= 0) {
            if (i == offs[si]) { status[si] = st; res2[si] = ACC(1, prev)[si]; }
            continue;
        }
        double pi;
        if (it > 0) {
            const double rho = ACC(0, prev)[si], rho_prev = ACC(0, prev2)[si];
            const double alpha = rho_prev / ACC(2, prev)[si];
            const double omega = ACC(5, prev)[si] / ACC(4, prev)[si];
            const double beta = (rho / rho_prev) * (alpha / omega);
            pi = (double)r[i] + beta * ((double)p[i] - omega * (double)v[i]);
        } else {
            pi = (double)r[i];
        }
        const T pt = (T)pi;
        p[i] = pt;
        if (JAC) z[i] = (T)((double)dinv[i] * (double)pt);
    }
}

// v = A p-hat and r~.v
template <typename T, typename I, bool SINGLE, bool VEC>
__global__ void ms_bicg_spmv_v(const I* __restrict__ indptr, const I* __restrict__ indices,
                               const T* __restrict__ data, const T* __restrict__ ph,
                               T* __restrict__ v, const T* __restrict__ rt,
                               const int* __restrict__ row_sys, const int* status, double* acc,
                               int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 4;
    MS_GRID_STRIDE
    if (!ms_block_running<SINGLE>(status)) return;
    SegSum<1, SINGLE> sum;
    double* const out[1] = {ACC(2, slot)};
    if (VEC) {
        MS_VEC_ROWS(i)
            int s = -1;
            double c[1] = {0.0};
            const int si = SINGLE ? 0 : row_sys[i];
            if (SINGLE || status[si] == MS_RUNNING) {
                const double vi = ms_row_dot_warp(indptr, indices, data, ph, i);
                if ((threadIdx.x & 31) == 0) { v[i] = (T)vi; c[0] = (double)rt[i] * vi; }
                s = si;
            }
            sum.add(s, c, out);
        }
    } else {
        MS_WARP_ROWS(i)
            int s = -1;
            double c[1] = {0.0};
            if (in_) {
                const int si = SINGLE ? 0 : row_sys[i];
                if (SINGLE || status[si] == MS_RUNNING) {
                    const double vi = ms_row_dot(indptr, indices, data, ph, i);
                    v[i] = (T)vi;
                    c[0] = (double)rt[i] * vi;
                    s = si;
                }
            }
            sum.add(s, c, out);
        }
    }
    sum.finish(out);
}

// alpha = rho / r~.v; x += alpha p-hat; s = r - alpha v (in r); z = dinv s; sums s.s.
template <typename T, typename I, bool SINGLE, bool JAC>
__global__ void ms_bicg_update_s(T* x, T* r, T* z, const T* p, const T* v, const T* __restrict__ dinv,
                                 const int* __restrict__ row_sys, int* status, const ll* offs,
                                 double* res2, double* acc, int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 4, prev = (slot + 3) % 4;
    MS_GRID_STRIDE
    if (!ms_block_running<SINGLE>(status)) return;
    SegSum<1, SINGLE> sum;
    double* const out[1] = {ACC(3, slot)};
    MS_WARP_ROWS(i)
        int s = -1;
        double c[1] = {0.0};
        if (in_) {
            const int si = SINGLE ? 0 : row_sys[i];
            if (SINGLE || status[si] == MS_RUNNING) {
                const double rv = ACC(2, slot)[si];
                if (rv == 0.0 || !isfinite(rv)) {
                    if (i == offs[si]) { status[si] = MS_BREAKDOWN; res2[si] = ACC(1, prev)[si]; }
                } else {
                    const double alpha = ACC(0, prev)[si] / rv;
                    const double phi = JAC ? (double)z[i] : (double)p[i];
                    x[i] = (T)((double)x[i] + alpha * phi);
                    const T si_ = (T)((double)r[i] - alpha * (double)v[i]);
                    r[i] = si_;
                    if (JAC) z[i] = (T)((double)dinv[i] * (double)si_);
                    c[0] = (double)si_ * (double)si_;
                    s = si;
                }
            }
        }
        sum.add(s, c, out);
    }
    sum.finish(out);
}

// Half-step convergence test; t = A s-hat, sums t.t and t.s.
template <typename T, typename I, bool SINGLE, bool VEC>
__global__ void ms_bicg_spmv_t(const I* __restrict__ indptr, const I* __restrict__ indices,
                               const T* __restrict__ data, const T* __restrict__ sh,
                               const T* __restrict__ sv, T* __restrict__ t,
                               const int* __restrict__ row_sys, int* status, ll* iters,
                               const double* tol2, const ll* offs, double* res2, double* acc,
                               int nsys, int slot, ll n,
    const I* __restrict__ act, int compact) {
    const int nslot = 4;
    MS_GRID_STRIDE
    if (!ms_block_running<SINGLE>(status)) return;
    SegSum<2, SINGLE> sum;
    double* const out[2] = {ACC(4, slot), ACC(5, slot)};
    if (VEC) {
        const bool lead = (threadIdx.x & 31) == 0;
        MS_VEC_ROWS(i)
            int s = -1;
            double c[2] = {0.0, 0.0};
            const int si = SINGLE ? 0 : row_sys[i];
            if (SINGLE || status[si] == MS_RUNNING) {
                const double ss = ACC(3, slot)[si];
                if (ss <= tol2[si]) {  // converged at the half step (x already has alpha p-hat)
                    if (lead && i == offs[si]) {
                        status[si] = MS_CONVERGED; iters[si] += 1; res2[si] = ss;
                    }
                } else {
                    const double ti = ms_row_dot_warp(indptr, indices, data, sh, i);
                    if (lead) { t[i] = (T)ti; c[0] = ti * ti; c[1] = ti * (double)sv[i]; }
                    s = si;
                }
            }
            sum.add(s, c, out);
        }
    } else {
        MS_WARP_ROWS(i)
            int s = -1;
            double c[2] = {0.0, 0.0};
            if (in_) {
                const int si = SINGLE ? 0 : row_sys[i];
                if (SINGLE || status[si] == MS_RUNNING) {
                    const double ss = ACC(3, slot)[si];
                    if (ss <= tol2[si]) {  // converged at the half step
                        if (i == offs[si]) { status[si] = MS_CONVERGED; iters[si] += 1; res2[si] = ss; }
                    } else {
                        const double ti = ms_row_dot(indptr, indices, data, sh, i);
                        t[i] = (T)ti;
                        c[0] = ti * ti; c[1] = ti * (double)sv[i];
                        s = si;
                    }
                }
            }
            sum.add(s, c, out);
        }
    }
    sum.finish(out);
}

// omega = t.s / t.t; x += omega s-hat; r = s - omega t; sums r~.r and r.r.
template <typename T, typename I, bool SINGLE, bool JAC>
__global__ void ms_bicg_update_r(T* x, T* r, const T* z, const T* t, const T* __restrict__ rt,
                                 const int* __restrict__ row_sys, int* status, ll* iters,
                                 const ll* offs, double* res2, double* acc, int nsys, int slot,
                                 ll n, const I* __restrict__ act, int compact) {
    const int nslot = 4;
    MS_GRID_STRIDE
    if (!ms_block_running<SINGLE>(status)) return;
    SegSum<2, SINGLE> sum;
    double* const out[2] = {ACC(0, slot), ACC(1, slot)};
    MS_WARP_ROWS(i)
        int s = -1;
        double c[2] = {0.0, 0.0};
        if (in_) {
            const int si = SINGLE ? 0 : row_sys[i];
            if (SINGLE || status[si] == MS_RUNNING) {
                const double tt = ACC(4, slot)[si];
                if (tt == 0.0 || !isfinite(tt)) {
                    if (i == offs[si]) {
                        status[si] = MS_BREAKDOWN; iters[si] += 1; res2[si] = ACC(3, slot)[si];
                    }
                } else {
                    const double omega = ACC(5, slot)[si] / tt;
                    const double ri_old = (double)r[i];
                    const double shi = JAC ? (double)z[i] : ri_old;
                    x[i] = (T)((double)x[i] + omega * shi);
                    const T ri = (T)(ri_old - omega * (double)t[i]);
                    r[i] = ri;
                    c[0] = (double)rt[i] * (double)ri; c[1] = (double)ri * (double)ri;
                    s = si;
                    if (i == offs[si]) iters[si] += 1;
                }
            }
        }
        sum.add(s, c, out);
    }
    sum.finish(out);
}

// ------------------------------------------- GMRES (batched.py's device path, _Gmres)
// Per-system coefficient arrays are laid out [a][s] (a = basis vector, s = system).
// Every kernel walks n rows: all of them, or (compact != 0) the list act of the
// rows of systems still running (compaction at a restart).

// w = A (dinv .* v), right Jacobi when JAC; one thread per row.
template <typename T, typename I, bool JAC>
__global__ void ms_gmres_spmv(const I* __restrict__ indptr, const I* __restrict__ indices,
                              const T* __restrict__ data, const T* __restrict__ v,
                              const T* __restrict__ dinv, T* __restrict__ w, ll n,
                              const ll* __restrict__ act, int compact) {
    MS_GRID_STRIDE
    for (ll t = tid; t < n; t += G) {
        const ll i = MS_ROW(t);
        double sum = 0.0;
        const I end = indptr[i + 1];
        for (I j = indptr[i]; j < end; ++j) {
            const I c = indices[j];
            sum += (double)data[j] * (JAC ? (double)dinv[c] * (double)v[c] : (double)v[c]);
        }
        w[i] = (T)sum;
    }
}

// out[a][s] += sum over system s's rows of V[a0 + a][i] * w[i], for a < k <= 8.
// SINGLE (one system): sums in registers, one block reduction, one atomic per block.
template <typename T, bool SINGLE>
__global__ void ms_gmres_dots(const T* __restrict__ V, ll ldv, const T* __restrict__ w,
                              const int* __restrict__ row_sys, double* out, int a0, int k,
                              int nsys, ll n, const ll* __restrict__ act, int compact) {
    MS_GRID_STRIDE
    SegSum<8, SINGLE> sum;
#define MS_OUT(a) (out + (ll)((a) < k ? (a) : 0) * nsys)
    double* const outs[8] = {MS_OUT(0), MS_OUT(1), MS_OUT(2), MS_OUT(3),
                             MS_OUT(4), MS_OUT(5), MS_OUT(6), MS_OUT(7)};
#undef MS_OUT
    MS_WARP_ROWS(i)
        int s = -1;
        double c[8];
        #pragma unroll
        for (int a = 0; a < 8; ++a) c[a] = 0.0;
        if (in_) {
            s = SINGLE ? 0 : row_sys[i];
            const double wi = (double)w[i];
            #pragma unroll
            for (int a = 0; a < 8; ++a)
                if (a < k) c[a] = (double)V[(ll)(a0 + a) * ldv + i] * wi;
        }
        sum.add(s, c, outs);
    }
    sum.finish(outs);
}

// y += sign * (dinv .*) sum_{a < k} coef[a][s(i)] V[a][i]: Gram-Schmidt's update
// (sign -1, no dinv) and the solution's update at the end of a cycle.
template <typename T, bool JAC>
__global__ void ms_gmres_combine(const T* __restrict__ V, ll ldv, const double* __restrict__ coef,
                                 const int* __restrict__ row_sys, const T* __restrict__ dinv,
                                 T* y, int k, double sign, int nsys, ll n,
                                 const ll* __restrict__ act, int compact) {
    MS_GRID_STRIDE
    for (ll t = tid; t < n; t += G) {
        const ll i = MS_ROW(t);
        const int s = row_sys[i];
        double acc = 0.0;
        for (int a = 0; a < k; ++a) acc += coef[(ll)a * nsys + s] * (double)V[(ll)a * ldv + i];
        if (JAC) acc *= (double)dinv[i];
        y[i] = (T)((double)y[i] + sign * acc);
    }
}

// v = w / norm[s(i)] (0 where the norm is 0: the system's Krylov space is complete).
template <typename T>
__global__ void ms_gmres_scale(const T* __restrict__ w, T* __restrict__ v,
                               const double* __restrict__ norm, const int* __restrict__ row_sys,
                               ll n, const ll* __restrict__ act, int compact) {
    MS_GRID_STRIDE
    for (ll t = tid; t < n; t += G) {
        const ll i = MS_ROW(t);
        const double nn = norm[row_sys[i]];
        v[i] = nn > 0.0 ? (T)((double)w[i] / nn) : (T)0;
    }
}
"""

_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
          np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
_B = ("false", "true")


def _instantiations(T: str, I: str) -> dict[str, str]:
    """Kernel name -> C++ name expression for one (value, index) type pair."""
    names: dict[str, str] = {}
    for s in (0, 1):
        for j in (0, 1):
            for x in (0, 1):
                names[f"init{s}{j}{x}"] = f"ms_init<{T}, {I}, {_B[s]}, {_B[j]}, {_B[x]}>"
            names[f"cg_update{s}{j}"] = f"ms_cg_update<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_direction{s}{j}"] = f"ms_bicg_direction<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_update_s{s}{j}"] = f"ms_bicg_update_s<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_update_r{s}{j}"] = f"ms_bicg_update_r<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"cg_spmv{s}{j}"] = f"ms_cg_spmv<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_spmv_v{s}{j}"] = f"ms_bicg_spmv_v<{T}, {I}, {_B[s]}, {_B[j]}>"
            names[f"bicg_spmv_t{s}{j}"] = f"ms_bicg_spmv_t<{T}, {I}, {_B[s]}, {_B[j]}>"
        names[f"cg_direction{s}"] = f"ms_cg_direction<{T}, {I}, {_B[s]}>"
        names[f"residual{s}"] = f"ms_residual<{T}, {I}, {_B[s]}>"
    names["zero_x"] = f"ms_zero_x<{T}>"
    for j in (0, 1):
        names[f"gmres_spmv{j}"] = f"ms_gmres_spmv<{T}, {I}, {_B[j]}>"
        names[f"gmres_combine{j}"] = f"ms_gmres_combine<{T}, {_B[j]}>"
        names[f"gmres_dots{j}"] = f"ms_gmres_dots<{T}, {_B[j]}>"
    names["gmres_scale"] = f"ms_gmres_scale<{T}>"
    # extern "C" kernels go through name expressions too: their lowered name is their own.
    names["init_status"] = "ms_init_status"
    names["bicg_check"] = "ms_bicg_check"
    return names


_lock = threading.Lock()
_modules: dict[tuple, dict[str, Any]] = {}


def kernels(device_id: int, dtype: Any, index_dtype: Any) -> dict[str, Any]:
    """Compiled kernels for one device and (value, index) dtype pair; compiled once, cached."""
    key = (int(device_id), np.dtype(dtype).str, np.dtype(index_dtype).str, CONTIGUOUS_ROWS)
    with _lock:
        if key in _modules:
            return _modules[key]
        cp = _backend.cupy()
        names = _instantiations(_TYPES[np.dtype(dtype)], _TYPES[np.dtype(index_dtype)])
        with cp.cuda.Device(device_id):
            mod = cp.RawModule(code=SOURCE, options=("-std=c++17", f"-DMS_CONTIGUOUS={int(CONTIGUOUS_ROWS)}"),
                               name_expressions=list(names.values()))
            fns = {k: mod.get_function(v) for k, v in names.items()}
        _modules[key] = fns
        return fns


@functools.cache
def _sm_count(device_id: int) -> int:
    cp = _backend.cupy()
    return int(cp.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _grid_rows(n: int, device_id: int) -> int:
    """Blocks for a grid-stride row kernel: one full wave (8 blocks of 256 per SM) at most."""
    return max(1, min(math.ceil(n / THREADS), _sm_count(device_id) * 8))


def residual_norms(batch: Any, x: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-system ``||b_s - A_s x_s||`` and ``||b_s||`` of a CuPy batch, as host float64 arrays.

    One fused pass (products, squares and per-system sums in float64) and one
    device -> host copy, instead of a cuSPARSE product, two weighted bincounts
    and their temporaries.
    """
    cp = _backend.cupy()
    dev = batch.data.device.id
    ns = batch.nsys
    with cp.cuda.Device(dev):
        k = kernels(dev, batch.dtype, batch.index_dtype)
        sums = cp.zeros(2 * ns, dtype=np.float64)
        k[f"residual{int(ns == 1)}"]((_grid_rows(batch.n, dev),), (THREADS,), (
            batch.indptr, batch.indices, batch.data, batch.b, x, batch.row_sys, sums[:ns],
            sums[ns:], np.int64(batch.n)))
        h = sums.get()  # sync: one read of the per-system norms
    # The caller's stream waited for the solve's stream, masked iterations included:
    # the batch and workspace kept for them can go now, not at the next solve.
    _release_done()
    return np.sqrt(h[:ns]), np.sqrt(h[ns:])


def solve(batch: Any, method: str, check_every: int | None, first_check: int | None = None) -> tuple:
    """Run batched CG or BiCGStab on a CuPy batch; returns BatchOutcome's fields.

    A workspace made beforehand by :func:`prepare` for this batch and method
    is used (once); otherwise it is built here.
    """
    cp = _backend.cupy()
    dev = batch.data.device.id
    ready = batch.__dict__.pop("_workspace", None)
    _release_done()
    with cp.cuda.Device(dev):
        if ready is not None and ready.method == method:
            solver, solver.batch = ready, batch
        else:
            solver = _Solver(cp, batch, method, dev)
        return solver.run(check_every, first_check)


def prepare(batch: Any, method: str) -> None:
    """Build a CuPy batch's solver workspace now, for the next :func:`solve` of it.

    ``solve_many`` calls this in a device's stager thread right after
    packing, so the workspace's allocations and small copies (6-34 ms a batch
    on an H200 host while other threads pack) happen beside the previous
    batch's compute instead of before this one's. The work goes on the
    current stream; the caller synchronises it before the batch is solved.
    """
    cp = _backend.cupy()
    dev = batch.data.device.id
    with cp.cuda.Device(dev):
        solver = _Solver(cp, batch, method, dev)
        stream = cp.cuda.get_current_stream()
        # The CUDA graph of the first iterations too: its capture launches every
        # kernel of GRAPH_CHUNK iterations from Python, which took 8-37 ms instead
        # of 1-2 on the worker while the stagers of two GPUs packed (the GPU idle
        # meanwhile). Capture needs a stream other than the default ones.
        if PREPARE_GRAPH and solver.uses_graph and stream.ptr not in (0, 1, 2):
            solver.graph = solver._capture(stream)
    solver.batch = None  # no cycle: a batch dropped unsolved frees its workspace at once
    batch._workspace = solver


class _Solver:
    """Workspace and launch sequence of one batched solve (all allocation in __init__)."""

    def __init__(self, cp: Any, batch: Any, method: str, dev: int):
        self.cp, self.batch, self.method, self.dev = cp, batch, method, dev
        n, nsys, dt = batch.n, batch.nsys, batch.dtype
        self.n, self.nsys = n, nsys
        self.k = kernels(dev, dt, batch.index_dtype)
        self.single = int(nsys == 1)
        self.jac = int(batch.dinv is not None)
        # A warp per row once rows are long enough to give most lanes work.
        self.vspmv = int(batch.nnz >= VECTOR_MIN_NNZ_PER_ROW * max(n, 1))
        self.grid = _grid_rows(n, dev)
        self.sgrid = max(1, math.ceil(nsys / 128))
        cg = method == "cg"
        self.nslot = CG_SLOTS if cg else BICG_SLOTS
        nacc = CG_ACCS if cg else BICG_ACCS
        empty = cp.empty
        self.x = empty(n, dtype=dt)
        nvec = 3 if cg else 5
        self.vec = [empty(n, dtype=dt) for _ in range(nvec)]
        self.z = empty(n, dtype=dt) if self.jac else None
        self.acc = cp.zeros(nacc * self.nslot * nsys, dtype=np.float64)
        self.bb = cp.zeros(nsys, dtype=np.float64)
        self.tol2 = empty(nsys, dtype=np.float64)
        self.rtol = cp.asarray(batch.rtol)
        self.atol = cp.asarray(batch.atol)
        self.maxiter = cp.asarray(batch.maxiter.astype(np.int64))
        self.offs = cp.asarray(batch.offsets.astype(np.int64))
        # status (int32), iterations (int64) and final r.r (float64) share one
        # buffer, so a checkpoint is a single device -> host copy.
        self.info = cp.zeros(nsys * 20, dtype=np.uint8)
        self.res2 = self.info[: 8 * nsys].view(np.float64)
        self.iters = self.info[8 * nsys: 16 * nsys].view(np.int64)
        self.status = self.info[16 * nsys:].view(np.int32)
        self.nn = np.int64(n)
        self.ns = np.int32(nsys)
        # Compaction: the iteration kernels walk ``act[:nact]`` (rows of running
        # systems) once most rows belong to finished systems.
        self.act = cp.empty(n if nsys > 1 else 0, dtype=batch.index_dtype)
        self.nact = np.int64(n)
        self.compact = np.int32(0)
        self.compactions = 0
        self.sizes = np.diff(batch.offsets).astype(np.int64)
        self.maxmax = int(batch.maxiter.max()) if nsys else 0
        self.uses_graph = self.maxmax > 0 and (n <= GRAPH_MAX_ROWS or (nsys > 1 and GRAPH_BATCHES))
        self.graph = None  # captured ahead by prepare()

    # -- launches ---------------------------------------------------------------------
    def _rows(self, fn: Any, *args: Any) -> None:
        fn((self.grid,), (THREADS,), args)

    def _setup(self) -> None:
        cp, b, k = self.cp, self.batch, self.k
        has_x0 = int(b.x0 is not None)
        if has_x0:
            cp.copyto(self.x, b.x0)
        else:
            self.x.fill(0)
        dinv = b.dinv if self.jac else self.x  # never read without Jacobi
        last = np.int32(self.nslot - 1)
        if self.method == "cg":
            r, p, _ = self.vec
            z = self.z if self.jac else r
            rr_id, rz_id, copy, jac = 2, 1, p, self.jac
        else:
            r, rt = self.vec[0], self.vec[1]
            z, rr_id, rz_id, copy, jac = r, 1, 0, rt, 0  # r~ = r; rho = r.r
        self._rows(k[f"init{self.single}{jac}{has_x0}"], b.indptr, b.indices, b.data, b.b, self.x,
                   dinv, r, z, copy, b.row_sys, self.bb, self.acc, self.ns, last,
                   np.int32(self.nslot), np.int32(rr_id), np.int32(rz_id), self.nn)
        if has_x0:
            self._rows(k["zero_x"], self.x, b.row_sys, self.bb, self.nn)
        k["init_status"]((self.sgrid,), (128,), (
            self.acc, self.ns, last, np.int32(self.nslot), np.int32(rr_id), np.int32(rz_id),
            self.bb, self.rtol, self.atol, self.maxiter, self.tol2, self.status, self.iters,
            self.res2))

    def _iteration(self, it: int) -> None:
        slot = np.int32(it % self.nslot)
        b, k, s, j = self.batch, self.k, self.single, self.jac
        A = (b.indptr, b.indices, b.data)
        dinv = b.dinv if j else self.x
        if self.method == "cg":
            r, p, q = self.vec
            z = self.z if j else r
            self._rows(k[f"cg_spmv{s}{self.vspmv}"], *A, p, q, b.row_sys, self.status, self.acc, self.ns,
                       slot, self.nact, self.act, self.compact)
            self._rows(k[f"cg_update{s}{j}"], self.x, r, z, p, q, dinv, b.row_sys, self.status,
                       self.offs, self.res2, self.acc, self.ns, slot, self.nact, self.act, self.compact)
            self._rows(k[f"cg_direction{s}"], p, z, b.row_sys, self.status, self.iters,
                       self.maxiter, self.tol2, self.offs, self.res2, self.acc, self.ns, slot,
                       self.nact, self.act, self.compact)
        else:
            r, rt, p, v, t = self.vec
            z = self.z if j else p
            ph = z if j else p
            sh = z if j else r
            self._rows(k[f"bicg_direction{s}{j}"], p, z, r, v, dinv, b.row_sys, self.status,
                       self.iters, self.maxiter, self.tol2, self.offs, self.res2, self.acc,
                       self.ns, slot, self.nact, self.act, self.compact)
            self._rows(k[f"bicg_spmv_v{s}{self.vspmv}"], *A, ph, v, rt, b.row_sys, self.status, self.acc,
                       self.ns, slot, self.nact, self.act, self.compact)
            self._rows(k[f"bicg_update_s{s}{j}"], self.x, r, z, p, v, dinv, b.row_sys,
                       self.status, self.offs, self.res2, self.acc, self.ns, slot, self.nact, self.act, self.compact)
            self._rows(k[f"bicg_spmv_t{s}{self.vspmv}"], *A, sh, r, t, b.row_sys, self.status, self.iters,
                       self.tol2, self.offs, self.res2, self.acc, self.ns, slot, self.nact, self.act, self.compact)
            self._rows(k[f"bicg_update_r{s}{j}"], self.x, r, z, t, rt, b.row_sys, self.status,
                       self.iters, self.offs, self.res2, self.acc, self.ns, slot, self.nact, self.act, self.compact)

    def _before_read(self, it: int) -> None:
        """BiCGStab applies its stopping tests at the start of an iteration; run them now."""
        if self.method != "cg":
            self.k["bicg_check"]((self.sgrid,), (128,), (
                self.acc, self.ns, np.int32(it % self.nslot), self.status, self.iters,
                self.maxiter, self.tol2, self.res2))

    # -- the loop -------------------------------------------------------------------
    def _capture(self, stream: Any) -> Any:
        """A CUDA graph of GRAPH_CHUNK iterations with the current row set."""
        stream.begin_capture()
        try:
            for it in range(GRAPH_CHUNK):
                self._iteration(it)
        finally:
            graph = stream.end_capture()
        return graph

    def _compact(self, status: np.ndarray, stream: Any) -> bool:
        """Restrict the iteration kernels to running systems' rows, when that halves the work.

        Called at a checkpoint with the statuses the host just read. Systems
        finished since then are still in the list (masked, as before); the
        list only shrinks. The rows go up through a page-locked buffer on the
        solver's stream; ``act`` was allocated with the workspace.
        """
        if self.nsys == 1 or int(self.nact) < COMPACT_MIN_ROWS:
            return False
        running = np.flatnonzero(status == RUNNING)
        lens = self.sizes[running]
        m = int(lens.sum())
        if m == 0 or m > COMPACT_FRACTION * int(self.nact):
            return False
        from ..kernels.packing import active_rows

        starts = self.batch.offsets[:-1][running].astype(np.int64)
        host = _pinned(m * self.act.itemsize, self.act.dtype, self._keep)
        active_rows(starts, lens, host)  # without the GIL
        self.cp.cuda.runtime.memcpyAsync(self.act.data.ptr, host.ctypes.data, host.nbytes,
                                         self.cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self.nact = np.int64(m)
        self.compact = np.int32(1)
        self.compactions += 1
        return True

    def run(self, check_every: int | None, first_check: int | None = None) -> tuple:
        """Launch iterations ahead of the host; read statuses without draining the GPU.

        After every ``spacing`` iterations the statuses go to a page-locked
        host buffer (an asynchronous copy) and an event is recorded. The host
        keeps up to AHEAD checkpoints' worth of iterations queued beyond the
        last one it has read, and waits on the oldest checkpoint's event while
        later work is still queued, so the GPU never idles on the host; the
        extra iterations queued after convergence run masked (threads of
        finished systems skip their rows). The only wait with nothing queued
        behind it is the last one when ``maxiter`` is reached: that count is
        returned as ``host_syncs`` (0 or 1), the checkpoint count as
        ``checkpoints``. ``first_check`` (a predicted iteration count) lets
        the host queue that many iterations before its first read.
        """
        cp = self.cp
        caller = cp.cuda.get_current_stream()
        stream = cp.cuda.Stream(non_blocking=True)
        # The batch was written on the caller's stream; ours must see it.
        stream.wait_event(caller.record())
        use_graph = self.uses_graph
        unit = GRAPH_CHUNK if use_graph else 1
        maxmax = self.maxmax
        last = -(-maxmax // unit) * unit  # iterations launched at most
        spacing = int(check_every) if check_every is not None else (GRAPH_CHUNK if use_graph else CHECK_EVERY)
        spacing = max(unit, -(-spacing // unit) * unit)
        ahead = max(AHEAD * spacing, int(first_check or 0))
        self._keep: list = []  # page-locked buffers, alive until their copies are done
        free: list[np.ndarray] = []
        pending: deque = deque()  # (iterations at the checkpoint, event, host buffer)
        syncs = checkpoints = 0
        launched = seen = 0
        final = None
        per_it = math.inf  # GPU milliseconds an iteration, measured at checkpoints
        behind = False  # the host came late to a checkpoint (the GPU had passed it)
        with stream:
            started = stream.record()  # GPU time of the solve, read once it is over
            last_event = started
            self._setup()
            graph, self.graph = self.graph, None
            if graph is None and use_graph:
                graph = self._capture(stream)
            while True:
                while launched < last and (launched - seen < ahead or not pending):
                    target = min(launched + spacing, last)
                    while launched < target:
                        if graph is not None:
                            graph.launch(stream)
                            launched += GRAPH_CHUNK
                        else:
                            self._iteration(launched)
                            launched += 1
                    self._before_read(launched)
                    buf = free.pop() if free else _pinned(self.info.nbytes, np.uint8, self._keep)
                    cp.cuda.runtime.memcpyAsync(buf.ctypes.data, self.info.data.ptr, self.info.nbytes,
                                                cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                    pending.append((launched, stream.record(), buf))
                if not pending:  # maxmax == 0: set-up decided every system
                    buf = _pinned(self.info.nbytes, np.uint8, self._keep)
                    done = stream.record()
                    self.info.get(out=buf)  # sync: the statuses set-up wrote, nothing queued behind
                    syncs += 1
                    final = buf
                    break
                at, event, buf = pending.popleft()
                # A host running behind (waiting for the GIL behind other threads)
                # goes straight to the newest checkpoint the GPU has passed instead
                # of waking once per checkpoint: one wake-up could cost up to the
                # 5 ms switch interval, and convergence was seen 10-20 ms late.
                while pending and pending[0][1].done:
                    free.append(buf)  # complete: an event after it is
                    at, event, buf = pending.popleft()
                    checkpoints += 1  # passed (and counted) without a wake-up of its own
                    behind = True
                if not pending:
                    syncs += 1  # this wait drains the queue (maxiter reached, or check_every)
                event.synchronize()  # sync: checkpoint `at`; later iterations stay queued
                checkpoints += 1
                # The fastest stretch between checkpoints is closest to the GPU's own
                # time per iteration (a stretch may include idling on the host).
                ms = cp.cuda.get_elapsed_time(last_event, event)  # both events are complete
                if at > seen and ms > 0:
                    per_it = min(per_it, ms / (at - seen))
                last_event = event
                seen = at
                status = buf[16 * self.nsys:].view(np.int32)
                if not (status == RUNNING).any():
                    final, done = buf, event
                    break
                if at >= last:
                    raise RuntimeError(
                        f"{self.method}_batched: {int((status == RUNNING).sum())} systems still "
                        f"running after {at} iterations with maxiter <= {maxmax}; this is a bug "
                        "in managed_solve's CUDA Krylov kernels, please report it")
                ahead = AHEAD * spacing
                if behind and per_it < math.inf:
                    spent = cp.cuda.get_elapsed_time(started, event)  # ms, both complete
                    want = min(AHEAD_SECONDS * 1e3, AHEAD_FRACTION * spent)
                    ahead = max(ahead, -(-int(want / per_it) // spacing) * spacing)
                if self._compact(status, stream) and graph is not None:
                    self._keep.append(graph)  # its queued launches still run
                    graph = self._capture(stream)
                free.append(buf)
        # Later work on the caller's stream must see x; masked iterations still queued
        # on ours finish first, and the workspace is only reused after them.
        caller.wait_event(stream.record())
        if pending:
            # The batch and this workspace too: their memory may have come from
            # another stream's pool arena (the stager's), which must not hand it
            # out again while masked iterations still read it.
            _retire(stream.record(), self._keep + [graph, self])
        ns = self.nsys
        h = final
        gpu_seconds = cp.cuda.get_elapsed_time(started, done) / 1e3  # both events are complete
        return (self.x, h[8 * ns:16 * ns].view(np.int64).copy(),
                np.sqrt(h[:8 * ns].view(np.float64)), h[16 * ns:].view(np.int32).astype(np.int8),
                syncs, checkpoints, self.compactions, gpu_seconds)


def _pinned(nbytes: int, dtype: Any, keep: list) -> np.ndarray:
    """A NumPy array over ``nbytes`` of page-locked memory (kept alive by ``keep``)."""
    return _backend.pinned_empty(nbytes // np.dtype(dtype).itemsize, dtype, keep)


# Page-locked buffers whose device -> host copies were still queued when their
# solve returned (masked iterations after convergence): released once done.
_retired: deque = deque()
_retired_lock = threading.Lock()


def _retire(event: Any, keep: list) -> None:
    with _retired_lock:
        _release_done_locked()
        _retired.append((event, keep))


def _release_done() -> None:
    """Drop the retired buffers whose queued work has finished (at each solve's start too)."""
    if _retired:
        with _retired_lock:
            _release_done_locked()


def _release_done_locked() -> None:
    live = [(e, k) for e, k in _retired if not e.done]
    _retired.clear()
    _retired.extend(live)
