//! The typed layer generated code plugs into.
//!
//! `#[flashrt::model]` and `include_model!` implement [`Model`] for the model type and
//! generate `<Model>Capsule`, a struct with one [`Region`] field per state region of the
//! layout plus [`CapsuleMeta`]. [`TypedSession<M>`] only accepts capsules that implement
//! [`CapsuleOf<M>`], which the generator implements for the model's own capsule alone — so
//! restoring model A's capsule into model B is a compile error. Capsules that arrive at run
//! time (files, the untyped API) are checked by fingerprint instead.

use crate::runtime::{self, Capsule as UntypedCapsule, Result};
use flashrt_ir::ModelIr;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;

pub use crate::runtime::{CapsuleMeta, Region};

/// A model type produced by `#[flashrt::model]` or `include_model!`.
pub trait Model: Sized + 'static {
    /// The generated capsule type: one field per state region.
    type Capsule: Capsule<Model = Self>;
    /// The model's snake_case name.
    const NAME: &'static str;
    /// The checked IR, as JSON.
    const IR_JSON: &'static str;
    /// State region (buffer) names in layout order: the capsule's fields.
    const STATE_REGIONS: &'static [&'static str];
    /// Benchmark targets generated from the model description.
    const BENCH_TARGETS: &'static [&'static str];
    /// The checked IR (parsed once).
    fn ir() -> &'static ModelIr;
}

/// A generated capsule type.
pub trait Capsule: Sized + Clone {
    type Model: Model;
    /// Split an untyped capsule into typed fields (fails if it belongs to another model).
    fn from_untyped(capsule: UntypedCapsule) -> Result<Self>;
    /// Reassemble the untyped capsule (cheap: regions are shared handles). Fails if the
    /// fields were mixed from different snapshots or the metadata was edited inconsistently.
    fn to_untyped(&self) -> Result<UntypedCapsule>;
    fn meta(&self) -> &CapsuleMeta;
}

/// Implemented by the generator for `<M>Capsule` only.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a capsule of model `{M}`",
    label = "this capsule belongs to another model",
    note = "a session of `{M}` restores `{M}Capsule` values only; capsules of different models have different state regions"
)]
pub trait CapsuleOf<M: Model>: Capsule<Model = M> {}

/// A model with weights on a backend, typed by its model description.
pub struct TypedModel<M: Model> {
    inner: runtime::Model,
    _m: PhantomData<fn() -> M>,
}

impl<M: Model> Clone for TypedModel<M> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            _m: PhantomData,
        }
    }
}

impl<M: Model> TypedModel<M> {
    /// Load a Hugging Face checkpoint folder (safetensors, HF tensor names).
    pub fn load(backend: Arc<dyn runtime::Backend>, dir: impl AsRef<Path>) -> Result<Self> {
        let inner = runtime::Model::load_ir_dir(backend, M::ir().clone(), dir.as_ref())?;
        Ok(Self {
            inner,
            _m: PhantomData,
        })
    }
    /// Deterministic random weights (demos, benchmarks).
    pub fn random(backend: Arc<dyn runtime::Backend>, seed: u64) -> Result<Self> {
        let inner = runtime::Model::with_random_weights(backend, M::ir(), seed)?;
        Ok(Self {
            inner,
            _m: PhantomData,
        })
    }
    pub fn untyped(&self) -> &runtime::Model {
        &self.inner
    }
    pub fn session(&self) -> Result<TypedSession<M>> {
        Ok(TypedSession {
            inner: self.inner.session()?,
            _m: PhantomData,
        })
    }
    /// An independent session starting from the capsule's boundary.
    pub fn fork<C: CapsuleOf<M>>(&self, capsule: &C) -> Result<TypedSession<M>> {
        Ok(TypedSession {
            inner: self.inner.fork(&capsule.to_untyped()?)?,
            _m: PhantomData,
        })
    }
}

/// A session of model `M`.
pub struct TypedSession<M: Model> {
    inner: runtime::Session,
    _m: PhantomData<fn() -> M>,
}

impl<M: Model> TypedSession<M> {
    /// Feed tokens (chunked through the prefill buckets).
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<()> {
        self.inner.append(tokens)
    }
    /// Greedy-decode `n` tokens.
    pub fn decode_greedy(&mut self, n: usize) -> Result<Vec<u32>> {
        self.inner.decode_greedy(n)
    }
    pub fn pos(&self) -> usize {
        self.inner.pos()
    }
    pub fn untyped(&mut self) -> &mut runtime::Session {
        &mut self.inner
    }
    /// The state at the current token boundary.
    pub fn snapshot(&self) -> Result<M::Capsule> {
        M::Capsule::from_untyped(self.inner.snapshot()?)
    }
    /// Byte-exact restore of a capsule of this model.
    pub fn restore<C: CapsuleOf<M>>(&mut self, capsule: &C) -> Result<()> {
        self.inner.restore(&capsule.to_untyped()?)
    }
    /// Return to an earlier boundary of this session's history.
    pub fn rollback<C: CapsuleOf<M>>(&mut self, capsule: &C) -> Result<()> {
        self.inner.rollback(&capsule.to_untyped()?)
    }
}

/// Items generated code refers to; not part of the public API.
#[doc(hidden)]
pub mod __private {
    pub use super::{Capsule, CapsuleOf, Model};
    pub use crate::runtime::{Capsule as UntypedCapsule, Result};
    pub use flashrt_ir::ModelIr;
    pub use std::sync::OnceLock;

    use super::{CapsuleMeta, Region};
    use crate::runtime::Error;

    pub fn parse_ir(json: &str) -> ModelIr {
        serde_json::from_str(json).expect("the IR embedded by flashrt's code generator parses")
    }

    /// An untyped capsule split into region handles, taken one by one in layout order.
    pub struct Regions {
        regions: Vec<Option<Region>>,
    }

    impl Regions {
        pub fn take(&mut self, i: usize) -> Region {
            self.regions[i].take().expect("each region is taken once")
        }
    }

    pub fn split_regions<M: Model>(
        capsule: UntypedCapsule,
        n: usize,
    ) -> Result<(CapsuleMeta, Regions)> {
        if capsule.meta().model != M::NAME {
            return Err(Error::Capsule(format!(
                "capsule of model `{}` cannot become a capsule of `{}`",
                capsule.meta().model,
                M::NAME
            )));
        }
        let ids = capsule.region_ids();
        if ids.len() != n {
            return Err(Error::Capsule(format!(
                "capsule has {} state regions, model `{}` has {n}",
                ids.len(),
                M::NAME
            )));
        }
        let meta = capsule.meta().clone();
        let regions = ids
            .into_iter()
            .map(|id| capsule.region_handle(id))
            .collect();
        Ok((meta, Regions { regions }))
    }

    pub fn join_regions(meta: &CapsuleMeta, regions: &[&Region]) -> Result<UntypedCapsule> {
        let first = regions
            .first()
            .ok_or_else(|| Error::Capsule("a capsule needs at least one state region".into()))?;
        if let Some(other) = regions
            .iter()
            .find(|r| !std::sync::Arc::ptr_eq(r.saved(), first.saved()))
        {
            return Err(Error::Capsule(format!(
                "capsule fields come from different snapshots (`{}` and `{}`); restore them separately",
                first.name(),
                other.name()
            )));
        }
        UntypedCapsule::from_parts(
            meta.clone(),
            first.saved().clone(),
            first.compiled().clone(),
        )
    }
}
