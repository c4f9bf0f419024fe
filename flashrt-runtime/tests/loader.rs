//! The streaming checkpoint loader: what a fingerprint covers, and that a load keeps the
//! mapped files out of the process's resident set.

mod common;

use common::*;
use flashrt_runtime::backend::{DeviceModel, SourceDtype, WeightSink};
use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::ir::{BufferId, Compiled, Role, compile};
use flashrt_runtime::loader::{Checkpoint, LoadProgress};
use flashrt_runtime::safetensors::{Dtype, TensorOut, serialize};
use flashrt_runtime::{Error, Model};
use std::path::Path;
use std::sync::Arc;

fn opts() -> HfOptions {
    HfOptions {
        // One name whatever the folder is called: the name is part of the fingerprint.
        name: Some("m".into()),
        max_seq: Some(128),
        prefill_buckets: Some(vec![16, 64]),
        ..HfOptions::default()
    }
}

/// Every tensor of every shard of `src` written into one `model.safetensors` in `dst`
/// (config and generation config copied): the same weights, sharded differently.
fn reshard_into_one(src: &Path, dst: &Path) {
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let mut entries = Vec::new();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("model-") && name.ends_with(".safetensors") {
            entries.extend(read_entries(&p));
        }
    }
    assert!(entries.len() > 50, "the fixture's shards hold the model");
    write_entries(&dst.join("model.safetensors"), &entries);
}

#[test]
fn fingerprints_cover_the_weights_not_their_sharding() {
    let src = fixture("qwen35real-public");
    let one = temp_dir("one-shard");
    reshard_into_one(&src, &one);
    let sharded = Model::load_hf_dir(cpu(), &src, &opts()).unwrap();
    let single = Model::load_hf_dir(cpu(), &one, &opts()).unwrap();
    assert_eq!(sharded.weights_digest(), single.weights_digest());
    assert_eq!(sharded.fingerprint(), single.fingerprint());
    // The layout alone gives another fingerprint: the weights are in it.
    let layout_only = compile(sharded.ir(), cpu().target(sharded.ir()));
    assert_ne!(layout_only.fingerprint(), sharded.fingerprint());

    // One element of one tensor changed: another digest, another fingerprint.
    let path = one.join("model.safetensors");
    let mut entries = read_entries(&path);
    let t = entries
        .iter_mut()
        .find(|e| e.0 == "lm_head.weight")
        .unwrap();
    t.3[0] ^= 1;
    write_entries(&path, &entries);
    let edited = Model::load_hf_dir(cpu(), &one, &opts()).unwrap();
    assert_ne!(edited.weights_digest(), single.weights_digest());
    assert_ne!(edited.fingerprint(), single.fingerprint());

    // A capsule of one cannot be restored into the other.
    let mut s = single.session().unwrap();
    s.append(&tokens(3, 9, single.vocab())).unwrap();
    let cap = s.snapshot().unwrap();
    let mut other = edited.session().unwrap();
    match other.restore(&cap) {
        Err(Error::Fingerprint { .. }) => {}
        r => panic!("expected a fingerprint error, got {r:?}"),
    }
}

#[test]
fn random_weight_seeds_are_in_the_fingerprint() {
    let json = std::fs::read_to_string(fixture("lfm2-public").join("config.json")).unwrap();
    let ir = ir_from_hf_config(&json, &opts()).unwrap();
    let a = Model::with_random_weights(cpu(), &ir, 0).unwrap();
    let b = Model::with_random_weights(cpu(), &ir, 0).unwrap();
    let c = Model::with_random_weights(cpu(), &ir, 7).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_ne!(a.fingerprint(), c.fingerprint());
    assert_eq!(a.weights_digest(), "random-seed:0");
}

#[test]
fn every_mismatch_is_named_in_one_error() {
    let dir = copy_fixture("qwen35-public");
    let path = dir.join("model.safetensors");
    let mut entries = read_entries(&path);
    entries.retain(|e| e.0 != "model.norm.weight");
    let t = entries
        .iter_mut()
        .find(|e| e.0 == "model.layers.0.mlp.up_proj.weight")
        .unwrap();
    t.2 = vec![t.2[1], t.2[0]];
    entries.push(("extra.weight".into(), Dtype::F32, vec![2], vec![0; 8]));
    write_entries(&path, &entries);
    let e = Model::load_hf_dir(cpu(), &dir, &opts())
        .unwrap_err()
        .to_string();
    for needle in [
        "missing tensors (1)",
        "model.norm.weight",
        "unexpected tensors (1)",
        "extra.weight",
        "misshaped tensors (1)",
        "model.layers.0.mlp.up_proj.weight",
    ] {
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }
}

/// The `RssFile` line of /proc/self/status, bytes (file-backed pages mapped by this
/// process). `None` where there is no procfs.
fn rss_file() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("RssFile:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// A sink that keeps nothing: it counts elements per buffer and samples the resident
/// file-backed memory at every piece.
struct Probe {
    filled: Vec<usize>,
    peak_rss_file: u64,
}

impl WeightSink for Probe {
    fn put(
        &mut self,
        id: BufferId,
        _first: usize,
        dtype: SourceDtype,
        bytes: &[u8],
    ) -> Result<(), Error> {
        // Touch the bytes as a real sink would copy them.
        let sum: u64 = bytes.iter().step_by(4096).map(|&b| b as u64).sum();
        std::hint::black_box(sum);
        self.filled[id.index()] += bytes.len() / dtype.size();
        if let Some(r) = rss_file() {
            self.peak_rss_file = self.peak_rss_file.max(r);
        }
        Ok(())
    }
    fn finish(self: Box<Self>, _c: Arc<Compiled>) -> Result<Arc<dyn DeviceModel>, Error> {
        unreachable!("the probe is never finished")
    }
}

#[derive(Default)]
struct Counted {
    started: u64,
    advanced: u64,
    shards: Vec<String>,
}

impl LoadProgress for Counted {
    fn start(&mut self, bytes: u64, _shards: usize) {
        self.started = bytes;
    }
    fn shard(&mut self, _index: usize, name: &str) {
        self.shards.push(name.to_string());
    }
    fn advance(&mut self, bytes: u64) {
        self.advanced += bytes;
    }
}

#[test]
fn streaming_a_checkpoint_keeps_its_pages_out_of_the_resident_set() {
    let Some(_) = rss_file() else {
        eprintln!("SKIP: no /proc/self/status RssFile on this system");
        return;
    };
    // The LFM2 fixture's shape with a 1M-token vocabulary: a 256 MiB tied embedding.
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("lfm2-public").join("config.json")).unwrap(),
    )
    .unwrap();
    cfg["vocab_size"] = (1usize << 20).into();
    let ir = ir_from_hf_config(&cfg.to_string(), &opts()).unwrap();
    let compiled = compile(&ir, cpu().target(&ir));
    let dir = temp_dir("big");
    let weights: Vec<(String, Vec<usize>, Vec<u8>)> = compiled
        .layout
        .buffers
        .iter()
        .filter(|b| b.role == Role::Weight)
        .map(|b| {
            (
                b.source.clone().unwrap(),
                b.shape.clone(),
                vec![0u8; b.numel() * 4],
            )
        })
        .collect();
    let outs: Vec<TensorOut> = weights
        .iter()
        .map(|(n, s, d)| TensorOut {
            name: n,
            dtype: Dtype::F32,
            shape: s.clone(),
            data: d,
        })
        .collect();
    std::fs::write(
        dir.join("model.safetensors"),
        serialize(&outs, &Default::default()),
    )
    .unwrap();
    let file_bytes = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len();
    drop(outs);
    drop(weights);
    assert!(file_bytes > 256 << 20);

    let ckpt = Checkpoint::open(&dir).unwrap();
    let base = rss_file().unwrap();
    let mut probe = Probe {
        filled: vec![0; compiled.layout.buffers.len()],
        peak_rss_file: base,
    };
    let mut progress = Counted::default();
    let report = ckpt.load(&compiled, &mut probe, &mut progress).unwrap();
    for b in compiled
        .layout
        .buffers
        .iter()
        .filter(|b| b.role == Role::Weight)
    {
        assert_eq!(probe.filled[b.id.index()], b.numel(), "{}", b.name);
    }
    assert_eq!(report.bytes, progress.started);
    assert_eq!(progress.advanced, progress.started);
    assert_eq!(progress.shards, ["model.safetensors"]);
    let grew = probe.peak_rss_file.saturating_sub(base);
    // Pieces are 32 MiB: at most a piece or two are mapped at a time, never the file.
    assert!(
        grew < 96 << 20,
        "mapped checkpoint pages stayed resident: RssFile grew by {} MiB for a {} MiB file",
        grew >> 20,
        file_bytes >> 20
    );
}
