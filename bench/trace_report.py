#!/usr/bin/env python3
"""Where a step's time goes, from a MOK_TRACE file (one line per task:
"sync kind cta start_ns end_ns wait_ns [cycles [stall counts]]", wall clock from
%globaltimer, cycles from clock64).

    MOK_TRACE=/tmp/t.txt python3 bench/bench_moe.py --profile --shapes mixtral-8x7b
    python3 bench/trace_report.py /tmp/t.txt --shape mixtral-8x7b [--sync N]

For the forward and the backward launch of one sync it prints: the launch's span (first
task start to last task end), per task kind the CTA time working and waiting for
dependencies, the GEMM rate while working (TFLOP/s if every SM ran that kind at that
pace), the mean SM clock over that kind's tasks (the board's power limit lowers it
within a step, and a variant that does less work runs at a higher clock), the CTAs'
idle time (before their first task, between tasks, after their last), and a timeline:
per time bin, how many CTAs run each kind. From a MOK_STALL_PROFILE build
(bench/gpu_session.sh stalls), per GEMM kind also thread 0's share of the kind's
cycles in each wait of gemm_tiles (STALLS below, gpu_params.h's TraceRecord).
"""
import argparse
import collections
import sys

from shapes import SHAPES  # bench/ is this script's directory

FWD = ["route", "shared1", "prefix", "dispatch", "gemm1", "shared2", "gemm2", "combine"]
BWD = ["dg", "dhs", "dh", "dxr", "dxs", "dx", "wgrad2", "wgrad13", "rw", "tree", "dxsum"]
RECOMPUTE = ["rg", "rgs"]  # the backward's gate|up recompute (cfg.gate_up), after the wait slots
RETURN = ["return"]  # the forward's o rows back to their ranks (W > 1), after those
NAMES = FWD + BWD + ["wait(fwd)", "wait(bwd)"] + RECOMPUTE + RETURN
# gpu_params.h's kStall* in order; epi-* are parts of "epilogue"; mma: each block's wgmma_wait<1>
# (the tensor core running the previous block)
STALLS = ["full", "empty", "spare", "drain", "epilogue", "epi-stores", "epi-barriers", "epi-issue", "signal", "epi-loads",
          "mma", "route-topk", "route-counts", "route-stats",
          "prefix-sums", "prefix-walk", "dg-rows", "dg-router"]

SM_FLOPS_PER_CYCLE = 4096  # dense bf16, one Hopper SM (bench/peer_cycles.py's peer rows compare)


def gemm_flops(shape):
    """FLOPs of each GEMM task kind over a whole step (no shared expert)."""
    T, H, F, E, K = shape
    R = T * K
    return {"route": 2 * T * H * E, "gemm1": 2 * R * H * 2 * F, "rg": 2 * R * H * 2 * F, "gemm2": 2 * R * F * H,
            "dh": 2 * R * H * F, "dxr": 2 * T * E * H, "dx": 2 * R * 2 * F * H,
            "wgrad2": 2 * R * H * F, "wgrad13": 2 * R * 2 * F * H}


def report(recs, kinds, label, flops, num_sms, bins=60):
    recs = [r for r in recs if NAMES[r[0]] in kinds]
    if not recs:
        return
    t0 = min(r[2] for r in recs)
    t1 = max(r[3] for r in recs)
    span = t1 - t0
    ctas = sorted({r[1] for r in recs})
    n = max(num_sms, len(ctas))
    print(f"\n{label}: span {span / 1e6:.3f} ms over {len(ctas)} CTAs, {len(recs)} tasks")
    work = collections.Counter()
    wait = collections.Counter()
    count = collections.Counter()
    cycles = collections.Counter()
    span_ns = collections.Counter()
    stall = collections.defaultdict(lambda: [0] * len(STALLS))
    for k, c, s, e, w, cy, st in recs:
        work[NAMES[k]] += e - s - w
        wait[NAMES[k]] += w
        count[NAMES[k]] += 1
        if cy is not None:
            cycles[NAMES[k]] += cy
            span_ns[NAMES[k]] += e - s
        for i, v in enumerate(st):
            stall[NAMES[k]][i] += v
    print(f"  {'kind':9} {'tasks':>6} {'work ms':>8} {'wait ms':>8}  (CTA-ms / {n}; work rate; mean SM clock)")
    for k in kinds:
        if count[k] == 0:
            continue
        line = f"  {k:9} {count[k]:6d} {work[k] / 1e6 / n:8.3f} {wait[k] / 1e6 / n:8.3f}"
        if k in flops and work[k] > 0:
            line += f"  {flops[k] / (work[k] / n) / 1e3:6.0f} TFLOP/s"
        if span_ns[k] > 0:
            line += f"  {1e3 * cycles[k] / span_ns[k]:5.0f} MHz"
            if k in flops and work[k] > 0:  # FLOPs per SM cycle of work: free of the clock
                work_cycles = cycles[k] * work[k] / span_ns[k]
                line += f"  {100 * flops[k] / work_cycles / SM_FLOPS_PER_CYCLE:5.1f}% of peak per cycle"
        print(line)
        if any(stall[k]) and cycles[k] > 0:
            shares = ", ".join(f"{n} {100 * v / cycles[k]:.1f}%" for n, v in zip(STALLS, stall[k]))
            print(f"  {'':9} thread 0's cycles waiting: {shares}")
    head = gaps = tail = 0
    by_cta = collections.defaultdict(list)
    for k, c, s, e, w, _, _ in recs:
        by_cta[c].append((s, e))
    for c, iv in by_cta.items():
        iv.sort()
        head += iv[0][0] - t0
        tail += t1 - iv[-1][1]
        gaps += sum(max(0, b[0] - a[1]) for a, b in zip(iv, iv[1:]))
    total_work = sum(work.values()) / 1e6 / n
    total_wait = sum(wait.values()) / 1e6 / n
    if sum(span_ns.values()) > 0:
        print(f"  mean SM clock over all tasks: {1e3 * sum(cycles.values()) / sum(span_ns.values()):.0f} MHz")
    print(f"  per SM: work {total_work:.3f} ms, waits {total_wait:.3f}, idle before the first task "
          f"{head / 1e6 / n:.3f}, between tasks {gaps / 1e6 / n:.3f}, after the last {tail / 1e6 / n:.3f}")
    # timeline: CTAs running each kind per bin (time-weighted)
    width = span / bins
    grid = collections.defaultdict(lambda: [0.0] * bins)
    for k, c, s, e, w, _, _ in recs:
        b0 = int((s - t0) / width)
        b1 = min(bins - 1, int((e - t0) / width))
        for b in range(b0, b1 + 1):
            lo = max(s, t0 + b * width)
            hi = min(e, t0 + (b + 1) * width)
            if hi > lo:
                grid[NAMES[k]][b] += (hi - lo) / width
    shades = " .:-=+*#%@"
    print(f"  timeline, {width / 1e3:.0f} us a column; shade = share of the {n} SMs on that kind")
    for k in kinds:
        if k in grid:
            row = "".join(shades[min(9, int(round(9 * v / n)))] for v in grid[k])
            print(f"  {k:9} |{row}|")
    busy = [sum(grid[k][b] for k in grid) / n for b in range(bins)]
    print(f"  {'all':9} |{''.join(shades[min(9, int(round(9 * v)))] for v in busy)}|")


def read_trace(path):
    """A MOK_TRACE file's records by sync: (kind, cta, start_ns, end_ns, wait_ns, cycles
    or None, stall counts)."""
    by_sync = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            v = list(map(int, line.split()))
            sy, k, c, s, e, w = v[:6]
            # (older traces: no cycles, no stall counts)
            by_sync[sy].append((k, c, s, e, w, v[6] if len(v) > 6 else None, v[7 : 7 + len(STALLS)]))
    return by_sync


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--shape", help="named shape, for GEMM rates")
    ap.add_argument("--sync", type=int, help="which sync (default: the last)")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    by_sync = read_trace(args.trace)
    if not by_sync:
        sys.exit("empty trace")
    sy = args.sync if args.sync is not None else max(by_sync)
    flops = gemm_flops(SHAPES[args.shape]) if args.shape else {}
    print(f"trace {args.trace}, sync {sy}" + (f", shape {args.shape}" if args.shape else ""))
    report(by_sync[sy], FWD + RETURN, "forward", flops, args.sms)
    report(by_sync[sy], BWD + RECOMPUTE, "backward", flops, args.sms)


if __name__ == "__main__":
    main()
