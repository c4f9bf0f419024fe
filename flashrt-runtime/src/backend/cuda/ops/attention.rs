//! Attention's launch helpers: the KV write, the split kernel's and the decode kernel's
//! parameters (attention.cu, attention_decode.cu), the mma.sync and TMA / warpgroup-MMA prefill
//! kernels (attention_prefill.cu, attention_prefill_wgmma.cu).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct KvWriteParams {
    pub(super) k: u64,
    pub(super) v: u64,
    pub(super) cache_k: u64,
    pub(super) cache_v: u64,
    pub(super) pos: u64,
    pub(super) len: u64,
    pub(super) ld_k: i32,
    pub(super) ld_v: i32,
    pub(super) width: i32,
    pub(super) max_seq: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttentionParams {
    pub(super) q: u64,
    pub(super) cache_k: u64,
    pub(super) cache_v: u64,
    pub(super) out: u64,
    pub(super) pos: u64,
    pub(super) len: u64,
    pub(super) ld_q: i32,
    pub(super) ld_out: i32,
    pub(super) q_heads: i32,
    pub(super) kv_heads: i32,
    pub(super) head_dim: i32,
    pub(super) max_seq: i32,
    pub(super) splits: i32,
    pub(super) scale: f32,
    pub(super) partial: u64,
}

/// Prefill attention tiles (attention_prefill.cu and attention_prefill_wgmma.cu): query rows
/// per block and keys per tile.
pub(super) const PREFILL_ROWS: usize = 128;
pub(super) const PREFILL_KEYS: usize = 64;
/// attention_prefill_wgmma.cu `FA_WG_SMEM`: Q and 2 stages of K and V as swizzled slabs, 1 KiB
/// of alignment slack, 5 mbarriers.
pub(super) const FA_WG_SMEM: u32 = ((PREFILL_ROWS + 4 * PREFILL_KEYS) * 256 * 2 + 1024 + 64) as u32;

/// A `CUtensorMap` as kernels receive it (mirrors `FaTmaMap` in attention_prefill_wgmma.cu).
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub(super) struct TmaMap(pub(super) [u64; 16]);

/// attention_prefill_wgmma.cu `AttentionTmaParams`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttentionTmaParams {
    pub(super) q: TmaMap,
    pub(super) k: TmaMap,
    pub(super) v: TmaMap,
    pub(super) a: AttentionParams,
}

/// A 3-D tiled tensor map of a 16-bit tensor at `base`: `dims` innermost first, byte strides
/// of dims 1 and 2, boxes of {64, 1, box_rows} elements with 128-byte swizzling (one box = one
/// wgmma slab), zeros outside the tensor.
pub(super) fn tma_map_3d(
    t: DType,
    base: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    box_rows: u32,
) -> Result<TmaMap> {
    use sys::{
        CUtensorMapDataType as Ty, CUtensorMapFloatOOBfill as Oob, CUtensorMapInterleave as Il,
        CUtensorMapL2promotion as L2, CUtensorMapSwizzle as Sw,
    };
    let ty = match t {
        DType::Bf16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        _ => return Err(Error::Unsupported(format!("tensor map of {}", t.name()))),
    };
    let boxes = [64u32, 1, box_rows];
    let elem_strides = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer addresses a live local array of the length the call reads (rank 3:
    // 3 dims, 2 strides, 3 box dims, 3 element strides); `map` is written by the call and read
    // only when it succeeds. Encoding touches no device memory.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            ty,
            3,
            base as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            Il::CU_TENSOR_MAP_INTERLEAVE_NONE,
            Sw::CU_TENSOR_MAP_SWIZZLE_128B,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            Oob::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Backend {
            op: "attention prefill".into(),
            msg: format!("cuTensorMapEncodeTiled failed: {r:?}"),
        });
    }
    // SAFETY: the call succeeded, so the map is initialised; CUtensorMap is 16 u64 words.
    let words: [u64; 16] = unsafe { std::mem::transmute(map.assume_init()) };
    Ok(TmaMap(words))
}

/// `attention_decode.cu`: the split kernel's parameters plus the per-program query tiling.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttentionDecodeParams {
    pub(super) attn: AttentionParams,
    /// Row capacity of the partial layout (bucket rows; 5 for shared phases).
    pub(super) rows: i32,
    /// 8-query column tiles per block, ceil(group * rows / 8) <= 8.
    pub(super) qtiles: i32,
}

impl Builder<'_> {
    /// The mma.sync prefill attention of attention_prefill.cu at head-dim bound `d`, or `None`
    /// where the device cannot give a block its shared memory.
    pub(super) fn attention_prefill_mma(
        &self,
        label: &str,
        p: &AttentionParams,
        t: DType,
        d: usize,
        rows: usize,
    ) -> Result<Option<Cmd>> {
        let smem = (PREFILL_ROWS + 4 * PREFILL_KEYS) * d * 2;
        Ok(self
            .kernel_smem(
                &format!("{label} prefill d{d}"),
                self.kernels.typed(&format!("attention_prefill_d{d}"), t)?,
                (p.q_heads as u32, ceil_div(rows, PREFILL_ROWS), 1),
                256,
                smem as u32,
                p,
            )
            .ok())
    }

    /// attention_prefill_wgmma.cu's parameters: 3-D tiled tensor maps {head_dim, heads, rows}
    /// of the query view (`rows` = the bucket) and of the K and V caches (`max_seq` rows), boxes
    /// of 64 columns x one tile of rows, 128-byte swizzled; coordinates past head_dim or the
    /// last row read as zeros.
    pub(super) fn attention_tma_params(
        &self,
        p: &AttentionParams,
        t: DType,
        rows: usize,
    ) -> Result<AttentionTmaParams> {
        let hd = p.head_dim as u64;
        let map = |base: u64, heads: i32, rows: u64, ld: u64, box_rows: u32| {
            tma_map_3d(
                t,
                base,
                [hd, heads as u64, rows],
                [hd * 2, ld * 2],
                box_rows,
            )
        };
        let kv_ld = (p.kv_heads as u64) * hd;
        Ok(AttentionTmaParams {
            q: map(
                p.q,
                p.q_heads,
                rows as u64,
                p.ld_q as u64,
                PREFILL_ROWS as u32,
            )?,
            k: map(
                p.cache_k,
                p.kv_heads,
                p.max_seq as u64,
                kv_ld,
                PREFILL_KEYS as u32,
            )?,
            v: map(
                p.cache_v,
                p.kv_heads,
                p.max_seq as u64,
                kv_ld,
                PREFILL_KEYS as u32,
            )?,
            a: *p,
        })
    }

    /// Attention of a small phase on `attention_decode.cu` (decode, MTP draft, verify and
    /// prefill buckets of at most 8 rows), after `kv_write`; `None` where it does not apply
    /// (head_dim > 256 or not a multiple of 16 bytes, caches not 16-byte aligned, more than 64
    /// query vectors per KV head, or no room for the kernel's ring of shared memory per block),
    /// and the caller launches the split kernel of attention.cu instead.
    ///
    /// grid (kv_heads, S) x 320 threads (8 consumer warps, 2 TMA producer warps), a 6-stage
    /// ring of K/V tiles in dynamic shared memory (198 KiB at head_dim 256 in bf16): each block
    /// serves every query head of its GQA group and every row, so each K/V byte is read once
    /// per step; then `attention_decode_combine` (grid (q_heads, rows, ceil(head_dim / 64)) x
    /// 128 threads) merges the S partial states, which live in the cuBLASLt workspace.
    /// S = min(sms / kv_heads, 128, ceil(max_seq / 16), workspace bound): about one block per
    /// SM at every context (the pieces, multiples of 16 keys, are cut on the device from the
    /// live length, so splits past the context are empty and cost one (m, l) write).
    ///
    /// With `shared = Some(s)` (models with verify plans) every phase of at most s rows uses
    /// the same S, the same query tiling (sized for s rows) and the same partial layout, and
    /// the kernel computes a row from its own query and context length only: a verify row
    /// is bit-identical to the decode step at its position.
    pub(super) fn attention_decode(
        &self,
        label: &str,
        p: &AttentionParams,
        rows: usize,
        shared: Option<usize>,
    ) -> Result<Option<Vec<Cmd>>> {
        const MAX_ROWS: usize = 8; // attention_decode.cu MAX_ROWS
        const MAX_QUERIES: usize = 64; // 8 warps x 8 query columns
        const MAX_SPLITS: usize = 128; // attention_decode.cu MAX_SPLITS
        const THREADS: u32 = 10 * 32; // attention_decode.cu THREADS
        const STAGES: usize = 6; // attention_decode.cu STAGES
        const COMBINE_THREADS: u32 = 128; // attention_decode.cu COMBINE_THREADS
        const COMBINE_DIMS: usize = 64; // attention_decode.cu 4 * COMBINE_COLS
        let t = self.target();
        let shape_rows = shared.unwrap_or(rows);
        let (q_heads, kv_heads, head_dim) =
            (p.q_heads as usize, p.kv_heads as usize, p.head_dim as usize);
        let group = q_heads / kv_heads;
        let d = match head_dim {
            1..=64 => 64,
            65..=128 => 128,
            129..=256 => 256,
            _ => return Ok(None),
        };
        if shape_rows > MAX_ROWS
            || rows > shape_rows
            || group * shape_rows > MAX_QUERIES
            || !matches!(t, DType::Bf16 | DType::F16 | DType::F32)
            || !(head_dim * t.size()).is_multiple_of(16)
            || !p.cache_k.is_multiple_of(16)
            || !p.cache_v.is_multiple_of(16)
        {
            return Ok(None);
        }
        let slot_bytes = shape_rows * q_heads * (head_dim + 2) * 4;
        let splits = (self.sms / kv_heads)
            .clamp(1, MAX_SPLITS)
            .min((p.max_seq as usize).div_ceil(16))
            .min((gemm::WORKSPACE_BYTES - 16) / slot_bytes);
        if splits == 0 {
            return Ok(None);
        }
        let dp = AttentionDecodeParams {
            attn: AttentionParams {
                splits: splits as i32,
                ..*p
            },
            rows: shape_rows as i32,
            qtiles: (group * shape_rows).div_ceil(8) as i32,
        };
        // attention_decode.cu `Shape::SMEM`: STAGES tiles of tk keys of K and of V, rows padded
        // by 16 bytes, tk = max(16, 32 KiB / (2 d size)); then 2 STAGES mbarriers.
        let es = t.size();
        let tk = (32768 / (2 * d * es)).max(16);
        let smem = (STAGES * 2 * tk * (d * es + 16) + 2 * STAGES * 8) as u32;
        let Ok(main) = self.kernel_smem(
            &format!("{label} decode ({splits} splits)"),
            self.kernels.typed(&format!("attention_decode_d{d}"), t)?,
            (kv_heads as u32, splits as u32, 1),
            THREADS,
            smem,
            &dp,
        ) else {
            return Ok(None);
        };
        let mut cmds = vec![main];
        if splits > 1 {
            cmds.push(self.kernel(
                &format!("{label} decode combine ({splits} splits)"),
                self.kernels.typed("attention_decode_combine", t)?,
                (
                    q_heads as u32,
                    rows as u32,
                    head_dim.div_ceil(COMBINE_DIMS) as u32,
                ),
                COMBINE_THREADS,
                &dp,
            ));
        }
        Ok(Some(cmds))
    }
}
