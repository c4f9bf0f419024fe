//! `GET /health` (no auth) and `GET /metrics` (Prometheus text).

use super::*;

pub(super) async fn health(State(st): St) -> Response {
    let alive = st.metrics.worker_alive.load(Ordering::SeqCst);
    let warming = st.metrics.warming.load(Ordering::SeqCst);
    let m = &st.metrics;
    json_response(
        if alive && !warming { 200 } else { 503 },
        &json!({
            "status": match (alive, warming) {
                (false, _) => "worker stopped",
                (true, true) => "warming",
                (true, false) => "ok",
            },
            "model": st.model_name,
            "fingerprint": st.fingerprint,
            "backend": st.backend,
            "vocab": st.vocab,
            "max_seq": st.max_seq,
            "tokenizer": st.text.is_some(),
            "chat_template": st.text.as_ref().is_some_and(|t| t.template.is_some()),
            "sessions": m.sessions.load(Ordering::Relaxed),
            "capsules": {
                "device": m.capsules[0].load(Ordering::Relaxed),
                "host": m.capsules[1].load(Ordering::Relaxed),
                "disk": m.capsules[2].load(Ordering::Relaxed),
            },
            "uptime_s": st.started.elapsed().as_secs_f64(),
        }),
    )
}

pub(super) async fn metrics(State(st): St) -> Response {
    if let Some(t) = &st.text {
        let (n, bytes) = t.prefixes.reused();
        st.metrics.prompt_reused.store(n, Ordering::Relaxed);
        st.metrics
            .prompt_reused_bytes
            .store(bytes, Ordering::Relaxed);
    }
    let mut r = Response::new(Body::from(st.metrics.render()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    r
}
