//! A capsule store: capsules by id in three tiers with byte budgets, LRU eviction down the
//! tiers, KV rows shared along a conversation, and longest-prefix lookup.
//!
//! # Tiers
//!
//! * **device**: the capsule as its backend saved it ([`Capsule`] with the backend's own
//!   [`SavedState`](crate::SavedState): device memory on CUDA, the CPU backend's host copy on
//!   CPU). A restore is one bulk copy per region.
//! * **host**: portable host bytes. KV regions hold only the rows past the capsule's *base*
//!   (below), plus every fixed (recurrent / conv) region and the logits row.
//! * **disk**: one capsule file per capsule in the store directory
//!   ([`crate::capsule_file`]), delta files for capsules with a base. Files survive restarts;
//!   [`CapsuleStore::open`] reloads them (verifying every checksum, deleting leftovers of
//!   interrupted writes, renaming corrupt files to `*.corrupt`).
//!
//! Each tier has a byte budget. After every insertion or promotion the store evicts the least
//! recently used capsule of a tier over budget *down* one tier: device -> host -> disk ->
//! dropped (host -> dropped without a directory). A capsule restored from host or disk is
//! promoted back to the device tier (re-snapshotted from the restored session, which is byte
//! for byte the same state). A capsule can sit in memory and on disk at once
//! ([`CapsuleStore::persist`]); it then counts in both tiers.
//!
//! # KV sharing
//!
//! A capsule's KV regions are position-major, and the KV rows of a position depend only on the
//! tokens up to it. When a capsule leaves the device tier, the store looks for its *base*: the
//! stored capsule whose token history is the longest prefix of this one's (earlier in the
//! order (position, insertion), so chains never loop). If the base's KV rows equal this
//! capsule's first rows (checked with per-region XXH64 hashes of the base's rows, cached), the
//! capsule keeps only the rows past the base's position. A restore walks the chain and
//! concatenates the rows: the result is byte-identical to the capsule as it was snapshotted.
//! A base is pinned while any capsule depends on it; deleting it only hides it until its
//! dependents are gone.
//!
//! # Trust, owners, persistence
//!
//! Every capsule has an owner (a tenant name; `""` is the default tenant) and a provenance:
//! *trusted* when the store's model computed the state itself ([`CapsuleStore::insert`]), not
//! trusted when it came from outside ([`CapsuleStore::import`]: a file's checksums prove only
//! that its bytes are intact, not that its token history is the history of its state).
//! Automatic prefix reuse asks for trusted capsules of one owner
//! ([`PrefixScope::Trusted`]), so an imported capsule is restored only when asked for by id.
//! A capsule a client persisted ([`CapsuleStore::persist`]) is pinned on disk: eviction never
//! drops its file, and a persist that the disk budget cannot hold fails with
//! [`Error::StoreFull`] instead. At most [`MAX_CHAIN`] capsules share one full capsule's
//! bytes (directly or through other deltas), so one corrupt file costs at most that many. Owners, provenance and pins survive a
//! restart (the file metadata and `<id>.pinned` markers).
//!
//! # Background demotion
//!
//! With [`StoreConfig::background`], a capsule leaving the device tier is copied to the host
//! and hashed on a thread of its own, and a capsule leaving the host tier has its file written
//! on one; the store applies the results when they are done (at its next operation, or
//! [`CapsuleStore::poll`]); see [`background`] for the rules.
//!
//! # Prefix reuse
//!
//! [`CapsuleStore::longest_prefix`] finds the stored capsule whose token history is the
//! longest prefix of a request's tokens, at any position: every capsule is indexed by
//! `(position, hash of its tokens)`, the request's prefix hashes are computed in one pass, and a
//! candidate's tokens are compared before it is returned.

mod background;
mod hash;

pub use background::MAX_IN_FLIGHT;

use crate::capsule::{Capsule, CapsuleMeta};
use crate::capsule_file::{self, BaseRef, FileMeta};
use crate::error::{Error, Result};
use crate::host_state::HostSaved;
use crate::session::{Model, Session};
use background::{Demoted, Demotion, Shape, Spill, Spilled};
use flashrt_ir::BufferId;
use hash::{KvRegion, all_threads, hash_kv};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A storage tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
    fn index(self) -> usize {
        self as usize
    }
}

/// Budgets and place of a store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Bytes of capsules kept as backend-saved state.
    pub budget_device: u64,
    /// Bytes of capsules kept as host bytes.
    pub budget_host: u64,
    /// Bytes of capsule files in `dir`.
    pub budget_disk: u64,
    /// Where capsule files go; `None`: no disk tier (host evictions drop capsules).
    pub dir: Option<PathBuf>,
    /// Share KV rows with a base capsule in the host and disk tiers.
    pub share_kv: bool,
    /// Copy and hash capsules leaving the device tier, and write the files of capsules leaving
    /// the host tier, on threads of their own (see the module docs); off, the operation that
    /// evicts them waits for that work.
    pub background: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            budget_device: 1 << 30,
            budget_host: 4 << 30,
            budget_disk: 64 << 30,
            dir: None,
            share_kv: true,
            background: false,
        }
    }
}

/// Counters and gauges of a store.
#[derive(Clone, Debug, Default)]
pub struct StoreStats {
    /// Visible capsules per tier (a capsule in memory and on disk counts in both).
    pub capsules: [usize; 3],
    /// Bytes held per tier (not counting capsules on their way down in the background).
    pub bytes: [u64; 3],
    /// Capsules on their way from the device tier to the host in the background, and the
    /// device bytes they still hold.
    pub demoting: usize,
    pub demoting_bytes: u64,
    /// Capsules whose files are being written in the background, and the host bytes they
    /// still hold.
    pub spilling: usize,
    pub spilling_bytes: u64,
    /// Demotions and spills finished in the background, and the seconds they took (off the
    /// store's thread).
    pub background_demotions: u64,
    pub background_spills: u64,
    pub background_seconds: f64,
    pub budgets: [u64; 3],
    /// Prefix lookups that found a capsule, and the tokens they saved.
    pub hits: u64,
    pub hit_tokens: u64,
    /// Prefix lookups that found nothing.
    pub misses: u64,
    /// Capsules moved out of each tier by eviction (from disk: dropped).
    pub evictions: [u64; 3],
    /// Capsules dropped from the store by eviction.
    pub dropped: u64,
    /// Bytes not stored thanks to KV sharing (host and disk copies).
    pub shared_bytes: u64,
    /// Files found corrupt (at open or at load) and set aside.
    pub corrupt_files: u64,
}

/// What [`CapsuleStore::info`] says about one capsule.
#[derive(Clone, Debug)]
pub struct CapsuleInfo {
    pub id: String,
    pub pos: usize,
    /// Tiers holding it, highest first.
    pub tiers: Vec<Tier>,
    /// Bytes per tier (0 where absent).
    pub bytes: [u64; 3],
    /// The capsule whose KV rows this one shares, if decided.
    pub base: Option<String>,
    pub label: Option<String>,
    pub owner: String,
    /// Computed by this store's model (see the module docs).
    pub trusted: bool,
    /// Pinned on disk.
    pub persisted: bool,
}

/// Which capsules a prefix lookup may return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixScope<'a> {
    /// Every visible capsule (tools and tests; never automatic reuse for clients).
    Any,
    /// Trusted capsules of this owner: what automatic reuse asks for.
    Trusted(&'a str),
    /// Trusted capsules of any owner: a prefix cache shared across tenants (an opt-in).
    TrustedShared,
}

impl PrefixScope<'_> {
    fn admits(&self, e: &Entry) -> bool {
        match self {
            PrefixScope::Any => true,
            PrefixScope::Trusted(o) => e.trusted && e.owner == *o,
            PrefixScope::TrustedShared => e.trusted,
        }
    }
}

/// Capsules whose bytes hang off one full capsule at most (it included): a corrupt file loses
/// at most this many.
pub const MAX_CHAIN: usize = 8;

/// How a restore went.
#[derive(Clone, Copy, Debug)]
pub struct RestoreInfo {
    /// The tier the capsule was restored from.
    pub tier: Tier,
    pub elapsed: Duration,
    pub pos: usize,
}

/// Region bytes by buffer id.
type Regions = Vec<(BufferId, Vec<u8>)>;

/// Host-tier bytes: fixed regions whole, KV regions from the base's position on.
struct HostCopy {
    meta: CapsuleMeta,
    /// Shared with a background write of its file (a spill), if one runs.
    regions: Arc<Regions>,
    bytes: u64,
}

/// Everything a capsule file is written from (on the store's thread or a spill's).
struct FileParts {
    path: PathBuf,
    meta: FileMeta,
    logits: Option<crate::capsule::LogitsRow>,
    regions: Arc<Regions>,
    compiled: Arc<flashrt_ir::Compiled>,
}

impl FileParts {
    fn encode(&self, w: &mut std::io::BufWriter<std::fs::File>) -> Result<u64> {
        let logits = self.logits.as_ref().map(|l| &l.0[..]);
        capsule_file::encode_to(w, &self.compiled, &self.meta, logits, |b| {
            self.regions
                .iter()
                .find(|(x, _)| *x == b.id)
                .map(|(_, v)| v.clone())
                .ok_or_else(|| Error::Capsule(format!("region `{}` missing", b.name)))
        })
    }
}

enum Mem {
    Device(Capsule),
    Host(HostCopy),
}

struct DiskCopy {
    path: PathBuf,
    bytes: u64,
}

struct Entry {
    id: String,
    /// The tenant it belongs to (`""`: the default one).
    owner: String,
    /// Computed by this store's model (not imported): may serve other requests' prefixes.
    trusted: bool,
    /// Pinned on disk by a client's persist.
    persisted: bool,
    seq: u64,
    pos: usize,
    tokens: Arc<[u32]>,
    label: Option<String>,
    /// `None`: not decided yet (still only on the device). `Some(None)`: stored whole.
    base: Option<Option<BaseRef>>,
    /// Capsules whose stored bytes depend on this one.
    pins: usize,
    mem: Option<Mem>,
    disk: Option<DiskCopy>,
    last_used: u64,
    /// Deleted by the user; kept only while others depend on it.
    hidden: bool,
    /// XXH64 of each KV region's rows `[0, pos)`, in layout order (once known).
    kv_hash: Option<Vec<u64>>,
}

impl Entry {
    fn mem_bytes(&self) -> (u64, u64) {
        match &self.mem {
            Some(Mem::Device(c)) => (device_bytes(c), 0),
            Some(Mem::Host(h)) => (0, h.bytes),
            None => (0, 0),
        }
    }
    fn tiers(&self) -> Vec<Tier> {
        let mut t = Vec::new();
        match &self.mem {
            Some(Mem::Device(_)) => t.push(Tier::Device),
            Some(Mem::Host(_)) => t.push(Tier::Host),
            None => {}
        }
        if self.disk.is_some() {
            t.push(Tier::Disk);
        }
        t
    }
    fn base_id(&self) -> Option<&str> {
        self.base
            .as_ref()
            .and_then(|b| b.as_ref())
            .map(|b| b.id.as_str())
    }
}

fn device_bytes(c: &Capsule) -> u64 {
    (c.bytes() + c.meta.last_logits.as_ref().map_or(0, |l| l.0.len() * 4)) as u64
}

/// FNV-1a over token ids, one step per token (so every prefix hash comes in one pass).
fn hash_step(h: u64, t: u32) -> u64 {
    let mut h = h;
    for b in t.to_le_bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
const HASH_INIT: u64 = 0xcbf2_9ce4_8422_2325;

fn tokens_hash(t: &[u32]) -> u64 {
    t.iter().fold(HASH_INIT, |h, &x| hash_step(h, x))
}

/// Whether `s` is a capsule id: 32 lowercase hex digits (16 in stores written before ids
/// became 128-bit); ids name files, so nothing else is ever accepted.
pub fn valid_id(s: &str) -> bool {
    (s.len() == 32 || s.len() == 16)
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A fresh 128-bit id from the operating system's random source, as 32 hex digits: not
/// guessable from another id or the clock.
pub fn random_id() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // No OS randomness (never seen on the supported systems): fall back to a mix of the
        // clock, the process and a counter, still unique within the process.
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let t = capsule_file::now_ms() ^ (std::process::id() as u64) << 40;
        b[..8].copy_from_slice(&crate::init::mix64(t ^ n).to_le_bytes());
        b[8..].copy_from_slice(&crate::init::mix64(n.wrapping_add(t)).to_le_bytes());
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The capsule store of one model.
pub struct CapsuleStore {
    model: Model,
    cfg: StoreConfig,
    entries: HashMap<String, Entry>,
    /// `(pos, tokens hash)` -> ids of visible capsules.
    index: HashMap<(usize, u64), Vec<String>>,
    /// Positions present in `index`.
    positions: BTreeSet<usize>,
    clock: u64,
    seq: u64,
    stats: StoreStats,
    /// Background jobs in flight, oldest first: demotions (device -> host), spills (host ->
    /// disk).
    demotions: VecDeque<Demotion>,
    spills: VecDeque<Spill>,
}

impl std::fmt::Debug for CapsuleStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapsuleStore")
            .field("model", &self.model.name())
            .field("capsules", &self.entries.len())
            .field("dir", &self.cfg.dir)
            .finish()
    }
}

impl CapsuleStore {
    /// A store for `model`. With a directory, its capsule files of this model are loaded
    /// (each one fully verified), leftovers of interrupted writes are deleted, and corrupt or
    /// orphaned files are renamed `*.corrupt` / `*.orphan` and never loaded.
    pub fn open(model: Model, cfg: StoreConfig) -> Result<CapsuleStore> {
        let mut store = CapsuleStore {
            model,
            stats: StoreStats {
                budgets: [cfg.budget_device, cfg.budget_host, cfg.budget_disk],
                ..StoreStats::default()
            },
            cfg,
            entries: HashMap::new(),
            index: HashMap::new(),
            positions: BTreeSet::new(),
            clock: 0,
            seq: 0,
            demotions: VecDeque::new(),
            spills: VecDeque::new(),
        };
        if let Some(dir) = store.cfg.dir.clone() {
            std::fs::create_dir_all(&dir).map_err(|e| Error::Io {
                path: dir.display().to_string(),
                source: e,
            })?;
            store.load_dir(&dir)?;
        }
        Ok(store)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
        move |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        }
    }

    fn load_dir(&mut self, dir: &Path) -> Result<()> {
        let mut found = Vec::new();
        let mut hidden = BTreeSet::new();
        let mut pinned = BTreeSet::new();
        for e in std::fs::read_dir(dir).map_err(Self::io(dir))? {
            let p = e.map_err(Self::io(dir))?.path();
            if capsule_file::is_temp_file(&p) {
                // An interrupted write: never renamed, so never a capsule.
                let _ = std::fs::remove_file(&p);
                continue;
            }
            let (Some(stem), Some(ext)) = (
                p.file_stem().and_then(|s| s.to_str()),
                p.extension().and_then(|s| s.to_str()),
            ) else {
                continue;
            };
            if !valid_id(stem) {
                continue;
            }
            match ext {
                "caps" => found.push((stem.to_string(), p.clone())),
                "hidden" => {
                    hidden.insert(stem.to_string());
                }
                "pinned" => {
                    pinned.insert(stem.to_string());
                }
                _ => {}
            }
        }
        let compiled = self.model.compiled().clone();
        let mut loaded: Vec<(FileMeta, PathBuf, u64)> = Vec::new();
        for (id, path) in found {
            match capsule_file::read_file(&path, &compiled) {
                Ok(f) if f.meta.id.as_deref() == Some(id.as_str()) => {
                    let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    loaded.push((f.meta, path, len));
                }
                Ok(_) => self.set_aside(&path, "corrupt"),
                // Another model's capsules may share the directory: leave them alone.
                Err(Error::Fingerprint { .. }) => {}
                Err(_) => self.set_aside(&path, "corrupt"),
            }
        }
        // Oldest first, so a base always gets a smaller sequence number than its dependents.
        loaded.sort_by_key(|a| (a.0.pos, a.0.created_ms));
        for (meta, path, len) in loaded {
            let id = meta.id.clone().unwrap_or_default();
            self.seq += 1;
            let tokens: Arc<[u32]> = meta.tokens.clone().into();
            self.entries.insert(
                id.clone(),
                Entry {
                    id: id.clone(),
                    owner: meta.owner.clone().unwrap_or_default(),
                    trusted: meta.trusted,
                    persisted: pinned.contains(&id),
                    seq: self.seq,
                    pos: meta.pos,
                    tokens,
                    label: meta.label.clone(),
                    base: Some(meta.base.clone()),
                    pins: 0,
                    mem: None,
                    disk: Some(DiskCopy { path, bytes: len }),
                    last_used: 0,
                    hidden: hidden.contains(&id),
                    kv_hash: None,
                },
            );
        }
        // Drop every capsule whose chain of bases is broken (missing, not a prefix, looping).
        loop {
            let broken: Vec<String> = self
                .entries
                .values()
                .filter(|e| !self.chain_ok(e))
                .map(|e| e.id.clone())
                .collect();
            if broken.is_empty() {
                break;
            }
            for id in broken {
                if let Some(e) = self.entries.remove(&id)
                    && let Some(d) = &e.disk
                {
                    self.set_aside(&d.path, "orphan");
                }
            }
        }
        let ids: Vec<String> = self.entries.keys().cloned().collect();
        for id in &ids {
            if let Some(b) = self.entries[id].base_id().map(str::to_string)
                && let Some(be) = self.entries.get_mut(&b)
            {
                be.pins += 1;
            }
        }
        for id in ids {
            let e = &self.entries[&id];
            if e.hidden && e.pins == 0 {
                self.remove_entry(&id);
            } else if !e.hidden {
                self.index_add(&id);
            }
        }
        self.enforce(None)
    }

    fn chain_ok(&self, e: &Entry) -> bool {
        let mut cur = e;
        for _ in 0..=self.entries.len() {
            let Some(b) = cur.base.as_ref().and_then(|b| b.as_ref()) else {
                return true;
            };
            let Some(be) = self.entries.get(&b.id) else {
                return false;
            };
            if be.pos != b.pos || b.pos > cur.pos || cur.tokens[..b.pos] != be.tokens[..] {
                return false;
            }
            cur = be;
        }
        false
    }

    fn set_aside(&mut self, path: &Path, why: &str) {
        self.stats.corrupt_files += 1;
        tracing::warn!(
            "capsule store: {} is {why}; renamed to *.{why} and not loaded",
            path.file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned())
        );
        let mut to = path.as_os_str().to_owned();
        to.push(format!(".{why}"));
        let _ = std::fs::rename(path, PathBuf::from(to));
    }

    fn new_id(&mut self) -> String {
        loop {
            let id = random_id();
            let on_disk = self
                .cfg
                .dir
                .as_ref()
                .is_some_and(|d| d.join(format!("{id}.caps")).exists());
            if !self.entries.contains_key(&id) && !on_disk {
                return id;
            }
        }
    }

    fn touch(&mut self, id: &str) {
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(id) {
            e.last_used = self.clock;
        }
    }

    fn index_add(&mut self, id: &str) {
        let e = &self.entries[id];
        let key = (e.pos, tokens_hash(&e.tokens));
        self.index.entry(key).or_default().push(id.to_string());
        self.positions.insert(e.pos);
    }

    fn index_remove(&mut self, id: &str) {
        let Some(e) = self.entries.get(id) else {
            return;
        };
        let key = (e.pos, tokens_hash(&e.tokens));
        if let Some(v) = self.index.get_mut(&key) {
            v.retain(|x| x != id);
            if v.is_empty() {
                self.index.remove(&key);
                if !self.index.keys().any(|k| k.0 == key.0) {
                    self.positions.remove(&key.0);
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Public operations

    /// Store a capsule this store's model computed (trusted), for the default tenant.
    pub fn insert(&mut self, capsule: Capsule, label: Option<String>) -> Result<String> {
        self.insert_as(capsule, label, "", true)
    }

    /// Store a capsule of this store's model for `owner`; returns its id. `trusted`: the
    /// state was computed here (see the module docs). A backend-saved capsule enters the
    /// device tier; a host-bytes capsule (an import) enters the host tier. Budgets are
    /// enforced before returning; a capsule too large for every tier is refused.
    pub fn insert_as(
        &mut self,
        capsule: Capsule,
        label: Option<String>,
        owner: &str,
        trusted: bool,
    ) -> Result<String> {
        self.poll()?;
        if capsule.fingerprint() != self.model.fingerprint() {
            return Err(Error::Fingerprint {
                capsule_model: capsule.meta.model.clone(),
                capsule: capsule.meta.fingerprint.clone(),
                session_model: self.model.name().to_string(),
                session: self.model.fingerprint().to_string(),
            });
        }
        let id = self.new_id();
        self.seq += 1;
        let host = capsule.saved().as_any().is::<HostSaved>();
        let size = device_bytes(&capsule);
        let entry = Entry {
            id: id.clone(),
            owner: owner.to_string(),
            trusted,
            persisted: false,
            seq: self.seq,
            pos: capsule.pos(),
            tokens: capsule.tokens().into(),
            label,
            base: None,
            pins: 0,
            mem: Some(Mem::Device(capsule)),
            disk: None,
            last_used: 0,
            hidden: false,
            kv_hash: None,
        };
        self.entries.insert(id.clone(), entry);
        self.index_add(&id);
        self.touch(&id);
        if host {
            self.demote_device(&id)?;
        }
        self.enforce(Some(&id))?;
        if !self.entries.contains_key(&id) {
            return Err(Error::StoreFull(format!(
                "capsule of {size} bytes does not fit in any tier of the store (budgets: device {}, host {}, disk {}; persisted capsules are never evicted)",
                self.cfg.budget_device,
                self.cfg.budget_host,
                if self.cfg.dir.is_some() {
                    self.cfg.budget_disk
                } else {
                    0
                }
            )));
        }
        Ok(id)
    }

    /// Whether a visible capsule `id` is stored.
    pub fn contains(&self, id: &str) -> bool {
        self.entries.get(id).is_some_and(|e| !e.hidden)
    }

    /// Ids of the visible capsules, most recently used first.
    pub fn ids(&self) -> Vec<String> {
        self.ids_of(None)
    }

    /// Ids of the visible capsules of `owner` (every owner's for `None`), most recently used
    /// first.
    pub fn ids_of(&self, owner: Option<&str>) -> Vec<String> {
        let mut v: Vec<&Entry> = self
            .entries
            .values()
            .filter(|e| !e.hidden && owner.is_none_or(|o| e.owner == o))
            .collect();
        v.sort_by(|a, b| b.last_used.cmp(&a.last_used).then(b.seq.cmp(&a.seq)));
        v.into_iter().map(|e| e.id.clone()).collect()
    }

    fn visible(&self, id: &str) -> Result<&Entry> {
        self.entries
            .get(id)
            .filter(|e| !e.hidden)
            .ok_or_else(|| Error::Input(format!("no capsule `{id}`")))
    }

    /// About one visible capsule.
    pub fn info(&self, id: &str) -> Result<CapsuleInfo> {
        let e = self.visible(id)?;
        let (d, h) = e.mem_bytes();
        Ok(CapsuleInfo {
            id: e.id.clone(),
            pos: e.pos,
            tiers: e.tiers(),
            bytes: [d, h, e.disk.as_ref().map_or(0, |x| x.bytes)],
            base: e.base_id().map(str::to_string),
            label: e.label.clone(),
            owner: e.owner.clone(),
            trusted: e.trusted,
            persisted: e.persisted,
        })
    }

    /// Token history of a visible capsule.
    pub fn tokens(&self, id: &str) -> Result<Arc<[u32]>> {
        Ok(self.visible(id)?.tokens.clone())
    }

    /// The stored capsule whose token history is the longest prefix of `tokens` (at most
    /// `tokens.len()` long, at least one token): `(id, its position)`. Pure: no statistics.
    pub fn longest_prefix(&self, tokens: &[u32]) -> Option<(String, usize)> {
        self.longest_prefix_in(tokens, PrefixScope::Any)
    }

    /// [`CapsuleStore::longest_prefix`] among the capsules `scope` admits.
    pub fn longest_prefix_in(
        &self,
        tokens: &[u32],
        scope: PrefixScope<'_>,
    ) -> Option<(String, usize)> {
        let mut prefix = Vec::with_capacity(tokens.len() + 1);
        let mut h = HASH_INIT;
        prefix.push(h);
        for &t in tokens {
            h = hash_step(h, t);
            prefix.push(h);
        }
        for &p in self.positions.range(1..=tokens.len()).rev() {
            let Some(ids) = self.index.get(&(p, prefix[p])) else {
                continue;
            };
            let best = ids
                .iter()
                .filter_map(|id| self.entries.get(id))
                .filter(|e| !e.hidden && scope.admits(e) && e.tokens[..] == tokens[..p])
                .max_by_key(|e| (e.last_used, e.seq));
            if let Some(e) = best {
                return Some((e.id.clone(), p));
            }
        }
        None
    }

    /// [`CapsuleStore::longest_prefix_in`], counted as a hit or a miss; a hit is touched.
    pub fn lookup_prefix(
        &mut self,
        tokens: &[u32],
        scope: PrefixScope<'_>,
    ) -> Option<(String, usize)> {
        let r = self.longest_prefix_in(tokens, scope);
        match &r {
            Some((id, p)) => {
                self.stats.hits += 1;
                self.stats.hit_tokens += *p as u64;
                let id = id.clone();
                self.touch(&id);
            }
            None => self.stats.misses += 1,
        }
        r
    }

    /// The capsule, materialised from whatever tier holds it (host and disk: reassembled
    /// through its chain of bases, every file checksum verified).
    pub fn get(&mut self, id: &str) -> Result<Capsule> {
        self.poll()?;
        self.visible(id)?;
        self.touch(id);
        self.materialize(id)
    }

    /// Restore `session` to capsule `id`, then promote the capsule to the device tier
    /// (re-snapshotted from the restored session) if it came from a lower tier.
    pub fn restore_into(&mut self, id: &str, session: &mut Session) -> Result<RestoreInfo> {
        self.poll()?;
        let t0 = Instant::now();
        let tier = *self
            .visible(id)?
            .tiers()
            .first()
            .ok_or_else(|| Error::Capsule(format!("capsule `{id}` has no bytes")))?;
        self.touch(id);
        let cap = self.materialize(id)?;
        session.restore(&cap)?;
        let elapsed = t0.elapsed();
        if tier != Tier::Device {
            let native = session.snapshot()?;
            if device_bytes(&native) <= self.cfg.budget_device
                && let Some(e) = self.entries.get_mut(id)
            {
                e.mem = Some(Mem::Device(native));
                self.enforce(Some(id))?;
            }
        }
        Ok(RestoreInfo {
            tier,
            elapsed,
            pos: cap.pos(),
        })
    }

    /// Delete a capsule. One that others share KV rows with is hidden (no longer listed or
    /// found) until they are gone.
    pub fn remove(&mut self, id: &str) -> Result<()> {
        self.visible(id)?;
        self.index_remove(id);
        let e = self.entries.get_mut(id).expect("checked");
        if e.pins > 0 {
            e.hidden = true;
            if let (Some(dir), Some(_)) = (&self.cfg.dir, &e.disk) {
                let marker = dir.join(format!("{id}.hidden"));
                capsule_file::write_atomic(&marker, |_| Ok(0))?;
            }
            return Ok(());
        }
        self.remove_entry(id);
        Ok(())
    }

    /// Write capsule `id` to the store directory durably and pin it there: eviction never
    /// drops the file (it stays in memory too, as the budgets allow). When the disk budget
    /// cannot hold it next to the capsules already pinned, nothing changes and the call fails
    /// with [`Error::StoreFull`].
    pub fn persist(&mut self, id: &str) -> Result<()> {
        self.visible(id)?;
        let Some(dir) = self.cfg.dir.clone() else {
            return Err(Error::Unsupported(
                "this store has no directory to persist capsules to (start the server with --store-dir)"
                    .into(),
            ));
        };
        if self.entries[id].persisted {
            return Ok(());
        }
        let had_file = self.entries[id].disk.is_some();
        self.write_disk(id)?;
        let own = self.entries[id].disk.as_ref().map_or(0, |d| d.bytes);
        let pinned: u64 = self
            .entries
            .values()
            .filter(|e| e.persisted)
            .filter_map(|e| e.disk.as_ref().map(|d| d.bytes))
            .sum();
        if pinned + own > self.cfg.budget_disk {
            if !had_file
                && let Some(e) = self.entries.get_mut(id)
                && let Some(d) = e.disk.take()
            {
                let _ = std::fs::remove_file(d.path);
            }
            return Err(Error::StoreFull(format!(
                "persisting this capsule ({own} bytes) would exceed the disk budget of {} bytes: \
                 {pinned} bytes are already persisted (delete some, or start with a larger \
                 --budget-disk)",
                self.cfg.budget_disk
            )));
        }
        capsule_file::write_atomic(&dir.join(format!("{id}.pinned")), |_| Ok(0))?;
        self.entries.get_mut(id).expect("present").persisted = true;
        self.enforce(Some(id))
    }

    /// Persist every visible capsule (e.g. at shutdown); returns how many files were written.
    pub fn flush(&mut self) -> Result<usize> {
        self.settle()?;
        if self.cfg.dir.is_none() {
            return Ok(0);
        }
        let mut ids: Vec<(usize, u64, String)> = self
            .entries
            .values()
            .filter(|e| e.disk.is_none())
            .map(|e| (e.pos, e.seq, e.id.clone()))
            .collect();
        ids.sort();
        let mut n = 0;
        for (_, _, id) in ids {
            self.write_disk(&id)?;
            n += 1;
        }
        Ok(n)
    }

    /// Export capsule `id` as a standalone file (every KV row), atomically.
    pub fn export(&mut self, id: &str, path: &Path) -> Result<u64> {
        let cap = self.get(id)?;
        capsule_file::write_capsule(path, &cap)
    }

    /// Import a standalone capsule file of this store's model (for the default tenant; not
    /// trusted, see the module docs).
    pub fn import(&mut self, path: &Path) -> Result<String> {
        let cap = capsule_file::read_capsule(path, &self.model)?;
        self.insert_as(cap, Some("import".into()), "", false)
    }

    /// Import standalone capsule file bytes (default tenant, not trusted).
    pub fn import_bytes(&mut self, bytes: &[u8]) -> Result<String> {
        self.import_bytes_as(bytes, "")
    }

    /// Import standalone capsule file bytes for `owner` (not trusted).
    pub fn import_bytes_as(&mut self, bytes: &[u8], owner: &str) -> Result<String> {
        let cap = capsule_file::capsule_from_slice(bytes, &self.model)?;
        self.insert_as(cap, Some("import".into()), owner, false)
    }

    /// Import a capsule already read (from a file the caller opened) for `owner`.
    pub fn import_capsule_as(&mut self, cap: Capsule, owner: &str) -> Result<String> {
        self.insert_as(cap, Some("import".into()), owner, false)
    }

    /// Bytes `owner`'s visible capsules hold, every tier counted.
    pub fn owner_bytes(&self, owner: &str) -> u64 {
        self.entries
            .values()
            .filter(|e| !e.hidden && e.owner == owner)
            .map(|e| {
                let (d, h) = e.mem_bytes();
                d + h + e.disk.as_ref().map_or(0, |x| x.bytes)
            })
            .sum()
    }

    /// Bring `owner`'s capsules within `budget` bytes by deleting its least recently used
    /// ones that are neither persisted nor `keep`. Fails with [`Error::StoreFull`] when that is
    /// not enough (what is persisted and `keep` alone exceed the budget).
    pub fn trim_owner(&mut self, owner: &str, budget: u64, keep: &str) -> Result<()> {
        while self.owner_bytes(owner) > budget {
            let victim = self
                .entries
                .values()
                .filter(|e| !e.hidden && e.owner == owner && !e.persisted && e.id != keep)
                .min_by_key(|e| (e.last_used, e.seq))
                .map(|e| e.id.clone());
            match victim {
                Some(v) => {
                    self.stats.dropped += 1;
                    self.remove(&v)?;
                }
                None => {
                    return Err(Error::StoreFull(format!(
                        "this tenant's capsules would hold {} bytes; its budget is {budget}",
                        self.owner_bytes(owner)
                    )));
                }
            }
        }
        Ok(())
    }

    /// Counters and gauges.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.stats.clone();
        s.capsules = [0; 3];
        s.bytes = [0; 3];
        for e in self.entries.values() {
            let (d, h) = e.mem_bytes();
            if self.is_demoting(e) {
                s.demoting += 1;
                s.demoting_bytes += d;
            } else {
                s.bytes[0] += d;
            }
            if self.is_spilling(e) {
                s.spilling += 1;
                s.spilling_bytes += h;
            } else {
                s.bytes[1] += h;
            }
            if let Some(x) = &e.disk {
                s.bytes[2] += x.bytes;
            }
            if !e.hidden {
                for t in e.tiers() {
                    s.capsules[t.index()] += 1;
                }
            }
        }
        s
    }

    // -----------------------------------------------------------------------------------------
    // Representations

    fn layout(&self) -> &flashrt_ir::Layout {
        &self.model.compiled().layout
    }

    /// The KV regions (per-token state buffers) and their bytes per token, in layout order.
    fn kv_regions(&self) -> Vec<KvRegion> {
        self.layout()
            .state_buffers()
            .filter(|b| b.state.is_some_and(|k| k.per_token()))
            .map(|b| (b.id, b.bytes_per_token()))
            .collect()
    }

    /// Full host bytes of every region of `id` (KV rows `[0, pos)`) and its meta.
    fn full_regions(&mut self, id: &str) -> Result<(CapsuleMeta, Regions)> {
        // Walk the chain down to a capsule held whole, collecting each link's own rows.
        let mut links: Vec<(CapsuleMeta, Regions)> = Vec::new();
        let mut cur = id.to_string();
        for _ in 0..=self.entries.len() {
            let (meta, regions, base) = self.own_regions(&cur)?;
            links.push((meta, regions));
            match base {
                Some(b) => cur = b,
                None => break,
            }
        }
        let (meta, mut regions) = links.remove(0);
        // `links` now runs from the direct base to the root; prepend their rows root first.
        for (_, base_regions) in links.into_iter() {
            for (rid, bytes) in regions.iter_mut() {
                let b = self.model.compiled().layout.buffer(*rid);
                if !b.state.is_some_and(|k| k.per_token()) {
                    continue;
                }
                let head = base_regions
                    .iter()
                    .find(|(x, _)| x == rid)
                    .map(|(_, v)| v)
                    .ok_or_else(|| Error::Capsule(format!("base lacks region `{}`", b.name)))?;
                let mut full = Vec::with_capacity(head.len() + bytes.len());
                full.extend_from_slice(head);
                full.extend_from_slice(bytes);
                *bytes = full;
            }
        }
        Ok((meta, regions))
    }

    /// One link: the capsule's own stored regions (KV from its base's position, or whole),
    /// its meta, and its base id if the regions are a delta.
    fn own_regions(&mut self, id: &str) -> Result<(CapsuleMeta, Regions, Option<String>)> {
        let e = self
            .entries
            .get(id)
            .ok_or_else(|| Error::Capsule(format!("capsule `{id}` is missing from the store")))?;
        match &e.mem {
            Some(Mem::Device(c)) => {
                let regions = self
                    .layout()
                    .state_buffers()
                    .map(|b| Ok((b.id, c.region_bytes(b.id)?)))
                    .collect::<Result<Vec<_>>>()?;
                Ok((c.meta.clone(), regions, None))
            }
            Some(Mem::Host(h)) => Ok((
                h.meta.clone(),
                h.regions.as_ref().clone(),
                e.base_id().map(str::to_string),
            )),
            None => {
                let d = e
                    .disk
                    .as_ref()
                    .ok_or_else(|| Error::Capsule(format!("capsule `{id}` has no bytes")))?;
                let path = d.path.clone();
                let want_base = e.base.clone().flatten();
                let f = match capsule_file::read_file(&path, self.model.compiled()) {
                    Ok(f) => f,
                    Err(err) => {
                        // Damaged since it was opened: set it aside, never load it, and forget
                        // the capsule (with whatever shares its KV rows: they cannot be whole).
                        self.set_aside(&path, "corrupt");
                        if let Some(e) = self.entries.get_mut(id) {
                            e.disk = None;
                        }
                        self.drop_broken(id);
                        return Err(err);
                    }
                };
                if f.meta.base != want_base || f.meta.id.as_deref() != Some(id) {
                    return Err(Error::Capsule(format!(
                        "{}: file does not describe capsule `{id}` as stored",
                        path.display()
                    )));
                }
                let base = f.meta.base.as_ref().map(|b| b.id.clone());
                let meta = f.meta.capsule_meta(f.logits);
                Ok((meta, f.regions, base))
            }
        }
    }

    fn materialize(&mut self, id: &str) -> Result<Capsule> {
        if let Some(Mem::Device(c)) = &self.entries.get(id).and_then(|e| e.mem.as_ref()) {
            return Ok(c.clone());
        }
        let (meta, regions) = self.full_regions(id)?;
        let saved = HostSaved::new(self.layout(), meta.pos, regions)?;
        Capsule::from_parts(meta, Arc::new(saved), self.model.compiled().clone())
    }

    /// KV hashes (rows `[0, pos)`) of `id`, computed and cached on first use.
    fn kv_hashes(&mut self, id: &str) -> Result<Vec<u64>> {
        if let Some(h) = self.entries.get(id).and_then(|e| e.kv_hash.clone()) {
            return Ok(h);
        }
        let (_, regions) = self.full_regions(id)?;
        let h = self.hash_kv(&regions, &[usize::MAX]).remove(0);
        if let Some(e) = self.entries.get_mut(id) {
            e.kv_hash = Some(h.clone());
        }
        Ok(h)
    }

    /// [`hash_kv`] over this store's KV regions, on every core: demoting a 16k-token capsule
    /// of the 27B shape hashes ~1.1 GB of KV (benches/RESULTS.md, "A stall found in the logs").
    fn hash_kv(&self, regions: &[(BufferId, Vec<u8>)], prefixes: &[usize]) -> Vec<Vec<u64>> {
        hash_kv(&self.kv_regions(), regions, prefixes, all_threads())
    }

    /// Decide the base of `id` (once): the capsule with the longest token-prefix history that
    /// comes earlier in (position, insertion) order and whose KV rows match.
    fn decide_base(&mut self, id: &str, full: &[(BufferId, Vec<u8>)]) -> Result<Option<BaseRef>> {
        if let Some(b) = &self.entries[id].base {
            return Ok(b.clone());
        }
        let cands = self.base_candidates(id);
        // This capsule's KV hashed once: its whole rows and every candidate's prefix.
        let prefixes: Vec<usize> = std::iter::once(usize::MAX)
            .chain(cands.iter().map(|c| c.0))
            .collect();
        let mut hashes = self.hash_kv(full, &prefixes).into_iter();
        let own = hashes.next().expect("the whole rows' hashes");
        let mut chosen = None;
        for ((cpos, cid), prefix) in cands.into_iter().zip(hashes) {
            if self.kv_hashes(&cid)? == prefix {
                chosen = Some(BaseRef { id: cid, pos: cpos });
                break;
            }
        }
        self.settle_base(id, chosen.clone(), own);
        Ok(chosen)
    }

    /// Record `id`'s base (pinning it) and its whole-row KV hashes.
    fn settle_base(&mut self, id: &str, base: Option<BaseRef>, own: Vec<u64>) {
        if let Some(b) = &base
            && let Some(be) = self.entries.get_mut(&b.id)
        {
            be.pins += 1;
        }
        let e = self.entries.get_mut(id).expect("present");
        e.base = Some(base);
        e.kv_hash = Some(own);
    }

    /// The capsules `id` may share KV rows with, best first: `(position, id)` of visible
    /// capsules earlier in (position, insertion) order whose tokens are a prefix of `id`'s,
    /// longest (then most recently used) first, in groups with room, at most four.
    fn base_candidates(&self, id: &str) -> Vec<(usize, String)> {
        if !self.cfg.share_kv {
            return Vec::new();
        }
        let e = &self.entries[id];
        let (pos, seq, tokens) = (e.pos, e.seq, &e.tokens);
        let mut cands: Vec<(usize, u64, String)> = self
            .entries
            .values()
            .filter(|c| {
                c.id != id
                    && !c.hidden
                    && (c.pos, c.seq) < (pos, seq)
                    && c.pos > 0
                    && c.tokens[..] == tokens[..c.pos]
            })
            .map(|c| (c.pos, c.last_used, c.id.clone()))
            .collect();
        cands.sort_by_key(|c| std::cmp::Reverse((c.0, c.1)));
        // A base's whole group (every capsule whose bytes hang off the same full capsule) is
        // what one corrupt file can cost: keep it under MAX_CHAIN.
        let groups = self.group_sizes();
        cands.retain(|c| {
            groups
                .get(self.group_root(&c.2).as_str())
                .is_none_or(|&n| n < MAX_CHAIN)
        });
        cands.truncate(4);
        cands.into_iter().map(|(p, _, c)| (p, c)).collect()
    }

    /// The full capsule at the top of `id`'s chain of bases (`id` itself if it has none).
    fn group_root(&self, id: &str) -> String {
        let mut cur = id;
        for _ in 0..=self.entries.len() {
            match self.entries.get(cur).and_then(|e| e.base_id()) {
                Some(b) => cur = b,
                None => break,
            }
        }
        cur.to_string()
    }

    /// Capsules per group root (a root and every capsule whose chain leads to it).
    fn group_sizes(&self) -> HashMap<String, usize> {
        let mut sizes = HashMap::new();
        for id in self.entries.keys() {
            *sizes.entry(self.group_root(id)).or_insert(0) += 1;
        }
        sizes
    }

    /// The regions `id` stores given its base: KV rows from the base's position on.
    fn delta_of(
        &self,
        full: Vec<(BufferId, Vec<u8>)>,
        base: &Option<BaseRef>,
    ) -> Vec<(BufferId, Vec<u8>)> {
        let start = base.as_ref().map_or(0, |b| b.pos);
        if start == 0 {
            return full;
        }
        full.into_iter()
            .map(|(rid, mut bytes)| {
                let b = self.layout().buffer(rid);
                if b.state.is_some_and(|k| k.per_token()) {
                    bytes.drain(..start * b.bytes_per_token());
                }
                (rid, bytes)
            })
            .collect()
    }

    /// Device -> host: the capsule's bytes on the host, KV shared with its base.
    fn demote_device(&mut self, id: &str) -> Result<()> {
        let (meta, full) = self.full_regions(id)?;
        let base = self.decide_base(id, &full)?;
        let full_bytes = full.iter().map(|(_, v)| v.len() as u64).sum();
        let regions = self.delta_of(full, &base);
        self.keep_on_host(id, meta, regions, full_bytes);
        Ok(())
    }

    /// Replace `id`'s memory copy by host bytes: `regions` (KV from its base's position on),
    /// of `full_bytes` whole.
    /// Returns the copy it replaces.
    fn keep_on_host(
        &mut self,
        id: &str,
        meta: CapsuleMeta,
        regions: Regions,
        full_bytes: u64,
    ) -> Option<Mem> {
        let logits = meta.last_logits.as_ref().map_or(0, |l| l.0.len() * 4) as u64;
        let bytes = regions.iter().map(|(_, v)| v.len() as u64).sum::<u64>() + logits;
        self.stats.shared_bytes += full_bytes + logits - bytes;
        let e = self.entries.get_mut(id).expect("present");
        e.mem.replace(Mem::Host(HostCopy {
            meta,
            regions: Arc::new(regions),
            bytes,
        }))
    }

    /// Write `id`'s file (a delta file if it has a base) unless it has one.
    fn write_disk(&mut self, id: &str) -> Result<()> {
        if self.entries.get(id).is_some_and(|e| e.disk.is_some()) {
            return Ok(());
        }
        let f = self.file_of(id)?;
        let bytes = capsule_file::write_atomic(&f.path, |w| f.encode(w))?;
        self.file_written(id, f.path, bytes)
    }

    /// What `id`'s file holds (deciding its base if it is only on the device).
    fn file_of(&mut self, id: &str) -> Result<FileParts> {
        let Some(dir) = self.cfg.dir.clone() else {
            return Err(Error::Unsupported("no store directory".into()));
        };
        let (meta, regions) = match &self.entries[id].mem {
            Some(Mem::Host(h)) => (h.meta.clone(), h.regions.clone()),
            _ => {
                let (meta, full) = self.full_regions(id)?;
                let base = self.decide_base(id, &full)?;
                (meta, Arc::new(self.delta_of(full, &base)))
            }
        };
        let e = &self.entries[id];
        let compiled = self.model.compiled().clone();
        let mut fm = FileMeta::of(&meta, &compiled.layout);
        fm.base = e.base.clone().flatten();
        fm.id = Some(id.to_string());
        fm.label = e.label.clone();
        fm.owner = Some(e.owner.clone()).filter(|o| !o.is_empty());
        fm.trusted = e.trusted;
        Ok(FileParts {
            path: dir.join(format!("{id}.caps")),
            meta: fm,
            logits: meta.last_logits,
            regions,
            compiled,
        })
    }

    /// `id`'s file is at `path` (`bytes` long): record it (and its hidden marker).
    fn file_written(&mut self, id: &str, path: PathBuf, bytes: u64) -> Result<()> {
        let e = self.entries.get_mut(id).expect("present");
        e.disk = Some(DiskCopy { path, bytes });
        if e.hidden
            && let Some(dir) = &self.cfg.dir
        {
            capsule_file::write_atomic(&dir.join(format!("{id}.hidden")), |_| Ok(0))?;
        }
        Ok(())
    }

    /// Forget `id` and, first, every capsule whose stored bytes depend on it.
    fn drop_broken(&mut self, id: &str) {
        let deps: Vec<String> = self
            .entries
            .values()
            .filter(|e| e.base_id() == Some(id))
            .map(|e| e.id.clone())
            .collect();
        for d in deps {
            self.drop_broken(&d);
        }
        self.remove_entry(id);
    }

    /// Forget `id` entirely (its file too) and unpin its base, cascading to hidden bases.
    fn remove_entry(&mut self, id: &str) {
        self.index_remove(id);
        let Some(e) = self.entries.remove(id) else {
            return;
        };
        if let Some(d) = &e.disk {
            let _ = std::fs::remove_file(&d.path);
        }
        if let Some(dir) = &self.cfg.dir {
            let _ = std::fs::remove_file(dir.join(format!("{id}.hidden")));
            let _ = std::fs::remove_file(dir.join(format!("{id}.pinned")));
        }
        if let Some(b) = e.base_id()
            && let Some(be) = self.entries.get_mut(b)
        {
            be.pins = be.pins.saturating_sub(1);
            if be.pins == 0 && be.hidden {
                let b = b.to_string();
                self.remove_entry(&b);
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Background jobs (background.rs)

    /// Whether `e`'s device copy is being demoted in the background.
    fn is_demoting(&self, e: &Entry) -> bool {
        match &e.mem {
            Some(Mem::Device(c)) => self
                .demotions
                .iter()
                .any(|p| p.id == e.id && p.is_for(c.saved())),
            _ => false,
        }
    }

    /// Whether `e`'s host copy is being written to disk in the background.
    fn is_spilling(&self, e: &Entry) -> bool {
        match &e.mem {
            Some(Mem::Host(h)) => self
                .spills
                .iter()
                .any(|p| p.id == e.id && p.is_for(&h.regions)),
            _ => false,
        }
    }

    /// Start demoting device-tier capsule `id` in the background (after the oldest demotion in
    /// flight, if [`MAX_IN_FLIGHT`] are).
    fn demote_later(&mut self, id: &str) -> Result<()> {
        while self.demotions.len() >= MAX_IN_FLIGHT {
            let (p, r) = self.demotions.pop_front().expect("non-empty").wait();
            self.finish_demotion(p, r)?;
        }
        let Some(Mem::Device(cap)) = &self.entries[id].mem else {
            return Ok(());
        };
        let cap = cap.clone();
        let decided = self.entries[id].base.clone();
        let mut cands = Vec::new();
        if decided.is_none() {
            for (pos, cid) in self.base_candidates(id) {
                let c = &self.entries[&cid];
                let (hash, capsule) = match (&c.kv_hash, &c.mem) {
                    (Some(h), _) => (Some(h.clone()), None),
                    (None, Some(Mem::Device(cc))) => (None, Some(cc.clone())),
                    // Only capsules loaded from files lack hashes off the device: read here.
                    (None, _) => (Some(self.kv_hashes(&cid)?), None),
                };
                cands.push(background::Candidate {
                    pos,
                    id: cid,
                    hash,
                    capsule,
                });
            }
        }
        let shape = Shape {
            state: self.layout().state_buffers().map(|b| b.id).collect(),
            kv: self.kv_regions(),
        };
        let p = background::demote(id.to_string(), cap, shape, decided, cands)?;
        self.demotions.push_back(p);
        Ok(())
    }

    /// Apply a finished demotion job (see background.rs for when the store demotes the
    /// capsule itself instead, and when it drops the result).
    fn finish_demotion(&mut self, p: Demotion, r: Result<Demoted>) -> Result<()> {
        let meta = match self.entries.get(&p.id).and_then(|e| e.mem.as_ref()) {
            Some(Mem::Device(c)) if p.is_for(c.saved()) => c.meta.clone(),
            _ => return Ok(()),
        };
        let d = match r {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(
                    "background demotion of capsule {} failed ({e}); demoting it here",
                    p.id
                );
                return self.demote_device(&p.id);
            }
        };
        for (cid, h) in d.cand_hashes {
            if let Some(c) = self.entries.get_mut(&cid)
                && c.kv_hash.is_none()
            {
                c.kv_hash = Some(h);
            }
        }
        let usable = match (&self.entries[&p.id].base, &d.base) {
            (Some(decided), chosen) => decided == chosen,
            (None, None) => true,
            (None, Some(b)) => {
                self.entries.get(&b.id).is_some_and(|c| !c.hidden)
                    && self
                        .group_sizes()
                        .get(self.group_root(&b.id).as_str())
                        .is_none_or(|&n| n < MAX_CHAIN)
            }
        };
        if !usable {
            return self.demote_device(&p.id);
        }
        if self.entries[&p.id].base.is_none() {
            self.settle_base(&p.id, d.base, d.own);
        }
        let old = self.keep_on_host(&p.id, meta, d.regions, d.full_bytes);
        self.stats.background_demotions += 1;
        self.stats.background_seconds += p.started.elapsed().as_secs_f64();
        background::free_later((old, p));
        Ok(())
    }

    /// Start writing host-tier capsule `id`'s file in the background (after the oldest spill
    /// in flight, if [`MAX_IN_FLIGHT`] are); its host copy goes when the file is in place.
    fn spill_later(&mut self, id: &str) -> Result<()> {
        while self.spills.len() >= MAX_IN_FLIGHT {
            let (p, r) = self.spills.pop_front().expect("non-empty").wait();
            self.finish_spill(p, r)?;
        }
        let parts = self.file_of(id)?;
        let p = background::spill(id.to_string(), parts)?;
        self.spills.push_back(p);
        Ok(())
    }

    /// Apply a finished spill: rename its file into place, drop the host copy.
    fn finish_spill(&mut self, p: Spill, r: Result<Spilled>) -> Result<()> {
        let current = self.entries.get(&p.id).is_some_and(|e| {
            e.disk.is_none() && matches!(&e.mem, Some(Mem::Host(h)) if p.is_for(&h.regions))
        });
        let f = match r {
            Ok(f) => f,
            Err(e) if current => {
                tracing::warn!(
                    "writing capsule {}'s file in the background failed ({e}); writing it here",
                    p.id
                );
                self.write_disk(&p.id)?;
                self.entries.get_mut(&p.id).expect("present").mem = None;
                return Ok(());
            }
            Err(_) => return Ok(()),
        };
        if !current {
            let _ = std::fs::remove_file(&f.tmp);
            return Ok(());
        }
        capsule_file::commit_temp(&f.tmp, &f.path)?;
        self.file_written(&p.id, f.path, f.bytes)?;
        let old = self.entries.get_mut(&p.id).expect("present").mem.take();
        self.stats.background_spills += 1;
        self.stats.background_seconds += p.started.elapsed().as_secs_f64();
        background::free_later((old, p));
        Ok(())
    }

    /// Apply the background jobs that have finished, then enforce the budgets again (the
    /// tiers below grew); returns how many were applied. Cheap when none is in flight; every
    /// operation of the store starts with it, and an owner that waits for other work (a
    /// server's idle worker) calls it while [`CapsuleStore::busy`].
    pub fn poll(&mut self) -> Result<usize> {
        // Only jobs started before this call: one a finished demotion starts (a spill of what
        // it pushed over the host budget) is left for the next.
        let (mut demotions, mut spills) = (self.demotions.len(), self.spills.len());
        let mut n = 0;
        while demotions > 0
            && let Some(r) = self.demotions.front().and_then(|p| p.try_take())
        {
            let p = self.demotions.pop_front().expect("non-empty");
            self.finish_demotion(p, r)?;
            demotions -= 1;
            n += 1;
        }
        while spills > 0
            && let Some(r) = self.spills.front().and_then(|p| p.try_take())
        {
            let p = self.spills.pop_front().expect("non-empty");
            self.finish_spill(p, r)?;
            spills -= 1;
            n += 1;
        }
        if n > 0 {
            self.enforce(None)?;
        }
        Ok(n)
    }

    /// Wait for every background job and apply it (and what the budgets then ask for).
    pub fn settle(&mut self) -> Result<()> {
        while self.busy() {
            while let Some(p) = self.demotions.pop_front() {
                let (p, r) = p.wait();
                self.finish_demotion(p, r)?;
            }
            while let Some(p) = self.spills.pop_front() {
                let (p, r) = p.wait();
                self.finish_spill(p, r)?;
            }
            self.enforce(None)?;
        }
        Ok(())
    }

    /// Whether background jobs are in flight.
    pub fn busy(&self) -> bool {
        !self.demotions.is_empty() || !self.spills.is_empty()
    }

    // -----------------------------------------------------------------------------------------
    // Eviction

    /// The least recently used entry matching `f`, preferring any other than `protect`.
    fn lru(&self, protect: Option<&str>, f: impl Fn(&Entry) -> bool) -> Option<String> {
        let pick = |skip: Option<&str>| {
            self.entries
                .values()
                .filter(|e| Some(e.id.as_str()) != skip && f(e))
                .min_by_key(|e| (e.last_used, e.seq))
                .map(|e| e.id.clone())
        };
        pick(protect).or_else(|| pick(None))
    }

    fn enforce(&mut self, protect: Option<&str>) -> Result<()> {
        loop {
            let s = self.stats();
            if s.bytes[0] > self.cfg.budget_device {
                let Some(v) = self.lru(protect, |e| {
                    matches!(e.mem, Some(Mem::Device(_))) && !self.is_demoting(e)
                }) else {
                    break;
                };
                if self.cfg.background {
                    self.demote_later(&v)?;
                } else {
                    self.demote_device(&v)?;
                }
                self.stats.evictions[0] += 1;
            } else if s.bytes[1] > self.cfg.budget_host {
                let Some(v) = self.lru(protect, |e| {
                    matches!(e.mem, Some(Mem::Host(_))) && !self.is_spilling(e)
                }) else {
                    break;
                };
                self.stats.evictions[1] += 1;
                if self.cfg.dir.is_some() {
                    if self.cfg.background && self.entries[&v].disk.is_none() {
                        self.spill_later(&v)?;
                    } else {
                        self.write_disk(&v)?;
                        self.entries.get_mut(&v).expect("present").mem = None;
                    }
                } else if !self.drop_leaf(&v, protect) {
                    break;
                }
            } else if self.cfg.dir.is_some() && s.bytes[2] > self.cfg.budget_disk {
                self.stats.evictions[2] += 1;
                if let Some(v) = self.lru(protect, |e| {
                    e.disk.is_some() && e.mem.is_some() && !e.persisted
                }) {
                    // Still in memory (which is what a restore reads first): drop only the
                    // file; nothing is lost until the process ends.
                    let e = self.entries.get_mut(&v).expect("present");
                    if let Some(d) = e.disk.take() {
                        let _ = std::fs::remove_file(d.path);
                    }
                } else if let Some(v) = self.lru(protect, |e| e.disk.is_some() && !e.persisted) {
                    if !self.drop_leaf(&v, protect) {
                        break;
                    }
                } else {
                    break;
                }
            } else {
                break;
            }
        }
        Ok(())
    }

    /// Drop `v` if nothing depends on it, else the least recently used capsule nothing depends
    /// on (every chain ends in one, so this frees something while the store is not empty).
    fn drop_leaf(&mut self, v: &str, protect: Option<&str>) -> bool {
        let victim = if self.entries[v].pins == 0 && !self.entries[v].persisted {
            Some(v.to_string())
        } else {
            self.lru(protect, |e| e.pins == 0 && !e.persisted)
        };
        match victim {
            Some(x) => {
                self.stats.dropped += 1;
                self.remove_entry(&x);
                true
            }
            None => false,
        }
    }
}
