//! The sessions API: create, inspect, append, generate, snapshot, restore, roll back, fork.

use super::*;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    tokens: Option<Tokens>,
    capsule: Option<String>,
    sampler: Option<SamplerBody>,
    reuse: Option<bool>,
}

pub(super) async fn create_session(State(st): St, body: Body) -> Response {
    let r = async {
        let b: CreateBody = parse(&st, body).await?;
        let tokens = b
            .tokens
            .map(|t| to_ids(&st, t))
            .transpose()?
            .unwrap_or_default();
        if let Some(c) = &b.capsule {
            check_id(c, "unknown_capsule")?;
        }
        let sampler = b.sampler.map(|s| s.build(&st)).transpose()?;
        Ok::<_, ApiError>(Cmd::CreateSession(CreateReq {
            tokens,
            capsule: b.capsule,
            sampler,
            reuse: b.reuse.unwrap_or(true),
        }))
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn list_sessions(State(st): St) -> Response {
    call_json(&st, Cmd::ListSessions).await
}

pub(super) async fn session_info(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_session") {
        return e.into_response();
    }
    call_json(&st, Cmd::SessionInfo(id)).await
}

pub(super) async fn delete_session(State(st): St, Path(id): Path<String>) -> Response {
    if let Err(e) = check_id(&id, "unknown_session") {
        return e.into_response();
    }
    call_json(&st, Cmd::DeleteSession(id)).await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AppendBody {
    tokens: Tokens,
}

pub(super) async fn append(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: AppendBody = parse(&st, body).await?;
        Ok::<_, ApiError>(Cmd::Append {
            session: id,
            tokens: to_ids(&st, b.tokens)?,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct GenerateBody {
    max_tokens: Option<usize>,
    sampler: Option<SamplerBody>,
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    stream: bool,
    /// Each token's log-probability and this many alternatives (0..=20).
    logprobs: Option<usize>,
}

/// A sessions-API generation request (`generate` and `sessions/generate` take the same fields).
fn session_gen_req(
    st: &AppState,
    max: Option<usize>,
    sampler: Option<SamplerBody>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: bool,
    logprobs: Option<usize>,
) -> Result<GenReq, ApiError> {
    Ok(GenReq {
        max_tokens: max_tokens(st, max, 16)?,
        sampler: sampler.map(|s| s.build(st)).transpose()?,
        stop: stops(st, stop_token_ids, ignore_eos),
        stop_strings: Vec::new(),
        logprobs: super::openai::top_logprobs_count(logprobs)?,
        // A session must stand exactly after the tokens it returned; a speculative round may
        // commit past a stop token, so the sessions API decodes plainly.
        speculative: Some(0),
        n: 1,
    })
}

pub(super) async fn generate(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: GenerateBody = parse(&st, body).await?;
        let req = session_gen_req(
            &st,
            b.max_tokens,
            b.sampler,
            b.stop_token_ids,
            b.ignore_eos,
            b.logprobs,
        )?;
        Ok::<_, ApiError>((req, b.stream))
    }
    .await;
    let (req, stream) = match r {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    if !stream {
        return call_json(
            &st,
            Cmd::Generate {
                session: id,
                req,
                stream: None,
            },
        )
        .await;
    }
    let (tx, rx) = mpsc::unbounded_channel();
    match call(
        &st,
        Cmd::Generate {
            session: id,
            req,
            stream: Some(tx),
        },
    )
    .await
    {
        Ok(_) => sse(
            rx,
            Box::new(|ev| match ev {
                Event::Token(Some(t), text, lp) => {
                    let mut v = json!({"token": t, "text": text});
                    if let Some(l) = lp {
                        v["logprob"] = json!(l.logprob);
                        v["top"] = l.top.iter().map(|(id, p)| json!([id, p])).collect();
                    }
                    vec![v.to_string()]
                }
                Event::Token(None, text, _) => vec![json!({"text": text}).to_string()],
                Event::Done(v) => vec![json!({"done": true, "result": v}).to_string()],
                Event::Error(e) => vec![e.body().to_string()],
                // Completions only.
                Event::Choice(_) | Event::ChoiceEnd(_) => vec![],
            }),
        ),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct GenerateManyBody {
    sessions: Vec<String>,
    max_tokens: Option<usize>,
    sampler: Option<SamplerBody>,
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: bool,
    logprobs: Option<usize>,
}

/// Sessions generating one batched generate may list (the most a batched step takes).
const MAX_GENERATE_MANY: usize = 8;

/// `POST /v1/sessions/generate`: one generate of several sessions at once (the branches of a
/// fork, a robot's streams): queued together, they join the worker's generating set in
/// consecutive rounds (one job per round), and from then on every round feeds them in one
/// batched step. `results[i]` is what `generate` on `sessions[i]` answers
/// (or its error); a `sampler` applies to each session (else each keeps its own and its RNG
/// position). Not streamed: stream each session's own `generate` for that.
pub(super) async fn generate_many(State(st): St, body: Body) -> Response {
    let r = async {
        let b: GenerateManyBody = parse(&st, body).await?;
        if b.sessions.is_empty() || b.sessions.len() > MAX_GENERATE_MANY {
            return Err(ApiError::bad(
                "invalid_sessions",
                format!(
                    "`sessions` lists 1 to {MAX_GENERATE_MANY} session ids, not {}",
                    b.sessions.len()
                ),
            ));
        }
        for (i, id) in b.sessions.iter().enumerate() {
            check_id(id, "unknown_session")?;
            if b.sessions[..i].contains(id) {
                return Err(ApiError::bad(
                    "invalid_sessions",
                    format!("session `{id}` is listed twice"),
                ));
            }
        }
        let req = session_gen_req(
            &st,
            b.max_tokens,
            b.sampler,
            b.stop_token_ids,
            b.ignore_eos,
            b.logprobs,
        )?;
        // Every job queued before any answer is awaited, so the worker takes them up together.
        let pending = b
            .sessions
            .into_iter()
            .map(|session| {
                send(
                    &st,
                    Cmd::Generate {
                        session,
                        req: req.clone(),
                        stream: None,
                    },
                )
            })
            .collect::<Vec<_>>();
        let mut results = Vec::with_capacity(pending.len());
        for p in pending {
            let answer = match p {
                Ok(rx) => rx.await.unwrap_or_else(|_| {
                    Err(ApiError::new(
                        503,
                        "shutting_down",
                        "the model worker has stopped",
                    ))
                }),
                Err(e) => Err(e),
            };
            // A session's failure is its entry (with the status its own generate would have
            // answered), not the batch's.
            let failed = |e: ApiError| {
                let mut v = e.body();
                v["status"] = json!(e.status);
                v
            };
            results.push(match answer {
                Ok(Out::Json(v)) => v,
                Ok(_) => failed(ApiError::new(500, "internal", "unexpected answer")),
                Err(e) => failed(e),
            });
        }
        Ok(json!({ "results": results }))
    }
    .await;
    match r {
        Ok(v) => ok(v),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SnapshotBody {
    #[serde(default)]
    persist: bool,
    label: Option<String>,
}

pub(super) async fn snapshot(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: SnapshotBody = parse(&st, body).await?;
        if b.label.as_ref().is_some_and(|l| l.len() > 256) {
            return Err(ApiError::bad(
                "invalid_request",
                "label longer than 256 bytes",
            ));
        }
        Ok(Cmd::Snapshot {
            session: id,
            persist: b.persist,
            label: b.label,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CapsuleBody {
    capsule: String,
}

pub(super) async fn restore(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: CapsuleBody = parse(&st, body).await?;
        check_id(&b.capsule, "unknown_capsule")?;
        Ok::<_, ApiError>(Cmd::Restore {
            session: id,
            capsule: b.capsule,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RollbackBody {
    capsule: Option<String>,
    pos: Option<usize>,
}

pub(super) async fn rollback(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: RollbackBody = parse(&st, body).await?;
        if let Some(c) = &b.capsule {
            check_id(c, "unknown_capsule")?;
        }
        Ok::<_, ApiError>(Cmd::Rollback {
            session: id,
            capsule: b.capsule,
            pos: b.pos,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    /// Branches to make (1 to 16); with `n`, the answer lists them as `sessions`.
    n: Option<usize>,
}

/// Most branches one fork makes.
const MAX_FORKS: usize = 16;

pub(super) async fn fork(State(st): St, Path(id): Path<String>, body: Body) -> Response {
    let r = async {
        check_id(&id, "unknown_session")?;
        let b: ForkBody = parse(&st, body).await?;
        if b.n.is_some_and(|n| !(1..=MAX_FORKS).contains(&n)) {
            return Err(ApiError::bad(
                "invalid_request",
                format!("`n` must be 1 to {MAX_FORKS}"),
            ));
        }
        Ok::<_, ApiError>(Cmd::Fork {
            session: id,
            n: b.n,
        })
    }
    .await;
    match r {
        Ok(cmd) => call_json(&st, cmd).await,
        Err(e) => e.into_response(),
    }
}
