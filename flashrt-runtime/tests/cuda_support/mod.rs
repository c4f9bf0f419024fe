//! Shared helpers of the CUDA tests (`tests/cuda_*.rs`): device discovery that skips cleanly,
//! a single-op harness that runs the same hand-built plan on the CPU reference and on the GPU,
//! and tolerant comparison.
//!
//! # The op harness
//!
//! [`OpCase`] builds a tiny closed layout around ONE op under test:
//!
//! ```text
//! Embed(table -> scratch.in)   random rows, so every input view is seeded random data
//! <the op>                     reads column windows of scratch.in / state, writes scratch.out
//! Linear(scratch.out -> io.logits, identity weight)
//! ```
//!
//! The identity `Linear` copies the op's output into the f32 logits exactly on both backends
//! (one non-zero product per output, accumulated in f32), so `logits()` reads the op's result;
//! state regions are read with `read_region`. Each case runs a sequence of steps (a full
//! prefill chunk, a partial one, then single decode steps) so that stateful ops are checked
//! across chunk boundaries and at positions other than 0, and with bucket padding rows.
//!
//! All random weights and table rows are rounded to bf16 before either backend sees them, so
//! with a bf16 GPU target both sides start from identical values and the comparison measures
//! only the kernels' arithmetic and output rounding.
#![allow(dead_code)]

use flashrt_runtime::CpuBackend;
use flashrt_runtime::backend::cuda::{CudaBackend, CudaOptions};
use flashrt_runtime::backend::{Backend, DeviceSession, HostWeights};
use flashrt_runtime::ir::{
    ALIGN, Arena, Buffer, BufferId, Compiled, DType, F64, IoIds, Layout, ModelIr, NormIr,
    NormWeight, Op, Phase, Plan, Role, StateKind, Target, View, WeightNaming,
};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// The CUDA backend, or `None` after printing why the test is skipped.
pub fn cuda(test: &str) -> Option<Arc<CudaBackend>> {
    cuda_with(test, CudaOptions::default())
}

pub fn cuda_with(test: &str, options: CudaOptions) -> Option<Arc<CudaBackend>> {
    if !CudaBackend::available() {
        // Straight to the process's stderr (not `eprintln!`, which the test harness captures),
        // so a plain `cargo test` shows which GPU tests were skipped.
        let _ = writeln!(
            std::io::stderr(),
            "SKIP {test}: no CUDA device/driver/cuBLASLt available (CudaBackend::available() is false)"
        );
        return None;
    }
    match CudaBackend::with_options(0, options) {
        Ok(b) => Some(Arc::new(b)),
        Err(e) => panic!("{test}: CUDA looks available but the backend failed to start: {e}"),
    }
}

/// The CUDA backend with small phases' 16-bit matmuls on the tensor cores (`gemv16m`,
/// opt-in), or `None` as [`cuda_with`].
pub fn cuda_gemv16m(test: &str) -> Option<Arc<CudaBackend>> {
    cuda_with(
        &format!("{test} (gemv16m)"),
        CudaOptions {
            gemv16_mma: true,
            ..CudaOptions::default()
        },
    )
}

/// The CUDA backend with small phases' 16-bit matmuls on the tensor cores in the CUDA-core
/// kernel's blocks (`gemv16s`, opt-in), or `None` as [`cuda_with`].
pub fn cuda_gemv16s(test: &str) -> Option<Arc<CudaBackend>> {
    cuda_with(
        &format!("{test} (gemv16s)"),
        CudaOptions {
            gemv16_smem: true,
            ..CudaOptions::default()
        },
    )
}

pub fn cpu() -> Arc<dyn Backend> {
    Arc::new(CpuBackend::with_threads(4))
}

/// The reference fixtures: `$FLASHRT_FIXTURES` if set, else the repository's `tests/fixtures`.
/// `None` when absent (the GPU machine gets a copy from `scripts/gpu-check.sh`).
pub fn fixtures_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("FLASHRT_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures"),
    };
    dir.join("README.md").is_file().then_some(dir)
}

// ---- models ----------------------------------------------------------------------------

/// A Qwen3.5-style hybrid at realistic head sizes (head_dim 256, GDN key/value dim 128,
/// partial RoPE, output gate, (1+w) norms), small in width and depth.
pub const QWEN_LIKE: &str = r#"{
  "model_type": "qwen3_5_text",
  "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000,
  "num_hidden_layers": 4,
  "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
  "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "hidden_act": "silu", "dtype": "bfloat16"
}"#;

/// [`QWEN_LIKE`] with one MTP layer.
pub fn qwen_like_mtp() -> String {
    let json = QWEN_LIKE.replace(
        "\"num_hidden_layers\": 4,",
        "\"num_hidden_layers\": 4, \"mtp_num_hidden_layers\": 1,",
    );
    assert_ne!(json, QWEN_LIKE, "the MTP key was inserted");
    json
}

/// [`QWEN_LIKE`] with attention as its first layer: that layer's key cache starts the state
/// arena (offset 0 in a batched step's per-row arenas).
pub fn qwen_like_attention_first() -> String {
    let json = QWEN_LIKE.replace(
        r#""layer_types": ["linear_attention","#,
        r#""layer_types": ["full_attention","#,
    );
    assert_ne!(json, QWEN_LIKE, "the first layer type was replaced");
    json
}

// ---- random data ------------------------------------------------------------------------

/// SplitMix64: small, seeded, reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi), rounded to bf16.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        bf16(lo + (hi - lo) * u)
    }
    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    pub fn below(&mut self, n: usize) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

pub fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Every weight of `w` rounded to bf16 (so a bf16 GPU and the f32 CPU see the same values).
pub fn round_weights(w: HostWeights) -> HostWeights {
    HostWeights {
        tensors: w
            .tensors
            .into_iter()
            .map(|t| t.map(|v| v.into_iter().map(bf16).collect()))
            .collect(),
    }
}

// ---- comparison -------------------------------------------------------------------------

/// Element-wise tolerance `|got - want| <= atol + rtol * |want|`.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub atol: f32,
    pub rtol: f32,
}

/// GPU f32 target vs CPU f32: the same arithmetic up to summation order (warp trees vs the
/// CPU's 8-lane order, online vs two-pass softmax) and libm vs CUDA transcendental ulps; over
/// the ~60 recurrent steps of a case that stays well below 1e-4 for O(1) values.
pub const TOL_F32: Tol = Tol {
    atol: 2e-4,
    rtol: 2e-4,
};

/// GPU bf16 target vs CPU f32 on identical bf16-rounded inputs: every op rounds its output to
/// bf16 (half an ulp = 2^-9 ≈ 0.002 relative) and a Linear with bias rounds twice (GEMM result,
/// then + bias); inside an op everything is f32 on both sides. rtol = 2 ulps (2^-7 ≈ 0.0078),
/// atol 1e-2 for values that cancel to near zero after a rounded intermediate of O(1).
pub const TOL_BF16: Tol = Tol {
    atol: 1e-2,
    rtol: 8e-3,
};

pub fn tol_for(d: DType) -> Tol {
    match d {
        DType::F32 => TOL_F32,
        _ => TOL_BF16,
    }
}

/// Panics with the worst elements if any element is out of tolerance (NaN never passes).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tol) {
    assert_eq!(
        got.len(),
        want.len(),
        "{what}: length {} vs {}",
        got.len(),
        want.len()
    );
    let mut bad = Vec::new();
    let mut worst = 0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let lim = tol.atol + tol.rtol * w.abs();
        // NaN fails: `err <= lim` is false for NaN.
        if err.is_nan() || err > lim {
            bad.push((i, g, w, err));
        }
        if err.is_finite() {
            worst = worst.max(err / lim);
        }
    }
    if !bad.is_empty() {
        bad.sort_by(|a, b| b.3.partial_cmp(&a.3).unwrap_or(std::cmp::Ordering::Equal));
        let show: Vec<String> = bad
            .iter()
            .take(8)
            .map(|(i, g, w, e)| format!("[{i}] got {g} want {w} (err {e:.3e})"))
            .collect();
        panic!(
            "{what}: {} of {} elements out of tolerance (atol {}, rtol {}):\n  {}",
            bad.len(),
            got.len(),
            tol.atol,
            tol.rtol,
            show.join("\n  ")
        );
    }
    println!(
        "  {what}: {} elements ok (worst {:.2} of tolerance)",
        got.len(),
        worst
    );
}

/// `max|got - want| / max|want|`.
pub fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let mut d = 0f64;
    let mut m = 0f64;
    for (&g, &w) in got.iter().zip(want) {
        d = d.max((g as f64 - w as f64).abs());
        m = m.max((w as f64).abs());
    }
    if !d.is_finite() || got.iter().any(|v| v.is_nan()) {
        return f64::INFINITY;
    }
    if m == 0.0 { d } else { d / m }
}

/// Bytes of a state region as f32 values.
pub fn decode(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::I32 => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
        DType::F8E4m3 => bytes
            .iter()
            .map(|&b| flashrt_runtime::quant::e4m3_to_f32(b))
            .collect(),
    }
}

// ---- the single-op harness ----------------------------------------------------------------

/// Builds the layout and plan of one op case for one target dtype.
pub struct OpBuilder {
    target: DType,
    bucket: usize,
    max_seq: usize,
    buffers: Vec<Buffer>,
    cursor: [usize; 4],
    data: Vec<Option<Vec<f32>>>,
    ops: Vec<Op>,
    in_width: usize,
    out_width: usize,
    pub rng: Rng,
    io: Option<IoIds>,
    table: Option<BufferId>,
    eye: Option<BufferId>,
    input: Option<BufferId>,
    output: Option<BufferId>,
    /// State regions, for read-back.
    pub states: Vec<BufferId>,
}

fn role_index(r: Role) -> usize {
    match r {
        Role::Weight => 0,
        Role::State => 1,
        Role::Scratch => 2,
        Role::Io => 3,
    }
}

impl OpBuilder {
    fn new(
        target: DType,
        bucket: usize,
        max_seq: usize,
        in_width: usize,
        out_width: usize,
        seed: u64,
    ) -> Self {
        let mut b = OpBuilder {
            target,
            bucket,
            max_seq,
            buffers: Vec::new(),
            cursor: [0; 4],
            data: Vec::new(),
            ops: Vec::new(),
            in_width,
            out_width,
            rng: Rng::new(seed),
            io: None,
            table: None,
            eye: None,
            input: None,
            output: None,
            states: Vec::new(),
        };
        let vocab = b.vocab();
        let tokens = b.push("io.tokens", Role::Io, DType::I32, vec![bucket], None, None);
        let logits = b.push(
            "io.logits",
            Role::Io,
            DType::F32,
            vec![bucket, vocab],
            None,
            None,
        );
        let pos = b.push("io.pos", Role::Io, DType::I32, vec![1], None, None);
        let len = b.push("io.len", Role::Io, DType::I32, vec![1], None, None);
        b.io = Some(IoIds {
            tokens,
            logits,
            pos,
            len,
        });
        let table = b.rng.vec(vocab * in_width, -1.0, 1.0);
        b.table = Some(b.push(
            "table",
            Role::Weight,
            target,
            vec![vocab, in_width],
            None,
            Some(table),
        ));
        let mut eye = vec![0f32; out_width * out_width];
        for i in 0..out_width {
            eye[i * out_width + i] = 1.0;
        }
        b.eye = Some(b.push(
            "eye",
            Role::Weight,
            target,
            vec![out_width, out_width],
            None,
            Some(eye),
        ));
        b.input = Some(b.push(
            "scratch.in",
            Role::Scratch,
            target,
            vec![bucket, in_width],
            None,
            None,
        ));
        b.output = Some(b.push(
            "scratch.out",
            Role::Scratch,
            target,
            vec![bucket, out_width],
            None,
            None,
        ));
        b
    }

    /// Table rows = logits columns: enough for the output and a spread of token ids.
    fn vocab(&self) -> usize {
        self.out_width.max(97)
    }

    fn push(
        &mut self,
        name: &str,
        role: Role,
        dtype: DType,
        shape: Vec<usize>,
        state: Option<StateKind>,
        data: Option<Vec<f32>>,
    ) -> BufferId {
        let id = BufferId(self.buffers.len() as u32);
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let cur = &mut self.cursor[role_index(role)];
        let offset = *cur;
        *cur = (offset + bytes).div_ceil(ALIGN) * ALIGN;
        self.buffers.push(Buffer {
            id,
            name: name.to_string(),
            role,
            dtype,
            shape,
            offset,
            bytes,
            layer: None,
            state,
            source: None,
            pieces: None,
            quant: None,
        });
        self.data.push(data);
        id
    }

    pub fn target(&self) -> DType {
        self.target
    }

    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// Columns `col .. col + width` of the random input.
    pub fn input(&self, col: usize, width: usize) -> View {
        assert!(
            col + width <= self.in_width,
            "input window {col}+{width} > {}",
            self.in_width
        );
        View {
            buf: self.input.unwrap(),
            col,
            width,
            stride: self.in_width,
        }
    }

    /// Columns `col .. col + width` of the output that is read back.
    pub fn output(&self, col: usize, width: usize) -> View {
        assert!(
            col + width <= self.out_width,
            "output window {col}+{width} > {}",
            self.out_width
        );
        View {
            buf: self.output.unwrap(),
            col,
            width,
            stride: self.out_width,
        }
    }

    /// A weight matrix in the target dtype, uniform in ±scale.
    pub fn weight(&mut self, name: &str, shape: &[usize], scale: f32) -> BufferId {
        let n = shape.iter().product();
        let v = self.rng.vec(n, -scale, scale);
        self.push(
            name,
            Role::Weight,
            self.target,
            shape.to_vec(),
            None,
            Some(v),
        )
    }

    /// A block-quantized weight matrix `[n, k]` (values uniform in ±scale, quantized by the
    /// reference rule when they load: FP8 codes + scales on a bf16/f16 GPU, their exact
    /// values on the CPU and on an f32 GPU).
    pub fn weight_fp8(
        &mut self,
        name: &str,
        shape: &[usize],
        scale: f32,
        block: [usize; 2],
    ) -> BufferId {
        let (n, k) = (shape[0], shape[1]);
        let v = self.rng.vec(n * k, -scale, scale);
        let dtype = if self.target == DType::F32 {
            DType::F32
        } else {
            DType::F8E4m3
        };
        let w = self.push(name, Role::Weight, dtype, shape.to_vec(), None, Some(v));
        let q = flashrt_runtime::ir::WeightQuant {
            scale: BufferId(0),
            block,
            segment: n,
            cols: k,
        };
        let s = self.push(
            &format!("{name}.scale"),
            Role::Weight,
            DType::F32,
            vec![q.block_rows(), q.block_cols()],
            None,
            None,
        );
        self.buffers[w.index()].quant = Some(flashrt_runtime::ir::WeightQuant { scale: s, ..q });
        w
    }

    /// A small 1-D f32 parameter with the given values rounded to bf16 (exact in every target).
    pub fn param(&mut self, name: &str, values: Vec<f32>) -> BufferId {
        let n = values.len();
        self.param_f32(name, &[n], values.into_iter().map(bf16).collect())
    }

    /// An f32 parameter of any shape with the given values (not rounded).
    pub fn param_f32(&mut self, name: &str, shape: &[usize], values: Vec<f32>) -> BufferId {
        assert_eq!(values.len(), shape.iter().product::<usize>(), "{name}");
        self.push(
            name,
            Role::Weight,
            DType::F32,
            shape.to_vec(),
            None,
            Some(values),
        )
    }

    /// A state region (recurrent: f32; others: the target dtype).
    pub fn state(&mut self, name: &str, shape: &[usize], kind: StateKind) -> BufferId {
        let dtype = if kind == StateKind::Recurrent {
            DType::F32
        } else {
            self.target
        };
        let id = self.push(name, Role::State, dtype, shape.to_vec(), Some(kind), None);
        self.states.push(id);
        id
    }

    pub fn op(&mut self, op: Op) {
        self.ops.push(op);
    }

    fn finish(mut self) -> (Compiled, HostWeights, Vec<BufferId>) {
        let io = self.io.unwrap();
        let vocab = self.vocab();
        let mut ops = vec![Op::Embed {
            table: self.table.unwrap(),
            out: self.input(0, self.in_width),
        }];
        ops.append(&mut self.ops);
        ops.push(Op::Linear {
            x: self.output(0, self.out_width),
            w: self.eye.unwrap(),
            bias: None,
            out: View {
                buf: io.logits,
                col: 0,
                width: self.out_width,
                stride: vocab,
            },
            accumulate: false,
        });
        let arenas = Role::ALL
            .iter()
            .map(|&role| Arena {
                role,
                bytes: self.cursor[role_index(role)],
            })
            .collect();
        let name = "op_case".to_string();
        let layout = Layout {
            model: name.clone(),
            target: Target { dtype: self.target },
            max_rows: self.bucket,
            max_seq: self.max_seq,
            buffers: self.buffers,
            arenas,
            fingerprint: format!("op-case-{}", self.target.name()),
        };
        let ir = ModelIr {
            name,
            vocab,
            hidden: self.in_width,
            dtype: self.target,
            max_seq: self.max_seq,
            prefill_buckets: vec![self.bucket],
            norm: NormIr {
                eps: F64(1e-6),
                weight: NormWeight::Plain,
            },
            tied_embeddings: false,
            layers: Vec::new(),
            mtp: None,
            weights: WeightNaming::Qwen35,
            quant: None,
            decode_batches: Vec::new(),
        };
        let plans = vec![
            Plan {
                phase: Phase::Prefill {
                    bucket: self.bucket,
                },
                ops: ops.clone(),
            },
            Plan {
                phase: Phase::Decode,
                ops,
            },
        ];
        let compiled = Compiled {
            ir,
            layout,
            io,
            plans,
        };
        (compiled, HostWeights { tensors: self.data }, self.states)
    }
}

/// One step of a case: `len` tokens at the running position (decode plan when `len == 1`).
pub fn default_steps(bucket: usize) -> Vec<usize> {
    let mut s = vec![bucket];
    if bucket > 2 {
        s.push(bucket - 2);
    }
    s.extend([1, 1, 1]);
    s
}

/// One single-op case.
pub struct OpCase {
    pub name: String,
    pub bucket: usize,
    pub max_seq: usize,
    pub in_width: usize,
    pub out_width: usize,
    pub steps: Vec<usize>,
    pub seed: u64,
    /// The bf16 tolerance, where the case's arithmetic differs from the reference by more
    /// than rounding (FP8 activations).
    pub tol: Option<Tol>,
}

impl OpCase {
    pub fn new(name: &str, bucket: usize, in_width: usize, out_width: usize) -> Self {
        OpCase {
            name: name.to_string(),
            bucket,
            max_seq: 4 * bucket + 16,
            in_width,
            out_width,
            steps: default_steps(bucket),
            seed: 0x5eed ^ (in_width as u64) << 20 ^ (out_width as u64) << 8 ^ bucket as u64,
            tol: None,
        }
    }

    /// Run the case built by `build` on the CPU (f32) and on `gpu` with target `dtype`;
    /// compare the op's output after every step and every state region at the end.
    pub fn check(&self, gpu: &Arc<CudaBackend>, dtype: DType, build: impl Fn(&mut OpBuilder)) {
        println!(
            "case {} [{}] bucket {} steps {:?}",
            self.name,
            dtype.name(),
            self.bucket,
            self.steps
        );
        let make = |d: DType| {
            let mut b = OpBuilder::new(
                d,
                self.bucket,
                self.max_seq,
                self.in_width,
                self.out_width,
                self.seed,
            );
            build(&mut b);
            b.finish()
        };
        let (c_cpu, w_cpu, states) = make(DType::F32);
        let (c_gpu, w_gpu, _) = make(dtype);
        let cpu_model = cpu()
            .load(Arc::new(c_cpu), w_cpu)
            .unwrap_or_else(|e| panic!("{}: CPU load: {e}", self.name));
        let gpu_model = gpu
            .load(Arc::new(c_gpu.clone()), w_gpu)
            .unwrap_or_else(|e| panic!("{}: GPU load: {e}", self.name));
        let mut cs = cpu_model.new_session().expect("cpu session");
        let mut gs = gpu_model
            .new_session()
            .unwrap_or_else(|e| panic!("{}: GPU session: {e}", self.name));
        let vocab = c_gpu.ir.vocab;
        let tol = match (dtype, self.tol) {
            (DType::F32, _) | (_, None) => tol_for(dtype),
            (_, Some(t)) => t,
        };
        let mut rng = Rng::new(self.seed ^ 0x70c5);
        let mut pos = 0;
        for (si, &len) in self.steps.iter().enumerate() {
            let tokens: Vec<u32> = (0..len).map(|_| rng.below(vocab)).collect();
            let phase = if len == 1 {
                Phase::Decode
            } else {
                Phase::Prefill {
                    bucket: self.bucket,
                }
            };
            cs.step(phase, &tokens, pos)
                .unwrap_or_else(|e| panic!("{} step {si}: CPU: {e}", self.name));
            gs.step(phase, &tokens, pos)
                .unwrap_or_else(|e| panic!("{} step {si}: GPU: {e}", self.name));
            let want = take_cols(&cs.logits(len).expect("cpu logits"), vocab, self.out_width);
            let got = take_cols(
                &gs.logits(len)
                    .unwrap_or_else(|e| panic!("{} step {si}: GPU logits: {e}", self.name)),
                vocab,
                self.out_width,
            );
            assert_close(
                &format!(
                    "{} [{}] step {si} (pos {pos}, len {len}) output",
                    self.name,
                    dtype.name()
                ),
                &got,
                &want,
                tol,
            );
            pos += len;
        }
        for id in states {
            let bc = c_gpu.layout.buffer(id);
            let want = decode(&cs.read_region(id, pos).expect("cpu region"), DType::F32);
            let got = decode(&gs.read_region(id, pos).expect("gpu region"), bc.dtype);
            assert_close(
                &format!("{} [{}] state `{}`", self.name, dtype.name(), bc.name),
                &got,
                &want,
                tol,
            );
        }
    }
}

fn take_cols(rows: &[f32], stride: usize, width: usize) -> Vec<f32> {
    rows.chunks_exact(stride)
        .flat_map(|r| r[..width].iter().copied())
        .collect()
}

/// Run `f` for each dtype the GPU computes in (f32: kernel logic; bf16: the fast path).
pub const DTYPES: [DType; 2] = [DType::F32, DType::Bf16];

/// For cases that step a session directly.
pub fn step(s: &mut dyn DeviceSession, bucket: usize, tokens: &[u32], pos: usize) {
    let phase = if tokens.len() == 1 {
        Phase::Decode
    } else {
        Phase::Prefill { bucket }
    };
    s.step(phase, tokens, pos).expect("step");
}
