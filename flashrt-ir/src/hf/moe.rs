//! Mixture-of-experts settings of the three families, each as transformers implements it
//! (`tests/fixtures/*moe-public/README.md` spell out the routing rules this relies on).

use super::*;

fn positive_f64(cfg: &Cfg, key: &str, default: f64) -> Result<f64> {
    let v = cfg.opt_f64(key)?.unwrap_or(default);
    if !(v.is_finite() && v > 0.0) {
        return Err(HfError::BadValue {
            key: cfg.key(key),
            expected: "a finite positive number".into(),
            found: v.to_string(),
        });
    }
    Ok(v)
}

fn top_k(cfg: &Cfg, experts: usize) -> Result<usize> {
    let k = cfg.pos("num_experts_per_tok")?;
    if k > experts {
        return Err(HfError::Invalid(format!(
            "{} = {k} exceeds the {experts} experts",
            cfg.key("num_experts_per_tok")
        )));
    }
    Ok(k)
}

/// Qwen3.5/3.6-MoE (`Qwen3_5MoeSparseMoeBlock`): softmax over all experts, top-k, always
/// renormalised (no epsilon, no scaling); a SwiGLU shared expert behind a per-token sigmoid
/// gate.
pub(super) fn qwen35(cfg: &Cfg) -> Result<MoeIr> {
    let experts = cfg.pos("num_experts")?;
    let top_k = top_k(cfg, experts)?;
    let shared = match cfg.opt_usize("shared_expert_intermediate_size")? {
        Some(0) | None => None,
        Some(w) => Some(SharedExpertIr {
            intermediate: w,
            gated: true,
        }),
    };
    Ok(MoeIr {
        route: RouteIr {
            experts,
            top_k,
            score: RouterScore::Softmax,
            expert_bias: false,
            // Qwen3.5-MoE has no switch; Qwen3-style configs that write one are honoured.
            renormalize: cfg.opt_bool("norm_topk_prob")?.unwrap_or(true),
            renorm_eps: F64(0.0),
            scaling: F64(1.0),
            groups: 1,
            top_groups: 1,
        },
        intermediate: cfg.pos("moe_intermediate_size")?,
        act: ExpertAct::Swiglu,
        shared,
    })
}

/// LFM2-MoE (`Lfm2MoeSparseMoeBlock`): sigmoid scores, `expert_bias` for the choice only,
/// renormalised with `+1e-6`, times `routed_scaling_factor`; no shared expert.
pub(super) fn lfm2(cfg: &Cfg) -> Result<MoeIr> {
    let experts = cfg.pos("num_experts")?;
    let top_k = top_k(cfg, experts)?;
    Ok(MoeIr {
        route: RouteIr {
            experts,
            top_k,
            score: RouterScore::Sigmoid,
            expert_bias: cfg.opt_bool("use_expert_bias")?.unwrap_or(true),
            renormalize: cfg.opt_bool("norm_topk_prob")?.unwrap_or(true),
            renorm_eps: F64(1e-6),
            scaling: F64(positive_f64(cfg, "routed_scaling_factor", 1.0)?),
            groups: 1,
            top_groups: 1,
        },
        intermediate: cfg.pos("moe_intermediate_size")?,
        act: ExpertAct::Swiglu,
        shared: None,
    })
}

/// Nemotron-H MoE blocks (`NemotronHMoE`, DeepSeek-V3 style router): sigmoid scores,
/// `e_score_correction_bias` for the choice only, group-limited top-k, renormalised with
/// `+1e-20`, times `routed_scaling_factor`; squared-ReLU experts and an ungated shared expert.
pub(super) fn nemotron_h(cfg: &Cfg) -> Result<MoeIr> {
    let experts = cfg.pos("n_routed_experts")?;
    let top_k = top_k(cfg, experts)?;
    if let Some(l) = cfg.opt_usize("moe_latent_size")?
        && l > 0
    {
        return Err(HfError::Unsupported(format!(
            "{} = {l} (latent MoE projections)",
            cfg.key("moe_latent_size")
        )));
    }
    let groups = cfg.opt_usize("n_group")?.unwrap_or(1).max(1);
    let top_groups = cfg.opt_usize("topk_group")?.unwrap_or(groups).max(1);
    if !experts.is_multiple_of(groups) || (groups > 1 && experts / groups < 2) {
        return Err(HfError::Invalid(format!(
            "{} = {groups} does not split the {experts} experts into groups of at least 2",
            cfg.key("n_group")
        )));
    }
    if top_groups > groups || top_k > top_groups * (experts / groups) {
        return Err(HfError::Invalid(format!(
            "{} = {top_groups} groups of {} experts cannot hold the top {top_k}",
            cfg.key("topk_group"),
            experts / groups
        )));
    }
    let shared = match cfg.opt_usize("moe_shared_expert_intermediate_size")? {
        Some(0) | None => None,
        Some(w) => Some(SharedExpertIr {
            intermediate: w,
            gated: false,
        }),
    };
    Ok(MoeIr {
        route: RouteIr {
            experts,
            top_k,
            score: RouterScore::Sigmoid,
            expert_bias: true,
            renormalize: cfg.opt_bool("norm_topk_prob")?.unwrap_or(true),
            renorm_eps: F64(1e-20),
            scaling: F64(positive_f64(cfg, "routed_scaling_factor", 1.0)?),
            groups,
            top_groups,
        },
        intermediate: cfg.pos("moe_intermediate_size")?,
        act: ExpertAct::Relu2,
        shared,
    })
}
