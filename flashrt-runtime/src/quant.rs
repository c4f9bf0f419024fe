//! Block-scaled FP8 weights: the E4M3 codec and the reference quantizer.
//!
//! A quantized weight ([`flashrt_ir::WeightQuant`]) is FP8 E4M3 codes `q` with one f32 scale
//! per block: `W[i, j] = e4m3(q[i, j]) * s[block of (i, j)]`. The product of an E4M3 value (4
//! significant bits) and a bf16 scale (8 bits) is exact in f32, so dequantizing in f32
//! reproduces the checkpoint's weights bit for bit; the CPU reference does exactly that.
//!
//! The quantizer (`--quantize fp8`, random weights of a quantized model) is the rule of the
//! reference fixtures' FP8 writer, bit for bit, per block `B` of the weight rounded to bf16:
//!
//! 1. `amax = max |W|` over `B`;
//! 2. `amax == 0`: scale `1.0` and every element stored as the E4M3 code of itself (±0);
//! 3. otherwise `scale = bf16(amax / 448)` (IEEE f32 division, then round to nearest even);
//! 4. `q = e4m3(clamp(W / scale, -448, 448))`, an f32 division by the scale and a round to
//!    nearest even.
//!
//! The CUDA backend's `fp8_quantize` kernel follows the same steps with the same IEEE
//! operations, so both backends hold the same codes and scales for the same weights. The
//! codec is written out here rather than taken from a crate because its rounding is part of
//! that contract (round to nearest even, saturating at ±448 like the device's `satfinite`
//! conversion, NaN to `0x7f`), and it is tested exhaustively against the decoder.

use flashrt_ir::WeightQuant;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The exact value of E4M3 code `b` (`s eeee mmm`, bias 7; `0x7f` / `0xff` are NaN, there
/// are no infinities).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 0x7) as f32;
    if e == 0xf && b & 0x7 == 0x7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m * (1.0 / 512.0)
    } else {
        (1.0 + m / 8.0) * f32::powi(2.0, e - 7)
    };
    sign * mag
}

/// The E4M3 code nearest to `x` (ties to even), saturating at ±448; NaN becomes `0x7f` (with
/// the sign of `x`).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range: multiples of 2^-9 (a code of 8 is the smallest normal, 0x08).
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let frac = (a / f32::powi(2.0, e) - 1.0) * 8.0;
    let mut m = frac.round_ties_even() as i32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = (((e + 7) as u8) << 3) | m as u8;
    // 464 and above round to 480 (the NaN code): saturate instead.
    sign | code.min(0x7e)
}

/// `x` rounded to bf16 (nearest even), as f32.
pub fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Quantize a weight by the reference rule (module docs): `values` row-major with `quant.cols`
/// columns (rounded to bf16 first; bf16 values are unchanged by that), into `codes` (one per
/// value) and `scales` (the scale buffer's layout, [`WeightQuant::scale_index`]).
pub fn quantize(values: &[f32], quant: &WeightQuant, codes: &mut [u8], scales: &mut [f32]) {
    let cols = quant.cols;
    let rows = values.len() / cols;
    let [br, bc] = quant.block;
    for seg in 0..rows / quant.segment {
        for bi in 0..quant.block_rows() {
            let r0 = seg * quant.segment + bi * br;
            let r1 = (r0 + br).min((seg + 1) * quant.segment);
            for bj in 0..quant.block_cols() {
                let c0 = bj * bc;
                let c1 = (c0 + bc).min(cols);
                let mut amax = 0.0f32;
                for r in r0..r1 {
                    for v in &values[r * cols + c0..r * cols + c1] {
                        amax = amax.max(round_bf16(*v).abs());
                    }
                }
                let scale = if amax == 0.0 {
                    1.0
                } else {
                    round_bf16(amax / E4M3_MAX)
                };
                scales[quant.scale_index(r0, c0)] = scale;
                for r in r0..r1 {
                    for c in c0..c1 {
                        let v = round_bf16(values[r * cols + c]);
                        let x = if amax == 0.0 {
                            v
                        } else {
                            (v / scale).clamp(-E4M3_MAX, E4M3_MAX)
                        };
                        codes[r * cols + c] = f32_to_e4m3(x);
                    }
                }
            }
        }
    }
}

/// `values[i] = e4m3(codes[i]) * scale` of its block, in place: `values` hold the codes'
/// values (unscaled) on entry. Exact in f32.
pub fn apply_scales(values: &mut [f32], quant: &WeightQuant, scales: &[f32]) {
    let cols = quant.cols;
    for (i, v) in values.iter_mut().enumerate() {
        *v *= scales[quant.scale_index(i / cols, i % cols)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashrt_ir::BufferId;

    #[test]
    fn codec_round_trips_every_code() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if b & 0x7f == 0x7f {
                assert!(v.is_nan());
                continue;
            }
            assert_eq!(f32_to_e4m3(v), b, "code {b:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x08), 1.0 / 64.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
    }

    #[test]
    fn encoder_rounds_to_nearest_even_between_every_pair_of_codes() {
        // Every adjacent pair of non-negative finite codes: just below, at and just above the
        // midpoint.
        for b in 0..0x7eu8 {
            let (lo, hi) = (e4m3_to_f32(b), e4m3_to_f32(b + 1));
            let mid = (lo + hi) / 2.0;
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_e4m3(below), b);
            assert_eq!(f32_to_e4m3(above), b + 1);
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "tie between {lo} and {hi}");
            assert_eq!(f32_to_e4m3(-mid), 0x80 | even);
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7e);
        assert_eq!(f32_to_e4m3(-470.0), 0xfe);
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert_eq!(f32_to_e4m3(1e-9), 0x00);
    }

    #[test]
    fn quantizer_keeps_segments_and_ragged_edges_apart() {
        // Two segments of 3 rows (a stacked weight), 5 columns, blocks of 2 x 4.
        let q = WeightQuant {
            scale: BufferId(0),
            block: [2, 4],
            segment: 3,
            cols: 5,
        };
        let values: Vec<f32> = (0..30).map(|i| (i as f32 - 11.0) * 0.37).collect();
        let mut codes = vec![0u8; 30];
        let mut scales = vec![0f32; 2 * 2 * 2];
        quantize(&values, &q, &mut codes, &mut scales);
        // Block (segment 1, block row 1) is row 5 alone; its second block column is column 4.
        let amax = round_bf16(values[5 * 5 + 4]).abs();
        assert_eq!(scales[q.scale_index(5, 4)], round_bf16(amax / 448.0));
        assert_eq!(q.scale_index(5, 4), 7);
        // Every value dequantizes to within the E4M3 step of its block.
        let mut deq: Vec<f32> = codes.iter().map(|&c| e4m3_to_f32(c)).collect();
        apply_scales(&mut deq, &q, &scales);
        for (i, (&v, &d)) in values.iter().zip(&deq).enumerate() {
            let s = scales[q.scale_index(i / 5, i % 5)];
            assert!((v - d).abs() <= s * 16.0 + 1e-3, "element {i}: {v} vs {d}");
        }
        // The block maximum maps to (nearly) 448.
        let big = codes
            .iter()
            .map(|&c| e4m3_to_f32(c).abs())
            .fold(0.0f32, f32::max);
        assert!(big >= 416.0);
    }

    #[test]
    fn zero_block_has_unit_scale_and_signed_zeros() {
        let q = WeightQuant {
            scale: BufferId(0),
            block: [2, 2],
            segment: 2,
            cols: 2,
        };
        let mut codes = vec![9u8; 4];
        let mut scales = vec![0f32; 1];
        quantize(&[0.0, -0.0, 0.0, -0.0], &q, &mut codes, &mut scales);
        assert_eq!(scales, [1.0]);
        assert_eq!(codes, [0x00, 0x80, 0x00, 0x80]);
    }
}
