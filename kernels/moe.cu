// flashrt kernels: sparse mixture-of-experts MLP (plan op `Moe`), launches that never leave
// the device, so a captured graph replays them at any position and routing:
//
//   moe_logits   router logits (f32 weights), tiles of 8 rows x 4 experts per block
//                (prefill plans: moe_x_f32, then a TF32 cuBLASLt matmul, see ops/moe.rs)
//   moe_route    per row: scores, choice, top-k, weights (small phases without
//                moe_up_routed*: and the plan)
//   moe_hist, moe_plan2  the (row, rank) pairs grouped by expert, the active experts and the
//                prefill GEMMs' tiles, over many blocks (small phases: in moe_route or
//                moe_up_routed*)
//   moe_up       per active expert: act(gate x) * (up x) (SwiGLU) or relu(up x)^2 for its pairs
//   moe_down     per active expert: y = down h for its pairs
//   moe_combine  per row: out += sum_j w_j y_j, ranks in order (best first)
//
// Small phases (decode, verify, batched steps) route, plan and project in the up launch and
// combine in the down launch: kernels/moe_small.cu. Prefill plans' grouped tensor-core GEMMs:
// kernels/moe_wgmma.cu.
//
// Routing follows flashrt_ir::RouteIr exactly as the CPU reference does (softmax over all
// experts or sigmoid; a selection-only bias; group-limited choice by each group's two best
// scores; top-k with ties to the lower index; weights from the unbiased scores, renormalised
// with `renorm_eps`, scaled). Experts read only their own weights, once per tile of pairs, so a
// decode step streams the chosen experts and nothing else. Every pair's dot products are
// computed by the same code whatever other pairs share its expert, and the combine sums the
// ranks in a fixed order: a row's result does not depend on the chunk it is in (the
// restore-at-any-boundary guarantee).
//
// Scratch: `tmp` row r (the op's scratch view, T elements) holds hidden(r, j) [inter] for
// j < k, then y(r, j) [hidden], then ids i32[k], weights f32[k] and the router logits
// f32[E]. `plan` (in the session's
// cuBLASLt workspace, free between matmuls) holds offsets[E + 1], active[E], n_active,
// pairs[rows * k], n_tiles, the tile list and moe_hist's per-block counts.
#include "common.cuh"

#define MOE_MAX_E 1024
#define MOE_MAX_H 8192
#define MOE_MAX_K 32
#define MOE_TILE 8

struct MoeParams {
    const void* x;       // [rows, ld_x] T: the block's (normed) input
    const float* router; // [E, H]
    const float* bias;   // [E] or null
    const void* up;      // [E, up_rows * inter, H] T
    const void* down;    // [E, H, inter] T
    void* out;           // [rows, ld_out] T, accumulated
    void* tmp;           // [rows, ld_tmp] T
    int* plan;
    const int* len;
    int ld_x;
    int ld_out;
    int ld_tmp;
    int hidden;
    int inter;
    int experts;
    int top_k;
    int softmax;     // 1: softmax over all experts, 0: sigmoid
    int renormalize;
    float renorm_eps;
    float scaling;
    int groups;
    int top_groups;
    int swiglu;      // 1: SwiGLU experts (gate rows then up rows), 0: relu^2
    int max_pairs;   // the plan's rows * k (sizes the pair list)
    int small;       // decode / verify (<= 8 rows): moe_route (when launched) also plans; moe_down_small combines
    int tile_m;      // pairs per prefill tile (moe_plan2): MOE_MM_M when 0, 128 for moe_*_w2
    // Small phases only: the block's neighbouring ops fused into its launches (null / 0 when
    // not). The RMSNorm before the block: moe_logits reads `norm_x`, normalises it (weights
    // `norm_w`, 1 + w with `one_plus`, rounded to T as the separate op stores it) and block
    // (0, y) stores the result to `x` for the later launches. The shared expert: its token
    // gate (x . s_gate, rounded to T) is one more router output, at `s_gate_out`; moe_up runs
    // it as one more expert over every row into `s_h` (gated by sigmoid of that logit), and
    // moe_down_small adds its down projection after the routed ranks.
    const void* norm_x;
    const float* norm_w;
    const void* s_gate;   // [hidden] T or null
    void* s_gate_out;     // [rows, ld_s_gate_out] T
    const void* s_up;     // [s_inter, hidden] T: gate rows (SwiGLU) or up rows
    const void* s_up2;    // [s_inter, hidden] T: up rows (SwiGLU) or null
    const void* s_down;   // [hidden, s_inter] T
    void* s_h;            // [rows, ld_s_h] T
    int ld_norm_x;
    int one_plus;
    float eps;
    int ld_s_gate_out;
    int ld_s_h;
    int s_inter;
    int shared;           // 1: the shared expert is fused (s_up, s_down, s_h set)
    int pad2_;
    // Small phases' routed up launches: the next matmul's weights, asked of the L2 before the
    // PDL wait (`prefetch_l2_share`; null / 0: none). The experts' weights stream past the L2
    // evict-first (ld16_evict_first) so those lines stay.
    const void* next_w;
    unsigned long long next_bytes;
};

namespace moe {

template <typename T> static __device__ __forceinline__ T* hidden_of(const MoeParams& p, int r, int j) {
    return static_cast<T*>(p.tmp) + (size_t)r * p.ld_tmp + (size_t)j * p.inter;
}
template <typename T> static __device__ __forceinline__ T* y_of(const MoeParams& p, int r, int j) {
    return static_cast<T*>(p.tmp) + (size_t)r * p.ld_tmp + (size_t)p.top_k * p.inter + (size_t)j * p.hidden;
}
template <typename T> static __device__ __forceinline__ int* ids_of(const MoeParams& p, int r) {
    return reinterpret_cast<int*>(static_cast<T*>(p.tmp) + (size_t)r * p.ld_tmp +
                                  (size_t)p.top_k * (p.inter + p.hidden));
}
template <typename T> static __device__ __forceinline__ float* weights_of(const MoeParams& p, int r) {
    return reinterpret_cast<float*>(ids_of<T>(p, r) + p.top_k);
}
template <typename T> static __device__ __forceinline__ float* logits_of(const MoeParams& p, int r) {
    return weights_of<T>(p, r) + p.top_k;
}

// plan layout
static __device__ __forceinline__ int* offsets(const MoeParams& p) { return p.plan; }
static __device__ __forceinline__ int* active(const MoeParams& p) { return p.plan + p.experts + 1; }
static __device__ __forceinline__ int* n_active(const MoeParams& p) { return p.plan + 2 * p.experts + 1; }
static __device__ __forceinline__ int* pairs(const MoeParams& p) { return p.plan + 2 * p.experts + 2; }

// (value, index) of the best lane: larger value, ties to the lower index; NaN never wins.
static __device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) {
            v = ov;
            i = oi;
        }
    }
}

static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

} // namespace moe

// Dot products of up to MOE_TILE input rows (`k` elements each, 16-byte packs, at `xr[q]`) with W
// weight rows (W = 2: SwiGLU's gate and up rows together): lane-strided packs, each lane's in
// increasing order, loaded MOE_BATCH / W at a time per weight row so a decode step keeps
// MOE_BATCH loads in flight per lane; then warp sums. acc[w * ROWS + q]: weight row w, input
// row q; every lane returns the totals.
#define MOE_BATCH 8
// B: packs loaded per weight row at a time (how many are in flight, not the sums' order).
template <typename T, int ROWS, int W = 1, int B = MOE_BATCH / W>
static __device__ __forceinline__ void tile_dots_at(const T* const (&w)[W], const T* const (&xr)[ROWS], int k, int n,
                                                    float* acc) {
    constexpr int N = flashrt::Pack16<T>::N;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < W * ROWS; ++q) acc[q] = 0.0f;
    for (int c0 = lane * N; c0 < k; c0 += B * 32 * N) {
        uint4 wp[W][B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int c = c0 + b * 32 * N;
#pragma unroll
            for (int v = 0; v < W; ++v) wp[v][b] = c < k ? flashrt::ld16_evict_first(w[v] + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const int c = c0 + b * 32 * N;
            if (c >= k) break;
#pragma unroll
            for (int q = 0; q < ROWS; ++q) {
                if (q >= n) break;
                float xv[N];
                flashrt::unpack16<T>(flashrt::ld16(xr[q] + c), xv);
#pragma unroll
                for (int v = 0; v < W; ++v) {
                    float wv[N];
                    flashrt::unpack16<T>(wp[v][b], wv);
#pragma unroll
                    for (int e = 0; e < N; ++e) acc[v * ROWS + q] += wv[e] * xv[e];
                }
            }
        }
    }
#pragma unroll
    for (int q = 0; q < W * ROWS; ++q) acc[q] = flashrt::warp_sum(acc[q]);
}

// tile_dots_at over rows stored one after another from `xs`.
template <typename T, int ROWS, int W = 1>
static __device__ __forceinline__ void tile_dots(const T* const (&w)[W], const T* xs, int k, int n, float* acc) {
    const T* xr[ROWS];
#pragma unroll
    for (int q = 0; q < ROWS; ++q) xr[q] = xs + (size_t)q * k;
    tile_dots_at<T, ROWS, W>(w, xr, k, n, acc);
}

#define MOE_LOGIT_ROWS 8
#define MOE_LOGIT_WARPS 4
#define MOE_LOGIT_BATCH 16

// Before the predecessor is done: the part of this warp's router row past the packs
// moe_logits_impl preloads (or the token gate row) into L2.
template <typename T> static __device__ __forceinline__ void moe_logits_prefetch(const MoeParams& p) {
    const int lane = threadIdx.x & 31;
    const int e = blockIdx.x * MOE_LOGIT_WARPS + (threadIdx.x >> 5);
    const char* row = nullptr;
    size_t from = 0, bytes = 0;
    if (e < p.experts) {
        row = reinterpret_cast<const char*>(p.router + (size_t)e * p.hidden);
        bytes = (size_t)p.hidden * 4;
        from = MOE_LOGIT_BATCH * 32 * 16;
    } else if (e == p.experts && p.s_gate) {
        row = static_cast<const char*>(p.s_gate);
        bytes = (size_t)p.hidden * sizeof(T);
    }
    for (size_t off = from + (size_t)lane * 128; off < bytes; off += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + off));
}

// grid = (ceil((E + token gate) / 4), ceil(rows / 8)), block = 128, dynamic shared memory
// 8 * hidden T: the block's rows of x in shared memory, warp w computes expert 4 * bx + w for
// them, reading its router row once (decode's router is a 2 MB f32 read spread over E / 4
// blocks). Each logit is the same lane-strided f32 sum whatever rows share the block. Before
// the PDL wait (weights only), each warp loads the first MOE_LOGIT_BATCH packs a lane of its
// router row into registers (all of it up to hidden 2048) and asks the L2 for the rest, and
// each thread loads the norm weights of its first two packs, so that once the predecessor is
// done only x's trip and the arithmetic remain.
template <typename T> static __device__ __forceinline__ void moe_logits_impl(const MoeParams& p) {
    extern __shared__ __align__(16) unsigned char logit_smem[];
    T* xs = reinterpret_cast<T*>(logit_smem);
    __shared__ float inv[MOE_LOGIT_ROWS];
    constexpr int N = flashrt::Pack16<T>::N;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, H = p.hidden;
    const int e = blockIdx.x * MOE_LOGIT_WARPS + warp;
    const float4* w = e < p.experts ? reinterpret_cast<const float4*>(p.router + (size_t)e * H) : nullptr;
    float4 w0[MOE_LOGIT_BATCH];
#pragma unroll
    for (int b = 0; b < MOE_LOGIT_BATCH; ++b) {
        const int i = lane + b * 32;
        w0[b] = w && i < H / 4 ? __ldg(w + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    moe_logits_prefetch<T>(p);
    // The norm's scale of element j of the pack at i (f32; 1 + w with `one_plus`).
    auto norm_scale = [&](int col, int j) {
        float s = p.norm_w ? __ldg(p.norm_w + col + j) : 1.0f;
        if (p.norm_w && p.one_plus) s += 1.0f;
        return s;
    };
    float nw[2][N];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int col = ((threadIdx.x + t * blockDim.x) % (H / N)) * N;
#pragma unroll
        for (int j = 0; j < N; ++j) nw[t][j] = p.norm_x ? norm_scale(col, j) : 1.0f;
    }
    const int len = flashrt::load_len(p.len); // before the wait: common.cuh
    flashrt::pdl_enter();
    const int r0 = blockIdx.y * MOE_LOGIT_ROWS;
    if (r0 >= len) return;
    const int n = min(MOE_LOGIT_ROWS, len - r0);
    FLASHRT_MARK(0);
    const T* src = static_cast<const T*>(p.norm_x ? p.norm_x : p.x);
    const int ld_src = p.norm_x ? p.ld_norm_x : p.ld_x;
    for (int i = threadIdx.x; i < n * (H / N); i += blockDim.x) {
        const int q = i / (H / N), col = (i % (H / N)) * N;
        flashrt::st16(xs + (size_t)q * H + col, flashrt::ld16(src + (size_t)(r0 + q) * ld_src + col));
    }
    __syncthreads();
    FLASHRT_MARK(1);
    if (p.norm_x) {
        // The fused RMSNorm: a warp per row sums the squares (lane-strided packs, then the warp
        // reduction), every element is scaled and rounded in place, block (0, y) stores the
        // rows for the launches after this one.
        for (int q = warp; q < n; q += MOE_LOGIT_WARPS) {
            float ss = 0.0f;
            for (int c = lane * N; c < H; c += 32 * N) {
                float v[N];
                flashrt::unpack16<T>(flashrt::ld16(xs + (size_t)q * H + c), v);
#pragma unroll
                for (int j = 0; j < N; ++j) ss = fmaf(v[j], v[j], ss);
            }
            ss = flashrt::warp_sum(ss);
            if (lane == 0) inv[q] = 1.0f / sqrtf(ss / (float)H + p.eps);
        }
        __syncthreads();
        auto scale_pack = [&](int i, const float* s) {
            const int q = i / (H / N), col = (i % (H / N)) * N;
            T* px = xs + (size_t)q * H + col;
            float v[N];
            flashrt::unpack16<T>(flashrt::ld16(px), v);
#pragma unroll
            for (int j = 0; j < N; ++j) px[j] = flashrt::from_f32<T>(v[j] * inv[q] * s[j]);
        };
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const int i = threadIdx.x + t * blockDim.x;
            if (i < n * (H / N)) scale_pack(i, nw[t]);
        }
        for (int i = threadIdx.x + 2 * blockDim.x; i < n * (H / N); i += blockDim.x) {
            const int col = (i % (H / N)) * N;
            float s[N];
#pragma unroll
            for (int j = 0; j < N; ++j) s[j] = norm_scale(col, j);
            scale_pack(i, s);
        }
        __syncthreads();
        if (blockIdx.x == 0)
            for (int i = threadIdx.x; i < n * (H / N); i += blockDim.x) {
                const int q = i / (H / N), col = (i % (H / N)) * N;
                flashrt::st16(static_cast<T*>(const_cast<void*>(p.x)) + (size_t)(r0 + q) * p.ld_x + col,
                              flashrt::ld16(xs + (size_t)q * H + col));
            }
    }
    FLASHRT_MARK(2);
    if (e == p.experts && p.s_gate) {
        // The shared expert's token gate: one T weight row.
        float acc[MOE_LOGIT_ROWS];
        const T* const gw[1] = {static_cast<const T*>(p.s_gate)};
        tile_dots<T, MOE_LOGIT_ROWS>(gw, xs, H, n, acc);
#pragma unroll
        for (int q = 0; q < MOE_LOGIT_ROWS; ++q) {
            if (q >= n) break;
            const float v = acc[q];
            if (lane == 0) static_cast<T*>(p.s_gate_out)[(size_t)(r0 + q) * p.ld_s_gate_out] = flashrt::from_f32<T>(v);
        }
        FLASHRT_MARK(6);
        return;
    }
    if (e >= p.experts) return;
    float acc[MOE_LOGIT_ROWS];
#pragma unroll
    for (int q = 0; q < MOE_LOGIT_ROWS; ++q) acc[q] = 0.0f;
    // MOE_LOGIT_BATCH float4 packs a lane at a time (the first batch preloaded); each lane sums
    // its packs in order.
    auto dots = [&](const float4 (&wv)[MOE_LOGIT_BATCH], int i0) {
#pragma unroll
        for (int b = 0; b < MOE_LOGIT_BATCH; ++b) {
            const int i = i0 + b * 32;
            if (i >= H / 4) break;
            const float4 v = wv[b];
#pragma unroll
            for (int q = 0; q < MOE_LOGIT_ROWS; ++q) {
                if (q >= n) break;
                const T* x = xs + (size_t)q * H + 4 * i;
                acc[q] += v.x * flashrt::to_f32(x[0]) + v.y * flashrt::to_f32(x[1]) +
                          v.z * flashrt::to_f32(x[2]) + v.w * flashrt::to_f32(x[3]);
            }
        }
    };
    dots(w0, lane);
    for (int i0 = lane + MOE_LOGIT_BATCH * 32; i0 < H / 4; i0 += MOE_LOGIT_BATCH * 32) {
        float4 wv[MOE_LOGIT_BATCH];
#pragma unroll
        for (int b = 0; b < MOE_LOGIT_BATCH; ++b) {
            const int i = i0 + b * 32;
            wv[b] = i < H / 4 ? __ldg(w + i) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
        dots(wv, i0);
    }
#pragma unroll
    for (int q = 0; q < MOE_LOGIT_ROWS; ++q) {
        if (q >= n) break;
        const float v = flashrt::warp_sum(acc[q]);
        if (lane == 0) moe::logits_of<T>(p, r0 + q)[e] = v;
    }
    FLASHRT_MARK(6);
}

FLASHRT_ENTRY_SELF(moe_logits, MoeParams, 128)

// grid = (ceil(hidden / 1024), rows), block = 256: row r of x widened to f32 in its `y` scratch
// (the input of the prefill router's TF32 matmul), four values per thread.
template <typename T> static __device__ __forceinline__ void moe_x_f32_impl(const MoeParams& p) {
    const int row = blockIdx.y;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (row >= flashrt::load_len(p.len) || c >= p.hidden) return;
    const T* x = static_cast<const T*>(p.x) + (size_t)row * p.ld_x + c;
    float4 v;
    v.x = flashrt::to_f32(x[0]);
    v.y = flashrt::to_f32(x[1]);
    v.z = flashrt::to_f32(x[2]);
    v.w = flashrt::to_f32(x[3]);
    *reinterpret_cast<float4*>(reinterpret_cast<float*>(moe::y_of<T>(p, row, 0)) + c) = v;
}

FLASHRT_ENTRY(moe_x_f32, MoeParams, 256)

// A routing candidate as one 64-bit key whose unsigned order is the routing order: the value
// (f32 bits mapped to an order-preserving unsigned, -0 as +0, NaN below -inf) above, the
// complement of the expert index below (a tie goes to the lower index). Keys are distinct.
static __device__ __forceinline__ unsigned long long route_key(float v, int e) {
    if (v == 0.0f) v = 0.0f;
    const unsigned u = __float_as_uint(v);
    const unsigned hi = isnan(v) ? 0u : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)hi << 32) | (0xffffffffu - (unsigned)e);
}
static __device__ __forceinline__ int route_key_index(unsigned long long k) {
    return (int)(0xffffffffu - (unsigned)k);
}
// Larger key first.
static __device__ __forceinline__ void key_order(unsigned long long& a, unsigned long long& b) {
    const unsigned long long lo = a < b ? a : b;
    a = a < b ? b : a;
    b = lo;
}

// The best ROUTE_LANE (value, index) candidates of a warp's 32 * ROUTE_LANE, best first, in every
// lane: each lane sorts its own (a 19-comparator network), then five butterfly rounds each keep
// the best ROUTE_LANE of a lane's list and its partner's (the larger of a[j] and b[7 - j] is a
// bitonic sequence holding them, sorted by three half-cleaner stages). Comparisons only, so the
// choice is the one K rounds of "best remaining, ties to the lower index" make.
#define ROUTE_LANE 8
static __device__ __forceinline__ void warp_top8(unsigned long long (&k)[ROUTE_LANE]) {
    constexpr int net[19][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6}, {3, 7}, {0, 1}, {2, 3},
                                {4, 5}, {6, 7}, {2, 4}, {3, 5}, {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};
#pragma unroll
    for (int c = 0; c < 19; ++c) key_order(k[net[c][0]], k[net[c][1]]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long b[ROUTE_LANE];
#pragma unroll
        for (int j = 0; j < ROUTE_LANE; ++j) b[j] = __shfl_xor_sync(0xffffffffu, k[j], o);
#pragma unroll
        for (int j = 0; j < ROUTE_LANE; ++j) k[j] = k[j] < b[ROUTE_LANE - 1 - j] ? b[ROUTE_LANE - 1 - j] : k[j];
#pragma unroll
        for (int d = ROUTE_LANE / 2; d > 0; d >>= 1)
#pragma unroll
            for (int j = 0; j < ROUTE_LANE; ++j)
                if (!(j & d)) key_order(k[j], k[j + d]);
    }
}

// One row's routing by one warp into `ids` / `wts` (K each, global or shared memory);
// `score`, `choice`: E floats of shared memory, `keep`: 32. Lane j holds rank j until the end.
// E <= 256 and K <= 8 (every released MoE model so far): the row's values in registers (lane
// holds e = lane + 32 m, the sums in the same order as the general path) and warp_top8;
// otherwise K rounds of a warp arg-max over the lanes' best.
template <typename T>
static __device__ __forceinline__ void route_row(const MoeParams& p, int row, float* score, float* choice, int* keep,
                                                 int* ids, float* wts) {
    const int E = p.experts, K = p.top_k;
    const int lane = threadIdx.x & 31;
    const float* logits = moe::logits_of<T>(p, row);
    const bool fast = E <= 32 * ROUTE_LANE && K <= ROUTE_LANE;
    if (fast) {
        float v[ROUTE_LANE];
#pragma unroll
        for (int m = 0; m < ROUTE_LANE; ++m) v[m] = lane + 32 * m < E ? logits[lane + 32 * m] : 0.0f;
        if (p.softmax) {
            float mx = -INFINITY;
#pragma unroll
            for (int m = 0; m < ROUTE_LANE; ++m)
                if (lane + 32 * m < E) mx = fmaxf(mx, v[m]);
            mx = moe::warp_max(mx);
            float sum = 0.0f;
#pragma unroll
            for (int m = 0; m < ROUTE_LANE; ++m)
                if (lane + 32 * m < E) {
                    v[m] = expf(v[m] - mx);
                    sum += v[m];
                }
            sum = flashrt::warp_sum(sum);
#pragma unroll
            for (int m = 0; m < ROUTE_LANE; ++m) v[m] /= sum;
        } else {
#pragma unroll
            for (int m = 0; m < ROUTE_LANE; ++m) v[m] = flashrt::sigmoidf_(v[m]);
        }
#pragma unroll
        for (int m = 0; m < ROUTE_LANE; ++m) {
            const int e = lane + 32 * m;
            if (e < E) {
                score[e] = v[m];
                choice[e] = v[m] + (p.bias ? p.bias[e] : 0.0f);
            }
        }
    } else {
        for (int e = lane; e < E; e += 32) score[e] = logits[e];
        __syncwarp();
        if (p.softmax) {
            float m = -INFINITY;
            for (int e = lane; e < E; e += 32) m = fmaxf(m, score[e]);
            m = moe::warp_max(m);
            float sum = 0.0f;
            for (int e = lane; e < E; e += 32) {
                const float v = expf(score[e] - m);
                score[e] = v;
                sum += v;
            }
            sum = flashrt::warp_sum(sum);
            for (int e = lane; e < E; e += 32) score[e] /= sum;
        } else {
            for (int e = lane; e < E; e += 32) score[e] = flashrt::sigmoidf_(score[e]);
        }
        for (int e = lane; e < E; e += 32) choice[e] = score[e] + (p.bias ? p.bias[e] : 0.0f);
    }
    __syncwarp();
    FLASHRT_MARK(3);
    if (p.groups > 1 && p.top_groups < p.groups) {
        const int per = E / p.groups;
        float gs = NAN; // lanes past the groups never win
        if (lane < p.groups) {
            float a = -INFINITY, b = -INFINITY;
            for (int e = lane * per; e < (lane + 1) * per; ++e) {
                const float v = choice[e];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            gs = a + b;
        }
        keep[lane] = 0;
        for (int t = 0; t < p.top_groups; ++t) {
            float v = gs;
            int i = lane;
            moe::warp_best(v, i);
            if (lane == i) {
                keep[lane] = 1;
                gs = NAN;
            }
        }
        __syncwarp();
        for (int e = lane; e < E; e += 32)
            if (!keep[e / per]) choice[e] = -INFINITY;
        __syncwarp();
    }
    int my_id = 0;
    float my_w = 0.0f;
    if (fast) {
        unsigned long long k[ROUTE_LANE];
#pragma unroll
        for (int m = 0; m < ROUTE_LANE; ++m) {
            const int e = lane + 32 * m;
            k[m] = e < E ? route_key(choice[e], e) : 0ull; // padding: below every candidate
        }
        warp_top8(k);
#pragma unroll
        for (int j = 0; j < ROUTE_LANE; ++j)
            if (lane == j) my_id = route_key_index(k[j]);
        if (lane < K) my_w = score[my_id];
    } else {
        // Top-k: each lane keeps the best of its own experts (e = lane + 32 m: larger value, ties
        // to the lower index, taken experts are NaN and never win); a round takes the warp's best
        // of those, and only the lane owning the winner marks it taken and scans its experts again.
        float lv;
        int li;
        auto lane_best = [&]() {
            lv = NAN;
            li = 0x7fffffff;
            for (int e = lane; e < E; e += 32) {
                const float c = choice[e];
                if (!isnan(c) && (isnan(lv) || c > lv)) {
                    lv = c;
                    li = e;
                }
            }
            if (isnan(lv)) lv = -INFINITY; // an empty lane loses to any candidate
        };
        lane_best();
        for (int j = 0; j < K; ++j) {
            float v = lv;
            int i = li;
            moe::warp_best(v, i); // every lane gets the winner
            if (lane == j) {
                my_id = i;
                my_w = score[i];
            }
            if (i < E && (i & 31) == lane) {
                choice[i] = NAN;
                lane_best();
            }
        }
    }
    FLASHRT_MARK(5);
    // The weights in rank order: the sum in that order (every lane), each divided by it.
    if (p.renormalize) {
        float sum = 0.0f;
        for (int j = 0; j < K; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);
        my_w /= sum + p.renorm_eps;
    }
    if (p.scaling != 1.0f) my_w *= p.scaling;
    if (lane < K) {
        ids[lane] = my_id;
        wts[lane] = my_w;
    }
}

template <typename T> static __device__ __forceinline__ void plan_block(const MoeParams& p);

// grid = ceil(rows / 8), block = 256: warp w routes row 8 * bx + w; dynamic shared memory
// 8 * 2 * E floats. With `small` (one block, E <= 256) the block then plans the pairs too.
template <typename T> static __device__ __forceinline__ void moe_route_impl(const MoeParams& p) {
    extern __shared__ float route_smem[];
    __shared__ int keep[8][32];
    const int warp = threadIdx.x >> 5;
    const int row = blockIdx.x * 8 + warp;
    float* score = route_smem + (size_t)warp * 2 * p.experts;
    if (row < flashrt::load_len(p.len))
        route_row<T>(p, row, score, score + p.experts, keep[warp], moe::ids_of<T>(p, row), moe::weights_of<T>(p, row));
    if (p.small) {
        __syncthreads();
        __threadfence_block();
        plan_block<T>(p);
    }
}

FLASHRT_ENTRY(moe_route, MoeParams, 256)


// grid = 1, block = 1024 (>= E): pairs (row * k + rank) grouped by expert. Offsets and the
// active list are block-wide prefix sums; a pair's place inside its expert's range is taken
// with an atomic (every pair's arithmetic is the same wherever it lands).
template <typename T> static __device__ __forceinline__ void plan_block(const MoeParams& p) {
    __shared__ int cnt[MOE_MAX_E];
    __shared__ int sc[MOE_MAX_E];
    __shared__ int sa[MOE_MAX_E];
    const int E = p.experts, K = p.top_k, n = flashrt::load_len(p.len) * K;
    const int e = threadIdx.x;
    if (e < E) cnt[e] = 0;
    __syncthreads();
    for (int q = threadIdx.x; q < n; q += blockDim.x) atomicAdd(&cnt[moe::ids_of<T>(p, q / K)[q % K]], 1);
    __syncthreads();
    const int c = e < E ? cnt[e] : 0;
    if (e < E) {
        sc[e] = c;
        sa[e] = c > 0;
    }
    __syncthreads();
    for (int off = 1; off < E; off <<= 1) {
        int vc = 0, va = 0;
        if (e < E && e >= off) {
            vc = sc[e - off];
            va = sa[e - off];
        }
        __syncthreads();
        if (e < E) {
            sc[e] += vc;
            sa[e] += va;
        }
        __syncthreads();
    }
    int* off = moe::offsets(p);
    if (e < E) {
        off[e] = sc[e] - c;
        cnt[e] = sc[e] - c; // the expert's cursor
        if (c > 0) moe::active(p)[sa[e] - 1] = e;
        if (e == E - 1) {
            off[E] = sc[e];
            *moe::n_active(p) = sa[e];
        }
    }
    __syncthreads();
    for (int q = threadIdx.x; q < n; q += blockDim.x) {
        const int slot = atomicAdd(&cnt[moe::ids_of<T>(p, q / K)[q % K]], 1);
        moe::pairs(p)[slot] = q;
    }
}


// One warp's share of an up tile: feature `c` of weight rows `wg` / `wu` (SwiGLU's gate and up
// rows; else the up row twice) over the tile's n <= MOE_TILE input rows `xr`, the activation of
// tile row q stored at `out_of(q)[c]` (the shared expert, `sh`: gated by the sigmoid of row
// `row_of(q)`'s token-gate logit).
// ROWS: the tile's capacity (MOE_TILE; 1 where every tile has one row, loading B packs per
// weight row at a time).
template <typename T, int ROWS = MOE_TILE, int B = MOE_BATCH / 2, typename RowOf, typename OutOf>
static __device__ __forceinline__ void up_tile(const MoeParams& p, bool sh, int c, const T* wg, const T* wu,
                                               const T* const (&xr)[ROWS], int n, RowOf row_of, OutOf out_of) {
    const int lane = threadIdx.x & 31;
    float gu[2 * ROWS];
    if (p.swiglu) {
        const T* const wr[2] = {wg, wu};
        tile_dots_at<T, ROWS, 2, B>(wr, xr, p.hidden, n, gu);
    } else {
        const T* const wr[1] = {wg};
        tile_dots_at<T, ROWS, 1, 2 * B>(wr, xr, p.hidden, n, gu);
    }
    const float* g = gu;
    const float* u = gu + ROWS;
    if (lane != 0) return;
    for (int q = 0; q < n; ++q) {
        float h;
        if (p.swiglu) {
            // Gate and up rounded to T first, as the dense MLP's separate ops store them.
            const float gr = flashrt::to_f32(flashrt::from_f32<T>(g[q]));
            const float ur = flashrt::to_f32(flashrt::from_f32<T>(u[q]));
            h = flashrt::apply_act(flashrt::ACT_SILU, gr) * ur;
        } else {
            h = flashrt::apply_act(flashrt::ACT_RELU2, flashrt::to_f32(flashrt::from_f32<T>(g[q])));
        }
        if (sh && p.s_gate) {
            // The token gate scales the rounded activation, as the separate row-gate multiply
            // does.
            const float tg = flashrt::to_f32(static_cast<const T*>(p.s_gate_out)[(size_t)row_of(q) * p.ld_s_gate_out]);
            h = flashrt::sigmoidf_(tg) * flashrt::to_f32(flashrt::from_f32<T>(h));
        }
        out_of(q)[c] = flashrt::from_f32<T>(h);
    }
}

// Weight rows of feature `c` (clamped into range) of expert `e` or the shared expert (`sh`).
template <typename T>
static __device__ __forceinline__ void up_rows(const MoeParams& p, bool sh, int e, int c, const T*& wg, const T*& wu) {
    const int H = p.hidden, I = sh ? p.s_inter : p.inter;
    const int cc = c < I ? c : 0;
    if (sh) {
        wg = static_cast<const T*>(p.s_up) + (size_t)cc * H;
        wu = p.swiglu ? static_cast<const T*>(p.s_up2) + (size_t)cc * H : wg;
    } else {
        const int up_rows = p.swiglu ? 2 * I : I;
        const T* base = static_cast<const T*>(p.up) + (size_t)e * up_rows * H;
        wg = base + (size_t)cc * H;                       // gate row (SwiGLU) or the up row
        wu = p.swiglu ? base + (size_t)(I + cc) * H : wg; // up row (SwiGLU only)
    }
}

// grid = (ceil(max(inter, s_inter) / 8), min(E, rows * k) + shared), block = 256 (a warp per
// feature); dynamic shared memory MOE_TILE * hidden * sizeof(T). With `shared`, the last
// blockIdx.y is the shared expert over every row (rows <= MOE_TILE: small phases only).
template <typename T> static __device__ __forceinline__ void moe_up_impl(const MoeParams& p) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* xs = reinterpret_cast<T*>(smem);
    const bool sh = p.shared && blockIdx.y == gridDim.y - 1;
    if (!sh && (int)blockIdx.y >= *moe::n_active(p)) return;
    const int e = sh ? 0 : moe::active(p)[blockIdx.y];
    const int lo = sh ? 0 : moe::offsets(p)[e];
    const int hi = sh ? flashrt::load_len(p.len) : moe::offsets(p)[e + 1];
    const int H = p.hidden, I = sh ? p.s_inter : p.inter, K = p.top_k;
    const int c = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const T* wg;
    const T* wu;
    up_rows<T>(p, sh, e, c, wg, wu);
    const T* xr[MOE_TILE];
#pragma unroll
    for (int q = 0; q < MOE_TILE; ++q) xr[q] = xs + (size_t)q * H;
    constexpr int N = flashrt::Pack16<T>::N;
    for (int t = lo; t < hi; t += MOE_TILE) {
        const int n = min(MOE_TILE, hi - t);
        // Pair q of the tile: its input row and where its activation goes.
        auto row_of = [&](int q) { return sh ? t + q : moe::pairs(p)[t + q] / K; };
        auto out_of = [&](int q) -> T* {
            if (sh) return static_cast<T*>(p.s_h) + (size_t)(t + q) * p.ld_s_h;
            const int pair = moe::pairs(p)[t + q];
            return moe::hidden_of<T>(p, pair / K, pair % K);
        };
        for (int i = threadIdx.x; i < n * (H / N); i += blockDim.x) {
            const int q = i / (H / N), col = (i % (H / N)) * N;
            flashrt::st16(xs + (size_t)q * H + col, flashrt::ld16(static_cast<const T*>(p.x) + (size_t)row_of(q) * p.ld_x + col));
        }
        __syncthreads();
        if (c < I) up_tile<T>(p, sh, c, wg, wu, xr, n, row_of, out_of);
        __syncthreads();
    }
}

FLASHRT_ENTRY(moe_up, MoeParams, 256)

// grid = (ceil(hidden / 8), min(E, rows * k)), block = 256; dynamic shared memory
// MOE_TILE * inter * sizeof(T).
template <typename T> static __device__ __forceinline__ void moe_down_impl(const MoeParams& p) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* hs = reinterpret_cast<T*>(smem);
    if ((int)blockIdx.y >= *moe::n_active(p)) return;
    const int e = moe::active(p)[blockIdx.y];
    const int lo = moe::offsets(p)[e], hi = moe::offsets(p)[e + 1];
    const int H = p.hidden, I = p.inter, K = p.top_k;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * (blockDim.x >> 5) + warp;
    const T* w = static_cast<const T*>(p.down) + ((size_t)e * H + (c < H ? c : 0)) * I;
    constexpr int N = flashrt::Pack16<T>::N;
    for (int t = lo; t < hi; t += MOE_TILE) {
        const int n = min(MOE_TILE, hi - t);
        for (int i = threadIdx.x; i < n * (I / N); i += blockDim.x) {
            const int q = i / (I / N), col = (i % (I / N)) * N;
            const int pair = moe::pairs(p)[t + q];
            flashrt::st16(hs + (size_t)q * I + col, flashrt::ld16(moe::hidden_of<T>(p, pair / K, pair % K) + col));
        }
        __syncthreads();
        if (c < H) {
            float acc[MOE_TILE];
            const T* const wr[1] = {w};
            tile_dots<T, MOE_TILE>(wr, hs, I, n, acc);
            if (lane == 0)
                for (int q = 0; q < n; ++q) {
                    const int pair = moe::pairs(p)[t + q];
                    moe::y_of<T>(p, pair / K, pair % K)[c] = flashrt::from_f32<T>(acc[q]);
                }
        }
        __syncthreads();
    }
}

FLASHRT_ENTRY(moe_down, MoeParams, 256)


// grid = (ceil(hidden / 256), rows), block = 256.
template <typename T> static __device__ __forceinline__ void moe_combine_impl(const MoeParams& p) {
    const int row = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.hidden) return;
    const float* w = moe::weights_of<T>(p, row);
    float acc = 0.0f;
    for (int j = 0; j < p.top_k; ++j) acc += w[j] * flashrt::to_f32(moe::y_of<T>(p, row, j)[c]);
    T* o = static_cast<T*>(p.out) + (size_t)row * p.ld_out + c;
    *o = flashrt::from_f32<T>(flashrt::to_f32(*o) + acc);
}

FLASHRT_ENTRY(moe_combine, MoeParams, 256)

// The same sums over 16-byte packs (8 bf16 / f16 or 4 f32 columns a thread), for `out` rows
// 16-byte aligned: the scalar kernel's 2-byte loads of the ranks' rows read at about half the
// copy bandwidth (an 8192-row chunk's combine reads 268 MB of them at the 35B-A3B shape).
// grid = (ceil(hidden / (256 * N)), rows), block = 256.
template <typename T> static __device__ __forceinline__ void moe_combine16_impl(const MoeParams& p) {
    constexpr int N = flashrt::Pack16<T>::N;
    const int row = blockIdx.y, c = (blockIdx.x * blockDim.x + threadIdx.x) * N;
    if (row >= flashrt::load_len(p.len) || c >= p.hidden) return;
    const float* w = moe::weights_of<T>(p, row);
    const int K = p.top_k;
    T* o = static_cast<T*>(p.out) + (size_t)row * p.ld_out + c;
    float acc[N];
#pragma unroll
    for (int e = 0; e < N; ++e) acc[e] = 0.0f;
    // Ranks in order, their packs loaded 8 at a time.
    for (int j0 = 0; j0 < K; j0 += 8) {
        uint4 ys[8];
#pragma unroll
        for (int b = 0; b < 8; ++b)
            if (j0 + b < K) ys[b] = flashrt::ld16(moe::y_of<T>(p, row, j0 + b) + c);
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            if (j0 + b >= K) break;
            float yv[N];
            flashrt::unpack16<T>(ys[b], yv);
            const float wj = w[j0 + b];
#pragma unroll
            for (int e = 0; e < N; ++e) acc[e] += wj * yv[e];
        }
    }
    float ov[N];
    flashrt::unpack16<T>(flashrt::ld16(o), ov);
#pragma unroll
    for (int e = 0; e < N; ++e) ov[e] += acc[e];
    flashrt::st16(o, flashrt::pack16<T>(ov));
}

FLASHRT_ENTRY(moe_combine16, MoeParams, 256)

// ---- prefill: tensor-core grouped GEMMs (bf16 / f16) ----------------------------------------
//
// Plans of more than 8 rows run the experts as grouped GEMMs on the tensor cores (wmma
// 16x16x16, f32 accumulators): block (feature tile, pair tile) takes MOE_MM_M pairs of one
// expert (gathered rows of x, or of the hidden activations) and MOE_MM_N of its features, and
// walks K in steps of MOE_MM_K through a two-stage cp.async pipeline in shared memory.
// `moe_plan2` lists the (expert, first pair) tiles; blocks past the list return. Each output element is one tensor-core
// dot product of its own A row and B column, whatever else shares the tile, so a row's result
// does not depend on its chunk; decode and verify steps (<= 8 rows) keep the CUDA-core kernels
// above (as the dense path keeps gemv for them).
#include <mma.h>

#define MOE_MM_M 64
#define MOE_MM_N 64
#define MOE_MM_K 64

namespace moe {
// Tiles of MOE_MM_M (or p.tile_m) pairs: tiles[2 t] = expert, tiles[2 t + 1] = first pair (into pairs());
// their count at n_tiles. Placed after pairs[max_rows * k].
static __device__ __forceinline__ int* n_tiles(const MoeParams& p, int max_pairs) {
    return pairs(p) + max_pairs;
}
static __device__ __forceinline__ int* tiles(const MoeParams& p, int max_pairs) {
    return pairs(p) + max_pairs + 1;
}
} // namespace moe


// ---- prefill plans on many blocks --------------------------------------------------------
//
// One block counting and placing an 8192-row chunk's 65536 pairs with its shared-memory
// atomics (the plan of decode and verify steps, `plan_block`) took ~95 us a layer, plus a
// one-block launch for the tile list. Plans of more than 8 rows take two launches over
// MOE_HIST_PAIRS pairs a block instead:
//   moe_hist   block b counts the experts of its pairs into hist[b][E] (no zeroing needed:
//              every block writes its whole row, zeros included);
//   moe_plan2  every block sums the rows (each expert's total, and its count in the blocks
//              before this one), block 0 writes the offsets, the active list and the tile
//              list, and block b places its own pairs from
//              offsets[e] + the earlier blocks' count of e on.
// A pair's place inside its expert's range still does not change its arithmetic.
#define MOE_HIST_PAIRS 1024

namespace moe {
static __device__ __forceinline__ int tile_m(const MoeParams& p) { return p.tile_m > 0 ? p.tile_m : MOE_MM_M; }
// hist[blocks][E], after the tile list of the plan's most tiles.
static __device__ __forceinline__ int* hist(const MoeParams& p) {
    const int mp = p.max_pairs, tm = tile_m(p);
    return tiles(p, mp) + 2 * ((mp + tm - 1) / tm + min(p.experts, mp));
}
} // namespace moe

// grid = ceil(max_pairs / MOE_HIST_PAIRS), block = 256.
template <typename T> static __device__ __forceinline__ void moe_hist_impl(const MoeParams& p) {
    __shared__ int h[MOE_MAX_E];
    const int E = p.experts, K = p.top_k, n = flashrt::load_len(p.len) * K;
    for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
    __syncthreads();
    constexpr int B = MOE_HIST_PAIRS / 256;
    int ids[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const int q = blockIdx.x * MOE_HIST_PAIRS + b * 256 + threadIdx.x;
        ids[b] = q < n ? moe::ids_of<T>(p, q / K)[q % K] : -1;
    }
#pragma unroll
    for (int b = 0; b < B; ++b)
        if (ids[b] >= 0) atomicAdd(&h[ids[b]], 1);
    __syncthreads();
    int* row = moe::hist(p) + (size_t)blockIdx.x * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) row[e] = h[e];
}

FLASHRT_ENTRY(moe_hist, MoeParams, 256)

// Inclusive prefix sum of v over the first E threads of the block (E <= blockDim.x), through
// `buf` (E ints of shared memory). Every thread calls it.
static __device__ __forceinline__ int moe_block_scan(int v, int E, int* buf) {
    const int e = threadIdx.x;
    if (e < E) buf[e] = v;
    __syncthreads();
    for (int off = 1; off < E; off <<= 1) {
        const int add = (e < E && e >= off) ? buf[e - off] : 0;
        __syncthreads();
        if (e < E) buf[e] += add;
        __syncthreads();
    }
    const int r = e < E ? buf[e] : 0;
    __syncthreads();
    return r;
}

// grid = ceil(max_pairs / MOE_HIST_PAIRS) (as moe_hist), block = 1024 (>= E).
template <typename T> static __device__ __forceinline__ void moe_plan2_impl(const MoeParams& p) {
    __shared__ int buf[MOE_MAX_E];
    __shared__ int cur[MOE_MAX_E];
    const int E = p.experts, K = p.top_k, n = flashrt::load_len(p.len) * K, nb = gridDim.x;
    const int e = threadIdx.x;
    const int* hist = moe::hist(p);
    int total = 0, before = 0;
    if (e < E) {
        for (int b0 = 0; b0 < nb; b0 += 8) {
            int v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = b0 + i < nb ? hist[(size_t)(b0 + i) * E + e] : 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                total += v[i];
                if (b0 + i < (int)blockIdx.x) before += v[i];
            }
        }
    }
    const int first = moe_block_scan(total, E, buf) - total; // the expert's offset
    if (e < E) cur[e] = first + before;
    if (blockIdx.x == 0) {
        const int act = moe_block_scan(e < E && total > 0, E, buf);
        const int tm = moe::tile_m(p);
        const int c = e < E ? (total + tm - 1) / tm : 0;
        const int tl = moe_block_scan(c, E, buf);
        if (e < E) {
            moe::offsets(p)[e] = first;
            if (total > 0) moe::active(p)[act - 1] = e;
            int* t = moe::tiles(p, p.max_pairs) + 2 * (tl - c);
            for (int i = 0; i < c; ++i) {
                t[2 * i] = e;
                t[2 * i + 1] = first + i * tm;
            }
            if (e == E - 1) {
                moe::offsets(p)[E] = first + total;
                *moe::n_active(p) = act;
                *moe::n_tiles(p, p.max_pairs) = tl;
            }
        }
    }
    __syncthreads();
    for (int q = blockIdx.x * MOE_HIST_PAIRS + threadIdx.x; q < min(n, (blockIdx.x + 1) * MOE_HIST_PAIRS);
         q += blockDim.x) {
        const int id = moe::ids_of<T>(p, q / K)[q % K];
        moe::pairs(p)[atomicAdd(&cur[id], 1)] = q;
    }
}

FLASHRT_ENTRY(moe_plan2, MoeParams, 1024)

// C[m, n] = sum_k A[m, k] B[n, k] for one tile: A rows are gathered (`a_row(m)` pointers, null
// past the tile's pairs), B rows `b_row(n)` (null past the matrix), K a multiple of 8. NB is the
// number of B row groups of MOE_MM_N (2 for SwiGLU's gate and up). Two stages of MOE_MM_K
// columns stream through dynamic shared memory by cp.async while the tensor cores work on the
// other; 4 warps in a 2 x 2 grid, each 32 rows x 32 columns of every group. The result lands in
// `smem` as [NB * MOE_MM_N][MOE_MM_M] floats (column-major per group).
template <typename T>
static __device__ __forceinline__ void cp_async16(T* dst, const T* src, bool valid) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}

template <typename T, int NB, typename ARow, typename BRow>
static __device__ __forceinline__ void mm_tile(ARow a_row, BRow b_row, int K, float* c_out, unsigned char* smem) {
    using namespace nvcuda;
    constexpr int LD = MOE_MM_K + 8;
    constexpr int A_ELEMS = MOE_MM_M * LD, B_ELEMS = NB * MOE_MM_N * LD;
    T* stage[2] = {reinterpret_cast<T*>(smem), reinterpret_cast<T*>(smem) + A_ELEMS + B_ELEMS};
    const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][NB][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][b][j], 0.0f);
    constexpr int PK = MOE_MM_K / 8;
    // A fallback source for zero-filled packs (never read: cp.async with 0 source bytes).
    const T* any = b_row(0) ? b_row(0) : a_row(0);
    auto load = [&](int s, int k0) {
        T* As = stage[s];
        T* Bs = stage[s] + A_ELEMS;
        for (int i = threadIdx.x; i < MOE_MM_M * PK; i += blockDim.x) {
            const int m = i / PK, kk = (i % PK) * 8;
            const T* src = a_row(m);
            const bool ok = src && k0 + kk < K;
            cp_async16(As + m * LD + kk, ok ? src + k0 + kk : any, ok);
        }
        for (int i = threadIdx.x; i < NB * MOE_MM_N * PK; i += blockDim.x) {
            const int n = i / PK, kk = (i % PK) * 8;
            const T* src = b_row(n);
            const bool ok = src && k0 + kk < K;
            cp_async16(Bs + n * LD + kk, ok ? src + k0 + kk : any, ok);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    const int nk = (K + MOE_MM_K - 1) / MOE_MM_K;
    load(0, 0);
    for (int kt = 0; kt < nk; ++kt) {
        if (kt + 1 < nk) {
            load((kt + 1) & 1, (kt + 1) * MOE_MM_K);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const T* As = stage[kt & 1];
        const T* Bs = stage[kt & 1] + A_ELEMS;
#pragma unroll
        for (int kk = 0; kk < MOE_MM_K; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * LD + kk, LD);
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
                    wmma::load_matrix_sync(fb, Bs + (b * MOE_MM_N + wn * 32 + j * 16) * LD + kk, LD);
#pragma unroll
                    for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[i][b][j], fa[i], fb, acc[i][b][j]);
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                wmma::store_matrix_sync(c_out + (size_t)(b * MOE_MM_N + wn * 32 + j * 16) * MOE_MM_M + wm * 32 + i * 16,
                                        acc[i][b][j], MOE_MM_M, wmma::mem_col_major);
    __syncthreads();
}

// grid = (ceil(inter / MOE_MM_N), max tiles), block = 128.
template <typename T> static __device__ __forceinline__ void moe_up_mm_impl(const MoeParams& p) {
    const int max_pairs = p.max_pairs;
    if ((int)blockIdx.y >= *moe::n_tiles(p, max_pairs)) return;
    const int e = moe::tiles(p, max_pairs)[2 * blockIdx.y];
    const int t0 = moe::tiles(p, max_pairs)[2 * blockIdx.y + 1];
    const int n = min(MOE_MM_M, moe::offsets(p)[e + 1] - t0);
    const int H = p.hidden, I = p.inter, K = p.top_k, c0 = blockIdx.x * MOE_MM_N;
    const int up_rows = p.swiglu ? 2 * I : I;
    const T* base = static_cast<const T*>(p.up) + (size_t)e * up_rows * H;
    const int* pr = moe::pairs(p) + t0;
    auto a_row = [&](int m) -> const T* {
        return m < n ? static_cast<const T*>(p.x) + (size_t)(pr[m] / K) * p.ld_x : nullptr;
    };
    extern __shared__ __align__(128) unsigned char mm_smem[];
    float* cs = reinterpret_cast<float*>(mm_smem);
    if (p.swiglu) {
        auto b_row = [&](int r) -> const T* {
            const int c = c0 + (r % MOE_MM_N);
            if (c >= I) return nullptr;
            return base + (size_t)(r < MOE_MM_N ? c : I + c) * H;
        };
        mm_tile<T, 2>(a_row, b_row, H, cs, mm_smem);
    } else {
        auto b_row = [&](int r) -> const T* {
            const int c = c0 + r;
            return c < I ? base + (size_t)c * H : nullptr;
        };
        mm_tile<T, 1>(a_row, b_row, H, cs, mm_smem);
    }
    for (int i = threadIdx.x; i < n * MOE_MM_N; i += blockDim.x) {
        const int m = i / MOE_MM_N, j = i % MOE_MM_N, c = c0 + j;
        if (c >= I) continue;
        const float g = flashrt::to_f32(flashrt::from_f32<T>(cs[(size_t)j * MOE_MM_M + m]));
        float h;
        if (p.swiglu) {
            const float u = flashrt::to_f32(flashrt::from_f32<T>(cs[(size_t)(MOE_MM_N + j) * MOE_MM_M + m]));
            h = flashrt::apply_act(flashrt::ACT_SILU, g) * u;
        } else {
            h = flashrt::apply_act(flashrt::ACT_RELU2, g);
        }
        const int pair = pr[m];
        moe::hidden_of<T>(p, pair / K, pair % K)[c] = flashrt::from_f32<T>(h);
    }
}

// grid = (ceil(hidden / MOE_MM_N), max tiles), block = 128.
template <typename T> static __device__ __forceinline__ void moe_down_mm_impl(const MoeParams& p) {
    const int max_pairs = p.max_pairs;
    if ((int)blockIdx.y >= *moe::n_tiles(p, max_pairs)) return;
    const int e = moe::tiles(p, max_pairs)[2 * blockIdx.y];
    const int t0 = moe::tiles(p, max_pairs)[2 * blockIdx.y + 1];
    const int n = min(MOE_MM_M, moe::offsets(p)[e + 1] - t0);
    const int H = p.hidden, I = p.inter, K = p.top_k, c0 = blockIdx.x * MOE_MM_N;
    const T* base = static_cast<const T*>(p.down) + (size_t)e * H * I;
    const int* pr = moe::pairs(p) + t0;
    auto a_row = [&](int m) -> const T* {
        return m < n ? moe::hidden_of<T>(p, pr[m] / K, pr[m] % K) : nullptr;
    };
    auto b_row = [&](int r) -> const T* {
        const int c = c0 + r;
        return c < H ? base + (size_t)c * I : nullptr;
    };
    extern __shared__ __align__(128) unsigned char mm_smem[];
    float* cs = reinterpret_cast<float*>(mm_smem);
    mm_tile<T, 1>(a_row, b_row, I, cs, mm_smem);
    for (int i = threadIdx.x; i < n * MOE_MM_N; i += blockDim.x) {
        const int m = i / MOE_MM_N, j = i % MOE_MM_N, c = c0 + j;
        if (c >= H) continue;
        const int pair = pr[m];
        moe::y_of<T>(p, pair / K, pair % K)[c] = flashrt::from_f32<T>(cs[(size_t)j * MOE_MM_M + m]);
    }
}

#define MOE_MM_ENTRY(name)                                                                    \
    extern "C" __global__ void __launch_bounds__(128) name##_bf16(const MoeParams p) {       \
        flashrt::pdl_enter();                                                                  \
        name##_impl<__nv_bfloat16>(p);                                                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) name##_f16(const MoeParams p) {        \
        flashrt::pdl_enter();                                                                  \
        name##_impl<__half>(p);                                                               \
    }

MOE_MM_ENTRY(moe_up_mm)
MOE_MM_ENTRY(moe_down_mm)
