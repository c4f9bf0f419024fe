//! Fuzz every endpoint's request body through a real server on loopback: whatever the bytes,
//! the answer is a 2xx or a 4xx (a 5xx for a client's bytes is a bug), and the server keeps
//! answering.
//!
//! The first input byte picks the endpoint (with a live session and capsule id, or an unknown
//! one), the second the content type; the rest is the body.
#![no_main]

use flashrt_runtime::{CpuBackend, Model, StoreConfig};
use flashrt_serve::{ServeConfig, Server};
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

const MODEL: &str = include_str!("../fuzz_tiny.toml");

struct Fixture {
    addr: SocketAddr,
    session: String,
    capsule: String,
    _server: Server,
}

fn request(addr: SocketAddr, method: &str, path: &str, ctype: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let status = std::str::from_utf8(&buf[..buf.len().min(12)])
        .ok()
        .and_then(|l| l.get(9..12))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, buf)
}

fn id_of(body: &[u8], key: &str) -> String {
    let text = String::from_utf8_lossy(body);
    let json = text.split("\r\n\r\n").nth(1).unwrap_or("");
    let v: serde_json::Value = serde_json::from_str(json).expect("json");
    v[key].as_str().expect("id").to_string()
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let ir = flashrt_compiler::model_from_toml(MODEL, "fuzz_tiny.toml").expect("fuzz model");
        let model = Model::with_random_weights(Arc::new(CpuBackend::with_threads(1)), &ir, 1)
            .expect("model");
        let dir = std::env::temp_dir().join(format!("flashrt-fuzz-http-{}", std::process::id()));
        let cfg = ServeConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            store: StoreConfig {
                budget_device: 1 << 20,
                budget_host: 1 << 20,
                budget_disk: 4 << 20,
                dir: Some(dir),
                share_kv: true,
                background: true,
                ..StoreConfig::default()
            },
            max_sessions: 8,
            ..ServeConfig::default()
        };
        let server = Server::start(model, None, cfg).expect("server");
        let addr = server.addr();
        let (_, b) = request(addr, "POST", "/v1/sessions", "application/json", br#"{"tokens": [3, 5, 7]}"#);
        let session = id_of(&b, "session");
        let (_, b) = request(addr, "POST", &format!("/v1/sessions/{session}/snapshot"), "application/json", b"{}");
        let capsule = id_of(&b, "capsule");
        Fixture { addr, session, capsule, _server: server }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let (Some(&which), Some(&ct)) = (data.first(), data.get(1)) else {
        return;
    };
    let body = &data[2..];
    let sid = if which & 0x80 == 0 { f.session.as_str() } else { "0123456789abcdef0123456789abcdef" };
    let cid = if which & 0x40 == 0 { f.capsule.as_str() } else { "fedcba9876543210fedcba9876543210" };
    let (method, path) = match which % 20 {
        0 => ("POST", "/v1/completions".to_string()),
        1 => ("POST", "/v1/chat/completions".to_string()),
        2 => ("POST", "/v1/sessions".to_string()),
        3 => ("POST", format!("/v1/sessions/{sid}/append")),
        4 => ("POST", format!("/v1/sessions/{sid}/generate")),
        5 => ("POST", format!("/v1/sessions/{sid}/snapshot")),
        6 => ("POST", format!("/v1/sessions/{sid}/restore")),
        7 => ("POST", format!("/v1/sessions/{sid}/rollback")),
        8 => ("POST", format!("/v1/sessions/{sid}/fork")),
        9 => ("POST", format!("/v1/capsules/{cid}/export")),
        10 => ("POST", format!("/v1/capsules/{cid}/persist")),
        11 => ("POST", "/v1/capsules/import".to_string()),
        12 => ("GET", format!("/v1/sessions/{sid}")),
        13 => ("GET", format!("/v1/capsules/{cid}")),
        14 => ("GET", format!("/v1/capsules/{cid}/file")),
        15 => ("GET", "/v1/models".to_string()),
        16 => ("GET", "/metrics".to_string()),
        17 => ("POST", format!("/v1/sessions/{}", String::from_utf8_lossy(&body[..body.len().min(8)]).escape_default())),
        18 => ("DELETE", "/v1/sessions/zzzz".to_string()),
        19 if which & 0x20 == 0 => ("POST", "/v1/sessions/generate".to_string()),
        _ => ("GET", "/health".to_string()),
    };
    let ctype = if ct & 1 == 0 { "application/json" } else { "application/octet-stream" };
    let (status, resp) = request(f.addr, method, &path, ctype, body);
    assert!(
        (200..500).contains(&status),
        "{method} {path} answered {status}: {}",
        String::from_utf8_lossy(&resp)
    );
    // Still serving.
    let (h, _) = request(f.addr, "GET", "/health", "application/json", b"");
    assert_eq!(h, 200);
});
