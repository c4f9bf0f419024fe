//! [`ModelIr`] -> canonical TOML (what `flashrt import-hf` prints).
//!
//! Layers are grouped by their `kind` name into `[kinds.*]` tables (first appearance
//! order); the stack is the shortest prefix of layers whose repetition gives the whole
//! stack, with `repeat` when it repeats more than once. Every field is written explicitly,
//! defaults included, so the file documents the model completely. Floats are written in
//! Rust's shortest round-trip form, so `model_from_toml(&ir_to_toml(&ir)) == ir` for every
//! IR the front-ends accept. (An IR that no front-end could have produced, e.g. two
//! different layers under one kind name, is written with suffixed kind names `name_2`, ...
//! and no longer round-trips.)

use flashrt_ir::*;
use std::fmt::Write;

pub fn ir_to_toml(ir: &ModelIr) -> String {
    let mut out = String::new();
    let mut kinds: Vec<(String, &LayerIr)> = Vec::new();
    let mut names = Vec::new();
    for layer in ir
        .layers
        .iter()
        .chain(ir.mtp.iter().flat_map(|m| m.layers.iter()))
    {
        let name = match kinds.iter().find(|(_, l)| *l == layer) {
            Some((n, _)) => n.clone(),
            None => {
                let mut name = layer.kind.clone();
                let mut k = 2;
                while kinds.iter().any(|(n, _)| *n == name) {
                    name = format!("{}_{k}", layer.kind);
                    k += 1;
                }
                kinds.push((name.clone(), layer));
                name
            }
        };
        names.push(name);
    }
    let (stack_names, mtp_names) = names.split_at(ir.layers.len());

    let _ = writeln!(out, "[model]");
    let _ = writeln!(out, "name = {}", string(&ir.name));
    let _ = writeln!(out, "vocab = {}", ir.vocab);
    let _ = writeln!(out, "hidden = {}", ir.hidden);
    let _ = writeln!(out, "dtype = {}", string(ir.dtype.name()));
    let _ = writeln!(out, "max_seq = {}", ir.max_seq);
    let buckets: Vec<String> = ir.prefill_buckets.iter().map(|b| b.to_string()).collect();
    let _ = writeln!(out, "prefill_buckets = [{}]", buckets.join(", "));
    if ir.decode_batches != flashrt_ir::DEFAULT_DECODE_BATCHES {
        let b: Vec<String> = ir.decode_batches.iter().map(|b| b.to_string()).collect();
        let _ = writeln!(out, "decode_batches = [{}]", b.join(", "));
    }
    let weight = match ir.norm.weight {
        NormWeight::Plain => "plain",
        NormWeight::OnePlus => "one_plus",
    };
    let _ = writeln!(
        out,
        "norm = {{ kind = \"rms\", eps = {}, weight = {} }}",
        float(ir.norm.eps.get()),
        string(weight)
    );
    let _ = writeln!(out, "tie_embeddings = {}", ir.tied_embeddings);
    let _ = writeln!(out, "weights = {}", string(ir.weights.hf_model_type()));
    if let Some(q) = &ir.quant {
        let exclude: Vec<String> = q.exclude.iter().map(|e| string(e)).collect();
        let _ = writeln!(
            out,
            "quantize = {{ format = {}, block = [{}, {}], exclude = [{}] }}",
            string(q.format.name()),
            q.block[0],
            q.block[1],
            exclude.join(", ")
        );
    }

    for (name, layer) in &kinds {
        let _ = writeln!(out, "\n[kinds.{}]", key(name));
        if let Some(m) = &layer.mixer {
            let _ = writeln!(out, "mixer = {}", mixer(m));
        }
        if let Some(m) = &layer.mlp {
            let _ = writeln!(out, "mlp = {}", mlp(m));
        }
    }

    let _ = writeln!(out, "\n[stack]");
    let period = period(stack_names);
    let pattern: Vec<String> = stack_names[..period].iter().map(|n| string(n)).collect();
    let _ = writeln!(out, "pattern = [{}]", pattern.join(", "));
    if period > 0 && stack_names.len() / period > 1 {
        let _ = writeln!(out, "repeat = {}", stack_names.len() / period);
    }

    if let Some(first) = mtp_names.first() {
        let _ = writeln!(out, "\n[mtp]");
        let _ = writeln!(out, "layers = {}", mtp_names.len());
        let _ = writeln!(out, "kind = {}", string(first));
    }
    out
}

/// The shortest `p` such that `names` is `names[..p]` repeated.
fn period(names: &[String]) -> usize {
    let n = names.len();
    (1..=n)
        .find(|&p| n.is_multiple_of(p) && (p..n).all(|i| names[i] == names[i % p]))
        .unwrap_or(n)
}

fn mixer(m: &MixerIr) -> String {
    match m {
        MixerIr::Attention(a) => {
            let rope = match &a.rope {
                None => "\"none\"".to_string(),
                Some(r) => format!(
                    "{{ theta = {}, fraction = {} }}",
                    float(r.theta.get()),
                    float(r.rotary_dims as f64 / a.head_dim as f64)
                ),
            };
            format!(
                "{{ kind = \"attention\", q_heads = {}, kv_heads = {}, head_dim = {}, qk_norm = {}, rope = {rope}, output_gate = {} }}",
                a.q_heads, a.kv_heads, a.head_dim, a.qk_norm, a.output_gate
            )
        }
        MixerIr::GatedDeltanet(g) => format!(
            "{{ kind = \"gated_deltanet\", key_heads = {}, value_heads = {}, key_dim = {}, value_dim = {}, conv = {}, norm_order = {} }}",
            g.key_heads,
            g.value_heads,
            g.key_dim,
            g.value_dim,
            g.conv,
            order(g.norm_order)
        ),
        MixerIr::ShortConv(c) => format!(
            "{{ kind = \"short_conv\", conv = {}, bias = {} }}",
            c.conv, c.bias
        ),
        MixerIr::Mamba2(m) => {
            let dt_min = m
                .dt_min
                .map(|d| format!(", dt_min = {}", float(d.get())))
                .unwrap_or_default();
            format!(
                "{{ kind = \"mamba2\", heads = {}, head_dim = {}, groups = {}, state = {}, conv = {}, chunk = {}, conv_bias = {}{dt_min}, norm_order = {} }}",
                m.heads,
                m.head_dim,
                m.groups,
                m.state,
                m.conv,
                m.chunk,
                m.conv_bias,
                order(m.norm_order)
            )
        }
    }
}

fn mlp(m: &MlpIr) -> String {
    let MlpIr::Moe(m) = m else {
        return format!(
            "{{ kind = \"{}\", intermediate = {} }}",
            m.kind_name(),
            m.intermediate()
        );
    };
    let r = &m.route;
    let shared = match &m.shared {
        None => String::new(),
        Some(s) => format!(
            ", shared = {{ intermediate = {}, gated = {} }}",
            s.intermediate, s.gated
        ),
    };
    format!(
        "{{ kind = \"moe\", experts = {}, top_k = {}, intermediate = {}, act = {}, router = {}, expert_bias = {}, renormalize = {}, renorm_eps = {}, scaling = {}, groups = {}, top_groups = {}{shared} }}",
        r.experts,
        r.top_k,
        m.intermediate,
        string(m.act.name()),
        string(r.score.name()),
        r.expert_bias,
        r.renormalize,
        float(r.renorm_eps.get()),
        float(r.scaling.get()),
        r.groups,
        r.top_groups
    )
}

fn order(o: GateOrder) -> String {
    string(match o {
        GateOrder::NormThenGate => "norm_then_gate",
        GateOrder::GateThenNorm => "gate_then_norm",
    })
}

/// A TOML float: Rust's shortest round-trip form (`1e-6`, `10000000.0`), which TOML parses
/// back to the same bits.
fn float(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf".into() } else { "-inf".into() }
    } else {
        format!("{x:?}")
    }
}

/// A TOML basic string.
fn string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A TOML key: bare when it can be, quoted otherwise.
fn key(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        s.to_string()
    } else {
        string(s)
    }
}
