//! `Op::GatedDeltaNet` (the gated delta-rule recurrence, token by token) and `Op::GatedRmsNorm`
//! after it.

use super::*;
use flashrt_ir::GateOrder;

/// Shapes of one Gated DeltaNet op.
pub(crate) struct GdnDims {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl GdnDims {
    /// Workspace floats [`gated_deltanet`] needs.
    pub fn tmp_len(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_dim
    }
}

/// `Op::GatedDeltaNet`, token by token. `qkv`: `[len, 2 Hk dk + Hv dv]`; `a`, `b`:
/// `[len, Hv]`; `state`: `[Hv, dk, dv]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_deltanet(
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    len: usize,
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    d: &GdnDims,
    tmp: &mut [f32],
    out: &mut OutRows,
) {
    let (hk, hv, dk, dv) = (d.key_heads, d.value_heads, d.key_dim, d.value_dim);
    let c = 2 * hk * dk + hv * dv;
    let scale = (1.0 / (dk as f64).sqrt()) as f32;
    let (qn, rest) = tmp.split_at_mut(hk * dk);
    let (kn, rest) = rest.split_at_mut(hk * dk);
    let delta = &mut rest[..dv];
    let per_key = hv / hk;
    for r in 0..len {
        let row = &qkv[r * c..(r + 1) * c];
        for h in 0..hk {
            let qs = &row[h * dk..(h + 1) * dk];
            let ks = &row[hk * dk + h * dk..hk * dk + (h + 1) * dk];
            let qi = 1.0 / (dot(qs, qs) + 1e-6).sqrt();
            let ki = 1.0 / (dot(ks, ks) + 1e-6).sqrt();
            for i in 0..dk {
                qn[h * dk + i] = qs[i] * qi * scale;
                kn[h * dk + i] = ks[i] * ki;
            }
        }
        let o = out.row(r);
        for h in 0..hv {
            let kh = h / per_key;
            let kv = &kn[kh * dk..(kh + 1) * dk];
            let qv = &qn[kh * dk..(kh + 1) * dk];
            let v = &row[2 * hk * dk + h * dv..2 * hk * dk + (h + 1) * dv];
            let beta = sigmoid(b[r * hv + h]);
            let g = -a_log[h].exp() * softplus(a[r * hv + h] + dt_bias[h]);
            let decay = g.exp();
            let s = &mut state[h * dk * dv..(h + 1) * dk * dv];
            for x in s.iter_mut() {
                *x *= decay;
            }
            // delta = (v - Sᵀk) * beta
            delta.fill(0.0);
            for (i, &ki) in kv.iter().enumerate() {
                for (m, &sv) in delta.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                    *m += sv * ki;
                }
            }
            for (m, &vj) in delta.iter_mut().zip(v) {
                *m = (vj - *m) * beta;
            }
            // S += k deltaᵀ; out = Sᵀq
            let oh = &mut o[h * dv..(h + 1) * dv];
            oh.fill(0.0);
            for (i, (&ki, &qi)) in kv.iter().zip(qv).enumerate() {
                let srow = &mut s[i * dv..(i + 1) * dv];
                for ((sv, &dj), oj) in srow.iter_mut().zip(delta.iter()).zip(oh.iter_mut()) {
                    *sv += ki * dj;
                    *oj += *sv * qi;
                }
            }
        }
    }
}

/// `Op::GatedRmsNorm`. `x`, `gate`: `[len, width]`; `tmp`: `group` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_rms_norm(
    x: &[f32],
    gate: &[f32],
    len: usize,
    width: usize,
    weight: &[f32],
    shared_weight: bool,
    eps: f32,
    group: usize,
    order: GateOrder,
    tmp: &mut [f32],
    out: &mut OutRows,
) {
    let tmp = &mut tmp[..group];
    for r in 0..len {
        let o = out.row(r);
        for gi in 0..width / group {
            let lo = r * width + gi * group;
            let xs = &x[lo..lo + group];
            let zs = &gate[lo..lo + group];
            let w = if shared_weight {
                &weight[..group]
            } else {
                &weight[gi * group..(gi + 1) * group]
            };
            let os = &mut o[gi * group..(gi + 1) * group];
            match order {
                GateOrder::NormThenGate => {
                    let inv = 1.0 / (dot(xs, xs) / group as f32 + eps).sqrt();
                    for i in 0..group {
                        os[i] = w[i] * (xs[i] * inv) * silu(zs[i]);
                    }
                }
                GateOrder::GateThenNorm => {
                    for i in 0..group {
                        tmp[i] = xs[i] * silu(zs[i]);
                    }
                    let inv = 1.0 / (dot(tmp, tmp) / group as f32 + eps).sqrt();
                    for i in 0..group {
                        os[i] = w[i] * (tmp[i] * inv);
                    }
                }
            }
        }
    }
}
