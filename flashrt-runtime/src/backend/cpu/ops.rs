//! Op kernels of the CPU reference backend, one function per [`flashrt_ir::Op`] variant.
//!
//! Inputs arrive as contiguous row-major `[len, width]` slices (the executor gathers views
//! into its workspace first, so no kernel has to reason about aliasing); outputs are written
//! through [`OutRows`], a strided window onto the destination buffer. State regions are plain
//! `&mut [f32]` slices of the session's state arena, in the layouts of
//! [`flashrt_ir::StateKind`].
//!
//! **Chunking invariance.** Every kernel computes each output row with the same sequence of
//! f32 operations whatever `len` is and wherever the chunk starts: reductions go through
//! [`dot`] (a fixed 8-lane order), recurrences step token by token, attention reads every
//! position from the cache. Rust never reassociates or fuses float operations, so this is a
//! bitwise guarantee, not an approximate one.

use flashrt_ir::{Act, ExpertAct, GateOrder, NormWeight, RouteIr, RouterScore};

/// A strided output window: row `r` is `data[base + r * stride ..][..width]`.
pub(crate) struct OutRows<'a> {
    pub data: &'a mut [f32],
    pub base: usize,
    pub stride: usize,
    pub width: usize,
}

impl OutRows<'_> {
    #[inline]
    pub fn row(&mut self, r: usize) -> &mut [f32] {
        let s = self.base + r * self.stride;
        &mut self.data[s..s + self.width]
    }
}

#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `log(1 + exp(x))`, linear above 20 (torch's default threshold).
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

#[inline]
pub(crate) fn act(a: Act, x: f32) -> f32 {
    match a {
        Act::Identity => x,
        Act::Silu => silu(x),
        Act::Sigmoid => sigmoid(x),
        Act::Relu2 => {
            let r = x.max(0.0);
            r * r
        }
    }
}

/// Dot products of `R` rows with `C` vectors, each in the fixed order of [`dot`]: 8 lanes
/// accumulate strided products, the lanes are combined pairwise, the tail is added last.
/// Element `[r][c]` does not depend on `R`, `C` or the other rows and vectors.
#[inline(always)]
fn dot_block<const R: usize, const C: usize>(a: [&[f32]; R], b: [&[f32]; C]) -> [[f32; C]; R] {
    let n = b[0].len();
    let n8 = n - n % 8;
    let mut acc = [[[0f32; 8]; C]; R];
    let mut i = 0;
    while i < n8 {
        let bb: [&[f32; 8]; C] =
            std::array::from_fn(|c| b[c][i..i + 8].try_into().expect("8 lanes"));
        for r in 0..R {
            let aa: &[f32; 8] = a[r][i..i + 8].try_into().expect("8 lanes");
            for c in 0..C {
                for l in 0..8 {
                    acc[r][c][l] += aa[l] * bb[c][l];
                }
            }
        }
        i += 8;
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let v = &acc[r][c];
            let mut s = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
            for j in n8..n {
                s += a[r][j] * b[c][j];
            }
            out[r][c] = s;
        }
    }
    out
}

/// `Σ a[i] b[i]` in the fixed order used by every reduction of this backend.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    dot_block::<1, 1>([a], [b])[0][0]
}

/// `Op::Embed`.
pub(crate) fn embed(table: &[f32], width: usize, tokens: &[u32], out: &mut OutRows) {
    for (r, &t) in tokens.iter().enumerate() {
        let t = t as usize;
        out.row(r)
            .copy_from_slice(&table[t * width..(t + 1) * width]);
    }
}

/// `Op::RmsNorm`. `x`: `[len, width]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm(
    x: &[f32],
    len: usize,
    width: usize,
    weight: Option<&[f32]>,
    kind: NormWeight,
    eps: f32,
    group: usize,
    out: &mut OutRows,
) {
    for r in 0..len {
        let xr = &x[r * width..(r + 1) * width];
        let o = out.row(r);
        for (xs, os) in xr.chunks_exact(group).zip(o.chunks_exact_mut(group)) {
            let inv = 1.0 / (dot(xs, xs) / group as f32 + eps).sqrt();
            match (weight, kind) {
                (None, _) => {
                    for (o, &v) in os.iter_mut().zip(xs) {
                        *o = v * inv;
                    }
                }
                (Some(w), NormWeight::Plain) => {
                    for ((o, &v), &w) in os.iter_mut().zip(xs).zip(w) {
                        *o = v * inv * w;
                    }
                }
                (Some(w), NormWeight::OnePlus) => {
                    for ((o, &v), &w) in os.iter_mut().zip(xs).zip(w) {
                        *o = v * inv * (1.0 + w);
                    }
                }
            }
        }
    }
}

/// Raw output pointer shared by the threads of one `linear` call.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: threads write disjoint column ranges of the output (see `linear`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Output columns per cache block (the block's weight rows stay in L2 across row blocks).
fn col_block(k: usize) -> usize {
    ((256 * 1024) / (4 * k.max(1))).clamp(8, 1024)
}

/// `Op::Linear`: `out[r][j] (+)= dot(x[r], w[j]) (+ bias[j])`. `x`: `[len, k]`, `w`: `[n, k]`.
/// Work is split over output columns between `threads` threads; every element is computed by
/// the same code whatever the split, so results do not depend on the thread count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut OutRows,
    accumulate: bool,
    threads: usize,
) {
    assert!(out.width == n && x.len() >= len * k && w.len() >= n * k);
    assert!(len == 0 || out.base + (len - 1) * out.stride + n <= out.data.len());
    if let Some(b) = bias {
        assert!(b.len() >= n);
    }
    let work = len * k * n;
    let threads = if work < (1 << 22) {
        1
    } else {
        threads.clamp(1, n.div_ceil(64))
    };
    let ptr = OutPtr(out.data.as_mut_ptr());
    let (base, stride) = (out.base, out.stride);
    let run = move |j0: usize, j1: usize| {
        // SAFETY: the asserts above keep every index `base + r * stride + j` (r < len,
        // j < n) inside `out.data`, which outlives this call; callers of `run` use disjoint
        // column ranges `[j0, j1)`, so no element is written by two threads and none is read
        // by another thread.
        unsafe { linear_cols(x, len, k, w, bias, ptr, base, stride, j0, j1, accumulate) }
    };
    if threads <= 1 {
        run(0, n);
        return;
    }
    let per = n.div_ceil(threads);
    std::thread::scope(|s| {
        for t in 1..threads {
            let (j0, j1) = ((t * per).min(n), ((t + 1) * per).min(n));
            if j0 < j1 {
                s.spawn(move || run(j0, j1));
            }
        }
        run(0, per.min(n));
    });
}

/// Columns `[j0, j1)` of a linear layer, compiled for AVX2 when the CPU has it. The AVX2
/// copy runs exactly the same lane-wise f32 operations (no FMA: Rust never contracts), so
/// both copies give identical bits.
///
/// # Safety
/// `out.0 + base + r * stride + j` must be valid for writes for every `r < len`,
/// `j0 <= j < j1`, and no other thread may access those elements during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn linear_cols(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: OutPtr,
    base: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    accumulate: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is available (checked above); the output contract is the caller's.
        unsafe { linear_cols_avx2(x, len, k, w, bias, out, base, stride, j0, j1, accumulate) };
        return;
    }
    // SAFETY: the caller's contract is passed on unchanged.
    unsafe { linear_cols_impl(x, len, k, w, bias, out, base, stride, j0, j1, accumulate) }
}

/// # Safety
/// As [`linear_cols`], and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn linear_cols_avx2(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: OutPtr,
    base: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    accumulate: bool,
) {
    // SAFETY: the caller's contract is passed on unchanged.
    unsafe { linear_cols_impl(x, len, k, w, bias, out, base, stride, j0, j1, accumulate) }
}

/// # Safety
/// As [`linear_cols`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn linear_cols_impl(
    x: &[f32],
    len: usize,
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
    out: OutPtr,
    base: usize,
    stride: usize,
    j0: usize,
    j1: usize,
    accumulate: bool,
) {
    let store = |r: usize, j: usize, v: f32| {
        let v = match bias {
            Some(b) => v + b[j],
            None => v,
        };
        // SAFETY: guaranteed by the caller (see the function's contract).
        unsafe {
            let p = out.0.add(base + r * stride + j);
            *p = if accumulate { *p + v } else { v };
        }
    };
    let xr = |r: usize| &x[r * k..(r + 1) * k];
    let wr = |j: usize| &w[j * k..(j + 1) * k];
    // One micro-kernel call: rows r0.., columns j.. (R x C outputs).
    macro_rules! block {
        ($r:literal, $c:literal, $r0:expr, $j:expr) => {{
            let v = dot_block::<$r, $c>(
                std::array::from_fn(|i| xr($r0 + i)),
                std::array::from_fn(|c| wr($j + c)),
            );
            for (i, row) in v.into_iter().enumerate() {
                for (c, val) in row.into_iter().enumerate() {
                    store($r0 + i, $j + c, val);
                }
            }
        }};
    }
    let jb = col_block(k);
    let mut c0 = j0;
    while c0 < j1 {
        let c1 = (c0 + jb).min(j1);
        let mut r0 = 0;
        while r0 < len {
            let rows = (len - r0).min(4);
            let mut j = c0;
            while j < c1 {
                let cols = if rows == 1 { 1 } else { (c1 - j).min(2) };
                match (rows, cols) {
                    (4, 2) => block!(4, 2, r0, j),
                    (4, _) => block!(4, 1, r0, j),
                    (3, 2) => block!(3, 2, r0, j),
                    (3, _) => block!(3, 1, r0, j),
                    (2, 2) => block!(2, 2, r0, j),
                    (2, _) => block!(2, 1, r0, j),
                    (_, 2) => block!(1, 2, r0, j),
                    _ => block!(1, 1, r0, j),
                }
                j += cols;
            }
            r0 += rows;
        }
        c0 = c1;
    }
}

/// `Op::Mul`: `out = act(gate) * x`; a `gate_width` of 1 is one gate per row.
pub(crate) fn mul(
    gate: &[f32],
    gate_width: usize,
    x: &[f32],
    len: usize,
    width: usize,
    a: Act,
    out: &mut OutRows,
) {
    for r in 0..len {
        let xv = &x[r * width..(r + 1) * width];
        if gate_width == 1 {
            let g = act(a, gate[r]);
            for (o, &v) in out.row(r).iter_mut().zip(xv) {
                *o = g * v;
            }
            continue;
        }
        let g = &gate[r * width..(r + 1) * width];
        for ((o, &g), &v) in out.row(r).iter_mut().zip(g).zip(xv) {
            *o = act(a, g) * v;
        }
    }
}

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

/// `Op::Unary`: `out = act(x)`.
pub(crate) fn unary(x: &[f32], len: usize, width: usize, a: Act, out: &mut OutRows) {
    for r in 0..len {
        for (o, &v) in out.row(r).iter_mut().zip(&x[r * width..(r + 1) * width]) {
            *o = act(a, v);
        }
    }
}

/// `Op::Rope`, in place on `[len, heads * head_dim]` rows; row `r` is at position `pos + r`.
/// Frequencies and angles are computed in f32 as transformers does
/// (`inv_freq = 1 / theta^(2i / rotary_dims)`, `angle = p * inv_freq`).
pub(crate) fn rope(
    x: &mut OutRows,
    len: usize,
    pos: usize,
    heads: usize,
    head_dim: usize,
    rotary_dims: usize,
    theta: f64,
) {
    let half = rotary_dims / 2;
    let theta = theta as f32;
    for r in 0..len {
        let p = (pos + r) as f32;
        let row = x.row(r);
        for i in 0..half {
            let inv_freq = 1.0 / theta.powf((2 * i) as f32 / rotary_dims as f32);
            let angle = p * inv_freq;
            let (s, c) = angle.sin_cos();
            for h in 0..heads {
                let o = h * head_dim;
                let a = row[o + i];
                let b = row[o + i + half];
                row[o + i] = a * c - b * s;
                row[o + i + half] = b * c + a * s;
            }
        }
    }
}

/// `Op::SplitHeads`: head `h` of `x` holds the parts `[p_0 | p_1 | ...]` (widths
/// `outs[i].width / heads`); part `i` goes to head `h` of output `i`.
pub(crate) fn split_heads_part(
    x: &[f32],
    len: usize,
    width: usize,
    heads: usize,
    part_off: usize,
    out: &mut OutRows,
) {
    let block = width / heads;
    let pw = out.width / heads;
    for r in 0..len {
        let xr = &x[r * width..(r + 1) * width];
        let o = out.row(r);
        for h in 0..heads {
            o[h * pw..(h + 1) * pw]
                .copy_from_slice(&xr[h * block + part_off..h * block + part_off + pw]);
        }
    }
}

/// Shapes of one attention op.
pub(crate) struct AttnDims {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// `Op::Attention` after the new K/V rows were written to the caches: row `r` (position
/// `pos + r`) attends to cache positions `0 ..= pos + r`. `q`: `[len, q_heads * head_dim]`;
/// caches `[max_seq, kv_heads, head_dim]`; `scores` has room for `pos + len` entries.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    q: &[f32],
    len: usize,
    pos: usize,
    cache_k: &[f32],
    cache_v: &[f32],
    d: &AttnDims,
    scores: &mut [f32],
    out: &mut OutRows,
) {
    let hd = d.head_dim;
    let qw = d.q_heads * hd;
    let kvw = d.kv_heads * hd;
    let group = d.q_heads / d.kv_heads;
    for r in 0..len {
        let n = pos + r + 1;
        let o = out.row(r);
        for h in 0..d.q_heads {
            let kh = h / group;
            let qv = &q[r * qw + h * hd..r * qw + (h + 1) * hd];
            let mut m = f32::NEG_INFINITY;
            for (j, s) in scores[..n].iter_mut().enumerate() {
                let kj = &cache_k[j * kvw + kh * hd..j * kvw + (kh + 1) * hd];
                *s = dot(qv, kj) * d.scale;
                m = m.max(*s);
            }
            let mut sum = 0f32;
            for s in scores[..n].iter_mut() {
                *s = (*s - m).exp();
                sum += *s;
            }
            let oh = &mut o[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for (j, &e) in scores[..n].iter().enumerate() {
                let p = e / sum;
                let vj = &cache_v[j * kvw + kh * hd..j * kvw + (kh + 1) * hd];
                for (o, &v) in oh.iter_mut().zip(vj) {
                    *o += p * v;
                }
            }
        }
    }
}

/// `Op::CausalConv1d`. `x`: `[len, c]`; `weight`: `[c, k]`; `state`: `[k - 1, c]`, oldest
/// first, updated to the last `k - 1` inputs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_conv1d(
    x: &[f32],
    len: usize,
    c: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    state: &mut [f32],
    a: Act,
    k: usize,
    out: &mut OutRows,
) {
    let km1 = k - 1;
    for r in 0..len {
        let o = out.row(r);
        for (ch, o) in o.iter_mut().enumerate() {
            let w = &weight[ch * k..(ch + 1) * k];
            let mut acc = 0f32;
            for (j, &wj) in w.iter().enumerate() {
                // Input time t = r + j - (k - 1) relative to the chunk start.
                let u = if r + j >= km1 {
                    x[(r + j - km1) * c + ch]
                } else {
                    state[(r + j) * c + ch]
                };
                acc += wj * u;
            }
            if let Some(b) = bias {
                acc += b[ch];
            }
            *o = act(a, acc);
        }
    }
    if len >= km1 {
        state.copy_from_slice(&x[(len - km1) * c..len * c]);
    } else {
        state.copy_within(len * c.., 0);
        state[(km1 - len) * c..].copy_from_slice(&x[..len * c]);
    }
}

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

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    #[test]
    fn linear_rows_and_threads_are_bitwise_stable() {
        let (len, k, n) = (7, 83, 50);
        let mut s = 1;
        let x: Vec<f32> = (0..len * k).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut s)).collect();
        let bias: Vec<f32> = (0..n).map(|_| lcg(&mut s)).collect();
        let run = |rows: std::ops::Range<usize>, threads: usize| {
            let mut data = vec![0f32; len * n];
            let m = rows.len();
            let mut out = OutRows {
                data: &mut data,
                base: rows.start * n,
                stride: n,
                width: n,
            };
            linear(
                &x[rows.start * k..],
                m,
                k,
                &w,
                n,
                Some(&bias),
                &mut out,
                false,
                threads,
            );
            data
        };
        let all = run(0..len, 1);
        // Row i is the same whichever block of rows it is computed in.
        for start in 0..len {
            let part = run(start..len, 1);
            assert_eq!(&part[start * n..], &all[start * n..]);
            let one = run(start..start + 1, 1);
            assert_eq!(
                &one[start * n..(start + 1) * n],
                &all[start * n..(start + 1) * n]
            );
        }
        // Reference: naive per-element dot.
        for r in 0..len {
            for j in 0..n {
                let want = dot(&x[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]) + bias[j];
                assert_eq!(all[r * n + j], want);
            }
        }
    }

    #[test]
    fn linear_threads_do_not_change_results() {
        let (len, k, n) = (5, 1024, 1000);
        let mut s = 7;
        let x: Vec<f32> = (0..len * k).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..n * k).map(|_| lcg(&mut s)).collect();
        let mut a = vec![0f32; len * n];
        let mut b = vec![0f32; len * n];
        linear(
            &x,
            len,
            k,
            &w,
            n,
            None,
            &mut OutRows {
                data: &mut a,
                base: 0,
                stride: n,
                width: n,
            },
            false,
            1,
        );
        linear(
            &x,
            len,
            k,
            &w,
            n,
            None,
            &mut OutRows {
                data: &mut b,
                base: 0,
                stride: n,
                width: n,
            },
            false,
            3,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn conv_state_carries_across_chunks() {
        let (c, k) = (3, 4);
        let mut s = 3;
        let x: Vec<f32> = (0..10 * c).map(|_| lcg(&mut s)).collect();
        let w: Vec<f32> = (0..c * k).map(|_| lcg(&mut s)).collect();
        let full = {
            let mut st = vec![0f32; (k - 1) * c];
            let mut o = vec![0f32; 10 * c];
            causal_conv1d(
                &x,
                10,
                c,
                &w,
                None,
                &mut st,
                Act::Silu,
                k,
                &mut OutRows {
                    data: &mut o,
                    base: 0,
                    stride: c,
                    width: c,
                },
            );
            (o, st)
        };
        for split in [1, 2, 5, 9] {
            let mut st = vec![0f32; (k - 1) * c];
            let mut o = vec![0f32; 10 * c];
            let mut rows = OutRows {
                data: &mut o,
                base: 0,
                stride: c,
                width: c,
            };
            causal_conv1d(
                &x[..split * c],
                split,
                c,
                &w,
                None,
                &mut st,
                Act::Silu,
                k,
                &mut rows,
            );
            // Single steps for the rest.
            for t in split..10 {
                let mut one = OutRows {
                    data: rows.data,
                    base: t * c,
                    stride: c,
                    width: c,
                };
                causal_conv1d(
                    &x[t * c..(t + 1) * c],
                    1,
                    c,
                    &w,
                    None,
                    &mut st,
                    Act::Silu,
                    k,
                    &mut one,
                );
                rows = OutRows {
                    data: one.data,
                    base: 0,
                    stride: c,
                    width: c,
                };
            }
            assert_eq!(o, full.0);
            assert_eq!(st, full.1);
        }
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// `cargo test --release -p flashrt-runtime --lib -- --ignored linear_gflops --nocapture`
    #[test]
    #[ignore]
    fn linear_gflops() {
        for (len, k, n, threads) in [(1, 2048, 8192, 1), (64, 2048, 2048, 1), (64, 2048, 2048, 2)] {
            let x = vec![0.5f32; len * k];
            let w = vec![0.25f32; n * k];
            let mut out = vec![0f32; len * n];
            let t = std::time::Instant::now();
            let reps = 5;
            for _ in 0..reps {
                let mut o = OutRows {
                    data: &mut out,
                    base: 0,
                    stride: n,
                    width: n,
                };
                linear(&x, len, k, &w, n, None, &mut o, false, threads);
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "len {len} k {k} n {n} threads {threads}: {:.2} ms, {:.1} GFLOP/s",
                s * 1e3,
                2.0 * (len * k * n) as f64 / s / 1e9
            );
        }
    }
}
