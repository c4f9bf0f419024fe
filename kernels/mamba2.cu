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
// block (B/C shared by the blocks of a group through L2), y written once. Serial over tokens:
// a chunked SSD prefill kernel is the fast path to add later.
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
        flashrt::pdl_wait();                                                                  \
        flashrt::pdl_trigger();                                                               \
        mamba2_impl<__nv_bfloat16, NPT>(p);                                                        \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(M2_WARPS * 32) mamba2_scan_n##D##_f16(const Mamba2Params p) {  \
        flashrt::pdl_wait();                                                                  \
        flashrt::pdl_trigger();                                                               \
        mamba2_impl<__half, NPT>(p);                                                               \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(M2_WARPS * 32) mamba2_scan_n##D##_f32(const Mamba2Params p) {  \
        flashrt::pdl_wait();                                                                  \
        flashrt::pdl_trigger();                                                               \
        mamba2_impl<float, NPT>(p);                                                                \
    }

FLASHRT_M2_ENTRY(64, 8)
FLASHRT_M2_ENTRY(128, 16)
FLASHRT_M2_ENTRY(256, 32)
