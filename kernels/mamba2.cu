// flashrt kernels: Mamba2 selective scan (plan op `Mamba2Scan`), token by token.
//
// Per row r < io.len and head h (group g = h / (H / G)), with S = state[h] ([P, N], f32),
// x_h the head's P inputs and B_g, C_g the group's N-vectors:
//     dt' = softplus(dt[h] + dt_bias[h])  (clamped below at dt_min when set),  A = -exp(a_log[h])
//     S = exp(dt' A) S + dt' x_h B_g^T;   y_h = S C_g + D[h] x_h
// Rows p of S are independent. grid = (ceil(P / 16), H), 4 warps per block, 16 rows per
// block; a warp holds 4 rows x 8 state-slices, lane (slice = lane & 7, row = lane >> 3) keeps
// S[p][n] for n = slice + 8m in registers (NPT = N/8 values; instantiated for N <= 64 / 128
// / 256) for the whole chunk. Per token the 8 slices' partial y are summed with 3 shuffles.
// B and C are staged in shared memory, double-buffered by token parity (one barrier per
// token), and the next token's inputs are fetched into registers during the current one.
//
// Memory traffic per launch: S read and written once; per token x, B, C, dt read once per
// block (B/C shared by the blocks of a group through L2), y written once. Serial over tokens;
// `mamba2_chunk_n{64,128}` (below) is the chunked prefill kernel for 16-bit targets.
#include "common.cuh"

struct Mamba2Params {
    const void* xbc; // [x | B | C] per row
    const void* dt;
    const float* a_log;   // [H]
    const float* d;       // [H]
    const float* dt_bias; // [H]
    float* state;         // [H, P, N]
    void* out;            // [H * P] per row
    const int* len;
    int ld_xbc;
    int ld_dt;
    int ld_out;
    int heads;
    int head_dim;
    int groups;
    int state_size;
    int has_dt_min;
    float dt_min;
};

#define M2_WARPS 4
#define M2_ROWS_PER_WARP 4
#define M2_SLICES 8

template <typename T, int NPT> static __device__ __forceinline__ void mamba2_impl(const Mamba2Params& p) {
    constexpr int N_MAX = NPT * M2_SLICES;
    __shared__ float sB[2][N_MAX], sC[2][N_MAX];
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = lane & 7;
    const int P = p.head_dim, N = p.state_size;
    const int prow = blockIdx.x * (M2_WARPS * M2_ROWS_PER_WARP) + warp * M2_ROWS_PER_WARP + (lane >> 3);
    const bool row_ok = prow < P;
    const int len = flashrt::load_len(p.len);
    const int g = h / (p.heads / p.groups);
    const int inner = p.heads * P;
    const int b_col = inner + g * N;
    const int c_col = inner + p.groups * N + g * N;
    const T* xbc = static_cast<const T*>(p.xbc);
    const T* dtp = static_cast<const T*>(p.dt);
    const float A = -expf(p.a_log[h]);
    const float Dh = p.d[h];
    const float dt_bias = p.dt_bias[h];

    float S[NPT];
    float* st = p.state + (size_t)h * P * N;
#pragma unroll
    for (int m = 0; m < NPT; ++m) {
        const int n = slice + M2_SLICES * m;
        S[m] = (row_ok && n < N) ? st[(size_t)prow * N + n] : 0.0f;
    }

    constexpr int LOADS = (N_MAX + M2_WARPS * 32 - 1) / (M2_WARPS * 32);
    float nB[LOADS], nC[LOADS], nx = 0.0f, ndt = 0.0f;
    auto fetch = [&](int r) {
        const size_t rb = (size_t)r * p.ld_xbc;
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int n = threadIdx.x + u * M2_WARPS * 32;
            nB[u] = n < N ? flashrt::to_f32(xbc[rb + b_col + n]) : 0.0f;
            nC[u] = n < N ? flashrt::to_f32(xbc[rb + c_col + n]) : 0.0f;
        }
        nx = row_ok ? flashrt::to_f32(xbc[rb + (size_t)h * P + prow]) : 0.0f;
        ndt = flashrt::to_f32(dtp[(size_t)r * p.ld_dt + h]);
    };
    auto stage = [&](int buf) {
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int n = threadIdx.x + u * M2_WARPS * 32;
            if (n < N_MAX) {
                sB[buf][n] = nB[u];
                sC[buf][n] = nC[u];
            }
        }
    };

    if (len > 0) {
        fetch(0);
        stage(0);
    }
    T* out = static_cast<T*>(p.out);
    for (int r = 0; r < len; ++r) {
        const int buf = r & 1;
        const float x = nx, dtv = ndt;
        __syncthreads(); // token r's B, C are staged in buffer `buf`
        if (r + 1 < len) fetch(r + 1);

        float dts = flashrt::softplusf_(dtv + dt_bias);
        if (p.has_dt_min) dts = fmaxf(dts, p.dt_min);
        const float dA = expf(dts * A);
        const float dx = dts * x;
        float y = 0.0f;
#pragma unroll
        for (int m = 0; m < NPT; ++m) {
            const int n = slice + M2_SLICES * m;
            if (n < N) {
                S[m] = dA * S[m] + dx * sB[buf][n];
                y += S[m] * sC[buf][n];
            }
        }
        y += __shfl_xor_sync(0xffffffffu, y, 1);
        y += __shfl_xor_sync(0xffffffffu, y, 2);
        y += __shfl_xor_sync(0xffffffffu, y, 4);
        if (row_ok && slice == 0)
            out[(size_t)r * p.ld_out + (size_t)h * P + prow] = flashrt::from_f32<T>(y + Dh * x);
        if (r + 1 < len) stage(buf ^ 1);
    }

#pragma unroll
    for (int m = 0; m < NPT; ++m) {
        const int n = slice + M2_SLICES * m;
        if (row_ok && n < N) st[(size_t)prow * N + n] = S[m];
    }
}

#define FLASHRT_M2_ENTRY(D, NPT)                                                                   \
    extern "C" __global__ void __launch_bounds__(M2_WARPS * 32) mamba2_scan_n##D##_bf16(const Mamba2Params p) { \
        flashrt::pdl_enter();                                                                  \
        mamba2_impl<__nv_bfloat16, NPT>(p);                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(M2_WARPS * 32) mamba2_scan_n##D##_f16(const Mamba2Params p) {  \
        flashrt::pdl_enter();                                                                  \
        mamba2_impl<__half, NPT>(p);                                                               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(M2_WARPS * 32) mamba2_scan_n##D##_f32(const Mamba2Params p) {  \
        flashrt::pdl_enter();                                                                  \
        mamba2_impl<float, NPT>(p);                                                                \
    }

FLASHRT_M2_ENTRY(64, 8)
FLASHRT_M2_ENTRY(128, 16)
FLASHRT_M2_ENTRY(256, 32)

// ==== mamba2_chunk_n{64,128}: chunked (SSD) prefill, bf16/f16 targets ==========================
//
// Same semantics, parameters (`Mamba2Params`) and state as `mamba2_scan_n*`, computed by chunks
// of C = M2C_ROWS = 64 rows on tensor cores. f32 targets have no chunked variant: they keep the
// token-by-token kernel (the oracle mode).
//
// Math. Within a chunk (rows i, j < C; rows past len are zero padding: x = B = C = 0 and
// dt' = 0, so a padded row leaves S unchanged), with a_i = dt'_i A, Lam_i = a_0 + ... + a_i
// (Lam_i - Lam_j <= 0 for j <= i) and S0 the state at the chunk start, unrolling the recurrence
// gives S_i = exp(Lam_i) S0 + sum_{j<=i} exp(Lam_i - Lam_j) dt'_j x_j B_j^T, so with X = [C, P]
// (the head's inputs), B, C = [C, N] (the group's):
//     Y     = diag(exp Lam) (C S0^T) + M X + D X,   M_ij = exp(Lam_i - Lam_j) dt'_j (C_i . B_j) for
//                                                   j <= i, else 0
//     S_new = exp(Lam_last) S0 + (diag(w) X)^T B,   w_j = dt'_j exp(Lam_last - Lam_j)
// Every exponent is <= 0: exp(Lam_i - Lam_j) is formed from the difference, never as
// exp(Lam_i) exp(-Lam_j), so nothing overflows however fast the decay.
//
// Grid = (ceil(P / M2C_PT), H), M2C_PT = 32 head_dim columns per block; block = 4 warps (128
// threads). One block owns the state slice S[p0 .. p0 + 31][0 .. NK) of head h (p0 =
// 32 blockIdx.x, NK = 64 / 128 the instantiated bound, N <= NK zero-padded, columns p >= P
// zero) and loops over all chunks of the call: the slice stays in registers (f32, mma
// accumulator layout: warp w holds columns [w NK/4, (w + 1) NK/4) of all 32 rows) from the
// first chunk to the final write-back. C B^T is recomputed by the ceil(P / 32) blocks of a head
// and the H / G heads of a group (cheaper than sharing it across blocks).
//
// Shared memory (elements of the target type E unless noted; row strides padded by 8 elements
// so that every ldmatrix phase reads 8 distinct 16-byte bank groups; all offsets multiples of
// 16 bytes), see `M2cLayout`:
//     Xs [2][C][PT + 8]   x of the chunk (double-buffered: chunk ch + 1 is loaded during ch)
//     Bs [2][C][NK + 8]   B of the chunk's rows (double-buffered)
//     Cs [2][C][NK + 8]   C of the chunk's rows (double-buffered)
//     St [PT][NK + 8]     S0 rounded to E (B operand of C S0^T)
//     Ms [C][C + 8]       M rounded to E (lower 16 x 16 blocks only are written and read)
//     f32 [C] x 4         Lam_i log2(e), dt'_i, exp(Lam_i), w_i
// Loads: cp.async 16 bytes a piece (zero-filled past len, P, N) when xbc is 16-byte aligned and
// ld_xbc, P and N are multiples of 8 elements; otherwise element by element (same layout). dt is
// read by warp 0 (2 rows a lane) a chunk ahead, into registers.
//
// A chunk is 3 phases between block barriers:
//   A. warp 0: dt' (softplus, clamp), the prefix sum Lam (warp scan), exp(Lam), w -> smem;
//      all warps, on tensor cores over the state axis (k = NK): 5 of the 20 lower 16x8 tiles of
//      G = C B^T each (warp w: tiles 5w .. 5w + 4 in row-major order of the lower tiles, i.e. of
//      row tiles w and w + 1), and Y1 = C S0^T for row tile w (16 rows x 32 columns);
//   B. G tiles masked and scaled (exp2(Lam_i - Lam_j) dt'_j for j <= i, else 0) -> Ms;
//      Y1 rows scaled by exp(Lam_i);
//   C. Y += M X (row tile w: k-blocks 0 .. w), y = Y + D x stored for rows < len and columns
//      < P; then S <- exp(Lam_last) S + (diag(w) X)^T B (each warp its NK/4 columns) and the
//      rounded copy St refreshed for the next chunk.
// Operand rounding: mma.sync m16n8k16 with f32 accumulation on operands in the target type: x,
// B, C exactly as loaded; S0 (St), M and w_j x_j rounded to E (relative 2^-9 for bf16, 2^-12
// for f16 per operand; the state itself stays f32 in registers, so rounding does not compound
// across chunks). Elementwise work (softplus, the scan, exp) is f32 on CUDA cores.
//
// Work per block and chunk (mma.m16n8k16 = 2048 multiply-adds), NK = 128 (NK = 64 in
// brackets): C B^T 160 (80), C S0^T 128 (64), M X 40 (40), state update 128 (64): 456 (248) mma
// = 0.93 (0.51) M multiply-adds, 108 .. 120 (56 .. 68) per warp (M X: warp w does 4 (w + 1));
// plus 64 softplus and 128 exp (warp 0) and at most 2560 exp2 (the masks) on CUDA cores;
// 3 block barriers. Global memory per block and chunk: the x tile 64 x 32, B and C 64 x N and
// 64 dt values read (B, C re-read by the blocks of a group, from L2), y 64 x 32 written; the
// state slice is read and written once per launch.
//
// Launch contract (mirror on the host):
//   entry    mamba2_chunk_n64_{bf16,f16} for 1 <= state_size <= 64,
//            mamba2_chunk_n128_{bf16,f16} for state_size <= 128; any head_dim >= 1; groups
//            divides heads;
//   grid     (ceil(head_dim / M2C_PT), heads, 1), M2C_PT = 32;
//   block    M2C_THREADS = 128 threads;
//   shared   M2C_SMEM(NK) bytes of dynamic shared memory, NK = 64 or 128 (the variant, not
//            state_size): 2 (2 C (PT + 8) + 4 C (NK + 8) + PT (NK + 8) + C (C + 8)) + 16 C with
//            C = 64, PT = 32, i.e. 576 NK + 25088: 61952 bytes (n64), 98816 bytes (n128). Above
//            48 KiB, so the function's MAX_DYNAMIC_SHARED_SIZE_BYTES must be raised; 2 blocks
//            fit an SM (__launch_bounds__(128, 2));
//   rows     one launch processes all io.len rows of the call (chunk after chunk, serially in
//            each block; len is read from the device scalar, the grid does not depend on it).
//            Like mamba2_scan_* it continues from `state` and leaves the state after row
//            len - 1 there, so successive calls (later prefill chunks, decode steps with
//            mamba2_scan_*) chain; len <= 0: nothing is read or written;
//   PDL      the entries start with pdl_enter (wait, trigger), like mamba2_scan_*;
//   alignment none required (no vector loads/stores unless the runtime check above passes;
//            y is written element by element).
#define M2C_ROWS 64
#define M2C_PT 32
#define M2C_WARPS 4
#define M2C_THREADS (M2C_WARPS * 32)
#define M2C_SMEM(NK)                                                                               \
    (2 * (2 * M2C_ROWS * (M2C_PT + 8) + 4 * M2C_ROWS * ((NK) + 8) + M2C_PT * ((NK) + 8) +             \
          M2C_ROWS * (M2C_ROWS + 8)) +                                                              \
     16 * M2C_ROWS)

// Byte offsets of the shared-memory regions (16-bit elements, then f32 vectors).
template <int NK> struct M2cLayout {
    static constexpr int C = M2C_ROWS, PT = M2C_PT, PAD = 8;
    static constexpr int LDX = PT + PAD; // Xs row stride (elements)
    static constexpr int LDN = NK + PAD; // Bs, Cs, St row stride
    static constexpr int LDM = C + PAD;  // Ms row stride
    static constexpr int X = 0;
    static constexpr int B = X + 2 * C * LDX * 2;
    static constexpr int CC = B + 2 * C * LDN * 2;
    static constexpr int ST = CC + 2 * C * LDN * 2;
    static constexpr int M = ST + PT * LDN * 2;
    static constexpr int LAM = M + C * LDM * 2; // Lam_i log2(e)
    static constexpr int DT = LAM + 4 * C;      // dt'_i
    static constexpr int EL = DT + 4 * C;       // exp(Lam_i)
    static constexpr int WL = EL + 4 * C;       // w_i = dt'_i exp(Lam_last - Lam_i)
    static constexpr int BYTES = WL + 4 * C;
    static_assert(BYTES == M2C_SMEM(NK), "M2C_SMEM must match the layout");
    static_assert(B % 16 == 0 && CC % 16 == 0 && ST % 16 == 0 && M % 16 == 0 && LAM % 16 == 0, "16-byte regions");
};

namespace flashrt_m2c {

using flashrt::Mma;
using flashrt::smem_u32;

using flashrt::ldsm_x2;
using flashrt::ldsm_x4;
using flashrt::ldsm_x4_t;

// Lane offsets (elements) from a tile's top-left corner, row stride ld, for the m16n8k16
// fragments (A: a0 (m 0-7, k 0-7), a1 (m 8-15, k 0-7), a2 (m 0-7, k 8-15), a3 (m 8-15, k 8-15);
// B: b0 (k 0-7), b1 (k 8-15) of 8 columns):
// * off_a: rows lane & 15, column 8 (lane / 16). x4: the A fragment of a row-major [m][k]
//   tile; x4.trans: the B fragments (b0, b1, b0', b1') of two 8-column tiles of a k-major [k][n]
//   matrix.
// * off_b: rows (lane & 7) + 8 (lane / 16), column 8 ((lane / 8) & 1). x4: the B fragments of
//   two 8-column tiles of an n-major [n][k] matrix; x4.trans: the A fragment of a k-major [k][m]
//   matrix.
// * off_b2: rows lane & 7, column 8 ((lane / 8) & 1). x2: the B fragment of one 8-column tile
//   of an n-major matrix (every lane's address stays inside the tile).
static __device__ __forceinline__ int off_a(int lane, int ld) { return (lane & 15) * ld + 8 * (lane >> 4); }
static __device__ __forceinline__ int off_b(int lane, int ld) {
    return ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1);
}
static __device__ __forceinline__ int off_b2(int lane, int ld) { return (lane & 7) * ld + 8 * ((lane >> 3) & 1); }

static __device__ __forceinline__ float2 unpack2(uint32_t u, const __nv_bfloat16*) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
static __device__ __forceinline__ float2 unpack2(uint32_t u, const __half*) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
}
// A packed pair (low, high) scaled by (s0, s1), rounded back to T.
template <typename T> static __device__ __forceinline__ uint32_t scale2(uint32_t u, float s0, float s1) {
    const float2 v = unpack2(u, static_cast<const T*>(nullptr));
    return Mma<T>::pack(v.x * s0, v.y * s1);
}

} // namespace flashrt_m2c

// One block = head h x 32 head_dim columns, all rows of the call, chunk by chunk.
template <typename T, int NK> static __device__ __forceinline__ void m2c_impl(const Mamba2Params& p) {
    using namespace flashrt_m2c;
    using L = M2cLayout<NK>;
    constexpr int C = M2C_ROWS, PT = M2C_PT, THREADS = M2C_THREADS;
    constexpr int NW = NK / M2C_WARPS; // state columns per warp
    constexpr int NWT = NW / 8;        // their 8-column tiles
    constexpr int KN = NK / 16;        // k-steps over the state axis
    static_assert(sizeof(T) == 2, "16-bit targets only");
    static_assert(C == 64 && PT == 32 && M2C_WARPS == 4 && (NK == 64 || NK == 128), "work split assumes these");

    extern __shared__ __align__(16) unsigned char m2c_smem[];
    T* Xs = reinterpret_cast<T*>(m2c_smem + L::X);
    T* Bs = reinterpret_cast<T*>(m2c_smem + L::B);
    T* Cs = reinterpret_cast<T*>(m2c_smem + L::CC);
    T* St = reinterpret_cast<T*>(m2c_smem + L::ST);
    T* Ms = reinterpret_cast<T*>(m2c_smem + L::M);
    float* LAM = reinterpret_cast<float*>(m2c_smem + L::LAM);
    float* DT = reinterpret_cast<float*>(m2c_smem + L::DT);
    float* EL = reinterpret_cast<float*>(m2c_smem + L::EL);
    float* WL = reinterpret_cast<float*>(m2c_smem + L::WL);
    const uint32_t sbase = smem_u32(m2c_smem);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, p0 = blockIdx.x * PT;
    const int P = p.head_dim, N = p.state_size;
    const int len = flashrt::load_len(p.len);
    if (len <= 0) return;
    const int pw = P - p0; // columns c < pw of the tile are valid
    const int grp = h / (p.heads / p.groups);
    const T* xbc = static_cast<const T*>(p.xbc);
    const T* dtp = static_cast<const T*>(p.dt);
    T* out = static_cast<T*>(p.out);
    const size_t ld = (size_t)p.ld_xbc;
    const int x_col = h * P + p0; // also the column of y
    const int b_col = p.heads * P + grp * N;
    const int c_col = p.heads * P + p.groups * N + grp * N;
    const float A = -expf(p.a_log[h]);
    const float Dh = p.d[h];
    const float dt_bias = p.dt_bias[h];
    const T zero = flashrt::from_f32<T>(0.0f);

    // Chunk loads into buffer `buf`: 16-byte cp.async when every piece is either wholly inside
    // or wholly outside the row's P / N columns and 16-byte aligned; else element by element.
    const bool vec = reinterpret_cast<uintptr_t>(xbc) % 16 == 0 && p.ld_xbc % 8 == 0 && P % 8 == 0 && N % 8 == 0;
    auto load_chunk = [&](int r0, int buf) {
        const int n = min(C, len - r0);
        T* xs = Xs + buf * (C * L::LDX);
        T* bs = Bs + buf * (C * L::LDN);
        T* cs = Cs + buf * (C * L::LDN);
        if (vec) {
            constexpr int XP = PT / 8, NP = NK / 8;
            static_assert((C * XP) % THREADS == 0 && (C * NP) % THREADS == 0, "pieces divide among the threads");
#pragma unroll
            for (int u = 0; u < C * XP / THREADS; ++u) {
                const int e = tid + u * THREADS, i = e / XP, c = (e % XP) * 8;
                const bool ok = i < n && c < pw;
                flashrt::cp_async16(smem_u32(xs + i * L::LDX + c), ok ? xbc + (size_t)(r0 + i) * ld + x_col + c : xbc, ok);
            }
#pragma unroll
            for (int u = 0; u < C * NP / THREADS; ++u) {
                const int e = tid + u * THREADS, i = e / NP, c = (e % NP) * 8;
                const bool ok = i < n && c < N;
                const T* row = xbc + (size_t)(ok ? r0 + i : 0) * ld;
                flashrt::cp_async16(smem_u32(bs + i * L::LDN + c), ok ? row + b_col + c : xbc, ok);
                flashrt::cp_async16(smem_u32(cs + i * L::LDN + c), ok ? row + c_col + c : xbc, ok);
            }
            flashrt::cp_async_commit();
        } else {
#pragma unroll 4
            for (int e = tid; e < C * PT; e += THREADS) {
                const int i = e / PT, c = e % PT;
                xs[i * L::LDX + c] = (i < n && c < pw) ? xbc[(size_t)(r0 + i) * ld + x_col + c] : zero;
            }
#pragma unroll 4
            for (int e = tid; e < C * NK; e += THREADS) {
                const int i = e / NK, c = e % NK;
                const bool ok = i < n && c < N;
                const T* row = xbc + (size_t)(ok ? r0 + i : 0) * ld;
                bs[i * L::LDN + c] = ok ? row[b_col + c] : zero;
                cs[i * L::LDN + c] = ok ? row[c_col + c] : zero;
            }
        }
    };
    // dt of rows 2 lane, 2 lane + 1 of a chunk (warp 0), loaded one chunk ahead.
    float gdt[2] = {0.0f, 0.0f};
    auto load_dt = [&](int r0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i = r0 + 2 * lane + e;
            gdt[e] = i < len ? flashrt::to_f32(dtp[(size_t)i * p.ld_dt + h]) : 0.0f;
        }
    };

    // The state slice S[p0 + pr][n], pr < 32, n in this warp's NW columns, in registers as
    // accumulators (m = pr, n); St holds a copy rounded to T.
    const int nw0 = warp * NW;
    float* st = p.state + (size_t)h * P * N;
    float sacc[2][NWT][4];
    // f(value, state element index, in range) for every accumulator of the slice.
    auto each_state = [&](auto&& f) {
#pragma unroll
        for (int mp = 0; mp < 2; ++mp)
#pragma unroll
            for (int nt = 0; nt < NWT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int pr = p0 + 16 * mp + g + 8 * (r >> 1), n = nw0 + 8 * nt + 2 * t + (r & 1);
                    f(sacc[mp][nt][r], (size_t)pr * N + n, pr < P && n < N);
                }
    };
    each_state([&](float& v, size_t i, bool ok) { v = ok ? st[i] : 0.0f; });
    auto store_st = [&]() {
#pragma unroll
        for (int mp = 0; mp < 2; ++mp)
#pragma unroll
            for (int nt = 0; nt < NWT; ++nt) {
                T* d = St + (16 * mp + g) * L::LDN + nw0 + 8 * nt + 2 * t;
                *reinterpret_cast<uint32_t*>(d) = Mma<T>::pack(sacc[mp][nt][0], sacc[mp][nt][1]);
                *reinterpret_cast<uint32_t*>(d + 8 * L::LDN) = Mma<T>::pack(sacc[mp][nt][2], sacc[mp][nt][3]);
            }
    };

    // This warp's 5 tiles of G = C B^T: lower 16x8 tiles 5 warp .. 5 warp + 4, numbered row by
    // row ((0,0) (0,1) | (1,0)..(1,3) | (2,0)..(2,5) | (3,0)..(3,7)); tile 5 warp is in row tile
    // `warp`, the others in row tile warp or warp + 1.
    int tm[5], tn[5];
#pragma unroll
    for (int u = 0; u < 5; ++u) {
        const int k = 5 * warp + u;
        const int m = k >= 12 ? 3 : k >= 6 ? 2 : k >= 2 ? 1 : 0;
        tm[u] = m;
        tn[u] = k - m * (m + 1);
    }
    const int mb = min(warp + 1, 3);

    // ldmatrix lane offsets in bytes.
    const uint32_t oaN = 2 * off_a(lane, L::LDN), obN = 2 * off_b(lane, L::LDN), ob2N = 2 * off_b2(lane, L::LDN);
    const uint32_t oaX = 2 * off_a(lane, L::LDX), obX = 2 * off_b(lane, L::LDX);
    const uint32_t oaM = 2 * off_a(lane, L::LDM);

    store_st();
    load_chunk(0, 0);
    if (warp == 0) load_dt(0);

    const int nchunks = (len + C - 1) / C;
    for (int ch = 0; ch < nchunks; ++ch) {
        const int r0 = ch * C, buf = ch & 1;
        const int n = min(C, len - r0); // valid rows; rows n .. C - 1 are zero padding
        if (vec) flashrt::cp_async_wait<0>();
        __syncthreads(); // chunk ch (buffer buf) and St are in shared memory; chunk ch - 1 is done
        if (ch + 1 < nchunks) load_chunk(r0 + C, buf ^ 1);
        const uint32_t sx = sbase + L::X + buf * (C * L::LDX * 2);
        const uint32_t sb = sbase + L::B + buf * (C * L::LDN * 2);
        const uint32_t sc = sbase + L::CC + buf * (C * L::LDN * 2);
        const uint32_t sst = sbase + L::ST, sm = sbase + L::M;

        // ---- A. gates (warp 0), G tiles and Y1 = C S0^T (all warps)
        if (warp == 0) {
            float dts[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float d = flashrt::softplusf_(gdt[e] + dt_bias);
                if (p.has_dt_min) d = fmaxf(d, p.dt_min);
                dts[e] = 2 * lane + e < n ? d : 0.0f;
            }
            if (ch + 1 < nchunks) load_dt(r0 + C);
            float l0 = dts[0] * A, l1 = dts[1] * A;
            const float last = flashrt::warp_prefix_sum2(l0, l1);
            LAM[2 * lane] = l0 * 1.44269504f; // log2(e)
            LAM[2 * lane + 1] = l1 * 1.44269504f;
            DT[2 * lane] = dts[0];
            DT[2 * lane + 1] = dts[1];
            EL[2 * lane] = expf(l0);
            EL[2 * lane + 1] = expf(l1);
            WL[2 * lane] = dts[0] * expf(last - l0);
            WL[2 * lane + 1] = dts[1] * expf(last - l1);
        }
        float gacc[5][4], yacc[4][4];
#pragma unroll
        for (int u = 0; u < 5; ++u)
#pragma unroll
            for (int r = 0; r < 4; ++r) gacc[u][r] = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int r = 0; r < 4; ++r) yacc[q][r] = 0.0f;
#pragma unroll 2
        for (int ks = 0; ks < KN; ++ks) {
            uint32_t fa[4], fb[4];
            ldsm_x4(fa, sc + (16 * warp * L::LDN + 16 * ks) * 2 + oaN);
            ldsm_x4(fb, sc + (16 * mb * L::LDN + 16 * ks) * 2 + oaN);
#pragma unroll
            for (int u = 0; u < 5; ++u) {
                uint32_t b[2], a[4];
                ldsm_x2(b, sb + (8 * tn[u] * L::LDN + 16 * ks) * 2 + ob2N);
#pragma unroll
                for (int q = 0; q < 4; ++q) a[q] = tm[u] == warp ? fa[q] : fb[q];
                Mma<T>::run(gacc[u], a, b[0], b[1]);
            }
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                uint32_t b[4];
                ldsm_x4(b, sst + (16 * q * L::LDN + 16 * ks) * 2 + obN);
                Mma<T>::run(yacc[2 * q], fa, b[0], b[1]);
                Mma<T>::run(yacc[2 * q + 1], fa, b[2], b[3]);
            }
        }
        __syncthreads(); // gates in shared memory

        // ---- B. Ms = mask(G), Y1 scaled by exp(Lam_i)
#pragma unroll
        for (int u = 0; u < 5; ++u) {
            float v[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = 16 * tm[u] + g + 8 * (r >> 1), j = 8 * tn[u] + 2 * t + (r & 1);
                v[r] = j <= i ? exp2f(LAM[i] - LAM[j]) * DT[j] * gacc[u][r] : 0.0f;
            }
            T* d = Ms + (16 * tm[u] + g) * L::LDM + 8 * tn[u] + 2 * t;
            *reinterpret_cast<uint32_t*>(d) = Mma<T>::pack(v[0], v[1]);
            *reinterpret_cast<uint32_t*>(d + 8 * L::LDM) = Mma<T>::pack(v[2], v[3]);
        }
        {
            const float e0 = EL[16 * warp + g], e1 = EL[16 * warp + g + 8];
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                yacc[q][0] *= e0;
                yacc[q][1] *= e0;
                yacc[q][2] *= e1;
                yacc[q][3] *= e1;
            }
        }
        __syncthreads(); // Ms complete

        // ---- C. Y += M X, outputs; state update
        for (int kk = 0; kk <= warp; ++kk) {
            uint32_t a[4];
            ldsm_x4(a, sm + (16 * warp * L::LDM + 16 * kk) * 2 + oaM);
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                uint32_t b[4];
                ldsm_x4_t(b, sx + (16 * kk * L::LDX + 16 * q) * 2 + oaX);
                Mma<T>::run(yacc[2 * q], a, b[0], b[1]);
                Mma<T>::run(yacc[2 * q + 1], a, b[2], b[3]);
            }
        }
        {
            const T* xs = Xs + buf * (C * L::LDX);
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = 16 * warp + g + 8 * (r >> 1), c = 8 * q + 2 * t + (r & 1);
                    if (i < n && c < pw)
                        out[(size_t)(r0 + i) * p.ld_out + x_col + c] =
                            flashrt::from_f32<T>(yacc[q][r] + Dh * flashrt::to_f32(xs[i * L::LDX + c]));
                }
        }
        {
            const float el = EL[C - 1]; // exp(Lam_last): padded rows add nothing to Lam
#pragma unroll
            for (int mp = 0; mp < 2; ++mp)
#pragma unroll
                for (int nt = 0; nt < NWT; ++nt)
#pragma unroll
                    for (int r = 0; r < 4; ++r) sacc[mp][nt][r] *= el;
#pragma unroll
            for (int s = 0; s < C / 16; ++s) {
                const int j = 16 * s + 2 * t;
                const float w0 = WL[j], w1 = WL[j + 1], w2 = WL[j + 8], w3 = WL[j + 9];
                uint32_t xa[2][4]; // A = (diag(w) X)^T: (m = p, k = j), from Xs [j][p] by .trans
#pragma unroll
                for (int mp = 0; mp < 2; ++mp) {
                    ldsm_x4_t(xa[mp], sx + (16 * s * L::LDX + 16 * mp) * 2 + obX);
                    xa[mp][0] = scale2<T>(xa[mp][0], w0, w1);
                    xa[mp][1] = scale2<T>(xa[mp][1], w0, w1);
                    xa[mp][2] = scale2<T>(xa[mp][2], w2, w3);
                    xa[mp][3] = scale2<T>(xa[mp][3], w2, w3);
                }
#pragma unroll
                for (int q = 0; q < NWT / 2; ++q) {
                    uint32_t b[4]; // B: (k = j, n), from Bs [j][n] by .trans, two 8-column tiles
                    ldsm_x4_t(b, sb + (16 * s * L::LDN + nw0 + 16 * q) * 2 + oaN);
#pragma unroll
                    for (int mp = 0; mp < 2; ++mp) {
                        Mma<T>::run(sacc[mp][2 * q], xa[mp], b[0], b[1]);
                        Mma<T>::run(sacc[mp][2 * q + 1], xa[mp], b[2], b[3]);
                    }
                }
            }
            store_st(); // St is not read again this chunk (phase A is behind two barriers)
        }
    }

    each_state([&](float& v, size_t i, bool ok) {
        if (ok) st[i] = v;
    });
}

#define FLASHRT_M2C_ENTRY(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(M2C_THREADS, 2) mamba2_chunk_n##D##_bf16(const Mamba2Params p) { \
        flashrt::pdl_enter();                                                                          \
        m2c_impl<__nv_bfloat16, D>(p);                                                                \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(M2C_THREADS, 2) mamba2_chunk_n##D##_f16(const Mamba2Params p) {  \
        flashrt::pdl_enter();                                                                          \
        m2c_impl<__half, D>(p);                                                                       \
    }

FLASHRT_M2C_ENTRY(64)
FLASHRT_M2C_ENTRY(128)
