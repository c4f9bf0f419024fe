//! Saved states: the regions a [`CudaSession`] saved, on the device or parked in pinned host
//! memory ([`CudaSaved`]), and the [`SavedState`] interface the runtime restores from.

use super::*;

/// A device buffer of `bytes` (at least 1) allocated in stream order on `stream`.
pub(super) fn alloc_on(
    stream: &Arc<CudaStream>,
    bytes: usize,
    what: &str,
) -> Result<CudaSlice<u8>> {
    // SAFETY: the buffer is only read in the ranges that are written right after, in stream
    // order, before any reader waits on the completion event.
    unsafe { stream.alloc::<u8>(bytes.max(1)) }
        .map_err(drv(&format!("allocate {what} ({bytes} bytes)")))
}

pub(super) struct SavedRegion {
    pub(super) id: BufferId,
    /// Byte offset inside the saved storage.
    pub(super) offset: usize,
    pub(super) bytes: usize,
}

pub(super) enum Storage {
    Device(CudaSlice<u8>),
    Pinned(PinnedHostSlice<u8>),
}

/// State regions saved by a [`CudaSession`]: on the device (`location() == "cuda:N"`) or parked
/// in pinned host memory (`"pinned"`).
pub struct CudaSaved {
    pub(super) model: String,
    pub(super) fingerprint: String,
    pub(super) pos: usize,
    pub(super) set: RegionSet,
    pub(super) regions: Vec<SavedRegion>,
    pub(super) total: usize,
    pub(super) location: String,
    pub(super) ordinal: usize,
    pub(super) storage: Storage,
    /// Device tier: recorded on `home` after the copies that filled `storage`.
    pub(super) ready: Option<CudaEvent>,
    /// The stream that owns the device storage (its free is ordered on it).
    pub(super) home: Arc<CudaStream>,
}

impl CudaSaved {
    /// Which regions were saved.
    pub fn set(&self) -> RegionSet {
        self.set
    }

    /// Whether the bytes are in pinned host memory.
    pub fn is_parked(&self) -> bool {
        matches!(self.storage, Storage::Pinned(_))
    }

    fn bind(&self) -> Result<()> {
        self.home
            .context()
            .bind_to_thread()
            .map_err(drv("bind context"))
    }

    /// A copy of this state in pinned host memory (frees no device memory by itself: drop the
    /// device copy for that). Blocks until the copy is complete.
    pub fn park(&self) -> Result<CudaSaved> {
        self.bind()?;
        let ctx = self.home.context();
        // SAFETY: every byte of the pinned buffer up to `total` is written by the copy below
        // (or already, for a parked source) before anything reads it.
        let mut host = unsafe { ctx.alloc_pinned_with_flags::<u8>(self.total.max(1), 0) }
            .map_err(drv("park: allocate pinned"))?;
        {
            let dst = host.as_mut_slice().map_err(drv("park"))?;
            match &self.storage {
                Storage::Device(src) => {
                    if let Some(ev) = &self.ready {
                        self.home.wait(ev).map_err(drv("park"))?;
                    }
                    // SAFETY: `src` holds `total` bytes written before `ready`; `dst` is pinned
                    // and stays borrowed until the synchronise below.
                    unsafe {
                        cudarc::driver::result::memcpy_dtoh_async(
                            &mut dst[..self.total],
                            dptr(src),
                            self.home.cu_stream(),
                        )
                    }
                    .map_err(drv("park"))?;
                    self.home.synchronize().map_err(drv("park"))?;
                }
                Storage::Pinned(src) => dst[..self.total]
                    .copy_from_slice(&src.as_slice().map_err(drv("park"))?[..self.total]),
            }
        }
        Ok(self.with_storage(Storage::Pinned(host), "pinned".into(), None))
    }

    /// A device copy of this state (on the device it was saved from).
    pub fn unpark(&self) -> Result<CudaSaved> {
        self.bind()?;
        let dev = alloc_on(&self.home, self.total, "unpark")?;
        match &self.storage {
            Storage::Pinned(src) => {
                let src = src.as_slice().map_err(drv("unpark"))?;
                // SAFETY: `dev` holds `total` bytes; the pinned source outlives the copy because
                // the stream is synchronised before returning.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dptr(&dev),
                        &src[..self.total],
                        self.home.cu_stream(),
                    )
                }
                .map_err(drv("unpark"))?;
                self.home.synchronize().map_err(drv("unpark"))?;
            }
            Storage::Device(src) => {
                if let Some(ev) = &self.ready {
                    self.home.wait(ev).map_err(drv("unpark"))?;
                }
                // SAFETY: both buffers hold `total` bytes; ordered on `home` after `ready`.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        dptr(&dev),
                        dptr(src),
                        self.total,
                        self.home.cu_stream(),
                    )
                }
                .map_err(drv("unpark"))?;
            }
        }
        let ready = self.home.record_event(None).map_err(drv("unpark"))?;
        Ok(self.with_storage(
            Storage::Device(dev),
            format!("cuda:{}", self.ordinal),
            Some(ready),
        ))
    }

    fn with_storage(
        &self,
        storage: Storage,
        location: String,
        ready: Option<CudaEvent>,
    ) -> CudaSaved {
        CudaSaved {
            model: self.model.clone(),
            fingerprint: self.fingerprint.clone(),
            pos: self.pos,
            set: self.set,
            regions: self
                .regions
                .iter()
                .map(|r| SavedRegion {
                    id: r.id,
                    offset: r.offset,
                    bytes: r.bytes,
                })
                .collect(),
            total: self.total,
            location,
            ordinal: self.ordinal,
            storage,
            ready,
            home: self.home.clone(),
        }
    }
}

impl SavedState for CudaSaved {
    fn location(&self) -> &str {
        &self.location
    }

    fn pos(&self) -> usize {
        self.pos
    }

    fn bytes(&self) -> usize {
        self.total
    }

    fn region_bytes(&self, id: BufferId) -> Result<Vec<u8>> {
        let r = self
            .regions
            .iter()
            .find(|r| r.id == id)
            .ok_or_else(|| Error::Capsule(format!("saved state has no region {}", id.0)))?;
        match &self.storage {
            Storage::Device(src) => {
                self.bind()?;
                let mut out = vec![0u8; r.bytes];
                if r.bytes > 0 {
                    if let Some(ev) = &self.ready {
                        ev.synchronize().map_err(drv("read saved region"))?;
                    }
                    // SAFETY: the range lies inside the saved buffer, complete after `ready`.
                    unsafe {
                        cudarc::driver::result::memcpy_dtoh_sync(
                            &mut out,
                            dptr(src) + r.offset as u64,
                        )
                    }
                    .map_err(drv("read saved region"))?;
                }
                Ok(out)
            }
            Storage::Pinned(src) => Ok(src.as_slice().map_err(drv("read saved region"))?
                [r.offset..r.offset + r.bytes]
                .to_vec()),
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
