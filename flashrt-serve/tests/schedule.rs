//! The scheduler over real HTTP (CPU backend, LFM2 fixture): completions generate together, a
//! token each in turn, so one arriving while another streams is answered long before that
//! one ends; each stream's tokens are still what the library samples alone; completions past
//! the generating set's size wait and are answered too.

mod common;

use common::*;
use flashrt_runtime::SamplerState;
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn local(m: &flashrt_runtime::Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = m.session().unwrap();
    s.set_sampler(SamplerState::greedy());
    s.append(prompt).unwrap();
    s.generate(n).unwrap()
}

/// Stream a completion, reporting each token as it arrives (`first`: a signal after the first
/// token). Returns every token with its arrival time.
fn stream(addr: SocketAddr, body: &Value, first: Option<mpsc::Sender<()>>) -> Vec<(Instant, u32)> {
    stream_at(addr, "/v1/completions", body, first)
}

/// [`stream`] to any streaming endpoint: completions' chunks (`choices[0].token_ids`) and the
/// sessions API's events (`token`).
fn stream_at(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    first: Option<mpsc::Sender<()>>,
) -> Vec<(Instant, u32)> {
    let payload = body.to_string();
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    write!(
        sock,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut pending = String::new();
    let mut buf = [0u8; 4096];
    let mut first = first;
    loop {
        let n = sock.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        let now = Instant::now();
        pending.push_str(&String::from_utf8_lossy(&buf[..n]));
        // Whole lines only; chunk-size lines of the transfer encoding are skipped.
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            let Some(data) = line.trim_end().strip_prefix("data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            let ids = v["choices"][0]["token_ids"]
                .as_array()
                .cloned()
                .unwrap_or_else(|| v.get("token").into_iter().cloned().collect());
            for t in ids {
                got.push((now, t.as_u64().unwrap() as u32));
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        }
    }
    got
}

#[test]
fn completions_interleave_and_each_stream_stays_exact() {
    let m = model("lfm2-public", 2048);
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let addr = server.addr();
    let (pa, pb) = (tokens(3, 40, v), tokens(4, 17, v));
    let long = 1200;
    let (tx, rx) = mpsc::channel();
    let body_a = json!({"prompt": pa, "max_tokens": long, "temperature": 0, "ignore_eos": true,
                        "stream": true});
    let a = std::thread::spawn(move || stream(addr, &body_a, Some(tx)));
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the long completion streams");
    let b = stream(
        addr,
        &json!({"prompt": pb, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
                "stream": true}),
        None,
    );
    let a = a.join().unwrap();
    assert_eq!(a.len(), long);
    assert_eq!(b.len(), 8);
    let (a_end, b_end) = (a.last().unwrap().0, b.last().unwrap().0);
    let a_after_b = a.iter().filter(|(t, _)| *t > b_end).count();
    assert!(
        b_end < a_end && a_after_b > 0,
        "the short completion should end while the long one streams ({a_after_b} of its tokens came after)"
    );
    let ids = |x: &[(Instant, u32)]| x.iter().map(|p| p.1).collect::<Vec<_>>();
    assert_eq!(ids(&b), local(&m, &pb, 8), "interleaved short stream");
    assert_eq!(ids(&a), local(&m, &pa, long), "interleaved long stream");
    let c = Client::new(addr, None);
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(metrics.contains("flashrt_generating 0"), "{metrics}");
    assert!(metrics.contains("flashrt_generation_waiting 0"));
    server.shutdown().unwrap();
}

#[test]
fn completions_past_the_generating_set_wait_their_turn() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let addr = server.addr();
    let n = flashrt_serve::worker::MAX_GENERATING + 4;
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let prompt = tokens(100 + i as u64, 9 + i, v);
            std::thread::spawn(move || {
                let c = Client::new(addr, None);
                let r = c.ok(
                    "/v1/completions",
                    &json!({"prompt": prompt, "max_tokens": 20, "temperature": 0,
                            "ignore_eos": true}),
                );
                (prompt, ids(&r["choices"][0]["token_ids"]))
            })
        })
        .collect();
    for t in threads {
        let (prompt, got) = t.join().unwrap();
        assert_eq!(got, local(&m, &prompt, 20));
    }
    server.shutdown().unwrap();
}

/// A long prompt arriving while a completion streams is prefilled a planned step per round,
/// with a token of the streaming completion in between: the stream keeps moving through the
/// newcomer's prefill, and both answers stay exact.
#[test]
fn a_long_prompt_is_prefilled_between_the_tokens_of_others() {
    let m = model("lfm2-public", 2048);
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let addr = server.addr();
    let (pa, pb) = (tokens(5, 20, v), tokens(6, 1800, v));
    let (tx, rx) = mpsc::channel();
    let body_a = json!({"prompt": pa, "max_tokens": 1000, "temperature": 0, "ignore_eos": true,
                        "stream": true});
    let a = std::thread::spawn(move || stream(addr, &body_a, Some(tx)));
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the first completion streams");
    let sent = Instant::now();
    let b = stream(
        addr,
        &json!({"prompt": pb, "max_tokens": 4, "temperature": 0, "ignore_eos": true,
                "stream": true}),
        None,
    );
    let a = a.join().unwrap();
    let b_first = b.first().expect("the long prompt's first token").0;
    let during = a.iter().filter(|(t, _)| *t > sent && *t < b_first).count();
    // 1800 tokens are 57 planned steps of at most 32 rows on this model.
    assert!(
        during >= 20,
        "only {during} tokens of the running stream arrived during the newcomer's prefill"
    );
    let ids = |x: &[(Instant, u32)]| x.iter().map(|p| p.1).collect::<Vec<_>>();
    assert_eq!(ids(&b), local(&m, &pb, 4), "sliced prefill");
    assert_eq!(ids(&a), local(&m, &pa, 1000), "the running stream");
    server.shutdown().unwrap();
}

/// A sessions-API `generate` joins the generating set too: a completion sent while it streams
/// ends first, and a command on the generating session waits for it (commands on one session
/// stay serialized) and then applies to the session as the generation left it.
#[test]
fn session_generations_interleave_and_their_commands_wait() {
    let m = model("lfm2-public", 2048);
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let addr = server.addr();
    let c = Client::new(addr, None);
    let head = tokens(8, 30, v);
    let sid = c.ok(
        "/v1/sessions",
        &json!({"tokens": head, "sampler": {"temperature": 0}}),
    )["session"]
        .as_str()
        .unwrap()
        .to_string();
    let long = 1000;
    let (tx, rx) = mpsc::channel();
    let gen_sid = sid.clone();
    let generation = std::thread::spawn(move || {
        stream_at(
            addr,
            &format!("/v1/sessions/{gen_sid}/generate"),
            &json!({"max_tokens": long, "stream": true, "ignore_eos": true}),
            Some(tx),
        )
    });
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the session generation streams");
    // A completion meanwhile, and an append to the generating session.
    let pc = tokens(9, 12, v);
    let done = stream(
        addr,
        &json!({"prompt": pc, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
                "stream": true}),
        None,
    );
    let completion_end = done.last().unwrap().0;
    let appended = c.ok(
        &format!("/v1/sessions/{sid}/append"),
        &json!({"tokens": [7]}),
    );
    let streamed = generation.join().unwrap();
    let gen_end = streamed.last().unwrap().0;
    assert!(
        completion_end < gen_end,
        "the completion should end while the session generates"
    );
    assert_eq!(
        done.iter().map(|p| p.1).collect::<Vec<_>>(),
        local(&m, &pc, 6)
    );
    // The append ran after the generation: the session holds head + 1000 generated + 1.
    assert_eq!(appended["pos"], 30 + long + 1, "{appended}");
    let info = c.ok_get(&format!("/v1/sessions/{sid}"));
    let history: Vec<u32> = ids(&info["tokens"]);
    let generated = local(&m, &head, long);
    assert_eq!(
        streamed.iter().map(|p| p.1).collect::<Vec<_>>(),
        generated,
        "streamed"
    );
    assert_eq!(history[30..30 + long], generated[..]);
    assert_eq!(history[30 + long], 7);
    server.shutdown().unwrap();
}

/// A prompt the prefix cache holds whole (nothing left to prefill), arriving while another
/// completion streams, with chunk costs measured on the device (the scheduler then slices
/// prefills by cost): answered from the stored boundary, exactly.
#[test]
fn a_cached_prompt_arriving_while_others_stream_is_answered() {
    let m = model("lfm2-public", 2048);
    let v = m.vocab();
    let plans = m.chunk_costs().plans().to_vec();
    m.set_chunk_costs(flashrt_runtime::ChunkCosts::new(
        plans,
        flashrt_runtime::CostSource::Measured,
    ))
    .unwrap();
    let server = start(&m, config(None, None));
    let addr = server.addr();
    let c = Client::new(addr, None);
    let (pa, pb) = (tokens(11, 20, v), tokens(12, 33, v));
    let body_b = json!({"prompt": pb, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let first = ids(&c.ok("/v1/completions", &body_b)["choices"][0]["token_ids"]);
    let (tx, rx) = mpsc::channel();
    let body_a = json!({"prompt": pa, "max_tokens": 600, "temperature": 0, "ignore_eos": true,
                        "stream": true});
    let a = std::thread::spawn(move || stream(addr, &body_a, Some(tx)));
    rx.recv_timeout(Duration::from_secs(60))
        .expect("the first completion streams");
    let again = c.ok("/v1/completions", &body_b);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 33);
    assert_eq!(ids(&again["choices"][0]["token_ids"]), first);
    assert_eq!(first, local(&m, &pb, 6));
    let a = a.join().unwrap();
    assert_eq!(a.len(), 600);
    server.shutdown().unwrap();
}

/// A server that warms its serving session first (as on the GPU: every plan, then the batched
/// steps on scratch sessions; forced here on the CPU) serves exactly what the library samples:
/// one completion, then three at once in the batched rounds, each equal to its local run.
#[test]
fn a_warmed_server_serves_exactly() {
    let m = lfm2();
    let v = m.vocab();
    let mut cfg = config(None, None);
    cfg.warm = Some(true);
    let server = start(&m, cfg);
    let addr = server.addr();
    // While it warms, /health says so (503, "warming"); once a job has been served, it is ok.
    let client = Client::new(addr, None);
    let health = client.get("/health");
    match health.status {
        503 => assert_eq!(health.json()["status"], "warming"),
        200 => assert_eq!(health.json()["status"], "ok"),
        other => panic!("/health while warming: {other}"),
    }
    let body = |p: &[u32], n: usize| json!({"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": true, "stream": true});
    let ids = |x: &[(Instant, u32)]| x.iter().map(|p| p.1).collect::<Vec<_>>();
    let p0 = tokens(11, 29, v);
    assert_eq!(ids(&stream(addr, &body(&p0, 6), None)), local(&m, &p0, 6));
    let health = client.get("/health");
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| tokens(20 + i, 9 + 7 * i as usize, v))
        .collect();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let b = body(p, 12);
            std::thread::spawn(move || stream(addr, &b, None))
        })
        .collect();
    for (p, h) in prompts.iter().zip(handles) {
        assert_eq!(ids(&h.join().unwrap()), local(&m, p, 12));
    }
    server.shutdown().unwrap();
}

/// While the store is still copying a capsule to the host (a background job, held at its start
/// here so that it stays in flight), a completion extending a stored prompt by a few tokens is
/// answered without waiting: its automatic capsules are skipped (a stored one covers them to
/// within 256 tokens) and counted, and its prompt is still restored from the stored one. A
/// store that waited would not answer until the watchdog released the job.
#[test]
fn completions_do_not_wait_for_a_capsule_copy_in_flight() {
    let m = lfm2();
    let v = m.vocab();
    let gate = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut cfg = config(None, None);
    // No device tier and no slack: every capsule stored goes down in the background.
    cfg.store.budget_device = 0;
    cfg.store.gate = Some(gate.clone());
    let server = start(&m, cfg);
    let c = Client::new(server.addr(), None);
    let watchdog = gate.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(20));
        watchdog.store(false, std::sync::atomic::Ordering::SeqCst);
    });
    // The count once it reaches `want` (a completion's capsule is stored, or skipped, after
    // its answer is out), else what it is after a second.
    let skipped = |c: &Client, want: u64| {
        let end = Instant::now() + Duration::from_secs(1);
        loop {
            let t = String::from_utf8(c.get("/metrics").body).unwrap();
            let n = t
                .lines()
                .find_map(|l| l.strip_prefix("flashrt_auto_capsules_skipped_total "))
                .map_or(0, |x| x.trim().parse::<u64>().unwrap());
            if n >= want || Instant::now() > end {
                return n;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let t0 = Instant::now();
    let prompt = tokens(61, 57, v);
    // Its prompt's capsule is stored (a new prompt) and starts down; the end-of-completion
    // capsule, 3 tokens further, is skipped.
    let a = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(skipped(&c, 1), 1);
    // Extending it: restored from the stored prompt (in flight to the host, still restorable),
    // both of its capsules skipped.
    let mut longer = prompt.clone();
    longer.extend(tokens(62, 5, v));
    let b = c.ok(
        "/v1/completions",
        &json!({"prompt": longer, "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 57);
    assert_eq!(skipped(&c, 3), 3);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "a completion waited for the held copy"
    );
    assert!(
        gate.load(std::sync::atomic::Ordering::SeqCst),
        "released early"
    );
    gate.store(false, std::sync::atomic::Ordering::SeqCst);
    server.shutdown().unwrap();
}
