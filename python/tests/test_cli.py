"""The mok command's layer options (tools/mok.c): the router and expert variants and
group-limited routing in `mok check` and `mok bench` on the CPU backend. The command is
the one built beside the library under test (MOK_LIBRARY's folder, as `make` leaves
build/mok next to build/libmok.so); skipped where there is none."""
import json
import os
import subprocess

import pytest

from mok import _lib

MOK = os.path.join(os.path.dirname(_lib.library_path()), "mok")
pytestmark = pytest.mark.skipif(not os.access(MOK, os.X_OK), reason=f"no mok command at {MOK}")

ALL = ["--routing", "deepseek-v3", "--router-bias", "on", "--expert-bias", "on", "--swiglu-limit", "0.5",
       "--shared-ffn", "64", "--shared-gate", "on"]


def mok(*args):
    return subprocess.run([MOK, *args], capture_output=True, text=True, timeout=300)


def test_check_with_every_variant():
    out = mok("check", "--shape", "tiny", "--ranks", "1,2", "--seed", "3", "--threads", "1", *ALL)
    assert out.returncode == 0, out.stdout + out.stderr
    routing = next(line for line in out.stdout.splitlines() if line.startswith("routing:"))
    for words in ("sigmoid", "bias_select", "the best 4 of 8 groups by their top-2 sums", "router logit bias",
                  "scaled by 2.5", "clamped SwiGLU (limit 0.5, alpha 1.702)", "biases b13, b2", "Fs 64, gated"):
        assert words in routing, (words, routing)
    checks = [line for line in out.stdout.splitlines() if line.startswith(("D1 ", "D2 ", "D3 ", "D4 "))]
    assert len(checks) == 5 and all(line.endswith("bitwise identical") for line in checks), out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("all 6 checks ok"), out.stdout


def test_check_default_is_the_plain_layer():
    out = mok("check", "--shape", "tiny", "--ranks", "1", "--seed", "3", "--threads", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "routing: fused softmax top-2, normalised, aux_loss_coef 0.01, z_loss_coef 0.001; experts: SwiGLU;" in out.stdout


def test_bench_writes_the_layer(tmp_path):
    path = str(tmp_path / "bench.json")
    out = mok("bench", "--shape", "tiny", "--steps", "1", "--threads", "1", "--json", path, "--n-group", "4",
              "--topk-group", "2", "--group-score", "max", "--expert-bias", "on", "--swiglu-limit", "7")
    assert out.returncode == 0, out.stdout + out.stderr
    with open(path) as f:
        layer = json.load(f)["layer"]
    assert layer == {"score": "softmax", "route_scale": 1, "bias_select": 0, "n_group": 4, "topk_group": 2,
                     "group_score": "max", "router_bias": 0, "expert_bias": 1, "swiglu_limit": 7,
                     "swiglu_alpha": 1.702, "shared_gate": 0}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n-group", "3", "--topk-group", "1"], "cfg.n_group = 3 must divide cfg.E = 8"),
        (["--n-group", "8", "--topk-group", "1"], "cfg.K = 2 must be at most the experts of the kept groups"),
        (["--topk-group", "2"], "cfg.topk_group = 2 needs cfg.n_group"),
        (["--swiglu-limit", "0"], "cfg.swiglu_limit = 0 must be > 0"),
        (["--swiglu-limit", "nan"], "--swiglu-limit needs a finite number"),
        (["--swiglu-limit", "7", "--swiglu-alpha", "-1"], "cfg.swiglu_alpha = -1 must be > 0"),
        (["--shared-gate", "on"], "needs a shared expert (cfg.Fs > 0)"),
        (["--router-bias", "yes"], "--router-bias needs off or on"),
        (["--group-score", "sum"], "--group-score needs top2 or max"),
        (["--routing", "v3"], "--routing needs default or deepseek-v3"),
        (["--shared-ffn", "-1"], "--shared-ffn needs an integer"),
    ],
)
@pytest.mark.parametrize("command", ["check", "bench"])
def test_bad_layer_options_are_named(command, args, message):
    out = mok(command, "--shape", "tiny", *args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr, out.stderr
