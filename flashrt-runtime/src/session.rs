//! Models and sessions: the public surface the CLI, the facade and the tests use.
//!
//! A [`Model`] is compiled IR plus weights resident on one backend; it is `Arc`-shared and
//! cheap to clone. A [`Session`] owns one set of arenas on the backend and a token history;
//! it appends tokens (prefill chunks and decode steps), exposes logits, and snapshots /
//! restores / forks / rolls back its whole execution state as [`Capsule`]s.
//!
//! # Chunking
//!
//! [`Session::append`] runs its input as the sequence of decode, verify and prefill steps the
//! model's chunk planner predicts cheapest ([`crate::chunking`]): a single token is a decode
//! step, a few tokens a verify pass, a long suffix the buckets that cover it at least cost
//! rather than one padded bucket. On the CPU backend every op is chunking-invariant (see
//! [`crate::backend::cpu`]), so the logits and state after any sequence of appends equal
//! those of one cold prefill of the concatenated tokens, bit for bit.

use crate::backend::{Backend, DeviceModel, DeviceSession, HostWeights, RegionSet, StepLogits};
use crate::capsule::{Capsule, CapsuleMeta, Counters, LogitsRow, SamplerState};
use crate::chunking::{ChunkCosts, CostSource, PlanCost, token_plans};
use crate::error::{Error, Result};
use crate::held_rows::{HeldRows, reuse_held_rows};
use crate::loader;
use flashrt_ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_ir::{BufferId, Compiled, ModelIr, Phase, Role, compile};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::{Arc, RwLock};

/// Where a model's weights come from.
pub enum WeightSource {
    /// Host tensors in layout order (see [`HostWeights`]).
    Host(HostWeights),
    /// A Hugging Face checkpoint folder (its safetensors files; `config.json` is not read).
    HfDir(PathBuf),
    /// [`crate::init::random_weights`] with this seed.
    Random(u64),
}

struct ModelInner {
    backend: Arc<dyn Backend>,
    device: Arc<dyn DeviceModel>,
    compiled: Arc<Compiled>,
    weights_digest: String,
    /// The chunk planner's costs ([`crate::chunking`]): derived at load, measured by
    /// [`Model::calibrate_chunking`].
    chunking: RwLock<ChunkCosts>,
}

/// The largest `max_seq` (at most `ir.max_seq`, a multiple of 1024 when it has to shrink)
/// for which the weights and one session's arenas take at most 90 % of the memory the
/// backend has free. `ir.max_seq` when the backend does not say.
pub fn fit_max_seq(ir: &ModelIr, backend: &dyn Backend) -> usize {
    let Some(free) = backend.memory_available() else {
        return ir.max_seq;
    };
    let c = compile(ir, backend.target(ir));
    let l = &c.layout;
    let fixed = l.arena_bytes(Role::Weight)
        + l.arena_bytes(Role::Scratch)
        + l.arena_bytes(Role::Io)
        + l.capsule_fixed_bytes();
    let per_token = l.capsule_bytes_per_token().max(1);
    let budget = free / 10 * 9;
    if fixed + per_token * ir.max_seq <= budget {
        return ir.max_seq;
    }
    let fit = budget.saturating_sub(fixed) / per_token / 1024 * 1024;
    fit.clamp(1024.min(ir.max_seq), ir.max_seq)
}

/// The backend computes in the dtype `compiled` was compiled for.
fn check_target(backend: &Arc<dyn Backend>, compiled: &Compiled) -> Result<()> {
    let want = backend.target(&compiled.ir);
    if compiled.layout.target != want {
        return Err(Error::Unsupported(format!(
            "{} was compiled for {}, backend {} needs {}",
            compiled.ir.name,
            compiled.layout.target.dtype.name(),
            backend.name(),
            want.dtype.name()
        )));
    }
    Ok(())
}

/// A compiled model with its weights on a backend. Cheap to clone (shared).
#[derive(Clone)]
pub struct Model {
    inner: Arc<ModelInner>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("name", &self.name())
            .field("fingerprint", &self.fingerprint())
            .field("backend", &self.backend_name())
            .finish()
    }
}

/// A model name derived from a folder name (`qwen35-public` -> `qwen35_public`).
pub fn name_from_dir(dir: &Path) -> Option<String> {
    let base = dir.canonicalize().ok().unwrap_or_else(|| dir.to_path_buf());
    let raw = base.file_name()?.to_string_lossy().to_lowercase();
    let mut s: String = raw
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.is_empty() {
        return None;
    }
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, 'm');
    }
    Some(s)
}

impl Model {
    /// Load a Hugging Face checkpoint folder: `config.json` -> IR -> compile for the
    /// backend's target -> weights from the folder's safetensors files. Without a name in
    /// `opts`, the model is named after the folder.
    pub fn load_hf_dir(backend: Arc<dyn Backend>, dir: &Path, opts: &HfOptions) -> Result<Model> {
        let cfg = dir.join("config.json");
        let json = std::fs::read_to_string(&cfg).map_err(|e| Error::Io {
            path: cfg.display().to_string(),
            source: e,
        })?;
        let mut opts = opts.clone();
        if opts.name.is_none() {
            opts.name = name_from_dir(dir);
        }
        let mut ir = ir_from_hf_config(&json, &opts)
            .map_err(|e| Error::Config(format!("{}: {e}", cfg.display())))?;
        if opts.max_seq.is_none() {
            let fit = fit_max_seq(&ir, backend.as_ref());
            if fit < ir.max_seq {
                tracing::info!(
                    "max_seq {} (config.json) capped to {fit}: weights and one session's state \
                     must fit in {} GB of free memory (--max-seq overrides)",
                    ir.max_seq,
                    backend.memory_available().unwrap_or(0) / 1_000_000_000
                );
                let opts = HfOptions {
                    max_seq: Some(fit),
                    ..opts
                };
                ir = ir_from_hf_config(&json, &opts)
                    .map_err(|e| Error::Config(format!("{}: {e}", cfg.display())))?;
            }
        }
        Model::from_ir(backend, &ir, WeightSource::HfDir(dir.to_path_buf()))
    }

    /// A model described by `ir` (e.g. generated from TOML or a macro) with its weights from
    /// the Hugging Face checkpoint folder `dir` (`config.json` is not read).
    pub fn load_ir_dir(backend: Arc<dyn Backend>, ir: ModelIr, dir: &Path) -> Result<Model> {
        Model::from_ir(backend, &ir, WeightSource::HfDir(dir.to_path_buf()))
    }

    /// Compile `ir` for the backend's target and load weights.
    pub fn from_ir(
        backend: Arc<dyn Backend>,
        ir: &ModelIr,
        weights: WeightSource,
    ) -> Result<Model> {
        let compiled = compile(ir, backend.target(ir));
        match weights {
            WeightSource::Host(h) => Model::from_compiled(backend, Arc::new(compiled), h),
            WeightSource::HfDir(dir) => {
                let ckpt = loader::Checkpoint::open(&dir)?;
                let mut progress = loader::TerminalProgress::new();
                Model::from_checkpoint(backend, compiled, &ckpt, &mut progress)
            }
            // Generated where the weights live (on the device for CUDA: no host copy).
            WeightSource::Random(seed) => {
                let digest = format!("random-seed:{seed}");
                let compiled = Arc::new(compiled.with_weights_digest(&digest));
                check_target(&backend, &compiled)?;
                let device = backend.load_random(compiled.clone(), seed)?;
                Ok(Model::assemble(backend, device, compiled, digest))
            }
        }
    }

    /// Stream a checkpoint's weights into the backend (see [`loader::Checkpoint::load`]);
    /// the model's fingerprint covers the weights' digest.
    pub fn from_checkpoint(
        backend: Arc<dyn Backend>,
        compiled: Compiled,
        checkpoint: &loader::Checkpoint,
        progress: &mut dyn loader::LoadProgress,
    ) -> Result<Model> {
        check_target(&backend, &compiled)?;
        let mut sink = backend.weight_sink(&compiled)?;
        let report = checkpoint.load(&compiled, sink.as_mut(), progress)?;
        let compiled = Arc::new(compiled.with_weights_digest(&report.digest));
        let device = sink.finish(compiled.clone())?;
        Ok(Model::assemble(backend, device, compiled, report.digest))
    }

    fn assemble(
        backend: Arc<dyn Backend>,
        device: Arc<dyn DeviceModel>,
        compiled: Arc<Compiled>,
        weights_digest: String,
    ) -> Model {
        let chunking = RwLock::new(ChunkCosts::derived(&compiled, device.pads_rows()));
        Model {
            inner: Arc::new(ModelInner {
                backend,
                device,
                compiled,
                weights_digest,
                chunking,
            }),
        }
    }

    /// A model with deterministic random weights (demo, benchmarks).
    pub fn with_random_weights(
        backend: Arc<dyn Backend>,
        ir: &ModelIr,
        seed: u64,
    ) -> Result<Model> {
        Model::from_ir(backend, ir, WeightSource::Random(seed))
    }

    /// Upload host weights for a model compiled for `backend.target(..)`; the fingerprint
    /// covers a digest of the values.
    pub fn from_compiled(
        backend: Arc<dyn Backend>,
        compiled: Arc<Compiled>,
        weights: HostWeights,
    ) -> Result<Model> {
        check_target(&backend, &compiled)?;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for t in weights.tensors.iter().flatten() {
            h.update(&(t.len() as u64).to_le_bytes());
            for x in t {
                h.update(&x.to_le_bytes());
            }
        }
        let digest = format!("host:{:032x}", h.digest128());
        let compiled = Arc::new((*compiled).clone().with_weights_digest(&digest));
        let device = backend.load(compiled.clone(), weights)?;
        Ok(Model::assemble(backend, device, compiled, digest))
    }

    /// What the fingerprint says about the weights: a checkpoint's XXH3-128 digest (names,
    /// dtypes, shapes, data), `random-seed:N`, or `host:` and a digest of host values.
    pub fn weights_digest(&self) -> &str {
        &self.inner.weights_digest
    }

    pub fn compiled(&self) -> &Arc<Compiled> {
        &self.inner.compiled
    }
    pub fn ir(&self) -> &ModelIr {
        &self.inner.compiled.ir
    }
    pub fn name(&self) -> &str {
        &self.inner.compiled.ir.name
    }
    pub fn fingerprint(&self) -> &str {
        &self.inner.compiled.layout.fingerprint
    }
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.inner.backend
    }
    pub fn backend_name(&self) -> String {
        self.inner.device.backend_name()
    }
    pub fn vocab(&self) -> usize {
        self.inner.compiled.ir.vocab
    }
    pub fn max_seq(&self) -> usize {
        self.inner.compiled.layout.max_seq
    }
    /// Device bytes each session allocates for itself ([`DeviceModel::session_bytes`]).
    pub fn session_bytes(&self) -> usize {
        self.inner.device.session_bytes()
    }
    /// Device bytes all sessions share, allocated once ([`DeviceModel::shared_bytes`]).
    pub fn shared_bytes(&self) -> usize {
        self.inner.device.shared_bytes()
    }

    /// Whether a step costs its plan's full rows ([`DeviceModel::pads_rows`]).
    pub fn pads_rows(&self) -> bool {
        self.inner.device.pads_rows()
    }

    /// The chunk planner's current costs.
    pub fn chunk_costs(&self) -> ChunkCosts {
        self.inner
            .chunking
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replace the chunk planner's costs (every plan must be one of the model's decode,
    /// verify or prefill plans, and the table must cover a decode step).
    pub fn set_chunk_costs(&self, costs: ChunkCosts) -> Result<()> {
        let c = &self.inner.compiled;
        if let Some(p) = costs
            .plans()
            .iter()
            .find(|p| !token_plans(c).any(|q| q == p.phase))
        {
            return Err(Error::Input(format!(
                "model {} has no token plan {}",
                c.ir.name,
                p.phase.label()
            )));
        }
        if !costs.plans().iter().any(|p| p.phase == Phase::Decode) {
            return Err(Error::Input("a cost table needs the decode plan".into()));
        }
        if let Some(p) = costs
            .plans()
            .iter()
            .find(|p| !(p.fixed.is_finite() && p.per_row.is_finite() && p.fixed + p.per_row > 0.0))
        {
            return Err(Error::Input(format!(
                "plan {}: a cost must be finite and positive",
                p.phase.label()
            )));
        }
        *self
            .inner
            .chunking
            .write()
            .unwrap_or_else(|e| e.into_inner()) = costs;
        Ok(())
    }

    /// Which plans run an append of `n` tokens, over how many rows each (in order).
    pub fn plan_chunks(&self, n: usize) -> Vec<(Phase, usize)> {
        self.inner
            .chunking
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .plan(n)
    }

    /// Time every decode, verify and prefill plan on a scratch session and make the chunk
    /// planner use the measurements (milliseconds, `fixed + per_row · rows` from a full and a
    /// one-row step, the median of `runs` each after two untimed steps, which on the CUDA
    /// backend also capture every plan's graph). `progress` gets one line per plan. Needs one
    /// session's memory for the duration.
    pub fn calibrate_chunking(
        &self,
        runs: usize,
        progress: &mut dyn FnMut(&str),
    ) -> Result<ChunkCosts> {
        let runs = runs.max(1);
        let compiled = self.inner.compiled.clone();
        let mut dev = self.inner.device.new_session()?;
        let mut plans = Vec::new();
        for phase in token_plans(&compiled) {
            dev.reset()?;
            let mut time = |rows: usize, n: usize| -> Result<f64> {
                let tokens = vec![0u32; rows];
                let mut t = Vec::with_capacity(n);
                for _ in 0..n {
                    let start = std::time::Instant::now();
                    dev.step_read(phase, &tokens, 0, StepLogits::Last)?;
                    t.push(start.elapsed().as_secs_f64() * 1e3);
                }
                t.sort_by(f64::total_cmp);
                Ok(t[t.len() / 2])
            };
            time(phase.rows(), 2)?;
            let full = time(phase.rows(), runs)?;
            let (fixed, per_row) = if phase.rows() > 1 {
                let one = time(1, runs)?;
                let per_row = ((full - one) / (phase.rows() - 1) as f64).max(0.0);
                ((full - per_row * phase.rows() as f64).max(1e-6), per_row)
            } else {
                (full, 0.0)
            };
            progress(&format!(
                "{}: {full:.3} ms ({} rows), {:.3} ms (1 row)",
                phase.label(),
                phase.rows(),
                fixed + per_row
            ));
            plans.push(PlanCost {
                phase,
                fixed,
                per_row,
            });
        }
        let costs = ChunkCosts::new(plans, CostSource::Measured);
        self.set_chunk_costs(costs.clone())?;
        Ok(costs)
    }

    /// A fresh session (zeroed state, position 0).
    pub fn session(&self) -> Result<Session> {
        Ok(Session {
            model: self.clone(),
            dev: self.inner.device.new_session()?,
            pos: 0,
            tokens: Vec::new(),
            logits: KeptLogits::default(),
            logits_rows: 0,
            logits_mode: LogitsMode::All,
            pending: None,
            sampler: SamplerState::default(),
            counters: Counters::default(),
            poisoned: false,
            row_states: true,
            held: HeldRows::default(),
        })
    }

    /// A new, independent session at the capsule's boundary.
    pub fn fork(&self, capsule: &Capsule) -> Result<Session> {
        let mut s = self.session()?;
        s.restore(capsule)?;
        Ok(s)
    }

    /// Feed one token to each of several sessions of this model in batched decode steps:
    /// session `r` takes `tokens[r]` at its own position. Afterwards every session is exactly
    /// as after its own `append(&[tokens[r]])` — same state bytes, same logits bits, same
    /// counters — so capsules move freely between batched and one-by-one stepping.
    ///
    /// On the CUDA backend up to 8 sessions run as one graph replay that reads the weights once
    /// for all of them (`decode[b]`, b from the model's `decode_batches` ladder, default 2, 4,
    /// 8; larger sets go in groups of the largest); the CPU
    /// reference, and models whose decode plan has no batched kernels
    /// ([`Model::batch_unsupported`]), step the sessions one after the other. A robot or agent
    /// loop calls this once per tick for all its streams; the server's scheduler does too.
    ///
    /// Checks every session before anything runs (an error then changes nothing); a device
    /// error half-way leaves every session of the failed group needing a reset or restore.
    pub fn step_batch(&self, sessions: &mut [&mut Session], tokens: &[u32]) -> Result<()> {
        if tokens.len() != sessions.len() {
            return Err(Error::Input(format!(
                "step_batch: {} sessions but {} tokens",
                sessions.len(),
                tokens.len()
            )));
        }
        for (r, (s, &t)) in sessions.iter().zip(tokens).enumerate() {
            if !Arc::ptr_eq(&s.model.inner, &self.inner) {
                return Err(Error::Input(format!(
                    "step_batch: session {r} belongs to another model (`{}`)",
                    s.model.name()
                )));
            }
            s.validate(&[t])
                .map_err(|e| Error::Input(format!("step_batch: session {r}: {e}")))?;
        }
        let group_size = self.ir().batch_sizes().last().copied().unwrap_or(1);
        for (group, toks) in sessions
            .chunks_mut(group_size)
            .zip(tokens.chunks(group_size))
        {
            let positions: Vec<usize> = group.iter().map(|s| s.pos).collect();
            let rows = {
                let mut devs: Vec<&mut dyn DeviceSession> = Vec::with_capacity(group.len());
                for s in group.iter_mut() {
                    devs.push(s.dev.as_mut());
                }
                self.inner.device.step_batch(&mut devs, toks, &positions)
            };
            let rows = match rows {
                Ok(rows) => rows,
                Err(e) => {
                    for s in group.iter_mut() {
                        s.poisoned = true;
                        s.logits.clear();
                        s.logits_rows = 0;
                    }
                    return Err(e);
                }
            };
            for ((s, &t), (row, at)) in group.iter_mut().zip(toks).zip(rows) {
                // A row whose copy is deferred is read when first wanted.
                let host = row.map_or_else(OnceLock::new, |r| OnceLock::from(Ok(r)));
                s.logits = KeptLogits::Device(host, at, s.dev.steps_run());
                s.logits_rows = 1;
                s.pos += 1;
                s.tokens.push(t);
                s.counters.steps += 1;
                s.counters.decode_tokens += 1;
                s.pending = None;
            }
        }
        Ok(())
    }

    /// [`Model::step_batch`] of 2 to the largest batch size's sessions, with every device
    /// command of the batched step timed: `(label, ms)` in plan order (plain launches with an
    /// event between commands, so each time includes what a replayed step pays per command).
    /// The sessions advance as after `step_batch`. For benchmarks (`flashrt bench --batch ...
    /// --profile`); backends that do not time commands (the CPU reference) say so.
    pub fn profile_step_batch(
        &self,
        sessions: &mut [&mut Session],
        tokens: &[u32],
    ) -> Result<Vec<(String, f64)>> {
        let most = self.ir().batch_sizes().last().copied().unwrap_or(1);
        if sessions.len() < 2 || sessions.len() > most {
            return Err(Error::Input(format!(
                "profile_step_batch: a batched step of 2 to {most} sessions, not {}",
                sessions.len()
            )));
        }
        if let Some(why) = self.batch_unsupported() {
            return Err(Error::Unsupported(format!(
                "profile_step_batch: this model steps sessions one by one ({why})"
            )));
        }
        self.inner.device.profile_next_batch()?;
        let stepped = self.step_batch(sessions, tokens);
        let times = self.inner.device.take_batch_profile();
        stepped?;
        times.ok_or_else(|| Error::Unsupported("profile_step_batch: the step was not timed".into()))
    }

    /// Why [`Model::step_batch`] steps this model's sessions one by one (`None`: it batches
    /// them on the device).
    pub fn batch_unsupported(&self) -> Option<String> {
        self.inner.device.batch_unsupported()
    }
}

/// The logits rows a session keeps: its own (from the device), or a capsule's last row
/// shared with it (after a restore).
#[derive(Debug)]
enum KeptLogits {
    Own(Vec<f32>),
    Shared(Arc<[f32]>),
    /// The last step's last row, which is also row `.1` of the device's I/O arena as long as
    /// the device session's [`DeviceSession::steps_run`] is still `.2` (a device sampler
    /// may draw from it there). `.0` is its host copy: read with the step (a batched step's
    /// rows), or when first wanted ([`DeviceSession::deferred_row`] of ticket `.2`, after a
    /// [`DeviceSession::step_deferred`]), so a token drawn on the device never waits for it.
    Device(HostRow, usize, u64),
}

/// A device row's host copy, once read (or why it could not be).
type HostRow = OnceLock<std::result::Result<Vec<f32>, String>>;

impl Default for KeptLogits {
    fn default() -> Self {
        KeptLogits::Own(Vec::new())
    }
}

impl KeptLogits {
    /// The rows on the host (a deferred device row is read from `dev` on first use).
    fn rows(&self, dev: &dyn DeviceSession) -> Result<&[f32]> {
        match self {
            KeptLogits::Own(v) => Ok(v),
            KeptLogits::Shared(a) => Ok(a),
            KeptLogits::Device(host, _, ticket) => host
                .get_or_init(|| dev.deferred_row(*ticket).map_err(|e| e.to_string()))
                .as_deref()
                .map_err(|msg| Error::Backend {
                    op: "read logits".into(),
                    msg: msg.clone(),
                }),
        }
    }

    /// The last of `n` rows of `v` logits (empty when `n` is 0).
    fn last(&self, dev: &dyn DeviceSession, n: usize, v: usize) -> Result<&[f32]> {
        if n == 0 {
            return Ok(&[]);
        }
        let rows = self.rows(dev)?;
        rows.get((n - 1) * v..n * v).ok_or_else(|| Error::Backend {
            op: "read logits".into(),
            msg: format!("{} logits kept for {n} rows of {v}", rows.len()),
        })
    }

    /// Empty, keeping an owned buffer's capacity.
    fn clear(&mut self) {
        match self {
            KeptLogits::Own(v) => v.clear(),
            KeptLogits::Shared(_) | KeptLogits::Device(..) => *self = KeptLogits::default(),
        }
    }

    /// The owned buffer (a shared row is dropped first).
    fn own(&mut self) -> &mut Vec<f32> {
        if !matches!(self, KeptLogits::Own(_)) {
            *self = KeptLogits::default();
        }
        match self {
            KeptLogits::Own(v) => v,
            _ => unreachable!("replaced above"),
        }
    }
}

/// Which logits rows [`Session::append`] keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogitsMode {
    /// Every row of the last append (`[n, vocab]`).
    #[default]
    All,
    /// Only the last row (long prompts with large vocabularies).
    Last,
}

/// A state region named by buffer name or id.
#[derive(Clone, Copy, Debug)]
pub enum RegionKey<'a> {
    Name(&'a str),
    Id(BufferId),
}

impl<'a> From<&'a str> for RegionKey<'a> {
    fn from(s: &'a str) -> Self {
        RegionKey::Name(s)
    }
}
impl<'a> From<&'a String> for RegionKey<'a> {
    fn from(s: &'a String) -> Self {
        RegionKey::Name(s)
    }
}
impl From<BufferId> for RegionKey<'_> {
    fn from(id: BufferId) -> Self {
        RegionKey::Id(id)
    }
}

/// One stream of tokens through a model, with its own state arenas.
pub struct Session {
    model: Model,
    dev: Box<dyn DeviceSession>,
    pos: usize,
    tokens: Vec<u32>,
    /// Kept rows of the last append, row-major.
    logits: KeptLogits,
    logits_rows: usize,
    logits_mode: LogitsMode,
    pending: Option<u32>,
    sampler: SamplerState,
    counters: Counters,
    /// A step failed half-way: the state is undefined until `reset` or a restore.
    poisoned: bool,
    /// Speculative rounds roll back through the backend's per-row states where it keeps
    /// them ([`Session::set_row_states`]).
    row_states: bool,
    /// Whose per-position rows the state holds, and how many ([`Capsule::kv_rows`]).
    held: HeldRows,
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("model", &self.model.name())
            .field("pos", &self.pos)
            .finish()
    }
}

/// Index of the largest value (the first one on ties; NaN never wins).
pub fn argmax(row: &[f32]) -> Option<u32> {
    // The maximum (lane-wise over 16 accumulators, so the loop vectorises; `f32::max` skips
    // NaN), then the first index holding it: the same answer as a strict-greater scan.
    let m = lane_max(row, |v| v);
    if m.is_nan() {
        return None;
    }
    row.iter().position(|&v| v == m).map(|i| i as u32)
}

/// The largest finite value of `row` (`None` if it has none).
pub fn max_finite(row: &[f32]) -> Option<f32> {
    let m = lane_max(row, |v| if v.is_finite() { v } else { f32::NAN });
    m.is_finite().then_some(m)
}

/// `max` over `f(v)` for every `v` of `row` (NaN where every value maps to NaN).
#[inline(always)]
fn lane_max(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    const LANES: usize = 16;
    let mut acc = [f32::NAN; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] = acc[j].max(f(c[j]));
        }
    }
    let mut m = f32::NAN;
    for &v in chunks.remainder() {
        m = m.max(f(v));
    }
    acc.iter().fold(m, |a, &b| a.max(b))
}

impl Session {
    pub fn model(&self) -> &Model {
        &self.model
    }
    /// Tokens consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Token history `[0, pos)`.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn counters(&self) -> Counters {
        self.counters
    }
    pub fn sampler(&self) -> &SamplerState {
        &self.sampler
    }
    /// Use `sampler` from now on; its presence and frequency penalties count the tokens that
    /// come after this point (`penalty_from` = the current position).
    pub fn set_sampler(&mut self, mut sampler: SamplerState) {
        sampler.penalty_from = self.pos;
        self.sampler = sampler;
    }
    /// Restart the sampler's RNG stream from `seed`, keeping every other setting (and the
    /// history the penalties count from): how the branches of one fork draw apart.
    pub fn reseed(&mut self, seed: u64) {
        self.sampler = self.sampler.reseeded(seed);
    }
    /// The next token, chosen but not yet fed, if any.
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }
    pub fn set_pending(&mut self, token: Option<u32>) {
        self.pending = token;
    }
    /// How a speculative round whose drafts were rejected returns to the last accepted row
    /// (see [`crate::speculative`]): with `true` (the default), through the state the backend
    /// kept after each row of the verify pass (a copy) where it keeps them; with `false`, or
    /// where it does not, by restoring the round's saved state and replaying the accepted rows.
    /// The tokens and the state are the same either way.
    pub fn set_row_states(&mut self, on: bool) {
        self.row_states = on;
    }

    pub fn set_logits_mode(&mut self, mode: LogitsMode) {
        self.logits_mode = mode;
    }

    /// Logits kept from the last append, row-major `[logits_rows(), vocab]` (after a restore:
    /// the capsule's last row).
    ///
    /// On the CUDA backend the last row crosses to the host behind the step and this waits
    /// for it; should that copy fail (a device error, which the next step reports too), this
    /// is empty.
    pub fn logits(&self) -> &[f32] {
        self.logits.rows(&*self.dev).unwrap_or_else(|e| {
            tracing::warn!("logits unavailable: {e}");
            &[]
        })
    }
    pub fn logits_rows(&self) -> usize {
        self.logits_rows
    }
    /// Logits after the last fed token (empty at position 0).
    pub fn last_logits(&self) -> &[f32] {
        self.last_row().unwrap_or_else(|e| {
            tracing::warn!("logits unavailable: {e}");
            &[]
        })
    }

    /// [`Session::last_logits`], or why the row could not be read.
    fn last_row(&self) -> Result<&[f32]> {
        self.logits
            .last(&*self.dev, self.logits_rows, self.model.vocab())
    }

    fn check_usable(&self) -> Result<()> {
        if self.poisoned {
            return Err(Error::Input(
                "a step failed half-way; reset or restore the session before using it".into(),
            ));
        }
        Ok(())
    }

    fn validate(&self, tokens: &[u32]) -> Result<()> {
        self.check_usable()?;
        if tokens.is_empty() {
            return Err(Error::Input(
                "empty input: append needs at least one token".into(),
            ));
        }
        let vocab = self.model.vocab();
        if let Some((i, &t)) = tokens
            .iter()
            .enumerate()
            .find(|&(_, &t)| t as usize >= vocab)
        {
            return Err(Error::Input(format!(
                "token id {t} at index {i} is out of range (vocab {vocab})"
            )));
        }
        let max = self.model.max_seq();
        if self.pos + tokens.len() > max {
            return Err(Error::Input(format!(
                "position {} + {} tokens exceeds max_seq {max}",
                self.pos,
                tokens.len()
            )));
        }
        Ok(())
    }

    /// Feed tokens: a sequence of decode, verify and prefill steps chosen by the model's chunk
    /// planner ([`Model::plan_chunks`], [`crate::chunking`]). Clears the pending token.
    pub fn append(&mut self, tokens: &[u32]) -> Result<()> {
        self.validate(tokens)?;
        let steps = self.model.plan_chunks(tokens.len());
        self.logits.clear();
        self.logits_rows = 0;
        let n_chunks = steps.len();
        let mut at = 0;
        for (ci, &(phase, rows)) in steps.iter().enumerate() {
            let chunk = &tokens[at..at + rows];
            at += rows;
            let keep_all = self.logits_mode == LogitsMode::All;
            let want = if keep_all {
                StepLogits::All
            } else if ci + 1 == n_chunks {
                StepLogits::Last
            } else {
                StepLogits::None
            };
            // The last row stays on the device with its host copy on the way, where the
            // backend defers it (a token drawn on the device does not wait for the copy).
            if want == StepLogits::Last {
                match self.dev.step_deferred(phase, chunk, self.pos) {
                    Ok(Some(ticket)) => {
                        self.logits = KeptLogits::Device(OnceLock::new(), chunk.len() - 1, ticket);
                        self.logits_rows = 1;
                        self.advance(phase, chunk);
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.poisoned = true;
                        self.logits.clear();
                        self.logits_rows = 0;
                        return Err(e);
                    }
                }
            }
            // Step and read as one operation: sessions of a model may share its I/O arena.
            let rows = match self.dev.step_read(phase, chunk, self.pos, want) {
                Ok(rows) => rows,
                Err(e) => {
                    self.poisoned = true;
                    self.logits.clear();
                    self.logits_rows = 0;
                    return Err(e);
                }
            };
            if keep_all {
                self.logits.own().extend_from_slice(&rows);
                self.logits_rows += chunk.len();
            } else if ci + 1 == n_chunks {
                // Only the last position's row crosses to the host.
                self.logits = KeptLogits::Device(
                    OnceLock::from(Ok(rows)),
                    chunk.len() - 1,
                    self.dev.steps_run(),
                );
                self.logits_rows = 1;
            }
            self.advance(phase, chunk);
        }
        self.pending = None;
        Ok(())
    }

    /// Position, history and counters after `chunk` was fed in a `phase` step.
    fn advance(&mut self, phase: Phase, chunk: &[u32]) {
        self.pos += chunk.len();
        self.tokens.extend_from_slice(chunk);
        self.counters.steps += 1;
        match phase {
            Phase::Decode => self.counters.decode_tokens += 1,
            // The planner never chooses the drafter's plan.
            Phase::Prefill { .. } | Phase::Verify { .. } | Phase::MtpDraft => {
                self.counters.prefill_tokens += chunk.len() as u64
            }
        }
    }

    /// Feed one chunk (at most the largest prefill bucket) as the last chunk of a prompt whose
    /// next token is wanted (last-row logits), timing every device command of the step:
    /// `(label, ms)` in plan order (see [`DeviceSession::profile_step`]). The session advances
    /// as after `append`, but keeps no logits. For benchmarks (`flashrt bench --profile`).
    pub fn profile_chunk(&mut self, tokens: &[u32]) -> Result<Vec<(String, f64)>> {
        self.validate(tokens)?;
        let buckets = &self.model.ir().prefill_buckets;
        let phase = if tokens.len() == 1 {
            Phase::Decode
        } else {
            let bucket = buckets.iter().copied().find(|&b| b >= tokens.len());
            Phase::Prefill {
                bucket: bucket.ok_or_else(|| {
                    Error::Input(format!(
                        "a profiled chunk holds at most the largest bucket's rows, not {}",
                        tokens.len()
                    ))
                })?,
            }
        };
        self.logits.clear();
        self.logits_rows = 0;
        let times = self
            .dev
            .profile_step(phase, tokens, self.pos, StepLogits::Last)
            .inspect_err(|_| {
                self.poisoned = true;
            })?;
        self.pos += tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.pending = None;
        Ok(times)
    }

    /// Greedy decoding: `n` times, take the argmax of the last logits and feed it. The first
    /// token comes from the logits already there (after a prefill or a restore).
    pub fn decode_greedy(&mut self, n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = self.argmax_next()?;
            self.append(&[t])?;
            out.push(t);
        }
        Ok(out)
    }

    /// The greedy choice from the last logits ([`argmax`] of [`Session::last_logits`]), taken
    /// on the device where the row is still there (only the id crosses to the host).
    pub fn argmax_next(&mut self) -> Result<u32> {
        self.check_usable()?;
        if self.logits_rows == 0 {
            return Err(Error::Input(
                "no logits to decode from: append tokens first".into(),
            ));
        }
        if let Some(t) = self.device_argmax(None)? {
            return Ok(t);
        }
        argmax(self.last_row()?).ok_or_else(|| Error::Backend {
            op: "argmax".into(),
            msg: "the logits row has no finite value".into(),
        })
    }

    /// The greedy choice from the kept device row (a penalized copy of it with `penalties`):
    /// `None` when the row is not on the device any more or the backend has no device
    /// sampler (the host copy gives the same choice).
    fn device_argmax(
        &mut self,
        penalties: Option<&crate::sampling::PenaltyList>,
    ) -> Result<Option<u32>> {
        let KeptLogits::Device(_, row, steps) = self.logits else {
            return Ok(None);
        };
        if steps != self.dev.steps_run() {
            return Ok(None);
        }
        match self.dev.argmax_row(row, penalties) {
            Ok(Some(t)) => Ok(Some(t)),
            Ok(None) => Err(Error::Backend {
                op: "sample".into(),
                msg: "the logits row has no finite value".into(),
            }),
            Err(Error::Unsupported(_) | Error::Input(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Choose the next token without feeding it: the pending token if there is one, else a
    /// draw from the last logits with the session's sampler (greedy by default; see
    /// [`crate::sampling`]), which advances the sampler's RNG.
    pub fn sample_next(&mut self) -> Result<u32> {
        self.check_usable()?;
        if let Some(t) = self.pending {
            return Ok(t);
        }
        let v = self.model.vocab();
        if self.logits_rows == 0 {
            return Err(Error::Input(
                "no logits to sample from: append tokens first".into(),
            ));
        }
        // Step 0 of crate::sampling: the tokens the penalties change, if any.
        let penalties = self.sampler.penalty_list(&self.tokens, v);
        // Greedy (crate::sampling: the argmax; no RNG draw) on the device, where the row is.
        if (self.sampler.is_greedy() || self.sampler.top_k == 1)
            && let Some(t) = self.device_argmax(penalties.as_ref())?
        {
            return Ok(t);
        }
        // On the device where the row is still there: the same token as the host sampler's
        // (crate::sampling), without a host pass over the row; penalties go to a device copy.
        if let KeptLogits::Device(_, row, steps) = self.logits
            && steps == self.dev.steps_run()
            && let Some((spec, rng)) = self.sampler.draw_spec(v)
        {
            match self.dev.sample_row(row, &spec, penalties.as_ref()) {
                Ok(Some(t)) => {
                    self.sampler.rng = rng;
                    return Ok(t);
                }
                Ok(None) => {
                    return Err(Error::Backend {
                        op: "sample".into(),
                        msg: "the logits row has no finite value".into(),
                    });
                }
                // No device sampler, or the row was overwritten: the host copy is the same.
                Err(Error::Unsupported(_) | Error::Input(_)) => {}
                Err(e) => return Err(e),
            }
        }
        // On the host: a penalized copy of the row when there are penalties.
        if let Some(list) = &penalties {
            let mut p = self.last_row()?.to_vec();
            list.apply(&mut p);
            return self.sampler.sample(&p).ok_or_else(|| Error::Backend {
                op: "sample".into(),
                msg: "the logits row has no finite value".into(),
            });
        }
        let row = self.logits.last(&*self.dev, self.logits_rows, v)?;
        self.sampler.sample(row).ok_or_else(|| Error::Backend {
            op: "sample".into(),
            msg: "the logits row has no finite value".into(),
        })
    }

    /// Sample and feed `n` tokens with the session's sampler ([`Session::sample_next`] then
    /// [`Session::append`] each); with the greedy sampler this equals
    /// [`Session::decode_greedy`].
    pub fn generate(&mut self, n: usize) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = self.sample_next()?;
            self.append(&[t])?;
            out.push(t);
        }
        Ok(out)
    }

    /// Run every decode, verify and prefill plan twice from position 0 (zero tokens), then
    /// [`Session::reset`]. On the CUDA backend a plan's first step on a session runs as plain
    /// launches and its second is captured as the session's graph, so a server warms the
    /// session it serves from here, before a client's request would pay for the capture (a
    /// prefill chunk's capture costs about one more step). ~2 steps of every plan.
    pub fn warm_plans(&mut self) -> Result<()> {
        let compiled = self.model.inner.compiled.clone();
        self.held.forget();
        for phase in token_plans(&compiled) {
            self.dev.reset()?;
            let tokens = vec![0u32; phase.rows()];
            for _ in 0..2 {
                self.dev.step_read(phase, &tokens, 0, StepLogits::Last)?;
            }
        }
        self.reset()
    }

    /// Zero the state: position 0, empty history.
    pub fn reset(&mut self) -> Result<()> {
        self.held.forget();
        self.dev.reset()?;
        self.pos = 0;
        self.tokens.clear();
        self.logits.clear();
        self.logits_rows = 0;
        self.pending = None;
        self.counters = Counters::default();
        self.poisoned = false;
        Ok(())
    }

    /// The execution state at the current boundary.
    pub fn snapshot(&self) -> Result<Capsule> {
        self.check_usable()?;
        let saved = self.dev.save(self.pos, RegionSet::All)?;
        self.capsule_of(saved)
    }

    /// [`Session::snapshot`] into host memory: every state region read to the host, nothing
    /// allocated on the device. Slower (a synchronous read of every region; ~0.2 s for a 1.2
    /// GiB capsule over PCIe), for when the device has no room for the copy: a server storing
    /// an automatic capsule falls back to it rather than lose the capsule. Restores exactly as
    /// the device capsule would (a host-bytes capsule, like one loaded from a file).
    pub fn snapshot_to_host(&self) -> Result<Capsule> {
        self.check_usable()?;
        let layout = &self.model.compiled().layout;
        let regions = layout
            .state_buffers()
            .map(|b| Ok((b.id, self.dev.read_region(b.id, self.pos)?)))
            .collect::<Result<Vec<_>>>()?;
        let saved = crate::host_state::HostSaved::new(layout, self.pos, regions)?;
        self.capsule_of(Arc::new(saved))
    }

    /// The capsule of `saved` (this session's state at its position) with the session's
    /// metadata and KV row ids.
    fn capsule_of(&self, saved: Arc<dyn crate::backend::SavedState>) -> Result<Capsule> {
        let last = match &self.logits {
            // A restored row goes back into the next capsule without a copy.
            KeptLogits::Shared(row) if self.logits_rows == 1 => Some(LogitsRow(row.clone())),
            _ => {
                let last = self.last_row()?;
                (!last.is_empty()).then(|| LogitsRow(last.into()))
            }
        };
        let meta = CapsuleMeta {
            model: self.model.name().to_string(),
            fingerprint: self.model.fingerprint().to_string(),
            pos: self.pos,
            pending: self.pending,
            tokens: self.tokens.clone(),
            sampler: self.sampler.clone(),
            counters: self.counters,
            last_logits: last,
        };
        let c = Capsule::from_parts(meta, saved, self.model.compiled().clone())?;
        // Rows all restored from one capsule (nothing written below `pos` since) are that
        // capsule's: the snapshot keeps its id, so restoring either into a session holding
        // the other's rows skips them; the pairs before name the rows it continues.
        Ok(c.with_kv_rows(self.held.snapshot_at(self.pos)))
    }

    fn check_capsule(&self, c: &Capsule) -> Result<()> {
        if c.meta.fingerprint != self.model.fingerprint() {
            return Err(Error::Fingerprint {
                capsule_model: c.meta.model.clone(),
                capsule: c.meta.fingerprint.clone(),
                session_model: self.model.name().to_string(),
                session: self.model.fingerprint().to_string(),
            });
        }
        if c.meta.pos > self.model.max_seq()
            || c.saved().pos() != c.meta.pos
            || c.meta.tokens.len() != c.meta.pos
        {
            return Err(Error::Capsule(format!(
                "inconsistent capsule: pos {}, saved at {}, {} tokens of history",
                c.meta.pos,
                c.saved().pos(),
                c.meta.tokens.len()
            )));
        }
        if let Some(l) = &c.meta.last_logits
            && l.0.len() != self.model.vocab()
        {
            return Err(Error::Capsule(format!(
                "capsule logits row has {} values, vocab is {}",
                l.0.len(),
                self.model.vocab()
            )));
        }
        Ok(())
    }

    fn adopt_meta(&mut self, c: &Capsule) {
        self.pos = c.meta.pos;
        self.tokens.clone_from(&c.meta.tokens);
        self.pending = c.meta.pending;
        self.sampler = c.meta.sampler.clone();
        self.counters = c.meta.counters;
        self.logits.clear();
        self.logits_rows = 0;
        if let Some(l) = &c.meta.last_logits {
            // Shared with the capsule, not copied: a restore costs no host copy of the row.
            self.logits = KeptLogits::Shared(l.0.clone());
            self.logits_rows = 1;
        }
    }

    /// Return to the capsule's boundary: afterwards every state byte equals the snapshot's,
    /// and decoding continues exactly as it would have from there.
    ///
    /// Per-position rows the session already holds from this capsule's content
    /// ([`Capsule::kv_rows`]: it was restored from or snapshotted into a capsule of the same
    /// rows, and has written only past them since) are not copied again.
    pub fn restore(&mut self, capsule: &Capsule) -> Result<()> {
        self.check_capsule(capsule)?;
        let held = if reuse_held_rows() {
            self.held.of(capsule)
        } else {
            0
        };
        self.held.forget();
        if let Err(e) = self
            .dev
            .restore(capsule.saved().as_ref(), RegionSet::All, held)
        {
            self.poisoned = true;
            return Err(e);
        }
        self.held.set(capsule.kv_rows());
        self.poisoned = false;
        self.adopt_meta(capsule);
        Ok(())
    }

    /// Restore to an earlier boundary of this session's own history (e.g. after rejected
    /// speculative tokens). Errors if the capsule's tokens are not a prefix of this history.
    pub fn rollback(&mut self, capsule: &Capsule) -> Result<()> {
        self.check_capsule(capsule)?;
        let t = &capsule.meta.tokens;
        if t.len() > self.tokens.len() || self.tokens[..t.len()] != t[..] {
            return Err(Error::Capsule(format!(
                "rollback target (position {}) is not a boundary of this session's history (position {})",
                t.len(),
                self.pos
            )));
        }
        self.restore(capsule)
    }

    /// Leading per-position (KV) rows of `capsule` this session holds already, which a
    /// [`Session::restore`] of it does not copy ([`Capsule::kv_rows`]): all of them right after
    /// restoring or snapshotting it, the rows below the session's position once it moved on,
    /// none after a reset or another capsule's restore.
    pub fn rows_held(&self, capsule: &Capsule) -> usize {
        self.held.of(capsule)
    }

    /// **Experiment API** (the KV-only ablation): restore only the attention K/V regions and
    /// the position/history, leaving conv and recurrent state as they are. The session is then
    /// deliberately inconsistent; this exists to show that recurrent state is load-bearing.
    pub fn restore_kv_only(&mut self, capsule: &Capsule) -> Result<()> {
        self.check_capsule(capsule)?;
        self.check_usable()?;
        self.held.forget();
        self.dev
            .restore(capsule.saved().as_ref(), RegionSet::KvOnly, 0)?;
        self.adopt_meta(capsule);
        Ok(())
    }

    /// Current host bytes of one state region (KV: positions `[0, pos)`).
    pub fn read_region<'a>(&self, key: impl Into<RegionKey<'a>>) -> Result<Vec<u8>> {
        let layout = &self.model.compiled().layout;
        let id = match key.into() {
            RegionKey::Id(id) => id,
            RegionKey::Name(n) => layout
                .id(n)
                .ok_or_else(|| Error::Input(format!("no buffer named `{n}`")))?,
        };
        match layout.buffers.get(id.index()) {
            Some(b) if b.role == Role::State => self.dev.read_region(id, self.pos),
            Some(b) => Err(Error::Input(format!("`{}` is not a state region", b.name))),
            None => Err(Error::Input(format!("no buffer with id {}", id.0))),
        }
    }

    /// Device time of the last restore's copy in milliseconds, where the backend measures it
    /// (CUDA: events around the copy kernel); waits for the copy. For benchmarks.
    pub fn last_restore_device_ms(&self) -> Result<Option<f64>> {
        Ok(self.dev.last_restore_seconds()?.map(|s| s * 1e3))
    }

    /// Wait until every queued step, snapshot and restore of this session has completed on
    /// the device (benchmarks stop their clocks after this).
    pub fn synchronize(&self) -> Result<()> {
        self.dev.synchronize()
    }

    /// Bytes a capsule of the current boundary holds (state regions, KV up to `pos`).
    pub fn state_bytes(&self) -> usize {
        self.model.compiled().layout.capsule_bytes(self.pos)
    }
}

// ---- Hooks for `crate::speculative` (speculative decoding). BEGIN ----
impl Session {
    /// The device session and the token history, for a speculative round; errors if a step
    /// failed half-way earlier.
    pub(crate) fn spec_parts(&mut self) -> Result<(&mut dyn DeviceSession, &[u32], bool)> {
        self.check_usable()?;
        // The drafter's step for the token at `pos` writes its K/V row `pos - 1`.
        self.held.written_from(self.pos.saturating_sub(1));
        Ok((&mut *self.dev, &self.tokens, self.row_states))
    }

    /// A speculative round failed half-way: the state is undefined until `reset` or a restore.
    pub(crate) fn spec_poison(&mut self) {
        self.poisoned = true;
        self.logits.clear();
        self.logits_rows = 0;
    }

    /// Commit tokens a speculative round fed, leaving exactly what plain decoding of them
    /// leaves: one decode step per token in the counters, `last_logits` as the one kept
    /// logits row, no pending token.
    pub(crate) fn spec_commit(&mut self, tokens: &[u32], last_logits: Vec<f32>) {
        self.pos += tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.logits = KeptLogits::Own(last_logits);
        self.logits_rows = 1;
        self.counters.steps += tokens.len() as u64;
        self.counters.decode_tokens += tokens.len() as u64;
        self.pending = None;
    }
}
// ---- Hooks for `crate::speculative`. END ----
