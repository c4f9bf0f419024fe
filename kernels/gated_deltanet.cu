// flashrt kernels: Gated DeltaNet recurrence (plan op `GatedDeltaNet`): a token-by-token kernel
// (decode, verify, small prefill buckets), a chunked one (prefill buckets of >= 32 rows), and
// for decode and verify on sm_90 the token kernel with the layer's causal conv before it and
// gated RMSNorm after it fused in (`gdn_decode_r*`, below the token kernel).
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
// (and its split form, `gated_deltanet_chunk_prep_*` then `gated_deltanet_chunk_pre{,2}_*`:
// see GDNC_PREP at `gdnc_impl`)
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
// q and k stay unnormalised in shared memory (exactly as loaded); the norms enter as per-row
// factors of the products above.
// Grid = (ceil(dv / 16), Hv): one block per value head and N = 16 value columns, 128 threads
// (4 warps), looping over the chunks of the call. Small blocks on purpose: at the 27B shape the
// 384 blocks fill every SM three deep (67 KiB of shared memory and <= 168 registers each), and
// the latency of one block's serial phases hides behind the other two. The state slice, as
// S^T [16][dk], stays in registers (accumulator layout) for the whole call. A chunk is 5
// phases between block barriers:
//   1. thread = row: the norms of q and k; warp 0: beta, the prefix sum gc, exp(gc),
//      exp(gc_last - gc) (its a, b inputs loaded a chunk ahead);
//   2. As = -A and P = lower-incl((Q K^T) * Gamma): the 20 lower 16x8 tiles of K K^T and
//      Q K^T, 5 per warp;
//   3. warp b inverts the diagonal block b of I + A (forward substitution, lane = column);
//      warps 0, 1: K S0 -> x (registers) for column tiles 0, 1; warps 2, 3: Q S0 -> the first
//      term of O; every warp loads its B fragments of the state update (K scaled by
//      exp(gc_last - gc) / |k|) into registers. K, Q, V are then free, and the next chunk's are
//      requested (cp.async, 16 bytes a piece, when rows are 16-byte aligned; element by element
//      otherwise) so that they arrive during phases 4 and 5;
//   4. warps 0, 1: V' = (I + A)^-1 X by blocks of 16 rows: y = x_b - sum_{c<b} A_bc v'_c,
//      v'_b = T_bb y (columns are independent, no block barrier);
//   5. warps 2, 3: O += P V', stored for rows < len; all: S^T <- exp(gc_last) S^T + V'^T K',
//      and the copy of S^T in shared memory (the B operand of K S0, Q S0) is refreshed.
// All products run on tensor cores with f32 accumulation, 16 k values per step: bf16/f16
// targets use mma.m16n8k16 on operands in the target type (q, k, v exactly as loaded; S0, A,
// P, T, y and v' rounded to it: relative 2^-9 for bf16, well inside the bf16 tolerance, since
// the state itself stays f32 in registers); f32 targets use two mma.m16n8k8 TF32 per step as
// 3xTF32 (hi/lo split, about 2^-22 relative per product) so they match the recurrence to f32
// rounding. Elementwise work (norms, gates, exp, the 16x16 inverses) is f32 on CUDA cores.
// Per block and chunk at dk = 128, N = 16 (multiply-adds): K K^T and Q K^T 0.33 M (recomputed
// by the 8 column blocks of a head: cheaper than sharing them), K S0 and Q S0 0.26 M,
// (I+A)^-1 X 0.03 M, P V' 0.03 M, state 0.13 M. Global memory: q, k, v, a, b read once per
// block (v once overall; q, k 48 times per key head, from L2: about 0.4 GB of L2 reads at the
// 27B shape, 2048 rows), out written once, the state read and written once.
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
    // The chunked kernel's per-chunk records (`gated_deltanet_chunk_prep_*` writes them,
    // `gated_deltanet_chunk_pre_*` reads them; null otherwise): record (h, c) at
    // prep + (h * prep_chunks + c) * GdncLayout::REC.
    void* prep;
    int prep_chunks;
    int prep_pad_;
};

#define GDN_WARPS 4
#define GDN_COLS_PER_WARP 8
#define GDN_SLICES 4

// One token of the recurrence for this thread's column slice (the token kernels' layout:
// lane = column (lane & 7) x row slice (lane >> 3), rows i = slice + 4 m): q, k (dk floats, as
// loaded) in shared memory, v of the thread's column, the token's a and b. Updates S in place
// and returns out[j] = S_new^T q for the column (every lane of the column's 4 slices).
// FULL: dk == RPT * GDN_SLICES, so no row is predicated off and the compiler can issue the
// shared-memory loads ahead of the multiply-adds (with a run-time bound it serialises each load
// and its use: ~1.5 us a token at dk = 128). Both forms do the same operations in the same order
// (the products pinned with intrinsics, so contraction cannot differ between them).
template <int RPT, bool FULL>
static __device__ __forceinline__ float gdn_token_impl(float (&S)[RPT], const float* sq, const float* sk, int dk,
                                                       float v, float av, float bv, float neg_a, float dt_bias,
                                                       float qscale) {
    constexpr int DK_MAX = RPT * GDN_SLICES;
    const int lane = threadIdx.x & 31, slice = lane >> 3;
    // Norms and k.q: every warp computes them redundantly (no extra barrier).
    float qq = 0.0f, kk = 0.0f, kq = 0.0f;
#pragma unroll
    for (int m = 0; m < (DK_MAX + 31) / 32; ++m) {
        const int i = lane + 32 * m;
        if ((FULL && DK_MAX % 32 == 0) || i < dk) {
            const float qi = sq[i], ki = sk[i];
            qq = __fmaf_rn(qi, qi, qq);
            kk = __fmaf_rn(ki, ki, kk);
            kq = __fmaf_rn(ki, qi, kq);
        }
    }
    qq = flashrt::warp_sum(qq);
    kk = flashrt::warp_sum(kk);
    kq = flashrt::warp_sum(kq);
    const float inv_q = 1.0f / sqrtf(qq + 1e-6f) * qscale;
    const float inv_k = 1.0f / sqrtf(kk + 1e-6f);
    FLASHRT_MARK(9);

    // Old-state contractions S^T k and S^T q over this thread's rows, then over slices.
    float kr[RPT];
    float sk_acc = 0.0f, sq_acc = 0.0f;
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        const int i = slice + GDN_SLICES * m;
        kr[m] = 0.0f;
        if (FULL || i < dk) {
            kr[m] = sk[i];
            sk_acc = __fmaf_rn(S[m], kr[m], sk_acc);
            sq_acc = __fmaf_rn(S[m], sq[i], sq_acc);
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
        if (FULL || i < dk) S[m] = __fmaf_rn(S[m], e, __fmul_rn(kr[m], dk_scaled));
    }
    return o;
}

template <int RPT>
static __device__ __forceinline__ float gdn_token(float (&S)[RPT], const float* sq, const float* sk, int dk, float v,
                                                  float av, float bv, float neg_a, float dt_bias, float qscale) {
    return dk == RPT * GDN_SLICES ? gdn_token_impl<RPT, true>(S, sq, sk, dk, v, av, bv, neg_a, dt_bias, qscale)
                                  : gdn_token_impl<RPT, false>(S, sq, sk, dk, v, av, bv, neg_a, dt_bias, qscale);
}

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

        const float o = gdn_token<RPT>(S, sq[buf], sk[buf], dk, v, av, bv, neg_a, dt_bias, qscale);
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

// ---- gdn_decode_r{R}_c{NB}: small phases, conv + recurrence + gated RMSNorm in one launch ----
// Decode and verify (<= GDND_ROWS rows, dk <= 128, dv <= 128 a multiple of 32, conv taps <= 4,
// 16-bit targets, sm_90): the causal conv before the recurrence and the gated RMSNorm after it
// (ops `CausalConv1d`, `GatedDeltaNet`, `GatedRmsNorm` of one layer) in one launch. A value
// head's state is split by columns over NB blocks (grid = Hv * NB; NB = 1, 2 or 4: 128, 64 or
// 32 columns a block, 16, 8 or 4 warps) with the token kernel's thread layout (8 columns x 4
// row slices a warp, the state slice in registers); the blocks of the R = Hv / Hk value heads
// that share a key head form one thread-block cluster (R * NB blocks). More, smaller blocks
// spread a layer's state loads and its serial token step over more SMs: a launch's critical
// path is one block's loads and token steps, not the device's bandwidth.
// Every conv channel has one owner in the cluster, so its state rolls without a race: block
// (h, c) convolves the v channels of its columns and a 1 / (R NB) share of the key head's q and
// k channels, and writes the q, k outputs into every cluster block's shared memory
// (distributed shared memory stores before the first cluster barrier). The recurrent and conv
// states and every weight are loaded before the wait for the predecessor (nothing earlier in a
// step writes them). Each value is computed as the separate kernels compute it: the conv output rounded to
// T (and stored, as the conv op stores it), the token kernel's recurrence, its output rounded to
// T (stored), then the gated norm of the head's dv outputs: each 32-column group's sum of squares
// (a warp sum) sent to the head's NB blocks before the second cluster barrier, and added in
// group order, whatever NB is (the sum in another order than the norm kernel's: f32 rounding).
#define GDND_ROWS 8
#define GDND_DK 128
#define GDND_DV 128

struct GdnDecodeParams {
    GdnParams g;            // qkv: the conv's input (pre-conv); out: the recurrence's output
    const float* conv_w;    // [C, K]
    const float* conv_b;    // [C] or null
    void* conv_state;       // [K - 1, C] T, oldest first
    void* conv_out;         // [rows, ld_conv_out] T: the conv op's output view
    const void* z;          // [rows, ld_z] T: the norm's gate
    const float* norm_w;    // [dv] (shared) or [Hv * dv]
    void* gated;            // [rows, ld_gated] T: the norm's output
    int ld_conv_out;
    int ld_z;
    int ld_gated;
    int conv_k;
    int act;
    int shared_weight;
    int gate_then_norm;
    float eps;
    // A batched step (common.cuh; grid y = the step's row capacity): block row y runs row y alone
    // on its own session's state (g.state and conv_state are offsets into the state arena), as a
    // one-row step of that session does. Null otherwise.
    const unsigned long long* slots;
    // Per-row states (a speculative round's verify pass; the runtime's
    // DeviceSession::keep_row_states): when set, the recurrent state and the conv state as they
    // are after row r, in their regions' own layouts, at ckpt_state / ckpt_conv +
    // r * ckpt_row_bytes, so that a rejected draft is undone by a copy. Null otherwise.
    float* ckpt_state;
    void* ckpt_conv;
    long long ckpt_row_bytes;
    // The next matmul's first weights, asked of the L2 (`flashrt::prefetch_l2_share`; null: none).
    const void* pf;
    unsigned long long pf_bytes;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
static __device__ __forceinline__ unsigned gdnd_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// The cluster barrier in two halves: a block's distributed shared memory may be written only once
// every block of the cluster runs, so each block arrives at entry and waits before its first
// remote store.
static __device__ __forceinline__ void gdnd_cluster_arrive() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
static __device__ __forceinline__ void gdnd_cluster_wait() {
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
}
static __device__ __forceinline__ void gdnd_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Stores v at `local` (an address in this block's shared memory) in the shared memory of
// cluster block `rank` (visible there after the next cluster barrier).
static __device__ __forceinline__ void gdnd_put(float* local, unsigned rank, float v) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(local);
    unsigned ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(ra), "f"(v) : "memory");
}
#endif

// Threads of a block of gdn_decode_*_c{NB}: one warp per 8 of its GDND_DV / NB columns.
#define GDND_THREADS(NB) (GDND_DV / (NB) / GDN_COLS_PER_WARP * 32)

template <typename T, int R, int NB, int MAXR> static __device__ __forceinline__ void gdn_decode_impl(const GdnDecodeParams& q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr int RPT = GDND_DK / GDN_SLICES;
    constexpr int COLS = GDND_DV / NB; // value columns of this block
    constexpr int THREADS = GDND_THREADS(NB);
    constexpr int GROUPS = GDND_DV / 32; // 32-column groups of a head (the norm's partial sums)
    __shared__ float cqk[MAXR][2 * GDND_DK]; // q then k, after the conv (T-rounded)
    __shared__ float cv[MAXR][COLS];
    __shared__ float zs[MAXR][COLS], so[MAXR][COLS];
    __shared__ float sab[MAXR][2];
    __shared__ float red[MAXR][GROUPS];
    const GdnParams& p = q.g;
    FLASHRT_MARK(0);
    flashrt::prefetch_l2_share(q.pf, q.pf_bytes);
    gdnd_cluster_arrive();
    const int h = blockIdx.x / NB, cb = blockIdx.x % NB, kh = h / R;
    const int c0 = cb * COLS; // this block's first column
    // This block's first row: 0, or its row of a batched step (the cluster shares blockIdx.y).
    const int row0 = q.slots ? (int)blockIdx.y : 0;
    const unsigned rank = gdnd_rank(); // == blockIdx.x % (R * NB)
    const unsigned head0 = rank - (unsigned)cb; // the rank of this head's first block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int dk = p.key_dim, dv = p.value_dim;
    const int slice = lane >> 3;
    const int j = c0 + warp * GDN_COLS_PER_WARP + (lane & 7); // the recurrence's column
    const bool col_ok = j < dv;
    const int C = 2 * p.key_heads * dk + p.value_heads * dv;
    const int K = q.conv_k, K1 = K - 1;
    // This thread's conv channel: the v channel of column c0 + t (t < COLS), or one of the
    // block's share of the key head's 2 dk q, k channels (index qi).
    const int t = threadIdx.x, share = (2 * dk + R * NB - 1) / (R * NB);
    const int jn = c0 + t; // the norm's column (t < COLS)
    const bool vrole = t < COLS;
    const int qi = vrole ? -1 : (int)rank * share + (t - COLS);
    const bool conv_ok = vrole ? jn < dv : (t - COLS < share && qi < 2 * dk);
    const int ch = vrole ? 2 * p.key_heads * dk + h * dv + jn
                 : qi < dk ? kh * dk + qi
                           : p.key_heads * dk + kh * dk + (qi - dk);

    // ---- before the wait: weights and the recurrent state (nothing earlier writes them)
    float S[RPT];
    float* st = flashrt::in_slot(p.state, q.slots, row0) + (size_t)h * dk * dv;
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        const int i = slice + GDN_SLICES * m;
        S[m] = (col_ok && i < dk) ? st[(size_t)i * dv + j] : 0.0f;
    }
    // The taps left-padded with zeros to 4 (conv_vec's order: exact zeros first).
    float cw[4], cbias = 0.0f;
#pragma unroll
    for (int u = 0; u < 4; ++u) cw[u] = (conv_ok && u >= 4 - K) ? q.conv_w[(size_t)ch * K + u - (4 - K)] : 0.0f;
    if (conv_ok && q.conv_b) cbias = q.conv_b[ch];
    const bool norm_ok = vrole && jn < dv;
    const float nw = norm_ok ? q.norm_w[q.shared_weight ? jn : (size_t)h * dv + jn] : 0.0f;
    const float qscale = rsqrtf((float)dk);
    const float neg_a = -expf(p.a_log[h]);
    const float dt_bias = p.dt_bias[h];
    // The conv's window of the last 4 times (win[3] = the newest), starting with its state's
    // rows (only this layer's launch of the previous step wrote them).
    T* cst = flashrt::in_slot(static_cast<T*>(q.conv_state), q.slots, row0);
    float win[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int s = K1 + m - 4; // state row of time m - 4 (none before the oldest)
        win[m] = conv_ok && s >= 0 ? flashrt::to_f32(cst[(size_t)s * C + ch]) : 0.0f;
    }

    const int live = flashrt::load_len(p.len); // before the wait too (common.cuh)
    FLASHRT_MARK(1);
    flashrt::pdl_enter();
    FLASHRT_MARK(2);
    if (q.slots && row0 >= live) return; // a batched step's padding row (the whole cluster)
    const int len = q.slots ? 1 : min(live, MAXR);
    // Activation rows from row0 on (r below counts from there).
    const T* x = static_cast<const T*>(p.qkv) + (size_t)row0 * p.ld_qkv;
    // The norm's gate and the recurrence's a, b for every row, requested first and held in
    // registers until the conv's loads are in flight too (one trip to L2 for all of them: the
    // compiler keeps loads after the conv's stores in program order, as the pointers may alias).
    constexpr int ZPER = (MAXR * COLS + THREADS - 1) / THREADS;
    float zr[ZPER], ar = 0.0f, br = 0.0f;
#pragma unroll
    for (int u = 0; u < ZPER; ++u) {
        const int i = t + u * THREADS, r = i / COLS, c = i % COLS;
        zr[u] = r < len && c0 + c < dv
                    ? flashrt::to_f32(static_cast<const T*>(q.z)[(size_t)(row0 + r) * q.ld_z + (size_t)h * dv + c0 + c])
                    : 0.0f;
    }
    if (t < len) {
        ar = flashrt::to_f32(static_cast<const T*>(p.a)[(size_t)(row0 + t) * p.ld_a + h]);
        br = flashrt::to_f32(static_cast<const T*>(p.b)[(size_t)(row0 + t) * p.ld_b + h]);
    }

    // ---- the causal conv of this thread's channel over the rows, its state rolled
    gdnd_cluster_wait(); // every block of the cluster runs (entry's arrival)
    if (conv_ok) {
        T* co = static_cast<T*>(q.conv_out) + (size_t)row0 * q.ld_conv_out;
#pragma unroll 1
        for (int r = 0; r < len; ++r) {
#pragma unroll
            for (int m = 0; m < 3; ++m) win[m] = win[m + 1];
            win[3] = flashrt::to_f32(x[(size_t)r * p.ld_qkv + ch]);
            // out[r] = act(bias + sum_j w[j] u[r - K1 + j]), taps in order, as conv_vec.
            float acc = cbias;
#pragma unroll
            for (int u0 = 0; u0 < 4; ++u0) acc += cw[u0] * win[u0];
            const T o = flashrt::from_f32<T>(flashrt::apply_act(q.act, acc));
            co[(size_t)r * q.ld_conv_out + ch] = o;
            if (vrole) {
                cv[r][t] = flashrt::to_f32(o);
            } else {
                // Every block of the cluster needs the key head's q and k.
#pragma unroll 1
                for (unsigned b = 0; b < (unsigned)(R * NB); ++b) gdnd_put(&cqk[r][qi], b, flashrt::to_f32(o));
            }
            if (q.ckpt_conv) {
                // The state after row r: its last K1 inputs, win[4 - K1 .. 3], oldest first.
                T* ck = reinterpret_cast<T*>(static_cast<char*>(q.ckpt_conv) + (size_t)r * q.ckpt_row_bytes);
#pragma unroll
                for (int m = 1; m < 4; ++m) {
                    const int s = m - (4 - K1);
                    if (s >= 0) ck[(size_t)s * C + ch] = flashrt::from_f32<T>(win[m]);
                }
            }
        }
        // New state row s = time len - K1 + s = win[4 - K1 + s] (state values where len < K1).
        // (Shifted left by 3 - K1 first, so that row s is win[1 + s]: static register indices.)
#pragma unroll
        for (int d = 0; d < 3; ++d)
            if (d < 3 - K1) {
#pragma unroll
                for (int m = 0; m < 3; ++m) win[m] = win[m + 1];
            }
#pragma unroll
        for (int s = 0; s < 3; ++s)
            if (s < K1) cst[(size_t)s * C + ch] = flashrt::from_f32<T>(win[1 + s]);
    }
#pragma unroll
    for (int u = 0; u < ZPER; ++u) {
        const int i = t + u * THREADS;
        if (i < len * COLS) zs[i / COLS][i % COLS] = zr[u];
    }
    if (t < len) sab[t][0] = ar, sab[t][1] = br;
    FLASHRT_MARK(3);
    // Every block's q, k shares (and this block's v, z, a, b) in place.
    gdnd_cluster_sync();
    FLASHRT_MARK(4);

    T* mix = static_cast<T*>(p.out) + (size_t)row0 * p.ld_out;
    T* gated = static_cast<T*>(q.gated) + (size_t)row0 * q.ld_gated;
    for (int r = 0; r < len; ++r) {
        const float* sq = cqk[r];
        const float* sk = cqk[r] + dk;
        // ---- the recurrence (gdn_impl's token step)
        const float v = col_ok ? cv[r][j - c0] : 0.0f;
        FLASHRT_MARK(5);
        const float o = gdn_token<RPT>(S, sq, sk, dk, v, sab[r][0], sab[r][1], neg_a, dt_bias, qscale);
        FLASHRT_MARK(6);
        if (q.ckpt_state) {
            // The recurrent state after row r (the final store below is the last row's).
            float* ck = reinterpret_cast<float*>(reinterpret_cast<char*>(q.ckpt_state) + (size_t)r * q.ckpt_row_bytes) +
                        (size_t)h * dk * dv;
#pragma unroll
            for (int m = 0; m < RPT; ++m) {
                const int i = slice + GDN_SLICES * m;
                if (col_ok && i < dk) ck[(size_t)i * dv + j] = S[m];
            }
        }
        if (col_ok && slice == 0) {
            const T ot = flashrt::from_f32<T>(o);
            mix[(size_t)r * p.ld_out + (size_t)h * dv + j] = ot;
            so[r][j - c0] = flashrt::to_f32(ot);
        }
    }
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
        const int i = slice + GDN_SLICES * m;
        if (col_ok && i < dk) st[(size_t)i * dv + j] = S[m];
    }
    __syncthreads();
    // ---- the gated RMSNorm of the head's dv outputs (thread t = column c0 + t): each 32-column
    // group's sum of squares to the head's NB blocks, then every group's in order
    float hv[MAXR], gv[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        hv[r] = 0.0f, gv[r] = 0.0f;
        if (r < len && norm_ok) {
            const float xv = so[r][t];
            const float sz = flashrt::apply_act(flashrt::ACT_SILU, zs[r][t]);
            if (q.gate_then_norm) {
                hv[r] = xv * sz;
                gv[r] = nw;
            } else {
                hv[r] = xv;
                gv[r] = nw * sz;
            }
        }
        if (r < len && t < COLS) {
            const float ss = flashrt::warp_sum(hv[r] * hv[r]);
            if (lane == 0 && c0 + t < dv)
                for (unsigned b = 0; b < (unsigned)NB; ++b) gdnd_put(&red[r][(c0 + t) / 32], head0 + b, ss);
        }
    }
    FLASHRT_MARK(7);
    gdnd_cluster_sync();
    if (norm_ok) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            if (r < len) {
                float tot = 0.0f;
                for (int w = 0; w < dv / 32; ++w) tot += red[r][w];
                const float inv = 1.0f / sqrtf(tot / (float)dv + q.eps);
                gated[(size_t)r * q.ld_gated + (size_t)h * dv + jn] = flashrt::from_f32<T>(hv[r] * inv * gv[r]);
            }
        }
    }
    FLASHRT_MARK(8);
#else
    __trap(); // sm_90 only; the host never selects it elsewhere
#endif
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define GDND_CLUSTER(n) __cluster_dims__(n, 1, 1)
#else
#define GDND_CLUSTER(n)
#endif
// `gdn_decode_r{R}_c{NB}` runs up to GDND_ROWS rows a block (decode and verify passes);
// `gdn_decode1_r{R}_c{NB}` one (a batched step's block rows: each its own session's row), with
// arrays sized for one row: 255 registers a thread at 8 rows leave one 256-thread block an SM,
// so a batched step's Hv x NB x b blocks would run in many waves. The same arithmetic per row.
#ifndef GDND1_MINB
#define GDND1_MINB(NB) (512 / GDND_THREADS(NB))
#endif
#define FLASHRT_GDND_ENTRY_ROWS(NAME, R, NB, MAXR, MINB)                                               \
    extern "C" __global__ void GDND_CLUSTER(R * NB) __launch_bounds__(GDND_THREADS(NB), MINB)         \
        NAME##_r##R##_c##NB##_bf16(const GdnDecodeParams p) {                                          \
        gdn_decode_impl<__nv_bfloat16, R, NB, MAXR>(p);                                                \
    }                                                                                                  \
    extern "C" __global__ void GDND_CLUSTER(R * NB) __launch_bounds__(GDND_THREADS(NB), MINB)         \
        NAME##_r##R##_c##NB##_f16(const GdnDecodeParams p) {                                           \
        gdn_decode_impl<__half, R, NB, MAXR>(p);                                                       \
    }
#define FLASHRT_GDND_ENTRY(R, NB)                                                                      \
    FLASHRT_GDND_ENTRY_ROWS(gdn_decode, R, NB, GDND_ROWS, 1)                                           \
    FLASHRT_GDND_ENTRY_ROWS(gdn_decode1, R, NB, 1, GDND1_MINB(NB))

FLASHRT_GDND_ENTRY(1, 1)
FLASHRT_GDND_ENTRY(2, 1)
FLASHRT_GDND_ENTRY(3, 1)
FLASHRT_GDND_ENTRY(4, 1)
FLASHRT_GDND_ENTRY(1, 2)
FLASHRT_GDND_ENTRY(2, 2)
FLASHRT_GDND_ENTRY(3, 2)
FLASHRT_GDND_ENTRY(4, 2)
FLASHRT_GDND_ENTRY(1, 4)
FLASHRT_GDND_ENTRY(2, 4)
FLASHRT_GDND_ENTRY(3, 4)
FLASHRT_GDND_ENTRY(4, 4)

// ---- chunked prefill kernel ----------------------------------------------------------------

#define GDNC_ROWS 64 // chunk rows C
#define GDNC_WARPS 4
#define GDNC_THREADS (GDNC_WARPS * 32)

// Shared memory of one block. E is the storage type of the matrix operands (the target dtype:
// q, k, v stay as loaded, unnormalised); row strides are padded by 8 elements so that every
// fragment load below is free of bank conflicts. All offsets are multiples of 16 bytes.
// Mirrored by the `GatedDeltaNet` arm of flashrt-runtime/src/backend/cuda/ops.rs.
template <typename E, int DK, int N> struct GdncLayout {
    static constexpr int C = GDNC_ROWS, PAD = 8, SZ = (int)sizeof(E);
    static constexpr int LDK = DK + PAD; // Ks, Qs: [C][LDK] raw k, q; St: [N][LDK] state S^T
    static constexpr int LDV = N + PAD;  // Vs: [C][LDV] raw v
    static constexpr int LDC = C + PAD;  // As (= -A), Ps: [C][LDC]; Vt: [N][LDC] v'^T
    static constexpr int LDT = 16 + PAD; // Ts: [C][LDT] diagonal blocks of (I + A)^-1; Yt: [8][LDT] per solver warp
    static constexpr int K = 0;
    static constexpr int Q = K + C * LDK * SZ;
    static constexpr int ST = Q + C * LDK * SZ;
    static constexpr int V = ST + N * LDK * SZ;
    static constexpr int A = V + C * LDV * SZ;
    static constexpr int P = A + C * LDC * SZ;
    static constexpr int T = P + C * LDC * SZ;
    static constexpr int VT = T + C * LDT * SZ;
    static constexpr int Y = VT + N * LDC * SZ;
    static constexpr int F = Y + (N / 8) * 8 * LDT * SZ; // f32 per-row vectors, C each:
    static constexpr int GC = F;                          //   cumulative log decay gc[i], times log2(e)
    static constexpr int BETA = GC + 4 * C;               //   beta[i]
    static constexpr int EG = BETA + 4 * C;               //   exp(gc[i])
    static constexpr int WL = EG + 4 * C;                 //   exp(gc[C-1] - gc[i])
    static constexpr int INVQ = WL + 4 * C;               //   dk^-1/2 / |q_i|
    static constexpr int INVK = INVQ + 4 * C;             //   1 / |k_i|
    static constexpr int BYTES = INVK + 4 * C;
    // A chunk's record (GDNC_PREP / GDNC_USE): As, Ps, Ts as laid out here, then the six
    // vectors. Multiples of 16 bytes.
    static constexpr int REC1 = VT - A;
    static constexpr int REC = REC1 + (BYTES - F);
};

// ---- tensor-core and copy helpers (the only inline assembly of the chunked kernel) ----------
// One k-step of every product covers 16 k values. Lane (g = lane / 4, t = lane % 4) holds, of
// a row-major A tile (16 x 16), the element pairs (row g, k 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
// (g+8, 2t+8..) and of a B tile (16 x 8) the pairs (k 2t..2t+1, column g), (k 2t+8.., g);
// its accumulator (16 x 8) elements are c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1).
// For 16-bit E a pair is one 32-bit register and a k-step is one mma.m16n8k16 (bf16 or f16,
// f32 accumulate). For f32 a pair is two registers and a k-step is two mma.m16n8k8 TF32, 3xTF32
// (x = hi + lo, a b ~ al bh + ah bl + ah bh: about 2^-22 relative, f32-grade): within each
// half the k index is permuted the same way in A and B (fragment k = t is element 2t, k = t + 4
// is 2t + 1), which leaves the products unchanged and lets pairs load as one float2.
template <typename E> struct GdncFrag {
    static constexpr int W = sizeof(E) == 2 ? 1 : 2; // registers per pair
    uint32_t r[4 * W];
};
template <typename E> struct GdncFragB {
    static constexpr int W = sizeof(E) == 2 ? 1 : 2;
    uint32_t r[2 * W];
};

static __device__ __forceinline__ uint32_t gdnc_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ void gdnc_mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                     uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void gdnc_mma(float (&c)[4], const GdncFrag<__nv_bfloat16>& a,
                                                const GdncFragB<__nv_bfloat16>& b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}

static __device__ __forceinline__ void gdnc_mma(float (&c)[4], const GdncFrag<__half>& a, const GdncFragB<__half>& b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}

// Two 32-bit halves of a bf16 / f16 pair from f32 values, low element first (round to nearest).
static __device__ __forceinline__ uint32_t gdnc_pack(float lo, float hi, __nv_bfloat16*) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}
static __device__ __forceinline__ uint32_t gdnc_pack(float lo, float hi, __half*) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// 16-byte global -> shared copy; bytes < 16 fills the rest with zeros (bytes = 0: no read).
static __device__ __forceinline__ void gdnc_cp16(void* smem, const void* gmem, int bytes) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void gdnc_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
static __device__ __forceinline__ void gdnc_cp_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// ---- end of tensor-core and copy helpers ----

static __device__ __forceinline__ void gdnc_mma(float (&c)[4], const GdncFrag<float>& a, const GdncFragB<float>& b) {
    // Register 2p / 2p+1 of a: pair p, elements k and k+1; see above for the pair order.
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
        const float x[4] = {__uint_as_float(a.r[4 * hf]), __uint_as_float(a.r[4 * hf + 2]), __uint_as_float(a.r[4 * hf + 1]),
                            __uint_as_float(a.r[4 * hf + 3])};
        const float y[2] = {__uint_as_float(b.r[2 * hf]), __uint_as_float(b.r[2 * hf + 1])};
        uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            ah[i] = gdnc_tf32(x[i]);
            al[i] = gdnc_tf32(x[i] - __uint_as_float(ah[i]));
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            bh[i] = gdnc_tf32(y[i]);
            bl[i] = gdnc_tf32(y[i] - __uint_as_float(bh[i]));
        }
        gdnc_mma_tf32(c, al[0], al[1], al[2], al[3], bh[0], bh[1]);
        gdnc_mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bl[0], bl[1]);
        gdnc_mma_tf32(c, ah[0], ah[1], ah[2], ah[3], bh[0], bh[1]);
    }
}

static __device__ __forceinline__ uint32_t gdnc_pack(float lo, float, float*) { return __float_as_uint(lo); }

// Pair p of a fragment: registers [p * W, p * W + W).
template <typename E> static __device__ __forceinline__ void gdnc_set_pair(uint32_t* r, const E* p) {
    if constexpr (sizeof(E) == 2) {
        r[0] = *reinterpret_cast<const uint32_t*>(p);
    } else {
        const float2 v = *reinterpret_cast<const float2*>(p);
        r[0] = __float_as_uint(v.x);
        r[1] = __float_as_uint(v.y);
    }
}
template <typename E> static __device__ __forceinline__ void gdnc_set_pair(uint32_t* r, float lo, float hi) {
    if constexpr (sizeof(E) == 2) {
        r[0] = gdnc_pack(lo, hi, static_cast<E*>(nullptr));
    } else {
        r[0] = __float_as_uint(lo);
        r[1] = __float_as_uint(hi);
    }
}

// A tile of a row-major matrix: element (m, k) at M[m * ld + k], M at (m0, k0).
template <typename E> static __device__ __forceinline__ GdncFrag<E> gdnc_a(const E* M, int ld, int g, int t) {
    constexpr int W = GdncFrag<E>::W;
    GdncFrag<E> f;
    gdnc_set_pair<E>(f.r + 0 * W, M + g * ld + 2 * t);
    gdnc_set_pair<E>(f.r + 1 * W, M + (g + 8) * ld + 2 * t);
    gdnc_set_pair<E>(f.r + 2 * W, M + g * ld + 2 * t + 8);
    gdnc_set_pair<E>(f.r + 3 * W, M + (g + 8) * ld + 2 * t + 8);
    return f;
}

// B tile of an n-major matrix: element (k, n) at M[n * ld + k], M at (k0, n0).
template <typename E> static __device__ __forceinline__ GdncFragB<E> gdnc_b(const E* M, int ld, int g, int t) {
    constexpr int W = GdncFragB<E>::W;
    GdncFragB<E> f;
    gdnc_set_pair<E>(f.r, M + g * ld + 2 * t);
    gdnc_set_pair<E>(f.r + W, M + g * ld + 2 * t + 8);
    return f;
}

// B tile of a k-major matrix with row k scaled by s0[k] s1[k]: element (k, n) =
// s0[k] s1[k] M[k * ld + n], rounded to E (M, s0, s1 at k0, n0).
template <typename E>
static __device__ __forceinline__ GdncFragB<E> gdnc_b_kscaled(const E* M, int ld, const float* s0, const float* s1, int g, int t) {
    constexpr int W = GdncFragB<E>::W;
    GdncFragB<E> f;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int k = 2 * t + 8 * q;
        gdnc_set_pair<E>(f.r + q * W, s0[k] * s1[k] * flashrt::to_f32(M[k * ld + g]),
                         s0[k + 1] * s1[k + 1] * flashrt::to_f32(M[(k + 1) * ld + g]));
    }
    return f;
}

// Accumulator element r of lane (g, t): row g + 8 (r / 2), column 2t + r % 2 of its tile.
static __device__ __forceinline__ int gdnc_row(int g, int r) { return g + 8 * (r >> 1); }
static __device__ __forceinline__ int gdnc_col(int t, int r) { return 2 * t + (r & 1); }

// Accumulator pairs (r = 0,1 and 2,3) stored as element pairs of a row-major matrix at M (m0, n0).
template <typename E> static __device__ __forceinline__ void gdnc_store_acc(E* M, int ld, const float (&c)[4], int g, int t) {
    if constexpr (sizeof(E) == 2) {
        *reinterpret_cast<uint32_t*>(M + g * ld + 2 * t) = gdnc_pack(c[0], c[1], static_cast<E*>(nullptr));
        *reinterpret_cast<uint32_t*>(M + (g + 8) * ld + 2 * t) = gdnc_pack(c[2], c[3], static_cast<E*>(nullptr));
    } else {
        *reinterpret_cast<float2*>(M + g * ld + 2 * t) = make_float2(c[0], c[1]);
        *reinterpret_cast<float2*>(M + (g + 8) * ld + 2 * t) = make_float2(c[2], c[3]);
    }
}

// Accumulator stored transposed: element (row, col) of the tile at M[col * ld + row].
template <typename E> static __device__ __forceinline__ void gdnc_store_acc_t(E* M, int ld, const float (&c)[4], int g, int t) {
#pragma unroll
    for (int r = 0; r < 4; ++r) M[gdnc_col(t, r) * ld + gdnc_row(g, r)] = flashrt::from_f32<E>(c[r]);
}

// Phase 2 of one warp: 5 lower 16x8 tiles of K K^T and Q K^T. Tiles u < CNT are in row tile
// MA, the others in MB; tile u's column tile is (NTAB >> 3u) & 7. Writes As = -A and Ps.
template <typename E, int DK, int N, int MA, int MB, int CNT, uint32_t NTAB>
static __device__ __forceinline__ void gdnc_gram(unsigned char* smem, int g, int t) {
    using L = GdncLayout<E, DK, N>;
    const E* Ks = reinterpret_cast<const E*>(smem + L::K);
    const E* Qs = reinterpret_cast<const E*>(smem + L::Q);
    E* As = reinterpret_cast<E*>(smem + L::A);
    E* Ps = reinterpret_cast<E*>(smem + L::P);
    const float* GC = reinterpret_cast<const float*>(smem + L::GC);
    const float* BETA = reinterpret_cast<const float*>(smem + L::BETA);
    const float* INVQ = reinterpret_cast<const float*>(smem + L::INVQ);
    const float* INVK = reinterpret_cast<const float*>(smem + L::INVK);
    float gk[5][4], gq[5][4];
#pragma unroll
    for (int u = 0; u < 5; ++u)
#pragma unroll
        for (int r = 0; r < 4; ++r) gk[u][r] = gq[u][r] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < DK; k0 += 16) {
        const GdncFrag<E> ka = gdnc_a<E>(Ks + 16 * MA * L::LDK + k0, L::LDK, g, t);
        const GdncFrag<E> qa = gdnc_a<E>(Qs + 16 * MA * L::LDK + k0, L::LDK, g, t);
        GdncFrag<E> kb = ka, qb = qa;
        if constexpr (MB != MA) {
            kb = gdnc_a<E>(Ks + 16 * MB * L::LDK + k0, L::LDK, g, t);
            qb = gdnc_a<E>(Qs + 16 * MB * L::LDK + k0, L::LDK, g, t);
        }
#pragma unroll
        for (int u = 0; u < 5; ++u) {
            const int n = (NTAB >> (3 * u)) & 7;
            const GdncFragB<E> b = gdnc_b<E>(Ks + 8 * n * L::LDK + k0, L::LDK, g, t);
            gdnc_mma(gk[u], u < CNT ? ka : kb, b);
            gdnc_mma(gq[u], u < CNT ? qa : qb, b);
        }
    }
#pragma unroll
    for (int u = 0; u < 5; ++u) {
        const int m = u < CNT ? MA : MB, n = (NTAB >> (3 * u)) & 7;
        float av[4], pv[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = 16 * m + gdnc_row(g, r), j = 8 * n + gdnc_col(t, r);
            const bool below = 8 * n + 7 < 16 * m; // the whole tile has i > j (known at compile time)
            // Gamma_ij = exp(gc_i - gc_j) <= 1 for i >= j (GC holds gc log2(e)); never evaluated
            // above the diagonal, where it may overflow.
            const float gam = (below || i >= j) ? exp2f(GC[i] - GC[j]) : 0.0f;
            const float kj = INVK[j] * gam;
            av[r] = (below || i > j) ? -(BETA[i] * INVK[i] * kj * gk[u][r]) : 0.0f;
            pv[r] = INVQ[i] * kj * gq[u][r];
        }
        gdnc_store_acc<E>(As + 16 * m * L::LDC + 8 * n, L::LDC, av, g, t);
        gdnc_store_acc<E>(Ps + 16 * m * L::LDC + 8 * n, L::LDC, pv, g, t);
    }
}

// One block = one value head h x N value columns, all rows of the call, chunk by chunk.
//
// MODE GDNC_FULL: as described at the top of the file. Phases 1, 2 and 3 (a) depend only on
// the chunk and the value head, not on the state or the value columns, yet every one of a
// head's dv / N blocks computed them again in its serial loop over the chunks (41 % of the
// kernel's time at the 27B shape, H100, 2026-12-06). So a call may split them off:
// GDNC_PREP: block (c, h) runs phases 1, 2 and 3 (a) of chunk c for value head h, all chunks
//   at once, and stores As, Ps, Ts and the six vectors as its record (GdncLayout::REC bytes);
// GDNC_USE: the serial loop copies each chunk's record into place instead (the same values
//   the same code computed: outputs and state bit-identical to GDNC_FULL);
// GDNC_USE2: as GDNC_USE, with two record buffers past the layout (GdncLayout::BYTES + 2 REC
//   bytes of shared memory), the next chunk's record copied during phases 4 and 5 instead of
//   after them. Two blocks an SM, so the host takes it where the launch has at most two blocks
//   an SM to place anyway.
#define GDNC_FULL 0
#define GDNC_PREP 1
#define GDNC_USE 2
#define GDNC_USE2 3
// (GDNC_PREP returns in the middle of the loop body: the rest is unreachable there, on purpose.)
#pragma nv_diag_suppress 128
template <typename T, int DK, int N, int MODE> static __device__ __forceinline__ void gdnc_impl(const GdnParams& p) {
    using E = T;
    using L = GdncLayout<E, DK, N>;
    constexpr int C = GDNC_ROWS;
    constexpr int NT = N / 8;        // 8-column tiles of the value columns
    constexpr int ND = DK / 8 / 4;   // 8-row tiles of S^T's d axis per warp
    constexpr int MJ = N / 16;       // 16-row tiles of S^T's j axis
    static_assert(GDNC_WARPS == 4 && C == 64, "work split assumes 4 warps and 64-row chunks");
    static_assert((N == 16 || N == 32) && (DK == 64 || DK == 128), "instantiated for N in {16, 32}, DK in {64, 128}");

    extern __shared__ __align__(16) unsigned char gdnc_smem[];
    E* Ks = reinterpret_cast<E*>(gdnc_smem + L::K);
    E* Qs = reinterpret_cast<E*>(gdnc_smem + L::Q);
    E* St = reinterpret_cast<E*>(gdnc_smem + L::ST);
    E* Vs = reinterpret_cast<E*>(gdnc_smem + L::V);
    E* As = reinterpret_cast<E*>(gdnc_smem + L::A);
    E* Ps = reinterpret_cast<E*>(gdnc_smem + L::P);
    E* Ts = reinterpret_cast<E*>(gdnc_smem + L::T);
    E* Vt = reinterpret_cast<E*>(gdnc_smem + L::VT);
    E* Yt = reinterpret_cast<E*>(gdnc_smem + L::Y);
    float* GC = reinterpret_cast<float*>(gdnc_smem + L::GC);
    float* BETA = reinterpret_cast<float*>(gdnc_smem + L::BETA);
    float* EG = reinterpret_cast<float*>(gdnc_smem + L::EG);
    float* WL = reinterpret_cast<float*>(gdnc_smem + L::WL);
    float* INVQ = reinterpret_cast<float*>(gdnc_smem + L::INVQ);
    float* INVK = reinterpret_cast<float*>(gdnc_smem + L::INVK);

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int h = blockIdx.y, j0 = MODE == GDNC_PREP ? 0 : blockIdx.x * N;
    const int dk = p.key_dim, dv = p.value_dim;
    const int len = flashrt::load_len(p.len);
    if (len <= 0) return;
    const int kh = h / (p.value_heads / p.key_heads);
    const T* qkv = static_cast<const T*>(p.qkv);
    const T* ap = static_cast<const T*>(p.a);
    const T* bp = static_cast<const T*>(p.b);
    T* out = static_cast<T*>(p.out);
    const int ld = p.ld_qkv;
    const int q_col = kh * dk;
    const int k_col = p.key_heads * dk + kh * dk;
    const int v_col = 2 * p.key_heads * dk + h * dv + j0;
    const float qscale = rsqrtf((float)dk);
    const float neg_a = -expf(p.a_log[h]);
    const float dt_bias = p.dt_bias[h];

    // Chunk loads: 16-byte cp.async when every row segment is 16-byte aligned (then a piece is
    // either all inside or all outside dk / dv); else element by element.
    constexpr int VE = 16 / (int)sizeof(E);
    const bool vec = (reinterpret_cast<uintptr_t>(qkv) % 16 == 0) && ((size_t)ld * sizeof(E)) % 16 == 0 && dk % VE == 0 &&
                     dv % VE == 0;
    auto load_chunk = [&](int r0) {
        const int n = min(C, len - r0);
        if (vec) {
            constexpr int KP = DK / VE, VP = N / VE;
#pragma unroll 4
            for (int e = tid; e < C * KP; e += GDNC_THREADS) {
                const int i = e / KP, d = (e % KP) * VE;
                const bool ok = i < n && d < dk;
                const T* row = qkv + (size_t)(ok ? r0 + i : 0) * ld;
                gdnc_cp16(Qs + i * L::LDK + d, ok ? row + q_col + d : qkv, ok ? 16 : 0);
                gdnc_cp16(Ks + i * L::LDK + d, ok ? row + k_col + d : qkv, ok ? 16 : 0);
            }
            for (int e = tid; e < C * VP; e += GDNC_THREADS) {
                const int i = e / VP, j = (e % VP) * VE;
                const bool ok = i < n && j0 + j < dv;
                gdnc_cp16(Vs + i * L::LDV + j, ok ? qkv + (size_t)(r0 + i) * ld + v_col + j : qkv, ok ? 16 : 0);
            }
            gdnc_cp_commit();
        } else {
            for (int e = tid; e < C * DK; e += GDNC_THREADS) {
                const int i = e / DK, d = e % DK;
                const bool ok = i < n && d < dk;
                const T* row = qkv + (size_t)(r0 + i) * ld;
                Qs[i * L::LDK + d] = ok ? row[q_col + d] : flashrt::from_f32<E>(0.0f);
                Ks[i * L::LDK + d] = ok ? row[k_col + d] : flashrt::from_f32<E>(0.0f);
            }
            for (int e = tid; e < C * N; e += GDNC_THREADS) {
                const int i = e / N, j = e % N;
                const bool ok = i < n && j0 + j < dv;
                Vs[i * L::LDV + j] = ok ? qkv[(size_t)(r0 + i) * ld + v_col + j] : flashrt::from_f32<E>(0.0f);
            }
        }
    };
    // Gates of rows 2 lane, 2 lane + 1 (warp 0), loaded one chunk ahead.
    float ga[2] = {0.0f, 0.0f}, gb[2] = {0.0f, 0.0f};
    auto load_gates = [&](int r0) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int i = r0 + 2 * lane + e;
            ga[e] = i < len ? flashrt::to_f32(ap[(size_t)i * p.ld_a + h]) : 0.0f;
            gb[e] = i < len ? flashrt::to_f32(bp[(size_t)i * p.ld_b + h]) : 0.0f;
        }
    };

    // The state slice, transposed: S^T[j][d] for j < N, d in warp's DK/4 rows, in registers
    // (accumulator layout: m = j, n = d) for the whole call; St holds a copy rounded to E.
    const int dw = warp * (DK / 4);
    float* st = p.state + (size_t)h * dk * dv;
    float sacc[MJ][ND][4];
    // f(value, state element index, in range) for every accumulator of the slice.
    auto each_state = [&](auto&& f) {
#pragma unroll
        for (int mj = 0; mj < MJ; ++mj)
#pragma unroll
            for (int nd = 0; nd < ND; ++nd)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int j = j0 + 16 * mj + gdnc_row(g, r), d = dw + 8 * nd + gdnc_col(t, r);
                    f(sacc[mj][nd][r], (size_t)d * dv + j, d < dk && j < dv);
                }
    };
    if constexpr (MODE != GDNC_PREP) each_state([&](float& v, size_t i, bool ok) { v = ok ? st[i] : 0.0f; });
    auto store_st = [&]() {
#pragma unroll
        for (int mj = 0; mj < MJ; ++mj)
#pragma unroll
            for (int nd = 0; nd < ND; ++nd) gdnc_store_acc<E>(St + 16 * mj * L::LDK + dw + 8 * nd, L::LDK, sacc[mj][nd], g, t);
    };
    // Record copies (16-byte cp.async; records are 16-byte aligned) and the chunk's record.
    unsigned char* const rec_base = static_cast<unsigned char*>(p.prep) + (size_t)h * p.prep_chunks * L::REC;
    auto copy_record = [&](int ch, bool to_smem) {
        unsigned char* rec = rec_base + (size_t)ch * L::REC;
        for (int o = tid * 16; o < L::REC; o += GDNC_THREADS * 16) {
            const int s = o < L::REC1 ? L::A + o : L::F + (o - L::REC1);
            if (to_smem) gdnc_cp16(gdnc_smem + s, rec + o, 16);
            else *reinterpret_cast<uint4*>(rec + o) = *reinterpret_cast<const uint4*>(gdnc_smem + s);
        }
    };
    // GDNC_USE2: record c in buffer c % 2, contiguous past the layout; the chunk's pointers
    // into it.
    auto copy_record2 = [&](int ch) {
        const unsigned char* rec = rec_base + (size_t)ch * L::REC;
        unsigned char* dst = gdnc_smem + L::BYTES + (ch & 1) * L::REC;
        for (int o = tid * 16; o < L::REC; o += GDNC_THREADS * 16) gdnc_cp16(dst + o, rec + o, 16);
    };
    auto point_record2 = [&](int ch) {
        unsigned char* b = gdnc_smem + L::BYTES + (ch & 1) * L::REC;
        As = reinterpret_cast<E*>(b);
        Ps = reinterpret_cast<E*>(b + (L::P - L::A));
        Ts = reinterpret_cast<E*>(b + (L::T - L::A));
        float* f = reinterpret_cast<float*>(b + L::REC1);
        GC = f;
        BETA = f + C;
        EG = f + 2 * C;
        WL = f + 3 * C;
        INVQ = f + 4 * C;
        INVK = f + 5 * C;
    };
    constexpr bool USE = MODE == GDNC_USE || MODE == GDNC_USE2;
    const int first = MODE == GDNC_PREP ? blockIdx.x : 0;
    if constexpr (MODE == GDNC_PREP) {
        if (first * C >= len) return;
    } else {
        store_st();
    }
    load_chunk(first * C);
    if constexpr (MODE == GDNC_USE2) {
        copy_record2(0);
        gdnc_cp_commit();
    }
    if (!USE && warp == 0) load_gates(first * C);

    // Roles in phases 3-5: with N = 16 warps 0, 1 form x and solve for v' (column tile = warp)
    // while warps 2, 3 form the outputs (column tile = warp - 2); with N = 32 every warp does
    // both for column tile = warp.
    constexpr bool SPLIT_ROLES = NT == 2;
    const bool solver = SPLIT_ROLES ? warp < 2 : true;
    const bool outer = SPLIT_ROLES ? warp >= 2 : true;
    const int xt = warp, ot = SPLIT_ROLES ? warp - 2 : warp;

    const int nchunks = MODE == GDNC_PREP ? first + 1 : (len + C - 1) / C;
    for (int ch = first; ch < nchunks; ++ch) {
        const int r0 = ch * C;
        const int n = min(C, len - r0); // valid rows; rows n .. C-1 are zero padding
        if constexpr (MODE == GDNC_USE) {
            __syncthreads(); // the previous chunk's phase 5 is done with As, Ps, Ts and the vectors
            copy_record(ch, true);
            gdnc_cp_commit();
            gdnc_cp_wait();
        } else if constexpr (MODE == GDNC_USE2) {
            gdnc_cp_wait(); // this chunk's record (and q, k, v), queued during the last one
            point_record2(ch);
        } else {
            if (vec) gdnc_cp_wait();
        }
        __syncthreads(); // the chunk's q, k, v (and record) and the state copy are in shared memory

        // ---- 1. norms (thread = row of q or k) and gates (warp 0)
        if constexpr (!USE) {
            const int i = tid & (C - 1);
            const E* row = (tid < C ? Qs : Ks) + i * L::LDK;
            float ss = 0.0f;
#pragma unroll
            for (int d = 0; d < DK; d += VE) {
                if constexpr (sizeof(E) == 2) {
                    const uint4 w = *reinterpret_cast<const uint4*>(row + d);
                    const E* e = reinterpret_cast<const E*>(&w);
#pragma unroll
                    for (int u = 0; u < 8; ++u) {
                        const float x = flashrt::to_f32(e[u]);
                        ss += x * x;
                    }
                } else {
                    const float4 w = *reinterpret_cast<const float4*>(row + d);
                    ss += w.x * w.x + w.y * w.y + w.z * w.z + w.w * w.w;
                }
            }
            const float inv = 1.0f / sqrtf(ss + 1e-6f);
            if (tid < C) INVQ[i] = inv * qscale;
            else INVK[i] = inv;
            if (warp == 0) {
                float gv[2], bt[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool ok = 2 * lane + e < n;
                    gv[e] = ok ? neg_a * flashrt::softplusf_(ga[e] + dt_bias) : 0.0f;
                    bt[e] = ok ? flashrt::sigmoidf_(gb[e]) : 0.0f;
                }
                if (ch + 1 < nchunks) load_gates(r0 + C);
                float gc0 = gv[0], gc1 = gv[1];
                const float last = flashrt::warp_prefix_sum2(gc0, gc1);
                GC[2 * lane] = gc0 * 1.44269504f; // log2(e)
                GC[2 * lane + 1] = gc1 * 1.44269504f;
                BETA[2 * lane] = bt[0];
                BETA[2 * lane + 1] = bt[1];
                EG[2 * lane] = expf(gc0);
                EG[2 * lane + 1] = expf(gc1);
                WL[2 * lane] = expf(last - gc0);
                WL[2 * lane + 1] = expf(last - gc1);
            }
        }
        __syncthreads();

        // ---- 2. As = -strictly-lower(beta_i (k_i . k_j) Gamma_ij), Ps = lower-incl((q_i . k_j)
        // Gamma_ij) with normalised q, k: the 20 lower 16x8 tiles of each, 5 per warp.
        if constexpr (!USE) switch (warp) {
        case 0: gdnc_gram<E, DK, N, 3, 3, 5, 0u | 1u << 3 | 2u << 6 | 3u << 9 | 4u << 12>(gdnc_smem, g, t); break;
        case 1: gdnc_gram<E, DK, N, 3, 0, 3, 5u | 6u << 3 | 7u << 6 | 0u << 9 | 1u << 12>(gdnc_smem, g, t); break;
        case 2: gdnc_gram<E, DK, N, 2, 2, 5, 0u | 1u << 3 | 2u << 6 | 3u << 9 | 4u << 12>(gdnc_smem, g, t); break;
        default: gdnc_gram<E, DK, N, 2, 1, 1, 5u | 0u << 3 | 1u << 6 | 2u << 9 | 3u << 12>(gdnc_smem, g, t); break;
        }
        __syncthreads();

        // ---- 3. (a) warp b: Ts block b = (I + A_bb)^-1 by forward substitution, lane l < 16
        // solving column l. (b) K S and Q S with the chunk's initial state (St):
        // solver warps x = beta (v - exp(gc) K S) into registers, output warps o = exp(gc) Q S.
        // (c) every warp: its state-update B fragments (K scaled by exp(gc_last - gc) / |k|) into
        // registers, so that the next chunk may be loaded during phases 4 and 5.
        if constexpr (!USE) {
            const int b = warp, l = lane & 15;
            const E* ab = As + 16 * b * L::LDC + 16 * b;
            float tc[16];
#pragma unroll
            for (int li = 0; li < 16; ++li) {
                float s0 = li == l ? 1.0f : 0.0f, s1 = 0.0f;
#pragma unroll
                for (int m = 0; m < li; m += 2) {
                    s0 += flashrt::to_f32(ab[li * L::LDC + m]) * tc[m];
                    if (m + 1 < li) s1 += flashrt::to_f32(ab[li * L::LDC + m + 1]) * tc[m + 1];
                }
                tc[li] = li < l ? 0.0f : s0 + s1;
            }
            if (lane < 16) {
#pragma unroll
                for (int li = 0; li < 16; ++li) Ts[(16 * b + li) * L::LDT + l] = flashrt::from_f32<E>(tc[li]);
            }
        }
        if constexpr (MODE == GDNC_PREP) {
            __syncthreads(); // Ts complete
            copy_record(ch, false);
            return;
        }
        float xacc[4][4], oacc[4][4];
        {
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int r = 0; r < 4; ++r) xacc[m][r] = oacc[m][r] = 0.0f;
            if (SPLIT_ROLES) {
                // One product per warp: rows of K (solver) or Q (output) times St tile.
                const E* A0 = warp < 2 ? Ks : Qs;
                const int nt = warp < 2 ? xt : ot;
                float(&acc)[4][4] = xacc;
#pragma unroll 2
                for (int k0 = 0; k0 < DK; k0 += 16) {
                    const GdncFragB<E> s = gdnc_b<E>(St + 8 * nt * L::LDK + k0, L::LDK, g, t);
#pragma unroll
                    for (int m = 0; m < 4; ++m) gdnc_mma(acc[m], gdnc_a<E>(A0 + 16 * m * L::LDK + k0, L::LDK, g, t), s);
                }
                if (warp >= 2) {
#pragma unroll
                    for (int m = 0; m < 4; ++m)
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            oacc[m][r] = xacc[m][r];
                            xacc[m][r] = 0.0f;
                        }
                }
            } else {
#pragma unroll 2
                for (int k0 = 0; k0 < DK; k0 += 16) {
                    const GdncFragB<E> s = gdnc_b<E>(St + 8 * xt * L::LDK + k0, L::LDK, g, t);
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        gdnc_mma(xacc[m], gdnc_a<E>(Ks + 16 * m * L::LDK + k0, L::LDK, g, t), s);
                        gdnc_mma(oacc[m], gdnc_a<E>(Qs + 16 * m * L::LDK + k0, L::LDK, g, t), s);
                    }
                }
            }
            if (solver) {
#pragma unroll
                for (int m = 0; m < 4; ++m)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = 16 * m + gdnc_row(g, r), j = 8 * xt + gdnc_col(t, r);
                        const float v = flashrt::to_f32(Vs[i * L::LDV + j]);
                        xacc[m][r] = BETA[i] * (v - EG[i] * INVK[i] * xacc[m][r]);
                    }
            }
            if (outer) {
#pragma unroll
                for (int m = 0; m < 4; ++m)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = 16 * m + gdnc_row(g, r);
                        oacc[m][r] *= EG[i] * INVQ[i];
                    }
            }
        }
        GdncFragB<E> kfr[4][ND]; // [c step][d tile]: (k = c, n = d) = K[c][d] exp(gc_last - gc_c) / |k_c|
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int nd = 0; nd < ND; ++nd)
                kfr[s][nd] = gdnc_b_kscaled<E>(Ks + 16 * s * L::LDK + dw + 8 * nd, L::LDK, WL + 16 * s, INVK + 16 * s, g, t);
        __syncthreads(); // Ts complete; K, Q, V and St are no longer read this chunk

        if (ch + 1 < nchunks) load_chunk(r0 + C);
        if constexpr (MODE == GDNC_USE2) {
            // Buffer (ch + 1) % 2 was last read by the previous chunk's phase 5.
            if (ch + 1 < nchunks) copy_record2(ch + 1);
            gdnc_cp_commit();
        }

        // ---- 4. v' = (I + A)^-1 x by blocks of 16 rows, one column tile per solver warp (columns
        // are independent): y = x_b - sum_{c<b} A_bc v'_c, v'_b = T_bb y. y passes through Yt
        // (warp-private) to become a B operand; v' is stored transposed in Vt.
        if (solver) {
            E* yt = Yt + xt * 8 * L::LDT;
            E* vt = Vt + 8 * xt * L::LDC;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                float y[4] = {xacc[b][0], xacc[b][1], xacc[b][2], xacc[b][3]};
#pragma unroll
                for (int c = 0; c < b; ++c)
                    gdnc_mma(y, gdnc_a<E>(As + 16 * b * L::LDC + 16 * c, L::LDC, g, t), gdnc_b<E>(vt + 16 * c, L::LDC, g, t));
                gdnc_store_acc_t<E>(yt, L::LDT, y, g, t);
                __syncwarp();
                float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                gdnc_mma(v, gdnc_a<E>(Ts + 16 * b * L::LDT, L::LDT, g, t), gdnc_b<E>(yt, L::LDT, g, t));
                gdnc_store_acc_t<E>(vt + 16 * b, L::LDC, v, g, t);
                __syncwarp();
            }
        }
        __syncthreads(); // Vt complete

        // ---- 5. outputs o += P v' (rows < n), then the state:
        // S^T <- exp(gc_last) S^T + v'^T (K exp(gc_last - gc) / |k|).
        if (outer) {
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int c = 0; c <= m; ++c)
                    gdnc_mma(oacc[m], gdnc_a<E>(Ps + 16 * m * L::LDC + 16 * c, L::LDC, g, t),
                             gdnc_b<E>(Vt + 8 * ot * L::LDC + 16 * c, L::LDC, g, t));
#pragma unroll
            for (int m = 0; m < 4; ++m)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int i = 16 * m + gdnc_row(g, r), j = j0 + 8 * ot + gdnc_col(t, r);
                    if (i < n && j < dv) out[(size_t)(r0 + i) * p.ld_out + (size_t)h * dv + j] = flashrt::from_f32<T>(oacc[m][r]);
                }
        }
        {
            const float e_last = EG[C - 1];
#pragma unroll
            for (int mj = 0; mj < MJ; ++mj)
#pragma unroll
                for (int nd = 0; nd < ND; ++nd)
#pragma unroll
                    for (int r = 0; r < 4; ++r) sacc[mj][nd][r] *= e_last;
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
                for (int mj = 0; mj < MJ; ++mj) {
                    const GdncFrag<E> va = gdnc_a<E>(Vt + 16 * mj * L::LDC + 16 * s, L::LDC, g, t);
#pragma unroll
                    for (int nd = 0; nd < ND; ++nd) gdnc_mma(sacc[mj][nd], va, kfr[s][nd]);
                }
            store_st();
        }
    }

    each_state([&](float& v, size_t i, bool ok) {
        if (ok) st[i] = v;
    });
}

#pragma nv_diag_default 128

#define GDNC_COLS 16 // value columns per block (16 or 32; mirrored by GDN_CHUNK_COLS in ops.rs)
#define GDNC_MIN_BLOCKS (GDNC_COLS == 16 ? 3 : 2) // blocks per SM the 16-bit variants are built for
#define FLASHRT_GDNC_ENTRY(PREFIX, D, MODE)                                                              \
    extern "C" __global__ void __launch_bounds__(GDNC_THREADS, GDNC_MIN_BLOCKS) PREFIX##D##_bf16(const GdnParams p) { \
        gdnc_impl<__nv_bfloat16, D, GDNC_COLS, MODE>(p);                                               \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDNC_THREADS, GDNC_MIN_BLOCKS) PREFIX##D##_f16(const GdnParams p) {  \
        gdnc_impl<__half, D, GDNC_COLS, MODE>(p);                                                      \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(GDNC_THREADS, 1) PREFIX##D##_f32(const GdnParams p) {  \
        gdnc_impl<float, D, GDNC_COLS, MODE>(p);                                                       \
    }

FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_k, 64, GDNC_FULL)
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_k, 128, GDNC_FULL)
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_prep_k, 64, GDNC_PREP)
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_prep_k, 128, GDNC_PREP)
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_pre_k, 64, GDNC_USE)
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_pre_k, 128, GDNC_USE)
#undef GDNC_MIN_BLOCKS
#define GDNC_MIN_BLOCKS 2
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_pre2_k, 64, GDNC_USE2)
FLASHRT_GDNC_ENTRY(gated_deltanet_chunk_pre2_k, 128, GDNC_USE2)
