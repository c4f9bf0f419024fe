//! How many sessions, and how large a device tier of the capsule store, fit in the device
//! memory the weights leave free — the defaults of `--max-sessions` and `--budget-device` on a
//! backend that reports its free memory (CUDA).
//!
//! A session owns only its state arena (`Model::session_bytes`: every position up to
//! `max_seq` preallocated, as the capsule contract needs); scratch and I/O are shared by all
//! sessions of the model (`Model::shared_bytes`). What is left after the shared arenas and a
//! reserve (graphs, cuBLASLt, allocator slack) is split: a quarter (at most 64 GiB) for the
//! device tier (its budget, and the slack of one capsule it may hold past it while the previous
//! one is copied down in the background), so that stored prompts at long context are restored at device copy speed and
//! not from host memory; the rest for sessions, each counted at its state bytes + 10 %.

use flashrt_runtime::Model;

/// What fits, and what it was computed from (logged at start-up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Device bytes free with the shared arenas allocated and no session open.
    pub free: u64,
    /// Device bytes each session allocates (its state arena).
    pub per_session: u64,
    /// Device bytes held back for graphs, libraries and allocator slack.
    pub reserve: u64,
    pub max_sessions: usize,
    pub budget_device: u64,
    /// Bytes the device tier may hold past its budget while a capsule is copied down.
    pub slack_device: u64,
}

/// Most sessions a default plan allows (a larger `--max-sessions` is the operator's call).
pub const MAX_DEFAULT_SESSIONS: usize = 64;

impl MemoryPlan {
    /// The plan for `free` bytes and sessions of `per_session` bytes; `max_sessions` and
    /// `budget_device` where the operator set them. One session is kept for the server's own
    /// completions (the worker's scratch session), so it is not counted in `max_sessions`.
    pub fn new(
        free: u64,
        per_session: u64,
        max_sessions: Option<usize>,
        budget_device: Option<u64>,
    ) -> MemoryPlan {
        const GIB: u64 = 1 << 30;
        let reserve = 2 * GIB + free / 20;
        let usable = free.saturating_sub(reserve);
        let cost = (per_session + per_session / 10).max(1);
        // The operator's session count comes first (and the server's own session): the tier
        // takes at most what they leave, so that a capsule stored while every session is open
        // still finds device memory (on an 80 GB card with 8 sessions of the 27B shape at 16k,
        // a quarter of the free memory did not).
        let left = match max_sessions {
            Some(n) => usable.saturating_sub((n as u64 + 1) * cost),
            None => usable,
        };
        // The tier may hold one more capsule past its budget while the previous one is on its
        // way to the host (`StoreConfig::slack_device`), so that storing it does not wait for
        // that copy: as large as a session's state (the largest a capsule can be), at most
        // half the tier's share, or what the operator's budget leaves.
        let (budget_device, slack_device) = match budget_device {
            Some(b) => (b, per_session.min(left.saturating_sub(b))),
            None => {
                let share = (usable / 4).min(64 * GIB).min(left);
                let slack = per_session.min(share / 2);
                (share - slack, slack)
            }
        };
        let max_sessions = max_sessions.unwrap_or_else(|| {
            let fit = usable.saturating_sub(budget_device + slack_device) / cost;
            (fit.saturating_sub(1) as usize).clamp(1, MAX_DEFAULT_SESSIONS)
        });
        MemoryPlan {
            free,
            per_session,
            reserve,
            max_sessions,
            budget_device,
            slack_device,
        }
    }

    /// The plan for `model` on its backend, `None` where the backend does not report free
    /// memory (the CPU reference: the defaults stay). Opens (and closes) one session first,
    /// so that the shared arenas exist and are not counted as free.
    pub fn of(
        model: &Model,
        max_sessions: Option<usize>,
        budget_device: Option<u64>,
    ) -> Result<Option<MemoryPlan>, String> {
        if model.backend().memory_available().is_none() {
            return Ok(None);
        }
        let probe = model
            .session()
            .map_err(|e| format!("opening a first session: {e}"))?;
        drop(probe);
        let Some(free) = model.backend().memory_available() else {
            return Ok(None);
        };
        Ok(Some(MemoryPlan::new(
            free as u64,
            model.session_bytes() as u64,
            max_sessions,
            budget_device,
        )))
    }
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "{:.1} GiB free after the weights and shared arenas: up to {} sessions of {:.2} GiB, a {:.1} GiB device tier (+ {:.1} GiB while a capsule is copied down), {:.1} GiB reserve",
            gib(self.free),
            self.max_sessions,
            gib(self.per_session),
            gib(self.budget_device),
            gib(self.slack_device),
            gib(self.reserve)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const GIB: u64 = 1 << 30;

    #[test]
    fn defaults_split_free_memory() {
        // The 27B shape on an H200: ~82 GiB free, 2.27 GiB of state per session.
        let p = MemoryPlan::new(82 * GIB, 2437 << 20, None, None);
        assert_eq!(p.reserve, 2 * GIB + 82 * GIB / 20);
        let usable = 82 * GIB - p.reserve;
        let tier = p.budget_device + p.slack_device;
        assert_eq!((tier, p.slack_device), (usable / 4, 2437 << 20));
        let cost = (2437u64 << 20) * 11 / 10;
        assert_eq!(p.max_sessions as u64, (usable - tier) / cost - 1);
        // Everything planned fits in what was free.
        assert!(p.reserve + tier + (p.max_sessions as u64 + 1) * cost <= 82 * GIB);
        assert!(p.max_sessions >= 8, "8 sessions at 16k should fit: {p}");
    }

    #[test]
    fn the_tier_takes_what_the_operators_sessions_leave() {
        // The 27B shape on an 80 GB card: 22.2 GiB free, sessions of 2.27 GiB; 6 asked for
        // (and the server's own) leave less than a quarter of the usable memory.
        let free = 22 * GIB + GIB / 5;
        let per = 2325u64 << 20;
        let cost = per * 11 / 10;
        let p = MemoryPlan::new(free, per, Some(6), None);
        assert_eq!(p.max_sessions, 6);
        assert!(p.budget_device > 0 && p.budget_device < (free - p.reserve) / 4);
        assert!(
            p.reserve + p.budget_device + p.slack_device + 7 * cost <= free,
            "over-committed: {p}"
        );
        // Sessions that take everything leave no tier (capsules go to the host tier).
        let p = MemoryPlan::new(free, per, Some(64), None);
        assert_eq!((p.budget_device, p.slack_device), (0, 0));
        // Without a session count the tier keeps its quarter, a capsule's slack in it.
        let p = MemoryPlan::new(82 * GIB, per, None, None);
        assert_eq!(p.budget_device + p.slack_device, (82 * GIB - p.reserve) / 4);
        assert_eq!(p.slack_device, per);
    }

    #[test]
    fn operator_settings_win_and_limits_hold() {
        let p = MemoryPlan::new(82 * GIB, GIB, Some(3), Some(5 * GIB));
        assert_eq!((p.max_sessions, p.budget_device), (3, 5 * GIB));
        assert_eq!(p.slack_device, GIB);
        // Huge free memory: the default session count is capped, the tier too.
        let p = MemoryPlan::new(1 << 50, 1 << 20, None, None);
        assert_eq!(p.max_sessions, MAX_DEFAULT_SESSIONS);
        assert_eq!(
            (p.budget_device, p.slack_device),
            (64 * GIB - (1 << 20), 1 << 20)
        );
        // Nothing free: still one session (its creation then fails with a clear error).
        let p = MemoryPlan::new(GIB, 4 * GIB, None, None);
        assert_eq!((p.max_sessions, p.budget_device), (1, 0));
    }
}
