//! `flashrt bench`: time-to-first-token cold and restored, snapshot and restore next to the
//! copy floor, decode step next to the weight-bandwidth floor — per prompt length, on the
//! best available backend, with progress on stderr and a table plus JSON at the end.
//!
//! Every timed region ends with a device synchronisation; repeated measurements report the
//! median. Cold TTFT is measured after a warm-up prefill at the same length (so graph capture
//! and lazy kernel loading are not counted) from a freshly reset session; restored TTFT is a
//! restore of the prompt's capsule plus one decode step.

use crate::runtime::{Backend, Model, Session};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// What to measure.
pub struct BenchOptions {
    pub lengths: Vec<usize>,
    pub iters: usize,
    pub decode_steps: usize,
    pub seed: u64,
}

#[derive(Serialize)]
pub struct LengthResult {
    pub tokens: usize,
    pub cold_ttft_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub capsule_bytes: usize,
    pub snapshot_ms: f64,
    pub restore_ms: f64,
    pub copy_floor_ms: f64,
    pub restored_ttft_ms: f64,
    pub restored_speedup: f64,
    pub decode_step_ms: f64,
}

#[derive(Serialize)]
pub struct BenchReport {
    pub model: String,
    pub backend: String,
    pub dtype: String,
    pub weight_bytes: usize,
    pub copy_bandwidth_gb_s: f64,
    pub decode_floor_ms: f64,
    pub load_ms: f64,
    pub lengths: Vec<LengthResult>,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn progress(msg: &str) {
    eprintln!("[bench] {msg}");
}

/// Deterministic prompt ids in `[3, vocab)`.
fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| 3 + (crate::runtime::loader::mix64(i ^ 0x5eed) % (vocab as u64 - 3)) as u32)
        .collect()
}

/// Time `f` on the session, including the device work it queued.
fn timed(
    s: &mut Session,
    f: impl FnOnce(&mut Session) -> crate::runtime::Result<()>,
) -> Result<f64, String> {
    let t = Instant::now();
    f(s).map_err(|e| e.to_string())?;
    s.synchronize().map_err(|e| e.to_string())?;
    Ok(ms(t))
}

pub fn run(
    backend: Arc<dyn Backend>,
    ir: &crate::ir::ModelIr,
    opts: &BenchOptions,
) -> Result<BenchReport, String> {
    let err = |e: crate::runtime::Error| e.to_string();
    if let Some(&bad) = opts.lengths.iter().find(|&&n| n == 0 || n >= ir.max_seq) {
        return Err(format!(
            "prompt length {bad} must be between 1 and max_seq - 1 = {}",
            ir.max_seq - 1
        ));
    }
    progress(&format!(
        "loading {} with random weights (seed {}) on {}",
        ir.name,
        opts.seed,
        backend.name()
    ));
    let t = Instant::now();
    let model = Model::with_random_weights(backend.clone(), ir, opts.seed).map_err(err)?;
    let load_ms = ms(t);
    let layout = &model.compiled().layout;
    let weight_bytes = layout.arena_bytes(crate::ir::Role::Weight);
    progress(&format!(
        "loaded {} of weights in {:.0} ms",
        crate::cli::human_bytes(weight_bytes),
        load_ms
    ));

    // Copy bandwidth (bytes read + written per second) at 1 GiB: the floor for both capsule
    // copies and weight streaming.
    let probe = 1 << 30;
    let t_probe = backend.copy_seconds(probe, 10).map_err(err)?;
    let copy_bw = 2.0 * probe as f64 / t_probe;
    let decode_floor_ms = weight_bytes as f64 / copy_bw * 1e3;
    progress(&format!(
        "copy bandwidth {:.0} GB/s (1 GiB); decode floor {decode_floor_ms:.2} ms",
        copy_bw / 1e9
    ));

    let mut session = model.session().map_err(err)?;
    let mut results = Vec::new();
    for &n in &opts.lengths {
        let tokens = prompt(n, ir.vocab);
        progress(&format!("{n} tokens: warm-up prefill"));
        session.reset().map_err(err)?;
        timed(&mut session, |s| s.append(&tokens))?;
        progress(&format!("{n} tokens: cold prefill"));
        session.reset().map_err(err)?;
        let cold = timed(&mut session, |s| {
            s.append(&tokens)?;
            crate::runtime::argmax(s.last_logits())
                .map(|_| ())
                .ok_or(crate::runtime::Error::Input("empty logits".into()))
        })?;

        progress(&format!("{n} tokens: snapshot x{}", opts.iters));
        let mut snaps = Vec::new();
        let mut capsule = None;
        for _ in 0..opts.iters.max(1) {
            let t = Instant::now();
            let c = session.snapshot().map_err(err)?;
            session.synchronize().map_err(err)?;
            snaps.push(ms(t));
            capsule = Some(c);
        }
        let capsule = capsule.expect("at least one snapshot");
        let bytes = capsule.bytes();
        let floor_ms = backend.copy_seconds(bytes, 10).map_err(err)? * 1e3;

        progress(&format!("{n} tokens: restore x{}", opts.iters));
        let mut restores = Vec::new();
        let mut restored_ttft = Vec::new();
        for _ in 0..opts.iters.max(1) {
            restores.push(timed(&mut session, |s| s.restore(&capsule))?);
            restored_ttft.push(timed(&mut session, |s| {
                s.restore(&capsule)?;
                s.decode_greedy(1).map(|_| ())
            })?);
        }

        progress(&format!("{n} tokens: {} decode steps", opts.decode_steps));
        session.restore(&capsule).map_err(err)?;
        session.decode_greedy(2).map_err(err)?; // warm the decode graph
        let mut steps = Vec::new();
        for _ in 0..opts.decode_steps.max(1) {
            steps.push(timed(&mut session, |s| s.decode_greedy(1).map(|_| ()))?);
        }
        let r = LengthResult {
            tokens: n,
            cold_ttft_ms: cold,
            prefill_tokens_per_s: n as f64 / (cold / 1e3),
            capsule_bytes: bytes,
            snapshot_ms: median(snaps),
            restore_ms: median(restores),
            copy_floor_ms: floor_ms,
            restored_ttft_ms: median(restored_ttft),
            restored_speedup: 0.0,
            decode_step_ms: median(steps),
        };
        let r = LengthResult {
            restored_speedup: r.cold_ttft_ms / r.restored_ttft_ms,
            ..r
        };
        progress(&format!(
            "{n} tokens: cold TTFT {:.1} ms, restored TTFT {:.2} ms, snapshot {:.3} ms, restore {:.3} ms (floor {:.3} ms)",
            r.cold_ttft_ms, r.restored_ttft_ms, r.snapshot_ms, r.restore_ms, r.copy_floor_ms
        ));
        results.push(r);
        drop(capsule);
    }
    Ok(BenchReport {
        model: ir.name.clone(),
        backend: model.backend_name(),
        dtype: layout.target.dtype.name().to_string(),
        weight_bytes,
        copy_bandwidth_gb_s: copy_bw / 1e9,
        decode_floor_ms,
        load_ms,
        lengths: results,
    })
}

/// The table `flashrt bench` prints.
pub fn render(r: &BenchReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "flashrt bench — {} ({}) on {}",
        r.model, r.dtype, r.backend
    );
    let _ = writeln!(
        s,
        "weights {}, copy bandwidth {:.0} GB/s, decode floor {:.2} ms (weight bytes / bandwidth)\n",
        crate::cli::human_bytes(r.weight_bytes),
        r.copy_bandwidth_gb_s,
        r.decode_floor_ms
    );
    let _ = writeln!(
        s,
        "{:>7} {:>11} {:>10} {:>11} {:>10} {:>10} {:>10} {:>12} {:>8} {:>10}",
        "tokens",
        "cold TTFT",
        "tok/s",
        "capsule",
        "snapshot",
        "restore",
        "copy floor",
        "restored TTFT",
        "speedup",
        "decode"
    );
    for l in &r.lengths {
        let _ = writeln!(
            s,
            "{:>7} {:>8.1} ms {:>10.0} {:>11} {:>7.3} ms {:>7.3} ms {:>7.3} ms {:>9.2} ms {:>7.1}x {:>7.2} ms",
            l.tokens,
            l.cold_ttft_ms,
            l.prefill_tokens_per_s,
            crate::cli::human_bytes(l.capsule_bytes),
            l.snapshot_ms,
            l.restore_ms,
            l.copy_floor_ms,
            l.restored_ttft_ms,
            l.restored_speedup,
            l.decode_step_ms
        );
    }
    s
}
