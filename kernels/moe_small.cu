// flashrt kernels: an MoE block's small phases (decode, verify, batched steps: <= 8 rows), the
// `moe` family's second file (compiled in one unit after kernels/moe.cu, whose parameters,
// routing (`route_row`) and dot products (`tile_dots_at`, `up_tile`) it uses). With
// moe_logits (kernels/moe.cu) a small phase's block is three launches:
//
//   moe_logits                 the fused RMSNorm, router logits, the shared expert's token gate
//   moe_up_routed1 / _tiles    routing and the pair plan in every block, then the experts' and
//                              the shared expert's up projections
//   moe_down_small             the down projections and the combine, the shared expert's down
//
// (`CudaOptions::moe_route_in_up` off, or x too wide for shared memory: moe_route with the plan,
// then moe_up, kernels/moe.cu, instead of moe_up_routed*.) (Doing the down projections in the
// up launch's blocks after they meet at a counter, `moe_updown1`, was measured slower: 3.83
// against 3.30 ms a 35B-A3B step on the H100, benches/RESULTS.md 2026-12-07 14:55; removed.)
//
// The experts' weights stream past the L2 evict-first (ld16_evict_first): a step reads each
// once, and with the default policy they pushed out what the next launches read (35B-A3B
// decode step 3.41 -> 3.25 ms on the H100, benches/RESULTS.md 2026-12-07 12:13).
#include "common.cuh"

// Small phases (<= 8 rows, E <= 256): the routing, the plan and the experts' up projections in
// one launch (the decode step's chain loses moe_route's launch and the plan's round trips).
// grid = (x, min(E, rows * k) + shared), block = 256 (one row: 128), x chosen so the launch is
// resident at once (every block routes once, none waits for a second wave; the warps stride
// over the features) and no warp takes more features than the fewest rounds need; dynamic
// shared memory rows * hidden T (the rows of x) + rows * 2 * E floats (routing scratch). Every block but the shared expert's routes every
// row (warp w routes row w, route_row: moe_route's arithmetic), then warp 0 groups the pairs by
// expert (experts in index order, each expert's pairs in pair order; a pair's arithmetic does
// not depend on its place) and block y takes the y-th active expert; the last y with `shared`
// runs the shared expert over every row from the start. Block (0, 0) stores the rows' ids and
// weights for moe_down_small.
template <typename T, int ROWS, int B>
static __device__ __forceinline__ void moe_up_routed_impl(const MoeParams& p, const int len) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int keep[8][32];
    __shared__ int sid[8 * MOE_MAX_K];
    __shared__ float swt[8 * MOE_MAX_K];
    __shared__ int plist[8 * MOE_MAX_K];
    __shared__ int act_e[8 * MOE_MAX_K], act_lo[8 * MOE_MAX_K], act_hi[8 * MOE_MAX_K];
    __shared__ unsigned amask[8];
    __shared__ int n_act;
    const int H = p.hidden, K = p.top_k, E = p.experts;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    T* xall = reinterpret_cast<T*>(smem);
    float* scratch = reinterpret_cast<float*>(smem + (size_t)len * H * sizeof(T));
    constexpr int N = flashrt::Pack16<T>::N;
    const bool sh = p.shared && blockIdx.y == gridDim.y - 1;
    FLASHRT_MARK(0);
    // The rows of x into shared memory by the warps that do not route (all of them after
    // routing when every warp routes a row), so the copy and the routing overlap.
    const int routing = sh ? 0 : len;
    const int cw = routing < warps ? routing : 0;
    if (!sh && warp < len)
        route_row<T>(p, warp, scratch + (size_t)warp * 2 * E, scratch + (size_t)warp * 2 * E + E, keep[warp],
                     sid + warp * K, swt + warp * K);
    if (warp >= cw)
        for (int i = threadIdx.x - 32 * cw; i < len * (H / N); i += blockDim.x - 32 * cw) {
            const int q = i / (H / N), col = (i % (H / N)) * N;
            flashrt::st16(xall + (size_t)q * H + col, flashrt::ld16(static_cast<const T*>(p.x) + (size_t)q * p.ld_x + col));
        }
    FLASHRT_MARK(1);
    if (!sh && len == 1) {
        // One row: its k experts are distinct, so an expert's place among the active ones is
        // the number of its row's picks below it, and warp 0 (which routed the row and holds
        // its picks) plans alone, in registers: the plan the general path below makes.
        if (warp == 0) {
            const int x = lane < K ? sid[lane] : 0x7fffffff;
            int less = 0;
            for (int i = 0; i < K; ++i) less += __shfl_sync(0xffffffffu, x, i) < x;
            if (lane < K) {
                plist[less] = lane;
                act_e[less] = x;
                act_lo[less] = less;
                act_hi[less] = less + 1;
                if (blockIdx.x == 0 && blockIdx.y == 0) {
                    moe::ids_of<T>(p, 0)[lane] = x;
                    moe::weights_of<T>(p, 0)[lane] = swt[lane];
                }
            }
            if (lane == 0) n_act = K;
        }
    } else if (!sh) {
        if (warp == 0 && lane < 8) amask[lane] = 0u;
        __syncthreads();
        const int n = len * K;
        if (blockIdx.x == 0 && blockIdx.y == 0)
            for (int q = threadIdx.x; q < n; q += blockDim.x) {
                moe::ids_of<T>(p, q / K)[q % K] = sid[q];
                moe::weights_of<T>(p, q / K)[q % K] = swt[q];
            }
        if (warp == 0) {
            for (int q = lane; q < n; q += 32) atomicOr(&amask[sid[q] >> 5], 1u << (sid[q] & 31));
            __syncwarp();
            for (int q = lane; q < n; q += 32) {
                const int x = sid[q];
                int less = 0, same = 0, before = 0;
                for (int r = 0; r < n; ++r) {
                    const int y = sid[r];
                    less += y < x;
                    same += y == x;
                    before += y == x && r < q;
                }
                plist[less + before] = q;
                if (before == 0) {
                    int a = __popc(amask[x >> 5] & ((1u << (x & 31)) - 1u));
                    for (int w = 0; w < (x >> 5); ++w) a += __popc(amask[w]);
                    act_e[a] = x;
                    act_lo[a] = less;
                    act_hi[a] = less + same;
                }
            }
            if (lane == 0) {
                int a = 0;
                for (int w = 0; w < 8; ++w) a += __popc(amask[w]);
                n_act = a;
            }
        }
    }
    __syncthreads();
    FLASHRT_MARK(2);
    if (!sh && (int)blockIdx.y >= n_act) return;
    const int e = sh ? 0 : act_e[blockIdx.y];
    const int lo = sh ? 0 : act_lo[blockIdx.y];
    const int hi = sh ? len : act_hi[blockIdx.y];
    const int I = sh ? p.s_inter : p.inter;
    for (int c = blockIdx.x * warps + warp; c < I; c += gridDim.x * warps) {
        const T* wg;
        const T* wu;
        up_rows<T>(p, sh, e, c, wg, wu);
        for (int t = lo; t < hi; t += ROWS) {
            const int n = min(ROWS, hi - t);
            auto row_of = [&](int q) { return sh ? t + q : plist[t + q] / K; };
            auto out_of = [&](int q) -> T* {
                if (sh) return static_cast<T*>(p.s_h) + (size_t)(t + q) * p.ld_s_h;
                const int pair = plist[t + q];
                return moe::hidden_of<T>(p, pair / K, pair % K);
            };
            const T* xr[ROWS];
#pragma unroll
            for (int q = 0; q < ROWS; ++q) xr[q] = xall + (size_t)row_of(q < n ? q : 0) * H;
            up_tile<T, ROWS, B>(p, sh, c, wg, wu, xr, n, row_of, out_of);
        }
        if (c == blockIdx.x * warps + warp) FLASHRT_MARK(4);
    }
    FLASHRT_MARK(6);
}

// The routed up entries: len loaded and the next matmul's weights asked of the L2 before the
// PDL wait (common.cuh). moe_up_routed_tiles: several rows. moe_up_routed1: one-row plans (a
// decode step), tiles of one pair, a feature's gate and up rows loaded whole (16 packs a lane
// in flight for hidden 2048) and fewer registers, so more blocks resident.
template <typename T, int ROWS, int B>
static __device__ __forceinline__ void moe_up_routed_entry(const MoeParams& p) {
    const int len = flashrt::load_len(p.len);
    flashrt::prefetch_l2_share(p.next_w, p.next_bytes);
    flashrt::pdl_enter();
    moe_up_routed_impl<T, ROWS, B>(p, len);
}
template <typename T> static __device__ __forceinline__ void moe_up_routed_tiles_impl(const MoeParams& p) {
    moe_up_routed_entry<T, MOE_TILE, MOE_BATCH / 2>(p);
}
template <typename T> static __device__ __forceinline__ void moe_up_routed1_impl(const MoeParams& p) {
    moe_up_routed_entry<T, 1, 8>(p);
}

FLASHRT_ENTRY_SELF(moe_up_routed_tiles, MoeParams, 256)
// 16-bit: at most 96 registers (94 used, none spilled; 101 unbounded) so that five 128-thread
// blocks are resident an SM: a 35B-A3B step's 9 x 64 blocks at once, 2 features a warp. (f32,
// a test target, would spill: unbounded.)
extern "C" __global__ void __maxnreg__(96) moe_up_routed1_bf16(const MoeParams p) {
    moe_up_routed1_impl<__nv_bfloat16>(p);
}
extern "C" __global__ void __maxnreg__(96) moe_up_routed1_f16(const MoeParams p) {
    moe_up_routed1_impl<__half>(p);
}
extern "C" __global__ void __launch_bounds__(256) moe_up_routed1_f32(const MoeParams p) {
    moe_up_routed1_impl<float>(p);
}

// Small phases (<= 8 rows): down projection and combine in one launch. grid = ceil(hidden / 8),
// block = 256: warp w owns output feature 8 * bx + w of every row. Its lanes walk the
// (rank, pack) pairs of all ranks at once, MOE_BATCH loads in flight each, summing
// w_j * down_{e_j}[c] . hidden(r, j) (f32, the y of the prefill path not rounded), then the
// shared expert's down_s[c] . s_h(r) (weight 1), one warp sum, added to out. A lane's packs are
// summed in pack order (the routed ranks', then the shared expert's). With a shared expert of
// at most 64 packs (s_inter 512 at 16 bits) after a whole number of 32-pack lane rounds, each
// lane loads its (at most two) shared down packs before the PDL wait (weights) and its s_h
// packs with the routed rounds' first loads, so the shared expert adds no round of loads.
#define MOE_DOWN_SHARED_PRE 2
// The f32 dot product of two 16-byte packs, in element order.
template <typename T> static __device__ __forceinline__ float moe_pack_dot(const uint4& w, const uint4& h) {
    constexpr int N = flashrt::Pack16<T>::N;
    float wv[N], hv[N];
    flashrt::unpack16<T>(w, wv);
    flashrt::unpack16<T>(h, hv);
    float d = 0.0f;
#pragma unroll
    for (int e = 0; e < N; ++e) d += wv[e] * hv[e];
    return d;
}
// Down pack q of output feature c (lane-strided over the row's k * P routed packs, rank q / P's
// expert `ids[q / P]`, then the shared expert's): its weights, and the matching pack of row
// r's input (the rank's hidden values, or the shared expert's).
template <typename T>
static __device__ __forceinline__ const T* moe_down_w(const MoeParams& p, const int* ids, int c, int q) {
    constexpr int N = flashrt::Pack16<T>::N;
    const int P = p.inter / N, KP = p.top_k * P;
    if (q < KP) return static_cast<const T*>(p.down) + ((size_t)ids[q / P] * p.hidden + c) * p.inter + (q % P) * N;
    return static_cast<const T*>(p.s_down) + (size_t)c * p.s_inter + (q - KP) * N;
}
template <typename T> static __device__ __forceinline__ const T* moe_down_in(const MoeParams& p, int r, int q) {
    constexpr int N = flashrt::Pack16<T>::N;
    const int P = p.inter / N, KP = p.top_k * P;
    if (q < KP) return moe::hidden_of<T>(p, r, q / P) + (q % P) * N;
    return static_cast<const T*>(p.s_h) + (size_t)r * p.ld_s_h + (q - KP) * N;
}
template <typename T> static __device__ __forceinline__ void moe_down_small_impl(const MoeParams& p) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * (blockDim.x >> 5) + warp;
    constexpr int N = flashrt::Pack16<T>::N;
    const int K = p.top_k, H = p.hidden, I = p.inter;
    const int P = I / N, SP = p.shared ? p.s_inter / N : 0;
    const int KP = K * P;
    const bool pre = SP > 0 && SP <= 32 * MOE_DOWN_SHARED_PRE && KP % 32 == 0;
    uint4 sw[MOE_DOWN_SHARED_PRE];
#pragma unroll
    for (int j = 0; j < MOE_DOWN_SHARED_PRE; ++j) {
        const int s = lane + 32 * j;
        sw[j] = pre && c < H && s < SP ? flashrt::ld16_evict_first(moe_down_w<T>(p, nullptr, c, KP + s))
                                       : make_uint4(0, 0, 0, 0);
    }
    const int len = flashrt::load_len(p.len); // before the wait: common.cuh
    flashrt::pdl_enter();
    FLASHRT_MARK(0);
    if (c >= H) return;
    const int total = pre ? KP : KP + SP;
    for (int r = 0; r < len; ++r) {
        const int* ids = moe::ids_of<T>(p, r);
        const float* wts = moe::weights_of<T>(p, r);
        uint4 sh[MOE_DOWN_SHARED_PRE];
#pragma unroll
        for (int j = 0; j < MOE_DOWN_SHARED_PRE; ++j) {
            const int s = lane + 32 * j;
            sh[j] = pre && s < SP ? flashrt::ld16(moe_down_in<T>(p, r, KP + s)) : make_uint4(0, 0, 0, 0);
        }
        float acc = 0.0f;
        for (int q0 = lane; q0 < total; q0 += MOE_BATCH * 32) {
            uint4 wp[MOE_BATCH], hp[MOE_BATCH];
            float sc[MOE_BATCH];
#pragma unroll
            for (int b = 0; b < MOE_BATCH; ++b) {
                const int q = q0 + b * 32;
                wp[b] = hp[b] = make_uint4(0, 0, 0, 0);
                sc[b] = 0.0f;
                if (q < total) {
                    wp[b] = flashrt::ld16_evict_first(moe_down_w<T>(p, ids, c, q));
                    hp[b] = flashrt::ld16(moe_down_in<T>(p, r, q));
                    sc[b] = q < KP ? wts[q / P] : 1.0f;
                }
            }
#pragma unroll
            for (int b = 0; b < MOE_BATCH; ++b) acc += sc[b] * moe_pack_dot<T>(wp[b], hp[b]);
        }
        // The shared expert's packs (preloaded), after the routed ones as in the loop above.
#pragma unroll
        for (int j = 0; j < MOE_DOWN_SHARED_PRE; ++j) {
            if (!pre || lane + 32 * j >= SP) break;
            acc += 1.0f * moe_pack_dot<T>(sw[j], sh[j]);
        }
        acc = flashrt::warp_sum(acc);
        if (lane == 0) {
            T* o = static_cast<T*>(p.out) + (size_t)r * p.ld_out + c;
            *o = flashrt::from_f32<T>(flashrt::to_f32(*o) + acc);
        }
    }
    FLASHRT_MARK(6);
}

FLASHRT_ENTRY_SELF(moe_down_small, MoeParams, 256)
