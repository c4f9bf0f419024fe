//! Compile-time behaviour of the model macros, one folder per failure category.
//! Refresh the expected `.stderr` files with `TRYBUILD=overwrite cargo test --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/[!p]*/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
