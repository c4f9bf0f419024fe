//! The capsule file format: a capsule on disk, versioned, fingerprinted and checksummed.
//!
//! # Layout (version 1; every integer little-endian)
//!
//! ```text
//! offset  size  field
//!      0     8  magic         "FLRTCAPS"
//!      8     4  version       u32 = 1
//!     12     4  flags         u32 = 0 (reserved; any other value is rejected)
//!     16     8  meta_len      u64: bytes of the metadata JSON
//!     24     8  table_len     u64: bytes of the region table
//!     32     8  data_len      u64: bytes of the region data
//!     40     8  header_hash   u64: XXH64 (seed 0) of bytes [0, 40) ++ metadata ++ table
//!     48        metadata      JSON (UTF-8), see [`FileMeta`]
//!               region table  u32 count, then `count` entries (below)
//!               region data   the regions' bytes, back to back in table order
//! ```
//!
//! The file is exactly `48 + meta_len + table_len + data_len` bytes long. A table entry:
//!
//! ```text
//!   u32  buffer id            (0xFFFF_FFFF: the last logits row)
//!   u8   dtype                0 f32, 1 bf16, 2 f16, 3 i32
//!   u8   kind                 0 key, 1 value, 2 conv, 3 recurrent, 4 logits, 5 hidden
//!   u16  name length, then the name (UTF-8; `layers.3.key`, `logits`)
//!   u8   rank, then rank × u64 dims   (the layout shape; `[vocab]` for logits)
//!   u64  row_start            KV: first position held; otherwise 0
//!   u64  row_count            KV: positions held; logits: 1; otherwise 0
//!   u64  offset               from the start of the region data
//!   u64  length               bytes
//!   u64  hash                 XXH64 (seed 0) of the bytes
//! ```
//!
//! Entries list every state region of the layout once, in layout order, then the logits row
//! if the capsule has one. KV regions are position-major, so the rows `[row_start, pos)` are
//! one contiguous range. A standalone file (what [`write_capsule`] makes) holds every row
//! (`row_start = 0`); a capsule store may write *delta* files whose metadata names a `base`
//! capsule at position `p` and whose KV regions hold only the rows `[p, pos)` — the rows
//! before `p` are the base's (see [`crate::store`]).
//!
//! The model fingerprint in the metadata names IR + layout + kernel version + dtype (see
//! [`flashrt_ir::Layout::fingerprint`]); a file of another model, another layout, another
//! kernel version or another dtype is refused with [`Error::Fingerprint`].
//!
//! # Durability
//!
//! [`write_atomic`] writes into a temporary file in the destination's directory
//! (`.NAME.PID.N.tmp`), fsyncs it, renames it over the destination and fsyncs the directory:
//! a crash leaves either the old file, the new file, or a stray `*.tmp` — never a torn file
//! under the final name. The writer streams region by region (memory: the largest region),
//! then seeks back to fill in the table's hashes and the header.
//!
//! # Untrusted input
//!
//! The reader treats every file as hostile: it checks the magic, version and flags, bounds
//! every length by what the *loading model's* layout can need (so a hostile length never
//! drives an allocation), checks the header hash before parsing the metadata, checks the
//! identity, compares every table entry with the layout, and checks each region's hash. Every
//! defect is an [`Error::Capsule`] (or [`Error::Fingerprint`]) with a message that says what
//! is wrong; nothing panics.

use crate::backend::SavedState;
use crate::capsule::{Capsule, CapsuleMeta, Counters, LogitsRow, SamplerState};
use crate::error::{Error, Result};
use crate::host_state::HostSaved;
use crate::session::Model;
use flashrt_ir::{Buffer, BufferId, Compiled, DType, KERNEL_VERSION, Layout, StateKind};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The first eight bytes of every capsule file.
pub const MAGIC: [u8; 8] = *b"FLRTCAPS";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the fixed header.
pub const HEADER_LEN: usize = 48;
/// The buffer id that marks the logits row in the region table.
pub const LOGITS_ID: u32 = u32::MAX;

/// The metadata of a capsule file (stored as JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FileMeta {
    /// Model name.
    pub model: String,
    /// Layout fingerprint (IR + layout + kernel version + dtype).
    pub fingerprint: String,
    /// Kernel version of the writer (informational: the fingerprint already covers it).
    pub kernel_version: u32,
    /// Layout dtype of the writer (informational: the fingerprint already covers it).
    pub dtype: String,
    /// Tokens consumed; KV regions end at this row.
    pub pos: usize,
    /// The next token, chosen but not yet fed.
    pub pending: Option<u32>,
    /// Token history `[0, pos)`.
    pub tokens: Vec<u32>,
    pub sampler: SamplerState,
    pub counters: Counters,
    /// Delta files only: the capsule whose KV rows `[0, base.pos)` complete this one.
    #[serde(default)]
    pub base: Option<BaseRef>,
    /// The capsule's id in the store that wrote it, if any.
    #[serde(default)]
    pub id: Option<String>,
    /// Milliseconds since the Unix epoch when the file was written.
    #[serde(default)]
    pub created_ms: u64,
    /// A free-form label given by the store (e.g. `auto`, `import`).
    #[serde(default)]
    pub label: Option<String>,
    /// The tenant the capsule belongs to, in the store that wrote it (`None`: the default
    /// tenant).
    #[serde(default)]
    pub owner: Option<String>,
    /// Whether the store computed this state itself (its token history and its state agree by
    /// construction), so it may serve other requests' prefixes. Imported capsules are not;
    /// files without the field are not.
    #[serde(default)]
    pub trusted: bool,
}

/// The base of a delta file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseRef {
    pub id: String,
    pub pos: usize,
}

impl FileMeta {
    /// The file metadata of a capsule (no base, no id).
    pub fn of(meta: &CapsuleMeta, layout: &Layout) -> FileMeta {
        FileMeta {
            model: meta.model.clone(),
            fingerprint: meta.fingerprint.clone(),
            kernel_version: KERNEL_VERSION,
            dtype: layout.target.dtype.name().to_string(),
            pos: meta.pos,
            pending: meta.pending,
            tokens: meta.tokens.clone(),
            sampler: meta.sampler.clone(),
            counters: meta.counters,
            base: None,
            id: None,
            created_ms: now_ms(),
            label: None,
            owner: None,
            trusted: false,
        }
    }

    /// The capsule metadata this file describes, with its logits row.
    pub fn capsule_meta(&self, logits: Option<Vec<f32>>) -> CapsuleMeta {
        CapsuleMeta {
            model: self.model.clone(),
            fingerprint: self.fingerprint.clone(),
            pos: self.pos,
            pending: self.pending,
            tokens: self.tokens.clone(),
            sampler: self.sampler.clone(),
            counters: self.counters,
            last_logits: logits.map(|l| LogitsRow(l.into())),
        }
    }

    /// First KV row held by the file.
    pub fn row_start(&self) -> usize {
        self.base.as_ref().map_or(0, |b| b.pos)
    }
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A validated capsule file.
#[derive(Debug)]
pub struct FileCapsule {
    pub meta: FileMeta,
    /// Every state region in layout order: KV regions hold rows `[meta.row_start(), pos)`.
    pub regions: Vec<(BufferId, Vec<u8>)>,
    /// The last logits row, if the capsule had one.
    pub logits: Option<Vec<f32>>,
}

impl FileCapsule {
    /// A standalone file as a capsule on `compiled`'s layout (host bytes; any backend restores
    /// it). Fails for a delta file.
    pub fn into_capsule(self, compiled: Arc<Compiled>) -> Result<Capsule> {
        if let Some(b) = &self.meta.base {
            return Err(Error::Capsule(format!(
                "capsule file holds only the rows past its base capsule `{}` (position {}); \
                 load it through the capsule store that wrote it",
                b.id, b.pos
            )));
        }
        let saved = HostSaved::new(&compiled.layout, self.meta.pos, self.regions)?;
        let meta = self.meta.capsule_meta(self.logits);
        Capsule::from_parts(meta, Arc::new(saved), compiled)
    }
}

// ---------------------------------------------------------------------------------------------
// XXH64

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

/// Streaming XXH64 (Yann Collet's xxHash, 64-bit variant), written from its specification.
#[derive(Clone, Debug)]
pub struct Xxh64 {
    acc: [u64; 4],
    seed: u64,
    buf: [u8; 32],
    buf_len: usize,
    total: u64,
}

fn xx_round(acc: u64, lane: u64) -> u64 {
    acc.wrapping_add(lane.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

fn xx_merge(h: u64, acc: u64) -> u64 {
    (h ^ xx_round(0, acc)).wrapping_mul(P1).wrapping_add(P4)
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

impl Xxh64 {
    pub fn new(seed: u64) -> Xxh64 {
        Xxh64 {
            acc: [
                seed.wrapping_add(P1).wrapping_add(P2),
                seed.wrapping_add(P2),
                seed,
                seed.wrapping_sub(P1),
            ],
            seed,
            buf: [0; 32],
            buf_len: 0,
            total: 0,
        }
    }

    fn stripe(&mut self, s: &[u8]) {
        for (i, a) in self.acc.iter_mut().enumerate() {
            *a = xx_round(*a, le64(&s[i * 8..]));
        }
    }

    pub fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.buf_len > 0 {
            let take = (32 - self.buf_len).min(data.len());
            self.buf[self.buf_len..self.buf_len + take].copy_from_slice(&data[..take]);
            self.buf_len += take;
            data = &data[take..];
            if self.buf_len < 32 {
                return;
            }
            let b = self.buf;
            self.stripe(&b);
            self.buf_len = 0;
        }
        let mut chunks = data.chunks_exact(32);
        for c in &mut chunks {
            self.stripe(c);
        }
        let rest = chunks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.buf_len = rest.len();
    }

    pub fn finish(&self) -> u64 {
        let [a1, a2, a3, a4] = self.acc;
        let mut h = if self.total >= 32 {
            let h = a1
                .rotate_left(1)
                .wrapping_add(a2.rotate_left(7))
                .wrapping_add(a3.rotate_left(12))
                .wrapping_add(a4.rotate_left(18));
            [a1, a2, a3, a4].iter().fold(h, |h, &a| xx_merge(h, a))
        } else {
            self.seed.wrapping_add(P5)
        };
        h = h.wrapping_add(self.total);
        let mut rest = &self.buf[..self.buf_len];
        while rest.len() >= 8 {
            h ^= xx_round(0, le64(rest));
            h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
            rest = &rest[8..];
        }
        if rest.len() >= 4 {
            h ^= (le32(rest) as u64).wrapping_mul(P1);
            h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
            rest = &rest[4..];
        }
        for &b in rest {
            h ^= (b as u64).wrapping_mul(P5);
            h = h.rotate_left(11).wrapping_mul(P1);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^= h >> 29;
        h = h.wrapping_mul(P3);
        h ^ (h >> 32)
    }
}

/// XXH64 of `data` with `seed`.
pub fn xxh64(data: &[u8], seed: u64) -> u64 {
    let mut h = Xxh64::new(seed);
    h.update(data);
    h.finish()
}

// ---------------------------------------------------------------------------------------------
// Region table

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    id: u32,
    dtype: u8,
    kind: u8,
    name: String,
    shape: Vec<u64>,
    row_start: u64,
    row_count: u64,
    offset: u64,
    len: u64,
    hash: u64,
}

const KIND_LOGITS: u8 = 4;

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
        DType::I32 => 3,
        // State regions are never FP8; the code exists so the mapping is total.
        DType::F8E4m3 => 4,
    }
}

fn kind_code(k: Option<StateKind>) -> u8 {
    match k {
        Some(StateKind::Key) => 0,
        Some(StateKind::Value) => 1,
        Some(StateKind::Conv) => 2,
        Some(StateKind::Recurrent) => 3,
        Some(StateKind::Hidden) => 5,
        None => 255,
    }
}

/// The table a file of `layout` at `pos` (KV rows from `row_start`) must carry, hashes zero.
fn expected_entries(
    layout: &Layout,
    vocab: usize,
    pos: usize,
    row_start: usize,
    logits: bool,
) -> Vec<Entry> {
    let mut out = Vec::new();
    let mut off = 0u64;
    for b in layout.state_buffers() {
        let per_token = b.state.is_some_and(|k| k.per_token());
        let (rs, rc, len) = if per_token {
            let rows = pos - row_start;
            (
                row_start as u64,
                rows as u64,
                (rows * b.bytes_per_token()) as u64,
            )
        } else {
            (0, 0, b.bytes as u64)
        };
        out.push(Entry {
            id: b.id.0,
            dtype: dtype_code(b.dtype),
            kind: kind_code(b.state),
            name: b.name.clone(),
            shape: b.shape.iter().map(|&d| d as u64).collect(),
            row_start: rs,
            row_count: rc,
            offset: off,
            len,
            hash: 0,
        });
        off += len;
    }
    if logits {
        out.push(Entry {
            id: LOGITS_ID,
            dtype: dtype_code(DType::F32),
            kind: KIND_LOGITS,
            name: "logits".into(),
            shape: vec![vocab as u64],
            row_start: 0,
            row_count: 1,
            offset: off,
            len: (vocab * 4) as u64,
            hash: 0,
        });
    }
    out
}

fn encode_table(entries: &[Entry]) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for e in entries {
        t.extend_from_slice(&e.id.to_le_bytes());
        t.push(e.dtype);
        t.push(e.kind);
        t.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
        t.extend_from_slice(e.name.as_bytes());
        t.push(e.shape.len() as u8);
        for d in &e.shape {
            t.extend_from_slice(&d.to_le_bytes());
        }
        for v in [e.row_start, e.row_count, e.offset, e.len, e.hash] {
            t.extend_from_slice(&v.to_le_bytes());
        }
    }
    t
}

/// A bounds-checked cursor over untrusted bytes.
struct Cur<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let Some(end) = end else {
            return Err(Error::Capsule(format!(
                "capsule file region table ends inside {what} (at byte {} of {})",
                self.at,
                self.b.len()
            )));
        };
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        let s = self.take(2, what)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(le32(self.take(4, what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(le64(self.take(8, what)?))
    }
}

fn decode_table(t: &[u8], max_entries: usize) -> Result<Vec<Entry>> {
    let mut c = Cur { b: t, at: 0 };
    let count = c.u32("the entry count")? as usize;
    if count > max_entries {
        return Err(Error::Capsule(format!(
            "capsule file lists {count} regions; the model has at most {max_entries}"
        )));
    }
    // Never trust the count for an allocation: an entry takes at least 53 bytes.
    let mut out = Vec::with_capacity(count.min(t.len() / 53));
    for i in 0..count {
        let what = format!("entry {i}");
        let id = c.u32(&what)?;
        let dtype = c.u8(&what)?;
        let kind = c.u8(&what)?;
        let name_len = c.u16(&what)? as usize;
        let name = std::str::from_utf8(c.take(name_len, &what)?)
            .map_err(|_| Error::Capsule(format!("capsule file region {i}: name is not UTF-8")))?
            .to_string();
        let rank = c.u8(&what)? as usize;
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(c.u64(&what)?);
        }
        let mut v = [0u64; 5];
        for x in &mut v {
            *x = c.u64(&what)?;
        }
        out.push(Entry {
            id,
            dtype,
            kind,
            name,
            shape,
            row_start: v[0],
            row_count: v[1],
            offset: v[2],
            len: v[3],
            hash: v[4],
        });
    }
    if c.at != t.len() {
        return Err(Error::Capsule(format!(
            "capsule file region table has {} unexplained trailing bytes",
            t.len() - c.at
        )));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Limits

/// The largest metadata any capsule of `compiled` needs (tokens dominate).
fn max_meta_len(compiled: &Compiled) -> u64 {
    64 * 1024 + 12 * compiled.layout.max_seq as u64
}

/// The largest region table any capsule of `compiled` needs.
fn max_table_len(compiled: &Compiled) -> u64 {
    let e = expected_entries(
        &compiled.layout,
        compiled.ir.vocab,
        compiled.layout.max_seq,
        0,
        true,
    );
    encode_table(&e).len() as u64
}

/// The largest region data any capsule of `compiled` needs.
fn max_data_len(compiled: &Compiled) -> u64 {
    (compiled.layout.capsule_bytes(compiled.layout.max_seq) + compiled.ir.vocab * 4) as u64
}

/// The largest capsule file of `compiled` this reader accepts.
pub fn max_file_len(compiled: &Compiled) -> u64 {
    HEADER_LEN as u64 + max_meta_len(compiled) + max_table_len(compiled) + max_data_len(compiled)
}

// ---------------------------------------------------------------------------------------------
// Writing

/// Stream a capsule file to `w`: `region(b)` returns the bytes of state region `b` as the file
/// holds them (KV: rows `[meta.row_start(), meta.pos)`; otherwise the whole region). Returns
/// the bytes written.
pub fn encode_to<W: Write + Seek>(
    w: &mut W,
    compiled: &Compiled,
    meta: &FileMeta,
    logits: Option<&[f32]>,
    mut region: impl FnMut(&Buffer) -> Result<Vec<u8>>,
) -> Result<u64> {
    let layout = &compiled.layout;
    let vocab = compiled.ir.vocab;
    if meta.pos > layout.max_seq || meta.tokens.len() != meta.pos || meta.row_start() > meta.pos {
        return Err(Error::Capsule(format!(
            "cannot write an inconsistent capsule: pos {}, {} tokens, base at {}",
            meta.pos,
            meta.tokens.len(),
            meta.row_start()
        )));
    }
    if logits.is_some_and(|l| l.len() != vocab) {
        return Err(Error::Capsule(format!(
            "logits row is not {vocab} values long"
        )));
    }
    let meta_json = serde_json::to_vec(meta)
        .map_err(|e| Error::Capsule(format!("cannot encode capsule metadata: {e}")))?;
    let mut entries = expected_entries(layout, vocab, meta.pos, meta.row_start(), logits.is_some());
    let data_len: u64 = entries.iter().map(|e| e.len).sum();
    let table_len = encode_table(&entries).len() as u64;
    let io = |e: std::io::Error| Error::Io {
        path: "capsule file".into(),
        source: e,
    };
    w.write_all(&[0u8; HEADER_LEN]).map_err(io)?;
    w.write_all(&meta_json).map_err(io)?;
    w.write_all(&encode_table(&entries)).map_err(io)?;
    let states: Vec<&Buffer> = layout.state_buffers().collect();
    for (e, b) in entries.iter_mut().zip(states) {
        let bytes = region(b)?;
        if bytes.len() as u64 != e.len {
            return Err(Error::Capsule(format!(
                "region `{}`: {} bytes given, the file needs {}",
                b.name,
                bytes.len(),
                e.len
            )));
        }
        e.hash = xxh64(&bytes, 0);
        w.write_all(&bytes).map_err(io)?;
    }
    if let (Some(l), Some(e)) = (logits, entries.last_mut()) {
        let bytes = crate::safetensors::f32_bytes(l);
        e.hash = xxh64(&bytes, 0);
        w.write_all(&bytes).map_err(io)?;
    }
    let table = encode_table(&entries);
    let mut head = [0u8; HEADER_LEN];
    head[0..8].copy_from_slice(&MAGIC);
    head[8..12].copy_from_slice(&VERSION.to_le_bytes());
    head[16..24].copy_from_slice(&(meta_json.len() as u64).to_le_bytes());
    head[24..32].copy_from_slice(&table_len.to_le_bytes());
    head[32..40].copy_from_slice(&data_len.to_le_bytes());
    let mut h = Xxh64::new(0);
    h.update(&head[..40]);
    h.update(&meta_json);
    h.update(&table);
    head[40..48].copy_from_slice(&h.finish().to_le_bytes());
    let end = HEADER_LEN as u64 + meta_json.len() as u64 + table_len + data_len;
    w.seek(SeekFrom::Start(HEADER_LEN as u64 + meta_json.len() as u64))
        .map_err(io)?;
    w.write_all(&table).map_err(io)?;
    w.seek(SeekFrom::Start(0)).map_err(io)?;
    w.write_all(&head).map_err(io)?;
    w.seek(SeekFrom::Start(end)).map_err(io)?;
    w.flush().map_err(io)?;
    Ok(end)
}

/// A standalone capsule file (every KV row) in memory.
pub fn capsule_to_vec(capsule: &Capsule) -> Result<Vec<u8>> {
    let mut cur = std::io::Cursor::new(Vec::new());
    encode_capsule(&mut cur, capsule)?;
    Ok(cur.into_inner())
}

fn encode_capsule<W: Write + Seek>(w: &mut W, capsule: &Capsule) -> Result<u64> {
    let compiled = capsule.compiled().clone();
    let meta = FileMeta::of(&capsule.meta, &compiled.layout);
    let saved = capsule.saved().clone();
    encode_to(w, &compiled, &meta, capsule.last_logits(), |b| {
        saved.region_bytes(b.id)
    })
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The temporary name [`write_atomic`] uses for `path`.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "capsule".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Whether `path` looks like a temporary file of [`write_atomic`] (a leftover after a crash).
pub fn is_temp_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with('.') && n.ends_with(".tmp"))
}

/// Write a file atomically: `write` fills a temporary file in the same directory, which is
/// fsynced, renamed over `path`, and the directory fsynced. On any error the temporary file
/// is removed and `path` is untouched.
pub fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<u64>,
) -> Result<u64> {
    let (tmp, n) = write_temp(path, write)?;
    commit_temp(&tmp, path)?;
    Ok(n)
}

/// The first half of [`write_atomic`]: `write` fills a new temporary file beside `path`
/// (named as a leftover of an interrupted write, so a store opened later deletes it), which
/// is fsynced; returns its path and the bytes written. On error nothing is left behind.
pub fn write_temp(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<u64>,
) -> Result<(PathBuf, u64)> {
    let tmp = temp_path(path);
    let io = |p: &Path| {
        let p = p.display().to_string();
        move |e: std::io::Error| Error::Io { path: p, source: e }
    };
    let result = (|| {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io(&tmp))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let n = write(&mut w)?;
        let f = w.into_inner().map_err(|e| Error::Io {
            path: tmp.display().to_string(),
            source: e.into_error(),
        })?;
        f.sync_all().map_err(io(&tmp))?;
        Ok(n)
    })();
    match result {
        Ok(n) => Ok((tmp, n)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The second half of [`write_atomic`]: rename the temporary file over `path` and fsync the
/// directory. On error the temporary file is removed.
pub fn commit_temp(tmp: &Path, path: &Path) -> Result<()> {
    let r = std::fs::rename(tmp, path)
        .map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })
        .and_then(|_| sync_dir(path));
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r
}

/// fsync the directory holding `path` (makes a rename durable).
fn sync_dir(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let d = File::open(dir).map_err(|e| Error::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    d.sync_all().map_err(|e| Error::Io {
        path: dir.display().to_string(),
        source: e,
    })
}

/// Export a capsule as a standalone file, atomically. Returns the file's size.
pub fn write_capsule(path: &Path, capsule: &Capsule) -> Result<u64> {
    write_atomic(path, |w| encode_capsule(w, capsule))
}

// ---------------------------------------------------------------------------------------------
// Reading

/// `read_exact` with a truncation reported as a defect of the file.
fn read_part<R: Read>(r: &mut R, buf: &mut [u8], what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            Error::Capsule(format!("capsule file is truncated inside {what}"))
        }
        _ => Error::Io {
            path: "capsule file".into(),
            source: e,
        },
    })
}

/// Parse and validate a capsule file of `compiled` from `r`, which holds exactly `len` bytes.
pub fn decode_from<R: Read>(r: &mut R, len: u64, compiled: &Compiled) -> Result<FileCapsule> {
    let layout = &compiled.layout;
    let (meta, entries) = decode_head(r, len, compiled)?;
    let mut regions = Vec::with_capacity(entries.len());
    let mut logits = None;
    for e in &entries {
        let mut bytes = vec![0u8; e.len as usize];
        read_part(r, &mut bytes, &format!("region `{}`", e.name))?;
        if xxh64(&bytes, 0) != e.hash {
            return Err(Error::Capsule(format!(
                "capsule file checksum mismatch in region `{}`: the data is corrupted",
                e.name
            )));
        }
        // Intact bytes can still be poison: a NaN or an infinity in any state or logits value
        // would make every continuation from this capsule meaningless.
        let dtype = if e.id == LOGITS_ID {
            DType::F32
        } else {
            layout.buffer(BufferId(e.id)).dtype
        };
        if let Some(i) = first_non_finite(dtype, &bytes) {
            return Err(Error::Capsule(format!(
                "capsule file region `{}` holds a non-finite value (element {i})",
                e.name
            )));
        }
        if e.id == LOGITS_ID {
            logits = Some(crate::safetensors::bytes_f32(&bytes));
        } else {
            regions.push((BufferId(e.id), bytes));
        }
    }
    let mut probe = [0u8; 1];
    if matches!(r.read(&mut probe), Ok(n) if n > 0) {
        return Err(Error::Capsule(
            "capsule file continues past its declared end".into(),
        ));
    }
    Ok(FileCapsule {
        meta,
        regions,
        logits,
    })
}

/// Everything of a capsule file up to its region data, validated: the header (magic, version,
/// flags, lengths bounded by `compiled`'s layout and adding up to `len`), the header checksum
/// over header, metadata and table, the identity, the metadata, and every table entry against
/// the layout. Leaves `r` at the start of the region data.
fn decode_head<R: Read>(
    r: &mut R,
    len: u64,
    compiled: &Compiled,
) -> Result<(FileMeta, Vec<Entry>)> {
    let layout = &compiled.layout;
    let vocab = compiled.ir.vocab;
    let read = read_part::<R>;
    let mut head = [0u8; HEADER_LEN];
    let have = len.min(HEADER_LEN as u64) as usize;
    read(r, &mut head[..have], "the header")?;
    if have < MAGIC.len() || head[..8] != MAGIC {
        return Err(Error::Capsule(
            "not a flashrt capsule file (bad magic)".into(),
        ));
    }
    if have < HEADER_LEN {
        return Err(Error::Capsule(format!(
            "capsule file is truncated: {len} bytes, the header alone is {HEADER_LEN}"
        )));
    }
    let version = le32(&head[8..]);
    if version != VERSION {
        return Err(Error::Capsule(format!(
            "capsule file format version {version} is not supported (this build reads version {VERSION})"
        )));
    }
    let flags = le32(&head[12..]);
    if flags != 0 {
        return Err(Error::Capsule(format!(
            "capsule file has unknown flags {flags:#x}"
        )));
    }
    let meta_len = le64(&head[16..]);
    let table_len = le64(&head[24..]);
    let data_len = le64(&head[32..]);
    let header_hash = le64(&head[40..]);
    // Bound what is read before the identity check: enough for this model's capsules, and
    // never less than a harmless 16 MiB so another model's file is still identified as such.
    let too_big = |what: &str, v: u64, max: u64| {
        Error::Capsule(format!(
            "capsule file declares {v} bytes of {what}; a capsule of model `{}` needs at most {max}",
            compiled.ir.name
        ))
    };
    const PREFLIGHT: u64 = 16 << 20;
    for (what, v, max) in [
        ("metadata", meta_len, max_meta_len(compiled).max(PREFLIGHT)),
        (
            "region table",
            table_len,
            max_table_len(compiled).max(PREFLIGHT),
        ),
    ] {
        if v > max {
            return Err(too_big(what, v, max));
        }
    }
    let declared = (HEADER_LEN as u64)
        .checked_add(meta_len)
        .and_then(|x| x.checked_add(table_len))
        .and_then(|x| x.checked_add(data_len))
        .ok_or_else(|| too_big("region data", data_len, max_data_len(compiled)))?;
    if declared != len {
        return Err(Error::Capsule(if len < declared {
            format!("capsule file is truncated: {len} bytes, its header declares {declared}")
        } else {
            format!(
                "capsule file has {} trailing bytes after the {declared} its header declares",
                len - declared
            )
        }));
    }
    let mut meta_bytes = vec![0u8; meta_len as usize];
    read(r, &mut meta_bytes, "the metadata")?;
    let mut table_bytes = vec![0u8; table_len as usize];
    read(r, &mut table_bytes, "the region table")?;
    let mut h = Xxh64::new(0);
    h.update(&head[..40]);
    h.update(&meta_bytes);
    h.update(&table_bytes);
    if h.finish() != header_hash {
        return Err(Error::Capsule(
            "capsule file header checksum mismatch: the header, metadata or region table is corrupted"
                .into(),
        ));
    }
    let meta: FileMeta = serde_json::from_slice(&meta_bytes)
        .map_err(|e| Error::Capsule(format!("capsule file metadata is invalid: {e}")))?;
    if meta.model != compiled.ir.name || meta.fingerprint != layout.fingerprint {
        return Err(Error::Fingerprint {
            capsule_model: meta.model.clone(),
            capsule: format!(
                "{}, kernel version {}, {}",
                meta.fingerprint, meta.kernel_version, meta.dtype
            ),
            session_model: compiled.ir.name.clone(),
            session: format!(
                "{}, kernel version {KERNEL_VERSION}, {}",
                layout.fingerprint,
                layout.target.dtype.name()
            ),
        });
    }
    for (what, v, max) in [
        ("metadata", meta_len, max_meta_len(compiled)),
        ("region table", table_len, max_table_len(compiled)),
        ("region data", data_len, max_data_len(compiled)),
    ] {
        if v > max {
            return Err(too_big(what, v, max));
        }
    }
    validate_meta(&meta, compiled)?;
    let entries = decode_table(&table_bytes, layout.state_buffers().count() + 1)?;
    let with_logits = entries.last().is_some_and(|e| e.id == LOGITS_ID);
    let want = expected_entries(layout, vocab, meta.pos, meta.row_start(), with_logits);
    if entries.len() != want.len() {
        return Err(Error::Capsule(format!(
            "capsule file lists {} regions, model `{}` at position {} needs {}",
            entries.len(),
            compiled.ir.name,
            meta.pos,
            want.len()
        )));
    }
    for (i, (got, want)) in entries.iter().zip(&want).enumerate() {
        let g = Entry {
            hash: 0,
            ..got.clone()
        };
        if g != *want {
            return Err(Error::Capsule(format!(
                "capsule file region {i} (`{}`) does not match the model's region `{}`: \
                 file has id {}, dtype {}, kind {}, shape {:?}, rows {}+{}, offset {}, {} bytes; \
                 expected id {}, dtype {}, kind {}, shape {:?}, rows {}+{}, offset {}, {} bytes",
                got.name.escape_debug(),
                want.name,
                got.id,
                got.dtype,
                got.kind,
                got.shape,
                got.row_start,
                got.row_count,
                got.offset,
                got.len,
                want.id,
                want.dtype,
                want.kind,
                want.shape,
                want.row_start,
                want.row_count,
                want.offset,
                want.len
            )));
        }
    }
    let total: u64 = want.iter().map(|e| e.len).sum();
    if total != data_len {
        return Err(Error::Capsule(format!(
            "capsule file declares {data_len} bytes of region data, its regions hold {total}"
        )));
    }
    Ok((meta, entries))
}

/// The index of the first NaN or infinity among `bytes` read as `dtype` (little-endian).
pub fn first_non_finite(dtype: DType, bytes: &[u8]) -> Option<usize> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).position(|c| {
            u32::from_le_bytes(c.try_into().expect("4")) & 0x7f80_0000 == 0x7f80_0000
        }),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .position(|c| u16::from_le_bytes(c.try_into().expect("2")) & 0x7f80 == 0x7f80),
        DType::F16 => bytes
            .chunks_exact(2)
            .position(|c| u16::from_le_bytes(c.try_into().expect("2")) & 0x7c00 == 0x7c00),
        DType::I32 => None,
        DType::F8E4m3 => bytes.iter().position(|b| b & 0x7f == 0x7f),
    }
}

fn validate_meta(meta: &FileMeta, compiled: &Compiled) -> Result<()> {
    let max = compiled.layout.max_seq;
    let vocab = compiled.ir.vocab;
    if meta.pos > max {
        return Err(Error::Capsule(format!(
            "capsule file position {} exceeds max_seq {max}",
            meta.pos
        )));
    }
    if meta.tokens.len() != meta.pos {
        return Err(Error::Capsule(format!(
            "capsule file has {} tokens of history at position {}",
            meta.tokens.len(),
            meta.pos
        )));
    }
    if let Some((i, t)) = meta
        .tokens
        .iter()
        .enumerate()
        .find(|(_, t)| **t as usize >= vocab)
    {
        return Err(Error::Capsule(format!(
            "capsule file token {t} at index {i} is outside the vocabulary ({vocab})"
        )));
    }
    if meta.pending.is_some_and(|t| t as usize >= vocab) {
        return Err(Error::Capsule(
            "capsule file pending token is outside the vocabulary".into(),
        ));
    }
    if let Some(b) = &meta.base
        && b.pos > meta.pos
    {
        return Err(Error::Capsule(format!(
            "capsule file base position {} is past its own position {}",
            b.pos, meta.pos
        )));
    }
    if meta.sampler.rng == [0; 4] {
        return Err(Error::Capsule(
            "capsule file sampler: an all-zero xoshiro256** state (never produced by seeding)"
                .into(),
        ));
    }
    meta.sampler
        .validate()
        .map_err(|e| Error::Capsule(format!("capsule file sampler: {e}")))
}

/// Parse and validate capsule file bytes.
pub fn decode(bytes: &[u8], compiled: &Compiled) -> Result<FileCapsule> {
    decode_from(&mut &bytes[..], bytes.len() as u64, compiled)
}

/// Read and validate a capsule file (standalone or delta).
pub fn read_file(path: &Path, compiled: &Compiled) -> Result<FileCapsule> {
    // No size check up front: the reader bounds every read by the loading model's layout.
    let (mut r, len) = open_file(path, 1 << 20)?;
    decode_from(&mut r, len, compiled).map_err(at(path))
}

/// The metadata of a capsule file of `compiled`, every part but the region data validated as
/// [`read_file`] validates it (the region bytes' checksums are checked when they are read):
/// what a store reads of each file when it opens, so that opening does not read every byte of
/// a large disk tier.
pub fn read_file_meta(path: &Path, compiled: &Compiled) -> Result<FileMeta> {
    let (mut r, len) = open_file(path, 64 << 10)?;
    decode_head(&mut r, len, compiled)
        .map(|(meta, _)| meta)
        .map_err(at(path))
}

/// `path` opened for reading through a buffer of `buf` bytes, and its length.
fn open_file(path: &Path, buf: usize) -> Result<(BufReader<File>, u64)> {
    let io = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        source: e,
    };
    let f = File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    Ok((BufReader::with_capacity(buf, f), len))
}

/// A defect of the file at `path`, said with its path.
fn at(path: &Path) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::Capsule(m) => Error::Capsule(format!("{}: {m}", path.display())),
        other => other,
    }
}

/// Import a standalone capsule file for `model` (host bytes; any backend restores it).
pub fn read_capsule(path: &Path, model: &Model) -> Result<Capsule> {
    read_file(path, model.compiled())?.into_capsule(model.compiled().clone())
}

/// [`read_capsule`] from a file already opened (and checked) by the caller; `name` is what
/// messages call it.
pub fn read_capsule_from(file: File, name: &str, model: &Model) -> Result<Capsule> {
    let len = file
        .metadata()
        .map_err(|e| Error::Io {
            path: name.to_string(),
            source: e,
        })?
        .len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    decode_from(&mut r, len, model.compiled())
        .map_err(|e| match e {
            Error::Capsule(m) => Error::Capsule(format!("{name}: {m}")),
            other => other,
        })?
        .into_capsule(model.compiled().clone())
}

/// Import standalone capsule file bytes for `model`.
pub fn capsule_from_slice(bytes: &[u8], model: &Model) -> Result<Capsule> {
    decode(bytes, model.compiled())?.into_capsule(model.compiled().clone())
}

/// Recompute the header hash and every region hash of a structurally sound file in place
/// (tests and fuzzing use it to reach the checks behind the checksums). Returns false when
/// the lengths do not describe the buffer.
#[doc(hidden)]
pub fn refresh_checksums(bytes: &mut [u8]) -> bool {
    if bytes.len() < HEADER_LEN {
        return false;
    }
    let meta_len = le64(&bytes[16..]) as usize;
    let table_len = le64(&bytes[24..]) as usize;
    let data_len = le64(&bytes[32..]) as usize;
    let Some(end) = HEADER_LEN
        .checked_add(meta_len)
        .and_then(|v| v.checked_add(table_len))
        .and_then(|v| v.checked_add(data_len))
    else {
        return false;
    };
    if end != bytes.len() {
        return false;
    }
    let t0 = HEADER_LEN + meta_len;
    let d0 = t0 + table_len;
    if let Ok(mut entries) = decode_table(&bytes[t0..d0], usize::MAX) {
        for e in &mut entries {
            let s = usize::try_from(e.offset).ok();
            let n = usize::try_from(e.len).ok();
            if let (Some(s), Some(n)) = (s, n)
                && let Some(stop) = s.checked_add(n).filter(|&x| x <= data_len)
            {
                e.hash = xxh64(&bytes[d0 + s..d0 + stop], 0);
            }
        }
        let t = encode_table(&entries);
        if t.len() == table_len {
            bytes[t0..d0].copy_from_slice(&t);
        }
    }
    let mut h = Xxh64::new(0);
    h.update(&bytes[..40]);
    h.update(&bytes[HEADER_LEN..d0]);
    let v = h.finish();
    bytes[40..48].copy_from_slice(&v.to_le_bytes());
    true
}

/// Bytes a saved state's region holds from row `row_start` on (KV), or whole (other regions).
pub fn region_rows(saved: &dyn SavedState, b: &Buffer, row_start: usize) -> Result<Vec<u8>> {
    let mut bytes = saved.region_bytes(b.id)?;
    if b.state.is_some_and(|k| k.per_token()) {
        let skip = row_start * b.bytes_per_token();
        if skip > bytes.len() {
            return Err(Error::Capsule(format!(
                "region `{}` has {} bytes, fewer than the {skip} of rows before {row_start}",
                b.name,
                bytes.len()
            )));
        }
        bytes.drain(..skip);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh64_reference_vectors() {
        assert_eq!(xxh64(b"", 0), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"a", 0), 0xD24E_C4F1_A98C_6E5B);
        assert_eq!(xxh64(b"abc", 0), 0x44BC_2CF5_AD77_0999);
        assert_eq!(xxh64(b"asdf", 0), 0x4158_72F5_99CE_A71E);
        assert_eq!(xxh64(b"Call me Ishmael.", 0), 0x6D04_390F_C9D6_1A90);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition", 0),
            0xFBCE_A83C_8A37_8BF1
        );
        assert_ne!(xxh64(b"abc", 1), xxh64(b"abc", 0));
    }

    #[test]
    fn xxh64_streaming_equals_one_shot() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        for split in [0, 1, 7, 31, 32, 33, 64, 500, 999, 1000] {
            let mut h = Xxh64::new(5);
            h.update(&data[..split]);
            h.update(&data[split..]);
            assert_eq!(h.finish(), xxh64(&data, 5), "split at {split}");
        }
        let mut h = Xxh64::new(0);
        for b in &data {
            h.update(std::slice::from_ref(b));
        }
        assert_eq!(h.finish(), xxh64(&data, 0));
    }
}
