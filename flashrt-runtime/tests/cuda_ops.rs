//! Every plan op on the GPU against the CPU reference, one op at a time (see
//! `cuda_support` for the harness). Each case runs with an f32 GPU target (checks the kernel
//! logic to rounding) and a bf16 target (the fast path), with seeded random data and odd sizes
//! (3, 50, 783) so that tails, partial warps and unaligned column windows are exercised.
//! Skips with a message when no CUDA device is present.
#![cfg(feature = "cuda")]

mod cuda_support;

use cuda_support::*;
use flashrt_runtime::ir::{Act, F64, GateOrder, NormWeight, Op, StateKind};

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
        for (bucket, width, group, kind, weighted) in [
            (3, 783, 783, NormWeight::Plain, true),
            (50, 150, 50, NormWeight::OnePlus, true),
            (50, 783, 3, NormWeight::Plain, false),
            (3, 1024, 256, NormWeight::OnePlus, true),
        ] {
            let case = OpCase::new(
                &format!("rms_norm w{width} g{group} {kind:?} weighted={weighted}"),
                bucket,
                width,
                width,
            );
            case.check(&gpu, dtype, |b| {
                let w = weighted.then(|| {
                    let v = b.rng.vec(group, -1.0, 1.0);
                    b.param("w", v)
                });
                // In place on the input window, then copied out: checks `out == x` aliasing.
                let x = b.input(0, width);
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
    for dtype in DTYPES {
        for (bucket, k, n, bias, accumulate) in [
            (3, 783, 50, true, false),
            (50, 50, 783, false, true),
            (50, 783, 783, true, true),
            (3, 256, 512, false, false),
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

#[test]
fn mul_and_unary() {
    let Some(gpu) = cuda("mul_and_unary") else {
        return;
    };
    for dtype in DTYPES {
        for act in [Act::Identity, Act::Silu, Act::Sigmoid, Act::Relu2] {
            for (bucket, width) in [(3, 783), (50, 50)] {
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
        for (bucket, heads, head_dim, rotary, theta) in [
            (3, 3, 50, 50, 1e4),
            (50, 4, 64, 16, 1e7),
            (50, 2, 256, 64, 1e6),
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
            let (qw, kvw) = (qh * hd, kvh * hd);
            let case = OpCase::new(
                &format!("attention q{qh} kv{kvh} d{hd}"),
                bucket,
                qw + 2 * kvw,
                qw,
            );
            case.check(&gpu, dtype, |b| {
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
                    scale: F64((hd as f64).powf(-0.5)),
                });
            });
        }
    }
}

#[test]
fn causal_conv1d() {
    let Some(gpu) = cuda("causal_conv1d") else {
        return;
    };
    for dtype in DTYPES {
        for (bucket, c, k, act, bias) in [
            (3, 783, 4, Act::Silu, true),
            (50, 50, 3, Act::Identity, false),
            (50, 783, 4, Act::Silu, false),
        ] {
            let mut case =
                OpCase::new(&format!("conv c{c} k{k} {act:?} bias={bias}"), bucket, c, c);
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
                    x: b.input(0, c),
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
    for dtype in DTYPES {
        for (bucket, hk, hv, dk, dv) in [
            (3, 1, 1, 3, 50),
            (50, 2, 4, 50, 50),
            (50, 2, 6, 128, 128),
            (3, 1, 2, 256, 64),
        ] {
            let qkv = 2 * hk * dk + hv * dv;
            let case = OpCase::new(
                &format!("gdn hk{hk} hv{hv} dk{dk} dv{dv}"),
                bucket,
                qkv + 2 * hv,
                hv * dv,
            );
            case.check(&gpu, dtype, |b| {
                let a_log = {
                    let v = b.rng.vec(hv, -1.0, 1.0);
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
    }
}

#[test]
fn gated_rms_norm() {
    let Some(gpu) = cuda("gated_rms_norm") else {
        return;
    };
    for dtype in DTYPES {
        for (bucket, width, group, shared, order) in [
            (3, 150, 50, true, GateOrder::NormThenGate),
            (50, 783, 261, false, GateOrder::GateThenNorm),
            (50, 512, 128, true, GateOrder::GateThenNorm),
            (3, 783, 783, false, GateOrder::NormThenGate),
        ] {
            let case = OpCase::new(
                &format!("gated_rms_norm w{width} g{group} shared={shared} {order:?}"),
                bucket,
                2 * width,
                width,
            );
            case.check(&gpu, dtype, |b| {
                let weight = {
                    let v = b.rng.vec(if shared { group } else { width }, 0.5, 1.5);
                    b.param("norm_w", v)
                };
                b.op(Op::GatedRmsNorm {
                    x: b.input(0, width),
                    gate: b.input(width, width),
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
