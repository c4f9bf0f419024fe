//! Weights from Hugging Face checkpoint folders, streamed into a backend.
//!
//! A [`Checkpoint`] maps every shard of a folder (the ones `model.safetensors.index.json`
//! names, else `model*.safetensors`) and parses their headers with the `safetensors` crate;
//! no tensor data is read yet. [`Checkpoint::resolve`] matches every weight buffer of a
//! compiled layout with the tensor its `source` names (Hugging Face names, with the aliases
//! real checkpoints use) and reports everything that does not fit in **one** error: missing
//! tensors, unexpected tensors, shapes that do not match, unsupported dtypes, duplicates across
//! shards. Known extras are skipped and said so once in the log: the vision tower of
//! multimodal checkpoints (`model.visual.*`), an `mtp.*` head the model does not declare,
//! `lm_head.weight` of a tied model, and stored rotary `inv_freq` buffers.
//!
//! [`Checkpoint::load`] then streams the matched tensors, shard by shard in file order, into a
//! [`WeightSink`] the backend owns, in their stored dtype (the sink converts where the model's
//! dtype differs). It copies each shard sequentially out of its memory map while a read-ahead
//! thread reads the same file ranges a window ahead with large sequential reads (what `dd`
//! does), so the disk never waits for the copy and the copy rarely waits for the disk; each
//! piece's pages are dropped from the process once the sink has it ([`SafeTensors::release`]):
//! resident memory stays at the backend's staging buffers whatever the checkpoint's size (the
//! read-ahead fills the page cache, not the process). On the way it hashes every tensor (name, dtype, shape, data; XXH3, on
//! a second thread while the sink copies) into the weights digest a loaded model's fingerprint
//! covers, and reports progress (bytes, rate, shard) to a [`LoadProgress`].

use crate::backend::{SourceDtype, WeightSink};
use crate::error::{Error, Result};
use crate::safetensors::SafeTensors;
use flashrt_ir::{BufferId, Compiled, Role};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;
use xxhash_rust::xxh3::{Xxh3, xxh3_128};

/// Bytes handed to the sink per call (and released per step).
const PIECE: usize = 32 << 20;
/// How far ahead of the copy the read-ahead thread reads.
const READ_AHEAD: u64 = 1 << 30;
/// Bytes per read of the read-ahead thread.
const READ_BLOCK: usize = 8 << 20;

/// The safetensors files of a checkpoint folder: the shards named in
/// `model.safetensors.index.json` if present, else every `model*.safetensors`, else every
/// `*.safetensors` (so reference/state dumps beside a checkpoint are not taken for weights).
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let io = |e: std::io::Error| Error::Io {
        path: dir.display().to_string(),
        source: e,
    };
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::Io {
            path: index.display().to_string(),
            source: e,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Checkpoint(format!("{}: not valid JSON: {e}", index.display())))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                Error::Checkpoint(format!("{}: no `weight_map` object", index.display()))
            })?;
        let mut files = BTreeSet::new();
        for (k, f) in map {
            let f = f.as_str().ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{}: weight_map[{k}] is not a string",
                    index.display()
                ))
            })?;
            if f.contains('/') || f.contains('\\') || f.contains("..") {
                return Err(Error::Checkpoint(format!(
                    "{}: shard name `{f}` is not a plain file name",
                    index.display()
                )));
            }
            files.insert(dir.join(f));
        }
        return Ok(files.into_iter().collect());
    }
    let mut all = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io)? {
        let p = e.map_err(io)?.path();
        if p.extension().is_some_and(|x| x == "safetensors") && p.is_file() {
            all.push(p);
        }
    }
    all.sort();
    let model: Vec<PathBuf> = all
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model"))
        })
        .cloned()
        .collect();
    let files = if model.is_empty() { all } else { model };
    if files.is_empty() {
        return Err(Error::Checkpoint(format!(
            "no *.safetensors file in {}",
            dir.display()
        )));
    }
    Ok(files)
}

/// Checkpoint tensors that are skipped (not an error) when no buffer uses them, and the group
/// they are reported under.
fn skipped_group(name: &str, tied: bool) -> Option<&'static str> {
    if name.starts_with("model.visual.") || name.starts_with("visual.") {
        Some("vision tower (model.visual.*): flashrt serves the text model")
    } else if name.starts_with("mtp.") || name.starts_with("model.mtp.") {
        Some("MTP head (mtp.*): the model declares no [mtp] section")
    } else if name.ends_with(".rotary_emb.inv_freq") {
        Some("stored rotary inv_freq buffers (recomputed)")
    } else if tied && name == "lm_head.weight" {
        Some("lm_head.weight of a tied model (the embedding is used)")
    } else {
        None
    }
}

/// Other names a source tensor may carry in real checkpoints.
fn alternatives(source: &str) -> Vec<String> {
    let mut v = vec![source.to_string()];
    if let Some(rest) = source.strip_prefix("model.") {
        v.push(format!("model.language_model.{rest}"));
    }
    if let Some(rest) = source.strip_prefix("backbone.") {
        v.push(format!("model.{rest}"));
    }
    v
}

/// A checkpoint folder: every shard mapped, every header parsed.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<SafeTensors>,
    /// Tensor name -> shard index.
    index: BTreeMap<String, usize>,
    duplicates: Vec<String>,
}

/// One weight buffer matched with its checkpoint tensor.
#[derive(Clone, Debug)]
pub struct Matched {
    pub buffer: BufferId,
    pub name: String,
    pub shard: usize,
    pub dtype: SourceDtype,
    pub start: usize,
    pub end: usize,
    pub shape: Vec<usize>,
    /// Element of the buffer the tensor's first element goes to (non-zero for the pieces of
    /// a stacked weight).
    pub first: usize,
}

/// What [`Checkpoint::load`] did.
#[derive(Clone, Debug)]
pub struct LoadReport {
    /// Bytes of tensor data streamed into the sink.
    pub bytes: u64,
    pub tensors: usize,
    pub seconds: f64,
    /// Hex XXH3-128 digest over every loaded tensor's name, dtype, shape and data.
    pub digest: String,
    /// Checkpoint tensors left out, by group.
    pub skipped: Vec<Skipped>,
}

/// Checkpoint tensors a model does not use and the loader leaves out without an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// What they are and why they are left out.
    pub group: String,
    pub tensors: usize,
    pub bytes: u64,
}

/// Progress of a long load. Every method has an empty default.
pub trait LoadProgress {
    /// Loading starts: `bytes` of tensor data in `shards` files.
    fn start(&mut self, bytes: u64, shards: usize) {
        let _ = (bytes, shards);
    }
    /// Shard `index` (0-based) of the folder, `name`, is being read.
    fn shard(&mut self, index: usize, name: &str) {
        let _ = (index, name);
    }
    /// `bytes` more have reached the backend.
    fn advance(&mut self, bytes: u64) {
        let _ = bytes;
    }
    fn finish(&mut self, report: &LoadReport) {
        let _ = report;
    }
}

/// No progress output.
pub struct Silent;
impl LoadProgress for Silent {}

/// A progress bar on standard error (bytes, rate, time left, the shard being read) when it is
/// a terminal, and one log line at the end either way.
pub struct TerminalProgress {
    bar: indicatif::ProgressBar,
    shards: usize,
}

impl TerminalProgress {
    pub fn new() -> Self {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stderr_with_hz(8),
        );
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        TerminalProgress { bar, shards: 0 }
    }
}

impl Default for TerminalProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl LoadProgress for TerminalProgress {
    fn start(&mut self, bytes: u64, shards: usize) {
        self.shards = shards;
        self.bar.set_length(bytes);
    }
    fn shard(&mut self, index: usize, name: &str) {
        self.bar
            .set_message(format!("loading {name} ({}/{})", index + 1, self.shards));
    }
    fn advance(&mut self, bytes: u64) {
        self.bar.inc(bytes);
    }
    fn finish(&mut self, r: &LoadReport) {
        self.bar.finish_and_clear();
        tracing::info!(
            "loaded {} tensors, {:.2} GB in {:.1} s ({:.2} GB/s)",
            r.tensors,
            r.bytes as f64 / 1e9,
            r.seconds,
            r.bytes as f64 / 1e9 / r.seconds.max(1e-9)
        );
    }
}

/// Shapes agree if they hold the same elements in the same order: equal after dropping
/// size-1 dims (a depthwise conv stored `[C, 1, K]` fills a `[C, K]` buffer).
fn same_shape(a: &[usize], b: &[usize]) -> bool {
    let sq = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
    a.iter().product::<usize>() == b.iter().product::<usize>() && sq(a) == sq(b)
}

/// The read-ahead thread's side of [`Checkpoint::load`]: it reads the file ranges the copy
/// will want, in order, at most [`READ_AHEAD`] bytes ahead of it, into a scratch buffer (the
/// point is the page cache it fills). Read errors are left to the copy, which meets them
/// through the map and reports them.
#[derive(Default)]
struct ReadAhead {
    consumed: std::sync::atomic::AtomicU64,
    stopped: std::sync::atomic::AtomicBool,
}

impl ReadAhead {
    fn consumed(&self, bytes: usize) {
        self.consumed
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Release);
    }

    fn stop(&self) {
        self.stopped
            .store(true, std::sync::atomic::Ordering::Release);
    }

    #[cfg(unix)]
    fn run(&self, plan: &[(Option<&Path>, std::ops::Range<usize>)]) {
        use std::os::unix::fs::FileExt;
        use std::sync::atomic::Ordering;
        let mut buf = vec![0u8; READ_BLOCK];
        let mut open: Option<(&Path, std::fs::File)> = None;
        let mut read = 0u64;
        for (path, range) in plan {
            let Some(path) = path else {
                continue;
            };
            if open.as_ref().is_none_or(|(p, _)| p != path) {
                match std::fs::File::open(path) {
                    Ok(f) => open = Some((path, f)),
                    Err(_) => return,
                }
            }
            let file = &open.as_ref().expect("opened above").1;
            let mut at = range.start;
            while at < range.end {
                while read > self.consumed.load(Ordering::Acquire) + READ_AHEAD {
                    if self.stopped.load(Ordering::Acquire) {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                if self.stopped.load(Ordering::Acquire) {
                    return;
                }
                let n = READ_BLOCK.min(range.end - at);
                match file.read_at(&mut buf[..n], at as u64) {
                    Ok(0) | Err(_) => return,
                    Ok(k) => {
                        at += k;
                        read += k as u64;
                    }
                }
            }
        }
    }

    #[cfg(not(unix))]
    fn run(&self, _plan: &[(Option<&Path>, std::ops::Range<usize>)]) {}
}

impl Checkpoint {
    /// Map the folder's shards and parse their headers.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let files = checkpoint_files(dir)?;
        let mut shards = Vec::with_capacity(files.len());
        for f in &files {
            shards.push(SafeTensors::open(f)?);
        }
        Ok(Checkpoint::from_shards(dir, shards))
    }

    /// A checkpoint over already-parsed files (tests).
    pub fn from_shards(dir: &Path, shards: Vec<SafeTensors>) -> Checkpoint {
        let mut index = BTreeMap::new();
        let mut duplicates = Vec::new();
        for (i, s) in shards.iter().enumerate() {
            for name in s.tensors.keys() {
                if let Some(prev) = index.insert(name.clone(), i) {
                    duplicates.push(format!(
                        "{name} (in {} and {})",
                        shards[prev].origin, s.origin
                    ));
                }
            }
        }
        Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            index,
            duplicates,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Total bytes of the shard files.
    pub fn file_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.len() as u64).sum()
    }

    /// Every tensor name of the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The shard and header entry of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<(&SafeTensors, &crate::safetensors::TensorInfo)> {
        let &i = self.index.get(name)?;
        Some((&self.shards[i], &self.shards[i].tensors[name]))
    }

    /// Match every weight buffer of `compiled` with its tensor; one error lists every
    /// mismatch. Also returns what is skipped, by group.
    pub fn resolve(&self, compiled: &Compiled) -> Result<(Vec<Matched>, Vec<Skipped>)> {
        let layout = &compiled.layout;
        let mut used: BTreeSet<&str> = BTreeSet::new();
        let mut missing = Vec::new();
        let mut misshaped = Vec::new();
        let mut bad_dtype = Vec::new();
        let mut matched = Vec::new();
        // Scale buffers after the weights: a weight stored in FP8 needs its scales from the
        // checkpoint, one stored as floats gets them computed when it is quantized.
        let scale_of: BTreeMap<BufferId, &flashrt_ir::Buffer> = layout
            .buffers
            .iter()
            .filter_map(|b| b.quant.map(|q| (q.scale, b)))
            .collect();
        let mut weights: Vec<&flashrt_ir::Buffer> = layout
            .buffers
            .iter()
            .filter(|b| b.role == Role::Weight)
            .collect();
        weights.sort_by_key(|b| scale_of.contains_key(&b.id));
        // Per quantized weight: whether its tensors are FP8 codes.
        let mut stored_fp8: BTreeMap<BufferId, bool> = BTreeMap::new();
        for b in weights {
            if let Some(w) = scale_of.get(&b.id)
                && stored_fp8.get(&w.id) != Some(&true)
            {
                // Floats (quantized while loading) or missing (reported with the weight).
                continue;
            }
            let Some(source) = &b.source else {
                missing.push(format!(
                    "{} (layout buffer without a checkpoint name)",
                    b.name
                ));
                continue;
            };
            let find = |source: &str| {
                alternatives(source)
                    .into_iter()
                    .find_map(|n| self.index.get_key_value(n.as_str()).map(|(k, &i)| (k, i)))
            };
            // The whole tensor, else (experts stored one tensor each) its pieces end to end.
            let parts: Vec<(&String, usize, &[usize], usize)> = match (find(source), &b.pieces) {
                (Some((name, shard)), _) => vec![(name, shard, &b.shape[..], 0)],
                (None, Some(p)) => {
                    let found: Vec<_> = p.names.iter().map(|n| find(n)).collect();
                    let absent: Vec<&String> = p
                        .names
                        .iter()
                        .zip(&found)
                        .filter(|(_, f)| f.is_none())
                        .map(|(n, _)| n)
                        .collect();
                    if !absent.is_empty() {
                        missing.push(if absent.len() == p.names.len() {
                            format!(
                                "{source} (or its {} per-expert pieces {}, ...)",
                                p.names.len(),
                                p.names[0]
                            )
                        } else {
                            format!(
                                "{} of the {} pieces of {source}, e.g. {}",
                                absent.len(),
                                p.names.len(),
                                absent[0]
                            )
                        });
                        continue;
                    }
                    let per = p.shape.iter().product::<usize>();
                    found
                        .into_iter()
                        .flatten()
                        .enumerate()
                        .map(|(j, (name, shard))| (name, shard, &p.shape[..], j * per))
                        .collect()
                }
                (None, None) => {
                    missing.push(source.clone());
                    continue;
                }
            };
            for (name, shard, shape, first) in parts {
                used.insert(name);
                let info = &self.shards[shard].tensors[name];
                if !same_shape(&info.shape, shape) {
                    misshaped.push(format!(
                        "{name}: checkpoint {:?}, model expects {:?}",
                        info.shape, shape
                    ));
                    continue;
                }
                let Some(dtype) = info.dtype.source() else {
                    bad_dtype.push(format!("{name}: {}", info.dtype.name()));
                    continue;
                };
                let fp8 = dtype == SourceDtype::F8E4m3;
                if fp8 && b.quant.is_none() {
                    bad_dtype.push(format!(
                        "{name}: F8_E4M3, but the model does not quantize `{}` (a checkpoint \
                         with FP8 weights needs its quantization_config, or `quantize` in a \
                         TOML model)",
                        b.name
                    ));
                    continue;
                }
                if b.quant.is_some() {
                    *stored_fp8.entry(b.id).or_insert(fp8) &= fp8;
                }
                matched.push(Matched {
                    buffer: b.id,
                    name: name.clone(),
                    shard,
                    dtype,
                    start: info.start,
                    end: info.end,
                    shape: info.shape.clone(),
                    first,
                });
            }
        }
        let tied = compiled.ir.tied_embeddings;
        let mut unexpected = Vec::new();
        let mut skipped: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
        for (n, &i) in &self.index {
            if used.contains(n.as_str()) {
                continue;
            }
            match skipped_group(n, tied) {
                Some(g) => {
                    let t = &self.shards[i].tensors[n];
                    let e = skipped.entry(g).or_default();
                    e.0 += 1;
                    e.1 += (t.end - t.start) as u64;
                }
                None => unexpected.push(n.clone()),
            }
        }
        let skipped = skipped
            .into_iter()
            .map(|(g, (tensors, bytes))| Skipped {
                group: g.to_string(),
                tensors,
                bytes,
            })
            .collect();
        if missing.is_empty()
            && misshaped.is_empty()
            && unexpected.is_empty()
            && bad_dtype.is_empty()
            && self.duplicates.is_empty()
        {
            return Ok((matched, skipped));
        }
        let mut msg = format!(
            "checkpoint {} does not match model `{}`:",
            self.dir.display(),
            compiled.ir.name
        );
        let mut section = |title: &str, items: &[String]| {
            if !items.is_empty() {
                msg.push_str(&format!("\n  {title} ({}):", items.len()));
                for it in items {
                    msg.push_str(&format!("\n    {it}"));
                }
            }
        };
        section("missing tensors", &missing);
        section("unexpected tensors", &unexpected);
        section("misshaped tensors", &misshaped);
        section("unsupported dtypes", &bad_dtype);
        section("duplicate tensors", &self.duplicates);
        Err(Error::Checkpoint(msg))
    }

    /// Stream every weight of `compiled` into `sink` (see the module docs). Does not call
    /// [`WeightSink::finish`]: the caller does, with the fingerprint the digest gives.
    pub fn load(
        &self,
        compiled: &Compiled,
        sink: &mut dyn WeightSink,
        progress: &mut dyn LoadProgress,
    ) -> Result<LoadReport> {
        let t0 = Instant::now();
        let (mut matched, skipped) = self.resolve(compiled)?;
        for k in &skipped {
            tracing::info!(
                "skipping {} checkpoint tensors ({:.1} MB): {}",
                k.tensors,
                k.bytes as f64 / 1e6,
                k.group
            );
        }
        // File order: each shard is read front to back, once.
        matched.sort_by_key(|m| (m.shard, m.start));
        let total: u64 = matched.iter().map(|m| (m.end - m.start) as u64).sum();
        progress.start(total, self.shards.len());
        // Every piece, in read order: (matched index, byte range in its shard).
        let mut pieces = Vec::new();
        for (i, m) in matched.iter().enumerate() {
            let step = PIECE / m.dtype.size() * m.dtype.size();
            let mut at = m.start;
            while at < m.end || (at == m.end && m.start == m.end) {
                let end = (at + step).min(m.end);
                pieces.push((i, at..end));
                if end == m.end {
                    break;
                }
                at = end;
            }
        }
        let plan: Vec<(Option<&Path>, std::ops::Range<usize>)> = pieces
            .iter()
            .map(|(i, r)| (self.shards[matched[*i].shard].path(), r.clone()))
            .collect();
        let ahead = ReadAhead::default();
        let mut hashes: Vec<(String, u64)> = Vec::with_capacity(matched.len());
        let streamed: Result<()> = std::thread::scope(|scope| {
            scope.spawn(|| ahead.run(&plan));
            let r = (|| -> Result<()> {
                let mut hasher = Xxh3::new();
                let mut shard_seen = usize::MAX;
                for (i, range) in &pieces {
                    let m = &matched[*i];
                    let shard = &self.shards[m.shard];
                    if m.shard != shard_seen {
                        shard_seen = m.shard;
                        let name = Path::new(&shard.origin)
                            .file_name()
                            .map_or(shard.origin.clone(), |n| n.to_string_lossy().into_owned());
                        progress.shard(m.shard, &name);
                    }
                    if range.start == m.start {
                        hasher.reset();
                        hasher.update(m.name.as_bytes());
                        hasher.update(&[0]);
                        hasher.update(m.dtype.name().as_bytes());
                        for d in &m.shape {
                            hasher.update(&(*d as u64).to_le_bytes());
                        }
                    }
                    let bytes = shard.bytes(range.clone());
                    let first = m.first + (range.start - m.start) / m.dtype.size();
                    if bytes.len() >= (1 << 20) {
                        // Hash on a second thread while the sink copies the same (page-cached) bytes.
                        std::thread::scope(|s| {
                            let h = s.spawn(|| hasher.update(bytes));
                            let r = sink.put(m.buffer, first, m.dtype, bytes);
                            h.join().expect("hashing does not panic");
                            r
                        })?;
                    } else {
                        hasher.update(bytes);
                        sink.put(m.buffer, first, m.dtype, bytes)?;
                    }
                    shard.release(range.clone());
                    ahead.consumed(range.len());
                    progress.advance(range.len() as u64);
                    if range.end == m.end {
                        hashes.push((m.name.clone(), hasher.digest()));
                    }
                }
                Ok(())
            })();
            ahead.stop();
            r
        });
        streamed?;
        hashes.sort();
        let mut all = Vec::with_capacity(hashes.len() * 40);
        for (name, h) in &hashes {
            all.extend_from_slice(name.as_bytes());
            all.push(0);
            all.extend_from_slice(&h.to_le_bytes());
        }
        let report = LoadReport {
            bytes: total,
            tensors: matched.len(),
            seconds: t0.elapsed().as_secs_f64(),
            digest: format!("{:032x}", xxh3_128(&all)),
            skipped,
        };
        progress.finish(&report);
        Ok(report)
    }
}

/// A sink that keeps f32 copies on the host ([`load_hf_weights`]: tests and tools that want
/// the values themselves). It makes no model.
struct Collect {
    tensors: Vec<Option<Vec<f32>>>,
    /// Buffers that received FP8 codes (their values need their scales).
    codes: BTreeSet<BufferId>,
}

impl WeightSink for Collect {
    fn put(&mut self, id: BufferId, first: usize, dtype: SourceDtype, bytes: &[u8]) -> Result<()> {
        if dtype == SourceDtype::F8E4m3 {
            self.codes.insert(id);
        }
        let t = self.tensors[id.index()]
            .as_mut()
            .ok_or_else(|| Error::Checkpoint(format!("buffer {} is not a weight", id.0)))?;
        let n = bytes.len() / dtype.size();
        let dst = t.get_mut(first..first + n).ok_or_else(|| {
            Error::Checkpoint(format!("elements {first}..{} out of range", first + n))
        })?;
        dtype.to_f32(bytes, dst);
        Ok(())
    }
    fn finish(
        self: Box<Self>,
        _compiled: std::sync::Arc<Compiled>,
    ) -> Result<std::sync::Arc<dyn crate::backend::DeviceModel>> {
        Err(Error::Unsupported(
            "a host collector makes no device model".into(),
        ))
    }
}

/// Every weight buffer of `compiled` from the checkpoint in `dir`, as f32 on the host, with
/// the weights digest. For tests and tools: a model loads through [`Checkpoint::load`] into
/// its backend's sink instead. A quantized weight stored in FP8 comes back as its exact values
/// (`q * scale`), one stored as floats as those floats; scale buffers come back as `None`.
pub fn load_hf_weights(compiled: &Compiled, dir: &Path) -> Result<crate::backend::HostWeights> {
    let ckpt = Checkpoint::open(dir)?;
    let mut sink = Collect {
        tensors: compiled
            .layout
            .buffers
            .iter()
            .map(|b| (b.role == Role::Weight).then(|| vec![0f32; b.numel()]))
            .collect(),
        codes: BTreeSet::new(),
    };
    ckpt.load(compiled, &mut sink, &mut Silent)?;
    for b in &compiled.layout.buffers {
        let Some(q) = b.quant else { continue };
        let scales = sink.tensors[q.scale.index()].take().unwrap_or_default();
        if sink.codes.contains(&b.id)
            && let Some(values) = sink.tensors[b.id.index()].as_mut()
        {
            crate::quant::apply_scales(values, &q, &scales);
        }
    }
    Ok(crate::backend::HostWeights {
        tensors: sink.tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_rules() {
        assert!(same_shape(&[192, 1, 4], &[192, 4]));
        assert!(same_shape(&[64], &[64]));
        assert!(!same_shape(&[4, 192], &[192, 4]));
        assert!(!same_shape(&[64, 32], &[64, 16]));
    }
}
