//! Text in and out against transformers: the repository's tiny byte-level BPE tokenizer and
//! chat template (tests/fixtures/text, made by scripts/make-text-fixtures.py), rendered and
//! tokenized exactly as transformers' `apply_chat_template` does; streamed text equal to the
//! non-streamed text; stop strings that never reach the stream.

mod common;

use common::*;
use flashrt_serve::text::{ChatTemplate, RenderOptions, Text, TextStream, cut_at_stop};
use serde_json::{Value, json};
use std::path::PathBuf;

fn text_dir() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/text")
}

fn text() -> Text {
    Text::from_dir(&text_dir())
        .unwrap()
        .expect("the fixture has a tokenizer")
}

fn cases(name: &str) -> Vec<Value> {
    let t = std::fs::read_to_string(text_dir().join(name)).unwrap();
    serde_json::from_str(&t).unwrap()
}

#[test]
fn chat_templates_render_exactly_as_transformers() {
    let t = text();
    let template = t
        .template
        .as_ref()
        .expect("the fixture has a chat template");
    let all = cases("chat_cases.json");
    assert!(all.len() >= 7);
    for c in &all {
        let opts = RenderOptions {
            tools: c.get("tools").cloned().filter(|v| !v.is_null()),
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
            kwargs: c["kwargs"].as_object().cloned().unwrap_or_default(),
        };
        let got = template.render(&c["messages"], &opts).unwrap();
        assert_eq!(
            got,
            c["expected_text"].as_str().unwrap(),
            "case {}",
            c["name"]
        );
        let ids = t.tokenizer.encode(&got).unwrap();
        assert_eq!(ids, ids_of(&c["expected_ids"]), "case {}", c["name"]);
    }
    // The template's own error reaches the caller.
    let e = template
        .render(
            &json!([{"role": "robot", "content": "?"}]),
            &RenderOptions::default(),
        )
        .unwrap_err();
    assert_eq!(e, "unknown role: robot");
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenizer_encodes_and_decodes_as_transformers() {
    let t = text();
    for c in cases("encode_cases.json") {
        let s = c["text"].as_str().unwrap();
        let ids = t.tokenizer.encode(s).unwrap();
        assert_eq!(ids, ids_of(&c["ids"]), "encode {s:?}");
        assert_eq!(
            t.tokenizer.decode_with(&ids, false),
            c["decoded"].as_str().unwrap()
        );
        assert_eq!(
            t.tokenizer.decode(&ids),
            c["decoded_skip_special"].as_str().unwrap()
        );
    }
    assert_eq!(t.eos_token_id(), t.tokenizer.token_id("<|im_end|>"));
}

#[test]
fn templates_are_found_in_tokenizer_config_too() {
    let dir = temp_dir("tmpl");
    let src = std::fs::read_to_string(text_dir().join("chat_template.jinja")).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": src}],
               "eos_token": {"content": "<|im_end|>", "special": true}})
        .to_string(),
    )
    .unwrap();
    let from_config = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let from_file = text().template.unwrap();
    let msgs = json!([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]);
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    assert_eq!(
        from_config.render(&msgs, &opts),
        from_file.render(&msgs, &opts)
    );
    std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
    assert!(ChatTemplate::from_dir(&dir).unwrap().is_none());
    std::fs::write(dir.join("chat_template.jinja"), "{% if %}").unwrap();
    let e = ChatTemplate::from_dir(&dir).unwrap_err();
    assert!(e.contains("does not compile"), "{e}");
}

/// Ids of texts with multi-byte characters, so pieces end inside characters.
fn sequences(t: &Text) -> Vec<Vec<u32>> {
    let texts = [
        "机器人把红色的方块放在桌子上。今天天气很好。",
        "emoji 🤖🚀 and symbols: ∑ √ ∞ ≈ ≠ → ←",
        "def add(a, b):\n    return a + b\n",
        "Les robots aiment les capsules: sauvegarder, restaurer.",
    ];
    let mut out: Vec<Vec<u32>> = texts
        .iter()
        .map(|s| t.tokenizer.encode(s).unwrap())
        .collect();
    // And arbitrary ids (any byte sequence, invalid UTF-8 included), special tokens among them.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    for len in [1, 7, 40, 120] {
        out.push(
            (0..len)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s % 512) as u32
                })
                .collect(),
        );
    }
    out
}

#[test]
fn streamed_text_is_whole_characters_and_adds_up_to_the_text() {
    let t = text();
    for ids in sequences(&t) {
        let full = t.tokenizer.decode(&ids);
        let mut ts = TextStream::new(&t.tokenizer, &[]);
        let mut streamed = String::new();
        for &id in &ids {
            let p = ts.push(id);
            assert!(!p.stop);
            if !full.contains('\u{FFFD}') {
                assert!(
                    !p.text.contains('\u{FFFD}'),
                    "a split character in {:?}",
                    p.text
                );
            }
            streamed.push_str(&p.text);
        }
        streamed.push_str(&ts.finish().text);
        assert_eq!(streamed, full);
        assert_eq!(ts.text(), full);
    }
}

#[test]
fn stop_strings_never_reach_the_stream() {
    let t = text();
    for ids in sequences(&t) {
        let full = t.tokenizer.decode(&ids);
        let chars: Vec<(usize, char)> = full.char_indices().collect();
        if chars.len() < 6 {
            continue;
        }
        // A stop string from the middle of the text, and one that never occurs.
        let (a, b) = (chars[chars.len() / 2].0, chars[chars.len() / 2 + 2].0);
        for stop in [full[a..b].to_string(), "\u{1}never".to_string()] {
            let stops = vec![stop.clone()];
            let want = cut_at_stop(&full, &stops);
            let mut ts = TextStream::new(&t.tokenizer, &stops);
            let mut streamed = String::new();
            let mut stopped = false;
            for &id in &ids {
                let p = ts.push(id);
                streamed.push_str(&p.text);
                assert!(!streamed.contains(&stop), "{stop:?} leaked: {streamed:?}");
                if p.stop {
                    stopped = true;
                    break;
                }
            }
            streamed.push_str(&ts.finish().text);
            assert_eq!(streamed, want, "stop {stop:?}");
            assert_eq!(stopped, want.len() < full.len());
        }
    }
}

/// The fixture model with the text fixture beside it, as a checkpoint folder would hold them.
fn server() -> (flashrt_serve::Server, flashrt_runtime::Model) {
    let m = model("qwen35-public", 512);
    let cfg = flashrt_serve::ServeConfig {
        eos: vec![text().eos_token_id().unwrap()],
        ..config(None, None)
    };
    (
        flashrt_serve::Server::start(m.clone(), Some(text()), cfg).unwrap(),
        m,
    )
}

fn stream_text(r: &Resp, chat: bool) -> String {
    let ev = r.events();
    ev[..ev.len() - 1]
        .iter()
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            let c = &v["choices"][0];
            let piece = if chat {
                &c["delta"]["content"]
            } else {
                &c["text"]
            };
            piece.as_str().unwrap_or("").to_string()
        })
        .collect()
}

/// A conversation sent again with one more turn (what a chat client does): the server
/// tokenizes it from the previous turn's ids (`/metrics` counts it), and the ids are exactly the
/// template's rendering encoded whole — the answer equals the runtime's greedy tokens on them.
#[test]
fn a_conversation_sent_again_reuses_its_tokenization_exactly() {
    let m = model("qwen35-public", 4096);
    let cfg = flashrt_serve::ServeConfig {
        eos: vec![text().eos_token_id().unwrap()],
        ..config(None, None)
    };
    let server = flashrt_serve::Server::start(m.clone(), Some(text()), cfg).unwrap();
    let c = Client::new(server.addr(), None);
    let t = text();
    let template = t.template.as_ref().unwrap();
    let line = "The arm reached the shelf, paused, and picked up the red cup. ";
    let mut messages = vec![json!({"role": "system", "content": "You control a robot arm."})];
    for turn in 0..3 {
        messages.push(json!({"role": "user", "content": line.repeat(20 + turn)}));
        let body = json!({"messages": messages, "max_tokens": 4, "temperature": 0,
                          "ignore_eos": true});
        let r = c.ok("/v1/chat/completions", &body);
        let prompt = template
            .render(
                &Value::Array(messages.clone()),
                &flashrt_serve::text::RenderOptions {
                    tools: None,
                    add_generation_prompt: true,
                    kwargs: Default::default(),
                },
            )
            .unwrap();
        let ids = t.tokenizer.encode(&prompt).unwrap();
        assert_eq!(r["usage"]["prompt_tokens"], ids.len(), "turn {turn}");
        let mut s = m.session().unwrap();
        s.append(&ids).unwrap();
        assert_eq!(
            ids_of(&r["choices"][0]["message"]["token_ids"]),
            s.decode_greedy(4).unwrap(),
            "turn {turn}"
        );
        let answer = r["choices"][0]["message"]["content"].clone();
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    let reused = metrics
        .lines()
        .find_map(|l| l.strip_prefix("flashrt_prompt_tokenizations_reused_total "))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0);
    assert!(
        reused >= 2,
        "turns 2 and 3 reuse turn 1 and 2's ids: {reused}"
    );
    server.shutdown().unwrap();
}

#[test]
fn chat_completions_use_the_models_template_and_stream_what_they_return() {
    let (server, m) = server();
    let c = Client::new(server.addr(), None);
    let case = cases("chat_cases.json")
        .into_iter()
        .find(|c| c["name"] == "tools, a tool call and its result")
        .unwrap();
    let body = json!({"messages": case["messages"], "tools": case["tools"], "max_tokens": 12,
                      "temperature": 0, "ignore_eos": true});
    let r = c.ok("/v1/chat/completions", &body);
    let expected_prompt = ids_of(&case["expected_ids"]);
    assert_eq!(r["usage"]["prompt_tokens"], expected_prompt.len());
    // The same prompt ids through the runtime give the same greedy tokens.
    let mut s = m.session().unwrap();
    s.append(&expected_prompt).unwrap();
    let want = s.decode_greedy(12).unwrap();
    let got = ids_of(&r["choices"][0]["message"]["token_ids"]);
    assert_eq!(got, want);
    let text_nonstream = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(text_nonstream, text().tokenizer.decode(&want));
    // Streamed: the same text, piece by piece.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let rs = c.post("/v1/chat/completions", &sbody);
    assert_eq!(stream_text(&rs, true), text_nonstream);
    // A stop string: cut in both, never streamed.
    let chars: Vec<(usize, char)> = text_nonstream.char_indices().collect();
    if chars.len() > 4 {
        let stop = text_nonstream[chars[2].0..chars[4].0].to_string();
        let mut b = body.clone();
        b["stop"] = json!([stop]);
        let r = c.ok("/v1/chat/completions", &b);
        let cut = cut_at_stop(&text_nonstream, std::slice::from_ref(&stop));
        assert_eq!(r["choices"][0]["message"]["content"], json!(cut));
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        b["stream"] = json!(true);
        assert_eq!(stream_text(&c.post("/v1/chat/completions", &b), true), cut);
    }
    // chat_template_kwargs reach the template.
    let off = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                     "chat_template_kwargs": {"enable_thinking": false}});
    let on = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
    let p_off = c.ok("/v1/chat/completions", &off)["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    let p_on = c.ok("/v1/chat/completions", &on)["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        p_off > p_on,
        "the empty thinking block adds tokens: {p_off} vs {p_on}"
    );
    // A text completion streams the same text as it returns.
    let body = json!({"prompt": "The robot picked up", "max_tokens": 10, "temperature": 0, "ignore_eos": true});
    let r = c.ok("/v1/completions", &body);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    assert_eq!(
        stream_text(&c.post("/v1/completions", &sbody), false),
        r["choices"][0]["text"].as_str().unwrap()
    );
    // Clear errors for what the client can fix.
    assert_eq!(
        c.post(
            "/v1/chat/completions",
            &json!({"messages": [{"content": "x"}]})
        )
        .status,
        400
    );
    assert_eq!(
        c.post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "robot", "content": "x"}]})
        )
        .code(),
        "chat_template"
    );
    server.shutdown().unwrap();
}
