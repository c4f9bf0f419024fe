// flashrt kernels: rotary position embedding (plan op `Rope`), in place.
//
// For row r (absolute position p = io.pos + r) and each of `heads` heads of `head_dim`, the
// first `rotary_dims` dims rotate in rotate-half pairs (i, i + rotary_dims/2) by the angle
// p * theta^(-2i / rotary_dims); the remaining dims pass through untouched. Frequencies and
// angles are computed in f32 exactly as transformers (and the CPU reference) do:
// inv_freq = 1 / theta^(2i / rotary_dims), angle = float(p) * inv_freq, then full-range
// sinf/cosf (no fast-math). grid = (heads, rows); thread i owns pair i, so reading both
// halves before writing them is race-free.
//
// Memory traffic: rotary_dims elements read and written per head and row.
#include "common.cuh"

struct RopeParams {
    void* x;
    const int* pos;
    const int* len;
    double theta;
    int ld_x;
    int head_dim;
    int rotary_dims;
};

template <typename T> static __device__ __forceinline__ void rope_impl(const RopeParams& p) {
    const int h = blockIdx.x, row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    const int half = p.rotary_dims / 2;
    const float position = (float)(flashrt::load_pos(p.pos) + row);
    const float theta = (float)p.theta;
    T* x = static_cast<T*>(p.x) + (size_t)row * p.ld_x + (size_t)h * p.head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)p.rotary_dims);
        float sf, cf;
        sincosf(position * inv_freq, &sf, &cf);
        const float a = flashrt::to_f32(x[i]), b = flashrt::to_f32(x[i + half]);
        x[i] = flashrt::from_f32<T>(a * cf - b * sf);
        x[i + half] = flashrt::from_f32<T>(b * cf + a * sf);
    }
}

FLASHRT_ENTRY(rope, RopeParams, 256)
