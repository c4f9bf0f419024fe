//! The worker's commands: the sessions API (create, append, generate, snapshot, restore,
//! rollback, fork, ...) and the capsule commands, each validated and answered here.

use super::*;

impl Worker {
    /// Runs one command of a tenant and gives the reply (or the client's error).
    pub(super) fn handle(&mut self, cmd: Cmd, t: &Tenant) -> WResult<Out> {
        match cmd {
            Cmd::CreateSession(req) => self.create(req, t),
            Cmd::SessionInfo(id) => {
                let s = self.session(&id, t)?;
                Ok(Out::Json(json!({
                    "session": id,
                    "pos": s.pos(),
                    "tokens": s.tokens(),
                    "sampler": sampler_json(s.sampler()),
                    "counters": {
                        "steps": s.counters().steps,
                        "prefill_tokens": s.counters().prefill_tokens,
                        "decode_tokens": s.counters().decode_tokens,
                    },
                })))
            }
            Cmd::ListSessions => {
                let mut v: Vec<Value> = self
                    .sessions
                    .iter()
                    .filter(|(_, s)| s.owner == t.name)
                    .map(|(id, s)| json!({"session": id, "pos": s.session.pos()}))
                    .chain(
                        self.sched
                            .busy
                            .iter()
                            .filter(|(_, owner)| ***owner == *t.name)
                            .map(|(id, _)| json!({"session": id, "generating": true})),
                    )
                    .collect();
                v.sort_by(|a, b| a["session"].as_str().cmp(&b["session"].as_str()));
                Ok(Out::Json(json!({"sessions": v})))
            }
            Cmd::DeleteSession(id) => {
                self.take(&id, t)?;
                Ok(Out::Json(json!({"deleted": id})))
            }
            Cmd::Append { session, tokens } => {
                let pos = self.session(&session, t)?.pos();
                if tokens.is_empty() {
                    return Err(ApiError::bad(
                        "invalid_tokens",
                        "append needs at least one token",
                    ));
                }
                self.validate_tokens(&tokens, pos)?;
                let mut s = self.take(&session, t)?;
                let t0 = Instant::now();
                let r = self.prefill(&mut s, &tokens);
                let took = t0.elapsed();
                let pos = s.pos();
                self.put_back(session.clone(), s, t);
                r?;
                // As `restore_us` for a restore: the worker's time for the prefill.
                Ok(Out::Json(json!({"session": session, "pos": pos,
                                    "prefill_us": took.as_secs_f64() * 1e6})))
            }
            // Taken by the scheduler before `handle` (see `run_job`).
            Cmd::Generate { .. } => Err(ApiError::new(
                500,
                "internal",
                "a generation reached the wrong handler",
            )),
            Cmd::Snapshot {
                session,
                persist,
                label,
            } => {
                let cap = snapshot_anywhere(self.session(&session, t)?)?;
                let id = self.store_computed(cap, label, t)?;
                if persist {
                    // Durable or an error: the capsule itself stays in memory either way.
                    self.store.persist(&id).map_err(|e| {
                        let mut a = ApiError::from(e);
                        a.message =
                            format!("capsule `{id}` was stored but not persisted: {}", a.message);
                        a
                    })?;
                }
                let info = self.store.info(&id)?;
                Ok(Out::Json(capsule_json(&info)))
            }
            Cmd::Restore { session, capsule } => {
                self.session(&session, t)?;
                self.check_capsule(&capsule, t)?;
                let mut s = self.take(&session, t)?;
                let r = self.restore_stored(&capsule, &mut s);
                let pos = s.pos();
                self.put_back(session.clone(), s, t);
                let info = r?;
                Ok(Out::Json(json!({
                    "session": session,
                    "capsule": capsule,
                    "pos": pos,
                    "from_tier": info.tier.name(),
                    "restore_us": info.elapsed.as_secs_f64() * 1e6,
                })))
            }
            Cmd::Rollback {
                session,
                capsule,
                pos,
            } => {
                let history: Vec<u32> = self.session(&session, t)?.tokens().to_vec();
                let capsule = match (capsule, pos) {
                    (Some(c), None) => {
                        self.check_capsule(&c, t)?;
                        let toks = self.store.tokens(&c)?;
                        if toks.len() > history.len() || history[..toks.len()] != toks[..] {
                            return Err(ApiError::new(
                                409,
                                "not_a_prefix",
                                format!(
                                    "capsule `{c}` (position {}) is not a boundary of this session's history (position {})",
                                    toks.len(),
                                    history.len()
                                ),
                            ));
                        }
                        c
                    }
                    (None, Some(p)) => {
                        if p > history.len() {
                            return Err(ApiError::bad(
                                "invalid_request",
                                format!(
                                    "position {p} is past the session's position {}",
                                    history.len()
                                ),
                            ));
                        }
                        // Only capsules computed here for this tenant: an imported one's history
                        // is only its claim.
                        match self
                            .store
                            .longest_prefix_in(&history[..p], PrefixScope::Trusted(&t.name))
                        {
                            Some((c, q)) if q == p => c,
                            _ => {
                                return Err(ApiError::new(
                                    409,
                                    "no_capsule_at_position",
                                    format!(
                                        "no stored capsule holds this session's first {p} tokens; snapshot there first"
                                    ),
                                ));
                            }
                        }
                    }
                    _ => {
                        return Err(ApiError::bad(
                            "invalid_request",
                            "give exactly one of `capsule` and `pos`",
                        ));
                    }
                };
                let mut s = self.take(&session, t)?;
                let r = self.restore_stored(&capsule, &mut s);
                let pos = s.pos();
                self.put_back(session.clone(), s, t);
                r?;
                Ok(Out::Json(
                    json!({"session": session, "capsule": capsule, "pos": pos}),
                ))
            }
            Cmd::Fork { session, n } => {
                let cap = snapshot_anywhere(self.session(&session, t)?)?;
                let mut ids = Vec::new();
                for i in 0..n.unwrap_or(1) {
                    let branch = self.new_session(t).and_then(|mut s| {
                        s.restore(&cap)?;
                        if i > 0 {
                            s.reseed(s.sampler().seed.wrapping_add(i as u64));
                        }
                        Ok(s)
                    });
                    match branch {
                        Ok(s) => {
                            let id = self.new_id();
                            self.put_back(id.clone(), s, t);
                            ids.push(id);
                        }
                        Err(e) => {
                            // All or nothing.
                            for id in &ids {
                                self.sessions.remove(id);
                            }
                            return Err(e);
                        }
                    }
                }
                let pos = cap.meta.pos;
                Ok(Out::Json(match n {
                    None => json!({"session": ids[0], "forked_from": session, "pos": pos}),
                    Some(_) => json!({"sessions": ids, "forked_from": session, "pos": pos}),
                }))
            }
            Cmd::ListCapsules => {
                let ids = self.store.ids_of(Some(&t.name));
                let v: Vec<Value> = ids
                    .iter()
                    .filter_map(|id| self.store.info(id).ok())
                    .map(|i| capsule_json(&i))
                    .collect();
                Ok(Out::Json(json!({"capsules": v})))
            }
            Cmd::CapsuleInfo(id) => {
                self.check_capsule(&id, t)?;
                let mut v = capsule_json(&self.store.info(&id)?);
                v["tokens"] = json!(&self.store.tokens(&id)?[..]);
                Ok(Out::Json(v))
            }
            Cmd::DeleteCapsule(id) => {
                self.check_capsule(&id, t)?;
                self.store.remove(&id)?;
                Ok(Out::Json(json!({"deleted": id})))
            }
            Cmd::PersistCapsule(id) => {
                self.check_capsule(&id, t)?;
                self.store.persist(&id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::ExportFile {
                capsule,
                path,
                name,
                overwrite,
            } => {
                self.check_capsule(&capsule, t)?;
                crate::files::check_export_target(&path, &name, overwrite)?;
                let bytes = match self.store.export(&capsule, &path) {
                    Ok(b) => b,
                    Err(e) if !self.store.contains(&capsule) => {
                        return Err(super::lost(&capsule, e));
                    }
                    Err(e) => return Err(crate::files::relative(e, &path, &name)),
                };
                Ok(Out::Json(json!({
                    "capsule": capsule,
                    "file": name,
                    "bytes": bytes,
                })))
            }
            Cmd::ExportBytes(capsule) => {
                self.check_capsule(&capsule, t)?;
                let cap = match self.store.get(&capsule) {
                    Ok(c) => c,
                    Err(e) if !self.store.contains(&capsule) => {
                        return Err(super::lost(&capsule, e));
                    }
                    Err(e) => return Err(e.into()),
                };
                Ok(Out::Bytes(flashrt_runtime::capsule_file::capsule_to_vec(
                    &cap,
                )?))
            }
            Cmd::ImportFile { path, name } => {
                let file = crate::files::open_regular(&path, &name)?;
                let cap =
                    flashrt_runtime::capsule_file::read_capsule_from(file, &name, &self.model)
                        .map_err(|e| crate::files::relative(e, &path, &name))?;
                let id = self.store.import_capsule_as(cap, &t.name)?;
                self.within_budget(t, &id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            Cmd::ImportBytes(bytes) => {
                let id = self.store.import_bytes_as(&bytes, &t.name)?;
                self.within_budget(t, &id)?;
                Ok(Out::Json(capsule_json(&self.store.info(&id)?)))
            }
            // Taken by the scheduler before `handle` (see `run_job`).
            Cmd::Complete { .. } => Err(ApiError::new(
                500,
                "internal",
                "a completion reached the wrong handler",
            )),
            Cmd::Shutdown => {
                let n = self.store.flush()?;
                Ok(Out::Json(json!({"flushed": n})))
            }
        }
    }

    pub(super) fn create(&mut self, req: CreateReq, t: &Tenant) -> WResult<Out> {
        if let Some(sm) = &req.sampler {
            sm.validate()?;
        }
        if req.capsule.is_some() && !req.tokens.is_empty() {
            return Err(ApiError::bad(
                "invalid_request",
                "give `capsule` or `tokens`, not both (append after creating)",
            ));
        }
        self.validate_tokens(&req.tokens, 0)?;
        if let Some(c) = &req.capsule {
            self.check_capsule(c, t)?;
        }
        let mut s = self.new_session(t)?;
        let mut reused = 0;
        let mut from = None;
        if let Some(c) = &req.capsule {
            self.restore_stored(c, &mut s)?;
            from = Some(c.clone());
        } else if !req.tokens.is_empty() {
            if req.reuse {
                reused = self.reuse_prefix(&mut s, &req.tokens, t)?;
            }
            self.prefill(&mut s, &req.tokens[reused..])?;
        }
        if let Some(sm) = req.sampler {
            s.set_sampler(sm);
        }
        let id = self.new_id();
        let pos = s.pos();
        self.put_back(id.clone(), s, t);
        Ok(Out::Json(json!({
            "session": id,
            "pos": pos,
            "reused_tokens": reused,
            "from_capsule": from,
        })))
    }
}
