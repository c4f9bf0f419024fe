// flashrt kernels: warpgroup tensor-core (wgmma) helpers shared by the sm_90a kernels
// (attention_prefill_wgmma.cu, moe_wgmma.cu): shared-memory matrix descriptors with 128-byte
// swizzling, the wgmma fences and group waits, and the proxy fence that makes generic-proxy
// shared-memory writes (cp.async, st.shared) visible to wgmma. Only compiled for sm_90a; the
// compute_90 PTX fallback gets an empty namespace (its entry points trap).
#pragma once
#include "common.cuh"

namespace flashrt_wg {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A shared-memory matrix descriptor with 128-byte swizzling: start address, leading byte offset
// and stride byte offset (all >> 4), swizzle mode 1 in bits 62-63 (PTX ISA "matrix descriptor").
static __device__ __forceinline__ uint64_t desc128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
           (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

static __device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> static __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins registers at this point of the program: reads after it see what an asynchronous wgmma
// wrote once its group was waited for, and writes before it are done when a wgmma is issued.
template <int N> static __device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to wgmma's reads.
static __device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#endif // __CUDA_ARCH_FEAT_SM90_ALL

} // namespace flashrt_wg
