// flashrt kernels: step inputs.
//
// `io_scatter` is the first node of every captured step graph. The host writes one small
// pinned record `[pos, len, tokens[0..len]]` (i32) and copies it to a device staging buffer
// with ONE host-to-device copy, outside the graph; this kernel then scatters the record into
// the plan's I/O buffers `io.pos`, `io.len` and `io.tokens`, from which every later kernel reads.
// Keeping the copy outside the graph means the graph itself never touches host memory.
//
// Memory traffic: 4 * (2 + len) bytes read and written; one block.
#include "common.cuh"

struct IoScatterParams {
    const int* staging; // [2 + max_rows]: pos, len, tokens
    int* tokens;        // io.tokens [max_rows]
    int* pos;           // io.pos [1]
    int* len;           // io.len [1]
    int max_rows;
};

extern "C" __global__ void __launch_bounds__(256) io_scatter(const IoScatterParams p) {
    int n = p.staging[1];
    n = n < 0 ? 0 : (n > p.max_rows ? p.max_rows : n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) p.tokens[i] = p.staging[2 + i];
    if (threadIdx.x == 0) {
        *p.pos = p.staging[0];
        *p.len = n;
    }
}
