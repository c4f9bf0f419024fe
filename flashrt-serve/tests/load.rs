//! A bounded load test against 127.0.0.1: a fixed number of client threads, each running a
//! fixed script of mixed operations over its own sessions (create with prompts sharing a
//! prefix, generate, snapshot, fork, restore, rollback, OpenAI completions, delete), against a
//! server with small tier budgets so capsules keep moving down the tiers. Bounded in count
//! and in time. Zero errors allowed; the tiers must stay within their budgets at every sample
//! of `/metrics` and at their peaks; forks and restores must stay token-identical under load.
//! Prints its figures (run with `--nocapture`; `benches/RESULTS.md` records them).

mod common;

use common::*;
use flashrt_runtime::store::MAX_IN_FLIGHT;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const THREADS: usize = 16;
const ROUNDS: usize = 20;
const DEADLINE: Duration = Duration::from_secs(50);

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).map(str::trim))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

struct Tally {
    requests: AtomicU64,
    errors: AtomicU64,
    latencies_us: std::sync::Mutex<Vec<u64>>,
}

fn timed(t: &Tally, f: impl FnOnce() -> Resp) -> Value {
    let t0 = Instant::now();
    let r = f();
    let us = t0.elapsed().as_micros() as u64;
    t.requests.fetch_add(1, Ordering::Relaxed);
    t.latencies_us.lock().unwrap().push(us);
    if r.status != 200 {
        t.errors.fetch_add(1, Ordering::Relaxed);
        panic!("status {}: {}", r.status, String::from_utf8_lossy(&r.body));
    }
    r.json()
}

fn sid(v: &Value) -> String {
    v["session"].as_str().unwrap().to_string()
}

#[test]
fn bounded_mixed_load_with_zero_errors_within_budgets() {
    let m = lfm2();
    let vocab = m.vocab();
    let dir = temp_dir("load");
    let mut cfg = config(Some(&dir), None);
    let (bd, bh, bk) = (192 << 10, 384 << 10, 32 << 20);
    cfg.store.budget_device = bd;
    cfg.store.budget_host = bh;
    cfg.store.budget_disk = bk;
    cfg.max_sessions = 4 * THREADS;
    // What a tier may hold: its budget, and the eighth past it the server allows while a
    // capsule is on its way down in the background (`StoreConfig::slack_device`).
    let (sd, sh) = (bd + bd / 8, bh + bh / 8);
    let server = start(&m, cfg);
    let addr = server.addr();
    let tally = Arc::new(Tally {
        requests: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        latencies_us: Default::default(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let over_budget = Arc::new(AtomicU64::new(0));
    let samples = Arc::new(AtomicU64::new(0));
    // Sample the tiers while the load runs.
    let monitor = {
        let (stop, over, samples) = (stop.clone(), over_budget.clone(), samples.clone());
        std::thread::spawn(move || {
            let c = Client::new(addr, None);
            while !stop.load(Ordering::Relaxed) {
                let t = String::from_utf8(c.get("/metrics").body).unwrap();
                let d = metric(&t, "flashrt_store_bytes{tier=\"device\"}");
                let h = metric(&t, "flashrt_store_bytes{tier=\"host\"}");
                let k = metric(&t, "flashrt_store_bytes{tier=\"disk\"}");
                if d > sd || h > sh || k > bk {
                    over.fetch_add(1, Ordering::Relaxed);
                }
                samples.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let system = tokens(5, 24, vocab);
    let t0 = Instant::now();
    let workers: Vec<_> = (0..THREADS)
        .map(|w| {
            let tally = tally.clone();
            let system = system.clone();
            std::thread::spawn(move || {
                let c = Client::new(addr, None);
                // Each thread is a conversation: a round's prompt extends the previous
                // round's snapshot, so creating the session reuses it (prefix lookup).
                let mut history = system.clone();
                let mut past: Vec<(String, Vec<u32>)> = Vec::new();
                for round in 0..ROUNDS {
                    assert!(t0.elapsed() < DEADLINE, "load test ran past its deadline");
                    let seed = (w * 1000 + round) as u64;
                    if history.len() > 150 {
                        history = system.clone();
                    }
                    let mut prompt = history.clone();
                    prompt.extend(tokens(seed, 4 + (seed % 12) as usize, vocab));
                    let sampler = json!({"temperature": 0.7, "top_k": 20, "seed": seed});
                    let s = sid(&timed(&tally, || {
                        c.post(
                            "/v1/sessions",
                            &json!({"tokens": prompt, "sampler": sampler}),
                        )
                    }));
                    timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{s}/generate"),
                            &json!({"max_tokens": 4}),
                        )
                    });
                    let cap = timed(&tally, || {
                        c.post(&format!("/v1/sessions/{s}/snapshot"), &json!({}))
                    })["capsule"]
                        .as_str()
                        .unwrap()
                        .to_string();
                    history =
                        ids(&timed(&tally, || c.get(&format!("/v1/capsules/{cap}")))["tokens"]);
                    let want = ids(&timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{s}/generate"),
                            &json!({"max_tokens": 5}),
                        )
                    })["tokens"]);
                    let f = sid(&timed(&tally, || {
                        c.post("/v1/sessions", &json!({"capsule": cap}))
                    }));
                    let got = ids(&timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{f}/generate"),
                            &json!({"max_tokens": 5}),
                        )
                    })["tokens"]);
                    assert_eq!(got, want, "fork under load");
                    timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{f}/append"),
                            &json!({"tokens": tokens(seed + 7, 6, vocab)}),
                        )
                    });
                    timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{f}/restore"),
                            &json!({"capsule": cap}),
                        )
                    });
                    let again = ids(&timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{f}/generate"),
                            &json!({"max_tokens": 5}),
                        )
                    })["tokens"]);
                    assert_eq!(again, want, "restore under load");
                    // An old capsule of this conversation, by now evicted down the tiers.
                    if round >= 4 {
                        let (old, old_want) = &past[round - 4];
                        timed(&tally, || {
                            c.post(
                                &format!("/v1/sessions/{f}/restore"),
                                &json!({"capsule": old}),
                            )
                        });
                        let got = ids(&timed(&tally, || {
                            c.post(
                                &format!("/v1/sessions/{f}/generate"),
                                &json!({"max_tokens": 5}),
                            )
                        })["tokens"]);
                        assert_eq!(&got, old_want, "restore of an old capsule under load");
                    }
                    past.push((cap.clone(), want.clone()));
                    timed(&tally, || {
                        c.post(
                            &format!("/v1/sessions/{s}/rollback"),
                            &json!({"capsule": cap}),
                        )
                    });
                    let g = sid(&timed(&tally, || {
                        c.post(&format!("/v1/sessions/{s}/fork"), &json!({}))
                    }));
                    timed(&tally, || {
                        c.post(
                            "/v1/completions",
                            &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
                        )
                    });
                    if round >= 8 {
                        // Old ones go (a base that others share KV rows with only hides).
                        let (old, _) = &past[round - 8];
                        timed(&tally, || c.delete(&format!("/v1/capsules/{old}")));
                    }
                    for x in [&s, &f, &g] {
                        timed(&tally, || c.delete(&format!("/v1/sessions/{x}")));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("a load worker failed");
    }
    let wall = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    monitor.join().unwrap();

    let c = Client::new(addr, None);
    let t = String::from_utf8(c.get("/metrics").body).unwrap();
    let requests = tally.requests.load(Ordering::Relaxed);
    let mut lat = tally.latencies_us.lock().unwrap().clone();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p) as usize] as f64 / 1000.0;
    let peak = |tier: &str| metric(&t, &format!("flashrt_store_peak_bytes{{tier=\"{tier}\"}}"));
    let rss_kib = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    println!(
        "serving load test ({THREADS} client threads x {ROUNDS} rounds, model {}, CPU backend)",
        m.name()
    );
    println!(
        "  requests            {requests} in {:.2} s = {:.0} req/s, errors {}",
        wall.as_secs_f64(),
        requests as f64 / wall.as_secs_f64(),
        tally.errors.load(Ordering::Relaxed)
    );
    println!(
        "  latency ms          p50 {:.2}  p90 {:.2}  p99 {:.2}  max {:.2}",
        pct(0.5),
        pct(0.9),
        pct(0.99),
        pct(1.0)
    );
    println!(
        "  peak bytes          device {} / {bd}  host {} / {bh}  disk {} / {bk}",
        peak("device"),
        peak("host"),
        peak("disk")
    );
    println!(
        "  tier samples        {} samples of /metrics, {} over budget",
        samples.load(Ordering::Relaxed),
        over_budget.load(Ordering::Relaxed)
    );
    println!(
        "  evictions           device {}  host {}  disk {}  dropped {}",
        metric(&t, "flashrt_store_evictions_total{tier=\"device\"}"),
        metric(&t, "flashrt_store_evictions_total{tier=\"host\"}"),
        metric(&t, "flashrt_store_evictions_total{tier=\"disk\"}"),
        metric(&t, "flashrt_store_dropped_total")
    );
    println!(
        "  background          {} device-tier demotions off the worker thread",
        metric(&t, "flashrt_store_background_demotions_total")
    );
    println!(
        "  prefix reuse        hits {}  misses {}  tokens reused {}",
        metric(&t, "flashrt_store_hits_total"),
        metric(&t, "flashrt_store_misses_total"),
        metric(&t, "flashrt_store_hit_tokens_total")
    );
    println!(
        "  kv sharing          {} bytes not copied",
        metric(&t, "flashrt_store_shared_bytes_total")
    );
    for tier in ["device", "host", "disk"] {
        let n = metric(
            &t,
            &format!("flashrt_restore_seconds_count{{tier=\"{tier}\"}}"),
        );
        let sum: f64 = t
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("flashrt_restore_seconds_sum{{tier=\"{tier}\"}}"))
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0);
        let under_1ms = metric(
            &t,
            &format!("flashrt_restore_seconds_bucket{{tier=\"{tier}\",le=\"0.001\"}}"),
        );
        println!(
            "  restores from {tier:<6} {n} (mean {:.1} us, {under_1ms} under 1 ms)",
            if n > 0 { sum / n as f64 * 1e6 } else { 0.0 }
        );
    }
    println!(
        "  process peak RSS    {:.1} MiB (server and clients in one process)",
        rss_kib as f64 / 1024.0
    );

    assert_eq!(tally.errors.load(Ordering::Relaxed), 0);
    assert_eq!(metric(&t, "flashrt_http_server_errors_total"), 0);
    assert_eq!(metric(&t, "flashrt_http_client_errors_total"), 0);
    assert_eq!(
        over_budget.load(Ordering::Relaxed),
        0,
        "a tier went over budget"
    );
    assert!(peak("device") <= sd && peak("host") <= sh && peak("disk") <= bk);
    assert!(
        metric(&t, "flashrt_store_evictions_total{tier=\"device\"}") > 0,
        "the budgets never bit"
    );
    // Every device-tier eviction went through the background thread (or is still in flight).
    let bg = metric(&t, "flashrt_store_background_demotions_total");
    let ev = metric(&t, "flashrt_store_evictions_total{tier=\"device\"}");
    assert!(bg > 0 && bg + MAX_IN_FLIGHT as u64 >= ev, "{bg} of {ev}");
    assert!(metric(&t, "flashrt_store_hits_total") > 0);
    assert!(wall < DEADLINE);
    server.shutdown().unwrap();
}
