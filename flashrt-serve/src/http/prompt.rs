//! `/v1/completions`' `prompt` as OpenAI takes it — text, token ids, or a list of either (a
//! batch of prompts) — read straight from the body's bytes by a serde visitor, with no JSON
//! tree in between: a 16k-token prompt of ids costs about 0.4 ms as a `serde_json::Value`
//! (a 32-byte node per id) on a build machine's core, and about a quarter of that read into
//! integers. Malformed prompts are kept as [`Prompt::Invalid`] with the error the client gets
//! (`invalid_prompt`, `invalid_tokens`), so they answer as precisely as before instead of as
//! a generic JSON error.

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// The `prompt` of a completion request.
#[derive(Debug, PartialEq)]
pub(super) enum Prompt {
    /// Text, for the tokenizer.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A list of prompts (each text or ids): one completion per prompt, answered together.
    Batch(Vec<Prompt>),
    /// Not a prompt: the error code and message the request answers with.
    Invalid(&'static str, String),
}

impl Prompt {
    /// Whether the prompt (or a prompt of the batch) is text, for the tokenizer.
    pub(super) fn has_text(&self) -> bool {
        match self {
            Prompt::Text(_) => true,
            Prompt::Batch(ps) => ps.iter().any(Prompt::has_text),
            Prompt::Ids(_) | Prompt::Invalid(..) => false,
        }
    }
}

const SHAPE: &str = "`prompt` must be a string, token ids (an array of integers), or a list of \
                     strings or of token-id arrays (a batch)";

fn not_an_id(v: impl fmt::Display) -> Prompt {
    Prompt::Invalid(
        "invalid_tokens",
        format!("`{v}` is not a token id (an integer in 0..2^32)"),
    )
}

fn shape() -> Prompt {
    Prompt::Invalid("invalid_prompt", SHAPE.to_string())
}

/// One element of a `prompt` array: a token id, or a whole prompt (a batch's element).
enum Item {
    Id(u32),
    One(Prompt),
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemVisitor)
    }
}

/// What is not a prompt (numbers, booleans, null, objects) at the top level.
struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(SHAPE)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.to_string()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(v))
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Prompt, E> {
        Ok(shape())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Prompt, E> {
        Ok(shape())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Prompt, E> {
        Ok(shape())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Prompt, E> {
        Ok(shape())
    }
    fn visit_unit<E: de::Error>(self) -> Result<Prompt, E> {
        Ok(shape())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Prompt, A::Error> {
        while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(shape())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Prompt, A::Error> {
        let (ids, mut batch, invalid) = read_items(seq)?;
        if let Some(e) = invalid {
            return Ok(e);
        }
        Ok(match (ids.is_empty(), batch.len()) {
            (_, 0) => Prompt::Ids(ids),
            (false, _) => Prompt::Invalid(
                "invalid_prompt",
                "`prompt` mixes token ids with strings or arrays: one prompt of ids, or a list \
                 of prompts"
                    .to_string(),
            ),
            // A list of one prompt is that prompt.
            (true, 1) => batch.pop().expect("one"),
            (true, _) => Prompt::Batch(batch),
        })
    }
}

/// An element of a `prompt` array: an id, a text prompt, or a prompt of ids (an array of
/// integers; arrays nest no deeper).
struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id, a string or an array of token ids")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
        Ok(u32::try_from(v).map_or_else(|_| Item::One(not_an_id(v)), Item::Id))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
        Ok(match u32::try_from(v) {
            Ok(id) => Item::Id(id),
            Err(_) => Item::One(not_an_id(v)),
        })
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Item, E> {
        Ok(Item::One(not_an_id(v)))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Item, E> {
        Ok(Item::One(not_an_id(v)))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Item, E> {
        Ok(Item::One(not_an_id("null")))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
        Ok(Item::One(Prompt::Text(v.to_string())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Item, E> {
        Ok(Item::One(Prompt::Text(v)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Item, A::Error> {
        while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Item::One(shape()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
        // A batch element of ids: integers only.
        let (ids, nested, invalid) = read_items(seq)?;
        let invalid = invalid.or_else(|| (!nested.is_empty()).then(shape));
        Ok(Item::One(invalid.unwrap_or(Prompt::Ids(ids))))
    }
}

/// The elements of a `prompt` array: its ids, its whole prompts (a batch's), and the first
/// invalid element's error.
type Items = (Vec<u32>, Vec<Prompt>, Option<Prompt>);

fn read_items<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<Items, A::Error> {
    let (mut ids, mut prompts, mut invalid) = (Vec::new(), Vec::new(), None);
    while let Some(item) = seq.next_element::<Item>()? {
        match item {
            Item::Id(id) => ids.push(id),
            Item::One(Prompt::Invalid(c, m)) => {
                invalid.get_or_insert(Prompt::Invalid(c, m));
            }
            Item::One(p) => prompts.push(p),
        }
    }
    Ok((ids, prompts, invalid))
}

/// The fast path of a completion body whose top-level `prompt` is an array of plain integers
/// (what a client sending token ids writes): the ids, read by a scanner that only has to
/// recognise digits, commas and whitespace, and the body with that array replaced by `null`
/// for serde to read the rest. A 16k-id prompt takes ~24 ns an id through the serde visitor
/// above on a build machine's core (0.4 ms, on every stored-prefix request's time to first
/// token) and a few here. `None` (anything else: text, a batch, a number serde would refuse or
/// report, no `prompt` key) leaves the body to serde whole, so errors read as before.
pub(super) fn split_ids(body: &[u8]) -> Option<(Vec<u32>, Vec<u8>)> {
    let mut i = ws(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = ws(body, i);
        if body.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = string_end(body, i)?;
        let key = &body[i + 1..key_end - 1];
        i = ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return None;
        }
        i = ws(body, i + 1);
        if key == b"prompt" {
            let (ids, end) = id_array(body, i)?;
            let mut rest = Vec::with_capacity(body.len() - (end - i) + 4);
            rest.extend_from_slice(&body[..i]);
            rest.extend_from_slice(b"null");
            rest.extend_from_slice(&body[end..]);
            return Some((ids, rest));
        }
        i = ws(body, value_end(body, i)?);
        match body.get(i) {
            Some(b',') => i += 1,
            _ => return None,
        }
    }
}

fn ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\n' | b'\r' | b'\t')) {
        i += 1;
    }
    i
}

/// Past the closing quote of the string opening at `i`.
fn string_end(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// Past the value starting at `i` (validated later by serde: this only has to find its end).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i)? {
        b'"' => string_end(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match b.get(j)? {
                    b'"' => {
                        j = string_end(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while !matches!(
                b.get(j),
                None | Some(b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
            ) {
                j += 1;
            }
            Some(j)
        }
    }
}

/// The array of plain JSON integers in `0..2^32` at `i`, and the index past its `]`.
fn id_array(b: &[u8], i: usize) -> Option<(Vec<u32>, usize)> {
    if b.get(i) != Some(&b'[') {
        return None;
    }
    // An id and its comma take at least 2 bytes.
    let mut ids = Vec::with_capacity(b.len().saturating_sub(i) / 7);
    let mut j = ws(b, i + 1);
    if b.get(j) == Some(&b']') {
        return Some((ids, j + 1));
    }
    loop {
        let start = j;
        let mut v = 0u64;
        while let Some(&c) = b.get(j).filter(|c| c.is_ascii_digit()) {
            v = v * 10 + u64::from(c - b'0');
            j += 1;
            // Past 10 digits it is not an id (serde reports it).
            if j - start > 10 {
                return None;
            }
        }
        // No digits, or a leading zero (not JSON): serde's to report.
        if j == start || (b[start] == b'0' && j - start > 1) {
            return None;
        }
        ids.push(u32::try_from(v).ok()?);
        j = ws(b, j);
        match b.get(j)? {
            b',' => j = ws(b, j + 1),
            b']' => return Some((ids, j + 1)),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Prompt {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn prompts_parse_as_openai_takes_them() {
        assert_eq!(p(r#""hi""#), Prompt::Text("hi".into()));
        assert_eq!(p("[1, 2, 4294967295]"), Prompt::Ids(vec![1, 2, u32::MAX]));
        assert_eq!(p("[]"), Prompt::Ids(vec![]));
        assert_eq!(p(r#"["hi"]"#), Prompt::Text("hi".into()));
        assert_eq!(p("[[7, 8]]"), Prompt::Ids(vec![7, 8]));
        assert_eq!(
            p(r#"["a", [1], "b"]"#),
            Prompt::Batch(vec![
                Prompt::Text("a".into()),
                Prompt::Ids(vec![1]),
                Prompt::Text("b".into())
            ])
        );
    }

    #[test]
    fn malformed_prompts_keep_their_error() {
        let code = |s: &str| match p(s) {
            Prompt::Invalid(c, m) => (c, m),
            other => panic!("{s}: parsed as {other:?}"),
        };
        assert_eq!(code("[1.5]").0, "invalid_tokens");
        assert!(code("[1.5]").1.contains("`1.5`"));
        assert_eq!(
            code("[-1]").1,
            "`-1` is not a token id (an integer in 0..2^32)"
        );
        assert_eq!(code("[4294967296]").0, "invalid_tokens");
        assert_eq!(code("[[1, -2]]").0, "invalid_tokens");
        assert_eq!(code(r#"[true]"#).0, "invalid_tokens");
        assert_eq!(code(r#"{"a": 1}"#).0, "invalid_prompt");
        assert_eq!(code("3").0, "invalid_prompt");
        assert_eq!(code("null").0, "invalid_prompt");
        assert_eq!(code(r#"[1, "a"]"#).0, "invalid_prompt");
        assert_eq!(code(r#"[["a"]]"#).0, "invalid_prompt");
        assert_eq!(code(r#"[[[1]]]"#).0, "invalid_prompt");
        assert_eq!(code(r#"[{"a": [1]}, "b"]"#).0, "invalid_prompt");
        // Still strict JSON: a syntax error is the body's error, not a prompt's.
        assert!(serde_json::from_str::<Prompt>("[1,").is_err());
    }

    /// The fast path reads what serde reads: the ids of `prompt`, and the rest of the body
    /// unchanged but for `null` in the array's place; and leaves everything else to serde.
    #[test]
    fn the_id_fast_path_reads_what_serde_reads() {
        struct Rng(u64);
        impl Rng {
            fn n(&mut self, n: u64) -> u64 {
                self.0 = self
                    .0
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (self.0 >> 33) % n
            }
            fn sp(&mut self) -> &'static str {
                ["", " ", "\n", " \t\r\n "][self.n(4) as usize]
            }
        }
        let mut r = Rng(7);
        let others = [
            r#""model": "m""#,
            r#""stop": ["]", "\"prompt\": [1]", "{"]"#,
            r#""logit_bias": {"5": -1.5e2, "7": [true, null, {"x": "}"}]}"#,
            r#""max_tokens": 16"#,
            r#""temperature": 0.7"#,
            r#""stream": false"#,
            r#""user": "a \\\" b""#,
        ];
        for case in 0..400 {
            let n = [0, 1, 2, 17, 300][r.n(5) as usize];
            let ids: Vec<u64> = (0..n)
                .map(|_| match r.n(4) {
                    0 => r.n(10),
                    1 => u64::from(u32::MAX) - r.n(3),
                    _ => r.n(250_000),
                })
                .collect();
            let mut arr = format!("[{}", r.sp());
            for (k, id) in ids.iter().enumerate() {
                if k > 0 {
                    arr += &format!("{},{}", r.sp(), r.sp());
                }
                arr += &id.to_string();
            }
            arr += &format!("{}]", r.sp());
            let mut fields: Vec<String> = (0..r.n(4))
                .map(|_| others[r.n(others.len() as u64) as usize].to_string())
                .collect();
            let at = r.n(fields.len() as u64 + 1) as usize;
            let (a, b) = (r.sp(), r.sp());
            fields.insert(at, format!(r#""prompt"{a}:{b}{arr}"#));
            let sep = format!(",{}", r.sp());
            let body = format!("{}{{{}{}}}{}", r.sp(), r.sp(), fields.join(&sep), r.sp());
            let whole: serde_json::Value = serde_json::from_str(&body).unwrap();
            let (got, rest) =
                split_ids(body.as_bytes()).unwrap_or_else(|| panic!("case {case}: {body}"));
            let want: Prompt = serde_json::from_value(whole["prompt"].clone()).unwrap();
            assert_eq!(Prompt::Ids(got), want, "case {case}: {body}");
            let mut nulled = whole.clone();
            nulled["prompt"] = serde_json::Value::Null;
            let rest: serde_json::Value = serde_json::from_slice(&rest).unwrap();
            assert_eq!(rest, nulled, "case {case}: {body}");
        }
        // Anything but plain ids in 0..2^32 is serde's (its answers and errors stay as they
        // were), as is a body with no `prompt` key or not an object.
        for body in [
            r#"{"prompt": "text"}"#,
            r#"{"prompt": [[1, 2]]}"#,
            r#"{"prompt": [1.5]}"#,
            r#"{"prompt": [1e3]}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": [01]}"#,
            r#"{"prompt": [4294967296]}"#,
            r#"{"prompt": [12345678901]}"#,
            r#"{"prompt": [1 2]}"#,
            r#"{"prompt": [1,]}"#,
            r#"{"prompt": [1, "a"]}"#,
            r#"{"prompt": null}"#,
            r#"{"pro\u006dpt": [1]}"#,
            r#"{"messages": []}"#,
            r#"[1, 2]"#,
            r#"{"prompt" [1]}"#,
            "",
        ] {
            assert!(split_ids(body.as_bytes()).is_none(), "{body}");
        }
    }
}
