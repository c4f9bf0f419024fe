// flashrt kernels: causal GQA attention over a position-major KV cache (plan op `Attention`).
//
// Two launches, in stream order:
//
// 1. `kv_write`: rows r < io.len of the new keys/values go to positions io.pos + r of the
//    caches `[max_seq, kv_heads, head_dim]` (in a batched step: row r's own position, in row
//    r's own caches; common.cuh). grid = (column tiles, rows). Traffic: 2 rows of
//    kv_heads * head_dim elements read and written per token.
//
// 2. `attention_d<D>`: grid = (query heads, rows, splits); KV head h / (q_heads / kv_heads).
//    Block (h, r, s) attends to its share of the causal positions 0 ..= io.pos + r: the range
//    is cut into `splits` equal contiguous pieces at run time (the length is only known on the
//    device), piece s belongs to the block. Inside a block, 4 warps take positions w, w + 4,
//    ... of the piece in groups of UNROLL: a warp loads UNROLL key rows, forms UNROLL dot
//    products with the query (which lives in registers, pre-scaled: lane l holds dims l,
//    l + 32, ...; D is the instantiated head-dim bound 64/128/256/512, dims >= head_dim are
//    masked), reduces them with interleaved warp shuffles, and folds them into its running
//    online-softmax state (max m, denominator l, accumulator o[], f32, in registers). The 4
//    warps' states are merged through shared memory. With one split the block writes the
//    output row; with several (flash-decoding) it writes its (m, l, o[]) to an f32 scratch
//    and
// 3. `attention_combine`: grid = (query heads, rows) merges the splits' partial states
//    (empty splits, m = -inf, are skipped) and writes the output.
//
//    The host picks `splits` per plan so that heads x rows x splits fills the GPU several
//    times over (decode: one row, so splits ~ 4 waves / q_heads; large prefill buckets: 1).
//    The partial states live in the session's cuBLASLt workspace, which no matmul uses
//    between an attention launch and its combine (one stream, in order).
//
//    Traffic per (row, head): (io.pos + r + 1) * head_dim * 2 elements of K and V (L2 hits
//    for all but the first of each GQA group), head_dim written (plus 4 * (head_dim + 2)
//    bytes per split and back with splits). Prefill re-reads each KV prefix once per row: a
//    tiled flash-attention prefill kernel is the next step for long chunks.
#include "common.cuh"

struct KvWriteParams {
    const void* k;
    const void* v;
    void* cache_k;
    void* cache_v;
    const int* pos;
    const int* len;
    int ld_k;
    int ld_v;
    int width; // kv_heads * head_dim
    int max_seq;
    const int* rows_pos;               // batched step (common.cuh): each row's position, else null
    const unsigned long long* slots;   // batched step: each row's state arena, else null
};

template <typename T> static __device__ __forceinline__ void kv_write_impl(const KvWriteParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.width) return;
    const int t = flashrt::row_pos(p.pos, p.rows_pos, row);
    if (t < 0 || t >= p.max_seq) return; // the host rejects such steps; never write out of bounds
    const size_t dst = (size_t)t * p.width + c;
    flashrt::in_slot(static_cast<T*>(p.cache_k), p.slots, row)[dst] = static_cast<const T*>(p.k)[(size_t)row * p.ld_k + c];
    flashrt::in_slot(static_cast<T*>(p.cache_v), p.slots, row)[dst] = static_cast<const T*>(p.v)[(size_t)row * p.ld_v + c];
}

FLASHRT_ENTRY(kv_write, KvWriteParams, 256)

struct AttentionParams {
    const void* q;
    const void* cache_k;
    const void* cache_v;
    void* out;
    const int* pos;
    const int* len;
    int ld_q;
    int ld_out;
    int q_heads;
    int kv_heads;
    int head_dim;
    int max_seq;
    int splits;   // position splits (gridDim.z); > 1: write partial states to `partial`
    float scale;
    float* partial; // [rows, q_heads, splits, head_dim + 2] f32: m, l, o[head_dim]
};

#define ATTN_WARPS 4
#define ATTN_UNROLL 4

template <typename T, int VPL>
static __device__ __forceinline__ void attention_impl(const AttentionParams& p) {
    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
    __shared__ float sm_o[ATTN_WARPS][VPL * 32];
    const int h = blockIdx.x, row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hd = p.head_dim;
    const int kvh = h / (p.q_heads / p.kv_heads);
    int n = flashrt::load_pos(p.pos) + row + 1; // positions 0 .. pos + row
    if (n > p.max_seq) n = p.max_seq;
    // This block's piece [lo, hi) of the positions.
    const int split = blockIdx.z;
    const int piece = (n + p.splits - 1) / p.splits;
    const int lo = split * piece;
    const int hi = min(n, lo + piece);
    const size_t kv_stride = (size_t)p.kv_heads * hd;
    const T* kbase = static_cast<const T*>(p.cache_k) + (size_t)kvh * hd;
    const T* vbase = static_cast<const T*>(p.cache_v) + (size_t)kvh * hd;
    const T* qrow = static_cast<const T*>(p.q) + (size_t)row * p.ld_q + (size_t)h * hd;

    float q[VPL], o[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        const int d = lane + 32 * i;
        q[i] = d < hd ? flashrt::to_f32(qrow[d]) * p.scale : 0.0f;
        o[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;

    for (int base = lo + warp * ATTN_UNROLL; base < hi; base += ATTN_WARPS * ATTN_UNROLL) {
        float s[ATTN_UNROLL];
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = base + u;
            float acc = 0.0f;
            if (t < hi) {
                const T* kr = kbase + (size_t)t * kv_stride;
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    const int d = lane + 32 * i;
                    if (d < hd) acc += q[i] * flashrt::to_f32(kr[d]);
                }
            }
            s[u] = acc;
        }
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) s[u] = flashrt::warp_sum(s[u]);
        float mnew = m;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u)
            if (base + u < hi) mnew = fmaxf(mnew, s[u]);
        // base < hi, so position `base` is valid and mnew is finite from here on.
        const float corr = expf(m - mnew);
        l *= corr;
#pragma unroll
        for (int i = 0; i < VPL; ++i) o[i] *= corr;
#pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            const int t = base + u;
            if (t < hi) {
                const float w = expf(s[u] - mnew);
                l += w;
                const T* vr = vbase + (size_t)t * kv_stride;
#pragma unroll
                for (int i = 0; i < VPL; ++i) {
                    const int d = lane + 32 * i;
                    if (d < hd) o[i] += w * flashrt::to_f32(vr[d]);
                }
            }
        }
        m = mnew;
    }

    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i) sm_o[warp][lane + 32 * i] = o[i];
    __syncthreads();
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) mx = fmaxf(mx, sm_m[w]);
    float scale[ATTN_WARPS], denom = 0.0f;
#pragma unroll
    for (int w = 0; w < ATTN_WARPS; ++w) {
        // A warp that saw no position has m = -inf, l = 0: its weight is exp(-inf) = 0.
        scale[w] = sm_m[w] == -INFINITY ? 0.0f : expf(sm_m[w] - mx);
        denom += sm_l[w] * scale[w];
    }
    if (p.splits > 1) {
        // Partial state of this split: m = max, l = denominator, o = unnormalised sum.
        float* part = p.partial + (((size_t)row * p.q_heads + h) * p.splits + split) * (size_t)(hd + 2);
        if (threadIdx.x == 0) {
            part[0] = mx;
            part[1] = denom;
        }
        if (mx == -INFINITY) return; // empty split: the combine skips it without reading o
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float acc = 0.0f;
#pragma unroll
            for (int w = 0; w < ATTN_WARPS; ++w) acc += sm_o[w][d] * scale[w];
            part[2 + d] = acc;
        }
        return;
    }
    const float inv = 1.0f / denom;
    T* orow = static_cast<T*>(p.out) + (size_t)row * p.ld_out + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) acc += sm_o[w][d] * scale[w];
        orow[d] = flashrt::from_f32<T>(acc * inv);
    }
}

// Merge the splits of one (head, row): out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
template <typename T> static __device__ __forceinline__ void attention_combine_impl(const AttentionParams& p) {
    const int h = blockIdx.x, row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    const int hd = p.head_dim;
    const float* part = p.partial + ((size_t)row * p.q_heads + h) * p.splits * (size_t)(hd + 2);
    float mx = -INFINITY;
    for (int s = 0; s < p.splits; ++s) mx = fmaxf(mx, part[(size_t)s * (hd + 2)]);
    float denom = 0.0f;
    for (int s = 0; s < p.splits; ++s) {
        const float m = part[(size_t)s * (hd + 2)];
        if (m != -INFINITY) denom += part[(size_t)s * (hd + 2) + 1] * expf(m - mx);
    }
    const float inv = 1.0f / denom;
    T* orow = static_cast<T*>(p.out) + (size_t)row * p.ld_out + (size_t)h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < p.splits; ++s) {
            const float* ps = part + (size_t)s * (hd + 2);
            if (ps[0] != -INFINITY) acc += ps[2 + d] * expf(ps[0] - mx);
        }
        orow[d] = flashrt::from_f32<T>(acc * inv);
    }
}

FLASHRT_ENTRY(attention_combine, AttentionParams, 256)

#define FLASHRT_ATTN_ENTRY(D, VPL)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_d##D##_bf16(const AttentionParams p) { \
        flashrt::pdl_enter();                                                                  \
        attention_impl<__nv_bfloat16, VPL>(p);                                                      \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_d##D##_f16(const AttentionParams p) {  \
        flashrt::pdl_enter();                                                                  \
        attention_impl<__half, VPL>(p);                                                             \
    }                                                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention_d##D##_f32(const AttentionParams p) {  \
        flashrt::pdl_enter();                                                                  \
        attention_impl<float, VPL>(p);                                                              \
    }

FLASHRT_ATTN_ENTRY(64, 2)
FLASHRT_ATTN_ENTRY(128, 4)
FLASHRT_ATTN_ENTRY(256, 8)
FLASHRT_ATTN_ENTRY(512, 16)
