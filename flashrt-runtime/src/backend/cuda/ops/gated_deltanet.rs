//! `Op::GatedDeltaNet` -> kernels/gated_deltanet.cu (the recurrent and chunked scans).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct GdnParams {
    qkv: u64,
    a: u64,
    b: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    out: u64,
    len: u64,
    ld_qkv: i32,
    ld_a: i32,
    ld_b: i32,
    ld_out: i32,
    key_heads: i32,
    value_heads: i32,
    key_dim: i32,
    value_dim: i32,
    prep: u64,
    prep_chunks: i32,
    prep_pad: i32,
}

/// kernels/gated_deltanet.cu `GDNC_ROWS`, `GDNC_COLS`: the chunked kernel's rows a chunk and
/// value columns a block (the least rows a plan runs it for is `CudaOptions::gdn_chunk_rows`).
const GDN_CHUNK_ROWS: usize = 64;
const GDN_CHUNK_COLS: usize = 16;

/// The chunked kernel's key_dim bound (64 or 128) where a plan of `rows` runs it (buckets of
/// `min_rows` rows or more).
fn chunk_dk(rows: usize, key_dim: usize, min_rows: usize) -> Option<usize> {
    match key_dim {
        _ if rows < min_rows => None,
        1..=64 => Some(64),
        65..=128 => Some(128),
        _ => None,
    }
}

/// Bytes of one chunk's record (kernels/gated_deltanet.cu `GdncLayout::REC`: As, Ps
/// [C][C + 8], Ts [C][24] in the target dtype, six f32 vectors [C]).
fn chunk_record_bytes(t: DType) -> usize {
    let c = GDN_CHUNK_ROWS;
    (2 * c * (c + 8) + c * 24) * t.size() + 6 * c * 4
}

/// Bytes of the chunk records the chunked Gated DeltaNet kernel's split-off phases need at
/// most over `compiled`'s plans (`CudaOptions::gdn_prep`): value heads x chunks x record.
pub fn gdn_prep_bytes(compiled: &Compiled, min_rows: usize) -> usize {
    let t = compiled.layout.target.dtype;
    let mut most = 0;
    for plan in &compiled.plans {
        let rows = plan.phase.rows();
        for op in &plan.ops {
            if let Op::GatedDeltaNet {
                key_dim,
                value_heads,
                ..
            } = op
                && chunk_dk(rows, *key_dim, min_rows).is_some()
            {
                most =
                    most.max(value_heads * rows.div_ceil(GDN_CHUNK_ROWS) * chunk_record_bytes(t));
            }
        }
    }
    most
}

/// kernels/gated_deltanet.cu `GdnDecodeParams`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GdnDecodeParams {
    g: GdnParams,
    conv_w: u64,
    conv_b: u64,
    conv_state: u64,
    conv_out: u64,
    z: u64,
    norm_w: u64,
    gated: u64,
    ld_conv_out: i32,
    ld_z: i32,
    ld_gated: i32,
    conv_k: i32,
    act: i32,
    shared_weight: i32,
    gate_then_norm: i32,
    eps: f32,
    slots: u64,
    ckpt_state: u64,
    ckpt_conv: u64,
    ckpt_row_bytes: i64,
    /// The next matmul's first weights, asked of the L2 ([`Builder::next_weights`]).
    pf: u64,
    pf_bytes: u64,
}

/// Mirrors of kernels/gated_deltanet.cu's GDND_* bounds: rows, key and value head widths of
/// the fused decode kernel, its block size, and the conv taps it holds.
const GDND_ROWS: usize = 8;
const GDND_DK: usize = 128;
const GDND_DV: usize = 128;
const GDND_TAPS: usize = 4;

impl Builder<'_> {
    /// Small phases (at most 8 rows, 16-bit targets, sm_90): a Gated DeltaNet layer's
    /// [`Op::CausalConv1d`], [`Op::GatedDeltaNet`] and [`Op::GatedRmsNorm`] (as the lowering
    /// writes them, each reading the previous one's output) as one launch of
    /// `gdn_decode_r{R}_c{NB}` (kernels/gated_deltanet.cu), R = value heads per key head, NB =
    /// blocks per value head ([`Builder::gdn_col_blocks`]; grid Hv * NB, clusters of R * NB). Returns
    /// the ops consumed, `None` where `ops` does not start with such a sequence the kernel
    /// takes (they then run one by one). With `keep_rows` (a verify pass, [`RowStateArea`])
    /// the kernel also writes the recurrent and conv states after every row to the model's
    /// row-state area.
    pub(super) fn gdn_small(
        &self,
        ops: &[Op],
        rows: usize,
        keep_rows: bool,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<Option<usize>> {
        let t = self.target();
        if !self.gdn_fused || rows > GDND_ROWS || !matches!(t, DType::Bf16 | DType::F16) {
            return Ok(None);
        }
        let [
            conv @ Op::CausalConv1d {
                x: cx,
                out: cout,
                kernel,
                state: conv_state,
                ..
            },
            gdn @ Op::GatedDeltaNet {
                qkv,
                out: gout,
                state: gdn_state,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
                ..
            },
            norm @ Op::GatedRmsNorm { x: nx, group, .. },
            ..,
        ] = ops
        else {
            return Ok(None);
        };
        let (hk, hv, dk, dv) = (*key_heads, *value_heads, *key_dim, *value_dim);
        let r = if hk > 0 && hv % hk == 0 { hv / hk } else { 0 };
        // Blocks per value head (a head's state columns split over them), and each block's
        // columns, threads (one warp per 8 columns) and share of the key head's q, k channels.
        let nb = match self.gdn_col_blocks {
            2 => 2,
            4 => 4,
            _ => 1,
        };
        let cols = GDND_DV / nb;
        let threads = cols / 8 * 32;
        let share = (2 * dk).div_ceil((r * nb).max(1));
        // What the fused kernel adds to the three ops' own checks (below): its size bounds,
        // and each op reading the previous one's output.
        let fits = qkv == cout
            && nx == gout
            && (1..=4).contains(&r)
            && (1..=GDND_DK).contains(&dk)
            && (32..=GDND_DV).contains(&dv)
            && dv.is_multiple_of(32)
            && cols + share <= threads
            && *group == dv
            && (1..=GDND_TAPS).contains(kernel)
            && self.buf(cx.buf).dtype == t;
        if !fits {
            return Ok(None);
        }
        // The three ops' checked parameters (the recurrence's qkv view is the conv's output;
        // the kernel reads the conv's input instead).
        let (c, _) = self.conv_params(conv, rows, label)?;
        let mut g = self.gdn_params(gdn, rows, label)?;
        let (n, _) = self.gated_norm_params(norm, rows, label)?;
        g.qkv = c.x;
        g.ld_qkv = c.ld_x;
        let p = GdnDecodeParams {
            g,
            conv_w: c.weight,
            conv_b: c.bias,
            conv_state: c.state,
            conv_out: c.out,
            z: n.gate,
            norm_w: n.weight,
            gated: n.out,
            ld_conv_out: c.ld_out,
            ld_z: n.ld_gate,
            ld_gated: n.ld_out,
            conv_k: c.kernel,
            act: c.act,
            shared_weight: n.shared_weight,
            gate_then_norm: n.gate_then_norm,
            eps: n.eps,
            slots: self.slots(),
            ckpt_state: 0,
            ckpt_conv: 0,
            ckpt_row_bytes: 0,
            pf: self.next_weights.get().0,
            pf_bytes: self.next_weights.get().1,
        };
        // A verify pass keeping each row's states: the recurrent and conv states after row r
        // at their places in row r of the model's row-state area.
        let mut p = p;
        if keep_rows && let Some(a) = &self.row_states {
            let (Some(s), Some(c)) = (a.at(*gdn_state), a.at(*conv_state)) else {
                return Err(Error::Config(format!(
                    "{label}: state regions missing from the row-state area"
                )));
            };
            p.ckpt_state = s;
            p.ckpt_conv = c;
            p.ckpt_row_bytes = a.row_bytes as i64;
        }
        // A batched step: one cluster row per session row (grid y), each block one row, so
        // the entry whose arrays hold one row (`gdn_decode1`: half the registers, twice the
        // blocks an SM; the same arithmetic per row).
        let (gy, entry) = if self.batch.is_some() {
            (rows as u32, "gdn_decode1")
        } else {
            (1, "gdn_decode")
        };
        let func = self.kernels.typed(&format!("{entry}_r{r}_c{nb}"), t)?;
        if r * nb > 8 {
            // Clusters of more than 8 blocks (up to 16 on sm_90) need the opt-in.
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1,
            )
            .map_err(|e| Error::Backend {
                op: label.to_string(),
                msg: format!("cannot allow a cluster of {} blocks: {e:?}", r * nb),
            })?;
        }
        cmds.push(self.kernel(
            &format!("{label} + gated_deltanet + gated_rms_norm"),
            func,
            ((hv * nb) as u32, gy, 1),
            threads as u32,
            &p,
        ));
        Ok(Some(3))
    }

    /// The checked kernel parameters of an `Op::GatedDeltaNet` over `rows`.
    fn gdn_params(&self, op: &Op, rows: usize, label: &str) -> Result<GdnParams> {
        let Op::GatedDeltaNet {
            qkv,
            a,
            b,
            a_log,
            dt_bias,
            state,
            out,
            key_heads,
            value_heads,
            key_dim,
            value_dim,
        } = op
        else {
            unreachable!("gdn_params takes only Op::GatedDeltaNet")
        };
        let t = self.target();
        let len = self.addr(self.compiled.io.len);
        let (qp, ld_qkv, qd) = self.view(qkv, rows, label, "qkv")?;
        let (ap, ld_a, ad) = self.view(a, rows, label, "a")?;
        let (bp, ld_b, bd) = self.view(b, rows, label, "b")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        if [qd, ad, bd, od].iter().any(|&d| d != t) {
            return Err(Error::Config(format!(
                "{label}: activations must be {}",
                t.name()
            )));
        }
        if *key_heads == 0 || value_heads % key_heads != 0 {
            return Err(Error::Config(format!(
                "{label}: {value_heads} value heads vs {key_heads} key heads"
            )));
        }
        if qkv.width != 2 * key_heads * key_dim + value_heads * value_dim
            || a.width != *value_heads
            || b.width != *value_heads
            || out.width != value_heads * value_dim
        {
            return Err(Error::Config(format!(
                "{label}: view widths do not match the head counts"
            )));
        }
        for p in [a_log, dt_bias] {
            self.expect_dtype(*p, DType::F32, label)?;
            self.expect_numel(*p, *value_heads, label)?;
        }
        self.expect_dtype(*state, DType::F32, label)?;
        self.expect_numel(*state, value_heads * key_dim * value_dim, label)?;
        Ok(GdnParams {
            qkv: qp,
            a: ap,
            b: bp,
            a_log: self.addr(*a_log),
            dt_bias: self.addr(*dt_bias),
            state: self.addr(*state),
            out: op_,
            len,
            ld_qkv,
            ld_a,
            ld_b,
            ld_out: ld_o,
            key_heads: to_i32(*key_heads, "key_heads", label)?,
            value_heads: to_i32(*value_heads, "value_heads", label)?,
            key_dim: to_i32(*key_dim, "key_dim", label)?,
            value_dim: to_i32(*value_dim, "value_dim", label)?,
            prep: 0,
            prep_chunks: 0,
            prep_pad: 0,
        })
    }

    /// The launches of an `Op::GatedDeltaNet` over `rows`: the recurrent kernel, or the
    /// chunked one where it applies (see the variant choice below).
    pub(super) fn gated_deltanet(
        &self,
        op: &Op,
        rows: usize,
        _shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::GatedDeltaNet {
            key_dim,
            value_heads,
            value_dim,
            ..
        } = op
        else {
            unreachable!("gated_deltanet builds only Op::GatedDeltaNet")
        };
        let t = self.target();
        let p = self.gdn_params(op, rows, label)?;
        // Two kernels (kernels/gated_deltanet.cu), both continuing from the state
        // left by earlier calls:
        // * buckets of >= `gdn_chunk_rows` (32) rows with key_dim <= 128: the chunked kernel (64-row
        //   chunks in WY form on tensor cores: bf16/f16 mma for 16-bit targets,
        //   3xTF32 for f32). One block per value head and 16 value columns, 128
        //   threads, its shared memory (`GDN_CHUNK_*` below, mirroring `GdncLayout`)
        //   above 48 KiB: 67 KiB for bf16 at key_dim 128, so 3 blocks share an SM
        //   (with `CudaOptions::gdn_prep`, the default: a launch of the chunks' records
        //   first and the `_pre` / `_pre2` loop reading them, below);
        // * otherwise (decode, verify, small prefill buckets, key_dim > 128): the
        //   token-by-token kernel, one block per value head and 32 value columns.
        // Which one runs depends only on the plan, so a phase always computes a row
        // the same way.
        // The chunked kernel's key_dim bound, if it runs.
        let chunk_dk = chunk_dk(rows, *key_dim, self.gdn_chunk_rows);
        let variant = match (chunk_dk, key_dim) {
            (_, 0) => return Err(Error::Config(format!("{label}: key_dim 0"))),
            (Some(64), _) => "gated_deltanet_chunk_k64",
            (Some(_), _) => "gated_deltanet_chunk_k128",
            (None, 1..=64) => "gated_deltanet_k64",
            (None, 65..=128) => "gated_deltanet_k128",
            (None, 129..=256) => "gated_deltanet_k256",
            _ => {
                return Err(Error::Unsupported(format!(
                    "{label}: key_dim {key_dim} > 256"
                )));
            }
        };
        match chunk_dk {
            Some(dk) => {
                // GdncLayout<E, DK, N>, elements of the target dtype: Ks, Qs [C][DK+8];
                // St [N][DK+8]; Vs [C][N+8]; As, Ps [C][C+8]; Ts [C][24]; Vt [N][C+8];
                // Yt [N/8][8][24]; then six per-row f32 vectors [C].
                let (c, n) = (GDN_CHUNK_ROWS, GDN_CHUNK_COLS);
                let elems = 2 * c * (dk + 8)
                    + n * (dk + 8)
                    + c * (n + 8)
                    + 2 * c * (c + 8)
                    + c * 24
                    + n * (c + 8)
                    + n * 24;
                let bytes = elems * t.size() + 6 * c * 4;
                // Phases 1-3 (a) of every chunk split off into one launch over all chunks
                // (`gated_deltanet_chunk_prep_*`), the serial loop copying their records
                // (`gated_deltanet_chunk_pre_*`): the same values, computed once per value
                // head and chunk instead of once per block of value columns.
                let chunks = rows.div_ceil(c);
                let prep_bytes = value_heads * chunks * chunk_record_bytes(t);
                let split = self.gdn_prep.0 != 0 && prep_bytes <= self.gdn_prep.1;
                // Two record buffers (the next chunk's copied during this one's last phases)
                // take two blocks' shared memory an SM: only where the launch places at most
                // two blocks an SM anyway (the 35B-A3B shape's 256 blocks, not the 27B's 384).
                let blocks = value_dim.div_ceil(n) * value_heads;
                let double = split && self.gdn_prep_double && blocks <= 2 * self.sms.max(1);
                let mut bytes = bytes;
                let mut p = p;
                let variant = if split {
                    p.prep = self.gdn_prep.0;
                    p.prep_chunks = to_i32(chunks, "chunks", label)?;
                    let prep = self
                        .kernels
                        .typed(&format!("gated_deltanet_chunk_prep_k{dk}"), t)?;
                    prep.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        100,
                    )
                    .map_err(|e| Error::Backend {
                        op: label.to_string(),
                        msg: format!("cannot set the shared-memory carveout: {e:?}"),
                    })?;
                    cmds.push(self.kernel_smem(
                        &format!("{label} chunk records"),
                        prep,
                        (chunks as u32, *value_heads as u32, 1),
                        128,
                        bytes as u32,
                        &p,
                    )?);
                    if double {
                        bytes += 2 * chunk_record_bytes(t);
                        format!("gated_deltanet_chunk_pre2_k{dk}")
                    } else {
                        format!("gated_deltanet_chunk_pre_k{dk}")
                    }
                } else {
                    variant.to_string()
                };
                let func = self.kernels.typed(&variant, t)?;
                // Ask for the largest shared-memory carveout, so that several blocks fit
                // on an SM (the kernel keeps nothing in L1 worth the space).
                func.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                    100,
                )
                .map_err(|e| Error::Backend {
                    op: label.to_string(),
                    msg: format!("cannot set the shared-memory carveout: {e:?}"),
                })?;
                cmds.push(self.kernel_smem(
                    label,
                    func,
                    (ceil_div(*value_dim, n), *value_heads as u32, 1),
                    128,
                    bytes as u32,
                    &p,
                )?);
            }
            None => cmds.push(self.kernel(
                label,
                self.kernels.typed(variant, t)?,
                (ceil_div(*value_dim, 32), *value_heads as u32, 1),
                128,
                &p,
            )),
        }
        Ok(())
    }
}
