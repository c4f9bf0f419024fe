//! The runtime's one error type.

use thiserror::Error;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum Error {
    #[error("io error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid checkpoint: {0}")]
    Checkpoint(String),
    #[error("invalid config: {0}")]
    Config(String),
    #[error("capsule error: {0}")]
    Capsule(String),
    #[error(
        "capsule fingerprint mismatch: capsule is for {capsule_model} ({capsule}), session is {session_model} ({session})"
    )]
    Fingerprint {
        capsule_model: String,
        capsule: String,
        session_model: String,
        session: String,
    },
    #[error("bad input: {0}")]
    Input(String),
    #[error("{op}: {msg}")]
    Backend { op: String, msg: String },
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A byte budget cannot hold what was asked for (a capsule to persist, say).
    #[error("store full: {0}")]
    StoreFull(String),
}
