//! Hugging Face `config.json` -> [`ModelIr`], one module per family.
//!
//! Each model type is translated as transformers implements it (the fixtures in
//! `tests/fixtures/*/README.md` document the details this importer relies on):
//!
//! * `qwen35`: `qwen3_5_text` (also `qwen3_5`, the multimodal wrapper whose text settings
//!   sit in a nested `text_config`): Gated DeltaNet layers (`linear_attention`) and gated full
//!   attention (`full_attention`), chosen by `layer_types` or every `full_attention_interval`-th
//!   layer; zero-centred `(1 + w)` RMSNorm; partial RoPE; SwiGLU MLP in every layer; optional
//!   MTP head (`mtp_num_hidden_layers` attention layers). `qwen3_5_moe_text` / `qwen3_5_moe`:
//!   the same with a sparse MoE block in every layer (bar `mlp_only_layers`).
//! * `lfm2`: gated short-convolution blocks (`conv`) and GQA attention with q/k norm
//!   (`full_attention`, from `layer_types` or `full_attn_idxs`); SwiGLU MLP whose real width
//!   follows `block_auto_adjust_ff_dim`. `lfm2_moe`: `num_dense_layers` dense layers, then MoE.
//! * `nemotron_h`: one mixer per block — Mamba2, attention (no positional encoding), a
//!   squared-ReLU MLP or an MoE block — from `layers_block_type` or `hybrid_override_pattern`
//!   (`M`, `*`, `-`, `E`).
//!
//! The routing rules of the three MoE families are in `moe`. Layer `kind`s are the mixer
//! kind names (`gated_deltanet`, `attention`, `short_conv`, `mamba2`), with `_moe` appended
//! where the layer's MLP is sparse, `mlp` for a block with only a dense channel mixer, `moe`
//! for one with only a sparse one. Every missing or ill-typed key is reported as an
//! [`HfError`] that names the key (with its `text_config.` prefix where nested).
//! Transformers' own encoding of non-finite floats (`{"__float__": "Infinity"}`) is accepted
//! wherever a float is read.

use crate::ir::*;
use serde_json::{Map, Value};
use std::fmt;

mod lfm2;
mod moe;
mod nemotron_h;
mod quant;
mod qwen35;

use lfm2::lfm2;
pub use lfm2::lfm2_mlp_width;
use nemotron_h::nemotron_h;
use qwen35::qwen35;

/// Options of the import that are not in `config.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HfOptions {
    /// Model name (snake_case). Default: derived from the model type.
    pub name: Option<String>,
    /// Default: `max_position_embeddings` (a runtime loading the checkpoint caps it to what
    /// fits in its memory; see `flashrt_runtime::Model::load_hf_dir`).
    pub max_seq: Option<usize>,
    /// Default: [`DEFAULT_PREFILL_BUCKETS`], the ladder the hand-tuned models use, up to
    /// `max_seq`; every given bucket is capped to `max_seq`.
    pub prefill_buckets: Option<Vec<usize>>,
    /// Default: the config's `dtype` / `torch_dtype` (bf16 when neither is present).
    pub dtype: Option<DType>,
    /// Quantize the weights while they load (`--quantize fp8`). A checkpoint whose config has
    /// a `quantization_config` is already quantized and keeps its own.
    pub quantize: Option<QuantIr>,
}

/// `max_seq` when a config has no `max_position_embeddings`.
pub const DEFAULT_MAX_SEQ: usize = 32768;
/// Default prefill buckets: a ladder up to 4096 rows, so a long prompt runs in large chunks
/// (each chunk streams every weight once) and a suffix in the plans that cover it at least
/// cost (the runtime's chunk planner combines them).
pub const DEFAULT_PREFILL_BUCKETS: [usize; 7] = [32, 64, 256, 512, 1024, 2048, 4096];

/// Why a config could not be imported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HfError {
    /// Not valid JSON, or not a JSON object.
    Json(String),
    /// `model_type` is not one of the supported ones.
    UnknownModelType(String),
    /// A required key is absent.
    Missing { key: String },
    /// A key is present with the wrong type or an impossible value.
    BadValue {
        key: String,
        expected: String,
        found: String,
    },
    /// A valid config this importer does not translate (MoE blocks, exotic RoPE, ...).
    Unsupported(String),
    /// Values that are individually fine but inconsistent (head counts not dividing, ...).
    Invalid(String),
}

impl fmt::Display for HfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HfError::Json(m) => write!(f, "config.json is not valid: {m}"),
            HfError::UnknownModelType(t) => write!(
                f,
                "unsupported model_type `{t}` (supported: qwen3_5_text, qwen3_5, qwen3_5_moe_text, qwen3_5_moe, lfm2, lfm2_moe, nemotron_h)"
            ),
            HfError::Missing { key } => write!(f, "missing key `{key}`"),
            HfError::BadValue {
                key,
                expected,
                found,
            } => {
                write!(f, "key `{key}`: expected {expected}, found {found}")
            }
            HfError::Unsupported(m) => write!(f, "unsupported: {m}"),
            HfError::Invalid(m) => write!(f, "inconsistent config: {m}"),
        }
    }
}

impl std::error::Error for HfError {}

type Result<T> = std::result::Result<T, HfError>;

/// Translate a Hugging Face `config.json` into model IR.
pub fn ir_from_hf_config(json: &str, opts: &HfOptions) -> Result<ModelIr> {
    let root: Value = serde_json::from_str(json).map_err(|e| HfError::Json(e.to_string()))?;
    let root = root
        .as_object()
        .ok_or_else(|| HfError::Json("the top level is not an object".into()))?;
    let top = Cfg {
        obj: root,
        prefix: String::new(),
        parent: None,
    };
    let model_type = top.str("model_type")?.to_string();
    let mut ir = match model_type.as_str() {
        "qwen3_next" => Err(HfError::Unsupported(
            "model_type `qwen3_next` (fused in_proj_qkvz projections and MoE blocks are not implemented; \
             qwen3_5_text / qwen3_5 are)"
                .into(),
        )),
        "qwen3_5_text" | "qwen3_5" | "qwen3_5_moe_text" | "qwen3_5_moe" => {
            // Multimodal Qwen3.5 configs nest the text model in `text_config`.
            let nested = match root.get("text_config") {
                Some(Value::Object(t)) => Some(t),
                Some(Value::Null) | None => None,
                Some(other) => return Err(bad("text_config", "an object", other)),
            };
            match nested {
                Some(t) => {
                    let cfg = Cfg {
                        obj: t,
                        prefix: "text_config.".into(),
                        parent: Some(root),
                    };
                    qwen35(&cfg, &model_type, opts)
                }
                None => qwen35(&top, &model_type, opts),
            }
        }
        "lfm2" | "lfm2_moe" => lfm2(&top, &model_type, opts),
        "nemotron_h" => nemotron_h(&top, opts),
        other => Err(HfError::UnknownModelType(other.to_string())),
    }?;
    ir.quant = quant::quantization(root, &ir)?.or_else(|| opts.quantize.clone());
    Ok(ir)
}

// ---------------------------------------------------------------------------------------------
// Typed access to a JSON object, with key names in every error.

struct Cfg<'a> {
    obj: &'a Map<String, Value>,
    /// Printed before key names (`text_config.`).
    prefix: String,
    /// Keys absent here are looked up in the parent (nested text configs).
    parent: Option<&'a Map<String, Value>>,
}

fn bad(key: &str, expected: &str, found: &Value) -> HfError {
    let mut f = found.to_string();
    if f.len() > 60 {
        f.truncate(57);
        f.push_str("...");
    }
    HfError::BadValue {
        key: key.to_string(),
        expected: expected.to_string(),
        found: f,
    }
}

/// A float, accepting transformers' `{"__float__": "Infinity"}` encoding.
fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Object(m) if m.len() == 1 => match m.get("__float__")?.as_str()? {
            "Infinity" | "inf" => Some(f64::INFINITY),
            "-Infinity" | "-inf" => Some(f64::NEG_INFINITY),
            _ => None,
        },
        _ => None,
    }
}

fn as_usize(v: &Value) -> Option<usize> {
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                usize::try_from(u).ok()
            } else {
                // Integral floats (`4096.0`) are accepted.
                let f = n.as_f64()?;
                (f >= 0.0 && f.fract() == 0.0 && f < 1e15).then_some(f as usize)
            }
        }
        _ => None,
    }
}

impl<'a> Cfg<'a> {
    fn key(&self, k: &str) -> String {
        format!("{}{k}", self.prefix)
    }

    /// The value of `k`, treating JSON `null` as absent; falls back to the parent object.
    fn get(&self, k: &str) -> Option<(&'a Value, String)> {
        match self.obj.get(k) {
            Some(Value::Null) | None => match self.parent.and_then(|p| p.get(k)) {
                Some(Value::Null) | None => None,
                Some(v) => Some((v, k.to_string())),
            },
            Some(v) => Some((v, self.key(k))),
        }
    }

    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some((v, key)) => as_usize(v)
                .map(Some)
                .ok_or_else(|| bad(&key, "a non-negative integer", v)),
        }
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.opt_usize(k)?
            .ok_or_else(|| HfError::Missing { key: self.key(k) })
    }
    /// The first present key of `keys` (aliases), as a positive integer.
    fn pos_alias(&self, keys: &[&str]) -> Result<usize> {
        for k in keys {
            if self.get(k).is_some() {
                return self.pos(k);
            }
        }
        Err(HfError::Missing {
            key: self.key(keys[0]),
        })
    }
    /// A positive integer.
    fn pos(&self, k: &str) -> Result<usize> {
        let v = self.usize(k)?;
        if v == 0 {
            return Err(HfError::BadValue {
                key: self.key(k),
                expected: "a positive integer".into(),
                found: "0".into(),
            });
        }
        Ok(v)
    }
    fn opt_f64(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some((v, key)) => as_f64(v).map(Some).ok_or_else(|| bad(&key, "a number", v)),
        }
    }
    fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some((Value::Bool(b), _)) => Ok(Some(*b)),
            Some((v, key)) => Err(bad(&key, "true or false", v)),
        }
    }
    fn opt_str(&self, k: &str) -> Result<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some((Value::String(s), _)) => Ok(Some(s.as_str())),
            Some((v, key)) => Err(bad(&key, "a string", v)),
        }
    }
    fn str(&self, k: &str) -> Result<&'a str> {
        self.opt_str(k)?
            .ok_or_else(|| HfError::Missing { key: self.key(k) })
    }
    fn opt_strings(&self, k: &str) -> Result<Option<Vec<&'a str>>> {
        match self.get(k) {
            None => Ok(None),
            Some((Value::Array(items), key)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str()
                        .ok_or_else(|| bad(&format!("{key}[{i}]"), "a string", v))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some((v, key)) => Err(bad(&key, "a list of strings", v)),
        }
    }
    fn opt_usizes(&self, k: &str) -> Result<Option<Vec<usize>>> {
        match self.get(k) {
            None => Ok(None),
            Some((Value::Array(items), key)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    as_usize(v)
                        .ok_or_else(|| bad(&format!("{key}[{i}]"), "a non-negative integer", v))
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some((v, key)) => Err(bad(&key, "a list of integers", v)),
        }
    }
    /// A nested object (`rope_parameters`), as a `Cfg` with its own prefix.
    fn opt_obj(&self, k: &str) -> Result<Option<Cfg<'a>>> {
        match self.get(k) {
            None => Ok(None),
            Some((Value::Object(m), key)) => Ok(Some(Cfg {
                obj: m,
                prefix: format!("{key}."),
                parent: None,
            })),
            Some((v, key)) => Err(bad(&key, "an object", v)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Settings shared by the three families.

struct Common {
    name: String,
    vocab: usize,
    hidden: usize,
    dtype: DType,
    max_seq: usize,
    buckets: Vec<usize>,
    tied: bool,
}

fn common(cfg: &Cfg, default_name: &str, opts: &HfOptions, default_tied: bool) -> Result<Common> {
    let vocab = cfg.pos("vocab_size")?;
    // LFM2 checkpoints also write `block_dim`.
    let hidden = cfg.pos_alias(&["hidden_size", "block_dim"])?;
    let dtype = match opts.dtype {
        Some(d) => d,
        None => {
            let (key, s) = match cfg.opt_str("dtype")? {
                Some(s) => ("dtype", Some(s)),
                None => ("torch_dtype", cfg.opt_str("torch_dtype")?),
            };
            match s {
                None => DType::Bf16,
                Some(s) => DType::parse(s).ok_or_else(|| HfError::BadValue {
                    key: cfg.key(key),
                    expected: "float32, bfloat16 or float16".into(),
                    found: format!("\"{s}\""),
                })?,
            }
        }
    };
    let max_seq = match opts.max_seq {
        Some(0) => return Err(HfError::Invalid("max_seq option must be positive".into())),
        Some(m) => m,
        None => cfg
            .opt_usize("max_position_embeddings")?
            .unwrap_or(DEFAULT_MAX_SEQ)
            .max(1),
    };
    let mut buckets: Vec<usize> = match &opts.prefill_buckets {
        Some(b) => b.iter().map(|&b| b.min(max_seq)).collect(),
        None => DEFAULT_PREFILL_BUCKETS
            .iter()
            .copied()
            .filter(|&b| b <= max_seq)
            .collect(),
    };
    if buckets.contains(&0) {
        return Err(HfError::Invalid("prefill buckets must be positive".into()));
    }
    buckets.sort_unstable();
    buckets.dedup();
    if buckets.is_empty() {
        buckets.push(DEFAULT_PREFILL_BUCKETS[0].min(max_seq));
    }
    let tied = cfg.opt_bool("tie_word_embeddings")?.unwrap_or(default_tied);
    let name = opts
        .name
        .clone()
        .unwrap_or_else(|| default_name.to_string());
    Ok(Common {
        name,
        vocab,
        hidden,
        dtype,
        max_seq,
        buckets,
        tied,
    })
}

fn finish(
    c: Common,
    norm: NormIr,
    layers: Vec<LayerIr>,
    mtp: Option<MtpIr>,
    weights: WeightNaming,
) -> ModelIr {
    ModelIr {
        name: c.name,
        vocab: c.vocab,
        hidden: c.hidden,
        dtype: c.dtype,
        max_seq: c.max_seq,
        prefill_buckets: c.buckets,
        norm,
        tied_embeddings: c.tied,
        layers,
        mtp,
        weights,
        quant: None,
        decode_batches: crate::DEFAULT_DECODE_BATCHES.to_vec(),
    }
}

fn divides(what: &str, a: usize, b: usize) -> Result<()> {
    if a == 0 || !b.is_multiple_of(a) {
        return Err(HfError::Invalid(format!(
            "{what}: {b} is not a multiple of {a}"
        )));
    }
    Ok(())
}

/// RoPE settings: `rope_parameters.{rope_theta, partial_rotary_factor, rope_type}`, or the
/// same keys at the top level (older configs).
fn rope(cfg: &Cfg, head_dim: usize, default_partial: f64) -> Result<RopeIr> {
    let params = cfg.opt_obj("rope_parameters")?;
    let lookup = |k: &str| -> Result<Option<f64>> {
        if let Some(p) = &params
            && let Some(v) = p.opt_f64(k)?
        {
            return Ok(Some(v));
        }
        cfg.opt_f64(k)
    };
    let theta = match lookup("rope_theta")? {
        Some(t) => t,
        None => {
            return Err(HfError::Missing {
                key: cfg.key("rope_parameters.rope_theta"),
            });
        }
    };
    if !(theta.is_finite() && theta > 1.0) {
        return Err(HfError::BadValue {
            key: cfg.key("rope_theta"),
            expected: "a finite number > 1".into(),
            found: theta.to_string(),
        });
    }
    let partial = lookup("partial_rotary_factor")?.unwrap_or(default_partial);
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(HfError::BadValue {
            key: cfg.key("partial_rotary_factor"),
            expected: "a number in (0, 1]".into(),
            found: partial.to_string(),
        });
    }
    let rope_type = match &params {
        Some(p) => p.opt_str("rope_type")?.or(p.opt_str("type")?),
        None => None,
    };
    if let Some(t) = rope_type
        && t != "default"
    {
        return Err(HfError::Unsupported(format!(
            "rope_type `{t}` (only `default` RoPE is implemented)"
        )));
    }
    if let Some(scaling) = cfg.opt_obj("rope_scaling")? {
        let t = scaling.opt_str("rope_type")?.or(scaling.opt_str("type")?);
        if !matches!(t, None | Some("default")) {
            return Err(HfError::Unsupported(format!(
                "rope_scaling type `{}`",
                t.unwrap_or("?")
            )));
        }
    }
    let rotary_dims = (head_dim as f64 * partial) as usize;
    if rotary_dims == 0 || !rotary_dims.is_multiple_of(2) {
        return Err(HfError::Invalid(format!(
            "rotary dims head_dim * partial_rotary_factor = {head_dim} * {partial} = {rotary_dims} must be even and positive"
        )));
    }
    Ok(RopeIr {
        theta: F64(theta),
        rotary_dims,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> String {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name);
        let path = dir.join("config.json");
        std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "fixture config {} not found ({e}); the repository keeps them in tests/fixtures",
                path.display()
            )
        })
    }

    #[test]
    fn qwen35_fixture() {
        let ir = ir_from_hf_config(&fixture("qwen35-public"), &HfOptions::default()).unwrap();
        assert_eq!(ir.name, "qwen3_5_text");
        assert_eq!((ir.vocab, ir.hidden, ir.max_seq), (512, 64, 4096));
        assert_eq!(ir.dtype, DType::F32);
        // The default ladder, as the hand-tuned models use it.
        assert_eq!(ir.prefill_buckets, vec![32, 64, 256, 512, 1024, 2048, 4096]);
        let short = ir_from_hf_config(
            &fixture("qwen35-public"),
            &HfOptions {
                max_seq: Some(1000),
                ..HfOptions::default()
            },
        )
        .unwrap();
        assert_eq!(short.prefill_buckets, vec![32, 64, 256, 512]);
        assert_eq!(ir.weights, WeightNaming::Qwen35);
        assert_eq!(ir.norm.weight, NormWeight::OnePlus);
        assert_eq!(ir.norm.eps, F64(1e-6));
        assert!(!ir.tied_embeddings);
        assert!(ir.mtp.is_none());
        let kinds: Vec<&str> = ir.layers.iter().map(|l| l.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "gated_deltanet",
                "gated_deltanet",
                "gated_deltanet",
                "attention"
            ]
        );
        let Some(MixerIr::GatedDeltanet(g)) = &ir.layers[0].mixer else {
            panic!()
        };
        assert_eq!(
            (g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.conv),
            (2, 4, 16, 16, 4)
        );
        assert_eq!(g.qkv_channels(), 128);
        assert_eq!(g.norm_order, GateOrder::NormThenGate);
        let Some(MixerIr::Attention(a)) = &ir.layers[3].mixer else {
            panic!()
        };
        assert_eq!((a.q_heads, a.kv_heads, a.head_dim), (4, 2, 32));
        assert!(a.qk_norm && a.output_gate);
        assert_eq!(
            a.rope,
            Some(RopeIr {
                theta: F64(10000.0),
                rotary_dims: 8
            })
        );
        assert!(
            ir.layers
                .iter()
                .all(|l| l.mlp == Some(MlpIr::Swiglu { intermediate: 128 }))
        );
    }

    #[test]
    fn lfm2_fixture() {
        let ir = ir_from_hf_config(&fixture("lfm2-public"), &HfOptions::default()).unwrap();
        assert_eq!(ir.name, "lfm2");
        assert_eq!(ir.weights, WeightNaming::Lfm2);
        assert!(ir.tied_embeddings);
        assert_eq!(
            ir.norm,
            NormIr {
                eps: F64(1e-5),
                weight: NormWeight::Plain
            }
        );
        let kinds: Vec<&str> = ir.layers.iter().map(|l| l.kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "short_conv",
                "short_conv",
                "attention",
                "short_conv",
                "attention"
            ]
        );
        assert_eq!(
            ir.layers[0].mixer,
            Some(MixerIr::ShortConv(ShortConvIr {
                conv: 3,
                bias: false
            }))
        );
        let Some(MixerIr::Attention(a)) = &ir.layers[2].mixer else {
            panic!()
        };
        assert_eq!(
            (a.q_heads, a.kv_heads, a.head_dim, a.qk_norm, a.output_gate),
            (4, 2, 16, true, false)
        );
        assert_eq!(
            a.rope,
            Some(RopeIr {
                theta: F64(1e6),
                rotary_dims: 16
            })
        );
        // intermediate_size 200 -> int(2*200/3) = 133 -> 32 * ceil(133/32) = 160.
        assert!(
            ir.layers
                .iter()
                .all(|l| l.mlp == Some(MlpIr::Swiglu { intermediate: 160 }))
        );
    }

    #[test]
    fn nemotron_h_fixture() {
        let json = fixture("nemotronh-public");
        let ir = ir_from_hf_config(&json, &HfOptions::default()).unwrap();
        assert_eq!(ir.name, "nemotron_h");
        assert_eq!(ir.weights, WeightNaming::NemotronH);
        assert!(!ir.tied_embeddings);
        let kinds: Vec<&str> = ir.layers.iter().map(|l| l.kind.as_str()).collect();
        assert_eq!(
            kinds,
            ["mamba2", "mlp", "mamba2", "attention", "mlp", "mamba2"]
        );
        let Some(MixerIr::Mamba2(m)) = &ir.layers[0].mixer else {
            panic!()
        };
        assert_eq!(
            (m.heads, m.head_dim, m.groups, m.state, m.conv, m.chunk),
            (8, 16, 2, 16, 4, 128)
        );
        assert_eq!(m.conv_channels(), 192);
        assert!(m.conv_bias);
        assert_eq!(m.dt_min, Some(F64(0.001)));
        assert_eq!(m.norm_order, GateOrder::GateThenNorm);
        assert!(ir.layers[0].mlp.is_none());
        assert_eq!(ir.layers[1].mlp, Some(MlpIr::Relu2 { intermediate: 128 }));
        assert!(ir.layers[1].mixer.is_none());
        let Some(MixerIr::Attention(a)) = &ir.layers[3].mixer else {
            panic!()
        };
        assert_eq!((a.q_heads, a.kv_heads, a.head_dim), (4, 2, 16));
        assert!(a.rope.is_none() && !a.qk_norm && !a.output_gate);

        // The older pattern-string form gives the same IR.
        let mut v: Value = serde_json::from_str(&json).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("layers_block_type");
        o.insert(
            "hybrid_override_pattern".into(),
            Value::String("M-M*-M".into()),
        );
        let ir2 = ir_from_hf_config(&v.to_string(), &HfOptions::default()).unwrap();
        assert_eq!(ir, ir2);
    }

    #[test]
    fn options_override_defaults() {
        let opts = HfOptions {
            name: Some("tiny".into()),
            max_seq: Some(40),
            prefill_buckets: Some(vec![64, 8, 32]),
            dtype: Some(DType::Bf16),
            ..HfOptions::default()
        };
        let ir = ir_from_hf_config(&fixture("lfm2-public"), &opts).unwrap();
        assert_eq!(ir.name, "tiny");
        assert_eq!(ir.max_seq, 40);
        assert_eq!(ir.prefill_buckets, vec![8, 32, 40]);
        assert_eq!(ir.dtype, DType::Bf16);
    }

    #[test]
    fn qwen_interval_nested_and_mtp() {
        let text: Value = serde_json::from_str(&fixture("qwen35-public")).unwrap();
        let mut text = text.as_object().unwrap().clone();
        text.remove("layer_types");
        text.insert("full_attention_interval".into(), 4.into());
        text.insert("mtp_num_hidden_layers".into(), 1.into());
        text.remove("dtype");
        let mut outer = Map::new();
        outer.insert("model_type".into(), "qwen3_5".into());
        outer.insert("torch_dtype".into(), "bfloat16".into());
        outer.insert("text_config".into(), Value::Object(text));
        let ir =
            ir_from_hf_config(&Value::Object(outer).to_string(), &HfOptions::default()).unwrap();
        let base = ir_from_hf_config(&fixture("qwen35-public"), &HfOptions::default()).unwrap();
        assert_eq!(ir.layers, base.layers);
        assert_eq!(ir.dtype, DType::Bf16);
        let mtp = ir.mtp.expect("mtp head");
        assert_eq!(mtp.layers.len(), 1);
        assert_eq!(mtp.layers[0].kind, "attention");
    }

    #[test]
    fn errors_name_the_key() {
        let e = ir_from_hf_config(r#"{"model_type": "llama"}"#, &HfOptions::default()).unwrap_err();
        assert!(
            matches!(e, HfError::UnknownModelType(ref t) if t == "llama"),
            "{e}"
        );
        assert!(e.to_string().contains("llama"));

        let e = ir_from_hf_config("{not json", &HfOptions::default()).unwrap_err();
        assert!(matches!(e, HfError::Json(_)));

        let mut v: Value = serde_json::from_str(&fixture("lfm2-public")).unwrap();
        v.as_object_mut().unwrap().remove("hidden_size");
        let e = ir_from_hf_config(&v.to_string(), &HfOptions::default()).unwrap_err();
        assert_eq!(
            e,
            HfError::Missing {
                key: "hidden_size".into()
            }
        );

        let mut v: Value = serde_json::from_str(&fixture("qwen35-public")).unwrap();
        v["linear_num_key_heads"] = Value::String("two".into());
        let e = ir_from_hf_config(&v.to_string(), &HfOptions::default()).unwrap_err();
        assert!(
            matches!(e, HfError::BadValue { ref key, .. } if key == "linear_num_key_heads"),
            "{e}"
        );

        let mut v: Value = serde_json::from_str(&fixture("nemotronh-public")).unwrap();
        v["layers_block_type"][2] = Value::String("moe".into());
        // transformers writes its MoE defaults into every nemotron_h config, so a `moe` block
        // is read from them (8 experts, top-2, width 7688 in this one).
        let ir = ir_from_hf_config(&v.to_string(), &HfOptions::default()).unwrap();
        assert!(
            matches!(ir.layers[2].mlp, Some(MlpIr::Moe(ref m)) if m.route.experts == 8),
            "{ir:?}"
        );
        let mut v: Value = serde_json::from_str(&fixture("nemotronh-public")).unwrap();
        v["layers_block_type"][2] = Value::String("moe".into());
        v.as_object_mut().unwrap().remove("n_routed_experts");
        let e = ir_from_hf_config(&v.to_string(), &HfOptions::default()).unwrap_err();
        assert!(
            matches!(e, HfError::Missing { ref key } if key == "n_routed_experts"),
            "{e}"
        );

        let e = ir_from_hf_config(r#"{"model_type": "qwen3_next"}"#, &HfOptions::default())
            .unwrap_err();
        assert!(matches!(e, HfError::Unsupported(_)), "{e}");

        let e = ir_from_hf_config(r#"{"vocab_size": 3}"#, &HfOptions::default()).unwrap_err();
        assert_eq!(
            e,
            HfError::Missing {
                key: "model_type".into()
            }
        );
    }

    #[test]
    fn infinity_encoding_is_a_float() {
        let v: Value = serde_json::from_str(r#"{"__float__": "Infinity"}"#).unwrap();
        assert_eq!(as_f64(&v), Some(f64::INFINITY));
    }

    #[test]
    fn lfm2_width_formula() {
        assert_eq!(lfm2_mlp_width(200, true, Some(1.0), 32), 160);
        assert_eq!(lfm2_mlp_width(200, false, Some(1.0), 32), 200);
        assert_eq!(lfm2_mlp_width(12288, true, None, 256), 8192);
    }

    #[test]
    fn moe_configs_and_their_errors() {
        let q = ir_from_hf_config(&fixture("qwen35moe-public"), &HfOptions::default()).unwrap();
        assert_eq!(q.layers[0].kind, "gated_deltanet_moe");
        assert_eq!(q.layers[3].kind, "attention_moe");
        let edit = |name: &str, key: &str, v: Value| {
            let mut c: Value = serde_json::from_str(&fixture(name)).unwrap();
            c[key] = v;
            ir_from_hf_config(&c.to_string(), &HfOptions::default())
        };
        let e = edit("qwen35moe-public", "num_experts_per_tok", 9.into()).unwrap_err();
        assert!(
            e.to_string()
                .contains("num_experts_per_tok = 9 exceeds the 8 experts"),
            "{e}"
        );
        let e = edit("nemotronhmoe-public", "moe_latent_size", 16.into()).unwrap_err();
        assert!(
            matches!(e, HfError::Unsupported(ref m) if m.contains("moe_latent_size")),
            "{e}"
        );
        let e = edit("nemotronhmoe-public", "n_group", 3.into()).unwrap_err();
        assert!(e.to_string().contains("n_group = 3"), "{e}");
        // `decoder_sparse_step` / `mlp_only_layers` make some Qwen layers dense.
        let mut c: Value = serde_json::from_str(&fixture("qwen35moe-public")).unwrap();
        c["mlp_only_layers"] = serde_json::json!([1]);
        c["intermediate_size"] = 96.into();
        let ir = ir_from_hf_config(&c.to_string(), &HfOptions::default()).unwrap();
        assert_eq!(ir.layers[1].mlp, Some(MlpIr::Swiglu { intermediate: 96 }));
        assert_eq!(ir.layers[1].kind, "gated_deltanet");
        assert!(matches!(ir.layers[2].mlp, Some(MlpIr::Moe(_))));
        // Nemotron-H patterns accept `E`.
        let mut c: Value = serde_json::from_str(&fixture("nemotronhmoe-public")).unwrap();
        c.as_object_mut().unwrap().remove("layers_block_type");
        c["hybrid_override_pattern"] = "MEM*EME".into();
        let p = ir_from_hf_config(&c.to_string(), &HfOptions::default()).unwrap();
        let base =
            ir_from_hf_config(&fixture("nemotronhmoe-public"), &HfOptions::default()).unwrap();
        assert_eq!(p.layers, base.layers);
    }

    /// `quantization_config` (fine-grained FP8): the block, and `modules_to_not_convert` as
    /// flashrt weight names — suffixes where every layer keeps the matrix.
    #[test]
    fn fp8_quantization_configs() {
        let ir = ir_from_hf_config(&fixture("qwen35fp8-public"), &HfOptions::default()).unwrap();
        let q = ir.quant.expect("quantized");
        assert_eq!((q.format, q.block), (QuantFormat::Fp8E4m3, [32, 32]));
        let mut ex = q.exclude.clone();
        ex.sort();
        assert_eq!(ex, ["gdn.in_proj_a", "gdn.in_proj_b", "lm_head"]);
        let ir = ir_from_hf_config(&fixture("qwen35moefp8-public"), &HfOptions::default()).unwrap();
        let mut ex = ir.quant.unwrap().exclude;
        ex.sort();
        assert_eq!(
            ex,
            [
                "gdn.in_proj_a",
                "gdn.in_proj_b",
                "lm_head",
                "moe.shared.token_gate"
            ]
        );
        // The multimodal releases' `model.language_model.` names, and one layer's projection.
        let mut c: Value = serde_json::from_str(&fixture("qwen35fp8-public")).unwrap();
        let list = c["quantization_config"]["modules_to_not_convert"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                Value::String(
                    v.as_str()
                        .unwrap()
                        .replace("model.layers.", "model.language_model.layers."),
                )
            })
            .chain([Value::String(
                "model.language_model.layers.1.linear_attn.out_proj".into(),
            )])
            .collect();
        c["quantization_config"]["modules_to_not_convert"] = Value::Array(list);
        let ir = ir_from_hf_config(&c.to_string(), &HfOptions::default()).unwrap();
        assert!(
            ir.quant
                .unwrap()
                .exclude
                .contains(&"layers.1.gdn.out_proj".to_string())
        );
        // Without a list, transformers keeps the LM head only; without a block, 128 x 128.
        let mut c: Value = serde_json::from_str(&fixture("qwen35fp8-public")).unwrap();
        let qc = c["quantization_config"].as_object_mut().unwrap();
        qc.remove("modules_to_not_convert");
        qc.remove("weight_block_size");
        let q = ir_from_hf_config(&c.to_string(), &HfOptions::default())
            .unwrap()
            .quant
            .unwrap();
        assert_eq!(
            (q.block, q.exclude),
            ([128, 128], vec!["lm_head".to_string()])
        );
        // `--quantize` applies to an unquantized checkpoint only.
        let opts = HfOptions {
            quantize: Some(QuantIr::with_defaults(QuantFormat::Fp8E4m3, [128, 128])),
            ..HfOptions::default()
        };
        let ir = ir_from_hf_config(&fixture("qwen35-public"), &opts).unwrap();
        assert_eq!(ir.quant.unwrap().block, [128, 128]);
        let ir = ir_from_hf_config(&fixture("qwen35fp8-public"), &opts).unwrap();
        assert_eq!(ir.quant.unwrap().block, [32, 32]);
    }

    #[test]
    fn unsupported_quantization_is_named() {
        let edit = |f: &dyn Fn(&mut Value)| {
            let mut c: Value = serde_json::from_str(&fixture("qwen35fp8-public")).unwrap();
            f(&mut c);
            ir_from_hf_config(&c.to_string(), &HfOptions::default())
                .unwrap_err()
                .to_string()
        };
        let e = edit(&|c| c["quantization_config"]["quant_method"] = "awq".into());
        assert!(e.contains("quant_method `awq`"), "{e}");
        let e = edit(&|c| c["quantization_config"]["activation_scheme"] = "static".into());
        assert!(e.contains("activation_scheme `static`"), "{e}");
        let e = edit(&|c| c["quantization_config"]["weight_block_size"] = Value::Null);
        assert!(e.contains("weight_block_size null"), "{e}");
        let e =
            edit(&|c| c["quantization_config"]["weight_block_size"] = serde_json::json!([0, 128]));
        assert!(e.contains("weight_block_size"), "{e}");
        // One expert's projections kept in bf16: a stacked weight is quantized whole.
        let mut c: Value = serde_json::from_str(&fixture("qwen35moefp8-public")).unwrap();
        c["quantization_config"]["modules_to_not_convert"]
            .as_array_mut()
            .unwrap()
            .push("model.layers.1.mlp.experts.3.up_proj".into());
        let e = ir_from_hf_config(&c.to_string(), &HfOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("keeps 1 of the 16") && e.contains("layers.1.moe.up"),
            "{e}"
        );
    }
}
