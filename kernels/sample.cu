// flashrt kernels: the sampler on the device (`sample_row`), bit for bit the algorithm of
// flashrt-runtime/src/sampling.rs, so that the CPU and CUDA backends choose the same token from
// the same logits and RNG state (capsules stay portable between them).
//
// Only the chosen index crosses to the host. The random number is drawn on the host (the RNG
// state lives in the capsule's SamplerState) and passed in as `draw` (53 bits); the kernel
// needs no RNG.
//
// Shape: three launches over one logits row (f32, in L2 right after the LM head wrote it):
// `sample_best` and `sample_weigh` spread over the device (the best finite logit; every
// weight, their total and the first digit's histogram, into a workspace), then
// `sample_pick`, ONE block of 1024 threads, does the selections. Every step is
// order-independent, so the result does not depend on the grid, the thread count or the
// schedule:
//   * the best finite logit is a max of IEEE total-order keys;
//   * a weight is floor(E(d) * 2^32) with E evaluated with round-to-nearest double
//     intrinsics (__dmul_rn / __dadd_rn / __dsub_rn: never contracted into an FMA), exactly
//     the operations of `portable_exp` and `weight`;
//   * sums of weights are exact 64-bit integers (a row of n < 2^32 weights <= 2^32 each);
//   * a candidate at a rank (by count for top-k, by mass for top-p and the draw) is found by
//     a radix selection on its 64-bit order key (the logit's total order above, the inverted
//     index below: a total order, ties to the smaller index), 12-bit digits high first: a
//     histogram of the measure per digit among the candidates that share the digits found so
//     far, then the digit where the running sum from the top passes the rank. Six passes
//     (12 x 5 + 4 bits) resolve the whole key: the first from the workspace's histogram, the
//     second over the row while it lists the candidates of the first digit, the rest over
//     that list only.
// Greedy draws take one launch instead (`sample_argmax`, at the end of this file).
//
// Penalties (step 0 of sampling.rs) come first, on a copy of the row: the host copies the row
// into the workspace and lists the tokens they change (`PenaltyList`: distinct ids, each with
// its count since `penalty_from`); `sample_penalize` (a thread per listed token) rewrites
// those values with the host's f32 operations, each rounded to nearest and never contracted
// (__fdiv_rn / __fmul_rn / __fsub_rn), and the three kernels above sample the copy.
#include "common.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kDigit = 12;
constexpr int kBuckets = 1 << kDigit;

constexpr double kScale = 4294967296.0;          // 2^32
constexpr double kTwo52 = 4503599627370496.0;    // 2^52
constexpr double kRound = 6755399441055744.0;    // 1.5 * 2^52
constexpr double kMinDelta = -23.0;

__device__ __forceinline__ double d_of(unsigned long long bits) { return __longlong_as_double((long long)bits); }
__device__ __forceinline__ unsigned long long bits_of(double x) { return (unsigned long long)__double_as_longlong(x); }

// sampling.rs `portable_exp`: the same IEEE operations in the same order, each rounded to
// nearest.
__device__ __forceinline__ double portable_exp(double d) {
    const double log2e = d_of(0x3ff71547652b82feull);
    const double ln2_hi = d_of(0x3fe62e42fee00000ull);
    const double ln2_lo = d_of(0x3dea39ef35793c76ull);
    const double k = __dsub_rn(__dadd_rn(__dmul_rn(d, log2e), kRound), kRound);
    const double r = __dsub_rn(__dsub_rn(d, __dmul_rn(k, ln2_hi)), __dmul_rn(k, ln2_lo));
    const unsigned long long poly[10] = {
        0x3ec71de3a556c734ull, 0x3efa01a01a01a01aull, 0x3f2a01a01a01a01aull,
        0x3f56c16c16c16c17ull, 0x3f81111111111111ull, 0x3fa5555555555555ull,
        0x3fc5555555555555ull, 0x3fe0000000000000ull, 0x3ff0000000000000ull,
        0x3ff0000000000000ull};
    double p = d_of(poly[0]);
#pragma unroll
    for (int i = 1; i < 10; i++) p = __dadd_rn(__dmul_rn(p, r), d_of(poly[i]));
    const unsigned long long biased = bits_of(__dadd_rn(k, kTwo52 + 1023.0)) - bits_of(kTwo52);
    return __dmul_rn(p, d_of(biased << 52));
}

// sampling.rs `weight`.
__device__ __forceinline__ unsigned long long weight(double d) {
    const bool inside = d >= kMinDelta;
    const double e = __dmul_rn(portable_exp(inside ? d : kMinDelta), kScale);
    const double t = __dadd_rn(e, kTwo52);
    const double rounded = __dsub_rn(t, kTwo52);
    const unsigned long long w = (bits_of(t) - bits_of(kTwo52)) - (rounded > e ? 1ull : 0ull);
    return inside ? w : 0ull;
}

__device__ __forceinline__ unsigned ord(float v) {
    const unsigned b = __float_as_uint(v);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float ord_value(unsigned o) {
    return __uint_as_float((o >> 31) ? (o & 0x7fffffffu) : ~o);
}

__device__ __forceinline__ bool finite(float v) { return isfinite(v); }

__device__ __forceinline__ unsigned long long order_key(float v, unsigned i) {
    return ((unsigned long long)ord(v) << 32) | (unsigned long long)(0xffffffffu - i);
}

struct SampleParams {
    const float* logits;
    unsigned int* out;          // [0]: the chosen index, 0xffffffff when no logit is finite
    double inv_t;               // 1 / temperature, computed on the host in f64
    unsigned long long floor_w; // min-p floor (>= 1)
    unsigned long long top_p;   // round(top_p * 2^32), when use_top_p
    unsigned long long draw;    // the RNG output >> 11
    // Workspace (zeroed by the host before the first kernel): header, first-digit
    // histogram, one weight per logit, and a list of (key, measure) pairs of up to n entries.
    unsigned long long* ws;     // [0]: best ord (low 32 bits) | finite count (high 32 bits)
                                // [1]: total weight; [2..2 + 4096): first-digit histogram
    unsigned long long* weights;
    unsigned long long* list;   // 2 * n
    unsigned int n;
    unsigned int top_k;         // 0: no top-k cut
    unsigned int use_top_p;     // top_p < 1
    unsigned int pad;
};

struct Shared {
    unsigned long long hist[kBuckets];
    unsigned long long red[kWarps];
    unsigned long long sel_base;
    unsigned long long sel_digit;
    unsigned int listed;
};

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T x, Op op, unsigned long long* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = op(x, (T)__shfl_xor_sync(0xffffffffu, x, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) red[warp] = (unsigned long long)x;
    __syncthreads();
    T r = (T)red[0];
    for (int w = 1; w < (int)(blockDim.x / 32); w++) r = op(r, (T)red[w]);
    return r;
}

__device__ __forceinline__ double z_max_of(const SampleParams& p) {
    return __dmul_rn((double)ord_value((unsigned)(p.ws[0] & 0xffffffffull)), p.inv_t);
}

// The weight of logit v (step 4 and the min-p floor of step 5; 0: not a candidate).
__device__ __forceinline__ unsigned long long weigh(const SampleParams& p, double z_max, float v) {
    if (!finite(v)) return 0;
    const unsigned long long w = weight(__dsub_rn(__dmul_rn((double)v, p.inv_t), z_max));
    return w >= p.floor_w ? w : 0;
}

// The measure of candidate i (key `key`): its weight (mass mode) or 1 (count mode) when it is
// a candidate (finite, not cut by top-k, weighing at least the floor), else 0.
struct Measure {
    bool mass;
    unsigned long long min_key; // top-k: keys below are cut (0: none)
    __device__ __forceinline__ unsigned long long of(const SampleParams& p, float v, unsigned i,
                                                     unsigned long long key) const {
        if (!finite(v) || key < min_key) return 0;
        return mass ? p.weights[i] : 1ull;
    }
};

// Warp 0 finds the digit holding rank `target` in sh.hist[0 .. nb) (from the top), given
// `base`, the measure of everything above those buckets: sh.sel_digit, and sh.sel_base = the
// measure above that digit's bucket.
__device__ __forceinline__ void pick_digit(Shared& sh, int nb, unsigned long long base,
                                           unsigned long long target) {
    if (threadIdx.x >= 32) return;
    // Lane l owns buckets [nb - (l + 1) c, nb - l c), taken from the top.
    const int lane = threadIdx.x, c = (nb + 31) / 32;
    const int hi = nb - lane * c, lo = max(nb - (lane + 1) * c, 0);
    unsigned long long sum = 0;
    for (int b = hi - 1; b >= lo; b--) sum += sh.hist[b];
    unsigned long long incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    const unsigned long long excl = incl - sum;
    // The lane whose range holds the rank: the first with base + incl > target.
    const unsigned hit = __ballot_sync(0xffffffffu, hi > lo && base + incl > target);
    if (hit && lane == __ffs(hit) - 1) {
        unsigned long long acc = base + excl;
        for (int b = hi - 1; b >= lo; b--) {
            if (acc + sh.hist[b] > target) {
                sh.sel_digit = (unsigned long long)b;
                sh.sel_base = acc;
                break;
            }
            acc += sh.hist[b];
        }
    }
}

// The candidate at rank `target` (0-based, from the top) of the measure: its key, and the
// measure of every candidate above it (`*above`). The measure's total must exceed `target`.
// `hist0`: the first digit's histogram of this measure when already known (else computed).
// Pass 0 takes the first 12 bits of the key, pass 1 the next 12 while it lists the
// candidates that share the first digit, passes 2..5 walk that list only.
__device__ unsigned long long select_rank(const SampleParams& p, const Measure& m,
                                          const unsigned long long* hist0,
                                          unsigned long long target, unsigned long long* above,
                                          Shared& sh) {
    unsigned long long prefix = 0, pmask = 0, base = 0;
    for (int pass = 0; pass < 6; pass++) {
        const int shift = pass < 5 ? 52 - 12 * pass : 0;
        const int width = pass < 5 ? kDigit : 4;
        const int nb = 1 << width;
        for (int b = threadIdx.x; b < nb; b += kThreads)
            sh.hist[b] = (pass == 0 && hist0) ? hist0[b] : 0ull;
        if (threadIdx.x == 0 && pass == 1) sh.listed = 0;
        __syncthreads();
        if (pass == 0 && !hist0) {
            for (unsigned i = threadIdx.x; i < p.n; i += kThreads) {
                const float v = p.logits[i];
                const unsigned long long key = order_key(v, i);
                const unsigned long long w = m.of(p, v, i, key);
                if (w) atomicAdd(&sh.hist[key >> 52], w);
            }
        } else if (pass == 1) {
            for (unsigned i = threadIdx.x; i < p.n; i += kThreads) {
                const float v = p.logits[i];
                const unsigned long long key = order_key(v, i);
                if ((key & pmask) != prefix) continue;
                const unsigned long long w = m.of(p, v, i, key);
                if (!w) continue;
                atomicAdd(&sh.hist[(key >> shift) & (nb - 1)], w);
                const unsigned slot = atomicAdd(&sh.listed, 1u);
                p.list[2 * slot] = key;
                p.list[2 * slot + 1] = w;
            }
        } else if (pass > 1) {
            const unsigned listed = sh.listed;
            for (unsigned j = threadIdx.x; j < listed; j += kThreads) {
                const unsigned long long key = p.list[2 * j];
                if ((key & pmask) != prefix) continue;
                atomicAdd(&sh.hist[(key >> shift) & (nb - 1)], p.list[2 * j + 1]);
            }
        }
        __syncthreads();
        pick_digit(sh, nb, base, target);
        __syncthreads();
        prefix |= sh.sel_digit << shift;
        pmask |= (unsigned long long)(nb - 1) << shift;
        base = sh.sel_base;
        // (The list written in pass 1 is read by other threads in pass 2: global writes are
        // visible to the block after the barrier above.)
    }
    *above = base;
    return prefix;
}

}  // namespace

// 1. The best finite logit (as a total-order key) and how many are finite: any grid.
extern "C" __global__ void __launch_bounds__(256) sample_best(const SampleParams p) {
    unsigned best = 0, count = 0;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x) {
        const float v = p.logits[i];
        if (finite(v)) {
            best = max(best, ord(v));
            count++;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
        count += __shfl_xor_sync(0xffffffffu, count, o);
    }
    if (threadIdx.x % 32 == 0 && count) {
        unsigned* h = reinterpret_cast<unsigned*>(p.ws);
        atomicMax(&h[0], best);
        atomicAdd(&h[1], count);
    }
}

// 2. Every logit's weight, their total and the first digit's histogram: any grid.
extern "C" __global__ void __launch_bounds__(256) sample_weigh(const SampleParams p) {
    __shared__ unsigned long long hist[kBuckets];
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const double z_max = z_max_of(p);
    unsigned long long total = 0;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x) {
        const float v = p.logits[i];
        const unsigned long long w = (p.ws[0] >> 32) ? weigh(p, z_max, v) : 0ull;
        p.weights[i] = w;
        if (w) {
            total += w;
            atomicAdd(&hist[ord(v) >> 20], w);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (threadIdx.x % 32 == 0 && total) atomicAdd(&p.ws[1], total);
    __syncthreads();
    for (int b = threadIdx.x; b < kBuckets; b += blockDim.x)
        if (hist[b]) atomicAdd(&p.ws[2 + b], hist[b]);
}

// 3. The choice: ONE block of 1024 threads.
extern "C" __global__ void __launch_bounds__(kThreads) sample_pick(const SampleParams p) {
    __shared__ Shared sh;
    const unsigned count = (unsigned)(p.ws[0] >> 32);
    if (count == 0) {
        if (threadIdx.x == 0) p.out[0] = 0xffffffffu;
        return;
    }
    Measure m{false, 0};
    unsigned long long above;
    const unsigned long long* hist0 = p.ws + 2;
    unsigned long long total = p.ws[1];
    // Top-k: the k-th best finite key is the smallest kept; the weights' total and first
    // histogram then count the kept candidates only.
    if (p.top_k > 0 && p.top_k < count) {
        m.min_key = select_rank(p, m, nullptr, p.top_k - 1, &above, sh);
        hist0 = nullptr;
        m.mass = true;
        total = 0;
        for (unsigned i = threadIdx.x; i < p.n; i += kThreads) {
            const float v = p.logits[i];
            total += m.of(p, v, i, order_key(v, i));
        }
        total = block_reduce(total, [](unsigned long long a, unsigned long long b) { return a + b; }, sh.red);
    }
    m.mass = true;
    // Top-p: the kept mass ends with the candidate at mass rank need - 1.
    unsigned long long kept = total;
    if (p.use_top_p) {
        // need = max(1, ceil(total * P / 2^32)), the product in 128 bits.
        const unsigned long long lo = total * p.top_p, hi = __umul64hi(total, p.top_p);
        unsigned long long need = (hi << 32) | (lo >> 32);
        if (lo & 0xffffffffull) need++;
        if (need == 0) need = 1;
        const unsigned long long key = select_rank(p, m, hist0, need - 1, &above, sh);
        const unsigned idx = 0xffffffffu - (unsigned)key;
        kept = above + m.of(p, p.logits[idx], idx, key);
    }
    // The draw: target = floor(u * kept / 2^53), the product in 128 bits.
    const unsigned long long lo = p.draw * kept, hi = __umul64hi(p.draw, kept);
    const unsigned long long target = (hi << 11) | (lo >> 53);
    const unsigned long long key = select_rank(p, m, hist0, target, &above, sh);
    if (threadIdx.x == 0) p.out[0] = 0xffffffffu - (unsigned)key;
}

// Greedy (sampling.rs `argmax`): the largest value that is not NaN (infinities included), the
// smallest index holding it, both zeros equal. One launch, any grid: each thread's best
// order_key (the value's total order with -0 read as +0, then the inverted index) goes into
// `ws[0]` by a 64-bit atomicMax, which the host cleared; 0 (no key: every value NaN) means none.
extern "C" __global__ void __launch_bounds__(256) sample_argmax(const SampleParams p) {
    unsigned long long best = 0;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x) {
        const float v = p.logits[i];
        if (!isnan(v)) best = max(best, order_key(v == 0.0f ? 0.0f : v, i));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (threadIdx.x % 32 == 0 && best) atomicMax(&p.ws[0], best);
}

// Step 0 on the row copy at `row`: entries[i] = (id, count since penalty_from), ids distinct.
struct PenalizeParams {
    float* row;
    const unsigned int* entries; // 2 per entry
    unsigned int count;
    unsigned int n;
    float repetition;            // used when use_repetition
    float presence;
    float frequency;
    unsigned int use_repetition;
    unsigned int counted;        // presence or frequency set
    unsigned int pad;
};

extern "C" __global__ void __launch_bounds__(256) sample_penalize(const PenalizeParams p) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < p.count; i += gridDim.x * blockDim.x) {
        const unsigned t = p.entries[2 * i], c = p.entries[2 * i + 1];
        if (t >= p.n) continue;
        float v = p.row[t];
        if (p.use_repetition) v = v > 0.0f ? __fdiv_rn(v, p.repetition) : __fmul_rn(v, p.repetition);
        if (p.counted && c > 0) v = __fsub_rn(__fsub_rn(v, p.presence), __fmul_rn(p.frequency, (float)c));
        p.row[t] = v;
    }
}
