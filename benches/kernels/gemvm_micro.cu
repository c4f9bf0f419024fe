// Microbenchmark of the small phases' matmul kernels on the Qwen3.6-27B shape's decode matrices:
// the tensor-core kernels (`gemv16m_*` over bf16 weights, `gemv8m_*` over FP8 codes with 128 x
// 128 block scales; kernels/gemv_mma.cu, stream-K grid as the host picks it) next to the
// CUDA-core `gemv_*` (kernels/gemv.cu) at 1, 2, 4 and 8 rows, and plain streaming reads of the
// same bytes (the ceiling). Each launch uses one of several copies of the weights (more bytes
// than L2 holds), back to back with programmatic dependent launch as in a decode step.
//
// Checks printed per shape: the tensor-core kernel's row 0 is bit-identical at every row count
// (`rows-invariant`), its outputs agree with the CUDA-core kernel's (16-bit weights; max
// difference relative to the largest output), and a hash of them (`bits`: a variant that must
// keep the bits prints the same). 16-bit weights also run `gemv16s_*` (mode
// `smem`: kernels/gemv.cu, the CUDA-core kernel's blocks with the products on the tensor
// cores), with the same two checks.
//
//   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
//       -o gemvm_micro benches/kernels/gemvm_micro.cu
//   ./gemvm_micro            (MB_CORES=1: the CUDA-core cases only; MB_STAGE=0: unstaged inputs where there is no norm; build with
//                             -DGEMVM8_RING=3 etc. for other ring depths; MB_PFS=steps: the
//                             tensor-core kernels' L2 prefetch before the PDL wait, as
//                             GemvParams::pf)
//
// -DGEMVM_NO_FIXUP: split tiles are not finished (wrong outputs), a bound on what finishing
// them costs. MB_GRID=n: n resident blocks per SM at most (default GEMVM_MINB, as the host).
// Built with -DFLASHRT_PROBE (benches/kernels/micro.cuh), each tensor-core case is also launched
// once alone with per-warp timestamps at the kernel's phases (entry, ring issued, PDL wait,
// prologue, first step, loop end, end), printed as median / max microseconds after the first
// warp's entry.
//
// Figures: benches/RESULTS.md.
#include "micro.cuh"
#include "gemv.cu"
#include "gemv_mma.cu"
#include <cmath>
#include <cstring>

__global__ void fill8(unsigned char* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned h = micro_hash(i, seed);
        p[i] = (unsigned char)(h & 0x77);
    }
}
// bf16 weights, uniform in about +-0.03.
__global__ void fill16(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const unsigned h = micro_hash(i, seed);
        p[i] = __float2bfloat16(((int)(h & 1023) - 512) * 6e-5f);
    }
}
__global__ void fillf(float* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        p[i] = 0.001f * (1 + (micro_hash(i, seed) & 255));
    }
}
__global__ void fillx(__nv_bfloat16* p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(((int)(i * 37 % 101) - 50) * 0.02f);
}
typedef void (*Kern)(const GemvParams);
struct Shape {
    const char* name;
    int n;
    int k;
    bool glu;
    bool norm;
};

static float bf(unsigned short h) {
    unsigned u = (unsigned)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int main() {
    Shape shapes[] = {
        {"gateup n=2x17408 k=5120 norm glu", 17408, 5120, true, true},
        {"down   n=5120 k=17408", 5120, 17408, false, false},
        {"qkvz   n=16384 k=5120 norm", 16384, 5120, false, true},
        {"out    n=5120 k=6144", 5120, 6144, false, false},
    };
    const int rows_list[] = {1, 2, 4, 8};
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    unsigned* dout;
    CK(cudaMalloc(&dout, 4));
    float* part;
    const size_t tw_max = (size_t)sms * GEMVM_MINB * GEMVM_WARPS;
    // (Zero: the tagged share words start untagged; each launch leaves them so.)
    CK(cudaMalloc(&part, tw_max * 128 * 8));
    CK(cudaMemset(part, 0, tw_max * 128 * 8));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    printf("gemvm micro: %d SMs, GEMVM16_RING %d, GEMVM8_RING %d\n", sms, GEMVM16_RING, GEMVM8_RING);

    // MB_CORES=1: the 16-bit shapes on the CUDA cores only (modes 1 and 3).
    const bool cores_only = getenv("MB_CORES") && getenv("MB_CORES")[0] == '1';
    for (int fp8 = 0; fp8 < (cores_only ? 1 : 2); ++fp8)
        for (auto& s : shapes) {
            const int nm = s.glu ? 2 : 1;
            const size_t welems = (size_t)s.n * s.k, wbytes = welems * (fp8 ? 1 : 2);
            const size_t sc = (size_t)((s.n + 127) / 128) * (s.k / 128);
            const int copies = std::max<int>(2, (int)(300e6 / (nm * wbytes)) + 1);
            std::vector<void*> w(copies * nm);
            std::vector<float*> scl(copies * nm);
            unsigned seed = 1;
            for (auto& p : w) {
                CK(cudaMalloc(&p, wbytes));
                if (fp8)
                    fill8<<<1024, 256>>>((unsigned char*)p, wbytes, seed++);
                else
                    fill16<<<1024, 256>>>((__nv_bfloat16*)p, welems, seed++);
            }
            for (auto& p : scl) {
                CK(cudaMalloc(&p, sc * 4));
                fillf<<<64, 256>>>(p, sc, seed++);
            }
            void *x, *o0, *o1, *go, *no;
            float* nw;
            CK(cudaMalloc(&x, 8 * s.k * 2));
            fillx<<<64, 256>>>((__nv_bfloat16*)x, 8 * s.k);
            CK(cudaMalloc(&nw, s.k * 4));
            CK(cudaMemset(nw, 0, s.k * 4));
            CK(cudaMalloc(&o0, 8 * s.n * 4));
            CK(cudaMalloc(&o1, 8 * s.n * 4));
            CK(cudaMalloc(&go, 8 * s.n * 4));
            CK(cudaMalloc(&no, 8 * s.k * 2));
            std::vector<unsigned short> row0_r1;
            std::vector<unsigned short> mma_out[9], core_out[9], smem_out[9];
            // The read ceiling for these bytes.
            const int iters = 40;
            cudaEventRecord(e0);
            for (int it = 0; it < iters; ++it)
                for (int m = 0; m < nm; ++m)
                    micro_readall<<<sms * 8, 256>>>((const uint4*)w[(it % copies) * nm + m], wbytes / 16, dout);
            cudaEventRecord(e1);
            CK(cudaEventSynchronize(e1));
            float msr;
            cudaEventElapsedTime(&msr, e0, e1);
            const double bytes = (double)nm * (wbytes + (fp8 ? sc * 4 : 0));
            printf("%s %-34s read %7.2f us %5.2f TB/s\n", fp8 ? "fp8 " : "bf16", s.name, msr * 1e3 / iters,
                   nm * wbytes / (msr * 1e3 / iters) / 1e6);
            for (int R : rows_list)
                for (int mode = 0; mode < 4; ++mode) {
                    // mode 0: gemv16m / gemv8m (stream-K), 1: CUDA cores, 2: gemv16s, 3: CUDA
                    // cores with staged rows launched one block per tile (not resident blocks
                    // looping over tiles, as the host launches them): what the loop saves.
                    const int core = mode == 1 || mode == 3;
                    if (mode == 3 && !GEMV_STAGED(R, s.norm, fp8)) continue;
                    if (cores_only && !core) continue;
                    if (mode == 2 && fp8) continue;
                    Kern f = nullptr;
                    int threads = mode ? 256 : GEMVM_WARPS * 32, grid;
                    size_t smem = 0;
                    const int tiles = s.glu ? (s.n + 7) / 8 : (s.n + 15) / 16;
                    int blocks;
                    if (mode == 2) {
                        // gemv16s_r<R>: 8 outputs a block at every R.
                        const int per = s.glu ? 4 : 8;
                        blocks = (s.n + per - 1) / per;
                        grid = s.glu ? blocks : blocks * nm;
#define SMEM(NR)                                                                                   \
    if (R == NR) f = s.norm ? gemv16s_norm_r##NR##_bf16 : gemv16s_r##NR##_bf16;
                        SMEM(1) SMEM(2) SMEM(4) SMEM(8)
                        smem = GEMVS_SMEM(R);
                        CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)smem));
                    } else if (core) {
                        // gemv_r<R> / gemv8_r<R>: 8 features per block at R <= 2 (FP8: R == 1), else 4.
                        const int feats = fp8 ? (R == 1 ? 8 : 4) : (R <= 2 ? 8 : 4);
                        const int per = s.glu ? feats / 2 : feats;
                        blocks = (s.n + per - 1) / per;
                        grid = s.glu ? blocks : blocks * nm;
#define CORE(NR)                                                                                   \
    if (R == NR)                                                                                   \
        f = fp8 ? (s.norm ? gemv8_norm_r##NR##_bf16 : gemv8_r##NR##_bf16)                          \
                : (s.norm ? gemv_norm_r##NR##_bf16 : gemv_r##NR##_bf16);
                        CORE(1) CORE(2) CORE(4) CORE(8)
                        // Several rows with the norm fused (GEMV_STAGED): the rows normalised
                        // once per block in shared memory, resident blocks looping over tiles
                        // (as the host launches them).
                        if (GEMV_STAGED(R, s.norm, fp8)) {
                            smem = (size_t)R * s.k * 2;
                            CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    (int)smem));
                            int per_sm = 0;
                            CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f, threads, smem));
                            if (mode == 1) grid = std::min(grid, std::max(per_sm, 1) * sms);
                        }
                    } else {
                        blocks = tiles;
                        const long long steps = (long long)(s.glu ? tiles : tiles * nm) * (s.k / 128);
                        const char* mg = getenv("MB_GRID");
                        const long long per_sm = mg ? atoi(mg) : GEMVM_MINB;
                        grid = (int)std::min<long long>(std::max<long long>(steps / (4 * GEMVM_WARPS), 1),
                                                        per_sm * sms);
#define MMA(NR)                                                                                    \
    if (R == NR)                                                                                   \
        f = fp8 ? (s.norm ? gemv8m_norm_r##NR##_bf16 : gemv8m_r##NR##_bf16)                        \
                : (s.norm ? gemv16m_norm_r##NR##_bf16 : gemv16m_r##NR##_bf16);
                        MMA(1) MMA(2) MMA(4) MMA(8)
                        smem = (size_t)R * (s.k + GEMVM_PAD) * 2;
                        // MB_STAGE=0: inputs without a norm read from global memory at each step.
                        const char* st = getenv("MB_STAGE");
                        if (smem > 96 * 1024 || (!s.norm && st && st[0] == '0')) smem = 0;
                        if (s.norm && smem == 0) continue;
                        CK(cudaFuncSetAttribute((const void*)f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)std::max<size_t>(smem, 1)));
                    }
                    std::vector<GemvParams> ps(copies);
                    for (int c = 0; c < copies; ++c) {
                        GemvParams p;
                        memset(&p, 0, sizeof p);
                        p.x = x;
                        p.ld_x = s.k;
                        p.k = s.k;
                        p.nmats = nm;
                        p.glu = s.glu;
                        p.act = 0;
                        p.stage = smem > 0;
                        p.glu_out = go;
                        p.ld_glu = s.n;
                        p.norm = s.norm;
                        p.norm_w = nw;
                        // (1 + w) with w = 0: the normalised rows themselves, so the fused-norm
                        // shapes' checks compare non-zero outputs.
                        p.one_plus = 1;
                        p.norm_out = no;
                        p.ld_norm_out = s.k;
                        p.eps = 1e-6f;
                        p.qbr = fp8 ? 128 : 1;
                        p.qbc = fp8 ? 128 : 1;
                        p.part = part;
                        // MB_PFS: the tensor-core kernels' L2 prefetch, steps per warp.
                        const char* pf = getenv("MB_PFS");
                        p.pf = pf && !core ? atoi(pf) : 0;
                        for (int m = 0; m < nm; ++m) {
                            p.m[m].w = w[c * nm + m];
                            p.m[m].out = m ? o1 : o0;
                            p.m[m].scale = scl[c * nm + m];
                            p.m[m].n = s.n;
                            p.m[m].ld_out = s.n;
                            p.m[m].blocks = blocks;
                            p.m[m].scale_ld = s.k / 128;
                        }
                        ps[c] = p;
                    }
                    cudaLaunchAttribute at[1];
                    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                    at[0].val.programmaticStreamSerializationAllowed = 1;
                    cudaLaunchConfig_t cfg = {};
                    cfg.gridDim = dim3(grid);
                    cfg.blockDim = dim3(threads);
                    cfg.dynamicSmemBytes = smem;
                    cfg.stream = 0;
                    cfg.attrs = at;
                    cfg.numAttrs = 1;
                    for (int it = 0; it < 6; ++it) CK(cudaLaunchKernelEx(&cfg, f, ps[it % copies]));
                    CK(cudaDeviceSynchronize());
                    cudaEventRecord(e0);
                    for (int it = 0; it < iters; ++it) CK(cudaLaunchKernelEx(&cfg, f, ps[it % copies]));
                    cudaEventRecord(e1);
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    cudaEventElapsedTime(&ms, e0, e1);
                    // One launch on copy 0: its outputs (glu product, or matrix 0; f32 bits
                    // folded to bf16 for the comparison).
                    CK(cudaMemset(o0, 0, 8 * s.n * 4));
                    CK(cudaMemset(go, 0, 8 * s.n * 4));
                    CK(cudaLaunchKernelEx(&cfg, f, ps[0]));
                    CK(cudaDeviceSynchronize());
                    std::vector<unsigned short> h((size_t)R * s.n);
                    CK(cudaMemcpy(h.data(), s.glu ? go : o0, h.size() * 2, cudaMemcpyDeviceToHost));
                    if (mode == 3) {
                        if (h != core_out[R]) printf("   cores1 R=%d: outputs differ from the resident blocks'\n", R);
                    } else {
                        (mode == 2 ? smem_out : core ? core_out : mma_out)[R] = h;
                    }
                    const double us = ms * 1e3 / iters;
                    printf("   %-6s R=%d grid=%5d smem=%6zu  %8.2f us %5.2f TB/s\n",
                           mode == 3 ? "cores1" : mode == 2 ? "smem" : core ? "cores" : "mma", R, grid, smem, us,
                           bytes / us / 1e6);
#ifdef FLASHRT_PROBE
                    if (mode == 0) {
                        float mp = 0;
                        const auto hp = probe_run((size_t)grid * GEMVM_WARPS, [&] {
                            cudaEventRecord(e0);
                            CK(cudaLaunchKernelEx(&cfg, f, ps[1 % copies]));
                            cudaEventRecord(e1);
                            CK(cudaDeviceSynchronize());
                            cudaEventElapsedTime(&mp, e0, e1);
                        });
                        printf("     probe (alone, event %.2f us):", mp * 1e3);
                        const char* names[9] = {"entry", "ring", "pdl", "loads", "sync1", "prologue", "first", "loop", "end"};
                        const int order[9] = {0, 1, 2, 7, 8, 3, 4, 5, 6};
                        probe_print(hp, names, order, 9);
                    }
#endif
                }
            // Row 0 at every R, bit for bit (tensor cores); tensor cores vs CUDA cores.
            bool inv = true;
            for (int R : rows_list)
                if (!mma_out[R].empty() && !mma_out[1].empty())
                    inv = inv && memcmp(mma_out[R].data(), mma_out[1].data(), (size_t)s.n * 2) == 0;
            double big = 0, diff = 0;
            if (!mma_out[8].empty() && !core_out[8].empty())
                for (size_t i = 0; i < mma_out[8].size(); ++i) {
                    big = std::max(big, (double)fabsf(bf(core_out[8][i])));
                    diff = std::max(diff, (double)fabsf(bf(core_out[8][i]) - bf(mma_out[8][i])));
                }
            // A hash of every tensor-core output (all row counts): a kernel variant that must
            // keep the bits prints the same.
            unsigned long long bits = 1469598103934665603ull;
            for (int R : rows_list)
                for (unsigned short v : mma_out[R]) bits = (bits ^ v) * 1099511628211ull;
            if (!cores_only)
                printf("   rows-invariant %s, |mma - cores| max %.3g of max |out| %.3g, bits %016llx\n", inv ? "yes" : "NO",
                       diff, big, bits);
            // The CUDA cores' row 0 at every R, bit for bit (staged and pipelined or not).
            bool cinv = true;
            for (int R : rows_list)
                if (!core_out[R].empty() && !core_out[1].empty())
                    cinv = cinv && memcmp(core_out[R].data(), core_out[1].data(), (size_t)s.n * 2) == 0;
            printf("   cores rows-invariant %s\n", cinv ? "yes" : "NO");
            if (!fp8 && !cores_only) {
                bool sinv = true;
                for (int R : rows_list)
                    sinv = sinv && !smem_out[R].empty() &&
                           memcmp(smem_out[R].data(), smem_out[1].data(), (size_t)s.n * 2) == 0;
                double sdiff = 0;
                if (!smem_out[8].empty() && !core_out[8].empty())
                    for (size_t i = 0; i < smem_out[8].size(); ++i)
                        sdiff = std::max(sdiff, (double)fabsf(bf(core_out[8][i]) - bf(smem_out[8][i])));
                printf("   smem rows-invariant %s, |smem - cores| max %.3g of max |out| %.3g\n", sinv ? "yes" : "NO",
                       sdiff, big);
            }
            for (auto p : w) cudaFree(p);
            for (auto p : scl) cudaFree(p);
            cudaFree(x);
            cudaFree(nw);
            cudaFree(o0);
            cudaFree(o1);
            cudaFree(go);
            cudaFree(no);
        }
    return 0;
}
