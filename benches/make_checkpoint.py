#!/usr/bin/env python3
"""Write a random-weight checkpoint of the Qwen3.6-27B shape in the released layout, with
transformers, on the GPU machine: `Qwen3_5ForConditionalGeneration` (nested `text_config`,
text weights under `model.language_model.*`), a small `model.visual.*` tower, a one-layer
`mtp.*` head, bf16, sharded by `save_pretrained`.

    python3 benches/make_checkpoint.py --out /tmp/qwen36-27b-ckpt [--layers 64]

transformers has no module for the MTP head (it ignores `mtp.*` on load and cannot save it),
so its 15 tensors are written afterwards into one more shard and added to
`model.safetensors.index.json`, as the released checkpoints carry them. The weights are
random (normal, std 0.02, drawn on the GPU): this measures loading, not quality.
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

HIDDEN, INTER, VOCAB = 5120, 17408, 248320


def text_config(layers):
    kinds = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "layer_types": [kinds[i % 4] for i in range(layers)],
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [11, 11, 10]},
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "eos_token_id": 248044,
        "dtype": "bfloat16",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--shard", default="5GB")
    a = ap.parse_args()
    t0 = time.time()
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": text_config(a.layers),
        # A small vision tower: the loader must skip it, not load it.
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 256,
                          "intermediate_size": 512, "num_heads": 4, "out_hidden_size": HIDDEN,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "in_channels": 3, "num_position_embeddings": 64,
                          "hidden_act": "gelu_pytorch_tanh"},
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    config = AutoConfig.from_pretrained(a.out)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    print(f"built {n / 1e9:.2f} B parameters in {time.time() - t0:.1f} s", flush=True)
    t1 = time.time()
    model.save_pretrained(a.out, max_shard_size=a.shard)
    print(f"save_pretrained: {time.time() - t1:.1f} s", flush=True)
    # The MTP head: one full-attention decoder layer plus its projections, released names.
    g = torch.Generator(device="cuda").manual_seed(1)
    r = lambda *s: (torch.randn(*s, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)
    q, kv, hd = 24, 4, 256
    mtp = {
        "mtp.fc.weight": r(HIDDEN, 2 * HIDDEN),
        "mtp.pre_fc_norm_embedding.weight": r(HIDDEN),
        "mtp.pre_fc_norm_hidden.weight": r(HIDDEN),
        "mtp.norm.weight": r(HIDDEN),
        "mtp.layers.0.input_layernorm.weight": r(HIDDEN),
        "mtp.layers.0.post_attention_layernorm.weight": r(HIDDEN),
        "mtp.layers.0.self_attn.q_proj.weight": r(2 * q * hd, HIDDEN),
        "mtp.layers.0.self_attn.k_proj.weight": r(kv * hd, HIDDEN),
        "mtp.layers.0.self_attn.v_proj.weight": r(kv * hd, HIDDEN),
        "mtp.layers.0.self_attn.o_proj.weight": r(HIDDEN, q * hd),
        "mtp.layers.0.self_attn.q_norm.weight": r(hd),
        "mtp.layers.0.self_attn.k_norm.weight": r(hd),
        "mtp.layers.0.mlp.gate_proj.weight": r(INTER, HIDDEN),
        "mtp.layers.0.mlp.up_proj.weight": r(INTER, HIDDEN),
        "mtp.layers.0.mlp.down_proj.weight": r(HIDDEN, INTER),
    }
    shard = "model-mtp.safetensors"
    save_file({k: v.cpu() for k, v in mtp.items()}, os.path.join(a.out, shard),
              metadata={"format": "pt"})
    idx_path = os.path.join(a.out, "model.safetensors.index.json")
    with open(idx_path) as f:
        idx = json.load(f)
    for k in mtp:
        idx["weight_map"][k] = shard
    with open(idx_path, "w") as f:
        json.dump(idx, f, indent=2)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [248046, 248044], "do_sample": True, "temperature": 0.6,
                   "top_p": 0.95, "top_k": 20}, f, indent=2)
    files = sorted(x for x in os.listdir(a.out) if x.endswith(".safetensors"))
    total = sum(os.path.getsize(os.path.join(a.out, x)) for x in files)
    print(json.dumps({"dir": a.out, "shards": len(files), "bytes": total,
                      "seconds": round(time.time() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
