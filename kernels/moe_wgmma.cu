// flashrt kernels: the prefill MoE experts' grouped GEMMs on Hopper's warpgroup tensor cores
// (plan op `Moe`, plans of more than 8 rows, bf16/f16 targets, sm_90a).
//
// Same tiles, scratch and results as `moe_up_mm` / `moe_down_mm` (moe.cu), which they replace
// on compute capability 9.0: `moe_tiles` lists (expert, first pair) tiles of MOE_MM_M = 64
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

#define MOE_WG_D64 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

#define MOE_WG_OPS64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

template <typename T> struct Wg;

// One 16-byte cp.async into shared `dst` (zero-filled when !valid; `src` is then not read).
static __device__ __forceinline__ void cp16(unsigned char* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(flashrt::smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

#define MOE_WG_TYPE(T, PTX)                                                                        \
    template <> struct Wg<T> {                                                                     \
        /* C[64 x 128] (+)= A[64 x 16] B[128 x 16]^T, both K-major in shared memory. */           \
        static __device__ __forceinline__ void mma(float (&d)[64], uint64_t a, uint64_t b, int acc) { \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
                         "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " " MOE_WG_D64  \
                         ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                         \
                         : MOE_WG_OPS64(d)                                                         \
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
        if (kt < nk) {
            unsigned char* st = base + (kt % MOE_WG_STAGES) * MOE_WG_STAGE_BYTES;
            const int k0 = kt * 64 + c * 8;
            const bool kin = k0 < K;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = r0 + 16 * i;
                const bool ok = kin && a_src[i];
                cp16(st + r * 128 + ((c ^ (r & 7)) << 4), ok ? a_src[i] + k0 : any, ok);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = r0 + 16 * i;
                const bool ok = kin && b_src[i];
                cp16(st + MOE_WG_A_BYTES + r * 128 + ((c ^ (r & 7)) << 4), ok ? b_src[i] + k0 : any, ok);
            }
        }
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
