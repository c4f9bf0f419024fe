//! The `flashrt` command line.

use flashrt_serve::args::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "\
flashrt — latency-first serving of hybrid language models with execution-state capsules

USAGE:
    flashrt demo [--backend cpu|cuda] [--prompt N]
        Run the embedded demo model: prefill, snapshot, fork two branches, roll back;
        print a table of operations, times, bytes and checks.
    flashrt compile <model.toml> [--target f32|bf16|f16] [--emit-rust <file.rs>] [--ops]
        Compile a model: print its buffer layout, plans per phase and capsule size.
    flashrt import-hf <config.json> [--name NAME] [--max-seq N] [--buckets 16,64] [--dtype bf16]
        Translate a Hugging Face config.json (qwen3_5_text, lfm2, nemotron_h) into TOML.
    flashrt check-reference <DIR> [--backend cpu|cuda]
        Check a checkpoint folder against transformers' reference outputs
        (config.json, model.safetensors, reference.safetensors[, state.safetensors]).
    flashrt serve <model.toml> (--random-weights | --checkpoint DIR) | --checkpoint DIR
          [--bind 127.0.0.1:8077] [--token BEARER] [--store-dir DIR] [--budget-device BYTES]
          [--budget-host BYTES] [--budget-disk BYTES] [--max-sessions N] [--tokenizer FILE]
        Serve a model over HTTP: OpenAI-compatible completions, a sessions API over
        capsules, a tiered capsule store (`flashrt serve --help` for every option).
    flashrt bench <model.toml> [--random-weights] [--lengths 2048,4096,8192,16384] [--iters N]
                  [--decode-steps N] [--json FILE] [--backend cpu|cuda] [--profile]
        Cold and restored time-to-first-token, snapshot/restore next to the copy floor,
        decode step next to the weight-bandwidth floor, per prompt length; --profile adds
        per-op device times of a decode step and a prefill chunk (CUDA).
    flashrt help
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        None | Some("help" | "--help" | "-h") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        Some("compile") => cmd_compile(&args[1..]),
        Some("import-hf") => cmd_import_hf(&args[1..]),
        Some("check-reference") => flashrt::cli::check_reference(&args[1..]),
        Some("demo") => flashrt::cli::demo(&args[1..]),
        Some("bench") => flashrt::cli::bench(&args[1..]),
        Some("serve") => flashrt_serve::cli::run(&args[1..]),
        Some(other) => Err(format!("unknown command `{other}`\n\n{USAGE}")),
    };
    match result {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn cmd_compile(args: &[String]) -> Result<ExitCode, String> {
    let a = Args::parse(args, &["ops"], &["target", "emit-rust"])?;
    let path = PathBuf::from(a.one("model file")?);
    let src = read(&path)?;
    let ir = flashrt::compiler::model_from_toml(&src, &path.display().to_string())
        .map_err(|d| d.to_string())?;
    let dtype = match a.get("target") {
        None => ir.dtype,
        Some(t) => {
            flashrt::ir::DType::parse(t).ok_or_else(|| format!("unknown target dtype `{t}`"))?
        }
    };
    let compiled = flashrt::ir::compile(&ir, flashrt::ir::Target { dtype });
    print!("{}", flashrt::cli::compile_report(&compiled, a.has("ops")));
    if let Some(out) = a.get("emit-rust") {
        let code = flashrt::compiler::emit::rust_source(&ir);
        std::fs::write(out, code).map_err(|e| format!("cannot write {out}: {e}"))?;
        println!("wrote generated Rust to {out}");
    }
    Ok(ExitCode::SUCCESS)
}

fn cmd_import_hf(args: &[String]) -> Result<ExitCode, String> {
    let a = Args::parse(args, &[], &["name", "max-seq", "buckets", "dtype"])?;
    let path = PathBuf::from(a.one("config.json")?);
    let json = read(&path)?;
    let mut opts = flashrt::ir::hf::HfOptions {
        name: a.get("name").map(str::to_string),
        max_seq: a.num("max-seq")?,
        prefill_buckets: a.list("buckets")?,
        ..Default::default()
    };
    if let Some(d) = a.get("dtype") {
        opts.dtype =
            Some(flashrt::ir::DType::parse(d).ok_or_else(|| format!("unknown dtype `{d}`"))?);
    }
    if opts.name.is_none() {
        opts.name = path.canonicalize().ok().and_then(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().replace(['-', '.'], "_"))
        });
    }
    let ir = flashrt::ir::hf::ir_from_hf_config(&json, &opts)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    print!("{}", flashrt::compiler::ir_to_toml(&ir));
    Ok(ExitCode::SUCCESS)
}
