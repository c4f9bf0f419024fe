//! MLP lowering: dense gated MLPs and MoE blocks (routed experts plus an optional shared expert).

use super::*;

impl Lower<'_> {
    pub(super) fn mlp(&mut self, i: usize, mlp: &MlpIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let inter = mlp.intermediate();
        let naming = self.ir.weights;
        match mlp {
            MlpIr::Moe(m) => self.moe(i, m, hn, x, ops),
            MlpIr::Swiglu { .. } => {
                let (gate_n, up_n, down_n) = match naming {
                    WeightNaming::Lfm2 => ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2"),
                    WeightNaming::NemotronH => {
                        ("mixer.gate_proj", "mixer.up_proj", "mixer.down_proj")
                    }
                    WeightNaming::Qwen35 => ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
                };
                // Gate and up side by side in one scratch where rows stay aligned (one
                // prefill matmul for both on the CUDA backend).
                let (g, u) = match self.scratch_cols("mlp_gu", &[inter, inter]).as_deref() {
                    Some(&[g, u]) => (g, u),
                    _ => (
                        self.scratch("mlp_gate", inter),
                        self.scratch("mlp_up", inter),
                    ),
                };
                self.linear(i, "mlp.gate_proj", gate_n, hn, g, false, ops, false);
                self.linear(i, "mlp.up_proj", up_n, hn, u, false, ops, false);
                ops.push(Op::Mul {
                    gate: g,
                    act: Act::Silu,
                    x: u,
                    out: u,
                });
                self.linear(i, "mlp.down_proj", down_n, u, x, false, ops, true);
            }
            MlpIr::Relu2 { .. } => {
                let (up_n, down_n) = match naming {
                    WeightNaming::NemotronH => ("mixer.up_proj", "mixer.down_proj"),
                    _ => ("mlp.up_proj", "mlp.down_proj"),
                };
                let u = self.scratch("mlp_up", inter);
                self.linear(i, "mlp.up_proj", up_n, hn, u, false, ops, false);
                ops.push(Op::Unary {
                    x: u,
                    act: Act::Relu2,
                    out: u,
                });
                self.linear(i, "mlp.down_proj", down_n, u, x, false, ops, true);
            }
        }
    }
}

/// Checkpoint names of an MoE block's tensors, per family.
struct MoeNames {
    /// Prefix of the block inside its layer (`mlp`, `feed_forward`, `mixer`).
    block: &'static str,
    bias: &'static str,
    /// Fused 3-D tensors (released checkpoints, transformers' in-memory form).
    fused_up: &'static str,
    /// Per-expert projections that stack into `up`, in order (gate before up).
    expert_up: &'static [&'static str],
    expert_down: &'static str,
    shared: &'static str,
}

fn moe_names(naming: WeightNaming) -> MoeNames {
    match naming {
        WeightNaming::Qwen35 => MoeNames {
            block: "mlp",
            bias: "gate.e_score_correction_bias",
            fused_up: "experts.gate_up_proj",
            expert_up: &["gate_proj", "up_proj"],
            expert_down: "down_proj",
            shared: "shared_expert",
        },
        WeightNaming::Lfm2 => MoeNames {
            block: "feed_forward",
            bias: "expert_bias",
            fused_up: "experts.gate_up_proj",
            expert_up: &["w1", "w3"],
            expert_down: "w2",
            shared: "shared_expert",
        },
        WeightNaming::NemotronH => MoeNames {
            block: "mixer",
            bias: "gate.e_score_correction_bias",
            fused_up: "experts.up_proj",
            expert_up: &["up_proj"],
            expert_down: "down_proj",
            shared: "shared_experts",
        },
    }
}

impl Lower<'_> {
    /// An MoE block: the routed experts as one [`Op::Moe`], then the shared expert (if any)
    /// as ordinary ops, both added to the residual `x`. Qwen3.5-MoE's shared-expert token gate
    /// `sigmoid(x · g)` scales the expert's hidden activation before `down` (equal to scaling
    /// its output, `down` being linear).
    pub(super) fn moe(&mut self, i: usize, m: &MoeIr, hn: View, x: View, ops: &mut Vec<Op>) {
        let h = self.ir.hidden;
        let e = m.route.experts;
        let n = moe_names(self.ir.weights);
        let blk = n.block;
        let lname = self.lname(i);
        let router = self.param(
            format!("{lname}.moe.router"),
            vec![e, h],
            Some(i),
            self.hf(i, &format!("{blk}.gate.weight")),
        );
        let bias = m.route.expert_bias.then(|| {
            let src = self.hf(i, &format!("{blk}.{}", n.bias));
            self.param(format!("{lname}.moe.expert_bias"), vec![e], Some(i), src)
        });
        let rows = m.act.up_rows();
        let up_names = (0..e)
            .flat_map(|j| {
                n.expert_up
                    .iter()
                    .map(move |p| format!("{blk}.experts.{j}.{p}.weight"))
            })
            .map(|rest| self.hf(i, &rest))
            .collect();
        // The experts have no FP8 kernels yet: a quantized checkpoint's experts are
        // dequantized to the target dtype while they load.
        let up = self.matrix(
            format!("{lname}.moe.up"),
            vec![e, rows * m.intermediate, h],
            Some(i),
            self.hf(i, &format!("{blk}.{}", n.fused_up)),
            Some(Pieces {
                names: up_names,
                shape: vec![m.intermediate, h],
            }),
            m.intermediate,
            false,
        );
        let down_names = (0..e)
            .map(|j| self.hf(i, &format!("{blk}.experts.{j}.{}.weight", n.expert_down)))
            .collect();
        let down = self.matrix(
            format!("{lname}.moe.down"),
            vec![e, h, m.intermediate],
            Some(i),
            self.hf(i, &format!("{blk}.experts.down_proj")),
            Some(Pieces {
                names: down_names,
                shape: vec![h, m.intermediate],
            }),
            h,
            false,
        );
        let k = m.route.top_k;
        // hidden [k, inter] + y [k, hidden] + ids, weights [k] + router logits [experts] (4-byte
        // values in 2-byte columns: twice as many columns as needed at f32).
        let tmp_width = (k * (m.intermediate + h + 4) + 2 * e).next_multiple_of(8);
        let tmp = self.scratch("moe_tmp", tmp_width);
        ops.push(Op::Moe {
            x: hn,
            router,
            bias,
            up,
            down,
            out: x,
            tmp,
            route: m.route.clone(),
            inter: m.intermediate,
            act: m.act,
        });
        let Some(shared) = &m.shared else {
            return;
        };
        let si = shared.intermediate;
        let sh = n.shared;
        let u = self.scratch("mlp_up", si);
        match m.act {
            ExpertAct::Swiglu => {
                let g = self.scratch("mlp_gate", si);
                let src = format!("{blk}.{sh}.gate_proj");
                self.linear(i, "moe.shared.gate_proj", &src, hn, g, false, ops, false);
                let src = format!("{blk}.{sh}.up_proj");
                self.linear(i, "moe.shared.up_proj", &src, hn, u, false, ops, false);
                ops.push(Op::Mul {
                    gate: g,
                    act: Act::Silu,
                    x: u,
                    out: u,
                });
            }
            ExpertAct::Relu2 => {
                let src = format!("{blk}.{sh}.up_proj");
                self.linear(i, "moe.shared.up_proj", &src, hn, u, false, ops, false);
                ops.push(Op::Unary {
                    x: u,
                    act: Act::Relu2,
                    out: u,
                });
            }
        }
        if shared.gated {
            let t = self.scratch("moe_shared_gate", 1);
            let src = format!("{blk}.{sh}_gate");
            self.linear(i, "moe.shared.token_gate", &src, hn, t, false, ops, false);
            ops.push(Op::Mul {
                gate: t,
                act: Act::Sigmoid,
                x: u,
                out: u,
            });
        }
        let src = format!("{blk}.{sh}.down_proj");
        self.linear(i, "moe.shared.down_proj", &src, u, x, false, ops, true);
    }
}
