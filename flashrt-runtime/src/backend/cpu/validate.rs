//! Load-time checks of every plan op's buffers (kinds, dtypes, shapes, view bounds), so the
//! executor can index without checking.

use super::*;

impl ModelData {
    /// Check every buffer an op touches once, at load time, so execution can index freely.
    pub(super) fn validate(&mut self, plan: &Plan) -> Result<()> {
        let rows = plan.phase.rows();
        let max_seq = self.compiled.layout.max_seq;
        for op in &plan.ops {
            let name = op.name();
            let view = |m: &mut ModelData, v: &View| -> Result<()> {
                let b = m.buf(v.buf)?;
                let ok = matches!(b.role, Role::Scratch | Role::Io)
                    && b.dtype == DType::F32
                    && b.shape.len() == 2
                    && b.shape[1] == v.stride
                    && v.col + v.width <= v.stride
                    && b.shape[0] >= rows;
                if !ok {
                    return Err(backend_err(
                        name,
                        format!(
                            "view {}[.., {}..{}] (stride {}) does not fit buffer shape {:?}",
                            b.name,
                            v.col,
                            v.col + v.width,
                            v.stride,
                            b.shape
                        ),
                    ));
                }
                m.ws_cols = m.ws_cols.max(v.width);
                Ok(())
            };
            let weight = |m: &ModelData, id: BufferId, numel: usize| -> Result<()> {
                let b = m.buf(id)?;
                if b.role != Role::Weight || b.numel() != numel {
                    return Err(backend_err(
                        name,
                        format!(
                            "weight {} has shape {:?}, expected {numel} elements",
                            b.name, b.shape
                        ),
                    ));
                }
                Ok(())
            };
            let state = |m: &ModelData, id: BufferId, numel: usize| -> Result<()> {
                let b = m.buf(id)?;
                if b.role != Role::State || b.numel() != numel {
                    return Err(backend_err(
                        name,
                        format!(
                            "state {} has shape {:?}, expected {numel} elements",
                            b.name, b.shape
                        ),
                    ));
                }
                Ok(())
            };
            let same = |a: &View, b: &View| -> Result<()> {
                if a.width != b.width {
                    return Err(backend_err(
                        name,
                        format!("view widths differ ({} vs {})", a.width, b.width),
                    ));
                }
                Ok(())
            };
            let divides = |what: &str, a: usize, b: usize| -> Result<()> {
                if a == 0 || !b.is_multiple_of(a) {
                    return Err(backend_err(
                        name,
                        format!("{what}: {b} is not a multiple of {a}"),
                    ));
                }
                Ok(())
            };
            match op {
                Op::Embed { table, out } => {
                    view(self, out)?;
                    let vocab = self.compiled.ir.vocab;
                    weight(self, *table, vocab * out.width)?;
                }
                Op::RmsNorm {
                    x,
                    weight: w,
                    out,
                    group,
                    ..
                } => {
                    view(self, x)?;
                    view(self, out)?;
                    same(x, out)?;
                    divides("norm group", *group, x.width)?;
                    if let Some(w) = w {
                        weight(self, *w, *group)?;
                    }
                }
                Op::Linear {
                    x, w, bias, out, ..
                } => {
                    view(self, x)?;
                    view(self, out)?;
                    weight(self, *w, out.width * x.width)?;
                    if let Some(b) = bias {
                        weight(self, *b, out.width)?;
                    }
                }
                Op::Mul { gate, x, out, .. } => {
                    view(self, gate)?;
                    view(self, x)?;
                    view(self, out)?;
                    if gate.width != 1 {
                        same(gate, x)?;
                    }
                    same(x, out)?;
                }
                Op::Moe {
                    x,
                    router,
                    bias,
                    up,
                    down,
                    out,
                    tmp,
                    route,
                    inter,
                    act,
                } => {
                    view(self, x)?;
                    view(self, out)?;
                    view(self, tmp)?;
                    if tmp.width < route.top_k * (inter + out.width + 4) + 2 * route.experts {
                        return Err(backend_err(name, "moe scratch too narrow"));
                    }
                    same(x, out)?;
                    let (e, h) = (route.experts, x.width);
                    if route.top_k == 0 || route.top_k > e || route.groups == 0 {
                        return Err(backend_err(name, "inconsistent routing"));
                    }
                    weight(self, *router, e * h)?;
                    if let Some(b) = bias {
                        weight(self, *b, e)?;
                    }
                    weight(self, *up, e * act.up_rows() * inter * h)?;
                    weight(self, *down, e * h * inter)?;
                }
                Op::Unary { x, out, .. } => {
                    view(self, x)?;
                    view(self, out)?;
                    same(x, out)?;
                }
                Op::SplitHeads { x, heads, outs } => {
                    view(self, x)?;
                    let mut total = 0;
                    for o in outs {
                        view(self, o)?;
                        divides("split part", *heads, o.width)?;
                        total += o.width;
                    }
                    if total != x.width {
                        return Err(backend_err(
                            name,
                            format!("parts sum to {total} columns, input has {}", x.width),
                        ));
                    }
                }
                Op::Rope {
                    x,
                    heads,
                    head_dim,
                    rotary_dims,
                    ..
                } => {
                    view(self, x)?;
                    if heads * head_dim != x.width || rotary_dims > head_dim || rotary_dims % 2 != 0
                    {
                        return Err(backend_err(name, "rope dims do not fit the view"));
                    }
                }
                Op::Attention {
                    q,
                    k,
                    v,
                    cache_k,
                    cache_v,
                    out,
                    q_heads,
                    kv_heads,
                    head_dim,
                    ..
                } => {
                    for x in [q, k, v, out] {
                        view(self, x)?;
                    }
                    divides("q_heads / kv_heads", *kv_heads, *q_heads)?;
                    if q.width != q_heads * head_dim
                        || out.width != q.width
                        || k.width != kv_heads * head_dim
                        || v.width != k.width
                    {
                        return Err(backend_err(name, "head counts do not match the views"));
                    }
                    state(self, *cache_k, max_seq * k.width)?;
                    state(self, *cache_v, max_seq * k.width)?;
                }
                Op::StoreLastRow { x, state: st } => {
                    view(self, x)?;
                    state(self, *st, x.width)?;
                }
                Op::LoadState { state: st, out } => {
                    view(self, out)?;
                    state(self, *st, out.width)?;
                }
                Op::CausalConv1d {
                    x,
                    weight: w,
                    bias,
                    state: st,
                    out,
                    kernel,
                    ..
                } => {
                    view(self, x)?;
                    view(self, out)?;
                    same(x, out)?;
                    if *kernel < 2 {
                        return Err(backend_err(name, "kernel must be at least 2"));
                    }
                    weight(self, *w, x.width * kernel)?;
                    if let Some(b) = bias {
                        weight(self, *b, x.width)?;
                    }
                    state(self, *st, (kernel - 1) * x.width)?;
                }
                Op::GatedDeltaNet {
                    qkv,
                    a,
                    b,
                    a_log,
                    dt_bias,
                    state: st,
                    out,
                    key_heads,
                    value_heads,
                    key_dim,
                    value_dim,
                } => {
                    for x in [qkv, a, b, out] {
                        view(self, x)?;
                    }
                    divides("value_heads / key_heads", *key_heads, *value_heads)?;
                    if qkv.width != 2 * key_heads * key_dim + value_heads * value_dim
                        || a.width != *value_heads
                        || b.width != *value_heads
                        || out.width != value_heads * value_dim
                    {
                        return Err(backend_err(name, "head counts do not match the views"));
                    }
                    weight(self, *a_log, *value_heads)?;
                    weight(self, *dt_bias, *value_heads)?;
                    state(self, *st, value_heads * key_dim * value_dim)?;
                    let d = ops::GdnDims {
                        key_heads: *key_heads,
                        value_heads: *value_heads,
                        key_dim: *key_dim,
                        value_dim: *value_dim,
                    };
                    self.tmp_len = self.tmp_len.max(d.tmp_len());
                }
                Op::GatedRmsNorm {
                    x,
                    gate,
                    weight: w,
                    shared_weight,
                    out,
                    group,
                    ..
                } => {
                    view(self, x)?;
                    view(self, gate)?;
                    view(self, out)?;
                    same(x, gate)?;
                    same(x, out)?;
                    divides("norm group", *group, x.width)?;
                    weight(self, *w, if *shared_weight { *group } else { x.width })?;
                    self.tmp_len = self.tmp_len.max(*group);
                }
                Op::Mamba2Scan {
                    xbc,
                    dt,
                    a_log,
                    d,
                    dt_bias,
                    state: st,
                    out,
                    heads,
                    head_dim,
                    groups,
                    state_size,
                    ..
                } => {
                    for x in [xbc, dt, out] {
                        view(self, x)?;
                    }
                    divides("heads / groups", *groups, *heads)?;
                    if xbc.width != heads * head_dim + 2 * groups * state_size
                        || dt.width != *heads
                        || out.width != heads * head_dim
                    {
                        return Err(backend_err(name, "head counts do not match the views"));
                    }
                    for w in [a_log, d, dt_bias] {
                        weight(self, *w, *heads)?;
                    }
                    state(self, *st, heads * head_dim * state_size)?;
                }
            }
        }
        Ok(())
    }
}
