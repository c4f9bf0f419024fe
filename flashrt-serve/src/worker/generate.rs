//! Generation: the token loop of completions and of session `generate` (plain steps, the
//! device or host sampler, logprobs, speculative rounds with the MTP head), and the
//! completion command around it (prefix reuse, prefill and the automatic capsules, through
//! the worker's helpers in `mod.rs`).

use super::*;

/// What [`Worker::generate`] produced.
pub(super) struct Generated {
    pub(super) tokens: Vec<u32>,
    pub(super) finish: &'static str,
    pub(super) text: String,
    /// The last token, chosen and streamed but not yet fed to the session.
    pub(super) unfed: Option<u32>,
    /// Per token, when asked for.
    pub(super) logprobs: Vec<TokenLogprobs>,
    /// What speculative rounds did, when the request could speculate.
    pub(super) spec: Option<flashrt_runtime::SpecStats>,
}

/// A request's speculative rounds as the summary JSON carries them.
pub(super) fn spec_json(s: &Option<flashrt_runtime::SpecStats>) -> Value {
    match s {
        None => Value::Null,
        Some(s) => json!({"rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                          "rollbacks": s.rollbacks}),
    }
}

/// Generated log-probabilities as the summary JSON carries them (`null` when not asked for).
pub(super) fn logprobs_json(req: &GenReq, l: &[TokenLogprobs]) -> Value {
    if req.logprobs.is_none() {
        return Value::Null;
    }
    l.iter()
        .map(|t| {
            json!({"token": t.token, "logprob": t.logprob,
                   "top": t.top.iter().map(|(id, lp)| json!([id, lp])).collect::<Vec<_>>()})
        })
        .collect()
}

/// A generation in progress: what [`Worker::gen_step`] carries from one token to the next, so
/// the scheduler can interleave several (see `schedule.rs`).
pub(super) struct GenState {
    out: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    finish: &'static str,
    /// The last token chosen and streamed, fed when the next one is wanted.
    unfed: Option<u32>,
    text: Option<TextStream>,
    /// When the previous token was handed to the client (first: when the request arrived).
    last: Instant,
    spec_max: usize,
    speculate: bool,
    spec: flashrt_runtime::SpecStats,
    done: bool,
}

impl Worker {
    /// A generation of `req` from `s`'s boundary, for a request that arrived at `enqueued`.
    pub(super) fn gen_start(&self, s: &Session, req: &GenReq, enqueued: Instant) -> GenState {
        // Speculative rounds (MTP head, greedy, no per-token logprobs): see `speculate`.
        let spec_max = req
            .speculative
            .unwrap_or(self.cfg.speculative)
            .min(flashrt_runtime::ir::lower::MAX_DRAFT);
        let speculate = spec_max > 0
            && self.model.ir().mtp.is_some()
            && (s.sampler().is_greedy() || s.sampler().top_k == 1)
            && !s.sampler().has_penalties()
            && req.logprobs.is_none()
            && s.pending().is_none();
        GenState {
            out: Vec::new(),
            logprobs: Vec::new(),
            finish: "length",
            unfed: None,
            text: self
                .text
                .as_ref()
                .map(|t| TextStream::new(&t.tokenizer, &req.stop_strings)),
            last: enqueued,
            spec_max,
            speculate,
            spec: flashrt_runtime::SpecStats::default(),
            done: false,
        }
    }

    /// Sample up to `req.max_tokens` tokens. Each token is streamed the moment it is chosen and
    /// fed to the session only when the next one is wanted, so no step runs after the last
    /// token: the session is left at the boundary before it, and the last token comes back
    /// unfed (the sessions API feeds it after answering; a completion never needs it). A
    /// speculative round feeds its tokens itself (the last one inside its verify pass), and
    /// may commit tokens past a stop token: only completions speculate.
    /// Returns the ids, the finish reason, the visible text (decoded incrementally, cut before
    /// a stop string; empty without a tokenizer) and the unfed token.
    ///
    /// `cache_prompt`: store the session's boundary as an automatic capsule of that tenant
    /// right after the first token is out (the session still stands there), so the copy and
    /// the store's bookkeeping never delay the first token.
    pub(super) fn generate(
        &mut self,
        s: &mut Session,
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
        cache_prompt: Option<&Tenant>,
    ) -> WResult<Generated> {
        let mut g = self.gen_start(s, req, self.job_enqueued);
        while !self.gen_step(s, &mut g, req, stream, cache_prompt)? {}
        Ok(self.gen_end(g, stream))
    }

    /// One token of `g` (or one speculative round): returns whether the generation has ended.
    pub(super) fn gen_step(
        &mut self,
        s: &mut Session,
        g: &mut GenState,
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
        cache_prompt: Option<&Tenant>,
    ) -> WResult<bool> {
        if g.done || g.out.len() >= req.max_tokens {
            g.done = true;
            return Ok(true);
        }
        g.done = true;
        let max = self.model.max_seq();
        // The token sampled next goes to position `pos` (after the unfed one).
        if s.pos() + g.unfed.is_some() as usize >= max {
            return Ok(true);
        }
        if self.cfg.cancel.load(Ordering::Relaxed) {
            g.finish = "cancelled";
            return Ok(true);
        }
        if let Some(prev) = g.unfed.take() {
            let t0 = Instant::now();
            s.append(&[prev])?;
            if g.speculate {
                self.tuner.plain_token(t0.elapsed().as_secs_f64());
            }
        }
        // A speculative round: its first token is the target's own choice, streamed before
        // the round runs; the drafts it accepts follow when it is verified. All its tokens are
        // fed (the last inside the verify pass).
        let room = max - s.pos();
        let k = if g.speculate && !g.out.is_empty() {
            self.tuner.next(g.spec_max)
        } else {
            0
        };
        let n = (k + 1).min(req.max_tokens - g.out.len()).min(room);
        if k > 0 && n >= 2 {
            let x = flashrt_runtime::argmax(s.last_logits()).ok_or_else(|| {
                ApiError::new(500, "internal", "the logits row has no finite value")
            })?;
            if self.emit(x, None, &req.stop, g, stream) {
                // Stopped (or gone) at the round's first token: not fed, as in plain
                // decoding.
                g.unfed = Some(x);
                return Ok(true);
            }
            let t0 = Instant::now();
            let (toks, st) = s.speculative_round(k.min(n - 1), &mut MtpDrafter)?;
            self.tuner
                .round(k.min(n - 1), toks.len(), t0.elapsed().as_secs_f64());
            g.spec += st;
            self.metrics
                .spec_rounds
                .fetch_add(st.rounds, Ordering::Relaxed);
            self.metrics
                .spec_drafted
                .fetch_add(st.drafted, Ordering::Relaxed);
            self.metrics
                .spec_accepted
                .fetch_add(st.accepted, Ordering::Relaxed);
            debug_assert_eq!(toks.first(), Some(&x));
            for &t in &toks[1..] {
                if self.emit(t, None, &req.stop, g, stream) {
                    // Tokens after a stop were committed too (the session stands after the
                    // round); only what the client gets is cut.
                    return Ok(true);
                }
            }
            g.done = false;
            return Ok(false);
        }
        // The prompt capsule keeps the sampler as it was before this draw.
        let before = (g.out.is_empty() && cache_prompt.is_some()).then(|| s.sampler().clone());
        let t = s.sample_next()?;
        // From the row the token was chosen from (sampling does not change it).
        let lp = req
            .logprobs
            .and_then(|k| flashrt_runtime::sampling::logprobs(s.last_logits(), t, k));
        if let Some(l) = &lp {
            g.logprobs.push(l.clone());
        }
        g.unfed = Some(t);
        let stop = self.emit(t, lp, &req.stop, g, stream);
        if let (Some(tenant), Some(sampler)) = (cache_prompt, before) {
            self.store_auto(s, Some(sampler), tenant)?;
        }
        g.done = stop || g.out.len() >= req.max_tokens;
        Ok(g.done)
    }

    /// What an ended generation produced; streams the text still held back.
    pub(super) fn gen_end(
        &mut self,
        mut g: GenState,
        stream: Option<&mpsc::UnboundedSender<Event>>,
    ) -> Generated {
        self.metrics
            .spec_k
            .store(self.tuner.k() as u64, Ordering::Relaxed);
        let visible = match g.text.as_mut() {
            Some(ts) => {
                let tail = ts.finish();
                if let Some(tx) = stream
                    && !tail.text.is_empty()
                {
                    let _ = tx.send(Event::Token(None, tail.text, None));
                }
                ts.text().to_string()
            }
            None => String::new(),
        };
        Generated {
            tokens: g.out,
            finish: g.finish,
            text: visible,
            unfed: g.unfed,
            logprobs: g.logprobs,
            spec: g.speculate.then_some(g.spec),
        }
    }

    /// Hand token `t` to the client (stream event, text, metrics); returns whether generation
    /// ends with it (`g.finish` says why).
    fn emit(
        &self,
        t: u32,
        lp: Option<TokenLogprobs>,
        stop_ids: &[u32],
        g: &mut GenState,
        stream: Option<&mpsc::UnboundedSender<Event>>,
    ) -> bool {
        g.out.push(t);
        self.metrics
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        let piece = g.text.as_mut().map(|ts| ts.push(t)).unwrap_or_default();
        let gone = stream.is_some_and(|tx| tx.send(Event::Token(Some(t), piece.text, lp)).is_err());
        let now = Instant::now();
        if g.out.len() == 1 {
            self.metrics.ttft.observe(now - g.last);
        } else {
            self.metrics.inter_token.observe(now - g.last);
        }
        g.last = now;
        if gone {
            g.finish = "cancelled";
            return true;
        }
        if stop_ids.contains(&t) || piece.stop {
            g.finish = "stop";
            return true;
        }
        false
    }

    pub(super) fn complete(
        &mut self,
        prompt: Vec<u32>,
        req: GenReq,
        stream: Option<mpsc::UnboundedSender<Event>>,
        t: &Tenant,
        rep: &mut Replier,
    ) -> WResult<Out> {
        if prompt.is_empty() {
            return Err(ApiError::bad("invalid_tokens", "the prompt is empty"));
        }
        self.validate_tokens(&prompt, 0)?;
        if prompt.len() >= self.model.max_seq() && req.max_tokens > 0 {
            return Err(ApiError::bad(
                "context_length_exceeded",
                format!(
                    "the prompt has {} tokens; the model holds {} (max_seq), leaving no room to generate",
                    prompt.len(),
                    self.model.max_seq()
                ),
            ));
        }
        if let Some(sm) = &req.sampler {
            sm.validate()?;
        }
        let mut s = match self.scratch.take() {
            Some(s) => s,
            None => self.fresh_session()?,
        };
        let r = self.complete_in(&mut s, &prompt, &req, stream.as_ref(), t, rep);
        self.scratch = Some(s);
        match r {
            Ok(v) => {
                if let Some(tx) = &stream {
                    let _ = tx.send(Event::Done(v.clone()));
                }
                Ok(Out::Json(v))
            }
            Err(e) => {
                if let Some(tx) = &stream {
                    let _ = tx.send(Event::Error(e.clone()));
                }
                // Whatever state the scratch session is in, the next request resets it.
                Err(e)
            }
        }
    }

    fn complete_in(
        &mut self,
        s: &mut Session,
        prompt: &[u32],
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
        t: &Tenant,
        rep: &mut Replier,
    ) -> WResult<Value> {
        let cached = self.reuse_prefix(s, prompt, t)?;
        self.prefill(s, &prompt[cached..])?;
        let sampler = req.sampler.clone().unwrap_or_default();
        s.set_sampler(sampler.clone());
        if stream.is_some() {
            rep.send(Ok(Out::Stream));
        }
        // A new prompt boundary is stored, after its first token is out.
        let cache_prompt = (self.cfg.auto_cache && cached < prompt.len()).then_some(t);
        if req.max_tokens == 0
            && let Some(t) = cache_prompt
        {
            self.store_auto(s, None, t)?;
        }
        if req.n > 1 {
            return self.complete_choices(s, prompt, req, stream, cache_prompt, cached, &sampler);
        }
        let g = self.generate(s, req, stream, cache_prompt)?;
        // The session stands before the last token (never fed: nothing will read it), so the
        // capsule worth keeping for a follow-up holds the prompt and all but that token.
        if self.cfg.auto_cache && g.tokens.len() > 1 && g.finish != "cancelled" {
            self.store_auto(s, None, t)?;
        }
        Ok(json!({
            "tokens": g.tokens,
            "text": g.text,
            "finish_reason": g.finish,
            "prompt_tokens": prompt.len(),
            "cached_tokens": cached,
            "seed": s.sampler().seed,
            "logprobs": logprobs_json(req, &g.logprobs),
            "speculative": spec_json(&g.spec),
        }))
    }

    /// `n` > 1 choices from the prefilled prompt: the session's boundary is kept as a capsule
    /// (one device copy before the first token) and each choice after the first starts from
    /// it, with seed `seed + i`. The choices run one after another (the small-batch scheduler
    /// will step them together); streamed, each choice's tokens follow an [`Event::Choice`]
    /// marker and end with an [`Event::ChoiceEnd`]. Only the prompt boundary is stored
    /// automatically (a follow-up could continue any choice).
    #[allow(clippy::too_many_arguments)]
    fn complete_choices(
        &mut self,
        s: &mut Session,
        prompt: &[u32],
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
        cache_prompt: Option<&Tenant>,
        cached: usize,
        sampler: &SamplerState,
    ) -> WResult<Value> {
        let boundary = s.snapshot()?;
        let mut choices = Vec::with_capacity(req.n);
        let mut completion_tokens = 0;
        let mut spec: Option<flashrt_runtime::SpecStats> = None;
        for i in 0..req.n {
            if i > 0 {
                if let Some(tx) = stream
                    && tx.send(Event::Choice(i)).is_err()
                {
                    break;
                }
                s.restore(&boundary)?;
                s.set_sampler(choice_sampler(sampler, i));
            }
            let g = self.generate(s, req, stream, if i == 0 { cache_prompt } else { None })?;
            completion_tokens += g.tokens.len();
            if let Some(st) = g.spec {
                *spec.get_or_insert_with(Default::default) += st;
            }
            if let Some(tx) = stream {
                let _ = tx.send(Event::ChoiceEnd(
                    json!({"index": i, "finish_reason": g.finish}),
                ));
            }
            let cancelled = g.finish == "cancelled";
            choices.push(json!({
                "index": i,
                "tokens": g.tokens,
                "text": g.text,
                "finish_reason": g.finish,
                "seed": choice_sampler(sampler, i).seed,
                "logprobs": logprobs_json(req, &g.logprobs),
            }));
            if cancelled {
                break;
            }
        }
        Ok(json!({
            "choices": choices,
            "completion_tokens": completion_tokens,
            "prompt_tokens": prompt.len(),
            "cached_tokens": cached,
            "seed": sampler.seed,
            "speculative": spec_json(&spec),
        }))
    }
}

/// Choice `i`'s sampler: the request's, seeded with `seed + i` (wrapping) from the start of
/// its RNG stream.
pub(super) fn choice_sampler(base: &SamplerState, i: usize) -> SamplerState {
    let fresh = SamplerState::seeded(base.seed.wrapping_add(i as u64), 0.0, 0, 1.0);
    SamplerState {
        seed: fresh.seed,
        rng: fresh.rng,
        ..base.clone()
    }
}
