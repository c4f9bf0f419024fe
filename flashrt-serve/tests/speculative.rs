//! Speculative decoding in the server (MTP head, greedy): over HTTP, completions with
//! `speculative` produce exactly the tokens plain greedy decoding of the library produces —
//! streamed and not, across stop tokens and the prefix cache — and the rounds are counted per
//! request and in /metrics. CPU backend, a small Qwen3.5-family model with one MTP layer and
//! random weights (which accept few drafts: rejections and rollbacks are exercised).

mod common;

use common::*;
use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::{CpuBackend, Model};
use serde_json::{Value, json};
use std::sync::Arc;

const QWEN_MTP: &str = r#"{
  "model_type": "qwen3_5_text",
  "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
  "num_hidden_layers": 4,
  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
  "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "hidden_act": "silu", "dtype": "float32",
  "mtp_num_hidden_layers": 1
}"#;

fn mtp_model() -> Model {
    let opts = HfOptions {
        name: Some("spec_serve".into()),
        max_seq: Some(256),
        prefill_buckets: Some(vec![4, 16]),
        dtype: Some(flashrt_runtime::ir::DType::F32),
        ..HfOptions::default()
    };
    let ir = ir_from_hf_config(QWEN_MTP, &opts).unwrap();
    Model::with_random_weights(Arc::new(CpuBackend::with_threads(1)), &ir, 11).unwrap()
}

fn greedy(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = m.session().unwrap();
    s.append(prompt).unwrap();
    s.decode_greedy(n).unwrap()
}

fn metric(c: &Client, name: &str) -> u64 {
    let text = String::from_utf8(c.get("/metrics").body).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("/metrics lacks {name}"))
        .parse()
        .unwrap()
}

#[test]
fn speculative_completions_equal_plain_greedy() {
    let m = mtp_model();
    let v = m.vocab();
    let mut cfg = config(None, None);
    cfg.speculative = 3;
    let server = start(&m, cfg);
    let c = Client::new(server.addr(), None);
    let mut rounds = 0;
    for seed in 0..4u64 {
        let prompt = tokens(100 + seed, 9 + 5 * seed as usize, v);
        let want = greedy(&m, &prompt, 20);
        let body =
            json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": true});
        let a = c.ok("/v1/completions", &body);
        assert_eq!(ids(&a["choices"][0]["token_ids"]), want, "prompt {seed}");
        // Streamed: the same tokens.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let ev = c.post("/v1/completions", &sb).events();
        let streamed: Vec<u32> = ev[..ev.len() - 1]
            .iter()
            .flat_map(|e| {
                ids(&serde_json::from_str::<Value>(e).unwrap()["choices"][0]["token_ids"])
            })
            .collect();
        assert_eq!(streamed, want, "prompt {seed}, streamed");
        let spec = &a["speculative"];
        assert!(spec.is_object(), "{a}");
        assert!(spec["accepted"].as_u64().unwrap() <= spec["drafted"].as_u64().unwrap());
        rounds += spec["rounds"].as_u64().unwrap();
    }
    assert!(rounds > 0, "no speculative round ran");
    assert!(metric(&c, "flashrt_speculative_rounds_total") >= rounds);
    assert!(
        metric(&c, "flashrt_speculative_drafted_total")
            >= metric(&c, "flashrt_speculative_accepted_total")
    );
    assert!(metric(&c, "flashrt_speculative_drafts_per_round") <= 4);

    // A stop token inside a round ends the answer there.
    let prompt = tokens(7, 12, v);
    let want = greedy(&m, &prompt, 12);
    let stop = want[5];
    let cut = want.iter().position(|&t| t == stop).unwrap();
    let a = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop],
                "speculative": 4}),
    );
    assert_eq!(ids(&a["choices"][0]["token_ids"]), want[..=cut].to_vec());
    assert_eq!(a["choices"][0]["finish_reason"], "stop");
    // A follow-up that extends prompt + answer still equals plain greedy decoding (whatever
    // the prefix cache restored).
    let mut longer = prompt.clone();
    longer.extend(&want[..=cut]);
    longer.extend(tokens(8, 3, v));
    let b = c.ok(
        "/v1/completions",
        &json!({"prompt": longer, "max_tokens": 10, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(ids(&b["choices"][0]["token_ids"]), greedy(&m, &longer, 10));

    // Per request: 0 is plain decoding; sampled requests never speculate; > 4 is refused.
    let plain = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "speculative": 0}),
    );
    assert!(plain["speculative"].is_null());
    let sampled = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0.8, "seed": 1}),
    );
    assert!(sampled["speculative"].is_null());
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "speculative": 5}),
    );
    assert_eq!(r.status, 400);
    server.shutdown().unwrap();
}
