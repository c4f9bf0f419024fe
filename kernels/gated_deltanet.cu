// flashrt kernels: Gated DeltaNet recurrence (plan op `GatedDeltaNet`), token by token.
//
// Per row r < io.len and value head h (key head kh = h / (Hv / Hk)), with S = state[h]
// ([dk, dv], f32) and q, k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q scaled by dk^-1/2:
//     beta = sigmoid(b[h]),  g = -exp(a_log[h]) * softplus(a[h] + dt_bias[h]),  e = exp(g)
//     S *= e;  d = (v - S^T k) * beta;  S += k d^T;  out[h] = S^T q
// Columns j of S evolve independently, so the kernel splits S by columns: grid =
// (ceil(dv / 32), Hv), 4 warps per block, 32 columns per block. A warp holds 8 columns x 4
// row-slices; lane (col = lane & 7, slice = lane >> 3) keeps S[i][j] for rows i = slice + 4m
// in registers (RPT = dk/4 values; instantiated for dk <= 64 / 128 / 256) for the whole
// chunk, so S is read and written once per launch, not once per token.
// Per token, S^T k and S^T q are both formed from the *old* S in one pass (2 partial dot
// products per thread, reduced over the 4 slices with 2 shuffles), using
//     S_new^T q = e S^T q + d (k . q),   d = (v - e S^T k) beta,
// then S is updated in registers. q and k (dk floats each) are staged in shared memory,
// double-buffered by token parity so one barrier per token suffices, and the next token's
// inputs are loaded into registers while the current one is computed.
//
// Memory traffic per launch: S (dk * dv * 4 bytes per head) read + written once; per token,
// q, k, v, a, b read once per block (q/k re-read by the dv/32 column blocks of a head, L2),
// out written once. The token loop is serial: this is the correct-first kernel; a chunked
// (WY / parallel-scan) prefill kernel is the fast path to add later.
#include "common.cuh"

struct GdnParams {
    const void* qkv; // [q | k | v] per row
    const void* a;
    const void* b;
    const float* a_log;   // [Hv]
    const float* dt_bias; // [Hv]
    float* state;         // [Hv, dk, dv]
    void* out;            // [Hv * dv] per row
    const int* len;
    int ld_qkv;
    int ld_a;
    int ld_b;
    int ld_out;
    int key_heads;
    int value_heads;
    int key_dim;
    int value_dim;
};

#define GDN_WARPS 4
#define GDN_COLS_PER_WARP 8
#define GDN_SLICES 4

template <typename T, int RPT> static __device__ __forceinline__ void gdn_impl(const GdnParams& p) {
    constexpr int DK_MAX = RPT * GDN_SLICES;
    __shared__ float sq[2][DK_MAX], sk[2][DK_MAX];
    const int h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = lane >> 3;
    const int j = blockIdx.x * (GDN_WARPS * GDN_COLS_PER_WARP) + warp * GDN_COLS_PER_WARP + (lane & 7);
    const int dk = p.key_dim, dv = p.value_dim;
    const bool col_ok = j < dv;
    const int len = flashrt::load_len(p.len);
    const int kh = h / (p.value_heads / p.key_heads);
    const T* qkv = static_cast<const T*>(p.qkv);
    const T* ap = static_cast<const T*>(p.a);
    const T* bp = static_cast<const T*>(p.b);
    const int q_col = kh * dk;
    const int k_col = p.key_heads * dk + kh * dk;
    const int v_col = 2 * p.key_heads * dk + h * dv + j;
    const float qscale = rsqrtf((float)dk);
    const float neg_a = -expf(p.a_log[h]);
    const float dt_bias = p.dt_bias[h];

    float S[RPT];
    float* st = p.state + (size_t)h * dk * dv;
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        const int i = slice + GDN_SLICES * m;
        S[m] = (col_ok && i < dk) ? st[(size_t)i * dv + j] : 0.0f;
    }

    // Staging of q, k: thread t < dk loads element t (and t + blockDim, ...) of each.
    constexpr int LOADS = (DK_MAX + GDN_WARPS * 32 - 1) / (GDN_WARPS * 32);
    float nq[LOADS], nk[LOADS], nv = 0.0f, na = 0.0f, nb = 0.0f;
    auto fetch = [&](int r) {
        const size_t rb = (size_t)r * p.ld_qkv;
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = threadIdx.x + u * GDN_WARPS * 32;
            nq[u] = i < dk ? flashrt::to_f32(qkv[rb + q_col + i]) : 0.0f;
            nk[u] = i < dk ? flashrt::to_f32(qkv[rb + k_col + i]) : 0.0f;
        }
        nv = col_ok ? flashrt::to_f32(qkv[rb + v_col]) : 0.0f;
        na = flashrt::to_f32(ap[(size_t)r * p.ld_a + h]);
        nb = flashrt::to_f32(bp[(size_t)r * p.ld_b + h]);
    };
    auto stage = [&](int buf) {
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int i = threadIdx.x + u * GDN_WARPS * 32;
            if (i < DK_MAX) {
                sq[buf][i] = nq[u];
                sk[buf][i] = nk[u];
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
        const float v = nv, av = na, bv = nb;
        __syncthreads(); // token r's q, k are staged in buffer `buf`
        if (r + 1 < len) fetch(r + 1);

        // Norms and k.q: every warp computes them redundantly (no extra barrier).
        float qq = 0.0f, kk = 0.0f, kq = 0.0f;
#pragma unroll
        for (int m = 0; m < (DK_MAX + 31) / 32; ++m) {
            const int i = lane + 32 * m;
            if (i < dk) {
                const float qi = sq[buf][i], ki = sk[buf][i];
                qq += qi * qi;
                kk += ki * ki;
                kq += ki * qi;
            }
        }
        qq = flashrt::warp_sum(qq);
        kk = flashrt::warp_sum(kk);
        kq = flashrt::warp_sum(kq);
        const float inv_q = 1.0f / sqrtf(qq + 1e-6f) * qscale;
        const float inv_k = 1.0f / sqrtf(kk + 1e-6f);

        // Old-state contractions S^T k and S^T q over this thread's rows, then over slices.
        float sk_acc = 0.0f, sq_acc = 0.0f;
#pragma unroll
        for (int m = 0; m < RPT; ++m) {
            const int i = slice + GDN_SLICES * m;
            if (i < dk) {
                sk_acc += S[m] * sk[buf][i];
                sq_acc += S[m] * sq[buf][i];
            }
        }
        sk_acc += __shfl_xor_sync(0xffffffffu, sk_acc, 8);
        sk_acc += __shfl_xor_sync(0xffffffffu, sk_acc, 16);
        sq_acc += __shfl_xor_sync(0xffffffffu, sq_acc, 8);
        sq_acc += __shfl_xor_sync(0xffffffffu, sq_acc, 16);

        const float beta = flashrt::sigmoidf_(bv);
        const float e = expf(neg_a * flashrt::softplusf_(av + dt_bias));
        const float d = (v - e * sk_acc * inv_k) * beta;
        const float o = e * sq_acc * inv_q + d * (kq * inv_k * inv_q);
        const float dk_scaled = d * inv_k; // S[i][j] += (k_i * inv_k) * d
#pragma unroll
        for (int m = 0; m < RPT; ++m) {
            const int i = slice + GDN_SLICES * m;
            if (i < dk) S[m] = e * S[m] + sk[buf][i] * dk_scaled;
        }
        if (col_ok && slice == 0) out[(size_t)r * p.ld_out + (size_t)h * dv + j] = flashrt::from_f32<T>(o);
        if (r + 1 < len) stage(buf ^ 1);
    }

#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        const int i = slice + GDN_SLICES * m;
        if (col_ok && i < dk) st[(size_t)i * dv + j] = S[m];
    }
}

#define FLASHRT_GDN_ENTRY(D, RPT)                                                                      \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gated_deltanet_k##D##_bf16(const GdnParams p) { \
        gdn_impl<__nv_bfloat16, RPT>(p);                                                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gated_deltanet_k##D##_f16(const GdnParams p) {  \
        gdn_impl<__half, RPT>(p);                                                                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDN_WARPS * 32) gated_deltanet_k##D##_f32(const GdnParams p) {  \
        gdn_impl<float, RPT>(p);                                                                       \
    }

FLASHRT_GDN_ENTRY(64, 16)
FLASHRT_GDN_ENTRY(128, 32)
FLASHRT_GDN_ENTRY(256, 64)
