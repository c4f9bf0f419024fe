//! Deterministic random weights, for demos, benchmarks and tests.
//!
//! Every element is a pure function of (seed, buffer index, element index) — SplitMix64's
//! finaliser over a counter — so any backend can generate any buffer in any order and get the
//! same values: the CPU backend on the host, the CUDA backend in place on the device
//! (`kernels/init.cu` reproduces [`Init::value`]). The seed is what a random-weight model's
//! fingerprint covers instead of a digest of the data.

use crate::backend::HostWeights;
use flashrt_ir::{Compiled, NormWeight, Op, Role};

/// SplitMix64's finaliser: a bijective 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How one weight buffer is initialised by [`random_weights`]. The discriminants are part of
/// the contract with the CUDA backend's `init_random` kernel, which reproduces the values on
/// the device.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(u32)]
pub enum Init {
    /// `mean + std * N(0, 1)` (Box-Muller).
    Normal { mean: f64, std: f64 } = 0,
    /// `U(lo, hi)`.
    Uniform { lo: f64, hi: f64 } = 1,
    /// `log(U(lo, hi))` (decay rates A = exp(A_log) in [lo, hi]).
    LogUniform { lo: f64, hi: f64 } = 2,
    /// Inverse softplus of a log-uniform dt in `[lo, hi]`.
    InvSoftplusDt { lo: f64, hi: f64 } = 3,
}

impl Init {
    /// `(kind, a, b)` as the device kernel takes them.
    pub fn params(self) -> (u32, f64, f64) {
        match self {
            Init::Normal { mean, std } => (0, mean, std),
            Init::Uniform { lo, hi } => (1, lo, hi),
            Init::LogUniform { lo, hi } => (2, lo, hi),
            Init::InvSoftplusDt { lo, hi } => (3, lo, hi),
        }
    }

    /// Element `i` of buffer `buffer` for `seed`: a pure function of its arguments
    /// (counter-based), so any backend can generate any element independently.
    pub fn value(self, seed: u64, buffer: u32, i: u64) -> f32 {
        let key = mix64(seed ^ mix64(((buffer as u64) << 1) | 1));
        // Uniform in (0, 1): 53 random bits, centred in their interval.
        let u = |k: u64| ((mix64(key ^ k) >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
        let (u1, u2) = (u(2 * i), u(2 * i + 1));
        (match self {
            Init::Normal { mean, std } => {
                mean + std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            }
            Init::Uniform { lo, hi } => lo + (hi - lo) * u1,
            Init::LogUniform { lo, hi } => (lo + (hi - lo) * u1).ln(),
            Init::InvSoftplusDt { lo, hi } => {
                let dt = (lo.ln() + (hi.ln() - lo.ln()) * u1).exp();
                dt + (-(-dt).exp_m1()).ln()
            }
        }) as f32
    }
}

/// Deterministic random weights with sensible scales, for demos and benchmarks: projections
/// and embeddings N(0, 0.02); norm scales near 1 (near 0 for `1 + w` norms); conv kernels
/// U(±1/√K); decay rates `A_log = log U(1, 16)`; `dt_bias` = softplus⁻¹ of dt ∈ [1e-3, 0.1];
/// Mamba2 `D` near 1; biases 0. Each buffer draws from its own stream (seed, buffer index).
/// A quantized weight gets values like any other (a backend quantizes them as it loads them)
/// and its scale buffer none.
pub fn random_weights(compiled: &Compiled, seed: u64) -> HostWeights {
    let inits = weight_inits(compiled);
    let tensors = compiled
        .layout
        .buffers
        .iter()
        .map(|b| {
            inits[b.id.index()].map(|init| {
                (0..b.numel() as u64)
                    .map(|i| init.value(seed, b.id.0, i))
                    .collect()
            })
        })
        .collect();
    HostWeights { tensors }
}

/// The initialiser of every weight buffer (`None` for other buffers), chosen by how the plans
/// use it: norms near their identity, projections N(0, 0.02), conv taps uniform, decay rates
/// and dt biases in ranges that keep the recurrences stable.
pub fn weight_inits(compiled: &Compiled) -> Vec<Option<Init>> {
    let layout = &compiled.layout;
    let mut init: Vec<Option<Init>> = vec![None; layout.buffers.len()];
    let mut set = |id: flashrt_ir::BufferId, i: Init| {
        let slot = &mut init[id.index()];
        if slot.is_none() {
            *slot = Some(i);
        }
    };
    const ZERO: Init = Init::Normal {
        mean: 0.0,
        std: 0.0,
    };
    let small = Init::Normal {
        mean: 0.0,
        std: 0.02,
    };
    let near_one = Init::Normal {
        mean: 1.0,
        std: 0.02,
    };
    let dt = Init::InvSoftplusDt { lo: 1e-3, hi: 0.1 };
    for plan in &compiled.plans {
        for op in &plan.ops {
            match op {
                Op::Embed { table, .. } => set(*table, small),
                Op::Linear { w, bias, .. } => {
                    set(*w, small);
                    if let Some(b) = bias {
                        set(*b, ZERO);
                    }
                }
                Op::RmsNorm {
                    weight: Some(w),
                    weight_kind,
                    ..
                } => set(
                    *w,
                    match weight_kind {
                        NormWeight::Plain => near_one,
                        NormWeight::OnePlus => small,
                    },
                ),
                Op::GatedRmsNorm { weight, .. } => set(*weight, near_one),
                Op::CausalConv1d {
                    weight,
                    bias,
                    kernel,
                    ..
                } => {
                    let a = 1.0 / (*kernel as f64).sqrt();
                    set(*weight, Init::Uniform { lo: -a, hi: a });
                    if let Some(b) = bias {
                        set(*b, ZERO);
                    }
                }
                Op::GatedDeltaNet { a_log, dt_bias, .. } => {
                    set(*a_log, Init::LogUniform { lo: 1.0, hi: 16.0 });
                    set(*dt_bias, dt);
                }
                Op::Mamba2Scan {
                    a_log, d, dt_bias, ..
                } => {
                    set(*a_log, Init::LogUniform { lo: 1.0, hi: 16.0 });
                    set(*d, near_one);
                    set(*dt_bias, dt);
                }
                _ => {}
            }
        }
    }
    // A quantized weight's scales are computed from its values when it loads.
    let scales: Vec<flashrt_ir::BufferId> = layout
        .buffers
        .iter()
        .filter_map(|b| b.quant.map(|q| q.scale))
        .collect();
    layout
        .buffers
        .iter()
        .map(|b| {
            (b.role == Role::Weight && !scales.contains(&b.id))
                .then(|| init[b.id.index()].unwrap_or(small))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_softplus_dt_round_trips() {
        // softplus(dt_bias) must give back a dt inside [1e-3, 0.1].
        let init = Init::InvSoftplusDt { lo: 1e-3, hi: 0.1 };
        for i in 0..1000 {
            let x = init.value(5, 3, i) as f64;
            let dt = x.exp().ln_1p();
            assert!(
                (1e-3 * 0.999..=0.1 * 1.001).contains(&dt),
                "element {i}: dt {dt}"
            );
        }
    }

    #[test]
    fn init_values_are_counter_based_and_well_spread() {
        let n = Init::Normal {
            mean: 0.0,
            std: 1.0,
        };
        // A pure function of (seed, buffer, index).
        assert_eq!(n.value(1, 2, 3), n.value(1, 2, 3));
        assert_ne!(n.value(1, 2, 3), n.value(1, 3, 3));
        assert_ne!(n.value(1, 2, 3), n.value(2, 2, 3));
        let v: Vec<f64> = (0..20000).map(|i| n.value(9, 1, i) as f64).collect();
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "mean {mean}, var {var}"
        );
        let u = Init::Uniform { lo: -2.0, hi: 3.0 };
        assert!(
            (0..1000)
                .map(|i| u.value(4, 0, i))
                .all(|x| (-2.0..=3.0).contains(&x))
        );
    }
}
