// flashrt kernels: matrix-vector products for small phases (plan op `Linear` in decode and
// verify steps, at most 8 rows), replacing cuBLASLt where a step streams the weights once.
//
// out[r, j] = sum_k x[r, k] * w[j, k]  (+ out[r, j] when accumulating), for r < R (the plan's
// rows, a compile-time constant 1..8: rows past io.len are computed and never read, as with
// the GEMMs they replace). Weights are bf16/f16 `[n, k]` row-major, activations the same
// type, accumulation f32, output the element type or f32 (the logits).
//
// One launch covers up to 4 matrices that read the same input (a layer's q/k/v or its Gated
// DeltaNet qkv/z/b/a projections): blocks are dealt to the matrices in order (`blocks[m]` of
// them to matrix m). In `glu` mode the launch is an MLP's gate and up projections plus the
// product after them (plan ops Linear(gate), Linear(up), Mul): matrix 0 is the gate, matrix 1
// the up projection with the same n, and warp w of a block computes gate row j and up row j
// together, writes both (rounded to the element type, as the separate ops would) and
// `glu_out[r, j] = act(gate) * up` computed from the rounded values — exactly what the three
// separate ops produce.
//
// Grid: one block per tile of GEMV_FEATS outputs (or the resident blocks, each looping over
// tiles: see `gemv_impl`); block: 8 warps that together own GEMV_FEATS output features (8 for
// R <= 2, 4 for more rows, whose partial sums need more registers; in glu mode half of them
// are gate rows and half the up rows with the same indices). The block's threads stride over k in 16-byte chunks (8 elements): thread t loads chunk t, t + blockDim, ... of
// all 8 weight rows, streamed past L1 (ld.global.nc L1::no_allocate: every weight byte is read
// exactly once per step), and the matching input chunk of each of the R rows through L1 (all
// blocks of an SM read the same few KiB), so one input load serves 8 weight rows. Each thread
// keeps R x 8 f32 partial sums; they are reduced across the warp with shuffles and then over
// the warps in a fixed order: a row's result does not depend on R or on the other rows, so
// decode (R = 1) and verify (R = 2..5) steps of a model with verify plans round identically
// without sharing a shape (the host launches each phase at its own rows).
//
// Several rows (verify passes, batched decode steps) change where the operands come from, not
// the arithmetic: with a fused norm the block's prologue normalises its R rows once into
// shared memory and the resident blocks loop over the tiles (`GEMV_STAGED`), and past two rows
// each thread requests its next chunk of weights (across a block's tiles) before this chunk's
// R x 4 x 8 multiply-adds (`GEMV_PIPELINED`), two blocks resident per SM. Before, at R = 8 a
// fused-norm tile normalised its rows again (as many instructions as its multiply-adds) and
// one resident block per SM waited on each chunk's loads: 6x a one-row launch at the 27B
// shape's gate/up (benches/RESULTS.md).
//
// Traffic: n * k * 2 bytes of weights (the step's floor), R * k input elements per warp from
// L1/L2, R * n outputs. Requires k % 8 == 0, 16-byte aligned weight and input rows (the host
// checks and falls back to cuBLASLt otherwise).
//
// FP8 weights (`gemv8_*`, W8A16): E4M3 codes with one f32 scale per [qbr, qbc] block; a
// 16-byte chunk is 16 codes, converted in registers, their products with the input summed in
// f32 and scaled by the row's block scale; n * k bytes of weights plus the scales. Requires
// k % 16 == 0 and qbc % 16 == 0.
#include "common.cuh"
#include <cuda_fp8.h>

#define GEMV_WARPS 8
#define GEMV_MATS 4
// A tile's cross-lane reduction with `warp_sum_many` (common.cuh): at R rows and F features a
// thread reduces R x F partial sums, one warp_sum (5 shuffles) each, 160 shuffles at 8 rows
// against ~2.5 chunks of multiply-adds a thread per tile at the 27B shape's k = 5120, and a
// warp's shuffle issues at one a clock per SM; warp_sum_many takes 31 for those 32 values (9
// instead of 40 at one row), with the same bits (it adds the same partners in the same order;
// an emulation of both over 32 lanes agreed bit for bit at every R x F the kernels use, and the
// GPU tests pass). H100, 27B shape at 2048, same machine: batched steps of 2 / 4 / 8 rows
// 19.79 / 23.42 / 30.74 -> 19.66 / 22.98 / 29.72 ms, one row and FP8 unchanged
// (benches/RESULTS.md, 2026-12-06 18:01). `-DGEMV_REDUCE_MANY=0`: one warp_sum per value.
#ifndef GEMV_REDUCE_MANY
#define GEMV_REDUCE_MANY 1
#endif

struct GemvMat {
    const void* w;
    void* out;
    // FP8 weights (`gemv8_*`): the f32 block scales, `scale_ld` per block row.
    const float* scale;
    int n;
    int ld_out;
    int blocks;
    int scale_ld;
};

struct GemvParams {
    const void* x;
    int ld_x;
    int k;
    int nmats;
    int accumulate;
    int out_f32;
    int glu; // 1: matrices 0/1 are gate/up, glu_out = act(gate) * up
    int act;
    // 1 when the input rows are staged in dynamic shared memory: `gemv8m_*` without the norm
    // (with it they always are), `gemv_norm_r<R>` at R > 1 (GEMV_STAGED).
    int stage;
    void* glu_out;
    int ld_glu;
    int last_row; // 1: R == 1 and the row is io.len - 1 of x and of every output (see below)
    const int* len;
    // Fused RMSNorm prologue (`norm` = 1): x is the norm's input; the matrices read
    // rmsnorm(x) * s (s = norm_w, 1 + norm_w with `one_plus`, or 1 without weights), rounded
    // to the element type as the separate `rms_norm` op would store it; block 0 also stores
    // it to `norm_out` for any later reader.
    int norm;
    int one_plus;
    const float* norm_w;
    void* norm_out;
    int ld_norm_out;
    float eps;
    // FP8 weights: rows and columns of a scale block (`qbc` a multiple of 16).
    int qbr;
    int qbc;
    // `gemv8m_*` / `gemv16m_*`: steps per warp, after the ring's first slots, asked of the L2
    // before the PDL wait (0: none); weights only (no earlier kernel writes them), so DRAM
    // keeps streaming while the prologue waits and runs. Unused by `gemv*`.
    int pf;
    // `gemv8m_*` / `gemv16m_*` (gemv_mma.cu): the split tiles' shares (one slot of 128 tagged
    // 64-bit words per warp of the launch), all zero between launches.
    float* part;
    GemvMat m[GEMV_MATS];
    // 1: a side launch (`CudaOptions::gemv_side`): it reads only what was complete before its
    // predecessor started (a residual row, normalised in its own prologue; norm_out null), so
    // it lets the next kernel launch first, runs beside its predecessor, and waits for it at
    // the end — whoever waits for this launch then finds both done. 0: wait, then trigger.
    int side;
    // 1: (one row, no fused norm, not a side launch) each block asks for its tile's first
    // weights before its PDL wait (`gemv_early_chunk`; `CudaOptions::gemv_early`).
    int early;
};
// The host's copy of this layout (flashrt-runtime/src/backend/cuda/ops/gemv.rs `GemvParams`)
// checks the same offsets: a field added or removed on one side alone fails a build.
static_assert(offsetof(GemvParams, part) == 112 && offsetof(GemvParams, m) == 120 && sizeof(GemvMat) == 40 &&
                  offsetof(GemvParams, side) == 280 && sizeof(GemvParams) == 288,
              "GemvParams layout changed: update ops/gemv.rs and these offsets");

static __device__ __forceinline__ uint4 load_stream(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Fused RMSNorm prologue (`p.norm`), shared by the gemv kernels. Each block reduces the sum of
// squares of its R input rows itself (k elements each, from L2) in a fixed order, so a row's
// scale depends on that row only. Ends with a block barrier.
// `nred`: WARPS x R floats of shared memory for the warps' sums (the caller's, or see below).
template <typename T, int R>
static __device__ __forceinline__ void gemv_norm_inv_in(const GemvParams& p, const T* x, float (&inv)[R],
                                                        float (&nred)[GEMV_WARPS][R]) {
    constexpr int WARPS = GEMV_WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunks = p.k >> 3;
    float ss[R];
#pragma unroll
    for (int r = 0; r < R; ++r) ss[r] = 0.0f;
    for (int c = threadIdx.x; c < chunks; c += WARPS * 32) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float xf[8];
            flashrt::unpack16<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)r * p.ld_x) + c), xf);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss[r] = fmaf(xf[e], xf[e], ss[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float v = flashrt::warp_sum(ss[r]);
        if (lane == 0) nred[warp][r] = v;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) t += nred[w][r];
        inv[r] = 1.0f / sqrtf(t / (float)p.k + p.eps);
    }
}

template <typename T, int R>
static __device__ __forceinline__ void gemv_norm_inv(const GemvParams& p, const T* x, float (&inv)[R]) {
    __shared__ float nred[GEMV_WARPS][R];
    gemv_norm_inv_in<T, R>(p, x, inv, nred);
}

// The norm weights of chunk c (elements 8c .. 8c + 7): w, 1 + w with `one_plus`, or 1
// without weights.
static __device__ __forceinline__ void gemv_norm_weight(const GemvParams& p, int c, float (&s)[8]) {
    if (p.norm_w) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(p.norm_w) + 2 * c);
        const float4 b = __ldg(reinterpret_cast<const float4*>(p.norm_w) + 2 * c + 1);
        s[0] = a.x, s[1] = a.y, s[2] = a.z, s[3] = a.w, s[4] = b.x, s[5] = b.y, s[6] = b.z, s[7] = b.w;
        if (p.one_plus) {
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] += 1.0f;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] = 1.0f;
    }
}

// Input chunk c of a row, loaded as f32 in `xf`: normalised by the row's `inv` and the norm
// weights and rounded to the element type, as the separate `rms_norm` op stores it.
template <typename T>
static __device__ __forceinline__ void gemv_norm_chunk(const GemvParams& p, float inv, int c, float (&xf)[8]) {
    float s[8];
    gemv_norm_weight(p, c, s);
#pragma unroll
    for (int e = 0; e < 8; ++e) xf[e] = flashrt::to_f32(flashrt::from_f32<T>(xf[e] * inv * s[e]));
}

// The normalised rows, stored by one block to `norm_out` for any later reader.
template <typename T, int R>
static __device__ __forceinline__ void gemv_norm_store(const GemvParams& p, const T* x, const float (&inv)[R]) {
    for (int c = threadIdx.x; c < (p.k >> 3); c += GEMV_WARPS * 32)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float xf[8];
            flashrt::unpack16<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)r * p.ld_x) + c), xf);
            gemv_norm_chunk<T>(p, inv[r], c, xf);
            T* o = static_cast<T*>(p.norm_out) + (size_t)r * p.ld_norm_out + (size_t)c * 8;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[e] = flashrt::from_f32<T>(xf[e]);
        }
}


// FP8 E4M3 weights (`FP8`): 16 codes per 16-byte chunk, each row's codes times its block's
// scale. A chunk's 16 products are summed in f32 and the sum scaled once (block columns are
// multiples of 16, so a chunk never straddles two blocks), then added to the accumulator.
// Codes 8h .. 8h + 7 of a 16-byte chunk as f32 (exact).
static __device__ __forceinline__ void unpack_e4m3x8(uint4 u, int h, float (&f)[8]) {
    const uint32_t w[2] = {h ? u.z : u.x, h ? u.w : u.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] & 0xffffu), __NV_E4M3);
        const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] >> 16), __NV_E4M3);
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        f[4 * i] = a.x, f[4 * i + 1] = a.y, f[4 * i + 2] = b.x, f[4 * i + 3] = b.y;
    }
}

// The end of a tile (after the block barrier): thread (r, i) adds the warps' partial sums
// `red[w][r][i]` of output j0 + i of input row r in warp order and stores it — in `glu` mode
// thread (r, i < F / 2) finishes pair i (gate in slot i, up in slot i + F / 2, both rounded to
// the element type, and act(gate) * up), else to matrix `mi`'s row r + row0 (the element type
// or f32, accumulating when asked). `W`: the slots of `red`, `F` of them used.
template <typename T, int R, int W, int F>
static __device__ __forceinline__ void gemv_finish(const GemvParams& p, const float (&red)[GEMV_WARPS][R][W], int mi,
                                                   int j0, int row0) {
    constexpr int WARPS = GEMV_WARPS, HALF = F / 2;
    const int t = threadIdx.x;
    if (t >= R * F) return;
    const int r = t / F, i = t % F;
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += red[w][r][i];
    if (p.glu) {
        if (i >= HALF) return;
        const int j = j0 + i;
        if (j >= p.m[0].n) return;
        float u = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) u += red[w][r][i + HALF];
        const T gt = flashrt::from_f32<T>(v);
        const T ut = flashrt::from_f32<T>(u);
        static_cast<T*>(p.m[0].out)[(size_t)r * p.m[0].ld_out + j] = gt;
        static_cast<T*>(p.m[1].out)[(size_t)r * p.m[1].ld_out + j] = ut;
        const float y = flashrt::apply_act(p.act, flashrt::to_f32(gt)) * flashrt::to_f32(ut);
        static_cast<T*>(p.glu_out)[(size_t)r * p.ld_glu + j] = flashrt::from_f32<T>(y);
        return;
    }
    const GemvMat& m = p.m[mi];
    const int j = j0 + i;
    if (j >= m.n) return;
    const size_t o = (size_t)(r + row0) * m.ld_out + j;
    if (p.out_f32) {
        float* out = static_cast<float*>(m.out);
        out[o] = p.accumulate ? out[o] + v : v;
    } else {
        T* out = static_cast<T*>(m.out);
        const float prev = p.accumulate ? flashrt::to_f32(out[o]) : 0.0f;
        out[o] = flashrt::from_f32<T>(v + prev);
    }
}

// Several rows of 16-bit weights with the fused norm read their inputs normalised from shared
// memory (`xs`: R rows of k elements, staged once per block by `gemv_impl`), not normalised
// again per tile: at R rows and 4 features a block, normalising the rows per tile cost as many
// instructions as the tile's multiply-adds, and the per-block prologue re-read R x k inputs
// from L2 per tile (the host launches these as resident blocks looping over tiles, with
// R * k * sizeof(T) bytes of dynamic shared memory).
// (`p.stage` = 1; otherwise each tile normalises the chunks it reads, as at one row.)
#define GEMV_STAGED(R, NORM, FP8) ((R) > 1 && (NORM) && !(FP8))
// Past two rows of 16-bit weights, launches with the fused norm (their rows staged in shared
// memory) stream each thread's weight chunks through a ring of GEMV_ASYNC_DEPTH slots in
// shared memory instead (gemv_async_tiles): two chunks in flight, not one, without the
// registers. H100, 27B at 2048, same machine (benches/RESULTS.md, 2026-12-06 19:10 and
// 19:36): 4-row steps 22.53 -> 21.11 ms, 8 rows 29.60 -> 29.33; every launch past two rows
// through the ring (`-DGEMV_ASYNC=2`: launches without the norm then read their input rows
// from L2 after the ring's wait, a compiler barrier) 21.28 / 29.02. `-DGEMV_ASYNC=0`: none.
#ifndef GEMV_ASYNC
#define GEMV_ASYNC 1
#endif
#ifndef GEMV_ASYNC_DEPTH
#define GEMV_ASYNC_DEPTH 2
#endif
#define GEMV_ASYNC_ON(R, NORM, FP8) (GEMV_ASYNC && (R) > 2 && !(FP8) && ((NORM) || GEMV_ASYNC == 2))
// More than two rows of 16-bit weights otherwise: the next chunk's weights are requested while
// this chunk's multiply-adds run (see gemv_tile).
// (Two rows that way too, at 128 or 80 registers: slower, 2-row steps 1.24-1.52x one row
// against 1.08x; benches/RESULTS.md, 2026-12-06 18:51.)
#define GEMV_PIPELINED(R, FP8) ((R) > 2 && !(FP8))

// One tile: GEMV_FEATS outputs of every row (see gemv_impl), `tile` counted over the launch's
// matrices in order. `inv`: the rows' norm scales (NORM); `xs`: the staged rows
// (GEMV_STAGED). Ends after a block barrier; threads return early only after it.
// Resident blocks looping over tiles (GEMV_PIPELINED): the last chunk of a tile requests the
// first of the block's next tile, which the next call takes from `carry`, so a block's stream
// of weights does not stop at its tiles' reductions (`-DGEMV_XTILE=0`: each tile starts its own).
#ifndef GEMV_XTILE
#define GEMV_XTILE 1
#endif

// A launch's tile (counted over its matrices in order) to its matrix: on entry `b` is the
// tile and `mi` 0, on return `mi` is the matrix and `b` the tile's index within it.
static __device__ __forceinline__ void gemv_tile_in(const GemvParams& p, int& b, int& mi) {
    while (mi + 1 < p.nmats && b >= p.m[mi].blocks) {
        b -= p.m[mi].blocks;
        ++mi;
    }
}

// The launch's tiles: every matrix's blocks, or in glu mode the gate's (each tile holds both).
static __device__ __forceinline__ int gemv_tile_count(const GemvParams& p) {
    int tiles = p.m[0].blocks;
    if (!p.glu)
        for (int mi = 1; mi < p.nmats; ++mi) tiles += p.m[mi].blocks;
    return tiles;
}

// Input chunk c of row r as f32: the raw input, or its normalised, rounded value (staged rows,
// `xs`: as the block's prologue stored it in shared memory, the same value).
template <typename T, int R, bool NORM, bool FP8>
static __device__ __forceinline__ void gemv_load_x(const GemvParams& p, int k, const T* x, const T* xs,
                                                   const float (&inv)[R], int r, int c, float (&xf)[8]) {
    if (GEMV_STAGED(R, NORM, FP8) && p.stage) {
        flashrt::unpack16<T>(*reinterpret_cast<const uint4*>(xs + (size_t)r * k + (size_t)c * 8), xf);
    } else {
        flashrt::unpack16<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)r * p.ld_x) + c), xf);
        if (NORM) gemv_norm_chunk<T>(p, inv[r], c, xf);
    }
}

// Weight row i (< F) of tile `tile` of a 16-bit launch: its address (row 0 past n) and whether
// it exists (as gemv_tile's own, below).
template <int F>
static __device__ __forceinline__ void gemv_rows16(const GemvParams& p, int tile, int wsize, const char* (&wr)[F],
                                                   bool (&ok)[F]) {
    constexpr int HALF = F / 2;
    int b = tile, mi = 0;
    gemv_tile_in(p, b, mi);
#pragma unroll
    for (int i = 0; i < F; ++i) {
        const int j = p.glu ? b * HALF + (i % HALF) : b * F + i;
        const GemvMat& m = p.glu ? p.m[i / HALF] : p.m[mi];
        ok[i] = j < (p.glu ? p.m[0].n : m.n);
        wr[i] = static_cast<const char*>(m.w) + (size_t)(ok[i] ? j : 0) * p.k * wsize;
    }
}

// A tile's fixed-order reduction: each partial sum across the warp with shuffles (lane 0's
// value, or with GEMV_REDUCE_MANY warp_sum_many's: the same bits, half the values exchanged
// per stage) into `red[warp]`; the warps are then added in order by gemv_finish.
template <int R, int F>
static __device__ __forceinline__ void gemv_reduce(float (&acc)[R][F], float (&red)[GEMV_WARPS][R][F], int lane,
                                                   int warp) {
    if constexpr (!GEMV_REDUCE_MANY) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < F; ++i) {
                const float v = flashrt::warp_sum(acc[r][i]);
                if (lane == 0) red[warp][r][i] = v;
            }
    } else {
        constexpr int N = R * F;
        float(&flat)[N] = reinterpret_cast<float(&)[N]>(acc);
        constexpr int KEPT = flashrt::warp_sum_many_count(N), DUP = flashrt::warp_sum_many_dup_mask(N);
        const int base = flashrt::warp_sum_many(flat);
        if ((lane & DUP) == 0) {
            float* out = &red[warp][0][0];
#pragma unroll
            for (int j = 0; j < KEPT; ++j) out[base + j] = flat[j];
        }
    }
}

template <typename T, int R, int GEMV_FEATS, bool NORM, bool FP8>
static __device__ __forceinline__ void gemv_tile(const GemvParams& p, int tile, const T* x, const T* xs, int row0,
                                                 const float (&inv)[R],
                                                 float (&red)[GEMV_WARPS][R][GEMV_FEATS], int next = -1,
                                                 uint4* carry = nullptr, bool* carried = nullptr,
                                                 const uint4 (*pre)[GEMV_FEATS] = nullptr) {
    constexpr int WARPS = GEMV_WARPS;
    // Bytes per weight element; a 16-byte chunk holds CH of them.
    constexpr int WSIZE = FP8 ? 1 : (int)sizeof(T);
    constexpr int CH = 16 / WSIZE;
    // Which matrix this tile belongs to, and its index within it.
    int b = tile, mi = 0;
    gemv_tile_in(p, b, mi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k = p.k, wchunks = k / CH;

    // The GEMV_FEATS weight rows of this block: features j0 .. j0 + GEMV_FEATS - 1 of matrix
    // mi, or in glu mode gate rows j0 .. j0 + HALF - 1 (slots 0 .. HALF - 1) and the up rows
    // with the same indices (slots HALF ..). `sr`: each row's scales (FP8).
    constexpr int HALF = GEMV_FEATS / 2;
    const char* wr[GEMV_FEATS];
    const float* sr[GEMV_FEATS];
    bool ok[GEMV_FEATS];
    int j0;
    if (p.glu) {
        j0 = b * HALF;
#pragma unroll
        for (int i = 0; i < GEMV_FEATS; ++i) {
            const int j = j0 + (i % HALF);
            const GemvMat& m = p.m[i / HALF];
            ok[i] = j < p.m[0].n;
            wr[i] = static_cast<const char*>(m.w) + (size_t)(ok[i] ? j : 0) * k * WSIZE;
            sr[i] = FP8 ? m.scale + (size_t)((ok[i] ? j : 0) / p.qbr) * m.scale_ld : nullptr;
        }
    } else {
        j0 = b * GEMV_FEATS;
        const GemvMat& m = p.m[mi];
#pragma unroll
        for (int i = 0; i < GEMV_FEATS; ++i) {
            ok[i] = j0 + i < m.n;
            wr[i] = static_cast<const char*>(m.w) + (size_t)(ok[i] ? j0 + i : 0) * k * WSIZE;
            sr[i] = FP8 ? m.scale + (size_t)((ok[i] ? j0 + i : 0) / p.qbr) * m.scale_ld : nullptr;
        }
    }
    auto load_x = [&](int r, int c, float (&xf)[8]) { gemv_load_x<T, R, NORM, FP8>(p, k, x, xs, inv, r, c, xf); };

    float acc[R][GEMV_FEATS];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int i = 0; i < GEMV_FEATS; ++i) acc[r][i] = 0.0f;

    // Thread t takes chunks t, t + blockDim, ...: every 16-byte weight chunk is loaded once,
    // and each input chunk serves all GEMV_FEATS rows.
    if constexpr (GEMV_PIPELINED(R, FP8)) {
        // Several rows (compute-heavy per chunk): the next chunk's weights are requested as
        // soon as this chunk's are unpacked (into the same registers), so each thread keeps a
        // chunk of every weight row in flight while it does this chunk's R x GEMV_FEATS x 8
        // multiply-adds. The same products in the same order as the loop below.
        constexpr int STRIDE = WARPS * 32;
        // The block's next tile's rows (GEMV_XTILE), whose first chunk the last one requests.
        const char* nw[GEMV_FEATS];
        bool nok[GEMV_FEATS];
#pragma unroll
        for (int i = 0; i < GEMV_FEATS; ++i) nw[i] = wr[i], nok[i] = false;
        if (GEMV_XTILE && carry && next >= 0) gemv_rows16<GEMV_FEATS>(p, next, WSIZE, nw, nok);
        uint4 wv[GEMV_FEATS];
        int c = threadIdx.x;
        if (GEMV_XTILE && carry && *carried) {
#pragma unroll
            for (int i = 0; i < GEMV_FEATS; ++i) wv[i] = carry[i];
        } else if (c < wchunks) {
#pragma unroll
            for (int i = 0; i < GEMV_FEATS; ++i)
                wv[i] = ok[i] ? load_stream(wr[i] + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
        }
        for (; c < wchunks; c += STRIDE) {
            float wf[GEMV_FEATS][8];
#pragma unroll
            for (int i = 0; i < GEMV_FEATS; ++i) flashrt::unpack16<T>(wv[i], wf[i]);
            // The next chunk of this tile, or the first of the next tile (predicated loads, no
            // branch: so they issue here, ahead of the multiply-adds).
            const bool more = c + STRIDE < wchunks;
#pragma unroll
            for (int i = 0; i < GEMV_FEATS; ++i) {
                const char* src = more ? wr[i] + (size_t)(c + STRIDE) * 16 : nw[i] + (size_t)threadIdx.x * 16;
                wv[i] = (more ? ok[i] : nok[i]) ? load_stream(src) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float xf[8];
                load_x(r, c, xf);
#pragma unroll
                for (int i = 0; i < GEMV_FEATS; ++i)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][i] = fmaf(xf[e], wf[i][e], acc[r][i]);
            }
        }
        if (GEMV_XTILE && carry) {
#pragma unroll
            for (int i = 0; i < GEMV_FEATS; ++i) carry[i] = wv[i];
            *carried = next >= 0 && (int)threadIdx.x < wchunks;
        }
    } else {
    // Chunk c's products from its weights `wv` (and, FP8, the rows' block scales `s`).
    auto chunk = [&](int c, const uint4 (&wv)[GEMV_FEATS], const float (&s)[GEMV_FEATS]) {
        if constexpr (FP8) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float d[GEMV_FEATS];
#pragma unroll
                for (int i = 0; i < GEMV_FEATS; ++i) d[i] = 0.0f;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float xf[8];
                    load_x(r, 2 * c + h, xf);
#pragma unroll
                    for (int i = 0; i < GEMV_FEATS; ++i) {
                        float wf[8];
                        unpack_e4m3x8(wv[i], h, wf);
#pragma unroll
                        for (int e = 0; e < 8; ++e) d[i] = fmaf(xf[e], wf[e], d[i]);
                    }
                }
#pragma unroll
                for (int i = 0; i < GEMV_FEATS; ++i) acc[r][i] = fmaf(s[i], d[i], acc[r][i]);
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float xf[8];
                load_x(r, c, xf);
#pragma unroll
                for (int i = 0; i < GEMV_FEATS; ++i) {
                    float wf[8];
                    flashrt::unpack16<T>(wv[i], wf);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][i] = fmaf(xf[e], wf[e], acc[r][i]);
                }
            }
        }
    };
    // The rows' block scales of chunk c (FP8).
    auto scales = [&](int c, float (&s)[GEMV_FEATS]) {
        if constexpr (FP8) {
            const int sc = c * CH / p.qbc;
#pragma unroll
            for (int i = 0; i < GEMV_FEATS; ++i) s[i] = ok[i] ? __ldg(sr[i] + sc) : 0.0f;
        }
    };
    int c = threadIdx.x;
    if (pre) {
        // The first chunk's weights were loaded before the PDL wait (gemv_early_chunk).
        if (c < wchunks) {
            float s[GEMV_FEATS];
            scales(c, s);
            chunk(c, *pre, s);
        }
        c += WARPS * 32;
    }
    for (; c < wchunks; c += WARPS * 32) {
        uint4 wv[GEMV_FEATS];
        float s[GEMV_FEATS];
#pragma unroll
        for (int i = 0; i < GEMV_FEATS; ++i) wv[i] = ok[i] ? load_stream(wr[i] + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
        scales(c, s);
        chunk(c, wv, s);
    }
    }

    gemv_reduce<R, GEMV_FEATS>(acc, red, lane, warp);
    __syncthreads();
    gemv_finish<T, R, GEMV_FEATS, GEMV_FEATS>(p, red, mi, j0, row0);
}

// The block's tiles with each thread's weight chunks streamed through its own ring of
// GEMV_ASYNC_DEPTH slots in shared memory (`cp.async`, past L1): while a chunk's R x F x 8
// multiply-adds run, the next GEMV_ASYNC_DEPTH chunks are in flight — across the block's tile
// boundaries — without registers to hold them (the register-carried pipeline above keeps one).
// A thread reads back only what it copied itself, so no block barrier guards the ring. The
// chunks, their order and every product and sum are gemv_tile's: the same bits.
template <typename T, int R, int F, bool NORM>
static __device__ __forceinline__ void gemv_async_tiles(const GemvParams& p, const T* x, const T* xs, int row0,
                                                        const float (&inv)[R], float (&red)[GEMV_WARPS][R][F]) {
    constexpr int D = GEMV_ASYNC_DEPTH, S = GEMV_WARPS * 32, WSIZE = (int)sizeof(T);
    __shared__ __align__(16) uint4 ring[D][F][S];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int k = p.k, wchunks = k / 8;
    const int tiles = gemv_tile_count(p);
    // The next entry this thread copies: tile `ptile`, chunk `pc` of its F weight rows `pw`.
    int ptile = blockIdx.x, pc = t;
    const char* pw[F];
    bool pok[F];
    gemv_rows16<F>(p, ptile < tiles ? ptile : 0, WSIZE, pw, pok);
    const bool any = t < wchunks;
    auto issue = [&](int slot) {
        const bool valid = any && ptile < tiles;
#pragma unroll
        for (int i = 0; i < F; ++i)
            flashrt::cp_async16(flashrt::smem_u32(&ring[slot][i][t]), pw[i] + (valid && pok[i] ? (size_t)pc * 16 : 0),
                                valid && pok[i]);
        flashrt::cp_async_commit();
        if (valid) {
            pc += S;
            if (pc >= wchunks) {
                pc = t;
                ptile += gridDim.x;
                if (ptile < tiles) gemv_rows16<F>(p, ptile, WSIZE, pw, pok);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < D; ++s) issue(s);
    int slot = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        // (gemv_tile_in written out: calling it here compiles these kernels differently from
        // the measured build, benches/RESULTS.md 2026-12-06 19:36.)
        int b = tile, mi = 0;
        while (mi + 1 < p.nmats && b >= p.m[mi].blocks) {
            b -= p.m[mi].blocks;
            ++mi;
        }
        const int j0 = p.glu ? b * (F / 2) : b * F;
        float acc[R][F];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int i = 0; i < F; ++i) acc[r][i] = 0.0f;
        for (int c = t; c < wchunks; c += S) {
            flashrt::cp_async_wait<D - 1>();
            float wf[F][8];
#pragma unroll
            for (int i = 0; i < F; ++i) flashrt::unpack16<T>(ring[slot][i][t], wf[i]);
            issue(slot);
            slot = slot + 1 == D ? 0 : slot + 1;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float xf[8];
                gemv_load_x<T, R, NORM, false>(p, k, x, xs, inv, r, c, xf);
#pragma unroll
                for (int i = 0; i < F; ++i)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][i] = fmaf(xf[e], wf[i][e], acc[r][i]);
            }
        }
        gemv_reduce<R, F>(acc, red, lane, warp);
        __syncthreads();
        gemv_finish<T, R, F, F>(p, red, mi, j0, row0);
        // `red` is reused by the next tile.
        __syncthreads();
    }
    flashrt::cp_async_wait<0>();
}

// One row without a fused norm, `p.early`: the first weights before the PDL wait. Weights are
// never written by a step, so a block can ask DRAM for its tile's first chunk as soon as it is
// resident, i.e. while the previous kernel's last blocks still run, and wait for that kernel
// only before it reads its input. The chunk is then gemv_tile's first, with the same products
// in the same order: the same bits. H100, one row at 2048 (benches/RESULTS.md, 2026-12-07
// 17:40): the 35B-A3B step 3.30 -> 3.23 ms (its out_proj / o_proj, 16.8 MB each), the 27B
// bf16 step 17.96 -> 18.07 and FP8 11.62 -> 11.68 (31-178 MB launches), hence a launch size
// limit on the host. (With the norm too, the 8-feature kernels spill, and nothing gained.)
#define GEMV_EARLY_OK(R, NORM) ((R) == 1 && !(NORM))

// Chunk threadIdx.x of tile `tile`'s F weight rows (gemv_tile's `wr`, `ok`: zero past n or
// past k). (Their FP8 scales are loaded after the wait: before it, the one-row FP8 kernel spills.)
template <int F>
static __device__ __forceinline__ void gemv_early_chunk(const GemvParams& p, int tile, int wsize, uint4 (&wv)[F]) {
    constexpr int HALF = F / 2;
    int b = tile, mi = 0;
    gemv_tile_in(p, b, mi);
    const int c = threadIdx.x, ch = 16 / wsize;
    const bool in_k = c < p.k / ch;
#pragma unroll
    for (int i = 0; i < F; ++i) {
        const int j = p.glu ? b * HALF + (i % HALF) : b * F + i;
        const GemvMat& m = p.glu ? p.m[i / HALF] : p.m[mi];
        const bool ok = in_k && j < (p.glu ? p.m[0].n : m.n);
        wv[i] = ok ? load_stream(static_cast<const char*>(m.w) + ((size_t)j * p.k * wsize + (size_t)c * 16))
                   : make_uint4(0, 0, 0, 0);
    }
}

// A block takes tiles blockIdx.x, blockIdx.x + gridDim.x, ... (the host launches one block per
// tile, or with FLASHRT_GEMV_TILES=1 for several rows of 16-bit weights as many blocks as are
// resident, so that the norm prologue, whose cost grows with the rows, runs once per block
// rather than once per tile). What a tile computes does not depend on which block runs it.
template <typename T, int R, int GEMV_FEATS, bool NORM, bool FP8 = false>
static __device__ __forceinline__ void gemv_impl(const GemvParams& p) {
    // `p.early`: the first weights, then the wait (gemv_entry has not waited).
    uint4 pre[GEMV_FEATS];
    if constexpr (GEMV_EARLY_OK(R, NORM)) {
        if (p.early && !p.side) {
            gemv_early_chunk<GEMV_FEATS>(p, blockIdx.x, FP8 ? 1 : (int)sizeof(T), pre);
            flashrt::pdl_enter();
        }
    }
    __shared__ float red[GEMV_WARPS][R][GEMV_FEATS];
    const T* x = static_cast<const T*>(p.x);
    // `last_row`: a prefill chunk whose caller wants only the last position's logits computes
    // the LM head for row io.len - 1 alone, reading and writing that row.
    const int row0 = p.last_row ? flashrt::load_len(p.len) - 1 : 0;
    x += (size_t)row0 * p.ld_x;
    float inv[R];
    if constexpr (GEMV_ASYNC_ON(R, NORM, FP8)) {
        // The warps' sums of squares in `red` (free until the first tile's reduction; the
        // barrier below or the staging's keeps them apart), so that 8 staged rows of k = 5120,
        // the ring and `red` fit two blocks an SM.
        if (NORM) {
            gemv_norm_inv_in<T, R>(p, x, inv, reinterpret_cast<float(&)[GEMV_WARPS][R]>(red));
            if (!p.stage) __syncthreads();
        }
    } else if (NORM) {
        gemv_norm_inv<T, R>(p, x, inv);
    }
    extern __shared__ __align__(16) unsigned char gemv_xs_smem[];
    T* xs = reinterpret_cast<T*>(gemv_xs_smem);
    if (GEMV_STAGED(R, NORM, FP8) && p.stage) {
        // The rows normalised and rounded once per block, as `gemv_norm_store` stores them
        // (block 0 stores them too, for later readers).
        const int k = p.k;
        for (int c = threadIdx.x; c < (k >> 3); c += GEMV_WARPS * 32)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float xf[8];
                flashrt::unpack16<T>(__ldg(reinterpret_cast<const uint4*>(x + (size_t)r * p.ld_x) + c), xf);
                gemv_norm_chunk<T>(p, inv[r], c, xf);
                T v[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) v[e] = flashrt::from_f32<T>(xf[e]);
                *reinterpret_cast<uint4*>(xs + (size_t)r * k + (size_t)c * 8) = *reinterpret_cast<const uint4*>(v);
                if (blockIdx.x == 0) {
                    T* o = static_cast<T*>(p.norm_out) + (size_t)r * p.ld_norm_out + (size_t)c * 8;
#pragma unroll
                    for (int e = 0; e < 8; ++e) o[e] = v[e];
                }
            }
        __syncthreads();
    } else if (NORM && blockIdx.x == 0 && p.norm_out) {
        gemv_norm_store<T, R>(p, x, inv);
    }
    if constexpr (R == 1) {
        // One row: always one block per tile (and the loop's registers would spill in the FP8
        // kernels).
        if (GEMV_EARLY_OK(R, NORM) && p.early && !p.side)
            gemv_tile<T, R, GEMV_FEATS, NORM, FP8>(p, blockIdx.x, x, xs, row0, inv, red, -1, nullptr, nullptr, &pre);
        else
            gemv_tile<T, R, GEMV_FEATS, NORM, FP8>(p, blockIdx.x, x, xs, row0, inv, red);
        return;
    }
    if constexpr (GEMV_ASYNC_ON(R, NORM, FP8)) {
        gemv_async_tiles<T, R, GEMV_FEATS, NORM>(p, x, xs, row0, inv, red);
        return;
    } else {
    const int tiles = gemv_tile_count(p);
    uint4 carry[GEMV_FEATS];
    bool carried = false;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int next = tile + (int)gridDim.x < tiles ? tile + (int)gridDim.x : -1;
        gemv_tile<T, R, GEMV_FEATS, NORM, FP8>(p, tile, x, xs, row0, inv, red, next, carry, &carried);
        // `red` is reused by the next tile.
        __syncthreads();
    }
    }
}

// ---- gemv16s: the same blocks, the products on the tensor cores ----------------------------
//
// `gemv16s_*` computes what `gemv_*` computes over 16-bit weights, with the blocks, tiles and
// loads of `gemv_tile` — a block per F (8, or 4 / 2 at one row) weight rows, thread t loading
// 16-byte chunks t, t + 256, ... of every row straight past L1, so a warp's load instruction
// streams 512 contiguous bytes of one row, the pattern that reads at ~4.2 TB/s on the H200 —
// but the multiply-adds run as `mma.sync.m16n8k16` (f32 accumulation) instead of R x 8 FMAs
// per chunk and row: the weight rows are the MMA's n = 8 columns, the R <= 8 input rows its
// first R of m = 16 rows, so one row and eight cost the same instructions. (On the CUDA cores
// R rows cost R times the FMAs: a verify or batched step of 5 to 8 rows is compute-bound.)
//
// Why a shared-memory hop: a lane holds 8 consecutive columns of every row of the tile, but an
// MMA operand wants each lane to hold columns of one row. Each warp stores its 8 rows x 32
// chunks (4 KiB) to its own shared-memory buffer (chunk c of row r at chunk c ^ r of the row's
// 512 bytes: a store instruction writes one row, 32 distinct chunks, and an ldmatrix phase reads
// one chunk of 8 rows, 8 distinct 16-byte bank groups: no conflicts either way) and reads them
// back as B fragments with ldmatrix.x4 (two k16 steps each). The inputs' A fragments are the
// rows' pairs of columns at the same k: at R <= 2 loaded from global memory (L1) as 4-byte
// pairs by the lanes of rows < R; at R > 2 staged through a second buffer like the weights
// (a chunk per lane and row, normalised when a norm is fused) and read by ldmatrix.
//
// Each output is then the sum, over the warps in order, of the warp's MMA accumulation over its
// windows of 256 columns in order, k16 step after k16 step: the same operations whatever R is
// and whichever F (an MMA's columns and rows do not mix), so decode, verify and batched steps
// round alike, as with `gemv_*` — but not alike `gemv_*` (a different summation order), so a
// model runs one or the other in every phase (`CudaOptions::gemv16_smem`). The next window's
// weights are requested before the current window's products, so each thread has its 8
// chunks (128 bytes) in flight while its warp computes.
//
// Traffic: n * k * 2 bytes of weights; per block R * k input elements from L1/L2; shared
// memory 4 KiB per warp (8 KiB at R > 2, dynamic: `GEMVS_SMEM(R)` bytes a block).
#define GEMVS_XS(R) ((R) > 2)
#define GEMVS_SMEM(R) (GEMV_WARPS * (GEMVS_XS(R) ? 2 : 1) * 8 * 32 * 16)

static __device__ __forceinline__ void gemvs_sts(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// Byte offset of chunk c of row r in a warp's 8 x 32-chunk buffer (see above).
static __device__ __forceinline__ uint32_t gemvs_off(int r, int c) { return (uint32_t)((r * 32 + (c ^ r)) * 16); }

// d += A B for m16n8k16 with A's rows 8..15 zero: a0 / a2 hold row g's columns 2t, 2t + 1 and
// 2t + 8, 2t + 9; b0 / b1 column g's rows at the same k.
static __device__ __forceinline__ void gemvs_mma(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1,
                                                 const __nv_bfloat16*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
static __device__ __forceinline__ void gemvs_mma(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1,
                                                 const __half*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

// Columns kc, kc + 1 of an input row as an A-fragment register: as stored, or normalised and
// rounded to the element type as `gemv_norm_chunk` (the separate `rms_norm` op) gives them.
template <typename T, bool NORM>
static __device__ __forceinline__ uint32_t gemvs_pair(const GemvParams& p, const T* xr, int kc, float inv) {
    uint32_t v = *reinterpret_cast<const uint32_t*>(xr + kc);
    if constexpr (NORM) {
        float s0 = 1.0f, s1 = 1.0f;
        if (p.norm_w) {
            const float2 w = __ldg(reinterpret_cast<const float2*>(p.norm_w + kc));
            s0 = w.x, s1 = w.y;
            if (p.one_plus) s0 += 1.0f, s1 += 1.0f;
        }
        const T* e = reinterpret_cast<const T*>(&v);
        const T y0 = flashrt::from_f32<T>(flashrt::to_f32(e[0]) * inv * s0);
        const T y1 = flashrt::from_f32<T>(flashrt::to_f32(e[1]) * inv * s1);
        v = (uint32_t)*reinterpret_cast<const unsigned short*>(&y0) |
            ((uint32_t)*reinterpret_cast<const unsigned short*>(&y1) << 16);
    }
    return v;
}

// One tile of F outputs of every row, as gemv_tile's (`sw`: this warp's shared buffers).
// Ends after a block barrier; threads return early only after it.
template <typename T, int R, int F, bool NORM>
static __device__ __forceinline__ void gemvs_tile(const GemvParams& p, int tile, const T* x, int row0,
                                                  const float (&inv)[R], float (&red)[GEMV_WARPS][R][F],
                                                  uint32_t sw) {
    constexpr int WARPS = GEMV_WARPS, HALF = F / 2;
    constexpr bool XS = GEMVS_XS(R);
    int b = tile, mi = 0;
    gemv_tile_in(p, b, mi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int k = p.k, chunks = k >> 3;
    const char* wr[F];
    bool ok[F];
    int j0;
    if (p.glu) {
        j0 = b * HALF;
#pragma unroll
        for (int i = 0; i < F; ++i) {
            const int j = j0 + (i % HALF);
            ok[i] = j < p.m[0].n;
            wr[i] = static_cast<const char*>(p.m[i / HALF].w) + (size_t)(ok[i] ? j : 0) * k * sizeof(T);
        }
    } else {
        j0 = b * F;
#pragma unroll
        for (int i = 0; i < F; ++i) {
            ok[i] = j0 + i < p.m[mi].n;
            wr[i] = static_cast<const char*>(p.m[mi].w) + (size_t)(ok[i] ? j0 + i : 0) * k * sizeof(T);
        }
    }
    const uint32_t sx = sw + 8 * 32 * 16;
    // ldmatrix: lane l addresses row l & 7 of matrix l >> 3 (chunk 4q + (l >> 3)).
    const int lm = lane >> 3, lr = lane & 7;
    const T* xg = x + (size_t)(g < R ? g : 0) * p.ld_x;
    // This lane's row's norm scale (a select chain: a register array indexed at run time would
    // go to local memory).
    float ginv = NORM ? inv[0] : 1.0f;
#pragma unroll
    for (int r = 1; r < R; ++r)
        if (NORM && g == r) ginv = inv[r];
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint4 wv[F];
    int cb = warp * 32;
    auto wload = [&](int base) {
        const int c = base + lane;
#pragma unroll
        for (int i = 0; i < F; ++i)
            wv[i] = ok[i] && c < chunks ? load_stream(wr[i] + (size_t)c * 16) : make_uint4(0, 0, 0, 0);
    };
    if (cb < chunks) wload(cb);
    for (; cb < chunks; cb += WARPS * 32) {
        const int c = cb + lane;
        uint4 xv[XS ? R : 1];
        if constexpr (XS) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (c < chunks) {
                    float xf[8];
                    xv[r] = __ldg(reinterpret_cast<const uint4*>(x + (size_t)r * p.ld_x) + c);
                    if (NORM) {
                        flashrt::unpack16<T>(xv[r], xf);
                        gemv_norm_chunk<T>(p, inv[r], c, xf);
                        xv[r] = flashrt::pack16<T>(xf);
                    }
                } else {
                    xv[r] = make_uint4(0, 0, 0, 0);
                }
            }
        }
        // The previous window's ldmatrix reads are done before its buffers are overwritten.
        __syncwarp();
#pragma unroll
        for (int i = 0; i < F; ++i) gemvs_sts(sw + gemvs_off(i, lane), wv[i]);
        if constexpr (XS) {
#pragma unroll
            for (int r = 0; r < R; ++r) gemvs_sts(sx + gemvs_off(r, lane), xv[r]);
        }
        __syncwarp();
        // The next window's weights stream while this one's products run.
        if (cb + WARPS * 32 < chunks) wload(cb + WARPS * 32);
        // Quarters of the window (8 chunks each): the inputs' pairs of a quarter are requested
        // together before its products, so a warp waits for them once a quarter, not at every
        // step (more at once spill at 64 registers).
        // Chunks past k are zeros in both operands (the last window's products add zeros).
#pragma unroll
        for (int part = 0; part < 4; ++part) {
            uint32_t xa[XS ? 1 : 8];
            if constexpr (!XS) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int ch = cb + 8 * part + e;
                    xa[e] = g < R && ch < chunks ? gemvs_pair<T, NORM>(p, xg, ch * 8 + 2 * t4, ginv) : 0u;
                }
            }
#pragma unroll
            for (int qq = 0; qq < 2; ++qq) {
                const int q = 2 * part + qq;
                uint32_t bw[4], ax[4];
                flashrt::ldsm_x4(bw, sw + gemvs_off(lr, 4 * q + lm));
                if constexpr (XS) {
                    flashrt::ldsm_x4(ax, sx + gemvs_off(lr, 4 * q + lm));
                } else {
#pragma unroll
                    for (int e = 0; e < 4; ++e) ax[e] = xa[4 * qq + e];
                }
                // k16 step 2q: chunks 4q (a0, b0) and 4q + 1 (a2, b1); step 2q + 1: 4q + 2, 4q + 3.
                gemvs_mma(acc, ax[0], ax[1], bw[0], bw[1], static_cast<const T*>(nullptr));
                gemvs_mma(acc, ax[2], ax[3], bw[2], bw[3], static_cast<const T*>(nullptr));
            }
        }
    }
    // acc[0], acc[1]: input row g, tile rows 2 t4, 2 t4 + 1.
    if (g < R) {
        if (2 * t4 < F) red[warp][g][2 * t4] = acc[0];
        if (2 * t4 + 1 < F) red[warp][g][2 * t4 + 1] = acc[1];
    }
    __syncthreads();
    gemv_finish<T, R, F, F>(p, red, mi, j0, row0);
}

template <typename T, int R, int F, bool NORM>
static __device__ __forceinline__ void gemvs_impl(const GemvParams& p) {
    __shared__ float red[GEMV_WARPS][R][F];
    extern __shared__ __align__(16) unsigned char gemvs_smem[];
    const T* x = static_cast<const T*>(p.x);
    const int row0 = p.last_row ? flashrt::load_len(p.len) - 1 : 0;
    x += (size_t)row0 * p.ld_x;
    float inv[R];
    if (NORM) gemv_norm_inv<T, R>(p, x, inv);
    if (NORM && blockIdx.x == 0) gemv_norm_store<T, R>(p, x, inv);
    const uint32_t sw = flashrt::smem_u32(gemvs_smem) + (threadIdx.x >> 5) * (GEMVS_XS(R) ? 2 : 1) * 8 * 32 * 16;
    gemvs_tile<T, R, F, NORM>(p, blockIdx.x, x, row0, inv, red, sw);
}

// `gemv16s_r<R>` / `gemv16s_norm_r<R>`: 8 outputs a block; `_r1f4` / `_r1f2`: 4 or 2 (one
// row, small matrices: fuller waves; the same sums).
#define FLASHRT_GEMVS_ENTRY_T(NAME, R, F, NORM, MINB)                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB) NAME##_bf16(const GemvParams p) { \
        flashrt::pdl_enter();                                                                             \
        gemvs_impl<__nv_bfloat16, R, F, NORM>(p);                                                         \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB) NAME##_f16(const GemvParams p) {  \
        flashrt::pdl_enter();                                                                             \
        gemvs_impl<__half, R, F, NORM>(p);                                                                \
    }
// Blocks per SM the register budget allows: 3 (80 registers: the next window's weights, a
// quarter window's input pairs and the row pointers; at 64 they spill more) up to two rows, 2
// past two. `-DGEMVS_MINB_SMALL=2` or `=4` builds the other budgets (microbenchmarks).
#ifndef GEMVS_MINB_SMALL
#define GEMVS_MINB_SMALL 3
#endif
#define GEMVS_MINB(R) ((R) > 2 ? 2 : GEMVS_MINB_SMALL)
#define FLASHRT_GEMVS_ENTRY(R)                                                                            \
    FLASHRT_GEMVS_ENTRY_T(gemv16s_r##R, R, 8, false, GEMVS_MINB(R))                                       \
    FLASHRT_GEMVS_ENTRY_T(gemv16s_norm_r##R, R, 8, true, GEMVS_MINB(R))

FLASHRT_GEMVS_ENTRY_T(gemv16s_r1f4, 1, 4, false, GEMVS_MINB_SMALL)
FLASHRT_GEMVS_ENTRY_T(gemv16s_norm_r1f4, 1, 4, true, GEMVS_MINB_SMALL)
FLASHRT_GEMVS_ENTRY_T(gemv16s_r1f2, 1, 2, false, GEMVS_MINB_SMALL)
FLASHRT_GEMVS_ENTRY_T(gemv16s_norm_r1f2, 1, 2, true, GEMVS_MINB_SMALL)
FLASHRT_GEMVS_ENTRY(1)
FLASHRT_GEMVS_ENTRY(2)
FLASHRT_GEMVS_ENTRY(3)
FLASHRT_GEMVS_ENTRY(4)
FLASHRT_GEMVS_ENTRY(5)
FLASHRT_GEMVS_ENTRY(6)
FLASHRT_GEMVS_ENTRY(7)
FLASHRT_GEMVS_ENTRY(8)

// Features per block: 8 for one or two rows, 4 for more (their partial sums need more
// registers). The thread-to-chunk mapping and the reduction order do not depend on it.
#define GEMV_FEATS_OF(R) ((R) <= 2 ? 8 : 4)

// Blocks per SM the register budget must allow: a decode step's single row streams with
// many resident blocks; more rows need more registers.
// (Two rows at 3 an SM spill and run slower: benches/RESULTS.md, 2026-12-06 18:51.)
#define GEMV_MINB_OF(R) ((R) == 1 ? 4 : 2)

// FP8 weights keep a scale pointer per feature and convert codes in registers: 8 features
// for one row, 4 for more, and a register budget that holds them without spilling.
#define GEMV8_FEATS_OF(R) ((R) == 1 ? 8 : 4)
#define GEMV8_MINB_OF(R) ((R) == 1 ? 3 : 1)

// The CUDA-core entries' PDL order: wait then trigger, or a side launch's (GemvParams::side).
template <typename T, int R, int FEATS, bool NORM, bool FP8>
static __device__ __forceinline__ void gemv_entry(const GemvParams& p) {
    // (One call of the body, so that it is inlined once.)
    if (p.side)
        flashrt::pdl_trigger();
    else if (!(GEMV_EARLY_OK(R, NORM) && p.early))
        flashrt::pdl_enter();
    gemv_impl<T, R, FEATS, NORM, FP8>(p);
    if (p.side) flashrt::pdl_wait();
}

// `gemv_r<R>`: plain; `gemv_norm_r<R>`: with the fused RMSNorm prologue (`p.norm` = 1);
// `gemv8_*`: the same over FP8 E4M3 weights with block scales (activations bf16/f16).
#define FLASHRT_GEMV_ENTRY_T(NAME, R, FEATS, NORM, MINB, FP8)                                             \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB) NAME##_bf16(const GemvParams p) {   \
        gemv_entry<__nv_bfloat16, R, FEATS, NORM, FP8>(p);                                              \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MINB) NAME##_f16(const GemvParams p) {    \
        gemv_entry<__half, R, FEATS, NORM, FP8>(p);                                                     \
    }
#define FLASHRT_GEMV_ENTRY(R)                                                                            \
    FLASHRT_GEMV_ENTRY_T(gemv_r##R, R, GEMV_FEATS_OF(R), false, GEMV_MINB_OF(R), false)                  \
    FLASHRT_GEMV_ENTRY_T(gemv_norm_r##R, R, GEMV_FEATS_OF(R), true, GEMV_MINB_OF(R), false)              \
    FLASHRT_GEMV_ENTRY_T(gemv8_r##R, R, GEMV8_FEATS_OF(R), false, GEMV8_MINB_OF(R), true)                \
    FLASHRT_GEMV_ENTRY_T(gemv8_norm_r##R, R, GEMV8_FEATS_OF(R), true, GEMV8_MINB_OF(R), true)

// One row with fewer features per block (`gemv_r1f<F>`): more, smaller blocks for matrices
// with few rows (5120 outputs make 640 blocks of 8, 1.2 waves of resident blocks on an H200;
// 2560 blocks of 2 balance to within a few percent). Same arithmetic per output.
FLASHRT_GEMV_ENTRY_T(gemv_r1f4, 1, 4, false, 4, false)
FLASHRT_GEMV_ENTRY_T(gemv_norm_r1f4, 1, 4, true, 4, false)
FLASHRT_GEMV_ENTRY_T(gemv_r1f2, 1, 2, false, 4, false)
FLASHRT_GEMV_ENTRY_T(gemv_norm_r1f2, 1, 2, true, 4, false)
FLASHRT_GEMV_ENTRY_T(gemv8_r1f4, 1, 4, false, 3, true)
FLASHRT_GEMV_ENTRY_T(gemv8_norm_r1f4, 1, 4, true, 3, true)
FLASHRT_GEMV_ENTRY_T(gemv8_r1f2, 1, 2, false, 3, true)
FLASHRT_GEMV_ENTRY_T(gemv8_norm_r1f2, 1, 2, true, 3, true)

FLASHRT_GEMV_ENTRY(1)
FLASHRT_GEMV_ENTRY(2)
FLASHRT_GEMV_ENTRY(3)
FLASHRT_GEMV_ENTRY(4)
FLASHRT_GEMV_ENTRY(5)
FLASHRT_GEMV_ENTRY(6)
FLASHRT_GEMV_ENTRY(7)
FLASHRT_GEMV_ENTRY(8)
