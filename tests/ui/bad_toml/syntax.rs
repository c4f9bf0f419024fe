// A TOML syntax error: the message carries file:line:col of the bad token.
// (trybuild builds this file from target/tests/trybuild/flashrt, four levels below the
// repository root, and include_model! resolves paths from CARGO_MANIFEST_DIR.)
flashrt::include_model!("../../../../tests/ui/bad_toml/bad.toml");

fn main() {}
