"""mok.MoE's router and expert variants on the CPU backend (mok.h, docs/CPU.md):
group-limited routing (n_group, topk_group, group_score), the router logit bias
(b_router), the expert biases (b13, b2), gpt-oss's clamped SwiGLU (swiglu_limit,
swiglu_alpha) and the gated shared expert (w_sg). Each against tests/reference.py in
bf16, by torch.autograd.gradcheck in EXACT numerics, with wgrad_fp32_accum, twice for
the same bits, and with its bad options and tensors named."""
import pytest
import torch

import mok
import test_moe  # (its run and check against tests/reference.py, which take the variants)

T, H, F, E, K, FS = 200, 64, 48, 8, 3, 24
VARIANT_PARAMS = ("b_router", "b13", "b2", "w_sg")
PARAMS = ("w_router", "w13", "w2", "ws13", "ws2") + VARIANT_PARAMS


def make_inputs(T, H):
    x, dy, _, _ = test_moe.make_inputs(T, H, E, K)
    return x, dy


def replay_inputs(T, E, K):
    _, _, idx, w = test_moe.make_inputs(T, H, E, K)
    return idx, w


run = test_moe.run
check_against_reference = test_moe.check_against_reference


def randomize_variants(m, scale=0.5):
    """variant parameters larger than nn.Linear's init, so that each moves the result"""
    with torch.no_grad():
        for name in VARIANT_PARAMS:
            p = getattr(m, name)
            if p is not None:
                p.copy_((torch.rand(p.shape, dtype=torch.float64) * 2 - 1) * scale)


CASES = {
    "deepseek-v3-groups": dict(score="sigmoid", bias_select=True, route_scale=2.5, n_group=4, topk_group=2,
                               shared_ffn=FS, aux_loss_coef=1e-2, z_loss_coef=1e-3),
    "deepseek-v2-groups": dict(score="softmax", n_group=2, topk_group=1, group_score="max", aux_loss_coef=1e-2),
    "router-bias": dict(router_bias=True, aux_loss_coef=1e-2, z_loss_coef=1e-3),
    "expert-bias": dict(expert_bias=True, shared_ffn=FS),
    "clamped-swiglu": dict(swiglu_limit=0.75, expert_bias=True),
    "gpt-oss": dict(router_bias=True, expert_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702),
    "shared-gate": dict(shared_ffn=FS, shared_gate=True, aux_loss_coef=1e-2),
    "all": dict(score="sigmoid", bias_select=True, n_group=4, topk_group=2, router_bias=True, expert_bias=True,
                swiglu_limit=0.75, shared_ffn=FS, shared_gate=True, aux_loss_coef=1e-2, z_loss_coef=1e-3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_variant_matches_reference(case):
    m = mok.MoE(H, F, E, K, **CASES[case])
    randomize_variants(m)
    if m.config.bias_select:
        m.bias_select.copy_(0.05 * torch.randn(E))
    x, dy = make_inputs(T, H)
    check_against_reference(m, x, dy)


@pytest.mark.parametrize("kw", [dict(expert_bias=True), dict(swiglu_limit=0.75), dict(shared_ffn=FS, shared_gate=True)],
                         ids=["expert-bias", "clamped-swiglu", "shared-gate"])
def test_replay_variant_matches_reference(kw):
    m = mok.MoE(H, F, E, K, routing="replay", **kw)
    randomize_variants(m)
    x, dy = make_inputs(T, H)
    idx, w = replay_inputs(T, E, K)
    got, _ = check_against_reference(m, x, dy, idx, w)
    assert got["d_topk_weight"].shape == (T, K)


@pytest.mark.parametrize("case", ["router-bias", "expert-bias", "shared-gate", "clamped-swiglu"])
def test_each_variant_changes_the_result(case):
    """a variant that the module ignored would still match a reference that ignores it"""
    kw = CASES[case]
    m = mok.MoE(H, F, E, K, **kw)
    randomize_variants(m)
    base = {k: v for k, v in kw.items() if k not in ("router_bias", "expert_bias", "shared_gate", "swiglu_limit")}
    off = mok.MoE(H, F, E, K, **base)
    off.load_state_dict({k: v for k, v in m.state_dict().items() if k not in VARIANT_PARAMS})
    x, _ = make_inputs(64, H)
    assert not torch.equal(m(x), off(x))


def test_group_limited_routing_keeps_the_groups():
    """every chosen expert lies in one of the topk_group groups of the largest scores"""
    m = mok.MoE(H, F, E, K, score="sigmoid", n_group=4, topk_group=2)
    x, _ = make_inputs(T, H)
    m(x)
    groups = (m.topk_idx.long() // (E // 4))
    assert all(len(set(g.tolist())) <= 2 for g in groups)
    flat = mok.MoE(H, F, E, K, score="sigmoid")
    flat.load_state_dict(m.state_dict())
    flat(x)
    assert not torch.equal(flat.topk_idx, m.topk_idx), "the groups changed no token's experts (tests nothing)"


def test_router_bias_stays_fp32():
    m = mok.MoE(H, F, E, K, router_bias=True, expert_bias=True, shared_ffn=FS, shared_gate=True)
    assert m.b_router.dtype == torch.float32 and m.b_router.shape == (E,)
    assert m.b13.shape == (E, 2 * F) and m.b2.shape == (E, H) and m.w_sg.shape == (H,)
    assert m.b13.dtype == m.b2.dtype == m.w_sg.dtype == torch.bfloat16
    m = m.to(torch.bfloat16)
    assert m.b_router.dtype == torch.float32 and m.w13.dtype == torch.bfloat16
    assert {n for n, _ in m.named_parameters()} >= set(VARIANT_PARAMS)


# ---------------------------------------------------------------- gradcheck (EXACT)


def _exact(**kw):
    return mok.MoE(8, 6, 4, 2, exact=True, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(router_bias=True, aux_loss_coef=0.3, z_loss_coef=0.2),
        dict(expert_bias=True, shared_ffn=3),
        dict(shared_ffn=3, shared_gate=True),
        dict(swiglu_limit=0.25, swiglu_alpha=1.702, expert_bias=True),
        dict(score="sigmoid", bias_select=True, n_group=2, topk_group=1, router_bias=True, aux_loss_coef=0.3),
    ],
    ids=["router-bias", "expert-bias", "shared-gate", "clamped-swiglu", "groups"],
)
def test_gradcheck_variants(kw):
    m = _exact(**kw)
    cfg = m.config
    randomize_variants(m)
    if cfg.bias_select:
        m.bias_select.copy_(0.1 * torch.randn(4, dtype=torch.float64))
    x = (torch.rand(7, 8, dtype=torch.float64) * 2 - 1).requires_grad_(True)
    names = [n for n in PARAMS if getattr(m, n) is not None]

    def f(x, *params):
        p = dict(zip(names, params))
        o = mok.moe_forward(x, p["w_router"], p["w13"], p["w2"], p.get("ws13"), p.get("ws2"), config=cfg,
                            bias_select=m.bias_select if cfg.bias_select else None,
                            **{n: p.get(n) for n in VARIANT_PARAMS})
        return o.y, o.aux_loss, o.z_loss

    if cfg.swiglu_limit is not None:  # x on both sides of the limit: gate and up clamped and not
        with torch.no_grad():
            m(x)
            a = torch.einsum("th,efh->tef", x, m.w13) + m.b13
            a = a[torch.arange(7)[:, None], m.topk_idx.long()]  # the routed experts'
            gate, up = a[..., :6], a[..., 6:]
            lim = cfg.swiglu_limit
            assert (gate > lim).any() and (gate <= lim).any() and (up.abs() > lim).any() and (up.abs() <= lim).any()
    params = [getattr(m, n) for n in names]
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- wgrad_fp32_accum, determinism


def test_variants_wgrad_fp32_accum():
    kw = CASES["all"]
    m = mok.MoE(H, F, E, K, wgrad_fp32_accum=True, **kw)
    randomize_variants(m)
    ref = mok.MoE(H, F, E, K, **kw)
    ref.load_state_dict(m.state_dict())
    x, dy = make_inputs(T, H)
    g = run(m, x, dy)
    r = run(ref, x, dy)
    for n in VARIANT_PARAMS:
        p = getattr(m, n)
        assert p.grad is None and p.main_grad.dtype == torch.float32
        assert torch.equal(g["d_" + n].to(p.dtype), r["d_" + n]), n  # the bf16 gradient is the fp32 one rounded
    g2 = run(m, x, dy)  # added into: twice the first
    for n in VARIANT_PARAMS:
        assert torch.equal(g2["d_" + n], g["d_" + n] + g["d_" + n]), n
    m.zero_main_grad()
    assert all(getattr(m, n).main_grad.abs().max() == 0 for n in VARIANT_PARAMS)


def test_variants_two_runs_are_bitwise_equal():
    m = mok.MoE(H, F, E, K, **CASES["all"])
    randomize_variants(m)
    x, dy = make_inputs(T, H)
    a, b = run(m, x, dy), run(m, x, dy)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_group=3), "n_group = 3 must divide"),
        (dict(n_group=4, topk_group=5), "topk_group = 5"),
        (dict(n_group=4, topk_group=0), "topk_group = 0"),
        (dict(topk_group=2), "topk_group = 2 needs n_group"),
        (dict(n_group=8, topk_group=2), "top_k = 3 must be at most"),
        (dict(group_score="sum"), "group_score"),
        (dict(routing="replay", router_bias=True), "router_bias"),
        (dict(routing="replay", n_group=4, topk_group=2), "n_group"),
        (dict(swiglu_limit=0.0), "swiglu_limit = 0.0"),
        (dict(swiglu_limit=-7.0), "swiglu_limit"),
        (dict(swiglu_limit=float("nan")), "swiglu_limit = nan"),
        (dict(swiglu_limit=float("inf")), "swiglu_limit = inf"),
        (dict(swiglu_limit=7.0, swiglu_alpha=float("nan")), "swiglu_alpha = nan"),
        (dict(swiglu_limit=7.0, swiglu_alpha=0.0), "swiglu_alpha"),
        (dict(shared_gate=True), "shared_gate needs a shared expert"),
    ],
)
def test_bad_variant_options_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        mok.MoE(H, F, E, K, **kw)


def test_bad_variant_tensors_are_named():
    m = mok.MoE(H, F, E, K, router_bias=True, expert_bias=True, shared_ffn=FS, shared_gate=True)
    x, _ = make_inputs(8, H)
    args = dict(b_router=m.b_router, b13=m.b13, b2=m.b2, w_sg=m.w_sg)

    def call(**change):
        a = dict(args, **change)
        return mok.moe_forward(x, m.w_router, m.w13, m.w2, m.ws13, m.ws2, config=m.config, **a)

    call()
    for name in VARIANT_PARAMS:
        with pytest.raises(ValueError, match=f"{name} .*required"):
            call(**{name: None})
    with pytest.raises(ValueError, match="b13 has shape"):
        call(b13=m.b13[:, :5])
    with pytest.raises(TypeError, match="b_router has dtype"):
        call(b_router=m.b_router.bfloat16())
    with pytest.raises(TypeError, match="w_sg has dtype"):
        call(w_sg=m.w_sg.float())
    plain = mok.MoE(H, F, E, K)
    with pytest.raises(ValueError, match="b13 given"):
        mok.moe_forward(x, plain.w_router, plain.w13, plain.w2, config=plain.config, b13=m.b13)


def test_library_names_the_field():
    """what only libmok checks (a config that skips the Python checks) comes back as
    MokError naming the field, not as a wrong result"""
    cfg = mok.MoE(H, F, E, K, swiglu_limit=7.0).config
    c = cfg.c_config(16, mok._lib.MOK_BACKEND_CPU)
    c.swiglu_limit = float("nan")
    import ctypes

    h = ctypes.c_void_p()
    s = mok._lib.lib().mok_context_create(ctypes.byref(c), ctypes.byref(h))
    assert s == mok._lib.STATUS_NAMES.index("MOK_STATUS_NONFINITE_VALUE")
    assert b"swiglu_limit" in mok._lib.lib().mok_last_create_error()
