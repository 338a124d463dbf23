"""p2p_copy.py — the NVLink bandwidth the expert-parallel figures are set against: a
plain peer-to-peer copy (copy engine, `Tensor.copy_` between two GPUs with peer access)
from GPU 0 to every other GPU of the host, one pair at a time, then from every GPU to
the next one all at once (each GPU sending and receiving, as a dispatch does).

    python3 bench/p2p_copy.py [--mib 256] [--json out.json]

GB/s = bytes / seconds (1e9), CUDA events around 10 copies after 3 warm-up copies,
median of 5 such runs; all-at-once: the slowest GPU's time.
"""
import argparse
import json
import statistics

import torch


def timed_copies(pairs, nbytes, reps=10):
    """Seconds a copy takes for each (src, dst) pair, all pairs running at once."""
    bufs = [(torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{s}"),
             torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}")) for s, d in pairs]
    streams = [torch.cuda.Stream(device=f"cuda:{s}") for s, _ in pairs]
    for (a, b), st in zip(bufs, streams):
        with torch.cuda.stream(st):
            for _ in range(3):
                b.copy_(a, non_blocking=True)
    for s, _ in pairs:
        torch.cuda.synchronize(s)
    runs = []
    for _ in range(5):
        events = []
        for (a, b), st in zip(bufs, streams):
            with torch.cuda.stream(st):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(st)
                for _ in range(reps):
                    b.copy_(a, non_blocking=True)
                e1.record(st)
                events.append((e0, e1))
        for s, _ in pairs:
            torch.cuda.synchronize(s)
        runs.append(max(e0.elapsed_time(e1) for e0, e1 in events) / 1e3 / reps)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes a copy, MiB")
    ap.add_argument("--json")
    args = ap.parse_args()
    n = torch.cuda.device_count()
    nbytes = args.mib << 20
    rows = []
    if n < 2:
        print(f"p2p_copy: {n} GPU(s); a peer copy needs 2")
    for d in range(1, n):
        if not torch.cuda.can_device_access_peer(0, d):
            print(f"GPU 0 -> GPU {d}: no peer access")
            continue
        s = timed_copies([(0, d)], nbytes)
        rows.append({"pairs": f"0->{d}", "gb_per_s": nbytes / s / 1e9})
        print(f"GPU 0 -> GPU {d}: {nbytes / s / 1e9:7.1f} GB/s")
    if n > 2:
        s = timed_copies([(r, (r + 1) % n) for r in range(n)], nbytes)
        rows.append({"pairs": f"r->r+1 mod {n}, all at once", "gb_per_s": nbytes / s / 1e9})
        print(f"every GPU r -> r + 1 at once: {nbytes / s / 1e9:7.1f} GB/s each")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpus": n, "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
