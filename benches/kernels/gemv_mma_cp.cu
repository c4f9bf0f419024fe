// CANDIDATE, not part of the build (build.rs compiles kernels/*.cu only): kernels/gemv_mma.cu
// with each warp's register ring of weight steps replaced by a shared-memory ring filled with
// cp.async (whole 128-byte lines of 4 rows per request, GEMVM_STAGES - 1 steps in flight,
// swizzled slots). Written and compiled on 2026-12-03, NOT yet measured or tested on a GPU
// (no device was available). Measure it with benches/kernels/gemv8m_micro.cu
// (-DGEMV8M_CANDIDATE -I benches/kernels; the checksum line must equal the kernel's), and if it
// wins move it over kernels/gemv_mma.cu: the host then sizes dynamic shared memory as the
// staged inputs (16-byte aligned) plus warps * GEMVM_STAGES * GEMVM_SLOT for every launch
// (flashrt-runtime/src/backend/cuda/ops/gemv.rs).
//
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
// contiguous range of them; a step never straddles a scale block). Each warp streams its steps
// through its own ring of GEMVM_STAGES slots in shared memory with cp.async (GEMVM_STAGES - 1
// steps in flight, the first requested before the prologue; each copy request covers whole
// 128-byte lines of 4 rows, past L1). Per step, lane (g, q) (g = lane / 4, q = lane % 4) takes
// 32 codes of tile row g and 32 of row g + 8 from the slot, at the step's columns 16q .. 16q + 15
// and 64 + 16q .. 64 + 16q + 15 (the slot's rows are swizzled so these loads are
// conflict-free), and the 32 inputs of input row g at the same columns when g < R. The MMA's k
// order is a permutation of the step's columns (logical columns 2q, 2q + 1, 2q + 8, 2q + 9 of
// MMA t are the lane's t-th group of 4 columns), the same for both operands, so each lane's
// loads feed its fragments without shuffles. A step's partial sums are scaled by each row's
// block scale and accumulated in f32; the warps' sums are added in a fixed order.
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
// shared memory besides the rings (the host checks and otherwise uses `gemv8_*`).
#include "common.cuh"

#define GEMVM_STEP 128
// Weight steps in each warp's shared-memory ring (GEMVM_STAGES - 1 in flight), and the bytes of
// one slot: 16 rows of 128 codes, then their 16 block scales. The host sizes the dynamic
// shared memory as the staged inputs plus WARPS * GEMVM_STAGES * GEMVM_SLOT.
#define GEMVM_STAGES 4
#define GEMVM_SLOT (16 * GEMVM_STEP + 64)
// Blocks per SM the registers allow for: three 8-warp blocks for one or two rows, two for
// more (shared memory may allow fewer).
#define GEMVM_MINB_OF(R, WARPS) (((R) <= 2 ? 24 : 16) / (WARPS))

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

// The power of two that brings a row whose largest magnitude is `amax` below 2^15.
static __device__ __forceinline__ float gemvm_row_scale(float amax) {
    if (!(amax > 0.0f) || isinf(amax)) return 1.0f;
    int e;
    frexpf(amax, &e); // amax = m 2^e, 0.5 <= m < 1
    return ldexpf(1.0f, min(max(15 - e, -120), 120));
}

// WARPS: warps per block (one tile per block). Waits for the previous launch itself (PDL).
template <typename T, int R, bool NORM, int WARPS>
static __device__ __forceinline__ void gemv8m_impl(const GemvParams& p) {
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

    // The tile's first row; rows past n read row 0 and are never written.
    const int j0 = p.glu ? b * 8 : b * 16;
    const int hoff = p.glu ? 0 : 8; // half h of the tile starts at row j0 + hoff * h

    const int steps = k / GEMVM_STEP, qshift = __ffs(p.qbc / GEMVM_STEP) - 1;
    // Warp w's steps: a contiguous range, so each of its rows is read front to back.
    const int s_begin = warp * steps / WARPS, s_end = (warp + 1) * steps / WARPS;
    // The warp's ring of GEMVM_STAGES steps in shared memory, after the staged inputs. Step s
    // arrives by cp.async: load i of lane l copies 16 bytes of tile row 4i + l / 8, so each
    // request reads whole 128-byte lines; the 16 rows' block scales follow the codes.
    const int stage_bytes = (NORM || p.stage) ? ((R * (k + 8) * 2 + 15) & ~15) : 0;
    unsigned char* ring = gemvm_smem + stage_bytes + (size_t)warp * GEMVM_STAGES * GEMVM_SLOT;
    const uint32_t ring_s = (uint32_t)__cvta_generic_to_shared(ring);
    auto fetch = [&](int slot, int s) {
        if (s < s_end) {
            const size_t kb = (size_t)s * GEMVM_STEP;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = 4 * i + (lane >> 3);
                const bool h = row >= 8;
                const GemvMat& m = p.glu ? p.m[h] : p.m[mi];
                int j = j0 + (row & 7) + (h ? hoff : 0);
                if (j >= m.n) j = 0;
                const unsigned char* src = static_cast<const unsigned char*>(m.w) + (size_t)j * k + kb + (lane & 7) * 16;
                // 16-byte chunk c of row r lands at chunk c ^ 4 when r is odd: the fragment
                // loads below are conflict-free.
                const uint32_t dst = ring_s + slot * GEMVM_SLOT + row * GEMVM_STEP + (((lane & 7) ^ ((row & 1) << 2)) << 4);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
            }
            if (lane < 16) {
                const bool h = lane >= 8;
                const GemvMat& m = p.glu ? p.m[h] : p.m[mi];
                int j = j0 + (lane & 7) + (h ? hoff : 0);
                if (j >= m.n) j = 0;
                const float* src = m.scale + (size_t)(j / p.qbr) * m.scale_ld + (s >> qshift);
                const uint32_t dst = ring_s + slot * GEMVM_SLOT + 16 * GEMVM_STEP + 4 * lane;
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
            }
        }
        // A group per step, empty past the end, so the count the loop waits for stays fixed.
        asm volatile("cp.async.commit_group;");
    };
#pragma unroll
    for (int u = 0; u < GEMVM_STAGES - 1; ++u) fetch(u, s_begin + u);
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
                } else {
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
        f[r] = gemvm_row_scale(NORM ? a * inv[r] : a);
    }
    if (threadIdx.x < R) row_scale[threadIdx.x] = f[threadIdx.x];
    if (stage) {
        // Each thread turns the chunks it stored into f16 operands.
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
                *at = gemvm_f16x8(xf, f[r]);
            }
    }
    __syncthreads();
    // The input row this lane feeds (column g of the MMA) and its scale.
    const bool feeds = g < R;
    const float fg = feeds ? row_scale[g] : 0.0f;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = s_begin; s < s_end; ++s) {
        // Step s's copies are done (this lane's), then the warp's; the slot of step s - 1 is
        // free again and takes step s + GEMVM_STAGES - 1.
        asm volatile("cp.async.wait_group %0;" ::"n"(GEMVM_STAGES - 2));
        __syncwarp();
        const int i = s - s_begin;
        fetch((i + GEMVM_STAGES - 1) % GEMVM_STAGES, s + GEMVM_STAGES - 1);
        // Inputs 16q .. 16q + 15 and 64 + 16q .. 64 + 16q + 15 of the step, as f16 pairs.
        uint4 xv[4];
        if (!feeds) {
#pragma unroll
            for (int e = 0; e < 4; ++e) xv[e] = make_uint4(0, 0, 0, 0);
        } else if (stage) {
            const uint4* xp = reinterpret_cast<const uint4*>(xs + (size_t)g * lds + (size_t)s * GEMVM_STEP + 16 * q);
#pragma unroll
            for (int e = 0; e < 4; ++e) xv[e] = xp[(e >> 1) * 8 + (e & 1)];
        } else {
            const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)g * p.ld_x + (size_t)s * GEMVM_STEP + 16 * q);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float xf[8];
                flashrt::unpack16<T>(__ldg(xp + (e >> 1) * 8 + (e & 1)), xf);
                xv[e] = gemvm_f16x8(xf, fg);
            }
        }
        // The lane's 32 codes of tile rows g and g + 8 (same parity, same swizzle).
        const unsigned char* sl = ring + (i % GEMVM_STAGES) * GEMVM_SLOT;
        const int sw = (g & 1) << 6;
        uint4 wv[4];
        wv[0] = *reinterpret_cast<const uint4*>(sl + g * GEMVM_STEP + ((16 * q) ^ sw));
        wv[1] = *reinterpret_cast<const uint4*>(sl + g * GEMVM_STEP + ((64 + 16 * q) ^ sw));
        wv[2] = *reinterpret_cast<const uint4*>(sl + (g + 8) * GEMVM_STEP + ((16 * q) ^ sw));
        wv[3] = *reinterpret_cast<const uint4*>(sl + (g + 8) * GEMVM_STEP + ((64 + 16 * q) ^ sw));
        const float* sc = reinterpret_cast<const float*>(sl + 16 * GEMVM_STEP);
        const float s0 = sc[g], s1 = sc[8 + g];
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int t = 0; t < 8; ++t) {
            // MMA t: word t of the lane's 32 codes of each row.
            const uint32_t ca = gemvm_word(wv, t), cb = gemvm_word(wv, 8 + t);
            gemvm_mma(d, gemvm_codes((unsigned short)ca), gemvm_codes((unsigned short)cb),
                      gemvm_codes((unsigned short)(ca >> 16)), gemvm_codes((unsigned short)(cb >> 16)),
                      gemvm_word(xv, 2 * t), gemvm_word(xv, 2 * t + 1));
        }
        acc[0] = fmaf(d[0], s0, acc[0]);
        acc[1] = fmaf(d[1], s0, acc[1]);
        acc[2] = fmaf(d[2], s1, acc[2]);
        acc[3] = fmaf(d[3], s1, acc[3]);
    }
    asm volatile("cp.async.wait_group 0;");

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
        if (r < R) v[i] /= row_scale[r];
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
