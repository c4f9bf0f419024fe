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

fn state_checks(r: &ReferenceReport) -> usize {
    r.checks
        .iter()
        .filter(|c| c.name.starts_with("state "))
        .count()
}

#[test]
fn qwen35_moe_matches_transformers() {
    let r = run("qwen35moe-public");
    assert_eq!(r.tolerance, 1e-3);
    assert_eq!(state_checks(&r), 8);
    assert_complete(&r);
}

#[test]
fn lfm2_moe_matches_transformers() {
    let r = run("lfm2moe-public");
    assert_eq!(r.tolerance, 1e-4);
    assert_eq!(state_checks(&r), 7);
    assert_complete(&r);
}

#[test]
fn nemotron_h_moe_matches_transformers() {
    let r = run("nemotronhmoe-public");
    assert_eq!(r.tolerance, 1e-4);
    // Mamba2 x3 (conv + recurrent) and one attention layer; MoE blocks hold no state.
    assert_eq!(state_checks(&r), 8);
    assert_complete(&r);
}

/// Rewrite a copied fixture's `model.safetensors` with its per-expert tensors stacked into
/// the fused 3-D form the released Qwen3.5/3.6-MoE checkpoints store (and transformers holds
/// in memory): `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows)
/// and `experts.down_proj` [E, H, I].
fn fused_experts(
    name: &str,
    block: &str,
    up_parts: &[&str],
    fused_up: &str,
    down: &str,
) -> TempDir {
    let dir = copy_fixture(name);
    let path = dir.join("model.safetensors");
    let entries = read_entries(&path);
    let mut out: Entries = Vec::new();
    let mut groups: BTreeMap<String, BTreeMap<usize, Entries>> = BTreeMap::new();
    for e in entries {
        let marker = format!(".{block}.experts.");
        match e.0.find(&marker) {
            Some(at) => {
                let prefix = e.0[..at + marker.len()].to_string();
                let rest = &e.0[at + marker.len()..];
                let (idx, _) = rest.split_once('.').unwrap();
                let idx: usize = idx.parse().unwrap();
                groups
                    .entry(prefix)
                    .or_default()
                    .entry(idx)
                    .or_default()
                    .push(e);
            }
            None => out.push(e),
        }
    }
    assert!(!groups.is_empty(), "{name} has no per-expert tensors");
    for (prefix, experts) in groups {
        let n = experts.len();
        let part = |experts: &BTreeMap<usize, Entries>, e: usize, p: &str| {
            experts[&e]
                .iter()
                .find(|t| t.0.ends_with(&format!(".{p}.weight")))
                .unwrap_or_else(|| panic!("{prefix}{e}.{p}"))
                .clone()
        };
        let mut up = Vec::new();
        let mut shape = Vec::new();
        for e in 0..n {
            for p in up_parts {
                let t = part(&experts, e, p);
                shape = t.2.clone();
                up.extend_from_slice(&t.3);
            }
        }
        out.push((
            format!("{prefix}{fused_up}"),
            Dtype::F32,
            vec![n, shape[0] * up_parts.len(), shape[1]],
            up,
        ));
        let mut dn = Vec::new();
        for e in 0..n {
            let t = part(&experts, e, down);
            shape = t.2.clone();
            dn.extend_from_slice(&t.3);
        }
        out.push((
            format!("{prefix}down_proj"),
            Dtype::F32,
            vec![n, shape[0], shape[1]],
            dn,
        ));
    }
    write_entries(&path, &out);
    dir
}

#[test]
fn fused_expert_checkpoints_load_and_match() {
    for (name, block, parts, fused, down) in [
        (
            "qwen35moe-public",
            "mlp",
            &["gate_proj", "up_proj"][..],
            "gate_up_proj",
            "down_proj",
        ),
        (
            "lfm2moe-public",
            "feed_forward",
            &["w1", "w3"][..],
            "gate_up_proj",
            "w2",
        ),
        (
            "nemotronhmoe-public",
            "mixer",
            &["up_proj"][..],
            "up_proj",
            "down_proj",
        ),
    ] {
        let dir = fused_experts(name, block, parts, fused, down);
        let names: Vec<String> = read_entries(&dir.join("model.safetensors"))
            .into_iter()
            .map(|e| e.0)
            .collect();
        assert!(
            names.iter().all(|n| !n.contains(".experts.0.")),
            "{name}: per-expert tensors left"
        );
        let r = check_reference(&dir, cpu()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(r.passed(), "{name} (fused experts):\n{r}");
        // Same weights, same numbers: the fused and per-expert forms load identically.
        let per_expert = check_reference(&fixture(name), cpu()).unwrap();
        assert_eq!(
            r.check("prompt_logits").unwrap().error,
            per_expert.check("prompt_logits").unwrap().error,
            "{name}"
        );
    }
}

#[test]
fn incomplete_expert_checkpoints_are_one_clear_error() {
    let dir = copy_fixture("qwen35moe-public");
    let path = dir.join("model.safetensors");
    let mut entries = read_entries(&path);
    entries.retain(|e| e.0 != "model.layers.2.mlp.experts.5.up_proj.weight");
    write_entries(&path, &entries);
    let e = check_reference(&dir, cpu()).unwrap_err().to_string();
    assert!(e.contains("missing tensors (1)"), "{e}");
    assert!(
        e.contains("model.layers.2.mlp.experts.5.up_proj.weight"),
        "{e}"
    );
}

/// A fixture whose `config.json` has one routing key changed.
fn with_config(name: &str, key: &str, value: serde_json::Value) -> TempDir {
    let dir = copy_fixture(name);
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg[key] = value;
    std::fs::write(&path, cfg.to_string()).unwrap();
    dir
}

/// The fixtures pin the routing rule: the rule with one step wrong fails them.
#[test]
fn wrong_routing_rules_fail_the_fixtures() {
    for (name, key, value) in [
        // Weights not renormalised over the chosen experts.
        (
            "qwen35moe-public",
            "norm_topk_prob",
            serde_json::json!(false),
        ),
        // No renormalisation (and so no +1e-6) for the sigmoid router either.
        ("lfm2moe-public", "norm_topk_prob", serde_json::json!(false)),
        // The routed scaling factor left out.
        (
            "nemotronhmoe-public",
            "routed_scaling_factor",
            serde_json::json!(1.0),
        ),
        // One expert fewer per token.
        (
            "nemotronhmoe-public",
            "num_experts_per_tok",
            serde_json::json!(1),
        ),
    ] {
        let dir = with_config(name, key, value);
        let r = check_reference(&dir, cpu()).unwrap();
        assert!(
            r.check("prompt_logits").is_some_and(|c| !c.passed),
            "{name} with {key} changed still passes:\n{r}"
        );
    }
    // A config that drops the selection bias the checkpoint holds is refused, not ignored.
    let dir = with_config(
        "lfm2moe-public",
        "use_expert_bias",
        serde_json::json!(false),
    );
    let e = check_reference(&dir, cpu()).unwrap_err().to_string();
    assert!(
        e.contains("unexpected tensors (3)") && e.contains("feed_forward.expert_bias"),
        "{e}"
    );
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
