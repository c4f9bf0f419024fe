//! The attention op's launches: the KV write, then a prefill chunk's tensor-core kernels
//! (attention_prefill.rs), the small phases' kernel (attention_decode.cu) or the split kernel
//! (attention.cu), and the merge of split partial states.

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
    pub(super) rows_pos: u64,
    pub(super) slots: u64,
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

/// `attention_decode.cu`: the split kernel's parameters plus the per-program query tiling.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct AttentionDecodeParams {
    pub(super) attn: AttentionParams,
    /// Row capacity of the partial layout (bucket rows; 5 for shared phases).
    pub(super) rows: i32,
    /// 8-query column tiles per block, ceil(group * rows / 8) <= 8.
    pub(super) qtiles: i32,
    /// A batched step's tables (kernels/common.cuh), else 0.
    pub(super) rows_pos: u64,
    pub(super) slots: u64,
    /// The fused output gate ([`OutGate`]), else 0.
    pub(super) gate: u64,
    pub(super) ld_gate: i32,
    pub(super) gate_act: i32,
    /// The next matmul's first weights, asked of the L2 by the main kernel
    /// ([`Builder::next_weights`]).
    pub(super) pf: u64,
    pub(super) pf_bytes: u64,
}

/// The plan's `Mul` right after an attention op (`out = act(gate) * out`: Qwen3.5's output
/// gate), fused into the small-phase attention's output stores (attention_decode.cu
/// `dec_store4`, same bits) where `CudaOptions::attn_gate` is on.
#[derive(Clone, Copy)]
pub(super) struct OutGate {
    pub(super) addr: u64,
    pub(super) ld: i32,
    pub(super) act: i32,
}

impl Builder<'_> {
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
    ///
    /// A batched step ([`Builder::batch`]) takes a one-row step's S and query tiling (so each
    /// row is bit-identical to its session's decode step) with one block row per session (grid
    /// z = rows, each block on its own session's caches and position) and a partial layout of
    /// `rows` rows; `None` where those partials do not fit the workspace.
    pub(super) fn attention_decode(
        &self,
        label: &str,
        p: &AttentionParams,
        rows: usize,
        shared: Option<usize>,
        gate: Option<OutGate>,
    ) -> Result<Option<Vec<Cmd>>> {
        const MAX_ROWS: usize = 8; // attention_decode.cu MAX_ROWS
        const MAX_QUERIES: usize = 64; // 8 warps x 8 query columns
        const MAX_SPLITS: usize = 128; // attention_decode.cu MAX_SPLITS
        const THREADS: u32 = 10 * 32; // attention_decode.cu THREADS
        const STAGES: usize = 6; // attention_decode.cu STAGES
        const COMBINE_THREADS: u32 = 128; // attention_decode.cu COMBINE_THREADS
        const COMBINE_DIMS: usize = 64; // attention_decode.cu 4 * COMBINE_COLS
        let t = self.target();
        let batched = self.batch.is_some();
        // The rows a block serves and the layout sizes are a one-row step's in a batched step.
        let shape_rows = shared.unwrap_or(if batched { 1 } else { rows });
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
            || rows > MAX_ROWS
            || (rows > shape_rows && !batched)
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
        let layout_rows = if batched {
            rows.max(shape_rows)
        } else {
            shape_rows
        };
        if splits == 0
            || layout_rows * q_heads * splits * (head_dim + 2) * 4 + 16 > gemm::WORKSPACE_BYTES
        {
            return Ok(None);
        }
        let dp = AttentionDecodeParams {
            attn: AttentionParams {
                splits: splits as i32,
                ..*p
            },
            rows: layout_rows as i32,
            qtiles: (group * shape_rows).div_ceil(8) as i32,
            rows_pos: self.rows_pos(),
            slots: self.slots(),
            gate: gate.map_or(0, |g| g.addr),
            ld_gate: gate.map_or(0, |g| g.ld),
            gate_act: gate.map_or(0, |g| g.act),
            pf: self.next_weights.get().0,
            pf_bytes: self.next_weights.get().1,
        };
        // attention_decode.cu `Shape::SMEM`: STAGES tiles of tk keys of K and of V, rows padded
        // by 16 bytes, tk = max(16, 32 KiB / (2 d size)); then 2 STAGES mbarriers.
        let es = t.size();
        let tk = (32768 / (2 * d * es)).max(16);
        let stage = 2 * tk * (d * es + 16);
        // A batched step's rows one after another in each (head, split) block
        // (`attention_decode_rows_d*`, `CudaOptions::attn_rows`): ROWS_STAGES stages, the merge
        // area after them (attention_decode.cu `RowsShape`), and block rows enough to fill the
        // SMs; otherwise one block per (head, split, row).
        let rows_kernel = batched && self.attn_rows;
        let (entry, smem, gz) = if rows_kernel {
            const ROWS_STAGES: usize = 4; // attention_decode.cu ROWS_STAGES
            let merge = 64 * (d + 4) * 4 + 4 * 64 * 4;
            let blocks = kv_heads * splits;
            let rb = (self.sms / blocks.max(1)).clamp(1, rows);
            (
                format!("attention_decode_rows_d{d}"),
                (ROWS_STAGES * stage + merge + 2 * ROWS_STAGES * 8) as u32,
                rb as u32,
            )
        } else {
            (
                format!("attention_decode_d{d}"),
                (STAGES * stage + 2 * STAGES * 8) as u32,
                if batched { rows as u32 } else { 1 },
            )
        };
        let Ok(main) = self.kernel_smem(
            &format!("{label} decode ({splits} splits)"),
            self.kernels.typed(&entry, t)?,
            (kv_heads as u32, splits as u32, gz),
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

impl Builder<'_> {
    /// The output gate `next` applies to attention `op`'s output, if it is one the small-phase
    /// kernel can fuse ([`OutGate`]) and `CudaOptions::attn_gate` is on.
    pub(super) fn out_gate(
        &self,
        op: &Op,
        next: Option<&Op>,
        rows: usize,
        label: &str,
    ) -> Result<Option<OutGate>> {
        let (
            Op::Attention { out, .. },
            Some(Op::Mul {
                gate,
                act,
                x,
                out: mout,
            }),
        ) = (op, next)
        else {
            return Ok(None);
        };
        // (The kernel reads a gate before it stores that output: never the same buffer.)
        if !self.attn_gate
            || x != out
            || mout != out
            || gate.width != out.width
            || gate.buf == out.buf
        {
            return Ok(None);
        }
        let (addr, ld, d) = self.view(gate, rows, label, "gate")?;
        Ok((d == self.target()).then_some(OutGate {
            addr,
            ld,
            act: act_code(*act),
        }))
    }

    /// The launches of an `Op::Attention` over `rows`: the KV-cache write (left out where
    /// `write_kv` is false: an earlier launch of the program wrote the rows' keys and values
    /// into the caches, [`Builder::qk_prep`]), then decode (split over the cache, combined) or
    /// prefill (tensor-core tiles) attention. With `shared = Some(s)` the split count is a
    /// one-row step's (see [`Builder::op`]). The output gate `gate` is fused where the
    /// small-phase kernel runs: returns whether it was (else the caller launches its `Mul`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        op: &Op,
        rows: usize,
        shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
        write_kv: bool,
        gate: Option<OutGate>,
    ) -> Result<bool> {
        let Op::Attention {
            q,
            k,
            v,
            cache_k,
            cache_v,
            out,
            q_heads,
            kv_heads,
            head_dim,
            scale,
        } = op
        else {
            unreachable!("attention builds only Op::Attention")
        };
        let shape_rows = shared.unwrap_or(rows);
        let t = self.target();
        let io = &self.compiled.io;
        let len = self.addr(io.len);
        let pos = self.addr(io.pos);
        let r = rows as u32;
        let (qp, ld_q, qd) = self.view(q, rows, label, "q")?;
        let (kp, ld_k, kd) = self.view(k, rows, label, "k")?;
        let (vp, ld_v, vd) = self.view(v, rows, label, "v")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        if [qd, kd, vd, od].iter().any(|&d| d != t) {
            return Err(Error::Config(format!(
                "{label}: q/k/v/out must be {}",
                t.name()
            )));
        }
        if *kv_heads == 0 || q_heads % kv_heads != 0 {
            return Err(Error::Config(format!(
                "{label}: {q_heads} query heads vs {kv_heads} KV heads"
            )));
        }
        let kvw = kv_heads * head_dim;
        if q.width != q_heads * head_dim || out.width != q.width || k.width != kvw || v.width != kvw
        {
            return Err(Error::Config(format!(
                "{label}: view widths do not match the head counts"
            )));
        }
        let max_seq = self.compiled.layout.max_seq;
        for c in [cache_k, cache_v] {
            self.expect_dtype(*c, t, label)?;
            let cb = self.buf(*c);
            if cb.shape != [max_seq, *kv_heads, *head_dim] {
                return Err(Error::Config(format!(
                    "{label}: cache `{}` has shape {:?}, expected [{max_seq}, {kv_heads}, {head_dim}]",
                    cb.name, cb.shape
                )));
            }
        }
        let variant = match head_dim {
            0 => return Err(Error::Config(format!("{label}: head_dim 0"))),
            1..=64 => "attention_d64",
            65..=128 => "attention_d128",
            129..=256 => "attention_d256",
            257..=512 => "attention_d512",
            _ => {
                return Err(Error::Unsupported(format!(
                    "{label}: head_dim {head_dim} > 512"
                )));
            }
        };
        let kw = KvWriteParams {
            k: kp,
            v: vp,
            cache_k: self.addr(*cache_k),
            cache_v: self.addr(*cache_v),
            pos,
            len,
            ld_k,
            ld_v,
            width: to_i32(kvw, "kv width", label)?,
            max_seq: to_i32(max_seq, "max_seq", label)?,
            rows_pos: self.rows_pos(),
            slots: self.slots(),
        };
        if write_kv {
            cmds.push(self.kernel(
                &format!("{label} kv_write"),
                self.kernels.typed("kv_write", t)?,
                (ceil_div(kvw, 256), r, 1),
                256,
                &kw,
            ));
        }
        let mut p = AttentionParams {
            q: qp,
            cache_k: self.addr(*cache_k),
            cache_v: self.addr(*cache_v),
            out: op_,
            pos,
            len,
            ld_q,
            ld_out: ld_o,
            q_heads: to_i32(*q_heads, "q_heads", label)?,
            kv_heads: to_i32(*kv_heads, "kv_heads", label)?,
            head_dim: to_i32(*head_dim, "head_dim", label)?,
            max_seq: to_i32(max_seq, "max_seq", label)?,
            splits: 1,
            scale: scale.get() as f32,
            partial: self.workspace,
        };
        let prefill = self.attention_prefill(label, &p, t, rows, shared)?;
        if let Some(v) = prefill {
            cmds.extend(v);
        } else if let Some(dec) = self
            .attn_decode
            .then(|| self.attention_decode(label, &p, rows, shared, gate))
            .transpose()?
            .flatten()
        {
            // Small phases (<= 8 rows, or every phase of a speculative model's shared
            // <= 5 rows): one block per (KV head, split), see `attention_decode`.
            cmds.extend(dec);
            return Ok(gate.is_some());
        } else if self.batch.is_some() {
            return Err(Error::Unsupported(format!(
                "{label}: no batched decode (the small-phase attention kernel does not apply)"
            )));
        } else {
            // Flash-decoding split: enough blocks for ~4 waves, pieces of >= 16
            // positions at max_seq, partials within the workspace.
            let blocks = q_heads * if shared.is_some() { 1 } else { rows };
            let per_split = q_heads * shape_rows * (head_dim + 2) * 4;
            let splits = (4 * self.sms)
                .div_ceil(blocks)
                .min(64)
                .min(max_seq.div_ceil(16))
                .min(gemm::WORKSPACE_BYTES / per_split)
                .max(1);
            p.splits = splits as i32;
            cmds.push(self.kernel(
                label,
                self.kernels.typed(variant, t)?,
                (*q_heads as u32, r, splits as u32),
                128,
                &p,
            ));
            cmds.extend(self.attention_combine(label, &p, t, r)?);
        }
        Ok(false)
    }

    /// With `p.splits > 1`: the launch of `attention_combine` (kernels/attention.cu) that
    /// merges the splits' partial states of `rows` rows into `p.out` — after the split kernel
    /// of attention.cu or the warpgroup-MMA prefill kernel, which write the same layout.
    pub(super) fn attention_combine(
        &self,
        label: &str,
        p: &AttentionParams,
        t: DType,
        rows: u32,
    ) -> Result<Option<Cmd>> {
        if p.splits <= 1 {
            return Ok(None);
        }
        Ok(Some(self.kernel(
            &format!("{label} combine ({} splits)", p.splits),
            self.kernels.typed("attention_combine", t)?,
            (p.q_heads as u32, rows, 1),
            128,
            p,
        )))
    }
}
