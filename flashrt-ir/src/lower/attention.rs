//! Attention mixer lowering (full attention with optional output gate, q/k norms, RoPE).

use super::*;

impl Lower<'_> {
    pub(super) fn attention(
        &mut self,
        i: usize,
        a: &AttentionIr,
        hn: View,
        x: View,
        ops: &mut Vec<Op>,
    ) {
        let naming = self.ir.weights;
        let (p, o_name, qn, kn) = match naming {
            WeightNaming::Qwen35 => ("self_attn", "o_proj", "q_norm", "k_norm"),
            WeightNaming::Lfm2 => ("self_attn", "out_proj", "q_layernorm", "k_layernorm"),
            WeightNaming::NemotronH => ("mixer", "o_proj", "q_norm", "k_norm"),
        };
        let qw = a.q_heads * a.head_dim;
        let kvw = a.kv_heads * a.head_dim;
        // q_proj's output (`[query | gate]` per head where there is an output gate), k and v
        // side by side in one scratch where rows stay aligned (one prefill matmul for the three
        // on the CUDA backend).
        let qo_width = if a.output_gate { 2 * qw } else { qw };
        let (qo, k, v) = match self
            .scratch_cols("attn_in", &[qo_width, kvw, kvw])
            .as_deref()
        {
            Some(&[qo, k, v]) => (qo, k, v),
            _ => (
                self.scratch(if a.output_gate { "q_gate" } else { "q" }, qo_width),
                self.scratch("k", kvw),
                self.scratch("v", kvw),
            ),
        };
        // With the gate, the split below writes the query and the gate to their own scratches.
        let gate = a.output_gate.then(|| self.scratch("gate", qw));
        let q = if a.output_gate {
            self.scratch("q", qw)
        } else {
            qo
        };
        let q_gate = gate.map(|_| qo);
        // Qwen3.5's q_proj emits `[query | gate]` per head, split below.
        self.linear(
            i,
            "attn.q_proj",
            &format!("{p}.q_proj"),
            hn,
            q_gate.unwrap_or(q),
            false,
            ops,
            false,
        );
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
        // The query / gate split after the three projections, so that they stay adjacent
        // reads of `hn` (one launch for all three in a decode step, with the norm before them).
        if let (Some(qg), Some(gate)) = (q_gate, gate) {
            ops.push(Op::SplitHeads {
                x: qg,
                heads: a.q_heads,
                outs: vec![q, gate],
            });
        }
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
}
