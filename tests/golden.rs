//! Golden snapshots of what the compiler emits for every model in `models/`: the layout
//! (`<model>.layout.txt`), the plan summary (`<model>.plan.txt`) and the generated Rust
//! (`<model>.rs`). A change to any of them shows up as a reviewable diff in `tests/golden/`.
//!
//! To accept an intended change: `FLASHRT_BLESS=1 cargo test --test golden`.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn models() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("models"))
        .expect("models/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    assert!(
        v.len() >= 5,
        "expected the fixture models, the 27B shape and the demo in models/"
    );
    v
}

fn check(path: &Path, actual: &str, failures: &mut Vec<String>) {
    if std::env::var_os("FLASHRT_BLESS").is_some() {
        std::fs::write(path, actual).expect("write golden");
        return;
    }
    match std::fs::read_to_string(path) {
        Ok(expected) if expected == actual => {}
        Ok(expected) => {
            let line = expected
                .lines()
                .zip(actual.lines())
                .position(|(a, b)| a != b)
                .unwrap_or(expected.lines().count().min(actual.lines().count()));
            failures.push(format!(
                "{} differs from the compiler's output (first difference at line {}); \
                 rerun with FLASHRT_BLESS=1 if the change is intended",
                path.display(),
                line + 1
            ));
        }
        Err(_) => failures.push(format!(
            "{} is missing; run with FLASHRT_BLESS=1",
            path.display()
        )),
    }
}

#[test]
fn compiler_output_matches_golden_snapshots() {
    let mut failures = Vec::new();
    for model in models() {
        let src = std::fs::read_to_string(&model).unwrap();
        let rel = format!("models/{}", model.file_name().unwrap().to_string_lossy());
        let ir = flashrt::compiler::model_from_toml(&src, &rel).unwrap_or_else(|d| panic!("{d}"));
        let stem = model.file_stem().unwrap().to_string_lossy().into_owned();
        let compiled = flashrt::ir::compile(&ir, flashrt::ir::Target { dtype: ir.dtype });
        let golden = root().join("tests/golden");
        check(
            &golden.join(format!("{stem}.layout.txt")),
            &flashrt::compiler::emit::layout_summary(&compiled),
            &mut failures,
        );
        check(
            &golden.join(format!("{stem}.plan.txt")),
            &flashrt::compiler::emit::plan_summary(&compiled),
            &mut failures,
        );
        check(
            &golden.join(format!("{stem}.rs")),
            &flashrt::compiler::emit::rust_source(&ir),
            &mut failures,
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The generated capsule has exactly one field per state region plus `meta`.
#[test]
fn generated_capsule_fields_are_exactly_the_state_regions() {
    for model in models() {
        let src = std::fs::read_to_string(&model).unwrap();
        let ir = flashrt::compiler::model_from_toml(&src, "m.toml").unwrap();
        let compiled = flashrt::ir::compile(&ir, flashrt::ir::Target { dtype: ir.dtype });
        let code = flashrt::compiler::emit::rust_source(&ir);
        let file = syn::parse_file(&code).expect("generated code parses");
        let capsule_name = format!("{}Capsule", ir.type_name());
        let st = file
            .items
            .iter()
            .find_map(|i| match i {
                syn::Item::Struct(s) if s.ident == capsule_name => Some(s),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no struct {capsule_name} in generated code"));
        let fields: Vec<String> = st
            .fields
            .iter()
            .map(|f| f.ident.as_ref().unwrap().to_string())
            .collect();
        let mut expected: Vec<String> = compiled
            .layout
            .state_buffers()
            .map(|b| b.field_name())
            .collect();
        expected.push("meta".into());
        assert_eq!(fields, expected, "{}", model.display());
    }
}
