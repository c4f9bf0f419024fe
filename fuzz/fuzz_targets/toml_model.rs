//! Fuzz the TOML model front-end: any text gets a model or diagnostics, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = flashrt_compiler::model_from_toml(text, "fuzz.toml");
    }
});
