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
            cmds.push(self.gemm_cmd(
                self.addr(*w),
                (xp, ld_x),
                (op_, ld_o, od),
                (shape_rows, x.width, out.width),
                *accumulate,
                &format!("{label} `{}`", wb.name),
            )?);
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

    /// One cuBLASLt matmul `out (+)= x · w^T` over 16-bit weights at `wp`: (rows, k, n).
    pub(super) fn gemm_cmd(
        &self,
        wp: u64,
        (xp, ld_x): (u64, i32),
        (op_, ld_o, od): (u64, i32, DType),
        (rows, k, n): (usize, usize, usize),
        accumulate: bool,
        label: &str,
    ) -> Result<Cmd> {
        let shape = GemmShape {
            in_dtype: self.target(),
            out_dtype: od,
            n: n as u64,
            k: k as u64,
            rows: rows as u64,
            ld_x: ld_x as i64,
            ld_out: ld_o as i64,
            align_w: gemm::alignment(wp),
            align_x: gemm::alignment(xp),
            align_out: gemm::alignment(op_),
            tf32: false,
        };
        let g = self.blas.gemm(shape).map_err(|e| match e {
            Error::Backend { msg, .. } => Error::Backend {
                op: label.to_string(),
                msg,
            },
            e => e,
        })?;
        Ok(Cmd::Gemm(GemmCmd {
            label: label.to_string(),
            gemm: g,
            w: wp,
            x: xp,
            out: op_,
            accumulate,
        }))
    }

    /// Two or more matmuls at `ops[0..]` as one GEMM (`CudaOptions::linear_group`): the same
    /// input view, no bias, not accumulating, 16-bit weights of the target type stored end to
    /// end in the arena, and outputs that are adjacent columns of one buffer, in order (what
    /// flashrt-ir's `scratch_cols` lays out). Then `[w_1; w_2; ...]` is one `[n_1 + n_2 + ...,
    /// k]` matrix and the outputs one view of that width. `None` where the ops do not qualify
    /// (they then run one by one); else the number of ops taken.
    pub(super) fn linear_group(
        &self,
        ops: &[Op],
        rows: usize,
        shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<Option<usize>> {
        if !self.linear_group {
            return Ok(None);
        }
        let t = self.target();
        // (weight, output view) of op j when it is a plain matmul of `t` weights over `x0`.
        let plain = |op: &Op, x0: Option<&View>| match op {
            Op::Linear {
                x,
                w,
                bias: None,
                out,
                accumulate: false,
            } if x0.is_none_or(|x0| x0 == x) => {
                let b = self.buf(*w);
                (b.dtype == t && b.shape == [out.width, x.width]).then_some((*w, *x, *out))
            }
            _ => None,
        };
        let Some((w0, x, out0)) = plain(&ops[0], None) else {
            return Ok(None);
        };
        let (mut end_w, mut end_out, mut n) =
            (self.addr(w0) + self.buf(w0).bytes as u64, out0, out0.width);
        let mut names = vec![self.buf(w0).name.as_str()];
        for op in &ops[1..] {
            let Some((w, _, out)) = plain(op, Some(&x)) else {
                break;
            };
            // (One buffer, one stride: `view` checks a view's stride against its buffer.)
            if self.addr(w) != end_w
                || out.buf != out0.buf
                || out.col != end_out.col + end_out.width
            {
                break;
            }
            end_w = self.addr(w) + self.buf(w).bytes as u64;
            end_out = out;
            n += out.width;
            names.push(self.buf(w).name.as_str());
        }
        if names.len() < 2 {
            return Ok(None);
        }
        let whole = View { width: n, ..out0 };
        let shape_rows = shared.unwrap_or(rows);
        let (xp, ld_x, xd) = self.view(&x, shape_rows, label, "x")?;
        let (op_, ld_o, od) = self.view(&whole, shape_rows, label, "out")?;
        if xd != t || od != t {
            return Ok(None);
        }
        cmds.push(self.gemm_cmd(
            self.addr(w0),
            (xp, ld_x),
            (op_, ld_o, od),
            (shape_rows, x.width, n),
            false,
            &format!("{label} `{}`", names.join("` + `")),
        )?);
        Ok(Some(names.len()))
    }
}
