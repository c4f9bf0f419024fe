//! Proc-macro shim over `flashrt-compiler`: all parsing, checking and code generation live
//! there (so the CLI and build scripts run the very same code); this crate only turns
//! compiler results into tokens and compiler diagnostics into `compile_error!`s at the user's
//! tokens.
//!
//! * `#[flashrt::model(model = {...}, kinds = {...}, stack = {...})] pub struct Name;` —
//!   the model written as Rust tokens on the item that becomes the model type.
//! * `flashrt::include_model!("models/name.toml");` — a TOML model file, resolved relative to
//!   the including crate's `CARGO_MANIFEST_DIR` (absolute paths are rejected), tracked with
//!   `include_str!` so editing it rebuilds.

use proc_macro::TokenStream;
use quote::quote;
use syn::{ItemStruct, LitStr, parse_macro_input};

/// Declare a model on a unit struct; the struct becomes the model type and a
/// `<Name>Capsule` type is generated beside it.
#[proc_macro_attribute]
pub fn model(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = parse_macro_input!(item as ItemStruct);
    let default_name = snake_case(&item.ident.to_string());
    let vis = &item.vis;
    let vis_tokens = quote!(#vis);
    match flashrt_compiler::model_from_tokens(attr.into(), Some(&default_name)) {
        Ok(ir) => {
            let impls = flashrt_compiler::emit::model_impls(&ir, &item.ident, &vis_tokens);
            quote!(#item #impls).into()
        }
        // Still emit the user's item so one mistake does not cascade into "type not found".
        Err(err) => {
            let errs = err.to_compile_error();
            quote!(#item #errs).into()
        }
    }
}

/// Compile a TOML model file into a model type (named after `[model] name`, CamelCase) and
/// its capsule type.
#[proc_macro]
pub fn include_model(input: TokenStream) -> TokenStream {
    let lit = parse_macro_input!(input as LitStr);
    match include_model_impl(&lit) {
        Ok(ts) => ts.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn include_model_impl(lit: &LitStr) -> syn::Result<proc_macro2::TokenStream> {
    let rel = lit.value();
    let rel_path = std::path::Path::new(&rel);
    if rel_path.is_absolute() {
        return Err(syn::Error::new(
            lit.span(),
            "model paths must be relative to the crate root (CARGO_MANIFEST_DIR), not absolute",
        ));
    }
    let root = std::env::var("CARGO_MANIFEST_DIR").map_err(|_| {
        syn::Error::new(
            lit.span(),
            "CARGO_MANIFEST_DIR is not set; include_model! must run under cargo",
        )
    })?;
    let path = std::path::Path::new(&root).join(rel_path);
    let src = std::fs::read_to_string(&path)
        .map_err(|e| syn::Error::new(lit.span(), format!("cannot read model file `{rel}`: {e}")))?;
    let ir = flashrt_compiler::model_from_toml(&src, &rel)
        .map_err(|d| syn::Error::new(lit.span(), format!("invalid model file:\n{d}")))?;
    let abs = path.to_string_lossy().into_owned();
    Ok(flashrt_compiler::emit::include_model_items(&ir, Some(&abs)))
}

fn snake_case(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}
