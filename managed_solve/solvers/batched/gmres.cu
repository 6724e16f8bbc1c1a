// ------------------------------------------- GMRES (the device primitives of gmres.py's loop)
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
