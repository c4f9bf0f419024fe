//! Every error is reported at once, each at the user's token.

mod common;

use common::*;
use flashrt_compiler::{model_from_tokens, model_from_toml};

/// `(line, col, message fragment)` of every error, in order.
fn toml_errors(src: &str) -> Vec<(usize, usize, String)> {
    let d = model_from_toml(src, "bad.toml").expect_err("the model is invalid");
    d.iter()
        .map(|e| (e.line, e.col, e.message.clone()))
        .collect()
}

fn assert_errors(got: &[(usize, usize, String)], want: &[(usize, usize, &str)]) {
    let show = || {
        got.iter()
            .map(|(l, c, m)| format!("{l}:{c}: {m}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(got.len(), want.len(), "got:\n{}", show());
    for ((l, c, m), (wl, wc, wm)) in got.iter().zip(want) {
        assert!(
            (l, c) == (wl, wc) && m.contains(wm),
            "expected {wl}:{wc}: ..{wm}.., got:\n{}",
            show()
        );
    }
}

const BAD: &str = r#"[model]
name = "Bad-Name"
vocab = 0
hidden = "64"
dtype = "bf17"
max_seq = 100
prefill_buckets = [64, 16, 128]
norm = { kind = "rms", eps = -1, wieght = "plain" }
weights = "qwen3"

[kinds.gdn]
mixer = { kind = "gated_deltanet", key_heads = 3, value_heads = 4, key_dim = 16, value_dim = 16, conv = 1 }

[kinds.attn]
mixer = { kind = "attention", q_head = 4, kv_heads = 3, head_dim = 30, rope = { theta = 1e4, fraction = 0.1 } }
mlp = { kind = "swiglo", intermediate = 1 }

[kinds.m]
mixer = { kind = "mamba2", heads = 3, head_dim = 16, groups = 2, state = 16, conv = 4 }
mlp = { kind = "relu2", intermediate = 64, gate = true }

[kinds.empty]

[kinds.conv]
mixer = { kind = "shortconv", conv = 4 }

[stack]
pattern = ["gdn", "atn", 3, "m"]
repeat = 0

[mtp]
layers = 1
kind = "mpt"
"#;

#[test]
fn toml_reports_every_error_at_its_token() {
    assert_errors(
        &toml_errors(BAD),
        &[
            (2, 8, "model name `Bad-Name` is not snake_case"),
            (3, 9, "expected a positive integer, found 0"),
            (4, 10, "expected a positive integer, found a string"),
            (5, 9, "unknown dtype `bf17`; did you mean `bf16`?"),
            (
                7,
                24,
                "prefill buckets must be strictly ascending: 16 follows 64",
            ),
            (7, 28, "prefill bucket 128 exceeds `max_seq` (100)"),
            (8, 30, "the norm epsilon must be positive"),
            (
                8,
                34,
                "unknown key `wieght` in `model.norm`; did you mean `weight`?",
            ),
            (
                9,
                11,
                "unknown weight naming `qwen3`; did you mean `qwen3_5_text`?",
            ),
            (
                12,
                48,
                "`value_heads` (4) is not a multiple of `key_heads` (3)",
            ),
            (12, 105, "kernel width of at least 2, found 1"),
            (
                15,
                1,
                "missing key `q_heads` in the attention mixer of kind `attn`",
            ),
            (15, 31, "unknown key `q_head`"),
            (
                15,
                105,
                "rotary dims = head_dim 30 x fraction 0.1 = 3 must be a positive even number",
            ),
            (16, 16, "unknown mlp kind `swiglo`; did you mean `swiglu`?"),
            (19, 63, "`heads` (3) is not a multiple of `groups` (2)"),
            (20, 44, "unknown key `gate` in the relu2 mlp of kind `m`"),
            (22, 8, "kind `empty` has neither a `mixer` nor an `mlp`"),
            (
                25,
                18,
                "unknown mixer kind `shortconv`; did you mean `short_conv`?",
            ),
            (
                28,
                19,
                "unknown layer kind `atn` in the stack pattern; did you mean `attn`?",
            ),
            (28, 26, "expected a string, found an integer"),
            (29, 10, "expected a positive integer, found 0"),
            (33, 8, "unknown layer kind `mpt` in `mtp`"),
        ],
    );
}

#[test]
fn toml_rendering_is_rustc_style() {
    let src = "[model]\nname = \"x\"\nvocab = 8\nhidden = 8\ndtype = \"f32\"\nmax_seq = 8\nprefill_buckets = [4]\nnorm = { eps = 1e-6 }\nweights = \"lfm2\"\nvocabb = 3\n\n[kinds.a]\nmlp = { kind = \"relu2\", intermediate = 8 }\n\n[stack]\npattern = [\"a\"]\n";
    let d = model_from_toml(src, "models/x.toml").unwrap_err();
    assert_eq!(
        d.to_string(),
        "models/x.toml:10:1: error: unknown key `vocabb` in `model`; did you mean `vocab`?\n  |\n10 | vocabb = 3\n   | ^^^^^^"
            .replace("\n  |\n", "\n   |\n")
    );
    let e: &dyn std::error::Error = &d;
    assert!(e.to_string().starts_with("models/x.toml:10:1: error:"));
}

#[test]
fn toml_missing_sections_and_keys_point_at_their_table() {
    let got = toml_errors(
        "[model]\nname = \"x\"\n\n[kinds.a]\nmixer = { kind = \"attention\", q_heads = 2 }\n",
    );
    assert_errors(
        &got,
        &[
            (1, 1, "missing section `stack`"),
            (1, 2, "missing key `vocab` in `model`"),
            (1, 2, "missing key `hidden` in `model`"),
            (1, 2, "missing key `dtype` in `model`"),
            (1, 2, "missing key `max_seq` in `model`"),
            (1, 2, "missing key `prefill_buckets` in `model`"),
            (1, 2, "missing key `norm` in `model`"),
            (1, 2, "missing key `weights` in `model`"),
            (
                5,
                1,
                "missing key `kv_heads` in the attention mixer of kind `a`",
            ),
            (5, 1, "missing key `head_dim`"),
            (5, 1, "missing key `rope`"),
        ],
    );
    let got = toml_errors("");
    assert_errors(
        &got,
        &[
            (1, 1, "missing section `model`"),
            (1, 1, "missing section `kinds`"),
            (1, 1, "missing section `stack`"),
        ],
    );
}

#[test]
fn toml_syntax_errors_are_all_reported() {
    let got = toml_errors("[model\nx = = 3\nok = 1\nb = 'x\n");
    assert!(got.len() >= 3, "{got:?}");
    assert_eq!((got[0].0, got[0].1), (1, 7));
    assert!(got.iter().any(|e| e.0 == 2));
    // Syntax errors come alone: no "missing section" follow-ons.
    assert!(got.iter().all(|e| !e.2.contains("missing")), "{got:?}");

    let got = toml_errors("[model]\nname = \"a\"\nname = \"b\"\n");
    assert_eq!((got[0].0, got[0].1), (3, 1));
    assert!(got[0].2.contains("duplicate key"), "{got:?}");
}

#[test]
fn toml_type_errors_and_ranges() {
    let src = model_file("qwen35-tiny")
        .replace("vocab = 512", "vocab = 512.0")
        .replace("hidden = 64", "hidden = 99999999999")
        .replace("tie_embeddings = false", "tie_embeddings = \"no\"")
        .replace("fraction = 0.25", "fraction = 1.5")
        .replace(
            "conv = 4, norm_order = \"norm_then_gate\"",
            "conv = 4, norm_order = \"later\"",
        )
        .replace("max_seq = 4096", "max_seq = 1979-05-27")
        .replace("pattern = [", "repeat = 5000\npattern = [");
    let got = toml_errors(&src);
    let msgs: Vec<&str> = got.iter().map(|e| e.2.as_str()).collect();
    for want in [
        "expected a positive integer, found a float",
        "99999999999 is too large",
        "expected a positive integer, found a datetime",
        "expected `true` or `false`, found a string",
        "unknown norm order `later`",
        "the rotary fraction must be in (0, 1], found 1.5",
        "the stack expands to 20000 layers (at most 4096)",
    ] {
        assert!(
            msgs.iter().any(|m| m.contains(want)),
            "no `{want}` in {msgs:#?}"
        );
    }
    assert_eq!(got.len(), 7, "{msgs:#?}");
}

#[test]
fn toml_odd_rotary_dims_and_head_counts() {
    let src = model_file("qwen36-27b")
        .replace("fraction = 0.25", "fraction = 0.3")
        .replace("kv_heads = 4", "kv_heads = 5")
        .replace("value_heads = 48", "value_heads = 40")
        .replace("key_heads = 16", "key_heads = 0");
    let got = toml_errors(&src);
    let msgs: Vec<&str> = got.iter().map(|e| e.2.as_str()).collect();
    assert_eq!(got.len(), 3, "{msgs:#?}");
    assert!(msgs[0].contains("expected a positive integer, found 0"));
    assert!(msgs[1].contains("`q_heads` (24) is not a multiple of `kv_heads` (5)"));
    assert!(msgs[2].contains("= 76.8 is not an integer"));
}

/// Line and column (1-based) of each attribute-form error, with its message.
fn macro_errors(src: &str, default_name: Option<&str>) -> Vec<(usize, usize, String)> {
    let e = model_from_tokens(tokens(src), default_name).expect_err("the model is invalid");
    e.into_iter()
        .map(|e| {
            let start = e.span().start();
            (start.line, start.column + 1, e.to_string())
        })
        .collect()
}

#[test]
fn macro_reports_every_error_at_its_token() {
    let src = r#"model = { vocab = 512, hidden = -64, dtype = bf17, max_seq = 4096,
  prefill_buckets = [16, 64], norm = { eps = 1e-6, weight = one_plus }, weights = qwen3_5_text },
kinds = {
  gdn = { mixer = { kind = gated_deltanet, key_heads = 2, value_heads = 4, key_dim = 16, value_dim = 16 },
          mlp = { kind = swiglu, intermediate = 128, intermediate = 64 } },
  gdn = { mlp = { kind = relu2, intermediate = 8 } },
  attn = { mixer = { kind = attention, q_heads = 4, kv_heads = 2, head_dim = 32, rope = rotary } },
},
stack = { pattern = [gdn, gdn, gdm, attn] },
mtp = { layers = 1, kind = attn, extra = 1 },
"#;
    let got = macro_errors(src, Some("m"));
    assert_errors(
        &got,
        &[
            (1, 33, "expected a positive integer, found -64"),
            (1, 46, "unknown dtype `bf17`; did you mean `bf16`?"),
            (
                4,
                11,
                "missing key `conv` in the gated_deltanet mixer of kind `gdn`",
            ),
            (5, 54, "duplicate key `intermediate`"),
            (6, 3, "duplicate key `gdn` in `kinds`"),
            (
                7,
                89,
                "expected `rope = { theta = .., fraction = .. }` or `rope = \"none\"`, found `rotary`",
            ),
            (
                9,
                32,
                "unknown layer kind `gdm` in the stack pattern; did you mean `gdn`?",
            ),
            (10, 34, "unknown key `extra` in `mtp`"),
        ],
    );
}

#[test]
fn macro_syntax_errors_are_all_reported() {
    let src = "model = { vocab 512, hidden = (64), dtype = f32 = 3 }, kinds = { a = }, stack = [1 2], 7 = x, mtp";
    let got = macro_errors(src, None);
    let msgs: Vec<&str> = got.iter().map(|e| e.2.as_str()).collect();
    for want in [
        "expected `=` after `vocab`, found `512`",
        "expected a value, found `(`",
        "expected `,` after the value of `dtype`, found `=`",
        "expected a value",
        "expected `,` or `]`, found `2`",
        "expected a key (`name = value`), found `7`",
        "expected `= value` after `mtp`",
    ] {
        assert!(
            msgs.iter().any(|m| m.contains(want)),
            "no `{want}` in {msgs:#?}"
        );
    }
    // Syntax errors come alone.
    assert!(msgs.iter().all(|m| !m.contains("missing")), "{msgs:#?}");
    assert_eq!((got[0].0, got[0].1), (1, 17));
}

#[test]
fn macro_type_errors() {
    let src = QWEN36_27B
        .replace("vocab = 248320", "vocab = 'v'")
        .replace("qk_norm = true", "qk_norm = 1")
        .replace("norm = { kind = rms", "norm = { kind = layer")
        .replace("pattern = [gdn, gdn, gdn, attn]", "pattern = gdn")
        .replace("mtp = { layers = 1, kind = attn }", "mtp = [1]");
    let got = macro_errors(&src, None);
    let msgs: Vec<&str> = got.iter().map(|e| e.2.as_str()).collect();
    assert_eq!(
        msgs,
        [
            "expected a positive integer, found a character",
            "unknown norm kind `layer`; expected one of `rms`",
            "expected `true` or `false`, found an integer",
            "expected an array of kind names, found a string",
            "expected a table, found an array",
        ]
    );
}

const BAD_MOE: &str = r#"[model]
name = "m"
vocab = 64
hidden = 32
dtype = "f32"
max_seq = 128
prefill_buckets = [8]
norm = { kind = "rms", eps = 1e-5 }
weights = "qwen3_5_text"

[kinds.a]
mlp = { kind = "moe", experts = 8, top_k = 9, intermediate = 16, router = "softmx", act = "gelu" }

[kinds.b]
mlp = { kind = "moe", experts = 6, top_k = 2, intermediate = 16, groups = 4, scaling = 0, renorm_eps = -1 }

[kinds.c]
mlp = { kind = "moe", experts = 8, top_k = 4, intermediate = 16, groups = 4, top_groups = 1, shared = { gated = true } }

[kinds.d]
mlp = { kind = "moe", top_k = 1, intermediate = 16, bias = true }

[stack]
pattern = ["a", "b", "c", "d"]
"#;

#[test]
fn moe_errors_are_all_reported_at_their_tokens() {
    assert_errors(
        &toml_errors(BAD_MOE),
        &[
            (12, 44, "`top_k` (9) exceeds the number of experts (8)"),
            (
                12,
                75,
                "unknown router score `softmx`; did you mean `softmax`?",
            ),
            (12, 91, "unknown expert activation `gelu`"),
            (15, 75, "`experts` (6) is not a multiple of `groups` (4)"),
            (15, 88, "`scaling` must be positive, found 0"),
            (15, 104, "`renorm_eps` must not be negative, found -1"),
            (
                18,
                91,
                "1 groups of 2 experts cannot hold the top 4 experts",
            ),
            (18, 94, "missing key `intermediate` in the shared expert"),
            (21, 1, "missing key `experts` in the moe mlp of kind `d`"),
            (21, 53, "unknown key `bias` in the moe mlp of kind `d`"),
        ],
    );
}

#[test]
fn macro_reports_moe_errors_at_their_tokens() {
    let src = r#"model = { vocab = 64, hidden = 32, dtype = f32, max_seq = 128, prefill_buckets = [8],
  norm = { eps = 1e-5 }, weights = nemotron_h },
kinds = {
  e = { mlp = { kind = moe, experts = 8, top_k = 3, intermediate = 16, groups = 8, act = relu2 } },
},
stack = { pattern = [e] },
"#;
    let got = macro_errors(src, Some("m"));
    assert_errors(
        &got,
        &[(
            4,
            81,
            "groups of 1 expert cannot be scored by their two best experts",
        )],
    );
}

const QUANT_BASE: &str = r#"[model]
name = "q"
vocab = 64
hidden = 32
dtype = "bf16"
max_seq = 64
prefill_buckets = [16]
norm = { kind = "rms", eps = 1e-6 }
weights = "qwen3_5_text"
QUANTIZE

[kinds.attn]
mixer = { kind = "attention", q_heads = 2, kv_heads = 1, head_dim = 16, rope = { theta = 1e4 } }
mlp = { kind = "swiglu", intermediate = 64 }

[stack]
pattern = ["attn"]
"#;

#[test]
fn quantize_key_errors_are_all_reported() {
    let src = QUANT_BASE.replace(
        "QUANTIZE",
        r#"quantize = { format = "fp4", block = [128, 0], exclud = ["lm_head"] }"#,
    );
    assert_errors(
        &toml_errors(&src),
        &[
            (10, 23, "unknown quantization format `fp4`"),
            (10, 44, "expected a positive integer, found 0"),
            (10, 48, "unknown key `exclud`"),
        ],
    );
}

#[test]
fn quantize_exclude_names_must_exist() {
    let src = QUANT_BASE.replace(
        "QUANTIZE",
        r#"quantize = { format = "fp8_e4m3", exclude = ["lm_head", "mlp.down_prj", "layers.7.attn.q_proj"] }"#,
    );
    let got = toml_errors(&src);
    assert_errors(
        &got,
        &[
            (10, 57, "names `mlp.down_prj`, which is no weight matrix"),
            (10, 73, "names `layers.7.attn.q_proj`"),
        ],
    );
    assert!(got[0].2.contains("did you mean `mlp.down_proj`"), "{got:?}");
}

#[test]
fn decode_batch_ladder_errors_are_all_reported() {
    // Line 10: `decode_batches = [1, 4, 4, 32]`, columns 19, 22, 25, 28.
    let src = QUANT_BASE.replace("QUANTIZE", "decode_batches = [1, 4, 4, 32]");
    assert_errors(
        &toml_errors(&src),
        &[
            (10, 19, "decode batch 1 is not in 2..=8"),
            (
                10,
                25,
                "decode batches must be strictly ascending: 4 follows 4",
            ),
            (10, 28, "decode batch 32 is not in 2..=8"),
        ],
    );
    // Within the largest prefill bucket (16 here).
    let src = QUANT_BASE
        .replace("prefill_buckets = [16]", "prefill_buckets = [4]")
        .replace("QUANTIZE", "decode_batches = [2, 8]");
    assert_errors(
        &toml_errors(&src),
        &[(
            10,
            22,
            "decode batch 8 exceeds the largest prefill bucket (4)",
        )],
    );
    let src = QUANT_BASE.replace("QUANTIZE", "decode_batches = 4");
    assert_errors(
        &toml_errors(&src),
        &[(10, 18, "expected an array of batch sizes, found")],
    );
}

#[test]
fn decode_batch_ladder_reaches_the_ir_and_round_trips() {
    let src = QUANT_BASE.replace("QUANTIZE", "decode_batches = [2, 3]");
    let ir = model_from_toml(&src, "q.toml").expect("valid");
    assert_eq!(ir.decode_batches, vec![2, 3]);
    assert_eq!(ir.batch_sizes(), vec![2, 3]);
    let again = model_from_toml(&flashrt_compiler::ir_to_toml(&ir), "again.toml")
        .expect("the canonical form parses");
    assert_eq!(again, ir);
    // Without the key: the default ladder, left out of the canonical form and the hash.
    let plain = model_from_toml(&QUANT_BASE.replace("QUANTIZE", ""), "q.toml").expect("valid");
    assert_eq!(plain.decode_batches, flashrt_ir::DEFAULT_DECODE_BATCHES);
    assert_eq!(plain.batch_sizes(), vec![2, 4, 8]);
    assert!(!flashrt_compiler::ir_to_toml(&plain).contains("decode_batches"));
    assert!(
        !serde_json::to_string(&plain)
            .unwrap()
            .contains("decode_batches")
    );
    assert_ne!(plain.ir_hash(), ir.ir_hash());
}
