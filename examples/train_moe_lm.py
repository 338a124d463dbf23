"""Train a small byte-level MoE language model on the Book of Genesis (examples/data)
with mok.MoE as every block's MLP, and get the same loss curve, bit for bit, on one
GPU and on two.

    make python
    python examples/train_moe_lm.py --curve one.json              # 1 GPU (or CPU)
    torchrun --nproc_per_node 2 examples/train_moe_lm.py --curve two.json --compare one.json
    python examples/train_moe_lm.py --moe torch --curve torch.json  # plain-PyTorch MoE
    python examples/train_moe_lm.py --ep 2 --curve ep1.json       # MoE calls of 2 chunks, 1 GPU
    torchrun --nproc_per_node 2 examples/train_moe_lm.py --ep 2 --curve ep2.json --compare ep1.json
                                                   # the experts split over 2 GPUs, same bits

The model: byte embedding -> L x (RMSNorm -> causal attention -> RMSNorm -> MoE with a
shared expert) -> RMSNorm -> head; the MoE is mok.MoE, or with --moe torch the same
layer written in plain PyTorch (softmax top-K router, SwiGLU experts, weighted sum).

Why the curves match: a step's global batch is cut into a fixed number of chunks of
whole sequences (--chunks), the same chunk shapes whatever the number of processes, so
every kernel sees the same problem. Each process runs its contiguous run of chunks, one
forward/backward each, keeping each chunk's gradient as an fp32 partial (mok.MoE adds
into fp32 main_grad buffers); mok.reduce_replicated sums the partials with mok's fixed
binary tree over the chunks, which gives the same bits however the chunks are shared
out; AdamW on fp32 master weights then makes the same update everywhere. torch runs
deterministic algorithms (attention written out, no atomics in the embedding's
backward).

With --ep W the MoE layers are expert-parallel: under torchrun with W processes each
holds experts / W of them (mok.MoE(process_group=...)) and each MoE call takes one
chunk from every process, which mok's kernels send to the experts' GPUs and back. The
curve to compare it with comes from one process with the same --ep: there each MoE
call takes the same W chunks together, and the dense parts run per chunk on their own
copy of the dense weights, so that each chunk's gradient stays a partial. mok gives an
MoE call the same bits on one GPU and on W (D3), and the rest is as above.

The script prints a loss per step, writes the curve (--curve, exact floats) and a PNG
(--png), and with --compare says whether another run's curve is bitwise equal.
"""
import argparse
import copy
import json
import math
import os
import struct
import sys
import time
import zlib

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS: deterministic workspaces
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import mok  # noqa: E402
from train_moe import chunk_partial, my_chunks, optimizer_step, zero_grads  # noqa: E402 (this directory)

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "genesis-kjv.txt")
VOCAB = 128  # the text is ASCII


class TorchMoE(nn.Module):
    """mok.MoE's layer in plain PyTorch (same weights and layouts, same losses): a
    careful user's version, tokens grouped by expert with index_select / index_add_."""

    def __init__(self, H, F, E, K, shared_ffn, aux_loss_coef, z_loss_coef, device):
        super().__init__()
        kw = dict(dtype=torch.bfloat16, device=device)
        self.E, self.K, self.F, self.Fs = E, K, F, shared_ffn
        self.aux_coef, self.z_coef = aux_loss_coef, z_loss_coef
        self.w_router = nn.Parameter(torch.empty(E, H, **kw))
        self.w13 = nn.Parameter(torch.empty(E, 2 * F, H, **kw))
        self.w2 = nn.Parameter(torch.empty(E, H, F, **kw))
        self.ws13 = nn.Parameter(torch.empty(2 * shared_ffn, H, **kw))
        self.ws2 = nn.Parameter(torch.empty(H, shared_ffn, **kw))
        with torch.no_grad():
            for p, fan_in in ((self.w_router, H), (self.w13, H), (self.w2, F), (self.ws13, H), (self.ws2, shared_ffn)):
                p.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    @staticmethod
    def swiglu(x, w13, w2, F):
        a = x @ w13.t()
        return (nn.functional.silu(a[:, :F]) * a[:, F:]) @ w2.t()

    def forward(self, x):
        T = x.shape[0]
        logits = x.float() @ self.w_router.float().t()
        prob = logits.softmax(-1)
        g, idx = prob.topk(self.K, dim=-1)
        g = g / g.sum(-1, keepdim=True)
        y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.E):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                o = self.swiglu(x.index_select(0, tok), self.w13[e], self.w2[e], self.F)
                y.index_add_(0, tok, o.float() * g[tok, slot].unsqueeze(1))
        y = y + self.swiglu(x, self.ws13, self.ws2, self.Fs).float()
        f = (idx.reshape(-1, 1) == torch.arange(self.E, device=x.device)).sum(0).float() / (T * self.K)
        self.aux_loss = self.aux_coef * self.E * (f * prob.mean(0)).sum()
        self.z_loss = self.z_coef * logits.logsumexp(-1).pow(2).mean()
        return y.to(x.dtype)


class Block(nn.Module):
    def __init__(self, args, tokens, device, group=None):
        super().__init__()
        H = args.hidden
        kw = dict(dtype=torch.bfloat16, device=device)
        self.heads = args.heads
        self.norm1 = nn.RMSNorm(H, **kw)
        self.qkv = nn.Linear(H, 3 * H, bias=False, **kw)
        self.proj = nn.Linear(H, H, bias=False, **kw)
        self.norm2 = nn.RMSNorm(H, **kw)
        moe = dict(shared_ffn=args.shared_ffn, aux_loss_coef=1e-2, z_loss_coef=1e-3)
        if args.moe == "mok":
            self.moe = mok.MoE(H, args.ffn, args.experts, args.top_k, wgrad_fp32_accum=True, max_tokens=tokens,
                               process_group=group, device=device, **moe)
        else:
            self.moe = TorchMoE(H, args.ffn, args.experts, args.top_k, device=device, **moe)

    def attention(self, h, seqs):  # causal self-attention, written out (deterministic)
        S, H = h.shape[0] // seqs, h.shape[1]
        q, k, v = self.qkv(h).view(seqs, S, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)).float() / math.sqrt(H // self.heads)
        att = att.masked_fill(torch.ones(S, S, dtype=torch.bool, device=h.device).triu(1), float("-inf"))
        o = att.softmax(-1).to(h.dtype) @ v
        return self.proj(o.permute(0, 2, 1, 3).reshape(seqs * S, H))


class ByteLM(nn.Module):
    def __init__(self, args, tokens, device, group=None):
        super().__init__()
        kw = dict(dtype=torch.bfloat16, device=device)
        self.emb = nn.Embedding(VOCAB, args.hidden, **kw)
        self.blocks = nn.ModuleList(Block(args, tokens, device, group) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden, **kw)
        self.head = nn.Linear(args.hidden, VOCAB, bias=False, **kw)

    def moes(self):
        return [b.moe for b in self.blocks]

    def dense(self):
        """The parameters outside the MoE layers"""
        moe = {id(p) for m in self.moes() for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in moe]


def round_forward(replicas, inputs):
    """One MoE call per layer over several chunks: chunk k ([seqs, S] bytes) runs the
    dense parts on replicas[k] (its own copy of the dense weights, so that its gradient
    stays a chunk partial), and the MoE layers (replicas[0]'s) take the chunks' tokens
    together, in chunk order: what the expert-parallel ranks' call sees, each rank one
    chunk. Returns each chunk's logits [seqs * S, V] and the router losses."""
    seqs = inputs[0].shape[0]
    hs = [r.emb(x.reshape(-1)) for r, x in zip(replicas, inputs)]
    router = torch.zeros((), dtype=torch.float32, device=hs[0].device)
    for i, moe in enumerate(replicas[0].moes()):
        blocks = [r.blocks[i] for r in replicas]
        hs = [h + b.attention(b.norm1(h), seqs) for b, h in zip(blocks, hs)]
        xs = [b.norm2(h) for b, h in zip(blocks, hs)]
        ys = moe(torch.cat(xs)).split([x.shape[0] for x in xs])
        hs = [h + y for h, y in zip(hs, ys)]
        router = router + moe.aux_loss.float() + moe.z_loss.float()
    return [r.head(r.norm(h)) for r, h in zip(replicas, hs)], router


def batch(step, args, data):
    """The global batch of a step (inputs, next bytes): the same on every process."""
    g = torch.Generator().manual_seed(args.seed * 1000003 + step)
    start = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
    rows = torch.stack([data[s : s + args.seq + 1] for s in start.tolist()])
    return rows[:, :-1].long(), rows[:, 1:].long()


def write_png(path, curves, width=640, height=360):
    """A line plot of one or more loss curves (lists of floats) as an 8-bit RGB PNG,
    drawn here so the example needs nothing beyond torch."""
    colors = [(214, 39, 40), (31, 119, 180), (44, 160, 44)]
    img = [[[255, 255, 255] for _ in range(width)] for _ in range(height)]
    lo = min(min(c) for c in curves)
    hi = max(max(c) for c in curves)
    pad = 20

    def xy(i, n, v):
        x = pad + int((width - 2 * pad - 1) * i / max(1, n - 1))
        y = height - pad - 1 - int((height - 2 * pad - 1) * (v - lo) / max(1e-9, hi - lo))
        return x, y

    for x in range(pad, width - pad):  # axes
        img[height - pad][x] = [0, 0, 0]
    for y in range(pad, height - pad + 1):
        img[y][pad - 1] = [0, 0, 0]
    for ci, c in reversed(list(enumerate(curves))):  # the first curve drawn last, on top
        col = list(colors[ci % len(colors)])
        prev = None
        for i, v in enumerate(c):
            p = xy(i, len(c), v)
            if prev:  # a straight segment, one pixel per step of the longer axis
                steps = max(abs(p[0] - prev[0]), abs(p[1] - prev[1]), 1)
                for s in range(steps + 1):
                    x = prev[0] + (p[0] - prev[0]) * s // steps
                    y = prev[1] + (p[1] - prev[1]) * s // steps
                    img[y][x] = col
            prev = p
    raw = b"".join(b"\x00" + bytes(v for px in row for v in px) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--moe", choices=["mok", "torch"], default="mok")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=128, help="bytes per sequence")
    ap.add_argument("--batch", type=int, default=64, help="sequences per global batch")
    ap.add_argument("--chunks", type=int, default=8, help="fixed chunks of sequences per global batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--shared-ffn", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curve", default="", help="write the loss curve (exact floats) to this JSON file")
    ap.add_argument("--compare", default="", help="a curve JSON of another run: say whether it is bitwise equal")
    ap.add_argument("--png", default="", help="write the loss curve (and --compare's) as a PNG")
    ap.add_argument("--torch-threads", type=int, default=1, help="CPU: torch's threads, fixed for the same bits")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert parallelism: each MoE call takes EP chunks at once, one a rank; under torchrun "
                         "with EP processes each MoE layer holds experts / EP of them (mok.MoE(process_group=...)), "
                         "in one process the same calls run on EP chunks together (the curve to compare with)")
    args = ap.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.torch_threads)
    torch.use_deterministic_algorithms(True)
    assert args.batch % args.chunks == 0, "--batch must be a multiple of --chunks"
    G = args.ep
    assert args.chunks % G == 0, "--chunks must be a multiple of --ep"
    ep = distributed and G > 1  # the experts spread over the processes
    assert not ep or (world == G and args.moe == "mok" and args.device == "cuda"), \
        "expert parallelism over processes: --ep = the number of processes, --moe mok, --device cuda"
    seqs = args.batch // args.chunks

    data = torch.frombuffer(bytearray(open(TEXT, "rb").read()), dtype=torch.uint8)
    torch.manual_seed(args.seed)  # the same initial weights on every process (its experts' slice of them)
    calls = 1 if ep else G  # chunks in one MoE call on this process
    model = ByteLM(args, calls * seqs * args.seq, device, dist.group.WORLD if ep else None)
    # rounds: each MoE call takes chunk runs[k][i] of every rank k (runs: my_chunks over
    # G ranks); with G = 1 a round is one chunk of this process's run
    runs = [list(my_chunks(args.chunks, G, k)) for k in range(G)] if G > 1 else [list(my_chunks(args.chunks, world, rank))]
    here = [rank] if ep else range(len(runs))  # the ranks' runs this process computes
    replicas = [model] + [copy.deepcopy(model) for _ in range(len(here) - 1)]
    for r in replicas[1:]:  # the dense weights copied, the MoE layers shared
        for b, b0 in zip(r.blocks, model.blocks):
            b.moe = b0.moe
    dense, moe_params = model.dense(), [p for m in model.moes() for p in m.parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in dense + moe_params]
    opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.0)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        how = f"experts over {world} processes" if ep else f"{world} process(es)"
        print(f"{args.moe} MoE, {n / 1e6:.2f} M parameters on rank 0, {how} on {device.type}, {args.chunks} chunks "
              f"of {seqs} x {args.seq} bytes a step, {G} a MoE call; text {os.path.basename(TEXT)} ({data.numel()} bytes)")

    curve, t0, tokens = [], None, 0
    for step in range(args.steps):
        if step == 5:  # tokens/s after a few warm-up steps
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, tokens = time.time(), 0
        inp, tgt = batch(step, args, data)
        dense_parts, moe_parts, losses = {}, [], {}
        for i in range(len(runs[0])):  # a forward/backward per round
            zero_grads([p for r in replicas for p in r.dense()] + moe_params, model.moes())
            chunks = [runs[k][i] for k in here]
            sl = [slice(c * seqs, (c + 1) * seqs) for c in chunks]
            logits, router = round_forward(replicas, [inp[x].to(device) for x in sl])
            ce = [nn.functional.cross_entropy(lg.float(), tgt[x].reshape(-1).to(device)) for lg, x in zip(logits, sl)]
            ((sum(ce[1:], ce[0]) + router) / args.chunks).backward()
            for c, r, l in zip(chunks, replicas, ce):
                dense_parts[c] = chunk_partial(r.dense())
                losses[c] = l.detach().float().reshape(1)
            moe_parts.append(chunk_partial(moe_params))
        # the fixed trees: dense weights and losses over every chunk (this process's in
        # chunk order, then across processes); the MoE layers over the rounds, across
        # processes only when each holds every expert (ep: mok summed the router and
        # shared expert over the ranks already, and each rank's experts are its own)
        order = sorted(dense_parts)
        width = sum(p.numel() for p in dense)
        g_dense = mok.reduce_replicated(torch.stack([dense_parts[c] for c in order]) if order else
                                        torch.zeros(0, width, device=device))
        g_moe = mok.reduce_replicated(torch.stack(moe_parts), distributed=distributed and not ep)
        loss = mok.reduce_replicated(torch.stack([losses[c] for c in order]) if order else
                                     torch.zeros(0, 1, device=device)) / args.chunks
        optimizer_step(dense + moe_params, master, opt, torch.cat([g_dense, g_moe]))
        with torch.no_grad():  # every replica's dense weights take the new values
            for r in replicas[1:]:
                for p, p0 in zip(r.dense(), dense):
                    p.copy_(p0)
        tokens += args.batch * args.seq
        curve.append(loss.item())
        if rank == 0:
            done = (step + 1) * 30 // args.steps
            print(f"\r[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{args.steps} loss {curve[-1]:.4f}", end="", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = tokens / (time.time() - t0) if t0 else float("nan")
    if rank == 0:
        print()
        for s in range(0, args.steps, max(1, args.steps // 10)):
            print(f"step {s + 1:4d}  loss {curve[s]:.4f}")
        print(f"final loss {curve[-1]:.4f}; {rate:,.0f} tokens/s over all processes (steps 6..{args.steps})")
        if args.curve:
            with open(args.curve, "w") as f:
                json.dump({"moe": args.moe, "world": world, "ep": G, "device": device.type, "tokens_per_s": rate,
                           "loss_hex": [float.hex(v) for v in curve]}, f)
        other = None
        if args.compare:
            with open(args.compare) as f:
                other = json.load(f)
            theirs = [float.fromhex(h) for h in other["loss_hex"]]
            diff = next((i for i, (a, b) in enumerate(zip(curve, theirs)) if a != b), None)
            if len(theirs) != len(curve):
                print(f"{args.compare}: {len(theirs)} steps against {len(curve)}: not comparable")
            elif diff is None:
                print(f"the loss curve is bitwise identical to {args.compare} ({other['world']} process(es), "
                      f"{other['moe']} MoE, --ep {other.get('ep', 1)}): all {len(curve)} steps")
            else:
                print(f"the loss curve differs from {args.compare} from step {diff + 1} on "
                      f"({curve[diff]!r} against {theirs[diff]!r})")
        if args.png:
            curves = [curve] + ([[float.fromhex(h) for h in other["loss_hex"]]] if other else [])
            write_png(args.png, curves)
            print(f"loss curve: {args.png} (x: steps 1..{args.steps}; y: loss {min(map(min, curves)):.3f}.."
                  f"{max(map(max, curves)):.3f}; this run red{', drawn over --compare in blue' if other else ''})")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
