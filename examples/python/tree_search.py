#!/usr/bin/env python3
"""An agent-style tree search on capsules: from a prompt's capsule, branch n ways (each
branch restores the capsule into a pooled session and samples a continuation with its own
seed), score the branches by their mean token log-probability under the model, keep the
best, snapshot it, and search again from there. No branch is re-prefilled: a branch starts
one restore after its parent.

    python examples/python/tree_search.py                          # demo model, CPU
    python examples/python/tree_search.py path/to/hf-checkpoint --prompt "Plan: " --backend cuda
"""

import argparse
import math
import sys
import time
from pathlib import Path

import flashrt

ROOT = Path(__file__).resolve().parents[2]


def log_softmax_at(logits, i):
    """log p(i) from a logits row (numpy or array.array)."""
    try:
        import numpy as np

        x = np.asarray(logits, dtype=np.float64)
        m = x.max()
        return float(x[i] - m - np.log(np.exp(x - m).sum()))
    except ImportError:
        m = max(logits)
        return logits[i] - m - math.log(sum(math.exp(v - m) for v in logits))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "demo.toml"))
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--prompt", default=None, help="text (needs a tokenizer); default: random ids")
    ap.add_argument("--width", type=int, default=4, help="branches per level")
    ap.add_argument("--depth", type=int, default=3, help="levels")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per branch")
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args()

    demo = a.model.endswith("demo.toml")
    model = flashrt.Model(a.model, backend=a.backend, random_weights=a.random_weights or demo)
    root = model.session()
    if a.prompt is not None:
        root.append(a.prompt)
    else:
        root.append([(17 * i + 3) % model.vocab for i in range(64)])
    node = root.snapshot()
    pool = [model.session() for _ in range(a.width)]
    print(f"{model!r}\nroot: {node.pos} tokens, capsule {node.nbytes / 2**20:.2f} MiB", file=sys.stderr)

    for level in range(a.depth):
        t_level = time.perf_counter()
        branches = []
        for b, s in enumerate(pool):
            t = time.perf_counter()
            s.restore(node)
            restore_ms = (time.perf_counter() - t) * 1e3
            s.set_sampler(temperature=a.temperature, seed=1000 * level + b)
            lp, ids = 0.0, []
            for _ in range(a.tokens):
                tok = s.sample()
                lp += log_softmax_at(s.logits(), tok)
                ids.append(tok)
                s.step(tok)
            branches.append((lp / a.tokens, b, ids, restore_ms))
        branches.sort(reverse=True)
        score, best, ids, _ = branches[0]
        node = pool[best].snapshot()
        print(f"level {level}: {a.width} branches in {(time.perf_counter() - t_level) * 1e3:.1f} ms")
        for sc, b, bids, rms in sorted(branches, key=lambda x: x[1]):
            text = model.decode(bids) if model.has_tokenizer else " ".join(map(str, bids))
            mark = "*" if b == best else " "
            print(f"  {mark} branch {b}: mean log p {sc:8.3f}  (restore {rms:.2f} ms)  {text!r}")
    print(f"best path: {node.pos} tokens")
    if model.has_tokenizer:
        print(model.decode(node.tokens[-a.depth * a.tokens:]))


if __name__ == "__main__":
    main()
