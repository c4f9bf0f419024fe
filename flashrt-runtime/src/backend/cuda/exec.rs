//! What every session of one model shares: the compute stream, the scratch and I/O arenas, the
//! cuBLASLt workspace, the FP8 matmul scratch and the pinned logits bounce buffers.
//!
//! A session owns only its state arena (plus a few bytes of input staging and its graphs): at
//! the 27B shape the scratch and I/O arenas are 0.9 and 3.8 GiB against 2.3 GiB of state, so
//! giving each session its own made a session cost three times its state, and the server's
//! session count was bounded by scratch nobody used at the same time.
//!
//! Sharing is safe because every command of every session of the model goes through ONE
//! stream ([`Exec::stream`]) while the [`Exec::lock`] is held: steps of different sessions
//! are ordered on the device, and no thread can queue work on the stream (or synchronise it,
//! or free memory on it) while another captures a graph there. What a step leaves in the I/O
//! arena — its logits — belongs to the session that ran it until another session steps;
//! [`ExecState::owner`] records whose they are, so a session that reads logits after another
//! session's step gets an error instead of someone else's numbers
//! ([`crate::backend::DeviceSession::step_read`] runs a step and its read under one lock).
//!
//! Session memory that is freed with the session (state arena, staging) is allocated on the
//! session's own copy stream, never on the shared one: a stream-ordered free queued on a
//! stream that another thread is capturing would land in that graph.

use super::ops::{self, Fp8Scratch};
use super::{BOUNCE_FLOATS, ModelInner, alloc_zeroed, dptr, drv, gemm};
use crate::error::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use flashrt_ir::Role;
use std::sync::{Arc, Mutex, MutexGuard};

/// The shared half of every session of one model (see the module docs).
pub(super) struct Exec {
    pub stream: Arc<CudaStream>,
    /// Where deferred logits rows cross to the host (`DeviceSession::step_deferred`): a
    /// stream of its own, so the copy waits only for the step that wrote the row, never
    /// behind a capsule's copy, and the compute stream runs on meanwhile.
    pub readback: Arc<CudaStream>,
    _scratch: CudaSlice<u8>,
    _io: CudaSlice<u8>,
    pub workspace: CudaSlice<u8>,
    /// FP8 matmuls' activations, scales and dequantized weight (ops::fp8_scratch_needs).
    _fp8: [CudaSlice<u8>; 3],
    pub fp8: Fp8Scratch,
    pub scratch_base: u64,
    pub io_base: u64,
    /// The device sampler's workspace (kernels/sample.cu), for rows of the model's vocabulary.
    pub sample_ws: CudaSlice<u8>,
    /// The tensor-core gemv's split-tile shares (ops::gemvm_sync_bytes).
    pub gemvm_part: CudaSlice<u8>,
    /// The chunked Gated DeltaNet kernel's chunk records (`CudaOptions::gdn_prep`).
    pub gdn_prep: Option<CudaSlice<u8>>,
    /// Verify passes' per-row states (`CudaOptions::row_states`; ops::RowStateArea).
    pub row_area: Option<CudaSlice<u8>>,
    lock: Mutex<ExecState>,
}

/// What the lock guards besides the stream itself.
pub(super) struct ExecState {
    /// The session whose step wrote the I/O arena last (0: none yet, or a batched step).
    pub owner: u64,
    /// After a batched step: the session of each logits row.
    pub rows_owners: Vec<u64>,
    /// The model's batched decode steps (built on first use).
    pub batch: Option<super::batch::BatchExec>,
    /// Two pinned buffers (and their completion events) for reading many logits rows.
    pub bounce: ([PinnedHostSlice<f32>; 2], [CudaEvent; 2]),
    /// Recorded on [`Exec::readback`] after the last deferred logits copy; while
    /// `readback_pending`, the next command that writes the I/O arena must wait for it
    /// ([`ExecState::before_io_write`]).
    pub readback_done: CudaEvent,
    pub readback_pending: bool,
}

impl Exec {
    /// Allocate the shared arenas of `model` (zeroed) and its stream.
    pub fn new(model: &ModelInner) -> Result<Exec> {
        let ctx = &model.ctx;
        ctx.bind_to_thread().map_err(drv("bind context"))?;
        let layout = &model.compiled.layout;
        let stream = ctx.new_stream().map_err(drv("create compute stream"))?;
        let readback = ctx.new_stream().map_err(drv("create readback stream"))?;
        let scratch_b = layout.arena_bytes(Role::Scratch);
        let io_b = layout.arena_bytes(Role::Io);
        let scratch = alloc_zeroed(&stream, scratch_b, "scratch arena")?;
        let io = alloc_zeroed(&stream, io_b, "io arena")?;
        let workspace = alloc_zeroed(&stream, gemm::WORKSPACE_BYTES, "cuBLASLt workspace")?;
        let (act_b, scale_b, deq_b) =
            ops::fp8_scratch_needs(&model.compiled, model.fp8_gemm, model.options.gemv);
        let fp8_bufs = [
            alloc_zeroed(&stream, act_b, "FP8 activations")?,
            alloc_zeroed(&stream, scale_b, "FP8 activation scales")?,
            alloc_zeroed(&stream, deq_b, "FP8 dequantized weight")?,
        ];
        let fp8 = Fp8Scratch {
            act: dptr(&fp8_bufs[0]),
            act_bytes: act_b,
            scales: dptr(&fp8_bufs[1]),
            scale_bytes: scale_b,
            dequant: dptr(&fp8_bufs[2]),
            dequant_bytes: deq_b,
        };
        let sample_ws = alloc_zeroed(
            &stream,
            super::sample::workspace_bytes(model.compiled.ir.vocab),
            "sampler workspace",
        )?;
        let gemvm_part = alloc_zeroed(
            &stream,
            ops::gemvm_sync_bytes(model.sms),
            "gemv split-tile shares",
        )?;
        let gdn_prep = match model.gdn_prep_bytes() {
            0 => None,
            n => Some(alloc_zeroed(&stream, n, "Gated DeltaNet chunk records")?),
        };
        let row_area = match model.row_area_bytes() {
            0 => None,
            n => Some(alloc_zeroed(&stream, n, "row-state area")?),
        };
        let pinned = || {
            // SAFETY: a bounce buffer is only read in the range a completed copy just wrote.
            unsafe { ctx.alloc_pinned_with_flags::<f32>(BOUNCE_FLOATS, 0) }
                .map_err(drv("allocate pinned bounce buffer"))
        };
        let event = || ctx.new_event(None).map_err(drv("create event"));
        let bounce = ([pinned()?, pinned()?], [event()?, event()?]);
        let readback_done = event()?;
        stream
            .synchronize()
            .map_err(drv("allocate shared arenas"))?;
        Ok(Exec {
            scratch_base: dptr(&scratch),
            io_base: dptr(&io),
            stream,
            readback,
            _scratch: scratch,
            _io: io,
            workspace,
            _fp8: fp8_bufs,
            fp8,
            sample_ws,
            gemvm_part,
            gdn_prep,
            row_area,
            lock: Mutex::new(ExecState {
                owner: 0,
                rows_owners: Vec::new(),
                batch: None,
                bounce,
                readback_done,
                readback_pending: false,
            }),
        })
    }

    /// Hold the stream: every command queued on [`Exec::stream`] is queued under this guard.
    pub fn lock(&self) -> Result<MutexGuard<'_, ExecState>> {
        self.lock.lock().map_err(|_| Error::Backend {
            op: "cuda".into(),
            msg: "a thread panicked while it held the model's stream; the model is unusable".into(),
        })
    }
}

impl ExecState {
    /// A one-session step of session `id` wrote the I/O arena.
    pub fn set_owner(&mut self, id: u64) {
        self.owner = id;
        self.rows_owners.clear();
    }
    /// Before a step (of any session, or a batched one) is queued on `stream`: make it wait
    /// for the deferred logits copy still reading the I/O arena, if any.
    pub fn before_io_write(&mut self, stream: &CudaStream) -> Result<()> {
        if std::mem::take(&mut self.readback_pending) {
            stream
                .wait(&self.readback_done)
                .map_err(drv("wait for the logits copy"))?;
        }
        Ok(())
    }
    /// Whether logits row `row` is session `id`'s (its last step wrote it).
    pub fn owns_row(&self, id: u64, row: usize) -> bool {
        self.owner == id || (self.owner == 0 && self.rows_owners.get(row) == Some(&id))
    }
}

/// `model`'s shared arenas, allocated by its first session and kept while the model lives.
pub(super) fn shared(model: &ModelInner) -> Result<Arc<Exec>> {
    let mut slot = model.exec.lock().map_err(|_| Error::Backend {
        op: "cuda".into(),
        msg: "shared arenas poisoned".into(),
    })?;
    if let Some(e) = &*slot {
        return Ok(e.clone());
    }
    let e = Arc::new(Exec::new(model)?);
    *slot = Some(e.clone());
    Ok(e)
}

/// The error for logits another session's step has overwritten.
pub(super) fn not_owner() -> Error {
    Error::Input(
        "the logits of this session's last step were overwritten by a step of another session \
         of the same model (sessions share the I/O arena): read them right after the step, or \
         run the step with step_read"
            .into(),
    )
}
