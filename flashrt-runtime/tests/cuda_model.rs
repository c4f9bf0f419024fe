//! Whole models on the GPU: against transformers' ground truth (f32), against the CPU
//! reference (bf16), graph replay against plain launches, and the capsule contract
//! (byte-exact restore, identical continuation, fork, pinned tier, KV-only ablation).
//! Skips with a message when no CUDA device is present; fixture-based tests also skip when the
//! fixtures are not found (`$FLASHRT_FIXTURES`, else `tests/fixtures`).
#![cfg(feature = "cuda")]

mod cuda_support;
#[path = "common/pool.rs"]
mod pool;

use cuda_support::*;
use flashrt_runtime::backend::Backend;
use flashrt_runtime::backend::cuda::{CudaOptions, CudaSaved};
use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::ir::{DType, ModelIr, Phase, Role, compile};
use flashrt_runtime::{
    Capsule, HostSaved, LogitsMode, Model, Session, argmax, check_reference, load_hf_weights,
    random_weights,
};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

const FIXTURES: [&str; 6] = [
    "qwen35-public",
    "lfm2-public",
    "nemotronh-public",
    "qwen35moe-public",
    "lfm2moe-public",
    "nemotronhmoe-public",
];

/// A Qwen3.5-MoE-style hybrid at realistic head and expert sizes (32 experts, top-8, expert
/// width 256, a gated shared expert), small in width and depth.
const QWEN_MOE_LIKE: &str = r#"{
  "model_type": "qwen3_5_moe_text",
  "hidden_size": 512, "vocab_size": 1000,
  "num_hidden_layers": 4,
  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
  "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
  "num_experts": 32, "num_experts_per_tok": 8, "moe_intermediate_size": 256,
  "shared_expert_intermediate_size": 256,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "hidden_act": "silu", "dtype": "bfloat16"
}"#;

fn ir_of(json: &str, dtype: DType, buckets: &[usize], max_seq: usize) -> ModelIr {
    let opts = HfOptions {
        name: Some("gpu_test".into()),
        max_seq: Some(max_seq),
        prefill_buckets: Some(buckets.to_vec()),
        dtype: Some(dtype),
        ..HfOptions::default()
    };
    ir_from_hf_config(json, &opts).unwrap_or_else(|e| panic!("config: {e}"))
}

/// The same model on `backend`, weights from `dir` (HF checkpoint) or seeded random ones,
/// rounded to bf16 so every backend starts from identical values.
fn model_on(backend: Arc<dyn Backend>, ir: &ModelIr, dir: Option<&Path>) -> Model {
    let compiled = Arc::new(compile(ir, backend.target(ir)));
    let w = match dir {
        Some(d) => load_hf_weights(&compiled, d).unwrap_or_else(|e| panic!("weights: {e}")),
        None => random_weights(&compiled, 7),
    };
    Model::from_compiled(backend, compiled, round_weights(w))
        .unwrap_or_else(|e| panic!("load: {e}"))
}

fn prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.below(vocab)).collect()
}

/// Feed `tokens` one at a time (decode plan) and collect the logits after each.
fn teacher_forced(s: &mut Session, tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&t| {
            s.append(&[t]).expect("decode step");
            s.last_logits().to_vec()
        })
        .collect()
}

/// Greedy decoding that also returns the logits each token was chosen from.
fn greedy(s: &mut Session, n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut toks = Vec::new();
    let mut rows = Vec::new();
    for _ in 0..n {
        let l = s.last_logits().to_vec();
        let t = argmax(&l).expect("logits");
        rows.extend_from_slice(&l);
        s.append(&[t]).expect("decode step");
        toks.push(t);
    }
    (toks, rows)
}

#[test]
fn fixtures_f32_match_transformers() {
    let Some(gpu) = cuda("fixtures_f32_match_transformers") else {
        return;
    };
    let Some(dir) = fixtures_dir() else {
        let _ = writeln!(
            std::io::stderr(),
            "SKIP fixtures_f32_match_transformers: fixtures not found (set FLASHRT_FIXTURES)"
        );
        return;
    };
    let mut failed = Vec::new();
    for name in FIXTURES {
        let report =
            check_reference(&dir.join(name), gpu.clone()).unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{report}");
        if !report.passed() {
            failed.push(name);
        }
    }
    assert!(
        failed.is_empty(),
        "fixtures failed on the GPU (f32): {failed:?}"
    );
}

/// bf16 on the GPU against the f32 CPU reference on identical (bf16-rounded) weights:
/// prompt logits, then teacher-forced decode steps on the CPU's greedy tokens. Returns
/// (prompt rel err, worst decode rel err, greedy agreement out of 12), errors as
/// `max|Δ| / max|ref|`.
///
/// Buckets of 8 and 16 rows: the 45-token prompt runs the token-by-token Gated DeltaNet kernel
/// (buckets of 32 rows or more run the chunked one, held to its own bounds by
/// [`bf16_chunked_prefill_tracks_cpu_reference`]).
fn bf16_vs_cpu(
    name: &str,
    json: &str,
    dir: Option<&Path>,
    gpu: Arc<dyn Backend>,
) -> (f64, f64, usize) {
    bf16_vs_cpu_in(name, json, dir, gpu, &[8, 16])
}

/// [`bf16_vs_cpu`] with these prefill buckets (the 45-token prompt's chunks follow from them).
fn bf16_vs_cpu_in(
    name: &str,
    json: &str,
    dir: Option<&Path>,
    gpu: Arc<dyn Backend>,
    buckets: &[usize],
) -> (f64, f64, usize) {
    bf16_vs_cpu_len(name, json, dir, gpu, buckets, 45)
}

/// [`bf16_vs_cpu_in`] with a prompt of `len` tokens.
fn bf16_vs_cpu_len(
    name: &str,
    json: &str,
    dir: Option<&Path>,
    gpu: Arc<dyn Backend>,
    buckets: &[usize],
    len: usize,
) -> (f64, f64, usize) {
    let ir_cpu = ir_of(json, DType::Bf16, buckets, (len + 12).next_multiple_of(256));
    let cpu_m = model_on(cpu(), &ir_cpu, dir);
    let gpu_m = model_on(gpu, &ir_cpu, dir);
    let vocab = cpu_m.vocab();
    let p = prompt(len, vocab, 11);
    let mut cs = cpu_m.session().unwrap();
    let mut gs = gpu_m.session().unwrap();
    cs.append(&p).unwrap();
    gs.append(&p).unwrap();
    let e = rel_err(gs.logits(), cs.logits());
    let per_row: Vec<String> = gs
        .logits()
        .chunks_exact(vocab)
        .zip(cs.logits().chunks_exact(vocab))
        .map(|(g, c)| format!("{:.1e}", rel_err(g, c)))
        .collect();
    println!(
        "{name}: prompt logits ({} rows) rel err {e:.3e}; per row: {}",
        p.len(),
        per_row.join(" ")
    );
    // CPU greedy continuation, then the GPU fed the same tokens.
    let mut cpu_tokens = Vec::new();
    let mut cpu_rows = Vec::new();
    for _ in 0..12 {
        let t = argmax(cs.last_logits()).unwrap();
        cs.append(&[t]).unwrap();
        cpu_tokens.push(t);
        cpu_rows.push(cs.last_logits().to_vec());
    }
    let gpu_first = argmax(gs.last_logits()).unwrap();
    let gpu_rows = teacher_forced(&mut gs, &cpu_tokens);
    let mut agree = (gpu_first == cpu_tokens[0]) as usize;
    let mut worst = 0f64;
    for (i, (g, c)) in gpu_rows.iter().zip(&cpu_rows).enumerate() {
        worst = worst.max(rel_err(g, c));
        if i + 1 < cpu_tokens.len() && argmax(g) == Some(cpu_tokens[i + 1]) {
            agree += 1;
        }
    }
    println!(
        "{name}: 12 teacher-forced decode steps: worst rel err {worst:.3e}, greedy agreement {agree}/12"
    );
    (e, worst, agree)
}

/// Whole-model bf16 bounds on `max|Δ| / max|ref|`, calibrated against transformers itself:
/// on an H200 (2026-11-29, transformers 5.17, torch 2.11) the fixtures' own bf16 forward
/// drifted from their f32 forward by 8.5e-2 (qwen35-public), 4.6e-2 (lfm2-public) and 1.4e-2
/// (nemotronh-public) on the prompt logits; flashrt's bf16 path measured 6.1e-2, 2.7e-2 and
/// 1.0e-2 against the f32 CPU reference (`benches/bf16_drift.py` reproduced the three drifts on
/// 2026-12-04 with transformers' PyTorch path). A bf16 backend is held to the drift of the reference
/// implementation's own bf16 run (rounded up); the random-weight model, which transformers
/// cannot load, gets the lfm2 bound (it measured 2.7e-2).
///
/// The MoE fixtures' README measured transformers' own bf16 drift at 35 % (qwen35moe,
/// lfm2moe) and 63 % (nemotronhmoe): in bf16 a few routing decisions flip, and a flipped
/// expert moves a whole row. Their bounds are those drifts; their greedy agreement may lose a
/// few more steps (see [`bf16_agreement`]).
fn bf16_bound(name: &str) -> f64 {
    match name {
        "qwen35-public" => 9e-2,
        "nemotronh-public" => 2e-2,
        "qwen35moe-public" | "lfm2moe-public" => 0.35,
        "nemotronhmoe-public" => 0.63,
        // Measured 1.27e-1 on the H200 (2026-12-02): top-8 of 32 random experts route on
        // close margins, so bf16 rounding moves a few experts per row (the f32 path matches
        // transformers at 1e-3 on the MoE fixtures).
        "qwen-moe-like" => 0.2,
        _ => 5e-2,
    }
}

/// Teacher-forced greedy decisions out of 12 that must agree with the CPU.
fn bf16_agreement(name: &str) -> usize {
    if name.contains("moe") { 8 } else { 10 }
}

#[test]
fn bf16_tracks_cpu_reference() {
    let Some(gpu) = cuda("bf16_tracks_cpu_reference") else {
        return;
    };
    let mut results = vec![
        (
            "qwen-like".to_string(),
            bf16_vs_cpu("qwen-like (random weights)", QWEN_LIKE, None, gpu.clone()),
        ),
        (
            "qwen-moe-like".to_string(),
            bf16_vs_cpu(
                "qwen-moe-like (random weights)",
                QWEN_MOE_LIKE,
                None,
                gpu.clone(),
            ),
        ),
    ];
    // The prefill experts' wmma kernels (what devices other than compute capability 9.0 run).
    if let Some(wmma) = cuda_with(
        "bf16_tracks_cpu_reference (wmma experts)",
        CudaOptions {
            moe_wgmma: false,
            ..CudaOptions::default()
        },
    ) {
        results.push((
            "qwen-moe-like".to_string(),
            bf16_vs_cpu(
                "qwen-moe-like (random weights, wmma experts)",
                QWEN_MOE_LIKE,
                None,
                wmma,
            ),
        ));
    }
    // The fused Gated DeltaNet decode kernel at 1 and 3 value heads per key head (clusters of
    // 1 and 3 blocks; the model above has 2).
    for (heads, what) in [
        (2, "1 value head per key head"),
        (6, "3 value heads per key head"),
    ] {
        let json = QWEN_LIKE.replace(
            "\"linear_num_value_heads\": 4",
            &format!("\"linear_num_value_heads\": {heads}"),
        );
        assert_ne!(json, QWEN_LIKE);
        results.push((
            "qwen-like".to_string(),
            bf16_vs_cpu(
                &format!("qwen-like (random weights, {what})"),
                &json,
                None,
                gpu.clone(),
            ),
        ));
    }
    // The Gated DeltaNet layers' separate conv, recurrence and norm kernels in small phases
    // (what runs where the fused clustered kernel does not apply).
    if let Some(unfused) = cuda_with(
        "bf16_tracks_cpu_reference (unfused Gated DeltaNet decode)",
        CudaOptions {
            gdn_fused: false,
            ..CudaOptions::default()
        },
    ) {
        results.push((
            "qwen-like".to_string(),
            bf16_vs_cpu(
                "qwen-like (random weights, unfused Gated DeltaNet decode)",
                QWEN_LIKE,
                None,
                unfused,
            ),
        ));
    }
    match fixtures_dir() {
        Some(dir) => {
            for name in FIXTURES {
                let json = std::fs::read_to_string(dir.join(name).join("config.json")).unwrap();
                results.push((
                    name.to_string(),
                    bf16_vs_cpu(name, &json, Some(&dir.join(name)), gpu.clone()),
                ));
            }
        }
        None => {
            println!("(fixture checkpoints not found: only the random-weight model was compared)")
        }
    }
    assert_bf16_within(&results, bf16_bound, "");
}

/// Every result of a bf16 comparison within `bound(name)` and the greedy agreement.
fn assert_bf16_within(results: &[(String, (f64, f64, usize))], bound: fn(&str) -> f64, what: &str) {
    for (name, (e, worst, agree)) in results {
        let bound = bound(name);
        assert!(
            *e <= bound && *worst <= bound,
            "{name}: bf16 logits rel err {e:.3e} / {worst:.3e} > {bound:.1e}{what}"
        );
        // Teacher-forced greedy decisions: bf16 may flip a near tie, not a run of them.
        assert!(
            *agree >= bf16_agreement(name),
            "{name}: bf16 greedy agreed with the CPU on only {agree}/12 steps{what}"
        );
    }
}

/// The same comparison with a 64-row bucket, so the 45-token prompt is one chunk of the chunked
/// Gated DeltaNet kernel (WY form on tensor cores, kernels/gated_deltanet.cu), which every
/// chunk of a bucket of 32 rows or more runs through, where the `[8, 16]` buckets above run
/// the token-by-token kernel; and with a 32-row bucket (two calls of one padded chunk each, the
/// state carried between them). Its bf16 operands (the state, A, P, T, v' rounded to bf16 for
/// the MMAs) drift further than the token kernel's f32 state, as flash-linear-attention's
/// chunked kernels do: bounds in [`bf16_chunked_bound`].
#[test]
fn bf16_chunked_prefill_tracks_cpu_reference() {
    let Some(gpu) = cuda("bf16_chunked_prefill_tracks_cpu_reference") else {
        return;
    };
    let mut results = vec![
        (
            "qwen-like".to_string(),
            bf16_vs_cpu_in(
                "qwen-like (random weights, 64-row chunk)",
                QWEN_LIKE,
                None,
                gpu.clone(),
                &[64],
            ),
        ),
        (
            "qwen-like".to_string(),
            bf16_vs_cpu_in(
                "qwen-like (random weights, 32-row chunks)",
                QWEN_LIKE,
                None,
                gpu.clone(),
                &[32],
            ),
        ),
        // 256-row chunks of the MoE model: 2048 (row, rank) pairs, so the prefill plan runs
        // over two blocks (kernels/moe.cu `moe_hist`, `moe_plan2`) and its GEMMs' tiles hold
        // up to 128 pairs of an expert.
        (
            "qwen-moe-like".to_string(),
            bf16_vs_cpu_len(
                "qwen-moe-like (random weights, 256-row chunks)",
                QWEN_MOE_LIKE,
                None,
                gpu.clone(),
                &[256],
                300,
            ),
        ),
    ];
    match fixtures_dir() {
        Some(dir) => {
            let name = "qwen35-public";
            let json = std::fs::read_to_string(dir.join(name).join("config.json")).unwrap();
            for bucket in [64, 32] {
                results.push((
                    name.to_string(),
                    bf16_vs_cpu_in(
                        &format!("{name} ({bucket}-row chunks)"),
                        &json,
                        Some(&dir.join(name)),
                        gpu.clone(),
                        &[bucket],
                    ),
                ));
            }
        }
        None => {
            println!("(fixture checkpoints not found: only the random-weight model was compared)")
        }
    }
    assert_bf16_within(&results, bf16_chunked_bound, " (chunked Gated DeltaNet)");
}

/// Bounds for [`bf16_chunked_prefill_tracks_cpu_reference`], by the same rule as
/// [`bf16_bound`] but against the reference implementation's own *chunked* bf16 path: on an
/// H200 (2026-12-04, transformers 5.17, torch 2.11, `benches/bf16_drift.py`) transformers'
/// bf16 forward of qwen35-public through flash-linear-attention's chunked kernels (what its GPU
/// users run) drifted 1.32e-1 from the f32 logits (its PyTorch fallback 8.5e-2); flashrt's
/// chunk kernel measured 1.19e-1 on the prompt (the token kernel 5.8e-2). The random-weight
/// model keeps its bound (it measured 2.7e-2).
fn bf16_chunked_bound(name: &str) -> f64 {
    match name {
        "qwen35-public" => 0.14,
        _ => bf16_bound(name),
    }
}

/// Chunks that take every plan of an `[8, 32]`-bucket model at several positions: prefill[32]
/// x1 + prefill[8] (5 rows), decode steps, prefill[32] (20 rows), prefill[8] (3 rows).
fn mixed_chunks(vocab: usize) -> Vec<Vec<u32>> {
    vec![
        prompt(37, vocab, 1),
        prompt(1, vocab, 2),
        prompt(1, vocab, 3),
        prompt(20, vocab, 4),
        prompt(3, vocab, 5),
    ]
}

/// The same token stream through CUDA graphs (with programmatic dependent launches) and
/// through plain launches (without) gives bit-identical logits: graphs are captured once per
/// phase and replayed at other positions and lengths, and PDL only moves launch latency.
#[test]
fn graphs_replay_like_direct_launches() {
    let Some(with) = cuda("graphs_replay_like_direct_launches") else {
        return;
    };
    let Some(without) = cuda_with(
        "graphs_replay_like_direct_launches",
        CudaOptions {
            graphs: false,
            pdl: false,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let a = model_on(with, &ir, None);
    let b = model_on(without, &ir, None);
    let mut sa = a.session().unwrap();
    let mut sb = b.session().unwrap();
    let chunks = mixed_chunks(a.vocab());
    for (i, c) in chunks.iter().enumerate() {
        let reps = if c.len() == 1 { 5 } else { 1 };
        for _ in 0..reps {
            sa.append(c).unwrap();
            sb.append(c).unwrap();
            assert_eq!(
                sa.logits(),
                sb.logits(),
                "chunk {i} (len {}) at pos {}: graph and direct logits differ",
                c.len(),
                sa.pos()
            );
        }
    }
    println!("graphs vs direct: {} positions bit-identical", sa.pos());
}

/// A session whose every plan was run and captured by `warm_plans` (what `flashrt serve` does
/// before its first request) steps exactly like a fresh one: its graphs, captured at position
/// 0, replay at every later position and length with bit-identical logits and state.
#[test]
fn warmed_session_steps_like_a_fresh_one() {
    let Some(gpu) = cuda("warmed_session_steps_like_a_fresh_one") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let m = model_on(gpu, &ir, None);
    let vocab = m.vocab();
    let mut warmed = m.session().unwrap();
    warmed.append(&prompt(9, vocab, 9)).unwrap();
    warmed.warm_plans().unwrap();
    assert_eq!(warmed.pos(), 0);
    let mut fresh = m.session().unwrap();
    for (i, c) in mixed_chunks(vocab).iter().enumerate() {
        warmed.append(c).unwrap();
        fresh.append(c).unwrap();
        assert_eq!(
            warmed.logits(),
            fresh.logits(),
            "chunk {i} at pos {}",
            fresh.pos()
        );
    }
    assert_state_equals(&warmed, &fresh.snapshot().unwrap(), "warmed vs fresh");
    println!("warmed vs fresh: {} positions bit-identical", fresh.pos());
}

/// A prompt appended with `LogitsMode::Last` runs its chunks without the LM head and its last
/// chunk with the head for the last row only (`StepLogits`); the next-token logits must match
/// the full computation's last row (one row through `gemv` instead of the bucket's cuBLASLt
/// matmul: the same products, summed in another order), and every later step must be the same.
#[test]
fn last_row_logits_match_full_prefill() {
    let Some(gpu) = cuda("last_row_logits_match_full_prefill") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let m = model_on(gpu, &ir, None);
    let vocab = m.vocab();
    for n in [5, 32, 77] {
        let p = prompt(n, vocab, 11);
        let mut full = m.session().unwrap();
        full.append(&p).unwrap();
        let want = full.logits()[(n - 1) * vocab..].to_vec();
        let mut last = m.session().unwrap();
        last.set_logits_mode(LogitsMode::Last);
        last.append(&p).unwrap();
        let got = last.last_logits().to_vec();
        let err = rel_err(&got, &want);
        println!("prompt {n}: last-row logits rel err {err:.2e}");
        assert!(
            err < 1e-4,
            "prompt {n}: last-row logits differ (rel err {err:.2e})"
        );
        assert_eq!(
            argmax(&got),
            argmax(&want),
            "prompt {n}: next token differs"
        );
        assert_eq!(
            full.decode_greedy(8).unwrap(),
            last.decode_greedy(8).unwrap(),
            "prompt {n}: continuations differ"
        );
    }
}

/// The MTP phases (draft and verify plans, with `StoreLastRow` / `LoadState` and the MTP
/// layer's own KV) on the GPU against the CPU, driven through the backend contract.
#[test]
fn mtp_phases_track_cpu() {
    let Some(gpu) = cuda("mtp_phases_track_cpu") else {
        return;
    };
    let json = qwen_like_mtp();
    let ir = ir_of(&json, DType::Bf16, &[8, 32], 256);
    assert!(ir.mtp.is_some(), "the config should have an MTP head");
    let run = |backend: Arc<dyn Backend>| {
        let compiled = Arc::new(compile(&ir, backend.target(&ir)));
        let w = round_weights(random_weights(&compiled, 3));
        let dev = backend.load(compiled.clone(), w).unwrap();
        let mut s = dev.new_session().unwrap();
        let vocab = compiled.ir.vocab;
        let p = prompt(20, vocab, 4);
        let mut out = Vec::new();
        s.step(Phase::Prefill { bucket: 32 }, &p, 0).unwrap();
        out.push(s.logits(20).unwrap());
        s.step(Phase::MtpDraft, &[p[19]], 19).unwrap();
        out.push(s.logits(1).unwrap());
        s.step(Phase::MtpDraft, &[7], 20).unwrap();
        out.push(s.logits(1).unwrap());
        s.step(Phase::Verify { k: 2 }, &[p[19], 7, 9], 20).unwrap();
        out.push(s.logits(3).unwrap());
        let hidden = compiled.layout.id("mtp.hidden").expect("mtp.hidden region");
        let h = decode(
            &s.read_region(hidden, 23).unwrap(),
            compiled.layout.buffer(hidden).dtype,
        );
        (out, h)
    };
    let (cpu_out, cpu_h) = run(cpu());
    let (gpu_out, gpu_h) = run(gpu);
    for (i, (g, c)) in gpu_out.iter().zip(&cpu_out).enumerate() {
        let e = rel_err(g, c);
        println!("mtp step {i}: logits rel err {e:.3e}");
        assert!(e <= 5e-2, "mtp step {i}: rel err {e:.3e}");
    }
    let e = rel_err(&gpu_h, &cpu_h);
    println!("mtp.hidden rel err {e:.3e}");
    assert!(e <= 5e-2, "mtp.hidden rel err {e:.3e}");
}

/// Reading many logits rows (more than one pinned bounce buffer: 32 rows x 40000) gives the
/// same rows as the CPU, in the right places.
#[test]
fn large_logits_reads() {
    let Some(gpu) = cuda("large_logits_reads") else {
        return;
    };
    let json = QWEN_LIKE.replace("\"vocab_size\": 1000", "\"vocab_size\": 40000");
    let ir = ir_of(&json, DType::Bf16, &[8, 32], 256);
    let c = model_on(cpu(), &ir, None);
    let g = model_on(gpu, &ir, None);
    let p = prompt(45, 40000, 5);
    let mut cs = c.session().unwrap();
    let mut gs = g.session().unwrap();
    cs.append(&p).unwrap();
    gs.append(&p).unwrap();
    let v = 40000;
    for (r, (gr, cr)) in gs
        .logits()
        .chunks_exact(v)
        .zip(cs.logits().chunks_exact(v))
        .enumerate()
    {
        let e = rel_err(gr, cr);
        assert!(e <= 5e-2, "row {r}: rel err {e:.3e}");
    }
    println!("large logits reads: {} rows x {v} ok", p.len());
}

fn assert_state_equals(s: &Session, cap: &Capsule, what: &str) {
    let layout = &s.model().compiled().layout;
    for b in layout.buffers.iter().filter(|b| b.role == Role::State) {
        let now = s.read_region(&b.name).unwrap();
        let saved = cap.region(&b.name).unwrap();
        assert!(
            now == saved,
            "{what}: region `{}` differs from the capsule ({} vs {} bytes)",
            b.name,
            now.len(),
            saved.len()
        );
    }
}

#[test]
fn capsules_on_gpu() {
    let Some(gpu) = cuda("capsules_on_gpu") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let model = model_on(gpu, &ir, None);
    let vocab = model.vocab();
    let mut s = model.session().unwrap();
    s.append(&prompt(41, vocab, 9)).unwrap();
    let cap = s.snapshot().unwrap();
    assert_eq!(
        cap.bytes(),
        model.compiled().layout.capsule_bytes(41),
        "capsule holds exactly the used state bytes"
    );
    assert!(
        cap.location().starts_with("cuda:"),
        "device-resident capsule, got {}",
        cap.location()
    );
    assert_state_equals(&s, &cap, "right after snapshot");
    let (t1, l1) = greedy(&mut s, 12);

    // Restore into the dirty session: byte-exact state, identical continuation. It holds
    // the capsule's 41 KV rows still (it only wrote past them), so the restore copies the
    // rest (`Session::rows_held`); a fresh session's fork below copies them all.
    assert_eq!(s.rows_held(&cap), 41);
    s.restore(&cap).unwrap();
    assert_state_equals(&s, &cap, "after restore");
    let (t2, l2) = greedy(&mut s, 12);
    assert_eq!(t1, t2, "greedy tokens after restore");
    assert!(l1 == l2, "logits after restore are not bit-identical");

    // Fork: an independent session from the same boundary.
    let mut f = model.fork(&cap).unwrap();
    assert_state_equals(&f, &cap, "fork");
    let (t3, l3) = greedy(&mut f, 12);
    assert_eq!(t1, t3, "greedy tokens of a fork");
    assert!(l1 == l3, "fork logits are not bit-identical");

    // Pinned-host tier: park, restore from host memory, unpark, restore again.
    let dev = cap
        .saved()
        .as_any()
        .downcast_ref::<CudaSaved>()
        .expect("a CUDA saved state");
    let parked = dev.park().unwrap();
    assert!(parked.is_parked());
    let pcap =
        Capsule::from_parts(cap.meta.clone(), Arc::new(parked), model.compiled().clone()).unwrap();
    assert_eq!(pcap.location(), "pinned");
    for b in model
        .compiled()
        .layout
        .buffers
        .iter()
        .filter(|b| b.role == Role::State)
    {
        assert!(
            pcap.region(&b.name).unwrap() == cap.region(&b.name).unwrap(),
            "parked region `{}`",
            b.name
        );
    }
    s.restore(&pcap).unwrap();
    assert_state_equals(&s, &cap, "after restore from pinned");
    let (t4, l4) = greedy(&mut s, 12);
    assert_eq!(t1, t4);
    assert!(
        l1 == l4,
        "logits after a pinned restore are not bit-identical"
    );
    let unparked = pcap
        .saved()
        .as_any()
        .downcast_ref::<CudaSaved>()
        .unwrap()
        .unpark()
        .unwrap();
    let ucap = Capsule::from_parts(
        cap.meta.clone(),
        Arc::new(unparked),
        model.compiled().clone(),
    )
    .unwrap();
    s.restore(&ucap).unwrap();
    assert_state_equals(&s, &cap, "after restore from an unparked copy");

    // Any other saved state (here: plain host bytes, as a capsule file yields) restores
    // through the generic host path.
    let host = HostSaved::from_saved(&model.compiled().layout, cap.saved().as_ref()).unwrap();
    let hcap =
        Capsule::from_parts(cap.meta.clone(), Arc::new(host), model.compiled().clone()).unwrap();
    let mut h = model.session().unwrap();
    h.restore(&hcap).unwrap();
    assert_state_equals(&h, &cap, "after restore from host bytes");
    let (th, lh) = greedy(&mut h, 12);
    assert_eq!(t1, th);
    assert!(
        l1 == lh,
        "logits after a host-bytes restore are not bit-identical"
    );

    // Dropping the capsules right after restores must be safe (frees are ordered after reads).
    let cap2 = s.snapshot().unwrap();
    let mut g = model.session().unwrap();
    g.restore(&cap2).unwrap();
    drop(cap2);
    let (t5, _) = greedy(&mut g, 12);
    assert_eq!(t1, t5);

    // KV-only ablation: recurrent and conv state are load-bearing.
    s.restore(&cap).unwrap();
    let _ = greedy(&mut s, 5);
    s.restore_kv_only(&cap).unwrap();
    let (_, l6) = greedy(&mut s, 12);
    assert!(
        l6 != l1,
        "KV-only restore reproduced the full restore: recurrent state had no effect?"
    );
    println!(
        "capsules on GPU: {} bytes at pos 41; restore/fork/pinned bit-identical; KV-only diverges",
        cap.bytes()
    );
}

#[test]
fn errors_are_reported_not_panics() {
    let Some(gpu) = cuda("errors_are_reported_not_panics") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8], 64);
    let model = model_on(gpu.clone(), &ir, None);
    let mut s = model.session().unwrap();
    assert!(s.append(&[5000]).is_err(), "token id beyond the vocabulary");
    let mut s = model.session().unwrap();
    assert!(
        s.append(&prompt(65, model.vocab(), 3)).is_err(),
        "beyond max_seq"
    );
    // A capsule of another model is refused with a fingerprint error.
    let other = model_on(gpu, &ir_of(QWEN_LIKE, DType::Bf16, &[16], 64), None);
    let mut o = other.session().unwrap();
    o.append(&prompt(4, other.vocab(), 1)).unwrap();
    let cap = o.snapshot().unwrap();
    let mut s = model.session().unwrap();
    let err = s.restore(&cap).expect_err("foreign capsule");
    println!("foreign capsule refused: {err}");
}

/// `load_random` generates the weights on the device with the host generator's counter-based
/// formula: an f32 model with device-generated weights must give the CPU reference's logits
/// (same values up to f64 libm rounding in the last bits).
#[test]
fn device_random_weights_match_the_host_generator() {
    let Some(gpu) = cuda("device_random_weights_match_the_host_generator") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::F32, &[16], 256);
    let cpu_model = Model::with_random_weights(cpu(), &ir, 11).expect("cpu model");
    let gpu_model = Model::with_random_weights(gpu, &ir, 11).expect("gpu model");
    let tokens = prompt(23, ir.vocab, 5);
    let mut a = cpu_model.session().unwrap();
    let mut b = gpu_model.session().unwrap();
    a.append(&tokens).unwrap();
    b.append(&tokens).unwrap();
    let (x, y) = (a.last_logits(), b.last_logits());
    let scale = x.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let err = x
        .iter()
        .zip(y)
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max)
        / scale;
    println!("device vs host random weights: logits rel err {err:.3e}");
    assert!(
        err < 1e-4,
        "device-generated weights differ from the host generator: rel err {err:.3e}"
    );
}

/// `max|a - b| / max|b|`.
fn rel_err_of(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
        / scale
}

/// Greedy tokens agree until a step whose reference margin (top-1 minus top-2) is within the
/// numerical error; returns how many agreed before such a step (or all of them).
fn agree_where_margins_allow(
    ours: &[u32],
    theirs: &[u32],
    their_logits: &[f32],
    vocab: usize,
    tol_abs: f32,
) -> usize {
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        if a != b {
            let row = &their_logits[i * vocab..(i + 1) * vocab];
            let mut sorted = row.to_vec();
            sorted.sort_by(|x, y| y.total_cmp(x));
            let margin = sorted[0] - sorted[1];
            assert!(
                margin <= 2.0 * tol_abs,
                "greedy step {i}: {a} vs {b} with a clear reference margin {margin} (tolerance {tol_abs})"
            );
            return i;
        }
    }
    ours.len()
}

/// Issue 4's capsule contract on the GPU in bf16: restore + append at boundaries that are not
/// on the bucket grid, and a 2-branch fork, each against a cold prefill of the whole sequence
/// on the same GPU. Different chunkings round differently in bf16, so logits agree within the
/// bf16 bound used against the CPU reference (3e-2 for this shape) and greedy ids agree
/// wherever the margin exceeds it.
#[test]
fn unaligned_restore_and_forks_match_cold_prefill_on_gpu() {
    let Some(gpu) = cuda("unaligned_restore_and_forks_match_cold_prefill_on_gpu") else {
        return;
    };
    // bf16 differences between a decode step and a prefill chunk (other kernels) move close
    // routing decisions in the MoE model: its bound is wider (measured 4.5e-2 at split 1).
    for (name, json, tol) in [
        ("qwen-like", QWEN_LIKE, 3e-2),
        ("qwen-moe-like", QWEN_MOE_LIKE, 8e-2),
    ] {
        println!("{name}:");
        unaligned_restore_and_forks(gpu.clone(), json, tol);
    }
}

fn unaligned_restore_and_forks(gpu: Arc<dyn Backend>, json: &str, tol: f64) {
    let ir = ir_of(json, DType::Bf16, &[8, 32], 256);
    let model = model_on(gpu, &ir, None);
    let vocab = model.vocab();
    let full = prompt(90, vocab, 21);
    for split in [1usize, 13, 41, 67] {
        let (head, tail) = full.split_at(split);
        let mut s = model.session().unwrap();
        s.append(head).unwrap();
        let cap = s.snapshot().unwrap();
        s.append(&prompt(29, vocab, 3)).unwrap(); // dirty it
        s.restore(&cap).unwrap();
        s.set_logits_mode(LogitsMode::All);
        s.append(tail).unwrap();
        let ours = s.logits().to_vec();
        let mut cold = model.session().unwrap();
        cold.set_logits_mode(LogitsMode::All);
        cold.append(&full).unwrap();
        let theirs = &cold.logits()[split * vocab..];
        let err = rel_err_of(&ours, theirs);
        println!(
            "restore at {split} + append {}: logits rel err {err:.3e} vs cold prefill",
            tail.len()
        );
        assert!(err <= tol, "split {split}: rel err {err:.3e} > {tol:.0e}");
        let (t_ours, _) = greedy(&mut s, 12);
        let (t_cold, l_cold) = greedy(&mut cold, 12);
        let scale = l_cold.iter().fold(0f32, |m, v| m.max(v.abs()));
        let n = agree_where_margins_allow(&t_ours, &t_cold, &l_cold, vocab, (tol as f32) * scale);
        println!("  greedy agreement {n}/12");
    }
    // Two branches from one capsule equal two cold runs.
    let base = prompt(37, vocab, 4);
    let mut s = model.session().unwrap();
    s.append(&base).unwrap();
    let cap = s.snapshot().unwrap();
    for (i, suffix) in [prompt(9, vocab, 5), prompt(14, vocab, 6)]
        .iter()
        .enumerate()
    {
        let mut branch = model.fork(&cap).unwrap();
        branch.set_logits_mode(LogitsMode::All);
        branch.append(suffix).unwrap();
        let ours = branch.logits().to_vec();
        let mut cold = model.session().unwrap();
        cold.set_logits_mode(LogitsMode::All);
        let whole: Vec<u32> = base.iter().chain(suffix).copied().collect();
        cold.append(&whole).unwrap();
        let err = rel_err_of(&ours, &cold.logits()[base.len() * vocab..]);
        let (tb, _) = greedy(&mut branch, 12);
        let (tc, lc) = greedy(&mut cold, 12);
        let scale = lc.iter().fold(0f32, |m, v| m.max(v.abs()));
        let n = agree_where_margins_allow(&tb, &tc, &lc, vocab, (tol as f32) * scale);
        println!(
            "fork branch {}: logits rel err {err:.3e} vs cold, greedy agreement {n}/12",
            i + 1
        );
        assert!(err <= tol, "branch {}: rel err {err:.3e}", i + 1);
    }
}

/// Issue 5 on the GPU: speculative greedy decoding with the MTP drafter (k = 1..4), an oracle
/// drafter (every draft accepted) and an adversary (every draft rejected) gives exactly the
/// tokens of plain greedy decoding. This needs verify rows to round like decode rows, which
/// the CUDA programs guarantee by sharing one GEMM shape and one attention split count across
/// every phase of at most MAX_DRAFT + 1 rows in models with verify plans.
#[test]
fn speculative_greedy_matches_plain_on_gpu() {
    use flashrt_runtime::speculative::{AdversaryDrafter, MtpDrafter, OracleDrafter};
    let Some(gpu) = cuda("speculative_greedy_matches_plain_on_gpu") else {
        return;
    };
    let json = qwen_like_mtp();
    let ir = ir_of(&json, DType::Bf16, &[8, 32], 512);
    assert!(ir.mtp.is_some());
    let model = Model::with_random_weights(gpu, &ir, 3).expect("model");
    let vocab = model.vocab();
    const N: usize = 120;
    for seed in [8u64, 9] {
        let p = prompt(40, vocab, seed);
        let mut a = model.session().unwrap();
        a.append_with_mtp(&p).unwrap();
        let plain = a.decode_greedy(N).unwrap();
        for k in 1..=4 {
            let mut b = model.session().unwrap();
            b.append_with_mtp(&p).unwrap();
            let (t, st) = b.decode_speculative(N, k, &mut MtpDrafter).unwrap();
            let same = t.iter().zip(&plain).take_while(|(x, y)| x == y).count();
            println!(
                "seed {seed} k {k}: mtp drafts {} accepted {} rollbacks {}; {same}/{N} tokens agree",
                st.drafted, st.accepted, st.rollbacks
            );
            assert_eq!(
                t, plain,
                "seed {seed}, k {k}: speculative output differs from plain greedy at token {same}"
            );
            assert_eq!(b.tokens(), a.tokens(), "history");
        }
        // The drafters' reference is the whole sequence from position 0.
        let reference: Vec<u32> = p.iter().chain(&plain).copied().collect();
        let mut o = model.session().unwrap();
        o.append_with_mtp(&p).unwrap();
        let (t, st) = o
            .decode_speculative(N, 4, &mut OracleDrafter::new(reference.clone()))
            .unwrap();
        assert_eq!(t, plain, "oracle drafter output");
        assert_eq!(st.accepted, st.drafted, "oracle: every draft accepted");
        let mut v = model.session().unwrap();
        v.append_with_mtp(&p).unwrap();
        let (t, st) = v
            .decode_speculative(N, 4, &mut AdversaryDrafter::new(reference))
            .unwrap();
        assert_eq!(t, plain, "adversary drafter output");
        assert_eq!(st.accepted, 0, "adversary: every draft rejected");
        println!("seed {seed}: oracle and adversary drafters reproduce plain greedy");
    }
}

/// Per-row states on the GPU (`CudaOptions::row_states`): the fused Gated DeltaNet kernel keeps
/// the recurrent and conv states after every verified row, and a round whose drafts are
/// rejected copies back the last accepted row's instead of replaying. Against the same model
/// rolled back by restore + replay: the same tokens, no replay, and every target state region
/// (and `mtp.hidden`) byte for byte the same after each run — all rejected (adversary) and the
/// MTP head's own drafts, k = 1..4.
#[test]
fn row_states_roll_back_like_a_replay_on_gpu() {
    use flashrt_runtime::speculative::{AdversaryDrafter, MtpDrafter};
    let name = "row_states_roll_back_like_a_replay_on_gpu";
    let Some(kept) = cuda_with(
        name,
        CudaOptions {
            row_states: true,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    let Some(replayed) = cuda_with(
        name,
        CudaOptions {
            row_states: false,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    let json = qwen_like_mtp();
    let ir = ir_of(&json, DType::Bf16, &[8, 32], 512);
    let mk = |b| Model::with_random_weights(b, &ir, 3).expect("model");
    let (mk_kept, mk_replay) = (mk(kept), mk(replayed));
    let vocab = mk_kept.vocab();
    const N: usize = 60;
    let state = |s: &flashrt_runtime::Session| -> Vec<(String, Vec<u8>)> {
        s.model()
            .compiled()
            .layout
            .state_buffers()
            .filter(|b| !(b.name.starts_with("mtp.") && b.name != "mtp.hidden"))
            .map(|b| (b.name.clone(), s.read_region(b.id).unwrap()))
            .collect()
    };
    let p = prompt(40, vocab, 8);
    let mut reference = mk_replay.session().unwrap();
    reference.append_with_mtp(&p).unwrap();
    let plain = reference.decode_greedy(N).unwrap();
    let all: Vec<u32> = p.iter().chain(&plain).copied().collect();
    for k in 1..=4 {
        for adversary in [true, false] {
            let run = |m: &Model| {
                let mut s = m.session().unwrap();
                s.append_with_mtp(&p).unwrap();
                let (t, st) = if adversary {
                    s.decode_speculative(N, k, &mut AdversaryDrafter::new(all.clone()))
                } else {
                    s.decode_speculative(N, k, &mut MtpDrafter)
                }
                .unwrap();
                (t, st, state(&s))
            };
            let (ta, sa, a) = run(&mk_kept);
            let (tb, sb, b) = run(&mk_replay);
            let what = format!("k {k}, adversary {adversary}");
            assert_eq!(ta, tb, "{what}: tokens");
            assert!(sa.rollbacks > 0, "{what}: {sa:?}");
            assert_eq!(
                sa.replayed, 0,
                "{what}: the kept states roll back without a replay"
            );
            assert_eq!(sb.replayed > 0, sb.rollbacks > 0, "{what}: {sb:?}");
            for ((name, x), (_, y)) in a.iter().zip(&b) {
                assert!(
                    x == y,
                    "{what}: region `{name}` differs from the replayed run's"
                );
            }
            println!(
                "{what}: {} rollbacks by copy, state equal to the replayed run",
                sa.rollbacks
            );
        }
    }
}

/// Issue 5 on the GPU: a capsule taken mid-way through speculative decoding holds the
/// drafter's state too (its K/V regions and `mtp.hidden`), restores byte-exactly into another
/// session, and the restored session continues with exactly the same tokens and drafts.
#[test]
fn speculative_capsule_mid_run_restores_exactly_on_gpu() {
    use flashrt_runtime::speculative::MtpDrafter;
    let Some(gpu) = cuda("speculative_capsule_mid_run_restores_exactly_on_gpu") else {
        return;
    };
    let json = qwen_like_mtp();
    let ir = ir_of(&json, DType::Bf16, &[8, 32], 512);
    let model = Model::with_random_weights(gpu, &ir, 3).expect("model");
    let p = prompt(33, model.vocab(), 12);
    let mut a = model.session().unwrap();
    a.append_with_mtp(&p).unwrap();
    let (first, _) = a.decode_speculative(37, 3, &mut MtpDrafter).unwrap();
    let cap = a.snapshot().unwrap();
    let names: Vec<String> = cap.regions().iter().map(|r| r.name().to_string()).collect();
    for needed in ["mtp.0.key", "mtp.0.value", "mtp.hidden"] {
        assert!(
            names.iter().any(|n| n == needed),
            "capsule lacks `{needed}`: {names:?}"
        );
    }
    let (rest, st_a) = a.decode_speculative(50, 3, &mut MtpDrafter).unwrap();
    // Restore into a session dirtied by another prompt.
    let mut b = model.session().unwrap();
    b.append_with_mtp(&prompt(20, model.vocab(), 13)).unwrap();
    b.restore(&cap).unwrap();
    assert_state_equals(&b, &cap, "after restoring a mid-run speculative capsule");
    let (again, st_b) = b.decode_speculative(50, 3, &mut MtpDrafter).unwrap();
    assert_eq!(rest, again, "continuation after restore");
    assert_eq!(
        (st_a.drafted, st_a.accepted),
        (st_b.drafted, st_b.accepted),
        "same drafts"
    );
    // And it is still plain greedy.
    let mut c = model.session().unwrap();
    c.append_with_mtp(&p).unwrap();
    let plain = c.decode_greedy(87).unwrap();
    let spec: Vec<u32> = first.iter().chain(&rest).copied().collect();
    assert_eq!(spec, plain, "speculative = plain greedy across the capsule");
    println!(
        "mid-run capsule at {}: {} bytes, continuation identical, drafter regions included",
        cap.pos(),
        cap.bytes()
    );
}

/// Sessions of one model share its scratch and I/O arenas and its stream (backend/cuda/exec.rs):
/// two sessions appending in turn, and two threads appending at once, each get exactly the
/// logits a session alone gets (same programs, so bit for bit); a raw device session whose
/// logits another session's step overwrote gets an error, not the other session's numbers.
#[test]
fn sessions_share_arenas_without_crosstalk() {
    let Some(gpu) = cuda("sessions_share_arenas_without_crosstalk") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let model = model_on(gpu.clone(), &ir, None);
    let vocab = model.vocab();
    let chunks = |seed: u64| -> Vec<Vec<u32>> {
        vec![
            prompt(37, vocab, seed),
            prompt(1, vocab, seed + 1),
            prompt(5, vocab, seed + 2),
            prompt(1, vocab, seed + 3),
            prompt(1, vocab, seed + 4),
        ]
    };
    let alone = |seed: u64| -> Vec<Vec<f32>> {
        let mut s = model.session().unwrap();
        chunks(seed)
            .iter()
            .map(|c| {
                s.append(c).unwrap();
                s.logits().to_vec()
            })
            .collect()
    };
    let (want_a, want_b) = (alone(10), alone(20));
    assert_ne!(
        want_a, want_b,
        "different prompts should give different logits"
    );

    // In turn, on one thread.
    let mut sa = model.session().unwrap();
    let mut sb = model.session().unwrap();
    for (i, (ca, cb)) in chunks(10).iter().zip(chunks(20)).enumerate() {
        sa.append(ca).unwrap();
        sb.append(&cb).unwrap();
        assert_eq!(
            sa.logits(),
            &want_a[i][..],
            "session a, chunk {i}, interleaved"
        );
        assert_eq!(
            sb.logits(),
            &want_b[i][..],
            "session b, chunk {i}, interleaved"
        );
    }
    drop((sa, sb));

    // At once, on four threads (each its own session), several rounds each.
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (model, want) = (&model, if t % 2 == 0 { &want_a } else { &want_b });
            let seed = if t % 2 == 0 { 10 } else { 20 };
            scope.spawn(move || {
                for round in 0..3 {
                    let mut s = model.session().unwrap();
                    for (i, c) in chunks(seed).iter().enumerate() {
                        s.append(c).unwrap();
                        assert_eq!(
                            s.logits(),
                            &want[i][..],
                            "thread {t} round {round} chunk {i}"
                        );
                    }
                }
            });
        }
    });

    // Raw device sessions: a read after another session's step is refused.
    let compiled = Arc::new(compile(&ir, gpu.target(&ir)));
    let dev = gpu
        .load(compiled, random_weights(model.compiled(), 7))
        .unwrap();
    let mut a = dev.new_session().unwrap();
    let mut b = dev.new_session().unwrap();
    let p = prompt(8, vocab, 3);
    a.step(Phase::Prefill { bucket: 8 }, &p, 0).unwrap();
    b.step(Phase::Prefill { bucket: 8 }, &p, 0).unwrap();
    let err = a
        .logits(8)
        .expect_err("a's logits were overwritten by b's step");
    assert!(err.to_string().contains("overwritten"), "{err}");
    assert_eq!(b.logits(8).unwrap().len(), 8 * vocab);
    println!(
        "sessions share {} bytes; each owns {} (state arena {})",
        dev.shared_bytes(),
        dev.session_bytes(),
        model.compiled().layout.arena_bytes(Role::State)
    );
}

/// Costs under which 2..5 tokens take one verify pass (whatever the measured ones say).
fn verify_first(model: &Model) {
    let table = flashrt_runtime::ChunkCosts::new(
        model
            .chunk_costs()
            .plans()
            .iter()
            .map(|p| flashrt_runtime::PlanCost {
                phase: p.phase,
                fixed: if matches!(p.phase, Phase::Verify { .. }) {
                    1.0
                } else {
                    5.0
                },
                per_row: 0.0,
            })
            .collect(),
        flashrt_runtime::CostSource::Given,
    );
    model.set_chunk_costs(table).unwrap();
}

/// Issue 13 on the GPU: a suffix of 2 to 5 tokens runs as one verify pass, whose rows round as
/// decode steps round (one GEMM shape, one attention split count for every phase of at most
/// MAX_DRAFT + 1 rows), so its last logits and the state it leaves equal feeding the tokens
/// one at a time, bit for bit. Then every plan is timed (`calibrate_chunking`), and a long
/// suffix split by the measured costs still tracks a cold prefill within the bf16 bound of
/// `unaligned_restore_and_forks_match_cold_prefill_on_gpu`.
#[test]
fn short_suffixes_run_as_verify_passes_on_gpu() {
    let Some(gpu) = cuda("short_suffixes_run_as_verify_passes_on_gpu") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    assert!(
        ir.mtp.is_none(),
        "verify plans serve models without an MTP head too"
    );
    let model = model_on(gpu, &ir, None);
    let vocab = model.vocab();
    let head = prompt(40, vocab, 31);
    let mut base = model.session().unwrap();
    base.append(&head).unwrap();
    let cap = base.snapshot().unwrap();
    let state = |s: &Session| -> Vec<(String, Vec<u8>)> {
        s.model()
            .compiled()
            .layout
            .state_buffers()
            .map(|b| (b.name.clone(), s.read_region(&b.name).unwrap()))
            .collect()
    };
    verify_first(&model);
    for n in 2..=5usize {
        assert_eq!(
            model.plan_chunks(n),
            vec![(Phase::Verify { k: n - 1 }, n)],
            "{n} tokens in one verify pass"
        );
        let suffix = prompt(n, vocab, 40 + n as u64);
        let mut pass = model.fork(&cap).unwrap();
        pass.append(&suffix).unwrap();
        let mut steps = model.fork(&cap).unwrap();
        for &t in &suffix {
            steps.append(&[t]).unwrap();
        }
        assert!(
            pass.last_logits() == steps.last_logits(),
            "{n} tokens: verify pass logits differ from {n} decode steps"
        );
        assert!(
            state(&pass) == state(&steps),
            "{n} tokens: verify pass state differs from {n} decode steps"
        );
        println!("{n} tokens: one verify pass == {n} decode steps (logits and state, bitwise)");
    }

    let costs = model
        .calibrate_chunking(2, &mut |line| println!("  {line}"))
        .unwrap();
    assert_eq!(costs.source(), flashrt_runtime::CostSource::Measured);
    assert_eq!(
        costs.plans().len(),
        2 + 1 + 4,
        "two buckets, decode, four verify plans"
    );
    assert!(
        costs
            .plans()
            .iter()
            .all(|p| p.fixed > 0.0 && p.per_row >= 0.0)
    );
    println!("measured: {costs}");
    let tail = prompt(41, vocab, 77);
    let steps = model.plan_chunks(tail.len());
    assert_eq!(steps.iter().map(|s| s.1).sum::<usize>(), 41);
    let mut s = model.fork(&cap).unwrap();
    s.set_logits_mode(LogitsMode::All);
    s.append(&tail).unwrap();
    let mut cold = model.session().unwrap();
    cold.set_logits_mode(LogitsMode::All);
    let whole: Vec<u32> = head.iter().chain(&tail).copied().collect();
    cold.append(&whole).unwrap();
    let err = rel_err_of(s.logits(), &cold.logits()[head.len() * vocab..]);
    println!("41 tokens as {steps:?}: logits rel err {err:.3e} vs cold prefill");
    assert!(err <= 3e-2, "rel err {err:.3e}");
}

/// `CudaOptions::gemv_tiles` (several rows' gemv launches as resident blocks looping over
/// tiles) changes which block computes a tile, and `CudaOptions::gemv_stage_rows` (the fused
/// norm's rows normalised once per block into shared memory, from that many rows up) where a
/// tile reads its normalised inputs, never the arithmetic: verify passes of 2..5 rows give the
/// same logits and state bit for bit under every combination (staged from 2 rows, from 3, or
/// never).
#[test]
fn gemv_tiles_compute_what_one_block_per_tile_computes() {
    let name = "gemv_tiles_compute_what_one_block_per_tile_computes";
    let with = |gemv_tiles, gemv_stage_rows| CudaOptions {
        gemv_tiles,
        gemv_stage_rows,
        ..CudaOptions::default()
    };
    let all = [
        with(false, 0),
        with(true, 0),
        with(false, 2),
        with(true, 2),
        with(false, 3),
    ];
    if same_bits_with(name, QWEN_LIKE, &all) {
        println!("gemv_tiles and gemv_stage_rows: verify passes of 2..5 rows bit-identical");
    }
}

/// `CudaOptions::gdn_col_blocks` (a value head's state columns over 1, 2 or 4 blocks of the
/// fused Gated DeltaNet decode kernel, the gated norm's partial sums shared through the
/// cluster) changes which block computes a column, never the arithmetic: decode steps and
/// verify passes of 2..5 rows give the same logits and state bit for bit, at 1, 2 and 3 value
/// heads per key head (clusters of up to 12 blocks).
#[test]
fn gdn_column_blocks_compute_what_one_block_per_head_computes() {
    let name = "gdn_column_blocks_compute_what_one_block_per_head_computes";
    let with = |nb| CudaOptions {
        gdn_col_blocks: nb,
        ..CudaOptions::default()
    };
    for heads in [2, 4, 6] {
        let json = QWEN_LIKE.replace(
            "\"linear_num_value_heads\": 4",
            &format!("\"linear_num_value_heads\": {heads}"),
        );
        if !same_bits_with(name, &json, &[with(1), with(2), with(4)]) {
            return;
        }
        println!(
            "{} value heads per key head: 1, 2 and 4 blocks a head bit-identical",
            heads / 2
        );
    }
}

/// `CudaOptions::moe_wide` (the prefill experts' grouped GEMMs over 128-pair x 256-row tiles
/// with persistent blocks, kernels/moe_wgmma.cu `moe_*_w2`) changes which tile and block
/// compute an output, never its tensor-core dot product: prefill chunks give the same logits
/// and states bit for bit as the 64 x 128 tiles. Chunks of up to 512 rows, so that with 8 of
/// 32 experts per token some experts get more than one 128-pair tile, and blocks take several
/// work items each.
#[test]
fn moe_wide_tiles_compute_what_the_narrow_tiles_compute() {
    let name = "moe_wide_tiles_compute_what_the_narrow_tiles_compute";
    let with = |moe_wide| CudaOptions {
        moe_wide,
        ..CudaOptions::default()
    };
    if same_bits_over(
        name,
        QWEN_MOE_LIKE,
        &[with(false), with(true)],
        &[8, 32, 512],
        &[600, 40, 3, 1, 300],
    ) {
        println!("moe_wide on and off: prefill chunks of 40..512 rows bit-identical");
    }
}

/// `CudaOptions::moe_prefetch` (the routed up launch asks the L2 for the next matmul's first
/// weights before its PDL wait) moves bytes into the L2 and computes nothing: decode and verify
/// steps of 1..5 rows give the same logits and states bit for bit with it off, at 32 MiB and
/// asking for far more than any matrix holds (capped at the matrix: a prefetch past its end
/// would read outside the weights).
#[test]
fn moe_prefetch_changes_nothing_computed() {
    let name = "moe_prefetch_changes_nothing_computed";
    let with = |mib: usize| CudaOptions {
        moe_prefetch: mib << 20,
        ..CudaOptions::default()
    };
    if same_bits_with(name, QWEN_MOE_LIKE, &[with(0), with(32), with(1 << 12)]) {
        println!("moe_prefetch 0, 32 MiB and 4 GiB: bit-identical");
    }
}

/// `CudaOptions::gemv_early` (one-row gemv launches without a fused norm load their first
/// weights before their PDL wait) changes when weights arrive, never what is computed: decode
/// and verify steps of 1..5 rows give the same logits and states bit for bit with it off and
/// with every such launch taking it (the model's Gated DeltaNet out_proj and attention o_proj
/// at one row).
#[test]
fn gemv_early_changes_nothing_computed() {
    let name = "gemv_early_changes_nothing_computed";
    let with = |gemv_early: usize| CudaOptions {
        gemv_early,
        ..CudaOptions::default()
    };
    if same_bits_with(name, QWEN_MOE_LIKE, &[with(0), with(usize::MAX)]) {
        println!("gemv_early off and on for every launch: bit-identical");
    }
}

/// `CudaOptions::linear_group`: a prefill chunk's matmuls that read one input and write
/// adjacent columns (each Gated DeltaNet layer's four input projections, attention's q / k / v,
/// every MLP's gate and up) run as one cuBLASLt matmul per group, and compute what the
/// separate matmuls compute up to the GEMM's own rounding (its algorithm may change with the
/// width, so not bit for bit): a 32-row chunk's profile holds the 3 + 1 + 4 groups of the
/// model's layers with the option on and none with it off, and the logits of prefill chunks
/// and decode steps after them agree within the bf16 bound.
#[test]
fn linear_groups_run_as_one_matmul_and_compute_what_separate_ones_compute() {
    let name = "linear_groups_run_as_one_matmul_and_compute_what_separate_ones_compute";
    let with = |linear_group: bool| CudaOptions {
        linear_group,
        ..CudaOptions::default()
    };
    let (Some(on), Some(off)) = (cuda_with(name, with(true)), cuda_with(name, with(false))) else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let models = [model_on(on, &ir, None), model_on(off, &ir, None)];
    let vocab = models[0].vocab();
    let tokens = prompt(32, vocab, 7);
    let groups: Vec<Vec<String>> = models
        .iter()
        .map(|m| {
            let mut s = m.session().unwrap();
            s.profile_chunk(&tokens)
                .unwrap()
                .into_iter()
                .map(|(label, _)| label)
                .filter(|l| l.contains("(linear)") && l.contains("` + `"))
                .collect()
        })
        .collect();
    for w in [
        "in_proj_qkv` + `layers.0.gdn.in_proj_z` + `layers.0.gdn.in_proj_b` + `layers.0.gdn.in_proj_a`",
        "q_proj` + `layers.3.attn.k_proj` + `layers.3.attn.v_proj`",
        "gate_proj` + `layers.3.mlp.up_proj`",
    ] {
        assert!(
            groups[0].iter().any(|l| l.contains(w)),
            "no grouped matmul `{w}` among {:?}",
            groups[0]
        );
    }
    assert_eq!(groups[0].len(), 8, "grouped matmuls: {:?}", groups[0]);
    assert!(
        groups[1].is_empty(),
        "grouped with the option off: {:?}",
        groups[1]
    );
    let mut s: Vec<Session> = models.iter().map(|m| m.session().unwrap()).collect();
    for (i, n) in [40, 3, 1, 1, 32].into_iter().enumerate() {
        let chunk = prompt(n, vocab, 90 + i as u64);
        for x in s.iter_mut() {
            x.append(&chunk).unwrap();
        }
        let err = rel_err_of(s[0].logits(), s[1].logits());
        assert!(!s[0].logits().is_empty());
        assert!(
            err < bf16_bound("qwen-like"),
            "chunk {i} ({n} rows): grouped and separate matmuls' logits differ by {err:.3e}"
        );
    }
    println!("linear groups: 8 grouped matmuls in a 32-row chunk; logits within the bf16 bound");
}

/// The MoE configurations the small-phase kernels' bit-identity tests run: the
/// Qwen3.5-MoE-like model (softmax, renormalised, gated shared expert) and, where the fixtures
/// are, the LFM2-MoE and Nemotron-H MoE configurations (sigmoid scores, a selection bias, a
/// scaling factor, squared-ReLU experts), with random weights.
fn moe_models() -> Vec<(String, String)> {
    let mut models = vec![("qwen-moe-like".to_string(), QWEN_MOE_LIKE.to_string())];
    if let Some(dir) = fixtures_dir() {
        for f in ["lfm2moe-public", "nemotronhmoe-public"] {
            let json = std::fs::read_to_string(dir.join(f).join("config.json"))
                .unwrap_or_else(|e| panic!("{f}: {e}"));
            models.push((f.to_string(), json));
        }
    }
    models
}

/// [`same_bits_with`] of options `off` and `on` (the option `what`) on every [`moe_models`]
/// configuration.
fn same_bits_on_moe_models(name: &str, what: &str, off: CudaOptions, on: CudaOptions) {
    for (model, json) in &moe_models() {
        if !same_bits_with(name, json, &[off, on]) {
            return;
        }
        println!("{model}: {what} on and off bit-identical");
    }
}

/// `CudaOptions::moe_route_in_up` (a small phase's MoE block routed and planned inside its up
/// launch, kernels/moe_small.cu `moe_up_routed*`) computes what `moe_route` + `moe_up` compute: decode
/// and verify steps of 1..5 rows after prefill chunks give the same logits and states bit for
/// bit, on the Qwen3.5-MoE-like model (softmax, renormalised, gated shared expert) and on the
/// LFM2-MoE and Nemotron-H MoE fixtures' configurations (sigmoid scores, a selection bias, a
/// scaling factor, squared-ReLU experts) with random weights.
#[test]
fn moe_routing_in_the_up_launch_computes_what_moe_route_computes() {
    let name = "moe_routing_in_the_up_launch_computes_what_moe_route_computes";
    let with = |moe_route_in_up| CudaOptions {
        moe_route_in_up,
        ..CudaOptions::default()
    };
    same_bits_on_moe_models(name, "moe_route_in_up", with(false), with(true));
}

/// `CudaOptions::qk_prep` (an attention layer's query / gate split, q and k norms, rotary
/// embeddings and cache write in one launch, kernels/norm_qk.cu) and `CudaOptions::attn_gate`
/// (its output gate in the small-phase attention's stores, kernels/attention_decode.cu), alone
/// and together, compute what the plan's separate launches compute: prefill chunks (the
/// tensor-core attention's buckets too), decode and verify steps give the same logits and
/// states bit for bit, in bf16 and f32, on the Qwen3.5-like model (gated attention, `1 + w`
/// norms, a partial rotation), on its MTP head, and on the LFM2 fixture's configuration (no
/// gate, plain norm weights).
#[test]
fn attention_fusions_compute_what_the_separate_launches_compute() {
    let name = "attention_fusions_compute_what_the_separate_launches_compute";
    let with = |qk_prep, attn_gate| CudaOptions {
        qk_prep,
        attn_gate,
        ..CudaOptions::default()
    };
    let options = [
        with(false, false),
        with(true, false),
        with(false, true),
        with(true, true),
    ];
    let mut models = vec![
        ("qwen-like".to_string(), QWEN_LIKE.to_string()),
        ("qwen-like + MTP".to_string(), qwen_like_mtp()),
        ("attention first".to_string(), qwen_like_attention_first()),
    ];
    if let Some(dir) = fixtures_dir() {
        let json = std::fs::read_to_string(dir.join("lfm2-public").join("config.json"))
            .unwrap_or_else(|e| panic!("lfm2-public: {e}"));
        models.push(("lfm2-public".to_string(), json));
    }
    for (model, json) in &models {
        for dtype in [DType::Bf16, DType::F32] {
            if !same_bits_in(
                name,
                json,
                dtype,
                &options,
                &[8, 32, 64],
                &[70, 2, 5, 1, 40, 3],
            ) {
                return;
            }
            println!(
                "{model} {}: qk_prep and attn_gate on and off bit-identical",
                dtype.name()
            );
        }
    }
}

/// `CudaOptions::gdn_prep` (the chunked Gated DeltaNet kernel's per-chunk phases that do not
/// depend on the state run for every chunk at once, kernels/gated_deltanet.cu `GDNC_PREP`, and
/// the serial loop copies their records, with one buffer or two) computes the same values in
/// another block: prefill chunks of 64..256 rows (several 64-row chunks a call, a partial last
/// one) and the decode and verify steps after them give the same logits and states bit for
/// bit with 0, 1 and 2, on the dense model and on the MoE model.
#[test]
fn gdn_chunk_records_compute_what_the_serial_loop_computes() {
    let name = "gdn_chunk_records_compute_what_the_serial_loop_computes";
    let with = |gdn_prep| CudaOptions {
        gdn_prep,
        ..CudaOptions::default()
    };
    for (model, json) in [("qwen-like", QWEN_LIKE), ("qwen-moe-like", QWEN_MOE_LIKE)] {
        if !same_bits_over(
            name,
            json,
            &[with(0), with(1), with(2)],
            &[8, 64, 256],
            &[300, 70, 3, 1, 130],
        ) {
            return;
        }
        println!("{model}: gdn_prep 0, 1 and 2 bit-identical");
    }
}

/// A step's last logits row left on the device with its host copy deferred
/// (`CudaOptions::defer_logits`, default) reads as the row read within the step, also when
/// another session of the model has stepped since (the next step waits for the copy); greedy
/// tokens taken on the device (`sample_argmax`) equal the host's argmax; and a capsule taken
/// after another session's step carries the session's own row.
#[test]
fn deferred_logits_read_as_eager_ones_on_gpu() {
    let name = "deferred_logits_read_as_eager_ones_on_gpu";
    let eager = CudaOptions {
        defer_logits: false,
        device_sampler: false,
        ..CudaOptions::default()
    };
    let deferred = CudaOptions {
        defer_logits: true,
        device_sampler: true,
        ..CudaOptions::default()
    };
    if !same_bits_with(name, QWEN_LIKE, &[eager, deferred]) {
        return;
    }
    let (Some(on), Some(off)) = (cuda_with(name, deferred), cuda_with(name, eager)) else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let (m_on, m_off) = (model_on(on, &ir, None), model_on(off, &ir, None));
    let vocab = m_on.vocab();
    let p = prompt(23, vocab, 91);
    let mut a = m_on.session().unwrap();
    let mut other = m_on.session().unwrap();
    let mut b = m_off.session().unwrap();
    a.append(&p).unwrap();
    b.append(&p).unwrap();
    other.append(&prompt(9, vocab, 92)).unwrap();
    for i in 0..12 {
        // Another session's step between a's step and the read of a's row.
        other.append(&[i as u32]).unwrap();
        assert!(
            a.last_logits() == b.last_logits(),
            "step {i}: a's row after another step"
        );
        let ta = a.decode_greedy(1).unwrap();
        let tb = b.decode_greedy(1).unwrap();
        assert_eq!(ta, tb, "step {i}: device argmax against the host's");
        other.append(&[i as u32 + 1]).unwrap();
        let (ca, cb) = (a.snapshot().unwrap(), b.snapshot().unwrap());
        assert!(
            ca.meta.last_logits.as_ref().map(|l| &l.0[..])
                == cb.meta.last_logits.as_ref().map(|l| &l.0[..]),
            "step {i}: the capsule's row"
        );
    }
    println!("deferred logits rows and device argmax equal eager reads over 12 steps");
}

/// `snapshot_to_host` (what a server stores when the device has no room for a capsule's copy)
/// reads the same bytes as a device snapshot, and restores on the GPU to the same continuation.
#[test]
fn host_snapshots_restore_like_device_ones_on_gpu() {
    let Some(gpu) = cuda("host_snapshots_restore_like_device_ones_on_gpu") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 256);
    let model = model_on(gpu, &ir, None);
    let vocab = model.vocab();
    let mut s = model.session().unwrap();
    s.append(&prompt(45, vocab, 71)).unwrap();
    let (dev, host) = (s.snapshot().unwrap(), s.snapshot_to_host().unwrap());
    for r in dev.regions() {
        assert!(
            host.region(r.name()).unwrap() == dev.region(r.name()).unwrap(),
            "region {}",
            r.name()
        );
    }
    let ids = s.decode_greedy(8).unwrap();
    let mut t = model.session().unwrap();
    t.append(&prompt(19, vocab, 72)).unwrap();
    t.restore(&host).unwrap();
    assert_eq!(
        t.decode_greedy(8).unwrap(),
        ids,
        "continuation after a host restore"
    );
    assert!(t.last_logits() == s.last_logits(), "logits after 8 steps");
    println!(
        "host snapshot: {} bytes, restored and continued as the device capsule",
        host.bytes()
    );
}

/// Runs the same appends (a 40-token prompt, then chunks of 2, 5, 3, 4 and single tokens: verify
/// passes and decode steps) on `json` under each of `options`, and asserts every logit and state
/// byte equal to the first's. False (skipped, said so) without a GPU.
fn same_bits_with(name: &str, json: &str, options: &[CudaOptions]) -> bool {
    same_bits_over(name, json, options, &[8, 32], &[40, 2, 5, 1, 3, 4, 1])
}

/// [`same_bits_with`] over prefill buckets `buckets` and appends of `chunks` tokens each.
fn same_bits_over(
    name: &str,
    json: &str,
    options: &[CudaOptions],
    buckets: &[usize],
    chunks: &[usize],
) -> bool {
    same_bits_in(name, json, DType::Bf16, options, buckets, chunks)
}

/// [`same_bits_over`] with the model's dtype `dtype`.
fn same_bits_in(
    name: &str,
    json: &str,
    dtype: DType,
    options: &[CudaOptions],
    buckets: &[usize],
    chunks: &[usize],
) -> bool {
    let mut gpus = Vec::new();
    for o in options {
        match cuda_with(name, *o) {
            Some(g) => gpus.push(g),
            None => return false,
        }
    }
    let max_seq = chunks.iter().sum::<usize>().next_multiple_of(256);
    let ir = ir_of(json, dtype, buckets, max_seq);
    let models: Vec<Model> = gpus.into_iter().map(|g| model_on(g, &ir, None)).collect();
    let vocab = models[0].vocab();
    for m in &models {
        verify_first(m);
    }
    let mut s: Vec<Session> = models.iter().map(|m| m.session().unwrap()).collect();
    let chunks: Vec<Vec<u32>> = chunks
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, vocab, 61 + i as u64))
        .collect();
    for (i, c) in chunks.iter().enumerate() {
        for x in s.iter_mut() {
            x.append(c).unwrap();
        }
        for (k, x) in s.iter().enumerate().skip(1) {
            assert!(
                s[0].logits() == x.logits(),
                "chunk {i} ({} rows): logits differ under options {k}",
                c.len()
            );
        }
    }
    let first = state_of(&s[0]);
    for (k, x) in s.iter().enumerate().skip(1) {
        for ((name, a), (_, b)) in first.iter().zip(state_of(x)) {
            assert!(*a == b, "state `{name}` differs under options {k}");
        }
    }
    true
}

/// Every state region of `s`, by name.
fn state_of(s: &Session) -> Vec<(String, Vec<u8>)> {
    s.model()
        .compiled()
        .layout
        .state_buffers()
        .map(|b| (b.name.clone(), s.read_region(&b.name).unwrap()))
        .collect()
}

/// Batched decode (`Model::step_batch`, one round through `Model::profile_step_batch`): each
/// row of a batched step is bit-identical to its session's own decode step — logits and every state byte — for sessions at different
/// positions, sessions joining and leaving between steps (2..=8 rows, so the 2-, 4- and 8-row
/// programs run with and without padding rows), forks of one capsule stepped in one batch, and
/// a capsule taken from a batched session restored into another session and continued one by
/// one (and the other way round). On a model with an MTP head (its hidden-state store is a
/// batched op too) and, through the one-by-one fallback, on a model the batched kernels do not
/// cover (f32 target).
#[test]
fn batched_decode_rows_equal_single_steps_on_gpu() {
    let Some(gpu) = cuda("batched_decode_rows_equal_single_steps_on_gpu") else {
        return;
    };
    let mtp = qwen_like_mtp();
    // And with small phases' 16-bit matmuls on the tensor cores (`gemv16m`, opt-in).
    let mma: Arc<dyn Backend> = cuda_gemv16m("batched decode").expect("a CUDA device");
    // And in the CUDA-core kernel's blocks (`gemv16s`, opt-in).
    let smem: Arc<dyn Backend> = cuda_gemv16s("batched decode").expect("a CUDA device");
    // And with the attention's output gate in its stores too (`attn_gate`, opt-in; `qk_prep`,
    // the default, named).
    let prep: Arc<dyn Backend> = cuda_with(
        "batched decode (qk_prep, attn_gate)",
        CudaOptions {
            qk_prep: true,
            attn_gate: true,
            ..CudaOptions::default()
        },
    )
    .expect("a CUDA device");
    // And with attention decode's one block per (head, split, row) instead of the rows one
    // after another in each (head, split) block (`attn_rows`, the default).
    let per_row: Arc<dyn Backend> = cuda_with(
        "batched decode (a block per row)",
        CudaOptions {
            attn_rows: false,
            ..CudaOptions::default()
        },
    )
    .expect("a CUDA device");
    // A first layer of attention: its key cache starts the state arena, so a batched step
    // addresses it at offset 0 of each row's arena.
    let attn_first = qwen_like_attention_first();
    let gpu: Arc<dyn Backend> = gpu;
    // (what, config, dtype, batched on the device, backend)
    type Case<'a> = (&'a str, &'a str, DType, bool, &'a Arc<dyn Backend>);
    let cases: [Case; 9] = [
        ("qwen-like bf16", QWEN_LIKE, DType::Bf16, true, &gpu),
        ("qwen-like + MTP bf16", &mtp, DType::Bf16, true, &gpu),
        (
            "qwen-like + MTP bf16, a block per row",
            &mtp,
            DType::Bf16,
            true,
            &per_row,
        ),
        (
            "qwen-like f32 (one by one)",
            QWEN_LIKE,
            DType::F32,
            false,
            &gpu,
        ),
        (
            "qwen-like bf16, gemv16m",
            QWEN_LIKE,
            DType::Bf16,
            true,
            &mma,
        ),
        (
            "qwen-like + MTP bf16, gemv16s",
            &mtp,
            DType::Bf16,
            true,
            &smem,
        ),
        ("qwen-moe-like bf16", QWEN_MOE_LIKE, DType::Bf16, true, &gpu),
        (
            "qwen-like + MTP bf16, qk_prep + attn_gate",
            &mtp,
            DType::Bf16,
            true,
            &prep,
        ),
        (
            "attention first bf16, qk_prep + attn_gate",
            &attn_first,
            DType::Bf16,
            true,
            &prep,
        ),
    ];
    for (what, json, dtype, batched, backend) in cases {
        let ir = ir_of(json, dtype, &[8, 32], 512);
        let model = model_on(backend.clone(), &ir, None);
        assert_eq!(
            model.batch_unsupported().is_none(),
            batched,
            "{what}: batch support {:?}",
            model.batch_unsupported()
        );
        let vocab = model.vocab();
        // Eight sessions at different positions (prompt lengths 3..=73, a fork pair among them).
        let mut batch: Vec<Session> = Vec::new();
        let mut alone: Vec<Session> = Vec::new();
        for i in 0..7u64 {
            let p = prompt(3 + 10 * i as usize, vocab, 100 + i);
            let mut s = model.session().unwrap();
            s.append(&p).unwrap();
            let cap = s.snapshot().unwrap();
            alone.push(model.fork(&cap).unwrap());
            batch.push(s);
        }
        let cap = batch[2].snapshot().unwrap();
        batch.push(model.fork(&cap).unwrap());
        alone.push(model.fork(&cap).unwrap());
        // Rounds over changing subsets: who steps in round k.
        let rounds: [&[usize]; 7] = [
            &[0, 1, 2, 3, 4, 5, 6, 7],
            &[0, 2],
            &[1, 3, 5],
            &[2, 7, 4, 6, 0],
            &[7, 2],
            &[0, 1, 2, 3, 4, 5, 6],
            &[3, 1, 0, 2, 4, 5, 6, 7],
        ];
        for (k, who) in rounds.iter().enumerate() {
            let toks: Vec<u32> = who
                .iter()
                .map(|&i| argmax(batch[i].last_logits()).unwrap())
                .collect();
            // Rows in `who`'s order (distinct indices).
            let mut slots: Vec<Option<&mut Session>> = batch.iter_mut().map(Some).collect();
            let mut refs: Vec<&mut Session> =
                who.iter().map(|&i| slots[i].take().unwrap()).collect();
            if k == 3 {
                // One round timed per command (`flashrt bench --batch --profile`): plain
                // launches of the program the graph replays, the same rows bit for bit.
                match model.profile_step_batch(&mut refs, &toks) {
                    Ok(times) => {
                        assert!(batched, "{what}: a one-by-one model timed a batched step");
                        assert!(
                            !times.is_empty() && times.iter().all(|(_, ms)| *ms >= 0.0),
                            "{what}: {} timed commands",
                            times.len()
                        );
                    }
                    Err(e) => {
                        assert!(!batched, "{what}: profiling a batched step failed: {e}");
                        model.step_batch(&mut refs, &toks).unwrap();
                    }
                }
            } else {
                model.step_batch(&mut refs, &toks).unwrap();
            }
            drop(refs);
            for (&i, &t) in who.iter().zip(&toks) {
                alone[i].append(&[t]).unwrap();
                assert!(
                    batch[i].last_logits() == alone[i].last_logits(),
                    "{what}: round {k}, session {i}: batched logits differ from its own step"
                );
                assert_eq!(batch[i].pos(), alone[i].pos());
            }
        }
        for i in 0..batch.len() {
            assert!(
                state_of(&batch[i]) == state_of(&alone[i]),
                "{what}: session {i}: state after batched steps differs"
            );
            assert_eq!(batch[i].counters(), alone[i].counters());
        }
        // Capsules cross: batched -> one by one, one by one -> batched.
        let from_batch = batch[5].snapshot().unwrap();
        let mut a = model.fork(&from_batch).unwrap();
        let mut b = model.fork(&alone[5].snapshot().unwrap()).unwrap();
        let t0 = argmax(a.last_logits()).unwrap();
        a.append(&[t0]).unwrap();
        let other = &mut batch[1];
        let t1 = argmax(other.last_logits()).unwrap();
        model.step_batch(&mut [&mut b, other], &[t0, t1]).unwrap();
        assert!(
            a.last_logits() == b.last_logits() && state_of(&a) == state_of(&b),
            "{what}: a capsule moved between batched and single stepping diverged"
        );
        println!(
            "{what}: {} rounds of batched steps == single steps (logits, state, counters), \
             capsules cross both ways",
            rounds.len()
        );
    }
}

/// The capsule store on the GPU: capsules demoted to the host land in the buffers of host
/// copies that left memory (host_pool.rs, `CudaSaved::region_bytes_into`), on the store's
/// thread and in the background, and restore byte for byte.
#[test]
fn store_demotions_into_reused_host_buffers_restore_exactly_on_gpu() {
    use flashrt_runtime::{CapsuleStore, StoreConfig};
    let Some(gpu) = cuda("store_demotions_into_reused_host_buffers_restore_exactly_on_gpu") else {
        return;
    };
    let ir = ir_of(QWEN_LIKE, DType::Bf16, &[8, 32], 16384);
    let model = model_on(gpu, &ir, None);
    let layout = &model.compiled().layout;
    // Long enough for KV regions past the pool's 1 MiB minimum; the host tier holds one
    // capsule, its pool (half the budget) the large regions of one.
    let (pos, one, big, host) = pool::pool_sized(layout);
    assert!(pos < 16384, "position {pos}");
    // A capsule of random state bytes (no prefill: nothing computes on them), as the GPU saves it.
    let capsule = |seed: u64| {
        let mut x = seed | 1;
        let regions = layout
            .state_buffers()
            .map(|b| {
                let v: Vec<u8> = (0..b.used_bytes(pos))
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x >> 32) as u8
                    })
                    .collect();
                (b.id, v)
            })
            .collect();
        let saved = HostSaved::new(layout, pos, regions).unwrap();
        let mut meta = model.session().unwrap().snapshot().unwrap().meta.clone();
        meta.pos = pos;
        meta.tokens = prompt(pos, model.vocab(), seed);
        meta.last_logits = None;
        let host = Capsule::from_parts(meta, Arc::new(saved), model.compiled().clone()).unwrap();
        let mut s = model.session().unwrap();
        s.restore(&host).unwrap();
        let dev = s.snapshot().unwrap();
        assert!(dev.saved().as_any().is::<CudaSaved>());
        let state: Vec<Vec<u8>> = layout
            .state_buffers()
            .map(|b| s.read_region(b.id).unwrap())
            .collect();
        (dev, state)
    };
    for background in [false, true] {
        let cfg = StoreConfig {
            budget_device: 0,
            budget_host: host,
            budget_disk: 0,
            background,
            share_kv: false,
            ..StoreConfig::default()
        };
        let mut store = CapsuleStore::open(model.clone(), cfg).unwrap();
        let mut last = None;
        for seed in 1..=4 {
            let (cap, state) = capsule(seed);
            let id = store.insert(cap, None).unwrap();
            store.settle().unwrap();
            last = Some((id, state));
        }
        let st = store.stats();
        assert_eq!((st.capsules[1], st.dropped), (1, 3), "{st:?}");
        assert_eq!(
            (st.pool_reused_bytes, st.pooled_bytes),
            (2 * big, big),
            "{st:?}"
        );
        let (id, want) = last.unwrap();
        let mut t = model.session().unwrap();
        store.restore_into(&id, &mut t).unwrap();
        let got: Vec<Vec<u8>> = layout
            .state_buffers()
            .map(|b| t.read_region(b.id).unwrap())
            .collect();
        assert!(got == want, "background: {background}");
    }
    println!("store demotions into reused host buffers: {big} of {one} bytes a capsule pooled");
}
