// Checks of CSR matrices and vectors that lie on a GPU: each pass reads the
// arrays once and leaves its answers in a few words of device memory, which
// the caller reads back in one copy (one synchronisation, not one a property).
//
// Flags are OR-ed into an int array; the bits are the FLAG_* constants of
// device_checks.py. Reductions of doubles go through an order-preserving map
// to unsigned 64-bit words (ms_order), so atomicMin/atomicMax on the words
// are min/max on the values.

typedef unsigned long long ms_u64;

#define MS_BAD_INDPTR 1
#define MS_BAD_INDEX 2
#define MS_NOT_CANONICAL 4
#define MS_MIRROR_MISSING 8
#define MS_NAN_DIAGONAL 16
#define MS_VALUES_DIFFER 32

__device__ __forceinline__ ms_u64 ms_order(double x)
{
    ms_u64 b = (ms_u64)__double_as_longlong(x);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ULL);
}

// Every value of x finite (no NaN, no Inf)? Sets `bit` in flags[0] otherwise.
// v - v is 0 for a finite v and NaN for a NaN or an infinity.
template <typename T>
__global__ void ms_nonfinite(const long long n, const T* __restrict__ x, int* flags, const int bit)
{
    bool bad = false;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const T v = x[i];
        bad |= !((v - v) == (T)0);
    }
    if (bad) atomicOr(flags, bit);
}

// A CSR pattern of n rows and nnz entries: indptr starts at 0, never
// decreases and ends at nnz (MS_BAD_INDPTR); every column index lies in
// [0, n) (MS_BAD_INDEX); within each row the columns increase strictly
// (sorted, no duplicates; MS_NOT_CANONICAL otherwise). Rows whose pointers
// are out of range are not read.
template <typename I>
__global__ void ms_csr_structure(const long long n, const long long nnz, const I* __restrict__ indptr,
                                 const I* __restrict__ indices, int* flags)
{
    int bad = 0;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t <= n || t < nnz; t += stride) {
        if (t <= n) {
            const long long p = (long long)indptr[t];
            if (p < 0 || p > nnz || (t == 0 && p != 0) || (t == n && p != nnz)) bad |= MS_BAD_INDPTR;
            if (t < n) {
                const long long q = (long long)indptr[t + 1];
                if (q < p) {
                    bad |= MS_BAD_INDPTR;
                } else if (p >= 0 && q <= nnz) {
                    for (long long k = p; k + 1 < q; ++k) {
                        if (!(indices[k] < indices[k + 1])) { bad |= MS_NOT_CANONICAL; break; }
                    }
                }
            }
        }
        if (t < nnz) {
            const long long j = (long long)indices[t];
            if (j < 0 || j >= n) bad |= MS_BAD_INDEX;
        }
    }
    if (bad) atomicOr(flags, bad);
}

// The position of column `col` among the sorted columns ix[a0 .. a1), or -1.
template <typename I>
__device__ __forceinline__ long long ms_find(const I* __restrict__ ix, long long a0, long long a1,
                                             const long long col)
{
    const long long end = a1;
    while (a0 < a1) {
        const long long m = (a0 + a1) >> 1;
        if ((long long)ix[m] < col) a0 = m + 1; else a1 = m;
    }
    return (a0 < end && (long long)ix[a0] == col) ? a0 : -1;
}

// max |a_ik| over row i's stored entries, as a double (fmax leaves a NaN out; 0 for an empty row).
template <typename I, typename T>
__device__ __forceinline__ double ms_row_max(const I* __restrict__ ip, const T* __restrict__ v,
                                             const long long i)
{
    double m = 0.0;
    for (long long p = (long long)ip[i]; p < (long long)ip[i + 1]; ++p) m = fmax(m, fabs((double)v[p]));
    return m;
}

// Symmetry and Gershgorin bounds of many canonical CSR matrices in one launch.
//
// Block b works on rows block_row0[b] .. + blockDim.x of matrix
// block_matrix[b]; matrix k's arrays are at the addresses ptrs[k], idxs[k],
// vals[k] (rows[k] rows). Row i's entries give its diagonal d (the sum of
// its stored diagonal entries), the absolute off-diagonal sum r, and for
// each entry (i, j) the mirror (j, i) found by binary search in row j.
// Each pair is judged by the symmetry rule of managed_solve/kernels/symmetry.py
// (the one statement of it): |a_ij - a_ji| <= rel * max(|a_ij|, |a_ji|,
// sqrt(r_i) * sqrt(r_j)) in double, r_i the largest |a_ik| of row i, the two
// rows read only when the first two terms fail; a pair that fails sets
// MS_VALUES_DIFFER. Both rows of a pair judge it, with the same operations
// in the same order, so the same verdict.
// out[8 k + 0..4]: flags (MS_MIRROR_MISSING, MS_NOT_CANONICAL, MS_NAN_DIAGONAL,
// MS_VALUES_DIFFER), then min(d - r), max(d + r), min d, max d (through
// ms_order). The caller sets the identities first.
template <typename I, typename T>
__global__ void ms_symmetry_many(const int* __restrict__ block_matrix, const long long* __restrict__ block_row0,
                                 const ms_u64* __restrict__ ptrs, const ms_u64* __restrict__ idxs,
                                 const ms_u64* __restrict__ vals, const long long* __restrict__ rows,
                                 const double rel, ms_u64* out)
{
    const int k = block_matrix[blockIdx.x];
    const long long i = block_row0[blockIdx.x] + threadIdx.x;
    const long long n = rows[k];
    const I* ip = (const I*)ptrs[k];
    const I* ix = (const I*)idxs[k];
    const T* v = (const T*)vals[k];
    int flag = 0;
    double lo = __longlong_as_double(0x7ff0000000000000LL), hi = -lo, dmin = lo, dmax = -lo;
    if (i < n) {
        const long long s = (long long)ip[i], e = (long long)ip[i + 1];
        double d = 0.0, r = 0.0;
        for (long long p = s; p < e; ++p) {
            const long long j = (long long)ix[p];
            const double a = (double)v[p];
            if (j == i) d += a; else r += fabs(a);
            if (p + 1 < e && !(ix[p] < ix[p + 1])) flag |= MS_NOT_CANONICAL;
            if (j < 0 || j >= n) {
                flag |= MS_MIRROR_MISSING;
            } else if (!(flag & MS_MIRROR_MISSING)) {
                const long long q = ms_find(ix, (long long)ip[j], (long long)ip[j + 1], i);
                if (q < 0) {
                    flag |= MS_MIRROR_MISSING;
                } else if (!(flag & MS_VALUES_DIFFER)) {
                    const double b = (double)v[q];
                    const double diff = fabs(a - b);
                    if (diff > rel * fmax(fabs(a), fabs(b))
                        && diff > rel * (sqrt(ms_row_max(ip, v, i)) * sqrt(ms_row_max(ip, v, j))))
                        flag |= MS_VALUES_DIFFER;
                }
            }
        }
        if (d != d) flag |= MS_NAN_DIAGONAL;
        lo = d - r; hi = d + r; dmin = d; dmax = d;
    }
    for (int off = 16; off > 0; off >>= 1) {
        flag |= __shfl_down_sync(0xffffffffu, flag, off);
        lo = fmin(lo, __shfl_down_sync(0xffffffffu, lo, off));
        hi = fmax(hi, __shfl_down_sync(0xffffffffu, hi, off));
        dmin = fmin(dmin, __shfl_down_sync(0xffffffffu, dmin, off));
        dmax = fmax(dmax, __shfl_down_sync(0xffffffffu, dmax, off));
    }
    if ((threadIdx.x & 31) == 0 && block_row0[blockIdx.x] + (long long)threadIdx.x < n) {
        ms_u64* o = out + 8 * (long long)k;
        if (flag) atomicOr(o, (ms_u64)flag);
        atomicMin(o + 1, ms_order(lo));
        atomicMax(o + 2, ms_order(hi));
        atomicMin(o + 3, ms_order(dmin));
        atomicMax(o + 4, ms_order(dmax));
    }
}
