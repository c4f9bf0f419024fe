//! # flashrt's Python bindings (`flashrt._native`; the package is `flashrt`)
//!
//! The runtime's own objects, in-process, for the agent loops, planners and robot policies
//! people write in Python:
//!
//! * [`PyModel`] (`flashrt.Model`): a checkpoint folder (with its tokenizer and chat template)
//!   or a model TOML, on the CPU or CUDA backend; `session()`, `fork(capsule)`,
//!   `load_capsule(path)`, `encode` / `decode`, `chat(messages, tools=...)`.
//! * [`PySession`] (`flashrt.Session`): `append(ids | text)`, `generate(...)` (an iterator of
//!   [`PyToken`]s, each yielded the moment it is chosen), `step(token)`, `logits()`,
//!   `snapshot()`, `restore`, `rollback`, `restore_kv_only`, `read_region`.
//! * [`PyCapsule`] (`flashrt.Capsule`): a session's whole state at a token boundary; `save`,
//!   `pos`, `tokens`, `nbytes`, `model`, `fingerprint`.
//!
//! **The GIL** is released while the backend works (prefill, decode, snapshot, restore), so
//! other Python threads run meanwhile. **Threads**: every object may be shared between
//! threads; a session serialises its calls with a lock (two threads stepping one session take
//! turns). **Errors** raise `flashrt.Error` with the runtime's message; a capsule of another
//! model raises `flashrt.CapsuleTypeError` (a `TypeError`) naming both models; bad arguments
//! raise `ValueError`.

use flashrt_runtime::{Capsule, Error, LogitsMode, Model, SamplerState, Session};
use flashrt_serve::cli::{BackendKind, DecodeMatmuls, Loaded, ModelArgs};
use flashrt_serve::text::{RenderOptions, TextStream};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pyo3::create_exception!(
    _native,
    FlashrtError,
    pyo3::exceptions::PyException,
    "A flashrt runtime error."
);
pyo3::create_exception!(
    _native,
    CapsuleTypeError,
    PyTypeError,
    "A capsule of another model (another fingerprint) was given to a session."
);

fn err(e: Error) -> PyErr {
    match e {
        Error::Fingerprint { .. } => CapsuleTypeError::new_err(e.to_string()),
        Error::Input(m) => PyValueError::new_err(m),
        other => FlashrtError::new_err(other.to_string()),
    }
}

fn msg(e: String) -> PyErr {
    FlashrtError::new_err(e)
}

/// Token ids, or text through the model's tokenizer.
fn ids_of(model: &PyModel, tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(s) = tokens.extract::<String>() {
        let text = model.loaded.text.as_ref().ok_or_else(|| {
            PyValueError::new_err("this model has no tokenizer.json: give token ids")
        })?;
        return text.tokenizer.encode(&s).map_err(PyValueError::new_err);
    }
    tokens
        .extract::<Vec<u32>>()
        .map_err(|_| PyValueError::new_err("tokens must be a str or a sequence of ints"))
}

/// A model with its weights on a backend (`flashrt.Model`).
#[pyclass(name = "Model", module = "flashrt", frozen)]
pub struct PyModel {
    loaded: Arc<Loaded>,
}

impl PyModel {
    fn model(&self) -> &Model {
        &self.loaded.model
    }
}

#[pymethods]
impl PyModel {
    /// Load a Hugging Face checkpoint folder (`config.json`, safetensors, and its
    /// `tokenizer.json` and chat template when present) or a model TOML (with
    /// `random_weights=True` or `checkpoint=DIR`). `backend`: "auto", "cpu" or "cuda".
    /// `quantize="fp8"` quantizes the weights while they load (block-scaled E4M3).
    /// `decode_matmuls`: "cuda-cores" (default, the fastest single stream) or "tensor-cores"
    /// (several streams stepped together); the CPU ignores it.
    #[new]
    #[pyo3(signature = (path, *, backend="auto", random_weights=false, seed=0, checkpoint=None, max_seq=None, buckets=None, dtype=None, tokenizer=None, quantize=None, decode_matmuls=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        random_weights: bool,
        seed: u64,
        checkpoint: Option<PathBuf>,
        max_seq: Option<usize>,
        buckets: Option<Vec<usize>>,
        dtype: Option<String>,
        tokenizer: Option<PathBuf>,
        quantize: Option<String>,
        decode_matmuls: Option<String>,
    ) -> PyResult<PyModel> {
        let backend = match backend {
            "auto" => None,
            "cpu" => Some(BackendKind::Cpu),
            "cuda" => Some(BackendKind::Cuda),
            b => {
                return Err(PyValueError::new_err(format!(
                    "backend must be \"auto\", \"cpu\" or \"cuda\", not {b:?}"
                )));
            }
        };
        let dtype = dtype
            .map(|d| {
                flashrt_runtime::ir::DType::parse(&d)
                    .ok_or_else(|| PyValueError::new_err(format!("unknown dtype {d:?}")))
            })
            .transpose()?;
        let quantize = quantize
            .map(|q| {
                flashrt_runtime::ir::QuantFormat::parse(&q)
                    .map(|f| flashrt_runtime::ir::QuantIr::with_defaults(f, [128, 128]))
                    .ok_or_else(|| {
                        PyValueError::new_err(format!("unknown quantization {q:?} (fp8)"))
                    })
            })
            .transpose()?;
        let decode_matmuls = match decode_matmuls.as_deref() {
            None => None,
            Some("cuda-cores") => Some(DecodeMatmuls::CudaCores),
            Some("tensor-cores") => Some(DecodeMatmuls::TensorCores),
            Some(u) => {
                return Err(PyValueError::new_err(format!(
                    "decode_matmuls must be \"cuda-cores\" or \"tensor-cores\", not {u:?}"
                )));
            }
        };
        let args = ModelArgs {
            model: Some(path),
            checkpoint,
            random_weights,
            seed,
            backend,
            max_seq,
            buckets,
            dtype,
            tokenizer,
            quantize,
            decode_matmuls,
        };
        let loaded = py.detach(|| flashrt_serve::cli::open(&args)).map_err(msg)?;
        Ok(PyModel {
            loaded: Arc::new(loaded),
        })
    }

    #[getter]
    fn name(&self) -> String {
        self.model().name().to_string()
    }
    /// Layout + weights digest: capsules restore only into a model of the same fingerprint.
    #[getter]
    fn fingerprint(&self) -> String {
        self.model().fingerprint().to_string()
    }
    #[getter]
    fn vocab(&self) -> usize {
        self.model().vocab()
    }
    #[getter]
    fn max_seq(&self) -> usize {
        self.model().max_seq()
    }
    #[getter]
    fn backend(&self) -> String {
        self.model().backend_name()
    }
    #[getter]
    fn has_tokenizer(&self) -> bool {
        self.loaded.text.is_some()
    }
    #[getter]
    fn has_chat_template(&self) -> bool {
        self.loaded
            .text
            .as_ref()
            .is_some_and(|t| t.template.is_some())
    }
    /// Every end-of-sequence id (generation stops there unless `ignore_eos`).
    #[getter]
    fn eos(&self) -> Vec<u32> {
        self.loaded.eos()
    }
    /// Names of the state regions a capsule holds.
    #[getter]
    fn state_regions(&self) -> Vec<String> {
        self.model()
            .compiled()
            .layout
            .state_buffers()
            .map(|b| b.name.clone())
            .collect()
    }

    /// Time every decode, verify and prefill plan on a scratch session (median of `runs`
    /// each) and make appends choose their steps by the measurements: worth it on a GPU,
    /// where a step costs its plan's rows whatever it is given (`flashrt serve` does it at
    /// start-up). Returns `(plan, ms of a full step, ms per row)` for every plan.
    #[pyo3(signature = (runs=3))]
    fn calibrate_chunking(&self, py: Python<'_>, runs: usize) -> PyResult<Vec<(String, f64, f64)>> {
        let costs = py
            .detach(|| self.model().calibrate_chunking(runs, &mut |_| {}))
            .map_err(err)?;
        Ok(costs
            .plans()
            .iter()
            .map(|p| (p.phase.label(), p.cost(p.rows()), p.per_row))
            .collect())
    }

    /// The steps an append of `n` tokens runs: `(plan, rows)` in order.
    fn chunk_plan(&self, n: usize) -> Vec<(String, usize)> {
        self.model()
            .plan_chunks(n)
            .into_iter()
            .map(|(phase, rows)| (phase.label(), rows))
            .collect()
    }

    /// A fresh session (zeroed state, position 0).
    fn session(&self, py: Python<'_>) -> PyResult<PySession> {
        let s = py.detach(|| self.model().session()).map_err(err)?;
        Ok(PySession::wrap(self.loaded.clone(), s))
    }

    /// One decode step for several sessions of this model at once: `sessions[i]` feeds
    /// `tokens[i]` at its own position. Each ends exactly as after its own `step` (same state
    /// bytes, same logits); on a GPU up to 8 of them run as one step that reads the weights
    /// once (`Model::step_batch`). A controller of several streams calls this once per tick.
    fn step_batch(
        &self,
        py: Python<'_>,
        sessions: Vec<Bound<'_, PySession>>,
        tokens: Vec<u32>,
    ) -> PyResult<()> {
        if sessions.len() != tokens.len() {
            return Err(PyValueError::new_err(format!(
                "step_batch: {} sessions but {} tokens",
                sessions.len(),
                tokens.len()
            )));
        }
        let handles: Vec<Handle> = sessions.iter().map(|s| s.get().inner.clone()).collect();
        for i in 0..handles.len() {
            if let Some(j) = (0..i).find(|&j| Arc::ptr_eq(&handles[i], &handles[j])) {
                return Err(PyValueError::new_err(format!(
                    "step_batch: sessions {j} and {i} are the same session"
                )));
            }
        }
        let model = self.model().clone();
        py.detach(move || {
            // Locked in address order, so two batches over overlapping sessions cannot deadlock.
            let mut order: Vec<usize> = (0..handles.len()).collect();
            order.sort_by_key(|&i| Arc::as_ptr(&handles[i]) as usize);
            let mut guards: Vec<Option<std::sync::MutexGuard<'_, Shared>>> =
                (0..handles.len()).map(|_| None).collect();
            for &i in &order {
                guards[i] = Some(lock(&handles[i]));
            }
            let mut refs: Vec<&mut Session> = Vec::with_capacity(guards.len());
            for g in guards.iter_mut() {
                refs.push(g.as_mut().expect("locked above").settle()?);
            }
            model.step_batch(&mut refs, &tokens)
        })
        .map_err(err)
    }

    /// A new, independent session at `capsule`'s boundary.
    fn fork(&self, py: Python<'_>, capsule: &PyCapsule) -> PyResult<PySession> {
        let s = py
            .detach(|| self.model().fork(&capsule.inner))
            .map_err(err)?;
        Ok(PySession::wrap(self.loaded.clone(), s))
    }

    /// A capsule file written by `Capsule.save` (checked: format, checksums, fingerprint).
    fn load_capsule(&self, py: Python<'_>, path: PathBuf) -> PyResult<PyCapsule> {
        let c = py
            .detach(|| flashrt_runtime::capsule_file::read_capsule(&path, self.model()))
            .map_err(err)?;
        Ok(PyCapsule { inner: c })
    }

    /// Token ids of `text` (special tokens in it recognised).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        let t = self
            .loaded
            .text
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this model has no tokenizer.json"))?;
        t.tokenizer.encode(text).map_err(PyValueError::new_err)
    }

    /// The text of `ids` (special tokens left out unless `skip_special=False`).
    #[pyo3(signature = (ids, skip_special=true))]
    fn decode(&self, ids: Vec<u32>, skip_special: bool) -> PyResult<String> {
        let t = self
            .loaded
            .text
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this model has no tokenizer.json"))?;
        Ok(t.tokenizer.decode_with(&ids, skip_special))
    }

    /// `messages` (OpenAI-style dicts) and `tools` through the model's own chat template, as
    /// transformers' `apply_chat_template(tokenize=False)` renders them. Keyword arguments
    /// (`enable_thinking=False`, ...) reach the template.
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=true, **kwargs))]
    fn render_chat(
        &self,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let template = self
            .loaded
            .text
            .as_ref()
            .and_then(|t| t.template.as_ref())
            .ok_or_else(|| PyValueError::new_err("this model has no chat template"))?;
        let json = |o: &Bound<'_, PyAny>| -> PyResult<serde_json::Value> {
            let s: String = o
                .py()
                .import("json")?
                .call_method1("dumps", (o,))?
                .extract()?;
            serde_json::from_str(&s).map_err(|e| PyValueError::new_err(e.to_string()))
        };
        let mut kw = serde_json::Map::new();
        if let Some(k) = kwargs
            && let serde_json::Value::Object(m) = json(k.as_any())?
        {
            kw = m;
        }
        let opts = RenderOptions {
            tools: tools.map(json).transpose()?,
            add_generation_prompt,
            kwargs: kw,
        };
        template
            .render(&json(messages)?, &opts)
            .map_err(PyValueError::new_err)
    }

    /// Chat through the model's own template: render `messages` (and `tools`), feed the
    /// prompt and return the reply as a `Generation` (iterate it, or `.text()`). With
    /// `session`, a session whose history is a prefix of the rendered prompt (an earlier turn
    /// of this conversation, a restored capsule) feeds only the new tokens; any other session
    /// is reset first. Without, a fresh session is used (`Generation.session`).
    #[pyo3(signature = (messages, tools=None, *, session=None, max_tokens=256, temperature=None, top_k=None, top_p=None, min_p=None, seed=None, stop=None, ignore_eos=false, template_kwargs=None))]
    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        session: Option<&PySession>,
        max_tokens: usize,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<String>>,
        ignore_eos: bool,
        template_kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyGenerate> {
        let prompt = self.render_chat(messages, tools, true, template_kwargs)?;
        let ids = self.encode(&prompt)?;
        let s = match session {
            Some(s) => PySession {
                model: s.model.clone(),
                inner: s.inner.clone(),
            },
            None => self.session(py)?,
        };
        if s.model.model.fingerprint() != self.model().fingerprint() {
            return Err(PyValueError::new_err(
                "the session belongs to another model",
            ));
        }
        let reused = py
            .detach(|| {
                let mut g = lock(&s.inner);
                let sess = g.settle()?;
                let have = sess.tokens();
                let prefix = have.len() <= ids.len() && ids[..have.len()] == *have;
                // The whole prompt already fed: its logits must be there to sample from.
                let whole = have.len() == ids.len() && !sess.last_logits().is_empty();
                let reused = if prefix && (have.len() < ids.len() || whole) {
                    have.len()
                } else {
                    sess.reset()?;
                    0
                };
                if reused < ids.len() {
                    sess.append(&ids[reused..])?;
                }
                Ok(reused)
            })
            .map_err(err)?;
        let sp = Sampling {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        };
        let mut g = generation(
            py,
            &self.loaded,
            &s.inner,
            max_tokens,
            sp,
            stop,
            None,
            ignore_eos,
        )?;
        g.reused = reused;
        Ok(g)
    }

    fn __repr__(&self) -> String {
        format!(
            "flashrt.Model({:?}, backend={:?}, fingerprint={:?})",
            self.model().name(),
            self.model().backend_name(),
            self.model().fingerprint()
        )
    }
}

/// A session and the token a generation yielded last, not fed yet: it is fed before anything
/// else happens to the session (the next `__next__`, an append, a snapshot, ...), so a token
/// reaches the caller before its decode step runs, and every yielded token is part of the
/// history whatever the caller does next.
struct Shared {
    session: Session,
    unfed: Option<u32>,
}

impl Shared {
    fn settle(&mut self) -> flashrt_runtime::Result<&mut Session> {
        if let Some(t) = self.unfed.take() {
            self.session.append(&[t])?;
        }
        Ok(&mut self.session)
    }
}

type Handle = Arc<Mutex<Shared>>;

fn lock(h: &Handle) -> std::sync::MutexGuard<'_, Shared> {
    h.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `f` on the settled session with the GIL released.
fn on_device<R: Send>(
    py: Python<'_>,
    h: &Handle,
    f: impl FnOnce(&mut Session) -> flashrt_runtime::Result<R> + Send,
) -> PyResult<R> {
    let h = h.clone();
    py.detach(move || {
        let mut g = lock(&h);
        let s = g.settle()?;
        f(s)
    })
    .map_err(err)
}

/// One session's state on the backend (`flashrt.Session`).
#[pyclass(name = "Session", module = "flashrt", frozen)]
pub struct PySession {
    model: Arc<Loaded>,
    inner: Handle,
}

impl PySession {
    fn wrap(model: Arc<Loaded>, mut s: Session) -> PySession {
        s.set_logits_mode(LogitsMode::Last);
        PySession {
            model,
            inner: Arc::new(Mutex::new(Shared {
                session: s,
                unfed: None,
            })),
        }
    }

    fn py_model(&self) -> PyModel {
        PyModel {
            loaded: self.model.clone(),
        }
    }
}

/// The sampler a generate call asks for (unset: the checkpoint's defaults; greedy without).
fn sampler(
    model: &Loaded,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<u64>,
) -> PyResult<SamplerState> {
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    let d = model.defaults.sampler(seed);
    let s = SamplerState::seeded(
        seed,
        temperature.unwrap_or(d.temperature),
        top_k.unwrap_or(d.top_k),
        top_p.unwrap_or(d.top_p),
    )
    .with_min_p(min_p.unwrap_or(0.0));
    s.validate().map_err(err)?;
    Ok(s)
}

/// Sampling parameters a call sets (unset ones keep the session's sampler).
struct Sampling {
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    seed: Option<u64>,
}

/// The iterator behind `Session.generate` and `Model.chat`.
#[allow(clippy::too_many_arguments)]
fn generation(
    py: Python<'_>,
    model: &Arc<Loaded>,
    h: &Handle,
    max_tokens: usize,
    sp: Sampling,
    stop: Option<Vec<String>>,
    stop_ids: Option<Vec<u32>>,
    ignore_eos: bool,
) -> PyResult<PyGenerate> {
    if sp.temperature.is_some()
        || sp.top_k.is_some()
        || sp.top_p.is_some()
        || sp.min_p.is_some()
        || sp.seed.is_some()
    {
        let sm = sampler(model, sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed)?;
        on_device(py, h, move |s| {
            s.set_sampler(sm);
            Ok(())
        })?;
    }
    let mut stops = stop_ids.unwrap_or_default();
    if !ignore_eos {
        stops.extend(model.eos());
    }
    let stop_strings = stop.unwrap_or_default();
    Ok(PyGenerate {
        model: model.clone(),
        session: h.clone(),
        text: model
            .text
            .as_ref()
            .map(|t| TextStream::new(&t.tokenizer, &stop_strings)),
        left: max_tokens,
        stops,
        done: false,
        reused: 0,
    })
}

#[pymethods]
impl PySession {
    /// Tokens consumed so far.
    #[getter]
    fn pos(&self, py: Python<'_>) -> PyResult<usize> {
        on_device(py, &self.inner, |s| Ok(s.pos()))
    }
    /// The token history.
    #[getter]
    fn tokens(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        on_device(py, &self.inner, |s| Ok(s.tokens().to_vec()))
    }
    #[getter]
    fn model(&self) -> PyModel {
        self.py_model()
    }

    /// Feed tokens (ids, or text through the tokenizer): a prefill in chunks, or one decode
    /// step for a single token.
    fn append(&self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = ids_of(&self.py_model(), tokens)?;
        on_device(py, &self.inner, move |s| s.append(&ids))
    }

    /// Feed one token: one decode step (the inner loop of a controller).
    fn step(&self, py: Python<'_>, token: u32) -> PyResult<()> {
        on_device(py, &self.inner, move |s| s.append(&[token]))
    }

    /// Set the session's sampler (used by `sample` and `generate`): unset parameters come
    /// from the checkpoint's `generation_config.json` (greedy when it has none).
    #[pyo3(signature = (*, temperature=None, top_k=None, top_p=None, min_p=None, seed=None))]
    fn set_sampler(
        &self,
        py: Python<'_>,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        seed: Option<u64>,
    ) -> PyResult<()> {
        let sm = sampler(&self.model, temperature, top_k, top_p, min_p, seed)?;
        on_device(py, &self.inner, move |s| {
            s.set_sampler(sm);
            Ok(())
        })
    }

    /// The next token from the last logits with the session's sampler, without feeding it.
    fn sample(&self, py: Python<'_>) -> PyResult<u32> {
        on_device(py, &self.inner, |s| s.sample_next())
    }

    /// Greedy-decode `n` tokens (each fed): the ids.
    fn decode_greedy(&self, py: Python<'_>, n: usize) -> PyResult<Vec<u32>> {
        on_device(py, &self.inner, move |s| s.decode_greedy(n))
    }

    /// The logits after the last fed token, as a float32 NumPy array (`array.array("f")`
    /// without NumPy): one copy of the row.
    fn logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let bytes: Vec<u8> = on_device(py, &self.inner, |s| {
            Ok(s.last_logits()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect())
        })?;
        let b = PyBytes::new(py, &bytes);
        match py.import("numpy") {
            Ok(np) => np.call_method1("frombuffer", (b, "float32")),
            Err(_) => py.import("array")?.call_method1("array", ("f", b)),
        }
    }

    /// Sample up to `max_tokens` tokens: an iterator of `Token(id, text)`, each yielded as
    /// soon as it is chosen (its decode step runs when the next one is asked for, or before
    /// the session's next use). Ends at an end-of-sequence id (unless `ignore_eos`) or a
    /// `stop_ids` id (neither is yielded nor fed), or at a `stop` string (the text never
    /// includes it). Unset sampling parameters come from the checkpoint's
    /// `generation_config.json` (greedy when it has none); `seed` makes sampling repeatable.
    #[pyo3(signature = (max_tokens=16, *, temperature=None, top_k=None, top_p=None, min_p=None, seed=None, stop=None, stop_ids=None, ignore_eos=false))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        max_tokens: usize,
        temperature: Option<f32>,
        top_k: Option<usize>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        seed: Option<u64>,
        stop: Option<Vec<String>>,
        stop_ids: Option<Vec<u32>>,
        ignore_eos: bool,
    ) -> PyResult<PyGenerate> {
        let sampling = Sampling {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        };
        generation(
            py,
            &self.model,
            &self.inner,
            max_tokens,
            sampling,
            stop,
            stop_ids,
            ignore_eos,
        )
    }

    /// The whole state at this boundary.
    fn snapshot(&self, py: Python<'_>) -> PyResult<PyCapsule> {
        let c = on_device(py, &self.inner, |s| s.snapshot())?;
        Ok(PyCapsule { inner: c })
    }

    /// Back to `capsule`'s boundary: every state byte equal to the snapshot's.
    fn restore(&self, py: Python<'_>, capsule: &PyCapsule) -> PyResult<()> {
        let c = capsule.inner.clone();
        on_device(py, &self.inner, move |s| s.restore(&c))
    }

    /// K/V rows of `capsule` this session holds already, which `restore(capsule)` does not
    /// copy: all of them after restoring or snapshotting it, while the session only moved on
    /// (a reset to a checkpoint costs its non-KV state, not its K/V); none after `reset`.
    fn rows_held(&self, py: Python<'_>, capsule: &PyCapsule) -> PyResult<usize> {
        let c = capsule.inner.clone();
        on_device(py, &self.inner, move |s| Ok(s.rows_held(&c)))
    }

    /// Back to an earlier boundary of this session's own history.
    fn rollback(&self, py: Python<'_>, capsule: &PyCapsule) -> PyResult<()> {
        let c = capsule.inner.clone();
        on_device(py, &self.inner, move |s| s.rollback(&c))
    }

    /// The KV-only ablation: restore attention K/V but not the recurrent and conv state (an
    /// experiment; the continuation diverges).
    fn restore_kv_only(&self, py: Python<'_>, capsule: &PyCapsule) -> PyResult<()> {
        let c = capsule.inner.clone();
        on_device(py, &self.inner, move |s| s.restore_kv_only(&c))
    }

    /// Back to position 0, zeroed state.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.inner.clone();
        py.detach(move || {
            let mut g = lock(&h);
            g.unfed = None;
            g.session.reset()
        })
        .map_err(err)
    }

    /// The current bytes of state region `name` (KV: up to the position).
    fn read_region<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let name = name.to_string();
        let b = on_device(py, &self.inner, move |s| s.read_region(name.as_str()))?;
        Ok(PyBytes::new(py, &b))
    }

    /// Wait for the backend to finish queued work (for timing).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        on_device(py, &self.inner, |s| s.synchronize())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("flashrt.Session(pos={})", self.pos(py).unwrap_or(0))
    }
}

/// One generated token.
#[pyclass(name = "Token", module = "flashrt", frozen, get_all)]
pub struct PyToken {
    pub id: u32,
    /// The text this token made visible (whole characters; may be empty).
    pub text: String,
}

#[pymethods]
impl PyToken {
    fn __repr__(&self) -> String {
        format!("flashrt.Token(id={}, text={:?})", self.id, self.text)
    }
}

/// The iterator `Session.generate` returns.
#[pyclass(name = "Generation", module = "flashrt")]
pub struct PyGenerate {
    model: Arc<Loaded>,
    session: Handle,
    text: Option<TextStream>,
    left: usize,
    stops: Vec<u32>,
    done: bool,
    reused: usize,
}

#[pymethods]
impl PyGenerate {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The session this generation runs in (snapshot it to keep the reply).
    #[getter]
    fn session(&self) -> PySession {
        PySession {
            model: self.model.clone(),
            inner: self.session.clone(),
        }
    }

    /// For `Model.chat` with a session: prompt tokens already in it (not prefilled again).
    #[getter]
    fn reused(&self) -> usize {
        self.reused
    }

    /// Run the generation to its end: the text of every token not yet yielded.
    fn text(&mut self, py: Python<'_>) -> PyResult<String> {
        let mut out = String::new();
        while let Some(t) = self.__next__(py)? {
            out.push_str(&t.text);
        }
        Ok(out)
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<PyToken>> {
        if self.done || self.left == 0 {
            return Ok(None);
        }
        let h = self.session.clone();
        // Feed the token yielded last, then choose the next one (GIL released).
        let next = py
            .detach(move || -> flashrt_runtime::Result<Option<(u32, bool)>> {
                let mut g = lock(&h);
                let s = g.settle()?;
                let max = s.model().max_seq();
                if s.pos() >= max {
                    return Ok(None);
                }
                let t = s.sample_next()?;
                Ok(Some((t, s.pos() + 1 >= max)))
            })
            .map_err(err)?;
        let Some((t, at_end)) = next else {
            self.done = true;
            return Ok(None);
        };
        if self.stops.contains(&t) {
            self.done = true;
            return Ok(None);
        }
        self.left -= 1;
        let piece = self.text.as_mut().map(|ts| ts.push(t)).unwrap_or_default();
        let mut text = piece.text;
        if piece.stop || self.left == 0 || at_end {
            self.done = true;
            if !piece.stop
                && let Some(ts) = self.text.as_mut()
            {
                text.push_str(&ts.finish().text);
            }
        }
        lock(&self.session).unfed = Some(t);
        Ok(Some(PyToken { id: t, text }))
    }
}

/// A session's whole execution state at a token boundary (`flashrt.Capsule`).
#[pyclass(name = "Capsule", module = "flashrt", frozen)]
pub struct PyCapsule {
    inner: Capsule,
}

#[pymethods]
impl PyCapsule {
    #[getter]
    fn pos(&self) -> usize {
        self.inner.pos()
    }
    /// The token history `[0, pos)`.
    #[getter]
    fn tokens(&self) -> Vec<u32> {
        self.inner.tokens().to_vec()
    }
    /// Bytes of state it holds.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }
    #[getter]
    fn model(&self) -> String {
        self.inner.meta().model.clone()
    }
    #[getter]
    fn fingerprint(&self) -> String {
        self.inner.fingerprint().to_string()
    }
    /// Where its bytes live ("host", "cuda:0", ...).
    #[getter]
    fn location(&self) -> String {
        self.inner.location().to_string()
    }
    /// The bytes of state region `name`.
    fn region<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.inner.region(name).map_err(err)?;
        Ok(PyBytes::new(py, &b))
    }
    /// Write a standalone capsule file (versioned, fingerprinted, checksummed, atomic);
    /// returns its size.
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<u64> {
        let c = self.inner.clone();
        py.detach(move || flashrt_runtime::capsule_file::write_capsule(&path, &c))
            .map_err(err)
    }
    fn __repr__(&self) -> String {
        format!(
            "flashrt.Capsule(model={:?}, pos={}, nbytes={})",
            self.inner.meta().model,
            self.inner.pos(),
            self.inner.bytes()
        )
    }
}

/// Reference timings for the overhead benchmark: `n` decode steps of `tokens` (cycled)
/// driven from a Rust loop, seconds per step (the same steps `Session.step` drives from
/// Python).
#[pyfunction]
fn _rust_decode_steps(
    py: Python<'_>,
    session: &PySession,
    tokens: Vec<u32>,
    n: usize,
) -> PyResult<f64> {
    if tokens.is_empty() || n == 0 {
        return Err(PyValueError::new_err("tokens and n must not be empty"));
    }
    on_device(py, &session.inner, move |s| {
        s.synchronize()?;
        let t0 = Instant::now();
        for i in 0..n {
            s.append(&[tokens[i % tokens.len()]])?;
        }
        s.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() / n as f64)
    })
}

/// Reference timings for the robot loop: `iters` times restore `capsule`, feed `tokens`,
/// choose the next token (greedy); seconds per iteration, from a Rust loop.
#[pyfunction]
fn _rust_restore_to_first_token(
    py: Python<'_>,
    session: &PySession,
    capsule: &PyCapsule,
    tokens: Vec<u32>,
    iters: usize,
) -> PyResult<Vec<f64>> {
    let c = capsule.inner.clone();
    on_device(py, &session.inner, move |s| {
        let mut out = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t0 = Instant::now();
            s.restore(&c)?;
            s.append(&tokens)?;
            let _ = flashrt_runtime::argmax(s.last_logits());
            s.synchronize()?;
            out.push(t0.elapsed().as_secs_f64());
        }
        Ok(out)
    })
}

#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyModel>()?;
    m.add_class::<PySession>()?;
    m.add_class::<PyCapsule>()?;
    m.add_class::<PyToken>()?;
    m.add_class::<PyGenerate>()?;
    m.add("Error", m.py().get_type::<FlashrtError>())?;
    m.add("CapsuleTypeError", m.py().get_type::<CapsuleTypeError>())?;
    m.add_function(wrap_pyfunction!(_rust_decode_steps, m)?)?;
    m.add_function(wrap_pyfunction!(_rust_restore_to_first_token, m)?)?;
    Ok(())
}
