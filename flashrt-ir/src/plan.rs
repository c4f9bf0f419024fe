//! Execution plans: per phase and shape bucket, an ordered list of [`Op`]s over buffer ids.
//!
//! # Execution model
//!
//! A plan processes one *chunk* of `len` consecutive tokens, `1 <= len <= rows` (`rows` is
//! the plan's bucket). Two device-side scalars in the I/O arena drive it:
//!
//! * `io.pos` (i32): absolute position of the chunk's first token;
//! * `io.len` (i32): number of valid rows.
//!
//! Token ids are read from `io.tokens[0..len]`. Every activation [`View`] has `len` rows.
//! Because positions and lengths are read from these scalars at run time, one captured plan
//! replays at any position without recapture; nothing in a plan allocates or copies from the
//! host.
//!
//! # Semantics
//!
//! Ops run in order. Each op's contract is documented on its variant; backends must agree
//! with the CPU reference within dtype tolerance. All activations are row-major `[len, width]`
//! views into 2-D scratch/I/O buffers (`[rows, cols]`); state regions use the layouts in
//! [`crate::layout::StateKind`]. Ops that touch state (attention, conv, recurrences) read the
//! state left at position `pos` and leave the state at position `pos + len`.
//!
//! Every op computes each output row with the same arithmetic whatever `len` is and wherever
//! the chunk starts (recurrences step token by token in the CPU reference), which is what makes
//! "restore + append at any boundary == cold prefill" hold exactly on the CPU backend.

use crate::ir::{ExpertAct, F64, GateOrder, NormWeight, RouteIr};
use crate::layout::BufferId;
use serde::{Deserialize, Serialize};

/// A column window of a 2-D `[rows, stride]` buffer: columns `col .. col + width`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct View {
    pub buf: BufferId,
    pub col: usize,
    pub width: usize,
    /// Elements between consecutive rows (the buffer's column count).
    pub stride: usize,
}

/// Element-wise activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    Identity,
    Silu,
    Sigmoid,
    /// `relu(x)^2`.
    Relu2,
}

/// One step of a plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// `out[r] = table[io.tokens[r]]` (`table`: `[vocab, width]`).
    Embed { table: BufferId, out: View },
    /// RMS normalisation of each `group` consecutive columns independently:
    /// `out = x / sqrt(mean(x^2) + eps) * s`, where `s = w` (`Plain`) or `1 + w` (`OnePlus`),
    /// `w` of length `group` shared by all groups of the row; no weight means `s = 1`.
    /// Computed in f32. `out` may alias `x`.
    RmsNorm {
        x: View,
        weight: Option<BufferId>,
        weight_kind: NormWeight,
        out: View,
        eps: F64,
        group: usize,
    },
    /// `out = x · wᵀ (+ bias)`, `w`: `[out.width, x.width]` row-major. With `accumulate`,
    /// the product is added to `out` (fused residual add).
    Linear {
        x: View,
        w: BufferId,
        bias: Option<BufferId>,
        out: View,
        accumulate: bool,
    },
    /// `out = act(gate) * x` element-wise (SwiGLU, output gates, LFM2's B·x and C·y). A
    /// `gate` of width 1 is one gate per row, applied to every column (the shared expert's
    /// token gate). `out` may alias `x` or `gate`.
    Mul {
        gate: View,
        act: Act,
        x: View,
        out: View,
    },
    /// `out = act(x)` element-wise. `out` may alias `x`.
    Unary { x: View, act: Act, out: View },
    /// De-interleave per-head parts: `x` holds `heads` blocks of `sum(outs[i].width) / heads`
    /// columns; part `i` of head `h` (width `outs[i].width / heads`) goes to head `h` of
    /// `outs[i]`. (Qwen3.5's `q_proj` emits `[query | gate]` per head.)
    SplitHeads {
        x: View,
        heads: usize,
        outs: Vec<View>,
    },
    /// Rotary embedding in place on `heads` heads of `head_dim`: the first `rotary_dims` dims
    /// of each head rotate (rotate-half pairs `i` and `i + rotary_dims/2`) by angle
    /// `p * theta^(-2i / rotary_dims)` with `p = io.pos + r`; the rest pass through.
    Rope {
        x: View,
        heads: usize,
        head_dim: usize,
        rotary_dims: usize,
        theta: F64,
    },
    /// Causal GQA attention with a KV cache. First writes rows `k[r]`, `v[r]` to positions
    /// `io.pos + r` of `cache_k` / `cache_v` (`[max_seq, kv_heads, head_dim]`), then
    /// `out[r]` (per query head `h`, KV head `h / (q_heads / kv_heads)`) is the softmax
    /// (`scale`) weighted sum of values at positions `0 ..= io.pos + r`.
    Attention {
        q: View,
        k: View,
        v: View,
        cache_k: BufferId,
        cache_v: BufferId,
        out: View,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        scale: F64,
    },
    /// Depthwise causal conv over time, per channel `c`:
    /// `out[r][c] = act(bias[c] + Σ_j weight[c][j] * u[r - (K-1) + j][c])`, where `u` is the
    /// input sequence preceded by the `K - 1` inputs held in `state` (`[K-1, channels]`,
    /// oldest first); afterwards `state` holds the last `K - 1` inputs. `weight`: `[C, K]`.
    CausalConv1d {
        x: View,
        weight: BufferId,
        bias: Option<BufferId>,
        state: BufferId,
        out: View,
        act: Act,
        kernel: usize,
    },
    /// Gated DeltaNet recurrence. `qkv` (post conv + SiLU) is `[q | k | v]` with
    /// `key_heads × key_dim`, `key_heads × key_dim`, `value_heads × value_dim` columns.
    /// Per row: q, k L2-normalised per head (`x / sqrt(Σx² + 1e-6)`), q scaled by
    /// `key_dim^-0.5`; value head `h` uses key head `h / (value_heads / key_heads)`;
    /// `beta = sigmoid(b[h])`, `g = -exp(a_log[h]) * softplus(a[h] + dt_bias[h])`;
    /// with `S = state[h]` (`[key_dim, value_dim]`, f32):
    /// `S *= exp(g); d = (v - Sᵀk) * beta; S += k dᵀ; out[h] = Sᵀq`.
    GatedDeltaNet {
        qkv: View,
        a: View,
        b: View,
        a_log: BufferId,
        dt_bias: BufferId,
        state: BufferId,
        out: View,
        key_heads: usize,
        value_heads: usize,
        key_dim: usize,
        value_dim: usize,
    },
    /// Gated RMSNorm over each `group` consecutive columns:
    /// `NormThenGate`: `out = w * rmsnorm(x) * silu(z)`;
    /// `GateThenNorm`: `out = w * rmsnorm(x * silu(z))`.
    /// `w` has `group` elements shared by all groups (`shared_weight`) or `x.width` elements.
    GatedRmsNorm {
        x: View,
        gate: View,
        weight: BufferId,
        shared_weight: bool,
        out: View,
        eps: F64,
        group: usize,
        order: GateOrder,
    },
    /// `state[0 .. x.width] = x[len - 1]`: keep the last row of a chunk as state (the MTP
    /// head's input hidden state). `state` has exactly `x.width` elements.
    StoreLastRow { x: View, state: BufferId },
    /// `out[r] = state[0 .. out.width]` for every row `r` (read a state vector back into an
    /// activation).
    LoadState { state: BufferId, out: View },
    /// Mamba2 selective scan. `xbc` (post conv + SiLU) is `[x | B | C]` with
    /// `heads × head_dim`, `groups × state`, `groups × state` columns; `dt` has `heads`.
    /// Per row and head `h` (group `g = h / (heads / groups)`):
    /// `dt' = softplus(dt[h] + dt_bias[h])` (clamped below at `dt_min` if set),
    /// `A = -exp(a_log[h])`; with `S = state[h]` (`[head_dim, state]`, f32):
    /// `S = exp(dt' A) S + dt' x_h B_gᵀ; y_h = S C_g + d[h] * x_h`.
    Mamba2Scan {
        xbc: View,
        dt: View,
        a_log: BufferId,
        d: BufferId,
        dt_bias: BufferId,
        state: BufferId,
        out: View,
        heads: usize,
        head_dim: usize,
        groups: usize,
        state_size: usize,
        dt_min: Option<F64>,
    },
    /// Sparse mixture of experts, added to `out` (fused residual add). Per row: router
    /// logits `x · routerᵀ` in f32 (`router`: `[experts, x.width]`, f32), the experts and
    /// weights [`RouteIr`] defines (`bias`: `[experts]` f32, present iff
    /// `route.expert_bias`), then `out += Σ_j w_j · down_{e_j}(act(up_{e_j} x))` summed over
    /// the chosen experts best first, in f32. `up`: `[experts, act.up_rows() * inter,
    /// x.width]` (SwiGLU: each expert's gate rows, then its up rows); `down`: `[experts,
    /// out.width, inter]`. Each row reads only its chosen experts. `tmp` (at least
    /// `top_k * (inter + out.width + 4) + 2 * route.experts` columns) is per-row scratch a backend may use for the
    /// routing and the experts' activations; its contents are meaningless afterwards.
    Moe {
        x: View,
        router: BufferId,
        bias: Option<BufferId>,
        up: BufferId,
        down: BufferId,
        out: View,
        tmp: View,
        route: RouteIr,
        inter: usize,
        act: ExpertAct,
    },
}

impl Op {
    /// Visit every activation view of the op, mutably, in field order.
    pub fn views_mut(&mut self, mut f: impl FnMut(&mut View)) {
        match self {
            Op::Embed { out, .. } => f(out),
            Op::RmsNorm { x, out, .. } | Op::Linear { x, out, .. } | Op::Unary { x, out, .. } => {
                f(x);
                f(out);
            }
            Op::Mul { gate, x, out, .. } => {
                f(gate);
                f(x);
                f(out);
            }
            Op::SplitHeads { x, outs, .. } => {
                f(x);
                outs.iter_mut().for_each(f);
            }
            Op::Rope { x, .. } => f(x),
            Op::Attention { q, k, v, out, .. } => {
                for view in [q, k, v, out] {
                    f(view);
                }
            }
            Op::CausalConv1d { x, out, .. } => {
                f(x);
                f(out);
            }
            Op::GatedDeltaNet { qkv, a, b, out, .. } => {
                for view in [qkv, a, b, out] {
                    f(view);
                }
            }
            Op::GatedRmsNorm { x, gate, out, .. } => {
                for view in [x, gate, out] {
                    f(view);
                }
            }
            Op::Mamba2Scan { xbc, dt, out, .. } => {
                for view in [xbc, dt, out] {
                    f(view);
                }
            }
            Op::StoreLastRow { x, .. } => f(x),
            Op::LoadState { out, .. } => f(out),
            Op::Moe { x, out, tmp, .. } => {
                f(x);
                f(out);
                f(tmp);
            }
        }
    }

    /// Every activation view of the op, in field order.
    pub fn views(&self) -> Vec<View> {
        let mut op = self.clone();
        let mut out = Vec::new();
        op.views_mut(|v| out.push(*v));
        out
    }

    /// Every buffer the op reads or writes, in field order (views as their buffer).
    pub fn buffers(&self) -> Vec<BufferId> {
        let mut v = Vec::new();
        let mut o = |b: Option<BufferId>| v.extend(b);
        match self {
            Op::Embed { table, out } => {
                o(Some(*table));
                o(Some(out.buf));
            }
            Op::RmsNorm { x, weight, out, .. } => {
                o(Some(x.buf));
                o(*weight);
                o(Some(out.buf));
            }
            Op::Linear {
                x, w, bias, out, ..
            } => {
                o(Some(x.buf));
                o(Some(*w));
                o(*bias);
                o(Some(out.buf));
            }
            Op::Mul { gate, x, out, .. } => {
                o(Some(gate.buf));
                o(Some(x.buf));
                o(Some(out.buf));
            }
            Op::Unary { x, out, .. } => {
                o(Some(x.buf));
                o(Some(out.buf));
            }
            Op::SplitHeads { x, outs, .. } => {
                o(Some(x.buf));
                for out in outs {
                    o(Some(out.buf));
                }
            }
            Op::Rope { x, .. } => o(Some(x.buf)),
            Op::Attention {
                q,
                k,
                v: vv,
                cache_k,
                cache_v,
                out,
                ..
            } => {
                for b in [q.buf, k.buf, vv.buf, *cache_k, *cache_v, out.buf] {
                    o(Some(b));
                }
            }
            Op::CausalConv1d {
                x,
                weight,
                bias,
                state,
                out,
                ..
            } => {
                o(Some(x.buf));
                o(Some(*weight));
                o(*bias);
                o(Some(*state));
                o(Some(out.buf));
            }
            Op::GatedDeltaNet {
                qkv,
                a,
                b,
                a_log,
                dt_bias,
                state,
                out,
                ..
            } => {
                for id in [qkv.buf, a.buf, b.buf, *a_log, *dt_bias, *state, out.buf] {
                    o(Some(id));
                }
            }
            Op::GatedRmsNorm {
                x,
                gate,
                weight,
                out,
                ..
            } => {
                for id in [x.buf, gate.buf, *weight, out.buf] {
                    o(Some(id));
                }
            }
            Op::Mamba2Scan {
                xbc,
                dt,
                a_log,
                d,
                dt_bias,
                state,
                out,
                ..
            } => {
                for id in [xbc.buf, dt.buf, *a_log, *d, *dt_bias, *state, out.buf] {
                    o(Some(id));
                }
            }
            Op::StoreLastRow { x, state } => {
                o(Some(x.buf));
                o(Some(*state));
            }
            Op::LoadState { state, out } => {
                o(Some(*state));
                o(Some(out.buf));
            }
            Op::Moe {
                x,
                router,
                bias,
                up,
                down,
                out,
                tmp,
                ..
            } => {
                o(Some(x.buf));
                o(Some(*router));
                o(*bias);
                o(Some(*up));
                o(Some(*down));
                o(Some(out.buf));
                o(Some(tmp.buf));
            }
        }
        v
    }

    /// Short name used in plan summaries.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Embed { .. } => "embed",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Linear { .. } => "linear",
            Op::Mul { .. } => "mul",
            Op::Unary { .. } => "unary",
            Op::SplitHeads { .. } => "split_heads",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::CausalConv1d { .. } => "causal_conv1d",
            Op::GatedDeltaNet { .. } => "gated_deltanet",
            Op::GatedRmsNorm { .. } => "gated_rms_norm",
            Op::Mamba2Scan { .. } => "mamba2_scan",
            Op::StoreLastRow { .. } => "store_last_row",
            Op::LoadState { .. } => "load_state",
            Op::Moe { .. } => "moe",
        }
    }
}

/// Which phase a plan serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// A prefill chunk of up to `bucket` tokens.
    Prefill { bucket: usize },
    /// One token.
    Decode,
    /// `k + 1` rows computed as decode steps compute them: target-model verification of `k`
    /// drafted tokens (the last committed token plus the drafts), and short suffixes of any
    /// model (see `flashrt_runtime`'s chunk planner). Logits for every row.
    Verify { k: usize },
    /// One step of the MTP drafter: one row whose token is the newest token, whose hidden
    /// input is the `mtp.hidden` state region; emits draft logits and replaces `mtp.hidden`
    /// with its own output hidden (for the next draft step). Models with an MTP head only.
    MtpDraft,
}

impl Phase {
    pub fn rows(self) -> usize {
        match self {
            Phase::Prefill { bucket } => bucket,
            Phase::Decode | Phase::MtpDraft => 1,
            Phase::Verify { k } => k + 1,
        }
    }
    pub fn label(self) -> String {
        match self {
            Phase::Prefill { bucket } => format!("prefill[{bucket}]"),
            Phase::Decode => "decode".to_string(),
            Phase::Verify { k } => format!("verify[{k}]"),
            Phase::MtpDraft => "mtp_draft".to_string(),
        }
    }
}

/// One phase's ordered ops.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Plan {
    pub phase: Phase,
    pub ops: Vec<Op>,
}

impl Plan {
    /// `(op name, count)` in order of first appearance.
    pub fn op_counts(&self) -> Vec<(&'static str, usize)> {
        let mut out: Vec<(&'static str, usize)> = Vec::new();
        for op in &self.ops {
            match out.iter_mut().find(|(n, _)| *n == op.name()) {
                Some((_, c)) => *c += 1,
                None => out.push((op.name(), 1)),
            }
        }
        out
    }
}
