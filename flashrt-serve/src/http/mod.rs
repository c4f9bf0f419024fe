//! The HTTP API: one shared request, auth and error layer (here) and one module per surface:
//! [`openai`] (completions, chat, models), [`sessions`], [`capsules`], [`health`] (health and
//! metrics); [`sse`] streams.
//!
//! Every handler parses its body itself (so malformed JSON gets the same JSON error shape as
//! everything else), turns it into a worker [`Cmd`], and awaits the worker's answer. Errors
//! are `{"error": {"message", "type", "code"}}` with a 4xx status for anything the client
//! can fix. See the crate docs for the endpoint list.
//!
//! **Tenants.** The auth middleware resolves the bearer token to a [`Tenant`] and runs the
//! handler inside a task-local scope holding it ([`TENANT`]); [`call`] attaches it to every
//! worker job, and fails closed (401) outside such a scope. So no handler can forget to say
//! whose request it is, and the worker checks ownership of every session and capsule.

mod batch;
mod capsules;
mod health;
mod openai;
mod prompt;
mod sessions;
mod sse;

use sse::sse;

use capsules::*;
use health::*;
use openai::*;
use sessions::*;

use crate::metrics::Metrics;
use crate::tenants::{Tenant, Tenants};
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
    /// Who a bearer token is.
    pub tenants: Tenants,
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
    /// How long a client may take to send a body.
    pub body_timeout: std::time::Duration,
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
        .route("/v1/sessions/generate", post(generate_many))
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

tokio::task_local! {
    /// The tenant of the request being handled (set by [`auth`]).
    pub static TENANT: Tenant;
}

/// The tenant of the request being handled.
fn current_tenant() -> Result<Tenant, ApiError> {
    TENANT
        .try_with(Tenant::clone)
        .map_err(|_| ApiError::new(401, "unauthorized", "no tenant for this request"))
}

async fn auth(State(st): St, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match st.tenants.authenticate(given) {
        Some(t) => TENANT.scope(t, next.run(req)).await,
        None => {
            let mut r =
                ApiError::new(401, "unauthorized", "missing or wrong bearer token").into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
    }
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
    parse_bytes(&read_body(st, body).await?)
}

/// A JSON body (an empty one reads as `{}`), with the API's answers for what it is not.
fn parse_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(text).map_err(|e| {
        let m = e.to_string();
        // A parameter this endpoint does not know is the client's to drop, not a JSON error.
        if m.starts_with("unknown field") {
            ApiError::bad("unsupported_parameter", format!("request body: {m}"))
        } else {
            ApiError::bad("invalid_json", format!("request body: {m}"))
        }
    })
}

async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(st.body_timeout, axum::body::to_bytes(body, st.max_body)).await {
        Err(_) => Err(ApiError::new(
            408,
            "body_timeout",
            format!(
                "the request body did not arrive within {:.0} s",
                st.body_timeout.as_secs_f64()
            ),
        )),
        Ok(r) => r.map_err(|_| {
            ApiError::new(
                413,
                "body_too_large",
                format!("request body is larger than {} bytes", st.max_body),
            )
        }),
    }
}

/// Send a command and await its answer.
async fn call(st: &AppState, cmd: Cmd) -> Result<Out, ApiError> {
    send(st, cmd)?
        .await
        .map_err(|_| ApiError::new(503, "shutting_down", "the model worker has stopped"))?
}

/// Queue `cmd` for the worker; the answer comes on the returned channel. Several jobs queued
/// before any answer is awaited are taken up together (a batched generate).
fn send(st: &AppState, cmd: Cmd) -> Result<oneshot::Receiver<Result<Out, ApiError>>, ApiError> {
    let tenant = current_tenant()?;
    let (tx, rx) = oneshot::channel();
    st.jobs
        .try_send(Job {
            cmd,
            tenant,
            reply: tx,
            enqueued: std::time::Instant::now(),
        })
        .map_err(|e| match e {
            std::sync::mpsc::TrySendError::Full(_) => {
                ApiError::new(503, "busy", "the server's queue is full; retry shortly")
            }
            std::sync::mpsc::TrySendError::Disconnected(_) => {
                ApiError::new(503, "shutting_down", "the model worker has stopped")
            }
        })?;
    Ok(rx)
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
// Shared request parts: samplers, token lists, limits

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SamplerBody {
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
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
        )
        .with_min_p(self.min_p.unwrap_or(0.0))
        .with_penalties(
            self.presence_penalty.unwrap_or(0.0),
            self.frequency_penalty.unwrap_or(0.0),
            self.repetition_penalty.unwrap_or(1.0),
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
