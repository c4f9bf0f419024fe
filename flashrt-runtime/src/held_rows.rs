//! Which K/V rows a session holds ([`crate::Capsule::kv_rows`]), so that a restore of a
//! capsule whose rows it holds already copies only the rest: the bookkeeping behind
//! [`crate::Session::rows_held`].

use crate::capsule::{Capsule, KvRows, MAX_KV_PAIRS};

/// Whether restores skip the rows a session holds already (`FLASHRT_RESTORE_REUSE=0` copies
/// every row, for measuring what the skip saves).
pub(crate) fn reuse_held_rows() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLASHRT_RESTORE_REUSE").map_or(true, |v| v != "0"))
}

/// The per-position (KV) rows a session's state holds, as [`KvRows`] pairs: for each
/// `(id, rows)`, rows `[0, rows)` are those of the capsules named `id`. Set by a restore to
/// the capsule's pairs and extended by a snapshot; every step of the model (decode,
/// prefill, verify, batched) writes rows at or past the position only, and the position goes
/// back only through a reset or a restore, which set this anew — so the rows stay held while
/// the session moves on. The MTP drafter is the exception: its step for the token at
/// position `p` writes its own K/V row `p - 1` (the row it could not write before that token
/// was known), so a speculative round gives up the row below the position
/// ([`HeldRows::written_from`]). Behind a lock because [`crate::Session::snapshot`] takes
/// `&self`.
#[derive(Default)]
pub(crate) struct HeldRows(std::sync::Mutex<Vec<(u64, usize)>>);

impl HeldRows {
    fn pairs(&self) -> std::sync::MutexGuard<'_, Vec<(u64, usize)>> {
        // A panic while holding it leaves a valid list (every update is one assignment).
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn forget(&self) {
        self.pairs().clear();
    }
    /// Something writes rows from `row` on: rows past it are held no more.
    pub(crate) fn written_from(&self, row: usize) {
        for p in self.pairs().iter_mut() {
            p.1 = p.1.min(row);
        }
    }
    pub(crate) fn set(&self, kv: &KvRows) {
        let mut p = self.pairs();
        p.clear();
        p.extend_from_slice(kv);
    }
    /// Leading rows of `c` the state holds already.
    pub(crate) fn of(&self, c: &Capsule) -> usize {
        let held = self.pairs();
        let mut best = 0;
        for &(id, rows) in held.iter() {
            for &(cid, crows) in c.kv_rows().iter() {
                if id == cid {
                    best = best.max(rows.min(crows));
                }
            }
        }
        best.min(c.pos())
    }
    /// The pairs of a snapshot at `pos`: the session's, with the snapshot's own last — the
    /// id of a pair holding all `pos` rows, or a fresh one.
    pub(crate) fn snapshot_at(&self, pos: usize) -> KvRows {
        let mut p = self.pairs();
        let own = match p.iter().rev().find(|&&(_, r)| r == pos) {
            Some(&(id, _)) => id,
            None => crate::capsule::fresh_kv_id(),
        };
        p.retain(|&(id, _)| id != own);
        p.push((own, pos));
        if p.len() > MAX_KV_PAIRS {
            let extra = p.len() - MAX_KV_PAIRS;
            p.drain(..extra);
        }
        p.as_slice().into()
    }
}
