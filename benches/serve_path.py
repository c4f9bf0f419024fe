#!/usr/bin/env python3
"""The served path as a client sees it, next to the engine, in one run (issue 13's table).

Starts `flashrt serve MODEL --random-weights`, then through HTTP (stdlib `http.client`,
streaming `/v1/completions`):

- stores a prefix of `--prefix` random tokens (the automatic prefix cache keeps its capsule);
- for each suffix length n: prefix + n fresh random tokens, `max_tokens: 1`, greedy; the time
  from sending the request to the first token event (`--runs` runs after a warm-up at that
  length), and the `cached_tokens` the server reports (it must be the prefix);
- an exact repeat of the stored prefix (nothing to prefill);
- streamed decode of `--decode-tokens` tokens at temperature 0, at 0.7 with top-p 0.9 and at
  the OpenAI default (temperature 1): the median gap between token events;

then runs `flashrt bench MODEL --random-weights` at the prefix length for the engine's
restored TTFT and decode step. Figures go to `OUT/serve_path.json`.

    python3 benches/serve_path.py --flashrt .gpu/flashrt --out $OUT
"""

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

from serve_client import health

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def stream(port, body):
    """(seconds to each token event from the request, the final usage or None)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]}")
    times, usage = [], None
    while True:
        line = r.fp.readline()
        if not line:
            break
        line = line.strip()
        if line == b"data: [DONE]":
            break
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter() - t0
        ev = json.loads(line[5:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            if ch.get("token_ids") or ch.get("text"):
                times.append(now)
    c.close()
    return times, usage


def cached(usage):
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashrt", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "qwen36-27b.toml"))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffixes", default="1,8,32,64,65,128,256,512,1024")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=248000)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"model": a.model, "prefix": a.prefix, "suffix_ttft_ms": {}, "decode_gap_ms": {}}

    cmd = [a.flashrt, "serve", a.model, "--random-weights", "--backend", a.backend,
           "--bind", f"127.0.0.1:{a.port}", "--max-sessions", "4"]
    logf = open(os.path.join(a.out, "serve.log"), "w")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    try:
        while not health(a.port):
            if p.poll() is not None:
                raise RuntimeError(f"flashrt serve exited with {p.returncode}; see serve.log")
            time.sleep(0.05)
        res["ready_s"] = time.time() - t0
        log(f"serve ready in {res['ready_s']:.1f} s")
        rng = random.Random(13)
        fresh = lambda n: [rng.randrange(3, a.vocab) for _ in range(n)]
        prefix = fresh(a.prefix)
        greedy = {"max_tokens": 1, "temperature": 0}
        stream(a.port, dict(greedy, prompt=prefix))  # stores the prefix (and captures graphs)
        for n in [int(x) for x in a.suffixes.split(",")]:
            runs, hits = [], []
            for i in range(1 + a.runs):
                times, usage = stream(a.port, dict(greedy, prompt=prefix + fresh(n)))
                if i >= 1:  # one warm-up per length: graph capture of its plans
                    runs.append(times[0] * 1e3)
                    hits.append(cached(usage))
            res["suffix_ttft_ms"][str(n)] = {"runs": runs, "median": statistics.median(runs),
                                             "cached_tokens": hits}
            log(f"suffix {n:5}: TTFT {', '.join(f'{x:.1f}' for x in runs)} ms (cached {hits})")
        runs, hits = [], []
        for _ in range(a.runs):
            times, usage = stream(a.port, dict(greedy, prompt=prefix))
            runs.append(times[0] * 1e3)
            hits.append(cached(usage))
        res["repeat_ttft_ms"] = {"runs": runs, "median": statistics.median(runs), "cached_tokens": hits}
        log(f"exact repeat: TTFT {', '.join(f'{x:.1f}' for x in runs)} ms (cached {hits})")
        for name, s in [("greedy", {"temperature": 0}),
                        ("t0.7_top_p0.9", {"temperature": 0.7, "top_p": 0.9, "seed": 1}),
                        ("t1", {"temperature": 1.0, "seed": 2})]:
            body = dict(s, prompt=prefix + fresh(8), max_tokens=a.decode_tokens + 1, ignore_eos=True)
            stream(a.port, body)  # warm-up
            body["prompt"] = prefix + fresh(8)
            times, _ = stream(a.port, body)
            gaps = [(b - x) * 1e3 for x, b in zip(times, times[1:])]
            res["decode_gap_ms"][name] = {"median": statistics.median(gaps), "n": len(gaps),
                                          "p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))]}
            log(f"streamed decode {name}: median gap {statistics.median(gaps):.2f} ms over {len(gaps)}")
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()

    j = os.path.join(a.out, "bench.json")
    with open(os.path.join(a.out, "bench.log"), "w") as f:
        subprocess.run([a.flashrt, "bench", a.model, "--random-weights", "--backend", a.backend,
                        "--lengths", str(a.prefix), "--iters", "3", "--decode-steps", "16",
                        "--json", j], stdout=f, stderr=subprocess.STDOUT, check=True)
    b = json.load(open(j))
    res["bench"] = b
    res["bench_decode_step_ms"] = b.get("decode_step_ms") or b["lengths"][0].get("decode_step_ms")
    g = res["decode_gap_ms"]
    log(f"bench decode step {res['bench_decode_step_ms']} ms; served greedy gap "
        f"{g['greedy']['median']:.2f} ms; sampled / greedy "
        f"{g['t0.7_top_p0.9']['median'] / g['greedy']['median']:.3f}x (t0.7, top-p 0.9), "
        f"{g['t1']['median'] / g['greedy']['median']:.3f}x (t1)")
    with open(os.path.join(a.out, "serve_path.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
