//! Chat templates: the model's own Jinja template, rendered as transformers'
//! `apply_chat_template` renders it.
//!
//! A checkpoint carries its template as `chat_template.jinja` (newer releases) or as the
//! `chat_template` key of `tokenizer_config.json` (a string, or a list of named templates of
//! which `default` is used, as transformers does). It is rendered with minijinja configured
//! like transformers' sandboxed jinja2 environment:
//!
//! * `trim_blocks` and `lstrip_blocks` on, the template's single trailing newline dropped;
//! * Python's string, list and dict methods (`.startswith`, `.split`, `.strip`, `.items`, ...)
//!   through minijinja-contrib's `pycompat`, loop controls (`break`, `continue`);
//! * `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False)` with Python's
//!   separators (`", "`, `": "`), key order kept, `indent` honoured, no HTML escaping;
//! * `raise_exception(msg)` fails the render with the template's message; `strftime_now(fmt)`
//!   formats the current UTC time;
//! * the context: `messages`, `tools` (when given), `add_generation_prompt`, the tokenizer's
//!   special tokens (`bos_token`, `eos_token`, ...), and any extra keyword the caller passes
//!   (`enable_thinking`, ...).
//!
//! Messages and tools are passed exactly as the client sent them (OpenAI JSON), key order
//! included, so a template sees what it would see in transformers.

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value as Json};
use std::path::Path;

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... from `tokenizer_config.json`.
    special: Map<String, Json>,
    /// Where it came from, for messages.
    origin: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .finish()
    }
}

/// Options of one render beyond the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// OpenAI `tools` (function definitions), passed as `tools`.
    pub tools: Option<Json>,
    /// End with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Extra variables (`enable_thinking`, ...), as `apply_chat_template(**kwargs)`.
    pub kwargs: Map<String, Json>,
}

fn read_json(path: &Path) -> Result<Option<Json>, String> {
    match std::fs::read_to_string(path) {
        Ok(t) => serde_json::from_str(&t)
            .map(Some)
            .map_err(|e| format!("{}: not valid JSON: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

impl ChatTemplate {
    /// Compile `source`; `special` holds the special tokens the template may use.
    pub fn new(source: &str, special: Map<String, Json>, origin: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .keep_trailing_newline(false)
                .build()
                .map_err(|e| format!("{origin}: {e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| format!("{origin}: the chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            special,
            origin: origin.to_string(),
        })
    }

    /// The template of a checkpoint folder: `chat_template.jinja`, else the `chat_template`
    /// of `tokenizer_config.json`; `Ok(None)` when it has neither.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>, String> {
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?;
        let special = config.as_ref().map(special_tokens).unwrap_or_default();
        let file = dir.join("chat_template.jinja");
        if file.is_file() {
            let src =
                std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            return ChatTemplate::new(&src, special, &file.display().to_string()).map(Some);
        }
        let origin = format!("{} (chat_template)", config_path.display());
        match config.as_ref().and_then(|c| c.get("chat_template")) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(src)) => ChatTemplate::new(src, special, &origin).map(Some),
            Some(Json::Array(list)) => {
                let default = list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .or(list.first());
                match default.and_then(|t| t["template"].as_str()) {
                    Some(src) => ChatTemplate::new(src, special, &origin).map(Some),
                    None => Err(format!("{origin}: no `default` template in the list")),
                }
            }
            Some(_) => Err(format!("{origin}: not a string or a list of templates")),
        }
    }

    /// Render `messages` (an array of OpenAI messages).
    pub fn render(&self, messages: &Json, opts: &RenderOptions) -> Result<String, String> {
        let mut ctx = self.special.clone();
        ctx.insert("messages".into(), messages.clone());
        if let Some(t) = &opts.tools {
            ctx.insert("tools".into(), t.clone());
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(opts.add_generation_prompt),
        );
        for (k, v) in &opts.kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| format!("{}: {e}", self.origin))?;
        tmpl.render(Value::from(minijinja::value::Serde(Json::Object(ctx))))
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidOperation
                    if e.detail()
                        .is_some_and(|d| d.starts_with("raise_exception: ")) =>
                {
                    e.detail()
                        .unwrap_or_default()
                        .trim_start_matches("raise_exception: ")
                        .to_string()
                }
                _ => format!("the chat template failed: {e}"),
            })
    }

    /// Where the template was read from.
    pub fn origin(&self) -> &str {
        &self.origin
    }
}

/// The special tokens of a `tokenizer_config.json` (strings, or `AddedToken` objects whose
/// `content` is the token), as transformers passes them to the template.
fn special_tokens(config: &Json) -> Map<String, Json> {
    let mut out = Map::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ] {
        match config.get(key) {
            Some(Json::String(s)) => {
                out.insert(key.into(), Json::String(s.clone()));
            }
            Some(Json::Object(o)) => {
                if let Some(c) = o.get("content").and_then(Json::as_str) {
                    out.insert(key.into(), Json::String(c.into()));
                }
            }
            _ => {}
        }
    }
    out
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("raise_exception: {msg}"),
    ))
}

/// `strftime_now(fmt)`: the current UTC time; `%Y %m %d %H %M %S %b %B %a %A %y %j %p %I %%`.
fn strftime_now(fmt: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    Ok(Value::from(strftime(&fmt, secs)))
}

/// `fmt` applied to `secs` since the Unix epoch, UTC.
pub fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = secs.div_euclid(86400);
    let sod = secs.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let (hh, mm, ss) = (sod / 3600, sod / 60 % 60, sod % 60);
    let month = MONTHS[(m - 1) as usize];
    let wday = DAYS[days.rem_euclid(7) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hh + 11) % 12 + 1)),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&wday[..3]),
            Some('A') => out.push_str(wday),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => Some(v.as_str().unwrap_or("").to_string()),
        },
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators {
        Some(s) if !s.is_none() => {
            let parts: Vec<Value> = s.try_iter()?.collect();
            match (
                parts.first().and_then(Value::as_str),
                parts.get(1).and_then(Value::as_str),
            ) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        // Python's defaults: "," with an indent, ", " without one.
        _ => (
            if indent.is_some() { "," } else { ", " }.to_string(),
            ": ".to_string(),
        ),
    };
    let mut out = String::new();
    let style = Style {
        indent: indent.as_deref(),
        item: &item,
        key: &key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    dump(value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct Style<'a> {
    indent: Option<&'a str>,
    item: &'a str,
    key: &'a str,
    sort_keys: bool,
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(ind) = style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

/// Python's `json.dumps` of one value (see [`tojson`]).
fn dump(v: &Value, style: &Style, depth: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or("")).expect("a string"));
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item);
                }
                newline(out, style, depth + 1);
                dump(x, style, depth + 1, out)?;
            }
            newline(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if style.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(style.item);
                }
                newline(out, style, depth + 1);
                let name = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                out.push_str(&serde_json::to_string(&name).expect("a string"));
                out.push_str(style.key);
                dump(&v.get_item(k)?, style, depth + 1, out)?;
            }
            newline(out, style, depth);
            out.push('}');
        }
        _ => {
            out.push_str(&serde_json::to_string(&v.to_string()).expect("a string"));
        }
    }
    Ok(())
}

/// Python's `repr(float)` as `json.dumps` writes it: the shortest round-trip digits, in
/// positional notation for exponents -4..16 and scientific (`1e-05`, `1.5e+16`) outside.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Shortest round-trip digits and decimal exponent from Rust's `{:e}`.
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').expect("`{:e}` has an exponent");
    let exp: i32 = exp.parse().expect("an integer exponent");
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(char::is_ascii_digit).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let s = if exp >= 0 {
            if n - 1 <= exp {
                format!("{digits}{}.0", "0".repeat((exp - (n - 1)) as usize))
            } else {
                let (a, b) = digits.split_at((exp + 1) as usize);
                format!("{a}.{b}")
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let es = if exp < 0 { "-" } else { "+" };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, ctx: Json) -> String {
        let t = ChatTemplate::new(src, Map::new(), "test").unwrap();
        let opts = RenderOptions {
            kwargs: ctx.as_object().cloned().unwrap_or_default(),
            ..Default::default()
        };
        t.render(&json!([]), &opts).unwrap()
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let v = json!({"b": 1, "a": [1.5, "x\"y", null, true], "c": {"é": 1e-5, "big": 1e16}, "d": 0.1});
        assert_eq!(
            render("{{ v | tojson }}", json!({"v": v})),
            r#"{"b": 1, "a": [1.5, "x\"y", null, true], "c": {"é": 1e-05, "big": 1e+16}, "d": 0.1}"#
        );
        assert_eq!(
            render(
                "{{ v | tojson(indent=2) }}",
                json!({"v": {"a": [1, 2], "e": {}}})
            ),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}"
        );
        assert_eq!(
            render(
                "{{ v | tojson(sort_keys=true) }}",
                json!({"v": {"b": 1, "a": 2}})
            ),
            r#"{"a": 2, "b": 1}"#
        );
        // No HTML escaping.
        assert_eq!(render("{{ '<a>&' | tojson }}", json!({})), r#""<a>&""#);
    }

    #[test]
    fn python_floats() {
        for (f, s) in [
            (1.0, "1.0"),
            (100.0, "100.0"),
            (0.5, "0.5"),
            (123.456, "123.456"),
            (1e-4, "0.0001"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (-2.5e20, "-2.5e+20"),
        ] {
            assert_eq!(python_float(f), s, "{f}");
        }
    }

    #[test]
    fn jinja_as_transformers_configures_it() {
        // trim_blocks / lstrip_blocks, python methods, namespace, loop controls, slicing.
        let src = "{% for m in messages %}\n  {% if m.startswith('a') %}{{ m.upper() }}{% endif %}\n{% endfor %}\n";
        let t = ChatTemplate::new(src, Map::new(), "t").unwrap();
        let out = t
            .render(&json!(["ab", "b", "ac"]), &RenderOptions::default())
            .unwrap();
        assert_eq!(out, "ABAC");
        let src = "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if loop.index0 == 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.split('-')[-1].strip() }}{% endfor %}{{ ns.n }}";
        let t = ChatTemplate::new(src, Map::new(), "t").unwrap();
        assert_eq!(
            t.render(&json!(["a- x", "b- y", "c- z"]), &RenderOptions::default())
                .unwrap(),
            "zy2"
        );
        let t =
            ChatTemplate::new("{{ raise_exception('no system role') }}", Map::new(), "t").unwrap();
        assert_eq!(
            t.render(&json!([]), &RenderOptions::default()).unwrap_err(),
            "no system role"
        );
    }

    #[test]
    fn strftime_formats_utc() {
        // 2026-12-01 20:39:07 UTC was a Tuesday.
        let t = 1_796_157_547;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2026-12-01 20:39:07");
        assert_eq!(
            strftime("%d %b %Y (%A, day %j)", t),
            "01 Dec 2026 (Tuesday, day 335)"
        );
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
    }
}
