//! `Op::CausalConv1d` -> kernels/conv.cu (the short causal convolution and its rolling state).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct ConvParams {
    pub(super) x: u64,
    pub(super) out: u64,
    pub(super) weight: u64,
    pub(super) bias: u64,
    pub(super) state: u64,
    pub(super) len: u64,
    pub(super) ld_x: i32,
    pub(super) ld_out: i32,
    pub(super) channels: i32,
    pub(super) kernel: i32,
    pub(super) act: i32,
}

impl Builder<'_> {
    /// The checked kernel parameters of an `Op::CausalConv1d` over `rows`, and its dtype.
    pub(super) fn conv_params(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
    ) -> Result<(ConvParams, DType)> {
        let Op::CausalConv1d {
            x,
            weight,
            bias,
            state,
            out,
            act,
            kernel,
        } = op
        else {
            unreachable!("conv_params takes only Op::CausalConv1d")
        };
        let len = self.addr(self.compiled.io.len);
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        let c = x.width;
        if xd != od || out.width != c || *kernel == 0 {
            return Err(Error::Config(format!(
                "{label}: x/out mismatch or kernel 0"
            )));
        }
        if x.buf == out.buf {
            return Err(Error::Unsupported(format!(
                "{label}: out aliases x (not supported by conv_out)"
            )));
        }
        self.expect_dtype(*weight, DType::F32, label)?;
        self.expect_numel(*weight, c * kernel, label)?;
        let bias_p = match bias {
            Some(b) => {
                self.expect_dtype(*b, DType::F32, label)?;
                self.expect_numel(*b, c, label)?;
                self.addr(*b)
            }
            None => 0,
        };
        self.expect_dtype(*state, xd, label)?;
        self.expect_numel(*state, (kernel - 1) * c, label)?;
        let p = ConvParams {
            x: xp,
            out: op_,
            weight: self.addr(*weight),
            bias: bias_p,
            state: self.addr(*state),
            len,
            ld_x,
            ld_out: ld_o,
            channels: to_i32(c, "channels", label)?,
            kernel: to_i32(*kernel, "kernel", label)?,
            act: act_code(*act),
        };
        Ok((p, xd))
    }

    /// The launch of an `Op::CausalConv1d` over `rows` (state read and written in place).
    pub(super) fn causal_conv1d(
        &self,
        op: &Op,
        rows: usize,
        _shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::CausalConv1d { x, kernel, .. } = op else {
            unreachable!("causal_conv1d builds only Op::CausalConv1d")
        };
        let (p, xd) = self.conv_params(op, rows, label)?;
        let r = rows as u32;
        let c = x.width;
        let (xp, op_, ld_x, ld_o) = (p.x, p.out, p.ld_x, p.ld_out);
        // kernels/conv.cu `conv_vec` (output and state roll in one launch, 16-byte
        // packs of channels) for kernels up to CONV_KMAX taps when the channel count,
        // both row strides and the x, out and state addresses are whole packs; else
        // `conv_out` then `conv_state`. Mirrors of its CONV_* constants.
        const CONV_KMAX: usize = 4;
        const CONV_ROWS: usize = 8;
        const CONV_WARPS: usize = 8;
        let pack = 16 / xd.size();
        let vec = *kernel <= CONV_KMAX
            && c > 0
            && c.is_multiple_of(pack)
            && [xp, op_, p.state].iter().all(|a| a.is_multiple_of(16))
            && [ld_x, ld_o]
                .iter()
                .all(|&ld| (ld as usize).is_multiple_of(pack));
        if vec {
            cmds.push(self.kernel(
                label,
                self.kernels.typed("conv_vec", xd)?,
                (
                    ceil_div(c, 32 * pack),
                    ceil_div(rows, CONV_WARPS * CONV_ROWS),
                    1,
                ),
                32 * CONV_WARPS as u32,
                &p,
            ));
        } else {
            cmds.push(self.kernel(
                label,
                self.kernels.typed("conv_out", xd)?,
                (ceil_div(c, 128), r, 1),
                128,
                &p,
            ));
            cmds.push(self.kernel(
                &format!("{label} state"),
                self.kernels.typed("conv_state", xd)?,
                (ceil_div(c, 128), 1, 1),
                128,
                &p,
            ));
        }
        Ok(())
    }
}
