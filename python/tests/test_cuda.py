"""mok.MoE on the CUDA backend (skipped without a GPU; `make test-gpu` runs it on the
H200): the GPU layer against the CPU layer with the same weights (the variants too:
gpt-oss's, DeepSeek-V3's groups, Qwen2-MoE's gated shared expert), bitwise repeatable
steps, replay routing (the shared expert with and without its gate),
torch.compile(fullgraph=True) against eager, and reduce_replicated on GPU partials
against the host's bits."""
import copy

import pytest
import torch

import mok

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# a shape the kernels take: H, F, Fs multiples of 64, E a multiple of 8
T, H, F, E, K, FS = 300, 128, 128, 16, 2, 64
TOL = 1e-2  # the two backends differ in the order of fp32 sums inside dot products


def step(m, x, dy, idx=None, w=None):
    """forward + backward through autograd on x's device; outputs and gradients"""
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if idx is not None:
        w = w.detach().clone().requires_grad_(True)
        y = m(x, idx, w)
        torch.autograd.backward([y], [dy])
    else:
        y = m(x)
        real = m.config.real_dtype
        one = torch.ones((), dtype=real, device=x.device)
        torch.autograd.backward([y, m.aux_loss, m.z_loss], [dy, 1.3 * one, 0.7 * one])
    out = {"y": y.detach(), "dx": x.grad, "topk_idx": m.topk_idx, "tokens_per_expert": m.tokens_per_expert}
    if idx is None:
        out.update(aux_loss=m.aux_loss.detach(), z_loss=m.z_loss.detach())
    else:
        out["d_topk_weight"] = w.grad
    for name in ("w_router", "w13", "w2", "ws13", "ws2", "b_router", "b13", "b2", "w_sg"):
        p = getattr(m, name)
        if p is not None:
            out["d_" + name] = p.grad
    return out


def rel_err(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())


def inputs(device):
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(T, H, generator=g) * 2 - 1).to(torch.bfloat16)
    dy = (torch.rand(T, H, generator=g) * 2 - 1).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = 0.5 + 0.5 * torch.rand(T, K, generator=g)
    return [t.to(device) for t in (x, dy, idx, w)]


@pytest.mark.parametrize("kw", [dict(score="softmax", aux_loss_coef=1e-2, z_loss_coef=1e-3, shared_ffn=FS),
                                dict(score="sigmoid", bias_select=True, route_scale=2.0),
                                # gpt-oss's router and experts: logit bias, expert biases, clamped SwiGLU
                                dict(router_bias=True, expert_bias=True, swiglu_limit=7.0, aux_loss_coef=1e-2),
                                # DeepSeek-V3's router: 4 groups, the best 2 by their top-2 sums
                                dict(score="sigmoid", bias_select=True, route_scale=2.5, n_group=4, topk_group=2,
                                     shared_ffn=FS),
                                # Qwen2-MoE's gated shared expert: sigmoid(x . w_sg) scales it, w_sg's gradient
                                dict(shared_ffn=FS, shared_gate=True, aux_loss_coef=1e-2, z_loss_coef=1e-3)])
def test_cuda_matches_cpu(kw):
    cpu = mok.MoE(H, F, E, K, **kw)
    gpu = copy.deepcopy(cpu).cuda()
    x, dy, _, _ = inputs("cpu")
    a = step(cpu, x, dy)
    b = step(gpu, x.cuda(), dy.cuda())
    differ = (a["topk_idx"] != b["topk_idx"].cpu()).float().mean().item()
    assert differ <= 0.01, f"{differ:.2%} of the top-K slots differ (only near-ties may)"
    errs = {k: rel_err(b[k], a[k]) for k in a if k not in ("topk_idx", "tokens_per_expert")}
    assert all(e <= TOL for e in errs.values()), errs
    assert ("d_w_sg" in errs) == bool(kw.get("shared_gate"))  # the gate's gradient is among them


def same_bits_as_kept(**variant):
    """On the GPU: a layer with `variant` options and one without (the same weights),
    one step of each, every output and gradient the same bits. Returns (variant, x, dy,
    outputs)."""
    kw = dict(aux_loss_coef=1e-2, z_loss_coef=1e-3, shared_ffn=FS, max_tokens=T)
    keep = mok.MoE(H, F, E, K, reuse_saved=False, **kw).cuda()
    other = mok.MoE(H, F, E, K, **{"reuse_saved": False, **variant}, **kw).cuda()
    other.load_state_dict(keep.state_dict())
    x, dy, _, _ = inputs("cuda")
    a, b = step(keep, x, dy), step(other, x, dy)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return other, x, dy, a


def test_cuda_recompute_gate_up_gives_the_same_bits():
    """recompute_gate_up on the GPU: every output and gradient equal to keeping gate|up,
    also with another call between forward and backward (its workspace may be the same
    memory)."""
    redo, x, dy, a = same_bits_as_kept(recompute_gate_up=True)
    redo.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = redo(xr)
    losses = [redo.aux_loss, redo.z_loss]
    with torch.no_grad():
        redo(x.flip(0))
    one = torch.ones((), device="cuda")
    torch.autograd.backward([y] + losses, [dy, 1.3 * one, 0.7 * one])
    assert torch.equal(y, a["y"]) and torch.equal(xr.grad, a["dx"])
    for name in ("w_router", "w13", "w2", "ws13", "ws2"):
        assert torch.equal(getattr(redo, name).grad, a["d_" + name]), name


def test_cuda_reuse_saved_gives_the_same_bits_and_backwards_again():
    """reuse_saved (the default) on the GPU: every output and gradient equal to keeping
    saved; a second backward through the same forward (retain_graph=True) runs the
    forward again into the used-up saved tensor first, and adds the same gradients
    again, with no device error."""
    reuse, x, dy, a = same_bits_as_kept(reuse_saved=True)
    mok.synchronize()
    reuse.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = reuse(xr)
    one = torch.ones((), device="cuda")
    for _ in range(2):  # the losses' gradients as step() gives them
        torch.autograd.backward([y, reuse.aux_loss, reuse.z_loss], [dy, 1.3 * one, 0.7 * one], retain_graph=True)
    mok.synchronize()
    assert torch.equal(xr.grad, 2 * a["dx"])  # (x + x is exact: twice the one backward's bits)
    for name in ("w_router", "w13", "w2", "ws13", "ws2"):
        assert torch.equal(getattr(reuse, name).grad, 2 * a["d_" + name]), name


@pytest.mark.parametrize("kw", [dict(shared_ffn=FS), dict(shared_ffn=FS, shared_gate=True)],
                         ids=["shared", "shared-gate"])
def test_cuda_replay_matches_cpu(kw):
    cpu = mok.MoE(H, F, E, K, routing="replay", **kw)
    gpu = copy.deepcopy(cpu).cuda()
    x, dy, idx, w = inputs("cpu")
    a = step(cpu, x, dy, idx, w)
    b = step(gpu, x.cuda(), dy.cuda(), idx.cuda(), w.cuda())
    assert torch.equal(a["tokens_per_expert"], b["tokens_per_expert"].cpu())
    errs = {k: rel_err(b[k], a[k]) for k in a if k not in ("topk_idx", "tokens_per_expert")}
    assert all(e <= TOL for e in errs.values()), errs
    assert ("d_w_sg" in errs) == bool(kw.get("shared_gate"))


def test_cuda_int64_index_outside_int32_is_refused_on_the_device():
    """An int64 replay index beyond int32 is not wrapped (2^32 + 5 is not expert 5): on
    the GPU it is refused by the kernel, without a host wait, and reported by
    mok.synchronize; the next step runs."""
    gpu = mok.MoE(H, F, E, K, routing="replay", device="cuda")
    x, dy, idx, w = inputs("cuda")
    mok.synchronize()
    bad = idx.long()
    bad[3, 1] = 2**32 + 5
    gpu(x, bad, w)
    with pytest.raises(mok.MokError, match="INDEX_OUT_OF_RANGE"):
        mok.synchronize()
    gpu(x, idx.long(), w)
    mok.synchronize()


def test_cuda_two_steps_are_bitwise_equal():
    m = mok.MoE(H, F, E, K, aux_loss_coef=1e-2, shared_ffn=FS, device="cuda")
    x, dy, _, _ = inputs("cuda")
    a, b = step(m, x, dy), step(m, x, dy)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_cuda_compile_fullgraph_matches_eager():
    m = mok.MoE(H, F, E, K, aux_loss_coef=1e-2, device="cuda")
    x, dy, _, _ = inputs("cuda")
    eager = step(m, x, dy)
    compiled = torch.compile(m, fullgraph=True)
    m.zero_grad(set_to_none=True)
    xc = x.detach().clone().requires_grad_(True)
    y = compiled(xc)
    y.backward(dy)
    # aux_loss gets no gradient here, so compare y and dx (the aux loss's router path
    # only changes d_w_router)
    assert torch.equal(y.detach(), eager["y"])
    m2 = mok.MoE(H, F, E, K, aux_loss_coef=1e-2, device="cuda")
    m2.load_state_dict(m.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    m2(x2).backward(dy)
    assert torch.equal(xc.grad, x2.grad)


def test_cuda_reduce_replicated_matches_host():
    p = torch.randn(77, 33) * torch.logspace(-3, 3, 77)[:, None]
    assert torch.equal(mok.reduce_replicated(p.cuda()).cpu(), mok.reduce_replicated(p))
