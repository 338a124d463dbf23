"""mok.MoE: the layer as a torch.nn.Module."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from . import _lib
from ._context import Config
from .ops import moe_forward

# every parameter, in the order of ops.GRAD_ACC_NAMES (wgrad_fp32_accum's main_grads)
_WEIGHTS = ("w_router", "w13", "w2", "ws13", "ws2", "b_router", "b13", "b2", "w_sg")
_EXPERTS = ("w13", "w2", "b13", "b2")  # per expert: a rank holds its own under world_size > 1


class MoE(nn.Module):
    """A mixture-of-experts layer (router, top-K, SwiGLU experts, weighted combine,
    optional shared expert) whose forward and backward run in libmok: deterministic,
    bitwise reproducible, fixed rounding points (see DESIGN.md / docs/).

    Args:
        hidden (H), ffn (F), num_experts (E), top_k (K): the layer.
        score: "softmax" or "sigmoid" router scores.
        normalize: divide the K weights by their sum (before route_scale).
        route_scale: multiplies the weights.
        bias_select: add the `bias_select` buffer [E] (fp32) to the scores for expert
            selection only (aux-loss-free balancing); it gets no gradient.
        aux_loss_coef, z_loss_coef: load-balancing loss and router z-loss; after a
            forward they are `module.aux_loss` and `module.z_loss` (0-dim tensors in the
            autograd graph: add them to your loss).
        shared_ffn (Fs): a shared expert of this ffn size applied to every token; 0 = none.
        n_group, topk_group, group_score: group-limited routing (DeepSeek-V3: 8, 4,
            "top2"; DeepSeek-V2: "max"): the E experts form n_group groups, the
            topk_group best by group_score are kept, and the K experts are chosen among
            theirs. 0 = no groups.
        router_bias: a router logit bias, parameter b_router [E] (fp32), added to the
            logits before the scores (gpt-oss).
        expert_bias: expert biases, parameters b13 [E, 2F] and b2 [E, H] (bf16), added to
            gate|up and to the expert output before their rounding (gpt-oss).
        swiglu_limit, swiglu_alpha: gpt-oss's clamped SwiGLU for the routed experts
            (limit 7, alpha 1.702 there): gate and up clamped at the limit, h = (up + 1)
            gate sigmoid(alpha gate). None = the plain SwiGLU.
        shared_gate: the shared expert's output scaled per token by sigmoid(x . w_sg),
            parameter w_sg [H] (bf16; Qwen2-MoE); needs shared_ffn.
        routing: "fused" (the layer routes) or "replay" (forward(x, topk_idx,
            topk_weight); topk_weight then gets a gradient).
        wgrad_fp32_accum: weight gradients are added into fp32 `main_grad` attributes of
            the weights (Megatron style) instead of .grad; zero them with
            zero_main_grad().
        max_tokens: most tokens per call; None = any (contexts are then made per
            power-of-two token count, each holding buffers for that many tokens).
        exact: EXACT numerics (CPU only): float64 weights and tensors, nothing rounded;
            for torch.autograd.gradcheck.
        num_threads: CPU threads of the layer; 0 = all cores.
        capacity: rows the experts can receive per call; 0 = safe default.
        recompute_gate_up: backward computes every expert row's gate|up (x w13^T) and
            SwiGLU output again instead of the forward keeping them for it: the same
            bits, and the saved tensor 6 F bytes smaller a routed row (6 Fs a token for
            the shared expert).
        reuse_saved: backward writes its own scratch (the gradient rows, d_a) over the
            parts of the saved tensor it has finished reading, so a step needs up to
            4 H + 4 F bytes a routed row less memory, and on one GPU with gate|up kept
            the forward writes the expert outputs over the dispatched token rows (the
            backward puts those back), 2 H bytes a routed row less, and with bf16
            weight gradients keeps no SwiGLU output h (the backward recomputes it from
            gate|up into the w13 gradient's buffer before that gradient is written),
            2 F bytes a routed row less; the same bits. The saved tensor is then used
            up: a second backward through the same forward (retain_graph) first runs
            the forward again into it (the same bits, so the same gradients, at the cost
            of a forward). False keeps it as it is.
        process_group: expert parallelism over this torch.distributed group (NCCL, a
            GPU per rank, CUDA backend): each rank holds experts rank * E / W .. + E / W
            (w13, w2 hold those) and its own tokens; the ranks' NCCL unique id goes
            through the group once, here (a collective: every rank makes its layers in
            the same order). Needs max_tokens, the same on every rank. The router and
            shared-expert gradients come out already summed over the ranks by mok's
            fixed tree, the same bits on every rank: do not all-reduce them again over
            this group.

    Weights (nn.Parameter, bf16 or float64 when exact), initialised as nn.Linear does
    (U(-1/sqrt(in), 1/sqrt(in))): w_router [E, H] (fused routing only), w13 [E, 2F, H]
    (rows 0..F-1 gate, F..2F-1 up), w2 [E, H, F], ws13 [2Fs, H], ws2 [H, Fs]; with the
    variants b_router [E] (fp32), b13 [E, 2F], b2 [E, H], w_sg [H], initialised as the
    biases of the nn.Linear they belong to (and w_sg as the weight of nn.Linear(H, 1)).

    After forward: aux_loss, z_loss, tokens_per_expert (int32 [E]), topk_idx (int32
    [T, K]) and topk_weight ([T, K], detached).
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        num_experts: int,
        top_k: int,
        *,
        score: str = "softmax",
        normalize: bool = True,
        route_scale: float = 1.0,
        bias_select: bool = False,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        shared_ffn: int = 0,
        routing: str = "fused",
        wgrad_fp32_accum: bool = False,
        max_tokens: Optional[int] = None,
        exact: bool = False,
        num_threads: int = 0,
        capacity: int = 0,
        recompute_gate_up: bool = False,
        reuse_saved: bool = True,
        n_group: int = 0,
        topk_group: int = 0,
        group_score: str = "top2",
        router_bias: bool = False,
        expert_bias: bool = False,
        swiglu_limit: Optional[float] = None,
        swiglu_alpha: float = 1.702,
        shared_gate: bool = False,
        process_group=None,
        device=None,
    ):
        super().__init__()
        world_size, rank, comm_id = 1, 0, ""
        if process_group is not None:
            import torch.distributed as dist

            world_size, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
            if world_size > 1:
                box = [_lib.comm_unique_id() if rank == 0 else None]
                dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
                comm_id = box[0]
        cfg = Config(
            hidden=hidden,
            ffn=ffn,
            num_experts=num_experts,
            top_k=top_k,
            score=score,
            normalize=normalize,
            route_scale=route_scale,
            bias_select=bias_select,
            aux_loss_coef=aux_loss_coef,
            z_loss_coef=z_loss_coef,
            shared_ffn=shared_ffn,
            routing=routing,
            wgrad_fp32_accum=wgrad_fp32_accum,
            max_tokens=max_tokens,
            exact=exact,
            num_threads=num_threads,
            capacity=capacity,
            recompute_gate_up=recompute_gate_up,
            reuse_saved=reuse_saved,
            n_group=n_group,
            topk_group=topk_group,
            group_score=group_score,
            router_bias=router_bias,
            expert_bias=expert_bias,
            swiglu_limit=swiglu_limit,
            swiglu_alpha=swiglu_alpha,
            shared_gate=shared_gate,
            world_size=world_size,
            rank=rank,
            comm_id=comm_id,
        )
        self.config = cfg
        H, F, E, Fs = hidden, ffn, num_experts, shared_ffn
        act, real = cfg.param_dtype, cfg.real_dtype
        kw = dict(dtype=act, device=device)
        self.register_parameter("w_router", nn.Parameter(torch.empty(E, H, **kw)) if cfg.fused else None)
        El = cfg.local_experts
        self.w13 = nn.Parameter(torch.empty(El, 2 * F, H, **kw))
        self.w2 = nn.Parameter(torch.empty(El, H, F, **kw))
        self.register_parameter("ws13", nn.Parameter(torch.empty(2 * Fs, H, **kw)) if Fs else None)
        self.register_parameter("ws2", nn.Parameter(torch.empty(H, Fs, **kw)) if Fs else None)
        rk = dict(dtype=real, device=device)
        self.register_parameter("b_router", nn.Parameter(torch.empty(E, **rk)) if cfg.router_bias else None)
        self.register_parameter("b13", nn.Parameter(torch.empty(El, 2 * F, **kw)) if cfg.expert_bias else None)
        self.register_parameter("b2", nn.Parameter(torch.empty(El, H, **kw)) if cfg.expert_bias else None)
        self.register_parameter("w_sg", nn.Parameter(torch.empty(H, **kw)) if cfg.shared_gate else None)
        self._real_params = ["b_router"] if cfg.router_bias else []  # (kept fp32 by .to(dtype), as bias_select)
        self.register_buffer("bias_select", torch.zeros(E, dtype=real, device=device))
        self._real_buffers = ["bias_select"]
        if wgrad_fp32_accum:
            for name in _WEIGHTS:
                p = getattr(self, name)
                if p is not None:
                    self.register_buffer("main_grad_" + name, torch.zeros(p.shape, dtype=real, device=device), persistent=False)
                    self._real_buffers.append("main_grad_" + name)
            self._link_main_grads()
        self.aux_loss: Optional[Tensor] = None
        self.z_loss: Optional[Tensor] = None
        self.tokens_per_expert: Optional[Tensor] = None
        self.topk_idx: Optional[Tensor] = None
        self.topk_weight: Optional[Tensor] = None
        self.reset_parameters()

    # -- parameters --
    def reset_parameters(self):
        """nn.Linear's initialisation of each [out, in] matrix and bias: U(-1/sqrt(in),
        1/sqrt(in)). The experts' tensors are drawn one expert at a time, in expert order,
        through a temporary of one expert's size (fp32, or fp64 with exact): with
        world_size > 1 every rank draws all E experts and keeps its own, so that the same
        seed gives the weights of world_size = 1, without a temporary of all E experts on
        every rank (kimi-k2's w13 alone: 45 GB in fp32)."""
        c = self.config
        fan_ins = {"b_router": c.hidden, "b13": c.hidden, "b2": c.ffn, "w_sg": c.hidden}
        dtype = torch.float64 if c.exact else torch.float32
        first = c.rank * c.local_experts  # (this rank's first expert: 0 at world_size 1)
        with torch.no_grad():
            for name in _WEIGHTS:
                p = getattr(self, name)
                if p is None:
                    continue
                fan_in = fan_ins.get(name, p.shape[-1])
                bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
                if name not in _EXPERTS:
                    p.copy_(nn.init.uniform_(torch.empty(p.shape, dtype=dtype, device=p.device), -bound, bound))
                    continue
                for e in range(c.num_experts):
                    tmp = nn.init.uniform_(torch.empty(p.shape[1:], dtype=dtype, device=p.device), -bound, bound)
                    if first <= e < first + p.shape[0]:
                        p[e - first].copy_(tmp)

    def _link_main_grads(self):
        for name in _WEIGHTS:
            p = getattr(self, name)
            if p is not None and hasattr(self, "main_grad_" + name):
                p.main_grad = getattr(self, "main_grad_" + name)

    def zero_main_grad(self):
        """Zeroes the fp32 main_grad buffers (wgrad_fp32_accum)."""
        for name in _WEIGHTS:
            buf = getattr(self, "main_grad_" + name, None)
            if buf is not None:
                buf.zero_()

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype) / .half() / .bfloat16() convert floating buffers: keep bias_select
        # and main_grad in their fp32 (float64) dtype, moving them to the new device only
        old = {name: getattr(self, name) for name in self._real_buffers}
        old_params = {name: getattr(self, name).dtype for name in self._real_params}
        out = super()._apply(fn, *args, **kwargs)
        for name, before in old.items():
            now = getattr(self, name)
            if now.dtype != before.dtype:
                setattr(self, name, before.to(device=now.device))
        for name, dtype in old_params.items():
            p = getattr(self, name)
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
        self._link_main_grads()
        return out

    # -- forward --
    def forward(self, x: Tensor, topk_idx: Optional[Tensor] = None, topk_weight: Optional[Tensor] = None) -> Tensor:
        cfg = self.config
        main_grads = None
        if cfg.wgrad_fp32_accum:
            main_grads = [getattr(self, "main_grad_" + n) if getattr(self, n) is not None else None for n in _WEIGHTS]
        out = moe_forward(
            x,
            self.w_router,
            self.w13,
            self.w2,
            self.ws13,
            self.ws2,
            config=cfg,
            bias_select=self.bias_select if cfg.bias_select else None,
            topk_idx=topk_idx,
            topk_weight=topk_weight,
            main_grads=main_grads,
            b_router=self.b_router,
            b13=self.b13,
            b2=self.b2,
            w_sg=self.w_sg,
        )
        self.aux_loss = out.aux_loss
        self.z_loss = out.z_loss
        self.tokens_per_expert = out.tokens_per_expert
        self.topk_idx = out.topk_idx
        self.topk_weight = out.topk_weight
        return out.y

    _RESULTS = ("aux_loss", "z_loss", "tokens_per_expert", "topk_idx", "topk_weight")

    def __getstate__(self):
        # the last forward's results are not state (and aux_loss / z_loss are not graph
        # leaves, so they cannot be deep-copied): copies and pickles leave them out
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        state = dict(state)
        for name in self._RESULTS:
            state[name] = None
        return state

    def extra_repr(self) -> str:
        c = self.config
        s = f"hidden={c.hidden}, ffn={c.ffn}, num_experts={c.num_experts}, top_k={c.top_k}, score={c.score!r}"
        if c.shared_ffn:
            s += f", shared_ffn={c.shared_ffn}"
        if c.routing != "fused":
            s += f", routing={c.routing!r}"
        if c.aux_loss_coef:
            s += f", aux_loss_coef={c.aux_loss_coef}"
        if c.z_loss_coef:
            s += f", z_loss_coef={c.z_loss_coef}"
        if c.bias_select:
            s += ", bias_select=True"
        if c.n_group:
            s += f", n_group={c.n_group}, topk_group={c.topk_group}, group_score={c.group_score!r}"
        for flag in ("router_bias", "expert_bias", "shared_gate"):
            if getattr(c, flag):
                s += f", {flag}=True"
        if c.swiglu_limit is not None:
            s += f", swiglu_limit={c.swiglu_limit}, swiglu_alpha={c.swiglu_alpha}"
        if c.wgrad_fp32_accum:
            s += ", wgrad_fp32_accum=True"
        if c.exact:
            s += ", exact=True"
        return s
