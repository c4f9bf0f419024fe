//! Loading a Qwen3.5-style checkpoint with an MTP head: the `mtp.*` tensors land in the MTP
//! weight buffers, text weights may carry real multimodal checkpoints' `model.language_model.`
//! prefix, and a missing MTP tensor is named in the error.

use flashrt_runtime::backend::Backend;
use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::ir::{DType, Role, compile};
use flashrt_runtime::safetensors::{Dtype, TensorOut, serialize};
use flashrt_runtime::speculative::MtpDrafter;
use flashrt_runtime::{CpuBackend, Error, Model, random_weights};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

const QWEN_MTP: &str = r#"{
  "model_type": "qwen3_5_text",
  "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
  "num_hidden_layers": 4,
  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
  "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "dtype": "float32",
  "mtp_num_hidden_layers": 1
}"#;

fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::with_threads(1))
}

fn opts() -> HfOptions {
    HfOptions {
        name: Some("mtp_ckpt".into()),
        dtype: Some(DType::F32),
        ..Default::default()
    }
}

/// Write config.json + model.safetensors holding `weights` under their checkpoint names,
/// text weights renamed to `model.language_model.*`; `drop` leaves one tensor out.
fn write_checkpoint(tag: &str, drop: Option<&str>) -> (PathBuf, flashrt_runtime::HostWeights) {
    let ir = ir_from_hf_config(QWEN_MTP, &opts()).unwrap();
    let compiled = compile(&ir, CpuBackend::new().target(&ir));
    let weights = random_weights(&compiled, 5);
    let dir = std::env::temp_dir().join(format!("flashrt-mtp-ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), QWEN_MTP).unwrap();
    let mut names = Vec::new();
    let mut data = Vec::new();
    for b in compiled
        .layout
        .buffers
        .iter()
        .filter(|b| b.role == Role::Weight)
    {
        let src = b.source.clone().unwrap();
        if Some(src.as_str()) == drop {
            continue;
        }
        let name = match src.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => src,
        };
        let bytes: Vec<u8> = weights.tensors[b.id.index()]
            .as_ref()
            .unwrap()
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        names.push((name, b.shape.clone()));
        data.push(bytes);
    }
    let outs: Vec<TensorOut<'_>> = names
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| TensorOut {
            name,
            dtype: Dtype::F32,
            shape: shape.clone(),
            data: bytes,
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        serialize(&outs, &BTreeMap::new()),
    )
    .unwrap();
    (dir, weights)
}

#[test]
fn mtp_tensors_load_from_a_checkpoint() {
    let (dir, weights) = write_checkpoint("ok", None);
    let loaded = Model::load_hf_dir(cpu(), &dir, &opts()).expect("checkpoint with mtp.* loads");
    assert!(loaded.ir().mtp.is_some());
    let compiled = Arc::new(compile(loaded.ir(), CpuBackend::new().target(loaded.ir())));
    let direct = Model::from_compiled(cpu(), compiled, weights).unwrap();
    let prompt: Vec<u32> = (0..23).map(|i| (i * 37 + 11) % 256).collect();
    // The drafter's weights matter to what it drafts: compare speculative runs (drafts and
    // acceptances) and plain logits between the checkpoint and the in-memory weights.
    let run = |m: &Model| {
        let mut s = m.session().unwrap();
        s.append_with_mtp(&prompt).unwrap();
        let logits = s.last_logits().to_vec();
        let (toks, st) = s.decode_speculative(24, 3, &mut MtpDrafter).unwrap();
        (
            logits,
            toks,
            st.drafted,
            st.accepted,
            s.read_region("mtp.hidden").unwrap(),
        )
    };
    let a = run(&loaded);
    let b = run(&direct);
    assert!(
        a.0 == b.0,
        "logits differ between the checkpoint and the same weights in memory"
    );
    assert_eq!(
        (a.1, a.2, a.3),
        (b.1, b.2, b.3),
        "tokens / drafts / acceptances"
    );
    assert!(
        a.4 == b.4,
        "mtp.hidden differs: the MTP weights were not loaded as written"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_missing_mtp_tensor_is_named() {
    let (dir, _) = write_checkpoint("missing", Some("mtp.fc.weight"));
    let err = Model::load_hf_dir(cpu(), &dir, &opts()).expect_err("mtp.fc.weight is missing");
    assert!(matches!(err, Error::Checkpoint(_)), "{err}");
    assert!(err.to_string().contains("mtp.fc.weight"), "{err}");
    let _ = std::fs::remove_dir_all(dir);
}
