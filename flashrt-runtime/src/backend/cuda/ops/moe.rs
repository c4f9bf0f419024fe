//! `Op::Moe` -> the launches of kernels/moe.cu (router logits, routing and planning, the
//! experts' projections, the combine).

use super::*;
use flashrt_ir::{ExpertAct, RouteIr, RouterScore};

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
    pad: i32,
}

/// kernels/moe.cu limits.
const MOE_MAX_E: usize = 1024;
const MOE_MAX_H: usize = 8192;
const MOE_MAX_K: usize = 32;
const MOE_TILE: usize = 8;
const MOE_MM_M: usize = 64;
const MOE_MM_N: usize = 64;
const MOE_MM_K: usize = 64;

/// Dynamic shared memory of a grouped-mma block with `groups` B row groups: two cp.async
/// stages of A (MOE_MM_M rows) and B (groups x MOE_MM_N rows) at MOE_MM_K + 8 columns, reused
/// for the f32 result tile.
fn mm_smem(groups: usize, t: DType) -> u32 {
    let stages = 2 * (MOE_MM_M + groups * MOE_MM_N) * (MOE_MM_K + 8) * t.size();
    let result = groups * MOE_MM_N * MOE_MM_M * 4;
    stages.max(result) as u32
}

impl Builder<'_> {
    /// The launches of an `Op::Moe` (kernels/moe.cu): router logits, route (+ plan in small
    /// phases), then for prefill plans the tile list and the grouped tensor-core GEMMs and the
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
        let mm = rows > 8 && matches!(t, DType::Bf16 | DType::F16);
        // Decode and verify: routing and planning in one block, down and combine in one launch.
        let small = rows <= 8 && e <= 256;
        let max_tiles = ceil_div(rows * k, MOE_MM_M) as usize + e.min(rows * k);
        let plan_bytes = 4 * (2 * e + 2 + rows * k + 1 + 2 * max_tiles);
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
            pad: 0,
        };
        let active = e.min(rows * k) as u32;
        let rr = rows as u32;
        cmds.push(self.kernel_smem(
            &format!("{label} router"),
            self.kernels.typed("moe_logits", t)?,
            (ceil_div(e, 4), ceil_div(rows, 8), 1),
            128,
            (8 * h * t.size()) as u32,
            &p,
        )?);
        cmds.push(self.kernel_smem(
            &format!("{label} route"),
            self.kernels.typed("moe_route", t)?,
            (ceil_div(rows, 8), 1, 1),
            256,
            (8 * 2 * e * 4) as u32,
            &p,
        )?);
        if !small {
            cmds.push(self.kernel(
                &format!("{label} plan"),
                self.kernels.typed("moe_plan", t)?,
                (1, 1, 1),
                1024,
                &p,
            ));
        }
        if mm {
            cmds.push(self.kernel(
                &format!("{label} tiles"),
                self.kernels.typed("moe_tiles", t)?,
                (1, 1, 1),
                1024,
                &p,
            ));
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
        } else {
            cmds.push(self.kernel_smem(
                &format!("{label} up"),
                self.kernels.typed("moe_up", t)?,
                (ceil_div(i, 8), active, 1),
                256,
                (MOE_TILE * h * t.size()) as u32,
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
        cmds.push(self.kernel(
            &format!("{label} combine"),
            self.kernels.typed("moe_combine", t)?,
            (ceil_div(h, 256), rr, 1),
            256,
            &p,
        ));
        Ok(())
    }
}
