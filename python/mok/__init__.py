"""mok: a deterministic mixture-of-experts layer for PyTorch, over libmok.

    import mok
    moe = mok.MoE(hidden=1024, ffn=512, num_experts=8, top_k=2, aux_loss_coef=1e-2)
    y = moe(x)                        # x [T, 1024] bf16
    loss = y.float().pow(2).mean() + moe.aux_loss
    loss.backward()

mok.MoE (nn.Module; process_group= for expert parallelism over GPUs), mok.moe_forward
(the functional form), mok.reduce_replicated (the fixed-tree sum of replicated
gradients), mok.comm_unique_id (the NCCL id of a functional layer's ranks),
mok.MokError (a libmok failure, with its status). The custom ops are torch.ops.mok.moe_forward / moe_backward, so
torch.compile(fullgraph=True) traces a model that uses mok.MoE.

libmok.so is found at $MOK_LIBRARY, or at build/libmok.so of the repository this
package lives in (`make python`).
"""
from ._lib import MOK_REDUCE_CHUNK_TOKENS, MokError, comm_unique_id, library_path, status_string, version
from ._context import Config, clear_cache, synchronize
from .ops import MoEOutput, moe_forward
from .moe import MoE
from .reduce import reduce_replicated
from . import _lib as _lib_module

# load and check the library now (ImportError with a clear message if it is missing,
# from another version, or if the config mirror does not match it)
_lib_module.lib()

__version__ = "0.5.0"

__all__ = [
    "MoE",
    "moe_forward",
    "MoEOutput",
    "Config",
    "reduce_replicated",
    "comm_unique_id",
    "MokError",
    "clear_cache",
    "synchronize",
    "library_path",
    "status_string",
    "version",
    "MOK_REDUCE_CHUNK_TOKENS",
]
