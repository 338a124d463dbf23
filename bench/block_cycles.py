"""SM cycles a 64-deep K block of each GEMM kind of mok's training step, at several token
counts: one traced step (MOK_TRACE) a count, the median task's SM cycles over the K
blocks a task runs. Weight-gradient tiles run T K / E rows deep, so their figure
falling with T is the cost a tile (epilogue, restart) spread over more blocks, and
what it tends to is the mainloop's own cost a block; the other kinds' tiles do not
depend on T. docs/PERF.md (seventh session) has a run.

    MOK_LIBRARY=build/libmok.so python3 bench/block_cycles.py --shape mixtral-8x7b \\
        --tokens 4096,8192,16384
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_moe  # noqa: E402  (sets up torch and mok)
from shapes import SHAPES  # noqa: E402
from trace_report import NAMES, read_trace  # noqa: E402

BK = 64


def group_size(num_kb):
    """Column tiles a GEMM task takes (sm90_tile_gemm.cuh's group_size, kGroupKb 128)."""
    return 1 if num_kb >= 128 else min(8, 128 // max(num_kb, 1))


def blocks_a_task(kind, T, H, F, E, K):
    """K blocks of one task of each GEMM kind (uniform routing: mean rows an expert)."""
    if kind in ("gemm1", "dh"):  # K = H
        return group_size(H // BK) * (H // BK)
    if kind == "gemm2":  # K = F
        return group_size(F // BK) * (F // BK)
    if kind == "dx":  # K = 2F
        return group_size(2 * F // BK) * (2 * F // BK)
    nk = max(1, -(-(T * K // E) // BK))  # weight gradients (sm90_moe_backward.cu's wgrad_group)
    return min(32, max(1, 128 // nk)) * nk


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="mixtral-8x7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="4096,8192,16384", help="token counts, comma-separated")
    args = ap.parse_args()
    _, H, F, E, K = SHAPES[args.shape]
    kinds = ["gemm1", "gemm2", "dh", "dx", "wgrad2", "wgrad13"]
    print(f"{args.shape} (H {H}, F {F}, E {E}, K {K}): SM cycles a K block, median task of one traced step")
    print(f"{'T':>7} " + " ".join(f"{k:>9}" for k in kinds))
    with tempfile.TemporaryDirectory() as tmp:
        for T in map(int, args.tokens.split(",")):
            name = f"{args.shape}@{T}"
            SHAPES[name] = (T, H, F, E, K)
            path = os.path.join(tmp, f"trace-{T}.txt")
            os.environ["MOK_TRACE"] = path  # read when the step's context is created
            bench_moe.profile_shape(name, False)
            by_sync = read_trace(path)
            recs = by_sync[max(by_sync)]
            row = []
            for k in kinds:
                cycles = sorted(r[5] for r in recs if r[0] == NAMES.index(k))
                med = cycles[len(cycles) // 2] if cycles else 0
                row.append(f"{med / blocks_a_task(k, T, H, F, E, K):9.1f}")
            print(f"{T:>7} " + " ".join(row), flush=True)


if __name__ == "__main__":
    main()
