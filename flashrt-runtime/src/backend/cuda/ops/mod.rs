//! Plan ops -> device commands.
//!
//! A session turns each plan into a [`Program`] once, when it is created: every op is checked
//! against the layout (views inside their buffers, dtypes, supported sizes), its kernel
//! chosen, its grid sized for the plan's bucket rows and its parameter struct filled with the
//! session's arena addresses; every `Linear` gets its cuBLASLt matmul (descriptors +
//! heuristic algorithm). Running a program is then nothing but enqueueing launches, which is
//! what graph capture records — no allocation, host copy or decision is left for capture
//! time (flashinfer's plan/run split).
//!
//! Each kernel takes one parameter struct by value. The structs below are `#[repr(C)]` and
//! mirror the ones in `kernels/*.cu` field for field (pointers as `u64`, `int` as `i32`,
//! `float` as `f32`, `double` as `f64`, in the same order), so both sides have the same
//! layout.
//!
//! The builders are split by kernel family, as `kernels/*.cu` is: `linear.rs` (a bucket's
//! matmuls: cuBLASLt, the FP8 path in `fp8.rs`), `gemv.rs` (small phases' matmuls,
//! kernels/gemv.cu and gemv_mma.cu), `attention.rs` (kernels/attention.cu, attention_decode.cu) and
//! `attention_prefill.rs` (kernels/attention_prefill*.cu), `conv.rs`
//! (kernels/conv.cu), `gated_deltanet.rs` (the recurrence, and a small phase's conv +
//! recurrence + gated norm as one launch), `mamba2.rs`, `moe.rs` (kernels/moe.cu,
//! moe_small.cu and moe_wgmma.cu), `norm.rs` (kernels/norm.cu), `qk_prep.rs` (an attention
//! layer's per-head work in one launch, kernels/norm_qk.cu), `elementwise.rs` (kernels/elementwise.cu:
//! products, activations, head splits, state rows), `embed.rs` and `rope.rs`. Adding an op
//! touches its family's file and the dispatch in `Builder::op`; the program, the shared
//! helpers and the dispatch are here.

use super::gemm::{self, Blas, GemmShape, LtGemm};
use super::kernels::Kernels;
use crate::backend::StepLogits;
use crate::error::{Error, Result};
use cudarc::driver::{CudaFunction, sys};
use flashrt_ir::{
    Act, Buffer, BufferId, Compiled, DType, GateOrder, NormWeight, Op, Plan, Role, View,
};

mod attention;
mod attention_prefill;
mod conv;
mod elementwise;
mod embed;
mod fp8;
mod gated_deltanet;
mod gemv;
mod linear;
pub(super) use gated_deltanet::gdn_prep_bytes;
pub(super) use gemv::gemvm_sync_bytes;
mod mamba2;
mod moe;
mod norm;
mod qk_prep;
mod rope;
pub use fp8::{Fp8DequantParams, Fp8GridParams, Fp8QuantizeParams, Fp8Scratch, fp8_scratch_needs};
use gemv::*;
use moe::MoeOp;

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Arc;

// ---- parameter structs (mirrors of kernels/*.cu) ---------------------------------------

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IoScatterParams {
    pub staging: u64,
    pub tokens: u64,
    pub pos: u64,
    pub len: u64,
    pub max_rows: i32,
}

/// A parameter struct as 8-byte words (the structs hold 8-byte pointers, so their alignment
/// is 8 and the copy keeps it).
pub struct ParamBytes(Vec<u64>);

impl ParamBytes {
    pub fn of<T: Copy>(v: &T) -> Self {
        let n = std::mem::size_of::<T>().div_ceil(8);
        let mut words = vec![0u64; n];
        // SAFETY: `words` has at least size_of::<T>() bytes; T is Copy plain data (repr(C)
        // structs of integers and floats), so its bytes may be copied verbatim; padding bytes
        // are copied as whatever they hold and never read by the kernel.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v as *const T as *const u8,
                words.as_mut_ptr() as *mut u8,
                std::mem::size_of::<T>(),
            );
        }
        Self(words)
    }
}

/// One kernel launch.
pub struct KernelCmd {
    pub label: String,
    pub func: CudaFunction,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, bytes (the function's opt-in maximum was raised to at
    /// least this when the command was built).
    pub shared: u32,
    /// Launch with programmatic stream serialisation (PDL): the kernel may start while its
    /// predecessor drains; it waits for it in `flashrt::pdl_wait()` (kernels.rs lists which
    /// kernels do).
    pub pdl: bool,
    pub params: ParamBytes,
}

/// One matmul.
pub struct GemmCmd {
    pub label: String,
    pub gemm: Arc<LtGemm>,
    pub w: u64,
    pub x: u64,
    pub out: u64,
    pub accumulate: bool,
}

pub enum Cmd {
    Kernel(KernelCmd),
    Gemm(GemmCmd),
}

/// A plan, ready to enqueue.
pub struct Program {
    pub cmds: Vec<Cmd>,
    /// Every state region the program writes is also kept after each of its rows in the
    /// model's row-state area ([`RowStateArea`]; a verify pass with `CudaOptions::row_states`).
    pub row_states: bool,
    /// With `row_states`: each `StoreLastRow` as `(row 0 of its source, bytes between rows,
    /// bytes of a row, its state region)`, so that a rollback to row r stores row r instead.
    pub row_hidden: Vec<(u64, u64, u64, u64)>,
}

/// Where a verify pass keeps each row's states (`CudaOptions::row_states`; the runtime's
/// `DeviceSession::keep_row_states`): the model's area at `base`, `row_bytes` per row, and the
/// offset in a row of every state region the fused Gated DeltaNet kernel writes (its
/// recurrent and conv states), in the regions' own layouts.
#[derive(Clone, Debug, Default)]
pub struct RowStateArea {
    pub base: u64,
    pub row_bytes: u64,
    pub offsets: Vec<(BufferId, u64)>,
}

impl RowStateArea {
    /// The regions a verify pass of `compiled` keeps per row (the recurrent and conv states
    /// of its Gated DeltaNet layers), each at a 256-byte aligned offset, and the bytes of a row.
    pub fn layout(compiled: &Compiled) -> (Vec<(BufferId, u64)>, u64) {
        let mut offsets: Vec<(BufferId, u64)> = Vec::new();
        let mut at = 0u64;
        for plan in &compiled.plans {
            if !matches!(plan.phase, flashrt_ir::Phase::Verify { .. }) {
                continue;
            }
            for op in &plan.ops {
                let id = match op {
                    Op::CausalConv1d { state, .. } | Op::GatedDeltaNet { state, .. } => *state,
                    _ => continue,
                };
                if offsets.iter().any(|(i, _)| *i == id) {
                    continue;
                }
                offsets.push((id, at));
                at += (compiled.layout.buffer(id).bytes as u64).next_multiple_of(256);
            }
        }
        (offsets, at)
    }

    /// Address of region `id` in row 0 of the area.
    pub fn at(&self, id: BufferId) -> Option<u64> {
        self.offsets
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, o)| self.base + o)
    }
}

impl Program {
    /// Enqueue every command on `stream`.
    ///
    /// # Safety
    /// The arenas, staging buffer and workspace whose addresses the program holds must be
    /// alive and not used concurrently by another stream; the context must be bound to the
    /// current thread.
    pub unsafe fn enqueue(&self, blas: &Blas, workspace: u64, stream: sys::CUstream) -> Result<()> {
        for cmd in &self.cmds {
            // SAFETY: forwarded from this function's contract.
            unsafe { cmd.enqueue(blas, workspace, stream) }?;
        }
        Ok(())
    }

    /// Enqueue every command with a timing event before it and after the last one, so the
    /// time of command i is `events[i].elapsed_ms(&events[i + 1])`. Returns the events
    /// (`cmds.len() + 1` of them).
    ///
    /// # Safety
    /// As [`Program::enqueue`].
    ///
    /// With `captured`, the stream is being captured into a graph and the events are recorded
    /// as graph nodes (`CU_EVENT_RECORD_EXTERNAL`), so they time the replay.
    pub unsafe fn enqueue_timed(
        &self,
        ctx: &Arc<cudarc::driver::CudaContext>,
        blas: &Blas,
        workspace: u64,
        stream: &cudarc::driver::CudaStream,
        captured: bool,
    ) -> Result<Vec<cudarc::driver::CudaEvent>> {
        let event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| Error::Backend {
                    op: "profile".into(),
                    msg: format!("cannot create an event: {e:?}"),
                })
        };
        let record = |ev: &cudarc::driver::CudaEvent| {
            let flags = if captured {
                sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
            } else {
                0
            };
            // SAFETY: the event and the stream belong to `ctx`, which is current.
            unsafe { sys::cuEventRecordWithFlags(ev.cu_event(), stream.cu_stream(), flags) }
                .result()
                .map_err(|e| Error::Backend {
                    op: "profile".into(),
                    msg: format!("cannot record an event: {e:?}"),
                })
        };
        let mut events = Vec::with_capacity(self.cmds.len() + 1);
        for cmd in &self.cmds {
            let ev = event()?;
            record(&ev)?;
            events.push(ev);
            // SAFETY: forwarded from this function's contract.
            unsafe { cmd.enqueue(blas, workspace, stream.cu_stream()) }?;
        }
        let ev = event()?;
        record(&ev)?;
        events.push(ev);
        Ok(events)
    }
}

impl Cmd {
    /// The command's label (plan phase, op index and name, GEMM weight).
    pub fn label(&self) -> &str {
        match self {
            Cmd::Kernel(k) => &k.label,
            Cmd::Gemm(g) => &g.label,
        }
    }

    /// Enqueue this one command on `stream`.
    ///
    /// # Safety
    /// As [`Program::enqueue`].
    pub unsafe fn enqueue(&self, blas: &Blas, workspace: u64, stream: sys::CUstream) -> Result<()> {
        match self {
            Cmd::Kernel(k) if k.pdl => {
                let mut args = [k.params.0.as_ptr() as *mut c_void];
                // SAFETY: an all-zero launch attribute is a valid value of the C union.
                let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
                attr.id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let config = sys::CUlaunchConfig {
                    gridDimX: k.grid.0,
                    gridDimY: k.grid.1,
                    gridDimZ: k.grid.2,
                    blockDimX: k.block.0,
                    blockDimY: k.block.1,
                    blockDimZ: k.block.2,
                    sharedMemBytes: k.shared,
                    hStream: stream,
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                // SAFETY: as below; `config` and `attr` outlive the call, and the kernel waits
                // for its predecessor before reading or writing memory (`pdl` is only set for
                // such kernels).
                unsafe {
                    sys::cuLaunchKernelEx(
                        &config,
                        k.func.cu_function(),
                        args.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                }
                .result()
                .map_err(|e| Error::Backend {
                    op: k.label.clone(),
                    msg: format!("kernel launch (PDL) failed: {e:?}"),
                })
            }
            Cmd::Kernel(k) => {
                let mut args = [k.params.0.as_ptr() as *mut c_void];
                // SAFETY: the function takes exactly one by-value parameter struct whose
                // bytes `params` holds (same repr(C) layout as the kernel's struct); grid,
                // block and shared memory were validated when the program was built; the
                // addresses inside are live by this function's contract.
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        k.func.cu_function(),
                        k.grid,
                        k.block,
                        k.shared,
                        stream,
                        &mut args,
                    )
                }
                .map_err(|e| Error::Backend {
                    op: k.label.clone(),
                    msg: format!("kernel launch failed: {e:?}"),
                })
            }
            Cmd::Gemm(g) => {
                // SAFETY: the operands were sized and aligned for this matmul when the
                // program was built; the workspace is the session's own.
                unsafe { blas.run(&g.gemm, g.w, g.x, g.out, g.accumulate, workspace, stream) }
                    .map_err(|e| Error::Backend {
                        op: g.label.clone(),
                        msg: e.to_string(),
                    })
            }
        }
    }
}

/// Device addresses of the four arenas.
#[derive(Clone, Copy, Debug)]
pub struct Arenas {
    pub weight: u64,
    pub state: u64,
    pub scratch: u64,
    pub io: u64,
}

/// A batched decode step's device tables (kernels/common.cuh), inside its staging record: row
/// `r`'s absolute position (`rows_pos`, i32) and the base address of its session's state arena
/// (`slots`, u64), for `rows` rows.
#[derive(Clone, Copy, Debug)]
pub struct BatchTables {
    pub rows: usize,
    pub rows_pos: u64,
    pub slots: u64,
}

/// Everything needed to turn a plan into a program.
pub struct Builder<'a> {
    pub compiled: &'a Compiled,
    pub kernels: &'a Kernels,
    pub blas: &'a Blas,
    pub arenas: Arenas,
    /// Device staging record `[pos, len, tokens..]` of the session.
    pub staging: u64,
    /// The session's cuBLASLt workspace ([`gemm::WORKSPACE_BYTES`]); attention's split
    /// partials borrow it between matmuls.
    pub workspace: u64,
    /// Multiprocessors of the device (sizes split-KV attention).
    pub sms: usize,
    /// Launch PDL-ready kernels with programmatic stream serialisation (`FLASHRT_PDL=0` turns
    /// it off).
    pub pdl: bool,
    /// Small phases' matmuls through `gemv` ([`Builder::gemv`]).
    pub gemv: bool,
    /// Small phases' attention through `attention_decode` ([`Builder::attention_decode`]).
    pub attn_decode: bool,
    /// Prefill attention at head_dim 129..=256 through attention_prefill_wgmma.cu (sm_90a).
    pub wgmma: bool,
    /// Split that kernel's keys over blocks when its grid is small (`CudaOptions::attn_split`).
    pub attn_split: bool,
    /// Pack a KV head's query heads into that kernel's blocks for chunks of fewer than 128 rows
    /// (`CudaOptions::attn_pack`).
    pub attn_pack: bool,
    /// Prefill buckets of at least this many rows run the chunked Gated DeltaNet kernel
    /// (`CudaOptions::gdn_chunk_rows`).
    pub gdn_chunk_rows: usize,
    /// Prefill MoE grouped GEMMs through kernels/moe_wgmma.cu (sm_90a).
    pub moe_wgmma: bool,
    /// ... over 128 x 256 tiles with persistent blocks (`moe_*_w2`; `CudaOptions::moe_wide`).
    pub moe_wide: bool,
    /// Small phases route inside the up launch (`moe_up_routed`; `CudaOptions::moe_route_in_up`).
    pub moe_route_in_up: bool,
    /// An attention layer's split, q / k norms, rotations and cache write as one launch
    /// ([`Builder::qk_prep`]; `CudaOptions::qk_prep`).
    pub qk_prep: bool,
    /// An attention op's output gate (the `Mul` after it) in the small-phase attention's output
    /// stores ([`Builder::out_gate`]; `CudaOptions::attn_gate`).
    pub attn_gate: bool,
    /// Batched steps' attention decode with each (head, split) block running the rows one
    /// after another (`attention_decode_rows_d*`; `CudaOptions::attn_rows`).
    pub attn_rows: bool,
    /// Small phases' Gated DeltaNet layers (conv, recurrence, gated norm) as one clustered
    /// launch ([`Builder::gdn_small`], sm_90).
    pub gdn_fused: bool,
    /// FP8 weights' prefill matmuls on the FP8 tensor cores (W8A8, cuBLASLt block scaling;
    /// compute capability 9.x), else through a dequantized copy (fp8.rs).
    pub fp8_gemm: bool,
    /// Small phases' FP8 matmuls on the tensor cores where their scale blocks allow
    /// (kernels/gemv_mma.cu, compute capability 9.x; [`Builder::gemv`]).
    pub gemv_mma: bool,
    /// Small phases' matmuls over 16-bit weights on the tensor cores (kernels/gemv_mma.cu
    /// `gemv16m_*`, compute capability 9.x; [`Builder::gemv`]).
    pub gemv16_mma: bool,
    /// Small phases' matmuls over 16-bit weights on the tensor cores in the CUDA-core kernel's
    /// blocks (kernels/gemv.cu `gemv16s_*`; [`Builder::gemv`]; before `gemv16_mma`).
    pub gemv16_smem: bool,
    /// The tensor-core gemv's split-tile shares (the model's, zero between launches;
    /// [`gemv::gemvm_sync_bytes`]).
    pub gemvm_part: u64,
    /// The chunked Gated DeltaNet kernel's chunk records (address, bytes; 0 when off:
    /// `CudaOptions::gdn_prep`, [`gdn_prep_bytes`]).
    pub gdn_prep: (u64, usize),
    /// ... with two record buffers where the launch fits two blocks an SM
    /// (`CudaOptions::gdn_prep` = 2).
    pub gdn_prep_double: bool,
    /// Several rows' 16-bit `gemv` launches as resident blocks looping over tiles
    /// ([`Builder::gemv`]; `CudaOptions::gemv_tiles`).
    pub gemv_tiles: bool,
    /// Several rows' fused-norm 16-bit `gemv` launches with their rows staged in shared
    /// memory, from this many rows up, 0 never ([`Builder::gemv`]; `CudaOptions::gemv_stage_rows`).
    pub gemv_stage_rows: u32,
    /// Steps per warp a tensor-core `gemv` launch asks of the L2 before its PDL wait, over
    /// 16-bit and FP8 weights (`CudaOptions::gemvm_prefetch`).
    pub gemvm_prefetch: (u32, u32),
    /// FP8 matmuls take the tensor-core kernel only where at most this many warps share a
    /// tile on average (`CudaOptions::gemv8m_max_splits`; 0: wherever it can run).
    pub gemv8m_max_splits: u32,
    /// One-row gemv launches of a normalised input's second weight format beside the first
    /// (`CudaOptions::gemv_side`).
    pub gemv_side: bool,
    /// One-row CUDA-core `gemv` launches without a fused norm of at most this many bytes of
    /// weights ask for their first weights before their PDL wait (`CudaOptions::gemv_early`).
    pub gemv_early: usize,
    /// Adjacent prefill matmuls over one input as one GEMM (`CudaOptions::linear_group`).
    pub linear_group: bool,
    /// Blocks per value head of the fused Gated DeltaNet decode launch
    /// (`CudaOptions::gdn_col_blocks`: 1, 2 or 4).
    pub gdn_col_blocks: u32,
    /// The session's FP8 scratch ([`fp8_scratch_needs`]).
    pub fp8: Fp8Scratch,
    /// Build the decode plan as a batched step of `rows` sessions (`arenas.state` is then 0, so
    /// state addresses are offsets into a session's arena): every op computes each row as a
    /// one-row decode step of its session computes it, or the build fails with
    /// `Error::Unsupported` (the runtime then steps the sessions one by one).
    pub batch: Option<BatchTables>,
    /// Keep each row's states in verify passes (`CudaOptions::row_states`).
    pub row_states: Option<RowStateArea>,
    /// Bytes of the next matmul's weights a latency-bound launch before it (a Gated DeltaNet
    /// block, attention decode) asks of the L2 (`CudaOptions::prefetch_next`; 0: none).
    pub prefetch_next: usize,
    /// Bytes of the next layer's first matmul a one-row MoE block asks of the L2
    /// (`CudaOptions::moe_prefetch`; 0: none).
    pub moe_prefetch: usize,
    /// What that launch asks for, set by [`Builder::program`] per op: (address, bytes), or 0s.
    pub next_weights: Cell<(u64, u64)>,
}

fn act_code(a: Act) -> i32 {
    match a {
        Act::Identity => 0,
        Act::Silu => 1,
        Act::Sigmoid => 2,
        Act::Relu2 => 3,
    }
}

fn to_i32(v: usize, what: &str, label: &str) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| Error::Unsupported(format!("{label}: {what} = {v} does not fit in i32")))
}

fn ceil_div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

impl Builder<'_> {
    fn buf(&self, id: BufferId) -> &Buffer {
        self.compiled.layout.buffer(id)
    }

    fn addr(&self, id: BufferId) -> u64 {
        let b = self.buf(id);
        let base = match b.role {
            Role::Weight => self.arenas.weight,
            Role::State => self.arenas.state,
            Role::Scratch => self.arenas.scratch,
            Role::Io => self.arenas.io,
        };
        base + b.offset as u64
    }

    fn target(&self) -> DType {
        self.compiled.layout.target.dtype
    }

    /// The batch tables' addresses for a kernel's parameters (0: a one-session step).
    fn rows_pos(&self) -> u64 {
        self.batch.map_or(0, |b| b.rows_pos)
    }
    fn slots(&self) -> u64 {
        self.batch.map_or(0, |b| b.slots)
    }

    /// `Error::Unsupported` for an op a batched step cannot take.
    fn not_batched(&self, label: &str, why: &str) -> Result<()> {
        if self.batch.is_some() {
            return Err(Error::Unsupported(format!(
                "{label}: no batched decode ({why})"
            )));
        }
        Ok(())
    }

    /// Check a view against its buffer (2-D, stride = columns, window inside, enough rows for
    /// the plan) and return (address of its first element, row stride, dtype).
    fn view(&self, v: &View, rows: usize, label: &str, role: &str) -> Result<(u64, i32, DType)> {
        let b = self.buf(v.buf);
        let bad =
            |msg: String| Error::Config(format!("{label}: {role} view of `{}` {msg}", b.name));
        if b.shape.len() != 2 {
            return Err(bad(format!("is not 2-D (shape {:?})", b.shape)));
        }
        if v.stride != b.shape[1] {
            return Err(bad(format!(
                "has stride {} but the buffer has {} columns",
                v.stride, b.shape[1]
            )));
        }
        if v.col + v.width > v.stride {
            return Err(bad(format!(
                "columns {}..{} exceed {}",
                v.col,
                v.col + v.width,
                v.stride
            )));
        }
        if b.shape[0] < rows {
            return Err(bad(format!(
                "has {} rows, the plan needs {rows}",
                b.shape[0]
            )));
        }
        Ok((
            self.addr(v.buf) + (v.col * b.dtype.size()) as u64,
            to_i32(v.stride, "stride", label)?,
            b.dtype,
        ))
    }

    fn expect_dtype(&self, id: BufferId, want: DType, label: &str) -> Result<()> {
        let b = self.buf(id);
        if b.dtype != want {
            return Err(Error::Config(format!(
                "{label}: buffer `{}` is {}, expected {}",
                b.name,
                b.dtype.name(),
                want.name()
            )));
        }
        Ok(())
    }

    fn expect_numel(&self, id: BufferId, want: usize, label: &str) -> Result<()> {
        let b = self.buf(id);
        if b.numel() != want {
            return Err(Error::Config(format!(
                "{label}: buffer `{}` has {} elements (shape {:?}), expected {want}",
                b.name,
                b.numel(),
                b.shape
            )));
        }
        Ok(())
    }

    fn kernel<T: Copy>(
        &self,
        label: &str,
        func: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        p: &T,
    ) -> Cmd {
        Cmd::Kernel(KernelCmd {
            label: label.to_string(),
            func: func.clone(),
            grid,
            block: (block, 1, 1),
            shared: 0,
            pdl: self.pdl && self.kernels.pdl_ready(func),
            params: ParamBytes::of(p),
        })
    }

    /// A launch with `shared` bytes of dynamic shared memory. Above the default 48 KiB the
    /// function's opt-in limit is raised here, at build time, so nothing is left for capture.
    fn kernel_smem<T: Copy>(
        &self,
        label: &str,
        func: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        p: &T,
    ) -> Result<Cmd> {
        self.allow_smem(label, func, shared)?;
        let mut cmd = self.kernel(label, func, grid, block, p);
        if let Cmd::Kernel(k) = &mut cmd {
            k.shared = shared;
        }
        Ok(cmd)
    }

    /// Lets `func` launch with `shared` bytes of dynamic shared memory: static plus dynamic
    /// past 48 KiB needs the opt-in; the limit only ever grows (programs of several phases
    /// set it for the same function, in any order).
    fn allow_smem(&self, label: &str, func: &CudaFunction, shared: u32) -> Result<()> {
        let attr = |a| {
            func.get_attribute(a).map_err(|e| Error::Backend {
                op: label.to_string(),
                msg: format!("cannot read a kernel attribute: {e:?}"),
            })
        };
        let fixed = attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
        if fixed as u64 + shared as u64 > 48 * 1024 {
            let now =
                attr(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)?;
            if (shared as i32) > now {
                func.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .map_err(|e| Error::Backend {
                    op: label.to_string(),
                    msg: format!("cannot allow {shared} bytes of shared memory: {e:?}"),
                })?;
            }
        }
        Ok(())
    }

    /// The program of one plan: the input scatter, then every op in order. `logits` says which
    /// rows of `io.logits` the step must produce: [`StepLogits::All`] runs the plan as written;
    /// for the others the LM head (the `Linear` into `io.logits`) is left out
    /// ([`StepLogits::None`]: a prefill chunk before the last) or computed for row `len - 1`
    /// only ([`StepLogits::Last`]) — where the target allows it, else as written.
    ///
    /// With [`Builder::batch`] the plan must be the decode plan; it runs over the batch's rows,
    /// one session each, with every row's logits.
    pub fn program(&self, plan: &Plan, logits: StepLogits) -> Result<Program> {
        if self.batch.is_some()
            && (plan.phase != flashrt_ir::Phase::Decode || logits != StepLogits::All)
        {
            return Err(Error::Config(format!(
                "a batched step runs the decode plan with all logits, not {}",
                plan.phase.label()
            )));
        }
        let rows = self.batch.map_or(plan.phase.rows(), |b| b.rows);
        let layout = &self.compiled.layout;
        let io = &self.compiled.io;
        let label = format!("{} io_scatter", plan.phase.label());
        if rows > layout.max_rows {
            return Err(Error::Config(format!(
                "{label}: {rows} rows > layout max_rows {}",
                layout.max_rows
            )));
        }
        let mut cmds = vec![self.kernel(
            &label,
            self.kernels.get("io_scatter")?,
            (1, 1, 1),
            256,
            &IoScatterParams {
                staging: self.staging,
                tokens: self.addr(io.tokens),
                pos: self.addr(io.pos),
                len: self.addr(io.len),
                max_rows: to_i32(layout.max_rows, "max_rows", &label)?,
            },
        )];
        // Speculative decoding commits verify rows in place of decode steps, so in models with
        // verify plans every phase of at most MAX_DRAFT + 1 rows computes a row the same way:
        // one GEMM shape (and so one cuBLASLt algorithm) and one attention split count.
        // (Rows past `len` are padding; GEMMs compute them and nobody reads them.)
        let spec = flashrt_ir::lower::MAX_DRAFT + 1;
        let has_verify = self
            .compiled
            .plans
            .iter()
            .any(|p| matches!(p.phase, flashrt_ir::Phase::Verify { .. }));
        // A batched step's rows are one-row decode steps: they share what a decode step shares.
        let one_row = if self.batch.is_some() { 1 } else { rows };
        let shared = (has_verify && one_row <= spec && layout.max_rows >= spec).then_some(spec);
        // A verify pass keeps each row's states where the model has the area (RowStateArea:
        // MAX_DRAFT + 1 rows); count the state-writing ops that would not keep theirs.
        let keep = self.row_states.is_some()
            && self.batch.is_none()
            && matches!(plan.phase, flashrt_ir::Phase::Verify { .. })
            && (2..=spec).contains(&rows);
        let mut unkept = 0usize;
        let mut row_hidden = Vec::new();
        let mut i = 0;
        while i < plan.ops.len() {
            let op = &plan.ops[i];
            // The label of op i + k (commands keep their op's label: profiles group by it).
            let label_at = |k: usize| {
                let op = &plan.ops[i + k];
                format!("{} op {} ({})", plan.phase.label(), i + k, op.name())
            };
            let label = label_at(0);
            if logits != StepLogits::All
                && matches!(op, Op::Linear { out, .. } if out.buf == io.logits)
            {
                match logits {
                    StepLogits::None => {
                        i += 1;
                        continue;
                    }
                    _ => {
                        if self.lm_head_last_row(op, rows, &label, &mut cmds)? {
                            i += 1;
                            continue;
                        }
                    }
                }
            }
            self.next_weights
                .set(self.next_weights_after(&plan.ops[i..]));
            if let Some(used) = self.moe_small(&plan.ops[i..], rows, &label, &mut cmds)? {
                i += used;
                continue;
            }
            if let Some(used) = self.gdn_small(&plan.ops[i..], rows, keep, &label, &mut cmds)? {
                i += used;
                continue;
            }
            if keep && let Op::StoreLastRow { x, state } = op {
                let (src, ld, d) = self.view(x, rows, &label, "x")?;
                let e = d.size() as u64;
                row_hidden.push((src, ld as u64 * e, x.width as u64 * e, self.addr(*state)));
            }
            // Not fused: its per-row states are not kept.
            if matches!(
                op,
                Op::CausalConv1d { .. } | Op::GatedDeltaNet { .. } | Op::Mamba2Scan { .. }
            ) && keep
            {
                unkept += 1;
            }
            if let Some(used) = self.qk_prep(&plan.ops[i..], rows, shared, &label_at, &mut cmds)? {
                i += used;
                continue;
            }
            // Attention here rather than in `op`: it may take the gate's `Mul` after it.
            if matches!(op, Op::Attention { .. }) {
                let gate = self.out_gate(op, plan.ops.get(i + 1), rows, &label)?;
                let gated = self.attention(op, rows, shared, &label, &mut cmds, true, gate)?;
                i += 1 + gated as usize;
                continue;
            }
            // gemv computes a row the same way whatever the row count (see kernels/gemv.cu),
            // so it runs at the plan's own rows even where phases share a GEMM shape.
            if let Some(used) = self.gemv(&plan.ops[i..], rows, &label, &mut cmds)? {
                i += used;
                continue;
            }
            if matches!(op, Op::Linear { .. }) {
                // A GEMM's algorithm depends on its row count: only gemv keeps rows apart.
                self.not_batched(&label, "a matmul gemv does not take")?;
                if let Some(used) =
                    self.linear_group(&plan.ops[i..], rows, shared, &label, &mut cmds)?
                {
                    i += used;
                    continue;
                }
            }
            self.op(op, rows, shared, &label, &mut cmds)?;
            i += 1;
        }
        let row_states = keep && unkept == 0;
        Ok(Program {
            cmds,
            row_states,
            row_hidden: if row_states { row_hidden } else { Vec::new() },
        })
    }

    /// The first weights of the next matmul after `ops[0]` (within a few ops: the Gated
    /// DeltaNet block's output projection, attention's o_proj), as much as
    /// `prefetch_next` allows: what a latency-bound launch there asks of the L2
    /// (kernels/common.cuh `prefetch_l2_share`), so that DRAM streams that matmul's weights
    /// while the launch computes. (0, 0) when off or there is none.
    ///
    /// At most a quarter of the matrix (a launch that asks for all of a small one competes
    /// with its own loads: the 35B-A3B shape's 16.8 MB out_proj, benches/RESULTS.md
    /// 2026-12-06 21:36 UTC), and none in batched steps, whose Gated DeltaNet blocks stream
    /// every row's state (8 rows: 50 MB a layer) and lost time to it there.
    fn next_weights_after(&self, ops: &[Op]) -> (u64, u64) {
        if self.prefetch_next == 0 {
            return (0, 0);
        }
        self.next_linear_weights(ops, |bytes| (bytes / 4).min(self.prefetch_next))
    }

    /// The first matmul's weights within a few ops after `ops[0]`, `cap(bytes)` of them; (0,
    /// 0) in batched steps or where there is none.
    pub(super) fn next_linear_weights(
        &self,
        ops: &[Op],
        cap: impl Fn(usize) -> usize,
    ) -> (u64, u64) {
        if self.batch.is_some() {
            return (0, 0);
        }
        ops.iter()
            .skip(1)
            .take(8)
            .find_map(|op| match op {
                Op::Linear { w, .. } => {
                    let b = self.buf(*w);
                    (b.role == Role::Weight).then(|| (self.addr(*w), cap(b.bytes) as u64))
                }
                _ => None,
            })
            .unwrap_or((0, 0))
    }

    /// The LM head for row `io.len - 1` only (one `gemv` row reading and writing that row):
    /// `false` when the target or the views do not allow it.
    fn lm_head_last_row(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<bool> {
        let t = self.target();
        if !matches!(t, DType::Bf16 | DType::F16) {
            return Ok(false);
        }
        let (Some(o), Op::Linear { x, out, w, .. }) = (self.gemv_operands(op, rows), op) else {
            return Ok(false);
        };
        let (prefix, qbr, qbc) = o.weights.kernel();
        let blocks = ceil_div(out.width, gemv_feats(1, o.weights != GemvWeights::Plain));
        let mut m = [GemvMat::default(); MAX_GEMV];
        m[0] = GemvMat {
            w: o.w,
            out: o.out,
            scale: o.scale,
            n: to_i32(out.width, "n", label)?,
            ld_out: o.ld_out,
            blocks: blocks as i32,
            scale_ld: o.scale_ld,
        };
        let p = GemvParams {
            x: o.x,
            ld_x: o.ld_x,
            k: to_i32(x.width, "k", label)?,
            nmats: 1,
            accumulate: 0,
            out_f32: o.out_f32 as i32,
            glu: 0,
            act: 0,
            stage: 0,
            glu_out: 0,
            ld_glu: 0,
            last_row: 1,
            len: self.addr(self.compiled.io.len),
            norm: 0,
            one_plus: 0,
            norm_w: 0,
            norm_out: 0,
            ld_norm_out: 0,
            eps: 0.0,
            qbr,
            qbc,
            pf: 0,
            part: 0,
            m,
            side: 0,
            // (An LM head: far past `gemv_early`.)
            early: 0,
        };
        cmds.push(self.kernel(
            &format!("{label} `{}` (last row)", self.buf(*w).name),
            self.kernels.typed(&format!("{prefix}_r1"), t)?,
            (blocks, 1, 1),
            32 * GEMV_WARPS as u32,
            &p,
        ));
        Ok(true)
    }

    /// Commands of one op over a bucket of `rows`. With `shared = Some(s)` (s >= rows) the op
    /// computes a row exactly as every other phase of at most `s` rows does: GEMMs are sized
    /// for `s` rows, and attention uses the split count of a one-row step (its workspace sized
    /// for `s` rows).
    fn op(
        &self,
        op: &Op,
        rows: usize,
        shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        match op {
            op @ Op::Embed { .. } => self.embed(op, rows, label, cmds)?,
            op @ Op::RmsNorm { .. } => self.rms_norm(op, rows, label, cmds)?,
            op @ Op::Linear { .. } => self.linear(op, rows, shared, label, cmds)?,
            op @ Op::Mul { .. } => self.mul(op, rows, label, cmds)?,
            op @ Op::Unary { .. } => self.unary(op, rows, label, cmds)?,
            op @ Op::SplitHeads { .. } => self.split_heads(op, rows, label, cmds)?,
            op @ Op::Rope { .. } => self.rope(op, rows, label, cmds)?,
            op @ Op::GatedRmsNorm { .. } => self.gated_rms_norm(op, rows, label, cmds)?,
            op @ Op::StoreLastRow { .. } => self.store_last_row(op, rows, label, cmds)?,
            op @ Op::LoadState { .. } => self.load_state(op, rows, label, cmds)?,
            op @ Op::Attention { .. } => {
                self.attention(op, rows, shared, label, cmds, true, None)?;
            }
            op @ Op::CausalConv1d { .. } => {
                self.not_batched(
                    label,
                    "a causal conv outside the fused Gated DeltaNet kernel",
                )?;
                self.causal_conv1d(op, rows, shared, label, cmds)?
            }
            op @ Op::GatedDeltaNet { .. } => {
                self.not_batched(label, "a Gated DeltaNet outside the fused kernel")?;
                self.gated_deltanet(op, rows, shared, label, cmds)?
            }
            Op::Moe {
                x,
                router,
                bias,
                up,
                down,
                out,
                tmp,
                route,
                inter,
                act,
            } => {
                self.not_batched(label, "an MoE layer outside the small-phase kernel")?;
                self.moe(
                    MoeOp {
                        x,
                        router: *router,
                        bias: *bias,
                        up: *up,
                        down: *down,
                        out,
                        tmp,
                        route,
                        inter: *inter,
                        act: *act,
                        norm: None,
                        shared: None,
                        next: (0, 0),
                    },
                    rows,
                    label,
                    cmds,
                )?
            }
            op @ Op::Mamba2Scan { .. } => {
                self.not_batched(label, "a Mamba2 scan")?;
                self.mamba2_scan(op, rows, shared, label, cmds)?
            }
        }
        Ok(())
    }
}
