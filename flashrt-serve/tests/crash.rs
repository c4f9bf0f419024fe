//! Crash safety: a process killed with SIGKILL while it writes capsule files into a store
//! directory leaves no corrupt capsule behind. A restarted server loads only whole files,
//! cleans up the interrupted write, and the capsules written before are intact.
//!
//! The writer is this test binary itself, re-run as a child process with
//! `FLASHRT_CRASH_CHILD_DIR` set (then the `crash_child` test below writes capsules in a loop
//! until it is killed; in a normal run it does nothing).

mod common;

use common::*;
use flashrt_runtime::{CapsuleStore, Model, StoreConfig};
use serde_json::json;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "FLASHRT_CRASH_CHILD_DIR";

/// LFM2 with a long context, so one capsule file is megabytes and takes a while to write.
fn big_model() -> Model {
    model("lfm2-public", 4096)
}

/// Child mode: fill a session with a long prompt, then store capsule after capsule; with
/// zero memory budgets every capsule goes straight to a file (whole: no KV sharing).
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let m = big_model();
    let cfg = StoreConfig {
        budget_device: 0,
        budget_host: 0,
        budget_disk: u64::MAX,
        dir: Some(dir.into()),
        share_kv: false,
        background: false,
        ..StoreConfig::default()
    };
    let mut store = CapsuleStore::open(m.clone(), cfg).unwrap();
    let mut s = m.session().unwrap();
    s.append(&tokens(99, 3000, m.vocab())).unwrap();
    for t in 0.. {
        s.append(&[3 + (t % 100)]).unwrap();
        store.insert(s.snapshot().unwrap(), None).unwrap();
    }
}

fn scan(dir: &Path) -> (usize, usize) {
    let mut caps = 0;
    let mut tmps = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            tmps += 1;
        } else if name.ends_with(".caps") {
            caps += 1;
        }
    }
    (caps, tmps)
}

#[test]
fn sigkill_while_writing_a_capsule_never_leaves_a_corrupt_one() {
    let m = big_model();
    let v = m.vocab();
    let dir = temp_dir("crash");
    let mut cfg = config(Some(&dir), None);
    cfg.store.budget_disk = u64::MAX;

    // Earlier capsules, persisted through the server, with their continuations.
    let server = start(&m, cfg.clone());
    let c = Client::new(server.addr(), None);
    let mut earlier = Vec::new();
    let sid = c.ok("/v1/sessions", &json!({"tokens": tokens(1, 50, v)}))["session"]
        .as_str()
        .unwrap()
        .to_string();
    for i in 0..3 {
        c.ok(
            &format!("/v1/sessions/{sid}/append"),
            &json!({"tokens": tokens(10 + i, 20, v)}),
        );
        let cap = c.ok(
            &format!("/v1/sessions/{sid}/snapshot"),
            &json!({"persist": true}),
        )["capsule"]
            .as_str()
            .unwrap()
            .to_string();
        let f = c.ok("/v1/sessions", &json!({"capsule": cap}))["session"]
            .as_str()
            .unwrap()
            .to_string();
        let cont = ids(&c.ok(
            &format!("/v1/sessions/{f}/generate"),
            &json!({"max_tokens": 6}),
        )["tokens"]);
        earlier.push((cap, cont));
    }
    server.shutdown().unwrap();

    // A child process writes capsules into the same directory; kill -9 it mid-write.
    let exe = std::env::current_exe().unwrap();
    let mut mid_write = 0;
    for attempt in 0..3 {
        let (before, _) = scan(&dir);
        let mut child = Command::new(&exe)
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &*dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let (caps, tmps) = scan(&dir);
            // At least one whole file from this child, and another one being written now.
            if caps > before + attempt && tmps > 0 {
                child.kill().unwrap(); // SIGKILL
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the writer exited on its own: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "the writer wrote nothing in time"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        child.wait().unwrap();
        if scan(&dir).1 > 0 {
            mid_write += 1;
        }
    }
    eprintln!("{mid_write} of 3 kills landed while a capsule file was being written");
    assert!(
        mid_write > 0,
        "no kill landed while a file was being written"
    );

    // Restart: only whole capsules load, the interrupted writes are gone, nothing is corrupt.
    let server = start(&m, cfg);
    let c = Client::new(server.addr(), None);
    assert_eq!(scan(&dir).1, 0, "temporary files survived the restart");
    let list = c.ok_get("/v1/capsules");
    let all: Vec<String> = list["capsules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["capsule"].as_str().unwrap().to_string())
        .collect();
    assert!(all.len() >= earlier.len() + 3, "{} capsules", all.len());
    for (cap, cont) in &earlier {
        assert!(all.contains(cap), "earlier capsule {cap} lost");
        let f = c.ok("/v1/sessions", &json!({"capsule": cap}))["session"]
            .as_str()
            .unwrap()
            .to_string();
        let got = ids(&c.ok(
            &format!("/v1/sessions/{f}/generate"),
            &json!({"max_tokens": 6}),
        )["tokens"]);
        assert_eq!(&got, cont, "earlier capsule {cap} changed");
        c.delete(&format!("/v1/sessions/{f}"));
    }
    // Every capsule the killed writer completed is whole and restores.
    for cap in all.iter().filter(|x| !earlier.iter().any(|(e, _)| e == *x)) {
        let r = c.post("/v1/sessions", &json!({"capsule": cap}));
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        c.delete(&format!(
            "/v1/sessions/{}",
            r.json()["session"].as_str().unwrap()
        ));
    }
    let metrics = String::from_utf8(c.get("/metrics").body).unwrap();
    assert!(
        metrics.contains("flashrt_store_corrupt_files_total 0"),
        "a corrupt file was found"
    );
    server.shutdown().unwrap();
}
