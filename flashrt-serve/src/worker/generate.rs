//! Generation: the token loop of completions and of session `generate` (plain steps, the
//! device or host sampler, logprobs, speculative rounds with the MTP head) as a resumable
//! state, one token per [`Worker::gen_step`]; `schedule.rs` interleaves completions with it.

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
    /// When the first token was handed to the client.
    first: Option<Instant>,
    spec_max: usize,
    speculate: bool,
    spec: flashrt_runtime::SpecStats,
}

impl GenState {
    /// The token this generation's next [`Worker::gen_step`] feeds before it chooses another
    /// — its last, unfed one, when generation goes on (tokens left, room in the session) — if
    /// another step may feed it instead: a scheduler round feeds these together, in one
    /// batched step. Speculative generations feed inside their own rounds (`None`).
    pub(super) fn feed_due(&self, req: &GenReq, pos: usize, max_seq: usize) -> Option<u32> {
        if self.speculate || self.out.len() >= req.max_tokens || pos + 1 >= max_seq {
            return None;
        }
        self.unfed
    }

    /// The token [`GenState::feed_due`] gave was fed.
    pub(super) fn fed(&mut self) {
        self.unfed = None;
    }

    /// When this generation's first token was handed to the client (`None` before).
    pub(super) fn first(&self) -> Option<Instant> {
        self.first
    }
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
            first: None,
            spec_max,
            speculate,
            spec: flashrt_runtime::SpecStats::default(),
        }
    }

    /// One token of `g` (or one speculative round): returns whether the generation has ended.
    /// Each token is streamed the moment it is chosen and fed to the session only when the
    /// next one is wanted, so no step runs after the last token: the session is left at the
    /// boundary before it, and the last token comes back unfed ([`Generated::unfed`]: the
    /// sessions API feeds it after answering; a completion never needs it). A speculative
    /// round feeds its tokens itself (the last one inside its verify pass), and may commit
    /// tokens past a stop token: only completions speculate.
    ///
    /// `cache_prompt`: store the session's boundary as an automatic capsule of that tenant
    /// right after the first token is out (the session still stands there), so the copy and
    /// the store's bookkeeping never delay the first token.
    pub(super) fn gen_step(
        &mut self,
        s: &mut Session,
        g: &mut GenState,
        req: &GenReq,
        stream: Option<&mpsc::UnboundedSender<Event>>,
        cache_prompt: Option<&Tenant>,
    ) -> WResult<bool> {
        if g.out.len() >= req.max_tokens {
            return Ok(true);
        }
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
                // The step returns before the device has run it: the tuner weighs what it
                // costs (the token drawn next waits for it anyway).
                s.synchronize()?;
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
            let x = s.argmax_next()?;
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
        Ok(stop || g.out.len() >= req.max_tokens)
    }

    /// What an ended generation produced; streams the text still held back.
    pub(super) fn gen_end(
        &mut self,
        g: &mut GenState,
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
            tokens: std::mem::take(&mut g.out),
            finish: g.finish,
            text: visible,
            unfed: g.unfed,
            logprobs: std::mem::take(&mut g.logprobs),
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
            g.first = Some(now);
            self.metrics.ttft.observe(now - g.last);
            tracing::debug!(
                "first token {:.2} ms after arrival",
                (now - g.last).as_secs_f64() * 1e3
            );
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
}

/// Choice `i`'s sampler: the request's, its RNG stream restarted at `seed + i` (wrapping).
pub(super) fn choice_sampler(base: &SamplerState, i: usize) -> SamplerState {
    base.reseeded(base.seed.wrapping_add(i as u64))
}
