//! A CUDA session: its state arena, its programs and captured graphs, stepping, sampling and
//! reading logits (save / restore are `saved.rs`'s).

use super::*;

/// A captured graph, owned by exactly one session (or by the model's batched steps, under its
/// lock).
pub(super) struct SessionGraph(pub(super) CudaGraph);

// SAFETY: CUDA graphs need external serialisation, not thread affinity. A `SessionGraph` lives
// inside one `CudaSession`, which is `Send` but not `Sync`, so only one thread at a time can
// reach it.
unsafe impl Send for SessionGraph {}

/// Which program: the phase and the logits rows it produces.
pub(super) type ProgramKey = (Phase, StepLogits);

/// One session: its state arena on the GPU, the programs of every phase, and the model's
/// shared scratch and I/O arenas and stream ([`exec`]).
pub struct CudaSession {
    pub(super) model: Arc<ModelInner>,
    pub(super) exec: Arc<Exec>,
    /// This session's id among the model's ([`exec::ExecState::owner`]).
    pub(super) id: u64,
    /// Steps run ([`DeviceSession::steps_run`]).
    pub(super) steps: u64,
    /// The model's compute stream (`exec.stream`): only used under `exec.lock()`.
    pub(super) stream: Arc<CudaStream>,
    pub(super) copy: Arc<CudaStream>,
    pub(super) _state: CudaSlice<u8>,
    pub(super) _staging_dev: CudaSlice<u8>,
    pub(super) staging_host: PinnedHostSlice<i32>,
    /// Recorded after each staging copy; the pinned record is rewritten only after it.
    pub(super) staging_free: CudaEvent,
    /// Recorded before and after a device restore's copy (timing events, reused: creating an
    /// event per restore costs more than the wait); the saved buffer's home stream waits on
    /// the second, and [`DeviceSession::last_restore_seconds`] reads the pair.
    pub(super) restore_start: CudaEvent,
    pub(super) restore_done: CudaEvent,
    /// Whether the pair above brackets the last restore.
    pub(super) restore_timed: bool,
    /// One program per phase, plus last-row-logits and no-logits variants of prefill phases.
    pub(super) programs: Vec<(ProgramKey, Program)>,
    pub(super) graphs: Vec<(ProgramKey, SessionGraph)>,
    /// Programs that have run once (as plain launches); the next step of one is captured.
    pub(super) warm: Vec<ProgramKey>,
    pub(super) state_base: u64,
    pub(super) io_base: u64,
    /// The next step keeps each row's states ([`DeviceSession::keep_row_states`]).
    pub(super) row_armed: bool,
    /// The step that kept them: its phase, rows and step count.
    pub(super) kept: Option<(Phase, usize, u64)>,
    /// Where deferred logits rows land (`CudaOptions::defer_logits`).
    pub(super) deferred: Option<DeferredRow>,
}

/// A session's last deferred logits row ([`DeviceSession::step_deferred`]): pinned host memory
/// the readback stream copies it into, the events after the step that wrote it (the copy
/// waits on it) and after the copy, and the ticket of the row it holds (0: none).
pub(super) struct DeferredRow {
    host: PinnedHostSlice<f32>,
    stepped: CudaEvent,
    copied: CudaEvent,
    ticket: u64,
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
        // The pinned logits row is freed with the session: not while a copy still writes it.
        if let Some(d) = &self.deferred {
            let _ = d.copied.synchronize();
        }
    }
}

/// Alignment of each region inside a saved state's buffer (lets `state_copy` use 16-byte
/// vectors; the layout already aligns regions inside the state arena).
pub(super) const SAVE_ALIGN: usize = 256;

/// Segments per `state_copy` launch (kernels/state.cu `FLASHRT_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 160;

/// `state_copy`'s parameters (kernels/state.cu).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct StateCopyParams {
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
    pub(super) unsafe fn batched_copy(
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
    pub(super) fn new(model: Arc<ModelInner>) -> Result<Self> {
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
        let deferred = if model.options.defer_logits {
            let event = || ctx.new_event(None).map_err(drv("create event"));
            Some(DeferredRow {
                // SAFETY: the row is read only after a copy filled it (`copied` completed).
                host: unsafe { ctx.alloc_pinned_with_flags::<f32>(model.compiled.ir.vocab, 0) }
                    .map_err(drv("allocate pinned logits row"))?,
                stepped: event()?,
                copied: event()?,
                ticket: 0,
            })
        } else {
            None
        };
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
            row_armed: false,
            kept: None,
            deferred,
        })
    }

    pub(super) fn bind(&self) -> Result<()> {
        self.model.ctx.bind_to_thread().map_err(drv("bind context"))
    }

    pub(super) fn layout(&self) -> &flashrt_ir::Layout {
        &self.model.compiled.layout
    }

    /// Run (or capture, then run) program `idx`.
    pub(super) fn launch(&mut self, idx: usize) -> Result<()> {
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
    pub(super) fn regions(&self, set: RegionSet, pos: usize) -> Vec<(&Buffer, usize)> {
        self.layout()
            .state_buffers()
            .filter(|b| in_set(b, set))
            .map(|b| (b, b.used_bytes(pos)))
            .collect()
    }

    /// The generic restore path for a saved state of another type (a capsule file's host
    /// bytes, another backend's copy): validated region bytes from
    /// [`crate::host_state::host_regions`], copied host-to-device on the copy stream, but for
    /// the first `held` rows of each per-position region (the session holds them already).
    /// Blocks until the copies are done (the bytes are pageable and dropped on return).
    pub(super) fn restore_host(
        &mut self,
        saved: &dyn SavedState,
        set: RegionSet,
        held: usize,
    ) -> Result<()> {
        let regions = crate::host_state::host_regions(&self.model.compiled.layout, saved, set)?;
        self.copy_after_compute("restore")?;
        for (b, pieces) in &regions {
            for (at, bytes) in crate::host_state::pieces_past(pieces, b.rows_bytes(held)) {
                // SAFETY: the pieces fill the used prefix of a state region one after the other
                // (host_regions checked their total against the layout), `at` is this piece's
                // offset in it; `regions` outlives the copy because the copy stream is
                // synchronised before this function returns.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        self.state_base + (b.offset + at) as u64,
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
    pub(super) fn copy_after_compute(&self, what: &str) -> Result<()> {
        let ev = self.stream.record_event(None).map_err(drv(what))?;
        self.copy.wait(&ev).map_err(drv(what))
    }
}

/// Per-command times from the events `Program::enqueue_timed` recorded.
pub(super) fn times(
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

pub(super) fn in_set(b: &Buffer, set: RegionSet) -> bool {
    match set {
        RegionSet::All => true,
        RegionSet::KvOnly => b
            .state
            .is_some_and(|k| matches!(k, StateKind::Key | StateKind::Value)),
        RegionSet::NonKv => b
            .state
            .is_some_and(|k| !matches!(k, StateKind::Key | StateKind::Value)),
        RegionSet::Hidden => b.state == Some(StateKind::Hidden),
    }
}

impl CudaSession {
    /// Validate a step's inputs and queue their copy into the staging record; returns the
    /// index of the phase's program.
    pub(super) fn stage(
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
        // Kept row states belong to the step that kept them: this one replaces them (a step
        // refused below never runs, and its count never matches).
        let armed = std::mem::take(&mut self.row_armed);
        self.kept =
            (armed && self.programs[idx].1.row_states).then_some((phase, len, self.steps + 1));
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
        g.before_io_write(&self.stream)?;
        self.steps += 1;
        self.launch(idx)?;
        g.set_owner(self.id);
        Ok(())
    }

    fn steps_run(&self) -> u64 {
        self.steps
    }

    fn keep_row_states(&mut self) -> bool {
        let ok = self.can_keep_row_states();
        self.row_armed = ok;
        ok
    }

    fn can_keep_row_states(&self) -> bool {
        // Every verify program keeps them (the model's option, and every state-writing op of
        // the plan in the fused kernel).
        let mut verify = self
            .programs
            .iter()
            .filter(|((phase, _), _)| matches!(phase, Phase::Verify { .. }))
            .peekable();
        verify.peek().is_some() && verify.all(|(_, p)| p.row_states)
    }

    fn rollback_to_row(&mut self, row: usize) -> Result<()> {
        let Some((phase, rows, steps)) = self.kept.take() else {
            return Err(Error::Unsupported("no row states kept".into()));
        };
        if steps != self.steps || row >= rows {
            return Err(Error::Unsupported(format!(
                "no state kept after row {row} of the last step"
            )));
        }
        let exec = self.exec.clone();
        let g = exec.lock()?;
        // The area and the scratch arena are the model's: another session's step since
        // would have replaced them.
        if g.owner != self.id {
            return Err(Error::Unsupported(
                "another session stepped since the row states were kept".into(),
            ));
        }
        let (Some((offsets, row_bytes)), Some(area)) = (&self.model.row_layout, &exec.row_area)
        else {
            return Err(Error::Unsupported("no row-state area".into()));
        };
        let layout = &self.model.compiled.layout;
        let base = dptr(area) + row as u64 * row_bytes;
        let mut segments: Vec<(u64, u64, u64)> = offsets
            .iter()
            .map(|&(id, off)| {
                let b = layout.buffer(id);
                (
                    base + off,
                    self.state_base + b.offset as u64,
                    b.bytes as u64,
                )
            })
            .collect();
        // The drafter's hidden input: row `row` of what the verify pass stored the last row of.
        let program = self
            .programs
            .iter()
            .find(|(k, _)| *k == (phase, StepLogits::All))
            .map(|(_, p)| p);
        for &(src, ld, bytes, dst) in program.map_or(&[][..], |p| &p.row_hidden) {
            segments.push((src + row as u64 * ld, dst, bytes));
        }
        self.bind()?;
        // SAFETY: the sources are the model's row-state area (written by this session's last
        // step, checked above) and its arenas' live rows; the destinations are this session's
        // state regions; the copy runs on the compute stream, ordered after that step and
        // before any later one.
        unsafe { self.batched_copy(&self.stream, &segments, "rollback to a row")? };
        drop(g);
        Ok(())
    }

    fn sample_row(
        &mut self,
        row: usize,
        spec: &crate::sampling::DrawSpec,
        penalties: Option<&crate::sampling::PenaltyList>,
    ) -> Result<Option<u32>> {
        self.draw_row(row, penalties, Some(spec))
    }

    fn argmax_row(
        &mut self,
        row: usize,
        penalties: Option<&crate::sampling::PenaltyList>,
    ) -> Result<Option<u32>> {
        self.draw_row(row, penalties, None)
    }

    fn step_deferred(&mut self, phase: Phase, tokens: &[u32], pos: usize) -> Result<Option<u64>> {
        if self.deferred.is_none() {
            return Ok(None);
        }
        let exec = self.exec.clone();
        let mut g = exec.lock()?;
        let idx = self.stage(phase, tokens, pos, StepLogits::Last)?;
        g.before_io_write(&self.stream)?;
        self.steps += 1;
        self.launch(idx)?;
        g.set_owner(self.id);
        self.queue_readback(&mut g, &exec.readback, tokens.len() - 1)
            .map(Some)
    }

    fn deferred_row(&self, ticket: u64) -> Result<Vec<f32>> {
        let d = self
            .deferred
            .as_ref()
            .ok_or_else(|| Error::Unsupported("deferred logits off".into()))?;
        if ticket == 0 || d.ticket != ticket {
            return Err(Error::Input(format!(
                "the deferred logits row of step {ticket} was replaced by a later step"
            )));
        }
        d.copied
            .synchronize()
            .map_err(drv("read deferred logits"))?;
        Ok(d.host
            .as_slice()
            .map_err(drv("read deferred logits"))?
            .to_vec())
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
        g.before_io_write(&self.stream)?;
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
        g.before_io_write(&self.stream)?;
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

    fn restore(&mut self, saved: &dyn SavedState, set: RegionSet, held: usize) -> Result<()> {
        let exec = self.exec.clone();
        let _g = exec.lock()?;
        self.restore_locked(saved, set, held)
    }

    fn read_region(&self, id: BufferId, pos: usize) -> Result<Vec<u8>> {
        let _g = self.exec.lock()?;
        self.read_region_locked(id, pos)
    }
}

impl CudaSession {
    /// A token from logits row `row` of this session's last step, on the device: drawn with
    /// `spec` ([`DeviceSession::sample_row`]), or greedy without
    /// ([`DeviceSession::argmax_row`]); from a penalized copy of the row with `penalties`.
    fn draw_row(
        &mut self,
        row: usize,
        penalties: Option<&crate::sampling::PenaltyList>,
        spec: Option<&crate::sampling::DrawSpec>,
    ) -> Result<Option<u32>> {
        if !self.model.options.device_sampler {
            return Err(Error::Unsupported("device sampler off".into()));
        }
        let g = self.exec.lock()?;
        let src = self.owned_row(&g, row)?;
        let vocab = self.model.compiled.ir.vocab;
        let ws = dptr(&self.exec.sample_ws);
        let (kernels, sms) = (&self.model.kernels, self.model.sms);
        // SAFETY: row < max_rows, so the vocab f32 at `src` lie inside io.logits, which this
        // session's last step wrote (owner checked under the lock, which is held until the
        // result is read); the workspace is the model's, sized for its vocabulary and used
        // only under the same lock. Penalties go to the workspace's copy of the row: the
        // arena's row (the capsule's logits) stays as the step wrote it.
        unsafe {
            let src = match penalties {
                Some(list) => sample::penalize_on(kernels, &self.stream, src, vocab, ws, list)?,
                None => src,
            };
            match spec {
                Some(spec) => sample::sample_on(kernels, &self.stream, src, vocab, ws, sms, spec),
                None => sample::argmax_on(kernels, &self.stream, src, vocab, ws, sms),
            }
        }
    }

    /// Queue the copy of logits row `row`, which the step just queued on the compute stream
    /// writes for this session, into this session's pinned row on `readback` (the caller
    /// holds the stream's lock, `g`); returns the row's ticket, the session's step count
    /// ([`DeviceSession::step_deferred`]).
    pub(super) fn queue_readback(
        &mut self,
        g: &mut exec::ExecState,
        readback: &CudaStream,
        row: usize,
    ) -> Result<u64> {
        let src = self.logits_row_addr(row)?;
        let steps = self.steps;
        let d = self
            .deferred
            .as_mut()
            .ok_or_else(|| Error::Unsupported("deferred logits off".into()))?;
        d.ticket = 0;
        d.stepped
            .record(&self.stream)
            .map_err(drv("defer logits"))?;
        readback.wait(&d.stepped).map_err(drv("defer logits"))?;
        let dst = d.host.as_mut_slice().map_err(drv("defer logits"))?;
        // SAFETY: `src` is row `row` of io.logits (`logits_row_addr`), which the step just queued
        // writes; the readback stream waits for that step, and the next step of any session
        // waits for `readback_done` (recorded below) before it writes the arena again. `dst`
        // is this session's pinned row of `vocab` f32, read only after `copied` completes and
        // rewritten only by this session's next deferred step.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, readback.cu_stream()) }
            .map_err(drv("defer logits"))?;
        d.copied.record(readback).map_err(drv("defer logits"))?;
        g.readback_done
            .record(readback)
            .map_err(drv("defer logits"))?;
        g.readback_pending = true;
        d.ticket = steps;
        Ok(steps)
    }

    /// The device address of logits row `row`, which this session's last step wrote (the
    /// caller holds the stream's lock, `g`); binds the context.
    fn owned_row(&self, g: &exec::ExecState, row: usize) -> Result<u64> {
        if !g.owns_row(self.id, row) {
            return Err(exec::not_owner());
        }
        self.bind()?;
        self.logits_row_addr(row)
    }

    /// The device address of row `row` of `io.logits` (`vocab` f32), checked against the
    /// buffer's rows.
    fn logits_row_addr(&self, row: usize) -> Result<u64> {
        let max_rows = self.layout().max_rows;
        if row >= max_rows {
            return Err(Error::Input(format!(
                "logits row {row} requested, buffer has {max_rows}"
            )));
        }
        let vocab = self.model.compiled.ir.vocab;
        let b = self.layout().buffer(self.model.compiled.io.logits);
        Ok(self.io_base + b.offset as u64 + (4 * row * vocab) as u64)
    }

    /// Row `row` of `io.logits` (the caller holds the stream's lock).
    pub(super) fn read_logits_row(&self, row: usize) -> Result<Vec<f32>> {
        self.bind()?;
        let src = self.logits_row_addr(row)?;
        let mut out = vec![0f32; self.model.compiled.ir.vocab];
        self.stream
            .synchronize()
            .map_err(drv("step (asynchronous error)"))?;
        // SAFETY: [src, src + 4 * vocab) lies inside io.logits (`logits_row_addr`); `out` holds
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
    pub(super) fn read_logits(&self, g: &mut exec::ExecState, rows: usize) -> Result<Vec<f32>> {
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
