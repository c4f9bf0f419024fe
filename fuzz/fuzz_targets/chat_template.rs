//! Fuzz the chat-template input a client controls: messages, tools and template keywords of
//! any shape (from JSON, or built from raw bytes) rendered with the repository's test template.
//! Rendering may fail with an error; it must never panic or hang.
#![no_main]

use flashrt_serve::text::{ChatTemplate, RenderOptions};
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};
use std::sync::OnceLock;

const TEMPLATE: &str = include_str!("../../tests/fixtures/text/chat_template.jinja");

fn template() -> &'static ChatTemplate {
    static T: OnceLock<ChatTemplate> = OnceLock::new();
    T.get_or_init(|| {
        let mut special = serde_json::Map::new();
        special.insert("eos_token".into(), json!("<|im_end|>"));
        ChatTemplate::new(TEMPLATE, special, "fuzz").expect("the test template compiles")
    })
}

fuzz_target!(|data: &[u8]| {
    let (messages, opts) = match serde_json::from_slice::<Value>(data) {
        Ok(Value::Object(mut o)) => {
            let messages = o.remove("messages").unwrap_or(Value::Array(vec![]));
            let opts = RenderOptions {
                tools: o.remove("tools"),
                add_generation_prompt: o.get("add_generation_prompt").and_then(Value::as_bool).unwrap_or(true),
                kwargs: o,
            };
            (messages, opts)
        }
        Ok(v) => (v, RenderOptions::default()),
        // Raw bytes: NUL-separated role/content pairs.
        Err(_) => {
            let text = String::from_utf8_lossy(data);
            let parts: Vec<&str> = text.split('\0').collect();
            let msgs = parts
                .chunks(2)
                .map(|p| json!({"role": p[0], "content": p.get(1).copied().unwrap_or("")}))
                .collect();
            (Value::Array(msgs), RenderOptions { add_generation_prompt: true, ..Default::default() })
        }
    };
    let _ = template().render(&messages, &opts);
});
