//! `qwen3_5_text` / `qwen3_5` (and their MoE variants `qwen3_5_moe_text` / `qwen3_5_moe`).

use super::*;

pub(super) fn qwen35(cfg: &Cfg, model_type: &str, opts: &HfOptions) -> Result<ModelIr> {
    let default_name = if model_type == "qwen3_5_text" {
        "qwen3_5_text"
    } else {
        model_type
    };
    let c = common(cfg, default_name, opts, false)?;
    let n_layers = cfg.pos("num_hidden_layers")?;
    let eps = cfg.opt_f64("rms_norm_eps")?.unwrap_or(1e-6);
    if let Some(act) = cfg.opt_str("hidden_act")?
        && act != "silu"
    {
        return Err(HfError::Unsupported(format!(
            "hidden_act `{act}` (Qwen3.5 MLPs are SwiGLU with silu)"
        )));
    }
    // Which layers hold a sparse MoE block: every layer of a `*_moe*` model (or one with
    // `num_experts`), except those in `mlp_only_layers` and those `decoder_sparse_step` skips.
    let moe_model = model_type.contains("moe") || cfg.opt_usize("num_experts")?.unwrap_or(0) > 0;
    let sparse: Vec<bool> = if moe_model {
        let only = cfg.opt_usizes("mlp_only_layers")?.unwrap_or_default();
        let step = cfg.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
        (0..n_layers)
            .map(|i| !only.contains(&i) && (i + 1) % step == 0)
            .collect()
    } else {
        vec![false; n_layers]
    };
    let moe = match sparse.iter().any(|&s| s) {
        true => Some(MlpIr::Moe(moe::qwen35(cfg)?)),
        false => None,
    };
    let dense = match sparse.iter().all(|&s| s) {
        true => None,
        false => Some(MlpIr::Swiglu {
            intermediate: cfg.pos("intermediate_size")?,
        }),
    };

    let q_heads = cfg.pos("num_attention_heads")?;
    let kv_heads = cfg.pos("num_key_value_heads")?;
    let head_dim = match cfg.opt_usize("head_dim")? {
        Some(d) => d,
        None => {
            divides("hidden_size / num_attention_heads", q_heads, c.hidden)?;
            c.hidden / q_heads
        }
    };
    divides(
        "num_attention_heads / num_key_value_heads",
        kv_heads,
        q_heads,
    )?;
    let output_gate = cfg.opt_bool("attn_output_gate")?.unwrap_or(true);
    let attn = AttentionIr {
        q_heads,
        kv_heads,
        head_dim,
        qk_norm: true,
        rope: Some(rope(cfg, head_dim, 0.25)?),
        output_gate,
    };

    let gdn_keys = [
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    ];
    let types: Vec<bool> = match cfg.opt_strings("layer_types")? {
        Some(types) => {
            if types.len() != n_layers {
                return Err(HfError::Invalid(format!(
                    "{} has {} entries but {} is {n_layers}",
                    cfg.key("layer_types"),
                    types.len(),
                    cfg.key("num_hidden_layers")
                )));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match *t {
                    "full_attention" => Ok(true),
                    "linear_attention" => Ok(false),
                    other => Err(HfError::BadValue {
                        key: format!("{}[{i}]", cfg.key("layer_types")),
                        expected: "\"full_attention\" or \"linear_attention\"".into(),
                        found: format!("\"{other}\""),
                    }),
                })
                .collect::<Result<_>>()?
        }
        None => {
            let interval = match cfg.opt_usize("full_attention_interval")? {
                Some(0) => {
                    return Err(HfError::BadValue {
                        key: cfg.key("full_attention_interval"),
                        expected: "a positive integer".into(),
                        found: "0".into(),
                    });
                }
                Some(i) => i,
                None => {
                    return Err(HfError::Missing {
                        key: cfg.key("layer_types (or full_attention_interval)"),
                    });
                }
            };
            (0..n_layers).map(|i| (i + 1) % interval == 0).collect()
        }
    };
    let gdn = if types.iter().any(|full| !full) {
        let key_heads = cfg.pos(gdn_keys[0])?;
        let value_heads = cfg.pos(gdn_keys[1])?;
        divides(
            "linear_num_value_heads / linear_num_key_heads",
            key_heads,
            value_heads,
        )?;
        let conv = cfg.pos(gdn_keys[4])?;
        if conv < 2 {
            return Err(HfError::Invalid(format!(
                "{} must be at least 2",
                cfg.key(gdn_keys[4])
            )));
        }
        Some(GatedDeltaNetIr {
            key_heads,
            value_heads,
            key_dim: cfg.pos(gdn_keys[2])?,
            value_dim: cfg.pos(gdn_keys[3])?,
            conv,
            norm_order: GateOrder::NormThenGate,
        })
    } else {
        None
    };
    let layer = |full: bool, sparse: bool| {
        let (kind, mixer) = match (full, &gdn) {
            (false, Some(g)) => ("gated_deltanet", MixerIr::GatedDeltanet(g.clone())),
            // `gdn` is read whenever a linear-attention layer exists.
            _ => ("attention", MixerIr::Attention(attn.clone())),
        };
        let (kind, mlp) = match sparse {
            true => (format!("{kind}_moe"), moe.clone()),
            false => (kind.to_string(), dense.clone()),
        };
        LayerIr {
            kind,
            mixer: Some(mixer),
            mlp,
        }
    };
    let layers = types
        .iter()
        .zip(&sparse)
        .map(|(&full, &sparse)| layer(full, sparse))
        .collect();
    // The MTP layer is an attention layer with the MLP of the main stack's last layer.
    let attn_layer = layer(true, sparse.last().copied().unwrap_or(false));
    let mtp = match cfg.opt_usize("mtp_num_hidden_layers")? {
        Some(n) if n > 0 => Some(MtpIr {
            layers: vec![attn_layer; n],
        }),
        _ => None,
    };
    let norm = NormIr {
        eps: F64(eps),
        weight: NormWeight::OnePlus,
    };
    Ok(finish(c, norm, layers, mtp, WeightNaming::Qwen35))
}
