// Microbenchmark of the fused Gated DeltaNet decode kernel (`gdn_decode_r3`, kernels/
// gated_deltanet.cu: causal conv + recurrence + gated RMSNorm of one layer, one row) on the
// Qwen3.6-27B shape (16 key heads, 48 value heads, dk = dv = 128, 4 conv taps): 48 layers'
// worth of states (more bytes than L2 holds), launched back to back with programmatic dependent
// launch as in a decode step, and each launch alone. Prints microseconds per launch.
//
//   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
//       -o gdn_micro benches/kernels/gdn_micro.cu
//
// Built with -DFLASHRT_PROBE (benches/kernels/micro.cuh), one launch alone is also timed per
// warp at the kernel's phases (FLASHRT_MARK: entry, state requested, wait passed, conv done,
// cluster barrier, q / k shared, recurrence, norm stored, state stored), printed as median /
// last warp in microseconds after the first warp's entry. Figures: benches/RESULTS.md.
#include "micro.cuh"
#include "gated_deltanet.cu"

// Uniform in about +-512 scale, as T (bf16 or f32).
template <typename T> __global__ void fill(T* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = (T)(((int)(micro_hash(i, seed) & 1023) - 512) * scale);
}

int main() {
    const int HK = 16, HV = 48, DK = 128, DV = 128, K = 4, L = 48;
    const int C = 2 * HK * DK + HV * DV;
    std::vector<GdnDecodeParams> ps(L);
    int* len;
    CK(cudaMalloc(&len, 4));
    const int one = 1;
    CK(cudaMemcpy(len, &one, 4, cudaMemcpyHostToDevice));
    unsigned seed = 1;
    auto bf = [&](size_t n, float scale) {
        __nv_bfloat16* p;
        CK(cudaMalloc(&p, n * 2));
        fill<<<256, 256>>>(p, n, seed++, scale);
        return p;
    };
    auto f32 = [&](size_t n, float scale) {
        float* p;
        CK(cudaMalloc(&p, n * 4));
        fill<<<256, 256>>>(p, n, seed++, scale);
        return p;
    };
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
    CK(cudaDeviceSynchronize());
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(HV);
    cfg.blockDim = dim3(GDND_THREADS);
    cfg.stream = 0;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    for (int it = 0; it < 2 * L; ++it) CK(cudaLaunchKernelEx(&cfg, gdn_decode_r3_bf16, ps[it % L]));
    CK(cudaDeviceSynchronize());
    const int iters = 10 * L;
    cudaEventRecord(e0);
    for (int it = 0; it < iters; ++it) CK(cudaLaunchKernelEx(&cfg, gdn_decode_r3_bf16, ps[it % L]));
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    printf("gdn_decode_r3 (27B shape): %.2f us per launch back to back (PDL), state %.2f MB per layer\n",
           ms * 1e3 / iters, HV * DK * DV * 4 / 1e6);
    // Alone: one launch between events, without PDL.
    cfg.numAttrs = 0;
    std::vector<float> alone;
    for (int it = 0; it < 2 * L; ++it) {
        cudaEventRecord(e0);
        CK(cudaLaunchKernelEx(&cfg, gdn_decode_r3_bf16, ps[it % L]));
        cudaEventRecord(e1);
        CK(cudaEventSynchronize(e1));
        cudaEventElapsedTime(&ms, e0, e1);
        alone.push_back(ms * 1e3f);
    }
    std::sort(alone.begin(), alone.end());
    printf("gdn_decode_r3 alone: median %.2f us (events around one launch)\n", alone[alone.size() / 2]);
#ifdef FLASHRT_PROBE
    const auto hp = probe_run((size_t)HV * (GDND_THREADS / 32), [&] {
        CK(cudaLaunchKernelEx(&cfg, gdn_decode_r3_bf16, ps[5]));
        CK(cudaDeviceSynchronize());
    });
    const char* names[9] = {"entry", "state-req", "wait", "conv", "cluster1", "qk-shared", "token", "norm", "end"};
    const int order[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    printf("probe (one launch alone, us after the first entry, median / last warp):");
    probe_print(hp, names, order, 9);
#endif
    return 0;
}
