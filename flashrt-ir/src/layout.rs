//! The closed buffer layout: every tensor the model touches, in one of four arenas.
//!
//! Buffers are addressed by [`BufferId`] (an index into [`Layout::buffers`]). Offsets are
//! fixed here, aligned to [`ALIGN`] bytes inside their arena, so a backend allocates each
//! arena once and never again. The `State` arena is exactly the set of capsule regions.

use crate::ir::{DType, fnv1a};
use serde::{Deserialize, Serialize};

/// Alignment of every buffer inside its arena, in bytes.
pub const ALIGN: usize = 256;

/// Bumped whenever kernels or op semantics change in a way that makes old state bytes
/// meaningless; part of every fingerprint.
pub const KERNEL_VERSION: u32 = 1;

/// Index of a buffer in [`Layout::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BufferId(pub u32);

impl BufferId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The arena a buffer lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Loaded once from the checkpoint, read-only afterwards.
    Weight,
    /// The restorable execution state: the capsule regions.
    State,
    /// Per-step temporaries; meaningless between steps.
    Scratch,
    /// Inputs and outputs of a step (token ids, logits, position/length scalars).
    Io,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Weight, Role::State, Role::Scratch, Role::Io];
    pub fn name(self) -> &'static str {
        match self {
            Role::Weight => "weight",
            Role::State => "state",
            Role::Scratch => "scratch",
            Role::Io => "io",
        }
    }
}

/// What a state region holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StateKind {
    /// Attention keys, position-major `[max_seq, kv_heads, head_dim]`.
    Key,
    /// Attention values, position-major `[max_seq, kv_heads, head_dim]`.
    Value,
    /// The last `K - 1` inputs of a causal depthwise conv, time-major `[K - 1, channels]`
    /// (oldest first).
    Conv,
    /// Recurrent / SSM state, fp32: Gated DeltaNet `[value_heads, key_dim, value_dim]`,
    /// Mamba2 `[heads, head_dim, state]`.
    Recurrent,
    /// A hidden-state vector carried between steps, `[hidden]` (the MTP head's input: the
    /// target model's final-normed hidden state of the newest token).
    Hidden,
}

impl StateKind {
    /// KV regions grow with the position; the used part is the prefix `[0, pos)`.
    pub fn per_token(self) -> bool {
        matches!(self, StateKind::Key | StateKind::Value)
    }
    pub fn name(self) -> &'static str {
        match self {
            StateKind::Key => "key",
            StateKind::Value => "value",
            StateKind::Conv => "conv",
            StateKind::Recurrent => "recurrent",
            StateKind::Hidden => "hidden",
        }
    }
}

/// One named buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Buffer {
    pub id: BufferId,
    /// Unique, dotted: `layers.3.attn.q_proj`, `layers.0.recurrent`, `scratch.x`, `io.logits`.
    pub name: String,
    pub role: Role,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte offset inside the arena of `role`.
    pub offset: usize,
    /// `numel * dtype.size()`.
    pub bytes: usize,
    /// Decoder layer this buffer belongs to (MTP layers count after the main stack).
    pub layer: Option<usize>,
    /// For `Role::State`: what the region holds.
    pub state: Option<StateKind>,
    /// For `Role::Weight`: the checkpoint tensor it is loaded from (Hugging Face name).
    pub source: Option<String>,
    /// For a weight stacked from several checkpoint tensors (the routed experts of an MoE
    /// block, stored one 2-D tensor per expert and projection by `save_pretrained`): the
    /// pieces that fill it in order, used when `source` (the fused 3-D tensor the released
    /// checkpoints hold) is absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pieces: Option<Pieces>,
    /// For a block-quantized weight: its scale buffer and block grid (see [`WeightQuant`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<WeightQuant>,
}

/// How a block-quantized weight is stored ([`crate::ir::QuantIr`]).
///
/// The weight is a matrix of `rows = numel / cols` rows and `cols` columns (a stacked
/// `[experts, r, c]` weight is `experts * r` rows), cut into segments of `segment` rows (the
/// checkpoint's pieces: one per plain matrix, one per expert and projection of a stacked one),
/// each segment into blocks of `block = [rows, cols]` with the ragged ones at its bottom and
/// right edges. Block `(b, c)` of segment `g` has the scale at row
/// `g * ceil(segment / block[0]) + b`, column `c` of `scale`, an f32 `[segments *
/// ceil(segment / block[0]), ceil(cols / block[1])]` weight buffer filled from the
/// checkpoint's `weight_scale_inv` tensors (or computed when the weight is quantized while it
/// loads). A weight of dtype `f8_e4m3` holds the quantized elements `q` and its value is
/// `q * scale`; a weight of another dtype holds that value (dequantized when it loads: the
/// CPU reference in f32, exactly).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightQuant {
    pub scale: BufferId,
    pub block: [usize; 2],
    pub segment: usize,
    pub cols: usize,
}

impl WeightQuant {
    /// Scale rows per segment.
    pub fn block_rows(&self) -> usize {
        self.segment.div_ceil(self.block[0])
    }
    /// Scale columns.
    pub fn block_cols(&self) -> usize {
        self.cols.div_ceil(self.block[1])
    }
    /// The scale index of element `(row, col)` of the weight.
    pub fn scale_index(&self, row: usize, col: usize) -> usize {
        let srow = (row / self.segment) * self.block_rows() + (row % self.segment) / self.block[0];
        srow * self.block_cols() + col / self.block[1]
    }
}

/// Checkpoint tensors that, laid end to end, fill one weight buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pieces {
    pub names: Vec<String>,
    /// Shape of every piece (`numel * names.len()` is the buffer's numel).
    pub shape: Vec<usize>,
}

impl Buffer {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes of one position of a per-token (KV) region, else 0.
    pub fn bytes_per_token(&self) -> usize {
        match self.state {
            Some(k) if k.per_token() => self.bytes / self.shape[0],
            _ => 0,
        }
    }
    /// Bytes of the first `rows` positions of a per-position (KV) region; 0 for any other
    /// region (a restore may skip rows a session holds already, never part of a non-KV one).
    pub fn rows_bytes(&self, rows: usize) -> usize {
        match self.state {
            Some(k) if k.per_token() => self.bytes_per_token() * rows.min(self.shape[0]),
            _ => 0,
        }
    }
    /// Bytes of this region a capsule must hold at position `pos`.
    pub fn used_bytes(&self, pos: usize) -> usize {
        match self.state {
            Some(k) if k.per_token() => self.rows_bytes(pos),
            _ => self.bytes,
        }
    }
    /// The capsule field name (`layers.3.key` -> `layers_3_key`).
    pub fn field_name(&self) -> String {
        self.name.replace('.', "_")
    }
}

/// Size of one arena.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Arena {
    pub role: Role,
    pub bytes: usize,
}

/// What the layout is built for: the dtype of weights, activations, KV and conv state
/// (recurrent state is always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Target {
    pub dtype: DType,
}

/// The closed set of buffers of one model on one target.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    pub model: String,
    pub target: Target,
    /// Rows of the largest step (the largest prefill bucket); scratch and I/O are sized by it.
    pub max_rows: usize,
    pub max_seq: usize,
    pub buffers: Vec<Buffer>,
    pub arenas: Vec<Arena>,
    /// Hex FNV-1a of (IR, layout, kernel version, target): names the layout.
    pub fingerprint: String,
}

impl Layout {
    pub fn buffer(&self, id: BufferId) -> &Buffer {
        &self.buffers[id.index()]
    }
    pub fn find(&self, name: &str) -> Option<&Buffer> {
        self.buffers.iter().find(|b| b.name == name)
    }
    pub fn id(&self, name: &str) -> Option<BufferId> {
        self.find(name).map(|b| b.id)
    }
    pub fn arena_bytes(&self, role: Role) -> usize {
        self.arenas
            .iter()
            .find(|a| a.role == role)
            .map_or(0, |a| a.bytes)
    }
    /// The capsule regions, in layout order.
    pub fn state_buffers(&self) -> impl Iterator<Item = &Buffer> {
        self.buffers.iter().filter(|b| b.role == Role::State)
    }
    /// Capsule size = `capsule_fixed_bytes() + pos * capsule_bytes_per_token()` (state
    /// regions only; metadata is a few hundred bytes on top).
    pub fn capsule_fixed_bytes(&self) -> usize {
        self.state_buffers()
            .filter(|b| !b.state.is_some_and(|k| k.per_token()))
            .map(|b| b.bytes)
            .sum()
    }
    pub fn capsule_bytes_per_token(&self) -> usize {
        self.state_buffers().map(|b| b.bytes_per_token()).sum()
    }
    pub fn capsule_bytes(&self, pos: usize) -> usize {
        self.state_buffers().map(|b| b.used_bytes(pos)).sum()
    }
}

/// Builds a layout buffer by buffer; offsets are assigned per arena in insertion order.
#[derive(Default)]
pub(crate) struct LayoutBuilder {
    pub buffers: Vec<Buffer>,
    cursor: [usize; 4],
}

fn role_index(r: Role) -> usize {
    match r {
        Role::Weight => 0,
        Role::State => 1,
        Role::Scratch => 2,
        Role::Io => 3,
    }
}

impl LayoutBuilder {
    pub fn push(
        &mut self,
        name: String,
        role: Role,
        dtype: DType,
        shape: Vec<usize>,
        layer: Option<usize>,
        state: Option<StateKind>,
        source: Option<String>,
    ) -> BufferId {
        debug_assert!(
            !self.buffers.iter().any(|b| b.name == name),
            "duplicate buffer {name}"
        );
        let id = BufferId(self.buffers.len() as u32);
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let cur = &mut self.cursor[role_index(role)];
        let offset = *cur;
        *cur = (offset + bytes).div_ceil(ALIGN) * ALIGN;
        self.buffers.push(Buffer {
            id,
            name,
            role,
            dtype,
            shape,
            offset,
            bytes,
            layer,
            state,
            source,
            pieces: None,
            quant: None,
        });
        id
    }

    /// Mark weight `id` as block-quantized (see [`Buffer::quant`]).
    pub fn set_quant(&mut self, id: BufferId, quant: WeightQuant) {
        self.buffers[id.index()].quant = Some(quant);
    }

    /// Give weight `id` its per-piece checkpoint names (see [`Buffer::pieces`]).
    pub fn set_pieces(&mut self, id: BufferId, pieces: Pieces) {
        let b = &mut self.buffers[id.index()];
        debug_assert_eq!(
            pieces.shape.iter().product::<usize>() * pieces.names.len(),
            b.numel(),
            "pieces of {} do not fill it",
            b.name
        );
        b.pieces = Some(pieces);
    }

    pub fn finish(
        self,
        model: &str,
        target: Target,
        max_rows: usize,
        max_seq: usize,
        ir_hash: u64,
    ) -> Layout {
        let arenas = Role::ALL
            .iter()
            .map(|&role| Arena {
                role,
                bytes: self.cursor[role_index(role)],
            })
            .collect();
        let mut layout = Layout {
            model: model.to_string(),
            target,
            max_rows,
            max_seq,
            buffers: self.buffers,
            arenas,
            fingerprint: String::new(),
        };
        let body = serde_json::to_string(&layout).expect("layout serialises");
        let mut bytes = body.into_bytes();
        bytes.extend_from_slice(&ir_hash.to_le_bytes());
        bytes.extend_from_slice(&KERNEL_VERSION.to_le_bytes());
        layout.fingerprint = format!("{:016x}", fnv1a(&bytes));
        layout
    }
}
