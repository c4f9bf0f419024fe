//! What the `flashrt` commands that run a model share — where the model, its weights and its
//! text come from ([`ModelArgs`], [`open`]) — and `flashrt serve` ([`ServeArgs`], [`serve`]).
//!
//! It lives in this crate because `serve` is implemented here, below the `flashrt` binary
//! that dispatches every command; `run`, `chat` and `bench` reuse [`ModelArgs`] and [`open`].
//!
//! Loading order matters to a user: the tokenizer and chat template are read first, so a
//! broken `tokenizer.json` fails in a second, not after minutes of weights.

use crate::text::{GenerationDefaults, Text};
use crate::{ServeConfig, Server};
use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::ir::{DType, QuantIr};
use flashrt_runtime::{Backend, Model, WeightSource};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

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

/// A backend by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The f32 reference.
    Cpu,
    /// One NVIDIA GPU (needs a build with `--features cuda`).
    Cuda,
}

/// Where the matrix products of decode, verify and batched steps run on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DecodeMatmuls {
    /// CUDA cores: the fastest single stream (the default)
    CudaCores,
    /// Tensor cores: several streams stepped together cost little more than one (a server
    /// with many streams; one stream is ~14 % slower)
    TensorCores,
}

/// The backend `--backend` names, else the best available (CUDA when compiled in and a GPU is
/// present; `FLASHRT_BACKEND=cpu|cuda` forces one).
pub fn backend(kind: Option<BackendKind>) -> Result<Arc<dyn Backend>, String> {
    backend_with(kind, None)
}

/// [`backend`] with the GPU's decode matmuls chosen (`None`: the default; `FLASHRT_GEMV16_MMA=1`
/// picks the tensor cores). The CPU reference ignores the choice.
pub fn backend_with(
    kind: Option<BackendKind>,
    matmuls: Option<DecodeMatmuls>,
) -> Result<Arc<dyn Backend>, String> {
    let tensor = matmuls.map(|m| m == DecodeMatmuls::TensorCores);
    Ok(match kind {
        None => flashrt_runtime::backend::best_with(tensor).map_err(|e| e.to_string())?,
        Some(BackendKind::Cpu) => Arc::new(flashrt_runtime::CpuBackend::new()),
        Some(BackendKind::Cuda) => {
            flashrt_runtime::backend::cuda_with(tensor).map_err(|e| e.to_string())?
        }
    })
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    DType::parse(s).ok_or_else(|| format!("unknown dtype `{s}` (f32, bf16 or f16)"))
}

/// Where a model, its weights and its text come from.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ModelArgs {
    /// A Hugging Face checkpoint folder (config.json + *.safetensors), or a model TOML
    #[arg(value_name = "MODEL")]
    pub model: Option<PathBuf>,
    /// Weights of a TOML model from this checkpoint folder (alone: the checkpoint to run)
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Deterministic random weights for a TOML model
    #[arg(long)]
    pub random_weights: bool,
    /// Seed of --random-weights
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub seed: u64,
    /// Backend (default: CUDA when built with it and a GPU is present, else the CPU)
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Where the GPU runs the matrix products of decode, verify and batched steps (default:
    /// CUDA cores; `tensor-cores` for serving several streams at once)
    #[arg(long, value_enum, value_name = "UNITS")]
    pub decode_matmuls: Option<DecodeMatmuls>,
    /// Positions per session of a checkpoint (default: config.json's, capped to what fits)
    #[arg(long, value_name = "N")]
    pub max_seq: Option<usize>,
    /// Prefill buckets of a checkpoint, rows (default: 64,512,2048,4096 up to max_seq)
    #[arg(long, value_delimiter = ',', value_name = "ROWS")]
    pub buckets: Option<Vec<usize>>,
    /// Compute dtype of a checkpoint on the GPU (default: its own; the CPU computes in f32)
    #[arg(long, value_parser = parse_dtype, value_name = "DTYPE")]
    pub dtype: Option<DType>,
    /// A tokenizer.json to use instead of the checkpoint's (its folder's chat template too)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Quantize the weights while they load: `fp8` (E4M3, 128 x 128 blocks, the bf16
    /// matrices of Qwen's FP8 releases kept in bf16). A checkpoint that is already quantized
    /// keeps its own format
    #[arg(long, value_parser = parse_quantize, value_name = "FORMAT")]
    pub quantize: Option<QuantIr>,
}

fn parse_quantize(s: &str) -> Result<QuantIr, String> {
    match flashrt_runtime::ir::QuantFormat::parse(s) {
        Some(f) => Ok(QuantIr::with_defaults(f, [128, 128])),
        None => Err(format!("unknown quantization `{s}` (fp8)")),
    }
}

/// The model a command line names.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// A TOML description with random weights (`quantize`: overrides the TOML's).
    TomlRandom {
        toml: PathBuf,
        seed: u64,
        quantize: Option<QuantIr>,
    },
    /// A TOML description with weights from a Hugging Face checkpoint folder.
    TomlCheckpoint {
        toml: PathBuf,
        dir: PathBuf,
        quantize: Option<QuantIr>,
    },
    /// A Hugging Face checkpoint folder (`config.json` + safetensors).
    Checkpoint { dir: PathBuf, opts: HfOptions },
}

impl ModelSource {
    /// The checkpoint folder, if the weights come from one.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            ModelSource::TomlCheckpoint { dir, .. } | ModelSource::Checkpoint { dir, .. } => {
                Some(dir)
            }
            ModelSource::TomlRandom { .. } => None,
        }
    }
}

impl ModelArgs {
    /// What the arguments name (checked, nothing loaded).
    pub fn source(&self) -> Result<ModelSource, String> {
        let opts = HfOptions {
            max_seq: self.max_seq,
            prefill_buckets: self.buckets.clone(),
            dtype: self.dtype,
            quantize: self.quantize.clone(),
            ..HfOptions::default()
        };
        let is_dir = |p: &Path| p.is_dir();
        match (&self.model, &self.checkpoint) {
            (Some(m), None) if is_dir(m) => {
                if self.random_weights {
                    return Err(format!(
                        "{} is a checkpoint folder: it has its own weights (--random-weights is for a TOML model)",
                        m.display()
                    ));
                }
                if !m.join("config.json").is_file() {
                    return Err(format!(
                        "{}: not a checkpoint folder (no config.json)",
                        m.display()
                    ));
                }
                Ok(ModelSource::Checkpoint {
                    dir: m.clone(),
                    opts,
                })
            }
            (Some(m), ckpt) => {
                if !m.is_file() {
                    return Err(format!(
                        "{}: no such model file or checkpoint folder",
                        m.display()
                    ));
                }
                // A TOML model states these itself; ignoring the flags would run another model
                // than the one asked for.
                let flags: Vec<&str> = [
                    ("--max-seq", self.max_seq.is_some()),
                    ("--buckets", self.buckets.is_some()),
                    ("--dtype", self.dtype.is_some()),
                ]
                .into_iter()
                .filter_map(|(f, set)| set.then_some(f))
                .collect();
                if !flags.is_empty() {
                    return Err(format!(
                        "{} set{} what a checkpoint's config.json leaves open; {} states it in its \
                         [model] table (max_seq, prefill_buckets, dtype): edit a copy of the TOML",
                        flags.join(", "),
                        if flags.len() == 1 { "s" } else { "" },
                        m.display()
                    ));
                }
                match (ckpt, self.random_weights) {
                    (Some(d), false) => Ok(ModelSource::TomlCheckpoint {
                        toml: m.clone(),
                        dir: d.clone(),
                        quantize: self.quantize.clone(),
                    }),
                    (None, true) => Ok(ModelSource::TomlRandom {
                        toml: m.clone(),
                        seed: self.seed,
                        quantize: self.quantize.clone(),
                    }),
                    (Some(_), true) => {
                        Err("--checkpoint and --random-weights exclude each other".into())
                    }
                    (None, false) => {
                        Err("a TOML model needs --random-weights or --checkpoint DIR".into())
                    }
                }
            }
            (None, Some(d)) => Ok(ModelSource::Checkpoint {
                dir: d.clone(),
                opts,
            }),
            (None, None) => Err("missing model: a checkpoint folder or a model TOML".into()),
        }
    }
}

/// A loaded model with what its checkpoint says about text.
pub struct Loaded {
    pub model: Model,
    pub text: Option<Text>,
    pub defaults: GenerationDefaults,
    pub source: ModelSource,
    /// Seconds from the start of the weights' load to a model ready to run.
    pub load_seconds: f64,
}

impl Loaded {
    /// Every stop id: the checkpoint's EOS ids and the tokenizer's `eos_token`.
    pub fn eos(&self) -> Vec<u32> {
        let mut v = self.defaults.eos.clone();
        if let Some(t) = &self.text
            && let Some(id) = t.eos_token_id()
            && !v.contains(&id)
        {
            v.push(id);
        }
        v
    }
}

/// Load the model `args` name: text first (a broken tokenizer fails before the weights
/// load), then the weights on the chosen backend, with a progress bar on a terminal.
pub fn open(args: &ModelArgs) -> Result<Loaded, String> {
    let source = args.source()?;
    let dir = source.dir().map(Path::to_path_buf);
    let text = match (&args.tokenizer, &dir) {
        (Some(t), _) => Some(Text::load(t, None)?),
        (None, Some(d)) => Text::from_dir(d)?,
        (None, None) => None,
    };
    if let Some(t) = &text {
        tracing::info!(
            "tokenizer {} ({} tokens){}",
            t.origin.display(),
            t.tokenizer.vocab_size(),
            match &t.template {
                Some(tm) => format!(", chat template {}", tm.origin()),
                None => ", no chat template".into(),
            }
        );
    }
    let defaults = match &dir {
        Some(d) => GenerationDefaults::from_dir(d)?,
        None => GenerationDefaults::default(),
    };
    let backend = backend_with(args.backend, args.decode_matmuls)?;
    let t0 = std::time::Instant::now();
    let model = load_model(&source, backend)?;
    let load_seconds = t0.elapsed().as_secs_f64();
    if let Some(t) = &text
        && t.tokenizer.vocab_size() > model.vocab()
    {
        tracing::warn!(
            "the tokenizer has {} tokens, the model's vocabulary {}: ids past it are refused",
            t.tokenizer.vocab_size(),
            model.vocab()
        );
    }
    Ok(Loaded {
        model,
        text,
        defaults,
        source,
        load_seconds,
    })
}

/// Load the model a source names.
pub fn load_model(src: &ModelSource, backend: Arc<dyn Backend>) -> Result<Model, String> {
    let from_toml =
        |p: &Path, quantize: &Option<QuantIr>| -> Result<flashrt_runtime::ir::ModelIr, String> {
            let text = std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
            let mut ir = flashrt_compiler::model_from_toml(&text, &p.display().to_string())
                .map_err(|d| d.to_string())?;
            if quantize.is_some() {
                ir.quant = quantize.clone();
            }
            Ok(ir)
        };
    match src {
        ModelSource::TomlRandom {
            toml,
            seed,
            quantize,
        } => {
            let ir = from_toml(toml, quantize)?;
            Model::from_ir(backend, &ir, WeightSource::Random(*seed)).map_err(|e| e.to_string())
        }
        ModelSource::TomlCheckpoint {
            toml,
            dir,
            quantize,
        } => {
            let ir = from_toml(toml, quantize)?;
            Model::load_ir_dir(backend, ir, dir).map_err(|e| e.to_string())
        }
        ModelSource::Checkpoint { dir, opts } => {
            Model::load_hf_dir(backend, dir, opts).map_err(|e| e.to_string())
        }
    }
}

/// `flashrt serve`: a model behind an HTTP API.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (port 0: any free port)
    #[arg(long, default_value = "127.0.0.1:8077", value_name = "ADDR")]
    pub bind: SocketAddr,
    /// Require `Authorization: Bearer TOKEN` on every endpoint but /health (one tenant)
    #[arg(long, value_name = "TOKEN", conflicts_with = "tokens")]
    pub token: Option<String>,
    /// Tenants: a JSON file of name -> token (or {"token", "max_sessions",
    /// "max_capsule_bytes"}), re-read when it changes; each tenant its own namespace
    #[arg(long, value_name = "FILE")]
    pub tokens: Option<PathBuf>,
    /// Let automatic prefix reuse restore capsules computed for other tenants
    #[arg(long)]
    pub share_prefix_cache: bool,
    /// Seconds a client may take to send a request's headers (also closes idle connections)
    #[arg(long, default_value_t = 10.0, value_name = "S")]
    pub header_timeout: f64,
    /// Seconds a client may take to send a request's body
    #[arg(long, default_value_t = 60.0, value_name = "S")]
    pub body_timeout: f64,
    /// Connections open at once (more are closed on arrival)
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub max_connections: usize,
    /// Seconds in-flight requests may run on at shutdown before they are cancelled
    #[arg(long, default_value_t = 10.0, value_name = "S")]
    pub grace: f64,
    /// Capsule store directory (the disk tier; the store is persisted there on shutdown)
    #[arg(long, value_name = "DIR")]
    pub store_dir: Option<PathBuf>,
    /// Where capsule export/import by file name goes (default: STORE_DIR/files)
    #[arg(long, value_name = "DIR")]
    pub files_dir: Option<PathBuf>,
    /// Byte budget of the device tier (K/M/G suffixes; default on a GPU: a quarter of the
    /// memory the weights leave, at most 64G, less the one capsule the tier may hold past its
    /// budget while another is copied to the host; elsewhere 1G)
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub budget_device: Option<u64>,
    /// Byte budget of the host-memory tier
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub budget_host: Option<u64>,
    /// Byte budget of the disk tier
    #[arg(long, value_parser = parse_bytes, value_name = "BYTES")]
    pub budget_disk: Option<u64>,
    /// Move capsules down the tiers on the worker thread (every stream waits for the copy,
    /// the hashing and the file writes) instead of on threads of their own
    #[arg(long)]
    pub demote_on_worker: bool,
    /// Sessions open at once (default on a GPU: as many as fit in free device memory, at
    /// most 64; elsewhere 64)
    #[arg(long, value_name = "N")]
    pub max_sessions: Option<usize>,
    /// Do not store prompt and completion capsules for automatic prefix reuse
    #[arg(long)]
    pub no_auto_cache: bool,
    /// Speculative decoding with the model's MTP head for greedy completions: at most K drafts
    /// per round (1..=4; 0: off), shrunk down to plain decoding where drafting is measured to
    /// cost more than it saves; a request's `speculative` overrides it
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub speculative: usize,
}

impl ServeArgs {
    /// The server configuration these arguments give (the model's stop ids and sampling
    /// defaults are filled in by [`serve`] once the checkpoint is read).
    pub fn config(&self) -> ServeConfig {
        let secs = |s: f64| std::time::Duration::from_secs_f64(s.max(0.001));
        let mut config = ServeConfig {
            bind: self.bind,
            token: self.token.clone(),
            tokens_file: self.tokens.clone(),
            share_prefix_cache: self.share_prefix_cache,
            header_timeout: secs(self.header_timeout),
            body_timeout: secs(self.body_timeout),
            max_connections: self.max_connections,
            grace: secs(self.grace),
            files_dir: self.files_dir.clone(),
            auto_cache: !self.no_auto_cache,
            speculative: self.speculative,
            ..ServeConfig::default()
        };
        if let Some(v) = self.budget_device {
            config.store.budget_device = v;
        }
        if let Some(v) = self.budget_host {
            config.store.budget_host = v;
        }
        if let Some(v) = self.budget_disk {
            config.store.budget_disk = v;
        }
        config.store.dir = self.store_dir.clone();
        if self.demote_on_worker {
            config.store.background = false;
        }
        if let Some(n) = self.max_sessions {
            config.max_sessions = n;
        }
        config
    }
}

/// `flashrt serve ...`: runs until SIGINT or SIGTERM, then persists the store.
pub fn serve(args: &ServeArgs) -> Result<ExitCode, String> {
    let mut config = args.config();
    let loaded = open(&args.model)?;
    config.eos = loaded.eos();
    config.defaults = loaded.defaults.clone();
    let model = loaded.model.clone();
    let max_draft = flashrt_runtime::ir::lower::MAX_DRAFT;
    if args.speculative > max_draft {
        return Err(format!(
            "--speculative {}: at most {max_draft} drafts per round",
            args.speculative
        ));
    }
    if args.speculative > 0 && model.ir().mtp.is_none() {
        tracing::warn!(
            "--speculative {}: model {} has no MTP head; decoding stays plain",
            args.speculative,
            model.name()
        );
    }
    crate::calibrate_chunking(&model);
    if let Some(plan) = config.fit_memory(&model, args.max_sessions, args.budget_device)? {
        tracing::info!("device memory: {plan}");
    }
    let bind_public = !config.bind.ip().is_loopback();
    let server = Server::start(model.clone(), loaded.text, config.clone())?;
    tracing::info!(
        "model {} ({}, fingerprint {}, max_seq {}) loaded in {:.1} s; {}",
        model.name(),
        model.backend_name(),
        model.fingerprint(),
        model.max_seq(),
        loaded.load_seconds,
        if config.store.dir.is_some() {
            "store with a disk tier"
        } else {
            "in-memory store"
        },
    );
    // The line scripts wait for: ready to serve.
    eprintln!(
        "flashrt serve: listening on http://{}{}",
        server.addr(),
        if config.token.is_some() || config.tokens_file.is_some() {
            " (bearer token required)"
        } else {
            ""
        }
    );
    if bind_public && config.token.is_none() && config.tokens_file.is_none() {
        tracing::warn!("listening beyond loopback without --token or --tokens");
    }
    crate::run_until_signal(server)?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(v: &[&str]) -> Result<ServeArgs, String> {
        Cli::try_parse_from(std::iter::once("serve").chain(v.iter().copied()))
            .map(|c| c.serve)
            .map_err(|e| e.to_string())
    }

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
        let toml = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/demo.toml");
        let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/lfm2-public");
        let p = parse(&[
            toml,
            "--random-weights",
            "--budget-host",
            "1M",
            "--bind",
            "127.0.0.1:0",
        ])
        .unwrap();
        assert!(matches!(
            p.model.source().unwrap(),
            ModelSource::TomlRandom { .. }
        ));
        assert_eq!(p.config().store.budget_host, 1 << 20);
        assert!(parse(&[toml]).unwrap().model.source().is_err());
        assert!(parse(&[]).unwrap().model.source().is_err());
        assert!(parse(&["--checkpoint", "d", "--bogus"]).is_err());
        assert!(parse(&["--checkpoint", "d", "--bind", "nope"]).is_err());
        let p = parse(&["--checkpoint", "d", "--max-seq", "128", "--buckets", "4,16"]).unwrap();
        match p.model.source().unwrap() {
            ModelSource::Checkpoint { opts, .. } => {
                assert_eq!(opts.max_seq, Some(128));
                assert_eq!(opts.prefill_buckets, Some(vec![4, 16]));
            }
            s => panic!("{s:?}"),
        }
        // A folder as the positional model is a checkpoint.
        assert!(matches!(
            parse(&[fixture]).unwrap().model.source().unwrap(),
            ModelSource::Checkpoint { .. }
        ));
        let e = parse(&[fixture, "--random-weights"])
            .unwrap()
            .model
            .source()
            .unwrap_err();
        assert!(e.contains("has its own weights"), "{e}");
        // A TOML model states its own positions, buckets and dtype: the flags are refused,
        // not ignored.
        let e = parse(&[
            toml,
            "--random-weights",
            "--max-seq",
            "9000",
            "--dtype",
            "f16",
        ])
        .unwrap()
        .model
        .source()
        .unwrap_err();
        assert!(e.starts_with("--max-seq, --dtype set what"), "{e}");
    }
}
