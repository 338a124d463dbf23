"""A plain PyTorch implementation of the mok layer, forward and backward, written from
the contract (DESIGN.md section 1, docs/): fp32 arithmetic on bf16 values, rounded to
bf16 at the contract's rounding points. The backward is written out by hand (not by
autograd) so that it rounds where the contract says: per slot dy_j = bf16(g dy),
d_a = bf16(SwiGLU derivative), dx_j = bf16(d_a w13), dx = bf16(sum_j dx_j + router
path + shared path), dlogits = bf16(.), weight gradients fp32 sums rounded to bf16.
Only the router's derivative (scores -> logits, with the losses) is taken by autograd,
in fp32, from the saved logits, then rounded like the library's dlogits."""
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


def _weights(s, idx, normalize, route_scale):
    g = s.gather(1, idx)
    if normalize:
        g = g / g.sum(-1, keepdim=True)
    return g * route_scale


def reference(cfg, x, w_router, w13, w2, ws13, ws2, bias_select, dy, d_aux, d_z, topk_idx=None, topk_weight=None):
    """Returns a dict of forward outputs and gradients (fp32 tensors; bf16-rounded
    where the library's outputs are bf16)."""
    X = x.float()
    T, H = X.shape
    E, K, F, Fs = cfg.num_experts, cfg.top_k, cfg.ffn, cfg.shared_ffn
    out = {}
    # ---- routing ----
    if cfg.routing == "fused":
        logits = X @ w_router.float().T
        s = _scores(logits, cfg.score)
        key = s + bias_select.float() if cfg.bias_select else s
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
        a = R(X[t] @ w13[e].float().T)
        gate, up = a[:, :F], a[:, F:]
        h = R(Fn.silu(gate) * up)
        o[t, j] = R(h @ w2[e].float().T)
        a_slot[t, j] = a
        h_slot[t, j] = h
    if Fs:
        a_s = R(X @ ws13.float().T)
        h_s = R(Fn.silu(a_s[:, :Fs]) * a_s[:, Fs:])
        o_s = R(h_s @ ws2.float().T)
    acc = torch.zeros(T, H)
    for j in range(K):
        acc = acc + g[:, j : j + 1] * o[:, j]
    if Fs:
        acc = acc + o_s
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
    dx_slots = torch.zeros(T, K, H)
    for e in range(E):
        t, j = (idx == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        dy_j = R(g[t, j][:, None] * DY[t])
        dh = dy_j @ w2[e].float()
        a = a_slot[t, j]
        gate, up = a[:, :F], a[:, F:]
        sg = torch.sigmoid(gate)
        silu = gate * sg
        dsilu = sg * (1 + gate * (1 - sg))
        d_a = R(torch.cat([dh * up * dsilu, dh * silu], 1))
        dx_slots[t, j] = R(d_a @ w13[e].float())
        dw2[e] = dy_j.T @ h_slot[t, j]
        dw13[e] = d_a.T @ X[t]
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
    else:
        out["d_topk_weight"] = dg
    if Fs:
        dh_s = DY @ ws2.float()
        gate, up = a_s[:, :Fs], a_s[:, Fs:]
        sg = torch.sigmoid(gate)
        silu = gate * sg
        dsilu = sg * (1 + gate * (1 - sg))
        d_a_s = R(torch.cat([dh_s * up * dsilu, dh_s * silu], 1))
        dx_acc = dx_acc + d_a_s @ ws13.float()
        out["d_ws13"] = d_a_s.T @ X
        out["d_ws2"] = DY.T @ h_s
    out["dx"] = R(dx_acc)
    out["d_w13"] = dw13
    out["d_w2"] = dw2
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (b the reference), in float64."""
    a, b = a.double(), b.double()
    nb = b.norm().item()
    d = (a - b).norm().item()
    return d / nb if nb > 0 else d
