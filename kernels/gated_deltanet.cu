// flashrt kernels: Gated DeltaNet recurrence (plan op `GatedDeltaNet`): a token-by-token kernel
// (decode, verify, small prefill buckets) and a chunked one (prefill buckets of >= 64 rows).
//
// Per row r < io.len and value head h (key head kh = h / (Hv / Hk)), with S = state[h]
// ([dk, dv], f32) and q, k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q scaled by dk^-1/2:
//     beta = sigmoid(b[h]),  g = -exp(a_log[h]) * softplus(a[h] + dt_bias[h]),  e = exp(g)
//     S *= e;  d = (v - S^T k) * beta;  S += k d^T;  out[h] = S^T q
// Both kernels continue from the state left by earlier calls and leave theirs in `state`.
//
// ---- gated_deltanet_k{64,128,256}: token by token ----
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
// Memory traffic per launch: S (dk * dv * 4 bytes per head) read + written once; per token,
// q, k, v, a, b read once per block (q/k re-read by the dv/32 column blocks of a head, L2),
// out written once. 6 dk dv FLOPs per token and head on CUDA cores, but the token loop is
// serial (about 4.2 ms per layer for 2048 rows of the 27B shape on an H200).
//
// ---- gated_deltanet_chunk_k{64,128}: chunks of C = 64 rows (WY form) ----
// Within a chunk (rows i, j < C; rows past len are padding with k = q = v = 0, g = 0,
// beta = 0, which leaves S unchanged), with gc_i = g_0 + ... + g_i and
// Gamma_ij = exp(gc_i - gc_j) (only for i >= j, where it is <= 1), unrolling the recurrence
// from the chunk's initial state S0 gives
//     S_i = exp(gc_i) S0 + sum_{j<=i} Gamma_ij k_j d_j^T
//     d_i + beta_i sum_{j<i} Gamma_ij (k_i . k_j) d_j = beta_i (v_i - exp(gc_i) S0^T k_i)
// so with A = strictly-lower(beta_i (k_i . k_j) Gamma_ij) and X = diag(beta) (V - diag(exp(gc)) K S0):
//     V' = (I + A)^-1 X                                  (the rows d_i)
//     O  = diag(exp(gc)) Q S0 + (lower-incl((Q K^T) * Gamma)) V'
//     S  = exp(gc_last) S0 + (diag(exp(gc_last - gc)) K)^T V'
// Grid = (ceil(dv / 64), Hv): one block per value head and 64 value columns, 256 threads
// (8 warps), looping over the chunks of the call; the state slice [dk, 64] stays in registers
// (accumulator layout) for the whole call. A chunk is 5 phases between block barriers:
//   1. load q, k (normalised, f32) [C, dk] and v [C, 64] into shared memory; warp 0 computes
//      beta, the prefix sum gc and exp(gc), exp(gc_last - gc);
//   2. A and P = lower-incl((Q K^T) * Gamma): the 20 lower 16x8 tiles of K K^T and Q K^T;
//   3. warps 0-3 invert the four 16x16 diagonal blocks of I + A (forward substitution,
//      lane = column); all warps: K S0 and Q S0 -> X (in place of v) and the first term of O;
//   4. V' = (I + A)^-1 X by blocks of 16 rows: y = x_b - sum_{c<b} A_bc v'_c, v'_b = T_bb y,
//      warp w on columns 8w..8w+7 only (columns are independent: no block barrier);
//   5. O += P V', stored for rows < len; S <- exp(gc_last) S + (K exp(gc_last - gc))^T V'.
// The chunk-only work (K K^T, Q K^T, T_bb) is recomputed by the dv/64 column blocks of a head
// and needs no scratch memory. All products run on tensor cores (mma.sync m16n8k8 TF32, f32
// accumulate; fragment layout at the helpers below): bf16/f16 targets round operands to
// TF32 (10-bit mantissa, far below the bf16 rounding of the outputs), f32 targets use
// 3xTF32 (hi/lo split, about 2^-22 relative per product) so they match the recurrence to f32
// rounding. Elementwise work (norms, gates, exp, the 16x16 inverses) is f32 on CUDA cores.
// Shared memory (f32, see GdncLayout): q, k [C][dk+8] each, S [dk][68], x and v' [C][68],
// A, P, T [C][72], 4 x C per-row values: 191 KiB for dk <= 128, 142 KiB for dk <= 64
// (opt-in above 48 KiB; one block per SM). 168-209 registers, no spills.
// Per block and chunk (dk = 128): 2.6 M multiply-adds (K K^T and Q K^T 0.66 M, K S0 and
// Q S0 1.05 M, (I+A)^-1 X 0.16 M, P V' 0.16 M, state 0.52 M), x3 for f32 targets.
// 27B shape (Hk 16, Hv 48, dk = dv = 128), 2048 rows: 96 blocks x 32 chunks, 15.7 GFLOP of
// TF32 (9.7 of them the state products, 4.0 the Gram tiles, half of those recomputed by the
// second column block of each head). Global memory: q, k, v, a, b read once (42 MB bf16; q, k
// re-read by the 6 blocks of a key head, from L2), out written once (25 MB), the state read
// and written once (6.3 MB); shared memory about 0.9 MB read per block and chunk, the bound.
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

// ---- chunked prefill kernel ----------------------------------------------------------------

#define GDNC_ROWS 64  // chunk rows C
#define GDNC_COLS 64  // value columns per block
#define GDNC_WARPS 8
#define GDNC_THREADS (GDNC_WARPS * 32)

// Shared memory of one block, in floats. Row strides are chosen so that every fragment load
// is free of bank conflicts except the transposed K read of the state update (2-way):
// LDK, LDC = 8 mod 32 (row-major float2 loads), LDV = 4 mod 32 (k-major float loads).
// Mirrored by `gdn_chunk_smem_bytes` in flashrt-runtime/src/backend/cuda/ops.rs.
template <int DK> struct GdncLayout {
    static constexpr int C = GDNC_ROWS, N = GDNC_COLS;
    static constexpr int LDK = DK + 8; // Ks, Qs: [C][LDK]   normalised k, q of the chunk
    static constexpr int LDV = N + 4;  // Ss: [DK][LDV] state; Xs, Vs: [C][LDV] x, then v'
    static constexpr int LDC = C + 8;  // As, Ps, Ts: [C][LDC]
    static constexpr int K = 0;
    static constexpr int Q = K + C * LDK;
    static constexpr int S = Q + C * LDK;
    static constexpr int X = S + DK * LDV;
    static constexpr int V = X + C * LDV;
    static constexpr int A = V + C * LDV;
    static constexpr int P = A + C * LDC;
    static constexpr int T = P + C * LDC;
    static constexpr int GC = T + C * LDC; // cumulative log decay gc[i]
    static constexpr int BETA = GC + C;
    static constexpr int EG = BETA + C; // exp(gc[i])
    static constexpr int WL = EG + C;   // exp(gc[C-1] - gc[i])
    static constexpr int FLOATS = WL + C;
};

// ---- TF32 tensor-core helpers (mma.sync m16n8k8, f32 accumulate) ----
// Fragments of lane (g = lane / 4, t = lane % 4), PTX ISA layout: A (16x8, row):
// a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4); B (8x8, col): b0 (t, g), b1 (t+4, g);
// C (16x8): c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1).
// The k index of every product is permuted the same way in A and B (fragment k = t is
// element k0 + 2t, k = t + 4 is k0 + 2t + 1), which leaves the dot products unchanged and
// lets row-major operands load as one float2.
// SPLIT (f32 targets): 3xTF32, x = hi + lo with both tf32, a*b ~ al*bh + ah*bl + ah*bh
// (dropping al*bl: about 2^-22 relative, so f32-grade results). Otherwise one TF32 product
// (10-bit mantissa, round to nearest), far below the bf16/f16 rounding of the outputs.
struct GdncFragA {
    uint32_t h[4], l[4];
};
struct GdncFragB {
    uint32_t h[2], l[2];
};

static __device__ __forceinline__ uint32_t gdnc_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ void gdnc_mma1(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// ---- end of TF32 tensor-core helpers ----

template <bool SPLIT> static __device__ __forceinline__ void gdnc_split(float x, uint32_t& h, uint32_t& l) {
    h = gdnc_tf32(x);
    l = SPLIT ? gdnc_tf32(x - __uint_as_float(h)) : 0u;
}

template <bool SPLIT>
static __device__ __forceinline__ GdncFragA gdnc_frag_a(float a0, float a1, float a2, float a3) {
    GdncFragA f;
    gdnc_split<SPLIT>(a0, f.h[0], f.l[0]);
    gdnc_split<SPLIT>(a1, f.h[1], f.l[1]);
    gdnc_split<SPLIT>(a2, f.h[2], f.l[2]);
    gdnc_split<SPLIT>(a3, f.h[3], f.l[3]);
    return f;
}

template <bool SPLIT> static __device__ __forceinline__ GdncFragB gdnc_frag_b(float b0, float b1) {
    GdncFragB f;
    gdnc_split<SPLIT>(b0, f.h[0], f.l[0]);
    gdnc_split<SPLIT>(b1, f.h[1], f.l[1]);
    return f;
}

template <bool SPLIT>
static __device__ __forceinline__ void gdnc_mma(float (&c)[4], const GdncFragA& a, const GdncFragB& b) {
    if (SPLIT) {
        gdnc_mma1(c, a.l, b.h);
        gdnc_mma1(c, a.h, b.l);
    }
    gdnc_mma1(c, a.h, b.h);
}

// A tile (rows m0..m0+15, k0..k0+7) of a row-major matrix: element (m, k) at M[m * ld + k].
template <bool SPLIT>
static __device__ __forceinline__ GdncFragA gdnc_a_rows(const float* M, int ld, int m0, int k0, int g, int t, float s = 1.0f) {
    const float2 x = *reinterpret_cast<const float2*>(M + (m0 + g) * ld + k0 + 2 * t);
    const float2 y = *reinterpret_cast<const float2*>(M + (m0 + g + 8) * ld + k0 + 2 * t);
    return gdnc_frag_a<SPLIT>(s * x.x, s * y.x, s * x.y, s * y.y);
}

// A tile of a k-major matrix: element (m, k) at M[k * ld + m], column k scaled by w[k].
template <bool SPLIT>
static __device__ __forceinline__ GdncFragA gdnc_a_cols(const float* M, int ld, int m0, int k0, int g, int t, const float* w) {
    const float* r0 = M + (k0 + 2 * t) * ld + m0 + g;
    const float* r1 = r0 + ld;
    const float w0 = w[k0 + 2 * t], w1 = w[k0 + 2 * t + 1];
    return gdnc_frag_a<SPLIT>(w0 * r0[0], w0 * r0[8], w1 * r1[0], w1 * r1[8]);
}

// B tile (k0..k0+7, columns n0..n0+7) of an n-major matrix: element (k, n) at M[n * ld + k].
template <bool SPLIT>
static __device__ __forceinline__ GdncFragB gdnc_b_nmajor(const float* M, int ld, int k0, int n0, int g, int t) {
    const float2 x = *reinterpret_cast<const float2*>(M + (n0 + g) * ld + k0 + 2 * t);
    return gdnc_frag_b<SPLIT>(x.x, x.y);
}

// B tile of a k-major matrix: element (k, n) at M[k * ld + n].
template <bool SPLIT>
static __device__ __forceinline__ GdncFragB gdnc_b_kmajor(const float* M, int ld, int k0, int n0, int g, int t) {
    const float* r0 = M + (k0 + 2 * t) * ld + n0 + g;
    return gdnc_frag_b<SPLIT>(r0[0], r0[ld]);
}

// Accumulator element r of lane (g, t): row g + 8 (r / 2), column 2t + r % 2 of its tile.
static __device__ __forceinline__ int gdnc_row(int g, int r) { return g + 8 * (r >> 1); }
static __device__ __forceinline__ int gdnc_col(int t, int r) { return 2 * t + (r & 1); }

// One block = one value head h x GDNC_COLS value columns, all rows of the call, chunk by chunk.
template <typename T, int DK, bool SPLIT> static __device__ __forceinline__ void gdnc_impl(const GdnParams& p) {
    using L = GdncLayout<DK>;
    constexpr int C = GDNC_ROWS, N = GDNC_COLS;
    static_assert(C == 64 && N == 64 && GDNC_WARPS == 8, "tile assignment assumes 64 x 64 and 8 warps");
    // State tiles (16 rows of S x 8 columns) per warp: warp w owns rows 16 ms .. and NS tiles.
    constexpr int MT_S = DK / 16;
    constexpr int WPM = GDNC_WARPS / MT_S;
    constexpr int NS = (N / 8) / WPM;
    static_assert(MT_S * WPM == GDNC_WARPS && NS * WPM == N / 8, "DK must be 64 or 128");
    constexpr int KPL = DK / 32; // q/k elements per lane per row

    extern __shared__ __align__(16) float gdnc_smem[];
    float* Ks = gdnc_smem + L::K;
    float* Qs = gdnc_smem + L::Q;
    float* Ss = gdnc_smem + L::S;
    float* Xs = gdnc_smem + L::X;
    float* Vs = gdnc_smem + L::V;
    float* As = gdnc_smem + L::A;
    float* Ps = gdnc_smem + L::P;
    float* Ts = gdnc_smem + L::T;
    float* GC = gdnc_smem + L::GC;
    float* BETA = gdnc_smem + L::BETA;
    float* EG = gdnc_smem + L::EG;
    float* WL = gdnc_smem + L::WL;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, j0 = blockIdx.x * N;
    const int dk = p.key_dim, dv = p.value_dim;
    const int len = flashrt::load_len(p.len);
    if (len <= 0) return;
    const int kh = h / (p.value_heads / p.key_heads);
    const T* qkv = static_cast<const T*>(p.qkv);
    const T* ap = static_cast<const T*>(p.a);
    const T* bp = static_cast<const T*>(p.b);
    T* out = static_cast<T*>(p.out);
    const int q_col = kh * dk;
    const int k_col = p.key_heads * dk + kh * dk;
    const int v_col = 2 * p.key_heads * dk + h * dv + j0;
    const float qscale = rsqrtf((float)dk);
    const float neg_a = -expf(p.a_log[h]);
    const float dt_bias = p.dt_bias[h];

    // The state slice S[:, j0 .. j0 + N) lives in registers (accumulator layout) for the whole
    // call; Ss holds a copy for the chunk's S products.
    const int ms = warp / WPM, nsb = (warp % WPM) * NS;
    float* st = p.state + (size_t)h * dk * dv;
    float sacc[NS][4];
#pragma unroll
    for (int u = 0; u < NS; ++u)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int d = 16 * ms + gdnc_row(g, r), j = j0 + 8 * (nsb + u) + gdnc_col(t, r);
            sacc[u][r] = (d < dk && j < dv) ? st[(size_t)d * dv + j] : 0.0f;
        }
    auto store_ss = [&]() {
#pragma unroll
        for (int u = 0; u < NS; ++u) {
            float* s = Ss + (16 * ms + g) * L::LDV + 8 * (nsb + u) + 2 * t;
            *reinterpret_cast<float2*>(s) = make_float2(sacc[u][0], sacc[u][1]);
            *reinterpret_cast<float2*>(s + 8 * L::LDV) = make_float2(sacc[u][2], sacc[u][3]);
        }
    };
    store_ss();

    // Output / x / v' tiles: warp w owns rows 16 om .. of the chunk and column tiles onb ..+3.
    const int om = warp & 3, onb = (warp >> 2) * 4;
    const int nchunks = (len + C - 1) / C;
    for (int ch = 0; ch < nchunks; ++ch) {
        const int r0 = ch * C;
        const int n = min(C, len - r0); // valid rows; rows n .. C-1 are zero padding

        // ---- 1. load: q, k (normalised), v, gates. Warp w: rows 8w .. 8w+7 of q and k.
        {
            float qv[8][KPL], kv[8][KPL];
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) {
                const int i = warp * 8 + rr;
                const T* row = qkv + (size_t)(r0 + i) * p.ld_qkv;
#pragma unroll
                for (int u = 0; u < KPL; ++u) {
                    const int d = lane + 32 * u;
                    const bool ok = i < n && d < dk;
                    qv[rr][u] = ok ? flashrt::to_f32(row[q_col + d]) : 0.0f;
                    kv[rr][u] = ok ? flashrt::to_f32(row[k_col + d]) : 0.0f;
                }
            }
            constexpr int VPT = C * N / GDNC_THREADS;
            float vv[VPT];
#pragma unroll
            for (int u = 0; u < VPT; ++u) {
                const int e = tid + u * GDNC_THREADS, i = e / N, j = e % N;
                vv[u] = (i < n && j0 + j < dv) ? flashrt::to_f32(qkv[(size_t)(r0 + i) * p.ld_qkv + v_col + j]) : 0.0f;
            }
            if (warp == 0) {
                // Gates of rows 2 lane, 2 lane + 1, then the inclusive prefix sum of g.
                float gv[2], bt[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int i = 2 * lane + e;
                    const bool ok = i < n;
                    const float av = ok ? flashrt::to_f32(ap[(size_t)(r0 + i) * p.ld_a + h]) : 0.0f;
                    const float bv = ok ? flashrt::to_f32(bp[(size_t)(r0 + i) * p.ld_b + h]) : 0.0f;
                    gv[e] = ok ? neg_a * flashrt::softplusf_(av + dt_bias) : 0.0f;
                    bt[e] = ok ? flashrt::sigmoidf_(bv) : 0.0f;
                }
                float incl = gv[0] + gv[1];
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const float y = __shfl_up_sync(0xffffffffu, incl, o);
                    if (lane >= o) incl += y;
                }
                float excl = __shfl_up_sync(0xffffffffu, incl, 1);
                if (lane == 0) excl = 0.0f;
                const float gc0 = excl + gv[0], gc1 = gc0 + gv[1];
                const float last = __shfl_sync(0xffffffffu, gc1, 31);
                GC[2 * lane] = gc0;
                GC[2 * lane + 1] = gc1;
                BETA[2 * lane] = bt[0];
                BETA[2 * lane + 1] = bt[1];
                EG[2 * lane] = expf(gc0);
                EG[2 * lane + 1] = expf(gc1);
                WL[2 * lane] = expf(last - gc0);
                WL[2 * lane + 1] = expf(last - gc1);
            }
#pragma unroll
            for (int rr = 0; rr < 8; ++rr) {
                const int i = warp * 8 + rr;
                float qq = 0.0f, kk = 0.0f;
#pragma unroll
                for (int u = 0; u < KPL; ++u) {
                    qq += qv[rr][u] * qv[rr][u];
                    kk += kv[rr][u] * kv[rr][u];
                }
                qq = flashrt::warp_sum(qq);
                kk = flashrt::warp_sum(kk);
                const float inv_q = 1.0f / sqrtf(qq + 1e-6f) * qscale;
                const float inv_k = 1.0f / sqrtf(kk + 1e-6f);
#pragma unroll
                for (int u = 0; u < KPL; ++u) {
                    Qs[i * L::LDK + lane + 32 * u] = qv[rr][u] * inv_q;
                    Ks[i * L::LDK + lane + 32 * u] = kv[rr][u] * inv_k;
                }
            }
#pragma unroll
            for (int u = 0; u < VPT; ++u) {
                const int e = tid + u * GDNC_THREADS;
                Xs[(e / N) * L::LDV + e % N] = vv[u];
            }
        }
        __syncthreads();

        // ---- 2. Gram matrices, lower tiles only (row tile gm, column tiles gnb .. gnb+gnc-1):
        // As = strictly-lower(beta_i (k_i . k_j) Gamma_ij), Ps = lower-incl((q_i . k_j) Gamma_ij),
        // Gamma_ij = exp(gc_i - gc_j) (never evaluated above the diagonal: it may overflow).
        {
            // (gm, gnb, gnc) per warp: (3,0,3) (3,3,3) (2,0,3) (2,3,3) (1,0,2) (1,2,2) (0,0,2) (3,6,2)
            const int gm = (0xC5AF >> (2 * warp)) & 3;
            const int gnb = (0xC10618 >> (3 * warp)) & 7;
            const int gnc = warp < 4 ? 3 : 2;
            float gacc[3][4], pacc[3][4];
#pragma unroll
            for (int u = 0; u < 3; ++u)
#pragma unroll
                for (int r = 0; r < 4; ++r) gacc[u][r] = pacc[u][r] = 0.0f;
#pragma unroll 4
            for (int k0 = 0; k0 < DK; k0 += 8) {
                const GdncFragA ak = gdnc_a_rows<SPLIT>(Ks, L::LDK, 16 * gm, k0, g, t);
                const GdncFragA aq = gdnc_a_rows<SPLIT>(Qs, L::LDK, 16 * gm, k0, g, t);
#pragma unroll
                for (int u = 0; u < 3; ++u) {
                    if (u < gnc) {
                        const GdncFragB b = gdnc_b_nmajor<SPLIT>(Ks, L::LDK, k0, 8 * (gnb + u), g, t);
                        gdnc_mma<SPLIT>(gacc[u], ak, b);
                        gdnc_mma<SPLIT>(pacc[u], aq, b);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < 3; ++u) {
                if (u < gnc) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = 16 * gm + gdnc_row(g, r), j = 8 * (gnb + u) + gdnc_col(t, r);
                        const float gam = i >= j ? expf(GC[i] - GC[j]) : 0.0f;
                        As[i * L::LDC + j] = i > j ? BETA[i] * gacc[u][r] * gam : 0.0f;
                        Ps[i * L::LDC + j] = pacc[u][r] * gam;
                    }
                }
            }
        }
        __syncthreads();

        // ---- 3. Warps 0-3: Ts diagonal block b = (I + A_bb)^-1 by forward substitution, lane
        // l < 16 solving column l. Then all warps: KS and QS with the chunk's initial state;
        // Xs <- x = beta (v - exp(gc) K S), oacc <- exp(gc) Q S.
        if (warp < 4) {
            const int b = warp, l = lane & 15;
            const float* ab = As + 16 * b * L::LDC + 16 * b;
            float tc[16];
#pragma unroll
            for (int li = 0; li < 16; ++li) {
                float s = li == l ? 1.0f : 0.0f;
#pragma unroll
                for (int m = 0; m < li; ++m) s -= ab[li * L::LDC + m] * tc[m];
                tc[li] = li < l ? 0.0f : s;
            }
            if (lane < 16) {
#pragma unroll
                for (int li = 0; li < 16; ++li) Ts[(16 * b + li) * L::LDC + 16 * b + l] = tc[li];
            }
        }
        float oacc[4][4];
        {
            float xacc[4][4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < 4; ++r) xacc[u][r] = oacc[u][r] = 0.0f;
#pragma unroll 2
            for (int k0 = 0; k0 < DK; k0 += 8) {
                const GdncFragA ak = gdnc_a_rows<SPLIT>(Ks, L::LDK, 16 * om, k0, g, t);
                const GdncFragA aq = gdnc_a_rows<SPLIT>(Qs, L::LDK, 16 * om, k0, g, t);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const GdncFragB b = gdnc_b_kmajor<SPLIT>(Ss, L::LDV, k0, 8 * (onb + u), g, t);
                    gdnc_mma<SPLIT>(xacc[u], ak, b);
                    gdnc_mma<SPLIT>(oacc[u], aq, b);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = 16 * om + gdnc_row(g, r), j = 8 * (onb + u) + gdnc_col(t, r);
                    const float e = EG[i];
                    float* x = Xs + i * L::LDV + j;
                    *x = BETA[i] * (*x - e * xacc[u][r]);
                    oacc[u][r] *= e;
                }
        }
        __syncthreads();

        // ---- 4. v' = (I + A)^-1 x by blocks of 16 rows, warp w on columns 8w .. 8w+7 only
        // (columns are independent, so no block barrier): y = x_b - sum_{c<b} A_bc v'_c,
        // v'_b = T_bb y. y is staged through Vs to turn accumulators into a B operand.
        {
            const int n0 = 8 * warp;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                float* vb = Vs + (16 * b + g) * L::LDV + n0 + 2 * t;
                const float* xb = Xs + (16 * b + g) * L::LDV + n0 + 2 * t;
                float y[4] = {xb[0], xb[1], xb[8 * L::LDV], xb[8 * L::LDV + 1]};
#pragma unroll
                for (int k0 = 0; k0 < 16 * b; k0 += 8) {
                    const GdncFragA a = gdnc_a_rows<SPLIT>(As, L::LDC, 16 * b, k0, g, t, -1.0f);
                    const GdncFragB v = gdnc_b_kmajor<SPLIT>(Vs, L::LDV, k0, n0, g, t);
                    gdnc_mma<SPLIT>(y, a, v);
                }
                *reinterpret_cast<float2*>(vb) = make_float2(y[0], y[1]);
                *reinterpret_cast<float2*>(vb + 8 * L::LDV) = make_float2(y[2], y[3]);
                __syncwarp();
                float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int k0 = 16 * b; k0 < 16 * b + 16; k0 += 8) {
                    const GdncFragA a = gdnc_a_rows<SPLIT>(Ts, L::LDC, 16 * b, k0, g, t);
                    const GdncFragB yb = gdnc_b_kmajor<SPLIT>(Vs, L::LDV, k0, n0, g, t);
                    gdnc_mma<SPLIT>(v, a, yb);
                }
                __syncwarp();
                *reinterpret_cast<float2*>(vb) = make_float2(v[0], v[1]);
                *reinterpret_cast<float2*>(vb + 8 * L::LDV) = make_float2(v[2], v[3]);
                __syncwarp();
            }
        }
        __syncthreads();

        // ---- 5. Output o = oacc + P v' (rows < n), then the state:
        // S <- exp(gc_last) S + (K * exp(gc_last - gc))^T v'.
        {
#pragma unroll
            for (int k0 = 0; k0 < 16 * om + 16; k0 += 8) {
                const GdncFragA a = gdnc_a_rows<SPLIT>(Ps, L::LDC, 16 * om, k0, g, t);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const GdncFragB v = gdnc_b_kmajor<SPLIT>(Vs, L::LDV, k0, 8 * (onb + u), g, t);
                    gdnc_mma<SPLIT>(oacc[u], a, v);
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = 16 * om + gdnc_row(g, r), j = j0 + 8 * (onb + u) + gdnc_col(t, r);
                    if (i < n && j < dv)
                        out[(size_t)(r0 + i) * p.ld_out + (size_t)h * dv + j] = flashrt::from_f32<T>(oacc[u][r]);
                }

            const float e_last = EG[C - 1];
#pragma unroll
            for (int u = 0; u < NS; ++u)
#pragma unroll
                for (int r = 0; r < 4; ++r) sacc[u][r] *= e_last;
#pragma unroll 2
            for (int k0 = 0; k0 < C; k0 += 8) {
                const GdncFragA a = gdnc_a_cols<SPLIT>(Ks, L::LDK, 16 * ms, k0, g, t, WL);
#pragma unroll
                for (int u = 0; u < NS; ++u) {
                    const GdncFragB v = gdnc_b_kmajor<SPLIT>(Vs, L::LDV, k0, 8 * (nsb + u), g, t);
                    gdnc_mma<SPLIT>(sacc[u], a, v);
                }
            }
            store_ss();
        }
        __syncthreads();
    }

#pragma unroll
    for (int u = 0; u < NS; ++u)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int d = 16 * ms + gdnc_row(g, r), j = j0 + 8 * (nsb + u) + gdnc_col(t, r);
            if (d < dk && j < dv) st[(size_t)d * dv + j] = sacc[u][r];
        }
}

#define FLASHRT_GDNC_ENTRY(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(GDNC_THREADS, 1) gated_deltanet_chunk_k##D##_bf16(const GdnParams p) { \
        gdnc_impl<__nv_bfloat16, D, false>(p);                                                         \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDNC_THREADS, 1) gated_deltanet_chunk_k##D##_f16(const GdnParams p) {  \
        gdnc_impl<__half, D, false>(p);                                                                \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDNC_THREADS, 1) gated_deltanet_chunk_k##D##_f32(const GdnParams p) {  \
        gdnc_impl<float, D, true>(p);                                                                  \
    }

FLASHRT_GDNC_ENTRY(64)
FLASHRT_GDNC_ENTRY(128)
