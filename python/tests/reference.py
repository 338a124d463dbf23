"""A plain PyTorch implementation of the mok layer, forward and backward, written from
the contract (DESIGN.md section 1, docs/): fp32 arithmetic on bf16 values, rounded to
bf16 at the contract's rounding points. The backward is written out by hand (not by
autograd) so that it rounds where the contract says: per slot dy_j = bf16(g dy),
d_a = bf16(SwiGLU derivative), dx_j = bf16(d_a w13), dx = bf16(sum_j dx_j + router
path + shared path), dlogits = bf16(.), weight gradients fp32 sums rounded to bf16.
Only the router's derivative (scores -> logits, with the losses) is taken by autograd,
in fp32, from the saved logits, then rounded like the library's dlogits.

The router and expert variants (mok.h, docs/CPU.md) likewise: group-limited routing
(the choice among the kept groups), the router logit bias b_router, the expert biases
b13 and b2 (added before a's and o's rounding; d_b13, d_b2 their rows' sums), gpt-oss's
clamped SwiGLU (its derivative written out, zero through a clamp) and the gated shared
expert (sigmoid(x . w_sg), dy_s = bf16(s_g dy), dl_g = bf16(.))."""
from __future__ import annotations

import torch
import torch.nn.functional as Fn


def R(t: torch.Tensor) -> torch.Tensor:
    """round to bf16 and back to fp32"""
    return t.to(torch.bfloat16).float()


def _scores(logits, score):
    return torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)


def _topk(key, K):
    # larger first, ties to the lower expert index
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    return order[:, :K]


def _group_mask(cfg, key):
    """[T, E] bool: the experts of each token's topk_group best groups (a group's score
    the sum of its two largest keys, or the largest; ties to the lower group index)."""
    T, E = key.shape
    G = cfg.n_group
    grouped = key.reshape(T, G, E // G)
    top = torch.sort(grouped, dim=-1, descending=True).values
    score = top[..., 0] + top[..., 1] if cfg.group_score == "top2" and E // G >= 2 else top[..., 0]
    kept = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, : cfg.topk_group]
    mask = torch.zeros(T, G, dtype=torch.bool)
    mask.scatter_(1, kept, True)
    return mask.repeat_interleave(E // G, dim=1)


def _f32(v):
    """a config float as the library reads it (fp32)"""
    return torch.tensor(v, dtype=torch.float32).item()


def _act(cfg, a, F, routed):
    """h from gate|up a (fp32 of bf16 values): the SwiGLU, or gpt-oss's clamped one"""
    gate, up = a[:, :F], a[:, F:]
    if not (routed and cfg.swiglu_limit is not None):
        return Fn.silu(gate) * up
    lim, alpha = _f32(cfg.swiglu_limit), _f32(cfg.swiglu_alpha)
    g, u = gate.clamp(max=lim), up.clamp(-lim, lim)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def _act_backward(cfg, a, dh, F, routed):
    """[d_gate | d_up] in fp32 (not rounded)"""
    gate, up = a[:, :F], a[:, F:]
    if not (routed and cfg.swiglu_limit is not None):
        sg = torch.sigmoid(gate)
        return torch.cat([dh * up * sg * (1 + gate * (1 - sg)), dh * gate * sg], 1)
    lim, alpha = _f32(cfg.swiglu_limit), _f32(cfg.swiglu_alpha)
    g, u = gate.clamp(max=lim), up.clamp(-lim, lim)
    s = torch.sigmoid(alpha * g)
    d_gate = torch.where(gate > lim, 0.0, dh * (u + 1) * (s + alpha * g * s * (1 - s)))
    d_up = torch.where((up > lim) | (up < -lim), 0.0, dh * g * s)
    return torch.cat([d_gate, d_up], 1)


def _weights(s, idx, normalize, route_scale):
    g = s.gather(1, idx)
    if normalize:
        g = g / g.sum(-1, keepdim=True)
    return g * route_scale


def reference(cfg, x, w_router, w13, w2, ws13, ws2, bias_select, dy, d_aux, d_z, topk_idx=None, topk_weight=None,
              b_router=None, b13=None, b2=None, w_sg=None):
    """Returns a dict of forward outputs and gradients (fp32 tensors; bf16-rounded
    where the library's outputs are bf16). b_router, b13, b2, w_sg: the variants'
    parameters, where the config has them."""
    X = x.float()
    T, H = X.shape
    E, K, F, Fs = cfg.num_experts, cfg.top_k, cfg.ffn, cfg.shared_ffn
    out = {}
    # ---- routing ----
    if cfg.routing == "fused":
        logits = X @ w_router.float().T
        if cfg.router_bias:
            logits = logits + b_router.float()
        s = _scores(logits, cfg.score)
        key = s + bias_select.float() if cfg.bias_select else s
        if cfg.n_group > 1:
            key = torch.where(_group_mask(cfg, key), key, float("-inf"))
        idx = _topk(key, K)
        g = _weights(s, idx, cfg.normalize, cfg.route_scale)
    else:
        idx = topk_idx.long()
        g = topk_weight.float()
    out["topk_idx"] = idx
    out["topk_weight"] = g
    counts = torch.bincount(idx.flatten(), minlength=E)
    out["tokens_per_expert"] = counts
    # ---- experts, slot by slot (grouped by expert) ----
    o = torch.zeros(T, K, H)
    a_slot = torch.zeros(T, K, 2 * F)
    h_slot = torch.zeros(T, K, F)
    for e in range(E):
        t, j = (idx == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        a = X[t] @ w13[e].float().T
        a = R(a + b13[e].float() if cfg.expert_bias else a)
        h = R(_act(cfg, a, F, True))
        o_e = h @ w2[e].float().T
        o[t, j] = R(o_e + b2[e].float() if cfg.expert_bias else o_e)
        a_slot[t, j] = a
        h_slot[t, j] = h
    if Fs:
        a_s = R(X @ ws13.float().T)
        h_s = R(Fn.silu(a_s[:, :Fs]) * a_s[:, Fs:])
        o_s = R(h_s @ ws2.float().T)
        sg = torch.sigmoid(X @ w_sg.float()) if cfg.shared_gate else None
    acc = torch.zeros(T, H)
    for j in range(K):
        acc = acc + g[:, j : j + 1] * o[:, j]
    if Fs:
        acc = acc + (sg[:, None] * o_s if cfg.shared_gate else o_s)
    out["y"] = R(acc)
    # ---- losses ----
    if cfg.routing == "fused":
        P = s.mean(0)
        f = counts.float() / (T * K)
        aux = cfg.aux_loss_coef * E * (f * P).sum()
        lse = torch.logsumexp(logits, -1)
        z = cfg.z_loss_coef * (lse * lse).mean()
        out["aux_loss"], out["z_loss"] = aux, z
    # ---- backward ----
    DY = dy.float()
    dg = (DY[:, None, :] * o).sum(-1)  # [T, K]
    dx_acc = torch.zeros(T, H)
    dw13 = torch.zeros(E, 2 * F, H)
    dw2 = torch.zeros(E, H, F)
    db13, db2 = torch.zeros(E, 2 * F), torch.zeros(E, H)
    dx_slots = torch.zeros(T, K, H)
    for e in range(E):
        t, j = (idx == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        dy_j = R(g[t, j][:, None] * DY[t])
        dh = dy_j @ w2[e].float()
        d_a = R(_act_backward(cfg, a_slot[t, j], dh, F, True))
        dx_slots[t, j] = R(d_a @ w13[e].float())
        dw2[e] = dy_j.T @ h_slot[t, j]
        dw13[e] = d_a.T @ X[t]
        db13[e], db2[e] = d_a.sum(0), dy_j.sum(0)
    for j in range(K):
        dx_acc = dx_acc + dx_slots[:, j]
    if cfg.routing == "fused":
        L = logits.detach().clone().requires_grad_(True)
        s2 = _scores(L, cfg.score)
        g2 = _weights(s2, idx, cfg.normalize, cfg.route_scale)
        total = (dg * g2).sum()
        if cfg.aux_loss_coef:
            total = total + d_aux * cfg.aux_loss_coef * E * (counts.float() / (T * K) * s2.mean(0)).sum()
        if cfg.z_loss_coef:
            lse2 = torch.logsumexp(L, -1)
            total = total + d_z * cfg.z_loss_coef * (lse2 * lse2).mean()
        (dlogits,) = torch.autograd.grad(total, L)
        dlogits = R(dlogits)
        dx_acc = dx_acc + dlogits @ w_router.float()
        out["d_w_router"] = dlogits.T @ X
        if cfg.router_bias:
            out["d_b_router"] = dlogits.sum(0)
    else:
        out["d_topk_weight"] = dg
    if Fs:
        dy_s = R(sg[:, None] * DY) if cfg.shared_gate else DY
        dh_s = dy_s @ ws2.float()
        d_a_s = R(_act_backward(cfg, a_s, dh_s, Fs, False))
        dx_acc = dx_acc + d_a_s @ ws13.float()
        out["d_ws13"] = d_a_s.T @ X
        out["d_ws2"] = dy_s.T @ h_s
        if cfg.shared_gate:
            dl_g = R((DY * o_s).sum(-1) * sg * (1 - sg))
            dx_acc = dx_acc + dl_g[:, None] * w_sg.float()
            out["d_w_sg"] = dl_g @ X
    out["dx"] = R(dx_acc)
    out["d_w13"] = dw13
    out["d_w2"] = dw2
    if cfg.expert_bias:
        out["d_b13"], out["d_b2"] = db13, db2
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (b the reference), in float64."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else d
