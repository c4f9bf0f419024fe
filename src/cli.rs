//! The `flashrt` command line: every command's flags and help text are the clap definitions
//! below (one usage text, generated from the code), and the implementations sit beside them
//! (kept in the library so tests can call them). `RUST_LOG` sets the log level (default
//! `info`, to standard error).

use clap::{Args, Parser, Subcommand};
use flashrt_ir::{Compiled, Role};
use flashrt_serve::cli::{BackendKind, ModelArgs, ServeArgs, backend};
use std::fmt::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// flashrt — latency-first serving of hybrid language models with execution-state capsules
#[derive(Parser, Debug)]
#[command(name = "flashrt", version, about, long_about = None, arg_required_else_help = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the embedded demo model: prefill, snapshot, fork two branches, roll back, the
    /// KV-only ablation; print a table of operations, times, bytes and checks
    Demo(DemoArgs),
    /// Generate from a checkpoint (or a TOML model) once: text in, streamed text out
    Run(crate::run::RunArgs),
    /// Chat in the terminal: one session across turns, capsules to save, restore, fork and
    /// roll back
    Chat(crate::chat::ChatArgs),
    /// Serve a model over HTTP: OpenAI-compatible completions and chat, a sessions API over
    /// capsules, a tiered capsule store
    Serve(ServeArgs),
    /// Cold and restored time-to-first-token, snapshot/restore next to the copy floor, decode
    /// step next to the weight-bandwidth floor, per prompt length
    Bench(BenchArgs),
    /// Compile a model TOML: print its buffer layout, plans per phase and capsule size
    Compile(CompileArgs),
    /// Translate a Hugging Face config.json (qwen3_5[_text], qwen3_5_moe[_text], lfm2[_moe],
    /// nemotron_h) into a model TOML
    ImportHf(ImportArgs),
    /// Check a checkpoint folder against transformers' reference outputs (config.json,
    /// model.safetensors, reference.safetensors[, state.safetensors])
    CheckReference(CheckArgs),
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Backend (default: the best available)
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Prompt length in tokens
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub prompt: usize,
}

#[derive(Args, Debug)]
pub struct CompileArgs {
    /// The model TOML
    pub model: PathBuf,
    /// Dtype to compile for (default: the model's)
    #[arg(long, value_name = "DTYPE")]
    pub target: Option<String>,
    /// Also write the generated Rust (model type, capsule struct) to this file
    #[arg(long, value_name = "FILE")]
    pub emit_rust: Option<PathBuf>,
    /// List every op of every plan
    #[arg(long)]
    pub ops: bool,
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// A config.json, or the checkpoint folder holding it
    pub config: PathBuf,
    /// Model name (default: the folder's)
    #[arg(long)]
    pub name: Option<String>,
    /// Positions per session (default: max_position_embeddings)
    #[arg(long, value_name = "N")]
    pub max_seq: Option<usize>,
    /// Prefill buckets, rows (default: 64,512,2048,4096 up to max_seq)
    #[arg(long, value_delimiter = ',', value_name = "ROWS")]
    pub buckets: Option<Vec<usize>>,
    /// Model dtype (default: the config's)
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The checkpoint folder with its reference outputs
    pub dir: PathBuf,
    /// Backend (default: the best available)
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Compute dtype (default: the config's; `f32` checks a bf16 or FP8 checkpoint on a GPU at
    /// the reference's tolerances)
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt lengths to measure
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "2048,4096,8192,16384",
        value_name = "N"
    )]
    pub lengths: Vec<usize>,
    /// Repetitions of snapshot and restore
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub iters: usize,
    /// Decode steps timed per length
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub decode_steps: usize,
    /// Write the report as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also time every kernel of a decode step and of a prefill chunk (CUDA), and with
    /// `--batch` of the largest batched step
    #[arg(long)]
    pub profile: bool,
    /// Also time every kernel of prefill chunks of these sizes (each in its smallest bucket),
    /// appended after a prefix of the first `--lengths` tokens: where a suffix's time goes
    #[arg(long, value_delimiter = ',', value_name = "N")]
    pub profile_rows: Vec<usize>,
    /// Then drive `flashrt serve` on the same model through HTTP (streaming completions on
    /// loopback): time to the first streamed token after a stored prefix of each `--lengths`
    /// plus each `--serve-suffixes`, an exact repeat, streamed decode greedy and sampled
    #[arg(long)]
    pub serve: bool,
    /// Fresh tokens appended to the stored prefix (`--serve`)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,8,32,64,256,1024",
        value_name = "N"
    )]
    pub serve_suffixes: Vec<usize>,
    /// Timed runs per suffix length, after one warm-up (`--serve`)
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub serve_runs: usize,
    /// Then N clients streaming greedy completions (`--decode-steps` tokens each) at once,
    /// against each alone: aggregate tokens/s, inter-token gaps, identical tokens (`--serve`)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub serve_clients: usize,
    /// Then a fresh prompt of N tokens sent while those clients stream: its TTFT against the
    /// idle server's, and the clients' gaps meanwhile (`--serve --serve-clients`)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub serve_newcomer: usize,
    /// Then one completion with OpenAI `n` = N choices (temperature 0.8, a seed,
    /// `--decode-steps` tokens each) against N single completions seeded alike: time, and
    /// whether each choice equals its single completion (`--serve`)
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub serve_choices: usize,
    /// Then chat turns through /v1/chat/completions with DIR's tokenizer.json and chat
    /// template (e.g. tests/fixtures/text): a conversation of each `--lengths` tokens stored,
    /// then one more turn: time to first token, templating and tokenizing included (`--serve`)
    #[arg(long, value_name = "DIR")]
    pub serve_chat: Option<PathBuf>,
    /// The served path's server moves capsules down the store's tiers on its worker thread,
    /// as `flashrt serve --demote-on-worker` (to measure what the background moves save)
    #[arg(long)]
    pub serve_demote_on_worker: bool,
    /// The served path's device-tier budget (K/M/G suffixes; default: what `flashrt serve`
    /// chooses), e.g. small enough that its capsules move down the tiers
    #[arg(long, value_parser = flashrt_serve::cli::parse_bytes, value_name = "BYTES")]
    pub serve_budget_device: Option<u64>,
    /// The served path's host-tier budget (default: what `flashrt serve` chooses), e.g. small
    /// enough that capsules leave host memory and their buffers are reused
    #[arg(long, value_parser = flashrt_serve::cli::parse_bytes, value_name = "BYTES")]
    pub serve_budget_host: Option<u64>,
    /// Then open N sessions at once, each prefilled to the longest `--lengths`, and report the
    /// device memory each costs next to its state arena (CUDA)
    #[arg(long, value_name = "N")]
    pub sessions: Option<usize>,
    /// Then the decode step of B sessions stepped together (one batched step), for each B, at
    /// each `--lengths` context, next to its floor and the one-session step
    #[arg(long, value_delimiter = ',', value_name = "B")]
    pub batch: Vec<usize>,
}

/// Logs to standard error; `RUST_LOG` filters (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Run a parsed command line.
pub fn dispatch(cli: Cli) -> Result<ExitCode, String> {
    match cli.command {
        Command::Demo(a) => demo(&a),
        Command::Run(a) => crate::run::run(&a),
        Command::Chat(a) => crate::chat::chat(&a),
        Command::Serve(a) => flashrt_serve::cli::serve(&a),
        Command::Bench(a) => bench(&a),
        Command::Compile(a) => compile(&a),
        Command::ImportHf(a) => import_hf(&a),
        Command::CheckReference(a) => check_reference(&a),
    }
}

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
    if let Some(q) = &c.ir.quant {
        let n = l.buffers.iter().filter(|b| b.quant.is_some()).count();
        let _ = writeln!(
            s,
            "quantized weights: {n} matrices, {} with {}x{} blocks (one f32 scale each); kept: {}",
            q.format.name(),
            q.block[0],
            q.block[1],
            if q.exclude.is_empty() {
                "none".to_string()
            } else {
                q.exclude.join(", ")
            }
        );
    }
    let _ = writeln!(s, "\nlayout ({} buffers)", l.buffers.len());
    let dw = l
        .buffers
        .iter()
        .map(|b| b.dtype.name().len())
        .max()
        .unwrap_or(5)
        .max(5);
    let _ = writeln!(
        s,
        "  {:<40} {:<8} {:<dw$} {:<24} {:>12}",
        "buffer", "role", "dtype", "shape", "bytes"
    );
    for b in &l.buffers {
        let _ = writeln!(
            s,
            "  {:<40} {:<8} {:<dw$} {:<24} {:>12}",
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

/// `flashrt check-reference <DIR>`: exit 0 when every check passes, 1 otherwise.
pub fn check_reference(a: &CheckArgs) -> Result<ExitCode, String> {
    let backend = backend(a.backend)?;
    let dtype = match &a.dtype {
        None => None,
        Some(d) => Some(
            crate::ir::DType::parse(d)
                .ok_or_else(|| format!("unknown dtype `{d}` (f32, bf16, f16)"))?,
        ),
    };
    let opts = crate::runtime::ReferenceOptions {
        dtype,
        ..Default::default()
    };
    let report = crate::runtime::check_reference_with(&a.dir, backend, &opts)
        .map_err(|e| format!("{}: {e}", a.dir.display()))?;
    println!("{report}");
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `flashrt demo`.
pub fn demo(a: &DemoArgs) -> Result<ExitCode, String> {
    let backend = backend(a.backend)?;
    if a.prompt == 0 || a.prompt + 64 > crate::demo::Demo::ir_max_seq() {
        return Err(format!(
            "--prompt must be between 1 and {}",
            crate::demo::Demo::ir_max_seq() - 64
        ));
    }
    let report = crate::demo::run(backend, a.prompt).map_err(|e| e.to_string())?;
    print!("{}", crate::demo::render(&report));
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `flashrt bench`: a TOML model with random weights, or a checkpoint exactly like it.
pub fn bench(a: &BenchArgs) -> Result<ExitCode, String> {
    let opts = crate::bench::BenchOptions {
        lengths: a.lengths.clone(),
        iters: a.iters,
        decode_steps: a.decode_steps,
        profile: a.profile,
        profile_rows: a.profile_rows.clone(),
    };
    let mut margs = a.model.clone();
    // A TOML model without weights is benchmarked with random ones.
    if margs.checkpoint.is_none() && margs.model.as_ref().is_some_and(|m| m.is_file()) {
        margs.random_weights = true;
    }
    let loaded = flashrt_serve::cli::open(&margs)?;
    let report = crate::bench::run(&loaded.model, loaded.load_seconds * 1e3, &opts)?;
    print!("{}", crate::bench::render(&report));
    for p in &report.profiles {
        print!("\n{}", crate::bench::render_profile(p));
    }
    let batched = if a.batch.is_empty() {
        None
    } else {
        if let Some(b) = a.batch.iter().find(|&&b| b == 0) {
            return Err(format!("--batch {b}: a batch has at least one session"));
        }
        let r = crate::bench_batch::run(
            &loaded.model,
            &a.batch,
            &a.lengths,
            a.decode_steps.max(4),
            report.decode_weight_bytes,
            report.copy_bandwidth_gb_s,
            a.profile,
        )?;
        print!("\n{}", crate::bench_batch::render(&r));
        for p in &r.profiles {
            print!("\n{}", crate::bench::render_profile(p));
        }
        Some(r)
    };
    let served = if a.serve {
        let sopts = crate::bench_serve::ServeBenchOptions {
            prefixes: a.lengths.clone(),
            suffixes: a.serve_suffixes.clone(),
            runs: a.serve_runs.max(1),
            decode_tokens: a.decode_steps.max(2),
            clients: a.serve_clients,
            newcomer: a.serve_newcomer,
            choices: a.serve_choices,
            chat: a.serve_chat.clone(),
            demote_on_worker: a.serve_demote_on_worker,
            budget_device: a.serve_budget_device,
            budget_host: a.serve_budget_host,
        };
        let r = crate::bench_serve::run(&loaded.model, &sopts)?;
        print!("\n{}", crate::bench_serve::render(&r));
        Some(r)
    } else {
        None
    };
    let sessions = match a.sessions {
        Some(n) if n > 0 => {
            let len = a.lengths.iter().copied().max().unwrap_or(2048);
            let r = crate::bench_sessions::run(&loaded.model, n, len)?;
            print!("\n{}", crate::bench_sessions::render(&r));
            Some(r)
        }
        _ => None,
    };
    if let Some(j) = &a.json {
        let mut value = serde_json::to_value(&report).map_err(|e| e.to_string())?;
        if let Some(r) = &served {
            value["serve"] = serde_json::to_value(r).map_err(|e| e.to_string())?;
        }
        if let Some(r) = &batched {
            value["batch"] = serde_json::to_value(r).map_err(|e| e.to_string())?;
        }
        if let Some(r) = &sessions {
            value["sessions"] = serde_json::to_value(r).map_err(|e| e.to_string())?;
        }
        let text = serde_json::to_string_pretty(&value).map_err(|e| e.to_string())?;
        std::fs::write(j, text).map_err(|e| format!("cannot write {}: {e}", j.display()))?;
        println!("wrote {}", j.display());
    }
    Ok(ExitCode::SUCCESS)
}

fn read(path: &std::path::Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// `flashrt compile`.
pub fn compile(a: &CompileArgs) -> Result<ExitCode, String> {
    let src = read(&a.model)?;
    let ir = crate::compiler::model_from_toml(&src, &a.model.display().to_string())
        .map_err(|d| d.to_string())?;
    let dtype = match &a.target {
        None => ir.dtype,
        Some(t) => {
            crate::ir::DType::parse(t).ok_or_else(|| format!("unknown target dtype `{t}`"))?
        }
    };
    let compiled = crate::ir::compile(&ir, crate::ir::Target { dtype });
    print!("{}", compile_report(&compiled, a.ops));
    if let Some(out) = &a.emit_rust {
        let code = crate::compiler::emit::rust_source(&ir);
        std::fs::write(out, code).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
        println!("wrote generated Rust to {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `flashrt import-hf`.
pub fn import_hf(a: &ImportArgs) -> Result<ExitCode, String> {
    let path = if a.config.is_dir() {
        a.config.join("config.json")
    } else {
        a.config.clone()
    };
    let json = read(&path)?;
    let mut opts = crate::ir::hf::HfOptions {
        name: a.name.clone(),
        max_seq: a.max_seq,
        prefill_buckets: a.buckets.clone(),
        ..Default::default()
    };
    if let Some(d) = &a.dtype {
        opts.dtype =
            Some(crate::ir::DType::parse(d).ok_or_else(|| format!("unknown dtype `{d}`"))?);
    }
    if opts.name.is_none() {
        opts.name = path.canonicalize().ok().and_then(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().replace(['-', '.'], "_"))
        });
    }
    let ir = crate::ir::hf::ir_from_hf_config(&json, &opts)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    print!("{}", crate::compiler::ir_to_toml(&ir));
    Ok(ExitCode::SUCCESS)
}
