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
//
// `rms_norm_vec` / `gated_rms_norm_vec`: the same math over 16-byte packs (N = 8 bf16/f16 or 4
// f32 elements), for views the host has proved aligned (addresses 16-byte aligned, strides and
// group multiples of N, weights 16-byte aligned). A group of group / N packs is owned by `tpg`
// threads, each holding up to NORM_VPT packs in registers (pack j of the group goes to thread
// j % tpg, slot j / tpg); `tpg` is a power of two <= 32 (several groups per warp, reduced with
// shuffles within aligned lane segments) or a multiple of 32 equal to blockDim.x (one group
// per block, reduced with `block_sum`). The grid flattens (row, group) over the bucket's
// rows. Every thread sums its own elements in slot order, then the fixed shuffle/block tree
// combines them: a row's result depends only on `group` (which fixes tpg), never on the
// number of rows. Wide norms (5120 columns: 160 threads of 4 packs) read everything at once,
// and per-head norms (256 columns: 8 threads of 4 packs, 16 heads per 128-thread block) stop
// spending a 64-thread block per head.
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

// ---- vector paths -------------------------------------------------------------------------

// Packs per thread in the vector kernels (the host picks tpg >= packs / NORM_VPT), and their
// block bound (512 leaves 128 registers for a gated thread's 4 x 8 normalised values and
// factors; groups up to 512 * 4 packs take the vector path).
#define NORM_VPT 4
#define NORM_VEC_THREADS 512

struct RmsNormVecParams {
    RmsNormParams n;
    int tpg;    // threads per group: a power of two <= 32, or blockDim.x (a multiple of 32, <= 512)
    int groups; // groups per row
};

struct GatedRmsNormVecParams {
    GatedRmsNormParams n;
    int tpg;
    int groups;
};

// Sum over the `tpg` threads of a group (see the header). Every thread of the block calls it.
static __device__ __forceinline__ float norm_group_sum(float v, int tpg, float* scratch) {
    if (tpg > 32) return flashrt::block_sum(v, scratch);
    for (int o = tpg >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// (row, group) of this thread's group and its index within the group.
struct NormSlot {
    int row, group, lane;
};

static __device__ __forceinline__ NormSlot norm_slot(int tpg, int groups) {
    const int gi = tpg > 32 ? (int)blockIdx.x : (int)((blockIdx.x * blockDim.x + threadIdx.x) / tpg);
    const int lane = tpg > 32 ? (int)threadIdx.x : (int)(threadIdx.x & (tpg - 1));
    return {gi / groups, gi % groups, lane};
}

// Eight (or four) f32 weights at an aligned address.
template <int N> static __device__ __forceinline__ void norm_load_w(const float* w, float (&f)[N]) {
#pragma unroll
    for (int e = 0; e < N; e += 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(w + e));
        f[e] = v.x;
        f[e + 1] = v.y;
        f[e + 2] = v.z;
        f[e + 3] = v.w;
    }
}

// A group's 1 / rms from each thread's packs `v` (slots past the group hold zeros): the thread
// sums its squares in slot order, then the group's threads combine them (`norm_group_sum`).
// Shared by `rms_norm_vec` and `qk_prep` (norm_qk.cu), which must agree bit for bit.
template <typename T>
static __device__ __forceinline__ float norm_vec_inv(const uint4 (&v)[NORM_VPT], int tpg, float* scratch, int group,
                                                     float eps) {
    constexpr int N = flashrt::Pack16<T>::N;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        float f[N];
        flashrt::unpack16<T>(v[k], f);
#pragma unroll
        for (int e = 0; e < N; ++e) ss += f[e] * f[e];
    }
    ss = norm_group_sum(ss, tpg, scratch);
    return 1.0f / sqrtf(ss / (float)group + eps);
}

// A pack normalised: x * inv * s, rounded to T.
template <typename T>
static __device__ __forceinline__ uint4 norm_vec_scale(uint4 v, float inv, const float (&w)[flashrt::Pack16<T>::N]) {
    constexpr int N = flashrt::Pack16<T>::N;
    float f[N];
    flashrt::unpack16<T>(v, f);
#pragma unroll
    for (int e = 0; e < N; ++e) f[e] = f[e] * inv * w[e];
    return flashrt::pack16<T>(f);
}

// Eight (or four) scale factors of an RMSNorm weight at an aligned address: w, or 1 + w.
template <int N> static __device__ __forceinline__ void norm_load_scale(const float* w, int one_plus, float (&f)[N]) {
    norm_load_w(w, f);
    if (one_plus) {
#pragma unroll
        for (int e = 0; e < N; ++e) f[e] = 1.0f + f[e];
    }
}

// A thread's packs of a group at `x` (pack j = lane + k * tpg, slot k; zeros past the group or
// where `valid` is false) and their scale factors (1 without a weight).
template <typename T>
static __device__ __forceinline__ void norm_vec_load(const T* x, const float* weight, int one_plus, int lane, int tpg,
                                                     int nvec, bool valid, uint4 (&v)[NORM_VPT],
                                                     float (&w)[NORM_VPT][flashrt::Pack16<T>::N]) {
    constexpr int N = flashrt::Pack16<T>::N;
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = lane + k * tpg;
        v[k] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < N; ++e) w[k][e] = 1.0f;
        if (valid && j < nvec) {
            v[k] = flashrt::ld16(x + (size_t)j * N);
            if (weight) norm_load_scale(weight + (size_t)j * N, one_plus, w[k]);
        }
    }
}

template <typename T> static __device__ __forceinline__ void rms_norm_vec_impl(const RmsNormVecParams& q) {
    constexpr int N = flashrt::Pack16<T>::N;
    __shared__ float scratch[32];
    const RmsNormParams& p = q.n;
    const NormSlot s = norm_slot(q.tpg, q.groups);
    const bool valid = s.row < flashrt::load_len(p.len);
    if (q.tpg > 32 && !valid) return; // the whole block is this group
    const int nvec = p.group / N;
    const size_t col0 = (size_t)s.group * p.group;
    const T* x = static_cast<const T*>(p.x) + (size_t)s.row * p.ld_x + col0;
    T* out = static_cast<T*>(p.out) + (size_t)s.row * p.ld_out + col0;
    uint4 v[NORM_VPT];
    float w[NORM_VPT][N];
    norm_vec_load<T>(x, p.weight, p.one_plus, s.lane, q.tpg, nvec, valid, v, w);
    const float inv = norm_vec_inv<T>(v, q.tpg, scratch, p.group, p.eps);
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = s.lane + k * q.tpg;
        if (valid && j < nvec) flashrt::st16(out + (size_t)j * N, norm_vec_scale<T>(v[k], inv, w[k]));
    }
}

FLASHRT_ENTRY(rms_norm_vec, RmsNormVecParams, NORM_VEC_THREADS)

template <typename T>
static __device__ __forceinline__ void gated_rms_norm_vec_impl(const GatedRmsNormVecParams& q) {
    constexpr int N = flashrt::Pack16<T>::N;
    __shared__ float scratch[32];
    const GatedRmsNormParams& p = q.n;
    const NormSlot s = norm_slot(q.tpg, q.groups);
    const bool valid = s.row < flashrt::load_len(p.len);
    if (q.tpg > 32 && !valid) return;
    const int nvec = p.group / N;
    const size_t col0 = (size_t)s.group * p.group;
    const T* x = static_cast<const T*>(p.x) + (size_t)s.row * p.ld_x + col0;
    const T* z = static_cast<const T*>(p.gate) + (size_t)s.row * p.ld_gate + col0;
    T* out = static_cast<T*>(p.out) + (size_t)s.row * p.ld_out + col0;
    const float* wt = p.weight + (p.shared_weight ? 0 : col0);
    uint4 xv[NORM_VPT], zv[NORM_VPT];
    float w[NORM_VPT][N];
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = s.lane + k * q.tpg;
        xv[k] = make_uint4(0, 0, 0, 0);
        zv[k] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int e = 0; e < N; ++e) w[k][e] = 0.0f;
        if (valid && j < nvec) {
            xv[k] = flashrt::ld16(x + (size_t)j * N);
            zv[k] = flashrt::ld16(z + (size_t)j * N);
            norm_load_w(wt + (size_t)j * N, w[k]);
        }
    }
    // h = the value that is normalised; g = the factor applied after normalisation (as the
    // scalar kernel); unused slots hold h = 0.
    float h[NORM_VPT][N], g[NORM_VPT][N];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        float xf[N], zf[N];
        flashrt::unpack16<T>(xv[k], xf);
        flashrt::unpack16<T>(zv[k], zf);
#pragma unroll
        for (int e = 0; e < N; ++e) {
            const float sz = flashrt::apply_act(flashrt::ACT_SILU, zf[e]);
            if (p.gate_then_norm) {
                h[k][e] = xf[e] * sz;
                g[k][e] = w[k][e];
            } else {
                h[k][e] = xf[e];
                g[k][e] = w[k][e] * sz;
            }
            ss += h[k][e] * h[k][e];
        }
    }
    ss = norm_group_sum(ss, q.tpg, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)p.group + p.eps);
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = s.lane + k * q.tpg;
        if (valid && j < nvec) {
            float o[N];
#pragma unroll
            for (int e = 0; e < N; ++e) o[e] = h[k][e] * inv * g[k][e];
            flashrt::st16(out + (size_t)j * N, flashrt::pack16<T>(o));
        }
    }
}

FLASHRT_ENTRY(gated_rms_norm_vec, GatedRmsNormVecParams, NORM_VEC_THREADS)
