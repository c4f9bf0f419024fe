//! Row norms (plan ops `RmsNorm` and `GatedRmsNorm`, kernels/norm.cu): the scalar kernel over
//! (groups, rows) blocks or the 16-byte-pack kernels where the shapes allow.

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct RmsNormParams {
    x: u64,
    out: u64,
    weight: u64,
    len: u64,
    ld_x: i32,
    ld_out: i32,
    group: i32,
    one_plus: i32,
    eps: f32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct GatedRmsNormParams {
    pub(super) x: u64,
    pub(super) gate: u64,
    pub(super) out: u64,
    pub(super) weight: u64,
    pub(super) len: u64,
    pub(super) ld_x: i32,
    pub(super) ld_gate: i32,
    pub(super) ld_out: i32,
    pub(super) group: i32,
    pub(super) shared_weight: i32,
    pub(super) gate_then_norm: i32,
    pub(super) eps: f32,
}

/// kernels/norm.cu: packs per thread and the vector kernels' block bound; blocks of several
/// small groups have `NORM_VEC_BLOCK` threads.
const NORM_VPT: usize = 4;
const NORM_VEC_THREADS: usize = 512;
const NORM_VEC_BLOCK: usize = 128;

/// The parameters of a vector norm (`rms_norm_vec`, `gated_rms_norm_vec`): the scalar
/// kernel's struct plus the thread layout (mirrors kernels/norm.cu `RmsNormVecParams` /
/// `GatedRmsNormVecParams`).
#[repr(C)]
#[derive(Clone, Copy)]
struct NormVecParams<P> {
    n: P,
    tpg: i32,
    groups: i32,
}

/// Threads per group of the vector norms (kernels/norm.cu) over groups of `group` elements of
/// `dtype`: NORM_VPT packs a thread at most, a power of two up to a warp, else whole warps.
/// `qk_prep` (kernels/norm_qk.cu) owns a head with as many, so its sums are the norm's.
pub(super) fn norm_vec_tpg(group: usize, dtype: DType) -> usize {
    let per = (group / (16 / dtype.size())).div_ceil(NORM_VPT);
    if per <= 32 {
        per.next_power_of_two()
    } else {
        per.next_multiple_of(32)
    }
}

/// Threads for a block that normalises `n` elements: a power of two in 32..=1024, about four
/// elements per thread (the norm kernels keep up to 8 per thread in registers).
fn reduce_threads(n: usize) -> u32 {
    (n.div_ceil(4)).next_power_of_two().clamp(32, 1024) as u32
}

impl Builder<'_> {
    /// An RMS norm over groups of each row (the vector kernel where the shapes allow).
    pub(super) fn rms_norm(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::RmsNorm {
            x,
            weight,
            weight_kind,
            out,
            eps,
            group,
        } = op
        else {
            unreachable!("rms_norm builds only Op::RmsNorm")
        };
        let len = self.addr(self.compiled.io.len);
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        if xd != od || x.width != out.width || *group == 0 || x.width % group != 0 {
            return Err(Error::Config(format!(
                "{label}: x ({} x{}) / out ({} x{}) / group {group} mismatch",
                xd.name(),
                x.width,
                od.name(),
                out.width
            )));
        }
        let w = match weight {
            Some(w) => {
                self.expect_dtype(*w, DType::F32, label)?;
                self.expect_numel(*w, *group, label)?;
                self.addr(*w)
            }
            None => 0,
        };
        let p = RmsNormParams {
            x: xp,
            out: op_,
            weight: w,
            len,
            ld_x,
            ld_out: ld_o,
            group: to_i32(*group, "group", label)?,
            one_plus: (*weight_kind == NormWeight::OnePlus) as i32,
            eps: eps.get() as f32,
        };
        cmds.push(self.norm_cmd(
            label,
            "rms_norm",
            xd,
            &p,
            (rows, x.width, *group),
            &[xp, op_, w],
            &[ld_x, ld_o],
        )?);
        Ok(())
    }

    /// The gated RMS norm after a recurrence (`norm(x) * act(gate)` or the other order).
    pub(super) fn gated_rms_norm(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::GatedRmsNorm { x, group, .. } = op else {
            unreachable!("gated_rms_norm builds only Op::GatedRmsNorm")
        };

        let (p, xd) = self.gated_norm_params(op, rows, label)?;
        cmds.push(self.norm_cmd(
            label,
            "gated_rms_norm",
            xd,
            &p,
            (rows, x.width, *group),
            &[p.x, p.gate, p.out, p.weight],
            &[p.ld_x, p.ld_gate, p.ld_out],
        )?);
        Ok(())
    }

    /// The checked kernel parameters of an `Op::GatedRmsNorm` over `rows`, and its dtype.
    pub(super) fn gated_norm_params(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
    ) -> Result<(GatedRmsNormParams, DType)> {
        let Op::GatedRmsNorm {
            x,
            gate,
            weight,
            shared_weight,
            out,
            eps,
            group,
            order,
        } = op
        else {
            unreachable!("gated_norm_params takes only Op::GatedRmsNorm")
        };
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        let (gp, ld_g, gd) = self.view(gate, rows, label, "gate")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        if xd != gd
            || xd != od
            || gate.width != x.width
            || out.width != x.width
            || *group == 0
            || x.width % group != 0
        {
            return Err(Error::Config(format!("{label}: x/gate/out/group mismatch")));
        }
        self.expect_dtype(*weight, DType::F32, label)?;
        self.expect_numel(
            *weight,
            if *shared_weight { *group } else { x.width },
            label,
        )?;
        let p = GatedRmsNormParams {
            x: xp,
            gate: gp,
            out: op_,
            weight: self.addr(*weight),
            len: self.addr(self.compiled.io.len),
            ld_x,
            ld_gate: ld_g,
            ld_out: ld_o,
            group: to_i32(*group, "group", label)?,
            shared_weight: *shared_weight as i32,
            gate_then_norm: (*order == GateOrder::GateThenNorm) as i32,
            eps: eps.get() as f32,
        };
        Ok((p, xd))
    }

    /// The launch of a row norm (`kernel` = `rms_norm` or `gated_rms_norm`, parameters `p`)
    /// over `(rows, width, group)`: the 16-byte-pack kernel `<kernel>_vec` where the group,
    /// every row stride in `lds` and every address in `addrs` are whole packs and the group
    /// fits NORM_VEC_THREADS threads of NORM_VPT packs — `tpg` threads per group, a power of
    /// two up to a warp (several groups per block of NORM_VEC_BLOCK threads) or whole warps
    /// (one group per block) —, else the scalar kernel over (groups, rows) blocks.
    #[allow(clippy::too_many_arguments)]
    fn norm_cmd<P: Copy>(
        &self,
        label: &str,
        kernel: &str,
        dtype: DType,
        p: &P,
        (rows, width, group): (usize, usize, usize),
        addrs: &[u64],
        lds: &[i32],
    ) -> Result<Cmd> {
        let groups = width / group;
        let pack = 16 / dtype.size();
        let tpg = norm_vec_tpg(group, dtype);
        let vec = group.is_multiple_of(pack)
            && tpg <= NORM_VEC_THREADS
            && addrs.iter().all(|a| a.is_multiple_of(16))
            && lds.iter().all(|&ld| (ld as usize).is_multiple_of(pack));
        if !vec {
            return Ok(self.kernel(
                label,
                self.kernels.typed(kernel, dtype)?,
                (groups as u32, rows as u32, 1),
                reduce_threads(group),
                p,
            ));
        }
        let (blocks, threads) = if tpg > 32 {
            (rows * groups, tpg)
        } else {
            (
                (rows * groups * tpg).div_ceil(NORM_VEC_BLOCK),
                NORM_VEC_BLOCK,
            )
        };
        let q = NormVecParams {
            n: *p,
            tpg: tpg as i32,
            groups: to_i32(groups, "groups", label)?,
        };
        Ok(self.kernel(
            label,
            self.kernels.typed(&format!("{kernel}_vec"), dtype)?,
            (to_i32(blocks, "blocks", label)? as u32, 1, 1),
            threads as u32,
            &q,
        ))
    }
}
