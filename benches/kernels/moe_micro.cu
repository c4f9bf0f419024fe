// Microbenchmark of an MoE block's small phases at one row (a decode step) on the
// Qwen3.6-35B-A3B shape (hidden 2048, 256 experts, top 8, expert width 512, a gated shared
// expert of width 512, SwiGLU, softmax routing renormalised): the three launches the host makes
// for it (flashrt-runtime/src/backend/cuda/ops/moe.rs: same grids, shared memory and PDL):
//
//   moe_logits       the fused RMSNorm, the f32 router logits, the shared expert's token gate
//   moe_up_routed1   routing and the pair plan in every block, then the chosen experts' and the
//                    shared expert's gate and up rows (SwiGLU)
//   moe_down_small   the down projections, the combine and the shared expert's down projection
//
// MB_LAYERS blocks, each with its own router, norm, shared-expert weights and input, share one
// set of routed experts (256 x 4 MiB of gate/up rows, 256 x 2 MiB of down rows): each layer's
// input routes elsewhere, so the experts a launch reads are seldom in the L2, as in a model.
// Printed: the three launches chained layer after layer (a decode step's MoE blocks back to
// back), each kind alone back to back over the layers, the bytes each reads and the time a
// plain read of as many bytes takes at the bandwidth measured here, and a hash of every output
// (`bits`), so a kernel variant built with -D flags can be checked for the same bits. Built
// with -DFLASHRT_PROBE (benches/kernels/micro.cuh), each kind is also launched once alone with
// per-warp phase stamps (median / last warp, us after the first warp's start).
//
//   NV="nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels"
//   $NV -o moe_micro benches/kernels/moe_micro.cu        (-DFLASHRT_PROBE: the stamps)
//   ./moe_micro                                          (MB_LAYERS=16, MB_ITERS=20)
//
// Figures: benches/RESULTS.md.
#include "micro.cuh"
#include "moe.cu"
#include "moe_small.cu"
#include <cstring>

typedef __nv_bfloat16 bf16;

template <typename X> static X* dalloc(size_t n) {
    X* p;
    CK(cudaMalloc(&p, n * sizeof(X)));
    return p;
}

// Uniform in +-range / 2.
template <typename X> static void fill(X* p, size_t n, unsigned seed, float range) {
    micro_fill<X><<<1024, 256>>>(p, n, seed, range / 1024);
    CK(cudaGetLastError());
}

static int env_int(const char* name, int dflt) {
    const char* v = getenv(name);
    return v ? atoi(v) : dflt;
}

// FNV-1a over device bytes.
static unsigned long long hash_dev(const void* p, size_t bytes, unsigned long long h) {
    std::vector<unsigned char> b(bytes);
    CK(cudaMemcpy(b.data(), p, bytes, cudaMemcpyDeviceToHost));
    for (unsigned char c : b) h = (h ^ c) * 1099511628211ull;
    return h;
}

typedef void (*MoeKernel)(const MoeParams);

struct Launch {
    MoeKernel f;
    dim3 grid;
    unsigned threads;
    size_t smem;
    size_t warps() const { return (size_t)grid.x * grid.y * (threads / 32); }
};

static void launch(const Launch& l, const MoeParams& p) {
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = l.grid;
    cfg.blockDim = dim3(l.threads);
    cfg.dynamicSmemBytes = l.smem;
    cfg.stream = 0;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, l.f, p));
}

int main() {
    const int H = 2048, E = 256, K = 8, I = 512, SI = 512;
    const int layers = env_int("MB_LAYERS", 16), iters = env_int("MB_ITERS", 20);
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("moe_micro on %s (%d SMs): hidden %d, %d experts, top %d, width %d, shared %d (gated), %d layers\n",
           prop.name, sms, H, E, K, I, SI, layers);

    // The routed experts, one set for every layer: gate rows then up rows per expert.
    const size_t n_up = (size_t)E * 2 * I * H, n_down = (size_t)E * H * I;
    bf16* up = dalloc<bf16>(n_up);
    bf16* down = dalloc<bf16>(n_down);
    fill(up, n_up, 11, 0.08f);
    fill(down, n_down, 12, 0.08f);
    int* len = dalloc<int>(1);
    const int one = 1;
    CK(cudaMemcpy(len, &one, 4, cudaMemcpyHostToDevice));
    // The router's scratch width as flashrt-ir's lowering sizes it (T elements).
    const int ld_tmp = (K * (I + H + 4) + 2 * E + 7) / 8 * 8;
    std::vector<MoeParams> ps(layers);
    std::vector<bf16*> outs(layers), shs(layers), tmps(layers), gates(layers);
    for (int l = 0; l < layers; ++l) {
        float* router = dalloc<float>((size_t)E * H);
        float* norm_w = dalloc<float>(H);
        bf16* s_gate = dalloc<bf16>(H);
        bf16* s_up = dalloc<bf16>((size_t)SI * H);
        bf16* s_up2 = dalloc<bf16>((size_t)SI * H);
        bf16* s_down = dalloc<bf16>((size_t)H * SI);
        bf16* resid = dalloc<bf16>(H);
        bf16* x = dalloc<bf16>(H);
        outs[l] = dalloc<bf16>(H);
        tmps[l] = dalloc<bf16>(ld_tmp);
        gates[l] = dalloc<bf16>(8);
        shs[l] = dalloc<bf16>(SI);
        const unsigned s = 100 + 16 * l;
        fill(router, (size_t)E * H, s, 0.2f);
        fill(norm_w, H, s + 1, 0.2f);
        fill(s_gate, H, s + 2, 0.08f);
        fill(s_up, (size_t)SI * H, s + 3, 0.08f);
        fill(s_up2, (size_t)SI * H, s + 4, 0.08f);
        fill(s_down, (size_t)H * SI, s + 5, 0.08f);
        fill(resid, H, s + 6, 4.0f);
        CK(cudaMemset(outs[l], 0, H * 2));
        CK(cudaMemset(tmps[l], 0, (size_t)ld_tmp * 2));
        CK(cudaMemset(gates[l], 0, 16));
        CK(cudaMemset(shs[l], 0, SI * 2));
        MoeParams p;
        memset(&p, 0, sizeof p);
        p.x = x;
        p.router = router;
        p.up = up;
        p.down = down;
        p.out = outs[l];
        p.tmp = tmps[l];
        p.plan = dalloc<int>(1 << 14);
        p.len = len;
        p.ld_x = H;
        p.ld_out = H;
        p.ld_tmp = ld_tmp;
        p.hidden = H;
        p.inter = I;
        p.experts = E;
        p.top_k = K;
        p.softmax = 1;
        p.renormalize = 1;
        p.renorm_eps = 0.0f;
        p.scaling = 1.0f;
        p.groups = 1;
        p.top_groups = 1;
        p.swiglu = 1;
        p.max_pairs = K;
        p.small = 1;
        p.tile_m = 0;
        p.norm_x = resid;
        p.norm_w = norm_w;
        p.one_plus = 1;
        p.eps = 1e-6f;
        p.ld_norm_x = H;
        p.s_gate = s_gate;
        p.s_gate_out = gates[l];
        p.ld_s_gate_out = 1;
        p.s_up = s_up;
        p.s_up2 = s_up2;
        p.s_down = s_down;
        p.s_h = shs[l];
        p.ld_s_h = SI;
        p.s_inter = SI;
        p.shared = 1;
        ps[l] = p;
    }
    CK(cudaDeviceSynchronize());

    // The host's launches (ops/moe.rs, one row): logits over ceil((E + gate) / 4) blocks of 4
    // warps; the routed up launch with one block row per active expert plus the shared expert's,
    // as many columns as are resident at once; down + combine over hidden / 8 blocks.
    Launch logits{moe_logits_bf16, dim3((E + 1 + 3) / 4, 1), 128, (size_t)8 * H * 2};
    // Up: MB_UP_THREADS a block (the host's 128), as many block columns as are resident, then
    // as few as keep the rounds of features a warp takes (ceil) the same.
    const size_t up_smem = (size_t)H * 2 + 2 * E * 4;
    const int up_threads = env_int("MB_UP_THREADS", 128), up_warps = up_threads / 32;
    int per_sm = 1;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_up_routed1_bf16, up_threads, up_smem));
    const int ys = K + 1, feats = std::max(I, SI);
    const int xs_max = std::max(1, std::min((feats + up_warps - 1) / up_warps, per_sm * sms / ys));
    const int rounds = (feats + xs_max * up_warps - 1) / (xs_max * up_warps);
    const int xs = (feats + up_warps * rounds - 1) / (up_warps * rounds);
    Launch upl{moe_up_routed1_bf16, dim3(xs, ys), (unsigned)up_threads, up_smem};
    Launch downl{moe_down_small_bf16, dim3(H / 8), 256, 0};
    printf("grids: logits %u x 128, up %u x %u x %d (%d resident an SM, %d rounds), down %u x 256\n", logits.grid.x,
           upl.grid.x, upl.grid.y, up_threads, per_sm, rounds, downl.grid.x);

    // Bytes each launch reads from DRAM (weights; activations are a few KiB).
    const double b_logits = (double)E * H * 4 + H * 2 + H * 4;
    const double b_up = (double)K * 2 * I * H * 2 + 2.0 * SI * H * 2;
    const double b_down = (double)K * H * I * 2 + (double)H * SI * 2;
    unsigned* sink = dalloc<unsigned>(1);
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float ms = 0;
    for (int r = 0; r < 2; ++r) micro_readall<<<sms * 8, 512>>>((const uint4*)up, n_up * 2 / 16, sink);
    cudaEventRecord(e0);
    micro_readall<<<sms * 8, 512>>>((const uint4*)up, n_up * 2 / 16, sink);
    cudaEventRecord(e1);
    CK(cudaEventSynchronize(e1));
    cudaEventElapsedTime(&ms, e0, e1);
    const double bw = n_up * 2 / (ms * 1e-3); // bytes / s
    printf("read bandwidth %.2f TB/s (%.2f GiB)\n", bw / 1e12, n_up * 2 / 1073741824.0);
    auto floor_us = [&](double bytes) { return bytes / bw * 1e6; };

    // Every output's bits after one chain (outputs zeroed first).
    for (int l = 0; l < layers; ++l) CK(cudaMemset(outs[l], 0, H * 2));
    for (int l = 0; l < layers; ++l) {
        launch(logits, ps[l]);
        launch(upl, ps[l]);
        launch(downl, ps[l]);
    }
    CK(cudaDeviceSynchronize());
    unsigned long long h = 1469598103934665603ull;
    for (int l = 0; l < layers; ++l) {
        h = hash_dev(outs[l], H * 2, h);
        h = hash_dev(shs[l], SI * 2, h);
        h = hash_dev(gates[l], 2, h);
        h = hash_dev(tmps[l], (size_t)ld_tmp * 2, h);
    }
    int ids[K];
    float wts[K];
    CK(cudaMemcpy(ids, (const char*)tmps[0] + (size_t)K * (I + H) * 2, sizeof ids, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(wts, (const char*)tmps[0] + (size_t)K * (I + H) * 2 + sizeof ids, sizeof wts, cudaMemcpyDeviceToHost));
    printf("bits %016llx; layer 0 routes to", h);
    float wsum = 0;
    for (int j = 0; j < K; ++j) printf(" %d (%.3f)", ids[j], wts[j]), wsum += wts[j];
    printf(", weights sum %.4f\n", wsum);

    // Timings: the chain, then each kind alone, back to back over the layers.
    auto timed = [&](auto&& body) {
        body();
        CK(cudaDeviceSynchronize());
        cudaEventRecord(e0);
        for (int it = 0; it < iters; ++it) body();
        cudaEventRecord(e1);
        CK(cudaEventSynchronize(e1));
        float t;
        cudaEventElapsedTime(&t, e0, e1);
        return t * 1e3 / ((double)iters * layers); // us a layer
    };
    const double chain = timed([&] {
        for (int l = 0; l < layers; ++l) {
            launch(logits, ps[l]);
            launch(upl, ps[l]);
            launch(downl, ps[l]);
        }
    });
    const double t_logits = timed([&] {
        for (int l = 0; l < layers; ++l) launch(logits, ps[l]);
    });
    const double t_up = timed([&] {
        for (int l = 0; l < layers; ++l) launch(upl, ps[l]);
    });
    const double t_down = timed([&] {
        for (int l = 0; l < layers; ++l) launch(downl, ps[l]);
    });
    printf("chain (logits, up, down per layer)  %8.2f us a layer   floor %6.2f us (%.1f MB)\n", chain,
           floor_us(b_logits + b_up + b_down), (b_logits + b_up + b_down) / 1e6);
    printf("  logits alone                      %8.2f us           floor %6.2f us (%.1f MB)\n", t_logits,
           floor_us(b_logits), b_logits / 1e6);
    printf("  up alone                          %8.2f us           floor %6.2f us (%.1f MB)\n", t_up, floor_us(b_up),
           b_up / 1e6);
    printf("  down alone                        %8.2f us           floor %6.2f us (%.1f MB)\n", t_down,
           floor_us(b_down), b_down / 1e6);

#ifdef FLASHRT_PROBE
    // Each kind once alone (its inputs from the chain above), every warp's phases.
    const Launch* kinds[3] = {&logits, &upl, &downl};
    const char* kname[3] = {"logits", "up", "down"};
    // up: "scores" / "top-k" / "routed" are the routing warps' (route_row's marks 3 and 5),
    // "routed" the others' too (their copy of x).
    const char* names[3][7] = {{"start", "staged", "normed", "end"},
                               {"start", "scores", "top-k", "routed", "planned", "first", "end"},
                               {"start", "end"}};
    const int orders[3][7] = {{0, 1, 2, 6}, {0, 3, 5, 1, 2, 4, 6}, {0, 6}};
    const int counts[3] = {4, 7, 2};
    // Then twice back to back, the stamps the second launch's (its code and inputs warm).
    for (int twice = 0; twice < 2; ++twice)
        for (int k = 0; k < 3; ++k) {
            float mp = 0;
            const auto hp = probe_run(kinds[k]->warps(), [&] {
                if (twice) launch(*kinds[k], ps[layers - 1]);
                cudaEventRecord(e0);
                launch(*kinds[k], ps[layers - 1]);
                cudaEventRecord(e1);
                CK(cudaDeviceSynchronize());
                cudaEventElapsedTime(&mp, e0, e1);
            });
            printf("  probe %-6s (%s, event %.2f us):", kname[k], twice ? "again" : "alone", mp * 1e3);
            probe_print(hp, names[k], orders[k], counts[k]);
        }
#endif
    return 0;
}
