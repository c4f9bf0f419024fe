//! The capsule size of the Qwen3.6-27B shape, derived independently from the public config
//! facts in DESIGN.md and compared with what the compiler (and `flashrt compile`) report.

const GDN_LAYERS: usize = 48;
const ATTN_LAYERS: usize = 16;
// Gated DeltaNet: 16 key heads and 48 value heads of dim 128; conv kernel 4 over q|k|v.
const KEY_HEADS: usize = 16;
const VALUE_HEADS: usize = 48;
const HEAD_DIM: usize = 128;
const CONV_KERNEL: usize = 4;
// Attention: 4 KV heads of dim 256.
const KV_HEADS: usize = 4;
const ATTN_HEAD_DIM: usize = 256;
const F32: usize = 4;
const BF16: usize = 2;

fn expected() -> (usize, usize) {
    // fp32 recurrent state [value_heads, key_dim, value_dim] per GDN layer.
    let recurrent = VALUE_HEADS * HEAD_DIM * HEAD_DIM * F32;
    // Conv state: the last K-1 inputs of every q, k, v channel, in bf16.
    let conv_channels = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM;
    let conv = (CONV_KERNEL - 1) * conv_channels * BF16;
    let fixed = GDN_LAYERS * (recurrent + conv);
    // K and V, bf16, per token and attention layer.
    let per_token = ATTN_LAYERS * KV_HEADS * ATTN_HEAD_DIM * 2 * BF16;
    (fixed, per_token)
}

fn compiled() -> flashrt::ir::Compiled {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/models/qwen36-27b.toml");
    let src = std::fs::read_to_string(path).unwrap();
    let ir = flashrt::compiler::model_from_toml(&src, "models/qwen36-27b.toml").unwrap();
    flashrt::ir::compile(&ir, flashrt::ir::Target { dtype: ir.dtype })
}

#[test]
fn qwen36_27b_capsule_bytes_match_the_config_facts() {
    let (fixed, per_token) = expected();
    let c = compiled();
    assert_eq!(c.layout.capsule_fixed_bytes(), fixed, "fixed bytes");
    assert_eq!(c.layout.capsule_bytes_per_token(), per_token, "bytes per token");
    // A 16k-token capsule is about 1 GiB of KV plus ~147 MiB of recurrent/conv state.
    assert_eq!(c.layout.capsule_bytes(16384), fixed + 16384 * per_token);
}

#[test]
fn flashrt_compile_prints_the_same_two_numbers() {
    let (fixed, per_token) = expected();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flashrt"))
        .args(["compile", concat!(env!("CARGO_MANIFEST_DIR"), "/models/qwen36-27b.toml")])
        .output()
        .expect("run flashrt compile");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let field = |label: &str| -> usize {
        let line = text.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("no `{label}` line in:\n{text}"));
        line.trim_start()[label.len()..].split_whitespace().next().unwrap().parse().unwrap()
    };
    assert_eq!(field("fixed bytes"), fixed);
    assert_eq!(field("bytes per token"), per_token);
}
