// flashrt kernels: block-scaled FP8 E4M3 weights (flashrt_ir::WeightQuant) — quantizing and
// dequantizing them while they load, and the per-token activation quantization of FP8
// prefill matmuls.
//
// A quantized weight is a matrix of `rows` x `cols` codes cut into segments of `seg` rows,
// each cut into [br, bc] blocks (ragged at its bottom and right edges); block (b, c) of
// segment g has its f32 scale at row g * ceil(seg / br) + b, column c of a row-major grid with
// ceil(cols / bc) columns. The value of a code is e4m3(code) * scale.
//
// * `fp8_quantize_<T>`: the reference rule of flashrt_runtime::quant, operation for operation
//   (the CPU and this kernel produce the same codes and scales): per block, amax of the
//   values rounded to bf16; scale = bf16(amax / 448) (1 for an all-zero block); code =
//   e4m3_rn(clamp(v / scale, -448, 448)). One CUDA block per scale block (grid: scale rows x
//   scale columns); it reads every
//   element of its block before it writes any, so it may run in place (`values` = `src`).
//   Writes the codes and/or the dequantized values (`values`, in T), and the scale.
// * `fp8_dequant_<T>`: `values[i] = T(v * scale)` with v the code `codes[i]` (a separate
//   code buffer: the prefill fallback's bf16 copy of an FP8 weight) or, without codes, the
//   value `values[i]` already holds (codes converted to T exactly while loading).
// * `fp8_act_quant_<T>`: a prefill chunk's activations x [rows, k] (bf16/f16) to E4M3 codes
//   q [rows, k] with one f32 scale per row and 128 columns, stored [k / 128][rows] (the
//   layout cuBLASLt's VEC128_32F scale mode reads): scale = amax / 448 (1 when all zero),
//   q = e4m3_rn(x / scale). Rows at and past io.len get zero codes and unit scales. One warp
//   per (row, group of 128), 4 elements per lane.
//
// Memory traffic: one read and one write of each element; these run once per load (the
// first two) or once per prefill matmul (the third, rows * k bytes out).
#include "common.cuh"


struct Fp8GridParams {
    unsigned long long rows;
    int cols;
    int seg;
    int br;
    int bc;
    int brows; // ceil(seg / br)
    int bcols; // ceil(cols / bc)
};

struct Fp8QuantizeParams {
    const void* src;
    uint8_t* codes;
    void* values;
    float* scales;
    Fp8GridParams g;
};

template <typename T> static __device__ __forceinline__ void fp8_quantize_impl(const Fp8QuantizeParams& p) {
    __shared__ float red[32];
    const Fp8GridParams& g = p.g;
    const unsigned long long srow = blockIdx.x;
    const int bcol = blockIdx.y;
    const unsigned long long seg = srow / g.brows;
    const unsigned long long r0 = seg * g.seg + (srow % g.brows) * g.br;
    const unsigned long long r1 = min(r0 + (unsigned long long)g.br, (seg + 1) * g.seg);
    const int c0 = bcol * g.bc, c1 = min(c0 + g.bc, g.cols);
    const int w = c1 - c0;
    const int n = (int)(r1 - r0) * w;
    const T* src = static_cast<const T*>(p.src);
    float amax = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const size_t at = (size_t)(r0 + i / w) * g.cols + c0 + i % w;
        amax = fmaxf(amax, fabsf(flashrt::round_bf16(flashrt::to_f32(src[at]))));
    }
    // Block max (exact, order-free).
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (threadIdx.x == 0) red[0] = v;
    }
    __syncthreads();
    amax = red[0];
    const float scale = amax == 0.0f ? 1.0f : flashrt::round_bf16(amax / 448.0f);
    if (threadIdx.x == 0) p.scales[srow * g.bcols + bcol] = scale;
    T* values = static_cast<T*>(p.values);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const size_t at = (size_t)(r0 + i / w) * g.cols + c0 + i % w;
        const float v = flashrt::round_bf16(flashrt::to_f32(src[at]));
        const float x = amax == 0.0f ? v : fminf(fmaxf(v / scale, -448.0f), 448.0f);
        const uint8_t code = flashrt::e4m3_code(x);
        if (p.codes) p.codes[at] = code;
        if (values) values[at] = flashrt::from_f32<T>(flashrt::e4m3_value(code) * scale);
    }
}

FLASHRT_ENTRY(fp8_quantize, Fp8QuantizeParams, 256)

struct Fp8DequantParams {
    const uint8_t* codes;
    void* values;
    const float* scales;
    Fp8GridParams g;
};

template <typename T> static __device__ __forceinline__ void fp8_dequant_impl(const Fp8DequantParams& p) {
    const Fp8GridParams& g = p.g;
    T* values = static_cast<T*>(p.values);
    const unsigned long long n = g.rows * (unsigned long long)g.cols;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned long long r = i / g.cols;
        const int c = (int)(i % g.cols);
        const unsigned long long srow = (r / g.seg) * g.brows + (r % g.seg) / g.br;
        const float s = __ldg(p.scales + srow * g.bcols + c / g.bc);
        const float v = p.codes ? flashrt::e4m3_value(p.codes[i]) : flashrt::to_f32(values[i]);
        values[i] = flashrt::from_f32<T>(v * s);
    }
}

FLASHRT_ENTRY(fp8_dequant, Fp8DequantParams, 256)

struct Fp8ActQuantParams {
    const void* x;
    uint8_t* q;
    float* scales;
    const int* len;
    int ld_x;
    int rows;
    int k;
};

template <typename T> static __device__ __forceinline__ void fp8_act_quant_impl(const Fp8ActQuantParams& p) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = p.k / 128;
    const int gidx = blockIdx.x * (blockDim.x >> 5) + warp;
    const int row = blockIdx.y;
    if (gidx >= groups) return;
    const int len = flashrt::load_len(p.len);
    uint8_t* q = p.q + (size_t)row * p.k + gidx * 128 + lane * 4;
    if (row >= len) {
        *reinterpret_cast<uint32_t*>(q) = 0u;
        if (lane == 0) p.scales[(size_t)gidx * p.rows + row] = 1.0f;
        return;
    }
    const T* x = static_cast<const T*>(p.x) + (size_t)row * p.ld_x + gidx * 128 + lane * 4;
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = flashrt::to_f32(x[e]);
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax == 0.0f ? 1.0f : amax / 448.0f;
    uint32_t packed = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) packed |= (uint32_t)flashrt::e4m3_code(v[e] / scale) << (8 * e);
    *reinterpret_cast<uint32_t*>(q) = packed;
    if (lane == 0) p.scales[(size_t)gidx * p.rows + row] = scale;
}

// Only the 16-bit activation types: f32 targets hold quantized weights dequantized.
extern "C" __global__ void __launch_bounds__(256) fp8_act_quant_bf16(const Fp8ActQuantParams p) {
    flashrt::pdl_enter();
    fp8_act_quant_impl<__nv_bfloat16>(p);
}
extern "C" __global__ void __launch_bounds__(256) fp8_act_quant_f16(const Fp8ActQuantParams p) {
    flashrt::pdl_enter();
    fp8_act_quant_impl<__half>(p);
}
