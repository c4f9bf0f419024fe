// flashrt kernels: causal GQA prefill attention on Hopper's warpgroup tensor cores (plan op
// `Attention`, prefill buckets of >= 32 rows, head_dim 129..256, bf16/f16 targets, sm_90a).
//
// Same semantics and launch shape as `attention_prefill_d256` (attention_prefill.cu), which it
// replaces on compute capability 9.0: query row r < io.len of head h attends to cache
// positions 0 ..= min(io.pos + r, max_seq - 1) of KV head h / (q_heads / kv_heads);
// out = softmax(scale * q.k) v; rows >= io.len are not written.
//
// grid  = (q_heads, ceil(bucket rows / 128), splits); the row tile of block y is tiles - 1 - y
//         (the longest tiles start first). Blocks whose first row is >= io.len return at once.
//         Packed (`pack` = G = q_heads / kv_heads > 1, a chunk of fewer than 128 rows): grid =
//         (kv_heads, ceil(rows / prows), splits), and the block's 128 query rows are the G query
//         heads of KV head x for `prows` chunk rows (G * prows <= 128): tile row i is chunk row
//         r0 + i / G of query head G x + i % G. A 32-row chunk of the 27B shape (G = 6) used
//         32 of each block's 128 rows and read every key 6 times (once per query head); packed,
//         two blocks per KV head fill 96 of 128 and read each key once. Every row is computed
//         as it is unpacked: the same keys in the same tiles, in the same order.
//         With splits > 1 (a small grid: a short chunk after a long context) block z walks
//         only its even share of the tile's key tiles and writes each row's softmax state
//         (m in natural-log units, l, o not divided by l) to `partial` in attention.cu's
//         layout; `attention_combine` merges them. A row's result then depends on how its
//         tile's keys were split (a function of the chunk), as GPU rows already do on the
//         kernels a phase uses; one split keeps the single-walk arithmetic.
// block = 2 warpgroups (256 threads); warpgroup w owns query rows 64w .. 64w + 63 of the tile
//         and within it warp i of the group owns rows 16i .. 16i + 15 (the wgmma M layout).
// loop  = over key tiles of 64 positions, 0 .. min(io.pos + last row + 1, max_seq); iteration t
//         issues, back to back,
//           S(t) = Q K(t)^T      16 x wgmma m64n64k16, A = Q and B = K both read from shared
//                                memory (K-major), f32 accumulators: 32 registers per thread;
//           O += P(t-1) V(t-1)   4 x wgmma m64n256k16, A = P re-packed to 16-bit from the
//                                previous S accumulators (the register A layout equals the
//                                accumulator layout), B = V read MN-major; O is 64 x 256 f32
//                                per warpgroup: 128 registers per thread;
//         then waits for S(t) only, masks it and folds it into the online softmax (the 4 lanes
//         of a quad share a row) while the tensor cores still run P V, and rescales O once P V
//         has landed. A warpgroup needs only the tiles up to its last row's limit; the branches
//         around the wgmmas depend on the warpgroup index read through a shuffle, so ptxas
//         knows they are uniform (otherwise it serialises every wgmma).
// smem  = Q [128 rows] + 2 stages of K and V [64 rows], each stored as 4 column slabs of 64
//         elements (128-byte rows) in the 128-byte-swizzled layout wgmma reads (16-byte chunk c
//         of row r at chunk c ^ (r & 7), 8-row groups 1024 bytes apart, slabs 1024-aligned).
//         Filled by TMA: thread 0 issues one 3-D box per slab ({head_dim, heads, rows} tensor
//         maps made on the host; boxes past head_dim or the last row arrive as zeros) and the
//         consumers wait on per-stage mbarriers; iteration t loads K(t + 1) and V(t) while it
//         computes with K(t) and V(t - 1). V rows past the last valid key are zeroed in shared
//         memory (their probabilities are 0, but 0 * stale data could be NaN).
//         192 KiB + 1 KiB of alignment slack + the mbarriers: one block per SM.
//
// Throughput (H200, 24 query / 4 KV heads, 4096 rows; harness timing, see benches/RESULTS.md):
// about 550 TFLOP/s for a chunk at position 0 and 630 at position 12288, against 260-270 for
// the mma.sync kernel, with bit-identical outputs.
//
// Descriptors (PTX ISA "matrix descriptor"): start address, leading byte offset (LBO), stride
// byte offset (SBO), all >> 4, swizzle mode 1 (128 B) in bits 62-63. K-major operands (Q, K):
// SBO = 1024 (next 8 rows), LBO unused; the k-steps inside a slab advance the start by 32 B
// (the hardware applies the swizzle to the final address). MN-major V: LBO = 8192 (the next
// 64 head dims = the next slab), SBO = 1024 (the next 8 keys); a k-step of 16 keys is +2048 B.
//
// Without sm_90a (the compute_90 PTX fallback in the fatbin) the entry points trap; the host
// selects them only on compute capability 9.0, where the sm_90a SASS is loaded.
#include "common.cuh"
#include "wgmma.cuh"

#define FA_WG_ROWS 128 // query rows per block (2 warpgroups x 64)
#define FA_WG_KEYS 64  // keys per tile

namespace flashrt_wg {

using flashrt::ex2;
using flashrt::mbar_arrive_expect_tx;
using flashrt::mbar_fence_init;
using flashrt::mbar_init;
using flashrt::mbar_wait;
using flashrt::Mma;
using flashrt::smem_u32;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The accumulator register list of m64n64 (32 floats) per thread (m64n256: wgmma.cuh).
#define FA_WG_D32 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"

#define FA_WG_OPS32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <typename T> struct Wg;

#define FA_WG_TYPE(T, PTX)                                                                        \
    template <> struct Wg<T> {                                                                    \
        /* S[64 x 64] (+)= Q[64 x 16] K^T: A and B K-major in shared memory. */                   \
        static __device__ __forceinline__ void qk(float (&d)[32], uint64_t a, uint64_t b, int acc) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                             \
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " " FA_WG_D32  \
                         ", %32, %33, p, 1, 1, 0, 0;\n}\n"                                        \
                         : FA_WG_OPS32(d)                                                         \
                         : "l"(a), "l"(b), "r"(acc));                                             \
        }                                                                                         \
        /* O[64 x 256] += P[64 x 16] V[16 x 256]: A in registers, B MN-major in shared memory. */ \
        static __device__ __forceinline__ void pv(float (&d)[128], const uint32_t (&a)[4], uint64_t b) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                            \
                         "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " " FLASHRT_WG_D128 \
                         ", {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                     \
                         : FLASHRT_WG_OPS128(d)                                                   \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));           \
        }                                                                                         \
    };

FA_WG_TYPE(__nv_bfloat16, "bf16")
FA_WG_TYPE(__half, "f16")

// One box of a 3-D tensor map at coordinates {c0, c1, c2} into shared `dst`, counted on
// mbarrier `bar` as complete_tx.
template <typename Map>
static __device__ __forceinline__ void tma_load_3d(uint32_t dst, const Map* map, int c0, int c1, int c2, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
                 : "memory");
}

// S[64 x 64] = Q K^T for this warpgroup's 64 rows (16 k-steps over the 4 slabs of D = 256).
template <typename T>
static __device__ __forceinline__ void issue_qk(float (&s)[32], uint32_t q_rows, uint32_t k_tile) {
#pragma unroll
    for (int ks = 0; ks < 16; ++ks) {
        const uint32_t kin = (ks & 3) * 32;
        Wg<T>::qk(s, desc128(q_rows + (ks >> 2) * (FA_WG_ROWS * 128) + kin, 16, 1024),
                  desc128(k_tile + (ks >> 2) * (FA_WG_KEYS * 128) + kin, 16, 1024), ks > 0);
    }
}

// O += P V over the 64 keys of a tile (4 k-steps of 16 keys; V read MN-major).
template <typename T>
static __device__ __forceinline__ void issue_pv(float (&o)[128], const uint32_t (&pf)[4][4], uint32_t v_tile) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) Wg<T>::pv(o, pf[kk], desc128(v_tile + kk * 16 * 128, FA_WG_KEYS * 128, 1024));
}

// Scale S into log2 units, mask, and fold the tile into the online softmax: s[4 j + e] is row
// g + 8 (e / 2) of the warp, key k0 + 8 j + 2 t4 + (e & 1); on return s holds the unnormalised
// probabilities and corr the factor by which each row's earlier O and l must be scaled.
static __device__ __forceinline__ void softmax_tile(float (&s)[32], float (&m)[2], float (&l)[2], float (&corr)[2],
                                                    int k0, int warp_lo, const int (&lim)[2], int t4, float sl2) {
    const bool mask = k0 + FA_WG_KEYS - 1 > warp_lo;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = s[4 * j + e] * sl2;
            if (mask && k0 + 8 * j + 2 * t4 + (e & 1) > lim[e >> 1]) x = -INFINITY;
            s[4 * j + e] = x;
        }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float mx = m[i];
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * i], s[4 * j + 2 * i + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row that has seen only masked keys keeps m = -inf; subtract 0 so that
        // exp2(-inf - 0) = 0 instead of NaN.
        const float mu = mx == -INFINITY ? 0.0f : mx;
        corr[i] = ex2(m[i] - mu);
        m[i] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[4 * j + 2 * i] = ex2(s[4 * j + 2 * i] - mu);
            s[4 * j + 2 * i + 1] = ex2(s[4 * j + 2 * i + 1] - mu);
            sum += s[4 * j + 2 * i] + s[4 * j + 2 * i + 1];
        }
        l[i] = l[i] * corr[i] + sum;
    }
}

// O *= corr per row, and P (the S accumulators of key columns 16 kk .. 16 kk + 15) packed as
// the A fragment of k-step kk.
template <typename T>
static __device__ __forceinline__ void rescale_pack(float (&o)[128], uint32_t (&pf)[4][4], const float (&s)[32],
                                                    const float (&corr)[2]) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        o[4 * j + 0] *= corr[0];
        o[4 * j + 1] *= corr[0];
        o[4 * j + 2] *= corr[1];
        o[4 * j + 3] *= corr[1];
    }
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        pf[kk][0] = Mma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
        pf[kk][1] = Mma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
        pf[kk][2] = Mma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
        pf[kk][3] = Mma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

#endif // __CUDA_ARCH_FEAT_SM90_ALL

} // namespace flashrt_wg

// Dynamic shared memory (bytes): Q + 2 stages of K and V, slack to align them to 1 KiB, and 5
// mbarriers.
#define FA_WG_SMEM ((FA_WG_ROWS + 4 * FA_WG_KEYS) * 256 * 2 + 1024 + 64)

// A CUtensorMap (cuTensorMapEncodeTiled) as the kernel receives it; mirrored by `TmaMap` in
// flashrt-runtime/src/backend/cuda/ops.rs.
struct __align__(128) FaTmaMap {
    unsigned long long w[16];
};

// The kernel's parameters: TMA maps of Q, K and V plus the plan's attention parameters. The
// maps are 3-D tiled views {head_dim, heads, rows} with boxes {64, 1, rows of a tile} and
// 128-byte swizzling, so a box lands as one swizzled slab; coordinates past head_dim or past
// the last row read as zeros. Mirrored by `AttentionTmaParams` in ops.rs.
struct AttentionTmaParams {
    FaTmaMap q, k, v;
    AttentionParams a;
    int pack;  // query heads per block row group (1: one head per block; see the header)
    int prows; // chunk rows per block (128 when pack = 1); the q map's boxes are {64, pack, prows}
};

template <typename T>
static __device__ __forceinline__ void attention_prefill_wg_impl(const AttentionTmaParams& tp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace flashrt_wg;
    const AttentionParams& p = tp.a;
    constexpr int BR = FA_WG_ROWS, BC = FA_WG_KEYS, D = 256;
    constexpr uint32_t Q_SLAB = BR * 128, KV_SLAB = BC * 128, KV_STAGE = BC * D * 2;
    extern __shared__ __align__(1024) unsigned char wg_smem[];

    const int len = flashrt::load_len(p.len);
    // Tile row i is chunk row r0 + i / G of query head h0 + i % G (G = 1: row r0 + i of head h0).
    const int G = tp.pack, PR = tp.prows;
    const int r0 = (gridDim.y - 1 - blockIdx.y) * PR;
    if (r0 >= len) return;
    const int pos = flashrt::load_pos(p.pos);
    const int h0 = blockIdx.x * G; // unpacked (G = 1): the query head
    const int kvh = G > 1 ? blockIdx.x : h0 / (p.q_heads / p.kv_heads);
    const int rend = min(r0 + PR, len);          // valid chunk rows [r0, rend)
    const int pend = (rend - r0) * G;            // valid tile rows [0, pend)
    const int kend = min(pos + rend, p.max_seq); // keys [0, kend)
    const int all_tiles = (kend + BC - 1) / BC;
    // Split z of p.splits (gridDim.z) takes key tiles [tb, tb + ntiles): an even share of the
    // block's tiles. Iteration t below counts the split's own tiles (stages, barrier phases);
    // key offsets are (tb + t) * BC.
    const int z = blockIdx.z;
    const int tb = (int)((long long)all_tiles * z / p.splits);
    const int ntiles = (int)((long long)all_tiles * (z + 1) / p.splits) - tb;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // The warpgroup index through a shuffle from lane 0, so the compiler knows it is uniform
    // per warp: every branch around a wgmma must be, or ptxas serialises the wgmmas.
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0), wq = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;

    const uint32_t sQ = (smem_u32(wg_smem) + 1023) & ~1023u;
    const uint32_t sK = sQ + BR * D * 2;
    const uint32_t sV = sK + 2 * KV_STAGE;
    // mbarriers: Q, K stages 0/1, V stages 0/1 (one arrival each: the issuing thread's
    // expect_tx; the TMA bytes complete the phase).
    const uint32_t bar_q = sV + 2 * KV_STAGE, bar_k = bar_q + 8, bar_v = bar_q + 24;

    // This warpgroup's tile rows [gr0, gr0 + 64) and the last key any of them may see; this
    // warp's tile rows [wr0, wr0 + 16) and the causal limits of the thread's two rows.
    const int gr0 = wg * 64;
    const bool group_rows = gr0 < pend;
    const int group_hi = min(pos + r0 + min(gr0 + 63, pend - 1) / G, p.max_seq - 1);
    const int wr0 = gr0 + wq * 16;
    const int warp_lo = min(pos + r0 + wr0 / G, p.max_seq - 1);
    int lim[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) lim[i] = min(pos + r0 + (wr0 + g + 8 * i) / G, p.max_seq - 1);
    const float sl2 = p.scale * 1.4426950408889634f;

    // Thread 0 issues every copy: 4 slabs (boxes of 64 columns) per tile.
    const bool issuer = threadIdx.x == 0;
    // A box is `bytes` long and lands at the start of its slab (`slab` bytes apart).
    auto load = [&](uint32_t dst, const FaTmaMap* map, uint32_t slab, uint32_t bytes, int head, int row0, uint32_t bar) {
        mbar_arrive_expect_tx(bar, 4 * bytes);
#pragma unroll
        for (int c = 0; c < 4; ++c) tma_load_3d(dst + c * slab, map, 64 * c, head, row0, bar);
    };
    if (issuer) {
        for (int b = 0; b < 5; ++b) mbar_init(bar_q + 8 * b, 1);
        mbar_fence_init();
    }
    __syncthreads();
    // Prologue: Q and K of tile 0. Iteration t then loads K of tile t + 1 and V of tile t.
    if (issuer) {
        // Tile rows past G * PR (packed) are never loaded: they belong to no row and are not
        // stored.
        load(sQ, &tp.q, Q_SLAB, (uint32_t)(G * PR) * 128u, h0, r0, bar_q);
        if (ntiles > 0) load(sK, &tp.k, KV_SLAB, KV_SLAB, kvh, tb * BC, bar_k);
    }

    float o[128];
#pragma unroll
    for (int j = 0; j < 128; ++j) o[j] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    uint32_t pf[4][4]; // P of the previous tile as the A fragments of its 4 k-steps
    const uint32_t q_rows = sQ + wg * 64 * 128; // this group's 64 rows within each Q slab
    // Key tiles of the split this warpgroup needs: those that start at or before its last
    // row's limit.
    const int gtiles = group_rows ? max(0, min(ntiles, group_hi / BC + 1 - tb)) : 0;

    // Iteration t issues S(t) = Q K(t)^T and O += P(t - 1) V(t - 1) together, then runs the
    // softmax of tile t while the tensor cores do the P V product (the two are independent
    // once P(t - 1) is packed), and rescales O only after P V has landed.
    for (int t = 0; t <= ntiles; ++t) {
        if (issuer) {
            if (t + 1 < ntiles) load(sK + ((t + 1) & 1) * KV_STAGE, &tp.k, KV_SLAB, KV_SLAB, kvh, (tb + t + 1) * BC, bar_k + ((t + 1) & 1) * 8);
            if (t < ntiles) load(sV + (t & 1) * KV_STAGE, &tp.v, KV_SLAB, KV_SLAB, kvh, (tb + t) * BC, bar_v + (t & 1) * 8);
        }
        // K(t) and V(t - 1) (and Q) have landed: stage s holds tiles s, s + 2, ..., so tile u
        // completes phase u / 2 of its stage's barrier.
        if (t == 0) mbar_wait(bar_q, 0);
        if (t < ntiles) mbar_wait(bar_k + (t & 1) * 8, (t >> 1) & 1);
        if (t > 0) mbar_wait(bar_v + ((t - 1) & 1) * 8, ((t - 1) >> 1) & 1);
        if (t == ntiles && t > 0 && tb + ntiles == all_tiles && kend % BC != 0) {
            // Keys past kend in the last tile are masked, but 0 * (stale V) could still be NaN:
            // zero those V rows (whole 128-byte slab rows, so the swizzle does not matter).
            const int first = kend - (all_tiles - 1) * BC;
            const uint32_t vt = sV + ((t - 1) & 1) * KV_STAGE;
            for (int c = threadIdx.x; c < (BC - first) * 4 * 8; c += blockDim.x) {
                const int row = first + c / 32, slab = (c / 8) & 3, ch = c & 7;
                asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(vt + slab * KV_SLAB + row * 128 + ch * 16), "r"(0) : "memory");
            }
            fence_async_smem();
            __syncthreads();
        }

        // Three shapes of iteration, each waiting for all of its own wgmmas before it ends
        // (so no accumulator is in flight across a branch): the first tile (S only), the
        // steady state (S of tile t with P V of tile t - 1 running under the softmax), the
        // last (P V only).
        const uint32_t sKs = sK + (t & 1) * KV_STAGE, sVs = sV + ((t - 1) & 1) * KV_STAGE;
        if (t < gtiles) {
            float s[32];
            wg_fence();
            issue_qk<T>(s, q_rows, sKs);
            wg_commit();
            if (t > 0) {
                pin(o);
                wg_fence();
                issue_pv<T>(o, pf, sVs);
                wg_commit();
                wg_wait<1>();
                pin(s);
                float corr[2];
                softmax_tile(s, m, l, corr, (tb + t) * BC, warp_lo, lim, t4, sl2);
                wg_wait<0>();
                pin(o);
                rescale_pack<T>(o, pf, s, corr);
            } else {
                wg_wait<0>();
                pin(s);
                float corr[2];
                softmax_tile(s, m, l, corr, (tb + t) * BC, warp_lo, lim, t4, sl2);
                rescale_pack<T>(o, pf, s, corr);
            }
        } else if (t == gtiles && t > 0) {
            pin(o);
            wg_fence();
            issue_pv<T>(o, pf, sVs);
            wg_commit();
            wg_wait<0>();
            pin(o);
        }
        // Everyone is done with K(t) and V(t - 1) before iteration t + 1 refills their stages.
        __syncthreads();
    }

    if (!group_rows) return;
    // Each of the thread's two tile rows to its chunk row and head: with one split the output
    // (flash_store's values: o / l, packed to T); with several, the row's (m, l, o[]) to the
    // partials (attention.cu's layout, m in natural-log units of the scaled scores, o not yet
    // divided by l), merged by `attention_combine` (a row that saw no key of this split writes
    // m = -inf, which the combine skips).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float sum = l[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int pi = wr0 + g + 8 * i;
        if (pi >= pend) continue;
        const int r = r0 + pi / G, h = h0 + pi % G;
        if (p.splits == 1) {
            const float inv = 1.0f / sum;
            T* orow = static_cast<T*>(p.out) + (size_t)r * p.ld_out + (size_t)h * p.head_dim;
#pragma unroll
            for (int j = 0; j < 32; ++j)
                if (8 * j < p.head_dim)
                    *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * t4) =
                        Mma<T>::pack(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
            continue;
        }
        float* part = p.partial + (((size_t)r * p.q_heads + h) * p.splits + z) * (size_t)(p.head_dim + 2);
        if (t4 == 0) {
            part[0] = m[i] == -INFINITY ? -INFINITY : m[i] * 0.6931471805599453f;
            part[1] = sum;
        }
        if (m[i] == -INFINITY) continue;
#pragma unroll
        for (int j = 0; j < 32; ++j)
            if (8 * j < p.head_dim) {
                part[2 + 8 * j + 2 * t4] = o[4 * j + 2 * i];
                part[2 + 8 * j + 2 * t4 + 1] = o[4 * j + 2 * i + 1];
            }
    }
#else
    __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(256, 1)
    attention_prefill_wg_d256_bf16(const __grid_constant__ AttentionTmaParams p) {
    attention_prefill_wg_impl<__nv_bfloat16>(p);
}
extern "C" __global__ void __launch_bounds__(256, 1)
    attention_prefill_wg_d256_f16(const __grid_constant__ AttentionTmaParams p) {
    attention_prefill_wg_impl<__half>(p);
}
