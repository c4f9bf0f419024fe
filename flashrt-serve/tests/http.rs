//! End to end over real HTTP against servers started in-process on 127.0.0.1 (port 0), on the
//! CPU backend with the LFM2 fixture: sessions, capsules, forks, rollbacks, export/import
//! through files, a restart from the disk tier, OpenAI completions with prefix reuse and
//! streaming, and hostile input.

mod common;

use common::*;
use flashrt_runtime::{SamplerState, capsule_file};
use serde_json::{Value, json};

/// A streamed completion with `n` choices in all, as its chunks tell it: each choice's tokens,
/// how many chunks ended each choice (with their finish reasons), and every chunk before
/// `[DONE]` (the last carries the usage).
struct Choices {
    tokens: Vec<Vec<u32>>,
    finished: Vec<usize>,
    reasons: Vec<Value>,
    chunks: Vec<Value>,
}

fn stream_choices(c: &Client, body: &Value, n: usize) -> Choices {
    let ev = c.post("/v1/completions", body).events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut got = Choices {
        tokens: vec![Vec::new(); n],
        finished: vec![0; n],
        reasons: Vec::new(),
        chunks: Vec::new(),
    };
    for ch in &chunks[..chunks.len() - 1] {
        let choice = &ch["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        got.tokens[i].extend(ids(&choice["token_ids"]));
        if !choice["finish_reason"].is_null() {
            got.reasons.push(choice["finish_reason"].clone());
            got.finished[i] += 1;
        }
    }
    got.chunks = chunks;
    got
}

/// What the library itself samples from `prompt` with `sampler`: the reference every server
/// answer must match token for token.
fn local(m: &flashrt_runtime::Model, prompt: &[u32], sampler: SamplerState, n: usize) -> Vec<u32> {
    let mut s = m.session().unwrap();
    s.set_sampler(sampler);
    s.append(prompt).unwrap();
    s.generate(n).unwrap()
}

#[test]
fn sessions_capsules_forks_rollbacks_files_and_a_restart() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("e2e");
    let server = start(&m, config(Some(&dir), Some("s3cret")));
    let c = Client::new(server.addr(), Some("s3cret"));

    let prompt = tokens(1, 30, v);
    let sampler = json!({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 7});
    let r = c.ok(
        "/v1/sessions",
        &json!({"tokens": prompt, "sampler": sampler}),
    );
    let sid = r["session"].as_str().unwrap().to_string();
    assert_eq!(r["pos"], 30);
    let g1 = ids(&c.ok(
        &format!("/v1/sessions/{sid}/generate"),
        &json!({"max_tokens": 8}),
    )["tokens"]);
    let snap = c.ok(&format!("/v1/sessions/{sid}/snapshot"), &json!({}));
    let cap = snap["capsule"].as_str().unwrap().to_string();
    assert_eq!(snap["pos"], 38);
    let g2 = ids(&c.ok(
        &format!("/v1/sessions/{sid}/generate"),
        &json!({"max_tokens": 8}),
    )["tokens"]);
    // The server samples exactly what the library samples.
    let all = local(&m, &prompt, SamplerState::seeded(7, 0.8, 40, 0.95), 16);
    assert_eq!([g1.clone(), g2.clone()].concat(), all);

    // Fork two branches from the capsule: both continue exactly like the original did.
    let b1 = c.ok("/v1/sessions", &json!({"capsule": cap}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let b2 = c.ok(&format!("/v1/sessions/{b1}/fork"), &json!({}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    for b in [&b1, &b2] {
        let g = ids(&c.ok(
            &format!("/v1/sessions/{b}/generate"),
            &json!({"max_tokens": 8}),
        )["tokens"]);
        assert_eq!(g, g2, "branch {b}");
    }
    // The branches are independent: one goes its own way, the other is untouched.
    let b3 = c.ok("/v1/sessions", &json!({"capsule": cap}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let appended = c.ok(
        &format!("/v1/sessions/{b3}/append"),
        &json!({"tokens": tokens(9, 5, v)}),
    );
    // The worker's time for the prefill, as a restore reports its own.
    assert!(
        appended["prefill_us"].as_f64().is_some_and(|us| us > 0.0),
        "{appended}"
    );
    let g3 = ids(&c.ok(
        &format!("/v1/sessions/{b3}/generate"),
        &json!({"max_tokens": 8}),
    )["tokens"]);
    assert_ne!(g3, g2);
    let b4 = c.ok("/v1/sessions", &json!({"capsule": cap}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{b4}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );

    // Roll back the original session to the capsule (a boundary of its history), twice.
    c.ok(
        &format!("/v1/sessions/{sid}/rollback"),
        &json!({"capsule": cap}),
    );
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{sid}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );
    c.ok(&format!("/v1/sessions/{sid}/rollback"), &json!({"pos": 38}));
    assert_eq!(c.ok_get(&format!("/v1/sessions/{sid}"))["pos"], 38);
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{sid}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );
    // Restore (not a rollback) works from any state, e.g. another branch's session.
    let r = c.ok(
        &format!("/v1/sessions/{b3}/restore"),
        &json!({"capsule": cap}),
    );
    assert_eq!(r["pos"], 38);
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{b3}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );

    // A greedy session: the default sampler.
    let greedy = c.ok("/v1/sessions", &json!({"tokens": prompt}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let gg = ids(&c.ok(
        &format!("/v1/sessions/{greedy}/generate"),
        &json!({"max_tokens": 10}),
    )["tokens"]);
    assert_eq!(gg, local(&m, &prompt, SamplerState::greedy(), 10));

    // Export through a file, import it back, restore from the import.
    let e = c.ok(
        &format!("/v1/capsules/{cap}/export"),
        &json!({"file": "branch.caps"}),
    );
    // The answer names the file as the client did, never by its path on the server.
    assert_eq!(e["file"], "branch.caps");
    assert!(e.get("path").is_none());
    assert!(dir.join("files").join("branch.caps").is_file());
    let imp = c.ok("/v1/capsules/import", &json!({"file": "branch.caps"}));
    let cap2 = imp["capsule"].as_str().unwrap().to_string();
    assert_ne!(cap2, cap);
    let s2 = c.ok("/v1/sessions", &json!({"capsule": cap2}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{s2}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );
    // The same through raw bytes.
    let bytes = c.get(&format!("/v1/capsules/{cap}/file"));
    assert_eq!(bytes.status, 200);
    assert_eq!(
        bytes.header("content-type"),
        Some("application/octet-stream")
    );
    let imp = c.raw(
        "POST",
        "/v1/capsules/import",
        "application/octet-stream",
        &bytes.body,
    );
    assert_eq!(imp.status, 200, "{}", String::from_utf8_lossy(&imp.body));
    let cap3 = imp.json()["capsule"].as_str().unwrap().to_string();
    let s3 = c.ok("/v1/sessions", &json!({"capsule": cap3}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{s3}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );
    // The library reads the exported file too.
    let lib = capsule_file::read_capsule(&dir.join("files").join("branch.caps"), &m).unwrap();
    assert_eq!(lib.pos(), 38);

    let list = c.ok_get("/v1/capsules");
    assert!(list["capsules"].as_array().unwrap().len() >= 3);
    let health = c.ok_get("/health");
    assert_eq!(health["status"], "ok");
    assert_eq!(health["model"], m.name());
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    for name in [
        "flashrt_store_hits_total",
        "flashrt_store_misses_total",
        "flashrt_store_bytes{tier=\"device\"}",
        "flashrt_store_bytes{tier=\"host\"}",
        "flashrt_store_bytes{tier=\"disk\"}",
        "flashrt_restore_seconds_bucket{tier=\"device\",le=\"0.001\"}",
        "flashrt_restore_seconds_count{tier=\"device\"}",
        "flashrt_time_to_first_token_seconds_bucket{le=\"0.01\"}",
        "flashrt_inter_token_seconds_count",
        "flashrt_queue_wait_seconds_sum",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }

    // Restart: a new server on the same store directory restores from disk.
    server.shutdown().unwrap();
    let server = start(&m, config(Some(&dir), Some("s3cret")));
    let c = Client::new(server.addr(), Some("s3cret"));
    let info = c.ok_get(&format!("/v1/capsules/{cap}"));
    assert_eq!(info["tiers"], json!(["disk"]));
    let s4 = c.ok("/v1/sessions", &json!({}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let r = c.ok(
        &format!("/v1/sessions/{s4}/restore"),
        &json!({"capsule": cap}),
    );
    assert_eq!(r["from_tier"], "disk");
    assert_eq!(
        ids(&c.ok(
            &format!("/v1/sessions/{s4}/generate"),
            &json!({"max_tokens": 8})
        )["tokens"]),
        g2
    );
    // Restored from disk once, the capsule is back on the device tier.
    assert_eq!(
        c.ok_get(&format!("/v1/capsules/{cap}"))["tiers"][0],
        "device"
    );
    for cc in [&cap2, &cap3] {
        let s = c.ok("/v1/sessions", &json!({"capsule": cc}))["session"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(
            ids(&c.ok(
                &format!("/v1/sessions/{s}/generate"),
                &json!({"max_tokens": 8})
            )["tokens"]),
            g2
        );
    }
    // Streaming generation from a restored session.
    let s5 = c.ok("/v1/sessions", &json!({"capsule": cap}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let r = c.post(
        &format!("/v1/sessions/{s5}/generate"),
        &json!({"max_tokens": 8, "stream": true}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let ev = r.events();
    let streamed: Vec<u32> = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["token"].as_u64().map(|t| t as u32))
        .collect();
    assert_eq!(streamed, g2);
    assert!(ev.last().unwrap().contains("\"done\":true"));
    server.shutdown().unwrap();
}

#[test]
fn openai_completions_reuse_prefixes_and_stream() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let prompt = tokens(21, 40, v);
    let body = json!({"model": m.name(), "prompt": prompt, "max_tokens": 6, "temperature": 0});
    let a = c.ok("/v1/completions", &body);
    assert_eq!(a["object"], "text_completion");
    let ta = ids(&a["choices"][0]["token_ids"]);
    assert_eq!(ta, local(&m, &prompt, SamplerState::greedy(), 6));
    assert_eq!(a["usage"]["prompt_tokens"], 40);
    assert_eq!(a["usage"]["completion_tokens"], 6);
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The same prompt again: restored from the stored prompt boundary, not prefilled.
    let b = c.ok("/v1/completions", &body);
    assert_eq!(ids(&b["choices"][0]["token_ids"]), ta);
    assert_eq!(b["usage"]["prompt_tokens_details"]["cached_tokens"], 40);
    // A longer prompt that extends prompt + completion reuses the previous turn up to its last
    // token (the completion never feeds that one: no step runs after the last token).
    let mut longer = prompt.clone();
    longer.extend(&ta);
    longer.extend(tokens(22, 7, v));
    let l = c.ok(
        "/v1/completions",
        &json!({"prompt": longer, "max_tokens": 5, "temperature": 0}),
    );
    assert_eq!(l["usage"]["prompt_tokens_details"]["cached_tokens"], 45);
    assert_eq!(
        ids(&l["choices"][0]["token_ids"]),
        local(&m, &longer, SamplerState::greedy(), 5)
    );
    // Seeded sampling equals the library's, through reuse too.
    let sb =
        json!({"prompt": prompt, "max_tokens": 9, "temperature": 0.9, "top_p": 0.9, "seed": 5});
    let s1 = ids(&c.ok("/v1/completions", &sb)["choices"][0]["token_ids"]);
    assert_eq!(
        s1,
        local(&m, &prompt, SamplerState::seeded(5, 0.9, 0, 0.9), 9)
    );
    // Streaming gives the same tokens, chunk by chunk, then [DONE].
    let mut sbs = sb.clone();
    sbs["stream"] = json!(true);
    let r = c.post("/v1/completions", &sbs);
    assert_eq!(r.status, 200);
    let ev = r.events();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let streamed: Vec<u32> = ev[..ev.len() - 1]
        .iter()
        .flat_map(|e| ids(&serde_json::from_str::<Value>(e).unwrap()["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(streamed, s1);
    // Chat completions with token-id contents (no tokenizer in this build of the test).
    let chat = c.ok(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(
        ids(&chat["choices"][0]["message"]["token_ids"]),
        ta[..4].to_vec()
    );
    let r = c.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3, "temperature": 0, "stream": true}),
    );
    let ev = r.events();
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    // A stop token ends generation early, including the stop token.
    let stop = ta[2];
    let st = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}),
    );
    assert_eq!(st["choices"][0]["finish_reason"], "stop");
    let got = ids(&st["choices"][0]["token_ids"]);
    assert_eq!(got.last(), Some(&stop));
    // Reuse is counted.
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    let hits: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("flashrt_store_hits_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(hits >= 3, "{hits} hits");
    // Per-token latency: one first token per generation request (8 above), one gap per
    // further token, one queue wait per job.
    let count = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}_count ")))
            .unwrap_or_else(|| panic!("/metrics lacks {name}_count"))
            .parse()
            .unwrap()
    };
    let tokens = (6 + 6 + 5 + 9 + 9 + 4 + 3 + got.len()) as u64;
    assert_eq!(count("flashrt_time_to_first_token_seconds"), 8);
    assert_eq!(count("flashrt_inter_token_seconds"), tokens - 8);
    assert!(count("flashrt_queue_wait_seconds") >= 8);
    // The prompt capsules the hits above came from were stored by the worker, timed.
    assert!(count("flashrt_auto_store_seconds") >= 3);
    server.shutdown().unwrap();
}

fn assert_4xx(r: &Resp, status: u16, code: &str) {
    assert_eq!(r.status, status, "{}", String::from_utf8_lossy(&r.body));
    let j = r.json();
    assert_eq!(j["error"]["code"], code, "{j}");
    assert!(!j["error"]["message"].as_str().unwrap().is_empty());
}

#[test]
fn hostile_input_gets_a_clear_4xx_and_the_server_keeps_serving() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("hostile");
    let server = start(&m, config(Some(&dir), Some("tok")));
    let c = Client::new(server.addr(), Some("tok"));
    let sid = c.ok("/v1/sessions", &json!({"tokens": tokens(3, 12, v)}))["session"]
        .as_str()
        .unwrap()
        .to_string();

    // Authentication.
    let anon = Client::new(server.addr(), None);
    assert_4xx(&anon.post("/v1/sessions", &json!({})), 401, "unauthorized");
    assert_4xx(
        &Client::new(server.addr(), Some("nope")).get("/v1/capsules"),
        401,
        "unauthorized",
    );
    assert_eq!(anon.get("/health").status, 200);
    // Malformed JSON, wrong types, unknown fields.
    let r = c.raw(
        "POST",
        "/v1/sessions",
        "application/json",
        b"{\"tokens\": [1, 2,",
    );
    assert_4xx(&r, 400, "invalid_json");
    assert_4xx(
        &c.raw("POST", "/v1/completions", "application/json", b"\xff\xfe"),
        400,
        "invalid_json",
    );
    assert_4xx(
        &c.post("/v1/sessions", &json!({"tokens": [-1]})),
        400,
        "invalid_json",
    );
    assert_4xx(
        &c.post("/v1/sessions", &json!({"tokens": "text"})),
        400,
        "no_tokenizer",
    );
    assert_4xx(
        &c.post("/v1/sessions", &json!({"tokns": [1]})),
        400,
        "unsupported_parameter",
    );
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/generate"),
            &json!({"max_tokens": "many"}),
        ),
        400,
        "invalid_json",
    );
    assert_4xx(
        &c.post("/v1/completions", &json!({"prompt": {"a": 1}})),
        400,
        "invalid_prompt",
    );
    assert_4xx(
        &c.post("/v1/completions", &json!({"prompt": [1.5]})),
        400,
        "invalid_tokens",
    );
    for n in [0, 17] {
        assert_4xx(
            &c.post("/v1/completions", &json!({"prompt": [1], "n": n})),
            400,
            "invalid_request",
        );
    }
    assert_4xx(
        &c.post("/v1/completions", &json!({"prompt": []})),
        400,
        "invalid_tokens",
    );
    // Unknown ids, and ids that are not ids at all.
    assert_4xx(
        &c.post(
            "/v1/sessions/0123456789abcdef/append",
            &json!({"tokens": [5]}),
        ),
        404,
        "unknown_session",
    );
    assert_4xx(&c.get("/v1/sessions/..%2f..%2fetc"), 404, "unknown_session");
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/restore"),
            &json!({"capsule": "0123456789abcdef"}),
        ),
        404,
        "unknown_capsule",
    );
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/restore"),
            &json!({"capsule": "../../x"}),
        ),
        404,
        "unknown_capsule",
    );
    assert_4xx(
        &c.delete("/v1/capsules/ffffffffffffffff"),
        404,
        "unknown_capsule",
    );
    assert_4xx(&c.get("/v2/nothing"), 404, "unknown_route");
    assert_4xx(
        &c.raw("PUT", "/v1/sessions", "application/json", b"{}"),
        405,
        "method_not_allowed",
    );
    // Token ids outside the vocabulary; prompts longer than max_seq.
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/append"),
            &json!({"tokens": [1, v]}),
        ),
        400,
        "invalid_tokens",
    );
    assert_4xx(
        &c.post("/v1/completions", &json!({"prompt": [u32::MAX]})),
        400,
        "invalid_tokens",
    );
    assert_4xx(
        &c.post("/v1/completions", &json!({"prompt": tokens(4, 257, v)})),
        400,
        "context_length_exceeded",
    );
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/append"),
            &json!({"tokens": tokens(4, 250, v)}),
        ),
        400,
        "context_length_exceeded",
    );
    assert_4xx(
        &c.post("/v1/sessions", &json!({"tokens": tokens(4, 300, v)})),
        400,
        "context_length_exceeded",
    );
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/generate"),
            &json!({"max_tokens": 100000}),
        ),
        400,
        "invalid_request",
    );
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/generate"),
            &json!({"sampler": {"top_p": 2.0}}),
        ),
        400,
        "invalid_sampler",
    );
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/generate"),
            &json!({"sampler": {"temperature": -1}}),
        ),
        400,
        "invalid_sampler",
    );
    let empty = c.ok("/v1/sessions", &json!({}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    assert_4xx(
        &c.post(&format!("/v1/sessions/{empty}/generate"), &json!({})),
        400,
        "empty_session",
    );
    // Rollback to a capsule that is not a boundary of the session's history.
    let other = c.ok("/v1/sessions", &json!({"tokens": tokens(77, 9, v)}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let oc = c.ok(&format!("/v1/sessions/{other}/snapshot"), &json!({}))["capsule"]
        .as_str()
        .unwrap()
        .to_string();
    assert_4xx(
        &c.post(
            &format!("/v1/sessions/{sid}/rollback"),
            &json!({"capsule": oc}),
        ),
        409,
        "not_a_prefix",
    );
    assert_4xx(
        &c.post(&format!("/v1/sessions/{sid}/rollback"), &json!({"pos": 5})),
        409,
        "no_capsule_at_position",
    );
    // File names that try to leave the files directory.
    for bad in ["../x.caps", "/etc/passwd", ".hidden", "a/b", ""] {
        assert_4xx(
            &c.post(&format!("/v1/capsules/{oc}/export"), &json!({"file": bad})),
            400,
            "invalid_file_name",
        );
    }
    assert_4xx(
        &c.post("/v1/capsules/import", &json!({"file": "missing.caps"})),
        404,
        "file_not_found",
    );

    // Capsule files: another model's, truncated, bit-flipped, garbage, oversized.
    let q = model("qwen35-public", 64);
    let mut qs = q.session().unwrap();
    qs.append(&tokens(5, 10, q.vocab())).unwrap();
    let foreign = capsule_file::capsule_to_vec(&qs.snapshot().unwrap()).unwrap();
    let up = |b: &[u8]| c.raw("POST", "/v1/capsules/import", "application/octet-stream", b);
    assert_4xx(&up(&foreign), 400, "fingerprint_mismatch");
    std::fs::write(dir.join("files").join("foreign.caps"), &foreign).unwrap();
    assert_4xx(
        &c.post("/v1/capsules/import", &json!({"file": "foreign.caps"})),
        400,
        "fingerprint_mismatch",
    );
    let good = c.get(&format!("/v1/capsules/{oc}/file")).body;
    assert_4xx(&up(&good[..good.len() / 2]), 400, "invalid_capsule");
    assert_4xx(&up(&good[..20]), 400, "invalid_capsule");
    let mut flipped = good.clone();
    let i = flipped.len() - 100;
    flipped[i] ^= 0x08;
    assert_4xx(&up(&flipped), 400, "invalid_capsule");
    let mut flipped = good.clone();
    flipped[60] ^= 0x01;
    assert_4xx(&up(&flipped), 400, "invalid_capsule");
    assert_4xx(
        &up(b"PK\x03\x04 definitely not a capsule"),
        400,
        "invalid_capsule",
    );
    assert_4xx(&up(&[]), 400, "invalid_capsule");
    let huge = vec![0u8; 10 << 20];
    assert_4xx(&up(&huge), 413, "body_too_large");
    // A good upload still works after all that.
    assert_eq!(up(&good).status, 200);

    // Concurrent requests on one session: serialized, none lost, state consistent.
    let before = c.ok_get(&format!("/v1/sessions/{sid}"))["pos"]
        .as_u64()
        .unwrap();
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let c = c.clone();
            let sid = sid.clone();
            std::thread::spawn(move || {
                for j in 0..3 {
                    let r = c.post(
                        &format!("/v1/sessions/{sid}/append"),
                        &json!({"tokens": [3 + i * 3 + j]}),
                    );
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                    let r = c.post(
                        &format!("/v1/sessions/{sid}/generate"),
                        &json!({"max_tokens": 2}),
                    );
                    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let info = c.ok_get(&format!("/v1/sessions/{sid}"));
    assert_eq!(info["pos"].as_u64().unwrap(), before + 8 * 3 * 3);
    // The interleaved session equals a cold run of its own history.
    let history = ids(&info["tokens"]);
    let cold = c.ok("/v1/sessions", &json!({"tokens": history, "reuse": false}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let a = ids(&c.ok(
        &format!("/v1/sessions/{sid}/generate"),
        &json!({"max_tokens": 5}),
    )["tokens"]);
    let b = ids(&c.ok(
        &format!("/v1/sessions/{cold}/generate"),
        &json!({"max_tokens": 5}),
    )["tokens"]);
    assert_eq!(a, b);

    // Still serving, and the errors were counted as client errors, never server errors.
    assert_eq!(c.ok_get("/health")["status"], "ok");
    let r = c.ok(
        "/v1/completions",
        &json!({"prompt": tokens(8, 10, v), "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(ids(&r["choices"][0]["token_ids"]).len(), 3);
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    let get = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    assert!(get("flashrt_http_client_errors_total ") >= 40);
    assert_eq!(get("flashrt_http_server_errors_total "), 0);
    server.shutdown().unwrap();
}

/// `logprobs` over HTTP against a log-softmax computed here from the library's own logits
/// (f64, independently of the server's code): completions (`logprobs: N`) and chat
/// (`logprobs: true, top_logprobs: N`), streamed and not, greedy (the chosen token is the top
/// alternative) and sampled; invalid requests get a clear 400.
#[test]
fn openai_logprobs_match_the_log_softmax() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let prompt = tokens(31, 23, v);
    // The reference: the library's logits at each generated position, log-softmaxed here.
    let reference = |toks: &[u32]| -> Vec<(f64, Vec<(u32, f64)>)> {
        let mut s = m.session().unwrap();
        s.append(&prompt).unwrap();
        toks.iter()
            .map(|&t| {
                let row: Vec<f64> = s.last_logits().iter().map(|&x| x as f64).collect();
                let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                let mut order: Vec<u32> = (0..row.len() as u32).collect();
                order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
                let top = order[..3]
                    .iter()
                    .map(|&i| (i, row[i as usize] - lse))
                    .collect();
                s.append(&[t]).unwrap();
                (row[t as usize] - lse, top)
            })
            .collect()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * (1.0 + b.abs());

    for sampled in [false, true] {
        let mut body = json!({"prompt": prompt, "max_tokens": 5, "logprobs": 3, "temperature": 0});
        if sampled {
            body["temperature"] = json!(1.1);
            body["seed"] = json!(9);
        }
        let a = c.ok("/v1/completions", &body);
        let toks = ids(&a["choices"][0]["token_ids"]);
        let want = reference(&toks);
        let lp = &a["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"].as_array().unwrap().len(), 5, "{lp}");
        let offsets: Vec<u64> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0);
        for (i, (l, top)) in want.iter().enumerate() {
            let got = lp["token_logprobs"][i].as_f64().unwrap();
            assert!(close(got, *l), "token {i}: {got} vs {l}");
            let alts = lp["top_logprobs"][i].as_object().unwrap();
            assert_eq!(alts.len(), 3);
            for (id, p) in top {
                let g = alts[&format!("token_id:{id}")].as_f64().unwrap();
                assert!(close(g, *p), "token {i}, alternative {id}: {g} vs {p}");
            }
            if !sampled {
                assert!(close(got, top[0].1), "greedy picks the top alternative");
            }
        }
        // Streamed: the same numbers, one token per chunk.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let ev = c.post("/v1/completions", &sb).events();
        let streamed: Vec<f64> = ev[..ev.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .filter(|e| !e["choices"][0]["logprobs"].is_null())
            .map(|e| {
                e["choices"][0]["logprobs"]["token_logprobs"][0]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        let plain: Vec<f64> = serde_json::from_value(lp["token_logprobs"].clone()).unwrap();
        assert_eq!(streamed, plain);
    }

    // Chat: `content` entries with token, logprob, bytes, top_logprobs.
    let chat = c.ok(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
                "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    let content = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap();
    assert_eq!(content.len(), 3);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert_eq!(content[0]["token"], content[0]["top_logprobs"][0]["token"]);
    assert!(content[0]["bytes"].is_array());
    // Without logprobs, none.
    let none = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}),
    );
    assert!(none["choices"][0]["logprobs"].is_null());

    // Bad requests.
    let bad = [
        ("/v1/completions", json!({"prompt": prompt, "logprobs": 21})),
        ("/v1/completions", json!({"prompt": prompt, "logprobs": -1})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}], "top_logprobs": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": prompt}], "logprobs": 3}),
        ),
    ];
    for (path, b) in bad {
        let r = c.post(path, &b);
        assert_eq!(r.status, 400, "{b}: {}", String::from_utf8_lossy(&r.body));
    }
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": prompt, "top_logprobs": 2}),
    );
    assert_4xx(&r, 400, "unsupported_parameter");

    // The sessions API: `logprobs: N` on generate, the same numbers.
    let sid = c.ok("/v1/sessions", &json!({"tokens": prompt}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let g = c.ok(
        &format!("/v1/sessions/{sid}/generate"),
        &json!({"max_tokens": 4, "logprobs": 3}),
    );
    let want = reference(&ids(&g["tokens"]));
    let lps = g["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), 4);
    for ((l, top), got) in want.iter().zip(lps) {
        assert!(close(got["logprob"].as_f64().unwrap(), *l));
        assert_eq!(got["top"][0][0].as_u64().unwrap() as u32, top[0].0);
    }
    server.shutdown().unwrap();
}

/// Presence, frequency and repetition penalties over HTTP equal the library's sampler with the
/// same settings (set after the prompt, so presence and frequency count generated tokens
/// only), greedy and seeded; a negative presence penalty makes greedy decoding repeat.
#[test]
fn penalties_match_the_library() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let prompt = tokens(41, 19, v);
    let local_pen = |sampler: SamplerState, n: usize| {
        let mut s = m.session().unwrap();
        s.append(&prompt).unwrap();
        s.set_sampler(sampler);
        s.generate(n).unwrap()
    };
    for (t, seed, pres, freq, rep) in [
        (0.0f32, 0u64, -2.0f32, 0.0f32, 1.0f32),
        (0.0, 0, 0.0, 0.7, 1.3),
        (0.9, 4, 0.4, 0.3, 1.1),
    ] {
        let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": t, "seed": seed,
                          "presence_penalty": pres, "frequency_penalty": freq,
                          "repetition_penalty": rep, "ignore_eos": true});
        let got = ids(&c.ok("/v1/completions", &body)["choices"][0]["token_ids"]);
        let want = local_pen(
            SamplerState::seeded(seed, t, 0, 1.0).with_penalties(pres, freq, rep),
            24,
        );
        assert_eq!(got, want, "{body}");
        if pres == -2.0 {
            // A negative presence penalty rewards what was generated: greedy decoding repeats.
            let plain = local(&m, &prompt, SamplerState::greedy(), 24);
            assert_ne!(got, plain, "the penalty should change greedy decoding");
            let distinct: std::collections::BTreeSet<_> = got.iter().collect();
            assert!(distinct.len() < got.len(), "{got:?}");
        }
    }
    server.shutdown().unwrap();
}

/// OpenAI `n`: the choices come from one prefilled prompt, choice `i` sampling with seed
/// `seed + i`, so each equals a single completion with that seed (and what the library samples
/// with it); streamed, every chunk says its choice, each choice ends with its own finish
/// reason, and the usage counts every choice's tokens.
#[test]
fn n_choices_equal_separately_seeded_completions() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let prompt = tokens(77, 23, v);
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": 5,
                      "n": 4, "ignore_eos": true});
    let r = c.ok("/v1/completions", &body);
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let mut all = Vec::new();
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(ch["seed"], 5 + i as u64);
        let got = ids(&ch["token_ids"]);
        let single = c.ok(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": 5 + i,
                    "ignore_eos": true}),
        );
        assert_eq!(got, ids(&single["choices"][0]["token_ids"]), "choice {i}");
        assert_eq!(
            got,
            local(
                &m,
                &prompt,
                SamplerState::seeded(5 + i as u64, 0.8, 0, 1.0),
                12
            ),
            "choice {i} against the library"
        );
        all.push(got);
    }
    let distinct: std::collections::BTreeSet<_> = all.iter().collect();
    assert_eq!(distinct.len(), 4, "four distinct continuations: {all:?}");
    assert_eq!(r["usage"]["completion_tokens"], 48);
    assert_eq!(r["usage"]["prompt_tokens"], 23);
    assert_eq!(r["seed"], 5);

    // Streamed: the same tokens per choice, one finish chunk each, usage last.
    let mut sbody = body.clone();
    sbody["n"] = json!(3);
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let Choices {
        tokens: per,
        finished,
        reasons,
        chunks,
    } = stream_choices(&c, &sbody, 3);
    assert!(reasons.iter().all(|r| r == "length"), "{reasons:?}");
    assert_eq!(per, all[..3].to_vec());
    assert_eq!(finished, [1, 1, 1]);
    // Side by side (the generating set has room for a session per choice): the choices'
    // chunks interleave, and every round fed them in one batched step.
    let order: Vec<u64> = chunks[..chunks.len() - 1]
        .iter()
        .map(|ch| ch["choices"][0]["index"].as_u64().unwrap())
        .collect();
    let last_zero = order.iter().rposition(|&i| i == 0).unwrap();
    assert!(
        order[..last_zero].contains(&2),
        "choices stream interleaved: {order:?}"
    );
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    let batched = metrics
        .lines()
        .find_map(|l| l.strip_prefix("flashrt_batched_steps_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(batched > 0, "no batched steps: {metrics}");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 36);

    // Chat: every choice's first delta names the role.
    let ev = c
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
                    "temperature": 0.8, "seed": 9, "n": 2, "stream": true}),
        )
        .events();
    let roles: Vec<u64> = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter(|v| v["choices"][0]["delta"]["role"] == "assistant")
        .map(|v| v["choices"][0]["index"].as_u64().unwrap())
        .collect();
    assert_eq!(roles, [0, 1]);
    server.shutdown().unwrap();

    // No room for a session per choice (one session in the memory plan): the choices run
    // one after another, with the same tokens.
    let mut cfg = config(None, None);
    cfg.max_sessions = 1;
    let server = start(&m, cfg);
    let c = Client::new(server.addr(), None);
    let r = c.ok("/v1/completions", &body);
    let one_by_one: Vec<Vec<u32>> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ch| ids(&ch["token_ids"]))
        .collect();
    assert_eq!(one_by_one, all);
    let ev = c.post("/v1/completions", &sbody).events();
    let order: Vec<u64> = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| v["choices"][0]["index"].as_u64())
        .collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
    server.shutdown().unwrap();
}

/// A list of prompts (OpenAI's batch form of `prompt`): one completion per prompt, queued
/// together, choice `i` of prompt `p` at index `p * n + i`, each equal to that prompt's own
/// completion (and to what the library samples), streamed or not; the usage sums the prompts;
/// a bad prompt anywhere refuses the whole request, naming it.
#[test]
fn prompt_lists_answer_each_prompt_as_alone() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| tokens(300 + i, 9 + 4 * i as usize, v))
        .collect();
    let body = |n: usize| {
        json!({"prompt": prompts, "max_tokens": 6, "temperature": 0.8, "seed": 11, "n": n,
               "ignore_eos": true})
    };
    // What each prompt gets alone, choice i seeded 11 + i.
    let mut alone: Vec<Vec<u32>> = Vec::new();
    for p in &prompts {
        for i in 0..2 {
            alone.push(local(&m, p, SamplerState::seeded(11 + i, 0.8, 0, 1.0), 6));
        }
    }
    let r = c.ok("/v1/completions", &body(2));
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (k, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], k);
        assert_eq!(
            ids(&ch["token_ids"]),
            alone[k],
            "prompt {} choice {}",
            k / 2,
            k % 2
        );
        assert_eq!(ch["finish_reason"], "length");
    }
    let plen: usize = prompts.iter().map(Vec::len).sum();
    assert_eq!(r["usage"]["prompt_tokens"], plen);
    assert_eq!(r["usage"]["completion_tokens"], 36);
    assert_eq!(r["timings"].as_array().map(Vec::len), Some(3));

    // Streamed, one choice per prompt: every chunk names its prompt's index, each ends once.
    let mut sbody = body(1);
    sbody["stream"] = json!(true);
    sbody["stream_options"] = json!({"include_usage": true});
    let Choices {
        tokens: per,
        finished,
        chunks,
        ..
    } = stream_choices(&c, &sbody, 3);
    let alone_one: Vec<Vec<u32>> = alone.iter().step_by(2).cloned().collect();
    assert_eq!(per, alone_one);
    assert_eq!(finished, [1, 1, 1]);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 18);
    assert_eq!(usage["usage"]["prompt_tokens"], plen);

    // A list of one prompt is that prompt.
    let one = c.ok(
        "/v1/completions",
        &json!({"prompt": [prompts[1]], "max_tokens": 6, "temperature": 0.8, "seed": 11,
                "ignore_eos": true}),
    );
    assert_eq!(ids(&one["choices"][0]["token_ids"]), alone[2]);

    // One bad prompt refuses the request, naming it; nothing is left running.
    let mut bad = prompts.clone();
    bad[2][3] = v as u32;
    let r = c.post("/v1/completions", &json!({"prompt": bad, "max_tokens": 2}));
    assert_4xx(&r, 400, "invalid_tokens");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt[2]:")
    );
    assert_4xx(
        &c.post(
            "/v1/completions",
            &json!({"prompt": [prompts[0], []], "max_tokens": 2}),
        ),
        400,
        "invalid_tokens",
    );
    assert_4xx(
        &c.post(
            "/v1/completions",
            &json!({"prompt": [1, [2]], "max_tokens": 2}),
        ),
        400,
        "invalid_prompt",
    );
    assert_4xx(
        &c.post(
            "/v1/completions",
            &json!({"prompt": vec![prompts[0].clone(); 17], "n": 4, "max_tokens": 2}),
        ),
        400,
        "invalid_request",
    );
    // Without a tokenizer, text prompts in a list are refused as a single one is.
    assert_4xx(
        &c.post(
            "/v1/completions",
            &json!({"prompt": ["a", "b"], "max_tokens": 2}),
        ),
        400,
        "no_tokenizer",
    );
    // And the server goes on serving the same answers.
    let again = c.ok("/v1/completions", &body(2));
    let got: Vec<Vec<u32>> = again["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ch| ids(&ch["token_ids"]))
        .collect();
    assert_eq!(got, alone);
    server.shutdown().unwrap();
}

/// Every completion says where its time went inside the server (`timings`): phases that add
/// up, a restored prefix's admission, the body's parse.
#[test]
fn completions_report_their_timings() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let prompt = tokens(401, 40, v);
    let body = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    for stream in [false, true] {
        let mut b = body.clone();
        b["stream"] = json!(stream);
        let t = if stream {
            let ev = c.post("/v1/completions", &b).events();
            let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
            last["timings"].clone()
        } else {
            c.ok("/v1/completions", &b)["timings"].clone()
        };
        let f = |k: &str| {
            t[k].as_f64()
                .unwrap_or_else(|| panic!("timings.{k} missing: {t}"))
        };
        for k in [
            "parse_ms",
            "queued_ms",
            "admit_ms",
            "prefill_ms",
            "first_token_ms",
            "generate_ms",
            "total_ms",
        ] {
            assert!(f(k) >= 0.0, "{k}: {t}");
        }
        // Arrival to first token covers the queue, admission and prefill; the total covers
        // the first token and the generation after it.
        assert!(
            f("first_token_ms") + 1e-3 >= f("queued_ms") + f("admit_ms") + f("prefill_ms") - 3e-3,
            "{t}"
        );
        assert!(
            (f("total_ms") - f("first_token_ms") - f("generate_ms")).abs() < 3e-3,
            "{t}"
        );
        assert!(
            f("generate_ms") > 0.0,
            "two more tokens were generated: {t}"
        );
        // The second request finds the prompt stored: nothing to prefill.
        if stream {
            assert!(f("prefill_ms") < 1.0, "{t}");
        }
    }
    server.shutdown().unwrap();
}

/// `fork` with `n`: that many branches of one session; branch 0 continues exactly as the
/// parent does, branch `i` samples with seed `seed + i` (what the library's `reseed` gives),
/// so sampled branches draw apart.
#[test]
fn fork_n_makes_branches_that_draw_apart() {
    let m = lfm2();
    let v = m.vocab();
    let server = start(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let head = tokens(51, 21, v);
    let sampler = json!({"temperature": 0.9, "seed": 3});
    let sid = c.ok("/v1/sessions", &json!({"tokens": head, "sampler": sampler}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    for bad in [0, 17] {
        assert_4xx(
            &c.post(&format!("/v1/sessions/{sid}/fork"), &json!({"n": bad})),
            400,
            "invalid_request",
        );
    }
    let f = c.ok(&format!("/v1/sessions/{sid}/fork"), &json!({"n": 3}));
    assert_eq!(f["forked_from"], sid);
    assert_eq!(f["pos"], 21);
    let branches: Vec<String> = f["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect();
    assert_eq!(branches.len(), 3);
    let generate = |id: &str| {
        ids(&c.ok(
            &format!("/v1/sessions/{id}/generate"),
            &json!({"max_tokens": 10, "ignore_eos": true}),
        )["tokens"])
    };
    let parent = generate(&sid);
    let got: Vec<Vec<u32>> = branches.iter().map(|b| generate(b)).collect();
    assert_eq!(got[0], parent, "branch 0 continues as the parent");
    for (i, g) in got.iter().enumerate() {
        let mut s = m.session().unwrap();
        s.set_sampler(SamplerState::seeded(3, 0.9, 0, 1.0));
        s.append(&head).unwrap();
        if i > 0 {
            s.reseed(3 + i as u64);
        }
        assert_eq!(
            g,
            &s.generate(10).unwrap(),
            "branch {i} against the library"
        );
    }
    assert!(
        got[1] != got[0] && got[2] != got[1] && got[2] != got[0],
        "{got:?}"
    );

    // The same three branches generated in one batched generate: each answers what its own
    // generate answered, in the listed order, and an unknown or repeated id is its own error.
    let again = c.ok("/v1/sessions", &json!({"tokens": head, "sampler": sampler}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let f = c.ok(&format!("/v1/sessions/{again}/fork"), &json!({"n": 3}));
    let fresh: Vec<String> = f["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect();
    let mut listed = vec![fresh[2].clone(), "0".repeat(32)];
    listed.extend([fresh[0].clone(), fresh[1].clone()]);
    let r = c.ok(
        "/v1/sessions/generate",
        &json!({"sessions": listed, "max_tokens": 10, "ignore_eos": true}),
    );
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 4);
    assert_eq!(results[1]["status"], 404, "{}", results[1]);
    for (at, branch) in [(0, 2), (2, 0), (3, 1)] {
        assert_eq!(results[at]["session"], listed[at]);
        assert_eq!(ids(&results[at]["tokens"]), got[branch], "branch {branch}");
    }
    for (bad, code) in [
        (json!({"sessions": []}), "invalid_sessions"),
        (
            json!({"sessions": [fresh[0], fresh[0]]}),
            "invalid_sessions",
        ),
        (
            json!({"sessions": [fresh[0]], "stream": true}),
            "unsupported_parameter",
        ),
    ] {
        assert_4xx(&c.post("/v1/sessions/generate", &bad), 400, code);
    }
    server.shutdown().unwrap();
}

/// Capsule files damaged on disk while the server was down (opening reads only their headers):
/// a completion that would have reused one is answered from a cold prefill, with the same
/// tokens; a client restoring or exporting one by id gets 410 `capsule_lost` without the
/// server's paths, and the capsule is gone from the store.
#[test]
fn a_damaged_capsule_file_is_a_cache_miss_or_a_410_never_a_failure() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("damaged");
    let server = start(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    let prompt = tokens(31, 40, v);
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0});
    let first = ids(&c.ok("/v1/completions", &body)["choices"][0]["token_ids"]);
    let s = c.ok("/v1/sessions", &json!({"tokens": tokens(32, 25, v)}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let cap = c.ok(&format!("/v1/sessions/{s}/snapshot"), &json!({}))["capsule"]
        .as_str()
        .unwrap()
        .to_string();
    server.shutdown().unwrap();
    let mut damaged = 0;
    for e in std::fs::read_dir(&*dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "caps") {
            let mut b = std::fs::read(&p).unwrap();
            let at = b.len() - 64;
            b[at] ^= 0x10;
            std::fs::write(&p, b).unwrap();
            damaged += 1;
        }
    }
    assert!(damaged >= 2, "{damaged} files");

    let server = start(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    assert_eq!(
        c.ok_get(&format!("/v1/capsules/{cap}"))["tiers"],
        json!(["disk"])
    );
    let again = c.ok("/v1/completions", &body);
    assert_eq!(ids(&again["choices"][0]["token_ids"]), first);
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let dir_name = dir.to_string_lossy().into_owned();
    let s2 = c.ok("/v1/sessions", &json!({}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let r = c.post(
        &format!("/v1/sessions/{s2}/restore"),
        &json!({"capsule": cap}),
    );
    let text = String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!(r.status, 410, "{text}");
    assert_eq!(r.json()["error"]["code"], "capsule_lost");
    assert!(!text.contains(&dir_name), "{text}");
    assert_eq!(c.get(&format!("/v1/capsules/{cap}")).status, 404);
    // The session is as it was, and the server goes on serving.
    assert_eq!(c.ok_get(&format!("/v1/sessions/{s2}"))["pos"], 0);
    assert_eq!(
        ids(&c.ok("/v1/completions", &body)["choices"][0]["token_ids"]),
        first
    );
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(
        metrics.contains("flashrt_store_corrupt_files_total 2"),
        "{metrics}"
    );
    server.shutdown().unwrap();
}
