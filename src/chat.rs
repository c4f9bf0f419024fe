//! `flashrt chat`: an interactive chat in the terminal, with the capsule workflow at hand.
//!
//! Every turn is appended to one session: the conversation is rendered with the model's chat
//! template, and only the tokens past what the session already holds are prefilled. When a
//! template rewrites earlier turns (Qwen's templates drop old reasoning, for instance), the
//! session is restored from the newest turn capsule that the new prompt still starts with,
//! and the rest is appended: restore + append equals a cold prefill at any boundary.
//!
//! Commands (one line each; anything else is a message):
//!
//! | command | what it does |
//! |---|---|
//! | `/save NAME` | snapshot the conversation as capsule NAME (a file in `--capsule-dir` too) |
//! | `/restore NAME` | continue from capsule NAME (from memory, or the file) |
//! | `/fork NAME` | a new branch NAME from here (an independent session); `/switch` back |
//! | `/switch NAME` | continue on branch NAME |
//! | `/rollback [N]` | undo the last N turns (default 1) |
//! | `/list` | capsules and branches, with tokens and bytes |
//! | `/history` | the conversation so far |
//! | `/reset` | a new conversation |
//! | `/help`, `/quit` | |
//!
//! Each answer is followed by its timings on standard error (new and reused prompt tokens,
//! prefill, first token, tokens per second); restores and forks say how long they took.

use crate::run::{SampleArgs, generate};
use crate::runtime::{Capsule, Model, Session};
use clap::Args;
use flashrt_serve::cli::{Loaded, ModelArgs};
use flashrt_serve::text::RenderOptions;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// `flashrt chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system prompt for the conversation
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Also write capsules saved with /save here (NAME.capsule + NAME.json), and let
    /// /restore read them back in a later chat
    #[arg(long, value_name = "DIR")]
    pub capsule_dir: Option<PathBuf>,
    #[command(flatten)]
    pub sample: SampleArgs,
}

/// One line of conversation: a session, the messages it holds, and a capsule per turn.
struct Branch {
    session: Session,
    messages: Vec<Value>,
    /// Per turn: the capsule right after its prompt was prefilled (a prefix of every later
    /// rendering of the conversation, whatever the answer re-tokenizes to), and the
    /// conversation before its user message (what /rollback returns to).
    turns: Vec<Turn>,
    /// Where the conversation started: empty, or a restored capsule and its messages.
    base: Option<(Capsule, Vec<Value>)>,
}

#[derive(Clone)]
struct Turn {
    prompt: Capsule,
    before: Vec<Value>,
}

struct Saved {
    capsule: Capsule,
    messages: Vec<Value>,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn mib(b: usize) -> String {
    format!("{:.2} MiB", b as f64 / (1 << 20) as f64)
}

struct Chat<'a> {
    loaded: &'a Loaded,
    args: &'a ChatArgs,
    branches: BTreeMap<String, Branch>,
    current: String,
    saved: BTreeMap<String, Saved>,
}

impl Chat<'_> {
    fn model(&self) -> &Model {
        &self.loaded.model
    }

    fn branch(&mut self) -> &mut Branch {
        self.branches
            .get_mut(&self.current)
            .expect("the current branch exists")
    }

    fn fresh_messages(&self) -> Vec<Value> {
        match &self.args.system {
            Some(s) => vec![json!({"role": "system", "content": s})],
            None => Vec::new(),
        }
    }

    fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<Vec<u32>, String> {
        let text = self
            .loaded
            .text
            .as_ref()
            .ok_or("this model has no tokenizer.json: `flashrt chat` needs text")?;
        let template = text.template.as_ref().ok_or(
            "this model has no chat template (chat_template.jinja or tokenizer_config.json): \
             use `flashrt run` for plain completion",
        )?;
        let prompt = template.render(
            &Value::Array(messages.to_vec()),
            &RenderOptions {
                tools: None,
                add_generation_prompt,
                kwargs: self.args.sample.template_kwargs(),
            },
        )?;
        // The conversation so far was tokenized last turn: only what follows the last added
        // token the two renderings share is encoded again.
        text.prefixes.encode(&text.tokenizer, "", &prompt)
    }

    /// Bring the session to a state whose history is a prefix of `ids`; returns how many
    /// tokens it already holds (reused) and whether a capsule was restored (its time).
    fn align(&mut self, ids: &[u32]) -> Result<(usize, Option<f64>), String> {
        let b = self.branch();
        if ids.starts_with(b.session.tokens()) {
            return Ok((b.session.pos(), None));
        }
        let best = b
            .turns
            .iter()
            .rev()
            .map(|t| &t.prompt)
            .chain(b.base.as_ref().map(|(c, _)| c))
            .find(|c| ids.starts_with(c.tokens()))
            .cloned();
        let t = Instant::now();
        match best {
            Some(c) => {
                b.session.restore(&c).map_err(|e| e.to_string())?;
                b.session.synchronize().map_err(|e| e.to_string())?;
                Ok((c.pos(), Some(ms(t))))
            }
            None => {
                b.session.reset().map_err(|e| e.to_string())?;
                Ok((0, None))
            }
        }
    }

    fn turn(&mut self, line: &str, out: &mut dyn Write) -> Result<(), String> {
        let mut messages = self.branch().messages.clone();
        messages.push(json!({"role": "user", "content": line}));
        let ids = self.render(&messages, true)?;
        if ids.len() >= self.model().max_seq() {
            return Err(format!(
                "the conversation has {} tokens; the model holds {} (max_seq): /rollback or /reset",
                ids.len(),
                self.model().max_seq()
            ));
        }
        let (reused, restored) = self.align(&ids)?;
        let eos = self.loaded.eos();
        let loaded = self.loaded;
        let sample = self.args.sample.clone();
        let b = self.branch();
        let before = b.messages.clone();
        // Prefill, then keep the prompt's capsule for the turns after this one.
        let t0 = Instant::now();
        b.session.set_logits_mode(crate::runtime::LogitsMode::Last);
        b.session
            .append(&ids[reused..])
            .map_err(|e| e.to_string())?;
        let prefill_ms = ms(t0);
        let prompt_cap = b.session.snapshot().map_err(|e| e.to_string())?;
        let mut printed = String::new();
        let mut g = generate(
            &mut b.session,
            &[],
            loaded.text.as_ref(),
            &eos,
            &sample,
            &mut |piece| {
                printed.push_str(piece);
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
            },
        )
        .map_err(|e| e.to_string())?;
        g.prefilled = ids.len() - reused;
        g.prefill_ms = prefill_ms;
        g.first_token_ms += prefill_ms;
        let _ = writeln!(out);
        messages.push(json!({"role": "assistant", "content": g.text}));
        b.messages = messages;
        b.turns.push(Turn {
            prompt: prompt_cap,
            before,
        });
        let n = g.ids.len();
        eprintln!(
            "[{} new prompt tokens ({reused} reused{}) in {:.1} ms · first token {:.1} ms · {n} tokens, {:.1} tokens/s · {}]",
            g.prefilled,
            restored.map_or(String::new(), |t| format!(
                ", turn capsule restored in {t:.2} ms"
            )),
            g.prefill_ms,
            g.first_token_ms,
            if g.decode_ms > 0.0 {
                n as f64 / (g.decode_ms / 1e3)
            } else {
                0.0
            },
            g.finish
        );
        Ok(())
    }

    fn command(
        &mut self,
        cmd: &str,
        arg: Option<&str>,
        out: &mut dyn Write,
    ) -> Result<bool, String> {
        let need = |what: &str| -> Result<String, String> {
            arg.map(str::to_string)
                .filter(|a| valid_name(a))
                .ok_or_else(|| format!("usage: /{what} NAME (letters, digits, `-`, `_`)"))
        };
        match cmd {
            "quit" | "exit" | "q" => return Ok(false),
            "help" | "h" | "?" => {
                let _ = writeln!(out, "{HELP}");
            }
            "save" => {
                let name = need("save")?;
                let t = Instant::now();
                let b = self.branch();
                let cap = b.session.snapshot().map_err(|e| e.to_string())?;
                b.session.synchronize().map_err(|e| e.to_string())?;
                let took = ms(t);
                let messages = b.messages.clone();
                let mut note = String::new();
                if let Some(dir) = &self.args.capsule_dir {
                    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                    let path = dir.join(format!("{name}.capsule"));
                    crate::runtime::capsule_file::write_capsule(&path, &cap)
                        .map_err(|e| e.to_string())?;
                    let conv = dir.join(format!("{name}.json"));
                    std::fs::write(&conv, Value::Array(messages.clone()).to_string())
                        .map_err(|e| format!("{}: {e}", conv.display()))?;
                    note = format!(", written to {}", path.display());
                }
                let _ = writeln!(
                    out,
                    "saved {name}: {} tokens, {} in {took:.2} ms{note}",
                    cap.pos(),
                    mib(cap.bytes())
                );
                self.saved.insert(
                    name,
                    Saved {
                        capsule: cap,
                        messages,
                    },
                );
            }
            "restore" => {
                let name = need("restore")?;
                let (cap, messages, from) = match self.saved.get(&name) {
                    Some(s) => (s.capsule.clone(), s.messages.clone(), "memory"),
                    None => {
                        let dir = self
                            .args
                            .capsule_dir
                            .as_ref()
                            .ok_or_else(|| format!("no capsule `{name}` (/list shows them)"))?;
                        let path = dir.join(format!("{name}.capsule"));
                        if !path.is_file() {
                            return Err(format!(
                                "no capsule `{name}` in memory or in {}",
                                dir.display()
                            ));
                        }
                        let cap = crate::runtime::capsule_file::read_capsule(&path, self.model())
                            .map_err(|e| e.to_string())?;
                        let conv = std::fs::read_to_string(dir.join(format!("{name}.json")))
                            .ok()
                            .and_then(|t| serde_json::from_str::<Vec<Value>>(&t).ok())
                            .unwrap_or_default();
                        (cap, conv, "file")
                    }
                };
                let t = Instant::now();
                let b = self.branch();
                b.session.restore(&cap).map_err(|e| e.to_string())?;
                b.session.synchronize().map_err(|e| e.to_string())?;
                let took = ms(t);
                b.messages = messages.clone();
                b.turns.clear();
                b.base = Some((cap.clone(), messages));
                let _ = writeln!(
                    out,
                    "restored {name} ({from}): {} tokens, {} in {took:.2} ms",
                    cap.pos(),
                    mib(cap.bytes())
                );
            }
            "fork" => {
                let name = need("fork")?;
                if self.branches.contains_key(&name) {
                    return Err(format!("branch `{name}` exists (/switch {name})"));
                }
                let t = Instant::now();
                let b = self.branch();
                let cap = b.session.snapshot().map_err(|e| e.to_string())?;
                let messages = b.messages.clone();
                let turns = b.turns.clone();
                let base = b.base.clone();
                let session = self.model().fork(&cap).map_err(|e| e.to_string())?;
                session.synchronize().map_err(|e| e.to_string())?;
                let took = ms(t);
                let from = std::mem::replace(&mut self.current, name.clone());
                self.branches.insert(
                    name.clone(),
                    Branch {
                        session,
                        messages,
                        turns,
                        base,
                    },
                );
                let _ = writeln!(
                    out,
                    "forked {name} from {from} at {} tokens in {took:.2} ms (/switch {from} goes back)",
                    cap.pos()
                );
            }
            "switch" => {
                let name = need("switch")?;
                if !self.branches.contains_key(&name) {
                    return Err(format!("no branch `{name}` (/list shows them)"));
                }
                self.current = name.clone();
                let pos = self.branch().session.pos();
                let _ = writeln!(out, "on branch {name} ({pos} tokens)");
            }
            "rollback" => {
                let n: usize = match arg {
                    None => 1,
                    Some(a) => a.parse().map_err(|_| "usage: /rollback [N]".to_string())?,
                };
                let b = self.branch();
                if n == 0 || n > b.turns.len() {
                    return Err(format!(
                        "there {} {} turn{} to roll back",
                        if b.turns.len() == 1 { "is" } else { "are" },
                        b.turns.len(),
                        if b.turns.len() == 1 { "" } else { "s" }
                    ));
                }
                let k = b.turns.len() - n;
                b.messages = b.turns[k].before.clone();
                b.turns.truncate(k);
                // The newest capsule still behind us: the last kept turn's prompt, else the
                // conversation's start.
                let t = Instant::now();
                let back = b
                    .turns
                    .last()
                    .map(|t| t.prompt.clone())
                    .or_else(|| b.base.as_ref().map(|(c, _)| c.clone()));
                let pos = match back {
                    Some(c) => {
                        b.session.restore(&c).map_err(|e| e.to_string())?;
                        c.pos()
                    }
                    None => {
                        b.session.reset().map_err(|e| e.to_string())?;
                        0
                    }
                };
                b.session.synchronize().map_err(|e| e.to_string())?;
                let _ = writeln!(
                    out,
                    "rolled back {n} turn{} to {pos} tokens in {:.2} ms",
                    if n == 1 { "" } else { "s" },
                    ms(t)
                );
            }
            "list" => {
                let _ = writeln!(out, "capsules:");
                if self.saved.is_empty() {
                    let _ = writeln!(out, "  (none: /save NAME)");
                }
                for (name, s) in &self.saved {
                    let _ = writeln!(
                        out,
                        "  {name:<16} {:>6} tokens  {:>11}  {} messages",
                        s.capsule.pos(),
                        mib(s.capsule.bytes()),
                        s.messages.len()
                    );
                }
                let _ = writeln!(out, "branches:");
                for (name, b) in &self.branches {
                    let _ = writeln!(
                        out,
                        "{} {name:<16} {:>6} tokens  {} turns",
                        if *name == self.current { "*" } else { " " },
                        b.session.pos(),
                        b.turns.len()
                    );
                }
            }
            "history" => {
                for m in &self.branch().messages {
                    let _ = writeln!(
                        out,
                        "{}: {}",
                        m["role"].as_str().unwrap_or("?"),
                        m["content"].as_str().unwrap_or("")
                    );
                }
            }
            "reset" => {
                let fresh = self.fresh_messages();
                let b = self.branch();
                b.session.reset().map_err(|e| e.to_string())?;
                b.messages = fresh;
                b.turns.clear();
                b.base = None;
                let _ = writeln!(out, "new conversation");
            }
            other => return Err(format!("unknown command /{other} (/help lists them)")),
        }
        Ok(true)
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

const HELP: &str = "\
commands:
  /save NAME       snapshot the conversation as capsule NAME
  /restore NAME    continue from capsule NAME
  /fork NAME       a new branch NAME from here (independent session); /switch back
  /switch NAME     continue on branch NAME
  /rollback [N]    undo the last N turns (default 1)
  /list            capsules and branches
  /history         the conversation so far
  /reset           a new conversation
  /quit            leave (also Ctrl-D)
anything else is a message to the model";

/// `flashrt chat MODEL`.
pub fn chat(a: &ChatArgs) -> Result<ExitCode, String> {
    let loaded = flashrt_serve::cli::open(&a.model)?;
    if loaded
        .text
        .as_ref()
        .and_then(|t| t.template.as_ref())
        .is_none()
    {
        return Err(
            "this model has no tokenizer.json with a chat template: `flashrt chat` needs both \
             (`flashrt run --raw` completes plain text)"
                .into(),
        );
    }
    let mut session = loaded.model.session().map_err(|e| e.to_string())?;
    session.set_sampler(a.sample.sampler(&loaded));
    let mut chat = Chat {
        loaded: &loaded,
        args: a,
        branches: BTreeMap::new(),
        current: "main".into(),
        saved: BTreeMap::new(),
    };
    let messages = chat.fresh_messages();
    chat.branches.insert(
        "main".into(),
        Branch {
            session,
            messages,
            turns: Vec::new(),
            base: None,
        },
    );
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let _ = writeln!(
        out,
        "flashrt chat — {} on {} (max {} tokens). /help for commands, /quit to leave.",
        loaded.model.name(),
        loaded.model.backend_name(),
        loaded.model.max_seq()
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock();
    loop {
        let _ = write!(out, "{}> ", chat.current);
        let _ = out.flush();
        let mut line = String::new();
        match lines.read_line(&mut line) {
            Ok(0) => {
                let _ = writeln!(out);
                break;
            }
            Ok(_) => {}
            Err(e) => return Err(format!("reading standard input: {e}")),
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim().is_empty() {
            continue;
        }
        let r = if let Some(c) = line.strip_prefix('/') {
            let mut parts = c.split_whitespace();
            let cmd = parts.next().unwrap_or("");
            match chat.command(cmd, parts.next(), &mut out) {
                Ok(true) => Ok(()),
                Ok(false) => break,
                Err(e) => Err(e),
            }
        } else {
            chat.turn(line, &mut out)
        };
        if let Err(e) = r {
            let _ = writeln!(out, "error: {e}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
