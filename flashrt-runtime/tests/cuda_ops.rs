//! Every plan op on the GPU against the CPU reference, one op at a time (see
//! `cuda_support` for the harness). Each case runs with an f32 GPU target (checks the kernel
//! logic to rounding) and a bf16 target (the fast path), with seeded random data and odd sizes
//! (3, 50, 783) so that tails, partial warps and unaligned column windows are exercised.
//! Skips with a message when no CUDA device is present.
#![cfg(feature = "cuda")]

mod cuda_support;

use cuda_support::*;
use flashrt_runtime::backend::cuda::CudaOptions;
use flashrt_runtime::ir::{
    Act, DType, ExpertAct, F64, GateOrder, NormWeight, Op, RouteIr, RouterScore, StateKind,
};

#[test]
fn embed() {
    let Some(gpu) = cuda("embed") else { return };
    for dtype in DTYPES {
        for (bucket, width) in [(3, 50), (50, 783)] {
            OpCase::new(&format!("embed w{width}"), bucket, width, width).check(&gpu, dtype, |b| {
                // The harness's own Embed fills scratch.in; copy it out unchanged.
                b.op(Op::Unary {
                    x: b.input(0, width),
                    act: Act::Identity,
                    out: b.output(0, width),
                });
            });
        }
    }
}

#[test]
fn rms_norm() {
    let Some(gpu) = cuda("rms_norm") else { return };
    for dtype in DTYPES {
        // `off`: the normalised window starts `off` columns into the input, whose row stride
        // is width + off. Whole 16-byte packs (width, group, off multiples of 8 elements) take
        // the vector kernel: one group per block (5120, group 5120 / 1024), several groups
        // per block (256, 128, 8); the others the scalar kernel.
        for (bucket, width, group, kind, weighted, off) in [
            (3, 783, 783, NormWeight::Plain, true, 0),
            (50, 150, 50, NormWeight::OnePlus, true, 0),
            (50, 783, 3, NormWeight::Plain, false, 0),
            (3, 1024, 256, NormWeight::OnePlus, true, 0),
            (64, 5120, 5120, NormWeight::Plain, true, 0),
            (130, 2048, 256, NormWeight::OnePlus, true, 0),
            (130, 1024, 128, NormWeight::Plain, false, 8),
            (50, 4096, 1024, NormWeight::Plain, true, 0),
            (50, 96, 8, NormWeight::OnePlus, true, 0),
            // Aligned sizes, misaligned window: scalar kernel (f32 takes packs at off 4).
            (64, 5120, 5120, NormWeight::Plain, true, 3),
            (50, 2048, 256, NormWeight::Plain, true, 4),
        ] {
            let in_width = width + off;
            let case = OpCase::new(
                &format!("rms_norm w{width} g{group} {kind:?} weighted={weighted} off={off}"),
                bucket,
                in_width,
                width,
            );
            case.check(&gpu, dtype, |b| {
                let w = weighted.then(|| {
                    let v = b.rng.vec(group, -1.0, 1.0);
                    b.param("w", v)
                });
                // In place on the input window, then copied out: checks `out == x` aliasing.
                let x = b.input(off, width);
                b.op(Op::RmsNorm {
                    x,
                    weight: w,
                    weight_kind: kind,
                    out: x,
                    eps: F64(1e-6),
                    group,
                });
                b.op(Op::Unary {
                    x,
                    act: Act::Identity,
                    out: b.output(0, width),
                });
            });
        }
    }
}

#[test]
fn linear() {
    let Some(gpu) = cuda("linear") else { return };
    // And with small phases' 16-bit matmuls on the tensor cores (`gemv16m`, `gemv16s`: opt-in).
    let mma = cuda_gemv16m("linear");
    let smem = cuda_gemv16s("linear");
    for (gpu, dtype) in std::iter::once(gpu)
        .chain(mma)
        .chain(smem)
        .flat_map(|g| DTYPES.map(|d| (g.clone(), d)))
    {
        for (bucket, k, n, bias, accumulate) in [
            (3, 783, 50, true, false),
            (50, 50, 783, false, true),
            (50, 783, 783, true, true),
            (3, 256, 512, false, false),
            // k % 8 == 0 and at most 8 rows: the gemv kernel, with a tail of k chunks.
            (3, 264, 100, false, true),
            (8, 1032, 37, false, false),
            // k % 128 == 0: 16-bit weights on the tensor cores (`gemv16m`), 1 to 8 rows.
            (1, 384, 40, false, true),
            (5, 640, 33, false, false),
            (8, 1280, 100, false, true),
            // Long k, few tiles: a tile's steps fall to eight warps, six of them wholly inside
            // it (`gemv16m`'s finisher reads seven published shares).
            (1, 4096, 40, false, true),
            (7, 4096, 24, false, false),
        ] {
            let name = format!("linear {k}->{n} bias={bias} acc={accumulate}");
            // Input: x in columns 0..k, the residual (accumulate target) in k..k+n.
            OpCase::new(&name, bucket, k + n, n).check(&gpu, dtype, |b| {
                let scale = 1.0 / (k as f32).sqrt();
                let w = b.weight("w", &[n, k], scale * 1.7);
                let bias = bias.then(|| {
                    let v = b.rng.vec(n, -1.0, 1.0);
                    b.param("bias", v)
                });
                let out = if accumulate {
                    b.input(k, n)
                } else {
                    b.output(0, n)
                };
                b.op(Op::Linear {
                    x: b.input(0, k),
                    w,
                    bias,
                    out,
                    accumulate,
                });
                if accumulate {
                    b.op(Op::Unary {
                        x: out,
                        act: Act::Identity,
                        out: b.output(0, n),
                    });
                }
            });
        }
    }
}

/// FP8 weights (block-scaled E4M3) against the CPU's exact dequantized values, on every path:
/// small phases (W8A16: only bf16 activation rounding differs, the bf16 tolerance) on the
/// tensor cores (`gemv8m`: scale blocks of 128-column multiples, k % 128 == 0) and on the CUDA
/// cores (`gemv8`: other blocks, or `gemv_mma` off), FP8 prefill chunks on the FP8 tensor cores (W8A8: activations quantized per
/// row and 128 columns — see `W8A8_TOL`), and the dequantized-copy fallback (other block
/// shapes, `fp8_gemm` off; the bf16 tolerance). On an f32 GPU the weights are dequantized
/// when they load, by the device's quantizer: equal to the CPU's at the f32 tolerance.
#[test]
fn fp8_linear() {
    let Some(gpu) = cuda("fp8_linear") else {
        return;
    };
    let no_w8a8 = cuda_with(
        "fp8_linear (dequantized prefill)",
        CudaOptions {
            fp8_gemm: false,
            ..CudaOptions::default()
        },
    );
    let no_mma = cuda_with(
        "fp8_linear (CUDA-core gemv8)",
        CudaOptions {
            gemv_mma: false,
            ..CudaOptions::default()
        },
    );
    // (bucket, k, n, block, accumulate)
    let cases = [
        // gemv8m (and gemv8 without the tensor cores): 128 x 128 blocks, a ragged last block
        // row and tile, accumulate; 1 to 8 rows; blocks of 64 rows and 256 columns; few steps
        // per warp, so tiles split between warps (the fix-up of kernels/gemv_mma.cu).
        (3, 512, 300, [128, 128], true),
        (8, 256, 130, [128, 128], false),
        (1, 384, 40, [128, 128], false),
        (6, 768, 200, [64, 256], true),
        // Many tiles, k = 128: below gemv8m's two-step ring, so gemv8 (CUDA cores).
        (2, 128, 7000, [128, 128], false),
        // gemv8 with the fixtures' 32 x 32 blocks, ragged both ways.
        (5, 96, 50, [32, 32], false),
        // k % 16 != 0: small phases take the dequantized copy too.
        (3, 40, 64, [32, 32], true),
        // Prefill chunks: W8A8 (128 x 128, k a multiple of 512, rows of 4).
        (64, 512, 384, [128, 128], false),
        (64, 1024, 256, [128, 128], true),
        // Prefill chunks the tensor cores do not take: the dequantized copy.
        (50, 96, 70, [32, 32], false),
    ];
    for (bucket, k, n, block, accumulate) in cases {
        let name = format!("fp8 linear {k}->{n} block {block:?} acc={accumulate}");
        let mut case = OpCase::new(&name, bucket, k + n, n);
        let w8a8 = bucket > 8 && block == [128, 128];
        if w8a8 {
            case.tol = Some(W8A8_TOL);
        }
        let build = |b: &mut OpBuilder| {
            let w = b.weight_fp8("w", &[n, k], 1.7 / (k as f32).sqrt(), block);
            let out = if accumulate {
                b.input(k, n)
            } else {
                b.output(0, n)
            };
            b.op(Op::Linear {
                x: b.input(0, k),
                w,
                bias: None,
                out,
                accumulate,
            });
            if accumulate {
                b.op(Op::Unary {
                    x: out,
                    act: Act::Identity,
                    out: b.output(0, n),
                });
            }
        };
        for dtype in DTYPES {
            case.check(&gpu, dtype, build);
        }
        if let (false, Some(g)) = (bucket > 8, &no_mma) {
            case.check(g, DType::Bf16, build);
        }
        if let (true, Some(g)) = (w8a8, &no_w8a8) {
            case.tol = None;
            case.check(g, DType::Bf16, build);
        }
    }
    // A layer's FP8 projections after an RmsNorm, and an FP8 MLP's gate, up and product, in
    // small phases: one gemv8m (or gemv8) launch each, at 1, 3 and 8 rows and both 16-bit
    // types.
    for (rows, dtype, g) in [
        (3, DType::Bf16, Some(&gpu)),
        (1, DType::F16, Some(&gpu)),
        (8, DType::Bf16, Some(&gpu)),
        (3, DType::Bf16, no_mma.as_ref()),
    ] {
        let Some(g) = g else { continue };
        let (k, n) = (256, 100);
        let mut case = OpCase::new("fp8 gemv rms_norm + glu", rows, k, k + 3 * n);
        // The normalised inputs (up to ~2 with the 1 + w weights) are rounded to 16 bits
        // before k = 256 products with weights of ~0.1: that rounding alone moves a sum by
        // ~5e-3 (one standard deviation), so outputs that cancel to O(0.1) need twice the
        // bf16 atol; the relative part stays.
        case.tol = Some(Tol {
            atol: 2e-2,
            ..TOL_BF16
        });
        case.check(g, dtype, |b| {
            let v = b.rng.vec(k, -1.0, 1.0);
            let nw = b.param("norm_w", v);
            let hn = b.output(0, k);
            b.op(Op::RmsNorm {
                x: b.input(0, k),
                weight: Some(nw),
                weight_kind: NormWeight::OnePlus,
                out: hn,
                eps: F64(1e-6),
                group: k,
            });
            let wg = b.weight_fp8("gate", &[n, k], 1.7 / (k as f32).sqrt(), [128, 128]);
            let wu = b.weight_fp8("up", &[n, k], 1.7 / (k as f32).sqrt(), [128, 128]);
            for (w, col) in [(wg, k), (wu, k + n)] {
                b.op(Op::Linear {
                    x: hn,
                    w,
                    bias: None,
                    out: b.output(col, n),
                    accumulate: false,
                });
            }
            b.op(Op::Mul {
                gate: b.output(k, n),
                act: Act::Silu,
                x: b.output(k + n, n),
                out: b.output(k + 2 * n, n),
            });
        });
    }
}

/// The shared expert of an FP8 MoE block as the lowering writes it (FP8 gate and up, a bf16
/// token gate of width 1, the row-gated product, an FP8 down projection with k = 40 that
/// `gemv8` does not take) in small phases and a 3-row chunk.
#[test]
fn fp8_shared_expert() {
    let Some(gpu) = cuda("fp8_shared_expert") else {
        return;
    };
    let (h, si) = (64, 40);
    // Input columns: x in 0..h, the residual in h..2h. Outputs: [gate | up | token gate | residual].
    OpCase::new("fp8 shared expert", 3, 2 * h, 2 * si + 1 + h).check(&gpu, DType::Bf16, |b| {
        let block = [32, 32];
        let wg = b.weight_fp8("gate", &[si, h], 1.7 / (h as f32).sqrt(), block);
        let wu = b.weight_fp8("up", &[si, h], 1.7 / (h as f32).sqrt(), block);
        let wt = b.weight("token_gate", &[1, h], 1.7 / (h as f32).sqrt());
        let wd = b.weight_fp8("down", &[h, si], 1.7 / (si as f32).sqrt(), block);
        let (g, u, t) = (b.output(0, si), b.output(si, si), b.output(2 * si, 1));
        let x = b.input(0, h);
        for (w, out) in [(wg, g), (wu, u), (wt, t)] {
            if w == wt {
                b.op(Op::Mul {
                    gate: g,
                    act: Act::Silu,
                    x: u,
                    out: u,
                });
            }
            b.op(Op::Linear {
                x,
                w,
                bias: None,
                out,
                accumulate: false,
            });
        }
        b.op(Op::Mul {
            gate: t,
            act: Act::Sigmoid,
            x: u,
            out: u,
        });
        let res = b.input(h, h);
        b.op(Op::Linear {
            x: u,
            w: wd,
            bias: None,
            out: res,
            accumulate: true,
        });
        b.op(Op::Unary {
            x: res,
            act: Act::Identity,
            out: b.output(2 * si + 1, h),
        });
    });
}

/// Routing ties, decided by rule and not by luck: experts in groups of three with exactly
/// equal scores (a group's experts `g, g + G, g + 2G` share a selection bias, or a router row),
/// top 8, so every row's eighth pick splits a tied group and the tie must go to the lower
/// index, as the CPU reference breaks it (a wrong pick swaps in another expert's weights and
/// moves the output by O(1)). Sigmoid scores of an all-zero router plus a per-group bias (the
/// LFM2-MoE / Nemotron-H rule: every row picks the same experts, in f32 and bf16); softmax of
/// duplicated router rows, renormalised (Qwen3.5-MoE; f32 only, where CPU and GPU logits agree
/// to rounding and only the exact ties are close). 48 experts (a partial last lane), 96 (a
/// group's experts on one lane) and 256 (the 35B-A3B count); decode steps and 3..8-row chunks.
#[test]
fn moe_routing_ties_go_to_the_lower_index() {
    let Some(gpu) = cuda("moe_routing_ties_go_to_the_lower_index") else {
        return;
    };
    let (h, inter, k) = (32, 16, 8);
    for (experts, softmax) in [
        (48usize, false),
        (96, false),
        (256, false),
        (48, true),
        (256, true),
    ] {
        let groups = experts.div_ceil(3);
        let tmp = k * (inter + h + 4) + 2 * experts;
        let name = format!(
            "moe ties, {experts} experts, {}",
            if softmax { "softmax" } else { "sigmoid + bias" }
        );
        let mut case = OpCase::new(&name, 8, 2 * h + tmp, h);
        case.steps = vec![5, 1, 1, 3, 8, 1];
        let dtypes: &[DType] = if softmax { &[DType::F32] } else { &DTYPES };
        for &dtype in dtypes {
            case.check(&gpu, dtype, |b| {
                // Group g's rank: a permutation, so the winning groups are not the lowest ones.
                let rank = |g: usize| (g * 7) % groups;
                let router = if softmax {
                    let base = Rng::new(11).vec(groups * h, -1.0, 1.0);
                    let rows = (0..experts)
                        .flat_map(|e| base[(e % groups) * h..][..h].to_vec())
                        .collect();
                    b.param_f32("router", &[experts, h], rows)
                } else {
                    b.param_f32("router", &[experts, h], vec![0.0; experts * h])
                };
                let bias = (!softmax).then(|| {
                    let v = (0..experts)
                        .map(|e| -0.015625 * rank(e % groups) as f32)
                        .collect();
                    b.param_f32("bias", &[experts], v)
                });
                let up = b.weight("up", &[experts, 2 * inter, h], 2.0 / (h as f32).sqrt());
                let down = b.weight("down", &[experts, h, inter], 2.0 / (inter as f32).sqrt());
                let res = b.input(h, h);
                b.op(Op::Moe {
                    x: b.input(0, h),
                    router,
                    bias,
                    up,
                    down,
                    out: res,
                    tmp: b.input(2 * h, tmp),
                    route: RouteIr {
                        experts,
                        top_k: k,
                        score: if softmax {
                            RouterScore::Softmax
                        } else {
                            RouterScore::Sigmoid
                        },
                        expert_bias: !softmax,
                        renormalize: softmax,
                        renorm_eps: F64(0.0),
                        scaling: F64(1.0),
                        groups: 1,
                        top_groups: 1,
                    },
                    inter,
                    act: ExpertAct::Swiglu,
                });
                b.op(Op::Unary {
                    x: res,
                    act: Act::Identity,
                    out: b.output(0, h),
                });
            });
        }
    }
}

/// W8A8 prefill against the CPU's W8A16: the activations' E4M3 rounding (3 mantissa bits,
/// relative error up to 2^-4 per element, about 2^-4 / sqrt(3) rms) moves a `k`-term dot
/// product of O(1) terms by about 1/28 of its own spread (for these cases' unit-variance
/// inputs: sigma about 0.02, worst of ~25k outputs about 0.09); a wrong scale layout or code
/// conversion moves it by the whole spread (about 0.6). So 0.12 + 5 %.
const W8A8_TOL: Tol = Tol {
    atol: 0.12,
    rtol: 0.05,
};

/// Small phases run consecutive `Linear`s on one input as one `gemv` launch (with a leading
/// RmsNorm fused in), and an MLP's gate, up and `Mul` as one fused launch: all must equal the
/// separate ops (decode steps and 3/5-row chunks; every output — the normalised rows, gate,
/// up and product — is compared).
#[test]
fn gemv_groups_and_glu() {
    let Some(gpu) = cuda("gemv_groups_and_glu") else {
        return;
    };
    let mma = cuda_gemv16m("gemv_groups_and_glu");
    let smem = cuda_gemv16s("gemv_groups_and_glu");
    for (gpu, dtype) in std::iter::once(gpu)
        .chain(mma)
        .chain(smem)
        .flat_map(|g| DTYPES.map(|d| (g.clone(), d)))
    {
        for bucket in [3, 5] {
            // Four projections of one input, widths not multiples of the block's features.
            let (k, ns) = (264, [50, 7, 130, 9]);
            let total: usize = ns.iter().sum();
            OpCase::new(&format!("gemv group {ns:?}"), bucket, k, total).check(&gpu, dtype, |b| {
                let mut col = 0;
                for (i, &n) in ns.iter().enumerate() {
                    let w = b.weight(&format!("w{i}"), &[n, k], 1.7 / (k as f32).sqrt());
                    b.op(Op::Linear {
                        x: b.input(0, k),
                        w,
                        bias: None,
                        out: b.output(col, n),
                        accumulate: false,
                    });
                    col += n;
                }
            });
            // RmsNorm fused into the projections' launch: outputs [normed | p0 | p1], with and
            // without a (1 + w) weight (k = 256: on the tensor cores for 16-bit targets).
            let (n0, n1) = (40, 17);
            for (k, weighted) in [(264, true), (264, false), (256, true)] {
                OpCase::new(
                    &format!("gemv rms_norm + group weighted={weighted}"),
                    bucket,
                    k,
                    k + n0 + n1,
                )
                .check(&gpu, dtype, |b| {
                    let w = weighted.then(|| {
                        let v = b.rng.vec(k, -1.0, 1.0);
                        b.param("norm_w", v)
                    });
                    let hn = b.output(0, k);
                    b.op(Op::RmsNorm {
                        x: b.input(0, k),
                        weight: w,
                        weight_kind: NormWeight::OnePlus,
                        out: hn,
                        eps: F64(1e-6),
                        group: k,
                    });
                    for (i, (n, col)) in [(n0, k), (n1, k + n0)].into_iter().enumerate() {
                        let w = b.weight(&format!("w{i}"), &[n, k], 1.7 / (k as f32).sqrt());
                        b.op(Op::Linear {
                            x: hn,
                            w,
                            bias: None,
                            out: b.output(col, n),
                            accumulate: false,
                        });
                    }
                });
            }
            // gate, up, act(gate) * up: outputs [gate | up | product].
            let (k, n) = (136, 45);
            for act in [Act::Silu, Act::Relu2] {
                OpCase::new(&format!("gemv glu {act:?}"), bucket, k, 3 * n).check(
                    &gpu,
                    dtype,
                    |b| {
                        let wg = b.weight("gate", &[n, k], 1.7 / (k as f32).sqrt());
                        let wu = b.weight("up", &[n, k], 1.7 / (k as f32).sqrt());
                        for (w, col) in [(wg, 0), (wu, n)] {
                            b.op(Op::Linear {
                                x: b.input(0, k),
                                w,
                                bias: None,
                                out: b.output(col, n),
                                accumulate: false,
                            });
                        }
                        b.op(Op::Mul {
                            gate: b.output(0, n),
                            act,
                            x: b.output(n, n),
                            out: b.output(2 * n, n),
                        });
                    },
                );
            }
        }
    }
}

#[test]
fn mul_and_unary() {
    let Some(gpu) = cuda("mul_and_unary") else {
        return;
    };
    for dtype in DTYPES {
        for act in [Act::Identity, Act::Silu, Act::Sigmoid, Act::Relu2] {
            // Widths that are whole 16-byte packs take `mul_vec` / `unary_vec` (2000: 250
            // packs, so the 1-D grid's blocks straddle rows; 1028 only for f32, whose packs
            // are 4 wide); the others the scalar kernels.
            for (bucket, width) in [(3, 783), (50, 50), (130, 1024), (64, 2000), (3, 1028)] {
                OpCase::new(
                    &format!("mul {act:?} w{width}"),
                    bucket,
                    2 * width,
                    2 * width,
                )
                .check(&gpu, dtype, |b| {
                    let g = b.input(0, width);
                    let x = b.input(width, width);
                    // out aliases x.
                    b.op(Op::Mul {
                        gate: g,
                        act,
                        x,
                        out: x,
                    });
                    b.op(Op::Unary {
                        x,
                        act: Act::Identity,
                        out: b.output(0, width),
                    });
                    b.op(Op::Unary {
                        x: g,
                        act,
                        out: b.output(width, width),
                    });
                });
            }
        }
    }
}

#[test]
fn split_heads() {
    let Some(gpu) = cuda("split_heads") else {
        return;
    };
    for dtype in DTYPES {
        for (bucket, heads, parts) in [
            (3, 3, vec![50, 17]),
            (50, 8, vec![64, 64]),
            (50, 2, vec![3, 50, 7]),
        ] {
            let per: usize = parts.iter().sum();
            let width = heads * per;
            OpCase::new(
                &format!("split_heads {heads}x{parts:?}"),
                bucket,
                width,
                width,
            )
            .check(&gpu, dtype, |b| {
                let mut outs = Vec::new();
                let mut col = 0;
                for p in &parts {
                    outs.push(b.output(col, heads * p));
                    col += heads * p;
                }
                b.op(Op::SplitHeads {
                    x: b.input(0, width),
                    heads,
                    outs,
                });
            });
        }
    }
}

#[test]
fn rope() {
    let Some(gpu) = cuda("rope") else { return };
    for dtype in DTYPES {
        // Blocks of hb heads (the largest divisor of heads with hb * rotary / 2 <= 256): all
        // 3, 4 and 2 heads in the first cases (25, 8 and 32 pairs); 6 of 12 (Qwen3.5-style
        // partial rotary, 64 of 256); 4 of 24; 5 of 5 with 48 pairs; rotary 1024 (512 pairs)
        // loops over pairs, one head per block.
        for (bucket, heads, head_dim, rotary, theta) in [
            (3, 3, 50, 50, 1e4),
            (50, 4, 64, 16, 1e7),
            (50, 2, 256, 64, 1e6),
            (130, 12, 256, 64, 1e7),
            (50, 24, 128, 128, 1e6),
            (3, 5, 96, 96, 1e4),
            (3, 2, 1024, 1024, 1e6),
        ] {
            let width = heads * head_dim;
            let mut case = OpCase::new(
                &format!("rope {heads}x{head_dim} rot{rotary}"),
                bucket,
                width,
                width,
            );
            case.max_seq = 2048;
            case.check(&gpu, dtype, |b| {
                let x = b.input(0, width);
                b.op(Op::Rope {
                    x,
                    heads,
                    head_dim,
                    rotary_dims: rotary,
                    theta: F64(theta),
                });
                b.op(Op::Unary {
                    x,
                    act: Act::Identity,
                    out: b.output(0, width),
                });
            });
        }
    }
}

#[test]
fn attention() {
    let Some(gpu) = cuda("attention") else { return };
    for dtype in DTYPES {
        for (bucket, qh, kvh, hd) in [
            (3, 3, 3, 50),
            (50, 6, 2, 50),
            (50, 4, 1, 128),
            (3, 8, 2, 256),
            (3, 2, 2, 512),
        ] {
            let case = attention_case(bucket, qh, kvh, hd);
            check_attention(&gpu, dtype, &case, qh, kvh, hd, 1.0);
        }
    }
    attention_prefill_cases(&gpu, &[DType::F32, DType::Bf16, DType::F16]);
}

/// The prefill cases with the warpgroup-MMA kernel turned off: on an sm_90 device `attention`
/// runs head_dim 129..=256 through attention_prefill_wgmma.cu, this through the mma.sync
/// kernel of attention_prefill.cu (elsewhere both take the mma.sync kernel).
#[test]
fn attention_prefill_mma_sync() {
    let Some(gpu) = cuda_with(
        "attention_prefill_mma_sync",
        CudaOptions {
            attn_wgmma: false,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    attention_prefill_cases(&gpu, &[DType::Bf16, DType::F16]);
}

/// The prefill cases with one query head a block of the warpgroup-MMA kernel at every chunk
/// length (`CudaOptions::attn_pack` off; on, chunks of fewer than 128 rows pack a KV head's
/// query heads into each block).
#[test]
fn attention_prefill_unpacked() {
    let Some(gpu) = cuda_with(
        "attention_prefill_unpacked",
        CudaOptions {
            attn_pack: false,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    attention_prefill_cases(&gpu, &[DType::Bf16]);
}

/// Prefill buckets of >= 32 rows: bf16/f16 targets run a tensor-core kernel (128-row tiles:
/// attention_prefill_wgmma.cu at head_dim 129..=256 on sm_90, else attention_prefill.cu), f32
/// the split kernel. Partial tiles (130 = 128 + 2 rows), partial chunks, chunks that start far
/// from 0 and at positions that are not multiples of a tile, head_dim below the instantiated
/// bound (96 -> 128, 200 -> 256), GQA; small grids whose keys the wgmma kernel splits over
/// blocks (`CudaOptions::attn_split`; empty splits past a short context included).
fn attention_prefill_cases(
    gpu: &std::sync::Arc<flashrt_runtime::backend::cuda::CudaBackend>,
    dtypes: &[DType],
) {
    for &dtype in dtypes {
        for (bucket, qh, kvh, hd, steps) in [
            (130, 6, 1, 256, None),
            (64, 4, 2, 128, None),
            (96, 2, 2, 64, None),
            (70, 3, 1, 96, None),
            (64, 4, 2, 128, Some(vec![64, 64, 64, 64, 3, 61, 64, 1, 1])),
            (128, 6, 1, 256, Some(vec![128, 128, 100, 128, 5, 128, 1])),
            (200, 4, 1, 200, Some(vec![200, 133, 200, 1])),
            // Short chunks after ~1.1k positions at GQA 6:1: the wgmma kernel's 12-block grid
            // splits its keys (7 on a 132-SM device), splits that end inside a key tile, then
            // a partial chunk.
            (
                64,
                12,
                2,
                256,
                Some([vec![64; 16], vec![37, 64, 5]].concat()),
            ),
            // 32-row chunks of the 27B shape's heads (24 / 4: packed 6 heads x 16 rows a
            // block, 16 key splits, most empty at these lengths) after 384 positions, then
            // partial chunks; 8 query heads a
            // KV head at head_dim 200 (16 rows fill a block), a chunk ending inside a block.
            (
                32,
                24,
                4,
                256,
                Some([vec![32; 12], vec![20, 32, 1, 17]].concat()),
            ),
            (32, 16, 2, 200, Some(vec![32, 32, 25, 32, 9, 32])),
        ] {
            let mut case = attention_case(bucket, qh, kvh, hd);
            if let Some(steps) = steps {
                case.max_seq = steps.iter().sum::<usize>() + 16;
                case.steps = steps;
            }
            check_attention(gpu, dtype, &case, qh, kvh, hd, 1.0);
        }
    }
}

fn attention_case(bucket: usize, qh: usize, kvh: usize, hd: usize) -> OpCase {
    let (qw, kvw) = (qh * hd, kvh * hd);
    OpCase::new(
        &format!("attention q{qh} kv{kvh} d{hd}"),
        bucket,
        qw + 2 * kvw,
        qw,
    )
}

/// Attention over the case's input as q | k | v, softmax scale `sharp / sqrt(hd)`.
fn check_attention(
    gpu: &std::sync::Arc<flashrt_runtime::backend::cuda::CudaBackend>,
    dtype: DType,
    case: &OpCase,
    qh: usize,
    kvh: usize,
    hd: usize,
    sharp: f64,
) {
    let (qw, kvw) = (qh * hd, kvh * hd);
    case.check(gpu, dtype, |b| {
        let shape = [b.max_seq(), kvh, hd];
        let ck = b.state("cache_k", &shape, StateKind::Key);
        let cv = b.state("cache_v", &shape, StateKind::Value);
        b.op(Op::Attention {
            q: b.input(0, qw),
            k: b.input(qw, kvw),
            v: b.input(qw + kvw, kvw),
            cache_k: ck,
            cache_v: cv,
            out: b.output(0, qw),
            q_heads: qh,
            kv_heads: kvh,
            head_dim: hd,
            scale: F64(sharp * (hd as f64).powf(-0.5)),
        });
    });
}

/// Small phases (decode steps and buckets of <= 8 rows) run attention_decode.cu: one block per
/// (KV head, split) for every query head of the group and every row, tensor cores for
/// bf16/f16, CUDA cores for f32. Long contexts (hundreds to ~3k positions, so many splits,
/// empty splits past the context and pieces that end inside a 16-key chunk), GQA 6:1 at
/// head_dim 256 (the 27B shape 24/4 too), multi-row phases (every row with its own piece),
/// G * rows from 6 to 48 query vectors per block, G = 1 and 16, head_dim below the
/// instantiated bound (200 -> 256, 96 -> 128), and sharper softmax (scale x4) so that the
/// running max moves often. 64 KV heads leave few splits (2 on a 132-SM device), so a block
/// streams more tiles than its 6-stage ring holds (the mbarrier phases wrap: 7 tiles of 32
/// keys in bf16/f16, 13 of 16 in f32).
#[test]
fn attention_decode() {
    let Some(gpu) = cuda("attention_decode") else {
        return;
    };
    let rep = |n: usize, len: usize, tail: &[usize]| {
        let mut v = vec![len; n];
        v.extend_from_slice(tail);
        v
    };
    for dtype in [DType::F32, DType::Bf16, DType::F16] {
        for (bucket, qh, kvh, hd, sharp, steps) in [
            (5, 24, 4, 256, 1.0, rep(40, 5, &[3, 1, 1, 1])),
            (5, 12, 2, 256, 4.0, rep(120, 5, &[1, 2, 1])),
            (64, 6, 1, 256, 1.0, rep(40, 64, &[1, 1, 1])),
            (8, 12, 2, 128, 1.0, rep(100, 8, &[7, 1, 1])),
            (4, 8, 8, 64, 4.0, rep(60, 4, &[3, 1])),
            (7, 4, 1, 200, 1.0, rep(30, 7, &[1, 6, 1])),
            (2, 16, 1, 96, 4.0, rep(100, 2, &[1, 1])),
            (8, 64, 64, 256, 4.0, rep(50, 8, &[1, 3, 1])),
        ] {
            let (qw, kvw) = (qh * hd, kvh * hd);
            let mut case = OpCase::new(
                &format!("attention_decode q{qh} kv{kvh} d{hd} x{sharp}"),
                bucket,
                qw + 2 * kvw,
                qw,
            );
            case.max_seq = steps.iter().sum::<usize>() + 16;
            case.steps = steps;
            check_attention(&gpu, dtype, &case, qh, kvh, hd, sharp);
        }
    }
}

#[test]
fn causal_conv1d() {
    let Some(gpu) = cuda("causal_conv1d") else {
        return;
    };
    for dtype in DTYPES {
        // `off`: x starts `off` columns into the input (row stride c + off). Whole 16-byte
        // packs of channels with k <= 4 take the fused `conv_vec` (2560: a partial 256-channel
        // tile for bf16; 130 rows: three 64-row blocks, the last partial; the 128-row step
        // rolls the state from rows past the first warp's window; k = 3 and 2 pad the taps);
        // odd sizes, k = 5 and the misaligned window (bf16 at off 4) the two scalar kernels.
        for (bucket, c, k, act, bias, off) in [
            (3, 783, 4, Act::Silu, true, 0),
            (50, 50, 3, Act::Identity, false, 0),
            (50, 783, 4, Act::Silu, false, 0),
            (130, 2560, 4, Act::Silu, true, 0),
            (64, 6144, 4, Act::Silu, false, 0),
            (50, 512, 3, Act::Identity, true, 0),
            (3, 256, 2, Act::Silu, true, 0),
            (50, 256, 5, Act::Silu, true, 0),
            (50, 512, 4, Act::Silu, true, 4),
        ] {
            let mut case = OpCase::new(
                &format!("conv c{c} k{k} {act:?} bias={bias} off={off}"),
                bucket,
                c + off,
                c,
            );
            // Many single-token steps: the state must roll correctly when len < K - 1.
            case.steps.extend([1, 1, 2]);
            case.check(&gpu, dtype, |b| {
                let weight = {
                    let v = b.rng.vec(c * k, -0.6, 0.6);
                    b.param("conv_w", v)
                };
                let bias = bias.then(|| {
                    let v = b.rng.vec(c, -0.5, 0.5);
                    b.param("conv_b", v)
                });
                let state = b.state("conv_state", &[k - 1, c], StateKind::Conv);
                b.op(Op::CausalConv1d {
                    x: b.input(off, c),
                    weight,
                    bias,
                    state,
                    out: b.output(0, c),
                    act,
                    kernel: k,
                });
            });
        }
    }
}

#[test]
fn gated_deltanet() {
    let Some(gpu) = cuda("gated_deltanet") else {
        return;
    };
    // Buckets below 32 rows: the token-by-token kernel (every phase).
    for dtype in DTYPES {
        for (bucket, hk, hv, dk, dv) in [
            (3, 1, 1, 3, 50),
            (20, 2, 4, 50, 50),
            (20, 2, 6, 128, 128),
            (3, 1, 2, 256, 64),
        ] {
            check_gated_deltanet(&gpu, dtype, bucket, hk, hv, dk, dv, None, false);
        }
    }
    // Prefill buckets of >= 32 rows: the chunked kernel (64-row chunks) for prefill steps,
    // the token kernel for the decode steps in between, each continuing from the state the
    // other left. Lengths that are and are not multiples of 64, below 64 (2 rows), chunks
    // after decode steps; dk below the instantiated bound (100 -> 128, 50 -> 64), dv below
    // and not a multiple of the 64-column block; the 27B head shape (dk = dv = 128, 3
    // value heads per key head). Even heads decay slowly (tens of tokens or more), so the
    // state carried across chunks and calls matters. The last two have rows whose q, k, v
    // segments are 16-byte aligned (input width a multiple of 8), which the kernel loads with
    // cp.async; the others go element by element; dv 40 ends in a partial column block. The
    // 32-row bucket runs one padded chunk a call (a stored prompt's short suffix).
    for dtype in DTYPES {
        for (bucket, hk, hv, dk, dv, steps) in [
            (32, 2, 6, 128, 128, Some(vec![32, 20, 1, 32, 5, 32])),
            (50, 2, 4, 50, 50, None),
            (200, 2, 6, 128, 128, None),
            (130, 1, 2, 64, 50, None),
            (130, 1, 2, 50, 70, Some(vec![130, 64, 1, 100])),
            (96, 2, 4, 100, 130, Some(vec![96, 65, 1, 2, 96])),
            (256, 1, 3, 128, 128, Some(vec![256, 2, 64, 1, 193, 1])),
            (128, 1, 4, 128, 40, Some(vec![128, 70, 1, 100])),
            (130, 2, 4, 64, 64, None),
        ] {
            check_gated_deltanet(&gpu, dtype, bucket, hk, hv, dk, dv, steps, true);
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn check_gated_deltanet(
    gpu: &std::sync::Arc<flashrt_runtime::backend::cuda::CudaBackend>,
    dtype: DType,
    bucket: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    steps: Option<Vec<usize>>,
    slow_heads: bool,
) {
    let qkv = 2 * hk * dk + hv * dv;
    let mut case = OpCase::new(
        &format!("gdn hk{hk} hv{hv} dk{dk} dv{dv}"),
        bucket,
        qkv + 2 * hv,
        hv * dv,
    );
    if let Some(steps) = steps {
        case.max_seq = steps.iter().sum::<usize>() + 16;
        case.steps = steps;
    }
    case.check(gpu, dtype, |b| {
        let a_log = {
            let mut v = b.rng.vec(hv, -1.0, 1.0);
            if slow_heads {
                // A_log in [-6, -4]: per-token decay exp(g) in about [0.96, 0.9997].
                for x in v.iter_mut().step_by(2) {
                    *x -= 5.0;
                }
            }
            b.param("A_log", v)
        };
        let dt_bias = {
            let v = b.rng.vec(hv, -1.0, 1.0);
            b.param("dt_bias", v)
        };
        let state = b.state("recurrent", &[hv, dk, dv], StateKind::Recurrent);
        b.op(Op::GatedDeltaNet {
            qkv: b.input(0, qkv),
            a: b.input(qkv, hv),
            b: b.input(qkv + hv, hv),
            a_log,
            dt_bias,
            state,
            out: b.output(0, hv * dv),
            key_heads: hk,
            value_heads: hv,
            key_dim: dk,
            value_dim: dv,
        });
    });
}

#[test]
fn gated_rms_norm() {
    let Some(gpu) = cuda("gated_rms_norm") else {
        return;
    };
    for dtype in DTYPES {
        // `off`: the gate starts `off` columns after x (input row stride 2 width + off).
        // Whole 16-byte packs take the vector kernel (group 128: 4 threads of 4 packs; 5120:
        // one group per block); odd sizes and a misaligned gate (bf16 at off 4) the scalar one.
        for (bucket, width, group, shared, order, off) in [
            (3, 150, 50, true, GateOrder::NormThenGate, 0),
            (50, 783, 261, false, GateOrder::GateThenNorm, 0),
            (50, 512, 128, true, GateOrder::GateThenNorm, 0),
            (3, 783, 783, false, GateOrder::NormThenGate, 0),
            (64, 3072, 128, false, GateOrder::NormThenGate, 0),
            (130, 1024, 256, true, GateOrder::GateThenNorm, 0),
            (3, 5120, 5120, false, GateOrder::NormThenGate, 0),
            (50, 1024, 128, true, GateOrder::NormThenGate, 4),
        ] {
            let case = OpCase::new(
                &format!("gated_rms_norm w{width} g{group} shared={shared} {order:?} off={off}"),
                bucket,
                2 * width + off,
                width,
            );
            case.check(&gpu, dtype, |b| {
                let weight = {
                    let v = b.rng.vec(if shared { group } else { width }, 0.5, 1.5);
                    b.param("norm_w", v)
                };
                b.op(Op::GatedRmsNorm {
                    x: b.input(0, width),
                    gate: b.input(width + off, width),
                    weight,
                    shared_weight: shared,
                    out: b.output(0, width),
                    eps: F64(1e-5),
                    group,
                    order,
                });
            });
        }
    }
}

#[test]
fn mamba2_scan() {
    let Some(gpu) = cuda("mamba2_scan") else {
        return;
    };
    for dtype in DTYPES {
        for (bucket, heads, p, groups, n, dt_min) in [
            (3, 3, 50, 1, 50, None),
            (50, 4, 16, 2, 128, Some(1e-3)),
            (50, 2, 64, 2, 256, Some(0.05)),
            (3, 6, 3, 3, 3, None),
            // Buckets of >= 64 rows on bf16/f16 run the chunked kernel (state size <= 128):
            // whole and partial 64-row chunks, head_dim not a multiple of its 32-column
            // tiles, state sizes below the instantiated 64 / 128, and (256) the scan kernel.
            (130, 4, 16, 2, 128, Some(1e-3)),
            (64, 2, 64, 2, 64, None),
            (100, 3, 50, 1, 50, None),
            (70, 2, 33, 1, 96, Some(0.05)),
            (64, 2, 16, 1, 256, None),
        ] {
            let xbc = heads * p + 2 * groups * n;
            let case = OpCase::new(
                &format!("mamba2 h{heads} p{p} g{groups} n{n} dt_min={dt_min:?}"),
                bucket,
                xbc + heads,
                heads * p,
            );
            case.check(&gpu, dtype, |b| {
                let a_log = {
                    let v = b.rng.vec(heads, -1.0, 1.5);
                    b.param("A_log", v)
                };
                let d = {
                    let v = b.rng.vec(heads, 0.5, 1.5);
                    b.param("D", v)
                };
                let dt_bias = {
                    let v = b.rng.vec(heads, -2.0, 0.0);
                    b.param("dt_bias", v)
                };
                let state = b.state("ssm", &[heads, p, n], StateKind::Recurrent);
                b.op(Op::Mamba2Scan {
                    xbc: b.input(0, xbc),
                    dt: b.input(xbc, heads),
                    a_log,
                    d,
                    dt_bias,
                    state,
                    out: b.output(0, heads * p),
                    heads,
                    head_dim: p,
                    groups,
                    state_size: n,
                    dt_min: dt_min.map(F64),
                });
            });
        }
    }
}

#[test]
fn store_last_row_and_load_state() {
    let Some(gpu) = cuda("store_last_row_and_load_state") else {
        return;
    };
    for dtype in DTYPES {
        for (bucket, width) in [(3, 50), (50, 783)] {
            OpCase::new(&format!("store/load state w{width}"), bucket, width, width).check(
                &gpu,
                dtype,
                |b| {
                    let hidden = b.state("hidden", &[width], StateKind::Hidden);
                    b.op(Op::StoreLastRow {
                        x: b.input(0, width),
                        state: hidden,
                    });
                    b.op(Op::LoadState {
                        state: hidden,
                        out: b.output(0, width),
                    });
                },
            );
        }
    }
}
