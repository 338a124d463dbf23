#!/usr/bin/env python3
"""The peer's grouped GEMMs per SM cycle, from ncu: a step's six CUTLASS kernels (all
named device_kernel), each replayed alone, with their SM cycles. FLOPs per SM cycle
do not depend on the clock the power cap allows, so they compare with the rates per
MHz that MOK_TRACE gives for mok's GEMM tasks (docs/PERF.md, sixth session).

    ncu --clock-control none --kernel-name device_kernel --csv \\
        --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second \\
        python3 bench/peer_cycles.py --run mixtral-8x7b > peer.csv
    python3 bench/peer_cycles.py --report peer.csv --shape mixtral-8x7b

--run: the peer's step 4 times (the first ones compile it); the last step's six
kernels are taken, in launch order: gate|up, down, dh, dW2, dx, dW13.
"""
import argparse
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import SHAPES  # noqa: E402
from trace_report import SM_FLOPS_PER_CYCLE, gemm_flops  # noqa: E402

# the peer's six grouped GEMMs in launch order, and mok's task kind doing the same work
GEMMS = [("gate|up", "gemm1"), ("down", "gemm2"), ("dh", "dh"), ("dW2", "wgrad2"), ("dx", "dx"),
         ("dW13", "wgrad13")]


def report(path, shape, num_sms):
    """Per GEMM: time, SM cycles, clock, and FLOPs per SM cycle as a share of the peak."""
    lines = [ln for ln in open(path) if ln.startswith('"')]  # ncu's CSV rows (its notes start otherwise)
    rows = list(csv.reader(lines))
    if not rows:
        sys.exit(f"{path}: no ncu rows (was --kernel-name device_kernel matched?)")
    head, rows = rows[0], rows[1:]
    col = {n: head.index(n) for n in ("ID", "Metric Name", "Metric Value")}
    kernels = {}
    for r in rows:
        kernels.setdefault(int(r[col["ID"]]), {})[r[col["Metric Name"]]] = float(r[col["Metric Value"]].replace(",", ""))
    last = [kernels[k] for k in sorted(kernels)[-len(GEMMS):]]
    flops = gemm_flops(SHAPES[shape])
    print(f"peer {shape}: the last step's grouped GEMMs, each alone under ncu")
    for (name, kind), m in zip(GEMMS, last):
        cycles = m["sm__cycles_elapsed.avg"]
        share = flops[kind] / (cycles * num_sms) / SM_FLOPS_PER_CYCLE
        print(f"  {name:8} {m['gpu__time_duration.sum'] / 1e6:7.3f} ms {cycles:12.0f} SM cycles "
              f"{m['sm__cycles_elapsed.avg.per_second'] / 1e6:5.0f} MHz  {100 * share:5.1f}% of peak per cycle")


def run(shape, steps=4):
    import torch

    import bench_moe

    pb = bench_moe.Problem(shape)
    for _ in range(steps):
        pb.peer_step()
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", metavar="SHAPE", help="run the peer's step (under ncu)")
    ap.add_argument("--report", metavar="CSV", help="ncu's --csv output of a --run")
    ap.add_argument("--shape", help="with --report: the shape that was run")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU (H100 / H200 SXM: 132)")
    args = ap.parse_args()
    if args.run:
        run(args.run)
    elif args.report and args.shape:
        report(args.report, args.shape, args.sms)
    else:
        ap.error("--run SHAPE, or --report CSV --shape SHAPE")


if __name__ == "__main__":
    main()
