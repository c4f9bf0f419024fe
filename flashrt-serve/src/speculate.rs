//! How many drafts the server's speculative decoding proposes per round (MTP head, greedy
//! requests): measured, not assumed. A round of `k` drafts costs `k + 1` drafter steps, one
//! `k + 1`-row verify pass and, when a draft is rejected, a replay of the accepted rows; it
//! pays off only if enough drafts are accepted. Random weights accept almost nothing; a
//! trained model's MTP head accepts most. So the tuner keeps the wall time per committed
//! token of plain decode steps and of speculative rounds at each `k` (exponential moving
//! averages) and moves `k` one step at a time: down when rounds at `k` cost more per token
//! than plain steps, up while they cost clearly less. At `k = 0` decoding is plain; every
//! [`PROBE_EVERY`] plain tokens one round at `k = 1` is tried again, in case the text got
//! more predictable.

use flashrt_runtime::ir::lower::MAX_DRAFT;

/// Plain tokens between two probing rounds while speculation is off.
pub const PROBE_EVERY: u64 = 64;
/// Weight of the newest sample in the moving averages.
const ALPHA: f64 = 0.25;
/// Rounds must cost below this fraction of a plain token to earn another draft.
const GROW_BELOW: f64 = 0.9;

#[derive(Clone, Copy, Debug, Default)]
struct Ema(Option<f64>);

impl Ema {
    fn add(&mut self, x: f64) {
        self.0 = Some(match self.0 {
            None => x,
            Some(m) => m + ALPHA * (x - m),
        });
    }
}

/// The draft length of the server's speculative rounds (see the module docs).
#[derive(Clone, Debug)]
pub struct SpecTuner {
    max_k: usize,
    k: usize,
    plain: Ema,
    rounds: [Ema; MAX_DRAFT + 1],
    plain_since_probe: u64,
}

impl SpecTuner {
    /// Starting at `max_k` drafts per round (clamped to the verify plans compiled).
    pub fn new(max_k: usize) -> SpecTuner {
        let max_k = max_k.min(MAX_DRAFT);
        SpecTuner {
            max_k,
            k: max_k,
            plain: Ema::default(),
            rounds: [Ema::default(); MAX_DRAFT + 1],
            plain_since_probe: 0,
        }
    }

    /// Drafts per round now (0: plain decoding).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The draft length for the next round, at most `limit`: the current one, or 1 when
    /// speculation is off and a probe is due.
    pub fn next(&mut self, limit: usize) -> usize {
        let k = if self.k == 0 && self.max_k > 0 && self.plain_since_probe >= PROBE_EVERY {
            self.plain_since_probe = 0;
            1
        } else {
            self.k
        };
        k.min(limit)
    }

    /// A plain decode step took `secs`.
    pub fn plain_token(&mut self, secs: f64) {
        self.plain.add(secs);
        if self.k == 0 {
            self.plain_since_probe += 1;
        }
    }

    /// A round with `k` drafts committed `tokens` tokens in `secs`.
    pub fn round(&mut self, k: usize, tokens: usize, secs: f64) {
        if k == 0 || k > MAX_DRAFT || tokens == 0 {
            return;
        }
        self.rounds[k].add(secs / tokens as f64);
        let (Some(per_token), Some(plain)) = (self.rounds[k].0, self.plain.0) else {
            return;
        };
        if per_token > plain {
            self.k = k - 1;
        } else if per_token < GROW_BELOW * plain && k < self.max_k {
            self.k = k + 1;
        } else {
            self.k = k;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejected_drafts_switch_speculation_off_and_probes_come_back() {
        // Random weights: every round commits one token at 2.1 plain steps.
        let mut t = SpecTuner::new(4);
        assert_eq!(t.next(8), 4);
        t.plain_token(0.014);
        t.round(4, 1, 0.030);
        assert_eq!(t.k(), 3);
        for k in (1..=3).rev() {
            assert_eq!(t.next(8), k);
            t.round(k, 1, 0.030);
        }
        assert_eq!(t.k(), 0);
        // Off: plain until a probe is due, then one round at k = 1.
        for _ in 0..PROBE_EVERY - 1 {
            assert_eq!(t.next(8), 0);
            t.plain_token(0.014);
        }
        t.plain_token(0.014);
        assert_eq!(t.next(8), 1);
        t.round(1, 1, 0.030);
        assert_eq!((t.k(), t.next(8)), (0, 0));
    }

    #[test]
    fn accepted_drafts_grow_k_up_to_the_limit() {
        // A trained MTP head: k = 1 commits 1.9 tokens per 1.06 plain steps, and so on.
        let mut t = SpecTuner::new(3);
        t.k = 1;
        t.plain_token(0.014);
        t.round(1, 2, 0.0149);
        assert_eq!(t.k(), 2);
        t.round(2, 3, 0.0152);
        assert_eq!(t.k(), 3);
        t.round(3, 4, 0.0155);
        assert_eq!(t.k(), 3, "never above max_k");
        assert_eq!(t.next(2), 2, "the caller's limit (tokens left) wins");
        // Break-even rounds keep k where it is.
        let mut t = SpecTuner::new(4);
        t.k = 2;
        t.plain_token(0.010);
        t.round(2, 1, 0.0095);
        assert_eq!(t.k(), 2);
        // No plain figure yet: nothing to compare with, k stays.
        let mut t = SpecTuner::new(2);
        t.round(2, 1, 1.0);
        assert_eq!(t.k(), 2);
        assert_eq!(SpecTuner::new(99).k(), MAX_DRAFT);
    }
}
