// flashrt kernels: the small phases' matmuls over 16-bit weights on the tensor cores, in the
// CUDA-core kernel's shape (`gemv16t_*`). A candidate, off by default (`CudaOptions::gemv16_tc`,
// `FLASHRT_GEMV16_TC=1`) until it measures on the device: benches/kernels/gemvm_micro.cu (mode
// `tc`) next to kernels/gemv.cu's CUDA-core `gemv_*` and kernels/gemv_mma.cu's stream-K
// `gemv16m_*`, and `flashrt bench --batch 1,2,4,8` with the variable set. Uses helpers of
// gemv.cu and gemv_mma.cu (the same translation unit, included before it by name order).
//
// Why this shape (benches/RESULTS.md, 2026-12-04 01:12 UTC): the stream-K tensor-core kernel
// streams as fast as the CUDA-core one until its split tiles are finished, and finishing them
// (the last contributor's store, counter, the other shares, the output) costs ~5-6 us at the end
// of every launch, ~290 launches a step. The CUDA-core kernel has no such chain: a block owns
// its 8 output features over all of k, its 8 warps split k, and the block sums them in shared
// memory; many short blocks (4 per SM at one row) overlap each other's start and end. This
// kernel keeps exactly that work split and replaces the FMAs with MMAs:
//
// - a block of 8 warps owns FEATS (8, or 4 for matrices with few rows) weight rows — in `glu`
//   mode FEATS / 2 gate rows and the up rows with the same indices — as the n = 8 columns of
//   `mma.sync.m16n8k16` (B operand; columns past FEATS are zeros); the R <= 8 input rows are the
//   MMA's first R rows (A operand; rows R.. and 8..15 are zeros), so 1 to 8 rows cost the same
//   instructions;
// - warp w takes the 64-wide column blocks w, w + 8, ... of k (128 bytes of each weight row),
//   loaded as whole lines, 4 rows per instruction, and moved into the fragment layout by
//   shuffles (`gemvm_exchange`: the fragment layout's own loads stream at ~3.3 TB/s, whole
//   lines at ~4.2), U column blocks in flight, the first U requested before the PDL wait;
// - the MMA's k order is a permutation of the column block (lane (g, q)'s 16 columns 16q ..
//   16q + 15 feed MMA t with columns 16q + 4t .. 16q + 4t + 3), the same for both operands;
// - each warp accumulates its column blocks in order in f32 (the MMA's accumulator), the block
//   adds the 8 warps' sums in warp order in shared memory, and one thread per output applies
//   gemv.cu's epilogue, `gemv_finish` (element type or f32, accumulating, the glu product from
//   the rounded gate and up values). An output is the same sum in the same order whatever R is.
//
// The fused RMSNorm prologue (`norm`) is gemv.cu's: each block reduces its rows' sums of squares
// and normalises the input columns it reads, rounded to the element type (block 0 also stores
// them to `norm_out`). Requires k % 64 == 0 and 16-byte aligned rows, as gemv.cu's kernels.

// Column blocks in flight per warp (32 bytes per lane each): GEMVT_U without the norm, GEMVT_UN
// with it (its prologue's registers): at 64 registers (4 blocks per SM) `ptxas -v` reports no
// spills without the norm and 4-8 bytes with it at 2-8 rows (U = 4 spills more; the CUDA-core
// kernel keeps 128 bytes per lane in flight).
#ifndef GEMVT_U
#define GEMVT_U 3
#endif
#ifndef GEMVT_UN
#define GEMVT_UN 2
#endif
#ifndef GEMVT_MINB
#define GEMVT_MINB 4
#endif

template <typename T, int R, int FEATS, bool NORM, int U>
static __device__ __forceinline__ void gemvt_impl(const GemvParams& p) {
    static_assert(FEATS == 8 || FEATS == 4, "8 or 4 weight rows a block");
    constexpr int WARPS = GEMV_WARPS;
    constexpr int HALF = FEATS / 2;
    constexpr bool BF16 = GemvmIsBf16<T>::value;
    __shared__ float red[WARPS][R][8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int k = p.k, ncb = k >> 6;

    // The block's tile: matrix `mi`, first row `j0` (glu: gate / up pair index).
    int b = blockIdx.x, mi = 0;
    if (!p.glu)
        while (mi + 1 < p.nmats && b >= p.m[mi].blocks) {
            b -= p.m[mi].blocks;
            ++mi;
        }
    const int j0 = p.glu ? b * HALF : b * FEATS;
    // Load instruction rg reads MMA column 4 rg + lane / 8 (a weight row, or nothing past FEATS
    // and past n), 16 bytes at 16 (lane % 8) of each 128-byte column block.
    const unsigned char* wr[2];
#pragma unroll
    for (int rg = 0; rg < 2; ++rg) {
        const int n = 4 * rg + (lane >> 3);
        wr[rg] = nullptr;
        if (n < FEATS) {
            const GemvMat& m = p.glu ? p.m[n / HALF] : p.m[mi];
            const int j = p.glu ? j0 + n % HALF : j0 + n;
            if (j < m.n) wr[rg] = static_cast<const unsigned char*>(m.w) + (size_t)j * k * 2 + 16 * (lane & 7);
        }
    }
    uint4 wv[U][2];
    auto fetch = [&](int u, int cb) {
#pragma unroll
        for (int rg = 0; rg < 2; ++rg)
            wv[u][rg] = wr[rg] && cb < ncb ? load_stream(wr[rg] + (size_t)cb * 128) : make_uint4(0, 0, 0, 0);
    };
    // Weights are constant while a plan runs: the first column blocks are requested before the
    // wait for the previous launch, the inputs read after it.
#pragma unroll
    for (int u = 0; u < U; ++u) fetch(u, warp + u * WARPS);
    flashrt::pdl_wait();
    flashrt::pdl_trigger();

    const T* x = static_cast<const T*>(p.x);
    const int row0 = p.last_row ? flashrt::load_len(p.len) - 1 : 0;
    x += (size_t)row0 * p.ld_x;
    float inv[R];
    if (NORM) gemv_norm_inv<T, R>(p, x, inv);
    if (NORM && blockIdx.x == 0) gemv_norm_store<T, R>(p, x, inv);
    // The input row this lane feeds (MMA row g) and its norm scale.
    const bool feeds = g < R;
    float invg = 1.0f;
#pragma unroll
    for (int r = 0; r < R; ++r)
        if (g == r) invg = inv[r];
    const T* xg = x + (size_t)(feeds ? g : 0) * p.ld_x;

    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int cb0 = warp; cb0 < ncb; cb0 += U * WARPS) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int cb = cb0 + u * WARPS;
            if (cb >= ncb) break; // (uniform across the warp)
            // Lane (g, q): columns 16q .. 16q + 7 (s0) and 16q + 8 .. 16q + 15 (s1) of MMA
            // column g's weight row.
            uint4 s0, s1;
            gemvm_exchange(wv[u][0], wv[u][1], lane, s0, s1);
            fetch(u, cb + U * WARPS);
            uint4 xa = make_uint4(0, 0, 0, 0), xb = make_uint4(0, 0, 0, 0);
            if (feeds) {
                const int c = cb * 8 + 2 * q; // 8-element chunk index of column 64 cb + 16 q
                const uint4* xp = reinterpret_cast<const uint4*>(xg) + c;
                xa = __ldg(xp);
                xb = __ldg(xp + 1);
                if (NORM) {
                    float f[8];
                    flashrt::unpack16<T>(xa, f);
                    gemv_norm_chunk<T>(p, invg, c, f);
                    xa = flashrt::pack16<T>(f);
                    flashrt::unpack16<T>(xb, f);
                    gemv_norm_chunk<T>(p, invg, c + 1, f);
                    xb = flashrt::pack16<T>(f);
                }
            }
            const uint32_t w[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
            const uint32_t a[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                if constexpr (BF16)
                    gemvm_mma_bf16(d, a[2 * t], 0u, a[2 * t + 1], 0u, w[2 * t], w[2 * t + 1]);
                else
                    gemvm_mma(d, a[2 * t], 0u, a[2 * t + 1], 0u, w[2 * t], w[2 * t + 1]);
            }
        }
    }

    // d[0], d[1]: input row g, MMA columns 2q, 2q + 1 (d[2], d[3]: the zero rows 8..15).
    if (feeds) {
        red[warp][g][2 * q] = d[0];
        red[warp][g][2 * q + 1] = d[1];
    }
    __syncthreads();
    gemv_finish<T, R, 8, FEATS>(p, red, mi, j0, row0);
}

#define FLASHRT_GEMVT_ENTRY_T(NAME, R, FEATS, NORM, U)                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMVT_MINB) NAME##_bf16(const GemvParams p) { \
        gemvt_impl<__nv_bfloat16, R, FEATS, NORM, U>(p);                                                \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMVT_MINB) NAME##_f16(const GemvParams p) {  \
        gemvt_impl<__half, R, FEATS, NORM, U>(p);                                                       \
    }
// `gemv16t_r<R>` / `gemv16t_norm_r<R>`: 8 weight rows a block; `gemv16t_r<R>f4`: 4 (matrices
// with few rows, e.g. 5120: 1280 blocks instead of 640, about 2.4 waves of resident blocks).
#define FLASHRT_GEMVT_ENTRY(R)                                                                           \
    FLASHRT_GEMVT_ENTRY_T(gemv16t_r##R, R, 8, false, GEMVT_U)                                            \
    FLASHRT_GEMVT_ENTRY_T(gemv16t_norm_r##R, R, 8, true, GEMVT_UN)                                       \
    FLASHRT_GEMVT_ENTRY_T(gemv16t_r##R##f4, R, 4, false, GEMVT_U)

FLASHRT_GEMVT_ENTRY(1)
FLASHRT_GEMVT_ENTRY(2)
FLASHRT_GEMVT_ENTRY(3)
FLASHRT_GEMVT_ENTRY(4)
FLASHRT_GEMVT_ENTRY(5)
FLASHRT_GEMVT_ENTRY(6)
FLASHRT_GEMVT_ENTRY(7)
FLASHRT_GEMVT_ENTRY(8)
