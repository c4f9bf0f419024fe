// flashrt kernels: split-KV ("flash-decoding") GQA attention for small phases (plan op
// `Attention` with at most 8 rows: decode, MTP draft, verify and tiny prefill buckets).
//
// Same semantics as `attention_impl` (attention.cu), after the same `kv_write`: query row r < io.len
// of head h attends to cache positions 0 .. n_r - 1, n_r = min(io.pos + r + 1, max_seq), of KV head
// h / G (G = q_heads / kv_heads); out = softmax(scale q.k) v, row-major.
//
// 1. `attention_decode_d<D>`: grid = (kv_heads, S), block = 8 consumer warps + 2 producer warps,
//    dynamic smem = `Shape::SMEM` (198 KiB at D = 256 bf16: one block per SM). D is the
//    instantiated head-dim bound 64/128/256 (head_dim <= D, a multiple of 8 for 16-bit targets and
//    of 4 for f32; dims >= head_dim are zero in shared memory and never written). Block (kvh, s)
//    serves ALL G * rows query vectors of KV head kvh (query i = row i / G, head kvh * G + i % G),
//    so each K/V byte of a step is read from HBM once.
//
//    Split pieces (per row, from the live length on the device, so one captured graph replays at
//    any position): piece_r = ceil(n_r / S) rounded up to CHUNK = 16 keys; split s owns
//    [s piece_r, min(n_r, (s + 1) piece_r)), possibly empty. The block streams the union of its
//    rows' pieces (rows differ by <= 7 positions, so the union is the piece plus a few keys; only
//    when piece_r steps by 16 between two rows of one phase does split s's union grow by 16 s keys)
//    in tiles of TK keys (TK = 32 KiB / (2 D sizeof(T)): 32 keys at D = 256 bf16).
//
//    Memory: a STAGES = 6 ring of K and V tiles, rows padded to D sizeof(T) + 16 bytes (so the 8
//    row addresses of every ldmatrix phase fall in 8 distinct 16-byte bank groups), filled by two
//    producer warps (K and V) with one TMA bulk copy (cp.async.bulk, mbarrier complete_tx) per key
//    row: rows past the union repeat its last row (finite data, masked below), so every stage
//    receives exactly 2 TK head_dim sizeof(T) bytes. full[s] / empty[s] mbarriers pair the
//    producers with the 8 consumer warps, which each walk the tiles at their own pace: up to 5
//    tiles (165 KiB per SM at D = 256) are in flight while one is computed.
//
//    Compute (bf16/f16: mma.sync m16n8k16, f32 accumulators), per 16-key chunk c (absolute index
//    key / 16). The host fixes per program the number of 8-query column tiles NT (qtiles:
//    ceil(G * shape rows / 8)); the kernel derives KG = 8 / NT key groups of WPG = 8 / KG warps.
//    Key group k owns the chunks with c % KG == k and keeps, per live column tile, its own online
//    softmax state. Inside a group, the NTL = ceil(nq / 8) live column tiles x DP dim parts are
//    spread over the WPG warps (DP: the largest power of two with NTL DP <= WPG, at most D / 16):
//    a decode step of the 27B shape (NT = 4 for the shared 5-row layout, KG = 2, NTL = 1) runs 4
//    warps per chunk, each computing the whole S^T (identical bits in all four) and a quarter of O;
//    its 5-row verify runs one column tile per warp; a model without verify plans (NT = 1) runs
//    8 key groups of one warp.
//      S^T = K Q^T   A = K chunk [16 keys x 16 dims] by ldmatrix, B = Q [16 dims x 8 queries] held
//                    in registers for the whole kernel (D / 8 registers); the D / 16 k-steps are
//                    summed in 4 chains, (c0 + c1) + (c2 + c3)
//      mask          keys outside the query's own piece -> -inf (by select)
//      softmax       per query (a column; 8 lanes share it): running max m (log2 units, scale *
//                    log2 e folded in), partial denominators l per lane
//      O^T += V^T P^T  A = V chunk by ldmatrix.trans, B = P^T: the S^T accumulators packed to
//                    bf16/f16 and transposed in registers by movmatrix; O^T is (D / DP) x 8 f32 per
//                    warp (D / 4 / DP registers per thread)
//    f32 targets run the same loop with the same fragment layout on CUDA cores (scalar dot products
//    from shared memory), as an exact oracle for the logic.
//    Then the KG group states of each query are merged in a fixed order (through shared memory)
//    and the block writes, per (row, head, split), (m, l) and the unnormalised o[head_dim] (f32) to
//    the partial buffer; with S == 1 it writes the output directly.
//
//    A batched step (rows of different sessions, each at its own position on its own caches)
//    runs `attention_decode_rows_d<D>` instead: grid = (kv_heads, S, RB), each block taking rows
//    z, z + RB, ... one after another, every row exactly as the one-row block computes it; the
//    ring (ROWS_STAGES = 4 stages) runs across rows and the merge area follows it, so the
//    producers stream the next row's tiles while the consumers merge this one
//    (`attention_decode_rows_impl`).
//
// 2. `attention_decode_combine`: grid = (q_heads, rows, ceil(head_dim / 64)), 128 threads, at most
//    64 registers (so that its blocks, launched early by PDL, fit beside a main block): out =
//    sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M) (empty splits, m = -inf, weigh 0) over 64 dims
//    per block. Every thread issues its o loads and the (m, l) loads at once (one round trip to
//    L2); M and the denominator are reduced by every warp in the same fixed order; the splits are
//    summed in 8 fixed groups (split s in group s % 8, in order), then the groups in order.
//
// Partial buffer (the session's cuBLASLt workspace, free between attention and its combine):
//   ml [rows][q_heads][S] float2 (m, l), padded to 16 bytes, then o [rows][q_heads][S][head_dim].
//
// Determinism and row independence (speculative decoding commits verify rows in place of decode
// steps): a row's arithmetic depends only on its own query, its own n_r, S, and the per-program NT
// (fixed for every phase of <= 5 rows by the host): chunk boundaries are absolute (multiples of 16
// keys), a chunk's key group is c % KG, how a group's column tiles and dims are spread over its
// warps changes no bit (an MMA computes each output element from its own row and column only,
// whatever the other query columns hold, and every warp of a column tile computes the same S^T),
// and a chunk outside a row's own piece is an exact no-op for that row (max unchanged ->
// correction 1 by select, p = 0 times finite V).
//
// Both entries are PDL-ready (not in kernels.rs NOT_PDL): they start with the wait and (but the
// gated combine, below) the trigger, so the combine's launch overlaps the main kernel.
//
// Traffic per step and KV head: n * head_dim * 2 elements of K and V read once (plus tile
// rounding at piece ends, mostly L2 hits), Q read once; partials 4 (head_dim + 2) bytes per (row,
// head, non-empty split) written and read back by the combine.
#include "common.cuh"

struct AttentionDecodeParams {
    AttentionParams a; // a.splits = S (gridDim.y), a.partial = the partial buffer
    int rows;          // row capacity of the partial layout (bucket rows; 5 for shared phases)
    int qtiles;        // 8-query column tiles per block, ceil(G * rows / 8) <= 8; fixed per program
    // A batched step (common.cuh; grid z = the step's row capacity): block z serves row z alone,
    // at its own position, on its own session's caches (a.cache_k / a.cache_v are offsets into the
    // state arena): exactly what a one-row step of that session computes. Null otherwise.
    const int* rows_pos;
    const unsigned long long* slots;
    // The plan's output gate after the attention (`Mul`: out = act(gate) * out), fused into the
    // stores of the output (`dec_store4`); null: none.
    const void* gate;
    int ld_gate;
    int gate_act;
    // The next matmul's first weights, asked of the L2 by the main kernel
    // (`flashrt::prefetch_l2_share`; null: none).
    const void* pf;
    unsigned long long pf_bytes;
};

namespace flashrt_dec {

constexpr int WARPS = 8;                  // consumer warps
constexpr int THREADS = (WARPS + 2) * 32; // + the producer warps of K and of V
constexpr int STAGES = 6;
constexpr int PAD = 16;    // bytes of padding per shared-memory key row
constexpr int CHUNK = 16;  // keys per MMA chunk
constexpr int MAX_ROWS = 8;
constexpr int MAX_SPLITS = 128;
constexpr int COMBINE_THREADS = 128; // combine: grid (q_heads, rows, ceil(head_dim / 64))
constexpr int COMBINE_COLS = 16;     // float4 columns (64 dims) per combine block
constexpr int COMBINE_PF = 8;        // o loads a combine thread issues before reducing

// Ring geometry; ops.rs `attention_decode` computes SMEM with the same formula.
template <typename T, int D> struct Shape {
    static constexpr int ES = (int)sizeof(T);
    static constexpr int ROWB = D * ES + PAD; // shared bytes per key row
    static constexpr int TK0 = 32768 / (2 * D * ES);
    static constexpr int TK = TK0 > CHUNK ? TK0 : CHUNK; // keys per tile
    static constexpr int CHUNKS = TK / CHUNK;
    static constexpr int HALF = TK * ROWB; // K (or V) of one stage
    static constexpr int STAGE = 2 * HALF;
    static constexpr int RING = STAGES * STAGE;
    static constexpr int SMEM = RING + 2 * STAGES * 8; // + full[] and empty[] mbarriers
    static_assert(RING % 16 == 0, "mbarriers need 8-byte alignment");
    // The merge reuses the ring: 64 query states x (D + 4) floats + (m, l, M, L).
    static_assert(64 * (D + 4) * 4 + 4 * 64 * 4 <= RING, "merge area");
};

template <typename T> struct IsF32 { static constexpr bool value = false; };
template <> struct IsF32<float> { static constexpr bool value = true; };

using flashrt::smem_u32;

// ---- mbarriers and TMA bulk copies (sm_90) -----------------------------------------------

using flashrt::mbar_arrive_expect_tx;
using flashrt::mbar_fence_init;
using flashrt::mbar_init;
using flashrt::mbar_wait;

static __device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst` (both 16-byte aligned), counted on
// mbarrier `bar` as complete_tx.
static __device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// ---- warp-level matrix primitives ----------------------------------------------------------

using flashrt::ldsm_x4;
using flashrt::ldsm_x4_t;

// Transpose of an 8x8 b16 matrix held in the standard fragment layout (lane: row lane / 4,
// columns 2 (lane % 4) .. + 1).
static __device__ __forceinline__ uint32_t movm_t(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

using flashrt::Mma; // kernels/common.cuh

// Split piece [lo, hi) of row r (empty when lo >= hi); a function of n_r and S only.
static __device__ __forceinline__ void piece_of(int pos, int r, int max_seq, int splits, int split, int& lo,
                                                int& hi) {
    const int n = min(pos + r + 1, max_seq);
    const int per = n > 0 ? (n + splits - 1) / splits : 0;
    const int piece = (per + CHUNK - 1) / CHUNK * CHUNK;
    lo = split * piece;
    hi = min(n, lo + piece);
}

// Offset (floats) of the o region in the partial buffer: after the (m, l) pairs, 16-byte aligned.
static __device__ __forceinline__ size_t o_region(const AttentionDecodeParams& dp) {
    const size_t slots = (size_t)dp.rows * dp.a.q_heads * dp.a.splits;
    return (2 * slots + 3) & ~(size_t)3;
}

// What every warp of a block knows after the prologue.
struct Block {
    int kvh, split, G, hd, S, pos, nq, ntl; // ntl: live column tiles ceil(nq / 8)
    int ulo, uhi, ntiles;                   // union of the rows' pieces, its tiles
    int KG;                                 // key groups
    uint32_t sbase, full, empty;            // shared addresses: ring, full[0], empty[0]
    float* merge;                           // the ring, reused after the loop (ROWS: its own area)
    int tbase;                              // ROWS: the ring's tiles before this row's
};

// A batched step's rows, one after another in each block (`attention_decode_rows_d<D>`): a
// ring of ROWS_STAGES stages and the merge area after it (not in the ring), so the producers
// stream the next row's tiles while the consumers merge this row's.
constexpr int ROWS_STAGES = 4;
template <typename T, int D> struct RowsShape {
    using Sh = Shape<T, D>;
    static constexpr int RING = ROWS_STAGES * Sh::STAGE;
    static constexpr int MERGE = 64 * (D + 4) * 4 + 4 * 64 * 4; // as the static_assert above
    static constexpr int SMEM = RING + MERGE + 2 * ROWS_STAGES * 8;
};

// The consumer warps' own barrier (the producers do not take part; id 0 is __syncthreads').
static __device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" ::"n"(WARPS * 32) : "memory");
}

// Merge area (floats, at the ring's start, or after it in the ROWS kernel): m, l [KG][NQS]; M, L [NQS]; o [KG][NQS][D + 4]
// (the + 4 keeps the fragment-order stores free of bank conflicts), NQS = 8 ntl.
template <int D> struct Merge {
    float *m, *l, *M, *L, *o;
    static constexpr int DS = D + 4;
    __device__ __forceinline__ Merge(float* base, int KG, int nqs) {
        m = base;
        l = m + KG * nqs;
        M = l + KG * nqs;
        L = M + nqs;
        o = L + nqs; // 2 KG nqs + 2 nqs floats: a multiple of 16 (nqs is a multiple of 8)
    }
};

// One consumer warp: its key group `kgi`, column tile `nt` and dim part `dpart` (DPT 16-dim
// tiles from 16 DPT dpart); inactive warps only pace the ring. Ends with the block-wide barrier
// that frees the ring (ROWS: the consumer warps' barrier, after which the previous row's merge
// is done with the merge area), then stores the warp's state in the merge area.
template <typename T, int D, int DPT, bool ROWS = false>
static __device__ __forceinline__ void consume(const AttentionParams& p, const Block& b, int kgi, bool active, int nt,
                                               int dpart) {
    constexpr int NST = ROWS ? ROWS_STAGES : STAGES;
    using Sh = Shape<T, D>;
    constexpr bool F32 = IsF32<T>::value;
    constexpr int KS = D / 16;                 // k-steps of S^T
    constexpr int NCHAIN = KS < 4 ? KS : 4;    // independent accumulator chains of S^T
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int G = b.G, hd = b.hd, KG = b.KG;
    extern __shared__ __align__(128) unsigned char dec_smem[];

    // The two query columns of this lane's accumulators (2 t4 + j) and their pieces.
    int qlo[2], qhi[2];
    const T* qcol[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int i = nt * 8 + 2 * t4 + j;
        qlo[j] = 0;
        qhi[j] = 0;
        qcol[j] = nullptr;
        if (active && i < b.nq) {
            piece_of(b.pos, i / G, p.max_seq, b.S, b.split, qlo[j], qhi[j]);
            qcol[j] = static_cast<const T*>(p.q) + (size_t)(i / G) * p.ld_q + (size_t)(b.kvh * G + i % G) * hd;
        }
    }

    // Q as the B operand of S^T = K Q^T: query nt * 8 + g, dims 16 ks + 2 t4 (+ 8) .. + 1.
    uint32_t qf[F32 ? 1 : KS][2];
    if constexpr (!F32) {
        const int i = nt * 8 + g;
        const bool ok = active && i < b.nq;
        const uint16_t* qr = ok ? reinterpret_cast<const uint16_t*>(static_cast<const T*>(p.q) +
                                                                    (size_t)(i / G) * p.ld_q +
                                                                    (size_t)(b.kvh * G + i % G) * hd)
                                : nullptr;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
            for (int h2 = 0; h2 < 2; ++h2) {
                const int d = 16 * ks + 8 * h2 + 2 * t4;
                qf[ks][h2] = ok && d < hd ? (uint32_t)__ldg(qr + d) | ((uint32_t)__ldg(qr + d + 1) << 16) : 0u;
            }
        }
    }

    const float sl2 = p.scale * 1.4426950408889634f;
    const int dt0 = dpart * DPT; // first 16-dim tile of this warp's O
    float o[DPT][4];
#pragma unroll
    for (int dt = 0; dt < DPT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int tile = 0; tile < b.ntiles; ++tile) {
        const int gt = ROWS ? b.tbase + tile : tile; // the ring's tile count
        const int st = gt % NST;
        mbar_wait(b.full + 8 * st, (uint32_t)(gt / NST) & 1u);
        const uint32_t kst = b.sbase + st * Sh::STAGE, vst = kst + Sh::HALF;
        const int t0 = b.ulo + tile * Sh::TK;
        const int jfirst = ((kgi - (t0 / CHUNK) % KG) % KG + KG) % KG; // first chunk of this group
        for (int jc = active ? jfirst : Sh::CHUNKS; jc < Sh::CHUNKS; jc += KG) {
            const int k0 = t0 + jc * CHUNK;
            if (k0 >= b.uhi) break;
            bool need = false;
#pragma unroll
            for (int j = 0; j < 2; ++j) need |= qlo[j] < qhi[j] && qlo[j] < k0 + CHUNK && qhi[j] > k0;
            if (!__any_sync(0xffffffffu, need)) continue;
            const int r0 = jc * CHUNK; // first tile row of the chunk

            // s[e]: key k0 + g + 8 (e / 2), query column 2 t4 + e % 2 (the C fragment layout).
            float s[4];
            if constexpr (!F32) {
                float acc[NCHAIN][4];
#pragma unroll
                for (int c = 0; c < NCHAIN; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
                const uint32_t ka = kst + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * Sh::ROWB + (lane >> 4) * 16;
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    uint32_t a[4];
                    ldsm_x4(a, ka + ks * 32);
                    Mma<T>::run(acc[ks % NCHAIN], a, qf[ks][0], qf[ks][1]);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if constexpr (NCHAIN == 4)
                        s[e] = (acc[0][e] + acc[1][e]) + (acc[2][e] + acc[3][e]);
                    else if constexpr (NCHAIN == 2)
                        s[e] = acc[0][e] + acc[1][e];
                    else
                        s[e] = acc[0][e];
                }
            } else {
                const unsigned char* kt = dec_smem + (kst - b.sbase);
                const int ra = r0 + g, rb = ra + 8;
                s[0] = s[1] = s[2] = s[3] = 0.0f;
                for (int c = 0; c < D / 4 && c * 4 < hd; ++c) {
                    const float4 ka = *reinterpret_cast<const float4*>(kt + ra * Sh::ROWB + c * 16);
                    const float4 kb = *reinterpret_cast<const float4*>(kt + rb * Sh::ROWB + c * 16);
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        float4 q = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        if (qcol[j]) {
                            const float* qp = reinterpret_cast<const float*>(qcol[j]) + 4 * c;
                            q = make_float4(__ldg(qp), __ldg(qp + 1), __ldg(qp + 2), __ldg(qp + 3));
                        }
                        s[j] += q.x * ka.x + q.y * ka.y + q.z * ka.z + q.w * ka.w;
                        s[2 + j] += q.x * kb.x + q.y * kb.y + q.z * kb.z + q.w * kb.w;
                    }
                }
            }

            // Online softmax per query column; out-of-piece keys weigh exactly 0 and a chunk with
            // none of the column's keys leaves its state bit-for-bit unchanged.
            float pe[4];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float sc[2];
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int key = k0 + g + 8 * hh;
                    sc[hh] = key >= qlo[j] && key < qhi[j] ? s[2 * hh + j] * sl2 : -INFINITY;
                }
                float mx = fmaxf(sc[0], sc[1]);
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
                const float mnew = fmaxf(m[j], mx);
                const float corr = mnew == m[j] ? 1.0f : exp2f(m[j] - mnew);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) pe[2 * hh + j] = sc[hh] == -INFINITY ? 0.0f : exp2f(sc[hh] - mnew);
                l[j] = l[j] * corr + (pe[j] + pe[2 + j]);
                m[j] = mnew;
#pragma unroll
                for (int dt = 0; dt < DPT; ++dt) {
                    o[dt][j] *= corr;
                    o[dt][2 + j] *= corr;
                }
            }

            // O^T[dims][queries] += V^T P^T over this warp's dims.
            if constexpr (!F32) {
                const uint32_t b0 = movm_t(Mma<T>::pack(pe[0], pe[1]));
                const uint32_t b1 = movm_t(Mma<T>::pack(pe[2], pe[3]));
                const uint32_t va = vst + (r0 + (lane & 7) + (lane >> 4) * 8) * Sh::ROWB + ((lane >> 3) & 1) * 16 +
                                    dt0 * 32;
#pragma unroll
                for (int dt = 0; dt < DPT; ++dt) {
                    uint32_t a[4];
                    ldsm_x4_t(a, va + dt * 32);
                    Mma<T>::run(o[dt], a, b0, b1);
                }
            } else {
                const unsigned char* vt = dec_smem + (vst - b.sbase);
                float pk[2][CHUNK];
#pragma unroll
                for (int k = 0; k < CHUNK; ++k) {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        pk[j][k] = __shfl_sync(0xffffffffu, pe[(k >> 3) * 2 + j], (k & 7) * 4 + t4);
                }
#pragma unroll
                for (int dt = 0; dt < DPT; ++dt) {
                    if (16 * (dt0 + dt) >= hd) continue;
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int d = 16 * (dt0 + dt) + g + 8 * hh;
#pragma unroll
                        for (int k = 0; k < CHUNK; ++k) {
                            const float v = *reinterpret_cast<const float*>(vt + (r0 + k) * Sh::ROWB + d * 4);
#pragma unroll
                            for (int j = 0; j < 2; ++j) o[dt][2 * hh + j] += pk[j][k] * v;
                        }
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(b.empty + 8 * st);
    }

#pragma unroll
    for (int j = 0; j < 2; ++j) {
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 4);
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 8);
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 16);
    }
    // (1) every tile consumed: the ring is free for the merge (ROWS: the previous row's merge
    // is done with the merge area).
    if constexpr (ROWS)
        consumers_sync();
    else
        __syncthreads();
    if (!active) return;
    const int nqs = 8 * b.ntl;
    Merge<D> mg(b.merge, KG, nqs);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int q = kgi * nqs + nt * 8 + 2 * t4 + j;
        if (dpart == 0 && g == 0) {
            mg.m[q] = m[j];
            mg.l[q] = l[j];
        }
#pragma unroll
        for (int dt = 0; dt < DPT; ++dt) {
            mg.o[q * Merge<D>::DS + 16 * (dt0 + dt) + g] = o[dt][j];
            mg.o[q * Merge<D>::DS + 16 * (dt0 + dt) + g + 8] = o[dt][2 + j];
        }
    }
}

} // namespace flashrt_dec

// Four outputs rounded to T; with a fused output gate `g` (the four gates of those columns),
// each times act(g) as the plan's `Mul` computes it (elementwise.cu `mul` / `mul_vec`: in f32
// on the rounded output, rounded again), so the fused and separate launches agree bit for bit.
template <typename T>
static __device__ __forceinline__ void dec_store4(T* o, float4 v, const T* g, int act) {
    T r[4] = {flashrt::from_f32<T>(v.x), flashrt::from_f32<T>(v.y), flashrt::from_f32<T>(v.z),
              flashrt::from_f32<T>(v.w)};
    if (g) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
            r[e] = flashrt::from_f32<T>(flashrt::apply_act(act, flashrt::to_f32(g[e])) * flashrt::to_f32(r[e]));
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = r[e];
}

// The ring's mbarriers (full: the two producers; empty: the consumer warps) and, where head_dim
// < D, the zeros of dims hd .. D - 1 of every ring row (the copies never write them); ends with
// the block barrier before the producers start.
template <typename T, int D, int NST>
static __device__ __forceinline__ void ring_init(const flashrt_dec::Block& b) {
    using namespace flashrt_dec;
    using Sh = Shape<T, D>;
    extern __shared__ __align__(128) unsigned char dec_smem[];
    const int tid = threadIdx.x, hd = b.hd;
    if (tid == 0) {
        for (int s = 0; s < NST; ++s) {
            mbar_init(b.full + 8 * s, 2);
            mbar_init(b.empty + 8 * s, WARPS);
        }
        mbar_fence_init();
    }
    if (hd < D) {
        const int nch = (D - hd) * Sh::ES / 16, nrows = NST * 2 * Sh::TK;
        for (int idx = tid; idx < nrows * nch; idx += THREADS) {
            const int row = idx / nch, c = idx - row * nch;
            *reinterpret_cast<uint4*>(dec_smem + row * Sh::ROWB + hd * Sh::ES + c * 16) = make_uint4(0, 0, 0, 0);
        }
    }
    __syncthreads();
}

// A producer warp's copies of tiles [0, ntiles) of keys [lo, hi) (K or V rows at `src`, one
// bulk copy per key row; rows past hi repeat its last row, so each stage receives exactly 2 TK
// row_bytes), tile t into ring tile gt0 + t of an NST-stage ring. (A bulk copy takes
// warp-uniform operands: the lanes' copies are issued one after the other.)
template <typename T, int D, int NST>
static __device__ __forceinline__ void produce(const flashrt_dec::Block& b, bool is_v, const T* src, size_t kv_stride,
                                               int lo, int hi, int ntiles, int gt0) {
    using namespace flashrt_dec;
    using Sh = Shape<T, D>;
    const int lane = threadIdx.x & 31;
    const uint32_t row_bytes = (uint32_t)(b.hd * Sh::ES);
    for (int tile = 0; tile < ntiles; ++tile) {
        const int gt = gt0 + tile;
        const int st = gt % NST;
        if (gt >= NST) mbar_wait(b.empty + 8 * st, (uint32_t)(gt / NST - 1) & 1u);
        const uint32_t full = b.full + 8 * st;
        if (lane == 0) mbar_arrive_expect_tx(full, Sh::TK * row_bytes);
        __syncwarp();
        const uint32_t dst = b.sbase + st * Sh::STAGE + (is_v ? Sh::HALF : 0);
        const int t0 = lo + tile * Sh::TK;
        for (int j = lane; j < Sh::TK; j += 32)
            bulk_g2s(dst + j * Sh::ROWB, src + (size_t)min(t0 + j, hi - 1) * kv_stride, row_bytes, full);
    }
}

// A consumer warp's share of the block's tiles (`consume` at its dim-part width DP).
template <typename T, int D, bool ROWS>
static __device__ __forceinline__ void consume_dp(const AttentionParams& p, const flashrt_dec::Block& b, int DP,
                                                  int kgi, bool active, int nt, int dpart) {
    using namespace flashrt_dec;
    constexpr int KS = D / 16;
    switch (DP) {
    case 1: consume<T, D, KS, ROWS>(p, b, kgi, active, nt, dpart); break;
    case 2: consume<T, D, KS / 2, ROWS>(p, b, kgi, active, nt, dpart); break;
    case 4: consume<T, D, KS / 4, ROWS>(p, b, kgi, active, nt, dpart); break;
    default:
        if constexpr (KS >= 8) consume<T, D, KS / 8, ROWS>(p, b, kgi, active, nt, dpart);
        break;
    }
}

// Merge the KG key groups of each query (fixed order) and write the result (the partial
// state of split b.split, or with one split the output), once every warp's state is in the
// merge area: by all THREADS (barriers __syncthreads), or with ROWS by the consumer warps alone.
template <typename T, int D, bool ROWS>
static __device__ __forceinline__ void merge_store(const AttentionDecodeParams& dp, const AttentionParams& p,
                                                   const flashrt_dec::Block& b, int row0, const T* gate) {
    using namespace flashrt_dec;
    constexpr int NT = ROWS ? WARPS * 32 : THREADS;
    auto sync = [] {
        if constexpr (ROWS)
            consumers_sync();
        else
            __syncthreads();
    };
    const int tid = threadIdx.x, S = b.S, hd = b.hd, G = b.G;
    float2* ml = reinterpret_cast<float2*>(p.partial);
    float* po = p.partial + o_region(dp);
    auto slot = [&](int i) { return ((size_t)(row0 + i / G) * p.q_heads + b.kvh * G + i % G) * S + b.split; };
    sync(); // (2) every state is in the merge area

    // Merge the KG key groups of each query (fixed order) and write the result.
    const int nqs = 8 * b.ntl, KG = b.KG;
    Merge<D> mg(b.merge, KG, nqs);
    for (int i = tid; i < b.nq; i += NT) {
        float M = -INFINITY;
        for (int k = 0; k < KG; ++k) M = fmaxf(M, mg.m[k * nqs + i]);
        float L = 0.0f;
        for (int k = 0; k < KG; ++k) {
            const float mk = mg.m[k * nqs + i];
            const float w = mk == M ? 1.0f : exp2f(mk - M);
            L += mg.l[k * nqs + i] * w;
            mg.m[k * nqs + i] = w; // from here on: the group's merge weight
        }
        mg.M[i] = M;
        mg.L[i] = L;
        if (S > 1) ml[slot(i)] = make_float2(M, L);
    }
    sync();
    constexpr int D4 = D / 4;
    for (int idx = tid; idx < b.nq * D4; idx += NT) {
        const int i = idx / D4, d = 4 * (idx - i * D4);
        if (d >= hd || (S > 1 && mg.M[i] == -INFINITY)) continue; // no key of the row here
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int k = 0; k < KG; ++k) {
            const float w = mg.m[k * nqs + i];
            const float4 v = *reinterpret_cast<const float4*>(mg.o + (k * nqs + i) * Merge<D>::DS + d);
            acc.x += v.x * w;
            acc.y += v.y * w;
            acc.z += v.z * w;
            acc.w += v.w * w;
        }
        if (S > 1) {
            *reinterpret_cast<float4*>(po + slot(i) * hd + d) = acc;
        } else {
            const float inv = 1.0f / mg.L[i];
            const size_t col = (size_t)(b.kvh * G + i % G) * hd + d;
            T* orow = static_cast<T*>(p.out) + (size_t)(i / G) * p.ld_out + col;
            dec_store4(orow, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv),
                       gate ? gate + (size_t)(i / G) * dp.ld_gate + col : nullptr, dp.gate_act);
        }
    }
}

template <typename T, int D>
static __device__ __forceinline__ void attention_decode_impl(const AttentionDecodeParams& dp, const int live,
                                                             const int pos_io) {
    using namespace flashrt_dec;
    using Sh = Shape<T, D>;
    constexpr int KS = D / 16;
    extern __shared__ __align__(128) unsigned char dec_smem[];

    const int tid = threadIdx.x, warp = tid >> 5;
    // Row `row0` is this block's first query row: 0, or in a batched step (one row per block,
    // blockIdx.z) the block's row, whose query, output, caches and position are its session's.
    AttentionParams p = dp.a;
    const T* gate = static_cast<const T*>(dp.gate);
    int len, row0 = 0, pos0;
    if (dp.slots) {
        row0 = blockIdx.z;
        if (row0 >= live) return;
        len = 1;
        pos0 = __ldg(dp.rows_pos + row0);
        p.q = static_cast<const T*>(p.q) + (size_t)row0 * p.ld_q;
        p.out = static_cast<T*>(p.out) + (size_t)row0 * p.ld_out;
        if (gate) gate += (size_t)row0 * dp.ld_gate;
        p.cache_k = flashrt::in_slot(p.cache_k, dp.slots, row0);
        p.cache_v = flashrt::in_slot(p.cache_v, dp.slots, row0);
    } else {
        len = min(min(live, dp.rows), MAX_ROWS);
        if (len <= 0) return;
        pos0 = pos_io;
    }

    Block b;
    b.kvh = blockIdx.x;
    b.split = blockIdx.y;
    b.G = p.q_heads / p.kv_heads;
    b.hd = p.head_dim;
    b.S = p.splits;
    b.pos = pos0;
    b.nq = b.G * len;
    b.ntl = (b.nq + 7) / 8;
    const int S = b.S, hd = b.hd, G = b.G;

    float2* ml = reinterpret_cast<float2*>(p.partial);
    auto slot = [&](int i) { return ((size_t)(row0 + i / G) * p.q_heads + b.kvh * G + i % G) * S + b.split; };

    // Union [ulo, uhi) of the rows' pieces.
    b.ulo = 0x7fffffff;
    b.uhi = 0;
    for (int r = 0; r < len; ++r) {
        int lo, hi;
        piece_of(b.pos, r, p.max_seq, S, b.split, lo, hi);
        if (lo < hi) {
            b.ulo = min(b.ulo, lo);
            b.uhi = max(b.uhi, hi);
        }
    }
    if (b.ulo >= b.uhi) { // every row's piece is empty: the combine skips this split
        for (int i = tid; i < b.nq; i += THREADS) ml[slot(i)] = make_float2(-INFINITY, 0.0f);
        return;
    }
    b.ntiles = (b.uhi - b.ulo + Sh::TK - 1) / Sh::TK;

    b.sbase = smem_u32(dec_smem);
    b.full = b.sbase + Sh::RING;
    b.empty = b.full + 8 * STAGES;
    b.merge = reinterpret_cast<float*>(dec_smem);
    ring_init<T, D, STAGES>(b);

    // Warp roles (see the header): KG key groups of WPG warps; in a group, ntl column tiles x DP
    // dim parts.
    const int NT = dp.qtiles;
    b.KG = WARPS / NT;
    const int WPG = WARPS / b.KG;
    int DP = 1;
    while (2 * DP * b.ntl <= WPG && 2 * DP <= KS) DP *= 2;

    if (warp >= WARPS) {
        // Producers (warp WARPS: K, warp WARPS + 1: V): one bulk copy per key row; rows past the
        // union repeat its last row, so each stage receives exactly 2 TK row_bytes. (A bulk copy
        // takes warp-uniform operands: the lanes' copies are issued one after the other.)
        const bool is_v = warp > WARPS;
        const T* src = static_cast<const T*>(is_v ? p.cache_v : p.cache_k) + (size_t)b.kvh * hd;
        produce<T, D, STAGES>(b, is_v, src, (size_t)p.kv_heads * hd, b.ulo, b.uhi, b.ntiles, 0);
        __syncthreads(); // (1), with the consumers
    } else {
        const int kgi = warp / WPG, wi = warp % WPG;
        const bool active = wi < b.ntl * DP;
        const int nt = active ? wi / DP : 0, dpart = active ? wi % DP : 0;
        consume_dp<T, D, false>(p, b, DP, kgi, active, nt, dpart);
    }
    merge_store<T, D, false>(dp, p, b, row0, gate);
}

// A batched step (`attention_decode_rows_d<D>`, `dp.slots` set): grid (kv_heads, S, RB), block z
// runs rows z, z + RB, ... of the step one after another, each exactly as the one-row block of
// `attention_decode_impl` computes it (its session's query, caches, position and piece; the same
// tiles, chunks, key groups and merge), so rows stay bit-identical to their sessions' own steps.
// The ring (ROWS_STAGES stages) runs across rows and the merge area is its own: the producers
// stream row r + 1's tiles while the consumer warps merge row r. One block an SM per (head,
// split) instead of a one-SM block per (head, split, row): 8 rows cost one prologue and their
// tiles, not 8 waves of blocks that each wait on their first loads.
template <typename T, int D>
static __device__ __forceinline__ void attention_decode_rows_impl(const AttentionDecodeParams& dp) {
    using namespace flashrt_dec;
    using Sh = Shape<T, D>;
    using RS = RowsShape<T, D>;
    constexpr int KS = D / 16;
    extern __shared__ __align__(128) unsigned char dec_smem[];

    const int tid = threadIdx.x, warp = tid >> 5;
    const AttentionParams& p = dp.a;
    const int live = flashrt::load_len(p.len);
    Block b;
    b.kvh = blockIdx.x;
    b.split = blockIdx.y;
    b.G = p.q_heads / p.kv_heads;
    b.hd = p.head_dim;
    b.S = p.splits;
    b.nq = b.G;
    b.ntl = (b.nq + 7) / 8;
    b.tbase = 0;
    const int S = b.S, hd = b.hd, G = b.G;
    b.sbase = smem_u32(dec_smem);
    b.merge = reinterpret_cast<float*>(dec_smem + RS::RING);
    b.full = b.sbase + RS::RING + RS::MERGE;
    b.empty = b.full + 8 * ROWS_STAGES;
    ring_init<T, D, ROWS_STAGES>(b);
    // Row r's piece of this split (empty when lo >= hi), as a one-row block cuts it.
    auto piece = [&](int r, int& lo, int& hi) { piece_of(__ldg(dp.rows_pos + r), 0, p.max_seq, S, b.split, lo, hi); };

    if (warp >= WARPS) {
        // Producers, as attention_decode_impl's, over the rows' tiles in order.
        const bool is_v = warp > WARPS;
        int gt = 0; // the ring's tile count
        for (int r = blockIdx.z; r < live; r += gridDim.z) {
            int lo, hi;
            piece(r, lo, hi);
            if (lo >= hi) continue;
            const T* src = static_cast<const T*>(flashrt::in_slot(is_v ? p.cache_v : p.cache_k, dp.slots, r)) +
                           (size_t)b.kvh * hd;
            const int ntiles = (hi - lo + Sh::TK - 1) / Sh::TK;
            produce<T, D, ROWS_STAGES>(b, is_v, src, (size_t)p.kv_heads * hd, lo, hi, ntiles, gt);
            gt += ntiles;
        }
        return;
    }

    const int NT = dp.qtiles;
    b.KG = WARPS / NT;
    const int WPG = WARPS / b.KG;
    int DP = 1;
    while (2 * DP * b.ntl <= WPG && 2 * DP <= KS) DP *= 2;
    const int kgi = warp / WPG, wi = warp % WPG;
    const bool active = wi < b.ntl * DP;
    const int nt = active ? wi / DP : 0, dpart = active ? wi % DP : 0;
    float2* ml = reinterpret_cast<float2*>(p.partial);
    for (int r = blockIdx.z; r < live; r += gridDim.z) {
        AttentionParams pr = p;
        pr.q = static_cast<const T*>(p.q) + (size_t)r * p.ld_q;
        pr.out = static_cast<T*>(p.out) + (size_t)r * p.ld_out;
        const T* gate = dp.gate ? static_cast<const T*>(dp.gate) + (size_t)r * dp.ld_gate : nullptr;
        b.pos = __ldg(dp.rows_pos + r);
        piece(r, b.ulo, b.uhi);
        if (b.ulo >= b.uhi) { // the row's piece is empty: the combine skips this split
            for (int i = tid; i < b.nq; i += WARPS * 32)
                ml[((size_t)r * p.q_heads + b.kvh * G + i) * S + b.split] = make_float2(-INFINITY, 0.0f);
            continue;
        }
        b.ntiles = (b.uhi - b.ulo + Sh::TK - 1) / Sh::TK;
        consume_dp<T, D, true>(pr, b, DP, kgi, active, nt, dpart);
        merge_store<T, D, true>(dp, pr, b, r, gate);
        b.tbase += b.ntiles;
    }
}

// Merge the splits of one (head, row) over COMBINE_COLS float4 columns (block z).
template <typename T>
static __device__ __forceinline__ void attention_decode_combine_impl(const AttentionDecodeParams& dp) {
    using namespace flashrt_dec;
    constexpr int NG = COMBINE_THREADS / COMBINE_COLS; // split groups
    __shared__ float4 red[COMBINE_THREADS];
    const AttentionParams& p = dp.a;
    const int h = blockIdx.x, r = blockIdx.y, tid = threadIdx.x, lane = tid & 31;
    if (r >= flashrt::load_len(p.len)) return;
    const int S = p.splits, hd = p.head_dim;
    const size_t slot0 = ((size_t)r * p.q_heads + h) * S;
    const float2* ml = reinterpret_cast<const float2*>(p.partial) + slot0;
    const int grp = tid / COMBINE_COLS, c = blockIdx.z * COMBINE_COLS + tid % COMBINE_COLS; // float4 column
    const bool on = 4 * c < hd;
    const float* po = p.partial + o_region(dp) + slot0 * hd + 4 * c;

    // Issue this thread's o loads and the (m, l) loads together: one round trip.
    float4 v[COMBINE_PF];
    float mv[COMBINE_PF];
#pragma unroll
    for (int k = 0; k < COMBINE_PF; ++k) {
        const int s = grp + k * NG;
        mv[k] = -INFINITY;
        if (on && s < S) {
            v[k] = *reinterpret_cast<const float4*>(po + (size_t)s * hd);
            mv[k] = ml[s].x;
        }
    }
    constexpr int LPS = MAX_SPLITS / 32; // (m, l) pairs per lane
    float2 mlv[LPS];
#pragma unroll
    for (int k = 0; k < LPS; ++k) mlv[k] = lane + 32 * k < S ? ml[lane + 32 * k] : make_float2(-INFINITY, 0.0f);

    // M (a max: any order) and the denominator (fixed order: per lane, then a tree to lane 0),
    // the same in every warp.
    float M = -INFINITY;
#pragma unroll
    for (int k = 0; k < LPS; ++k) M = fmaxf(M, mlv[k].x);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float den = 0.0f;
#pragma unroll
    for (int k = 0; k < LPS; ++k) den += mlv[k].x == -INFINITY ? 0.0f : mlv[k].y * exp2f(mlv[k].x - M);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) den += __shfl_down_sync(0xffffffffu, den, o);
    den = __shfl_sync(0xffffffffu, den, 0);

    // Unwritten o of an empty split may hold anything: select, never multiply by 0.
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto add = [&](float m, const float4& x) {
        const float w = m == -INFINITY ? 0.0f : exp2f(m - M);
        if (w != 0.0f) {
            acc.x += w * x.x;
            acc.y += w * x.y;
            acc.z += w * x.z;
            acc.w += w * x.w;
        }
    };
#pragma unroll
    for (int k = 0; k < COMBINE_PF; ++k) {
        if (on && grp + k * NG < S) add(mv[k], v[k]);
    }
    if (on) {
        for (int s = grp + COMBINE_PF * NG; s < S; s += NG) add(ml[s].x, *reinterpret_cast<const float4*>(po + (size_t)s * hd));
    }
    red[tid] = acc;
    __syncthreads();
    if (grp == 0 && on) {
        float4 sum = red[tid];
#pragma unroll
        for (int k = 1; k < NG; ++k) {
            const float4 x = red[k * COMBINE_COLS + tid];
            sum.x += x.x;
            sum.y += x.y;
            sum.z += x.z;
            sum.w += x.w;
        }
        const float inv = 1.0f / den;
        const size_t col = (size_t)h * hd + 4 * c;
        T* orow = static_cast<T*>(p.out) + (size_t)r * p.ld_out + col;
        dec_store4(orow, make_float4(sum.x * inv, sum.y * inv, sum.z * inv, sum.w * inv),
                   dp.gate ? static_cast<const T*>(dp.gate) + (size_t)r * dp.ld_gate + col : nullptr, dp.gate_act);
    }
}

// At most 64 registers, so that combine blocks launched early (PDL) fit beside a main block.
// With the output gate fused the launch after the combine is the output projection's matmul:
// let it launch only when the combine ends (an implicit trigger), or its blocks take the SMs
// while the main kernel still runs (0.2 ms a 27B decode step on the H100 with the early
// trigger; even without it, benches/RESULTS.md 2026-12-06 15:35 UTC).
#define FLASHRT_DEC_COMBINE(suffix, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(flashrt_dec::COMBINE_THREADS, 8)                      \
        attention_decode_combine_##suffix(const AttentionDecodeParams p) {                             \
        flashrt::pdl_wait();                                                                            \
        if (!p.gate) flashrt::pdl_trigger();                                                            \
        attention_decode_combine_impl<T>(p);                                                           \
    }
FLASHRT_DEC_COMBINE(bf16, __nv_bfloat16)
FLASHRT_DEC_COMBINE(f16, __half)
FLASHRT_DEC_COMBINE(f32, float)

#define FLASHRT_DEC_ENTRY(D)                                                                           \
    extern "C" __global__ void __launch_bounds__(flashrt_dec::THREADS, 1)                              \
        attention_decode_d##D##_bf16(const AttentionDecodeParams p) {                                  \
        flashrt::prefetch_l2_share(p.pf, p.pf_bytes);                                                   \
        const int len = flashrt::load_len(p.a.len), pos = flashrt::load_pos(p.a.pos);                  \
        flashrt::pdl_enter();                                                                           \
        attention_decode_impl<__nv_bfloat16, D>(p, len, pos);                                          \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(flashrt_dec::THREADS, 1)                              \
        attention_decode_d##D##_f16(const AttentionDecodeParams p) {                                   \
        flashrt::prefetch_l2_share(p.pf, p.pf_bytes);                                                   \
        const int len = flashrt::load_len(p.a.len), pos = flashrt::load_pos(p.a.pos);                  \
        flashrt::pdl_enter();                                                                           \
        attention_decode_impl<__half, D>(p, len, pos);                                                 \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(flashrt_dec::THREADS, 1)                              \
        attention_decode_d##D##_f32(const AttentionDecodeParams p) {                                   \
        flashrt::prefetch_l2_share(p.pf, p.pf_bytes);                                                   \
        const int len = flashrt::load_len(p.a.len), pos = flashrt::load_pos(p.a.pos);                  \
        flashrt::pdl_enter();                                                                           \
        attention_decode_impl<float, D>(p, len, pos);                                                  \
    }

FLASHRT_DEC_ENTRY(64)
FLASHRT_DEC_ENTRY(128)
FLASHRT_DEC_ENTRY(256)

// `attention_decode_rows_d<D>`: a batched step's rows in each block (attention_decode_rows_impl).
#define FLASHRT_DEC_ROWS_ENTRY(D, suffix, T)                                                           \
    extern "C" __global__ void __launch_bounds__(flashrt_dec::THREADS, 1)                              \
        attention_decode_rows_d##D##_##suffix(const AttentionDecodeParams p) {                         \
        flashrt::prefetch_l2_share(p.pf, p.pf_bytes);                                                   \
        flashrt::pdl_enter();                                                                           \
        attention_decode_rows_impl<T, D>(p);                                                           \
    }
#define FLASHRT_DEC_ROWS_ENTRIES(D)                                                                    \
    FLASHRT_DEC_ROWS_ENTRY(D, bf16, __nv_bfloat16)                                                     \
    FLASHRT_DEC_ROWS_ENTRY(D, f16, __half)                                                             \
    FLASHRT_DEC_ROWS_ENTRY(D, f32, float)
FLASHRT_DEC_ROWS_ENTRIES(64)
FLASHRT_DEC_ROWS_ENTRIES(128)
FLASHRT_DEC_ROWS_ENTRIES(256)
