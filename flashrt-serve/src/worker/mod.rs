//! The model worker: one thread that owns the model, every session and the capsule store.
//!
//! One thing runs on the model at a time, so the worker is a plain loop over a bounded queue
//! of [`Job`]s; generations advance together, a batched step per round (`schedule.rs`).
//! HTTP handlers never touch a session: they send a [`Cmd`] and await the reply, so
//! concurrent requests on one session are serialized by construction and can never
//! interleave inside it. A streamed generation replies "accepted" ([`Out::Stream`]) once its
//! input is validated, then sends [`Event`]s as tokens are sampled; a client that goes away
//! stops the generation at the next token.
//!
//! The pieces: `commands.rs` (the sessions and capsule commands), `schedule.rs` (the
//! generating set and its rounds), `generate.rs` (one generation's tokens and replies),
//! `pool.rs` (idle sessions, warmed at start-up and reused).
//!
//! A panic inside a command (a bug, not an input: inputs are validated) is caught, answered
//! with a 500, and the session it touched is dropped; the worker goes on serving.
//!
//! Every job carries its [`Tenant`]: sessions and capsules belong to the tenant that made
//! them, and another tenant's id is answered exactly as an unknown one (404). Automatic
//! prefix reuse restores only trusted capsules (computed here) of the requesting tenant, or
//! of any tenant with `share_prefix_cache`. Files are opened without following symbolic
//! links, only when they are regular files, and never block the worker.

mod generate;

use generate::{logprobs_json, spec_json};

mod commands;
mod pool;
mod schedule;
pub use schedule::MAX_GENERATING;

use crate::metrics::Metrics;
use crate::speculate::SpecTuner;
use crate::tenants::Tenant;
use crate::text::{Text, TextStream};
use flashrt_runtime::sampling::TokenLogprobs;
use flashrt_runtime::store::{CapsuleInfo, PrefixScope, random_id, valid_id};
use flashrt_runtime::{CapsuleStore, Error, LogitsMode, Model, MtpDrafter, SamplerState, Session};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// An error for the client: HTTP status, a stable machine code, a message.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn bad(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(400, code, message)
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(404, code, message)
    }
    /// The OpenAI-style error type for the status.
    pub fn kind(&self) -> &'static str {
        match self.status {
            401 => "authentication_error",
            404 | 410 => "not_found_error",
            409 => "conflict_error",
            507 => "insufficient_storage",
            413 => "request_too_large",
            429 | 503 => "overloaded_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.code}})
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        match &e {
            Error::Input(_) => ApiError::bad("invalid_request", e.to_string()),
            Error::Fingerprint { .. } => ApiError::bad("fingerprint_mismatch", e.to_string()),
            Error::Capsule(_) => ApiError::bad("invalid_capsule", e.to_string()),
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                ApiError::not_found("file_not_found", e.to_string())
            }
            Error::Unsupported(_) => ApiError::bad("unsupported", e.to_string()),
            Error::StoreFull(_) => ApiError::new(507, "insufficient_storage", e.to_string()),
            _ => ApiError::new(500, "internal", e.to_string()),
        }
    }
}

type WResult<T> = Result<T, ApiError>;

/// Capsule `id` was found damaged when its stored copy was read (the store set the file aside
/// and forgot it, `e` says why): 410 `capsule_lost`, the details (with the server's paths) in
/// the log only.
fn lost(id: &str, e: Error) -> ApiError {
    tracing::warn!("capsule {id} could not be read back and was removed: {e}");
    ApiError::new(
        410,
        "capsule_lost",
        format!(
            "capsule `{id}` could not be read back: its stored copy is damaged and was removed"
        ),
    )
}

/// What a command answers.
#[derive(Debug)]
pub enum Out {
    Json(Value),
    Bytes(Vec<u8>),
    /// Accepted; [`Event`]s follow on the command's stream.
    Stream,
}

/// One event of a streamed generation.
#[derive(Debug)]
pub enum Event {
    /// A sampled token (streamed the moment it is chosen, fed to the session when the next
    /// one is wanted)
    /// and the text it makes visible (empty without a tokenizer, or while a character or a
    /// possible stop string is incomplete). `None`: the text still held back at the end.
    /// With its log-probabilities when the request asked for them.
    Token(Option<u32>, String, Option<TokenLogprobs>),
    /// Completions with `n` > 1: the tokens that follow belong to choice `.0` (choice 0 has
    /// none: it starts the stream).
    Choice(usize),
    /// Completions with `n` > 1: choice `index` ended (`{"index", "finish_reason"}`).
    ChoiceEnd(Value),
    /// The end: a summary (`tokens`, `finish_reason`, `pos`, usage).
    Done(Value),
    /// A failure after the stream started.
    Error(ApiError),
}

/// A generation request, validated by the HTTP layer.
#[derive(Clone, Debug, Default)]
pub struct GenReq {
    pub max_tokens: usize,
    /// `None`: keep the session's sampler (and its RNG position).
    pub sampler: Option<SamplerState>,
    /// Generation stops after one of these tokens (it is fed and returned).
    pub stop: Vec<u32>,
    /// Generation stops when the decoded text contains one of these (needs a tokenizer);
    /// the text returned and streamed ends before it.
    pub stop_strings: Vec<String>,
    /// Report each token's log-probability and this many alternatives
    /// ([`flashrt_runtime::sampling::logprobs`]); `None`: none.
    pub logprobs: Option<usize>,
    /// At most this many MTP drafts per round for greedy decoding (0: plain decoding);
    /// `None`: the server's `--speculative`.
    pub speculative: Option<usize>,
    /// Completions: this many choices from the one prefilled prompt (0 and 1: one). Choice
    /// `i` samples with seed `seed + i` (wrapping), so it equals a single completion with
    /// that seed.
    pub n: usize,
}

/// Session creation.
#[derive(Clone, Debug, Default)]
pub struct CreateReq {
    pub tokens: Vec<u32>,
    pub capsule: Option<String>,
    pub sampler: Option<SamplerState>,
    /// Restore the longest stored prefix of `tokens` instead of prefilling it.
    pub reuse: bool,
}

/// Commands the worker runs.
#[derive(Debug)]
pub enum Cmd {
    CreateSession(CreateReq),
    SessionInfo(String),
    ListSessions,
    DeleteSession(String),
    Append {
        session: String,
        tokens: Vec<u32>,
    },
    Generate {
        session: String,
        req: GenReq,
        stream: Option<mpsc::UnboundedSender<Event>>,
    },
    Snapshot {
        session: String,
        persist: bool,
        label: Option<String>,
    },
    Restore {
        session: String,
        capsule: String,
    },
    Rollback {
        session: String,
        capsule: Option<String>,
        pos: Option<usize>,
    },
    /// `n`: that many branches, listed (branch `i` > 0 samples with seed `seed + i` from the
    /// start of its RNG stream; branch 0 keeps the session's RNG state); `None`: one.
    Fork {
        session: String,
        n: Option<usize>,
    },
    ListCapsules,
    CapsuleInfo(String),
    DeleteCapsule(String),
    PersistCapsule(String),
    ExportFile {
        capsule: String,
        path: PathBuf,
        /// What messages call the file (its name in the tenant's files directory).
        name: String,
        overwrite: bool,
    },
    ExportBytes(String),
    ImportFile {
        path: PathBuf,
        name: String,
    },
    ImportBytes(Vec<u8>),
    /// OpenAI-style stateless completion over a prompt (with automatic prefix reuse).
    Complete {
        prompt: Vec<u32>,
        req: GenReq,
        stream: Option<mpsc::UnboundedSender<Event>>,
    },
    /// Persist the store (if it has a directory) and stop.
    Shutdown,
}

/// A command, whose it is, and where to answer it.
pub struct Job {
    pub cmd: Cmd,
    pub tenant: Tenant,
    pub reply: oneshot::Sender<WResult<Out>>,
    /// When the job entered the queue: the start of its queue wait and of its time to first
    /// token.
    pub enqueued: Instant,
}

/// Worker settings.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub max_sessions: usize,
    /// Completions store a capsule at the prompt boundary and at the end of generation.
    pub auto_cache: bool,
    /// Automatic prefix reuse may restore trusted capsules of other tenants (an opt-in).
    pub share_prefix_cache: bool,
    /// Set at shutdown once the grace period is over: generations stop at the next token.
    pub cancel: Arc<std::sync::atomic::AtomicBool>,
    /// Default most MTP drafts per round of greedy completions (0: off; see `speculate`).
    pub speculative: usize,
    /// Warm the serving session before the first job (`None`: on graph backends).
    pub warm: Option<bool>,
}

struct Slot {
    session: Session,
    owner: Arc<str>,
}

/// The worker's state.
pub struct Worker {
    model: Model,
    store: CapsuleStore,
    sessions: HashMap<String, Slot>,
    /// Idle sessions for completions (kept between rounds: [`Worker::idle_sessions_kept`]).
    pool: Vec<Session>,
    /// Completions generating and waiting (`schedule.rs`).
    sched: schedule::Schedule,
    metrics: Arc<Metrics>,
    text: Option<Arc<Text>>,
    cfg: WorkerConfig,
    session_arena_bytes: u64,
    /// Drafts per speculative round, from measured costs.
    tuner: SpecTuner,
}

struct Replier(Option<oneshot::Sender<WResult<Out>>>);

impl Replier {
    fn send(&mut self, r: WResult<Out>) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(r);
        }
    }
}

fn capsule_json(i: &CapsuleInfo) -> Value {
    json!({
        "capsule": i.id,
        "pos": i.pos,
        "tiers": i.tiers.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "bytes": {"device": i.bytes[0], "host": i.bytes[1], "disk": i.bytes[2]},
        "base": i.base,
        "label": i.label,
        // Computed by this server (automatic reuse may use it) or imported (by id only).
        "origin": if i.trusted { "computed" } else { "imported" },
        "persisted": i.persisted,
    })
}

fn sampler_json(s: &SamplerState) -> Value {
    json!({"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p, "seed": s.seed})
}

impl Worker {
    pub fn new(
        model: Model,
        store: CapsuleStore,
        metrics: Arc<Metrics>,
        text: Option<Arc<Text>>,
        cfg: WorkerConfig,
    ) -> Worker {
        let session_arena_bytes = model.session_bytes() as u64;
        metrics.publish_store(&store.stats());
        Worker {
            model,
            store,
            sessions: HashMap::new(),
            pool: Vec::new(),
            sched: schedule::Schedule::default(),
            metrics,
            text,
            cfg,
            session_arena_bytes,
            tuner: SpecTuner::new(flashrt_runtime::ir::lower::MAX_DRAFT),
        }
    }

    /// Serve jobs until a [`Cmd::Shutdown`] or until every sender is gone. Between jobs,
    /// every generating completion advances by a token (`schedule.rs`); the queue is waited
    /// on only while nothing generates.
    pub fn run(mut self, rx: std::sync::mpsc::Receiver<Job>) {
        self.warm_pool();
        self.metrics.warming.store(false, Ordering::SeqCst);
        self.metrics.worker_alive.store(true, Ordering::SeqCst);
        loop {
            self.poll_store();
            let job = if self.sched.is_idle() {
                if self.store.busy() {
                    // Wake up to apply the demotion when it is done.
                    match rx.recv_timeout(Duration::from_millis(2)) {
                        Ok(job) => Some(job),
                        Err(RecvTimeoutError::Timeout) => continue,
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                } else {
                    match rx.recv() {
                        Ok(job) => Some(job),
                        Err(_) => break,
                    }
                }
            } else {
                // Senders gone: the generating completions still finish.
                rx.try_recv().ok()
            };
            if let Some(job) = job
                && self.run_job(job)
            {
                break;
            }
            self.step_generating();
        }
        self.metrics.worker_alive.store(false, Ordering::SeqCst);
    }

    /// Apply the store's finished background demotions (cheap when none is in flight).
    fn poll_store(&mut self) {
        match self.store.poll() {
            Ok(0) => {}
            Ok(_) => self.publish(),
            Err(e) => tracing::warn!("capsule store: {e}"),
        }
    }

    /// One job; `true` after the shutdown command.
    fn run_job(&mut self, job: Job) -> bool {
        // A command on a session that is generating waits for the generation to end.
        let Some(job) = self.defer_if_busy(job) else {
            return false;
        };
        self.metrics.queue_wait.observe(job.enqueued.elapsed());
        match job.cmd {
            Cmd::Complete { .. } => {
                self.start_completion(job);
                self.publish();
                return false;
            }
            Cmd::Generate { .. } => {
                self.start_session_generate(job);
                self.publish();
                return false;
            }
            _ => {}
        }
        let shutdown = matches!(job.cmd, Cmd::Shutdown);
        if shutdown {
            // What generates ends first (at once when the grace period is over: the cancel
            // flag stops it at its next token).
            while !self.sched.is_idle() {
                self.step_generating();
            }
        }
        let touched = match &job.cmd {
            Cmd::Append { session, .. }
            | Cmd::Restore { session, .. }
            | Cmd::Rollback { session, .. } => Some(session.clone()),
            _ => None,
        };
        let mut rep = Replier(Some(job.reply));
        let tenant = job.tenant;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.handle(job.cmd, &tenant)
        }));
        let r = r.unwrap_or_else(|_| {
            // The session may be half-updated: drop it rather than serve garbage.
            if let Some(s) = touched {
                self.sessions.remove(&s);
            }
            self.pool.clear();
            Err(ApiError::new(
                500,
                "internal",
                "internal error while running the command (the session involved was closed)",
            ))
        });
        rep.send(r);
        self.publish();
        shutdown
    }

    /// Sessions of the sessions API, those generating included.
    fn open_sessions(&self) -> usize {
        self.sessions.len() + self.sched.busy.len()
    }

    fn publish(&self) {
        self.metrics.publish_store(&self.store.stats());
        let n = self.open_sessions() as u64;
        self.metrics.sessions.store(n, Ordering::Relaxed);
        // Completions' sessions (generating or pooled) besides the sessions API's.
        let live = n + (self.pool.len() + self.sched.completions()) as u64;
        self.metrics
            .session_bytes
            .store(live * self.session_arena_bytes, Ordering::Relaxed);
    }

    fn new_id(&mut self) -> String {
        loop {
            let id = random_id();
            if !self.sessions.contains_key(&id) {
                return id;
            }
        }
    }

    /// Tenant `t`'s session `id` (another tenant's is as unknown as a missing one).
    fn session(&mut self, id: &str, t: &Tenant) -> WResult<&mut Session> {
        self.sessions
            .get_mut(id)
            .filter(|s| s.owner == t.name)
            .map(|s| &mut s.session)
            .ok_or_else(|| ApiError::not_found("unknown_session", format!("no session `{id}`")))
    }

    /// Take tenant `t`'s session `id` out of the map (put it back with [`Self::put_back`]).
    fn take(&mut self, id: &str, t: &Tenant) -> WResult<Session> {
        self.session(id, t)?;
        Ok(self.sessions.remove(id).expect("checked").session)
    }

    fn put_back(&mut self, id: String, session: Session, t: &Tenant) {
        self.sessions.insert(
            id,
            Slot {
                session,
                owner: t.name.clone(),
            },
        );
    }

    fn check_capsule(&self, id: &str, t: &Tenant) -> WResult<()> {
        let owned = valid_id(id) && self.store.info(id).is_ok_and(|i| i.owner == *t.name);
        if !owned {
            return Err(ApiError::not_found(
                "unknown_capsule",
                format!("no capsule `{}`", id.escape_debug()),
            ));
        }
        Ok(())
    }

    /// Store a capsule this server computed for `t`, within `t`'s byte budget.
    fn store_computed(
        &mut self,
        cap: flashrt_runtime::Capsule,
        label: Option<String>,
        t: &Tenant,
    ) -> WResult<String> {
        let id = self.store.insert_as(cap, label, &t.name, true)?;
        self.within_budget(t, &id)?;
        Ok(id)
    }

    /// Store `s`'s boundary as an automatic capsule of `t` (with `sampler` in place of the
    /// session's, if given). A full store (or tenant budget) refuses; the request goes on
    /// without it.
    fn store_auto(
        &mut self,
        s: &Session,
        sampler: Option<SamplerState>,
        t: &Tenant,
    ) -> WResult<()> {
        let start = Instant::now();
        // Skipped while the store would wait for the previous capsule's copy to the host (every
        // stream would wait too), when a stored capsule already holds all but a few of its
        // tokens: a request extending it then prefills at most one short chunk more (a burst
        // of follow-ups on one long prompt). A new long prompt is stored, waiting if need be.
        self.poll_store();
        let bytes = s.model().compiled().layout.capsule_bytes(s.pos()) as u64;
        if self.store.insert_would_wait(bytes) {
            let covered = self
                .store
                .longest_prefix_in(s.tokens(), self.prefix_scope(t))
                .map_or(0, |(_, p)| p);
            if covered + AUTO_SKIP_GAP >= s.pos() {
                self.metrics
                    .auto_store_skipped
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    "automatic capsule at {} tokens skipped: {covered} of them are stored, and the store is still copying another capsule to the host",
                    s.pos()
                );
                return Ok(());
            }
        }
        let mut cap = snapshot_anywhere(s)?;
        if let Some(sm) = sampler {
            cap.meta.sampler = sm;
        }
        let _ = self.store_computed(cap, Some("auto".into()), t);
        let took = start.elapsed();
        self.metrics.auto_store.observe(took);
        if took.as_millis() >= 100 {
            // Demotions in the background leave only the snapshot here (and a wait when one
            // is still in flight): say so when it stalls the others anyway.
            tracing::warn!(
                "storing an automatic capsule at {} tokens took {:.0} ms (snapshot and demotions down the tiers); other generations waited",
                s.pos(),
                took.as_secs_f64() * 1e3
            );
        }
        Ok(())
    }

    /// Keep `t`'s capsules within its byte budget: its least recently used ones that are not
    /// persisted go first; when `id` itself does not fit, it is removed and the call fails.
    fn within_budget(&mut self, t: &Tenant, id: &str) -> WResult<()> {
        let Some(budget) = t.max_capsule_bytes else {
            return Ok(());
        };
        let r = self.store.trim_owner(&t.name, budget, id);
        if r.is_err() {
            let _ = self.store.remove(id);
        }
        Ok(r?)
    }

    fn prefix_scope<'a>(&self, t: &'a Tenant) -> PrefixScope<'a> {
        if self.cfg.share_prefix_cache {
            PrefixScope::TrustedShared
        } else {
            PrefixScope::Trusted(&t.name)
        }
    }

    fn observe_restore(&self, info: &flashrt_runtime::store::RestoreInfo) {
        self.metrics.restore[info.tier as usize].observe(info.elapsed);
    }

    /// Restore stored capsule `id` into `s`. A capsule whose stored copy turns out damaged
    /// when read (the store sets its file aside and forgets it) answers 410 `capsule_lost`,
    /// the details (with the server's paths) going to the log only.
    fn restore_stored(
        &mut self,
        id: &str,
        s: &mut Session,
    ) -> WResult<flashrt_runtime::store::RestoreInfo> {
        match self.store.restore_into(id, s) {
            Ok(info) => {
                self.observe_restore(&info);
                Ok(info)
            }
            Err(e) if !self.store.contains(id) => Err(lost(id, e)),
            Err(e) => Err(e.into()),
        }
    }

    /// Restore the longest stored prefix of `tokens` among the capsules automatic reuse may
    /// use for `t` into `s`; returns its length (0: none, and `s` was reset). A capsule found
    /// damaged on the way is skipped (the store forgets it) for the next longest: a cache
    /// miss, never a failed request.
    fn reuse_prefix(&mut self, s: &mut Session, tokens: &[u32], t: &Tenant) -> WResult<usize> {
        let scope = self.prefix_scope(t);
        while let Some((id, p)) = self.store.lookup_prefix(tokens, scope) {
            match self.restore_stored(&id, s) {
                Ok(_) => {
                    s.set_pending(None);
                    return Ok(p);
                }
                // Gone from the store: the next lookup cannot find it again.
                Err(e) if e.code == "capsule_lost" => continue,
                Err(e) => return Err(e),
            }
        }
        s.reset()?;
        Ok(0)
    }

    fn prefill(&self, s: &mut Session, tokens: &[u32]) -> WResult<()> {
        if !tokens.is_empty() {
            s.append(tokens)?;
            self.metrics
                .prefill_tokens
                .fetch_add(tokens.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    fn validate_tokens(&self, tokens: &[u32], at: usize) -> WResult<()> {
        check_tokens(tokens, at, self.model.vocab(), self.model.max_seq())
    }
}

/// Tokens past a stored prefix under which an automatic capsule is skipped rather than stored
/// while the store would wait for a copy to the host (`Worker::store_auto`): what a later
/// request extending it prefills instead (one 256-row chunk, tens of milliseconds at the 27B
/// shape), against a stall of every stream for the copy (hundreds).
pub const AUTO_SKIP_GAP: usize = 256;

/// `s`'s boundary as a capsule: a device copy, or, when that fails (no device memory left for
/// it), the state read into host memory — slower, but the capsule a client asked for or the
/// prefix cache wants is not lost.
pub(super) fn snapshot_anywhere(s: &Session) -> WResult<flashrt_runtime::Capsule> {
    match s.snapshot() {
        Ok(c) => Ok(c),
        Err(e) => {
            tracing::warn!(
                "device snapshot at {} tokens failed ({e}); copying the state to host memory instead",
                s.pos()
            );
            Ok(s.snapshot_to_host()?)
        }
    }
}

/// `tokens` appended at position `at` of a model with `vocab` ids and `max_seq` positions:
/// every id in the vocabulary, and room for all of them.
pub fn check_tokens(tokens: &[u32], at: usize, vocab: usize, max: usize) -> WResult<()> {
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= vocab)
    {
        return Err(ApiError::bad(
            "invalid_tokens",
            format!("token id {t} at index {i} is outside the vocabulary (vocab {vocab})"),
        ));
    }
    if at + tokens.len() > max {
        return Err(ApiError::bad(
            "context_length_exceeded",
            format!(
                "position {at} + {} tokens exceeds the model's max_seq {max}",
                tokens.len()
            ),
        ));
    }
    Ok(())
}

/// A completion's prompt: not empty, its ids valid ([`check_tokens`]), and room to generate
/// when `max_tokens` > 0. The worker's admission and the HTTP layer's check of a batch's
/// prompts (before any starts) both ask this.
pub fn check_prompt(prompt: &[u32], vocab: usize, max: usize, max_tokens: usize) -> WResult<()> {
    if prompt.is_empty() {
        return Err(ApiError::bad("invalid_tokens", "the prompt is empty"));
    }
    check_tokens(prompt, 0, vocab, max)?;
    if prompt.len() >= max && max_tokens > 0 {
        return Err(ApiError::bad(
            "context_length_exceeded",
            format!(
                "the prompt has {} tokens; the model holds {max} (max_seq), leaving no room to generate",
                prompt.len(),
            ),
        ));
    }
    Ok(())
}
