"""mok inside Hugging Face transformers (5.x): the routed experts, or the whole sparse-MoE
block, run in libmok. Importing this module needs transformers; `import mok` does not
import it.

    import mok.transformers                     # registers experts_implementation="mok"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok")
    # or, the router (and the shared expert) inside mok too:
    names = mok.transformers.fuse(model)

Two paths:

- Replay (`experts_implementation="mok"`, or `model.set_experts_implementation("mok")`):
  transformers' router picks the experts; every routed-experts module then runs through
  mok's replay mode (mok::moe_forward with topk_idx / topk_weight), forward and
  backward, on the module's own parameters. `replay(model, **options)` sets that
  implementation and mok's options (max_tokens, threads, expert parallelism, ...) on
  every experts module. It runs the experts of Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
  DeepSeek-V2, DeepSeek-V3 and gpt-oss (its expert biases as mok's b13 / b2, its gate
  function as mok's clamped SwiGLU with the module's limit and alpha); routers and
  shared experts stay in torch.
- Fused (`fuse(model, **options)`): each block of FUSED_FAMILIES (Qwen3-MoE, Mixtral,
  OLMoE, Qwen2-MoE, DeepSeek-V2, DeepSeek-V3, gpt-oss) becomes a MokSparseMoeBlock that
  runs routing, experts, shared expert and combine in mok's fused mode. The block keeps the
  submodules it had (the same objects, so parameters, state_dict keys and
  output-recording hooks stay), and when the model collects router logits
  (output_router_logits) it calls its router module for them, so that transformers
  computes the model-level load-balancing loss from them exactly as it does for its
  own blocks (see fuse's docstring, which also gives each family's routing rule).

Layouts and their cost. mok's expert weights are w13 [E, 2F, H] (gate rows first) and
w2 [E, H, F], bf16: the layout of Qwen3-MoE's, Mixtral's, OLMoE's, Qwen2-MoE's and
DeepSeek-V2's and V3's gate_up_proj and down_proj, which mok then reads in place (no
copy) when the model is bf16. What differs is converted on every call, through autograd (the
gradients come back in the module's layout and dtype):
  - a float32 module: its weights and activations are rounded to bf16 (a copy of each
    expert weight, 2 bytes a parameter, every forward; its gradient is mok's bf16 one);
  - is_transposed (gate_up_proj [E, H, 2F], down_proj [E, F, H]): a transposed copy;
  - not is_concatenated (gate and up rows interleaved): a reordered copy, and of
    gate_up_proj_bias the same reordering (gpt-oss is both transposed and interleaved);
  - fused shared experts: [gate_proj; up_proj] concatenated (a copy of 2 Fs H).
float16 and other dtypes are refused (mok's numerics are bf16 with fp32 accumulation).
gpt-oss's clamp is a step in the gradient: a gate or up entry that bf16 rounding (of x,
of gate|up) moves across swiglu_limit gains or loses its whole gradient term, so mok's
gradients differ from a float32 model's more where many entries lie near the limit.

What mok lacks raises UnsupportedModuleError (a NotImplementedError) naming the module
and the feature, never a fallback to another implementation: a custom gate function
(_apply_gate) other than gpt-oss's, post-expert norms, ungated experts, an activation
other than SiLU (routed or shared experts), biases in a shared expert or its gate,
transformers' own tensor/expert parallelism (DTensor parameters), and in fuse() any
family not in FUSED_FAMILIES, a DeepSeek-V2 router whose topk_method mok lacks (or
whose K exceeds its kept groups' experts), and a configuration that libmok's backend on
the block's device refuses.

Expert parallelism: with process_group= (a NCCL group, a GPU per rank, max_tokens
required), replay() and fuse() keep on each rank only its E / W experts (rank r:
experts r E / W .. (r + 1) E / W - 1, the gate_up_proj / down_proj parameters replaced
by that slice: same keys, smaller shapes) and mok sends each token to its experts' rank
inside the kernels. Each rank passes its own tokens. The parameters outside the experts
are replicated: in the replay path their gradients are this rank's (all-reduce them as
in data parallelism); in the fused path the gradients of the router (weight and bias)
and of the shared expert and its gate come out of mok already summed over the ranks
(mok's fixed tree), so they must not be all-reduced again over that group.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn

import transformers  # noqa: F401  (ImportError here when transformers is not installed)
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface

from . import _lib
from ._context import Config, Context

try:  # transformers 5.x; the gate function that a module without its own gets
    from transformers.integrations.moe import _default_apply_gate
except ImportError:  # pragma: no cover
    _default_apply_gate = None

try:  # gpt-oss's experts: their gate function is mok's clamped SwiGLU
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as _GptOssExperts
except ImportError:  # pragma: no cover
    _GptOssExperts = None

try:  # the collector of capture_outputs (output_router_logits, ...), 5.x
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover
    _active_collector = None

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()

__all__ = ["fuse", "replay", "router_losses", "MokSparseMoeBlock", "UnsupportedModuleError", "FUSED_FAMILIES"]

IMPLEMENTATION = "mok"

# the options of mok's layer that the two paths take (mok.MoE's meaning); process_group
# is taken apart (it becomes world_size, rank and comm_id)
_REPLAY_OPTIONS = ("max_tokens", "num_threads", "capacity", "recompute_gate_up", "reuse_saved")
_FUSED_OPTIONS = _REPLAY_OPTIONS + ("aux_loss_coef", "z_loss_coef")


class UnsupportedModuleError(NotImplementedError):
    """A module of the model needs something that mok does not have (yet)."""


def _name(module: nn.Module) -> str:
    where = getattr(module, "_mok_name", "")
    return f"{where} ({type(module).__name__})" if where else type(module).__name__


def _refuse(module: nn.Module, feature: str):
    raise UnsupportedModuleError(f"mok: {_name(module)} has {feature}, which mok does not support")


# ---- the experts module ---------------------------------------------------------------


def _is_experts(module: nn.Module) -> bool:
    """A routed-experts module of transformers (@use_experts_implementation)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "is_concatenated")


def _gate_variant(module: nn.Module) -> dict:
    """mok's activation for the module's gate function, as Config fields: {} for
    silu(gate) * up (the default _apply_gate with a SiLU act_fn), gpt-oss's clamped
    SwiGLU (GptOssExperts._apply_gate) as swiglu_limit / swiglu_alpha from the module's
    limit and alpha. Raises UnsupportedModuleError for any other."""
    own_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if _default_apply_gate is None or own_gate is _default_apply_gate:
        act = getattr(module, "act_fn", None)
        if type(act) not in (SiLUActivation, nn.SiLU):
            _refuse(module, f"the activation {type(act).__name__}: mok's experts compute silu(gate) * up (SwiGLU)")
        return {}
    if _GptOssExperts is not None and own_gate is _GptOssExperts._apply_gate:
        limit, alpha = getattr(module, "limit", None), getattr(module, "alpha", None)
        for name, v in (("limit", limit), ("alpha", alpha)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                _refuse(module, f"a clamped SwiGLU with {name} = {v!r}: mok's takes a finite limit and alpha > 0")
        return dict(swiglu_limit=float(limit), swiglu_alpha=float(alpha))
    _refuse(module, "its own gate function (_apply_gate): mok computes silu(gate) * up, or gpt-oss's clamped "
                    "SwiGLU (GptOssExperts._apply_gate)")


def _check_experts(module: nn.Module) -> dict:
    """Raises UnsupportedModuleError for what mok's experts cannot run; returns the
    experts' variants as Config fields (expert_bias, swiglu_limit, swiglu_alpha)."""
    if not module.has_gate:
        _refuse(module, "experts without a gate projection (has_gate=False): mok's experts are gated (SwiGLU)")
    variants = {}
    if module.has_bias:
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if not isinstance(getattr(module, name, None), Tensor):
                _refuse(module, f"expert biases (has_bias) without a {name} tensor")
        variants["expert_bias"] = True
    if getattr(module, "has_post_expert_norm", False):
        _refuse(module, "a norm after each expert (has_post_expert_norm)")
    variants.update(_gate_variant(module))
    if getattr(module, "_is_expert_parallel", False) or any(isinstance(p, DTensor) for p in module.parameters()):
        _refuse(module, "transformers' own tensor or expert parallelism (a tp_plan / distributed_config: DTensor "
                        "or sharded experts); mok shards the experts itself: replay(model, process_group=...) "
                        "or fuse(model, process_group=...)")
    dtype = module.gate_up_proj.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        _refuse(module, f"weights of dtype {dtype}: mok runs bf16 (fp32 accumulation) and takes bfloat16 or "
                        "float32 modules (float32 is rounded to bf16 on every call)")
    return variants


def _expert_shapes(module: nn.Module) -> Tuple[int, int, int]:
    """(H, F, E_local) from the module's gate_up_proj."""
    w = module.gate_up_proj
    if module.is_transposed:  # [E, H, 2F]
        return int(w.shape[1]), int(w.shape[2]) // 2, int(w.shape[0])
    return int(w.shape[2]), int(w.shape[1]) // 2, int(w.shape[0])  # [E, 2F, H]


def _expert_weights(module: nn.Module) -> Tuple[Tensor, Tensor]:
    """The module's experts as mok's w13 [E, 2F, H] and w2 [E, H, F], bf16: the
    parameters themselves when they are bf16 in mok's layout, else converted copies
    (through autograd, so that the gradients reach the parameters)."""
    w13, w2 = module.gate_up_proj, module.down_proj
    if module.is_transposed:  # [E, H, 2F], [E, F, H]
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    if not module.is_concatenated:
        w13 = _gate_rows_first(w13)
    return w13.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous()


def _gate_rows_first(t: Tensor) -> Tensor:
    """[E, 2F, ...] interleaved (gate_0, up_0, gate_1, up_1, ...) -> gate rows, then up
    rows (a copy, through autograd)."""
    return t.unflatten(1, (t.shape[1] // 2, 2)).transpose(1, 2).flatten(1, 2)


def _expert_biases(module: nn.Module) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The module's expert biases as mok's b13 [E, 2F] (gate entries first, reordered as
    the gate_up rows are) and b2 [E, H], bf16; (None, None) without has_bias."""
    if not module.has_bias:
        return None, None
    b13, b2 = module.gate_up_proj_bias, module.down_proj_bias
    if not module.is_concatenated:
        b13 = _gate_rows_first(b13)
    return b13.to(torch.bfloat16).contiguous(), b2.to(torch.bfloat16).contiguous()


_NO_OPTIONS: dict = {}


def _options_of(module: nn.Module) -> Tuple[str, dict]:
    """The mok options replay() set on an experts module: as a canonical string (part of
    its config key) and as a dict (read by traced code, which cannot parse the string)."""
    return getattr(module, "_mok_options", "{}"), getattr(module, "_mok_options_dict", _NO_OPTIONS)


@torch.compiler.assume_constant_result
def _replay_key(H: int, F: int, E: int, K: int, options: str, expert_bias: bool, swiglu_limit: Optional[float],
                swiglu_alpha: float) -> str:
    """The mok config key of a replay call (a constant to torch.compile: the config is
    made here, outside the traced code)."""
    return _replay_config(H, F, E, K, options, expert_bias, swiglu_limit, swiglu_alpha).key()


_configs: Dict[tuple, Config] = {}


def _replay_config(H: int, F: int, E: int, K: int, options: str, expert_bias: bool = False,
                   swiglu_limit: Optional[float] = None, swiglu_alpha: float = 1.702) -> Config:
    key = (H, F, E, K, options, expert_bias, swiglu_limit, swiglu_alpha)
    cfg = _configs.get(key)
    if cfg is None:
        cfg = Config(hidden=H, ffn=F, num_experts=E, top_k=K, routing="replay", expert_bias=expert_bias,
                     swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha, **json.loads(options))
        _configs[key] = cfg
    return cfg


def _variant_args(variants: dict) -> Tuple[bool, Optional[float], float]:
    """The experts' variants (_check_experts) as _replay_config's last three arguments."""
    return (variants.get("expert_bias", False), variants.get("swiglu_limit"),
            variants.get("swiglu_alpha", Config.swiglu_alpha))


def _check_tokens(module: nn.Module, x: Tensor, options: dict):
    T = x.shape[0]
    max_tokens = options.get("max_tokens")
    if max_tokens is not None and T > max_tokens:
        raise ValueError(f"mok: {_name(module)} got {T} tokens, more than its max_tokens = {max_tokens}")
    if options.get("world_size", 1) > 1 and x.device.type != "cuda":
        raise ValueError(f"mok: {_name(module)} is expert-parallel over {options['world_size']} ranks, which runs "
                         f"on the CUDA backend, but its tokens are on {x.device}")


def mok_experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The ExpertsInterface function "mok": hidden_states [T, H], top_k_index [T, K]
    (int64, global expert ids), top_k_weights [T, K] -> [T, H] in hidden_states' dtype,
    through mok's replay mode. top_k_weights gets mok's d_topk_weight as its gradient;
    expert biases (gate_up_proj_bias, down_proj_bias) are mok's b13, b2 and gpt-oss's
    gate function its clamped SwiGLU."""
    variants = _check_experts(self)
    H, F, E_local = _expert_shapes(self)
    options, opts = _options_of(self)
    E = E_local * opts.get("world_size", 1)
    K = int(top_k_index.shape[-1])
    _check_tokens(self, hidden_states, opts)
    key = _replay_key(H, F, E, K, options, *_variant_args(variants))
    w13, w2 = _expert_weights(self)
    b13, b2 = _expert_biases(self)
    # HF's router indices are in [0, E) (mok refuses any other: INDEX_OUT_OF_RANGE), so
    # the narrowing to mok's int32 is exact
    idx = top_k_index.to(torch.int32)
    wt = top_k_weights.to(torch.float32)
    y = torch.ops.mok.moe_forward(
        hidden_states.to(torch.bfloat16), None, None, w13, w2, None, None, idx, wt, [], key, None, b13, b2, None
    )[0]
    return y.to(hidden_states.dtype)


ExpertsInterface.register(IMPLEMENTATION, mok_experts_forward)


# ---- options and expert parallelism ---------------------------------------------------


def _group_options(process_group, modules: List[nn.Module]) -> List[dict]:
    """world_size / rank / a fresh NCCL unique id per module (one collective per module,
    in the model's module order: every rank must call with the same model)."""
    if process_group is None:
        return [{} for _ in modules]
    import torch.distributed as dist

    W, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    if W == 1:
        return [{} for _ in modules]
    src = dist.get_global_rank(process_group, 0)
    ids = [_lib.comm_unique_id() if rank == 0 else None for _ in modules]
    dist.broadcast_object_list(ids, src=src, group=process_group)
    return [dict(world_size=W, rank=rank, comm_id=i) for i in ids]


def _shard(module: nn.Module, world_size: int, rank: int):
    """Keeps only this rank's E / W experts in gate_up_proj and down_proj (and their
    biases: new parameters, the same names)."""
    E = int(module.gate_up_proj.shape[0])
    if E % world_size:
        raise ValueError(f"mok: {_name(module)} has {E} experts, not a multiple of the {world_size} ranks")
    El = E // world_size
    biases = ("gate_up_proj_bias", "down_proj_bias") if module.has_bias else ()
    for name in ("gate_up_proj", "down_proj") + biases:
        p = getattr(module, name)
        mine = p.detach()[rank * El:(rank + 1) * El].clone()
        setattr(module, name, nn.Parameter(mine, requires_grad=p.requires_grad))


def _take_options(options: dict, allowed: Tuple[str, ...], what: str) -> Tuple[dict, object]:
    options = dict(options)
    group = options.pop("process_group", None)
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise TypeError(f"mok: {what} takes the options {', '.join(allowed)} and process_group; not {', '.join(bad)}")
    if group is not None and options.get("max_tokens") is None:
        raise ValueError(f"mok: {what} with process_group needs max_tokens (every rank's buffers are sized alike)")
    return options, group


def replay(model: nn.Module, **mok_options) -> List[str]:
    """Runs every routed-experts module of `model` through mok's replay path: sets the
    model's experts_implementation to "mok" and these options of mok's layer on each
    module (max_tokens, num_threads, capacity, recompute_gate_up, reuse_saved; see
    mok.MoE). process_group= shards the experts over a NCCL group (module docstring).
    Experts inside blocks that fuse() replaced are left to those blocks. Returns the
    names of the experts modules. Raises UnsupportedModuleError, before changing
    anything, when one of them needs what mok lacks."""
    options, group = _take_options(mok_options, _REPLAY_OPTIONS, "replay()")
    found = [(n, m) for n, m in model.named_modules() if _is_experts(m) and not getattr(m, "_mok_fused", False)]
    variants = []
    for n, m in found:
        m._mok_name = n
        variants.append(_check_experts(m))
    for (n, m), v, g in zip(found, variants, _group_options(group, [m for _, m in found])):
        H, F, E = _expert_shapes(m)
        opts = dict(options, **g)
        _replay_config(H, F, E, 1, json.dumps(opts, sort_keys=True), *_variant_args(v))  # the options' errors, now
        if g:
            _shard(m, g["world_size"], g["rank"])
        m._mok_options = json.dumps(opts, sort_keys=True)
        m._mok_options_dict = opts
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(IMPLEMENTATION)
    else:
        model.config._experts_implementation = IMPLEMENTATION
    return [n for n, _ in found]


# ---- the fused block ------------------------------------------------------------------


def _router_logits_wanted() -> bool:
    """Whether the model's forward collects router logits now (output_router_logits).
    Where this transformers has no collector that can be read, always."""
    if _active_collector is None:
        return True
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class MokSparseMoeBlock(nn.Module):
    """A sparse-MoE block (router + routed experts, and the family's shared expert) run
    in mok's fused mode: routing (the family's rule: softmax or sigmoid scores, group
    limits, a logit bias or a selection bias, top-K with ties to the lower expert,
    normalisation, scaling), the experts (SwiGLU or gpt-oss's clamped one, with their
    biases), the shared expert (and its sigmoid gate) and the weighted combine in one
    forward and one backward of libmok.

    Holds the block's own submodules under their names (router `gate`, or `router` in
    gpt-oss; `experts`; `shared_expert(s)`, `shared_expert_gate`), so its parameters
    and state_dict keys are the block's: e.g. gate.weight [E, H],
    experts.gate_up_proj [E, 2F, H] (E / W of them under expert parallelism),
    experts.down_proj [E, H, F]. Its forward returns what the block's did: gpt-oss's
    (hidden states, router scores [T, K]), the others' hidden states.

    After a forward: aux_loss and z_loss (mok's own per-block losses, 0 unless fuse() was
    given aux_loss_coef / z_loss_coef; router_losses(model) sums them), tokens_per_expert
    (int32 [E]), topk_idx (int32 [T, K]) and topk_weight (fp32 [T, K]).
    """

    def __init__(self, block: nn.Module, family: "_Family", config: Config, jitter_noise: float = 0.0):
        super().__init__()
        for name, child in block.named_children():  # (the block's order: its state_dict keys' order)
            self.add_module(name, child)
        self.family = family.name
        self.config = config
        self.jitter_noise = float(jitter_noise)
        self._router_name = family.router
        self._shared_name = family.shared
        self._shared_gate_name = family.shared_gate
        self._returns_scores = family.returns_scores
        self.experts._mok_fused = True
        self.aux_loss: Optional[Tensor] = None
        self.z_loss: Optional[Tensor] = None
        self.tokens_per_expert: Optional[Tensor] = None
        self.topk_idx: Optional[Tensor] = None
        self.topk_weight: Optional[Tensor] = None

    def _shared_weights(self) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """ws13 [2Fs, H] (gate_proj's rows, then up_proj's), ws2 [H, Fs] and w_sg [H],
        bf16 copies through autograd; None where the block has none."""
        cfg = self.config
        if not cfg.shared_ffn:
            return None, None, None
        mlp = getattr(self, self._shared_name)
        ws13 = torch.cat([mlp.gate_proj.weight.to(torch.bfloat16), mlp.up_proj.weight.to(torch.bfloat16)])
        ws2 = mlp.down_proj.weight.to(torch.bfloat16).contiguous()
        w_sg = None
        if cfg.shared_gate:
            w_sg = getattr(self, self._shared_gate_name).weight.reshape(cfg.hidden).to(torch.bfloat16).contiguous()
        return ws13, ws2, w_sg

    def forward(self, hidden_states: Tensor):
        cfg = self.config
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, cfg.hidden)
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, on router and experts alike
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        T = x.shape[0]
        if cfg.max_tokens is not None and T > cfg.max_tokens:
            raise ValueError(f"mok: {_name(self)} got {T} tokens, more than its max_tokens = {cfg.max_tokens}")
        if cfg.world_size > 1 and x.device.type != "cuda":
            raise ValueError(f"mok: {_name(self)} is expert-parallel over {cfg.world_size} ranks, which runs on "
                             f"the CUDA backend, but its tokens are on {x.device}")
        router = getattr(self, self._router_name)
        w13, w2 = _expert_weights(self.experts)
        b13, b2 = _expert_biases(self.experts)
        w_router = router.weight.to(torch.bfloat16)
        # DeepSeek-V3's e_score_correction_bias: a buffer, for selection only (no gradient)
        bias_select = router.e_score_correction_bias.detach().to(torch.float32) if cfg.bias_select else None
        b_router = router.bias.to(torch.float32) if cfg.router_bias else None  # gpt-oss's logit bias
        ws13, ws2, w_sg = self._shared_weights()
        y, aux, z, tpe, idx, wt, _saved = torch.ops.mok.moe_forward(
            x.to(torch.bfloat16), w_router, bias_select, w13, w2, ws13, ws2, None, None, [], cfg.key(),
            b_router, b13, b2, w_sg
        )
        self.aux_loss, self.z_loss, self.tokens_per_expert = aux, z, tpe
        self.topk_idx, self.topk_weight = idx, wt.detach()
        if _router_logits_wanted():
            # the model collects router logits (for its load-balancing loss): the block's
            # router module computes them, and the model's recording hook on it takes
            # them, as for transformers' own block; its choice of experts is not used
            router(x)
        y = y.to(hidden_states.dtype).reshape(shape)
        if self._returns_scores:  # gpt-oss's block: (hidden states, router scores); mok's weights, detached
            return y, self.topk_weight.to(hidden_states.dtype)
        return y

    def extra_repr(self) -> str:
        c = self.config
        s = f"family={self.family!r}, hidden={c.hidden}, ffn={c.ffn}, num_experts={c.num_experts}, top_k={c.top_k}"
        s += f", score={c.score!r}, normalize={c.normalize}"
        if c.route_scale != 1.0:
            s += f", route_scale={c.route_scale}"
        if c.n_group:
            s += f", n_group={c.n_group}, topk_group={c.topk_group}, group_score={c.group_score!r}"
        if c.shared_ffn:
            s += f", shared_ffn={c.shared_ffn}"
        for flag in ("bias_select", "router_bias", "expert_bias", "shared_gate"):
            if getattr(c, flag):
                s += f", {flag}=True"
        if c.swiglu_limit is not None:
            s += f", swiglu_limit={c.swiglu_limit}, swiglu_alpha={c.swiglu_alpha}"
        if c.world_size > 1:
            s += f", world_size={c.world_size}, rank={c.rank}"
        return s

    _RESULTS = ("aux_loss", "z_loss", "tokens_per_expert", "topk_idx", "topk_weight")

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self._RESULTS:
            state[name] = None
        return state


class _Family(NamedTuple):
    """How fuse() reads a family's block."""

    name: str
    router: str  # the block's router module: weight [E, H] (and top_k, ...)
    routing: Callable[[nn.Module], dict]  # the block -> the Config fields of its routing rule
    shared: str = ""  # the block's shared-expert MLP (gate_proj, up_proj, down_proj; SiLU), if any
    shared_gate: str = ""  # its gate, nn.Linear(H, 1, bias=False): y += sigmoid(x . w) * shared(x)
    returns_scores: bool = False  # the block returns (hidden states, router scores)
    jitter: str = ""  # the block's router jitter attribute (Mixtral)


def _top_k_normalized(block: nn.Module) -> dict:
    """softmax over the E logits, top-K, divided by their sum per norm_topk_prob
    (Qwen3-MoE, OLMoE, Qwen2-MoE)."""
    return dict(top_k=int(block.gate.top_k), normalize=bool(block.gate.norm_topk_prob))


def _deepseek_v3_routing(block: nn.Module) -> dict:
    """sigmoid scores; the selection keys scores + e_score_correction_bias; the best
    topk_group of n_group groups by the sum of each group's two largest keys; top-K
    keys among theirs; the weights the scores, divided by their sum (+1e-20, below fp32's
    resolution of a sum of sigmoids) per norm_topk_prob, times routed_scaling_factor."""
    g = block.gate
    return dict(top_k=int(g.top_k), score="sigmoid", normalize=bool(g.norm_topk_prob),
                route_scale=float(g.routed_scaling_factor), bias_select=True, **_groups(block, "top2"))


def _groups(block: nn.Module, group_score: str) -> dict:
    """The Config fields of the group-limited routing of a DeepSeek router (block.gate:
    num_group, topk_group), or UnsupportedModuleError where they are not counts."""
    n_group, topk_group = block.gate.num_group, block.gate.topk_group
    for name, v in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            _refuse(block, f"{name} = {v!r}: mok's group-limited routing takes n_group >= topk_group >= 1")
    return dict(n_group=n_group, topk_group=topk_group, group_score=group_score)


def _deepseek_v2_routing(block: nn.Module) -> dict:
    """softmax scores; topk_method "greedy": top-K of all E; "group_limited_greedy": the
    best topk_group of n_group groups by each group's largest score, top-K among theirs
    (transformers zeroes the other groups' scores; mok leaves them out, the same choice
    while K fits in the kept groups); the weights the scores, never normalised
    (transformers' router reads no norm_topk_prob), times routed_scaling_factor."""
    g = block.gate
    fields = dict(top_k=int(g.top_k), score="softmax", normalize=False, route_scale=float(g.routed_scaling_factor))
    if g.topk_method == "greedy":
        return fields
    if g.topk_method != "group_limited_greedy":
        _refuse(block, f"a router with topk_method = {g.topk_method!r} (mok runs DeepSeek-V2's 'greedy' and "
                       "'group_limited_greedy')")
    groups = _groups(block, "max")
    kept = groups["topk_group"] * (int(g.num_experts) // groups["n_group"])
    if fields["top_k"] > kept:
        _refuse(block, f"top_k = {fields['top_k']}, more than the {kept} experts of its topk_group kept groups "
                       "(transformers then takes experts of the other groups too, at weight 0; mok chooses the K "
                       "among the kept groups' experts)")
    return dict(fields, **groups)


def _families() -> Dict[type, _Family]:
    """The blocks fuse() replaces, by class."""
    out = {}
    known = (
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock", _Family("qwen3_moe", "gate", _top_k_normalized)),
        # softmax, top-K, always normalised
        ("mixtral", "MixtralSparseMoeBlock",
         _Family("mixtral", "gate", lambda b: dict(top_k=int(b.gate.top_k), normalize=True), jitter="jitter_noise")),
        ("olmoe", "OlmoeSparseMoeBlock", _Family("olmoe", "gate", _top_k_normalized)),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock",
         _Family("qwen2_moe", "gate", _top_k_normalized, shared="shared_expert", shared_gate="shared_expert_gate")),
        ("deepseek_v2", "DeepseekV2Moe", _Family("deepseek_v2", "gate", _deepseek_v2_routing, shared="shared_experts")),
        ("deepseek_v3", "DeepseekV3MoE", _Family("deepseek_v3", "gate", _deepseek_v3_routing, shared="shared_experts")),
        # top-K of the biased logits, softmax over those K: mok's softmax over E of the
        # biased logits, top-K, normalised (the same K weights)
        ("gpt_oss", "GptOssMLP",
         _Family("gpt_oss", "router", lambda b: dict(top_k=int(b.router.top_k), normalize=True, router_bias=True),
                 returns_scores=True)),
    )
    for module_name, class_name, family in known:
        try:
            mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        except ImportError:  # pragma: no cover
            continue
        cls = getattr(mod, class_name, None)
        if cls is not None:
            out[cls] = family
    return out


# the families fuse() runs (FUSED_FAMILIES): the families' names in transformers
FUSED_FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")


def _looks_like_moe_block(module: nn.Module) -> bool:
    return any(_is_experts(c) for c in module.children())


def _check_linear(owner: nn.Module, name: str, shape: Tuple[int, int]) -> Tensor:
    lin = getattr(owner, name, None)
    if not isinstance(lin, nn.Linear):
        _refuse(owner, f"a {name} that is not an nn.Linear ({type(lin).__name__})")
    if lin.bias is not None:
        _refuse(owner, f"a bias in {name}: mok's shared expert and its gate have none")
    if tuple(lin.weight.shape) != shape:
        raise ValueError(f"mok: {_name(owner)}: {name}.weight {list(lin.weight.shape)} is not {list(shape)}")
    if lin.weight.dtype not in (torch.bfloat16, torch.float32) or isinstance(lin.weight, DTensor):
        _refuse(owner, f"a {name}.weight of dtype {lin.weight.dtype} or a DTensor: mok takes bf16 or float32")
    return lin.weight


def _check_shared(block: nn.Module, family: _Family, H: int) -> dict:
    """The shared expert's Config fields (shared_ffn, shared_gate): mok's is one SwiGLU
    MLP, ws13 = [gate_proj; up_proj] [2Fs, H], ws2 = down_proj [H, Fs], no biases."""
    if not family.shared:
        return {}
    mlp = getattr(block, family.shared)
    mlp._mok_name = block._mok_name + "." + family.shared
    Fs = int(mlp.gate_proj.weight.shape[0]) if isinstance(getattr(mlp, "gate_proj", None), nn.Linear) else 0
    _check_linear(mlp, "gate_proj", (Fs, H))
    _check_linear(mlp, "up_proj", (Fs, H))
    _check_linear(mlp, "down_proj", (H, Fs))
    if type(getattr(mlp, "act_fn", None)) not in (SiLUActivation, nn.SiLU):
        _refuse(mlp, f"the activation {type(getattr(mlp, 'act_fn', None)).__name__}: mok's shared expert computes "
                     "silu(gate) * up (SwiGLU)")
    if set(n for n, _ in mlp.named_children()) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        _refuse(mlp, "submodules besides gate_proj, up_proj, down_proj and act_fn")
    if Fs == 0:  # a zero-width shared expert adds 0 (gated or not)
        return {}
    fields = dict(shared_ffn=Fs)
    if family.shared_gate:
        _check_linear(block, family.shared_gate, (1, H))
        fields["shared_gate"] = True
    return fields


def _check_block(block: nn.Module, family: _Family, E: int, H: int) -> dict:
    """The Config fields of a family's block (routing, shared expert), or
    UnsupportedModuleError / ValueError for what does not fit."""
    names = {family.router, "experts", family.shared, family.shared_gate} - {""}
    extra = sorted(set(n for n, _ in block.named_children()) - names)
    if extra or any(True for _ in block.named_parameters(recurse=False)):
        _refuse(block, f"submodules or parameters fuse() does not know ({', '.join(extra) or 'its own parameters'})")
    router = getattr(block, family.router)
    if isinstance(router.weight, DTensor):
        _refuse(router, "a DTensor router weight (transformers' tensor parallelism)")
    if tuple(router.weight.shape) != (E, H):
        raise ValueError(f"mok: {_name(block)}: router weight {list(router.weight.shape)} does not match "
                         f"{E} experts of hidden size {H}")
    fields = family.routing(block)
    for flag, name in (("router_bias", "bias"), ("bias_select", "e_score_correction_bias")):
        if fields.get(flag):
            t = getattr(router, name, None)
            if not isinstance(t, Tensor) or tuple(t.shape) != (E,):
                raise ValueError(f"mok: {_name(block)}: the router's {name} is not a tensor [{E}]")
    fields.update(_check_shared(block, family, H))
    return fields


_probed: Dict[tuple, Optional[str]] = {}


def _check_backend(block: nn.Module, cfg: Config, device: torch.device):
    """Asks libmok whether its backend on `device` runs this block's configuration: a
    context for 16 tokens (and one rank) made and destroyed, once per configuration and
    device. What the backend does not run (MOK_STATUS_UNSUPPORTED_SHAPE: a variant it
    lacks, a shape its kernels do not take) is an UnsupportedModuleError naming the block
    and libmok's reason."""
    probe = dataclasses.replace(cfg, world_size=1, rank=0, comm_id="", max_tokens=None)
    key = (probe.key(), str(device))
    if key not in _probed:
        why = None
        try:
            Context(probe, 16, device).destroy()
        except _lib.MokError as e:
            if e.status_name != "MOK_STATUS_UNSUPPORTED_SHAPE":
                raise
            why = str(e)
        _probed[key] = why
    why = _probed[key]
    if why is not None:
        features = [words for flag, words in _VARIANT_WORDS if getattr(cfg, flag)]
        raise UnsupportedModuleError(
            f"mok: {_name(block)} has {', '.join(features) or 'a configuration'} on {device}, which libmok's "
            f"backend there does not run ({why}); fuse() does not run it there")


_VARIANT_WORDS = (
    ("shared_gate", "a sigmoid-gated shared expert (shared_expert_gate)"),
    ("n_group", "group-limited routing (n_group)"),
    ("router_bias", "a router logit bias"),
    ("expert_bias", "expert biases"),
    ("swiglu_limit", "a clamped SwiGLU (swiglu_limit)"),
)


def fuse(model: nn.Module, **mok_options) -> List[str]:
    """Replaces each sparse-MoE block of `model` (FUSED_FAMILIES: Qwen3-MoE, Mixtral,
    OLMoE, Qwen2-MoE, DeepSeek-V2, DeepSeek-V3, gpt-oss) by a MokSparseMoeBlock running
    the whole block in mok's fused mode, and returns the replaced modules' names. Options: those
    of mok.MoE (max_tokens, num_threads, capacity, recompute_gate_up, reuse_saved,
    aux_loss_coef, z_loss_coef) and process_group (expert parallelism; module docstring).

    Routing: the block's router weight and rule, in mok's numerics: logits from bf16
    products with fp32 sums (a float32 router weight, DeepSeek-V2's and V3's included,
    is rounded to bf16), the weights kept in fp32 (transformers rounds them to the
    model's dtype), ties to the lower expert index. Per family (transformers' code, read for 5.24):
      - Qwen3-MoE, OLMoE, Qwen2-MoE: softmax over E, top-K, normalised per
        norm_topk_prob; Mixtral: the same, always normalised (and its jitter noise).
      - DeepSeek-V2: softmax over E; topk_method "greedy" (V2-Lite): top-K;
        "group_limited_greedy" (V2): the topk_group best of n_group groups by their
        largest score (mok's group_score "max"), top-K among those (refused where K
        exceeds the kept groups' experts: transformers then takes other groups' experts
        at weight 0); weights the scores, never normalised (transformers' DeepSeek-V2
        router does not read the config's norm_topk_prob), times routed_scaling_factor.
        Its first_k_dense_replace dense layers are not MoE blocks and stay as they are.
      - DeepSeek-V3: sigmoid scores; e_score_correction_bias (a buffer) added for the
        selection only (mok's bias_select); the topk_group best of n_group groups by
        the sum of their two largest selection keys; top-K among those; weights the
        unbiased scores, normalised per norm_topk_prob, times routed_scaling_factor.
      - gpt-oss: router logits with the router's bias (mok's router_bias: b_router gets
        its gradient), top-K of them, softmax over those K (mok's softmax over E, top-K,
        normalised: the same weights).
    The experts as in the replay path (expert biases, gpt-oss's clamped SwiGLU). The
    shared expert, where the family has one, runs inside mok too: DeepSeek-V2's and
    V3's shared_experts (n_shared_experts * moe_intermediate_size wide) and Qwen2-MoE's
    shared_expert become mok's shared expert of width Fs (ws13 = [gate_proj; up_proj],
    ws2 = down_proj: a bf16 copy of them every forward, through autograd), and
    Qwen2-MoE's shared_expert_gate mok's shared gate (w_sg, y += sigmoid(x . w_sg) *
    shared(x)). fuse() asks libmok about each block's configuration on the block's
    device (a context made and destroyed) and refuses, with UnsupportedModuleError,
    what its backend there refuses (a variant or a shape that backend lacks; a model
    fused on one device and moved to another gets libmok's MokError at its first
    forward there).

    The load-balancing loss: transformers computes it over all layers together, from
    the router logits it collects when output_router_logits is set (f_e and P_e summed
    over every layer's tokens first, then multiplied), which no sum of per-layer losses
    equals. So the block gives the model what transformers' own block gives it: when the
    model collects router logits the block calls its router module on its input (one
    [T, H] x [H, E] product in torch, and the recording hook on it), and the model's
    aux_loss and loss are then transformers' own, gradients included, with the same
    router_aux_loss_coef (DeepSeek-V2's and V3's models record the logits and have no
    such loss).
    mok's in-kernel losses are off unless asked for: with aux_loss_coef mok adds its
    per-block load-balancing loss, aux_loss_coef * E * sum_e f_e P_e with f_e = count_e
    / (T K), K times smaller than transformers' per-layer form (f_e = count_e / T) at the
    same coefficient; z_loss_coef adds mok's router z-loss. Those are not in the model's
    outputs: add router_losses(model) to the loss.

    Raises UnsupportedModuleError, before replacing anything, for a block mok cannot
    run (an unknown family's block, experts or a shared expert that need what mok
    lacks, a routing rule mok lacks, a variant the block's backend refuses)."""
    options, group = _take_options(mok_options, _FUSED_OPTIONS, "fuse()")
    families = _families()
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, MokSparseMoeBlock):
            continue
        if getattr(module, "_mok_fused", False):
            continue
        family = families.get(type(module))
        if family is None:
            if _looks_like_moe_block(module):
                module._mok_name = name
                raise UnsupportedModuleError(
                    f"mok: {_name(module)} is a sparse-MoE block of a family fuse() does not know (it knows "
                    f"{', '.join(FUSED_FAMILIES)}); its experts can run in the replay path "
                    "(experts_implementation='mok')")
            continue
        module._mok_name = name
        module.experts._mok_name = name + ".experts"
        variants = _check_experts(module.experts)
        H, F, E = _expert_shapes(module.experts)
        fields = dict(_check_block(module, family, E, H), **variants)
        blocks.append((name, module, family, H, F, E, fields))

    configs = []
    for (name, module, family, H, F, E, fields), g in zip(blocks, _group_options(group, [b[1] for b in blocks])):
        cfg = Config(hidden=H, ffn=F, num_experts=E, routing="fused", **fields, **options, **g)
        _check_backend(module, cfg, module.experts.gate_up_proj.device)
        jitter = float(getattr(module, family.jitter)) if family.jitter else 0.0
        configs.append((cfg, jitter, g))
    names = []
    for (name, module, family, *_), (cfg, jitter, g) in zip(blocks, configs):
        if g:
            _shard(module.experts, g["world_size"], g["rank"])
        fused = MokSparseMoeBlock(module, family, cfg, jitter)
        fused._mok_name = name
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, fused)
        names.append(name)
    return names


def router_losses(model: nn.Module) -> Tensor:
    """The sum of mok's in-kernel router losses (aux_loss + z_loss) of every fused block
    in the model's last forward: 0-dim, in the autograd graph; add it to the loss when
    fuse() was given aux_loss_coef or z_loss_coef. transformers' own load-balancing loss
    is already in the model's loss (output_router_logits) and is not in this sum."""
    total = None
    for m in model.modules():
        if isinstance(m, MokSparseMoeBlock) and m.aux_loss is not None:
            part = m.aux_loss + m.z_loss
            total = part if total is None else total + part
    if total is None:
        return torch.zeros(())
    return total
