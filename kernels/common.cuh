// flashrt kernels: shared device helpers.
//
// Every kernel file includes this header. The build compiles all kernels/*.cu as ONE
// translation unit (flashrt-runtime/build.rs generates an umbrella file), so helpers here are
// `static __device__ __forceinline__` and guarded against double inclusion.
//
// Conventions every kernel follows:
// * framework-free: raw pointers, explicit sizes, one `#[repr(C)]`-mirrored parameter struct
//   per kernel passed by value (the Rust side is flashrt-runtime/src/backend/cuda/ops.rs);
// * entry points are `extern "C" __global__ <op>_<dtype>` with dtype in {bf16, f16, f32}: the
//   element type of activations, weights, KV and conv state (the layout's target dtype);
//   recurrent state, norm scales and other small parameters are always f32; all arithmetic
//   accumulates in f32;
// * the chunk position and length are read from device scalars (`io.pos`, `io.len`), never
//   from kernel arguments, so a captured CUDA graph replays at any position. Grids are sized
//   for the plan's bucket rows; blocks whose row is >= len return at once;
// * activation views are row-major `[rows, ld]` windows: element (r, c) is at `p[r * ld + c]`,
//   where the Rust side has already added the view's column offset to the pointer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace flashrt {

// ---- element conversion ---------------------------------------------------------------

static __device__ __forceinline__ float to_f32(float v) { return v; }
static __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T> static __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// ---- activations (must match flashrt_ir::plan::Act) ------------------------------------

enum ActKind : int { ACT_IDENTITY = 0, ACT_SILU = 1, ACT_SIGMOID = 2, ACT_RELU2 = 3 };

static __device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

static __device__ __forceinline__ float apply_act(int act, float x) {
    switch (act) {
    case ACT_SILU: return x * sigmoidf_(x);
    case ACT_SIGMOID: return sigmoidf_(x);
    case ACT_RELU2: { float r = x > 0.0f ? x : 0.0f; return r * r; }
    default: return x;
    }
}

// softplus(x) = log(1 + e^x), linear above 20 (as torch.nn.functional.softplus).
static __device__ __forceinline__ float softplusf_(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// ---- reductions -------------------------------------------------------------------------

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the
// result. `scratch` holds at least 32 floats; the call ends with a barrier after which
// `scratch` may be reused.
static __device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// Device scalars of the I/O arena (see flashrt_ir::plan): number of valid rows and the
// absolute position of the chunk's first token.
static __device__ __forceinline__ int load_len(const int* len) { return __ldg(len); }
static __device__ __forceinline__ int load_pos(const int* pos) { return __ldg(pos); }

} // namespace flashrt

// Instantiate an `extern "C"` entry point `<name>_<dtype>` for each element type from a
// template kernel body `name##_impl<T>(P)`, where P is the kernel's parameter struct.
#define FLASHRT_ENTRY(name, Params, bounds)                                                   \
    extern "C" __global__ void __launch_bounds__(bounds) name##_bf16(const Params p) {       \
        name##_impl<__nv_bfloat16>(p);                                                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bounds) name##_f16(const Params p) {        \
        name##_impl<__half>(p);                                                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bounds) name##_f32(const Params p) {        \
        name##_impl<float>(p);                                                                \
    }
