//! flashrt facade (placeholder, being written).
pub use flashrt_ir as ir;
