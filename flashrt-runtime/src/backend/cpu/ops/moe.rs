//! `Op::Moe`: exact routing (softmax or sigmoid scores, selection-only bias, grouped top-k,
//! renormalisation, scaling) and the chosen experts, row by row.

use super::*;
use flashrt_ir::{ExpertAct, RouteIr, RouterScore};

/// The experts `route` chooses for one row of router `logits`, best first, and their
/// weights ([`RouteIr`] gives the rule). `ids` and `weights` hold `route.top_k` entries.
/// Ties go to the lower expert index (as they do for group choice).
pub(crate) fn route(
    route: &RouteIr,
    logits: &[f32],
    bias: Option<&[f32]>,
    ids: &mut [usize],
    weights: &mut [f32],
) {
    let e = route.experts;
    let k = route.top_k;
    debug_assert!(logits.len() == e && ids.len() == k && weights.len() == k);
    let mut scores = vec![0f32; e];
    match route.score {
        RouterScore::Softmax => {
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (s, &l) in scores.iter_mut().zip(logits) {
                *s = (l - m).exp();
                sum += *s;
            }
            for s in &mut scores {
                *s /= sum;
            }
        }
        RouterScore::Sigmoid => {
            for (s, &l) in scores.iter_mut().zip(logits) {
                *s = sigmoid(l);
            }
        }
    }
    let mut choice: Vec<f32> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
        None => scores.clone(),
    };
    if route.groups > 1 && route.top_groups < route.groups {
        let per = e / route.groups;
        // A group's score: the sum of its two largest choice scores.
        let group_score = |g: &[f32]| {
            let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
            for &v in g {
                if v > a {
                    b = a;
                    a = v;
                } else if v > b {
                    b = v;
                }
            }
            a + b
        };
        let mut gs: Vec<f32> = choice.chunks(per).map(group_score).collect();
        let mut keep = vec![false; route.groups];
        for _ in 0..route.top_groups {
            let best = argmax_first(&gs);
            keep[best] = true;
            gs[best] = f32::NEG_INFINITY;
        }
        for (g, kept) in keep.iter().enumerate() {
            if !kept {
                choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
    }
    for j in 0..k {
        let best = argmax_first(&choice);
        ids[j] = best;
        weights[j] = scores[best];
        choice[best] = f32::NAN;
    }
    if route.renormalize {
        let mut sum = 0f32;
        for &w in weights.iter() {
            sum += w;
        }
        let denom = sum + route.renorm_eps.0 as f32;
        for w in weights.iter_mut() {
            *w /= denom;
        }
    }
    let scale = route.scaling.0 as f32;
    if scale != 1.0 {
        for w in weights.iter_mut() {
            *w *= scale;
        }
    }
}

/// A contiguous `[_, width]` output.
fn dense_rows(data: &mut [f32], width: usize) -> OutRows<'_> {
    OutRows {
        data,
        base: 0,
        stride: width,
        width,
    }
}

/// Index of the largest value, the first one on ties; NaN entries (already taken) never win.
fn argmax_first(v: &[f32]) -> usize {
    let mut best = usize::MAX;
    for (i, &x) in v.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if best == usize::MAX || x > v[best] {
            best = i;
        }
    }
    best
}

/// The weights of one [`flashrt_ir::Op::Moe`].
pub(crate) struct MoeWeights<'a> {
    pub router: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub up: &'a [f32],
    pub down: &'a [f32],
}

/// `Op::Moe`: route every row, run each expert on the rows that chose it (through
/// [`linear`], so every element is the same [`dot`] whatever rows share the expert), then
/// `out[r] += Σ_j w_j y_j` over row `r`'s experts best first. `x`: `[len, h]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe(
    x: &[f32],
    len: usize,
    h: usize,
    w: &MoeWeights,
    r: &RouteIr,
    inter: usize,
    expert_act: ExpertAct,
    out: &mut OutRows,
    threads: usize,
) {
    let (e, k) = (r.experts, r.top_k);
    let mut logits = vec![0f32; len * e];
    linear(
        x,
        len,
        h,
        w.router,
        e,
        None,
        &mut OutRows {
            data: &mut logits,
            base: 0,
            stride: e,
            width: e,
        },
        false,
        threads,
    );
    let mut ids = vec![0usize; len * k];
    let mut wts = vec![0f32; len * k];
    for row in 0..len {
        let (a, b) = (row * k, (row + 1) * k);
        route(
            r,
            &logits[row * e..(row + 1) * e],
            w.bias,
            &mut ids[a..b],
            &mut wts[a..b],
        );
    }
    let up_rows = expert_act.up_rows() * inter;
    // y[slot] = expert(x[slot / k]) for every (row, rank) slot.
    let mut y = vec![0f32; len * k * h];
    let (mut xs, mut hid, mut act_in, mut ys) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for ex in 0..e {
        let slots: Vec<usize> = (0..len * k).filter(|&s| ids[s] == ex).collect();
        if slots.is_empty() {
            continue;
        }
        let n = slots.len();
        xs.clear();
        for &s in &slots {
            let row = s / k;
            xs.extend_from_slice(&x[row * h..(row + 1) * h]);
        }
        hid.resize(n * up_rows, 0.0);
        let up = &w.up[ex * up_rows * h..(ex + 1) * up_rows * h];
        linear(
            &xs,
            n,
            h,
            up,
            up_rows,
            None,
            &mut dense_rows(&mut hid, up_rows),
            false,
            threads,
        );
        act_in.clear();
        for i in 0..n {
            let hr = &hid[i * up_rows..(i + 1) * up_rows];
            match expert_act {
                ExpertAct::Swiglu => {
                    act_in.extend((0..inter).map(|c| silu(hr[c]) * hr[inter + c]));
                }
                ExpertAct::Relu2 => act_in.extend(hr.iter().map(|&v| act(Act::Relu2, v))),
            }
        }
        ys.resize(n * h, 0.0);
        let down = &w.down[ex * h * inter..(ex + 1) * h * inter];
        linear(
            &act_in,
            n,
            inter,
            down,
            h,
            None,
            &mut dense_rows(&mut ys, h),
            false,
            threads,
        );
        for (i, &s) in slots.iter().enumerate() {
            y[s * h..(s + 1) * h].copy_from_slice(&ys[i * h..(i + 1) * h]);
        }
    }
    for row in 0..len {
        let o = out.row(row);
        for (c, o) in o.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                let s = row * k + j;
                acc += wts[s] * y[s * h + c];
            }
            *o += acc;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashrt_ir::F64;

    fn rule(score: RouterScore, k: usize, bias: bool, eps: f64, scaling: f64) -> RouteIr {
        RouteIr {
            experts: 4,
            top_k: k,
            score,
            expert_bias: bias,
            renormalize: true,
            renorm_eps: F64(eps),
            scaling: F64(scaling),
            groups: 1,
            top_groups: 1,
        }
    }

    fn routed(r: &RouteIr, logits: &[f32], bias: Option<&[f32]>) -> (Vec<usize>, Vec<f32>) {
        let mut ids = vec![0; r.top_k];
        let mut w = vec![0.0; r.top_k];
        route(r, logits, bias, &mut ids, &mut w);
        (ids, w)
    }

    /// Expected values computed by hand from the rules in the fixtures' READMEs.
    #[test]
    fn routing_rules_by_hand() {
        // Softmax -> top-2 -> renormalise == a softmax over the two largest logits:
        // e^3 / (e^3 + e^2) = 1 / (1 + e^-1).
        let r = rule(RouterScore::Softmax, 2, false, 0.0, 1.0);
        let (ids, w) = routed(&r, &[1.0, 3.0, 2.0, 0.0], None);
        assert_eq!(ids, [1, 2]);
        let hi = 1.0 / (1.0 + (-1f64).exp());
        assert!((w[0] as f64 - hi).abs() < 1e-6 && (w[1] as f64 - (1.0 - hi)).abs() < 1e-6);

        // Sigmoid, a selection-only bias: experts 0 and 1 are chosen by s + b = [1.5, 0.62,
        // -0.27, 0.27] although expert 2 has the largest logit, and weighted by the unbiased
        // s = [0.5, sigmoid(0.5)], renormalised with +1e-6, then scaled by 2.
        let r = rule(RouterScore::Sigmoid, 2, true, 1e-6, 2.0);
        let (ids, w) = routed(&r, &[0.0, 0.5, 1.0, -1.0], Some(&[1.0, 0.0, -1.0, 0.0]));
        assert_eq!(ids, [0, 1]);
        let s1 = 1.0 / (1.0 + (-0.5f64).exp());
        let denom = 0.5 + s1 + 1e-6;
        assert!((w[0] as f64 - 2.0 * 0.5 / denom).abs() < 1e-6, "{w:?}");
        assert!((w[1] as f64 - 2.0 * s1 / denom).abs() < 1e-6, "{w:?}");

        // Group-limited: choice scores [0.9, 0.1, 0.6, 0.6]; group 0 scores 1.0, group 1
        // scores 1.2, so only experts 2 and 3 stay eligible and the tie goes to expert 2,
        // although expert 0 has the largest score.
        let mut r = rule(RouterScore::Sigmoid, 1, true, 0.0, 1.0);
        r.groups = 2;
        r.top_groups = 1;
        let (ids, w) = routed(&r, &[0.0; 4], Some(&[0.4, -0.4, 0.1, 0.1]));
        assert_eq!((ids, w), (vec![2], vec![1.0]));
        r.top_groups = 2;
        assert_eq!(routed(&r, &[0.0; 4], Some(&[0.4, -0.4, 0.1, 0.1])).0, [0]);

        // Ties go to the lower index; no renormalisation keeps the raw scores.
        let mut r = rule(RouterScore::Sigmoid, 3, false, 0.0, 1.0);
        r.renormalize = false;
        let (ids, w) = routed(&r, &[0.0, 0.0, 0.0, 0.0], None);
        assert_eq!((ids, w), (vec![0, 1, 2], vec![0.5; 3]));
    }
}
