//! The disk tier: capsule files written (whole, or as deltas on their base), and a store's
//! directory loaded at open (every file's header, metadata and region table verified, its
//! region bytes when they are first read; leftovers of interrupted writes deleted; corrupt or
//! orphaned files set aside).

use super::*;

/// Everything a capsule file is written from (on the store's thread or a spill's).
pub(super) struct FileParts {
    pub(super) path: PathBuf,
    pub(super) meta: FileMeta,
    pub(super) logits: Option<crate::capsule::LogitsRow>,
    pub(super) regions: Arc<Regions>,
    pub(super) compiled: Arc<flashrt_ir::Compiled>,
}

impl FileParts {
    pub(super) fn encode(&self, w: &mut std::io::BufWriter<std::fs::File>) -> Result<u64> {
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

impl CapsuleStore {
    pub(super) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
        move |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        }
    }

    pub(super) fn load_dir(&mut self, dir: &Path) -> Result<()> {
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
            // Header, metadata and region table only: the region bytes' checksums are checked
            // when they are first read (`own_regions` sets a file that fails aside then).
            match capsule_file::read_file_meta(&path, &compiled) {
                Ok(meta) if meta.id.as_deref() == Some(id.as_str()) => {
                    let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    loaded.push((meta, path, len));
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
                    kv: std::sync::Arc::new([(crate::capsule::fresh_kv_id(), meta.pos)]),
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

    pub(super) fn chain_ok(&self, e: &Entry) -> bool {
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

    pub(super) fn set_aside(&mut self, path: &Path, why: &str) {
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

    /// Write `id`'s file (a delta file if it has a base) unless it has one.
    pub(super) fn write_disk(&mut self, id: &str) -> Result<()> {
        if self.entries.get(id).is_some_and(|e| e.disk.is_some()) {
            return Ok(());
        }
        let f = self.file_of(id)?;
        let bytes = capsule_file::write_atomic(&f.path, |w| f.encode(w))?;
        self.file_written(id, f.path, bytes)
    }

    /// What `id`'s file holds (deciding its base if it is only on the device).
    pub(super) fn file_of(&mut self, id: &str) -> Result<FileParts> {
        let Some(dir) = self.cfg.dir.clone() else {
            return Err(Error::Unsupported("no store directory".into()));
        };
        let (meta, regions) = match &self.entries[id].mem {
            Some(Mem::Host(h)) => (h.meta.clone(), h.regions.clone()),
            _ => {
                let (meta, full) = self.full_regions(id)?;
                let base = self.decide_base(id, &full)?;
                (meta, Arc::new(self.delta_of(sharing::owned(full), &base)))
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
    pub(super) fn file_written(&mut self, id: &str, path: PathBuf, bytes: u64) -> Result<()> {
        let e = self.entries.get_mut(id).expect("present");
        e.disk = Some(DiskCopy { path, bytes });
        if e.hidden
            && let Some(dir) = &self.cfg.dir
        {
            capsule_file::write_atomic(&dir.join(format!("{id}.hidden")), |_| Ok(0))?;
        }
        Ok(())
    }
}
