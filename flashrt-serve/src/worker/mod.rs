//! The model worker: one thread that owns the model, every session and the capsule store.
//!
//! Batch-1 serving means one thing runs on the model at a time, so the worker is a plain loop
//! over a bounded queue of [`Job`]s. HTTP handlers never touch a session: they send a
//! [`Cmd`] and await the reply, so concurrent requests on one session are serialized by
//! construction and can never interleave inside it. A streamed generation replies
//! "accepted" ([`Out::Stream`]) once its input is validated, then sends [`Event`]s as tokens
//! are sampled; a client that goes away stops the generation at the next token.
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
use std::time::Instant;
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
            404 => "not_found_error",
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
            let job = if self.sched.is_idle() {
                match rx.recv() {
                    Ok(job) => Some(job),
                    Err(_) => break,
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

    fn new_session(&mut self, t: &Tenant) -> WResult<Session> {
        // Sessions generating are out of the map but still open.
        let mine = self.sessions.values().filter(|s| s.owner == t.name).count()
            + self.sched.busy.values().filter(|o| ***o == *t.name).count();
        let open = self.open_sessions();
        let cap = t.max_sessions.unwrap_or(self.cfg.max_sessions);
        if mine >= cap || open >= self.cfg.max_sessions {
            return Err(ApiError::new(
                429,
                "too_many_sessions",
                format!(
                    "{} sessions are open (the limit is {}); delete one first",
                    if mine >= cap { mine } else { open },
                    if mine >= cap {
                        cap
                    } else {
                        self.cfg.max_sessions
                    }
                ),
            ));
        }
        // An idle pooled session beyond the one kept for completions becomes the new session,
        // reset to a fresh one's state: its plans' graphs are already captured (a robot loop's
        // first appends run at full speed) and no memory moves.
        if self.pool.len() > 1
            && let Some(mut s) = self.pool.pop()
            && s.reset().is_ok()
        {
            s.set_sampler(flashrt_runtime::SamplerState::default());
            s.set_logits_mode(LogitsMode::Last);
            return Ok(s);
        }
        // Otherwise a new one, in the place of an idle pooled one where the memory plan has
        // no room for both (one pooled session always stays).
        let keep = self.idle_room(1);
        self.pool.truncate(keep);
        self.fresh_session().map_err(|e| {
            if e.code == "internal" && e.message.contains("OUT_OF_MEMORY") {
                ApiError::new(
                    429,
                    "out_of_device_memory",
                    format!(
                        "no device memory left for another session ({} open); delete one first",
                        self.sessions.len()
                    ),
                )
            } else {
                e
            }
        })
    }

    /// On a backend that runs plans as captured graphs (CUDA), the pooled sessions (one per
    /// session of the largest batched step, as many as the pool keeps) are created and every
    /// plan captured on them before the first job: otherwise requests would pay for the
    /// captures (measured on the H200, 27B shape: 32 tokens after a stored prefix took 39.9
    /// instead of 19.2 ms on the plan's second use; warming took 1.8 s a session). Best
    /// effort: a failure leaves fewer pooled sessions and sessions are made on demand.
    fn warm_pool(&mut self) {
        if !self.cfg.warm.unwrap_or_else(|| self.model.pads_rows()) || !self.pool.is_empty() {
            return;
        }
        let start = Instant::now();
        match self
            .fresh_session()
            .map_err(|e| e.message)
            .and_then(|mut s| {
                s.warm_plans().map_err(|e| e.to_string())?;
                Ok(s)
            }) {
            Ok(s) => {
                self.pool.push(s);
                tracing::info!(
                    "serving session ready, every plan's graph captured ({:.1} s)",
                    start.elapsed().as_secs_f64()
                );
            }
            Err(e) => {
                tracing::warn!("warming the serving session failed ({e}); continuing");
                return;
            }
        }
        // The batched decode steps' graphs too (one per size of the ladder, shared by every
        // set of sessions), on scratch sessions beside the pooled one. (Where the backend
        // steps them one by one this only costs the steps.)
        let start = Instant::now();
        let cap = self.generating_capacity();
        let sizes: Vec<usize> = (self.model.ir().batch_sizes().into_iter())
            .filter(|&b| b <= cap)
            .collect();
        let Some(&most) = sizes.last() else {
            return;
        };
        let model = self.model.clone();
        let mut extra = Vec::with_capacity(most - 1);
        let warmed = (|| -> WResult<()> {
            for _ in 1..most {
                extra.push(self.fresh_session()?);
            }
            let first = self.pool.last_mut().expect("pushed above");
            let mut all: Vec<&mut Session> =
                std::iter::once(first).chain(extra.iter_mut()).collect();
            for &b in &sizes {
                for _ in 0..2 {
                    model.step_batch(&mut all[..b], &vec![0; b])?;
                }
            }
            for s in all {
                s.reset()?;
            }
            Ok(())
        })();
        // The scratch sessions stay pooled (as many as the pool keeps), each with every plan
        // captured too, so no burst of parallel completions pays for an allocation or a
        // capture (a plan's second use on a session would capture it).
        if warmed.is_ok() {
            extra.truncate(self.idle_sessions_kept().saturating_sub(self.pool.len()));
            let start = Instant::now();
            match extra.iter_mut().try_for_each(|s| s.warm_plans()) {
                Ok(()) => {
                    if !extra.is_empty() {
                        tracing::info!(
                            "{} more pooled sessions ready, every plan's graph captured ({:.1} s)",
                            extra.len(),
                            start.elapsed().as_secs_f64()
                        );
                    }
                    self.pool.extend(extra);
                }
                Err(e) => tracing::warn!("warming the pooled sessions failed ({e}); continuing"),
            }
        }
        match warmed {
            Ok(()) => tracing::info!(
                "batched decode steps of {sizes:?} sessions captured ({:.1} s)",
                start.elapsed().as_secs_f64()
            ),
            Err(e) => {
                tracing::warn!(
                    "warming the batched steps failed ({}); continuing",
                    e.message
                );
                // The pooled session may have stepped: start it over.
                if let Some(s) = self.pool.last_mut()
                    && s.reset().is_err()
                {
                    self.pool.clear();
                }
            }
        }
    }

    /// A session as the server uses it: only the last position's logits are kept (it samples
    /// the next token and nothing else), so a prompt's chunks skip the LM head on the device
    /// and no row but the last crosses to the host.
    fn fresh_session(&self) -> WResult<Session> {
        let mut s = self.model.session()?;
        s.set_logits_mode(LogitsMode::Last);
        Ok(s)
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
        let mut cap = s.snapshot()?;
        if let Some(sm) = sampler {
            cap.meta.sampler = sm;
        }
        let _ = self.store_computed(cap, Some("auto".into()), t);
        let took = start.elapsed();
        self.metrics.auto_store.observe(took);
        if took.as_millis() >= 100 {
            // Demotions run on the worker thread for now: say so when they stall the others.
            tracing::warn!(
                "storing an automatic capsule at {} tokens took {:.0} ms (demotions down the tiers); other generations waited",
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

    /// Restore the longest stored prefix of `tokens` among the capsules automatic reuse may
    /// use for `t` into `s`; returns its length (0: none, and `s` was reset).
    fn reuse_prefix(&mut self, s: &mut Session, tokens: &[u32], t: &Tenant) -> WResult<usize> {
        let scope = self.prefix_scope(t);
        if let Some((id, p)) = self.store.lookup_prefix(tokens, scope) {
            let info = self.store.restore_into(&id, s)?;
            self.observe_restore(&info);
            s.set_pending(None);
            return Ok(p);
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
        let vocab = self.model.vocab();
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
        let max = self.model.max_seq();
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

    fn handle(&mut self, cmd: Cmd, t: &Tenant) -> WResult<Out> {
        match cmd {
            Cmd::CreateSession(req) => self.create(req, t),
            Cmd::SessionInfo(id) => {
                let s = self.session(&id, t)?;
                Ok(Out::Json(json!({
                    "session": id,
                    "pos": s.pos(),
                    "tokens": s.tokens(),
                    "sampler": sampler_json(s.sampler()),
                    "counters": {
                        "steps": s.counters().steps,
                        "prefill_tokens": s.counters().prefill_tokens,
                        "decode_tokens": s.counters().decode_tokens,
                    },
                })))
            }
            Cmd::ListSessions => {
                let mut v: Vec<Value> = self
                    .sessions
                    .iter()
                    .filter(|(_, s)| s.owner == t.name)
                    .map(|(id, s)| json!({"session": id, "pos": s.session.pos()}))
                    .chain(
                        self.sched
                            .busy
                            .iter()
                            .filter(|(_, owner)| ***owner == *t.name)
                            .map(|(id, _)| json!({"session": id, "generating": true})),
                    )
                    .collect();
                v.sort_by(|a, b| a["session"].as_str().cmp(&b["session"].as_str()));
                Ok(Out::Json(json!({"sessions": v})))
            }
            Cmd::DeleteSession(id) => {
                self.take(&id, t)?;
                Ok(Out::Json(json!({"deleted": id})))
            }
            Cmd::Append { session, tokens } => {
                let pos = self.session(&session, t)?.pos();
                if tokens.is_empty() {
                    return Err(ApiError::bad(
                        "invalid_tokens",
                        "append needs at least one token",
                    ));
                }
                self.validate_tokens(&tokens, pos)?;
                let mut s = self.take(&session, t)?;
                let r = self.prefill(&mut s, &tokens);
                let pos = s.pos();
                self.put_back(session.clone(), s, t);
                r?;
                Ok(Out::Json(json!({"session": session, "pos": pos})))
            }
            // Taken by the scheduler before `handle` (see `run_job`).
            Cmd::Generate { .. } => Err(ApiError::new(
                500,
                "internal",
                "a generation reached the wrong handler",
            )),
            Cmd::Snapshot {
                session,
                persist,
                label,
            } => {
                let cap = self.session(&session, t)?.snapshot()?;
                let id = self.store_computed(cap, label, t)?;
                if persist {
                    // Durable or an error: the capsule itself stays in memory either way.
                    self.store.persist(&id).map_err(|e| {
                        let mut a = ApiError::from(e);
                        a.message =
                            format!("capsule `{id}` was stored but not persisted: {}", a.message);
                        a
                    })?;
                }
                let info = self.store.info(&id)?;
                Ok(Out::Json(capsule_json(&info)))
            }
            Cmd::Restore { session, capsule } => {
                self.session(&session, t)?;
                self.check_capsule(&capsule, t)?;
                let mut s = self.take(&session, t)?;
                let r = self.store.restore_into(&capsule, &mut s);
                let pos = s.pos();
                self.put_back(session.clone(), s, t);
                let info = r?;
                self.observe_restore(&info);
                Ok(Out::Json(json!({
                    "session": session,
                    "capsule": capsule,
                    "pos": pos,
                    "from_tier": info.tier.name(),
                    "restore_us": info.elapsed.as_secs_f64() * 1e6,
                })))
            }
            Cmd::Rollback {
                session,
                capsule,
                pos,
            } => {
                let history: Vec<u32> = self.session(&session, t)?.tokens().to_vec();
                let capsule = match (capsule, pos) {
                    (Some(c), None) => {
                        self.check_capsule(&c, t)?;
                        let toks = self.store.tokens(&c)?;
                        if toks.len() > history.len() || history[..toks.len()] != toks[..] {
                            return Err(ApiError::new(
                                409,
                                "not_a_prefix",
                                format!(
                                    "capsule `{c}` (position {}) is not a boundary of this session's history (position {})",
                                    toks.len(),
                                    history.len()
                                ),
                            ));
                        }
                        c
                    }
                    (None, Some(p)) => {
                        if p > history.len() {
                            return Err(ApiError::bad(
                                "invalid_request",
                                format!(
                                    "position {p} is past the session's position {}",
                                    history.len()
                                ),
                            ));
                        }
                        // Only capsules computed here for this tenant: an imported one's history
                        // is only its claim.
                        match self
                            .store
                            .longest_prefix_in(&history[..p], PrefixScope::Trusted(&t.name))
                        {
                            Some((c, q)) if q == p => c,
                            _ => {
                                return Err(ApiError::new(
                                    409,
                                    "no_capsule_at_position",
                                    format!(
                                        "no stored capsule holds this session's first {p} tokens; snapshot there first"
                                    ),
                                ));
                            }
                        }
                    }
                    _ => {
                        return Err(ApiError::bad(
                            "invalid_request",
                            "give exactly one of `capsule` and `pos`",
                        ));
                    }
                };
                let mut s = self.take(&session, t)?;
                let r = self.store.restore_into(&capsule, &mut s);
                let pos = s.pos();
                self.put_back(session.clone(), s, t);
                let info = r?;
                self.observe_restore(&info);
                Ok(Out::Json(
                    json!({"session": session, "capsule": capsule, "pos": pos}),
                ))
            }
            Cmd::Fork { session, n } => {
                let cap = self.session(&session, t)?.snapshot()?;
                let mut ids = Vec::new();
                for i in 0..n.unwrap_or(1) {
                    let branch = self.new_session(t).and_then(|mut s| {
                        s.restore(&cap)?;
                        if i > 0 {
                            s.reseed(s.sampler().seed.wrapping_add(i as u64));
                        }
                        Ok(s)
                    });
                    match branch {
                        Ok(s) => {
                            let id = self.new_id();
                            self.put_back(id.clone(), s, t);
                            ids.push(id);
                        }
                        Err(e) => {
                            // All or nothing.
                            for id in &ids {
                                self.sessions.remove(id);
                            }
                            return Err(e);
                        }
                    }
                }
                let pos = cap.meta.pos;
                Ok(Out::Json(match n {
                    None => json!({"session": ids[0], "forked_from": session, "pos": pos}),
                    Some(_) => json!({"sessions": ids, "forked_from": session, "pos": pos}),
                }))
            }
            Cmd::ListCapsules => {
                let ids = self.store.ids_of(Some(&t.name));
                let v: Vec<Value> = ids
                    .iter()
                    .filter_map(|id| self.store.info(id).ok())
                    .map(|i| capsule_json(&i))
                    .collect();
                Ok(Out::Json(json!({"capsules": v})))
            }
            Cmd::CapsuleInfo(id) => {
                self.check_capsule(&id, t)?;
                let mut v = capsule_json(&self.store.info(&id)?);
                v["tokens"] = json!(&self.store.tokens(&id)?[..]);
                Ok(Out::Json(v))
            }
            Cmd::DeleteCapsule(id) => {
                self.check_capsule(&id, t)?;
                self.store.remove(&id)?;
                Ok(Out::Json(json!({"deleted": id})))
            }
            Cmd::PersistCapsule(id) => {
                self.check_capsule(&id, t)?;
                self.store.persist(&id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::ExportFile {
                capsule,
                path,
                name,
                overwrite,
            } => {
                self.check_capsule(&capsule, t)?;
                crate::files::check_export_target(&path, &name, overwrite)?;
                let bytes = self
                    .store
                    .export(&capsule, &path)
                    .map_err(|e| crate::files::relative(e, &path, &name))?;
                Ok(Out::Json(json!({
                    "capsule": capsule,
                    "file": name,
                    "bytes": bytes,
                })))
            }
            Cmd::ExportBytes(capsule) => {
                self.check_capsule(&capsule, t)?;
                let cap = self.store.get(&capsule)?;
                Ok(Out::Bytes(flashrt_runtime::capsule_file::capsule_to_vec(
                    &cap,
                )?))
            }
            Cmd::ImportFile { path, name } => {
                let file = crate::files::open_regular(&path, &name)?;
                let cap =
                    flashrt_runtime::capsule_file::read_capsule_from(file, &name, &self.model)
                        .map_err(|e| crate::files::relative(e, &path, &name))?;
                let id = self.store.import_capsule_as(cap, &t.name)?;
                self.within_budget(t, &id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::ImportBytes(bytes) => {
                let id = self.store.import_bytes_as(&bytes, &t.name)?;
                self.within_budget(t, &id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            // Taken by the scheduler before `handle` (see `run_job`).
            Cmd::Complete { .. } => Err(ApiError::new(
                500,
                "internal",
                "a completion reached the wrong handler",
            )),
            Cmd::Shutdown => {
                let n = self.store.flush()?;
                Ok(Out::Json(json!({"flushed": n})))
            }
        }
    }

    fn create(&mut self, req: CreateReq, t: &Tenant) -> WResult<Out> {
        if let Some(sm) = &req.sampler {
            sm.validate()?;
        }
        if req.capsule.is_some() && !req.tokens.is_empty() {
            return Err(ApiError::bad(
                "invalid_request",
                "give `capsule` or `tokens`, not both (append after creating)",
            ));
        }
        self.validate_tokens(&req.tokens, 0)?;
        if let Some(c) = &req.capsule {
            self.check_capsule(c, t)?;
        }
        let mut s = self.new_session(t)?;
        let mut reused = 0;
        let mut from = None;
        if let Some(c) = &req.capsule {
            let info = self.store.restore_into(c, &mut s)?;
            self.observe_restore(&info);
            from = Some(c.clone());
        } else if !req.tokens.is_empty() {
            if req.reuse {
                reused = self.reuse_prefix(&mut s, &req.tokens, t)?;
            }
            self.prefill(&mut s, &req.tokens[reused..])?;
        }
        if let Some(sm) = req.sampler {
            s.set_sampler(sm);
        }
        let id = self.new_id();
        let pos = s.pos();
        self.put_back(id.clone(), s, t);
        Ok(Out::Json(json!({
            "session": id,
            "pos": pos,
            "reused_tokens": reused,
            "from_capsule": from,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker over the demo model (random weights) on the CPU reference.
    fn demo_worker(max_sessions: usize, warm: bool) -> (Model, Worker) {
        let src = include_str!("../../../models/demo.toml");
        let ir = flashrt_compiler::model_from_toml(src, "demo.toml").unwrap();
        let cpu: Arc<dyn flashrt_runtime::Backend> = Arc::new(flashrt_runtime::CpuBackend::new());
        let model = Model::with_random_weights(cpu, &ir, 3).unwrap();
        let store = CapsuleStore::open(model.clone(), Default::default()).unwrap();
        let cfg = WorkerConfig {
            max_sessions,
            auto_cache: true,
            share_prefix_cache: false,
            cancel: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            speculative: 0,
            warm: Some(warm),
        };
        let w = Worker::new(model.clone(), store, Arc::default(), None, cfg);
        (model, w)
    }

    /// Warming (forced here on the CPU reference, where it is otherwise skipped) leaves pooled
    /// sessions at position 0 with every state byte zero, after running every plan and the
    /// batched steps of the whole ladder on the first and on the others: one per session of
    /// the largest batch.
    #[test]
    fn warming_leaves_fresh_pooled_sessions() {
        let (model, mut w) = demo_worker(8, true);
        w.warm_pool();
        let most = *model.ir().batch_sizes().last().unwrap();
        assert!(most > 1, "the demo model has a batch ladder");
        assert_eq!(w.pool.len(), most);
        for s in &w.pool {
            assert_eq!(s.pos(), 0);
            for b in model.compiled().layout.state_buffers() {
                let bytes = s.read_region(b.id).unwrap();
                assert!(bytes.iter().all(|&x| x == 0), "state `{}` not zero", b.name);
            }
        }
        // Warming twice does nothing more.
        w.warm_pool();
        assert_eq!(w.pool.len(), most);
    }

    /// Idle sessions are kept for the next burst of completions within the memory plan: as
    /// many as could generate beside the open sessions (at least one, at most
    /// MAX_GENERATING), fewer as sessions-API sessions open.
    #[test]
    fn the_pool_keeps_what_the_memory_plan_leaves() {
        let (model, mut w) = demo_worker(4, false);
        let tenant = crate::tenants::Tenant::default_tenant();
        let fresh = w.fresh_session().unwrap();
        for i in 0..7 {
            // Idle sessions as completions leave them: advanced, sampling, all logits kept.
            let mut s = w.fresh_session().unwrap();
            s.set_logits_mode(LogitsMode::All);
            s.append(&[1, 2, 3 + i]).unwrap();
            s.set_sampler(flashrt_runtime::SamplerState {
                temperature: 0.8,
                ..flashrt_runtime::SamplerState::default()
            });
            w.pool.push(s);
        }
        // max_sessions + 1 = 5 sessions in the plan, none open.
        w.trim_pool();
        assert_eq!(w.pool.len(), 5);
        // Each API session takes an idle one's place: reused while more than one is idle, as
        // fresh as a new session (state, position, sampler, logits kept).
        for want in [4, 3, 2, 1] {
            let mut session = w.new_session(&tenant).unwrap();
            assert_eq!(w.pool.len(), want);
            assert_eq!(session.pos(), 0);
            assert_eq!(session.sampler(), fresh.sampler());
            for b in model.compiled().layout.state_buffers() {
                let bytes = session.read_region(b.id).unwrap();
                assert!(bytes.iter().all(|&x| x == 0), "state `{}` not zero", b.name);
            }
            session.append(&[5, 6]).unwrap();
            assert_eq!(session.logits_rows(), 1, "only the last row kept");
            let owner = tenant.name.clone();
            w.sessions
                .insert(format!("s{want}"), Slot { session, owner });
            w.trim_pool();
            assert_eq!(w.pool.len(), want);
        }
        // The plan is full: a further API session is refused, one idle session stays.
        let Err(e) = w.new_session(&tenant) else {
            panic!("a session beyond the memory plan was made")
        };
        assert_eq!((e.status, e.code), (429, "too_many_sessions"));
        assert_eq!(w.pool.len(), 1);
        // With room again, a new session is made and the last idle one stays for completions.
        w.sessions.remove("s1");
        let s = w.new_session(&tenant).unwrap();
        assert_eq!((s.pos(), w.pool.len()), (0, 1));
    }
}
