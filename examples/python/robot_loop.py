#!/usr/bin/env python3
"""A robot-style control loop on capsules: at a fixed rate, each tick goes back to a stored
state (a reset to the task's start, a re-entry into the last committed state, or a branch
into a spare session to try an alternative), feeds the tick's observation tokens and picks
the next action token. What it measures is what a controller waits for: restore to first
token. It prints the latency distribution, the deadline misses, and (with --rust) the same
restore + observation + token driven by a Rust loop on the same session, side by side.

    python examples/python/robot_loop.py                           # demo model, CPU
    python examples/python/robot_loop.py models/qwen36-27b.toml --random-weights \\
        --backend cuda --hz 20 --ticks 400 --rust --json out.json  # the 27B shape on a GPU
    python examples/python/robot_loop.py path/to/hf-checkpoint --backend cuda

Observations are random token ids here (a real policy would tokenize sensor readings).
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import flashrt

ROOT = Path(__file__).resolve().parents[2]


def pct(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summary(ms):
    return {
        "n": len(ms),
        "p50_ms": pct(ms, 50),
        "p90_ms": pct(ms, 90),
        "p99_ms": pct(ms, 99),
        "max_ms": max(ms),
        "mean_ms": sum(ms) / len(ms),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "demo.toml"),
                    help="a model TOML or a Hugging Face checkpoint folder (default: the demo model)")
    ap.add_argument("--random-weights", action="store_true", help="random weights for a TOML model (the demo model always)")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--hz", type=float, default=20.0, help="control rate (ticks per second)")
    ap.add_argument("--ticks", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--task-tokens", type=int, default=256, help="the task prompt prefilled once")
    ap.add_argument("--obs-tokens", type=int, default=8, help="observation tokens fed each tick")
    ap.add_argument("--rust", action="store_true", help="also time the same restore-to-first-token from a Rust loop")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()

    demo = a.model.endswith("demo.toml")
    t0 = time.perf_counter()
    model = flashrt.Model(a.model, backend=a.backend, random_weights=a.random_weights or demo)
    print(f"{model!r} loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    rng = random.Random(7)
    vocab = model.vocab

    def obs():
        return [rng.randrange(vocab) for _ in range(a.obs_tokens)]

    live = model.session()
    spare = model.session()  # the branch target: a second session, restored into
    live.append([rng.randrange(vocab) for _ in range(a.task_tokens)])
    start = live.snapshot()  # the task's start: every reset comes back here
    committed = start  # the last state the controller committed to
    print(f"task prompt {start.pos} tokens, capsule {start.nbytes / 2**20:.1f} MiB on {start.location}", file=sys.stderr)

    period = 1.0 / a.hz
    kinds = ("reset", "re-enter", "branch")
    lat = {k: [] for k in kinds}
    misses = 0
    next_tick = time.perf_counter()
    for tick in range(a.warmup + a.ticks):
        kind = kinds[tick % 3]
        o = obs()
        t = time.perf_counter()
        if kind == "reset":
            s = live
            s.restore(start)
        elif kind == "re-enter":
            s = live
            s.restore(committed)
        else:
            s = spare
            s.restore(committed)
        s.append(o)
        action = s.sample()  # greedy unless the checkpoint's generation_config says otherwise
        dt = time.perf_counter() - t
        if tick >= a.warmup:
            lat[kind].append(dt * 1e3)
            misses += dt > period
        # Commit every few ticks: the action is fed and the new state becomes the re-entry point.
        if kind == "re-enter" and tick % 6 == 1:
            s.step(action)
            committed = s.snapshot()
            if committed.pos > start.pos + 64:  # re-anchor: the episode starts over
                committed = start
        next_tick += period
        sleep = next_tick - time.perf_counter()
        if sleep > 0:
            time.sleep(sleep)
        else:
            next_tick = time.perf_counter()

    all_ms = [x for k in kinds for x in lat[k]]
    out = {
        "model": model.name,
        "backend": model.backend,
        "task_tokens": a.task_tokens,
        "obs_tokens": a.obs_tokens,
        "hz": a.hz,
        "capsule_bytes": start.nbytes,
        "python": summary(all_ms),
        "python_by_kind": {k: summary(v) for k, v in lat.items()},
        "deadline_misses": misses,
    }
    print(f"\nrestore to first token ({a.obs_tokens} observation tokens, {a.ticks} ticks at {a.hz:g} Hz):")
    print(f"  {'':10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'max ms':>9}")
    for k in kinds:
        v = out["python_by_kind"][k]
        print(f"  {k:10} {v['p50_ms']:9.3f} {v['p90_ms']:9.3f} {v['p99_ms']:9.3f} {v['max_ms']:9.3f}")
    v = out["python"]
    print(f"  {'all':10} {v['p50_ms']:9.3f} {v['p90_ms']:9.3f} {v['p99_ms']:9.3f} {v['max_ms']:9.3f}")
    print(f"  deadline ({period * 1e3:.1f} ms) missed {misses} times")

    if a.rust:
        # The same work from a Rust loop: restore the committed-style capsule, feed an
        # observation, choose a token; paced by the same sleep so caches and clocks match.
        rust = []
        o = obs()
        for _ in range(a.ticks):
            rust += flashrt._native._rust_restore_to_first_token(live, start, o, 1)
            time.sleep(max(0.0, period - rust[-1]))
        rust_ms = [x * 1e3 for x in rust]
        out["rust"] = summary(rust_ms)
        py_reset = out["python_by_kind"]["reset"]
        r = out["rust"]
        out["ratio_p50"] = py_reset["p50_ms"] / r["p50_ms"]
        out["ratio_p99"] = py_reset["p99_ms"] / r["p99_ms"]
        print("\nthe same restore + observation + token from Rust (reset ticks from Python beside it):")
        print(f"  rust       p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms")
        print(f"  python     p50 {py_reset['p50_ms']:.3f} ms  p99 {py_reset['p99_ms']:.3f} ms"
              f"  ({out['ratio_p50']:.3f}x / {out['ratio_p99']:.3f}x)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
