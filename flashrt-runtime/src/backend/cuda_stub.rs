//! Stand-in for the CUDA backend when flashrt is built without the `cuda` feature: same
//! names, and every constructor reports that CUDA was not compiled in.

use super::{Backend, WeightSink};
use crate::error::{Error, Result};
use flashrt_ir::{Compiled, ModelIr, Target};

/// Never constructed: [`CudaBackend::new`] always fails in this build.
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

impl CudaBackend {
    /// Always false: this build has no CUDA backend.
    pub fn available() -> bool {
        false
    }
    pub fn new(_ordinal: usize) -> Result<Self> {
        Err(Error::Unsupported(
            "flashrt was not compiled with CUDA (build with `--features cuda`)".into(),
        ))
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        match self._never {}
    }
    fn target(&self, _ir: &ModelIr) -> Target {
        match self._never {}
    }
    fn weight_sink(&self, _c: &Compiled) -> Result<Box<dyn WeightSink>> {
        match self._never {}
    }
}
