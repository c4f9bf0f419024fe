//! Shared helpers: the model files, and the same models written in the attribute form.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn models_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models")
}

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// Every `models/*.toml`, as (file stem, source), sorted by name.
pub fn model_files() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(models_dir())
        .expect("models/ exists")
        .map(|e| e.expect("readable dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            (
                stem,
                std::fs::read_to_string(&p).expect("readable model file"),
            )
        })
        .collect();
    out.sort();
    out
}

pub fn model_file(stem: &str) -> String {
    std::fs::read_to_string(models_dir().join(format!("{stem}.toml"))).expect("model file")
}

pub fn tokens(src: &str) -> proc_macro2::TokenStream {
    syn::parse_str(src).expect("test tokens lex")
}

/// `models/qwen35-tiny.toml` in the attribute form (bare identifiers, an integer theta,
/// defaults left out, the name supplied by the caller).
pub const QWEN35_TINY: &str = r#"
    model = {
        vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
        prefill_buckets = [16, 64],
        norm = { kind = rms, eps = 1e-6, weight = one_plus },
        weights = qwen3_5_text,
    },
    kinds = {
        gated_deltanet = {
            mixer = { kind = gated_deltanet, key_heads = 2, value_heads = 4, key_dim = 16, value_dim = 16, conv = 4 },
            mlp = { kind = swiglu, intermediate = 128 },
        },
        attention = {
            mixer = {
                kind = attention, q_heads = 4, kv_heads = 2, head_dim = 32, qk_norm = true,
                rope = { theta = 10_000, fraction = 0.25 }, output_gate = true,
            },
            mlp = { kind = swiglu, intermediate = 128 },
        },
    },
    stack = { pattern = [gated_deltanet, gated_deltanet, gated_deltanet, attention] },
"#;

/// `models/lfm2-tiny.toml` in the attribute form (quoted strings, explicit name).
pub const LFM2_TINY: &str = r#"
    model = {
        name = "lfm2_tiny", vocab = 512, hidden = 64, dtype = "f32", max_seq = 4096usize,
        prefill_buckets = [16, 64], norm = { eps = 1e-5 }, tie_embeddings = true, weights = "lfm2",
    },
    kinds = {
        short_conv = {
            mixer = { kind = "short_conv", conv = 3 },
            mlp = { kind = "swiglu", intermediate = 160 },
        },
        attention = {
            mixer = { kind = "attention", q_heads = 4, kv_heads = 2, head_dim = 16, qk_norm = true, rope = { theta = 1e6 } },
            mlp = { kind = "swiglu", intermediate = 160 },
        },
    },
    stack = { pattern = ["short_conv", "short_conv", "attention", "short_conv", "attention"], repeat = 1 }
"#;

/// `models/nemotronh-tiny.toml` in the attribute form (Mamba2 defaults left out).
pub const NEMOTRONH_TINY: &str = r#"
    model = {
        name = nemotronh_tiny, vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
        prefill_buckets = [16, 64], norm = { kind = rms, eps = 0.00001, weight = plain },
        tie_embeddings = false, weights = nemotron_h,
    },
    kinds = {
        mamba2 = { mixer = { kind = mamba2, heads = 8, head_dim = 16, groups = 2, state = 16, conv = 4, dt_min = 1e-3 } },
        attention = { mixer = { kind = attention, q_heads = 4, kv_heads = 2, head_dim = 16, rope = none } },
        mlp = { mlp = { kind = relu2, intermediate = 128 } },
    },
    stack = { pattern = [mamba2, mlp, mamba2, attention, mlp, mamba2] },
"#;

/// `models/qwen36-27b.toml` in the attribute form.
pub const QWEN36_27B: &str = r#"
    model = {
        name = qwen36_27b, vocab = 248320, hidden = 5120, dtype = bf16, max_seq = 32768,
        prefill_buckets = [32, 64, 256, 512, 1024, 2048, 4096],
        norm = { kind = rms, eps = 1e-6, weight = one_plus },
        weights = qwen3_5_text,
    },
    kinds = {
        gdn = {
            mixer = { kind = gated_deltanet, key_heads = 16, value_heads = 48, key_dim = 128, value_dim = 128, conv = 4 },
            mlp = { kind = swiglu, intermediate = 17408 },
        },
        attn = {
            mixer = {
                kind = attention, q_heads = 24, kv_heads = 4, head_dim = 256, qk_norm = true,
                rope = { theta = 1e7, fraction = 0.25 }, output_gate = true,
            },
            mlp = { kind = swiglu, intermediate = 17408 },
        },
    },
    stack = { repeat = 16, pattern = [gdn, gdn, gdn, attn] },
    mtp = { layers = 1, kind = attn },
"#;

/// The attribute-form texts with the model file each one mirrors and the default name to
/// pass.
pub const MACRO_MODELS: &[(&str, &str, Option<&str>)] = &[
    ("qwen35-tiny", QWEN35_TINY, Some("qwen35_tiny")),
    ("lfm2-tiny", LFM2_TINY, None),
    ("nemotronh-tiny", NEMOTRONH_TINY, None),
    (
        "qwen36-27b",
        QWEN36_27B,
        Some("ignored_because_the_name_is_given"),
    ),
];

/// xorshift64*: a tiny deterministic generator for the fuzz-style tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
