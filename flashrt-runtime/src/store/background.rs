//! Background work of the store: the slow halves of moving a capsule down the tiers.
//!
//! * **Demotion** (device -> host) copies every region to the host (a 16k-token capsule of
//!   the 27B shape is 1.2 GiB: tens of milliseconds over PCIe) and hashes its KV rows against
//!   its candidate bases.
//! * **Spill** (host -> disk) encodes the capsule file (checksums over every byte) and fsyncs
//!   it: seconds for a GiB on a slow disk.
//!
//! On the thread that owns the store (a server's worker, which also steps every generating
//! session) either is a stall every stream feels. With [`StoreConfig::background`] the store
//! hands the work to a thread of its own and *applies* the result on its own thread when the
//! job is done ([`CapsuleStore::poll`], or its next operation), in O(1) work per region.
//!
//! A demotion's thread reads the capsule's regions (its saved state is immutable and
//! `Send + Sync`; on CUDA the copies run on the legacy stream of another thread, which does not
//! wait for the worker's non-blocking streams), hashes its KV rows, picks its base among the
//! candidates the store gave it (their hashes as the store knew them, or computed there for
//! device capsules the store had not hashed yet) and cuts the delta; applying it checks the
//! base is still there, installs the host copy and frees the device copy. A spill's thread
//! writes the file under a temporary name (what a store opened later deletes as a leftover of
//! an interrupted write); applying it renames the file into place and drops the host copy.
//!
//! Meanwhile the capsule stays in its tier, restorable from there; its bytes count as
//! *demoting* / *spilling* rather than against that tier's budget
//! ([`StoreStats::demoting_bytes`], [`StoreStats::spilling_bytes`]). At most [`MAX_IN_FLIGHT`]
//! jobs of each kind run at once. One more waits for the oldest, so the memory held past a
//! budget is bounded by one capsule, which is what the synchronous path holds too between the
//! insertion that triggers it and its end; unless the tier is within its slack
//! ([`StoreConfig::slack_device`], [`StoreConfig::slack_host`]): then the store leaves the tier
//! over budget and moves the next capsule down when the job in flight is applied, so that no
//! insertion waits for a copy (a server sets it; the bound is then one capsule plus the slack).
//!
//! A finished job is applied only to the copy it was started for: if the entry was removed,
//! or moved and brought back meanwhile, or got its file another way (a persist), the result is
//! dropped (copies are compared by identity; a spill's temporary file is deleted). When a
//! demotion's base is no longer usable (deleted meanwhile, its group full) or the capsule's
//! base was decided otherwise meanwhile (a persist), and when a job failed, the store does the
//! work on its own thread as without this module: rare, and the copy is still there to read.
//!
//! [`StoreConfig::background`]: super::StoreConfig::background
//! [`StoreConfig::slack_device`]: super::StoreConfig::slack_device
//! [`StoreConfig::slack_host`]: super::StoreConfig::slack_host
//! [`CapsuleStore::poll`]: super::CapsuleStore::poll
//! [`StoreStats::demoting_bytes`]: super::StoreStats::demoting_bytes
//! [`StoreStats::spilling_bytes`]: super::StoreStats::spilling_bytes

use super::hash::{KvRegion, all_threads, hash_kv};
use super::{CapsuleStore, Entry, FileParts, MAX_CHAIN, Mem, Regions};
use crate::SavedState;
use crate::capsule::Capsule;
use crate::capsule_file::{self, BaseRef};
use crate::error::{Error, Result};
use crate::host_pool::HostPool;
use flashrt_ir::BufferId;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Instant;

/// Jobs of each kind in flight at once.
pub const MAX_IN_FLIGHT: usize = 1;

/// A candidate base, as the store knows it when the job starts.
pub(super) struct Candidate {
    pub pos: usize,
    pub id: String,
    /// Its whole KV rows' hashes, if the store has them.
    pub hash: Option<Vec<u64>>,
    /// Else its device copy, to hash them from.
    pub capsule: Option<Capsule>,
}

/// What a job computes off the store's thread.
pub(super) struct Demoted {
    /// The chosen base (or the one decided before the job started), if any.
    pub base: Option<BaseRef>,
    /// Every state region, KV rows from the base's position on.
    pub regions: Regions,
    /// Bytes of every region whole (KV rows `[0, pos)`).
    pub full_bytes: u64,
    /// The capsule's whole KV rows' hashes.
    pub own: Vec<u64>,
    /// Whole-row KV hashes of candidates that came without them.
    pub cand_hashes: Vec<(String, Vec<u64>)>,
}

/// A job in flight for entry `id`, started for the copy `keep` points at (an entry's device
/// state for a demotion, its host regions for a spill): its result applies only while the
/// entry still holds that very copy.
pub(super) struct Job<T, K: ?Sized> {
    pub id: String,
    keep: Arc<K>,
    pub started: Instant,
    rx: mpsc::Receiver<Result<T>>,
}

/// A demotion (device -> host) in flight.
pub(super) type Demotion = Job<Demoted, dyn SavedState>;
/// A spill (host -> disk) in flight.
pub(super) type Spill = Job<Spilled, Regions>;

impl<T, K: ?Sized> Job<T, K> {
    /// Whether `k` is the copy this job was started for.
    pub fn is_for(&self, k: &Arc<K>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.keep), Arc::as_ptr(k))
    }

    /// The result if the job has finished.
    pub fn try_take(&self) -> Option<Result<T>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(lost())),
        }
    }

    /// The result, waiting for the job.
    pub fn wait(self) -> (Self, Result<T>) {
        let r = self.rx.recv().unwrap_or_else(|_| Err(lost()));
        (self, r)
    }
}

/// Run `work` on a new thread (once `hold` is clear); the job applies to `id` while it holds
/// `keep`.
fn start<T: Send + 'static, K: ?Sized>(
    id: String,
    keep: Arc<K>,
    what: &str,
    hold: Arc<AtomicBool>,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<Job<T, K>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name(format!("flashrt-{what}"))
        .spawn(move || {
            while hold.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let _ = tx.send(work());
        })
        .map_err(|e| Error::Capsule(format!("start a {what} thread: {e}")))?;
    Ok(Job {
        id,
        keep,
        started: Instant::now(),
        rx,
    })
}

/// Drop `x` (a copy that just left its tier, and the job that held it too) on a thread of its
/// own: giving a GiB back to the system unmaps a quarter of a million pages, tens of
/// milliseconds the store's thread should not spend.
pub(super) fn free_later<T: Send + 'static>(x: T) {
    if let Err(e) = std::thread::Builder::new()
        .name("flashrt-free".into())
        .spawn(move || drop(x))
    {
        // The failed spawn dropped the closure, and `x` with it, on this thread.
        tracing::warn!("could not start a thread to free a capsule copy: {e}");
    }
}

impl CapsuleStore {
    /// Give the buffers of `old` (a copy that just left its tier) to the host pool where it is
    /// a host copy nothing else holds, for the next capsule read from the device; the rest is
    /// freed off this thread ([`free_later`]).
    pub(super) fn recycle(&self, old: Option<Mem>) {
        let Some(Mem::Host(h)) = old else {
            if old.is_some() {
                free_later(old);
            }
            return;
        };
        match Arc::try_unwrap(h.regions) {
            Ok(regions) => {
                let rest: Vec<Vec<u8>> = regions
                    .into_iter()
                    .filter_map(|(_, v)| self.pool.give(v))
                    .collect();
                if !rest.is_empty() {
                    free_later(rest);
                }
            }
            Err(shared) => free_later(shared),
        }
    }
}

fn lost() -> Error {
    Error::Capsule("a background store job ended without a result".into())
}

/// What a job needs to know of the layout.
pub(super) struct Shape {
    /// Every state region, in layout order.
    pub state: Vec<BufferId>,
    pub kv: Vec<KvRegion>,
}

/// Start demoting `capsule` (entry `id`) on a new thread: copy its regions to the host, hash
/// its KV rows, take as base `decided` (a base settled before) or else the first of `cands`
/// whose whole rows hash as this capsule's first rows, and keep only the rows past it.
pub(super) fn demote(
    id: String,
    hold: Arc<AtomicBool>,
    pool: Arc<HostPool>,
    capsule: Capsule,
    shape: Shape,
    decided: Option<Option<BaseRef>>,
    cands: Vec<Candidate>,
) -> Result<Demotion> {
    let saved = capsule.saved().clone();
    start(id, saved, "demote", hold, move || {
        run(&capsule, &shape, decided, cands, &pool)
    })
}

/// A capsule file written beside its final path, fsynced, not yet renamed into place.
pub(super) struct Spilled {
    pub tmp: PathBuf,
    pub path: PathBuf,
    pub bytes: u64,
}

/// Start writing entry `id`'s file from `parts` on a new thread, as a temporary file (a store
/// opened later deletes it if the job never lands); the store renames it into place when it
/// applies the job.
pub(super) fn spill(id: String, hold: Arc<AtomicBool>, parts: FileParts) -> Result<Spill> {
    let keep = parts.regions.clone();
    start(id, keep, "spill", hold, move || {
        let (tmp, bytes) = capsule_file::write_temp(&parts.path, |w| parts.encode(w))?;
        Ok(Spilled {
            tmp,
            path: parts.path,
            bytes,
        })
    })
}

/// `capsule`'s regions `ids` read to the host into buffers from `pool`.
pub(super) fn read_regions(
    capsule: &Capsule,
    ids: &[BufferId],
    pool: &HostPool,
) -> Result<Regions> {
    ids.iter()
        .map(|&b| {
            let buf = pool.take(capsule.region_len(b));
            Ok((b, capsule.region_bytes_into(b, buf)?))
        })
        .collect()
}

fn run(
    capsule: &Capsule,
    shape: &Shape,
    decided: Option<Option<BaseRef>>,
    cands: Vec<Candidate>,
    pool: &HostPool,
) -> Result<Demoted> {
    // Leave a core to the thread that owns the store: it launches every stream's steps.
    let threads = all_threads().saturating_sub(1).max(1);
    let t0 = Instant::now();
    let full = read_regions(capsule, &shape.state, pool)?;
    // This capsule's KV hashed once: its whole rows and every candidate's prefix.
    let prefixes: Vec<usize> = std::iter::once(usize::MAX)
        .chain(cands.iter().map(|c| c.pos))
        .collect();
    let t1 = Instant::now();
    let mut hashes = hash_kv(&shape.kv, &full, &prefixes, threads).into_iter();
    let own = hashes.next().expect("the whole rows' hashes");
    let t2 = Instant::now();
    let mut cand_hashes = Vec::new();
    let mut chosen = None;
    if decided.is_none() {
        for (c, prefix) in cands.into_iter().zip(hashes) {
            let theirs = match (c.hash, &c.capsule) {
                (Some(h), _) => h,
                (None, Some(cap)) => {
                    let ids: Vec<BufferId> = shape.kv.iter().map(|&(b, _)| b).collect();
                    let kv = read_regions(cap, &ids, pool)?;
                    let h = hash_kv(&shape.kv, &kv, &[usize::MAX], threads).remove(0);
                    // Read only to be hashed: its buffers serve the next read.
                    for (_, v) in kv {
                        drop(pool.give(v));
                    }
                    cand_hashes.push((c.id.clone(), h.clone()));
                    h
                }
                (None, None) => continue,
            };
            if theirs == prefix {
                chosen = Some(BaseRef {
                    id: c.id,
                    pos: c.pos,
                });
                break;
            }
        }
    }
    let base = decided.unwrap_or(chosen);
    let t3 = Instant::now();
    let full_bytes = full.iter().map(|(_, v)| v.len() as u64).sum();
    let regions = super::sharing::delta(&shape.kv, full, &base);
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    tracing::debug!(
        "demotion job: {full_bytes} bytes copied in {:.1} ms, hashed in {:.1} ms, candidates {:.1} ms, delta {:.1} ms",
        ms(t0, t1),
        ms(t1, t2),
        ms(t2, t3),
        ms(t3, Instant::now())
    );
    Ok(Demoted {
        base,
        regions,
        full_bytes,
        own,
        cand_hashes,
    })
}

/// The store's side: starting jobs, applying their results.
impl CapsuleStore {
    /// Whether `e`'s device copy is being demoted in the background.
    pub(super) fn is_demoting(&self, e: &Entry) -> bool {
        match &e.mem {
            Some(Mem::Device(c)) => self
                .demotions
                .iter()
                .any(|p| p.id == e.id && p.is_for(c.saved())),
            _ => false,
        }
    }

    /// Whether `e`'s host copy is being written to disk in the background.
    pub(super) fn is_spilling(&self, e: &Entry) -> bool {
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
    pub(super) fn demote_later(&mut self, id: &str) -> Result<()> {
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
                cands.push(Candidate {
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
        let p = demote(
            id.to_string(),
            self.hold.clone(),
            self.pool.clone(),
            cap,
            shape,
            decided,
            cands,
        )?;
        self.demotions.push_back(p);
        Ok(())
    }

    /// Apply a finished demotion job (see background.rs for when the store demotes the
    /// capsule itself instead, and when it drops the result).
    pub(super) fn finish_demotion(&mut self, p: Demotion, r: Result<Demoted>) -> Result<()> {
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
        free_later((old, p));
        Ok(())
    }

    /// Start writing host-tier capsule `id`'s file in the background (after the oldest spill
    /// in flight, if [`MAX_IN_FLIGHT`] are); its host copy goes when the file is in place.
    pub(super) fn spill_later(&mut self, id: &str) -> Result<()> {
        while self.spills.len() >= MAX_IN_FLIGHT {
            let (p, r) = self.spills.pop_front().expect("non-empty").wait();
            self.finish_spill(p, r)?;
        }
        let parts = self.file_of(id)?;
        let p = spill(id.to_string(), self.hold.clone(), parts)?;
        self.spills.push_back(p);
        Ok(())
    }

    /// Apply a finished spill: rename its file into place, drop the host copy.
    pub(super) fn finish_spill(&mut self, p: Spill, r: Result<Spilled>) -> Result<()> {
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
                let old = self.entries.get_mut(&p.id).expect("present").mem.take();
                drop(p);
                self.recycle(old);
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
        // The job shares the host copy: dropped first, so that its buffers can be pooled.
        drop(p);
        self.recycle(old);
        Ok(())
    }

    /// [`CapsuleStore::poll`] at the start of an operation: what went wrong applying another
    /// capsule's job (its own fallback failing) is logged, not made this operation's error.
    pub(super) fn poll_quietly(&mut self) {
        if let Err(e) = self.poll() {
            tracing::warn!("capsule store: applying a background job: {e}");
        }
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

    /// Whether inserting a device capsule of `bytes` now would wait for a demotion in flight
    /// (the device tier past its budget and slack with one more job needed; only with
    /// [`StoreConfig::background`]: on the store's thread the insertion demotes anyway). A
    /// server skips an automatic capsule then rather than stall every stream: it is a cache
    /// entry, and the next one comes with the next request.
    ///
    /// [`StoreConfig::background`]: super::StoreConfig::background
    pub fn insert_would_wait(&self, bytes: u64) -> bool {
        let (c, jobs) = (&self.cfg, self.demotions.len());
        // Moving one more capsule down with a job in flight is what waits (`demote_later`).
        c.background
            && jobs >= MAX_IN_FLIGHT
            && self.must_move(
                self.stats().bytes[0] + bytes,
                c.budget_device,
                c.slack_device,
                jobs,
            )
    }
}
