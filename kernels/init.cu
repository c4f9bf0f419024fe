// flashrt kernels: deterministic random weights generated in place (`Backend::load_random`), and
// the dtype conversion of checkpoint tensors stored in another float type than the model.
//
// Reproduces `flashrt_runtime::init::Init::value` element for element: the value of element i
// of buffer b is a pure function of (seed, b, i) — SplitMix64's finaliser over a counter — so
// a grid-stride loop can generate any buffer in any order, and the CUDA backend gets the same
// weights as the CPU reference (computed in f64 here and there, then rounded to the buffer's
// dtype) without staging tens of gigabytes on the host.
//
// kind 0: mean + std * N(0,1) (Box-Muller), 1: U(lo, hi), 2: log U(lo, hi),
// 3: softplus^-1 of a log-uniform dt in [lo, hi].
//
// Memory traffic: one write per element; compute-bound on f64 transcendental functions, a few
// milliseconds per gigabyte on an H200.
#include "common.cuh"

struct InitParams {
    void* out;
    unsigned long long n;
    unsigned long long seed;
    unsigned int buffer;
    unsigned int kind;
    double a;
    double b;
};

static __device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static __device__ __forceinline__ double unit(unsigned long long key, unsigned long long k) {
    return ((double)(mix64(key ^ k) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

template <typename T> static __device__ __forceinline__ void init_random_impl(const InitParams& p) {
    const unsigned long long key = mix64(p.seed ^ mix64(((unsigned long long)p.buffer << 1) | 1ULL));
    T* out = static_cast<T*>(p.out);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        const double u1 = unit(key, 2 * i), u2 = unit(key, 2 * i + 1);
        double v;
        switch (p.kind) {
        case 0: v = p.a + p.b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2); break;
        case 1: v = p.a + (p.b - p.a) * u1; break;
        case 2: v = log(p.a + (p.b - p.a) * u1); break;
        default: {
            const double dt = exp(log(p.a) + (log(p.b) - log(p.a)) * u1);
            v = dt + log(-expm1(-dt));
        }
        }
        out[i] = flashrt::from_f32<T>((float)v);
    }
}

FLASHRT_ENTRY(init_random, InitParams, 256)

// Checkpoint tensors stored in another float type than the model's: elements [0, n) of `in`
// (src_kind 0: f32, 1: f16, 2: bf16, 3: f64, 4: FP8 E4M3 codes, their exact unscaled values)
// converted to T at `out` (through f32, rounding to nearest even; f64 rounds to f32 first, as
// the host loader does). One read and one write
// per element: a staging piece of 32 MiB converts in a few microseconds.
struct ConvertParams {
    void* out;
    const void* in;
    unsigned long long n;
    unsigned int src_kind;
    unsigned int pad;
};

template <typename T> static __device__ __forceinline__ void convert_impl(const ConvertParams& p) {
    T* out = static_cast<T*>(p.out);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += stride) {
        float v;
        switch (p.src_kind) {
        case 0: v = static_cast<const float*>(p.in)[i]; break;
        case 1: v = __half2float(static_cast<const __half*>(p.in)[i]); break;
        case 2: v = __bfloat162float(static_cast<const __nv_bfloat16*>(p.in)[i]); break;
        case 4: v = flashrt::e4m3_value(static_cast<const uint8_t*>(p.in)[i]); break;
        default: v = (float)static_cast<const double*>(p.in)[i];
        }
        out[i] = flashrt::from_f32<T>(v);
    }
}

FLASHRT_ENTRY(convert, ConvertParams, 256)
