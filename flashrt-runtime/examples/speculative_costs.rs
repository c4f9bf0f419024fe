//! What speculative decoding's pieces cost, and which rollback method is cheaper.
//!
//! ```text
//! cargo run --release -p flashrt-runtime --example speculative_costs            # CPU, demo-mtp
//! FLASHRT_BACKEND=cuda speculative_costs --model 27b                            # H200, 27B shape
//! ```
//!
//! Models (random weights, one MTP layer): `demo` — the `models/demo-mtp.toml` shape (Qwen3.5
//! family, hidden 256, 8 layers); `27b` — the Qwen3.6-27B shape of `models/qwen36-27b.toml`
//! (64 layers, hidden 5120, vocab 248320; `max_seq` 4096 here). The CPU runs one thread.
//!
//! Prints medians of: a decode step, the verify passes (`k + 1` rows), an MTP draft step,
//! saving / restoring the non-KV regions next to the backend's copy floor for the same bytes,
//! a full snapshot for comparison; then one round's target work when `a` of `k` drafts are
//! accepted, for restore + replay of the `a + 1` committed rows (what `crate::speculative`
//! does) and for per-row checkpoints (emulated: `k + 1` single-row steps with a non-KV save
//! after each, rollback = one restore), and measured where the backend keeps per-row states
//! (`keep_row_states`: the verify pass keeping them, then `rollback_to_row`); then end-to-end
//! tokens per second of plain greedy
//! decoding and of speculative decoding with the MTP head, an oracle and an adversary drafter.

use flashrt_runtime::ir::hf::{HfOptions, ir_from_hf_config};
use flashrt_runtime::ir::{DType, Phase, compile};
use flashrt_runtime::{
    AdversaryDrafter, Backend, CpuBackend, DeviceSession, Model, MtpDrafter, OracleDrafter,
    RegionSet,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DEMO_MTP: &str = r#"{
  "model_type": "qwen3_5_text",
  "hidden_size": 256, "intermediate_size": 768, "vocab_size": 2048,
  "num_hidden_layers": 8, "full_attention_interval": 4,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4,
  "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "mtp_num_hidden_layers": 1
}"#;

const QWEN36_27B: &str = r#"{
  "model_type": "qwen3_5_text",
  "hidden_size": 5120, "intermediate_size": 17408, "vocab_size": 248320,
  "num_hidden_layers": 64, "full_attention_interval": 4,
  "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
  "linear_num_key_heads": 16, "linear_num_value_heads": 48,
  "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
  "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
  "tie_word_embeddings": false, "mtp_num_hidden_layers": 1
}"#;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Median of `reps` runs of `f` (after 3 warm-up runs), the device synchronised before each
/// clock stops.
fn time(
    dev: &mut dyn DeviceSession,
    reps: usize,
    mut f: impl FnMut(&mut dyn DeviceSession),
) -> Duration {
    for _ in 0..3 {
        f(dev);
    }
    dev.synchronize().unwrap();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f(dev);
                dev.synchronize().unwrap();
                t.elapsed()
            })
            .collect(),
    )
}

fn us(d: Duration) -> String {
    format!("{:10.1} us", d.as_secs_f64() * 1e6)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let shape = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1))
        .map_or("demo", |s| s.as_str());
    let (json, name, max_seq, buckets, n_end) = match shape {
        "demo" => (DEMO_MTP, "demo_mtp", 2048, vec![16, 128], 256),
        "27b" => (QWEN36_27B, "qwen36_27b", 4096, vec![64, 512], 128),
        other => panic!("unknown model `{other}` (demo | 27b)"),
    };
    let opts = HfOptions {
        name: Some(name.into()),
        max_seq: Some(max_seq),
        prefill_buckets: Some(buckets.clone()),
        dtype: Some(DType::Bf16),
        ..HfOptions::default()
    };
    let ir = ir_from_hf_config(json, &opts).expect("config");
    let backend: Arc<dyn Backend> = if std::env::var("FLASHRT_BACKEND").as_deref() == Ok("cuda") {
        flashrt_runtime::backend::best().expect("CUDA backend")
    } else {
        Arc::new(CpuBackend::with_threads(1))
    };
    let compiled = Arc::new(compile(&ir, backend.target(&ir)));
    let layout = &compiled.layout;
    let non_kv: usize = layout
        .state_buffers()
        .filter(|b| RegionSet::NonKv.contains(b.state))
        .map(|b| b.bytes)
        .sum();
    println!("device: {}", backend.name());
    println!(
        "model: {name}, {} layers + 1 MTP layer, {}, non-KV state {:.1} MiB, KV {} B/token",
        ir.layers.len(),
        layout.target.dtype.name(),
        non_kv as f64 / (1 << 20) as f64,
        layout.capsule_bytes_per_token()
    );

    let reps = 21;
    let p = 512;
    let largest = *buckets.iter().max().unwrap();
    let prompt: Vec<u32> = (0..p as u32).map(|i| (i * 7 + 3) % 2000).collect();
    {
        // A raw device session at position P = 512.
        let dev_model = backend.load_random(compiled.clone(), 5).expect("load");
        let mut dev = dev_model.new_session().expect("session");
        let dev: &mut dyn DeviceSession = &mut *dev;
        for (i, c) in prompt.chunks(largest).enumerate() {
            dev.step(Phase::Prefill { bucket: largest }, c, i * largest)
                .unwrap();
        }
        let rows: Vec<u32> = vec![5, 6, 7, 8, 9];

        println!("\n-- pieces at position {p} (median of {reps}) --");
        let decode = time(dev, reps, |d| d.step(Phase::Decode, &rows[..1], p).unwrap());
        println!("decode step (1 row)            {}", us(decode));
        let mtp = time(dev, reps, |d| {
            d.step(Phase::MtpDraft, &rows[..1], p - 1).unwrap()
        });
        println!("MTP draft step                 {}", us(mtp));
        let mut verify = vec![decode];
        for k in 1..=4 {
            let v = time(dev, reps, |d| {
                d.step(Phase::Verify { k }, &rows[..=k], p).unwrap()
            });
            println!(
                "verify k = {k} ({} rows)          {}   {:.2} x decode",
                k + 1,
                us(v),
                v.as_secs_f64() / decode.as_secs_f64()
            );
            verify.push(v);
        }
        let save = time(dev, reps, |d| {
            std::hint::black_box(d.save(p, RegionSet::NonKv).unwrap());
        });
        let saved = dev.save(p, RegionSet::NonKv).unwrap();
        let restore = time(dev, reps, |d| {
            d.restore(&*saved, RegionSet::NonKv, 0).unwrap()
        });
        let floor = Duration::from_secs_f64(backend.copy_seconds(non_kv, reps).unwrap());
        let full = time(dev, reps, |d| {
            std::hint::black_box(d.save(p, RegionSet::All).unwrap());
        });
        println!("save non-KV                    {}", us(save));
        println!("restore non-KV                 {}", us(restore));
        println!("copy floor, same bytes         {}", us(floor));
        println!(
            "full snapshot at {p} ({:.1} MiB) {}",
            layout.capsule_bytes(p) as f64 / (1 << 20) as f64,
            us(full)
        );

        println!("\n-- one round's target work when a of k drafts are accepted --");
        println!(
            "save+replay: save non-KV, verify (k+1 rows), if a < k: restore + replay (a+1 rows)"
        );
        println!(
            "row ckpt:    k+1 single-row steps with a non-KV save after each, if a < k: restore"
        );
        println!(
            "in-pass:     estimate: verify + (k+1) non-KV copies at the floor, if a < k: one more"
        );
        println!("kept:        measured where the backend keeps per-row states (keep_row_states):");
        println!("             verify (k+1 rows) keeping them, if a < k: rollback_to_row(a)");
        let kept_ok = dev.keep_row_states();
        if kept_ok {
            // Disarm: the next step below must not keep them.
            dev.step(Phase::Decode, &rows[..1], p).unwrap();
        }
        println!(
            " k  a |  save+replay (x decode) |  row ckpt (x decode)    |  in-pass (x decode)     |  kept (x decode)"
        );
        for (k, &verify_k) in verify.iter().enumerate().skip(1) {
            let ckpt = time(dev, reps, |d| {
                for r in 0..=k {
                    d.step(Phase::Decode, &rows[r..=r], p + r).unwrap();
                    std::hint::black_box(d.save(p + r + 1, RegionSet::NonKv).unwrap());
                }
            });
            for a in 0..=k {
                let replay = if a == k {
                    Duration::ZERO
                } else {
                    let phase = if a == 0 {
                        Phase::Decode
                    } else {
                        Phase::Verify { k: a }
                    };
                    time(dev, reps, |d| {
                        d.restore(&*saved, RegionSet::NonKv, 0).unwrap();
                        d.step(phase, &rows[..=a], p).unwrap();
                    })
                };
                let rejected = u32::from(a < k);
                let kept = if kept_ok {
                    time(dev, reps, |d| {
                        d.keep_row_states();
                        d.step(Phase::Verify { k }, &rows[..=k], p).unwrap();
                        if a < k {
                            d.rollback_to_row(a).unwrap();
                        }
                    })
                } else {
                    Duration::ZERO
                };
                let mut costs = vec![
                    save + verify_k + replay,
                    ckpt + restore * rejected,
                    verify_k + floor * (k as u32 + 1 + rejected),
                ];
                if kept_ok {
                    costs.push(kept);
                }
                let x = |d: Duration| d.as_secs_f64() / decode.as_secs_f64();
                let cells: Vec<String> = costs
                    .iter()
                    .map(|&c| format!("{} {:5.2} x", us(c), x(c)))
                    .collect();
                println!("{k:2} {a:2} | {}", cells.join(" | "));
            }
        }
    }

    println!("\n-- end to end: {n_end} tokens after a 64-token prompt --");
    let model = Model::with_random_weights(backend.clone(), &ir, 5).expect("model");
    let prompt = &prompt[..64];
    let mut s = model.session().unwrap();
    s.append(prompt).unwrap();
    let t = Instant::now();
    let out = s.decode_greedy(n_end).unwrap();
    let plain = t.elapsed();
    println!(
        "plain greedy                 {:8.1} tok/s",
        n_end as f64 / plain.as_secs_f64()
    );
    let mut reference = prompt.to_vec();
    reference.extend_from_slice(&out);
    let same_as = |o: &[u32], r: &[u32]| match o.iter().zip(r).position(|(a, b)| a != b) {
        None => "== plain".to_string(),
        Some(i) => format!("differs from plain at token {i}"),
    };
    let same = |o: &[u32]| same_as(o, &out);
    // The MTP head's sessions take the prompt token by token (`append_with_mtp`: decode steps
    // that also fill the drafter's state), the others as one chunk. On the CPU both leave the
    // same bits; on a GPU a prefill chunk and decode steps round differently (other kernels),
    // so their plain reference is greedy decoding after the same token-by-token prompt.
    let out_mtp = {
        let mut s = model.session().unwrap();
        s.append_with_mtp(prompt).unwrap();
        s.decode_greedy(n_end).unwrap()
    };
    for k in 1..=4 {
        let mut s = model.session().unwrap();
        s.append_with_mtp(prompt).unwrap();
        let t = Instant::now();
        let (o, st) = s.decode_speculative(n_end, k, &mut MtpDrafter).unwrap();
        let e = t.elapsed();
        println!(
            "MTP head  k = {k}  {:8.1} tok/s  acceptance {:5.1}%  {:.2} tok/round  {}",
            n_end as f64 / e.as_secs_f64(),
            100.0 * st.acceptance_rate(),
            st.tokens_per_round(),
            same_as(&o, &out_mtp)
        );
        // The adversary's rejected drafts rolled back through kept per-row states (where the
        // backend keeps them) and by restore + replay.
        for (what, adversary, kept) in [
            ("oracle   ", false, true),
            ("adversary", true, true),
            ("adv.replay", true, false),
        ] {
            let mut s = model.session().unwrap();
            s.set_row_states(kept);
            s.append(prompt).unwrap();
            let t = Instant::now();
            let (o, st) = if adversary {
                s.decode_speculative(n_end, k, &mut AdversaryDrafter::new(reference.clone()))
            } else {
                s.decode_speculative(n_end, k, &mut OracleDrafter::new(reference.clone()))
            }
            .unwrap();
            let e = t.elapsed();
            println!(
                "{what} k = {k}  {:8.1} tok/s  acceptance {:5.1}%  {:.2} tok/round  {}",
                n_end as f64 / e.as_secs_f64(),
                100.0 * st.acceptance_rate(),
                st.tokens_per_round(),
                same(&o)
            );
        }
    }
}
