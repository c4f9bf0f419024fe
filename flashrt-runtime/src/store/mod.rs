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
//!   [`CapsuleStore::open`] reloads them (reading and verifying each file's header, metadata
//!   and region table, deleting leftovers of interrupted writes, renaming corrupt files to
//!   `*.corrupt`); a file's region bytes are verified when they are first read, and a file
//!   that fails then is set aside with whatever shares its KV rows. Opening costs kilobytes
//!   per capsule, not the whole disk tier.
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
//! capsule keeps only the rows past the base's position. A restore walks the chain and copies
//! each link's rows into place one after the other (a chained [`HostSaved`]): the result is
//! byte-identical to the capsule as it was snapshotted.
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
//! [`CapsuleStore::poll`]); `background.rs` has the rules.
//!
//! # Prefix reuse
//!
//! [`CapsuleStore::longest_prefix`] finds the stored capsule whose token history is the
//! longest prefix of a request's tokens, at any position: every capsule is indexed by
//! `(position, hash of its tokens)`, the request's prefix hashes are computed in one pass, and a
//! candidate's tokens are compared before it is returned.
//!
//! # Where things are
//!
//! This file: the types and the public operations. `sharing.rs`: bases, deltas and the chains
//! a restore walks; `evict.rs`: budgets and eviction; `files.rs`: the disk tier (writing files,
//! loading a directory); `background.rs`: demotions and spills off the store's thread;
//! `hash.rs`: KV-row hashes.

mod background;
mod evict;
mod files;
mod hash;
mod sharing;

pub use background::MAX_IN_FLIGHT;

use crate::capsule::{Capsule, CapsuleMeta};
use crate::capsule_file::{self, BaseRef, FileMeta};
use crate::error::{Error, Result};
use crate::host_pool::HostPool;
use crate::host_state::{HostSaved, Regions};
use crate::session::{Model, Session};
use background::{Demotion, Spill};
use files::FileParts;
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
    /// Bytes the device tier may hold past `budget_device` while a background demotion is in
    /// flight, rather than wait for it before starting the next (with `background`); the next
    /// starts when the first is applied ([`CapsuleStore::poll`]). A server whose worker steps
    /// every stream sets it so that no capsule insertion waits for a previous copy; 0 keeps
    /// the tier within one capsule of its budget at every moment.
    pub slack_device: u64,
    /// The same for the host tier and a background spill.
    pub slack_host: u64,
    /// Tests: a flag that, while set, keeps background jobs from beginning, so that a test can
    /// observe the store (or a server's, through its config) with jobs in flight whatever the
    /// machine's speed. `None`: never held.
    #[doc(hidden)]
    pub gate: Option<Arc<std::sync::atomic::AtomicBool>>,
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
            slack_device: 0,
            slack_host: 0,
            gate: None,
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
    /// Host buffers of copies that left memory, kept for the next copies read from the device
    /// (`host_pool.rs`), and the bytes read into such reused buffers since the store opened.
    pub pooled_bytes: u64,
    pub pool_reused_bytes: u64,
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

/// Host-tier bytes: fixed regions whole, KV regions from the base's position on.
struct HostCopy {
    meta: CapsuleMeta,
    /// Shared with a background write of its file (a spill), if one runs.
    regions: Arc<Regions>,
    bytes: u64,
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
    /// The inserted capsule's [`Capsule::kv_rows`], kept on whatever tier holds it, so a
    /// session holding its rows skips them on restore.
    kv: crate::capsule::KvRows,
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

/// A hash over token ids, one step per token, so every prefix's hash comes in one pass over a
/// prompt: a multiply and a rotation per id (a 16k-token prompt's chain in ~25 us on the build
/// machine, against ~81 us for byte-wise FNV-1a, whose four dependent multiplies per id were a
/// fifth of a stored prompt's admission). The index is in memory only (rebuilt from each
/// entry's tokens), and a hit is confirmed by comparing the tokens themselves.
fn hash_step(h: u64, t: u32) -> u64 {
    (h ^ t as u64)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(29)
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
    /// While set, background jobs wait to begin ([`StoreConfig::gate`]).
    hold: Arc<std::sync::atomic::AtomicBool>,
    /// Buffers of host copies that left memory, for the next copies read from the device.
    pool: Arc<HostPool>,
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
    /// (header, metadata and region table verified; region bytes when first read), leftovers of interrupted writes are deleted, and corrupt or
    /// orphaned files are renamed `*.corrupt` / `*.orphan` and never loaded.
    pub fn open(model: Model, cfg: StoreConfig) -> Result<CapsuleStore> {
        // Half the host tier's budget (at most 8 GiB): one capsule leaving the host while
        // another comes down is the steady state.
        let pool_cap = (cfg.budget_host / 2).min(8 << 30) as usize;
        let hold = cfg.gate.clone().unwrap_or_default();
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
            hold,
            pool: Arc::new(HostPool::new(pool_cap)),
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
        self.poll_quietly();
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
            kv: capsule.kv_rows().clone(),
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
        self.poll_quietly();
        self.visible(id)?;
        self.touch(id);
        self.materialize(id)
    }

    /// Restore `session` to capsule `id`, then promote the capsule to the device tier
    /// (re-snapshotted from the restored session) if it came from a lower tier.
    pub fn restore_into(&mut self, id: &str, session: &mut Session) -> Result<RestoreInfo> {
        self.poll_quietly();
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
        let (pos, promote) = (cap.pos(), device_bytes(&cap) <= self.cfg.budget_device);
        // It may share the host copy's bytes: dropped first, so that they can be pooled.
        drop(cap);
        // Promoted when it fits the device tier (the snapshot is byte for byte the capsule).
        if tier != Tier::Device && promote {
            let native = session.snapshot()?;
            if let Some(e) = self.entries.get_mut(id) {
                // The host copy (a GiB at 16k tokens of the 27B shape) goes to the pool, or is
                // freed off this thread.
                let old = e.mem.replace(Mem::Device(native));
                self.recycle(old);
                self.enforce(Some(id))?;
            }
        }
        Ok(RestoreInfo { tier, elapsed, pos })
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
        s.pooled_bytes = self.pool.bytes() as u64;
        s.pool_reused_bytes = self.pool.reused();
        s
    }
}
