// Microbenchmark of a weight-streaming matmul for prefill chunks of 16 to 64 rows (a stored
// prompt's short suffix), on the Qwen3.6-27B shape's matrices, against the streaming floor.
// What it is for: in a 32-row chunk the cuBLASLt matmuls stream the 27B weights at 67-91 % of
// the copy bandwidth on the H100 (the N = 5120 outputs worst: o_proj 67 %, out_proj 72 %,
// down 84 %; benches/RESULTS.md 2026-12-07 22:14), with no programmatic dependent launch at
// any boundary. Before writing such a kernel into the product (fused norm prologue, SwiGLU
// epilogue, PDL, as gemv_mma.cu does for <= 8 rows), this measures whether the design streams
// near the floor. Not used by flashrt.
//
// Design (`skinny<R>`): out[r][n] = sum_k x[r][k] w[n][k], bf16 in, f32 accumulation, bf16 out.
// A step is 128 weight rows (a tile group: 8 warps x 16 rows, the MMA's m) by 128 columns of k;
// the chunk's R rows are the MMA's n (R / 8 MMAs m16n8k16 per 16 columns). Stream-K over
// blocks (one per SM): the S = groups x k / 128 steps, group-major, are dealt to the blocks as
// equal contiguous ranges, so every block streams the same bytes; within a block all 8 warps
// work on the same step, so the step's R x 128 inputs are staged once per block (R x 256 B
// against 32 KiB of weights: the inputs cost 25 % extra L2 reads at R = 32, where a per-warp
// stream-K as gemv_mma.cu's would read them per warp: 2x the weight bytes). Weights and inputs
// travel by cp.async (16 B, L1 bypassed; kernels/common.cuh's helpers, as the product's
// tensor-core kernels use them) into a ring of STAGES steps in shared memory, rows of
// 256 B with their 16-byte chunks swizzled (chunk c of row r at c ^ (r & 7)) so the ldmatrix
// reads are conflict-free. A group whose steps all fall to one block is stored by it; a group
// split between blocks leaves each block's share as f32 partial sums (at most 2 per block: the
// group its range starts in and the one it ends in), summed in block order by `skinny_reduce`,
// a second launch (a fixed order: results do not depend on timing).
//
//   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
//       -L .venv/nvcc/cuda/lib -o .gpu/extra/skinny_micro benches/kernels/skinny_micro.cu
//   (carry it packed with the rest: tar ... .gpu/extra into .gpupack/p.tar.xz)
//   ./skinny_micro          (SK_ITERS=n launches timed per case, default 20)
//
// Prints per shape and R: us per matmul (both launches), weight TB/s, the fraction of the
// streaming read of the same bytes (micro_readall), and the largest difference from a naive
// f32 reference relative to its largest output.
#include "micro.cuh"
#include "common.cuh"
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>

#define SK_BN 128     // weight rows a step (8 warps x 16)
#define SK_BK 128     // columns of k a step (256 bytes of bf16)
#define SK_WARPS 8
#define SK_STAGES 4

template <int R> struct SkinnyShape {
    static constexpr int W_BYTES = SK_BN * SK_BK * 2;
    static constexpr int X_BYTES = R * SK_BK * 2;
    static constexpr int STAGE = W_BYTES + X_BYTES;
    static constexpr int SMEM = SK_STAGES * STAGE;
};

struct SkinnyParams {
    const __nv_bfloat16* w; // [n][k]
    const __nv_bfloat16* x; // [R][k]
    __nv_bfloat16* out;     // [R][n]
    float* part;            // [blocks][2][R][SK_BN]
    int n, k;
};

// Byte offset of 16-byte chunk c of row r in a swizzled tile of 256-byte rows.
static __device__ __forceinline__ uint32_t sk_off(int r, int c) {
    return (uint32_t)(r * 256 + ((c ^ (r & 7)) << 4));
}

// The block owning global step a: the largest b with floor(b S / B) <= a.
static __device__ __forceinline__ int sk_owner(long long a, long long S, long long B) {
    return (int)(((a + 1) * B + S - 1) / S - 1);
}

template <int R>
__global__ void __launch_bounds__(SK_WARPS * 32, 1) skinny(const SkinnyParams p) {
    using Sh = SkinnyShape<R>;
    extern __shared__ __align__(128) unsigned char sk_buf[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ks = p.k / SK_BK;
    const int groups = (p.n + SK_BN - 1) / SK_BN;
    const long long S = (long long)groups * ks, B = gridDim.x;
    const int s0 = (int)(blockIdx.x * S / B), s1 = (int)((blockIdx.x + 1) * S / B);
    if (s0 >= s1) return;
    const uint32_t base = flashrt::smem_u32(sk_buf);

    // Issue step s into stage `st`: 128 weight rows x 16 chunks and R input rows x 16 chunks.
    auto issue = [&](int s, int st) {
        const int g = s / ks, kc = s % ks;
        const uint32_t ws = base + st * Sh::STAGE, xs = ws + Sh::W_BYTES;
#pragma unroll
        for (int i = 0; i < SK_BN * 16 / (SK_WARPS * 32); ++i) {
            const int c = tid + i * SK_WARPS * 32, row = c >> 4, ch = c & 15;
            const int n = g * SK_BN + row;
            const bool ok = n < p.n;
            flashrt::cp_async16(ws + sk_off(row, ch), p.w + (size_t)(ok ? n : 0) * p.k + (size_t)kc * SK_BK + ch * 8, ok);
        }
#pragma unroll
        for (int i = 0; i < (R * 16 + SK_WARPS * 32 - 1) / (SK_WARPS * 32); ++i) {
            const int c = tid + i * SK_WARPS * 32;
            if (c < R * 16) {
                const int row = c >> 4, ch = c & 15;
                flashrt::cp_async16(xs + sk_off(row, ch), p.x + (size_t)row * p.k + (size_t)kc * SK_BK + ch * 8, true);
            }
        }
    };

    float acc[R / 8][4];
#pragma unroll
    for (int j = 0; j < R / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const int gq = lane >> 2, tq = lane & 3;
    const int mi = lane >> 3, mr = lane & 7; // ldmatrix: matrix and row this lane addresses

#pragma unroll
    for (int i = 0; i < SK_STAGES - 1; ++i) {
        if (s0 + i < s1) issue(s0 + i, i);
        flashrt::cp_async_commit();
    }
    for (int s = s0; s < s1; ++s) {
        const int i = s - s0;
        flashrt::cp_async_wait<SK_STAGES - 2>();
        __syncthreads();
        // The stage step i - 1 used is free: refill it with step i + STAGES - 1.
        if (s + SK_STAGES - 1 < s1) issue(s + SK_STAGES - 1, (i + SK_STAGES - 1) % SK_STAGES);
        flashrt::cp_async_commit();
        const uint32_t ws = base + (i % SK_STAGES) * Sh::STAGE, xs = ws + Sh::W_BYTES;
#pragma unroll
        for (int kk = 0; kk < SK_BK / 16; ++kk) {
            uint32_t a[4];
            // A (16 weight rows x 16 columns): matrices rows 0-7 / 8-15 x chunks 2kk / 2kk + 1.
            flashrt::ldsm_x4(a, ws + sk_off(warp * 16 + (mi & 1) * 8 + mr, 2 * kk + (mi >> 1)));
#pragma unroll
            for (int nb = 0; nb < R / 8; nb += 2) {
                // B of two 8-row column tiles: matrices (rows nb, chunk 2kk), (nb, 2kk + 1),
                // (nb + 1, 2kk), (nb + 1, 2kk + 1).
                uint32_t b[4];
                flashrt::ldsm_x4(b, xs + sk_off((nb + (mi >> 1)) * 8 + mr, 2 * kk + (mi & 1)));
                flashrt::Mma<__nv_bfloat16>::run(acc[nb], a, b[0], b[1]);
                flashrt::Mma<__nv_bfloat16>::run(acc[nb + 1], a, b[2], b[3]);
            }
        }
        // The end of a group's segment: store it whole, or leave this block's share.
        const int g = s / ks;
        if ((s + 1) % ks == 0 || s + 1 == s1) {
            const bool whole = max(s0, g * ks) == g * ks && s + 1 == (g + 1) * ks;
            const int slot = g == s0 / ks ? 0 : 1;
#pragma unroll
            for (int nb = 0; nb < R / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = warp * 16 + gq + 8 * (e >> 1), r = nb * 8 + 2 * tq + (e & 1);
                    const int n = g * SK_BN + row;
                    if (whole) {
                        if (n < p.n) p.out[(size_t)r * p.n + n] = __float2bfloat16(acc[nb][e]);
                    } else {
                        p.part[(((size_t)blockIdx.x * 2 + slot) * R + r) * SK_BN + row] = acc[nb][e];
                    }
                    acc[nb][e] = 0.0f;
                }
        }
    }
    flashrt::cp_async_wait<0>();
}

// The groups split between blocks: their shares summed in block order.
template <int R> __global__ void skinny_reduce(const SkinnyParams p, int blocks) {
    const int g = blockIdx.x, row = threadIdx.x, n = g * SK_BN + row;
    const int ks = p.k / SK_BK, groups = (p.n + SK_BN - 1) / SK_BN;
    const long long S = (long long)groups * ks;
    const int b_lo = sk_owner((long long)g * ks, S, blocks), b_hi = sk_owner((long long)(g + 1) * ks - 1, S, blocks);
    if (b_lo == b_hi || n >= p.n) return;
    for (int r = 0; r < R; ++r) {
        float sum = 0.0f;
        for (int b = b_lo; b <= b_hi; ++b) {
            const int first = (int)((long long)b * S / blocks) / ks;
            const int slot = g == first ? 0 : 1;
            sum += p.part[(((size_t)b * 2 + slot) * R + r) * SK_BN + row];
        }
        p.out[(size_t)r * p.n + n] = __float2bfloat16(sum);
    }
}

// f32 reference, one warp an output (lanes stride over k: coalesced rows).
__global__ void skinny_ref(const __nv_bfloat16* w, const __nv_bfloat16* x, float* out, int rows, int n, int k) {
    const size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (i >= (size_t)rows * n) return;
    const int r = (int)(i / n), j = (int)(i % n);
    float s = 0.0f;
    for (int c = lane; c < k; c += 32) s += __bfloat162float(x[(size_t)r * k + c]) * __bfloat162float(w[(size_t)j * k + c]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[i] = s;
}

template <int R>
static void run_case(const char* name, int n, int k, int sms, int iters, const std::vector<__nv_bfloat16*>& ws,
                     __nv_bfloat16* x, __nv_bfloat16* out, float* part, float* ref, unsigned* sink) {
    using Sh = SkinnyShape<R>;
    CK(cudaFuncSetAttribute(skinny<R>, cudaFuncAttributeMaxDynamicSharedMemorySize, Sh::SMEM));
    const int groups = (n + SK_BN - 1) / SK_BN;
    auto launch = [&](int copy) {
        SkinnyParams p{ws[copy], x, out, part, n, k};
        skinny<R><<<sms, SK_WARPS * 32, Sh::SMEM>>>(p);
        skinny_reduce<R><<<groups, SK_BN>>>(p, sms);
    };
    // Correctness on copy 0.
    launch(0);
    CK(cudaGetLastError());
    skinny_ref<<<(unsigned)(((size_t)R * n * 32 + 255) / 256), 256>>>(ws[0], x, ref, R, n, k);
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> ho((size_t)R * n);
    std::vector<float> hr((size_t)R * n);
    CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr.data(), ref, hr.size() * 4, cudaMemcpyDeviceToHost));
    double dmax = 0, rmax = 0;
    for (size_t i = 0; i < hr.size(); ++i) {
        dmax = std::max(dmax, (double)std::fabs(__bfloat162float(ho[i]) - hr[i]));
        rmax = std::max(rmax, (double)std::fabs(hr[i]));
    }
    // Timing: back to back over the weight copies (more bytes than L2 holds).
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) launch(i % ws.size());
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) launch(i % ws.size());
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = ms * 1e3 / iters;
    const double bytes = (double)n * k * 2;
    // The streaming floor: the same bytes read once per launch.
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i)
        micro_readall<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(ws[i % ws.size()]), (size_t)n * k * 2 / 16, sink);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms_read = 0;
    CK(cudaEventElapsedTime(&ms_read, e0, e1));
    const double us_read = ms_read * 1e3 / iters;
    printf("%-10s n %6d k %6d R %2d: %8.1f us  %5.2f TB/s  %5.1f %% of the streaming read (%.1f us)  max diff %.2e of %.2e\n",
           name, n, k, R, us, bytes / us * 1e-6, 100.0 * us_read / us, us_read, dmax / rmax, rmax);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
}

int main() {
    int dev = 0, sms = 0;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int iters = getenv("SK_ITERS") ? atoi(getenv("SK_ITERS")) : 20;
    struct Shape {
        const char* name;
        int n, k;
    };
    // The 27B shape's prefill matmuls as the grouped layout runs them.
    const Shape shapes[] = {
        {"mlp_gu", 34816, 5120}, {"down", 5120, 17408}, {"gdn_in", 16480, 5120}, {"out_proj", 5120, 6144},
        {"attn_in", 14336, 5120},
    };
    size_t most = 0;
    for (const Shape& s : shapes) most = std::max(most, (size_t)s.n * s.k);
    const int copies = 4;
    std::vector<__nv_bfloat16*> ws(copies);
    for (int c = 0; c < copies; ++c) {
        CK(cudaMalloc(&ws[c], most * 2));
        micro_fill<<<1024, 256>>>(ws[c], most, 7 + c, 1.0f / 4096);
    }
    const int kmax = 17408, rmax = 64, nmax = 34816;
    __nv_bfloat16 *x, *out;
    float *part, *ref;
    unsigned* sink;
    CK(cudaMalloc(&x, (size_t)rmax * kmax * 2));
    micro_fill<<<1024, 256>>>(x, (size_t)rmax * kmax, 99, 1.0f / 512);
    CK(cudaMalloc(&out, (size_t)rmax * nmax * 2));
    CK(cudaMalloc(&ref, (size_t)rmax * nmax * 4));
    CK(cudaMalloc(&part, (size_t)sms * 2 * rmax * SK_BN * 4));
    CK(cudaMalloc(&sink, 4));
    CK(cudaDeviceSynchronize());
    printf("%d SMs, %d launches a case, %d weight copies\n", sms, iters, copies);
    for (const Shape& s : shapes) {
        // (Each copy holds `most` elements; a smaller matrix uses the start of it.)
        run_case<16>(s.name, s.n, s.k, sms, iters, ws, x, out, part, ref, sink);
        run_case<32>(s.name, s.n, s.k, sms, iters, ws, x, out, part, ref, sink);
        run_case<64>(s.name, s.n, s.k, sms, iters, ws, x, out, part, ref, sink);
    }
    return 0;
}
