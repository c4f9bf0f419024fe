//! Short-convolution mixer lowering (LFM2's gated causal conv).

use super::*;

impl Lower<'_> {
    pub(super) fn short_conv(
        &mut self,
        i: usize,
        c: &ShortConvIr,
        hn: View,
        x: View,
        ops: &mut Vec<Op>,
    ) {
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
        let y = self.causal_conv(
            i,
            "conv.conv",
            "conv.conv",
            bx,
            c.conv,
            c.bias,
            Act::Identity,
            ops,
        );
        ops.push(Op::Mul {
            gate: cpart,
            act: Act::Identity,
            x: y,
            out: y,
        });
        self.linear(i, "conv.out_proj", "conv.out_proj", y, x, c.bias, ops, true);
    }
}
