//! `lfm2` and `lfm2_moe`.

use super::*;

/// LFM2's real MLP width: with `block_auto_adjust_ff_dim`,
/// `m * ceil(int(mult * int(2 * intermediate / 3)) / m)` (`m = block_multiple_of`,
/// `mult = block_ffn_dim_multiplier`, skipped when null).
pub fn lfm2_mlp_width(
    intermediate: usize,
    auto_adjust: bool,
    multiplier: Option<f64>,
    multiple_of: usize,
) -> usize {
    if !auto_adjust {
        return intermediate;
    }
    let mut w = 2 * intermediate / 3;
    if let Some(m) = multiplier {
        w = (m * w as f64) as usize;
    }
    let m = multiple_of.max(1);
    w.div_ceil(m) * m
}

pub(super) fn lfm2(cfg: &Cfg, model_type: &str, opts: &HfOptions) -> Result<ModelIr> {
    let c = common(cfg, model_type, opts, true)?;
    let is_moe = model_type == "lfm2_moe";
    let n_layers = cfg.pos_alias(&["num_hidden_layers", "num_layers"])?;
    let eps = cfg
        .opt_f64("norm_eps")?
        .or(cfg.opt_f64("block_norm_eps")?)
        .unwrap_or(1e-5);
    let q_heads = cfg.pos("num_attention_heads")?;
    let kv_heads = cfg.pos("num_key_value_heads")?;
    divides("hidden_size / num_attention_heads", q_heads, c.hidden)?;
    divides(
        "num_attention_heads / num_key_value_heads",
        kv_heads,
        q_heads,
    )?;
    let head_dim = match cfg.opt_usize("head_dim")? {
        Some(d) => d,
        None => c.hidden / q_heads,
    };
    let attn = AttentionIr {
        q_heads,
        kv_heads,
        head_dim,
        qk_norm: true,
        rope: Some(rope(cfg, head_dim, 1.0)?),
        output_gate: false,
    };
    let conv = cfg.pos("conv_L_cache")?;
    if conv < 2 {
        return Err(HfError::Invalid(format!(
            "{} must be at least 2",
            cfg.key("conv_L_cache")
        )));
    }
    let sc = ShortConvIr {
        conv,
        bias: cfg.opt_bool("conv_bias")?.unwrap_or(false),
    };
    let intermediate = cfg.pos_alias(&["intermediate_size", "block_ff_dim"])?;
    // `lfm2_moe`'s dense layers are exactly `intermediate_size` wide (no auto-adjust).
    let auto = !is_moe && cfg.opt_bool("block_auto_adjust_ff_dim")?.unwrap_or(false);
    let width = lfm2_mlp_width(
        intermediate,
        auto,
        cfg.opt_f64("block_ffn_dim_multiplier")?,
        cfg.opt_usize("block_multiple_of")?.unwrap_or(256),
    );
    if width == 0 {
        return Err(HfError::Invalid("the adjusted MLP width is 0".into()));
    }
    let mlp = MlpIr::Swiglu {
        intermediate: width,
    };
    // `lfm2_moe`: layers `0..num_dense_layers` dense, every later one a sparse MoE block.
    let (dense_layers, moe) = if is_moe {
        let d = cfg.opt_usize("num_dense_layers")?.unwrap_or(0);
        let moe = (d < n_layers).then(|| moe::lfm2(cfg)).transpose()?;
        (d, moe.map(MlpIr::Moe))
    } else {
        (n_layers, None)
    };

    let is_attn: Vec<bool> = match cfg.opt_strings("layer_types")? {
        Some(types) => {
            if types.len() != n_layers {
                return Err(HfError::Invalid(format!(
                    "layer_types has {} entries but num_hidden_layers is {n_layers}",
                    types.len()
                )));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match *t {
                    "full_attention" | "attention" => Ok(true),
                    "conv" | "short_conv" => Ok(false),
                    other => Err(HfError::BadValue {
                        key: format!("layer_types[{i}]"),
                        expected: "\"conv\" or \"full_attention\"".into(),
                        found: format!("\"{other}\""),
                    }),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let idxs = cfg
                .opt_usizes("full_attn_idxs")?
                .ok_or_else(|| HfError::Missing {
                    key: "layer_types (or full_attn_idxs)".into(),
                })?;
            let mut v = vec![false; n_layers];
            for (i, &ix) in idxs.iter().enumerate() {
                if ix >= n_layers {
                    return Err(HfError::BadValue {
                        key: format!("full_attn_idxs[{i}]"),
                        expected: format!("a layer index < {n_layers}"),
                        found: ix.to_string(),
                    });
                }
                v[ix] = true;
            }
            v
        }
    };
    let layers = is_attn
        .iter()
        .enumerate()
        .map(|(i, &a)| {
            let (kind, mixer) = if a {
                ("attention", MixerIr::Attention(attn.clone()))
            } else {
                ("short_conv", MixerIr::ShortConv(sc.clone()))
            };
            let (kind, mlp) = match (&moe, i >= dense_layers) {
                (Some(m), true) => (format!("{kind}_moe"), m.clone()),
                _ => (kind.to_string(), mlp.clone()),
            };
            LayerIr {
                kind,
                mixer: Some(mixer),
                mlp: Some(mlp),
            }
        })
        .collect();
    let norm = NormIr {
        eps: F64(eps),
        weight: NormWeight::Plain,
    };
    Ok(finish(c, norm, layers, None, WeightNaming::Lfm2))
}
