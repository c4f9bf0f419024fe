//! The capsule contract on the CPU reference, for every fixture model (loaded through the HF
//! importer with small prefill buckets, so prompts span several chunks and plans).

mod common;

use common::*;
use flashrt_runtime::ir::Phase;
use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::{ChunkCosts, CostSource, Error, LogitsMode, Model, PlanCost, Session};

const BUCKETS: [usize; 2] = [4, 16];

fn models() -> Vec<(&'static str, Model)> {
    FIXTURES.iter().map(|&n| (n, load(n, &BUCKETS))).collect()
}

/// Every state region's current bytes, by name.
fn state_of(s: &Session) -> Vec<(String, Vec<u8>)> {
    s.model()
        .compiled()
        .layout
        .state_buffers()
        .map(|b| (b.name.clone(), s.read_region(b.id).unwrap()))
        .collect()
}

#[test]
fn restore_is_byte_exact_after_dirtying() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut s = m.session().unwrap();
        s.append(&tokens(1, 37, v)).unwrap();
        let cap = s.snapshot().unwrap();
        let before = state_of(&s);
        // The capsule holds exactly the live bytes.
        for (region, bytes) in &before {
            assert_eq!(
                &cap.region(region).unwrap(),
                bytes,
                "{name}: capsule region {region}"
            );
        }
        assert_eq!(cap.bytes(), s.state_bytes());
        assert_eq!(cap.bytes(), m.compiled().layout.capsule_bytes(37));
        assert_eq!(
            cap.regions().len(),
            m.compiled().layout.state_buffers().count()
        );

        // Dirty the session: more tokens, then a different prompt from scratch.
        s.decode_greedy(5).unwrap();
        s.append(&tokens(2, 20, v)).unwrap();
        s.reset().unwrap();
        s.append(&tokens(3, 51, v)).unwrap();
        assert_ne!(state_of(&s), before, "{name}: dirtying changed nothing");

        s.restore(&cap).unwrap();
        assert_eq!(
            state_of(&s),
            before,
            "{name}: state bytes differ after restore"
        );
        assert_eq!(s.pos(), 37);
        assert_eq!(s.tokens(), &tokens(1, 37, v)[..]);
        assert_eq!(s.last_logits(), cap.last_logits().unwrap());
    }
}

/// `snapshot_to_host` (the fallback when the device has no room for a capsule's copy) holds
/// the same bytes and metadata as `snapshot`, enters a store's host tier, and restores into a
/// dirtied session exactly as the device capsule does.
#[test]
fn host_snapshots_equal_device_snapshots() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut s = m.session().unwrap();
        s.append(&tokens(6, 33, v)).unwrap();
        s.decode_greedy(2).unwrap();
        let (dev, host) = (s.snapshot().unwrap(), s.snapshot_to_host().unwrap());
        for r in dev.regions() {
            assert_eq!(
                host.region(r.name()).unwrap(),
                dev.region(r.name()).unwrap(),
                "{name}: region {}",
                r.name()
            );
        }
        assert_eq!(host.meta(), dev.meta(), "{name}: metadata");
        assert_eq!(host.kv_rows(), dev.kv_rows(), "{name}: KV row ids");
        let ids = s.decode_greedy(6).unwrap();
        let mut t = m.session().unwrap();
        t.append(&tokens(7, 21, v)).unwrap();
        t.restore(&host).unwrap();
        assert_eq!(t.decode_greedy(6).unwrap(), ids, "{name}: continuation");
        let mut store = flashrt_runtime::CapsuleStore::open(
            m.clone(),
            flashrt_runtime::store::StoreConfig::default(),
        )
        .unwrap();
        let id = store.insert(host, None).unwrap();
        assert_eq!(
            store.info(&id).unwrap().tiers,
            vec![flashrt_runtime::store::Tier::Host],
            "{name}: a host capsule is stored in the host tier"
        );
    }
}

#[test]
fn decode_after_restore_equals_undisturbed_decode() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut s = m.session().unwrap();
        s.append(&tokens(4, 29, v)).unwrap();
        let cap = s.snapshot().unwrap();
        let ids = s.decode_greedy(12).unwrap();
        let logits = s.last_logits().to_vec();

        let mut t = m.session().unwrap();
        t.append(&tokens(5, 40, v)).unwrap();
        t.decode_greedy(3).unwrap();
        t.restore(&cap).unwrap();
        assert_eq!(t.decode_greedy(12).unwrap(), ids, "{name}");
        assert_eq!(
            t.last_logits(),
            &logits[..],
            "{name}: logits after decode not bitwise equal"
        );
        assert_eq!(
            t.counters(),
            s.counters(),
            "{name}: counters travel with the capsule"
        );
    }
}

#[test]
fn two_forks_equal_two_cold_runs() {
    for (name, m) in models() {
        let v = m.vocab();
        let prompt = tokens(6, 33, v);
        let (s1, s2) = (tokens(7, 9, v), tokens(8, 14, v));
        let mut s = m.session().unwrap();
        s.append(&prompt).unwrap();
        let cap = s.snapshot().unwrap();
        let mut b1 = m.fork(&cap).unwrap();
        let mut b2 = m.fork(&cap).unwrap();
        b1.append(&s1).unwrap();
        b2.append(&s2).unwrap();
        let g1 = b1.decode_greedy(8).unwrap();
        let g2 = b2.decode_greedy(8).unwrap();
        for (suffix, branch_logits, g) in [(&s1, &b1, &g1), (&s2, &b2, &g2)] {
            let mut cold = m.session().unwrap();
            let mut all = prompt.clone();
            all.extend_from_slice(suffix);
            cold.append(&all).unwrap();
            let mut fork = m.fork(&cap).unwrap();
            fork.append(suffix).unwrap();
            let rows = cold.logits_rows();
            let tail = &cold.logits()[(rows - suffix.len()) * v..];
            assert_eq!(
                fork.logits(),
                tail,
                "{name}: fork logits differ from the cold run"
            );
            assert_eq!(
                &cold.decode_greedy(8).unwrap(),
                g,
                "{name}: fork greedy ids"
            );
            assert_eq!(cold.last_logits(), branch_logits.last_logits(), "{name}");
        }
        // The parent session was not touched by its forks.
        assert_eq!(s.pos(), prompt.len());
        assert_eq!(
            s.snapshot().unwrap().region("layers.0.conv").ok(),
            cap.region("layers.0.conv").ok()
        );
    }
}

#[test]
fn restore_and_append_at_any_boundary_equals_cold_prefill_bitwise() {
    for (name, m) in models() {
        let v = m.vocab();
        let all = tokens(9, 45, v);
        let mut cold = m.session().unwrap();
        cold.append(&all).unwrap();
        let cold_logits = cold.logits().to_vec();
        let cold_state = state_of(&cold);

        let mut dirty = m.session().unwrap();
        for split in [1, 2, 3, 4, 5, 7, 13, 16, 17, 31, 32, 33, 44] {
            let mut a = m.session().unwrap();
            a.append(&all[..split]).unwrap();
            let cap = a.snapshot().unwrap();
            // Restore into a session that holds something else entirely.
            dirty.reset().unwrap();
            dirty.append(&tokens(10 + split as u64, 23, v)).unwrap();
            dirty.restore(&cap).unwrap();
            dirty.append(&all[split..]).unwrap();
            assert_eq!(
                dirty.logits(),
                &cold_logits[split * v..],
                "{name}: split {split}: logits not bitwise equal"
            );
            assert_eq!(
                state_of(&dirty),
                cold_state,
                "{name}: split {split}: state not bitwise equal"
            );
        }
        // Token by token through the decode plan, and ragged chunks, give the same bits too.
        let mut t = m.session().unwrap();
        let mut rows = Vec::new();
        let mut i = 0;
        for n in [1, 1, 6, 1, 3, 17, 2, 1, 13] {
            t.append(&all[i..i + n]).unwrap();
            rows.extend_from_slice(t.logits());
            i += n;
        }
        assert_eq!(i, all.len());
        assert_eq!(rows, cold_logits, "{name}: ragged appends");
        assert_eq!(state_of(&t), cold_state, "{name}: ragged appends state");
    }
}

/// Cost tables that make the chunk planner choose very different steps for the same tokens:
/// the derived CPU table (fewest chunks), a padded device's derived table, one where verify
/// passes are cheapest and one where the smallest bucket is.
fn cost_tables(m: &Model) -> Vec<(&'static str, ChunkCosts)> {
    let table = |f: &dyn Fn(Phase) -> f64| {
        ChunkCosts::new(
            m.chunk_costs()
                .plans()
                .iter()
                .map(|p| PlanCost {
                    phase: p.phase,
                    fixed: f(p.phase),
                    per_row: 0.0,
                })
                .collect(),
            CostSource::Given,
        )
    };
    vec![
        ("derived", m.chunk_costs()),
        ("padded", ChunkCosts::derived(m.compiled(), true)),
        (
            "verify",
            table(&|p| match p {
                Phase::Verify { .. } => 1.0,
                Phase::Decode => 1.5,
                _ => 50.0,
            }),
        ),
        (
            "small bucket",
            table(&|p| match p {
                Phase::Prefill { bucket: 4 } => 1.0,
                Phase::Prefill { .. } | Phase::Verify { .. } => 100.0,
                _ => 0.8,
            }),
        ),
    ]
}

/// The chunk planner's choice never changes a bit on the reference backend: for every cost
/// table, restore + append at any boundary equals a cold prefill, and the session runs
/// exactly the steps the planner chose.
#[test]
fn every_chunk_plan_gives_the_same_bits() {
    for (name, m) in models() {
        let v = m.vocab();
        let all = tokens(19, 45, v);
        let mut cold = m.session().unwrap();
        cold.append(&all).unwrap();
        let cold_logits = cold.logits().to_vec();
        let cold_state = state_of(&cold);
        for (label, table) in cost_tables(&m) {
            m.set_chunk_costs(table).unwrap();
            let plan = m.plan_chunks(45);
            let verify = plan.iter().any(|(p, _)| matches!(p, Phase::Verify { .. }));
            assert_eq!(label == "verify", verify, "{name} {label}: {plan:?}");
            for split in [1, 3, 8, 21, 40, 43, 44] {
                let mut s = m.session().unwrap();
                s.append(&all[..split]).unwrap();
                let cap = s.snapshot().unwrap();
                s.append(&tokens(7, 9, v)).unwrap();
                s.restore(&cap).unwrap();
                let before = s.counters().steps;
                s.append(&all[split..]).unwrap();
                assert_eq!(
                    (s.counters().steps - before) as usize,
                    m.plan_chunks(45 - split).len(),
                    "{name} {label} split {split}: steps run"
                );
                assert_eq!(
                    s.logits(),
                    &cold_logits[split * v..],
                    "{name} {label} split {split}: logits not bitwise equal"
                );
                assert_eq!(
                    state_of(&s),
                    cold_state,
                    "{name} {label} split {split}: state not bitwise equal"
                );
            }
        }
    }
}

#[test]
fn chunk_cost_tables_are_checked() {
    let m = load(FIXTURES[0], &BUCKETS);
    let bad = |plans: Vec<PlanCost>| m.set_chunk_costs(ChunkCosts::new(plans, CostSource::Given));
    let decode = PlanCost {
        phase: Phase::Decode,
        fixed: 1.0,
        per_row: 0.0,
    };
    let e = bad(vec![
        decode,
        PlanCost {
            phase: Phase::Prefill { bucket: 64 },
            ..decode
        },
    ])
    .unwrap_err();
    assert!(e.to_string().contains("no token plan prefill[64]"), "{e}");
    let e = bad(vec![PlanCost {
        phase: Phase::Prefill { bucket: 16 },
        ..decode
    }])
    .unwrap_err();
    assert!(e.to_string().contains("needs the decode plan"), "{e}");
    let e = bad(vec![PlanCost {
        fixed: f64::NAN,
        ..decode
    }])
    .unwrap_err();
    assert!(e.to_string().contains("finite and positive"), "{e}");
    // Timing every plan installs a measured table over all of them.
    let mut lines = 0;
    let measured = m.calibrate_chunking(1, &mut |_| lines += 1).unwrap();
    assert_eq!(measured.source(), CostSource::Measured);
    assert_eq!(measured.plans().len(), BUCKETS.len() + 1 + 4, "{measured}");
    assert_eq!(lines, measured.plans().len());
    assert_eq!(m.chunk_costs(), measured);
    // A decode-only table is valid: every append runs token by token.
    bad(vec![decode]).unwrap();
    assert_eq!(m.plan_chunks(3), vec![(Phase::Decode, 1); 3]);
}

#[test]
fn rollback_returns_to_an_earlier_boundary() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut s = m.session().unwrap();
        s.append(&tokens(11, 20, v)).unwrap();
        let c1 = s.snapshot().unwrap();
        let ids = s.decode_greedy(6).unwrap();
        let c2 = s.snapshot().unwrap();
        s.append(&tokens(12, 5, v)).unwrap();
        // Reject the speculative tail: back to c2, then to c1.
        s.rollback(&c2).unwrap();
        assert_eq!(s.pos(), 26);
        s.rollback(&c1).unwrap();
        assert_eq!(s.pos(), 20);
        assert_eq!(s.decode_greedy(6).unwrap(), ids, "{name}");
        // Greedy decoding is deterministic, so the same 6 tokens came back and c2 is again a
        // boundary of this history.
        s.rollback(&c2).unwrap();
        // A capsule of another history is not a rollback target.
        let mut other = m.session().unwrap();
        other.append(&tokens(13, 30, v)).unwrap();
        let foreign = other.snapshot().unwrap();
        let e = s.rollback(&foreign).unwrap_err();
        assert!(matches!(e, Error::Capsule(_)), "{name}: {e}");
        // A later boundary is not a rollback target either.
        s.rollback(&c1).unwrap();
        assert!(s.rollback(&c2).is_err(), "{name}: rolling forward accepted");
        // ... but a plain restore to it is fine.
        s.restore(&c2).unwrap();
        assert_eq!(s.pos(), 26);
    }
}

#[test]
fn kv_only_ablation_diverges() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut s = m.session().unwrap();
        s.append(&tokens(14, 37, v)).unwrap();
        let cap = s.snapshot().unwrap();
        let suffix = tokens(15, 9, v);
        let mut truth = m.fork(&cap).unwrap();
        truth.append(&suffix).unwrap();

        // Dirty conv/recurrent state with another prompt, then restore only K/V.
        let mut ab = m.session().unwrap();
        ab.append(&tokens(16, 37, v)).unwrap();
        ab.restore_kv_only(&cap).unwrap();
        for b in m.compiled().layout.state_buffers() {
            let same = ab.read_region(b.id).unwrap() == cap.region_by_id(b.id).unwrap();
            assert_eq!(
                same,
                b.state.unwrap().per_token(),
                "{name}: region {} after KV-only restore",
                b.name
            );
        }
        ab.append(&suffix).unwrap();
        let diff = max_abs_diff(ab.logits(), truth.logits());
        println!(
            "{name}: KV-only restore, max |logit diff| over the next {} tokens = {diff:.4}",
            suffix.len()
        );
        assert!(
            diff > 1e-3,
            "{name}: KV-only restore did not diverge ({diff})"
        );
        // A full restore of the same capsule repairs it.
        ab.restore(&cap).unwrap();
        ab.append(&suffix).unwrap();
        assert_eq!(ab.logits(), truth.logits(), "{name}");
    }
}

#[test]
fn fingerprint_mismatch_is_an_error() {
    let ms = models();
    let (qwen, lfm2) = (&ms[0].1, &ms[1].1);
    let mut s = lfm2.session().unwrap();
    s.append(&[5, 6, 7]).unwrap();
    let cap = s.snapshot().unwrap();
    let mut q = qwen.session().unwrap();
    let e = q.restore(&cap).unwrap_err();
    assert!(matches!(e, Error::Fingerprint { .. }), "{e}");
    assert!(qwen.fork(&cap).is_err());
    assert!(q.restore_kv_only(&cap).is_err());
    // The same checkpoint compiled with another max_seq has another layout.
    let opts = HfOptions {
        max_seq: Some(128),
        prefill_buckets: Some(BUCKETS.to_vec()),
        ..Default::default()
    };
    let other = Model::load_hf_dir(cpu(), &fixture("lfm2-public"), &opts).unwrap();
    assert_ne!(other.fingerprint(), lfm2.fingerprint());
    let e = other.fork(&cap).unwrap_err();
    assert!(matches!(e, Error::Fingerprint { .. }), "{e}");
    println!("{e}");
}

#[test]
fn capsule_meta_and_logits_modes() {
    let m = load("nemotronh-public", &BUCKETS);
    let v = m.vocab();
    let mut s = m.session().unwrap();
    assert!(s.last_logits().is_empty());
    assert!(s.decode_greedy(1).is_err());
    let empty = s.snapshot().unwrap();
    assert_eq!(empty.pos(), 0);
    assert!(empty.last_logits().is_none());

    s.append(&tokens(17, 21, v)).unwrap();
    assert_eq!(s.logits_rows(), 21);
    let c = s.counters();
    // 21 tokens = chunks of 16 and 5 -> two prefill steps.
    assert_eq!((c.steps, c.prefill_tokens, c.decode_tokens), (2, 21, 0));
    s.decode_greedy(2).unwrap();
    let c = s.counters();
    assert_eq!((c.steps, c.prefill_tokens, c.decode_tokens), (4, 21, 2));
    let cap = s.snapshot().unwrap();
    assert_eq!(cap.meta.pos, 23);
    assert_eq!(cap.meta.tokens.len(), 23);
    assert_eq!(cap.meta.counters, c);
    assert_eq!(cap.meta.model, m.name());
    assert!(cap.meta.sampler.is_greedy());
    assert_eq!(cap.last_logits().unwrap().len(), v);
    for r in cap.regions() {
        assert_eq!(r.to_host().unwrap().len(), r.bytes());
        assert_eq!(r.bytes(), r.buffer().used_bytes(23));
    }
    // Restoring the empty capsule gives a fresh session.
    s.restore(&empty).unwrap();
    assert_eq!(s.pos(), 0);
    assert!(s.last_logits().is_empty());

    // LogitsMode::Last keeps only the final row, with the same bits.
    let mut a = m.session().unwrap();
    let mut b = m.session().unwrap();
    b.set_logits_mode(LogitsMode::Last);
    let p = tokens(18, 40, v);
    a.append(&p).unwrap();
    b.append(&p).unwrap();
    assert_eq!(b.logits_rows(), 1);
    assert_eq!(a.last_logits(), b.last_logits());
}

#[test]
fn random_weight_models_are_deterministic() {
    let json = std::fs::read_to_string(fixture("qwen35-public").join("config.json")).unwrap();
    let ir = flashrt_runtime::ir::hf::ir_from_hf_config(
        &json,
        &HfOptions {
            max_seq: Some(64),
            ..Default::default()
        },
    )
    .unwrap();
    let a = Model::with_random_weights(cpu(), &ir, 42).unwrap();
    let b = Model::with_random_weights(cpu(), &ir, 42).unwrap();
    let c = Model::with_random_weights(cpu(), &ir, 43).unwrap();
    let p = tokens(19, 20, ir.vocab);
    let run = |m: &Model| {
        let mut s = m.session().unwrap();
        s.append(&p).unwrap();
        (s.logits().to_vec(), s.decode_greedy(5).unwrap())
    };
    let (la, ga) = run(&a);
    let (lb, gb) = run(&b);
    let (lc, _) = run(&c);
    assert_eq!((la.clone(), ga), (lb, gb));
    assert_ne!(la, lc);
    assert!(la.iter().all(|x| x.is_finite()));
}

/// `Model::step_batch` leaves every session exactly as its own one-token append does (state,
/// logits, position, history, counters), whatever the mix of positions and whichever sessions
/// step together; bad input is refused before anything runs.
#[test]
fn step_batch_equals_each_session_appending() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut batch: Vec<Session> = Vec::new();
        let mut alone: Vec<Session> = Vec::new();
        for i in 0..5u64 {
            let mut s = m.session().unwrap();
            s.append(&tokens(40 + i, 2 + 7 * i as usize, v)).unwrap();
            alone.push(m.fork(&s.snapshot().unwrap()).unwrap());
            batch.push(s);
        }
        for (k, who) in [&[0usize, 1, 2, 3, 4][..], &[3, 1], &[4, 0, 2]]
            .into_iter()
            .enumerate()
        {
            let toks: Vec<u32> = who
                .iter()
                .map(|&i| flashrt_runtime::argmax(batch[i].last_logits()).unwrap())
                .collect();
            let mut slots: Vec<Option<&mut Session>> = batch.iter_mut().map(Some).collect();
            let mut refs: Vec<&mut Session> =
                who.iter().map(|&i| slots[i].take().unwrap()).collect();
            m.step_batch(&mut refs, &toks).unwrap();
            drop(refs);
            for (&i, &t) in who.iter().zip(&toks) {
                alone[i].append(&[t]).unwrap();
                assert_eq!(
                    batch[i].last_logits(),
                    alone[i].last_logits(),
                    "{name}: round {k}, session {i}"
                );
            }
        }
        for (i, (b, a)) in batch.iter().zip(&alone).enumerate() {
            assert_eq!(state_of(b), state_of(a), "{name}: session {i} state");
            assert_eq!(b.pos(), a.pos());
            assert_eq!(b.tokens(), a.tokens());
            assert_eq!(b.counters(), a.counters());
        }

        // Refused before anything runs: nothing moves.
        let before: Vec<usize> = batch.iter().map(|s| s.pos()).collect();
        let [s0, s1, ..] = &mut batch[..] else {
            unreachable!()
        };
        let bad = v as u32;
        for (toks, want) in [
            (vec![1u32], "2 sessions but 1 tokens"),
            (vec![1, bad], "out of range"),
        ] {
            let e = m.step_batch(&mut [&mut *s0, &mut *s1], &toks).unwrap_err();
            assert!(
                matches!(&e, Error::Input(msg) if msg.contains(want)),
                "{name}: {e}"
            );
        }
        let other = load(
            FIXTURES[(FIXTURES.iter().position(|&n| n == name).unwrap() + 1) % FIXTURES.len()],
            &BUCKETS,
        );
        let mut foreign = other.session().unwrap();
        foreign.append(&[1]).unwrap();
        let e = m
            .step_batch(&mut [&mut *s0, &mut foreign], &[1, 1])
            .unwrap_err();
        assert!(
            matches!(&e, Error::Input(msg) if msg.contains("another model")),
            "{name}: {e}"
        );
        assert_eq!(
            batch.iter().map(|s| s.pos()).collect::<Vec<_>>(),
            before,
            "{name}: a refused batch moved a session"
        );
    }
}

/// `warm_plans` (a server warms its session's graphs with it) runs every plan and leaves a
/// session that is a fresh one: zero state, position 0, and the same logits and state bytes
/// as an untouched session after the same tokens.
#[test]
fn a_warmed_session_is_a_fresh_session() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut warmed = m.session().unwrap();
        let mut fresh = m.session().unwrap();
        let zero = state_of(&fresh);
        warmed.append(&tokens(4, 9, v)).unwrap();
        warmed.warm_plans().unwrap();
        assert_eq!(warmed.pos(), 0, "{name}");
        assert_eq!(state_of(&warmed), zero, "{name}: warming left state behind");
        for (i, chunk) in [tokens(5, 21, v), tokens(6, 1, v), tokens(7, 3, v)]
            .iter()
            .enumerate()
        {
            warmed.append(chunk).unwrap();
            fresh.append(chunk).unwrap();
            assert_eq!(warmed.logits(), fresh.logits(), "{name}: chunk {i}");
        }
        assert_eq!(state_of(&warmed), state_of(&fresh), "{name}");
    }
}

/// A restore skips the KV rows the session holds already ([`Session::rows_held`]): over a
/// seeded walk of appends, decodes, batched steps, snapshots, resets and restores, every
/// restore leaves exactly the bytes a fresh session restored from the same capsule holds
/// (which copies every row), and the rows skipped are those the walk says are held.
#[test]
fn restores_skip_only_rows_the_session_holds() {
    for (name, m) in models() {
        let v = m.vocab();
        let mut s = m.session().unwrap();
        let mut other = m.session().unwrap();
        other.append(&tokens(90, 5, v)).unwrap();
        // A checkpoint, a step past it and a snapshot there, back to the checkpoint: the
        // session still holds the checkpoint's rows (a reset loop; a server's stored prefix
        // with a new suffix each time).
        s.append(&tokens(91, 23, v)).unwrap();
        let cp = s.snapshot().unwrap();
        s.append(&tokens(92, 3, v)).unwrap();
        let later = s.snapshot().unwrap();
        assert_eq!((s.rows_held(&cp), s.rows_held(&later)), (23, 26), "{name}");
        s.restore(&cp).unwrap();
        assert_eq!((s.rows_held(&cp), s.rows_held(&later)), (23, 23), "{name}");
        assert_eq!(state_of(&s), state_of(&m.fork(&cp).unwrap()), "{name}");
        s.reset().unwrap();
        let mut caps: Vec<flashrt_runtime::Capsule> = Vec::new();
        let mut rng = 0x9e37_79b9_u64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut skipped = 0usize;
        for step in 0..60 {
            let room = 200usize.saturating_sub(s.pos());
            match next(7) {
                0 | 1 if room > 20 => {
                    let n = 1 + next(19) as usize;
                    s.append(&tokens(1000 + step, n, v)).unwrap();
                }
                2 if room > 4 && s.pos() > 0 => {
                    s.decode_greedy(1 + next(3) as usize).unwrap();
                }
                3 if room > 2 && s.pos() > 0 && other.pos() < 190 => {
                    let t = [
                        flashrt_runtime::argmax(s.last_logits()).unwrap(),
                        flashrt_runtime::argmax(other.last_logits()).unwrap(),
                    ];
                    m.step_batch(&mut [&mut s, &mut other], &t).unwrap();
                }
                4 => {
                    let c = s.snapshot().unwrap();
                    assert_eq!(
                        s.rows_held(&c),
                        c.pos(),
                        "{name}: a snapshot's rows are held"
                    );
                    caps.push(c);
                }
                5 if next(3) == 0 => {
                    s.reset().unwrap();
                    assert!(caps.iter().all(|c| s.rows_held(c) == 0), "{name}: reset");
                }
                _ if !caps.is_empty() => {
                    let c = caps[next(caps.len() as u64) as usize].clone();
                    let held = s.rows_held(&c);
                    assert!(held <= c.pos().min(s.pos()), "{name}: step {step}");
                    skipped += held;
                    s.restore(&c).unwrap();
                    let fresh = m.fork(&c).unwrap();
                    assert_eq!(
                        state_of(&s),
                        state_of(&fresh),
                        "{name}: step {step}: restore skipping {held} held rows"
                    );
                    assert_eq!(s.rows_held(&c), c.pos());
                    // Another session's rows are never taken for this one's.
                    assert_eq!(other.rows_held(&c), 0);
                }
                _ => {}
            }
        }
        assert!(skipped > 0, "{name}: the walk never restored held rows");
    }
}
