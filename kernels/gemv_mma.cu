// flashrt kernels: matrix-vector products over FP8 weights on the tensor cores (`gemv8m_*`),
// the decode and verify steps' `Linear`s (at most 8 rows) when the weights are E4M3 codes with
// block scales spanning a power-of-two multiple of 128 columns (Qwen's 128 x 128).
//
// Why not the CUDA cores (`gemv8_*` in gemv.cu): W8A16 there converts every code to f32 (one
// `cvt.f16x2.e4m3x2` per two codes plus one f16 -> f32 conversion per code) before its FMA, and
// by instruction count that bounds it near 2.5 TB/s of weights, short of the ~4 TB/s a decode
// step can stream. Here a pair of codes costs the one `cvt.f16x2.e4m3x2` (its f16 values are
// exact) and the products run as `mma.sync.m16n8k16` f16 x f16 with f32 accumulation: the R <= 8
// input rows are the MMA's n = 8 columns (columns past R are zeros), so one to eight rows cost
// the same.
//
// Inputs as f16. Each input row r is scaled by a power of two f_r = 2^(15 - E) where E is the
// binary exponent of its largest magnitude, so every element fits f16 (|x f_r| < 2^15) and
// converts exactly (16-bit float inputs have at most 11 significant bits; only elements below
// 2^-39 of the row's largest lose bits, to f16 subnormals). The result is scaled back by 1 / f_r
// in f32, exactly. f_r depends on row r alone, so rows round alike at any R.
//
// Work split (stream-K). A tile is 16 weight rows: two halves of 8 (rows j0 .. j0 + 7 and
// j0 + 8 .. j0 + 15 of one matrix, or in `glu` mode gate rows j0 .. j0 + 7 and the up rows with
// the same indices) over all of k, in 128-wide steps (a step never straddles a scale block).
// The launch's S = tiles x k / 128 steps, tile after tile, are dealt to its TW warps as equal
// contiguous ranges (the grid is a few resident blocks per SM, chosen by the host from the shape
// alone), so every warp streams the same bytes without pause from its first step to its last,
// across tile boundaries: no block waits on another, no wave is half empty, and the prologue
// runs once per block. Per step, lane (g, q) (g = lane / 4, q = lane % 4) needs 32 weights of
// tile row g and 32 of row g + 8 (codes 32q .. 32q + 31; 16-bit weights columns 16q .. 16q + 15
// and 64 + 16q .. 64 + 16q + 15) and the inputs of input row g at the same columns when g < R.
// The weights are loaded as whole 128-byte lines, 4 rows per instruction (16-byte streaming
// loads past L1), and moved to the lanes that need them by shuffles (`gemvm_exchange`): loads in
// the fragments' own layout (4 lanes, 64 bytes per row per instruction) stream at only ~3.3 TB/s.
// The MMA's k order is a permutation of the step's columns (logical columns 2q, 2q + 1, 2q + 8,
// 2q + 9 of MMA t are the lane's t-th group of 4 columns), the same for both operands. Each warp
// keeps a ring of steps in flight (its first slots requested before the prologue, the rest
// after it, refilled as used). A step's sums are scaled by
// each row's block scale and accumulated in f32. A tile whose steps fall to two or more warps
// (at most one tile per warp boundary) is finished by the one holding its last steps, from
// shares published mid-stream: each warp streams its tiles last first, so every other
// contributor streams that tile first and publishes its share at once to its slot in `part`
// as tagged 64-bit words (relaxed stores: no fence, no counter), and the finisher, which
// streams that tile last of its own, reads them in warp order when its stream ends, clears
// them and stores the sum (see `finish` in gemv8m_impl; the work split is emulated and checked
// by benches/kernels/gemvm_split_check.py). Every output is thus the same sum in the same
// order whatever R is and whatever the timing. (Until 2026-12-07 the last contributor to
// arrive finished a tile, after a release / acquire counter: 0.3-0.4 ms slower per FP8 27B
// step on an H100, benches/RESULTS.md.)
//
// Prologue: one pass over the R input rows from L2 takes each row's largest magnitude (with a
// fused RMSNorm, `norm`: its sum of squares and the largest |x * s|, s the norm weight) and,
// when they fit in the dynamic shared memory (`stage`; always with the norm), stores the rows
// there; then the staged rows become their f16 operands in place — after the norm, normalised
// and rounded to the element type first, as the separate `rms_norm` op stores them (block 0
// also writes those to `norm_out`). Rows not staged are read from global memory and converted
// at each step. Rows of shared memory are padded (16 bytes; 64 for 16-bit weights): the
// fragment loads are conflict-free. The epilogue is gemv.cu's: outputs in the element type or f32 (accumulating
// when asked), or the glu product from the rounded gate and up values.
//
// Traffic: n * k bytes of codes plus the scales; R * k input elements per block from L2; per
// share of a split tile 1 KiB (128 tagged words) written, read and cleared through L2.
// Requires k % 128 == 0, k >= 128 x the ring depth, 16-byte aligned rows, and with the norm
// R * (k + pad) 16-bit elements of shared memory (the host checks and otherwise uses
// `gemv8_*`).
//
// 16-bit weights (`gemv16m_*`, the same kernel with W16): bf16/f16 weights are already MMA
// operands, so the rows x weights products run on the tensor cores (bf16 x bf16 or f16 x f16,
// f32 accumulation) with no conversion at all: a lane's 32 columns of a tile row are 64 bytes
// (four 16-byte loads, at 16q + 64i bytes of the step's 256), the inputs are the rows as stored (no power-of-two scaling: they are
// operands of their own type), and there are no block scales. On the CUDA cores (`gemv_*` in
// gemv.cu) every weight element costs an f32 conversion and one FMA per input row, so R rows
// cost R times the instructions and a verify or batched step of 5 to 8 rows is compute-bound
// (2 to 5 times a decode step on the H200); here one to eight rows cost one step's weight bytes.
// Each output is the same sum in the same order whatever R is (rows are MMA columns), so decode,
// verify and batched steps round alike, as the CUDA-core kernel's rows do.
#include "common.cuh"

#define GEMVM_STEP 128
#ifndef GEMVM_WARPS
#define GEMVM_WARPS 8
#endif
// Blocks per SM (the register budget: 128 per thread) and steps each warp keeps in flight:
// 4 KiB steps of 16-bit weights, 2 KiB of codes, so 8 KiB per warp, 128 KiB per SM either way.
#ifndef GEMVM_MINB
#define GEMVM_MINB 2
#endif
#ifndef GEMVM16_RING
#define GEMVM16_RING 2
#endif
#ifndef GEMVM8_RING
#define GEMVM8_RING 2
#endif
// Ring slots requested before the prologue (the rest after it): a warp requesting a slot waits
// while its SM's requests in flight are at their limit (~2 us at the start of a launch), and the
// prologue's own loads wait behind them (measured with benches/kernels/gemvm_micro.cu's probes).
#ifndef GEMVM16_RING_EARLY
#define GEMVM16_RING_EARLY 1
#endif
#ifndef GEMVM8_RING_EARLY
#define GEMVM8_RING_EARLY 2
#endif
// Shared-memory row padding of the staged inputs (elements): the input loads of a warp's lanes
// (rows g, columns 16q or 32q of a step) spread over the banks.
#define GEMVM_PAD 8

// Share words (`part`): 64-bit relaxed accesses at GPU scope (single-copy atomic).
static __device__ __forceinline__ void gemvm_st_tagged(unsigned long long* a, unsigned long long v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
static __device__ __forceinline__ unsigned long long gemvm_ld_tagged(const unsigned long long* a) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
    return v;
}

// Two E4M3 codes (first code in the low byte) as an f16x2 (exact).
static __device__ __forceinline__ uint32_t gemvm_codes(unsigned short c) {
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(c));
    return h;
}

static __device__ __forceinline__ void gemvm_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void gemvm_mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                      uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t gemvm_word(const uint4 (&v)[4], int i) {
    const uint4 u = v[i >> 2];
    switch (i & 3) {
    case 0: return u.x;
    case 1: return u.y;
    case 2: return u.z;
    default: return u.w;
    }
}

// Word i (< 8) of two 16-byte values.
static __device__ __forceinline__ uint32_t gemvm_word2(const uint4* v, int i) {
    const uint4 u = v[i >> 2];
    switch (i & 3) {
    case 0: return u.x;
    case 1: return u.y;
    case 2: return u.z;
    default: return u.w;
    }
}

// 8 values times f as f16 (round to nearest even; exact for the scaled inputs).
static __device__ __forceinline__ uint4 gemvm_f16x8(const float (&v)[8], float f) {
    uint4 o;
    uint32_t* w = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 h = __floats2half2_rn(v[2 * i] * f, v[2 * i + 1] * f);
        w[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    return o;
}

template <typename T> struct GemvmIsBf16 { static constexpr bool value = false; };
template <> struct GemvmIsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// The power of two that brings a row whose largest magnitude is `amax` below 2^15.
static __device__ __forceinline__ float gemvm_row_scale(float amax) {
    if (!(amax > 0.0f) || isinf(amax)) return 1.0f;
    int e;
    frexpf(amax, &e); // amax = m 2^e, 0.5 <= m < 1
    return ldexpf(1.0f, min(max(15 - e, -120), 120));
}

// A 16-byte value from lane `src`.
static __device__ __forceinline__ uint4 gemvm_shfl(uint4 v, int src) {
    v.x = __shfl_sync(0xffffffffu, v.x, src);
    v.y = __shfl_sync(0xffffffffu, v.y, src);
    v.z = __shfl_sync(0xffffffffu, v.z, src);
    v.w = __shfl_sync(0xffffffffu, v.w, src);
    return v;
}

// Loads to fragments. A load instruction reads 4 rows x 128 contiguous bytes (lane 8a + b: row
// 4 rg + a of the half, bytes 16b of the column block; `in0`, `in1`: rg = 0, 1), whole cache
// lines, which streams at the full bandwidth where the fragments' own layout (4 lanes per row,
// 64 bytes per row per instruction) does not (3.3 against 4.2 TB/s measured on the H200,
// benches/kernels/gemv_pattern_micro.cu). Lane (g, q) needs 32 bytes of row g: pieces
// b = 2q and 2q + 1 (slots `s0`, `s1`), held by lanes 8 (g % 4) + 2q + e of instruction rg =
// g / 4. Rows g < 4 take piece 2q + e in exchange e, rows g >= 4 piece 2q + 1 - e, so every
// source lane is read once per exchange and passes the instruction its reader wants.
static __device__ __forceinline__ void gemvm_exchange(uint4 in0, uint4 in1, int lane, uint4& s0, uint4& s1) {
    const int g = lane >> 2, q = lane & 3;
    const bool lo = g < 4, odd = lane & 1;
    const int base = 8 * (g & 3) + 2 * q;
    const uint4 r0 = gemvm_shfl(odd ? in1 : in0, base + (lo ? 0 : 1));
    const uint4 r1 = gemvm_shfl(odd ? in0 : in1, base + (lo ? 1 : 0));
    s0 = lo ? r0 : r1;
    s1 = lo ? r1 : r0;
}

// Stream-K: warp `gw` of the launch's TW warps takes the global steps [gw S / TW, (gw + 1) S / TW)
// of the S = tiles x (k / 128) steps (tile-major), so every warp streams the same number of
// steps (to one) whatever the shape. The warp owning global step `a`:
// the largest w with floor(w S / TW) <= a.
static __device__ __forceinline__ int gemvm_owner(long long a, long long S, long long tw) {
    return (int)(((a + 1) * tw + S - 1) / S - 1);
}

// Tile t of the launch: its matrix `mi` and its first output row `j0` (glu: gate/up pair index).
static __device__ __forceinline__ void gemvm_tile(const GemvParams& p, int t, int& mi, int& j0) {
    mi = 0;
    if (p.glu) {
        j0 = t * 8;
        return;
    }
    gemv_tile_in(p, t, mi);
    j0 = t * 16;
}

// Tile `t`'s finished sums (lane (g, q): v[2h + c] is tile row g + 8h, input row 2q + c) to the
// outputs: the glu product, or the element type / f32 (accumulating when asked).
template <typename T, int R, bool W16>
static __device__ __forceinline__ void gemvm_store(const GemvParams& p, int t, float (&v)[4], int row0,
                                                   const float* row_scale) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int mi, j0;
    gemvm_tile(p, t, mi, j0);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = 2 * q + c;
        if (r >= R) continue;
        if (!W16) v[c] /= row_scale[r], v[2 + c] /= row_scale[r];
        if (p.glu) {
            const int j = j0 + g;
            if (j >= p.m[0].n) continue;
            const T gt = flashrt::from_f32<T>(v[c]);
            const T ut = flashrt::from_f32<T>(v[2 + c]);
            static_cast<T*>(p.m[0].out)[(size_t)r * p.m[0].ld_out + j] = gt;
            static_cast<T*>(p.m[1].out)[(size_t)r * p.m[1].ld_out + j] = ut;
            const float y = flashrt::apply_act(p.act, flashrt::to_f32(gt)) * flashrt::to_f32(ut);
            static_cast<T*>(p.glu_out)[(size_t)r * p.ld_glu + j] = flashrt::from_f32<T>(y);
            continue;
        }
        const GemvMat& m = p.m[mi];
        // The previous values first (all loads in flight together, before any store).
        float prev[2] = {0.0f, 0.0f};
        if (p.accumulate)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = j0 + g + 8 * h;
                if (j >= m.n) continue;
                const size_t o = (size_t)(r + row0) * m.ld_out + j;
                prev[h] = p.out_f32 ? __ldcg(static_cast<const float*>(m.out) + o)
                                    : flashrt::to_f32(static_cast<const T*>(m.out)[o]);
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + g + 8 * h;
            if (j >= m.n) continue;
            const size_t o = (size_t)(r + row0) * m.ld_out + j;
            if (p.out_f32)
                static_cast<float*>(m.out)[o] = p.accumulate ? prev[h] + v[2 * h + c] : v[2 * h + c];
            else
                static_cast<T*>(m.out)[o] = flashrt::from_f32<T>(v[2 * h + c] + prev[h]);
        }
    }
}

// Weights of type T (`gemv16m_*`, W16) or E4M3 codes with block scales (`gemv8m_*`); blocks of
// GEMVM_WARPS warps, the grid chosen by the host from the shape alone. Waits for the previous
// launch itself (PDL).
template <typename T, int R, bool NORM, bool W16 = false>
static __device__ __forceinline__ void gemv8m_impl(const GemvParams& p) {
    constexpr int WARPS = GEMVM_WARPS;
    constexpr int RING = W16 ? GEMVM16_RING : GEMVM8_RING;
    constexpr int EARLY = W16 ? GEMVM16_RING_EARLY : GEMVM8_RING_EARLY;
    constexpr int WB = W16 ? 2 : 1;       // weight bytes per element
    constexpr int NLD = W16 ? 8 : 4;      // 16-byte weight loads per step (both halves)
    constexpr bool BF16 = W16 && GemvmIsBf16<T>::value;
    extern __shared__ __align__(16) unsigned char gemvm_smem[];
    __shared__ float nred[WARPS][2][R];
    __shared__ float row_scale[R];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    FLASHRT_MARK(0);
    const int k = p.k, spt = k / GEMVM_STEP;
    const int tiles = gemv_tile_count(p);
    const long long S = (long long)tiles * spt, TW = (long long)gridDim.x * WARPS;
    const int gw = blockIdx.x * WARPS + warp;
    // (S < 2^31: the host checks.)
    const int i0 = (int)(gw * S / TW), i1 = (int)((gw + 1) * S / TW);
    const int qshift = W16 ? 0 : __ffs(p.qbc / GEMVM_STEP) - 1;

    // The warp's tiles are streamed last first (see `finish` below): tile t_last (the one its
    // range ends in) first, then whole tiles downwards, tile t_first (the one its range starts
    // in) last; each tile's steps in column order. Tile t's steps in the range: [sb(t), se(t)).
    const int t_first = i0 / spt, t_last = i1 > i0 ? (i1 - 1) / spt : t_first;
    auto sb = [&](int t) { return t == t_first ? i0 - t * spt : 0; };
    auto se = [&](int t) { return t == t_last ? i1 - t * spt : spt; };
    // The fetch cursor: tile `ft`, column step `fs` (its segment ends at `fe`), global steps
    // fetched `fi` (from i0); this lane's two weight rows of the tile (half 0: tile row g, half
    // 1: tile row g + 8; in glu mode gate and up row j0 + g) and their scale rows. Rows past n
    // read row 0 and are never written.
    int ft = t_last, fs = sb(t_last), fe = se(t_last), fi = i0;
    // Loads (see gemvm_exchange): lane 8a + b reads rows 4rg + a of each half, 16 bytes at 16b
    // of each 128-byte column block; the scales are those of its fragment rows g, g + 8.
    const int la = lane >> 3, lb = lane & 7;
    const unsigned char* wr[2][2];
    const float* sr[2] = {nullptr, nullptr};
    auto point = [&](int t) {
        int mi, j0;
        gemvm_tile(p, t, mi, j0);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const GemvMat& m = p.glu ? p.m[h] : p.m[mi];
            const int h0 = p.glu ? j0 : j0 + 8 * h;
#pragma unroll
            for (int rg = 0; rg < 2; ++rg) {
                int j = h0 + 4 * rg + la;
                if (j >= m.n) j = 0;
                wr[h][rg] = static_cast<const unsigned char*>(m.w) + (size_t)j * k * WB + 16 * lb;
            }
            if constexpr (!W16) {
                int j = h0 + g;
                if (j >= m.n) j = 0;
                sr[h] = m.scale + (size_t)(j / p.qbr) * m.scale_ld;
            }
        }
    };
    if (i0 < i1) point(ft);
    // The weights stream through a ring of RING steps per warp, requested before the prologue;
    // each slot is refilled with the warp's next step once used, across tile boundaries. Loads
    // of a step, per half h: W16 wv[4h + 2rg + cb] (column blocks cb of 128 bytes), codes
    // wv[2h + rg].
    uint4 wv[RING][NLD];
    float sv[RING][2];
    auto fetch = [&](int u) {
        if (fi >= i1) return;
        if (fs == fe) {
            --ft;
            fs = sb(ft);
            fe = spt;
            point(ft);
        }
        const size_t kb = (size_t)fs * GEMVM_STEP * WB;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int rg = 0; rg < 2; ++rg) {
                if constexpr (W16) {
                    wv[u][4 * h + 2 * rg] = load_stream(wr[h][rg] + kb);
                    wv[u][4 * h + 2 * rg + 1] = load_stream(wr[h][rg] + kb + 128);
                } else {
                    wv[u][2 * h + rg] = load_stream(wr[h][rg] + kb);
                }
            }
        if constexpr (!W16) {
            sv[u][0] = __ldg(sr[0] + (fs >> qshift));
            sv[u][1] = __ldg(sr[1] + (fs >> qshift));
        }
        ++fs;
        ++fi;
    };
#pragma unroll
    for (int u = 0; u < EARLY; ++u) fetch(u);
    // `p.pf` more steps of the current tile asked of the L2 (lane = tile row: half lane / 8,
    // row lane % 8), so DRAM keeps working while the prologue waits and runs.
    if (p.pf > 0 && fi < i1 && lane < 16) {
        int pt = ft, ps = fs, pe = fe;
        if (ps == pe) --pt, ps = sb(pt), pe = spt;
        const int ns = min(min(p.pf, pe - ps), i1 - fi);
        int mi, j0;
        gemvm_tile(p, pt, mi, j0);
        const int h = lane >> 3;
        const GemvMat& m = p.glu ? p.m[h] : p.m[mi];
        const int j = (p.glu ? j0 : j0 + 8 * h) + (lane & 7);
        if (j < m.n)
            flashrt::prefetch_l2(static_cast<const unsigned char*>(m.w) + (size_t)j * k * WB + (size_t)ps * GEMVM_STEP * WB,
                                 (unsigned)(ns * GEMVM_STEP * WB));
    }
    FLASHRT_MARK(1);
    // Weights and scales are constant while a plan runs, so the first slots fill before the
    // wait for the previous launch (programmatic dependent launch); the inputs are read after
    // it, the other slots requested after the prologue.
    flashrt::pdl_enter();
    FLASHRT_MARK(2);

    const T* x = static_cast<const T*>(p.x);
    const int row0 = p.last_row ? flashrt::load_len(p.len) - 1 : 0;
    x += (size_t)row0 * p.ld_x;

    // Prologue: per row the largest magnitude (and with the norm the sum of squares and the
    // largest |x * s|), the rows staged in shared memory when `stage`.
    const bool stage = NORM || p.stage;
    __half* xs = reinterpret_cast<__half*>(gemvm_smem);
    const int lds = k + GEMVM_PAD, chunks = k >> 3;
    {
        float ss[R], am[R];
#pragma unroll
        for (int r = 0; r < R; ++r) ss[r] = 0.0f, am[r] = 0.0f;
#pragma unroll 4
        for (int c = threadIdx.x; c < chunks; c += WARPS * 32)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const uint4 u = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * p.ld_x) + c);
                if (stage) *reinterpret_cast<uint4*>(xs + (size_t)r * lds + (size_t)c * 8) = u;
                float xf[8];
                flashrt::unpack16<T>(u, xf);
                if (NORM) {
                    float s[8];
                    gemv_norm_weight(p, c, s);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        ss[r] = fmaf(xf[e], xf[e], ss[r]);
                        am[r] = fmaxf(am[r], fabsf(xf[e] * s[e]));
                    }
                } else if (!W16) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) am[r] = fmaxf(am[r], fabsf(xf[e]));
                }
            }
        FLASHRT_MARK(7);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = flashrt::warp_sum(ss[r]);
            float a = am[r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
            if (lane == 0) nred[warp][0][r] = v, nred[warp][1][r] = a;
        }
    }
    __syncthreads();
    FLASHRT_MARK(8);
    float inv[R], f[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float t = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) t += nred[w][0][r], a = fmaxf(a, nred[w][1][r]);
        inv[r] = NORM ? 1.0f / sqrtf(t / (float)k + p.eps) : 1.0f;
        // After the norm an element is at most inv * max|x * s|, rounded: 2^15 leaves room.
        // 16-bit weights take the inputs as they are.
        f[r] = W16 ? 1.0f : gemvm_row_scale(NORM ? a * inv[r] : a);
    }
    if (threadIdx.x < R) row_scale[threadIdx.x] = f[threadIdx.x];
    if (stage && (NORM || !W16)) {
        // Each thread turns the chunks it stored into f16 operands (16-bit weights: into the
        // normalised rows; rows without a norm are operands as stored).
        for (int c = threadIdx.x; c < chunks; c += WARPS * 32)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                uint4* at = reinterpret_cast<uint4*>(xs + (size_t)r * lds + (size_t)c * 8);
                float xf[8];
                flashrt::unpack16<T>(*at, xf);
                if (NORM) {
                    gemv_norm_chunk<T>(p, inv[r], c, xf);
                    if (blockIdx.x == 0) {
                        T v[8];
#pragma unroll
                        for (int e = 0; e < 8; ++e) v[e] = flashrt::from_f32<T>(xf[e]);
                        *reinterpret_cast<uint4*>(static_cast<T*>(p.norm_out) + (size_t)r * p.ld_norm_out +
                                                  (size_t)c * 8) = *reinterpret_cast<const uint4*>(v);
                    }
                }
                if constexpr (W16) {
                    // The rows as stored (after the norm: rounded to T, as `rms_norm` stores them).
                    if (NORM) {
                        T v[8];
#pragma unroll
                        for (int e = 0; e < 8; ++e) v[e] = flashrt::from_f32<T>(xf[e]);
                        *at = *reinterpret_cast<const uint4*>(v);
                    }
                } else {
                    *at = gemvm_f16x8(xf, f[r]);
                }
            }
    }
    __syncthreads();
#pragma unroll
    for (int u = EARLY; u < RING; ++u) fetch(u);
    FLASHRT_MARK(3);
    // The input row this lane feeds (column g of the MMA) and its scale.
    const bool feeds = g < R;
    const float fg = feeds ? row_scale[g] : 0.0f;

    // Split tiles. A tile's steps fall to warps w_f .. w_l of the launch (w_f holds its first
    // steps); w_l, which streams that tile last of all its own, finishes it. Every other
    // contributor streams that tile *first* (it is the tile its range ends in) and publishes
    // its share as soon as it is done, mid-stream, to its slot in `part`: 128 64-bit words
    // (the sum's bits and a tag 1 above them, one relaxed store each: single-copy atomic, so
    // no fence and no counter). When w_l's stream ends, the shares of w_f .. w_l - 1 have
    // usually been there for most of the launch (only a warp whose whole range lies inside
    // the tile publishes at its end); it reads them in warp order (polling a word until its
    // tag is set: the writers are earlier warps, resident or done), clears them for the next
    // launch and stores the sum, added in warp order — a fixed order, so the result depends
    // on neither R nor timing. A warp publishes at most one share (of tile t_last) and
    // finishes at most one (t_first).
    unsigned long long* slots = reinterpret_cast<unsigned long long*>(p.part);
    // The warp's share, to its slot. (GEMVM_NO_FIXUP: a timing bound for
    // benches/kernels/gemvm_micro.cu only, split tiles left unfinished: wrong outputs; never
    // defined in the product.)
    auto publish = [&](float (&a)[4]) {
#ifndef GEMVM_NO_FIXUP
        unsigned long long* mine = slots + (size_t)gw * 128 + lane;
#pragma unroll
        for (int e = 0; e < 4; ++e) gemvm_st_tagged(mine + e * 32, (1ull << 32) | __float_as_uint(a[e]));
#endif
    };
    // A segment before the last: a whole tile, or the share of tile t_last (published).
    auto finish_mid = [&](int t, float (&a)[4]) {
        if (t * spt + se(t) == (t + 1) * spt) {
            float v[4] = {a[0], a[1], a[2], a[3]};
            gemvm_store<T, R, W16>(p, t, v, row0, row_scale);
            return;
        }
        publish(a);
    };
    // The last segment (tile t_first): as one before it when it starts the tile or ends before
    // the tile does (whole, or published); otherwise it holds the tile's last steps, and the
    // warp finishes the tile.
    auto finish = [&](int t, float (&a)[4]) {
        if (sb(t) == 0 || se(t) < spt) {
            finish_mid(t, a);
            return;
        }
#ifdef GEMVM_NO_FIXUP
        return;
#endif
        const int wf = gemvm_owner((long long)t * spt, S, TW);
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        // The shares in warp order, four warps' words in flight at a time. A share not yet all
        // tagged is polled again word-parallel (its four words in flight together): its words
        // land together, and re-reading them one after the other cost the last finisher of a
        // launch ~2 us (measured with benches/kernels/gemvm_micro.cu's probes).
        for (int w0 = wf; w0 < gw; w0 += 4) {
            unsigned long long sh[4][4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (w0 + u >= gw) break;
                const unsigned long long* sl = slots + (size_t)(w0 + u) * 128 + lane;
#pragma unroll
                for (int e = 0; e < 4; ++e) sh[u][e] = gemvm_ld_tagged(sl + e * 32);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (w0 + u >= gw) break;
                unsigned long long* sl = slots + (size_t)(w0 + u) * 128 + lane;
                for (;;) {
                    bool ready = true;
#pragma unroll
                    for (int e = 0; e < 4; ++e) ready &= (sh[u][e] >> 32) == 1ull;
                    if (ready) break;
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if ((sh[u][e] >> 32) != 1ull) sh[u][e] = gemvm_ld_tagged(sl + e * 32);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    v[e] += __uint_as_float((unsigned)sh[u][e]);
                    gemvm_st_tagged(sl + e * 32, 0ull);
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] += a[e];
        gemvm_store<T, R, W16>(p, t, v, row0, row_scale);
    };

    // The consume cursor: tile `ct`, column step `cs`, its segment ending at column step `ce`.
    // A round of RING steps crosses at most one segment boundary (the host requires k >= RING
    // x 128, and only the first segment can be shorter than a tile): steps after it add to
    // `accn`.
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, accn[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int ct = t_last, cs = sb(t_last), ce = se(t_last), i = i0;
    while (i < i1) {
        bool crossed = false;
#pragma unroll
        for (int u = 0; u < RING; ++u) {
            if (i >= i1) break;
            // Inputs of the step at the lane's columns, as operand pairs (the weights' order).
            // (16-bit weights: per column block, below.)
            uint4 xv[4];
            if (!feeds || W16) {
#pragma unroll
                for (int e = 0; e < 4; ++e) xv[e] = make_uint4(0, 0, 0, 0);
            } else if (stage) {
                {
                    const uint4* xp = reinterpret_cast<const uint4*>(xs + (size_t)g * lds + (size_t)cs * GEMVM_STEP + 32 * q);
#pragma unroll
                    for (int e = 0; e < 4; ++e) xv[e] = xp[e];
                }
            } else {
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)g * p.ld_x + (size_t)cs * GEMVM_STEP + 32 * q);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float xf[8];
                    flashrt::unpack16<T>(__ldg(xp + e), xf);
                    xv[e] = gemvm_f16x8(xf, fg);
                }
            }
            const float sc0 = W16 ? 1.0f : sv[u][0], sc1 = W16 ? 1.0f : sv[u][1];
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if constexpr (W16) {
                // Per 128-byte column block cb, the weights as fragments: fr[2h + e] (row g + 8h,
                // columns 64cb + 16q + 8e .. + 7), then MMAs t = 4cb .. 4cb + 3: the lane's words
                // 2t, 2t + 1 of each half and the inputs' same words.
#pragma unroll
                for (int cb = 0; cb < 2; ++cb) {
                    // Inputs 64cb + 16q + 8e .. + 7 of the step (row g).
                    uint4 xw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
                    if (feeds) {
                        const size_t at = (size_t)cs * GEMVM_STEP + 64 * cb + 16 * q;
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            xw[e] = stage ? reinterpret_cast<const uint4*>(xs + (size_t)g * lds + at)[e]
                                          : __ldg(reinterpret_cast<const uint4*>(x + (size_t)g * p.ld_x + at) + e);
                    }
                    uint4 fr[4];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
                        gemvm_exchange(wv[u][4 * h + cb], wv[u][4 * h + 2 + cb], lane, fr[2 * h], fr[2 * h + 1]);
#pragma unroll
                    for (int t = 4 * cb; t < 4 * cb + 4; ++t) {
                        const int w = 2 * t - 8 * cb;
                        const uint32_t a0 = gemvm_word2(fr, w), a2 = gemvm_word2(fr, w + 1);
                        const uint32_t a1 = gemvm_word2(fr + 2, w), a3 = gemvm_word2(fr + 2, w + 1);
                        const uint32_t b0 = gemvm_word2(xw, w), b1 = gemvm_word2(xw, w + 1);
                        if constexpr (BF16)
                            gemvm_mma_bf16(d, a0, a1, a2, a3, b0, b1);
                        else
                            gemvm_mma(d, a0, a1, a2, a3, b0, b1);
                    }
                }
            } else {
                // The weights as fragments: fr[2h + e] (codes 32q + 16e .. + 15 of row g + 8h);
                // MMA t: word t of the lane's 32 codes of each row.
                uint4 fr[4];
#pragma unroll
                for (int h = 0; h < 2; ++h) gemvm_exchange(wv[u][2 * h], wv[u][2 * h + 1], lane, fr[2 * h], fr[2 * h + 1]);
#pragma unroll
                for (int t = 0; t < 8; ++t) {
                    const uint32_t ca = gemvm_word(fr, t), cb = gemvm_word(fr, 8 + t);
                    gemvm_mma(d, gemvm_codes((unsigned short)ca), gemvm_codes((unsigned short)cb),
                              gemvm_codes((unsigned short)(ca >> 16)), gemvm_codes((unsigned short)(cb >> 16)),
                              gemvm_word(xv, 2 * t), gemvm_word(xv, 2 * t + 1));
                }
            }
            // (W16: a scale of 1, so the fma is the sum.)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float sc = e < 2 ? sc0 : sc1;
                if (crossed)
                    accn[e] = fmaf(d[e], sc, accn[e]);
                else
                    acc[e] = fmaf(d[e], sc, acc[e]);
            }
            // The slot is free again: the warp's next step goes into it.
            fetch(u);
            if (i == i0) FLASHRT_MARK(4);
            ++i;
            if (++cs == ce && i < i1) {
                crossed = true;
                cs = sb(ct - 1);
                ce = spt;
            }
        }
        if (crossed) {
            finish_mid(ct, acc);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] = accn[e], accn[e] = 0.0f;
            --ct;
        }
    }
    FLASHRT_MARK(5);
    // The last segment: tile t_first.
    if (i0 < i1) finish(ct, acc);
    FLASHRT_MARK(6);
}

// `gemv8m_r<R>` / `gemv8m_norm_r<R>` (`p.norm` = 1): blocks of GEMVM_WARPS warps, two per SM
// by the register budget.
#define FLASHRT_GEMVM_ENTRY_T(NAME, R, NORM, W16)                                                       \
    extern "C" __global__ void __launch_bounds__(GEMVM_WARPS * 32, GEMVM_MINB) NAME##_bf16(const GemvParams p) { \
        gemv8m_impl<__nv_bfloat16, R, NORM, W16>(p);                                                    \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMVM_WARPS * 32, GEMVM_MINB) NAME##_f16(const GemvParams p) {  \
        gemv8m_impl<__half, R, NORM, W16>(p);                                                           \
    }
// `gemv16m_*`: 16-bit weights on the tensor cores (see the header), same entry points.
#define FLASHRT_GEMVM_ENTRY(R)                                                                           \
    FLASHRT_GEMVM_ENTRY_T(gemv8m_r##R, R, false, false)                                                  \
    FLASHRT_GEMVM_ENTRY_T(gemv8m_norm_r##R, R, true, false)                                              \
    FLASHRT_GEMVM_ENTRY_T(gemv16m_r##R, R, false, true)                                                  \
    FLASHRT_GEMVM_ENTRY_T(gemv16m_norm_r##R, R, true, true)

FLASHRT_GEMVM_ENTRY(1)
FLASHRT_GEMVM_ENTRY(2)
FLASHRT_GEMVM_ENTRY(3)
FLASHRT_GEMVM_ENTRY(4)
FLASHRT_GEMVM_ENTRY(5)
FLASHRT_GEMVM_ENTRY(6)
FLASHRT_GEMVM_ENTRY(7)
FLASHRT_GEMVM_ENTRY(8)
