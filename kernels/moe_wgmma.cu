// flashrt kernels: the prefill MoE experts' grouped GEMMs on Hopper's warpgroup tensor cores
// (plan op `Moe`, plans of more than 8 rows, bf16/f16 targets, sm_90a).
//
// Same tiles, scratch and results as `moe_up_mm` / `moe_down_mm` (moe.cu), which they replace
// on compute capability 9.0: `moe_plan2` lists (expert, first pair) tiles of MOE_MM_M = 64
// pairs; block (feature tile, pair tile) computes C[64 pairs, 128 features] =
// A[pairs, K] . B[features, K]^T with A the pairs' gathered rows (x for up, the hidden
// activations for down) and B the expert's weight rows, both K-major.
//
// block = one warpgroup (128 threads); warp w owns pair rows 16w .. 16w + 15 (the wgmma M
// layout). loop = over K in slabs of 64 elements (128-byte rows): MOE_WG_STAGES stages in
// flight through cp.async (16-byte chunks, rows gathered per pair, zero-filled past the tile's
// pairs, past the matrix or past K), each stage one A slab [64 rows] and one B slab [128 rows]
// in the 128-byte-swizzled layout wgmma reads (chunk c of row r at chunk c ^ (r & 7), 8-row
// groups 1024 bytes apart, slabs 1024-aligned), then 4 x wgmma m64n128k16 (f32 accumulators,
// 64 registers per thread) with both operands read from shared memory. Descriptors and the
// wgmma fences are wgmma.cuh's (flashrt_wg).
//
// Up (SwiGLU): B rows 0..63 are the gate rows of features c0 .. c0 + 63 and rows 64..127 the
// up rows of the same features, so a thread holds each feature's gate and up accumulators and
// the epilogue writes act(gate) * up (both rounded to T first, as moe_up_mm does) straight to
// the pair's hidden activation. relu^2 experts: 128 up rows. Down: 128 hidden features per
// block into the pair's y; moe_combine sums the ranks in order afterwards.
//
// Each output is one tensor-core dot product of its own A row and B column whatever else
// shares the tile, so a row's result does not depend on the chunk it is in.
//
// Without sm_90a (the compute_90 PTX fallback) the entry points trap; the host selects them
// only on compute capability 9.0.
#include "common.cuh"
#include "wgmma.cuh"

#define MOE_WG_N 128
#define MOE_WG_A_BYTES (MOE_MM_M * 128)
#define MOE_WG_B_BYTES (MOE_WG_N * 128)
#define MOE_WG_STAGE_BYTES (MOE_WG_A_BYTES + MOE_WG_B_BYTES)
// Dynamic shared memory of S stages plus 1 KiB of alignment slack.
#define MOE_WG_SMEM(S) ((S) * MOE_WG_STAGE_BYTES + 1024)

namespace moe_wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename T> struct Wg;

// One 16-byte cp.async into shared `dst` (zero-filled when !valid; `src` is then not read).
static __device__ __forceinline__ void cp16(unsigned char* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(flashrt::smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

// One 64-column K slab into stage `st`: this thread's NA A rows and NB B rows (rows r0 + STEP
// i), 16 bytes at chunk c of each 128-byte row, swizzled (chunk c of row r at c ^ (r & 7)), the B
// slab `a_bytes` after the A slab; null rows and columns past K zero-filled (`any`: a valid
// address, never read). `k0`: the slab's first column plus this thread's chunk.
template <typename T, int NA, int NB, int STEP>
static __device__ __forceinline__ void load_slab(unsigned char* st, int a_bytes, const T* const (&a)[NA],
                                                 const T* const (&b)[NB], const T* any, int r0, int c, int k0, int K) {
    const bool kin = k0 < K;
#pragma unroll
    for (int i = 0; i < NA; ++i) {
        const int r = r0 + STEP * i;
        const bool ok = kin && a[i];
        cp16(st + r * 128 + ((c ^ (r & 7)) << 4), ok ? a[i] + k0 : any, ok);
    }
#pragma unroll
    for (int i = 0; i < NB; ++i) {
        const int r = r0 + STEP * i;
        const bool ok = kin && b[i];
        cp16(st + a_bytes + r * 128 + ((c ^ (r & 7)) << 4), ok ? b[i] + k0 : any, ok);
    }
}

#define MOE_WG_TYPE(T, PTX)                                                                        \
    template <> struct Wg<T> {                                                                     \
        /* C[64 x 128] (+)= A[64 x 16] B[128 x 16]^T, both K-major in shared memory. */           \
        static __device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b, int acc) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " FLASHRT_WG_D64  \
                         ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                         \
                         : FLASHRT_WG_OPS64(d)                                                         \
                         : "l"(a), "l"(b), "r"(acc));                                              \
        }                                                                                          \
    };

MOE_WG_TYPE(__nv_bfloat16, "bf16")
MOE_WG_TYPE(__half, "f16")

// C = A B^T for one tile: `a_row(m)` (m < 64) and `b_row(n)` (n < 128) give the rows' global
// addresses or null (zero rows); K a multiple of 8. On return d holds the accumulators: d[4 j
// + e] is row 16 w + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + (e & 1).
template <typename T, int MOE_WG_STAGES, typename ARow, typename BRow>
static __device__ __forceinline__ void gemm_tile(ARow a_row, BRow b_row, int K, float (&d)[64], unsigned char* raw) {
    const uint32_t raw_s = flashrt::smem_u32(raw);
    const uint32_t base_s = (raw_s + 1023u) & ~1023u;
    unsigned char* base = raw + (base_s - raw_s);
    const int tid = threadIdx.x;
    // This thread's chunks: A rows tid / 8 + 16 i (4 of them), B rows tid / 8 + 16 i (8), all
    // at chunk tid % 8; their sources are fixed for the whole tile.
    const int c = tid & 7, r0 = tid >> 3;
    const T* a_src[4];
    const T* b_src[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) a_src[i] = a_row(r0 + 16 * i);
#pragma unroll
    for (int i = 0; i < 8; ++i) b_src[i] = b_row(r0 + 16 * i);
    const T* any = b_src[0] ? b_src[0] : a_row(0);
    const int nk = (K + 63) / 64;
    auto load = [&](int kt) {
        if (kt < nk)
            load_slab<T, 4, 8, 16>(base + (kt % MOE_WG_STAGES) * MOE_WG_STAGE_BYTES, MOE_WG_A_BYTES, a_src, b_src,
                                   any, r0, c, kt * 64 + c * 8, K);
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < MOE_WG_STAGES - 1; ++s) load(s);
    for (int kt = 0; kt < nk; ++kt) {
        // Stage kt landed (this thread's copies), made visible to the async proxy, then to
        // every thread; all warps are past the wgmma of kt - 1, whose buffer is refilled next.
        asm volatile("cp.async.wait_group %0;\n" ::"n"(MOE_WG_STAGES - 2));
        flashrt_wg::fence_async_smem();
        __syncthreads();
        load(kt + MOE_WG_STAGES - 1);
        const uint32_t st = base_s + (kt % MOE_WG_STAGES) * MOE_WG_STAGE_BYTES;
        flashrt_wg::wg_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            Wg<T>::mma(d, flashrt_wg::desc128(st + ks * 32, 16, 1024),
                       flashrt_wg::desc128(st + MOE_WG_A_BYTES + ks * 32, 16, 1024), kt > 0 || ks > 0);
        flashrt_wg::wg_commit();
        flashrt_wg::wg_wait<0>();
        flashrt_wg::pin(d);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}

#endif // __CUDA_ARCH_FEAT_SM90_ALL

} // namespace moe_wg

// grid = (ceil(inter / 64) SwiGLU or ceil(inter / 128) relu^2, max tiles), block = 128,
// dynamic shared memory MOE_WG_SMEM(S).
template <typename T, int S> static __device__ __forceinline__ void moe_up_wg_impl(const MoeParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int max_pairs = p.max_pairs;
    if ((int)blockIdx.y >= *moe::n_tiles(p, max_pairs)) return;
    const int e = moe::tiles(p, max_pairs)[2 * blockIdx.y];
    const int t0 = moe::tiles(p, max_pairs)[2 * blockIdx.y + 1];
    const int n = min(MOE_MM_M, moe::offsets(p)[e + 1] - t0);
    const int H = p.hidden, I = p.inter, K = p.top_k;
    const int per = p.swiglu ? MOE_WG_N / 2 : MOE_WG_N; // features per block
    const int c0 = blockIdx.x * per;
    const int up_rows = p.swiglu ? 2 * I : I;
    const T* base = static_cast<const T*>(p.up) + (size_t)e * up_rows * H;
    const int* pr = moe::pairs(p) + t0;
    auto a_row = [&](int m) -> const T* {
        return m < n ? static_cast<const T*>(p.x) + (size_t)(pr[m] / K) * p.ld_x : nullptr;
    };
    auto b_row = [&](int r) -> const T* {
        const int f = c0 + (r % per);
        if (f >= I) return nullptr;
        return base + (size_t)(r < per ? f : I + f) * H;
    };
    extern __shared__ __align__(128) unsigned char moe_wg_smem[];
    float d[64];
    moe_wg::gemm_tile<T, S>(a_row, b_row, H, d, moe_wg_smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int m = warp * 16 + (lane >> 2) + 8 * half;
        if (m >= n) continue;
        const int pair = pr[m];
        T* out = moe::hidden_of<T>(p, pair / K, pair % K);
        // SwiGLU: column blocks j < 8 are gates, j + 8 the matching ups.
        if (p.swiglu) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int f = c0 + 8 * j + 2 * (lane & 3) + b;
                    if (f >= I) continue;
                    const float g = flashrt::to_f32(flashrt::from_f32<T>(d[4 * j + 2 * half + b]));
                    const float u = flashrt::to_f32(flashrt::from_f32<T>(d[4 * (j + 8) + 2 * half + b]));
                    out[f] = flashrt::from_f32<T>(flashrt::apply_act(flashrt::ACT_SILU, g) * u);
                }
        } else {
#pragma unroll
            for (int j = 0; j < 16; ++j)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const int f = c0 + 8 * j + 2 * (lane & 3) + b;
                    if (f >= I) continue;
                    const float g = flashrt::to_f32(flashrt::from_f32<T>(d[4 * j + 2 * half + b]));
                    out[f] = flashrt::from_f32<T>(flashrt::apply_act(flashrt::ACT_RELU2, g));
                }
        }
    }
#else
    __trap();
#endif
}

// grid = (ceil(hidden / 128), max tiles), block = 128, dynamic shared memory MOE_WG_SMEM(S).
template <typename T, int S> static __device__ __forceinline__ void moe_down_wg_impl(const MoeParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int max_pairs = p.max_pairs;
    if ((int)blockIdx.y >= *moe::n_tiles(p, max_pairs)) return;
    const int e = moe::tiles(p, max_pairs)[2 * blockIdx.y];
    const int t0 = moe::tiles(p, max_pairs)[2 * blockIdx.y + 1];
    const int n = min(MOE_MM_M, moe::offsets(p)[e + 1] - t0);
    const int H = p.hidden, I = p.inter, K = p.top_k, c0 = blockIdx.x * MOE_WG_N;
    const T* base = static_cast<const T*>(p.down) + (size_t)e * H * I;
    const int* pr = moe::pairs(p) + t0;
    auto a_row = [&](int m) -> const T* {
        return m < n ? moe::hidden_of<T>(p, pr[m] / K, pr[m] % K) : nullptr;
    };
    auto b_row = [&](int r) -> const T* {
        const int f = c0 + r;
        return f < H ? base + (size_t)f * I : nullptr;
    };
    extern __shared__ __align__(128) unsigned char moe_wg_smem[];
    float d[64];
    moe_wg::gemm_tile<T, S>(a_row, b_row, I, d, moe_wg_smem);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int m = warp * 16 + (lane >> 2) + 8 * half;
        if (m >= n) continue;
        const int pair = pr[m];
        T* y = moe::y_of<T>(p, pair / K, pair % K);
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const int f = c0 + 8 * j + 2 * (lane & 3) + b;
                if (f < H) y[f] = flashrt::from_f32<T>(d[4 * j + 2 * half + b]);
            }
    }
#else
    __trap();
#endif
}

#define MOE_WG_ENTRY(name, S, suffix)                                                         \
    extern "C" __global__ void __launch_bounds__(128) name##suffix##_bf16(const MoeParams p) { \
        flashrt::pdl_enter();                                                                  \
        name##_impl<__nv_bfloat16, S>(p);                                                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) name##suffix##_f16(const MoeParams p) {  \
        flashrt::pdl_enter();                                                                  \
        name##_impl<__half, S>(p);                                                            \
    }

MOE_WG_ENTRY(moe_up_wg, 3, )
MOE_WG_ENTRY(moe_down_wg, 3, )

// ---- wide tiles: 128 pairs x 256 weight rows, persistent blocks ---------------------------
//
// `moe_up_w2` / `moe_down_w2` compute what `moe_up_wg` / `moe_down_wg` compute, over tiles of
// MOE_W2_M = 128 pairs (`moe_plan2` with p.tile_m = 128) and 256 weight rows. Why: a 64 x 128
// tile moves 24 KiB into shared memory per 0.5 M multiply-adds, and at the 35B-A3B shape those
// kernels ran at ~40 % (up) and ~22 % (down, K = 512: 8 slabs a block, each block filling
// and draining its own pipeline) of the tensor cores' rate (benches/RESULTS.md, 2026-12-06).
// Here a slab of 48 KiB feeds 2 M multiply-adds, and the blocks are persistent: block b takes
// work items (pair tile, feature tile) b, b + grid, ... as one stream of K slabs, so the next
// item's first slabs load while this item's last ones multiply and its epilogue stores.
//
// block = two warpgroups (256 threads); warpgroup g owns pair rows 64 g .. 64 g + 63, both
// read the slab's 256 B rows (wgmma m64n256k16, 128 f32 accumulators a thread). MOE_W2_STAGES
// = 4 buffers, loads two slabs ahead: while the wgmma of slab s runs, slab s + 1 lands and
// slab s + 2 is queued into the buffer the wgmma of slab s - 2 read (waited for with
// wgmma.wait_group 1). Each output is still one tensor-core dot product of its own A row and B
// column over K in slab order, whatever else shares the tile.
#define MOE_W2_M 128
#define MOE_W2_N 256
#define MOE_W2_STAGES 4
#define MOE_W2_A_BYTES (MOE_W2_M * 128)
#define MOE_W2_B_BYTES (MOE_W2_N * 128)
#define MOE_W2_STAGE_BYTES (MOE_W2_A_BYTES + MOE_W2_B_BYTES)
#define MOE_W2_SMEM (MOE_W2_STAGES * MOE_W2_STAGE_BYTES + 1024)

namespace moe_wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename T> struct Wg2;

#define MOE_W2_TYPE(T, PTX)                                                                        \
    template <> struct Wg2<T> {                                                                    \
        /* C[64 x 256] (+)= A[64 x 16] B[256 x 16]^T, both K-major in shared memory. */           \
        static __device__ __forceinline__ void mma(float (&d)[128], uint64_t a, uint64_t b, int acc) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                             \
                         "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " " FLASHRT_WG_D128 \
                         ", %128, %129, p, 1, 1, 0, 0;\n}\n"                                       \
                         : FLASHRT_WG_OPS128(d)                                                        \
                         : "l"(a), "l"(b), "r"(acc));                                              \
        }                                                                                          \
    };

MOE_W2_TYPE(__nv_bfloat16, "bf16")
MOE_W2_TYPE(__half, "f16")

// The persistent stream of one launch. `Item` describes work item i (pair tile, feature
// tile): `rows(i, a, b)` fills the thread's 4 A row sources (rows r0 + 32 j, null = zero) and 8
// B row sources; `epilogue(i, d)` stores an item's accumulators. K a multiple of 8.
template <typename T, typename Rows, typename Epilogue>
static __device__ __forceinline__ void gemm_stream(int items, int K, Rows rows, Epilogue epilogue, unsigned char* raw) {
    const uint32_t raw_s = flashrt::smem_u32(raw);
    const uint32_t base_s = (raw_s + 1023u) & ~1023u;
    unsigned char* base = raw + (base_s - raw_s);
    const int tid = threadIdx.x, wg = tid >> 7;
    const int c = tid & 7, r0 = tid >> 3;
    const int nk = (K + 63) / 64;
    const int mine = items > (int)blockIdx.x ? (items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int total = mine * nk;
    const T* a_src[4];
    const T* b_src[8];
    const T* any = nullptr;
    // Slab s of this block's stream into buffer s % MOE_W2_STAGES (an empty group past the end,
    // so every iteration commits one).
    auto load = [&](int s) {
        if (s < total) {
            const int j = s / nk, kt = s - j * nk;
            if (kt == 0) {
                rows((int)blockIdx.x + j * (int)gridDim.x, a_src, b_src);
                any = b_src[0];
#pragma unroll
                for (int i = 0; i < 4; ++i) any = any ? any : a_src[i];
            }
            load_slab<T, 4, 8, 32>(base + (s % MOE_W2_STAGES) * MOE_W2_STAGE_BYTES, MOE_W2_A_BYTES, a_src, b_src, any,
                                   r0, c, kt * 64 + c * 8, K);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    load(0);
    load(1);
    for (int j = 0, s = 0; j < mine; ++j) {
        for (int kt = 0; kt < nk; ++kt, ++s) {
            // Slab s landed (this thread's copies; slab s + 1 may be in flight), made visible
            // to the async proxy and to every thread; every warp is past the wait for the
            // wgmma of slab s - 2, whose buffer the next load refills.
            asm volatile("cp.async.wait_group 1;\n" ::);
            flashrt_wg::fence_async_smem();
            __syncthreads();
            load(s + 2);
            const uint32_t st = base_s + (s % MOE_W2_STAGES) * MOE_W2_STAGE_BYTES;
            const uint32_t a_s = st + wg * (64 * 128);
            flashrt_wg::wg_fence();
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                Wg2<T>::mma(d, flashrt_wg::desc128(a_s + ks * 32, 16, 1024),
                            flashrt_wg::desc128(st + MOE_W2_A_BYTES + ks * 32, 16, 1024), kt > 0 || ks > 0);
            flashrt_wg::wg_commit();
            flashrt_wg::wg_wait<1>();
        }
        flashrt_wg::wg_wait<0>();
        flashrt_wg::pin(d);
        epilogue((int)blockIdx.x + j * (int)gridDim.x, d);
        flashrt_wg::pin(d);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
}

#endif // __CUDA_ARCH_FEAT_SM90_ALL

} // namespace moe_wg

// Stores two adjacent outputs (f even, both inside the row when f < limit: limits are
// multiples of 8) as one 4-byte store.
template <typename T> struct MoeW2Pair;
template <> struct MoeW2Pair<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct MoeW2Pair<__half> { using type = __half2; };
template <typename T> static __device__ __forceinline__ void moe_w2_store2(T* row, int f, float v0, float v1) {
    typename MoeW2Pair<T>::type v;
    v.x = flashrt::from_f32<T>(v0);
    v.y = flashrt::from_f32<T>(v1);
    *reinterpret_cast<typename MoeW2Pair<T>::type*>(row + f) = v;
}

// Work item `item` of a wide launch (pair tile item / nf, feature tile item % nf of `per`
// weight rows): its expert, first feature, pair count and pairs.
struct MoeW2Item {
    int e, c0, n;
    const int* pr;
};
static __device__ __forceinline__ MoeW2Item moe_w2_item(const MoeParams& p, int item, int nf, int per) {
    const int y = item / nf;
    const int* t = moe::tiles(p, p.max_pairs) + 2 * y;
    const int e = t[0], t0 = t[1];
    return {e, (item - y * nf) * per, min(MOE_W2_M, moe::offsets(p)[e + 1] - t0), moe::pairs(p) + t0};
}

// grid = min(SMs, work items), block = 256, dynamic shared memory MOE_W2_SMEM. Work item i:
// pair tile i / nf, feature tile i % nf (nf = ceil(inter / 128) SwiGLU, ceil(inter / 256)
// relu^2), so the blocks working at once share the pair tile's gathered rows in L2.
template <typename T> static __device__ __forceinline__ void moe_up_w2_impl(const MoeParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int max_pairs = p.max_pairs;
    const int H = p.hidden, I = p.inter, K = p.top_k;
    const int per = p.swiglu ? MOE_W2_N / 2 : MOE_W2_N; // features per item
    const int nf = (I + per - 1) / per;
    const int items = *moe::n_tiles(p, max_pairs) * nf;
    const int up_rows = p.swiglu ? 2 * I : I;
    const int r0 = threadIdx.x >> 3;
    auto rows = [&](int item, const T* (&a)[4], const T* (&b)[8]) {
        const auto [e, c0, n, pr] = moe_w2_item(p, item, nf, per);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = r0 + 32 * i;
            a[i] = m < n ? static_cast<const T*>(p.x) + (size_t)(pr[m] / K) * p.ld_x : nullptr;
        }
        const T* base = static_cast<const T*>(p.up) + (size_t)e * up_rows * H;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int r = r0 + 32 * i, f = c0 + (r % per);
            b[i] = f < I ? base + (size_t)(r < per ? f : I + f) * H : nullptr;
        }
    };
    const int warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7, lane = threadIdx.x & 31;
    auto epilogue = [&](int item, float (&d)[128]) {
        const auto [e, c0, n, pr] = moe_w2_item(p, item, nf, per);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = 64 * wg + warp * 16 + (lane >> 2) + 8 * half;
            if (m >= n) continue;
            const int pair = pr[m];
            T* out = moe::hidden_of<T>(p, pair / K, pair % K);
            // SwiGLU: column blocks j < 16 are gates, j + 16 the matching ups.
            if (p.swiglu) {
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    const int f = c0 + 8 * j + 2 * (lane & 3);
                    if (f >= I) continue;
                    float h[2];
#pragma unroll
                    for (int b = 0; b < 2; ++b) {
                        const float g = flashrt::to_f32(flashrt::from_f32<T>(d[4 * j + 2 * half + b]));
                        const float u = flashrt::to_f32(flashrt::from_f32<T>(d[4 * (j + 16) + 2 * half + b]));
                        h[b] = flashrt::apply_act(flashrt::ACT_SILU, g) * u;
                    }
                    moe_w2_store2<T>(out, f, h[0], h[1]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 32; ++j) {
                    const int f = c0 + 8 * j + 2 * (lane & 3);
                    if (f >= I) continue;
                    float h[2];
#pragma unroll
                    for (int b = 0; b < 2; ++b)
                        h[b] = flashrt::apply_act(flashrt::ACT_RELU2,
                                                  flashrt::to_f32(flashrt::from_f32<T>(d[4 * j + 2 * half + b])));
                    moe_w2_store2<T>(out, f, h[0], h[1]);
                }
            }
        }
    };
    extern __shared__ __align__(128) unsigned char moe_w2_smem[];
    moe_wg::gemm_stream<T>(items, H, rows, epilogue, moe_w2_smem);
#else
    __trap();
#endif
}

// grid = min(SMs, work items), block = 256, dynamic shared memory MOE_W2_SMEM. Work item i:
// pair tile i / nf, hidden features 256 (i % nf) .. (nf = ceil(hidden / 256)).
template <typename T> static __device__ __forceinline__ void moe_down_w2_impl(const MoeParams& p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int max_pairs = p.max_pairs;
    const int H = p.hidden, I = p.inter, K = p.top_k;
    const int nf = (H + MOE_W2_N - 1) / MOE_W2_N;
    const int items = *moe::n_tiles(p, max_pairs) * nf;
    const int r0 = threadIdx.x >> 3;
    auto rows = [&](int item, const T* (&a)[4], const T* (&b)[8]) {
        const auto [e, c0, n, pr] = moe_w2_item(p, item, nf, MOE_W2_N);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = r0 + 32 * i;
            a[i] = m < n ? moe::hidden_of<T>(p, pr[m] / K, pr[m] % K) : nullptr;
        }
        const T* base = static_cast<const T*>(p.down) + (size_t)e * H * I;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int f = c0 + r0 + 32 * i;
            b[i] = f < H ? base + (size_t)f * I : nullptr;
        }
    };
    const int warp = (threadIdx.x >> 5) & 3, wg = threadIdx.x >> 7, lane = threadIdx.x & 31;
    auto epilogue = [&](int item, float (&d)[128]) {
        const auto [e, c0, n, pr] = moe_w2_item(p, item, nf, MOE_W2_N);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = 64 * wg + warp * 16 + (lane >> 2) + 8 * half;
            if (m >= n) continue;
            const int pair = pr[m];
            T* y_row = moe::y_of<T>(p, pair / K, pair % K);
#pragma unroll
            for (int j = 0; j < 32; ++j) {
                const int f = c0 + 8 * j + 2 * (lane & 3);
                if (f < H) moe_w2_store2<T>(y_row, f, d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
            }
        }
    };
    extern __shared__ __align__(128) unsigned char moe_w2_smem[];
    moe_wg::gemm_stream<T>(items, I, rows, epilogue, moe_w2_smem);
#else
    __trap();
#endif
}

#define MOE_W2_ENTRY(name)                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) name##_bf16(const MoeParams p) {         \
        flashrt::pdl_enter();                                                                     \
        name##_impl<__nv_bfloat16>(p);                                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 1) name##_f16(const MoeParams p) {          \
        flashrt::pdl_enter();                                                                     \
        name##_impl<__half>(p);                                                                  \
    }

MOE_W2_ENTRY(moe_up_w2)
MOE_W2_ENTRY(moe_down_w2)
