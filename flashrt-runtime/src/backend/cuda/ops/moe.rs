//! `Op::Moe` -> the launches of kernels/moe.cu (router logits, routing and planning, the
//! experts' projections, the combine), moe_small.cu (small phases) and moe_wgmma.cu (prefill
//! GEMMs).

use super::*;
use flashrt_ir::{ExpertAct, RouteIr, RouterScore};

/// A small phase's shared expert (the ops the lowering writes after an `Op::Moe`), fused
/// into the block's launches ([`Builder::moe_small`]).
#[derive(Clone, Copy)]
pub(super) struct SharedExpert {
    /// Token gate weight `[1, hidden]` and its output view (address, row stride), if gated.
    gate: Option<(u64, u64, i32)>,
    /// Gate rows (SwiGLU) or up rows `[inter, hidden]`; SwiGLU's up rows (else 0).
    up: u64,
    up2: u64,
    /// `[hidden, inter]`.
    down: u64,
    /// The activation view (address, row stride).
    h: (u64, i32),
    inter: usize,
    /// Plan ops it replaces.
    ops: usize,
}

/// The operands of one `Op::Moe`.
pub(super) struct MoeOp<'a> {
    pub(super) x: &'a View,
    pub(super) router: BufferId,
    pub(super) bias: Option<BufferId>,
    pub(super) up: BufferId,
    pub(super) down: BufferId,
    pub(super) out: &'a View,
    pub(super) tmp: &'a View,
    pub(super) route: &'a RouteIr,
    pub(super) inter: usize,
    pub(super) act: ExpertAct,
    /// Small phases: the RMSNorm before the block and the shared expert after it, fused.
    pub(super) norm: Option<GemvNorm>,
    pub(super) shared: Option<SharedExpert>,
    /// Small phases: the next matmul's weights the up launch asks of the L2 (address, bytes).
    pub(super) next: (u64, u64),
}

/// kernels/moe.cu `MoeParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeParams {
    x: u64,
    router: u64,
    bias: u64,
    up: u64,
    down: u64,
    out: u64,
    tmp: u64,
    plan: u64,
    len: u64,
    ld_x: i32,
    ld_out: i32,
    ld_tmp: i32,
    hidden: i32,
    inter: i32,
    experts: i32,
    top_k: i32,
    softmax: i32,
    renormalize: i32,
    renorm_eps: f32,
    scaling: f32,
    groups: i32,
    top_groups: i32,
    swiglu: i32,
    max_pairs: i32,
    small: i32,
    tile_m: i32,
    norm_x: u64,
    norm_w: u64,
    s_gate: u64,
    s_gate_out: u64,
    s_up: u64,
    s_up2: u64,
    s_down: u64,
    s_h: u64,
    ld_norm_x: i32,
    one_plus: i32,
    eps: f32,
    ld_s_gate_out: i32,
    ld_s_h: i32,
    s_inter: i32,
    shared: i32,
    pad2: i32,
    /// One-row routed up launches: the next matmul's weights to ask of the L2 before the PDL
    /// wait (`CudaOptions::moe_prefetch`; 0, 0: none).
    next_w: u64,
    next_bytes: u64,
}

/// kernels/moe.cu limits.
const MOE_MAX_E: usize = 1024;
const MOE_MAX_H: usize = 8192;
const MOE_MAX_K: usize = 32;
const MOE_TILE: usize = 8;
const MOE_MM_M: usize = 64;
const MOE_MM_N: usize = 64;
const MOE_MM_K: usize = 64;
const MOE_HIST_PAIRS: usize = 1024;
/// kernels/moe_small.cu `moe_up_routed*`: the most dynamic shared memory (rows of x and
/// routing scratch) the routed up launch takes; wider blocks (f32 rows of 8k hidden) route in
/// `moe_route` instead. Leaves room under the 227 KiB opt-in for the kernel's ~7 KiB of
/// static plan arrays.
const MOE_ROUTED_MAX_SMEM: usize = 160 * 1024;
/// kernels/moe_wgmma.cu `MOE_WG_SMEM`: 4 stages of a 64-row A slab and a 128-row B slab
/// (128-byte rows), plus 1 KiB of alignment slack.
fn moe_wg_smem(stages: u32) -> u32 {
    stages * (64 + 128) * 128 + 1024
}
/// kernels/moe_wgmma.cu `MOE_W2_M`, `MOE_W2_N`, `MOE_W2_SMEM`: wide tiles of 128 pairs and 256
/// weight rows, 4 stages of their 128-byte slabs plus 1 KiB of alignment slack.
const MOE_W2_M: usize = 128;
const MOE_W2_N: usize = 256;
const MOE_W2_SMEM: u32 = (4 * (MOE_W2_M + MOE_W2_N) * 128 + 1024) as u32;

/// Dynamic shared memory of a grouped-mma block with `groups` B row groups: two cp.async
/// stages of A (MOE_MM_M rows) and B (groups x MOE_MM_N rows) at MOE_MM_K + 8 columns, reused
/// for the f32 result tile.
fn mm_smem(groups: usize, t: DType) -> u32 {
    let stages = 2 * (MOE_MM_M + groups * MOE_MM_N) * (MOE_MM_K + 8) * t.size();
    let result = groups * MOE_MM_N * MOE_MM_M * 4;
    stages.max(result) as u32
}

fn mm16(t: DType) -> bool {
    matches!(t, DType::Bf16 | DType::F16)
}

impl Builder<'_> {
    /// Small 16-bit phases: the `Op::Moe` at `ops[0]` (or `ops[1]` after the RMSNorm that
    /// produces its input) with the shared-expert ops the lowering writes after it, as three
    /// launches: norm + router + token gate, route + plan + the experts' up projections with
    /// the shared expert as one more (`moe_up_routed*`; four launches with a separate
    /// `moe_route` where `CudaOptions::moe_route_in_up` is off or x does not fit in shared
    /// memory), and down + combine with the shared down projection.
    /// Returns the ops consumed, `None` where the head is not such a block (the ops then run
    /// one by one).
    pub(super) fn moe_small(
        &self,
        ops: &[Op],
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<Option<usize>> {
        let t = self.target();
        if !self.gemv || rows > 8 || !mm16(t) {
            return Ok(None);
        }
        let (norm, at) = match ops {
            [n @ Op::RmsNorm { out, .. }, Op::Moe { x, .. }, ..] if out == x => {
                match self.row_norm(n, rows) {
                    Some(g) => (Some(g), 1),
                    None => return Ok(None),
                }
            }
            [Op::Moe { .. }, ..] => (None, 0),
            _ => return Ok(None),
        };
        let Op::Moe {
            x,
            router,
            bias,
            up,
            down,
            out,
            tmp,
            route,
            inter,
            act,
        } = &ops[at]
        else {
            return Ok(None);
        };
        if route.experts > 256 {
            return Ok(None);
        }
        let shared = self.shared_expert(&ops[at + 1..], x, out, *act, rows);
        let used = at + 1 + shared.map_or(0, |s| s.ops);
        let next = match self.moe_prefetch {
            0 => (0, 0),
            cap => self.next_linear_weights(&ops[used - 1..], |b| b.min(cap)),
        };
        let m = MoeOp {
            x,
            router: *router,
            bias: *bias,
            up: *up,
            down: *down,
            out,
            tmp,
            route,
            inter: *inter,
            act: *act,
            norm,
            shared,
            next,
        };
        self.moe(m, rows, label, cmds)?;
        Ok(Some(used))
    }

    /// The shared expert the lowering writes after an MoE block reading `hn` and adding to
    /// `out`: [gate Linear, up Linear, Mul(silu)] (SwiGLU) or [up Linear, Unary(relu2)], then
    /// optionally [token-gate Linear to width 1, Mul(sigmoid)], then the down Linear
    /// accumulating into `out`. `None` unless `ops` starts with exactly that, with weights
    /// and views the fused kernels take.
    fn shared_expert(
        &self,
        ops: &[Op],
        hn: &View,
        out: &View,
        act: ExpertAct,
        rows: usize,
    ) -> Option<SharedExpert> {
        let t = self.target();
        let h = hn.width;
        // A bias-free Linear from `src` (width `k`) to a width-`n` view: (weight, out view).
        let lin = |op: &Op, src: &View, n: Option<usize>, acc: bool| -> Option<(u64, View)> {
            let Op::Linear {
                x,
                w,
                bias: None,
                out,
                accumulate,
            } = op
            else {
                return None;
            };
            let b = self.buf(*w);
            let fits = x == src
                && *accumulate == acc
                && n.is_none_or(|n| out.width == n)
                && b.dtype == t
                && b.shape == [out.width, x.width]
                && self.addr(*w).is_multiple_of(16);
            fits.then_some((self.addr(*w), *out))
        };
        let mut i = 0;
        let next = |i: &mut usize| {
            let op = ops.get(*i);
            *i += 1;
            op
        };
        let (up, up2, hv) = match act {
            ExpertAct::Swiglu => {
                let (g, gv) = lin(next(&mut i)?, hn, None, false)?;
                let (u, uv) = lin(next(&mut i)?, hn, Some(gv.width), false)?;
                let Op::Mul {
                    gate,
                    act: Act::Silu,
                    x,
                    out,
                } = next(&mut i)?
                else {
                    return None;
                };
                (*gate == gv && *x == uv && *out == uv).then_some((g, u, uv))?
            }
            ExpertAct::Relu2 => {
                let (u, uv) = lin(next(&mut i)?, hn, None, false)?;
                let Op::Unary {
                    x,
                    act: Act::Relu2,
                    out,
                } = next(&mut i)?
                else {
                    return None;
                };
                (*x == uv && *out == uv).then_some((u, 0, uv))?
            }
        };
        let si = hv.width;
        let mut gate = None;
        if let Some((tw, tv)) = ops.get(i).and_then(|op| lin(op, hn, Some(1), false)) {
            let Some(Op::Mul {
                gate: g,
                act: Act::Sigmoid,
                x,
                out,
            }) = ops.get(i + 1)
            else {
                return None;
            };
            if *g != tv || *x != hv || *out != hv {
                return None;
            }
            let (tp, ld_t, td) = self.view(&tv, rows, "", "").ok()?;
            if td != t {
                return None;
            }
            gate = Some((tw, tp, ld_t));
            i += 2;
        }
        let (d, dv) = lin(ops.get(i)?, &hv, Some(h), true)?;
        if dv != *out {
            return None;
        }
        let (hp, ld_h, hd) = self.view(&hv, rows, "", "").ok()?;
        let pack = 16 / t.size();
        let fits = hd == t
            && si.is_multiple_of(pack)
            && (ld_h as usize).is_multiple_of(pack)
            && hp.is_multiple_of(16);
        fits.then_some(SharedExpert {
            gate,
            up,
            up2,
            down: d,
            h: (hp, ld_h),
            inter: si,
            ops: i + 1,
        })
    }

    /// The launches of an `Op::Moe` (kernels/moe.cu): router logits, route (+ plan in small
    /// phases, or both inside the up launch, `moe_up_routed*`; else the plan and the tile list
    /// over many blocks, `moe_hist` + `moe_plan2`),
    /// then for prefill plans the grouped tensor-core GEMMs (kernels/moe_wgmma.cu) and the
    /// combine, for decode and verify the CUDA-core up and a fused down + combine.
    pub(super) fn moe(
        &self,
        m: MoeOp,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let t = self.target();
        let (xp, ld_x, xd) = self.view(m.x, rows, label, "x")?;
        let (op_, ld_o, od) = self.view(m.out, rows, label, "out")?;
        let (tp, ld_t, td) = self.view(m.tmp, rows, label, "tmp")?;
        let bad = |msg: String| Error::Config(format!("{label}: {msg}"));
        if [xd, od, td].iter().any(|&d| d != t) {
            return Err(bad(format!("activations must be {}", t.name())));
        }
        let r = m.route;
        let (e, k, h, i) = (r.experts, r.top_k, m.x.width, m.inter);
        let pack = 16 / t.size();
        if m.out.width != h
            || !h.is_multiple_of(pack)
            || !i.is_multiple_of(pack)
            || !h.is_multiple_of(4)
            || !(ld_t as usize).is_multiple_of(pack)
        {
            return Err(bad(format!(
                "hidden {h} / expert width {i} must be multiples of {pack}, with aligned rows"
            )));
        }
        if e > MOE_MAX_E || h > MOE_MAX_H || k == 0 || k > MOE_MAX_K.min(e) {
            return Err(Error::Unsupported(format!(
                "{label}: {e} experts, top {k}, hidden {h} (the kernels take up to {MOE_MAX_E} \
                 experts, top {MOE_MAX_K}, hidden {MOE_MAX_H})"
            )));
        }
        if r.groups > 32 || r.groups == 0 || e % r.groups != 0 {
            return Err(Error::Unsupported(format!(
                "{label}: {} expert groups",
                r.groups
            )));
        }
        let need = (k * (i + h)) * t.size() + 8 * k + 4 * e;
        if m.tmp.width * t.size() < need || tp % 16 != 0 || xp % 16 != 0 {
            return Err(bad(format!(
                "scratch `tmp` narrower than {need} bytes or unaligned"
            )));
        }
        // Prefill plans run the experts as tensor-core grouped GEMMs over tiles of pairs.
        let mm = rows > 8 && mm16(t);
        // Decode and verify: routing and planning in one block, down and combine in one launch.
        let small = rows <= 8 && e <= 256;
        let sh = m.shared;
        if (m.norm.is_some() || sh.is_some()) && !(small && mm16(t)) {
            return Err(bad(
                "fused norm / shared expert outside a small 16-bit phase".into(),
            ));
        }
        let wide = mm && self.moe_wgmma && self.moe_wide;
        let tile_m = if wide { MOE_W2_M } else { MOE_MM_M };
        let max_tiles = ceil_div(rows * k, tile_m) as usize + e.min(rows * k);
        // kernels/moe.cu `moe_hist`: one row of E counts per MOE_HIST_PAIRS pairs.
        let hist_blocks = (rows * k).div_ceil(MOE_HIST_PAIRS);
        let plan_bytes = 4 * (2 * e + 2 + rows * k + 1 + 2 * max_tiles + hist_blocks * e);
        if plan_bytes > gemm::WORKSPACE_BYTES {
            return Err(bad(format!(
                "routing plan of {plan_bytes} bytes > workspace"
            )));
        }
        self.expect_dtype(m.router, DType::F32, label)?;
        self.expect_numel(m.router, e * h, label)?;
        if let Some(b) = m.bias {
            self.expect_dtype(b, DType::F32, label)?;
            self.expect_numel(b, e, label)?;
        }
        let up_rows = m.act.up_rows() * i;
        for (w, n) in [(m.up, e * up_rows * h), (m.down, e * h * i)] {
            self.expect_dtype(w, t, label)?;
            self.expect_numel(w, n, label)?;
            if !self.addr(w).is_multiple_of(16) {
                return Err(bad(format!(
                    "weight `{}` is not 16-byte aligned",
                    self.buf(w).name
                )));
            }
        }
        let p = MoeParams {
            x: xp,
            router: self.addr(m.router),
            bias: m.bias.map_or(0, |b| self.addr(b)),
            up: self.addr(m.up),
            down: self.addr(m.down),
            out: op_,
            tmp: tp,
            plan: self.workspace,
            len: self.addr(self.compiled.io.len),
            ld_x,
            ld_out: ld_o,
            ld_tmp: ld_t,
            hidden: to_i32(h, "hidden", label)?,
            inter: to_i32(i, "inter", label)?,
            experts: e as i32,
            top_k: k as i32,
            softmax: (r.score == RouterScore::Softmax) as i32,
            renormalize: r.renormalize as i32,
            renorm_eps: r.renorm_eps.get() as f32,
            scaling: r.scaling.get() as f32,
            groups: r.groups as i32,
            top_groups: r.top_groups as i32,
            swiglu: (m.act == ExpertAct::Swiglu) as i32,
            max_pairs: (rows * k) as i32,
            small: small as i32,
            tile_m: tile_m as i32,
            norm_x: m.norm.map_or(0, |n| n.x),
            norm_w: m.norm.map_or(0, |n| n.w),
            s_gate: sh.and_then(|s| s.gate).map_or(0, |g| g.0),
            s_gate_out: sh.and_then(|s| s.gate).map_or(0, |g| g.1),
            s_up: sh.map_or(0, |s| s.up),
            s_up2: sh.map_or(0, |s| s.up2),
            s_down: sh.map_or(0, |s| s.down),
            s_h: sh.map_or(0, |s| s.h.0),
            ld_norm_x: m.norm.map_or(0, |n| n.ld_x),
            one_plus: m.norm.is_some_and(|n| n.one_plus) as i32,
            eps: m.norm.map_or(0.0, |n| n.eps),
            ld_s_gate_out: sh.and_then(|s| s.gate).map_or(0, |g| g.2),
            ld_s_h: sh.map_or(0, |s| s.h.1),
            s_inter: sh.map_or(0, |s| s.inter as i32),
            shared: sh.is_some() as i32,
            pad2: 0,
            next_w: m.next.0,
            next_bytes: m.next.1,
        };
        let active = e.min(rows * k) as u32;
        let rr = rows as u32;
        // Prefill routers run on the TF32 tensor cores (cuBLASLt): x widened to f32 in each
        // row's `y` scratch, logits straight into the rows' logit slots. bf16/f16 inputs and
        // router weights stored from a 16-bit checkpoint are exact in TF32, so only the sum
        // order differs from the CUDA-core kernel (which f32 targets and small phases keep).
        let ld_f32 = ld_t as usize * t.size() / 4;
        if mm && k * t.size() >= 4 && (ld_t as usize * t.size()).is_multiple_of(4) {
            cmds.push(self.kernel(
                &format!("{label} router input (f32)"),
                self.kernels.typed("moe_x_f32", t)?,
                (ceil_div(h, 1024), rr, 1),
                256,
                &p,
            ));
            let row_bytes = |cols: usize| (cols * t.size()) as u64;
            let xf = tp + row_bytes(k * i);
            let logits = tp + row_bytes(k * (i + h)) + 8 * k as u64;
            let router = self.addr(m.router);
            let shape = GemmShape {
                in_dtype: DType::F32,
                out_dtype: DType::F32,
                n: e as u64,
                k: h as u64,
                rows: rows as u64,
                ld_x: ld_f32 as i64,
                ld_out: ld_f32 as i64,
                align_w: gemm::alignment(router),
                align_x: gemm::alignment(xf),
                align_out: gemm::alignment(logits),
                tf32: true,
            };
            cmds.push(Cmd::Gemm(GemmCmd {
                label: format!("{label} router (tf32 matmul)"),
                gemm: self.blas.gemm(shape)?,
                w: router,
                x: xf,
                out: logits,
                accumulate: false,
            }));
        } else {
            let gate = sh.is_some_and(|s| s.gate.is_some()) as usize;
            cmds.push(self.kernel_smem(
                &format!("{label} router"),
                self.kernels.typed("moe_logits", t)?,
                (ceil_div(e + gate, 4), ceil_div(rows, 8), 1),
                128,
                (8 * h * t.size()) as u32,
                &p,
            )?);
        }
        // Small phases: the up launch routes and plans itself where its rows of x and routing
        // scratch fit in shared memory.
        let routed_smem = rows * (h * t.size() + 2 * e * 4);
        let routed = small && self.moe_route_in_up && routed_smem <= MOE_ROUTED_MAX_SMEM;
        if !routed {
            cmds.push(self.kernel_smem(
                &format!("{label} route"),
                self.kernels.typed("moe_route", t)?,
                (ceil_div(rows, 8), 1, 1),
                256,
                (8 * 2 * e * 4) as u32,
                &p,
            )?);
        }
        if !small {
            cmds.push(self.kernel(
                &format!("{label} plan (counts)"),
                self.kernels.typed("moe_hist", t)?,
                (hist_blocks as u32, 1, 1),
                256,
                &p,
            ));
            cmds.push(self.kernel(
                &format!("{label} plan"),
                self.kernels.typed("moe_plan2", t)?,
                (hist_blocks as u32, 1, 1),
                1024,
                &p,
            ));
        }
        if mm {
            if wide {
                // kernels/moe_wgmma.cu `moe_*_w2`: persistent blocks (one an SM) over work
                // items (pair tile, 128 features' gate and up rows or 256 rows).
                let per = if m.act == ExpertAct::Swiglu {
                    MOE_W2_N / 2
                } else {
                    MOE_W2_N
                };
                let blocks = |nf: usize| (nf * max_tiles).min(self.sms.max(1)) as u32;
                cmds.push(self.kernel_smem(
                    &format!("{label} up (grouped wgmma, wide)"),
                    self.kernels.typed("moe_up_w2", t)?,
                    (blocks(i.div_ceil(per)), 1, 1),
                    256,
                    MOE_W2_SMEM,
                    &p,
                )?);
                cmds.push(self.kernel_smem(
                    &format!("{label} down (grouped wgmma, wide)"),
                    self.kernels.typed("moe_down_w2", t)?,
                    (blocks(h.div_ceil(MOE_W2_N)), 1, 1),
                    256,
                    MOE_W2_SMEM,
                    &p,
                )?);
            } else if self.moe_wgmma {
                // kernels/moe_wgmma.cu: 64 pairs x 128 B rows per block (SwiGLU: 64 features'
                // gate and up rows).
                let per = if m.act == ExpertAct::Swiglu { 64 } else { 128 };
                // Three stages: measured ahead of four (16k cold TTFT 345.7 vs 354.2 ms, H200,
                // benches/results/2026-12-02-h200-moe-wgmma) — three blocks fit an SM.
                let stages = 3;
                cmds.push(self.kernel_smem(
                    &format!("{label} up (grouped wgmma)"),
                    self.kernels.typed("moe_up_wg", t)?,
                    (ceil_div(i, per), max_tiles as u32, 1),
                    128,
                    moe_wg_smem(stages),
                    &p,
                )?);
                cmds.push(self.kernel_smem(
                    &format!("{label} down (grouped wgmma)"),
                    self.kernels.typed("moe_down_wg", t)?,
                    (ceil_div(h, 128), max_tiles as u32, 1),
                    128,
                    moe_wg_smem(stages),
                    &p,
                )?);
            } else {
                cmds.push(self.kernel_smem(
                    &format!("{label} up (grouped mma)"),
                    self.kernels.typed("moe_up_mm", t)?,
                    (ceil_div(i, MOE_MM_N), max_tiles as u32, 1),
                    128,
                    mm_smem(m.act.up_rows(), t),
                    &p,
                )?);
                cmds.push(self.kernel_smem(
                    &format!("{label} down (grouped mma)"),
                    self.kernels.typed("moe_down_mm", t)?,
                    (ceil_div(h, MOE_MM_N), max_tiles as u32, 1),
                    128,
                    mm_smem(1, t),
                    &p,
                )?);
            }
        } else {
            let feats = sh.map_or(i, |s| s.inter.max(i));
            let ys = active + sh.is_some() as u32;
            let mut xs = ceil_div(feats, 8);
            let (name, smem) = if routed {
                let name = if rows == 1 {
                    "moe_up_routed1"
                } else {
                    "moe_up_routed_tiles"
                };
                (name, routed_smem as u32)
            } else {
                ("moe_up", (MOE_TILE * h * t.size()) as u32)
            };
            let func = self.kernels.typed(name, t)?;
            // One-row routed launches: 128-thread blocks (5 resident an SM with the kernel's
            // 96 registers, where 256-thread ones fit 2: 35B-A3B's 512 features get 2 a warp,
            // not 2 or 3).
            let threads = if routed && rows == 1 { 128 } else { 256 };
            if routed {
                // As many blocks as are resident (the warps stride over the features): every
                // block routes once, none waits for a second wave. Then as few columns as
                // give each warp the same number of features at most.
                self.allow_smem(label, func, smem)?;
                let resident = func
                    .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
                    .unwrap_or(1)
                    .max(1)
                    * self.sms.max(1) as u32;
                let warps = (threads / 32) as usize;
                let most = (resident / ys).max(1).min(ceil_div(feats, warps)) as usize;
                let rounds = feats.div_ceil(most * warps);
                xs = ceil_div(feats, warps * rounds);
            }
            cmds.push(self.kernel_smem(
                &format!("{label} up"),
                func,
                (xs, ys, 1),
                threads,
                smem,
                &p,
            )?);
            if small {
                cmds.push(self.kernel(
                    &format!("{label} down + combine"),
                    self.kernels.typed("moe_down_small", t)?,
                    (ceil_div(h, 8), 1, 1),
                    256,
                    &p,
                ));
                return Ok(());
            }
            cmds.push(self.kernel_smem(
                &format!("{label} down"),
                self.kernels.typed("moe_down", t)?,
                (ceil_div(h, 8), active, 1),
                256,
                (MOE_TILE * i * t.size()) as u32,
                &p,
            )?);
        }
        // 16-byte packs where every row of `out` is 16-byte aligned (the same sums per column).
        let packed = op_.is_multiple_of(16) && (ld_o as usize).is_multiple_of(pack);
        let (name, per) = if packed {
            ("moe_combine16", 256 * pack)
        } else {
            ("moe_combine", 256)
        };
        cmds.push(self.kernel(
            &format!("{label} combine"),
            self.kernels.typed(name, t)?,
            (ceil_div(h, per), rr, 1),
            256,
            &p,
        ));
        Ok(())
    }
}
