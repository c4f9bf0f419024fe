// flashrt kernels: shared device helpers.
//
// Every kernel file includes this header. The build compiles kernels/*.cu by family (the
// name before the first `_`), each family ONE translation unit (flashrt-runtime/build.rs
// generates an umbrella file per family and compiles the families in parallel), so helpers
// here are `static __device__ __forceinline__` and guarded against double inclusion, and a
// file may use only what this header, other headers (wgmma.cuh) or an earlier file of its own
// family defines.
//
// Conventions every kernel follows:
// * framework-free: raw pointers, explicit sizes, one `#[repr(C)]`-mirrored parameter struct
//   per kernel passed by value (the Rust side is flashrt-runtime/src/backend/cuda/ops.rs);
// * entry points are `extern "C" __global__ <op>_<dtype>` with dtype in {bf16, f16, f32}: the
//   element type of activations, weights, KV and conv state (the layout's target dtype);
//   recurrent state, norm scales and other small parameters are always f32; all arithmetic
//   accumulates in f32;
// * the chunk position and length are read from device scalars (`io.pos`, `io.len`), never
//   from kernel arguments, so a captured CUDA graph replays at any position. Grids are sized
//   for the plan's bucket rows; blocks whose row is >= len return at once;
// * activation views are row-major `[rows, ld]` windows: element (r, c) is at `p[r * ld + c]`,
//   where the Rust side has already added the view's column offset to the pointer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace flashrt {

// ---- element conversion ---------------------------------------------------------------

static __device__ __forceinline__ float to_f32(float v) { return v; }
static __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
static __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T> static __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// FP8 E4M3 (OCP `e4m3fn`): a code's exact value, and the code nearest to a value (ties to
// even, saturating at +-448).
static __device__ __forceinline__ float e4m3_value(uint8_t code) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3);
    return __half2float(*reinterpret_cast<const __half*>(&h));
}
static __device__ __forceinline__ uint8_t e4m3_code(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}
static __device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// ---- activations (must match flashrt_ir::plan::Act) ------------------------------------

enum ActKind : int { ACT_IDENTITY = 0, ACT_SILU = 1, ACT_SIGMOID = 2, ACT_RELU2 = 3 };

static __device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

static __device__ __forceinline__ float apply_act(int act, float x) {
    switch (act) {
    case ACT_SILU: return x * sigmoidf_(x);
    case ACT_SIGMOID: return sigmoidf_(x);
    case ACT_RELU2: { float r = x > 0.0f ? x : 0.0f; return r * r; }
    default: return x;
    }
}

// softplus(x) = log(1 + e^x), linear above 20 (as torch.nn.functional.softplus).
static __device__ __forceinline__ float softplusf_(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// The 16-byte pack of thread i of a 1-D grid over (row, pack), rows of `width` elements (a
// multiple of N): row i / (width / N), first column (i % (width / N)) N.
template <int N> static __device__ __forceinline__ void pack_of_thread(int width, int& row, int& col) {
    const unsigned nvec = (unsigned)width / N;
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    row = (int)(i / nvec);
    col = (int)(i % nvec) * N;
}

// ---- reductions -------------------------------------------------------------------------

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// warp_sum of each of a thread's N values, bit for bit (every stage adds the same xor partner's
// partial in the same operand order; the partners' sums are equal as a + b == b + a), with
// fewer shuffles: while a stage has an even count M of values left, each lane keeps half of
// them (the upper half where its lane bit O is set) and sends the partner the other half, one
// shuffle per kept value; an odd count exchanges them all, as warp_sum does. 32 values take 31
// shuffles instead of 160, 8 take 9 instead of 40 (a warp's shuffles issue at one a clock per
// SM: the reduction of a several-row gemv tile cost more than its multiply-adds). On return the
// lane holds `warp_sum_many_count(N)` sums in a[0..]: a[j] is the sum of original value
// `base + j`, identical on the lanes that differ only in `warp_sum_many_dup_mask(N)`'s bits.
__host__ __device__ constexpr int warp_sum_many_count(int n) {
    for (int o = 16; o > 0; o >>= 1)
        if (n % 2 == 0) n /= 2;
    return n;
}
__host__ __device__ constexpr int warp_sum_many_dup_mask(int n) {
    int mask = 0;
    for (int o = 16; o > 0; o >>= 1) {
        if (n % 2 == 0) n /= 2;
        else mask |= o;
    }
    return mask;
}
template <int O, int M, int N> static __device__ __forceinline__ void warp_sum_many_stage(float (&a)[N], int& base) {
    if constexpr (O > 0) {
        if constexpr (M % 2 == 0) {
            constexpr int H = M / 2;
            const bool hi = (threadIdx.x & O) != 0;
#pragma unroll
            for (int j = 0; j < H; ++j) {
                const float send = hi ? a[j] : a[j + H];
                const float keep = hi ? a[j + H] : a[j];
                a[j] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            if (hi) base += H;
            warp_sum_many_stage<O / 2, H>(a, base);
        } else {
#pragma unroll
            for (int j = 0; j < M; ++j) a[j] += __shfl_xor_sync(0xffffffffu, a[j], O);
            warp_sum_many_stage<O / 2, M>(a, base);
        }
    }
}
// Returns `base` (see above).
template <int N> static __device__ __forceinline__ int warp_sum_many(float (&a)[N]) {
    int base = 0;
    warp_sum_many_stage<16, N>(a, base);
    return base;
}

// Inclusive prefix sum over the 64 values of a warp held 2 per lane (lane l holds elements 2l
// and 2l + 1): on return v0, v1 are the sums up to and including them, and the result is the
// total (the chunked recurrences' cumulative log-decays).
static __device__ __forceinline__ float warp_prefix_sum2(float& v0, float& v1) {
    const int lane = threadIdx.x & 31;
    float incl = v0 + v1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    float excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0.0f;
    v0 += excl;
    v1 += v0;
    return __shfl_sync(0xffffffffu, v1, 31);
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the
// result. `scratch` holds at least 32 floats; the call ends with a barrier after which
// `scratch` may be reused.
static __device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

// Device scalars of the I/O arena (see flashrt_ir::plan): number of valid rows and the
// absolute position of the chunk's first token.
// io.len is written once a step, by `io_scatter` (kernels/io.cu), the step graph's first node. A
// PDL launch starts only after its predecessor has passed its own wait, so every grid before
// that predecessor is complete and visible: a kernel that is never a graph's second launch (the
// MoE block's, after a norm at least; attention decode and the fused Gated DeltaNet decode block,
// after a projection) may load len (and io.pos, written with it) before its `pdl_wait()`, off
// its chain of dependent loads.
static __device__ __forceinline__ int load_len(const int* len) { return __ldg(len); }
static __device__ __forceinline__ int load_pos(const int* pos) { return __ldg(pos); }

// ---- batched decode steps ------------------------------------------------------------------
//
// A batched decode step (`decode[b]`, flashrt_runtime's `Model::step_batch`) runs one plan over
// b rows that belong to b sessions, each at its own position and with its own state arena. The
// host writes, next to the step's tokens, two small device tables: `rows_pos[r]`, row r's
// absolute position, and `slots[r]`, the base address of row r's session state arena. Kernels
// that touch positions or state take both (null in a one-session step); a state address in their
// parameters is then an offset into the arena, and row r's is `slots[r] + offset`. A row of a
// batched step is computed exactly as the same row of a one-row step of its session.
static __device__ __forceinline__ int row_pos(const int* pos, const int* rows_pos, int row) {
    return rows_pos ? __ldg(rows_pos + row) : __ldg(pos) + row;
}
template <typename P> static __device__ __forceinline__ P* in_slot(P* state, const unsigned long long* slots, int row) {
    return slots ? reinterpret_cast<P*>(reinterpret_cast<uintptr_t>(state) + (uintptr_t)__ldg(slots + row)) : state;
}

// ---- programmatic dependent launch (PDL) --------------------------------------------------
//
// The host may launch a kernel with programmatic stream serialisation (ops.rs, for the kernels
// kernels.rs does not list in NOT_PDL), which lets the kernel start while its predecessor in the
// stream drains. Every such kernel calls `pdl_wait()` before touching global memory: it blocks
// until the predecessor grid has completed and its writes are visible (a no-op when launched
// without the attribute). `pdl_trigger()` then lets the *next* kernel launch as soon as every
// block of this one has started; that kernel waits in its own `pdl_wait()`, so the ordering
// stays that of the stream while the launch latency overlaps this kernel's execution.
static __device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
static __device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Timing hooks at a kernel's phases (gemv_mma.cu, gated_deltanet.cu, moe*.cu): empty in the
// product; the kernel microbenchmarks built with -DFLASHRT_PROBE (benches/kernels/micro.cuh)
// stamp each warp's %globaltimer there.
#ifndef FLASHRT_MARK
#define FLASHRT_MARK(i)
#endif

// The start of a PDL-ready entry: wait, then let the next kernel launch. (Triggering first, so
// that a chain of short kernels is resident ahead of its predecessor's end, measured slower on
// the H200 for every model: 27B decode 13.91 against 13.67 ms, FP8 10.44 / 10.15, 35B-A3B
// 3.56 / 3.49; benches/RESULTS.md, 2026-12-04 17:55 UTC.)
static __device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}

// Asks the L2 for `bytes` at `p` (16-byte aligned; rounded down to a multiple of 16) and does
// not wait: one bulk prefetch, issued by the SM's copy engine (sm_90 `cp.async.bulk.prefetch`),
// so a kernel can start its weights' trip from DRAM before its `pdl_wait()` and keep DRAM busy
// through its prologue, at the cost of one instruction per region. Nothing on older devices.
static __device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    bytes &= ~15u;
    if (bytes) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The next matmul's weights asked of the L2 by a launch that streams little itself (a Gated
// DeltaNet block, attention decode: latency-bound at one row), so that DRAM works through it
// and the matmul after it finds the first `bytes` of its weights in the L2: each block's
// thread 0 asks for its share (blocks in linear order over the grid). Issued before the PDL
// wait (weights are never written by a step). Nothing when `p` is null.
static __device__ __forceinline__ void prefetch_l2_share(const void* p, unsigned long long bytes) {
    if (!p || threadIdx.x + threadIdx.y + threadIdx.z != 0) return;
    const unsigned long long nb = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
    const unsigned long long b =
        blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    const unsigned long long share = ((bytes + nb - 1) / nb + 15) & ~15ull;
    const unsigned long long lo = b * share;
    if (lo >= bytes) return;
    const unsigned long long n = bytes - lo < share ? bytes - lo : share;
    prefetch_l2(static_cast<const char*>(p) + lo, (unsigned)(n < (1ull << 30) ? n : (1ull << 30)));
}

} // namespace flashrt

// ---- 16-byte packs (the vector paths of conv.cu, elementwise.cu and norm.cu) ---------------
//
// The vector paths move 16 bytes per load/store: 8 bf16/f16 or 4 f32 elements. The host takes
// them only when it has proved every view address 16-byte aligned and every row stride and
// width a multiple of the pack.
namespace flashrt {

// Weights a step reads once and that nothing reads again soon (a one-row MoE block's experts):
// the L2 evicts these lines before others (`createpolicy ... evict_first`), so a stream of them
// does not push out what a launch asked the L2 to hold for the next matmul (`prefetch_l2`).
// Same value as ld16; built with -DMOE_EVICT_FIRST=0 it is ld16.
#ifndef MOE_EVICT_FIRST
#define MOE_EVICT_FIRST 1
#endif
static __device__ __forceinline__ uint4 ld16_evict_first(const void* p) {
#if MOE_EVICT_FIRST && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint4 v;
    unsigned long long pol;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
#else
    return *static_cast<const uint4*>(p);
#endif
}

template <typename T> struct Pack16 {
    static constexpr int N = 16 / (int)sizeof(T);
};

static __device__ __forceinline__ uint4 ld16(const void* p) { return *static_cast<const uint4*>(p); }
static __device__ __forceinline__ void st16(void* p, uint4 v) { *static_cast<uint4*>(p) = v; }

static __device__ __forceinline__ void unpack16(uint4 u, float (&f)[8], const __nv_bfloat16*) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
static __device__ __forceinline__ void unpack16(uint4 u, float (&f)[8], const __half*) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}
static __device__ __forceinline__ void unpack16(uint4 u, float (&f)[4], const float*) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
}

// Elements of a pack as f32, and back (round to nearest even, as `from_f32`).
template <typename T> static __device__ __forceinline__ void unpack16(uint4 u, float (&f)[Pack16<T>::N]) {
    unpack16(u, f, static_cast<const T*>(nullptr));
}

static __device__ __forceinline__ uint4 pack16(const float (&f)[8], const __nv_bfloat16*) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}
static __device__ __forceinline__ uint4 pack16(const float (&f)[8], const __half*) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 v = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
        w[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}
static __device__ __forceinline__ uint4 pack16(const float (&f)[4], const float*) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
}

template <typename T> static __device__ __forceinline__ uint4 pack16(const float (&f)[Pack16<T>::N]) {
    return pack16(f, static_cast<const T*>(nullptr));
}

// ---- shared memory and asynchronous copies (the tensor-core kernels) ---------------------

static __device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; `valid == false` writes 16 zero bytes and reads nothing.
static __device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// 2^x on the special function unit (flush-to-zero; exp2(-inf) = 0).
static __device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ---- ldmatrix (the mma.sync kernels) ------------------------------------------------------

// 8x8 b16 matrices: lanes 8q .. 8q + 7 address the rows of matrix q; register q of lane l
// receives, without .trans, row l / 4, columns 2 (l % 4), +1 of matrix q; with .trans, rows
// 2 (l % 4), +1 of column l / 4, the lower row in the low half.
static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
static __device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
static __device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
}

// ---- mbarriers (sm_90; TMA-fed kernels) -------------------------------------------------

static __device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised mbarriers visible to the async proxy (TMA) and the other threads (with
// the __syncthreads that follows).
static __device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive and expect `bytes` more of transactions (complete_tx) in the current phase.
static __device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Wait until the phase of parity `parity` has completed.
static __device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n"
                 ".reg .pred P1;\n"
                 "LAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\n"
                 "bra LAB_WAIT;\n"
                 "DONE:\n"
                 "}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

// ---- tensor-core MMA (the flash attention kernels) --------------------------------------

// One m16n8k16 MMA with f32 accumulation, and the f32 -> packed pair conversion, per element
// type (attention_prefill.cu, attention_decode.cu).
template <typename T> struct Mma;

template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Low half = lo (the lower column), as the fragment layouts expect.
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
};

// The epilogue of the flash attention kernels (attention_prefill.cu, attention_prefill_wgmma.cu):
// O / l for the thread's two rows r0 and r0 + 8 in the m16n8 accumulator layout (n8 tile j:
// o[4 j + 2 i], o[4 j + 2 i + 1] are row r0 + 8 i, columns 8 j + 2 t4 and + 1), each row's l
// summed over the 4 lanes of its quad first. `out` points at the head's first column of row 0;
// rows >= rend and columns >= hd are not written.
template <typename T, int NO>
static __device__ __forceinline__ void flash_store(const float (&o)[4 * NO], const float (&l)[2], int r0, int rend,
                                                   T* out, int ld_out, int hd, int t4) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float sum = l[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int r = r0 + 8 * i;
        if (r >= rend) continue;
        const float inv = 1.0f / sum;
        T* orow = out + (size_t)r * ld_out;
#pragma unroll
        for (int j = 0; j < NO; ++j)
            if (8 * j < hd)
                *reinterpret_cast<uint32_t*>(orow + 8 * j + 2 * t4) =
                    Mma<T>::pack(o[4 * j + 2 * i] * inv, o[4 * j + 2 * i + 1] * inv);
    }
}

} // namespace flashrt

// Instantiate an `extern "C"` entry point `<name>_<dtype>` for each element type from a
// template kernel body `name##_impl<T>(P)`, where P is the kernel's parameter struct.
// Every such entry is PDL-ready (waits for its predecessor first).
#define FLASHRT_ENTRY(name, Params, bounds)                                                   \
    extern "C" __global__ void __launch_bounds__(bounds) name##_bf16(const Params p) {       \
        flashrt::pdl_enter();                                                                 \
        name##_impl<__nv_bfloat16>(p);                                                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bounds) name##_f16(const Params p) {        \
        flashrt::pdl_enter();                                                                 \
        name##_impl<__half>(p);                                                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bounds) name##_f32(const Params p) {        \
        flashrt::pdl_enter();                                                                 \
        name##_impl<float>(p);                                                                \
    }

// As FLASHRT_ENTRY, for a body that calls `flashrt::pdl_enter()` itself (after loading weights
// into registers, which no kernel writes, while the predecessor drains).
#define FLASHRT_ENTRY_SELF(name, Params, bounds)                                              \
    extern "C" __global__ void __launch_bounds__(bounds) name##_bf16(const Params p) {       \
        name##_impl<__nv_bfloat16>(p);                                                        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bounds) name##_f16(const Params p) {        \
        name##_impl<__half>(p);                                                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(bounds) name##_f32(const Params p) {        \
        name##_impl<float>(p);                                                                \
    }
