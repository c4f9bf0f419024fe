//! The `flashrt` binary, end to end: exit codes and output of every command.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn flashrt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_flashrt"))
        .args(args)
        .env("FLASHRT_BACKEND", "cpu")
        .output()
        .expect("run flashrt")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    assert!(
        p.is_dir(),
        "the reference fixtures are expected at {} (tests/fixtures of the repository)",
        p.display()
    );
    p
}

#[test]
fn check_reference_passes_on_every_fixture() {
    for name in ["qwen35-public", "lfm2-public", "nemotronh-public"] {
        let dir = fixtures().join(name);
        let out = flashrt(&["check-reference", dir.to_str().unwrap()]);
        let t = text(&out);
        assert!(out.status.success(), "{name}:\n{t}");
        assert!(
            t.contains("all") && t.contains("checks passed"),
            "{name}:\n{t}"
        );
        // One line per check with its measured error.
        for check in [
            "prompt_logits",
            "greedy_ids",
            "greedy_logits",
            "fork_s1_logits",
            "fork_s1_greedy_ids",
            "fork_s2_logits",
            "fork_s2_greedy_ids",
            "state layers.0",
        ] {
            let line = t
                .lines()
                .find(|l| l.trim_start().starts_with(check))
                .unwrap_or_else(|| panic!("{name}: no `{check}` line:\n{t}"));
            assert!(line.split_whitespace().any(|w| w == "ok"), "{name}: {line}");
        }
    }
}

/// Copy a fixture folder, then flip one value of `prompt_logits` in reference.safetensors.
fn perturbed_copy(name: &str) -> PathBuf {
    let src = fixtures().join(name);
    let dst = std::env::temp_dir().join(format!(
        "flashrt-cli-perturbed-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors", "reference.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let path = dst.join("reference.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header["prompt_logits"]["data_offsets"][0].as_u64().unwrap() as usize;
    // Logit row 5, column 7 of [37, vocab] f32: add 1.0 (about 8% of the largest logit).
    let vocab = header["prompt_logits"]["shape"][1].as_u64().unwrap() as usize;
    let at = 8 + header_len + start + (5 * vocab + 7) * 4;
    let v = f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) + 1.0;
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    std::fs::write(&path, bytes).unwrap();
    dst
}

#[test]
fn check_reference_fails_on_a_perturbed_reference() {
    let dir = perturbed_copy("lfm2-public");
    let out = flashrt(&["check-reference", dir.to_str().unwrap()]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("FAIL"), "{t}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn check_reference_on_a_missing_folder_is_a_clear_error() {
    let out = flashrt(&["check-reference", "/nonexistent/flashrt-fixture"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("/nonexistent/flashrt-fixture"),
        "{}",
        text(&out)
    );
}

#[test]
fn demo_passes_every_check() {
    let out = flashrt(&["demo", "--prompt", "48"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("all checks passed"), "{t}");
    for row in [
        "snapshot A",
        "restore A",
        "fork branch 1",
        "fork branch 2",
        "rollback",
        "KV-only",
    ] {
        assert!(t.contains(row), "missing `{row}` row:\n{t}");
    }
    assert!(!t.contains("FAIL"), "{t}");
}

#[test]
fn import_hf_prints_toml_that_compiles_to_the_same_ir() {
    for name in ["qwen35-public", "lfm2-public", "nemotronh-public"] {
        let config = fixtures().join(name).join("config.json");
        let out = flashrt(&["import-hf", config.to_str().unwrap()]);
        assert!(out.status.success(), "{}", text(&out));
        let toml = String::from_utf8(out.stdout).unwrap();
        let from_toml = flashrt::compiler::model_from_toml(&toml, "imported.toml")
            .unwrap_or_else(|d| panic!("{d}\n{toml}"));
        let json = std::fs::read_to_string(&config).unwrap();
        let opts = flashrt::ir::hf::HfOptions {
            name: Some(from_toml.name.clone()),
            ..Default::default()
        };
        let direct = flashrt::ir::hf::ir_from_hf_config(&json, &opts).unwrap();
        assert_eq!(from_toml, direct, "{name}");
    }
}

#[test]
fn compile_emits_rust_that_parses() {
    let out_file = std::env::temp_dir().join(format!("flashrt-emit-{}.rs", std::process::id()));
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/nemotronh-tiny.toml");
    let out = flashrt(&[
        "compile",
        model.to_str().unwrap(),
        "--emit-rust",
        out_file.to_str().unwrap(),
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for part in [
        "layout",
        "plans",
        "prefill[16]",
        "decode",
        "capsule",
        "bytes per token",
    ] {
        assert!(t.contains(part), "no `{part}` in:\n{t}");
    }
    let code = std::fs::read_to_string(&out_file).unwrap();
    syn::parse_file(&code).expect("emitted Rust parses");
    assert!(code.contains("pub struct NemotronhTinyCapsule"));
    let _ = std::fs::remove_file(out_file);
}

#[test]
fn compile_reports_errors_with_file_line_col_and_exit_code_2() {
    let path = std::env::temp_dir().join(format!("flashrt-bad-{}.toml", std::process::id()));
    std::fs::write(&path, "[model]\nname = \"x\"\nvocab = -3\n").unwrap();
    let out = flashrt(&["compile", path.to_str().unwrap()]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(t.contains(&format!("{}:3:9", path.display())), "{t}");
    let _ = std::fs::remove_file(path);
}

#[test]
fn unknown_commands_and_options_are_usage_errors() {
    assert_eq!(flashrt(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(
        flashrt(&["compile", "x.toml", "--bogus"]).status.code(),
        Some(2)
    );
    assert!(flashrt(&["help"]).status.success());
}

#[test]
fn every_command_has_help_and_the_binary_a_version() {
    for cmd in [
        "demo",
        "run",
        "chat",
        "serve",
        "bench",
        "compile",
        "import-hf",
        "check-reference",
    ] {
        let out = flashrt(&[cmd, "--help"]);
        let t = text(&out);
        assert!(out.status.success(), "{cmd} --help: {t}");
        assert!(t.contains(&format!("Usage: flashrt {cmd}")), "{cmd}: {t}");
    }
    let out = flashrt(&["--version"]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("flashrt {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn a_broken_tokenizer_fails_before_the_weights_load() {
    let dir = std::env::temp_dir().join(format!("flashrt-badtok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A config but no weights at all: a load would fail on the weights; the tokenizer is read
    // (and refused) first.
    std::fs::copy(
        fixtures().join("qwen35-public/config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{ not a tokenizer").unwrap();
    let out = flashrt(&["run", dir.to_str().unwrap(), "hello"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(2), "{t}");
    assert!(
        t.contains("tokenizer.json") && !t.contains("safetensors"),
        "{t}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bench_takes_a_checkpoint_like_a_toml() {
    let dir = fixtures().join("lfm2-public");
    let out = flashrt(&[
        "bench",
        dir.to_str().unwrap(),
        "--lengths",
        "40",
        "--iters",
        "2",
        "--decode-steps",
        "2",
    ]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("flashrt bench") && t.contains("40"), "{t}");
}

#[test]
fn bench_refuses_profiling_off_cuda_before_measuring() {
    let dir = fixtures().join("lfm2-public");
    let dir = dir.to_str().unwrap();
    for flag in [&["--profile"][..], &["--profile-rows", "8"][..]] {
        let mut args = vec!["bench", dir, "--backend", "cpu", "--lengths", "40"];
        args.extend_from_slice(flag);
        let out = flashrt(&args);
        let t = text(&out);
        assert!(!out.status.success(), "{flag:?}: {t}");
        assert!(t.contains("need the CUDA backend"), "{flag:?}: {t}");
        assert!(
            !t.contains("copy bandwidth"),
            "{flag:?}: measured before refusing: {t}"
        );
    }
}

#[test]
fn decode_matmuls_is_a_choice_the_cpu_ignores() {
    let dir = fixtures().join("lfm2-public");
    let dir = dir.to_str().unwrap();
    let args = [
        "bench",
        dir,
        "--backend",
        "cpu",
        "--lengths",
        "40",
        "--iters",
        "1",
    ];
    let mut ok = args.to_vec();
    ok.extend(["--decode-steps", "1", "--decode-matmuls", "tensor-cores"]);
    let out = flashrt(&ok);
    assert!(out.status.success(), "{}", text(&out));
    let mut bad = args.to_vec();
    bad.extend(["--decode-matmuls", "gpus"]);
    let out = flashrt(&bad);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("cuda-cores"), "{}", text(&out));
}
