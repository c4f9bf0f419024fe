//! FP8 weights on the GPU, whole models: the FP8 fixtures in f32 against transformers, in
//! bf16 (codes + block scales) against the f32 CPU reference on the same FP8 weights, the
//! device's quantizer against the fixtures' FP8 checkpoint (a bf16 checkpoint quantized while
//! it loads gives bit-identical logits), and a random-weight model at realistic sizes whose
//! prefill runs on the FP8 tensor cores. Skips with a message when no CUDA device is present.
#![cfg(feature = "cuda")]

mod common;
mod cuda_support;

use cuda_support::*;
use flashrt_runtime::backend::Backend;
use flashrt_runtime::backend::HostWeights;
use flashrt_runtime::backend::cuda::CudaOptions;
use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::ir::{DType, QuantFormat, QuantIr, Role, Target, compile};
use flashrt_runtime::safetensors::SafeTensors;
use flashrt_runtime::{
    Model, ReferenceOptions, WeightSource, argmax, check_reference_with, load_hf_weights,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const FP8_FIXTURES: [&str; 2] = ["qwen35fp8-public", "qwen35moefp8-public"];

fn fixture(name: &str) -> Option<PathBuf> {
    fixtures_dir().map(|d| d.join(name))
}

#[test]
fn fp8_fixtures_f32_on_gpu_match_transformers() {
    let Some(gpu) = cuda("fp8_fixtures_f32_on_gpu_match_transformers") else {
        return;
    };
    for name in FP8_FIXTURES {
        let Some(dir) = fixture(name) else { return };
        let opts = ReferenceOptions {
            dtype: Some(DType::F32),
            ..Default::default()
        };
        let r = check_reference_with(&dir, gpu.clone(), &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{r}");
        assert!(r.passed(), "{name} (f32 on the GPU): {:#?}", r.failures());
    }
}

/// [`QWEN_LIKE`] quantized to FP8 as `--quantize fp8` does (128 x 128 blocks, the released
/// checkpoints' exclusions kept in bf16), 512 positions, prefill buckets 8 and 64.
fn random_fp8_ir() -> flashrt_runtime::ir::ModelIr {
    let o = HfOptions {
        name: Some("fp8_test".into()),
        max_seq: Some(512),
        prefill_buckets: Some(vec![8, 64]),
        quantize: Some(QuantIr::with_defaults(QuantFormat::Fp8E4m3, [128, 128])),
        ..HfOptions::default()
    };
    ir_from_hf_config(QWEN_LIKE, &o).unwrap()
}

fn opts(buckets: &[usize]) -> HfOptions {
    HfOptions {
        max_seq: Some(256),
        prefill_buckets: Some(buckets.to_vec()),
        ..HfOptions::default()
    }
}

/// (prompt logits rel err, worst teacher-forced decode rel err, greedy agreement of 12,
/// reference greedy ids matched of 24) of a bf16 GPU model against the f32 CPU one.
fn gpu_vs_cpu(
    name: &str,
    gpu: &Model,
    cpu: &Model,
    reference: Option<&[u32]>,
    prompt: &[u32],
) -> (f64, f64, usize, usize) {
    let mut cs = cpu.session().unwrap();
    let mut gs = gpu.session().unwrap();
    cs.append(prompt).unwrap();
    gs.append(prompt).unwrap();
    let e = rel_err(gs.logits(), cs.logits());
    let mut tokens = Vec::new();
    let mut cpu_rows = Vec::new();
    for _ in 0..12 {
        let t = argmax(cs.last_logits()).unwrap();
        cs.append(&[t]).unwrap();
        tokens.push(t);
        cpu_rows.push(cs.last_logits().to_vec());
    }
    let mut agree = (argmax(gs.last_logits()) == Some(tokens[0])) as usize;
    let mut worst = 0f64;
    for (i, &t) in tokens.iter().enumerate() {
        gs.append(&[t]).unwrap();
        worst = worst.max(rel_err(gs.last_logits(), &cpu_rows[i]));
        if i + 1 < tokens.len() && argmax(gs.last_logits()) == Some(tokens[i + 1]) {
            agree += 1;
        }
    }
    // The GPU's own greedy continuation against the reference's ids.
    let mut matched = 0;
    if let Some(want) = reference {
        let mut s = gpu.session().unwrap();
        s.append(prompt).unwrap();
        for &w in want {
            let t = argmax(s.last_logits()).unwrap();
            if t != w {
                break;
            }
            matched += 1;
            s.append(&[t]).unwrap();
        }
    }
    println!(
        "{name}: prompt logits rel err {e:.3e}, 12 teacher-forced steps worst {worst:.3e}, \
         greedy agreement {agree}/12, reference greedy ids matched {matched}/{}",
        reference.map_or(0, |r| r.len())
    );
    (e, worst, agree, matched)
}

fn reference_ids(dir: &Path, name: &str) -> Vec<u32> {
    let r = SafeTensors::read(&dir.join("reference.safetensors")).unwrap();
    r.i64(name).unwrap().into_iter().map(|v| v as u32).collect()
}

/// The same model without quantization, its weights the FP8 model's exact values rounded to
/// bf16, on `backend` (both backends get the same rounded values): what this model drifts by
/// when it simply runs in bf16.
fn plain_bf16_twin(fp8: &Model, dir: &Path, backend: Arc<dyn Backend>) -> Model {
    let q = compile(fp8.ir(), Target { dtype: DType::F32 });
    let values = load_hf_weights(&q, dir).unwrap();
    let mut ir = fp8.ir().clone();
    ir.quant = None;
    let plain = Arc::new(compile(&ir, backend.target(&ir)));
    let tensors = plain
        .layout
        .buffers
        .iter()
        .map(|b| {
            (b.role == Role::Weight).then(|| {
                let id = q.layout.id(&b.name).expect("same weights");
                values.tensors[id.index()].clone().expect("a value")
            })
        })
        .collect();
    Model::from_compiled(backend, plain, round_weights(HostWeights { tensors })).unwrap()
}

/// The FP8 fixtures with their FP8 weights on a bf16 GPU (gemv8 in decode and 5-row chunks,
/// the dequantized bf16 copy in 32-row prefill chunks: the fixtures' 32 x 32 blocks) against
/// the f32 CPU reference on the same weights. The bound is measured: the same model run in
/// plain bf16 (its weights the FP8 values rounded to bf16) against the CPU on those weights,
/// the methodology of the bf16 fixtures, whose bounds are transformers' own bf16 drift (9 %
/// for qwen35, 35 % for qwen35moe); FP8 must stay within 1.25x the larger of the two.
///
/// The MoE fixture's teacher-forced decode steps are not bounded: its README measures 3-5 of
/// ~150 routing decisions flipping in transformers' own bf16 run, and one flipped expert moves
/// a whole row. On the H200 (2026-12-02) its decode rows drifted by 1.19 (FP8 as stored),
/// 0.09 (shared expert kept in bf16), 0.56 (only the shared expert in FP8), 0.55 (only the
/// routed experts quantized, held in bf16) and 0.15 (plain bf16): the size follows which
/// routing decisions flip, not the format, while `cuda_ops::fp8_shared_expert` holds the
/// same ops to the bf16 tolerance. Its prompt logits and greedy agreement are bounded.
#[test]
fn fp8_fixtures_bf16_on_gpu_track_cpu() {
    let Some(gpu) = cuda("fp8_fixtures_bf16_on_gpu_track_cpu") else {
        return;
    };
    for (name, bound, agreement) in [(FP8_FIXTURES[0], 9e-2, 10), (FP8_FIXTURES[1], 0.35, 8)] {
        let Some(dir) = fixture(name) else { return };
        let cpu_m = Model::load_hf_dir(cpu(), &dir, &opts(&[8, 32])).unwrap();
        let gpu_m = Model::load_hf_dir(gpu.clone(), &dir, &opts(&[8, 32])).unwrap();
        let prompt0 = reference_ids(&dir, "prompt_ids");
        let twin_gpu = plain_bf16_twin(&cpu_m, &dir, gpu.clone());
        let twin_cpu = plain_bf16_twin(&cpu_m, &dir, cpu());
        let (te, tworst, ..) = gpu_vs_cpu(
            &format!("{name} as plain bf16"),
            &twin_gpu,
            &twin_cpu,
            None,
            &prompt0,
        );
        let moe = name.contains("moe");
        let bound = 1.25 * f64::max(bound, if moe { te } else { te.max(tworst) });
        assert!(
            gpu_m
                .compiled()
                .layout
                .buffers
                .iter()
                .any(|b| b.dtype == DType::F8E4m3),
            "{name}: the GPU model holds no FP8 weights"
        );
        let prompt = reference_ids(&dir, "prompt_ids");
        let greedy = reference_ids(&dir, "greedy_ids");
        let (e, worst, agree, _) = gpu_vs_cpu(name, &gpu_m, &cpu_m, Some(&greedy), &prompt);
        // The same without the small-phase kernels (gemv8, the fused MoE launches).
        if let Some(g) = cuda_with(
            "fp8_fixtures_bf16_on_gpu_track_cpu (no gemv)",
            CudaOptions {
                gemv: false,
                ..CudaOptions::default()
            },
        ) {
            let m = Model::load_hf_dir(g, &dir, &opts(&[8, 32])).unwrap();
            gpu_vs_cpu(
                &format!("{name} without gemv"),
                &m,
                &cpu_m,
                Some(&greedy),
                &prompt,
            );
        }
        assert!(e <= bound, "{name}: prompt logits {e:.3e} > {bound}");
        assert!(
            moe || worst <= bound,
            "{name}: decode {worst:.3e} > {bound}"
        );
        assert!(agree >= agreement, "{name}: greedy agreement {agree}/12");
    }
}

/// The device's quantizer reproduces the fixtures' FP8 bytes: a bf16 checkpoint quantized
/// while it loads gives the model the FP8 checkpoint gives, logit for logit, on f32 (values
/// dequantized in place) and bf16 (codes in the FP8 buffers) targets.
#[test]
fn gpu_quantizer_equals_the_fp8_checkpoint() {
    let Some(gpu) = cuda("gpu_quantizer_equals_the_fp8_checkpoint") else {
        return;
    };
    for name in FP8_FIXTURES {
        let Some(fp8) = fixture(name) else { return };
        let bf16 = common::unquantized_copy(name);
        for dtype in [DType::F32, DType::Bf16] {
            let o = HfOptions {
                dtype: Some(dtype),
                ..opts(&[8, 32])
            };
            let a = Model::load_hf_dir(gpu.clone(), &fp8, &o).unwrap();
            let b = Model::load_hf_dir(gpu.clone(), &bf16, &o).unwrap();
            let p = reference_ids(&fp8, "prompt_ids");
            let (mut sa, mut sb) = (a.session().unwrap(), b.session().unwrap());
            sa.append(&p).unwrap();
            sb.append(&p).unwrap();
            assert_eq!(sa.logits(), sb.logits(), "{name} [{}]", dtype.name());
            sa.append(&[5]).unwrap();
            sb.append(&[5]).unwrap();
            assert_eq!(
                sa.last_logits(),
                sb.last_logits(),
                "{name} [{}] decode",
                dtype.name()
            );
        }
    }
}

/// A Qwen3.5-style hybrid at realistic head sizes, its projections in FP8 with 128 x 128
/// blocks and random weights (quantized identically by both backends): prefill chunks of 64
/// rows run W8A8 on the FP8 tensor cores, decode steps W8A16 in gemv8. Against the f32 CPU on
/// the same FP8 weights. `fp8_gemm: false` (prefill through the dequantized copy) is held to
/// the bf16 models' bound (measured 3.7e-2). W8A8 adds the activations' E4M3 rounding at
/// every matmul input (bounded per op in cuda_ops.rs `W8A8_TOL`, where it stays within half
/// of it); through four layers of random weights, which amplify like the fixtures do, it
/// measured 0.29 on the H200 (2026-12-02) with 10 of 12 greedy decisions kept: 0.4.
#[test]
fn random_fp8_model_tracks_cpu() {
    let Some(gpu) = cuda("random_fp8_model_tracks_cpu") else {
        return;
    };
    let ir = random_fp8_ir();
    let cpu_m = Model::from_ir(cpu(), &ir, WeightSource::Random(3)).unwrap();
    let mut prompt_rng = Rng::new(17);
    let prompt: Vec<u32> = (0..128).map(|_| prompt_rng.below(1000)).collect();
    let mut results = Vec::new();
    let gpu_m = Model::from_ir(
        gpu.clone() as Arc<dyn Backend>,
        &ir,
        WeightSource::Random(3),
    )
    .unwrap();
    results.push((
        "w8a8",
        gpu_vs_cpu("random fp8 (W8A8 prefill)", &gpu_m, &cpu_m, None, &prompt),
        0.4,
    ));
    if let Some(g) = cuda_with(
        "random_fp8_model_tracks_cpu (dequantized prefill)",
        CudaOptions {
            fp8_gemm: false,
            ..CudaOptions::default()
        },
    ) {
        let m = Model::from_ir(g as Arc<dyn Backend>, &ir, WeightSource::Random(3)).unwrap();
        results.push((
            "dequant",
            gpu_vs_cpu(
                "random fp8 (dequantized prefill)",
                &m,
                &cpu_m,
                None,
                &prompt,
            ),
            5e-2,
        ));
    }
    for (what, (e, worst, agree, _), bound) in results {
        assert!(
            e <= bound,
            "{what}: prompt logits rel err {e:.3e} > {bound}"
        );
        // Decode steps are W8A16 on both models.
        assert!(worst <= 0.25, "{what}: decode rel err {worst:.3e}");
        assert!(agree >= 8, "{what}: greedy agreement {agree}/12");
    }
}

/// `CudaOptions::gemv_side` (at one row, an FP8 layer's bf16 Gated DeltaNet in_proj_b / _a as a
/// side launch beside the FP8 in_proj_qkv / _z launch, normalising the residual row itself and
/// waiting for its predecessor at its end) computes what the launch after it computes: on a
/// random FP8 model (the released checkpoints' exclusions: in_proj_a / _b and the LM head in
/// bf16), a prompt prefilled in chunks, then decode steps and verify passes give the same
/// logits and states bit for bit with the option off and on.
#[test]
fn fp8_side_launch_computes_what_the_serial_launch_computes() {
    let name = "fp8_side_launch_computes_what_the_serial_launch_computes";
    let with = |gemv_side| CudaOptions {
        gemv_side,
        ..CudaOptions::default()
    };
    let (Some(off), Some(on)) = (cuda_with(name, with(false)), cuda_with(name, with(true))) else {
        return;
    };
    let ir = random_fp8_ir();
    let kept = ir
        .quant
        .as_ref()
        .map(|q| q.exclude.clone())
        .unwrap_or_default();
    assert!(
        kept.iter().any(|e| e.contains("in_proj_b")),
        "in_proj_b stays bf16 (the side launch's case): {kept:?}"
    );
    let models: Vec<Model> = [off, on]
        .into_iter()
        .map(|g| Model::from_ir(g as Arc<dyn Backend>, &ir, WeightSource::Random(3)).unwrap())
        .collect();
    let mut s: Vec<_> = models.iter().map(|m| m.session().unwrap()).collect();
    let mut rng = Rng::new(23);
    for (i, n) in [40usize, 1, 2, 1, 5, 1, 3, 1, 1].into_iter().enumerate() {
        let chunk: Vec<u32> = (0..n).map(|_| rng.below(1000)).collect();
        for x in s.iter_mut() {
            x.append(&chunk).unwrap();
        }
        assert!(
            s[0].logits() == s[1].logits(),
            "chunk {i} ({n} rows): logits differ with the side launch"
        );
    }
    for b in models[0].compiled().layout.state_buffers() {
        assert!(
            s[0].read_region(&b.name).unwrap() == s[1].read_region(&b.name).unwrap(),
            "state `{}` differs with the side launch",
            b.name
        );
    }
    println!("gemv_side off and on: decode steps and verify passes bit-identical (FP8)");
}
