// flashrt kernels: sparse mixture-of-experts MLP (plan op `Moe`), five launches that never
// leave the device, so a captured graph replays them at any position and routing:
//
//   moe_logits   router logits (f32 weights), tiles of 8 rows x 4 experts per block
//   moe_route    per row: scores, choice, top-k, weights
//   moe_plan     one block: the (row, rank) pairs grouped by expert, the active experts
//   moe_up       per active expert: act(gate x) * (up x) (SwiGLU) or relu(up x)^2 for its pairs
//   moe_down     per active expert: y = down h for its pairs
//   moe_combine  per row: out += sum_j w_j y_j, ranks in order (best first)
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
// cursor[E] and pairs[rows * k].
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
    int small;       // decode / verify (<= 8 rows): moe_route also plans; moe_down_small combines
    int pad_;
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

#define MOE_LOGIT_ROWS 8
#define MOE_LOGIT_WARPS 4

// grid = (ceil(E / 4), ceil(rows / 8)), block = 128, dynamic shared memory 8 * hidden T: the
// block's rows of x in shared memory, warp w computes expert 4 * bx + w for them, reading its
// router row once (decode's router is a 2 MB f32 read spread over E / 4 blocks). Each logit is
// the same lane-strided f32 sum whatever rows share the block.
template <typename T> static __device__ __forceinline__ void moe_logits_impl(const MoeParams& p) {
    extern __shared__ __align__(16) unsigned char logit_smem[];
    T* xs = reinterpret_cast<T*>(logit_smem);
    const int len = flashrt::load_len(p.len);
    const int r0 = blockIdx.y * MOE_LOGIT_ROWS;
    if (r0 >= len) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = min(MOE_LOGIT_ROWS, len - r0), H = p.hidden;
    constexpr int N = flashrt::Pack16<T>::N;
    for (int i = threadIdx.x; i < n * (H / N); i += blockDim.x) {
        const int q = i / (H / N), col = (i % (H / N)) * N;
        flashrt::st16(xs + (size_t)q * H + col, flashrt::ld16(static_cast<const T*>(p.x) + (size_t)(r0 + q) * p.ld_x + col));
    }
    __syncthreads();
    const int e = blockIdx.x * MOE_LOGIT_WARPS + warp;
    if (e >= p.experts) return;
    const float4* w = reinterpret_cast<const float4*>(p.router + (size_t)e * H);
    float acc[MOE_LOGIT_ROWS];
#pragma unroll
    for (int q = 0; q < MOE_LOGIT_ROWS; ++q) acc[q] = 0.0f;
#pragma unroll 4
    for (int i = lane; i < H / 4; i += 32) {
        const float4 v = __ldg(w + i);
#pragma unroll
        for (int q = 0; q < MOE_LOGIT_ROWS; ++q) {
            if (q >= n) break;
            const T* x = xs + (size_t)q * H + 4 * i;
            acc[q] += v.x * flashrt::to_f32(x[0]) + v.y * flashrt::to_f32(x[1]) +
                      v.z * flashrt::to_f32(x[2]) + v.w * flashrt::to_f32(x[3]);
        }
    }
#pragma unroll
    for (int q = 0; q < MOE_LOGIT_ROWS; ++q) {
        if (q >= n) break;
        const float v = flashrt::warp_sum(acc[q]);
        if (lane == 0) moe::logits_of<T>(p, r0 + q)[e] = v;
    }
}

FLASHRT_ENTRY(moe_logits, MoeParams, 128)

// One row's routing by one warp; `score`, `choice`: E floats of shared memory, `keep`: 32.
template <typename T>
static __device__ __forceinline__ void route_row(const MoeParams& p, int row, float* score, float* choice, int* keep) {
    const int E = p.experts, K = p.top_k;
    const int lane = threadIdx.x & 31;
    const float* logits = moe::logits_of<T>(p, row);
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
    __syncwarp();
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
    int* ids = moe::ids_of<T>(p, row);
    float* wts = moe::weights_of<T>(p, row);
    for (int j = 0; j < K; ++j) {
        float v = NAN;
        int i = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            const float c = choice[e];
            if (!isnan(c) && (isnan(v) || c > v)) {
                v = c;
                i = e;
            }
        }
        if (isnan(v)) v = -INFINITY; // an empty lane loses to any candidate
        moe::warp_best(v, i);
        if (lane == 0) {
            ids[j] = i;
            wts[j] = score[i];
            choice[i] = NAN;
        }
        __syncwarp();
    }
    if (lane == 0) {
        if (p.renormalize) {
            float sum = 0.0f;
            for (int j = 0; j < K; ++j) sum += wts[j];
            const float denom = sum + p.renorm_eps;
            for (int j = 0; j < K; ++j) wts[j] /= denom;
        }
        if (p.scaling != 1.0f)
            for (int j = 0; j < K; ++j) wts[j] *= p.scaling;
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
    if (row < flashrt::load_len(p.len)) route_row<T>(p, row, score, score + p.experts, keep[warp]);
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

template <typename T> static __device__ __forceinline__ void moe_plan_impl(const MoeParams& p) {
    plan_block<T>(p);
}

FLASHRT_ENTRY(moe_plan, MoeParams, 1024)

// Dot products of up to MOE_TILE shared input rows (`k` elements each, 16-byte packs) with one
// weight row: lane-strided packs, then a warp sum; every lane returns the totals.
template <typename T, int ROWS>
static __device__ __forceinline__ void tile_dots(const T* w, const T* xs, int k, int n, float* acc) {
    constexpr int N = flashrt::Pack16<T>::N;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int q = 0; q < ROWS; ++q) acc[q] = 0.0f;
    for (int c = lane * N; c < k; c += 32 * N) {
        float wv[N];
        flashrt::unpack16<T>(flashrt::ld16(w + c), wv);
#pragma unroll
        for (int q = 0; q < ROWS; ++q) {
            if (q >= n) break;
            float xv[N];
            flashrt::unpack16<T>(flashrt::ld16(xs + (size_t)q * k + c), xv);
#pragma unroll
            for (int e = 0; e < N; ++e) acc[q] += wv[e] * xv[e];
        }
    }
#pragma unroll
    for (int q = 0; q < ROWS; ++q) acc[q] = flashrt::warp_sum(acc[q]);
}

// grid = (ceil(inter / 8), min(E, rows * k)), block = 256 (a warp per feature); dynamic shared
// memory MOE_TILE * hidden * sizeof(T).
template <typename T> static __device__ __forceinline__ void moe_up_impl(const MoeParams& p) {
    extern __shared__ __align__(16) unsigned char smem[];
    T* xs = reinterpret_cast<T*>(smem);
    if ((int)blockIdx.y >= *moe::n_active(p)) return;
    const int e = moe::active(p)[blockIdx.y];
    const int lo = moe::offsets(p)[e], hi = moe::offsets(p)[e + 1];
    const int H = p.hidden, I = p.inter, K = p.top_k;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * (blockDim.x >> 5) + warp;
    const int up_rows = p.swiglu ? 2 * I : I;
    const T* base = static_cast<const T*>(p.up) + (size_t)e * up_rows * H;
    const T* wg = base + (size_t)(c < I ? c : 0) * H;     // gate row (SwiGLU) or the up row
    const T* wu = base + (size_t)(c < I ? I + c : 0) * H; // up row (SwiGLU only)
    constexpr int N = flashrt::Pack16<T>::N;
    for (int t = lo; t < hi; t += MOE_TILE) {
        const int n = min(MOE_TILE, hi - t);
        for (int i = threadIdx.x; i < n * (H / N); i += blockDim.x) {
            const int q = i / (H / N), col = (i % (H / N)) * N;
            const int r = moe::pairs(p)[t + q] / K;
            flashrt::st16(xs + (size_t)q * H + col, flashrt::ld16(static_cast<const T*>(p.x) + (size_t)r * p.ld_x + col));
        }
        __syncthreads();
        if (c < I) {
            float g[MOE_TILE], u[MOE_TILE];
            tile_dots<T, MOE_TILE>(wg, xs, H, n, g);
            if (p.swiglu) tile_dots<T, MOE_TILE>(wu, xs, H, n, u);
            if (lane == 0) {
                for (int q = 0; q < n; ++q) {
                    const int pair = moe::pairs(p)[t + q];
                    float h;
                    if (p.swiglu) {
                        // Gate and up rounded to T first, as the dense MLP's separate ops store them.
                        const float gr = flashrt::to_f32(flashrt::from_f32<T>(g[q]));
                        const float ur = flashrt::to_f32(flashrt::from_f32<T>(u[q]));
                        h = flashrt::apply_act(flashrt::ACT_SILU, gr) * ur;
                    } else {
                        h = flashrt::apply_act(flashrt::ACT_RELU2, flashrt::to_f32(flashrt::from_f32<T>(g[q])));
                    }
                    moe::hidden_of<T>(p, pair / K, pair % K)[c] = flashrt::from_f32<T>(h);
                }
            }
        }
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
            tile_dots<T, MOE_TILE>(w, hs, I, n, acc);
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

// Small phases (<= 8 rows): down projection and combine in one launch. grid = ceil(hidden / 8),
// block = 256: warp w owns output feature 8 * bx + w of every row and sums
// w_j * down_{e_j}[c] . hidden(r, j) over the ranks in order (f32, the y of the prefill path
// not rounded), then adds it to out.
template <typename T> static __device__ __forceinline__ void moe_down_small_impl(const MoeParams& p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * (blockDim.x >> 5) + warp;
    if (c >= p.hidden) return;
    const int len = flashrt::load_len(p.len), K = p.top_k, H = p.hidden, I = p.inter;
    for (int r = 0; r < len; ++r) {
        const int* ids = moe::ids_of<T>(p, r);
        const float* wts = moe::weights_of<T>(p, r);
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const T* w = static_cast<const T*>(p.down) + ((size_t)ids[j] * H + c) * I;
            float d;
            tile_dots<T, 1>(w, moe::hidden_of<T>(p, r, j), I, 1, &d);
            acc += wts[j] * d;
        }
        if (lane == 0) {
            T* o = static_cast<T*>(p.out) + (size_t)r * p.ld_out + c;
            *o = flashrt::from_f32<T>(flashrt::to_f32(*o) + acc);
        }
    }
}

FLASHRT_ENTRY(moe_down_small, MoeParams, 256)

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

// ---- prefill: tensor-core grouped GEMMs (bf16 / f16) ----------------------------------------
//
// Plans of more than 8 rows run the experts as grouped GEMMs on the tensor cores (wmma
// 16x16x16, f32 accumulators): block (feature tile, pair tile) takes MOE_MM_M pairs of one
// expert (gathered rows of x, or of the hidden activations) and MOE_MM_N of its features, and
// walks K in steps of MOE_MM_K through a two-stage cp.async pipeline in shared memory. `moe_tiles` lists the (expert, first pair)
// tiles after `moe_plan`; blocks past the list return. Each output element is one tensor-core
// dot product of its own A row and B column, whatever else shares the tile, so a row's result
// does not depend on its chunk; decode and verify steps (<= 8 rows) keep the CUDA-core kernels
// above (as the dense path keeps gemv for them).
#include <mma.h>

#define MOE_MM_M 64
#define MOE_MM_N 64
#define MOE_MM_K 64

namespace moe {
// Tiles of MOE_MM_M pairs: tiles[2 t] = expert, tiles[2 t + 1] = first pair (into pairs());
// their count at n_tiles. Placed after pairs[max_rows * k].
static __device__ __forceinline__ int* n_tiles(const MoeParams& p, int max_pairs) {
    return pairs(p) + max_pairs;
}
static __device__ __forceinline__ int* tiles(const MoeParams& p, int max_pairs) {
    return pairs(p) + max_pairs + 1;
}
} // namespace moe

// grid = 1, block = 1024 (>= E): after moe_plan, the tile list.
template <typename T> static __device__ __forceinline__ void moe_tiles_impl(const MoeParams& p) {
    __shared__ int sc[MOE_MAX_E];
    const int E = p.experts, e = threadIdx.x, max_pairs = p.max_pairs;
    const int* off = moe::offsets(p);
    const int c = e < E ? (off[e + 1] - off[e] + MOE_MM_M - 1) / MOE_MM_M : 0;
    if (e < E) sc[e] = c;
    __syncthreads();
    for (int o = 1; o < E; o <<= 1) {
        const int v = (e < E && e >= o) ? sc[e - o] : 0;
        __syncthreads();
        if (e < E) sc[e] += v;
        __syncthreads();
    }
    if (e < E) {
        int* t = moe::tiles(p, max_pairs) + 2 * (sc[e] - c);
        for (int i = 0; i < c; ++i) {
            t[2 * i] = e;
            t[2 * i + 1] = off[e] + i * MOE_MM_M;
        }
        if (e == E - 1) *moe::n_tiles(p, max_pairs) = sc[e];
    }
}

FLASHRT_ENTRY(moe_tiles, MoeParams, 1024)

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
        flashrt::pdl_wait();                                                                  \
        flashrt::pdl_trigger();                                                               \
        name##_impl<__nv_bfloat16>(p);                                                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) name##_f16(const MoeParams p) {        \
        flashrt::pdl_wait();                                                                  \
        flashrt::pdl_trigger();                                                               \
        name##_impl<__half>(p);                                                               \
    }

MOE_MM_ENTRY(moe_up_mm)
MOE_MM_ENTRY(moe_down_mm)
