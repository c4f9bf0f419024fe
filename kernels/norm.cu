// flashrt kernels: RMS normalisation (plan ops `RmsNorm` and `GatedRmsNorm`).
//
// Both normalise each `group` consecutive columns of a row independently; grid = (groups,
// rows), one block per (group, row), rows >= io.len exit. Each thread loads its elements
// (up to NORM_REGS of them, all loads issued before the first use, so a decode step's single
// row costs one memory latency rather than one per element), accumulates the sum of squares
// in f32, the block reduces it, and the thread writes its scaled outputs from registers.
// Groups longer than blockDim.x * NORM_REGS re-read their inputs in a second pass. A thread
// reads and writes only its own elements, so `out` may alias `x`.
//
// rms_norm:        out = x / sqrt(mean(x^2) + eps) * s,  s = w | 1 + w | 1
// gated_rms_norm:  norm-then-gate: out = w * rmsnorm(x) * silu(z)
//                  gate-then-norm: out = w * rmsnorm(x * silu(z))
//                  (w: `group` elements shared by all groups, or one per column of x)
//
// Memory traffic: per element, one read of x (and z), one write; norm weights are f32.
#include "common.cuh"

struct RmsNormParams {
    const void* x;
    void* out;
    const float* weight; // [group] or null (s = 1)
    const int* len;
    int ld_x;
    int ld_out;
    int group;
    int one_plus; // 1: s = 1 + w
    float eps;
};

// Elements per thread kept in registers: groups up to blockDim.x * NORM_REGS (8192 with the
// host's 1024-thread cap) are read once, with all loads of a thread issued back to back; a
// longer group falls back to re-reading its inputs.
#define NORM_REGS 8

template <typename T> static __device__ __forceinline__ void rms_norm_impl(const RmsNormParams& p) {
    __shared__ float scratch[32];
    const int row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    const T* x = static_cast<const T*>(p.x) + (size_t)row * p.ld_x + (size_t)blockIdx.x * p.group;
    T* out = static_cast<T*>(p.out) + (size_t)row * p.ld_out + (size_t)blockIdx.x * p.group;
    const int n = p.group, step = blockDim.x;
    auto scale = [&](int c) { return p.weight ? (p.one_plus ? 1.0f + p.weight[c] : p.weight[c]) : 1.0f; };
    if (n <= step * NORM_REGS) {
        float v[NORM_REGS], w[NORM_REGS];
        float ss = 0.0f;
#pragma unroll
        for (int e = 0; e < NORM_REGS; ++e) {
            const int c = threadIdx.x + e * step;
            v[e] = c < n ? flashrt::to_f32(x[c]) : 0.0f;
            w[e] = c < n ? scale(c) : 0.0f;
            ss += v[e] * v[e];
        }
        ss = flashrt::block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)n + p.eps);
#pragma unroll
        for (int e = 0; e < NORM_REGS; ++e) {
            const int c = threadIdx.x + e * step;
            if (c < n) out[c] = flashrt::from_f32<T>(v[e] * inv * w[e]);
        }
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < n; c += step) {
        const float v = flashrt::to_f32(x[c]);
        ss += v * v;
    }
    ss = flashrt::block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + p.eps);
    for (int c = threadIdx.x; c < n; c += step) out[c] = flashrt::from_f32<T>(flashrt::to_f32(x[c]) * inv * scale(c));
}

FLASHRT_ENTRY(rms_norm, RmsNormParams, 1024)

struct GatedRmsNormParams {
    const void* x;
    const void* gate;
    void* out;
    const float* weight; // [group] (shared) or [groups * group]
    const int* len;
    int ld_x;
    int ld_gate;
    int ld_out;
    int group;
    int shared_weight;
    int gate_then_norm;
    float eps;
};

template <typename T>
static __device__ __forceinline__ void gated_rms_norm_impl(const GatedRmsNormParams& p) {
    __shared__ float scratch[32];
    const int row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    const size_t col0 = (size_t)blockIdx.x * p.group;
    const T* x = static_cast<const T*>(p.x) + (size_t)row * p.ld_x + col0;
    const T* z = static_cast<const T*>(p.gate) + (size_t)row * p.ld_gate + col0;
    T* out = static_cast<T*>(p.out) + (size_t)row * p.ld_out + col0;
    const float* w = p.weight + (p.shared_weight ? 0 : col0);
    const int n = p.group, step = blockDim.x;
    // h = the value that is normalised; g = the factor applied after normalisation.
    auto load = [&](int c, float& h, float& g) {
        const float v = flashrt::to_f32(x[c]);
        const float s = flashrt::apply_act(flashrt::ACT_SILU, flashrt::to_f32(z[c]));
        if (p.gate_then_norm) {
            h = v * s;
            g = w[c];
        } else {
            h = v;
            g = w[c] * s;
        }
    };
    if (n <= step * NORM_REGS) {
        float h[NORM_REGS], g[NORM_REGS];
        float ss = 0.0f;
#pragma unroll
        for (int e = 0; e < NORM_REGS; ++e) {
            const int c = threadIdx.x + e * step;
            h[e] = 0.0f;
            g[e] = 0.0f;
            if (c < n) load(c, h[e], g[e]);
            ss += h[e] * h[e];
        }
        ss = flashrt::block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)n + p.eps);
#pragma unroll
        for (int e = 0; e < NORM_REGS; ++e) {
            const int c = threadIdx.x + e * step;
            if (c < n) out[c] = flashrt::from_f32<T>(h[e] * inv * g[e]);
        }
        return;
    }
    float ss = 0.0f;
    for (int c = threadIdx.x; c < n; c += step) {
        float hv, gv;
        load(c, hv, gv);
        ss += hv * hv;
    }
    ss = flashrt::block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)n + p.eps);
    for (int c = threadIdx.x; c < n; c += step) {
        float hv, gv;
        load(c, hv, gv);
        out[c] = flashrt::from_f32<T>(hv * inv * gv);
    }
}

FLASHRT_ENTRY(gated_rms_norm, GatedRmsNormParams, 1024)
