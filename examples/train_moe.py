"""Train a tiny MoE model with mok.MoE on the CPU — alone or data-parallel under torchrun —
with bitwise reproducible results whatever the number of processes.

    make python                                     # builds build/libmok.so
    python examples/train_moe.py                    # one process
    torchrun --nproc_per_node 2 examples/train_moe.py   # two processes (gloo), same bits
    python examples/train_moe.py --compile          # torch.compile(fullgraph=True)

The task: next-token prediction where the next token is a fixed permutation of the
current one 90% of the time (so the loss falls from ln(V) towards ~0.6). The model:
embedding -> L x (RMSNorm -> mok.MoE with a shared expert, residual) -> RMSNorm -> head.

How the bits stay the same on 1, 2 or 4 processes: the global batch of each step is cut
into a fixed number of chunks (--chunks); each process runs its contiguous run of
chunks, one forward/backward per chunk, and keeps every chunk's gradient as an fp32
partial (mok.MoE accumulates into fp32 main_grad buffers: wgrad_fp32_accum=True). The
partials are summed by mok.reduce_replicated, mok's fixed binary tree over the chunks,
which gives the same bits however the chunks are shared out over the processes. The
optimizer (AdamW on fp32 master weights) then runs the same update on every process.
The last line prints a checksum of the weights: compare it across runs.
"""
import argparse
import ctypes
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import mok


class Block(nn.Module):
    def __init__(self, args, max_tokens):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden, dtype=torch.bfloat16)
        self.moe = mok.MoE(
            args.hidden, args.ffn, args.experts, args.top_k,
            shared_ffn=args.shared_ffn,
            aux_loss_coef=1e-2, z_loss_coef=1e-3,
            wgrad_fp32_accum=True,          # fp32 gradients in .main_grad
            max_tokens=max_tokens,
        )

    def forward(self, h):
        return h + self.moe(self.norm(h))


class TinyLM(nn.Module):
    def __init__(self, args, max_tokens):
        super().__init__()
        self.emb = nn.Embedding(args.vocab, args.hidden, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList(Block(args, max_tokens) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden, dtype=torch.bfloat16)
        self.head = nn.Linear(args.hidden, args.vocab, bias=False, dtype=torch.bfloat16)

    def forward(self, tokens):                  # tokens [T] -> logits [T, V], router losses
        h = self.emb(tokens)
        router_loss = torch.zeros((), dtype=torch.float32)
        for b in self.blocks:
            h = b(h)
            router_loss = router_loss + b.moe.aux_loss + b.moe.z_loss
        return self.head(self.norm(h)), router_loss


def batch(step, args, perm):
    """The global batch of a step: the same on every process."""
    g = torch.Generator().manual_seed(args.seed * 1000003 + step)
    cur = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    noise = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    keep = torch.rand(args.tokens, generator=g) < 0.9
    return cur, torch.where(keep, perm[cur], noise)


def my_chunks(num_chunks, world, rank):
    """Rank r's contiguous run of chunks (as even as possible)."""
    base, extra = divmod(num_chunks, world)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (1 if rank < extra else 0))


def zero_grads(params, moes):
    """Before a chunk: no .grad, and the MoE layers' fp32 main_grad buffers zeroed."""
    for p in params:
        p.grad = None
    for m in moes:
        if hasattr(m, "zero_main_grad"):
            m.zero_main_grad()


def chunk_partial(params):
    """This chunk's gradient of every parameter, fp32, as one vector (main_grad where
    the MoE layer keeps it)."""
    return torch.cat([(p.main_grad if hasattr(p, "main_grad") else p.grad.float()).reshape(-1) for p in params])


def reduce_and_step(params, master, opt, partials, losses, num_chunks):
    """The step from this rank's chunk partials and losses: mok.reduce_replicated sums
    every rank's chunks by the fixed tree (the same bits for any split of the chunks),
    AdamW updates the fp32 masters, the model's weights take their values. Returns the
    mean loss over all chunks."""
    dev = params[0].device
    width = sum(p.numel() for p in params)
    grad = mok.reduce_replicated(torch.stack(partials) if partials else torch.zeros(0, width, device=dev))
    loss = mok.reduce_replicated(torch.stack(losses) if losses else torch.zeros(0, 1, device=dev)) / num_chunks
    optimizer_step(params, master, opt, grad)
    return loss


def optimizer_step(params, master, opt, grad):
    """AdamW on the fp32 masters from grad (every parameter's, one vector in params'
    order); the model's weights take the masters' values."""
    at = 0
    for m in master:
        m.grad = grad[at : at + m.numel()].view_as(m)
        at += m.numel()
    opt.step()
    with torch.no_grad():
        for p, m in zip(params, master):
            p.copy_(m)


def checksum(params):
    h = hashlib.sha256()
    for p in params:
        t = p.detach().contiguous().cpu()  # (a CUDA tensor's bytes through host memory)
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return h.hexdigest()[:16]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per global batch")
    ap.add_argument("--chunks", type=int, default=4, help="fixed chunks per global batch; each process runs a contiguous run of them")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--shared-ffn", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True) the model")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch's CPU threads (kept fixed so torch's own GEMMs give the same bits in every run)")
    args = ap.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    assert args.tokens % args.chunks == 0, "--tokens must be a multiple of --chunks"
    torch.set_num_threads(args.torch_threads)
    chunk_tokens = args.tokens // args.chunks

    torch.manual_seed(args.seed)                # same initial weights on every process
    model = TinyLM(args, max_tokens=chunk_tokens)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.0)
    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(args.seed + 1))
    fwd = torch.compile(model, fullgraph=True) if args.compile else model
    mine = my_chunks(args.chunks, world, rank)
    if rank == 0:
        print(f"mok {mok.library_path()}: {world} process(es), {args.chunks} chunks of {chunk_tokens} tokens, "
              f"chunks {list(mine)} on rank 0{', compiled' if args.compile else ''}")

    t0 = time.time()
    for step in range(args.steps):
        cur, nxt = batch(step, args, perm)
        partials, losses = [], []
        for c in mine:                          # one forward/backward per chunk
            zero_grads(params, [b.moe for b in model.blocks])
            sl = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
            logits, router_loss = fwd(cur[sl])
            ce = nn.functional.cross_entropy(logits.float(), nxt[sl])
            ((ce + router_loss) / args.chunks).backward()
            partials.append(chunk_partial(params))
            losses.append(ce.detach().float().reshape(1))
        loss = reduce_and_step(params, master, opt, partials, losses, args.chunks)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            tpe = model.blocks[0].moe.tokens_per_expert.tolist()
            print(f"step {step:4d}  loss {loss.item():.4f}  layer-0 tokens/expert {tpe}")
    if rank == 0:
        print(f"{args.steps} steps in {time.time() - t0:.1f} s; weights checksum {checksum(params)}")
    if distributed:
        dist.barrier()                          # no rank leaves while another still talks
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
