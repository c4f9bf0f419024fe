//! `flashrt run` and `flashrt chat` through a real terminal (a pseudo-terminal), on the CPU,
//! with a fixture checkpoint that carries a tokenizer and a chat template, as a person would
//! use them. The expected answers are computed in-process from the same checkpoint through
//! the library (template, tokenizer, greedy decoding).
#![cfg(unix)]

use flashrt::runtime::ir::hf::HfOptions;
use flashrt::runtime::{CpuBackend, Model};
use flashrt_serve::text::{RenderOptions, Text};
use serde_json::{Value, json};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A checkpoint folder: the Qwen3.5 fixture's weights and config plus the text fixture's
/// tokenizer and chat template.
fn checkpoint(tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("flashrt-term-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for (dir, f) in [
        ("qwen35-public", "config.json"),
        ("qwen35-public", "generation_config.json"),
        ("qwen35-public", "model.safetensors"),
        ("text", "tokenizer.json"),
        ("text", "tokenizer_config.json"),
        ("text", "chat_template.jinja"),
    ] {
        std::fs::copy(fixtures().join(dir).join(f), dst.join(f)).unwrap();
    }
    dst
}

/// Greedy answer of the library to `messages`, cut at the template's end of turn, as text.
fn expected_answer(dir: &Path, messages: &Value, max_tokens: usize) -> String {
    let text = Text::from_dir(dir).unwrap().unwrap();
    let model = Model::load_hf_dir(
        Arc::new(CpuBackend::with_threads(1)),
        dir,
        &HfOptions::default(),
    )
    .unwrap();
    let prompt = text
        .template
        .as_ref()
        .unwrap()
        .render(
            messages,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    let ids = text.tokenizer.encode(&prompt).unwrap();
    let mut s = model.session().unwrap();
    s.append(&ids).unwrap();
    let eos = text.eos_token_id().unwrap();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let t = flashrt::runtime::argmax(s.last_logits()).unwrap();
        if t == eos {
            break;
        }
        out.push(t);
        s.append(&[t]).unwrap();
    }
    text.tokenizer.decode(&out)
}

/// A child process whose standard streams are a pseudo-terminal, and everything it wrote.
struct Term {
    child: Child,
    master: File,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Term {
    fn spawn(args: &[&str]) -> Term {
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty writes two new file descriptors into the two out-parameters; the
        // name, termios and winsize pointers may be null.
        let r = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty failed");
        // SAFETY: both descriptors were just opened by openpty and are owned here only.
        let (master, slave) = unsafe { (File::from_raw_fd(master), File::from_raw_fd(slave)) };
        let child = Command::new(env!("CARGO_BIN_EXE_flashrt"))
            .args(args)
            .env("FLASHRT_BACKEND", "cpu")
            .env("FLASHRT_CPU_THREADS", "1")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave))
            .spawn()
            .expect("spawn flashrt");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().unwrap();
        let sink = seen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // EIO once the child has closed the terminal: the end.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Term {
            child,
            master,
            seen,
        }
    }

    /// Everything written so far, carriage returns removed.
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).replace('\r', "")
    }

    /// Wait until the output holds `needle` `count` times.
    fn wait_for(&self, needle: &str, count: usize) -> String {
        let t0 = Instant::now();
        loop {
            let t = self.text();
            if t.matches(needle).count() >= count {
                return t;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "timed out waiting for {needle:?} x{count}; output so far:\n{t}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn send(&mut self, line: &str) {
        self.master.write_all(line.as_bytes()).unwrap();
        self.master.write_all(b"\n").unwrap();
        self.master.flush().unwrap();
    }

    fn finish(mut self) -> String {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "exit {status}; output:\n{}", self.text());
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(120),
                "did not exit; output:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(100));
        self.text()
    }
}

#[test]
fn run_streams_the_answer_to_a_terminal() {
    let dir = checkpoint("run");
    let prompt = "What is the weather like in Paris?";
    let want = expected_answer(&dir, &json!([{"role": "user", "content": prompt}]), 12);
    assert!(!want.is_empty());
    let term = Term::spawn(&["run", dir.to_str().unwrap(), prompt, "--max-tokens", "12"]);
    let out = term.finish();
    assert!(out.contains(&want), "expected {want:?} in:\n{out}");
    assert!(out.contains("prompt tokens in"), "no timings in:\n{out}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn chat_keeps_one_session_and_saves_restores_forks_and_rolls_back() {
    let dir = checkpoint("chat");
    let caps = dir.join("capsules");
    let first = "Pick up the red block.";
    let second = "And the blue one?";
    let a1 = expected_answer(&dir, &json!([{"role": "user", "content": first}]), 8);
    let a2 = expected_answer(
        &dir,
        &json!([
            {"role": "user", "content": first},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": second}
        ]),
        8,
    );
    let mut t = Term::spawn(&[
        "chat",
        dir.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--capsule-dir",
        caps.to_str().unwrap(),
    ]);
    t.wait_for("main> ", 1);
    t.send(first);
    let out = t.wait_for("main> ", 2);
    assert!(out.contains(&a1), "first answer {a1:?} missing:\n{out}");
    t.send("/save first");
    let out = t.wait_for("main> ", 3);
    assert!(out.contains("saved first:"), "{out}");
    assert!(caps.join("first.capsule").is_file());
    t.send(second);
    let out = t.wait_for("main> ", 4);
    // The second turn was appended to the first: only the new prompt tokens were prefilled.
    assert!(
        out.matches(&a2).count() >= 1,
        "second answer {a2:?} missing:\n{out}"
    );
    let stats = out
        .lines()
        .filter(|l| l.contains("new prompt tokens"))
        .nth(1)
        .unwrap_or_else(|| panic!("no stats for the second turn:\n{out}"))
        .to_string();
    assert!(
        !stats.contains("(0 reused"),
        "the second turn re-prefilled: {stats}"
    );
    t.send("/rollback");
    let out = t.wait_for("main> ", 5);
    assert!(out.contains("rolled back 1 turn"), "{out}");
    // The same message after the rollback gets the same answer.
    t.send(second);
    let out = t.wait_for("main> ", 6);
    assert!(
        out.matches(&a2).count() >= 2,
        "answer after rollback differs:\n{out}"
    );
    t.send("/fork side");
    let out = t.wait_for("side> ", 1);
    assert!(out.contains("forked side from main"), "{out}");
    t.send("/restore first");
    let out = t.wait_for("side> ", 2);
    assert!(out.contains("restored first"), "{out}");
    t.send(second);
    let out = t.wait_for("side> ", 3);
    assert!(
        out.matches(&a2).count() >= 3,
        "answer after restore differs:\n{out}"
    );
    t.send("/list");
    let out = t.wait_for("side> ", 4);
    assert!(
        out.contains("capsules:") && out.contains("first") && out.contains("* side"),
        "{out}"
    );
    t.send("/switch main");
    t.wait_for("main> ", 7);
    t.send("/bogus");
    let out = t.wait_for("main> ", 8);
    assert!(out.contains("unknown command /bogus"), "{out}");
    t.send("/quit");
    t.finish();
    let _ = std::fs::remove_dir_all(dir);
}
