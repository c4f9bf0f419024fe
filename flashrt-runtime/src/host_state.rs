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
use std::borrow::Cow;
use std::sync::Arc;

/// Region bytes by buffer id.
pub type Regions = Vec<(BufferId, Vec<u8>)>;

/// State regions as host bytes, in layout order. The bytes may be shared with their owner, and
/// a KV region may be the concatenation of several owners' rows: a capsule store's host tier
/// keeps a capsule whole or as the rows past its base's, and a restore reads them where they
/// are ([`HostSaved::chained`]), copying nothing on the host ([`host_regions`] hands a backend
/// each region's pieces).
pub struct HostSaved {
    fingerprint: String,
    pos: usize,
    /// The owners of the bytes.
    parts: Vec<Arc<Regions>>,
    /// Per state region, in layout order: `(part, index in the part)` of its pieces, in order.
    regions: Vec<(BufferId, Vec<(usize, usize)>)>,
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
        for b in layout.state_buffers() {
            let bytes = slots[b.id.index()]
                .take()
                .ok_or_else(|| Error::Capsule(format!("region `{}` is missing", b.name)))?;
            out.push((b.id, bytes));
        }
        HostSaved::chained(layout, pos, vec![Arc::new(out)])
    }

    /// A state at `pos` whose KV regions are the rows of `links` one after the other (root
    /// first: each link holds the rows from where the previous one ends; one link: a state
    /// held whole) and whose other regions are the last link's; nothing is copied. Every link holds every state region
    /// in layout order, and the rows add up to each KV region's used bytes at `pos`.
    pub fn chained(layout: &Layout, pos: usize, links: Vec<Arc<Regions>>) -> Result<HostSaved> {
        let n = layout.state_buffers().count();
        if pos > layout.max_seq || links.is_empty() {
            return Err(Error::Capsule(format!(
                "a chained saved state needs links and a position within max_seq {} (at {pos})",
                layout.max_seq
            )));
        }
        let top = links.len() - 1;
        let mut regions = Vec::with_capacity(n);
        let mut total = 0;
        for (i, b) in layout.state_buffers().enumerate() {
            for (k, l) in links.iter().enumerate() {
                if l.len() != n || l[i].0 != b.id {
                    return Err(Error::Capsule(format!(
                        "link {k} of a chained saved state does not hold region `{}` in layout order",
                        b.name
                    )));
                }
            }
            let pieces: Vec<(usize, usize)> = if b.state.is_some_and(|k| k.per_token()) {
                (0..links.len())
                    .filter(|&k| !links[k][i].1.is_empty())
                    .map(|k| (k, i))
                    .collect()
            } else {
                vec![(top, i)]
            };
            let len: usize = pieces.iter().map(|&(k, j)| links[k][j].1.len()).sum();
            if len != b.used_bytes(pos) {
                return Err(Error::Capsule(format!(
                    "region `{}` has {len} bytes in its chain, expected {} at position {pos}",
                    b.name,
                    b.used_bytes(pos)
                )));
            }
            total += len;
            regions.push((b.id, pieces));
        }
        Ok(HostSaved {
            fingerprint: layout.fingerprint.clone(),
            pos,
            parts: links,
            regions,
            total,
        })
    }

    /// Copy any saved state (e.g. a device-resident one) to host bytes.
    pub fn from_saved(layout: &Layout, saved: &dyn SavedState) -> Result<HostSaved> {
        let regions = host_regions(layout, saved, RegionSet::All)?
            .into_iter()
            .map(|(b, pieces)| (b.id, pieces.concat()))
            .collect();
        HostSaved::new(layout, saved.pos(), regions)
    }

    /// The layout fingerprint these bytes belong to.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The bytes of one region as the pieces they are stored in, in order.
    pub fn pieces(&self, id: BufferId) -> Option<Vec<&[u8]>> {
        self.regions
            .iter()
            .find(|(r, _)| *r == id)
            .map(|(_, p)| p.iter().map(|&(k, j)| &self.parts[k][j].1[..]).collect())
    }

    /// The bytes of one region: borrowed when stored in one piece, else joined.
    pub fn region(&self, id: BufferId) -> Option<Cow<'_, [u8]>> {
        let mut p = self.pieces(id)?;
        Some(if p.len() == 1 {
            Cow::Borrowed(p.remove(0))
        } else {
            Cow::Owned(p.concat())
        })
    }

    /// `(id, bytes)` of every region, in layout order.
    pub fn regions(&self) -> impl Iterator<Item = (BufferId, Cow<'_, [u8]>)> {
        self.regions
            .iter()
            .map(|(id, _)| (*id, self.region(*id).expect("listed")))
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
            .map(Cow::into_owned)
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

/// A region's bytes as pieces to copy one after the other.
pub type Pieces<'s> = Vec<Cow<'s, [u8]>>;

/// The pieces of a region past its first `skip` bytes (rows a session holds already), each
/// with its byte offset in the region.
pub fn pieces_past<'p>(
    pieces: &'p [Cow<'_, [u8]>],
    skip: usize,
) -> impl Iterator<Item = (usize, &'p [u8])> {
    let mut at = 0;
    pieces.iter().filter_map(move |p| {
        let start = at;
        at += p.len();
        let from = skip.max(start);
        (from < at).then(|| (from, &p[from - start..]))
    })
}

/// The generic restore path of every backend: the host bytes of each state region in `set`
/// as pieces to copy one after the other (borrowed from a [`HostSaved`], where they are; one
/// piece read through [`SavedState::region_bytes`] from any other [`SavedState`]), each
/// region checked to hold exactly its used bytes at `saved.pos()`. A backend copies them into
/// its state arena (converting nothing: the bytes are in the layout's dtype).
pub fn host_regions<'a, 's>(
    layout: &'a Layout,
    saved: &'s dyn SavedState,
    set: RegionSet,
) -> Result<Vec<(&'a Buffer, Pieces<'s>)>> {
    let pos = saved.pos();
    if pos > layout.max_seq {
        return Err(Error::Capsule(format!(
            "saved position {pos} exceeds max_seq {}",
            layout.max_seq
        )));
    }
    let host = saved.as_any().downcast_ref::<HostSaved>();
    if let Some(h) = host
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
        let bytes: Pieces<'s> = match host.and_then(|h| h.pieces(b.id)) {
            Some(p) => p.into_iter().map(Cow::Borrowed).collect(),
            None => vec![Cow::Owned(saved.region_bytes(b.id)?)],
        };
        let len: usize = bytes.iter().map(|p| p.len()).sum();
        if len != b.used_bytes(pos) {
            return Err(Error::Capsule(format!(
                "saved region `{}` has {len} bytes, expected {} at position {pos}",
                b.name,
                b.used_bytes(pos)
            )));
        }
        out.push((b, bytes));
    }
    Ok(out)
}
