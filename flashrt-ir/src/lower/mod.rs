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

mod attention;
mod gated_deltanet;
mod mamba2;
mod mlp;
mod mtp;
mod short_conv;

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

    /// Adjacent column views of one scratch buffer, one per width in order: matmuls that read
    /// one input and write these views can run as one matmul over their weights end to end
    /// (the CUDA backend's prefill `linear_group`; weights created one after another are
    /// adjacent in the arena). `None` where that would misalign a row: the total width and
    /// the first column of every piece whose width is a multiple of 8 must be multiples of 8
    /// (16-byte rows for the vector loads of the kernels that read them).
    fn scratch_cols(&mut self, name: &'static str, widths: &[usize]) -> Option<Vec<View>> {
        let mut col = 0;
        for &w in widths {
            if w % 8 == 0 && col % 8 != 0 {
                return None;
            }
            col += w;
        }
        if col % 8 != 0 {
            return None;
        }
        let whole = self.scratch(name, col);
        let mut col = 0;
        Some(
            widths
                .iter()
                .map(|&width| {
                    let v = View {
                        col,
                        width,
                        ..whole
                    };
                    col += width;
                    v
                })
                .collect(),
        )
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
        ops.push(self.lm_head(io, hn, head));
        ops
    }

    /// The LM head: every row of the final-normed hidden `hn` to `io.logits`.
    fn lm_head(&self, io: IoIds, hn: View, head: BufferId) -> Op {
        Op::Linear {
            x: hn,
            w: head,
            bias: None,
            out: View {
                buf: io.logits,
                col: 0,
                width: self.ir.vocab,
                stride: self.ir.vocab,
            },
            accumulate: false,
        }
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

    /// A causal depthwise conv over `x` (`channels` wide, `kernel` taps): its weight
    /// `{layer}.{ours}` (checkpoint `{hf}.weight`), optional bias `{ours}_bias`, its conv state
    /// region and the `conv` scratch it writes, which it returns.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv(
        &mut self,
        i: usize,
        ours: &str,
        hf: &str,
        x: View,
        kernel: usize,
        bias: bool,
        act: Act,
        ops: &mut Vec<Op>,
    ) -> View {
        let channels = x.width;
        let weight = self.param(
            format!("{}.{ours}", self.lname(i)),
            vec![channels, kernel],
            Some(i),
            self.hf(i, &format!("{hf}.weight")),
        );
        let bias = bias.then(|| {
            let s = self.hf(i, &format!("{hf}.bias"));
            self.param(
                format!("{}.{ours}_bias", self.lname(i)),
                vec![channels],
                Some(i),
                s,
            )
        });
        let state = self.state(i, StateKind::Conv, vec![kernel - 1, channels]);
        let out = self.scratch("conv", channels);
        ops.push(Op::CausalConv1d {
            x,
            weight,
            bias,
            state,
            out,
            act,
            kernel,
        });
        out
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
