//! `Op::CausalConv1d`: the depthwise causal conv, token by token over its carried state.

use super::*;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::ops::lcg;

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
