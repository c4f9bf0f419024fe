//! Speculative decoding on the CPU reference: greedy output and session state equal plain
//! greedy decoding whatever the drafts, over long runs and every draft length; forced
//! drafters (oracle: all accepted, adversary: all rejected, scripted: partial); capsules taken
//! mid-run carry the drafter's state; the statistics add up; rollback of conv and Mamba2
//! state on the fixture models (verified through prefill plans, which have no MTP head).

mod common;

use common::*;
use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::ir::{DType, ModelIr};
use flashrt_runtime::speculative::{DraftCx, Drafter};
use flashrt_runtime::{
    AdversaryDrafter, Counters, Error, Model, MtpDrafter, OracleDrafter, Session, SpecStats,
    Speculator,
};

/// A small Qwen3.5-family model with one MTP layer (the shape of `models/demo-mtp.toml`,
/// scaled down): Gated DeltaNet x3 + gated attention, SwiGLU, partial RoPE.
const QWEN_MTP: &str = r#"{
  "model_type": "qwen3_5_text",
  "hidden_size": 64, "intermediate_size": 128, "vocab_size": 256,
  "num_hidden_layers": 4,
  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
  "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "hidden_act": "silu", "dtype": "float32",
  "mtp_num_hidden_layers": 1
}"#;

fn ir(max_seq: usize) -> ModelIr {
    let opts = HfOptions {
        name: Some("spec_test".into()),
        max_seq: Some(max_seq),
        prefill_buckets: Some(vec![4, 16]),
        dtype: Some(DType::F32),
        ..HfOptions::default()
    };
    ir_from_hf_config(QWEN_MTP, &opts).unwrap()
}

fn model(max_seq: usize) -> Model {
    Model::with_random_weights(cpu(), &ir(max_seq), 11).unwrap()
}

/// Every state region's bytes, by name; `skip_drafter_kv` leaves out `mtp.{j}.key/value`
/// (the only regions a session that never drafted does not write).
fn state_of(s: &Session, skip_drafter_kv: bool) -> Vec<(String, Vec<u8>)> {
    s.model()
        .compiled()
        .layout
        .state_buffers()
        .filter(|b| !(skip_drafter_kv && b.name.starts_with("mtp.") && b.name != "mtp.hidden"))
        .map(|b| (b.name.clone(), s.read_region(b.id).unwrap()))
        .collect()
}

fn delta(a: Counters, b: Counters) -> (u64, u64, u64) {
    (
        a.steps - b.steps,
        a.prefill_tokens - b.prefill_tokens,
        a.decode_tokens - b.decode_tokens,
    )
}

/// Plain greedy decoding of `n` tokens after `prompt`: (session, prompt + output).
fn plain(m: &Model, prompt: &[u32], n: usize) -> (Session, Vec<u32>) {
    let mut s = m.session().unwrap();
    s.append(prompt).unwrap();
    let out = s.decode_greedy(n).unwrap();
    let mut all = prompt.to_vec();
    all.extend_from_slice(&out);
    (s, all)
}

/// Speculative decoding must leave exactly what plain decoding left.
fn assert_same_as_plain(spec: &Session, reference: &Session, what: &str) {
    assert_eq!(spec.pos(), reference.pos(), "{what}: position");
    assert_eq!(spec.tokens(), reference.tokens(), "{what}: history");
    assert_eq!(spec.pending(), reference.pending(), "{what}: pending");
    assert_eq!(
        spec.logits_rows(),
        reference.logits_rows(),
        "{what}: logits rows"
    );
    assert_eq!(
        spec.last_logits()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        reference
            .last_logits()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        "{what}: last logits (bitwise)"
    );
    assert!(
        state_of(spec, true) == state_of(reference, true),
        "{what}: target state bytes differ from plain decoding"
    );
}

/// Drafts of an inner drafter, recorded.
struct Recording<D> {
    inner: D,
    drafts: Vec<Vec<u32>>,
}

impl<D: Drafter> Drafter for Recording<D> {
    fn name(&self) -> &str {
        "recording"
    }
    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> flashrt_runtime::Result<Vec<u32>> {
        let d = self.inner.draft(cx, k)?;
        self.drafts.push(d.clone());
        Ok(d)
    }
}

/// The reference continuation with one wrong draft at a position-dependent offset (or none):
/// exercises every accepted length `0 ..= k`.
struct Scripted {
    reference: Vec<u32>,
}

impl Drafter for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> flashrt_runtime::Result<Vec<u32>> {
        let p = cx.pos();
        let mut d: Vec<u32> = self.reference[(p + 1).min(self.reference.len())..]
            .iter()
            .take(k)
            .copied()
            .collect();
        // A pseudo-random offset; k or k + 1 means all correct.
        let mut z = (p as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 31)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let wrong_at = (z ^ (z >> 29)) as usize % (k + 2);
        if let Some(t) = d.get_mut(wrong_at) {
            *t = (*t + 1) % cx.vocab() as u32;
        }
        Ok(d)
    }
}

#[test]
fn speculative_greedy_equals_plain_greedy_with_the_mtp_head() {
    let m = model(512);
    let v = m.vocab();
    let n = 220;
    let mut total = SpecStats::default();
    for (seed, len) in [(1u64, 5usize), (2, 17), (3, 33)] {
        let prompt = tokens(seed, len, v);
        let (reference, all) = plain(&m, &prompt, n);
        for k in 1..=4 {
            let mut s = m.session().unwrap();
            s.append_with_mtp(&prompt).unwrap();
            let before = s.counters();
            let (out, stats) = s.decode_speculative(n, k, &mut MtpDrafter).unwrap();
            let what = format!("prompt {seed}, k = {k}");
            assert_eq!(out, all[len..], "{what}: tokens");
            assert_same_as_plain(&s, &reference, &what);
            // Plain decoding counts one decode step per token.
            assert_eq!(
                delta(s.counters(), before),
                (n as u64, 0, n as u64),
                "{what}: counters"
            );
            assert_eq!(stats.tokens(), n as u64, "{what}");
            assert!(stats.verify_passes > 0, "{what}: nothing was verified");
            total += stats;
        }
    }
    eprintln!(
        "MTP head, random weights: {} of {} drafts accepted ({:.1}%), {:.2} tokens per round, accepted lengths {:?}",
        total.accepted,
        total.drafted,
        100.0 * total.acceptance_rate(),
        total.tokens_per_round(),
        total.accepted_hist
    );
}

#[test]
fn oracle_drafts_are_all_accepted() {
    let m = model(512);
    let v = m.vocab();
    let n = 203;
    let prompt = tokens(7, 9, v);
    let (reference, all) = plain(&m, &prompt, n);
    for k in 1..=4 {
        let mut s = m.session().unwrap();
        s.append(&prompt).unwrap();
        let before = s.counters();
        let mut spec = Speculator::new(OracleDrafter::new(all.clone()), k);
        let out = spec.decode(&mut s, n).unwrap();
        let st = spec.stats;
        assert_eq!(out, all[prompt.len()..], "k = {k}");
        assert_same_as_plain(&s, &reference, &format!("oracle, k = {k}"));
        assert_eq!(delta(s.counters(), before), (n as u64, 0, n as u64));
        assert!(st.drafted > 0);
        assert_eq!(st.accepted, st.drafted, "k = {k}: {st:?}");
        assert_eq!(st.rollbacks, 0);
        assert_eq!(st.replayed, 0);
        // Full rounds of k + 1 tokens until the tail.
        assert_eq!(st.rounds as usize, n.div_ceil(k + 1), "k = {k}");
        assert_eq!(
            st.accepted_hist[k],
            st.verify_passes - u64::from(n % (k + 1) > 1)
        );
    }
}

#[test]
fn adversary_drafts_are_all_rejected() {
    let m = model(512);
    let v = m.vocab();
    let n = 201;
    let prompt = tokens(8, 12, v);
    let (reference, all) = plain(&m, &prompt, n);
    // Rolled back through the per-row states the CPU keeps (a copy), and by restore + replay.
    for (k, row_states) in (1..=4).flat_map(|k| [(k, true), (k, false)]) {
        let mut s = m.session().unwrap();
        s.set_row_states(row_states);
        s.append(&prompt).unwrap();
        let before = s.counters();
        let (out, st) = s
            .decode_speculative(n, k, &mut AdversaryDrafter::new(all.clone()))
            .unwrap();
        let what = format!("adversary, k = {k}, row states {row_states}");
        assert_eq!(out, all[prompt.len()..], "{what}");
        assert_same_as_plain(&s, &reference, &what);
        assert_eq!(delta(s.counters(), before), (n as u64, 0, n as u64));
        assert_eq!(st.accepted, 0, "{what}: {st:?}");
        assert_eq!(st.rejected(), st.drafted);
        // Every round but the last (no room for a draft) verifies and rolls back one token.
        assert_eq!(st.rounds, n as u64);
        assert_eq!(st.verify_passes, n as u64 - 1);
        assert_eq!(st.rollbacks, st.verify_passes);
        let replayed = if row_states { 0 } else { st.rollbacks };
        assert_eq!(st.replayed, replayed, "{what}");
        assert_eq!(st.accepted_hist[0], st.verify_passes);
    }
}

#[test]
fn partial_acceptance_rolls_back_exactly() {
    let m = model(512);
    let v = m.vocab();
    let n = 240;
    let prompt = tokens(9, 6, v);
    let (reference, all) = plain(&m, &prompt, n);
    for k in 1..=4 {
        let mut s = m.session().unwrap();
        s.append(&prompt).unwrap();
        let before = s.counters();
        let (out, st) = s
            .decode_speculative(
                n,
                k,
                &mut Scripted {
                    reference: all.clone(),
                },
            )
            .unwrap();
        assert_eq!(out, all[prompt.len()..], "k = {k}");
        assert_same_as_plain(&s, &reference, &format!("scripted, k = {k}"));
        assert_eq!(delta(s.counters(), before), (n as u64, 0, n as u64));
        for a in 0..=k {
            assert!(
                st.accepted_hist[a] > 0,
                "k = {k}: no round accepted {a}: {st:?}"
            );
        }
        assert!(st.rollbacks > 0 && st.rollbacks < st.verify_passes);
    }
}

#[test]
fn statistics_add_up() {
    let m = model(512);
    let v = m.vocab();
    let prompt = tokens(10, 8, v);
    let (_, all) = plain(&m, &prompt, 300);
    let mut s = m.session().unwrap();
    s.append(&prompt).unwrap();
    let mut spec = Speculator::new(
        Scripted {
            reference: all.clone(),
        },
        3,
    );
    let mut parts = SpecStats::default();
    let mut produced = Vec::new();
    for n in [1, 2, 37, 0, 100, 60] {
        let before = spec.stats;
        let out = spec.decode(&mut s, n).unwrap();
        assert_eq!(out.len(), n);
        produced.extend(out);
        let mut d = spec.stats;
        // The per-call difference, for the `+=` check below.
        for (x, y) in d.accepted_hist.iter_mut().zip(before.accepted_hist) {
            *x -= y;
        }
        d.rounds -= before.rounds;
        d.verify_passes -= before.verify_passes;
        d.drafted -= before.drafted;
        d.accepted -= before.accepted;
        d.bonus -= before.bonus;
        d.rollbacks -= before.rollbacks;
        d.replayed -= before.replayed;
        d.draft_steps -= before.draft_steps;
        assert_eq!(d.tokens(), n as u64);
        parts += d;
    }
    let st = spec.stats;
    assert_eq!(parts, st);
    assert_eq!(produced, all[prompt.len()..prompt.len() + 200]);
    assert_eq!(st.tokens(), 200);
    assert_eq!(st.accepted + st.rejected(), st.drafted);
    assert_eq!(st.bonus, st.rounds);
    assert_eq!(st.accepted_hist.iter().sum::<u64>(), st.verify_passes);
    assert_eq!(
        st.accepted_hist
            .iter()
            .enumerate()
            .map(|(a, c)| a as u64 * c)
            .sum::<u64>(),
        st.accepted
    );
    assert!(st.rollbacks <= st.verify_passes - st.accepted_hist[3]);
    // The CPU keeps per-row states: a rollback is a copy, nothing is replayed.
    assert_eq!(st.replayed, 0);
    assert_eq!(st.draft_steps, 0, "the scripted drafter runs no plan");
    assert!((st.mean_accepted() - st.accepted as f64 / st.verify_passes as f64).abs() < 1e-12);
    assert!((st.tokens_per_round() - 200.0 / st.rounds as f64).abs() < 1e-12);

    // The MTP drafter runs k + 1 draft steps per round.
    let mut s = m.session().unwrap();
    s.append_with_mtp(&prompt).unwrap();
    let (_, st) = s.decode_speculative(50, 2, &mut MtpDrafter).unwrap();
    assert_eq!(st.draft_steps, st.drafted + st.rounds);
    assert_eq!(st.replayed, 0);
}

#[test]
fn capsule_mid_run_restores_the_drafter_state() {
    let m = model(512);
    let v = m.vocab();
    let prompt = tokens(12, 21, v);
    let k = 3;
    let mut s = m.session().unwrap();
    s.append_with_mtp(&prompt).unwrap();
    let mut first = Recording {
        inner: MtpDrafter,
        drafts: Vec::new(),
    };
    s.decode_speculative(57, k, &mut first).unwrap();
    let cap = s.snapshot().unwrap();
    let at_snapshot = state_of(&s, false);
    for (name, bytes) in &at_snapshot {
        assert_eq!(&cap.region(name).unwrap(), bytes, "capsule region {name}");
    }
    // The drafter's K/V covers every committed position but the newest (the next round's
    // first draft writes that row), and `mtp.hidden` is set.
    let zero = |b: &[u8]| b.iter().all(|&x| x == 0);
    let row_bytes = m
        .compiled()
        .layout
        .find("mtp.0.key")
        .unwrap()
        .bytes_per_token();
    for name in ["mtp.0.key", "mtp.0.value"] {
        let kv = cap.region(name).unwrap();
        for (p, row) in kv.chunks(row_bytes).enumerate().take(cap.pos() - 1) {
            assert!(!zero(row), "{name}: row {p} of {} never written", cap.pos());
        }
    }
    assert!(!zero(&cap.region("mtp.hidden").unwrap()));

    let mut rec = Recording {
        inner: MtpDrafter,
        drafts: Vec::new(),
    };
    let (cont, st) = s.decode_speculative(90, k, &mut rec).unwrap();
    let logits = s.last_logits().to_vec();
    let end = state_of(&s, false);

    // A fork from the capsule, and the original session restored after dirtying it.
    let mut dirty = m.session().unwrap();
    dirty.append_with_mtp(&tokens(13, 30, v)).unwrap();
    dirty.decode_speculative(20, 4, &mut MtpDrafter).unwrap();
    let forked = m.fork(&cap).unwrap();
    // Restored, a round run (its first draft writes the drafter's row at the position
    // before), restored again: the second restore holds the capsule's rows but that one.
    let mut again = m.fork(&cap).unwrap();
    again.decode_speculative(5, k, &mut MtpDrafter).unwrap();
    again.restore(&cap).unwrap();
    s.reset().unwrap();
    s.append(&tokens(14, 40, v)).unwrap();
    s.restore(&cap).unwrap();
    dirty.restore(&cap).unwrap();
    for (what, mut t) in [
        ("fork", forked),
        ("restored", s),
        ("restored over another run", dirty),
        ("restored over its own continuation", again),
    ] {
        assert!(
            state_of(&t, false) == at_snapshot,
            "{what}: state bytes differ from the capsule"
        );
        let mut rec2 = Recording {
            inner: MtpDrafter,
            drafts: Vec::new(),
        };
        let (cont2, st2) = t.decode_speculative(90, k, &mut rec2).unwrap();
        assert_eq!(cont2, cont, "{what}: continuation");
        // Same drafts: the drafter's K/V and hidden came back with the capsule.
        assert_eq!(rec2.drafts, rec.drafts, "{what}: drafts");
        assert_eq!(st2, st, "{what}: statistics");
        assert_eq!(t.last_logits(), &logits[..], "{what}: logits");
        assert!(
            state_of(&t, false) == end,
            "{what}: state bytes after the continuation"
        );
    }
}

#[test]
fn speculation_runs_up_to_max_seq() {
    let m = model(48);
    let v = m.vocab();
    let prompt = tokens(15, 5, v);
    let n = 48 - prompt.len();
    let (reference, all) = plain(&m, &prompt, n);
    for k in 1..=4 {
        let mut s = m.session().unwrap();
        s.append_with_mtp(&prompt).unwrap();
        let before = s.counters();
        let (out, _) = s.decode_speculative(n, k, &mut MtpDrafter).unwrap();
        assert_eq!(out, all[prompt.len()..]);
        assert_same_as_plain(&s, &reference, &format!("to max_seq, k = {k}"));
        assert_eq!(delta(s.counters(), before), (n as u64, 0, n as u64));
        let mut o = m.session().unwrap();
        o.append(&prompt).unwrap();
        let (out, st) = o
            .decode_speculative(n, k, &mut OracleDrafter::new(all.clone()))
            .unwrap();
        assert_eq!(out, all[prompt.len()..]);
        assert_eq!(st.accepted, st.drafted);
        let e = s.decode_speculative(1, k, &mut MtpDrafter).unwrap_err();
        assert!(matches!(e, Error::Input(_)), "{e}");
    }
}

/// A drafter that misbehaves after running the MTP head: proposes `token`, `k + extra` times.
struct Broken {
    token: u32,
    extra: usize,
}

impl Drafter for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> flashrt_runtime::Result<Vec<u32>> {
        MtpDrafter.draft(cx, k)?;
        Ok(vec![self.token; k + self.extra])
    }
}

/// A drafter that tries to rewrite the drafter row of an older committed position.
struct Rewriter;

impl Drafter for Rewriter {
    fn name(&self) -> &str {
        "rewriter"
    }
    fn draft(&mut self, cx: &mut DraftCx<'_>, _k: usize) -> flashrt_runtime::Result<Vec<u32>> {
        let p = cx.pos();
        cx.mtp_step(1, p - 2)?;
        Ok(Vec::new())
    }
}

#[test]
fn bad_requests_and_drafters_are_errors_that_leave_the_session_intact() {
    let m = model(512);
    let v = m.vocab();
    let prompt = tokens(16, 10, v);
    let (reference, all) = plain(&m, &prompt, 30);
    let mut s = m.session().unwrap();
    s.append_with_mtp(&prompt).unwrap();
    let e = s.decode_speculative(5, 5, &mut MtpDrafter).unwrap_err();
    assert!(matches!(e, Error::Input(_)), "{e}");
    let state = state_of(&s, true);
    for (token, extra) in [(v as u32, 0), (3, 1)] {
        // Out of range, or one draft too many.
        let e = s
            .decode_speculative(5, 2, &mut Broken { token, extra })
            .unwrap_err();
        assert!(matches!(e, Error::Input(_)), "{e}");
        assert!(
            state_of(&s, true) == state,
            "a rejected drafter changed the target state"
        );
        assert_eq!(s.pos(), prompt.len());
    }
    // A drafter may not overwrite the drafter rows of committed positions.
    let state_of_all = state_of(&s, false);
    let e = s.decode_speculative(5, 2, &mut Rewriter).unwrap_err();
    assert!(matches!(e, Error::Input(_)), "{e}");
    assert!(
        state_of(&s, false) == state_of_all,
        "a refused MTP step changed the state"
    );
    let (out, _) = s.decode_speculative(30, 2, &mut MtpDrafter).unwrap();
    assert_eq!(out, all[prompt.len()..]);
    assert_same_as_plain(&s, &reference, "after drafter errors");

    // The MTP drafter needs an MTP head.
    let f = load("qwen35-public", &[4, 16]);
    let mut t = f.session().unwrap();
    t.append(&tokens(17, 5, f.vocab())).unwrap();
    let e = t.decode_speculative(3, 1, &mut MtpDrafter).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert!(matches!(
        t.append_with_mtp(&[1]).unwrap_err(),
        Error::Unsupported(_)
    ));
    // Zero tokens: nothing happens.
    let (out, st) = s.decode_speculative(0, 4, &mut MtpDrafter).unwrap();
    assert!(out.is_empty());
    assert_eq!(st, SpecStats::default());
}

#[test]
fn rollback_is_exact_for_conv_and_mamba2_state_too() {
    // The fixture models have no MTP head: verification runs through prefill plans.
    for name in FIXTURES {
        let m = load(name, &[4, 16]);
        let v = m.vocab();
        let prompt = tokens(18, 7, v);
        let n = 120;
        let (reference, all) = plain(&m, &prompt, n);
        for (k, row_states) in [1, 3, 4].into_iter().flat_map(|k| [(k, true), (k, false)]) {
            let mut s = m.session().unwrap();
            s.set_row_states(row_states);
            s.append(&prompt).unwrap();
            let before = s.counters();
            let (out, st) = s
                .decode_speculative(
                    n,
                    k,
                    &mut Scripted {
                        reference: all.clone(),
                    },
                )
                .unwrap();
            let what = format!("{name}, k = {k}, row states {row_states}");
            assert_eq!(out, all[prompt.len()..], "{what}");
            assert_same_as_plain(&s, &reference, &what);
            assert_eq!(delta(s.counters(), before), (n as u64, 0, n as u64));
            assert!(st.rollbacks > 0, "{name}");
            assert_eq!(st.replayed == 0, row_states, "{what}: {st:?}");
        }
    }
}

/// Single rounds (what a server streams round by round) commit what plain greedy decoding
/// commits, 1 ..= k + 1 tokens each, at every k, and leave the session as plain decoding does.
#[test]
fn single_rounds_equal_plain_greedy() {
    let m = model(512);
    let v = m.vocab();
    let prompt = tokens(9, 21, v);
    let n = 60;
    let (reference, all) = plain(&m, &prompt, n);
    let mut s = m.session().unwrap();
    s.append_with_mtp(&prompt).unwrap();
    let mut out = Vec::new();
    let mut i = 0usize;
    while out.len() < n {
        let k = (i % 5).min(n - out.len() - 1);
        let (toks, stats) = s.speculative_round(k, &mut MtpDrafter).unwrap();
        assert!(
            !toks.is_empty() && toks.len() <= k + 1,
            "round {i}: {toks:?}"
        );
        assert_eq!(stats.rounds, 1);
        assert_eq!(stats.tokens(), toks.len() as u64);
        out.extend(toks);
        i += 1;
    }
    assert_eq!(out, all[prompt.len()..]);
    assert_same_as_plain(&s, &reference, "single rounds");
    assert!(
        s.speculative_round(5, &mut MtpDrafter).is_err(),
        "k above MAX_DRAFT"
    );
}
