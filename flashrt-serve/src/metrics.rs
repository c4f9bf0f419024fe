//! Server metrics: lock-free counters and gauges shared by the worker (which updates them) and
//! the HTTP handlers (which read them for `/metrics` and `/health` without waiting on the
//! model), rendered in the Prometheus text exposition format.

use flashrt_runtime::store::{StoreStats, Tier};
use std::fmt::Write;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of the restore latency histogram buckets.
pub const RESTORE_BUCKETS: [f64; 14] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3,
    1.0,
];

/// Upper bounds (seconds) of the per-token histograms (time to first token, inter-token
/// latency, queue wait): fine around one decode step (a few to a few tens of ms), coarse out
/// to a long prefill.
pub const TOKEN_BUCKETS: [f64; 20] = [
    250e-6, 500e-6, 1e-3, 2e-3, 5e-3, 7.5e-3, 10e-3, 12.5e-3, 15e-3, 20e-3, 25e-3, 30e-3, 40e-3,
    50e-3, 75e-3, 100e-3, 250e-3, 1.0, 2.5, 10.0,
];

/// The bucket bounds of one kind of histogram.
pub trait Buckets {
    const BOUNDS: &'static [f64];
}

/// [`RESTORE_BUCKETS`].
pub struct RestoreBuckets;
impl Buckets for RestoreBuckets {
    const BOUNDS: &'static [f64] = &RESTORE_BUCKETS;
}

/// [`TOKEN_BUCKETS`].
pub struct TokenBuckets;
impl Buckets for TokenBuckets {
    const BOUNDS: &'static [f64] = &TOKEN_BUCKETS;
}

const MAX_BUCKETS: usize = 20;

/// A fixed-bucket histogram (cumulative buckets, as Prometheus exposes them).
pub struct Histogram<B: Buckets = RestoreBuckets> {
    buckets: [AtomicU64; MAX_BUCKETS],
    count: AtomicU64,
    sum_ns: AtomicU64,
    kind: PhantomData<B>,
}

impl<B: Buckets> Default for Histogram<B> {
    fn default() -> Self {
        const { assert!(B::BOUNDS.len() <= MAX_BUCKETS) };
        Histogram {
            buckets: Default::default(),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
            kind: PhantomData,
        }
    }
}

impl<B: Buckets> Histogram<B> {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        for (b, &le) in self.buckets.iter().zip(B::BOUNDS) {
            if s <= le {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
    /// Observations and their sum in seconds.
    pub fn count_sum(&self) -> (u64, f64) {
        (
            self.count(),
            self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        )
    }

    /// The `_bucket`, `_sum` and `_count` lines, with `labels` (`key="value",...`) on each.
    fn render(&self, o: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, le) in self.buckets.iter().zip(B::BOUNDS) {
            let _ = writeln!(o, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {}", get(b));
        }
        let _ = writeln!(
            o,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count()
        );
        let braces = |l: &str| {
            if l.is_empty() {
                String::new()
            } else {
                format!("{{{l}}}")
            }
        };
        let _ = writeln!(
            o,
            "{name}_sum{} {}",
            braces(labels),
            get(&self.sum_ns) as f64 * 1e-9
        );
        let _ = writeln!(o, "{name}_count{} {}", braces(labels), self.count());
    }
}

/// Everything `/metrics` reports.
#[derive(Default)]
pub struct Metrics {
    pub http_requests: AtomicU64,
    pub http_4xx: AtomicU64,
    pub http_5xx: AtomicU64,
    /// Connections closed on arrival because the connection cap was reached.
    pub refused_connections: AtomicU64,
    pub prefill_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub sessions: AtomicU64,
    pub session_bytes: AtomicU64,
    /// Completions generating now (interleaved token by token), and waiting for a slot.
    pub generating: AtomicU64,
    pub waiting: AtomicU64,
    /// Batched decode steps (several generations fed in one step) and the rows they fed:
    /// rows / steps is the batch occupancy.
    pub batched_steps: AtomicU64,
    pub batched_rows: AtomicU64,
    pub capsules: [AtomicU64; 3],
    pub tier_bytes: [AtomicU64; 3],
    pub tier_budget: [AtomicU64; 3],
    pub evictions: [AtomicU64; 3],
    pub hits: AtomicU64,
    pub hit_tokens: AtomicU64,
    pub misses: AtomicU64,
    pub dropped: AtomicU64,
    pub shared_bytes: AtomicU64,
    pub corrupt_files: AtomicU64,
    /// Host buffers kept for capsules copied down, and bytes read into reused ones.
    pub pooled_bytes: AtomicU64,
    pub pool_reused_bytes: AtomicU64,
    /// Bytes of capsules on their way down in the background (device -> host, host -> disk),
    /// and the moves finished so.
    pub demoting_bytes: AtomicU64,
    pub spilling_bytes: AtomicU64,
    pub background_demotions: AtomicU64,
    pub background_spills: AtomicU64,
    /// Their time on their threads, in microseconds.
    pub background_seconds_micros: AtomicU64,
    /// Peak of the sum of the three tiers' bytes.
    pub peak_tier_bytes: [AtomicU64; 3],
    pub restore: [Histogram; 3],
    /// From a generation request entering the worker's queue to its first token being
    /// handed to the client (streamed, or chosen when not streaming).
    pub ttft: Histogram<TokenBuckets>,
    /// Between consecutive tokens of one generation, as handed to the client.
    pub inter_token: Histogram<TokenBuckets>,
    /// From any request entering the worker's queue to the worker taking it up.
    pub queue_wait: Histogram<TokenBuckets>,
    /// The worker storing an automatic capsule (snapshot, insertion, and the demotions down
    /// the tiers it causes): time in which no other generation advances.
    pub auto_store: Histogram<TokenBuckets>,
    /// Automatic capsules not stored because the store would have waited for a copy to the
    /// host (`CapsuleStore::insert_would_wait`).
    pub auto_store_skipped: AtomicU64,
    pub worker_alive: AtomicBool,
    /// The worker is warming its pooled sessions (capturing their graphs) before the first
    /// job: `/health` says so with a 503 until it is done.
    pub warming: AtomicBool,
    /// Speculative decoding (MTP): rounds, drafts verified and accepted, drafts per round now.
    pub spec_rounds: AtomicU64,
    pub spec_drafted: AtomicU64,
    pub spec_accepted: AtomicU64,
    pub spec_k: AtomicU64,
    /// Prompts tokenized from a remembered prompt of the same tenant, and the bytes not
    /// tokenized again (`text::PrefixTokens`, copied in before each render).
    pub prompt_reused: AtomicU64,
    pub prompt_reused_bytes: AtomicU64,
}

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

impl Metrics {
    /// Copy the store's counters and gauges.
    pub fn publish_store(&self, s: &StoreStats) {
        for i in 0..3 {
            self.capsules[i].store(s.capsules[i] as u64, Ordering::Relaxed);
            self.tier_bytes[i].store(s.bytes[i], Ordering::Relaxed);
            self.tier_budget[i].store(s.budgets[i], Ordering::Relaxed);
            self.evictions[i].store(s.evictions[i], Ordering::Relaxed);
            self.peak_tier_bytes[i].fetch_max(s.bytes[i], Ordering::Relaxed);
        }
        self.hits.store(s.hits, Ordering::Relaxed);
        self.hit_tokens.store(s.hit_tokens, Ordering::Relaxed);
        self.misses.store(s.misses, Ordering::Relaxed);
        self.dropped.store(s.dropped, Ordering::Relaxed);
        self.shared_bytes.store(s.shared_bytes, Ordering::Relaxed);
        self.corrupt_files.store(s.corrupt_files, Ordering::Relaxed);
        self.pooled_bytes.store(s.pooled_bytes, Ordering::Relaxed);
        self.pool_reused_bytes
            .store(s.pool_reused_bytes, Ordering::Relaxed);
        self.demoting_bytes
            .store(s.demoting_bytes, Ordering::Relaxed);
        self.background_demotions
            .store(s.background_demotions, Ordering::Relaxed);
        self.spilling_bytes
            .store(s.spilling_bytes, Ordering::Relaxed);
        self.background_spills
            .store(s.background_spills, Ordering::Relaxed);
        self.background_seconds_micros
            .store((s.background_seconds * 1e6) as u64, Ordering::Relaxed);
    }

    /// The Prometheus text format.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let mut one = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        one(
            "flashrt_http_requests_total",
            "counter",
            "HTTP requests received.",
            get(&self.http_requests),
        );
        one(
            "flashrt_http_client_errors_total",
            "counter",
            "Responses with a 4xx status.",
            get(&self.http_4xx),
        );
        one(
            "flashrt_http_server_errors_total",
            "counter",
            "Responses with a 5xx status.",
            get(&self.http_5xx),
        );
        one(
            "flashrt_http_refused_connections_total",
            "counter",
            "Connections closed on arrival: the connection cap was reached.",
            get(&self.refused_connections),
        );
        one(
            "flashrt_prefill_tokens_total",
            "counter",
            "Prompt tokens run through the model.",
            get(&self.prefill_tokens),
        );
        one(
            "flashrt_generated_tokens_total",
            "counter",
            "Tokens sampled and fed.",
            get(&self.generated_tokens),
        );
        one(
            "flashrt_speculative_rounds_total",
            "counter",
            "Speculative rounds (one verify pass each).",
            get(&self.spec_rounds),
        );
        one(
            "flashrt_speculative_drafted_total",
            "counter",
            "MTP drafts verified.",
            get(&self.spec_drafted),
        );
        one(
            "flashrt_speculative_accepted_total",
            "counter",
            "MTP drafts accepted (equal to the target's greedy choice).",
            get(&self.spec_accepted),
        );
        one(
            "flashrt_speculative_drafts_per_round",
            "gauge",
            "Drafts per round the server uses now (0: plain decoding; measured, see speculate.rs).",
            get(&self.spec_k),
        );
        one(
            "flashrt_sessions",
            "gauge",
            "Open sessions.",
            get(&self.sessions),
        );
        one(
            "flashrt_generating",
            "gauge",
            "Completions generating now, a token each in turn.",
            get(&self.generating),
        );
        one(
            "flashrt_batched_steps_total",
            "counter",
            "Batched decode steps: one step feeding several generations at once.",
            get(&self.batched_steps),
        );
        one(
            "flashrt_batched_rows_total",
            "counter",
            "Tokens fed by batched decode steps (divided by the steps: the batch occupancy).",
            get(&self.batched_rows),
        );
        one(
            "flashrt_generation_waiting",
            "gauge",
            "Completions waiting for a place among the generating ones (not started yet).",
            get(&self.waiting),
        );
        one(
            "flashrt_session_bytes",
            "gauge",
            "Bytes of the arenas of open sessions.",
            get(&self.session_bytes),
        );
        one(
            "flashrt_store_hits_total",
            "counter",
            "Prefix lookups that reused a stored capsule.",
            get(&self.hits),
        );
        one(
            "flashrt_store_hit_tokens_total",
            "counter",
            "Prompt tokens not prefilled thanks to reuse.",
            get(&self.hit_tokens),
        );
        one(
            "flashrt_store_misses_total",
            "counter",
            "Prefix lookups that found no capsule.",
            get(&self.misses),
        );
        one(
            "flashrt_prompt_tokenizations_reused_total",
            "counter",
            "Prompts tokenized from a remembered prompt of the same tenant (only the text after their last shared added token encoded).",
            get(&self.prompt_reused),
        );
        one(
            "flashrt_prompt_bytes_reused_total",
            "counter",
            "Prompt bytes whose ids came from a remembered prompt instead of the tokenizer.",
            get(&self.prompt_reused_bytes),
        );
        one(
            "flashrt_store_dropped_total",
            "counter",
            "Capsules dropped by eviction.",
            get(&self.dropped),
        );
        one(
            "flashrt_store_shared_bytes_total",
            "counter",
            "Bytes not copied to host or disk thanks to KV sharing.",
            get(&self.shared_bytes),
        );
        one(
            "flashrt_store_corrupt_files_total",
            "counter",
            "Capsule files found corrupt and set aside.",
            get(&self.corrupt_files),
        );
        one(
            "flashrt_auto_capsules_skipped_total",
            "counter",
            "Automatic capsules not stored because the store would have waited for the previous capsule's copy to the host (every stream would have waited too).",
            get(&self.auto_store_skipped),
        );
        one(
            "flashrt_store_pooled_bytes",
            "gauge",
            "Host buffers of capsule copies that left memory, kept (pages in place) for the next capsules copied from the device.",
            get(&self.pooled_bytes),
        );
        one(
            "flashrt_store_pool_reused_bytes_total",
            "counter",
            "Bytes of capsules copied from the device into reused host buffers.",
            get(&self.pool_reused_bytes),
        );
        one(
            "flashrt_store_demoting_bytes",
            "gauge",
            "Device bytes of capsules being copied to the host in the background (not counted in the device tier's bytes).",
            get(&self.demoting_bytes),
        );
        one(
            "flashrt_store_background_demotions_total",
            "counter",
            "Capsules demoted from the device tier off the worker thread.",
            get(&self.background_demotions),
        );
        one(
            "flashrt_store_spilling_bytes",
            "gauge",
            "Host bytes of capsules whose files are being written in the background (not counted in the host tier's bytes).",
            get(&self.spilling_bytes),
        );
        one(
            "flashrt_store_background_spills_total",
            "counter",
            "Capsule files written for the disk tier off the worker thread.",
            get(&self.background_spills),
        );
        let mut tiered = |name: &str, kind: &str, help: &str, v: &[AtomicU64; 3]| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for t in Tier::ALL {
                let _ = writeln!(o, "{name}{{tier=\"{}\"}} {}", t.name(), get(&v[t as usize]));
            }
        };
        tiered(
            "flashrt_store_bytes",
            "gauge",
            "Bytes of capsules held per tier.",
            &self.tier_bytes,
        );
        tiered(
            "flashrt_store_peak_bytes",
            "gauge",
            "Highest bytes held per tier since start.",
            &self.peak_tier_bytes,
        );
        tiered(
            "flashrt_store_budget_bytes",
            "gauge",
            "Byte budget per tier.",
            &self.tier_budget,
        );
        tiered(
            "flashrt_store_capsules",
            "gauge",
            "Capsules held per tier.",
            &self.capsules,
        );
        tiered(
            "flashrt_store_evictions_total",
            "counter",
            "Capsules evicted out of each tier.",
            &self.evictions,
        );
        let name = "flashrt_restore_seconds";
        let _ = writeln!(
            o,
            "# HELP {name} Latency of restoring a session from a stored capsule, by source tier.\n# TYPE {name} histogram"
        );
        for t in Tier::ALL {
            self.restore[t as usize].render(&mut o, name, &format!("tier=\"{}\"", t.name()));
        }
        for (name, help, h) in [
            (
                "flashrt_time_to_first_token_seconds",
                "From a generation request entering the worker queue to its first token handed to the client.",
                &self.ttft,
            ),
            (
                "flashrt_inter_token_seconds",
                "Between consecutive tokens of one generation, as handed to the client.",
                &self.inter_token,
            ),
            (
                "flashrt_queue_wait_seconds",
                "From a request entering the worker queue to the worker taking it up.",
                &self.queue_wait,
            ),
            (
                "flashrt_auto_store_seconds",
                "The worker storing an automatic capsule, demotions down the tiers included (nothing else advances meanwhile).",
                &self.auto_store,
            ),
        ] {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
            h.render(&mut o, name, "");
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rendered buckets are cumulative counts of the observations at or below each bound,
    /// checked against a direct count of the same observations.
    #[test]
    fn token_histogram_renders_cumulative_buckets() {
        let m = Metrics::default();
        let obs_ms = [
            0.1, 3.0, 7.5, 7.6, 14.9, 15.0, 16.0, 90.0, 3_000.0, 20_000.0,
        ];
        for &ms in &obs_ms {
            m.inter_token.observe(Duration::from_secs_f64(ms * 1e-3));
        }
        let text = m.render();
        for le in TOKEN_BUCKETS {
            let want = obs_ms.iter().filter(|&&ms| ms * 1e-3 <= le).count();
            let line = format!("flashrt_inter_token_seconds_bucket{{le=\"{le}\"}} {want}\n");
            assert!(text.contains(&line), "missing {line:?} in\n{text}");
        }
        assert!(text.contains("flashrt_inter_token_seconds_bucket{le=\"+Inf\"} 10\n"));
        assert!(text.contains("flashrt_inter_token_seconds_count 10\n"));
        let sum: f64 = obs_ms.iter().sum::<f64>() * 1e-3;
        let got: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("flashrt_inter_token_seconds_sum "))
            .unwrap()
            .parse()
            .unwrap();
        assert!((got - sum).abs() < 1e-6, "sum {got} vs {sum}");
        // Untouched histograms render empty, labelled ones keep their labels.
        assert!(text.contains("flashrt_time_to_first_token_seconds_count 0\n"));
        assert!(text.contains("flashrt_restore_seconds_count{tier=\"host\"} 0\n"));
        assert!(text.contains("flashrt_restore_seconds_bucket{tier=\"disk\",le=\"0.001\"} 0\n"));
    }
}
