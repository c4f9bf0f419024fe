//! Weights: Hugging Face checkpoint folders and deterministic random weights.
//!
//! [`load_hf_weights`] maps every weight buffer of a compiled layout to the checkpoint tensor
//! named by its `source` (Hugging Face names), converting f32 / bf16 / f16 / f64 to f32.
//! Everything that does not fit is collected and reported in **one** error: missing tensors,
//! unexpected tensors, tensors whose shape does not match, unsupported dtypes, duplicates
//! across shards. Known extras are skipped: `mtp.*` (the runtime runs no MTP head yet), the
//! vision tower of multimodal checkpoints (`model.visual.*`, `visual.*`), `lm_head.weight` of
//! a tied model, and stored rotary `inv_freq` buffers.

use crate::backend::HostWeights;
use crate::error::{Error, Result};
use crate::safetensors::{Dtype, SafeTensors};
use flashrt_ir::{Compiled, NormWeight, Op, Role};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The safetensors files of a checkpoint folder: the shards named in
/// `model.safetensors.index.json` if present, else every `model*.safetensors`, else every
/// `*.safetensors` (so reference/state dumps beside a checkpoint are not taken for weights).
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let io = |e: std::io::Error| Error::Io {
        path: dir.display().to_string(),
        source: e,
    };
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::Io {
            path: index.display().to_string(),
            source: e,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Checkpoint(format!("{}: not valid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                Error::Checkpoint(format!("{}: no `weight_map` object", index.display()))
            })?;
        let mut files = BTreeSet::new();
        for (k, f) in map {
            let f = f.as_str().ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{}: weight_map[{k}] is not a string",
                    index.display()
                ))
            })?;
            if f.contains('/') || f.contains('\\') || f.contains("..") {
                return Err(Error::Checkpoint(format!(
                    "{}: shard name `{f}` is not a plain file name",
                    index.display()
                )));
            }
            files.insert(dir.join(f));
        }
        return Ok(files.into_iter().collect());
    }
    let mut all = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io)? {
        let p = e.map_err(io)?.path();
        if p.extension().is_some_and(|x| x == "safetensors") && p.is_file() {
            all.push(p);
        }
    }
    all.sort();
    let model: Vec<PathBuf> = all
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model"))
        })
        .cloned()
        .collect();
    let files = if model.is_empty() { all } else { model };
    if files.is_empty() {
        return Err(Error::Checkpoint(format!(
            "no *.safetensors file in {}",
            dir.display()
        )));
    }
    Ok(files)
}

/// Checkpoint tensors skipped silently.
fn ignorable(name: &str, tied: bool) -> bool {
    name.starts_with("mtp.")
        || name.starts_with("model.mtp.")
        || name.starts_with("model.visual.")
        || name.starts_with("visual.")
        || name.ends_with(".rotary_emb.inv_freq")
        || (tied && name == "lm_head.weight")
}

/// Other names a source tensor may carry in real checkpoints.
fn alternatives(source: &str) -> Vec<String> {
    let mut v = vec![source.to_string()];
    if let Some(rest) = source.strip_prefix("model.") {
        v.push(format!("model.language_model.{rest}"));
    }
    if let Some(rest) = source.strip_prefix("backbone.") {
        v.push(format!("model.{rest}"));
    }
    v
}

/// Shapes agree if they hold the same elements in the same order: equal after dropping
/// size-1 dims (a depthwise conv stored `[C, 1, K]` fills a `[C, K]` buffer).
fn same_shape(a: &[usize], b: &[usize]) -> bool {
    let sq = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    a.iter().product::<usize>() == b.iter().product::<usize>() && sq(a) == sq(b)
}

/// Load every weight buffer of `compiled` from the checkpoint in `dir`.
pub fn load_hf_weights(compiled: &Compiled, dir: &Path) -> Result<HostWeights> {
    let files = checkpoint_files(dir)?;
    let mut shards = Vec::with_capacity(files.len());
    for f in &files {
        shards.push(SafeTensors::read(f)?);
    }
    load_from_shards(compiled, &shards, &dir.display().to_string())
}

/// [`load_hf_weights`] over already-parsed files.
pub fn load_from_shards(
    compiled: &Compiled,
    shards: &[SafeTensors],
    origin: &str,
) -> Result<HostWeights> {
    let layout = &compiled.layout;
    let mut index: BTreeMap<&str, usize> = BTreeMap::new();
    let mut duplicates = Vec::new();
    for (i, s) in shards.iter().enumerate() {
        for name in s.tensors.keys() {
            if let Some(prev) = index.insert(name.as_str(), i) {
                duplicates.push(format!(
                    "{name} (in {} and {})",
                    shards[prev].origin, s.origin
                ));
            }
        }
    }
    let mut used: BTreeSet<&str> = BTreeSet::new();
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    let mut bad_dtype = Vec::new();
    let mut tensors: Vec<Option<Vec<f32>>> = vec![None; layout.buffers.len()];
    for b in layout.buffers.iter().filter(|b| b.role == Role::Weight) {
        let Some(source) = &b.source else {
            missing.push(format!(
                "{} (layout buffer without a checkpoint name)",
                b.name
            ));
            continue;
        };
        let found = alternatives(source)
            .into_iter()
            .find_map(|n| index.get_key_value(n.as_str()).map(|(k, &i)| (*k, i)));
        let Some((name, shard)) = found else {
            missing.push(source.clone());
            continue;
        };
        used.insert(name);
        let info = &shards[shard].tensors[name];
        if !same_shape(&info.shape, &b.shape) {
            misshaped.push(format!(
                "{name}: checkpoint {:?}, model expects {:?}",
                info.shape, b.shape
            ));
            continue;
        }
        if !matches!(
            info.dtype,
            Dtype::F32 | Dtype::F16 | Dtype::Bf16 | Dtype::F64
        ) {
            bad_dtype.push(format!("{name}: {}", info.dtype.name()));
            continue;
        }
        tensors[b.id.index()] = Some(shards[shard].f32(name)?);
    }
    let tied = compiled.ir.tied_embeddings;
    let unexpected: Vec<&str> = index
        .keys()
        .copied()
        .filter(|n| !used.contains(n) && !ignorable(n, tied))
        .collect();
    if missing.is_empty()
        && misshaped.is_empty()
        && unexpected.is_empty()
        && bad_dtype.is_empty()
        && duplicates.is_empty()
    {
        return Ok(HostWeights { tensors });
    }
    let mut msg = format!(
        "checkpoint {origin} does not match model `{}`:",
        compiled.ir.name
    );
    let mut section = |title: &str, items: &[String]| {
        if !items.is_empty() {
            msg.push_str(&format!("\n  {title} ({}):", items.len()));
            for it in items {
                msg.push_str(&format!("\n    {it}"));
            }
        }
    };
    section("missing tensors", &missing);
    section(
        "unexpected tensors",
        &unexpected.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    );
    section("misshaped tensors", &misshaped);
    section("unsupported dtypes", &bad_dtype);
    section("duplicate tensors", &duplicates);
    Err(Error::Checkpoint(msg))
}

/// SplitMix64: a tiny, well-mixed deterministic generator.
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
    layout
        .buffers
        .iter()
        .map(|b| (b.role == Role::Weight).then(|| init[b.id.index()].unwrap_or(small)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_rules() {
        assert!(same_shape(&[192, 1, 4], &[192, 4]));
        assert!(same_shape(&[64], &[64]));
        assert!(!same_shape(&[4, 192], &[192, 4]));
        assert!(!same_shape(&[64, 32], &[64, 16]));
    }

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
