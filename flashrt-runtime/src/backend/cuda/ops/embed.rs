//! The token embedding lookup (plan op `Embed`, kernels/embed.cu).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct EmbedParams {
    tokens: u64,
    len: u64,
    table: u64,
    out: u64,
    ld_out: i32,
    width: i32,
    vocab: i32,
}

impl Builder<'_> {
    /// The embedding lookup of the bucket's tokens (padding rows zeroed).
    pub(super) fn embed(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::Embed { table, out } = op else {
            unreachable!("embed builds only Op::Embed")
        };
        let len = self.addr(self.compiled.io.len);
        let r = rows as u32;
        let (o, ld_o, od) = self.view(out, rows, label, "out")?;
        self.expect_dtype(*table, od, label)?;
        let tb = self.buf(*table);
        if tb.shape.len() != 2 || tb.shape[1] != out.width {
            return Err(Error::Config(format!(
                "{label}: table `{}` shape {:?} does not match width {}",
                tb.name, tb.shape, out.width
            )));
        }
        let p = EmbedParams {
            tokens: self.addr(self.compiled.io.tokens),
            len,
            table: self.addr(*table),
            out: o,
            ld_out: ld_o,
            width: to_i32(out.width, "width", label)?,
            vocab: to_i32(tb.shape[0], "vocab", label)?,
        };
        cmds.push(self.kernel(label, self.kernels.typed("embed", od)?, (r, 1, 1), 256, &p));
        Ok(())
    }
}
