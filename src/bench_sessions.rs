//! `flashrt bench --sessions N`: N sessions of the model alive at once, each prefilled to the
//! longest `--lengths`, and what each costs in device memory (the drop in free memory as it
//! is opened and prefilled) next to its state arena — the bytes the capsule contract needs
//! preallocated — and the bytes its capsule would hold at that length. Then a few decode
//! steps round-robin over all of them (each continues from its own state: the sessions share
//! the model's scratch and I/O arenas, not their state).

use crate::runtime::{LogitsMode, Model, Session};
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize)]
pub struct SessionsReport {
    pub sessions: usize,
    pub tokens_each: usize,
    /// Free device bytes before the first session was opened (shared arenas allocated).
    pub free_before: u64,
    /// Drop in free device bytes after each session was opened and prefilled.
    pub used_after: Vec<u64>,
    /// Device bytes per session: the total drop / sessions.
    pub bytes_per_session: f64,
    /// The state arena (`max_seq` positions preallocated).
    pub state_bytes: u64,
    /// A capsule at `tokens_each` (what the state holds at that length).
    pub capsule_bytes: u64,
    /// Bytes all sessions share (scratch, I/O, workspace), allocated once.
    pub shared_bytes: u64,
    /// Median of one decode step per session, round-robin over all sessions.
    pub decode_ms: f64,
}

pub fn run(model: &Model, sessions: usize, tokens: usize) -> Result<SessionsReport, String> {
    let backend = model.backend().clone();
    let free = || backend.memory_available().map(|f| f as u64);
    let Some(free_before) = free() else {
        return Err("--sessions needs a backend that reports free memory (CUDA)".into());
    };
    let tokens = tokens.min(model.max_seq() - 8);
    let mut open: Vec<Session> = Vec::new();
    let mut used_after = Vec::new();
    for i in 0..sessions {
        let mut s = model
            .session()
            .map_err(|e| format!("session {} of {sessions}: {e}", i + 1))?;
        s.set_logits_mode(LogitsMode::Last);
        let prompt = crate::demo::tokens(7000 + i as u64, tokens, model.vocab());
        s.append(&prompt)
            .map_err(|e| format!("session {}: prefill: {e}", i + 1))?;
        s.synchronize().map_err(|e| e.to_string())?;
        open.push(s);
        let now = free().unwrap_or(0);
        used_after.push(free_before.saturating_sub(now));
        eprintln!(
            "[bench --sessions] {} open at {tokens} tokens: {:.2} GiB used",
            i + 1,
            *used_after.last().unwrap() as f64 / (1u64 << 30) as f64
        );
    }
    let mut times = Vec::new();
    for round in 0..4 {
        for s in open.iter_mut() {
            let t = s.argmax_next().unwrap_or(0);
            let t0 = Instant::now();
            s.append(&[t])
                .and_then(|()| s.synchronize())
                .map_err(|e| format!("decode: {e}"))?;
            if round > 0 {
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    times.sort_by(f64::total_cmp);
    let l = &model.compiled().layout;
    Ok(SessionsReport {
        sessions,
        tokens_each: tokens,
        free_before,
        bytes_per_session: *used_after.last().unwrap_or(&0) as f64 / sessions.max(1) as f64,
        used_after,
        state_bytes: model.session_bytes() as u64,
        capsule_bytes: l.capsule_bytes(tokens) as u64,
        shared_bytes: model.shared_bytes() as u64,
        decode_ms: times.get(times.len() / 2).copied().unwrap_or(0.0),
    })
}

pub fn render(r: &SessionsReport) -> String {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    format!(
        "sessions alive at once: {} at {} tokens each, {:.2} GiB free before\n  \
         per session {:.3} GiB = {:.3}x its state arena ({:.3} GiB; its capsule at {} tokens: {:.3} GiB); shared by all: {:.2} GiB\n  \
         decode step, round-robin over all sessions: {:.2} ms (median)\n",
        r.sessions,
        r.tokens_each,
        gib(r.free_before as f64),
        gib(r.bytes_per_session),
        r.bytes_per_session / r.state_bytes.max(1) as f64,
        gib(r.state_bytes as f64),
        r.tokens_each,
        gib(r.capsule_bytes as f64),
        gib(r.shared_bytes as f64),
        r.decode_ms,
    )
}
