//! The OpenAI-compatible surface: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
//! (JSON or SSE), with automatic prefix reuse through the worker.

use super::batch::{complete_batch, completion_prompts, stream_batch};
use super::prompt::Prompt;
use super::*;
use flashrt_runtime::sampling::{MAX_TOP_LOGPROBS, TokenLogprobs};

pub(super) async fn models(State(st): St) -> Response {
    ok(json!({
        "object": "list",
        "data": [{"id": st.model_name, "object": "model", "owned_by": "flashrt",
                  "max_seq": st.max_seq, "vocab": st.vocab, "fingerprint": st.fingerprint}],
    }))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompletionBody {
    /// Must name this server's model when given (404 `model_not_found` otherwise).
    model: Option<String>,
    prompt: Option<Prompt>,
    /// Chat messages as sent (the template sees them unchanged).
    messages: Option<Vec<Value>>,
    /// OpenAI function definitions, rendered by the chat template.
    tools: Option<Value>,
    /// Extra template variables (`{"enable_thinking": false}`), as vLLM takes them.
    chat_template_kwargs: Option<Value>,
    add_generation_prompt: Option<bool>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: bool,
    n: Option<usize>,
    #[serde(default)]
    echo: bool,
    logprobs: Option<Value>,
    /// flashrt: at most this many MTP drafts per round for a greedy request (0: plain
    /// decoding; default: the server's `--speculative`).
    speculative: Option<usize>,
    top_logprobs: Option<Value>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    // OpenAI parameters a client may send at their no-op values; anything else is refused,
    // naming the parameter, rather than silently ignored.
    logit_bias: Option<Value>,
    best_of: Option<usize>,
    suffix: Option<Value>,
    response_format: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<Value>,
    stream_options: Option<Value>,
    /// An end-user id (OpenAI's abuse-monitoring field): accepted, not used.
    #[allow(dead_code)]
    user: Option<String>,
}

impl CompletionBody {
    /// Refuse parameters this server does not implement, naming the first one found.
    fn check_unsupported(&self) -> Result<(), ApiError> {
        let refuse = |p: &str, why: &str| {
            Err(ApiError::bad(
                "unsupported_parameter",
                format!("`{p}` is not supported by this server ({why})"),
            ))
        };
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|x| !x.is_null());
        if self
            .logit_bias
            .as_ref()
            .is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()))
        {
            return refuse("logit_bias", "leave it empty");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return refuse("best_of", "one completion per request");
        }
        if set(&self.suffix) {
            return refuse("suffix", "no insertion mode");
        }
        if let Some(r) = &self.response_format
            && !r.is_null()
            && r.get("type").and_then(Value::as_str) != Some("text")
        {
            return refuse(
                "response_format",
                "no constrained decoding; only {\"type\": \"text\"}",
            );
        }
        if let Some(c) = &self.tool_choice
            && !c.is_null()
            && c.as_str() != Some("auto")
            && c.as_str() != Some("none")
        {
            return refuse(
                "tool_choice",
                "the model decides whether to call a tool: \"auto\" or \"none\" only",
            );
        }
        if let Some(p) = &self.parallel_tool_calls
            && !p.is_null()
            && p != &Value::Bool(true)
        {
            return refuse("parallel_tool_calls", "only the model's default, true");
        }
        if let Some(o) = &self.stream_options
            && !o.is_null()
            && o.as_object()
                .is_none_or(|m| m.keys().any(|k| k != "include_usage"))
        {
            return refuse(
                "stream_options",
                "only include_usage (the last chunk always carries the usage)",
            );
        }
        Ok(())
    }
}

/// A chat message's `content` as token ids, on a server without a tokenizer (text answers
/// `no_tokenizer`).
fn message_ids(st: &AppState, p: &Value) -> Result<Vec<u32>, ApiError> {
    match p {
        Value::String(s) => to_ids(st, Tokens::Text(s.clone())),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .ok_or_else(|| {
                        ApiError::bad(
                            "invalid_tokens",
                            format!("`{x}` is not a token id (an integer in 0..2^32)"),
                        )
                    })
            })
            .collect(),
        _ => Err(ApiError::bad(
            "invalid_prompt",
            "a message's content must be token ids (an array of integers) or, with a \
             tokenizer, a string",
        )),
    }
}

/// The prompt of a chat request: the model's chat template over the messages (and tools)
/// exactly as sent, then tokenized; without a tokenizer, each message's content must be
/// token ids, concatenated.
fn chat_ids(st: &AppState, b: &CompletionBody, owner: &str) -> Result<Vec<u32>, ApiError> {
    let msgs = b
        .messages
        .as_deref()
        .ok_or_else(|| ApiError::bad("invalid_request", "`messages` is required"))?;
    if msgs.is_empty() {
        return Err(ApiError::bad("invalid_request", "`messages` is empty"));
    }
    for (i, m) in msgs.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::bad(
                "invalid_request",
                format!("messages[{i}] needs a string `role`"),
            ));
        }
    }
    match &st.text {
        Some(text) => {
            let Some(template) = &text.template else {
                return Err(ApiError::bad(
                    "no_chat_template",
                    "this model has no chat template (no chat_template.jinja, no chat_template \
                     in tokenizer_config.json): use /v1/completions with a prompt",
                ));
            };
            let kwargs = match &b.chat_template_kwargs {
                None | Some(Value::Null) => serde_json::Map::new(),
                Some(Value::Object(m)) => m.clone(),
                Some(_) => {
                    return Err(ApiError::bad(
                        "invalid_request",
                        "`chat_template_kwargs` must be an object",
                    ));
                }
            };
            let tools = match &b.tools {
                None | Some(Value::Null) => None,
                Some(t @ Value::Array(_)) => Some(t.clone()),
                Some(_) => {
                    return Err(ApiError::bad("invalid_request", "`tools` must be a list"));
                }
            };
            let opts = RenderOptions {
                tools,
                add_generation_prompt: b.add_generation_prompt.unwrap_or(true),
                kwargs,
            };
            let prompt = template
                .render(&Value::Array(msgs.to_vec()), &opts)
                .map_err(|e| ApiError::bad("chat_template", e))?;
            // A conversation sent again with a new turn: its earlier turns' ids are reused.
            text.prefixes
                .encode(&text.tokenizer, owner, &prompt)
                .map_err(|e| ApiError::bad("tokenizer", e))
        }
        None => {
            let mut ids = Vec::new();
            for m in msgs {
                if !m["content"].is_array() {
                    return Err(ApiError::bad(
                        "no_tokenizer",
                        "this server has no tokenizer: give each message's content as token ids",
                    ));
                }
                ids.extend(message_ids(st, &m["content"])?);
            }
            Ok(ids)
        }
    }
}

/// The number of alternatives a `top_logprobs`-style count asks for, checked (0..=20).
pub(super) fn top_logprobs_count(n: Option<usize>) -> Result<Option<usize>, ApiError> {
    match n {
        Some(k) if k > MAX_TOP_LOGPROBS => Err(ApiError::bad(
            "invalid_request",
            format!("at most {MAX_TOP_LOGPROBS} alternatives per token (asked for {k})"),
        )),
        n => Ok(n),
    }
}

/// What `logprobs` / `top_logprobs` ask for: chat takes `logprobs: true` and
/// `top_logprobs: 0..=20`; completions take `logprobs: 0..=20` (alternatives per token).
fn logprobs_req(b: &CompletionBody, chat: bool) -> Result<Option<usize>, ApiError> {
    let bad = |m: &str| Err(ApiError::bad("invalid_request", m.to_string()));
    let count = |v: &Value, what: &str| -> Result<usize, ApiError> {
        v.as_u64().map(|n| n as usize).ok_or_else(|| {
            ApiError::bad(
                "invalid_request",
                format!("`{what}` must be a whole number from 0 to {MAX_TOP_LOGPROBS}"),
            )
        })
    };
    let top = match &b.top_logprobs {
        None | Some(Value::Null) => None,
        Some(v) => Some(count(v, "top_logprobs")?),
    };
    if chat {
        let on = match &b.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(_) => return bad("`logprobs` must be true or false"),
        };
        if !on {
            if top.is_some_and(|k| k > 0) {
                return bad("`top_logprobs` needs `logprobs: true`");
            }
            return Ok(None);
        }
        top_logprobs_count(Some(top.unwrap_or(0)))
    } else {
        if top.is_some_and(|k| k > 0) {
            return Err(ApiError::bad(
                "unsupported_parameter",
                "`top_logprobs` is a chat parameter; /v1/completions takes `logprobs: N`",
            ));
        }
        match &b.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            Some(v) => top_logprobs_count(Some(count(v, "logprobs")?)),
        }
    }
}

/// A token as `logprobs` name it: its text (the tokenizer's), else `token_id:N`.
fn token_str(st: &AppState, id: u32) -> String {
    match &st.text {
        Some(t) => t.tokenizer.decode_with(&[id], false),
        None => format!("token_id:{id}"),
    }
}

/// A log-probability for JSON (which has no infinities): OpenAI's -9999 for "impossible".
fn lp_json(x: f64) -> f64 {
    if x.is_finite() { x } else { -9999.0 }
}

/// One token's log-probability and alternatives: from a stream event or the summary.
struct Lp {
    token: u32,
    logprob: f64,
    top: Vec<(u32, f64)>,
}

impl Lp {
    fn of(l: &TokenLogprobs) -> Lp {
        Lp {
            token: l.token,
            logprob: l.logprob as f64,
            top: l.top.iter().map(|&(id, p)| (id, p as f64)).collect(),
        }
    }

    /// The worker's summary form (`{"token", "logprob", "top": [[id, lp]]}`; a logprob
    /// JSON could not carry is null).
    fn all_of(v: &Value) -> Option<Vec<Lp>> {
        let num = |x: &Value| x.as_f64().unwrap_or(f64::NEG_INFINITY);
        v.as_array().map(|a| {
            a.iter()
                .map(|e| Lp {
                    token: e["token"].as_u64().unwrap_or(0) as u32,
                    logprob: num(&e["logprob"]),
                    top: e["top"]
                        .as_array()
                        .map(|t| {
                            t.iter()
                                .map(|p| (p[0].as_u64().unwrap_or(0) as u32, num(&p[1])))
                                .collect()
                        })
                        .unwrap_or_default(),
                })
                .collect()
        })
    }
}

/// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
fn chat_logprobs(st: &AppState, lps: &[Lp]) -> Value {
    let entry = |id: u32, lp: f64| {
        let s = token_str(st, id);
        json!({"token": s, "logprob": lp_json(lp), "bytes": s.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|&(id, p)| entry(id, p)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs`: `{tokens, token_logprobs, top_logprobs, text_offset}`; `offset`
/// is the text offset (characters of the completion) of the first token, advanced past them.
fn completion_logprobs(st: &AppState, lps: &[Lp], offset: &mut usize) -> Value {
    let mut tokens = Vec::new();
    let mut offsets = Vec::new();
    for l in lps {
        let s = token_str(st, l.token);
        offsets.push(*offset);
        *offset += s.chars().count();
        tokens.push(s);
    }
    json!({
        "tokens": tokens,
        "token_logprobs": lps.iter().map(|l| lp_json(l.logprob)).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| {
            l.top.iter().map(|&(id, p)| (token_str(st, id), json!(lp_json(p))))
                .collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

fn completion_req(st: &AppState, b: &CompletionBody, chat: bool) -> Result<GenReq, ApiError> {
    if let Some(m) = &b.model
        && m != &st.model_name
    {
        return Err(ApiError::not_found(
            "model_not_found",
            format!(
                "model `{}` is not served here; this server serves `{}`",
                m.escape_debug(),
                st.model_name
            ),
        ));
    }
    b.check_unsupported()?;
    let n = b.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::bad(
            "invalid_request",
            format!("`n` must be 1 to {MAX_CHOICES} (got {n})"),
        ));
    }
    if b.echo {
        return Err(ApiError::bad("unsupported", "echo is not supported"));
    }
    let logprobs = logprobs_req(b, chat)?;
    let stop_strings: Vec<String> = match &b.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::bad("invalid_request", "`stop` must be strings"))?,
        _ => return Err(ApiError::bad("invalid_request", "`stop` must be strings")),
    };
    if !stop_strings.is_empty() && st.text.is_none() {
        return Err(ApiError::bad(
            "no_tokenizer",
            "`stop` strings need a tokenizer; use `stop_token_ids`",
        ));
    }
    let sampler = SamplerBody {
        temperature: b.temperature,
        top_k: b.top_k,
        top_p: b.top_p,
        min_p: b.min_p,
        seed: b.seed,
        presence_penalty: b.presence_penalty,
        frequency_penalty: b.frequency_penalty,
        repetition_penalty: b.repetition_penalty,
    }
    .build(st)?;
    Ok(GenReq {
        max_tokens: max_tokens(st, b.max_completion_tokens.or(b.max_tokens), 16)?,
        sampler: Some(sampler),
        stop: stops(st, b.stop_token_ids.clone(), b.ignore_eos),
        stop_strings,
        logprobs,
        speculative: match b.speculative {
            Some(k) if k > flashrt_runtime::ir::lower::MAX_DRAFT => {
                return Err(ApiError::bad(
                    "invalid_request",
                    format!(
                        "`speculative`: at most {} drafts per round (asked for {k})",
                        flashrt_runtime::ir::lower::MAX_DRAFT
                    ),
                ));
            }
            k => k,
        },
        n,
    })
}

/// Most choices one completion request may ask for (`n`).
pub const MAX_CHOICES: usize = 16;

/// `/v1/completions`' body; a prompt of token ids through the fast path
/// ([`super::prompt::split_ids`]), anything else (and any body the fast path's rest does not
/// parse) through serde whole, so answers and errors are serde's.
async fn completion_body(st: &AppState, body: Body) -> Result<CompletionBody, ApiError> {
    let bytes = read_body(st, body).await?;
    if let Some((ids, rest)) = super::prompt::split_ids(&bytes)
        && let Ok(mut b) = serde_json::from_slice::<CompletionBody>(&rest)
    {
        b.prompt = Some(Prompt::Ids(ids));
        return Ok(b);
    }
    parse_bytes(&bytes)
}

pub(super) async fn completions(State(st): St, body: Body) -> Response {
    openai(st, body, false).await
}

pub(super) async fn chat_completions(State(st): St, body: Body) -> Response {
    openai(st, body, true).await
}

pub(super) async fn openai(st: Arc<AppState>, body: Body, chat: bool) -> Response {
    let t0 = std::time::Instant::now();
    let r = async {
        let b = if chat {
            parse(&st, body).await?
        } else {
            completion_body(&st, body).await?
        };
        // Each endpoint's own parameters only.
        let misplaced = if chat {
            [
                ("prompt", b.prompt.is_some()),
                ("suffix", b.suffix.is_some()),
            ]
        } else {
            [
                ("messages", b.messages.is_some()),
                ("tools", b.tools.is_some() || b.tool_choice.is_some()),
            ]
        };
        if let Some((p, _)) = misplaced.iter().find(|(_, set)| *set) {
            return Err(ApiError::bad(
                "unsupported_parameter",
                format!(
                    "`{p}` is not a parameter of {}",
                    if chat {
                        "/v1/chat/completions"
                    } else {
                        "/v1/completions (use /v1/chat/completions)"
                    }
                ),
            ));
        }
        let req = completion_req(&st, &b, chat)?;
        let stream = b.stream;
        // Templating and tokenizing a long prompt takes milliseconds (~30 ms for 20k tokens
        // of text on a build machine's core): off the HTTP thread, whose event loop streams
        // every other client's tokens meanwhile.
        let text = st.text.is_some() && (chat || b.prompt.as_ref().is_some_and(Prompt::has_text));
        let req2 = req.clone();
        let st2 = st.clone();
        let owner = current_tenant()?.name;
        let prepare = move || -> Result<Vec<Vec<u32>>, ApiError> {
            if chat {
                return Ok(vec![chat_ids(&st2, &b, &owner)?]);
            }
            let p = b
                .prompt
                .ok_or_else(|| ApiError::bad("invalid_request", "`prompt` is required"))?;
            completion_prompts(&st2, p, &req2, &owner)
        };
        let prompts = if text {
            tokio::task::spawn_blocking(prepare).await.map_err(|_| {
                ApiError::new(
                    500,
                    "internal",
                    "internal error while tokenizing the prompt",
                )
            })??
        } else {
            prepare()?
        };
        Ok::<_, ApiError>((prompts, req, stream))
    }
    .await;
    let (mut prompts, req, stream) = match r {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    // Reading and parsing the body (and tokenizing or templating the prompt): the part of
    // the request's time before the worker's queue, added to its `timings`.
    let parse_ms = (t0.elapsed().as_secs_f64() * 1e6).round() / 1e3;
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-{n:x}", if chat { "chatcmpl" } else { "cmpl" });
    let created = flashrt_runtime::capsule_file::now_ms() / 1000;
    if !stream {
        let answer = if prompts.len() == 1 {
            call(
                &st,
                Cmd::Complete {
                    prompt: prompts.pop().expect("one prompt"),
                    req,
                    stream: None,
                },
            )
            .await
        } else {
            complete_batch(&st, prompts, req).await
        };
        return match answer {
            Ok(Out::Json(mut v)) => {
                if v["timings"].is_object() {
                    v["timings"]["parse_ms"] = json!(parse_ms);
                }
                let body = completion_json(&st, &id, created, chat, &v);
                let mut r = ok(body);
                let t = TokenCount::default();
                t.set(
                    v["prompt_tokens"].as_u64().unwrap_or(0),
                    completion_tokens(&v),
                );
                r.extensions_mut().insert(t);
                r
            }
            Ok(_) => ApiError::new(500, "internal", "unexpected answer").into_response(),
            Err(e) => e.into_response(),
        };
    }
    let rx = if prompts.len() == 1 {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Err(e) = call(
            &st,
            Cmd::Complete {
                prompt: prompts.pop().expect("one prompt"),
                req,
                stream: Some(tx),
            },
        )
        .await
        {
            return e.into_response();
        }
        rx
    } else {
        match stream_batch(&st, prompts, req).await {
            Ok(rx) => rx,
            Err(e) => return e.into_response(),
        }
    };
    let st2 = st.clone();
    let mut first = true;
    let mut offset = 0usize;
    let mut index = 0usize;
    // n > 1: choices may interleave; each keeps its own first-chunk flag and text offset
    // (saved here while another choice streams).
    let mut saved: std::collections::HashMap<usize, (bool, usize)> =
        std::collections::HashMap::new();
    let count = TokenCount::default();
    let count2 = count.clone();
    let mut r = sse(
        rx,
        Box::new(move |ev| {
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let choice = |piece: String,
                          tokens: Vec<u32>,
                          finish: Value,
                          first: bool,
                          lp: Value| {
                if chat {
                    let mut delta = json!({"content": piece, "token_ids": tokens});
                    if first {
                        delta["role"] = json!("assistant");
                    }
                    json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": piece, "token_ids": tokens, "logprobs": lp, "finish_reason": finish})
                }
            };
            // The chunk that ends a choice: no text, its finish reason.
            let finish = |v: &Value, first: bool| {
                choice(
                    String::new(),
                    vec![],
                    v["finish_reason"].clone(),
                    first,
                    Value::Null,
                )
            };
            let chunk = |c: Value| {
                json!({"id": id, "object": object, "created": created, "model": st2.model_name,
                   "system_fingerprint": st2.fingerprint, "choices": [c]})
                .to_string()
            };
            match ev {
                Event::Token(t, piece, lp) => {
                    let lp = match lp {
                        Some(l) if chat => chat_logprobs(&st2, &[Lp::of(&l)]),
                        Some(l) => completion_logprobs(&st2, &[Lp::of(&l)], &mut offset),
                        None => Value::Null,
                    };
                    let c = choice(piece, t.into_iter().collect(), Value::Null, first, lp);
                    first = false;
                    vec![chunk(c)]
                }
                Event::Choice(i) => {
                    saved.insert(index, (first, offset));
                    index = i;
                    (first, offset) = saved.get(&i).copied().unwrap_or((true, 0));
                    vec![]
                }
                // n > 1: each choice's last chunk carries its finish reason.
                Event::ChoiceEnd(v) => vec![chunk(finish(&v, first))],
                Event::Done(v) => {
                    count2.set(
                        v["prompt_tokens"].as_u64().unwrap_or(0),
                        completion_tokens(&v),
                    );
                    // The last chunk carries the finish reason (n = 1; with more choices their
                    // own last chunks did) and, like OpenAI's `include_usage`, the usage.
                    let mut last: Value = if v["choices"].is_array() {
                        serde_json::from_str(&chunk(Value::Null)).unwrap_or_default()
                    } else {
                        serde_json::from_str(&chunk(finish(&v, first))).unwrap_or_default()
                    };
                    if v["choices"].is_array() {
                        last["choices"] = json!([]);
                    }
                    last["usage"] = usage(&v);
                    if !v["speculative"].is_null() {
                        last["speculative"] = v["speculative"].clone();
                    }
                    if !v["timings"].is_null() {
                        last["timings"] = v["timings"].clone();
                        if v["timings"].is_object() {
                            last["timings"]["parse_ms"] = json!(parse_ms);
                        }
                    }
                    vec![last.to_string(), "[DONE]".to_string()]
                }
                Event::Error(e) => vec![e.body().to_string(), "[DONE]".to_string()],
            }
        }),
    );
    r.extensions_mut().insert(count);
    r
}

/// Generated tokens of a worker summary: one choice's, or all choices' (`n` > 1).
pub(super) fn completion_tokens(v: &Value) -> u64 {
    v["completion_tokens"]
        .as_u64()
        .unwrap_or_else(|| v["tokens"].as_array().map_or(0, |a| a.len() as u64))
}

fn usage(v: &Value) -> Value {
    let p = v["prompt_tokens"].as_u64().unwrap_or(0);
    let c = completion_tokens(v);
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": v["cached_tokens"]}})
}

fn completion_json(st: &AppState, id: &str, created: u64, chat: bool, v: &Value) -> Value {
    let choices: Vec<Value> = match v["choices"].as_array() {
        // n > 1: each choice as the worker summarised it.
        Some(cs) => cs.iter().map(|c| choice_json(st, chat, c)).collect(),
        None => vec![choice_json(st, chat, v)],
    };
    let mut body = json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": st.model_name,
        "system_fingerprint": st.fingerprint,
        "seed": v["seed"],
        "choices": choices,
        "usage": usage(v),
    });
    // flashrt: what speculative rounds did for this request, when it could speculate.
    if !v["speculative"].is_null() {
        body["speculative"] = v["speculative"].clone();
    }
    // flashrt: where the request's time went inside the server (see the HTTP docs).
    if !v["timings"].is_null() {
        body["timings"] = v["timings"].clone();
    }
    body
}

/// One choice of a completion body from its worker summary (`tokens`, `text`,
/// `finish_reason`, `logprobs`, and `index` when there are several).
fn choice_json(st: &AppState, chat: bool, v: &Value) -> Value {
    let index = v["index"].as_u64().unwrap_or(0);
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap_or_default();
    // The worker's text: decoded incrementally and cut at a stop string, exactly what a
    // streamed answer carries.
    let text = v["text"].as_str().unwrap_or_default();
    let logprobs = match Lp::all_of(&v["logprobs"]) {
        Some(l) if chat => chat_logprobs(st, &l),
        Some(l) => completion_logprobs(st, &l, &mut 0),
        None => Value::Null,
    };
    let mut choice = if chat {
        json!({"index": index, "message": {"role": "assistant", "content": text, "token_ids": ids},
               "logprobs": logprobs, "finish_reason": v["finish_reason"]})
    } else {
        json!({"index": index, "text": text, "token_ids": ids, "logprobs": logprobs,
               "finish_reason": v["finish_reason"]})
    };
    // flashrt: the seed each of several choices sampled with.
    if v["index"].is_u64() {
        choice["seed"] = v["seed"].clone();
    }
    choice
}
