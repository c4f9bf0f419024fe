//! MTP drafter lowering (Qwen3.5/3.6's multi-token-prediction head).

use super::*;

impl Lower<'_> {
    /// The `mtp.hidden` state region (created on first use).
    pub(super) fn mtp_hidden(&mut self) -> BufferId {
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
    pub(super) fn lower_mtp_draft(
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
        ops.push(self.lm_head(io, hn, head));
        ops
    }
}
