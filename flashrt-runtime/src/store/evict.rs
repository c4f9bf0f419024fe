//! Budgets: the least recently used capsule of a tier over budget moves down one tier, and
//! what nothing depends on is dropped when there is no tier below.

use super::*;

impl CapsuleStore {
    /// Forget `id` and, first, every capsule whose stored bytes depend on it.
    pub(super) fn drop_broken(&mut self, id: &str) {
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
    pub(super) fn remove_entry(&mut self, id: &str) {
        self.index_remove(id);
        let Some(mut e) = self.entries.remove(id) else {
            return;
        };
        self.recycle(e.mem.take());
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

    /// The least recently used entry matching `f`, preferring any other than `protect`.
    pub(super) fn lru(&self, protect: Option<&str>, f: impl Fn(&Entry) -> bool) -> Option<String> {
        let pick = |skip: Option<&str>| {
            self.entries
                .values()
                .filter(|e| Some(e.id.as_str()) != skip && f(e))
                .min_by_key(|e| (e.last_used, e.seq))
                .map(|e| e.id.clone())
        };
        pick(protect).or_else(|| pick(None))
    }

    /// Whether a tier holding `bytes` over `budget` moves a capsule down now: always on the
    /// store's thread; in the background, unless starting one more job would wait for the
    /// oldest (`jobs` in flight) and the tier is within its `slack` of the budget.
    pub(super) fn must_move(&self, bytes: u64, budget: u64, slack: u64, jobs: usize) -> bool {
        bytes > budget
            && !(self.cfg.background
                && jobs >= MAX_IN_FLIGHT
                && bytes <= budget.saturating_add(slack))
    }

    pub(super) fn enforce(&mut self, protect: Option<&str>) -> Result<()> {
        loop {
            let s = self.stats();
            let (demotions, spills) = (self.demotions.len(), self.spills.len());
            let c = &self.cfg;
            if self.must_move(s.bytes[0], c.budget_device, c.slack_device, demotions) {
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
            } else if self.must_move(s.bytes[1], c.budget_host, c.slack_host, spills) {
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
                        let old = self.entries.get_mut(&v).expect("present").mem.take();
                        self.recycle(old);
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
    pub(super) fn drop_leaf(&mut self, v: &str, protect: Option<&str>) -> bool {
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
