//! The same model written as a TOML file (`include_model!`) and on a Rust item
//! (`#[flashrt::model]`) compiles, through the real macros, to identical IR — equal values
//! and equal hashes — for each reference family. (The compiler crate checks the same property
//! on token streams; this test goes through the proc macros a user actually writes.)

use flashrt::Model;

flashrt::include_model!("models/qwen35-tiny.toml");
flashrt::include_model!("models/lfm2-tiny.toml");
flashrt::include_model!("models/nemotronh-tiny.toml");
flashrt::include_model!("models/qwen36-27b.toml");

#[flashrt::model(
    model = {
        name = "qwen35_tiny", vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
        prefill_buckets = [16, 64], norm = { kind = rms, eps = 1e-6, weight = one_plus },
        tie_embeddings = false, weights = qwen3_5_text,
    },
    kinds = {
        gated_deltanet = {
            mixer = { kind = gated_deltanet, key_heads = 2, value_heads = 4, key_dim = 16, value_dim = 16, conv = 4 },
            mlp = { kind = swiglu, intermediate = 128 },
        },
        attention = {
            mixer = { kind = attention, q_heads = 4, kv_heads = 2, head_dim = 32, qk_norm = true,
                      rope = { theta = 10000.0, fraction = 0.25 }, output_gate = true },
            mlp = { kind = swiglu, intermediate = 128 },
        },
    },
    stack = { pattern = [gated_deltanet, gated_deltanet, gated_deltanet, attention] },
)]
pub struct Qwen35Macro;

#[flashrt::model(
    model = {
        name = "lfm2_tiny", vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
        prefill_buckets = [16, 64], norm = { kind = rms, eps = 1e-5, weight = plain },
        tie_embeddings = true, weights = lfm2,
    },
    kinds = {
        short_conv = { mixer = { kind = short_conv, conv = 3 }, mlp = { kind = swiglu, intermediate = 160 } },
        attention = {
            mixer = { kind = attention, q_heads = 4, kv_heads = 2, head_dim = 16, qk_norm = true, rope = { theta = 1e6 } },
            mlp = { kind = swiglu, intermediate = 160 },
        },
    },
    stack = { pattern = [short_conv, short_conv, attention, short_conv, attention] },
)]
pub struct Lfm2Macro;

#[flashrt::model(
    model = {
        name = "nemotronh_tiny", vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
        prefill_buckets = [16, 64], norm = { kind = rms, eps = 1e-5, weight = plain },
        weights = nemotron_h,
    },
    kinds = {
        mamba2 = { mixer = { kind = mamba2, heads = 8, head_dim = 16, groups = 2, state = 16, conv = 4, dt_min = 0.001 } },
        attention = { mixer = { kind = attention, q_heads = 4, kv_heads = 2, head_dim = 16, rope = none } },
        mlp = { mlp = { kind = relu2, intermediate = 128 } },
    },
    stack = { pattern = [mamba2, mlp, mamba2, attention, mlp, mamba2] },
)]
pub struct NemotronhMacro;

#[flashrt::model(
    model = {
        name = "qwen36_27b", vocab = 248320, hidden = 5120, dtype = bf16, max_seq = 32768,
        prefill_buckets = [32, 64, 256, 512, 1024, 2048, 4096], norm = { kind = rms, eps = 1e-6, weight = one_plus },
        weights = qwen3_5_text,
    },
    kinds = {
        gdn = {
            mixer = { kind = gated_deltanet, key_heads = 16, value_heads = 48, key_dim = 128, value_dim = 128, conv = 4 },
            mlp = { kind = swiglu, intermediate = 17408 },
        },
        attn = {
            mixer = { kind = attention, q_heads = 24, kv_heads = 4, head_dim = 256, qk_norm = true,
                      rope = { theta = 1e7, fraction = 0.25 }, output_gate = true },
            mlp = { kind = swiglu, intermediate = 17408 },
        },
    },
    stack = { repeat = 16, pattern = [gdn, gdn, gdn, attn] },
    mtp = { layers = 1, kind = attn },
)]
pub struct Qwen36Macro;

fn same<A: Model, B: Model>() {
    assert_eq!(A::ir(), B::ir(), "{} vs {}", A::NAME, B::NAME);
    assert_eq!(A::ir().ir_hash(), B::ir().ir_hash());
    assert_eq!(A::STATE_REGIONS, B::STATE_REGIONS);
}

#[test]
fn qwen35_toml_and_macro_are_the_same_model() {
    same::<Qwen35Tiny, Qwen35Macro>();
}

#[test]
fn lfm2_toml_and_macro_are_the_same_model() {
    same::<Lfm2Tiny, Lfm2Macro>();
}

#[test]
fn nemotronh_toml_and_macro_are_the_same_model() {
    same::<NemotronhTiny, NemotronhMacro>();
}

#[test]
fn qwen36_27b_toml_and_macro_are_the_same_model() {
    same::<Qwen3627b, Qwen36Macro>();
}

/// A different model really is different (the comparison above can fail).
#[test]
fn different_models_differ() {
    assert_ne!(Lfm2Tiny::ir().ir_hash(), NemotronhTiny::ir().ir_hash());
}
