"""mok.transformers on the CPU backend (skipped without transformers): tiny random models
of each family (hf_models.py: the family's own config class, 2 layers, no downloads),
float32 with bf16-representable weights, against the same model with
experts_implementation="eager": logits, loss, aux loss and every parameter's gradient
within mok's bf16 rounding, routing the same except near ties; for the replay path
(experts_implementation="mok") and the fused one (mok.transformers.fuse), every family
both ways (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE with its gated shared expert,
DeepSeek-V2 with group-limited softmax routing (a group's largest score), its shared
experts and a dense first layer, DeepSeek-V3 with group-limited sigmoid routing and its
shared experts, gpt-oss with its biases and clamped SwiGLU). Then the save_pretrained / from_pretrained round trip
(bitwise), torch.compile of a patched model, the layouts that convert (transposed,
interleaved), gpt-oss's clamp where most entries are clamped, the errors for what mok
lacks, the K factor between the two load-balancing losses, and D1 of a training step."""
import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import mok  # noqa: E402
import mok.transformers as mt  # noqa: E402
from hf_models import (E, F, FUSED, H, K, LAYERS, NO_AUX_LOSS, REPLAY, TOL, batch, check_close,  # noqa: E402
                       check_compile, check_round_trip, check_routing, check_same_step, compare, make_model, mok_copy,
                       rel_err, step)

PATHS = ["replay", "fused"]


def cases():
    return [(f, p) for p in PATHS for f in (REPLAY if p == "replay" else FUSED)]


@pytest.mark.parametrize("family,path", cases(), ids=[f"{f}-{p}" for f, p in cases()])
def test_matches_eager(family, path):
    eager = make_model(family)
    model = mok_copy(eager, path)
    got, ref = compare(eager, model, batch())
    # transformers' own aux loss, from router logits the mok model returned (DeepSeek-V2's
    # and V3's models record the logits and have no such loss)
    assert (got["aux_loss"] is None) == (ref["aux_loss"] is None) == (family in NO_AUX_LOSS)
    assert len(got["router_logits"]) == LAYERS
    for a, b in zip(got["router_logits"], ref["router_logits"]):
        assert a.shape == b.shape and rel_err(a, b) < TOL
    # the experts' gradients are mok's (not a copy of eager's): bf16 values; in the fused
    # path the shared expert's and its gate's too (.mlp.shared_expert(s), _gate)
    mine = (".mlp.experts.", ".mlp.shared_expert") if path == "fused" else (".mlp.experts.",)
    for n, g in got["grads"].items():
        if any(m in n for m in mine):
            assert torch.equal(g, g.bfloat16().float()), n
    assert not torch.equal(got["logits"], ref["logits"])  # mok's bf16 numerics, not eager's float32


@pytest.mark.parametrize("path", PATHS)
def test_without_router_logits(path):
    """output_router_logits=False: no aux loss (as in eager), and the fused block does
    not call its router module at all."""
    eager = make_model("qwen3_moe")
    model = mok_copy(eager, path)
    calls = []
    for r in (m.gate for m in model.modules() if isinstance(m, mt.MokSparseMoeBlock)):
        r.register_forward_hook(lambda *a: calls.append(1))
    inputs = batch()
    got = step(model, inputs, output_router_logits=False)
    assert not calls
    ref = step(eager, inputs, output_router_logits=False, force=[idx for idx, _ in got["routing"]])
    assert ref["aux_loss"] is None and got["aux_loss"] is None
    check_close(got, ref)


def test_mixtral_jitter_noise():
    """Mixtral's router jitter (training): the same noise draws as eager's, on router and
    experts alike."""
    eager = make_model("mixtral", router_jitter_noise=0.2)
    model = mok_copy(eager, "fused")
    inputs = batch()
    torch.manual_seed(3)
    got = step(model, inputs)
    torch.manual_seed(3)
    ref = step(eager, inputs, force=[idx for idx, _ in got["routing"]])
    check_close(got, ref)
    check_routing(got["routing"], ref["own"])
    torch.manual_seed(4)
    other = step(model, inputs)
    assert not torch.equal(other["logits"], got["logits"])  # the noise is there


@pytest.mark.parametrize("path", PATHS)
def test_training_step_is_bitwise_repeatable(path):
    """D1 through the model: two steps, and a copy's step, give the same bits; mok's
    thread count does not change them."""
    model = mok_copy(make_model("olmoe"), path)
    inputs = batch()
    a, b = step(model, inputs), step(model, inputs)
    c = step(mok_copy(make_model("olmoe"), path, num_threads=1), inputs)
    for r in (b, c):
        check_same_step(a, r)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_state_dict_keys_and_parameters_are_kept(family):
    eager = make_model(family)
    keys = list(eager.state_dict())
    for path in PATHS:
        model = mok_copy(eager, path)
        assert list(model.state_dict()) == keys
        for (n, p), (m, q) in zip(eager.named_parameters(), model.named_parameters()):
            assert n == m and torch.equal(p, q)
    fused = copy.deepcopy(eager)
    blocks = {n: dict(b.named_children()) for n, b in fused.named_modules() if hasattr(b, "experts")}
    mt.fuse(fused)
    for n, children in blocks.items():  # the same modules inside the new block, under their names
        b = fused.get_submodule(n)
        assert isinstance(b, mt.MokSparseMoeBlock) and dict(b.named_children()) == children
        assert all(getattr(b, c) is m for c, m in children.items())
    assert f"family='{family}'" in repr(fused)


def test_bf16_weights_are_read_in_place():
    """the replay path reads bf16 weights in place: nothing is copied"""
    bf = make_model("qwen3_moe", dtype=torch.bfloat16)
    mt.replay(bf)
    experts = bf.model.layers[0].mlp.experts
    w13, w2 = mt._expert_weights(experts)
    assert w13.data_ptr() == experts.gate_up_proj.data_ptr() and w2.data_ptr() == experts.down_proj.data_ptr()


ROUND_TRIPS = [(p, f) for p in PATHS for f in ("qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")]


@pytest.mark.parametrize("path,family", ROUND_TRIPS, ids=[f"{f}-{p}" for p, f in ROUND_TRIPS])
def test_save_pretrained_round_trip(path, family, tmp_path):
    check_round_trip(path, tmp_path, family=family)


@pytest.mark.parametrize("path", PATHS)
def test_torch_compile(path):
    check_compile(path)


def test_k_factor_of_the_load_balancing_loss():
    """mok's per-block aux loss with aux_loss_coef = K * c equals c times transformers'
    load-balancing loss of that layer (f_e = count / T there, count / (T K) in mok);
    with one MoE layer that is the model's aux_loss."""
    eager = make_model("qwen3_moe", num_hidden_layers=1)
    c = eager.config.router_aux_loss_coef
    model = copy.deepcopy(eager)
    mt.fuse(model, aux_loss_coef=K * c)
    ids, mask, labels = batch()
    out = model(input_ids=ids, labels=labels, output_router_logits=True)  # no padding mask: mok counts every token
    mine = mt.router_losses(model)
    assert mine.requires_grad
    theirs = c * float(out.aux_loss.detach())
    assert abs(float(mine.detach()) - theirs) <= 1e-2 * abs(theirs)
    # and mok's loss reaches the router: its gradient is c * d(HF's aux)/d(router)
    model.zero_grad()
    mine.backward()
    g_mine = model.model.layers[0].mlp.gate.weight.grad.clone()
    model.zero_grad()
    out = model(input_ids=ids, output_router_logits=True)
    (c * out.aux_loss).backward()
    g_hf = model.model.layers[0].mlp.gate.weight.grad
    assert float((g_mine - g_hf).norm() / g_hf.norm()) < 2e-2


def test_z_loss_option():
    model = mok_copy(make_model("olmoe"), "fused", z_loss_coef=1e-3)
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels)
    blocks = [m for m in model.modules() if isinstance(m, mt.MokSparseMoeBlock)]
    assert all(float(b.z_loss.detach()) > 0 and float(b.aux_loss.detach()) == 0 for b in blocks)
    assert torch.equal(mt.router_losses(model), blocks[0].z_loss + blocks[1].z_loss)
    assert all(int(b.tokens_per_expert.sum()) == ids.numel() * K for b in blocks)


# ---------------------------------------------------------------- layouts that convert


def _layout_experts(is_transposed, is_concatenated):
    """An experts module of transformers' decorator in another layout, whose own
    (eager) forward reads that layout."""
    from transformers.integrations.moe import use_experts_implementation

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            shape13, shape2 = ((E, H, 2 * F), (E, F, H)) if is_transposed else ((E, 2 * F, H), (E, H, F))
            self.gate_up_proj = torch.nn.Parameter((torch.randn(shape13) / H ** 0.5).bfloat16().float())
            self.down_proj = torch.nn.Parameter((torch.randn(shape2) / F ** 0.5).bfloat16().float())
            self.act_fn = torch.nn.SiLU()

        def forward(self, x, idx, w):
            y = torch.zeros_like(x)
            for t in range(x.shape[0]):
                for j in range(idx.shape[1]):
                    e = int(idx[t, j])
                    w13, w2 = self.gate_up_proj[e], self.down_proj[e]
                    if is_transposed:
                        w13, w2 = w13.t(), w2.t()
                    a = w13 @ x[t]
                    gate, up = (a[0::2], a[1::2]) if not is_concatenated else (a[:F], a[F:])
                    y[t] = y[t] + w[t, j] * (w2 @ (self.act_fn(gate) * up))
            return y

    decorated = use_experts_implementation(is_transposed=is_transposed, is_concatenated=is_concatenated)(Experts)
    cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E)
    return decorated(cfg)


@pytest.mark.parametrize("is_transposed,is_concatenated", [(True, True), (False, False), (True, False)],
                         ids=["transposed", "interleaved", "transposed-interleaved"])
def test_layouts_that_convert(is_transposed, is_concatenated):
    experts = _layout_experts(is_transposed, is_concatenated)
    T = 24
    x = (torch.rand(T, H) * 2 - 1).bfloat16().float().requires_grad_()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    w = (0.3 + torch.rand(T, K)).requires_grad_()
    dy = torch.randn(T, H)

    def run(impl):
        experts.config._experts_implementation = impl
        experts.zero_grad()
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = experts(xi, idx, wi)
        y.backward(dy)
        return [y, xi.grad, wi.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    ref, got = run("eager"), run("mok")
    for name, a, b in zip(["y", "dx", "d_weights", "d_gate_up_proj", "d_down_proj"], got, ref):
        assert a.shape == b.shape, name
        err = float((a - b).detach().norm() / b.detach().norm())  # (y keeps its graph: no grad wanted here)
        assert err < 2e-2, (name, err)


# ---------------------------------------------------------------- what mok lacks


def test_gpt_oss_clamp_on_bf16_inputs():
    """gpt-oss's experts module (its own eager forward: gate_up_proj [E, H, 2F] with
    gate and up columns interleaved, the biases, the clamped SwiGLU) against mok's replay
    on bf16 inputs, with the limit where a quarter of the gate|up entries lie beyond it: the
    output, dx, d_weights and each parameter's gradient within bf16 rounding. The limit,
    1 + 2^-8, is the midpoint of two bf16 values, and the inputs are bf16 values: an
    entry is then clamped in mok's bf16 gate|up exactly when it is in eager's float32
    one (an entry that crosses the limit gains or loses its gradient term)."""
    limit = 1.00390625
    experts = make_model("gpt_oss", swiglu_limit=limit).model.layers[0].mlp.experts
    assert mt._check_experts(experts) == dict(expert_bias=True, swiglu_limit=limit, swiglu_alpha=1.702)
    g = torch.Generator().manual_seed(9)
    T = 96
    x = torch.randn(T, H, generator=g).bfloat16().float()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.2
    dy = torch.randn(T, H, generator=g)
    with torch.no_grad():
        a = torch.einsum("th,tkhf->tkf", x, experts.gate_up_proj[idx]) + experts.gate_up_proj_bias[idx]
        gate, up = a[..., ::2], a[..., 1::2]
        clamped = float(((gate > limit).float().mean() + (up.abs() > limit).float().mean()) / 2)
    assert clamped > 0.2, clamped

    def run(impl):
        experts.config._experts_implementation = impl
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = experts(xi, idx, wi)
        y.backward(dy)
        return [y, xi.grad, wi.grad] + [p.grad for _, p in experts.named_parameters()]

    ref, got = run("eager"), run("mok")
    names = ["y", "dx", "d_weights"] + ["d_" + n for n, _ in experts.named_parameters()]
    for name, a, b in zip(names, got, ref):
        assert a.shape == b.shape and rel_err(a, b) < 2e-2, (name, rel_err(a, b))


def test_gpt_oss_clamp_is_active_in_the_model():
    """In test_matches_eager's gpt-oss model some routed rows' gate|up entries lie
    beyond swiglu_limit (the clamp is exercised there too)."""
    model = make_model("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    limit = experts.limit
    seen = []
    experts.register_forward_hook(lambda m, args, out: seen.append((args[0].detach(), args[1])))
    ids, mask, _ = batch()
    model(input_ids=ids, attention_mask=mask)
    x, idx = seen[0]
    with torch.no_grad():
        a = torch.einsum("th,tkhf->tkf", x, experts.gate_up_proj[idx]) + experts.gate_up_proj_bias[idx]
    beyond = float(((a[..., ::2] > limit).sum() + (a[..., 1::2].abs() > limit).sum()) / a.numel())
    assert 0.005 < beyond < 0.05, beyond


def test_deepseek_v3_selection_bias_is_read():
    """e_score_correction_bias (a buffer: no gradient) moves the choice only: with a
    large bias on expert 5 every token of the fused model takes it (its group is kept),
    and its weight is still the unbiased sigmoid score's share (< routed_scaling_factor)."""
    model = make_model("deepseek_v3")
    mt.fuse(model)
    for b in model.modules():
        if isinstance(b, mt.MokSparseMoeBlock):
            b.gate.e_score_correction_bias[5] = 10.0
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for b in (m for m in model.modules() if isinstance(m, mt.MokSparseMoeBlock)):
        assert bool((b.topk_idx == 5).any(-1).all())
        scale = b.gate.routed_scaling_factor
        assert torch.allclose(b.topk_weight.sum(-1), torch.full((ids.numel(),), scale))
        assert float(b.topk_weight[b.topk_idx == 5].max()) < scale
        assert b.gate.e_score_correction_bias.grad is None


def test_deepseek_v2_greedy_and_dense_layer():
    """DeepSeek-V2-Lite's router, topk_method "greedy" (top-K of the softmax over all E,
    no groups), both paths against eager; fuse() replaces the MoE layers only (layer 0 is
    dense, first_k_dense_replace) and its blocks carry the router rule: no groups in
    greedy, a group's largest score in group_limited_greedy, never normalised."""
    eager = make_model("deepseek_v2", topk_method="greedy", n_group=None, topk_group=None)
    for path in PATHS:
        compare(eager, mok_copy(eager, path), batch())
    fused = mok_copy(eager, "fused")
    assert type(fused.model.layers[0].mlp).__name__ == "DeepseekV2MLP"
    blocks = [m for m in fused.modules() if isinstance(m, mt.MokSparseMoeBlock)]
    assert [(b.config.n_group, b.config.normalize, b.config.route_scale) for b in blocks] == [(0, False, 2.0)] * LAYERS
    grouped = [m for m in mok_copy(make_model("deepseek_v2"), "fused").modules() if isinstance(m, mt.MokSparseMoeBlock)]
    assert [(b.config.n_group, b.config.topk_group, b.config.group_score, b.config.shared_ffn) for b in grouped] \
        == [(2, 1, "max", 2 * F)] * LAYERS


def test_shared_gate_where_the_backend_refuses_it(monkeypatch):
    """fuse() asks libmok whether the block's backend runs its configuration: where it
    refuses it (MOK_STATUS_UNSUPPORTED_SHAPE, as CUDA builds before the kernels' shared
    gate refused the gated shared expert; here a stand-in context that refuses it on the
    CPU), fuse() raises
    UnsupportedModuleError naming the block and the feature, and replaces nothing."""
    class Refusing:
        def __init__(self, cfg, T, device):
            if cfg.shared_gate:
                raise mok.MokError(mok._lib.MOK_STATUS_UNSUPPORTED_SHAPE, "cfg.use_shared_gate = 1: the gated "
                                   "shared expert is CPU-only so far", "mok_context_create")

        def destroy(self):
            pass

    monkeypatch.setattr(mt, "Context", Refusing)
    monkeypatch.setattr(mt, "_probed", {})
    check_fuse_refused(make_model("qwen2_moe"), r"model\.layers\.0\.mlp \(Qwen2MoeSparseMoeBlock\) has a "
                       r"sigmoid-gated shared expert \(shared_expert_gate\) on cpu.*MOK_STATUS_UNSUPPORTED_SHAPE")
    assert len(mt.fuse(make_model("deepseek_v3"))) == LAYERS  # (the stand-in runs the others)


def check_fuse_refused(model, match):
    """fuse() raises UnsupportedModuleError matching `match` and replaces nothing."""
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(mt.UnsupportedModuleError, match=match):
        mt.fuse(model)
    assert [type(m).__name__ for m in model.modules()] == before


def test_what_the_new_families_lack_is_refused():
    """A shared expert of another activation (DeepSeek-V3), a bias in Qwen2-MoE's shared
    expert gate, gpt-oss's experts with their gate function replaced, DeepSeek-V2's
    router with a topk_method mok lacks or more experts than its kept groups hold."""
    model = make_model("deepseek_v3")
    model.model.layers[1].mlp.shared_experts.act_fn = torch.nn.GELU()
    check_fuse_refused(model, r"model\.layers\.1\.mlp\.shared_experts \(DeepseekV3MLP\).*activation GELU")
    model = make_model("qwen2_moe")
    model.model.layers[0].mlp.shared_expert_gate = torch.nn.Linear(H, 1)
    check_fuse_refused(model, r"model\.layers\.0\.mlp \(Qwen2MoeSparseMoeBlock\).*bias in shared_expert_gate")
    model = make_model("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    experts.__class__ = type("OtherGate", (type(experts),), {"_apply_gate": lambda self, a: a[..., ::2]})
    with pytest.raises(mt.UnsupportedModuleError, match=r"OtherGate.*own gate function"):
        mt.replay(model)
    with pytest.raises(mt.UnsupportedModuleError, match=r"OtherGate.*own gate function"):
        mt.fuse(model)
    model = make_model("deepseek_v2")
    model.model.layers[2].mlp.gate.topk_method = "noaux_tc"
    check_fuse_refused(model, r"model\.layers\.2\.mlp \(DeepseekV2Moe\) has a router with topk_method = 'noaux_tc'")
    check_fuse_refused(make_model("deepseek_v2", num_experts_per_tok=5),
                       r"model\.layers\.1\.mlp \(DeepseekV2Moe\) has top_k = 5, more than the 4 experts of its "
                       r"topk_group kept groups")


def test_other_activation_is_refused():
    model = make_model("qwen3_moe", hidden_act="gelu")
    with pytest.raises(mt.UnsupportedModuleError, match=r"Qwen3MoeExperts.*activation GELUActivation"):
        mt.fuse(model)
    with pytest.raises(mt.UnsupportedModuleError, match="activation"):
        mt.replay(model)


def test_custom_gate_function_is_refused():
    from transformers.integrations.moe import use_experts_implementation

    class Clamped(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * F, H))
            self.down_proj = torch.nn.Parameter(torch.zeros(E, H, F))
            self.act_fn = torch.nn.SiLU()

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, -1)
            return self.act_fn(gate.clamp(max=7.0)) * up

        def forward(self, x, idx, w):
            return x

    m = use_experts_implementation(Clamped)(transformers.Qwen3MoeConfig(hidden_size=H))
    m.config._experts_implementation = "mok"
    with pytest.raises(mt.UnsupportedModuleError, match=r"Clamped.*_apply_gate"):
        m(torch.zeros(4, H), torch.zeros(4, K, dtype=torch.long), torch.ones(4, K))


def test_float16_and_bad_options_are_refused():
    with pytest.raises(mt.UnsupportedModuleError, match="torch.float16"):
        mt.fuse(make_model("olmoe", dtype=torch.float16))
    model = make_model("olmoe")
    with pytest.raises(TypeError, match="not bogus"):
        mt.fuse(model, bogus=1)
    with pytest.raises(TypeError, match="not aux_loss_coef"):
        mt.replay(model, aux_loss_coef=0.1)  # replay's router is transformers'
    with pytest.raises(ValueError, match="needs max_tokens"):
        mt.fuse(model, process_group=object())
    with pytest.raises(ValueError, match="capacity = -1"):  # mok's own validation, at fuse time
        mt.fuse(make_model("olmoe"), capacity=-1)
    small = mok_copy(model, "fused", max_tokens=16)
    ids, _, _ = batch()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp \(MokSparseMoeBlock\) got 96 tokens, "
                                         r"more than its max_tokens = 16"):
        small(input_ids=ids)


def test_import_mok_does_not_import_transformers():
    code = "import sys, mok; assert 'transformers' not in sys.modules; import mok.transformers; print('ok')"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert mok.__version__
