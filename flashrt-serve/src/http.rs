//! The HTTP API: routes, request parsing, errors, SSE streaming.
//!
//! Every handler parses its body itself (so malformed JSON gets the same JSON error shape as
//! everything else), turns it into a worker [`Cmd`], and awaits the worker's answer. Errors
//! are `{"error": {"message", "type", "code"}}` with a 4xx status for anything the client
//! can fix. See the crate docs for the endpoint list.

use crate::metrics::Metrics;
use crate::text::{GenerationDefaults, RenderOptions, Text};
use crate::worker::{ApiError, Cmd, CreateReq, Event, GenReq, Job, Out};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use flashrt_runtime::SamplerState;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot};

/// What every handler shares.
pub struct AppState {
    pub jobs: std::sync::mpsc::SyncSender<Job>,
    pub metrics: Arc<Metrics>,
    pub token: Option<String>,
    /// The checkpoint's tokenizer and chat template, when it has them.
    pub text: Option<Arc<Text>>,
    pub model_name: String,
    pub fingerprint: String,
    pub backend: String,
    pub vocab: usize,
    pub max_seq: usize,
    /// Stop tokens of the model (EOS), applied unless a request says `ignore_eos`.
    pub eos: Vec<u32>,
    /// Sampling defaults of the checkpoint (`generation_config.json`) for what a request
    /// leaves out.
    pub defaults: GenerationDefaults,
    /// Where `export`/`import` by file name read and write.
    pub files_dir: Option<PathBuf>,
    /// Largest accepted body (a capsule file upload is the largest thing).
    pub max_body: usize,
    pub started: std::time::Instant,
    pub next_id: AtomicU64,
}

type St = State<Arc<AppState>>;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &self.body())
    }
}

fn json_response(status: u16, v: &Value) -> Response {
    let mut r = Response::new(Body::from(serde_json::to_vec(v).unwrap_or_default()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn ok(v: Value) -> Response {
    json_response(200, &v)
}

/// The router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/sessions", post(create_session).get(list_sessions))
        .route(
            "/v1/sessions/{id}",
            get(session_info).delete(delete_session),
        )
        .route("/v1/sessions/{id}/append", post(append))
        .route("/v1/sessions/{id}/generate", post(generate))
        .route("/v1/sessions/{id}/snapshot", post(snapshot))
        .route("/v1/sessions/{id}/restore", post(restore))
        .route("/v1/sessions/{id}/rollback", post(rollback))
        .route("/v1/sessions/{id}/fork", post(fork))
        .route("/v1/capsules", get(list_capsules))
        .route("/v1/capsules/import", post(import))
        .route(
            "/v1/capsules/{id}",
            get(capsule_info).delete(delete_capsule),
        )
        .route("/v1/capsules/{id}/persist", post(persist))
        .route("/v1/capsules/{id}/export", post(export))
        .route("/v1/capsules/{id}/file", get(export_bytes))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .layer(middleware::from_fn(log_requests))
        .with_state(state)
}

/// Prompt and completion tokens of an answer, for its log line: attached to the response by
/// the handler (a JSON answer) or filled in when its stream ends (SSE).
#[derive(Clone, Default)]
pub struct TokenCount(Arc<std::sync::Mutex<Option<(u64, u64)>>>);

impl TokenCount {
    fn set(&self, prompt: u64, completion: u64) {
        if let Ok(mut g) = self.0.lock() {
            *g = Some((prompt, completion));
        }
    }
    fn describe(&self) -> String {
        match self.0.lock().ok().and_then(|g| *g) {
            Some((p, c)) => format!(" tokens={p}+{c}"),
            None => String::new(),
        }
    }
}

/// One log line per request: method, path, status, latency (to the last byte of a stream),
/// tokens where the answer has them.
async fn log_requests(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let t0 = std::time::Instant::now();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let tokens = resp.extensions().get::<TokenCount>().cloned();
    let line = move |what: &str| {
        let t = tokens.as_ref().map_or(String::new(), TokenCount::describe);
        tracing::info!(
            "{method} {path} {status} {:.1} ms{what}{t}",
            t0.elapsed().as_secs_f64() * 1e3
        );
    };
    let streaming = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streaming {
        line("");
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let logged = LoggedBody {
        inner: body,
        on_end: Some(Box::new(move || line(" (stream)"))),
    };
    Response::from_parts(parts, Body::new(logged))
}

/// A response body that runs `on_end` once, when it ends or is dropped (a client gone).
struct LoggedBody {
    inner: Body,
    on_end: Option<Box<dyn FnOnce() + Send>>,
}

impl http_body::Body for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = r
            && let Some(f) = self.on_end.take()
        {
            f();
        }
        r
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        if let Some(f) = self.on_end.take() {
            f();
        }
    }
}

async fn count(State(st): St, req: Request, next: Next) -> Response {
    st.metrics.http_requests.fetch_add(1, Ordering::Relaxed);
    let r = next.run(req).await;
    let s = r.status().as_u16();
    if (400..500).contains(&s) {
        st.metrics.http_4xx.fetch_add(1, Ordering::Relaxed);
    } else if s >= 500 {
        st.metrics.http_5xx.fetch_add(1, Ordering::Relaxed);
    }
    r
}

/// Constant-time comparison (the token is a secret).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(st): St, req: Request, next: Next) -> Response {
    if let Some(token) = &st.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !same(given.as_bytes(), token.as_bytes()) {
            let mut r =
                ApiError::new(401, "unauthorized", "missing or wrong bearer token").into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return r;
        }
    }
    next.run(req).await
}

async fn not_found() -> Response {
    ApiError::not_found("unknown_route", "no such endpoint").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        405,
        "method_not_allowed",
        "method not allowed on this endpoint",
    )
    .into_response()
}

/// Read the body (bounded) and parse it as JSON; an empty body is `{}`.
async fn parse<T: DeserializeOwned>(st: &AppState, body: Body) -> Result<T, ApiError> {
    let bytes = read_body(st, body).await?;
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        &bytes
    };
    serde_json::from_slice(text)
        .map_err(|e| ApiError::bad("invalid_json", format!("request body: {e}")))
}

async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, st.max_body).await.map_err(|_| {
        ApiError::new(
            413,
            "body_too_large",
            format!("request body is larger than {} bytes", st.max_body),
        )
    })
}

/// Send a command and await its answer.
async fn call(st: &AppState, cmd: Cmd) -> Result<Out, ApiError> {
    let (tx, rx) = oneshot::channel();
    st.jobs
        .try_send(Job { cmd, reply: tx })
        .map_err(|e| match e {
            std::sync::mpsc::TrySendError::Full(_) => {
                ApiError::new(503, "busy", "the server's queue is full; retry shortly")
            }
            std::sync::mpsc::TrySendError::Disconnected(_) => {
                ApiError::new(503, "shutting_down", "the model worker has stopped")
            }
        })?;
    rx.await
        .map_err(|_| ApiError::new(503, "shutting_down", "the model worker has stopped"))?
}

async fn call_json(st: &AppState, cmd: Cmd) -> Response {
    match call(st, cmd).await {
        Ok(Out::Json(v)) => ok(v),
        Ok(Out::Bytes(b)) => bytes_response(b),
        Ok(Out::Stream) => ApiError::new(500, "internal", "unexpected stream").into_response(),
        Err(e) => e.into_response(),
    }
}

fn bytes_response(b: Vec<u8>) -> Response {
    let mut r = Response::new(Body::from(b));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    r
}

fn check_id(id: &str, what: &'static str) -> Result<(), ApiError> {
    if flashrt_runtime::store::valid_id(id) {
        Ok(())
    } else {
        Err(ApiError::not_found(
            what,
            format!("no such id `{}` (ids are 16 hex digits)", id.escape_debug()),
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// Health and metrics

async fn health(State(st): St) -> Response {
    let alive = st.metrics.worker_alive.load(Ordering::SeqCst);
    let m = &st.metrics;
    json_response(
        if alive { 200 } else { 503 },
        &json!({
            "status": if alive { "ok" } else { "worker stopped" },
            "model": st.model_name,
            "fingerprint": st.fingerprint,
            "backend": st.backend,
            "vocab": st.vocab,
            "max_seq": st.max_seq,
            "tokenizer": st.text.is_some(),
            "chat_template": st.text.as_ref().is_some_and(|t| t.template.is_some()),
            "sessions": m.sessions.load(Ordering::Relaxed),
            "capsules": {
                "device": m.capsules[0].load(Ordering::Relaxed),
                "host": m.capsules[1].load(Ordering::Relaxed),
                "disk": m.capsules[2].load(Ordering::Relaxed),
            },
            "uptime_s": st.started.elapsed().as_secs_f64(),
        }),
    )
}

async fn metrics(State(st): St) -> Response {
    let mut r = Response::new(Body::from(st.metrics.render()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}

async fn models(State(st): St) -> Response {
    ok(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "owned_by": "flashrt",
                  "max_seq": st.max_seq, "vocab": st.vocab, "fingerprint": st.fingerprint}],
    }))
}

// ---------------------------------------------------------------------------------------------
// Sessions API

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SamplerBody {
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: Option<u64>,
}

impl SamplerBody {
    /// The sampler; what the body leaves out comes from the checkpoint's generation config
    /// (OpenAI's defaults where it says nothing: temperature 1, no top-k / top-p cut).
    fn build(self, st: &AppState) -> Result<SamplerState, ApiError> {
        let seed = self.seed.unwrap_or_else(|| fresh_seed(st));
        let d = st.defaults.sampler(seed);
        let temperature = match (self.temperature, st.defaults.do_sample) {
            (Some(t), _) => t,
            (None, Some(false)) => 0.0,
            (None, _) => st.defaults.temperature.unwrap_or(1.0),
        };
        let s = SamplerState::seeded(
            seed,
            temperature,
            self.top_k.unwrap_or(d.top_k),
            self.top_p.unwrap_or(d.top_p),
        );
        s.validate()
            .map_err(|e| ApiError::bad("invalid_sampler", e.to_string()))?;
        Ok(s)
    }
}

fn fresh_seed(st: &AppState) -> u64 {
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let t = st.started.elapsed().as_nanos() as u64;
    (t ^ n.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ flashrt_runtime::capsule_file::now_ms()
}

/// Token ids, or text when the server has a tokenizer.
#[derive(Deserialize)]
#[serde(untagged)]
enum Tokens {
    Ids(Vec<u32>),
    Text(String),
}

fn to_ids(st: &AppState, t: Tokens) -> Result<Vec<u32>, ApiError> {
    match t {
        Tokens::Ids(v) => Ok(v),
        Tokens::Text(s) => match &st.text {
            Some(t) => t
                .tokenizer
                .encode(&s)
                .map_err(|e| ApiError::bad("tokenizer", e)),
            None => Err(ApiError::bad(
                "no_tokenizer",
                "this server has no tokenizer: send token ids",
            )),
        },
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    tokens: Option<Tokens>,
    capsule: Option<String>,
    sampler: Option<SamplerBody>,
    reuse: Option<bool>,
}

async fn create_session(State(st): St, body: Body) -> Response {
    let r = async {
        let b: CreateBody = parse(&st, body).await?;
        let tokens = b
            .tokens
            .map(|t| to_ids(&st, t))
            .transpose()?
            .unwrap_or_default();
        if let Some(c) = &b.capsule {
            check_id(c, "unknown_capsule")?;
        }
        let sampler = b.sampler.map(|s| s.build(&st)).transpose()?;
        Ok::<_, ApiError>(Cmd::CreateSession(CreateReq {
            tokens,
            capsule: b.capsule,
            sampler,
            reuse: b.reuse.unwrap_or(true),
        }))
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

async fn list_sessions(State(st): St) -> Response {
    call_json(&st, Cmd::ListSessions).await
}

async fn session_info(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_session") {
        return e.into_response();
    }
    call_json(&st, Cmd::SessionInfo(id)).await
}

async fn delete_session(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_session") {
        return e.into_response();
    }
    call_json(&st, Cmd::DeleteSession(id)).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AppendBody {
    tokens: Tokens,
}

async fn append(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: AppendBody = parse(&st, body).await?;
        Ok::<_, ApiError>(Cmd::Append {
            session: id,
            tokens: to_ids(&st, b.tokens)?,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct GenerateBody {
    max_tokens: Option<usize>,
    sampler: Option<SamplerBody>,
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    stream: bool,
}

fn max_tokens(st: &AppState, n: Option<usize>, default: usize) -> Result<usize, ApiError> {
    let n = n.unwrap_or(default);
    if n > st.max_seq {
        return Err(ApiError::bad(
            "invalid_request",
            format!("max_tokens {n} exceeds the model's max_seq {}", st.max_seq),
        ));
    }
    Ok(n)
}

fn stops(st: &AppState, extra: Option<Vec<u32>>, ignore_eos: bool) -> Vec<u32> {
    let mut v = extra.unwrap_or_default();
    if !ignore_eos {
        v.extend(&st.eos);
    }
    v
}

async fn generate(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: GenerateBody = parse(&st, body).await?;
        let req = GenReq {
            max_tokens: max_tokens(&st, b.max_tokens, 16)?,
            sampler: b.sampler.map(|s| s.build(&st)).transpose()?,
            stop: stops(&st, b.stop_token_ids, b.ignore_eos),
            stop_strings: Vec::new(),
        };
        Ok::<_, ApiError>((req, b.stream))
    }
    .await;
    let (req, stream) = match r {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    if !stream {
        return call_json(
            &st,
            Cmd::Generate {
                session: id,
                req,
                stream: None,
            },
        )
        .await;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    match call(
        &st,
        Cmd::Generate {
            session: id,
            req,
            stream: Some(tx),
        },
    )
    .await
    {
        Ok(_) => sse(
            rx,
            Box::new(|ev| match ev {
                Event::Token(Some(t), text) => vec![json!({"token": t, "text": text}).to_string()],
                Event::Token(None, text) => vec![json!({"text": text}).to_string()],
                Event::Done(v) => vec![json!({"done": true, "result": v}).to_string()],
                Event::Error(e) => vec![e.body().to_string()],
            }),
        ),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    persist: bool,
    label: Option<String>,
}

async fn snapshot(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: SnapshotBody = parse(&st, body).await?;
        if b.label.as_ref().is_some_and(|l| l.len() > 256) {
            return Err(ApiError::bad(
                "invalid_request",
                "label longer than 256 bytes",
            ));
        }
        Ok(Cmd::Snapshot {
            session: id,
            persist: b.persist,
            label: b.label,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CapsuleBody {
    capsule: String,
}

async fn restore(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: CapsuleBody = parse(&st, body).await?;
        check_id(&b.capsule, "unknown_capsule")?;
        Ok::<_, ApiError>(Cmd::Restore {
            session: id,
            capsule: b.capsule,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RollbackBody {
    capsule: Option<String>,
    pos: Option<usize>,
}

async fn rollback(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: RollbackBody = parse(&st, body).await?;
        if let Some(c) = &b.capsule {
            check_id(c, "unknown_capsule")?;
        }
        Ok::<_, ApiError>(Cmd::Rollback {
            session: id,
            capsule: b.capsule,
            pos: b.pos,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

async fn fork(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_session") {
        return e.into_response();
    }
    call_json(&st, Cmd::Fork { session: id }).await
}

// ---------------------------------------------------------------------------------------------
// Capsules

async fn list_capsules(State(st): St) -> Response {
    call_json(&st, Cmd::ListCapsules).await
}

async fn capsule_info(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::CapsuleInfo(id)).await
}

async fn delete_capsule(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::DeleteCapsule(id)).await
}

async fn persist(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::PersistCapsule(id)).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBody {
    file: String,
}

/// `file` as a plain name inside the files directory.
fn file_path(st: &AppState, name: &str) -> Result<PathBuf, ApiError> {
    let Some(dir) = &st.files_dir else {
        return Err(ApiError::bad(
            "no_files_dir",
            "this server has no files directory (start it with --store-dir or --files-dir); \
             use GET /v1/capsules/{id}/file and an octet-stream import instead",
        ));
    };
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if !ok {
        return Err(ApiError::bad(
            "invalid_file_name",
            format!(
                "`{}` is not a plain file name (letters, digits, `.`, `_`, `-`; at most 128)",
                name.escape_debug()
            ),
        ));
    }
    Ok(dir.join(name))
}

async fn export(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_capsule")?;
        let b: FileBody = parse(&st, body).await?;
        Ok::<_, ApiError>(Cmd::ExportFile {
            capsule: id,
            path: file_path(&st, &b.file)?,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

async fn export_bytes(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_capsule") {
        return e.into_response();
    }
    call_json(&st, Cmd::ExportBytes(id)).await
}

async fn import(State(st): St, headers: HeaderMap, body: Body) -> Response {
    let binary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/octet-stream"));
    let r = async {
        if binary {
            let bytes = read_body(&st, body).await?;
            return Ok(Cmd::ImportBytes(bytes.to_vec()));
        }
        let b: FileBody = parse(&st, body).await?;
        Ok::<_, ApiError>(Cmd::ImportFile(file_path(&st, &b.file)?))
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// OpenAI-compatible completions

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Option<Value>,
    /// Chat messages as sent (the template sees them unchanged).
    messages: Option<Vec<Value>>,
    /// OpenAI function definitions, rendered by the chat template.
    tools: Option<Value>,
    /// Extra template variables (`{"enable_thinking": false}`), as vLLM takes them.
    chat_template_kwargs: Option<Value>,
    add_generation_prompt: Option<bool>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: bool,
    n: Option<usize>,
    #[serde(default)]
    echo: bool,
    logprobs: Option<Value>,
}

fn prompt_ids(st: &AppState, p: &Value) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::bad(
            "invalid_prompt",
            "`prompt` must be token ids (an array of integers) or, with a tokenizer, a string; \
             one prompt per request",
        )
    };
    match p {
        Value::String(s) => match &st.text {
            // As transformers' `tokenizer(prompt)`: with what the post-processor adds.
            Some(t) => t
                .tokenizer
                .encode_with(s, true)
                .map_err(|e| ApiError::bad("tokenizer", e)),
            None => to_ids(st, Tokens::Text(s.clone())),
        },
        Value::Array(a) if a.len() == 1 && !a[0].is_number() => prompt_ids(st, &a[0]),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| {
                        ApiError::bad(
                            "invalid_tokens",
                            format!("`{x}` is not a token id (an integer in 0..2^32)"),
                        )
                    })
            })
            .collect(),
        _ => Err(bad()),
    }
}

/// The prompt of a chat request: the model's chat template over the messages (and tools)
/// exactly as sent, then tokenized; without a tokenizer, each message's content must be
/// token ids, concatenated.
fn chat_ids(st: &AppState, b: &CompletionBody) -> Result<Vec<u32>, ApiError> {
    let msgs = b
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::bad("invalid_request", "`messages` is required"))?;
    if msgs.is_empty() {
        return Err(ApiError::bad("invalid_request", "`messages` is empty"));
    }
    for (i, m) in msgs.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::bad(
                "invalid_request",
                format!("messages[{i}] needs a string `role`"),
            ));
        }
    }
    match &st.text {
        Some(text) => {
            let Some(template) = &text.template else {
                return Err(ApiError::bad(
                    "no_chat_template",
                    "this model has no chat template (no chat_template.jinja, no chat_template \
                     in tokenizer_config.json): use /v1/completions with a prompt",
                ));
            };
            let kwargs = match &b.chat_template_kwargs {
                None | Some(Value::Null) => serde_json::Map::new(),
                Some(Value::Object(m)) => m.clone(),
                Some(_) => {
                    return Err(ApiError::bad(
                        "invalid_request",
                        "`chat_template_kwargs` must be an object",
                    ));
                }
            };
            let tools = match &b.tools {
                None | Some(Value::Null) => None,
                Some(t @ Value::Array(_)) => Some(t.clone()),
                Some(_) => {
                    return Err(ApiError::bad("invalid_request", "`tools` must be a list"));
                }
            };
            let opts = RenderOptions {
                tools,
                add_generation_prompt: b.add_generation_prompt.unwrap_or(true),
                kwargs,
            };
            let prompt = template
                .render(&Value::Array(msgs.to_vec()), &opts)
                .map_err(|e| ApiError::bad("chat_template", e))?;
            text.tokenizer
                .encode(&prompt)
                .map_err(|e| ApiError::bad("tokenizer", e))
        }
        None => {
            let mut ids = Vec::new();
            for m in msgs {
                if !m["content"].is_array() {
                    return Err(ApiError::bad(
                        "no_tokenizer",
                        "this server has no tokenizer: give each message's content as token ids",
                    ));
                }
                ids.extend(prompt_ids(st, &m["content"])?);
            }
            Ok(ids)
        }
    }
}

fn completion_req(st: &AppState, b: &CompletionBody) -> Result<GenReq, ApiError> {
    if b.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad(
            "unsupported",
            "n must be 1 (a batch-1 server)",
        ));
    }
    if b.echo {
        return Err(ApiError::bad("unsupported", "echo is not supported"));
    }
    if b.logprobs
        .as_ref()
        .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
    {
        return Err(ApiError::bad("unsupported", "logprobs are not supported"));
    }
    let stop_strings: Vec<String> = match &b.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::bad("invalid_request", "`stop` must be strings"))?,
        _ => return Err(ApiError::bad("invalid_request", "`stop` must be strings")),
    };
    if !stop_strings.is_empty() && st.text.is_none() {
        return Err(ApiError::bad(
            "no_tokenizer",
            "`stop` strings need a tokenizer; use `stop_token_ids`",
        ));
    }
    let sampler = SamplerBody {
        temperature: b.temperature,
        top_k: b.top_k,
        top_p: b.top_p,
        seed: b.seed,
    }
    .build(st)?;
    Ok(GenReq {
        max_tokens: max_tokens(st, b.max_completion_tokens.or(b.max_tokens), 16)?,
        sampler: Some(sampler),
        stop: stops(st, b.stop_token_ids.clone(), b.ignore_eos),
        stop_strings,
    })
}

async fn completions(State(st): St, body: Body) -> Response {
    openai(st, body, false).await
}

async fn chat_completions(State(st): St, body: Body) -> Response {
    openai(st, body, true).await
}

async fn openai(st: Arc<AppState>, body: Body, chat: bool) -> Response {
    let r = async {
        let b: CompletionBody = parse(&st, body).await?;
        let prompt = if chat {
            chat_ids(&st, &b)?
        } else {
            prompt_ids(
                &st,
                b.prompt
                    .as_ref()
                    .ok_or_else(|| ApiError::bad("invalid_request", "`prompt` is required"))?,
            )?
        };
        let req = completion_req(&st, &b)?;
        Ok::<_, ApiError>((prompt, req, b.stream))
    }
    .await;
    let (prompt, req, stream) = match r {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-{n:x}", if chat { "chatcmpl" } else { "cmpl" });
    let created = flashrt_runtime::capsule_file::now_ms() / 1000;
    if !stream {
        return match call(
            &st,
            Cmd::Complete {
                prompt,
                req,
                stream: None,
            },
        )
        .await
        {
            Ok(Out::Json(v)) => {
                let body = completion_json(&st, &id, created, chat, &v);
                let mut r = ok(body);
                let t = TokenCount::default();
                t.set(
                    v["prompt_tokens"].as_u64().unwrap_or(0),
                    v["tokens"].as_array().map_or(0, |a| a.len() as u64),
                );
                r.extensions_mut().insert(t);
                r
            }
            Ok(_) => ApiError::new(500, "internal", "unexpected answer").into_response(),
            Err(e) => e.into_response(),
        };
    }
    let (tx, rx) = mpsc::unbounded_channel();
    if let Err(e) = call(
        &st,
        Cmd::Complete {
            prompt,
            req,
            stream: Some(tx),
        },
    )
    .await
    {
        return e.into_response();
    }
    let st2 = st.clone();
    let mut first = true;
    let count = TokenCount::default();
    let count2 = count.clone();
    let mut r = sse(
        rx,
        Box::new(move |ev| {
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let choice = |piece: String, tokens: Vec<u32>, finish: Value, first: bool| {
                if chat {
                    let mut delta = json!({"content": piece, "token_ids": tokens});
                    if first {
                        delta["role"] = json!("assistant");
                    }
                    json!({"index": 0, "delta": delta, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": piece, "token_ids": tokens, "logprobs": null, "finish_reason": finish})
                }
            };
            let chunk = |c: Value| {
                json!({"id": id, "object": object, "created": created, "model": st2.model_name,
                   "system_fingerprint": st2.fingerprint, "choices": [c]})
                .to_string()
            };
            match ev {
                Event::Token(t, piece) => {
                    let c = choice(piece, t.into_iter().collect(), Value::Null, first);
                    first = false;
                    vec![chunk(c)]
                }
                Event::Done(v) => {
                    count2.set(
                        v["prompt_tokens"].as_u64().unwrap_or(0),
                        v["tokens"].as_array().map_or(0, |a| a.len() as u64),
                    );
                    // The last chunk carries the finish reason and, like OpenAI's
                    // `include_usage`, the usage.
                    let c = choice(String::new(), vec![], v["finish_reason"].clone(), first);
                    let mut last: Value = serde_json::from_str(&chunk(c)).unwrap_or_default();
                    last["usage"] = usage(&v);
                    vec![last.to_string(), "[DONE]".to_string()]
                }
                Event::Error(e) => vec![e.body().to_string(), "[DONE]".to_string()],
            }
        }),
    );
    r.extensions_mut().insert(count);
    r
}

fn usage(v: &Value) -> Value {
    let p = v["prompt_tokens"].as_u64().unwrap_or(0);
    let c = v["tokens"].as_array().map_or(0, |a| a.len() as u64);
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": v["cached_tokens"]}})
}

fn completion_json(st: &AppState, id: &str, created: u64, chat: bool, v: &Value) -> Value {
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap_or_default();
    // The worker's text: decoded incrementally and cut at a stop string, exactly what a
    // streamed answer carries.
    let text = v["text"].as_str().unwrap_or_default();
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text, "token_ids": ids},
               "finish_reason": v["finish_reason"]})
    } else {
        json!({"index": 0, "text": text, "token_ids": ids, "logprobs": null,
               "finish_reason": v["finish_reason"]})
    };
    json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": st.model_name,
        "system_fingerprint": st.fingerprint,
        "seed": v["seed"],
        "choices": [choice],
        "usage": usage(v),
    })
}

// ---------------------------------------------------------------------------------------------
// Server-sent events

type Formatter = Box<dyn FnMut(Event) -> Vec<String> + Send>;

/// `data: ...\n\n` frames from the worker's events; ends after the final event.
struct SseStream {
    rx: mpsc::UnboundedReceiver<Event>,
    fmt: Formatter,
    queue: VecDeque<Bytes>,
    done: bool,
}

impl futures_core::Stream for SseStream {
    type Item = Result<Bytes, Infallible>;
    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.queue.pop_front() {
                return Poll::Ready(Some(Ok(b)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => {
                    let last = matches!(ev, Event::Done(_) | Event::Error(_));
                    for s in (this.fmt)(ev) {
                        this.queue.push_back(Bytes::from(format!("data: {s}\n\n")));
                    }
                    this.done = last;
                }
                Poll::Ready(None) => this.done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

fn sse(rx: mpsc::UnboundedReceiver<Event>, fmt: Formatter) -> Response {
    let stream = SseStream {
        rx,
        fmt,
        queue: VecDeque::new(),
        done: false,
    };
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
