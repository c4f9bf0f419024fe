//! Sampling the next token from a logits row: greedy, temperature, top-k, top-p, seeded.
//!
//! The whole sampler — its configuration *and* its RNG state — is a [`SamplerState`], which
//! is part of every [`Capsule`](crate::Capsule). A restored or forked session therefore draws
//! exactly the random numbers the original would have drawn next, and samples exactly the
//! continuation it would have sampled.
//!
//! # The algorithm (deterministic, documented so other implementations can match it)
//!
//! 1. **Greedy** when `temperature <= 0` or `top_k == 1`: the index of the largest logit
//!    (the first one on ties; NaN never wins). No random number is drawn.
//! 2. Candidates are the indices whose logit is finite; each gets the score
//!    `z = logit / temperature`, computed in `f64`.
//! 3. Candidates are ordered by score, descending, ties broken by the smaller index: a total
//!    order, so the result does not depend on the sort routine.
//! 4. **Top-k** (`top_k > 0`): keep the first `top_k` candidates.
//! 5. Softmax over the kept candidates in `f64`: `w = exp(z - z_max)`, `p = w / Σw`.
//! 6. **Top-p** (`top_p < 1`): keep the shortest prefix (in the order of step 3) whose
//!    probabilities sum to at least `top_p`; at least one candidate is always kept.
//! 7. Draw one `u64` `r` from the xoshiro256** state and form `u = (r >> 11) · 2⁻⁵³` in
//!    `[0, 1)`. With `W` the sum of the kept weights, return the first kept candidate whose
//!    running sum of weights exceeds `u · W` (the last kept one if rounding leaves none).
//!
//! Exactly one random number is drawn per non-greedy token, so the RNG position is the count
//! of sampled tokens since seeding. xoshiro256** is the public-domain generator of Blackman and
//! Vigna; the state is seeded from `seed` through SplitMix64 ([`SamplerState::seeded`]).

use crate::capsule::SamplerState;
use crate::error::{Error, Result};
use crate::session::argmax;

/// One step of xoshiro256**: returns the next output and advances `s`.
pub fn xoshiro256ss_next(s: &mut [u64; 4]) -> u64 {
    let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
    let t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = s[3].rotate_left(45);
    result
}

impl SamplerState {
    /// Check the configuration: a finite, non-negative temperature and `0 < top_p <= 1`.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::Input(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }

    /// The next uniform number in `[0, 1)` (advances the RNG).
    pub fn next_uniform(&mut self) -> f64 {
        (xoshiro256ss_next(&mut self.rng) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Choose a token from one row of logits (see the module docs for the algorithm).
    /// `None` when the row has no finite value.
    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        if self.is_greedy() || self.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.temperature as f64;
        let mut cand: Vec<(f64, u32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (v as f64 * inv_t, i as u32))
            .collect();
        if cand.is_empty() {
            return None;
        }
        let order = |a: &(f64, u32), b: &(f64, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if self.top_k > 0 && self.top_k < cand.len() {
            cand.select_nth_unstable_by(self.top_k - 1, order);
            cand.truncate(self.top_k);
        }
        cand.sort_unstable_by(order);
        let z_max = cand[0].0;
        let weights: Vec<f64> = cand.iter().map(|&(z, _)| (z - z_max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut kept = weights.len();
        if self.top_p < 1.0 {
            let need = self.top_p as f64 * total;
            let mut acc = 0.0;
            for (i, w) in weights.iter().enumerate() {
                acc += w;
                if acc >= need {
                    kept = i + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = weights[..kept].iter().sum();
        let target = self.next_uniform() * kept_total;
        let mut acc = 0.0;
        for i in 0..kept {
            acc += weights[i];
            if acc > target {
                return Some(cand[i].1);
            }
        }
        Some(cand[kept - 1].1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xoshiro_reference_sequence() {
        // The generator's reference outputs for the state {1, 2, 3, 4}.
        let mut s = [1u64, 2, 3, 4];
        let got: Vec<u64> = (0..4).map(|_| xoshiro256ss_next(&mut s)).collect();
        assert_eq!(got, vec![11520, 0, 1509978240, 1215971899390074240]);
    }

    #[test]
    fn greedy_is_argmax_and_draws_nothing() {
        let mut s = SamplerState::greedy();
        let rng = s.rng;
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), Some(1));
        assert_eq!(s.rng, rng);
        let mut k1 = SamplerState::seeded(7, 1.0, 1, 1.0);
        assert_eq!(k1.sample(&[0.1, 3.0, 5.0]), Some(2));
    }

    #[test]
    fn same_seed_same_tokens_and_state_resumes() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let mut a = SamplerState::seeded(42, 0.8, 20, 0.9);
        let mut b = a.clone();
        let ta: Vec<u32> = (0..30).map(|_| a.sample(&logits).unwrap()).collect();
        let tb: Vec<u32> = (0..30).map(|_| b.sample(&logits).unwrap()).collect();
        assert_eq!(ta, tb);
        // Resuming from a copy of the state mid-stream continues the same stream.
        let mut c = SamplerState::seeded(42, 0.8, 20, 0.9);
        for _ in 0..10 {
            c.sample(&logits);
        }
        let mut d = c.clone();
        let tc: Vec<u32> = (0..20).map(|_| c.sample(&logits).unwrap()).collect();
        let td: Vec<u32> = (0..20).map(|_| d.sample(&logits).unwrap()).collect();
        assert_eq!(tc, td);
        assert_eq!(tc, ta[10..]);
        // Another seed, another stream.
        let mut e = SamplerState::seeded(43, 0.8, 20, 0.9);
        let te: Vec<u32> = (0..30).map(|_| e.sample(&logits).unwrap()).collect();
        assert_ne!(te, ta);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [5.0f32, 4.0, 3.0, -2.0, f32::NAN, f32::NEG_INFINITY];
        let mut s = SamplerState::seeded(1, 1.0, 2, 1.0);
        for _ in 0..500 {
            let t = s.sample(&logits).unwrap();
            assert!(t == 0 || t == 1, "top_k=2 sampled {t}");
        }
        // p(0) = e^5 / (e^5 + e^4 + e^3 + e^-2) ≈ 0.665 < 0.7 <= p(0) + p(1).
        let mut s = SamplerState::seeded(2, 1.0, 0, 0.7);
        let mut seen = [0usize; 6];
        for _ in 0..2000 {
            seen[s.sample(&logits).unwrap() as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0);
        assert_eq!(seen[2] + seen[3] + seen[4] + seen[5], 0);
        // Tiny top_p keeps one candidate: the argmax.
        let mut s = SamplerState::seeded(3, 1.0, 0, 1e-6);
        assert!((0..50).all(|_| s.sample(&logits) == Some(0)));
    }

    #[test]
    fn frequencies_follow_the_distribution() {
        // Two logits ln(3) and 0 at temperature 1: p = 0.75 / 0.25.
        let logits = [3f32.ln(), 0.0];
        let mut s = SamplerState::seeded(9, 1.0, 0, 1.0);
        let n = 20000;
        let zeros = (0..n).filter(|_| s.sample(&logits) == Some(0)).count();
        let f = zeros as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.02, "frequency {f}");
    }

    #[test]
    fn no_finite_logit_is_none() {
        let mut s = SamplerState::seeded(1, 1.0, 0, 1.0);
        assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY]), None);
        assert_eq!(s.sample(&[]), None);
    }

    #[test]
    fn validation() {
        assert!(SamplerState::seeded(1, 0.7, 0, 0.9).validate().is_ok());
        assert!(SamplerState::seeded(1, -1.0, 0, 0.9).validate().is_err());
        assert!(
            SamplerState::seeded(1, f32::NAN, 0, 0.9)
                .validate()
                .is_err()
        );
        assert!(SamplerState::seeded(1, 1.0, 0, 0.0).validate().is_err());
        assert!(SamplerState::seeded(1, 1.0, 0, 1.5).validate().is_err());
    }
}
