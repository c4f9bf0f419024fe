// flashrt kernels: element-wise ops (plan ops `Mul`, `Unary`, `SplitHeads`, `StoreLastRow`,
// `LoadState`, and the bias add of `Linear`).
//
// All are memory-bound copies with a little arithmetic: grid = (column tiles, rows), 256
// threads, one element per thread per tile; rows >= io.len exit. Each output element is
// computed from inputs at the same (row, column) by the same thread, so `out` may alias an
// input (the plan allows `out == x` / `out == gate`).
//
// `mul_vec` / `unary_vec` are the same ops over 16-byte packs (8 bf16/f16 or 4 f32 elements per
// thread), for views the host has proved aligned (every address 16-byte aligned, strides and
// width multiples of the pack). They flatten (row, pack) into one 1-D grid of 256-thread
// blocks sized for the bucket's rows, so a wide row (SwiGLU's 17408 columns) has no tail tile
// and a decode step launches ceil(width / (256 N)) blocks. Scalar 2-byte accesses move 64
// bytes per warp load; 16-byte packs move 512 and keep enough bytes in flight for HBM.
//
// mul:         out = act(gate) * x
// unary:       out = act(x)
// add_bias:    out += bias (f32 bias, one per column; used after the cuBLASLt GEMM)
// split_heads: de-interleave per-head parts (Qwen3.5's [query | gate] per head)
//
// Memory traffic: each input element read once, each output written once.
#include "common.cuh"

struct MulParams {
    const void* gate;
    const void* x;
    void* out;
    const int* len;
    int ld_gate;
    int ld_x;
    int ld_out;
    int width;
    int act;
};

template <typename T> static __device__ __forceinline__ void mul_impl(const MulParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.width) return;
    const float g = flashrt::to_f32(static_cast<const T*>(p.gate)[(size_t)row * p.ld_gate + c]);
    const float x = flashrt::to_f32(static_cast<const T*>(p.x)[(size_t)row * p.ld_x + c]);
    static_cast<T*>(p.out)[(size_t)row * p.ld_out + c] = flashrt::from_f32<T>(flashrt::apply_act(p.act, g) * x);
}

FLASHRT_ENTRY(mul, MulParams, 256)

// mul_rowgate: out[r, c] = act(gate[r]) * x[r, c], one gate per row (a gate view of width 1:
// the MoE shared expert's token gate). grid = (column tiles, rows).
template <typename T> static __device__ __forceinline__ void mul_rowgate_impl(const MulParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.width) return;
    const float g = flashrt::to_f32(static_cast<const T*>(p.gate)[(size_t)row * p.ld_gate]);
    const float x = flashrt::to_f32(static_cast<const T*>(p.x)[(size_t)row * p.ld_x + c]);
    static_cast<T*>(p.out)[(size_t)row * p.ld_out + c] = flashrt::from_f32<T>(flashrt::apply_act(p.act, g) * x);
}

FLASHRT_ENTRY(mul_rowgate, MulParams, 256)

// Thread i of the 1-D grid handles pack i % (width / N) of row i / (width / N).
template <typename T> static __device__ __forceinline__ void mul_vec_impl(const MulParams& p) {
    constexpr int N = flashrt::Pack16<T>::N;
    int row, c;
    flashrt::pack_of_thread<N>(p.width, row, c);
    if (row >= flashrt::load_len(p.len)) return;
    float g[N], x[N], o[N];
    flashrt::unpack16<T>(flashrt::ld16(static_cast<const T*>(p.gate) + (size_t)row * p.ld_gate + c), g);
    flashrt::unpack16<T>(flashrt::ld16(static_cast<const T*>(p.x) + (size_t)row * p.ld_x + c), x);
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] = flashrt::apply_act(p.act, g[e]) * x[e];
    flashrt::st16(static_cast<T*>(p.out) + (size_t)row * p.ld_out + c, flashrt::pack16<T>(o));
}

FLASHRT_ENTRY(mul_vec, MulParams, 256)

struct UnaryParams {
    const void* x;
    void* out;
    const int* len;
    int ld_x;
    int ld_out;
    int width;
    int act;
};

template <typename T> static __device__ __forceinline__ void unary_impl(const UnaryParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.width) return;
    const float x = flashrt::to_f32(static_cast<const T*>(p.x)[(size_t)row * p.ld_x + c]);
    static_cast<T*>(p.out)[(size_t)row * p.ld_out + c] = flashrt::from_f32<T>(flashrt::apply_act(p.act, x));
}

FLASHRT_ENTRY(unary, UnaryParams, 256)

// As `mul_vec`: one 16-byte pack per thread of a 1-D grid over (row, pack).
template <typename T> static __device__ __forceinline__ void unary_vec_impl(const UnaryParams& p) {
    constexpr int N = flashrt::Pack16<T>::N;
    int row, c;
    flashrt::pack_of_thread<N>(p.width, row, c);
    if (row >= flashrt::load_len(p.len)) return;
    float x[N];
    flashrt::unpack16<T>(flashrt::ld16(static_cast<const T*>(p.x) + (size_t)row * p.ld_x + c), x);
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = flashrt::apply_act(p.act, x[e]);
    flashrt::st16(static_cast<T*>(p.out) + (size_t)row * p.ld_out + c, flashrt::pack16<T>(x));
}

FLASHRT_ENTRY(unary_vec, UnaryParams, 256)

struct AddBiasParams {
    void* out;
    const float* bias;
    const int* len;
    int ld_out;
    int width;
};

template <typename T> static __device__ __forceinline__ void add_bias_impl(const AddBiasParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.width) return;
    T* o = static_cast<T*>(p.out) + (size_t)row * p.ld_out + c;
    *o = flashrt::from_f32<T>(flashrt::to_f32(*o) + p.bias[c]);
}

FLASHRT_ENTRY(add_bias, AddBiasParams, 256)

#define FLASHRT_MAX_PARTS 4

struct SplitHeadsParams {
    const void* x;
    void* out[FLASHRT_MAX_PARTS];
    const int* len;
    int ld_x;
    int ld_out[FLASHRT_MAX_PARTS];
    int part[FLASHRT_MAX_PARTS]; // per-head width of each part
    int nparts;
    int heads;
};

// grid = (heads, rows): block (h, r) copies head h's parts of row r.
template <typename T> static __device__ __forceinline__ void split_heads_impl(const SplitHeadsParams& p) {
    const int h = blockIdx.x, row = blockIdx.y;
    if (row >= flashrt::load_len(p.len)) return;
    // Loops over parts are unrolled to the compile-time bound so the parameter arrays are
    // indexed by constants (no local-memory copy of the struct).
    int per_head = 0;
#pragma unroll
    for (int i = 0; i < FLASHRT_MAX_PARTS; ++i)
        if (i < p.nparts) per_head += p.part[i];
    const T* src = static_cast<const T*>(p.x) + (size_t)row * p.ld_x + (size_t)h * per_head;
    int off = 0;
#pragma unroll
    for (int i = 0; i < FLASHRT_MAX_PARTS; ++i) {
        if (i < p.nparts) {
            T* dst = static_cast<T*>(p.out[i]) + (size_t)row * p.ld_out[i] + (size_t)h * p.part[i];
            for (int c = threadIdx.x; c < p.part[i]; c += blockDim.x) dst[c] = src[off + c];
            off += p.part[i];
        }
    }
}

FLASHRT_ENTRY(split_heads, SplitHeadsParams, 256)

// store_last_row: state[0 .. width] = x[len - 1, :] (plan op `StoreLastRow`: the MTP head's
// input hidden state). One block; reads len from the device like every kernel.
// load_state: out[r, :] = state[0 .. width] for rows r < len (plan op `LoadState`).
// grid = (column tiles, rows).
struct RowStateParams {
    const void* x;  // store: source view; load: unused
    void* out;      // load: destination view; store: unused
    void* state;    // [width]
    const int* len;
    int ld;         // row stride of the view
    int width;
    const unsigned long long* slots; // store, batched step (common.cuh): every row r < len goes
                                     // to its own session's state (grid (1, rows)); else null
};

template <typename T> static __device__ __forceinline__ void store_last_row_impl(const RowStateParams& p) {
    const int len = flashrt::load_len(p.len);
    if (len < 1) return;
    // A batched step's rows are sessions of one row each: row blockIdx.y is its session's last.
    const int row = p.slots ? (int)blockIdx.y : len - 1;
    if (row >= len) return;
    const T* src = static_cast<const T*>(p.x) + (size_t)row * p.ld;
    T* dst = flashrt::in_slot(static_cast<T*>(p.state), p.slots, row);
    for (int c = threadIdx.x; c < p.width; c += blockDim.x) dst[c] = src[c];
}

FLASHRT_ENTRY(store_last_row, RowStateParams, 256)

template <typename T> static __device__ __forceinline__ void load_state_impl(const RowStateParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.width) return;
    static_cast<T*>(p.out)[(size_t)row * p.ld + c] = static_cast<const T*>(p.state)[c];
}

FLASHRT_ENTRY(load_state, RowStateParams, 256)
