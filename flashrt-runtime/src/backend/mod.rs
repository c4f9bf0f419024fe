//! Backends: where plans execute and state lives.
//!
//! A backend is three object-safe traits, one per lifetime:
//!
//! * [`Backend`]: a device (CPU, one CUDA GPU). Loads a compiled model's weights once.
//! * [`DeviceModel`]: weights resident on the device; creates sessions.
//! * [`DeviceSession`]: the state, scratch and I/O arenas of one session, allocated once from
//!   the layout at creation and never again; runs plans; saves and restores state regions.
//!
//! Every backend folder (`cpu/`, `cuda/`) uses the same file names so they read side by side.
//! When the crate is built without the `cuda` feature, `cuda_stub.rs` stands in with the same
//! names and reports "not compiled with CUDA", so no model or runtime code needs a `cfg`.
//!
//! Position and length are the plan's device-side scalars (`io.pos`, `io.len`): `step` writes
//! them (and the token ids) into the I/O arena and then runs the plan unchanged.

use crate::error::Result;
use flashrt_ir::{BufferId, Compiled, Phase};
use std::any::Any;
use std::sync::Arc;

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;

/// Host-side weights in layout order: one f32 vector per weight buffer (`None` for non-weight
/// buffers). Backends convert to their dtype at upload time.
pub struct HostWeights {
    pub tensors: Vec<Option<Vec<f32>>>,
}

/// Which state regions a save/restore touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionSet {
    /// Every state region (the capsule contract).
    All,
    /// Only attention K/V regions: the KV-only ablation experiment.
    KvOnly,
}

/// Saved bytes of the state regions at a token boundary, owned by the backend that made
/// them. `Host` copies live in ordinary memory; device copies stay on the device.
pub trait SavedState: Send + Sync + Any {
    /// Where the bytes live ("host", "cuda:0", "pinned").
    fn location(&self) -> &str;
    /// Position the state was saved at (KV regions hold `pos` rows).
    fn pos(&self) -> usize;
    /// Total bytes held.
    fn bytes(&self) -> usize;
    /// Bytes of one region as they would be restored (used part only), copied to the host.
    fn region_bytes(&self, id: BufferId) -> Result<Vec<u8>>;
    fn as_any(&self) -> &dyn Any;
}

/// A device.
pub trait Backend: Send + Sync {
    /// Human-readable device name, e.g. "cpu (f32 reference)" or "cuda:0 NVIDIA H200".
    fn name(&self) -> String;
    /// The layout target this backend computes in (CPU: f32; CUDA: the model dtype).
    fn target(&self, ir: &flashrt_ir::ModelIr) -> flashrt_ir::Target;
    /// Upload weights; the compiled model must have been compiled for `self.target(..)`.
    fn load(&self, compiled: Arc<Compiled>, weights: HostWeights) -> Result<Arc<dyn DeviceModel>>;
}

/// A model whose weights live on a device.
pub trait DeviceModel: Send + Sync {
    fn compiled(&self) -> &Arc<Compiled>;
    fn backend_name(&self) -> String;
    /// A new session with zeroed state.
    fn new_session(&self) -> Result<Box<dyn DeviceSession>>;
}

/// One session's arenas on the device.
pub trait DeviceSession: Send {
    /// Run the plan of `phase` over `tokens` (`1 <= len <= phase.rows()`) starting at absolute
    /// position `pos`. Leaves the state at `pos + len` and the logits of every row in `io.logits`.
    fn step(&mut self, phase: Phase, tokens: &[u32], pos: usize) -> Result<()>;
    /// Logits of rows `0..rows` of the last step, row-major `[rows, vocab]`, as f32.
    fn logits(&self, rows: usize) -> Result<Vec<f32>>;
    /// Zero every state region (a fresh session).
    fn reset(&mut self) -> Result<()>;
    /// Copy the selected regions (KV: only positions `0..pos`) into backend-owned storage.
    fn save(&self, pos: usize, set: RegionSet) -> Result<Arc<dyn SavedState>>;
    /// Copy saved regions back; regions outside `set` are left as they are.
    fn restore(&mut self, saved: &dyn SavedState, set: RegionSet) -> Result<()>;
    /// The current bytes of one state region, up to position `pos` for KV, on the host.
    fn read_region(&self, id: BufferId, pos: usize) -> Result<Vec<u8>>;
}

/// The best backend available at run time: CUDA when compiled in and a GPU and driver are
/// present, otherwise the CPU reference. `FLASHRT_BACKEND=cpu|cuda` forces one.
pub fn best() -> Result<Arc<dyn Backend>> {
    match std::env::var("FLASHRT_BACKEND").ok().as_deref() {
        Some("cpu") => return Ok(Arc::new(cpu::CpuBackend::new())),
        Some("cuda") => return Ok(Arc::new(cuda::CudaBackend::new(0)?)),
        _ => {}
    }
    if cuda::CudaBackend::available()
        && let Ok(b) = cuda::CudaBackend::new(0)
    {
        return Ok(Arc::new(b));
    }
    Ok(Arc::new(cpu::CpuBackend::new()))
}
