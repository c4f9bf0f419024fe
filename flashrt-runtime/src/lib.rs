//! # flashrt-runtime: sessions, capsules and backends
//!
//! The runtime takes a [`Compiled`](flashrt_ir::Compiled) model (closed buffer layout + one
//! plan per phase), puts its weights on a [`Backend`], and runs [`Session`]s over it.
//!
//! * [`backend`]: the object-safe backend contract ([`Backend`] -> [`DeviceModel`] ->
//!   [`DeviceSession`]) and its implementations: [`backend::cpu`], the f32 reference that is
//!   the numerical oracle for everything else, and the CUDA backend (or a stand-in that says
//!   "not compiled with CUDA").
//! * [`session`]: [`Model`] (weights on a device, `Arc`-shared) and [`Session`] (arenas, token
//!   history, logits; append / decode / snapshot / restore / fork / rollback).
//! * [`capsule`]: [`Capsule`], the whole execution state at a token boundary: every state
//!   region plus position, pending token, sampler state, counters and the last logits row.
//! * [`loader`]: Hugging Face safetensors checkpoints -> host weights, with one error listing
//!   every mismatch; deterministic random weights.
//! * [`safetensors`]: a strict reader/writer that treats every file as untrusted.
//! * [`reference`]: checks a runtime against a folder of transformers reference outputs.
//!
//! The contract every backend keeps: a session's state is exactly the layout's `State` arena;
//! a snapshot copies its regions (KV only up to the position), a restore copies them back, so
//! afterwards every state byte equals the snapshot's and decoding continues with exactly the
//! tokens it would have produced had the session never moved. The CPU backend additionally
//! makes every op chunking-invariant, so restore + append at *any* boundary equals a cold
//! prefill bit for bit.

pub mod backend;
pub mod capsule;
pub mod error;
pub mod loader;
pub mod reference;
pub mod safetensors;
pub mod session;

pub use flashrt_ir as ir;

pub use backend::cpu::CpuBackend;
pub use backend::{Backend, DeviceModel, DeviceSession, HostWeights, RegionSet, SavedState};
pub use capsule::{Capsule, CapsuleMeta, Counters, LogitsRow, Region, SamplerState};
pub use error::{Error, Result};
pub use loader::{load_hf_weights, random_weights};
pub use reference::{
    CheckLine, ReferenceOptions, ReferenceReport, check_reference, check_reference_with,
};
pub use session::{LogitsMode, Model, RegionKey, Session, WeightSource, argmax};
