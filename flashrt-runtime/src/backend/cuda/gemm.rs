//! `Linear` as a cuBLASLt matmul.
//!
//! The plan's row-major `out[r, j] = Σ_k x[r, k] · w[j, k]` is, in cuBLAS's column-major
//! terms, `D[N, rows] = op(A)[N, K] · B[K, rows]` with
//!
//! * `A` = the weight `[N, K]` row-major = column-major `[K, N]`, ld `K`, `op = T`;
//! * `B` = the input view = column-major `[K, rows]` with ld = the view's row stride (the
//!   column offset is already in the pointer);
//! * `C = D` = the output view, column-major `[N, rows]`, ld = its row stride; `beta = 1` for
//!   `accumulate` (the fused residual add), else 0.
//!
//! Inputs are the target dtype (bf16/f16/f32), the output is the target dtype or f32 (the
//! logits), compute and scale are f32 (`CUBLAS_COMPUTE_32F`: no TF32 shortcut, so an f32
//! target is an exact-arithmetic oracle mode). Everything that cuBLASLt decides — descriptors,
//! layouts and the algorithm from its heuristic — is decided here when a session builds its
//! programs, outside graph capture, with the real pointer alignments as preferences. The
//! workspace is the session's own (32 MiB, NVIDIA's recommendation for Hopper), so a captured
//! matmul never allocates (split-KV attention borrows the same buffer for its partial results
//! between two matmuls: one stream, so their uses never overlap). Split-K reductions are
//! restricted to non-in-place schemes so every matmul is bitwise reproducible. The row count is the plan's bucket: rows `>= io.len` are computed
//! too and ignored (GEMM rows are independent, so they cannot disturb valid rows).

use crate::error::{Error, Result};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use flashrt_ir::DType;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Workspace every session gives cuBLASLt.
pub const WORKSPACE_BYTES: usize = 32 << 20;

fn cuda_type(d: DType) -> Result<sys::cudaDataType> {
    Ok(match d {
        DType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DType::F8E4m3 => sys::cudaDataType_t::CUDA_R_8F_E4M3,
        DType::I32 => return Err(Error::Unsupported("linear: i32 matrices".into())),
    })
}

fn lt_err(what: &str, e: lt::CublasError) -> Error {
    Error::Backend {
        op: "linear (cuBLASLt)".into(),
        msg: format!("{what}: {e:?}"),
    }
}

/// Largest power of two (up to 256) dividing a device address: the alignment cuBLASLt may
/// assume for that operand.
pub fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    (1u64 << ptr.trailing_zeros().min(8)) as u32
}

/// Everything that determines a matmul's descriptors and algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub in_dtype: DType,
    pub out_dtype: DType,
    /// Output features (`w` rows).
    pub n: u64,
    /// Input features (`w` columns).
    pub k: u64,
    /// Rows of the chunk (the plan's bucket).
    pub rows: u64,
    pub ld_x: i64,
    pub ld_out: i64,
    pub align_w: u32,
    pub align_x: u32,
    pub align_out: u32,
    /// f32 inputs through the TF32 tensor cores (`CUBLAS_COMPUTE_32F_FAST_TF32`). Only for
    /// operands whose values TF32 holds exactly (bf16/f16 values widened to f32, as the MoE
    /// router's input): the products stay exact and only the f32 sum order differs.
    pub tf32: bool,
}

/// An FP8 W8A8 matmul (`E4M3 x E4M3`, f32 accumulation): the weight `[n, k]` with one f32
/// scale per 128 x 128 block (`BLK128x128_32F`, scales `[n / 128][k / 128]` row-major), the
/// chunk's activations `[rows, k]` (ld `k`) with one per row and 128 columns (`VEC128_32F`,
/// scales `[k / 128][rows]`), the output `[rows, n]` (ld `ld_out`) in `out_dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8GemmShape {
    pub out_dtype: DType,
    pub n: u64,
    pub k: u64,
    pub rows: u64,
    pub ld_out: i64,
    pub align_out: u32,
}

/// A ready-to-run matmul: descriptors plus the chosen algorithm. Immutable after creation, so
/// one is shared by every session and graph with the same shape.
pub struct LtGemm {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host objects that cuBLASLt only reads after creation;
// nothing mutates them until `Drop`, which runs once, when the last `Arc` goes.
unsafe impl Send for LtGemm {}
// SAFETY: as above: shared use is read-only.
unsafe impl Sync for LtGemm {}

impl Drop for LtGemm {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this value and is destroyed exactly once here;
        // errors on destruction cannot be acted on.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl LtGemm {
    /// A matmul descriptor with f32 scaling for `D[n, rows] = op(A)ᵀ B` in this module's
    /// convention (A the weight `[n, k]` row-major, transposed; B the input with ld `ld_x`; C =
    /// D the output with ld `ld_out`), element types `(a, b, out)`; the algorithm is left to
    /// the caller. Built step by step, so Drop frees whatever was created if a step fails.
    fn tn(
        compute: sys::cublasComputeType_t,
        (a_t, b_t, out_t): (sys::cudaDataType, sys::cudaDataType, sys::cudaDataType),
        (n, k, rows): (u64, u64, u64),
        (ld_x, ld_out): (i64, i64),
    ) -> Result<LtGemm> {
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
            .map_err(|e| lt_err("cublasLtMatmulDescCreate", e))?;
        let mut g = LtGemm {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            c: std::ptr::null_mut(),
            // SAFETY: cublasLtMatmulAlgo_t is a plain array of u64; all-zero is a valid value
            // that the caller overwrites with a heuristic's choice before any use.
            algo: unsafe { std::mem::zeroed() },
        };
        type A = sys::cublasLtMatmulDescAttributes_t;
        g.set(A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32, "TRANSA")?; // CUBLAS_OP_T
        g.set(A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32, "TRANSB")?; // CUBLAS_OP_N
        g.a = lt::create_matrix_layout(a_t, k, n, k as i64)
            .map_err(|e| lt_err("layout A (weight)", e))?;
        g.b = lt::create_matrix_layout(b_t, k, rows, ld_x)
            .map_err(|e| lt_err("layout B (input)", e))?;
        g.c = lt::create_matrix_layout(out_t, n, rows, ld_out)
            .map_err(|e| lt_err("layout C/D (output)", e))?;
        Ok(g)
    }

    /// Set one descriptor attribute to `v` (its C type: i32 for modes, a device pointer for
    /// scale pointers).
    fn set<T: Copy>(
        &self,
        attr: sys::cublasLtMatmulDescAttributes_t,
        v: &T,
        what: &str,
    ) -> Result<()> {
        // SAFETY: `desc` is live; `v` points at size_of::<T>() readable bytes, the attribute's
        // size, and outlives the call (cuBLASLt copies the value).
        unsafe {
            lt::set_matmul_desc_attribute(
                self.desc,
                attr,
                v as *const T as *const c_void,
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| lt_err(what, e))
    }
}

/// The model's cuBLASLt handle and a cache of matmuls by shape (FP8 matmuls also by their
/// scale pointers, which their descriptors hold, and their algorithms by shape).
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    cache: Mutex<HashMap<GemmShape, Arc<LtGemm>>>,
    fp8: Mutex<Fp8Cache>,
}

#[derive(Default)]
struct Fp8Cache {
    gemms: HashMap<(Fp8GemmShape, u64, u64), Arc<LtGemm>>,
    algos: HashMap<Fp8GemmShape, sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: a cuBLASLt handle carries no per-call mutable state (stream and workspace are
// arguments of every `cublasLtMatmul`), and cuBLASLt documents its API as thread-safe.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        self.cache.lock().map(|mut c| c.clear()).ok();
        self.fp8.lock().map(|mut c| c.gemms.clear()).ok();
        // SAFETY: the handle was created in `Blas::new` and is destroyed once, after every
        // cached matmul (which do not reference the handle) is gone.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

impl Blas {
    pub fn new() -> Result<Self> {
        let handle = lt::create_handle().map_err(|e| lt_err("cublasLtCreate", e))?;
        Ok(Self {
            handle,
            cache: Mutex::new(HashMap::new()),
            fp8: Mutex::new(Fp8Cache::default()),
        })
    }

    /// The matmul for `shape`, created (with a heuristic algorithm query) on first request.
    pub fn gemm(&self, shape: GemmShape) -> Result<Arc<LtGemm>> {
        let mut cache = self.cache.lock().map_err(|_| Error::Backend {
            op: "linear (cuBLASLt)".into(),
            msg: "matmul cache poisoned".into(),
        })?;
        if let Some(g) = cache.get(&shape) {
            return Ok(g.clone());
        }
        let g = Arc::new(self.create(shape)?);
        cache.insert(shape, g.clone());
        Ok(g)
    }

    fn create(&self, s: GemmShape) -> Result<LtGemm> {
        let in_t = cuda_type(s.in_dtype)?;
        let out_t = cuda_type(s.out_dtype)?;
        let compute = if s.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let mut g = LtGemm::tn(
            compute,
            (in_t, in_t, out_t),
            (s.n, s.k, s.rows),
            (s.ld_x, s.ld_out),
        )?;

        g.algo = self.heuristic(&g, [s.align_w, s.align_x, s.align_out], || {
            format!(
                "no algorithm for {}x{} -> {} rows ({} in, {} out, ld {}/{})",
                s.k,
                s.n,
                s.rows,
                s.in_dtype.name(),
                s.out_dtype.name(),
                s.ld_x,
                s.ld_out
            )
        })?;
        Ok(g)
    }

    /// The FP8 matmul for `shape` whose weight scales are at `w_scale` and activation scales
    /// at `x_scale` (device addresses; see [`Fp8GemmShape`]), created on first request.
    pub fn gemm_fp8(&self, shape: Fp8GemmShape, w_scale: u64, x_scale: u64) -> Result<Arc<LtGemm>> {
        let mut cache = self.fp8.lock().map_err(|_| Error::Backend {
            op: "linear (cuBLASLt)".into(),
            msg: "matmul cache poisoned".into(),
        })?;
        if let Some(g) = cache.gemms.get(&(shape, w_scale, x_scale)) {
            return Ok(g.clone());
        }
        let s = shape;
        let out_t = cuda_type(s.out_dtype)?;
        let fp8 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        let mut g = LtGemm::tn(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            (fp8, fp8, out_t),
            (s.n, s.k, s.rows),
            (s.k as i64, s.ld_out),
        )?;
        type A = sys::cublasLtMatmulDescAttributes_t;
        let a_mode = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        let b_mode = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        g.set(
            A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
            &(a_mode as i32),
            "A scale mode",
        )?;
        g.set(
            A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
            &(b_mode as i32),
            "B scale mode",
        )?;
        g.set(
            A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
            &w_scale,
            "A scale pointer",
        )?;
        g.set(
            A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            &x_scale,
            "B scale pointer",
        )?;
        g.algo = match cache.algos.get(&s) {
            Some(a) => *a,
            None => {
                let a = self.heuristic(&g, [16, 16, s.align_out], || {
                    format!(
                        "no FP8 block-scaled algorithm for {}x{} -> {} rows ({} out, ld {})",
                        s.k,
                        s.n,
                        s.rows,
                        s.out_dtype.name(),
                        s.ld_out
                    )
                })?;
                cache.algos.insert(s, a);
                a
            }
        };
        let g = Arc::new(g);
        cache.gemms.insert((s, w_scale, x_scale), g.clone());
        Ok(g)
    }

    /// cuBLASLt's first heuristic algorithm for `g` under the workspace, reduction and
    /// alignment (`[a, b, c/d]` bytes) preferences every matmul here uses.
    fn heuristic(
        &self,
        g: &LtGemm,
        aligns: [u32; 3],
        what: impl Fn() -> String,
    ) -> Result<sys::cublasLtMatmulAlgo_t> {
        let pref =
            lt::create_matmul_pref().map_err(|e| lt_err("cublasLtMatmulPreferenceCreate", e))?;
        let ws: u64 = WORKSPACE_BYTES as u64;
        let set_pref =
            |attr: sys::cublasLtMatmulPreferenceAttributes_t, v: *const c_void, n: usize| {
                // SAFETY: `pref` is live until destroyed below; `v` points at `n` readable bytes.
                unsafe { lt::set_matmul_pref_attribute(pref, attr, v, n) }
            };
        type P = sys::cublasLtMatmulPreferenceAttributes_t;
        let heuristic = (|| {
            set_pref(
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                8,
            )?;
            // Split-K only with a separate reduction (NONE | COMPUTE_TYPE | OUTPUT_TYPE), never
            // in place in the output, so results are bitwise reproducible run to run.
            let reductions: u32 = 0b110;
            set_pref(
                P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                &reductions as *const u32 as *const c_void,
                4,
            )?;
            let aligns = [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aligns[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, aligns[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, aligns[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, aligns[2]),
            ];
            for (attr, v) in aligns {
                set_pref(attr, &v as *const u32 as *const c_void, 4)?;
            }
            // SAFETY: all descriptors are live; C and D share one layout (in-place update).
            unsafe { lt::get_matmul_algo_heuristic(self.handle, g.desc, g.a, g.b, g.c, g.c, pref) }
        })();
        // SAFETY: `pref` was created above and is not used after this point.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let heuristic = heuristic.map_err(|e| lt_err(&what(), e))?;
        if heuristic.workspaceSize > WORKSPACE_BYTES {
            return Err(Error::Backend {
                op: "linear (cuBLASLt)".into(),
                msg: format!(
                    "algorithm wants {} workspace bytes > {WORKSPACE_BYTES}",
                    heuristic.workspaceSize
                ),
            });
        }
        Ok(heuristic.algo)
    }

    /// Enqueue `out = x · wᵀ (+ out if accumulate)` on `stream`.
    ///
    /// # Safety
    /// The pointers must address live device memory of the sizes `g` was created for, the
    /// workspace must be [`WORKSPACE_BYTES`] long and not in use by another stream, and the
    /// current thread must have the context bound.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        g: &LtGemm,
        w: u64,
        x: u64,
        out: u64,
        accumulate: bool,
        workspace: u64,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let alpha: f32 = 1.0;
        let beta: f32 = if accumulate { 1.0 } else { 0.0 };
        // SAFETY: forwarded to the caller (see above); alpha/beta are host scalars read during
        // the call (host pointer mode), also when the call is being captured into a graph.
        unsafe {
            lt::matmul(
                self.handle,
                g.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                g.a,
                x as *const c_void,
                g.b,
                out as *const c_void,
                g.c,
                out as *mut c_void,
                g.c,
                &g.algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("cublasLtMatmul", e))
    }
}
