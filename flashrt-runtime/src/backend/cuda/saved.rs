//! Saved states: the regions a [`CudaSession`] saved, on the device or parked in pinned host
//! memory ([`CudaSaved`]), and the [`SavedState`] interface the runtime restores from.

use super::session::{SAVE_ALIGN, in_set};
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
        self.region_bytes_into(id, Vec::new())
    }

    fn region_bytes_into(&self, id: BufferId, buf: Vec<u8>) -> Result<Vec<u8>> {
        let r = self
            .regions
            .iter()
            .find(|r| r.id == id)
            .ok_or_else(|| Error::Capsule(format!("saved state has no region {}", id.0)))?;
        match &self.storage {
            Storage::Device(src) => {
                self.bind()?;
                // A pooled buffer's pages are in place: no faults while the copy lands.
                let mut out = if buf.capacity() >= r.bytes {
                    let mut b = buf;
                    b.resize(r.bytes, 0);
                    b
                } else {
                    host_buffer(r.bytes)
                };
                if r.bytes > 0 {
                    if let Some(ev) = &self.ready {
                        ev.synchronize().map_err(drv("read saved region"))?;
                    }
                    read_staged(
                        &self.home,
                        self.ordinal,
                        dptr(src) + r.offset as u64,
                        &mut out,
                    )?;
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

/// A zeroed host buffer of `n` bytes whose pages exist before it is written. A fresh
/// buffer's first-touch page faults, one per 4 KiB taken by the thread that writes it, cost
/// ~0.8 s a GiB on the H200 host (benches/RESULTS.md, 2026-12-05: most of a demotion's time;
/// faulting on 8 threads was 25 % faster but took the CPU from the HTTP threads). Large
/// buffers ask for transparent huge pages (2 MiB: 512x fewer faults) and have the kernel
/// populate them in one call; both are hints (an older kernel, or huge pages off, falls back
/// to faults as they come).
fn host_buffer(n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    #[cfg(target_os = "linux")]
    if n >= 4 << 20 {
        // The whole 4 KiB pages inside the buffer (the allocator's header page stays as is).
        let start = (out.as_mut_ptr() as usize).next_multiple_of(4096);
        let end = (out.as_mut_ptr() as usize + n) & !4095;
        if end > start {
            // SAFETY: advice only, on pages inside this live allocation; neither call changes
            // their contents (the buffer is zero either way).
            unsafe {
                if huge_pages() {
                    libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
                }
                // Linux 5.14 and later: every page faulted in now, by the kernel, in one call.
                libc::madvise(
                    start as *mut libc::c_void,
                    end - start,
                    libc::MADV_POPULATE_WRITE,
                );
            }
        }
    }
    out
}

/// Whether [`host_buffer`] asks for transparent huge pages: `FLASHRT_HOST_HUGEPAGES=0` turns it
/// off (an A/B: a huge page the kernel must compact memory for can stall the copy).
#[cfg(target_os = "linux")]
fn huge_pages() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FLASHRT_HOST_HUGEPAGES").map_or(true, |v| v != "0"))
}

/// Bytes of one staging buffer of [`read_staged`].
const STAGING_BYTES: usize = 32 << 20;

/// Per device: a stream of its own and two pinned buffers, for [`read_staged`].
struct Staging {
    stream: Arc<CudaStream>,
    bufs: [PinnedHostSlice<u8>; 2],
}

// SAFETY: the pinned buffers are only touched by the thread holding the `STAGING` lock.
unsafe impl Send for Staging {}

static STAGING: Mutex<Vec<(usize, Staging)>> = Mutex::new(Vec::new());

/// Copy `out.len()` bytes from device address `src` (complete: the caller waited for its
/// writes) into `out`, through two pinned buffers on a stream of their own: each 32 MiB chunk
/// is a DMA (tens of GB/s) overlapped with the host copy of the previous one. A pageable
/// device-to-host copy instead runs at ~1 GB/s for a GiB-sized capsule and, made from another
/// thread (a background demotion), stalled the thread launching every stream's steps (H200,
/// 2026-12-05: streamed decode's mean gap 13.7 -> 23 ms while capsules were demoted).
fn read_staged(home: &Arc<CudaStream>, ordinal: usize, src: u64, out: &mut [u8]) -> Result<()> {
    let mut all = STAGING.lock().unwrap_or_else(|e| e.into_inner());
    if !all.iter().any(|(o, _)| *o == ordinal) {
        let ctx = home.context();
        let stream = ctx.new_stream().map_err(drv("staging stream"))?;
        // SAFETY: pinned host buffers, each written by a copy before it is read.
        let alloc = || unsafe { ctx.alloc_pinned_with_flags::<u8>(STAGING_BYTES, 0) };
        let bufs = [
            alloc().map_err(drv("staging buffer"))?,
            alloc().map_err(drv("staging buffer"))?,
        ];
        all.push((ordinal, Staging { stream, bufs }));
    }
    let st = &mut all
        .iter_mut()
        .find(|(o, _)| *o == ordinal)
        .expect("added")
        .1;
    let len = out.len();
    let n = len.div_ceil(STAGING_BYTES);
    let chunk = move |i: usize| (i * STAGING_BYTES, ((i + 1) * STAGING_BYTES).min(len));
    let mut done: [Option<CudaEvent>; 2] = [None, None];
    // Queue chunk `i` into buffer `i % 2`.
    let queue = |st: &mut Staging, i: usize| -> Result<CudaEvent> {
        let (a, b) = chunk(i);
        let dst = st.bufs[i % 2].as_mut_slice().map_err(drv("staging"))?;
        // SAFETY: `dst` is pinned and not read until the event recorded below completes; the
        // source range lies inside the saved buffer.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                &mut dst[..b - a],
                src + a as u64,
                st.stream.cu_stream(),
            )
        }
        .map_err(drv("read saved region"))?;
        st.stream.record_event(None).map_err(drv("staging"))
    };
    done[0] = Some(queue(st, 0)?);
    for i in 0..n {
        if i + 1 < n {
            done[(i + 1) % 2] = Some(queue(st, i + 1)?);
        }
        done[i % 2]
            .take()
            .expect("queued")
            .synchronize()
            .map_err(drv("read saved region"))?;
        let (a, b) = chunk(i);
        let buf = st.bufs[i % 2].as_slice().map_err(drv("staging"))?;
        copy_parallel(&mut out[a..b], &buf[..b - a]);
    }
    Ok(())
}

/// Threads sharing the host copy of each staged chunk of [`read_staged`].
const COPY_THREADS: usize = 4;

/// `dst.copy_from_slice(src)` on [`COPY_THREADS`] threads: one thread copies from pinned
/// memory at ~4 GB/s on the H100 host (a 16k-token capsule of the 27B shape, 1.3 GB, read back
/// in 320-450 ms, the staged DMAs idle most of it: 2026-12-06 debug lines).
fn copy_parallel(dst: &mut [u8], src: &[u8]) {
    let part = dst.len().div_ceil(COPY_THREADS).max(1 << 20);
    if dst.len() <= part {
        dst.copy_from_slice(src);
        return;
    }
    std::thread::scope(|sc| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            sc.spawn(move || d.copy_from_slice(s));
        }
    });
}

/// The state commands, each run with the stream's lock held by its `DeviceSession` method (session.rs).
impl CudaSession {
    pub(super) fn reset_locked(&mut self) -> Result<()> {
        self.bind()?;
        let bytes = self.layout().arena_bytes(Role::State);
        // SAFETY: the state arena is at least `bytes` long; the memset is ordered on the
        // session stream after every queued step, and restores make that stream wait for them.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.state_base,
                0,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(drv("reset state"))
    }

    pub(super) fn save_locked(&self, pos: usize, set: RegionSet) -> Result<Arc<dyn SavedState>> {
        self.bind()?;
        if pos > self.layout().max_seq {
            return Err(Error::Input(format!(
                "save at position {pos} > max_seq {}",
                self.layout().max_seq
            )));
        }
        let regions = self.regions(set, pos);
        // Regions are packed at 256-byte alignment so the copy kernel moves 16-byte vectors.
        let mut saved_regions = Vec::with_capacity(regions.len());
        let mut off = 0usize;
        for (b, n) in &regions {
            saved_regions.push(SavedRegion {
                id: b.id,
                offset: off,
                bytes: *n,
            });
            off += n.div_ceil(SAVE_ALIGN) * SAVE_ALIGN;
        }
        let total = off;
        self.copy_after_compute("save")?;
        let storage = alloc_on(&self.copy, total.max(1), "saved state")?;
        let dst = dptr(&storage);
        let segments: Vec<(u64, u64, u64)> = regions
            .iter()
            .zip(&saved_regions)
            .filter(|((_, n), _)| *n > 0)
            .map(|((b, n), r)| {
                (
                    self.state_base + b.offset as u64,
                    dst + r.offset as u64,
                    *n as u64,
                )
            })
            .collect();
        // SAFETY: every source is the used prefix of a state region inside the state arena;
        // every destination range lies inside `storage` (sized to the packed total); the copy
        // stream waits for the compute stream, and the compute stream waits for `ready`.
        unsafe { self.batched_copy(&self.copy, &segments, "save")? };
        let ready = self.copy.record_event(None).map_err(drv("save"))?;
        self.stream.wait(&ready).map_err(drv("save"))?;
        let layout = self.layout();
        Ok(Arc::new(CudaSaved {
            model: layout.model.clone(),
            fingerprint: layout.fingerprint.clone(),
            pos,
            set,
            regions: saved_regions,
            total,
            location: format!("cuda:{}", self.model.ordinal),
            ordinal: self.model.ordinal,
            storage: Storage::Device(storage),
            ready: Some(ready),
            home: self.copy.clone(),
        }))
    }

    pub(super) fn restore_locked(
        &mut self,
        saved: &dyn SavedState,
        set: RegionSet,
        held: usize,
    ) -> Result<()> {
        self.bind()?;
        self.restore_timed = false;
        let Some(s) = saved.as_any().downcast_ref::<CudaSaved>() else {
            return self.restore_host(saved, set, held);
        };
        let layout = self.layout();
        if s.fingerprint != layout.fingerprint {
            return Err(Error::Fingerprint {
                capsule_model: s.model.clone(),
                capsule: s.fingerprint.clone(),
                session_model: layout.model.clone(),
                session: layout.fingerprint.clone(),
            });
        }
        let mut copies = Vec::with_capacity(s.regions.len());
        // Saved regions are in layout order, so the next one is almost always the match: the
        // lookup stays linear in the region count (restore is on the TTFT path).
        let mut next = 0;
        for b in layout.state_buffers().filter(|b| in_set(b, set)) {
            let i = match s.regions.get(next) {
                Some(r) if r.id == b.id => next,
                _ => s.regions.iter().position(|r| r.id == b.id).ok_or_else(|| {
                    Error::Capsule(format!(
                        "saved state ({:?}) has no region `{}` needed by a {set:?} restore",
                        s.set, b.name
                    ))
                })?,
            };
            next = i + 1;
            copies.push((b, &s.regions[i]));
        }
        match &s.storage {
            Storage::Device(src) => {
                if s.ordinal != self.model.ordinal {
                    return Err(Error::Unsupported(format!(
                        "restore of a state saved on cuda:{} into a session on cuda:{} (park it first)",
                        s.ordinal, self.model.ordinal
                    )));
                }
                // The copy runs on the compute stream itself: ordered after every queued step
                // and before the next, with no event between the two streams.
                if let Some(ev) = &s.ready {
                    self.stream.wait(ev).map_err(drv("restore"))?;
                }
                let base = dptr(src);
                // Rows the session holds already (every per-position region's first `held`)
                // are not copied: a restore of the capsule a session came from moves its
                // non-KV state and the rows past what it holds.
                let segments: Vec<(u64, u64, u64)> = copies
                    .iter()
                    .map(|(b, r)| (b, r, b.rows_bytes(held).min(r.bytes)))
                    .filter(|(_, r, skip)| r.bytes > *skip)
                    .map(|(b, r, skip)| {
                        (
                            base + (r.offset + skip) as u64,
                            self.state_base + (b.offset + skip) as u64,
                            (r.bytes - skip) as u64,
                        )
                    })
                    .collect();
                // SAFETY: every source lies inside the saved buffer (written before `ready`,
                // which the compute stream waited for); every destination is the prefix of a
                // state region of this session, written in stream order with the steps.
                self.restore_start
                    .record(&self.stream)
                    .map_err(drv("restore"))?;
                unsafe { self.batched_copy(&self.stream, &segments, "restore")? };
                // The saved buffer is freed (stream-ordered) on its home stream when dropped:
                // make that stream wait for these reads first.
                self.restore_done
                    .record(&self.stream)
                    .map_err(drv("restore"))?;
                s.home.wait(&self.restore_done).map_err(drv("restore"))?;
                self.restore_timed = true;
                return Ok(());
            }
            Storage::Pinned(host) => {
                self.copy_after_compute("restore")?;
                let src = host.as_slice().map_err(drv("restore"))?;
                for (b, r) in &copies {
                    if r.bytes > 0 {
                        // SAFETY: source is a range of the pinned buffer, which outlives the
                        // copy because this function synchronises the copy stream below.
                        unsafe {
                            cudarc::driver::result::memcpy_htod_async(
                                self.state_base + b.offset as u64,
                                &src[r.offset..r.offset + r.bytes],
                                self.copy.cu_stream(),
                            )
                        }
                        .map_err(drv(&format!("restore `{}`", b.name)))?;
                    }
                }
                self.copy.synchronize().map_err(drv("restore"))?;
            }
        }
        Ok(())
    }

    pub(super) fn read_region_locked(&self, id: BufferId, pos: usize) -> Result<Vec<u8>> {
        self.bind()?;
        let layout = self.layout();
        if id.index() >= layout.buffers.len() {
            return Err(Error::Input(format!("no buffer {}", id.0)));
        }
        let b = layout.buffer(id);
        if b.role != Role::State {
            return Err(Error::Input(format!("`{}` is not a state region", b.name)));
        }
        let n = b.used_bytes(pos);
        let mut out = vec![0u8; n];
        self.stream
            .synchronize()
            .map_err(drv("step (asynchronous error)"))?;
        if n > 0 {
            // SAFETY: the range is the used prefix of a state region inside the state arena;
            // the stream is idle (restores make it wait for the copy stream).
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut out,
                    self.state_base + b.offset as u64,
                    self.stream.cu_stream(),
                )
            }
            .map_err(drv(&format!("read `{}`", b.name)))?;
            self.stream
                .synchronize()
                .map_err(drv(&format!("read `{}`", b.name)))?;
        }
        Ok(out)
    }
}
