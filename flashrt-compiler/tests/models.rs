//! Every model in `models/` parses, checks, lowers and round-trips through `ir_to_toml`;
//! the tiny models agree with the Hugging Face fixtures they describe.

mod common;

use common::*;
use flashrt_compiler::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_compiler::ir::*;
use flashrt_compiler::{ir_to_toml, model_from_toml};

fn load(stem: &str) -> ModelIr {
    let src = model_file(stem);
    model_from_toml(&src, &format!("models/{stem}.toml")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn every_model_file_checks_and_lowers() {
    let files = model_files();
    for required in [
        "demo",
        "lfm2-tiny",
        "nemotronh-tiny",
        "qwen35-tiny",
        "qwen36-27b",
        "qwen36-35b-a3b",
        "qwen35moe-tiny",
        "lfm2moe-tiny",
        "nemotronhmoe-tiny",
    ] {
        assert!(
            files.iter().any(|(s, _)| s == required),
            "models/{required}.toml is missing"
        );
    }
    for (stem, src) in &files {
        let ir = model_from_toml(src, stem).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ir.name,
            stem.replace('-', "_"),
            "model name follows the file name"
        );
        // Checked IR satisfies everything the lowering assumes.
        for dtype in [DType::F32, ir.dtype] {
            let compiled = compile(&ir, Target { dtype });
            // Prefill buckets, decode and verify[1..=MAX_DRAFT] (every model file's largest
            // bucket holds their rows); models with an MTP head add the drafter.
            let verify = flashrt_ir::lower::MAX_DRAFT;
            let mtp_plans = verify + usize::from(ir.mtp.is_some());
            assert_eq!(
                compiled.plans.len(),
                ir.prefill_buckets.len() + 1 + mtp_plans
            );
        }
    }
}

#[test]
fn ir_to_toml_round_trips_every_model() {
    for (stem, src) in model_files() {
        let ir = model_from_toml(&src, &stem).unwrap();
        let text = ir_to_toml(&ir);
        let back = model_from_toml(&text, "canonical.toml")
            .unwrap_or_else(|e| panic!("{stem}:\n{e}\n{text}"));
        assert_eq!(back, ir, "{stem}");
        assert_eq!(back.ir_hash(), ir.ir_hash());
        assert_eq!(
            ir_to_toml(&back),
            text,
            "{stem}: canonical form is a fixed point"
        );
    }
}

#[test]
fn ir_to_toml_groups_repetitions() {
    let text = ir_to_toml(&load("qwen36-27b"));
    assert!(
        text.contains("pattern = [\"gdn\", \"gdn\", \"gdn\", \"attn\"]\nrepeat = 16\n"),
        "{text}"
    );
    assert!(
        text.contains("[mtp]\nlayers = 1\nkind = \"attn\"\n"),
        "{text}"
    );
    let text = ir_to_toml(&load("nemotronh-tiny"));
    assert!(text.contains(
        "pattern = [\"mamba2\", \"mlp\", \"mamba2\", \"attention\", \"mlp\", \"mamba2\"]\n"
    ));
    assert!(!text.contains("repeat"));
    assert!(text.contains("dt_min = 0.001"));
    assert!(text.contains("rope = \"none\""));
}

#[test]
fn ir_to_toml_handles_irregular_irs() {
    // An MTP-only kind, a stack that is not a clean repetition, and odd floats.
    let mut ir = load("demo");
    ir.layers.pop();
    ir.norm.eps = F64(1.0 / 3.0);
    let mut mtp_layer = ir.layers[0].clone();
    mtp_layer.kind = "draft".into();
    mtp_layer.mlp = Some(MlpIr::Relu2 { intermediate: 100 });
    ir.mtp = Some(MtpIr {
        layers: vec![mtp_layer; 3],
    });
    if let Some(MixerIr::Attention(a)) = &mut ir.layers[3].mixer {
        a.rope = Some(RopeIr {
            theta: F64(123456.789),
            rotary_dims: 6,
        });
    }
    let text = ir_to_toml(&ir);
    assert!(!text.contains("repeat"), "{text}");
    assert_eq!(
        model_from_toml(&text, "x.toml").unwrap_or_else(|e| panic!("{e}\n{text}")),
        ir
    );

    // Same kind name, different layers: written under distinct names (no longer equal IR).
    let mut ir = load("qwen35-tiny");
    ir.layers[3].kind = "gated_deltanet".into();
    let text = ir_to_toml(&ir);
    assert!(text.contains("[kinds.gated_deltanet_2]"), "{text}");
    assert!(model_from_toml(&text, "x.toml").is_ok());
}

#[test]
fn qwen36_27b_shape() {
    let ir = load("qwen36-27b");
    assert_eq!(
        (ir.vocab, ir.hidden, ir.dtype, ir.max_seq),
        (248320, 5120, DType::Bf16, 32768)
    );
    assert_eq!(ir.prefill_buckets, [32, 64, 256, 512, 1024, 2048, 4096]);
    assert_eq!(
        ir.norm,
        NormIr {
            eps: F64(1e-6),
            weight: NormWeight::OnePlus
        }
    );
    assert_eq!(ir.layers.len(), 64);
    for (i, l) in ir.layers.iter().enumerate() {
        assert_eq!(
            l.mlp,
            Some(MlpIr::Swiglu {
                intermediate: 17408
            })
        );
        match &l.mixer {
            Some(MixerIr::Attention(a)) => {
                assert_eq!(i % 4, 3);
                assert_eq!(
                    (a.q_heads, a.kv_heads, a.head_dim, a.qk_norm, a.output_gate),
                    (24, 4, 256, true, true)
                );
                assert_eq!(
                    a.rope,
                    Some(RopeIr {
                        theta: F64(1e7),
                        rotary_dims: 64
                    })
                );
            }
            Some(MixerIr::GatedDeltanet(g)) => {
                assert_ne!(i % 4, 3);
                assert_eq!(
                    (g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.conv),
                    (16, 48, 128, 128, 4)
                );
                assert_eq!(g.norm_order, GateOrder::NormThenGate);
            }
            other => panic!("layer {i}: {other:?}"),
        }
    }
    let mtp = ir.mtp.as_ref().expect("mtp");
    assert_eq!(mtp.layers, vec![ir.layers[3].clone()]);
}

#[test]
fn demo_shape() {
    let ir = load("demo");
    assert_eq!(
        (ir.vocab, ir.hidden, ir.dtype, ir.max_seq),
        (2048, 256, DType::Bf16, 2048)
    );
    assert_eq!(ir.prefill_buckets, [16, 128]);
    let kinds: Vec<&str> = ir.layers.iter().map(|l| l.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["gdn", "gdn", "gdn", "attn", "gdn", "gdn", "gdn", "attn"]
    );
    assert!(ir.mtp.is_none());
}

/// External ground truth: the tiny models equal what flashrt's importer makes of the
/// fixtures' `config.json` (same kind names, same shapes, same conventions).
#[test]
fn tiny_models_match_the_hf_fixtures() {
    let dir = fixtures_dir();
    if !dir.exists() {
        eprintln!("skipping: no fixtures at {}", dir.display());
        return;
    }
    for (stem, fixture) in [
        ("qwen35-tiny", "qwen35-public"),
        ("lfm2-tiny", "lfm2-public"),
        ("nemotronh-tiny", "nemotronh-public"),
        ("qwen35moe-tiny", "qwen35moe-public"),
        ("lfm2moe-tiny", "lfm2moe-public"),
        ("nemotronhmoe-tiny", "nemotronhmoe-public"),
    ] {
        let ir = load(stem);
        let config = std::fs::read_to_string(dir.join(fixture).join("config.json")).unwrap();
        let opts = HfOptions {
            name: Some(ir.name.clone()),
            max_seq: Some(4096),
            prefill_buckets: Some(vec![16, 64]),
            dtype: Some(DType::F32),
            ..HfOptions::default()
        };
        let imported =
            ir_from_hf_config(&config, &opts).unwrap_or_else(|e| panic!("{fixture}: {e}"));
        assert_eq!(imported, ir, "{stem} vs {fixture}/config.json");
        // What `flashrt import-hf` prints reads back to the same model.
        assert_eq!(
            model_from_toml(&ir_to_toml(&imported), "import.toml").unwrap(),
            ir
        );
    }
}

#[test]
fn tiny_model_details_from_the_fixture_readmes() {
    let q = load("qwen35-tiny");
    assert_eq!(q.norm.weight, NormWeight::OnePlus);
    let Some(MixerIr::Attention(a)) = &q.layers[3].mixer else {
        panic!()
    };
    assert_eq!(
        a.rope,
        Some(RopeIr {
            theta: F64(10000.0),
            rotary_dims: 8
        })
    );
    assert!(a.output_gate && a.qk_norm);

    let l = load("lfm2-tiny");
    assert!(l.tied_embeddings);
    assert_eq!(l.weights, WeightNaming::Lfm2);
    assert_eq!(l.layers[0].mlp, Some(MlpIr::Swiglu { intermediate: 160 }));
    assert_eq!(
        l.layers[0].mixer,
        Some(MixerIr::ShortConv(ShortConvIr {
            conv: 3,
            bias: false
        }))
    );

    let n = load("nemotronh-tiny");
    let Some(MixerIr::Mamba2(m)) = &n.layers[0].mixer else {
        panic!()
    };
    assert_eq!(
        (m.heads, m.head_dim, m.groups, m.state, m.conv, m.chunk),
        (8, 16, 2, 16, 4, 128)
    );
    assert_eq!(m.dt_min, Some(F64(0.001)));
    assert!(m.conv_bias);
    assert_eq!(m.norm_order, GateOrder::GateThenNorm);
    assert_eq!(
        n.layers[1],
        LayerIr {
            kind: "mlp".into(),
            mixer: None,
            mlp: Some(MlpIr::Relu2 { intermediate: 128 })
        }
    );
    let Some(MixerIr::Attention(a)) = &n.layers[3].mixer else {
        panic!()
    };
    assert_eq!(a.rope, None);
}

/// A `config.json` in the released Qwen3.5/3.6-35B-A3B form (multimodal wrapper
/// `qwen3_5_moe`, text settings nested in `text_config`) with the shape the issue and the
/// model card give; keys that do not affect the shape (vision tower, token ids) left out.
const QWEN36_35B_A3B_CONFIG: &str = r#"{
  "architectures": ["Qwen3_5MoeForConditionalGeneration"],
  "model_type": "qwen3_5_moe",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_moe_text",
    "dtype": "bfloat16",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attn_output_gate": true,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "router_aux_loss_coef": 0.001,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}
  }
}"#;

#[test]
fn qwen36_35b_a3b_is_the_released_config() {
    let ir = load("qwen36-35b-a3b");
    let opts = HfOptions {
        name: Some(ir.name.clone()),
        max_seq: Some(ir.max_seq),
        prefill_buckets: Some(ir.prefill_buckets.clone()),
        dtype: None,
        ..HfOptions::default()
    };
    let imported = ir_from_hf_config(QWEN36_35B_A3B_CONFIG, &opts).unwrap();
    // Same model; the importer's kind names (`gated_deltanet_moe`, ...) differ from the
    // hand-written file's.
    let strip = |ir: &ModelIr| {
        let mut ir = ir.clone();
        for l in ir
            .layers
            .iter_mut()
            .chain(ir.mtp.iter_mut().flat_map(|m| m.layers.iter_mut()))
        {
            l.kind.clear();
        }
        ir
    };
    assert_eq!(strip(&imported), strip(&ir));
    assert_eq!(ir.layers.len(), 40);
    let Some(MlpIr::Moe(m)) = &ir.layers[0].mlp else {
        panic!("{:?}", ir.layers[0].mlp)
    };
    assert_eq!(
        (
            m.route.experts,
            m.route.top_k,
            m.intermediate,
            m.route.score
        ),
        (256, 8, 512, RouterScore::Softmax)
    );
    assert!(m.route.renormalize && !m.route.expert_bias && m.route.groups == 1);
    assert_eq!(
        m.shared,
        Some(SharedExpertIr {
            intermediate: 512,
            gated: true
        })
    );
    let attn = ir
        .layers
        .iter()
        .filter(|l| matches!(l.mixer, Some(MixerIr::Attention(_))))
        .count();
    assert_eq!(attn, 10);
    // The MTP layer is an attention layer with the same MoE block.
    assert_eq!(ir.mtp.as_ref().unwrap().layers, vec![ir.layers[3].clone()]);
}

#[test]
fn moe_tiny_model_details_from_the_fixture_readmes() {
    let moe = |ir: &ModelIr, i: usize| match &ir.layers[i].mlp {
        Some(MlpIr::Moe(m)) => m.clone(),
        other => panic!("layer {i}: {other:?}"),
    };
    // Qwen3.5-MoE: softmax -> top-k -> renormalise (no epsilon), gated SwiGLU shared expert.
    let q = moe(&load("qwen35moe-tiny"), 0);
    assert_eq!(
        (q.route.score, q.route.renorm_eps, q.route.scaling),
        (RouterScore::Softmax, F64(0.0), F64(1.0))
    );
    assert_eq!(
        q.shared,
        Some(SharedExpertIr {
            intermediate: 48,
            gated: true
        })
    );
    // LFM2-MoE: two dense layers first; sigmoid, selection-only bias, +1e-6, no shared expert.
    let l = load("lfm2moe-tiny");
    assert_eq!(l.layers[1].mlp, Some(MlpIr::Swiglu { intermediate: 128 }));
    let lm = moe(&l, 2);
    assert_eq!(
        (lm.route.score, lm.route.expert_bias, lm.route.renorm_eps),
        (RouterScore::Sigmoid, true, F64(1e-6))
    );
    assert!(lm.shared.is_none());
    // Nemotron-H: MoE blocks without a mixer, relu2 experts, scaling 2.5, ungated shared expert.
    let n = load("nemotronhmoe-tiny");
    assert!(n.layers[1].mixer.is_none());
    let nm = moe(&n, 1);
    assert_eq!(
        (nm.act, nm.route.scaling, nm.route.renorm_eps),
        (ExpertAct::Relu2, F64(2.5), F64(1e-20))
    );
    assert_eq!(
        nm.shared,
        Some(SharedExpertIr {
            intermediate: 48,
            gated: false
        })
    );
}

/// `quantize` in TOML: the IR, the layout (FP8 matrices with one f32 scale buffer each on a
/// bf16 target, f32 values on the CPU's), the excluded matrices, and the round trip.
#[test]
fn quantized_models_lower_to_fp8_weights_with_scales() {
    let src = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen36-27b.toml"),
    )
    .unwrap()
    .replace(
        "weights = \"qwen3_5_text\"",
        "weights = \"qwen3_5_text\"\nquantize = { format = \"fp8_e4m3\" }",
    );
    let ir = flashrt_compiler::model_from_toml(&src, "q.toml").unwrap();
    let q = ir.quant.clone().expect("quantized");
    assert_eq!(q.block, [128, 128]);
    assert_eq!(
        q.exclude,
        [
            "lm_head",
            "gdn.in_proj_a",
            "gdn.in_proj_b",
            "moe.shared.token_gate"
        ]
    );
    let bf16 = compile(&ir, Target { dtype: DType::Bf16 });
    let l = &bf16.layout;
    let w = l.find("layers.0.mlp.down_proj").unwrap();
    assert_eq!(w.dtype, DType::F8E4m3);
    assert_eq!(w.bytes, 5120 * 17408);
    let s = l.buffer(w.quant.unwrap().scale);
    assert_eq!(s.name, "layers.0.mlp.down_proj.scale");
    assert_eq!((s.dtype, s.shape.clone()), (DType::F32, vec![40, 136]));
    assert_eq!(
        s.source.as_deref(),
        Some("model.layers.0.mlp.down_proj.weight_scale_inv")
    );
    for kept in [
        "lm_head",
        "embed",
        "layers.0.gdn.in_proj_a",
        "layers.0.gdn.in_proj_b",
    ] {
        let b = l.find(kept).unwrap();
        assert_eq!((b.dtype, b.quant), (DType::Bf16, None), "{kept}");
    }
    assert_eq!(l.find("mtp.fc").unwrap().dtype, DType::F8E4m3);
    // About half the weight bytes of the bf16 model.
    let plain = compile(
        &flashrt_compiler::model_from_toml(
            &src.replace("quantize = { format = \"fp8_e4m3\" }", ""),
            "p.toml",
        )
        .unwrap(),
        Target { dtype: DType::Bf16 },
    );
    let ratio = l.arena_bytes(Role::Weight) as f64 / plain.layout.arena_bytes(Role::Weight) as f64;
    assert!((0.5..0.58).contains(&ratio), "{ratio}");
    assert_ne!(l.fingerprint, plain.layout.fingerprint);
    // The CPU's layout holds the values in f32, with the same scale buffers.
    let f32 = compile(&ir, Target { dtype: DType::F32 });
    let w = f32.layout.find("layers.0.mlp.down_proj").unwrap();
    assert_eq!(w.dtype, DType::F32);
    assert!(w.quant.is_some());
    // The canonical TOML round-trips it.
    let again =
        flashrt_compiler::model_from_toml(&flashrt_compiler::ir_to_toml(&ir), "rt.toml").unwrap();
    assert_eq!(again, ir);
}
