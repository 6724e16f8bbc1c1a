// Packing systems that lie on a GPU into one batch: one launch for all of
// them, each thread finding its system by binary search over the offsets.
//
// System k's arrays are at the addresses ptrs[k], idxs[k], vals[k], rhs[k]
// and x0s[k] (0: no x0, zeros in the batch); its rows are
// row_off[k] .. row_off[k+1] of the batch and its entries nnz_off[k] ..
// nnz_off[k+1]. Row pointers are shifted by nnz_off[k], column indices by
// row_off[k]: the batch is one block-diagonal CSR matrix.

typedef unsigned long long ms_u64;

__device__ __forceinline__ int ms_owner(const long long* off, const int count, const long long t)
{
    int lo = 0, hi = count;  // the largest k with off[k] <= t
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (off[mid] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

template <typename T, typename I, typename O>
__global__ void ms_pack_gather(const int count, const long long n, const long long nnz,
                               const long long* __restrict__ row_off, const long long* __restrict__ nnz_off,
                               const ms_u64* __restrict__ ptrs, const ms_u64* __restrict__ idxs,
                               const ms_u64* __restrict__ vals, const ms_u64* __restrict__ rhs,
                               const ms_u64* __restrict__ x0s,
                               O* indptr, O* indices, T* data, T* b, T* x0)
{
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n || t < nnz; t += stride) {
        if (t < n) {
            const int k = ms_owner(row_off, count, t);
            const long long r = t - row_off[k];
            indptr[t] = (O)((long long)((const I*)ptrs[k])[r] + nnz_off[k]);
            b[t] = ((const T*)rhs[k])[r];
            if (x0 != nullptr) x0[t] = x0s[k] ? ((const T*)x0s[k])[r] : (T)0;
        }
        if (t < nnz) {
            const int k = ms_owner(nnz_off, count, t);
            const long long p = t - nnz_off[k];
            indices[t] = (O)((long long)((const I*)idxs[k])[p] + row_off[k]);
            data[t] = ((const T*)vals[k])[p];
        }
        if (t == 0) indptr[n] = (O)nnz;
    }
}
