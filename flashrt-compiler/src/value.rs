//! The generic value tree both front-ends produce, and the error sink every later stage
//! writes to.
//!
//! A [`Value`] is TOML's data model (strings, integers, floats, booleans, arrays, tables)
//! with one addition: every value and every table key carries a [`Loc`], an opaque index
//! into a span table owned by the front-end that built the tree (byte ranges for TOML,
//! `proc_macro2::Span`s for the attribute form). The tree itself holds no parser or
//! proc-macro types, so [`crate::spec`] and [`crate::check`] are shared by both surfaces,
//! and an error found there is handed back as `(Loc, message)` for the front-end to place.
//!
//! Front-ends allocate locs in source order, so sorting errors by `Loc` sorts them by
//! position in the macro form; the TOML front sorts by byte offset instead.

/// Where a value or key came from: an index into the front-end's span table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Loc(pub(crate) u32);

impl Loc {
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

/// A value with its location.
#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub kind: ValueKind,
    pub loc: Loc,
}

/// The shape of a value.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    /// A string; the attribute form also maps bare identifiers here (`pattern = [gdn, attn]`).
    Str(String),
    /// An integer (wide enough for any TOML integer and any Rust integer literal).
    Int(i128),
    Float(f64),
    Bool(bool),
    Array(Vec<Value>),
    Table(Table),
    /// A value the spec language never accepts (a TOML datetime, a Rust char literal, ...);
    /// the payload names it for the "expected X, found Y" message.
    Other(&'static str),
}

impl ValueKind {
    /// "a string", "an integer", ...: the noun used in type errors.
    pub fn describe(&self) -> &'static str {
        match self {
            ValueKind::Str(_) => "a string",
            ValueKind::Int(_) => "an integer",
            ValueKind::Float(_) => "a float",
            ValueKind::Bool(_) => "a boolean",
            ValueKind::Array(_) => "an array",
            ValueKind::Table(_) => "a table",
            ValueKind::Other(what) => what,
        }
    }
}

/// A table: entries in source order. Duplicate keys are kept here (the attribute form can
/// write them) and reported by the spec stage.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Table {
    pub entries: Vec<Entry>,
}

/// One `key = value` entry of a table.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: String,
    pub key_loc: Loc,
    pub value: Value,
}

/// Collects every error of a compilation; nothing stops at the first one.
#[derive(Debug, Default)]
pub struct Errors {
    list: Vec<(Loc, String)>,
}

impl Errors {
    pub fn push(&mut self, loc: Loc, message: impl Into<String>) {
        self.list.push((loc, message.into()));
    }
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
    pub fn len(&self) -> usize {
        self.list.len()
    }
    pub fn into_vec(self) -> Vec<(Loc, String)> {
        self.list
    }
}

/// Levenshtein distance, for "did you mean" hints (inputs are short keys).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// The candidate closest to `word`, if it is close enough to be a plausible typo.
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|&(d, c)| d <= limit || c.starts_with(word) && word.len() >= 3)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// `; did you mean `x`?` or `; expected one of `a`, `b`` (a hint suffix for a bad name).
pub fn hint(word: &str, candidates: &[&str]) -> String {
    match closest(word, candidates.iter().copied()) {
        Some(c) => format!("; did you mean `{c}`?"),
        None if candidates.is_empty() => String::new(),
        None => format!("; expected one of {}", list(candidates)),
    }
}

/// "`a`, `b`, `c`"
pub fn list(items: &[&str]) -> String {
    items
        .iter()
        .map(|s| format!("`{s}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance() {
        assert_eq!(edit_distance("q_head", "q_heads"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn suggestions() {
        assert_eq!(closest("q_head", ["q_heads", "kv_heads"]), Some("q_heads"));
        assert_eq!(closest("mamba", ["mamba2", "attention"]), Some("mamba2"));
        assert_eq!(closest("zzz", ["mamba2", "attention"]), None);
        assert_eq!(hint("zzz", &["a", "b"]), "; expected one of `a`, `b`");
    }
}
