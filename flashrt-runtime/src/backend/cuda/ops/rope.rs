//! Rotary position embeddings (plan op `Rope`, kernels/rope.cu).

use super::*;

#[repr(C)]
#[derive(Clone, Copy)]
struct RopeParams {
    x: u64,
    pos: u64,
    len: u64,
    theta: f64,
    ld_x: i32,
    head_dim: i32,
    rotary_dims: i32,
    rows_pos: u64,
}

impl Builder<'_> {
    /// Rotates the q or k heads of `rows` rows by their positions (per-row positions in a batched
    /// step).
    pub(super) fn rope(
        &self,
        op: &Op,
        rows: usize,
        label: &str,
        cmds: &mut Vec<Cmd>,
    ) -> Result<()> {
        let Op::Rope {
            x,
            heads,
            head_dim,
            rotary_dims,
            theta,
        } = op
        else {
            unreachable!("rope builds only Op::Rope")
        };
        let len = self.addr(self.compiled.io.len);
        let pos = self.addr(self.compiled.io.pos);
        let r = rows as u32;
        let (xp, ld_x, xd) = self.view(x, rows, label, "x")?;
        if heads * head_dim > x.width || *rotary_dims > *head_dim || rotary_dims % 2 != 0 {
            return Err(Error::Config(format!(
                "{label}: {heads} heads x {head_dim} (rotary {rotary_dims}) vs width {}",
                x.width
            )));
        }
        let p = RopeParams {
            x: xp,
            pos,
            len,
            theta: theta.get(),
            ld_x,
            head_dim: to_i32(*head_dim, "head_dim", label)?,
            rotary_dims: to_i32(*rotary_dims, "rotary_dims", label)?,
            rows_pos: self.rows_pos(),
        };
        // kernels/rope.cu: a block rotates `hb` heads (a divisor of `heads`) with one
        // thread per (head, pair), blockDim = hb * half <= 256, the angles computed
        // once per block; pairs beyond 256 take hb = 1 and 256 threads looping.
        let half = rotary_dims / 2;
        let (hb, threads) = match half {
            0 => (1, 32),
            257.. => (1, 256),
            _ => {
                let hb = (1..=*heads)
                    .rev()
                    .find(|d| heads % d == 0 && d * half <= 256)
                    .unwrap_or(1);
                (hb, hb * half)
            }
        };
        cmds.push(self.kernel(
            label,
            self.kernels.typed("rope", xd)?,
            ((heads / hb) as u32, r, 1),
            threads as u32,
            &p,
        ));
        Ok(())
    }
}
