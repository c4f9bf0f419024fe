// Which weight access pattern streams at the H200's bandwidth? Reads (no arithmetic beyond an
// xor) of a [n, k] bf16 matrix in the order each decode-GEMV design reads it, back to back over
// several copies (more bytes than L2 holds):
//   warp        : stream-K over warps: a warp's contiguous range of 16-row x 128-column steps,
//                 lanes reading 64 contiguous bytes of 8 rows per load (the MMA fragments' own
//                 layout); a ring of 2 steps per warp.
//   block       : the same steps, but a block's 8 warps take 8 adjacent steps of one tile at a
//                 time (2 KiB contiguous per row per block), blocks stream-K over those chunks.
//   rows/insn R : the warp's steps, each load instruction reading R rows x 512 / R bytes.
//   cores       : kernels/gemv.cu's: a block per 8 rows, thread t reads 16-byte chunk t of each.
// Measured (RESULTS.md, 2026-12-03): 8 rows x 64 bytes per instruction streams at 3.3-3.4 TB/s,
// 4 rows x 128 bytes (whole lines) at 4.2-4.4 TB/s, like the CUDA-core kernel's pattern; so
// kernels/gemv_mma.cu loads whole lines and moves them into fragments with shuffles.
//
//   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
//       -L .venv/nvcc/cuda/lib -o gemv_pattern_micro benches/kernels/gemv_pattern_micro.cu
#include "gemv.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>

static __device__ __forceinline__ unsigned fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// W: warps per block, RING: steps in flight per warp.
template <int RING>
__global__ void __launch_bounds__(256, 2) pat_warp(const unsigned char* w, int n, int k, unsigned* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int spt = k / 128, tiles = n / 16;
    const long long S = (long long)tiles * spt, TW = (long long)gridDim.x * 8, gw = blockIdx.x * 8 + warp;
    const long long i0 = gw * S / TW, i1 = (gw + 1) * S / TW;
    unsigned a = 0;
    uint4 v[RING][8];
    auto fetch = [&](int u, long long i) {
        if (i >= i1) return;
        const int t = (int)(i / spt), s = (int)(i % spt);
        const unsigned char* r0 = w + ((size_t)(t * 16 + g) * k + s * 128) * 2 + 16 * q;
        const unsigned char* r1 = r0 + (size_t)8 * k * 2;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[u][j] = load_stream(r0 + 64 * j), v[u][4 + j] = load_stream(r1 + 64 * j);
    };
#pragma unroll
    for (int u = 0; u < RING; ++u) fetch(u, i0 + u);
    for (long long i = i0; i < i1; i += RING)
#pragma unroll
        for (int u = 0; u < RING; ++u) {
            if (i + u >= i1) break;
#pragma unroll
            for (int j = 0; j < 8; ++j) a ^= fold(v[u][j]);
            fetch(u, i + u + RING);
        }
    if (a == 0x12345678) out[0] = a;
}

template <int RING>
__global__ void __launch_bounds__(256, 2) pat_block(const unsigned char* w, int n, int k, unsigned* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int spt = k / 128, cpt = (spt + 7) / 8, tiles = n / 16;
    const long long C = (long long)tiles * cpt, G = gridDim.x;
    const long long c0 = blockIdx.x * C / G, c1 = (blockIdx.x + 1) * C / G;
    unsigned a = 0;
    uint4 v[RING][8];
    auto fetch = [&](int u, long long c) {
        if (c >= c1) return;
        const int t = (int)(c / cpt), s = (int)(c % cpt) * 8 + warp;
        if (s >= spt) return;
        const unsigned char* r0 = w + ((size_t)(t * 16 + g) * k + s * 128) * 2 + 16 * q;
        const unsigned char* r1 = r0 + (size_t)8 * k * 2;
#pragma unroll
        for (int j = 0; j < 4; ++j) v[u][j] = load_stream(r0 + 64 * j), v[u][4 + j] = load_stream(r1 + 64 * j);
    };
#pragma unroll
    for (int u = 0; u < RING; ++u) fetch(u, c0 + u);
    for (long long c = c0; c < c1; c += RING)
#pragma unroll
        for (int u = 0; u < RING; ++u) {
            if (c + u >= c1) break;
#pragma unroll
            for (int j = 0; j < 8; ++j) a ^= fold(v[u][j]);
            fetch(u, c + u + RING);
        }
    if (a == 0x12345678) out[0] = a;
}


// The same warp stream-K steps (16 rows x 256 bytes, ring of 2), read with RPI rows per load
// instruction (32 / RPI lanes per row, 512 / RPI contiguous bytes of a row per instruction).
template <int RPI>
__global__ void __launch_bounds__(256, 2) pat_rows(const unsigned char* w, int n, int k, unsigned* out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int LPR = 32 / RPI;          // lanes per row
    const int rsub = lane / LPR, col = (lane % LPR) * 16;
    const int spt = k / 128, tiles = n / 16;
    const long long S = (long long)tiles * spt, TW = (long long)gridDim.x * 8, gw = blockIdx.x * 8 + warp;
    const long long i0 = gw * S / TW, i1 = (gw + 1) * S / TW;
    unsigned a = 0;
    uint4 v[2][8];
    auto fetch = [&](int u, long long i) {
        if (i >= i1) return;
        const int t = (int)(i / spt), s = (int)(i % spt);
        // 16 rows x 256 bytes = 8 instructions of RPI rows x 512 / RPI bytes: a row's 256 bytes
        // take RPI / 2 of them (RPI >= 2).
        static_assert(RPI >= 2 && RPI <= 8, "2, 4 or 8 rows per instruction");
        constexpr int per_row = RPI / 2;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int r = (j / per_row) * RPI + rsub, c = (j % per_row) * (512 / RPI) + col;
            v[u][j] = load_stream(w + ((size_t)(t * 16 + r) * k + s * 128) * 2 + c);
        }
    };
    fetch(0, i0);
    fetch(1, i0 + 1);
    for (long long i = i0; i < i1; i += 2)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            if (i + u >= i1) break;
#pragma unroll
            for (int j = 0; j < 8; ++j) a ^= fold(v[u][j]);
            fetch(u, i + u + 2);
        }
    if (a == 0x12345678) out[0] = a;
}

__global__ void __launch_bounds__(256, 4) pat_cores(const unsigned char* w, int n, int k, unsigned* out) {
    const int j0 = blockIdx.x * 8, chunks = k / 8;
    unsigned a = 0;
    for (int c = threadIdx.x; c < chunks; c += 256) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = load_stream(w + ((size_t)(j0 + i) * k + (size_t)c * 8) * 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) a ^= fold(v[i]);
    }
    if (a == 0x12345678) out[0] = a;
}

int main() {
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    unsigned* out;
    cudaMalloc(&out, 4);
    struct { const char* name; int n, k; } shapes[] = {{"gateup 34816x5120", 34816, 5120}, {"down 5120x17408", 5120, 17408},
                                                       {"qkvz 16384x5120", 16384, 5120}, {"out 5120x6144", 5120, 6144}};
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (auto& s : shapes) {
        const size_t bytes = (size_t)s.n * s.k * 2;
        const int copies = (int)(400e6 / bytes) + 2;
        std::vector<unsigned char*> w(copies);
        for (auto& p : w) cudaMalloc(&p, bytes), cudaMemset(p, 1, bytes);
        auto run = [&](const char* name, auto launch) {
            for (int i = 0; i < 4; ++i) launch(w[i % copies]);
            cudaDeviceSynchronize();
            const int iters = 40;
            cudaEventRecord(e0);
            for (int i = 0; i < iters; ++i) launch(w[i % copies]);
            cudaEventRecord(e1);
            cudaEventSynchronize(e1);
            float ms;
            cudaEventElapsedTime(&ms, e0, e1);
            const double us = ms * 1e3 / iters;
            printf("%-20s %-14s %8.2f us %5.2f TB/s\n", s.name, name, us, bytes / us / 1e6);
        };
        const int grid = 2 * sms;
        run("warp r2", [&](unsigned char* p) { pat_warp<2><<<grid, 256>>>(p, s.n, s.k, out); });
        run("block r3", [&](unsigned char* p) { pat_block<3><<<grid, 256>>>(p, s.n, s.k, out); });
        run("rows/insn 8", [&](unsigned char* p) { pat_rows<8><<<grid, 256>>>(p, s.n, s.k, out); });
        run("rows/insn 4", [&](unsigned char* p) { pat_rows<4><<<grid, 256>>>(p, s.n, s.k, out); });
        run("rows/insn 2", [&](unsigned char* p) { pat_rows<2><<<grid, 256>>>(p, s.n, s.k, out); });
        run("rows/insn 2 g4", [&](unsigned char* p) { pat_rows<2><<<4 * sms, 256>>>(p, s.n, s.k, out); });
        run("cores", [&](unsigned char* p) { pat_cores<<<s.n / 8, 256>>>(p, s.n, s.k, out); });
        for (auto p : w) cudaFree(p);
    }
    cudaError_t e = cudaDeviceSynchronize();
    printf("%s\n", cudaGetErrorString(e));
    return 0;
}
