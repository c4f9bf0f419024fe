//! # flashrt-ir: the data every stage of flashrt shares
//!
//! The compiler pipeline runs in one direction:
//!
//! ```text
//! front-end (TOML | #[flashrt::model] | HF config.json) -> spec -> check -> ModelIr
//!     -> lower::compile(ir, target) -> Compiled { layout, plans }   -> emit / runtime
//! ```
//!
//! This crate holds the part after checking: the [`ir::ModelIr`] (what the model is), the
//! [`layout::Layout`] (a closed set of named buffers in four arenas: weights, state, scratch,
//! I/O, with fixed offsets and a fingerprint), and the [`plan::Plan`]s (per phase and bucket,
//! an ordered list of ops over buffer ids). Everything here is plain data
//! (`Clone + Eq + Hash + Serialize`): no parser types, no GPU types. The runtime depends on
//! this crate alone, so a model compiled by the macro at build time and one compiled from a
//! TOML file at run time are the same value.
//!
//! Invariants the rest of the system relies on:
//! * the `State` arena is exactly the restorable state (the capsule regions); nothing else
//!   survives between steps;
//! * KV regions are position-major, so the used part at position `p` is one contiguous prefix;
//! * plans never allocate, and read the chunk position and length from device-side scalars
//!   (`io.pos`, `io.len`), so one captured plan replays at any position.

// The lowering's buffer/op constructors take many plain arguments by design.
#![allow(clippy::too_many_arguments)]

pub mod hf;
pub mod ir;
pub mod layout;
pub mod lower;
pub mod plan;

pub use ir::*;
pub use layout::{
    ALIGN, Arena, Buffer, BufferId, KERNEL_VERSION, Layout, Role, StateKind, Target, WeightQuant,
};
pub use lower::{Compiled, IoIds, compile};
pub use plan::{Act, Op, Phase, Plan, View};
