// What the kernel microbenchmarks (gemvm_micro.cu, gdn_micro.cu, moe_micro.cu) share: the CUDA
// error check, the hash their data is drawn from (`micro_fill`), the streaming read they are
// compared with (`micro_readall`), and the per-warp phase probes.
// Include it before the kernel sources: with -DFLASHRT_PROBE it defines kernels/common.cuh's
// FLASHRT_MARK(i) (the timing hooks, empty in the product) to store the warp's %globaltimer in
// slot i (< 10) of its row of `g_probe` (warps in linear block order, 1-D or 2-D grids);
// `probe_run` arms it around one launch and `probe_print` prints each phase as median / last
// warp in microseconds after the first warp's entry (mark 0).
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e = (x);                                                                       \
        if (e != cudaSuccess) {                                                                    \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

// A well-mixed 32-bit value of element i under `seed` (the fill kernels' source of data).
static __device__ __forceinline__ unsigned micro_hash(size_t i, unsigned seed) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    return h;
}

// Uniform in about +-512 * scale, as T (float, bf16, f16): the microbenchmarks' data.
template <typename T> __global__ void micro_fill(T* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (T)(((int)(micro_hash(i, seed) & 1023) - 512) * scale);
}

// Reads `n` 16-byte words once (not kept in L1): the streaming floor a kernel is compared with.
__global__ void micro_readall(const uint4* p, size_t n, unsigned* out) {
    unsigned a = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p + i));
        a ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (a == 0x12345678u) out[0] = a;
}

#ifdef FLASHRT_PROBE
#define MICRO_PROBE_SLOTS 10
__device__ unsigned long long* g_probe;
#define FLASHRT_MARK(i)                                                                            \
    do {                                                                                           \
        if ((threadIdx.x & 31) == 0 && g_probe) {                                                  \
            unsigned long long t_;                                                                 \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                                 \
            const size_t w_ = ((size_t)blockIdx.y * gridDim.x + blockIdx.x) * (blockDim.x >> 5) +  \
                              (threadIdx.x >> 5);                                                  \
            g_probe[w_ * MICRO_PROBE_SLOTS + (i)] = t_;                                            \
        }                                                                                          \
    } while (0)

// The stamps of `warps` warps over one call of `launch()` (which launches and synchronises).
template <typename L> static std::vector<unsigned long long> probe_run(size_t warps, L launch) {
    const size_t n = warps * MICRO_PROBE_SLOTS;
    unsigned long long* pb;
    CK(cudaMalloc(&pb, n * 8));
    CK(cudaMemset(pb, 0, n * 8));
    CK(cudaMemcpyToSymbol(g_probe, &pb, sizeof pb));
    launch();
    unsigned long long* nul = nullptr;
    CK(cudaMemcpyToSymbol(g_probe, &nul, sizeof nul));
    std::vector<unsigned long long> hp(n);
    CK(cudaMemcpy(hp.data(), pb, n * 8, cudaMemcpyDeviceToHost));
    CK(cudaFree(pb));
    return hp;
}

// " name median/last" for marks order[0 .. n) (named names[0 .. n)), then a newline.
static void probe_print(const std::vector<unsigned long long>& hp, const char* const* names, const int* order, int n) {
    const size_t warps = hp.size() / MICRO_PROBE_SLOTS;
    unsigned long long t0 = ~0ull;
    for (size_t w = 0; w < warps; ++w)
        if (hp[w * MICRO_PROBE_SLOTS]) t0 = std::min(t0, hp[w * MICRO_PROBE_SLOTS]);
    for (int k = 0; k < n; ++k) {
        std::vector<double> v;
        for (size_t w = 0; w < warps; ++w)
            if (hp[w * MICRO_PROBE_SLOTS + order[k]]) v.push_back((hp[w * MICRO_PROBE_SLOTS + order[k]] - t0) * 1e-3);
        if (v.empty()) continue;
        std::sort(v.begin(), v.end());
        printf(" %s %.2f/%.2f", names[k], v[v.size() / 2], v.back());
    }
    printf("\n");
}
#endif
