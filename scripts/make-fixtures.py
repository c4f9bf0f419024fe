#!/usr/bin/env python3
"""Regenerate a reference fixture of the form tests/fixtures/<name> with transformers.

    python3 scripts/make-fixtures.py --like qwen35-public --out /tmp/qwen35-regen
    flashrt check-reference /tmp/qwen35-regen

Needs torch and transformers (the GPU machine has both; it runs on the CPU). The model's
shape is the committed fixture's config.json (`--like`); the weights are random: for seeds
from --seed upwards, the library's own initialiser, then the committed fixtures' recipe to
make greedy decisions clear (constant-initialised 1-D parameters get N(0, 0.1) noise, the
output embedding is scaled by 2.5), until every greedy decision (main and both forks) wins
by at least 0.05 with at least 4 distinct tokens in the main continuation.

Writes the checkpoint (save_pretrained, float32), reference.safetensors (prompt, prompt
logits, greedy ids / logits / margins, the fork scenario with cold forwards), state.safetensors
+ state_layout.json (every cache tensor after the prompt: layers.N.{conv_state,
recurrent_state, key, value}) and fixture.json (seed, versions, margins). float32, eager
attention, one thread, CPU: deterministic on one machine; elsewhere BLAS may move the last
bits, never the ids. The committed fixtures stay the ground truth: this script is for a new
family, a new shape or a new transformers release.
"""
import argparse
import json
import os
import pathlib
import platform

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT, GREEDY, S1, S2, FORK_GREEDY = 37, 24, 9, 14, 12
MARGIN = 0.05


def margin(row):
    top = torch.topk(row, 2).values
    return float(top[0] - top[1])


def forward(model, ids, cache=None):
    out = model(input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True)
    return out.logits[0], out.past_key_values


def greedy(model, logits_last, cache, n):
    ids, rows = [], []
    row = logits_last
    for i in range(n):
        t = int(torch.argmax(row))
        ids.append(t)
        rows.append(row)
        if i + 1 < n:
            out, cache = forward(model, torch.tensor([t]), cache)
            row = out[-1]
    return ids, torch.stack(rows)


def build(config, seed):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and p.numel() > 1 and bool(torch.all(p == p.flatten()[0])):
                p.add_(torch.randn_like(p) * 0.1)
        model.get_output_embeddings().weight.mul_(2.5)
    return model


def state_tensors(cache):
    """layers.N.<kind> for every tensor the cache holds after the prompt."""
    names = {"conv_states": "conv_state", "recurrent_states": "recurrent_state",
             "ssm_states": "recurrent_state", "keys": "key", "values": "value"}
    out = {}
    for i, layer in enumerate(getattr(cache, "layers", [])):
        for attr, kind in names.items():
            v = getattr(layer, attr, None)
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if isinstance(v, dict):
                v = next(iter(v.values()), None)
            if torch.is_tensor(v) and v.numel() > 0:
                # A copy: decoding updates conv and recurrent states in place.
                out[f"layers.{i}.{kind}"] = v.detach().float().clone().contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--like", required=True, help="a folder name under tests/fixtures")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1001)
    ap.add_argument("--tries", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    src = ROOT / "tests" / "fixtures" / a.like
    # transformers writes non-finite floats as {"__float__": "Infinity"}.
    def floats(d):
        if "__float__" in d and len(d) == 1:
            return float(d["__float__"])
        return d

    cfg = json.loads((src / "config.json").read_text(), object_hook=floats)
    for k in ("transformers_version", "architectures", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    vocab = config.vocab_size
    for seed in range(a.seed, a.seed + a.tries):
        model = build(config, seed)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, vocab, (PROMPT,), generator=g)
        s1 = torch.randint(3, vocab, (S1,), generator=g)
        s2 = torch.randint(3, vocab, (S2,), generator=g)
        with torch.no_grad():
            logits, cache = forward(model, prompt)
            state = state_tensors(cache)
            g_ids, g_rows = greedy(model, logits[-1], cache, GREEDY)
            forks = {}
            for tag, suffix in (("s1", s1), ("s2", s2)):
                cold, c = forward(model, torch.cat([prompt, suffix]))
                ids, rows = greedy(model, cold[-1], c, FORK_GREEDY)
                forks[tag] = (suffix, cold[PROMPT:], ids, rows)
        margins = [margin(r) for r in g_rows]
        fork_margins = [margin(r) for f in forks.values() for r in f[3]]
        if min(margins + fork_margins) < MARGIN or len(set(g_ids)) < 4:
            continue
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        ref = {
            "prompt_ids": prompt, "prompt_logits": logits.contiguous(),
            "greedy_ids": torch.tensor(g_ids), "greedy_logits": g_rows.contiguous(),
            "greedy_margin": torch.tensor(margins),
        }
        for tag, (suffix, cold, ids, rows) in forks.items():
            ref[f"fork_{tag}_ids"] = suffix
            ref[f"fork_{tag}_logits"] = cold.contiguous()
            ref[f"fork_{tag}_greedy_ids"] = torch.tensor(ids)
            ref[f"fork_{tag}_greedy_logits"] = rows.contiguous()
            ref[f"fork_{tag}_greedy_margin"] = torch.tensor([margin(r) for r in rows])
        save_file(ref, str(out / "reference.safetensors"))
        save_file(state, str(out / "state.safetensors"))
        (out / "state_layout.json").write_text(json.dumps(
            {k: {"shape": list(v.shape), "dtype": "float32"} for k, v in state.items()}, indent=1))
        (out / "fixture.json").write_text(json.dumps({
            "like": a.like, "seed": seed, "model_type": config.model_type,
            "min_greedy_margin": min(margins), "min_fork_margin": min(fork_margins),
            "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                         "python": platform.python_version()},
        }, indent=1))
        print(f"wrote {out} (seed {seed}, smallest margin {min(margins + fork_margins):.4f})")
        return
    raise SystemExit(f"no seed in {a.seed}..{a.seed + a.tries} gives margins >= {MARGIN}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
