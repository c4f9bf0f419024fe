//! Saved state as plain host bytes, independent of any backend.
//!
//! A [`HostSaved`] holds the bytes of every state region of a layout at one position (KV
//! regions: the used prefix `[0, pos)`), exactly as [`SavedState::region_bytes`] returns them.
//! It is what a capsule becomes when it leaves its backend: read from a capsule file
//! ([`crate::capsule_file`]), reassembled from a chain of shared KV rows in the
//! [`crate::store`], or copied off a device to make room.
//!
//! Every backend restores it through the generic path: when the saved state handed to
//! [`DeviceSession::restore`](crate::DeviceSession::restore) is not the backend's own type,
//! the backend asks [`host_regions`] for the validated bytes of each region and copies them
//! in. [`host_regions`] works for *any* [`SavedState`], so a backend needs exactly one
//! fallback.

use crate::backend::{RegionSet, SavedState};
use crate::error::{Error, Result};
use flashrt_ir::{Buffer, BufferId, Layout, Role};
use std::any::Any;

/// State regions as host bytes, one vector per region, in layout order.
pub struct HostSaved {
    fingerprint: String,
    pos: usize,
    regions: Vec<(BufferId, Vec<u8>)>,
    total: usize,
}

impl std::fmt::Debug for HostSaved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostSaved")
            .field("fingerprint", &self.fingerprint)
            .field("pos", &self.pos)
            .field("regions", &self.regions.len())
            .field("bytes", &self.total)
            .finish()
    }
}

impl HostSaved {
    /// Assemble from region bytes. Every state region of `layout` must appear exactly once,
    /// with exactly [`Buffer::used_bytes`]`(pos)` bytes; regions may come in any order.
    pub fn new(
        layout: &Layout,
        pos: usize,
        regions: Vec<(BufferId, Vec<u8>)>,
    ) -> Result<HostSaved> {
        if pos > layout.max_seq {
            return Err(Error::Capsule(format!(
                "saved position {pos} exceeds max_seq {}",
                layout.max_seq
            )));
        }
        let mut slots: Vec<Option<Vec<u8>>> = vec![None; layout.buffers.len()];
        for (id, bytes) in regions {
            let b = state_buffer(layout, id)?;
            let want = b.used_bytes(pos);
            if bytes.len() != want {
                return Err(Error::Capsule(format!(
                    "region `{}` has {} bytes, expected {want} at position {pos}",
                    b.name,
                    bytes.len()
                )));
            }
            if slots[id.index()].replace(bytes).is_some() {
                return Err(Error::Capsule(format!("region `{}` given twice", b.name)));
            }
        }
        let mut out = Vec::new();
        let mut total = 0;
        for b in layout.state_buffers() {
            let bytes = slots[b.id.index()]
                .take()
                .ok_or_else(|| Error::Capsule(format!("region `{}` is missing", b.name)))?;
            total += bytes.len();
            out.push((b.id, bytes));
        }
        Ok(HostSaved {
            fingerprint: layout.fingerprint.clone(),
            pos,
            regions: out,
            total,
        })
    }

    /// Copy any saved state (e.g. a device-resident one) to host bytes.
    pub fn from_saved(layout: &Layout, saved: &dyn SavedState) -> Result<HostSaved> {
        let regions = host_regions(layout, saved, RegionSet::All)?
            .into_iter()
            .map(|(b, bytes)| (b.id, bytes))
            .collect();
        HostSaved::new(layout, saved.pos(), regions)
    }

    /// The layout fingerprint these bytes belong to.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The bytes of one region, borrowed.
    pub fn region(&self, id: BufferId) -> Option<&[u8]> {
        self.regions
            .iter()
            .find(|(r, _)| *r == id)
            .map(|(_, b)| &b[..])
    }

    /// `(id, bytes)` of every region, in layout order.
    pub fn regions(&self) -> impl Iterator<Item = (BufferId, &[u8])> {
        self.regions.iter().map(|(id, b)| (*id, &b[..]))
    }
}

impl SavedState for HostSaved {
    fn location(&self) -> &str {
        "host"
    }
    fn pos(&self) -> usize {
        self.pos
    }
    fn bytes(&self) -> usize {
        self.total
    }
    fn region_bytes(&self, id: BufferId) -> Result<Vec<u8>> {
        self.region(id)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| Error::Capsule(format!("region {} is not in this saved state", id.0)))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn state_buffer(layout: &Layout, id: BufferId) -> Result<&Buffer> {
    match layout.buffers.get(id.index()) {
        Some(b) if b.role == Role::State => Ok(b),
        Some(b) => Err(Error::Capsule(format!(
            "`{}` is not a state region",
            b.name
        ))),
        None => Err(Error::Capsule(format!("no buffer with id {}", id.0))),
    }
}

/// The generic restore path of every backend: the host bytes of each state region in `set`,
/// read from any [`SavedState`] through [`SavedState::region_bytes`], each checked to hold
/// exactly the used bytes of its region at `saved.pos()`. A backend copies them into its
/// state arena (converting nothing: the bytes are in the layout's dtype).
pub fn host_regions<'a>(
    layout: &'a Layout,
    saved: &dyn SavedState,
    set: RegionSet,
) -> Result<Vec<(&'a Buffer, Vec<u8>)>> {
    let pos = saved.pos();
    if pos > layout.max_seq {
        return Err(Error::Capsule(format!(
            "saved position {pos} exceeds max_seq {}",
            layout.max_seq
        )));
    }
    if let Some(h) = saved.as_any().downcast_ref::<HostSaved>()
        && h.fingerprint != layout.fingerprint
    {
        return Err(Error::Capsule(format!(
            "saved state has layout {}, this session has {}",
            h.fingerprint, layout.fingerprint
        )));
    }
    let mut out = Vec::new();
    for b in layout.state_buffers() {
        if !set.contains(b.state) {
            continue;
        }
        let bytes = saved.region_bytes(b.id)?;
        if bytes.len() != b.used_bytes(pos) {
            return Err(Error::Capsule(format!(
                "saved region `{}` has {} bytes, expected {} at position {pos}",
                b.name,
                bytes.len(),
                b.used_bytes(pos)
            )));
        }
        out.push((b, bytes));
    }
    Ok(out)
}
