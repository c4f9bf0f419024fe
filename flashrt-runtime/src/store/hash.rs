//! KV-row hashes: what the store compares to decide whether a capsule may share a base's KV
//! rows. XXH64 (seed 0, as capsule files use) of each KV region's first rows, for several row
//! counts at once: one streaming pass over each region serves every prefix (XXH64's state is
//! read out at each prefix's end), and the regions are hashed on several threads, because a
//! 16k-token capsule of the 27B shape holds ~1.1 GB of KV.

use crate::capsule_file;
use flashrt_ir::BufferId;

/// A KV region: its buffer and bytes per token.
pub(super) type KvRegion = (BufferId, usize);

/// XXH64 of each KV region's first `rows` rows (all of them for `usize::MAX`), for each
/// `rows` in `prefixes`: `[prefix][region]`, regions in `kv`'s order (a region absent from
/// `regions` hashes as empty). At most `threads` threads.
pub(super) fn hash_kv(
    kv: &[KvRegion],
    regions: &[(BufferId, Vec<u8>)],
    prefixes: &[usize],
    threads: usize,
) -> Vec<Vec<u64>> {
    let work: Vec<(&[u8], Vec<usize>)> = kv
        .iter()
        .map(|&(id, per_token)| {
            let bytes = regions
                .iter()
                .find(|(x, _)| *x == id)
                .map_or(&[][..], |(_, v)| &v[..]);
            let ends = prefixes
                .iter()
                .map(|&rows| rows.saturating_mul(per_token).min(bytes.len()))
                .collect();
            (bytes, ends)
        })
        .collect();
    let per_region = hash_prefixes_parallel(&work, threads);
    (0..prefixes.len())
        .map(|i| per_region.iter().map(|h| h[i]).collect())
        .collect()
}

/// The machine's hardware threads.
pub(super) fn all_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// XXH64 (seed 0) of `bytes[..end]` for every `end` (ascending order not required) of each
/// `(bytes, ends)` item, in one streaming pass per item; items spread over up to `threads`
/// threads. Equal to `capsule_file::xxh64(&bytes[..end], 0)`.
fn hash_prefixes_parallel(work: &[(&[u8], Vec<usize>)], threads: usize) -> Vec<Vec<u64>> {
    fn one(bytes: &[u8], ends: &[usize]) -> Vec<u64> {
        let mut order: Vec<usize> = (0..ends.len()).collect();
        order.sort_by_key(|&i| ends[i]);
        let mut out = vec![0; ends.len()];
        let mut h = capsule_file::Xxh64::new(0);
        let mut at = 0;
        for i in order {
            h.update(&bytes[at..ends[i]]);
            at = ends[i];
            out[i] = h.finish();
        }
        out
    }
    let threads = threads.min(work.len()).max(1);
    if threads == 1 {
        return work.iter().map(|(b, e)| one(b, e)).collect();
    }
    let per = work.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .chunks(per)
            .map(|part| {
                scope.spawn(move || part.iter().map(|(b, e)| one(b, e)).collect::<Vec<_>>())
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("hashing thread"))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One streaming pass per region, read out at every prefix, on several threads, gives
    /// exactly the one-shot XXH64 of each prefix (what capsule files and earlier stores
    /// computed), in the callers' order, at any thread count.
    #[test]
    fn prefix_hashes_in_one_pass_equal_one_shot_hashes() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut byte = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        };
        let data: Vec<Vec<u8>> = [0usize, 7, 31, 32, 33, 1000, 4099]
            .iter()
            .cycle()
            .take(37)
            .map(|&n| (0..n).map(|_| byte()).collect())
            .collect();
        let work: Vec<(&[u8], Vec<usize>)> = data
            .iter()
            .map(|d| {
                let n = d.len();
                // Unsorted, repeated and whole-region ends.
                (&d[..], vec![n, n / 2, 0, n / 3, n / 2, n.saturating_sub(1)])
            })
            .collect();
        for threads in [1, 3, all_threads()] {
            let got = hash_prefixes_parallel(&work, threads);
            assert_eq!(got.len(), work.len());
            for ((bytes, ends), hashes) in work.iter().zip(&got) {
                for (&end, &h) in ends.iter().zip(hashes) {
                    assert_eq!(
                        h,
                        capsule_file::xxh64(&bytes[..end], 0),
                        "prefix {end} of {}",
                        bytes.len()
                    );
                }
            }
        }
    }
}
