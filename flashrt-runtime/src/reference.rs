//! Checking a runtime against a folder of transformers reference outputs.
//!
//! The folder format is the one of the repository's `tests/fixtures/*`: `config.json` + `model.safetensors`
//! (the checkpoint), `reference.safetensors` (prompt, logits, greedy ids, fork scenarios) and
//! optionally `state.safetensors` (every cache tensor right after the prompt). All lengths are
//! read from the files. Each comparison becomes one [`CheckLine`]; logits and state use the
//! relative error `max|ours - ref| / max|ref|`, token ids must be identical.
//!
//! The scenario: prefill the prompt and compare all its logits; snapshot the prompt capsule;
//! compare the state regions with `state.safetensors` (mapped to transformers' layouts); decode
//! greedily and compare ids (and the logits that chose them); fork S1 from the capsule on a new
//! session, and S2 by restoring the capsule into the (now dirty) main session; compare both
//! suffixes' logits against transformers' cold forwards and their greedy continuations.

use crate::backend::Backend;
use crate::capsule::Capsule;
use crate::error::{Error, Result};
use crate::safetensors::{SafeTensors, bytes_f32};
use crate::session::{Model, Session, argmax};
use flashrt_ir::StateKind;
use flashrt_ir::hf::HfOptions;
use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// One comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckLine {
    pub name: String,
    /// Relative max error for tensors; number of differing ids for id lists.
    pub error: f64,
    pub tolerance: f64,
    pub passed: bool,
    /// Extra context (shapes, first mismatch).
    pub detail: String,
}

/// The result of [`check_reference`].
#[derive(Clone, Debug)]
pub struct ReferenceReport {
    pub dir: PathBuf,
    pub model: String,
    pub model_type: String,
    pub backend: String,
    /// Relative tolerance used for logits and state.
    pub tolerance: f64,
    pub checks: Vec<CheckLine>,
    /// What the model has that the reference does not cover, and why (e.g. an MTP head,
    /// which transformers loads no module for and never runs).
    pub not_covered: Vec<String>,
}

impl ReferenceReport {
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }
    pub fn failures(&self) -> Vec<&CheckLine> {
        self.checks.iter().filter(|c| !c.passed).collect()
    }
    pub fn check(&self, name: &str) -> Option<&CheckLine> {
        self.checks.iter().find(|c| c.name == name)
    }
}

impl fmt::Display for ReferenceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "reference check of {} ({}, model {}) on {}",
            self.dir.display(),
            self.model_type,
            self.model,
            self.backend
        )?;
        let w = self
            .checks
            .iter()
            .map(|c| c.name.len())
            .max()
            .unwrap_or(4)
            .max(5);
        writeln!(
            f,
            "  {:<w$}  {:>10}  {:>10}  result",
            "check", "error", "tolerance"
        )?;
        for c in &self.checks {
            let verdict = if c.passed { "ok" } else { "FAIL" };
            write!(
                f,
                "  {:<w$}  {:>10.3e}  {:>10.1e}  {verdict}",
                c.name, c.error, c.tolerance
            )?;
            if !c.detail.is_empty() {
                write!(f, "  ({})", c.detail)?;
            }
            writeln!(f)?;
        }
        for n in &self.not_covered {
            writeln!(f, "  not covered: {n}")?;
        }
        let failed = self.failures().len();
        if failed == 0 {
            write!(f, "  all {} checks passed", self.checks.len())
        } else {
            write!(f, "  {failed} of {} checks FAILED", self.checks.len())
        }
    }
}

/// Options of [`check_reference_with`].
#[derive(Clone, Debug, Default)]
pub struct ReferenceOptions {
    /// Override the relative tolerance (default: 1e-3 for `qwen3_5_text`, 1e-4 otherwise, as
    /// the fixtures' README prescribes).
    pub rel_tol: Option<f64>,
    /// Prefill buckets to compile with (default: the importer's `[16, 64]`); small buckets
    /// make the prompt span several chunks and plans.
    pub prefill_buckets: Option<Vec<usize>>,
    /// The model dtype (default: the config's). The tolerances are those of an f32 forward:
    /// checkpoints stored in bf16 or FP8 are checked in f32 on a GPU with `Some(F32)`.
    pub dtype: Option<flashrt_ir::DType>,
}

/// Run the reference scenario of `dir` on `backend` with the default tolerances.
pub fn check_reference(dir: &Path, backend: Arc<dyn Backend>) -> Result<ReferenceReport> {
    check_reference_with(dir, backend, &ReferenceOptions::default())
}

/// `max|a - b| / max|b|` (absolute error when `b` is all zeros); infinite on length mismatch.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f64 {
    if ours.len() != reference.len() {
        return f64::INFINITY;
    }
    let mut diff = 0f64;
    let mut scale = 0f64;
    for (&a, &b) in ours.iter().zip(reference) {
        let d = (a as f64 - b as f64).abs();
        diff = if d.is_nan() {
            f64::INFINITY
        } else {
            diff.max(d)
        };
        scale = scale.max((b as f64).abs());
    }
    if scale > 0.0 { diff / scale } else { diff }
}

fn model_type(json: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let outer = v.get("model_type").and_then(|t| t.as_str()).unwrap_or("?");
    match v
        .get("text_config")
        .and_then(|t| t.get("model_type"))
        .and_then(|t| t.as_str())
    {
        Some(inner) => inner.to_string(),
        None => outer.to_string(),
    }
}

/// Default relative tolerance for a model type (fixtures' README).
pub fn default_tolerance(model_type: &str) -> f64 {
    if model_type.starts_with("qwen3_5") || model_type == "qwen3_next" {
        1e-3
    } else {
        1e-4
    }
}

struct Checks {
    lines: Vec<CheckLine>,
    tol: f64,
}

impl Checks {
    fn tensor(&mut self, name: &str, ours: &[f32], reference: &[f32]) {
        let error = rel_err(ours, reference);
        let detail = if ours.len() != reference.len() {
            format!(
                "{} values vs {} in the reference",
                ours.len(),
                reference.len()
            )
        } else {
            String::new()
        };
        self.lines.push(CheckLine {
            name: name.into(),
            error,
            tolerance: self.tol,
            passed: error <= self.tol,
            detail,
        });
    }
    fn ids(&mut self, name: &str, ours: &[u32], reference: &[u32]) {
        let n = ours.len().max(reference.len());
        let differing = (0..n).filter(|&i| ours.get(i) != reference.get(i)).count();
        let detail = match (0..n).find(|&i| ours.get(i) != reference.get(i)) {
            Some(i) => format!(
                "first difference at {i}: ours {:?}, reference {:?}",
                ours.get(i),
                reference.get(i)
            ),
            None => format!("{n} ids"),
        };
        self.lines.push(CheckLine {
            name: name.into(),
            error: differing as f64,
            tolerance: 0.0,
            passed: differing == 0,
            detail,
        });
    }
    fn fail(&mut self, name: &str, detail: String) {
        self.lines.push(CheckLine {
            name: name.into(),
            error: f64::INFINITY,
            tolerance: self.tol,
            passed: false,
            detail,
        });
    }
}

fn ids(r: &SafeTensors, name: &str) -> Result<Vec<u32>> {
    r.i64(name)?
        .into_iter()
        .map(|v| {
            u32::try_from(v)
                .map_err(|_| Error::Checkpoint(format!("{}: `{name}` holds id {v}", r.origin)))
        })
        .collect()
}

/// Greedy decoding that also returns the logits row that chose each token.
fn greedy_with_rows(s: &mut Session, n: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    let mut out = Vec::with_capacity(n);
    let mut rows = Vec::new();
    for i in 0..n {
        let row = s.last_logits();
        let t = argmax(row).ok_or_else(|| Error::Input("no logits".into()))?;
        rows.extend_from_slice(row);
        out.push(t);
        if i + 1 < n {
            s.append(&[t])?;
        }
    }
    Ok((out, rows))
}

/// Run the reference scenario with options.
pub fn check_reference_with(
    dir: &Path,
    backend: Arc<dyn Backend>,
    opts: &ReferenceOptions,
) -> Result<ReferenceReport> {
    let cfg = dir.join("config.json");
    let json = std::fs::read_to_string(&cfg).map_err(|e| Error::Io {
        path: cfg.display().to_string(),
        source: e,
    })?;
    let mt = model_type(&json);
    let tol = opts.rel_tol.unwrap_or_else(|| default_tolerance(&mt));
    let r = SafeTensors::read(&dir.join("reference.safetensors"))?;
    let prompt = ids(&r, "prompt_ids")?;
    let greedy = ids(&r, "greedy_ids")?;
    let s1 = ids(&r, "fork_s1_ids")?;
    let s2 = ids(&r, "fork_s2_ids")?;
    let s1g = ids(&r, "fork_s1_greedy_ids")?;
    let s2g = ids(&r, "fork_s2_greedy_ids")?;
    if prompt.is_empty() {
        return Err(Error::Checkpoint(format!("{}: empty prompt_ids", r.origin)));
    }
    let needed = prompt.len()
        + greedy
            .len()
            .max(s1.len() + s1g.len())
            .max(s2.len() + s2g.len());
    let hf = HfOptions {
        max_seq: Some(needed.next_multiple_of(64)),
        prefill_buckets: opts.prefill_buckets.clone(),
        dtype: opts.dtype,
        ..HfOptions::default()
    };
    let model = Model::load_hf_dir(backend, dir, &hf)?;
    let mut c = Checks {
        lines: Vec::new(),
        tol,
    };
    let mut not_covered = Vec::new();
    if let Some(mtp) = &model.ir().mtp {
        let regions: Vec<&str> = model
            .compiled()
            .layout
            .state_buffers()
            .filter(|b| b.name.starts_with("mtp."))
            .map(|b| b.name.as_str())
            .collect();
        not_covered.push(format!(
            "the MTP head ({} layer{}; state {}): transformers has no module for it and never \
             runs it, so the reference holds no MTP logits or K/V. Its weights are loaded and \
             shape-checked; its numerics are covered by the speculative-decoding tests",
            mtp.layers.len(),
            if mtp.layers.len() == 1 { "" } else { "s" },
            regions.join(", ")
        ));
    }

    // Prompt prefill.
    let mut s = model.session()?;
    s.append(&prompt)?;
    c.tensor("prompt_logits", s.logits(), &r.f32("prompt_logits")?);
    let cap = s.snapshot()?;

    // State after the prompt.
    let state_path = dir.join("state.safetensors");
    if state_path.is_file() {
        let st = SafeTensors::read(&state_path)?;
        compare_state(&mut c, &model, &cap, &st)?;
    }

    // Greedy continuation.
    let (g, rows) = greedy_with_rows(&mut s, greedy.len())?;
    c.ids("greedy_ids", &g, &greedy);
    if r.info("greedy_logits").is_some() {
        c.tensor("greedy_logits", &rows, &r.f32("greedy_logits")?);
    }

    // Fork S1 on a new session from the prompt capsule.
    let mut f1 = model.fork(&cap)?;
    f1.append(&s1)?;
    c.tensor("fork_s1_logits", f1.logits(), &r.f32("fork_s1_logits")?);
    let (g1, rows1) = greedy_with_rows(&mut f1, s1g.len())?;
    c.ids("fork_s1_greedy_ids", &g1, &s1g);
    if r.info("fork_s1_greedy_logits").is_some() {
        c.tensor(
            "fork_s1_greedy_logits",
            &rows1,
            &r.f32("fork_s1_greedy_logits")?,
        );
    }

    // Fork S2 by restoring the capsule into the main session (dirtied by the greedy run).
    s.restore(&cap)?;
    s.append(&s2)?;
    c.tensor("fork_s2_logits", s.logits(), &r.f32("fork_s2_logits")?);
    let (g2, rows2) = greedy_with_rows(&mut s, s2g.len())?;
    c.ids("fork_s2_greedy_ids", &g2, &s2g);
    if r.info("fork_s2_greedy_logits").is_some() {
        c.tensor(
            "fork_s2_greedy_logits",
            &rows2,
            &r.f32("fork_s2_greedy_logits")?,
        );
    }

    Ok(ReferenceReport {
        dir: dir.to_path_buf(),
        model: model.name().to_string(),
        model_type: mt,
        backend: model.backend_name(),
        tolerance: tol,
        checks: c.lines,
        not_covered,
    })
}

/// Map each state region to transformers' cache tensor and compare:
/// K/V `[pos, kv_heads, head_dim]` vs `[1, kv_heads, seq, head_dim]`; conv `[K-1, C]` vs the
/// last `K-1` columns of `[1, C, K]`; recurrent state in the same order.
fn compare_state(c: &mut Checks, model: &Model, cap: &Capsule, st: &SafeTensors) -> Result<()> {
    let layout = &model.compiled().layout;
    let pos = cap.pos();
    let mut matched = BTreeSet::new();
    for b in layout.state_buffers() {
        let (Some(layer), Some(kind)) = (b.layer, b.state) else {
            continue;
        };
        // The MTP head's regions have no counterpart in transformers' cache (see
        // `ReferenceReport::not_covered`).
        if model.ir().mtp.is_some() && b.name.starts_with("mtp.") {
            continue;
        }
        let hf = match kind {
            StateKind::Key => format!("layers.{layer}.key"),
            StateKind::Value => format!("layers.{layer}.value"),
            StateKind::Conv => format!("layers.{layer}.conv_state"),
            StateKind::Recurrent => format!("layers.{layer}.recurrent_state"),
            // Not part of transformers' cache (the MTP head's input hidden state).
            StateKind::Hidden => continue,
        };
        let line = format!("state {}", b.name);
        let Some(info) = st.info(&hf) else {
            c.fail(&line, format!("no `{hf}` in {}", st.origin));
            continue;
        };
        matched.insert(hf.clone());
        let ours = bytes_f32(&cap.region_by_id(b.id)?);
        let theirs = st.f32(&hf)?;
        let shape = &info.shape;
        let mapped: Option<Vec<f32>> = match kind {
            StateKind::Key | StateKind::Value => {
                let (kvh, hd) = (b.shape[1], b.shape[2]);
                (shape == &[1, kvh, pos, hd]).then(|| {
                    let mut v = vec![0f32; pos * kvh * hd];
                    for h in 0..kvh {
                        for t in 0..pos {
                            let src = (h * pos + t) * hd;
                            v[(t * kvh + h) * hd..(t * kvh + h + 1) * hd]
                                .copy_from_slice(&theirs[src..src + hd]);
                        }
                    }
                    v
                })
            }
            StateKind::Conv => {
                let (km1, ch) = (b.shape[0], b.shape[1]);
                (shape.len() == 3 && shape[0] == 1 && shape[1] == ch && shape[2] >= km1).then(
                    || {
                        let k = shape[2];
                        let mut v = vec![0f32; km1 * ch];
                        for t in 0..km1 {
                            for cc in 0..ch {
                                v[t * ch + cc] = theirs[cc * k + (k - km1) + t];
                            }
                        }
                        v
                    },
                )
            }
            StateKind::Hidden => None,
            StateKind::Recurrent => (shape.iter().product::<usize>() == b.numel()
                && shape.iter().skip(1).eq(b.shape.iter()))
            .then(|| theirs.clone()),
        };
        match mapped {
            Some(v) => c.tensor(&line, &ours, &v),
            None => c.fail(
                &line,
                format!(
                    "`{hf}` has shape {shape:?}; ours is {:?} at position {pos}",
                    b.shape
                ),
            ),
        }
    }
    for name in st.tensors.keys() {
        if !matched.contains(name) {
            c.fail(
                &format!("state {name}"),
                "transformers holds this state tensor; the layout has no region for it".into(),
            );
        }
    }
    Ok(())
}
