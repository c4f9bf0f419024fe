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

use crate::metrics::Metrics;
use crate::text::{Text, TextStream};
use flashrt_runtime::store::{CapsuleInfo, valid_id};
use flashrt_runtime::{CapsuleStore, Error, LogitsMode, Model, SamplerState, Session};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
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
    /// A sampled token (streamed the moment it is chosen, fed to the session right after)
    /// and the text it makes visible (empty without a tokenizer, or while a character or a
    /// possible stop string is incomplete). `None`: the text still held back at the end.
    Token(Option<u32>, String),
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
    Fork {
        session: String,
    },
    ListCapsules,
    CapsuleInfo(String),
    DeleteCapsule(String),
    PersistCapsule(String),
    ExportFile {
        capsule: String,
        path: PathBuf,
    },
    ExportBytes(String),
    ImportFile(PathBuf),
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

/// A command and where to answer it.
pub struct Job {
    pub cmd: Cmd,
    pub reply: oneshot::Sender<WResult<Out>>,
}

/// Worker settings.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub max_sessions: usize,
    /// Completions store a capsule at the prompt boundary and at the end of generation.
    pub auto_cache: bool,
}

struct Slot {
    session: Session,
}

/// The worker's state.
pub struct Worker {
    model: Model,
    store: CapsuleStore,
    sessions: HashMap<String, Slot>,
    scratch: Option<Session>,
    metrics: Arc<Metrics>,
    text: Option<Arc<Text>>,
    cfg: WorkerConfig,
    id_state: u64,
    session_arena_bytes: u64,
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
    })
}

fn sampler_json(s: &SamplerState) -> Value {
    json!({"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed})
}

impl Worker {
    pub fn new(
        model: Model,
        store: CapsuleStore,
        metrics: Arc<Metrics>,
        text: Option<Arc<Text>>,
        cfg: WorkerConfig,
    ) -> Worker {
        let l = &model.compiled().layout;
        let session_arena_bytes = [
            flashrt_ir::Role::State,
            flashrt_ir::Role::Scratch,
            flashrt_ir::Role::Io,
        ]
        .iter()
        .map(|&r| l.arena_bytes(r) as u64)
        .sum();
        metrics.publish_store(&store.stats());
        Worker {
            model,
            store,
            sessions: HashMap::new(),
            scratch: None,
            metrics,
            text,
            cfg,
            id_state: flashrt_runtime::capsule_file::now_ms() ^ 0x5e55_1011,
            session_arena_bytes,
        }
    }

    /// Serve jobs until a [`Cmd::Shutdown`] or until every sender is gone.
    pub fn run(mut self, rx: std::sync::mpsc::Receiver<Job>) {
        self.metrics.worker_alive.store(true, Ordering::SeqCst);
        while let Ok(job) = rx.recv() {
            let shutdown = matches!(job.cmd, Cmd::Shutdown);
            let touched = match &job.cmd {
                Cmd::Append { session, .. }
                | Cmd::Generate { session, .. }
                | Cmd::Restore { session, .. }
                | Cmd::Rollback { session, .. } => Some(session.clone()),
                _ => None,
            };
            let mut rep = Replier(Some(job.reply));
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.handle(job.cmd, &mut rep)
            }));
            let r = r.unwrap_or_else(|_| {
                // The session may be half-updated: drop it rather than serve garbage.
                if let Some(s) = touched {
                    self.sessions.remove(&s);
                }
                self.scratch = None;
                Err(ApiError::new(
                    500,
                    "internal",
                    "internal error while running the command (the session involved was closed)",
                ))
            });
            rep.send(r);
            self.publish();
            if shutdown {
                break;
            }
        }
        self.metrics.worker_alive.store(false, Ordering::SeqCst);
    }

    fn publish(&self) {
        self.metrics.publish_store(&self.store.stats());
        let n = self.sessions.len() as u64;
        self.metrics.sessions.store(n, Ordering::Relaxed);
        let live = n + self.scratch.is_some() as u64;
        self.metrics
            .session_bytes
            .store(live * self.session_arena_bytes, Ordering::Relaxed);
    }

    fn new_id(&mut self) -> String {
        loop {
            self.id_state = self.id_state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.id_state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let id = format!("{:016x}", z ^ (z >> 31));
            if !self.sessions.contains_key(&id) {
                return id;
            }
        }
    }

    fn session(&mut self, id: &str) -> WResult<&mut Session> {
        self.sessions
            .get_mut(id)
            .map(|s| &mut s.session)
            .ok_or_else(|| ApiError::not_found("unknown_session", format!("no session `{id}`")))
    }

    fn check_capsule(&self, id: &str) -> WResult<()> {
        if !valid_id(id) || !self.store.contains(id) {
            return Err(ApiError::not_found(
                "unknown_capsule",
                format!("no capsule `{}`", id.escape_debug()),
            ));
        }
        Ok(())
    }

    fn new_session(&mut self) -> WResult<Session> {
        if self.sessions.len() >= self.cfg.max_sessions {
            return Err(ApiError::new(
                429,
                "too_many_sessions",
                format!(
                    "the server holds its maximum of {} sessions; delete one first",
                    self.cfg.max_sessions
                ),
            ));
        }
        self.fresh_session()
    }

    /// A session as the server uses it: only the last position's logits are kept (it samples
    /// the next token and nothing else), so a prompt's chunks skip the LM head on the device
    /// and no row but the last crosses to the host.
    fn fresh_session(&self) -> WResult<Session> {
        let mut s = self.model.session()?;
        s.set_logits_mode(LogitsMode::Last);
        Ok(s)
    }

    fn observe_restore(&self, info: &flashrt_runtime::store::RestoreInfo) {
        self.metrics.restore[info.tier as usize].observe(info.elapsed);
    }

    /// Restore the longest stored prefix of `tokens` into `s`; returns its length (0: none,
    /// and `s` was reset).
    fn reuse_prefix(&mut self, s: &mut Session, tokens: &[u32]) -> WResult<usize> {
        if let Some((id, p)) = self.store.lookup_prefix(tokens) {
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

    fn handle(&mut self, cmd: Cmd, rep: &mut Replier) -> WResult<Out> {
        match cmd {
            Cmd::CreateSession(req) => self.create(req),
            Cmd::SessionInfo(id) => {
                let s = self.session(&id)?;
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
                    .map(|(id, s)| json!({"session": id, "pos": s.session.pos()}))
                    .collect();
                v.sort_by(|a, b| a["session"].as_str().cmp(&b["session"].as_str()));
                Ok(Out::Json(json!({"sessions": v})))
            }
            Cmd::DeleteSession(id) => {
                self.sessions.remove(&id).ok_or_else(|| {
                    ApiError::not_found("unknown_session", format!("no session `{id}`"))
                })?;
                Ok(Out::Json(json!({"deleted": id})))
            }
            Cmd::Append { session, tokens } => {
                let pos = self.session(&session)?.pos();
                if tokens.is_empty() {
                    return Err(ApiError::bad(
                        "invalid_tokens",
                        "append needs at least one token",
                    ));
                }
                self.validate_tokens(&tokens, pos)?;
                let mut s = self.sessions.remove(&session).expect("checked").session;
                let r = self.prefill(&mut s, &tokens);
                let pos = s.pos();
                self.sessions.insert(session.clone(), Slot { session: s });
                r?;
                Ok(Out::Json(json!({"session": session, "pos": pos})))
            }
            Cmd::Generate {
                session,
                req,
                stream,
            } => {
                self.session(&session)?;
                if let Some(sm) = &req.sampler {
                    sm.validate()?;
                }
                let mut s = self.sessions.remove(&session).expect("checked").session;
                if let Some(sm) = &req.sampler {
                    s.set_sampler(sm.clone());
                }
                if s.pos() == 0 && s.pending().is_none() {
                    self.sessions.insert(session, Slot { session: s });
                    return Err(ApiError::bad(
                        "empty_session",
                        "nothing to generate from: append tokens first",
                    ));
                }
                if stream.is_some() {
                    rep.send(Ok(Out::Stream));
                }
                let r = self.generate(&mut s, &req, stream.as_ref());
                let pos = s.pos();
                self.sessions.insert(session.clone(), Slot { session: s });
                let (tokens, finish, text) = match r {
                    Ok(x) => x,
                    Err(e) => {
                        if let Some(tx) = &stream {
                            let _ = tx.send(Event::Error(e.clone()));
                        }
                        return Err(e);
                    }
                };
                let summary = json!({
                    "session": session,
                    "tokens": tokens,
                    "text": text,
                    "finish_reason": finish,
                    "pos": pos,
                });
                if let Some(tx) = &stream {
                    let _ = tx.send(Event::Done(summary.clone()));
                }
                Ok(Out::Json(summary))
            }
            Cmd::Snapshot {
                session,
                persist,
                label,
            } => {
                let cap = self.session(&session)?.snapshot()?;
                let id = self.store.insert(cap, label)?;
                if persist {
                    self.store.persist(&id)?;
                }
                let info = self.store.info(&id)?;
                Ok(Out::Json(capsule_json(&info)))
            }
            Cmd::Restore { session, capsule } => {
                self.session(&session)?;
                self.check_capsule(&capsule)?;
                let mut s = self.sessions.remove(&session).expect("checked").session;
                let r = self.store.restore_into(&capsule, &mut s);
                let pos = s.pos();
                self.sessions.insert(session.clone(), Slot { session: s });
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
                let history: Vec<u32> = self.session(&session)?.tokens().to_vec();
                let capsule = match (capsule, pos) {
                    (Some(c), None) => {
                        self.check_capsule(&c)?;
                        let t = self.store.tokens(&c)?;
                        if t.len() > history.len() || history[..t.len()] != t[..] {
                            return Err(ApiError::new(
                                409,
                                "not_a_prefix",
                                format!(
                                    "capsule `{c}` (position {}) is not a boundary of this session's history (position {})",
                                    t.len(),
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
                        match self.store.longest_prefix(&history[..p]) {
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
                let mut s = self.sessions.remove(&session).expect("checked").session;
                let r = self.store.restore_into(&capsule, &mut s);
                let pos = s.pos();
                self.sessions.insert(session.clone(), Slot { session: s });
                let info = r?;
                self.observe_restore(&info);
                Ok(Out::Json(
                    json!({"session": session, "capsule": capsule, "pos": pos}),
                ))
            }
            Cmd::Fork { session } => {
                let cap = self.session(&session)?.snapshot()?;
                let mut s = self.new_session()?;
                s.restore(&cap)?;
                let id = self.new_id();
                let pos = s.pos();
                self.sessions.insert(id.clone(), Slot { session: s });
                Ok(Out::Json(
                    json!({"session": id, "forked_from": session, "pos": pos}),
                ))
            }
            Cmd::ListCapsules => {
                let ids = self.store.ids();
                let v: Vec<Value> = ids
                    .iter()
                    .filter_map(|id| self.store.info(id).ok())
                    .map(|i| capsule_json(&i))
                    .collect();
                Ok(Out::Json(json!({"capsules": v})))
            }
            Cmd::CapsuleInfo(id) => {
                self.check_capsule(&id)?;
                let mut v = capsule_json(&self.store.info(&id)?);
                v["tokens"] = json!(&self.store.tokens(&id)?[..]);
                Ok(Out::Json(v))
            }
            Cmd::DeleteCapsule(id) => {
                self.check_capsule(&id)?;
                self.store.remove(&id)?;
                Ok(Out::Json(json!({"deleted": id})))
            }
            Cmd::PersistCapsule(id) => {
                self.check_capsule(&id)?;
                self.store.persist(&id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::ExportFile { capsule, path } => {
                self.check_capsule(&capsule)?;
                let bytes = self.store.export(&capsule, &path)?;
                Ok(Out::Json(json!({
                    "capsule": capsule,
                    "path": path.display().to_string(),
                    "bytes": bytes,
                })))
            }
            Cmd::ExportBytes(capsule) => {
                self.check_capsule(&capsule)?;
                let cap = self.store.get(&capsule)?;
                Ok(Out::Bytes(flashrt_runtime::capsule_file::capsule_to_vec(
                    &cap,
                )?))
            }
            Cmd::ImportFile(path) => {
                let id = self.store.import(&path)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::ImportBytes(bytes) => {
                let id = self.store.import_bytes(&bytes)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::Complete {
                prompt,
                req,
                stream,
            } => self.complete(prompt, req, stream, rep),
            Cmd::Shutdown => {
                let n = self.store.flush()?;
                Ok(Out::Json(json!({"flushed": n})))
            }
        }
    }

    fn create(&mut self, req: CreateReq) -> WResult<Out> {
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
            self.check_capsule(c)?;
        }
        let mut s = self.new_session()?;
        let mut reused = 0;
        let mut from = None;
        if let Some(c) = &req.capsule {
            let info = self.store.restore_into(c, &mut s)?;
            self.observe_restore(&info);
            from = Some(c.clone());
        } else if !req.tokens.is_empty() {
            if req.reuse {
                reused = self.reuse_prefix(&mut s, &req.tokens)?;
            }
            self.prefill(&mut s, &req.tokens[reused..])?;
        }
        if let Some(sm) = req.sampler {
            s.set_sampler(sm);
        }
        let id = self.new_id();
        let pos = s.pos();
        self.sessions.insert(id.clone(), Slot { session: s });
        Ok(Out::Json(json!({
            "session": id,
            "pos": pos,
            "reused_tokens": reused,
            "from_capsule": from,
        })))
    }

    /// Sample and feed up to `req.max_tokens` tokens. Each token is streamed as soon as it is
    /// chosen, before the step that feeds it runs. Returns the ids, the finish reason and the
    /// visible text (decoded incrementally, cut before a stop string; empty without a
    /// tokenizer).
    fn generate(
        &self,
        s: &mut Session,
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
    ) -> WResult<(Vec<u32>, &'static str, String)> {
        let mut out = Vec::new();
        let max = self.model.max_seq();
        let mut finish = "length";
        let mut text = self
            .text
            .as_ref()
            .map(|t| TextStream::new(&t.tokenizer, &req.stop_strings));
        for _ in 0..req.max_tokens {
            if s.pos() >= max {
                break;
            }
            let t = s.sample_next()?;
            out.push(t);
            self.metrics
                .generated_tokens
                .fetch_add(1, Ordering::Relaxed);
            let piece = text.as_mut().map(|ts| ts.push(t)).unwrap_or_default();
            if let Some(tx) = stream
                && tx.send(Event::Token(Some(t), piece.text)).is_err()
            {
                finish = "cancelled";
                s.append(&[t])?;
                break;
            }
            s.append(&[t])?;
            if req.stop.contains(&t) || piece.stop {
                finish = "stop";
                break;
            }
        }
        let visible = match text.as_mut() {
            Some(ts) => {
                let tail = ts.finish();
                if let Some(tx) = stream
                    && !tail.text.is_empty()
                {
                    let _ = tx.send(Event::Token(None, tail.text));
                }
                ts.text().to_string()
            }
            None => String::new(),
        };
        Ok((out, finish, visible))
    }

    fn complete(
        &mut self,
        prompt: Vec<u32>,
        req: GenReq,
        stream: Option<mpsc::UnboundedSender<Event>>,
        rep: &mut Replier,
    ) -> WResult<Out> {
        if prompt.is_empty() {
            return Err(ApiError::bad("invalid_tokens", "the prompt is empty"));
        }
        self.validate_tokens(&prompt, 0)?;
        if let Some(sm) = &req.sampler {
            sm.validate()?;
        }
        let mut s = match self.scratch.take() {
            Some(s) => s,
            None => self.fresh_session()?,
        };
        let r = self.complete_in(&mut s, &prompt, &req, stream.as_ref(), rep);
        self.scratch = Some(s);
        match r {
            Ok(v) => {
                if let Some(tx) = &stream {
                    let _ = tx.send(Event::Done(v.clone()));
                }
                Ok(Out::Json(v))
            }
            Err(e) => {
                if let Some(tx) = &stream {
                    let _ = tx.send(Event::Error(e.clone()));
                }
                // Whatever state the scratch session is in, the next request resets it.
                Err(e)
            }
        }
    }

    fn complete_in(
        &mut self,
        s: &mut Session,
        prompt: &[u32],
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
        rep: &mut Replier,
    ) -> WResult<Value> {
        let cached = self.reuse_prefix(s, prompt)?;
        self.prefill(s, &prompt[cached..])?;
        if self.cfg.auto_cache && cached < prompt.len() {
            let cap = s.snapshot()?;
            // A full store refuses; the completion goes on without caching.
            let _ = self.store.insert(cap, Some("auto".into()));
        }
        s.set_sampler(req.sampler.clone().unwrap_or_default());
        if stream.is_some() {
            rep.send(Ok(Out::Stream));
        }
        let (tokens, finish, text) = self.generate(s, req, stream)?;
        if self.cfg.auto_cache && !tokens.is_empty() && finish != "cancelled" {
            let cap = s.snapshot()?;
            let _ = self.store.insert(cap, Some("auto".into()));
        }
        Ok(json!({
            "tokens": tokens,
            "text": text,
            "finish_reason": finish,
            "prompt_tokens": prompt.len(),
            "cached_tokens": cached,
            "seed": s.sampler().seed,
        }))
    }
}
