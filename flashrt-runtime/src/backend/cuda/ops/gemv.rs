//! Small phases' matmuls -> kernels/gemv.cu launches: consecutive `Linear`s on one input in one
//! launch, with the RMSNorm before them fused into the prologue and an MLP's SwiGLU product into
//! the epilogue.

use super::*;

/// Matrices one `gemv` launch may cover and warps per block: mirrors of kernels/gemv.cu.
pub(super) const MAX_GEMV: usize = 4;
pub(super) const GEMV_WARPS: usize = 8;
/// kernels/gemv_mma.cu: columns per warp step (and the multiple `k` and the scale blocks'
/// columns must be), and the most shared memory its normalised input rows may take.
const GEMVM_STEP: usize = 128;
const GEMVM_MAX_SMEM: usize = 96 * 1024;
/// kernels/gemv.cu: the most shared memory the CUDA-core kernel's staged rows may take (under
/// the H100/H200 opt-in limit of 227 KiB less the kernel's static shared memory).
const GEMV_MAX_SMEM: usize = 200 * 1024;
/// kernels/gemv_mma.cu: warps per block, resident blocks per SM, steps in flight per warp (a
/// launch needs `k >= ring x 128`), and the staged rows' padding (elements).
const GEMVM_WARPS: usize = 8;
const GEMVM_MINB: usize = 2;
const GEMVM_RING: usize = 2;
const GEMVM_PAD: usize = 8;
/// Fewest steps a warp of a tensor-core launch takes (small launches use fewer blocks).
const GEMVM_MIN_STEPS: usize = 4;

/// kernels/gemv.cu `GEMVS_SMEM(R)`: the dynamic shared memory of a `gemv16s_*` block (a 4 KiB
/// transpose buffer per warp, two past two rows).
fn gemvs_smem(rows: usize) -> u32 {
    (GEMV_WARPS * if rows > 2 { 2 } else { 1 } * 8 * 32 * 16) as u32
}

/// Bytes of the tensor-core gemv's split-tile buffer for `sms` SMs: a slot of 128 tagged
/// 64-bit share words per warp of the largest grid (kernels/gemv_mma.cu); zeroed once, the
/// kernel leaves it at zero.
pub(in crate::backend::cuda) fn gemvm_sync_bytes(sms: usize) -> usize {
    sms.max(1) * GEMVM_MINB * GEMVM_WARPS * 128 * 8
}

/// Output features per `gemv` block at `rows` rows (in `glu` mode half as many gate/up
/// pairs): `GEMV_FEATS_OF` (16-bit weights) and `GEMV8_FEATS_OF` (FP8) in kernels/gemv.cu.
pub(super) fn gemv_feats(rows: usize, fp8: bool) -> usize {
    match (fp8, rows) {
        (false, 0..=2) | (true, 1) => 8,
        _ => 4,
    }
}

/// How a `gemv` launch reads its weights: the target dtype, or FP8 codes with block scales of
/// `[rows, cols]` (the same for every matrix of the launch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GemvWeights {
    Plain,
    Fp8 { block: [usize; 2] },
}

/// One matrix as a `gemv` operand: (x address, ld_x, weight, out address, ld_out, out is f32,
/// weight format, scale address, scale row stride).
#[derive(Clone, Copy)]
pub(super) struct GemvOperands {
    pub(super) x: u64,
    pub(super) ld_x: i32,
    pub(super) w: u64,
    pub(super) out: u64,
    pub(super) ld_out: i32,
    pub(super) out_f32: bool,
    pub(super) weights: GemvWeights,
    pub(super) scale: u64,
    pub(super) scale_ld: i32,
}

/// A RmsNorm fused into a `gemv` launch ([`Builder::gemv_norm`]).
#[derive(Clone, Copy, Default)]
pub(super) struct GemvNorm {
    pub(super) x: u64,
    pub(super) ld_x: i32,
    pub(super) w: u64,
    pub(super) one_plus: bool,
    pub(super) out: u64,
    pub(super) ld_out: i32,
    pub(super) eps: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct GemvMat {
    pub(super) w: u64,
    pub(super) out: u64,
    pub(super) scale: u64,
    pub(super) n: i32,
    pub(super) ld_out: i32,
    pub(super) blocks: i32,
    pub(super) scale_ld: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct GemvParams {
    pub(super) x: u64,
    pub(super) ld_x: i32,
    pub(super) k: i32,
    pub(super) nmats: i32,
    pub(super) accumulate: i32,
    pub(super) out_f32: i32,
    pub(super) glu: i32,
    pub(super) act: i32,
    /// `gemv8m_*` without a norm: the input rows are staged in dynamic shared memory.
    pub(super) stage: i32,
    pub(super) glu_out: u64,
    pub(super) ld_glu: i32,
    pub(super) last_row: i32,
    pub(super) len: u64,
    pub(super) norm: i32,
    pub(super) one_plus: i32,
    pub(super) norm_w: u64,
    pub(super) norm_out: u64,
    pub(super) ld_norm_out: i32,
    pub(super) eps: f32,
    pub(super) qbr: i32,
    pub(super) qbc: i32,
    /// `gemv8m_*` / `gemv16m_*`: steps per warp asked of the L2 before the PDL wait; 0 for
    /// none ([`Builder::gemvm_prefetch`]).
    pub(super) pf: i32,
    /// `gemv8m_*` / `gemv16m_*`: split tiles' shares ([`gemvm_sync_bytes`]).
    pub(super) part: u64,
    pub(super) m: [GemvMat; MAX_GEMV],
    /// 1: a side launch ([`Builder::gemv`]): triggers the next kernel first and waits for its
    /// predecessor at the end.
    pub(super) side: i32,
    /// 1: each block asks for its first weights before its PDL wait (one row, CUDA cores, no
    /// fused norm, not a side launch; [`Builder::gemv_early`]).
    pub(super) early: i32,
}

// kernels/gemv.cu checks the same offsets of its `GemvParams` (the struct is passed by value as
// the kernels' only argument): a field added or removed on one side alone fails a build.
const _: () = assert!(
    std::mem::offset_of!(GemvParams, part) == 112
        && std::mem::offset_of!(GemvParams, m) == 120
        && std::mem::size_of::<GemvMat>() == 40
        && std::mem::offset_of!(GemvParams, side) == 280
        && std::mem::size_of::<GemvParams>() == 288
);

impl GemvWeights {
    /// The kernel name prefix (`gemv` / `gemv8`) and the scale block (`qbr`, `qbc`).
    pub(super) fn kernel(self) -> (&'static str, i32, i32) {
        match self {
            GemvWeights::Plain => ("gemv", 1, 1),
            GemvWeights::Fp8 { block } => ("gemv8", block[0] as i32, block[1] as i32),
        }
    }
}

impl Builder<'_> {
    /// A `Linear` that [`Builder::gemv`] can run: no bias, 16-bit target, `k % 8 == 0`,
    /// 16-byte aligned rows; FP8 weights with `k` and the block's columns multiples of 16.
    /// `None` leaves the op to the matmul path (which also reports bad views).
    pub(super) fn gemv_operands(&self, op: &Op, shape_rows: usize) -> Option<GemvOperands> {
        let Op::Linear {
            x,
            w,
            bias: None,
            out,
            ..
        } = op
        else {
            return None;
        };
        let t = self.target();
        let (xp, ld_x, xd) = self.view(x, shape_rows, "", "").ok()?;
        let (op_, ld_o, od) = self.view(out, shape_rows, "", "").ok()?;
        let wb = self.buf(*w);
        let wp = self.addr(*w);
        let (weights, scale, scale_ld) = match (wb.dtype, wb.quant) {
            (d, _) if d == t => (GemvWeights::Plain, 0, 0),
            (DType::F8E4m3, Some(q)) if super::fp8::gemv8_shape(&q, out.width, x.width) => {
                let s = self.addr(q.scale);
                (
                    GemvWeights::Fp8 { block: q.block },
                    s,
                    i32::try_from(q.block_cols()).ok()?,
                )
            }
            _ => return None,
        };
        let fits = xd == t
            && (od == t || od == DType::F32)
            && wb.shape == [out.width, x.width]
            && x.width % 8 == 0
            && ld_x % 8 == 0
            && xp % 16 == 0
            && wp.is_multiple_of(16);
        fits.then_some(GemvOperands {
            x: xp,
            ld_x,
            w: wp,
            out: op_,
            ld_out: ld_o,
            out_f32: od == DType::F32,
            weights,
            scale,
            scale_ld,
        })
    }

    /// Small phases (at most 8 shape rows, bf16/f16): the `Linear`s at the head of `ops` as
    /// one `gemv` launch (kernels/gemv.cu) — up to 4 consecutive matrices reading the same
    /// input, or an MLP's gate, up and `Mul` fused (`glu`). Returns how many ops it consumed,
    /// `None` when the head op is not such a `Linear` (or gemv is off).
    ///
    /// With `gemv_side`, at one row, where a normalised input's matrices come in two weight
    /// formats (an FP8 layer's Gated DeltaNet in_proj_qkv / _z and its bf16 in_proj_b / _a,
    /// which the released checkpoints keep unquantized), the second group becomes a side
    /// launch: it normalises the residual row itself (the same values: the prologue rounds as
    /// the RmsNorm op does) instead of reading what the first launch stores, so it needs
    /// nothing the first launch writes and runs beside it (kernels/gemv.cu `gemv_entry`).
    pub(super) fn gemv(
        &self,
        ops: &[Op],
        shape_rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<Option<usize>> {
        let Some(used) = self.gemv_with(ops, shape_rows, label, cmds, false)? else {
            return Ok(None);
        };
        // (Only the CUDA-core kernel's entry runs side launches: 16-bit weights, neither
        // tensor-core gemv option on.)
        if !self.gemv_side
            || shape_rows != 1
            || self.gemv16_mma
            || self.gemv16_smem
            || self.gemv_norm(ops, shape_rows).is_none()
        {
            return Ok(Some(used));
        }
        // The Linears right after this launch's on the same normalised input, weights of the
        // other format, as [the norm, those Linears] in one side launch.
        let Op::Linear { x: x0, .. } = &ops[1] else {
            return Ok(Some(used));
        };
        let side: Vec<Op> = ops[used..]
            .iter()
            .take(MAX_GEMV)
            .take_while(|op| {
                matches!(op, Op::Linear { x, accumulate: false, .. } if x == x0)
                    && self
                        .gemv_operands(op, shape_rows)
                        .is_some_and(|o| o.weights == GemvWeights::Plain)
            })
            .cloned()
            .collect();
        if side.is_empty() {
            return Ok(Some(used));
        }
        let n = side.len();
        let mut fused = vec![ops[0].clone()];
        fused.extend(side);
        match self.gemv_with(&fused, shape_rows, label, cmds, true)? {
            Some(k) if k == n + 1 => Ok(Some(used + n)),
            // (Built as fewer ops than asked: undo; they run in their own turn as before.)
            Some(_) => {
                cmds.pop();
                Ok(Some(used))
            }
            None => Ok(Some(used)),
        }
    }

    /// [`Builder::gemv`]'s launch of the head of `ops`; `side`: as a side launch.
    fn gemv_with(
        &self,
        ops: &[Op],
        shape_rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
        side: bool,
    ) -> Result<Option<usize>> {
        let t = self.target();
        if !self.gemv || shape_rows > 8 || !matches!(t, DType::Bf16 | DType::F16) {
            return Ok(None);
        }
        // A leading RmsNorm over whole rows, read by the Linears right after it, is fused
        // into their launch (each block normalises its input rows itself).
        let norm = self.gemv_norm(ops, shape_rows);
        let ops = if norm.is_some() { &ops[1..] } else { ops };
        let Some(first) = self.gemv_operands(&ops[0], shape_rows) else {
            return Ok(None);
        };
        let Op::Linear {
            x: x0,
            accumulate: acc0,
            ..
        } = &ops[0]
        else {
            return Ok(None);
        };
        // The group: consecutive non-accumulating Linears on the same input and output dtype,
        // with weights of one format.
        let mut group = vec![(&ops[0], first)];
        if !acc0 {
            for op in ops.iter().skip(1).take(MAX_GEMV - 1) {
                match (op, self.gemv_operands(op, shape_rows)) {
                    (
                        Op::Linear {
                            x,
                            accumulate: false,
                            ..
                        },
                        Some(o),
                    ) if x == x0 && o.out_f32 == first.out_f32 && o.weights == first.weights => {
                        group.push((op, o))
                    }
                    _ => break,
                }
            }
        }
        let out_view = |op: &Op| match op {
            Op::Linear { out, w, .. } => (*out, *w),
            _ => unreachable!("gemv groups hold Linear ops only"),
        };
        // gate, up, Mul(act(gate) * up) -> one glu launch.
        let glu = match (group.len() >= 2, ops.get(2)) {
            (
                true,
                Some(Op::Mul {
                    gate,
                    act,
                    x: mx,
                    out,
                }),
            ) => {
                let (g, _) = out_view(group[0].0);
                let (u, _) = out_view(group[1].0);
                (*gate == g && *mx == u && g.width == u.width && !first.out_f32)
                    .then_some((*act, *out))
            }
            _ => None,
        };
        if glu.is_some() {
            group.truncate(2);
        }
        let k = x0.width;
        let widths: Vec<usize> = group.iter().map(|(op, _)| out_view(op).0.width).collect();
        // FP8 weights whose scale blocks span multiples of 128 columns: the tensor-core
        // kernel (16 rows per tile, 8 gate/up pairs in glu mode), with the normalised input
        // rows in shared memory when a norm is fused.
        let (prefix, qbr, qbc) = first.weights.kernel();
        // (Without a norm the rows are staged when they fit, else read at each step.)
        let staged = shape_rows * (k + GEMVM_PAD) * 2;
        // 16-bit weights: whether the tensor-core kernel runs depends on the shape alone, never
        // on the rows (with a norm, the most rows' staged inputs must fit), so every phase of
        // a model computes a row the same way (decode, verify and batched steps bit for bit).
        let staged_max = 8 * (k + GEMVM_PAD) * 2;
        // The tensor-core launch's steps: tiles of 16 rows (8 gate/up pairs) x 128 columns (the
        // kernel counts them in an i32).
        let mma_tiles: usize = if glu.is_some() {
            widths[0].div_ceil(8)
        } else {
            widths.iter().map(|w| w.div_ceil(16)).sum()
        };
        let steps = mma_tiles * (k / GEMVM_STEP);
        let mma_shape = k.is_multiple_of(GEMVM_STEP)
            && k >= GEMVM_RING * GEMVM_STEP
            && steps < i32::MAX as usize;
        // The tensor-core kernel: its steps dealt evenly to up to two resident 8-warp blocks
        // per SM (at least GEMVM_MIN_STEPS per warp), a grid chosen from the shape alone, so
        // every row count of a matrix sums in the same order.
        let mma_grid =
            (steps / (GEMVM_MIN_STEPS * GEMVM_WARPS)).clamp(1, GEMVM_MINB * self.sms.max(1));
        // Warps sharing a tile on average: each split tile is finished after its last
        // contributor's stream ends, a chain that costs a few microseconds at the end of every
        // launch, so matrices whose tiles fall to many warps (few long tiles: a down or out
        // projection, 6.6 warps a tile at the 27B shape) stream faster on the CUDA cores at
        // one row (`CudaOptions::gemv8m_max_splits`).
        let splits =
            (k / GEMVM_STEP) as f64 * (mma_grid * GEMVM_WARPS) as f64 / steps.max(1) as f64;
        let mma = match first.weights {
            GemvWeights::Fp8 { block } => {
                self.gemv_mma
                    && mma_shape
                    && block[1].is_multiple_of(GEMVM_STEP)
                    && (block[1] / GEMVM_STEP).is_power_of_two()
                    && (norm.is_none() || staged <= GEMVM_MAX_SMEM)
                    && (self.gemv8m_max_splits == 0 || splits <= self.gemv8m_max_splits as f64)
            }
            GemvWeights::Plain => {
                !self.gemv16_smem
                    && self.gemv16_mma
                    && mma_shape
                    && (norm.is_none() || staged_max <= GEMVM_MAX_SMEM)
            }
        };
        // `gemv16s_*`: the CUDA-core kernel's blocks with the products on the tensor cores
        // (any shape the CUDA-core kernel takes; 8 outputs a block at any row count).
        let smem_mma = !mma && self.gemv16_smem && first.weights == GemvWeights::Plain;
        let stage = mma && staged <= GEMVM_MAX_SMEM;
        let mma_smem = if stage { staged } else { 0 };
        // The CUDA-core kernel at several rows with the norm fused (`GEMV_STAGED` in
        // kernels/gemv.cu): resident blocks looping over tiles, each with its rows normalised
        // once into `rows x k` elements of shared memory, where 8 rows fit (otherwise each tile
        // normalises what it reads, as before: the same values either way).
        let cores_staged = self.gemv_stage_rows > 0
            && !mma
            && !smem_mma
            && norm.is_some()
            && shape_rows >= (self.gemv_stage_rows as usize).max(2)
            && first.weights == GemvWeights::Plain
            && 8 * k * t.size() <= GEMV_MAX_SMEM;
        let cores_smem = shape_rows * k * t.size();
        // Features per block: the rows' default, or for one row fewer when the default leaves
        // the last wave of resident blocks mostly empty (see `gemv_r1f<F>`).
        let (prefix, feats, suffix) = if mma {
            let name = match first.weights {
                GemvWeights::Plain => "gemv16m",
                GemvWeights::Fp8 { .. } => "gemv8m",
            };
            (name, 16, "")
        } else if smem_mma {
            let (feats, suffix) = self.gemvs_shape(
                shape_rows,
                &widths[..if glu.is_some() { 1 } else { widths.len() }],
                glu.is_some(),
                norm.is_some(),
            )?;
            ("gemv16s", feats, suffix)
        } else {
            let (feats, suffix) = self.gemv_shape(
                shape_rows,
                &widths[..if glu.is_some() { 1 } else { widths.len() }],
                glu.is_some(),
                norm.is_some(),
                first.weights,
            )?;
            (prefix, feats, suffix)
        };
        let per_block = if glu.is_some() { feats / 2 } else { feats };
        let mut mats = [GemvMat::default(); MAX_GEMV];
        let mut total_blocks = 0u32;
        let mut names = Vec::new();
        let wsize = match first.weights {
            GemvWeights::Plain => t.size(),
            GemvWeights::Fp8 { .. } => 1,
        };
        let mut weight_bytes = 0;
        for (slot, (op, o)) in mats.iter_mut().zip(&group) {
            let (out, w) = out_view(op);
            weight_bytes += out.width * k * wsize;
            let blocks = ceil_div(out.width, per_block);
            *slot = GemvMat {
                w: o.w,
                out: o.out,
                scale: o.scale,
                n: to_i32(out.width, "n", label)?,
                ld_out: o.ld_out,
                blocks: blocks as i32,
                scale_ld: o.scale_ld,
            };
            total_blocks += blocks;
            names.push(self.buf(w).name.clone());
        }
        if glu.is_some() {
            total_blocks = mats[0].blocks as u32;
        }
        let (glu_out, ld_glu, act) = match glu {
            Some((act, out)) => {
                let (p, ld, d) = self.view(&out, shape_rows, label, "glu out")?;
                if d != t || out.width != mats[0].n as usize {
                    return Ok(None);
                }
                (p, ld, act_code(act))
            }
            None => (0, 0, 0),
        };
        let (xp, ld_x) = norm.map_or((first.x, first.ld_x), |n| (n.x, n.ld_x));
        let n = norm.unwrap_or_default();
        let p = GemvParams {
            x: xp,
            ld_x,
            k: to_i32(k, "k", label)?,
            nmats: group.len() as i32,
            accumulate: *acc0 as i32,
            out_f32: first.out_f32 as i32,
            glu: glu.is_some() as i32,
            act,
            stage: (stage || cores_staged) as i32,
            glu_out,
            ld_glu,
            last_row: 0,
            len: 0,
            norm: norm.is_some() as i32,
            one_plus: n.one_plus as i32,
            norm_w: n.w,
            norm_out: if side { 0 } else { n.out },
            ld_norm_out: n.ld_out,
            eps: n.eps,
            qbr,
            qbc,
            pf: match (mma, first.weights) {
                (false, _) => 0,
                (true, GemvWeights::Plain) => self.gemvm_prefetch.0 as i32,
                (true, GemvWeights::Fp8 { .. }) => self.gemvm_prefetch.1 as i32,
            },
            part: self.gemvm_part,
            m: mats,
            side: side as i32,
            early: (shape_rows == 1
                && norm.is_none()
                && !side
                && !mma
                && !smem_mma
                && weight_bytes <= self.gemv_early) as i32,
        };
        let (suffix, warps) = if mma {
            ("", GEMVM_WARPS)
        } else {
            (suffix, GEMV_WARPS)
        };
        let kernel = if norm.is_some() {
            format!("{prefix}_norm_r{shape_rows}{suffix}")
        } else {
            format!("{prefix}_r{shape_rows}{suffix}")
        };
        let label = format!(
            "{label} {}`{}`{}",
            if norm.is_some() { "rms_norm + " } else { "" },
            names.join("` + `"),
            if glu.is_some() { " + mul" } else { "" }
        );
        let func = self.kernels.typed(&kernel, t)?;
        let threads = 32 * warps as u32;
        // (The occupancy of a staged launch counts its shared memory, which must be allowed
        // first.)
        if cores_staged {
            self.allow_smem(&label, func, cores_smem as u32)?;
        }
        // Several rows of 16-bit weights with a fused norm (always), or without one with
        // `gemv_tiles` (opt-in until measured): as many blocks as are resident, each taking
        // tiles in turn, so the norm's prologue (its rows' sums of squares, read from L2, and
        // the staged rows) runs once per block rather than once per tile (kernels/gemv.cu,
        // `gemv_impl`). A tile computes the same whichever block runs it.
        let grid_blocks = if mma {
            mma_grid as u32
        } else if cores_staged {
            let resident = func
                .occupancy_max_active_blocks_per_multiprocessor(threads, cores_smem, None)
                .unwrap_or(1)
                .max(1) as u32
                * self.sms.max(1) as u32;
            total_blocks.min(resident)
        } else if self.gemv_tiles
            && !smem_mma
            && shape_rows > 1
            && first.weights == GemvWeights::Plain
        {
            let resident = func
                .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
                .unwrap_or(1)
                .max(1) as u32
                * self.sms.max(1) as u32;
            total_blocks.min(resident)
        } else {
            total_blocks
        };
        let grid = (grid_blocks, 1, 1);
        cmds.push(if mma && mma_smem > 0 {
            self.kernel_smem(&label, func, grid, threads, mma_smem as u32, &p)?
        } else if smem_mma {
            self.kernel_smem(&label, func, grid, threads, gemvs_smem(shape_rows), &p)?
        } else if cores_staged {
            self.kernel_smem(&label, func, grid, threads, cores_smem as u32, &p)?
        } else {
            self.kernel(&label, func, grid, threads, &p)
        });
        Ok(Some(
            norm.is_some() as usize + group.len() + glu.is_some() as usize,
        ))
    }

    /// Features per block and entry-point suffix for a `gemv` launch over matrices with
    /// `widths` outputs (`glu`: one gate/up pair width). More rows use their default; one row
    /// takes the largest of 8 / 4 / 2 whose blocks fill the resident slots (SMs x blocks per
    /// SM, from the occupancy calculator) in waves at least 85 % full, else the fullest.
    pub(super) fn gemv_shape(
        &self,
        rows: usize,
        widths: &[usize],
        glu: bool,
        norm: bool,
        weights: GemvWeights,
    ) -> Result<(usize, &'static str)> {
        let fp8 = weights != GemvWeights::Plain;
        if rows != 1 {
            return Ok((gemv_feats(rows, fp8), ""));
        }
        self.gemv_r1_shape(weights.kernel().0, 0, widths, glu, norm)
    }

    /// [`Builder::gemv_shape`] for `gemv16s_*`: 8 outputs a block at any row count (an MMA's 8
    /// columns; the partial sums do not grow with the rows), and at one row the same choice of
    /// 8 / 4 / 2 (every choice sums each output alike).
    fn gemvs_shape(
        &self,
        rows: usize,
        widths: &[usize],
        glu: bool,
        norm: bool,
    ) -> Result<(usize, &'static str)> {
        if rows != 1 {
            return Ok((8, ""));
        }
        self.gemv_r1_shape("gemv16s", gemvs_smem(1), widths, glu, norm)
    }

    /// One row: the largest of 8 / 4 / 2 outputs a block (`{prefix}_[norm_]r1[f4|f2]`, with
    /// `smem` bytes of dynamic shared memory) whose blocks fill the resident slots (SMs x
    /// blocks per SM, from the occupancy calculator) in waves at least 85 % full, else the
    /// fullest.
    fn gemv_r1_shape(
        &self,
        prefix: &str,
        smem: u32,
        widths: &[usize],
        glu: bool,
        norm: bool,
    ) -> Result<(usize, &'static str)> {
        let t = self.target();
        let mut best = (0.0, 8, "");
        for (feats, suffix) in [(8, ""), (4, "f4"), (2, "f2")] {
            let name = format!("{prefix}_{}r1{suffix}", if norm { "norm_" } else { "" });
            let func = self.kernels.typed(&name, t)?;
            let per_block = if glu { feats / 2 } else { feats };
            let blocks: usize = widths.iter().map(|w| w.div_ceil(per_block)).sum();
            let resident = func
                .occupancy_max_active_blocks_per_multiprocessor(
                    32 * GEMV_WARPS as u32,
                    smem as usize,
                    None,
                )
                .unwrap_or(1)
                .max(1) as usize
                * self.sms.max(1);
            let waves = blocks as f64 / resident as f64;
            let fill = waves / waves.ceil();
            if fill >= 0.85 {
                return Ok((feats, suffix));
            }
            if fill > best.0 {
                best = (fill, feats, suffix);
            }
        }
        Ok((best.1, best.2))
    }

    /// `ops[0]` as a fusable RmsNorm ([`Builder::row_norm`]) read by the `Linear` at `ops[1]`.
    pub(super) fn gemv_norm(&self, ops: &[Op], rows: usize) -> Option<GemvNorm> {
        let [norm @ Op::RmsNorm { out, .. }, Op::Linear { x: lx, .. }, ..] = ops else {
            return None;
        };
        if lx != out {
            return None;
        }
        self.row_norm(norm, rows)
    }

    /// The address of an RMSNorm weight a fused kernel reads in 16-byte packs: f32, `group`
    /// elements, 16-byte aligned (0 for no weight); `None` where it is not such a weight.
    pub(super) fn norm_weight(&self, weight: Option<BufferId>, group: usize) -> Option<u64> {
        let Some(w) = weight else {
            return Some(0);
        };
        let b = self.buf(w);
        (b.dtype == DType::F32 && b.numel() == group && self.addr(w).is_multiple_of(16))
            .then(|| self.addr(w))
    }

    /// `op` as an RmsNorm a kernel can fuse into its prologue: over whole 16-byte-aligned rows
    /// (`group == width`) of the target dtype, with an f32 weight (or none).
    pub(super) fn row_norm(&self, op: &Op, rows: usize) -> Option<GemvNorm> {
        let Op::RmsNorm {
            x,
            weight,
            weight_kind,
            out,
            eps,
            group,
        } = op
        else {
            return None;
        };
        let t = self.target();
        let (xp, ld_x, xd) = self.view(x, rows, "", "").ok()?;
        let (op_, ld_o, od) = self.view(out, rows, "", "").ok()?;
        let w = self.norm_weight(*weight, *group)?;
        let fits = *group == x.width
            && x.width == out.width
            && xd == t
            && od == t
            && x.width % 8 == 0
            && ld_x % 8 == 0
            && xp % 16 == 0;
        fits.then_some(GemvNorm {
            x: xp,
            ld_x,
            w,
            one_plus: weight.is_some() && *weight_kind == NormWeight::OnePlus,
            out: op_,
            ld_out: ld_o,
            eps: eps.get() as f32,
        })
    }
}
