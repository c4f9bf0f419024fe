//! `Op::Mamba2Scan`: the Mamba2 selective-state recurrence, token by token.

use super::*;

/// Shapes of one Mamba2 scan.
pub(crate) struct MambaDims {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    pub dt_min: Option<f32>,
}

/// `Op::Mamba2Scan`, token by token. `xbc`: `[len, H P + 2 G N]`; `dt`: `[len, H]`;
/// `state`: `[H, P, N]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mamba2_scan(
    xbc: &[f32],
    dt: &[f32],
    len: usize,
    a_log: &[f32],
    d_skip: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    d: &MambaDims,
    out: &mut OutRows,
) {
    let (nh, p, g, n) = (d.heads, d.head_dim, d.groups, d.state);
    let inner = nh * p;
    let cd = inner + 2 * g * n;
    let per_group = nh / g;
    for r in 0..len {
        let row = &xbc[r * cd..(r + 1) * cd];
        let (x, bc) = row.split_at(inner);
        let (bm, cm) = bc.split_at(g * n);
        let o = out.row(r);
        for h in 0..nh {
            let gi = h / per_group;
            let bg = &bm[gi * n..(gi + 1) * n];
            let cg = &cm[gi * n..(gi + 1) * n];
            let mut dtv = softplus(dt[r * nh + h] + dt_bias[h]);
            if let Some(m) = d.dt_min {
                dtv = dtv.max(m);
            }
            let a = -a_log[h].exp();
            let da = (dtv * a).exp();
            for pi in 0..p {
                let xp = x[h * p + pi];
                let s = &mut state[(h * p + pi) * n..(h * p + pi + 1) * n];
                for (sv, &bv) in s.iter_mut().zip(bg) {
                    *sv = *sv * da + (dtv * bv) * xp;
                }
                o[h * p + pi] = dot(s, cg) + d_skip[h] * xp;
            }
        }
    }
}
