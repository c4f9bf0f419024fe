//! Elementwise ops and row moves (plan ops `Mul`, `Unary`, `SplitHeads`, `StoreLastRow`,
//! `LoadState`; kernels/elementwise.cu).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct MulParams {
    gate: u64,
    x: u64,
    out: u64,
    len: u64,
    ld_gate: i32,
    ld_x: i32,
    ld_out: i32,
    width: i32,
    act: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UnaryParams {
    x: u64,
    out: u64,
    len: u64,
    ld_x: i32,
    ld_out: i32,
    width: i32,
    act: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct RowStateParams {
    x: u64,
    out: u64,
    state: u64,
    len: u64,
    ld: i32,
    width: i32,
    slots: u64,
}

const MAX_PARTS: usize = 4;

#[repr(C)]
#[derive(Clone, Copy)]
struct SplitHeadsParams {
    x: u64,
    out: [u64; MAX_PARTS],
    len: u64,
    ld_x: i32,
    ld_out: [i32; MAX_PARTS],
    part: [i32; MAX_PARTS],
    nparts: i32,
    heads: i32,
}

impl Builder<'_> {
    pub(super) fn mul(&self, op: &Op, rows: usize, label: &str, cmds: &mut Vec<Cmd>) -> Result<()> {
        let Op::Mul { gate, act, x, out } = op else {
            unreachable!("mul builds only Op::Mul")
        };
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        let (gp, ld_g, gd) = self.view(gate, rows, label, "gate")?;
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        // A gate of width 1 is one gate per row (the MoE shared expert's token gate).
        let row_gate = gate.width == 1 && x.width > 1;
        if gd != xd || xd != od || (!row_gate && gate.width != x.width) || x.width != out.width {
            return Err(Error::Config(format!(
                "{label}: operand dtypes or widths differ"
            )));
        }
        let p = MulParams {
            gate: gp,
            x: xp,
            out: op_,
            len,
            ld_gate: ld_g,
            ld_x,
            ld_out: ld_o,
            width: to_i32(x.width, "width", label)?,
            act: act_code(*act),
        };
        cmds.push(if row_gate {
            self.kernel(
                label,
                self.kernels.typed("mul_rowgate", xd)?,
                (ceil_div(x.width, 256), r, 1),
                256,
                &p,
            )
        } else {
            self.elementwise(
                label,
                "mul",
                xd,
                (rows, r, x.width),
                &[(gp, ld_g), (xp, ld_x), (op_, ld_o)],
                &p,
            )?
        });
        Ok(())
    }

    /// `out = act(x)`.
    pub(super) fn unary(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::Unary { x, act, out } = op else {
            unreachable!("unary builds only Op::Unary")
        };
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        if xd != od || x.width != out.width {
            return Err(Error::Config(format!(
                "{label}: operand dtypes or widths differ"
            )));
        }
        let p = UnaryParams {
            x: xp,
            out: op_,
            len,
            ld_x,
            ld_out: ld_o,
            width: to_i32(x.width, "width", label)?,
            act: act_code(*act),
        };
        cmds.push(self.elementwise(
            label,
            "unary",
            xd,
            (rows, r, x.width),
            &[(xp, ld_x), (op_, ld_o)],
            &p,
        )?);
        Ok(())
    }

    /// Splits each head of `x` into its parts (q / gate, and the like), one output per part.
    pub(super) fn split_heads(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::SplitHeads { x, heads, outs } = op else {
            unreachable!("split_heads builds only Op::SplitHeads")
        };
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        if outs.is_empty() || outs.len() > MAX_PARTS {
            return Err(Error::Unsupported(format!(
                "{label}: {} parts (1..={MAX_PARTS} supported)",
                outs.len()
            )));
        }
        let total: usize = outs.iter().map(|o| o.width).sum();
        if *heads == 0 || total != x.width || outs.iter().any(|o| o.width % heads != 0) {
            return Err(Error::Config(format!(
                "{label}: parts {:?} do not split {} columns into {heads} heads",
                outs.iter().map(|o| o.width).collect::<Vec<_>>(),
                x.width
            )));
        }
        let mut p = SplitHeadsParams {
            x: xp,
            out: [0; MAX_PARTS],
            len,
            ld_x,
            ld_out: [0; MAX_PARTS],
            part: [0; MAX_PARTS],
            nparts: outs.len() as i32,
            heads: to_i32(*heads, "heads", label)?,
        };
        for (i, o) in outs.iter().enumerate() {
            let (a, ld, d) = self.view(o, rows, label, "out")?;
            if d != xd {
                return Err(Error::Config(format!(
                    "{label}: part {i} dtype differs from x"
                )));
            }
            p.out[i] = a;
            p.ld_out[i] = ld;
            p.part[i] = to_i32(o.width / heads, "part width", label)?;
        }
        cmds.push(self.kernel(
            label,
            self.kernels.typed("split_heads", xd)?,
            (*heads as u32, r, 1),
            128,
            &p,
        ));
        Ok(())
    }

    /// Stores the last valid row of `x` into a state region (every row into its own session in a
    /// batched step).
    pub(super) fn store_last_row(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::StoreLastRow { x, state } = op else {
            unreachable!("store_last_row builds only Op::StoreLastRow")
        };
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        self.expect_dtype(*state, xd, label)?;
        self.expect_numel(*state, x.width, label)?;
        let p = RowStateParams {
            x: xp,
            out: 0,
            state: self.addr(*state),
            len,
            ld: ld_x,
            width: to_i32(x.width, "width", label)?,
            slots: self.slots(),
        };
        // A batched step stores every row into its own session (grid y = rows).
        let gy = if self.batch.is_some() { r } else { 1 };
        cmds.push(self.kernel(
            label,
            self.kernels.typed("store_last_row", xd)?,
            (1, gy, 1),
            256,
            &p,
        ));
        Ok(())
    }

    /// Broadcasts a state row (the MTP drafter's hidden state) into the output rows.
    pub(super) fn load_state(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::LoadState { state, out } = op else {
            unreachable!("load_state builds only Op::LoadState")
        };
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        self.not_batched(label, "the MTP drafter's state load")?;
        let (op_, ld_o, od) = self.view(out, rows, label, "out")?;
        self.expect_dtype(*state, od, label)?;
        self.expect_numel(*state, out.width, label)?;
        let p = RowStateParams {
            x: 0,
            out: op_,
            state: self.addr(*state),
            len,
            ld: ld_o,
            width: to_i32(out.width, "width", label)?,
            slots: 0,
        };
        cmds.push(self.kernel(
            label,
            self.kernels.typed("load_state", od)?,
            (ceil_div(out.width, 256), r, 1),
            256,
            &p,
        ));
        Ok(())
    }

    /// An elementwise kernel of kernels/elementwise.cu over `rows` (the bucket; `r` blocks of
    /// rows for the scalar kernel) of `width` elements: `<name>_vec`, one 16-byte pack per thread
    /// of a 1-D grid over (row, pack), where the width, every view's address and row stride
    /// (`views`: (address, ld)) are whole packs; else `<name>`, one element per thread.
    pub(super) fn elementwise<P: Copy>(
        &self,
        label: &str,
        name: &str,
        dtype: DType,
        (rows, r, width): (usize, u32, usize),
        views: &[(u64, i32)],
        p: &P,
    ) -> Result<Cmd> {
        let pack = 16 / dtype.size();
        let threads = rows * (width / pack);
        let vec = width > 0
            && width.is_multiple_of(pack)
            && threads <= u32::MAX as usize
            && views
                .iter()
                .all(|&(a, ld)| a.is_multiple_of(16) && (ld as usize).is_multiple_of(pack));
        Ok(if vec {
            self.kernel(
                label,
                self.kernels.typed(&format!("{name}_vec"), dtype)?,
                (ceil_div(threads, 256), 1, 1),
                256,
                p,
            )
        } else {
            self.kernel(
                label,
                self.kernels.typed(name, dtype)?,
                (ceil_div(width, 256), r, 1),
                256,
                p,
            )
        })
    }
}
