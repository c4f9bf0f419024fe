// flashrt kernels: the rotary embedding's arithmetic, shared by `rope` (rope.cu) and the fused
// per-head norm + rotation of `qk_prep` (norm_qk.cu), so that both compute every rotated
// element with the same instructions (the fused path is bit-identical to the separate
// launches; tests/cuda_model.rs checks it).
#pragma once
#include "common.cuh"

namespace flashrt {

// (cos, sin) of pair i's angle at `position`: inv_freq = 1 / theta^(2i / rotary_dims), angle =
// position * inv_freq, full-range sincosf (no fast-math), as transformers and the CPU reference.
static __device__ __forceinline__ float2 rope_cos_sin(float position, float theta, int i, int rotary_dims) {
    const float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)rotary_dims);
    float sf, cf;
    sincosf(position * inv_freq, &sf, &cf);
    return make_float2(cf, sf);
}

// The rotate-half pair (a = x[i], b = x[i + half]) by (cos, sin) `cs`: a cos - b sin and
// b cos + a sin, with the multiply-adds pinned (the form nvcc chose for rope.cu's plain
// expressions), so that no kernel's context can contract them another way.
static __device__ __forceinline__ float rope_first(float a, float b, float2 cs) {
    return __fmaf_rn(a, cs.x, -__fmul_rn(b, cs.y));
}
static __device__ __forceinline__ float rope_second(float a, float b, float2 cs) {
    return __fmaf_rn(b, cs.x, __fmul_rn(a, cs.y));
}

} // namespace flashrt
