//! Test helpers: a fixture model, an in-process server on 127.0.0.1 port 0, and a tiny
//! blocking HTTP/1.1 client (one connection per request) that speaks just enough HTTP for the
//! server: Content-Length bodies out, Content-Length or chunked bodies back.
#![allow(dead_code)]

use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::{CpuBackend, Model, StoreConfig};
use flashrt_serve::{ServeConfig, Server};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// `tests/fixtures/NAME` of the repository.
pub fn fixture(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    assert!(
        d.join("config.json").is_file(),
        "fixture {} not found in the repository's tests/fixtures",
        d.display()
    );
    d
}

/// A fixture model on the CPU backend (one thread), small prefill buckets.
pub fn model(name: &str, max_seq: usize) -> Model {
    let opts = HfOptions {
        max_seq: Some(max_seq),
        prefill_buckets: Some(vec![8, 32]),
        ..HfOptions::default()
    };
    Model::load_hf_dir(Arc::new(CpuBackend::with_threads(1)), &fixture(name), &opts)
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

/// The default test model: LFM2 (conv + attention), vocab 512, max_seq 256.
pub fn lfm2() -> Model {
    model("lfm2-public", 256)
}

pub fn config(dir: Option<&Path>, token: Option<&str>) -> ServeConfig {
    ServeConfig {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        token: token.map(str::to_string),
        store: StoreConfig {
            budget_device: 4 << 20,
            budget_host: 4 << 20,
            budget_disk: 64 << 20,
            dir: dir.map(Path::to_path_buf),
            share_kv: true,
            background: true,
            ..StoreConfig::default()
        },
        max_sessions: 64,
        ..ServeConfig::default()
    }
}

pub fn start(model: &Model, cfg: ServeConfig) -> Server {
    Server::start(model.clone(), None, cfg).expect("server starts")
}

/// A scratch directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn temp_dir(tag: &str) -> TempDir {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "flashrt-serve-test-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

/// Deterministic token ids in `[3, vocab)`.
pub fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            3 + (s % (vocab as u64 - 3)) as u32
        })
        .collect()
}

/// An HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: body is not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// `data:` payloads of a server-sent-events body.
    pub fn events(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.body)
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
    /// The error code of a JSON error body.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }
}

/// A client for one server.
#[derive(Clone)]
pub struct Client {
    pub addr: SocketAddr,
    pub token: Option<String>,
}

impl Client {
    pub fn new(addr: SocketAddr, token: Option<&str>) -> Client {
        Client {
            addr,
            token: token.map(str::to_string),
        }
    }

    pub fn raw(&self, method: &str, path: &str, ctype: &str, body: &[u8]) -> Resp {
        request(self.addr, method, path, self.token.as_deref(), ctype, body)
    }

    pub fn get(&self, path: &str) -> Resp {
        self.raw("GET", path, "application/json", b"")
    }
    pub fn delete(&self, path: &str) -> Resp {
        self.raw("DELETE", path, "application/json", b"")
    }
    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.raw(
            "POST",
            path,
            "application/json",
            body.to_string().as_bytes(),
        )
    }
    /// POST, expecting 200, returning the JSON body.
    pub fn ok(&self, path: &str, body: &Value) -> Value {
        let r = self.post(path, body);
        assert_eq!(
            r.status,
            200,
            "POST {path} {body}: {}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }
    pub fn ok_get(&self, path: &str) -> Value {
        let r = self.get(path);
        assert_eq!(
            r.status,
            200,
            "GET {path}: {}",
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }
}

fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    ctype: &str,
    body: &[u8],
) -> Resp {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.set_nodelay(true).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // A server refusing the request (413 for an oversized body, say) may answer and close
    // before it has read the whole body: the write then fails, and the answer is still there.
    let wrote = s.write_all(body);
    let mut buf = Vec::new();
    if let Err(e) = s.read_to_end(&mut buf) {
        panic!("read response: {e} (writing the body: {wrote:?})");
    }
    parse_response(&buf)
}

fn parse_response(buf: &[u8]) -> Resp {
    let split = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("response head");
    let head = std::str::from_utf8(&buf[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    let raw = &buf[split + 4..];
    let chunked = headers
        .iter()
        .any(|(n, v)| n.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked { dechunk(raw) } else { raw.to_vec() };
    Resp {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size_str = std::str::from_utf8(&b[..eol]).unwrap();
        let size = usize::from_str_radix(size_str.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
    out
}

/// Token ids of a JSON array.
pub fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).expect("token ids")
}
