//! The attribute front-end: the tokens of `#[flashrt::model(...)]` -> [`Value`] tree with
//! `proc_macro2::Span`s.
//!
//! The grammar is TOML's data model written with Rust tokens:
//!
//! ```text
//! entries := (key `=` value),* [`,`]
//! key     := identifier | "string"
//! value   := "string" | identifier | integer | float | `-` number | `true` | `false`
//!          | `{` entries `}` | `[` value,* [`,`] `]`
//! ```
//!
//! A bare identifier is a string (`pattern = [gdn, gdn, attn]`, `dtype = bf16`). Integer and
//! float literals may carry Rust suffixes and underscores (`4096usize`, `1_000_000.0`). A
//! syntax error skips to the next `,` of the enclosing list and parsing goes on, so every
//! syntax error is reported; the spec stages only run on an error-free tree.

use crate::value::{Entry, Loc, Table, Value, ValueKind};
use proc_macro2::{Delimiter, Span, TokenStream, TokenTree};

/// Deepest nesting of arrays and tables accepted (no model needs more than three).
const MAX_DEPTH: usize = 64;

/// A parsed attribute: the tree, the span of every [`Loc`] in it, and the syntax errors.
pub struct Parsed {
    pub root: Value,
    pub spans: Vec<Span>,
    pub errors: Vec<(Span, String)>,
}

pub fn parse(tokens: TokenStream) -> Parsed {
    let mut p = Parser {
        spans: Vec::new(),
        errors: Vec::new(),
    };
    let loc = p.loc(Span::call_site());
    let table = p.entries(tokens, Span::call_site(), 0);
    Parsed {
        root: Value {
            kind: ValueKind::Table(table),
            loc,
        },
        spans: p.spans,
        errors: p.errors,
    }
}

struct Parser {
    spans: Vec<Span>,
    errors: Vec<(Span, String)>,
}

fn is_punct(tt: Option<&TokenTree>, c: char) -> bool {
    matches!(tt, Some(TokenTree::Punct(p)) if p.as_char() == c)
}

/// Index just past the next `,` at or after `i` (or the end).
fn skip_past_comma(tts: &[TokenTree], mut i: usize) -> usize {
    while i < tts.len() {
        i += 1;
        if is_punct(tts.get(i - 1), ',') {
            break;
        }
    }
    i
}

fn unraw(id: &proc_macro2::Ident) -> String {
    let s = id.to_string();
    match s.strip_prefix("r#") {
        Some(rest) => rest.to_string(),
        None => s,
    }
}

fn describe(tt: &TokenTree) -> String {
    match tt {
        TokenTree::Group(g) => match g.delimiter() {
            Delimiter::Parenthesis => "`(`".into(),
            Delimiter::Brace => "`{`".into(),
            Delimiter::Bracket => "`[`".into(),
            Delimiter::None => "a group".into(),
        },
        other => format!("`{other}`"),
    }
}

impl Parser {
    fn loc(&mut self, span: Span) -> Loc {
        self.spans.push(span);
        Loc(self.spans.len() as u32 - 1)
    }

    fn error(&mut self, span: Span, msg: impl Into<String>) {
        self.errors.push((span, msg.into()));
    }

    /// `key = value, ...` (the top level and the inside of `{ }`).
    fn entries(&mut self, tokens: TokenStream, span: Span, depth: usize) -> Table {
        let tts: Vec<TokenTree> = tokens.into_iter().collect();
        let mut entries = Vec::new();
        if depth > MAX_DEPTH {
            self.error(span, format!("values nested more than {MAX_DEPTH} deep"));
            return Table { entries };
        }
        let mut i = 0;
        while i < tts.len() {
            let key = match &tts[i] {
                TokenTree::Ident(id) => Some((unraw(id), id.span())),
                TokenTree::Literal(l) => match syn::Lit::new(l.clone()) {
                    syn::Lit::Str(s) => Some((s.value(), l.span())),
                    _ => None,
                },
                _ => None,
            };
            let Some((key, key_span)) = key else {
                self.error(
                    tts[i].span(),
                    format!(
                        "expected a key (`name = value`), found {}",
                        describe(&tts[i])
                    ),
                );
                i = skip_past_comma(&tts, i);
                continue;
            };
            i += 1;
            match tts.get(i) {
                Some(TokenTree::Punct(p)) if p.as_char() == '=' => i += 1,
                Some(other) => {
                    self.error(
                        other.span(),
                        format!("expected `=` after `{key}`, found {}", describe(other)),
                    );
                    i = skip_past_comma(&tts, i);
                    continue;
                }
                None => {
                    self.error(key_span, format!("expected `= value` after `{key}`"));
                    break;
                }
            }
            let key_loc = self.loc(key_span);
            let value = self.value(&tts, &mut i, key_span, depth + 1);
            match tts.get(i) {
                None => {}
                Some(TokenTree::Punct(p)) if p.as_char() == ',' => i += 1,
                Some(other) => {
                    self.error(
                        other.span(),
                        format!(
                            "expected `,` after the value of `{key}`, found {}",
                            describe(other)
                        ),
                    );
                    i = skip_past_comma(&tts, i);
                }
            }
            if let Some(value) = value {
                entries.push(Entry {
                    key,
                    key_loc,
                    value,
                });
            }
        }
        Table { entries }
    }

    /// One value starting at `tts[*i]`; advances `*i` past it (by at least one token when
    /// there is one). `prev` places the error when the value is missing.
    fn value(
        &mut self,
        tts: &[TokenTree],
        i: &mut usize,
        prev: Span,
        depth: usize,
    ) -> Option<Value> {
        let Some(tt) = tts.get(*i) else {
            self.error(prev, "expected a value");
            return None;
        };
        *i += 1;
        let kind = match tt {
            TokenTree::Group(g) => match g.delimiter() {
                Delimiter::Brace => {
                    let loc = self.loc(g.span());
                    let t = self.entries(g.stream(), g.span(), depth);
                    return Some(Value {
                        kind: ValueKind::Table(t),
                        loc,
                    });
                }
                Delimiter::Bracket => {
                    let loc = self.loc(g.span());
                    let items = self.array(g.stream(), g.span(), depth);
                    return Some(Value {
                        kind: ValueKind::Array(items?),
                        loc,
                    });
                }
                Delimiter::None => {
                    // An invisible group from a macro_rules expansion: its content is one value.
                    let inner: Vec<TokenTree> = g.stream().into_iter().collect();
                    let mut j = 0;
                    let v = self.value(&inner, &mut j, g.span(), depth + 1);
                    if let Some(extra) = inner.get(j) {
                        self.error(
                            extra.span(),
                            format!("expected one value, found {}", describe(extra)),
                        );
                        return None;
                    }
                    return v;
                }
                Delimiter::Parenthesis => {
                    self.error(
                        g.span(),
                        "expected a value, found `(`; tables are written `{ key = value }`",
                    );
                    return None;
                }
            },
            TokenTree::Ident(id) => {
                let s = unraw(id);
                let kind = match s.as_str() {
                    "true" => ValueKind::Bool(true),
                    "false" => ValueKind::Bool(false),
                    _ => ValueKind::Str(s),
                };
                let loc = self.loc(id.span());
                return Some(Value { kind, loc });
            }
            TokenTree::Literal(l) => self.literal(l, false)?,
            TokenTree::Punct(p) if p.as_char() == '-' => {
                let lit = match tts.get(*i) {
                    Some(TokenTree::Literal(l)) => l,
                    Some(other) => {
                        self.error(
                            other.span(),
                            format!("expected a number after `-`, found {}", describe(other)),
                        );
                        return None;
                    }
                    None => {
                        self.error(p.span(), "expected a number after `-`");
                        return None;
                    }
                };
                *i += 1;
                let kind = self.literal(lit, true)?;
                let span = p.span().join(lit.span()).unwrap_or_else(|| lit.span());
                let loc = self.loc(span);
                return Some(Value { kind, loc });
            }
            TokenTree::Punct(p) => {
                self.error(
                    p.span(),
                    format!("expected a value, found `{}`", p.as_char()),
                );
                return None;
            }
        };
        let loc = self.loc(tt.span());
        Some(Value { kind, loc })
    }

    fn array(&mut self, tokens: TokenStream, span: Span, depth: usize) -> Option<Vec<Value>> {
        if depth > MAX_DEPTH {
            self.error(span, format!("values nested more than {MAX_DEPTH} deep"));
            return None;
        }
        let tts: Vec<TokenTree> = tokens.into_iter().collect();
        let mut items = Vec::new();
        let mut i = 0;
        while i < tts.len() {
            let prev = tts[i].span();
            if let Some(v) = self.value(&tts, &mut i, prev, depth + 1) {
                items.push(v);
            }
            match tts.get(i) {
                None => {}
                Some(TokenTree::Punct(p)) if p.as_char() == ',' => i += 1,
                Some(other) => {
                    self.error(
                        other.span(),
                        format!("expected `,` or `]`, found {}", describe(other)),
                    );
                    i = skip_past_comma(&tts, i);
                }
            }
        }
        Some(items)
    }

    fn literal(&mut self, l: &proc_macro2::Literal, negative: bool) -> Option<ValueKind> {
        let lit = syn::Lit::new(l.clone());
        let kind = match &lit {
            syn::Lit::Int(n) => match n.base10_parse::<i128>() {
                Ok(x) => ValueKind::Int(if negative { -x } else { x }),
                Err(e) => {
                    self.error(l.span(), format!("invalid integer: {e}"));
                    return None;
                }
            },
            syn::Lit::Float(x) => match x.base10_parse::<f64>() {
                Ok(x) => ValueKind::Float(if negative { -x } else { x }),
                Err(e) => {
                    self.error(l.span(), format!("invalid float: {e}"));
                    return None;
                }
            },
            _ if negative => {
                self.error(l.span(), "expected a number after `-`");
                return None;
            }
            syn::Lit::Str(s) => ValueKind::Str(s.value()),
            syn::Lit::Char(_) => ValueKind::Other("a character"),
            syn::Lit::Byte(_) => ValueKind::Other("a byte literal"),
            syn::Lit::ByteStr(_) => ValueKind::Other("a byte string"),
            syn::Lit::CStr(_) => ValueKind::Other("a C string"),
            _ => ValueKind::Other("a literal"),
        };
        Some(kind)
    }
}
