//! Code generation: a checked [`ModelIr`] becomes Rust items.
//!
//! For a model type `T` the emitter produces:
//!
//! * `impl flashrt::Model for T`: the name, the IR (embedded as JSON, parsed once), the state
//!   region names in layout order, and the per-model benchmark targets;
//! * `TCapsule`: one public field per state region of the layout (a [`Region`] handle,
//!   named after the buffer: `layers.3.key` -> `layers_3_key`) plus `meta`, and nothing else;
//! * `impl flashrt::Capsule for TCapsule` and `impl flashrt::CapsuleOf<T> for TCapsule`, so a
//!   session of `T` accepts `TCapsule` and no other model's capsule, at compile time.
//!
//! Generated code only names items through `::flashrt::__private`, so it is hygienic
//! whatever the user has in scope. Emitters assume valid input: checking happened before.
//!
//! [`Region`]: ../../flashrt/struct.Region.html

use crate::ir::{Compiled, ModelIr, Phase, Target, compile};
use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote};

/// What a per-model benchmark target measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchKind {
    /// One decode step at a mid-length position.
    DecodeStep,
    /// One full prefill chunk of `bucket` tokens.
    PrefillChunk { bucket: usize },
    /// A snapshot of every state region.
    Snapshot,
    /// A restore of every state region.
    Restore,
}

/// A per-model benchmark target, generated from the model description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchTarget {
    /// `decode_step`, `prefill_chunk_512`, `snapshot`, `restore`.
    pub name: String,
    pub kind: BenchKind,
    /// What it measures, in words.
    pub what: String,
}

/// The benchmark targets every model gets: one decode step, one prefill chunk per bucket,
/// snapshot and restore of the capsule at a full prefill. `benches/models.rs` runs them for
/// every model in `models/`; generated code lists their names in `Model::BENCH_TARGETS`.
pub fn bench_targets(ir: &ModelIr) -> Vec<BenchTarget> {
    let mut out = vec![BenchTarget {
        name: "decode_step".into(),
        kind: BenchKind::DecodeStep,
        what: "one decode step (plan `decode`) at a mid-length position".into(),
    }];
    for &b in &ir.prefill_buckets {
        out.push(BenchTarget {
            name: format!("prefill_chunk_{b}"),
            kind: BenchKind::PrefillChunk { bucket: b },
            what: format!("one full prefill chunk of {b} tokens (plan `prefill[{b}]`)"),
        });
    }
    out.push(BenchTarget {
        name: "snapshot".into(),
        kind: BenchKind::Snapshot,
        what: "snapshot of every state region".into(),
    });
    out.push(BenchTarget {
        name: "restore".into(),
        kind: BenchKind::Restore,
        what: "restore of every state region".into(),
    });
    out
}

/// The layout used to name capsule fields (region names and order do not depend on the
/// target dtype, so any target gives the same fields).
fn reference_layout(ir: &ModelIr) -> Compiled {
    compile(ir, Target { dtype: ir.dtype })
}

/// Items for a model whose type `ty` the user declared (the `#[flashrt::model]` form).
pub fn model_impls(ir: &ModelIr, ty: &Ident, vis: &TokenStream) -> TokenStream {
    let compiled = reference_layout(ir);
    let capsule = format_ident!("{}Capsule", ty);
    let name = &ir.name;
    let json = serde_json::to_string(ir).expect("IR serialises");
    let regions: Vec<String> = compiled
        .layout
        .state_buffers()
        .map(|b| b.name.clone())
        .collect();
    let fields: Vec<Ident> = compiled
        .layout
        .state_buffers()
        .map(|b| Ident::new(&b.field_name(), Span::call_site()))
        .collect();
    let field_docs: Vec<String> = compiled
        .layout
        .state_buffers()
        .map(|b| {
            let kind = b.state.map_or("state", |k| k.name());
            let per = if b.bytes_per_token() > 0 {
                format!("{} bytes per token", b.bytes_per_token())
            } else {
                format!("{} bytes", b.bytes)
            };
            format!(
                "`{}`: layer {} {kind} state, shape {:?} ({per} in {}).",
                b.name,
                b.layer.unwrap_or(0),
                b.shape,
                b.dtype.name()
            )
        })
        .collect();
    let idx: Vec<usize> = (0..fields.len()).collect();
    let n = fields.len();
    let benches: Vec<String> = bench_targets(ir).into_iter().map(|b| b.name).collect();
    let capsule_doc = format!(
        "Execution-state capsule of [`{ty}`]: one field per state region of its layout, plus metadata. \
         A session of `{ty}` restores this type and no other."
    );
    quote! {
        impl ::flashrt::__private::Model for #ty {
            type Capsule = #capsule;
            const NAME: &'static str = #name;
            const IR_JSON: &'static str = #json;
            const STATE_REGIONS: &'static [&'static str] = &[#(#regions),*];
            const BENCH_TARGETS: &'static [&'static str] = &[#(#benches),*];
            fn ir() -> &'static ::flashrt::__private::ModelIr {
                static IR: ::flashrt::__private::OnceLock<::flashrt::__private::ModelIr> =
                    ::flashrt::__private::OnceLock::new();
                IR.get_or_init(|| ::flashrt::__private::parse_ir(<Self as ::flashrt::__private::Model>::IR_JSON))
            }
        }

        #[doc = #capsule_doc]
        #[derive(Clone)]
        #vis struct #capsule {
            #(
                #[doc = #field_docs]
                pub #fields: ::flashrt::Region,
            )*
            /// Position, pending token, sampler state, counters, token history, fingerprint.
            pub meta: ::flashrt::CapsuleMeta,
        }

        impl ::flashrt::__private::Capsule for #capsule {
            type Model = #ty;
            fn from_untyped(
                capsule: ::flashrt::__private::UntypedCapsule,
            ) -> ::flashrt::__private::Result<Self> {
                let (meta, mut regions) = ::flashrt::__private::split_regions::<#ty>(capsule, #n)?;
                Ok(Self {
                    #( #fields: regions.take(#idx), )*
                    meta,
                })
            }
            fn to_untyped(&self) -> ::flashrt::__private::Result<::flashrt::__private::UntypedCapsule> {
                ::flashrt::__private::join_regions(&self.meta, &[#( &self.#fields ),*])
            }
            fn meta(&self) -> &::flashrt::CapsuleMeta {
                &self.meta
            }
        }

        impl ::flashrt::__private::CapsuleOf<#ty> for #capsule {}
    }
}

/// Items for `include_model!`: the model type itself (a unit struct named after the model)
/// plus [`model_impls`]. `source_path` (absolute, resolved by the macro) is included with
/// `include_str!` so cargo rebuilds when the file changes.
pub fn include_model_items(ir: &ModelIr, source_path: Option<&str>) -> TokenStream {
    let ty = Ident::new(&ir.type_name(), Span::call_site());
    let doc = format!(
        "The `{}` model (compiled by flashrt from its description).",
        ir.name
    );
    let vis = quote!(pub);
    let impls = model_impls(ir, &ty, &vis);
    let track = source_path.map(|p| quote! { const _: &str = include_str!(#p); });
    quote! {
        #[doc = #doc]
        #[derive(Clone, Copy, Debug, Default)]
        pub struct #ty;
        #impls
        #track
    }
}

/// Pretty-printed Rust source of the generated items (for `flashrt compile --emit-rust` and
/// the golden snapshots).
pub fn rust_source(ir: &ModelIr) -> String {
    let tokens = include_model_items(ir, None);
    let file: syn::File = syn::parse2(tokens).expect("generated code parses");
    let mut out = format!(
        "// Generated by flashrt from model `{}`. Do not edit.\n// IR hash {:016x}\n\n",
        ir.name,
        ir.ir_hash()
    );
    // The embedded IR JSON is long; the pretty printer keeps it on one line.
    out.push_str(&prettyplease::unparse(&file));
    out
}

/// A compact, stable text summary of the layout (one line per buffer) for golden snapshots
/// and the CLI.
pub fn layout_summary(c: &Compiled) -> String {
    use std::fmt::Write;
    let l = &c.layout;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model {} target {} fingerprint {}",
        l.model,
        l.target.dtype.name(),
        l.fingerprint
    );
    for a in &l.arenas {
        let _ = writeln!(s, "arena {:<8} {:>16} bytes", a.role.name(), a.bytes);
    }
    let _ = writeln!(
        s,
        "{:<5} {:<36} {:<8} {:<5} {:<22} {:>14} {:>14}",
        "id", "buffer", "role", "dtype", "shape", "offset", "bytes"
    );
    for b in &l.buffers {
        let _ = writeln!(
            s,
            "{:<5} {:<36} {:<8} {:<5} {:<22} {:>14} {:>14}",
            b.id.0,
            b.name,
            b.role.name(),
            b.dtype.name(),
            format!("{:?}", b.shape),
            b.offset,
            b.bytes
        );
    }
    let _ = writeln!(
        s,
        "capsule {} fixed bytes + {} bytes per token",
        l.capsule_fixed_bytes(),
        l.capsule_bytes_per_token()
    );
    s
}

/// Per phase: op count and the ordered op-kind histogram.
pub fn plan_summary(c: &Compiled) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    for p in &c.plans {
        let counts = p
            .op_counts()
            .iter()
            .map(|(n, k)| format!("{n}x{k}"))
            .collect::<Vec<_>>()
            .join(" ");
        let _ = writeln!(
            s,
            "{:<16} rows {:>5} ops {:>5}: {counts}",
            p.phase.label(),
            p.phase.rows(),
            p.ops.len()
        );
    }
    if let Some(p) = c.plan(Phase::Decode) {
        let _ = writeln!(s, "decode op order:");
        for (i, op) in p.ops.iter().enumerate() {
            let bufs: Vec<&str> = op
                .buffers()
                .iter()
                .map(|&b| c.layout.buffer(b).name.as_str())
                .collect();
            let _ = writeln!(s, "  {i:>4} {:<15} {}", op.name(), bufs.join(" "));
        }
    }
    s
}
