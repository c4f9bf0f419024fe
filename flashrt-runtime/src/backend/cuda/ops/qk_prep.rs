//! An attention layer's per-head work as one launch (kernels/norm_qk.cu `qk_prep`): the
//! query / gate split, the q and k norms, the rotary embedding of both and the attention op's
//! cache write, which the plan writes as five or six launches of a few kilobytes each.

use super::norm::norm_vec_tpg;
use super::*;

/// kernels/norm_qk.cu: threads a block; the angles' shared array bounds rotary_dims / 2.
const QK_PREP_THREADS: usize = 128;
const QK_PREP_MAX_HALF: usize = 256;

#[repr(C)]
#[derive(Clone, Copy)]
struct QkPrepParams {
    src: u64,
    q: u64,
    gate: u64,
    k: u64,
    v: u64,
    cache_k: u64,
    cache_v: u64,
    q_w: u64,
    k_w: u64,
    pos: u64,
    len: u64,
    rows_pos: u64,
    slots: u64,
    theta: f64,
    ld_src: i32,
    ld_q: i32,
    ld_gate: i32,
    ld_k: i32,
    ld_v: i32,
    src_stride: i32,
    q_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    rotary_dims: i32,
    tpg: i32,
    one_plus_q: i32,
    one_plus_k: i32,
    eps_q: f32,
    eps_k: f32,
    max_seq: i32,
}

/// One of the two per-head norms: its weight's address (0: none), `1 + w` or `w`, eps.
fn head_norm(b: &Builder<'_>, op: &Op, x: &View, head_dim: usize) -> Option<(u64, i32, f32)> {
    let Op::RmsNorm {
        x: nx,
        weight,
        weight_kind,
        out,
        eps,
        group,
    } = op
    else {
        return None;
    };
    if nx != x || out != x || *group != head_dim {
        return None;
    }
    let w = b.norm_weight(*weight, head_dim)?;
    let one_plus = weight.is_some() && *weight_kind == NormWeight::OnePlus;
    Some((w, one_plus as i32, eps.get() as f32))
}

impl Builder<'_> {
    /// `[SplitHeads]`, `RmsNorm` q, `RmsNorm` k, `Rope` q, `Rope` k, `Attention` (what an
    /// attention layer with per-head norms and a rotary embedding lowers to, flashrt-ir
    /// `lower/attention.rs`) as `qk_prep` and the attention op without its cache write, where
    /// `CudaOptions::qk_prep` is on and the separate norms would take their vector kernel
    /// (every value the same, bit for bit: kernels/norm_qk.cu); with the output gate's `Mul`
    /// after it where that fuses ([`Builder::out_gate`]). Returns how many ops it took.
    /// `label_at(k)`: the label of `ops[k]` (the attention's launches keep theirs, so that
    /// profiles group them as before).
    pub(super) fn qk_prep(
        &self,
        ops: &[Op],
        rows: usize,
        shared: Option<usize>,
        label_at: &dyn Fn(usize) -> String,
        cmds: &mut Vec<Cmd>,
    ) -> Result<Option<usize>> {
        if !self.qk_prep {
            return Ok(None);
        }
        let label = &label_at(0);
        let (split, rest) = match ops {
            [Op::SplitHeads { x, heads, outs }, rest @ ..] if outs.len() == 2 => {
                (Some((x, *heads, outs[0], outs[1])), rest)
            }
            _ => (None, ops),
        };
        let [
            nq,
            nk,
            Op::Rope {
                x: rq,
                heads: hq,
                head_dim: dq,
                rotary_dims,
                theta,
            },
            Op::Rope {
                x: rk,
                heads: hk,
                head_dim: dk,
                rotary_dims: rdk,
                theta: thk,
            },
            att @ Op::Attention {
                q,
                k,
                v,
                cache_k,
                cache_v,
                q_heads,
                kv_heads,
                head_dim,
                ..
            },
            ..,
        ] = rest
        else {
            return Ok(None);
        };
        let hd = *head_dim;
        let t = self.target();
        let pack = 16 / t.size();
        let half = rotary_dims / 2;
        let shapes = rq == q
            && rk == k
            && (*hq, *hk, *dq, *dk) == (*q_heads, *kv_heads, hd, hd)
            && (rotary_dims, theta) == (rdk, thk)
            && q.width == q_heads * hd
            && k.width == kv_heads * hd
            && v.width == k.width
            && *rotary_dims <= hd
            && rotary_dims % 2 == 0
            && half.is_multiple_of(pack)
            && half <= QK_PREP_MAX_HALF
            && hd.is_multiple_of(pack)
            && split.is_none_or(|(x, heads, sq, sg)| {
                sq == *q && sg.width == q.width && heads == *q_heads && x.width == 2 * q.width
            });
        if !shapes {
            return Ok(None);
        }
        let (Some((q_w, one_plus_q, eps_q)), Some((k_w, one_plus_k, eps_k))) =
            (head_norm(self, nq, q, hd), head_norm(self, nk, k, hd))
        else {
            return Ok(None);
        };
        let tpg = norm_vec_tpg(hd, t);
        if tpg > 32 {
            return Ok(None);
        }
        let (src, ld_src, sd, src_stride) = match split {
            Some((x, ..)) => {
                let (a, ld, d) = self.view(x, rows, label, "x")?;
                (a, ld, d, 2 * hd)
            }
            None => {
                let (a, ld, d) = self.view(q, rows, label, "q")?;
                (a, ld, d, hd)
            }
        };
        let (qp, ld_q, qd) = self.view(q, rows, label, "q")?;
        let (gp, ld_gate, gd) = match split {
            Some((.., gate)) => self.view(&gate, rows, label, "gate")?,
            None => (0, 0, t),
        };
        let (kp, ld_k, kd) = self.view(k, rows, label, "k")?;
        let (vp, ld_v, vd) = self.view(v, rows, label, "v")?;
        let (ck, cv) = (self.addr(*cache_k), self.addr(*cache_v));
        let aligned = [sd, qd, gd, kd, vd].iter().all(|&d| d == t)
            && [src, qp, gp, kp, vp, ck, cv, q_w, k_w]
                .iter()
                .all(|a| a.is_multiple_of(16))
            && [ld_src, ld_q, ld_gate, ld_k, ld_v]
                .iter()
                .all(|&ld| (ld as usize).is_multiple_of(pack));
        if !aligned {
            return Ok(None);
        }
        let max_seq = self.compiled.layout.max_seq;
        let p = QkPrepParams {
            src,
            q: qp,
            gate: gp,
            k: kp,
            v: vp,
            cache_k: ck,
            cache_v: cv,
            q_w,
            k_w,
            pos: self.addr(self.compiled.io.pos),
            len: self.addr(self.compiled.io.len),
            rows_pos: self.rows_pos(),
            slots: self.slots(),
            theta: theta.get(),
            ld_src,
            ld_q,
            ld_gate,
            ld_k,
            ld_v,
            src_stride: to_i32(src_stride, "head stride", label)?,
            q_heads: to_i32(*q_heads, "q_heads", label)?,
            kv_heads: to_i32(*kv_heads, "kv_heads", label)?,
            head_dim: to_i32(hd, "head_dim", label)?,
            rotary_dims: to_i32(*rotary_dims, "rotary_dims", label)?,
            tpg: tpg as i32,
            one_plus_q,
            one_plus_k,
            eps_q,
            eps_k,
            max_seq: to_i32(max_seq, "max_seq", label)?,
        };
        let heads_per_block = QK_PREP_THREADS / tpg;
        // `<phase> op <i> (qk_prep)`: a group of its own in profiles.
        let prep_label = match label.rfind(" (") {
            Some(at) => format!("{} (qk_prep)", &label[..at]),
            None => format!("{label} qk_prep"),
        };
        cmds.push(self.kernel(
            &prep_label,
            self.kernels.typed("qk_prep", t)?,
            (
                ceil_div(q_heads + kv_heads, heads_per_block),
                rows as u32,
                1,
            ),
            QK_PREP_THREADS as u32,
            &p,
        ));
        let at = 4 + split.is_some() as usize;
        let att_label = label_at(at);
        let gate = self.out_gate(att, rest.get(5), rows, &att_label)?;
        let gated = self.attention(att, rows, shared, &att_label, cmds, false, gate)?;
        Ok(Some(at + 1 + gated as usize))
    }
}
