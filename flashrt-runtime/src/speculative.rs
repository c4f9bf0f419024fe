//! Speculative greedy decoding with exact rollback of recurrent, conv and MTP state.
//!
//! A *round* at a committed boundary (position `P`, history `t_0 .. t_{P-1}`, last logits
//! `L_{P-1}`) does what plain greedy decoding does for several tokens at once:
//!
//! 1. `x = argmax(L_{P-1})`: the target's own next token (the *bonus* of the previous round's
//!    verification, or the first token after a prefill) — exactly what
//!    [`Session::decode_greedy`] would feed next.
//! 2. Save the rollback point: the non-KV state regions ([`RegionSet::NonKv`]: conv,
//!    recurrent, `mtp.hidden`), a fixed number of bytes whatever `P` is — or, where the
//!    verify pass will keep each row's states (step 6), only `mtp.hidden`
//!    ([`RegionSet::Hidden`]), to undo a drafter that fails.
//! 3. A [`Drafter`] proposes up to `k <= MAX_DRAFT` tokens `d_1 .. d_k` for positions
//!    `P+1 .. P+k` ([`MtpDrafter`]: `k + 1` runs of the [`Phase::MtpDraft`] plan).
//! 4. One target pass over the `k + 1` rows `[x, d_1 .. d_k]` at position `P` with the
//!    [`Phase::Verify`] plan (`Verify { k }`, compiled for every model whose largest bucket
//!    holds `k + 1` rows; otherwise the smallest prefill bucket that holds them — same ops,
//!    so same result).
//!    Row `i`'s logits are `L_{P+i}`, what plain decoding would have after feeding row `i`.
//! 5. Accept the longest prefix with `d_{i+1} == argmax(L_{P+i})`; call its length `a`. The
//!    round commits `[x, d_1 .. d_a]` (`a + 1` tokens) and its last logits are `L_{P+a}`, whose
//!    argmax is the next round's `x` (this round's bonus token).
//! 6. If `a == k`, the verify pass left the state at `P + k + 1` = the committed boundary:
//!    nothing to undo. If `a < k` (a *rollback*): where the backend kept every non-KV
//!    region's value after each row of the verify pass ([`DeviceSession::keep_row_states`],
//!    asked for before step 4; the CPU reference keeps them), copy back the values after row
//!    `a` ([`DeviceSession::rollback_to_row`]) — a rejected round then costs the verify pass
//!    and a copy; otherwise (or with [`Session::set_row_states`]`(false)`) restore the saved
//!    non-KV regions and replay the `a + 1` committed tokens in one pass (`Decode` for one
//!    row, else `Verify { a }`). K/V rows past the new boundary are dead: every later step
//!    overwrites a row before any attention reads it, so they need no restore.
//!
//! Afterwards the session is exactly what plain decoding of the same tokens leaves: token
//! history, position, counters (one decode step per committed token), one kept logits row,
//! no pending token, and every target state region byte for byte (on the CPU reference,
//! whose ops are chunking-invariant, the verify and replay rows equal decode steps bit for
//! bit). Only the drafter's own K/V regions (`mtp.{j}.key/value`) differ from a session that
//! never drafted. Speculative decoding is greedy only; the sampler is not consulted.
//!
//! That equality needs row-invariant numerics: a verify row must compute exactly what a
//! decode step computes. The CPU reference guarantees it; the CUDA backend does not yet (its
//! `k + 1`-row GEMMs and attention may round differently from the 1-row ones), so on a GPU a
//! near-tie in the logits can flip a token (seen with random 27B weights, whose logits are
//! nearly flat).
//!
//! # The drafter's position convention (MTP)
//!
//! The MTP row at position `p` takes the token `t_{p+1}` and a hidden input, writes MTP K/V
//! row `p` (RoPE at `p`), and predicts `t_{p+2}` — vLLM's convention for Qwen3.5/3.6 and
//! DeepSeek MTP. The hidden input is the target's final-normed hidden `h_p` where the target
//! left it in `mtp.hidden` (the last row of every target step), else the drafter's own output
//! hidden of row `p - 1` (chained drafting). A round at `P` runs `k + 1` draft steps at
//! positions `P-1 .. P+k-1` with tokens `x, d_1 .. d_k`: the first uses `h_{P-1}`, the others
//! chain. The last step's draft is discarded; it exists so that MTP K/V covers position
//! `P+k-1` when every draft is accepted.
//!
//! Invariant at every committed boundary `P` reached through [`Session::append_with_mtp`] and
//! speculative rounds: MTP K/V rows `0 .. P-2` hold entries of committed tokens (from `h_p`
//! for prompt positions and each round's first position, chained hiddens for accepted
//! drafts), row `P-1` and beyond are dead, and `mtp.hidden = h_{P-1}` as after plain
//! decoding. The whole drafter state is in state regions (the [`MtpDrafter`] holds nothing),
//! so a capsule taken at a committed boundary carries it and restores it exactly.
//!
//! vLLM instead re-runs the MTP layer over every accepted position with the target's hidden
//! of each verified row, overwriting the chained entries. The plans here keep only the last
//! row's hidden (`StoreLastRow`), so accepted drafts keep their chained entries; this changes
//! what the drafter proposes (acceptance), never the output.
//!
//! Positions committed without the MTP drafter ([`Session::append`], plain decoding, rounds
//! of other drafters) leave the MTP rows as they were (zeros in a fresh session): the target's per-row hidden is only kept for the last row of a step, so
//! they cannot be filled in afterwards. Drafts then still verify exactly; only acceptance
//! suffers. [`Session::append_with_mtp`] feeds a prompt token by token (one decode step and
//! one draft step per token) to cover it; a multi-row MTP pass fed from every row's hidden
//! would make that one pass (a plan op that keeps all rows of the final hidden).
//!
//! # Rollback cost (CPU reference)
//!
//! `examples/speculative_costs.rs` measures the pieces (demo-mtp shape, one thread, position
//! 512, medians; a shared 2-core VM, so ±20%): decode step 1.6 ms, MTP draft step 0.24 ms,
//! verify passes of 2 / 3 / 4 / 5 rows 8.0 / 5.3 / 5.8 / 6.9 ms (the CPU has almost no
//! multi-row gain; the 2-row pass is an outlier of the CPU linear kernel), saving or restoring
//! the 421 KiB of non-KV state 9 us each (= a memcpy of the same bytes; a full snapshot at
//! 512 is 46 us). So a rollback is a restore at the copy floor plus the replay of `a + 1`
//! rows, and the replay dominates: `a + 1` decode steps' worth. Per-row checkpoints
//! (emulated: `k + 1` single-row steps with a non-KV save after each, rollback = one restore)
//! cost less on this CPU whenever a draft is rejected — 2.2 / 3.2 / 4.2 / 5.2 decode steps
//! per round for k = 1..4 against 4.2 .. 8.9 with save + replay — but are not one pass, and
//! the pass is what a GPU makes cheap: there a `k + 1`-row verify costs about one decode step,
//! so the replay would double a rejected round. The CPU reference now keeps each row's state
//! inside the one verify pass (its recurrent ops step row by row and copy the state after
//! each, bit for bit what the whole pass computes), so a rollback there is one copy. On CUDA
//! the fused Gated DeltaNet decode kernel writes them with `CudaOptions::row_states` (on by
//! default, `FLASHRT_ROW_STATES=0` off): on the H200 at the 27B shape an all-rejected round
//! then costs its verify pass (1.25 / 1.74 / 2.01 / 2.28 decode steps for k = 1..4, against
//! 2.28 / 2.76 / 3.03 / 3.30 with save + replay; benches/RESULTS.md). Save + replay stays
//! the fallback wherever a backend keeps nothing.
//!
//! On an H200 with the Qwen3.6-27B shape (bf16, position 512) the same example measured a
//! decode step at 16.6 ms, verify passes for k = 1..4 at 1.01 / 1.03 / 1.05 / 1.06 x that, an
//! MTP step at 0.95 ms, and the 147 MiB non-KV save / restore at 1.34 / 0.63 ms against an
//! 83 us copy floor; a rejected round with save + replay costs 2.2 x a decode step, one with
//! in-pass checkpoints would cost about 1.05 x.
//!
//! # API
//!
//! * [`Session::decode_speculative`]`(n, k, &mut dyn Drafter) -> (tokens, SpecStats)`: `n`
//!   tokens, identical to [`Session::decode_greedy`]`(n)`.
//! * [`Speculator`]: a drafter, `k`, and statistics accumulated over calls.
//! * [`Session::append_with_mtp`]: feed a prompt so the MTP drafter's K/V covers it.
//! * Drafters: [`MtpDrafter`] (the model's MTP head), [`OracleDrafter`] (proposes a given
//!   reference continuation: every draft accepted when the reference is the greedy output),
//!   [`AdversaryDrafter`] (proposes a token other than the reference's: every draft rejected).

use crate::backend::{DeviceSession, RegionSet, StepLogits};
use crate::error::{Error, Result};
use crate::session::{Session, argmax};
use flashrt_ir::lower::MAX_DRAFT;
use flashrt_ir::{Compiled, MixerIr, Phase};
use std::ops::AddAssign;

/// Proposes draft tokens for a speculative round.
pub trait Drafter {
    /// Short name for reports.
    fn name(&self) -> &str;

    /// Propose at most `k` tokens for positions `cx.pos() + 1 ..`, i.e. to follow
    /// `cx.next_token()` (the target's next token, at position `cx.pos()`). Fewer (even none)
    /// is allowed. The drafter may run the MTP draft plan through `cx`; it must not assume
    /// anything about rows it wrote at positions `>= cx.pos()` in a later round.
    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> Result<Vec<u32>>;
}

/// What a drafter sees of the session during a round.
pub struct DraftCx<'a> {
    dev: &'a mut dyn DeviceSession,
    compiled: &'a Compiled,
    history: &'a [u32],
    next: u32,
    steps: u64,
}

impl DraftCx<'_> {
    /// The committed boundary `P` (tokens fed so far).
    pub fn pos(&self) -> usize {
        self.history.len()
    }
    /// Committed tokens `[0, P)`.
    pub fn history(&self) -> &[u32] {
        self.history
    }
    /// The target's next token `x = argmax(L_{P-1})`, to be fed at position `P`.
    pub fn next_token(&self) -> u32 {
        self.next
    }
    pub fn compiled(&self) -> &Compiled {
        self.compiled
    }
    pub fn vocab(&self) -> usize {
        self.compiled.ir.vocab
    }
    /// One run of the [`Phase::MtpDraft`] plan: a row at position `pos` with `token`, whose
    /// hidden input is `mtp.hidden`; writes MTP K/V row `pos`, replaces `mtp.hidden` with its
    /// own output hidden, and returns its draft logits (`[vocab]`). Rows of committed
    /// positions are the drafter's state: `pos` must be at least `P - 1`.
    pub fn mtp_step(&mut self, token: u32, pos: usize) -> Result<Vec<f32>> {
        if self.compiled.plan(Phase::MtpDraft).is_none() {
            return Err(Error::Unsupported(format!(
                "model {} has no MTP head",
                self.compiled.ir.name
            )));
        }
        if pos + 1 < self.pos() {
            return Err(Error::Input(format!(
                "MTP step at position {pos} would overwrite a committed drafter row (boundary {})",
                self.pos()
            )));
        }
        let logits = self
            .dev
            .step_read(Phase::MtpDraft, &[token], pos, StepLogits::All)?;
        self.steps += 1;
        Ok(logits)
    }
}

/// Counts of what speculative decoding did. Tokens committed = `accepted + bonus`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Rounds (one target pass each, plus a replay after a rejection).
    pub rounds: u64,
    /// Rounds that verified at least one draft (`Verify { k }` passes).
    pub verify_passes: u64,
    /// Draft tokens verified.
    pub drafted: u64,
    /// Drafts accepted (equal to the target's greedy choice, as a prefix).
    pub accepted: u64,
    /// Tokens the target chose itself: one per round (the argmax of the previous logits,
    /// i.e. the previous verification's bonus token).
    pub bonus: u64,
    /// Rounds with a rejected tail: non-KV state restored and committed tokens replayed.
    pub rollbacks: u64,
    /// Tokens re-fed by rollbacks.
    pub replayed: u64,
    /// Drafter plan runs (MTP steps).
    pub draft_steps: u64,
    /// Verify passes by number of accepted drafts (index `a`, `0 ..= MAX_DRAFT`).
    pub accepted_hist: [u64; MAX_DRAFT + 1],
}

impl SpecStats {
    /// Tokens committed.
    pub fn tokens(&self) -> u64 {
        self.accepted + self.bonus
    }
    /// Drafts rejected.
    pub fn rejected(&self) -> u64 {
        self.drafted - self.accepted
    }
    /// `accepted / drafted` (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }
    /// Mean accepted drafts per verify pass.
    pub fn mean_accepted(&self) -> f64 {
        ratio(self.accepted, self.verify_passes)
    }
    /// Mean tokens committed per round (target pass).
    pub fn tokens_per_round(&self) -> f64 {
        ratio(self.tokens(), self.rounds)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

impl AddAssign for SpecStats {
    fn add_assign(&mut self, o: SpecStats) {
        self.rounds += o.rounds;
        self.verify_passes += o.verify_passes;
        self.drafted += o.drafted;
        self.accepted += o.accepted;
        self.bonus += o.bonus;
        self.rollbacks += o.rollbacks;
        self.replayed += o.replayed;
        self.draft_steps += o.draft_steps;
        for (a, b) in self.accepted_hist.iter_mut().zip(o.accepted_hist) {
            *a += b;
        }
    }
}

/// The model's MTP head as drafter (see the module docs for its position convention). It
/// holds no state of its own: everything lives in the session's state regions.
#[derive(Clone, Copy, Debug, Default)]
pub struct MtpDrafter;

/// The MTP head must exist and hold only attention (its K/V rows past a boundary are dead;
/// a recurrent MTP layer would need its own rollback).
fn check_mtp(compiled: &Compiled) -> Result<()> {
    let ir = &compiled.ir;
    let Some(mtp) = &ir.mtp else {
        return Err(Error::Unsupported(format!(
            "model {} has no MTP head",
            ir.name
        )));
    };
    if let Some(l) = mtp.layers.iter().find(|l| {
        l.mixer
            .as_ref()
            .is_some_and(|m| !matches!(m, MixerIr::Attention(_)))
    }) {
        return Err(Error::Unsupported(format!(
            "MTP layer kind `{}` of model {} has recurrent or conv state; the MTP drafter needs attention-only MTP layers",
            l.kind, ir.name
        )));
    }
    Ok(())
}

impl Drafter for MtpDrafter {
    fn name(&self) -> &str {
        "mtp"
    }

    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> Result<Vec<u32>> {
        check_mtp(cx.compiled())?;
        let p = cx.pos();
        if p == 0 {
            return Err(Error::Input(
                "the MTP drafter needs at least one committed token".into(),
            ));
        }
        let mut token = cx.next_token();
        let mut drafts = Vec::with_capacity(k);
        // k + 1 steps at positions P-1 .. P+k-1; the last one only covers row P+k-1.
        for j in 0..=k {
            let logits = cx.mtp_step(token, p - 1 + j)?;
            if j == k {
                break;
            }
            token = argmax(&logits).ok_or_else(|| Error::Backend {
                op: "mtp_draft".into(),
                msg: "draft logits have no finite value".into(),
            })?;
            drafts.push(token);
        }
        Ok(drafts)
    }
}

/// Proposes a known continuation: `reference` is the whole expected token sequence from
/// position 0 (prompt + continuation); at boundary `P` it proposes `reference[P+1 ..]`.
/// With the greedy output as reference, every draft is accepted.
#[derive(Clone, Debug)]
pub struct OracleDrafter {
    pub reference: Vec<u32>,
}

impl OracleDrafter {
    pub fn new(reference: Vec<u32>) -> Self {
        OracleDrafter { reference }
    }
}

fn reference_window(reference: &[u32], pos: usize, k: usize) -> &[u32] {
    let start = (pos + 1).min(reference.len());
    &reference[start..(start + k).min(reference.len())]
}

impl Drafter for OracleDrafter {
    fn name(&self) -> &str {
        "oracle"
    }
    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> Result<Vec<u32>> {
        Ok(reference_window(&self.reference, cx.pos(), k).to_vec())
    }
}

/// Proposes, at every position, a token other than the reference's (`(t + 1) % vocab`):
/// with the greedy output as reference, every draft is rejected.
#[derive(Clone, Debug)]
pub struct AdversaryDrafter {
    pub reference: Vec<u32>,
}

impl AdversaryDrafter {
    pub fn new(reference: Vec<u32>) -> Self {
        AdversaryDrafter { reference }
    }
}

impl Drafter for AdversaryDrafter {
    fn name(&self) -> &str {
        "adversary"
    }
    fn draft(&mut self, cx: &mut DraftCx<'_>, k: usize) -> Result<Vec<u32>> {
        let vocab = cx.vocab() as u32;
        Ok(reference_window(&self.reference, cx.pos(), k)
            .iter()
            .map(|&t| (t + 1) % vocab)
            .collect())
    }
}

/// A drafter, a draft length and statistics accumulated over every call.
#[derive(Clone, Debug, Default)]
pub struct Speculator<D: Drafter = MtpDrafter> {
    pub drafter: D,
    /// Drafts per round (`<= MAX_DRAFT`).
    pub k: usize,
    pub stats: SpecStats,
}

impl Speculator<MtpDrafter> {
    /// The MTP head drafting `k` tokens per round.
    pub fn mtp(k: usize) -> Self {
        Speculator::new(MtpDrafter, k)
    }
}

impl<D: Drafter> Speculator<D> {
    pub fn new(drafter: D, k: usize) -> Self {
        Speculator {
            drafter,
            k,
            stats: SpecStats::default(),
        }
    }

    /// [`Session::decode_speculative`] with this drafter; the statistics accumulate in
    /// `self.stats` (also for the rounds completed before an error).
    pub fn decode(&mut self, session: &mut Session, n: usize) -> Result<Vec<u32>> {
        decode(session, n, self.k, &mut self.drafter, &mut self.stats)
    }
}

/// The plan that runs `rows` (`2 ..= MAX_DRAFT + 1`) target rows: `Verify { rows - 1 }`, else
/// the smallest prefill bucket that holds them.
fn multi_row_phase(compiled: &Compiled, rows: usize) -> Option<Phase> {
    let verify = Phase::Verify { k: rows - 1 };
    if compiled.plan(verify).is_some() {
        return Some(verify);
    }
    compiled
        .plans
        .iter()
        .filter_map(|p| match p.phase {
            Phase::Prefill { bucket } if bucket >= rows => Some(bucket),
            _ => None,
        })
        .min()
        .map(|bucket| Phase::Prefill { bucket })
}

fn target_phase(compiled: &Compiled, rows: usize) -> Phase {
    if rows == 1 {
        Phase::Decode
    } else {
        multi_row_phase(compiled, rows).expect("checked before the first round")
    }
}

impl Session {
    /// Greedy decoding of `n` tokens with speculation: rounds of up to `k` drafts from
    /// `drafter`, verified in one target pass each (see [`crate::speculative`]). Returns the
    /// tokens — identical to [`Session::decode_greedy`]`(n)` — and what the rounds did; the
    /// session ends exactly as plain decoding would leave it (drafter K/V aside).
    ///
    /// On an error the tokens of completed rounds stay committed; a failure inside a target
    /// pass poisons the session (reset or restore it).
    pub fn decode_speculative(
        &mut self,
        n: usize,
        k: usize,
        drafter: &mut dyn Drafter,
    ) -> Result<(Vec<u32>, SpecStats)> {
        let mut stats = SpecStats::default();
        let out = decode(self, n, k, drafter, &mut stats)?;
        Ok((out, stats))
    }

    /// ONE speculative round at the session's boundary with at most `k` drafts: commits the
    /// target's own next token and the drafts it accepts (1 ..= `k + 1` tokens, what plain
    /// greedy decoding would commit next), as [`Session::decode_speculative`] does round by
    /// round. For callers that hand tokens out as each round ends (a server streaming).
    pub fn speculative_round(
        &mut self,
        k: usize,
        drafter: &mut dyn Drafter,
    ) -> Result<(Vec<u32>, SpecStats)> {
        let mut stats = SpecStats::default();
        let compiled = self.model().compiled().clone();
        check_plans(&compiled, k)?;
        let out = round(self, &compiled, k, drafter, &mut stats)?;
        Ok((out, stats))
    }

    /// Feed `tokens` one at a time, covering each position for the MTP drafter: before token
    /// `t_P` is fed, one MTP step at position `P - 1` with `(t_P, h_{P-1})` (skipped at
    /// position 0), then one decode step. The target ends exactly as after
    /// [`Session::append`] (bitwise on the CPU reference); the counters record one decode
    /// step per token. Costs one decode step and one draft step per token.
    pub fn append_with_mtp(&mut self, tokens: &[u32]) -> Result<()> {
        let compiled = self.model().compiled().clone();
        check_mtp(&compiled)?;
        for &t in tokens {
            if self.pos() > 0 {
                if t as usize >= compiled.ir.vocab {
                    return Err(Error::Input(format!(
                        "token id {t} is out of range (vocab {})",
                        compiled.ir.vocab
                    )));
                }
                let p = self.pos();
                let (dev, _, _) = self.spec_parts()?;
                if let Err(e) = dev.step(Phase::MtpDraft, &[t], p - 1) {
                    self.spec_poison();
                    return Err(e);
                }
            }
            self.append(&[t])?;
        }
        Ok(())
    }
}

fn decode(
    s: &mut Session,
    n: usize,
    k: usize,
    drafter: &mut dyn Drafter,
    stats: &mut SpecStats,
) -> Result<Vec<u32>> {
    let compiled = s.model().compiled().clone();
    check_plans(&compiled, k)?;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let committed = round(s, &compiled, k.min(n - out.len() - 1), drafter, stats)?;
        out.extend_from_slice(&committed);
    }
    Ok(out)
}

/// `k` drafts per round are allowed and every row count a round needs has a plan.
fn check_plans(compiled: &Compiled, k: usize) -> Result<()> {
    if k > MAX_DRAFT {
        return Err(Error::Input(format!(
            "{k} drafts per round requested; at most {MAX_DRAFT} (the verify plans compiled)"
        )));
    }
    if let Some(rows) = (2..=k + 1).find(|&r| multi_row_phase(compiled, r).is_none()) {
        return Err(Error::Unsupported(format!(
            "model {} has no plan for {rows} rows (no verify plans and no prefill bucket that large)",
            compiled.ir.name
        )));
    }
    Ok(())
}

/// One round at the session's boundary with at most `k` drafts; returns the committed tokens.
fn round(
    s: &mut Session,
    compiled: &Compiled,
    k: usize,
    drafter: &mut dyn Drafter,
    stats: &mut SpecStats,
) -> Result<Vec<u32>> {
    let vocab = compiled.ir.vocab;
    let max_seq = compiled.layout.max_seq;
    let x = s.argmax_next()?;
    let pos = s.pos();
    if pos >= max_seq {
        return Err(Error::Input(format!(
            "position {pos} + 1 tokens exceeds max_seq {max_seq}"
        )));
    }
    // The verify pass writes rows pos ..= pos + k.
    let k = k.min(max_seq - pos - 1);
    let (dev, history, row_states) = s.spec_parts()?;

    // Rollback point, taken before the drafter moves `mtp.hidden`: the non-KV regions, or,
    // where the verify pass will keep each row's states, only `mtp.hidden` (to undo a drafter
    // that fails; everything else is restored from the kept rows).
    let saved_set = if row_states && k > 0 && dev.can_keep_row_states() {
        RegionSet::Hidden
    } else {
        RegionSet::NonKv
    };
    let saved = dev.save(pos, saved_set)?;
    let mut cx = DraftCx {
        dev,
        compiled,
        history,
        next: x,
        steps: 0,
    };
    let drafted = drafter.draft(&mut cx, k);
    stats.draft_steps += cx.steps;
    let dev = cx.dev;
    let drafts = match drafted.and_then(|d| check_drafts(d, k, vocab, drafter.name())) {
        Ok(d) => d,
        Err(e) => {
            // Undo what the drafter did to `mtp.hidden`; its K/V rows from `pos - 1` on are dead.
            if dev.restore(&*saved, saved_set, 0).is_err() {
                s.spec_poison();
            }
            return Err(e);
        }
    };
    let kk = drafts.len();
    let mut fed = Vec::with_capacity(kk + 1);
    fed.push(x);
    fed.extend_from_slice(&drafts);

    // The state after each verified row, where the backend keeps it: a rejected tail is then
    // undone by a copy instead of a replay.
    let kept = saved_set == RegionSet::Hidden && kk > 0 && dev.keep_row_states();
    let verified = dev.step_read(target_phase(compiled, kk + 1), &fed, pos, StepLogits::All);
    let logits = match verified {
        Ok(l) => l,
        Err(e) => {
            s.spec_poison();
            return Err(e);
        }
    };
    let row = |l: &[f32], i: usize| l[i * vocab..(i + 1) * vocab].to_vec();
    let a = (0..kk)
        .take_while(|&i| argmax(&logits[i * vocab..(i + 1) * vocab]) == Some(drafts[i]))
        .count();
    // Rejected tail with kept row states: every non-KV region back to its state after the
    // last accepted row (the K/V rows past it are dead by position); that row's logits are the
    // verify pass's. A backend that finds nothing kept (another session stepped in between)
    // leaves the state as it was: the replay below then needs the non-KV regions, which only
    // `mtp.hidden` was saved of, and fails without touching the state (the session is then
    // poisoned, not wrong).
    let rolled = a < kk
        && kept
        && match dev.rollback_to_row(a) {
            Ok(()) => true,
            Err(Error::Unsupported(_)) => false,
            Err(e) => {
                s.spec_poison();
                return Err(e);
            }
        };
    let last = if rolled {
        stats.rollbacks += 1;
        row(&logits, a)
    } else if a < kk {
        // Rejected tail: back to the boundary's non-KV state, then replay the committed rows.
        let replayed = dev.restore(&*saved, RegionSet::NonKv, 0).and_then(|()| {
            dev.step_read(
                target_phase(compiled, a + 1),
                &fed[..=a],
                pos,
                StepLogits::All,
            )
        });
        match replayed {
            Ok(l) => {
                stats.rollbacks += 1;
                stats.replayed += a as u64 + 1;
                row(&l, a)
            }
            Err(e) => {
                s.spec_poison();
                return Err(e);
            }
        }
    } else {
        row(&logits, kk)
    };
    stats.rounds += 1;
    stats.bonus += 1;
    if kk > 0 {
        stats.verify_passes += 1;
        stats.drafted += kk as u64;
        stats.accepted += a as u64;
        stats.accepted_hist[a] += 1;
    }
    let committed = fed[..=a].to_vec();
    s.spec_commit(&committed, last);
    Ok(committed)
}

fn check_drafts(d: Vec<u32>, k: usize, vocab: usize, name: &str) -> Result<Vec<u32>> {
    if d.len() > k {
        return Err(Error::Input(format!(
            "drafter `{name}` proposed {} tokens, at most {k} allowed",
            d.len()
        )));
    }
    if let Some(&t) = d.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Input(format!(
            "drafter `{name}` proposed token id {t}, out of range (vocab {vocab})"
        )));
    }
    Ok(d)
}
