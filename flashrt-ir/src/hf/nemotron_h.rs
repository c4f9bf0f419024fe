//! `nemotron_h` (Mamba2, attention, MLP and MoE blocks).

use super::*;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Block {
    Mamba,
    Attention,
    Mlp,
    Moe,
}

pub(super) fn nemotron_h(cfg: &Cfg, opts: &HfOptions) -> Result<ModelIr> {
    let c = common(cfg, "nemotron_h", opts, false)?;
    let eps = cfg
        .opt_f64("layer_norm_epsilon")?
        .or(cfg.opt_f64("rms_norm_eps")?)
        .unwrap_or(1e-5);
    let blocks: Vec<Block> = if let Some(types) = cfg.opt_strings("layers_block_type")? {
        types
            .iter()
            .enumerate()
            .map(|(i, t)| match *t {
                "mamba" | "mamba2" | "linear_attention" => Ok(Block::Mamba),
                "attention" | "full_attention" => Ok(Block::Attention),
                "mlp" => Ok(Block::Mlp),
                "moe" => Ok(Block::Moe),
                other => Err(HfError::BadValue {
                    key: format!("layers_block_type[{i}]"),
                    expected: "\"mamba\", \"attention\", \"mlp\" or \"moe\"".into(),
                    found: format!("\"{other}\""),
                }),
            })
            .collect::<Result<_>>()?
    } else if let Some(p) = cfg.opt_str("hybrid_override_pattern")? {
        p.chars()
            .enumerate()
            .map(|(i, ch)| match ch {
                'M' => Ok(Block::Mamba),
                '*' => Ok(Block::Attention),
                '-' => Ok(Block::Mlp),
                'E' => Ok(Block::Moe),
                other => Err(HfError::BadValue {
                    key: format!("hybrid_override_pattern[{i}]"),
                    expected: "one of 'M', '*', '-', 'E'".into(),
                    found: format!("'{other}'"),
                }),
            })
            .collect::<Result<_>>()?
    } else {
        return Err(HfError::Missing {
            key: "layers_block_type (or hybrid_override_pattern)".into(),
        });
    };
    if blocks.is_empty() {
        return Err(HfError::Invalid("the layer list is empty".into()));
    }
    if let Some(n) = cfg.opt_usize("num_hidden_layers")?
        && n != blocks.len()
    {
        return Err(HfError::Invalid(format!(
            "num_hidden_layers is {n} but the block pattern has {} entries",
            blocks.len()
        )));
    }

    let attn = if blocks.contains(&Block::Attention) {
        let q_heads = cfg.pos("num_attention_heads")?;
        let kv_heads = cfg.pos("num_key_value_heads")?;
        divides(
            "num_attention_heads / num_key_value_heads",
            kv_heads,
            q_heads,
        )?;
        let head_dim = match cfg
            .opt_usize("head_dim")?
            .or(cfg.opt_usize("attention_head_dim")?)
        {
            Some(d) => d,
            None => {
                divides("hidden_size / num_attention_heads", q_heads, c.hidden)?;
                c.hidden / q_heads
            }
        };
        if cfg.opt_bool("attention_bias")?.unwrap_or(false) {
            return Err(HfError::Unsupported("attention_bias = true".into()));
        }
        Some(AttentionIr {
            q_heads,
            kv_heads,
            head_dim,
            qk_norm: false,
            rope: None,
            output_gate: false,
        })
    } else {
        None
    };
    let mamba = if blocks.contains(&Block::Mamba) {
        let heads = cfg.pos("mamba_num_heads")?;
        let groups = cfg.pos("n_groups")?;
        divides("mamba_num_heads / n_groups", groups, heads)?;
        let conv = cfg.pos("conv_kernel")?;
        if conv < 2 {
            return Err(HfError::Invalid("conv_kernel must be at least 2".into()));
        }
        if cfg.opt_bool("mamba_proj_bias")?.unwrap_or(false) {
            return Err(HfError::Unsupported("mamba_proj_bias = true".into()));
        }
        if let Some(act) = cfg.opt_str("mamba_hidden_act")?
            && act != "silu"
        {
            return Err(HfError::Unsupported(format!("mamba_hidden_act `{act}`")));
        }
        // HF clamps dt below at `time_step_min` on its multi-token path (the decode path does
        // not); a cold forward over any sequence takes the multi-token path, so the clamp is
        // applied on every path here.
        let dt_min = cfg.opt_f64("time_step_min")?.filter(|v| *v > 0.0).map(F64);
        Some(Mamba2Ir {
            heads,
            head_dim: cfg.pos("mamba_head_dim")?,
            groups,
            state: cfg.pos("ssm_state_size")?,
            conv,
            chunk: cfg.opt_usize("chunk_size")?.unwrap_or(128).max(1),
            conv_bias: cfg.opt_bool("use_conv_bias")?.unwrap_or(true),
            dt_min,
            norm_order: GateOrder::GateThenNorm,
        })
    } else {
        None
    };
    if blocks.contains(&Block::Mlp) || blocks.contains(&Block::Moe) {
        let act = cfg.opt_str("mlp_hidden_act")?.unwrap_or("relu2");
        if act != "relu2" {
            return Err(HfError::Unsupported(format!(
                "mlp_hidden_act `{act}` (only relu2)"
            )));
        }
    }
    let moe = match blocks.contains(&Block::Moe) {
        true => Some(MlpIr::Moe(moe::nemotron_h(cfg)?)),
        false => None,
    };
    let mlp = if blocks.contains(&Block::Mlp) {
        let act = cfg.opt_str("mlp_hidden_act")?.unwrap_or("relu2");
        if act != "relu2" {
            return Err(HfError::Unsupported(format!(
                "mlp_hidden_act `{act}` (only relu2)"
            )));
        }
        if cfg.opt_bool("mlp_bias")?.unwrap_or(false) {
            return Err(HfError::Unsupported("mlp_bias = true".into()));
        }
        Some(MlpIr::Relu2 {
            intermediate: cfg.pos("intermediate_size")?,
        })
    } else {
        None
    };
    let layers = blocks
        .iter()
        .map(|b| match b {
            Block::Mamba => LayerIr {
                kind: "mamba2".into(),
                mixer: mamba.clone().map(MixerIr::Mamba2),
                mlp: None,
            },
            Block::Attention => LayerIr {
                kind: "attention".into(),
                mixer: attn.clone().map(MixerIr::Attention),
                mlp: None,
            },
            Block::Mlp => LayerIr {
                kind: "mlp".into(),
                mixer: None,
                mlp: mlp.clone(),
            },
            Block::Moe => LayerIr {
                kind: "moe".into(),
                mixer: None,
                mlp: moe.clone(),
            },
        })
        .collect();
    if cfg.opt_usize("num_nextn_predict_layers")?.unwrap_or(0) > 0 {
        return Err(HfError::Unsupported(
            "Nemotron-H MTP layers (num_nextn_predict_layers > 0)".into(),
        ));
    }
    let norm = NormIr {
        eps: F64(eps),
        weight: NormWeight::Plain,
    };
    Ok(finish(c, norm, layers, None, WeightNaming::NemotronH))
}
