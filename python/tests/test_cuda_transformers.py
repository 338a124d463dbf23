"""mok.transformers on the CUDA backend (skipped without a GPU, without transformers, or
when libmok was built without its CUDA backend): test_transformers.py's checks on the
GPU, for the replay path (experts_implementation="mok") and the fused one
(mok.transformers.fuse), each family's tiny model (hf_models.py) in float32 with
bf16-representable weights against the same model with experts_implementation="eager"
on the GPU: logits, loss, aux loss and every parameter's gradient within bf16 rounding,
routing the same except near ties (every family in both paths: Qwen2-MoE's gated
shared expert in the kernels in the fused one). Then the save_pretrained /
from_pretrained round trip (bitwise), torch.compile of a patched model, D1 of a whole
training step (forward, backward, AdamW): two runs from the same state give the same
bits, and fuse()'s refusal of a block whose shape the CUDA backend does not run.

Run it in a process of its own (CUBLAS_WORKSPACE_CONFIG is set here, before cuBLAS
starts, for torch's deterministic mode)."""
import copy
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")

import mok  # noqa: E402
import mok.transformers as mt  # noqa: E402
from hf_models import (FUSED, NO_AUX_LOSS, REPLAY, batch, check_compile, check_round_trip,  # noqa: E402
                       check_same_step, compare, make_model, mok_copy, step)

PATHS = ["replay", "fused"]


def _why_skip():
    """None when libmok runs on the GPU here, else the reason to skip."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    try:
        mok.MoE(128, 64, 8, 2, device="cuda")(torch.zeros(16, 128, dtype=torch.bfloat16, device="cuda"))
        mok.synchronize()
    except mok.MokError as e:
        if e.status_name == "MOK_STATUS_BACKEND_UNAVAILABLE":
            return f"libmok has no CUDA backend ({e})"
        raise
    return None


WHY = _why_skip()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.fixture
def deterministic():
    """torch's deterministic algorithms for the dense parts (the embedding's backward
    otherwise adds with atomics), so that a step's bits are the step's alone."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def cases():
    return [(f, p) for p in PATHS for f in (REPLAY if p == "replay" else FUSED)]


@pytest.mark.parametrize("family,path", cases(), ids=[f"{f}-{p}" for f, p in cases()])
def test_cuda_matches_eager(family, path):
    eager = make_model(family, device="cuda")
    model = mok_copy(eager, path)
    got, ref = compare(eager, model, batch("cuda"))
    assert got["logits"].is_cuda and (got["aux_loss"] is None) == (family in NO_AUX_LOSS)  # (no such loss there)
    # mok's bf16 gradients, not eager's: the experts', and in the fused path the shared
    # expert's and its gate's (Qwen2-MoE's shared_expert_gate: w_sg's gradient in the kernels)
    mine = (".mlp.experts.", ".mlp.shared_expert") if path == "fused" else (".mlp.experts.",)
    for n, g in got["grads"].items():
        if any(m in n for m in mine):
            assert torch.equal(g, g.bfloat16().float()), n
    assert not torch.equal(got["logits"], ref["logits"])


def training_run(model, inputs, steps=2):
    """`steps` AdamW steps from the model's current state: each step's outputs and
    gradients (hf_models.step), and the weights after the last."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        out.append(step(model, inputs))
        opt.step()
    return out, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,path", [("qwen3_moe", "replay"), ("qwen3_moe", "fused"), ("mixtral", "fused"),
                                         ("olmoe", "replay"), ("qwen2_moe", "fused")])
def test_cuda_training_step_is_bitwise_repeatable(family, path, deterministic):
    """D1 of a whole training step on the GPU: two runs of two steps from the same state
    (weights and a fresh AdamW) give the same loss, logits and gradients at each step
    and the same weights after, bit for bit; and the steps did change the weights."""
    model = mok_copy(make_model(family, device="cuda"), path)
    start = copy.deepcopy(model.state_dict())
    inputs = batch("cuda")
    a, wa = training_run(model, inputs)
    model.load_state_dict(start)
    b, wb = training_run(model, inputs)
    for sa, sb in zip(a, b):
        check_same_step(sa, sb)
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n
    assert not torch.equal(a[0]["loss"], a[1]["loss"])  # the first step moved the weights
    assert any(not torch.equal(wa[n], start[n]) for n in wa)


@pytest.mark.parametrize("path", PATHS)
def test_cuda_save_pretrained_round_trip(path, tmp_path, deterministic):
    check_round_trip(path, tmp_path, "cuda")


@pytest.mark.parametrize("path", PATHS)
def test_cuda_torch_compile(path):
    check_compile(path, "cuda")


def test_cuda_unsupported_is_refused():
    """A block whose shape libmok's CUDA backend does not run (an expert width of 96, not
    a multiple of the kernels' 64: MOK_STATUS_UNSUPPORTED_SHAPE at create): fuse() asks
    the backend and refuses the block there, naming it and libmok's reason, replacing
    nothing."""
    model = make_model("qwen3_moe", device="cuda", moe_intermediate_size=96)
    with pytest.raises(mt.UnsupportedModuleError,
                       match=r"model\.layers\.0\.mlp \(Qwen3MoeSparseMoeBlock\) has a configuration on cuda.*"
                             r"UNSUPPORTED_SHAPE.*multiples of 64"):
        mt.fuse(model)
    assert not any(isinstance(m, mt.MokSparseMoeBlock) for m in model.modules())
