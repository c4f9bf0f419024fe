//! The host sampler on a logits row as wide as Qwen3.5/3.6's vocabulary (248,320): greedy,
//! the OpenAI default (temperature 1, no cut), temperature 0.7 with top-p 0.9, top-k 50 and
//! min-p 0.05, on a flat row (what random weights give: every candidate carries weight) and
//! a peaked one (a trained model: a few candidates carry the mass); and the log-probabilities
//! a request with `logprobs` / `top_logprobs: 5` costs per token.
//!
//! ```sh
//! cargo bench --bench sampling
//! ```

use criterion::{Criterion, criterion_group, criterion_main};
use flashrt::runtime::SamplerState;
use flashrt::runtime::sampling::xoshiro256ss_next;

const VOCAB: usize = 248_320;

fn rows() -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = [1u64, 2, 3, 4];
    let mut uniform = move || (xoshiro256ss_next(&mut rng) >> 40) as f32 / (1u64 << 24) as f32;
    let flat = (0..VOCAB).map(|_| uniform() * 0.5 - 0.25).collect();
    let peaked = (0..VOCAB)
        .map(|i| {
            let x = uniform();
            if i % 4099 == 17 {
                14.0 + x
            } else {
                x * 6.0 - 3.0
            }
        })
        .collect();
    vec![("flat", flat), ("peaked", peaked)]
}

fn bench_sampling(c: &mut Criterion) {
    let configs = [
        ("greedy", SamplerState::greedy()),
        ("t1", SamplerState::seeded(1, 1.0, 0, 1.0)),
        ("t0.7_top_p0.9", SamplerState::seeded(1, 0.7, 0, 0.9)),
        ("top_k50", SamplerState::seeded(1, 1.0, 50, 1.0)),
        (
            "min_p0.05",
            SamplerState::seeded(1, 1.0, 0, 1.0).with_min_p(0.05),
        ),
    ];
    let mut g = c.benchmark_group("sample_248320");
    for (row_name, row) in rows() {
        for (name, s) in &configs {
            let mut s = s.clone();
            g.bench_function(format!("{row_name}/{name}"), |b| {
                b.iter(|| std::hint::black_box(s.sample(std::hint::black_box(&row))))
            });
        }
        g.bench_function(format!("{row_name}/logprobs_top5"), |b| {
            b.iter(|| {
                std::hint::black_box(flashrt::runtime::sampling::logprobs(
                    std::hint::black_box(&row),
                    3,
                    5,
                ))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench_sampling);
criterion_main!(benches);
