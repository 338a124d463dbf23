"""The expert-parallel PyTorch peer for mok's benchmark (docs/DISTRIBUTED.md): the MoE
layer over the W ranks of a torch.distributed group as a careful PyTorch user writes it
without DeepEP. Rank r holds T_r tokens and experts [r E/W, (r+1) E/W).

    y = ep_moe(x, w_router, bias, w13_local, w2_local, K, group)

fp32 router softmax and top-K (ties and weights as bench_moe.peer_forward), the (token,
slot) rows sorted by expert (stable: rows of an expert in token order; experts of a rank
are contiguous, so this also groups them by destination rank), the per-destination
counts exchanged, then the rows with all_to_all_single (which syncs with the host for
the split sizes: without a DeepEP-like kernel a PyTorch user cannot avoid it); on the
owner the received rows regrouped by local expert (stable: source rank, then its token
order = the global token order), torch._grouped_mm for gate|up and down with SwiGLU
between, the results sent back by a second all_to_all_single, and each token's K
results summed with index_add_. Differentiable end to end
(torch.distributed.nn.functional.all_to_all_single carries the gradients back).

On CPU tensors (gloo) the grouped GEMM is a loop over experts, so the logic can be
checked without a GPU (python/tests/test_ep_peer.py).
"""
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dfn
from torch.nn import functional as F


def grouped_mm(a, b, offs):
    """a [N, k] rows grouped by expert (group g ends at offs[g]), b [G, k, n] -> [N, n]."""
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=offs)
    out, lo = [], 0
    for g, hi in enumerate(offs.tolist()):
        out.append(a[lo:hi] @ b[g])
        lo = hi
    return torch.cat(out) if out else a.new_zeros(0, b.shape[-1])


def route(x, w_router, bias, K, score="softmax", route_scale=1.0, n_group=0, topk_group=0):
    """Top-K experts and normalised weights of each token (fp32 scores; sigmoid scores
    as DeepSeek-V3's; n_group > 1: its group-limited choice, the top-K among the
    experts of the topk_group groups with the largest top-2 sums of score + bias)."""
    logits = F.linear(x, w_router).float()
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    key = scores + bias
    if n_group > 1:
        T, E = key.shape
        group_score = key.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        key = key.masked_fill(~kept.repeat_interleave(E // n_group, dim=1), float("-inf"))
    _, idx = torch.topk(key, K, dim=-1)
    g = scores.gather(1, idx)
    return idx, g / g.sum(-1, keepdim=True) * route_scale


def ep_moe(x, w_router, bias, w13_local, w2_local, K, group=None):
    """y [T_r, H] of this rank's tokens; w13_local [E/W, 2F, H], w2_local [E/W, H, F]."""
    W = dist.get_world_size(group) if group is not None or dist.is_initialized() else 1
    T, H = x.shape
    E_loc, twoF, _ = w13_local.shape
    E, Fd = E_loc * W, twoF // 2
    idx, g = route(x, w_router, bias, K)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)  # rows by expert, so by destination rank too
    token = order // K
    send_counts = torch.bincount(flat, minlength=E).view(W, E_loc)  # [dest, local expert]
    if W > 1:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source, local expert]
        in_splits = send_counts.sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = dfn.all_to_all_single(x.new_empty(sum(out_splits), H), x[token], out_splits, in_splits, group=group)
    else:
        recv_counts, recv = send_counts, x[token]
    # regroup by local expert; stable, so within an expert: source rank, then token order
    expert_of_row = torch.repeat_interleave(
        torch.arange(E_loc, device=x.device).repeat(W), recv_counts.flatten())
    perm = torch.argsort(expert_of_row, stable=True)
    offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
    a = grouped_mm(recv[perm], w13_local.transpose(1, 2), offs)
    h = F.silu(a[:, :Fd]) * a[:, Fd:]
    o = grouped_mm(h, w2_local.transpose(1, 2), offs)
    o = o[torch.argsort(perm)]  # back to the order the rows arrived in
    if W > 1:
        o = dfn.all_to_all_single(o.new_empty(T * K, H), o, in_splits, out_splits, group=group)
    o = o * g.flatten()[order].unsqueeze(1).to(o.dtype)
    return torch.zeros_like(x).index_add_(0, token, o)
