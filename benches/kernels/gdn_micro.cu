// Microbenchmark of the fused Gated DeltaNet decode kernel (`gdn_decode_r{R}_c{NB}`, kernels/
// gated_deltanet.cu: causal conv + recurrence + gated RMSNorm of one layer, one row) on the
// Qwen3.6-27B shape (16 key heads, 48 value heads: R = 3) and the 35B-A3B shape (16 / 32: R = 2),
// dk = dv = 128, 4 conv taps, for NB = 1, 2, 4 blocks per value head: 48 layers' worth of states
// (more bytes than L2 holds), launched back to back with programmatic dependent launch as in a
// decode step; each launch alone; and each launch between two bandwidth-bound kernels (a 100 MB
// streaming read standing in for the layer's projections, PDL-chained as in a step: the figure
// is what the launch adds to the stream). Prints microseconds per launch and an output checksum
// (equal for every NB: the kernel's outputs do not depend on it).
//
//   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
//       -o gdn_micro benches/kernels/gdn_micro.cu
//
// Built with -DFLASHRT_PROBE (benches/kernels/micro.cuh), one launch alone is also timed per
// warp at the kernel's phases (FLASHRT_MARK: entry, state requested, wait passed, conv done,
// cluster barrier, token step entered, its q / k norms, recurrence, norm partials sent, end), printed as median / last warp in
// microseconds after the first warp's entry. Figures: benches/RESULTS.md.
#include "micro.cuh"
#include "gated_deltanet.cu"

// A weight stream's stand-in: waits for its predecessor, lets its successor launch, reads
// `n` 16-byte words once and writes one word per block.
__global__ void __launch_bounds__(512) stream_read(const uint4* p, size_t n, unsigned* out) {
    flashrt::pdl_enter();
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__global__ void checksum(const __nv_bfloat16* p, size_t n, double* out) {
    double s = 0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += (double)__bfloat162float(p[i]) * (double)((i % 7) + 1);
    atomicAdd(out, s);
}

typedef void (*GdndFn)(const GdnDecodeParams);

struct Shape {
    const char* name;
    int hv;
};

static void run(const Shape sh, int nb, GdndFn fn, int sms) {
    const int HK = 16, HV = sh.hv, DK = 128, DV = 128, K = 4, L = 48;
    const int C = 2 * HK * DK + HV * DV;
    std::vector<GdnDecodeParams> ps(L);
    int* len;
    CK(cudaMalloc(&len, 4));
    const int one = 1;
    CK(cudaMemcpy(len, &one, 4, cudaMemcpyHostToDevice));
    unsigned seed = 1;
    std::vector<void*> owned;
    // n values of T filled from the next seed, freed at the end.
    auto dev = [&](auto* tag, size_t n, float scale) {
        decltype(tag) p;
        CK(cudaMalloc(&p, n * sizeof(*tag)));
        micro_fill<<<256, 256>>>(p, n, seed++, scale);
        owned.push_back(p);
        return p;
    };
    auto bf = [&](size_t n, float scale) { return dev((__nv_bfloat16*)nullptr, n, scale); };
    auto f32 = [&](size_t n, float scale) { return dev((float*)nullptr, n, scale); };
    for (int l = 0; l < L; ++l) {
        GdnDecodeParams q = {};
        GdnParams& g = q.g;
        g.qkv = bf(C, 2e-3f);
        g.a = bf(HV, 2e-3f);
        g.b = bf(HV, 2e-3f);
        g.a_log = f32(HV, 1e-3f);
        g.dt_bias = f32(HV, 1e-3f);
        g.state = f32((size_t)HV * DK * DV, 1e-4f);
        g.out = bf(HV * DV, 0);
        g.len = len;
        g.ld_qkv = C;
        g.ld_a = HV;
        g.ld_b = HV;
        g.ld_out = HV * DV;
        g.key_heads = HK;
        g.value_heads = HV;
        g.key_dim = DK;
        g.value_dim = DV;
        q.conv_w = f32((size_t)C * K, 1e-3f);
        q.conv_b = nullptr;
        q.conv_state = bf((size_t)(K - 1) * C, 2e-3f);
        q.conv_out = bf(C, 0);
        q.z = bf(HV * DV, 2e-3f);
        q.norm_w = f32(DV, 1e-3f);
        q.gated = bf(HV * DV, 0);
        q.ld_conv_out = C;
        q.ld_z = HV * DV;
        q.ld_gated = HV * DV;
        q.conv_k = K;
        q.act = flashrt::ACT_SILU;
        q.shared_weight = 1;
        q.gate_then_norm = 0;
        q.eps = 1e-6f;
        ps[l] = q;
    }
    const size_t sn = (100u << 20) / 16;
    uint4* sp;
    unsigned* sout;
    CK(cudaMalloc(&sp, sn * 16));
    CK(cudaMemset(sp, 1, sn * 16));
    CK(cudaMalloc(&sout, 4096 * 4));
    CK(cudaDeviceSynchronize());
    CK(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(HV * nb);
    cfg.blockDim = dim3(GDND_DV / nb / GDN_COLS_PER_WARP * 32);
    cfg.stream = 0;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    cudaLaunchConfig_t scfg = cfg;
    scfg.gridDim = dim3(sms * 2);
    scfg.blockDim = dim3(512);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    // One launch per layer from fresh states: the checksum of every layer's gated output.
    for (int l = 0; l < L; ++l) CK(cudaLaunchKernelEx(&cfg, fn, ps[l]));
    double* dsum;
    CK(cudaMalloc(&dsum, 8));
    CK(cudaMemset(dsum, 0, 8));
    for (int l = 0; l < L; ++l) checksum<<<1, 256>>>((const __nv_bfloat16*)ps[l].gated, (size_t)HV * DV, dsum);
    double hsum;
    CK(cudaMemcpy(&hsum, dsum, 8, cudaMemcpyDeviceToHost));
    for (int it = 0; it < 2 * L; ++it) CK(cudaLaunchKernelEx(&cfg, fn, ps[it % L]));
    CK(cudaDeviceSynchronize());
    const int iters = 10 * L;
    float ms;
    cudaEventRecord(e0);
    for (int it = 0; it < iters; ++it) CK(cudaLaunchKernelEx(&cfg, fn, ps[it % L]));
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms, e0, e1);
    const float b2b = ms * 1e3f / iters;
    // Between streams: stream, gdn, stream, gdn, ... against streams alone.
    const int si = 4 * L;
    cudaEventRecord(e0);
    for (int it = 0; it < si; ++it) CK(cudaLaunchKernelEx(&scfg, stream_read, (const uint4*)sp, sn, sout));
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms, e0, e1);
    const float st = ms * 1e3f / si;
    cudaEventRecord(e0);
    for (int it = 0; it < si; ++it) {
        CK(cudaLaunchKernelEx(&scfg, stream_read, (const uint4*)sp, sn, sout));
        CK(cudaLaunchKernelEx(&cfg, fn, ps[it % L]));
    }
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms, e0, e1);
    const float mixed = ms * 1e3f / si;
    // Alone: one launch between events, without PDL.
    cfg.numAttrs = 0;
    std::vector<float> alone;
    for (int it = 0; it < 2 * L; ++it) {
        cudaEventRecord(e0);
        CK(cudaLaunchKernelEx(&cfg, fn, ps[it % L]));
        cudaEventRecord(e1);
        CK(cudaEventSynchronize(e1));
        cudaEventElapsedTime(&ms, e0, e1);
        alone.push_back(ms * 1e3f);
    }
    std::sort(alone.begin(), alone.end());
    printf("%s NB=%d (%d blocks x %d threads): back to back %.2f us, alone %.2f us, between 100 MB streams +%.2f us "
           "(stream %.2f us), checksum %.9e\n",
           sh.name, nb, HV * nb, cfg.blockDim.x, b2b, alone[alone.size() / 2], mixed - st, st, hsum);
#ifdef FLASHRT_PROBE
    const auto hp = probe_run((size_t)HV * nb * (cfg.blockDim.x / 32), [&] {
        CK(cudaLaunchKernelEx(&cfg, fn, ps[5]));
        CK(cudaDeviceSynchronize());
    });
    const char* names[10] = {"entry", "state-req", "wait", "conv", "cluster1", "token-in", "qk-norms", "token", "norm", "end"};
    const int order[10] = {0, 1, 2, 3, 4, 5, 9, 6, 7, 8};
    printf("  probe (one launch alone, us after the first entry, median / last warp):");
    probe_print(hp, names, order, 10);
#endif
    for (void* p : owned) CK(cudaFree(p));
    CK(cudaFree(sp));
    CK(cudaFree(sout));
    CK(cudaFree(len));
    CK(cudaFree(dsum));
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const Shape b27 = {"27B (R = 3)", 48}, b35 = {"35B-A3B (R = 2)", 32};
    run(b27, 1, gdn_decode_r3_c1_bf16, sms);
    run(b27, 2, gdn_decode_r3_c2_bf16, sms);
    run(b27, 4, gdn_decode_r3_c4_bf16, sms);
    run(b35, 1, gdn_decode_r2_c1_bf16, sms);
    run(b35, 2, gdn_decode_r2_c2_bf16, sms);
    run(b35, 4, gdn_decode_r2_c4_bf16, sms);
    return 0;
}
