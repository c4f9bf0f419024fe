//! The command implementations behind `flashrt` (kept in the library so tests can call them).

use crate::runtime::Backend;
use flashrt_ir::{Compiled, Role};
use flashrt_serve::args::Args;
use std::fmt::Write;
use std::process::ExitCode;
use std::sync::Arc;

/// Bytes in binary units: `1.50 GiB`.
pub fn human_bytes(b: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// What `flashrt compile` prints: layout, plans, capsule size.
pub fn compile_report(c: &Compiled, ops: bool) -> String {
    let l = &c.layout;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model {} ({} layers{}), target {}, fingerprint {}",
        c.ir.name,
        c.ir.layers.len(),
        c.ir.mtp
            .as_ref()
            .map_or(String::new(), |m| format!(" + {} MTP", m.layers.len())),
        l.target.dtype.name(),
        l.fingerprint
    );
    let _ = writeln!(s, "\nlayout ({} buffers)", l.buffers.len());
    let _ = writeln!(
        s,
        "  {:<40} {:<8} {:<5} {:<24} {:>12}",
        "buffer", "role", "dtype", "shape", "bytes"
    );
    for b in &l.buffers {
        let _ = writeln!(
            s,
            "  {:<40} {:<8} {:<5} {:<24} {:>12}",
            b.name,
            b.role.name(),
            b.dtype.name(),
            format!("{:?}", b.shape),
            b.bytes
        );
    }
    let _ = writeln!(s, "\narenas");
    for role in Role::ALL {
        let bytes = l.arena_bytes(role);
        let _ = writeln!(
            s,
            "  {:<8} {:>16} bytes  {:>11}",
            role.name(),
            bytes,
            human_bytes(bytes)
        );
    }
    let _ = writeln!(s, "\nplans");
    for p in &c.plans {
        let counts = p
            .op_counts()
            .iter()
            .map(|(n, k)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            s,
            "  {:<15} {:>5} ops: {counts}",
            p.phase.label(),
            p.ops.len()
        );
        if ops {
            for (i, op) in p.ops.iter().enumerate() {
                let _ = writeln!(s, "      {i:>5} {}", op.name());
            }
        }
    }
    let fixed = l.capsule_fixed_bytes();
    let per = l.capsule_bytes_per_token();
    let _ = writeln!(s, "\ncapsule");
    let _ = writeln!(
        s,
        "  fixed bytes      {fixed:>16}  {:>11}  (recurrent + conv state)",
        human_bytes(fixed)
    );
    let _ = writeln!(
        s,
        "  bytes per token  {per:>16}  {:>11}  (attention K/V)",
        human_bytes(per)
    );
    if c.ir.mtp.is_some() {
        let mtp = |per_token: bool| -> usize {
            l.state_buffers()
                .filter(|b| b.name.starts_with("mtp."))
                .map(|b| match (per_token, b.bytes_per_token()) {
                    (true, n) => n,
                    (false, 0) => b.bytes,
                    (false, _) => 0,
                })
                .sum()
        };
        let _ = writeln!(
            s,
            "  MTP head fixed bytes      {:>16}  (included above: drafter input hidden)",
            mtp(false)
        );
        let _ = writeln!(
            s,
            "  MTP head bytes per token  {:>16}  (included above: drafter K/V)",
            mtp(true)
        );
    }
    for n in [2048usize, 16384, l.max_seq] {
        if n <= l.max_seq {
            let _ = writeln!(
                s,
                "  at {n:>6} tokens  {:>16}  {:>11}",
                fixed + per * n,
                human_bytes(fixed + per * n)
            );
        }
    }
    s
}

/// The backend `--backend cpu|cuda` names, else the best available.
fn backend(choice: Option<&str>) -> Result<Arc<dyn Backend>, String> {
    Ok(match choice {
        None => crate::runtime::backend::best().map_err(|e| e.to_string())?,
        Some("cpu") => Arc::new(crate::runtime::CpuBackend::new()),
        Some("cuda") => {
            Arc::new(crate::runtime::backend::cuda::CudaBackend::new(0).map_err(|e| e.to_string())?)
        }
        Some(other) => return Err(format!("unknown backend `{other}` (cpu or cuda)")),
    })
}

/// `flashrt check-reference <DIR>`: exit 0 when every check passes, 1 otherwise.
pub fn check_reference(args: &[String]) -> Result<ExitCode, String> {
    let a = Args::parse(args, &[], &["backend"])?;
    let dir = std::path::PathBuf::from(a.one("checkpoint folder")?);
    let backend = backend(a.get("backend"))?;
    let report = crate::runtime::check_reference(&dir, backend)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    println!("{report}");
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `flashrt demo`.
pub fn demo(args: &[String]) -> Result<ExitCode, String> {
    let a = Args::parse(args, &[], &["backend", "prompt"])?;
    if let Some(p) = a.positional.first() {
        return Err(format!("unexpected argument `{p}`"));
    }
    let prompt: usize = a.num("prompt")?.unwrap_or(256);
    let backend = backend(a.get("backend"))?;
    if prompt == 0 || prompt + 64 > crate::demo::Demo::ir_max_seq() {
        return Err(format!(
            "--prompt must be between 1 and {}",
            crate::demo::Demo::ir_max_seq() - 64
        ));
    }
    let report = crate::demo::run(backend, prompt).map_err(|e| e.to_string())?;
    print!("{}", crate::demo::render(&report));
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `flashrt bench <model.toml> [--random-weights] [--lengths 2048,4096] [--iters N]
/// [--decode-steps N] [--json FILE] [--backend cpu|cuda]`.
pub fn bench(args: &[String]) -> Result<ExitCode, String> {
    // `--random-weights` is accepted for clarity: random weights are the only mode so far
    // (checkpoints are not needed for timing).
    let a = Args::parse(
        args,
        &["random-weights", "profile"],
        &[
            "backend",
            "lengths",
            "iters",
            "decode-steps",
            "seed",
            "json",
        ],
    )?;
    let opts = crate::bench::BenchOptions {
        lengths: a
            .list("lengths")?
            .unwrap_or_else(|| vec![2048, 4096, 8192, 16384]),
        iters: a.num("iters")?.unwrap_or(20),
        decode_steps: a.num("decode-steps")?.unwrap_or(20),
        seed: a.num("seed")?.unwrap_or(7),
        profile: a.has("profile"),
    };
    let path = a.one("model file")?.to_string();
    let json = a.get("json").map(str::to_string);
    let backend = backend(a.get("backend"))?;
    let src = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let ir = crate::compiler::model_from_toml(&src, &path).map_err(|d| d.to_string())?;
    let report = crate::bench::run(backend, &ir, &opts)?;
    print!("{}", crate::bench::render(&report));
    for p in &report.profiles {
        print!("\n{}", crate::bench::render_profile(p));
    }
    if let Some(j) = json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&j, text).map_err(|e| format!("cannot write {j}: {e}"))?;
        println!("wrote {j}");
    }
    Ok(ExitCode::SUCCESS)
}
