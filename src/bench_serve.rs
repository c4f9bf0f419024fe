//! `flashrt bench --serve`: the served path as a client sees it, in the same process and run as
//! the engine figures. Starts `flashrt serve`'s server on the loaded model (loopback, a free
//! port) and drives it through HTTP the way a client does: streamed `/v1/completions`, every
//! timestamp taken when a token event's bytes arrive on the socket.
//!
//! For each prefix length: the prefix is stored by the automatic prefix cache (one completion
//! of it), then for each suffix length n the prefix plus n fresh tokens with `max_tokens: 1`
//! (a warm-up, then `runs` runs, each with new tokens), the time from sending the request to
//! the first token event and the `cached_tokens` the server reports; an exact repeat of the
//! stored prompt; and streamed decode, greedy and at temperature 0.7 / top-p 0.9 (and, for a
//! model with an MTP head, greedy with speculative rounds, checked against the plain greedy
//! tokens): the median and mean gap between token events.
//!
//! The client is a few lines over `std::net::TcpStream` (HTTP/1.1, chunked responses, SSE
//! events), so nothing between the socket and the clock buffers a token.

use crate::runtime::Model;
use serde::Serialize;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// What to measure.
pub struct ServeBenchOptions {
    /// Stored prefix lengths.
    pub prefixes: Vec<usize>,
    /// Fresh tokens appended to the stored prefix.
    pub suffixes: Vec<usize>,
    /// Timed runs per suffix length (after one warm-up).
    pub runs: usize,
    /// Streamed tokens per decode measurement.
    pub decode_tokens: usize,
    /// Clients streaming greedy completions at once (0: skip), each `decode_tokens` long.
    pub clients: usize,
    /// A fresh prompt of this many tokens sent while the clients stream (0: skip).
    pub newcomer: usize,
    /// One completion with `n` = this many choices at temperature 0.8 with a seed, against
    /// the same number of single completions seeded `seed + i` (0: skip).
    pub choices: usize,
    /// Chat turns through `/v1/chat/completions` with this folder's `tokenizer.json` and chat
    /// template, on a server of their own (`None`: skip).
    pub chat: Option<std::path::PathBuf>,
    /// Move capsules down the store's tiers on the worker thread (`flashrt serve
    /// --demote-on-worker`), to measure what background demotion saves the streams.
    pub demote_on_worker: bool,
    /// The device tier's byte budget (`flashrt serve --budget-device`; `None`: what the server
    /// would choose), e.g. small enough that the run's capsules move down the tiers.
    pub budget_device: Option<u64>,
    /// The host tier's byte budget (`flashrt serve --budget-host`; `None`: the server's
    /// default), e.g. small enough that capsules leave host memory.
    pub budget_host: Option<u64>,
}

/// A conversation of about `prefix` tokens stored, then one more turn, through
/// `/v1/chat/completions`: what a chat or agent client sees, templating and tokenizing
/// included (the server's `parse_ms`).
#[derive(Serialize)]
pub struct ChatResult {
    pub prefix: usize,
    /// The stored conversation's prompt tokens.
    pub stored_tokens: usize,
    /// Per run: prompt tokens, the cached part, time to the first streamed token, and the
    /// server's timings.
    pub prompt_tokens: Vec<usize>,
    pub cached_tokens: Vec<usize>,
    pub ttft_ms: Vec<f64>,
    pub server: Vec<Value>,
}

#[derive(Serialize)]
pub struct SuffixResult {
    pub suffix: usize,
    /// Time to the first streamed token, per run.
    pub ttft_ms: Vec<f64>,
    /// `cached_tokens` of each run (the stored prefix when reuse worked).
    pub cached_tokens: Vec<usize>,
    /// The steps the chunk planner runs the suffix as (`plan[rows]`).
    pub steps: Vec<String>,
    /// The server's `timings` of each run (where the time went inside it: queue, admission
    /// with the prefix restore, prefill, first token).
    pub server: Vec<Value>,
}

#[derive(Serialize)]
pub struct DecodeResult {
    pub sampler: String,
    /// Median gap between consecutive token events.
    pub median_gap_ms: f64,
    /// (last event - first event) / (tokens - 1): what bursts of speculative rounds average to.
    pub mean_gap_ms: f64,
    pub tokens: usize,
    /// Speculative runs: whether the tokens equal the plain greedy run's.
    pub same_as_greedy: Option<bool>,
    /// The server's summary of the speculative rounds (null when plain).
    pub speculative: Value,
}

#[derive(Serialize)]
pub struct PrefixResult {
    pub prefix: usize,
    pub suffixes: Vec<SuffixResult>,
    /// An exact repeat of the stored prompt (nothing to prefill).
    pub repeat_ttft_ms: Vec<f64>,
    /// The server's `timings` of each repeat.
    pub repeat_server: Vec<Value>,
    pub decode: Vec<DecodeResult>,
}

#[derive(Serialize)]
pub struct ServeReport {
    /// The chunk planner's costs the server used.
    pub chunk_costs: String,
    pub prefixes: Vec<PrefixResult>,
    /// Several clients at once (`clients` > 0).
    pub concurrent: Option<ConcurrentResult>,
    /// OpenAI `n` (`choices` > 0).
    pub choices: Option<ChoicesResult>,
    /// Chat turns (`chat` set).
    pub chat: Vec<ChatResult>,
    /// What the capsule store did meanwhile (the main server's, at its shutdown).
    pub store: StoreSummary,
}

/// The capsule store's moves down the tiers during the run.
#[derive(Serialize)]
pub struct StoreSummary {
    /// Demotions ran on a thread of their own (not `--serve-demote-on-worker`).
    pub background: bool,
    /// Capsules moved out of the device and host tiers.
    pub evictions: [u64; 2],
    /// Of those, moved off the worker thread, and their mean time there.
    pub background_moves: u64,
    pub background_mean_ms: f64,
    /// Automatic capsules stored (the worker's time: snapshot, insertion, and on the worker's
    /// path whatever demotion that causes): count and mean.
    pub auto_stores: u64,
    pub auto_store_mean_ms: f64,
    /// Bytes of capsules read from the device into reused host buffers (host_pool.rs).
    pub pool_reused_bytes: u64,
}

/// One completion with `n` choices against `n` separately seeded single completions.
#[derive(Serialize)]
pub struct ChoicesResult {
    pub n: usize,
    pub tokens_per_choice: usize,
    pub seed: u64,
    /// From sending the `n` request to its last token, and the single completions' times
    /// (each from sending to its last token) added up.
    pub together_ms: f64,
    pub singles_ms: f64,
    /// Choice i's tokens equal the single completion seeded `seed + i`, for every i.
    pub same_as_singles: bool,
    /// No two choices are the same token sequence.
    pub distinct: bool,
}

impl ChoicesResult {
    pub fn summary(&self) -> String {
        format!(
            "n = {} at temperature 0.8, seed {}: {} tokens per choice in {:.1} ms (the {} single completions one after another: {:.1} ms, {:.2}x); choices {} the single completions seeded {}..{}, {}",
            self.n,
            self.seed,
            self.tokens_per_choice,
            self.together_ms,
            self.n,
            self.singles_ms,
            self.singles_ms / self.together_ms,
            if self.same_as_singles {
                "equal"
            } else {
                "DIFFER from"
            },
            self.seed,
            self.seed + self.n as u64 - 1,
            if self.distinct {
                "all distinct"
            } else {
                "NOT all distinct"
            }
        )
    }
}

/// Clients streaming at once against each alone (the scheduler of `flashrt-serve`).
#[derive(Serialize)]
pub struct ConcurrentResult {
    pub clients: usize,
    pub tokens_per_client: usize,
    /// One client alone: its tokens over the time from sending to its last token (mean of
    /// the clients' solo runs).
    pub alone_tokens_per_s: f64,
    /// All at once: every token over the time from the first send to the last token.
    pub aggregate_tokens_per_s: f64,
    /// Median and p99 of the gaps between consecutive tokens of a client, all clients.
    pub median_gap_ms: f64,
    pub p99_gap_ms: f64,
    /// The median gap of the solo runs.
    pub alone_median_gap_ms: f64,
    /// Every client's tokens equal its solo run's.
    pub same_as_alone: bool,
    pub newcomer: Option<NewcomerResult>,
}

impl ConcurrentResult {
    /// One line: together against alone, the gaps, whether the tokens agree.
    pub fn summary(&self) -> String {
        format!(
            "{} clients at once, {} tokens each: {:.1} tokens/s together against {:.1} alone ({:.2}x); gaps median {:.2} ms, p99 {:.2} ms (alone {:.2} ms); tokens {} their solo runs",
            self.clients,
            self.tokens_per_client,
            self.aggregate_tokens_per_s,
            self.alone_tokens_per_s,
            self.aggregate_tokens_per_s / self.alone_tokens_per_s,
            self.median_gap_ms,
            self.p99_gap_ms,
            self.alone_median_gap_ms,
            if self.same_as_alone {
                "equal"
            } else {
                "DIFFER from"
            }
        )
    }
}

/// A long fresh prompt sent while the clients stream.
#[derive(Serialize)]
pub struct NewcomerResult {
    pub prompt_tokens: usize,
    /// Its time to first token with the clients streaming, and on the idle server.
    pub ttft_ms: f64,
    pub idle_ttft_ms: f64,
    /// The clients' gaps between sending it and its first token.
    pub p99_gap_during_ms: f64,
    pub max_gap_during_ms: f64,
    pub gaps_during: usize,
    /// The clients' gaps after its first token, to their end: what storing its capsule (and
    /// the demotions that causes) costs them.
    pub p99_gap_after_ms: f64,
    pub max_gap_after_ms: f64,
    pub gaps_after: usize,
}

/// One streamed completion: the seconds from sending to each token event, and the usage's
/// `cached_tokens`.
/// What a streamed completion delivered: per token, the time its event arrived (seconds
/// from sending the request); the cached prompt tokens; the token ids; the `speculative`
/// summary of the last chunk (null when the request did not speculate).
struct Streamed {
    /// When the request was sent; `times` count from here.
    start: Instant,
    times: Vec<f64>,
    cached: usize,
    tokens: Vec<u32>,
    /// The tokens by choice index (`n` > 1 streams its choices interleaved).
    by_choice: Vec<Vec<u32>>,
    speculative: Value,
    /// The server's `timings` (the last chunk's).
    timings: Value,
    /// `usage.prompt_tokens`.
    prompt: usize,
}

fn stream_completion(addr: SocketAddr, body: &Value) -> Result<Streamed, String> {
    stream_to(addr, "/v1/completions", body)
}

fn stream_to(addr: SocketAddr, path: &str, body: &Value) -> Result<Streamed, String> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let payload = body.to_string();
    let mut sock = TcpStream::connect_timeout(&addr, Duration::from_secs(10))
        .map_err(|e| format!("connect {addr}: {e}"))?;
    sock.set_nodelay(true).ok();
    sock.set_read_timeout(Some(Duration::from_secs(600))).ok();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    );
    let t0 = Instant::now();
    sock.write_all(req.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut r = BufReader::new(sock);
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    let status = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut chunked = false;
    loop {
        line.clear();
        r.read_line(&mut line).map_err(|e| e.to_string())?;
        let h = line.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':')
            && n.eq_ignore_ascii_case("transfer-encoding")
            && v.to_ascii_lowercase().contains("chunked")
        {
            chunked = true;
        }
    }
    if status != "200" {
        let mut rest = String::new();
        let _ = r.read_to_string(&mut rest);
        return Err(format!(
            "HTTP {status}: {}",
            rest.chars().take(300).collect::<String>()
        ));
    }
    // The body as it arrives: de-chunked bytes, split into SSE events at blank lines.
    let mut got = Streamed {
        start: t0,
        times: Vec::new(),
        cached: 0,
        tokens: Vec::new(),
        by_choice: Vec::new(),
        speculative: Value::Null,
        timings: Value::Null,
        prompt: 0,
    };
    let mut pending = Vec::<u8>::new();
    let mut on_bytes = |bytes: &[u8], got: &mut Streamed| -> bool {
        let now = t0.elapsed().as_secs_f64();
        pending.extend_from_slice(bytes);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                let data = data.trim();
                if data == "[DONE]" {
                    return true;
                }
                let Ok(v) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                if let Some(c) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                    got.cached = c as usize;
                }
                if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
                    got.prompt = p as usize;
                }
                if !v["speculative"].is_null() {
                    got.speculative = v["speculative"].clone();
                }
                if !v["timings"].is_null() {
                    got.timings = v["timings"].clone();
                }
                for c in v["choices"].as_array().into_iter().flatten() {
                    // Completions' chunks carry `token_ids`, chat chunks `delta.token_ids`.
                    let ids: Vec<u32> = c["token_ids"]
                        .as_array()
                        .or_else(|| c["delta"]["token_ids"].as_array())
                        .map(|a| {
                            a.iter()
                                .filter_map(|x| x.as_u64())
                                .map(|x| x as u32)
                                .collect()
                        })
                        .unwrap_or_default();
                    let i = c["index"].as_u64().unwrap_or(0) as usize;
                    if got.by_choice.len() <= i {
                        got.by_choice.resize(i + 1, Vec::new());
                    }
                    got.by_choice[i].extend(&ids);
                    got.times.extend(std::iter::repeat_n(now, ids.len()));
                    got.tokens.extend(ids);
                }
            }
        }
        false
    };
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line).map_err(|e| e.to_string())?;
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                .map_err(|_| format!("bad chunk size line {line:?}"))?;
            if size == 0 {
                break;
            }
            let mut buf = vec![0u8; size + 2];
            r.read_exact(&mut buf).map_err(|e| e.to_string())?;
            if on_bytes(&buf[..size], &mut got) {
                break;
            }
        }
    } else {
        let mut buf = [0u8; 4096];
        loop {
            let n = r.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 || on_bytes(&buf[..n], &mut got) {
                break;
            }
        }
    }
    Ok(got)
}

/// The `q` quantile (0..=1) of `v`, nearest rank.
fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return 0.0;
    }
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// Gaps between consecutive tokens of a stream (ms), with the absolute time of each gap's end.
fn gaps(st: &Streamed) -> Vec<(Instant, f64)> {
    st.times
        .windows(2)
        .map(|w| {
            (
                st.start + Duration::from_secs_f64(w[1]),
                (w[1] - w[0]) * 1e3,
            )
        })
        .collect()
}

/// `opts.clients` clients streaming greedy completions of fresh 64-token prompts at once,
/// against each alone; then (`opts.newcomer`) a fresh long prompt sent while they stream.
fn concurrent(
    addr: SocketAddr,
    opts: &ServeBenchOptions,
    fresh: &mut dyn FnMut(usize) -> Vec<u32>,
) -> Result<ConcurrentResult, String> {
    let n = opts.decode_tokens.max(2);
    let body = |prompt: &[u32], max_tokens: usize| json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true});
    let prompts: Vec<Vec<u32>> = (0..opts.clients).map(|_| fresh(64)).collect();
    // Store every prompt first, so the solo and the joint runs both start from a restore.
    for p in &prompts {
        stream_completion(addr, &body(p, 1))?;
    }
    let mut alone = Vec::new();
    for p in &prompts {
        alone.push(stream_completion(addr, &body(p, n))?);
    }
    let solo_rate = alone
        .iter()
        .map(|a| a.tokens.len() as f64 / a.times.last().copied().unwrap_or(1.0))
        .sum::<f64>()
        / alone.len() as f64;
    let solo_gaps: Vec<f64> = alone.iter().flat_map(gaps).map(|g| g.1).collect();
    let together = run_clients(addr, &prompts, &|p| body(p, n))?;
    let first_send = together.iter().map(|s| s.start).min().ok_or("no clients")?;
    let last = together
        .iter()
        .filter_map(|s| {
            s.times
                .last()
                .map(|t| s.start + Duration::from_secs_f64(*t))
        })
        .max()
        .ok_or("no tokens")?;
    let total: usize = together.iter().map(|s| s.tokens.len()).sum();
    let all_gaps: Vec<f64> = together.iter().flat_map(gaps).map(|g| g.1).collect();
    let same = together
        .iter()
        .zip(&alone)
        .all(|(t, a)| t.tokens == a.tokens);
    let r = ConcurrentResult {
        clients: opts.clients,
        tokens_per_client: n,
        alone_tokens_per_s: solo_rate,
        aggregate_tokens_per_s: total as f64 / (last - first_send).as_secs_f64(),
        median_gap_ms: median(&all_gaps),
        p99_gap_ms: quantile(&all_gaps, 0.99),
        alone_median_gap_ms: median(&solo_gaps),
        same_as_alone: same,
        newcomer: if opts.newcomer > 0 {
            Some(newcomer(addr, opts, &prompts, fresh)?)
        } else {
            None
        },
    };
    eprintln!("[bench --serve] {}", r.summary());
    Ok(r)
}

/// `n` choices of one sampled completion of `prompt` (stored by the prefix runs) against `n`
/// single completions seeded `seed + i`, one after another.
fn choices(
    addr: SocketAddr,
    n: usize,
    prompt: &[u32],
    tokens: usize,
) -> Result<ChoicesResult, String> {
    const SEED: u64 = 7;
    let body = |n: usize, seed: u64| json!({"prompt": prompt, "max_tokens": tokens, "temperature": 0.8, "seed": seed, "n": n, "ignore_eos": true});
    let last_ms = |s: &Streamed| s.times.last().copied().unwrap_or(0.0) * 1e3;
    // A warm-up, then the timed request.
    stream_completion(addr, &body(n, SEED))?;
    let together = stream_completion(addr, &body(n, SEED))?;
    let mut singles = Vec::new();
    for i in 0..n {
        singles.push(stream_completion(addr, &body(1, SEED + i as u64))?);
    }
    let got = &together.by_choice;
    let same = got.len() == n && singles.iter().zip(got).all(|(s, c)| s.tokens == *c);
    let distinct = (0..got.len()).all(|i| (i + 1..got.len()).all(|j| got[i] != got[j]));
    let r = ChoicesResult {
        n,
        tokens_per_choice: got.iter().map(Vec::len).min().unwrap_or(0),
        seed: SEED,
        together_ms: last_ms(&together),
        singles_ms: singles.iter().map(last_ms).sum(),
        same_as_singles: same,
        distinct,
    };
    eprintln!("[bench --serve] {}", r.summary());
    Ok(r)
}

/// Stream one completion per prompt, all at once (a thread each).
fn run_clients(
    addr: SocketAddr,
    prompts: &[Vec<u32>],
    body: &dyn Fn(&[u32]) -> Value,
) -> Result<Vec<Streamed>, String> {
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let b = body(p);
            std::thread::spawn(move || stream_completion(addr, &b))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| {
            h.join()
                .map_err(|_| "a client thread panicked".to_string())?
        })
        .collect()
}

/// A fresh prompt of `opts.newcomer` tokens: its TTFT on the idle server, then while (at
/// most 4 of) the clients stream (sent once every client has its first token), with the
/// clients' gaps meanwhile.
fn newcomer(
    addr: SocketAddr,
    opts: &ServeBenchOptions,
    prompts: &[Vec<u32>],
    fresh: &mut dyn FnMut(usize) -> Vec<u32>,
) -> Result<NewcomerResult, String> {
    let len = opts.newcomer;
    let one = |p: &[u32]| json!({"prompt": p, "max_tokens": 1, "temperature": 0});
    let idle = stream_completion(addr, &one(&fresh(len)))?;
    let idle_ttft = idle.times.first().copied().unwrap_or(0.0) * 1e3;
    // At most 4 clients (issue 15's case), streaming long enough to cover the newcomer's
    // prefill (a token each per prefill slice of about 40 ms, and some) and `decode_tokens`
    // more after it: storing its capsule comes after its first token.
    let prompts = &prompts[..prompts.len().min(4)];
    let long = 2 * opts.decode_tokens.max(2) + (idle_ttft / 40.0) as usize + 16;
    let body = move |p: &[u32]| json!({"prompt": p, "max_tokens": long, "temperature": 0, "ignore_eos": true});
    let clients = {
        let prompts = prompts.to_vec();
        std::thread::spawn(move || run_clients(addr, &prompts, &body))
    };
    // Started: give every client time for its first token (their prompts are stored).
    std::thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    let nc = stream_completion(addr, &one(&fresh(len)))?;
    let first = nc.start + Duration::from_secs_f64(nc.times.first().copied().unwrap_or(0.0));
    let streams = clients
        .join()
        .map_err(|_| "the clients' thread panicked".to_string())??;
    // The clients' gaps ending in (from, to]: while the newcomer waits, and after its first.
    let cut = first + Duration::from_millis(1);
    let gaps_in = |from: Instant, to: Option<Instant>| -> Vec<f64> {
        streams
            .iter()
            .flat_map(gaps)
            .filter(|(end, _)| *end > from && to.is_none_or(|t| *end <= t))
            .map(|g| g.1)
            .collect()
    };
    let during = gaps_in(sent, Some(cut));
    let after = gaps_in(cut, None);
    let r = NewcomerResult {
        prompt_tokens: len,
        ttft_ms: (first - nc.start).as_secs_f64() * 1e3,
        idle_ttft_ms: idle_ttft,
        p99_gap_during_ms: quantile(&during, 0.99),
        max_gap_during_ms: during.iter().copied().fold(0.0, f64::max),
        gaps_during: during.len(),
        p99_gap_after_ms: quantile(&after, 0.99),
        max_gap_after_ms: after.iter().copied().fold(0.0, f64::max),
        gaps_after: after.len(),
    };
    eprintln!(
        "[bench --serve] a {len}-token prompt while {} clients stream: TTFT {:.1} ms (idle {:.1} ms, {:.2}x); the clients' gaps meanwhile p99 {:.1} ms, max {:.1} ms ({} gaps); after its first token p99 {:.1} ms, max {:.1} ms ({} gaps)",
        prompts.len(),
        r.ttft_ms,
        r.idle_ttft_ms,
        r.ttft_ms / r.idle_ttft_ms.max(1e-9),
        r.p99_gap_during_ms,
        r.max_gap_during_ms,
        r.gaps_during,
        r.p99_gap_after_ms,
        r.max_gap_after_ms,
        r.gaps_after
    );
    Ok(r)
}

/// The medians of the server's `timings` over runs: how long a request waited in the queue,
/// its admission (validation, prefix lookup, the stored prefix's restore), its prefill, and
/// its first token from its arrival in the queue (the rest of the client's TTFT is HTTP,
/// parsing and loopback).
fn server_phases(ts: &[Value]) -> String {
    let m = |k: &str| server_median(ts, k);
    if ts.iter().all(Value::is_null) {
        return "no server timings".into();
    }
    format!(
        "server: parse {:.2}, queued {:.2}, admit {:.2}, prefill {:.2}, first token {:.2} ms after arrival",
        m("parse_ms"),
        m("queued_ms"),
        m("admit_ms"),
        m("prefill_ms"),
        m("first_token_ms")
    )
}

/// The median over runs of one field of the server's `timings` (`first_token_ms`: from the
/// request's arrival in its queue).
fn server_median(ts: &[Value], key: &str) -> f64 {
    median(
        &ts.iter()
            .filter_map(|t| t[key].as_f64())
            .collect::<Vec<_>>(),
    )
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() { 0.0 } else { s[s.len() / 2] }
}

/// Words of the synthetic conversations (ASCII: any byte-level vocabulary encodes them).
const WORDS: &[&str] = &[
    "the",
    "robot",
    "arm",
    "moved",
    "to",
    "shelf",
    "picked",
    "up",
    "red",
    "cup",
    "and",
    "placed",
    "it",
    "on",
    "table",
    "then",
    "checked",
    "camera",
    "frame",
    "for",
    "obstacles",
    "before",
    "next",
    "grasp",
    "gripper",
    "opened",
    "slowly",
    "left",
    "right",
    "base",
];

/// `n` words, deterministic in `seed`.
fn sentence(seed: &mut u64, n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[(*seed >> 33) as usize % WORDS.len()]);
    }
    s.push('.');
    s
}

/// For each prefix length: a conversation of about that many tokens stored through
/// `/v1/chat/completions` (one token generated), then `runs` more turns on it (after a
/// warm-up), each the stored conversation, a short answer and a new user message: time to the
/// first streamed token, the prompt and cached tokens, and the server's timings (its
/// `parse_ms` holds the templating and tokenizing). On a server of its own with `dir`'s
/// tokenizer and chat template.
fn chat_turns(
    model: &Model,
    opts: &ServeBenchOptions,
    dir: &std::path::Path,
) -> Result<Vec<ChatResult>, String> {
    use flashrt_serve::text::{RenderOptions, Text};
    let load = || Text::load(&dir.join("tokenizer.json"), Some(dir));
    let text = load()?;
    let template = text
        .template
        .as_ref()
        .ok_or_else(|| format!("{}: no chat template", dir.display()))?;
    if text.tokenizer.vocab_size() > model.vocab() {
        return Err(format!(
            "{}: {} tokens, more than the model's vocabulary of {}",
            dir.display(),
            text.tokenizer.vocab_size(),
            model.vocab()
        ));
    }
    let cfg = flashrt_serve::ServeConfig {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..flashrt_serve::ServeConfig::default()
    };
    let server = flashrt_serve::Server::start(model.clone(), Some(load()?), cfg)?;
    let addr = server.addr();
    let count = |msgs: &[Value]| -> Result<usize, String> {
        let opts = RenderOptions {
            tools: None,
            add_generation_prompt: true,
            kwargs: Default::default(),
        };
        let p = template.render(&Value::Array(msgs.to_vec()), &opts)?;
        Ok(text.tokenizer.encode(&p)?.len())
    };
    let body = |m: &[Value]| json!({"messages": m, "max_tokens": 1, "temperature": 0});
    let mut seed = 77u64;
    let mut out = Vec::new();
    for &p in &opts.prefixes {
        if p + 512 >= model.max_seq() {
            eprintln!("[bench --serve] chat at {p} tokens does not fit max_seq: skipped");
            continue;
        }
        let mut msgs = vec![json!({"role": "system", "content": "You control a robot arm."})];
        while count(&msgs)? < p {
            let role = if msgs.len() % 2 == 1 {
                "user"
            } else {
                "assistant"
            };
            msgs.push(json!({"role": role, "content": sentence(&mut seed, 150)}));
        }
        let stored = stream_to(addr, "/v1/chat/completions", &body(&msgs))?;
        let mut r = ChatResult {
            prefix: p,
            stored_tokens: stored.prompt,
            prompt_tokens: Vec::new(),
            cached_tokens: Vec::new(),
            ttft_ms: Vec::new(),
            server: Vec::new(),
        };
        for run in 0..=opts.runs {
            let mut m = msgs.clone();
            m.push(json!({"role": "assistant", "content": "Done."}));
            m.push(json!({"role": "user", "content": sentence(&mut seed, 20)}));
            let got = stream_to(addr, "/v1/chat/completions", &body(&m))?;
            if run > 0 {
                r.ttft_ms
                    .push(got.times.first().copied().unwrap_or(0.0) * 1e3);
                r.prompt_tokens.push(got.prompt);
                r.cached_tokens.push(got.cached);
                r.server.push(got.timings);
            }
        }
        eprintln!(
            "[bench --serve] chat: a {}-token conversation plus a turn ({:?} prompt tokens, {:?} cached): TTFT {:.2} ms (median of {}); {}",
            r.stored_tokens,
            r.prompt_tokens,
            r.cached_tokens,
            median(&r.ttft_ms),
            opts.runs,
            server_phases(&r.server)
        );
        out.push(r);
    }
    server.shutdown()?;
    Ok(out)
}

/// Run the served-path measurements against a server started here on `model`.
pub fn run(model: &Model, opts: &ServeBenchOptions) -> Result<ServeReport, String> {
    let max_seq = model.max_seq();
    let vocab = model.vocab();
    let mut cfg = flashrt_serve::ServeConfig {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..flashrt_serve::ServeConfig::default()
    };
    cfg.store.background = !opts.demote_on_worker;
    // Chunk costs and the device tier as `flashrt serve` finds them.
    let costs = flashrt_serve::calibrate_chunking(model);
    eprintln!("[bench --serve] chunk planner: {costs}");
    if let Some(plan) = cfg.fit_memory(model, Some(opts.clients.max(4)), opts.budget_device)? {
        eprintln!("[bench --serve] device memory: {plan}");
    }
    if let Some(b) = opts.budget_device {
        cfg.store.budget_device = b;
    }
    if let Some(b) = opts.budget_host {
        cfg.store.budget_host = b;
    }
    let server = flashrt_serve::Server::start(model.clone(), None, cfg)?;
    let addr = server.addr();
    let mut seed = 1000u64;
    let mut fresh = |n: usize| {
        seed += 1;
        crate::demo::tokens(seed, n, vocab)
    };
    let mut prefixes = Vec::new();
    let mut first_prefix: Option<Vec<u32>> = None;
    for &p in &opts.prefixes {
        if p == 0 || p + 2 >= max_seq {
            eprintln!("[bench --serve] prefix {p} does not fit max_seq {max_seq}: skipped");
            continue;
        }
        let prefix = fresh(p);
        first_prefix.get_or_insert_with(|| prefix.clone());
        let greedy = |prompt: &[u32], max_tokens: usize| json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
        eprintln!("[bench --serve] prefix {p}: storing it");
        stream_completion(addr, &greedy(&prefix, 1))?;
        let mut suffixes = Vec::new();
        for &n in &opts.suffixes {
            if p + n + 1 >= max_seq {
                continue;
            }
            let mut r = SuffixResult {
                suffix: n,
                ttft_ms: Vec::new(),
                cached_tokens: Vec::new(),
                steps: model
                    .plan_chunks(n)
                    .iter()
                    .map(|(phase, rows)| format!("{}[{rows}]", phase.label()))
                    .collect(),
                server: Vec::new(),
            };
            for run in 0..=opts.runs {
                let mut prompt = prefix.clone();
                prompt.extend(fresh(n));
                let Streamed {
                    times,
                    cached,
                    timings,
                    ..
                } = stream_completion(addr, &greedy(&prompt, 1))?;
                let first = *times.first().ok_or("a completion streamed no token")?;
                if run > 0 {
                    r.ttft_ms.push(first * 1e3);
                    r.cached_tokens.push(cached);
                    r.server.push(timings);
                }
            }
            eprintln!(
                "[bench --serve] prefix {p} + {n}: TTFT {:.2} ms (median of {}), cached {:?}, steps {}; {}",
                median(&r.ttft_ms),
                opts.runs,
                r.cached_tokens,
                r.steps.join(" + "),
                server_phases(&r.server)
            );
            suffixes.push(r);
        }
        let mut repeat = Vec::new();
        let mut repeat_server = Vec::new();
        for _ in 0..opts.runs {
            let got = stream_completion(addr, &greedy(&prefix, 1))?;
            repeat.push(got.times.first().copied().unwrap_or(0.0) * 1e3);
            repeat_server.push(got.timings);
        }
        eprintln!(
            "[bench --serve] prefix {p}, exact repeat: TTFT {:.2} ms (median of {}); {}",
            median(&repeat),
            opts.runs,
            server_phases(&repeat_server)
        );
        let mut decode = Vec::new();
        let n = opts.decode_tokens.min(max_seq.saturating_sub(p + 2));
        let mut runs = vec![
            ("greedy".to_string(), greedy(&prefix, n)),
            (
                "temperature 0.7, top_p 0.9".to_string(),
                json!({"prompt": prefix, "max_tokens": n, "temperature": 0.7, "top_p": 0.9, "seed": 1}),
            ),
        ];
        // With an MTP head: greedy with speculative rounds, up to 4 drafts (the server adapts
        // the count to what it measures), against the plain greedy tokens.
        if model.ir().mtp.is_some() {
            let mut b = greedy(&prefix, n);
            b["speculative"] = json!(4);
            runs.push(("greedy, speculative (MTP, up to 4 drafts)".to_string(), b));
        }
        let mut plain_tokens = Vec::new();
        for (name, body) in runs {
            let got = stream_completion(addr, &body)?;
            let times = &got.times;
            let gaps: Vec<f64> = times.windows(2).map(|w| (w[1] - w[0]) * 1e3).collect();
            let mean = match (times.first(), times.last()) {
                (Some(a), Some(b)) if times.len() > 1 => (b - a) * 1e3 / (times.len() - 1) as f64,
                _ => 0.0,
            };
            if name == "greedy" {
                plain_tokens = got.tokens.clone();
            }
            let d = DecodeResult {
                median_gap_ms: median(&gaps),
                mean_gap_ms: mean,
                tokens: times.len(),
                same_as_greedy: (!got.speculative.is_null()).then(|| got.tokens == plain_tokens),
                speculative: got.speculative,
                sampler: name,
            };
            eprintln!(
                "[bench --serve] prefix {p}: streamed decode ({}) {:.2} ms per token (median gap), {:.2} ms (mean)",
                d.sampler, d.median_gap_ms, d.mean_gap_ms
            );
            decode.push(d);
        }
        prefixes.push(PrefixResult {
            prefix: p,
            suffixes,
            repeat_ttft_ms: repeat,
            repeat_server,
            decode,
        });
    }
    let concurrent = if opts.clients > 0 {
        Some(concurrent(addr, opts, &mut fresh)?)
    } else {
        None
    };
    let choices = match (opts.choices, &first_prefix) {
        (0, _) | (_, None) => None,
        (n, Some(prompt)) => Some(choices(addr, n, prompt, opts.decode_tokens.max(2))?),
    };
    let store = store_summary(&server, !opts.demote_on_worker);
    server.shutdown()?;
    let chat = match &opts.chat {
        Some(dir) => chat_turns(model, opts, dir)?,
        None => Vec::new(),
    };
    Ok(ServeReport {
        chunk_costs: costs.to_string(),
        prefixes,
        concurrent,
        choices,
        chat,
        store,
    })
}

fn store_summary(server: &flashrt_serve::Server, background: bool) -> StoreSummary {
    use std::sync::atomic::Ordering::Relaxed;
    let m = server.metrics();
    let moves = m.background_demotions.load(Relaxed) + m.background_spills.load(Relaxed);
    let (n, sum) = m.auto_store.count_sum();
    StoreSummary {
        background,
        evictions: [m.evictions[0].load(Relaxed), m.evictions[1].load(Relaxed)],
        background_moves: moves,
        background_mean_ms: if moves > 0 {
            m.background_seconds_micros.load(Relaxed) as f64 / 1e3 / moves as f64
        } else {
            0.0
        },
        auto_stores: n,
        auto_store_mean_ms: if n > 0 { sum * 1e3 / n as f64 } else { 0.0 },
        pool_reused_bytes: m.pool_reused_bytes.load(Relaxed),
    }
}

/// The report as a table.
pub fn render(r: &ServeReport) -> String {
    let mut o = String::from("served path (HTTP, streaming /v1/completions, loopback)\n");
    for p in &r.prefixes {
        o += &format!(
            "  stored prefix {} tokens: time to first streamed token\n  {:>8} {:>12} {:>28} {:>14}\n",
            p.prefix, "suffix", "median", "runs (ms), cached tokens", "in the server"
        );
        for s in &p.suffixes {
            let runs: Vec<String> = s.ttft_ms.iter().map(|t| format!("{t:.2}")).collect();
            let cached = s.cached_tokens.first().copied().unwrap_or(0);
            o += &format!(
                "  {:>8} {:>9.2} ms {:>28} {:>11.2} ms\n",
                s.suffix,
                median(&s.ttft_ms),
                format!("{} | {cached}", runs.join(" ")),
                server_median(&s.server, "first_token_ms")
            );
        }
        o += &format!(
            "  {:>8} {:>9.2} ms {:>28} {:>11.2} ms\n",
            "repeat",
            median(&p.repeat_ttft_ms),
            "",
            server_median(&p.repeat_server, "first_token_ms")
        );
        for d in &p.decode {
            o += &format!(
                "  streamed decode, {}: {:.2} ms per token (median gap; mean {:.2} ms, {} tokens){}\n",
                d.sampler,
                d.median_gap_ms,
                d.mean_gap_ms,
                d.tokens,
                match d.same_as_greedy {
                    Some(same) => format!(
                        "; drafts accepted {}/{} in {} rounds; tokens {} plain greedy",
                        d.speculative["accepted"],
                        d.speculative["drafted"],
                        d.speculative["rounds"],
                        if same { "equal" } else { "DIFFER from" }
                    ),
                    None => String::new(),
                }
            );
        }
    }
    if let Some(c) = &r.concurrent {
        o += &format!("  {}\n", c.summary());
        if let Some(nc) = &c.newcomer {
            o += &format!(
                "  a {}-token prompt sent while they stream: TTFT {:.1} ms (idle {:.1} ms); their gaps meanwhile p99 {:.1} ms, max {:.1} ms; after its first token p99 {:.1} ms, max {:.1} ms\n",
                nc.prompt_tokens,
                nc.ttft_ms,
                nc.idle_ttft_ms,
                nc.p99_gap_during_ms,
                nc.max_gap_during_ms,
                nc.p99_gap_after_ms,
                nc.max_gap_after_ms
            );
        }
    }
    if let Some(c) = &r.choices {
        o += &format!("  {}\n", c.summary());
    }
    for c in &r.chat {
        let parse = server_median(&c.server, "parse_ms");
        o += &format!(
            "  chat (/v1/chat/completions): a {}-token conversation plus a turn of {} tokens: TTFT {:.2} ms (median of {}), of which templating + tokenizing {:.2} ms, {:.2} ms to the first token in the server\n",
            c.stored_tokens,
            c.prompt_tokens
                .first()
                .zip(c.cached_tokens.first())
                .map_or(0, |(p, k)| p - k),
            median(&c.ttft_ms),
            c.ttft_ms.len(),
            parse,
            server_median(&c.server, "first_token_ms")
        );
    }
    let st = &r.store;
    o += &format!(
        "  capsule store: {} evictions from the device tier, {} from the host; {} of those moves off the worker thread (mean {:.1} ms there){}; {} automatic capsules stored, {:.2} ms of the worker's time each; {:.2} GB read into reused host buffers\n",
        st.evictions[0],
        st.evictions[1],
        st.background_moves,
        st.background_mean_ms,
        if st.background {
            ""
        } else {
            " (--serve-demote-on-worker)"
        },
        st.auto_stores,
        st.auto_store_mean_ms,
        st.pool_reused_bytes as f64 / 1e9
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a real server on the CPU demo model: every run of a suffix reuses the stored
    /// prefix, and the streamed tokens of the decode runs arrive one event each.
    #[test]
    fn serve_bench_reuses_the_prefix_and_counts_every_token() {
        let src = include_str!("../models/demo.toml");
        let ir = crate::compiler::model_from_toml(src, "demo.toml").unwrap();
        let cpu: std::sync::Arc<dyn crate::runtime::Backend> =
            std::sync::Arc::new(crate::runtime::CpuBackend::new());
        let model = Model::with_random_weights(cpu, &ir, 7).unwrap();
        let opts = ServeBenchOptions {
            prefixes: vec![24],
            suffixes: vec![1, 5],
            runs: 2,
            decode_tokens: 6,
            clients: 3,
            newcomer: 100,
            choices: 3,
            chat: Some(
                std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text"),
            ),
            demote_on_worker: false,
            // No room on the device tier: every stored capsule moves down, off the worker.
            budget_device: Some(1),
            budget_host: None,
        };
        let r = run(&model, &opts).unwrap();
        let st = &r.store;
        assert!(st.background && st.evictions[0] > 0, "{}", render(&r));
        assert!(st.background_moves + 1 >= st.evictions[0], "{}", render(&r));
        // Chat turns: each restores the stored conversation and prefills only its new turn.
        let c = &r.chat[0];
        assert_eq!(c.ttft_ms.len(), 2);
        assert_eq!(c.cached_tokens, vec![c.stored_tokens; 2]);
        assert!(c.prompt_tokens.iter().all(|&p| p > c.stored_tokens + 5));
        assert!(c.server.iter().all(|t| t["parse_ms"].as_f64().is_some()));
        let p = &r.prefixes[0];
        assert_eq!(p.suffixes.len(), 2);
        for s in &p.suffixes {
            assert_eq!(s.ttft_ms.len(), 2);
            assert_eq!(s.cached_tokens, vec![24, 24], "suffix {}", s.suffix);
        }
        assert_eq!(p.repeat_ttft_ms.len(), 2);
        for d in &p.decode {
            assert_eq!(d.tokens, 6, "{}", d.sampler);
            assert!(d.median_gap_ms > 0.0);
        }
        assert!(render(&r).contains("stored prefix 24 tokens"));
        // Three clients at once get the tokens each gets alone; the newcomer is answered.
        let c = r.concurrent.as_ref().expect("clients measured");
        assert!(c.same_as_alone);
        assert_eq!((c.clients, c.tokens_per_client), (3, 6));
        assert!(c.aggregate_tokens_per_s > 0.0 && c.p99_gap_ms >= c.median_gap_ms);
        let nc = c.newcomer.as_ref().expect("newcomer measured");
        assert!(nc.ttft_ms > 0.0 && nc.idle_ttft_ms > 0.0);
        assert!(render(&r).contains("3 clients at once"));
        // n = 3: each choice is the single completion with its seed (the server's own
        // guarantee, checked here from the client's side of the stream).
        let ch = r.choices.as_ref().expect("choices measured");
        assert_eq!((ch.n, ch.tokens_per_choice), (3, 6));
        assert!(ch.same_as_singles, "{}", ch.summary());
        assert!(render(&r).contains("n = 3 at temperature 0.8"));
    }
}
