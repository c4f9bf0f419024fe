#!/usr/bin/env python3
"""Side-by-side table of one `flashrt bench --json` run and one `peer_transformers.py --json`
run (made in the same command by benches/run-h200.sh), with issue 7's bars checked.

Usage: python3 benches/compare.py flashrt.json peer.json
Prints Markdown. Every ratio is computed from the two files given; nothing is hard-coded
except the bars themselves (from the issue).
"""

import json
import sys

# Issue 7's bars.
DECODE_OVER_FLOOR = 1.15
COLD_SPEEDUP = 1.2
RESTORE_OVER_FLOOR = 1.3
RESTORED_TTFT_MS = 16.0
SELF_SPEEDUP = {2048: 10.0, 16384: 80.0}


def mark(ok):
    return "yes" if ok else "**no**"


def main():
    ours = json.load(open(sys.argv[1]))
    peer = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"lengths": []}
    peers = {p["tokens"]: p for p in peer.get("lengths", [])}
    floor = ours["decode_floor_ms"]
    print(f"flashrt: {ours['model']} ({ours['dtype']}) on {ours['backend']}; "
          f"copy bandwidth {ours['copy_bandwidth_gb_s']:.0f} GB/s, decode floor {floor:.2f} ms, "
          f"matmul rate {ours.get('matmul_tflops', 0):.0f} TFLOP/s")
    if peers:
        print(f"peer: {peer.get('peer')} {peer.get('transformers', '')} (torch {peer.get('torch', '?')}) "
              f"on {peer.get('device', '?')}")
    print()
    print("| prompt | flashrt cold TTFT | peer cold TTFT | speedup (bar >= 1.2x) | prefill floor "
          "| flashrt restored TTFT (bar <= 16 ms) | peer deepcopy + 1 step | own cold / restored "
          "| flashrt decode (bar <= 1.15x floor) | peer decode |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for l in ours["lengths"]:
        n = l["tokens"]
        p = peers.get(n)
        speed = p and p["cold_ttft_ms"] / l["cold_ttft_ms"]
        dec = l["decode_step_ms"] / floor
        print(
            f"| {n} | {l['cold_ttft_ms']:.1f} ms | "
            + (f"{p['cold_ttft_ms']:.1f} ms | {speed:.2f}x {mark(speed >= COLD_SPEEDUP)} | " if p else "- | - | ")
            + f"{l['prefill_floor_ms']:.1f} ms | "
            + f"{l['restored_ttft_ms']:.2f} ms {mark(l['restored_ttft_ms'] <= RESTORED_TTFT_MS)} | "
            + (f"{p['restored_ttft_ms']:.1f} ms | " if p else "- | ")
            + f"{l['restored_speedup']:.0f}x"
            + (f" {mark(l['restored_speedup'] >= SELF_SPEEDUP[n])}" if n in SELF_SPEEDUP else "")
            + f" | {l['decode_step_ms']:.2f} ms = {dec:.3f}x {mark(dec <= DECODE_OVER_FLOOR)} | "
            + (f"{p['decode_step_ms']:.1f} ms |" if p else "- |")
        )
    print()
    print("| prompt | capsule | snapshot | restore (wall) | restore (device) | copy floor "
          "| restore / floor (bar <= 1.3x): device, wall |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for l in ours["lengths"]:
        dev = l.get("restore_device_ms")
        r_dev = dev / l["copy_floor_ms"] if dev else None
        r_wall = l["restore_ms"] / l["copy_floor_ms"]
        print(
            f"| {l['tokens']} | {l['capsule_bytes'] / 2**20:.1f} MiB | {l['snapshot_ms']:.3f} ms | "
            f"{l['restore_ms']:.3f} ms | " + (f"{dev:.3f} ms | " if dev else "- | ")
            + f"{l['copy_floor_ms']:.3f} ms | "
            + (f"{r_dev:.2f}x {mark(r_dev <= RESTORE_OVER_FLOOR)}, " if r_dev else "")
            + f"{r_wall:.2f}x {mark(r_wall <= RESTORE_OVER_FLOOR)} |"
        )
    if peers:
        firsts = ", ".join(f"{p['tokens']}: {p['first_call_ms'] / 1e3:.1f} s" for p in peers.values())
        print(f"\npeer first call per length (Triton autotuning): {firsts}")
    ours_first = ", ".join(f"{l['tokens']}: {l['first_prefill_ms']:.0f} ms" for l in ours["lengths"]
                           if "first_prefill_ms" in l)
    if ours_first:
        print(f"flashrt first prefill per length (plain launches before graph capture): {ours_first}")


if __name__ == "__main__":
    main()
