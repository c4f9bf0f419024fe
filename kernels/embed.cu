// flashrt kernels: token embedding lookup (plan op `Embed`).
//
// `out[r, :] = table[io.tokens[r], :]` for rows r < io.len. One block per row of the bucket;
// threads stride over the `width` columns. Rows r >= io.len are zeroed: they are the padding of
// a partial chunk, which the bucket-sized GEMMs compute on and discard, and zeroing them keeps
// that discarded arithmetic finite and deterministic from step to step. A token id outside
// [0, vocab) also yields a zero row (the host rejects such ids before a step, so this is only
// a guard against reading out of bounds).
//
// Memory traffic: width elements read (one table row) and written per row.
#include "common.cuh"

struct EmbedParams {
    const int* tokens; // io.tokens
    const int* len;    // io.len
    const void* table; // [vocab, width]
    void* out;         // view, row stride ld_out
    int ld_out;
    int width;
    int vocab;
};

template <typename T> static __device__ __forceinline__ void embed_impl(const EmbedParams& p) {
    const int row = blockIdx.x;
    T* out = static_cast<T*>(p.out) + (size_t)row * p.ld_out;
    const bool valid = row < flashrt::load_len(p.len);
    const int tok = valid ? p.tokens[row] : -1;
    if (tok < 0 || tok >= p.vocab) {
        for (int c = threadIdx.x; c < p.width; c += blockDim.x) out[c] = flashrt::from_f32<T>(0.0f);
        return;
    }
    const T* src = static_cast<const T*>(p.table) + (size_t)tok * p.width;
    // Unrolled so that several loads are in flight per thread (one row is latency-bound).
#pragma unroll 8
    for (int c = threadIdx.x; c < p.width; c += blockDim.x) out[c] = src[c];
}

FLASHRT_ENTRY(embed, EmbedParams, 256)
