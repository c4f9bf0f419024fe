//! Block-scaled FP8 weights on the CPU reference: the FP8 fixtures against transformers, the
//! quantizer against the fixtures' own bytes, quantizing while loading against loading the
//! FP8 checkpoint, and the errors for checkpoints that do not fit the model.

mod common;

use common::*;
use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::ir::{BufferId, WeightQuant};
use flashrt_runtime::quant::{e4m3_to_f32, quantize};
use flashrt_runtime::safetensors::{Dtype, SafeTensors};
use flashrt_runtime::{Model, check_reference};

const FP8_FIXTURES: [&str; 2] = ["qwen35fp8-public", "qwen35moefp8-public"];

#[test]
fn fp8_fixtures_match_transformers() {
    for name in FP8_FIXTURES {
        let r = check_reference(&fixture(name), cpu()).unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{r}");
        assert_eq!(r.tolerance, 1e-3, "{name}");
        for check in [
            "prompt_logits",
            "greedy_ids",
            "greedy_logits",
            "fork_s1_logits",
            "fork_s1_greedy_ids",
            "fork_s2_logits",
            "fork_s2_greedy_ids",
        ] {
            assert!(r.check(check).is_some(), "{name}: no {check}");
        }
        assert_eq!(
            r.checks
                .iter()
                .filter(|c| c.name.starts_with("state "))
                .count(),
            8,
            "{name}"
        );
        assert!(r.passed(), "{name}: {:#?}", r.failures());
    }
}

fn block_of(dir: &std::path::Path) -> [usize; 2] {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let b = &cfg["quantization_config"]["weight_block_size"];
    [
        b[0].as_u64().unwrap() as usize,
        b[1].as_u64().unwrap() as usize,
    ]
}

/// The bf16 -> FP8 rule reproduces, byte for byte, every code and scale the fixtures' writer
/// stored (ragged edge blocks and the all-zero block included).
#[test]
fn quantizer_reproduces_the_fixture_bytes() {
    for (name, expect) in [(FP8_FIXTURES[0], 25), (FP8_FIXTURES[1], 121)] {
        let dir = fixture(name);
        let block = block_of(&dir);
        let src = SafeTensors::read(&dir.join("fp8_source_weights.safetensors")).unwrap();
        let ckpt = SafeTensors::read(&dir.join("model.safetensors")).unwrap();
        let mut checked = 0;
        let mut zero_blocks = 0;
        for (tname, info) in &src.tensors {
            assert_eq!(info.dtype, Dtype::Bf16, "{name}: {tname}");
            let (rows, cols) = (info.shape[0], info.shape[1]);
            let values = src.f32(tname).unwrap();
            let q = WeightQuant {
                scale: BufferId(0),
                block,
                segment: rows,
                cols,
            };
            let mut codes = vec![0u8; rows * cols];
            let mut scales = vec![0f32; q.block_rows() * q.block_cols()];
            quantize(&values, &q, &mut codes, &mut scales);
            let stored = ckpt.tensors.get(tname).expect("stored weight");
            assert_eq!(stored.dtype, Dtype::F8E4m3, "{name}: {tname}");
            assert_eq!(
                ckpt.data(tname).unwrap(),
                &codes[..],
                "{name}: codes of {tname}"
            );
            let sname = format!("{}_scale_inv", tname);
            let stored_scales = ckpt.f32(&sname).unwrap();
            assert_eq!(stored_scales, scales, "{name}: {sname}");
            zero_blocks += scales.iter().filter(|&&s| s == 1.0).count();
            // Dequantized values stay within half an E4M3 step (3 mantissa bits) of the source.
            for (i, (&v, &c)) in values.iter().zip(&codes).enumerate() {
                let s = scales[q.scale_index(i / cols, i % cols)];
                let d = e4m3_to_f32(c) * s;
                assert!(
                    (d - v).abs() <= v.abs() / 16.0 + s / 1024.0,
                    "{name}: {tname}[{i}] {v} -> {d}"
                );
            }
            checked += 1;
        }
        assert_eq!(checked, expect, "{name}: FP8 weights checked");
        if name == FP8_FIXTURES[1] {
            assert!(zero_blocks >= 1, "the all-zero block was not met");
        }
    }
}

fn prompt_logits(model: &Model, prompt: &[u32]) -> Vec<f32> {
    let mut s = model.session().unwrap();
    s.append(prompt).unwrap();
    s.logits().to_vec()
}

/// Quantizing a bf16 checkpoint while it loads gives the model the FP8 checkpoint gives:
/// the same logits, bit for bit.
#[test]
fn quantizing_while_loading_equals_the_fp8_checkpoint() {
    let opts = HfOptions {
        max_seq: Some(128),
        prefill_buckets: Some(vec![8, 64]),
        ..HfOptions::default()
    };
    for name in FP8_FIXTURES {
        let fp8 = Model::load_hf_dir(cpu(), &fixture(name), &opts).unwrap();
        let dir = unquantized_copy(name);
        let bf16 = Model::load_hf_dir(cpu(), &dir, &opts).unwrap();
        let prompt = tokens(7, 21, 512);
        let a = prompt_logits(&fp8, &prompt);
        let b = prompt_logits(&bf16, &prompt);
        assert_eq!(a, b, "{name}");
        // And it still passes the reference.
        let r = check_reference(&dir, cpu()).unwrap();
        assert!(r.passed(), "{name} quantized while loading:\n{r}");
    }
}

#[test]
fn fp8_checkpoint_without_its_quantization_config_is_refused() {
    let dir = copy_fixture(FP8_FIXTURES[0]);
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let e = check_reference(&dir, cpu()).unwrap_err().to_string();
    assert!(e.contains("unsupported dtypes (25)"), "{e}");
    assert!(
        e.contains("F8_E4M3, but the model does not quantize"),
        "{e}"
    );
    // The scales have nowhere to go either.
    assert!(e.contains("unexpected tensors (25)"), "{e}");
}

#[test]
fn fp8_checkpoint_missing_a_scale_is_one_clear_error() {
    let dir = copy_fixture(FP8_FIXTURES[0]);
    let path = dir.join("model.safetensors");
    let mut entries = read_entries(&path);
    entries.retain(|e| e.0 != "model.layers.3.mlp.up_proj.weight_scale_inv");
    write_entries(&path, &entries);
    let e = check_reference(&dir, cpu()).unwrap_err().to_string();
    assert!(e.contains("missing tensors (1)"), "{e}");
    assert!(
        e.contains("model.layers.3.mlp.up_proj.weight_scale_inv"),
        "{e}"
    );
}

/// `--quantize fp8` on a float checkpoint (128 x 128 blocks, the fixture's small matrices each
/// one ragged block): the model equals, logit for logit, the unquantized model whose weights
/// are the reference rule's values computed here from the checkpoint's floats.
#[test]
fn quantize_option_applies_to_float_checkpoints() {
    use flashrt_runtime::backend::HostWeights;
    use flashrt_runtime::ir::{QuantFormat, QuantIr, Role, Target, compile};
    use flashrt_runtime::quant::{apply_scales, e4m3_to_f32};
    let dir = fixture("qwen35-public");
    let opts = HfOptions {
        max_seq: Some(128),
        prefill_buckets: Some(vec![4, 16]),
        quantize: Some(QuantIr::with_defaults(QuantFormat::Fp8E4m3, [128, 128])),
        ..HfOptions::default()
    };
    let q = Model::load_hf_dir(cpu(), &dir, &opts).unwrap();
    let cq = compile(
        q.ir(),
        Target {
            dtype: flashrt_runtime::ir::DType::F32,
        },
    );
    let quantized: Vec<_> = cq
        .layout
        .buffers
        .iter()
        .filter(|b| b.quant.is_some())
        .collect();
    // As in the FP8 fixture: 3 x 3 Gated DeltaNet + 4 attention + 4 x 3 MLP projections.
    assert_eq!(
        quantized.len(),
        25,
        "every projection but lm_head and a / b"
    );
    let mut host = flashrt_runtime::load_hf_weights(&cq, &dir).unwrap();
    for b in &quantized {
        let wq = b.quant.unwrap();
        let v = host.tensors[b.id.index()].as_mut().unwrap();
        let mut codes = vec![0u8; v.len()];
        let mut scales = vec![0f32; cq.layout.buffer(wq.scale).numel()];
        quantize(v, &wq, &mut codes, &mut scales);
        for (x, c) in v.iter_mut().zip(&codes) {
            *x = e4m3_to_f32(*c);
        }
        apply_scales(v, &wq, &scales);
    }
    let mut ir = q.ir().clone();
    ir.quant = None;
    let plain = std::sync::Arc::new(compile(
        &ir,
        Target {
            dtype: flashrt_runtime::ir::DType::F32,
        },
    ));
    let tensors = plain
        .layout
        .buffers
        .iter()
        .map(|b| {
            (b.role == Role::Weight).then(|| {
                host.tensors[cq.layout.id(&b.name).unwrap().index()]
                    .clone()
                    .unwrap()
            })
        })
        .collect();
    let twin = Model::from_compiled(cpu(), plain, HostWeights { tensors }).unwrap();
    let p = tokens(5, 19, 512);
    assert_eq!(prompt_logits(&q, &p), prompt_logits(&twin, &p));
}
