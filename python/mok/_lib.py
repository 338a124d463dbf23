"""ctypes binding of libmok (include/mok.h): the library, mirrors of its structs and
enums, status codes and the error they raise.

The structs here mirror mok.h field for field (same order, same C types); ctypes lays
them out as the C compiler does on the same ABI. mok_config_t carries its own size and
version (MOK_CONFIG_INIT), so a mirror that drifted from the library's header is caught
when the first context is created (MOK_STATUS_VERSION_MISMATCH), which load() does once.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

# ---- mok.h constants -------------------------------------------------------------

MOK_VERSION_MAJOR = 0
MOK_VERSION_MINOR = 5
MOK_VERSION_PATCH = 0
MOK_VERSION_CODE = MOK_VERSION_MAJOR * 10000 + MOK_VERSION_MINOR * 100 + MOK_VERSION_PATCH
MOK_REDUCE_CHUNK_TOKENS = 64

STATUS_NAMES = [
    "MOK_STATUS_SUCCESS",
    "MOK_STATUS_INVALID_CONTEXT",
    "MOK_STATUS_NULL_POINTER",
    "MOK_STATUS_MISALIGNED_POINTER",
    "MOK_STATUS_INVALID_SHAPE",
    "MOK_STATUS_UNSUPPORTED_SHAPE",
    "MOK_STATUS_INVALID_ARGUMENT",
    "MOK_STATUS_NONFINITE_VALUE",
    "MOK_STATUS_VERSION_MISMATCH",
    "MOK_STATUS_INDEX_OUT_OF_RANGE",
    "MOK_STATUS_DUPLICATE_INDEX",
    "MOK_STATUS_WORKSPACE_TOO_SMALL",
    "MOK_STATUS_INVALID_SAVED",
    "MOK_STATUS_CAPACITY_EXCEEDED",
    "MOK_STATUS_COMM_TIMEOUT",
    "MOK_STATUS_COMM_ERROR",
    "MOK_STATUS_BACKEND_UNAVAILABLE",
    "MOK_STATUS_OUT_OF_MEMORY",
    "MOK_STATUS_CUDA_ERROR",
    "MOK_STATUS_INTERNAL_ERROR",
]
for _i, _name in enumerate(STATUS_NAMES):
    globals()[_name] = _i
del _i, _name

MOK_BACKEND_CPU, MOK_BACKEND_CUDA = 0, 1
MOK_SCORE_SOFTMAX, MOK_SCORE_SIGMOID = 0, 1
MOK_ROUTING_FUSED, MOK_ROUTING_REPLAY = 0, 1
MOK_WGRAD_BF16, MOK_WGRAD_FP32_ACCUM = 0, 1
MOK_NUMERICS_BF16, MOK_NUMERICS_EXACT = 0, 1
MOK_GATE_UP_SAVE, MOK_GATE_UP_RECOMPUTE = 0, 1
MOK_SAVED_KEEP, MOK_SAVED_REUSE = 0, 1
MOK_GROUP_SCORE_TOP2, MOK_GROUP_SCORE_MAX = 0, 1
MOK_ACTIVATION_SWIGLU, MOK_ACTIVATION_SWIGLU_CLAMPED = 0, 1

ALIGN_TENSOR = 16       # every tensor pointer
ALIGN_WORKSPACE = 256   # workspace and saved buffers

# ---- struct mirrors ---------------------------------------------------------------

MOK_COMM_UNIQUE_ID_BYTES = 128  # mok.h
_c_enum = ctypes.c_int  # C enums with small non-negative values are int on the ABIs mok runs on


class MokConfig(ctypes.Structure):
    """mok_config_t."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("version", ctypes.c_int),
        ("T", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("F", ctypes.c_int64),
        ("E", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("W", ctypes.c_int),
        ("rank", ctypes.c_int),
        ("routing", _c_enum),
        ("score", _c_enum),
        ("normalize", ctypes.c_int),
        ("route_scale", ctypes.c_float),
        ("use_bias_select", ctypes.c_int),
        ("aux_loss_coef", ctypes.c_float),
        ("z_loss_coef", ctypes.c_float),
        ("n_group", ctypes.c_int),
        ("topk_group", ctypes.c_int),
        ("group_score", _c_enum),
        ("use_router_bias", ctypes.c_int),
        ("use_expert_bias", ctypes.c_int),
        ("activation", _c_enum),
        ("swiglu_alpha", ctypes.c_float),
        ("swiglu_limit", ctypes.c_float),
        ("Fs", ctypes.c_int64),
        ("use_shared_gate", ctypes.c_int),
        ("wgrad", _c_enum),
        ("numerics", _c_enum),
        ("backend", _c_enum),
        ("capacity", ctypes.c_int64),
        ("num_threads", ctypes.c_int),
        ("comm_timeout_s", ctypes.c_double),
        ("cpu_comm", ctypes.c_void_p),
        ("num_ctas", ctypes.c_int),
        ("cta_pairs", _c_enum),
        ("comm_unique_id", ctypes.c_void_p),
        ("gate_up", _c_enum),
        ("saved_use", _c_enum),
    ]

    @classmethod
    def init(cls) -> "MokConfig":
        """MOK_CONFIG_INIT."""
        c = cls()
        c.struct_size = ctypes.sizeof(cls)
        c.version = MOK_VERSION_CODE
        c.T = c.H = c.F = c.E = c.K = 0
        c.W = 1
        c.rank = 0
        c.routing = MOK_ROUTING_FUSED
        c.score = MOK_SCORE_SOFTMAX
        c.normalize = 1
        c.route_scale = 1.0
        c.use_bias_select = 0
        c.aux_loss_coef = 0.0
        c.z_loss_coef = 0.0
        c.n_group = 0
        c.topk_group = 0
        c.group_score = MOK_GROUP_SCORE_TOP2
        c.use_router_bias = 0
        c.use_expert_bias = 0
        c.activation = MOK_ACTIVATION_SWIGLU
        c.swiglu_alpha = 0.0
        c.swiglu_limit = 0.0
        c.Fs = 0
        c.use_shared_gate = 0
        c.wgrad = MOK_WGRAD_BF16
        c.numerics = MOK_NUMERICS_BF16
        c.backend = MOK_BACKEND_CPU
        c.capacity = 0
        c.num_threads = 0
        c.comm_timeout_s = 0.0
        c.cpu_comm = None
        c.num_ctas = 0
        c.cta_pairs = 0  # MOK_CTA_PAIRS_AUTO
        c.comm_unique_id = None
        c.gate_up = MOK_GATE_UP_SAVE
        c.saved_use = MOK_SAVED_KEEP
        return c


class MokForwardArgs(ctypes.Structure):
    """mok_forward_args_t."""

    _fields_ = [
        ("num_tokens", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("w_router", ctypes.c_void_p),
        ("bias_select", ctypes.c_void_p),
        ("b_router", ctypes.c_void_p),
        ("w13", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("b13", ctypes.c_void_p),
        ("b2", ctypes.c_void_p),
        ("ws13", ctypes.c_void_p),
        ("ws2", ctypes.c_void_p),
        ("w_sg", ctypes.c_void_p),
        ("topk_idx", ctypes.c_void_p),
        ("topk_weight", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("tokens_per_expert", ctypes.c_void_p),
        ("aux_loss", ctypes.c_void_p),
        ("z_loss", ctypes.c_void_p),
        ("saved", ctypes.c_void_p),
        ("saved_bytes", ctypes.c_size_t),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
    ]


class MokBackwardArgs(ctypes.Structure):
    """mok_backward_args_t."""

    _fields_ = [
        ("num_tokens", ctypes.c_int64),
        ("x", ctypes.c_void_p),
        ("w_router", ctypes.c_void_p),
        ("w13", ctypes.c_void_p),
        ("w2", ctypes.c_void_p),
        ("b13", ctypes.c_void_p),
        ("ws13", ctypes.c_void_p),
        ("ws2", ctypes.c_void_p),
        ("w_sg", ctypes.c_void_p),
        ("dy", ctypes.c_void_p),
        ("d_aux_loss", ctypes.c_void_p),
        ("d_z_loss", ctypes.c_void_p),
        ("saved", ctypes.c_void_p),
        ("saved_bytes", ctypes.c_size_t),
        ("dx", ctypes.c_void_p),
        ("d_topk_weight", ctypes.c_void_p),
        ("d_w_router", ctypes.c_void_p),
        ("d_b_router", ctypes.c_void_p),
        ("d_w13", ctypes.c_void_p),
        ("d_w2", ctypes.c_void_p),
        ("d_b13", ctypes.c_void_p),
        ("d_b2", ctypes.c_void_p),
        ("d_ws13", ctypes.c_void_p),
        ("d_ws2", ctypes.c_void_p),
        ("d_w_sg", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
    ]


# ---- errors -----------------------------------------------------------------------


class MokError(RuntimeError):
    """A libmok call failed. `status` is the mok_status_t code, `status_name` its name
    (e.g. "MOK_STATUS_BACKEND_UNAVAILABLE"), and the message is the library's own
    (which argument, which rule)."""

    def __init__(self, status: int, message: str, call: str = ""):
        self.status = int(status)
        self.status_name = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else f"status {status}"
        self.message = message
        self.call = call
        where = f"{call}: " if call else ""
        super().__init__(f"{where}{self.status_name}: {message}" if message else f"{where}{self.status_name}")


# ---- loading ----------------------------------------------------------------------

_lock = threading.Lock()
_lib = None
_lib_path = None


def _candidates():
    env = os.environ.get("MOK_LIBRARY")
    if env:
        return [Path(env)]
    here = Path(__file__).resolve().parent  # python/mok
    return [
        here.parent.parent / "build" / "libmok.so",  # repository checkout: <repo>/build/libmok.so
        here.parent / "build" / "libmok.so",          # python/build/libmok.so
        here / "libmok.so",                           # installed next to the package
    ]


def library_path() -> str:
    """Path of the libmok.so that is (or would be) loaded."""
    if _lib_path:
        return _lib_path
    for c in _candidates():
        if c.is_file():
            return str(c)
    return ""


def _declare(lib):
    P = ctypes.c_void_p
    st = ctypes.c_int
    sigs = {
        "mok_status_string": (ctypes.c_char_p, [st]),
        "mok_version": (ctypes.c_int, []),
        "mok_context_create": (st, [ctypes.POINTER(MokConfig), ctypes.POINTER(ctypes.c_void_p)]),
        "mok_context_destroy": (st, [P]),
        "mok_context_last_error": (ctypes.c_char_p, [P]),
        "mok_last_create_error": (ctypes.c_char_p, []),
        "mok_workspace_size": (st, [P, ctypes.POINTER(ctypes.c_size_t)]),
        "mok_workspace_sizes": (st, [P, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]),
        "mok_saved_size": (st, [P, ctypes.POINTER(ctypes.c_size_t)]),
        "mok_forward": (st, [P, ctypes.POINTER(MokForwardArgs)]),
        "mok_backward": (st, [P, ctypes.POINTER(MokBackwardArgs)]),
        "mok_reduce_tree": (st, [P, ctypes.c_int64, ctypes.c_int64, P]),
        "mok_cpu_comm_create": (st, [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]),
        "mok_comm_unique_id": (st, [P, ctypes.c_size_t]),
        "mok_cpu_comm_destroy": (st, [P]),
    }
    optional = {"mok_context_sync": (st, [P])}
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    for name, (res, args) in optional.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = res
            fn.argtypes = args


def lib():
    """The loaded libmok (ctypes.CDLL), loading and checking it on first use."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = _candidates()
        path = next((c for c in tried if c.is_file()), None)
        if path is None:
            raise ImportError(
                "mok: libmok.so not found (looked at "
                + ", ".join(str(c) for c in tried)
                + "): build it with `make python` in the mok repository, or set MOK_LIBRARY "
                "to its path"
            )
        handle = ctypes.CDLL(str(path))
        _declare(handle)
        version = handle.mok_version()
        if version != MOK_VERSION_CODE:
            raise ImportError(
                f"mok: {path} is libmok version code {version}, but this binding mirrors mok.h "
                f"version code {MOK_VERSION_CODE}: rebuild the library and the binding together"
            )
        _check_config_mirror(handle, path)
        _lib, _lib_path = handle, str(path)
        return _lib


def _check_config_mirror(handle, path):
    """Creates one tiny context: the library compares struct_size with its own
    sizeof(mok_config_t) and answers VERSION_MISMATCH when the mirror is wrong."""
    cfg = MokConfig.init()
    cfg.T, cfg.H, cfg.F, cfg.E, cfg.K, cfg.num_threads = 0, 1, 1, 1, 1, 1
    ctx = ctypes.c_void_p()
    s = handle.mok_context_create(ctypes.byref(cfg), ctypes.byref(ctx))
    if s == MOK_STATUS_VERSION_MISMATCH:
        msg = (handle.mok_last_create_error() or b"").decode(errors="replace")
        raise ImportError(
            f"mok: the ctypes mirror of mok_config_t ({ctypes.sizeof(MokConfig)} bytes) does "
            f"not match {path}: {msg}"
        )
    if s != MOK_STATUS_SUCCESS:
        msg = (handle.mok_last_create_error() or b"").decode(errors="replace")
        raise ImportError(f"mok: could not create a test context with {path}: {STATUS_NAMES[s]}: {msg}")
    handle.mok_context_destroy(ctx)


def status_string(status: int) -> str:
    return lib().mok_status_string(int(status)).decode()


def version() -> int:
    return lib().mok_version()


def check(status: int, call: str, ctx=None):
    """Raises MokError for a failed call, with the context's (or create's) message."""
    if status == MOK_STATUS_SUCCESS:
        return
    L = lib()
    if ctx is not None:
        msg = (L.mok_context_last_error(ctx) or b"").decode(errors="replace")
    elif call == "mok_context_create":
        msg = (L.mok_last_create_error() or b"").decode(errors="replace")
    else:
        msg = L.mok_status_string(int(status)).decode(errors="replace")
    raise MokError(status, msg, call)


def comm_unique_id() -> str:
    """A new NCCL unique id for the W ranks of a CUDA layer (mok_comm_unique_id), as hex:
    made on one rank, given to every rank's mok.Config(comm_id=...)."""
    buf = ctypes.create_string_buffer(MOK_COMM_UNIQUE_ID_BYTES)
    check(lib().mok_comm_unique_id(buf, MOK_COMM_UNIQUE_ID_BYTES), "mok_comm_unique_id")
    return buf.raw.hex()
