//! Which plans run an append of `n` tokens: the chunk planner.
//!
//! A model has a closed set of plans: the decode step (1 row), the verify plans (`k + 1` rows,
//! computed the way a decode step computes a row) and one prefill plan per bucket. An append
//! of `n` tokens is a sequence of steps, each running one plan over up to its rows. Padding a
//! suffix up to the next bucket wastes the difference (65 tokens in the 512-row plan), and
//! chunking it by the largest bucket wastes the tail; so [`ChunkCosts::plan`] chooses the
//! sequence of plans whose predicted total cost is least, by dynamic programming over the
//! number of rows left (`best[i] = min over plans p of cost(p, min(rows_p, i)) + best[i -
//! min(rows_p, i)]`; a plan is always filled as far as it goes, which is optimal because a
//! step's cost never falls with its rows).
//!
//! A step's predicted cost is `fixed + per_row · rows`:
//!
//! * A device that runs a plan at its full rows whatever the input holds (the CUDA backend:
//!   captured graphs, padded GEMMs) has `per_row = 0`: its costs are measured per plan at
//!   start-up ([`crate::Model::calibrate_chunking`]: `flashrt serve` does this), or until then
//!   derived from the plan's rows ([`ChunkCosts::derived`]: a decode step is 1, a verify pass
//!   of `k + 1` rows `1 + 0.3 k`, a prefill chunk of `R` rows `1.1 + R / 200` — the shape the
//!   H200 measured for the 27B model).
//! * The CPU reference computes only the rows it is given: a step costs its rows plus a small
//!   per-step overhead, so the plan is the fewest chunks of the largest bucket, as before.
//!
//! Exactness does not depend on the choice: on the CPU reference every op is
//! chunking-invariant, so any sequence of plans leaves the same logits and state bit for bit;
//! on the CUDA backend decode and verify rows round identically (see the backend), and a
//! prefill chunk differs from another split of the same rows only by bf16 rounding, as a
//! restore at an unaligned boundary always has.

use flashrt_ir::{Compiled, Phase};
use std::fmt;

/// The predicted cost of one step with one plan: `fixed + per_row · rows` (milliseconds when
/// measured, units of a decode step when derived).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanCost {
    pub phase: Phase,
    pub fixed: f64,
    pub per_row: f64,
}

impl PlanCost {
    /// The most rows the plan takes.
    pub fn rows(&self) -> usize {
        self.phase.rows()
    }
    /// Predicted cost of one step over `rows` rows.
    pub fn cost(&self, rows: usize) -> f64 {
        self.fixed + self.per_row * rows as f64
    }
}

/// Where a cost table came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CostSource {
    /// From the plans' rows alone ([`ChunkCosts::derived`]).
    Derived,
    /// Timed on the device ([`crate::Model::calibrate_chunking`]).
    Measured,
    /// Given by the caller ([`crate::Model::set_chunk_costs`]).
    Given,
}

/// Predicted costs of a model's plans, and the planner over them.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkCosts {
    plans: Vec<PlanCost>,
    source: CostSource,
}

/// An append longer than this many largest-bucket chunks runs its head in largest-bucket
/// chunks and plans only the tail (the planner's table stays small for 100k-token prompts).
const PLANNED_CHUNKS: usize = 4;

impl ChunkCosts {
    /// Costs from the plans' rows: `padded` for a device whose step costs the plan's full rows
    /// whatever it is given (see the module docs).
    pub fn derived(compiled: &Compiled, padded: bool) -> ChunkCosts {
        Self::derived_for(token_plans(compiled), padded)
    }

    fn derived_for(phases: impl Iterator<Item = Phase>, padded: bool) -> ChunkCosts {
        let plans = phases
            .map(|phase| {
                let rows = phase.rows() as f64;
                if padded {
                    // The shape the H200 measured for the 27B model (2026-12-03, in decode
                    // steps): a verify pass 1.20 / 1.66 / 1.88 / 2.13 for k = 1..4, a prefill
                    // chunk 1.28 / 1.83 / 3.02 / 5.78 / 10.9 / 20.8 for 64 .. 4096 rows.
                    // Below 64 rows nothing was measured (a 32-row bucket's Gated DeltaNet
                    // runs one padded 64-row chunk, as 64 rows do): such a bucket is assumed
                    // no cheaper than 64 rows until timed.
                    let fixed = match phase {
                        Phase::Decode => 1.0,
                        Phase::Verify { k } => 1.0 + 0.3 * k as f64,
                        _ if rows < 64.0 => 1.1 + 64.0 / 200.0 + 0.01,
                        _ => 1.1 + rows / 200.0,
                    };
                    PlanCost {
                        phase,
                        fixed,
                        per_row: 0.0,
                    }
                } else {
                    PlanCost {
                        phase,
                        fixed: 0.25,
                        per_row: 1.0,
                    }
                }
            })
            .collect();
        ChunkCosts {
            plans,
            source: CostSource::Derived,
        }
    }

    /// A cost table for exactly these plans (each must be a plan of the model that takes
    /// tokens: decode, verify or prefill).
    pub fn new(plans: Vec<PlanCost>, source: CostSource) -> ChunkCosts {
        ChunkCosts { plans, source }
    }

    pub fn plans(&self) -> &[PlanCost] {
        &self.plans
    }
    pub fn source(&self) -> CostSource {
        self.source
    }

    /// The cheapest sequence of steps for `n` rows: `(plan, rows)` pairs, larger chunks first,
    /// rows summing to `n`. Empty for `n = 0` or a table without plans.
    pub fn plan(&self, n: usize) -> Vec<(Phase, usize)> {
        // One token is a decode step, whatever a (noisy) table says: the per-token path.
        if n == 1 && self.plans.iter().any(|p| p.phase == Phase::Decode) {
            return vec![(Phase::Decode, 1)];
        }
        let Some(largest) = self.plans.iter().max_by_key(|p| p.rows()) else {
            return Vec::new();
        };
        let big = largest.rows();
        // The head in largest-bucket chunks, the tail (at most PLANNED_CHUNKS of them) planned.
        let tail = if n > big * PLANNED_CHUNKS {
            n - (n - big * PLANNED_CHUNKS).div_ceil(big) * big
        } else {
            n
        };
        let mut out: Vec<(Phase, usize)> =
            std::iter::repeat_n((largest.phase, big), (n - tail) / big).collect();
        // best[i]: least cost of i rows, with the plan taken first and its chunk count.
        let mut best: Vec<(f64, usize, usize)> = vec![(0.0, usize::MAX, 0); tail + 1];
        for i in 1..=tail {
            let mut b = (f64::INFINITY, usize::MAX, usize::MAX);
            for (pi, p) in self.plans.iter().enumerate() {
                let r = p.rows().min(i);
                let (rest, _, chunks) = best[i - r];
                let c = (p.cost(r) + rest, pi, chunks + 1);
                // Ties: fewer steps, then the step that takes more rows (full chunks first,
                // the remainder last), then the plan with fewer rows (a decode step for one
                // token, not a partly filled prefill chunk of the same cost).
                let better = if (c.0 - b.0).abs() > 1e-9 {
                    c.0 < b.0
                } else if c.2 != b.2 {
                    c.2 < b.2
                } else {
                    let (br, bp) = (self.plans[b.1].rows().min(i), self.plans[b.1].rows());
                    r > br || (r == br && p.rows() < bp)
                };
                if b.1 == usize::MAX || better {
                    b = c;
                }
            }
            best[i] = b;
        }
        let mut i = tail;
        let mut steps = Vec::new();
        while i > 0 {
            let p = &self.plans[best[i].1];
            let r = p.rows().min(i);
            steps.push((p.phase, r));
            i -= r;
        }
        steps.sort_by_key(|s| std::cmp::Reverse(s.1));
        out.extend(steps);
        out
    }

    /// The predicted cost of [`ChunkCosts::plan`]`(n)`.
    pub fn predict(&self, n: usize) -> f64 {
        self.cost_of(&self.plan(n))
    }

    /// The predicted cost of running `steps` (`(plan, rows)`; plans not in the table count 0).
    pub fn cost_of(&self, steps: &[(Phase, usize)]) -> f64 {
        steps
            .iter()
            .map(|&(phase, rows)| {
                self.plans
                    .iter()
                    .find(|p| p.phase == phase)
                    .map_or(0.0, |p| p.cost(rows))
            })
            .sum()
    }
}

impl fmt::Display for ChunkCosts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.source {
            CostSource::Derived => " (decode steps)",
            _ => " ms",
        };
        for (i, p) in self.plans.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {:.3}", p.phase.label(), p.fixed)?;
            if p.per_row > 0.0 {
                write!(f, " + {:.4}/row", p.per_row)?;
            }
        }
        f.write_str(unit)
    }
}

/// The plans that take a model's tokens (decode, verify, prefill), in plan order.
pub fn token_plans(compiled: &Compiled) -> impl Iterator<Item = Phase> + '_ {
    compiled
        .plans
        .iter()
        .map(|p| p.phase)
        .filter(|p| !matches!(p, Phase::MtpDraft))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn padded(costs: &[(Phase, f64)]) -> ChunkCosts {
        ChunkCosts::new(
            costs
                .iter()
                .map(|&(phase, fixed)| PlanCost {
                    phase,
                    fixed,
                    per_row: 0.0,
                })
                .collect(),
            CostSource::Given,
        )
    }

    /// The 27B shape's costs as `flashrt serve` measured them on the H200 (ms, 2026-12-03,
    /// benches/results/2026-12-03-h200-chunk-planner).
    fn h200() -> ChunkCosts {
        padded(&[
            (Phase::Prefill { bucket: 64 }, 17.487),
            (Phase::Prefill { bucket: 256 }, 25.086),
            (Phase::Prefill { bucket: 512 }, 41.337),
            (Phase::Prefill { bucket: 1024 }, 79.095),
            (Phase::Prefill { bucket: 2048 }, 148.858),
            (Phase::Prefill { bucket: 4096 }, 283.958),
            (Phase::Decode, 13.676),
            (Phase::Verify { k: 1 }, 16.460),
            (Phase::Verify { k: 2 }, 22.677),
            (Phase::Verify { k: 3 }, 25.651),
            (Phase::Verify { k: 4 }, 29.181),
        ])
    }

    #[test]
    fn short_suffixes_take_the_decode_and_verify_plans() {
        let c = h200();
        assert_eq!(c.plan(1), vec![(Phase::Decode, 1)]);
        // Two rows: a verify pass (16.5 ms) beats the 64-row plan (17.5 ms) ...
        assert_eq!(c.plan(2), vec![(Phase::Verify { k: 1 }, 2)]);
        // ... three no longer do (22.7 ms), nor do two verify passes.
        for n in 3..=8 {
            assert_eq!(
                c.plan(n),
                vec![(Phase::Prefill { bucket: 64 }, n)],
                "n = {n}"
            );
        }
        // Were verify passes as cheap as a decode step, they would take up to five rows.
        let flat = padded(
            &c.plans()
                .iter()
                .map(|p| match p.phase {
                    Phase::Verify { .. } => (p.phase, 13.9),
                    _ => (p.phase, p.fixed),
                })
                .collect::<Vec<_>>(),
        );
        for n in 2..=5 {
            assert_eq!(flat.plan(n), vec![(Phase::Verify { k: n - 1 }, n)]);
        }
    }

    #[test]
    fn long_suffixes_are_split_rather_than_padded() {
        let c = h200();
        // 65 rows: the 256-row plan (25.1 ms) beats 64 + a decode step (31.2 ms) ...
        assert_eq!(c.plan(65), vec![(Phase::Prefill { bucket: 256 }, 65)]);
        // ... and without it, 64 + a decode step beats the 512-row plan.
        let ladder = ChunkCosts::new(
            c.plans()
                .iter()
                .filter(|p| p.phase != Phase::Prefill { bucket: 256 })
                .copied()
                .collect(),
            CostSource::Given,
        );
        assert_eq!(
            ladder.plan(65),
            vec![(Phase::Prefill { bucket: 64 }, 64), (Phase::Decode, 1)]
        );
        assert_eq!(c.plan(256), vec![(Phase::Prefill { bucket: 256 }, 256)]);
        assert_eq!(c.plan(1024), vec![(Phase::Prefill { bucket: 1024 }, 1024)]);
        // 1030 rows: 1024 + the 64-row plan for 6 beats the 2048-row plan and 1024 + a
        // verify pass + a decode step.
        assert_eq!(
            c.plan(1030),
            vec![
                (Phase::Prefill { bucket: 1024 }, 1024),
                (Phase::Prefill { bucket: 64 }, 6)
            ]
        );
        assert!((c.predict(1030) - (79.095 + 17.487)).abs() < 1e-9);
    }

    #[test]
    fn the_planner_finds_the_cheapest_cover() {
        let c = h200();
        for n in [1, 2, 6, 9, 33, 64, 65, 70, 130, 300, 513, 700] {
            let want = brute_memo(&c, n);
            let got = c.predict(n);
            assert!(
                (got - want).abs() < 1e-6,
                "n = {n}: planner {got}, best {want}"
            );
            assert_eq!(c.plan(n).iter().map(|x| x.1).sum::<usize>(), n);
        }
        // A small table, every n up to two chunks of its largest plan.
        let small = padded(&[
            (Phase::Prefill { bucket: 4 }, 2.5),
            (Phase::Decode, 1.0),
            (Phase::Verify { k: 1 }, 1.1),
        ]);
        for n in 1..=9 {
            assert!(
                (small.predict(n) - brute_memo(&small, n)).abs() < 1e-9,
                "n = {n}"
            );
        }
    }

    /// The least cost of `n` rows over every split and every fill (exhaustive recurrence).
    fn brute_memo(c: &ChunkCosts, n: usize) -> f64 {
        let mut best = vec![f64::INFINITY; n + 1];
        best[0] = 0.0;
        for i in 1..=n {
            for p in c.plans() {
                for r in 1..=p.rows().min(i) {
                    best[i] = best[i].min(p.cost(r) + best[i - r]);
                }
            }
        }
        best[n]
    }

    /// Before the start-up measurement, the derived costs choose the plans the H200's
    /// measured costs choose (from 1 to 3000 rows, allowing ties within 10 %).
    #[test]
    fn derived_device_costs_choose_as_the_measurements_do() {
        let measured = h200();
        let derived = ChunkCosts::derived_for(measured.plans().iter().map(|p| p.phase), true);
        for n in (1..=80).chain((81..=3000).step_by(37)) {
            let (a, b) = (measured.plan(n), derived.plan(n));
            if a != b {
                // Where they differ, the derived choice costs at most 10 % more when measured.
                assert!(
                    measured.cost_of(&b) <= measured.cost_of(&a) * 1.1,
                    "n = {n}: measured {a:?}, derived {b:?}"
                );
            }
        }
    }

    #[test]
    fn the_cpu_keeps_the_largest_chunks() {
        let c = ChunkCosts::new(
            [16usize, 128]
                .iter()
                .map(|&b| PlanCost {
                    phase: Phase::Prefill { bucket: b },
                    fixed: 0.25,
                    per_row: 1.0,
                })
                .chain([PlanCost {
                    phase: Phase::Decode,
                    fixed: 0.25,
                    per_row: 1.0,
                }])
                .collect(),
            CostSource::Derived,
        );
        assert_eq!(
            c.plan(300),
            vec![
                (Phase::Prefill { bucket: 128 }, 128),
                (Phase::Prefill { bucket: 128 }, 128),
                (Phase::Prefill { bucket: 128 }, 44)
            ]
        );
        assert_eq!(c.plan(1), vec![(Phase::Decode, 1)]);
    }

    #[test]
    fn long_prompts_run_their_head_in_the_largest_bucket() {
        let c = h200();
        let p = c.plan(100_000);
        assert_eq!(p.iter().map(|x| x.1).sum::<usize>(), 100_000);
        assert!(
            p[..20]
                .iter()
                .all(|&x| x == (Phase::Prefill { bucket: 4096 }, 4096))
        );
        assert_eq!(c.plan(0), vec![]);
    }
}
