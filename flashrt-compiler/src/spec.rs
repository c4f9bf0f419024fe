//! Value tree -> spec AST: the structural half of checking.
//!
//! This stage knows the shape of the spec language (which keys each table has, their types,
//! their defaults, the names of the enumerations) and nothing about what makes a model
//! consistent; that is [`crate::check`]'s job. Every field is read independently, so one
//! bad value costs one error and the rest of the description is still read and checked.
//! A field that is missing or malformed becomes `None` after its error has been recorded;
//! later stages skip checks that depend on it instead of reporting follow-on errors.

use crate::value::{Entry, Errors, Loc, Table, Value, ValueKind, hint, list};
use flashrt_ir::{DType, ExpertAct, GateOrder, NormWeight, QuantFormat, RouterScore, WeightNaming};

/// The largest size the spec language accepts for any dimension or count (`i32::MAX`:
/// positions and lengths travel to kernels as `i32`).
pub const MAX_SIZE: u64 = i32::MAX as u64;

/// A value with the location of the token it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct S<T> {
    pub v: T,
    pub loc: Loc,
}

/// A field after reading: `None` when it was missing or malformed (already reported).
pub type F<T> = Option<S<T>>;

/// A part of a layer kind that may be absent by design.
#[derive(Clone, Debug, PartialEq)]
pub enum Part<T> {
    Absent,
    /// Written, but malformed (already reported).
    Invalid,
    Present(T),
}

/// A whole model description.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub loc: Loc,
    pub model: Option<ModelSection>,
    pub kinds: Vec<KindSpec>,
    pub stack: Option<StackSpec>,
    pub mtp: Option<MtpSpec>,
}

/// `[model]`
#[derive(Clone, Debug)]
pub struct ModelSection {
    pub loc: Loc,
    pub name: F<String>,
    pub vocab: F<u64>,
    pub hidden: F<u64>,
    pub dtype: F<DType>,
    pub max_seq: F<u64>,
    pub prefill_buckets: F<Vec<S<u64>>>,
    /// `None`: no `decode_batches` key (the default ladder).
    pub decode_batches: Option<F<Vec<S<u64>>>>,
    pub norm: Option<NormSpec>,
    pub tie_embeddings: F<bool>,
    pub weights: F<WeightNaming>,
    /// `None`: no `quantize` key.
    pub quantize: Option<QuantSpec>,
}

/// `quantize = { format = "fp8_e4m3", block = [128, 128], exclude = [...] }`
#[derive(Clone, Debug)]
pub struct QuantSpec {
    pub loc: Loc,
    pub format: F<QuantFormat>,
    pub block: F<[S<u64>; 2]>,
    /// `None` (absent): [`flashrt_ir::DEFAULT_QUANT_EXCLUDE`].
    pub exclude: F<Option<Vec<S<String>>>>,
}

/// `norm = { kind = "rms", eps, weight }`
#[derive(Clone, Debug)]
pub struct NormSpec {
    pub loc: Loc,
    pub eps: F<f64>,
    pub weight: F<NormWeight>,
}

/// `[kinds.<name>]`
#[derive(Clone, Debug)]
pub struct KindSpec {
    pub name: S<String>,
    pub loc: Loc,
    pub mixer: Part<S<MixerSpec>>,
    pub mlp: Part<S<MlpSpec>>,
}

#[derive(Clone, Debug)]
pub enum MixerSpec {
    Attention(AttentionSpec),
    GatedDeltanet(GdnSpec),
    ShortConv(ShortConvSpec),
    Mamba2(Mamba2Spec),
}

#[derive(Clone, Debug)]
pub struct AttentionSpec {
    pub q_heads: F<u64>,
    pub kv_heads: F<u64>,
    pub head_dim: F<u64>,
    pub qk_norm: F<bool>,
    /// `Some(None)`: `rope = "none"`.
    pub rope: F<Option<RopeSpec>>,
    pub output_gate: F<bool>,
}

#[derive(Clone, Debug)]
pub struct RopeSpec {
    pub theta: F<f64>,
    pub fraction: F<f64>,
}

#[derive(Clone, Debug)]
pub struct GdnSpec {
    pub key_heads: F<u64>,
    pub value_heads: F<u64>,
    pub key_dim: F<u64>,
    pub value_dim: F<u64>,
    pub conv: F<u64>,
    pub norm_order: F<GateOrder>,
}

#[derive(Clone, Debug)]
pub struct ShortConvSpec {
    pub conv: F<u64>,
    pub bias: F<bool>,
}

#[derive(Clone, Debug)]
pub struct Mamba2Spec {
    pub heads: F<u64>,
    pub head_dim: F<u64>,
    pub groups: F<u64>,
    pub state: F<u64>,
    pub conv: F<u64>,
    pub chunk: F<u64>,
    pub conv_bias: F<bool>,
    pub dt_min: F<Option<f64>>,
    pub norm_order: F<GateOrder>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    Swiglu,
    Relu2,
    Moe,
}

#[derive(Clone, Debug)]
pub struct MlpSpec {
    pub kind: MlpKind,
    /// The dense width, or one routed expert's.
    pub intermediate: F<u64>,
    /// `kind = "moe"` only.
    pub moe: Option<MoeSpec>,
}

/// The routing and experts of `mlp = { kind = "moe", .. }`.
#[derive(Clone, Debug)]
pub struct MoeSpec {
    pub experts: F<u64>,
    pub top_k: F<u64>,
    pub act: F<ExpertAct>,
    pub router: F<RouterScore>,
    pub expert_bias: F<bool>,
    pub renormalize: F<bool>,
    pub renorm_eps: F<f64>,
    pub scaling: F<f64>,
    pub groups: F<u64>,
    /// `None`: every group.
    pub top_groups: F<Option<u64>>,
    /// `None`: no shared expert.
    pub shared: F<Option<SharedSpec>>,
}

/// `shared = { intermediate, gated }`
#[derive(Clone, Debug)]
pub struct SharedSpec {
    pub intermediate: F<u64>,
    pub gated: F<bool>,
}

/// `[stack]`
#[derive(Clone, Debug)]
pub struct StackSpec {
    pub loc: Loc,
    pub pattern: F<Vec<S<String>>>,
    pub repeat: F<u64>,
}

/// `[mtp]`
#[derive(Clone, Debug)]
pub struct MtpSpec {
    pub loc: Loc,
    pub layers: F<u64>,
    pub kind: F<String>,
}

pub const DTYPES: &[(&str, DType)] = &[
    ("f32", DType::F32),
    ("bf16", DType::Bf16),
    ("f16", DType::F16),
];
pub const QUANT_FORMATS: &[(&str, QuantFormat)] = &[("fp8_e4m3", QuantFormat::Fp8E4m3)];
pub const NORM_WEIGHTS: &[(&str, NormWeight)] = &[
    ("plain", NormWeight::Plain),
    ("one_plus", NormWeight::OnePlus),
];
pub const GATE_ORDERS: &[(&str, GateOrder)] = &[
    ("norm_then_gate", GateOrder::NormThenGate),
    ("gate_then_norm", GateOrder::GateThenNorm),
];
pub const NAMINGS: &[(&str, WeightNaming)] = &[
    ("qwen3_5_text", WeightNaming::Qwen35),
    ("lfm2", WeightNaming::Lfm2),
    ("nemotron_h", WeightNaming::NemotronH),
];
pub const MIXER_KINDS: &[&str] = &["attention", "gated_deltanet", "short_conv", "mamba2"];
pub const MLP_KINDS: &[(&str, MlpKind)] = &[
    ("swiglu", MlpKind::Swiglu),
    ("relu2", MlpKind::Relu2),
    ("moe", MlpKind::Moe),
];
pub const EXPERT_ACTS: &[(&str, ExpertAct)] =
    &[("swiglu", ExpertAct::Swiglu), ("relu2", ExpertAct::Relu2)];
pub const ROUTER_SCORES: &[(&str, RouterScore)] = &[
    ("softmax", RouterScore::Softmax),
    ("sigmoid", RouterScore::Sigmoid),
];

/// Reads the keys of one table. Every key looked up is remembered, so [`Fields::finish`]
/// can report the others as unknown, with a suggestion among the known ones.
struct Fields<'a> {
    table: &'a Table,
    /// Where "missing key" errors and defaults are placed: the key that names the table
    /// (`mixer` in `mixer = { .. }`, `attn` in `[kinds.attn]`), or the document.
    loc: Loc,
    what: String,
    asked: Vec<&'static str>,
}

impl<'a> Fields<'a> {
    fn new(cx: &mut Errors, table: &'a Table, loc: Loc, what: String) -> Self {
        for (i, e) in table.entries.iter().enumerate() {
            if table.entries[..i].iter().any(|p| p.key == e.key) {
                cx.push(e.key_loc, format!("duplicate key `{}` in {what}", e.key));
            }
        }
        Fields {
            table,
            loc,
            what,
            asked: Vec::new(),
        }
    }

    fn entry(&mut self, key: &'static str) -> Option<&'a Entry> {
        self.asked.push(key);
        self.table.entries.iter().find(|e| e.key == key)
    }

    fn get(&mut self, key: &'static str) -> Option<&'a Value> {
        self.entry(key).map(|e| &e.value)
    }

    /// A required key.
    fn req<T>(
        &mut self,
        cx: &mut Errors,
        key: &'static str,
        f: impl FnOnce(&mut Errors, &'a Value) -> Option<T>,
    ) -> F<T> {
        match self.get(key) {
            Some(v) => f(cx, v).map(|x| S { v: x, loc: v.loc }),
            None => {
                cx.push(self.loc, format!("missing key `{key}` in {}", self.what));
                None
            }
        }
    }

    /// An optional key with a default (located at the key naming the table when absent).
    fn opt<T>(
        &mut self,
        cx: &mut Errors,
        key: &'static str,
        default: T,
        f: impl FnOnce(&mut Errors, &'a Value) -> Option<T>,
    ) -> F<T> {
        match self.get(key) {
            Some(v) => f(cx, v).map(|x| S { v: x, loc: v.loc }),
            None => Some(S {
                v: default,
                loc: self.loc,
            }),
        }
    }

    fn finish(self, cx: &mut Errors) {
        for e in &self.table.entries {
            if !self.asked.contains(&e.key.as_str()) {
                cx.push(
                    e.key_loc,
                    format!(
                        "unknown key `{}` in {}{}",
                        e.key,
                        self.what,
                        hint(&e.key, &self.asked)
                    ),
                );
            }
        }
    }
}

fn mismatch(cx: &mut Errors, v: &Value, expected: &str) {
    cx.push(
        v.loc,
        format!("expected {expected}, found {}", v.kind.describe()),
    );
}

/// An array of positive integers, each located.
fn sizes(cx: &mut Errors, v: &Value, expected: &str) -> Option<Vec<S<u64>>> {
    match &v.kind {
        ValueKind::Array(items) => {
            let out: Vec<Option<S<u64>>> = items
                .iter()
                .map(|i| size(cx, i).map(|x| S { v: x, loc: i.loc }))
                .collect();
            out.into_iter().collect::<Option<Vec<_>>>()
        }
        _ => {
            mismatch(cx, v, expected);
            None
        }
    }
}

/// A positive integer no larger than [`MAX_SIZE`].
fn size(cx: &mut Errors, v: &Value) -> Option<u64> {
    match v.kind {
        ValueKind::Int(i) if i <= 0 => {
            cx.push(v.loc, format!("expected a positive integer, found {i}"));
            None
        }
        ValueKind::Int(i) if i > MAX_SIZE as i128 => {
            cx.push(v.loc, format!("{i} is too large (at most {MAX_SIZE})"));
            None
        }
        ValueKind::Int(i) => Some(i as u64),
        _ => {
            mismatch(cx, v, "a positive integer");
            None
        }
    }
}

/// A finite number (integers are accepted and converted).
fn number(cx: &mut Errors, v: &Value) -> Option<f64> {
    let x = match v.kind {
        ValueKind::Int(i) => i as f64,
        ValueKind::Float(f) => f,
        _ => {
            mismatch(cx, v, "a number");
            return None;
        }
    };
    if !x.is_finite() {
        cx.push(v.loc, format!("expected a finite number, found {x}"));
        return None;
    }
    // `-0.0 + 0.0 == +0.0`: one spelling of zero, so equal models hash alike.
    Some(x + 0.0)
}

fn boolean(cx: &mut Errors, v: &Value) -> Option<bool> {
    match v.kind {
        ValueKind::Bool(b) => Some(b),
        _ => {
            mismatch(cx, v, "`true` or `false`");
            None
        }
    }
}

fn string(cx: &mut Errors, v: &Value) -> Option<String> {
    match &v.kind {
        ValueKind::Str(s) => Some(s.clone()),
        _ => {
            mismatch(cx, v, "a string");
            None
        }
    }
}

fn table<'a>(cx: &mut Errors, v: &'a Value) -> Option<&'a Table> {
    match &v.kind {
        ValueKind::Table(t) => Some(t),
        _ => {
            mismatch(cx, v, "a table");
            None
        }
    }
}

/// One of a fixed set of names; `alias` maps further accepted spellings.
fn choice<T: Copy>(
    cx: &mut Errors,
    v: &Value,
    what: &str,
    options: &[(&str, T)],
    alias: impl Fn(&str) -> Option<T>,
) -> Option<T> {
    let s = string(cx, v)?;
    if let Some(&(_, t)) = options.iter().find(|(n, _)| *n == s) {
        return Some(t);
    }
    if let Some(t) = alias(&s) {
        return Some(t);
    }
    let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
    cx.push(
        v.loc,
        format!("unknown {what} `{s}`{}", full_hint(&s, &names)),
    );
    None
}

/// A hint that always lists the options (enumerations are short).
fn full_hint(word: &str, names: &[&str]) -> String {
    let h = hint(word, names);
    if h.starts_with("; did you mean") {
        format!("{h} (expected one of {})", list(names))
    } else {
        h
    }
}

fn no_alias<T>(_: &str) -> Option<T> {
    None
}

/// Reads the whole description. `default_name` stands in for a missing `model.name`.
pub fn read(cx: &mut Errors, root: &Value, default_name: Option<&str>) -> ModelSpec {
    let empty = Table::default();
    let top = table(cx, root).unwrap_or(&empty);
    let mut f = Fields::new(cx, top, root.loc, "the model description".into());
    let model = match f.entry("model") {
        Some(e) => table(cx, &e.value).map(|t| read_model(cx, t, e.key_loc, default_name)),
        None => {
            cx.push(root.loc, "missing section `model`");
            None
        }
    };
    let kinds = match f.entry("kinds") {
        Some(e) => table(cx, &e.value)
            .map(|t| read_kinds(cx, t, e.key_loc))
            .unwrap_or_default(),
        None => {
            cx.push(
                root.loc,
                "missing section `kinds` (the layer kinds the stack is built from)",
            );
            Vec::new()
        }
    };
    let stack = match f.entry("stack") {
        Some(e) => table(cx, &e.value).map(|t| read_stack(cx, t, e.key_loc)),
        None => {
            cx.push(root.loc, "missing section `stack`");
            None
        }
    };
    let mtp = f
        .entry("mtp")
        .and_then(|e| table(cx, &e.value).map(|t| read_mtp(cx, t, e.key_loc)));
    f.finish(cx);
    ModelSpec {
        loc: root.loc,
        model,
        kinds,
        stack,
        mtp,
    }
}

fn read_model(cx: &mut Errors, t: &Table, loc: Loc, default_name: Option<&str>) -> ModelSection {
    let mut f = Fields::new(cx, t, loc, "`model`".into());
    let name = match default_name {
        Some(d) => f.opt(cx, "name", d.to_string(), string),
        None => f.req(cx, "name", string),
    };
    let vocab = f.req(cx, "vocab", size);
    let hidden = f.req(cx, "hidden", size);
    let dtype = f.req(cx, "dtype", |cx, v| {
        choice(cx, v, "dtype", DTYPES, DType::parse)
    });
    let max_seq = f.req(cx, "max_seq", size);
    let prefill_buckets = f.req(cx, "prefill_buckets", |cx, v| {
        sizes(cx, v, "an array of chunk sizes")
    });
    let decode_batches = f
        .get("decode_batches")
        .map(|v| sizes(cx, v, "an array of batch sizes").map(|x| S { v: x, loc: v.loc }));
    let norm = match f.entry("norm") {
        Some(e) => table(cx, &e.value).map(|t| read_norm(cx, t, e.key_loc)),
        None => {
            cx.push(
                loc,
                "missing key `norm` in `model` (e.g. `norm = { kind = \"rms\", eps = 1e-6 }`)",
            );
            None
        }
    };
    let tie_embeddings = f.opt(cx, "tie_embeddings", false, boolean);
    let weights = f.req(cx, "weights", |cx, v| {
        choice(
            cx,
            v,
            "weight naming",
            NAMINGS,
            WeightNaming::from_hf_model_type,
        )
    });
    let quantize = f
        .entry("quantize")
        .and_then(|e| table(cx, &e.value).map(|t| read_quantize(cx, t, e.key_loc)));
    f.finish(cx);
    ModelSection {
        loc,
        name,
        vocab,
        hidden,
        dtype,
        max_seq,
        prefill_buckets,
        decode_batches,
        norm,
        tie_embeddings,
        weights,
        quantize,
    }
}

fn read_quantize(cx: &mut Errors, t: &Table, loc: Loc) -> QuantSpec {
    let mut f = Fields::new(cx, t, loc, "`model.quantize`".into());
    let format = f.req(cx, "format", |cx, v| {
        choice(
            cx,
            v,
            "quantization format",
            QUANT_FORMATS,
            QuantFormat::parse,
        )
    });
    let block = f.opt(
        cx,
        "block",
        [S { v: 128, loc }, S { v: 128, loc }],
        |cx, v| match &v.kind {
            ValueKind::Array(items) if items.len() == 2 => {
                let r = size(cx, &items[0]).map(|x| S {
                    v: x,
                    loc: items[0].loc,
                });
                let c = size(cx, &items[1]).map(|x| S {
                    v: x,
                    loc: items[1].loc,
                });
                Some([r?, c?])
            }
            _ => {
                mismatch(cx, v, "an array `[rows, cols]` of two block sizes");
                None
            }
        },
    );
    let exclude = f.opt(cx, "exclude", None, |cx, v| match &v.kind {
        ValueKind::Array(items) => {
            let out: Vec<Option<S<String>>> = items
                .iter()
                .map(|i| string(cx, i).map(|x| S { v: x, loc: i.loc }))
                .collect();
            out.into_iter().collect::<Option<Vec<_>>>().map(Some)
        }
        _ => {
            mismatch(cx, v, "an array of weight names");
            None
        }
    });
    f.finish(cx);
    QuantSpec {
        loc,
        format,
        block,
        exclude,
    }
}

fn read_norm(cx: &mut Errors, t: &Table, loc: Loc) -> NormSpec {
    let mut f = Fields::new(cx, t, loc, "`model.norm`".into());
    f.opt(cx, "kind", (), |cx, v| {
        choice(cx, v, "norm kind", &[("rms", ())], no_alias)
    });
    let eps = f.req(cx, "eps", |cx, v| {
        let x = number(cx, v)?;
        if x > 0.0 {
            Some(x)
        } else {
            cx.push(
                v.loc,
                format!("the norm epsilon must be positive, found {x}"),
            );
            None
        }
    });
    let weight = f.opt(cx, "weight", NormWeight::Plain, |cx, v| {
        choice(cx, v, "norm weight", NORM_WEIGHTS, no_alias)
    });
    f.finish(cx);
    NormSpec { loc, eps, weight }
}

fn read_kinds(cx: &mut Errors, t: &Table, loc: Loc) -> Vec<KindSpec> {
    // Duplicate kind names are duplicate keys of this table.
    let _ = Fields::new(cx, t, loc, "`kinds`".into());
    let mut out = Vec::new();
    for e in &t.entries {
        let name = S {
            v: e.key.clone(),
            loc: e.key_loc,
        };
        let Some(kt) = table(cx, &e.value) else {
            continue;
        };
        let what = format!("kind `{}`", e.key);
        let mut f = Fields::new(cx, kt, e.key_loc, what.clone());
        let mixer = match f.entry("mixer") {
            None => Part::Absent,
            Some(m) => match read_mixer(cx, m, &e.key) {
                Some(spec) => Part::Present(S {
                    v: spec,
                    loc: m.key_loc,
                }),
                None => Part::Invalid,
            },
        };
        let mlp = match f.entry("mlp") {
            None => Part::Absent,
            Some(m) => match read_mlp(cx, m, &e.key) {
                Some(spec) => Part::Present(S {
                    v: spec,
                    loc: m.key_loc,
                }),
                None => Part::Invalid,
            },
        };
        f.finish(cx);
        if matches!(mixer, Part::Absent) && matches!(mlp, Part::Absent) {
            cx.push(
                e.key_loc,
                format!("{what} has neither a `mixer` nor an `mlp`"),
            );
        }
        out.push(KindSpec {
            name,
            loc: e.value.loc,
            mixer,
            mlp,
        });
    }
    out
}

/// Reads `kind = "..."` of a mixer or MLP table; `None` (reported) when missing or unknown.
fn kind_tag<'a>(
    cx: &mut Errors,
    f: &mut Fields<'a>,
    what: &str,
    names: &[&'static str],
) -> Option<&'static str> {
    let v = f.get("kind");
    let Some(v) = v else {
        cx.push(
            f.loc,
            format!("missing key `kind` in {} (one of {})", f.what, list(names)),
        );
        return None;
    };
    let s = string(cx, v)?;
    match names.iter().find(|n| **n == s) {
        Some(n) => Some(n),
        None => {
            cx.push(
                v.loc,
                format!("unknown {what} kind `{s}`{}", full_hint(&s, names)),
            );
            None
        }
    }
}

fn read_mixer(cx: &mut Errors, e: &Entry, kind: &str) -> Option<MixerSpec> {
    let t = table(cx, &e.value)?;
    let mut f = Fields::new(cx, t, e.key_loc, format!("the mixer of kind `{kind}`"));
    let tag = kind_tag(cx, &mut f, "mixer", MIXER_KINDS)?;
    f.what = format!("the {tag} mixer of kind `{kind}`");
    let m = match tag {
        "attention" => MixerSpec::Attention(AttentionSpec {
            q_heads: f.req(cx, "q_heads", size),
            kv_heads: f.req(cx, "kv_heads", size),
            head_dim: f.req(cx, "head_dim", size),
            qk_norm: f.opt(cx, "qk_norm", false, boolean),
            rope: match f.entry("rope") {
                Some(e) => read_rope(cx, e).map(|r| S {
                    v: r,
                    loc: e.value.loc,
                }),
                None => {
                    cx.push(f.loc, format!("missing key `rope` in {} (`rope = \"none\"` for no positional encoding)", f.what));
                    None
                }
            },
            output_gate: f.opt(cx, "output_gate", false, boolean),
        }),
        "gated_deltanet" => MixerSpec::GatedDeltanet(GdnSpec {
            key_heads: f.req(cx, "key_heads", size),
            value_heads: f.req(cx, "value_heads", size),
            key_dim: f.req(cx, "key_dim", size),
            value_dim: f.req(cx, "value_dim", size),
            conv: f.req(cx, "conv", size),
            norm_order: f.opt(cx, "norm_order", GateOrder::NormThenGate, |cx, v| {
                choice(cx, v, "norm order", GATE_ORDERS, no_alias)
            }),
        }),
        "short_conv" => MixerSpec::ShortConv(ShortConvSpec {
            conv: f.req(cx, "conv", size),
            bias: f.opt(cx, "bias", false, boolean),
        }),
        "mamba2" => MixerSpec::Mamba2(Mamba2Spec {
            heads: f.req(cx, "heads", size),
            head_dim: f.req(cx, "head_dim", size),
            groups: f.req(cx, "groups", size),
            state: f.req(cx, "state", size),
            conv: f.req(cx, "conv", size),
            chunk: f.opt(cx, "chunk", 128, size),
            conv_bias: f.opt(cx, "conv_bias", true, boolean),
            dt_min: f.opt(cx, "dt_min", None, |cx, v| {
                let x = number(cx, v)?;
                if x < 0.0 {
                    cx.push(v.loc, format!("`dt_min` must not be negative, found {x}"));
                    return None;
                }
                Some(Some(x))
            }),
            norm_order: f.opt(cx, "norm_order", GateOrder::GateThenNorm, |cx, v| {
                choice(cx, v, "norm order", GATE_ORDERS, no_alias)
            }),
        }),
        _ => return None,
    };
    f.finish(cx);
    Some(m)
}

fn read_rope(cx: &mut Errors, e: &Entry) -> Option<Option<RopeSpec>> {
    let v = &e.value;
    match &v.kind {
        ValueKind::Str(s) if s == "none" => Some(None),
        ValueKind::Str(s) => {
            cx.push(v.loc, format!("expected `rope = {{ theta = .., fraction = .. }}` or `rope = \"none\"`, found `{s}`"));
            None
        }
        ValueKind::Table(t) => {
            let mut f = Fields::new(cx, t, e.key_loc, "`rope`".into());
            let theta = f.req(cx, "theta", |cx, v| {
                let x = number(cx, v)?;
                if x > 0.0 {
                    Some(x)
                } else {
                    cx.push(v.loc, format!("the rope theta must be positive, found {x}"));
                    None
                }
            });
            let fraction = f.opt(cx, "fraction", 1.0, |cx, v| {
                let x = number(cx, v)?;
                if x > 0.0 && x <= 1.0 {
                    Some(x)
                } else {
                    cx.push(
                        v.loc,
                        format!("the rotary fraction must be in (0, 1], found {x}"),
                    );
                    None
                }
            });
            f.finish(cx);
            Some(Some(RopeSpec { theta, fraction }))
        }
        _ => {
            mismatch(cx, v, "a rope table or \"none\"");
            None
        }
    }
}

fn read_mlp(cx: &mut Errors, e: &Entry, kind: &str) -> Option<MlpSpec> {
    let t = table(cx, &e.value)?;
    let mut f = Fields::new(cx, t, e.key_loc, format!("the mlp of kind `{kind}`"));
    let names: Vec<&'static str> = MLP_KINDS.iter().map(|(n, _)| *n).collect();
    let tag = kind_tag(cx, &mut f, "mlp", &names)?;
    let mlp_kind = MLP_KINDS.iter().find(|(n, _)| *n == tag).map(|&(_, k)| k)?;
    f.what = format!("the {tag} mlp of kind `{kind}`");
    let intermediate = f.req(cx, "intermediate", size);
    let moe = (mlp_kind == MlpKind::Moe).then(|| read_moe(cx, &mut f));
    f.finish(cx);
    Some(MlpSpec {
        kind: mlp_kind,
        intermediate,
        moe,
    })
}

fn read_moe<'a>(cx: &mut Errors, f: &mut Fields<'a>) -> MoeSpec {
    let non_negative = |cx: &mut Errors, v: &Value| {
        let x = number(cx, v)?;
        if x >= 0.0 {
            Some(x)
        } else {
            cx.push(
                v.loc,
                format!("`renorm_eps` must not be negative, found {x}"),
            );
            None
        }
    };
    let positive = |cx: &mut Errors, v: &Value| {
        let x = number(cx, v)?;
        if x > 0.0 {
            Some(x)
        } else {
            cx.push(v.loc, format!("`scaling` must be positive, found {x}"));
            None
        }
    };
    let shared = match f.entry("shared") {
        None => Some(S {
            v: None,
            loc: f.loc,
        }),
        Some(e) => table(cx, &e.value).map(|t| {
            let mut g = Fields::new(cx, t, e.key_loc, "the shared expert".into());
            let spec = SharedSpec {
                intermediate: g.req(cx, "intermediate", size),
                gated: g.opt(cx, "gated", false, boolean),
            };
            g.finish(cx);
            S {
                v: Some(spec),
                loc: e.key_loc,
            }
        }),
    };
    MoeSpec {
        experts: f.req(cx, "experts", size),
        top_k: f.req(cx, "top_k", size),
        act: f.opt(cx, "act", ExpertAct::Swiglu, |cx, v| {
            choice(cx, v, "expert activation", EXPERT_ACTS, no_alias)
        }),
        router: f.opt(cx, "router", RouterScore::Softmax, |cx, v| {
            choice(cx, v, "router score", ROUTER_SCORES, no_alias)
        }),
        expert_bias: f.opt(cx, "expert_bias", false, boolean),
        renormalize: f.opt(cx, "renormalize", true, boolean),
        renorm_eps: f.opt(cx, "renorm_eps", 0.0, non_negative),
        scaling: f.opt(cx, "scaling", 1.0, positive),
        groups: f.opt(cx, "groups", 1, size),
        top_groups: f.opt(cx, "top_groups", None, |cx, v| size(cx, v).map(Some)),
        shared,
    }
}

fn read_stack(cx: &mut Errors, t: &Table, loc: Loc) -> StackSpec {
    let mut f = Fields::new(cx, t, loc, "`stack`".into());
    let pattern = f.req(cx, "pattern", |cx, v| match &v.kind {
        ValueKind::Array(items) if items.is_empty() => {
            cx.push(v.loc, "the stack pattern is empty");
            None
        }
        // Malformed entries are reported and left out; the others are still checked.
        ValueKind::Array(items) => Some(
            items
                .iter()
                .filter_map(|i| string(cx, i).map(|s| S { v: s, loc: i.loc }))
                .collect(),
        ),
        _ => {
            mismatch(cx, v, "an array of kind names");
            None
        }
    });
    let repeat = f.opt(cx, "repeat", 1, size);
    f.finish(cx);
    StackSpec {
        loc,
        pattern,
        repeat,
    }
}

fn read_mtp(cx: &mut Errors, t: &Table, loc: Loc) -> MtpSpec {
    let mut f = Fields::new(cx, t, loc, "`mtp`".into());
    let layers = f.req(cx, "layers", size);
    let kind = f.req(cx, "kind", string);
    f.finish(cx);
    MtpSpec { loc, layers, kind }
}
