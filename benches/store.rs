//! What a capsule leaving the device tier costs the thread that owns the store (a server's
//! worker, which steps every stream): the insertion that evicts it, with the demotion on that
//! thread (`background: false`) and on threads of its own (`background: true`, what
//! `flashrt serve` does: then also the `poll`s that apply the finished jobs), and how long
//! it takes to land: on the host, and with a store directory and no host budget, on disk (its
//! file written and fsynced in the system's temporary directory); then a restore from the host
//! tier (a capsule stored whole, one chained to it; into a session holding other rows, and
//! into one holding the capsule's KV rows already), and what opening a store directory of
//! such files costs.
//!
//! The capsules have the 27B shape's KV bytes per token (16 attention layers x 2 x 4 KV heads
//! x 256 x bf16 = 64 KiB; here 2 KV heads in f32, the CPU backend's state dtype) at 8k and
//! 16k tokens: a conversation's capsule B at 16k extends capsule A at 8k, so demoting B hashes
//! its KV rows whole and at A's position (KV sharing), as a served conversation does. The
//! capsules are made by restoring random state bytes into a CPU session and snapshotting it
//! (no prefill), so the CPU backend's "device" copy stands in for device memory: the figures
//! are the host side of a demotion (copy + hashing), not a PCIe transfer.
//!
//! ```sh
//! cargo bench --bench store                       # 16k tokens, 5 runs
//! cargo bench --bench store -- --json out.json    # also write the figures as JSON
//! ```

use flashrt::runtime::{
    Capsule, CapsuleMeta, CapsuleStore, CpuBackend, HostSaved, LogitsRow, Model, StoreConfig,
};
use std::sync::Arc;
use std::time::Instant;

const TOML: &str = r#"
[model]
name = "store_bench"
vocab = 512
hidden = 64
dtype = "f32"
max_seq = 16448
prefill_buckets = [16]
norm = { kind = "rms", eps = 1e-6 }
weights = "qwen3_5_text"

[kinds.attention]
mixer = { kind = "attention", q_heads = 2, kv_heads = 2, head_dim = 256, rope = "none" }
mlp = { kind = "swiglu", intermediate = 64 }

[stack]
repeat = 16
pattern = ["attention"]
"#;

/// A device-tier (CPU-saved) capsule at `tokens.len()` whose KV rows are `rows(seed, row)`:
/// equal seeds give equal rows, so a capsule made from a prefix of another's tokens with the
/// same seed shares its first rows.
fn capsule(m: &Model, tokens: &[u32], seed: u64) -> Capsule {
    let layout = &m.compiled().layout;
    let pos = tokens.len();
    let regions = layout
        .state_buffers()
        .map(|b| {
            let n = b.used_bytes(pos);
            let per = b.bytes_per_token().max(1);
            let mut v = vec![0u8; n];
            for (row, chunk) in v.chunks_mut(per).enumerate() {
                let mut x = seed ^ (row as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b.id.0 as u64;
                for w in chunk.chunks_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let bytes = (x & 0x3f3f_3f3f_3f3f_3f3f).to_le_bytes();
                    w.copy_from_slice(&bytes[..w.len()]);
                }
            }
            (b.id, v)
        })
        .collect();
    let saved = HostSaved::new(layout, pos, regions).expect("host state");
    let meta = CapsuleMeta {
        model: m.name().to_string(),
        fingerprint: m.fingerprint().to_string(),
        pos,
        pending: None,
        tokens: tokens.to_vec(),
        sampler: Default::default(),
        counters: Default::default(),
        last_logits: Some(LogitsRow(vec![0.0; m.vocab()].into())),
    };
    let host = Capsule::from_parts(meta, Arc::new(saved), m.compiled().clone()).expect("capsule");
    // Through a session: the store keeps what the backend saved on its "device" tier.
    let mut s = m.session().expect("session");
    s.restore(&host).expect("restore");
    s.snapshot().expect("snapshot")
}

struct Run {
    /// The insertion that evicts B (A already demoted), on the store's thread.
    insert_ms: f64,
    /// Background: the `poll` that applies B's finished demotion, on the store's thread.
    apply_ms: f64,
    /// From that insertion's start until B's demotion has landed (`settle`).
    landed_ms: f64,
}

/// `dir`: a store directory and no host budget, so every capsule leaving the device goes on to
/// disk (its file written and fsynced) as well.
fn run(
    m: &Model,
    background: bool,
    dir: Option<&std::path::Path>,
    a: &Capsule,
    b: &Capsule,
    x: &Capsule,
) -> Run {
    let budget = (b.bytes() + m.vocab() * 4) as u64;
    if let Some(d) = dir {
        let _ = std::fs::remove_dir_all(d);
    }
    let cfg = StoreConfig {
        budget_device: budget,
        budget_host: if dir.is_some() { 0 } else { 1 << 40 },
        budget_disk: 1 << 40,
        dir: dir.map(|d| d.to_path_buf()),
        share_kv: true,
        background,
        ..StoreConfig::default()
    };
    let mut store = CapsuleStore::open(m.clone(), cfg).expect("store");
    store.insert(a.clone(), None).expect("insert A");
    // B does not fit beside A: A goes down (nothing to share with).
    store.insert(b.clone(), None).expect("insert B");
    store.settle().expect("settle");
    // X does not fit beside B: B goes down, sharing A's rows.
    let t0 = Instant::now();
    store.insert(x.clone(), None).expect("insert X");
    let insert_ms = t0.elapsed().as_secs_f64() * 1e3;
    // What a server's worker does between steps: poll until the demotion has landed.
    let mut apply_ms = 0.0;
    while store.busy() {
        let t = Instant::now();
        if store.poll().expect("poll") > 0 {
            apply_ms += t.elapsed().as_secs_f64() * 1e3;
        } else {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
    let landed_ms = t0.elapsed().as_secs_f64() * 1e3;
    let st = store.stats();
    assert_eq!(st.evictions[0], 2, "{st:?}");
    assert!(st.shared_bytes > 0, "B did not share A's rows: {st:?}");
    assert_eq!(st.evictions[1], if dir.is_some() { 2 } else { 0 }, "{st:?}");
    Run {
        insert_ms,
        apply_ms,
        landed_ms,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    let ir = flashrt::compiler::model_from_toml(TOML, "benches/store.rs").expect("model");
    let m = Model::with_random_weights(Arc::new(CpuBackend::new()), &ir, 1).expect("model");
    let (half, full) = (8192usize, 16384usize);
    let toks: Vec<u32> = (0..full as u32).map(|i| i % 500).collect();
    let other: Vec<u32> = (0..full as u32).map(|i| (i * 7 + 3) % 500).collect();
    let a = capsule(&m, &toks[..half], 1);
    let b = capsule(&m, &toks, 1);
    let x = capsule(&m, &other, 2);
    let kv_per_token = m
        .compiled()
        .layout
        .state_buffers()
        .filter(|b| b.state.is_some_and(|k| k.per_token()))
        .map(|b| b.bytes_per_token())
        .sum::<usize>();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "capsules: A {half} tokens, B {full} tokens ({:.2} GiB, {} KiB of KV per token); {cores} cores",
        b.bytes() as f64 / (1u64 << 30) as f64,
        kv_per_token / 1024
    );
    let runs = 5;
    let mut out = serde_json::Map::new();
    let tmp = std::env::temp_dir().join(format!("flashrt-store-bench-{}", std::process::id()));
    for (case, dir) in [("to_host", None), ("to_disk", Some(tmp.as_path()))] {
        println!(
            "{:<20} {:>22} {:>22} {:>24}",
            if dir.is_some() {
                "B: device -> disk"
            } else {
                "B: device -> host"
            },
            "insert (thread held)",
            "apply (thread held)",
            "until B has landed"
        );
        for background in [false, true] {
            // One run to warm the allocator, then the measured ones.
            let _ = run(&m, background, dir, &a, &b, &x);
            let rs: Vec<Run> = (0..runs)
                .map(|_| run(&m, background, dir, &a, &b, &x))
                .collect();
            let ins = median(rs.iter().map(|r| r.insert_ms).collect());
            let apply = median(rs.iter().map(|r| r.apply_ms).collect());
            let landed = median(rs.iter().map(|r| r.landed_ms).collect());
            let name = if background {
                "background thread"
            } else {
                "store's thread"
            };
            println!("{name:<20} {ins:>19.2} ms {apply:>19.2} ms {landed:>21.2} ms");
            out.insert(
                format!(
                    "{case}/{}",
                    if background {
                        "background"
                    } else {
                        "on_thread"
                    }
                ),
                serde_json::json!({
                    "insert_ms_median": ins,
                    "apply_ms_median": apply,
                    "landed_ms_median": landed,
                    "insert_ms": rs.iter().map(|r| r.insert_ms).collect::<Vec<_>>(),
                    "apply_ms": rs.iter().map(|r| r.apply_ms).collect::<Vec<_>>(),
                    "landed_ms": rs.iter().map(|r| r.landed_ms).collect::<Vec<_>>(),
                }),
            );
        }
    }
    // Restoring from the host tier: A (stored whole) and B (its rows past A's, chained to it),
    // into a session, as a completion whose prefix was demoted does.
    {
        let cfg = StoreConfig {
            budget_device: 0,
            budget_host: 1 << 40,
            budget_disk: 0,
            dir: None,
            share_kv: true,
            background: false,
            ..StoreConfig::default()
        };
        let mut store = CapsuleStore::open(m.clone(), cfg).expect("store");
        let ia = store.insert(a.clone(), None).expect("insert A");
        let ib = store.insert(b.clone(), None).expect("insert B");
        assert_eq!(
            store.info(&ib).expect("B").base.as_deref(),
            Some(ia.as_str())
        );
        let mut s = m.session().expect("session");
        let mut row = serde_json::Map::new();
        for (name, id) in [("A (whole)", &ia), ("B (chained to A)", &ib)] {
            let _ = store.restore_into(id, &mut s).expect("warm-up");
            // Into a session holding other rows (reset first: every row is copied), and into
            // the one that restored it last (its KV rows held: only the rest is copied).
            for (how, reset) in [("", true), (", rows held", false)] {
                let ms: Vec<f64> = (0..runs)
                    .map(|_| {
                        if reset {
                            s.reset().expect("reset");
                        }
                        let t = Instant::now();
                        let info = store.restore_into(id, &mut s).expect("restore");
                        assert_eq!(info.tier, flashrt::runtime::Tier::Host);
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect();
                let med = median(ms.clone());
                println!(
                    "restore of {name} from the host tier{how}: {med:.1} ms (median of {runs})"
                );
                row.insert(
                    format!("{name}{how}"),
                    serde_json::json!({"ms_median": med, "ms": ms}),
                );
            }
        }
        out.insert("restore_from_host".into(), serde_json::Value::Object(row));
    }
    // Opening a store directory: each file's header, metadata and table (what `open` reads)
    // against every byte of it verified (what `open` read before 2026-12-05). The files were
    // just written, so both read from the page cache: a cold disk makes the second slower.
    let _ = std::fs::remove_dir_all(&tmp);
    {
        let cfg = StoreConfig {
            budget_device: 0,
            budget_host: 0,
            budget_disk: 1 << 40,
            dir: Some(tmp.clone()),
            share_kv: false,
            background: false,
            ..StoreConfig::default()
        };
        let mut store = CapsuleStore::open(m.clone(), cfg.clone()).expect("store");
        for c in [&a, &b, &x] {
            store.insert(c.clone(), None).expect("insert");
        }
        drop(store);
        let files: Vec<std::path::PathBuf> = std::fs::read_dir(&tmp)
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .collect();
        let bytes: u64 = files
            .iter()
            .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
            .sum();
        let t = Instant::now();
        let store = CapsuleStore::open(m.clone(), cfg).expect("reopen");
        let open_ms = t.elapsed().as_secs_f64() * 1e3;
        assert_eq!(store.ids().len(), 3);
        let t = Instant::now();
        for f in &files {
            flashrt::runtime::capsule_file::read_file(f, m.compiled()).expect("read");
        }
        let verify_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "opening a store of {} capsule files ({:.2} GiB): {open_ms:.2} ms (headers); reading and verifying every byte {verify_ms:.0} ms",
            files.len(),
            bytes as f64 / (1u64 << 30) as f64
        );
        out.insert(
            "open".into(),
            serde_json::json!({"files": files.len(), "bytes": bytes, "open_ms": open_ms, "verify_every_byte_ms": verify_ms}),
        );
    }
    let _ = std::fs::remove_dir_all(&tmp);
    if let Some(path) = json {
        let doc = serde_json::json!({
            "bench": "store demotion",
            "capsule_tokens": full,
            "capsule_bytes": b.bytes(),
            "kv_bytes_per_token": kv_per_token,
            "cores": cores,
            "runs": runs,
            "results": out,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).expect("write json");
        println!("wrote {path}");
    }
}
