//! The server attacked as a hostile client would, one test per finding of the trust and
//! durability review: poisoned imports, weights outside the fingerprint, non-finite state,
//! SIGTERM, stalled clients, persists that were not durable, a corrupt base losing a chain,
//! files that are not regular files, and the small ones (guessable ids, unknown models,
//! unimplemented parameters, prompts with no room, absolute paths, silent overwrites); and
//! two tenants that must never see each other.
//!
//! Signal tests re-run this binary as a child server (`FLASHRT_ATTACK_CHILD`).

mod common;

use common::*;
use flashrt_runtime::capsule_file;
use flashrt_serve::{ServeConfig, Server};
use serde_json::json;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn start_with(m: &flashrt_runtime::Model, cfg: ServeConfig) -> Server {
    Server::start(m.clone(), None, cfg).expect("server starts")
}

/// A completion's greedy tokens and how many prompt tokens came from the cache.
fn complete(c: &Client, prompt: &[u32], n: usize) -> (Vec<u32>, u64) {
    let r = c.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true}),
    );
    (
        ids(&r["choices"][0]["token_ids"]),
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

/// A new session over `tokens`; its id.
fn session(c: &Client, tokens: &[u32]) -> String {
    c.ok("/v1/sessions", &json!({"tokens": tokens}))["session"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A snapshot of session `sid`; the capsule's id.
fn snapshot(c: &Client, sid: &str) -> String {
    c.ok(&format!("/v1/sessions/{sid}/snapshot"), &json!({}))["capsule"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Capsule file bytes with `edit` applied to the decoded capsule, written back with valid
/// checksums (what an attacker with the format can do).
fn forge(
    m: &flashrt_runtime::Model,
    bytes: &[u8],
    edit: impl FnOnce(
        &mut capsule_file::FileMeta,
        &mut Vec<(flashrt_runtime::ir::BufferId, Vec<u8>)>,
        &mut Option<Vec<f32>>,
    ),
) -> Vec<u8> {
    let compiled = m.compiled();
    let mut f = capsule_file::decode(bytes, compiled).unwrap();
    edit(&mut f.meta, &mut f.regions, &mut f.logits);
    let mut out = std::io::Cursor::new(Vec::new());
    capsule_file::encode_to(&mut out, compiled, &f.meta, f.logits.as_deref(), |b| {
        Ok(f.regions
            .iter()
            .find(|(id, _)| *id == b.id)
            .unwrap()
            .1
            .clone())
    })
    .unwrap();
    out.into_inner()
}

fn import_bytes(c: &Client, bytes: &[u8]) -> Resp {
    c.raw(
        "POST",
        "/v1/capsules/import",
        "application/octet-stream",
        bytes,
    )
}

#[test]
fn an_imported_capsule_never_serves_another_prompt() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("poison");
    let prompt = tokens(7, 24, v);
    // What the model answers, from a server that has seen nothing.
    let clean = {
        let s = start_with(&m, config(None, None));
        let c = Client::new(s.addr(), None);
        let r = complete(&c, &prompt, 6);
        s.shutdown().unwrap();
        r.0
    };
    let server = start_with(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    // The attacker snapshots some other history, rewrites its token history into our
    // prompt's first 12 tokens, recomputes the checksums and imports it.
    let sid = session(&c, &tokens(99, 12, v));
    let cap = snapshot(&c, &sid);
    // Its own computed capsule would be reused for its own history; delete it first.
    let bytes = c.get(&format!("/v1/capsules/{cap}/file")).body;
    assert_eq!(c.delete(&format!("/v1/capsules/{cap}")).status, 200);
    let forged = forge(&m, &bytes, |meta, _, _| meta.tokens = prompt[..12].to_vec());
    let imp = import_bytes(&c, &forged);
    assert_eq!(imp.status, 200, "{}", String::from_utf8_lossy(&imp.body));
    assert_eq!(imp.json()["origin"], "imported");
    let forged_id = imp.json()["capsule"].as_str().unwrap().to_string();
    // Another request with that prefix: never served from the import.
    let (got, cached) = complete(&c, &prompt, 6);
    assert_eq!(cached, 0, "the forged capsule was reused");
    assert_eq!(got, clean);
    // The importer can still restore it explicitly, by id.
    let r = c.ok("/v1/sessions", &json!({"capsule": forged_id}));
    assert_eq!(r["pos"], 12);
    // After a restart it is still only an import.
    server.shutdown().unwrap();
    let server = start_with(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    let info = c.ok_get(&format!("/v1/capsules/{forged_id}"));
    assert_eq!(info["origin"], "imported");
    let p2: Vec<u32> = prompt[..12]
        .iter()
        .copied()
        .chain(tokens(5, 8, v))
        .collect();
    let fresh = {
        let s = start_with(&m, config(None, None));
        let c2 = Client::new(s.addr(), None);
        let r = complete(&c2, &p2, 4);
        s.shutdown().unwrap();
        r.0
    };
    let (got, cached) = complete(&c, &p2, 4);
    assert!(
        cached == 0 || cached >= 24,
        "restored the import: cached {cached}"
    );
    assert_eq!(got, fresh);
    server.shutdown().unwrap();
}

#[test]
fn other_weights_have_another_fingerprint_and_their_capsules_are_refused() {
    let json = std::fs::read_to_string(fixture("lfm2-public").join("config.json")).unwrap();
    let ir = flashrt_runtime::ir::hf::ir_from_hf_config(
        &json,
        &flashrt_runtime::ir::hf::HfOptions {
            name: Some("same".into()),
            max_seq: Some(128),
            prefill_buckets: Some(vec![8, 32]),
            ..Default::default()
        },
    )
    .unwrap();
    let cpu = || -> std::sync::Arc<dyn flashrt_runtime::Backend> {
        std::sync::Arc::new(flashrt_runtime::CpuBackend::with_threads(1))
    };
    let a = flashrt_runtime::Model::with_random_weights(cpu(), &ir, 0).unwrap();
    let b = flashrt_runtime::Model::with_random_weights(cpu(), &ir, 7).unwrap();
    let sa = start_with(&a, config(None, None));
    let sb = start_with(&b, config(None, None));
    let (ca, cb) = (Client::new(sa.addr(), None), Client::new(sb.addr(), None));
    let fa = ca.ok_get("/health")["fingerprint"].clone();
    let fb = cb.ok_get("/health")["fingerprint"].clone();
    assert_ne!(fa, fb, "seed 0 and seed 7 report one fingerprint");
    let sid = session(&ca, &[5, 6, 7]);
    let cap = snapshot(&ca, &sid);
    let bytes = ca.get(&format!("/v1/capsules/{cap}/file")).body;
    let r = import_bytes(&cb, &bytes);
    assert_eq!(r.status, 400);
    assert_eq!(r.code(), "fingerprint_mismatch");
    sa.shutdown().unwrap();
    sb.shutdown().unwrap();
}

#[test]
fn non_finite_state_is_refused_at_import_and_at_load() {
    let m = lfm2();
    let dir = temp_dir("nan");
    let server = start_with(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    let sid = session(&c, &tokens(3, 10, m.vocab()));
    let cap = snapshot(&c, &sid);
    let bytes = c.get(&format!("/v1/capsules/{cap}/file")).body;
    let nan_state = forge(&m, &bytes, |_, regions, _| {
        regions[0].1[..4].copy_from_slice(&f32::NAN.to_le_bytes())
    });
    let nan_logits = forge(&m, &bytes, |_, _, logits| {
        logits.as_mut().unwrap()[3] = f32::INFINITY
    });
    let zero_rng = forge(&m, &bytes, |meta, _, _| meta.sampler.rng = [0; 4]);
    for (what, b) in [
        ("state", &nan_state),
        ("logits", &nan_logits),
        ("rng", &zero_rng),
    ] {
        let r = import_bytes(&c, b);
        assert_eq!(
            r.status,
            400,
            "{what}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.code(), "invalid_capsule", "{what}");
    }
    // Every completion still works.
    complete(&c, &tokens(3, 12, m.vocab()), 3);
    server.shutdown().unwrap();
    // The same bytes dropped into the store directory: listed after the next start (opening
    // reads headers only), refused and set aside when their bytes are read.
    let id = "00000000000000000000000000000abc";
    let planted = forge(&m, &bytes, |meta, regions, _| {
        meta.id = Some(id.into());
        regions[0].1[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    });
    std::fs::write(dir.join(format!("{id}.caps")), &planted).unwrap();
    let server = start_with(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    assert_eq!(c.get(&format!("/v1/capsules/{id}")).status, 200);
    let r = c.post("/v1/sessions", &json!({"capsule": id}));
    assert_eq!(r.status, 410, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.code(), "capsule_lost");
    assert_eq!(c.get(&format!("/v1/capsules/{id}")).status, 404);
    assert!(dir.join(format!("{id}.caps.corrupt")).is_file());
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(
        metrics.contains("flashrt_store_corrupt_files_total 1"),
        "{metrics}"
    );
    server.shutdown().unwrap();
}

const CHILD: &str = "FLASHRT_ATTACK_CHILD";

/// Child mode: serve the LFM2 fixture from a store directory until a signal (the `serve`
/// command's own path: `run_until_signal`), printing the address first.
#[test]
fn attack_child() {
    let Ok(dir) = std::env::var(CHILD) else {
        return;
    };
    let mut cfg = config(Some(Path::new(&dir)), None);
    cfg.grace = Duration::from_millis(500);
    cfg.header_timeout = Duration::from_secs(30);
    let server = start_with(&lfm2(), cfg);
    println!("ADDR {}", server.addr());
    std::io::stdout().flush().unwrap();
    flashrt_serve::run_until_signal(server).unwrap();
    println!("STOPPED");
}

fn spawn_child(dir: &Path) -> (Child, std::net::SocketAddr) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "attack_child",
            "--exact",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut buf = Vec::new();
    let t0 = Instant::now();
    let addr = loop {
        let mut b = [0u8; 256];
        let n = out.read(&mut b).unwrap();
        buf.extend_from_slice(&b[..n]);
        let text = String::from_utf8_lossy(&buf);
        // libtest prints `test attack_child ... ` before the child's own line.
        if let Some(rest) = text.split("ADDR ").nth(1)
            && let Some(addr) = rest.split_whitespace().next()
            && rest.contains('\n')
        {
            break addr.parse().unwrap();
        }
        assert!(
            n > 0 && t0.elapsed() < Duration::from_secs(60),
            "child: {text}"
        );
    };
    // Keep reading: a closed pipe would make the child's last lines fail.
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = out.read_to_end(&mut sink);
    });
    (child, addr)
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sends a signal to our own child process, which is still alive (not reaped).
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
}

fn wait(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            panic!("the server did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigterm_drains_and_persists_the_store() {
    let dir = temp_dir("sigterm");
    let (mut child, addr) = spawn_child(&dir);
    let c = Client::new(addr, None);
    let mut caps = Vec::new();
    for i in 0..3 {
        let sid = c.ok(
            "/v1/sessions",
            &json!({"tokens": tokens(i, 9 + i as usize, 512)}),
        )["session"]
            .as_str()
            .unwrap()
            .to_string();
        caps.push(snapshot(&c, &sid));
    }
    signal(&child, libc::SIGTERM);
    let status = wait(&mut child, Duration::from_secs(30));
    assert!(status.success(), "exit {status}");
    // Every capsule held in memory is now a file, and a new server has it.
    let server = start_with(&lfm2(), config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    for cap in &caps {
        let info = c.ok_get(&format!("/v1/capsules/{cap}"));
        assert!(info["tiers"].to_string().contains("disk"), "{info}");
    }
    server.shutdown().unwrap();
}

#[test]
fn a_stalled_client_does_not_hold_up_shutdown() {
    let dir = temp_dir("stall");
    let (mut child, addr) = spawn_child(&dir);
    // Half a request, never finished, and a connection that sends nothing at all.
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(b"POST /v1/sessions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"tok")
        .unwrap();
    let _idle = TcpStream::connect(addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    signal(&child, libc::SIGINT);
    // Grace 0.5 s: out well before the 30 s header timeout or the 60 s body timeout.
    let status = wait(&mut child, Duration::from_secs(10));
    assert!(status.success(), "exit {status}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
}

#[test]
fn a_second_signal_exits_at_once() {
    let dir = temp_dir("twice");
    let (mut child, addr) = spawn_child(&dir);
    // Half a request keeps the drain waiting for its grace period (0.5 s in the child) ...
    let mut half = TcpStream::connect(addr).unwrap();
    half.write_all(b"POST /v1/sessions HTTP/1.1\r\nContent-Length: 10\r\n\r\n{")
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    signal(&child, libc::SIGINT);
    std::thread::sleep(Duration::from_millis(100));
    // ... and a second signal does not wait for it.
    signal(&child, libc::SIGINT);
    let status = wait(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(130), "exit {status}");
}

#[test]
fn half_open_and_excess_connections_are_closed() {
    let m = lfm2();
    let mut cfg = config(None, None);
    cfg.header_timeout = Duration::from_millis(700);
    cfg.max_connections = 64;
    let server = start_with(&m, cfg);
    let addr = server.addr();
    let mut conns: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(addr).ok())
        .collect();
    for c in conns.iter_mut() {
        let _ = c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n");
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    }
    std::thread::sleep(Duration::from_millis(1500));
    // Every one of them is closed by now: over the cap at once, the others by the timeout.
    let mut still = 0;
    for c in conns.iter_mut() {
        c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut b = [0u8; 256];
        loop {
            match c.read(&mut b) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    still += 1;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    assert_eq!(still, 0, "{still} half-open connections are still held");
    drop(conns);
    // An idle keep-alive connection (one whole request answered, then silence) is closed too.
    let mut ka = TcpStream::connect(addr).unwrap();
    ka.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    ka.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut first = [0u8; 4096];
    let n = ka.read(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    let t0 = Instant::now();
    let mut rest = Vec::new();
    let _ = ka.read_to_end(&mut rest);
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "an idle keep-alive connection stayed open {:?}",
        t0.elapsed()
    );
    // The server serves as before.
    let c = Client::new(addr, None);
    assert_eq!(c.get("/health").status, 200);
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(
        !metrics.contains("flashrt_http_refused_connections_total 0"),
        "{metrics}"
    );
    // A body that never arrives gets 408 once the body timeout passes (set short here).
    server.shutdown().unwrap();
    let mut cfg = config(None, None);
    cfg.body_timeout = Duration::from_millis(500);
    let server = start_with(&m, cfg);
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.write_all(b"POST /v1/sessions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{\"tok")
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut resp = String::new();
    let _ = s.read_to_string(&mut resp);
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    server.shutdown().unwrap();
}

#[test]
fn persist_is_durable_or_an_error() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("persist");
    let mut cfg = config(Some(&dir), None);
    // Room for a few capsule files only; memory tiers tiny so everything spills to disk.
    cfg.store.budget_device = 0;
    cfg.store.budget_host = 0;
    cfg.store.budget_disk = 96 << 10;
    let server = start_with(&m, cfg.clone());
    let c = Client::new(server.addr(), None);
    let mut persisted = Vec::new();
    let mut refused = 0;
    for i in 0..12 {
        let sid = session(&c, &tokens(40 + i, 30, v));
        let r = c.post(
            &format!("/v1/sessions/{sid}/snapshot"),
            &json!({"persist": true}),
        );
        match r.status {
            200 => {
                let j = r.json();
                assert!(
                    j["tiers"].to_string().contains("disk"),
                    "200 without a disk copy: {j}"
                );
                assert_eq!(j["persisted"], true);
                persisted.push(j["capsule"].as_str().unwrap().to_string());
            }
            507 => {
                refused += 1;
                assert_eq!(r.code(), "insufficient_storage");
                assert!(
                    r.json()["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("budget")
                );
            }
            s => panic!(
                "snapshot answered {s}: {}",
                String::from_utf8_lossy(&r.body)
            ),
        }
        // Unpersisted traffic on top, which the store may evict.
        complete(&c, &tokens(100 + i, 20, v), 2);
    }
    assert!(
        !persisted.is_empty() && refused > 0,
        "{} persisted, {refused} refused",
        persisted.len()
    );
    for cap in &persisted {
        assert!(
            dir.join(format!("{cap}.caps")).is_file(),
            "{cap} lost its file"
        );
    }
    server.shutdown().unwrap();
    let server = start_with(&m, cfg);
    let c = Client::new(server.addr(), None);
    for cap in &persisted {
        assert_eq!(
            c.get(&format!("/v1/capsules/{cap}")).status,
            200,
            "{cap} gone after a restart"
        );
    }
    server.shutdown().unwrap();
}

#[test]
fn a_corrupt_base_file_costs_at_most_one_chain() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("chain");
    let mut cfg = config(Some(&dir), None);
    cfg.store.budget_disk = u64::MAX;
    let server = start_with(&m, cfg.clone());
    let c = Client::new(server.addr(), None);
    // One conversation, a capsule every few tokens: each shares the KV rows of the last.
    let sid = session(&c, &tokens(1, 8, v));
    let mut caps = Vec::new();
    for i in 0..20 {
        c.ok(
            &format!("/v1/sessions/{sid}/append"),
            &json!({"tokens": tokens(50 + i, 3, v)}),
        );
        caps.push(snapshot(&c, &sid));
    }
    server.shutdown().unwrap(); // every capsule becomes a file, deltas along the chain
    // Flip one bit in the data of the first (the base of everything after it).
    let p = dir.join(format!("{}.caps", caps[0]));
    let mut b = std::fs::read(&p).unwrap();
    let at = b.len() - 9;
    b[at] ^= 0x10;
    std::fs::write(&p, b).unwrap();
    let server = start_with(&m, cfg);
    let c = Client::new(server.addr(), None);
    // Opening reads headers only: the damage shows when a capsule's chain is read (410 for
    // the capsule that found it; those sharing its rows are gone with it: 404).
    let mut found = 0;
    for cap in &caps {
        let r = c.post("/v1/sessions", &json!({"capsule": cap}));
        found += (r.status == 410) as usize;
        assert!(
            r.status == 200 || r.status == 404 || (r.status == 410 && r.code() == "capsule_lost"),
            "{cap}: {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    let alive = caps
        .iter()
        .filter(|cap| c.get(&format!("/v1/capsules/{cap}")).status == 200)
        .count();
    let lost = caps.len() - alive;
    assert!(lost >= 1 && found == 1, "the corrupt file was loaded");
    assert!(
        lost <= flashrt_runtime::store::MAX_CHAIN,
        "one corrupt file lost {lost} capsules (chains are at most {})",
        flashrt_runtime::store::MAX_CHAIN
    );
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(
        !metrics.contains("flashrt_store_corrupt_files_total 0"),
        "{metrics}"
    );
    server.shutdown().unwrap();
}

#[test]
fn only_regular_files_are_read_and_messages_name_no_server_path() {
    let m = lfm2();
    let dir = temp_dir("files");
    let server = start_with(&m, config(Some(&dir), None));
    let c = Client::new(server.addr(), None);
    let files = dir.join("files");
    let sid = session(&c, &[4, 5, 6]);
    let cap = snapshot(&c, &sid);
    // A FIFO: refused at once (opening it would block), the worker keeps serving.
    let fifo = files.join("pipe");
    let cpath = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(cpath.as_ptr(), 0o600) }, 0);
    let t0 = Instant::now();
    let r = c.post("/v1/capsules/import", &json!({"file": "pipe"}));
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(c.get("/v1/sessions").status, 200);
    // A directory.
    std::fs::create_dir(files.join("adir")).unwrap();
    let r = c.post("/v1/capsules/import", &json!({"file": "adir"}));
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("directory")
    );
    // A symbolic link out of the directory, to a real capsule file.
    let outside = dir.join("outside.caps");
    std::fs::write(&outside, c.get(&format!("/v1/capsules/{cap}/file")).body).unwrap();
    std::os::unix::fs::symlink(&outside, files.join("link.caps")).unwrap();
    let r = c.post("/v1/capsules/import", &json!({"file": "link.caps"}));
    assert_eq!(r.status, 400, "{}", String::from_utf8_lossy(&r.body));
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("symbolic link")
    );
    // Export: refuses to overwrite unless asked; never writes through a link.
    c.ok(
        &format!("/v1/capsules/{cap}/export"),
        &json!({"file": "a.caps"}),
    );
    let r = c.post(
        &format!("/v1/capsules/{cap}/export"),
        &json!({"file": "a.caps"}),
    );
    assert_eq!(r.status, 409);
    assert_eq!(r.code(), "file_exists");
    c.ok(
        &format!("/v1/capsules/{cap}/export"),
        &json!({"file": "a.caps", "overwrite": true}),
    );
    let r = c.post(
        &format!("/v1/capsules/{cap}/export"),
        &json!({"file": "link.caps", "overwrite": true}),
    );
    assert_eq!(r.status, 400);
    // No message carries the server's paths.
    let root = dir.display().to_string();
    for (path, body) in [
        ("/v1/capsules/import", json!({"file": "missing.caps"})),
        ("/v1/capsules/import", json!({"file": "pipe"})),
        ("/v1/capsules/import", json!({"file": "link.caps"})),
    ] {
        let r = c.post(path, &body);
        let text = String::from_utf8_lossy(&r.body).into_owned();
        assert!(r.status >= 400 && !text.contains(&root), "{text}");
    }
    std::fs::write(files.join("junk.caps"), b"not a capsule").unwrap();
    let r = c.post("/v1/capsules/import", &json!({"file": "junk.caps"}));
    assert_eq!(r.status, 400);
    assert!(!String::from_utf8_lossy(&r.body).contains(&root));
    server.shutdown().unwrap();
}

#[test]
fn the_openai_surface_refuses_what_it_does_not_do() {
    let m = lfm2();
    let server = start_with(&m, config(None, None));
    let c = Client::new(server.addr(), None);
    let r = c.post(
        "/v1/completions",
        &json!({"model": "nonexistent", "prompt": [5, 6]}),
    );
    assert_eq!((r.status, r.code().as_str()), (404, "model_not_found"));
    let ok = c.post(
        "/v1/completions",
        &json!({"model": m.name(), "prompt": [5, 6], "max_tokens": 1}),
    );
    assert_eq!(ok.status, 200);
    // Penalties outside OpenAI's ranges: a clear 400 naming them.
    for (body, param) in [
        (
            json!({"prompt": [5], "frequency_penalty": 2.5}),
            "frequency_penalty",
        ),
        (
            json!({"prompt": [5], "presence_penalty": -3}),
            "presence_penalty",
        ),
        (
            json!({"prompt": [5], "repetition_penalty": 0}),
            "repetition_penalty",
        ),
    ] {
        let r = c.post("/v1/completions", &body);
        assert_eq!(
            (r.status, r.code().as_str()),
            (400, "invalid_sampler"),
            "{body}"
        );
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(param)
        );
    }
    for (body, param) in [
        (
            json!({"prompt": [5], "logit_bias": {"5": 10}}),
            "logit_bias",
        ),
        (
            json!({"prompt": [5], "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"prompt": [5], "tools": []}), "tools"),
        (json!({"prompt": [5], "mirostat": 2}), "mirostat"),
        (json!({"prompt": [5], "best_of": 3}), "best_of"),
    ] {
        let r = c.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.code(), "unsupported_parameter", "{body}");
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(param),
            "{body}"
        );
    }
    // The no-op values clients send by default are fine.
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": [5], "max_tokens": 1, "frequency_penalty": 0, "presence_penalty": 0,
                "logit_bias": {}, "user": "u1", "n": 1, "stream_options": {"include_usage": true}}),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // A prompt of exactly max_seq tokens leaves no room to generate.
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": tokens(1, m.max_seq(), m.vocab())}),
    );
    assert_eq!(
        (r.status, r.code().as_str()),
        (400, "context_length_exceeded")
    );
    // Ids are 128-bit and random.
    let a = c.ok("/v1/sessions", &json!({}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    let b = c.ok("/v1/sessions", &json!({}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(a.len(), 32);
    assert_ne!(a[..16], b[..16], "ids share a prefix: {a} {b}");
    server.shutdown().unwrap();
}

/// Two tenants from a token file.
fn tenants_config(dir: &Path) -> ServeConfig {
    let file = dir.join("tokens.json");
    std::fs::write(
        &file,
        r#"{"alice": "alice-secret-token", "bob": {"token": "bob-secret-token", "max_sessions": 8}}"#,
    )
    .unwrap();
    let mut cfg = config(Some(dir), None);
    cfg.tokens_file = Some(file);
    cfg
}

#[test]
fn tenants_never_see_each_other() {
    let m = lfm2();
    let v = m.vocab();
    let dir = temp_dir("tenants");
    let server = start_with(&m, tenants_config(&dir));
    let alice = Client::new(server.addr(), Some("alice-secret-token"));
    let bob = Client::new(server.addr(), Some("bob-secret-token"));
    let nobody = Client::new(server.addr(), Some("wrong-token-1234"));
    assert_eq!(nobody.get("/v1/sessions").status, 401);
    assert_eq!(
        Client::new(server.addr(), None).get("/v1/sessions").status,
        401
    );
    let prompt = tokens(3, 20, v);
    let sid = session(&alice, &prompt);
    let cap = snapshot(&alice, &sid);
    // Bob sees nothing of Alice's: not listed, not readable, not usable, not deletable.
    assert_eq!(bob.ok_get("/v1/sessions")["sessions"], json!([]));
    assert_eq!(bob.ok_get("/v1/capsules")["capsules"], json!([]));
    for (method, path) in [
        ("GET", format!("/v1/sessions/{sid}")),
        ("GET", format!("/v1/capsules/{cap}")),
        ("GET", format!("/v1/capsules/{cap}/file")),
        ("DELETE", format!("/v1/capsules/{cap}")),
        ("DELETE", format!("/v1/sessions/{sid}")),
    ] {
        let r = bob.raw(method, &path, "application/json", b"");
        assert_eq!(r.status, 404, "{method} {path}");
    }
    for (path, body) in [
        (
            format!("/v1/sessions/{sid}/generate"),
            json!({"max_tokens": 1}),
        ),
        (format!("/v1/sessions/{sid}/append"), json!({"tokens": [5]})),
        (format!("/v1/sessions/{sid}/fork"), json!({})),
        (format!("/v1/capsules/{cap}/persist"), json!({})),
        (
            format!("/v1/capsules/{cap}/export"),
            json!({"file": "stolen.caps"}),
        ),
        ("/v1/sessions".to_string(), json!({"capsule": cap})),
    ] {
        assert_eq!(bob.post(&path, &body).status, 404, "{path}");
    }
    // Alice's prompts warm only Alice's prefix cache.
    alice.ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 2}),
    );
    let (_, cached) = complete(&bob, &prompt, 2);
    assert_eq!(cached, 0, "bob was served alice's prefix");
    let (_, cached) = complete(&alice, &prompt, 2);
    assert!(cached > 0);
    // Files directories are per tenant.
    alice.ok(
        &format!("/v1/capsules/{cap}/export"),
        &json!({"file": "mine.caps"}),
    );
    assert!(dir.join("files/alice/mine.caps").is_file());
    assert_eq!(
        bob.post("/v1/capsules/import", &json!({"file": "mine.caps"}))
            .status,
        404
    );
    // Bob's session cap (8 in the token file).
    for _ in 0..8 {
        bob.ok("/v1/sessions", &json!({}));
    }
    assert_eq!(bob.post("/v1/sessions", &json!({})).status, 429);
    assert_eq!(alice.post("/v1/sessions", &json!({})).status, 200);
    server.shutdown().unwrap();
}

/// Both tenants run every endpoint at once; each must see only its own objects, no request may
/// fail, and greedy outputs must equal a single-tenant run. `FLASHRT_TENANT_SOAK_SECS` sets the
/// duration (CI: 60).
#[test]
fn two_tenants_at_once_every_endpoint_zero_leaks_zero_errors() {
    let secs: u64 = std::env::var("FLASHRT_TENANT_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let m = lfm2();
    let v = m.vocab();
    // The reference: each workload's greedy tokens on a single-tenant server.
    let reference: Vec<Vec<u32>> = {
        let s = start_with(&m, config(None, None));
        let c = Client::new(s.addr(), None);
        let r = (0..4)
            .map(|i| complete(&c, &tokens(200 + i, 16, v), 5).0)
            .collect();
        s.shutdown().unwrap();
        r
    };
    let dir = temp_dir("soak");
    let server = start_with(&m, tenants_config(&dir));
    let addr = server.addr();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let run = |name: &'static str, token: &'static str, other: &'static str| {
        let reference = reference.clone();
        std::thread::spawn(move || {
            let c = Client::new(addr, Some(token));
            let o = Client::new(addr, Some(other));
            let mut rounds = 0u64;
            let mut mine_caps: Vec<String> = Vec::new();
            while Instant::now() < deadline {
                let i = (rounds % 4) as usize;
                let (got, _) = complete(&c, &tokens(200 + i as u64, 16, v), 5);
                assert_eq!(got, reference[i], "{name}: completion {i} differs");
                let chat = c.post(
                    "/v1/chat/completions",
                    &json!({"messages": [{"role": "user", "content": tokens(9, 4, v)}], "max_tokens": 2}),
                );
                assert_eq!(chat.status, 200, "{name}: chat");
                let sid = c.ok(
                    "/v1/sessions",
                    &json!({"tokens": tokens(300 + i as u64, 10, v)}),
                )["session"]
                    .as_str()
                    .unwrap()
                    .to_string();
                c.ok(
                    &format!("/v1/sessions/{sid}/append"),
                    &json!({"tokens": [7, 8]}),
                );
                c.ok(
                    &format!("/v1/sessions/{sid}/generate"),
                    &json!({"max_tokens": 2}),
                );
                let cap = snapshot(&c, &sid);
                let fork = c.ok(&format!("/v1/sessions/{sid}/fork"), &json!({}))["session"]
                    .as_str()
                    .unwrap()
                    .to_string();
                c.ok(
                    &format!("/v1/sessions/{fork}/restore"),
                    &json!({"capsule": cap}),
                );
                c.ok(
                    &format!("/v1/sessions/{sid}/rollback"),
                    &json!({"capsule": cap}),
                );
                let file = c.get(&format!("/v1/capsules/{cap}/file"));
                assert_eq!(file.status, 200, "{name}: file");
                let imp = c.raw(
                    "POST",
                    "/v1/capsules/import",
                    "application/octet-stream",
                    &file.body,
                );
                assert_eq!(
                    imp.status,
                    200,
                    "{name}: import {}",
                    String::from_utf8_lossy(&imp.body)
                );
                c.ok(
                    &format!("/v1/capsules/{cap}/export"),
                    &json!({"file": format!("{name}.caps"), "overwrite": true}),
                );
                c.ok(
                    "/v1/capsules/import",
                    &json!({"file": format!("{name}.caps")}),
                );
                // Everything listed is ours; the other tenant's ids are unknown to us and ours to it.
                let listed = c.ok_get("/v1/capsules")["capsules"].clone();
                for x in listed.as_array().unwrap() {
                    let id = x["capsule"].as_str().unwrap();
                    assert_eq!(
                        o.get(&format!("/v1/capsules/{id}")).status,
                        404,
                        "{name}: leak of {id}"
                    );
                }
                assert_eq!(
                    o.get(&format!("/v1/sessions/{sid}")).status,
                    404,
                    "{name}: session leak"
                );
                for id in c.ok_get("/v1/sessions")["sessions"].as_array().unwrap() {
                    let id = id["session"].as_str().unwrap();
                    assert_eq!(c.delete(&format!("/v1/sessions/{id}")).status, 200);
                }
                mine_caps.push(cap);
                if mine_caps.len() > 4 {
                    let old = mine_caps.remove(0);
                    let _ = c.delete(&format!("/v1/capsules/{old}"));
                }
                assert_eq!(c.get("/metrics").status, 200);
                rounds += 1;
            }
            rounds
        })
    };
    let a = run("alice", "alice-secret-token", "bob-secret-token");
    let b = run("bob", "bob-secret-token", "alice-secret-token");
    let (ra, rb) = (a.join().expect("alice"), b.join().expect("bob"));
    assert!(ra > 0 && rb > 0);
    let c = Client::new(addr, Some("alice-secret-token"));
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(
        metrics.contains("flashrt_http_server_errors_total 0"),
        "{metrics}"
    );
    eprintln!("soak: {secs} s, alice {ra} rounds, bob {rb} rounds");
    server.shutdown().unwrap();
}
