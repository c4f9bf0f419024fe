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

use flashrt_ir::{Act, NormWeight};

mod attention;
mod conv;
mod gated_deltanet;
mod linear;
mod mamba2;
mod moe;

pub(crate) use attention::*;
pub(crate) use conv::*;
pub(crate) use gated_deltanet::*;
pub(crate) use linear::*;
pub(crate) use mamba2::*;
pub(crate) use moe::*;

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

/// Deterministic values in [-0.5, 0.5) for the kernels' tests.
#[cfg(test)]
pub(crate) fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}
