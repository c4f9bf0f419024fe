//! The worker's session pool: sessions made, warmed (their plans' graphs captured before the
//! first client), reused and trimmed to what the memory plan leaves.

use super::*;

impl Worker {
    /// A session for the sessions API: within the tenant's and the memory plan's limits (else
    /// 429), an idle pooled one (reset, its graphs already captured) while more than one is
    /// idle, else a fresh one after trimming the pool to the room left.
    pub(super) fn new_session(&mut self, t: &Tenant) -> WResult<Session> {
        // Sessions generating are out of the map but still open.
        let mine = self.sessions.values().filter(|s| s.owner == t.name).count()
            + self.sched.busy.values().filter(|o| ***o == *t.name).count();
        let open = self.open_sessions();
        let cap = t.max_sessions.unwrap_or(self.cfg.max_sessions);
        if mine >= cap || open >= self.cfg.max_sessions {
            return Err(ApiError::new(
                429,
                "too_many_sessions",
                format!(
                    "{} sessions are open (the limit is {}); delete one first",
                    if mine >= cap { mine } else { open },
                    if mine >= cap {
                        cap
                    } else {
                        self.cfg.max_sessions
                    }
                ),
            ));
        }
        // An idle pooled session beyond the one kept for completions becomes the new session,
        // reset to a fresh one's state: its plans' graphs are already captured (a robot loop's
        // first appends run at full speed) and no memory moves.
        if self.pool.len() > 1
            && let Some(mut s) = self.pool.pop()
            && s.reset().is_ok()
        {
            s.set_sampler(flashrt_runtime::SamplerState::default());
            s.set_logits_mode(LogitsMode::Last);
            return Ok(s);
        }
        // Otherwise a new one, in the place of an idle pooled one where the memory plan has
        // no room for both (one pooled session always stays).
        let keep = self.idle_room(1);
        self.pool.truncate(keep);
        self.fresh_session().map_err(|e| {
            if e.code == "internal" && e.message.contains("OUT_OF_MEMORY") {
                ApiError::new(
                    429,
                    "out_of_device_memory",
                    format!(
                        "no device memory left for another session ({} open); delete one first",
                        self.sessions.len()
                    ),
                )
            } else {
                e
            }
        })
    }

    /// On a backend that runs plans as captured graphs (CUDA), the pooled sessions (one per
    /// session of the largest batched step, as many as the pool keeps) are created and every
    /// plan captured on them before the first job: otherwise requests would pay for the
    /// captures (measured on the H200, 27B shape: 32 tokens after a stored prefix took 39.9
    /// instead of 19.2 ms on the plan's second use; warming took 1.8 s a session). Best
    /// effort: a failure leaves fewer pooled sessions and sessions are made on demand.
    pub(super) fn warm_pool(&mut self) {
        if !self.cfg.warm.unwrap_or_else(|| self.model.pads_rows()) || !self.pool.is_empty() {
            return;
        }
        let start = Instant::now();
        match self
            .fresh_session()
            .map_err(|e| e.message)
            .and_then(|mut s| {
                s.warm_plans().map_err(|e| e.to_string())?;
                Ok(s)
            }) {
            Ok(s) => {
                self.pool.push(s);
                tracing::info!(
                    "serving session ready, every plan's graph captured ({:.1} s)",
                    start.elapsed().as_secs_f64()
                );
            }
            Err(e) => {
                tracing::warn!("warming the serving session failed ({e}); continuing");
                return;
            }
        }
        // The batched decode steps' graphs too (one per size of the ladder, shared by every
        // set of sessions), on scratch sessions beside the pooled one. (Where the backend
        // steps them one by one this only costs the steps.)
        let start = Instant::now();
        let cap = self.generating_capacity();
        let sizes: Vec<usize> = (self.model.ir().batch_sizes().into_iter())
            .filter(|&b| b <= cap)
            .collect();
        let Some(&most) = sizes.last() else {
            return;
        };
        let model = self.model.clone();
        let mut extra = Vec::with_capacity(most - 1);
        let warmed = (|| -> WResult<()> {
            for _ in 1..most {
                extra.push(self.fresh_session()?);
            }
            let first = self.pool.last_mut().expect("pushed above");
            let mut all: Vec<&mut Session> =
                std::iter::once(first).chain(extra.iter_mut()).collect();
            for &b in &sizes {
                for _ in 0..2 {
                    model.step_batch(&mut all[..b], &vec![0; b])?;
                }
            }
            for s in all {
                s.reset()?;
            }
            Ok(())
        })();
        // The scratch sessions stay pooled (as many as the pool keeps), each with every plan
        // captured too, so no burst of parallel completions pays for an allocation or a
        // capture (a plan's second use on a session would capture it).
        if warmed.is_ok() {
            extra.truncate(self.idle_sessions_kept().saturating_sub(self.pool.len()));
            let start = Instant::now();
            match extra.iter_mut().try_for_each(|s| s.warm_plans()) {
                Ok(()) => {
                    if !extra.is_empty() {
                        tracing::info!(
                            "{} more pooled sessions ready, every plan's graph captured ({:.1} s)",
                            extra.len(),
                            start.elapsed().as_secs_f64()
                        );
                    }
                    self.pool.extend(extra);
                }
                Err(e) => tracing::warn!("warming the pooled sessions failed ({e}); continuing"),
            }
        }
        match warmed {
            Ok(()) => tracing::info!(
                "batched decode steps of {sizes:?} sessions captured ({:.1} s)",
                start.elapsed().as_secs_f64()
            ),
            Err(e) => {
                tracing::warn!(
                    "warming the batched steps failed ({}); continuing",
                    e.message
                );
                // The pooled session may have stepped: start it over.
                if let Some(s) = self.pool.last_mut()
                    && s.reset().is_err()
                {
                    self.pool.clear();
                }
            }
        }
    }

    /// A session as the server uses it: only the last position's logits are kept (it samples
    /// the next token and nothing else), so a prompt's chunks skip the LM head on the device
    /// and no row but the last crosses to the host.
    pub(super) fn fresh_session(&self) -> WResult<Session> {
        let mut s = self.model.session()?;
        s.set_logits_mode(LogitsMode::Last);
        Ok(s)
    }

    /// Idle sessions kept for the next completions: as many as could generate at once beside
    /// the open sessions and the completions holding theirs (at least one, at most
    /// [`MAX_GENERATING`]), so a burst of parallel requests (an agent's fan-out, `n` choices)
    /// finds sessions whose graphs are captured instead of allocating and capturing anew each
    /// time; the rest go back to the device.
    pub(super) fn idle_sessions_kept(&self) -> usize {
        self.idle_room(0).min(MAX_GENERATING)
    }

    /// Sessions the memory plan (`max_sessions` + 1) leaves idle beside the open ones, the
    /// completions' and `opening` more, and always one.
    pub(super) fn idle_room(&self, opening: usize) -> usize {
        (self.cfg.max_sessions + 1)
            .saturating_sub(self.open_sessions() + self.sched.completions() + opening)
            .max(1)
    }

    pub(super) fn trim_pool(&mut self) {
        let keep = self.idle_sessions_kept();
        self.pool.truncate(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker over the demo model (random weights) on the CPU reference.
    fn demo_worker(max_sessions: usize, warm: bool) -> (Model, Worker) {
        let src = include_str!("../../../models/demo.toml");
        let ir = flashrt_compiler::model_from_toml(src, "demo.toml").unwrap();
        let cpu: Arc<dyn flashrt_runtime::Backend> = Arc::new(flashrt_runtime::CpuBackend::new());
        let model = Model::with_random_weights(cpu, &ir, 3).unwrap();
        let store = CapsuleStore::open(model.clone(), Default::default()).unwrap();
        let cfg = WorkerConfig {
            max_sessions,
            auto_cache: true,
            share_prefix_cache: false,
            cancel: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            speculative: 0,
            warm: Some(warm),
        };
        let w = Worker::new(model.clone(), store, Arc::default(), None, cfg);
        (model, w)
    }

    /// Warming (forced here on the CPU reference, where it is otherwise skipped) leaves pooled
    /// sessions at position 0 with every state byte zero, after running every plan and the
    /// batched steps of the whole ladder on the first and on the others: one per session of
    /// the largest batch.
    #[test]
    fn warming_leaves_fresh_pooled_sessions() {
        let (model, mut w) = demo_worker(8, true);
        w.warm_pool();
        let most = *model.ir().batch_sizes().last().unwrap();
        assert!(most > 1, "the demo model has a batch ladder");
        assert_eq!(w.pool.len(), most);
        for s in &w.pool {
            assert_eq!(s.pos(), 0);
            for b in model.compiled().layout.state_buffers() {
                let bytes = s.read_region(b.id).unwrap();
                assert!(bytes.iter().all(|&x| x == 0), "state `{}` not zero", b.name);
            }
        }
        // Warming twice does nothing more.
        w.warm_pool();
        assert_eq!(w.pool.len(), most);
    }

    /// Idle sessions are kept for the next burst of completions within the memory plan: as
    /// many as could generate beside the open sessions (at least one, at most
    /// MAX_GENERATING), fewer as sessions-API sessions open.
    #[test]
    fn the_pool_keeps_what_the_memory_plan_leaves() {
        let (model, mut w) = demo_worker(4, false);
        let tenant = crate::tenants::Tenant::default_tenant();
        let fresh = w.fresh_session().unwrap();
        for i in 0..7 {
            // Idle sessions as completions leave them: advanced, sampling, all logits kept.
            let mut s = w.fresh_session().unwrap();
            s.set_logits_mode(LogitsMode::All);
            s.append(&[1, 2, 3 + i]).unwrap();
            s.set_sampler(flashrt_runtime::SamplerState {
                temperature: 0.8,
                ..flashrt_runtime::SamplerState::default()
            });
            w.pool.push(s);
        }
        // max_sessions + 1 = 5 sessions in the plan, none open.
        w.trim_pool();
        assert_eq!(w.pool.len(), 5);
        // Each API session takes an idle one's place: reused while more than one is idle, as
        // fresh as a new session (state, position, sampler, logits kept).
        for want in [4, 3, 2, 1] {
            let mut session = w.new_session(&tenant).unwrap();
            assert_eq!(w.pool.len(), want);
            assert_eq!(session.pos(), 0);
            assert_eq!(session.sampler(), fresh.sampler());
            for b in model.compiled().layout.state_buffers() {
                let bytes = session.read_region(b.id).unwrap();
                assert!(bytes.iter().all(|&x| x == 0), "state `{}` not zero", b.name);
            }
            session.append(&[5, 6]).unwrap();
            assert_eq!(session.logits_rows(), 1, "only the last row kept");
            let owner = tenant.name.clone();
            w.sessions
                .insert(format!("s{want}"), Slot { session, owner });
            w.trim_pool();
            assert_eq!(w.pool.len(), want);
        }
        // The plan is full: a further API session is refused, one idle session stays.
        let Err(e) = w.new_session(&tenant) else {
            panic!("a session beyond the memory plan was made")
        };
        assert_eq!((e.status, e.code), (429, "too_many_sessions"));
        assert_eq!(w.pool.len(), 1);
        // With room again, a new session is made and the last idle one stays for completions.
        w.sessions.remove("s1");
        let s = w.new_session(&tenant).unwrap();
        assert_eq!((s.pos(), w.pool.len()), (0, 1));
    }
}
