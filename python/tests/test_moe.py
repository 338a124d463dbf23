"""mok.MoE on the CPU backend: results against a plain PyTorch implementation of the
same layer (tests/reference.py), gradcheck in EXACT numerics, argument errors,
determinism, wgrad_fp32_accum, torch.compile."""
import copy
import dataclasses

import pytest
import torch

import mok
from reference import reference, rel_err

TOL = 2e-2
D_AUX, D_Z = 1.3, 0.7


def make_inputs(T, H, E, K, dtype=torch.bfloat16, real=torch.float32):
    x = (torch.rand(T, H, dtype=torch.float64) * 2 - 1).to(dtype)
    dy = (torch.rand(T, H, dtype=torch.float64) * 2 - 1).to(dtype)
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    w = (0.5 + 0.5 * torch.rand(T, K, dtype=torch.float64)).to(real)
    return x, dy, idx, w


def run(m, x, dy, idx=None, w=None, d_aux=D_AUX, d_z=D_Z):
    """forward + backward through autograd; returns outputs and gradients"""
    cfg = m.config
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if idx is not None:
        w = w.detach().clone().requires_grad_(True)
        y = m(x, idx, w)
    else:
        y = m(x)
    real = cfg.real_dtype
    torch.autograd.backward(
        [y, m.aux_loss, m.z_loss],
        [dy, torch.tensor(d_aux, dtype=real), torch.tensor(d_z, dtype=real)],
    )
    out = {
        "y": y.detach(),
        "dx": x.grad,
        "aux_loss": m.aux_loss.detach(),
        "z_loss": m.z_loss.detach(),
        "tokens_per_expert": m.tokens_per_expert,
        "topk_idx": m.topk_idx,
        "topk_weight": m.topk_weight,
    }
    for name in ("w_router", "w13", "w2", "ws13", "ws2", "b_router", "b13", "b2", "w_sg"):  # (the variants' last)
        p = getattr(m, name)
        if p is not None:
            out["d_" + name] = p.main_grad.clone() if cfg.wgrad_fp32_accum else p.grad
    if idx is not None:
        out["d_topk_weight"] = w.grad
    return out


def check_against_reference(m, x, dy, idx=None, w=None, d_aux=D_AUX, d_z=D_Z):
    got = run(m, x, dy, idx, w, d_aux, d_z)
    ref = reference(
        m.config, x, m.w_router, m.w13, m.w2, m.ws13, m.ws2, m.bias_select, dy, d_aux, d_z, idx, w,
        b_router=m.b_router, b13=m.b13, b2=m.b2, w_sg=m.w_sg,
    )
    for name in ("b_router", "b13", "b2", "w_sg"):  # every variant parameter's gradient is compared
        if getattr(m, name) is not None:
            assert "d_" + name in ref and got["d_" + name].dtype == getattr(m, name).dtype, name
    assert torch.equal(got["topk_idx"].long(), ref["topk_idx"]), "routing differs from the reference"
    assert torch.equal(got["tokens_per_expert"].long(), ref["tokens_per_expert"])
    errs = {}
    for name, r in ref.items():
        if name in ("topk_idx", "tokens_per_expert"):
            continue
        if name in ("aux_loss", "z_loss") and float(r.detach()) == 0.0:
            assert float(got[name]) == 0.0
            continue
        errs[name] = rel_err(got[name].float(), r.float())
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad} (all: {errs})"
    return got, errs


T, H, F, E, K, FS = 200, 64, 48, 8, 3, 24

CASES = {
    "softmax-shared-losses-bias": dict(score="softmax", shared_ffn=FS, aux_loss_coef=1e-2, z_loss_coef=1e-3, bias_select=True),
    "sigmoid-shared-losses-unnormalized": dict(score="sigmoid", normalize=False, route_scale=2.5, shared_ffn=FS, aux_loss_coef=1e-2, z_loss_coef=1e-3),
    "sigmoid-normalized": dict(score="sigmoid"),
    "softmax-plain": dict(score="softmax"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_matches_reference(case):
    m = mok.MoE(H, F, E, K, **CASES[case])
    if m.config.bias_select:
        m.bias_select.copy_(0.05 * torch.randn(E))
    x, dy, _, _ = make_inputs(T, H, E, K)
    got, errs = check_against_reference(m, x, dy)
    if m.config.aux_loss_coef:
        assert float(got["aux_loss"]) > 0 and float(got["z_loss"]) > 0


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_loss_gradients_reach_the_router(score):
    """With dy = 0 the router gradient is the aux and z losses' alone."""
    m = mok.MoE(H, F, E, K, score=score, shared_ffn=FS, aux_loss_coef=0.1, z_loss_coef=0.01)
    x, _, _, _ = make_inputs(T, H, E, K)
    dy = torch.zeros(T, H, dtype=torch.bfloat16)
    got, errs = check_against_reference(m, x, dy)
    assert got["d_w_router"].abs().max() > 0
    # and an unused loss gives no gradient
    m.zero_grad()
    x2 = x.clone().requires_grad_(True)
    y = m(x2)
    (y.float() * 0).sum().backward()
    assert m.w_router.grad.abs().max() == 0


def test_replay_matches_reference():
    m = mok.MoE(H, F, E, K, routing="replay", shared_ffn=FS)
    assert m.w_router is None
    x, dy, idx, w = make_inputs(T, H, E, K)
    got, errs = check_against_reference(m, x, dy, idx, w)
    assert got["d_topk_weight"].dtype == torch.float32 and got["d_topk_weight"].shape == (T, K)
    assert float(got["aux_loss"]) == 0.0


def test_replay_accepts_int64_indices():
    m = mok.MoE(H, F, E, K, routing="replay")
    x, dy, idx, w = make_inputs(16, H, E, K)
    y32 = m(x, idx, w)
    y64 = m(x, idx.long(), w)
    assert torch.equal(y32, y64)


@pytest.mark.parametrize("value", [2**32 + 5, 2**32 + 1, -(2**32) + 3, E, -1])
def test_replay_int64_indices_outside_int32_are_refused(value):
    """An int64 index is range-checked before it is narrowed: 2^32 + 5 must not route to
    expert 5, nor 2^32 + 1 read as a duplicate of expert 1."""
    m = mok.MoE(H, F, E, K, routing="replay")
    x, dy, idx, w = make_inputs(16, H, E, K)
    idx = idx.long()
    idx[3, 1] = value
    with pytest.raises(ValueError, match=r"topk_idx\[3, 1\] = " + str(value)):
        m(x, idx, w)


def test_functional_form_matches_module():
    m = mok.MoE(H, F, E, K, shared_ffn=FS, aux_loss_coef=1e-2)
    x, _, _, _ = make_inputs(50, H, E, K)
    out = mok.moe_forward(x, m.w_router, m.w13, m.w2, m.ws13, m.ws2, config=m.config)
    y = m(x)
    assert torch.equal(out.y, y)
    assert torch.equal(out.aux_loss, m.aux_loss)
    assert torch.equal(out.tokens_per_expert, m.tokens_per_expert)
    assert out.topk_idx.shape == (50, K) and out.topk_weight.shape == (50, K)
    # the config may also be given as its key string
    out2 = mok.moe_forward(x, m.w_router, m.w13, m.w2, m.ws13, m.ws2, config=m.config.key())
    assert torch.equal(out2.y, y)


def test_module_basics():
    m = mok.MoE(H, F, E, K, shared_ffn=FS)
    assert m.w_router.shape == (E, H) and m.w_router.dtype == torch.bfloat16
    assert m.w13.shape == (E, 2 * F, H) and m.w2.shape == (E, H, F)
    assert m.ws13.shape == (2 * FS, H) and m.ws2.shape == (H, FS)
    assert m.bias_select.shape == (E,) and m.bias_select.dtype == torch.float32
    assert not m.bias_select.requires_grad
    # nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in))
    for p, fan_in in ((m.w_router, H), (m.w13, H), (m.w2, F), (m.ws13, H), (m.ws2, FS)):
        b = 1 / fan_in ** 0.5
        assert p.float().abs().max() <= b * 1.01 and p.float().abs().max() > 0.8 * b
    # bf16 conversion keeps bias_select fp32
    m.to(torch.bfloat16)
    assert m.bias_select.dtype == torch.float32
    assert "num_experts=8" in repr(m)
    names = {n for n, _ in m.named_parameters()}
    assert names == {"w_router", "w13", "w2", "ws13", "ws2"}


def test_empty_batch():
    m = mok.MoE(H, F, E, K, shared_ffn=FS, aux_loss_coef=1e-2, wgrad_fp32_accum=False)
    x = torch.zeros(0, H, dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.shape == (0, H)
    (y.float().sum() + m.aux_loss).backward()
    assert x.grad.shape == (0, H)
    assert m.w13.grad.abs().max() == 0 and m.w_router.grad.abs().max() == 0
    assert int(m.tokens_per_expert.sum()) == 0


def test_fewer_tokens_than_max_tokens():
    m = mok.MoE(H, F, E, K, max_tokens=128)
    x, dy, _, _ = make_inputs(100, H, E, K)
    check_against_reference(m, x, dy)
    x2, dy2, _, _ = make_inputs(128, H, E, K)
    check_against_reference(m, x2, dy2)


# ---------------------------------------------------------------- gradcheck (EXACT)


def _exact_module(**kw):
    m = mok.MoE(8, 6, 4, 2, exact=True, **kw)
    assert m.w13.dtype == torch.float64
    return m


@pytest.mark.parametrize(
    "kw",
    [
        dict(score="softmax", shared_ffn=4, aux_loss_coef=0.3, z_loss_coef=0.2),
        dict(score="sigmoid", normalize=False, route_scale=1.7, shared_ffn=3, aux_loss_coef=0.3, z_loss_coef=0.2),
        dict(score="softmax", bias_select=True),
    ],
    ids=["softmax-shared-losses", "sigmoid-unnormalized", "bias-select"],
)
def test_gradcheck_fused(kw):
    m = _exact_module(**kw)
    cfg = m.config
    if cfg.bias_select:
        m.bias_select.copy_(0.1 * torch.randn(4, dtype=torch.float64))
    x = torch.rand(7, 8, dtype=torch.float64, requires_grad=True) * 2 - 1
    x = x.detach().requires_grad_(True)
    Fs = cfg.shared_ffn

    def f(x, wr, w13, w2, *shared):
        ws13, ws2 = shared if shared else (None, None)
        o = mok.moe_forward(x, wr, w13, w2, ws13, ws2, config=cfg, bias_select=m.bias_select if cfg.bias_select else None)
        return o.y, o.aux_loss, o.z_loss

    params = [m.w_router, m.w13, m.w2] + ([m.ws13, m.ws2] if Fs else [])
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_replay():
    m = _exact_module(routing="replay", shared_ffn=3)
    cfg = m.config
    x = (torch.rand(7, 8, dtype=torch.float64) * 2 - 1).requires_grad_(True)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(7)]).to(torch.int32)
    w = (0.5 + torch.rand(7, 2, dtype=torch.float64)).requires_grad_(True)

    def f(x, w13, w2, ws13, ws2, w):
        return mok.moe_forward(x, None, w13, w2, ws13, ws2, config=cfg, topk_idx=idx, topk_weight=w).y

    assert torch.autograd.gradcheck(f, (x, m.w13, m.w2, m.ws13, m.ws2, w), eps=1e-6, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- errors


def test_bad_arguments_are_named():
    m = mok.MoE(H, F, E, K, max_tokens=64)
    with pytest.raises(ValueError, match="x must be 2-D"):
        m(torch.zeros(H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="hidden"):
        m(torch.zeros(4, H + 1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        m(torch.zeros(4, H, dtype=torch.float32))
    with pytest.raises(ValueError, match="max_tokens = 64"):
        m(torch.zeros(65, H, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        m([[0.0] * H])
    with pytest.raises(ValueError, match="topk_idx"):
        m(torch.zeros(4, H, dtype=torch.bfloat16), torch.zeros(4, K, dtype=torch.int32), torch.zeros(4, K))
    # functional form: a weight of the wrong dtype / shape
    x = torch.zeros(4, H, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="w13 has dtype torch.float32"):
        mok.moe_forward(x, m.w_router, m.w13.float(), m.w2, config=m.config)
    with pytest.raises(ValueError, match=r"w2 has shape \[8, 64, 47\]"):
        mok.moe_forward(x, m.w_router, m.w13, m.w2[:, :, :47], config=m.config)
    with pytest.raises(ValueError, match="w_router is required"):
        mok.moe_forward(x, None, m.w13, m.w2, config=m.config)
    with pytest.raises(ValueError, match="shared_ffn = 0"):
        mok.moe_forward(x, m.w_router, m.w13, m.w2, m.w2, m.w2, config=m.config)


def test_bad_replay_arguments():
    m = mok.MoE(H, F, E, K, routing="replay")
    x, _, idx, w = make_inputs(4, H, E, K)
    with pytest.raises(ValueError, match="needs topk_idx"):
        m(x)
    with pytest.raises(ValueError, match=r"topk_idx has shape \[4, 2\]"):
        m(x, idx[:, :2], w)
    with pytest.raises(TypeError, match="topk_weight has dtype torch.bfloat16"):
        m(x, idx, w.bfloat16())
    # what libmok itself rejects comes back as MokError with its status and message
    bad = idx.clone()
    bad[2, 1] = E
    with pytest.raises(mok.MokError, match="INDEX_OUT_OF_RANGE") as ei:
        m(x, bad, w)
    assert ei.value.status_name == "MOK_STATUS_INDEX_OUT_OF_RANGE" and "topk_idx[2, 1]" in str(ei.value)
    dup = idx.clone()
    dup[1, 1] = dup[1, 0]
    with pytest.raises(mok.MokError, match="DUPLICATE_INDEX"):
        m(x, dup, w)


def test_bad_configs():
    with pytest.raises(ValueError, match="top_k = 9"):
        mok.MoE(H, F, 8, 9)
    with pytest.raises(ValueError, match="score"):
        mok.MoE(H, F, E, K, score="relu")
    with pytest.raises(ValueError, match="routing"):
        mok.MoE(H, F, E, K, routing="learned")
    with pytest.raises(ValueError, match="hidden = 0"):
        mok.MoE(0, F, E, K)
    with pytest.raises(ValueError, match="finite"):
        mok.MoE(H, F, E, K, route_scale=float("nan"))
    with pytest.raises(ValueError, match="fused"):
        mok.MoE(H, F, E, K, routing="replay", aux_loss_coef=0.1)


def test_expert_parallel_configs():
    """world_size > 1 (a GPU per rank): the rules named, and a rank's share of experts."""
    ok_id = "00" * 128
    with pytest.raises(ValueError, match="comm_id"):
        mok.Config(H, F, 8, 2, world_size=2, max_tokens=64)
    with pytest.raises(ValueError, match="max_tokens"):
        mok.Config(H, F, 8, 2, world_size=2, comm_id=ok_id)
    with pytest.raises(ValueError, match="multiple of world_size"):
        mok.Config(H, F, 6, 2, world_size=4, comm_id=ok_id, max_tokens=64)
    with pytest.raises(ValueError, match="rank = 2"):
        mok.Config(H, F, 8, 2, world_size=2, rank=2, comm_id=ok_id, max_tokens=64)
    c = mok.Config(H, F, 8, 2, world_size=4, rank=3, comm_id=ok_id, max_tokens=64)
    assert c.local_experts == 2 and mok.Config(H, F, 8, 2).local_experts == 8
    # CPU tensors into an expert-parallel layer: named before any context is made
    from mok.ops import moe_forward

    x = torch.zeros(4, H, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(2, 2 * F, H, dtype=torch.bfloat16), torch.zeros(2, H, F, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expert-parallel over world_size = 4"):
        moe_forward(x, torch.zeros(8, H, dtype=torch.bfloat16), w13, w2, None, None, config=c)


def test_rank_init_is_a_slice_of_the_whole(monkeypatch):
    """reset_parameters draws the experts one at a time, in order, on every rank: a
    rank's experts under a seed are world_size = 1's experts of that rank, bit for bit
    (w13, w2 and the expert biases), the replicated weights are world_size = 1's, and no
    temporary holds more than one expert's tensor (or a replicated weight)."""
    E8, W = 8, 4
    torch.manual_seed(21)
    one = mok.MoE(H, F, E8, 2, expert_bias=True, router_bias=True)
    for rank in range(W):
        torch.manual_seed(21)
        layer = mok.MoE(H, F, E8, 2, expert_bias=True, router_bias=True)
        # the rank's config and tensors, as a process_group layer has them (CPU: no context is made)
        layer.config = dataclasses.replace(layer.config, world_size=W, rank=rank, comm_id="00" * 128, max_tokens=64)
        El = layer.config.local_experts
        for name in ("w13", "w2", "b13", "b2"):
            p = getattr(layer, name)
            setattr(layer, name, torch.nn.Parameter(torch.full((El,) + tuple(p.shape[1:]), float("nan"), dtype=p.dtype)))
        torch.manual_seed(21)
        sizes, empty = [], torch.empty

        def recorded_empty(*args, **kw):
            t = empty(*args, **kw)
            sizes.append(t.numel())
            return t

        monkeypatch.setattr(torch, "empty", recorded_empty)
        layer.reset_parameters()
        monkeypatch.undo()
        assert max(sizes) == max(2 * F * H, E8 * H), sizes  # (w13's expert, w_router)
        mine = slice(rank * El, (rank + 1) * El)
        for name in ("w13", "w2", "b13", "b2"):
            assert torch.equal(getattr(layer, name), getattr(one, name)[mine]), (rank, name)
        for name in ("w_router", "b_router"):
            assert torch.equal(getattr(layer, name), getattr(one, name)), (rank, name)


def test_cuda_is_a_clear_error_not_a_copy():
    """Without a GPU, a context for CUDA tensors fails with the library's
    MOK_STATUS_BACKEND_UNAVAILABLE (mok never copies to the CPU)."""
    from mok._context import Config, Context

    if not torch.cuda.is_available():
        # a shape the CUDA backend takes (multiples of 64), on a machine with no GPU:
        # BACKEND_UNAVAILABLE whether or not libmok was built with the CUDA backend
        cfg = Config(64, 64, E, K)
        with pytest.raises(mok.MokError, match="BACKEND_UNAVAILABLE") as ei:
            Context(cfg, 16, torch.device("cuda", 0))
        assert ei.value.status == 16  # MOK_STATUS_BACKEND_UNAVAILABLE
        assert "CUDA" in str(ei.value) or "device" in str(ei.value)
    # an unsupported device is named
    m = mok.MoE(H, F, E, K)
    with pytest.raises(ValueError, match="device meta"):
        m(torch.zeros(4, H, dtype=torch.bfloat16, device="meta"))


def test_exact_mode_rejects_bf16():
    m = _exact_module()
    with pytest.raises(TypeError, match="exact numerics"):
        m(torch.zeros(3, 8, dtype=torch.bfloat16))


# ---------------------------------------------------------------- determinism


def test_two_runs_are_bitwise_equal():
    m = mok.MoE(H, F, E, K, shared_ffn=FS, aux_loss_coef=1e-2, z_loss_coef=1e-3)
    x, dy, _, _ = make_inputs(T, H, E, K)
    a = run(m, x, dy)
    m.zero_grad()
    b = run(m, x, dy)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # another module with the same weights and another thread count: the same bits
    m2 = copy.deepcopy(m)
    m2.config = dataclasses.replace(m.config, num_threads=1)
    m2.zero_grad()
    c = run(m2, x, dy)
    for k in a:
        assert torch.equal(a[k], c[k]), k


def same_bits_as_kept(**variant):
    """A layer with `variant` options and one without (the same weights): one step of
    each, every output and gradient the same bits. Returns (kept, variant, x, dy, outputs)."""
    kw = dict(shared_ffn=FS, aux_loss_coef=1e-2, z_loss_coef=1e-3, max_tokens=T)
    m = mok.MoE(H, F, E, K, reuse_saved=False, **kw)
    r = mok.MoE(H, F, E, K, **{"reuse_saved": False, **variant}, **kw)
    r.load_state_dict(m.state_dict())
    x, dy, _, _ = make_inputs(T, H, E, K)
    a, b = run(m, x, dy), run(r, x, dy)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    return m, r, x, dy, a


def test_recompute_gate_up_gives_the_same_bits():
    """recompute_gate_up: every output and gradient equal to keeping gate|up, with a
    saved tensor smaller by 6 F bytes a routed row and 6 Fs a token (each piece
    256-byte aligned)."""
    m, r, x, dy, a = same_bits_as_kept(recompute_gate_up=True)
    # another call between forward and backward, whose workspace may be the same memory
    # (each call's is allocated for it; forward left gate|up in its own): backward
    # recomputes it, so the bits stay
    r.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = r(xr)
    losses = [r.aux_loss, r.z_loss]
    with torch.no_grad():
        r(x.flip(0))
    one = torch.tensor(1.0)
    torch.autograd.backward([y] + losses, [dy, one * D_AUX, one * D_Z])
    assert torch.equal(y, a["y"]) and torch.equal(xr.grad, a["dx"])
    for name in ("w_router", "w13", "w2", "ws13", "ws2"):
        assert torch.equal(getattr(r, name).grad, a["d_" + name]), name
    key = lambda mod: mod.config.key()
    args = lambda mod: (x, mod.w_router, None, mod.w13, mod.w2, mod.ws13, mod.ws2, None, None, [])
    kept = torch.ops.mok.moe_forward(*args(m), key(m))[-1].numel()
    less = torch.ops.mok.moe_forward(*args(r), key(r))[-1].numel()
    rows = T * K  # the default capacity
    pieces = [rows * 2 * F * 2, rows * F * 2, T * 2 * FS * 2, T * FS * 2]  # a, h; shared a, h (bf16)
    assert kept - less == sum(-(-n // 256) * 256 for n in pieces), (kept, less)


def test_reuse_saved_gives_the_same_bits():
    """reuse_saved (the default): every output and gradient equal to keeping saved."""
    assert mok.MoE(H, F, E, K).config.reuse_saved
    same_bits_as_kept(reuse_saved=True)


@pytest.mark.parametrize("kw", [dict(), dict(score="sigmoid", bias_select=True, n_group=2, topk_group=1,
                                             router_bias=True, expert_bias=True, shared_gate=True),
                                dict(routing="replay")], ids=["fused", "variants", "replay"])
def test_reuse_saved_second_backward(kw):
    """A second backward through one forward (retain_graph=True): the first used the
    saved tensor up (reuse_saved, the default), so the second runs the forward again
    into it first; after each backward every gradient has the bits of a layer that
    keeps saved, and a third runs too."""
    replay = kw.get("routing") == "replay"
    kw = dict(shared_ffn=FS, aux_loss_coef=0.0 if replay else 1e-2, **kw)
    keep = mok.MoE(H, F, E, K, reuse_saved=False, **kw)
    with torch.no_grad():
        for p in (keep.b_router, keep.b13, keep.b2, keep.w_sg):
            if p is not None:
                p.copy_(0.5 * torch.randn(p.shape))
        keep.bias_select.copy_(0.05 * torch.randn(E))
    reuse = mok.MoE(H, F, E, K, **kw)
    reuse.load_state_dict(keep.state_dict())
    x, dy, idx, w = make_inputs(T, H, E, K)
    grads = []
    for m in (keep, reuse):
        m.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        y = m(xr, idx, wr) if replay else m(xr)
        seen = []
        for _ in range(3):
            losses, d_losses = ([], []) if replay else ([m.aux_loss], [torch.tensor(D_AUX)])
            torch.autograd.backward([y] + losses, [dy] + d_losses, retain_graph=True)
            seen.append([xr.grad.clone(), wr.grad.clone() if replay else None]
                        + [p.grad.clone() for p in m.parameters()])
        grads.append(seen)
    for step, (a, b) in enumerate(zip(*grads)):
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert (ga is None and gb is None) or torch.equal(ga, gb), (step, i)
    assert not torch.equal(grads[1][0][0], grads[1][1][0])  # (the second backward added to .grad)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(reentrant):
    """torch.utils.checkpoint around the layer (Megatron's recompute, torchtitan's AC,
    transformers' gradient checkpointing): the backward runs the forward again and uses
    that saved tensor up (reuse_saved, the default); every gradient has the bits of the
    step without checkpointing."""
    m = mok.MoE(H, F, E, K, shared_ffn=FS, aux_loss_coef=1e-2)
    x, dy, _, _ = make_inputs(T, H, E, K)
    grads = []
    for ckpt in (False, True):
        m.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)

        def layer(t):
            return m(t) * 1  # (a tensor of this function's, for the reentrant form's output)
        y = torch.utils.checkpoint.checkpoint(layer, xr, use_reentrant=reentrant) if ckpt else layer(xr)
        y.backward(dy)
        grads.append([xr.grad] + [p.grad for p in m.parameters()])
    for i, (a, b) in enumerate(zip(*grads)):
        assert torch.equal(a, b), i


def test_forward_is_batch_invariant():
    """D4: a token's output does not depend on the other tokens of its batch."""
    m = mok.MoE(H, F, E, K, shared_ffn=FS)
    x, _, _, _ = make_inputs(T, H, E, K)
    with torch.no_grad():
        y_all = m(x)
        y_part = m(x[37:90])
    assert torch.equal(y_all[37:90], y_part)


# ---------------------------------------------------------------- wgrad_fp32_accum


def test_wgrad_fp32_accum_two_steps():
    kw = dict(shared_ffn=FS, aux_loss_coef=1e-2)
    m = mok.MoE(H, F, E, K, wgrad_fp32_accum=True, **kw)
    ref = mok.MoE(H, F, E, K, **kw)
    ref.load_state_dict(m.state_dict())
    names = ["w_router", "w13", "w2", "ws13", "ws2"]
    for n in names:
        mg = getattr(m, n).main_grad
        assert mg.dtype == torch.float32 and mg.shape == getattr(m, n).shape and mg.abs().max() == 0
    x1, dy1, _, _ = make_inputs(T, H, E, K)
    x2, dy2, _, _ = make_inputs(T, H, E, K)
    g1 = run(m, x1, dy1)
    for n in names:
        assert getattr(m, n).grad is None  # Megatron style: main_grad instead of .grad
    r1 = run(ref, x1, dy1)
    for n in names:  # the bf16 gradient is the fp32 one rounded
        assert torch.equal(g1["d_" + n].bfloat16(), r1["d_" + n]), n
    g2 = run(m, x2, dy2)
    ref.zero_grad()
    # step 2 added into step 1: main_grad = g(x1) + g(x2), one fp32 add per element
    m_single = mok.MoE(H, F, E, K, wgrad_fp32_accum=True, **kw)
    m_single.load_state_dict(m.state_dict())
    s2 = run(m_single, x2, dy2)
    for n in names:
        assert torch.equal(g2["d_" + n], g1["d_" + n] + s2["d_" + n]), n
    m.zero_main_grad()
    assert all(getattr(m, n).main_grad.abs().max() == 0 for n in names)


def test_wgrad_fp32_accum_interleaved_microbatches():
    """forward 1, forward 2, backward 2, backward 1: both add into main_grad."""
    m = mok.MoE(H, F, E, K, wgrad_fp32_accum=True)
    x1, dy1, _, _ = make_inputs(64, H, E, K)
    x2, dy2, _, _ = make_inputs(64, H, E, K)
    y1 = m(x1.requires_grad_())
    y2 = m(x2.requires_grad_())
    y2.backward(dy2)
    y1.backward(dy1)
    total = m.w13.main_grad.clone()
    m.zero_main_grad()
    m(x2).backward(dy2)
    a = m.w13.main_grad.clone()
    m.zero_main_grad()
    m(x1).backward(dy1)
    b = m.w13.main_grad.clone()
    assert torch.equal(total, a + b)


# ---------------------------------------------------------------- torch.compile


class _Model(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.proj = torch.nn.Linear(H, H, dtype=torch.bfloat16)
        self.moe = mok.MoE(H, F, E, K, max_tokens=128, **kw)

    def forward(self, x):
        h = self.proj(x)
        return h + self.moe(h), self.moe.aux_loss


def _train_step(model, fn, x, accum):
    if accum:
        model.moe.zero_main_grad()
    model.zero_grad(set_to_none=True)
    y, aux = fn(x)
    (y.float().square().mean() + aux).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if accum:
        grads.update({n: p.main_grad.clone() for n, p in model.moe.named_parameters()})
    return y.detach(), aux.detach(), grads


@pytest.mark.parametrize("accum", [False, True], ids=["bf16-wgrad", "fp32-accum"])
def test_torch_compile_fullgraph_matches_eager(accum):
    torch._dynamo.reset()
    model = _Model(shared_ffn=FS, aux_loss_coef=1e-2, z_loss_coef=1e-3, wgrad_fp32_accum=accum)
    x = (torch.rand(100, H) * 2 - 1).bfloat16()
    ye, ae, ge = _train_step(model, model, x, accum)
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(2):
        yc, ac, gc = _train_step(model, compiled, x, accum)
        assert torch.equal(ye, yc) and torch.equal(ae, ac)
        assert ge.keys() == gc.keys() and len(ge) >= 4
        for n in ge:
            assert torch.equal(ge[n], gc[n]), n


def test_torch_compile_second_backward():
    """torch.compile and reuse_saved (the default): a second backward through one
    compiled forward (retain_graph=True) gives the gradients of the first again (the
    backward op runs the forward again into the used-up saved tensor at run time, not
    in the traced graph)."""
    torch._dynamo.reset()
    model = _Model(shared_ffn=FS, aux_loss_coef=1e-2)
    assert model.moe.config.reuse_saved
    x = (torch.rand(100, H) * 2 - 1).bfloat16()
    compiled = torch.compile(model, fullgraph=True)
    model.zero_grad(set_to_none=True)
    y, aux = compiled(x)
    loss = y.float().square().mean() + aux
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss.backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 4
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_saved_buffer_survives_a_copy():
    """The saved tensor may be copied between forward and backward (a compiler may do
    that): the payload is found again, also when its 256-byte alignment is lost."""
    m = mok.MoE(H, F, E, K, shared_ffn=FS, aux_loss_coef=1e-2)
    x, dy, _, _ = make_inputs(50, H, E, K)
    key = m.config.key()
    outs = torch.ops.mok.moe_forward(x, m.w_router, None, m.w13, m.w2, m.ws13, m.ws2, None, None, [], key)
    saved = outs[-1]
    pristine = saved.clone()  # (reuse_saved, the default: each backward uses its saved up)
    one = torch.ones((), dtype=torch.float32)
    args = (dy, x, m.w_router, m.w13, m.w2, m.ws13, m.ws2)
    ref = torch.ops.mok.moe_backward(*args, saved, one, one, [], key)
    for shift in (0, 64, 128, 192):
        big = torch.empty(saved.numel() + 256, dtype=torch.uint8)
        moved = big[shift : shift + saved.numel()]
        moved.copy_(pristine)
        got = torch.ops.mok.moe_backward(*args, moved, one, one, [], key)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), shift
    with pytest.raises(ValueError, match="saved has"):
        torch.ops.mok.moe_backward(*args, saved[:-1], one, one, [], key)
