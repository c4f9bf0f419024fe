//! Tokenizing a conversation sent again with one more turn (what a chat or agent client does
//! every turn): the whole rendered text through the tokenizer, against
//! [`PrefixTokens`](flashrt_serve::text::PrefixTokens) reusing the previous turn's ids up to
//! the last added token the two share (`flashrt serve` and `flashrt chat` do this). A
//! ~75 KB conversation in the chat template's shape (`<|im_start|>role\n...<|im_end|>\n`) from
//! the repository's own text; on the test fixture's small vocabulary and, when
//! `scripts/qwen-tokenizer-reference.py` has written it to target/qwen-tokenizer, on the real
//! Qwen3.5/3.6 vocabulary (about 20k tokens).
//!
//! ```sh
//! cargo bench --bench tokenize
//! ```

use criterion::{Criterion, criterion_group, criterion_main};
use flashrt_serve::text::{PrefixTokens, Tokenizer};
use std::path::PathBuf;

fn conversation(turns_bytes: usize) -> (String, String) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let src = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let mut text = String::new();
    let mut turn = 0;
    while text.len() < turns_bytes {
        let at = (turn * 997) % (src.len() - 3000);
        let mut end = at + 3000;
        let mut start = at;
        while !src.is_char_boundary(start) {
            start += 1;
        }
        while !src.is_char_boundary(end) {
            end += 1;
        }
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        text.push_str(&format!(
            "<|im_start|>{role}\n{}<|im_end|>\n",
            &src[start..end]
        ));
        turn += 1;
    }
    let next = format!(
        "{text}<|im_start|>user\none more question about {}<|im_end|>\n<|im_start|>assistant\n",
        &src[..200]
    );
    (text, next)
}

fn bench_tokenize(c: &mut Criterion) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut tokenizers = vec![("fixture", root.join("tests/fixtures/text/tokenizer.json"))];
    let qwen = root.join("target/qwen-tokenizer/tokenizer.json");
    if qwen.is_file() {
        tokenizers.push(("qwen", qwen));
    } else {
        eprintln!(
            "no {} (scripts/qwen-tokenizer-reference.py): fixture vocabulary only",
            qwen.display()
        );
    }
    let (before, after) = conversation(75_000);
    for (name, path) in tokenizers {
        let tok = Tokenizer::load(&path).expect("tokenizer");
        let ids = tok.encode(&after).expect("encode");
        eprintln!("{name}: {} bytes, {} tokens", after.len(), ids.len());
        c.bench_function(&format!("tokenize/{name}/whole"), |b| {
            b.iter(|| tok.encode(&after).unwrap())
        });
        c.bench_function(
            &format!("tokenize/{name}/extending_the_previous_turn"),
            |b| {
                b.iter_batched(
                    || {
                        let cache = PrefixTokens::new(&tok);
                        cache.encode(&tok, "", &before).unwrap();
                        cache
                    },
                    |cache| {
                        let got = cache.encode(&tok, "", &after).unwrap();
                        assert_eq!(got.len(), ids.len());
                        got
                    },
                    criterion::BatchSize::LargeInput,
                )
            },
        );
    }
}

criterion_group!(benches, bench_tokenize);
criterion_main!(benches);
