//! Spec AST -> [`ModelIr`]: the semantic half of checking.
//!
//! [`check`] validates what the structural stage cannot see (names, cross references,
//! head-count divisibility, rotary dims, bucket order, layer counts), reporting every
//! problem at the token it concerns. Only when the whole description is clean does it
//! build the IR, so `build` may assume every field is present and consistent; the
//! lowering in `flashrt_ir::lower` relies on the same guarantees.

use crate::spec::*;
use crate::value::{Errors, Loc, hint};
use flashrt_ir::*;

/// The most decoder layers a stack (or an MTP head) may expand to.
pub const MAX_LAYERS: u64 = 4096;

/// Checks a spec and, when it and everything before it (`cx` is empty on entry for a
/// clean read) is valid, returns its IR. Errors go to `cx`.
pub fn check(cx: &mut Errors, spec: &ModelSpec) -> Option<ModelIr> {
    if let Some(m) = &spec.model {
        check_model(cx, m);
    }
    let names: Vec<&str> = spec.kinds.iter().map(|k| k.name.v.as_str()).collect();
    for k in &spec.kinds {
        check_kind(cx, k);
    }
    if let Some(stack) = &spec.stack
        && let Some(pattern) = &stack.pattern
    {
        for p in &pattern.v {
            check_kind_ref(cx, &p.v, p.loc, &names, "the stack pattern");
        }
        if let Some(repeat) = &stack.repeat {
            let total = (pattern.v.len() as u64).saturating_mul(repeat.v);
            if total > MAX_LAYERS {
                cx.push(
                    repeat.loc,
                    format!("the stack expands to {total} layers (at most {MAX_LAYERS})"),
                );
            }
        }
    }
    if let Some(mtp) = &spec.mtp {
        if let Some(kind) = &mtp.kind {
            check_kind_ref(cx, &kind.v, kind.loc, &names, "`mtp`");
        }
        if let Some(layers) = &mtp.layers
            && layers.v > MAX_LAYERS
        {
            cx.push(
                layers.loc,
                format!("an MTP head of {} layers (at most {MAX_LAYERS})", layers.v),
            );
        }
    }
    // Any error so far, from this stage or the structural one, means no IR.
    if !cx.is_empty() {
        return None;
    }
    let ir = build(spec);
    if let (Some(ir), Some(q)) = (&ir, spec.model.as_ref().and_then(|m| m.quantize.as_ref())) {
        check_quant_exclude(cx, ir, q);
        if !cx.is_empty() {
            return None;
        }
    }
    if ir.is_none() {
        // Unreachable when the stages agree; a message beats a panic in a proc macro.
        cx.push(
            spec.loc,
            "internal error: a checked model description did not lower to IR",
        );
    }
    ir
}

fn check_model(cx: &mut Errors, m: &ModelSection) {
    check_decode_batches(cx, m);
    if let Some(name) = &m.name {
        let ok = name.v.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .v
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ok {
            cx.push(
                name.loc,
                format!(
                    "model name `{}` is not snake_case (lowercase ASCII letters, digits and `_`, starting with a letter)",
                    name.v
                ),
            );
        }
    }
    if let Some(buckets) = &m.prefill_buckets {
        for w in buckets.v.windows(2) {
            if w[1].v <= w[0].v {
                cx.push(
                    w[1].loc,
                    format!(
                        "prefill buckets must be strictly ascending: {} follows {}",
                        w[1].v, w[0].v
                    ),
                );
            }
        }
        if let Some(max_seq) = &m.max_seq {
            for b in &buckets.v {
                if b.v > max_seq.v {
                    cx.push(
                        b.loc,
                        format!("prefill bucket {} exceeds `max_seq` ({})", b.v, max_seq.v),
                    );
                }
            }
        }
    }
}

/// `decode_batches`: ascending sizes of 2..=8 rows, within the largest prefill bucket (the
/// activation buffers' rows).
fn check_decode_batches(cx: &mut Errors, m: &ModelSection) {
    let Some(Some(batches)) = &m.decode_batches else {
        return;
    };
    let max = flashrt_ir::MAX_DECODE_BATCH as u64;
    for w in batches.v.windows(2) {
        if w[1].v <= w[0].v {
            cx.push(
                w[1].loc,
                format!(
                    "decode batches must be strictly ascending: {} follows {}",
                    w[1].v, w[0].v
                ),
            );
        }
    }
    let rows = m
        .prefill_buckets
        .as_ref()
        .and_then(|b| b.v.iter().map(|x| x.v).max());
    for b in &batches.v {
        if !(2..=max).contains(&b.v) {
            cx.push(
                b.loc,
                format!(
                    "decode batch {} is not in 2..={max} (sessions per batched step)",
                    b.v
                ),
            );
        } else if let Some(rows) = rows.filter(|&r| b.v > r) {
            cx.push(
                b.loc,
                format!(
                    "decode batch {} exceeds the largest prefill bucket ({rows})",
                    b.v
                ),
            );
        }
    }
}

fn check_kind_ref(cx: &mut Errors, name: &str, loc: Loc, names: &[&str], place: &str) {
    if !names.contains(&name) {
        let extra = if names.is_empty() {
            "; no kinds are defined".to_string()
        } else {
            hint(name, names)
        };
        cx.push(
            loc,
            format!("unknown layer kind `{name}` in {place}{extra}"),
        );
    }
}

fn check_kind(cx: &mut Errors, k: &KindSpec) {
    let n = &k.name.v;
    let ok = n.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !ok {
        cx.push(
            k.name.loc,
            format!("kind name `{n}` is not an identifier (ASCII letters, digits and `_`, not starting with a digit)"),
        );
    }
    if let Part::Present(m) = &k.mlp
        && let Some(moe) = &m.v.moe
    {
        check_moe(cx, moe);
    }
    if let Part::Present(m) = &k.mixer {
        match &m.v {
            MixerSpec::Attention(a) => check_attention(cx, a),
            MixerSpec::GatedDeltanet(g) => {
                divides(cx, &g.key_heads, &g.value_heads, "value_heads", "key_heads");
                conv_width(cx, &g.conv);
            }
            MixerSpec::ShortConv(c) => conv_width(cx, &c.conv),
            MixerSpec::Mamba2(m) => {
                divides(cx, &m.groups, &m.heads, "heads", "groups");
                if let (Some(h), Some(d), Some(g)) = (&m.heads, &m.head_dim, &m.groups) {
                    let inner = h.v * d.v;
                    if !inner.is_multiple_of(g.v) {
                        cx.push(
                            g.loc,
                            format!(
                                "the inner width heads * head_dim = {inner} is not a multiple of `groups` ({})",
                                g.v
                            ),
                        );
                    }
                }
                conv_width(cx, &m.conv);
            }
        }
    }
}

/// `big` must be a multiple of `small`; reported at `small`.
fn divides(cx: &mut Errors, small: &F<u64>, big: &F<u64>, big_name: &str, small_name: &str) {
    if let (Some(s), Some(b)) = (small, big)
        && !b.v.is_multiple_of(s.v)
    {
        cx.push(
            s.loc,
            format!(
                "`{big_name}` ({}) is not a multiple of `{small_name}` ({})",
                b.v, s.v
            ),
        );
    }
}

fn conv_width(cx: &mut Errors, conv: &F<u64>) {
    if let Some(c) = conv
        && c.v < 2
    {
        cx.push(
            c.loc,
            format!(
                "a causal conv needs a kernel width of at least 2, found {}",
                c.v
            ),
        );
    }
}

fn check_attention(cx: &mut Errors, a: &AttentionSpec) {
    divides(cx, &a.kv_heads, &a.q_heads, "q_heads", "kv_heads");
    if let (Some(hd), Some(S { v: Some(rope), .. })) = (&a.head_dim, &a.rope)
        && let Some(fr) = &rope.fraction
        && let Err(msg) = rotary_dims(hd.v, fr.v)
    {
        cx.push(fr.loc, msg);
    }
}

/// `head_dim * fraction`, which must be a positive even integer.
pub(crate) fn rotary_dims(head_dim: u64, fraction: f64) -> Result<usize, String> {
    let x = head_dim as f64 * fraction;
    let r = x.round();
    if (x - r).abs() > 1e-9 * x.max(1.0) {
        return Err(format!(
            "rotary dims = head_dim {head_dim} x fraction {fraction} = {x} is not an integer"
        ));
    }
    let r = r as u64;
    if r < 2 || !r.is_multiple_of(2) {
        return Err(format!(
            "rotary dims = head_dim {head_dim} x fraction {fraction} = {r} must be a positive even number"
        ));
    }
    Ok(r as usize)
}

fn build_moe(m: &MoeSpec, intermediate: usize) -> Option<MoeIr> {
    let groups = us(&m.groups)?;
    let shared = match &m.shared.as_ref()?.v {
        None => None,
        Some(s) => Some(SharedExpertIr {
            intermediate: us(&s.intermediate)?,
            gated: s.gated.as_ref()?.v,
        }),
    };
    Some(MoeIr {
        route: RouteIr {
            experts: us(&m.experts)?,
            top_k: us(&m.top_k)?,
            score: m.router.as_ref()?.v,
            expert_bias: m.expert_bias.as_ref()?.v,
            renormalize: m.renormalize.as_ref()?.v,
            renorm_eps: F64(m.renorm_eps.as_ref()?.v),
            scaling: F64(m.scaling.as_ref()?.v),
            groups,
            top_groups: m.top_groups.as_ref()?.v.map_or(groups, |g| g as usize),
        },
        intermediate,
        act: m.act.as_ref()?.v,
        shared,
    })
}

/// Routing consistency of an MoE MLP: `top_k` experts must be reachable.
fn check_moe(cx: &mut Errors, m: &MoeSpec) {
    let (Some(e), Some(k)) = (&m.experts, &m.top_k) else {
        return;
    };
    if k.v > e.v {
        cx.push(
            k.loc,
            format!("`top_k` ({}) exceeds the number of experts ({})", k.v, e.v),
        );
        return;
    }
    let Some(g) = &m.groups else {
        return;
    };
    if !e.v.is_multiple_of(g.v) {
        cx.push(
            g.loc,
            format!(
                "`experts` ({}) is not a multiple of `groups` ({})",
                e.v, g.v
            ),
        );
        return;
    }
    if g.v > 1 && e.v / g.v < 2 {
        cx.push(
            g.loc,
            format!(
                "groups of {} expert cannot be scored by their two best experts",
                e.v / g.v
            ),
        );
        return;
    }
    if let Some(S { v: Some(tg), loc }) = &m.top_groups {
        if *tg > g.v {
            cx.push(
                *loc,
                format!("`top_groups` ({tg}) exceeds `groups` ({})", g.v),
            );
        } else if k.v > tg * (e.v / g.v) {
            cx.push(
                *loc,
                format!(
                    "{tg} groups of {} experts cannot hold the top {} experts",
                    e.v / g.v,
                    k.v
                ),
            );
        }
    }
}

/// Builds the IR of a spec that passed [`check`]; `None` only if a field is missing.
fn build(spec: &ModelSpec) -> Option<ModelIr> {
    let m = spec.model.as_ref()?;
    let norm = m.norm.as_ref()?;
    let mut kinds: Vec<(&str, LayerIr)> = Vec::new();
    for k in &spec.kinds {
        if kinds.iter().any(|(n, _)| *n == k.name.v) {
            continue;
        }
        let mixer = match &k.mixer {
            Part::Absent => None,
            Part::Invalid => return None,
            Part::Present(m) => Some(build_mixer(&m.v)?),
        };
        let mlp = match &k.mlp {
            Part::Absent => None,
            Part::Invalid => return None,
            Part::Present(m) => {
                let intermediate = us(&m.v.intermediate)?;
                Some(match m.v.kind {
                    MlpKind::Swiglu => MlpIr::Swiglu { intermediate },
                    MlpKind::Relu2 => MlpIr::Relu2 { intermediate },
                    MlpKind::Moe => MlpIr::Moe(build_moe(m.v.moe.as_ref()?, intermediate)?),
                })
            }
        };
        kinds.push((
            &k.name.v,
            LayerIr {
                kind: k.name.v.clone(),
                mixer,
                mlp,
            },
        ));
    }
    let layer = |name: &str| {
        kinds
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, l)| l.clone())
    };
    let stack = spec.stack.as_ref()?;
    let pattern = &stack.pattern.as_ref()?.v;
    let repeat = us(&stack.repeat)?;
    let mut layers = Vec::with_capacity(pattern.len() * repeat);
    for _ in 0..repeat {
        for p in pattern {
            layers.push(layer(&p.v)?);
        }
    }
    let mtp = match &spec.mtp {
        None => None,
        Some(mtp) => {
            let l = layer(&mtp.kind.as_ref()?.v)?;
            Some(MtpIr {
                layers: vec![l; us(&mtp.layers)?],
            })
        }
    };
    Some(ModelIr {
        name: m.name.as_ref()?.v.clone(),
        vocab: us(&m.vocab)?,
        hidden: us(&m.hidden)?,
        dtype: m.dtype.as_ref()?.v,
        max_seq: us(&m.max_seq)?,
        prefill_buckets: m
            .prefill_buckets
            .as_ref()?
            .v
            .iter()
            .map(|b| b.v as usize)
            .collect(),
        norm: NormIr {
            eps: F64(norm.eps.as_ref()?.v),
            weight: norm.weight.as_ref()?.v,
        },
        tied_embeddings: m.tie_embeddings.as_ref()?.v,
        layers,
        mtp,
        weights: m.weights.as_ref()?.v,
        decode_batches: match &m.decode_batches {
            None => flashrt_ir::DEFAULT_DECODE_BATCHES.to_vec(),
            Some(b) => b.as_ref()?.v.iter().map(|x| x.v as usize).collect(),
        },
        quant: match &m.quantize {
            None => None,
            Some(q) => Some(build_quant(q)?),
        },
    })
}

fn build_quant(q: &QuantSpec) -> Option<QuantIr> {
    let format = q.format.as_ref()?.v;
    let [r, c] = &q.block.as_ref()?.v;
    let block = [r.v as usize, c.v as usize];
    Some(match &q.exclude.as_ref()?.v {
        None => QuantIr::with_defaults(format, block),
        Some(names) => QuantIr {
            format,
            block,
            exclude: names.iter().map(|n| n.v.clone()).collect(),
        },
    })
}

/// Every `quantize.exclude` entry must name a quantizable matrix of the model (a typo would
/// otherwise quantize what the user meant to keep), but for the default names
/// ([`DEFAULT_QUANT_EXCLUDE`]), which canonical TOML writes out for every model.
fn check_quant_exclude(cx: &mut Errors, ir: &ModelIr, q: &QuantSpec) {
    let Some(Some(names)) = q.exclude.as_ref().map(|e| &e.v) else {
        return;
    };
    let mut all = ir.clone();
    if let Some(quant) = all.quant.as_mut() {
        quant.exclude.clear();
    }
    let layout = compile(&all, Target { dtype: DType::F32 }).layout;
    let matrices: Vec<&str> = layout
        .buffers
        .iter()
        .filter(|b| b.quant.is_some())
        .map(|b| b.name.as_str())
        .collect();
    for n in names {
        // The default names apply to whichever model has those matrices.
        if DEFAULT_QUANT_EXCLUDE.contains(&n.v.as_str()) {
            continue;
        }
        let probe = QuantIr {
            format: QuantFormat::Fp8E4m3,
            block: [1, 1],
            exclude: vec![n.v.clone()],
        };
        if !matrices.iter().any(|m| probe.excludes(m)) {
            let mut kinds: Vec<String> = matrices
                .iter()
                .map(|m| match m.split_once('.') {
                    Some((l, rest)) if l == "layers" || l == "mtp" => rest
                        .split_once('.')
                        .map_or(rest.to_string(), |(_, r)| r.to_string()),
                    _ => m.to_string(),
                })
                .collect();
            kinds.sort();
            kinds.dedup();
            let list: Vec<&str> = kinds.iter().map(String::as_str).collect();
            cx.push(
                n.loc,
                format!(
                    "`quantize.exclude` names `{}`, which is no weight matrix of this model{}",
                    n.v,
                    hint(&n.v, &list)
                ),
            );
        }
    }
}

fn us(f: &F<u64>) -> Option<usize> {
    f.as_ref().map(|s| s.v as usize)
}

fn val<T: Copy>(f: &F<T>) -> Option<T> {
    f.as_ref().map(|s| s.v)
}

fn build_mixer(m: &MixerSpec) -> Option<MixerIr> {
    Some(match m {
        MixerSpec::Attention(a) => {
            let head_dim = us(&a.head_dim)?;
            let rope = match &a.rope.as_ref()?.v {
                None => None,
                Some(r) => Some(RopeIr {
                    theta: F64(val(&r.theta)?),
                    rotary_dims: rotary_dims(head_dim as u64, val(&r.fraction)?).ok()?,
                }),
            };
            MixerIr::Attention(AttentionIr {
                q_heads: us(&a.q_heads)?,
                kv_heads: us(&a.kv_heads)?,
                head_dim,
                qk_norm: val(&a.qk_norm)?,
                rope,
                output_gate: val(&a.output_gate)?,
            })
        }
        MixerSpec::GatedDeltanet(g) => MixerIr::GatedDeltanet(GatedDeltaNetIr {
            key_heads: us(&g.key_heads)?,
            value_heads: us(&g.value_heads)?,
            key_dim: us(&g.key_dim)?,
            value_dim: us(&g.value_dim)?,
            conv: us(&g.conv)?,
            norm_order: val(&g.norm_order)?,
        }),
        MixerSpec::ShortConv(c) => MixerIr::ShortConv(ShortConvIr {
            conv: us(&c.conv)?,
            bias: val(&c.bias)?,
        }),
        MixerSpec::Mamba2(m) => MixerIr::Mamba2(Mamba2Ir {
            heads: us(&m.heads)?,
            head_dim: us(&m.head_dim)?,
            groups: us(&m.groups)?,
            state: us(&m.state)?,
            conv: us(&m.conv)?,
            chunk: us(&m.chunk)?,
            conv_bias: val(&m.conv_bias)?,
            dt_min: val(&m.dt_min)?.map(F64),
            norm_order: val(&m.norm_order)?,
        }),
    })
}
