//! Tokenizing a prompt that extends one seen before: the ids of the shared beginning reused,
//! only the rest encoded.
//!
//! An agent or chat client sends its whole conversation every turn; rendered by the chat
//! template, a 16k-token history is ~60 KB of text whose encoding alone takes ~30 ms on a
//! build machine's core — twice a decode step of the 27B model, on every turn, for ids the
//! server already computed the turn before. [`PrefixTokens`] keeps the last prompts' ids per
//! owner (a tenant: no tenant learns anything about another's prompts, not even through
//! timing) and encodes a new prompt as the ids of a remembered one up to a *split point*, plus
//! the encoding of the text from there.
//!
//! The result equals encoding the whole text, because a split point is the start `s` of an
//! added token (`<|im_start|>`, ...) that is matched on the raw text (not `normalized`),
//! strips no whitespace (`lstrip` / `rstrip`), may sit inside a word (not `single_word`), lies
//! inside the prefix both texts share (up to `common`), and where no added token could match
//! differently in the two texts: none starting at a position `p <= s` has the shared bytes
//! `[p, common)` as a proper prefix (it could run past the shared bytes in one text and not in
//! the other). The tokenizer splits the raw text at added tokens first, leftmost-longest; every
//! match starting before `s` and the one at `s` are then the same in both texts, so both split
//! identically up to `s`, and the pieces between added tokens are normalised, pre-tokenized and
//! BPE-merged independently of one another. So
//! ids(text) = ids(text[..s]) ++ ids(text[s..]), and ids(text[..s]) is the remembered
//! encoding's prefix up to the token at `s`. Tokenizers for which that does not hold (a
//! truncation or padding setting, a pre-tokenizer that treats the input's first piece
//! differently) are found at load by encoding a probe both ways, and never use the cache.

use super::Tokenizer;
use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Prompts remembered (each with its ids), all owners together.
const ENTRIES: usize = 32;

/// Texts longer than this are encoded whole and not remembered: the cache holds at most
/// `ENTRIES` of them (with their ids, about 3x the text), so clients cannot make it large.
const MAX_BYTES: usize = 2 << 20;

/// Texts shorter than this are encoded whole (it costs well under a millisecond); from a
/// quarter of it on they are remembered, as the start of a conversation that grows.
const MIN_BYTES: usize = 2048;

/// A split point: (start byte, end byte, index in the ids) of a splittable added token.
type Mark = (usize, usize, usize);

struct Entry {
    owner: String,
    text: String,
    ids: Vec<u32>,
    /// Split points, in order.
    marks: Vec<Mark>,
}

/// The last prompts' ids per owner, to encode a prompt that extends one of them from the last
/// split point they share (see the module docs).
pub struct PrefixTokens {
    /// Added tokens a split may come before; empty: the cache is off.
    splittable: HashSet<u32>,
    /// Every added token's content.
    contents: Vec<String>,
    /// The post-processor adds no tokens (Qwen's adds none): a prompt encoded with what it
    /// adds is encoded as without, and may reuse a remembered one too.
    adds_nothing: bool,
    entries: Mutex<VecDeque<Entry>>,
    /// Prompts encoded from a remembered one, and the bytes whose encoding that saved.
    reused: AtomicU64,
    reused_bytes: AtomicU64,
}

impl std::fmt::Debug for PrefixTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixTokens")
            .field("splittable", &self.splittable.len())
            .finish()
    }
}

impl PrefixTokens {
    /// The cache for `tok`, off when its encodings do not split at added tokens (or with
    /// `FLASHRT_PROMPT_REUSE=0`, to measure without it).
    pub fn new(tok: &Tokenizer) -> PrefixTokens {
        let inner = tok.inner();
        let added = inner.get_added_tokens_decoder();
        let mut splittable: HashSet<u32> = added
            .iter()
            .filter(|(_, t)| {
                !t.normalized && !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty()
            })
            .map(|(id, _)| *id)
            .collect();
        let mut cache = PrefixTokens {
            splittable: HashSet::new(),
            contents: added.values().map(|t| t.content.clone()).collect(),
            adds_nothing: tok.encode_with("a", true).ok() == tok.encode("a").ok(),
            entries: Mutex::new(VecDeque::new()),
            reused: AtomicU64::new(0),
            reused_bytes: AtomicU64::new(0),
        };
        if inner.get_truncation().is_some()
            || inner.get_padding().is_some()
            || std::env::var("FLASHRT_PROMPT_REUSE").is_ok_and(|v| v == "0")
        {
            return cache;
        }
        // A probe: text around every splittable token, encoded whole and split before it.
        let mut ids: Vec<u32> = splittable.iter().copied().collect();
        ids.sort_unstable();
        let pieces = [" Hello", "world\n", "\n\n  x", " 12", "é ", "\t", "a"];
        let mut probe = String::new();
        for (i, id) in ids.iter().enumerate() {
            let content = &added[id].content;
            probe.push_str(pieces[i % pieces.len()]);
            probe.push_str(content);
            probe.push_str(pieces[(i + 3) % pieces.len()]);
        }
        cache.splittable = std::mem::take(&mut splittable);
        let Ok((whole, marks)) = cache.encode_marked(tok, &probe) else {
            cache.splittable.clear();
            return cache;
        };
        for &(s, _, k) in &marks {
            let split = tok.encode(&probe[s..]);
            if split.as_deref().ok() != Some(&whole[k..]) {
                cache.splittable.clear();
                return cache;
            }
        }
        cache
    }

    /// Whether prompts are ever reused.
    pub fn enabled(&self) -> bool {
        !self.splittable.is_empty()
    }

    /// Prompts encoded from a remembered one so far, and the bytes not encoded again.
    pub fn reused(&self) -> (u64, u64) {
        (
            self.reused.load(Ordering::Relaxed),
            self.reused_bytes.load(Ordering::Relaxed),
        )
    }

    /// `text`'s ids and its split points.
    fn encode_marked(&self, tok: &Tokenizer, text: &str) -> Result<(Vec<u32>, Vec<Mark>), String> {
        let enc = tok.inner().encode(text, false).map_err(|e| e.to_string())?;
        let ids = enc.get_ids().to_vec();
        let marks = ids
            .iter()
            .zip(enc.get_offsets())
            .enumerate()
            .filter(|&(_, (&id, &(s, e)))| {
                self.splittable.contains(&id)
                    && text
                        .get(s..e)
                        .is_some_and(|t| tok.token(id).as_deref() == Some(t))
            })
            .map(|(k, (_, &(s, e)))| (s, e, k))
            .collect();
        Ok((ids, marks))
    }

    /// Whether the mark at `s` (ending at `e`) splits `text` as it splits any text sharing its
    /// first `common` bytes: the mark is shared whole, and no added token starting at or
    /// before `s` could match past the shared bytes (see the module docs).
    fn splits_alike(&self, text: &[u8], common: usize, s: usize, e: usize) -> bool {
        if e > common {
            return false;
        }
        // (A token starting at `s` itself matches alike: the encoding from `s` sees it too; one
        // starting further back than the longest token's length cannot reach past `common`.)
        let longest = self.contents.iter().map(String::len).max().unwrap_or(0);
        (s.saturating_sub(longest)..s).all(|p| {
            let shared = &text[p..common];
            !self
                .contents
                .iter()
                .any(|c| c.len() > shared.len() && c.as_bytes().starts_with(shared))
        })
    }

    /// The ids of `text` (what [`Tokenizer::encode`] gives), reusing `owner`'s remembered
    /// prompt that shares the longest beginning with it; `text` is remembered in turn.
    pub fn encode(&self, tok: &Tokenizer, owner: &str, text: &str) -> Result<Vec<u32>, String> {
        if !self.enabled() || text.len() < MIN_BYTES / 4 || text.len() > MAX_BYTES {
            return tok.encode(text);
        }
        // The remembered prompt of this owner with the latest split point valid for `text`.
        let reuse = if text.len() < MIN_BYTES {
            None
        } else {
            let entries = self.entries.lock().map_err(|_| "prefix cache poisoned")?;
            let best = entries
                .iter()
                .filter(|e| e.owner == owner)
                .filter_map(|e| {
                    let common = common_len(&e.text, text);
                    let below = e.marks.partition_point(|&(s, _, _)| s < common);
                    let j = (0..below).rev().find(|&j| {
                        let (s, end, _) = e.marks[j];
                        self.splits_alike(e.text.as_bytes(), common, s, end)
                    })?;
                    Some((e, j))
                })
                .max_by_key(|(e, j)| e.marks[*j].0);
            best.map(|(e, j)| {
                let (s, _, k) = e.marks[j];
                (s, e.ids[..k].to_vec(), e.marks[..j].to_vec())
            })
        };
        let (ids, marks) = match reuse {
            Some((s, mut ids, mut marks)) => {
                self.reused.fetch_add(1, Ordering::Relaxed);
                self.reused_bytes.fetch_add(s as u64, Ordering::Relaxed);
                let (tail, tail_marks) = self.encode_marked(tok, &text[s..])?;
                let k = ids.len();
                marks.extend(tail_marks.iter().map(|&(a, b, i)| (a + s, b + s, i + k)));
                ids.extend(tail);
                (ids, marks)
            }
            None => self.encode_marked(tok, text)?,
        };
        let mut entries = self.entries.lock().map_err(|_| "prefix cache poisoned")?;
        // One entry per owner and text: a repeat moves to the front.
        entries.retain(|e| !(e.owner == owner && e.text == text));
        entries.push_front(Entry {
            owner: owner.to_string(),
            text: text.to_string(),
            ids: ids.clone(),
            marks,
        });
        entries.truncate(ENTRIES);
        Ok(ids)
    }

    /// The ids of `text` with what the tokenizer's post-processor adds ([`Tokenizer::
    /// encode_with`]`(text, true)`, as transformers' `tokenizer(text)`), reusing a remembered
    /// prompt of `owner`'s when the post-processor adds nothing.
    pub fn encode_with_special(
        &self,
        tok: &Tokenizer,
        owner: &str,
        text: &str,
    ) -> Result<Vec<u32>, String> {
        if self.adds_nothing {
            self.encode(tok, owner, text)
        } else {
            tok.encode_with(text, true)
        }
    }
}

/// Bytes two strings share at their start.
fn common_len(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let n = a.len().min(b.len());
    // 64 bytes at a time, then byte by byte.
    let mut i = 0;
    while i + 64 <= n && a[i..i + 64] == b[i..i + 64] {
        i += 64;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture_tokenizer() -> Tokenizer {
        Tokenizer::load(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/fixtures/text/tokenizer.json"),
        )
        .unwrap()
    }

    /// A deterministic stream of conversation pieces: words, unicode, digits, whitespace
    /// runs and newlines, and the tokenizer's added tokens between them.
    fn piece(seed: &mut u64, specials: &[String]) -> String {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = (*seed >> 33) as usize;
        let words = [
            "hello",
            " world",
            "\n",
            "\n\n",
            "  ",
            " é",
            "日本語",
            " 123",
            "4",
            ".",
            ",\n",
            "\t",
            " don't",
            "user\n",
            "assistant\n",
            " <not special>",
            "😀",
            "  \n ",
        ];
        match r % 10 {
            0 | 1 => specials[r / 10 % specials.len()].clone(),
            _ => words[r / 10 % words.len()].to_string(),
        }
    }

    /// Conversations that grow, fork at every kind of position (inside a word, right after an
    /// added token, in a whitespace run) and repeat: the cached encoding always equals the
    /// whole text's.
    fn grows_and_forks(tok: &Tokenizer) {
        let cache = PrefixTokens::new(tok);
        assert!(cache.enabled(), "the probe refused this tokenizer");
        let specials: Vec<String> = cache
            .splittable
            .iter()
            .filter_map(|id| tok.token(*id))
            .collect();
        let mut seed = 7u64;
        let mut text = String::new();
        for turn in 0..60 {
            // Grow by a turn, or (every 5th turn) go back to a random earlier point.
            if turn % 5 == 4 {
                let mut cut = (seed as usize >> 7) % text.len().max(1);
                while !text.is_char_boundary(cut) {
                    cut -= 1;
                }
                text.truncate(cut);
            }
            while text.len() < MIN_BYTES + turn * 97 {
                text.push_str(&piece(&mut seed, &specials));
            }
            let owner = if turn % 7 == 6 { "other" } else { "me" };
            let got = cache.encode(tok, owner, &text).unwrap();
            assert_eq!(got, tok.encode(&text).unwrap(), "turn {turn}");
        }
        // Most turns extend a remembered prompt (the others start an owner's first one).
        let (n, bytes) = cache.reused();
        assert!(
            n >= 40 && bytes > 40 * MIN_BYTES as u64,
            "reused {n} prompts, {bytes} bytes"
        );
    }

    #[test]
    fn prompts_extending_remembered_ones_encode_as_whole() {
        grows_and_forks(&fixture_tokenizer());
    }

    /// The same on the real Qwen3.5/3.6 vocabulary (`scripts/qwen-tokenizer-reference.py`
    /// writes it to target/qwen-tokenizer; skipped, and said, without it).
    #[test]
    fn qwen_prompts_extending_remembered_ones_encode_as_whole() {
        let dir = match std::env::var_os("FLASHRT_QWEN_TOKENIZER") {
            Some(d) => PathBuf::from(d),
            None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/qwen-tokenizer"),
        };
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            eprintln!(
                "SKIP qwen_prompts_extending_remembered_ones_encode_as_whole: no {} (run scripts/qwen-tokenizer-reference.py)",
                path.display()
            );
            return;
        }
        grows_and_forks(&Tokenizer::load(&path).unwrap());
    }

    /// An added token that starts before a split point and runs past the shared bytes
    /// (`ab<|im_start|>user` over a remembered `...ab<|im_start|>us...`) matches in the new
    /// text and not in the remembered one: the split point before it is refused, and the
    /// encoding still equals the whole text's.
    #[test]
    fn a_longer_added_token_over_the_split_point_is_respected() {
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/text/tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        json["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
                "id": 512, "content": "ab<|im_start|>user", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
        let tok = Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
        let cache = PrefixTokens::new(&tok);
        assert!(cache.enabled());
        let body = "hello world, ".repeat(400);
        let before = format!("<|im_start|>user\n{body}<|im_end|>\nab<|im_start|>usX tail");
        let after = format!("<|im_start|>user\n{body}<|im_end|>\nab<|im_start|>user\nmore");
        let whole = tok.encode(&after).unwrap();
        assert!(
            whole.contains(&512),
            "the long token matches in the new text"
        );
        cache.encode(&tok, "", &before).unwrap();
        assert_eq!(cache.encode(&tok, "", &after).unwrap(), whole);
        // It still reused the ids before the earlier split point (the first `<|im_end|>`).
        assert!(cache.reused().0 >= 1);
    }

    #[test]
    fn owners_never_share_prompts() {
        let tok = fixture_tokenizer();
        let cache = PrefixTokens::new(&tok);
        let specials: Vec<String> = cache
            .splittable
            .iter()
            .filter_map(|id| tok.token(*id))
            .collect();
        let mut seed = 3u64;
        let mut text = String::new();
        while text.len() < 4 * MIN_BYTES {
            text.push_str(&piece(&mut seed, &specials));
        }
        cache.encode(&tok, "a", &text).unwrap();
        // Another owner's identical prompt is encoded whole and remembered separately.
        assert_eq!(
            cache.encode(&tok, "b", &text).unwrap(),
            tok.encode(&text).unwrap()
        );
        let entries = cache.entries.lock().unwrap();
        assert_eq!(entries.len(), 2);
        assert!(entries.iter().any(|e| e.owner == "a") && entries.iter().any(|e| e.owner == "b"));
    }

    #[test]
    fn common_len_counts_shared_bytes() {
        let a = "x".repeat(200) + "yz";
        assert_eq!(common_len(&a, &a), a.len());
        assert_eq!(common_len(&a, &("x".repeat(200) + "yq")), 201);
        assert_eq!(common_len(&a, "xq"), 1);
        assert_eq!(common_len("", &a), 0);
    }
}
