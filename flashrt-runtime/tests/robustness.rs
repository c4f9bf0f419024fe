//! Bad inputs give clear errors, never panics: corrupt checkpoints, unknown configs, mismatched
//! tensors, out-of-range tokens, positions beyond max_seq.

mod common;

use common::*;
use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::safetensors::Dtype;
use flashrt_runtime::{Error, Model};
use std::path::Path;

fn load_dir(dir: &Path) -> Result<Model, Error> {
    Model::load_hf_dir(
        cpu(),
        dir,
        &HfOptions {
            max_seq: Some(128),
            ..Default::default()
        },
    )
}

fn expect_checkpoint_error(dir: &Path, needle: &str) -> String {
    let e = load_dir(dir).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, Error::Checkpoint(_)),
        "expected a checkpoint error, got {e}"
    );
    assert!(
        msg.contains(needle),
        "message does not mention `{needle}`:\n{msg}"
    );
    msg
}

#[test]
fn truncated_checkpoint_is_an_error() {
    let dir = copy_fixture("lfm2-public");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 5, 8, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = load_dir(&dir).unwrap_err();
        assert!(matches!(e, Error::Checkpoint(_)), "cut {cut}: {e}");
        assert!(
            e.to_string().contains("model.safetensors"),
            "cut {cut}: error does not name the file: {e}"
        );
    }
}

#[test]
fn corrupt_headers_are_errors() {
    let dir = copy_fixture("lfm2-public");
    let path = dir.join("model.safetensors");
    let good = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;

    let mut b = good.clone();
    b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&path, &b).unwrap();
    expect_checkpoint_error(&dir, "header length");

    let mut b = good.clone();
    b[8] = b'[';
    std::fs::write(&path, &b).unwrap();
    expect_checkpoint_error(&dir, "JSON");

    // Offsets beyond the data section.
    let header = std::str::from_utf8(&good[8..8 + n]).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(header.trim_end()).unwrap();
    v["model.embedding_norm.weight"]["data_offsets"] = serde_json::json!([0, 1u64 << 33]);
    let mut h = v.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&h);
    b.extend_from_slice(&good[8 + n..]);
    std::fs::write(&path, &b).unwrap();
    expect_checkpoint_error(&dir, "out of range");

    // A dtype whose element size does not match the byte range.
    let mut v: serde_json::Value = serde_json::from_str(header.trim_end()).unwrap();
    v["model.embedding_norm.weight"]["dtype"] = serde_json::json!("F64");
    let mut h = v.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&h);
    b.extend_from_slice(&good[8 + n..]);
    std::fs::write(&path, &b).unwrap();
    expect_checkpoint_error(&dir, "wrong dtype size");
}

#[test]
fn unknown_model_type_is_a_config_error() {
    let dir = copy_fixture("lfm2-public");
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"lfm2\"", "\"mystery_net\"");
    std::fs::write(&p, text).unwrap();
    let e = load_dir(&dir).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
    assert!(
        e.to_string().contains("mystery_net") && e.to_string().contains("model_type"),
        "{e}"
    );

    std::fs::write(&p, "{\"model_type\": \"lfm2\", \"vocab_size\": \"many\"}").unwrap();
    let e = load_dir(&dir).unwrap_err();
    assert!(e.to_string().contains("vocab_size"), "{e}");

    std::fs::remove_file(&p).unwrap();
    let e = load_dir(&dir).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
}

#[test]
fn tensor_mismatches_are_listed_in_one_error() {
    let dir = copy_fixture("nemotronh-public");
    let path = dir.join("model.safetensors");
    let mut e = read_entries(&path);
    e.retain(|t| t.0 != "backbone.layers.2.mixer.D" && t.0 != "lm_head.weight");
    e.push((
        "backbone.layers.9.mixer.extra".into(),
        Dtype::F32,
        vec![2],
        vec![0; 8],
    ));
    let t = e
        .iter_mut()
        .find(|t| t.0 == "backbone.layers.1.mixer.up_proj.weight")
        .unwrap();
    t.2 = vec![t.2[1], t.2[0]];
    write_entries(&path, &e);
    let msg = expect_checkpoint_error(&dir, "missing tensors (2)");
    for needle in [
        "backbone.layers.2.mixer.D",
        "lm_head.weight",
        "unexpected tensors (1)",
        "backbone.layers.9.mixer.extra",
        "misshaped tensors (1)",
        "backbone.layers.1.mixer.up_proj.weight",
    ] {
        assert!(msg.contains(needle), "`{needle}` not in:\n{msg}");
    }
    println!("{msg}");
}

#[test]
fn real_checkpoint_naming_is_accepted() {
    // Multimodal Qwen3.5 checkpoints name text weights `model.language_model.*` and carry
    // `mtp.*` and vision tensors; all of that loads, with the same numbers.
    let dir = copy_fixture("qwen35-public");
    let path = dir.join("model.safetensors");
    let mut e = read_entries(&path);
    for t in e.iter_mut() {
        if let Some(rest) = t.0.strip_prefix("model.") {
            t.0 = format!("model.language_model.{rest}");
        }
    }
    e.push(("mtp.fc.weight".into(), Dtype::F32, vec![2], vec![0; 8]));
    e.push((
        "model.visual.patch_embed.weight".into(),
        Dtype::F32,
        vec![1],
        vec![0; 4],
    ));
    write_entries(&path, &e);
    let a = load_dir(&dir).unwrap();
    let b = load_dir(&fixture("qwen35-public")).unwrap();
    let p = tokens(3, 12, 512);
    let (mut sa, mut sb) = (a.session().unwrap(), b.session().unwrap());
    sa.append(&p).unwrap();
    sb.append(&p).unwrap();
    assert_eq!(sa.logits(), sb.logits());
}

#[test]
fn bf16_and_f16_checkpoints_load() {
    for dtype in [Dtype::Bf16, Dtype::F16] {
        let dir = copy_fixture("lfm2-public");
        let path = dir.join("model.safetensors");
        let mut e = read_entries(&path);
        for t in e.iter_mut() {
            let vals = flashrt_runtime::safetensors::bytes_f32(&t.3);
            t.3 = match dtype {
                Dtype::Bf16 => vals
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
                _ => vals
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            };
            t.1 = dtype.clone();
        }
        write_entries(&path, &e);
        let m = load_dir(&dir).unwrap();
        let r = load_dir(&fixture("lfm2-public")).unwrap();
        let p = tokens(4, 16, 512);
        let (mut a, mut b) = (m.session().unwrap(), r.session().unwrap());
        a.append(&p).unwrap();
        b.append(&p).unwrap();
        let rel = flashrt_runtime::reference::rel_err(a.logits(), b.logits());
        println!("{dtype:?} weights vs f32: relative logit error {rel:.2e}");
        assert!(rel < 0.05, "{dtype:?}: {rel}");
    }
}

#[test]
fn bad_session_inputs_are_errors() {
    let m = load("qwen35-public", &[4, 16]);
    let mut s = m.session().unwrap();
    let e = s.append(&[]).unwrap_err();
    assert!(matches!(e, Error::Input(_)), "{e}");
    let e = s.append(&[1, 2, 512]).unwrap_err();
    assert!(
        matches!(e, Error::Input(_)) && e.to_string().contains("512"),
        "{e}"
    );
    assert_eq!(s.pos(), 0, "a rejected append must not consume tokens");

    let max = m.max_seq();
    s.append(&tokens(1, max - 2, 512)).unwrap();
    let e = s.append(&[5, 6, 7]).unwrap_err();
    assert!(
        matches!(e, Error::Input(_)) && e.to_string().contains("max_seq"),
        "{e}"
    );
    s.append(&[5, 6]).unwrap();
    assert_eq!(s.pos(), max);
    assert!(s.decode_greedy(1).is_err());

    assert!(s.read_region("io.logits").is_err());
    assert!(s.read_region("no.such.region").is_err());
    assert!(s.read_region("layers.3.key").is_ok());
    // The session still works after all of that.
    s.reset().unwrap();
    s.append(&[5, 6, 7]).unwrap();
    assert_eq!(s.pos(), 3);
}

#[test]
fn no_checkpoint_files_is_an_error() {
    let dir = temp_dir("empty");
    std::fs::copy(
        fixture("lfm2-public").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    let e = load_dir(&dir).unwrap_err();
    assert!(
        matches!(e, Error::Checkpoint(_)) && e.to_string().contains("no *.safetensors"),
        "{e}"
    );
}
