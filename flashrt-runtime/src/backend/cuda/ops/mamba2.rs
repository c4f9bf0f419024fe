//! `Op::Mamba2Scan` -> kernels/mamba2.cu (the recurrent and chunked SSD scans).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct Mamba2Params {
    xbc: u64,
    dt: u64,
    a_log: u64,
    d: u64,
    dt_bias: u64,
    state: u64,
    out: u64,
    len: u64,
    ld_xbc: i32,
    ld_dt: i32,
    ld_out: i32,
    heads: i32,
    head_dim: i32,
    groups: i32,
    state_size: i32,
    has_dt_min: i32,
    dt_min: f32,
}

impl Builder<'_> {
    /// The launches of an `Op::Mamba2Scan` over `rows` (kernels/mamba2.cu picks the scan).
    pub(super) fn mamba2_scan(
        &self,
        op: &Op,
        rows: usize,
        _shared: Option<usize>,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::Mamba2Scan {
            xbc,
            dt,
            a_log,
            d,
            dt_bias,
            state,
            out,
            heads,
            head_dim,
            groups,
            state_size,
            dt_min,
        } = op
        else {
            unreachable!("mamba2_scan builds only Op::Mamba2Scan")
        };
        let t = self.target();
        let io = &self.compiled.io;
        let len = self.addr(io.len);
        let (xp, ld_xbc, xd) = self.view(xbc, rows, label, "xbc")?;
        let (dp, ld_dt, dd) = self.view(dt, rows, label, "dt")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        if [xd, dd, od].iter().any(|&d| d != t) {
            return Err(Error::Config(format!(
                "{label}: activations must be {}",
                t.name()
            )));
        }
        if *groups == 0 || heads % groups != 0 {
            return Err(Error::Config(format!(
                "{label}: {heads} heads vs {groups} groups"
            )));
        }
        if xbc.width != heads * head_dim + 2 * groups * state_size
            || dt.width != *heads
            || out.width != heads * head_dim
        {
            return Err(Error::Config(format!(
                "{label}: view widths do not match the head counts"
            )));
        }
        for p in [a_log, d, dt_bias] {
            self.expect_dtype(*p, DType::F32, label)?;
            self.expect_numel(*p, *heads, label)?;
        }
        self.expect_dtype(*state, DType::F32, label)?;
        self.expect_numel(*state, heads * head_dim * state_size, label)?;
        let variant = match state_size {
            0 => return Err(Error::Config(format!("{label}: state size 0"))),
            1..=64 => "mamba2_scan_n64",
            65..=128 => "mamba2_scan_n128",
            129..=256 => "mamba2_scan_n256",
            _ => {
                return Err(Error::Unsupported(format!(
                    "{label}: state size {state_size} > 256"
                )));
            }
        };
        let p = Mamba2Params {
            xbc: xp,
            dt: dp,
            a_log: self.addr(*a_log),
            d: self.addr(*d),
            dt_bias: self.addr(*dt_bias),
            state: self.addr(*state),
            out: op_,
            len,
            ld_xbc,
            ld_dt,
            ld_out: ld_o,
            heads: to_i32(*heads, "heads", label)?,
            head_dim: to_i32(*head_dim, "head_dim", label)?,
            groups: to_i32(*groups, "groups", label)?,
            state_size: to_i32(*state_size, "state_size", label)?,
            has_dt_min: dt_min.is_some() as i32,
            dt_min: dt_min.map_or(0.0, |v| v.get() as f32),
        };
        // Prefill buckets of >= 64 rows on 16-bit targets with state size <= 128: the
        // chunked (SSD) kernel of mamba2.cu (`mamba2_chunk_n{64,128}`: grid
        // (ceil(head_dim / 32), heads), 128 threads, `M2C_SMEM(NK)` = 576 NK + 25088
        // bytes of shared memory). The choice depends on the plan only, so a phase
        // always computes a row the same way. Everything else scans token by token.
        let chunk = match state_size {
            _ if rows < 64 || !matches!(t, DType::Bf16 | DType::F16) => None,
            1..=64 => Some(64usize),
            65..=128 => Some(128),
            _ => None,
        };
        let chunked = match chunk {
            Some(nk) => self
                .kernel_smem(
                    &format!("{label} chunked"),
                    self.kernels.typed(&format!("mamba2_chunk_n{nk}"), t)?,
                    (ceil_div(*head_dim, 32), *heads as u32, 1),
                    128,
                    (576 * nk + 25088) as u32,
                    &p,
                )
                .ok(),
            None => None,
        };
        cmds.push(match chunked {
            Some(c) => c,
            None => self.kernel(
                label,
                self.kernels.typed(variant, t)?,
                (ceil_div(*head_dim, 16), *heads as u32, 1),
                128,
                &p,
            ),
        });
        Ok(())
    }
}
