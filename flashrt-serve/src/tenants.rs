//! Tenants: who a request is, from its bearer token.
//!
//! * No token configured: every request is the default tenant (`""`), as on a laptop.
//! * `--token T`: the single-tenant shorthand, the default tenant behind one token.
//! * `--tokens FILE`: a JSON file naming tenants and their tokens, re-read when it changes
//!   (checked at most once a second), so tenants can be added or revoked without a restart:
//!
//!   ```json
//!   {"alice": "token-of-alice",
//!    "bob": {"token": "token-of-bob", "max_sessions": 4, "max_capsule_bytes": "2G"}}
//!   ```
//!
//! A tenant is a namespace: its sessions, capsules and files directory (`FILES_DIR/<name>`)
//! are invisible to every other tenant (another tenant's id answers 404, as an unknown one
//! does), and its automatic prefix cache holds only capsules computed for its own requests.
//! Tokens are compared in constant time.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// One tenant and its limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    /// `""` for the default tenant.
    pub name: Arc<str>,
    /// Sessions it may hold open at once (the server's limit when `None`).
    pub max_sessions: Option<usize>,
    /// Bytes of capsules it may keep in the store, every tier counted (none when `None`).
    pub max_capsule_bytes: Option<u64>,
}

impl Tenant {
    /// The default tenant.
    pub fn default_tenant() -> Tenant {
        Tenant {
            name: "".into(),
            max_sessions: None,
            max_capsule_bytes: None,
        }
    }

    /// The name as logs and messages show it.
    pub fn display(&self) -> &str {
        if self.name.is_empty() {
            "default"
        } else {
            &self.name
        }
    }
}

/// Whether `s` can name a tenant (it names a folder too).
pub fn valid_tenant_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The tenants of a server and how to recognise them.
pub struct Tenants {
    mode: Mode,
}

enum Mode {
    Open,
    Single(String),
    File(Mutex<FileTenants>),
}

struct FileTenants {
    path: PathBuf,
    modified: Option<SystemTime>,
    checked: Instant,
    tokens: Vec<(String, Tenant)>,
}

/// Parse a token file's text.
pub fn parse_token_file(text: &str) -> Result<Vec<(String, Tenant)>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or("the token file must be a JSON object of tenant name -> token")?;
    let mut out = Vec::new();
    for (name, entry) in obj {
        if !valid_tenant_name(name) {
            return Err(format!(
                "tenant name `{}` must be 1-64 of a-z, 0-9, `-`, `_`",
                name.escape_debug()
            ));
        }
        let (token, max_sessions, max_bytes) = match entry {
            serde_json::Value::String(t) => (t.clone(), None, None),
            serde_json::Value::Object(o) => {
                let token = o
                    .get("token")
                    .and_then(|t| t.as_str())
                    .ok_or_else(|| format!("tenant `{name}`: no string `token`"))?
                    .to_string();
                let ms =
                    match o.get("max_sessions") {
                        None => None,
                        Some(x) => Some(x.as_u64().ok_or_else(|| {
                            format!("tenant `{name}`: `max_sessions` is not a count")
                        })? as usize),
                    };
                let mb = match o.get("max_capsule_bytes") {
                    None => None,
                    Some(serde_json::Value::String(s)) => Some(
                        crate::cli::parse_bytes(s).map_err(|e| format!("tenant `{name}`: {e}"))?,
                    ),
                    Some(x) => Some(x.as_u64().ok_or_else(|| {
                        format!("tenant `{name}`: `max_capsule_bytes` is not a byte count")
                    })?),
                };
                (token, ms, mb)
            }
            _ => return Err(format!("tenant `{name}`: expected a token or an object")),
        };
        if token.len() < 8 {
            return Err(format!(
                "tenant `{name}`: tokens must be at least 8 characters"
            ));
        }
        if out.iter().any(|(t, _): &(String, Tenant)| t == &token) {
            return Err(format!(
                "tenant `{name}`: its token is another tenant's too"
            ));
        }
        out.push((
            token,
            Tenant {
                name: name.as_str().into(),
                max_sessions,
                max_capsule_bytes: max_bytes,
            },
        ));
    }
    Ok(out)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

impl Tenants {
    /// Everyone is the default tenant.
    pub fn open() -> Tenants {
        Tenants { mode: Mode::Open }
    }

    /// From the command line: a single token, a token file, or neither (not both).
    pub fn new(token: Option<String>, file: Option<&Path>) -> Result<Tenants, String> {
        match (token, file) {
            (Some(_), Some(_)) => Err("--token and --tokens exclude each other".into()),
            (Some(t), None) => Ok(Tenants {
                mode: Mode::Single(t),
            }),
            (None, Some(p)) => {
                let text =
                    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                let tokens =
                    parse_token_file(&text).map_err(|e| format!("{}: {e}", p.display()))?;
                Ok(Tenants {
                    mode: Mode::File(Mutex::new(FileTenants {
                        path: p.to_path_buf(),
                        modified: modified(p),
                        checked: Instant::now(),
                        tokens,
                    })),
                })
            }
            (None, None) => Ok(Tenants::open()),
        }
    }

    /// Whether requests need a bearer token.
    pub fn required(&self) -> bool {
        !matches!(self.mode, Mode::Open)
    }

    /// Tenants named in a token file (for messages).
    pub fn count(&self) -> usize {
        match &self.mode {
            Mode::Open | Mode::Single(_) => 1,
            Mode::File(f) => f.lock().map_or(0, |f| f.tokens.len()),
        }
    }

    /// The tenant a bearer token belongs to (`None`: not authenticated).
    pub fn authenticate(&self, bearer: Option<&str>) -> Option<Tenant> {
        match &self.mode {
            Mode::Open => Some(Tenant::default_tenant()),
            Mode::Single(t) => bearer
                .is_some_and(|b| same(b.as_bytes(), t.as_bytes()))
                .then(Tenant::default_tenant),
            Mode::File(f) => {
                let bearer = bearer?;
                let mut f = f.lock().ok()?;
                if f.checked.elapsed() >= Duration::from_secs(1) {
                    f.checked = Instant::now();
                    let m = modified(&f.path);
                    if m != f.modified {
                        f.modified = m;
                        match std::fs::read_to_string(&f.path)
                            .map_err(|e| e.to_string())
                            .and_then(|t| parse_token_file(&t))
                        {
                            Ok(t) => {
                                tracing::info!(
                                    "token file {} reloaded: {} tenants",
                                    f.path.display(),
                                    t.len()
                                );
                                f.tokens = t;
                            }
                            Err(e) => tracing::error!(
                                "token file {} not reloaded (the previous tenants stay): {e}",
                                f.path.display()
                            ),
                        }
                    }
                }
                // Compare with every token, so the time does not say which one matched.
                let mut found = None;
                for (t, tenant) in &f.tokens {
                    if same(bearer.as_bytes(), t.as_bytes()) {
                        found = Some(tenant.clone());
                    }
                }
                found
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_files() {
        let t = parse_token_file(
            r#"{"alice": "aaaaaaaa1", "bob": {"token": "bbbbbbbb2", "max_sessions": 3, "max_capsule_bytes": "1M"}}"#,
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].1.max_sessions, Some(3));
        assert_eq!(t[1].1.max_capsule_bytes, Some(1 << 20));
        for bad in [
            "[]",
            r#"{"Alice": "aaaaaaaa"}"#,
            r#"{"a": "short"}"#,
            r#"{"a": "aaaaaaaa", "b": "aaaaaaaa"}"#,
            r#"{"a": {"max_sessions": 2}}"#,
            r#"{"../x": "aaaaaaaa"}"#,
        ] {
            assert!(parse_token_file(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn authentication_and_reload() {
        assert_eq!(
            Tenants::open().authenticate(None),
            Some(Tenant::default_tenant())
        );
        let single = Tenants::new(Some("s3cret-token".into()), None).unwrap();
        assert!(single.authenticate(Some("s3cret-token")).is_some());
        assert!(single.authenticate(Some("s3cret-tokeN")).is_none());
        assert!(single.authenticate(None).is_none());
        let dir = std::env::temp_dir().join(format!("flashrt-tenants-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("tokens.json");
        std::fs::write(&p, r#"{"alice": "alice-token"}"#).unwrap();
        let ts = Tenants::new(None, Some(&p)).unwrap();
        assert_eq!(
            ts.authenticate(Some("alice-token")).unwrap().name.as_ref(),
            "alice"
        );
        assert!(ts.authenticate(Some("bob-token-1")).is_none());
        // Revoke alice, add bob: seen after the next check.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(&p, r#"{"bob": "bob-token-1"}"#).unwrap();
        let t0 = Instant::now();
        while ts.authenticate(Some("bob-token-1")).is_none() {
            assert!(t0.elapsed() < Duration::from_secs(5), "never reloaded");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(ts.authenticate(Some("alice-token")).is_none());
        // A broken file keeps the tenants that were.
        std::fs::write(&p, "{ broken").unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        assert!(ts.authenticate(Some("bob-token-1")).is_some());
        let _ = std::fs::remove_dir_all(dir);
    }
}
