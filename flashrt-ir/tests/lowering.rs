//! Structural invariants of layouts and plans, for every reference family and for a model
//! with an MTP head.

use flashrt_ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_ir::*;
use std::path::PathBuf;

fn fixture_ir(name: &str) -> ModelIr {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    let json = std::fs::read_to_string(dir.join("config.json"))
        .unwrap_or_else(|e| panic!("fixture {name} (expected in tests/fixtures): {e}"));
    ir_from_hf_config(&json, &HfOptions::default()).unwrap()
}

/// The Qwen3.5 fixture shape plus one MTP layer of its attention kind.
fn with_mtp() -> ModelIr {
    let mut ir = fixture_ir("qwen35-public");
    let attn = ir
        .layers
        .iter()
        .find(|l| matches!(l.mixer, Some(MixerIr::Attention(_))))
        .unwrap()
        .clone();
    ir.mtp = Some(MtpIr { layers: vec![attn] });
    ir
}

fn all() -> Vec<ModelIr> {
    vec![
        fixture_ir("qwen35-public"),
        fixture_ir("lfm2-public"),
        fixture_ir("nemotronh-public"),
        with_mtp(),
    ]
}

fn check_layout(c: &Compiled) {
    let l = &c.layout;
    let mut names = std::collections::BTreeSet::new();
    for (i, b) in l.buffers.iter().enumerate() {
        assert_eq!(b.id.index(), i, "ids are indices");
        assert!(
            names.insert(b.name.clone()),
            "duplicate buffer name {}",
            b.name
        );
        assert_eq!(b.bytes, b.numel() * b.dtype.size(), "{}", b.name);
        assert_eq!(b.offset % ALIGN, 0, "{} misaligned", b.name);
        assert!(
            b.offset + b.bytes <= l.arena_bytes(b.role),
            "{} outside its arena",
            b.name
        );
        assert_eq!(b.role == Role::State, b.state.is_some(), "{}", b.name);
        assert_eq!(b.role == Role::Weight, b.source.is_some(), "{}", b.name);
        if b.state.is_some_and(|k| k.per_token()) {
            assert_eq!(b.shape[0], l.max_seq, "{} is position-major", b.name);
        }
        if b.state == Some(StateKind::Recurrent) {
            assert_eq!(b.dtype, DType::F32, "recurrent state is fp32");
        }
    }
    // No two buffers of one arena overlap.
    for role in Role::ALL {
        let mut spans: Vec<(usize, usize, &str)> = l
            .buffers
            .iter()
            .filter(|b| b.role == role)
            .map(|b| (b.offset, b.offset + b.bytes, b.name.as_str()))
            .collect();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{} overlaps {}", w[0].2, w[1].2);
        }
    }
}

fn check_view(c: &Compiled, v: &View, rows: usize) {
    let b = c.layout.buffer(v.buf);
    assert!(
        matches!(b.role, Role::Scratch | Role::Io),
        "views address scratch/io, not {}",
        b.name
    );
    assert_eq!(b.shape.len(), 2, "{}", b.name);
    assert_eq!(
        b.shape[1], v.stride,
        "{}: stride is the column count",
        b.name
    );
    assert!(
        v.col + v.width <= v.stride,
        "{}: window inside the row",
        b.name
    );
    assert!(
        b.shape[0] >= rows,
        "{}: {} rows < plan rows {rows}",
        b.name,
        b.shape[0]
    );
}

#[test]
fn layouts_are_closed_aligned_and_disjoint() {
    for ir in all() {
        for dtype in [DType::F32, DType::Bf16] {
            check_layout(&compile(&ir, Target { dtype }));
        }
    }
}

#[test]
fn every_op_addresses_valid_buffers_and_views() {
    for ir in all() {
        let c = compile(&ir, Target { dtype: DType::Bf16 });
        for plan in &c.plans {
            for op in &plan.ops {
                for b in op.buffers() {
                    assert!(
                        b.index() < c.layout.buffers.len(),
                        "{}: dangling buffer id",
                        op.name()
                    );
                }
                for v in op.views() {
                    check_view(&c, &v, plan.phase.rows());
                }
            }
            // Every plan but the drafter ends with the LM head into io.logits.
            match plan.ops.last() {
                Some(Op::Linear { out, .. }) => assert_eq!(out.buf, c.io.logits),
                other => panic!("{} ends with {other:?}", plan.phase.label()),
            }
        }
    }
}

#[test]
fn phases_cover_buckets_decode_and_mtp() {
    let plain = compile(&fixture_ir("lfm2-public"), Target { dtype: DType::F32 });
    let phases: Vec<Phase> = plain.plans.iter().map(|p| p.phase).collect();
    let mut expected: Vec<Phase> = plain
        .ir
        .prefill_buckets
        .iter()
        .map(|&bucket| Phase::Prefill { bucket })
        .collect();
    expected.push(Phase::Decode);
    // Verify plans serve short suffixes of every model, not only speculation.
    expected.extend([1, 2, 3, 4].map(|k| Phase::Verify { k }));
    assert_eq!(phases, expected);
    assert!(plain.ir.mtp.is_none() && !phases.contains(&Phase::MtpDraft));

    // A largest bucket of 3 rows holds verify[1] and verify[2] only.
    let mut small = fixture_ir("lfm2-public");
    small.prefill_buckets = vec![3];
    let phases: Vec<Phase> = compile(&small, Target { dtype: DType::F32 })
        .plans
        .iter()
        .map(|p| p.phase)
        .collect();
    assert_eq!(
        phases,
        [
            Phase::Prefill { bucket: 3 },
            Phase::Decode,
            Phase::Verify { k: 1 },
            Phase::Verify { k: 2 }
        ]
    );

    let mtp = compile(&with_mtp(), Target { dtype: DType::Bf16 });
    for k in 1..=lower::MAX_DRAFT {
        let p = mtp.plan(Phase::Verify { k }).expect("verify plan");
        assert_eq!(p.phase.rows(), k + 1);
    }
    let draft = mtp.plan(Phase::MtpDraft).expect("draft plan");
    let names: Vec<&str> = draft.ops.iter().map(Op::name).collect();
    assert_eq!(names.first(), Some(&"embed"));
    assert!(names.contains(&"load_state") && names.contains(&"attention"));
    // The drafter's attention uses its own KV regions, which are capsule regions.
    let att_state: Vec<&str> = draft
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Attention {
                cache_k, cache_v, ..
            } => Some([*cache_k, *cache_v]),
            _ => None,
        })
        .flatten()
        .map(|id| mtp.layout.buffer(id).name.as_str())
        .collect();
    assert_eq!(att_state, ["mtp.0.key", "mtp.0.value"]);
    let hidden = mtp.layout.find("mtp.hidden").expect("mtp.hidden region");
    assert_eq!(
        (hidden.role, hidden.state),
        (Role::State, Some(StateKind::Hidden))
    );
    // Main plans keep the newest hidden for the drafter.
    let decode = mtp.plan(Phase::Decode).unwrap();
    assert!(
        decode
            .ops
            .iter()
            .any(|op| matches!(op, Op::StoreLastRow { state, .. } if *state == hidden.id))
    );
    // MTP weights carry the checkpoint's names.
    for (buf, src) in [
        ("mtp.fc", "mtp.fc.weight"),
        (
            "mtp.pre_fc_norm_embedding",
            "mtp.pre_fc_norm_embedding.weight",
        ),
        ("mtp.0.attn.q_proj", "mtp.layers.0.self_attn.q_proj.weight"),
        ("mtp.0.mlp.down_proj", "mtp.layers.0.mlp.down_proj.weight"),
        ("mtp.norm", "mtp.norm.weight"),
    ] {
        assert_eq!(
            mtp.layout.find(buf).and_then(|b| b.source.as_deref()),
            Some(src),
            "{buf}"
        );
    }
}

#[test]
fn fingerprints_name_ir_and_target() {
    let a = fixture_ir("qwen35-public");
    let f = |ir: &ModelIr, dtype| compile(ir, Target { dtype }).layout.fingerprint;
    assert_eq!(
        f(&a, DType::Bf16),
        f(&a.clone(), DType::Bf16),
        "deterministic"
    );
    assert_ne!(
        f(&a, DType::Bf16),
        f(&a, DType::F32),
        "target dtype is part of the fingerprint"
    );
    let mut b = a.clone();
    b.max_seq += 1;
    assert_ne!(
        f(&a, DType::Bf16),
        f(&b, DType::Bf16),
        "IR is part of the fingerprint"
    );
    assert_eq!(
        compile(&a, Target { dtype: DType::F32 }),
        compile(&a, Target { dtype: DType::F32 })
    );
}

#[test]
fn capsule_bytes_grow_linearly_with_position() {
    for ir in all() {
        let l = compile(&ir, Target { dtype: DType::Bf16 }).layout;
        let (fixed, per) = (l.capsule_fixed_bytes(), l.capsule_bytes_per_token());
        for pos in [0, 1, 37, l.max_seq] {
            assert_eq!(l.capsule_bytes(pos), fixed + per * pos);
        }
        assert_eq!(
            l.capsule_bytes(l.max_seq),
            l.arena_bytes(Role::State) - padding(&l),
            "{}",
            ir.name
        );
    }
}

/// Alignment padding inside the state arena.
fn padding(l: &Layout) -> usize {
    l.arena_bytes(Role::State) - l.state_buffers().map(|b| b.bytes).sum::<usize>()
}

/// In the fixture families (whose widths keep side-by-side rows aligned), matmuls that read one
/// input one after another (a Gated DeltaNet layer's input projections, attention's q / k / v,
/// a dense MLP's gate and up) write adjacent columns of one scratch from weights that lie end
/// to end in the weight arena, in the same order — what the CUDA backend's prefill
/// `linear_group` needs to run them as one matmul. Each family has its groups: the Qwen3.5
/// shape's four input projections and gate / up, q / k / v in all three.
#[test]
fn projections_of_one_input_lie_side_by_side() {
    for (ir, want) in [
        (
            fixture_ir("qwen35-public"),
            &["gdn.in_proj_qkv", "attn.q_proj", "mlp.gate_proj"][..],
        ),
        (
            fixture_ir("lfm2-public"),
            &["attn.q_proj", "mlp.gate_proj"][..],
        ),
        (fixture_ir("nemotronh-public"), &["attn.q_proj"][..]),
    ] {
        let c = compile(&ir, Target { dtype: DType::Bf16 });
        let l = &c.layout;
        let mut found = std::collections::BTreeSet::new();
        for plan in &c.plans {
            for pair in plan.ops.windows(2) {
                let (
                    Op::Linear {
                        x: x0,
                        w: w0,
                        out: o0,
                        ..
                    },
                    Op::Linear {
                        x: x1,
                        w: w1,
                        out: o1,
                        ..
                    },
                ) = (&pair[0], &pair[1])
                else {
                    continue;
                };
                if x0 != x1 {
                    continue;
                }
                let (b0, b1) = (l.buffer(*w0), l.buffer(*w1));
                assert_eq!(
                    o1.buf, o0.buf,
                    "{} and {}: one output buffer",
                    b0.name, b1.name
                );
                assert_eq!(
                    o1.col,
                    o0.col + o0.width,
                    "{} then {}: adjacent columns",
                    b0.name,
                    b1.name
                );
                assert_eq!(
                    b1.offset,
                    b0.offset + b0.bytes,
                    "{} then {}: adjacent weights",
                    b0.name,
                    b1.name
                );
                let kind = b0.name.split_once('.').map_or("", |(_, rest)| rest);
                let kind = kind.split_once('.').map_or(kind, |(_, rest)| rest);
                found.insert(kind.to_string());
            }
        }
        for w in want {
            assert!(
                found.contains(*w),
                "{}: no group starting at `{w}` (found {found:?})",
                ir.name
            );
        }
    }
}

/// Where side-by-side outputs would misalign a row (here the Gated DeltaNet projections' widths
/// 136 + 72 + 6 + 6 = 220 columns, not a multiple of 8), each projection keeps a scratch of its
/// own, and the plans stay valid.
#[test]
fn misaligned_projections_keep_their_own_scratches() {
    let mut ir = fixture_ir("qwen35-public");
    let mut changed = 0;
    for l in &mut ir.layers {
        if let Some(MixerIr::GatedDeltanet(g)) = &mut l.mixer {
            g.value_heads = 6;
            g.value_dim = 12;
            changed += 1;
        }
    }
    assert!(changed > 0, "the fixture has Gated DeltaNet layers");
    let c = compile(&ir, Target { dtype: DType::Bf16 });
    check_layout(&c);
    let decode = c.plans.iter().find(|p| p.phase == Phase::Decode).unwrap();
    let outs: Vec<View> = decode
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Linear { w, out, .. }
                if c.layout.buffer(*w).name.starts_with("layers.0.gdn.in_proj") =>
            {
                Some(*out)
            }
            _ => None,
        })
        .collect();
    assert_eq!(outs.len(), 4);
    for (i, o) in outs.iter().enumerate() {
        assert_eq!(o.col, 0, "projection {i} at column 0 of its own scratch");
        check_view(&c, o, decode.phase.rows());
    }
    let bufs: std::collections::BTreeSet<_> = outs.iter().map(|o| o.buf).collect();
    assert_eq!(bufs.len(), 4, "four scratches");
}
