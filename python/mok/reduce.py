"""mok.reduce_replicated: mok's fixed-order sum of replicated gradients, for any of a
model's replicated parameters (the layer uses it for its router and shared expert).

The sum over chunks is the binary tree fixed by the number of chunks N:
node [lo, hi) = node [lo, mid) + node [mid, hi), mid = lo + the largest power of two
below hi - lo (the pairwise tree), in fp32 (mok.h, mok_reduce_tree). The bits depend on
N and the partials only.

Under torch.distributed, each rank holds a contiguous run of the chunks (rank 0 the
first ones, then rank 1, ...). Each rank sums the maximal subtrees of the global tree
that lie inside its own run (libmok), the ranks exchange those subtree sums
(all_gather), and every rank combines them by the same tree. Whatever the split of the
N chunks over the ranks, the result is bitwise the single-process sum over all N
chunks: that is what makes replicated gradients independent of the number of ranks.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _lib


def _tree_mid(lo: int, hi: int) -> int:
    """Where node [lo, hi) splits: lo + the largest power of two below hi - lo (the
    pairwise tree; mok.h, mok_reduce_tree). tests/test_binding.py checks that this is
    the library's tree."""
    half = 1
    while 2 * half < hi - lo:
        half *= 2
    return lo + half


def _reduce_pairwise(partials: Tensor) -> Tensor:
    """The same tree on any device with torch ops, level by level: node i of level l+1
    = node 2i + node 2i+1 of level l (one fp32 add per element), a lone last node
    passed up. tests check it against mok_reduce_tree bit for bit."""
    p = partials
    if p.shape[0] == 0:
        return torch.zeros(p.shape[1], dtype=torch.float32, device=p.device)
    while p.shape[0] > 1:
        half = p.shape[0] // 2
        s = p[0 : 2 * half : 2] + p[1 : 2 * half : 2]
        p = torch.cat([s, p[2 * half :]]) if p.shape[0] % 2 else s
    return p[0].clone()


def _reduce_local(partials: Tensor) -> Tensor:
    """The tree over partials [N, n] (fp32) -> [n]: mok_reduce_tree for host tensors,
    the same tree in torch ops on a GPU."""
    if partials.device.type != "cpu":
        return _reduce_pairwise(partials)
    N, n = partials.shape
    p = partials.contiguous()
    out = torch.empty(n, dtype=torch.float32)
    s = _lib.lib().mok_reduce_tree(p.data_ptr() if N else None, N, n, out.data_ptr())
    _lib.check(s, "mok_reduce_tree")
    return out


def _check_partials(partials) -> Tuple[Tensor, Tuple[int, ...]]:
    if not isinstance(partials, Tensor):
        raise TypeError(f"mok: partials must be a torch.Tensor, got {type(partials).__name__}")
    if partials.dim() < 1:
        raise ValueError("mok: partials must be [num_chunks, ...]: one partial per chunk along dim 0")
    if partials.dtype != torch.float32:
        raise TypeError(f"mok: partials has dtype {partials.dtype}, expected torch.float32")
    shape = tuple(partials.shape[1:])
    n = 1
    for d in shape:
        n *= d
    return partials.detach().reshape(partials.shape[0], n), shape


def _owner(chunk_lo: List[int], lo: int, hi: int) -> int:
    for r in range(len(chunk_lo) - 1):
        if chunk_lo[r] <= lo and hi <= chunk_lo[r + 1]:
            return r
    return -1


def _rank_nodes(chunk_lo: List[int], r: int, lo: int, hi: int, out: List[Tuple[int, int]]):
    """The maximal nodes of the tree over [lo, hi) that lie inside rank r's chunks,
    left to right."""
    mine_lo, mine_hi = chunk_lo[r], chunk_lo[r + 1]
    if hi <= lo or hi <= mine_lo or lo >= mine_hi:
        return
    if mine_lo <= lo and hi <= mine_hi:
        out.append((lo, hi))
        return
    mid = _tree_mid(lo, hi)
    _rank_nodes(chunk_lo, r, lo, mid, out)
    _rank_nodes(chunk_lo, r, mid, hi, out)


def reduce_replicated(partials: Tensor, *, group=None, distributed: Optional[bool] = None) -> Tensor:
    """The fixed binary-tree sum of fp32 partials over their leading (chunk) dimension.

    Single process: partials [num_chunks, *shape] -> [*shape], the sum by the tree fixed
    by num_chunks (mok_reduce_tree).

    Distributed (torch.distributed initialised with more than one rank in `group`, or
    distributed=True): each rank passes the partials of its own contiguous run of chunks
    ([n_r, *shape]; rank 0 holds chunks 0..n_0-1, rank 1 the next n_1, and so on; n_r
    may differ between ranks and may be 0), and every rank gets the sum over all
    N = sum n_r chunks, bitwise what one process would get from all N chunks in order.
    Every rank must call it (it is collective) with the same *shape. There is no
    alignment rule on n_r: the ranks' runs need not line up with the tree's nodes (a
    rank whose run straddles a node sends its pieces, and the node is formed from
    them by the same tree); only the order of the chunks (rank-major) and N fix the
    bits. The exchange runs on the partials' device: CPU tensors need a backend that
    takes them (gloo), CUDA tensors NCCL. On a GPU the tree is evaluated level by level
    with torch ops, the same bits as mok_reduce_tree on the host.
    """
    flat, shape = _check_partials(partials)
    if distributed is None:
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed:
        return _reduce_local(flat).reshape(shape)

    import torch.distributed as dist

    W = dist.get_world_size(group)
    me = dist.get_rank(group)
    n = flat.shape[1]
    # 1. every rank's chunk count -> the global chunk list
    dev = flat.device
    counts = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(W)]
    dist.all_gather(counts, torch.tensor([flat.shape[0], n], dtype=torch.int64, device=dev), group=group)
    if any(int(c[1]) != n for c in counts):
        raise ValueError(
            "mok: reduce_replicated: the ranks passed partials of different sizes per chunk: "
            + ", ".join(f"rank {r}: {int(c[1])}" for r, c in enumerate(counts))
        )
    chunk_lo = [0]
    for c in counts:
        chunk_lo.append(chunk_lo[-1] + int(c[0]))
    N = chunk_lo[-1]
    if N == 0:
        return torch.zeros(shape, dtype=torch.float32, device=dev)
    # 2. every rank's maximal subtrees (known to all ranks from the counts)
    nodes: List[List[Tuple[int, int]]] = []
    for r in range(W):
        lst: List[Tuple[int, int]] = []
        _rank_nodes(chunk_lo, r, 0, N, lst)
        nodes.append(lst)
    max_nodes = max(len(l) for l in nodes)
    mine = torch.zeros(max_nodes, n, dtype=torch.float32, device=dev)
    for i, (lo, hi) in enumerate(nodes[me]):
        mine[i] = _reduce_local(flat[lo - chunk_lo[me] : hi - chunk_lo[me]])
    # 3. exchange the subtree sums, 4. combine them by the same tree
    gathered = [torch.empty_like(mine) for _ in range(W)]
    dist.all_gather(gathered, mine, group=group)
    where = {}
    for r in range(W):
        for i, node in enumerate(nodes[r]):
            where[node] = gathered[r][i]

    def combine(lo: int, hi: int) -> Tensor:
        if _owner(chunk_lo, lo, hi) >= 0:
            return where[(lo, hi)]
        mid = _tree_mid(lo, hi)
        return torch.add(combine(lo, mid), combine(mid, hi))  # one fp32 add per element

    return combine(0, N).clone().reshape(shape)
