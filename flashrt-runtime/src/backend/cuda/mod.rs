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

pub use load::CudaSink;
pub use sample::CudaSampler;
pub use saved::CudaSaved;
use saved::{SavedRegion, Storage, alloc_on};

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
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Run prefill MoE experts as warpgroup-MMA grouped GEMMs (kernels/moe_wgmma.cu) on
    /// compute capability 9.0 (default); `false`, or any other device, uses the wmma kernels
    /// of kernels/moe.cu. Default from `FLASHRT_MOE_WGMMA` (`0` = off).
    pub moe_wgmma: bool,
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
    /// Sample non-greedy tokens on the device (kernels/sample.cu) from the row the step left
    /// in the I/O arena (default): only the id crosses to the host. `false` samples on the
    /// host from the copied row; both choose the same token. Default from
    /// `FLASHRT_DEVICE_SAMPLER` (`0` = off).
    pub device_sampler: bool,
    /// Run several rows' (verify) 16-bit `gemv` launches as the resident blocks looping over
    /// tiles, so the fused RMSNorm prologue runs once per block instead of once per tile
    /// (kernels/gemv.cu `gemv_impl`; same arithmetic per row). Off by default until measured;
    /// `FLASHRT_GEMV_TILES=1` turns it on.
    pub gemv_tiles: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        let on = |var: &str| std::env::var(var).map_or(true, |v| v != "0");
        Self {
            graphs: on("FLASHRT_CUDA_GRAPHS"),
            pdl: on("FLASHRT_PDL"),
            gemv: on("FLASHRT_GEMV"),
            attn_decode: on("FLASHRT_ATTN_DECODE"),
            attn_wgmma: on("FLASHRT_ATTN_WGMMA"),
            moe_wgmma: on("FLASHRT_MOE_WGMMA"),
            gdn_fused: on("FLASHRT_GDN_FUSED"),
            fp8_gemm: on("FLASHRT_FP8_GEMM"),
            gemv_mma: on("FLASHRT_GEMV_MMA"),
            gemv16_mma: std::env::var("FLASHRT_GEMV16_MMA").is_ok_and(|v| v == "1"),
            device_sampler: on("FLASHRT_DEVICE_SAMPLER"),
            gemv_tiles: std::env::var("FLASHRT_GEMV_TILES").is_ok_and(|v| v == "1"),
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
        let dev = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
        // Said in the name where it applies (compute capability 9.x), so every report names
        // the decode kernels it measured.
        let units = if options.gemv16_mma && major == 9 {
            ", tensor-core decode matmuls"
        } else {
            ""
        };
        Ok(Self {
            ctx,
            ordinal,
            name: format!("cuda:{ordinal} {dev} (sm_{major}{minor}){units}"),
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
    /// What its sessions share, from the first session on ([`exec`]).
    exec: Mutex<Option<Arc<Exec>>>,
    /// Ids handed to sessions (from 1), for [`exec::ExecState::owner`].
    sessions: AtomicU64,
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
    ) -> Result<Vec<(Vec<f32>, usize)>> {
        self.step_batch_cuda(sessions, tokens, positions)
    }

    fn batch_unsupported(&self) -> Option<String> {
        CudaModel::batch_unsupported(self).unwrap_or_else(|e| Some(e.to_string()))
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
            + {
                let (part, cnt) = ops::gemvm_sync_bytes(self.inner.sms);
                part + cnt
            }
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
        wgmma: model.wgmma,
        moe_wgmma: model.moe_wgmma,
        gdn_fused: model.gdn_fused,
        fp8_gemm: model.fp8_gemm,
        gemv_mma: model.gemv_mma,
        gemv16_mma: model.gemv16_mma,
        gemv_tiles: model.options.gemv_tiles,
        gemvm_part: dptr(&exec.gemvm_part),
        gemvm_cnt: dptr(&exec.gemvm_cnt),
        fp8: exec.fp8,
        batch,
    }
}

/// A captured graph, owned by exactly one session (or by the model's batched steps, under its
/// lock).
struct SessionGraph(CudaGraph);

// SAFETY: CUDA graphs need external serialisation, not thread affinity. A `SessionGraph` lives
// inside one `CudaSession`, which is `Send` but not `Sync`, so only one thread at a time can
// reach it.
unsafe impl Send for SessionGraph {}

/// Which program: the phase and the logits rows it produces.
type ProgramKey = (Phase, StepLogits);

/// One session: its state arena on the GPU, the programs of every phase, and the model's
/// shared scratch and I/O arenas and stream ([`exec`]).
pub struct CudaSession {
    model: Arc<ModelInner>,
    exec: Arc<Exec>,
    /// This session's id among the model's ([`exec::ExecState::owner`]).
    id: u64,
    /// Steps run ([`DeviceSession::steps_run`]).
    steps: u64,
    /// The model's compute stream (`exec.stream`): only used under `exec.lock()`.
    stream: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    _state: CudaSlice<u8>,
    _staging_dev: CudaSlice<u8>,
    staging_host: PinnedHostSlice<i32>,
    /// Recorded after each staging copy; the pinned record is rewritten only after it.
    staging_free: CudaEvent,
    /// Recorded before and after a device restore's copy (timing events, reused: creating an
    /// event per restore costs more than the wait); the saved buffer's home stream waits on
    /// the second, and [`DeviceSession::last_restore_seconds`] reads the pair.
    restore_start: CudaEvent,
    restore_done: CudaEvent,
    /// Whether the pair above brackets the last restore.
    restore_timed: bool,
    /// One program per phase, plus last-row-logits and no-logits variants of prefill phases.
    programs: Vec<(ProgramKey, Program)>,
    graphs: Vec<(ProgramKey, SessionGraph)>,
    /// Programs that have run once (as plain launches); the next step of one is captured.
    warm: Vec<ProgramKey>,
    state_base: u64,
    io_base: u64,
}

impl Drop for CudaSession {
    fn drop(&mut self) {
        // Graphs first, then wait for all queued work before the state arena is freed (its
        // free is stream-ordered on the copy stream, which knows nothing of the compute
        // stream's steps). Under the stream's lock: another session may be capturing there.
        let exec = self.exec.clone();
        let _guard = exec.lock();
        self.graphs.clear();
        let _ = self.model.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        let _ = self.copy.synchronize();
    }
}

/// Alignment of each region inside a saved state's buffer (lets `state_copy` use 16-byte
/// vectors; the layout already aligns regions inside the state arena).
const SAVE_ALIGN: usize = 256;

/// Segments per `state_copy` launch (kernels/state.cu `FLASHRT_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 160;

/// `state_copy`'s parameters (kernels/state.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct StateCopyParams {
    count: u32,
    pad: u32,
    seg: [[u64; 3]; MAX_SEGMENTS],
}

impl CudaSession {
    /// Copy `(src, dst, bytes)` device ranges on the copy stream with one `state_copy` launch
    /// per 160 segments (instead of one copy-engine call per region).
    ///
    /// # Safety
    /// Every range must be live device memory of this context, sources not written and
    /// destinations not accessed by other work until the copy stream passes this point.
    unsafe fn batched_copy(
        &self,
        stream: &CudaStream,
        segments: &[(u64, u64, u64)],
        what: &str,
    ) -> Result<()> {
        let func = self.model.kernels.get("state_copy")?;
        for chunk in segments.chunks(MAX_SEGMENTS) {
            let mut p = StateCopyParams {
                count: chunk.len() as u32,
                pad: 0,
                seg: [[0; 3]; MAX_SEGMENTS],
            };
            for (slot, &(src, dst, n)) in p.seg.iter_mut().zip(chunk) {
                *slot = [src, dst, n];
            }
            let largest = chunk.iter().map(|s| s.2).max().unwrap_or(0);
            // 256 threads x 16 bytes x ~8 iterations per block; at most 1024 blocks per segment.
            let blocks_x = (largest.div_ceil(256 * 16 * 8) as u32).clamp(1, 1024);
            let mut args = [&p as *const StateCopyParams as *mut std::ffi::c_void];
            // SAFETY: `state_copy` takes one by-value `StateCopyParams` (same repr(C) layout as
            // the kernel's struct, 3848 bytes, under the 4 KiB parameter limit); the ranges are
            // valid by this function's contract; `p` outlives the launch call.
            unsafe {
                cudarc::driver::result::launch_kernel(
                    func.cu_function(),
                    (blocks_x, chunk.len() as u32, 1),
                    (256, 1, 1),
                    0,
                    stream.cu_stream(),
                    &mut args,
                )
            }
            .map_err(drv(&format!("{what}: state_copy")))?;
        }
        Ok(())
    }
    fn new(model: Arc<ModelInner>) -> Result<Self> {
        let exec = exec::shared(&model)?;
        let ctx = &model.ctx;
        ctx.bind_to_thread().map_err(drv("bind context"))?;
        let layout = &model.compiled.layout;
        let stream = exec.stream.clone();
        let copy = ctx.new_stream().map_err(drv("create copy stream"))?;
        // On the copy stream, which only this session uses (see the `exec` module docs).
        let state = alloc_zeroed(&copy, layout.arena_bytes(Role::State), "state arena")?;
        let record = 2 + layout.max_rows;
        let staging_dev = alloc_zeroed(&copy, 4 * record, "input staging")?;
        // SAFETY: the pinned record is fully written (header and tokens) before any copy reads
        // the part of it that a step uses.
        let staging_host = unsafe { ctx.alloc_pinned_with_flags::<i32>(record, 0) }
            .map_err(drv("allocate pinned staging"))?;
        let staging_free = ctx.new_event(None).map_err(drv("create event"))?;
        let timing = || {
            ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("create event"))
        };
        let (restore_start, restore_done) = (timing()?, timing()?);
        copy.synchronize().map_err(drv("allocate session state"))?;

        let builder = builder(&model, &exec, dptr(&state), dptr(&staging_dev), None);
        let arenas = builder.arenas;
        let mut programs = Vec::new();
        for plan in &model.compiled.plans {
            let variants: &[StepLogits] = match plan.phase {
                Phase::Prefill { .. } => &[StepLogits::All, StepLogits::Last, StepLogits::None],
                _ => &[StepLogits::All],
            };
            for &v in variants {
                programs.push(((plan.phase, v), builder.program(plan, v)?));
            }
        }
        Ok(Self {
            state_base: arenas.state,
            io_base: arenas.io,
            id: model.sessions.fetch_add(1, Ordering::Relaxed),
            steps: 0,
            model: model.clone(),
            exec,
            stream,
            copy,
            _state: state,
            _staging_dev: staging_dev,
            staging_host,
            staging_free,
            restore_start,
            restore_done,
            restore_timed: false,
            programs,
            graphs: Vec::new(),
            warm: Vec::new(),
        })
    }

    fn bind(&self) -> Result<()> {
        self.model.ctx.bind_to_thread().map_err(drv("bind context"))
    }

    fn layout(&self) -> &flashrt_ir::Layout {
        &self.model.compiled.layout
    }

    /// Run (or capture, then run) program `idx`.
    fn launch(&mut self, idx: usize) -> Result<()> {
        let key = self.programs[idx].0;
        let phase = key.0;
        let ws = dptr(&self.exec.workspace);
        if !self.model.options.graphs {
            // SAFETY: the program addresses this session's live arenas/staging/workspace and
            // the model's weights (kept alive by `self.model`); it runs on this session's stream.
            return unsafe {
                self.programs[idx]
                    .1
                    .enqueue(&self.model.blas, ws, self.stream.cu_stream())
            };
        }
        if let Some((_, g)) = self.graphs.iter().find(|(k, _)| *k == key) {
            return g
                .0
                .launch()
                .map_err(drv(&format!("{} graph launch", phase.label())));
        }
        if !self.warm.contains(&key) {
            // A phase's first step runs as plain launches: it is a real step (no side effect is
            // wasted) and it warms up everything lazily initialised on first use — module
            // loading of our kernels and of cuBLASLt's — so that nothing but launches happens
            // while the second step is being captured.
            self.warm.push(key);
            // SAFETY: as above.
            return unsafe {
                self.programs[idx]
                    .1
                    .enqueue(&self.model.blas, ws, self.stream.cu_stream())
            };
        }
        let label = format!("{} graph capture", phase.label());
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(drv(&label))?;
        // SAFETY: as above; while capturing, the launches are recorded, not executed.
        let enqueued = unsafe {
            self.programs[idx]
                .1
                .enqueue(&self.model.blas, ws, self.stream.cu_stream())
        };
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        enqueued?;
        let graph = graph.map_err(drv(&label))?.ok_or_else(|| Error::Backend {
            op: label.clone(),
            msg: "capture produced no graph".into(),
        })?;
        graph.upload().map_err(drv(&label))?;
        graph
            .launch()
            .map_err(drv(&format!("{} graph launch", phase.label())))?;
        self.graphs.push((key, SessionGraph(graph)));
        Ok(())
    }

    /// The state regions of `set`, with the bytes a capsule at `pos` holds.
    fn regions(&self, set: RegionSet, pos: usize) -> Vec<(&Buffer, usize)> {
        self.layout()
            .state_buffers()
            .filter(|b| in_set(b, set))
            .map(|b| (b, b.used_bytes(pos)))
            .collect()
    }

    /// The generic restore path for a saved state of another type (a capsule file's host
    /// bytes, another backend's copy): validated region bytes from
    /// [`crate::host_state::host_regions`], copied host-to-device on the copy stream.
    /// Blocks until the copies are done (the bytes are pageable and dropped on return).
    fn restore_host(&mut self, saved: &dyn SavedState, set: RegionSet) -> Result<()> {
        let regions = crate::host_state::host_regions(&self.model.compiled.layout, saved, set)?;
        self.copy_after_compute("restore")?;
        for (b, bytes) in &regions {
            if !bytes.is_empty() {
                // SAFETY: the destination is the used prefix of a state region (host_regions
                // checked the length against the layout); `regions` outlives the copy because
                // the copy stream is synchronised before this function returns.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        self.state_base + b.offset as u64,
                        bytes,
                        self.copy.cu_stream(),
                    )
                }
                .map_err(drv(&format!("restore `{}`", b.name)))?;
            }
        }
        self.copy.synchronize().map_err(drv("restore"))
    }

    /// Make `copy` wait for everything queued so far on the compute stream.
    fn copy_after_compute(&self, what: &str) -> Result<()> {
        let ev = self.stream.record_event(None).map_err(drv(what))?;
        self.copy.wait(&ev).map_err(drv(what))
    }
}

/// Per-command times from the events `Program::enqueue_timed` recorded.
fn times(
    program: &ops::Program,
    events: &[cudarc::driver::CudaEvent],
    label: &str,
) -> Result<Vec<(String, f64)>> {
    program
        .cmds
        .iter()
        .zip(events.windows(2))
        .map(|(cmd, w)| {
            let ms = w[0].elapsed_ms(&w[1]).map_err(drv(label))?;
            Ok((cmd.label().to_string(), ms as f64))
        })
        .collect()
}

fn in_set(b: &Buffer, set: RegionSet) -> bool {
    match set {
        RegionSet::All => true,
        RegionSet::KvOnly => b
            .state
            .is_some_and(|k| matches!(k, StateKind::Key | StateKind::Value)),
        RegionSet::NonKv => b
            .state
            .is_some_and(|k| !matches!(k, StateKind::Key | StateKind::Value)),
    }
}

impl CudaSession {
    /// Validate a step's inputs and queue their copy into the staging record; returns the
    /// index of the phase's program.
    fn stage(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        logits: StepLogits,
    ) -> Result<usize> {
        self.bind()?;
        // A phase without the asked-for variant runs its full program (all rows are a
        // superset of what was asked).
        let idx = self
            .programs
            .iter()
            .position(|(k, _)| *k == (phase, logits))
            .or_else(|| {
                self.programs
                    .iter()
                    .position(|(k, _)| *k == (phase, StepLogits::All))
            })
            .ok_or_else(|| {
                Error::Input(format!(
                    "model `{}` has no {} plan",
                    self.layout().model,
                    phase.label()
                ))
            })?;
        let len = tokens.len();
        if len == 0 || len > phase.rows() {
            return Err(Error::Input(format!(
                "{}: {len} tokens (1..={} allowed)",
                phase.label(),
                phase.rows()
            )));
        }
        let max_seq = self.layout().max_seq;
        if pos + len > max_seq {
            return Err(Error::Input(format!(
                "{}: positions {pos}..{} exceed max_seq {max_seq}",
                phase.label(),
                pos + len
            )));
        }
        let vocab = self.model.compiled.ir.vocab;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Input(format!("token id {t} >= vocab {vocab}")));
        }
        // The previous step's staging copy must have read the pinned record before it is
        // rewritten (normally long done).
        self.staging_free.synchronize().map_err(drv("staging"))?;
        let rec = self.staging_host.as_mut_slice().map_err(drv("staging"))?;
        rec[0] = pos as i32;
        rec[1] = len as i32;
        for (d, &t) in rec[2..2 + len].iter_mut().zip(tokens) {
            *d = t as i32;
        }
        let staging = dptr(&self._staging_dev);
        // SAFETY: source is 2 + len initialised i32 of the pinned record, which stays untouched
        // until `staging_free` (recorded right after) completes; the destination is the
        // session's staging buffer of 2 + max_rows i32, len <= max_rows.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                staging,
                &rec[..2 + len],
                self.stream.cu_stream(),
            )
        }
        .map_err(drv("copy step inputs"))?;
        self.staging_free
            .record(&self.stream)
            .map_err(drv("staging"))?;
        Ok(idx)
    }
}

impl DeviceSession for CudaSession {
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn step(&mut self, phase: Phase, tokens: &[u32], pos: usize) -> Result<()> {
        self.step_logits(phase, tokens, pos, StepLogits::All)
    }

    fn step_logits(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        logits: StepLogits,
    ) -> Result<()> {
        let exec = self.exec.clone();
        let mut g = exec.lock()?;
        let idx = self.stage(phase, tokens, pos, logits)?;
        self.steps += 1;
        self.launch(idx)?;
        g.set_owner(self.id);
        Ok(())
    }

    fn steps_run(&self) -> u64 {
        self.steps
    }

    fn sample_row(&mut self, row: usize, spec: &crate::sampling::DrawSpec) -> Result<Option<u32>> {
        if !self.model.options.device_sampler {
            return Err(Error::Unsupported("device sampler off".into()));
        }
        let g = self.exec.lock()?;
        if !g.owns_row(self.id, row) {
            return Err(exec::not_owner());
        }
        let max_rows = self.layout().max_rows;
        if row >= max_rows {
            return Err(Error::Input(format!(
                "logits row {row} requested, buffer has {max_rows}"
            )));
        }
        self.bind()?;
        let vocab = self.model.compiled.ir.vocab;
        let b = self.layout().buffer(self.model.compiled.io.logits);
        let src = self.io_base + b.offset as u64 + (4 * row * vocab) as u64;
        // SAFETY: row < max_rows, so the vocab f32 at `src` lie inside io.logits, which this
        // session's last step wrote (owner checked under the lock, which is held until the
        // result is read); the workspace is the model's, sized for its vocabulary and used
        // only under the same lock.
        unsafe {
            sample::sample_on(
                &self.model.kernels,
                &self.stream,
                src,
                vocab,
                dptr(&self.exec.sample_ws),
                self.model.sms,
                spec,
            )
        }
    }

    fn step_read(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        want: StepLogits,
    ) -> Result<Vec<f32>> {
        let exec = self.exec.clone();
        let mut g = exec.lock()?;
        let idx = self.stage(phase, tokens, pos, want)?;
        self.steps += 1;
        self.launch(idx)?;
        g.set_owner(self.id);
        match want {
            StepLogits::All => self.read_logits(&mut g, tokens.len()),
            StepLogits::Last => self.read_logits_row(tokens.len() - 1),
            StepLogits::None => Ok(Vec::new()),
        }
    }

    fn profile_step(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        logits: StepLogits,
    ) -> Result<Vec<(String, f64)>> {
        let exec = self.exec.clone();
        let mut g = exec.lock()?;
        let idx = self.stage(phase, tokens, pos, logits)?;
        self.steps += 1;
        g.set_owner(self.id);
        let ws = dptr(&self.exec.workspace);
        let program = &self.programs[idx].1;
        let label = format!("{} profile", phase.label());
        // Captured as a graph with an event node between commands, so the times include what
        // a replayed step pays per node; plain launches (`graphs: false`, or when the driver
        // refuses the graph) time the launches.
        let mut graph_err = None;
        if self.model.options.graphs {
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(drv(&label))?;
            // SAFETY: as in `launch`: the program addresses this session's live buffers; the
            // launches are recorded, not executed, until the graph is launched below.
            let events = unsafe {
                program.enqueue_timed(&self.model.ctx, &self.model.blas, ws, &self.stream, true)
            };
            let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
            let run = || -> Result<Vec<cudarc::driver::CudaEvent>> {
                let events = events?;
                let graph = graph.map_err(drv(&label))?.ok_or_else(|| Error::Backend {
                    op: label.clone(),
                    msg: "capture produced no graph".into(),
                })?;
                graph.upload().map_err(drv(&label))?;
                graph.launch().map_err(drv(&label))?;
                self.stream.synchronize().map_err(drv(&label))?;
                // Elapsed times are read now, while the graph (owning the nodes) is alive.
                for w in events.windows(2) {
                    w[0].elapsed_ms(&w[1]).map_err(drv(&label))?;
                }
                Ok(events)
            };
            match run() {
                Ok(events) => return times(program, &events, &label),
                Err(e) => graph_err = Some(e),
            }
        }
        if let Some(e) = graph_err {
            eprintln!("{label}: timing inside a graph failed ({e}); timing plain launches");
        }
        // SAFETY: as above, executed directly.
        let events = unsafe {
            program.enqueue_timed(&self.model.ctx, &self.model.blas, ws, &self.stream, false)
        }?;
        self.stream.synchronize().map_err(drv(&label))?;
        times(program, &events, &label)
    }

    fn logits_row(&self, row: usize) -> Result<Vec<f32>> {
        let g = self.exec.lock()?;
        if !g.owns_row(self.id, row) {
            return Err(exec::not_owner());
        }
        self.read_logits_row(row)
    }

    fn last_restore_seconds(&self) -> Result<Option<f64>> {
        if !self.restore_timed {
            return Ok(None);
        }
        self.bind()?;
        let ms = self
            .restore_start
            .elapsed_ms(&self.restore_done)
            .map_err(drv("restore time"))?;
        Ok(Some(ms as f64 / 1e3))
    }

    fn synchronize(&self) -> Result<()> {
        let _g = self.exec.lock()?;
        self.bind()?;
        self.copy
            .synchronize()
            .map_err(drv("synchronize copy stream"))?;
        self.stream
            .synchronize()
            .map_err(drv("synchronize compute stream"))
    }

    fn logits(&self, rows: usize) -> Result<Vec<f32>> {
        let mut g = self.exec.lock()?;
        if g.owner != self.id {
            return Err(exec::not_owner());
        }
        self.read_logits(&mut g, rows)
    }

    fn reset(&mut self) -> Result<()> {
        let exec = self.exec.clone();
        let _g = exec.lock()?;
        self.reset_locked()
    }

    fn save(&self, pos: usize, set: RegionSet) -> Result<Arc<dyn SavedState>> {
        let _g = self.exec.lock()?;
        self.save_locked(pos, set)
    }

    fn restore(&mut self, saved: &dyn SavedState, set: RegionSet) -> Result<()> {
        let exec = self.exec.clone();
        let _g = exec.lock()?;
        self.restore_locked(saved, set)
    }

    fn read_region(&self, id: BufferId, pos: usize) -> Result<Vec<u8>> {
        let _g = self.exec.lock()?;
        self.read_region_locked(id, pos)
    }
}

impl CudaSession {
    /// Row `row` of `io.logits` (the caller holds the stream's lock).
    fn read_logits_row(&self, row: usize) -> Result<Vec<f32>> {
        self.bind()?;
        let max_rows = self.layout().max_rows;
        if row >= max_rows {
            return Err(Error::Input(format!(
                "logits row {row} requested, buffer has {max_rows}"
            )));
        }
        let vocab = self.model.compiled.ir.vocab;
        let b = self.layout().buffer(self.model.compiled.io.logits);
        let src = self.io_base + b.offset as u64 + (4 * row * vocab) as u64;
        let mut out = vec![0f32; vocab];
        self.stream
            .synchronize()
            .map_err(drv("step (asynchronous error)"))?;
        // SAFETY: row < max_rows, so [src, src + 4 * vocab) lies inside io.logits; `out` holds
        // vocab f32; the stream is idle and the copy into pageable memory completes before
        // the synchronize below returns.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, src, self.stream.cu_stream())
        }
        .map_err(drv("read logits row"))?;
        self.stream.synchronize().map_err(drv("read logits row"))?;
        Ok(out)
    }

    /// Rows `0..rows` of `io.logits` (the caller holds the stream's lock, `g`).
    fn read_logits(&self, g: &mut exec::ExecState, rows: usize) -> Result<Vec<f32>> {
        self.bind()?;
        let max_rows = self.layout().max_rows;
        if rows > max_rows {
            return Err(Error::Input(format!(
                "logits of {rows} rows requested, at most {max_rows}"
            )));
        }
        let vocab = self.model.compiled.ir.vocab;
        let b = self.layout().buffer(self.model.compiled.io.logits);
        let src = self.io_base + b.offset as u64;
        let mut out = vec![0f32; rows * vocab];
        self.stream
            .synchronize()
            .map_err(drv("step (asynchronous error)"))?;
        if out.len() <= BOUNCE_FLOATS {
            // One small copy (a decode step's row): straight into the vector.
            // SAFETY: io.logits holds max_rows x vocab f32 at `src`; `out` is rows x vocab with
            // rows <= max_rows; the stream is idle; a copy into pageable memory returns when
            // complete.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(&mut out, src, self.stream.cu_stream())
            }
            .map_err(drv("read logits"))?;
            self.stream.synchronize().map_err(drv("read logits"))?;
            return Ok(out);
        }
        // Large reads (every row of a prefill chunk) go through two pinned bounce buffers:
        // chunk k is copied device -> pinned while chunk k - 1 is copied pinned -> vector.
        // Pageable device-to-host copies run several times slower than pinned ones.
        let (bufs, events) = &mut g.bounce;
        let mut pending: Option<(usize, std::ops::Range<usize>)> = None;
        let ranges: Vec<_> = (0..out.len())
            .step_by(BOUNCE_FLOATS)
            .map(|a| a..(a + BOUNCE_FLOATS).min(out.len()))
            .collect();
        for (k, r) in ranges.into_iter().enumerate() {
            let i = k % 2;
            // Buffer i was last filled by chunk k - 2, which was copied out in iteration k - 1.
            let dst = &mut bufs[i].as_mut_slice().map_err(drv("read logits"))?[..r.len()];
            // SAFETY: `src + 4 * r.start` .. `+ 4 * r.end` lies inside io.logits (r.end <=
            // rows x vocab); `dst` is pinned and is not read before `events[i]` completes.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    dst,
                    src + 4 * r.start as u64,
                    self.stream.cu_stream(),
                )
            }
            .map_err(drv("read logits"))?;
            events[i].record(&self.stream).map_err(drv("read logits"))?;
            if let Some((j, pr)) = pending.take() {
                events[j].synchronize().map_err(drv("read logits"))?;
                out[pr.clone()]
                    .copy_from_slice(&bufs[j].as_slice().map_err(drv("read logits"))?[..pr.len()]);
            }
            pending = Some((i, r));
        }
        if let Some((j, pr)) = pending {
            events[j].synchronize().map_err(drv("read logits"))?;
            out[pr.clone()]
                .copy_from_slice(&bufs[j].as_slice().map_err(drv("read logits"))?[..pr.len()]);
        }
        Ok(out)
    }
}

/// The state commands, each run with the stream's lock held by its trait method above.
impl CudaSession {
    fn reset_locked(&mut self) -> Result<()> {
        self.bind()?;
        let bytes = self.layout().arena_bytes(Role::State);
        // SAFETY: the state arena is at least `bytes` long; the memset is ordered on the
        // session stream after every queued step, and restores make that stream wait for them.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.state_base,
                0,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(drv("reset state"))
    }

    fn save_locked(&self, pos: usize, set: RegionSet) -> Result<Arc<dyn SavedState>> {
        self.bind()?;
        if pos > self.layout().max_seq {
            return Err(Error::Input(format!(
                "save at position {pos} > max_seq {}",
                self.layout().max_seq
            )));
        }
        let regions = self.regions(set, pos);
        // Regions are packed at 256-byte alignment so the copy kernel moves 16-byte vectors.
        let mut saved_regions = Vec::with_capacity(regions.len());
        let mut off = 0usize;
        for (b, n) in &regions {
            saved_regions.push(SavedRegion {
                id: b.id,
                offset: off,
                bytes: *n,
            });
            off += n.div_ceil(SAVE_ALIGN) * SAVE_ALIGN;
        }
        let total = off;
        self.copy_after_compute("save")?;
        let storage = alloc_on(&self.copy, total.max(1), "saved state")?;
        let dst = dptr(&storage);
        let segments: Vec<(u64, u64, u64)> = regions
            .iter()
            .zip(&saved_regions)
            .filter(|((_, n), _)| *n > 0)
            .map(|((b, n), r)| {
                (
                    self.state_base + b.offset as u64,
                    dst + r.offset as u64,
                    *n as u64,
                )
            })
            .collect();
        // SAFETY: every source is the used prefix of a state region inside the state arena;
        // every destination range lies inside `storage` (sized to the packed total); the copy
        // stream waits for the compute stream, and the compute stream waits for `ready`.
        unsafe { self.batched_copy(&self.copy, &segments, "save")? };
        let ready = self.copy.record_event(None).map_err(drv("save"))?;
        self.stream.wait(&ready).map_err(drv("save"))?;
        let layout = self.layout();
        Ok(Arc::new(CudaSaved {
            model: layout.model.clone(),
            fingerprint: layout.fingerprint.clone(),
            pos,
            set,
            regions: saved_regions,
            total,
            location: format!("cuda:{}", self.model.ordinal),
            ordinal: self.model.ordinal,
            storage: Storage::Device(storage),
            ready: Some(ready),
            home: self.copy.clone(),
        }))
    }

    fn restore_locked(&mut self, saved: &dyn SavedState, set: RegionSet) -> Result<()> {
        self.bind()?;
        self.restore_timed = false;
        let Some(s) = saved.as_any().downcast_ref::<CudaSaved>() else {
            return self.restore_host(saved, set);
        };
        let layout = self.layout();
        if s.fingerprint != layout.fingerprint {
            return Err(Error::Fingerprint {
                capsule_model: s.model.clone(),
                capsule: s.fingerprint.clone(),
                session_model: layout.model.clone(),
                session: layout.fingerprint.clone(),
            });
        }
        let mut copies = Vec::with_capacity(s.regions.len());
        // Saved regions are in layout order, so the next one is almost always the match: the
        // lookup stays linear in the region count (restore is on the TTFT path).
        let mut next = 0;
        for b in layout.state_buffers().filter(|b| in_set(b, set)) {
            let i = match s.regions.get(next) {
                Some(r) if r.id == b.id => next,
                _ => s.regions.iter().position(|r| r.id == b.id).ok_or_else(|| {
                    Error::Capsule(format!(
                        "saved state ({:?}) has no region `{}` needed by a {set:?} restore",
                        s.set, b.name
                    ))
                })?,
            };
            next = i + 1;
            copies.push((b, &s.regions[i]));
        }
        match &s.storage {
            Storage::Device(src) => {
                if s.ordinal != self.model.ordinal {
                    return Err(Error::Unsupported(format!(
                        "restore of a state saved on cuda:{} into a session on cuda:{} (park it first)",
                        s.ordinal, self.model.ordinal
                    )));
                }
                // The copy runs on the compute stream itself: ordered after every queued step
                // and before the next, with no event between the two streams.
                if let Some(ev) = &s.ready {
                    self.stream.wait(ev).map_err(drv("restore"))?;
                }
                let base = dptr(src);
                let segments: Vec<(u64, u64, u64)> = copies
                    .iter()
                    .filter(|(_, r)| r.bytes > 0)
                    .map(|(b, r)| {
                        (
                            base + r.offset as u64,
                            self.state_base + b.offset as u64,
                            r.bytes as u64,
                        )
                    })
                    .collect();
                // SAFETY: every source lies inside the saved buffer (written before `ready`,
                // which the compute stream waited for); every destination is the prefix of a
                // state region of this session, written in stream order with the steps.
                self.restore_start
                    .record(&self.stream)
                    .map_err(drv("restore"))?;
                unsafe { self.batched_copy(&self.stream, &segments, "restore")? };
                // The saved buffer is freed (stream-ordered) on its home stream when dropped:
                // make that stream wait for these reads first.
                self.restore_done
                    .record(&self.stream)
                    .map_err(drv("restore"))?;
                s.home.wait(&self.restore_done).map_err(drv("restore"))?;
                self.restore_timed = true;
                return Ok(());
            }
            Storage::Pinned(host) => {
                self.copy_after_compute("restore")?;
                let src = host.as_slice().map_err(drv("restore"))?;
                for (b, r) in &copies {
                    if r.bytes > 0 {
                        // SAFETY: source is a range of the pinned buffer, which outlives the
                        // copy because this function synchronises the copy stream below.
                        unsafe {
                            cudarc::driver::result::memcpy_htod_async(
                                self.state_base + b.offset as u64,
                                &src[r.offset..r.offset + r.bytes],
                                self.copy.cu_stream(),
                            )
                        }
                        .map_err(drv(&format!("restore `{}`", b.name)))?;
                    }
                }
                self.copy.synchronize().map_err(drv("restore"))?;
            }
        }
        Ok(())
    }

    fn read_region_locked(&self, id: BufferId, pos: usize) -> Result<Vec<u8>> {
        self.bind()?;
        let layout = self.layout();
        if id.index() >= layout.buffers.len() {
            return Err(Error::Input(format!("no buffer {}", id.0)));
        }
        let b = layout.buffer(id);
        if b.role != Role::State {
            return Err(Error::Input(format!("`{}` is not a state region", b.name)));
        }
        let n = b.used_bytes(pos);
        let mut out = vec![0u8; n];
        self.stream
            .synchronize()
            .map_err(drv("step (asynchronous error)"))?;
        if n > 0 {
            // SAFETY: the range is the used prefix of a state region inside the state arena;
            // the stream is idle (restores make it wait for the copy stream).
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut out,
                    self.state_base + b.offset as u64,
                    self.stream.cu_stream(),
                )
            }
            .map_err(drv(&format!("read `{}`", b.name)))?;
            self.stream
                .synchronize()
                .map_err(drv(&format!("read `{}`", b.name)))?;
        }
        Ok(out)
    }
}
