//! `flashrt demo`: the embedded demo model end to end — prefill, snapshot, decode, restore,
//! fork two branches, roll back, the KV-only ablation — with every claim checked as it runs.

use crate::runtime::{self, Backend, Capsule, Session};
use crate::typed::{Model as _, TypedModel, TypedSession};
use std::sync::Arc;
use std::time::Instant;

crate::include_model!("models/demo.toml");

impl Demo {
    /// The demo model's maximum sequence length.
    pub fn ir_max_seq() -> usize {
        <Demo as crate::typed::Model>::ir().max_seq
    }
}

/// One row of the demo table.
pub struct Row {
    pub op: String,
    pub ms: Option<f64>,
    pub bytes: Option<usize>,
    /// `(Some(passed), what)` for a check, `(None, note)` for a remark.
    pub check: Option<(Option<bool>, String)>,
}

/// Everything the demo measured and checked.
pub struct DemoReport {
    pub backend: String,
    pub model: String,
    pub rows: Vec<Row>,
}

impl DemoReport {
    pub fn passed(&self) -> bool {
        self.rows
            .iter()
            .all(|r| r.check.as_ref().is_none_or(|(ok, _)| ok.unwrap_or(true)))
    }
}

/// Deterministic token ids in `[3, vocab)` (splitmix64); `flashrt bench --serve` draws its
/// prompts with it too.
pub(crate) fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            3 + (z % (vocab as u64 - 3)) as u32
        })
        .collect()
}

fn timed<T>(f: impl FnOnce() -> runtime::Result<T>) -> runtime::Result<(T, f64)> {
    let t = Instant::now();
    let v = f()?;
    Ok((v, t.elapsed().as_secs_f64() * 1e3))
}

/// `f(session)`, returning once the device has run what it queued (a step returns before).
fn synced<T>(
    session: &mut TypedSession<Demo>,
    f: impl FnOnce(&mut TypedSession<Demo>) -> runtime::Result<T>,
) -> runtime::Result<T> {
    let v = f(session)?;
    session.untyped().synchronize()?;
    Ok(v)
}

/// Every state byte of the session equals the capsule's.
fn state_equals(s: &Session, c: &Capsule) -> runtime::Result<bool> {
    for id in c.region_ids() {
        if s.read_region(id)? != c.region_bytes(id)? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Run the demo on `backend`.
pub fn run(backend: Arc<dyn Backend>, prompt_len: usize) -> runtime::Result<DemoReport> {
    let ir = Demo::ir();
    let mut rows = Vec::new();
    let mut row =
        |op: &str, ms: Option<f64>, bytes: Option<usize>, check: Option<(Option<bool>, String)>| {
            rows.push(Row {
                op: op.to_string(),
                ms,
                bytes,
                check,
            })
        };

    let (model, ms) = timed(|| TypedModel::<Demo>::random(backend.clone(), 7))?;
    let weights = model
        .untyped()
        .compiled()
        .layout
        .arena_bytes(crate::ir::Role::Weight);
    let exact_dtype = model.untyped().compiled().layout.target.dtype == crate::ir::DType::F32;
    row(
        "load demo model (random weights)",
        Some(ms),
        Some(weights),
        None,
    );

    let prompt = tokens(1, prompt_len, ir.vocab);
    let s1 = tokens(2, 9, ir.vocab);
    let s2 = tokens(3, 14, ir.vocab);
    let other = tokens(4, 50, ir.vocab);
    let n_decode = 16;

    // Cold prefill of the prompt.
    let mut session = model.session()?;
    let (_, cold_ms) = timed(|| session.prefill(&prompt))?;
    row(
        &format!("prefill {prompt_len}-token prompt (cold)"),
        Some(cold_ms),
        None,
        None,
    );

    // Snapshot A at the prompt boundary.
    let (cap_a, ms) = timed(|| session.snapshot())?;
    let untyped_a = crate::typed::Capsule::to_untyped(&cap_a)?;
    let exact = state_equals(session.untyped(), &untyped_a)?;
    row(
        &format!("snapshot A @ {}", cap_a.meta.pos),
        Some(ms),
        Some(untyped_a.bytes()),
        Some((Some(exact), "capsule bytes = live state".into())),
    );

    // The uninterrupted continuation.
    let (reference, ms) = timed(|| synced(&mut session, |s| s.decode_greedy(n_decode)))?;
    row(
        &format!("greedy decode {n_decode} tokens"),
        Some(ms),
        None,
        None,
    );

    // Dirty the session with an unrelated prompt, then restore A.
    session.untyped().reset()?;
    session.prefill(&other)?;
    let (_, ms) = timed(|| session.restore(&cap_a))?;
    let exact = state_equals(session.untyped(), &untyped_a)?;
    row(
        "restore A into a dirtied session",
        Some(ms),
        Some(untyped_a.bytes()),
        Some((Some(exact), "every state byte equal".into())),
    );
    let (again, ms) = timed(|| synced(&mut session, |s| s.decode_greedy(n_decode)))?;
    row(
        &format!("decode {n_decode} after restore"),
        Some(ms),
        None,
        Some((
            Some(again == reference),
            "tokens identical to uninterrupted decode".into(),
        )),
    );

    // Restored TTFT: restore + first token vs cold prefill.
    let (_, ms) = timed(|| {
        session.restore(&cap_a)?;
        synced(&mut session, |s| s.decode_greedy(1))
    })?;
    row(
        "restored TTFT (restore + 1 token)",
        Some(ms),
        None,
        Some((
            None,
            format!("{:.1}x faster than cold prefill", cold_ms / ms.max(1e-9)),
        )),
    );

    // Two forks from A, each compared with a cold run of the whole sequence.
    for (name, suffix) in [("fork branch 1", &s1), ("fork branch 2", &s2)] {
        let (mut branch, ms) = timed(|| model.fork(&cap_a))?;
        branch.prefill(suffix)?;
        let logits = branch.untyped().logits().to_vec();
        let toks = branch.decode_greedy(8)?;
        let mut cold = model.session()?;
        let full: Vec<u32> = prompt.iter().chain(suffix.iter()).copied().collect();
        cold.prefill(&full)?;
        let cold_logits = cold.untyped().logits().to_vec();
        let cold_tail = &cold_logits[cold_logits.len() - logits.len()..];
        let cold_toks = cold.decode_greedy(8)?;
        let d = max_abs_diff(&logits, cold_tail);
        // The f32 CPU reference computes every row identically whatever the chunking, so the
        // fork must equal the cold run bit for bit; reduced-precision backends may round
        // differently per chunk shape, so they get a bf16-sized relative tolerance.
        let scale = cold_tail
            .iter()
            .fold(0.0f32, |m, x| m.max(x.abs()))
            .max(1e-6);
        let tol = if exact_dtype { 0.0 } else { 3e-2 * scale };
        row(
            &format!("{name}: fork A + {} tokens", suffix.len()),
            Some(ms),
            None,
            Some((
                Some(toks == cold_toks && d <= tol),
                format!(
                    "= cold prefill of {} tokens (max |dlogit| {d:.1e})",
                    full.len()
                ),
            )),
        );
    }

    // Rollback: continue past A, then return to A.
    session.restore(&cap_a)?;
    session.decode_greedy(n_decode)?;
    let (_, ms) = timed(|| session.rollback(&cap_a))?;
    let exact = state_equals(session.untyped(), &untyped_a)?;
    let toks = session.decode_greedy(n_decode)?;
    row(
        &format!("rollback {} tokens to A", n_decode),
        Some(ms),
        Some(untyped_a.bytes()),
        Some((
            Some(exact && toks == reference),
            "byte-exact, same continuation".into(),
        )),
    );

    // The KV-only ablation must diverge: recurrent and conv state are load-bearing.
    session.untyped().reset()?;
    session.prefill(&other)?;
    session.untyped().restore_kv_only(&untyped_a)?;
    let ablated = session.decode_greedy(n_decode)?;
    let same = ablated
        .iter()
        .zip(&reference)
        .take_while(|(a, b)| a == b)
        .count();
    row(
        "KV-only restore (ablation)",
        None,
        None,
        Some((
            Some(ablated != reference),
            format!("diverges as expected ({same}/{n_decode} tokens agree)"),
        )),
    );

    Ok(DemoReport {
        backend: model.untyped().backend_name(),
        model: describe(ir),
        rows,
    })
}

fn describe(ir: &crate::ir::ModelIr) -> String {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for l in &ir.layers {
        let k = l
            .mixer
            .as_ref()
            .map_or("mlp", |m| m.kind_name())
            .to_string();
        match kinds.iter_mut().find(|(n, _)| *n == k) {
            Some((_, c)) => *c += 1,
            None => kinds.push((k, 1)),
        }
    }
    let parts = kinds
        .iter()
        .map(|(k, c)| format!("{c} {k}"))
        .collect::<Vec<_>>()
        .join(" + ");
    format!(
        "{} ({} layers: {parts}; hidden {}, vocab {})",
        ir.name,
        ir.layers.len(),
        ir.hidden,
        ir.vocab
    )
}

/// The table `flashrt demo` prints.
pub fn render(r: &DemoReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "flashrt demo — {}", r.model);
    let _ = writeln!(s, "backend: {}\n", r.backend);
    let w = r
        .rows
        .iter()
        .map(|x| x.op.chars().count())
        .max()
        .unwrap_or(10);
    let _ = writeln!(
        s,
        "  {:<w$}  {:>10}  {:>10}  check",
        "operation", "time", "bytes"
    );
    let _ = writeln!(
        s,
        "  {}  {}  {}  {}",
        "-".repeat(w),
        "-".repeat(10),
        "-".repeat(10),
        "-".repeat(40)
    );
    for x in &r.rows {
        let time = x.ms.map_or("".to_string(), |m| {
            if m < 1.0 {
                format!("{:.0} µs", m * 1e3)
            } else {
                format!("{m:.2} ms")
            }
        });
        let bytes = x.bytes.map_or("".to_string(), crate::cli::human_bytes);
        let check = match &x.check {
            None => String::new(),
            Some((Some(true), what)) => format!("ok    {what}"),
            Some((Some(false), what)) => format!("FAIL  {what}"),
            Some((None, note)) => format!("      {note}"),
        };
        let _ = writeln!(s, "  {:<w$}  {time:>10}  {bytes:>10}  {check}", x.op);
    }
    let _ = writeln!(
        s,
        "\n{}",
        if r.passed() {
            "all checks passed"
        } else {
            "SOME CHECKS FAILED"
        }
    );
    s
}
