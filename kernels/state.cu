// flashrt kernels: capsule snapshot / restore as ONE launch (`state_copy`).
//
// A snapshot copies every state region (K/V: only the used prefix of positions) between the
// session's state arena and a capsule buffer; a restore copies back. Issuing one
// cuMemcpyDtoDAsync per region costs a few microseconds of launch overhead each — with ~130
// regions (the Qwen3.6-27B shape) that alone is ~0.5 ms, about the whole copy floor of a
// 16k-token capsule. Here the host passes the list of (src, dst, bytes) segments by value and
// one kernel moves them all: blockIdx.y picks the segment, the blocks along x stride over its
// bytes with 16-byte vector loads/stores when source, destination and length allow it (the
// backend aligns every segment to 256 bytes on both sides), else byte by byte.
//
// Memory traffic: each byte read once and written once — the same as the copy engine, so the
// floor is bytes / (copy bandwidth / 2).
#include "common.cuh"

#define FLASHRT_MAX_SEGMENTS 160

struct Segment {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long bytes;
};

struct StateCopyParams {
    unsigned int count;
    unsigned int pad;
    Segment seg[FLASHRT_MAX_SEGMENTS];
};

extern "C" __global__ void __launch_bounds__(256) state_copy(const StateCopyParams p) {
    if (blockIdx.y >= p.count) return;
    const Segment s = p.seg[blockIdx.y];
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    if (((s.src | s.dst | s.bytes) & 15ULL) == 0) {
        const uint4* src = reinterpret_cast<const uint4*>(s.src);
        uint4* dst = reinterpret_cast<uint4*>(s.dst);
        const unsigned long long n = s.bytes >> 4;
        for (unsigned long long i = tid; i < n; i += stride) dst[i] = src[i];
    } else {
        const unsigned char* src = reinterpret_cast<const unsigned char*>(s.src);
        unsigned char* dst = reinterpret_cast<unsigned char*>(s.dst);
        for (unsigned long long i = tid; i < s.bytes; i += stride) dst[i] = src[i];
    }
}
