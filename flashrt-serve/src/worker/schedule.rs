//! The scheduler: generations run together, a token each in turn.
//!
//! A completion is admitted when its job is taken from the queue (validation, prefix reuse)
//! and joins the *generating* set; the worker loop alternates between taking the next job
//! from the queue (without waiting while anything generates) and one round over the set, in
//! which each completion advances by one step: a slice of its prompt while it prefills
//! ([`Worker::prefill_rows`]: the whole rest when nothing else generates, else one planned
//! step of at most [`PREFILL_SLICE_MS`] by the measured costs), then one token (or one
//! speculative round, [`Worker::gen_step`]). So a completion arriving while others stream gets
//! its first token after its own prefill and a token of each of the others per slice, not
//! after they end, and a long prompt arriving does not freeze the streams already running.
//! A round starts with one batched decode step ([`Model::step_batch`]) that feeds every
//! generating completion the token it chose in the previous round, so the device reads the
//! weights once per round for all of them (on the CUDA backend; the CPU reference steps them
//! one by one) and each then chooses its next token from its own row — bit for bit what it
//! would get alone. Each completion owns a session while it generates, at most
//! [`MAX_GENERATING`] at once and no more than the memory plan's sessions leave room for,
//! and further completions wait their turn (`flashrt_generation_waiting`).
//!
//! A sessions-API `generate` joins the set as well: its session leaves the worker's map while
//! it generates, and its owner's commands on it meanwhile wait, in order, until it ends
//! ([`Worker::defer_if_busy`]), so commands on one session stay serialized.
//!
//! Choices (`n` > 1) start from one prefilled prompt: its boundary is a capsule, and choice
//! `i` samples with seed `seed + i`. When the generating set has room for a session per
//! choice, choices 1.. are forked from the boundary and generate beside choice 0 (their
//! tokens fed in the round's batched step, streamed interleaved, each chunk naming its
//! choice); otherwise they run one after another, each restoring the boundary. Either way
//! choice `i` is exactly the single completion with seed `seed + i`.

use super::generate::{GenState, Generated, choice_sampler};
use super::*;
use std::collections::VecDeque;

/// Completions generating at once (each holds a session while it does).
pub const MAX_GENERATING: usize = 8;

/// While other completions generate, a prompt is prefilled in steps predicted (from the
/// costs measured at start-up) to take at most this long, one per round.
pub const PREFILL_SLICE_MS: f64 = 50.0;

/// A completion between its first and its last token.
pub(super) struct Active {
    tenant: Tenant,
    rep: Replier,
    stream: Option<mpsc::UnboundedSender<Event>>,
    req: GenReq,
    s: Session,
    /// Prompt tokens not yet prefilled (run a slice per round, see [`Worker::prefill_rows`]).
    prefill: Vec<u32>,
    /// `None` while prefilling.
    g: Option<GenState>,
    enqueued: Instant,
    /// When the worker took the job from its queue (admission began).
    taken: Instant,
    /// When the prompt's cached part was restored (admission done).
    admitted: Instant,
    /// When the whole prompt was in (the last prefill slice ran), and when the first token
    /// was handed to the client: the request's `timings`.
    prompt_in: Option<Instant>,
    first_token: Option<Instant>,
    prompt_len: usize,
    cached: usize,
    /// Store the prompt boundary after the first token (automatic prefix cache).
    cache_prompt: bool,
    sampler: SamplerState,
    choices: Option<Choices>,
    /// A sessions-API `generate` of this session (back in the map when it ends).
    session_id: Option<String>,
}

impl Active {
    /// Where a completion's time went, in milliseconds from its arrival at the worker's queue
    /// to `end` (its last token): waiting in the queue, admission (validation, prefix lookup,
    /// restore of the stored prefix), prefilling the rest of the prompt (with other streams'
    /// rounds interleaved when several generate), to the first token, and generating.
    fn timings(&self, end: Instant) -> Value {
        let ms = |a: Instant, b: Instant| {
            (b.saturating_duration_since(a).as_secs_f64() * 1e6).round() / 1e3
        };
        let prompt_in = self.prompt_in.unwrap_or(end);
        let first = self.first_token.unwrap_or(end);
        json!({
            "queued_ms": ms(self.enqueued, self.taken),
            "admit_ms": ms(self.taken, self.admitted),
            "prefill_ms": ms(self.admitted, prompt_in),
            "first_token_ms": ms(self.enqueued, first),
            "generate_ms": ms(first, end),
            "total_ms": ms(self.enqueued, end),
        })
    }
}

/// `n` > 1: the prompt boundary and the choices that ended.
struct Choices {
    boundary: flashrt_runtime::Capsule,
    /// One after another: the choice generating now.
    index: usize,
    done: Vec<Value>,
    completion_tokens: usize,
    spec: Option<flashrt_runtime::SpecStats>,
    /// Side by side: choices 1.. in their own sessions (choice 0 is the completion's own),
    /// whether choice 0 has ended, and the choice the stream's last token belonged to.
    branches: Vec<Branch>,
    zero_done: bool,
    streaming: usize,
}

/// Choice `index` of a completion generating beside choice 0, in a session of its own.
struct Branch {
    index: usize,
    s: Session,
    g: GenState,
    done: bool,
}

/// The generating completions and session generations, and completions waiting for a place
/// among them.
#[derive(Default)]
pub(super) struct Schedule {
    pub(super) active: VecDeque<Active>,
    pub(super) waiting: VecDeque<Job>,
    /// Sessions of the sessions API generating now (out of the worker's map), by owner.
    pub(super) busy: HashMap<String, Arc<str>>,
    /// Their owners' commands that came meanwhile, run in order when the generation ends
    /// (commands on one session stay serialized).
    pub(super) deferred: HashMap<String, VecDeque<Job>>,
}

impl Schedule {
    pub(super) fn is_idle(&self) -> bool {
        self.active.is_empty() && self.waiting.is_empty()
    }
    /// Sessions held by generating completions: one each from the pool, plus one per choice
    /// generating beside choice 0.
    pub(super) fn completions(&self) -> usize {
        self.active.len() - self.busy.len() + self.branches()
    }
    /// Sessions held by choices generating beside their completion's choice 0.
    fn branches(&self) -> usize {
        self.active
            .iter()
            .filter_map(|a| a.choices.as_ref())
            .map(|c| c.branches.len())
            .sum()
    }
    /// Sessions the generating set holds (what [`Worker::generating_capacity`] bounds).
    fn generating(&self) -> usize {
        self.active.len() + self.branches()
    }
}

impl Worker {
    /// Take a completion job: set it up and add it to the generating set, or queue it when
    /// the set is full.
    pub(super) fn start_completion(&mut self, job: Job) {
        if self.sched.generating() >= self.generating_capacity() {
            self.sched.waiting.push_back(job);
            self.publish_schedule();
            return;
        }
        let Job {
            cmd,
            tenant,
            reply,
            enqueued,
        } = job;
        let Cmd::Complete {
            prompt,
            req,
            stream,
        } = cmd
        else {
            unreachable!("start_completion takes completions only")
        };
        let mut rep = Replier(Some(reply));
        let taken = Instant::now();
        let mut s = match self.pool.pop() {
            Some(s) => s,
            None => match self.fresh_session() {
                Ok(s) => s,
                Err(e) => return fail(&mut rep, stream.as_ref(), e),
            },
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.admit(&mut s, &prompt, &req, &tenant)
        }));
        match r {
            Ok(Ok(cached)) => {
                let sampler = req.sampler.clone().unwrap_or_default();
                self.sched.active.push_back(Active {
                    cache_prompt: self.cfg.auto_cache && cached < prompt.len(),
                    tenant,
                    rep,
                    stream,
                    req,
                    s,
                    prefill: prompt[cached..].to_vec(),
                    g: None,
                    enqueued,
                    taken,
                    admitted: Instant::now(),
                    prompt_in: None,
                    first_token: None,
                    prompt_len: prompt.len(),
                    cached,
                    sampler,
                    choices: None,
                    session_id: None,
                });
            }
            Ok(Err(e)) => {
                // Whatever state the session is in, the next completion resets it.
                self.pool.push(s);
                fail(&mut rep, stream.as_ref(), e);
            }
            Err(_) => fail(
                &mut rep,
                stream.as_ref(),
                ApiError::new(
                    500,
                    "internal",
                    "internal error while setting up the completion",
                ),
            ),
        }
        self.publish_schedule();
    }

    /// Take a sessions-API `generate`: the session leaves the map for the generating set
    /// (its owner's commands on it wait meanwhile, [`Worker::defer_if_busy`]) and comes back,
    /// its last token fed, when it ends.
    pub(super) fn start_session_generate(&mut self, job: Job) {
        let Job {
            cmd,
            tenant,
            reply,
            enqueued,
        } = job;
        let Cmd::Generate {
            session,
            req,
            stream,
        } = cmd
        else {
            unreachable!("start_session_generate takes session generations only")
        };
        let mut rep = Replier(Some(reply));
        let r = (|| -> WResult<Session> {
            let s = self.session(&session, &tenant)?;
            if let Some(sm) = &req.sampler {
                sm.validate()?;
            }
            if s.pos() == 0 && s.pending().is_none() {
                return Err(ApiError::bad(
                    "empty_session",
                    "nothing to generate from: append tokens first",
                ));
            }
            if s.pos() >= self.model.max_seq() {
                return Err(ApiError::bad(
                    "context_length_exceeded",
                    format!(
                        "the session holds max_seq = {} tokens: no room to generate",
                        self.model.max_seq()
                    ),
                ));
            }
            self.take(&session, &tenant)
        })();
        let mut s = match r {
            Ok(s) => s,
            Err(e) => return fail(&mut rep, stream.as_ref(), e),
        };
        if let Some(sm) = &req.sampler {
            s.set_sampler(sm.clone());
        }
        if stream.is_some() {
            rep.send(Ok(Out::Stream));
        }
        let g = self.gen_start(&s, &req, enqueued);
        let now = Instant::now();
        self.sched.busy.insert(session.clone(), tenant.name.clone());
        self.sched.active.push_back(Active {
            cache_prompt: false,
            sampler: s.sampler().clone(),
            tenant,
            rep,
            stream,
            req,
            s,
            prefill: Vec::new(),
            g: Some(g),
            enqueued,
            taken: now,
            admitted: now,
            prompt_in: Some(now),
            first_token: None,
            prompt_len: 0,
            cached: 0,
            choices: None,
            session_id: Some(session),
        });
        self.publish_schedule();
    }

    /// Validation and prefix reuse of a completion: how many prompt tokens the restored
    /// capsule covers.
    fn admit(
        &mut self,
        s: &mut Session,
        prompt: &[u32],
        req: &GenReq,
        t: &Tenant,
    ) -> WResult<usize> {
        check_prompt(
            prompt,
            self.model.vocab(),
            self.model.max_seq(),
            req.max_tokens,
        )?;
        if let Some(sm) = &req.sampler {
            sm.validate()?;
        }
        self.reuse_prefix(s, prompt, t)
    }

    /// How many of `remaining` prompt tokens to prefill in this round: all of them when
    /// nothing else generates; otherwise the planner's first step, and with costs measured on
    /// the device, no step predicted longer than [`PREFILL_SLICE_MS`], so that the other
    /// streams wait at most about that long for their next token.
    fn prefill_rows(&self, remaining: usize) -> usize {
        // Nothing left (a prompt the prefix cache held whole), or nobody to wait: all of it.
        if remaining == 0 || self.sched.active.is_empty() {
            return remaining;
        }
        let costs = self.model.chunk_costs();
        let first = costs.plan(remaining).first().map_or(remaining, |s| s.1);
        if costs.source() != flashrt_runtime::CostSource::Measured {
            return first;
        }
        let fits = costs
            .plans()
            .iter()
            .filter(|p| p.cost(p.rows()) <= PREFILL_SLICE_MS)
            .map(|p| p.rows())
            .max()
            .unwrap_or(1);
        first.min(fits).max(1)
    }

    /// The prompt is in: the sampler, the stream's start, the automatic prompt capsule when
    /// nothing is generated, the boundary of several choices, and the generation state.
    fn ready(&mut self, a: &mut Active) -> WResult<()> {
        // The last slice's step returns before the device has run it; `prompt_in` is when it
        // has (the first token waits for it anyway).
        a.s.synchronize()?;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            "completion of {} prompt tokens ({} cached): admitted {:.2} ms after arrival, prompt in after {:.2} ms more",
            a.prompt_len,
            a.cached,
            ms(a.admitted - a.enqueued),
            ms(a.admitted.elapsed())
        );
        a.prompt_in = Some(Instant::now());
        a.s.set_sampler(a.sampler.clone());
        if a.stream.is_some() {
            a.rep.send(Ok(Out::Stream));
        }
        if a.req.max_tokens == 0 && a.cache_prompt {
            self.store_auto(&a.s, None, &a.tenant)?;
        }
        // Several choices: the boundary each later one starts from (one device copy before
        // the first token).
        if a.req.n > 1 {
            let boundary = super::snapshot_anywhere(&a.s)?;
            // Side by side when a session per choice fits in the generating set (`a` is out
            // of the set while it advances: it counts itself).
            let room = self
                .generating_capacity()
                .saturating_sub(self.sched.generating() + 1);
            let mut branches = Vec::new();
            if room >= a.req.n - 1 {
                for i in 1..a.req.n {
                    let mut s = match self.pool.pop() {
                        Some(s) => s,
                        None => self.fresh_session()?,
                    };
                    s.restore(&boundary)?;
                    s.set_sampler(choice_sampler(&a.sampler, i));
                    let g = self.gen_start(&s, &a.req, a.enqueued);
                    branches.push(Branch {
                        index: i,
                        s,
                        g,
                        done: false,
                    });
                }
            }
            a.choices = Some(Choices {
                boundary,
                index: 0,
                done: Vec::with_capacity(a.req.n),
                completion_tokens: 0,
                spec: None,
                branches,
                zero_done: false,
                streaming: 0,
            });
        }
        a.g = Some(self.gen_start(&a.s, &a.req, a.enqueued));
        Ok(())
    }

    /// One round: every generating completion advances by a token (or a speculative round),
    /// in arrival order; those that end answer and leave the set, and waiting ones take
    /// their places.
    pub(super) fn step_generating(&mut self) {
        self.feed_together();
        for _ in 0..self.sched.active.len() {
            let Some(mut a) = self.sched.active.pop_front() else {
                break;
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.advance(&mut a)));
            match r {
                Ok(Ok(false)) => self.sched.active.push_back(a),
                Ok(Ok(true)) => self.answer(a),
                Ok(Err(e)) => {
                    let Active {
                        mut rep,
                        stream,
                        s,
                        session_id,
                        tenant,
                        ..
                    } = a;
                    fail(&mut rep, stream.as_ref(), e);
                    match session_id {
                        // The session goes back as the failure left it (a failed step
                        // poisons it, and it says so).
                        Some(id) => {
                            self.put_back(id.clone(), s, &tenant);
                            self.release(&id);
                        }
                        None => self.pool.push(s),
                    }
                }
                Err(_) => {
                    // The session may be half-updated: it is dropped, not reused.
                    let Active {
                        mut rep,
                        stream,
                        session_id,
                        ..
                    } = a;
                    fail(
                        &mut rep,
                        stream.as_ref(),
                        ApiError::new(500, "internal", "internal error while generating"),
                    );
                    if let Some(id) = session_id {
                        self.release(&id);
                    }
                }
            }
        }
        while self.sched.generating() < self.generating_capacity() {
            let Some(job) = self.sched.waiting.pop_front() else {
                break;
            };
            self.start_completion(job);
        }
        self.trim_pool();
        self.publish_schedule();
    }

    /// Feed, in one batched step, the token each generating completion chose in the last round
    /// (the one its next [`Worker::gen_step`] would feed first, under the same conditions), so
    /// a round costs one device step for all of them. Speculative generations feed inside
    /// their own rounds. A failed step poisons the sessions it held: their `gen_step` then
    /// reports it, each to its own client.
    fn feed_together(&mut self) {
        if self.cfg.cancel.load(Ordering::Relaxed) {
            return;
        }
        let max = self.model.max_seq();
        let mut picked: Vec<(&mut Session, &mut GenState, u32)> = Vec::new();
        for a in self.sched.active.iter_mut() {
            let Active {
                s, g, req, choices, ..
            } = a;
            let zero_done = choices.as_ref().is_some_and(|c| c.zero_done);
            if let Some(g) = g.as_mut()
                && !zero_done
                && let Some(t) = g.feed_due(req, s.pos(), max)
            {
                picked.push((s, g, t));
            }
            for b in choices.iter_mut().flat_map(|c| c.branches.iter_mut()) {
                if !b.done
                    && let Some(t) = b.g.feed_due(req, b.s.pos(), max)
                {
                    picked.push((&mut b.s, &mut b.g, t));
                }
            }
        }
        if picked.len() < 2 {
            return;
        }
        let toks: Vec<u32> = picked.iter().map(|p| p.2).collect();
        let fed = {
            let mut sessions: Vec<&mut Session> = picked.iter_mut().map(|p| &mut *p.0).collect();
            self.model.step_batch(&mut sessions, &toks).is_ok()
        };
        if fed {
            self.metrics.batched_steps.fetch_add(1, Ordering::Relaxed);
            self.metrics
                .batched_rows
                .fetch_add(toks.len() as u64, Ordering::Relaxed);
            for (_, g, _) in picked {
                g.fed();
            }
        }
    }

    /// One token of `a`; `true` when the completion has ended (every choice).
    fn advance(&mut self, a: &mut Active) -> WResult<bool> {
        if a.g.is_none() {
            // Prefilling: a slice of the prompt this round; the first token as soon as the
            // last slice is in.
            let rows = self.prefill_rows(a.prefill.len());
            let slice: Vec<u32> = a.prefill.drain(..rows).collect();
            self.prefill(&mut a.s, &slice)?;
            if !a.prefill.is_empty() {
                return Ok(false);
            }
            self.ready(a)?;
        }
        let first_choice = a.choices.as_ref().is_none_or(|c| c.index == 0);
        let cache = (a.cache_prompt && first_choice).then(|| a.tenant.clone());
        if a.choices.as_ref().is_some_and(|c| !c.branches.is_empty()) {
            return self.advance_side_by_side(a, cache);
        }
        let g = a.g.as_mut().expect("generating");
        let ended = self.gen_step(&mut a.s, g, &a.req, a.stream.as_ref(), cache.as_ref())?;
        a.first_token = a.first_token.or(g.first());
        if !ended {
            return Ok(false);
        }
        let Some(c) = a.choices.as_mut() else {
            return Ok(true);
        };
        // A choice ended: record it, and start the next one from the prompt boundary.
        let g = self.gen_end(a.g.as_mut().expect("generating"), a.stream.as_ref());
        let i = c.index;
        let cancelled = g.finish == "cancelled";
        record_choice(c, i, g, &a.req, &a.sampler, a.stream.as_ref());
        if cancelled || i + 1 >= a.req.n {
            return Ok(true);
        }
        c.index = i + 1;
        if let Some(tx) = &a.stream
            && tx.send(Event::Choice(i + 1)).is_err()
        {
            return Ok(true);
        }
        a.s.restore(&c.boundary)?;
        a.s.set_sampler(choice_sampler(&a.sampler, i + 1));
        a.g = Some(self.gen_start(&a.s, &a.req, Instant::now()));
        Ok(false)
    }

    /// One token of every choice of `a` still generating, choice 0 and its branches (a
    /// completion whose choices run side by side); `true` when all have ended.
    fn advance_side_by_side(&mut self, a: &mut Active, cache: Option<Tenant>) -> WResult<bool> {
        let Active {
            s,
            g,
            req,
            stream,
            sampler,
            choices,
            first_token,
            ..
        } = a;
        let c = choices.as_mut().expect("choices side by side");
        let g = g.as_mut().expect("generating");
        let mut gone = false;
        if !c.zero_done {
            switch_choice(c, 0, stream.as_ref());
            let ended = self.gen_step(s, g, req, stream.as_ref(), cache.as_ref())?;
            *first_token = first_token.or(g.first());
            if ended {
                let out = self.gen_end(g, stream.as_ref());
                gone |= out.finish == "cancelled";
                record_choice(c, 0, out, req, sampler, stream.as_ref());
                c.zero_done = true;
            }
        }
        for i in 0..c.branches.len() {
            if c.branches[i].done || gone {
                continue;
            }
            let index = c.branches[i].index;
            switch_choice(c, index, stream.as_ref());
            let b = &mut c.branches[i];
            let ended = self.gen_step(&mut b.s, &mut b.g, req, stream.as_ref(), None)?;
            *first_token = first_token.or(b.g.first());
            if ended {
                let out = self.gen_end(&mut b.g, stream.as_ref());
                b.done = true;
                gone |= out.finish == "cancelled";
                record_choice(c, index, out, req, sampler, stream.as_ref());
            }
        }
        Ok(gone || (c.zero_done && c.branches.iter().all(|b| b.done)))
    }

    /// An ended completion: its summary to the client, then its capsule to the store (the
    /// client does not wait for that: a 16k-token capsule may wait for the previous one's
    /// copy to the host), its session to the pool.
    fn answer(&mut self, mut a: Active) {
        if let Some(id) = a.session_id.take() {
            return self.answer_session(id, a);
        }
        let timings = a.timings(Instant::now());
        let mut store = false;
        let mut summary = match a.choices.take() {
            Some(mut c) => {
                // Side by side, choices end in any order; the answer lists them by index.
                c.done.sort_by_key(|v| v["index"].as_u64());
                self.pool.extend(c.branches.drain(..).map(|b| b.s));
                json!({
                "choices": c.done,
                "completion_tokens": c.completion_tokens,
                "prompt_tokens": a.prompt_len,
                "cached_tokens": a.cached,
                "seed": a.sampler.seed,
                "speculative": spec_json(&c.spec),
                })
            }
            None => {
                let g = self.gen_end(a.g.as_mut().expect("generated"), a.stream.as_ref());
                // The session stands before the last token (never fed: nothing will read
                // it), so the capsule worth keeping for a follow-up holds the prompt and all
                // but that token (stored once the answer is out).
                store = self.cfg.auto_cache && g.tokens.len() > 1 && g.finish != "cancelled";
                json!({
                    "tokens": g.tokens,
                    "text": g.text,
                    "finish_reason": g.finish,
                    "prompt_tokens": a.prompt_len,
                    "cached_tokens": a.cached,
                    "seed": a.s.sampler().seed,
                    "logprobs": logprobs_json(&a.req, &g.logprobs),
                    "speculative": spec_json(&g.spec),
                })
            }
        };
        summary["timings"] = timings;
        if let Some(tx) = &a.stream {
            let _ = tx.send(Event::Done(summary.clone()));
        }
        a.rep.send(Ok(Out::Json(summary)));
        // A follow-up queues behind this job on the worker, so it finds the capsule.
        if store && let Err(e) = self.store_auto(&a.s, None, &a.tenant) {
            tracing::warn!("storing the capsule after a completion: {}", e.message);
        }
        self.pool.push(a.s);
    }

    /// How many completions may generate at once: [`MAX_GENERATING`], within the sessions
    /// the memory plan allows (`max_sessions` counts the sessions API's; one more is kept
    /// for completions), and always at least one.
    pub(super) fn generating_capacity(&self) -> usize {
        let room = (self.cfg.max_sessions + 1).saturating_sub(self.open_sessions());
        // Session generations hold their own sessions: they do not take completions' room.
        room.clamp(1, MAX_GENERATING) + self.sched.busy.len()
    }

    /// An ended sessions-API generation: the summary, then the last token fed and the session
    /// back in the map.
    fn answer_session(&mut self, id: String, mut a: Active) {
        let g = self.gen_end(a.g.as_mut().expect("generated"), a.stream.as_ref());
        // The session ends after the last token: it is fed once the answer is out.
        let pos = a.s.pos() + g.unfed.is_some() as usize;
        let summary = json!({
            "session": id,
            "tokens": g.tokens,
            "text": g.text,
            "finish_reason": g.finish,
            "pos": pos,
            "logprobs": logprobs_json(&a.req, &g.logprobs),
            "speculative": spec_json(&g.spec),
            "timings": a.timings(Instant::now()),
        });
        if let Some(tx) = &a.stream {
            let _ = tx.send(Event::Done(summary.clone()));
        }
        let fed = match g.unfed {
            Some(last) => a.s.append(&[last]),
            None => Ok(()),
        };
        self.put_back(id.clone(), a.s, &a.tenant);
        match fed {
            Ok(()) => a.rep.send(Ok(Out::Json(summary))),
            Err(e) => {
                // The stream already ended well; the session is poisoned and says so.
                tracing::error!("session {id}: feeding the last generated token: {e}");
                a.rep.send(Err(e.into()));
            }
        }
        self.release(&id);
    }

    /// Session `id` stopped generating: run the commands that waited for it, in order, until
    /// one of them makes it generate again.
    fn release(&mut self, id: &str) {
        self.sched.busy.remove(id);
        while !self.sched.busy.contains_key(id) {
            let Some(job) = self
                .sched
                .deferred
                .get_mut(id)
                .and_then(VecDeque::pop_front)
            else {
                break;
            };
            self.run_job(job);
        }
        if self.sched.deferred.get(id).is_some_and(VecDeque::is_empty) {
            self.sched.deferred.remove(id);
        }
    }

    /// Hold `job` if it is a command of its tenant's session that is generating now; `None`
    /// when it was held.
    pub(super) fn defer_if_busy(&mut self, job: Job) -> Option<Job> {
        let id = match &job.cmd {
            Cmd::SessionInfo(id) | Cmd::DeleteSession(id) => id,
            Cmd::Append { session, .. }
            | Cmd::Generate { session, .. }
            | Cmd::Snapshot { session, .. }
            | Cmd::Restore { session, .. }
            | Cmd::Rollback { session, .. }
            | Cmd::Fork { session, .. } => session,
            _ => return Some(job),
        };
        if self
            .sched
            .busy
            .get(id)
            .is_none_or(|o| **o != *job.tenant.name)
        {
            return Some(job);
        }
        let id = id.clone();
        self.sched.deferred.entry(id).or_default().push_back(job);
        None
    }

    pub(super) fn publish_schedule(&self) {
        self.metrics
            .generating
            .store(self.sched.active.len() as u64, Ordering::Relaxed);
        self.metrics
            .waiting
            .store(self.sched.waiting.len() as u64, Ordering::Relaxed);
    }
}

/// Answer a completion with an error (and end its stream with it).
fn fail(rep: &mut Replier, stream: Option<&mpsc::UnboundedSender<Event>>, e: ApiError) {
    if let Some(tx) = stream {
        let _ = tx.send(Event::Error(e.clone()));
    }
    rep.send(Err(e));
}

/// Side by side: tell the stream that the tokens that follow are choice `i`'s (the SSE layer
/// keeps each choice's own first-chunk and offset state).
fn switch_choice(c: &mut Choices, i: usize, stream: Option<&mpsc::UnboundedSender<Event>>) {
    if c.streaming != i {
        c.streaming = i;
        if let Some(tx) = stream {
            let _ = tx.send(Event::Choice(i));
        }
    }
}

/// Choice `i` ended with `out`: its entry in the answer, its finish chunk on the stream.
fn record_choice(
    c: &mut Choices,
    i: usize,
    out: Generated,
    req: &GenReq,
    sampler: &SamplerState,
    stream: Option<&mpsc::UnboundedSender<Event>>,
) {
    c.completion_tokens += out.tokens.len();
    if let Some(st) = out.spec {
        *c.spec.get_or_insert_with(Default::default) += st;
    }
    if let Some(tx) = stream {
        let _ = tx.send(Event::ChoiceEnd(
            json!({"index": i, "finish_reason": out.finish}),
        ));
    }
    c.done.push(json!({
        "index": i,
        "tokens": out.tokens,
        "text": out.text,
        "finish_reason": out.finish,
        "seed": choice_sampler(sampler, i).seed,
        "logprobs": logprobs_json(req, &out.logprobs),
    }));
}
