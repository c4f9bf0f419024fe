//! The TOML model front-end on thousands of seeded random mutations of the repository's model
//! files (the stable-toolchain counterpart of the `toml_model` cargo-fuzz target): it returns
//! a model or diagnostics, and never panics.

use std::path::Path;

fn model_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for dir in [root.join("models"), root.join("fuzz")] {
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "toml")
                && p.file_name().is_some_and(|n| n != "Cargo.toml")
            {
                out.push((
                    p.display().to_string(),
                    std::fs::read_to_string(&p).unwrap(),
                ));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn every_model_file_parses() {
    let files = model_files();
    assert!(files.len() >= 2);
    for (path, text) in files {
        flashrt_compiler::model_from_toml(&text, &path).unwrap_or_else(|d| panic!("{path}: {d}"));
    }
}

struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Tokens that matter to TOML and to the model schema.
const PIECES: &[&str] = &[
    "=",
    "[",
    "]",
    "{",
    "}",
    ",",
    "\"",
    "'",
    "\n",
    "#",
    ".",
    "0",
    "-1",
    "1e400",
    "nan",
    "inf",
    "99999999999999999999",
    "true",
    "[model]",
    "[stack]",
    "[kinds.x]",
    "[mtp]",
    "repeat = 0",
    "vocab = 0",
    "max_seq = 1",
    "pattern = []",
    "kind = \"attention\"",
    "\u{feff}",
    "\\u0000",
    "\"\"\"",
    "prefill_buckets = [0]",
];

fn mutate(text: &str, r: &mut Mix) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    for _ in 0..1 + r.below(4) {
        if lines.is_empty() {
            lines.push(String::new());
        }
        let i = r.below(lines.len());
        match r.below(6) {
            0 => {
                lines.remove(i);
            }
            1 => {
                let l = lines[i].clone();
                lines.insert(r.below(lines.len() + 1), l);
            }
            2 => {
                let at = {
                    let l = &lines[i];
                    let mut k = r.below(l.len() + 1);
                    while !l.is_char_boundary(k) {
                        k -= 1;
                    }
                    k
                };
                let p = PIECES[r.below(PIECES.len())];
                lines[i].insert_str(at, p);
            }
            3 => {
                // Replace a number with another.
                let l = lines[i].clone();
                if let Some(pos) = l.find(|c: char| c.is_ascii_digit()) {
                    let end = l[pos..]
                        .find(|c: char| !c.is_ascii_digit())
                        .map_or(l.len(), |e| pos + e);
                    let n = ["0", "1", "3", "7", "65536", "18446744073709551615", "-5"][r.below(7)];
                    lines[i] = format!("{}{n}{}", &l[..pos], &l[end..]);
                }
            }
            4 => {
                let l = &lines[i];
                let mut k = r.below(l.len() + 1);
                while !l.is_char_boundary(k) {
                    k -= 1;
                }
                lines[i].truncate(k);
            }
            _ => {
                let j = r.below(lines.len());
                lines.swap(i, j);
            }
        }
    }
    lines.join("\n")
}

#[test]
fn thousands_of_mutated_model_files_never_panic() {
    let files = model_files();
    let mut r = Mix(0x70_4d1);
    let (mut ok, mut err) = (0, 0);
    for k in 0..3000 {
        let (path, text) = &files[k % files.len()];
        let m = mutate(text, &mut r);
        match std::panic::catch_unwind(|| flashrt_compiler::model_from_toml(&m, path)) {
            Ok(Ok(_)) => ok += 1,
            Ok(Err(d)) => {
                assert!(!d.to_string().is_empty());
                err += 1;
            }
            Err(_) => panic!("model_from_toml panicked on this input:\n{m}"),
        }
    }
    assert!(err > 1000, "{ok} parsed, {err} rejected");
}
