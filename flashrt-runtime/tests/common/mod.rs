//! Shared helpers of the runtime's integration tests.
#![allow(dead_code)]

pub mod pool;

use flashrt_runtime::ir::hf::HfOptions;
use flashrt_runtime::{Backend, CpuBackend, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Every dense and MoE fixture family (the capsule contract runs on all of them).
pub const FIXTURES: [&str; 6] = [
    "qwen35-public",
    "lfm2-public",
    "nemotronh-public",
    "qwen35moe-public",
    "lfm2moe-public",
    "nemotronhmoe-public",
];

/// The repository's reference fixtures (`tests/fixtures`).
pub fn fixtures_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    assert!(
        dir.join("README.md").is_file(),
        "reference fixtures not found at {} (tests/fixtures of the repository)",
        dir.display()
    );
    dir
}

pub fn fixture(name: &str) -> PathBuf {
    let d = fixtures_dir().join(name);
    assert!(
        d.join("config.json").is_file(),
        "fixture {} is incomplete (no config.json)",
        d.display()
    );
    d
}

pub fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::with_threads(1))
}

/// A fixture model through the HF importer, with small buckets so prompts span several chunks.
pub fn load(name: &str, buckets: &[usize]) -> Model {
    let opts = HfOptions {
        max_seq: Some(256),
        prefill_buckets: Some(buckets.to_vec()),
        ..HfOptions::default()
    };
    Model::load_hf_dir(cpu(), &fixture(name), &opts)
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

/// A scratch directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

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

/// A fresh scratch directory.
pub fn temp_dir(tag: &str) -> TempDir {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "flashrt-rt-test-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

/// Copy a fixture folder into a scratch directory (to corrupt it).
pub fn copy_fixture(name: &str) -> TempDir {
    let src = fixture(name);
    let dst = temp_dir(name);
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    dst
}

/// Deterministic pseudo-random token ids in `[3, vocab)`.
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

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A safetensors file as editable `(name, dtype, shape, bytes)` entries.
pub type Entries = Vec<(
    String,
    flashrt_runtime::safetensors::Dtype,
    Vec<usize>,
    Vec<u8>,
)>;

pub fn read_entries(path: &Path) -> Entries {
    let st = flashrt_runtime::safetensors::SafeTensors::read(path).unwrap();
    st.tensors
        .iter()
        .map(|(n, i)| {
            (
                n.clone(),
                i.dtype.clone(),
                i.shape.clone(),
                st.data(n).unwrap().to_vec(),
            )
        })
        .collect()
}

pub fn write_entries(path: &Path, entries: &Entries) {
    use flashrt_runtime::safetensors::{TensorOut, serialize};
    let outs: Vec<TensorOut> = entries
        .iter()
        .map(|(n, d, s, b)| TensorOut {
            name: n,
            dtype: d.clone(),
            shape: s.clone(),
            data: b,
        })
        .collect();
    std::fs::write(path, serialize(&outs, &Default::default())).unwrap();
}

/// A copy of an FP8 fixture whose FP8 weights are replaced by the bf16 weights they were
/// quantized from (scales removed): the checkpoint a user would quantize while loading.
pub fn unquantized_copy(name: &str) -> TempDir {
    let dir = copy_fixture(name);
    let path = dir.join("model.safetensors");
    let sources = read_entries(&dir.join("fp8_source_weights.safetensors"));
    let mut entries: Entries = read_entries(&path)
        .into_iter()
        .filter(|e| {
            e.1 != flashrt_runtime::safetensors::Dtype::F8E4m3 && !e.0.ends_with("_scale_inv")
        })
        .collect();
    entries.extend(sources);
    write_entries(&path, &entries);
    std::fs::remove_file(dir.join("fp8_source_weights.safetensors")).unwrap();
    dir
}
