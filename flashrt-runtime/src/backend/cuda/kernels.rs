//! The embedded kernel modules: `kernels/*.cu`, compiled by `build.rs` with nvcc into one
//! fatbin per kernel family (sm_90a SASS + compute_90 PTX), each loaded once per model with
//! `cuModuleLoadData` (~0.1 ms each; no NVRTC at run time).
//!
//! Every entry point the backend may launch is resolved when the module loads, so a missing
//! or misspelt kernel is a load-time error, never a failure halfway through a captured graph.

use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use flashrt_ir::DType;
use std::collections::HashMap;
use std::sync::Arc;

// `FATBINS: &[(family, fatbin)]`, produced by `build.rs`.
include!(concat!(env!("OUT_DIR"), "/flashrt_kernels.rs"));

/// Kernels whose entry points are `<name>_<dtype>` for dtype in bf16, f16, f32.
const PER_DTYPE: &[&str] = &[
    "embed",
    "rms_norm",
    "rms_norm_vec",
    "gated_rms_norm",
    "gated_rms_norm_vec",
    "mul",
    "mul_vec",
    "mul_rowgate",
    "unary",
    "unary_vec",
    "add_bias",
    "split_heads",
    "store_last_row",
    "load_state",
    "rope",
    "qk_prep",
    "kv_write",
    "attention_d64",
    "attention_d128",
    "attention_d256",
    "attention_d512",
    "attention_combine",
    "attention_decode_d64",
    "attention_decode_d128",
    "attention_decode_d256",
    "attention_decode_rows_d64",
    "attention_decode_rows_d128",
    "attention_decode_rows_d256",
    "attention_decode_combine",
    "conv_out",
    "conv_state",
    "conv_vec",
    "gated_deltanet_k64",
    "gated_deltanet_k128",
    "gated_deltanet_k256",
    "gated_deltanet_chunk_k64",
    "gated_deltanet_chunk_k128",
    "gated_deltanet_chunk_prep_k64",
    "gated_deltanet_chunk_prep_k128",
    "gated_deltanet_chunk_pre_k64",
    "gated_deltanet_chunk_pre_k128",
    "gated_deltanet_chunk_pre2_k64",
    "gated_deltanet_chunk_pre2_k128",
    "mamba2_scan_n64",
    "mamba2_scan_n128",
    "mamba2_scan_n256",
    "init_random",
    "convert",
    "moe_logits",
    "moe_x_f32",
    "moe_route",
    "moe_hist",
    "moe_plan2",
    "moe_up",
    "moe_up_routed_tiles",
    "moe_up_routed1",
    "moe_down",
    "moe_combine",
    "moe_combine16",
    "moe_down_small",
    "fp8_quantize",
    "fp8_dequant",
];

/// Kernels whose entry points are `<name>_<dtype>` for the 16-bit dtypes only (tensor-core
/// kernels: bf16 and f16; f32 targets use the CUDA-core kernels).
const PER_HALF_DTYPE: &[&str] = &[
    "attention_prefill_d64",
    "attention_prefill_d128",
    "attention_prefill_d256",
    "attention_prefill_wg_d256",
    "mamba2_chunk_n64",
    "mamba2_chunk_n128",
    "gemv_r1",
    "gemv_r2",
    "gemv_r3",
    "gemv_r4",
    "gemv_r5",
    "gemv_r6",
    "gemv_r7",
    "gemv_r8",
    "gemv_norm_r1",
    "gemv_norm_r2",
    "gemv_norm_r3",
    "gemv_norm_r4",
    "gemv_norm_r5",
    "gemv_norm_r6",
    "gemv_norm_r7",
    "gemv_norm_r8",
    "gemv_r1f4",
    "gemv_norm_r1f4",
    "gemv_r1f2",
    "gemv_norm_r1f2",
    "gemv8_r1",
    "gemv8_r2",
    "gemv8_r3",
    "gemv8_r4",
    "gemv8_r5",
    "gemv8_r6",
    "gemv8_r7",
    "gemv8_r8",
    "gemv8_norm_r1",
    "gemv8_norm_r2",
    "gemv8_norm_r3",
    "gemv8_norm_r4",
    "gemv8_norm_r5",
    "gemv8_norm_r6",
    "gemv8_norm_r7",
    "gemv8_norm_r8",
    "gemv8_r1f4",
    "gemv8_norm_r1f4",
    "gemv8_r1f2",
    "gemv8_norm_r1f2",
    "gemv8m_r1",
    "gemv8m_r2",
    "gemv8m_r3",
    "gemv8m_r4",
    "gemv8m_r5",
    "gemv8m_r6",
    "gemv8m_r7",
    "gemv8m_r8",
    "gemv8m_norm_r1",
    "gemv8m_norm_r2",
    "gemv8m_norm_r3",
    "gemv8m_norm_r4",
    "gemv8m_norm_r5",
    "gemv8m_norm_r6",
    "gemv8m_norm_r7",
    "gemv8m_norm_r8",
    "gemv16m_r1",
    "gemv16m_r2",
    "gemv16m_r3",
    "gemv16m_r4",
    "gemv16m_r5",
    "gemv16m_r6",
    "gemv16m_r7",
    "gemv16m_r8",
    "gemv16m_norm_r1",
    "gemv16m_norm_r2",
    "gemv16m_norm_r3",
    "gemv16m_norm_r4",
    "gemv16m_norm_r5",
    "gemv16m_norm_r6",
    "gemv16m_norm_r7",
    "gemv16m_norm_r8",
    "gemv16s_r1",
    "gemv16s_r2",
    "gemv16s_r3",
    "gemv16s_r4",
    "gemv16s_r5",
    "gemv16s_r6",
    "gemv16s_r7",
    "gemv16s_r8",
    "gemv16s_norm_r1",
    "gemv16s_norm_r2",
    "gemv16s_norm_r3",
    "gemv16s_norm_r4",
    "gemv16s_norm_r5",
    "gemv16s_norm_r6",
    "gemv16s_norm_r7",
    "gemv16s_norm_r8",
    "gemv16s_r1f4",
    "gemv16s_norm_r1f4",
    "gemv16s_r1f2",
    "gemv16s_norm_r1f2",
    "fp8_act_quant",
    "moe_up_mm",
    "moe_down_mm",
    "moe_up_wg",
    "moe_down_wg",
    "moe_up_w2",
    "moe_down_w2",
    "gdn_decode_r1_c1",
    "gdn_decode_r2_c1",
    "gdn_decode_r3_c1",
    "gdn_decode_r4_c1",
    "gdn_decode_r1_c2",
    "gdn_decode_r2_c2",
    "gdn_decode_r3_c2",
    "gdn_decode_r4_c2",
    "gdn_decode_r1_c4",
    "gdn_decode_r2_c4",
    "gdn_decode_r3_c4",
    "gdn_decode_r4_c4",
    "gdn_decode1_r1_c1",
    "gdn_decode1_r2_c1",
    "gdn_decode1_r3_c1",
    "gdn_decode1_r4_c1",
    "gdn_decode1_r1_c2",
    "gdn_decode1_r2_c2",
    "gdn_decode1_r3_c2",
    "gdn_decode1_r4_c2",
    "gdn_decode1_r1_c4",
    "gdn_decode1_r2_c4",
    "gdn_decode1_r3_c4",
    "gdn_decode1_r4_c4",
];

/// Kernels with a single entry point.
const PLAIN: &[&str] = &[
    "io_scatter",
    "state_copy",
    "sample_best",
    "sample_weigh",
    "sample_pick",
    "sample_argmax",
    "sample_penalize",
];

/// Base names of the kernels whose entry points do NOT start with `flashrt::pdl_enter()` (see
/// kernels/common.cuh): they are launched with plain stream ordering. Every other `PER_DTYPE`
/// / `PER_HALF_DTYPE` kernel waits for its predecessor first (`FLASHRT_ENTRY` kernels and
/// those whose entry macros call the wait) and may be launched with programmatic stream
/// serialisation; `PLAIN` kernels never are.
const NOT_PDL: &[&str] = &[
    "gated_deltanet_k64",
    "gated_deltanet_k128",
    "gated_deltanet_k256",
    "gated_deltanet_chunk_k64",
    "gated_deltanet_chunk_k128",
    "gated_deltanet_chunk_prep_k64",
    "gated_deltanet_chunk_prep_k128",
    "gated_deltanet_chunk_pre_k64",
    "gated_deltanet_chunk_pre_k128",
    "gated_deltanet_chunk_pre2_k64",
    "gated_deltanet_chunk_pre2_k128",
    "attention_prefill_d64",
    "attention_prefill_d128",
    "attention_prefill_d256",
    "attention_prefill_wg_d256",
    "init_random",
];

/// Suffix of the entry points instantiated for a dtype.
pub fn dtype_suffix(d: DType) -> Option<&'static str> {
    match d {
        DType::Bf16 => Some("bf16"),
        DType::F16 => Some("f16"),
        DType::F32 => Some("f32"),
        DType::I32 | DType::F8E4m3 => None,
    }
}

/// A kernel family's fatbin from `FLASHRT_KERNELS_DIR/<family>.fatbin`, when that variable
/// names a folder holding one: for kernel work, an A/B of a family built with other flags
/// (scripts/build-kernel-variant.sh: `nvcc -fatbin` of that family's `kernels/<family>*.cu`
/// with build.rs's arguments and the variant's flags) against
/// the same binary, without rebuilding it. Every entry point is still resolved at load, so a
/// fatbin missing one fails here. Logged, since it replaces what the binary was built with.
fn override_fatbin(
    dir: Option<&std::ffi::OsStr>,
    family: &str,
) -> Result<Option<(Vec<u8>, String)>> {
    let Some(dir) = dir else { return Ok(None) };
    let path = std::path::Path::new(dir).join(format!("{family}.fatbin"));
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = std::fs::read(&path).map_err(|e| Error::Backend {
        op: "load kernels".into(),
        msg: format!("FLASHRT_KERNELS_DIR: cannot read {}: {e}", path.display()),
    })?;
    tracing::warn!(family, path = %path.display(), "kernel family loaded from FLASHRT_KERNELS_DIR, not the embedded fatbin");
    Ok(Some((bytes, path.display().to_string())))
}

/// The loaded modules and every entry point, by full name (`rms_norm_bf16`).
pub struct Kernels {
    _modules: Vec<Arc<CudaModule>>,
    funcs: HashMap<String, CudaFunction>,
    /// Function handles (as addresses) of the PDL-ready entry points.
    pdl: std::collections::HashSet<usize>,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let dir = std::env::var_os("FLASHRT_KERNELS_DIR").filter(|d| !d.is_empty());
        let modules = FATBINS
            .iter()
            .map(|(family, fatbin)| {
                let (bytes, from) = match override_fatbin(dir.as_deref(), family)? {
                    Some((bytes, path)) => (bytes, path),
                    None => (fatbin.to_vec(), "the embedded".to_string()),
                };
                ctx.load_module(Ptx::from_binary(bytes))
                    .map_err(|e| Error::Backend {
                        op: "load kernels".into(),
                        msg: format!("cuModuleLoadData of {from} `{family}` fatbin failed: {e:?} (built for sm_90; set FLASHRT_CUDA_ARCHS for other GPUs)"),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut funcs = HashMap::new();
        let names = PER_DTYPE
            .iter()
            .flat_map(|k| ["bf16", "f16", "f32"].map(|s| format!("{k}_{s}")))
            .chain(
                PER_HALF_DTYPE
                    .iter()
                    .flat_map(|k| ["bf16", "f16"].map(|s| format!("{k}_{s}"))),
            )
            .chain(PLAIN.iter().map(|s| s.to_string()));
        for name in names {
            // Each entry point lives in exactly one family's module.
            let f = modules
                .iter()
                .find_map(|m| m.load_function(&name).ok())
                .ok_or_else(|| Error::Backend {
                    op: "load kernels".into(),
                    msg: format!("entry point `{name}` not found in the kernel fatbins"),
                })?;
            funcs.insert(name, f);
        }
        let pdl = funcs
            .iter()
            .filter(|(name, _)| {
                name.rsplit_once('_').is_some_and(|(base, _)| {
                    PER_DTYPE.iter().chain(PER_HALF_DTYPE).any(|b| *b == base)
                        && !NOT_PDL.contains(&base)
                })
            })
            .map(|(_, f)| f.cu_function() as usize)
            .collect();
        Ok(Self {
            _modules: modules,
            funcs,
            pdl,
        })
    }

    /// Whether `func` waits for its predecessor grid before touching memory, so it may be
    /// launched with programmatic stream serialisation.
    pub fn pdl_ready(&self, func: &CudaFunction) -> bool {
        self.pdl.contains(&(func.cu_function() as usize))
    }

    /// The entry point `name` (already suffixed).
    pub fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs.get(name).ok_or_else(|| Error::Backend {
            op: "kernel lookup".into(),
            msg: format!("no kernel `{name}`"),
        })
    }

    /// The entry point `<base>_<dtype>`.
    pub fn typed(&self, base: &str, dtype: DType) -> Result<&CudaFunction> {
        let suffix = dtype_suffix(dtype).ok_or_else(|| {
            Error::Unsupported(format!("kernel `{base}` has no {} variant", dtype.name()))
        })?;
        self.get(&format!("{base}_{suffix}"))
    }

    /// Size of the embedded fatbins in bytes.
    pub fn fatbin_bytes() -> usize {
        FATBINS.iter().map(|(_, f)| f.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn sources(dir: &Path, ext: &str, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, ext, out);
            } else if path.extension().is_some_and(|e| e == ext) {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path.display().to_string(), text));
            }
        }
    }

    /// The string literals that follow `marker` (`.get("` / `.typed("`) in `text`.
    fn literals<'a>(text: &'a str, marker: &str) -> Vec<&'a str> {
        text.match_indices(marker)
            .filter_map(|(i, _)| {
                let rest = &text[i + marker.len()..];
                let name = &rest[..rest.find('"')?];
                let ident = name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
                (!name.is_empty() && ident).then_some(name)
            })
            .collect()
    }

    /// Every kernel the CUDA backend asks for by a literal name is one that `Kernels::load`
    /// resolves (a kernel missing from these lists fails only on the GPU, at its first use),
    /// and every single-entry kernel is defined in kernels/*.cu. Checked without a GPU.
    #[test]
    fn every_kernel_asked_for_is_registered_and_defined() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut rust = Vec::new();
        sources(&root.join("src/backend/cuda"), "rs", &mut rust);
        let mut cuda = Vec::new();
        sources(&root.join("../kernels"), "cu", &mut cuda);
        assert!(!rust.is_empty() && !cuda.is_empty());
        let mut missing = Vec::new();
        for (path, text) in &rust {
            for name in literals(text, ".get(\"") {
                if !PLAIN.contains(&name) {
                    missing.push(format!("{path}: `{name}` (get) is not in PLAIN"));
                }
            }
            for name in literals(text, ".typed(\"") {
                if !PER_DTYPE.contains(&name) && !PER_HALF_DTYPE.contains(&name) {
                    missing.push(format!(
                        "{path}: `{name}` (typed) is not in PER_DTYPE / PER_HALF_DTYPE"
                    ));
                }
            }
        }
        for name in PLAIN {
            let defined = cuda
                .iter()
                .any(|(_, text)| text.contains(&format!(" {name}(")));
            if !defined {
                missing.push(format!(
                    "PLAIN kernel `{name}` is defined in no kernels/*.cu"
                ));
            }
        }
        // Per-dtype entry points are stamped out by macros that paste numbers into the name
        // (`attention_d##D`, `gdn_decode_r##R##_c##NB`): every part between the numbers.
        for name in PER_DTYPE.iter().chain(PER_HALF_DTYPE) {
            let parts: Vec<&str> = name
                .split(|c: char| c.is_ascii_digit())
                .filter(|p| !p.is_empty())
                .collect();
            if !cuda
                .iter()
                .any(|(_, text)| parts.iter().all(|p| text.contains(p)))
            {
                missing.push(format!("kernel `{name}` appears in no kernels/*.cu"));
            }
        }
        assert!(missing.is_empty(), "{}", missing.join("\n"));
    }
}
