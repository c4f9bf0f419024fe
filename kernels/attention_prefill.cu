// flashrt kernels: tiled causal GQA prefill attention on tensor cores (plan op `Attention`,
// prefill buckets of >= 64 rows, bf16/f16 targets; flash-attention-2 style).
//
// Same semantics as `attention_impl` (attention.cu), which it replaces for these plans after
// the same `kv_write`: query row r < io.len of head h attends to cache positions
// 0 ..= min(io.pos + r, max_seq - 1) of KV head h / (q_heads / kv_heads); out = softmax(scale *
// q.k) v, rows >= io.len are not written.
//
// `attention_prefill_d<D>`: D is the instantiated head-dim bound 64/128/256 (head_dim must be a
// multiple of 8 and <= D; dims >= head_dim are zero-filled and never written).
//
// grid  = (q_heads, ceil(bucket rows / BR)); the row tile of block y is tiles - 1 - y, so the
//         tiles with the most keys (the last rows) are dispatched first and the short ones fill
//         the tail; heads of one GQA group are neighbours in x and share K/V through L2.
//         Blocks whose first row is >= io.len return at once.
// block = WARPS = 8 warps, BR = 128 query rows: warp w owns rows 16w .. 16w + 15 of the tile
//         (the M of its m16n8k16 MMAs), every warp sweeps the whole key tile.
// loop  = over key tiles of BC = 64 positions, 0 .. kend = min(io.pos + last row + 1, max_seq):
//           S = Q K^T      (mma.sync m16n8k16, f32 accumulators, 16 x 64 per warp in registers;
//                           A = Q from ldmatrix (D = 256) or kept in registers (D <= 128),
//                           B = K rows by ldmatrix)
//           causal mask    (only on tiles that reach past a warp's first row's limit; a warp
//                           whose rows all end before the tile skips it entirely)
//           online softmax (per row max m and partial sum l in f32, exp2 with scale * log2 e
//                           folded in; the 4 lanes of a quad share a row)
//           O += P V       (P re-packed from the S accumulators to bf16/f16 A fragments without
//                           touching shared memory, B = V by ldmatrix.trans; O is 16 x D f32 per
//                           warp in registers: 128 registers per thread at D = 256)
//         then O / l is written straight from the accumulators (4-byte stores, 8 rows per
//         store instruction).
// smem  = Q tile [BR][D] + 2 stages of K and V tiles [BC][D], all 16-byte chunks XOR-swizzled
//         by (row & 7) so every ldmatrix phase hits 8 distinct chunk columns (no bank
//         conflicts); filled by cp.async (16 B, zero-fill past the valid rows / head_dim), tile
//         t + 1 is in flight while tile t is computed. D = 256: 64 + 128 KiB = 192 KiB (1 block
//         per SM); D = 128: 96 KiB; D = 64: 48 KiB.
//
// Work and traffic per (head, row tile of BR rows, key tile of BC keys): 4 * BR * BC * D FLOPs
// (S and PV; ~half wasted on the diagonal tile only), BC * D * 2 elements of K/V from L2/HBM
// (each K/V row is read once per row tile and query head, i.e. bucket / BR times per head;
// GQA siblings mostly hit L2). Shared memory reads per warp: Q (D = 256 only) + K + V tile, which
// bounds the kernel at ~14-16 FLOP per smem byte (about 60% of the dense mma.sync peak).
// The causal total for a chunk of n rows at position p is 2 * n * (2p + n) * D * q_heads FLOPs.
#include "common.cuh"

namespace flashrt_fa {

using flashrt::cp_async16;
using flashrt::cp_async_commit;
using flashrt::cp_async_wait;
using flashrt::ex2;
using flashrt::ldsm_x4;
using flashrt::ldsm_x4_t;
using flashrt::smem_u32;

using flashrt::Mma; // kernels/common.cuh

// Byte offset of 16-byte chunk `ch` of tile row `row` (rows of D elements = D / 8 chunks).
template <int D> static __device__ __forceinline__ uint32_t swz(int row, int ch) {
    return static_cast<uint32_t>((row * (D / 8) + (ch ^ (row & 7))) * 16);
}

// cp.async ROWS rows of a [rows, D] tile: row i comes from base + (row0 + i) * stride and is
// zero-filled when row0 + i >= lim; chunks at or past head_dim are zero-filled.
template <typename T, int D, int ROWS, int THREADS>
static __device__ __forceinline__ void load_tile(uint32_t dst, const T* base, size_t stride, int row0, int lim,
                                                 int hd) {
    constexpr int CH = D / 8;
    static_assert((ROWS * CH) % THREADS == 0, "tile chunks must divide among the threads");
#pragma unroll
    for (int i = 0; i < ROWS * CH / THREADS; ++i) {
        const int c = threadIdx.x + i * THREADS;
        const int row = c / CH, ch = c % CH;
        const bool valid = row0 + row < lim && ch * 8 < hd;
        const T* src = valid ? base + (size_t)(row0 + row) * stride + ch * 8 : base;
        cp_async16(dst + swz<D>(row, ch), src, valid);
    }
}

} // namespace flashrt_fa

#define FA_WARPS 8
#define FA_BC 64

template <typename T, int D, bool QREG>
static __device__ __forceinline__ void attention_prefill_impl(const AttentionParams& p) {
    using namespace flashrt_fa;
    constexpr int WARPS = FA_WARPS, BC = FA_BC, BR = WARPS * 16, THREADS = WARPS * 32;
    constexpr int NS = BC / 8;  // 8-key column tiles of S
    constexpr int NO = D / 8;   // 8-dim column tiles of O
    constexpr int KS = D / 16;  // k-steps of Q K^T
    extern __shared__ __align__(128) unsigned char fa_smem[];

    const int len = flashrt::load_len(p.len);
    const int r0 = (gridDim.y - 1 - blockIdx.y) * BR;
    if (r0 >= len) return;
    const int pos = flashrt::load_pos(p.pos);
    const int h = blockIdx.x;
    const int kvh = h / (p.q_heads / p.kv_heads);
    const int hd = p.head_dim;
    const int rend = min(r0 + BR, len);           // valid rows [r0, rend)
    const int kend = min(pos + rend, p.max_seq);  // keys [0, kend)
    const int ntiles = (kend + BC - 1) / BC;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;

    const uint32_t sQ = smem_u32(fa_smem);
    const uint32_t sK = sQ + BR * D * 2;
    const uint32_t sV = sK + 2 * BC * D * 2;
    constexpr uint32_t KV_STAGE = BC * D * 2;

    const size_t kv_stride = (size_t)p.kv_heads * hd;
    const T* kbase = static_cast<const T*>(p.cache_k) + (size_t)kvh * hd;
    const T* vbase = static_cast<const T*>(p.cache_v) + (size_t)kvh * hd;
    const T* qbase = static_cast<const T*>(p.q) + (size_t)h * hd;

    // Rows of this warp and their causal limits (the last key each row may see).
    const int wr0 = r0 + warp * 16;
    const bool warp_rows = wr0 < rend;
    const int warp_lo = min(pos + wr0, p.max_seq - 1);
    const int warp_hi = min(pos + min(wr0 + 15, rend - 1), p.max_seq - 1);
    int lim[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) lim[i] = min(pos + wr0 + g + 8 * i, p.max_seq - 1);
    const float sl2 = p.scale * 1.4426950408889634f;

    // Stage 0: Q (own group) and the first K/V tile.
    load_tile<T, D, BR, THREADS>(sQ, qbase, (size_t)p.ld_q, r0, rend, hd);
    cp_async_commit();
    load_tile<T, D, BC, THREADS>(sK, kbase, kv_stride, 0, kend, hd);
    load_tile<T, D, BC, THREADS>(sV, vbase, kv_stride, 0, kend, hd);
    cp_async_commit();

    // ldmatrix lane addressing (see the fragment layouts of mma.m16n8k16): A (Q) and B^T (V,
    // transposed load) take tile rows lane & 15 at chunk c + lane / 16; B (K) takes rows
    // (lane & 7) + 8 (lane / 16) at chunk c + (lane / 8) & 1, for c = 2 ks (Q, K) or 2 dj (V).
    // Every such row is = lane (mod 8), so the swizzled chunk (c + b) ^ (lane & 7) only mixes
    // the low 3 bits: = 8 (c / 8) + ((c % 8 + b) ^ (lane & 7)). The 4 values of c % 8 give 4
    // lane offsets per operand; the rest (8 (c / 8) chunks, 16-row steps) are immediates.
    const int x7 = lane & 7;
    const int a_row = (lane & 7) + ((lane >> 3) & 1) * 8, a_ch = lane >> 4;
    const int k_row = (lane & 7) + (lane >> 4) * 8, k_ch = (lane >> 3) & 1;
    constexpr int ROW_B = D * 2; // bytes per tile row
    uint32_t q_off[4], k_off[4], v_off[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        q_off[c] = sQ + (warp * 16 + a_row) * ROW_B + (((2 * c + a_ch) ^ x7) * 16);
        k_off[c] = k_row * ROW_B + (((2 * c + k_ch) ^ x7) * 16);
        v_off[c] = a_row * ROW_B + (((2 * c + a_ch) ^ x7) * 16);
    }

    uint32_t qf[QREG ? KS : 1][4];
    if constexpr (QREG) {
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) ldsm_x4(qf[ks], q_off[ks & 3] + (ks >> 2) * 128);
    }

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int kt = 0; kt < ntiles; ++kt) {
        // Prefetch tile kt + 1 into the other stage (freed by the barrier that ended kt - 1).
        if (kt + 1 < ntiles) {
            const uint32_t st = ((kt + 1) & 1) * KV_STAGE;
            load_tile<T, D, BC, THREADS>(sK + st, kbase, kv_stride, (kt + 1) * BC, kend, hd);
            load_tile<T, D, BC, THREADS>(sV + st, vbase, kv_stride, (kt + 1) * BC, kend, hd);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();

        const int k0 = kt * BC;
        if (warp_rows && k0 <= warp_hi) {
            const uint32_t sKs = sK + (kt & 1) * KV_STAGE, sVs = sV + (kt & 1) * KV_STAGE;
            float s[NS][4];
#pragma unroll
            for (int j = 0; j < NS; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                uint32_t a[4];
                if constexpr (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[e] = qf[ks][e];
                } else {
                    ldsm_x4(a, q_off[ks & 3] + (ks >> 2) * 128);
                }
#pragma unroll
                for (int jj = 0; jj < NS / 2; ++jj) {
                    uint32_t b[4];
                    ldsm_x4(b, sKs + k_off[ks & 3] + (ks >> 2) * 128 + jj * 16 * ROW_B);
                    Mma<T>::run(s[2 * jj], a, b[0], b[1]);
                    Mma<T>::run(s[2 * jj + 1], a, b[2], b[3]);
                }
            }

            // Scale into log2 units, mask, online softmax. Element e of s[j] is row g + 8 (e / 2),
            // key k0 + 8 j + 2 t4 + (e & 1).
            const bool mask = k0 + BC - 1 > warp_lo;
#pragma unroll
            for (int j = 0; j < NS; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[j][e] * sl2;
                    if (mask && k0 + 8 * j + 2 * t4 + (e & 1) > lim[e >> 1]) x = -INFINITY;
                    s[j][e] = x;
                }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                float mx = m[i];
#pragma unroll
                for (int j = 0; j < NS; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                // A row that has seen only masked keys keeps m = -inf; subtract 0 so that
                // exp2(-inf - 0) = 0 instead of NaN.
                const float mu = mx == -INFINITY ? 0.0f : mx;
                const float corr = ex2(m[i] - mu);
                m[i] = mx;
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < NS; ++j) {
                    s[j][2 * i] = ex2(s[j][2 * i] - mu);
                    s[j][2 * i + 1] = ex2(s[j][2 * i + 1] - mu);
                    sum += s[j][2 * i] + s[j][2 * i + 1];
                }
                l[i] = l[i] * corr + sum;
#pragma unroll
                for (int j = 0; j < NO; ++j) {
                    o[j][2 * i] *= corr;
                    o[j][2 * i + 1] *= corr;
                }
            }

            // O += P V: the S accumulators of key tiles 2kk, 2kk + 1 are the A fragment of
            // k-step kk.
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                uint32_t a[4];
                a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
                a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
                a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int dj = 0; dj < NO / 2; ++dj) {
                    uint32_t b[4];
                    ldsm_x4_t(b, sVs + v_off[dj & 3] + (dj >> 2) * 128 + kk * 16 * ROW_B);
                    Mma<T>::run(o[2 * dj], a, b[0], b[1]);
                    Mma<T>::run(o[2 * dj + 1], a, b[2], b[3]);
                }
            }
        }
        // Everyone is done with stage kt & 1 before iteration kt + 1 refills it.
        __syncthreads();
    }
    cp_async_wait<0>();

    if (!warp_rows) return;
    flashrt::flash_store<T, NO>(reinterpret_cast<const float(&)[4 * NO]>(o), l, wr0 + g, rend,
                                static_cast<T*>(p.out) + (size_t)h * hd, p.ld_out, hd, t4);
}

// Dynamic shared memory of attention_prefill_d<D> (bytes): Q tile + 2 stages of K and V.
#define FA_SMEM(D) ((FA_WARPS * 16 * (D) + 2 * 2 * FA_BC * (D)) * 2)

#define FLASHRT_FA_ENTRY(D, QREG, MINB)                                                            \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, MINB)                               \
        attention_prefill_d##D##_bf16(const AttentionParams p) {                                    \
        attention_prefill_impl<__nv_bfloat16, D, QREG>(p);                                          \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(FA_WARPS * 32, MINB)                               \
        attention_prefill_d##D##_f16(const AttentionParams p) {                                     \
        attention_prefill_impl<__half, D, QREG>(p);                                                 \
    }

FLASHRT_FA_ENTRY(64, true, 2)
FLASHRT_FA_ENTRY(128, true, 1)
FLASHRT_FA_ENTRY(256, false, 1)
