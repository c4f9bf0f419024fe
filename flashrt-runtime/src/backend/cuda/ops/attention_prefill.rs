//! Prefill attention's launches: the warpgroup-MMA kernel fed by TMA
//! (kernels/attention_prefill_wgmma.cu: its tensor maps, the packing of a short chunk's query
//! heads, the key splits of a small grid) and the mma.sync kernel (kernels/attention_prefill.cu).
//! attention.rs dispatches an attention op here, to the small-phase kernel or to the split one.

use super::attention::AttentionParams;
use super::*;

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
    /// Query heads a block row group packs (1: one head per block; see [`Packing`]).
    pub(super) pack: i32,
    /// Chunk rows per block.
    pub(super) prows: i32,
}

/// How the warpgroup-MMA prefill kernel lays query rows on its blocks' 128 tile rows: one query
/// head's 128 chunk rows (`pack` = 1, `prows` = 128), or for a chunk of fewer than 128 rows
/// the `pack` query heads of one KV head for `prows` chunk rows each (attention_prefill_wgmma.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Packing {
    pub(super) pack: usize,
    pub(super) prows: usize,
}

impl Packing {
    /// Packed where a chunk of `rows` would fill less than a block (`rows < 128`) and a KV head
    /// serves several query heads: `prows` balanced over the fewest blocks of at most 128 tile
    /// rows (a 32- or 64-row chunk with 6 query heads a KV head: 16 rows, 96 tile rows a block).
    pub(super) fn for_chunk(rows: usize, q_heads: usize, kv_heads: usize, on: bool) -> Packing {
        let group = q_heads / kv_heads.max(1);
        let most = PREFILL_ROWS / group.max(1);
        if !on || group < 2 || rows == 0 || rows >= PREFILL_ROWS || most == 0 {
            return Packing {
                pack: 1,
                prows: PREFILL_ROWS,
            };
        }
        let blocks = rows.div_ceil(most);
        Packing {
            pack: group,
            prows: rows.div_ceil(blocks),
        }
    }

    /// Blocks a KV head (packed) or query head needs for `rows` chunk rows.
    pub(super) fn row_blocks(&self, rows: usize) -> usize {
        rows.div_ceil(self.prows)
    }
}

/// A 3-D tiled tensor map of a 16-bit tensor at `base`: `dims` innermost first, byte strides
/// of dims 1 and 2, boxes of {64, box_heads, box_rows} elements with 128-byte swizzling (one
/// box = one wgmma slab), zeros outside the tensor.
pub(super) fn tma_map_3d(
    t: DType,
    base: u64,
    dims: [u64; 3],
    strides: [u64; 2],
    (box_heads, box_rows): (u32, u32),
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
    let boxes = [64u32, box_heads, box_rows];
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

impl Builder<'_> {
    /// A prefill chunk's attention on the tensor-core kernels (`None`: the caller takes the
    /// small-phase or split kernel): buckets of >= 32 rows on 16-bit targets, head dims up to
    /// 256, 16-byte aligned views and caches.
    pub(super) fn attention_prefill(
        &self,
        label: &str,
        p: &AttentionParams,
        t: DType,
        rows: usize,
        shared: Option<usize>,
    ) -> Result<Option<Vec<Cmd>>> {
        let (q_heads, kv_heads) = (p.q_heads as usize, p.kv_heads as usize);
        let head_dim = p.head_dim as usize;
        let r = rows as u32;
        // Prefill buckets of >= 32 rows on 16-bit targets: the tensor-core kernel of
        // attention_prefill.cu (tiles of 128 query rows x 64 keys, head_dim a multiple
        // of 8 up to 256, 16-byte aligned rows for cp.async), which reads the context once per
        // tile; the split kernel re-reads it per row (a 32-row chunk after 16k tokens of
        // context took 154 ms with it on the H200 against 26 ms for a 64-row one). Decode and verify plans
        // never take it (small phases go to `attention_decode`, the rest to the split
        // kernel of attention.cu). A device that cannot give a block
        // the kernel's shared memory (192 KiB at head_dim 256) keeps the old kernel too.
        let prefill_d = match head_dim {
            8..=64 => Some(64),
            65..=128 => Some(128),
            129..=256 => Some(256),
            _ => None,
        }
        .filter(|_| {
            shared.is_none()
                && rows >= 32
                && matches!(t, DType::Bf16 | DType::F16)
                && head_dim.is_multiple_of(8)
                && p.ld_q % 8 == 0
                && p.ld_out % 8 == 0
                && [p.q, p.out, p.cache_k, p.cache_v]
                    .iter()
                    .all(|a| a % 16 == 0)
        });
        // A small grid of the wgmma kernel (few heads x row tiles: a short chunk) splits its
        // keys (see `prefill_splits`); the splits' states merge in `attention_combine`. A
        // chunk of fewer than 128 rows packs a KV head's query heads into each block
        // (`Packing`), whose few blocks then split further (`packed_splits`).
        let packing = Packing::for_chunk(rows, q_heads, kv_heads, self.attn_pack);
        let (grid_x, packed) = if packing.pack > 1 {
            (kv_heads, true)
        } else {
            (q_heads, false)
        };
        let blocks = grid_x * packing.row_blocks(rows);
        let per_split = rows * q_heads * (head_dim + 2) * 4;
        let mut pw = *p;
        pw.splits = match (self.attn_split, packed) {
            (false, _) => 1,
            (true, false) => prefill_splits(blocks, self.sms, per_split) as i32,
            (true, true) => packed_splits(blocks, self.sms, per_split) as i32,
        };
        Ok(match prefill_d {
            // attention_prefill_wgmma.cu (sm_90a): TMA-fed, so it takes tensor maps
            // of Q, K and V; if the driver cannot encode them, the mma.sync kernel.
            Some(256) if self.wgmma => self
                .attention_tma_params(&pw, t, rows, packing)
                .and_then(|tp| {
                    let splits = pw.splits as u32;
                    let mut v = vec![self.kernel_smem(
                        &format!("{label} prefill wgmma d256"),
                        self.kernels.typed("attention_prefill_wg_d256", t)?,
                        (grid_x as u32, packing.row_blocks(rows) as u32, splits),
                        256,
                        FA_WG_SMEM,
                        &tp,
                    )?];
                    v.extend(self.attention_combine(&format!("{label} prefill"), &pw, t, r)?);
                    Ok(v)
                })
                .ok()
                .map_or_else(
                    || {
                        self.attention_prefill_mma(label, p, t, 256, rows)
                            .map(|c| c.map(|c| vec![c]))
                    },
                    |v| Ok(Some(v)),
                )?,
            Some(d) => self
                .attention_prefill_mma(label, p, t, d, rows)?
                .map(|c| vec![c]),
            None => None,
        })
    }

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
        packing: Packing,
    ) -> Result<AttentionTmaParams> {
        let hd = p.head_dim as u64;
        let map = |base: u64, heads: i32, rows: u64, ld: u64, boxes: (usize, usize)| {
            tma_map_3d(
                t,
                base,
                [hd, heads as u64, rows],
                [hd * 2, ld * 2],
                (boxes.0 as u32, boxes.1 as u32),
            )
        };
        let kv_ld = (p.kv_heads as u64) * hd;
        Ok(AttentionTmaParams {
            q: map(
                p.q,
                p.q_heads,
                rows as u64,
                p.ld_q as u64,
                (packing.pack, packing.prows),
            )?,
            k: map(
                p.cache_k,
                p.kv_heads,
                p.max_seq as u64,
                kv_ld,
                (1, PREFILL_KEYS),
            )?,
            v: map(
                p.cache_v,
                p.kv_heads,
                p.max_seq as u64,
                kv_ld,
                (1, PREFILL_KEYS),
            )?,
            a: *p,
            pack: packing.pack as i32,
            prows: packing.prows as i32,
        })
    }
}

/// Key splits of the warpgroup-MMA prefill attention for a grid of `blocks` (query heads x
/// row tiles) on `sms` multiprocessors (one block each: 192 KiB of shared memory), within the
/// workspace that holds their partial states (`per_split` bytes each), at most 16. Blocks of
/// one launch walk equally many keys, so the time goes as waves / splits; each split adds a
/// little (its partial states, the combine's reads, Q loaded again), counted as 2 % of a
/// whole walk. A grid that fills the device by itself keeps one. A 32- or 64-row chunk of
/// the 27B shape (24 blocks) gets 5 splits, 256 rows (48) 5, 512 rows (96) one (two splits'
/// partials fit the workspace, and would make two waves of half walks).
fn prefill_splits(blocks: usize, sms: usize, per_split: usize) -> usize {
    let (blocks, sms) = (blocks.max(1), sms.max(1));
    if blocks >= sms {
        return 1;
    }
    let most = 16.min(gemm::WORKSPACE_BYTES / per_split.max(1)).max(1);
    let cost = |s: usize| (blocks * s).div_ceil(sms) as f64 / s as f64 + 0.02 * s as f64;
    (1..=most)
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1)
}

/// Key splits of the packed prefill attention ([`Packing`]: a KV head's query heads in each
/// block, so a short chunk has only kv_heads x row blocks, 8 for a 32-row chunk of the 27B
/// shape): time as waves x (1 / s + 0.02), each block's fixed work (Q, its partial states, the
/// combine's reads) counted as 2 % of a whole walk, so that a grid far below the device fills
/// it (that chunk: 16 splits, one wave of 128 blocks walking 1/16 of the keys each, where
/// [`prefill_splits`] would stop at 7), within the workspace and at most 16.
fn packed_splits(blocks: usize, sms: usize, per_split: usize) -> usize {
    let (blocks, sms) = (blocks.max(1), sms.max(1));
    let most = 16.min(gemm::WORKSPACE_BYTES / per_split.max(1)).max(1);
    let cost = |s: usize| (blocks * s).div_ceil(sms) as f64 * (1.0 / s as f64 + 0.02);
    (1..=most)
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::{Packing, packed_splits, prefill_splits};

    #[test]
    fn short_chunks_pack_a_kv_heads_query_heads_into_each_block() {
        // The 27B shape: 24 query heads, 4 KV heads (6 a group: at most 21 rows a block).
        let p = |rows| Packing::for_chunk(rows, 24, 4, true);
        assert_eq!(p(32), Packing { pack: 6, prows: 16 });
        assert_eq!(p(64), Packing { pack: 6, prows: 16 });
        assert_eq!(p(20), Packing { pack: 6, prows: 20 });
        assert_eq!(p(64).row_blocks(64), 4);
        // The 35B-A3B shape: 16 query heads, 2 KV heads (8 a group: 16 rows fill a block).
        assert_eq!(
            Packing::for_chunk(32, 16, 2, true),
            Packing { pack: 8, prows: 16 }
        );
        // A chunk that fills blocks by itself, no grouping, or packing off: one head a block.
        let one = Packing {
            pack: 1,
            prows: 128,
        };
        assert_eq!(p(128), one);
        assert_eq!(p(4096), one);
        assert_eq!(Packing::for_chunk(32, 8, 8, true), one);
        assert_eq!(Packing::for_chunk(32, 24, 4, false), one);
        // Every packed block holds at most 128 tile rows and covers the chunk.
        for rows in 1..128 {
            for (q, kv) in [(24, 4), (16, 2), (32, 2), (64, 1), (40, 8)] {
                let k = Packing::for_chunk(rows, q, kv, true);
                assert!(
                    k.pack * k.prows <= 128,
                    "{rows} rows, {q}/{kv} heads: {k:?}"
                );
                assert!(k.row_blocks(rows) * k.prows >= rows);
                assert!((k.row_blocks(rows) - 1) * k.prows < rows);
            }
        }
    }

    #[test]
    fn packed_splits_fill_the_device() {
        let per = |rows: usize| rows * 24 * (256 + 2) * 4;
        // 32 / 64 rows of the 27B shape packed: 8 / 16 blocks.
        assert_eq!(packed_splits(8, 132, per(32)), 16);
        assert_eq!(packed_splits(16, 132, per(64)), 8);
        // A grid that fills the device keeps one split; the workspace bounds them.
        assert_eq!(packed_splits(132, 132, per(64)), 1);
        assert_eq!(packed_splits(8, 132, gemm_workspace() / 3), 3);
    }

    fn gemm_workspace() -> usize {
        super::gemm::WORKSPACE_BYTES
    }

    #[test]
    fn prefill_splits_fill_the_device_and_stay_in_the_workspace() {
        let per = |rows: usize| rows * 24 * (256 + 2) * 4;
        // The 27B shape (24 query heads) on 132 multiprocessors.
        assert_eq!(prefill_splits(24, 132, per(64)), 5);
        assert_eq!(prefill_splits(48, 132, per(256)), 5);
        // 512 rows: the workspace holds 2 splits' partials, which would make 2 waves of half
        // walks: no gain.
        assert_eq!(prefill_splits(96, 132, per(512)), 1);
        assert_eq!(prefill_splits(384, 132, per(2048)), 1);
        // 1024 rows: one split's partials take 25 MiB of the 32 MiB workspace.
        assert_eq!(prefill_splits(192, 132, per(1024)), 1);
        // One block: past ~7 splits each costs more than it saves; a huge grid gets one.
        assert_eq!(prefill_splits(1, 132, 1024), 7);
        assert_eq!(prefill_splits(10_000, 132, 1024), 1);
    }
}
