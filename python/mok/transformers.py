"""mok inside Hugging Face transformers (5.x): the routed experts, or the whole sparse-MoE
block, run in libmok. Importing this module needs transformers; `import mok` does not
import it.

    import mok.transformers                     # registers experts_implementation="mok"
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="mok")
    # or, the router inside mok too (Qwen3-MoE, Mixtral, OLMoE blocks):
    names = mok.transformers.fuse(model)

Two paths:

- Replay (`experts_implementation="mok"`, or `model.set_experts_implementation("mok")`):
  transformers' router picks the experts; every routed-experts module then runs through
  mok's replay mode (mok::moe_forward with topk_idx / topk_weight), forward and
  backward, on the module's own parameters. `replay(model, **options)` sets that
  implementation and mok's options (max_tokens, threads, expert parallelism, ...) on
  every experts module.
- Fused (`fuse(model, **options)`): each supported block (router + experts) becomes a
  MokSparseMoeBlock that runs routing, experts and combine in mok's fused mode. The
  block keeps the router and experts modules it had (the same objects, so parameters,
  state_dict keys and output-recording hooks stay), and when the model collects router
  logits (output_router_logits) it calls its router module for them, so that
  transformers computes the model-level load-balancing loss from them exactly as it
  does for its own blocks (see fuse's docstring).

Layouts and their cost. mok's expert weights are w13 [E, 2F, H] (gate rows first) and
w2 [E, H, F], bf16: the layout of Qwen3-MoE's, Mixtral's and OLMoE's gate_up_proj and
down_proj, which mok then reads in place (no copy) when the model is bf16. What differs
is converted on every call, through autograd (the gradients come back in the module's
layout and dtype):
  - a float32 module: its weights and activations are rounded to bf16 (a copy of each
    expert weight, 2 bytes a parameter, every forward; its gradient is mok's bf16 one);
  - is_transposed (gate_up_proj [E, H, 2F], down_proj [E, F, H]): a transposed copy;
  - not is_concatenated (gate and up rows interleaved): a reordered copy.
float16 and other dtypes are refused (mok's numerics are bf16 with fp32 accumulation).

What mok lacks raises UnsupportedModuleError (a NotImplementedError) naming the module
and the feature, never a fallback to another implementation: expert biases (gpt-oss),
a custom gate function (_apply_gate: gpt-oss's clamped SwiGLU), post-expert norms,
ungated experts, an activation other than SiLU, transformers' own tensor/expert
parallelism (DTensor parameters), and in fuse() the blocks whose routing or shared
expert mok's fused mode does not have (Qwen2-MoE's sigmoid-gated shared expert,
DeepSeek-V3's group-limited routing, and any family not listed in FUSED_FAMILIES).
The replay path runs the routed experts of Qwen2-MoE and DeepSeek-V3 (transformers'
router and shared expert stay in torch); gpt-oss's experts are refused (biases, clamped
SwiGLU).

Expert parallelism: with process_group= (a NCCL group, a GPU per rank, max_tokens
required), replay() and fuse() keep on each rank only its E / W experts (rank r:
experts r E / W .. (r + 1) E / W - 1, the gate_up_proj / down_proj parameters replaced
by that slice: same keys, smaller shapes) and mok sends each token to its experts' rank
inside the kernels. Each rank passes its own tokens. The parameters outside the experts
are replicated: in the replay path their gradients are this rank's (all-reduce them as
in data parallelism); in the fused path the router's gradient comes out of mok already
summed over the ranks (mok's fixed tree), so it must not be all-reduced again over that
group.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

import transformers  # noqa: F401  (ImportError here when transformers is not installed)
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface

from . import _lib
from ._context import Config

try:  # transformers 5.x; the gate function that a module without its own gets
    from transformers.integrations.moe import _default_apply_gate
except ImportError:  # pragma: no cover
    _default_apply_gate = None

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


def _check_experts(module: nn.Module):
    """Raises UnsupportedModuleError for what mok's SwiGLU experts cannot run."""
    if not module.has_gate:
        _refuse(module, "experts without a gate projection (has_gate=False): mok's experts are gated (SwiGLU)")
    if module.has_bias:
        _refuse(module, "expert biases (has_bias: gate_up_proj_bias, down_proj_bias, as in gpt-oss): mok's "
                        "expert-bias variant is not in its PyTorch binding yet")
    if getattr(module, "has_post_expert_norm", False):
        _refuse(module, "a norm after each expert (has_post_expert_norm)")
    own_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    if _default_apply_gate is not None and own_gate is not _default_apply_gate:
        _refuse(module, "its own gate function (_apply_gate, e.g. gpt-oss's clamped SwiGLU): mok computes "
                        "silu(gate) * up")
    act = getattr(module, "act_fn", None)
    if type(act) not in (SiLUActivation, nn.SiLU):
        _refuse(module, f"the activation {type(act).__name__}: mok's experts compute silu(gate) * up (SwiGLU)")
    if getattr(module, "_is_expert_parallel", False) or any(isinstance(p, DTensor) for p in module.parameters()):
        _refuse(module, "transformers' own tensor or expert parallelism (a tp_plan / distributed_config: DTensor "
                        "or sharded experts); mok shards the experts itself: replay(model, process_group=...) "
                        "or fuse(model, process_group=...)")
    dtype = module.gate_up_proj.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        _refuse(module, f"weights of dtype {dtype}: mok runs bf16 (fp32 accumulation) and takes bfloat16 or "
                        "float32 modules (float32 is rounded to bf16 on every call)")


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
    if not module.is_concatenated:  # rows gate_0, up_0, gate_1, up_1, ...
        E, F2, H = w13.shape
        w13 = w13.reshape(E, F2 // 2, 2, H).transpose(1, 2).reshape(E, F2, H)
    return w13.to(torch.bfloat16).contiguous(), w2.to(torch.bfloat16).contiguous()


_NO_OPTIONS: dict = {}


def _options_of(module: nn.Module) -> Tuple[str, dict]:
    """The mok options replay() set on an experts module: as a canonical string (part of
    its config key) and as a dict (read by traced code, which cannot parse the string)."""
    return getattr(module, "_mok_options", "{}"), getattr(module, "_mok_options_dict", _NO_OPTIONS)


@torch.compiler.assume_constant_result
def _replay_key(H: int, F: int, E: int, K: int, options: str) -> str:
    """The mok config key of a replay call (a constant to torch.compile: the config is
    made here, outside the traced code)."""
    return _replay_config(H, F, E, K, options).key()


_configs: Dict[tuple, Config] = {}


def _replay_config(H: int, F: int, E: int, K: int, options: str) -> Config:
    key = (H, F, E, K, options)
    cfg = _configs.get(key)
    if cfg is None:
        cfg = Config(hidden=H, ffn=F, num_experts=E, top_k=K, routing="replay", **json.loads(options))
        _configs[key] = cfg
    return cfg


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
    through mok's replay mode. top_k_weights gets mok's d_topk_weight as its gradient."""
    _check_experts(self)
    H, F, E_local = _expert_shapes(self)
    options, opts = _options_of(self)
    E = E_local * opts.get("world_size", 1)
    K = int(top_k_index.shape[-1])
    _check_tokens(self, hidden_states, opts)
    key = _replay_key(H, F, E, K, options)
    w13, w2 = _expert_weights(self)
    # HF's router indices are in [0, E) (mok refuses any other: INDEX_OUT_OF_RANGE), so
    # the narrowing to mok's int32 is exact
    idx = top_k_index.to(torch.int32)
    wt = top_k_weights.to(torch.float32)
    y = torch.ops.mok.moe_forward(
        hidden_states.to(torch.bfloat16), None, None, w13, w2, None, None, idx, wt, [], key
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
    """Keeps only this rank's E / W experts in gate_up_proj and down_proj (new
    parameters, the same names)."""
    E = int(module.gate_up_proj.shape[0])
    if E % world_size:
        raise ValueError(f"mok: {_name(module)} has {E} experts, not a multiple of the {world_size} ranks")
    El = E // world_size
    for name in ("gate_up_proj", "down_proj"):
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
    for n, m in found:
        m._mok_name = n
        _check_experts(m)
    for (n, m), g in zip(found, _group_options(group, [m for _, m in found])):
        H, F, E = _expert_shapes(m)
        opts = dict(options, **g)
        _replay_config(H, F, E, 1, json.dumps(opts, sort_keys=True))  # the options' errors, now
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
    """A sparse-MoE block (router + routed experts) run in mok's fused mode: routing
    (softmax, top-K with ties to the lower expert, optional normalisation), the SwiGLU
    experts and the weighted combine in one forward and one backward of libmok.

    Holds the block's own router (`gate`) and experts (`experts`) modules, so its
    parameters and state_dict keys are the block's: gate.weight [E, H],
    experts.gate_up_proj [E, 2F, H] (E / W of them under expert parallelism),
    experts.down_proj [E, H, F].

    After a forward: aux_loss and z_loss (mok's own per-block losses, 0 unless fuse() was
    given aux_loss_coef / z_loss_coef; router_losses(model) sums them), tokens_per_expert
    (int32 [E]), topk_idx (int32 [T, K]) and topk_weight (fp32 [T, K]).
    """

    def __init__(self, block: nn.Module, family: str, config: Config, jitter_noise: float = 0.0):
        super().__init__()
        self.gate = block.gate
        self.experts = block.experts
        self.family = family
        self.config = config
        self.jitter_noise = float(jitter_noise)
        self.experts._mok_fused = True
        self.aux_loss: Optional[Tensor] = None
        self.z_loss: Optional[Tensor] = None
        self.tokens_per_expert: Optional[Tensor] = None
        self.topk_idx: Optional[Tensor] = None
        self.topk_weight: Optional[Tensor] = None

    def forward(self, hidden_states: Tensor) -> Tensor:
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
        w13, w2 = _expert_weights(self.experts)
        w_router = self.gate.weight.to(torch.bfloat16)
        y, aux, z, tpe, idx, wt, _saved = torch.ops.mok.moe_forward(
            x.to(torch.bfloat16), w_router, None, w13, w2, None, None, None, None, [], cfg.key()
        )
        self.aux_loss, self.z_loss, self.tokens_per_expert = aux, z, tpe
        self.topk_idx, self.topk_weight = idx, wt.detach()
        if _router_logits_wanted():
            # the model collects router logits (for its load-balancing loss): the block's
            # router module computes them, and the model's recording hook on it takes
            # them, as for transformers' own block; its choice of experts is not used
            self.gate(x)
        return y.to(hidden_states.dtype).reshape(shape)

    def extra_repr(self) -> str:
        c = self.config
        s = f"family={self.family!r}, hidden={c.hidden}, ffn={c.ffn}, num_experts={c.num_experts}, top_k={c.top_k}"
        s += f", normalize={c.normalize}"
        if c.world_size > 1:
            s += f", world_size={c.world_size}, rank={c.rank}"
        return s

    _RESULTS = ("aux_loss", "z_loss", "tokens_per_expert", "topk_idx", "topk_weight")

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self._RESULTS:
            state[name] = None
        return state


def _families() -> Dict[type, Tuple[str, object]]:
    """The blocks fuse() replaces: class -> (family, how it routes: a function of the
    block giving (top_k, normalize, jitter_noise))."""
    out = {}
    try:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        out[Qwen3MoeSparseMoeBlock] = ("qwen3_moe", lambda b: (b.gate.top_k, bool(b.gate.norm_topk_prob), 0.0))
    except ImportError:  # pragma: no cover
        pass
    try:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        out[MixtralSparseMoeBlock] = ("mixtral", lambda b: (b.gate.top_k, True, float(b.jitter_noise)))
    except ImportError:  # pragma: no cover
        pass
    try:
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

        out[OlmoeSparseMoeBlock] = ("olmoe", lambda b: (b.gate.top_k, bool(b.gate.norm_topk_prob), 0.0))
    except ImportError:  # pragma: no cover
        pass
    return out


# the families fuse() knows, and those it refuses with the reason
FUSED_FAMILIES = ("qwen3_moe", "mixtral", "olmoe")
_REFUSED = {
    "Qwen2MoeSparseMoeBlock": "a shared expert scaled by a sigmoid gate (shared_expert_gate), a variant that "
                              "mok's fused mode does not have yet; its routed experts run in the replay path "
                              "(experts_implementation='mok')",
    "DeepseekV3MoE": "group-limited routing (n_group, topk_group), which mok's PyTorch binding does not have yet "
                     "(the library's CPU backend has it); its routed experts run in the replay path "
                     "(experts_implementation='mok')",
}


def _looks_like_moe_block(module: nn.Module) -> bool:
    return any(_is_experts(c) for c in module.children())


def fuse(model: nn.Module, **mok_options) -> List[str]:
    """Replaces each sparse-MoE block of `model` (Qwen3-MoE, Mixtral, OLMoE) by a
    MokSparseMoeBlock running the whole block in mok's fused mode, and returns the
    replaced modules' names. Options: those of mok.MoE (max_tokens, num_threads,
    capacity, recompute_gate_up, reuse_saved, aux_loss_coef, z_loss_coef) and
    process_group (expert parallelism; module docstring).

    Routing: the block's router weight and rule (softmax over E, top-K, normalised when
    the family normalises: Mixtral always, Qwen3-MoE and OLMoE per norm_topk_prob), in
    mok's numerics: logits from bf16 products with fp32 sums, the weights kept in fp32
    (transformers rounds them to the model's dtype), ties to the lower expert index.

    The load-balancing loss: transformers computes it over all layers together, from
    the router logits it collects when output_router_logits is set (f_e and P_e summed
    over every layer's tokens first, then multiplied), which no sum of per-layer losses
    equals. So the block gives the model what transformers' own block gives it: when the
    model collects router logits the block calls its router module on its input (one
    [T, H] x [H, E] product in torch, and the recording hook on it), and the model's
    aux_loss and loss are then transformers' own, gradients included, with the same
    router_aux_loss_coef. mok's in-kernel losses are off unless asked for: with
    aux_loss_coef mok adds its per-block load-balancing loss, aux_loss_coef * E *
    sum_e f_e P_e with f_e = count_e / (T K), K times smaller than transformers' per-layer
    form (f_e = count_e / T) at the same coefficient; z_loss_coef adds mok's router
    z-loss. Those are not in the model's outputs: add router_losses(model) to the loss.

    Raises UnsupportedModuleError, before replacing anything, for a block mok cannot
    run (Qwen2-MoE's gated shared expert, DeepSeek-V3's group-limited routing, an unknown
    family's block, experts that need what mok lacks)."""
    options, group = _take_options(mok_options, _FUSED_OPTIONS, "fuse()")
    families = _families()
    blocks = []
    for name, module in model.named_modules():
        if isinstance(module, MokSparseMoeBlock):
            continue
        if getattr(module, "_mok_fused", False):
            continue
        kind = families.get(type(module))
        if kind is None:
            if type(module).__name__ in _REFUSED:
                module._mok_name = name
                raise UnsupportedModuleError(f"mok: {_name(module)} has {_REFUSED[type(module).__name__]}; "
                                             "fuse() does not run it")
            if _looks_like_moe_block(module):
                module._mok_name = name
                raise UnsupportedModuleError(
                    f"mok: {_name(module)} is a sparse-MoE block of a family fuse() does not know (it knows "
                    f"{', '.join(FUSED_FAMILIES)}); its experts can run in the replay path "
                    "(experts_implementation='mok')")
            continue
        module._mok_name = name
        module.experts._mok_name = name + ".experts"
        _check_experts(module.experts)
        if isinstance(module.gate.weight, DTensor):
            _refuse(module.gate, "a DTensor router weight (transformers' tensor parallelism)")
        blocks.append((name, module, kind))

    configs = []
    for (name, module, (family, routing)), g in zip(blocks, _group_options(group, [b for _, b, _ in blocks])):
        H, F, E = _expert_shapes(module.experts)
        E_router, H_router = module.gate.weight.shape
        if (E_router, H_router) != (E, H):
            raise ValueError(f"mok: {_name(module)}: router weight {list(module.gate.weight.shape)} does not match "
                             f"{E} experts of hidden size {H}")
        top_k, normalize, jitter = routing(module)
        cfg = Config(hidden=H, ffn=F, num_experts=E, top_k=int(top_k), score="softmax", normalize=normalize,
                     routing="fused", **options, **g)
        configs.append((cfg, jitter, g))
    names = []
    for (name, module, (family, _)), (cfg, jitter, g) in zip(blocks, configs):
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
