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
//! * [`loader`]: Hugging Face safetensors checkpoints streamed into a backend's
//!   [`WeightSink`] (memory-mapped, in their stored dtype, hashed into the weights digest a
//!   model's fingerprint covers), with one error listing every mismatch; [`init`]:
//!   deterministic random weights; [`quant`]: the FP8 E4M3 codec and the block quantizer
//!   (the reference rule every backend reproduces bit for bit).
//! * [`safetensors`]: safetensors files through the format's crate, mapped, every file
//!   treated as untrusted.
//! * [`reference`]: checks a runtime against a folder of transformers reference outputs.
//! * [`sampling`]: greedy / temperature / top-k / top-p sampling whose RNG state lives in the
//!   capsule, so restored and forked sessions sample the same continuation.
//! * [`capsule_file`]: the versioned, fingerprinted, checksummed capsule file format (atomic
//!   writes; an untrusting, never-panicking reader); [`host_state`]: saved state as portable
//!   host bytes, which every backend restores through one generic path.
//! * [`store`]: a capsule store with byte budgets per tier (device, host, disk), LRU eviction
//!   down the tiers, KV rows shared along a conversation, and longest-prefix lookup.
//! * [`chunking`]: the chunk planner: which decode, verify and prefill plans run an append
//!   of `n` tokens, chosen to minimise a per-plan cost measured on the device (or derived).
//! * [`speculative`]: speculative greedy decoding (MTP drafts, one verify pass per round)
//!   with exact rollback of recurrent, conv and MTP state; drafters and acceptance statistics.
//!
//! The contract every backend keeps: a session's state is exactly the layout's `State` arena;
//! a snapshot copies its regions (KV only up to the position), a restore copies them back, so
//! afterwards every state byte equals the snapshot's and decoding continues with exactly the
//! tokens it would have produced had the session never moved. The CPU backend additionally
//! makes every op chunking-invariant, so restore + append at *any* boundary equals a cold
//! prefill bit for bit.

pub mod backend;
pub mod capsule;
pub mod capsule_file;
pub mod chunking;
pub mod error;
mod held_rows;
pub mod host_pool;
pub mod host_state;
pub mod init;
pub mod loader;
pub mod quant;
pub mod reference;
pub mod safetensors;
pub mod sampling;
pub mod session;
pub mod speculative;
pub mod store;

pub use flashrt_ir as ir;

pub use backend::cpu::CpuBackend;
pub use backend::{
    Backend, DeviceModel, DeviceSession, HostWeights, RegionSet, SavedState, SourceDtype,
    WeightSink,
};
pub use capsule::{Capsule, CapsuleMeta, Counters, LogitsRow, Region, SamplerState};
pub use chunking::{ChunkCosts, CostSource, PlanCost};
pub use error::{Error, Result};
pub use host_state::HostSaved;
pub use init::random_weights;
pub use loader::{Checkpoint, LoadProgress, LoadReport, load_hf_weights};
pub use reference::{
    CheckLine, ReferenceOptions, ReferenceReport, check_reference, check_reference_with,
};
pub use session::{LogitsMode, Model, RegionKey, Session, WeightSource, argmax};
pub use speculative::{
    AdversaryDrafter, DraftCx, Drafter, MtpDrafter, OracleDrafter, SpecStats, Speculator,
};
pub use store::{CapsuleStore, StoreConfig, Tier};
