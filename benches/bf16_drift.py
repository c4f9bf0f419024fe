#!/usr/bin/env python3
"""How far transformers' own bf16 forward is from the fixtures' float32 logits, on a GPU.

The bf16 bounds of flashrt's GPU tests (flashrt-runtime/tests/cuda_model.rs, `bf16_bound`) are
the drift of the reference implementation's own bf16 run on the same fixture. This measures
it: each fixture folder's checkpoint loaded by transformers in float32 (a check of the harness:
it should reproduce `prompt_logits` to ~1e-5) and in bf16 on the GPU, one forward over
`prompt_ids`, error `max|logits - prompt_logits| / max|prompt_logits|` as the tests compute it.
With flash-linear-attention importable (PYTHONPATH with the wheels of
benches/fetch-peer-wheels.sh) transformers runs the Gated DeltaNet layers with its chunked
Triton kernels, the path GPU users of transformers and vLLM take; without it, its PyTorch
fallback.

    python3 benches/bf16_drift.py tests/fixtures --json drift.json
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

FIXTURES = ["qwen35-public", "lfm2-public", "nemotronh-public", "qwen35real-public"]


def load(path, dtype):
    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return m.to("cuda").eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("fixtures")
    ap.add_argument("--json")
    ap.add_argument("--names", default=",".join(FIXTURES))
    a = ap.parse_args()
    fla = importlib.util.find_spec("fla") is not None
    out = {"fla": fla, "torch": torch.__version__, "device": torch.cuda.get_device_name(0), "fixtures": {}}
    for name in a.names.split(","):
        d = os.path.join(a.fixtures, name)
        ref = load_file(os.path.join(d, "reference.safetensors"))
        ids = ref["prompt_ids"].long().reshape(1, -1).to("cuda")
        want = ref["prompt_logits"].float().to("cuda")
        scale = want.abs().max().item()
        row = {}
        for label, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
            try:
                m = load(d, dtype)
                with torch.no_grad():
                    got = m(ids).logits[0].float()
                err = (got - want).abs().max().item() / scale
                per_row = ((got - want).abs().amax(dim=1) / scale).tolist()
                row[label] = {"rel_err": err, "worst_rows": sorted(per_row)[-3:]}
                del m
                torch.cuda.empty_cache()
            except Exception as e:  # a fixture this transformers cannot load
                row[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(f"{name} {label} (fla {fla}): {row[label]}", flush=True)
        out["fixtures"][name] = row
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
