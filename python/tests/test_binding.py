"""The ctypes mirror against include/mok.h (compiled here with the C compiler), the
library's load-time checks, and mok.reduce_replicated (single process and under
torch.distributed with the gloo backend)."""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import mok
from mok import _lib

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
HEADER = os.path.join(REPO, "include", "mok.h")

STRUCTS = {
    "mok_config_t": _lib.MokConfig,
    "mok_forward_args_t": _lib.MokForwardArgs,
    "mok_backward_args_t": _lib.MokBackwardArgs,
}


def _c_layout():
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc) or not os.path.isfile(HEADER):
        pytest.skip("needs a C compiler and include/mok.h")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "mok.h"', "int main(void) {"]
    for cname, py in STRUCTS.items():
        lines.append(f'  printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for field, _ in py._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    lines.append('  printf("MOK_VERSION_CODE %d\\n", MOK_VERSION_CODE);')
    lines.append('  printf("MOK_REDUCE_CHUNK_TOKENS %d\\n", MOK_REDUCE_CHUNK_TOKENS);')
    lines.append('  printf("MOK_STATUS_COUNT_ %d\\n", (int)MOK_STATUS_COUNT_);')
    lines.append("  return 0; }")
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
        with open(src, "w") as f:
            f.write("\n".join(lines))
        r = subprocess.run([cc, "-std=c11", "-I", os.path.dirname(HEADER), src, "-o", exe], capture_output=True, text=True)
        assert r.returncode == 0, f"a field of the ctypes mirror is not in mok.h:\n{r.stderr}"
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        table[tuple(parts[:-1])] = int(parts[-1])
    return table


def test_struct_mirrors_match_mok_h():
    table = _c_layout()
    for cname, py in STRUCTS.items():
        c_fields = [k[1] for k in table if k[0] == cname and k[1] != "sizeof"]
        assert c_fields == [f for f, _ in py._fields_]
        for field, _ in py._fields_:
            assert getattr(py, field).offset == table[(cname, field)], f"{cname}.{field}"
        assert ctypes.sizeof(py) == table[(cname, "sizeof")], f"sizeof({cname})"
    assert table[("MOK_VERSION_CODE",)] == _lib.MOK_VERSION_CODE
    assert table[("MOK_REDUCE_CHUNK_TOKENS",)] == mok.MOK_REDUCE_CHUNK_TOKENS
    assert table[("MOK_STATUS_COUNT_",)] == len(_lib.STATUS_NAMES)


def test_library_loaded_and_checked():
    assert os.path.isfile(mok.library_path())
    assert mok.version() == _lib.MOK_VERSION_CODE
    assert mok.status_string(16).startswith("MOK_STATUS_BACKEND_UNAVAILABLE")


def test_version_mismatch_is_detected():
    """A config struct of the wrong size is what the load-time check catches."""
    L = _lib.lib()
    cfg = _lib.MokConfig.init()
    cfg.struct_size -= 8
    cfg.T, cfg.H, cfg.F, cfg.E, cfg.K = 0, 1, 1, 1, 1
    h = ctypes.c_void_p()
    s = L.mok_context_create(ctypes.byref(cfg), ctypes.byref(h))
    assert s == _lib.MOK_STATUS_VERSION_MISMATCH
    with pytest.raises(mok.MokError, match="struct_size"):
        _lib.check(s, "mok_context_create")


def test_missing_library_message():
    env = dict(os.environ, MOK_LIBRARY="/nonexistent/libmok.so")
    code = "import mok"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(mok.__file__))))
    assert r.returncode != 0 and "make python" in r.stderr and "MOK_LIBRARY" in r.stderr


# ---------------------------------------------------------------- reduce_replicated


def tree_sum(p, lo, hi):
    """the fixed tree in plain torch: node [lo, hi) = [lo, mid) + [mid, hi), with the
    binding's split rule (which the distributed form relies on)"""
    if hi - lo == 1:
        return p[lo].clone()
    mid = mok.reduce._tree_mid(lo, hi)
    assert lo < mid < hi
    return tree_sum(p, lo, mid) + tree_sum(p, mid, hi)


@pytest.mark.parametrize("N", [1, 2, 3, 5, 7, 12, 16, 37, 100])
def test_reduce_replicated_is_the_fixed_tree(N):
    p = torch.randn(N, 5, 3) * torch.logspace(-3, 3, N)[:, None, None]
    out = mok.reduce_replicated(p)
    assert out.shape == (5, 3) and out.dtype == torch.float32
    assert torch.equal(out, tree_sum(p, 0, N))


@pytest.mark.parametrize("N", [0, 1, 2, 3, 5, 7, 12, 16, 37, 100, 129])
def test_pairwise_torch_tree_is_the_library_tree(N):
    """The torch-op evaluation (used for GPU partials) gives mok_reduce_tree's bits."""
    p = torch.randn(N, 7) * torch.logspace(-3, 3, max(N, 1))[:N, None]
    assert torch.equal(mok.reduce._reduce_pairwise(p), mok.reduce._reduce_local(p))


def test_reduce_replicated_errors_and_empty():
    assert torch.equal(mok.reduce_replicated(torch.zeros(0, 4)), torch.zeros(4))
    with pytest.raises(TypeError, match="float32"):
        mok.reduce_replicated(torch.zeros(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_chunks"):
        mok.reduce_replicated(torch.tensor(1.0))


def _dist_worker(rank, world, init_file, splits, n, seed, result_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(seed)
        N = sum(splits)
        allp = torch.randn(N, n, generator=g) * torch.logspace(-4, 4, N, dtype=torch.float32)[:, None]
        lo = sum(splits[:rank])
        out = mok.reduce_replicated(allp[lo : lo + splits[rank]])
        torch.save(out, os.path.join(result_dir, f"{rank}.pt"))
        dist.barrier()  # no rank tears down gloo while another still talks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("splits", [[3, 4], [1, 5, 1], [4, 0, 3]], ids=str)
def test_reduce_replicated_distributed_matches_single_process(splits, tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world, n, seed = len(splits), 33, 7
    mp.spawn(_dist_worker, args=(world, str(tmp_path / "init"), splits, n, seed, str(tmp_path)), nprocs=world, join=True)
    g = torch.Generator().manual_seed(seed)
    N = sum(splits)
    allp = torch.randn(N, n, generator=g) * torch.logspace(-4, 4, N, dtype=torch.float32)[:, None]
    single = mok.reduce_replicated(allp)
    for r in range(world):
        assert torch.equal(torch.load(tmp_path / f"{r}.pt"), single), f"rank {r}"
