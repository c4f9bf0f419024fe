//! # flashrt-compiler: model descriptions -> checked `ModelIr`
//!
//! This crate is the front half of flashrt's compiler. The proc macro
//! (`#[flashrt::model]`, `flashrt::include_model!`), build scripts and the `flashrt` CLI all
//! call the same three functions:
//!
//! * [`model_from_toml`]`(src, path) -> Result<ModelIr, Diagnostics>`
//! * [`model_from_tokens`]`(tokens, default_name) -> Result<ModelIr, syn::Error>`
//! * [`ir_to_toml`]`(&ModelIr) -> String` (canonical TOML; round-trips through
//!   [`model_from_toml`])
//!
//! ## Design
//!
//! ```text
//! TOML text ──toml_front──┐                              ┌─> Diagnostics (path:line:col)
//!                         ├─> value::Value ─spec─> spec AST ─check─> ModelIr
//! attribute tokens ─rust_front┘   (+ span table)         └─> syn::Error (combined)
//! ```
//!
//! * The two surface syntaxes are front-ends over **one generic value tree**
//!   ([`value::Value`]: TOML's data model). Each value and key carries an opaque
//!   [`value::Loc`], an index into a span table the front-end keeps (byte ranges for TOML,
//!   `proc_macro2::Span`s for tokens); the tree holds no parser or proc-macro types.
//! * [`spec`] reads the tree into a typed spec AST (keys, types, defaults, enumeration
//!   names) and [`check`] validates it semantically and builds the IR. Both stages are
//!   shared by the two syntaxes, so a model written either way yields an identical
//!   `ModelIr` (and `ir_hash()`), and an error is found by the same code and placed by the
//!   front-end at the user's token.
//! * Every error is reported, not the first: each field is read independently; a field that
//!   fails becomes "absent" and the checks that depend on it are skipped, so one mistake
//!   costs one error. Syntax errors are reported alone (a recovered tree would only produce
//!   follow-on errors).
//! * Nothing here panics on user input; the tests feed truncated and mutated model files to
//!   both front-ends to hold that.
//!
//! ## The spec language (reference)
//!
//! A model is four sections. Types: *size* = integer in `1..=2^31-1`; *number* = integer or
//! float, finite; *name* = string (in the attribute form a bare identifier also works).
//!
//! **`[model]`**
//!
//! | key | type | default | meaning |
//! |---|---|---|---|
//! | `name` | string | required in TOML; the macro passes a default | snake_case model name (`[a-z][a-z0-9_]*`); the generated type is its CamelCase |
//! | `vocab` | size | required | vocabulary size |
//! | `hidden` | size | required | residual width |
//! | `dtype` | `"f32"` \| `"bf16"` \| `"f16"` | required | weight/activation dtype on accelerators (`float32`, `bfloat16`, `fp16`, ... also accepted) |
//! | `max_seq` | size | required | longest sequence (KV capacity) |
//! | `prefill_buckets` | array of sizes | required | prefill chunk sizes, strictly ascending, each `<= max_seq` (may be empty) |
//! | `decode_batches` | array of sizes | `[2, 4, 8]` | batch sizes of the batched decode step (several sessions' decode steps as one; a step of n sessions runs the smallest size `>= n`): strictly ascending, each in `2..=8` and at most the largest prefill bucket |
//! | `norm` | table | required | `{ kind = "rms" (default), eps = number > 0 (required), weight = "plain" (default) \| "one_plus" }`; `one_plus` stores `w` for a scale of `1 + w` |
//! | `tie_embeddings` | bool | `false` | the LM head reuses the embedding table |
//! | `weights` | `"qwen3_5_text"` \| `"lfm2"` \| `"nemotron_h"` | required | checkpoint naming convention (the HF `model_type`) |
//! | `quantize` | table | absent | block-quantized weights: `{ format = "fp8_e4m3" (required), block = [rows, cols] of sizes ([128, 128]), exclude = array of weight names }`. Every linear projection's matrix, the MTP `fc`, the LM head and the routed experts are quantized except those `exclude` names (a layout name such as `layers.3.attn.q_proj`, or a suffix such as `gdn.in_proj_a` for every layer; default `["lm_head", "gdn.in_proj_a", "gdn.in_proj_b", "moe.shared.token_gate"]`, what Qwen's FP8 releases keep in bf16). Each block of a weight has one f32 scale (`W = q * scale`); see `flashrt_ir::QuantIr` |
//!
//! **`[kinds.<name>]`**: one table per layer kind; `<name>` is an identifier. A kind has a
//! `mixer`, an `mlp`, or both (a decoder layer is `x += mixer(norm(x)); x += mlp(norm(x))`).
//!
//! Mixers (`mixer = { kind = "...", ... }`):
//!
//! | kind | keys (default) |
//! |---|---|
//! | `attention` | `q_heads`, `kv_heads`, `head_dim`: size; `qk_norm`: bool (`false`); `rope`: `{ theta = number > 0, fraction = number in (0, 1] (1.0) }` or `"none"` (required); `output_gate`: bool (`false`). `q_heads % kv_heads == 0`; rotary dims `head_dim * fraction` must be a positive even integer |
//! | `gated_deltanet` | `key_heads`, `value_heads`, `key_dim`, `value_dim`, `conv`: size; `norm_order`: `"norm_then_gate"` (default) \| `"gate_then_norm"`. `value_heads % key_heads == 0`, `conv >= 2` |
//! | `short_conv` | `conv`: size `>= 2`; `bias`: bool (`false`) |
//! | `mamba2` | `heads`, `head_dim`, `groups`, `state`, `conv`: size; `chunk`: size (`128`); `conv_bias`: bool (`true`); `dt_min`: number `>= 0` (absent: no clamp); `norm_order` (`"gate_then_norm"`). `heads % groups == 0`, `heads * head_dim % groups == 0`, `conv >= 2` |
//!
//! MLPs (`mlp = { kind = "...", intermediate = size }`): `swiglu` (`down(silu(gate x) * up x)`),
//! `relu2` (`down(relu(up x)^2)`), or `moe`, a sparse mixture of experts whose `intermediate`
//! is one routed expert's width, with these further keys (defaults in brackets):
//!
//! | key | value |
//! |---|---|
//! | `experts`, `top_k` | size (required); `top_k <= experts` |
//! | `act` | `"swiglu"` (default) \| `"relu2"`: every expert's feed-forward |
//! | `router` | `"softmax"` (default, over all experts) \| `"sigmoid"`: router logits to scores |
//! | `expert_bias` | bool (`false`): a per-expert bias added to the scores for the choice only |
//! | `renormalize` | bool (`true`): chosen weights divided by their sum + `renorm_eps` (number `>= 0`, `0`) |
//! | `scaling` | number `> 0` (`1`): routed weights multiplied by it |
//! | `groups`, `top_groups` | size (`1`, all groups): group-limited choice; `groups` divides `experts` in groups of at least 2, groups score by their two best experts |
//! | `shared` | `{ intermediate = size, gated = bool (false) }` (absent: none): an always-active expert; `gated` scales it by a per-token `sigmoid(x · g)` |
//!
//! Routing (`flashrt_ir::RouteIr`): scores of all experts, the `top_k` best by score (+ bias),
//! weights from the unbiased scores, renormalised, scaled.
//!
//! **`[stack]`**: `pattern` = non-empty array of kind names; `repeat` = size (`1`). The
//! decoder is the pattern repeated `repeat` times (at most 4096 layers); each layer's IR
//! `kind` is its kind name.
//!
//! **`[mtp]`** (optional): `layers` = size, `kind` = kind name. The multi-token-prediction
//! head is `layers` copies of that kind.
//!
//! Unknown keys, duplicate keys, unknown kind references, wrong types, zero sizes and
//! inconsistent shapes are all errors. Unused kinds are allowed.
//!
//! ### TOML form
//!
//! ```toml
//! [model]
//! name = "tiny"
//! vocab = 512
//! hidden = 64
//! dtype = "f32"
//! max_seq = 4096
//! prefill_buckets = [16, 64]
//! norm = { kind = "rms", eps = 1e-6, weight = "one_plus" }
//! weights = "qwen3_5_text"
//!
//! [kinds.gdn]
//! mixer = { kind = "gated_deltanet", key_heads = 2, value_heads = 4, key_dim = 16, value_dim = 16, conv = 4 }
//! mlp = { kind = "swiglu", intermediate = 128 }
//!
//! [kinds.attn]
//! mixer = { kind = "attention", q_heads = 4, kv_heads = 2, head_dim = 32, qk_norm = true,
//!           rope = { theta = 1e4, fraction = 0.25 }, output_gate = true }
//! mlp = { kind = "swiglu", intermediate = 128 }
//!
//! [stack]
//! pattern = ["gdn", "gdn", "gdn", "attn"]
//! repeat = 2
//! ```
//!
//! ### Attribute form
//!
//! The same tree as `key = value` pairs: tables `{ k = v, ... }`, arrays `[...]`, strings,
//! integers and floats (Rust literals, `-` for negatives), `true`/`false`, and bare
//! identifiers wherever a string is expected:
//!
//! ```text
//! #[flashrt::model(
//!     model = { vocab = 512, hidden = 64, dtype = f32, max_seq = 4096,
//!               prefill_buckets = [16, 64], norm = { eps = 1e-6, weight = one_plus },
//!               weights = qwen3_5_text },
//!     kinds = {
//!         gdn = { mixer = { kind = gated_deltanet, key_heads = 2, value_heads = 4,
//!                           key_dim = 16, value_dim = 16, conv = 4 },
//!                 mlp = { kind = swiglu, intermediate = 128 } },
//!         attn = { mixer = { kind = attention, q_heads = 4, kv_heads = 2, head_dim = 32,
//!                            qk_norm = true, rope = { theta = 1e4, fraction = 0.25 },
//!                            output_gate = true },
//!                  mlp = { kind = swiglu, intermediate = 128 } },
//!     },
//!     stack = { pattern = [gdn, gdn, gdn, attn], repeat = 2 },
//! )]
//! struct Tiny;
//! ```
//!
//! Here `model.name` may be omitted: the caller supplies a default (the macro passes the
//! snake_case of the item's name).

pub mod canonical;
pub mod check;
pub mod emit;
pub mod rust_front;
pub mod spec;
pub mod toml_front;
pub mod value;

pub use canonical::ir_to_toml;
pub use flashrt_ir as ir;
pub use toml_front::{Diagnostic, Diagnostics};

use flashrt_ir::ModelIr;
use value::Errors;

/// Parses and checks a TOML model description. `path` only labels diagnostics.
pub fn model_from_toml(src: &str, path: &str) -> Result<ModelIr, Diagnostics> {
    let parsed = toml_front::parse(src).map_err(|errors| Diagnostics::new(src, path, errors))?;
    let mut cx = Errors::default();
    let spec = spec::read(&mut cx, &parsed.root, None);
    let ir = check::check(&mut cx, &spec);
    match ir {
        Some(ir) if cx.is_empty() => Ok(ir),
        _ => {
            let errors = cx
                .into_vec()
                .into_iter()
                .map(|(loc, msg)| (parsed.spans[loc.index()].clone(), msg))
                .collect();
            Err(Diagnostics::new(src, path, errors))
        }
    }
}

/// Parses and checks the tokens of `#[flashrt::model(...)]`. Every error is returned,
/// combined into one `syn::Error`, each at its token. `default_name` stands in for a missing
/// `model.name`.
pub fn model_from_tokens(
    tokens: proc_macro2::TokenStream,
    default_name: Option<&str>,
) -> Result<ModelIr, syn::Error> {
    let parsed = rust_front::parse(tokens);
    if let Some(e) = combine(parsed.errors) {
        return Err(e);
    }
    let mut cx = Errors::default();
    let spec = spec::read(&mut cx, &parsed.root, default_name);
    let ir = check::check(&mut cx, &spec);
    match ir {
        Some(ir) if cx.is_empty() => Ok(ir),
        _ => {
            let mut errors = cx.into_vec();
            // Locs are allocated in token order, so this is source order.
            errors.sort_by_key(|(loc, _)| *loc);
            errors.dedup();
            let errors = errors
                .into_iter()
                .map(|(loc, msg)| (parsed.spans[loc.index()], msg))
                .collect();
            Err(combine(errors).unwrap_or_else(|| {
                syn::Error::new(proc_macro2::Span::call_site(), "invalid model")
            }))
        }
    }
}

fn combine(errors: Vec<(proc_macro2::Span, String)>) -> Option<syn::Error> {
    let mut iter = errors
        .into_iter()
        .map(|(span, msg)| syn::Error::new(span, msg));
    let mut first = iter.next()?;
    for e in iter {
        first.combine(e);
    }
    Some(first)
}
