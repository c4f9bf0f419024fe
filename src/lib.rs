//! # flashrt
//!
//! Latency-first serving of hybrid language models (attention + Gated DeltaNet / Mamba2
//! recurrences + short convolutions) with execution-state capsules.
//!
//! A model is written once — in TOML (`include_model!`), on a Rust item
//! (`#[flashrt::model]`), or imported from a Hugging Face `config.json` — and compiled ahead of
//! time into a closed set of named buffers, an execution plan per phase, and a generated
//! capsule type whose fields are exactly the model's restorable state. The runtime snapshots,
//! restores, forks and rolls back that state with bulk copies.
//!
//! This crate is the facade: it re-exports the compiler ([`compiler`]), the IR ([`ir`]), the
//! runtime ([`runtime`]) and the macros, and holds the typed layer ([`Model`], [`Capsule`],
//! [`TypedSession`]) that generated code plugs into.

extern crate self as flashrt;

pub mod bench;
pub mod bench_batch;
pub mod bench_serve;
pub mod bench_sessions;
pub mod chat;
pub mod cli;
pub mod demo;
pub mod run;

pub use flashrt_compiler as compiler;
pub use flashrt_ir as ir;
pub use flashrt_macros::{include_model, model};
pub use flashrt_runtime as runtime;
pub mod typed;

pub use runtime::{Backend, CapsuleMeta, Region};
pub use typed::{Capsule, CapsuleOf, Model, TypedModel, TypedSession};

#[doc(hidden)]
pub use typed::__private;
