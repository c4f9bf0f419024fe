//! `Op::Attention`: causal attention of a chunk's rows over the session's KV cache (every
//! position read from the cache, so a row's result does not depend on the chunk).

use super::*;

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
