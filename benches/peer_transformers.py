#!/usr/bin/env python3
"""Peer baseline for `flashrt bench`: Hugging Face transformers on the same model shape.

Measures, per prompt length, on one GPU in bf16 with random weights (batch 1):
  * cold TTFT: one forward over the prompt with a fresh cache, then argmax of the last row;
  * decode step: median of single-token forwards reusing the cache;
  * prompt-cache reuse the way transformers offers it: copy.deepcopy(cache) + one step
    ("restored TTFT"), and the deepcopy alone;
  * cache bytes.
Prints a table and writes JSON (--json), in the same units as `flashrt bench --json`.

Run it in the same command as flashrt's benchmark (issue 7), e.g. on the GPU machine:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl  # fla wheels
    PYTHONPATH=/tmp/site python3 benches/peer_transformers.py --config qwen36-27b \
        --lengths 2048,4096,8192,16384 --json $OUT/peer.json

The prefill asks for the last position's logits only (`logits_to_keep=1`), as flashrt's
prefill does, so neither side pays for a [tokens, vocab] logits tensor. The JSON is rewritten
after every length, so a run cut short keeps what it measured.
"""

import argparse
import copy
import json
import statistics
import time

import torch

# The Qwen3.6-27B shape of models/qwen36-27b.toml (DESIGN.md), as a transformers config.
QWEN36_27B = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)

# The Qwen3.6-35B-A3B shape of models/qwen36-35b-a3b.toml: 40 layers, a sparse MoE block in
# every layer (256 experts, top-8, width 512, gated shared expert of width 512). transformers
# runs its default MoE path for it.
QWEN36_35B_A3B = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False,
)

CONFIGS = {"qwen36-27b": QWEN36_27B, "qwen36-35b-a3b": QWEN36_35B_A3B}


def sync():
    torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t) * 1e3


def cache_bytes(cache):
    total = 0
    seen = set()
    for obj in [cache] + list(getattr(cache, "layers", [])):
        for v in vars(obj).values():
            vals = v if isinstance(v, (list, tuple)) else [v]
            for t in vals:
                if torch.is_tensor(t) and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen36-27b", choices=sorted(CONFIGS))
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--decode-steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**CONFIGS[args.config])
    torch.manual_seed(7)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.eval()
    vocab = cfg.vocab_size
    results = []
    for n in lengths:
        ids = torch.randint(3, vocab, (1, n), device="cuda")
        with torch.no_grad():
            # First call at a new length pays autotuning; report it, then measure a warm one.
            _, first_ms = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
            out, cold_ms = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            cache = out.past_key_values
            steps = []
            c = cache
            t = nxt
            for _ in range(args.decode_steps):
                o, ms = timed(lambda: model(t, past_key_values=c, use_cache=True))
                c, t = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                steps.append(ms)
            copied, copy_ms = timed(lambda: copy.deepcopy(cache))
            _, restored_ms = timed(
                lambda: model(nxt, past_key_values=copy.deepcopy(cache), use_cache=True)
            )
        r = dict(
            tokens=n,
            first_call_ms=first_ms,
            cold_ttft_ms=cold_ms,
            decode_step_ms=statistics.median(steps),
            deepcopy_ms=copy_ms,
            restored_ttft_ms=restored_ms,
            cache_bytes=cache_bytes(copied),
        )
        print(r, flush=True)
        results.append(r)
        del out, cache, copied, c
        torch.cuda.empty_cache()
        report = dict(
            peer="transformers",
            transformers=__import__("transformers").__version__,
            torch=torch.__version__,
            model=args.config,
            device=torch.cuda.get_device_name(),
            lengths=results,
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    print(f"{'tokens':>7} {'cold TTFT':>11} {'decode':>9} {'deepcopy':>9} {'restored':>10} {'cache':>10}")
    for r in results:
        print(
            f"{r['tokens']:>7} {r['cold_ttft_ms']:>8.1f} ms {r['decode_step_ms']:>6.1f} ms "
            f"{r['deepcopy_ms']:>6.1f} ms {r['restored_ttft_ms']:>7.1f} ms {r['cache_bytes'] / 1e6:>7.0f} MB"
        )


if __name__ == "__main__":
    main()
