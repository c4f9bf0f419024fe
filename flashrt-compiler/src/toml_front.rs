//! The TOML front-end: source text -> [`Value`] tree with byte spans, and the rendering of
//! errors as `path:line:col: error: message` with the source line and a caret underneath.
//!
//! Parsing uses `toml::de::DeTable`, the span-preserving document tree of the `toml` crate,
//! in its recovering mode so that every syntax error of a file is reported at once. When a
//! file has syntax errors the spec stages do not run (the recovered tree is partial and would
//! only produce follow-on errors).

use crate::value::{Entry, Loc, Table, Value, ValueKind};
use std::fmt;
use std::ops::Range;
use toml::de::{DeTable, DeValue};

/// Deepest nesting of arrays and tables accepted (no model needs more than three).
const MAX_DEPTH: usize = 64;

/// A parsed document: the tree, and the byte range of every [`Loc`] in it.
pub struct Parsed {
    pub root: Value,
    pub spans: Vec<Range<usize>>,
}

/// Parses a TOML document; `Err` holds every syntax error with its byte range.
pub fn parse(src: &str) -> Result<Parsed, Vec<(Range<usize>, String)>> {
    let (doc, errors) = DeTable::parse_recoverable(src);
    if !errors.is_empty() {
        return Err(errors
            .iter()
            .map(|e| (e.span().unwrap_or(0..0), e.message().to_string()))
            .collect());
    }
    let mut b = Builder {
        spans: Vec::new(),
        errors: Vec::new(),
    };
    let root_loc = b.loc(0..0);
    let table = b.table(doc.get_ref(), 0);
    if !b.errors.is_empty() {
        return Err(b.errors);
    }
    Ok(Parsed {
        root: Value {
            kind: ValueKind::Table(table),
            loc: root_loc,
        },
        spans: b.spans,
    })
}

struct Builder {
    spans: Vec<Range<usize>>,
    errors: Vec<(Range<usize>, String)>,
}

impl Builder {
    fn loc(&mut self, span: Range<usize>) -> Loc {
        self.spans.push(span);
        Loc(self.spans.len() as u32 - 1)
    }

    fn table(&mut self, t: &DeTable<'_>, depth: usize) -> Table {
        // The document tree is ordered by key; restore source order.
        let mut items: Vec<_> = t.iter().collect();
        items.sort_by_key(|(k, _)| k.span().start);
        let mut entries = Vec::with_capacity(items.len());
        for (k, v) in items {
            let key_loc = self.loc(k.span());
            let value = self.value(v.get_ref(), v.span(), depth + 1);
            entries.push(Entry {
                key: k.get_ref().to_string(),
                key_loc,
                value,
            });
        }
        Table { entries }
    }

    fn value(&mut self, v: &DeValue<'_>, span: Range<usize>, depth: usize) -> Value {
        let loc = self.loc(span.clone());
        if depth > MAX_DEPTH {
            self.errors
                .push((span, format!("values nested more than {MAX_DEPTH} deep")));
            return Value {
                kind: ValueKind::Other("a nested value"),
                loc,
            };
        }
        let kind = match v {
            DeValue::String(s) => ValueKind::Str(s.to_string()),
            DeValue::Integer(i) => match i128::from_str_radix(i.as_str(), i.radix()) {
                Ok(n) => ValueKind::Int(n),
                Err(_) => {
                    self.errors.push((span, format!("invalid integer `{i}`")));
                    ValueKind::Other("an invalid integer")
                }
            },
            DeValue::Float(f) => match f.as_str().parse::<f64>() {
                Ok(x) => ValueKind::Float(x),
                Err(_) => {
                    self.errors.push((span, format!("invalid float `{f}`")));
                    ValueKind::Other("an invalid float")
                }
            },
            DeValue::Boolean(b) => ValueKind::Bool(*b),
            DeValue::Datetime(_) => ValueKind::Other("a datetime"),
            DeValue::Array(a) => ValueKind::Array(
                a.iter()
                    .map(|e| self.value(e.get_ref(), e.span(), depth + 1))
                    .collect(),
            ),
            DeValue::Table(t) => ValueKind::Table(self.table(t, depth)),
        };
        Value { kind, loc }
    }
}

/// One error in a TOML model file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file path as given to [`crate::model_from_toml`].
    pub path: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column, in characters.
    pub col: usize,
    pub message: String,
    /// The text of the line (without its line break), for the rendered snippet.
    pub source_line: String,
    /// Characters to underline, at least 1.
    pub width: usize,
}

/// Every error of a TOML model file, sorted by position. `Display` renders them rustc-style.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostics {
    pub errors: Vec<Diagnostic>,
}

impl Diagnostics {
    /// Places `(byte range, message)` errors in `src`, sorted by position.
    pub fn new(src: &str, path: &str, mut errors: Vec<(Range<usize>, String)>) -> Diagnostics {
        errors.sort_by_key(|(r, _)| r.start);
        errors.dedup();
        let errors = errors
            .into_iter()
            .map(|(span, message)| locate(src, path, span, message))
            .collect();
        Diagnostics { errors }
    }

    pub fn len(&self) -> usize {
        self.errors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Diagnostic> {
        self.errors.iter()
    }
}

impl<'a> IntoIterator for &'a Diagnostics {
    type Item = &'a Diagnostic;
    type IntoIter = std::slice::Iter<'a, Diagnostic>;
    fn into_iter(self) -> Self::IntoIter {
        self.errors.iter()
    }
}

fn floor_boundary(src: &str, mut i: usize) -> usize {
    i = i.min(src.len());
    while !src.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn locate(src: &str, path: &str, span: Range<usize>, message: String) -> Diagnostic {
    let start = floor_boundary(src, span.start);
    let end = floor_boundary(src, span.end.max(start));
    let line_start = src[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = src[start..].find('\n').map_or(src.len(), |i| start + i);
    let line = src[..start].matches('\n').count() + 1;
    let col = src[line_start..start].chars().count() + 1;
    let source_line = src[line_start..line_end].trim_end_matches('\r').to_string();
    let width = src[start..end.min(line_end).max(start)]
        .chars()
        .count()
        .max(1);
    Diagnostic {
        path: path.to_string(),
        line,
        col,
        message,
        source_line,
        width,
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let num = self.line.to_string();
        let pad = " ".repeat(num.len());
        // Tabs keep their width in the caret line so the caret stays under its token.
        let lead: String = self
            .source_line
            .chars()
            .take(self.col - 1)
            .map(|c| if c == '\t' { '\t' } else { ' ' })
            .collect();
        writeln!(
            f,
            "{}:{}:{}: error: {}",
            self.path, self.line, self.col, self.message
        )?;
        writeln!(f, "{pad} |")?;
        writeln!(f, "{num} | {}", self.source_line)?;
        write!(f, "{pad} | {lead}{}", "^".repeat(self.width))
    }
}

impl fmt::Display for Diagnostics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
                writeln!(f)?;
            }
            write!(f, "{d}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Diagnostics {}
