// Fused CG and BiCGStab kernels: set-up, iterations, true residual (cuda.py, gpu.py).

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
                           int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                             double* res2, double* acc, int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                                double* res2, const double* acc, int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                                  double* res2, double* acc, int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                               int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                                 double* res2, double* acc, int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                               int nsys, int slot, const ll* __restrict__ ctl,
    const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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
                                 const ll* __restrict__ ctl, const I* __restrict__ act) {
    const ll n = ctl[0];  // rows walked: all, or the running systems' after compaction
    const int compact = (int)ctl[1];
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

