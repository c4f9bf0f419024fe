//! Per-model benchmark targets, generated from the model descriptions: every `models/*.toml`
//! gets `<model>/decode_step`, `<model>/prefill_chunk_<bucket>` for each of its prefill
//! buckets, `<model>/snapshot` and `<model>/restore` (the list comes from
//! `flashrt::compiler::emit::bench_targets`, the same function that fills
//! `Model::BENCH_TARGETS` in generated code). A new model file gets benchmarks for free.
//!
//! ```sh
//! cargo bench --bench models                                  # CPU reference, small models
//! cargo bench --features cuda --bench models                  # best backend (CUDA on a GPU)
//! FLASHRT_BENCH_MODELS=qwen36_27b cargo bench --features cuda --bench models -- qwen36_27b
//! ```
//!
//! Models run with random weights on the best available backend. By default only models
//! whose weights take at most 1 GiB on that backend run (the 27B shape needs a GPU);
//! `FLASHRT_BENCH_MODELS=name,name` picks models explicitly; `FLASHRT_MODELS_DIR` points a
//! binary that was built elsewhere at the model files (default: the build tree's, else ./models).
//! Every timed region ends with a device synchronisation; state is reset or restored outside
//! the timed region.

use criterion::{Criterion, criterion_group, criterion_main};
use flashrt::compiler::emit::{BenchKind, bench_targets};
use flashrt::ir::{ModelIr, Role, compile};
use flashrt::runtime::{Backend, Model, Session, backend};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn models(backend: &Arc<dyn Backend>) -> Vec<ModelIr> {
    // The repository's models/, or `$FLASHRT_MODELS_DIR` / ./models where the bench binary runs
    // on another machine (a GPU host that got the binary, not the build tree).
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let dir = match std::env::var_os("FLASHRT_MODELS_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None if built.is_dir() => built,
        None => std::path::PathBuf::from("models"),
    };
    let wanted: Option<Vec<String>> = std::env::var("FLASHRT_BENCH_MODELS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("models/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    files
        .iter()
        .filter_map(|p| {
            let src = std::fs::read_to_string(p).ok()?;
            let ir = flashrt::compiler::model_from_toml(&src, &p.display().to_string()).ok()?;
            let weight_bytes = compile(&ir, backend.target(&ir))
                .layout
                .arena_bytes(Role::Weight);
            let chosen = match &wanted {
                Some(names) => names.contains(&ir.name),
                None => weight_bytes <= 1 << 30,
            };
            chosen.then_some(ir)
        })
        .collect()
}

fn tokens(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| 3 + (flashrt::runtime::init::mix64(i ^ salt) % (vocab as u64 - 3)) as u32)
        .collect()
}

/// Time `iters` runs of `timed`, each after an untimed `setup`, device-synchronised.
fn measure(
    s: &mut Session,
    iters: u64,
    mut setup: impl FnMut(&mut Session),
    mut timed: impl FnMut(&mut Session),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        setup(s);
        s.synchronize().expect("sync");
        let t = Instant::now();
        timed(s);
        s.synchronize().expect("sync");
        total += t.elapsed();
    }
    total
}

fn bench_models(c: &mut Criterion) {
    let backend = backend::best().expect("a backend");
    for ir in models(&backend) {
        let model = Model::with_random_weights(backend.clone(), &ir, 7).expect("random weights");
        let mut session = model.session().expect("session");
        // As a prompt is served: only the last row's logits reach the host (all rows would
        // be a vocab x bucket copy per chunk, 2 GB at the 27B shape's 2048-row bucket).
        session.set_logits_mode(flashrt::runtime::LogitsMode::Last);
        // The boundary the decode/snapshot/restore targets start from: a mid-length position.
        let pos = (ir.max_seq / 2).min(1024);
        session.append(&tokens(pos, ir.vocab, 1)).expect("prefill");
        let capsule = session.snapshot().expect("snapshot");
        let mut group = c.benchmark_group(&ir.name);
        group.sample_size(10);
        for target in bench_targets(&ir) {
            match target.kind {
                BenchKind::DecodeStep => group.bench_function(&target.name, |b| {
                    b.iter_custom(|iters| {
                        measure(
                            &mut session,
                            iters,
                            |s| s.restore(&capsule).expect("restore"),
                            |s| {
                                s.decode_greedy(1).expect("decode");
                            },
                        )
                    })
                }),
                BenchKind::PrefillChunk { bucket } => {
                    let chunk = tokens(bucket, ir.vocab, 2);
                    group.bench_function(&target.name, |b| {
                        b.iter_custom(|iters| {
                            measure(
                                &mut session,
                                iters,
                                |s| s.reset().expect("reset"),
                                |s| s.append(&chunk).expect("prefill chunk"),
                            )
                        })
                    })
                }
                BenchKind::Snapshot => group.bench_function(&target.name, |b| {
                    b.iter_custom(|iters| {
                        measure(
                            &mut session,
                            iters,
                            |s| s.restore(&capsule).expect("restore"),
                            |s| {
                                std::hint::black_box(s.snapshot().expect("snapshot"));
                            },
                        )
                    })
                }),
                // Into a session holding other rows (reset first): a restore into the session
                // that holds the capsule's KV rows copies only the rest (`Session::rows_held`).
                BenchKind::Restore => group.bench_function(&target.name, |b| {
                    b.iter_custom(|iters| {
                        measure(
                            &mut session,
                            iters,
                            |s| s.reset().expect("reset"),
                            |s| s.restore(&capsule).expect("restore"),
                        )
                    })
                }),
            };
        }
        group.finish();
    }
}

criterion_group!(benches, bench_models);
criterion_main!(benches);
