"""The layer as PyTorch operators: mok::moe_forward and mok::moe_backward
(torch.library custom ops, with fake implementations for tracing and an autograd
formula), and the functional form mok.moe_forward that checks its arguments and calls
them.

mok::moe_forward runs mok_forward and returns, besides y and the monitoring outputs,
the `saved` buffer (uint8) that mok_backward needs; the autograd formula keeps it for
backward, where mok::moe_backward runs mok_backward on the same cached context.

Weight gradients: written as fresh tensors (bf16, float64 in exact numerics) and
returned to autograd, or, with wgrad_fp32_accum, added by libmok into the fp32
`main_grad` buffers (Megatron style), in which case autograd gets None for the weights.
The variants' parameters (b_router fp32; b13, b2, w_sg bf16) come last, defaulting to
None (a caller of the ops without variants passes none of them); their gradients follow
the weights' rule (b_router's is fp32 either way, mok.h).
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _lib
from ._context import Config, device_guard, get_context

# ---- helpers ----------------------------------------------------------------------


def _prep(t: Optional[Tensor]) -> Optional[Tensor]:
    """Contiguous and 16-byte aligned (a copy only when it is not already)."""
    if t is None:
        return None
    t = t.contiguous()
    if t.numel() and t.data_ptr() % _lib.ALIGN_TENSOR:
        t = t.clone()
    return t


def _ptr(t: Optional[Tensor]) -> Optional[int]:
    return t.data_ptr() if t is not None else None


def _stream(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


# the fp32 buffers that wgrad_fp32_accum adds the weight gradients into, in this order
GRAD_ACC_NAMES = ("router", "w13", "w2", "ws13", "ws2", "b_router", "b13", "b2", "w_sg")


def _variant_inputs(cfg, b_router=None, b13=None, b2=None, w_sg=None, backward=False):
    """The variants' tensors the config uses (prepared), None for the others; a missing
    one that it uses is a ValueError naming it (the backward takes b13 and w_sg only)."""
    uses = {"b_router": cfg.router_bias and not backward, "b13": cfg.expert_bias,
            "b2": cfg.expert_bias and not backward, "w_sg": cfg.shared_gate}
    out = []
    for name, t in (("b_router", b_router), ("b13", b13), ("b2", b2), ("w_sg", w_sg)):
        if not uses[name]:
            out.append(None)
            continue
        if t is None:
            raise ValueError(f"mok: {name} is required by this layer's config")
        out.append(_prep(t))
    return out


def _nothing(device) -> Tensor:
    """Placeholder for an output this configuration does not have."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def _saved_offset(saved: Tensor) -> int:
    """Offset of the saved payload inside the saved tensor. CPU: the 256-byte aligned
    offset recorded by the forward in the tensor's last byte. CUDA: 0 (torch's CUDA
    allocator hands out 512-byte aligned blocks; reading a byte back would need a
    device synchronisation)."""
    if saved.device.type == "cpu":
        return ctypes.string_at(saved.data_ptr() + saved.numel() - 1, 1)[0]
    return 0


def _saved_payload(ctx, saved: Tensor) -> Tuple[int, Tensor]:
    """Address of the saved payload written by the forward. If the tensor was copied
    since (so the payload is no longer 256-byte aligned), the payload is copied into a
    fresh aligned buffer."""
    n = saved.numel()
    if n != ctx.saved_numel:
        raise ValueError(
            f"mok: saved has {n} bytes, but the context of this configuration expects "
            f"{ctx.saved_numel}: it was not written by mok::moe_forward with the same config"
        )
    off = _saved_offset(saved)
    p = saved.data_ptr() + off
    if p % _lib.ALIGN_WORKSPACE == 0:
        return p, saved
    fresh = torch.empty(ctx.saved_bytes + _lib.ALIGN_WORKSPACE, dtype=torch.uint8, device=saved.device)
    q = (-fresh.data_ptr()) % _lib.ALIGN_WORKSPACE
    fresh[q : q + ctx.saved_bytes].copy_(saved[off : off + ctx.saved_bytes])
    return fresh.data_ptr() + q, fresh


# The saved tensors that a reuse_saved backward has used up (its scratch written over
# them), by (device, address), the newest last: a forward takes its own off, and a
# backward that finds its saved here runs the forward again into it first
# (_restore_saved), so a second backward through one forward (retain_graph=True) runs
# as with saved kept, at the cost of that forward. Host state alone (no device
# synchronisation); at most _USED_UP_MAX entries, past which the oldest is forgotten
# (a second backward on that one would be refused by libmok, "used up").
_used_up: "OrderedDict[Tuple[str, int], None]" = OrderedDict()
_used_up_lock = threading.Lock()
_USED_UP_MAX = 4096


def _saved_key(saved: Tensor) -> Tuple[str, int]:
    return str(saved.device), saved.data_ptr()


def _is_used_up(saved: Tensor) -> bool:
    with _used_up_lock:
        return _saved_key(saved) in _used_up


def _set_used_up(saved: Tensor, used: bool) -> None:
    key = _saved_key(saved)
    with _used_up_lock:
        _used_up.pop(key, None)
        if used:
            _used_up[key] = None  # (the newest last)
            while len(_used_up) > _USED_UP_MAX:
                _used_up.popitem(last=False)


# ---- mok::moe_forward -------------------------------------------------------------


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def _moe_forward_op(
    x: Tensor,
    w_router: Optional[Tensor],
    bias_select: Optional[Tensor],
    w13: Tensor,
    w2: Tensor,
    ws13: Optional[Tensor],
    ws2: Optional[Tensor],
    topk_idx: Optional[Tensor],
    topk_weight: Optional[Tensor],
    grad_acc: List[Tensor],
    config: str,
    b_router: Optional[Tensor] = None,
    b13: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    w_sg: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (y, aux_loss, z_loss, tokens_per_expert, topk_idx, topk_weight, saved).
    grad_acc (the fp32 main_grad buffers, or empty) is not used here: it is an input so
    that the autograd formula can hand it to the backward."""
    return _forward(Config.from_key(config), x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight,
                    b_router, b13, b2, w_sg)


def _forward(cfg, x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight, b_router, b13, b2, w_sg,
             saved: Optional[Tensor] = None):
    """mok_forward, writing a fresh saved tensor, or the given one again (a used-up
    saved of this forward: _restore_saved)."""
    T, H, K, E = x.shape[0], cfg.hidden, cfg.top_k, cfg.num_experts
    dev = x.device
    ctx = get_context(cfg, T, dev)
    act, real = cfg.param_dtype, cfg.real_dtype
    x, w_router, bias_select, w13, w2, ws13, ws2 = map(_prep, (x, w_router, bias_select, w13, w2, ws13, ws2))
    b_router, b13, b2, w_sg = _variant_inputs(cfg, b_router=b_router, b13=b13, b2=b2, w_sg=w_sg)
    y = torch.empty(T, H, dtype=act, device=dev)
    aux = torch.zeros((), dtype=real, device=dev)
    z = torch.zeros((), dtype=real, device=dev)
    tpe = torch.zeros(E, dtype=torch.int32, device=dev)
    if cfg.fused:
        idx = torch.empty(T, K, dtype=torch.int32, device=dev)
        wt = torch.empty(T, K, dtype=real, device=dev)
        idx_in, wt_in = idx, wt
    else:
        idx_in, wt_in = _prep(topk_idx), _prep(topk_weight)
        idx, wt = idx_in.clone(), wt_in.clone()
    if saved is None:
        saved = torch.empty(ctx.saved_numel, dtype=torch.uint8, device=dev)
    sp = saved.data_ptr()
    off = (-sp) % _lib.ALIGN_WORKSPACE
    if dev.type == "cpu":
        ctypes.memset(sp + saved.numel() - 1, off, 1)  # the payload's offset, for backward
    elif off:
        raise RuntimeError(f"mok: torch's {dev.type} allocator returned a saved buffer that is not 256-byte aligned")

    a = _lib.MokForwardArgs()
    a.num_tokens = T
    a.x = _ptr(x)
    a.w_router = _ptr(w_router) if cfg.fused else None
    a.bias_select = _ptr(bias_select) if cfg.fused and cfg.bias_select else None
    a.w13, a.w2 = _ptr(w13), _ptr(w2)
    a.ws13 = _ptr(ws13) if cfg.shared_ffn else None
    a.ws2 = _ptr(ws2) if cfg.shared_ffn else None
    a.b_router, a.b13, a.b2, a.w_sg = _ptr(b_router), _ptr(b13), _ptr(b2), _ptr(w_sg)
    a.topk_idx, a.topk_weight = _ptr(idx_in), _ptr(wt_in)
    a.y = _ptr(y)
    a.tokens_per_expert = _ptr(tpe)
    a.aux_loss, a.z_loss = _ptr(aux), _ptr(z)
    a.saved, a.saved_bytes = sp + off, ctx.saved_bytes
    a.stream = _stream(dev)
    L = _lib.lib()
    with ctx.lock, device_guard(dev):
        ws_buf, a.workspace, a.workspace_bytes = ctx.workspace("forward")  # (ws_buf: held past the enqueue)
        ctx.check(L.mok_forward(ctx.handle, ctypes.byref(a)), "mok_forward")
    _set_used_up(saved, False)
    return y, aux, z, tpe, idx, wt, saved


@_moe_forward_op.register_fake
def _moe_forward_fake(x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight, grad_acc, config,
                      b_router=None, b13=None, b2=None, w_sg=None):
    cfg = Config.from_key(config)
    T, H, K, E = x.shape[0], cfg.hidden, cfg.top_k, cfg.num_experts
    if cfg.max_tokens is not None:
        T_ctx = cfg.max_tokens
    else:
        T_ctx = int(T)  # the context (and the saved size) depends on T: specialise on it
    ctx = get_context(cfg, T_ctx, x.device)
    act, real = cfg.param_dtype, cfg.real_dtype
    return (
        x.new_empty((T, H), dtype=act),
        x.new_empty((), dtype=real),
        x.new_empty((), dtype=real),
        x.new_empty((E,), dtype=torch.int32),
        x.new_empty((T, K), dtype=torch.int32),
        x.new_empty((T, K), dtype=real),
        x.new_empty((ctx.saved_numel,), dtype=torch.uint8),
    )


# ---- mok::moe_backward ------------------------------------------------------------


@torch.library.custom_op("mok::moe_backward", mutates_args=("grad_acc",))
def _moe_backward_op(
    dy: Tensor,
    x: Tensor,
    w_router: Optional[Tensor],
    w13: Tensor,
    w2: Tensor,
    ws13: Optional[Tensor],
    ws2: Optional[Tensor],
    saved: Tensor,
    d_aux_loss: Tensor,
    d_z_loss: Tensor,
    grad_acc: List[Tensor],
    config: str,
    b13: Optional[Tensor] = None,
    w_sg: Optional[Tensor] = None,
    bias_select: Optional[Tensor] = None,
    topk_idx: Optional[Tensor] = None,
    topk_weight: Optional[Tensor] = None,
    b_router: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx, d_w_router, d_w13, d_w2, d_ws13, d_ws2, d_topk_weight, d_b_router,
    d_b13, d_b2, d_w_sg); a gradient this configuration does not have is an empty
    tensor. With wgrad_fp32_accum the weight gradients are added into grad_acc =
    [router, w13, w2, ws13, ws2, b_router, b13, b2, w_sg] (fp32) and the returned ones
    are empty. With reuse_saved libmok also writes into `saved`: an
    opaque buffer that only this op reads, so it is not declared among the mutated
    arguments (functionalization would copy it, the memory reuse_saved is for). A
    saved that an earlier reuse_saved backward used up is first written again by the
    forward, which then needs the forward's other inputs (bias_select, topk_idx,
    topk_weight, b_router, b2, where the config has them): _restore_saved."""
    cfg = Config.from_key(config)
    T, H, F, E, K, Fs = x.shape[0], cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k, cfg.shared_ffn
    El = cfg.local_experts
    dev = x.device
    ctx = get_context(cfg, T, dev)
    act, real = cfg.param_dtype, cfg.real_dtype
    dy, x, w_router, w13, w2, ws13, ws2 = map(_prep, (dy, x, w_router, w13, w2, ws13, ws2))
    _, b13, _, w_sg = _variant_inputs(cfg, b13=b13, w_sg=w_sg, backward=True)
    d_aux = _prep(d_aux_loss.detach().to(real).reshape(()))
    d_z = _prep(d_z_loss.detach().to(real).reshape(()))
    alloc = torch.zeros if T == 0 else torch.empty  # with no tokens libmok writes nothing
    dx = alloc(T, H, dtype=act, device=dev)
    dtw = alloc(T, K, dtype=real, device=dev) if not cfg.fused else _nothing(dev)
    if cfg.wgrad_fp32_accum:
        if len(grad_acc) != len(GRAD_ACC_NAMES):
            raise ValueError(f"mok: wgrad_fp32_accum needs grad_acc = [{', '.join(GRAD_ACC_NAMES)}]")
        for g in grad_acc:
            if g.numel() and (not g.is_contiguous() or g.data_ptr() % 4):
                raise ValueError("mok: main_grad buffers must be contiguous (they are added into in place)")
        dwr, d13, d2, ds13, ds2, dbr, db13, db2, dwsg = (_nothing(dev) for _ in range(9))
        p_r, p_13, p_2, p_s13, p_s2, p_br, p_b13, p_b2, p_wsg = (_ptr(g) for g in grad_acc)
    else:
        dwr = alloc(E, H, dtype=act, device=dev) if cfg.fused else _nothing(dev)
        d13 = alloc(El, 2 * F, H, dtype=act, device=dev)
        d2 = alloc(El, H, F, dtype=act, device=dev)
        ds13 = alloc(2 * Fs, H, dtype=act, device=dev) if Fs else _nothing(dev)
        ds2 = alloc(H, Fs, dtype=act, device=dev) if Fs else _nothing(dev)
        dbr = alloc(E, dtype=real, device=dev) if cfg.router_bias else _nothing(dev)  # (fp32 either way)
        db13 = alloc(El, 2 * F, dtype=act, device=dev) if cfg.expert_bias else _nothing(dev)
        db2 = alloc(El, H, dtype=act, device=dev) if cfg.expert_bias else _nothing(dev)
        dwsg = alloc(H, dtype=act, device=dev) if cfg.shared_gate else _nothing(dev)
        p_r, p_13, p_2, p_s13, p_s2, p_br, p_b13, p_b2, p_wsg = (
            _ptr(g) for g in (dwr, d13, d2, ds13, ds2, dbr, db13, db2, dwsg))

    b = _lib.MokBackwardArgs()
    b.num_tokens = T
    b.x = _ptr(x)
    b.w_router = _ptr(w_router) if cfg.fused else None
    b.w13, b.w2 = _ptr(w13), _ptr(w2)
    b.ws13 = _ptr(ws13) if Fs else None
    b.ws2 = _ptr(ws2) if Fs else None
    b.b13, b.w_sg = _ptr(b13), _ptr(w_sg)
    b.dy = _ptr(dy)
    b.d_aux_loss, b.d_z_loss = _ptr(d_aux), _ptr(d_z)  # never NULL: NULL means 1 in mok.h
    b.dx = _ptr(dx)
    b.d_topk_weight = _ptr(dtw) if not cfg.fused else None
    b.d_w_router = p_r if cfg.fused else None
    b.d_w13, b.d_w2 = p_13, p_2
    b.d_ws13 = p_s13 if Fs else None
    b.d_ws2 = p_s2 if Fs else None
    b.d_b_router = p_br if cfg.router_bias else None
    b.d_b13 = p_b13 if cfg.expert_bias else None
    b.d_b2 = p_b2 if cfg.expert_bias else None
    b.d_w_sg = p_wsg if cfg.shared_gate else None
    b.stream = _stream(dev)
    if cfg.reuse_saved and _is_used_up(saved):
        _restore_saved(cfg, saved, x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight,
                       b_router, b13, b2, w_sg)
    L = _lib.lib()
    with ctx.lock, device_guard(dev):
        b.saved, keep = _saved_payload(ctx, saved)
        b.saved_bytes = ctx.saved_bytes
        ws_buf, b.workspace, b.workspace_bytes = ctx.workspace("backward")  # (ws_buf: held past the enqueue)
        ctx.check(L.mok_backward(ctx.handle, ctypes.byref(b)), "mok_backward")
    if cfg.reuse_saved and keep is saved:  # (not a copy of it: _saved_payload)
        _set_used_up(saved, True)
    del keep
    return dx, dwr, d13, d2, ds13, ds2, dtw, dbr, db13, db2, dwsg


def _restore_saved(cfg, saved, x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight,
                   b_router, b13, b2, w_sg):
    """A second backward through one forward with reuse_saved (retain_graph=True): the
    first wrote its scratch over `saved`; the forward again, on the same inputs, writes
    its payload as it was, to the bit (D1; the header gets a new forward serial), in
    place (no second saved tensor)."""
    # (_forward reads each input only where the config has it, and names a missing
    # b_router or b2 itself)
    missing = [name for name, t, needed in (
        ("bias_select", bias_select, cfg.fused and cfg.bias_select), ("topk_idx", topk_idx, not cfg.fused),
        ("topk_weight", topk_weight, not cfg.fused)) if needed and t is None]
    if missing:
        raise ValueError(f"mok: saved was used up by a reuse_saved backward; writing it again runs the forward, "
                         f"which needs {', '.join(missing)}")
    with torch.no_grad():
        _forward(cfg, x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight, b_router, b13, b2, w_sg,
                 saved=saved)


@_moe_backward_op.register_fake
def _moe_backward_fake(dy, x, w_router, w13, w2, ws13, ws2, saved, d_aux_loss, d_z_loss, grad_acc, config,
                       b13=None, w_sg=None, bias_select=None, topk_idx=None, topk_weight=None, b_router=None,
                       b2=None):
    cfg = Config.from_key(config)
    T, H, F, E, K, Fs = x.shape[0], cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k, cfg.shared_ffn
    El = cfg.local_experts
    act, real = cfg.param_dtype, cfg.real_dtype

    def nothing():
        return x.new_empty((0,), dtype=torch.uint8)

    dx = x.new_empty((T, H), dtype=act)
    dtw = x.new_empty((T, K), dtype=real) if not cfg.fused else nothing()
    if cfg.wgrad_fp32_accum:
        return (dx, nothing(), nothing(), nothing(), nothing(), nothing(), dtw) + tuple(nothing() for _ in range(4))
    return (
        dx,
        x.new_empty((E, H), dtype=act) if cfg.fused else nothing(),
        x.new_empty((El, 2 * F, H), dtype=act),
        x.new_empty((El, H, F), dtype=act),
        x.new_empty((2 * Fs, H), dtype=act) if Fs else nothing(),
        x.new_empty((H, Fs), dtype=act) if Fs else nothing(),
        dtw,
        x.new_empty((E,), dtype=real) if cfg.router_bias else nothing(),
        x.new_empty((El, 2 * F), dtype=act) if cfg.expert_bias else nothing(),
        x.new_empty((El, H), dtype=act) if cfg.expert_bias else nothing(),
        x.new_empty((H,), dtype=act) if cfg.shared_gate else nothing(),
    )


# ---- autograd ---------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight, grad_acc, config = inputs[:11]
    # the trailing variant tensors as the call passed them (torch 2.11 can leave out those
    # at their default)
    b_router, b13, b2, w_sg = (tuple(inputs[11:]) + (None,) * 4)[:4]
    y, aux, z, tpe, idx, wt, saved = output
    # the forward's inputs too (references, no copies): with reuse_saved a second
    # backward runs the forward again on them (_restore_saved)
    ctx.save_for_backward(x, w_router, w13, w2, ws13, ws2, saved, b13, w_sg, bias_select, topk_idx, topk_weight,
                          b_router, b2)
    # not through save_for_backward: the buffers are added into in place by every
    # backward (several forwards may be pending), so no version check on them
    ctx.grad_acc = list(grad_acc)
    ctx.config = config
    ctx.mark_non_differentiable(tpe, idx, wt, saved)
    # gradients of unused outputs arrive as None, not as zeros: materialising them
    # would fill a tensor the size of `saved` (the activations) every step
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, d_aux, d_z, d_tpe, d_idx, d_wt, d_saved):
    x, w_router, w13, w2, ws13, ws2, saved, b13, w_sg, bias_select, topk_idx, topk_weight, b_router, b2 = (
        ctx.saved_tensors)
    cfg = Config.from_key(ctx.config)
    real = cfg.real_dtype
    if dy is None:
        dy = torch.zeros_like(x)
    if d_aux is None:
        d_aux = x.new_zeros((), dtype=real)
    if d_z is None:
        d_z = x.new_zeros((), dtype=real)
    dx, dwr, d13, d2, ds13, ds2, dtw, dbr, db13, db2, dwsg = torch.ops.mok.moe_backward(
        dy, x, w_router, w13, w2, ws13, ws2, saved, d_aux, d_z, ctx.grad_acc, ctx.config, b13, w_sg,
        bias_select, topk_idx, topk_weight, b_router, b2
    )
    if cfg.wgrad_fp32_accum:
        dwr = d13 = d2 = ds13 = ds2 = dbr = db13 = db2 = dwsg = None
    grads = (
        dx,
        dwr if cfg.fused else None,
        None,  # bias_select: selection only, no gradient
        d13,
        d2,
        ds13 if cfg.shared_ffn else None,
        ds2 if cfg.shared_ffn else None,
        None,  # topk_idx
        dtw if not cfg.fused else None,
        [None] * len(ctx.grad_acc),  # grad_acc
        None,  # config
        dbr if cfg.router_bias else None,
        db13 if cfg.expert_bias else None,
        db2 if cfg.expert_bias else None,
        dwsg if cfg.shared_gate else None,
    )
    # as many as the op's inputs in torch's record of the call (torch 2.11 leaves out
    # trailing arguments at their default; ctx.needs_input_grad has its structure)
    return grads[: len(ctx.needs_input_grad)]


_moe_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ---- the functional form ----------------------------------------------------------


class MoEOutput(NamedTuple):
    y: Tensor                  # [T, H]
    aux_loss: Tensor           # 0-dim, in the autograd graph (0 when aux_loss_coef = 0)
    z_loss: Tensor             # 0-dim, in the autograd graph (0 when z_loss_coef = 0)
    tokens_per_expert: Tensor  # [E] int32
    topk_idx: Tensor           # [T, K] int32: the experts of each token, in slot order
    topk_weight: Tensor        # [T, K] fp32 (detached): their weights g


def _check_tensor(name, t, shape, dtype, device, dtype_hint=""):
    if not isinstance(t, Tensor):
        raise TypeError(f"mok: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"mok: {name} has shape {list(t.shape)}, expected {list(shape)}")
    if t.dtype != dtype:
        raise TypeError(f"mok: {name} has dtype {t.dtype}, expected {dtype}{dtype_hint}")
    if t.device != device:
        raise ValueError(f"mok: {name} is on {t.device}, but x is on {device}: all tensors must be on one device")


def _narrow_topk_idx(topk_idx: Tensor, E: int) -> Tensor:
    """int64 replay indices as the int32 libmok reads, never wrapped (2^32 + 5 must not
    become expert 5). On the CPU every index is checked here, a ValueError naming the
    first one outside [0, E). On the GPU that check would wait for the device, so an index
    outside int32 becomes -1 instead, which the kernel refuses with
    MOK_STATUS_INDEX_OUT_OF_RANGE (mok.synchronize raises it)."""
    if topk_idx.dim() != 2:
        return topk_idx.to(torch.int32)  # (its shape is refused next, by name)
    if topk_idx.device.type == "cpu":
        bad = ((topk_idx < 0) | (topk_idx >= E)).nonzero()
        if bad.numel():
            t, j = (int(v) for v in bad[0])
            raise ValueError(f"mok: topk_idx[{t}, {j}] = {int(topk_idx[t, j])} is outside [0, num_experts = {E})")
        return topk_idx.to(torch.int32)
    outside = (topk_idx < -(2**31)) | (topk_idx >= 2**31)
    return torch.where(outside, torch.full_like(topk_idx, -1), topk_idx).to(torch.int32)


def moe_forward(
    x: Tensor,
    w_router: Optional[Tensor],
    w13: Tensor,
    w2: Tensor,
    ws13: Optional[Tensor] = None,
    ws2: Optional[Tensor] = None,
    *,
    config: Union[Config, str],
    bias_select: Optional[Tensor] = None,
    topk_idx: Optional[Tensor] = None,
    topk_weight: Optional[Tensor] = None,
    main_grads: Optional[List[Tensor]] = None,
    b_router: Optional[Tensor] = None,
    b13: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    w_sg: Optional[Tensor] = None,
) -> MoEOutput:
    """The MoE layer as a function (what mok.MoE.forward calls).

    x [T, H]; w_router [E, H] (fused routing; None for replay); w13 [E, 2F, H];
    w2 [E, H, F]; ws13 [2Fs, H] and ws2 [H, Fs] when config.shared_ffn > 0. All bf16
    (float64 with config.exact). bias_select [E] fp32 when config.bias_select.
    Replay routing: topk_idx [T, K] int32 (int64 is converted) and topk_weight [T, K]
    fp32, which gets a gradient. The variants' parameters, each when its option is on:
    b_router [E] fp32 (router_bias), b13 [E, 2F] and b2 [E, H] bf16 (expert_bias), w_sg
    [H] bf16 (shared_gate); each gets a gradient. With config.wgrad_fp32_accum,
    main_grads = the fp32 buffers [router, w13, w2, ws13, ws2, b_router, b13, b2, w_sg]
    (the first five alone when the layer has no variant's parameter; None where the
    layer has none) that the weight gradients are added into (default: the weights'
    `main_grad` attributes); then the weights get no .grad.

    Raises TypeError / ValueError naming the argument for a bad dtype / shape / device,
    and mok.MokError for what libmok rejects (its status and message).
    """
    cfg = Config.from_key(config) if isinstance(config, str) else config
    if not isinstance(cfg, Config):
        raise TypeError(f"mok: config must be a mok.Config, got {type(config).__name__}")
    H, F, E, K, Fs = cfg.hidden, cfg.ffn, cfg.num_experts, cfg.top_k, cfg.shared_ffn
    El = cfg.local_experts  # (w13, w2 and their gradients: this rank's experts)
    act, real = cfg.param_dtype, cfg.real_dtype
    hint = " (this layer runs exact numerics: float64)" if cfg.exact else " (this layer is bf16)"
    if not isinstance(x, Tensor):
        raise TypeError(f"mok: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"mok: x must be 2-D [tokens, hidden], got shape {list(x.shape)}")
    if x.shape[1] != H:
        raise ValueError(f"mok: x has hidden size {x.shape[1]} (shape {list(x.shape)}), but the layer has hidden = {H}")
    if x.dtype != act:
        raise TypeError(f"mok: x has dtype {x.dtype}, expected {act}{hint}")
    dev = x.device
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"mok: x is on device {dev}: mok runs on 'cpu' (CPU backend) or 'cuda' (CUDA backend)")
    if cfg.world_size > 1 and dev.type != "cuda":
        raise ValueError(f"mok: x is on device {dev}, but the layer is expert-parallel over world_size = "
                         f"{cfg.world_size} ranks, which runs on the CUDA backend (a GPU per rank)")
    T = x.shape[0]
    if cfg.max_tokens is not None and T > cfg.max_tokens:
        raise ValueError(f"mok: x has {T} tokens, more than max_tokens = {cfg.max_tokens} of this layer")
    if cfg.fused:
        if w_router is None:
            raise ValueError("mok: w_router is required with routing='fused'")
        _check_tensor("w_router", w_router, (E, H), act, dev, hint)
        if topk_idx is not None or topk_weight is not None:
            raise ValueError("mok: topk_idx / topk_weight are inputs of routing='replay' only; this layer routes itself")
        if cfg.bias_select:
            if bias_select is None:
                raise ValueError("mok: bias_select [E] is required when the layer has bias_select=True")
            _check_tensor("bias_select", bias_select, (E,), real, dev)
        else:
            bias_select = None
    else:
        w_router = None
        bias_select = None
        if topk_idx is None or topk_weight is None:
            raise ValueError("mok: routing='replay' needs topk_idx [T, K] and topk_weight [T, K]")
        if not isinstance(topk_idx, Tensor):
            raise TypeError(f"mok: topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        if topk_idx.dtype == torch.int64:
            topk_idx = _narrow_topk_idx(topk_idx, E)
        _check_tensor("topk_idx", topk_idx, (T, K), torch.int32, dev, " (or torch.int64)")
        _check_tensor("topk_weight", topk_weight, (T, K), real, dev)
    _check_tensor("w13", w13, (El, 2 * F, H), act, dev, hint)
    _check_tensor("w2", w2, (El, H, F), act, dev, hint)
    if Fs:
        if ws13 is None or ws2 is None:
            raise ValueError(f"mok: ws13 and ws2 are required with shared_ffn = {Fs}")
        _check_tensor("ws13", ws13, (2 * Fs, H), act, dev, hint)
        _check_tensor("ws2", ws2, (H, Fs), act, dev, hint)
    else:
        if ws13 is not None or ws2 is not None:
            raise ValueError("mok: ws13 / ws2 given, but the layer has shared_ffn = 0")
    variants = (("b_router", b_router, cfg.router_bias, (E,), real), ("b13", b13, cfg.expert_bias, (El, 2 * F), act),
                ("b2", b2, cfg.expert_bias, (El, H), act), ("w_sg", w_sg, cfg.shared_gate, (H,), act))
    for name, t, on, shape, dtype in variants:
        if on:
            if t is None:
                raise ValueError(f"mok: {name} {list(shape)} is required by this layer's config")
            _check_tensor(name, t, shape, dtype, dev, hint if dtype == act else "")
        elif t is not None:
            raise ValueError(f"mok: {name} given, but the layer's config has no such parameter")
    grad_acc: List[Tensor] = []
    if cfg.wgrad_fp32_accum:
        weights = (w_router, w13, w2, ws13, ws2, b_router, b13, b2, w_sg)
        if main_grads is None:
            main_grads = [getattr(w, "main_grad", None) if w is not None else None for w in weights]
        main_grads = list(main_grads)
        if len(main_grads) == 5 and not any(v[2] for v in variants):
            main_grads += [None] * 4
        names = tuple(f"main_grads[{i}] ({n})" for i, n in enumerate(GRAD_ACC_NAMES))
        shapes = ((E, H), (El, 2 * F, H), (El, H, F), (2 * Fs, H), (H, Fs)) + tuple(v[3] for v in variants)
        needed = (cfg.fused, True, True, Fs > 0, Fs > 0) + tuple(v[2] for v in variants)
        if len(main_grads) != len(GRAD_ACC_NAMES):
            raise ValueError(f"mok: main_grads must be [{', '.join(GRAD_ACC_NAMES)}] (None where the layer has none)")
        for name, g, shape, need in zip(names, main_grads, shapes, needed):
            if need:
                if g is None:
                    raise ValueError(f"mok: wgrad_fp32_accum needs {name}: pass main_grads or set .main_grad on the weight")
                _check_tensor(name, g, shape, real, dev)
                grad_acc.append(g)
            else:
                grad_acc.append(x.new_empty((0,), dtype=real))
    y, aux, z, tpe, idx, wt, _saved = torch.ops.mok.moe_forward(
        x, w_router, bias_select, w13, w2, ws13, ws2, topk_idx, topk_weight, grad_acc, cfg.key(),
        b_router, b13, b2, w_sg
    )
    return MoEOutput(y, aux, z, tpe, idx, wt.detach())
