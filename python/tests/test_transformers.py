"""mok.transformers on the CPU backend (skipped without transformers): tiny random models
of each family (hf_models.py: the family's own config class, 2 layers, no downloads),
float32 with bf16-representable weights, against the same model with
experts_implementation="eager": logits, loss, aux loss and every parameter's gradient
within mok's bf16 rounding, routing the same except near ties; for the replay path
(experts_implementation="mok") and the fused one (mok.transformers.fuse). Then the
save_pretrained / from_pretrained round trip (bitwise), torch.compile of a patched
model, the layouts that convert (transposed, interleaved), the errors for what mok
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
from hf_models import (E, F, FUSED, H, K, LAYERS, REPLAY, TOL, batch, check_close, check_compile,  # noqa: E402
                       check_round_trip, check_routing, check_same_step, compare, make_model, mok_copy, rel_err,
                       step)

PATHS = ["replay", "fused"]


def cases():
    return [(f, p) for p in PATHS for f in (REPLAY if p == "replay" else FUSED)]


@pytest.mark.parametrize("family,path", cases(), ids=[f"{f}-{p}" for f, p in cases()])
def test_matches_eager(family, path):
    eager = make_model(family)
    model = mok_copy(eager, path)
    got, ref = compare(eager, model, batch())
    # transformers' own aux loss, from router logits the mok model returned
    assert got["aux_loss"] is not None and len(got["router_logits"]) == LAYERS
    for a, b in zip(got["router_logits"], ref["router_logits"]):
        assert a.shape == b.shape and rel_err(a, b) < TOL
    # the experts' gradients are mok's (not a copy of eager's): bf16 values
    for n, g in got["grads"].items():
        if "experts." in n:
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


def test_state_dict_keys_and_parameters_are_kept():
    eager = make_model("mixtral")
    keys = list(eager.state_dict())
    for path in PATHS:
        model = mok_copy(eager, path)
        assert list(model.state_dict()) == keys
        for (n, p), (m, q) in zip(eager.named_parameters(), model.named_parameters()):
            assert n == m and torch.equal(p, q)
    fused = copy.deepcopy(eager)
    blocks = {n: (b.gate, b.experts) for n, b in fused.named_modules() if n.endswith("mlp")}
    mt.fuse(fused)
    for n, (gate, experts) in blocks.items():  # the same modules inside the new block
        b = fused.get_submodule(n)
        assert isinstance(b, mt.MokSparseMoeBlock) and b.gate is gate and b.experts is experts
    assert "family='mixtral'" in repr(fused)
    # the replay path reads bf16 weights in place: nothing is copied
    bf = make_model("qwen3_moe", dtype=torch.bfloat16)
    mt.replay(bf)
    experts = bf.model.layers[0].mlp.experts
    w13, w2 = mt._expert_weights(experts)
    assert w13.data_ptr() == experts.gate_up_proj.data_ptr() and w2.data_ptr() == experts.down_proj.data_ptr()


@pytest.mark.parametrize("path", PATHS)
def test_save_pretrained_round_trip(path, tmp_path):
    check_round_trip(path, tmp_path)


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
        err = float((a - b).norm() / b.norm())
        assert err < 2e-2, (name, err)


# ---------------------------------------------------------------- what mok lacks


def test_gpt_oss_experts_are_refused():
    model = make_model("gpt_oss", experts_implementation="mok")
    ids, mask, _ = batch()
    with pytest.raises(mt.UnsupportedModuleError, match=r"GptOssExperts.*expert biases"):
        model(input_ids=ids)
    model = make_model("gpt_oss")
    with pytest.raises(mt.UnsupportedModuleError, match=r"model\.layers\.0\.mlp\.experts \(GptOssExperts\).*biases"):
        mt.replay(model)
    assert model.config._experts_implementation == "eager"  # nothing changed
    with pytest.raises(mt.UnsupportedModuleError,
                       match=r"model\.layers\.0\.mlp \(GptOssMLP\).*family fuse\(\) does not know"):
        mt.fuse(model)


def test_deepseek_v3_replay_matches_eager_and_fuse_is_refused():
    """DeepSeek-V3 (sigmoid scores, group-limited top-K, routed_scaling_factor, a shared
    expert): the replay path runs its routed experts under transformers' router; fuse()
    refuses the block (group-limited routing), changing nothing. The one MoE layer's
    input is the same bits in both models (the first layer is dense), so the same
    experts are chosen and no forcing is needed."""
    eager = make_model("deepseek_v3")
    model = mok_copy(eager, "replay", layers=1)
    inputs = batch()
    got, ref = step(model, inputs), step(eager, inputs)
    assert len(got["routing"]) == 1 and torch.equal(got["routing"][0][0], ref["routing"][0][0])
    check_close(got, ref)
    assert not torch.equal(got["logits"], ref["logits"])
    assert all(torch.equal(g, g.bfloat16().float()) for n, g in got["grads"].items() if ".mlp.experts." in n)
    check_fuse_refused("deepseek_v3", r"model\.layers\.1\.mlp \(DeepseekV3MoE\).*group-limited")


def check_fuse_refused(family, match):
    """fuse() raises UnsupportedModuleError matching `match` and replaces nothing."""
    model = make_model(family)
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(mt.UnsupportedModuleError, match=match):
        mt.fuse(model)
    assert [type(m).__name__ for m in model.modules()] == before


def test_qwen2_moe_fuse_is_refused_and_nothing_changes():
    check_fuse_refused("qwen2_moe", r"model\.layers\.0\.mlp \(Qwen2MoeSparseMoeBlock\).*sigmoid")


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
