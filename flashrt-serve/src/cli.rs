//! `flashrt serve`: load a model, start a [`Server`], run until Ctrl-C, persist the store.

use crate::args::Args;
use crate::tokenizer::Tokenizer;
use crate::{ServeConfig, Server};
use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::{Backend, Model, WeightSource};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// Usage lines for the `flashrt` help text.
pub const USAGE: &str = concat!(
    "    flashrt serve <model.toml> (--random-weights [--seed N] | --checkpoint DIR) [OPTIONS]\n",
    "    flashrt serve --checkpoint DIR [--max-seq N] [--buckets 16,64] [OPTIONS]\n",
    "        Serve a model over HTTP: OpenAI-compatible completions, a sessions API over\n",
    "        capsules, a tiered capsule store. Ctrl-C stops it and writes every stored\n",
    "        capsule to --store-dir. OPTIONS (BYTES takes K/M/G suffixes):\n",
    "        --bind 127.0.0.1:8077     --token BEARER           --backend cpu|cuda\n",
    "        --store-dir DIR           --files-dir DIR          --max-sessions N\n",
    "        --budget-device BYTES     --budget-host BYTES      --budget-disk BYTES\n",
    "        --tokenizer tokenizer.json (needs the `tokenizers` feature)   --no-auto-cache\n",
);

/// `4G`, `512M`, `64K`, `1000`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                'B' => 1,
                _ => return Err(format!("`{s}`: unknown size suffix")),
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a byte count"))?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("`{s}` is not a byte count"));
    }
    Ok((n * mul as f64) as u64)
}

/// The model a `serve` command line names.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A TOML description with random weights.
    TomlRandom { toml: PathBuf, seed: u64 },
    /// A TOML description with weights from a Hugging Face checkpoint folder.
    TomlCheckpoint { toml: PathBuf, dir: PathBuf },
    /// A Hugging Face checkpoint folder (`config.json` + safetensors).
    Checkpoint { dir: PathBuf, opts: HfOptions },
}

/// Load the model a source names.
pub fn load_model(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<Model, String> {
    let from_toml = |p: &Path| -> Result<flashrt_runtime::ir::ModelIr, String> {
        let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
        flashrt_compiler::model_from_toml(&text, &p.display().to_string())
            .map_err(|d| d.to_string())
    };
    match src {
        ModelSource::TomlRandom { toml, seed } => {
            let ir = from_toml(toml)?;
            Model::from_ir(backend, &ir, WeightSource::Random(*seed)).map_err(|e| e.to_string())
        }
        ModelSource::TomlCheckpoint { toml, dir } => {
            let ir = from_toml(toml)?;
            Model::load_ir_dir(backend, ir, dir).map_err(|e| e.to_string())
        }
        ModelSource::Checkpoint { dir, opts } => {
            Model::load_hf_dir(backend, dir, opts).map_err(|e| e.to_string())
        }
    }
}

/// EOS ids from `generation_config.json` or `config.json` of a checkpoint folder.
pub fn eos_from_dir(dir: &Path) -> Vec<u32> {
    for f in ["generation_config.json", "config.json"] {
        let Ok(text) = std::fs::read_to_string(dir.join(f)) else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
            continue;
        };
        match &v["eos_token_id"] {
            serde_json::Value::Number(n) => {
                if let Some(x) = n.as_u64().and_then(|x| u32::try_from(x).ok()) {
                    return vec![x];
                }
            }
            serde_json::Value::Array(a) => {
                return a
                    .iter()
                    .filter_map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect();
            }
            _ => {}
        }
    }
    Vec::new()
}

/// Everything `flashrt serve` parsed.
pub struct Plan {
    pub source: ModelSource,
    pub backend: Option<String>,
    pub config: ServeConfig,
    pub tokenizer: Option<PathBuf>,
}

/// Parse a `serve` command line.
pub fn parse(args: &[String]) -> Result<Plan, String> {
    const SWITCHES: &[&str] = &["random-weights", "no-auto-cache"];
    const VALUED: &[&str] = &[
        "checkpoint",
        "seed",
        "max-seq",
        "buckets",
        "bind",
        "token",
        "backend",
        "budget-device",
        "budget-host",
        "budget-disk",
        "store-dir",
        "files-dir",
        "max-sessions",
        "tokenizer",
    ];
    let a = Args::parse(args, SWITCHES, VALUED)?;
    let checkpoint = a.get("checkpoint").map(PathBuf::from);
    let source = match (a.positional.as_slice(), checkpoint) {
        ([toml], Some(dir)) => ModelSource::TomlCheckpoint {
            toml: toml.into(),
            dir,
        },
        ([toml], None) if a.has("random-weights") => ModelSource::TomlRandom {
            toml: toml.into(),
            seed: a.num("seed")?.unwrap_or(0),
        },
        ([_], None) => {
            return Err("a TOML model needs --random-weights or --checkpoint DIR".into());
        }
        ([], Some(dir)) => {
            let opts = HfOptions {
                max_seq: a.num("max-seq")?,
                prefill_buckets: a.list("buckets")?,
                ..HfOptions::default()
            };
            ModelSource::Checkpoint { dir, opts }
        }
        ([], None) => return Err("missing model: <model.toml> or --checkpoint DIR".into()),
        _ => return Err("expected at most one model file".into()),
    };
    let mut config = ServeConfig::default();
    if let Some(b) = a.get("bind") {
        config.bind = b
            .parse::<SocketAddr>()
            .map_err(|_| format!("--bind: `{b}` is not an address like 127.0.0.1:8077"))?;
    }
    config.token = a.get("token").map(str::to_string);
    if let Some(v) = a.get("budget-device") {
        config.store.budget_device = parse_bytes(v)?;
    }
    if let Some(v) = a.get("budget-host") {
        config.store.budget_host = parse_bytes(v)?;
    }
    if let Some(v) = a.get("budget-disk") {
        config.store.budget_disk = parse_bytes(v)?;
    }
    config.store.dir = a.get("store-dir").map(PathBuf::from);
    config.files_dir = a.get("files-dir").map(PathBuf::from);
    if let Some(n) = a.num("max-sessions")? {
        config.max_sessions = n;
    }
    config.auto_cache = !a.has("no-auto-cache");
    let dir = match &source {
        ModelSource::TomlCheckpoint { dir, .. } | ModelSource::Checkpoint { dir, .. } => {
            Some(dir.clone())
        }
        ModelSource::TomlRandom { .. } => None,
    };
    if let Some(d) = &dir {
        config.eos = eos_from_dir(d);
    }
    let tokenizer = a.get("tokenizer").map(PathBuf::from).or_else(|| {
        dir.map(|d| d.join("tokenizer.json"))
            .filter(|p| p.is_file() && crate::tokenizer::AVAILABLE)
    });
    Ok(Plan {
        source,
        backend: a.get("backend").map(str::to_string),
        config,
        tokenizer,
    })
}

/// `flashrt serve ...`: runs until Ctrl-C.
pub fn run(args: &[String]) -> Result<ExitCode, String> {
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("USAGE:\n{USAGE}");
        return Ok(ExitCode::SUCCESS);
    }
    let plan = parse(args)?;
    let backend: Arc<dyn Backend> = match plan.backend.as_deref() {
        None => flashrt_runtime::backend::best().map_err(|e| e.to_string())?,
        Some("cpu") => Arc::new(flashrt_runtime::CpuBackend::new()),
        Some("cuda") => Arc::new(
            flashrt_runtime::backend::cuda::CudaBackend::new(0).map_err(|e| e.to_string())?,
        ),
        Some(o) => return Err(format!("unknown backend `{o}` (cpu or cuda)")),
    };
    let model = load_model(&plan.source, backend)?;
    let tokenizer = plan.tokenizer.as_deref().map(Tokenizer::load).transpose()?;
    let bind_public = !plan.config.bind.ip().is_loopback();
    let server = Server::start(model.clone(), tokenizer, plan.config.clone())?;
    eprintln!(
        "flashrt serve: model {} ({}, fingerprint {}) on {}\n  listening on http://{}{}",
        model.name(),
        model.backend_name(),
        model.fingerprint(),
        if plan.config.store.dir.is_some() {
            "a store with a disk tier"
        } else {
            "an in-memory store"
        },
        server.addr(),
        if plan.config.token.is_some() {
            " (bearer token required)"
        } else {
            ""
        }
    );
    if bind_public && plan.config.token.is_none() {
        eprintln!("  warning: listening beyond loopback without --token");
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let _ = tokio::signal::ctrl_c().await;
    });
    eprintln!("flashrt serve: stopping; persisting the capsule store");
    server.shutdown()?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert_eq!(parse_bytes("64K").unwrap(), 64 << 10);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("2m").unwrap(), 2 << 20);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1").is_err());
    }

    #[test]
    fn command_lines() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let p = parse(&s(&[
            "m.toml",
            "--random-weights",
            "--budget-host",
            "1M",
            "--bind",
            "127.0.0.1:0",
        ]))
        .unwrap();
        assert!(matches!(p.source, ModelSource::TomlRandom { .. }));
        assert_eq!(p.config.store.budget_host, 1 << 20);
        assert!(parse(&s(&["m.toml"])).is_err());
        assert!(parse(&s(&[])).is_err());
        assert!(parse(&s(&["--checkpoint", "d", "--bogus"])).is_err());
        assert!(parse(&s(&["--checkpoint", "d", "--bind", "nope"])).is_err());
        let p = parse(&s(&[
            "--checkpoint",
            "d",
            "--max-seq",
            "128",
            "--buckets",
            "4,16",
        ]))
        .unwrap();
        match p.source {
            ModelSource::Checkpoint { opts, .. } => {
                assert_eq!(opts.max_seq, Some(128));
                assert_eq!(opts.prefill_buckets, Some(vec![4, 16]));
            }
            _ => panic!(),
        }
    }
}
