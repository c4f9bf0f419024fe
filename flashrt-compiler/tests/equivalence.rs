//! The same model written in TOML and in the attribute form gives identical IR.

mod common;

use common::*;
use flashrt_compiler::{model_from_tokens, model_from_toml};

fn same_model(stem: &str) {
    let (_, text, default_name) = MACRO_MODELS.iter().find(|(s, _, _)| *s == stem).unwrap();
    let from_toml = model_from_toml(&model_file(stem), stem).unwrap_or_else(|e| panic!("{e}"));
    let from_tokens =
        model_from_tokens(tokens(text), *default_name).unwrap_or_else(|e| panic!("{stem}: {e}"));
    assert_eq!(from_tokens, from_toml, "{stem}");
    assert_eq!(from_tokens.ir_hash(), from_toml.ir_hash(), "{stem}");
}

#[test]
fn qwen35_toml_and_tokens_agree() {
    same_model("qwen35-tiny");
}

#[test]
fn lfm2_toml_and_tokens_agree() {
    same_model("lfm2-tiny");
}

#[test]
fn nemotronh_toml_and_tokens_agree() {
    same_model("nemotronh-tiny");
}

#[test]
fn qwen36_27b_toml_and_tokens_agree() {
    same_model("qwen36-27b");
}

#[test]
fn quote_built_tokens_work() {
    let heads = 4usize;
    let ts = quote::quote! {
        model = {
            name = "q", vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
            prefill_buckets = [16, 64], norm = { eps = 1e-6, weight = one_plus }, weights = qwen3_5_text,
        },
        kinds = {
            gated_deltanet = {
                mixer = { kind = gated_deltanet, key_heads = 2, value_heads = #heads, key_dim = 16, value_dim = 16, conv = 4 },
                mlp = { kind = swiglu, intermediate = 128 },
            },
            attention = {
                mixer = { kind = attention, q_heads = #heads, kv_heads = 2, head_dim = 32, qk_norm = true,
                          rope = { theta = 10000.0, fraction = 0.25 }, output_gate = true },
                mlp = { kind = swiglu, intermediate = 128 },
            },
        },
        stack = { pattern = [gated_deltanet, gated_deltanet, gated_deltanet, attention] },
    };
    let ir = model_from_tokens(ts, None).unwrap();
    let mut expected = model_from_toml(&model_file("qwen35-tiny"), "q").unwrap();
    expected.name = "q".into();
    assert_eq!(ir, expected);
}

#[test]
fn default_name_applies_only_when_name_is_missing() {
    let ir = model_from_tokens(tokens(QWEN35_TINY), Some("my_model")).unwrap();
    assert_eq!(ir.name, "my_model");
    let ir = model_from_tokens(tokens(QWEN36_27B), Some("other")).unwrap();
    assert_eq!(ir.name, "qwen36_27b");
    let err = model_from_tokens(tokens(QWEN35_TINY), None).unwrap_err();
    assert_eq!(err.to_string(), "missing key `name` in `model`");
}

#[test]
fn spellings_that_mean_the_same() {
    // Raw identifiers, string keys, suffixed and negative-free literals, trailing commas,
    // dtype aliases, integer-valued floats.
    let a = model_from_tokens(tokens(LFM2_TINY), None).unwrap();
    let variant = LFM2_TINY
        .replace("dtype = \"f32\"", "r#dtype = float32")
        .replace("hidden = 64", "\"hidden\" = 64u32")
        .replace("theta = 1e6", "theta = 1_000_000.0f64");
    let b = model_from_tokens(tokens(&variant), None).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a, b);
}

#[test]
fn zero_has_one_spelling() {
    let base = model_file("nemotronh-tiny");
    let a = model_from_toml(&base.replace("dt_min = 0.001", "dt_min = -0.0"), "a").unwrap();
    let b = model_from_toml(&base.replace("dt_min = 0.001", "dt_min = 0"), "b").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.ir_hash(), b.ir_hash());
    let c = model_from_tokens(
        tokens(&NEMOTRONH_TINY.replace("dt_min = 1e-3", "dt_min = -0.0")),
        None,
    )
    .unwrap();
    assert_eq!(c.ir_hash(), b.ir_hash());
}

/// The two examples in the crate-root docs parse and describe the same model.
#[test]
fn crate_doc_examples_agree() {
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs")).unwrap();
    let doc: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let block = |open: &str| {
        let start = doc.find(open).expect("example block") + open.len();
        let len = doc[start..].find("```").unwrap();
        doc[start..start + len].to_string()
    };
    let toml = block("```toml\n");
    let rust = block("```text\n#[flashrt::model(");
    let rust = rust
        .trim_end()
        .strip_suffix("struct Tiny;")
        .unwrap()
        .trim_end()
        .strip_suffix(")]")
        .unwrap();
    let a = model_from_toml(&toml, "doc.toml").unwrap_or_else(|e| panic!("{e}"));
    let b = model_from_tokens(tokens(rust), Some("tiny")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a, b);
    assert_eq!(a.layers.len(), 8);
}
