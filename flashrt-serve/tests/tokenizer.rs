//! Text in and out through a `tokenizer.json` (only with `--features tokenizers`): a small
//! word-level tokenizer over the fixture's vocabulary, text prompts, ChatML chat, and text
//! streaming.
#![cfg(feature = "tokenizers")]

mod common;

use common::*;
use flashrt_serve::tokenizer::Tokenizer;
use serde_json::{Value, json};

fn word_level(dir: &std::path::Path, vocab: usize) -> Tokenizer {
    let mut words = serde_json::Map::new();
    words.insert("<|im_start|>".into(), json!(0));
    words.insert("<|im_end|>".into(), json!(1));
    words.insert("[UNK]".into(), json!(2));
    for i in 3..vocab {
        words.insert(format!("w{i}"), json!(i));
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<|im_start|>"), special(1, "<|im_end|>")],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": Value::Object(words), "unk_token": "[UNK]"},
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tj.to_string()).unwrap();
    Tokenizer::load(&path).unwrap()
}

#[test]
fn text_prompts_chat_and_streaming_text() {
    let m = lfm2();
    let dir = temp_dir("tok");
    let tok = word_level(&dir, m.vocab());
    assert_eq!(tok.encode("w5 w9 w10").unwrap(), vec![5, 9, 10]);
    let server = flashrt_serve::Server::start(m.clone(), Some(tok), config(None, None)).unwrap();
    let c = Client::new(server.addr(), None);
    let r = c.ok(
        "/v1/completions",
        &json!({"prompt": "w5 w9 w10 w11", "max_tokens": 4, "temperature": 0}),
    );
    let ids_out = ids(&r["choices"][0]["token_ids"]);
    let want: Vec<String> = ids_out.iter().map(|t| format!("w{t}")).collect();
    assert_eq!(r["choices"][0]["text"], want.join(" "));
    // The same prompt as ids gives the same tokens.
    let r2 = c.ok(
        "/v1/completions",
        &json!({"prompt": [5, 9, 10, 11], "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(ids(&r2["choices"][0]["token_ids"]), ids_out);
    // Chat: ChatML around the messages.
    let chat = c.ok("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "w7 w8"}], "max_tokens": 3, "temperature": 0}));
    assert!(chat["usage"]["prompt_tokens"].as_u64().unwrap() >= 4);
    assert!(chat["choices"][0]["message"]["content"].is_string());
    // Streaming text pieces add up to the text.
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": "w5 w9 w10 w11", "max_tokens": 4, "temperature": 0, "stream": true}),
    );
    let text: String = r.events()[..r.events().len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(text.trim(), want.join(" "));
    // Stop strings cut the text.
    let stop = want[1].clone();
    let r = c.ok(
        "/v1/completions",
        &json!({"prompt": "w5 w9 w10 w11", "max_tokens": 4, "temperature": 0, "stop": [stop]}),
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["choices"][0]["text"].as_str().unwrap().trim(), want[0]);
    server.shutdown().unwrap();
}
