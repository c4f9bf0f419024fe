//! Gated DeltaNet mixer lowering (projections, causal conv, the delta-rule recurrence, gated norm).

use super::*;

impl Lower<'_> {
    pub(super) fn gdn(
        &mut self,
        i: usize,
        g: &GatedDeltaNetIr,
        hn: View,
        x: View,
        ops: &mut Vec<Op>,
    ) {
        let c = g.qkv_channels();
        let vw = g.value_heads * g.value_dim;
        // The four input projections' outputs side by side in one scratch where rows stay
        // aligned (one prefill matmul for all four on the CUDA backend).
        let h = g.value_heads;
        let (raw, z, bv, av) = match self.scratch_cols("gdn_in", &[c, vw, h, h]).as_deref() {
            Some(&[raw, z, bv, av]) => (raw, z, bv, av),
            _ => (
                self.scratch("proj", c),
                self.scratch("z", vw),
                self.scratch("b", h),
                self.scratch("a", h),
            ),
        };
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
        let qkv = self.causal_conv(
            i,
            "gdn.conv1d",
            "linear_attn.conv1d",
            raw,
            g.conv,
            false,
            Act::Silu,
            ops,
        );
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
}
