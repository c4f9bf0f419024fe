#!/usr/bin/env python3
"""What driving flashrt from Python costs over driving it from Rust, per decode step, in one
process and one run: the same session, the same capsule, the same tokens, interleaved rounds.

  step:      `for t in toks: s.step(t)` (Python)     vs  `_rust_decode_steps` (a Rust loop)
  generate:  `for tok in s.generate(n, ...)` (Python) vs  `s.decode_greedy(n)` (a Rust loop)

Each round restores the capsule first (not timed), so every round decodes the same positions.
Two estimates, in microseconds per step: the median over rounds of the paired difference, and
the difference of the fastest rounds (noise only ever adds time, so on a busy CPU the minima
are the steadier figure). Also the cost of one call into the runtime that does no work
(`Session.pos`: argument handling, the GIL released and taken back, the session lock).

    python benches/python_overhead.py                                   # demo model, CPU
    python benches/python_overhead.py models/qwen36-27b.toml --random-weights --backend cuda
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import flashrt
from flashrt import _native

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "demo.toml"))
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--json")
    a = ap.parse_args()

    demo = a.model.endswith("demo.toml")
    t0 = time.perf_counter()
    m = flashrt.Model(a.model, backend=a.backend, random_weights=a.random_weights or demo)
    load_s = time.perf_counter() - t0
    s = m.session()
    s.append([(31 * i + 7) % m.vocab for i in range(a.prompt_tokens)])
    cap = s.snapshot()
    toks = [(13 * i + 5) % m.vocab for i in range(a.steps)]
    n = a.steps

    def py_step():
        s.restore(cap)
        s.synchronize()
        t = time.perf_counter()
        for tok in toks:
            s.step(tok)
        s.synchronize()
        return (time.perf_counter() - t) / n

    def rust_step():
        s.restore(cap)
        return _native._rust_decode_steps(s, toks, n)

    def py_generate():
        s.restore(cap)
        s.synchronize()
        t = time.perf_counter()
        for _ in s.generate(n, temperature=0, ignore_eos=True):
            pass
        s.synchronize()  # feeds the last token: n samples and n steps, as decode_greedy(n)
        return (time.perf_counter() - t) / n

    def rust_generate():
        s.restore(cap)
        s.synchronize()
        t = time.perf_counter()
        s.decode_greedy(n)
        s.synchronize()
        return (time.perf_counter() - t) / n

    pairs = {"step": (py_step, rust_step), "generate": (py_generate, rust_generate)}
    for py, rs in pairs.values():  # warm-up
        py(), rs()
    raw = {k: {"python": [], "rust": []} for k in pairs}
    for r in range(a.rounds):
        for k, (py, rs) in pairs.items():
            # Alternate which goes first, so drift does not favour one side.
            if r % 2:
                raw[k]["rust"].append(rs())
                raw[k]["python"].append(py())
            else:
                raw[k]["python"].append(py())
                raw[k]["rust"].append(rs())

    out = {
        "model": m.name,
        "backend": m.backend,
        "load_s": load_s,
        "prompt_tokens": a.prompt_tokens,
        "steps_per_round": n,
        "rounds": a.rounds,
    }
    print(f"{m!r}: {a.rounds} rounds of {n} decode steps after a {a.prompt_tokens}-token prompt")
    print(f"  {'':9} {'python us/step':>15} {'rust us/step':>13} {'overhead (median)':>18} {'(fastest)':>10}")
    for k, v in raw.items():
        diffs = [(p - q) * 1e6 for p, q in zip(v["python"], v["rust"])]
        res = {
            "python_us": statistics.median(v["python"]) * 1e6,
            "rust_us": statistics.median(v["rust"]) * 1e6,
            "overhead_us": statistics.median(diffs),
            "overhead_us_quartiles": statistics.quantiles(diffs, n=4),
            "python_min_us": min(v["python"]) * 1e6,
            "rust_min_us": min(v["rust"]) * 1e6,
            "python_us_all": [x * 1e6 for x in v["python"]],
            "rust_us_all": [x * 1e6 for x in v["rust"]],
        }
        res["overhead_min_us"] = res["python_min_us"] - res["rust_min_us"]
        out[k] = res
        print(f"  {k:9} {res['python_us']:15.1f} {res['rust_us']:13.1f} {res['overhead_us']:18.2f} {res['overhead_min_us']:10.2f}")
    calls = 20000
    t = time.perf_counter()
    for _ in range(calls):
        s.pos
    out["null_call_us"] = (time.perf_counter() - t) / calls * 1e6
    print(f"  one call into the runtime doing no work (Session.pos): {out['null_call_us']:.2f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    worst = max(out[k]["overhead_us"] for k in pairs)
    print(f"worst overhead {worst:.2f} us/step (bar: 20)", file=sys.stderr)


if __name__ == "__main__":
    main()
