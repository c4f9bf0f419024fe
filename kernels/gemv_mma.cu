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
// Work split. A tile is 16 weight rows: two halves of 8 (rows j0 .. j0 + 7 and j0 + 8 .. j0 + 15
// of one matrix, or in `glu` mode gate rows j0 .. j0 + 7 and the up rows with the same
// indices), one block per tile. The block's warps split k into 128-wide steps (warp w takes a
// contiguous range of them; a step never straddles a scale block): per step, lane (g, q)
// (g = lane / 4, q = lane % 4) loads 32 codes of tile row g and 32 of row g + 8, at the step's
// columns 16q .. 16q + 15 and 64 + 16q .. 64 + 16q + 15 (16-byte streaming loads past L1; the four
// lanes of a row read 64 contiguous bytes per load), and the 32 inputs of input row g at the
// same columns when g < R. The MMA's k order is a permutation of the step's columns (logical
// columns 2q, 2q + 1, 2q + 8, 2q + 9 of MMA t are the lane's t-th group of 4 columns), the same
// for both operands, so each lane's loads feed its fragments without shuffles. Each warp keeps
// GEMVM_RING steps of weights in flight (the first requested before the prologue). A step's
// partial sums are scaled by each row's block scale and accumulated in f32; the warps' sums
// are added in a fixed order.
//
// Prologue: one pass over the R input rows from L2 takes each row's largest magnitude (with a
// fused RMSNorm, `norm`: its sum of squares and the largest |x * s|, s the norm weight) and,
// when they fit in the dynamic shared memory (`stage`; always with the norm), stores the rows
// there; then the staged rows become their f16 operands in place — after the norm, normalised
// and rounded to the element type first, as the separate `rms_norm` op stores them (block 0
// also writes those to `norm_out`). Rows not staged are read from global memory and converted
// at each step. Rows of shared memory are padded by 16 bytes: the fragment loads are
// conflict-free. The epilogue is gemv.cu's: outputs in the element type or f32 (accumulating
// when asked), or the glu product from the rounded gate and up values.
//
// Traffic: n * k bytes of codes plus the scales; R * k input elements per block from L2.
// Requires k % 128 == 0, 16-byte aligned rows, and with the norm R * (k + 8) 16-bit elements of
// shared memory (the host checks and otherwise uses `gemv8_*`).
//
// 16-bit weights (`gemv16m_*`, the same kernel with W16): bf16/f16 weights are already MMA
// operands, so the rows x weights products run on the tensor cores (bf16 x bf16 or f16 x f16,
// f32 accumulation) with no conversion at all: a lane's 32 columns of a tile row are 64 bytes
// (four 16-byte loads), the inputs are the rows as stored (no power-of-two scaling: they are
// operands of their own type), and there are no block scales. On the CUDA cores (`gemv_*` in
// gemv.cu) every weight element costs an f32 conversion and one FMA per input row, so R rows
// cost R times the instructions and a verify or batched step of 5 to 8 rows is compute-bound
// (2 to 5 times a decode step on the H200); here one to eight rows cost one step's weight bytes.
// Each output is the same sum in the same order whatever R is (rows are MMA columns), so decode,
// verify and batched steps round alike, as the CUDA-core kernel's rows do.
#include "common.cuh"

#define GEMVM_STEP 128
// Weight steps each warp has in flight (2 KiB each): 2 for one or two rows, whose kernels fit
// 64 registers and so four 8-warp blocks per SM (the prologue of one block overlaps the
// others' streaming); 4 for more rows, two blocks per SM.
#define GEMVM_RING_OF(R) ((R) <= 2 ? 2 : 4)
#define GEMVM_MINB_OF(R, WARPS) ((GEMVM_RING_OF(R) == 2 ? 24 : 16) / (WARPS))
// 16-bit weights: two 4 KiB steps per warp in flight (64 registers of loads), two 8-warp blocks
// per SM.
#define GEMVM16_RING 2
#define GEMVM16_MINB_OF(WARPS) (16 / (WARPS))

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

// WARPS: warps per block (one tile per block). W16: weights of type T (`gemv16m_*`), else E4M3
// codes with block scales. Waits for the previous launch itself (PDL).
template <typename T, int R, bool NORM, int WARPS, bool W16 = false>
static __device__ __forceinline__ void gemv8m_impl(const GemvParams& p) {
    constexpr int GEMVM_RING = W16 ? GEMVM16_RING : GEMVM_RING_OF(R);
    constexpr int WB = W16 ? 2 : 1;       // weight bytes per element
    constexpr int NLD = W16 ? 8 : 4;      // 16-byte weight loads per step (both halves)
    constexpr bool BF16 = W16 && GemvmIsBf16<T>::value;
    extern __shared__ __align__(16) unsigned char gemvm_smem[];
    __shared__ float red[WARPS][4][32];
    __shared__ float nred[WARPS][2][R];
    __shared__ float row_scale[R];

    int b = blockIdx.x, mi = 0;
    while (mi + 1 < p.nmats && b >= p.m[mi].blocks) {
        b -= p.m[mi].blocks;
        ++mi;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int k = p.k;

    // This lane's two weight rows (half 0: tile row g, half 1: tile row g + 8) and their
    // scale rows; rows past n read row 0 and are never written.
    int j0;
    const unsigned char* wr[2];
    const float* sr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const GemvMat& m = p.glu ? p.m[h] : p.m[mi];
        int j;
        if (p.glu) {
            j0 = b * 8;
            j = j0 + g;
        } else {
            j0 = b * 16;
            j = j0 + g + 8 * h;
        }
        if (j >= m.n) j = 0;
        wr[h] = static_cast<const unsigned char*>(m.w) + ((size_t)j * k + 16 * q) * WB;
        sr[h] = W16 ? nullptr : m.scale + (size_t)(j / p.qbr) * m.scale_ld;
    }

    // The weights stream through a ring of GEMVM_RING steps per warp: requested before the
    // prologue, each slot refilled with the step GEMVM_RING later once used.
    const int steps = k / GEMVM_STEP, qshift = W16 ? 0 : __ffs(p.qbc / GEMVM_STEP) - 1;
    // Warp w's steps: a contiguous range, so each of its rows is read front to back.
    const int s_begin = warp * steps / WARPS, s_end = (warp + 1) * steps / WARPS;
    // Loads [0, NLD / 2): half 0 (tile row g), then half 1: the lane's columns 16q .. 16q + 15
    // and 64 + 16q .. 64 + 16q + 15 of the step, in order.
    uint4 wv[GEMVM_RING][NLD];
    float sv[GEMVM_RING][2];
    auto fetch = [&](int u, int s) {
        if (s >= s_end) return;
        const size_t kb = (size_t)s * GEMVM_STEP * WB;
        if constexpr (W16) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[u][4 * h + 0] = load_stream(wr[h] + kb);
                wv[u][4 * h + 1] = load_stream(wr[h] + kb + 16);
                wv[u][4 * h + 2] = load_stream(wr[h] + kb + 128);
                wv[u][4 * h + 3] = load_stream(wr[h] + kb + 144);
            }
        } else {
            wv[u][0] = load_stream(wr[0] + kb);
            wv[u][1] = load_stream(wr[0] + kb + 64);
            wv[u][2] = load_stream(wr[1] + kb);
            wv[u][3] = load_stream(wr[1] + kb + 64);
            sv[u][0] = __ldg(sr[0] + (s >> qshift));
            sv[u][1] = __ldg(sr[1] + (s >> qshift));
        }
    };
#pragma unroll
    for (int u = 0; u < GEMVM_RING; ++u) fetch(u, s_begin + u);
    // Weights and scales are constant while a plan runs, so the ring fills before the wait for
    // the previous launch (programmatic dependent launch); the inputs are read after it.
    flashrt::pdl_wait();
    flashrt::pdl_trigger();

    const T* x = static_cast<const T*>(p.x);
    const int row0 = p.last_row ? flashrt::load_len(p.len) - 1 : 0;
    x += (size_t)row0 * p.ld_x;

    // Prologue: per row the largest magnitude (and with the norm the sum of squares and the
    // largest |x * s|), the rows staged in shared memory when `stage`.
    const bool stage = NORM || p.stage;
    __half* xs = reinterpret_cast<__half*>(gemvm_smem);
    const int lds = k + 8, chunks = k >> 3;
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
    // The input row this lane feeds (column g of the MMA) and its scale.
    const bool feeds = g < R;
    const float fg = feeds ? row_scale[g] : 0.0f;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int base = s_begin; base < s_end; base += GEMVM_RING) {
#pragma unroll
        for (int u = 0; u < GEMVM_RING; ++u) {
            const int s = base + u;
            if (s >= s_end) break;
            // Inputs 16q .. 16q + 15 and 64 + 16q .. 64 + 16q + 15 of the step, as f16 pairs.
            uint4 xv[4];
            if (!feeds) {
#pragma unroll
                for (int i = 0; i < 4; ++i) xv[i] = make_uint4(0, 0, 0, 0);
            } else if (stage) {
                const uint4* xp = reinterpret_cast<const uint4*>(xs + (size_t)g * lds + (size_t)s * GEMVM_STEP + 16 * q);
#pragma unroll
                for (int i = 0; i < 4; ++i) xv[i] = xp[(i >> 1) * 8 + (i & 1)];
            } else {
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)g * p.ld_x + (size_t)s * GEMVM_STEP + 16 * q);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint4 raw = __ldg(xp + (i >> 1) * 8 + (i & 1));
                    if constexpr (W16) {
                        xv[i] = raw;
                    } else {
                        float xf[8];
                        flashrt::unpack16<T>(raw, xf);
                        xv[i] = gemvm_f16x8(xf, fg);
                    }
                }
            }
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int t = 0; t < 8; ++t) {
                if constexpr (W16) {
                    // MMA t: the lane's columns 4t .. 4t + 3 of each half (words 2t, 2t + 1).
                    const uint4 (&ha)[4] = *reinterpret_cast<const uint4(*)[4]>(&wv[u][0]);
                    const uint4 (&hb)[4] = *reinterpret_cast<const uint4(*)[4]>(&wv[u][4]);
                    const uint32_t a0 = gemvm_word(ha, 2 * t), a2 = gemvm_word(ha, 2 * t + 1);
                    const uint32_t a1 = gemvm_word(hb, 2 * t), a3 = gemvm_word(hb, 2 * t + 1);
                    if constexpr (BF16)
                        gemvm_mma_bf16(d, a0, a1, a2, a3, gemvm_word(xv, 2 * t), gemvm_word(xv, 2 * t + 1));
                    else
                        gemvm_mma(d, a0, a1, a2, a3, gemvm_word(xv, 2 * t), gemvm_word(xv, 2 * t + 1));
                } else {
                    // MMA t: word t of the lane's 32 codes of each row.
                    const uint32_t ca = gemvm_word(wv[u], t), cb = gemvm_word(wv[u], 8 + t);
                    gemvm_mma(d, gemvm_codes((unsigned short)ca), gemvm_codes((unsigned short)cb),
                              gemvm_codes((unsigned short)(ca >> 16)), gemvm_codes((unsigned short)(cb >> 16)),
                              gemvm_word(xv, 2 * t), gemvm_word(xv, 2 * t + 1));
                }
            }
            if constexpr (W16) {
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i] += d[i];
            } else {
                acc[0] = fmaf(d[0], sv[u][0], acc[0]);
                acc[1] = fmaf(d[1], sv[u][0], acc[1]);
                acc[2] = fmaf(d[2], sv[u][1], acc[2]);
                acc[3] = fmaf(d[3], sv[u][1], acc[3]);
            }
            fetch(u, s + GEMVM_RING);
        }
    }

    // Fixed-order reduction over the warps; warp 0 finishes, undoing the rows' scales.
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v[i] += red[w][i][lane];
        const int r = 2 * q + (i & 1);
        if (!W16 && r < R) v[i] /= row_scale[r];
    }
    // v[2h + c]: tile row g + 8h (half h), input row 2q + c.
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const int r = 2 * q + c;
        if (r >= R) continue;
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
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = j0 + g + 8 * h;
            if (j >= m.n) continue;
            const size_t o = (size_t)(r + row0) * m.ld_out + j;
            if (p.out_f32) {
                float* out = static_cast<float*>(m.out);
                out[o] = p.accumulate ? out[o] + v[2 * h + c] : v[2 * h + c];
            } else {
                T* out = static_cast<T*>(m.out);
                const float prev = p.accumulate ? flashrt::to_f32(out[o]) : 0.0f;
                out[o] = flashrt::from_f32<T>(v[2 * h + c] + prev);
            }
        }
    }
}

// `gemv8m_r<R>` / `gemv8m_norm_r<R>` (`p.norm` = 1): blocks of 8 warps, two per SM by the
// register budget; `..._w4`: blocks of 4 warps (four per SM), for matrices with few tiles,
// so that all of their blocks are resident at once.
#define FLASHRT_GEMVM_ENTRY_T(NAME, R, NORM, WARPS)                                                      \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, GEMVM_MINB_OF(R, WARPS)) NAME##_bf16(const GemvParams p) { \
        gemv8m_impl<__nv_bfloat16, R, NORM, WARPS>(p);                                                   \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, GEMVM_MINB_OF(R, WARPS)) NAME##_f16(const GemvParams p) {  \
        gemv8m_impl<__half, R, NORM, WARPS>(p);                                                          \
    }
#define FLASHRT_GEMVM_ENTRY(R)                                                                           \
    FLASHRT_GEMVM_ENTRY_T(gemv8m_r##R, R, false, 8)                                                      \
    FLASHRT_GEMVM_ENTRY_T(gemv8m_norm_r##R, R, true, 8)                                                  \
    FLASHRT_GEMVM_ENTRY_T(gemv8m_r##R##w4, R, false, 4)                                                  \
    FLASHRT_GEMVM_ENTRY_T(gemv8m_norm_r##R##w4, R, true, 4)

FLASHRT_GEMVM_ENTRY(1)
FLASHRT_GEMVM_ENTRY(2)
FLASHRT_GEMVM_ENTRY(3)
FLASHRT_GEMVM_ENTRY(4)
FLASHRT_GEMVM_ENTRY(5)
FLASHRT_GEMVM_ENTRY(6)
FLASHRT_GEMVM_ENTRY(7)
FLASHRT_GEMVM_ENTRY(8)

// `gemv16m_*`: 16-bit weights on the tensor cores (see the header), same entry points.
#define FLASHRT_GEMV16M_ENTRY_T(NAME, R, NORM, WARPS)                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, GEMVM16_MINB_OF(WARPS)) NAME##_bf16(const GemvParams p) { \
        gemv8m_impl<__nv_bfloat16, R, NORM, WARPS, true>(p);                                             \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, GEMVM16_MINB_OF(WARPS)) NAME##_f16(const GemvParams p) {  \
        gemv8m_impl<__half, R, NORM, WARPS, true>(p);                                                    \
    }
#define FLASHRT_GEMV16M_ENTRY(R)                                                                         \
    FLASHRT_GEMV16M_ENTRY_T(gemv16m_r##R, R, false, 8)                                                   \
    FLASHRT_GEMV16M_ENTRY_T(gemv16m_norm_r##R, R, true, 8)                                               \
    FLASHRT_GEMV16M_ENTRY_T(gemv16m_r##R##w4, R, false, 4)                                               \
    FLASHRT_GEMV16M_ENTRY_T(gemv16m_norm_r##R##w4, R, true, 4)

FLASHRT_GEMV16M_ENTRY(1)
FLASHRT_GEMV16M_ENTRY(2)
FLASHRT_GEMV16M_ENTRY(3)
FLASHRT_GEMV16M_ENTRY(4)
FLASHRT_GEMV16M_ENTRY(5)
FLASHRT_GEMV16M_ENTRY(6)
FLASHRT_GEMV16M_ENTRY(7)
FLASHRT_GEMV16M_ENTRY(8)
