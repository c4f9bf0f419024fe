//! Host buffers kept for reuse by capsules copied down from the device.
//!
//! A capsule demoted to the host is read into fresh host buffers: at 16k tokens of the 27B
//! shape 1.3 GB whose pages the kernel must fault in (or populate) before the copy lands,
//! which made a demotion take 0.4-3 s on the H100 host (2026-12-06, `demotion job` debug
//! lines: 1.3-2.7 GB/s, against the tens of GB/s of the pinned DMA behind it), and dropping a
//! host copy gives those pages back (tens of milliseconds of unmapping). The capsule store
//! gives the buffers of host copies leaving memory to a pool and the next demotion takes them
//! back, pages already in place, so in a steady state (one capsule in, one out) neither happens.
//!
//! A buffer taken may have up to twice the capacity the region needs (never more), which the
//! host tier's byte count (lengths) does not see; the pool itself holds at most its cap.
//!
//! Hand-written because what it pools is specific: `Vec<u8>` region buffers of very different
//! sizes (a 40 MB KV region next to a 3 MB recurrent state), matched by capacity, under a byte
//! cap, never shrunk in place.

use std::sync::Mutex;

/// Buffers smaller than this are not kept: allocating them costs little.
pub const MIN_POOLED: usize = 1 << 20;

/// A bounded set of host buffers (see the module docs). Thread-safe: a demotion's thread
/// takes, the store's thread gives.
#[derive(Debug, Default)]
pub struct HostPool {
    cap: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    bufs: Vec<Vec<u8>>,
    bytes: usize,
    /// Bytes handed out in reused buffers, ever.
    reused: u64,
}

impl HostPool {
    /// A pool holding at most `cap` bytes of buffers (capacity).
    pub fn new(cap: usize) -> HostPool {
        HostPool {
            cap,
            inner: Mutex::default(),
        }
    }

    /// A buffer of length `n`: the pooled one of the smallest capacity that holds `n` bytes
    /// and not more than twice that (bytes from an earlier use, to be overwritten, up to its
    /// old length; zeros past it), or an empty `Vec` with no capacity when none does (or `n`
    /// is below [`MIN_POOLED`]).
    pub fn take(&self, n: usize) -> Vec<u8> {
        if n < MIN_POOLED {
            return Vec::new();
        }
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let best = g
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= n && b.capacity() / 2 <= n)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let Some(i) = best else {
            return Vec::new();
        };
        let mut v = g.bufs.swap_remove(i);
        g.bytes -= v.capacity();
        g.reused += n as u64;
        drop(g);
        // Within the old length this only moves the end; past it, zeros (the pages are there).
        v.resize(n, 0);
        v
    }

    /// Keep `v` for a later [`HostPool::take`] if it is large enough and fits under the cap;
    /// otherwise hand it back (for the caller to drop where the unmapping costs nobody).
    pub fn give(&self, v: Vec<u8>) -> Option<Vec<u8>> {
        let c = v.capacity();
        if c < MIN_POOLED {
            return Some(v);
        }
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.bytes + c > self.cap {
            return Some(v);
        }
        g.bytes += c;
        g.bufs.push(v);
        None
    }

    /// Bytes of buffers held.
    pub fn bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).bytes
    }

    /// Bytes handed out in reused buffers since the pool was made.
    pub fn reused(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).reused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: usize = MIN_POOLED;

    #[test]
    fn takes_the_smallest_that_fits_under_the_cap() {
        let p = HostPool::new(10 * M);
        assert!(p.give(vec![1u8; 4 * M]).is_none());
        assert!(p.give(vec![2u8; 2 * M]).is_none());
        // Over the cap, or too small to keep: handed back.
        assert_eq!(p.give(vec![3u8; 5 * M]).map(|v| v.len()), Some(5 * M));
        assert_eq!(p.give(vec![4u8; M - 1]).map(|v| v.len()), Some(M - 1));
        assert_eq!(p.bytes(), 6 * M);
        // The 2 MiB buffer for 3/2 MiB; its bytes are the old ones (to be overwritten).
        let a = p.take(3 * M / 2);
        assert_eq!((a.len(), a[0]), (3 * M / 2, 2));
        assert_eq!(p.reused(), 3 * M as u64 / 2);
        // Nothing holds 5 MiB; nothing is wasted on 1 MiB.
        assert_eq!(p.take(5 * M).capacity(), 0);
        assert_eq!(p.take(M).capacity(), 0);
        assert_eq!(p.bytes(), 4 * M);
        // Given back shorter, a buffer grows zeros past its old length.
        assert!(p.give(a).is_none());
        let b = p.take(2 * M);
        assert_eq!((b.len(), b[0], b[2 * M - 1]), (2 * M, 2, 0));
        // Small requests never come from the pool.
        assert_eq!(p.take(M / 2).capacity(), 0);
        assert_eq!(p.bytes(), 4 * M);
    }
}
