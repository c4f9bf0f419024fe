//! `flashrt run`: one prompt in, the model's text out as it is generated.
//!
//! With a checkpoint that ships a chat template (and no `--raw`), the prompt is sent as a
//! user message through the model's own template, as a chat client would; otherwise it is
//! tokenized as it is. Text streams to standard output as whole characters (see
//! `flashrt_serve::text::TextStream`); timings go to standard error at the end.

use crate::runtime::{LogitsMode, SamplerState, Session};
use clap::Args;
use flashrt_serve::cli::{Loaded, ModelArgs};
use flashrt_serve::text::{RenderOptions, Text, TextStream};
use serde_json::{Value, json};
use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Instant;

/// How to generate (shared by `run` and `chat`).
#[derive(Args, Clone, Debug)]
pub struct SampleArgs {
    /// Most tokens to generate per answer
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_tokens: usize,
    /// Sampling temperature, 0 = greedy (default: the checkpoint's generation_config.json;
    /// greedy when it has none)
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Keep only the K most likely tokens
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Seed of the sampler (default: from the clock)
    #[arg(long, value_name = "N")]
    pub sample_seed: Option<u64>,
    /// Stop when the text contains this string (repeatable; it is not printed)
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens
    #[arg(long)]
    pub ignore_eos: bool,
    /// Ask a template with a thinking toggle to think (`enable_thinking=true`)
    #[arg(long, conflicts_with = "no_think")]
    pub think: bool,
    /// Ask a template with a thinking toggle not to think (`enable_thinking=false`)
    #[arg(long)]
    pub no_think: bool,
}

impl SampleArgs {
    /// The sampler: these flags over the checkpoint's defaults.
    pub fn sampler(&self, loaded: &Loaded) -> SamplerState {
        let seed = self.sample_seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        let d = loaded.defaults.sampler(seed);
        SamplerState::seeded(
            seed,
            self.temperature.unwrap_or(d.temperature),
            self.top_k.unwrap_or(d.top_k),
            self.top_p.unwrap_or(d.top_p),
        )
    }

    /// Template keywords these flags set.
    pub fn template_kwargs(&self) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        if self.think || self.no_think {
            m.insert("enable_thinking".into(), json!(self.think));
        }
        m
    }
}

/// `flashrt run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (default: standard input)
    #[arg(value_name = "PROMPT")]
    pub prompt: Option<String>,
    /// Tokenize the prompt as it is instead of sending it through the chat template
    #[arg(long)]
    pub raw: bool,
    /// A system prompt (with the chat template)
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    #[command(flatten)]
    pub sample: SampleArgs,
}

/// What one answer took.
#[derive(Clone, Debug, Default)]
pub struct Generated {
    pub ids: Vec<u32>,
    pub text: String,
    pub finish: &'static str,
    /// New prompt tokens prefilled, and their time.
    pub prefilled: usize,
    pub prefill_ms: f64,
    /// From the start of the prefill to the first token chosen.
    pub first_token_ms: f64,
    pub decode_ms: f64,
}

/// Prefill `prompt` (appended to what the session holds), then sample up to `max_tokens`
/// tokens, handing each piece of visible text to `out` as soon as it is complete. A token that
/// ends the answer (EOS, a stop string, the token limit) is not fed, so the session ends where
/// the answer does.
pub fn generate(
    session: &mut Session,
    prompt: &[u32],
    text: Option<&Text>,
    eos: &[u32],
    args: &SampleArgs,
    out: &mut dyn FnMut(&str),
) -> crate::runtime::Result<Generated> {
    let t0 = Instant::now();
    session.set_logits_mode(LogitsMode::Last);
    if !prompt.is_empty() {
        session.append(prompt)?;
        // The step returns before the device has run it.
        session.synchronize()?;
    }
    let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut g = Generated {
        prefilled: prompt.len(),
        prefill_ms,
        finish: "length",
        ..Generated::default()
    };
    let mut stream = text.map(|t| TextStream::new(&t.tokenizer, &args.stop));
    let max = session.model().max_seq();
    let t1 = Instant::now();
    for i in 0..args.max_tokens {
        if session.pos() >= max {
            break;
        }
        let t = session.sample_next()?;
        if i == 0 {
            g.first_token_ms = t0.elapsed().as_secs_f64() * 1e3;
        }
        g.ids.push(t);
        let piece = stream.as_mut().map(|s| s.push(t)).unwrap_or_default();
        out(&piece.text);
        if piece.stop || (!args.ignore_eos && eos.contains(&t)) {
            g.finish = "stop";
            break;
        }
        if i + 1 < args.max_tokens {
            session.append(&[t])?;
        }
    }
    if let Some(s) = stream.as_mut() {
        out(&s.finish().text);
        g.text = s.text().to_string();
    }
    g.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
    Ok(g)
}

/// The prompt ids of `run`: the chat template over a user message (and a system prompt)
/// when there is one and `--raw` is not given, else the text itself.
pub fn prompt_ids(
    text: Option<&Text>,
    prompt: &str,
    system: Option<&str>,
    raw: bool,
    kwargs: serde_json::Map<String, Value>,
) -> Result<Vec<u32>, String> {
    let Some(t) = text else {
        // No tokenizer: the prompt must be token ids.
        return prompt
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u32>().map_err(|_| {
                    format!(
                        "this model has no tokenizer.json: give the prompt as token ids (`{s}` is not one)"
                    )
                })
            })
            .collect();
    };
    match (&t.template, raw) {
        (Some(tm), false) => {
            let mut msgs = Vec::new();
            if let Some(s) = system {
                msgs.push(json!({"role": "system", "content": s}));
            }
            msgs.push(json!({"role": "user", "content": prompt}));
            let rendered = tm.render(
                &Value::Array(msgs),
                &RenderOptions {
                    tools: None,
                    add_generation_prompt: true,
                    kwargs,
                },
            )?;
            t.tokenizer.encode(&rendered)
        }
        _ => {
            if system.is_some() {
                return Err("--system needs a chat template (and no --raw)".into());
            }
            t.tokenizer.encode_with(prompt, true)
        }
    }
}

/// `flashrt run MODEL [PROMPT]`.
pub fn run(a: &RunArgs) -> Result<ExitCode, String> {
    let mut margs = a.model.clone();
    let mut prompt = a.prompt.clone();
    // `flashrt run --checkpoint DIR "text"`: the one positional is the prompt.
    if prompt.is_none()
        && margs.checkpoint.is_some()
        && margs.model.as_ref().is_some_and(|m| !m.exists())
    {
        prompt = margs.model.take().map(|m| m.to_string_lossy().into_owned());
    }
    let prompt = match prompt {
        Some(p) if p != "-" => p,
        _ => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| format!("reading the prompt from standard input: {e}"))?;
            s
        }
    };
    let loaded = flashrt_serve::cli::open(&margs)?;
    let ids = prompt_ids(
        loaded.text.as_ref(),
        &prompt,
        a.system.as_deref(),
        a.raw,
        a.sample.template_kwargs(),
    )?;
    if ids.is_empty() {
        return Err("the prompt is empty".into());
    }
    if ids.len() >= loaded.model.max_seq() {
        return Err(format!(
            "the prompt has {} tokens; the model holds {} (max_seq) and needs room to answer",
            ids.len(),
            loaded.model.max_seq()
        ));
    }
    let mut session = loaded.model.session().map_err(|e| e.to_string())?;
    session.set_sampler(a.sample.sampler(&loaded));
    let stdout = std::io::stdout();
    let mut lock = stdout.lock();
    let no_text = loaded.text.is_none();
    let mut ids_out = Vec::new();
    let g = generate(
        &mut session,
        &ids,
        loaded.text.as_ref(),
        &loaded.eos(),
        &a.sample,
        &mut |piece| {
            let _ = lock.write_all(piece.as_bytes());
            let _ = lock.flush();
        },
    )
    .map_err(|e| e.to_string())?;
    if no_text {
        ids_out.extend(g.ids.iter().map(u32::to_string));
        let _ = write!(lock, "{}", ids_out.join(" "));
    }
    let _ = writeln!(lock);
    drop(lock);
    let n = g.ids.len();
    eprintln!(
        "[{} prompt tokens in {:.1} ms; first token {:.1} ms; {n} tokens in {:.1} ms ({:.1} tokens/s); {}]",
        g.prefilled,
        g.prefill_ms,
        g.first_token_ms,
        g.decode_ms,
        if g.decode_ms > 0.0 {
            n as f64 / (g.decode_ms / 1e3)
        } else {
            0.0
        },
        g.finish
    );
    Ok(ExitCode::SUCCESS)
}
