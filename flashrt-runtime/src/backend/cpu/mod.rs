//! The CPU reference backend: f32 everywhere, simple and obviously right — the numerical
//! oracle for every other backend.
//!
//! # Execution
//!
//! A session owns three arenas allocated once from the layout (`state`, `scratch`, `io`,
//! each one `Vec<f32>` with the layout's byte offsets divided by four; i32 I/O scalars are
//! stored bit-for-bit) plus a workspace sized from the plans. [`DeviceSession::step`] writes
//! the token ids and the `io.pos` / `io.len` scalars into the I/O arena and then executes the
//! compiled [`Plan`] op by op, exactly as documented in `flashrt_ir::plan`; every op reads the
//! position and length back from those scalars. There is no separate interpreter: the plan is
//! the program.
//!
//! Each op first copies its input views into the workspace (so aliasing between views needs
//! no reasoning) and then writes its output view in place; state regions are updated in
//! place in the state arena.
//!
//! # Chunking invariance (bitwise)
//!
//! Every op computes each output row with the same sequence of f32 operations whatever the
//! chunk length and start are: dot products and norms use one fixed summation order
//! (`ops::dot`), the Gated DeltaNet and Mamba2 recurrences and the causal conv step token by
//! token from the state left by the previous token, and attention reads every position
//! (including the chunk's own) from the KV cache after writing the chunk's keys and values.
//! Linear layers split work over output columns only, so the thread count never changes a
//! result. Hence restoring a capsule at *any* boundary and appending the rest reproduces a
//! cold prefill of the whole sequence bit for bit, whatever the bucket choices on either side.
//!
//! # Snapshots
//!
//! The state arena is one contiguous `Vec<f32>` laid out by the layout, and KV regions are
//! position-major, so a snapshot is one bulk copy per region (KV regions: only the used prefix
//! `[0, pos)`), and a restore copies the same ranges back.

mod ops;
mod validate;

use super::{
    Backend, DeviceModel, DeviceSession, QuantJob, RegionSet, SavedState, SourceDtype, WeightFill,
    WeightSink,
};
use crate::error::{Error, Result};
use flashrt_ir::{BufferId, Compiled, DType, ModelIr, Op, Phase, Plan, Role, Target, View};
use ops::OutRows;
use std::any::Any;
use std::sync::Arc;

/// The CPU reference backend.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    threads: usize,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// Threads for large linear layers: `FLASHRT_CPU_THREADS`, else the available
    /// parallelism. Results never depend on it.
    pub fn new() -> Self {
        let threads = std::env::var("FLASHRT_CPU_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        Self::with_threads(threads)
    }
    pub fn with_threads(threads: usize) -> Self {
        CpuBackend {
            threads: threads.max(1),
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        format!("cpu (f32 reference, {} threads)", self.threads)
    }
    fn target(&self, _ir: &ModelIr) -> Target {
        Target { dtype: DType::F32 }
    }
    fn weight_sink(&self, compiled: &Compiled) -> Result<Box<dyn WeightSink>> {
        let layout = &compiled.layout;
        if layout.target.dtype != DType::F32 {
            return Err(backend_err(
                "load",
                format!(
                    "the CPU backend runs f32 layouts; this one was compiled for {}",
                    layout.target.dtype.name()
                ),
            ));
        }
        let arena = layout.arena_bytes(Role::Weight) / 4;
        let mut weights = Vec::new();
        weights.try_reserve_exact(arena).map_err(|_| {
            backend_err(
                "load",
                format!("cannot allocate {} bytes of weights", arena * 4),
            )
        })?;
        weights.resize(arena, 0f32);
        Ok(Box::new(CpuSink {
            weights,
            fill: WeightFill::new(compiled),
            threads: self.threads,
        }))
    }

    fn memory_available(&self) -> Option<usize> {
        // MemAvailable of /proc/meminfo (kB), where there is one.
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    }
}

/// The CPU backend's weight sink: every piece converted to f32 straight into the weight arena.
struct CpuSink {
    weights: Vec<f32>,
    fill: WeightFill,
    threads: usize,
}

impl WeightSink for CpuSink {
    fn put(&mut self, id: BufferId, first: usize, dtype: SourceDtype, bytes: &[u8]) -> Result<()> {
        let t = self.fill.put(id, first, dtype, bytes.len())?;
        let at = t.offset / 4;
        dtype.to_f32(bytes, &mut self.weights[at..at + t.count]);
        Ok(())
    }

    fn finish(mut self: Box<Self>, compiled: Arc<Compiled>) -> Result<Arc<dyn DeviceModel>> {
        // Quantized weights end as their exact f32 values (`q * scale`).
        let layout = &compiled.layout;
        for job in self.fill.quant_jobs()? {
            let (QuantJob::Dequantize { weight, quant } | QuantJob::Quantize { weight, quant }) =
                job;
            let w = layout.buffer(weight);
            let sb = layout.buffer(quant.scale);
            let (wo, so) = (w.offset / 4, sb.offset / 4);
            let mut scales = self.weights[so..so + sb.numel()].to_vec();
            let values = &mut self.weights[wo..wo + w.numel()];
            if let QuantJob::Quantize { .. } = job {
                let mut codes = vec![0u8; values.len()];
                crate::quant::quantize(values, &quant, &mut codes, &mut scales);
                for (v, &c) in values.iter_mut().zip(&codes) {
                    *v = crate::quant::e4m3_to_f32(c);
                }
                self.weights[so..so + sb.numel()].copy_from_slice(&scales);
                self.fill.mark_full(quant.scale);
            }
            let values = &mut self.weights[wo..wo + w.numel()];
            crate::quant::apply_scales(values, &quant, &scales);
        }
        self.fill.finish(&compiled)?;
        Ok(Arc::new(CpuModel {
            inner: Arc::new(ModelData::new(compiled, self.weights, self.threads)?),
        }))
    }
}

/// Where a buffer lives: arena and f32 offset / length.
#[derive(Clone, Copy, Debug)]
struct Loc {
    role: Role,
    off: usize,
    len: usize,
}

struct ModelData {
    compiled: Arc<Compiled>,
    weights: Vec<f32>,
    locs: Vec<Loc>,
    /// Columns of each workspace buffer (the widest view of any plan).
    ws_cols: usize,
    /// Floats of the small per-op temporaries.
    tmp_len: usize,
    threads: usize,
}

fn backend_err(op: &str, msg: impl Into<String>) -> Error {
    Error::Backend {
        op: op.to_string(),
        msg: msg.into(),
    }
}

impl ModelData {
    fn new(compiled: Arc<Compiled>, warena: Vec<f32>, threads: usize) -> Result<ModelData> {
        let layout = &compiled.layout;
        let mut locs = Vec::with_capacity(layout.buffers.len());
        for b in &layout.buffers {
            if b.offset % 4 != 0 || (b.dtype.size() != 4) {
                return Err(backend_err(
                    "load",
                    format!(
                        "buffer {} is not a 4-byte buffer at a 4-byte offset",
                        b.name
                    ),
                ));
            }
            locs.push(Loc {
                role: b.role,
                off: b.offset / 4,
                len: b.numel(),
            });
        }
        let mut m = ModelData {
            compiled: compiled.clone(),
            weights: warena,
            locs,
            ws_cols: 1,
            tmp_len: 1,
            threads,
        };
        for plan in &compiled.plans {
            m.validate(plan)?;
        }
        Ok(m)
    }

    fn buf(&self, id: BufferId) -> Result<&flashrt_ir::Buffer> {
        self.compiled
            .layout
            .buffers
            .get(id.index())
            .ok_or_else(|| backend_err("plan", format!("unknown buffer id {}", id.0)))
    }

    fn weight(&self, id: BufferId) -> &[f32] {
        let l = self.locs[id.index()];
        &self.weights[l.off..l.off + l.len]
    }
}

/// A model whose weights live in host memory.
pub struct CpuModel {
    inner: Arc<ModelData>,
}

impl DeviceModel for CpuModel {
    fn compiled(&self) -> &Arc<Compiled> {
        &self.inner.compiled
    }
    fn backend_name(&self) -> String {
        format!("cpu (f32 reference, {} threads)", self.inner.threads)
    }
    /// A step computes the rows it is given, not its plan's.
    fn pads_rows(&self) -> bool {
        false
    }
    fn new_session(&self) -> Result<Box<dyn DeviceSession>> {
        let m = &self.inner;
        let layout = &m.compiled.layout;
        let rows = layout.max_rows;
        Ok(Box::new(CpuSession {
            model: m.clone(),
            state: vec![0f32; layout.arena_bytes(Role::State) / 4],
            scratch: vec![0f32; layout.arena_bytes(Role::Scratch) / 4],
            io: vec![0f32; layout.arena_bytes(Role::Io) / 4],
            ws: Workspace {
                a: vec![0f32; rows * m.ws_cols],
                b: vec![0f32; rows * m.ws_cols],
                c: vec![0f32; rows * m.ws_cols],
                scores: vec![0f32; layout.max_seq],
                tmp: vec![0f32; m.tmp_len],
            },
            rows: RowStates::default(),
        }))
    }
}

/// Per-session temporaries, allocated with the session.
struct Workspace {
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
    scores: Vec<f32>,
    tmp: Vec<f32>,
}

/// One session's arenas.
pub struct CpuSession {
    model: Arc<ModelData>,
    state: Vec<f32>,
    scratch: Vec<f32>,
    io: Vec<f32>,
    ws: Workspace,
    rows: RowStates,
}

/// The state regions' values after each row of a step ([`DeviceSession::keep_row_states`]).
#[derive(Default)]
struct RowStates {
    /// Record during the next step.
    armed: bool,
    /// Rows of the step that recorded (0: nothing to roll back to).
    rows: usize,
    /// Each written region's place in the state arena and its value after every row.
    regions: Vec<(std::ops::Range<usize>, Vec<f32>)>,
}

impl RowStates {
    /// Region `at` holds `v` after row `row` of `rows` (a later op writing the same region
    /// replaces an earlier one's values).
    fn record(&mut self, at: &std::ops::Range<usize>, row: usize, rows: usize, v: &[f32]) {
        let n = at.len();
        let i = match self.regions.iter().position(|(r, _)| r == at) {
            Some(i) => i,
            None => {
                self.regions.push((at.clone(), vec![0.0; rows * n]));
                self.regions.len() - 1
            }
        };
        self.regions[i].1[row * n..(row + 1) * n].copy_from_slice(v);
    }

    fn clear(&mut self) {
        self.rows = 0;
        self.regions.clear();
    }
}

/// Run a recurrent op over `len` rows whose state is `state[at]`: at once, or, when `rec`
/// records, row by row with the state kept after each (the ops step token by token, so both
/// give the same bits).
fn by_rows(
    len: usize,
    rec: &mut Option<&mut RowStates>,
    at: &std::ops::Range<usize>,
    state: &mut [f32],
    mut step: impl FnMut(usize, usize, &mut [f32]),
) {
    match rec {
        None => step(0, len, &mut state[at.clone()]),
        Some(rec) => {
            for r in 0..len {
                step(r, 1, &mut state[at.clone()]);
                rec.record(at, r, len, &state[at.clone()]);
            }
        }
    }
}

/// Copy `len` rows of a view into `dst` (contiguous `[len, width]`).
fn gather(locs: &[Loc], scratch: &[f32], io: &[f32], v: &View, len: usize, dst: &mut [f32]) {
    let l = locs[v.buf.index()];
    let src = if l.role == Role::Io { io } else { scratch };
    for r in 0..len {
        let s = l.off + r * v.stride + v.col;
        dst[r * v.width..(r + 1) * v.width].copy_from_slice(&src[s..s + v.width]);
    }
}

/// The output window of a view.
fn out_rows<'a>(locs: &[Loc], scratch: &'a mut [f32], io: &'a mut [f32], v: &View) -> OutRows<'a> {
    let l = locs[v.buf.index()];
    let data = if l.role == Role::Io { io } else { scratch };
    OutRows {
        data,
        base: l.off + v.col,
        stride: v.stride,
        width: v.width,
    }
}

fn i32_at(io: &[f32], off: usize) -> i32 {
    io[off].to_bits() as i32
}

impl CpuSession {
    /// Execute a plan; `io.tokens`, `io.pos` and `io.len` are already written.
    fn run(&mut self, plan: &Plan) -> Result<()> {
        let m = &*self.model;
        let io_ids = m.compiled.io;
        let pos = i32_at(&self.io, m.locs[io_ids.pos.index()].off);
        let len = i32_at(&self.io, m.locs[io_ids.len.index()].off);
        let max_seq = m.compiled.layout.max_seq;
        if len < 1
            || len as usize > plan.phase.rows()
            || pos < 0
            || pos as usize + len as usize > max_seq
        {
            return Err(backend_err(
                "run",
                format!(
                    "io.pos = {pos}, io.len = {len} invalid for {}",
                    plan.phase.label()
                ),
            ));
        }
        let (pos, len) = (pos as usize, len as usize);
        let locs = &m.locs[..];
        let (scratch, io, state, ws) = (
            &mut self.scratch[..],
            &mut self.io[..],
            &mut self.state[..],
            &mut self.ws,
        );
        // Per-row states for a rollback (DeviceSession::keep_row_states), this step only.
        let armed = std::mem::take(&mut self.rows.armed);
        self.rows.clear();
        let mut rec = armed.then_some(&mut self.rows);
        let region = |id: BufferId| {
            let l = locs[id.index()];
            l.off..l.off + l.len
        };
        for op in &plan.ops {
            match op {
                Op::Embed { table, out } => {
                    let vocab = m.compiled.ir.vocab;
                    let toff = locs[io_ids.tokens.index()].off;
                    let mut toks = [0u32; 64];
                    let mut done = 0;
                    // Tokens are read from io.tokens in blocks (the output may live in io too).
                    while done < len {
                        let n = (len - done).min(toks.len());
                        for (i, t) in toks[..n].iter_mut().enumerate() {
                            let v = i32_at(io, toff + done + i);
                            if v < 0 || v as usize >= vocab {
                                return Err(backend_err(
                                    "embed",
                                    format!("token id {v} out of range (vocab {vocab})"),
                                ));
                            }
                            *t = v as u32;
                        }
                        let mut o = out_rows(locs, scratch, io, out);
                        o.base += done * o.stride;
                        ops::embed(m.weight(*table), out.width, &toks[..n], &mut o);
                        done += n;
                    }
                }
                Op::RmsNorm {
                    x,
                    weight,
                    weight_kind,
                    out,
                    eps,
                    group,
                } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    let w = weight.map(|w| m.weight(w));
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::rms_norm(
                        &ws.a,
                        len,
                        x.width,
                        w,
                        *weight_kind,
                        eps.0 as f32,
                        *group,
                        &mut o,
                    );
                }
                Op::Linear {
                    x,
                    w,
                    bias,
                    out,
                    accumulate,
                } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    let b = bias.map(|b| m.weight(b));
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::linear(
                        &ws.a,
                        len,
                        x.width,
                        m.weight(*w),
                        out.width,
                        b,
                        &mut o,
                        *accumulate,
                        m.threads,
                    );
                }
                Op::Mul { gate, act, x, out } => {
                    gather(locs, scratch, io, gate, len, &mut ws.a);
                    gather(locs, scratch, io, x, len, &mut ws.b);
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::mul(&ws.a, gate.width, &ws.b, len, x.width, *act, &mut o);
                }
                Op::Moe {
                    x,
                    router,
                    bias,
                    up,
                    down,
                    out,
                    route,
                    inter,
                    act,
                    ..
                } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    let w = ops::MoeWeights {
                        router: m.weight(*router),
                        bias: bias.map(|b| m.weight(b)),
                        up: m.weight(*up),
                        down: m.weight(*down),
                    };
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::moe(
                        &ws.a, len, x.width, &w, route, *inter, *act, &mut o, m.threads,
                    );
                }
                Op::Unary { x, act, out } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::unary(&ws.a, len, x.width, *act, &mut o);
                }
                Op::SplitHeads { x, heads, outs } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    let mut part_off = 0;
                    for v in outs {
                        let mut o = out_rows(locs, scratch, io, v);
                        ops::split_heads_part(&ws.a, len, x.width, *heads, part_off, &mut o);
                        part_off += v.width / heads;
                    }
                }
                Op::Rope {
                    x,
                    heads,
                    head_dim,
                    rotary_dims,
                    theta,
                } => {
                    let mut o = out_rows(locs, scratch, io, x);
                    ops::rope(&mut o, len, pos, *heads, *head_dim, *rotary_dims, theta.0);
                }
                Op::Attention {
                    q,
                    k,
                    v,
                    cache_k,
                    cache_v,
                    out,
                    q_heads,
                    kv_heads,
                    head_dim,
                    scale,
                } => {
                    gather(locs, scratch, io, q, len, &mut ws.a);
                    let kvw = kv_heads * head_dim;
                    // New keys and values go to positions pos..pos+len of the caches.
                    let (rk, rv) = (region(*cache_k), region(*cache_v));
                    gather(
                        locs,
                        scratch,
                        io,
                        k,
                        len,
                        &mut state[rk.start + pos * kvw..rk.start + (pos + len) * kvw],
                    );
                    gather(
                        locs,
                        scratch,
                        io,
                        v,
                        len,
                        &mut state[rv.start + pos * kvw..rv.start + (pos + len) * kvw],
                    );
                    let dims = ops::AttnDims {
                        q_heads: *q_heads,
                        kv_heads: *kv_heads,
                        head_dim: *head_dim,
                        scale: scale.0 as f32,
                    };
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::attention(
                        &ws.a,
                        len,
                        pos,
                        &state[rk],
                        &state[rv],
                        &dims,
                        &mut ws.scores,
                        &mut o,
                    );
                }
                Op::StoreLastRow { x, state: st } => {
                    let l = locs[x.buf.index()];
                    let src = if l.role == Role::Io {
                        &io[..]
                    } else {
                        &scratch[..]
                    };
                    let at = region(*st);
                    if let Some(rec) = rec.as_mut() {
                        for r in 0..len {
                            let off = l.off + r * x.stride + x.col;
                            rec.record(&at, r, len, &src[off..off + x.width]);
                        }
                    }
                    let off = l.off + (len - 1) * x.stride + x.col;
                    state[at].copy_from_slice(&src[off..off + x.width]);
                }
                Op::LoadState { state: st, out } => {
                    let mut o = out_rows(locs, scratch, io, out);
                    let src = &state[region(*st)];
                    for r in 0..len {
                        o.row(r).copy_from_slice(src);
                    }
                }
                Op::CausalConv1d {
                    x,
                    weight,
                    bias,
                    state: st,
                    out,
                    act,
                    kernel,
                } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    let b = bias.map(|b| m.weight(b));
                    let w = x.width;
                    by_rows(len, &mut rec, &region(*st), state, |r0, n, s| {
                        let mut o = out_rows(locs, scratch, io, out);
                        o.base += r0 * o.stride;
                        ops::causal_conv1d(
                            &ws.a[r0 * w..(r0 + n) * w],
                            n,
                            w,
                            m.weight(*weight),
                            b,
                            s,
                            *act,
                            *kernel,
                            &mut o,
                        );
                    });
                }
                Op::GatedDeltaNet {
                    qkv,
                    a,
                    b,
                    a_log,
                    dt_bias,
                    state: st,
                    out,
                    key_heads,
                    value_heads,
                    key_dim,
                    value_dim,
                } => {
                    gather(locs, scratch, io, qkv, len, &mut ws.a);
                    gather(locs, scratch, io, a, len, &mut ws.b);
                    gather(locs, scratch, io, b, len, &mut ws.c);
                    let dims = ops::GdnDims {
                        key_heads: *key_heads,
                        value_heads: *value_heads,
                        key_dim: *key_dim,
                        value_dim: *value_dim,
                    };
                    let (wq, wa, wb) = (qkv.width, a.width, b.width);
                    let Workspace {
                        a: qa,
                        b: aa,
                        c: ba,
                        tmp,
                        ..
                    } = &mut *ws;
                    by_rows(len, &mut rec, &region(*st), state, |r0, n, s| {
                        let mut o = out_rows(locs, scratch, io, out);
                        o.base += r0 * o.stride;
                        ops::gated_deltanet(
                            &qa[r0 * wq..(r0 + n) * wq],
                            &aa[r0 * wa..(r0 + n) * wa],
                            &ba[r0 * wb..(r0 + n) * wb],
                            n,
                            m.weight(*a_log),
                            m.weight(*dt_bias),
                            s,
                            &dims,
                            tmp,
                            &mut o,
                        );
                    });
                }
                Op::GatedRmsNorm {
                    x,
                    gate,
                    weight,
                    shared_weight,
                    out,
                    eps,
                    group,
                    order,
                } => {
                    gather(locs, scratch, io, x, len, &mut ws.a);
                    gather(locs, scratch, io, gate, len, &mut ws.b);
                    let mut o = out_rows(locs, scratch, io, out);
                    ops::gated_rms_norm(
                        &ws.a,
                        &ws.b,
                        len,
                        x.width,
                        m.weight(*weight),
                        *shared_weight,
                        eps.0 as f32,
                        *group,
                        *order,
                        &mut ws.tmp,
                        &mut o,
                    );
                }
                Op::Mamba2Scan {
                    xbc,
                    dt,
                    a_log,
                    d,
                    dt_bias,
                    state: st,
                    out,
                    heads,
                    head_dim,
                    groups,
                    state_size,
                    dt_min,
                } => {
                    gather(locs, scratch, io, xbc, len, &mut ws.a);
                    gather(locs, scratch, io, dt, len, &mut ws.b);
                    let dims = ops::MambaDims {
                        heads: *heads,
                        head_dim: *head_dim,
                        groups: *groups,
                        state: *state_size,
                        dt_min: dt_min.map(|v| v.0 as f32),
                    };
                    let (wx, wd) = (xbc.width, dt.width);
                    by_rows(len, &mut rec, &region(*st), state, |r0, n, s| {
                        let mut o = out_rows(locs, scratch, io, out);
                        o.base += r0 * o.stride;
                        ops::mamba2_scan(
                            &ws.a[r0 * wx..(r0 + n) * wx],
                            &ws.b[r0 * wd..(r0 + n) * wd],
                            n,
                            m.weight(*a_log),
                            m.weight(*d),
                            m.weight(*dt_bias),
                            s,
                            &dims,
                            &mut o,
                        );
                    });
                }
            }
        }
        Ok(())
    }

    fn state_loc(&self, id: BufferId) -> Result<(Loc, &flashrt_ir::Buffer)> {
        let b = self.model.buf(id)?;
        if b.role != Role::State {
            return Err(backend_err(
                "region",
                format!("{} is not a state region", b.name),
            ));
        }
        Ok((self.model.locs[id.index()], b))
    }

    /// f32 elements of a region's used part at `pos`.
    fn used_len(b: &flashrt_ir::Buffer, pos: usize) -> usize {
        b.used_bytes(pos) / 4
    }
}

impl DeviceSession for CpuSession {
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn step(&mut self, phase: Phase, tokens: &[u32], pos: usize) -> Result<()> {
        let m = self.model.clone();
        let plan = m
            .compiled
            .plan(phase)
            .ok_or_else(|| backend_err("step", format!("no plan for {}", phase.label())))?;
        let len = tokens.len();
        if len == 0 || len > phase.rows() {
            return Err(backend_err(
                "step",
                format!(
                    "{len} tokens for {} (1..={} allowed)",
                    phase.label(),
                    phase.rows()
                ),
            ));
        }
        if pos + len > m.compiled.layout.max_seq {
            return Err(backend_err(
                "step",
                format!(
                    "positions {pos}..{} exceed max_seq {}",
                    pos + len,
                    m.compiled.layout.max_seq
                ),
            ));
        }
        let vocab = m.compiled.ir.vocab;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(backend_err(
                "step",
                format!("token id {t} out of range (vocab {vocab})"),
            ));
        }
        let io = m.compiled.io;
        let toff = m.locs[io.tokens.index()].off;
        for (i, &t) in tokens.iter().enumerate() {
            self.io[toff + i] = f32::from_bits(t);
        }
        self.io[m.locs[io.pos.index()].off] = f32::from_bits(pos as i32 as u32);
        self.io[m.locs[io.len.index()].off] = f32::from_bits(len as i32 as u32);
        let keep = self.rows.armed;
        self.run(plan)?;
        if keep {
            self.rows.rows = len;
        }
        Ok(())
    }

    fn keep_row_states(&mut self) -> bool {
        self.rows.armed = true;
        true
    }

    fn can_keep_row_states(&self) -> bool {
        true
    }

    fn rollback_to_row(&mut self, row: usize) -> Result<()> {
        if row >= self.rows.rows {
            return Err(Error::Input(format!(
                "no state kept after row {row} (the last step kept {} rows)",
                self.rows.rows
            )));
        }
        for (at, v) in &self.rows.regions {
            let n = at.len();
            self.state[at.clone()].copy_from_slice(&v[row * n..(row + 1) * n]);
        }
        self.rows.clear();
        Ok(())
    }

    fn logits(&self, rows: usize) -> Result<Vec<f32>> {
        let m = &self.model;
        let l = m.locs[m.compiled.io.logits.index()];
        let vocab = m.compiled.ir.vocab;
        if rows * vocab > l.len {
            return Err(backend_err(
                "logits",
                format!("{rows} rows requested, io.logits holds {}", l.len / vocab),
            ));
        }
        Ok(self.io[l.off..l.off + rows * vocab].to_vec())
    }

    fn reset(&mut self) -> Result<()> {
        self.state.fill(0.0);
        self.rows.clear();
        Ok(())
    }

    fn save(&self, pos: usize, set: RegionSet) -> Result<Arc<dyn SavedState>> {
        let layout = &self.model.compiled.layout;
        if pos > layout.max_seq {
            return Err(backend_err(
                "save",
                format!("position {pos} beyond max_seq {}", layout.max_seq),
            ));
        }
        let chosen: Vec<&flashrt_ir::Buffer> = layout
            .state_buffers()
            .filter(|b| set.contains(b.state))
            .collect();
        let total: usize = chosen.iter().map(|b| Self::used_len(b, pos)).sum();
        let mut data = Vec::with_capacity(total);
        let mut regions = Vec::with_capacity(chosen.len());
        for b in chosen {
            let l = self.model.locs[b.id.index()];
            let n = Self::used_len(b, pos);
            regions.push(SavedRegion {
                id: b.id,
                start: data.len(),
                len: n,
            });
            data.extend_from_slice(&self.state[l.off..l.off + n]);
        }
        Ok(Arc::new(CpuSaved {
            pos,
            set,
            regions,
            data,
            fingerprint: layout.fingerprint.clone(),
        }))
    }

    fn restore(&mut self, saved: &dyn SavedState, set: RegionSet, held: usize) -> Result<()> {
        self.rows.clear();
        let Some(saved) = saved.as_any().downcast_ref::<CpuSaved>() else {
            // Not this backend's own saved state (a capsule file, a store tier): the generic
            // path through host bytes, every region validated before anything is written.
            let m = self.model.clone();
            for (b, pieces) in crate::host_state::host_regions(&m.compiled.layout, saved, set)? {
                let (l, _) = self.state_loc(b.id)?;
                for (at, bytes) in crate::host_state::pieces_past(&pieces, b.rows_bytes(held)) {
                    let dst = &mut self.state[l.off + at / 4..l.off + (at + bytes.len()) / 4];
                    for (d, c) in dst.iter_mut().zip(bytes.chunks_exact(4)) {
                        *d = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                    }
                }
            }
            return Ok(());
        };
        let layout = &self.model.compiled.layout;
        if saved.fingerprint != layout.fingerprint {
            return Err(Error::Capsule(format!(
                "saved state has layout {}, this session has {}",
                saved.fingerprint, layout.fingerprint
            )));
        }
        if !saved.set.covers(set) {
            return Err(Error::Capsule(format!(
                "saved state holds {:?} regions; a {set:?} restore needs more",
                saved.set
            )));
        }
        for r in &saved.regions {
            let (l, b) = self.state_loc(r.id)?;
            if !set.contains(b.state) {
                continue;
            }
            if r.len != Self::used_len(b, saved.pos) || r.len > l.len {
                return Err(Error::Capsule(format!(
                    "saved region {} has {} values, expected {}",
                    b.name,
                    r.len,
                    Self::used_len(b, saved.pos)
                )));
            }
            // Rows the session holds already are not copied (the held rows of every
            // per-position region; nothing of the others).
            let skip = (b.rows_bytes(held) / 4).min(r.len);
            self.state[l.off + skip..l.off + r.len]
                .copy_from_slice(&saved.data[r.start + skip..r.start + r.len]);
        }
        Ok(())
    }

    fn read_region(&self, id: BufferId, pos: usize) -> Result<Vec<u8>> {
        let (l, b) = self.state_loc(id)?;
        let n = Self::used_len(b, pos);
        Ok(crate::safetensors::f32_bytes(&self.state[l.off..l.off + n]))
    }
}

#[derive(Clone, Copy, Debug)]
struct SavedRegion {
    id: BufferId,
    start: usize,
    len: usize,
}

/// State regions saved on the host.
pub struct CpuSaved {
    pos: usize,
    set: RegionSet,
    regions: Vec<SavedRegion>,
    data: Vec<f32>,
    fingerprint: String,
}

impl SavedState for CpuSaved {
    fn location(&self) -> &str {
        "host"
    }
    fn pos(&self) -> usize {
        self.pos
    }
    fn bytes(&self) -> usize {
        self.data.len() * 4
    }
    fn region_bytes(&self, id: BufferId) -> Result<Vec<u8>> {
        self.region_bytes_into(id, Vec::new())
    }
    fn region_bytes_into(&self, id: BufferId, buf: Vec<u8>) -> Result<Vec<u8>> {
        let r =
            self.regions.iter().find(|r| r.id == id).ok_or_else(|| {
                Error::Capsule(format!("region {} is not in this saved state", id.0))
            })?;
        Ok(crate::safetensors::f32_bytes_into(
            &self.data[r.start..r.start + r.len],
            buf,
        ))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
