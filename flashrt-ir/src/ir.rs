//! The model IR: what a model *is*, independent of how it was written down.
//!
//! Every front-end (TOML, `#[flashrt::model]`, Hugging Face `config.json`) produces a
//! [`ModelIr`]; two descriptions of the same model yield equal IR (and equal hashes). The
//! layer stack is fully expanded: `layers[i]` is decoder layer `i` of the checkpoint.

use serde::{Deserialize, Serialize};
use std::hash::{Hash, Hasher};

/// An `f64` that is `Eq + Hash` by its bit pattern (the IR never holds NaN).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct F64(pub f64);

impl Eq for F64 {}
impl Hash for F64 {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // +0.0 and -0.0 compare equal; hash them alike.
        let v = if self.0 == 0.0 { 0.0f64 } else { self.0 };
        v.to_bits().hash(state);
    }
}

impl F64 {
    pub fn get(self) -> f64 {
        self.0
    }
}

/// Element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    Bf16,
    F16,
    I32,
    /// OCP FP8 E4M3 (`float8_e4m3fn`): a block-quantized weight's elements; the value is the
    /// element times its block's scale ([`QuantIr`]). Only weights hold it.
    #[serde(rename = "f8_e4m3")]
    F8E4m3,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::F8E4m3 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::F8E4m3 => "f8_e4m3",
        }
    }
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" | "float32" | "fp32" => DType::F32,
            "bf16" | "bfloat16" => DType::Bf16,
            "f16" | "float16" | "fp16" => DType::F16,
            _ => return None,
        })
    }
}

/// The element format of quantized weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QuantFormat {
    /// FP8 E4M3 elements with one f32 scale per block (the fine-grained FP8 format of Qwen's
    /// and DeepSeek's FP8 checkpoints: `W[i, j] = q[i, j] * scale_inv[i / bo, j / bi]`).
    Fp8E4m3,
}

impl QuantFormat {
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Fp8E4m3 => "fp8_e4m3",
        }
    }
    pub fn parse(s: &str) -> Option<QuantFormat> {
        match s {
            "fp8_e4m3" | "fp8" | "f8_e4m3" | "e4m3" => Some(QuantFormat::Fp8E4m3),
            _ => None,
        }
    }
}

/// Block-scaled weight quantization of a model's matrices.
///
/// Every weight matrix of a linear projection, of the MTP head's `fc`, of the LM head and of
/// the routed experts is quantized unless `exclude` names it; embeddings, norms, convolution
/// taps, recurrence parameters and MoE routers never are. A matrix `[out, in]` is cut into
/// blocks of `block = [rows, cols]` (edge blocks hold what is left) and each block has one
/// scale: `W[i, j] = q[i, j] * s[i / rows, j / cols]`. A stacked weight (the routed experts,
/// gate and up rows per expert) restarts the block grid at every piece, as the checkpoints
/// that store one tensor per expert and projection do.
///
/// `exclude` holds layout weight names (`layers.3.gdn.in_proj_a`, `lm_head`) or their
/// suffixes after a `.` (`gdn.in_proj_a` excludes that projection in every layer).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QuantIr {
    pub format: QuantFormat,
    pub block: [usize; 2],
    pub exclude: Vec<String>,
}

impl QuantIr {
    /// What a model description gets when it names only the format: the matrices Qwen's FP8
    /// releases keep in bf16 stay so (the LM head, the Gated DeltaNet `a` / `b` projections,
    /// the shared expert's token gate).
    pub fn with_defaults(format: QuantFormat, block: [usize; 2]) -> QuantIr {
        QuantIr {
            format,
            block,
            exclude: DEFAULT_QUANT_EXCLUDE
                .iter()
                .map(|s| s.to_string())
                .collect(),
        }
    }

    /// Whether the weight buffer `name` (a layout name) is left unquantized.
    pub fn excludes(&self, name: &str) -> bool {
        self.exclude.iter().any(|e| {
            name == e
                || name
                    .strip_suffix(e.as_str())
                    .is_some_and(|rest| rest.ends_with('.'))
        })
    }
}

/// [`QuantIr::with_defaults`]' exclusions.
pub const DEFAULT_QUANT_EXCLUDE: [&str; 4] = [
    "lm_head",
    "gdn.in_proj_a",
    "gdn.in_proj_b",
    "moe.shared.token_gate",
];

/// Whether a stored RMSNorm weight is the scale itself (`w`) or an offset from one (`1 + w`,
/// "zero-centred", Qwen3.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormWeight {
    Plain,
    OnePlus,
}

/// RMSNorm convention used by every norm of the model that is not explicitly different.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NormIr {
    pub eps: F64,
    pub weight: NormWeight,
}

/// Order of normalisation and SiLU gating in a gated RMSNorm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateOrder {
    /// `w * rmsnorm(x) * silu(z)` (Gated DeltaNet's output norm).
    NormThenGate,
    /// `w * rmsnorm(x * silu(z))` (Mamba2's grouped output norm).
    GateThenNorm,
}

/// Which checkpoint naming convention weights follow (the Hugging Face `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightNaming {
    /// `qwen3_5_text`: `model.layers.N.{linear_attn,self_attn,mlp}.*`.
    Qwen35,
    /// `lfm2`: `model.layers.N.{conv,self_attn,feed_forward}.*`, final norm `model.embedding_norm`.
    Lfm2,
    /// `nemotron_h`: `backbone.layers.N.mixer.*`, final norm `backbone.norm_f`.
    NemotronH,
}

impl WeightNaming {
    pub fn hf_model_type(self) -> &'static str {
        match self {
            WeightNaming::Qwen35 => "qwen3_5_text",
            WeightNaming::Lfm2 => "lfm2",
            WeightNaming::NemotronH => "nemotron_h",
        }
    }
    pub fn from_hf_model_type(s: &str) -> Option<Self> {
        Some(match s {
            "qwen3_5_text" | "qwen3_5" | "qwen3_next" | "qwen3_5_moe_text" | "qwen3_5_moe" => {
                WeightNaming::Qwen35
            }
            "lfm2" | "lfm2_moe" => WeightNaming::Lfm2,
            "nemotron_h" => WeightNaming::NemotronH,
            _ => return None,
        })
    }
}

/// Rotary position embedding on the first `rotary_dims` dims of each head (rotate-half
/// convention; the remaining dims pass through).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RopeIr {
    pub theta: F64,
    pub rotary_dims: usize,
}

/// Full causal softmax attention with grouped KV heads.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AttentionIr {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Per-head RMSNorm of q and k (model norm convention) before RoPE.
    pub qk_norm: bool,
    /// `None`: no positional encoding (Nemotron-H).
    pub rope: Option<RopeIr>,
    /// Qwen3.5: `q_proj` emits `[query | gate]` per head; output is `o * sigmoid(gate)`.
    pub output_gate: bool,
}

/// Gated DeltaNet (Qwen3.5 `linear_attention`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GatedDeltaNetIr {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// Depthwise causal conv kernel width over the qkv channels.
    pub conv: usize,
    pub norm_order: GateOrder,
}

impl GatedDeltaNetIr {
    pub fn qkv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// LFM2 gated short convolution block: `out_proj(C * conv(B * x))`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShortConvIr {
    pub conv: usize,
    pub bias: bool,
}

/// Mamba2 selective state-space mixer (Nemotron-H).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mamba2Ir {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    pub conv: usize,
    /// Chunk length of the chunked scan (a kernel tiling choice; the math is the recurrence).
    pub chunk: usize,
    pub conv_bias: bool,
    /// Lower clamp of `dt` after softplus, applied on every path (`None`: no clamp).
    pub dt_min: Option<F64>,
    pub norm_order: GateOrder,
}

impl Mamba2Ir {
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn conv_channels(&self) -> usize {
        self.inner() + 2 * self.groups * self.state
    }
}

/// A token mixer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MixerIr {
    Attention(AttentionIr),
    GatedDeltanet(GatedDeltaNetIr),
    ShortConv(ShortConvIr),
    Mamba2(Mamba2Ir),
}

impl MixerIr {
    pub fn kind_name(&self) -> &'static str {
        match self {
            MixerIr::Attention(_) => "attention",
            MixerIr::GatedDeltanet(_) => "gated_deltanet",
            MixerIr::ShortConv(_) => "short_conv",
            MixerIr::Mamba2(_) => "mamba2",
        }
    }
}

/// Channel mixer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MlpIr {
    /// `down(silu(gate x) * up x)`.
    Swiglu { intermediate: usize },
    /// `down(relu(up x)^2)`.
    Relu2 { intermediate: usize },
    /// A sparse mixture of experts (see [`MoeIr`]).
    Moe(MoeIr),
}

impl MlpIr {
    /// Width of the dense MLP, or of one routed expert.
    pub fn intermediate(&self) -> usize {
        match self {
            MlpIr::Swiglu { intermediate } | MlpIr::Relu2 { intermediate } => *intermediate,
            MlpIr::Moe(m) => m.intermediate,
        }
    }
    pub fn kind_name(&self) -> &'static str {
        match self {
            MlpIr::Swiglu { .. } => "swiglu",
            MlpIr::Relu2 { .. } => "relu2",
            MlpIr::Moe(_) => "moe",
        }
    }
}

/// The feed-forward of one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertAct {
    /// `down(silu(gate x) * up x)`; stored fused as `gate_up` `[experts, 2 * width, hidden]`
    /// (rows `0..width` the gate, `width..2 * width` the up projection).
    Swiglu,
    /// `down(relu(up x)^2)` (Nemotron-H); `up` `[experts, width, hidden]`.
    Relu2,
}

impl ExpertAct {
    pub fn name(self) -> &'static str {
        match self {
            ExpertAct::Swiglu => "swiglu",
            ExpertAct::Relu2 => "relu2",
        }
    }
    /// Rows of the first projection per unit of width (gate + up for SwiGLU).
    pub fn up_rows(self) -> usize {
        match self {
            ExpertAct::Swiglu => 2,
            ExpertAct::Relu2 => 1,
        }
    }
}

/// How router logits become scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterScore {
    /// Softmax over all experts (Qwen3.5/3.6-MoE).
    Softmax,
    /// Element-wise sigmoid (LFM2-MoE, Nemotron-H, DeepSeek-V3).
    Sigmoid,
}

impl RouterScore {
    pub fn name(self) -> &'static str {
        match self {
            RouterScore::Softmax => "softmax",
            RouterScore::Sigmoid => "sigmoid",
        }
    }
}

/// The always-active shared expert of an MoE block (same activation as the routed experts).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SharedExpertIr {
    pub intermediate: usize,
    /// Qwen3.5-MoE: the shared output is scaled by `sigmoid(x · g)` per token.
    pub gated: bool,
}

/// The routing rule of an MoE block. Per token, with `x` the block's (normed) input:
///
/// 1. router logits `l = x Wᵀ` (`W`: `[experts, hidden]`, f32), scores `s = score(l)`;
/// 2. choice scores `c = s + bias` with `expert_bias` (a per-expert bias used for the choice
///    only), else `c = s`; with `groups > 1` the experts form `groups` equal consecutive
///    groups, each scored by the sum of its two largest `c`, and only the experts of the
///    `top_groups` best groups stay eligible;
/// 3. the `top_k` eligible experts of largest `c`, best first (ties: the lower index first);
/// 4. weights `w_j = s_j` of the chosen experts (unbiased), divided by `Σ w + renorm_eps` when
///    `renormalize`, then multiplied by `scaling`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RouteIr {
    pub experts: usize,
    pub top_k: usize,
    pub score: RouterScore,
    pub expert_bias: bool,
    pub renormalize: bool,
    pub renorm_eps: F64,
    pub scaling: F64,
    /// Group-limited routing (1: no groups).
    pub groups: usize,
    pub top_groups: usize,
}

/// Sparse mixture-of-experts MLP: `Σ_j w_j expert_{e_j}(x)` over the routed experts (see
/// [`RouteIr`]), plus the shared expert when there is one. Holds no state.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MoeIr {
    pub route: RouteIr,
    /// Width of one routed expert.
    pub intermediate: usize,
    pub act: ExpertAct,
    pub shared: Option<SharedExpertIr>,
}

/// One decoder layer: `x += mixer(norm(x))` then `x += mlp(norm(x))`; either part may be
/// absent (Nemotron-H blocks hold exactly one), never both.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerIr {
    /// The user's name for this layer kind (`[kinds.<name>]`).
    pub kind: String,
    pub mixer: Option<MixerIr>,
    pub mlp: Option<MlpIr>,
}

/// Multi-token-prediction head (Qwen3.5/3.6 style): `fc([norm(embed(t)) ; norm(h)])`, then
/// `layers` decoder layers, a final norm and the shared LM head.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MtpIr {
    pub layers: Vec<LayerIr>,
}

/// A whole model.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelIr {
    /// snake_case model name; the generated Rust type is its CamelCase form.
    pub name: String,
    pub vocab: usize,
    pub hidden: usize,
    /// Weight and activation dtype on accelerators (the CPU backend computes in f32).
    pub dtype: DType,
    pub max_seq: usize,
    /// Prefill chunk sizes, ascending; the decode step is the bucket 1.
    pub prefill_buckets: Vec<usize>,
    pub norm: NormIr,
    /// The LM head reuses the embedding table.
    pub tied_embeddings: bool,
    pub layers: Vec<LayerIr>,
    pub mtp: Option<MtpIr>,
    pub weights: WeightNaming,
    /// Block-quantized weights (`None`: every weight in `dtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<QuantIr>,
    /// Batch sizes of the batched decode step (`decode[b]`: b sessions' decode steps as one,
    /// each row at its own position in its own session's state), ascending, each 2..=8 and at
    /// most the largest prefill bucket; a step of n sessions runs the smallest b >= n.
    /// [`DEFAULT_DECODE_BATCHES`] unless the model says otherwise (and then left out of the
    /// canonical form, so the IR hash of a model without the key is what it was before it).
    #[serde(
        default = "default_decode_batches",
        skip_serializing_if = "is_default_decode_batches"
    )]
    pub decode_batches: Vec<usize>,
}

/// The batched decode ladder of a model that does not name one.
pub const DEFAULT_DECODE_BATCHES: [usize; 3] = [2, 4, 8];

/// The most rows a batched decode step takes (the small-phase kernels' bound).
pub const MAX_DECODE_BATCH: usize = 8;

fn default_decode_batches() -> Vec<usize> {
    DEFAULT_DECODE_BATCHES.to_vec()
}

fn is_default_decode_batches(v: &[usize]) -> bool {
    v == DEFAULT_DECODE_BATCHES
}

impl ModelIr {
    /// The batch sizes this model's batched decode steps run at: its ladder, up to the largest
    /// prefill bucket (the activation buffers' rows).
    pub fn batch_sizes(&self) -> Vec<usize> {
        let max_rows = self.prefill_buckets.iter().copied().max().unwrap_or(1);
        self.decode_batches
            .iter()
            .copied()
            .filter(|&b| (2..=MAX_DECODE_BATCH).contains(&b) && b <= max_rows)
            .collect()
    }

    /// A stable 64-bit hash of the IR (FNV-1a over its canonical JSON form).
    pub fn ir_hash(&self) -> u64 {
        fnv1a(
            serde_json::to_string(self)
                .expect("IR serialises")
                .as_bytes(),
        )
    }

    /// The generated Rust type name (`qwen36_27b` -> `Qwen3627b`).
    pub fn type_name(&self) -> String {
        camel_case(&self.name)
    }
}

/// FNV-1a, 64-bit: a stable, dependency-free content hash (identity, not security).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// `snake_case` -> `CamelCase`; digits are kept, separators dropped.
pub fn camel_case(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut up = true;
    for c in s.chars() {
        if c == '_' || c == '-' {
            up = true;
        } else if up {
            out.extend(c.to_uppercase());
            up = false;
        } else {
            out.push(c);
        }
    }
    out
}
