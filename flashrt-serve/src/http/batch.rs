//! Batches of prompts in `/v1/completions` (OpenAI's list form of `prompt`): each prompt a
//! completion of its own, queued together so the worker decodes them side by side (one
//! batched step per round), their answers merged into one, choice `i` of prompt `p` at index
//! `p * n + i` — streamed as one event stream of the single-prompt kind, so the formatter in
//! `openai.rs` serves both.

use super::openai::completion_tokens;
use super::prompt::Prompt;
use super::*;
use crate::worker::check_prompt;

/// The prompts of a completion request as token ids: one, or a batch's (each checked against
/// the vocabulary and `max_seq` here, so that no prompt of a batch starts when another is
/// refused).
pub(super) fn completion_prompts(
    st: &AppState,
    p: Prompt,
    req: &GenReq,
    owner: &str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let n = req.n;
    let one = |p: Prompt| -> Result<Vec<u32>, ApiError> {
        match p {
            // As transformers' `tokenizer(prompt)`: with what the post-processor adds.
            Prompt::Text(s) => match &st.text {
                Some(t) => t
                    .prefixes
                    .encode_with_special(&t.tokenizer, owner, &s)
                    .map_err(|e| ApiError::bad("tokenizer", e)),
                None => to_ids(st, Tokens::Text(s)),
            },
            Prompt::Ids(v) => Ok(v),
            Prompt::Invalid(code, m) => Err(ApiError::bad(code, m)),
            Prompt::Batch(_) => Err(ApiError::bad("invalid_prompt", "prompts do not nest")),
        }
    };
    let Prompt::Batch(ps) = p else {
        return Ok(vec![one(p)?]);
    };
    if ps.len() * n > MAX_BATCH_CHOICES {
        return Err(ApiError::bad(
            "invalid_request",
            format!(
                "{} prompts x n = {n} asks for {} completions; at most {MAX_BATCH_CHOICES} per request",
                ps.len(),
                ps.len() * n
            ),
        ));
    }
    let mut out = Vec::with_capacity(ps.len());
    for (i, p) in ps.into_iter().enumerate() {
        let at = |e: ApiError| ApiError {
            message: format!("prompt[{i}]: {}", e.message),
            ..e
        };
        let ids = one(p).map_err(at)?;
        // The worker's own check, for every prompt before any starts.
        check_prompt(&ids, st.vocab, st.max_seq, req.max_tokens).map_err(at)?;
        out.push(ids);
    }
    Ok(out)
}

/// Most completions (prompts x `n`) one request may ask for.
pub const MAX_BATCH_CHOICES: usize = 64;

/// The worker's summaries of a batch's prompts as one summary with every choice, choice `i`
/// of prompt `p` at index `p * n + i` (OpenAI's order), the usage summed, and each prompt's
/// `timings` in a list.
fn merge_batch(parts: &[Value], n: usize) -> Value {
    let mut choices = Vec::new();
    let (mut prompt, mut completion, mut cached) = (0u64, 0u64, 0u64);
    for (p, v) in parts.iter().enumerate() {
        match v["choices"].as_array() {
            Some(cs) => choices.extend(cs.iter().map(|c| {
                let mut c = c.clone();
                c["index"] = json!(p * n + c["index"].as_u64().unwrap_or(0) as usize);
                c
            })),
            None => {
                let mut c = v.clone();
                c["index"] = json!(p * n);
                choices.push(c);
            }
        }
        prompt += v["prompt_tokens"].as_u64().unwrap_or(0);
        completion += completion_tokens(v);
        cached += v["cached_tokens"].as_u64().unwrap_or(0);
    }
    json!({
        "choices": choices,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "seed": parts.first().map_or(Value::Null, |v| v["seed"].clone()),
        "timings": parts.iter().map(|v| v["timings"].clone()).collect::<Vec<_>>(),
    })
}

fn worker_gone(_: oneshot::error::RecvError) -> ApiError {
    ApiError::new(503, "shutting_down", "the model worker has stopped")
}

/// A batch of prompts, not streamed: one completion each, queued together (the worker
/// generates them side by side), answered as one.
pub(super) async fn complete_batch(
    st: &AppState,
    prompts: Vec<Vec<u32>>,
    req: GenReq,
) -> Result<Out, ApiError> {
    let n = req.n;
    let replies = prompts
        .into_iter()
        .map(|prompt| {
            send(
                st,
                Cmd::Complete {
                    prompt,
                    req: req.clone(),
                    stream: None,
                },
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut parts = Vec::with_capacity(replies.len());
    for r in replies {
        match r.await.map_err(worker_gone)?? {
            Out::Json(v) => parts.push(v),
            _ => return Err(ApiError::new(500, "internal", "unexpected answer")),
        }
    }
    Ok(Out::Json(merge_batch(&parts, n)))
}

/// A batch of prompts, streamed: one completion each, queued together; their events merged
/// into one stream of the single-prompt kind, where choice `i` of prompt `p` is choice
/// `p * n + i` (a `Choice` switch before each token of another choice than the last one's),
/// each prompt's end is its choices' last chunk, and the end of the last prompt is a summary
/// of all ([`merge_batch`]). The stream starts once every prompt is in.
pub(super) async fn stream_batch(
    st: &AppState,
    prompts: Vec<Vec<u32>>,
    req: GenReq,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    let (n, k) = (req.n, prompts.len());
    let (mtx, mut mrx) = mpsc::unbounded_channel::<(usize, Event)>();
    let mut replies = Vec::with_capacity(k);
    for (p, prompt) in prompts.into_iter().enumerate() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        replies.push(send(
            st,
            Cmd::Complete {
                prompt,
                req: req.clone(),
                stream: Some(tx),
            },
        )?);
        let mtx = mtx.clone();
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                if mtx.send((p, ev)).is_err() {
                    break;
                }
            }
        });
    }
    drop(mtx);
    for r in replies {
        match r.await.map_err(worker_gone)?? {
            Out::Stream => {}
            _ => return Err(ApiError::new(500, "internal", "unexpected answer")),
        }
    }
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        // The formatter's current choice (it starts at 0), each prompt's current choice.
        let mut cur = 0usize;
        let mut choice = vec![0usize; k];
        let mut done: Vec<Value> = vec![Value::Null; k];
        let mut left = k;
        let mut out = Vec::new();
        while let Some((p, ev)) = mrx.recv().await {
            let mut switch = |g: usize, out: &mut Vec<Event>| {
                if g != cur {
                    out.push(Event::Choice(g));
                    cur = g;
                }
            };
            let mut end = false;
            match ev {
                Event::Choice(i) => choice[p] = i,
                Event::Token(..) => {
                    switch(p * n + choice[p], &mut out);
                    out.push(ev);
                }
                Event::ChoiceEnd(mut v) => {
                    let g = p * n + v["index"].as_u64().unwrap_or(0) as usize;
                    v["index"] = json!(g);
                    switch(g, &mut out);
                    out.push(Event::ChoiceEnd(v));
                }
                Event::Done(v) => {
                    if v["choices"].is_null() {
                        // One choice: its end is in the summary.
                        switch(p * n, &mut out);
                        out.push(Event::ChoiceEnd(
                            json!({"index": p * n, "finish_reason": v["finish_reason"]}),
                        ));
                    }
                    done[p] = v;
                    left -= 1;
                    if left == 0 {
                        out.push(Event::Done(merge_batch(&done, n)));
                        end = true;
                    }
                }
                Event::Error(e) => {
                    out.push(Event::Error(e));
                    end = true;
                }
            }
            for ev in out.drain(..) {
                if tx.send(ev).is_err() {
                    return;
                }
            }
            if end {
                return;
            }
        }
    });
    Ok(rx)
}
