"""mok.MoE(process_group=...) under torchrun on two GPUs (skipped with fewer; `make
test-gpu` runs it on the 2-GPU H200 machine): each rank's outputs and gradients bitwise
equal to mok.MoE at W = 1 on the global batch (ep_worker.py), with fused routing and the
router losses, with replay routing, and with fp32 main_grad accumulation."""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")


@pytest.mark.parametrize("flags", [[], ["--replay"], ["--accum"]], ids=["fused", "replay", "accum"])
def test_expert_parallel_is_bitwise_w1(flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(HERE, "ep_worker.py")] + flags
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")  # never NVLink multicast
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("rank ")]
    assert out.returncode == 0 and sorted(lines) == ["rank 0: ok", "rank 1: ok"], \
        f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
