#!/usr/bin/env python3
"""Where the warps of one kernel wait, by SASS instruction, from ncu's source page.

Reads the per-instruction CSV that `bench/gpu_session.sh phase-ncu` brings back
($OUT/ncu-phase-<knob>-sass.csv.gz: `ncu --page source --csv --print-source sass` of a
report with the WarpStateStats and SourceCounters sections) and prints
  - each stall reason's share of all warp samples;
  - the windows of --window consecutive instructions with the most samples, with their
    top reasons and most executed opcodes (a GEMM's mainloop, an epilogue, DG's loop);
  - the single instructions above --min percent of the samples.
Instruction numbers are positions in the CSV (the SASS order), so that a window can be
read again with --range A B.

    python3 bench/ncu_sass_report.py ncu-phase-0-sass.csv.gz
    python3 bench/ncu_sass_report.py ncu-phase-0-sass.csv.gz --range 2220 7700 --min 0.05
"""
import argparse
import collections
import csv
import gzip


def read(path):
    """Rows (text, samples, executed, {reason: samples}) in SASS order."""
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt") as fh:
        r = csv.reader(fh)
        next(r)  # "Kernel Name", ...
        hdr = next(r)
        col = {h: i for i, h in enumerate(hdr)}
        reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
        for row in r:
            if len(row) < len(hdr):
                continue
            num = lambda h: int(row[col[h]] or 0)
            rows.append((row[col["Source"]].strip(), num("Warp Stall Sampling (All Samples)"),
                         num("Instructions Executed"), {h[6:]: num(h) for h in reasons}))
    return rows


def opcode(text):
    t = text.split()
    return (t[1] if t[0].startswith("@") and len(t) > 1 else t[0]).split(".")[0]


def summary(rows, total, lo, hi):
    seg = rows[lo:hi]
    s = sum(r[1] for r in seg)
    reasons = collections.Counter()
    ops = collections.Counter()
    for r in seg:
        reasons.update(r[3])
        ops[opcode(r[0])] += r[2]
    why = ", ".join(f"{k} {100 * v / max(s, 1):.0f}%" for k, v in reasons.most_common(4))
    what = " ".join(f"{k}:{v}" for k, v in ops.most_common(5))
    return f"[{lo}, {hi}) {100 * s / total:5.2f}% of samples; {why} | executed: {what}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--min", type=float, default=0.3, help="instructions above this %% of the samples")
    ap.add_argument("--range", type=int, nargs=2, metavar=("A", "B"), help="only instructions [A, B)")
    args = ap.parse_args()
    rows = read(args.csv)
    total = sum(r[1] for r in rows)
    lo, hi = args.range if args.range else (0, len(rows))
    print(f"{len(rows)} instructions, {total} warp samples")
    reasons = collections.Counter()
    for r in rows[lo:hi]:
        reasons.update(r[3])
    print("reasons: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in reasons.most_common(10)))
    if not args.range:
        w = args.window
        windows = collections.Counter()
        for i, r in enumerate(rows):
            windows[i // w] += r[1]
        print(f"windows of {w} instructions with the most samples:")
        for k, _ in windows.most_common(args.top):
            print("  " + summary(rows, total, k * w, min(len(rows), (k + 1) * w)))
    else:
        print(summary(rows, total, lo, hi))
    print(f"instructions above {args.min}% of the samples:")
    for i in range(lo, hi):
        text, s, ex, why = rows[i]
        if 100 * s / total >= args.min:
            top = " ".join(f"{k}:{v}" for k, v in sorted(why.items(), key=lambda kv: -kv[1])[:3] if v)
            print(f"  {i:6d} {100 * s / total:5.2f}% executed {ex:9d}  {text[:60]:60s} {top}")


if __name__ == "__main__":
    main()
