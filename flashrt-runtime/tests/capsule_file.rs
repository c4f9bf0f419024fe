//! The capsule file format: round trips, identity checks, and a few thousand seeded random
//! mutations of real files, none of which may panic or load.

mod common;

use common::*;
use flashrt_runtime::capsule_file::{
    self, HEADER_LEN, capsule_from_slice, capsule_to_vec, read_capsule, write_capsule,
};
use flashrt_runtime::{Capsule, Error, Model, SamplerState, Session};

const BUCKETS: [usize; 2] = [4, 16];

fn state_of(s: &Session) -> Vec<Vec<u8>> {
    s.model()
        .compiled()
        .layout
        .state_buffers()
        .map(|b| s.read_region(b.id).unwrap())
        .collect()
}

fn capsule_at(m: &Model, seed: u64, n: usize) -> (Session, Capsule) {
    let mut s = m.session().unwrap();
    s.set_sampler(SamplerState::seeded(seed, 0.9, 40, 0.95));
    s.append(&tokens(seed, n, m.vocab())).unwrap();
    s.generate(3).unwrap();
    let c = s.snapshot().unwrap();
    (s, c)
}

#[test]
fn round_trip_through_a_file_is_byte_exact_and_samples_the_same() {
    for name in FIXTURES {
        let m = load(name, &BUCKETS);
        let (mut s, cap) = capsule_at(&m, 11, 29);
        let before = state_of(&s);
        let dir = temp_dir("caps-rt");
        let path = dir.join("a.caps");
        let n = write_capsule(&path, &cap).unwrap();
        assert_eq!(n, std::fs::metadata(&path).unwrap().len());
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(&*dir).unwrap().count(), 1);
        let back = read_capsule(&path, &m).unwrap();
        assert_eq!(back.meta, cap.meta, "{name}: metadata");
        for id in cap.region_ids() {
            assert_eq!(
                back.region_bytes(id).unwrap(),
                cap.region_bytes(id).unwrap()
            );
        }
        // What the original goes on to sample...
        let want = s.generate(8).unwrap();
        // ...a fresh session restored from the file samples too (RNG state included).
        let mut t = m.session().unwrap();
        t.restore(&back).unwrap();
        assert_eq!(
            state_of(&t),
            before,
            "{name}: state after restore from file"
        );
        assert_eq!(t.generate(8).unwrap(), want, "{name}: continuation");
        // In memory too.
        let bytes = capsule_to_vec(&cap).unwrap();
        let again = capsule_from_slice(&bytes, &m).unwrap();
        assert_eq!(again.meta, cap.meta);
    }
}

#[test]
fn a_capsule_at_position_zero_round_trips() {
    let m = load("lfm2-public", &BUCKETS);
    let cap = m.session().unwrap().snapshot().unwrap();
    let bytes = capsule_to_vec(&cap).unwrap();
    let back = capsule_from_slice(&bytes, &m).unwrap();
    assert_eq!(back.pos(), 0);
    assert!(back.last_logits().is_none());
}

#[test]
fn another_models_file_is_a_fingerprint_error() {
    let a = load("lfm2-public", &BUCKETS);
    let b = load("qwen35-public", &BUCKETS);
    let (_, cap) = capsule_at(&a, 3, 10);
    let bytes = capsule_to_vec(&cap).unwrap();
    match capsule_from_slice(&bytes, &b) {
        Err(Error::Fingerprint {
            capsule_model,
            session_model,
            ..
        }) => {
            assert_eq!(capsule_model, a.name());
            assert_eq!(session_model, b.name());
        }
        other => panic!("expected a fingerprint error, got {other:?}"),
    }
    // Same model name, other layout (max_seq differs): still refused.
    let opts = flashrt_runtime::ir::hf::HfOptions {
        max_seq: Some(128),
        prefill_buckets: Some(BUCKETS.to_vec()),
        ..Default::default()
    };
    let a2 = Model::load_hf_dir(cpu(), &fixture("lfm2-public"), &opts).unwrap();
    assert_eq!(a2.name(), a.name());
    assert!(matches!(
        capsule_from_slice(&bytes, &a2),
        Err(Error::Fingerprint { .. })
    ));
}

fn expect_capsule_err(r: Result<Capsule, Error>, needle: &str) {
    match r {
        Err(Error::Capsule(m)) => assert!(m.contains(needle), "message `{m}` lacks `{needle}`"),
        other => panic!("expected a capsule error containing `{needle}`, got {other:?}"),
    }
}

#[test]
fn clear_errors_for_magic_version_truncation_and_bit_flips() {
    let m = load("lfm2-public", &BUCKETS);
    let (_, cap) = capsule_at(&m, 5, 20);
    let good = capsule_to_vec(&cap).unwrap();
    expect_capsule_err(capsule_from_slice(b"", &m), "bad magic");
    expect_capsule_err(capsule_from_slice(b"GIF89a....", &m), "bad magic");
    let mut v = good.clone();
    v[8] = 9;
    expect_capsule_err(capsule_from_slice(&v, &m), "version 9 is not supported");
    expect_capsule_err(capsule_from_slice(&good[..30], &m), "truncated");
    expect_capsule_err(capsule_from_slice(&good[..good.len() - 1], &m), "truncated");
    let mut long = good.clone();
    long.push(0);
    expect_capsule_err(capsule_from_slice(&long, &m), "trailing");
    // A flipped bit in the metadata: the header checksum catches it.
    let mut v = good.clone();
    v[HEADER_LEN + 5] ^= 0x10;
    expect_capsule_err(capsule_from_slice(&v, &m), "header checksum");
    // A flipped bit in the region data: that region's checksum catches it.
    let mut v = good.clone();
    let last = v.len() - 3;
    v[last] ^= 0x01;
    expect_capsule_err(capsule_from_slice(&v, &m), "checksum mismatch in region");
    // A huge declared length is refused before any allocation.
    let mut v = good.clone();
    v[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_capsule_err(capsule_from_slice(&v, &m), "needs at most");
}

#[test]
fn semantic_defects_behind_valid_checksums_are_caught() {
    let m = load("lfm2-public", &BUCKETS);
    let (_, cap) = capsule_at(&m, 6, 20);
    let good = capsule_to_vec(&cap).unwrap();
    let meta_len = u64::from_le_bytes(good[16..24].try_into().unwrap()) as usize;
    let meta = std::str::from_utf8(&good[HEADER_LEN..HEADER_LEN + meta_len]).unwrap();
    let edit = |from: &str, to: &str| -> Vec<u8> {
        assert!(meta.contains(from), "{from}");
        let new_meta = meta.replacen(from, to, 1);
        let mut v = good[..16].to_vec();
        v.extend_from_slice(&(new_meta.len() as u64).to_le_bytes());
        v.extend_from_slice(&good[24..HEADER_LEN]);
        v.extend_from_slice(new_meta.as_bytes());
        v.extend_from_slice(&good[HEADER_LEN + meta_len..]);
        assert!(capsule_file::refresh_checksums(&mut v));
        v
    };
    // Position that disagrees with the history and with the regions.
    let pos = format!("\"pos\":{}", cap.pos());
    expect_capsule_err(
        capsule_from_slice(&edit(&pos, "\"pos\":3"), &m),
        "tokens of history",
    );
    // A token outside the vocabulary.
    let first = format!("\"tokens\":[{}", cap.tokens()[0]);
    expect_capsule_err(
        capsule_from_slice(&edit(&first, "\"tokens\":[99999"), &m),
        "outside the vocabulary",
    );
    // A sampler that cannot be valid.
    expect_capsule_err(
        capsule_from_slice(&edit("\"top_p\":0.95", "\"top_p\":7.0"), &m),
        "top_p",
    );
    // Not JSON at all.
    expect_capsule_err(
        capsule_from_slice(&edit("{", "["), &m),
        "metadata is invalid",
    );
    // A delta file cannot be imported on its own.
    let with_base = edit(
        "\"base\":null",
        "\"base\":{\"id\":\"0123456789abcdef\",\"pos\":0}",
    );
    expect_capsule_err(capsule_from_slice(&with_base, &m), "base capsule");
}

/// SplitMix64 for the mutation schedule.
struct Mix(u64);
impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// One random mutation: bit flips, byte overwrites, truncation, extension, splices, length
/// fields set to edge values; half of them with every checksum recomputed afterwards so the
/// parser behind the checksums is exercised too.
fn mutate(good: &[u8], r: &mut Mix) -> (Vec<u8>, bool) {
    let mut v = good.to_vec();
    for _ in 0..1 + r.below(3) {
        match r.below(7) {
            0 => {
                let i = r.below(v.len());
                v[i] ^= 1 << r.below(8);
            }
            1 => {
                let i = r.below(v.len());
                v[i] = r.next() as u8;
            }
            2 => {
                let n = r.below(v.len());
                v.truncate(n);
            }
            3 => {
                let extra = r.below(64);
                v.extend((0..extra).map(|_| r.next() as u8));
            }
            4 if v.len() >= HEADER_LEN => {
                let field = 16 + 8 * r.below(3);
                let val = match r.below(4) {
                    0 => 0u64,
                    1 => u64::MAX,
                    2 => r.next() % 4096,
                    _ => {
                        u64::from_le_bytes(v[field..field + 8].try_into().unwrap())
                            ^ (1 << r.below(64))
                    }
                };
                v[field..field + 8].copy_from_slice(&val.to_le_bytes());
            }
            5 => {
                // Copy a random slice over another place.
                let a = r.below(v.len());
                let b = r.below(v.len());
                let n = r.below(32).min(v.len() - a).min(v.len() - b);
                let s = v[a..a + n].to_vec();
                v[b..b + n].copy_from_slice(&s);
            }
            _ => {
                // Inside the region table: a field of an entry.
                let meta_len = v
                    .get(16..24)
                    .map_or(0, |x| u64::from_le_bytes(x.try_into().unwrap()));
                let at = HEADER_LEN
                    .saturating_add(meta_len as usize)
                    .saturating_add(r.below(200));
                if at < v.len() {
                    v[at] = r.next() as u8;
                }
            }
        }
        if v.is_empty() {
            break;
        }
    }
    let refreshed = r.below(2) == 0 && capsule_file::refresh_checksums(&mut v);
    (v, refreshed)
}

#[test]
fn thousands_of_random_mutations_never_panic_and_never_load() {
    let m = load("qwen35-public", &BUCKETS);
    let (_, cap) = capsule_at(&m, 8, 13);
    let good = capsule_to_vec(&cap).unwrap();
    let mut r = Mix(0x5eed);
    let mut loaded = 0;
    let mut rejected = 0;
    for _ in 0..3000 {
        let (v, refreshed) = mutate(&good, &mut r);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| capsule_from_slice(&v, &m)))
        {
            Err(_) => panic!("the loader panicked on a mutated file"),
            Ok(Ok(c)) if refreshed => {
                // Checksums recomputed over changed bytes: the file is well-formed, so it may
                // load, but only as a consistent capsule that a session accepts.
                m.fork(&c).expect("a capsule that loads restores");
                loaded += 1;
            }
            Ok(Ok(c)) => {
                // Without fresh checksums only a change to nothing that matters (a digit of
                // the timestamp, say) may load: then it is the very same capsule.
                assert_eq!(
                    c.meta, cap.meta,
                    "a corrupted file loaded as a different capsule"
                );
                for id in cap.region_ids() {
                    assert_eq!(c.region_bytes(id).unwrap(), cap.region_bytes(id).unwrap());
                }
                loaded += 1;
            }
            Ok(Err(Error::Capsule(_) | Error::Fingerprint { .. })) => rejected += 1,
            Ok(Err(e)) => panic!("unexpected error kind: {e}"),
        }
    }
    eprintln!(
        "{rejected} rejected, {loaded} loaded, file {} bytes",
        good.len()
    );
    assert!(rejected > 2000, "{rejected} rejected, {loaded} loaded");
}
