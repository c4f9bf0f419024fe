//! The CPU reference against transformers' ground truth (`tests/fixtures`), through the HF
//! importer: prompt logits, greedy ids, fork S1/S2 via the prompt capsule, state after prefill.

mod common;

use common::*;
use flashrt_runtime::safetensors::{Dtype, SafeTensors, TensorOut, serialize};
use flashrt_runtime::{ReferenceOptions, ReferenceReport, check_reference, check_reference_with};
use std::collections::BTreeMap;

fn run(name: &str) -> ReferenceReport {
    let report = check_reference(&fixture(name), cpu()).unwrap_or_else(|e| panic!("{name}: {e}"));
    println!("{report}");
    report
}

fn assert_complete(r: &ReferenceReport) {
    for name in [
        "prompt_logits",
        "greedy_ids",
        "greedy_logits",
        "fork_s1_logits",
        "fork_s1_greedy_ids",
        "fork_s2_logits",
        "fork_s2_greedy_ids",
    ] {
        assert!(
            r.check(name).is_some(),
            "check {name} missing from the report"
        );
    }
    assert!(
        r.checks.iter().any(|c| c.name.starts_with("state ")),
        "no state checks"
    );
    assert!(r.passed(), "failed checks: {:#?}", r.failures());
}

#[test]
fn qwen35_matches_transformers() {
    let r = run("qwen35-public");
    assert_eq!(r.tolerance, 1e-3);
    // 3 GDN layers (conv + recurrent) and one attention layer (key + value).
    assert_eq!(
        r.checks
            .iter()
            .filter(|c| c.name.starts_with("state "))
            .count(),
        8
    );
    assert_complete(&r);
}

#[test]
fn lfm2_matches_transformers() {
    let r = run("lfm2-public");
    assert_eq!(r.tolerance, 1e-4);
    assert_eq!(
        r.checks
            .iter()
            .filter(|c| c.name.starts_with("state "))
            .count(),
        7
    );
    assert_complete(&r);
}

#[test]
fn nemotron_h_matches_transformers() {
    let r = run("nemotronh-public");
    assert_eq!(r.tolerance, 1e-4);
    assert_eq!(
        r.checks
            .iter()
            .filter(|c| c.name.starts_with("state "))
            .count(),
        8
    );
    assert_complete(&r);
}

#[test]
fn qwen35_released_layout_matches_transformers() {
    // bf16 shards + index, nested text_config, model.language_model.*, a vision tower that is
    // skipped, an MTP head that is loaded but that transformers never runs.
    let r = run("qwen35real-public");
    assert_eq!(r.model_type, "qwen3_5_text");
    assert_eq!(r.tolerance, 1e-3);
    assert_eq!(
        r.checks
            .iter()
            .filter(|c| c.name.starts_with("state "))
            .count(),
        8,
        "{r}"
    );
    assert!(
        !r.checks.iter().any(|c| c.name.contains("mtp")),
        "the reference has no MTP state to compare: {r}"
    );
    assert_eq!(r.not_covered.len(), 1, "{r}");
    assert!(r.not_covered[0].contains("MTP head"), "{r}");
    assert_complete(&r);
}

/// Rewrite `reference.safetensors` of a copied fixture with `edit` applied to one tensor.
fn perturbed(name: &str, tensor: &str, edit: impl Fn(&mut Vec<u8>)) -> TempDir {
    let dir = copy_fixture(name);
    let path = dir.join("reference.safetensors");
    let st = SafeTensors::read(&path).unwrap();
    let mut datas: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors
        .iter()
        .map(|(n, i)| {
            (
                n.clone(),
                i.dtype.clone(),
                i.shape.clone(),
                st.data(n).unwrap().to_vec(),
            )
        })
        .collect();
    let t = datas
        .iter_mut()
        .find(|t| t.0 == tensor)
        .expect("tensor exists");
    edit(&mut t.3);
    let outs: Vec<TensorOut> = datas
        .iter()
        .map(|(n, d, s, b)| TensorOut {
            name: n,
            dtype: d.clone(),
            shape: s.clone(),
            data: b,
        })
        .collect();
    std::fs::write(&path, serialize(&outs, &BTreeMap::new())).unwrap();
    dir
}

#[test]
fn perturbed_references_fail() {
    // A logit nudged by 1% of the largest one.
    let dir = perturbed("lfm2-public", "prompt_logits", |b| {
        let v = f32::from_le_bytes(b[40..44].try_into().unwrap()) + 0.13;
        b[40..44].copy_from_slice(&v.to_le_bytes());
    });
    let r = check_reference(&dir, cpu()).unwrap();
    assert!(!r.passed());
    let failed: Vec<&str> = r.failures().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(failed, ["prompt_logits"], "{r}");

    // One greedy id changed.
    let dir = perturbed("nemotronh-public", "greedy_ids", |b| {
        let v = i64::from_le_bytes(b[16..24].try_into().unwrap());
        b[16..24].copy_from_slice(&((v + 1) % 512).to_le_bytes());
    });
    let r = check_reference(&dir, cpu()).unwrap();
    let failed: Vec<&str> = r.failures().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(failed, ["greedy_ids"], "{r}");
    assert_eq!(r.check("greedy_ids").unwrap().error, 1.0);
}

#[test]
fn perturbed_state_fails() {
    let dir = copy_fixture("qwen35-public");
    let path = dir.join("state.safetensors");
    let st = SafeTensors::read(&path).unwrap();
    let mut datas: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors
        .iter()
        .map(|(n, i)| {
            (
                n.clone(),
                i.dtype.clone(),
                i.shape.clone(),
                st.data(n).unwrap().to_vec(),
            )
        })
        .collect();
    // Scale one recurrent state by 1.01.
    let t = datas
        .iter_mut()
        .find(|t| t.0 == "layers.1.recurrent_state")
        .unwrap();
    for c in t.3.chunks_exact_mut(4) {
        let v = f32::from_le_bytes(c.try_into().unwrap()) * 1.01;
        c.copy_from_slice(&v.to_le_bytes());
    }
    let outs: Vec<TensorOut> = datas
        .iter()
        .map(|(n, d, s, b)| TensorOut {
            name: n,
            dtype: d.clone(),
            shape: s.clone(),
            data: b,
        })
        .collect();
    std::fs::write(&path, serialize(&outs, &BTreeMap::new())).unwrap();
    let r = check_reference(&dir, cpu()).unwrap();
    let failed: Vec<&str> = r.failures().iter().map(|c| c.name.as_str()).collect();
    assert_eq!(failed, ["state layers.1.recurrent"], "{r}");
}

#[test]
fn chunked_prefill_matches_transformers() {
    // Buckets 3 and 8: the 37-token prompt runs as 4 chunks of 8 plus one of 5, suffixes as
    // ragged chunks, single tokens through the decode plan.
    for name in FIXTURES {
        let opts = ReferenceOptions {
            prefill_buckets: Some(vec![3, 8]),
            ..Default::default()
        };
        let r = check_reference_with(&fixture(name), cpu(), &opts).unwrap();
        assert!(r.passed(), "{name}:\n{r}");
    }
}
