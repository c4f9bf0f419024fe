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
}
