"""floors.py — the two floors of a training step (forward + backward) for each named
shape, no GPU needed: its FLOPs over the dense bf16 rate, and the fewest bytes it must
move through device memory over the copy bandwidth. A step can run no faster than the
larger; mok's time over it is the gap issue 4 closes. With a bench JSON, each row's
measured times are set against the floors.

    python3 bench/floors.py [--json bench/results/bench-h200-....json] [--tflops 777] [--tbps 4.2]

FLOPs: shapes.step_flops (3 x the forward's 6 T K H F + 2 T H E), as bench_moe.py
counts them too. Bytes (bf16, 2 bytes an element), each tensor once:
- weights W = E (2F H + H F + H): the forward reads those of the experts that have
  rows, the backward reads them again and writes every expert's gradients (bf16; an
  expert without rows gets zeros), W + 2 W active / E. Uniform routing: every expert
  has rows. Skewed (shapes.hot_experts): E/32 experts (at least one) are every
  token's first choices, so when K is at most that, only they have rows;
- tokens: x read by the forward and again by the backward, y written, dy read, dx
  written: 5 T H;
- activations kept for the backward at their smallest: the gate|up outputs of each
  routed row, T K 2F, written once and read once (recomputing them instead trades
  these bytes for 2 T K H 2F FLOPs).
Not counted (a design may avoid them): rows copied into expert order and back, the
routing's own tensors, fp32 gradient accumulation (4 bytes an element instead of 2).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES, hot_experts, step_flops  # noqa: E402


def active_experts(E, K, skewed):
    hot = hot_experts(E)
    return hot if skewed and K <= hot else E


def step_bytes(T, H, F, E, K, skewed=False):
    weights = E * (2 * F * H + H * F + H) * 2
    tokens = 5 * T * H * 2
    saved = 2 * T * K * 2 * F * 2
    return weights + 2 * weights * active_experts(E, K, skewed) // E, tokens, saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="", help="a bench_moe.py JSON: its mok and peer times against the floors")
    ap.add_argument("--tflops", type=float, default=777.0, help="dense bf16 rate (the H200's measured ceiling)")
    ap.add_argument("--tbps", type=float, default=4.2, help="device-memory copy bandwidth, TB/s (measured)")
    args = ap.parse_args()
    measured = {}
    if args.json:
        with open(args.json) as f:
            for r in json.load(f)["rows"]:
                measured[(r["shape"], r["routing"])] = (r["mok"]["ms"], r.get("peer", {}).get("ms"))
    print("| shape | routing | TFLOP a step | compute floor ms | GB a step (weights + tokens + saved) "
          "| bytes floor ms | FLOP per byte |" + (" mok ms | mok / floor | peer ms | peer / floor |" if measured else ""))
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: | ---: |" if measured else ""))
    for name, (T, H, F, E, K) in SHAPES.items():
        for routing in ("uniform", "skewed"):
            fl = step_flops(T, H, F, E, K)
            w, t, s = step_bytes(T, H, F, E, K, routing == "skewed")
            by = w + t + s
            c_ms, b_ms = fl / (args.tflops * 1e12) * 1e3, by / (args.tbps * 1e12) * 1e3
            line = (f"| {name} | {routing} | {fl / 1e12:.2f} | {c_ms:.2f} | {by / 1e9:.1f} ({w / 1e9:.1f} + "
                    f"{t / 1e9:.2f} + {s / 1e9:.2f}) | {b_ms:.2f} | {fl / by:.0f} |")
            if measured:
                m, p = measured.get((name, routing), (None, None))
                floor = max(c_ms, b_ms)
                line += f" {m:.2f} | {m / floor:.2f} |" if m else " - | - |"
                line += f" {p:.2f} | {p / floor:.2f} |" if p else " - | - |"
            print(line)

if __name__ == "__main__":
    main()
