"""Layer configurations and the cache of libmok contexts.

A mok context is made for one configuration and a maximum token count (the config's
T); a call may pass fewer tokens. Contexts are cached per (configuration, T_max,
backend) and live until clear_cache(): the saved buffer that a forward writes is tied
to the context that wrote it, so the backward must find that same context.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import threading
from functools import lru_cache
from typing import Optional

import torch

from . import _lib

SCORES = {"softmax": _lib.MOK_SCORE_SOFTMAX, "sigmoid": _lib.MOK_SCORE_SIGMOID}
ROUTINGS = {"fused": _lib.MOK_ROUTING_FUSED, "replay": _lib.MOK_ROUTING_REPLAY}
GROUP_SCORES = {"top2": _lib.MOK_GROUP_SCORE_TOP2, "max": _lib.MOK_GROUP_SCORE_MAX}


@dataclasses.dataclass(frozen=True)
class Config:
    """The layer, as mok.MoE takes it (see mok.MoE for the meaning of each field)."""

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    score: str = "softmax"
    normalize: bool = True
    route_scale: float = 1.0
    bias_select: bool = False
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    shared_ffn: int = 0
    routing: str = "fused"
    wgrad_fp32_accum: bool = False
    max_tokens: Optional[int] = None
    exact: bool = False
    num_threads: int = 0
    capacity: int = 0  # rows this rank can receive; 0 = the library's safe default
    recompute_gate_up: bool = False  # backward recomputes gate|up instead of forward saving it
    reuse_saved: bool = True  # backward writes its scratch over saved (a second backward: forward again)
    # router and expert variants (mok.h; each off by default)
    n_group: int = 0  # group-limited routing: n_group groups of E / n_group experts
    topk_group: int = 0  # ... of which the topk_group best are kept
    group_score: str = "top2"  # a group's score: "top2" (DeepSeek-V3) or "max" (DeepSeek-V2)
    router_bias: bool = False  # b_router [E] added to the logits (gpt-oss)
    expert_bias: bool = False  # b13 [E, 2F], b2 [E, H] added to a and o (gpt-oss)
    swiglu_limit: Optional[float] = None  # gpt-oss's clamped SwiGLU at this limit (7 there)
    swiglu_alpha: float = 1.702  # ... and this alpha (with swiglu_limit only)
    shared_gate: bool = False  # the shared expert scaled by sigmoid(x . w_sg) (Qwen2-MoE)
    # expert parallelism (CUDA backend, a GPU per rank): this rank of world_size, which
    # holds experts rank * E / W .. + E / W; comm_id, the ranks' NCCL unique id as hex
    # (mok.comm_unique_id() on one rank, the same string on every rank)
    world_size: int = 1
    rank: int = 0
    comm_id: str = ""

    def __post_init__(self):
        def positive_int(name, v, allow_zero=False):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"mok: {name} must be an int, got {type(v).__name__}")
            if v < 0 or (v == 0 and not allow_zero):
                raise ValueError(f"mok: {name} = {v} must be {'>= 0' if allow_zero else '>= 1'}")

        positive_int("hidden", self.hidden)
        positive_int("ffn", self.ffn)
        positive_int("num_experts", self.num_experts)
        positive_int("top_k", self.top_k)
        positive_int("shared_ffn", self.shared_ffn, allow_zero=True)
        positive_int("num_threads", self.num_threads, allow_zero=True)
        positive_int("capacity", self.capacity, allow_zero=True)
        positive_int("n_group", self.n_group, allow_zero=True)
        positive_int("topk_group", self.topk_group, allow_zero=True)
        positive_int("world_size", self.world_size)
        positive_int("rank", self.rank, allow_zero=True)
        if self.num_experts % self.world_size:
            raise ValueError(f"mok: num_experts = {self.num_experts} must be a multiple of world_size = {self.world_size}")
        if self.rank >= self.world_size:
            raise ValueError(f"mok: rank = {self.rank} must be < world_size = {self.world_size}")
        if self.world_size > 1:
            if not isinstance(self.comm_id, str) or len(self.comm_id) != 2 * _lib.MOK_COMM_UNIQUE_ID_BYTES:
                raise ValueError(
                    f"mok: world_size = {self.world_size} needs comm_id, the ranks' NCCL unique id as "
                    f"{2 * _lib.MOK_COMM_UNIQUE_ID_BYTES} hex digits (mok.comm_unique_id() on one rank)")
            if self.max_tokens is None:
                raise ValueError(
                    f"mok: world_size = {self.world_size} needs max_tokens: every rank's buffers are sized alike")
        if self.max_tokens is not None:
            positive_int("max_tokens", self.max_tokens, allow_zero=True)
        if self.top_k > self.num_experts:
            raise ValueError(f"mok: top_k = {self.top_k} must be <= num_experts = {self.num_experts}")
        if self.score not in SCORES:
            raise ValueError(f"mok: score = {self.score!r} must be one of {sorted(SCORES)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"mok: routing = {self.routing!r} must be one of {sorted(ROUTINGS)}")
        for name in ("route_scale", "aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"mok: {name} must be a float, got {type(v).__name__}")
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError(f"mok: {name} = {v} must be finite")
            object.__setattr__(self, name, float(v))
        for name in ("normalize", "bias_select", "wgrad_fp32_accum", "exact", "recompute_gate_up", "reuse_saved",
                     "router_bias", "expert_bias", "shared_gate"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.routing == "replay" and (self.aux_loss_coef or self.z_loss_coef or self.bias_select):
            raise ValueError("mok: aux_loss_coef, z_loss_coef and bias_select apply to routing='fused' only")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"mok: group_score = {self.group_score!r} must be one of {sorted(GROUP_SCORES)}")
        if self.n_group:
            if self.num_experts % self.n_group:
                raise ValueError(f"mok: n_group = {self.n_group} must divide num_experts = {self.num_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"mok: topk_group = {self.topk_group} must be in [1, n_group = {self.n_group}]")
            kept = self.topk_group * (self.num_experts // self.n_group)
            if self.top_k > kept:
                raise ValueError(f"mok: top_k = {self.top_k} must be at most the kept groups' experts, "
                                 f"topk_group * num_experts / n_group = {kept}")
        elif self.topk_group:
            raise ValueError(f"mok: topk_group = {self.topk_group} needs n_group >= 1")
        if self.routing == "replay" and (self.n_group or self.router_bias):
            raise ValueError("mok: n_group and router_bias apply to routing='fused' only")
        if self.swiglu_limit is not None:
            for name in ("swiglu_limit", "swiglu_alpha"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise TypeError(f"mok: {name} must be a float, got {type(v).__name__}")
                if not (v > 0 and v != float("inf")):
                    raise ValueError(f"mok: {name} = {v} must be finite and > 0 (gpt-oss: swiglu_limit 7, "
                                     "swiglu_alpha 1.702)")
                object.__setattr__(self, name, float(v))
        if self.shared_gate and not self.shared_ffn:
            raise ValueError("mok: shared_gate needs a shared expert (shared_ffn > 0)")
        # the canonical string, computed once (traced code reads it as a constant)
        object.__setattr__(
            self, "_key", json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        )

    # -- derived --
    @property
    def fused(self) -> bool:
        return self.routing == "fused"

    @property
    def local_experts(self) -> int:
        """The experts this rank holds (E / world_size)."""
        return self.num_experts // self.world_size

    @property
    def param_dtype(self) -> torch.dtype:
        """bf16 tensors of the contract (x, y, weights); float64 in exact numerics."""
        return torch.float64 if self.exact else torch.bfloat16

    @property
    def real_dtype(self) -> torch.dtype:
        """fp32 tensors of the contract (bias_select, topk_weight, losses, main_grad)."""
        return torch.float64 if self.exact else torch.float32

    def key(self) -> str:
        """A canonical string for this config (what the custom ops carry)."""
        return self._key

    @staticmethod
    def from_key(key: str) -> "Config":
        return _config_from_key(key)

    def context_tokens(self, T: int) -> int:
        """T of the context that runs a call of T tokens: max_tokens, or else T rounded
        up to a power of two (at least 16), so that a few contexts serve varying T."""
        if self.max_tokens is not None:
            return self.max_tokens
        n = 16
        while n < T:
            n *= 2
        return n

    def c_config(self, T_max: int, backend: int) -> _lib.MokConfig:
        c = _lib.MokConfig.init()
        c.T, c.H, c.F, c.E, c.K = T_max, self.hidden, self.ffn, self.num_experts, self.top_k
        c.W, c.rank = self.world_size, self.rank
        if self.world_size > 1:  # (kept with the struct: it must outlive mok_context_create)
            c._comm_id = ctypes.create_string_buffer(bytes.fromhex(self.comm_id), _lib.MOK_COMM_UNIQUE_ID_BYTES)
            c.comm_unique_id = ctypes.cast(c._comm_id, ctypes.c_void_p)
        c.routing = ROUTINGS[self.routing]
        c.score = SCORES[self.score]
        c.normalize = int(self.normalize)
        c.route_scale = self.route_scale
        c.use_bias_select = int(self.bias_select)
        c.aux_loss_coef = self.aux_loss_coef
        c.z_loss_coef = self.z_loss_coef
        c.Fs = self.shared_ffn
        c.n_group, c.topk_group = self.n_group, self.topk_group
        c.group_score = GROUP_SCORES[self.group_score]
        c.use_router_bias = int(self.router_bias)
        c.use_expert_bias = int(self.expert_bias)
        if self.swiglu_limit is not None:
            c.activation = _lib.MOK_ACTIVATION_SWIGLU_CLAMPED
            c.swiglu_alpha, c.swiglu_limit = self.swiglu_alpha, self.swiglu_limit
        c.use_shared_gate = int(self.shared_gate)
        c.wgrad = _lib.MOK_WGRAD_FP32_ACCUM if self.wgrad_fp32_accum else _lib.MOK_WGRAD_BF16
        c.numerics = _lib.MOK_NUMERICS_EXACT if self.exact else _lib.MOK_NUMERICS_BF16
        c.backend = backend
        c.capacity = self.capacity
        c.num_threads = self.num_threads
        c.gate_up = _lib.MOK_GATE_UP_RECOMPUTE if self.recompute_gate_up else _lib.MOK_GATE_UP_SAVE
        c.saved_use = _lib.MOK_SAVED_REUSE if self.reuse_saved else _lib.MOK_SAVED_KEEP
        return c


@lru_cache(maxsize=None)
def _config_from_key(key: str) -> Config:
    return Config(**json.loads(key))


def backend_of(device: torch.device) -> int:
    if device.type == "cpu":
        return _lib.MOK_BACKEND_CPU
    if device.type == "cuda":
        return _lib.MOK_BACKEND_CUDA
    raise ValueError(
        f"mok: tensors on device {device} are not supported: mok runs on 'cpu' (CPU backend) "
        "or 'cuda' (CUDA backend)"
    )


def device_guard(device: torch.device):
    """The current-device scope for libmok calls on `device` (a CUDA context belongs to
    the GPU current at its creation, and its calls run there)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _aligned_view(buf: torch.Tensor, nbytes: int, align: int) -> int:
    """Address inside uint8 tensor buf where nbytes aligned to `align` start."""
    p = buf.data_ptr()
    off = (-p) % align
    assert off + nbytes <= buf.numel()
    return p + off


class Context:
    """One libmok context: its sizes and a lock (a context runs one call at a time)."""

    def __init__(self, config: Config, T_max: int, device: torch.device):
        L = _lib.lib()
        self.config = config
        self.T_max = T_max
        self.device = device
        self.backend = backend_of(device)
        self.lock = threading.Lock()
        cfg = config.c_config(T_max, self.backend)
        h = ctypes.c_void_p()
        with device_guard(device):
            _lib.check(L.mok_context_create(ctypes.byref(cfg), ctypes.byref(h)), "mok_context_create")
        self.handle = h
        fwd, bwd, sv = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        _lib.check(L.mok_workspace_sizes(h, ctypes.byref(fwd), ctypes.byref(bwd)), "mok_workspace_sizes", h)
        _lib.check(L.mok_saved_size(h, ctypes.byref(sv)), "mok_saved_size", h)
        self.workspace_bytes = {"forward": fwd.value, "backward": bwd.value}
        self.saved_bytes = sv.value

    # the saved tensor: payload at a 256-byte aligned offset, the offset in the last byte
    @property
    def saved_numel(self) -> int:
        return self.saved_bytes + _lib.ALIGN_WORKSPACE + 1

    def workspace(self, call: str):
        """(tensor, pointer, bytes) of a workspace for one call ("forward" or "backward"),
        allocated for it by PyTorch's caching allocator on the current stream: a step then
        holds each call's own scratch only while that call runs (the CUDA forward's holds
        the SwiGLU output h, which saved does not keep: mok_workspace_sizes), not the
        larger of the two throughout. The tensor must outlive the call's enqueue."""
        n = self.workspace_bytes[call]
        buf = torch.empty(n + _lib.ALIGN_WORKSPACE, dtype=torch.uint8, device=self.device)
        return buf, _aligned_view(buf, n, _lib.ALIGN_WORKSPACE), n

    def destroy(self):
        if self.handle:
            _lib.lib().mok_context_destroy(self.handle)
            self.handle = None

    def check(self, status: int, call: str):
        _lib.check(status, call, self.handle)


_cache: dict = {}
_cache_lock = threading.Lock()


def get_context(config: Config, T: int, device: torch.device) -> Context:
    """The cached context for (config, T_max of a T-token call, device)."""
    T_max = config.context_tokens(T)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (config.key(), T_max, str(dev))
    ctx = _cache.get(key)
    if ctx is None:
        with _cache_lock:
            ctx = _cache.get(key)
            if ctx is None:
                ctx = Context(config, T_max, dev)
                _cache[key] = ctx
    return ctx


def clear_cache():
    """Destroys every cached context. Saved buffers of forwards whose backward has not
    run yet become invalid (their backward then fails with a clear error)."""
    with _cache_lock:
        for ctx in _cache.values():
            ctx.destroy()
        _cache.clear()


def num_cached_contexts() -> int:
    return len(_cache)


def synchronize():
    """Waits for the work libmok enqueued on the GPU and raises MokError for an error
    that a kernel met (mok_context_sync on every cached CUDA context). The CPU backend's
    calls are synchronous: nothing to do for them."""
    L = _lib.lib()
    fn = getattr(L, "mok_context_sync", None)
    if fn is None:
        return
    for ctx in list(_cache.values()):
        if ctx.handle and ctx.backend == _lib.MOK_BACKEND_CUDA:
            ctx.check(fn(ctx.handle), "mok_context_sync")
