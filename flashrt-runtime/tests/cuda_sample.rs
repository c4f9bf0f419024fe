//! The device sampler (kernels/sample.cu) against the host sampler (flashrt-runtime/src/
//! sampling.rs, itself checked against a plain sort-and-walk implementation): the same token
//! from the same row and RNG state, on rows built to break a careless implementation — exact
//! ties (the order falls back to the index), values an ulp apart, both zeros, NaN and
//! infinities, ties that share the high radix digits, a flat 248k-wide row (a model with
//! random weights) and a peaked one — under greedy-adjacent and extreme temperatures, top-k,
//! top-p and min-p; the same rows with repetition, presence and frequency penalties (the
//! device penalizes a copy of the row). Then a whole session: sampled generation with the
//! device sampler equals the same generation sampled on the host, token for token, RNG state
//! included, with and without penalties.
//! Skips with a message when no CUDA device is present.
#![cfg(feature = "cuda")]

mod cuda_support;

use cuda_support::*;
use flashrt_runtime::backend::cuda::{CudaOptions, CudaSampler};
use flashrt_runtime::sampling::xoshiro256ss_next;
use flashrt_runtime::{LogitsMode, SamplerState, argmax};

fn rows() -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = [0x1234_5678_9abc_def0u64, 7, 11, 13];
    let mut next = move || xoshiro256ss_next(&mut rng);
    let mut rows = vec![
        ("all equal", vec![0.25f32; 3000]),
        (
            "ulps, zeros, NaN, -inf",
            (0..5000)
                .map(|i| match i % 7 {
                    0 => f32::from_bits(0x3f80_0000 + (i % 5) as u32),
                    1 => 0.0,
                    2 => -0.0,
                    3 => f32::NAN,
                    4 => f32::NEG_INFINITY,
                    _ => f32::from_bits(0x3f80_0000 - (i % 3) as u32),
                })
                .collect(),
        ),
        (
            "ties across radix digits",
            (0..20_000)
                .map(|i| {
                    f32::from_bits(0x4000_0000 | ((i * 2_654_435_761u64 as usize) as u32 & 0xfff))
                })
                .collect(),
        ),
        (
            "two near-tied leaders, +inf elsewhere ignored",
            (0..4096)
                .map(|i| match i {
                    17 => 9.0,
                    4000 => f32::from_bits(9.0f32.to_bits() - 1),
                    100 => f32::INFINITY,
                    _ => -3.0 + (i % 13) as f32 * 0.01,
                })
                .collect(),
        ),
        ("one finite", {
            let mut v = vec![f32::NAN; 777];
            v[500] = -1e30;
            v
        }),
    ];
    rows.push((
        "flat, 248320 wide",
        (0..248_320)
            .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32 * 0.2 - 0.1)
            .collect(),
    ));
    rows.push((
        "peaked, 65536 wide",
        (0..65_536)
            .map(|i| {
                let x = (next() >> 40) as f32 / (1u64 << 24) as f32;
                if i % 997 == 3 {
                    12.0 + x
                } else {
                    x * 4.0 - 8.0
                }
            })
            .collect(),
    ));
    rows
}

#[test]
fn device_sampler_chooses_what_the_host_sampler_chooses() {
    let Some(gpu) = cuda("device_sampler_chooses_what_the_host_sampler_chooses") else {
        return;
    };
    let mut dev = CudaSampler::new(&gpu, 248_320).expect("device sampler");
    // (temperature, top_k, top_p, min_p)
    let configs = [
        (1.0f32, 0usize, 1.0f32, 0.0f32),
        (0.7, 0, 0.9, 0.0),
        (1.3, 50, 1.0, 0.0),
        (0.5, 7, 0.5, 0.0),
        (1.0, 0, 1.0, 0.05),
        (1e-3, 0, 0.95, 0.0),
        (80.0, 0, 0.3, 0.0),
        (1.0, 0, 1e-7, 0.0),
        (1.0, 0, 1e-12, 0.0),
        (0.9, 40_000, 0.99, 0.001),
        (1.1, 1_000_000, 0.8, 0.0),
    ];
    let mut checked = 0;
    for (name, row) in rows() {
        for (c, &(t, k, p, mp)) in configs.iter().enumerate() {
            let mut host =
                SamplerState::seeded(c as u64 * 7919 + row.len() as u64, t, k, p).with_min_p(mp);
            let mut device = host.clone();
            let draws = if row.len() > 100_000 { 4 } else { 16 };
            for draw in 0..draws {
                let want = host.sample(&row);
                let (spec, rng) = device.draw_spec(row.len()).expect("not greedy");
                let got = dev.sample(&row, &spec).expect("device sample");
                if got.is_some() {
                    device.rng = rng;
                }
                assert_eq!(
                    got, want,
                    "{name}, config {c} {:?}, draw {draw}",
                    configs[c]
                );
                assert_eq!(device.rng, host.rng, "{name}, config {c}, draw {draw}: RNG");
                checked += 1;
            }
        }
    }
    // A row with no finite value: no token, and the host sampler draws nothing either.
    let mut host = SamplerState::seeded(3, 1.0, 0, 0.9);
    let nothing = vec![f32::NAN; 64];
    let (spec, _) = host.draw_spec(64).unwrap();
    assert_eq!(dev.sample(&nothing, &spec).unwrap(), None);
    assert_eq!(host.sample(&nothing), None);
    println!("device sampler: {checked} draws equal to the host sampler's");
}

/// Greedy on the device (`sample_argmax`, one launch) against the host's [`argmax`]: the
/// largest value that is not NaN, infinities included, the smallest index holding it, both zeros
/// equal; `None` only when every value is NaN.
#[test]
fn device_argmax_is_the_host_argmax() {
    let Some(gpu) = cuda("device_argmax_is_the_host_argmax") else {
        return;
    };
    let mut dev = CudaSampler::new(&gpu, 248_320).expect("device sampler");
    let mut cases = rows();
    let mut with = |name: &'static str, n: usize, set: &[(usize, f32)], fill: f32| {
        let mut v = vec![fill; n];
        for &(i, x) in set {
            v[i] = x;
        }
        cases.push((name, v));
    };
    with("every value NaN", 300, &[], f32::NAN);
    with("every value -inf", 300, &[], f32::NEG_INFINITY);
    with(
        "-inf and NaN",
        300,
        &[(0, f32::NAN), (299, f32::NEG_INFINITY)],
        f32::NAN,
    );
    with(
        "-0 before +0 (equal)",
        1000,
        &[(700, 0.0), (300, -0.0)],
        -5.0,
    );
    with(
        "+0 before -0 (equal)",
        1000,
        &[(300, 0.0), (700, -0.0)],
        -5.0,
    );
    with(
        "+inf twice",
        5000,
        &[(4999, f32::INFINITY), (1234, f32::INFINITY)],
        1.0,
    );
    with(
        "+inf after NaN",
        5000,
        &[(0, f32::NAN), (4, f32::INFINITY)],
        1.0,
    );
    with("max at the last index", 248_320, &[(248_319, 3.0)], 2.0);
    with(
        "max at index 0, ties later",
        248_320,
        &[(0, 3.0), (9, 3.0), (248_000, 3.0)],
        -1.0,
    );
    with(
        "ulp apart",
        4096,
        &[(17, 1.0), (4000, f32::from_bits(1.0f32.to_bits() + 1))],
        0.5,
    );
    for (name, row) in &cases {
        let want = argmax(row);
        assert_eq!(dev.argmax(row).unwrap(), want, "{name}");
    }
    println!(
        "device argmax: {} rows equal to the host argmax",
        cases.len()
    );
}

/// Sampled generation through sessions: the device sampler (default) and the host sampler
/// (`device_sampler: false`) on identical weights give identical tokens and RNG states,
/// also across a snapshot / restore (the restored row is on the host, not the device).
#[test]
fn sessions_sample_the_same_on_device_and_host() {
    let name = "sessions_sample_the_same_on_device_and_host";
    let Some(on) = cuda(name) else {
        return;
    };
    let Some(off) = cuda_with(
        name,
        CudaOptions {
            device_sampler: false,
            ..CudaOptions::default()
        },
    ) else {
        return;
    };
    let json = QWEN_LIKE;
    let opts = flashrt_runtime::ir::hf::HfOptions {
        name: Some("gpu_test".into()),
        max_seq: Some(256),
        prefill_buckets: Some(vec![8, 32]),
        dtype: Some(flashrt_runtime::ir::DType::Bf16),
        ..Default::default()
    };
    let ir = flashrt_runtime::ir::hf::ir_from_hf_config(json, &opts).unwrap();
    let run = |backend: std::sync::Arc<flashrt_runtime::backend::cuda::CudaBackend>,
               sampler: SamplerState| {
        let compiled = std::sync::Arc::new(flashrt_runtime::ir::compile(
            &ir,
            flashrt_runtime::backend::Backend::target(backend.as_ref(), &ir),
        ));
        let w = round_weights(flashrt_runtime::random_weights(&compiled, 5));
        let model = flashrt_runtime::Model::from_compiled(backend, compiled, w).unwrap();
        let mut s = model.session().unwrap();
        s.set_logits_mode(LogitsMode::Last);
        s.set_sampler(sampler);
        let prompt: Vec<u32> = (0..21).map(|i| (i * 37 % 1000) as u32).collect();
        s.append(&prompt).unwrap();
        let mut toks = s.generate(12).unwrap();
        let cap = s.snapshot().unwrap();
        toks.extend(s.generate(6).unwrap());
        s.restore(&cap).unwrap();
        toks.extend(s.generate(6).unwrap());
        (toks, s.sampler().rng)
    };
    // A high temperature over random weights: many tokens are possible at every step; then
    // the same with penalties (the device penalizes a copy of the row, the host its own).
    let plain = SamplerState::seeded(77, 1.5, 0, 0.95).with_min_p(0.001);
    for (what, sampler) in [
        ("plain", plain.clone()),
        ("penalties", plain.clone().with_penalties(0.4, 0.3, 1.3)),
        // Greedy: the device's argmax (of a penalized copy) against the host's.
        (
            "greedy with penalties",
            SamplerState::greedy().with_penalties(0.4, 0.3, 1.3),
        ),
    ] {
        let (a, ra) = run(on.clone(), sampler.clone());
        let (b, rb) = run(off.clone(), sampler);
        assert_eq!(a, b, "{what}: device-sampled and host-sampled tokens");
        assert_eq!(ra, rb, "{what}");
        assert_eq!(
            a[12..18],
            a[18..24],
            "{what}: restore replays the same draws"
        );
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(
            distinct.len() > 3,
            "{what}: a sampled run should vary: {a:?}"
        );
    }
}

/// Step 0 on the device: penalties applied to a device copy of the row (kernels/sample.cu
/// `sample_penalize`) choose what the host chooses from its penalized copy, on the adversarial
/// rows, with histories that repeat tokens, start generating at different points, and name
/// ids outside the row; under every penalty alone and together.
#[test]
fn device_penalties_choose_what_the_host_chooses() {
    let Some(gpu) = cuda("device_penalties_choose_what_the_host_chooses") else {
        return;
    };
    let mut dev = CudaSampler::new(&gpu, 248_320).expect("device sampler");
    // (presence, frequency, repetition)
    let penalties = [
        (0.0f32, 0.0f32, 1.3f32),
        (0.0, 0.0, 0.7),
        (1.5, 0.0, 1.0),
        (0.0, 0.8, 1.0),
        (-0.5, 0.25, 1.1),
        (2.0, 2.0, 1e-3),
    ];
    let mut rng = [0x9e37_79b9_7f4a_7c15u64, 3, 5, 7];
    let mut checked = 0;
    for (name, row) in rows() {
        let n = row.len();
        // Random ids, some twice or more, one past the row, the first and the last.
        let mut history: Vec<u32> = (0..40)
            .map(|_| (xoshiro256ss_next(&mut rng) % n as u64) as u32)
            .collect();
        history.extend([
            history[3],
            history[3],
            history[7],
            n as u32 + 5,
            0,
            (n - 1) as u32,
        ]);
        for (c, &(pr, fr, rp)) in penalties.iter().enumerate() {
            for from in [0, 20, history.len()] {
                let mut host = SamplerState::seeded(c as u64 * 31 + n as u64, 1.0, 0, 0.95)
                    .with_penalties(pr, fr, rp);
                host.penalty_from = from;
                let mut device = host.clone();
                let list = device.penalty_list(&history, n).expect("penalties");
                let penalized = host.penalize(&row, &history).expect("penalties");
                for draw in 0..3 {
                    let want = host.sample(&penalized);
                    let (spec, next) = device.draw_spec(n).expect("not greedy");
                    let got = dev
                        .sample_penalized(&row, &spec, Some(&list))
                        .expect("device sample");
                    if got.is_some() {
                        device.rng = next;
                    }
                    assert_eq!(got, want, "{name}, penalties {c}, from {from}, draw {draw}");
                    checked += 1;
                }
            }
        }
    }
    println!("device penalties: {checked} draws equal to the host sampler's");
}
