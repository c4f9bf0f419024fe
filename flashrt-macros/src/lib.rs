//! flashrt-macros (placeholder, being written).
