// flashrt kernels: an attention layer's per-head work between its projections and the attention
// kernel, in one launch (`qk_prep`): what the plan writes as
//
//   split_heads  [query | gate] per head -> q, gate          (Qwen3.5's gated attention; optional)
//   rms_norm     q per head (q_norm), in place
//   rms_norm     k per head (k_norm), in place
//   rope         q, k (the first rotary_dims dims of each head, rotate-half pairs)
//   kv_write     k, v -> the caches at row r's position       (the attention op's first launch)
//
// five or six launches of a few kilobytes each, every one a launch latency in a decode step.
// The values are bit-identical to those launches': the norm is `rms_norm_vec`'s arithmetic
// (norm.cu `norm_vec_inv` / `norm_vec_scale`, the same threads per head `tpg` and the same
// pack-to-thread assignment, so the same sums in the same order; the normalised values rounded
// to T as that kernel stores them), the rotation is rope.cu's (rope.cuh), and the rest copies.
//
// grid = (ceil((q_heads + kv_heads) / hpb), rows), blockDim = QK_PREP_THREADS = hpb * tpg:
// `tpg` threads (a power of two <= 32, as the host's `rms_norm_vec` launch would pick for a
// head) own a head — query heads first, then key heads —, pack j of the head going to thread
// j % tpg, slot j / tpg. The block's first threads compute the row's rotation angles into
// shared memory while every thread loads its packs (and its head's gate or value packs, to
// copy); each group reduces its head's sum of squares with shuffles, stages its normalised packs
// in shared memory, and after one barrier each thread rotates its packs against their partners
// (pack j + half / N or j - half / N of the same head) and stores them: queries to q, keys to k
// and to the key cache, gates to gate, values to the value cache. A batched step's rows take
// their own positions and state arenas (common.cuh `row_pos`, `in_slot`).
//
// The host takes this kernel only where the separate norms would take `rms_norm_vec` (16-byte
// aligned views, head_dim a multiple of the pack, tpg <= 32) and where rotary_dims / 2 is a
// multiple of the pack; otherwise the plan's launches run as written.
//
// Memory traffic per row: the query, gate, key and value heads read once; q, gate, k written
// once, k and v once more into the caches.
#include "rope.cuh"

#define QK_PREP_THREADS 128

struct QkPrepParams {
    const void* src;  // query heads: head h at column h * src_stride of row r ([query | gate] when split)
    void* q;          // the normalised, rotated queries
    void* gate;       // the gate parts (split), else null
    void* k;          // keys, normalised and rotated in place
    const void* v;    // values (read only to fill the cache)
    void* cache_k;    // [max_seq, kv_heads * head_dim]; in a batched step an offset into each row's
    void* cache_v;    // state arena (0 for a cache at the arena's start: never a null test)
    const float* q_w; // [head_dim] norm weights, or null (s = 1)
    const float* k_w;
    const int* pos;
    const int* len;
    const int* rows_pos;             // batched step: each row's position, else null
    const unsigned long long* slots; // batched step: each row's state arena, else null
    double theta;
    int ld_src;
    int ld_q;
    int ld_gate;
    int ld_k;
    int ld_v;
    int src_stride;
    int q_heads;
    int kv_heads;
    int head_dim;
    int rotary_dims;
    int tpg;
    int one_plus_q;
    int one_plus_k;
    float eps_q;
    float eps_k;
    int max_seq;
};

template <typename T> static __device__ __forceinline__ void qk_prep_impl(const QkPrepParams& p) {
    constexpr int N = flashrt::Pack16<T>::N;
    __shared__ float2 angle[256];
    __shared__ uint4 stage[QK_PREP_THREADS * NORM_VPT];
    const int row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return; // the whole block is this row
    const int tpg = p.tpg, hpb = (int)blockDim.x / tpg;
    const int g = (int)threadIdx.x / tpg, lane = (int)threadIdx.x & (tpg - 1);
    const int u = (int)blockIdx.x * hpb + g;
    const bool active = u < p.q_heads + p.kv_heads, is_q = u < p.q_heads;
    const int hd = p.head_dim, nvec = hd / N, half = p.rotary_dims / 2, kh = u - p.q_heads;
    const int t = flashrt::row_pos(p.pos, p.rows_pos, row);
    const T* src = is_q ? static_cast<const T*>(p.src) + (size_t)row * p.ld_src + (size_t)u * p.src_stride
                        : static_cast<const T*>(p.k) + (size_t)row * p.ld_k + (size_t)kh * hd;
    const T* other = is_q ? (p.gate ? src + hd : nullptr)
                          : static_cast<const T*>(p.v) + (size_t)row * p.ld_v + (size_t)kh * hd;
    const float* wt = is_q ? p.q_w : p.k_w;
    const int one_plus = is_q ? p.one_plus_q : p.one_plus_k;
    // The head's packs as `rms_norm_vec` loads them, and its gate or value packs to copy.
    uint4 v[NORM_VPT], x[NORM_VPT];
    float w[NORM_VPT][N];
    norm_vec_load<T>(src, wt, one_plus, lane, tpg, nvec, active, v, w);
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = lane + k * tpg;
        x[k] = other && active && j < nvec ? flashrt::ld16(other + (size_t)j * N) : make_uint4(0, 0, 0, 0);
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x)
        angle[i] = flashrt::rope_cos_sin((float)t, (float)p.theta, i, p.rotary_dims);
    // Every lane of every warp takes part in the group's shuffles (tpg <= 32: no block sum).
    const float inv = norm_vec_inv<T>(v, tpg, nullptr, hd, is_q ? p.eps_q : p.eps_k);
    uint4* mine = stage + (size_t)g * tpg * NORM_VPT;
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = lane + k * tpg;
        v[k] = norm_vec_scale<T>(v[k], inv, w[k]);
        if (active && j < nvec) mine[j] = v[k];
    }
    __syncthreads();
    if (!active) return;
    const bool cache = t >= 0 && t < p.max_seq; // the host rejects other steps; never write out of bounds
    const size_t kvw = (size_t)p.kv_heads * hd;
    T* dst = is_q ? static_cast<T*>(p.q) + (size_t)row * p.ld_q + (size_t)u * hd
                  : static_cast<T*>(p.k) + (size_t)row * p.ld_k + (size_t)kh * hd;
    T* dst_x = is_q ? (p.gate ? static_cast<T*>(p.gate) + (size_t)row * p.ld_gate + (size_t)u * hd : nullptr) : nullptr;
    T* ck = cache && !is_q ? flashrt::in_slot(static_cast<T*>(p.cache_k), p.slots, row) + (size_t)t * kvw + (size_t)kh * hd
                           : nullptr;
    T* cv = cache && !is_q ? flashrt::in_slot(static_cast<T*>(p.cache_v), p.slots, row) + (size_t)t * kvw + (size_t)kh * hd
                           : nullptr;
#pragma unroll
    for (int k = 0; k < NORM_VPT; ++k) {
        const int j = lane + k * tpg;
        if (j >= nvec) continue;
        const int c0 = j * N;
        uint4 r = v[k];
        if (c0 < 2 * half) {
            const bool first = c0 < half;
            float own[N], partner[N], o[N];
            flashrt::unpack16<T>(v[k], own);
            flashrt::unpack16<T>(mine[first ? j + half / N : j - half / N], partner);
#pragma unroll
            for (int e = 0; e < N; ++e) {
                const float2 cs = angle[(first ? c0 : c0 - half) + e];
                o[e] = first ? flashrt::rope_first(own[e], partner[e], cs) : flashrt::rope_second(partner[e], own[e], cs);
            }
            r = flashrt::pack16<T>(o);
        }
        flashrt::st16(dst + c0, r);
        if (dst_x) flashrt::st16(dst_x + c0, x[k]);
        if (ck) {
            flashrt::st16(ck + c0, r);
            flashrt::st16(cv + c0, x[k]);
        }
    }
}

FLASHRT_ENTRY(qk_prep, QkPrepParams, QK_PREP_THREADS)
