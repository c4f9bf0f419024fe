//! Lowering: [`ModelIr`] -> [`Layout`] + [`Plan`]s.
//!
//! The lowering assumes checked IR (the compiler's `check` stage guarantees divisibility,
//! non-zero sizes and head-count consistency). It is deterministic: the same IR and target
//! always give byte-identical layouts and plans, hence the same fingerprint.

use crate::ir::*;
use crate::layout::*;
use crate::plan::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Ids of the I/O buffers every plan reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IoIds {
    /// `[max_rows]` i32 token ids of the chunk.
    pub tokens: BufferId,
    /// `[max_rows, vocab]` f32 logits of every row of the chunk.
    pub logits: BufferId,
    /// `[1]` i32 absolute position of the chunk's first token.
    pub pos: BufferId,
    /// `[1]` i32 number of valid rows.
    pub len: BufferId,
}

/// Everything a backend needs to run a model.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Compiled {
    pub ir: ModelIr,
    pub layout: Layout,
    pub io: IoIds,
    /// One plan per prefill bucket (ascending), then the decode plan.
    pub plans: Vec<Plan>,
}

impl Compiled {
    pub fn plan(&self, phase: Phase) -> Option<&Plan> {
        self.plans.iter().find(|p| p.phase == phase)
    }
    pub fn fingerprint(&self) -> &str {
        &self.layout.fingerprint
    }

    /// The same model with its fingerprint covering a digest of its weights, so capsules of
    /// different weights (another checkpoint, another random seed) can never be restored into
    /// each other. `compile` alone fingerprints IR + layout + kernel version + dtype; a loaded
    /// model's fingerprint is `fnv1a(that, digest)`. Buffers, offsets and plans are unchanged.
    pub fn with_weights_digest(mut self, digest: &str) -> Compiled {
        let mut bytes = self.layout.fingerprint.clone().into_bytes();
        bytes.push(b':');
        bytes.extend_from_slice(digest.as_bytes());
        self.layout.fingerprint = format!("{:016x}", fnv1a(&bytes));
        self
    }
}

/// Compile checked IR for a target.
pub fn compile(ir: &ModelIr, target: Target) -> Compiled {
    let max_rows = ir.prefill_buckets.iter().copied().max().unwrap_or(1).max(1);
    let mut cx = Lower {
        ir,
        target,
        max_rows,
        b: LayoutBuilder::default(),
        scratch_widths: BTreeMap::new(),
    };
    let io = cx.io();
    let (embed, head) = cx.embeddings();
    let ops = cx.lower_body(io, embed, head);
    let draft = ir
        .mtp
        .as_ref()
        .map(|mtp| cx.lower_mtp_draft(io, embed, head, mtp));
    // Scratch buffers are created last so their widths are the maxima over every use.
    let scratch_ids = cx.materialise_scratch();
    let ops = ops
        .into_iter()
        .map(|op| resolve(op, &scratch_ids))
        .collect::<Vec<_>>();
    let draft = draft.map(|d| {
        d.into_iter()
            .map(|op| resolve(op, &scratch_ids))
            .collect::<Vec<_>>()
    });
    let layout =
        cx.b.finish(&ir.name, target, max_rows, ir.max_seq, ir.ir_hash());
    let mut phases: Vec<Phase> = ir
        .prefill_buckets
        .iter()
        .map(|&bucket| Phase::Prefill { bucket })
        .collect();
    phases.push(Phase::Decode);
    // Verify plans serve speculative rounds (models with an MTP head) and short suffixes of
    // every model: 2 ..= MAX_DRAFT + 1 rows computed the way a decode step computes them.
    phases.extend(
        (1..=MAX_DRAFT)
            .filter(|&k| k < max_rows)
            .map(|k| Phase::Verify { k }),
    );
    let mut plans: Vec<Plan> = phases
        .into_iter()
        .map(|phase| Plan {
            phase,
            ops: ops.clone(),
        })
        .collect();
    if let Some(ops) = draft {
        plans.push(Plan {
            phase: Phase::MtpDraft,
            ops,
        });
    }
    Compiled {
        ir: ir.clone(),
        layout,
        io,
        plans,
    }
}

/// Verify plans are compiled for 1..=MAX_DRAFT drafted tokens (rows up to the largest bucket).
pub const MAX_DRAFT: usize = 4;

/// Scratch buffers are referred to by a placeholder id (`u32::MAX - slot`) until their widths
/// are known; `resolve` swaps in the real ids.
const SCRATCH_BASE: u32 = u32::MAX - 4096;

struct Lower<'a> {
    ir: &'a ModelIr,
    target: Target,
    max_rows: usize,
    b: LayoutBuilder,
    /// scratch name -> (slot, width)
    scratch_widths: BTreeMap<&'static str, (u32, usize)>,
}

impl<'a> Lower<'a> {
    fn io(&mut self) -> IoIds {
        let r = self.max_rows;
        let tokens = self.b.push(
            "io.tokens".into(),
            Role::Io,
            DType::I32,
            vec![r],
            None,
            None,
            None,
        );
        let logits = self.b.push(
            "io.logits".into(),
            Role::Io,
            DType::F32,
            vec![r, self.ir.vocab],
            None,
            None,
            None,
        );
        let pos = self.b.push(
            "io.pos".into(),
            Role::Io,
            DType::I32,
            vec![1],
            None,
            None,
            None,
        );
        let len = self.b.push(
            "io.len".into(),
            Role::Io,
            DType::I32,
            vec![1],
            None,
            None,
            None,
        );
        IoIds {
            tokens,
            logits,
            pos,
            len,
        }
    }

    /// A scratch view of `width` columns; the buffer's width is the max over all requests.
    fn scratch(&mut self, name: &'static str, width: usize) -> View {
        let next = self.scratch_widths.len() as u32;
        let entry = self.scratch_widths.entry(name).or_insert((next, 0));
        entry.1 = entry.1.max(width);
        View {
            buf: BufferId(SCRATCH_BASE + entry.0),
            col: 0,
            width,
            stride: usize::MAX,
        }
    }

    fn materialise_scratch(&mut self) -> BTreeMap<u32, (BufferId, usize)> {
        let mut out = BTreeMap::new();
        let mut entries: Vec<_> = self
            .scratch_widths
            .iter()
            .map(|(n, &(s, w))| (s, *n, w))
            .collect();
        entries.sort();
        for (slot, name, width) in entries {
            let dtype = self.act_dtype();
            let id = self.b.push(
                format!("scratch.{name}"),
                Role::Scratch,
                dtype,
                vec![self.max_rows, width],
                None,
                None,
                None,
            );
            out.insert(SCRATCH_BASE + slot, (id, width));
        }
        out
    }

    fn act_dtype(&self) -> DType {
        self.target.dtype
    }

    fn weight(
        &mut self,
        name: String,
        shape: Vec<usize>,
        layer: Option<usize>,
        source: String,
    ) -> BufferId {
        let dtype = self.target.dtype;
        self.b
            .push(name, Role::Weight, dtype, shape, layer, None, Some(source))
    }

    /// A matrix weight that the model's quantization may cover: `[rows.., cols]` loaded from
    /// `source` (or from `pieces` end to end, each `segment` rows), block-quantized unless the
    /// model has no [`QuantIr`] or its `exclude` names `name`. A quantized matrix is stored as
    /// FP8 on reduced-precision targets when `fp8` (the ops that read it have FP8 kernels),
    /// else in the target dtype, dequantized while it loads; its scale buffer follows it.
    fn matrix(
        &mut self,
        name: String,
        shape: Vec<usize>,
        layer: Option<usize>,
        source: String,
        pieces: Option<Pieces>,
        segment: usize,
        fp8: bool,
    ) -> BufferId {
        let quant = self
            .ir
            .quant
            .as_ref()
            .filter(|q| !q.excludes(&name))
            .cloned();
        let Some(q) = quant else {
            let id = self.weight(name, shape, layer, source);
            if let Some(p) = pieces {
                self.b.set_pieces(id, p);
            }
            return id;
        };
        let dtype = match (q.format, self.target.dtype) {
            (_, DType::F32) => DType::F32,
            (QuantFormat::Fp8E4m3, _) if fp8 => DType::F8E4m3,
            (_, d) => d,
        };
        let cols = *shape.last().expect("a matrix has columns");
        let rows = shape.iter().product::<usize>() / cols;
        let scale_name = format!("{name}.scale");
        let scale_src = format!("{source}_scale_inv");
        let w = self
            .b
            .push(name, Role::Weight, dtype, shape, layer, None, Some(source));
        let wq = WeightQuant {
            scale: BufferId(0),
            block: q.block,
            segment,
            cols,
        };
        let scale_rows = (rows / segment) * wq.block_rows();
        let scale = self.b.push(
            scale_name,
            Role::Weight,
            DType::F32,
            vec![scale_rows, wq.block_cols()],
            layer,
            None,
            Some(scale_src),
        );
        if let Some(p) = pieces {
            let scale_pieces = Pieces {
                names: p.names.iter().map(|n| format!("{n}_scale_inv")).collect(),
                shape: vec![p.shape[0].div_ceil(q.block[0]), wq.block_cols()],
            };
            self.b.set_pieces(w, p);
            self.b.set_pieces(scale, scale_pieces);
        }
        self.b.set_quant(w, WeightQuant { scale, ..wq });
        w
    }

    /// Small per-channel parameters (norm scales, A_log, dt_bias, D, biases) stay f32.
    fn param(
        &mut self,
        name: String,
        shape: Vec<usize>,
        layer: Option<usize>,
        source: String,
    ) -> BufferId {
        self.b.push(
            name,
            Role::Weight,
            DType::F32,
            shape,
            layer,
            None,
            Some(source),
        )
    }

    fn state(&mut self, layer: usize, kind: StateKind, shape: Vec<usize>) -> BufferId {
        let dtype = match kind {
            StateKind::Recurrent => DType::F32,
            _ => self.target.dtype,
        };
        self.b.push(
            format!("{}.{}", self.lname(layer), kind.name()),
            Role::State,
            dtype,
            shape,
            Some(layer),
            Some(kind),
            None,
        )
    }

    /// Buffer-name prefix of layer `i`: `layers.{i}` in the main stack, `mtp.{j}` for MTP layer
    /// `j` (layer index `layers.len() + j`).
    fn lname(&self, i: usize) -> String {
        let n = self.ir.layers.len();
        if i < n {
            format!("layers.{i}")
        } else {
            format!("mtp.{}", i - n)
        }
    }

    fn hf(&self, layer: usize, rest: &str) -> String {
        let n = self.ir.layers.len();
        if layer >= n {
            // Qwen3.5/3.6 checkpoints: `mtp.layers.{j}.*` (the only family with MTP heads).
            return format!("mtp.layers.{}.{rest}", layer - n);
        }
        match self.ir.weights {
            WeightNaming::Qwen35 | WeightNaming::Lfm2 => format!("model.layers.{layer}.{rest}"),
            WeightNaming::NemotronH => format!("backbone.layers.{layer}.{rest}"),
        }
    }

    /// The embedding table and the LM head (the same buffer when tied).
    fn embeddings(&mut self) -> (BufferId, BufferId) {
        let ir = self.ir;
        let embed_src = match ir.weights {
            WeightNaming::Qwen35 | WeightNaming::Lfm2 => "model.embed_tokens.weight",
            WeightNaming::NemotronH => "backbone.embeddings.weight",
        };
        let embed = self.weight(
            "embed".into(),
            vec![ir.vocab, ir.hidden],
            None,
            embed_src.into(),
        );
        let head = if ir.tied_embeddings {
            embed
        } else {
            self.matrix(
                "lm_head".into(),
                vec![ir.vocab, ir.hidden],
                None,
                "lm_head.weight".into(),
                None,
                ir.vocab,
                true,
            )
        };
        (embed, head)
    }

    fn lower_body(&mut self, io: IoIds, embed: BufferId, head: BufferId) -> Vec<Op> {
        let ir = self.ir;
        let h = ir.hidden;
        let mut ops = Vec::new();
        let final_src = match ir.weights {
            WeightNaming::Qwen35 => "model.norm.weight",
            WeightNaming::Lfm2 => "model.embedding_norm.weight",
            WeightNaming::NemotronH => "backbone.norm_f.weight",
        };
        let x = self.scratch("x", h);
        ops.push(Op::Embed {
            table: embed,
            out: x,
        });
        for (i, layer) in ir.layers.iter().enumerate() {
            self.lower_layer(i, layer, x, &mut ops);
        }
        let final_norm = self.param("final_norm".into(), vec![h], None, final_src.into());
        let hn = self.scratch("h", h);
        ops.push(Op::RmsNorm {
            x,
            weight: Some(final_norm),
            weight_kind: ir.norm.weight,
            out: hn,
            eps: ir.norm.eps,
            group: h,
        });
        if ir.mtp.is_some() {
            // The MTP head drafts from the target's final-normed hidden of the newest token.
            let hidden = self.mtp_hidden();
            ops.push(Op::StoreLastRow {
                x: hn,
                state: hidden,
            });
        }
        let logits = View {
            buf: io.logits,
            col: 0,
            width: ir.vocab,
            stride: ir.vocab,
        };
        ops.push(Op::Linear {
            x: hn,
            w: head,
            bias: None,
            out: logits,
            accumulate: false,
        });
        ops
    }

    /// The `mtp.hidden` state region (created on first use).
    fn mtp_hidden(&mut self) -> BufferId {
        if let Some(b) = self.b.buffers.iter().find(|b| b.name == "mtp.hidden") {
            return b.id;
        }
        let dtype = self.act_dtype();
        self.b.push(
            "mtp.hidden".into(),
            Role::State,
            dtype,
            vec![self.ir.hidden],
            None,
            Some(StateKind::Hidden),
            None,
        )
    }

    /// The MTP drafter (Qwen3.5/3.6): `x = fc([norm_e(embed(t)) ; norm_h(hidden)])`, the MTP
    /// decoder layers (own KV regions), `h = norm(x)`; `h` becomes the next `mtp.hidden` and
    /// the shared LM head gives the draft logits.
    fn lower_mtp_draft(
        &mut self,
        io: IoIds,
        embed: BufferId,
        head: BufferId,
        mtp: &MtpIr,
    ) -> Vec<Op> {
        let ir = self.ir;
        let h = ir.hidden;
        let mut ops = Vec::new();
        let hidden = self.mtp_hidden();
        let e = self.scratch("h", h);
        ops.push(Op::Embed {
            table: embed,
            out: e,
        });
        let cat = self.scratch("mtp_cat", 2 * h);
        let nw = |cx: &mut Self, name: &str| {
            cx.param(
                format!("mtp.{name}"),
                vec![h],
                None,
                format!("mtp.{name}.weight"),
            )
        };
        let w_e = nw(self, "pre_fc_norm_embedding");
        let w_h = nw(self, "pre_fc_norm_hidden");
        let eps = ir.norm.eps;
        let kind = ir.norm.weight;
        ops.push(Op::RmsNorm {
            x: e,
            weight: Some(w_e),
            weight_kind: kind,
            out: View { width: h, ..cat },
            eps,
            group: h,
        });
        let hin = self.scratch("mix", h);
        ops.push(Op::LoadState {
            state: hidden,
            out: hin,
        });
        ops.push(Op::RmsNorm {
            x: hin,
            weight: Some(w_h),
            weight_kind: kind,
            out: View {
                col: h,
                width: h,
                ..cat
            },
            eps,
            group: h,
        });
        let fc = self.matrix(
            "mtp.fc".into(),
            vec![h, 2 * h],
            None,
            "mtp.fc.weight".into(),
            None,
            h,
            true,
        );
        let x = self.scratch("x", h);
        ops.push(Op::Linear {
            x: cat,
            w: fc,
            bias: None,
            out: x,
            accumulate: false,
        });
        let base = ir.layers.len();
        for (j, layer) in mtp.layers.iter().enumerate() {
            self.lower_layer(base + j, layer, x, &mut ops);
        }
        let w_n = nw(self, "norm");
        let hn = self.scratch("h", h);
        ops.push(Op::RmsNorm {
            x,
            weight: Some(w_n),
            weight_kind: kind,
            out: hn,
            eps,
            group: h,
        });
        ops.push(Op::StoreLastRow {
            x: hn,
            state: hidden,
        });
        let logits = View {
            buf: io.logits,
            col: 0,
            width: ir.vocab,
            stride: ir.vocab,
        };
        ops.push(Op::Linear {
            x: hn,
            w: head,
            bias: None,
            out: logits,
            accumulate: false,
        });
        ops
    }

    fn norm_names(&self, layer: &LayerIr) -> (&'static str, &'static str) {
        let both = layer.mixer.is_some() && layer.mlp.is_some();
        match self.ir.weights {
            WeightNaming::Qwen35 => ("input_layernorm", "post_attention_layernorm"),
            WeightNaming::Lfm2 => ("operator_norm", "ffn_norm"),
            WeightNaming::NemotronH if both => ("norm", "norm2"),
            WeightNaming::NemotronH => ("norm", "norm"),
        }
    }

    fn pre_norm(&mut self, i: usize, which: &str, x: View, ops: &mut Vec<Op>) -> View {
        let h = self.ir.hidden;
        let src = self.hf(i, &format!("{which}.weight"));
        let w = self.param(format!("{}.{which}", self.lname(i)), vec![h], Some(i), src);
        let hn = self.scratch("h", h);
        ops.push(Op::RmsNorm {
            x,
            weight: Some(w),
            weight_kind: self.ir.norm.weight,
            out: hn,
            eps: self.ir.norm.eps,
            group: h,
        });
        hn
    }

    fn lower_layer(&mut self, i: usize, layer: &LayerIr, x: View, ops: &mut Vec<Op>) {
        let (n1, n2) = self.norm_names(layer);
        if let Some(mixer) = &layer.mixer {
            let hn = self.pre_norm(i, n1, x, ops);
            match mixer {
                MixerIr::Attention(a) => self.attention(i, a, hn, x, ops),
                MixerIr::GatedDeltanet(g) => self.gdn(i, g, hn, x, ops),
                MixerIr::ShortConv(c) => self.short_conv(i, c, hn, x, ops),
                MixerIr::Mamba2(m) => self.mamba2(i, m, hn, x, ops),
            }
        }
        if let Some(mlp) = &layer.mlp {
            let which = if layer.mixer.is_some() { n2 } else { n1 };
            let hn = self.pre_norm(i, which, x, ops);
            self.mlp(i, mlp, hn, x, ops);
        }
    }

    fn linear(
        &mut self,
        i: usize,
        name: &str,
        src: &str,
        xin: View,
        out: View,
        bias: bool,
        ops: &mut Vec<Op>,
        accumulate: bool,
    ) {
        let w = self.matrix(
            format!("{}.{name}", self.lname(i)),
            vec![out.width, xin.width],
            Some(i),
            self.hf(i, &format!("{src}.weight")),
            None,
            out.width,
            true,
        );
        let bias = bias.then(|| {
            let s = self.hf(i, &format!("{src}.bias"));
            self.param(
                format!("{}.{name}_bias", self.lname(i)),
                vec![out.width],
                Some(i),
                s,
            )
        });
        ops.push(Op::Linear {
            x: xin,
            w,
            bias,
            out,
            accumulate,
        });
    }

    fn attention(&mut self, i: usize, a: &AttentionIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let naming = self.ir.weights;
        let (p, o_name, qn, kn) = match naming {
            WeightNaming::Qwen35 => ("self_attn", "o_proj", "q_norm", "k_norm"),
            WeightNaming::Lfm2 => ("self_attn", "out_proj", "q_layernorm", "k_layernorm"),
            WeightNaming::NemotronH => ("mixer", "o_proj", "q_norm", "k_norm"),
        };
        let qw = a.q_heads * a.head_dim;
        let kvw = a.kv_heads * a.head_dim;
        let q = self.scratch("q", qw);
        let gate = a.output_gate.then(|| self.scratch("gate", qw));
        if let Some(gate) = gate {
            let qg = self.scratch("q_gate", 2 * qw);
            self.linear(
                i,
                "attn.q_proj",
                &format!("{p}.q_proj"),
                hn,
                qg,
                false,
                ops,
                false,
            );
            ops.push(Op::SplitHeads {
                x: qg,
                heads: a.q_heads,
                outs: vec![q, gate],
            });
        } else {
            self.linear(
                i,
                "attn.q_proj",
                &format!("{p}.q_proj"),
                hn,
                q,
                false,
                ops,
                false,
            );
        }
        let k = self.scratch("k", kvw);
        let v = self.scratch("v", kvw);
        self.linear(
            i,
            "attn.k_proj",
            &format!("{p}.k_proj"),
            hn,
            k,
            false,
            ops,
            false,
        );
        self.linear(
            i,
            "attn.v_proj",
            &format!("{p}.v_proj"),
            hn,
            v,
            false,
            ops,
            false,
        );
        if a.qk_norm {
            for (t, nm) in [(q, qn), (k, kn)] {
                let src = self.hf(i, &format!("{p}.{nm}.weight"));
                let w = self.param(
                    format!("{}.attn.{nm}", self.lname(i)),
                    vec![a.head_dim],
                    Some(i),
                    src,
                );
                ops.push(Op::RmsNorm {
                    x: t,
                    weight: Some(w),
                    weight_kind: self.ir.norm.weight,
                    out: t,
                    eps: self.ir.norm.eps,
                    group: a.head_dim,
                });
            }
        }
        if let Some(rope) = &a.rope {
            ops.push(Op::Rope {
                x: q,
                heads: a.q_heads,
                head_dim: a.head_dim,
                rotary_dims: rope.rotary_dims,
                theta: rope.theta,
            });
            ops.push(Op::Rope {
                x: k,
                heads: a.kv_heads,
                head_dim: a.head_dim,
                rotary_dims: rope.rotary_dims,
                theta: rope.theta,
            });
        }
        let shape = vec![self.ir.max_seq, a.kv_heads, a.head_dim];
        let cache_k = self.state(i, StateKind::Key, shape.clone());
        let cache_v = self.state(i, StateKind::Value, shape);
        let o = self.scratch("mix", qw);
        ops.push(Op::Attention {
            q,
            k,
            v,
            cache_k,
            cache_v,
            out: o,
            q_heads: a.q_heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            scale: F64((a.head_dim as f64).powf(-0.5)),
        });
        if let Some(gate) = gate {
            ops.push(Op::Mul {
                gate,
                act: Act::Sigmoid,
                x: o,
                out: o,
            });
        }
        self.linear(
            i,
            "attn.o_proj",
            &format!("{p}.{o_name}"),
            o,
            x,
            false,
            ops,
            true,
        );
    }

    fn gdn(&mut self, i: usize, g: &GatedDeltaNetIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let c = g.qkv_channels();
        let vw = g.value_heads * g.value_dim;
        let raw = self.scratch("proj", c);
        let z = self.scratch("z", vw);
        let bv = self.scratch("b", g.value_heads);
        let av = self.scratch("a", g.value_heads);
        self.linear(
            i,
            "gdn.in_proj_qkv",
            "linear_attn.in_proj_qkv",
            hn,
            raw,
            false,
            ops,
            false,
        );
        self.linear(
            i,
            "gdn.in_proj_z",
            "linear_attn.in_proj_z",
            hn,
            z,
            false,
            ops,
            false,
        );
        self.linear(
            i,
            "gdn.in_proj_b",
            "linear_attn.in_proj_b",
            hn,
            bv,
            false,
            ops,
            false,
        );
        self.linear(
            i,
            "gdn.in_proj_a",
            "linear_attn.in_proj_a",
            hn,
            av,
            false,
            ops,
            false,
        );
        let conv_w = self.param(
            format!("{}.gdn.conv1d", self.lname(i)),
            vec![c, g.conv],
            Some(i),
            self.hf(i, "linear_attn.conv1d.weight"),
        );
        let conv_state = self.state(i, StateKind::Conv, vec![g.conv - 1, c]);
        let qkv = self.scratch("conv", c);
        ops.push(Op::CausalConv1d {
            x: raw,
            weight: conv_w,
            bias: None,
            state: conv_state,
            out: qkv,
            act: Act::Silu,
            kernel: g.conv,
        });
        let a_log = self.param(
            format!("{}.gdn.A_log", self.lname(i)),
            vec![g.value_heads],
            Some(i),
            self.hf(i, "linear_attn.A_log"),
        );
        let dt_bias = self.param(
            format!("{}.gdn.dt_bias", self.lname(i)),
            vec![g.value_heads],
            Some(i),
            self.hf(i, "linear_attn.dt_bias"),
        );
        let state = self.state(
            i,
            StateKind::Recurrent,
            vec![g.value_heads, g.key_dim, g.value_dim],
        );
        let o = self.scratch("mix", vw);
        ops.push(Op::GatedDeltaNet {
            qkv,
            a: av,
            b: bv,
            a_log,
            dt_bias,
            state,
            out: o,
            key_heads: g.key_heads,
            value_heads: g.value_heads,
            key_dim: g.key_dim,
            value_dim: g.value_dim,
        });
        let nw = self.param(
            format!("{}.gdn.norm", self.lname(i)),
            vec![g.value_dim],
            Some(i),
            self.hf(i, "linear_attn.norm.weight"),
        );
        let gated = self.scratch("gated", vw);
        ops.push(Op::GatedRmsNorm {
            x: o,
            gate: z,
            weight: nw,
            shared_weight: true,
            out: gated,
            eps: self.ir.norm.eps,
            group: g.value_dim,
            order: g.norm_order,
        });
        self.linear(
            i,
            "gdn.out_proj",
            "linear_attn.out_proj",
            gated,
            x,
            false,
            ops,
            true,
        );
    }

    fn short_conv(&mut self, i: usize, c: &ShortConvIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let h = self.ir.hidden;
        let bcx = self.scratch("proj", 3 * h);
        self.linear(
            i,
            "conv.in_proj",
            "conv.in_proj",
            hn,
            bcx,
            c.bias,
            ops,
            false,
        );
        let bpart = View { width: h, ..bcx };
        let cpart = View {
            col: h,
            width: h,
            ..bcx
        };
        let xpart = View {
            col: 2 * h,
            width: h,
            ..bcx
        };
        let bx = self.scratch("z", h);
        ops.push(Op::Mul {
            gate: bpart,
            act: Act::Identity,
            x: xpart,
            out: bx,
        });
        let w = self.param(
            format!("{}.conv.conv", self.lname(i)),
            vec![h, c.conv],
            Some(i),
            self.hf(i, "conv.conv.weight"),
        );
        let bias = c.bias.then(|| {
            let s = self.hf(i, "conv.conv.bias");
            self.param(
                format!("{}.conv.conv_bias", self.lname(i)),
                vec![h],
                Some(i),
                s,
            )
        });
        let state = self.state(i, StateKind::Conv, vec![c.conv - 1, h]);
        let y = self.scratch("conv", h);
        ops.push(Op::CausalConv1d {
            x: bx,
            weight: w,
            bias,
            state,
            out: y,
            act: Act::Identity,
            kernel: c.conv,
        });
        ops.push(Op::Mul {
            gate: cpart,
            act: Act::Identity,
            x: y,
            out: y,
        });
        self.linear(i, "conv.out_proj", "conv.out_proj", y, x, c.bias, ops, true);
    }

    fn mamba2(&mut self, i: usize, m: &Mamba2Ir, hn: View, x: View, ops: &mut Vec<Op>) {
        let inner = m.inner();
        let cd = m.conv_channels();
        let total = inner + cd + m.heads;
        let proj = self.scratch("proj", total);
        self.linear(
            i,
            "mamba.in_proj",
            "mixer.in_proj",
            hn,
            proj,
            false,
            ops,
            false,
        );
        let z = View {
            width: inner,
            ..proj
        };
        let xbc_raw = View {
            col: inner,
            width: cd,
            ..proj
        };
        let dt = View {
            col: inner + cd,
            width: m.heads,
            ..proj
        };
        let w = self.param(
            format!("{}.mamba.conv1d", self.lname(i)),
            vec![cd, m.conv],
            Some(i),
            self.hf(i, "mixer.conv1d.weight"),
        );
        let bias = m.conv_bias.then(|| {
            let s = self.hf(i, "mixer.conv1d.bias");
            self.param(
                format!("{}.mamba.conv1d_bias", self.lname(i)),
                vec![cd],
                Some(i),
                s,
            )
        });
        let conv_state = self.state(i, StateKind::Conv, vec![m.conv - 1, cd]);
        let xbc = self.scratch("conv", cd);
        ops.push(Op::CausalConv1d {
            x: xbc_raw,
            weight: w,
            bias,
            state: conv_state,
            out: xbc,
            act: Act::Silu,
            kernel: m.conv,
        });
        let a_log = self.param(
            format!("{}.mamba.A_log", self.lname(i)),
            vec![m.heads],
            Some(i),
            self.hf(i, "mixer.A_log"),
        );
        let d = self.param(
            format!("{}.mamba.D", self.lname(i)),
            vec![m.heads],
            Some(i),
            self.hf(i, "mixer.D"),
        );
        let dt_bias = self.param(
            format!("{}.mamba.dt_bias", self.lname(i)),
            vec![m.heads],
            Some(i),
            self.hf(i, "mixer.dt_bias"),
        );
        let state = self.state(i, StateKind::Recurrent, vec![m.heads, m.head_dim, m.state]);
        let y = self.scratch("mix", inner);
        ops.push(Op::Mamba2Scan {
            xbc,
            dt,
            a_log,
            d,
            dt_bias,
            state,
            out: y,
            heads: m.heads,
            head_dim: m.head_dim,
            groups: m.groups,
            state_size: m.state,
            dt_min: m.dt_min,
        });
        let nw = self.param(
            format!("{}.mamba.norm", self.lname(i)),
            vec![inner],
            Some(i),
            self.hf(i, "mixer.norm.weight"),
        );
        let gated = self.scratch("gated", inner);
        ops.push(Op::GatedRmsNorm {
            x: y,
            gate: z,
            weight: nw,
            shared_weight: false,
            out: gated,
            eps: self.ir.norm.eps,
            group: inner / m.groups,
            order: m.norm_order,
        });
        self.linear(
            i,
            "mamba.out_proj",
            "mixer.out_proj",
            gated,
            x,
            false,
            ops,
            true,
        );
    }

    fn mlp(&mut self, i: usize, mlp: &MlpIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let inter = mlp.intermediate();
        let naming = self.ir.weights;
        match mlp {
            MlpIr::Moe(m) => self.moe(i, m, hn, x, ops),
            MlpIr::Swiglu { .. } => {
                let (gate_n, up_n, down_n) = match naming {
                    WeightNaming::Lfm2 => ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2"),
                    WeightNaming::NemotronH => {
                        ("mixer.gate_proj", "mixer.up_proj", "mixer.down_proj")
                    }
                    WeightNaming::Qwen35 => ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                };
                let g = self.scratch("mlp_gate", inter);
                let u = self.scratch("mlp_up", inter);
                self.linear(i, "mlp.gate_proj", gate_n, hn, g, false, ops, false);
                self.linear(i, "mlp.up_proj", up_n, hn, u, false, ops, false);
                ops.push(Op::Mul {
                    gate: g,
                    act: Act::Silu,
                    x: u,
                    out: u,
                });
                self.linear(i, "mlp.down_proj", down_n, u, x, false, ops, true);
            }
            MlpIr::Relu2 { .. } => {
                let (up_n, down_n) = match naming {
                    WeightNaming::NemotronH => ("mixer.up_proj", "mixer.down_proj"),
                    _ => ("mlp.up_proj", "mlp.down_proj"),
                };
                let u = self.scratch("mlp_up", inter);
                self.linear(i, "mlp.up_proj", up_n, hn, u, false, ops, false);
                ops.push(Op::Unary {
                    x: u,
                    act: Act::Relu2,
                    out: u,
                });
                self.linear(i, "mlp.down_proj", down_n, u, x, false, ops, true);
            }
        }
    }
}

/// Checkpoint names of an MoE block's tensors, per family.
struct MoeNames {
    /// Prefix of the block inside its layer (`mlp`, `feed_forward`, `mixer`).
    block: &'static str,
    bias: &'static str,
    /// Fused 3-D tensors (released checkpoints, transformers' in-memory form).
    fused_up: &'static str,
    /// Per-expert projections that stack into `up`, in order (gate before up).
    expert_up: &'static [&'static str],
    expert_down: &'static str,
    shared: &'static str,
}

fn moe_names(naming: WeightNaming) -> MoeNames {
    match naming {
        WeightNaming::Qwen35 => MoeNames {
            block: "mlp",
            bias: "gate.e_score_correction_bias",
            fused_up: "experts.gate_up_proj",
            expert_up: &["gate_proj", "up_proj"],
            expert_down: "down_proj",
            shared: "shared_expert",
        },
        WeightNaming::Lfm2 => MoeNames {
            block: "feed_forward",
            bias: "expert_bias",
            fused_up: "experts.gate_up_proj",
            expert_up: &["w1", "w3"],
            expert_down: "w2",
            shared: "shared_expert",
        },
        WeightNaming::NemotronH => MoeNames {
            block: "mixer",
            bias: "gate.e_score_correction_bias",
            fused_up: "experts.up_proj",
            expert_up: &["up_proj"],
            expert_down: "down_proj",
            shared: "shared_experts",
        },
    }
}

impl Lower<'_> {
    /// An MoE block: the routed experts as one [`Op::Moe`], then the shared expert (if any)
    /// as ordinary ops, both added to the residual `x`. Qwen3.5-MoE's shared-expert token gate
    /// `sigmoid(x · g)` scales the expert's hidden activation before `down` (equal to scaling
    /// its output, `down` being linear).
    fn moe(&mut self, i: usize, m: &MoeIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let h = self.ir.hidden;
        let e = m.route.experts;
        let n = moe_names(self.ir.weights);
        let blk = n.block;
        let lname = self.lname(i);
        let router = self.param(
            format!("{lname}.moe.router"),
            vec![e, h],
            Some(i),
            self.hf(i, &format!("{blk}.gate.weight")),
        );
        let bias = m.route.expert_bias.then(|| {
            let src = self.hf(i, &format!("{blk}.{}", n.bias));
            self.param(format!("{lname}.moe.expert_bias"), vec![e], Some(i), src)
        });
        let rows = m.act.up_rows();
        let up_names = (0..e)
            .flat_map(|j| {
                n.expert_up
                    .iter()
                    .map(move |p| format!("{blk}.experts.{j}.{p}.weight"))
            })
            .map(|rest| self.hf(i, &rest))
            .collect();
        // The experts have no FP8 kernels yet: a quantized checkpoint's experts are
        // dequantized to the target dtype while they load.
        let up = self.matrix(
            format!("{lname}.moe.up"),
            vec![e, rows * m.intermediate, h],
            Some(i),
            self.hf(i, &format!("{blk}.{}", n.fused_up)),
            Some(Pieces {
                names: up_names,
                shape: vec![m.intermediate, h],
            }),
            m.intermediate,
            false,
        );
        let down_names = (0..e)
            .map(|j| self.hf(i, &format!("{blk}.experts.{j}.{}.weight", n.expert_down)))
            .collect();
        let down = self.matrix(
            format!("{lname}.moe.down"),
            vec![e, h, m.intermediate],
            Some(i),
            self.hf(i, &format!("{blk}.experts.down_proj")),
            Some(Pieces {
                names: down_names,
                shape: vec![h, m.intermediate],
            }),
            h,
            false,
        );
        let k = m.route.top_k;
        // hidden [k, inter] + y [k, hidden] + ids, weights [k] + router logits [experts] (4-byte
        // values in 2-byte columns: twice as many columns as needed at f32).
        let tmp_width = (k * (m.intermediate + h + 4) + 2 * e).next_multiple_of(8);
        let tmp = self.scratch("moe_tmp", tmp_width);
        ops.push(Op::Moe {
            x: hn,
            router,
            bias,
            up,
            down,
            out: x,
            tmp,
            route: m.route.clone(),
            inter: m.intermediate,
            act: m.act,
        });
        let Some(shared) = &m.shared else {
            return;
        };
        let si = shared.intermediate;
        let sh = n.shared;
        let u = self.scratch("mlp_up", si);
        match m.act {
            ExpertAct::Swiglu => {
                let g = self.scratch("mlp_gate", si);
                let src = format!("{blk}.{sh}.gate_proj");
                self.linear(i, "moe.shared.gate_proj", &src, hn, g, false, ops, false);
                let src = format!("{blk}.{sh}.up_proj");
                self.linear(i, "moe.shared.up_proj", &src, hn, u, false, ops, false);
                ops.push(Op::Mul {
                    gate: g,
                    act: Act::Silu,
                    x: u,
                    out: u,
                });
            }
            ExpertAct::Relu2 => {
                let src = format!("{blk}.{sh}.up_proj");
                self.linear(i, "moe.shared.up_proj", &src, hn, u, false, ops, false);
                ops.push(Op::Unary {
                    x: u,
                    act: Act::Relu2,
                    out: u,
                });
            }
        }
        if shared.gated {
            let t = self.scratch("moe_shared_gate", 1);
            let src = format!("{blk}.{sh}_gate");
            self.linear(i, "moe.shared.token_gate", &src, hn, t, false, ops, false);
            ops.push(Op::Mul {
                gate: t,
                act: Act::Sigmoid,
                x: u,
                out: u,
            });
        }
        let src = format!("{blk}.{sh}.down_proj");
        self.linear(i, "moe.shared.down_proj", &src, u, x, false, ops, true);
    }
}

fn fix(v: View, ids: &BTreeMap<u32, (BufferId, usize)>) -> View {
    match ids.get(&v.buf.0) {
        Some(&(id, width)) => View {
            buf: id,
            stride: width,
            ..v
        },
        None => v,
    }
}

fn resolve(mut op: Op, ids: &BTreeMap<u32, (BufferId, usize)>) -> Op {
    op.views_mut(|v| *v = fix(*v, ids));
    op
}
