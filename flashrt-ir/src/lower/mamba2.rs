//! Mamba2 mixer lowering (Nemotron-H's SSD layers).

use super::*;

impl Lower<'_> {
    pub(super) fn mamba2(&mut self, i: usize, m: &Mamba2Ir, hn: View, x: View, ops: &mut Vec<Op>) {
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
        let xbc = self.causal_conv(
            i,
            "mamba.conv1d",
            "mixer.conv1d",
            xbc_raw,
            m.conv,
            m.conv_bias,
            Act::Silu,
            ops,
        );
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
}
