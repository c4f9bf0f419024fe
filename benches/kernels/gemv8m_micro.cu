// Microbenchmark of the FP8 tensor-core decode GEMV (`gemv8m_*`, kernels/gemv_mma.cu) on the
// 27B shape's decode matrices, next to plain streaming reads of the same bytes (the ceiling):
// each launch uses one of 6 copies of the weights (more than L2 holds), back to back with
// programmatic dependent launch as in a decode step; a checksum of one launch's outputs lets
// variants of the kernel be compared for equal results.
//
//   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
//       -L .venv/nvcc/cuda/lib -o gemv8m_micro benches/kernels/gemv8m_micro.cu
//   ./gemv8m_micro            (MB_WARPS=4|8 forces the block size, MB_STAGE=0 unstaged inputs)
//   (with benches/kernels/gemv_mma_cp.patch applied it measures that candidate: the shared-
//   memory size below follows the kernel's GEMVM_SLOT / GEMVM_STAGES when they exist)
//
// Figures: benches/RESULTS.md (issue 17).
#include "gemv.cu"
#include "gemv_mma.cu"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

__global__ void readall(const uint4* p, size_t n, unsigned* out) {
    unsigned a = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = load_stream(p + i);
        a ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (a == 0x12345678) out[0] = a;
}

__global__ void readall4(const uint4* p, size_t n, unsigned* out) {
    unsigned a = 0;
    const size_t st = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * st < n; i += 4 * st) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = load_stream(p + i + u * st);
#pragma unroll
        for (int u = 0; u < 4; ++u) a ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += st) { uint4 v = load_stream(p + i); a ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (a == 0x12345678) out[0] = a;
}
__global__ void fill8(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = (unsigned char)(h & 0x77);
    }
}
__global__ void fillf(float* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 15;
        p[i] = 0.001f * (1 + (h & 255));
    }
}
__global__ void fillx(__nv_bfloat16* p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(((int)(i * 37 % 101) - 50) * 0.02f);
}
typedef void (*Kern)(const GemvParams);
struct Shape { const char* name; int n; int k; bool glu; bool norm; int R; };

int main(int argc, char** argv) {
    const int COPIES = 6;
    (void)argc; (void)argv;
    Shape shapes[] = {
        {"gateup  n=17408x2 k=5120 norm glu", 17408, 5120, true, true, 1},
        {"down    n=5120 k=17408", 5120, 17408, false, false, 1},
        {"qkvz    n=16384 k=5120 norm", 16384, 5120, false, true, 1},
        {"out     n=5120 k=6144", 5120, 6144, false, false, 1},
        {"gateup R=4", 17408, 5120, true, true, 4},
        {"down R=4", 5120, 17408, false, false, 4},
    };
    int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    unsigned* dout; CK(cudaMalloc(&dout, 4));

    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (auto& s : shapes) {
        int nm = s.glu ? 2 : 1;
        size_t wbytes = (size_t)s.n * s.k;
        size_t sc = (size_t)((s.n + 127) / 128) * (s.k / 128);
        std::vector<unsigned char*> w(COPIES * nm); std::vector<float*> scl(COPIES * nm);
        unsigned seed = 1;
        for (auto& p : w) { CK(cudaMalloc(&p, wbytes)); fill8<<<1024, 256>>>(p, wbytes, seed++); }
        for (auto& p : scl) { CK(cudaMalloc(&p, sc * 4)); fillf<<<64, 256>>>(p, sc, seed++); }
        void *x, *o0, *o1, *go, *no; float* nw;
        CK(cudaMalloc(&x, 8 * s.k * 2)); fillx<<<64, 256>>>((__nv_bfloat16*)x, 8 * s.k);
        CK(cudaMalloc(&nw, s.k * 4)); CK(cudaMemset(nw, 0, s.k * 4));
        CK(cudaMalloc(&o0, 8 * s.n * 4)); CK(cudaMalloc(&o1, 8 * s.n * 4)); CK(cudaMalloc(&go, 8 * s.n * 4)); CK(cudaMalloc(&no, 8 * s.k * 2));
        int tiles = s.glu ? (s.n + 7) / 8 : (s.n + 15) / 16;
        int blocks = tiles;
        int warps = blocks > 6 * sms || blocks <= 3 * sms ? 8 : 4;
        if (getenv("MB_WARPS")) warps = atoi(getenv("MB_WARPS"));
        Kern f;
#define PICK(NR) if (s.R == NR) f = s.norm ? (warps == 8 ? gemv8m_norm_r##NR##_bf16 : gemv8m_norm_r##NR##w4_bf16) : (warps == 8 ? gemv8m_r##NR##_bf16 : gemv8m_r##NR##w4_bf16);
        PICK(1) PICK(2) PICK(4) PICK(8)
        size_t smem = (size_t)s.R * (s.k + 8) * 2;
#ifdef GEMVM_SLOT
        smem = ((smem + 15) & ~(size_t)15) + (size_t)warps * GEMVM_STAGES * GEMVM_SLOT;
#endif

        CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        std::vector<GemvParams> ps(COPIES);
        for (int c = 0; c < COPIES; ++c) {
            GemvParams p; memset(&p, 0, sizeof p);
            p.x = x; p.ld_x = s.k; p.k = s.k; p.nmats = nm; p.glu = s.glu; p.act = 0; p.stage = getenv("MB_STAGE") ? atoi(getenv("MB_STAGE")) : 1;
            p.glu_out = go; p.ld_glu = s.n; p.norm = s.norm; p.norm_w = nw; p.norm_out = no; p.ld_norm_out = s.k; p.eps = 1e-6f;
            p.qbr = 128; p.qbc = 128;
            for (int m = 0; m < nm; ++m) {
                p.m[m].w = w[c * nm + m]; p.m[m].out = m ? o1 : o0; p.m[m].scale = scl[c * nm + m]; p.m[m].n = s.n; p.m[m].ld_out = s.n;
                p.m[m].blocks = blocks; p.m[m].scale_ld = s.k / 128;
            }
            ps[c] = p;
        }
        int grid = s.glu ? blocks : blocks * nm;
        cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(grid); cfg.blockDim = dim3(warps * 32); cfg.dynamicSmemBytes = smem; cfg.stream = 0; cfg.attrs = at; cfg.numAttrs = 1;
        const int iters = 60;
        for (int it = 0; it < 10; ++it) CK(cudaLaunchKernelEx(&cfg, f, ps[it % COPIES]));
        CK(cudaDeviceSynchronize());
        cudaEventRecord(e0);
        for (int it = 0; it < iters; ++it) CK(cudaLaunchKernelEx(&cfg, f, ps[it % COPIES]));
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        {
            // checksum of the outputs of one launch on copy 0
            CK(cudaMemset(o0, 0, 8 * s.n * 4)); CK(cudaMemset(go, 0, 8 * s.n * 4));
            CK(cudaLaunchKernelEx(&cfg, f, ps[0])); CK(cudaDeviceSynchronize());
            std::vector<unsigned short> h(s.R * s.n);
            CK(cudaMemcpy(h.data(), s.glu ? go : o0, h.size() * 2, cudaMemcpyDeviceToHost));
            unsigned long long hs = 1469598103934665603ull; double sum = 0;
            for (size_t i = 0; i < h.size(); ++i) { hs = (hs ^ h[i]) * 1099511628211ull; unsigned u = (unsigned)h[i] << 16; float fv; memcpy(&fv, &u, 4); sum += fabs(fv); }
            printf("   check %016llx sum %.6g\n", hs, sum);
        }
        double us = ms * 1e3 / iters, bytes = (double)nm * (wbytes + sc * 4);
        // pure read of the same bytes (both matrices of the copy: read each separately)
        cudaEventRecord(e0);
        for (int it = 0; it < iters; ++it) for (int m = 0; m < nm; ++m) readall<<<sms * 8, 256>>>((const uint4*)w[(it % COPIES) * nm + m], wbytes / 16, dout);
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms2; cudaEventElapsedTime(&ms2, e0, e1);
        double us2 = ms2 * 1e3 / iters;
        cudaEventRecord(e0);
        for (int it = 0; it < iters; ++it) for (int m = 0; m < nm; ++m) readall4<<<sms * 4, 512>>>((const uint4*)w[(it % COPIES) * nm + m], wbytes / 16, dout);
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms3; cudaEventElapsedTime(&ms3, e0, e1);
        printf("   read4 %.2f TB/s\n", nm * wbytes / (ms3 * 1e3 / iters) / 1e6);
        printf("%-36s R=%d warps=%d grid=%5d  gemv %7.2f us %5.2f TB/s | read %7.2f us %5.2f TB/s | floor@4.2 %6.2f us\n", s.name, s.R, warps, grid, us, bytes / us / 1e6, us2, nm * wbytes / us2 / 1e6, bytes / 4.2e6);
        for (auto p : w) cudaFree(p); for (auto p : scl) cudaFree(p);
        cudaFree(x); cudaFree(nw); cudaFree(o0); cudaFree(o1); cudaFree(go); cudaFree(no);
    }
    return 0;
}
