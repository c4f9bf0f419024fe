//! # flashrt-serve: an HTTP server for one model, small-batch, with sessions and capsules
//!
//! `flashrt serve` puts a model behind a local HTTP API (127.0.0.1 by default; one bearer
//! token, or tenants from a token file: [`tenants`]). Three layers:
//!
//! * [`http`]: axum routes. Handlers parse and validate requests, then talk to the worker over
//!   a bounded channel; they never touch model state.
//! * [`worker`]: one thread that owns the model, every session and the
//!   `CapsuleStore` ([`flashrt_runtime::store`]). Commands run one at a time, so
//!   concurrent requests on one session are serialized and cannot corrupt it.
//! * [`metrics`]: counters, gauges and a restore-latency histogram, read lock-free by
//!   `/metrics` and `/health`.
//!
//! Around them: [`text`] (tokenizer, chat template, streamed text), [`files`] (client-named
//! files opened as untrusted input), [`cli`] (model sources shared by every command, and
//! `serve`), and the accept loop in this file (header and body timeouts, a connection cap,
//! a bounded drain on SIGINT / SIGTERM: [`run_until_signal`]).
//!
//! ## Endpoints
//!
//! Every body is JSON; every error is `{"error": {"message", "type", "code"}}` with a 4xx
//! status for anything the client can fix (5xx only for server faults). Ids are 32 hex
//! digits (128 random bits). Token lists may be text instead when the server has a tokenizer.
//! Every object belongs to the tenant that made it; another tenant's id answers 404.
//!
//! | method, path | body | answer |
//! |---|---|---|
//! | `GET /health` (no auth) | | `{status, model, fingerprint, backend, vocab, max_seq, sessions, capsules{device,host,disk}}`; 503 while `status` is `warming` (start-up) or the worker stopped |
//! | `GET /metrics` | | Prometheus text |
//! | `GET /v1/models` | | OpenAI model list |
//! | `POST /v1/completions` | OpenAI: `model?`, `prompt` (text or ids), `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `stop_token_ids`, `ignore_eos`, `stream` (unimplemented OpenAI parameters: 400 naming them) | OpenAI `text_completion` (+ `token_ids`), SSE chunks when streaming |
//! | `POST /v1/chat/completions` | OpenAI: `messages`, `tools`, `chat_template_kwargs` (rendered by the model's chat template; without a tokenizer, contents as ids) | OpenAI `chat.completion` / chunks |
//! | `POST /v1/sessions` | `{tokens?, capsule?, sampler?{temperature,top_k,top_p,seed}, reuse?=true}` | `{session, pos, reused_tokens, from_capsule}` |
//! | `GET /v1/sessions` | | `{sessions: [{session, pos}]}` |
//! | `GET /v1/sessions/{id}` | | `{session, pos, tokens, sampler, counters}` |
//! | `DELETE /v1/sessions/{id}` | | `{deleted}` |
//! | `POST /v1/sessions/{id}/append` | `{tokens}` | `{session, pos}` |
//! | `POST /v1/sessions/{id}/generate` | `{max_tokens?=16, sampler?, stop_token_ids?, ignore_eos?, stream?}` | `{session, tokens, finish_reason, pos}`; SSE `{token}` … `{done, result}` |
//! | `POST /v1/sessions/{id}/snapshot` | `{persist?, label?}` | `{capsule, pos, tiers, bytes{device,host,disk}, base, label, origin, persisted}` (persist that does not fit: 507) |
//! | `POST /v1/sessions/{id}/restore` | `{capsule}` | `{session, capsule, pos, from_tier, restore_us}` |
//! | `POST /v1/sessions/{id}/rollback` | `{capsule}` or `{pos}` (a stored boundary of this history) | `{session, capsule, pos}` |
//! | `POST /v1/sessions/{id}/fork` | | `{session, forked_from, pos}` (a new, independent session) |
//! | `GET /v1/capsules` | | `{capsules: [...]}` |
//! | `GET /v1/capsules/{id}` | | `{capsule, pos, tiers, bytes, base, label, tokens}` |
//! | `DELETE /v1/capsules/{id}` | | `{deleted}` |
//! | `POST /v1/capsules/{id}/persist` | | the capsule, now pinned in a file of the store directory (507 when the disk budget cannot hold it) |
//! | `POST /v1/capsules/{id}/export` | `{file, overwrite?=false}` (a plain name in the tenant's files directory) | `{capsule, file, bytes}` (409 `file_exists` without `overwrite`) |
//! | `GET /v1/capsules/{id}/file` | | the standalone capsule file (`application/octet-stream`) |
//! | `POST /v1/capsules/import` | `{file}` (a regular file, not a link), or the file itself as `application/octet-stream` | the new capsule (`origin: imported`: restorable by id, never reused automatically) |
//!
//! OpenAI completions reuse stored capsules automatically: the prompt's longest stored prefix
//! among the tenant's own computed capsules (at any position) is restored instead of
//! prefilled, and the prompt boundary and the end of each completion are stored (label
//! `auto`) for the next request.

pub mod cli;
pub mod files;
pub mod http;
pub mod memory;
pub mod metrics;
pub mod speculate;
pub mod tenants;
pub mod text;
pub mod worker;

use flashrt_runtime::{CapsuleStore, Model, StoreConfig};
use metrics::Metrics;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use text::{GenerationDefaults, Text};
use worker::{Cmd, Job, Worker, WorkerConfig};

/// Everything a server needs besides the model.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Where to listen; port 0 picks a free port ([`Server::addr`] says which).
    pub bind: SocketAddr,
    /// Required as `Authorization: Bearer <token>` on everything but `/health` (the default
    /// tenant's token; see [`tenants`]).
    pub token: Option<String>,
    /// A token file naming tenants (excludes `token`; see [`tenants`]).
    pub tokens_file: Option<PathBuf>,
    /// Let automatic prefix reuse restore trusted capsules of other tenants.
    pub share_prefix_cache: bool,
    /// How long a client may take to send a request's headers (and an idle keep-alive
    /// connection may stay open).
    pub header_timeout: std::time::Duration,
    /// How long a client may take to send a request's body.
    pub body_timeout: std::time::Duration,
    /// Connections open at once; more are closed as they arrive.
    pub max_connections: usize,
    /// At shutdown: how long in-flight requests may go on before they are cancelled.
    pub grace: std::time::Duration,
    pub store: StoreConfig,
    /// Where export/import by file name go; defaults to `<store dir>/files`.
    pub files_dir: Option<PathBuf>,
    pub max_sessions: usize,
    /// Jobs waiting for the worker before requests are refused with 503.
    pub queue: usize,
    /// Completions store capsules at the prompt boundary and after generation.
    pub auto_cache: bool,
    /// Stop tokens applied unless a request sets `ignore_eos`.
    pub eos: Vec<u32>,
    /// Most MTP drafts per round of greedy completions on a model with an MTP head (0: off);
    /// the server shrinks it, down to plain decoding, where drafting costs more than it saves.
    pub speculative: usize,
    /// The checkpoint's sampling defaults for what a request leaves out.
    pub defaults: GenerationDefaults,
    /// Before the first request, run every plan (and the batched decode steps) on the session
    /// the server serves from, so no client pays for a graph capture. `None`: where the
    /// backend runs plans as captured graphs (CUDA).
    pub warm: Option<bool>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 8077)),
            token: None,
            tokens_file: None,
            share_prefix_cache: false,
            header_timeout: std::time::Duration::from_secs(10),
            body_timeout: std::time::Duration::from_secs(60),
            max_connections: 1024,
            grace: std::time::Duration::from_secs(10),
            // The worker steps every stream: capsules leaving the device tier are copied and
            // hashed on a thread of their own instead of stalling it.
            store: StoreConfig {
                background: true,
                ..StoreConfig::default()
            },
            files_dir: None,
            max_sessions: 64,
            queue: 1024,
            auto_cache: true,
            eos: Vec::new(),
            defaults: GenerationDefaults::default(),
            speculative: 0,
            warm: None,
        }
    }
}

impl ServeConfig {
    /// Size `max_sessions` and the store's device tier to the device memory the model leaves
    /// free ([`memory::MemoryPlan`]), keeping what the operator set (`Some`). Returns the plan
    /// (to log), or `None` where the backend does not report free memory and the defaults
    /// stay.
    pub fn fit_memory(
        &mut self,
        model: &Model,
        max_sessions: Option<usize>,
        budget_device: Option<u64>,
    ) -> Result<Option<memory::MemoryPlan>, String> {
        let plan = memory::MemoryPlan::of(model, max_sessions, budget_device)?;
        if let Some(p) = &plan {
            self.max_sessions = p.max_sessions;
            self.store.budget_device = p.budget_device;
            self.store.slack_device = p.slack_device;
        }
        Ok(plan)
    }
}

/// On a device whose steps cost their plan's full rows (CUDA), time every decode, verify and
/// prefill plan once at start-up so suffixes are chunked by measured cost
/// ([`Model::calibrate_chunking`]; this also captures every plan's graph before the first
/// client). Elsewhere, or if timing fails, the derived costs stay (they chunk correctly, only
/// less well). Returns the table in use.
pub fn calibrate_chunking(model: &Model) -> flashrt_runtime::ChunkCosts {
    if !model.pads_rows() {
        return model.chunk_costs();
    }
    let start = std::time::Instant::now();
    match model.calibrate_chunking(3, &mut |line| tracing::debug!("chunk costs: {line}")) {
        Ok(costs) => {
            tracing::info!(
                "chunk planner: {costs} (measured in {:.1} s)",
                start.elapsed().as_secs_f64()
            );
            costs
        }
        Err(e) => {
            tracing::warn!("timing the plans failed ({e}); the chunk planner keeps derived costs");
            model.chunk_costs()
        }
    }
}

/// A running server: an HTTP thread (tokio, current-thread) and the model worker thread.
pub struct Server {
    addr: SocketAddr,
    jobs: std::sync::mpsc::SyncSender<Job>,
    stop_http: Option<tokio::sync::oneshot::Sender<()>>,
    http: Option<std::thread::JoinHandle<()>>,
    worker: Option<std::thread::JoinHandle<()>>,
    metrics: Arc<Metrics>,
}

impl Server {
    /// Open the store (loading its directory), start the worker and the HTTP listener.
    pub fn start(model: Model, text: Option<Text>, cfg: ServeConfig) -> Result<Server, String> {
        if let Some(t) = &text {
            tracing::debug!(
                "prompt tokenization reuse (a prompt extending one its tenant sent before): {}",
                if t.prefixes.enabled() {
                    "on"
                } else {
                    "off (FLASHRT_PROMPT_REUSE=0, or this tokenizer does not split at its added tokens)"
                }
            );
        }
        let tenants = tenants::Tenants::new(cfg.token.clone(), cfg.tokens_file.as_deref())?;
        let mut store_cfg = cfg.store.clone();
        if store_cfg.background {
            // A capsule stored while the previous one is still being copied down does not wait
            // for that copy (hundreds of milliseconds for a 16k-token capsule, felt by every
            // stream): its tier holds up to its slack past its budget meanwhile (on a GPU the
            // memory plan's one capsule, counted in the plan; elsewhere, and at least, an
            // eighth of the budget).
            store_cfg.slack_device = store_cfg.slack_device.max(store_cfg.budget_device / 8);
            store_cfg.slack_host = store_cfg.slack_host.max(store_cfg.budget_host / 8);
        }
        let store = CapsuleStore::open(model.clone(), store_cfg)
            .map_err(|e| format!("opening the capsule store: {e}"))?;
        let files_dir = cfg
            .files_dir
            .clone()
            .or_else(|| cfg.store.dir.as_ref().map(|d| d.join("files")));
        if let Some(d) = &files_dir {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        let listener = std::net::TcpListener::bind(cfg.bind)
            .map_err(|e| format!("cannot listen on {}: {e}", cfg.bind))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;

        let metrics = Arc::new(Metrics::default());
        let text = text.map(Arc::new);
        let (jobs, rx) = std::sync::mpsc::sync_channel(cfg.queue.max(1));
        let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worker = Worker::new(
            model.clone(),
            store,
            metrics.clone(),
            text.clone(),
            WorkerConfig {
                max_sessions: cfg.max_sessions,
                auto_cache: cfg.auto_cache,
                share_prefix_cache: cfg.share_prefix_cache,
                cancel: cancel.clone(),
                speculative: cfg.speculative,
                warm: cfg.warm,
            },
        );
        metrics
            .worker_alive
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // Set before the worker starts, so no request sees "ok" before warming is done.
        metrics.warming.store(
            cfg.warm.unwrap_or_else(|| model.pads_rows()),
            std::sync::atomic::Ordering::SeqCst,
        );
        let worker = std::thread::Builder::new()
            .name("flashrt-worker".into())
            .spawn(move || worker.run(rx))
            .map_err(|e| e.to_string())?;

        let max_file = flashrt_runtime::capsule_file::max_file_len(model.compiled());
        let state = Arc::new(http::AppState {
            jobs: jobs.clone(),
            metrics: metrics.clone(),
            tenants,
            text,
            model_name: model.name().to_string(),
            fingerprint: model.fingerprint().to_string(),
            backend: model.backend_name(),
            vocab: model.vocab(),
            max_seq: model.max_seq(),
            eos: cfg.eos.clone(),
            defaults: cfg.defaults.clone(),
            files_dir,
            max_body: (max_file as usize).saturating_add(1 << 20).max(8 << 20),
            body_timeout: cfg.body_timeout,
            started: std::time::Instant::now(),
            next_id: AtomicU64::new(0),
        });
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let limits = Limits {
            header_timeout: cfg.header_timeout,
            max_connections: cfg.max_connections.max(1),
            grace: cfg.grace,
            metrics: metrics.clone(),
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let http = std::thread::Builder::new()
            .name("flashrt-http".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    let app = http::router(state);
                    accept_loop(listener, app, &limits, stop_rx, &cancel).await;
                });
            })
            .map_err(|e| e.to_string())?;
        ready_rx
            .recv()
            .map_err(|_| "the HTTP thread died while starting".to_string())??;
        Ok(Server {
            addr,
            jobs,
            stop_http: Some(stop_tx),
            http: Some(http),
            worker: Some(worker),
            metrics,
        })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Stop accepting requests, let the worker persist the store (when it has a directory),
    /// and wait for both threads.
    pub fn shutdown(mut self) -> Result<(), String> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), String> {
        if let Some(tx) = self.stop_http.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.http.take() {
            let _ = h.join();
        }
        let mut result = Ok(());
        if let Some(w) = self.worker.take() {
            let (tx, rx) = tokio::sync::oneshot::channel();
            if self
                .jobs
                .send(Job {
                    cmd: Cmd::Shutdown,
                    tenant: tenants::Tenant::default_tenant(),
                    reply: tx,
                    enqueued: std::time::Instant::now(),
                })
                .is_ok()
                && let Ok(Err(e)) = rx.blocking_recv()
            {
                result = Err(format!("persisting the capsule store: {}", e.message));
            }
            let _ = w.join();
        }
        result
    }
}

/// What the accept loop enforces.
struct Limits {
    header_timeout: std::time::Duration,
    max_connections: usize,
    grace: std::time::Duration,
    metrics: Arc<Metrics>,
}

/// Accept connections until `stop`, each served by hyper's HTTP/1 with a header read timeout
/// (which also closes idle keep-alive connections), at most `max_connections` at a time (more
/// are closed on arrival); then stop accepting, let in-flight requests finish within the
/// grace period, and cancel what is still running (generations stop at their next token).
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    limits: &Limits,
    mut stop: tokio::sync::oneshot::Receiver<()>,
    cancel: &std::sync::atomic::AtomicBool,
) {
    use std::sync::atomic::Ordering;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    loop {
        tokio::select! {
            _ = &mut stop => break,
            r = listener.accept() => {
                let Ok((stream, _)) = r else { continue };
                let Ok(permit) = open.clone().try_acquire_owned() else {
                    limits.metrics.refused_connections.fetch_add(1, Ordering::Relaxed);
                    drop(stream);
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let svc = hyper_util::service::TowerToHyperService::new(app.clone());
                let mut b = hyper::server::conn::http1::Builder::new();
                b.timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .keep_alive(true);
                let conn = graceful.watch(b.serve_connection(hyper_util::rt::TokioIo::new(stream), svc));
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(permit);
                });
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(limits.grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            "shutdown: requests still running after the {:.0} s grace period were cancelled",
            limits.grace.as_secs_f64()
        );
        cancel.store(true, Ordering::SeqCst);
    }
}

/// Serve until SIGINT or SIGTERM, then drain (see [`ServeConfig::grace`]), persist the store
/// and return. A second signal during that exits the process at once with status 130 (capsule
/// files are written atomically, so whatever is on disk is whole).
pub fn run_until_signal(server: Server) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(stop_signal());
    tracing::info!("stopping: draining requests, then persisting the capsule store");
    std::thread::Builder::new()
        .name("flashrt-second-signal".into())
        .spawn(move || {
            if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                rt.block_on(stop_signal());
                tracing::warn!("second signal: exiting now");
                std::process::exit(130);
            }
        })
        .map_err(|e| e.to_string())?;
    server.shutdown()
}

/// Wait for SIGINT (Ctrl-C) or SIGTERM (systemd, `docker stop`, Kubernetes).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}
