// flashrt kernels: rotary position embedding (plan op `Rope`), in place.
//
// For row r (absolute position p = io.pos + r, or row r's own in a batched step) and each of `heads` heads of `head_dim`, the
// first `rotary_dims` dims rotate in rotate-half pairs (i, i + rotary_dims/2) by the angle
// p * theta^(-2i / rotary_dims); the remaining dims pass through untouched. Frequencies and
// angles are computed in f32 exactly as transformers (and the CPU reference) do:
// inv_freq = 1 / theta^(2i / rotary_dims), angle = float(p) * inv_freq, then full-range
// sinf/cosf (no fast-math).
//
// grid = (heads / hb, rows); a block rotates hb consecutive heads of one row. With
// rotary_dims / 2 <= blockDim.x the host makes blockDim.x = hb * (rotary_dims / 2) (hb a
// divisor of heads): thread (head h, pair i) loads its pair first, the block's first
// rotary_dims / 2 threads compute the angles once into shared memory, and every thread rotates
// its pair. So the powf/sincosf of a (row, pair) is shared by hb heads instead of recomputed
// per head, and a decode step of 24 heads x 32 pairs is 3 blocks of 256 threads rather than
// 24 single-warp blocks. Wider rotations (hb = 1, blockDim.x < rotary_dims / 2) loop over
// pairs. Each thread owns its pair, so reading both halves before writing them is race-free.
//
// Memory traffic: rotary_dims elements read and written per head and row.
#include "rope.cuh"

struct RopeParams {
    void* x;
    const int* pos;
    const int* len;
    double theta;
    int ld_x;
    int head_dim;
    int rotary_dims;
    const int* rows_pos; // batched step: each row's own position (common.cuh), else null
};

template <typename T> static __device__ __forceinline__ void rope_impl(const RopeParams& p) {
    __shared__ float2 angle[256]; // (cos, sin) of each pair, when blockDim.x = hb * half
    const int row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    const int half = p.rotary_dims / 2;
    if (half == 0) return;
    const float position = (float)flashrt::row_pos(p.pos, p.rows_pos, row);
    const float theta = (float)p.theta;
    auto cos_sin = [&](int i) { return flashrt::rope_cos_sin(position, theta, i, p.rotary_dims); };
    if (half <= (int)blockDim.x) {
        const int hb = blockDim.x / half;
        const int i = threadIdx.x % half, h = blockIdx.x * hb + threadIdx.x / half;
        const bool own = (int)threadIdx.x < hb * half; // all of them when blockDim.x = hb * half
        T* x = static_cast<T*>(p.x) + (size_t)row * p.ld_x + (size_t)h * p.head_dim;
        float a = 0.0f, b = 0.0f;
        if (own) {
            a = flashrt::to_f32(x[i]);
            b = flashrt::to_f32(x[i + half]);
        }
        if ((int)threadIdx.x < half) angle[i] = cos_sin(i);
        __syncthreads();
        if (!own) return;
        const float2 cs = angle[i];
        x[i] = flashrt::from_f32<T>(flashrt::rope_first(a, b, cs));
        x[i + half] = flashrt::from_f32<T>(flashrt::rope_second(a, b, cs));
        return;
    }
    T* x = static_cast<T*>(p.x) + (size_t)row * p.ld_x + (size_t)blockIdx.x * p.head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float2 cs = cos_sin(i);
        const float a = flashrt::to_f32(x[i]), b = flashrt::to_f32(x[i + half]);
        x[i] = flashrt::from_f32<T>(flashrt::rope_first(a, b, cs));
        x[i + half] = flashrt::from_f32<T>(flashrt::rope_second(a, b, cs));
    }
}

FLASHRT_ENTRY(rope, RopeParams, 256)
