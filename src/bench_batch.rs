//! `flashrt bench --batch 1,2,4,8`: the decode step of b sessions stepped together
//! ([`Model::step_batch`]: one graph replay on the CUDA backend) at each `--lengths` context,
//! next to the floor — the decode weights read once plus every row's state at that length
//! (what the step must read at least), at the copy bandwidth measured in the same run — and the
//! tokens per second it gives against one session.
//!
//! The b sessions are forks of one prefilled capsule (all at the same context), each choosing
//! its own greedy token every step (on the device, untimed); the timer covers `step_batch`
//! until the device has run it (each row's logits stay there, their host copies deferred, as a
//! one-session step's are), median over the steps.

use crate::runtime::{Model, Session};
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize)]
pub struct BatchRow {
    pub batch: usize,
    pub context: usize,
    /// Median `step_batch` time.
    pub step_ms: f64,
    /// This step against the one-session step at the same context.
    pub vs_one: f64,
    pub tokens_per_s: f64,
    /// (decode weights + batch x capsule bytes at `context`) / copy bandwidth.
    pub floor_ms: f64,
}

#[derive(Serialize)]
pub struct BatchReport {
    /// Why the backend steps these sessions one by one (`None`: one batched step).
    pub one_by_one: Option<String>,
    pub rows: Vec<BatchRow>,
    /// With `--profile`: every command of the largest batched step, timed, at each context.
    pub profiles: Vec<crate::bench::Profile>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Time `steps` batched steps of each size in `batches` at each context of `lengths`.
/// `decode_bytes` and `copy_gb_s` come from the engine's report (the same run).
pub fn run(
    model: &Model,
    batches: &[usize],
    lengths: &[usize],
    steps: usize,
    decode_bytes: usize,
    copy_gb_s: f64,
    profile: bool,
) -> Result<BatchReport, String> {
    let one_by_one = model.batch_unsupported();
    let mut profiles = Vec::new();
    // The batched step profiled: the largest size asked for that the model batches.
    let most = model.ir().batch_sizes().last().copied().unwrap_or(1);
    let profiled = batches
        .iter()
        .copied()
        .filter(|&b| b >= 2 && b <= most)
        .max();
    let vocab = model.vocab();
    let layout = &model.compiled().layout;
    let mut rows = Vec::new();
    for &len in lengths {
        let len = len.min(model.max_seq() - steps - 4);
        eprintln!("[bench --batch] prefilling {len} tokens");
        let mut base = model.session().map_err(|e| e.to_string())?;
        base.append(&crate::demo::tokens(4242, len, vocab))
            .map_err(|e| format!("prefill: {e}"))?;
        let cap = base.snapshot().map_err(|e| e.to_string())?;
        drop(base);
        let mut one = None;
        for &b in batches {
            let mut sessions: Vec<Session> = (0..b)
                .map(|_| model.fork(&cap))
                .collect::<Result<_, _>>()
                .map_err(|e| format!("batch {b}: {e}"))?;
            let mut times = Vec::with_capacity(steps);
            // Two untimed steps first: the first runs as plain launches, the second is captured.
            for i in 0..steps + 2 {
                let toks = next_tokens(&mut sessions);
                let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
                let t0 = Instant::now();
                model
                    .step_batch(&mut refs, &toks)
                    .and_then(|()| sessions[0].synchronize())
                    .map_err(|e| format!("batch {b}: step: {e}"))?;
                if i >= 2 {
                    times.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            if profile && one_by_one.is_none() && Some(b) == profiled {
                let toks = next_tokens(&mut sessions);
                let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
                let t = model
                    .profile_step_batch(&mut refs, &toks)
                    .map_err(|e| format!("batch {b}: profile: {e}"))?;
                profiles.push(crate::bench::profile_of(
                    format!("decode[{b}] at {len}"),
                    &t,
                ));
            }
            let step_ms = median(times);
            let one_ms = *one.get_or_insert(if b == 1 { step_ms } else { f64::NAN });
            let bytes = decode_bytes + b * layout.capsule_bytes(len + steps / 2);
            let row = BatchRow {
                batch: b,
                context: len,
                step_ms,
                vs_one: step_ms / one_ms,
                tokens_per_s: b as f64 / step_ms * 1e3,
                floor_ms: bytes as f64 / (copy_gb_s * 1e9) * 1e3,
            };
            eprintln!(
                "[bench --batch] {len} tokens, batch {b}: {step_ms:.2} ms per step, {:.0} tokens/s",
                row.tokens_per_s
            );
            rows.push(row);
        }
    }
    Ok(BatchReport {
        one_by_one,
        rows,
        profiles,
    })
}

pub fn render(r: &BatchReport) -> String {
    let mut out = match &r.one_by_one {
        None => "batched decode (one step for all rows):\n".to_string(),
        Some(why) => format!("batched decode: sessions stepped one by one ({why}):\n"),
    };
    out.push_str("  context  batch   step ms   x one   tokens/s   floor ms\n");
    for x in &r.rows {
        out.push_str(&format!(
            "  {:>7}  {:>5}  {:>8.2}  {:>6.2}  {:>9.0}  {:>9.2}\n",
            x.context, x.batch, x.step_ms, x.vs_one, x.tokens_per_s, x.floor_ms
        ));
    }
    out
}

/// Each session's greedy token (taken on the device where its row is; 0 without logits).
fn next_tokens(sessions: &mut [Session]) -> Vec<u32> {
    sessions
        .iter_mut()
        .map(|s| s.argmax_next().unwrap_or(0))
        .collect()
}
