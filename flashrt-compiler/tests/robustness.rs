//! Fuzz-style robustness: truncated, mutated and random inputs to both front-ends return
//! `Ok` or `Err`, never panic; and whatever they accept, the lowering accepts too.

mod common;

use common::*;
use flashrt_compiler::ir::{Target, compile};
use flashrt_compiler::{ir_to_toml, model_from_tokens, model_from_toml};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs the TOML front-end on `src`; `Err(src)` if it panicked. Accepted models are lowered
/// (checked IR must satisfy everything the lowering assumes) and printed back.
fn toml_survives(src: &str) -> Result<bool, String> {
    catch_unwind(|| match model_from_toml(src, "fuzz.toml") {
        Ok(ir) => {
            if ir.hidden * ir.vocab < 1 << 24 && ir.max_seq < 1 << 16 {
                compile(&ir, Target { dtype: ir.dtype });
            }
            assert_eq!(
                model_from_toml(&ir_to_toml(&ir), "again.toml").as_ref(),
                Ok(&ir)
            );
            true
        }
        Err(d) => {
            assert!(!d.is_empty());
            let _ = d.to_string();
            false
        }
    })
    .map_err(|_| src.to_string())
}

/// Lexes `src` as Rust tokens (skipping what does not lex) and runs the attribute front-end.
fn tokens_survive(src: &str, default_name: Option<&str>) -> Result<bool, String> {
    let Ok(ts) = syn::parse_str::<proc_macro2::TokenStream>(src) else {
        return Ok(false);
    };
    catch_unwind(AssertUnwindSafe(|| {
        match model_from_tokens(ts, default_name) {
            Ok(ir) => {
                assert_eq!(
                    model_from_toml(&ir_to_toml(&ir), "again.toml").as_ref(),
                    Ok(&ir)
                );
                true
            }
            Err(e) => {
                let _ = e.into_compile_error();
                false
            }
        }
    }))
    .map_err(|_| src.to_string())
}

fn prefixes(src: &str) -> impl Iterator<Item = &str> {
    (0..=src.len())
        .filter(|&i| src.is_char_boundary(i))
        .map(move |i| &src[..i])
}

#[test]
fn truncated_model_files_never_panic() {
    for (stem, src) in model_files() {
        let mut accepted = 0;
        for prefix in prefixes(&src) {
            accepted +=
                toml_survives(prefix).unwrap_or_else(|s| panic!("{stem}: panic on\n{s}")) as usize;
        }
        // Only cuts inside the trailing comments/blank lines (or after the last digit) pass.
        assert!(accepted >= 1, "{stem}: the whole file must be accepted");
    }
}

#[test]
fn truncated_attribute_forms_never_panic() {
    for (stem, text, default_name) in MACRO_MODELS {
        let mut accepted = 0;
        for prefix in prefixes(text) {
            accepted += tokens_survive(prefix, *default_name)
                .unwrap_or_else(|s| panic!("{stem}: panic on\n{s}"))
                as usize;
        }
        assert!(accepted >= 1, "{stem}");
    }
}

/// Snippets that mutations splice in: structure, types, edge values.
const SNIPPETS: &[&str] = &[
    "=",
    "{",
    "}",
    "[",
    "]",
    ",",
    "\"",
    "'",
    "#",
    "\n",
    ".",
    "-",
    " ",
    "0",
    "1",
    "2",
    "3",
    "-1",
    "7",
    "64",
    "1e999",
    "-0.0",
    "nan",
    "inf",
    "0.3",
    "1.5",
    "99999999999999999999999999",
    "2147483647",
    "2147483648",
    "true",
    "false",
    "none",
    "\"none\"",
    "kind",
    "mixer",
    "mlp",
    "attention",
    "mamba2",
    "short_conv",
    "gated_deltanet",
    "swiglu",
    "relu2",
    "[kinds.x]",
    "[stack]",
    "[mtp]",
    "[[a]]",
    "repeat = 4096",
    "repeat = 5000",
    "layers = 0",
    "pattern = []",
    "r#type",
    "1979-05-27",
    "0x10",
    "1_0",
    "\\u0000",
    "é",
    "{ a = { b = { c = [[[1]]] } } }",
];

fn mutate(rng: &mut Rng, src: &str) -> String {
    let mut s: Vec<char> = src.chars().collect();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(s.len() + 1);
        let len = rng.below(8).min(s.len() - at.min(s.len()));
        match rng.below(5) {
            0 => {
                s.drain(at..at + len);
            }
            1 | 2 => {
                let snip: Vec<char> = SNIPPETS[rng.below(SNIPPETS.len())].chars().collect();
                s.splice(at..at + len, snip);
            }
            3 => {
                let copy: Vec<char> = s[at..at + len].to_vec();
                let to = rng.below(s.len() + 1);
                s.splice(to..to, copy);
            }
            _ => {
                let c = char::from_u32(rng.below(0x80) as u32).unwrap_or('?');
                s.insert(at, c);
            }
        }
    }
    s.into_iter().collect()
}

/// Replaces every integer in `src` with a small random one (0..=300), to drive the
/// semantic checks and the lowering through many shapes.
fn reshape(rng: &mut Rng, src: &str) -> String {
    let mut out = String::new();
    let mut chars = src.chars().peekable();
    let mut prev = ' ';
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() && !(prev.is_ascii_alphanumeric() || prev == '_' || prev == '.') {
            let mut lit = String::from(c);
            while let Some(&d) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' || d == '.' {
                    lit.push(d);
                    chars.next();
                } else {
                    break;
                }
            }
            let is_int = lit.chars().all(|d| d.is_ascii_digit() || d == '_');
            if is_int && rng.below(3) != 0 {
                out.push_str(
                    &[0, 1, 2, 3, 4, 6, 8, 16, 17, 64, 128, 300][rng.below(12)].to_string(),
                );
            } else {
                out.push_str(&lit);
            }
            prev = '0';
            continue;
        }
        out.push(c);
        prev = c;
    }
    out
}

#[test]
fn mutated_model_files_never_panic() {
    let mut rng = Rng::new(0x5eed_f1a5);
    let mut accepted = 0;
    for (stem, src) in model_files() {
        for _ in 0..400 {
            let m = mutate(&mut rng, &src);
            accepted +=
                toml_survives(&m).unwrap_or_else(|s| panic!("{stem}: panic on\n{s}")) as usize;
        }
        for _ in 0..300 {
            let m = reshape(&mut rng, &src);
            accepted +=
                toml_survives(&m).unwrap_or_else(|s| panic!("{stem}: panic on\n{s}")) as usize;
        }
    }
    assert!(
        accepted > 50,
        "the mutations should leave some models valid ({accepted})"
    );
}

#[test]
fn mutated_attribute_forms_never_panic() {
    let mut rng = Rng::new(0xc0ff_ee00_1234);
    let mut accepted = 0;
    for (stem, text, default_name) in MACRO_MODELS {
        for _ in 0..400 {
            let m = mutate(&mut rng, text);
            accepted += tokens_survive(&m, *default_name)
                .unwrap_or_else(|s| panic!("{stem}: panic on\n{s}"))
                as usize;
        }
        for _ in 0..300 {
            let m = reshape(&mut rng, text);
            accepted += tokens_survive(&m, *default_name)
                .unwrap_or_else(|s| panic!("{stem}: panic on\n{s}"))
                as usize;
        }
    }
    assert!(
        accepted > 50,
        "the mutations should leave some models valid ({accepted})"
    );
}

#[test]
fn garbage_never_panics() {
    let mut rng = Rng::new(42);
    let alphabet: Vec<char> = "abcdefgz_019 =,{}[]\"'#\n.-+eE\\\t()!:;é".chars().collect();
    for _ in 0..2000 {
        let len = rng.below(120);
        let s: String = (0..len)
            .map(|_| alphabet[rng.below(alphabet.len())])
            .collect();
        toml_survives(&s).unwrap_or_else(|s| panic!("panic on {s:?}"));
        tokens_survive(&s, None).unwrap_or_else(|s| panic!("panic on {s:?}"));
    }
    // Arbitrary bytes, made UTF-8 the lossy way.
    for _ in 0..500 {
        let bytes: Vec<u8> = (0..rng.below(200)).map(|_| rng.next() as u8).collect();
        let s = String::from_utf8_lossy(&bytes);
        toml_survives(&s).unwrap_or_else(|s| panic!("panic on {s:?}"));
        tokens_survive(&s, Some("x")).unwrap_or_else(|s| panic!("panic on {s:?}"));
    }
    // Deep nesting.
    for depth in [10, 100, 1000] {
        let toml = format!(
            "[model]\nname = {}1{}\n",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        toml_survives(&toml).unwrap_or_else(|_| panic!("panic at depth {depth}"));
        let rust = format!("model = {}1{}", "[".repeat(depth), "]".repeat(depth));
        tokens_survive(&rust, None).unwrap_or_else(|_| panic!("panic at depth {depth}"));
        let rust = format!("model = {}{}", "{ a = ".repeat(depth), "}".repeat(depth));
        tokens_survive(&rust, None).unwrap_or_else(|_| panic!("panic at depth {depth}"));
    }
}
