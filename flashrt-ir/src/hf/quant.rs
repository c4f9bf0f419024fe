//! `quantization_config` -> [`QuantIr`]: the fine-grained FP8 format of Qwen's (and
//! DeepSeek's) FP8 releases, as transformers reads it (`FineGrainedFP8Config`).
//!
//! * `quant_method: "fp8"` with `weight_block_size: [rows, cols]` (transformers' default
//!   `[128, 128]` when absent); `activation_scheme: "dynamic"` (activations are not quantized
//!   in the checkpoint: no stored activation scales); `fmt`, when written, `"e4m3"`.
//! * `modules_to_not_convert` lists the modules kept in bf16. transformers keeps a module
//!   when an entry equals its name, is a prefix of it up to a `.`, or a suffix of it after a
//!   `.`; the multimodal releases write the text model's modules under
//!   `model.language_model.`, which this importer reads as `model.`. The list becomes the
//!   IR's `exclude` in flashrt's weight names, one suffix (`gdn.in_proj_a`) where every layer
//!   keeps that matrix, full names otherwise. Without a list, transformers keeps the LM head.
//!
//! Other methods (GPTQ, AWQ, compressed-tensors, ...) and per-tensor or static scales are
//! refused by name.

use super::{HfError, Result};
use crate::ir::*;
use crate::layout::Target;
use serde_json::{Map, Value};

pub(super) fn quantization(root: &Map<String, Value>, ir: &ModelIr) -> Result<Option<QuantIr>> {
    let (key, cfg) = match (root.get("quantization_config"), root.get("text_config")) {
        (Some(v), _) if !v.is_null() => ("quantization_config", v),
        (_, Some(Value::Object(t))) => match t.get("quantization_config") {
            Some(v) if !v.is_null() => ("text_config.quantization_config", v),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let q = cfg.as_object().ok_or_else(|| HfError::BadValue {
        key: key.into(),
        expected: "an object".into(),
        found: cfg.to_string(),
    })?;
    let k = |name: &str| format!("{key}.{name}");
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .ok_or_else(|| HfError::Missing {
            key: k("quant_method"),
        })?;
    if method != "fp8" {
        return Err(HfError::Unsupported(format!(
            "{} `{method}`: flashrt reads block-scaled FP8 checkpoints (quant_method \"fp8\"), \
             or serve the unquantized checkpoint (`--quantize fp8` quantizes it while loading)",
            k("quant_method")
        )));
    }
    if let Some(s) = q.get("activation_scheme").and_then(Value::as_str)
        && s != "dynamic"
    {
        return Err(HfError::Unsupported(format!(
            "{} `{s}` (stored activation scales): only \"dynamic\" is read",
            k("activation_scheme")
        )));
    }
    if let Some(s) = q.get("fmt").and_then(Value::as_str)
        && s != "e4m3"
    {
        return Err(HfError::Unsupported(format!(
            "{} `{s}`: FP8 weights are read as e4m3",
            k("fmt")
        )));
    }
    let block = match q.get("weight_block_size") {
        None => [128, 128],
        Some(Value::Array(a))
            if a.len() == 2 && a.iter().all(|x| x.as_u64().is_some_and(|v| v > 0)) =>
        {
            [
                a[0].as_u64().expect("checked") as usize,
                a[1].as_u64().expect("checked") as usize,
            ]
        }
        Some(Value::Null) => {
            return Err(HfError::Unsupported(format!(
                "{} null (one scale per tensor): flashrt reads block-scaled FP8",
                k("weight_block_size")
            )));
        }
        Some(other) => {
            return Err(HfError::BadValue {
                key: k("weight_block_size"),
                expected: "[rows, cols], two positive integers".into(),
                found: other.to_string(),
            });
        }
    };
    let keep: Option<Vec<String>> = match q.get("modules_to_not_convert") {
        None | Some(Value::Null) => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|x| {
                    x.as_str().map(normalise).ok_or_else(|| HfError::BadValue {
                        key: k("modules_to_not_convert"),
                        expected: "an array of module names".into(),
                        found: x.to_string(),
                    })
                })
                .collect::<Result<_>>()?,
        ),
        Some(other) => {
            return Err(HfError::BadValue {
                key: k("modules_to_not_convert"),
                expected: "an array of module names".into(),
                found: other.to_string(),
            });
        }
    };
    let format = QuantFormat::Fp8E4m3;
    let exclude = match keep {
        None => vec!["lm_head".to_string()],
        Some(keep) => exclude_names(ir, format, block, &keep)?,
    };
    Ok(Some(QuantIr {
        format,
        block,
        exclude,
    }))
}

/// A module name as the text model's checkpoint names it (`model.language_model.x` -> `model.x`).
fn normalise(name: &str) -> String {
    match name.strip_prefix("model.language_model.") {
        Some(rest) => format!("model.{rest}"),
        None => name.to_string(),
    }
}

/// transformers' `should_convert_module`, negated: whether an entry keeps module `name`.
fn kept(name: &str, keep: &[String]) -> bool {
    keep.iter().any(|k| {
        name == k
            || name
                .strip_prefix(k.as_str())
                .is_some_and(|r| r.starts_with('.'))
            || name
                .strip_suffix(k.as_str())
                .is_some_and(|r| r.ends_with('.'))
    })
}

/// The quantizable matrices of `ir` that `keep` keeps, in flashrt's names: a suffix for a
/// matrix kept in every layer that has it, full names otherwise.
fn exclude_names(
    ir: &ModelIr,
    format: QuantFormat,
    block: [usize; 2],
    keep: &[String],
) -> Result<Vec<String>> {
    let mut all = ir.clone();
    all.quant = Some(QuantIr {
        format,
        block,
        exclude: Vec::new(),
    });
    let layout = crate::lower::compile(&all, Target { dtype: DType::F32 }).layout;
    // (layout name, suffix, kept)
    let mut rows: Vec<(String, String, bool)> = Vec::new();
    for b in layout.buffers.iter().filter(|b| b.quant.is_some()) {
        let module = |src: &str| src.strip_suffix(".weight").unwrap_or(src).to_string();
        let modules: Vec<String> = match &b.pieces {
            Some(p) => p.names.iter().map(|n| module(n)).collect(),
            None => vec![module(b.source.as_deref().unwrap_or(&b.name))],
        };
        let n_kept = modules.iter().filter(|m| kept(m, keep)).count();
        if n_kept != 0 && n_kept != modules.len() {
            return Err(HfError::Unsupported(format!(
                "quantization_config.modules_to_not_convert keeps {n_kept} of the {} experts' \
                 projections stacked in `{}` (e.g. {}): a stacked weight is quantized whole",
                modules.len(),
                b.name,
                modules.iter().find(|m| kept(m, keep)).expect("one is kept")
            )));
        }
        rows.push((b.name.clone(), suffix(&b.name), n_kept != 0));
    }
    let mut out: Vec<String> = Vec::new();
    for (name, suf, k) in &rows {
        if !k {
            continue;
        }
        let group_all_kept = rows.iter().filter(|r| &r.1 == suf).all(|r| r.2);
        let entry = if group_all_kept { suf } else { name };
        if !out.contains(entry) {
            out.push(entry.clone());
        }
    }
    Ok(out)
}

/// `layers.3.gdn.in_proj_a` -> `gdn.in_proj_a`; `mtp.0.attn.q_proj` -> `attn.q_proj`; other
/// names as they are.
fn suffix(name: &str) -> String {
    let mut parts = name.splitn(3, '.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("layers" | "mtp"), Some(i), Some(rest)) if i.parse::<usize>().is_ok() => {
            rest.to_string()
        }
        _ => name.to_string(),
    }
}
