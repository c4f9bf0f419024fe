//! KV rows shared along a conversation: a capsule's base (the stored capsule whose history is
//! the longest prefix of its own and whose KV rows hash alike), its delta (the rows past the
//! base), and the chains a restore walks to put the rows back together.

use super::*;

impl CapsuleStore {
    pub(super) fn layout(&self) -> &flashrt_ir::Layout {
        &self.model.compiled().layout
    }

    /// The KV regions (per-token state buffers) and their bytes per token, in layout order.
    pub(super) fn kv_regions(&self) -> Vec<KvRegion> {
        self.layout()
            .state_buffers()
            .filter(|b| b.state.is_some_and(|k| k.per_token()))
            .map(|b| (b.id, b.bytes_per_token()))
            .collect()
    }

    /// `id`'s meta and the stored regions of each link of its chain, `id`'s first and the
    /// capsule held whole last (just `id`'s when it is held whole).
    pub(super) fn links(&mut self, id: &str) -> Result<(CapsuleMeta, Vec<Arc<Regions>>)> {
        let mut links = Vec::new();
        let mut meta = None;
        let mut cur = id.to_string();
        for _ in 0..=self.entries.len() {
            let (m, regions, base) = self.own_regions(&cur)?;
            meta.get_or_insert(m);
            links.push(regions);
            match base {
                Some(b) => cur = b,
                None => break,
            }
        }
        Ok((meta.expect("at least one link"), links))
    }

    /// Full host bytes of every region of `id` (KV rows `[0, pos)`) and its meta. A capsule
    /// held whole on the host comes back shared, without a copy; a chain is assembled with one
    /// copy of each byte (every KV region once, root rows first).
    pub(super) fn full_regions(&mut self, id: &str) -> Result<(CapsuleMeta, Arc<Regions>)> {
        let (meta, mut links) = self.links(id)?;
        if links.len() == 1 {
            return Ok((meta, links.pop().expect("one link")));
        }
        // `links` runs from `id` to the root; the fixed regions are `id`'s own.
        let layout = &self.model.compiled().layout;
        let mut out = Vec::with_capacity(links[0].len());
        for (rid, bytes) in links[0].iter() {
            let b = layout.buffer(*rid);
            if !b.state.is_some_and(|k| k.per_token()) {
                out.push((*rid, bytes.clone()));
                continue;
            }
            let parts = links
                .iter()
                .rev()
                .map(|l| {
                    l.iter()
                        .find(|(x, _)| x == rid)
                        .map(|(_, v)| &v[..])
                        .ok_or_else(|| Error::Capsule(format!("base lacks region `{}`", b.name)))
                })
                .collect::<Result<Vec<&[u8]>>>()?;
            out.push((*rid, parts.concat()));
        }
        Ok((meta, Arc::new(out)))
    }

    /// One link: the capsule's own stored regions (KV from its base's position, or whole),
    /// its meta, and its base id if the regions are a delta.
    pub(super) fn own_regions(
        &mut self,
        id: &str,
    ) -> Result<(CapsuleMeta, Arc<Regions>, Option<String>)> {
        let e = self
            .entries
            .get(id)
            .ok_or_else(|| Error::Capsule(format!("capsule `{id}` is missing from the store")))?;
        match &e.mem {
            Some(Mem::Device(c)) => {
                let ids: Vec<BufferId> = self.layout().state_buffers().map(|b| b.id).collect();
                let regions = super::background::read_regions(c, &ids, &self.pool)?;
                Ok((c.meta.clone(), Arc::new(regions), None))
            }
            Some(Mem::Host(h)) => Ok((
                h.meta.clone(),
                h.regions.clone(),
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
                Ok((meta, Arc::new(f.regions), base))
            }
        }
    }

    pub(super) fn materialize(&mut self, id: &str) -> Result<Capsule> {
        if let Some(Mem::Device(c)) = &self.entries.get(id).and_then(|e| e.mem.as_ref()) {
            return Ok(c.clone());
        }
        // The links' bytes as they are stored: a restore copies each piece into place.
        let (meta, mut links) = self.links(id)?;
        links.reverse();
        let saved = HostSaved::chained(self.layout(), meta.pos, links)?;
        let c = Capsule::from_parts(meta, Arc::new(saved), self.model.compiled().clone())?;
        Ok(c.with_kv_rows(self.entries[id].kv.clone()))
    }

    /// KV hashes (rows `[0, pos)`) of `id`, computed and cached on first use.
    pub(super) fn kv_hashes(&mut self, id: &str) -> Result<Vec<u64>> {
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
    pub(super) fn hash_kv(
        &self,
        regions: &[(BufferId, Vec<u8>)],
        prefixes: &[usize],
    ) -> Vec<Vec<u64>> {
        hash_kv(&self.kv_regions(), regions, prefixes, all_threads())
    }

    /// Decide the base of `id` (once): the capsule with the longest token-prefix history that
    /// comes earlier in (position, insertion) order and whose KV rows match.
    pub(super) fn decide_base(
        &mut self,
        id: &str,
        full: &[(BufferId, Vec<u8>)],
    ) -> Result<Option<BaseRef>> {
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
    pub(super) fn settle_base(&mut self, id: &str, base: Option<BaseRef>, own: Vec<u64>) {
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
    pub(super) fn base_candidates(&self, id: &str) -> Vec<(usize, String)> {
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
    pub(super) fn group_root(&self, id: &str) -> String {
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
    pub(super) fn group_sizes(&self) -> HashMap<String, usize> {
        let mut sizes = HashMap::new();
        for id in self.entries.keys() {
            *sizes.entry(self.group_root(id)).or_insert(0) += 1;
        }
        sizes
    }

    /// The regions `id` stores given its base: KV rows from the base's position on.
    pub(super) fn delta_of(&self, full: Regions, base: &Option<BaseRef>) -> Regions {
        delta(&self.kv_regions(), full, base)
    }

    /// Device -> host: the capsule's bytes on the host, KV shared with its base.
    pub(super) fn demote_device(&mut self, id: &str) -> Result<()> {
        let (meta, full) = self.full_regions(id)?;
        let base = self.decide_base(id, &full)?;
        let full_bytes = full.iter().map(|(_, v)| v.len() as u64).sum();
        let regions = self.delta_of(owned(full), &base);
        self.keep_on_host(id, meta, regions, full_bytes);
        Ok(())
    }

    /// Replace `id`'s memory copy by host bytes: `regions` (KV from its base's position on),
    /// of `full_bytes` whole.
    /// Returns the copy it replaces.
    pub(super) fn keep_on_host(
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
}

/// The regions `full` (every region whole) keep given their `base`: the KV regions (`kv`) from
/// the base's position on, cut in place; the others whole.
pub(super) fn delta(kv: &[KvRegion], full: Regions, base: &Option<BaseRef>) -> Regions {
    let start = base.as_ref().map_or(0, |b| b.pos);
    if start == 0 {
        return full;
    }
    full.into_iter()
        .map(|(rid, mut bytes)| {
            if let Some(&(_, per_token)) = kv.iter().find(|k| k.0 == rid) {
                bytes.drain(..(start * per_token).min(bytes.len()));
            }
            (rid, bytes)
        })
        .collect()
}

/// The regions of `a`, moved out when nothing else holds them, else copied.
pub(super) fn owned(a: Arc<Regions>) -> Regions {
    Arc::try_unwrap(a).unwrap_or_else(|a| a.as_ref().clone())
}
