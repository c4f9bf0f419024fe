//! Backends: where plans execute and state lives.
//!
//! A backend is three object-safe traits, one per lifetime:
//!
//! * [`Backend`]: a device (CPU, one CUDA GPU). Loads a compiled model's weights once.
//! * [`DeviceModel`]: weights resident on the device; creates sessions.
//! * [`DeviceSession`]: the state arena of one session (and, on the CPU, its scratch and I/O
//!   arenas; CUDA sessions share the model's), allocated once from the layout at creation and
//!   never again; runs plans; saves and restores state regions.
//!
//! Every backend folder (`cpu/`, `cuda/`) uses the same file names so they read side by side.
//! When the crate is built without the `cuda` feature, `cuda_stub.rs` stands in with the same
//! names and reports "not compiled with CUDA", so no model or runtime code needs a `cfg`.
//!
//! Position and length are the plan's device-side scalars (`io.pos`, `io.len`): `step` writes
//! them (and the token ids) into the I/O arena and then runs the plan unchanged.

use crate::error::Result;
use flashrt_ir::{BufferId, Compiled, DType, Phase, Role, StateKind};
use std::any::Any;
use std::sync::Arc;

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;

/// Host-side weights in layout order: one f32 vector per weight buffer (`None` for non-weight
/// buffers and the scale buffers of quantized weights, whose vectors hold their values). A convenience for tests and generated weights; checkpoints stream through a
/// [`WeightSink`] instead and never exist on the host as a whole.
pub struct HostWeights {
    pub tensors: Vec<Option<Vec<f32>>>,
}

/// Element type of tensor bytes handed to a [`WeightSink`] (little-endian, as stored).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceDtype {
    F64,
    F32,
    F16,
    Bf16,
    /// FP8 E4M3 codes of a block-quantized weight (the value is the code times its block's
    /// scale, which arrives separately).
    F8E4m3,
}

impl SourceDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            SourceDtype::F64 => 8,
            SourceDtype::F32 => 4,
            SourceDtype::F16 | SourceDtype::Bf16 => 2,
            SourceDtype::F8E4m3 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            SourceDtype::F64 => "F64",
            SourceDtype::F32 => "F32",
            SourceDtype::F16 => "F16",
            SourceDtype::Bf16 => "BF16",
            SourceDtype::F8E4m3 => "F8_E4M3",
        }
    }
    /// The same element type in the layout's terms, where it has one (F64 has none).
    pub fn layout_dtype(self) -> Option<DType> {
        match self {
            SourceDtype::F64 => None,
            SourceDtype::F32 => Some(DType::F32),
            SourceDtype::F16 => Some(DType::F16),
            SourceDtype::Bf16 => Some(DType::Bf16),
            SourceDtype::F8E4m3 => Some(DType::F8E4m3),
        }
    }
    /// Element `i` of `bytes` as f32 (f64 rounds to nearest, like `as f32`; an FP8 code as its
    /// exact value, unscaled).
    pub fn to_f32(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            SourceDtype::F64 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                    *o = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32;
                }
            }
            SourceDtype::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                }
            }
            SourceDtype::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32();
                }
            }
            SourceDtype::Bf16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes(c.try_into().expect("2 bytes")).to_f32();
                }
            }
            SourceDtype::F8E4m3 => {
                for (o, &b) in out.iter_mut().zip(bytes) {
                    *o = crate::quant::e4m3_to_f32(b);
                }
            }
        }
    }
}

/// Where weights go while they load: the backend's own weight memory for one compiled model.
///
/// A loader (a checkpoint reader, the random generator, a test) pushes each weight buffer's
/// elements in any order and in pieces of any size, in the dtype they are stored in; the sink
/// converts to the buffer's dtype (the CPU backend to f32 on the host, the CUDA backend on
/// the device, and only where the dtypes differ) and owns every byte from then on. Nothing
/// about the source survives a `put`, so the loader can release its copy right after. The
/// direction is one way: loaders know this trait, backends know nothing of loaders.
pub trait WeightSink {
    /// Store `bytes` (elements of `dtype`) as elements `first..first + n` of weight buffer
    /// `id`. Every element of every weight buffer must be put exactly once before `finish`.
    fn put(&mut self, id: BufferId, first: usize, dtype: SourceDtype, bytes: &[u8]) -> Result<()>;
    /// Wait for every copy, free staging memory, and make the model. `compiled` is the model
    /// the sink was created for, possibly with its fingerprint now covering the weights
    /// ([`flashrt_ir::Compiled::with_weights_digest`]); its layout must be the same.
    fn finish(self: Box<Self>, compiled: Arc<Compiled>) -> Result<Arc<dyn DeviceModel>>;
}

/// The bookkeeping every [`WeightSink`] does: which buffers are weights, where they live, and
/// how many elements each has received, so a bad `put` and a missing weight are clear errors.
///
/// For block-quantized weights ([`flashrt_ir::WeightQuant`]) it also records how the
/// elements arrived — as FP8 codes (their scales arrive as the scale buffer's elements) or as
/// floats (to be quantized by [`crate::quant`]'s rule, the scales computed) — and tells the
/// sink at the end what is left to do ([`WeightFill::quant_jobs`]).
pub struct WeightFill {
    /// Per layout buffer: role, byte offset in its arena, elements, dtype, name.
    buffers: Vec<(Role, usize, usize, DType, String)>,
    filled: Vec<usize>,
    weight_bytes: usize,
    /// Per buffer: its quantization, when it is a quantized weight.
    quant: Vec<Option<flashrt_ir::WeightQuant>>,
    /// Per buffer: the weight whose scales it holds, when it is a scale buffer.
    scale_of: Vec<Option<BufferId>>,
    /// Per quantized weight: FP8 codes arrived (`Some(true)`), floats (`Some(false)`).
    codes: Vec<Option<bool>>,
    /// Per buffer: elements given by `put` (a scale buffer's own scales, not computed ones).
    given: Vec<bool>,
}

/// What a sink does for a quantized weight once every piece has arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantJob {
    /// FP8 codes (and their scales) arrived for a weight the layout holds as values (f32 on
    /// the CPU, bf16 for ops without FP8 kernels): multiply each code's value by its scale.
    Dequantize {
        weight: BufferId,
        quant: flashrt_ir::WeightQuant,
    },
    /// Floats arrived: quantize them by the reference rule, computing the scales; an FP8
    /// weight keeps the codes, a value weight the dequantized values.
    Quantize {
        weight: BufferId,
        quant: flashrt_ir::WeightQuant,
    },
}

/// Where a checked `put` goes.
pub struct PutTarget {
    /// Byte offset of the buffer in the weight arena.
    pub offset: usize,
    pub dtype: DType,
    /// Elements in the piece.
    pub count: usize,
}

impl WeightFill {
    pub fn new(compiled: &Compiled) -> WeightFill {
        let l = &compiled.layout;
        let mut scale_of = vec![None; l.buffers.len()];
        for b in &l.buffers {
            if let Some(q) = &b.quant
                && let Some(s) = scale_of.get_mut(q.scale.index())
            {
                *s = Some(b.id);
            }
        }
        WeightFill {
            buffers: l
                .buffers
                .iter()
                .map(|b| (b.role, b.offset, b.numel(), b.dtype, b.name.clone()))
                .collect(),
            filled: vec![0; l.buffers.len()],
            weight_bytes: l.arena_bytes(Role::Weight),
            quant: l.buffers.iter().map(|b| b.quant).collect(),
            scale_of,
            codes: vec![None; l.buffers.len()],
            given: vec![false; l.buffers.len()],
        }
    }

    /// The quantization of weight `id`, if it is a quantized weight.
    pub fn quant(&self, id: BufferId) -> Option<flashrt_ir::WeightQuant> {
        self.quant.get(id.index()).copied().flatten()
    }

    /// Whether buffer `id` holds another weight's scales.
    pub fn is_scale(&self, id: BufferId) -> bool {
        self.scale_of.get(id.index()).is_some_and(|s| s.is_some())
    }

    /// What is left to do for every quantized weight (see [`QuantJob`]); errors for a weight
    /// whose pieces arrived partly as codes and partly as floats, or codes without scales.
    pub fn quant_jobs(&self) -> Result<Vec<QuantJob>> {
        let mut jobs = Vec::new();
        for (i, q) in self.quant.iter().enumerate() {
            let Some(quant) = *q else { continue };
            let weight = BufferId(i as u32);
            let name = &self.buffers[i].4;
            match self.codes[i] {
                // Nothing arrived: `finish` reports the missing weight.
                None => {}
                Some(true) if self.buffers[i].3 != DType::F8E4m3 => {
                    jobs.push(QuantJob::Dequantize { weight, quant });
                }
                Some(true) => {}
                Some(false) => {
                    if self.given[quant.scale.index()] {
                        return Err(crate::error::Error::Checkpoint(format!(
                            "weight `{name}` arrived unquantized but its scales were given too"
                        )));
                    }
                    jobs.push(QuantJob::Quantize { weight, quant });
                }
            }
        }
        Ok(jobs)
    }

    /// Check a `put` of `bytes` as elements `first..` of buffer `id` and count it.
    pub fn put(
        &mut self,
        id: BufferId,
        first: usize,
        dtype: SourceDtype,
        bytes: usize,
    ) -> Result<PutTarget> {
        let bad = |msg: String| crate::error::Error::Checkpoint(msg);
        let Some((role, offset, numel, to, name)) = self.buffers.get(id.index()) else {
            return Err(bad(format!("no buffer with id {}", id.0)));
        };
        let count = bytes / dtype.size();
        let quantized = self.quant[id.index()].is_some();
        if dtype == SourceDtype::F8E4m3 && !quantized {
            return Err(bad(format!(
                "`{name}` is given as FP8 codes but the model does not quantize it (its \
                 `quantize.exclude` names it, or the model has no `quantize` section)"
            )));
        }
        if quantized {
            let codes = dtype == SourceDtype::F8E4m3;
            match self.codes[id.index()] {
                Some(c) if c != codes => {
                    return Err(bad(format!(
                        "pieces of `{name}` arrive partly as FP8 codes and partly as floats"
                    )));
                }
                _ => self.codes[id.index()] = Some(codes),
            }
        } else if *to == DType::F8E4m3 {
            return Err(bad(format!(
                "FP8 buffer `{name}` is not a quantized weight"
            )));
        }
        if *role != Role::Weight || first + count > *numel || !bytes.is_multiple_of(dtype.size()) {
            return Err(bad(format!(
                "elements {first}..{} of `{name}` ({} bytes of {}; {numel} elements, role {})",
                first + count,
                bytes,
                dtype.name(),
                role.name()
            )));
        }
        self.filled[id.index()] += count;
        self.given[id.index()] = true;
        Ok(PutTarget {
            offset: offset + first * to.size(),
            dtype: *to,
            count,
        })
    }

    /// Every weight complete, and `compiled` the layout the sink was made for.
    pub fn finish(&self, compiled: &Compiled) -> Result<()> {
        for ((role, _, numel, _, name), &got) in self.buffers.iter().zip(&self.filled) {
            if *role == Role::Weight && got != *numel {
                return Err(crate::error::Error::Checkpoint(format!(
                    "weight `{name}`: {got} of {numel} elements were loaded"
                )));
            }
        }
        if compiled.layout.buffers.len() != self.buffers.len()
            || compiled.layout.arena_bytes(Role::Weight) != self.weight_bytes
        {
            return Err(crate::error::Error::Config(
                "the model to finish has another layout than its weight sink was made for".into(),
            ));
        }
        Ok(())
    }

    /// The name of buffer `id` (for messages).
    pub fn name(&self, id: BufferId) -> &str {
        self.buffers.get(id.index()).map_or("?", |b| b.4.as_str())
    }

    /// Mark buffer `id` complete (weights generated in place).
    /// (A quantized weight generated in place counts as arrived as floats.)
    pub fn mark_full(&mut self, id: BufferId) {
        self.filled[id.index()] = self.buffers[id.index()].2;
        if self.quant[id.index()].is_some() && self.codes[id.index()].is_none() {
            self.codes[id.index()] = Some(false);
        }
    }

    /// Byte offset of buffer `id` in its arena, its elements and its dtype.
    pub fn place(&self, id: BufferId) -> (usize, usize, DType) {
        let b = &self.buffers[id.index()];
        (b.1, b.2, b.3)
    }

    /// Whether every element of buffer `id` has arrived.
    pub fn complete(&self, id: BufferId) -> bool {
        self.filled
            .get(id.index())
            .is_some_and(|&f| f == self.buffers[id.index()].2)
    }
}

/// Put every buffer of `weights` into `sink` (as f32). A quantized weight's host tensor is its
/// values (the sink quantizes them); its scale buffer's tensor, if any, is not used.
pub fn put_host_weights(
    compiled: &Compiled,
    weights: &HostWeights,
    sink: &mut dyn WeightSink,
) -> Result<()> {
    let layout = &compiled.layout;
    if weights.tensors.len() != layout.buffers.len() {
        return Err(crate::error::Error::Checkpoint(format!(
            "{} host tensors for {} layout buffers",
            weights.tensors.len(),
            layout.buffers.len()
        )));
    }
    let scales: std::collections::BTreeSet<BufferId> = layout
        .buffers
        .iter()
        .filter_map(|b| b.quant.map(|q| q.scale))
        .collect();
    for (b, t) in layout.buffers.iter().zip(&weights.tensors) {
        if scales.contains(&b.id) {
            // Host weights hold a quantized weight's values; the sink quantizes them.
            continue;
        }
        match (b.role, t) {
            (Role::Weight, Some(t)) if t.len() == b.numel() => {
                let bytes: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
                sink.put(b.id, 0, SourceDtype::F32, &bytes)?;
            }
            (Role::Weight, Some(t)) => {
                return Err(crate::error::Error::Checkpoint(format!(
                    "weight `{}`: {} values for shape {:?}",
                    b.name,
                    t.len(),
                    b.shape
                )));
            }
            (Role::Weight, None) => {
                return Err(crate::error::Error::Checkpoint(format!(
                    "weight `{}` has no host tensor",
                    b.name
                )));
            }
            (_, Some(_)) => {
                return Err(crate::error::Error::Checkpoint(format!(
                    "data given for non-weight buffer `{}`",
                    b.name
                )));
            }
            (_, None) => {}
        }
    }
    Ok(())
}

/// Which state regions a save/restore touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionSet {
    /// Every state region (the capsule contract).
    All,
    /// Only attention K/V regions: the KV-only ablation experiment.
    KvOnly,
    /// Every region except attention K/V: conv, recurrent and hidden (MTP) state. Fixed size
    /// whatever the position; what a speculative rollback saves and restores (K/V rows past
    /// the accepted boundary are dead and get overwritten, so they need no restore).
    NonKv,
    /// Only the MTP drafter's hidden input (`mtp.hidden`): what a speculative round saves
    /// when the backend keeps each verified row's states
    /// ([`DeviceSession::keep_row_states`]), to undo a drafter that fails.
    Hidden,
}

impl RegionSet {
    /// Whether a state region of `kind` belongs to the set (`None`: not a state region
    /// kind; only [`RegionSet::All`] takes it).
    pub fn contains(self, kind: Option<StateKind>) -> bool {
        let kv = kind.is_some_and(|k| k.per_token());
        match self {
            RegionSet::All => true,
            RegionSet::KvOnly => kv,
            RegionSet::NonKv => kind.is_some() && !kv,
            RegionSet::Hidden => kind == Some(StateKind::Hidden),
        }
    }

    /// Whether state saved with `self` holds every region a restore of `set` needs.
    pub fn covers(self, set: RegionSet) -> bool {
        self == RegionSet::All
            || self == set
            || (self == RegionSet::NonKv && set == RegionSet::Hidden)
    }
}

/// Which rows of `io.logits` a step must leave there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StepLogits {
    /// Every row of the chunk (the plan as written).
    All,
    /// Only row `len - 1`, the chunk's last position (a prompt's last chunk when the caller
    /// wants the next token only). Other rows are left undefined.
    Last,
    /// None (a prompt's chunks before the last). Every row is left undefined.
    None,
}

/// Saved bytes of the state regions at a token boundary, owned by the backend that made
/// them. `Host` copies live in ordinary memory; device copies stay on the device.
pub trait SavedState: Send + Sync + Any {
    /// Where the bytes live ("host", "cuda:0", "pinned").
    fn location(&self) -> &str;
    /// Position the state was saved at (KV regions hold `pos` rows).
    fn pos(&self) -> usize;
    /// Total bytes held.
    fn bytes(&self) -> usize;
    /// Bytes of one region as they would be restored (used part only), copied to the host.
    fn region_bytes(&self, id: BufferId) -> Result<Vec<u8>>;
    /// [`SavedState::region_bytes`] into `buf` where the backend can reuse it (its capacity
    /// and pages: a [`crate::host_pool::HostPool`] buffer), else into a new buffer.
    fn region_bytes_into(&self, id: BufferId, buf: Vec<u8>) -> Result<Vec<u8>> {
        let _ = buf;
        self.region_bytes(id)
    }
    fn as_any(&self) -> &dyn Any;
}

/// A device.
pub trait Backend: Send + Sync {
    /// Human-readable device name, e.g. "cpu (f32 reference)" or "cuda:0 NVIDIA H200".
    fn name(&self) -> String;
    /// The layout target this backend computes in (CPU: f32; CUDA: the model dtype).
    fn target(&self, ir: &flashrt_ir::ModelIr) -> flashrt_ir::Target;
    /// A sink for the weights of `compiled` (compiled for `self.target(..)`): the weight
    /// memory is allocated here, once; [`WeightSink::finish`] makes the model.
    fn weight_sink(&self, compiled: &Compiled) -> Result<Box<dyn WeightSink>>;
    /// Upload host weights (tests, generated weights) through [`Backend::weight_sink`].
    fn load(&self, compiled: Arc<Compiled>, weights: HostWeights) -> Result<Arc<dyn DeviceModel>> {
        let mut sink = self.weight_sink(&compiled)?;
        put_host_weights(&compiled, &weights, sink.as_mut())?;
        sink.finish(compiled)
    }
    /// Deterministic random weights ([`crate::init::random_weights`]: the same values on
    /// every backend, up to dtype rounding), generated buffer by buffer. Backends with their
    /// own memory override this to generate the values in place instead.
    fn load_random(&self, compiled: Arc<Compiled>, seed: u64) -> Result<Arc<dyn DeviceModel>> {
        let mut sink = self.weight_sink(&compiled)?;
        let inits = crate::init::weight_inits(&compiled);
        for b in compiled.layout.buffers.iter() {
            if let Some(init) = inits[b.id.index()] {
                let bytes: Vec<u8> = (0..b.numel() as u64)
                    .flat_map(|i| init.value(seed, b.id.0, i).to_le_bytes())
                    .collect();
                sink.put(b.id, 0, SourceDtype::F32, &bytes)?;
            }
        }
        sink.finish(compiled)
    }
    /// Bytes of memory this backend can still give to a model's weights and sessions (the
    /// free device memory; host memory for the CPU backend), where it knows.
    fn memory_available(&self) -> Option<usize> {
        None
    }
    /// Seconds one copy of `bytes` within this backend's memory takes (the median of `iters`
    /// after a warm-up): the floor that snapshots and restores are compared with.
    fn copy_seconds(&self, bytes: usize, iters: usize) -> Result<f64> {
        let src = vec![1u8; bytes.max(1)];
        let mut dst = vec![0u8; bytes.max(1)];
        let mut times = Vec::with_capacity(iters.max(1));
        for i in 0..iters.max(1) + 1 {
            let t = std::time::Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            if i > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }
    /// Measured dense matmul rate in the model's element type `dtype`, FLOP/s (a large square
    /// product, median of a few): the ceiling prefill throughput is compared with. Backends
    /// without a meaningful figure return `Unsupported`.
    fn matmul_flops(&self, dtype: flashrt_ir::DType) -> Result<f64> {
        let _ = dtype;
        Err(crate::error::Error::Unsupported(
            "no matmul-rate probe on this backend".into(),
        ))
    }
}

/// A model whose weights live on a device.
pub trait DeviceModel: Send + Sync {
    fn compiled(&self) -> &Arc<Compiled>;
    fn backend_name(&self) -> String;
    /// A new session with zeroed state.
    fn new_session(&self) -> Result<Box<dyn DeviceSession>>;
    /// Device bytes each session allocates for itself (its state arena and what goes with
    /// it), as opposed to [`DeviceModel::shared_bytes`]: what a server divides free memory by
    /// to know how many sessions fit.
    fn session_bytes(&self) -> usize {
        let l = &self.compiled().layout;
        l.arena_bytes(Role::State) + l.arena_bytes(Role::Scratch) + l.arena_bytes(Role::Io)
    }
    /// Device bytes all sessions of the model share, allocated once (by the first session)
    /// and kept while the model lives. The default backend shares nothing.
    fn shared_bytes(&self) -> usize {
        0
    }
    /// Whether a step costs its plan's full rows whatever it is given (captured graphs over
    /// padded rows: the CUDA backend), rather than the rows it computes (the CPU reference).
    /// The chunk planner's derived costs follow it ([`crate::chunking`]).
    fn pads_rows(&self) -> bool {
        true
    }
    /// One decode step of several sessions of this model at once: session `r` feeds
    /// `tokens[r]` at its position `positions[r]`. Returns, per session, its logits row (a host
    /// copy, or `None` where its copy is deferred: [`DeviceSession::deferred_row`] of the
    /// session's [`DeviceSession::steps_run`]) and the row of the device's logits buffer that
    /// holds it until the next step of any session ([`DeviceSession::sample_row`]). Every row
    /// equals, bit for bit, the session's own decode step. The default (the CPU reference: it has no weights to share between rows)
    /// steps the sessions one after the other; the CUDA backend runs one batched graph
    /// (`backend/cuda/batch.rs`). On error the sessions' states are undefined.
    fn step_batch(
        &self,
        sessions: &mut [&mut dyn DeviceSession],
        tokens: &[u32],
        positions: &[usize],
    ) -> Result<Vec<(Option<Vec<f32>>, usize)>> {
        if tokens.len() != sessions.len() || positions.len() != sessions.len() {
            return Err(crate::error::Error::Input(format!(
                "a batched step of {} sessions needs as many tokens and positions, got {} and {}",
                sessions.len(),
                tokens.len(),
                positions.len()
            )));
        }
        sessions
            .iter_mut()
            .zip(tokens.iter().zip(positions))
            .map(|(s, (&t, &p))| {
                Ok((
                    Some(s.step_read(Phase::Decode, &[t], p, StepLogits::Last)?),
                    0,
                ))
            })
            .collect()
    }
    /// Why [`DeviceModel::step_batch`] runs sessions one by one on this model, if it does.
    fn batch_unsupported(&self) -> Option<String> {
        Some("this backend has no batched kernels".into())
    }
    /// Time every device command of this model's next batched step (a step of 2 or more rows
    /// through [`DeviceModel::step_batch`], run as plain launches with an event between
    /// commands); [`DeviceModel::take_batch_profile`] then gives `(label, ms)` in plan order.
    /// For benchmarks (`flashrt bench --batch ... --profile`).
    fn profile_next_batch(&self) -> Result<()> {
        Err(crate::error::Error::Unsupported(
            "timing a batched step's commands needs the CUDA backend".into(),
        ))
    }
    /// The times [`DeviceModel::profile_next_batch`] asked for, once that step has run (and
    /// the request withdrawn if it has not).
    fn take_batch_profile(&self) -> Option<Vec<(String, f64)>> {
        None
    }
}

/// One session's arenas on the device.
pub trait DeviceSession: Send {
    /// The concrete session (a backend's batched step finds its own sessions' arenas).
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// Run the plan of `phase` over `tokens` (`1 <= len <= phase.rows()`) starting at absolute
    /// position `pos`. Leaves the state at `pos + len` and the logits of every row in `io.logits`.
    fn step(&mut self, phase: Phase, tokens: &[u32], pos: usize) -> Result<()>;
    /// [`DeviceSession::step`], producing only the `logits` rows asked for (backends may skip
    /// the LM head's other rows). The default computes them all.
    fn step_logits(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        logits: StepLogits,
    ) -> Result<()> {
        let _ = logits;
        self.step(phase, tokens, pos)
    }
    /// Logits of rows `0..rows` of the last step, row-major `[rows, vocab]`, as f32.
    fn logits(&self, rows: usize) -> Result<Vec<f32>>;
    /// [`DeviceSession::step_logits`] and the read of what it produced, as one operation: all
    /// rows of the chunk for [`StepLogits::All`], the last row for [`StepLogits::Last`],
    /// nothing for [`StepLogits::None`]. Backends whose sessions share an I/O arena (CUDA)
    /// hold it across both, so no other session's step can come in between.
    fn step_read(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        want: StepLogits,
    ) -> Result<Vec<f32>> {
        self.step_logits(phase, tokens, pos, want)?;
        match want {
            StepLogits::All => self.logits(tokens.len()),
            StepLogits::Last => self.logits_row(tokens.len() - 1),
            StepLogits::None => Ok(Vec::new()),
        }
    }
    /// Logits of row `row` of the last step (`[vocab]`): what a prefill needs when only the
    /// last position's distribution is wanted. Backends override it to copy one row only.
    fn logits_row(&self, row: usize) -> Result<Vec<f32>> {
        let all = self.logits(row + 1)?;
        let vocab = all.len() / (row + 1);
        Ok(all[row * vocab..].to_vec())
    }
    /// Steps this session has run (any phase). While it is unchanged, and no other session
    /// of the model has stepped, the I/O arena still holds the last step's logits.
    fn steps_run(&self) -> u64 {
        0
    }
    /// Draw the next token on the device from row `row` of the last step's logits, with the
    /// inputs [`crate::SamplerState::draw_spec`] computed: the same token the host sampler
    /// chooses from the same row (only the id crosses to the host). `None` when no logit of
    /// the row is finite. `Unsupported` where the backend has no device sampler; an error,
    /// not a token, when another session's step has overwritten the row. With `penalties`
    /// (step 0 of [`crate::sampling`]) the draw is from a penalized copy of the row; the row
    /// itself is left as the step wrote it.
    fn sample_row(
        &mut self,
        row: usize,
        spec: &crate::sampling::DrawSpec,
        penalties: Option<&crate::sampling::PenaltyList>,
    ) -> Result<Option<u32>> {
        let _ = (row, spec, penalties);
        Err(crate::error::Error::Unsupported(
            "no device sampler on this backend".into(),
        ))
    }
    /// The greedy choice ([`crate::argmax`]) from row `row` of the last step's logits, on the
    /// device: [`DeviceSession::sample_row`]'s contract for the sampler's greedy draw (`None`
    /// when every value is NaN).
    fn argmax_row(
        &mut self,
        row: usize,
        penalties: Option<&crate::sampling::PenaltyList>,
    ) -> Result<Option<u32>> {
        let _ = (row, penalties);
        Err(crate::error::Error::Unsupported(
            "no device sampler on this backend".into(),
        ))
    }
    /// Step as [`DeviceSession::step_logits`] with the last row's logits left on the device,
    /// and queue their copy to host memory behind the step, without waiting for either:
    /// `Some(ticket)` (the session's [`DeviceSession::steps_run`] after this step), then
    /// [`DeviceSession::deferred_row`] reads the row when it is wanted, so a step whose token is
    /// drawn on the device ([`DeviceSession::sample_row`], [`DeviceSession::argmax_row`]) never
    /// waits for the row's copy. `None`: the backend does not defer (nothing ran; the caller
    /// uses [`DeviceSession::step_read`]).
    fn step_deferred(&mut self, phase: Phase, tokens: &[u32], pos: usize) -> Result<Option<u64>> {
        let _ = (phase, tokens, pos);
        Ok(None)
    }
    /// The logits row of the [`DeviceSession::step_deferred`] that returned `ticket` (waits for
    /// its copy); an error once a later deferred step has replaced it.
    fn deferred_row(&self, ticket: u64) -> Result<Vec<f32>> {
        let _ = ticket;
        Err(crate::error::Error::Unsupported(
            "no deferred logits on this backend".into(),
        ))
    }
    /// Block until every step, save and restore queued so far has completed (benchmarks stop
    /// their clocks after this). Synchronous backends need not override it.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// Device time of the last [`DeviceSession::restore`]'s copy (waits for it), where the
    /// backend times it on the device: the figure to hold against a device copy of the same
    /// bytes (host-side call overhead excluded). `None` if not timed.
    fn last_restore_seconds(&self) -> Result<Option<f64>> {
        Ok(None)
    }
    /// Keep, during the next step only (a speculative round's verify pass), every non-KV state
    /// region's value after each of its rows, so that [`DeviceSession::rollback_to_row`] can
    /// return to any of them with a copy instead of a replay. `false` where the backend does
    /// not keep them (the caller then saves and replays).
    fn keep_row_states(&mut self) -> bool {
        false
    }
    /// Whether [`DeviceSession::keep_row_states`] would keep them (asked before the round's
    /// drafting, to choose what it saves). Arms nothing.
    fn can_keep_row_states(&self) -> bool {
        false
    }
    /// After a step run with [`DeviceSession::keep_row_states`]: set every non-KV state region
    /// to its value after row `row` of that step — bit for bit what a step of rows
    /// `0..=row` alone leaves (K/V rows past it are dead by position). One-shot: any other
    /// step, reset or restore discards the kept states.
    fn rollback_to_row(&mut self, row: usize) -> Result<()> {
        let _ = row;
        Err(crate::error::Error::Unsupported(
            "no per-row states on this backend".into(),
        ))
    }
    /// Zero every state region (a fresh session).
    fn reset(&mut self) -> Result<()>;
    /// Copy the selected regions (KV: only positions `0..pos`) into backend-owned storage.
    fn save(&self, pos: usize, set: RegionSet) -> Result<Arc<dyn SavedState>>;
    /// Copy saved regions back; regions outside `set` are left as they are. The first `held`
    /// rows of every per-position (KV) region already hold the saved bytes (the caller knows:
    /// [`crate::Capsule::kv_rows`]); a backend may skip copying them.
    fn restore(&mut self, saved: &dyn SavedState, set: RegionSet, held: usize) -> Result<()>;
    /// The current bytes of one state region, up to position `pos` for KV, on the host.
    fn read_region(&self, id: BufferId, pos: usize) -> Result<Vec<u8>>;
    /// Run one step like [`DeviceSession::step`] and time every device command of it, in plan
    /// order: `(label, milliseconds)`. The label names the phase, the op index and kind, and
    /// for matmuls the weight. Backends without a per-command clock return `Unsupported`.
    fn profile_step(
        &mut self,
        phase: Phase,
        tokens: &[u32],
        pos: usize,
        logits: StepLogits,
    ) -> Result<Vec<(String, f64)>> {
        let _ = (phase, tokens, pos, logits);
        Err(crate::error::Error::Unsupported(
            "per-command profiling needs the CUDA backend".into(),
        ))
    }
}

/// The CUDA backend on device 0, its small phases' matmuls on the tensor cores or not
/// (`tensor_core_decode`; `None`: the default, [`cuda::CudaOptions`]).
pub fn cuda_with(tensor_core_decode: Option<bool>) -> Result<Arc<dyn Backend>> {
    #[cfg(feature = "cuda")]
    {
        let mut options = cuda::CudaOptions::default();
        if let Some(on) = tensor_core_decode {
            options.gemv16_mma = on;
        }
        Ok(Arc::new(cuda::CudaBackend::with_options(0, options)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = tensor_core_decode;
        Ok(Arc::new(cuda::CudaBackend::new(0)?))
    }
}

/// [`best`], with the CUDA backend's small phases' matmuls on the tensor cores or not
/// (`None`: the default; the CPU reference has no such choice).
pub fn best_with(tensor_core_decode: Option<bool>) -> Result<Arc<dyn Backend>> {
    match std::env::var("FLASHRT_BACKEND").ok().as_deref() {
        Some("cpu") => return Ok(Arc::new(cpu::CpuBackend::new())),
        Some("cuda") => return cuda_with(tensor_core_decode),
        _ => {}
    }
    if cuda::CudaBackend::available()
        && let Ok(b) = cuda_with(tensor_core_decode)
    {
        return Ok(b);
    }
    Ok(Arc::new(cpu::CpuBackend::new()))
}

/// The best backend available at run time: CUDA when compiled in and a GPU and driver are
/// present, otherwise the CPU reference. `FLASHRT_BACKEND=cpu|cuda` forces one.
pub fn best() -> Result<Arc<dyn Backend>> {
    best_with(None)
}

#[cfg(test)]
mod tests {
    use super::RegionSet;
    use flashrt_ir::StateKind;

    /// Which regions each set holds, and which saves can serve which restores: a round that
    /// saved only `mtp.hidden` cannot be replayed from (it needs the non-KV set).
    #[test]
    fn region_sets_hold_and_cover_what_they_say() {
        use StateKind::*;
        let kinds = [
            Some(Key),
            Some(Value),
            Some(Conv),
            Some(Recurrent),
            Some(Hidden),
            None,
        ];
        let held = |set: RegionSet| kinds.map(|k| set.contains(k));
        assert_eq!(held(RegionSet::All), [true; 6]);
        assert_eq!(
            held(RegionSet::KvOnly),
            [true, true, false, false, false, false]
        );
        assert_eq!(
            held(RegionSet::NonKv),
            [false, false, true, true, true, false]
        );
        assert_eq!(
            held(RegionSet::Hidden),
            [false, false, false, false, true, false]
        );
        assert!(RegionSet::All.covers(RegionSet::Hidden));
        assert!(RegionSet::NonKv.covers(RegionSet::Hidden));
        assert!(!RegionSet::Hidden.covers(RegionSet::NonKv));
        assert!(!RegionSet::KvOnly.covers(RegionSet::Hidden));
        assert!(!RegionSet::NonKv.covers(RegionSet::All));
    }
}
