//! Execution-state capsules: the whole state of a session at a token boundary.
//!
//! A [`Capsule`] is the saved bytes of every state region of the layout (KV regions: only the
//! used prefix `[0, pos)`), kept by the backend that made them (host memory for the CPU
//! backend, device memory for CUDA), plus [`CapsuleMeta`]: position, token history, the
//! pending token, sampler state, counters, and the last logits row, so that a restored session
//! chooses its next token without running a step.
//!
//! Capsules are cheap to clone (the saved bytes sit behind an `Arc`) and immutable: restoring
//! copies the bytes back, it never hands them to the session. The generated, typed capsule
//! structs of the facade crate are views over the same data: one [`Region`] handle per state
//! region ([`Capsule::region_handle`], [`Capsule::regions`]) plus the meta.

use crate::backend::SavedState;
use crate::error::{Error, Result};
use flashrt_ir::{BufferId, Compiled, Role};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::sync::Arc;

/// Sampling configuration and RNG state (greedy by default). Part of the capsule so a
/// restored session continues the same random stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplerState {
    pub seed: u64,
    /// xoshiro256** state, derived from `seed` and advanced by every sampled token.
    pub rng: [u64; 4],
    /// `0.0` means greedy (argmax).
    pub temperature: f32,
    /// `0`: no top-k cut.
    pub top_k: usize,
    /// `1.0`: no nucleus cut.
    pub top_p: f32,
    /// `0.0`: no min-p cut (candidates below `min_p` times the best one's probability go).
    #[serde(default)]
    pub min_p: f32,
    /// OpenAI's presence penalty: subtracted once from the logit of every token generated
    /// since the sampler was set (history positions from `penalty_from`). `0.0`: none.
    #[serde(default)]
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty: subtracted from a generated token's logit once per
    /// occurrence. `0.0`: none.
    #[serde(default)]
    pub frequency_penalty: f32,
    /// The repetition penalty of transformers and vLLM, over the whole history (prompt
    /// included): a positive logit of a token seen is divided by it, a negative one
    /// multiplied. `1.0`: none.
    #[serde(default = "one")]
    pub repetition_penalty: f32,
    /// The first history position whose tokens count as generated (set by
    /// `Session::set_sampler`).
    #[serde(default)]
    pub penalty_from: usize,
}

fn one() -> f32 {
    1.0
}

impl Default for SamplerState {
    fn default() -> Self {
        SamplerState::greedy()
    }
}

impl SamplerState {
    pub fn greedy() -> Self {
        SamplerState {
            seed: 0,
            rng: seed_rng(0),
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            penalty_from: 0,
        }
    }
    pub fn seeded(seed: u64, temperature: f32, top_k: usize, top_p: f32) -> Self {
        SamplerState {
            seed,
            rng: seed_rng(seed),
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            penalty_from: 0,
        }
    }
    /// The same sampler with its RNG stream restarted at `seed` (every other setting kept).
    pub fn reseeded(&self, seed: u64) -> Self {
        SamplerState {
            seed,
            rng: seed_rng(seed),
            ..self.clone()
        }
    }
    /// The same sampler with penalties (presence, frequency, repetition).
    pub fn with_penalties(mut self, presence: f32, frequency: f32, repetition: f32) -> Self {
        self.presence_penalty = presence;
        self.frequency_penalty = frequency;
        self.repetition_penalty = repetition;
        self
    }
    /// Whether any penalty changes the logits before sampling.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
    }
    /// The same sampler with a min-p cut.
    pub fn with_min_p(mut self, min_p: f32) -> Self {
        self.min_p = min_p;
        self
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// xoshiro256** seeding through SplitMix64.
fn seed_rng(seed: u64) -> [u64; 4] {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    [next(), next(), next(), next()]
}

/// Work done by a session since it was created (carried through capsules).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Plan executions.
    pub steps: u64,
    /// Tokens fed through prefill plans.
    pub prefill_tokens: u64,
    /// Tokens fed through the decode plan.
    pub decode_tokens: u64,
}

/// One row of logits, shared (cloning a capsule does not copy it).
#[derive(Clone, PartialEq)]
pub struct LogitsRow(pub Arc<[f32]>);

impl fmt::Debug for LogitsRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LogitsRow([{} values])", self.0.len())
    }
}

impl Serialize for LogitsRow {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.as_ref().serialize(s)
    }
}

impl<'de> Deserialize<'de> for LogitsRow {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(LogitsRow(Vec::<f32>::deserialize(d)?.into()))
    }
}

/// Everything about a boundary that is not a state region.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapsuleMeta {
    /// Model name.
    pub model: String,
    /// Layout fingerprint; restore refuses a capsule whose fingerprint differs.
    pub fingerprint: String,
    /// Tokens consumed (KV regions hold this many rows).
    pub pos: usize,
    /// The next token, chosen but not yet fed, if any.
    pub pending: Option<u32>,
    /// Token history `[0, pos)`.
    pub tokens: Vec<u32>,
    pub sampler: SamplerState,
    pub counters: Counters,
    /// Logits after the last fed token (`None` at position 0).
    pub last_logits: Option<LogitsRow>,
}

/// An untyped capsule: meta plus the saved state regions.
#[derive(Clone)]
pub struct Capsule {
    pub meta: CapsuleMeta,
    saved: Arc<dyn SavedState>,
    compiled: Arc<Compiled>,
    /// Names the KV rows' content ([`Capsule::kv_rows`]).
    kv: KvRows,
}

/// What a state's per-position (KV) rows are, as `(id, rows)` pairs: rows `[0, rows)` are
/// those of every capsule named `id` over the rows it has. Fresh ids go to snapshots whose
/// rows are new; all capsules of one id hold prefixes of one sequence of rows. A capsule's
/// own pair is the last; the pairs before it name the capsules its rows continue (at most
/// [`MAX_KV_PAIRS`]).
pub type KvRows = Arc<[(u64, usize)]>;

/// Pairs a [`KvRows`] keeps (the most recent): a session restored to one checkpoint, then
/// moved on and snapshotted a few times, still knows it holds the checkpoint's rows.
pub const MAX_KV_PAIRS: usize = 8;

/// A fresh kv id (never 0, never reused within a process).
pub(crate) fn fresh_kv_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl fmt::Debug for Capsule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capsule")
            .field("model", &self.meta.model)
            .field("fingerprint", &self.meta.fingerprint)
            .field("pos", &self.meta.pos)
            .field("bytes", &self.saved.bytes())
            .field("location", &self.saved.location())
            .finish()
    }
}

impl Capsule {
    /// Assemble a capsule (the facade's typed capsules convert back through this). The saved
    /// state must be at `meta.pos` and `meta.fingerprint` must name `compiled`'s layout.
    pub fn from_parts(
        meta: CapsuleMeta,
        saved: Arc<dyn SavedState>,
        compiled: Arc<Compiled>,
    ) -> Result<Capsule> {
        if meta.fingerprint != compiled.layout.fingerprint {
            return Err(Error::Fingerprint {
                capsule_model: meta.model.clone(),
                capsule: meta.fingerprint.clone(),
                session_model: compiled.ir.name.clone(),
                session: compiled.layout.fingerprint.clone(),
            });
        }
        if saved.pos() != meta.pos || meta.tokens.len() != meta.pos {
            return Err(Error::Capsule(format!(
                "inconsistent capsule: meta.pos {}, saved state at {}, {} tokens of history",
                meta.pos,
                saved.pos(),
                meta.tokens.len()
            )));
        }
        Ok(Capsule {
            kv: Arc::new([(fresh_kv_id(), meta.pos)]),
            meta,
            saved,
            compiled,
        })
    }

    /// This capsule's per-position (KV) rows as [`KvRows`] pairs: its own id last, before it
    /// the capsules its rows continue. Two capsules with the same id hold the same bytes in
    /// every per-position region over the rows both have. A snapshot of a session whose rows
    /// all came from a capsule (restored, then nothing written below the snapshot's position)
    /// keeps that capsule's id; anything else gets a fresh one. A session remembers whose rows
    /// it holds, so restoring a capsule whose rows it holds already copies only the rest (the
    /// recurrent, conv and other non-KV regions, and the rows past what it holds): a reset to
    /// a checkpoint, or the next turn of a conversation on the same session, moves megabytes
    /// instead of a gigabyte.
    pub fn kv_rows(&self) -> &KvRows {
        &self.kv
    }

    /// The same capsule under other [`KvRows`] (the store keeps an entry's pairs across
    /// the tiers it moves through; a snapshot names its rows after the session's). The
    /// caller guarantees the rows are those the pairs name.
    pub(crate) fn with_kv_rows(mut self, kv: KvRows) -> Capsule {
        self.kv = kv;
        self
    }

    pub fn meta(&self) -> &CapsuleMeta {
        &self.meta
    }
    /// The same saved state under other metadata (the typed capsules rebuild an untyped one
    /// this way). A restore re-checks the metadata against the saved state.
    pub fn with_meta(&self, meta: CapsuleMeta) -> Capsule {
        Capsule {
            meta,
            saved: self.saved.clone(),
            compiled: self.compiled.clone(),
            kv: self.kv.clone(),
        }
    }
    pub fn pos(&self) -> usize {
        self.meta.pos
    }
    pub fn fingerprint(&self) -> &str {
        &self.meta.fingerprint
    }
    pub fn tokens(&self) -> &[u32] {
        &self.meta.tokens
    }
    /// Logits after the last fed token.
    pub fn last_logits(&self) -> Option<&[f32]> {
        self.meta.last_logits.as_ref().map(|l| &l.0[..])
    }
    /// Bytes of saved state (all regions, KV up to `pos`).
    pub fn bytes(&self) -> usize {
        self.saved.bytes()
    }
    /// Where the saved bytes live ("host", "cuda:0", ...).
    pub fn location(&self) -> &str {
        self.saved.location()
    }
    pub fn saved(&self) -> &Arc<dyn SavedState> {
        &self.saved
    }
    pub fn compiled(&self) -> &Arc<Compiled> {
        &self.compiled
    }

    /// Host bytes of the region called `name` (`layers.3.key`), as it would be restored.
    pub fn region(&self, name: &str) -> Result<Vec<u8>> {
        let b = self
            .compiled
            .layout
            .find(name)
            .filter(|b| b.role == Role::State)
            .ok_or_else(|| {
                Error::Capsule(format!(
                    "model {} has no state region `{name}`",
                    self.meta.model
                ))
            })?;
        self.saved.region_bytes(b.id)
    }

    /// Host bytes of a region by buffer id.
    pub fn region_by_id(&self, id: BufferId) -> Result<Vec<u8>> {
        self.saved.region_bytes(id)
    }

    /// Ids of the state regions, in layout order.
    pub fn region_ids(&self) -> Vec<BufferId> {
        self.compiled.layout.state_buffers().map(|b| b.id).collect()
    }

    /// Name of a region (`layers.3.key`); `"?"` for an id outside the layout.
    pub fn region_name(&self, id: BufferId) -> &str {
        self.compiled
            .layout
            .buffers
            .get(id.index())
            .map_or("?", |b| b.name.as_str())
    }

    /// Saved bytes of one region (KV: the used prefix); 0 for a non-state id.
    pub fn region_len(&self, id: BufferId) -> usize {
        match self.compiled.layout.buffers.get(id.index()) {
            Some(b) if b.role == Role::State => b.used_bytes(self.meta.pos),
            _ => 0,
        }
    }

    /// Host bytes of a region by buffer id (alias of [`Capsule::region_by_id`]).
    pub fn region_bytes(&self, id: BufferId) -> Result<Vec<u8>> {
        self.saved.region_bytes(id)
    }

    /// [`Capsule::region_bytes`] into `buf` where the backend can reuse it
    /// ([`SavedState::region_bytes_into`]).
    pub fn region_bytes_into(&self, id: BufferId, buf: Vec<u8>) -> Result<Vec<u8>> {
        self.saved.region_bytes_into(id, buf)
    }

    /// A handle to one region (cheap: shares the saved bytes); `None` if `id` is not a state
    /// region of this capsule's layout.
    pub fn region_handle(&self, id: BufferId) -> Option<Region> {
        let b = self.compiled.layout.buffers.get(id.index())?;
        (b.role == Role::State).then(|| Region {
            id,
            bytes: b.used_bytes(self.meta.pos),
            saved: self.saved.clone(),
            compiled: self.compiled.clone(),
        })
    }

    /// One handle per state region, in layout order (the typed capsule's fields).
    pub fn regions(&self) -> Vec<Region> {
        self.compiled
            .layout
            .state_buffers()
            .filter_map(|b| self.region_handle(b.id))
            .collect()
    }
}

/// A handle to one saved state region of a capsule.
#[derive(Clone)]
pub struct Region {
    id: BufferId,
    bytes: usize,
    saved: Arc<dyn SavedState>,
    compiled: Arc<Compiled>,
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Region({}, {} bytes on {})",
            self.name(),
            self.bytes,
            self.saved.location()
        )
    }
}

impl Region {
    pub fn id(&self) -> BufferId {
        self.id
    }
    /// Buffer name (`layers.3.key`).
    pub fn name(&self) -> &str {
        &self.compiled.layout.buffer(self.id).name
    }
    /// The layout buffer this region restores into.
    pub fn buffer(&self) -> &flashrt_ir::Buffer {
        self.compiled.layout.buffer(self.id)
    }
    /// Saved bytes of this region (KV: the used prefix only).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The bytes, copied to the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        self.saved.region_bytes(self.id)
    }
    /// The saved state this region belongs to (shared by every region of one capsule).
    pub fn saved(&self) -> &Arc<dyn SavedState> {
        &self.saved
    }
    /// The compiled model whose layout the region belongs to.
    pub fn compiled(&self) -> &Arc<Compiled> {
        &self.compiled
    }
}
