//! Background demotion: the slow half of moving a capsule from the device tier to the host.
//!
//! Demoting a capsule copies every region to the host (a 16k-token capsule of the 27B shape is
//! 1.2 GiB: tens of milliseconds over PCIe) and hashes its KV rows against its candidate bases.
//! On the thread that owns the store (a server's worker, which also steps every generating
//! session) that is a stall every stream feels. With [`StoreConfig::background`] the store
//! hands the victim to a thread of its own instead. The thread reads the capsule's regions
//! (its saved state is immutable and `Send + Sync`; on CUDA the copies run on the legacy
//! stream of another thread, which does not wait for the worker's non-blocking streams),
//! hashes its KV rows, picks its base among the candidates the store gave it (their hashes as
//! the store knew them, or computed there for device capsules the store had not hashed yet)
//! and cuts the delta. The store *finishes* the demotion on its own thread when the job is
//! done, in O(1) work per region: it checks the base is still there, installs the host copy
//! and frees the device copy.
//!
//! Meanwhile the capsule stays on the device tier, restorable from there; its bytes count as
//! *demoting* rather than against the device budget ([`StoreStats::demoting_bytes`]). At most
//! [`MAX_IN_FLIGHT`] demotions run at once: one more waits for the oldest, so the device
//! memory held past the budget is bounded by one capsule, which is what a synchronous
//! demotion holds too between the insertion that triggers it and its end.
//!
//! A finished job is applied only to the capsule it was started for: if the entry was removed,
//! or demoted and promoted again meanwhile, the result is dropped (the saved state is compared
//! by identity). When the base it chose is no longer usable (deleted meanwhile, its group
//! full) or the capsule's base was decided otherwise meanwhile (a persist), and when the job
//! failed, the store demotes the capsule on its own thread as without this module: rare, and
//! the device copy is still there to read.
//!
//! [`StoreConfig::background`]: super::StoreConfig::background
//! [`StoreStats::demoting_bytes`]: super::StoreStats::demoting_bytes

use super::Regions;
use super::hash::{KvRegion, all_threads, hash_kv};
use crate::SavedState;
use crate::capsule::Capsule;
use crate::capsule_file::BaseRef;
use crate::error::{Error, Result};
use flashrt_ir::BufferId;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Instant;

/// Demotions in flight at once.
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

/// A demotion in flight.
pub(super) struct Pending {
    pub id: String,
    /// The saved state being demoted (compared by identity when the job is applied).
    pub saved: Arc<dyn SavedState>,
    pub started: Instant,
    rx: mpsc::Receiver<Result<Demoted>>,
}

impl Pending {
    /// Whether `saved` is the state this job demotes.
    pub fn is_for(&self, saved: &Arc<dyn SavedState>) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.saved), Arc::as_ptr(saved))
    }

    /// The result if the job has finished.
    pub fn try_take(&self) -> Option<Result<Demoted>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(lost())),
        }
    }

    /// The result, waiting for the job.
    pub fn wait(self) -> (Pending, Result<Demoted>) {
        let r = self.rx.recv().unwrap_or_else(|_| Err(lost()));
        (self, r)
    }
}

fn lost() -> Error {
    Error::Capsule("the demotion thread ended without a result".into())
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
pub(super) fn spawn(
    id: String,
    capsule: Capsule,
    shape: Shape,
    decided: Option<Option<BaseRef>>,
    cands: Vec<Candidate>,
) -> Result<Pending> {
    let (tx, rx) = mpsc::channel();
    let saved = capsule.saved().clone();
    std::thread::Builder::new()
        .name("flashrt-demote".into())
        .spawn(move || {
            let _ = tx.send(run(&capsule, &shape, decided, cands));
        })
        .map_err(|e| Error::Capsule(format!("start a demotion thread: {e}")))?;
    Ok(Pending {
        id,
        saved,
        started: Instant::now(),
        rx,
    })
}

fn run(
    capsule: &Capsule,
    shape: &Shape,
    decided: Option<Option<BaseRef>>,
    cands: Vec<Candidate>,
) -> Result<Demoted> {
    // Leave a core to the thread that owns the store: it launches every stream's steps.
    let threads = all_threads().saturating_sub(1).max(1);
    let full = shape
        .state
        .iter()
        .map(|&b| Ok((b, capsule.region_bytes(b)?)))
        .collect::<Result<Regions>>()?;
    // This capsule's KV hashed once: its whole rows and every candidate's prefix.
    let prefixes: Vec<usize> = std::iter::once(usize::MAX)
        .chain(cands.iter().map(|c| c.pos))
        .collect();
    let mut hashes = hash_kv(&shape.kv, &full, &prefixes, threads).into_iter();
    let own = hashes.next().expect("the whole rows' hashes");
    let mut cand_hashes = Vec::new();
    let mut chosen = None;
    if decided.is_none() {
        for (c, prefix) in cands.into_iter().zip(hashes) {
            let theirs = match (c.hash, &c.capsule) {
                (Some(h), _) => h,
                (None, Some(cap)) => {
                    let kv = shape
                        .kv
                        .iter()
                        .map(|&(b, _)| Ok((b, cap.region_bytes(b)?)))
                        .collect::<Result<Regions>>()?;
                    let h = hash_kv(&shape.kv, &kv, &[usize::MAX], threads).remove(0);
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
    let full_bytes = full.iter().map(|(_, v)| v.len() as u64).sum();
    let start = base.as_ref().map_or(0, |b| b.pos);
    let regions = full
        .into_iter()
        .map(|(b, bytes)| match shape.kv.iter().find(|k| k.0 == b) {
            Some(&(_, per_token)) if start > 0 => (b, bytes[start * per_token..].to_vec()),
            _ => (b, bytes),
        })
        .collect();
    Ok(Demoted {
        base,
        regions,
        full_bytes,
        own,
        cand_hashes,
    })
}
