//! Build script: compiles the CUDA kernels (`../kernels/*.cu`) into fatbins, only when the
//! `cuda` feature is on. Without it this does nothing, so CPU-only builds and CI stay fast.
//!
//! Kernel files are compiled by family, the name before the first `_` (`gemv.cu` and
//! `gemv_mma.cu` are the `gemv` family, `attention*.cu` the `attention` family): each family is
//! one translation unit (a generated `k_<family>.cu` that `#include`s its files in name order,
//! so a file may use what an earlier file of its family defines), and the families compile in
//! parallel (`NUM_JOBS` nvcc processes, largest first): on two cores the build takes about as
//! long as the largest family instead of the sum. A family whose sources, shared headers
//! (`*.cuh`), nvcc and flags are unchanged is not recompiled: not in this `OUT_DIR`, and not
//! when another profile or feature set of the same target directory built it (a content-keyed
//! copy in `<target>/flashrt-kernels/`). Shared device helpers live in `kernels/common.cuh`.
//!
//! nvcc is taken from `$FLASHRT_NVCC`, else `$NVCC`, else the repository's `.venv/nvcc`
//! (created by `scripts/install-nvcc.sh`). Targets: `sm_90a` SASS (Hopper, with the wgmma kernels)
//! plus `compute_90` PTX (so newer GPUs JIT it; the sm_90a-only kernels trap there and the host
//! never selects them); `FLASHRT_CUDA_ARCHS="80 89 120"` adds SASS for more architectures.
//! Extra nvcc flags can be passed with `FLASHRT_NVCC_FLAGS`.
//! The fatbins are written to `$OUT_DIR/k_<family>.fatbin`, and `$OUT_DIR/flashrt_kernels.rs`
//! lists them for `src/backend/cuda/kernels.rs`, which embeds them with `include_bytes!` and
//! loads one module per family.

use std::collections::BTreeMap;
use std::env;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in [
        "FLASHRT_NVCC",
        "NVCC",
        "FLASHRT_CUDA_ARCHS",
        "FLASHRT_NVCC_FLAGS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let root = manifest.parent().expect("workspace root").to_path_buf();
    let kernels = root.join("kernels");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));

    println!("cargo:rerun-if-changed={}", kernels.display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", kernels.display())))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|x| x.to_str()), Some("cu" | "cuh")))
        .collect();
    sources.sort();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    let units: Vec<&PathBuf> = sources
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    if units.is_empty() {
        fail(&format!("no .cu files in {}", kernels.display()));
    }

    let nvcc = find_nvcc(&root);
    let mut args: Vec<String> = [
        "-fatbin",
        "-O3",
        "-std=c++17",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90,code=compute_90",
        // nvcc compresses only large modules by default; small families too (a third the
        // bytes, decompressed once at load).
        "-Xfatbin",
        "-compress-all",
    ]
    .map(String::from)
    .to_vec();
    if let Ok(archs) = env::var("FLASHRT_CUDA_ARCHS") {
        for a in archs
            .split([',', ' '])
            .map(str::trim)
            .filter(|a| !a.is_empty())
        {
            let a = a.trim_start_matches("sm_").trim_start_matches("compute_");
            if a != "90" {
                args.push(format!("-gencode=arch=compute_{a},code=sm_{a}"));
            }
        }
    }
    if let Ok(flags) = env::var("FLASHRT_NVCC_FLAGS") {
        args.extend(flags.split_whitespace().map(String::from));
    }

    // Families, and what every family's result depends on besides its own files.
    let mut families: BTreeMap<String, Vec<&PathBuf>> = BTreeMap::new();
    for u in &units {
        let stem = u.file_stem().and_then(|s| s.to_str()).unwrap_or("kernels");
        let family = stem.split('_').next().unwrap_or(stem).to_string();
        families.entry(family).or_default().push(u);
    }
    let read = |p: &Path| {
        std::fs::read(p).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", p.display())))
    };
    let mut shared = std::collections::hash_map::DefaultHasher::new();
    for s in sources
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "cuh"))
    {
        read(s).hash(&mut shared);
    }
    nvcc.hash(&mut shared);
    args.hash(&mut shared);
    let shared = shared.finish();

    struct Job {
        family: String,
        umbrella: PathBuf,
        fatbin: PathBuf,
        stamp: PathBuf,
        key: String,
        bytes: usize,
    }
    let mut jobs = Vec::new();
    let mut listed = Vec::new();
    // Fatbins by content key, shared by every build in this target directory (debug and
    // release, `check` and `build`, other feature sets): `<target>/flashrt-kernels/`.
    let cache = out.ancestors().nth(4).map(|t| t.join("flashrt-kernels"));
    for (family, files) in &families {
        let umbrella = out.join(format!("k_{family}.cu"));
        let mut text = format!(
            "// Generated by flashrt-runtime/build.rs: the `{family}` kernel family, one unit.\n"
        );
        let mut h = std::collections::hash_map::DefaultHasher::new();
        shared.hash(&mut h);
        let mut bytes = 0;
        for f in files {
            text.push_str(&format!("#include \"{}\"\n", f.display()));
            let src = read(f);
            bytes += src.len();
            src.hash(&mut h);
        }
        text.hash(&mut h);
        let key = format!("{:016x}", h.finish());
        let fatbin = out.join(format!("k_{family}.fatbin"));
        let stamp = out.join(format!("k_{family}.key"));
        listed.push((family.clone(), fatbin.clone()));
        let cached = cache
            .as_ref()
            .map(|c| c.join(format!("{family}-{key}.fatbin")));
        let fresh = fatbin.is_file() && std::fs::read_to_string(&stamp).is_ok_and(|k| k == key);
        if fresh {
            if let Some(c) = cached.filter(|c| !c.is_file()) {
                let _ = std::fs::create_dir_all(c.parent().unwrap_or(&out));
                let _ = std::fs::copy(&fatbin, c);
            }
            continue;
        }
        // Built before for another profile or feature set of this target directory.
        if let Some(c) = &cached
            && std::fs::copy(c, &fatbin).is_ok()
        {
            let _ = std::fs::write(&stamp, &key);
            continue;
        }
        std::fs::write(&umbrella, text)
            .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", umbrella.display())));
        jobs.push(Job {
            family: family.clone(),
            umbrella,
            fatbin,
            stamp,
            key,
            bytes,
        });
    }
    // Largest first, so the longest compile starts at once.
    jobs.sort_by_key(|j| std::cmp::Reverse(j.bytes));
    let workers = env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let warnings = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| {
                while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let output = Command::new(&nvcc)
                        .args(&args)
                        .arg("-I")
                        .arg(&kernels)
                        .arg("-o")
                        .arg(&job.fatbin)
                        .arg(&job.umbrella)
                        .output();
                    match output {
                        Err(e) => failures
                            .lock()
                            .unwrap()
                            .push(format!("cannot run {}: {e}", nvcc.display())),
                        Ok(o) if !o.status.success() => failures.lock().unwrap().push(format!(
                            "nvcc failed on the `{}` kernels ({}):\n{}\n{}",
                            job.family,
                            o.status,
                            String::from_utf8_lossy(&o.stdout),
                            String::from_utf8_lossy(&o.stderr)
                        )),
                        Ok(o) => {
                            let _ = std::fs::write(&job.stamp, &job.key);
                            if let Some(c) = &cache {
                                let _ = std::fs::create_dir_all(c);
                                let _ = std::fs::copy(
                                    &job.fatbin,
                                    c.join(format!("{}-{}.fatbin", job.family, job.key)),
                                );
                            }
                            // Warnings are worth seeing while kernels are written; cargo
                            // shows them with -vv.
                            warnings.lock().unwrap().extend(
                                String::from_utf8_lossy(&o.stderr)
                                    .lines()
                                    .filter(|l| !l.trim().is_empty())
                                    .map(|l| format!("nvcc ({}): {l}", job.family)),
                            );
                        }
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    if !failures.is_empty() {
        fail(&failures.join("\n"));
    }
    for w in warnings.into_inner().unwrap() {
        println!("cargo:warning={w}");
    }
    let mut list = String::from(
        "// Generated by flashrt-runtime/build.rs: one fatbin per kernel family.\n\
         static FATBINS: &[(&str, &[u8])] = &[\n",
    );
    for (family, fatbin) in &listed {
        list.push_str(&format!(
            "    ({family:?}, include_bytes!({:?})),\n",
            fatbin.display().to_string()
        ));
    }
    list.push_str("];\n");
    let rs = out.join("flashrt_kernels.rs");
    std::fs::write(&rs, list)
        .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", rs.display())));
}

/// `$FLASHRT_NVCC`, else `$NVCC`, else `<repo>/.venv/nvcc/cuda/bin/nvcc`.
fn find_nvcc(root: &Path) -> PathBuf {
    for var in ["FLASHRT_NVCC", "NVCC"] {
        if let Some(p) = env::var_os(var).filter(|p| !p.is_empty()) {
            let p = PathBuf::from(p);
            if p.is_file() || p.components().count() == 1 {
                return p;
            }
            fail(&format!(
                "${var} points at {}, which does not exist",
                p.display()
            ));
        }
    }
    let venv = root.join(".venv/nvcc/cuda/bin/nvcc");
    if venv.is_file() {
        return venv;
    }
    fail(&format!(
        "the `cuda` feature needs nvcc, and none was found: run `scripts/install-nvcc.sh` \
         (installs the pinned CUDA 13.0 nvcc into {}), or set FLASHRT_NVCC to an nvcc binary",
        root.join(".venv/nvcc").display()
    ))
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    panic!("flashrt-runtime build script: {msg}");
}
