//! `flashrt bench`: time-to-first-token cold and restored, snapshot and restore next to the
//! copy floor, decode step next to the weight-bandwidth floor — per prompt length, on the
//! best available backend, with progress on stderr and a table plus JSON at the end.
//!
//! Every timed region ends with a device synchronisation; repeated measurements report the
//! median. Cold TTFT is the median of three prefills from a freshly reset session, measured
//! after two warm-up prefills at the same length (so lazy kernel loading and graph capture are
//! not counted); restored TTFT is a restore of the prompt's capsule plus one decode step.

use crate::runtime::{Model, Session};
use serde::Serialize;
use std::time::Instant;

/// What to measure.
pub struct BenchOptions {
    pub lengths: Vec<usize>,
    pub iters: usize,
    pub decode_steps: usize,
    /// Also time every device command of a decode step (at each length) and of one full
    /// prefill chunk (at 0 and at the last chunk of the longest prompt), grouped by op.
    pub profile: bool,
    /// Also time every device command of prefill chunks of these sizes, after a prefix of the
    /// first length (a stored prompt's suffix).
    pub profile_rows: Vec<usize>,
}

#[derive(Serialize)]
pub struct LengthResult {
    pub tokens: usize,
    /// The first prefill at this length in the process (plain launches; the first length
    /// also pays lazy kernel loading): the first-call penalty, if any.
    pub first_prefill_ms: f64,
    pub cold_ttft_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub capsule_bytes: usize,
    pub snapshot_ms: f64,
    /// Wall-clock: the `restore` call plus waiting for its copy.
    pub restore_ms: f64,
    /// Device time of the restore's copy (events around it; CUDA), comparable with the floor,
    /// which is also device time.
    pub restore_device_ms: Option<f64>,
    pub copy_floor_ms: f64,
    /// Wall-clock of a restore into the session that holds the capsule's KV rows already (it
    /// restored it last and moved on): only the rest is copied. The other restore figures
    /// are into a session holding other rows (reset first), every row copied.
    pub restore_held_ms: f64,
    pub restored_ttft_ms: f64,
    pub restored_speedup: f64,
    pub decode_step_ms: f64,
    /// Matmul FLOPs a prefill of this prompt needs (see [`prefill_flops`]).
    pub prefill_flops: f64,
    /// Those FLOPs at the measured matmul rate: the prefill's compute floor.
    pub prefill_floor_ms: f64,
}

/// Dense FLOPs of a prefill of `n` tokens with last-row logits: every `Linear` of the decode
/// plan (2 per weight element per token), the LM head once, and causal attention (4 x heads x
/// head_dim per query-key pair, n(n+1)/2 pairs per layer). Recurrent scans, convolutions and
/// norms are left out (a few percent; none is a matmul).
pub fn prefill_flops(compiled: &crate::ir::Compiled, n: usize) -> f64 {
    let (fp8, other) = prefill_flops_split(compiled, n);
    fp8 + other
}

/// [`prefill_flops`] split into the FLOPs of matmuls over FP8 weights (which run on the FP8
/// tensor cores) and the rest.
pub fn prefill_flops_split(compiled: &crate::ir::Compiled, n: usize) -> (f64, f64) {
    let Some(plan) = compiled.plan(crate::ir::Phase::Decode) else {
        return (0.0, 0.0);
    };
    let layout = &compiled.layout;
    let logits = compiled.io.logits;
    let (mut per_token, mut once, mut per_pair) = (0.0, 0.0, 0.0);
    let mut fp8 = 0.0;
    for op in &plan.ops {
        match op {
            crate::ir::Op::Linear { w, out, .. } => {
                let b = layout.buffer(*w);
                let f = 2.0 * b.numel() as f64;
                if out.buf == logits {
                    once += f;
                } else {
                    per_token += f;
                    if b.dtype == crate::ir::DType::F8E4m3 {
                        fp8 += f * n as f64;
                    }
                }
            }
            crate::ir::Op::Attention {
                q_heads, head_dim, ..
            } => per_pair += 4.0 * (*q_heads * *head_dim) as f64,
            // The router, then `top_k` of the experts per token.
            crate::ir::Op::Moe {
                router,
                up,
                down,
                route,
                ..
            } => {
                let chosen = route.top_k as f64 / route.experts as f64;
                per_token += 2.0 * layout.buffer(*router).numel() as f64
                    + 2.0
                        * chosen
                        * (layout.buffer(*up).numel() + layout.buffer(*down).numel()) as f64;
            }
            _ => {}
        }
    }
    let n = n as f64;
    let total = per_token * n + once + per_pair * n * (n + 1.0) / 2.0;
    (fp8, total - fp8)
}

/// Weight bytes one decode step reads: every weight its plan touches, once, except that the
/// embedding table gives one row (unless it is also the LM head) and an MoE block reads only
/// `top_k` of its experts. Weights only other phases use (an MTP head) are not counted.
pub fn decode_weight_bytes(compiled: &crate::ir::Compiled) -> usize {
    use crate::ir::{Op, Role};
    let layout = &compiled.layout;
    let Some(plan) = compiled.plan(crate::ir::Phase::Decode) else {
        return layout.arena_bytes(Role::Weight);
    };
    let mut read: std::collections::BTreeMap<u32, usize> = Default::default();
    let mut note = |id: crate::ir::BufferId, bytes: usize| {
        let e = read.entry(id.0).or_default();
        *e = (*e).max(bytes);
    };
    for op in &plan.ops {
        match op {
            Op::Embed { table, .. } => {
                let b = layout.buffer(*table);
                note(*table, b.bytes / b.shape[0].max(1));
            }
            Op::Moe {
                router,
                bias,
                up,
                down,
                route,
                ..
            } => {
                for id in [*router].into_iter().chain(*bias) {
                    note(id, layout.buffer(id).bytes);
                }
                for id in [*up, *down] {
                    note(id, layout.buffer(id).bytes / route.experts * route.top_k);
                }
            }
            _ => {
                for id in op.buffers() {
                    let b = layout.buffer(id);
                    if b.role == Role::Weight {
                        note(id, b.bytes);
                        // A quantized weight's scales are read with it.
                        if let Some(q) = b.quant {
                            note(q.scale, layout.buffer(q.scale).bytes);
                        }
                    }
                }
            }
        }
    }
    read.values().sum()
}

#[derive(Serialize)]
pub struct BenchReport {
    pub model: String,
    pub backend: String,
    pub dtype: String,
    pub weight_bytes: usize,
    /// What a decode step reads of them (MoE blocks: the chosen experts only).
    pub decode_weight_bytes: usize,
    pub copy_bandwidth_gb_s: f64,
    pub decode_floor_ms: f64,
    /// Measured dense matmul rate in the model's dtype (8192^3), TFLOP/s; 0 where the backend
    /// has no probe.
    pub matmul_tflops: f64,
    /// Measured block-scaled FP8 matmul rate (8192^3), TFLOP/s, for models with FP8 weights
    /// (their matmuls' share of the prefill floor is at this rate); 0 otherwise.
    pub fp8_matmul_tflops: f64,
    pub load_ms: f64,
    pub lengths: Vec<LengthResult>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub profiles: Vec<Profile>,
}

/// Per-command device times of one step, grouped (`flashrt bench --profile`).
#[derive(Serialize)]
pub struct Profile {
    /// Which step: `decode at 2048`, `prefill 2048 rows at 0`.
    pub step: String,
    /// Sum of every command's time.
    pub total_ms: f64,
    pub commands: usize,
    /// (group, commands, ms), largest first.
    pub groups: Vec<ProfileGroup>,
}

#[derive(Serialize)]
pub struct ProfileGroup {
    pub group: String,
    pub commands: usize,
    pub ms: f64,
}

/// The group of a command label: the op kind and, for matmuls, the weight with layer indices
/// replaced by `*` (`linear layers.*.mlp.down_proj.weight`); split counts are dropped.
pub fn profile_group(label: &str) -> String {
    // Labels read `<phase> op <i> (<kind>)[ <rest>]`.
    let rest = match label.find(" op ") {
        Some(i) => {
            let after = &label[i + 4..];
            after.find(' ').map_or("", |j| &after[j + 1..])
        }
        None => label,
    };
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars().peekable();
    let mut prev_dot = false;
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() && prev_dot {
            while chars.peek().is_some_and(|d| d.is_ascii_digit()) {
                chars.next();
            }
            out.push('*');
            prev_dot = false;
            continue;
        }
        prev_dot = c == '.';
        out.push(c);
    }
    let out = match out.find(" splits)") {
        Some(_) => out.split(" (").next().unwrap_or(&out).to_string(),
        None => out,
    };
    out.replace(['(', ')', '`'], "")
}

pub fn profile_of(step: String, times: &[(String, f64)]) -> Profile {
    let mut groups: Vec<ProfileGroup> = Vec::new();
    for (label, ms) in times {
        let g = profile_group(label);
        match groups.iter_mut().find(|x| x.group == g) {
            Some(x) => {
                x.commands += 1;
                x.ms += ms;
            }
            None => groups.push(ProfileGroup {
                group: g,
                commands: 1,
                ms: *ms,
            }),
        }
    }
    groups.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    Profile {
        step,
        total_ms: times.iter().map(|(_, t)| t).sum(),
        commands: times.len(),
        groups,
    }
}

/// The profile table: every group above 0.5 % of the step, then the rest summed.
pub fn render_profile(p: &Profile) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "profile: {} — {} commands, {:.3} ms",
        p.step, p.commands, p.total_ms
    );
    let (mut rest_n, mut rest_ms) = (0, 0.0);
    for g in &p.groups {
        if g.ms >= 0.005 * p.total_ms {
            let _ = writeln!(
                s,
                "  {:>9.3} ms {:>5.1} % {:>5} x  {}",
                g.ms,
                100.0 * g.ms / p.total_ms,
                g.commands,
                g.group
            );
        } else {
            rest_n += g.commands;
            rest_ms += g.ms;
        }
    }
    if rest_n > 0 {
        let _ = writeln!(
            s,
            "  {:>9.3} ms {:>5.1} % {:>5} x  (other groups)",
            rest_ms,
            100.0 * rest_ms / p.total_ms,
            rest_n
        );
    }
    s
}

/// Cold prefills measured per length (the median is reported).
const COLD_RUNS: usize = 3;

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
        .map(|i| 3 + (crate::runtime::init::mix64(i ^ 0x5eed) % (vocab as u64 - 3)) as u32)
        .collect()
}

/// Time `f` on the session, including the device work it queued.
fn timed(
    s: &mut Session,
    f: impl FnOnce(&mut Session) -> crate::runtime::Result<()>,
) -> Result<f64, String> {
    // Work queued before (a step whose logits stay on the device returns before it ran) is
    // not this call's.
    s.synchronize().map_err(|e| e.to_string())?;
    let t = Instant::now();
    f(s).map_err(|e| e.to_string())?;
    s.synchronize().map_err(|e| e.to_string())?;
    Ok(ms(t))
}

/// Measure `model` (random weights or a checkpoint; `load_ms` is how long it took to load).
pub fn run(model: &Model, load_ms: f64, opts: &BenchOptions) -> Result<BenchReport, String> {
    let err = |e: crate::runtime::Error| e.to_string();
    let ir = model.ir();
    let backend = model.backend().clone();
    if let Some(&bad) = opts.lengths.iter().find(|&&n| n == 0 || n >= ir.max_seq) {
        return Err(format!(
            "prompt length {bad} must be between 1 and max_seq - 1 = {}",
            ir.max_seq - 1
        ));
    }
    if (opts.profile || !opts.profile_rows.is_empty()) && !model.backend_name().starts_with("cuda")
    {
        // Said before anything is measured, not after.
        return Err(format!(
            "--profile and --profile-rows time each device command and need the CUDA backend (this run: {})",
            model.backend_name()
        ));
    }
    if let Some(&bad) = opts.profile_rows.iter().find(|&&n| {
        n == 0
            || n > ir.prefill_buckets.iter().copied().max().unwrap_or(1)
            || opts.lengths.first().is_some_and(|&p| p + n >= ir.max_seq)
    }) {
        return Err(format!(
            "--profile-rows {bad}: a profiled chunk is 1 to {} rows (the largest bucket) and fits after the prefix in max_seq {}",
            ir.prefill_buckets.iter().copied().max().unwrap_or(1),
            ir.max_seq
        ));
    }
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
    let decode_bytes = decode_weight_bytes(model.compiled());
    let decode_floor_ms = decode_bytes as f64 / copy_bw * 1e3;
    progress(&format!(
        "copy bandwidth {:.0} GB/s (1 GiB); decode floor {decode_floor_ms:.2} ms",
        copy_bw / 1e9
    ));

    let matmul = backend.matmul_flops(layout.target.dtype).unwrap_or(0.0);
    if matmul > 0.0 {
        progress(&format!(
            "matmul rate {:.0} TFLOP/s ({}, 8192^3)",
            matmul / 1e12,
            layout.target.dtype.name()
        ));
    }
    // Models with FP8 weights: the block-scaled FP8 matmul rate, the floor of those matmuls.
    let has_fp8 = layout
        .buffers
        .iter()
        .any(|b| b.dtype == crate::ir::DType::F8E4m3);
    let matmul_fp8 = if has_fp8 {
        backend
            .matmul_flops(crate::ir::DType::F8E4m3)
            .unwrap_or(0.0)
    } else {
        0.0
    };
    if matmul_fp8 > 0.0 {
        progress(&format!(
            "FP8 matmul rate {:.0} TFLOP/s (e4m3, 128x128 block scales, 8192^3)",
            matmul_fp8 / 1e12
        ));
    }
    let prefill_floor = |n: usize| {
        let (f8, other) = prefill_flops_split(model.compiled(), n);
        match (matmul > 0.0, matmul_fp8 > 0.0) {
            (true, true) => (f8 / matmul_fp8 + other / matmul) * 1e3,
            (true, false) => (f8 + other) / matmul * 1e3,
            _ => 0.0,
        }
    };

    let mut session = model.session().map_err(err)?;
    // Time to *first token*: only the last position's logits cross to the host.
    session.set_logits_mode(crate::runtime::LogitsMode::Last);
    let mut results = Vec::new();
    let mut profiles = Vec::new();
    for &n in &opts.lengths {
        let tokens = prompt(n, ir.vocab);
        // Two warm-ups: a phase's first step runs as plain launches and its second is captured
        // into a graph; neither is a steady-state prefill.
        progress(&format!("{n} tokens: warm-up prefills"));
        let mut warmups = Vec::new();
        for _ in 0..2 {
            session.reset().map_err(err)?;
            warmups.push(timed(&mut session, |s| s.append(&tokens))?);
        }
        let mut colds = Vec::new();
        for _ in 0..COLD_RUNS {
            session.reset().map_err(err)?;
            colds.push(timed(&mut session, |s| {
                s.append(&tokens)?;
                s.argmax_next().map(|_| ())
            })?);
        }
        progress(&format!(
            "{n} tokens: warm-ups {:.1} ms (first), {:.1} ms (graph capture); cold prefills {}",
            warmups[0],
            warmups[1],
            colds
                .iter()
                .map(|c| format!("{c:.1} ms"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let cold = median(colds);

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
        let mut restores_device = Vec::new();
        let mut restored_ttft = Vec::new();
        // Warm the decode phase (plain launches, then graph capture) before timing it.
        session.restore(&capsule).map_err(err)?;
        session.decode_greedy(2).map_err(err)?;
        let mut restores_held = Vec::new();
        // A session that took or restored the capsule holds its KV rows and a restore skips
        // them; these restores are into a session holding other rows (a reset, not timed).
        let forget = |s: &mut Session| s.reset().and_then(|()| s.synchronize()).map_err(err);
        for _ in 0..opts.iters.max(1) {
            forget(&mut session)?;
            restores.push(timed(&mut session, |s| s.restore(&capsule))?);
            if let Some(d) = session.last_restore_device_ms().map_err(err)? {
                restores_device.push(d);
            }
            session.decode_greedy(1).map_err(err)?;
            restores_held.push(timed(&mut session, |s| s.restore(&capsule))?);
            forget(&mut session)?;
            restored_ttft.push(timed(&mut session, |s| {
                s.restore(&capsule)?;
                s.decode_greedy(1).map(|_| ())
            })?);
        }

        progress(&format!("{n} tokens: {} decode steps", opts.decode_steps));
        session.restore(&capsule).map_err(err)?;
        let mut steps = Vec::new();
        for _ in 0..opts.decode_steps.max(1) {
            steps.push(timed(&mut session, |s| s.decode_greedy(1).map(|_| ()))?);
        }
        if opts.profile {
            progress(&format!("{n} tokens: profiling a decode step"));
            // The second profiled step is reported: the first pays one-time costs.
            session.profile_chunk(&tokens[..1]).map_err(err)?;
            let times = session.profile_chunk(&tokens[1..2]).map_err(err)?;
            profiles.push(profile_of(format!("decode at {n}"), &times));
        }
        let r = LengthResult {
            tokens: n,
            first_prefill_ms: warmups[0],
            cold_ttft_ms: cold,
            prefill_tokens_per_s: n as f64 / (cold / 1e3),
            capsule_bytes: bytes,
            snapshot_ms: median(snaps),
            restore_ms: median(restores),
            restore_device_ms: if restores_device.is_empty() {
                None
            } else {
                Some(median(restores_device))
            },
            copy_floor_ms: floor_ms,
            restore_held_ms: median(restores_held),
            restored_ttft_ms: median(restored_ttft),
            restored_speedup: 0.0,
            decode_step_ms: median(steps),
            prefill_flops: prefill_flops(model.compiled(), n),
            prefill_floor_ms: prefill_floor(n),
        };
        let r = LengthResult {
            restored_speedup: r.cold_ttft_ms / r.restored_ttft_ms,
            ..r
        };
        progress(&format!(
            "{n} tokens: cold TTFT {:.1} ms, restored TTFT {:.2} ms, snapshot {:.3} ms, restore {:.3} ms (floor {:.3} ms; {:.3} ms into a session holding its KV rows)",
            r.cold_ttft_ms,
            r.restored_ttft_ms,
            r.snapshot_ms,
            r.restore_ms,
            r.copy_floor_ms,
            r.restore_held_ms
        ));
        results.push(r);
        drop(capsule);
    }
    if opts.profile
        && let Some(&longest) = opts.lengths.iter().max()
    {
        let chunk = ir.prefill_buckets.iter().copied().max().unwrap_or(1);
        let tokens = prompt(longest.max(chunk), ir.vocab);
        let last = (longest.max(chunk) - 1) / chunk * chunk;
        for at in [0, last] {
            progress(&format!("profiling a {chunk}-row prefill chunk at {at}"));
            session.reset().map_err(err)?;
            if at > 0 {
                session.append(&tokens[..at]).map_err(err)?;
            }
            let rows = &tokens[at..at + chunk.min(tokens.len() - at)];
            let times = session.profile_chunk(rows).map_err(err)?;
            profiles.push(profile_of(
                format!("prefill {} rows at {at}", rows.len()),
                &times,
            ));
            if at == last {
                break;
            }
        }
    }
    if let Some(&prefix) = opts.lengths.first() {
        for &rows in &opts.profile_rows {
            let tokens = prompt(prefix + rows, ir.vocab);
            progress(&format!("profiling a {rows}-row suffix at {prefix}"));
            session.reset().map_err(err)?;
            session.append(&tokens[..prefix]).map_err(err)?;
            let snap = session.snapshot().map_err(err)?;
            // The second profiled chunk is reported: the first pays one-time costs.
            session.profile_chunk(&tokens[prefix..]).map_err(err)?;
            session.restore(&snap).map_err(err)?;
            let times = session.profile_chunk(&tokens[prefix..]).map_err(err)?;
            // The same rows appended unprofiled (the chunk planner's steps, captured graphs, no
            // events between commands): the median of three after two warm-ups, restore
            // excluded.
            let mut plain = Vec::new();
            for i in 0..5 {
                session.restore(&snap).map_err(err)?;
                session.synchronize().map_err(err)?;
                let t = Instant::now();
                session.append(&tokens[prefix..]).map_err(err)?;
                session.synchronize().map_err(err)?;
                if i >= 2 {
                    plain.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            plain.sort_by(f64::total_cmp);
            progress(&format!(
                "a {rows}-row suffix at {prefix}: {:.3} ms appended unprofiled (median of 3)",
                plain[1]
            ));
            profiles.push(profile_of(
                format!("suffix of {rows} rows at {prefix}"),
                &times,
            ));
        }
    }
    Ok(BenchReport {
        model: ir.name.clone(),
        backend: model.backend_name(),
        dtype: layout.target.dtype.name().to_string(),
        weight_bytes,
        decode_weight_bytes: decode_bytes,
        copy_bandwidth_gb_s: copy_bw / 1e9,
        decode_floor_ms,
        matmul_tflops: matmul / 1e12,
        fp8_matmul_tflops: matmul_fp8 / 1e12,
        load_ms,
        lengths: results,
        profiles,
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
        "weights {} ({} read per decode step), copy bandwidth {:.0} GB/s, decode floor {:.2} ms (bytes read / bandwidth)",
        crate::cli::human_bytes(r.weight_bytes),
        crate::cli::human_bytes(r.decode_weight_bytes),
        r.copy_bandwidth_gb_s,
        r.decode_floor_ms
    );
    if r.matmul_tflops > 0.0 && r.fp8_matmul_tflops > 0.0 {
        let _ = writeln!(
            s,
            "matmul rate {:.0} TFLOP/s, FP8 {:.0} TFLOP/s; prefill floor = the prompt's matmul FLOPs at those rates (FP8 weights' at the FP8 one)",
            r.matmul_tflops, r.fp8_matmul_tflops
        );
    } else if r.matmul_tflops > 0.0 {
        let _ = writeln!(
            s,
            "matmul rate {:.0} TFLOP/s; prefill floor = the prompt's matmul FLOPs at that rate",
            r.matmul_tflops
        );
    }
    let _ = writeln!(
        s,
        "\n{:>7} {:>11} {:>13} {:>10} {:>11} {:>10} {:>10} {:>12} {:>10} {:>13} {:>8} {:>10}",
        "tokens",
        "cold TTFT",
        "prefill floor",
        "tok/s",
        "capsule",
        "snapshot",
        "restore",
        "restore dev",
        "copy floor",
        "restored TTFT",
        "speedup",
        "decode"
    );
    for l in &r.lengths {
        let dev = l
            .restore_device_ms
            .map_or("-".to_string(), |d| format!("{d:.3} ms"));
        let _ = writeln!(
            s,
            "{:>7} {:>8.1} ms {:>10.1} ms {:>10.0} {:>11} {:>7.3} ms {:>7.3} ms {:>12} {:>7.3} ms {:>10.2} ms {:>7.1}x {:>7.2} ms",
            l.tokens,
            l.cold_ttft_ms,
            l.prefill_floor_ms,
            l.prefill_tokens_per_s,
            crate::cli::human_bytes(l.capsule_bytes),
            l.snapshot_ms,
            l.restore_ms,
            dev,
            l.copy_floor_ms,
            l.restored_ttft_ms,
            l.restored_speedup,
            l.decode_step_ms
        );
    }
    let _ = writeln!(
        s,
        "restore: wall clock of the call plus its wait; restore dev: device time of its copy \
         (events), comparable with the copy floor (a device copy of the same bytes)"
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiled(stem: &str) -> crate::ir::Compiled {
        let path = format!("{}/models/{stem}.toml", env!("CARGO_MANIFEST_DIR"));
        let src = std::fs::read_to_string(&path).unwrap();
        let ir = crate::compiler::model_from_toml(&src, &path).unwrap();
        crate::ir::compile(&ir, crate::ir::Target { dtype: ir.dtype })
    }

    #[test]
    fn decode_bytes_count_what_a_step_reads() {
        // Qwen3.6-35B-A3B, by hand: per layer 8 of 256 experts (3 x 512 x 2048 bf16 each), the
        // gated shared expert, the f32 router and the mixer; plus the LM head and one
        // embedding row, and no MTP head: the "about 5.9 GB".
        let moe = compiled("qwen36-35b-a3b");
        let all = moe.layout.arena_bytes(crate::ir::Role::Weight);
        let read = decode_weight_bytes(&moe);
        let expert = 3 * 512 * 2048 * 2;
        let experts_per_layer = 256 * expert;
        assert!(
            read < all - 40 * (experts_per_layer - 8 * expert),
            "{read} of {all}"
        );
        assert!((5.5e9..6.2e9).contains(&(read as f64)), "{read}");
        // Dense: everything but the embedding table (one row) and the MTP head.
        let dense = compiled("qwen36-27b");
        let all = dense.layout.arena_bytes(crate::ir::Role::Weight);
        let embed = 248320 * 5120 * 2;
        let read = decode_weight_bytes(&dense);
        assert!(read < all - embed + 5120 * 2, "{read} of {all}");
        assert!((50e9..52.5e9).contains(&(read as f64)), "{read}");
    }

    #[test]
    fn profile_groups_merge_layers_and_splits() {
        // Labels as the CUDA backend writes them.
        let cases = [
            (
                "decode op 12 (linear) `layers.3.mlp.down_proj.weight`",
                "linear layers.*.mlp.down_proj.weight",
            ),
            (
                "decode op 40 (linear) `layers.11.mlp.down_proj.weight`",
                "linear layers.*.mlp.down_proj.weight",
            ),
            (
                "prefill[2048] op 52 (attention) combine (22 splits)",
                "attention combine",
            ),
            ("decode op 7 (gated_deltanet)", "gated_deltanet"),
            ("decode op 47 (qk_prep)", "qk_prep"),
            (
                "verify[3] op 2 (rms_norm) rms_norm + `mtp.0.q_proj.weight`",
                "rms_norm rms_norm + mtp.*.q_proj.weight",
            ),
        ];
        for (label, group) in cases {
            assert_eq!(profile_group(label), group, "label {label:?}");
        }
    }

    #[test]
    fn profile_sums_and_orders_groups() {
        let times = vec![
            ("decode op 1 (rms_norm)".to_string(), 0.5),
            ("decode op 2 (linear) `layers.0.a.weight`".to_string(), 2.0),
            ("decode op 9 (linear) `layers.1.a.weight`".to_string(), 3.0),
        ];
        let p = profile_of("decode at 0".into(), &times);
        assert_eq!(p.commands, 3);
        assert!((p.total_ms - 5.5).abs() < 1e-12);
        assert_eq!(p.groups[0].group, "linear layers.*.a.weight");
        assert_eq!(p.groups[0].commands, 2);
        assert!((p.groups[0].ms - 5.0).abs() < 1e-12);
        assert_eq!(p.groups[1].group, "rms_norm");
    }

    #[test]
    fn prefill_flops_count_linears_head_once_and_causal_pairs() {
        let src = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/models/qwen36-27b.toml"
        ))
        .unwrap();
        let ir = crate::compiler::model_from_toml(&src, "qwen36-27b.toml").unwrap();
        let c = crate::ir::compile(
            &ir,
            crate::ir::Target {
                dtype: crate::ir::DType::Bf16,
            },
        );
        // Independent count from the shape (models/qwen36-27b.toml): per layer, the MLP is
        // 3 x 5120 x 17408; a GDN mixer projects 5120 -> 10240 (qkv) + 6144 (z) + 48 + 48 and
        // back 6144 -> 5120; an attention mixer projects 5120 -> 24 x 256 x 2 (query + gate) +
        // 2 x 4 x 256 and back 6144 -> 5120. The MTP layer is not part of a prefill (it has
        // its own draft plan). The LM head counts once.
        let (h, i) = (5120.0, 17408.0);
        let mlp = 3.0 * h * i;
        let gdn = h * (10240.0 + 6144.0 + 96.0) + 6144.0 * h;
        let attn = h * (12288.0 + 2048.0) + 6144.0 * h;
        let per_token = 2.0 * (64.0 * mlp + 48.0 * gdn + 16.0 * attn);
        let head = 2.0 * 248320.0 * h;
        let pairs = |n: f64| n * (n + 1.0) / 2.0;
        let per_pair = 4.0 * 24.0 * 256.0 * 16.0;
        for n in [1usize, 2048, 16384] {
            let want = per_token * n as f64 + head + per_pair * pairs(n as f64);
            let got = prefill_flops(&c, n);
            assert!(
                (got - want).abs() / want < 1e-9,
                "{n} tokens: {got:e} FLOPs, independent count {want:e}"
            );
        }
    }
}
