#!/usr/bin/env python3
"""A real checkpoint end to end on the GPU machine, in one run (issue 12's bar):

  1. write the full Qwen3.6-27B shape in the released layout (benches/make_checkpoint.py);
  2. the read floor: `dd` every shard once after dropping the page cache;
  3. `flashrt serve --checkpoint DIR` from a cold page cache: time to ready (GET /health),
     peak resident memory (VmHWM), then cold time-to-first-token through HTTP streaming
     (`/v1/completions`, no prefix cache) at each length;
  4. `flashrt bench models/qwen36-27b.toml --random-weights` at the same lengths (the
     hand-written TOML the server's TTFT is held to);
  5. transformers' `from_pretrained(DIR, device_map="cuda")` from a cold page cache: time
     and peak resident memory;
  6. delete the checkpoint (unless --keep).

    python3 benches/real_checkpoint.py --flashrt .gpu/flashrt --out $OUT [--dir /tmp/ckpt]

Writes real_checkpoint.json (and logs) to --out; prints a short table last.
"""
import argparse
import http.client
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time

from serve_client import health

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def drop_caches():
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        log(f"cannot drop the page cache: {e}")
        return False


def shards(d):
    return sorted(os.path.join(d, x) for x in os.listdir(d) if x.endswith(".safetensors"))


def read_floor(d):
    drop_caches()
    total, t0 = 0, time.time()
    for p in shards(d):
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "status=none"], check=True)
        total += os.path.getsize(p)
    s = time.time() - t0
    return {"bytes": total, "seconds": s, "gb_per_s": total / s / 1e9}


def vm_hwm(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def ttft(port, ids):
    """Seconds from sending a streaming completion to its first token event."""
    body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]}")
    first = None
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data:") and first is None and b"token_ids" in line:
            first = time.perf_counter() - t0
        if line.strip() == b"data: [DONE]":
            break
    c.close()
    return first


def serve_run(a, port, lengths):
    drop_caches()
    cmd = [a.flashrt, "serve", "--checkpoint", a.dir, "--backend", "cuda",
           "--bind", f"127.0.0.1:{port}", "--no-auto-cache", "--max-sessions", "4"]
    logf = open(os.path.join(a.out, "serve.log"), "w")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
    peak_load = None
    while not health(port):
        if p.poll() is not None:
            raise RuntimeError(f"flashrt serve exited with {p.returncode}; see serve.log")
        peak_load = vm_hwm(p.pid) or peak_load
        time.sleep(0.05)
    ready = time.time() - t0
    peak_load = vm_hwm(p.pid)
    log(f"flashrt serve ready in {ready:.1f} s, peak RSS {peak_load / 2**30:.2f} GiB")
    out = {"ready_s": ready, "peak_rss_at_ready": peak_load, "ttft_ms": {}}
    rng = random.Random(5)
    for n in lengths:
        runs = []
        for i in range(2 + a.runs):
            ids = [rng.randrange(3, 248000) for _ in range(n)]
            t = ttft(port, ids)
            if i >= 2:  # two warm-ups: plain launches, then graph capture
                runs.append(t * 1e3)
        out["ttft_ms"][str(n)] = {"runs": runs, "median": statistics.median(runs)}
        log(f"served cold TTFT at {n}: {', '.join(f'{x:.1f}' for x in runs)} ms")
    out["peak_rss"] = vm_hwm(p.pid)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
    out["exit_code"] = p.returncode
    return out


def bench_run(a, lengths):
    j = os.path.join(a.out, "bench_toml.json")
    cmd = [a.flashrt, "bench", os.path.join(ROOT, "models", "qwen36-27b.toml"), "--random-weights",
           "--backend", "cuda", "--lengths", ",".join(map(str, lengths)), "--iters", "5",
           "--decode-steps", "5", "--json", j]
    with open(os.path.join(a.out, "bench_toml.log"), "w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=True)
    r = json.load(open(j))
    return {str(x["tokens"]): x["cold_ttft_ms"] for x in r["lengths"]}


def transformers_run(a):
    drop_caches()
    code = f"""
import time, resource, json, torch
t0 = time.time()
from transformers import Qwen3_5ForConditionalGeneration
m = Qwen3_5ForConditionalGeneration.from_pretrained({a.dir!r}, device_map="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print(json.dumps({{"seconds": time.time() - t0, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    with open(os.path.join(a.out, "transformers.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flashrt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/tmp/flashrt-qwen36-27b")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--lengths", default="2048,16384")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of steps to skip: bench,transformers")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    lengths = [int(x) for x in a.lengths.split(",")]
    skip = set(a.skip.split(","))
    res = {"layers": a.layers}
    path = os.path.join(a.out, "real_checkpoint.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=2)

    try:
        if not os.path.exists(os.path.join(a.dir, "model.safetensors.index.json")):
            t0 = time.time()
            r = subprocess.run([sys.executable, os.path.join(ROOT, "benches", "make_checkpoint.py"),
                                "--out", a.dir, "--layers", str(a.layers)],
                               capture_output=True, text=True)
            with open(os.path.join(a.out, "make_checkpoint.log"), "w") as f:
                f.write(r.stdout + r.stderr)
            if r.returncode != 0:
                raise RuntimeError("make_checkpoint failed: " + r.stderr[-2000:])
            res["write_s"] = time.time() - t0
        res["files"] = {"shards": len(shards(a.dir)),
                        "bytes": sum(os.path.getsize(p) for p in shards(a.dir))}
        log(f"checkpoint: {res['files']}")
        save()
        res["read_floor"] = read_floor(a.dir)
        log(f"read floor: {res['read_floor']}")
        save()
        res["flashrt_serve"] = serve_run(a, 18077, lengths)
        save()
        if "bench" not in skip:
            res["bench_toml_cold_ttft_ms"] = bench_run(a, lengths)
            save()
        if "transformers" not in skip:
            res["transformers"] = transformers_run(a)
            log(f"transformers: {res['transformers']}")
            save()
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)
        save()
    fl, rf = res.get("flashrt_serve", {}), res.get("read_floor", {})
    print("| what | figure |\n|---|---|")
    if rf:
        print(f"| read floor (dd, cold) | {rf['seconds']:.1f} s ({rf['gb_per_s']:.2f} GB/s, {rf['bytes'] / 1e9:.1f} GB) |")
    if fl:
        print(f"| flashrt serve ready | {fl['ready_s']:.1f} s = {fl['ready_s'] / rf['seconds']:.2f}x the read floor |")
        print(f"| flashrt peak RSS | {fl['peak_rss'] / 2**30:.2f} GiB |")
        for n, t in fl["ttft_ms"].items():
            b = res.get("bench_toml_cold_ttft_ms", {}).get(n)
            ratio = f" = {t['median'] / b:.3f}x bench {b:.1f} ms" if b else ""
            print(f"| served cold TTFT {n} | {t['median']:.1f} ms{ratio} |")
    tr = res.get("transformers", {})
    if "seconds" in tr:
        print(f"| transformers from_pretrained | {tr['seconds']:.1f} s, peak RSS {tr['peak_rss'] / 2**30:.2f} GiB |")


if __name__ == "__main__":
    main()
