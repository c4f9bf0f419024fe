//! `Linear` over FP8 weights outside the `gemv` path (kernels/fp8.cu, cuBLASLt).
//!
//! * **W8A8 on the FP8 tensor cores** (prefill chunks of Hopper-shaped matrices): the chunk's
//!   activations are quantized per row and 128 columns (`fp8_act_quant`, scales
//!   `[k / 128][rows]`) into the session's FP8 scratch, then one cuBLASLt matmul multiplies
//!   E4M3 by E4M3 with the weight's 128 x 128 block scales (`BLK128x128_32F`) and the
//!   activations' (`VEC128_32F`), accumulating in f32 and writing the target dtype. Taken
//!   when the device is compute capability 9.x, the blocks are 128 x 128, `k` is a multiple
//!   of 128 (and its block count of 4), the chunk's rows of 4, `n` of 16, the output in the
//!   target dtype and every address 16-byte aligned.
//! * **Dequantize, then bf16** (everything else: other block shapes, the f32 LM head, odd
//!   sizes, `FLASHRT_FP8_GEMM=0`): `fp8_dequant` writes the weight's values into the
//!   session's bf16 copy buffer and the ordinary matmul runs on it. Exact values, one extra
//!   pass over the weight per chunk.
//!
//! Decode and verify steps (at most 8 rows) read FP8 weights in `gemv8_*` (gemv.rs) and only
//! fall back here for matrices it cannot take (`k` not a multiple of 16).

use super::*;
use flashrt_ir::WeightQuant;

/// The session's FP8 scratch buffers (device addresses and sizes in bytes; 0 when unused).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp8Scratch {
    /// E4M3 activations of a W8A8 matmul, `[rows, k]`.
    pub act: u64,
    pub act_bytes: usize,
    /// Their f32 scales, `[k / 128][rows]`.
    pub scales: u64,
    pub scale_bytes: usize,
    /// A dequantized weight in the target dtype, `[n, k]`.
    pub dequant: u64,
    pub dequant_bytes: usize,
}

/// `fp8_*`'s grid description (mirrors kernels/fp8.cu `Fp8GridParams`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Fp8GridParams {
    pub rows: u64,
    pub cols: i32,
    pub seg: i32,
    pub br: i32,
    pub bc: i32,
    pub brows: i32,
    pub bcols: i32,
}

impl Fp8GridParams {
    pub fn of(q: &WeightQuant, numel: usize) -> Result<Self> {
        let i = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| Error::Unsupported(format!("fp8 {what} {v}")))
        };
        Ok(Fp8GridParams {
            rows: (numel / q.cols) as u64,
            cols: i(q.cols, "cols")?,
            seg: i(q.segment, "segment")?,
            br: i(q.block[0], "block rows")?,
            bc: i(q.block[1], "block cols")?,
            brows: i(q.block_rows(), "scale rows")?,
            bcols: i(q.block_cols(), "scale cols")?,
        })
    }
}

/// kernels/fp8.cu `Fp8DequantParams`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Fp8DequantParams {
    pub codes: u64,
    pub values: u64,
    pub scales: u64,
    pub g: Fp8GridParams,
}

/// kernels/fp8.cu `Fp8QuantizeParams`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Fp8QuantizeParams {
    pub src: u64,
    pub codes: u64,
    pub values: u64,
    pub scales: u64,
    pub g: Fp8GridParams,
}

/// kernels/fp8.cu `Fp8ActQuantParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Fp8ActQuantParams {
    x: u64,
    q: u64,
    scales: u64,
    len: u64,
    ld_x: i32,
    rows: i32,
    k: i32,
}

/// Whether a `[n, k]` FP8 weight with `q` over `rows` rows into `out` runs as a W8A8 matmul
/// (the address checks come on top).
fn w8a8_shape(q: &WeightQuant, n: usize, k: usize, rows: usize, out: DType, t: DType) -> bool {
    q.block == [128, 128]
        && q.segment == n
        && k.is_multiple_of(128)
        && (k / 128).is_multiple_of(4)
        && rows.is_multiple_of(4)
        && rows > 8
        && n.is_multiple_of(16)
        && out == t
        && matches!(t, DType::Bf16 | DType::F16)
}

/// Whether `gemv8` takes a `[n, k]` FP8 weight with `q` (the address checks come on top).
pub(super) fn gemv8_shape(q: &WeightQuant, n: usize, k: usize) -> bool {
    k.is_multiple_of(16) && q.block[1].is_multiple_of(16) && q.segment == n
}

/// The FP8 scratch a session of `compiled` needs: `(activation bytes, scale bytes, dequant
/// bytes)` over every FP8 `Linear` of every plan that `gemv8` does not take (small phases,
/// when `gemv`), W8A8 where `w8a8` allows it.
pub fn fp8_scratch_needs(compiled: &Compiled, w8a8: bool, gemv: bool) -> (usize, usize, usize) {
    let layout = &compiled.layout;
    let t = layout.target.dtype;
    let (mut act, mut scales, mut dequant) = (0, 0, 0);
    for plan in &compiled.plans {
        let rows = plan.phase.rows();
        for op in &plan.ops {
            let Op::Linear { x, w, out, .. } = op else {
                continue;
            };
            let wb = layout.buffer(*w);
            let (DType::F8E4m3, Some(q)) = (wb.dtype, wb.quant) else {
                continue;
            };
            let out_dtype = layout.buffer(out.buf).dtype;
            // What `gemv_operands` checks of the views (arena bases are 256-byte aligned).
            let xb = layout.buffer(x.buf);
            let views_fit = x.width.is_multiple_of(8)
                && x.stride.is_multiple_of(8)
                && (xb.offset + x.col * xb.dtype.size()).is_multiple_of(16)
                && wb.offset.is_multiple_of(16);
            if gemv && rows <= 8 && views_fit && gemv8_shape(&q, out.width, x.width) {
                continue;
            }
            if w8a8 && w8a8_shape(&q, out.width, x.width, rows, out_dtype, t) {
                act = act.max(rows * x.width);
                scales = scales.max(4 * rows * (x.width / 128));
            } else {
                dequant = dequant.max(wb.numel() * t.size());
            }
        }
    }
    (act, scales, dequant)
}

impl Builder<'_> {
    /// An FP8 `Linear` (see the module docs): `x` `[rows, k]` at `xp`, `out` at `op_`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_fp8(
        &self,
        w: BufferId,
        (xp, ld_x): (u64, i32),
        (op_, ld_o, od): (u64, i32, DType),
        (rows, k, n): (usize, usize, usize),
        accumulate: bool,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let t = self.target();
        let wb = self.buf(w);
        let q = wb.quant.ok_or_else(|| {
            Error::Config(format!("{label}: FP8 weight `{}` has no scales", wb.name))
        })?;
        let wp = self.addr(w);
        let sp = self.addr(q.scale);
        let s = self.fp8;
        let aligned = [xp, op_, wp, s.act, s.scales].iter().all(|a| a % 16 == 0)
            && ld_x % 8 == 0
            && ld_o % 8 == 0;
        let name = &wb.name;
        if self.fp8_gemm && aligned && w8a8_shape(&q, n, k, rows, od, t) {
            if rows * k > s.act_bytes || 4 * rows * (k / 128) > s.scale_bytes {
                return Err(Error::Config(format!(
                    "{label}: FP8 activation scratch too small for `{name}`"
                )));
            }
            let groups = k / 128;
            let p = Fp8ActQuantParams {
                x: xp,
                q: s.act,
                scales: s.scales,
                len: self.addr(self.compiled.io.len),
                ld_x,
                rows: to_i32(rows, "rows", label)?,
                k: to_i32(k, "k", label)?,
            };
            cmds.push(self.kernel(
                &format!("{label} `{name}` act fp8"),
                self.kernels.typed("fp8_act_quant", t)?,
                (ceil_div(groups, 8), rows as u32, 1),
                256,
                &p,
            ));
            let shape = gemm::Fp8GemmShape {
                out_dtype: od,
                n: n as u64,
                k: k as u64,
                rows: rows as u64,
                ld_out: ld_o as i64,
                align_out: gemm::alignment(op_),
            };
            let g = self
                .blas
                .gemm_fp8(shape, sp, s.scales)
                .map_err(|e| match e {
                    Error::Backend { msg, .. } => Error::Backend {
                        op: format!("{label} `{name}`"),
                        msg,
                    },
                    e => e,
                })?;
            cmds.push(Cmd::Gemm(GemmCmd {
                label: format!("{label} `{name}` (fp8)"),
                gemm: g,
                w: wp,
                x: s.act,
                out: op_,
                accumulate,
            }));
            return Ok(());
        }
        // Dequantize into the session's copy, then the ordinary matmul.
        if wb.numel() * t.size() > s.dequant_bytes {
            return Err(Error::Config(format!(
                "{label}: FP8 dequantization scratch too small for `{name}`"
            )));
        }
        let p = Fp8DequantParams {
            codes: wp,
            values: s.dequant,
            scales: sp,
            g: Fp8GridParams::of(&q, wb.numel())?,
        };
        cmds.push(self.kernel(
            &format!("{label} `{name}` dequant"),
            self.kernels.typed("fp8_dequant", t)?,
            (ceil_div(wb.numel(), 256).clamp(1, 8192), 1, 1),
            256,
            &p,
        ));
        cmds.push(self.gemm_cmd(
            s.dequant,
            (xp, ld_x),
            (op_, ld_o, od),
            (rows, k, n),
            accumulate,
            &format!("{label} `{name}` (dequantized)"),
        )?);
        Ok(())
    }
}
