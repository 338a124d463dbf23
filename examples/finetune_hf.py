"""Train a small Qwen3-MoE-style model of Hugging Face transformers on the Book of
Genesis (examples/data), its routed experts run by transformers' own "eager" and
"grouped_mm" implementations and by mok, each twice from the same initial weights:
loss curves, tokens/s, peak GPU memory, and whether the two runs are bitwise equal.

    make python
    python examples/finetune_hf.py                           # one GPU, all four, 100 steps
    python examples/finetune_hf.py --steps 300 --out runs/hf # longer, elsewhere
    python examples/finetune_hf.py --device cpu --steps 2 --layers 1 --batch 2 --seq 32

The implementations (--impls):
  eager       transformers' loop over the experts (index_add_)
  grouped_mm  transformers' grouped GEMM (torch._grouped_mm)
  mok         experts_implementation="mok": transformers' router picks the experts and
              mok's replay mode runs them, forward and backward (`import mok.transformers`)
  mok-fused   mok.transformers.fuse(model): the whole sparse-MoE block (router, experts,
              combine) in mok's fused kernels

The model is made from transformers' Qwen3MoeConfig (random weights, nothing
downloaded): bytes as tokens (the text is ASCII), --layers decoder layers of hidden
size 256, 4 heads (eager attention, written out, so that torch's deterministic mode
covers it), 16 experts of 256, top-4, normalised, transformers' load-balancing loss
(router_aux_loss_coef 0.01, output_router_logits). Weights in bf16 (mok reads the
experts' gate_up_proj and down_proj in place), AdamW on fp32 master copies; every run
of every implementation starts from the same weights and sees the same batches. torch
runs its deterministic algorithms, so that whatever differs between two runs comes
from the experts' implementation.

Writes to --out: results.json (per implementation: both runs' losses as exact floats,
whether they are bitwise equal, the weights' checksums, tokens/s, peak memory) and
loss.png (the curves, with matplotlib; without it the PNG is skipped, with a message).
"""
import argparse
import copy
import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS: deterministic workspaces
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
import transformers  # noqa: E402
import mok  # noqa: E402
import mok.transformers  # noqa: E402  (registers experts_implementation="mok")
from train_moe import checksum, optimizer_step  # noqa: E402 (this directory)

TEXT = os.path.join(HERE, "data", "genesis-kjv.txt")
VOCAB = 128  # the text is ASCII
IMPLS = ("eager", "grouped_mm", "mok", "mok-fused")


def make_model(args):
    """The Qwen3-MoE-style model, float32 on the CPU, from the seed."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01,
        max_position_embeddings=args.seq, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(args.seed)
    return transformers.Qwen3MoeForCausalLM(cfg)


def with_impl(base, impl, device):
    """A copy of the model in bf16 on the device whose experts run by `impl`."""
    model = copy.deepcopy(base).to(device=device, dtype=torch.bfloat16).train()
    if impl == "mok-fused":
        mok.transformers.fuse(model)
    elif impl == "mok":
        mok.transformers.replay(model)
    elif hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:  # (a transformers without the setter)
        model.config._experts_implementation = impl
    return model


def batch(step, args, data):
    """The step's sequences [batch, seq] of bytes (the labels are the inputs:
    transformers shifts them)."""
    g = torch.Generator().manual_seed(args.seed * 1000003 + step)
    start = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=g)
    return torch.stack([data[s : s + args.seq] for s in start.tolist()]).long()


def train(base, impl, args, data, device):
    """One run: the loss of every step (fp32 floats), the final weights' checksum,
    tokens/s over the steps after the fifth, peak memory allocated (bytes, GPU)."""
    model = with_impl(base, impl, device)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=args.lr, weight_decay=0.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, t0, tokens = [], None, 0
    for step in range(args.steps):
        if step == min(5, args.steps - 1):  # timing after a few warm-up steps
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, tokens = time.time(), 0
        ids = batch(step, args, data).to(device)
        for p in params:
            p.grad = None
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for p in params])
        optimizer_step(params, master, opt, grad)
        losses.append(out.loss.detach().float())
        tokens += ids.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = tokens / (time.time() - t0) if t0 is not None else float("nan")
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return [float(v) for v in torch.stack(losses).cpu()], checksum(params), rate, peak


def plot(path, results):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path}")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for impl, r in results.items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=impl, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy + load-balancing)")
    ax.set_title("Qwen3-MoE-style model on Genesis, by experts implementation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curves: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"a comma-separated choice of {', '.join(IMPLS)}")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32, help="sequences a step")
    ap.add_argument("--seq", type=int, default=256, help="bytes a sequence")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="finetune_hf", help="folder for results.json and loss.png")
    ap.add_argument("--torch-threads", type=int, default=1, help="CPU: torch's threads, fixed for the same bits")
    args = ap.parse_args()
    impls = [s for s in args.impls.split(",") if s]
    bad = [s for s in impls if s not in IMPLS]
    if bad:
        ap.error(f"--impls: {', '.join(bad)} not among {', '.join(IMPLS)}")

    device = torch.device(args.device)
    torch.set_num_threads(args.torch_threads)
    # an op with no deterministic version warns (rather than stops the run); the verdict
    # "two runs differ" then tells
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.makedirs(args.out, exist_ok=True)
    data = torch.frombuffer(bytearray(open(TEXT, "rb").read()), dtype=torch.uint8)
    base = make_model(args)
    n = sum(p.numel() for p in base.parameters())
    print(f"Qwen3-MoE-style model, {n / 1e6:.2f} M parameters, {args.layers} layers, 16 experts top-4, bf16 on "
          f"{device}; {args.steps} steps of {args.batch} x {args.seq} bytes of {os.path.basename(TEXT)}; "
          f"transformers {transformers.__version__}, torch {torch.__version__}, mok {mok.__version__}")

    results = {}
    for impl in impls:
        runs = [train(base, impl, args, data, device) for _ in range(2)]
        (la, ca, rate, peak), (lb, cb, rate_b, peak_b) = runs
        same = [float.hex(v) for v in la] == [float.hex(v) for v in lb] and ca == cb
        results[impl] = dict(loss=la, loss_hex=[float.hex(v) for v in la], loss_hex_second=[float.hex(v) for v in lb],
                             weights=[ca, cb], bitwise_equal=same, tokens_per_s=[rate, rate_b],
                             peak_bytes=None if peak is None else max(peak, peak_b))
        mem = "" if peak is None else f", peak {max(peak, peak_b) / 2**20:,.0f} MiB"
        print(f"{impl:>10}: loss {la[0]:.4f} -> {la[-1]:.4f}, {max(rate, rate_b):,.0f} tokens/s{mem}, "
              f"two runs {'bitwise equal' if same else 'DIFFER'}" +
              ("" if same else f" (from step {next((i + 1 for i, (a, b) in enumerate(zip(la, lb)) if a != b), '-')}, "
                               f"weights {ca} against {cb})"))

    print()
    print("| experts | final loss | tokens/s | peak memory | two runs |")
    print("| --- | ---: | ---: | ---: | --- |")
    for impl, r in results.items():
        mem = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:,.0f} MiB"
        print(f"| {impl} | {r['loss'][-1]:.4f} | {max(r['tokens_per_s']):,.0f} | {mem} | "
              f"{'bitwise equal' if r['bitwise_equal'] else 'differ'} |")
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(dict(device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                       transformers=transformers.__version__, torch=torch.__version__, mok=mok.__version__,
                       args=vars(args), results=results), f, indent=1)
    print(f"results: {path}")
    plot(os.path.join(args.out, "loss.png"), results)


if __name__ == "__main__":
    main()
