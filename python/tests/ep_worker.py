"""One torchrun rank of test_cuda_ep.py: mok.MoE(process_group=WORLD) on this rank's
GPU against mok.MoE at W = 1 on the whole global batch (run here too, on the same GPU),
bit for bit (D3 through the binding). Prints one line "rank R: ok" or what differs, and
exits 1 when anything does.

    torchrun --standalone --nproc-per-node 2 python/tests/ep_worker.py [--replay] [--accum]
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mok  # noqa: E402
from test_cuda import step  # noqa: E402 (this directory)

# tokens per rank a multiple of 64 (the router losses' chunks: DESIGN's D3 condition)
T_RANK, H, F, E, K, FS = 256, 128, 128, 16, 2, 64


def step_grads(m, *args):
    """test_cuda.step (forward + backward, outputs and gradients by name), the weight
    gradients taken from main_grad when the layer accumulates into it"""
    out = step(m, *args)
    if m.config.wgrad_fp32_accum:
        for name in ("w_router", "w13", "w2", "ws13", "ws2"):
            p = getattr(m, name)
            if p is not None:
                out["d_" + name] = p.main_grad
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--accum", action="store_true", help="wgrad_fp32_accum (main_grad)")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)

    g = torch.Generator().manual_seed(11)  # the global batch, the same on every rank
    T = T_RANK * W
    x = ((torch.rand(T, H, generator=g) * 2 - 1).to(torch.bfloat16)).to(dev)
    dy = ((torch.rand(T, H, generator=g) * 2 - 1).to(torch.bfloat16)).to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32).to(dev)
    w = (0.5 + 0.5 * torch.rand(T, K, generator=g)).to(dev)
    kw = dict(shared_ffn=FS, wgrad_fp32_accum=a.accum, device=dev)
    if a.replay:
        kw["routing"] = "replay"
    else:
        kw.update(aux_loss_coef=1e-2, z_loss_coef=1e-3)

    torch.manual_seed(5)  # the same draws on every rank: W = 2 keeps its slice of them
    ep = mok.MoE(H, F, E, K, max_tokens=T_RANK, process_group=dist.group.WORLD, **kw)
    mine = slice(rank * T_RANK, (rank + 1) * T_RANK)
    args = (idx[mine], w[mine]) if a.replay else ()
    got = step_grads(ep, x[mine], dy[mine], *args)

    torch.manual_seed(5)
    one = mok.MoE(H, F, E, K, max_tokens=T, **kw)
    args = (idx, w) if a.replay else ()
    ref = step_grads(one, x, dy, *args)

    El = E // W
    experts = slice(rank * El, (rank + 1) * El)
    per_token = ("y", "dx", "topk_idx", "d_topk_weight")
    bad = []
    for name, v in got.items():
        r = ref[name]
        if v is None or r is None:
            if (v is None) != (r is None):
                bad.append(name)
            continue
        if name in per_token:
            r = r[mine]
        elif name in ("d_w13", "d_w2"):
            r = r[experts]
        if v.shape != r.shape or not torch.equal(v, r):
            bad.append(name)
    print(f"rank {rank}: " + ("ok" if not bad else "differs from W = 1: " + ", ".join(bad)), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
