//! Batched decode steps (`decode[b]`): one graph replay steps several sessions of a model.
//!
//! A decode step at the 27B shape reads 54.6 GB of weights for one token; the `gemv` kernels
//! take up to 8 rows for nearly the same bytes, so b sessions stepped together cost little more
//! than one. Row `r` of a batched step belongs to session `s_r` at its own position `p_r`: the
//! ops that touch state or positions (the fused Gated DeltaNet kernel, the KV write, decode
//! attention, rope, the MTP hidden store) read two small device tables written with the step's
//! tokens — `rows_pos[r]` and `slots[r]`, the base address of `s_r`'s state arena — and address
//! row `r`'s state as `slots[r] + offset` (kernels/common.cuh). So one program per batch size,
//! built from the decode plan with state addresses as offsets ([`Builder::batch`]) and captured
//! once, serves any set of sessions at any positions: no recapture, no per-position graph.
//!
//! Each row is computed exactly as a one-row decode step of its session computes it (the
//! kernels' per-row arithmetic does not depend on the row count; attention keeps the decode
//! step's split count and query tiling), so a batched row is bit-identical to the session
//! stepped alone, and capsules move freely between the two. A model whose decode plan has an op
//! without a batched kernel (Mamba2, a standalone causal conv, f32 targets, ...) reports
//! `Unsupported` once, and its sessions are stepped one by one instead.
//!
//! Sessions keep their own state arenas (a "slot" is an arena's address, so a session never
//! moves); the programs, their graphs and the staging record live with the model's shared
//! arenas ([`super::exec`]) and run under its lock.

use super::exec::{self, ExecState};
use super::ops::{BatchTables, Program};
use super::{CudaModel, CudaSession, SessionGraph, alloc_zeroed, dptr, drv};
use crate::backend::{DeviceSession, StepLogits};
use crate::error::{Error, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
use flashrt_ir::Phase;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The most sessions one batched step takes (the `gemv` kernels' row bound). The batch sizes
/// with a program are the model's ladder ([`flashrt_ir::ModelIr::batch_sizes`], `decode_batches`
/// in its description): a step of n sessions runs the smallest one >= n (its padding rows
/// compute nothing), more than the largest go one by one.
pub const MAX_BATCH: usize = flashrt_ir::MAX_DECODE_BATCH;

/// One batch size's program and graph.
struct BatchProgram {
    rows: usize,
    program: Program,
    graph: Option<SessionGraph>,
    /// Ran once as plain launches; the next step is captured.
    warm: bool,
}

/// The model's batched-step state (in [`ExecState`], so under the stream's lock).
pub(super) struct BatchExec {
    /// `[pos, len, tokens[max_rows]]` (i32, what `io_scatter` reads), then `rows_pos[8]` (i32),
    /// then `slots[8]` (u64, 8-byte aligned).
    staging_dev: CudaSlice<u8>,
    staging_host: PinnedHostSlice<i32>,
    staging_free: CudaEvent,
    /// Word offsets of the two tables in the record.
    rows_pos_at: usize,
    slots_at: usize,
    programs: Vec<BatchProgram>,
    /// Why the decode plan has no batched program (then every batched step runs one by one).
    unsupported: Option<String>,
}

impl BatchExec {
    fn new(model: &CudaModel, exec: &exec::Exec) -> Result<BatchExec> {
        let inner = &model.inner;
        let max_rows = inner.compiled.layout.max_rows;
        let rows_pos_at = 2 + max_rows;
        let slots_at = (rows_pos_at + MAX_BATCH).next_multiple_of(2);
        let words = slots_at + 2 * MAX_BATCH;
        let staging_dev = alloc_zeroed(&exec.stream, 4 * words, "batch staging")?;
        // SAFETY: the pinned record is fully written before any copy reads it.
        let staging_host = unsafe { inner.ctx.alloc_pinned_with_flags::<i32>(words, 0) }
            .map_err(drv("allocate pinned batch staging"))?;
        let staging_free = inner.ctx.new_event(None).map_err(drv("create event"))?;
        let base = dptr(&staging_dev);
        let mut programs = Vec::new();
        let mut unsupported = None;
        let decode = inner
            .compiled
            .plans
            .iter()
            .find(|p| p.phase == Phase::Decode)
            .ok_or_else(|| Error::Config("the model has no decode plan".into()))?;
        for rows in inner.compiled.ir.batch_sizes() {
            let tables = BatchTables {
                rows,
                rows_pos: base + 4 * rows_pos_at as u64,
                slots: base + 4 * slots_at as u64,
            };
            let builder = super::builder(inner, exec, 0, base, Some(tables));
            match builder.program(decode, StepLogits::All) {
                Ok(program) => programs.push(BatchProgram {
                    rows,
                    program,
                    graph: None,
                    warm: false,
                }),
                Err(Error::Unsupported(why)) => {
                    unsupported = Some(why);
                    programs.clear();
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if programs.is_empty() && unsupported.is_none() {
            unsupported = Some(format!(
                "no batch size in the model's decode_batches {:?} fits its {max_rows} rows",
                inner.compiled.ir.decode_batches
            ));
        }
        Ok(BatchExec {
            staging_dev,
            staging_host,
            staging_free,
            rows_pos_at,
            slots_at,
            programs,
            unsupported,
        })
    }
}

impl CudaModel {
    /// Why this model's sessions cannot be stepped together (`None`: they can). Builds the
    /// batched programs on first use.
    pub fn batch_unsupported(&self) -> Result<Option<String>> {
        let exec = exec::shared(&self.inner)?;
        let mut g = exec.lock()?;
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(drv("bind context"))?;
        Ok(batch_state(self, &exec, &mut g)?.unsupported.clone())
    }

    /// [`crate::backend::DeviceModel::step_batch`] on this model (see the module docs).
    pub(super) fn step_batch_cuda(
        &self,
        sessions: &mut [&mut dyn DeviceSession],
        tokens: &[u32],
        positions: &[usize],
    ) -> Result<Vec<(Option<Vec<f32>>, usize)>> {
        let n = sessions.len();
        if tokens.len() != n || positions.len() != n {
            return Err(Error::Input(format!(
                "a batched step of {n} sessions needs {n} tokens and positions, got {} and {}",
                tokens.len(),
                positions.len()
            )));
        }
        if n > MAX_BATCH {
            return Err(Error::Input(format!(
                "a batched step takes at most {MAX_BATCH} sessions, not {n}"
            )));
        }
        let inner = &self.inner;
        let vocab = inner.compiled.ir.vocab;
        let max_seq = inner.compiled.layout.max_seq;
        let mut cuda: Vec<&mut CudaSession> = Vec::with_capacity(n);
        for s in sessions.iter_mut() {
            let cs = s
                .as_any_mut()
                .downcast_mut::<CudaSession>()
                .filter(|cs| Arc::ptr_eq(&cs.model, inner))
                .ok_or_else(|| {
                    Error::Input("a batched step takes sessions of the model that runs it".into())
                })?;
            cuda.push(cs);
        }
        for (r, (&t, &p)) in tokens.iter().zip(positions).enumerate() {
            if t as usize >= vocab {
                return Err(Error::Input(format!(
                    "row {r}: token id {t} >= vocab {vocab}"
                )));
            }
            if p + 1 > max_seq {
                return Err(Error::Input(format!(
                    "row {r}: position {p} + 1 exceeds max_seq {max_seq}"
                )));
            }
        }
        let exec = exec::shared(inner)?;
        let mut g = exec.lock()?;
        inner.ctx.bind_to_thread().map_err(drv("bind context"))?;
        let batch = batch_state(self, &exec, &mut g)?;
        let Some(idx) = (n >= 2)
            .then(|| batch.programs.iter().position(|p| p.rows >= n))
            .flatten()
        else {
            // One session, or no batched program: one by one (each step takes the lock itself).
            drop(g);
            return sessions
                .iter_mut()
                .zip(tokens.iter().zip(positions))
                .map(
                    |(s, (&t, &p))| match s.step_deferred(Phase::Decode, &[t], p)? {
                        Some(_) => Ok((None, 0)),
                        None => Ok((
                            Some(s.step_read(Phase::Decode, &[t], p, StepLogits::Last)?),
                            0,
                        )),
                    },
                )
                .collect();
        };
        // The record: padding rows repeat row 0 (their blocks return before using them, but
        // some kernels load state before they read the row count).
        batch
            .staging_free
            .synchronize()
            .map_err(drv("batch staging"))?;
        let (rp, sl) = (batch.rows_pos_at, batch.slots_at);
        let rec = batch
            .staging_host
            .as_mut_slice()
            .map_err(drv("batch staging"))?;
        rec[0] = positions[0] as i32;
        rec[1] = n as i32;
        for (d, &t) in rec[2..2 + n].iter_mut().zip(tokens) {
            *d = t as i32;
        }
        for r in 0..MAX_BATCH {
            let src = if r < n { r } else { 0 };
            rec[rp + r] = positions[src] as i32;
            let base = cuda[src].state_base;
            rec[sl + 2 * r] = base as u32 as i32;
            rec[sl + 2 * r + 1] = (base >> 32) as u32 as i32;
        }
        let stream = exec.stream.clone();
        // SAFETY: the source is the initialised pinned record, untouched until `staging_free`
        // (recorded right after) completes; the destination is the staging buffer of the same
        // size, alive with the model's shared state.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dptr(&batch.staging_dev),
                &rec[..],
                stream.cu_stream(),
            )
        }
        .map_err(drv("copy batch inputs"))?;
        batch
            .staging_free
            .record(&stream)
            .map_err(drv("batch staging"))?;
        let graphs = inner.options.graphs;
        let batch = {
            g.before_io_write(&stream)?;
            batch_state(self, &exec, &mut g)?
        };
        let bp = &mut batch.programs[idx];
        let label = format!("decode[{}]", bp.rows);
        let ws = dptr(&exec.workspace);
        // Timed per command (`DeviceModel::profile_next_batch`): plain launches with an event
        // between commands, the same program the graph replays.
        let profile = inner.batch_profile_next.swap(false, Ordering::Relaxed);
        let launched = if profile {
            // SAFETY: as below (plain launches of the same program).
            let events = unsafe {
                bp.program
                    .enqueue_timed(&inner.ctx, &inner.blas, ws, &stream, false)
            }?;
            stream.synchronize().map_err(drv(&label))?;
            let t = super::session::times(&bp.program, &events, &label)?;
            if let Ok(mut p) = inner.batch_profile.lock() {
                *p = Some(t);
            }
            Ok(())
        } else if !graphs || !bp.warm {
            // The first step of a size runs as plain launches (warming lazily loaded modules),
            // so the second is captured with nothing but launches in it.
            bp.warm = true;
            // SAFETY: the program addresses the model's weights, the shared arenas and
            // workspace, the batch staging record and (through it) the sessions' state arenas,
            // all alive; it runs on the shared stream under its lock.
            unsafe { bp.program.enqueue(&inner.blas, ws, stream.cu_stream()) }
        } else if let Some(gr) = &bp.graph {
            gr.0.launch().map_err(drv(&format!("{label} graph launch")))
        } else {
            let what = format!("{label} graph capture");
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(drv(&what))?;
            // SAFETY: as above; while capturing, launches are recorded, not executed.
            let enqueued = unsafe { bp.program.enqueue(&inner.blas, ws, stream.cu_stream()) };
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            enqueued?;
            let graph = graph.map_err(drv(&what))?.ok_or_else(|| Error::Backend {
                op: what.clone(),
                msg: "capture produced no graph".into(),
            })?;
            graph.upload().map_err(drv(&what))?;
            graph
                .launch()
                .map_err(drv(&format!("{label} graph launch")))?;
            bp.graph = Some(SessionGraph(graph));
            Ok(())
        };
        launched?;
        for cs in cuda.iter_mut() {
            cs.steps += 1;
        }
        g.owner = 0;
        g.rows_owners = cuda.iter().map(|cs| cs.id).collect();
        if cuda.iter().all(|cs| cs.deferred.is_some()) {
            // Each row to its session's pinned row behind the step, read when wanted.
            for (r, cs) in cuda.iter_mut().enumerate() {
                cs.queue_readback(&mut g, &exec.readback, r)?;
            }
            return Ok((0..n).map(|r| (None, r)).collect());
        }
        let all = cuda[0].read_logits(&mut g, n)?;
        Ok(all
            .chunks_exact(vocab)
            .enumerate()
            .map(|(r, row)| (Some(row.to_vec()), r))
            .collect())
    }
}

/// The model's [`BatchExec`], built on first use (the caller holds the lock, `g`).
fn batch_state<'g>(
    model: &CudaModel,
    exec: &exec::Exec,
    g: &'g mut ExecState,
) -> Result<&'g mut BatchExec> {
    if g.batch.is_none() {
        g.batch = Some(BatchExec::new(model, exec)?);
    }
    Ok(g.batch.as_mut().expect("just built"))
}
