// CG with one thread block per system: every iteration of a batch of small
// systems in one launch (gpu.py, FusedSolve._run_blocks).
//
// The row kernels of cg_bicgstab.cu spread every system over the whole GPU and
// pay three launches and three grid-wide barriers an iteration; for systems
// small enough for one SM, a block iterates its system alone, its barriers
// are __syncthreads, and a block whose system is done takes the next one
// (largest first, from a counter), so no SM idles behind a long system and no
// finished system costs a masked pass. Same recurrence and stopping tests as
// ms_cg_update / ms_cg_direction / ms_init_status; sums in a fixed order, so
// a batch's iterates are the same from run to run. At the end the block
// computes its system's true residual norm in float64 (the verify step's).

// Sums of K values over the block, returned to every thread (fixed order).
// sh: K x 32 doubles of shared memory, alternating between two buffers from
// one call to the next, so one barrier a call suffices: a thread writes a
// buffer again only after the next call's barrier, which every thread
// reaches after reading it. The barrier also orders every write before the
// call before every read after it.
template <int K>
__device__ __forceinline__ void ms_block_sums(double (&v)[K], double (*sh)[32]) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        const double w = ms_warp_sum(v[k]);
        if (lane == 0) sh[k][wid] = w;
    }
    __syncthreads();
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        double t = 0.0;
        for (int w = 0; w < nw; ++w) t += sh[k][w];
        v[k] = t;
    }
}

// ms_row_dot with the loads of four entries issued before their products: a
// block per system has few warps to hide memory latency with. Same sum, in
// the same order. v holds the system's values from its first row on (global
// column c at v[c - off]): a vector of the batch with off 0, or the block's
// copy in shared memory with the system's first row as off.
template <typename T, typename I>
__device__ __forceinline__ double ms_row_dot4(const I* __restrict__ indptr,
                                              const I* __restrict__ indices,
                                              const T* __restrict__ data, const T* v, ll off,
                                              ll i) {
    double sum = 0.0;
    I j = indptr[i];
    const I end = indptr[i + 1];
    for (; j + 4 <= end; j += 4) {
        const ll c0 = indices[j] - off, c1 = indices[j + 1] - off;
        const ll c2 = indices[j + 2] - off, c3 = indices[j + 3] - off;
        const double d0 = (double)data[j], d1 = (double)data[j + 1];
        const double d2 = (double)data[j + 2], d3 = (double)data[j + 3];
        const double v0 = (double)v[c0], v1 = (double)v[c1], v2 = (double)v[c2], v3 = (double)v[c3];
        sum += d0 * v0; sum += d1 * v1; sum += d2 * v2; sum += d3 * v3;
    }
    for (; j < end; ++j) sum += (double)data[j] * (double)v[indices[j] - off];
    return sum;
}

// x, r, z (Jacobi), p, q: the packed batch's vectors; a block touches only its
// system's rows, and a thread only its rows of x, r, z and q (p is read across
// rows, so it is the one not restrict). x0, dinv and z are not read without
// their flag (the host passes another vector for them then). order: systems
// by decreasing size; next: the claim counter (zero at launch).
// norms2[s] = ||b - A x||^2, norms2[nsys + s] = ||b||^2. At most 1024 threads
// a block, so 64 registers a thread at most.
//
// SH: p, q and x of the block's system live in dynamic shared memory (3 n
// values of T; the host launches with room for the batch's largest system)
// and x goes to the batch's x at the end. Each iteration then reads and
// writes in device memory only the matrix and r (and z, dinv with Jacobi):
// the kernel is bound by memory bandwidth, and a block's p, q and x made up
// about 40% of its traffic. Same operations in the same order, values stored
// as T either way: the same iterates as without SH.
template <typename T, typename I, bool JAC, bool HASX0, bool SH>
__global__ void __launch_bounds__(1024, 1)
ms_cg_blocks(const I* __restrict__ indptr, const I* __restrict__ indices,
             const T* __restrict__ data, const T* __restrict__ b, const T* __restrict__ x0,
             const T* __restrict__ dinv, T* __restrict__ x, T* __restrict__ r,
             T* __restrict__ z, T* p, T* __restrict__ q, const ll* __restrict__ offs,
             const int* __restrict__ order, int* next, int nsys, const double* __restrict__ rtol,
             const double* __restrict__ atol, const ll* __restrict__ maxiter, double* res2,
             ll* iters, int* status, double* norms2) {
    extern __shared__ double ms_dyn[];  // SH: the system's p, q, x
    __shared__ int claimed;
    __shared__ double red[2][3][32];
    int flip = 0;
    const ll step = blockDim.x;
    for (;;) {
        __syncthreads();  // every thread has read the previous claim (and the previous x)
        if (threadIdx.x == 0) {
            const int k = atomicAdd(next, 1);
            claimed = k < nsys ? order[k] : -1;
        }
        __syncthreads();
        const int s = claimed;
        if (s < 0) return;
        const ll off = offs[s], n = offs[s + 1] - off, lo = threadIdx.x;
        // The system's p, q, x from its first row: row i of the batch at [i - off].
        T* P = SH ? (T*)ms_dyn : p + off;
        T* Q = SH ? (T*)ms_dyn + n : q + off;
        T* X = SH ? (T*)ms_dyn + 2 * n : x + off;

        // r = b - A x0 (or b), z = dinv r, p = z; sums b.b, r.r, r.z
        double c3[3] = {0.0, 0.0, 0.0};
        for (ll k = lo; k < n; k += step) {
            const ll i = off + k;
            const double bi = (double)b[i];
            T ri;
            if (HASX0) {
                X[k] = x0[i];
                ri = (T)(bi - ms_row_dot4(indptr, indices, data, x0, (ll)0, i));
            } else {
                X[k] = (T)0;
                ri = (T)bi;
            }
            const T zi = JAC ? (T)((double)dinv[i] * (double)ri) : ri;
            r[i] = ri;
            if (JAC) z[i] = zi;
            P[k] = zi;
            c3[0] += bi * bi; c3[1] += (double)ri * (double)ri; c3[2] += (double)ri * (double)zi;
        }
        ms_block_sums<3>(c3, red[flip ^= 1]);
        const double bb = c3[0];
        double rr = c3[1], rz = c3[2];
        const double tol = fmax(rtol[s] * sqrt(bb), atol[s]);
        const double t2 = tol * tol;
        const ll maxit = maxiter[s];
        int st = MS_RUNNING;
        ll it = 0;
        double res = rr;
        if (bb == 0.0) {  // x = 0 whatever x0 (SciPy returns b)
            st = MS_CONVERGED; res = 0.0;
            if (HASX0) for (ll k = lo; k < n; k += step) X[k] = (T)0;
        } else if (rr <= t2) st = MS_CONVERGED;
        else if (maxit <= 0) st = MS_MAXITER;
        else if (rz == 0.0 || !isfinite(rz)) st = MS_BREAKDOWN;

        while (st == MS_RUNNING) {
            // q = A p; p.q
            double c1[1] = {0.0};
            for (ll k = lo; k < n; k += step) {
                const double qk = ms_row_dot4(indptr, indices, data, (const T*)P, off, off + k);
                Q[k] = (T)qk;
                c1[0] += (double)P[k] * qk;
            }
            ms_block_sums<1>(c1, red[flip ^= 1]);
            const double pq = c1[0];
            if (!(pq > 0.0)) { st = MS_BREAKDOWN; res = rr; break; }  // not positive definite (or NaN)
            // x += alpha p; r -= alpha q; z = dinv r; sums r.z, r.r
            const double alpha = rz / pq;
            double c2[2] = {0.0, 0.0};
            #pragma unroll 4
            for (ll k = lo; k < n; k += step) {
                const ll i = off + k;
                X[k] = (T)((double)X[k] + alpha * (double)P[k]);
                const T ri = (T)((double)r[i] - alpha * (double)Q[k]);
                r[i] = ri;
                const T zi = JAC ? (T)((double)dinv[i] * (double)ri) : ri;
                if (JAC) z[i] = zi;
                c2[0] += (double)ri * (double)zi; c2[1] += (double)ri * (double)ri;
            }
            ms_block_sums<2>(c2, red[flip ^= 1]);
            const double rz1 = c2[0];
            rr = c2[1];
            ++it;
            if (rr <= t2) { st = MS_CONVERGED; res = rr; break; }
            if (it >= maxit) { st = MS_MAXITER; res = rr; break; }
            if (rz1 == 0.0 || !isfinite(rz1)) { st = MS_BREAKDOWN; res = rr; break; }
            // p = z + beta p
            const double beta = rz1 / rz;
            rz = rz1;
            #pragma unroll 4
            for (ll k = lo; k < n; k += step) {
                const ll i = off + k;
                const double zi = JAC ? (double)z[i] : (double)r[i];
                P[k] = (T)(zi + beta * (double)P[k]);
            }
            __syncthreads();  // the next product reads other threads' p
        }

        // ||b - A x|| and ||b|| in float64
        __syncthreads();  // x complete
        double c2[2] = {0.0, 0.0};
        for (ll k = lo; k < n; k += step) {
            const ll i = off + k;
            const double bi = (double)b[i];
            const double ri = bi - ms_row_dot4(indptr, indices, data, (const T*)X, off, i);
            c2[0] += ri * ri; c2[1] += bi * bi;
            if (SH) x[i] = X[k];
        }
        ms_block_sums<2>(c2, red[flip ^= 1]);
        if (threadIdx.x == 0) {
            status[s] = st; iters[s] = it; res2[s] = res;
            norms2[s] = c2[0]; norms2[nsys + s] = c2[1];
        }
    }
}
