//! The OpenAI-compatible surface: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
//! (JSON or SSE), with automatic prefix reuse through the worker.

use super::*;

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
    prompt: Option<Value>,
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
    // OpenAI parameters a client may send at their no-op values; anything else is refused,
    // naming the parameter, rather than silently ignored.
    top_logprobs: Option<Value>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
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
        let nonzero = |v: Option<f64>| v.is_some_and(|x| x != 0.0);
        let set = |v: &Option<Value>| v.as_ref().is_some_and(|x| !x.is_null());
        if nonzero(self.frequency_penalty) {
            return refuse("frequency_penalty", "no penalties yet; leave it 0");
        }
        if nonzero(self.presence_penalty) {
            return refuse("presence_penalty", "no penalties yet; leave it 0");
        }
        if self.repetition_penalty.is_some_and(|x| x != 1.0) {
            return refuse("repetition_penalty", "no penalties yet; leave it 1");
        }
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
        if set(&self.top_logprobs) && self.top_logprobs != Some(Value::from(0)) {
            return refuse("top_logprobs", "no logprobs yet");
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

fn prompt_ids(st: &AppState, p: &Value) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::bad(
            "invalid_prompt",
            "`prompt` must be token ids (an array of integers) or, with a tokenizer, a string; \
             one prompt per request",
        )
    };
    match p {
        Value::String(s) => match &st.text {
            // As transformers' `tokenizer(prompt)`: with what the post-processor adds.
            Some(t) => t
                .tokenizer
                .encode_with(s, true)
                .map_err(|e| ApiError::bad("tokenizer", e)),
            None => to_ids(st, Tokens::Text(s.clone())),
        },
        Value::Array(a) if a.len() == 1 && !a[0].is_number() => prompt_ids(st, &a[0]),
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
        _ => Err(bad()),
    }
}

/// The prompt of a chat request: the model's chat template over the messages (and tools)
/// exactly as sent, then tokenized; without a tokenizer, each message's content must be
/// token ids, concatenated.
fn chat_ids(st: &AppState, b: &CompletionBody) -> Result<Vec<u32>, ApiError> {
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
            text.tokenizer
                .encode(&prompt)
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
                ids.extend(prompt_ids(st, &m["content"])?);
            }
            Ok(ids)
        }
    }
}

fn completion_req(st: &AppState, b: &CompletionBody) -> Result<GenReq, ApiError> {
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
    if b.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad(
            "unsupported",
            "n must be 1 (a batch-1 server)",
        ));
    }
    if b.echo {
        return Err(ApiError::bad("unsupported", "echo is not supported"));
    }
    if b.logprobs
        .as_ref()
        .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
    {
        return Err(ApiError::bad("unsupported", "logprobs are not supported"));
    }
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
    }
    .build(st)?;
    Ok(GenReq {
        max_tokens: max_tokens(st, b.max_completion_tokens.or(b.max_tokens), 16)?,
        sampler: Some(sampler),
        stop: stops(st, b.stop_token_ids.clone(), b.ignore_eos),
        stop_strings,
    })
}

pub(super) async fn completions(State(st): St, body: Body) -> Response {
    openai(st, body, false).await
}

pub(super) async fn chat_completions(State(st): St, body: Body) -> Response {
    openai(st, body, true).await
}

pub(super) async fn openai(st: Arc<AppState>, body: Body, chat: bool) -> Response {
    let r = async {
        let b: CompletionBody = parse(&st, body).await?;
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
        let prompt = if chat {
            chat_ids(&st, &b)?
        } else {
            prompt_ids(
                &st,
                b.prompt
                    .as_ref()
                    .ok_or_else(|| ApiError::bad("invalid_request", "`prompt` is required"))?,
            )?
        };
        let req = completion_req(&st, &b)?;
        Ok::<_, ApiError>((prompt, req, b.stream))
    }
    .await;
    let (prompt, req, stream) = match r {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-{n:x}", if chat { "chatcmpl" } else { "cmpl" });
    let created = flashrt_runtime::capsule_file::now_ms() / 1000;
    if !stream {
        return match call(
            &st,
            Cmd::Complete {
                prompt,
                req,
                stream: None,
            },
        )
        .await
        {
            Ok(Out::Json(v)) => {
                let body = completion_json(&st, &id, created, chat, &v);
                let mut r = ok(body);
                let t = TokenCount::default();
                t.set(
                    v["prompt_tokens"].as_u64().unwrap_or(0),
                    v["tokens"].as_array().map_or(0, |a| a.len() as u64),
                );
                r.extensions_mut().insert(t);
                r
            }
            Ok(_) => ApiError::new(500, "internal", "unexpected answer").into_response(),
            Err(e) => e.into_response(),
        };
    }
    let (tx, rx) = mpsc::unbounded_channel();
    if let Err(e) = call(
        &st,
        Cmd::Complete {
            prompt,
            req,
            stream: Some(tx),
        },
    )
    .await
    {
        return e.into_response();
    }
    let st2 = st.clone();
    let mut first = true;
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
            let choice = |piece: String, tokens: Vec<u32>, finish: Value, first: bool| {
                if chat {
                    let mut delta = json!({"content": piece, "token_ids": tokens});
                    if first {
                        delta["role"] = json!("assistant");
                    }
                    json!({"index": 0, "delta": delta, "finish_reason": finish})
                } else {
                    json!({"index": 0, "text": piece, "token_ids": tokens, "logprobs": null, "finish_reason": finish})
                }
            };
            let chunk = |c: Value| {
                json!({"id": id, "object": object, "created": created, "model": st2.model_name,
                   "system_fingerprint": st2.fingerprint, "choices": [c]})
                .to_string()
            };
            match ev {
                Event::Token(t, piece) => {
                    let c = choice(piece, t.into_iter().collect(), Value::Null, first);
                    first = false;
                    vec![chunk(c)]
                }
                Event::Done(v) => {
                    count2.set(
                        v["prompt_tokens"].as_u64().unwrap_or(0),
                        v["tokens"].as_array().map_or(0, |a| a.len() as u64),
                    );
                    // The last chunk carries the finish reason and, like OpenAI's
                    // `include_usage`, the usage.
                    let c = choice(String::new(), vec![], v["finish_reason"].clone(), first);
                    let mut last: Value = serde_json::from_str(&chunk(c)).unwrap_or_default();
                    last["usage"] = usage(&v);
                    vec![last.to_string(), "[DONE]".to_string()]
                }
                Event::Error(e) => vec![e.body().to_string(), "[DONE]".to_string()],
            }
        }),
    );
    r.extensions_mut().insert(count);
    r
}

fn usage(v: &Value) -> Value {
    let p = v["prompt_tokens"].as_u64().unwrap_or(0);
    let c = v["tokens"].as_array().map_or(0, |a| a.len() as u64);
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
           "prompt_tokens_details": {"cached_tokens": v["cached_tokens"]}})
}

fn completion_json(st: &AppState, id: &str, created: u64, chat: bool, v: &Value) -> Value {
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap_or_default();
    // The worker's text: decoded incrementally and cut at a stop string, exactly what a
    // streamed answer carries.
    let text = v["text"].as_str().unwrap_or_default();
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text, "token_ids": ids},
               "finish_reason": v["finish_reason"]})
    } else {
        json!({"index": 0, "text": text, "token_ids": ids, "logprobs": null,
               "finish_reason": v["finish_reason"]})
    };
    json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": st.model_name,
        "system_fingerprint": st.fingerprint,
        "seed": v["seed"],
        "choices": [choice],
        "usage": usage(v),
    })
}
