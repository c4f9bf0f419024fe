//! Prefill matmuls (plan op `Linear` over a bucket of rows): a cuBLASLt matmul for 16-bit
//! weights, the FP8 path (fp8.rs) for E4M3 codes, and the bias after either
//! (kernels/elementwise.cu `add_bias`). Small phases' matmuls are gemv.rs's.

use super::*;

/// kernels/elementwise.cu `add_bias`.
#[repr(C)]
#[derive(Clone, Copy)]
struct AddBiasParams {
    out: u64,
    bias: u64,
    len: u64,
    ld_out: i32,
    width: i32,
}

impl Builder<'_> {
    /// A bucket's matmul: cuBLASLt (16-bit weights, sized for `shared` rows when given) or the FP8
    /// path, then the bias.
    pub(super) fn linear(
        &self,
        op: &Op,
        rows: usize,
        shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::Linear {
            x,
            w,
            bias,
            out,
            accumulate,
        } = op
        else {
            unreachable!("linear builds only Op::Linear")
        };
        let shape_rows = shared.unwrap_or(rows);
        let t = self.target();
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        let (xp, ld_x, xd) = self.view(x, shape_rows, label, "x")?;
        let (op_, ld_o, od) = self.view(out, shape_rows, label, "out")?;
        let fp8 = self.buf(*w).dtype == DType::F8E4m3;
        if !fp8 {
            self.expect_dtype(*w, t, label)?;
        }
        if xd != t || (od != t && od != DType::F32) {
            return Err(Error::Unsupported(format!(
                "{label}: linear with input {} and output {} on a {} target",
                xd.name(),
                od.name(),
                t.name()
            )));
        }
        let wb = self.buf(*w);
        if wb.shape != [out.width, x.width] {
            return Err(Error::Config(format!(
                "{label}: weight `{}` has shape {:?}, expected [{}, {}]",
                wb.name, wb.shape, out.width, x.width
            )));
        }
        if fp8 {
            self.linear_fp8(
                *w,
                (xp, ld_x),
                (op_, ld_o, od),
                (shape_rows, x.width, out.width),
                *accumulate,
                label,
                cmds,
            )?;
        } else {
            let wp = self.addr(*w);
            let shape = GemmShape {
                in_dtype: t,
                out_dtype: od,
                n: out.width as u64,
                k: x.width as u64,
                rows: shape_rows as u64,
                ld_x: ld_x as i64,
                ld_out: ld_o as i64,
                align_w: gemm::alignment(wp),
                align_x: gemm::alignment(xp),
                align_out: gemm::alignment(op_),
                tf32: false,
            };
            let g = self.blas.gemm(shape).map_err(|e| match e {
                Error::Backend { msg, .. } => Error::Backend {
                    op: format!("{label} `{}`", wb.name),
                    msg,
                },
                e => e,
            })?;
            cmds.push(Cmd::Gemm(GemmCmd {
                label: format!("{label} `{}`", wb.name),
                gemm: g,
                w: wp,
                x: xp,
                out: op_,
                accumulate: *accumulate,
            }));
        }
        if let Some(b) = bias {
            self.expect_dtype(*b, DType::F32, label)?;
            self.expect_numel(*b, out.width, label)?;
            let p = AddBiasParams {
                out: op_,
                bias: self.addr(*b),
                len,
                ld_out: ld_o,
                width: to_i32(out.width, "width", label)?,
            };
            cmds.push(self.kernel(
                &format!("{label} bias"),
                self.kernels.typed("add_bias", od)?,
                (ceil_div(out.width, 256), r, 1),
                256,
                &p,
            ));
        }
        Ok(())
    }
}
