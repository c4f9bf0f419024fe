//! Fuzz the capsule file loader: it must never panic, whatever the bytes.
//!
//! Inputs whose first byte is even are loaded as files as they are. Inputs whose first byte
//! is odd are read as edits to a valid capsule file made at start-up (offset/value pairs),
//! with every checksum recomputed afterwards when the second byte is odd, so the fuzzer
//! reaches the metadata, identity and region-table checks behind the checksums without first
//! having to learn XXH64.
#![no_main]

use flashrt_runtime::capsule_file::{decode, refresh_checksums};
use flashrt_runtime::{CpuBackend, Model};
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};

const MODEL: &str = include_str!("../fuzz_tiny.toml");

struct Fixture {
    model: Model,
    good: Vec<u8>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let ir = flashrt_compiler::model_from_toml(MODEL, "fuzz_tiny.toml").expect("fuzz model");
        let model = Model::with_random_weights(Arc::new(CpuBackend::new()), &ir, 1).expect("model");
        let mut s = model.session().expect("session");
        s.append(&[3, 9, 27, 17, 51, 33, 8]).expect("append");
        let good = flashrt_runtime::capsule_file::capsule_to_vec(&s.snapshot().expect("snapshot"))
            .expect("encode");
        Fixture { model, good }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let compiled = f.model.compiled();
    match data.first() {
        Some(b) if b & 1 == 1 => {
            let mut v = f.good.clone();
            let edits = &data[1.min(data.len())..];
            for e in edits.get(1..).unwrap_or(&[]).chunks(3) {
                if let [hi, lo, val] = *e {
                    let at = ((hi as usize) << 8 | lo as usize) % (v.len() + 1);
                    if at == v.len() {
                        v.truncate((val as usize) * v.len() / 256);
                    } else {
                        v[at] = val;
                    }
                }
            }
            if v.is_empty() {
                return;
            }
            if edits.first().is_some_and(|b| b & 1 == 1) {
                refresh_checksums(&mut v);
            }
            if let Ok(c) = decode(&v, compiled) {
                // Whatever loads must be consistent enough to become a capsule or say why not.
                let _ = c.into_capsule(compiled.clone());
            }
        }
        _ => {
            if let Ok(c) = decode(data, compiled) {
                let _ = c.into_capsule(compiled.clone());
            }
        }
    }
});
