//! Sampling the next token from a logits row: greedy, temperature, top-k, min-p, top-p,
//! seeded.
//!
//! The whole sampler — its configuration *and* its RNG state — is a [`SamplerState`], which
//! is part of every [`Capsule`](crate::Capsule). A restored or forked session therefore draws
//! exactly the random numbers the original would have drawn next, and samples exactly the
//! continuation it would have sampled.
//!
//! # The algorithm (deterministic, specified so other implementations match it bit for bit)
//!
//! Every step is exact integer arithmetic or a single IEEE-754 binary64 operation (no fused
//! multiply-add, no library `exp`), so the result depends only on the logits and the RNG
//! state — not on the order of a reduction, the sort routine, the machine or the backend. A
//! device implementation that follows it chooses the same token from the same row.
//!
//! 0. **Penalties** (when set; [`SamplerState::penalize`]), on a copy of the row, token by
//!    token in id order, each an f32 operation rounded to nearest: for a token anywhere in the
//!    history, `v / r` if `v > 0` else `v · r` (repetition penalty `r`); then for a token
//!    generated `c > 0` times since `penalty_from`, `(v − presence) − frequency · c`. The
//!    steps below run on the penalized row (a device sampler penalizes a copy of its row:
//!    [`SamplerState::penalty_list`]).
//! 1. **Greedy** when `temperature <= 0` or `top_k == 1`: the index of the largest logit
//!    (the first one on ties; NaN never wins). No random number is drawn.
//! 2. Candidates are the indices whose logit `v` is finite. They are ordered by `v`,
//!    descending (IEEE total order, so `+0.0` before `-0.0`), ties broken by the smaller
//!    index: a total order. (Dividing by the temperature is monotone, so this is also the
//!    order of the scores.)
//! 3. **Top-k** (`top_k > 0`): keep the first `top_k` candidates.
//! 4. Each kept candidate's score is `z = (v as f64) · (1 / T)` (`1 / T` computed once, in
//!    f64); `d = z − z_max ≤ 0`. Its **weight** is the integer
//!    `W = floor(E(d) · 2^32)` for `d ≥ −23`, else `0`, with `E` the portable exponential of
//!    [`portable_exp`]. The best candidate weighs exactly `2^32`; a weight of 0 can never be
//!    drawn (its probability is below `2^-32` of the best one's).
//! 5. **Min-p** (`min_p > 0`): drop candidates with `W < ceil(min_p · 2^32)` (probability
//!    below `min_p` times the best one's).
//! 6. **Top-p** (`top_p < 1`): with `S = ΣW` (exact, `u128`), `P = round(top_p · 2^32)` and
//!    `need = max(1, ceil(S · P / 2^32))`, keep the shortest prefix (in the order of step 2)
//!    whose weights sum to at least `need`.
//! 7. Draw one `u64` `r` from the xoshiro256** state, `u = r >> 11` (53 bits). With `K` the
//!    sum of the kept weights, `target = floor(u · K / 2^53)` (`< K`). Return the first kept
//!    candidate whose running sum of weights exceeds `target`.
//!
//! Exactly one random number is drawn per non-greedy token, so the RNG position is the count
//! of sampled tokens since seeding. xoshiro256** is the public-domain generator of Blackman and
//! Vigna; the state is seeded from `seed` through SplitMix64 ([`SamplerState::seeded`]).
//!
//! # Cost
//!
//! No sort of the row. Without a top-k cut the weights are computed in one vectorised pass
//! over the row (AVX2 where the CPU has it: the same IEEE operations, the same bits), and
//! the prefix sums of steps 6 and 7 are found by a radix selection on the order key (12-bit
//! digits, mass per digit): one histogram pass over the row, then only the candidates of one
//! digit. A row of 64 Ki candidates or more is weighed by up to 4 threads
//! (`FLASHRT_SAMPLE_THREADS`); the sums are exact integers, so the split changes no bit.
//! `cargo bench --bench sampling` measures it on a 248,320-wide row.
//!
//! The CUDA backend runs the same algorithm on the device (kernels/sample.cu, from the
//! values of [`SamplerState::draw_spec`]) on the row the LM head just wrote, so only the
//! chosen id crosses to the host; `flashrt-runtime/tests/cuda_sample.rs` checks that it
//! chooses what [`SamplerState::sample`] chooses on adversarial rows.

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

/// Fixed-point scale of the weights: `W = floor(E(d) · 2^WEIGHT_BITS)`. With 32 bits a
/// row of up to `2^32 − 1` candidates sums to less than `2^64`.
pub const WEIGHT_BITS: u32 = 32;
/// Score differences below this weigh 0 without evaluating `E` (`E(−23) · 2^32 < 1` anyway).
pub const MIN_DELTA: f64 = -23.0;

const SCALE: f64 = (1u64 << WEIGHT_BITS) as f64;
const TWO52: f64 = 4_503_599_627_370_496.0;
const LOG2E: f64 = f64::from_bits(0x3ff7_1547_652b_82fe);
/// ln 2 split so that `k · LN2_HI` is exact for `|k| < 2^21` (its low 21 bits are zero).
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
/// `1 / n!` for `n = 9 .. 0`, the Taylor coefficients in Horner order (the truncation error,
/// below 1e-11 relative on `|r| <= ln 2 / 2`, is far under the weights' `2^-32` resolution).
const EXP_POLY: [f64; 10] = [
    f64::from_bits(0x3ec7_1de3_a556_c734),
    f64::from_bits(0x3efa_01a0_1a01_a01a),
    f64::from_bits(0x3f2a_01a0_1a01_a01a),
    f64::from_bits(0x3f56_c16c_16c1_6c17),
    f64::from_bits(0x3f81_1111_1111_1111),
    f64::from_bits(0x3fa5_5555_5555_5555),
    f64::from_bits(0x3fc5_5555_5555_5555),
    0.5,
    1.0,
    1.0,
];

/// `e^d` for `d` in `[MIN_DELTA, 0]` from IEEE binary64 multiplications and additions only,
/// each rounded to nearest (never fused):
/// `k = (d · log2 e + 1.5 · 2^52) − 1.5 · 2^52` (`d · log2 e` rounded to an integer, ties to
/// even), `r = (d − k · LN2_HI) − k · LN2_LO`, the degree-9 Taylor polynomial of `e^r` in
/// Horner form with the coefficients of `EXP_POLY`, times `2^k` (built from its bits: `k` is
/// in `[−34, 0]`). Relative error below 2e-11; `portable_exp(0) == 1` exactly. The device
/// sampler (kernels/sample.cu) evaluates the same expression with round-to-nearest
/// intrinsics (`__dmul_rn`, `__dadd_rn`, `__dsub_rn`) and gets the same bits.
#[inline(always)]
pub fn portable_exp(d: f64) -> f64 {
    const ROUND: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    let k = (d * LOG2E + ROUND) - ROUND;
    let r = (d - k * LN2_HI) - k * LN2_LO;
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    // k + 2^52 + 1023 is an integer in [2^52, 2^53): its low mantissa bits are 1023 + k.
    let biased = (k + (TWO52 + 1023.0)).to_bits() - TWO52.to_bits();
    p * f64::from_bits(biased << 52)
}

/// The weight of a score difference `d = z − z_max` (step 4 of the module docs), and 0 for a
/// non-finite `d`. Branch-free so that a loop of it vectorises.
#[inline(always)]
pub fn weight(d: f64) -> u64 {
    let inside = d >= MIN_DELTA; // false for NaN and −∞
    let e = portable_exp(if inside { d } else { MIN_DELTA }) * SCALE; // in (0, 2^32]
    // floor(e) for 0 <= e < 2^52: round to an integer by adding 2^52, step down if above.
    let t = e + TWO52;
    let rounded = t - TWO52;
    let w = (t.to_bits() - TWO52.to_bits()) - (rounded > e) as u64;
    if inside { w } else { 0 }
}

/// `out[i]` = the weight of `row[i]` against `z_max` (0 for non-finite logits and below
/// `floor_w`); returns the sum.
#[inline(always)]
fn fill_weights_generic(row: &[f32], inv_t: f64, z_max: f64, floor_w: u64, out: &mut [u64]) -> u64 {
    let mut total = 0u64;
    for (o, &v) in out.iter_mut().zip(row) {
        let w = weight(v as f64 * inv_t - z_max);
        let w = if v.is_finite() && w >= floor_w { w } else { 0 };
        *o = w;
        total += w;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fill_weights_avx2(row: &[f32], inv_t: f64, z_max: f64, floor_w: u64, out: &mut [u64]) -> u64 {
    fill_weights_generic(row, inv_t, z_max, floor_w, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fill_weights_avx512(row: &[f32], inv_t: f64, z_max: f64, floor_w: u64, out: &mut [u64]) -> u64 {
    fill_weights_generic(row, inv_t, z_max, floor_w, out)
}

fn fill_weights(row: &[f32], inv_t: f64, z_max: f64, floor_w: u64, out: &mut [u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { fill_weights_avx512(row, inv_t, z_max, floor_w, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { fill_weights_avx2(row, inv_t, z_max, floor_w, out) };
    }
    fill_weights_generic(row, inv_t, z_max, floor_w, out)
}

/// The IEEE total order of `v` as an unsigned integer.
#[inline(always)]
fn ord(v: f32) -> u32 {
    let b = v.to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// The order key of candidate `i` with logit `v`: larger key = earlier in the order of
/// step 2 (the total order of `v` in the high 32 bits, the inverted index below).
#[inline(always)]
fn order_key(v: f32, i: u32) -> u64 {
    ((ord(v) as u64) << 32) | (u32::MAX - i) as u64
}

#[inline]
fn key_logit(key: u64) -> f32 {
    let o = (key >> 32) as u32;
    f32::from_bits(if o >> 31 == 1 { o & 0x7fff_ffff } else { !o })
}

#[inline]
fn key_index(key: u64) -> u32 {
    u32::MAX - key as u32
}

const DIGIT: i32 = 12;
const MASK: u64 = (1 << DIGIT) - 1;

/// The candidate at mass rank `target` in descending key order: the `(key, inclusive prefix
/// sum)` of the first item whose running sum of weights exceeds `target`, where `base` is the
/// weight of every candidate before `items` and key bits above `shift + 12` are shared by
/// all items. `items` holds `(key, weight)` pairs with distinct keys and positive weights, in
/// any order, reaching past `target`. A radix selection on 12-bit digits of the key, high
/// digit first; at most 64 items are sorted.
fn mass_select(items: &[(u64, u64)], target: u128, mut base: u128, mut shift: i32) -> (u64, u128) {
    let mut hist = [0u64; 1 << DIGIT];
    let mut narrowed: Option<Vec<(u64, u64)>> = None;
    loop {
        let cur = narrowed.as_deref().unwrap_or(items);
        if cur.len() <= 64 || shift < 0 {
            let mut v = cur.to_vec();
            v.sort_unstable_by_key(|a| std::cmp::Reverse(a.0));
            let mut acc = base;
            for (k, w) in v {
                acc += w as u128;
                if acc > target {
                    return (k, acc);
                }
            }
            unreachable!("mass_select: target beyond the total weight");
        }
        hist.fill(0);
        for &(k, w) in cur {
            hist[((k >> shift) & MASK) as usize] += w;
        }
        let digit = pick_digit(&hist, target, &mut base);
        let next = cur
            .iter()
            .copied()
            .filter(|&(k, _)| (k >> shift) & MASK == digit)
            .collect();
        narrowed = Some(next);
        shift -= DIGIT;
    }
}

/// The highest digit whose bucket holds mass rank `target`; `base` advances past the buckets
/// above it. (A bucket's weights sum below `2^64`: fewer than `2^32` weights of at most
/// `2^32` each.)
fn pick_digit(hist: &[u64], target: u128, base: &mut u128) -> u64 {
    for d in (0..hist.len()).rev() {
        if *base + hist[d] as u128 > target {
            return d as u64;
        }
        *base += hist[d] as u128;
    }
    unreachable!("mass_select: target beyond the total weight")
}

/// [`mass_select`] over a whole row with its weights (`weights[i] == 0`: not a candidate):
/// the first digit's histogram is taken from the row once, then each selection gathers only
/// its digit's candidates.
struct RowSelect<'a> {
    row: &'a [f32],
    weights: &'a [u64],
    /// Weight of the candidates of each first digit.
    hist: Vec<u64>,
    /// The candidates of the last digit gathered (top-p and the draw often share one).
    gathered: Option<(u32, Vec<(u64, u64)>)>,
}

impl<'a> RowSelect<'a> {
    /// Weigh `row` into `weights` (see [`fill_weights`]) and take the first digit's
    /// histogram; returns the selector and the total weight. A wide row is split across a
    /// few threads (the host is idle while a sampled token is chosen); every sum is an exact
    /// integer, so the split changes nothing.
    fn weigh(
        row: &'a [f32],
        weights: &'a mut [u64],
        inv_t: f64,
        z_max: f64,
        floor_w: u64,
    ) -> (Self, u128) {
        let part = |r: &[f32], w: &mut [u64]| {
            let total = fill_weights(r, inv_t, z_max, floor_w, w);
            let mut hist = vec![0u64; 1 << DIGIT];
            for (&v, &x) in r.iter().zip(w.iter()) {
                hist[(ord(v) >> (32 - DIGIT)) as usize] += x;
            }
            (total as u128, hist)
        };
        let threads = sample_threads(row.len());
        let (total, hist) = if threads > 1 {
            let chunk = row.len().div_ceil(threads);
            std::thread::scope(|sc| {
                let parts: Vec<_> = row
                    .chunks(chunk)
                    .zip(weights.chunks_mut(chunk))
                    .map(|(r, w)| sc.spawn(move || part(r, w)))
                    .collect();
                let mut total = 0u128;
                let mut hist = vec![0u64; 1 << DIGIT];
                for p in parts {
                    let (t, h) = p.join().expect("sampling thread");
                    total += t;
                    hist.iter_mut().zip(h).for_each(|(a, b)| *a += b);
                }
                (total, hist)
            })
        } else {
            part(row, weights)
        };
        let sel = RowSelect {
            row,
            weights,
            hist,
            gathered: None,
        };
        (sel, total)
    }

    fn select(&mut self, target: u128) -> (u64, u128) {
        let mut base = 0u128;
        let digit = pick_digit(&self.hist, target, &mut base) as u32;
        if self.gathered.as_ref().is_none_or(|(d, _)| *d != digit) {
            // The digit test first: it is rarely true, so the branch predicts well (a zero
            // weight, no candidate, is common and random at low temperatures).
            let items = self
                .row
                .iter()
                .zip(self.weights)
                .enumerate()
                .filter(|&(_, (&v, &w))| ord(v) >> (32 - DIGIT) == digit && w != 0)
                .map(|(i, (&v, &w))| (order_key(v, i as u32), w))
                .collect();
            self.gathered = Some((digit, items));
        }
        let (_, items) = self.gathered.as_ref().expect("gathered");
        mass_select(items, target, base, 64 - 2 * DIGIT)
    }
}

impl SamplerState {
    /// Check the configuration: a finite, non-negative temperature, `0 < top_p <= 1` and
    /// `0 <= min_p <= 1`.
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
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(Error::Input(format!(
                "min_p must be in [0, 1], got {}",
                self.min_p
            )));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::Input(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(Error::Input(format!(
                "repetition_penalty must be a finite number > 0, got {}",
                self.repetition_penalty
            )));
        }
        Ok(())
    }

    /// Step 0 of the module docs: `row` with the penalties applied for a session whose token
    /// history is `history`; `None` when the sampler has no penalty.
    pub fn penalize(&self, row: &[f32], history: &[u32]) -> Option<Vec<f32>> {
        let list = self.penalty_list(history, row.len())?;
        let mut out = row.to_vec();
        list.apply(&mut out);
        Some(out)
    }

    /// Step 0 as the tokens it changes: every distinct id of `history` below `n` (the
    /// repetition penalty's), each with its count since `penalty_from` (presence and
    /// frequency), in id order. `None` when the sampler has no penalty. A device sampler
    /// applies it to a copy of the row it samples (kernels/sample.cu `sample_penalize`).
    pub fn penalty_list(&self, history: &[u32], n: usize) -> Option<PenaltyList> {
        if !self.has_penalties() {
            return None;
        }
        let repetition = self.repetition_penalty != 1.0;
        // (id, generated since penalty_from) keys, sorted: runs of one id.
        let from = self.penalty_from.min(history.len());
        let mut keys: Vec<u64> = history
            .iter()
            .enumerate()
            .filter(|&(_, &t)| (t as usize) < n)
            .map(|(i, &t)| ((t as u64) << 1) | (i >= from) as u64)
            .collect();
        keys.sort_unstable();
        let mut entries: Vec<[u32; 2]> = Vec::new();
        for k in keys {
            let (t, generated) = ((k >> 1) as u32, (k & 1) as u32);
            match entries.last_mut() {
                Some(e) if e[0] == t => e[1] += generated,
                _ => entries.push([t, generated]),
            }
        }
        // Without a repetition penalty only the generated tokens change.
        if !repetition {
            entries.retain(|e| e[1] > 0);
        }
        Some(PenaltyList {
            repetition: repetition.then_some(self.repetition_penalty),
            presence: self.presence_penalty,
            frequency: self.frequency_penalty,
            entries,
        })
    }

    /// The min-p floor of step 5 (at least 1: a weight of 0 is never a candidate).
    fn floor_weight(&self) -> u64 {
        if self.min_p > 0.0 {
            ((self.min_p as f64 * SCALE).ceil() as u64).max(1)
        } else {
            1
        }
    }

    /// What a device implementation of [`SamplerState::sample`] over a row of `n` logits
    /// needs (kernels/sample.cu), computed exactly as `sample` computes it, and the RNG state
    /// after the draw (to keep once the device has chosen a token: `sample` does not draw
    /// when the row has no finite value). `None` for the greedy sampler, which draws nothing.
    pub fn draw_spec(&self, n: usize) -> Option<(DrawSpec, [u64; 4])> {
        if self.is_greedy() || self.top_k == 1 {
            return None;
        }
        let mut rng = self.rng;
        let draw = xoshiro256ss_next(&mut rng) >> 11;
        let spec = DrawSpec {
            inv_t: 1.0 / self.temperature as f64,
            floor_w: self.floor_weight(),
            top_k: if self.top_k > 0 && self.top_k < n {
                self.top_k as u32
            } else {
                0
            },
            top_p: (self.top_p < 1.0).then(|| top_p_scaled(self.top_p)),
            draw,
        };
        Some((spec, rng))
    }

    /// Choose a token from one row of logits (see the module docs for the algorithm).
    /// `None` when the row has no finite value.
    pub fn sample(&mut self, logits: &[f32]) -> Option<u32> {
        if self.is_greedy() || self.top_k == 1 {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.temperature as f64;
        let floor_w = self.floor_weight();
        let n = logits.len();
        if self.top_k > 0 && self.top_k < n {
            return self.sample_top_k(logits, inv_t, floor_w);
        }
        // Steps 2 and 4-5 over the whole row: the best finite logit, then every weight.
        let best = crate::session::max_finite(logits)?;
        let z_max = best as f64 * inv_t;
        // The weights buffer is kept per thread: every element is written before it is read,
        // and a fresh row-sized allocation per token would cost its page faults.
        WEIGHTS.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < n {
                buf.resize(n, 0);
            }
            // Steps 6-7: the top-p cut as the total weight of the kept prefix, one draw, the
            // candidate at that mass rank; both from one histogram of the row.
            let (mut sel, total) = RowSelect::weigh(logits, &mut buf[..n], inv_t, z_max, floor_w);
            let kept = if self.top_p < 1.0 {
                sel.select(top_p_need(total, self.top_p) - 1).1
            } else {
                total
            };
            let target = draw_target(&mut self.rng, kept);
            Some(key_index(sel.select(target).0))
        })
    }

    /// [`SamplerState::sample`] with a top-k cut below the row's width: the k best keys by
    /// selection, then the same steps over them.
    fn sample_top_k(&mut self, logits: &[f32], inv_t: f64, floor_w: u64) -> Option<u32> {
        let mut keys: Vec<u64> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| order_key(v, i as u32))
            .collect();
        if keys.is_empty() {
            return None;
        }
        if self.top_k < keys.len() {
            keys.select_nth_unstable_by(self.top_k - 1, |a, b| b.cmp(a));
            keys.truncate(self.top_k);
        }
        let best = keys.iter().copied().max().expect("non-empty");
        let z_max = key_logit(best) as f64 * inv_t;
        let mut items: Vec<(u64, u64)> = Vec::with_capacity(keys.len());
        let mut total = 0u128;
        for &k in &keys {
            let w = weight(key_logit(k) as f64 * inv_t - z_max);
            if w >= floor_w {
                items.push((k, w));
                total += w as u128;
            }
        }
        let kept = if self.top_p < 1.0 {
            mass_select(&items, top_p_need(total, self.top_p) - 1, 0, 64 - DIGIT).1
        } else {
            total
        };
        let target = draw_target(&mut self.rng, kept);
        Some(key_index(mass_select(&items, target, 0, 64 - DIGIT).0))
    }
}

thread_local! {
    static WEIGHTS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Threads for weighing a row of `n` logits: one below 64 Ki candidates, else up to 4 (the
/// available parallelism; `FLASHRT_SAMPLE_THREADS` overrides).
fn sample_threads(n: usize) -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let t = *THREADS.get_or_init(|| {
        std::env::var("FLASHRT_SAMPLE_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |p| p.get().min(4)))
            .max(1)
    });
    if n < 1 << 16 { 1 } else { t }
}

/// Step 6's `P = round(top_p · 2^32)`.
fn top_p_scaled(top_p: f32) -> u64 {
    (top_p as f64 * 4_294_967_296.0).round() as u64
}

/// Step 6's `need = max(1, ceil(S · P / 2^32))`.
fn top_p_need(total: u128, top_p: f32) -> u128 {
    (total * top_p_scaled(top_p) as u128)
        .div_ceil(1 << 32)
        .max(1)
}

/// One non-greedy draw as a device sampler takes it ([`SamplerState::draw_spec`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawSpec {
    /// `1 / T` in f64 (step 4).
    pub inv_t: f64,
    /// The min-p floor on weights, at least 1 (step 5).
    pub floor_w: u64,
    /// The top-k cut, 0 for none (step 3; only below the row's width).
    pub top_k: u32,
    /// `P = round(top_p · 2^32)` when there is a top-p cut (step 6).
    pub top_p: Option<u64>,
    /// The RNG output `>> 11` (step 7's `u`).
    pub draw: u64,
}

/// Step 0's changes to a row ([`SamplerState::penalty_list`]): what a device sampler needs to
/// penalize its copy of the row exactly as the host does.
#[derive(Clone, Debug, PartialEq)]
pub struct PenaltyList {
    /// The repetition penalty `r`, when it is not 1.
    pub repetition: Option<f32>,
    pub presence: f32,
    pub frequency: f32,
    /// `[id, count since penalty_from]`, ids distinct, ascending, below the row's width.
    pub entries: Vec<[u32; 2]>,
}

impl PenaltyList {
    /// Whether presence or frequency is set (a generated token's count then applies).
    pub fn counted(&self) -> bool {
        self.presence != 0.0 || self.frequency != 0.0
    }

    /// Apply the penalties to `row` in place: each listed token's value `v` becomes `v / r`
    /// if `v > 0` else `v · r`, then, if it was generated `c > 0` times,
    /// `(v − presence) − frequency · c`, every operation an f32 one rounded to nearest (no
    /// fused multiply-add), as kernels/sample.cu computes it.
    pub fn apply(&self, row: &mut [f32]) {
        let counted = self.counted();
        for &[t, c] in &self.entries {
            let v = &mut row[t as usize];
            if let Some(r) = self.repetition {
                *v = if *v > 0.0 { *v / r } else { *v * r };
            }
            if counted && c > 0 {
                *v = (*v - self.presence) - self.frequency * c as f32;
            }
        }
    }
}

/// Step 7's `floor(u · K / 2^53)` with `u` the top 53 bits of the next RNG output.
fn draw_target(rng: &mut [u64; 4], kept: u128) -> u128 {
    let u = (xoshiro256ss_next(rng) >> 11) as u128;
    (u * kept) >> 53
}

/// Log-probabilities of one chosen token, as OpenAI's `logprobs` / `top_logprobs` report
/// them ([`logprobs`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    /// `ln p(token)`; `-inf` for a token whose logit is not finite.
    pub logprob: f32,
    /// The `top` most likely tokens and their log-probabilities, most likely first (ties: the
    /// smaller id first).
    pub top: Vec<(u32, f32)>,
}

/// `Σ e^(v − max)` over the finite logits (terms below `e^-87` add 0), for [`logprobs`]:
/// eight independent f64 sums, so the additions do not form one serial chain, of f32 terms
/// (relative error ~1e-7, far below what an f32 log-probability shows).
fn exp_sum(row: &[f32], max: f32) -> f64 {
    let term = |v: f32| {
        let d = v - max;
        let ok = v.is_finite() && d >= -87.0;
        let e = exp_neg_f32(if ok { d } else { 0.0 });
        if ok { e as f64 } else { 0.0 }
    };
    let mut acc = [0f64; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += term(v);
        }
    }
    for (a, &v) in acc.iter_mut().zip(chunks.remainder()) {
        *a += term(v);
    }
    acc.iter().sum()
}

/// `e^d` for `d` in `[-87, 0]` in f32, branch-free: `2^k · p(r)` with `k = round(d · log2 e)`,
/// `r = d − k · ln 2` (two-part ln 2) and the degree-7 Taylor polynomial of `e^r`
/// (`|r| <= ln 2 / 2`: truncation below 2e-8 relative). For [`logprobs`] only; the sampler's
/// weights use the specified [`portable_exp`].
#[inline(always)]
fn exp_neg_f32(d: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23
    let k = (d * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (d - k * 0.693_145_75) - k * 1.428_606_8e-6;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = p * r + c;
    }
    // k + 2^23 + 127 is an integer in [2^23, 2^24): its low mantissa bits are 127 + k (no
    // float-to-int conversion, which would keep the loop from vectorising).
    const TWO23: f32 = 8_388_608.0;
    let biased = (k + (TWO23 + 127.0)).to_bits() - TWO23.to_bits();
    p * f32::from_bits(biased << 23)
}

/// Most alternatives [`logprobs`] reports per token (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probabilities of `token` and of the `top` (at most [`MAX_TOP_LOGPROBS`]) most
/// likely tokens under the model's distribution over `row`: the log-softmax of the raw logits
/// (temperature 1, before any top-k / top-p / min-p cut; what vLLM reports by default), in
/// f64 (`ln Σ exp(v − max)` over the finite logits, each term in f32), rounded to f32. `None` when no logit is finite. A pass over the row on the
/// host (`cargo bench --bench sampling -- logprobs`), so servers compute it only when a
/// request asks.
pub fn logprobs(row: &[f32], token: u32, top: usize) -> Option<TokenLogprobs> {
    let max = crate::session::max_finite(row)? as f64;
    // Branch-free so that it vectorises: `portable_exp` holds for d >= -708 (2^k stays a
    // normal number); smaller terms, and non-finite logits, add 0.
    let sum = exp_sum(row, max as f32);
    let lse = max + sum.ln();
    let lp = |v: f32| {
        if v.is_finite() {
            (v as f64 - lse) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    // The `top` largest order keys, kept sorted, largest first: one comparison per logit once
    // the list is full.
    let top = top.min(MAX_TOP_LOGPROBS);
    let mut best: Vec<u64> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &v) in row.iter().enumerate() {
            if !v.is_finite() {
                continue;
            }
            let k = order_key(v, i as u32);
            if best.len() == top && k <= best[top - 1] {
                continue;
            }
            let at = best.partition_point(|&b| b > k);
            best.insert(at, k);
            best.truncate(top);
        }
    }
    Some(TokenLogprobs {
        token,
        logprob: row
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top: best
            .into_iter()
            .map(|k| (key_index(k), lp(key_logit(k))))
            .collect(),
    })
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

    /// The algorithm of the module docs written the plain way: a full sort of the candidates
    /// by (logit desc, index asc) and linear prefix walks. `sample` must agree with it on
    /// every row (it shares only `weight`, whose accuracy `portable_exp_matches_exp` checks).
    fn sample_by_sorting(s: &mut SamplerState, logits: &[f32]) -> Option<u32> {
        if s.is_greedy() || s.top_k == 1 {
            return argmax(logits);
        }
        let mut c: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (v, i as u32))
            .collect();
        if c.is_empty() {
            return None;
        }
        c.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if s.top_k > 0 && s.top_k < c.len() {
            c.truncate(s.top_k);
        }
        let inv_t = 1.0 / s.temperature as f64;
        let z_max = c[0].0 as f64 * inv_t;
        let floor_w = ((s.min_p as f64 * 2f64.powi(32)).ceil() as u64).max(1);
        let kept: Vec<(u32, u64)> = c
            .iter()
            .map(|&(v, i)| (i, weight(v as f64 * inv_t - z_max)))
            .filter(|&(_, w)| w >= floor_w)
            .collect();
        let total: u128 = kept.iter().map(|&(_, w)| w as u128).sum();
        let mut n = kept.len();
        if s.top_p < 1.0 {
            let p = (s.top_p as f64 * 2f64.powi(32)).round() as u128;
            let need = (total * p).div_ceil(1 << 32).max(1);
            let mut acc = 0u128;
            n = kept
                .iter()
                .position(|&(_, w)| {
                    acc += w as u128;
                    acc >= need
                })
                .unwrap()
                + 1;
        }
        let k: u128 = kept[..n].iter().map(|&(_, w)| w as u128).sum();
        let target = ((xoshiro256ss_next(&mut s.rng) >> 11) as u128 * k) >> 53;
        let mut acc = 0u128;
        kept[..n]
            .iter()
            .find(|&&(_, w)| {
                acc += w as u128;
                acc > target
            })
            .map(|&(i, _)| i)
    }

    #[test]
    fn portable_exp_matches_exp() {
        assert_eq!(portable_exp(0.0), 1.0);
        assert_eq!(weight(0.0), 1 << WEIGHT_BITS);
        let mut worst = 0f64;
        for i in 0..=320_000 {
            let d = -(i as f64) * 1e-4;
            let rel = (portable_exp(d) - d.exp()).abs() / d.exp();
            worst = worst.max(rel);
        }
        assert!(worst < 2e-11, "relative error {worst:e}");
        assert_eq!(weight(-23.0), 0);
        assert_eq!(weight(-23.5), 0);
        assert_eq!(weight(f64::NEG_INFINITY), 0);
        assert_eq!(weight(f64::NAN), 0);
        // The floor of the scaled exponential, for every d the weights can take.
        for i in 0..=230_000 {
            let d = -(i as f64) * 1e-4;
            assert_eq!(
                weight(d),
                (portable_exp(d) * 2f64.powi(32)).floor() as u64,
                "d = {d}"
            );
        }
    }

    #[test]
    fn radix_selection_equals_the_sorted_walk_on_adversarial_rows() {
        let mut rng = [0x1234_5678_9abc_def0u64, 7, 11, 13];
        let mut next = move || xoshiro256ss_next(&mut rng);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        // Every value equal: the order is the index order only.
        rows.push(vec![0.25; 3000]);
        // Values a few ulps apart, many exact duplicates, both zeros, non-finite entries.
        rows.push(
            (0..5000)
                .map(|i| match i % 7 {
                    0 => f32::from_bits(0x3f80_0000 + (i % 5) as u32),
                    1 => 0.0,
                    2 => -0.0,
                    3 => f32::NAN,
                    4 => f32::NEG_INFINITY,
                    _ => f32::from_bits(0x3f80_0000 - (i % 3) as u32),
                })
                .collect(),
        );
        // Flat random logits (a model with random weights) and a peaked row, wide.
        rows.push(
            (0..248_320)
                .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 0.2 - 0.1)
                .collect(),
        );
        rows.push(
            (0..65_536)
                .map(|i| {
                    let x = (next() >> 40) as f32 / (1u64 << 24) as f32;
                    if i % 997 == 3 {
                        12.0 + x
                    } else {
                        x * 4.0 - 8.0
                    }
                })
                .collect(),
        );
        // Ties across radix digits: values sharing the high key bits, differing low.
        rows.push(
            (0..20_000)
                .map(|i| {
                    f32::from_bits(0x4000_0000 | ((i * 2_654_435_761u64 as usize) as u32 & 0xfff))
                })
                .collect(),
        );
        let configs = [
            (1.0f32, 0usize, 1.0f32, 0.0f32),
            (0.7, 0, 0.9, 0.0),
            (1.3, 50, 1.0, 0.0),
            (0.5, 7, 0.5, 0.0),
            (1.0, 0, 1.0, 0.05),
            (1e-3, 0, 0.95, 0.0),
            (80.0, 0, 0.3, 0.0),
            (1.0, 0, 1e-7, 0.0),
            (0.9, 40_000, 0.99, 0.001),
        ];
        for (r, row) in rows.iter().enumerate() {
            for (c, &(t, k, p, mp)) in configs.iter().enumerate() {
                let mut a = SamplerState::seeded(r as u64 * 31 + c as u64, t, k, p).with_min_p(mp);
                let mut b = a.clone();
                let draws = if row.len() > 100_000 { 3 } else { 24 };
                for draw in 0..draws {
                    let x = a.sample(row);
                    let y = sample_by_sorting(&mut b, row);
                    assert_eq!(x, y, "row {r}, config {c}, draw {draw}");
                    assert_eq!(a.rng, b.rng);
                }
            }
        }
    }

    #[test]
    fn penalties_follow_the_spec() {
        let row = [2.0f32, -1.0, 0.5, 3.0, 1.0];
        let history = [0u32, 3, 3, 1, 4, 3]; // from position 2 on: 3, 1, 4, 3
        let mut s = SamplerState::greedy().with_penalties(0.5, 0.25, 2.0);
        s.penalty_from = 2;
        let p = s.penalize(&row, &history).unwrap();
        // token 0: seen (prompt only): 2 / 2 = 1; not generated.
        // token 1: seen, negative: -1 * 2 = -2; generated once: (-2 - 0.5) - 0.25 = -2.75.
        // token 2: untouched. token 3: 3 / 2 = 1.5; generated twice: (1.5 - 0.5) - 0.5 = 0.5.
        // token 4: 1 / 2 = 0.5; once: (0.5 - 0.5) - 0.25 = -0.25.
        assert_eq!(p, vec![1.0, -2.75, 0.5, 0.5, -0.25]);
        // Greedy on the penalized row: token 0 (1.0) instead of token 3.
        assert_eq!(s.clone().sample(&p), Some(0));
        assert!(SamplerState::greedy().penalize(&row, &history).is_none());
        assert!(s.validate().is_ok());
        assert!(
            SamplerState::greedy()
                .with_penalties(2.5, 0.0, 1.0)
                .validate()
                .is_err()
        );
        assert!(
            SamplerState::greedy()
                .with_penalties(0.0, 0.0, 0.0)
                .validate()
                .is_err()
        );
        // Out-of-vocabulary history ids are ignored, not a panic.
        assert!(s.penalize(&row, &[99, 100]).is_some());
        // As a list (what a device sampler applies): distinct ids in order, generated counts.
        let l = s.penalty_list(&history, row.len()).unwrap();
        assert_eq!(l.entries, vec![[0, 0], [1, 1], [3, 2], [4, 1]]);
        assert_eq!((l.repetition, l.counted()), (Some(2.0), true));
        // Without a repetition penalty only the generated tokens are listed.
        let mut g = SamplerState::greedy().with_penalties(0.5, 0.0, 1.0);
        g.penalty_from = 2;
        let l = g.penalty_list(&[0, 3, 3, 1, 4, 3, 9], 5).unwrap();
        assert_eq!(
            (l.entries, l.repetition),
            (vec![[1, 1], [3, 2], [4, 1]], None)
        );
        assert_eq!(
            g.penalize(&row, &history).unwrap(),
            vec![2.0, -1.5, 0.5, 2.5, 0.5]
        );
    }

    #[test]
    fn exp_neg_f32_is_accurate() {
        let mut worst = 0f64;
        for i in 0..=87_000 {
            let d = -(i as f32) * 1e-3;
            let got = exp_neg_f32(d) as f64;
            let want = (d as f64).exp();
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 5e-7, "relative error {worst:e}");
        assert_eq!(exp_neg_f32(0.0), 1.0);
    }

    #[test]
    fn logprobs_are_the_log_softmax() {
        // Logits ln 1, ln 2, ln 3, ln 4 (+ a NaN and -inf): p = 0.1, 0.2, 0.3, 0.4.
        let row = [
            0.0f32,
            2f32.ln(),
            f32::NAN,
            3f32.ln(),
            4f32.ln(),
            f32::NEG_INFINITY,
        ];
        let l = logprobs(&row, 3, 3).unwrap();
        assert_eq!(l.token, 3);
        assert!((l.logprob as f64 - 0.3f64.ln()).abs() < 1e-6, "{l:?}");
        let ids: Vec<u32> = l.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![4, 3, 1]);
        for ((_, got), p) in l.top.iter().zip([0.4f64, 0.3, 0.2]) {
            assert!((*got as f64 - p.ln()).abs() < 1e-6);
        }
        // Non-finite logits: -inf, never among the top.
        assert_eq!(logprobs(&row, 2, 20).unwrap().logprob, f32::NEG_INFINITY);
        assert_eq!(logprobs(&row, 2, 20).unwrap().top.len(), 4);
        // Ties: the smaller id first; at most MAX_TOP_LOGPROBS.
        let flat = vec![1.5f32; 100];
        let l = logprobs(&flat, 7, 50).unwrap();
        assert_eq!(l.top.len(), MAX_TOP_LOGPROBS);
        assert_eq!(l.top[0].0, 0);
        assert_eq!(l.top[19].0, 19);
        assert!((l.logprob as f64 + 100f64.ln()).abs() < 1e-5);
        // Large logits do not overflow.
        let big = [1e30f32, 1e30 - 1e24, -1e30];
        let l = logprobs(&big, 0, 1).unwrap();
        assert!(l.logprob <= 0.0 && l.logprob.is_finite());
        assert!(logprobs(&[f32::NAN], 0, 1).is_none());
    }

    #[test]
    fn min_p_drops_the_unlikely() {
        // Relative probabilities 1, e^-1, e^-3: min_p 0.2 keeps the first two.
        let logits = [0.0f32, -1.0, -3.0];
        let mut s = SamplerState::seeded(5, 1.0, 0, 1.0).with_min_p(0.2);
        let mut seen = [0usize; 3];
        for _ in 0..3000 {
            seen[s.sample(&logits).unwrap() as usize] += 1;
        }
        assert!(seen[0] > 0 && seen[1] > 0 && seen[2] == 0, "{seen:?}");
        let mut bad = SamplerState::seeded(1, 1.0, 0, 1.0).with_min_p(1.5);
        assert!(bad.validate().is_err());
        bad.min_p = f32::NAN;
        assert!(bad.validate().is_err());
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
