//! The CUDA backend (feature `cuda`): one NVIDIA GPU through cudarc with dynamic loading.
//!
//! # Shape
//!
//! * [`CudaBackend`] owns a context on one device. [`CudaBackend::available`] checks that
//!   libcuda and libcublasLt can be opened *before* cudarc touches them (a missing library
//!   panics inside cudarc), then that a device exists.
//! * [`CudaBackend::weight_sink`](super::Backend::weight_sink) loads the embedded kernel
//!   fatbin ([`kernels`]), creates the cuBLASLt handle ([`gemm`]) and allocates one weight
//!   arena, which a [`CudaSink`] fills from a loader through a ring of pinned staging buffers
//!   (tensors in the model's dtype are copied as they are; others are converted on the
//!   device); random weights are generated in place.
//! * A [`CudaSession`] allocates its state arena and a small input staging record at
//!   creation; the scratch and I/O arenas, the cuBLASLt workspace (also holding split-KV
//!   attention partials), the FP8 scratch, the pinned logits bounce buffers and the compute
//!   stream are the model's, shared by all its sessions and allocated by the first one
//!   ([`exec`]: why that is safe). Nothing is allocated afterwards except the storage of
//!   saved states. At creation a session also turns every plan into a [`ops::Program`] (all
//!   checks, kernel choices, grid sizes, split counts, parameter structs and matmul
//!   algorithms decided up front).
//!
//! # Dtype
//!
//! The layout target is the model's own dtype: bf16 (the default and the fast path), f16, or
//! f32. Every kernel is instantiated for all three, and all arithmetic accumulates in f32
//! (cuBLASLt with `CUBLAS_COMPUTE_32F`; recurrent state is always f32). Honouring the declared
//! dtype costs nothing (templates) and gives an f32 mode whose results match the CPU
//! reference to rounding, which is what the op tests use to check kernel logic separately
//! from bf16 noise.
//!
//! # A step
//!
//! `step` writes `[pos, len, tokens..]` into a pinned host record and copies it to the device
//! with ONE host-to-device copy; the program's first kernel (`io_scatter`) moves it into
//! `io.pos`, `io.len`, `io.tokens`, from which every kernel reads. The ops then run either as
//! plain launches or, by default, as a CUDA graph: one graph per phase (prefill bucket or
//! decode, and the MTP draft/verify phases where present). A phase's first step runs as
//! plain launches (which also warms up lazily loaded kernels, ours and cuBLASLt's), its
//! second step is captured and launched, and every later step replays that graph. Because
//! kernels read the position and length from device memory and grids are sized for the
//! bucket, a graph is valid at every position and length — recapture is never needed.
//!
//! Capture happens on the model's non-default stream in thread-local mode, under its lock.
//! cudarc's event tracking is disabled on the context right after creation, before any
//! allocation, so no slice carries events and no hidden `cuEventRecord`/`cuStreamWaitEvent`
//! can land inside a capture; ordering between the compute stream and a session's copy
//! stream is explicit (events below).
//!
//! Graph invariants, by construction: a graph holds the addresses of the session's state
//! arena and staging record, of the shared arenas and workspace, and of the model's weights;
//! the session owns the first two and keeps an `Arc` of the rest, and graphs are dropped with
//! the session. A graph is only launched on the stream it was captured on, after the staging
//! copy of the same step.
//!
//! # Save / restore
//!
//! `save` copies the selected state regions — K/V only rows `0..pos`, one contiguous prefix
//! per region because the caches are position-major — device-to-device into one fresh device
//! buffer, on the session's copy stream: the copy stream first waits for the compute stream
//! (an event), and the compute stream then waits for the copies (another event) so a later
//! step cannot overwrite state still being read. The host does not block. `restore` mirrors
//! this. A saved state can be parked in pinned host memory ([`CudaSaved::park`]) and brought
//! back ([`CudaSaved::unpark`]); `restore` accepts either tier, and any other
//! [`SavedState`] (a capsule file's [`crate::host_state::HostSaved`], say) through the generic
//! host path, [`crate::host_state::host_regions`].
//!
//! Numerics: results agree with the CPU reference within dtype tolerance, not bit for bit;
//! each bucket's graph may use a different GEMM algorithm, so a restored session continuing
//! with decode steps is bit-identical to the original session continuing the same way (same
//! graphs, same inputs), but "restore + append == cold prefill" holds to tolerance only.

mod batch;
mod exec;
pub mod gemm;
pub mod kernels;
mod load;
pub mod ops;
mod sample;
mod saved;
mod session;

pub use load::CudaSink;
pub use sample::CudaSampler;
pub use saved::CudaSaved;
pub use session::CudaSession;
use session::SessionGraph;

use super::{
    Backend, DeviceModel, DeviceSession, QuantJob, RegionSet, SavedState, SourceDtype, StepLogits,
    WeightFill, WeightSink,
};
use crate::error::{Error, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError,
    PinnedHostSlice,
};
use exec::Exec;
use flashrt_ir::{Buffer, BufferId, Compiled, DType, ModelIr, Phase, Role, StateKind, Target};
use gemm::{Blas, GemmShape};
use kernels::Kernels;
use ops::{Arenas, Builder, Program};
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// f32 elements of each pinned bounce buffer of a session (4 MiB).
const BOUNCE_FLOATS: usize = 1 << 20;

fn drv(op: &str) -> impl FnOnce(DriverError) -> Error + '_ {
    move |e| Error::Backend {
        op: op.to_string(),
        msg: format!("{e:?}"),
    }
}

/// Device address of a slice (event tracking is off, so no synchronisation is attached).
fn dptr(s: &CudaSlice<u8>) -> u64 {
    let (p, _guard) = s.device_ptr(s.stream());
    p
}

/// A zero-filled device buffer of `bytes` (at least 1) allocated in stream order on `stream`.
fn alloc_zeroed(stream: &Arc<CudaStream>, bytes: usize, what: &str) -> Result<CudaSlice<u8>> {
    let op = format!("allocate {what} ({bytes} bytes)");
    stream.alloc_zeros::<u8>(bytes.max(1)).map_err(drv(&op))
}

/// Options of a [`CudaBackend`].
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// Run steps as captured CUDA graphs (default). `false` launches the ops one by one,
    /// which is slower but easier to debug. Default from `FLASHRT_CUDA_GRAPHS` (`0` = off).
    pub graphs: bool,
    /// Launch the kernels that support it with programmatic dependent launch (default): each
    /// may start while its predecessor drains, hiding launch latency between the many small
    /// kernels of a decode step. Default from `FLASHRT_PDL` (`0` = off).
    pub pdl: bool,
    /// Run small phases' (at most 8 rows) matmuls with flashrt's `gemv` kernel instead of
    /// cuBLASLt (default). Default from `FLASHRT_GEMV` (`0` = off).
    pub gemv: bool,
    /// Run small phases' attention with the flash-decoding kernel
    /// (kernels/attention_decode.cu) where it applies (default); `false` uses the generic
    /// split kernel of kernels/attention.cu. Default from `FLASHRT_ATTN_DECODE` (`0` = off).
    pub attn_decode: bool,
    /// Run prefill attention at head_dim 129..=256 with the warpgroup-MMA kernel
    /// (kernels/attention_prefill_wgmma.cu) on compute capability 9.0 (default); `false`, or
    /// any other device, uses the mma.sync kernel of kernels/attention_prefill.cu. Default
    /// from `FLASHRT_ATTN_WGMMA` (`0` = off).
    pub attn_wgmma: bool,
    /// Split the warpgroup-MMA prefill attention's keys over several blocks per query tile
    /// when its (heads x row tiles) grid would leave most of the device idle — short chunks
    /// after a long context (a 32-token suffix of a 16k-token prompt: 24 blocks, each walking
    /// 256 key tiles alone) — and merge the splits' softmax states with `attention_combine`
    /// (default). Default from `FLASHRT_ATTN_SPLIT` (`0` = off).
    pub attn_split: bool,
    /// Prefill chunks of fewer than 128 rows (the 32- and 64-row buckets that a stored prompt's
    /// short suffix runs) lay the query heads of one KV head side by side in each block of the
    /// warpgroup-MMA attention kernel (kernels/attention_prefill_wgmma.cu, `Packing` in
    /// ops/attention.rs): a 32-row chunk of the 27B shape filled 32 of a block's 128 query
    /// rows and read every key once per query head; packed, 96 of 128, each key once per KV
    /// head, and the few blocks split the keys 8 to 16 ways. Each row attends to the same keys
    /// in the same tiles. Default on; `FLASHRT_ATTN_PACK=0` keeps one query head a block.
    pub attn_pack: bool,
    /// Run prefill MoE experts as warpgroup-MMA grouped GEMMs (kernels/moe_wgmma.cu) on
    /// compute capability 9.0 (default); `false`, or any other device, uses the wmma kernels
    /// of kernels/moe.cu. Default from `FLASHRT_MOE_WGMMA` (`0` = off).
    pub moe_wgmma: bool,
    /// The warpgroup-MMA prefill experts over wide tiles (kernels/moe_wgmma.cu `moe_*_w2`: 128
    /// pairs x 256 weight rows, two warpgroups, persistent blocks streaming their tiles' K
    /// slabs back to back) instead of 64 x 128 tiles, one block each (default). Every prefill
    /// phase of a model uses the same kernels either way. Default from `FLASHRT_MOE_WIDE`
    /// (`0` = off).
    pub moe_wide: bool,
    /// Route a small phase's MoE block inside its up-projection launch (kernels/moe_small.cu
    /// `moe_up_routed`: every block routes every row and plans the pairs in shared memory)
    /// instead of a `moe_route` launch whose plan the up launch reads back (default). Default
    /// from `FLASHRT_MOE_ROUTE_IN_UP` (`0` = off).
    pub moe_route_in_up: bool,
    /// Run an attention layer's query / gate split, q and k norms, rotary embeddings and cache
    /// write as one launch (kernels/norm_qk.cu `qk_prep`) instead of five or six, in every
    /// phase, where the norms' shapes take their vector kernel. The same values bit for bit
    /// (tests/cuda_model.rs). Default on: decode at 2048 on the H100, 27B shape 18.36 ->
    /// 18.20 ms, 35B-A3B 3.56 -> 3.46 ms, cold TTFT unchanged (benches/RESULTS.md, 2026-12-06
    /// 15:35 UTC). Default from `FLASHRT_QK_PREP` (`0` = off).
    pub qk_prep: bool,
    /// Apply an attention layer's output gate (Qwen3.5's `out * sigmoid(gate)`) in the
    /// small-phase attention kernel's output stores (kernels/attention_decode.cu `dec_store4`)
    /// instead of a `mul` launch after it. The same values bit for bit (tests/cuda_model.rs).
    /// Off by default: it saves no time. On the H100 at the 27B shape it first cost 0.2 ms a
    /// decode step (18.57 against 18.36 ms; without PDL it saved 0.02), as the matmul after
    /// the combine then launched while the attention still held the SMs; with the combine
    /// releasing its dependant only at its end when it applies the gate it is even (17.97
    /// against 17.96 ms; batched steps 0.5 % slower at 8 rows), benches/RESULTS.md
    /// 2026-12-06 15:35 UTC. `FLASHRT_ATTN_GATE=1` turns it on.
    pub attn_gate: bool,
    /// Run small phases' Gated DeltaNet layers (causal conv, recurrence, gated RMSNorm) as
    /// one launch per layer (kernels/gated_deltanet.cu `gdn_decode_r*`, thread-block
    /// clusters) on compute capability 9.0 and later (default); `false` launches the three
    /// ops' kernels. Default from `FLASHRT_GDN_FUSED` (`0` = off).
    pub gdn_fused: bool,
    /// Run prefill matmuls over FP8 weights on the FP8 tensor cores (activations quantized
    /// per row and 128 columns, cuBLASLt block scaling) on compute capability 9.x (default);
    /// `false`, or any other device, multiplies a dequantized bf16 copy of the weight.
    /// Default from `FLASHRT_FP8_GEMM` (`0` = off).
    pub fp8_gemm: bool,
    /// Run small phases' matmuls over FP8 weights with 128-column-multiple scale blocks on the
    /// tensor cores (kernels/gemv_mma.cu `gemv8m_*`) on compute capability 9.x (default);
    /// `false`, or any other device, uses the CUDA-core `gemv8_*` of kernels/gemv.cu. Default
    /// from `FLASHRT_GEMV_MMA` (`0` = off).
    pub gemv_mma: bool,
    /// Run small phases' matmuls over bf16/f16 weights on the tensor cores
    /// (kernels/gemv_mma.cu `gemv16m_*`) on compute capability 9.x: eight rows cost about 1.5
    /// one-row steps instead of 4.9 (a batched step of 8 sessions gives 349 tokens/s against
    /// 121 at the 27B shape on the H200), but one row costs 15.1 ms against the CUDA-core
    /// kernel's 13.4 (its smaller matrices stream at 2.7-3.6 TB/s against 3.7-4.1; RESULTS.md,
    /// 2026-12-03). Off by default (latency first);
    /// every phase of a model uses the same kernel either way, so rows round alike across
    /// decode, verify and batched steps. `FLASHRT_GEMV16_MMA=1` (or the CLI's
    /// `--decode-matmuls tensor-cores`) turns it on.
    pub gemv16_mma: bool,
    /// Run small phases' matmuls over bf16/f16 weights with `gemv16s_*` (kernels/gemv.cu):
    /// the CUDA-core kernel's blocks and weight loads, the products on the tensor cores
    /// through a per-warp shared-memory transpose, so one to eight rows cost the same
    /// instructions without the stream-K kernel's fix-up at the end of every launch (compute
    /// capability 9.x). Every phase of a model uses it when on, so rows round alike across
    /// decode, verify and batched steps. Not yet measured on the H200: off by default;
    /// `FLASHRT_GEMV16_SMEM=1` turns it on (and takes precedence over `gemv16_mma`).
    pub gemv16_smem: bool,
    /// Sample tokens on the device (kernels/sample.cu; greedy ones with one `sample_argmax`
    /// launch) from the row the step left in the I/O arena (default): only the id crosses to
    /// the host. `false` samples on the host from the copied row; both choose the same token.
    /// Default from `FLASHRT_DEVICE_SAMPLER` (`0` = off).
    pub device_sampler: bool,
    /// A step whose last row's logits are kept (the runtime's `Session::append`) leaves them on
    /// the device and copies them to a pinned host row on a stream of their own behind the
    /// step, without waiting (`DeviceSession::step_deferred`): a token drawn on the device
    /// never waits for the 1 MB row (the 27B shape's vocabulary) to cross into pageable
    /// memory, and whoever wants the row on the host (logprobs, the host sampler, a capsule)
    /// waits for the copy then. Default on; `FLASHRT_DEFER_LOGITS=0` reads the row within the
    /// step, as before.
    pub defer_logits: bool,
    /// Run several rows' (verify) 16-bit `gemv` launches as the resident blocks looping over
    /// tiles, so the fused RMSNorm prologue runs once per block instead of once per tile
    /// (kernels/gemv.cu `gemv_impl`; same arithmetic per row). Off by default until measured;
    /// `FLASHRT_GEMV_TILES=1` turns it on.
    pub gemv_tiles: bool,
    /// Several rows' 16-bit `gemv` launches with a fused RMSNorm read their input rows
    /// normalised once per block from shared memory, as resident blocks looping over tiles,
    /// instead of normalising them again in every tile (kernels/gemv.cu `GEMV_STAGED`; same
    /// values, same arithmetic per row), from this many rows up (0: never). Default 2;
    /// `FLASHRT_GEMV_STAGE=0` turns it off, `=N` (N >= 2) stages launches of N rows or more
    /// (fewer rows normalise per tile, one block a tile, as at one row).
    pub gemv_stage_rows: u32,
    /// Keep each row's Gated DeltaNet states in verify passes (the fused decode kernel writes
    /// the recurrent and conv states after every row to a model-wide area of `MAX_DRAFT + 1`
    /// rows of them), so that a speculative round whose drafts are rejected rolls back with
    /// one copy instead of a replay (the runtime's `DeviceSession::keep_row_states`). Default
    /// on: on the H200 at the 27B shape a round with every draft rejected costs what its
    /// verify pass costs (1.25x a decode step at k = 1, 2.28x at k = 4) instead of 2.28x /
    /// 3.30x with a restore and replay, and a verify pass keeping them costs the same as one
    /// that does not (benches/RESULTS.md, the 2026-12-04 15:40 UTC section); the area is
    /// 0.77 GB at that shape. `FLASHRT_ROW_STATES=0` turns it off.
    pub row_states: bool,
    /// Tensor-core small-phase matmuls (kernels/gemv_mma.cu) ask the L2 for this many more
    /// 128-column steps per warp before their PDL wait, so DRAM keeps streaming while the
    /// prologue (inputs, fused norm) waits and runs: `(16-bit weights, FP8 weights)`. On the
    /// H200 at the 27B shape 4 steps take the tensor-core bf16 decode step from 15.61 to
    /// 15.34 ms, and cost the FP8 step 0.1 ms (10.14 against 10.26 ms), hence (4, 0)
    /// (benches/RESULTS.md, 2026-12-04 17:55 UTC; the same prefetch in the CUDA-core `gemv`,
    /// bytes of each weight row, was slower there and is gone). Default from
    /// `FLASHRT_GEMV16M_PREFETCH` and `FLASHRT_GEMV8M_PREFETCH`.
    pub gemvm_prefetch: (u32, u32),
    /// FP8 small-phase matmuls run on the tensor cores (`gemv_mma`) only where at most this
    /// many warps of the stream-K launch share a weight tile on average; matrices with few,
    /// long tiles (the 27B shape's down and out projections: 6.6 warps a tile) take the
    /// CUDA-core `gemv8_*`, which streams them faster at one row (26.8 / 12.3 us against
    /// 32.9 / 16.8 on the H200, RESULTS.md 2026-12-04 17:55 UTC). The choice depends on the
    /// shape alone, so every phase computes a row alike. Default 4 from
    /// `FLASHRT_GEMV8M_MAX_SPLITS` (`0`: every shape the kernel can run).
    pub gemv8m_max_splits: u32,
    /// At one row, a normalised input's matrices of a second weight format (an FP8 layer's
    /// bf16 Gated DeltaNet in_proj_b / _a, kept unquantized as the released checkpoints keep
    /// them) run as a side launch beside the first group's instead of after it: it normalises
    /// the row itself, lets the next kernel launch first and waits for its predecessor at its
    /// end (kernels/gemv.cu `gemv_entry`). The same values. On by default: the FP8 27B step
    /// 11.64 / 11.63 -> 11.60 / 11.58 ms on the H100 (one row at 2048, alternated twice;
    /// benches/RESULTS.md 2026-12-07 17:40 UTC); `FLASHRT_GEMV_SIDE=0` turns it off.
    pub gemv_side: bool,
    /// One-row CUDA-core `gemv` launches without a fused norm whose weights are at most this
    /// many bytes ask DRAM for each block's first weights before the PDL wait, so a launch's
    /// first blocks stream while its predecessor's last ones run (kernels/gemv.cu
    /// `gemv_early_chunk`; the same values). H100, one row at 2048: the 35B-A3B step 3.30 ->
    /// 3.23 ms (its 16.8 MB out_proj / o_proj), while every launch of the 27B shape (31-178
    /// MB) lost (bf16 17.96 -> 18.07 ms, FP8 11.62 -> 11.68; benches/RESULTS.md 2026-12-07
    /// 17:40 UTC), hence the limit. Default 24 MiB from `FLASHRT_GEMV_EARLY_MB` (0: none).
    pub gemv_early: usize,
    /// Prefill matmuls that read one input and write adjacent columns of one buffer from
    /// weights stored end to end (a Gated DeltaNet layer's four input projections, attention's
    /// q, k and v, an MLP's gate and up: flashrt-ir's `scratch_cols`) run as one cuBLASLt
    /// matmul over the whole weight block (`linear_group` in ops/linear.rs). A row's outputs
    /// are the same dot products; the GEMM's algorithm may differ with its width. Default on;
    /// `FLASHRT_LINEAR_GROUP=0` runs them one by one.
    pub linear_group: bool,
    /// Blocks per value head of the fused Gated DeltaNet decode kernel (1, 2 or 4: 128, 64 or
    /// 32 state columns a block; kernels/gated_deltanet.cu `gdn_decode_r*_c*`). Outputs do not
    /// depend on it. 2 on the H200: 27B decode 13.96 -> 13.53 ms, 35B-A3B 3.61 -> 3.43 ms against
    /// 1; 4 (clusters of 12 at the 27B shape) is slower there (benches/RESULTS.md, 2026-12-04
    /// 20:10 UTC). Batched steps too (their one-row blocks, `gdn_decode1_*`: 8 rows at 2048 on
    /// the H100 30.56 ms with 2, 30.62 with 4, 30.96 with 1; 2026-12-06 15:35 UTC). Any other
    /// value runs 1. Default 2 from `FLASHRT_GDN_COL_BLOCKS`.
    pub gdn_col_blocks: u32,
    /// Split the chunked Gated DeltaNet prefill kernel's per-chunk phases that do not depend
    /// on the state (q / k norms, gates, the chunk's K K^T and Q K^T products and the
    /// inverses' diagonal blocks) into one launch over every chunk and value head, the serial
    /// loop over chunks copying their results (kernels/gated_deltanet.cu `GDNC_PREP` /
    /// `GDNC_USE`; the same values: outputs and states bit-identical). Every one of a head's
    /// value-column blocks computed them again, 41 % of the kernel's time at the 27B shape
    /// (H100, benches/RESULTS.md 2026-12-06). `0`: off; `1`: on, each chunk's results copied
    /// when its turn comes; `2` (default): on, and where the launch places at most two blocks
    /// an SM, the next chunk's copied during this one (`GDNC_USE2`). Costs a buffer of value
    /// heads x chunks x 20 KiB for bf16 ([`ops::gdn_prep_bytes`]: 60 MiB at the 27B shape's
    /// 4096-row bucket). Default from `FLASHRT_GDN_PREP`.
    pub gdn_prep: u32,
    /// Prefill buckets of at least this many rows run the chunked Gated DeltaNet kernel (one
    /// padded 64-row chunk for a 32-row bucket); smaller ones the token-by-token kernel. 32: a
    /// stored prompt's 32-token suffix spent 2.5 ms of its 25.5 ms profile (22.7 unprofiled) in
    /// the token kernel's 48 launches at the 27B shape (52 us each, H100, benches/RESULTS.md
    /// 2026-12-07 22:14 UTC), where the
    /// chunk kernel and its records took 1.2 ms for a 64-row chunk. The chunk kernel's bf16
    /// operands drift further from the f32 reference than the token kernel's f32 state (both
    /// within the reference implementation's own bf16 drift: the GPU tests
    /// `bf16_tracks_cpu_reference`, `bf16_chunked_prefill_tracks_cpu_reference`). Default from
    /// `FLASHRT_GDN_CHUNK_ROWS` (64: the kernel choice before 2026-12-07).
    pub gdn_chunk_rows: usize,
    /// Keep device memory freed by stream-ordered frees in the device's memory pool for the
    /// next allocation (release threshold: unlimited) instead of the driver's default of
    /// handing it back to the system at every synchronisation. A server allocates and frees
    /// capsule-sized buffers all the time (a 16k-token capsule of the 27B shape is 1.2 GiB):
    /// with the default, each snapshot after an eviction maps fresh pages on the worker
    /// thread and each synchronisation after a free unmaps them. [`Backend::memory_available`]
    /// trims the pool first, so free memory reads as before. Default off (`FLASHRT_POOL_KEEP=1`
    /// turns it on): on the H200 it changed none of the served path's figures (2k / 16k stored
    /// prefix + 1 and + 32, exact repeats, streamed decode: benches/RESULTS.md, 2026-12-05),
    /// so the driver's default stays.
    pub pool_keep: bool,
    /// Bytes of the next matmul's weights that a latency-bound launch before it (the fused
    /// Gated DeltaNet decode block, the split-KV attention decode kernel) asks of the L2 before
    /// its PDL wait (`cp.async.bulk.prefetch.L2`, shared over its blocks), so that DRAM keeps
    /// streaming weights while those launches compute and the matmul after them starts on L2
    /// hits; at most a quarter of the matrix, and none in batched steps (the program builder's
    /// `next_weights_after` says why). Nothing changes in what is computed. 16 MiB: a 27B
    /// decode step 13.12 -> 12.96 ms on the H200 and 17.98 -> 17.77 on the H100, the 35B-A3B
    /// step 3.45 -> 3.43 on the H100 (benches/RESULTS.md, 2026-12-06 21:36 and 22:37 UTC).
    /// Default from `FLASHRT_PREFETCH_NEXT_MB` (MiB; 0 = off).
    pub prefetch_next: usize,
    /// Bytes of the next layer's first matmul that a one-row MoE block's routed up launch
    /// (kernels/moe_small.cu) asks of the L2 before its PDL wait: DRAM is otherwise nearly idle
    /// while the router launch and the up launch's routing run (~10 us a layer at the
    /// 35B-A3B shape, benches/RESULTS.md 2026-12-07), and the experts' weights stream past the
    /// L2 with the evict-first policy (`MOE_EVICT_FIRST`) so that what was asked for is still
    /// there when the next layer's projection reads it. None in batched steps. 32 MiB: the
    /// 35B-A3B decode step 3.25 / 3.26 -> 3.23 / 3.22 ms on the H100 (16 MiB: 3.24 / 3.24; without
    /// the evict-first loads it costs time, 3.41 -> 3.51 / 3.49: benches/RESULTS.md 2026-12-07
    /// 12:13). Nothing changes in what is computed (GPU test
    /// `moe_prefetch_changes_nothing_computed`). Default from `FLASHRT_MOE_PREFETCH_MB` (MiB;
    /// 0 = off).
    pub moe_prefetch: usize,
    /// Batched steps' split-KV attention decode with each (KV head, split) block running the
    /// step's rows one after another (kernels/attention_decode.cu `attention_decode_rows_d*`:
    /// a ring that streams the next row's keys while this row's key groups merge) instead of
    /// one block per (head, split, row): at the 27B shape 8 rows made 8 waves of one-SM blocks.
    /// Each row computes exactly what its session's one-row step computes. 8-row steps on the
    /// H100: 29.50 -> 29.21 ms (CUDA-core matmuls), 24.99 -> 24.79 (tensor cores;
    /// benches/RESULTS.md, 2026-12-06 22:37 UTC). Default on; `FLASHRT_ATTN_ROWS=0` launches a
    /// block per row.
    pub attn_rows: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        let on = |var: &str| std::env::var(var).map_or(true, |v| v != "0");
        let num = |var: &str, default: u32| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(default)
        };
        Self {
            graphs: on("FLASHRT_CUDA_GRAPHS"),
            pdl: on("FLASHRT_PDL"),
            gemv: on("FLASHRT_GEMV"),
            attn_decode: on("FLASHRT_ATTN_DECODE"),
            attn_wgmma: on("FLASHRT_ATTN_WGMMA"),
            attn_split: on("FLASHRT_ATTN_SPLIT"),
            attn_pack: on("FLASHRT_ATTN_PACK"),
            moe_wgmma: on("FLASHRT_MOE_WGMMA"),
            moe_wide: on("FLASHRT_MOE_WIDE"),
            moe_route_in_up: on("FLASHRT_MOE_ROUTE_IN_UP"),
            qk_prep: on("FLASHRT_QK_PREP"),
            attn_gate: std::env::var("FLASHRT_ATTN_GATE").is_ok_and(|v| v == "1"),
            gdn_fused: on("FLASHRT_GDN_FUSED"),
            fp8_gemm: on("FLASHRT_FP8_GEMM"),
            gemv_mma: on("FLASHRT_GEMV_MMA"),
            gemv16_mma: std::env::var("FLASHRT_GEMV16_MMA").is_ok_and(|v| v == "1"),
            gemv16_smem: std::env::var("FLASHRT_GEMV16_SMEM").is_ok_and(|v| v == "1"),
            device_sampler: on("FLASHRT_DEVICE_SAMPLER"),
            defer_logits: on("FLASHRT_DEFER_LOGITS"),
            gemv_tiles: std::env::var("FLASHRT_GEMV_TILES").is_ok_and(|v| v == "1"),
            gemv_stage_rows: match num("FLASHRT_GEMV_STAGE", 2) {
                0 => 0,
                n => n.max(2),
            },
            row_states: on("FLASHRT_ROW_STATES"),
            gemvm_prefetch: (
                num("FLASHRT_GEMV16M_PREFETCH", 4),
                num("FLASHRT_GEMV8M_PREFETCH", 0),
            ),
            gemv8m_max_splits: num("FLASHRT_GEMV8M_MAX_SPLITS", 4),
            gemv_side: num("FLASHRT_GEMV_SIDE", 1) != 0,
            gemv_early: (num("FLASHRT_GEMV_EARLY_MB", 24) as usize) << 20,
            linear_group: num("FLASHRT_LINEAR_GROUP", 1) != 0,
            gdn_col_blocks: num("FLASHRT_GDN_COL_BLOCKS", 2),
            gdn_prep: num("FLASHRT_GDN_PREP", 2),
            gdn_chunk_rows: num("FLASHRT_GDN_CHUNK_ROWS", 32) as usize,
            pool_keep: std::env::var("FLASHRT_POOL_KEEP").is_ok_and(|v| v == "1"),
            prefetch_next: (num("FLASHRT_PREFETCH_NEXT_MB", 16) as usize) << 20,
            moe_prefetch: (num("FLASHRT_MOE_PREFETCH_MB", 32) as usize) << 20,
            attn_rows: on("FLASHRT_ATTN_ROWS"),
        }
    }
}

/// One CUDA device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    options: CudaOptions,
}

fn libraries_present() -> std::result::Result<(), &'static str> {
    // SAFETY: these only try to open the shared libraries by their candidate names (dlopen);
    // no CUDA function is called and nothing is cached on failure.
    let (driver, lt) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::cublaslt::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err("the CUDA driver library (libcuda.so) was not found");
    }
    if !lt {
        return Err("the cuBLASLt library (libcublasLt.so) was not found");
    }
    Ok(())
}

/// The device's default memory pool (the one stream-ordered allocations draw from).
fn default_pool(
    ctx: &CudaContext,
) -> std::result::Result<cudarc::driver::sys::CUmemoryPool, String> {
    use cudarc::driver::sys;
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer; the device handle is the context's own.
    let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuDeviceGetDefaultMemPool: {r:?}"));
    }
    Ok(pool)
}

/// Let the default pool keep up to `bytes` of freed memory across synchronisations.
fn set_pool_release_threshold(ctx: &CudaContext, bytes: u64) -> std::result::Result<(), String> {
    use cudarc::driver::sys;
    let pool = default_pool(ctx)?;
    let mut v: u64 = bytes;
    // SAFETY: the release threshold attribute takes a pointer to a cuuint64_t, which `v` is,
    // live for the call.
    let r = unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut v as *mut u64).cast(),
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuMemPoolSetAttribute(release threshold): {r:?}"));
    }
    Ok(())
}

/// Hand the default pool's unused memory back to the system.
fn trim_pool(ctx: &CudaContext) -> std::result::Result<(), String> {
    use cudarc::driver::sys;
    let pool = default_pool(ctx)?;
    // SAFETY: a pool handle from the driver; trimming frees only memory no allocation uses.
    let r = unsafe { sys::cuMemPoolTrimTo(pool, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("cuMemPoolTrimTo: {r:?}"));
    }
    Ok(())
}

impl CudaBackend {
    /// Whether a CUDA device can be used: libcuda and libcublasLt load, the driver
    /// initialises and reports at least one device. Never panics.
    pub fn available() -> bool {
        libraries_present().is_ok()
            && cudarc::driver::result::init().is_ok()
            && CudaContext::device_count().is_ok_and(|n| n > 0)
    }

    /// A backend on device `ordinal` with default [`CudaOptions`].
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, CudaOptions::default())
    }

    pub fn with_options(ordinal: usize, options: CudaOptions) -> Result<Self> {
        libraries_present()
            .map_err(|m| Error::Unsupported(format!("CUDA backend unavailable: {m}")))?;
        let ctx = CudaContext::new(ordinal).map_err(drv("create CUDA context"))?;
        // SAFETY: called before this context object allocates anything, so no slice ever
        // carries tracking events; every cross-stream dependency in this backend is an
        // explicit event (see the module docs), and no slice is freed while another stream
        // may still use it (sessions synchronise their streams before dropping arenas; saved
        // states make their home stream wait for every restore that reads them).
        unsafe { ctx.disable_event_tracking() };
        if options.pool_keep
            && let Err(e) = set_pool_release_threshold(&ctx, u64::MAX)
        {
            tracing::debug!("keeping freed device memory in the pool: {e}");
        }
        let dev = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
        // Said in the name where it applies (compute capability 9.x), so every report names
        // the decode kernels it measured.
        let units = if options.gemv16_smem && major == 9 {
            ", tensor-core decode matmuls (gemv16s)"
        } else if options.gemv16_mma && major == 9 {
            ", tensor-core decode matmuls"
        } else {
            ""
        };
        // The attention fusions where they differ from the defaults.
        let fused = match (options.qk_prep, options.attn_gate) {
            (true, true) => ", attention gate fused",
            (true, false) => "",
            (false, true) => ", no qk_prep, attention gate fused",
            (false, false) => ", no qk_prep",
        };
        Ok(Self {
            ctx,
            ordinal,
            name: format!("cuda:{ordinal} {dev} (sm_{major}{minor}){units}{fused}"),
            options,
        })
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    /// The model's own dtype (bf16 by default; f16 and f32 also run). See the module docs.
    fn target(&self, ir: &ModelIr) -> Target {
        let dtype = match ir.dtype {
            DType::I32 => DType::Bf16,
            d => d,
        };
        Target { dtype }
    }

    fn weight_sink(&self, compiled: &Compiled) -> Result<Box<dyn WeightSink>> {
        Ok(Box::new(CudaSink::new(self, compiled)?))
    }

    fn load_random(&self, compiled: Arc<Compiled>, seed: u64) -> Result<Arc<dyn DeviceModel>> {
        let mut sink = CudaSink::new(self, &compiled)?;
        sink.fill_random(&compiled, seed)?;
        Box::new(sink).finish(compiled)
    }

    fn memory_available(&self) -> Option<usize> {
        self.ctx.bind_to_thread().ok()?;
        // What the pool holds unused is available: hand it back first, so free memory reads
        // the same whether or not the pool keeps freed memory (`CudaOptions::pool_keep`).
        if self.options.pool_keep
            && let Err(e) = trim_pool(&self.ctx)
        {
            tracing::debug!("trimming the device memory pool: {e}");
        }
        cudarc::driver::result::mem_get_info()
            .ok()
            .map(|(free, _)| free)
    }

    fn copy_seconds(&self, bytes: usize, iters: usize) -> Result<f64> {
        self.device_copy_seconds(bytes, iters)
    }

    fn matmul_flops(&self, dtype: DType) -> Result<f64> {
        self.device_matmul_flops(dtype, 8192, 10)
    }
}

/// `init_random`'s parameters (kernels/init.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct InitParams {
    out: u64,
    n: u64,
    seed: u64,
    buffer: u32,
    kind: u32,
    a: f64,
    b: f64,
}

impl CudaBackend {
    /// Seconds one device-to-device copy of `bytes` takes (median of `iters`, timed with
    /// events after a warm-up): the copy floor capsule snapshots and restores are held to.
    pub fn device_copy_seconds(&self, bytes: usize, iters: usize) -> Result<f64> {
        self.ctx.bind_to_thread().map_err(drv("bind context"))?;
        let stream = self.ctx.new_stream().map_err(drv("create stream"))?;
        let src = alloc_zeroed(&stream, bytes.max(1), "copy probe source")?;
        let dst = alloc_zeroed(&stream, bytes.max(1), "copy probe destination")?;
        let (s, d) = (dptr(&src), dptr(&dst));
        let start = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("event"))?;
        let end = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("event"))?;
        let mut times = Vec::with_capacity(iters.max(1));
        for i in 0..iters.max(1) + 2 {
            start.record(&stream).map_err(drv("event"))?;
            // SAFETY: both allocations hold `bytes` bytes and are only used by this stream.
            unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, bytes, stream.cu_stream()) }
                .map_err(drv("copy probe"))?;
            end.record(&stream).map_err(drv("event"))?;
            end.synchronize().map_err(drv("copy probe"))?;
            if i >= 2 {
                times.push(start.elapsed_ms(&end).map_err(drv("event time"))? as f64 / 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// FLOP/s of an `n x n x n` product through the same cuBLASLt path as `Linear` (f32
    /// accumulation), median of `iters` after warm-ups, on zeroed operands (a product's time
    /// does not depend on the values' magnitudes here; only its rounding would).
    pub fn device_matmul_flops(&self, dtype: DType, n: usize, iters: usize) -> Result<f64> {
        self.ctx.bind_to_thread().map_err(drv("bind context"))?;
        let stream = self.ctx.new_stream().map_err(drv("create stream"))?;
        let bytes = n * n * dtype.size();
        let w = alloc_zeroed(&stream, bytes, "matmul probe weight")?;
        let x = alloc_zeroed(&stream, bytes, "matmul probe input")?;
        let out = alloc_zeroed(&stream, n * n * dtype.size().max(2), "matmul probe output")?;
        let ws = alloc_zeroed(&stream, gemm::WORKSPACE_BYTES, "matmul probe workspace")?;
        let blas = Blas::new()?;
        // FP8: the block-scaled W8A8 matmul of FP8 weights' prefill (bf16 out), its scales
        // (zeros, like the operands) in their own buffers.
        let scales = alloc_zeroed(&stream, 4 * n * n.div_ceil(128), "matmul probe scales")?;
        let g = if dtype == DType::F8E4m3 {
            let w_scale = dptr(&scales);
            let x_scale = w_scale + 4 * (n.div_ceil(128) * n.div_ceil(128)) as u64;
            blas.gemm_fp8(
                gemm::Fp8GemmShape {
                    out_dtype: DType::Bf16,
                    n: n as u64,
                    k: n as u64,
                    rows: n as u64,
                    ld_out: n as i64,
                    align_out: 256,
                },
                w_scale,
                x_scale,
            )?
        } else {
            blas.gemm(GemmShape {
                in_dtype: dtype,
                out_dtype: dtype,
                n: n as u64,
                k: n as u64,
                rows: n as u64,
                ld_x: n as i64,
                ld_out: n as i64,
                align_w: 256,
                align_x: 256,
                align_out: 256,
                tf32: false,
            })?
        };
        let event = || {
            self.ctx
                .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event"))
        };
        let (start, end) = (event()?, event()?);
        let mut times = Vec::with_capacity(iters.max(1));
        for i in 0..iters.max(1) + 2 {
            start.record(&stream).map_err(drv("event"))?;
            // SAFETY: the three operands hold n x n elements of `dtype`, the workspace is
            // WORKSPACE_BYTES long; everything lives on this stream only.
            unsafe {
                blas.run(
                    &g,
                    dptr(&w),
                    dptr(&x),
                    dptr(&out),
                    false,
                    dptr(&ws),
                    stream.cu_stream(),
                )
            }?;
            end.record(&stream).map_err(drv("event"))?;
            end.synchronize().map_err(drv("matmul probe"))?;
            if i >= 2 {
                times.push(start.elapsed_ms(&end).map_err(drv("event time"))? as f64 / 1e3);
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(2.0 * (n as f64).powi(3) / times[times.len() / 2])
    }
}

struct ModelInner {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    compiled: Arc<Compiled>,
    kernels: Kernels,
    blas: Blas,
    weight_base: u64,
    _weights: CudaSlice<u8>,
    options: CudaOptions,
    /// Multiprocessor count of the device.
    sms: usize,
    /// Prefill attention through the sm_90a warpgroup-MMA kernel.
    wgmma: bool,
    moe_wgmma: bool,
    gdn_fused: bool,
    fp8_gemm: bool,
    gemv_mma: bool,
    gemv16_mma: bool,
    gemv16_smem: bool,
    /// Verify passes keep each row's states (`CudaOptions::row_states` with the fused Gated
    /// DeltaNet kernel): the regions and the bytes of one row of the area.
    row_layout: Option<(Vec<(BufferId, u64)>, u64)>,
    /// What its sessions share, from the first session on ([`exec`]).
    exec: Mutex<Option<Arc<Exec>>>,
    /// Ids handed to sessions (from 1), for [`exec::ExecState::owner`].
    sessions: AtomicU64,
    /// Whether the next batched step is timed per command (`DeviceModel::profile_next_batch`;
    /// one relaxed load per batched step), and the `(label, ms)` times of the last one that was.
    batch_profile_next: AtomicBool,
    batch_profile: Mutex<Option<Vec<(String, f64)>>>,
}

impl ModelInner {
    /// Device bytes of the row-state area (`CudaOptions::row_states`): a row of kept states
    /// for every row a verify pass has.
    /// The chunked Gated DeltaNet kernel's chunk records (0 when off).
    fn gdn_prep_bytes(&self) -> usize {
        if self.options.gdn_prep > 0 {
            ops::gdn_prep_bytes(&self.compiled, self.options.gdn_chunk_rows)
        } else {
            0
        }
    }

    fn row_area_bytes(&self) -> usize {
        self.row_layout.as_ref().map_or(0, |(_, row)| {
            *row as usize * (flashrt_ir::lower::MAX_DRAFT + 1)
        })
    }
}

/// A model whose weights are on one GPU.
pub struct CudaModel {
    inner: Arc<ModelInner>,
}

impl DeviceModel for CudaModel {
    fn compiled(&self) -> &Arc<Compiled> {
        &self.inner.compiled
    }

    fn backend_name(&self) -> String {
        self.inner.name.clone()
    }

    fn new_session(&self) -> Result<Box<dyn DeviceSession>> {
        Ok(Box::new(CudaSession::new(self.inner.clone())?))
    }

    /// The state arena and the input staging record: scratch, I/O, workspace and FP8 scratch
    /// are shared ([`exec`]). Graphs' own device memory comes on top (measured by `flashrt
    /// bench --sessions`).
    fn session_bytes(&self) -> usize {
        let layout = &self.inner.compiled.layout;
        layout.arena_bytes(Role::State) + 4 * (2 + layout.max_rows)
    }

    fn step_batch(
        &self,
        sessions: &mut [&mut dyn DeviceSession],
        tokens: &[u32],
        positions: &[usize],
    ) -> Result<Vec<(Option<Vec<f32>>, usize)>> {
        self.step_batch_cuda(sessions, tokens, positions)
    }

    fn batch_unsupported(&self) -> Option<String> {
        CudaModel::batch_unsupported(self).unwrap_or_else(|e| Some(e.to_string()))
    }

    fn profile_next_batch(&self) -> Result<()> {
        if let Ok(mut p) = self.inner.batch_profile.lock() {
            *p = None;
        }
        self.inner.batch_profile_next.store(true, Ordering::Relaxed);
        Ok(())
    }

    fn take_batch_profile(&self) -> Option<Vec<(String, f64)>> {
        self.inner
            .batch_profile_next
            .store(false, Ordering::Relaxed);
        self.inner.batch_profile.lock().ok()?.take()
    }

    fn shared_bytes(&self) -> usize {
        let layout = &self.inner.compiled.layout;
        let (a, b, c) = ops::fp8_scratch_needs(
            &self.inner.compiled,
            self.inner.fp8_gemm,
            self.inner.options.gemv,
        );
        layout.arena_bytes(Role::Scratch)
            + layout.arena_bytes(Role::Io)
            + gemm::WORKSPACE_BYTES
            + a
            + b
            + c
            + sample::workspace_bytes(self.inner.compiled.ir.vocab)
            + ops::gemvm_sync_bytes(self.inner.sms)
            + self.inner.row_area_bytes()
            + self.inner.gdn_prep_bytes()
    }
}

/// The program builder of a session whose state arena is at `state` (0 for a batched step,
/// whose state addresses are offsets) and whose staging record is at `staging`.
fn builder<'a>(
    model: &'a ModelInner,
    exec: &Exec,
    state: u64,
    staging: u64,
    batch: Option<ops::BatchTables>,
) -> Builder<'a> {
    Builder {
        compiled: &model.compiled,
        kernels: &model.kernels,
        blas: &model.blas,
        arenas: Arenas {
            weight: model.weight_base,
            state,
            scratch: exec.scratch_base,
            io: exec.io_base,
        },
        staging,
        workspace: dptr(&exec.workspace),
        sms: model.sms,
        pdl: model.options.pdl,
        gemv: model.options.gemv,
        attn_decode: model.options.attn_decode,
        attn_split: model.options.attn_split,
        attn_pack: model.options.attn_pack,
        gdn_chunk_rows: model.options.gdn_chunk_rows,
        wgmma: model.wgmma,
        moe_wgmma: model.moe_wgmma,
        moe_wide: model.options.moe_wide,
        moe_route_in_up: model.options.moe_route_in_up,
        qk_prep: model.options.qk_prep,
        attn_gate: model.options.attn_gate,
        attn_rows: model.options.attn_rows,
        gdn_fused: model.gdn_fused,
        fp8_gemm: model.fp8_gemm,
        gemv_mma: model.gemv_mma,
        gemv16_mma: model.gemv16_mma,
        gemv16_smem: model.gemv16_smem,
        gemv_tiles: model.options.gemv_tiles,
        gemv_stage_rows: model.options.gemv_stage_rows,
        gemvm_prefetch: model.options.gemvm_prefetch,
        gemv8m_max_splits: model.options.gemv8m_max_splits,
        gemv_side: model.options.gemv_side,
        gemv_early: model.options.gemv_early,
        linear_group: model.options.linear_group,
        gdn_col_blocks: model.options.gdn_col_blocks,
        prefetch_next: model.options.prefetch_next,
        moe_prefetch: model.options.moe_prefetch,
        next_weights: std::cell::Cell::new((0, 0)),
        gemvm_part: dptr(&exec.gemvm_part),
        gdn_prep: exec
            .gdn_prep
            .as_ref()
            .map_or((0, 0), |b| (dptr(b), b.len())),
        gdn_prep_double: model.options.gdn_prep >= 2,
        fp8: exec.fp8,
        batch,
        row_states: match (&model.row_layout, &exec.row_area) {
            (Some((offsets, row_bytes)), Some(area)) if batch.is_none() => {
                Some(ops::RowStateArea {
                    base: dptr(area),
                    row_bytes: *row_bytes,
                    offsets: offsets.clone(),
                })
            }
            _ => None,
        },
    }
}
