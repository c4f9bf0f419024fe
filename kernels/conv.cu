// flashrt kernels: depthwise causal conv over time with a rolling state (plan op
// `CausalConv1d`).
//
// Per channel c and row r < io.len, with u the input sequence preceded by the K-1 inputs held
// in `state` ([K-1, C], time-major, oldest first):
//     out[r][c] = act(bias[c] + sum_j weight[c][j] * u[r - (K-1) + j][c]).
// Two launches, in stream order, so no block ever reads a state row another block rewrites:
//
// 1. `conv_out`: grid = (channel tiles, rows); thread (r, c) reads K inputs (from x, or from
//    the old state for the first K-1 rows) and writes one output. Coalesced over channels.
// 2. `conv_state`: one thread per channel rolls the state forward to hold the last K-1 inputs
//    of (old state ++ x[0..len]). It writes row s from source row len + s of the concatenated
//    sequence, in ascending s: a state row is only read (index len + s > s) before it is
//    overwritten, so the update is in place.
//
// Memory traffic: x read ~K times (L1/L2 hits after the first), out written once; state
// (K-1) * C elements read and written. Weights and bias are f32; accumulation is f32.
// `out` must not alias `x` (the plan never does).
//
// `conv_vec`: both steps in one launch, for K <= CONV_KMAX and views the host has proved
// 16-byte aligned (x, out and state addresses; strides and C multiples of the pack N = 8
// bf16/f16 or 4 f32 channels). grid = (C / (32 N), row blocks of CONV_WARPS * CONV_ROWS), 256
// threads. The block first stages its 32 N channels' taps and bias in shared memory,
// transposed to [tap][channel] (the [C, K] weight rows are 16 bytes apart per channel, which
// scalar per-thread loads would fetch as 32 lines per warp instruction); taps are left-padded
// with zeros to CONV_KMAX, so out[r] = act(bias + sum_{j < CONV_KMAX} w'[j] u[r - 3 + j])
// adds exact zeros first and then the K real taps in the scalar kernel's order. Lane l of warp
// w then owns channels [32 N bx + N l, +N) for rows [r0, r0 + CONV_ROWS), r0 = (by
// CONV_WARPS + w) CONV_ROWS: it loads the CONV_ROWS + CONV_KMAX - 1 packs of its input window
// (x rows, or state rows for times < 0; none past len) before the barrier, so a decode step
// costs one memory latency, and slides the taps over them in registers. x is read
// (CONV_ROWS + 3) / CONV_ROWS times from L2 and about once from HBM.
//
// State roll in the same launch: state (time < 0) is read only by warp 0 of row block 0 (r0 =
// 0), so that thread alone rewrites its channels' state, after its own loads. Row s of the new
// state is time len - (K-1) + s: taken from its registers when that time is inside its window
// (always for len <= CONV_ROWS, e.g. decode), else from x rows it loads up front with the
// window.
#include "common.cuh"

struct ConvParams {
    const void* x;
    void* out;
    const float* weight; // [C, K]
    const float* bias;   // [C] or null
    void* state;         // [K-1, C]
    const int* len;
    int ld_x;
    int ld_out;
    int channels;
    int kernel;
    int act;
};

template <typename T> static __device__ __forceinline__ void conv_out_impl(const ConvParams& p) {
    const int row = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= flashrt::load_len(p.len) || c >= p.channels) return;
    const int K = p.kernel;
    const T* x = static_cast<const T*>(p.x);
    const T* st = static_cast<const T*>(p.state);
    float acc = p.bias ? p.bias[c] : 0.0f;
    for (int j = 0; j < K; ++j) {
        const int t = row - (K - 1) + j; // time index; < 0 reads the state
        const float u = t >= 0 ? flashrt::to_f32(x[(size_t)t * p.ld_x + c])
                               : flashrt::to_f32(st[(size_t)(K - 1 + t) * p.channels + c]);
        acc += p.weight[(size_t)c * K + j] * u;
    }
    static_cast<T*>(p.out)[(size_t)row * p.ld_out + c] = flashrt::from_f32<T>(flashrt::apply_act(p.act, acc));
}

FLASHRT_ENTRY(conv_out, ConvParams, 256)

template <typename T> static __device__ __forceinline__ void conv_state_impl(const ConvParams& p) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= p.channels) return;
    const int len = flashrt::load_len(p.len);
    const int K1 = p.kernel - 1;
    const T* x = static_cast<const T*>(p.x);
    T* st = static_cast<T*>(p.state);
    for (int s = 0; s < K1; ++s) {
        // Row s of the new state is element len + s of (old state ++ x), i.e. time len + s - K1.
        const int t = len + s - K1;
        const T v = t >= 0 ? x[(size_t)t * p.ld_x + c] : st[(size_t)(K1 + t) * p.channels + c];
        st[(size_t)s * p.channels + c] = v;
    }
}

FLASHRT_ENTRY(conv_state, ConvParams, 256)

// Taps held per thread (kernels up to 4 wide: Qwen3.5/3.6 and Mamba2 use 4), rows per warp and
// warps (row chunks) per block of the vector kernel.
#define CONV_KMAX 4
#define CONV_ROWS 8
#define CONV_WARPS 8

template <typename T> static __device__ __forceinline__ void conv_vec_impl(const ConvParams& p) {
    constexpr int N = flashrt::Pack16<T>::N;
    constexpr int TC = 32 * N;                       // channels per block
    constexpr int W = CONV_ROWS + CONV_KMAX - 1;     // window: times r0 - 3 .. r0 + CONV_ROWS - 1
    __shared__ float taps[CONV_KMAX + 1][32 * 8];    // padded taps, then bias; [.][channel]
    const int len = flashrt::load_len(p.len);
    const int K = p.kernel, K1 = K - 1, C = p.channels;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cb = blockIdx.x * TC;
    const int c0 = cb + lane * N;
    const int r0 = (blockIdx.y * CONV_WARPS + warp) * CONV_ROWS;
    const bool active = c0 < C && r0 < len;
    const bool roll = active && r0 == 0;
    const T* x = static_cast<const T*>(p.x);
    T* st = static_cast<T*>(p.state);

    // Input window (zeros before the state's oldest row and from len on; never read then).
    uint4 win[W];
#pragma unroll
    for (int m = 0; m < W; ++m) {
        const int t = r0 - (CONV_KMAX - 1) + m;
        win[m] = make_uint4(0, 0, 0, 0);
        if (active && t < len) {
            if (t >= 0)
                win[m] = flashrt::ld16(x + (size_t)t * p.ld_x + c0);
            else if (t >= -K1)
                win[m] = flashrt::ld16(st + (size_t)(K1 + t) * C + c0);
        }
    }
    // New state rows whose time lies past the window (only when len > CONV_ROWS).
    uint4 late[CONV_KMAX - 1];
#pragma unroll
    for (int s = 0; s < CONV_KMAX - 1; ++s) {
        const int t = len - K1 + s;
        late[s] = make_uint4(0, 0, 0, 0);
        if (roll && s < K1 && t >= CONV_ROWS) late[s] = flashrt::ld16(x + (size_t)t * p.ld_x + c0);
    }

    // Stage taps (left-padded with zeros) and bias for the block's channels.
    for (int i = threadIdx.x; i < CONV_KMAX * TC; i += blockDim.x) {
        const int j = i / TC, ch = i % TC, c = cb + ch;
        const int tap = j - (CONV_KMAX - K);
        taps[j][ch] = tap >= 0 && c < C ? p.weight[(size_t)c * K + tap] : 0.0f;
    }
    for (int ch = threadIdx.x; ch < TC; ch += blockDim.x)
        taps[CONV_KMAX][ch] = p.bias && cb + ch < C ? p.bias[cb + ch] : 0.0f;
    __syncthreads();
    if (!active) return;

    float w[CONV_KMAX][N], b[N];
#pragma unroll
    for (int e = 0; e < N; ++e) {
#pragma unroll
        for (int j = 0; j < CONV_KMAX; ++j) w[j][e] = taps[j][lane * N + e];
        b[e] = taps[CONV_KMAX][lane * N + e];
    }
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int i = 0; i < CONV_ROWS; ++i) {
        const int r = r0 + i;
        if (r < len) {
            float acc[N];
#pragma unroll
            for (int e = 0; e < N; ++e) acc[e] = b[e];
#pragma unroll
            for (int j = 0; j < CONV_KMAX; ++j) {
                float u[N];
                flashrt::unpack16<T>(win[i + j], u);
#pragma unroll
                for (int e = 0; e < N; ++e) acc[e] += w[j][e] * u[e];
            }
#pragma unroll
            for (int e = 0; e < N; ++e) acc[e] = flashrt::apply_act(p.act, acc[e]);
            flashrt::st16(out + (size_t)r * p.ld_out + c0, flashrt::pack16<T>(acc));
        }
    }

    if (!roll) return;
    // Row s of the new state = time len - K1 + s (in [-K1, len), all read above): from the
    // window slot of that time (slot m holds time m - 3; a constant index per slot keeps the
    // window in registers) or from `late`.
#pragma unroll
    for (int m = 0; m < W; ++m) {
        const int t = m - (CONV_KMAX - 1), s = t - (len - K1);
        if (s >= 0 && s < K1 && t < len) flashrt::st16(st + (size_t)s * C + c0, win[m]);
    }
#pragma unroll
    for (int s = 0; s < CONV_KMAX - 1; ++s) {
        if (s < K1 && len - K1 + s >= CONV_ROWS) flashrt::st16(st + (size_t)s * C + c0, late[s]);
    }
}

FLASHRT_ENTRY(conv_vec, ConvParams, 256)
