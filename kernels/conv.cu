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
