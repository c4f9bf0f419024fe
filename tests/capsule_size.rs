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
// One MTP layer (an attention layer of the same shape) and its input hidden vector.
const MTP_LAYERS: usize = 1;
const HIDDEN: usize = 5120;

/// The main stack alone, exactly as the issue states the facts.
fn expected_main() -> (usize, usize) {
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

/// The MTP head's regions: its own K/V per token, and the hidden vector it drafts from.
fn expected_mtp() -> (usize, usize) {
    (
        HIDDEN * BF16,
        MTP_LAYERS * KV_HEADS * ATTN_HEAD_DIM * 2 * BF16,
    )
}

fn expected() -> (usize, usize) {
    let (f, p) = expected_main();
    let (mf, mp) = expected_mtp();
    (f + mf, p + mp)
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
    assert_eq!(
        c.layout.capsule_bytes_per_token(),
        per_token,
        "bytes per token"
    );
    // A 16k-token capsule is about 1 GiB of KV plus ~147 MiB of recurrent/conv state.
    assert_eq!(c.layout.capsule_bytes(16384), fixed + 16384 * per_token);
    // The main stack's share is exactly the figure derived from the config facts alone.
    let (main_fixed, main_per) = expected_main();
    let main = |per: bool| -> usize {
        c.layout
            .state_buffers()
            .filter(|b| b.name.starts_with("layers."))
            .map(|b| {
                if per {
                    b.bytes_per_token()
                } else if b.bytes_per_token() == 0 {
                    b.bytes
                } else {
                    0
                }
            })
            .sum()
    };
    assert_eq!(main(false), main_fixed);
    assert_eq!(main(true), main_per);
}

#[test]
fn flashrt_compile_prints_the_same_two_numbers() {
    let (fixed, per_token) = expected();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flashrt"))
        .args([
            "compile",
            concat!(env!("CARGO_MANIFEST_DIR"), "/models/qwen36-27b.toml"),
        ])
        .output()
        .expect("run flashrt compile");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let field = |label: &str| -> usize {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(label))
            .unwrap_or_else(|| panic!("no `{label}` line in:\n{text}"));
        line.trim_start()[label.len()..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(field("fixed bytes"), fixed);
    assert_eq!(field("bytes per token"), per_token);
    let (mf, mp) = expected_mtp();
    assert_eq!(field("MTP head fixed bytes"), mf);
    assert_eq!(field("MTP head bytes per token"), mp);
}
