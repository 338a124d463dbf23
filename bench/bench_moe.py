"""bench_moe.py — one training step (forward + backward) of the MoE layer on one GPU:
mok against a PyTorch peer written here and the dense bf16 GEMM ceiling, in one run.

    python3 bench/bench_moe.py [--shapes qwen3-30b-a3b,...] [--steps 20] [--json out.json]

The peer is what a careful PyTorch user writes: fp32 router softmax and top-K, tokens
sorted by expert (stable argsort), torch._grouped_mm for the gate|up and down
projections, SwiGLU, weighted scatter back with index_add_, under torch.compile.
Both run the same weights, inputs and routing (bias_select adds the same selection
bias to both); "skewed" routing makes E/32 experts (at least one) hot: every token
selects them; "groups" (deepseek-v3) is DeepSeek-V3's own group-limited router in both
(shapes.ROUTERS). Times: CUDA events around --steps back-to-back steps (the host queues
the next step while the GPU runs, as in training), median of 3 such runs; "iso ms":
one step at a time from an idle GPU (its host launch latency exposed), median of --steps.
--rounds N: mok and the peer timed N times a row, in turn (the peer first in odd
rounds); ms is the median of the rounds, and the rounds' peer/mok ratios (their
spread: a difference smaller than it is noise) are printed and kept in the JSON. TFLOP/s
counts 3 x the forward FLOPs (6 T K H F + 2 T H E), DESIGN.md section 7. Peak memory:
torch.cuda.max_memory_allocated over a step, weights and inputs included, less what was
allocated before the shape's problem was made (what earlier shapes leave cached: 0.03-0.04
GiB on the later shapes of a run until 2026-12-06); the peer's with none of mok's memory
left (its cached contexts freed first).
Determinism: two steps on the same inputs give equal y, dx and weight grads (compared
by two integer sums over their bits, so that no gradient is held twice).
--recompute-gate-up: mok's layer with recompute_gate_up=True (its backward computes
gate|up again instead of the forward keeping it: less peak memory, one more GEMM).
--keep-saved: mok's layer with reuse_saved=False (its backward leaves the saved tensor as
it is; the default, reuse_saved=True, writes the backward's scratch over the saved
tensor's parts it has read: less peak memory, the same work).
--variants: mok alone, uniform routing, each shape with every variant off and then with
each of shapes.VARIANTS on, in turn, --rounds times; ms is the median of the rounds and
the cost each variant's ms over the variants-off ms of the same rounds.
"""
import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

if "--profile" in sys.argv:
    os.environ["MOK_PROFILE"] = "1"  # read by libmok when a context is created
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import mok  # noqa: E402
from ep_peer import route  # noqa: E402  (bench/ is this script's directory)
from shapes import ROUTERS, SHAPES, VARIANTS, hot_experts, step_flops  # noqa: E402

# mok.MoE's memory options, set from --recompute-gate-up and --keep-saved
LAYER_OPTIONS = {"recompute_gate_up": False, "reuse_saved": True}


def time_ms(fn, steps, warmup=3, before_run=None):
    """Milliseconds a call of fn: CUDA events around `steps` back-to-back calls (the
    host queues the next call while the GPU runs, as in training), median of 3 such
    runs. The GPU is idle before each run, so its first call's launch latency counts.
    before_run (e.g. a distributed barrier) is called before each run."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    global LAST_WINDOW
    t0 = time.time()
    runs = []
    for _ in range(3):
        if before_run:
            before_run()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(steps):
            fn()
        b.record()
        b.synchronize()
        runs.append(a.elapsed_time(b) / steps)
    LAST_WINDOW = (t0, time.time())
    return statistics.median(runs)


class GpuSampler:
    """SM clock (MHz), board power (W) and temperature (C) of the GPU every 50 ms, from `nvidia-smi -lms`
    in the background, each sample stamped by nvidia-smi itself (its output reaches us in
    bursts). A sustained run is limited by the board's power cap, so a faster step at
    full clock need not be a faster step in a long run. mean(t0, t1): (MHz, W, C) over a
    wall-clock (time.time()) interval, or (None, None, None)."""

    def __init__(self):
        import shutil
        import threading
        from datetime import datetime
        self.samples, self.proc = [], None
        if not shutil.which("nvidia-smi"):
            return
        dev = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        query = None
        for q in ("timestamp,clocks.sm,power.draw.instant,temperature.gpu",
                  "timestamp,clocks.sm,power.draw,temperature.gpu"):
            r = subprocess.run(["nvidia-smi", "-i", dev, f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            if r.returncode == 0 and "Not Supported" not in r.stdout and "N/A" not in r.stdout:
                query = q
                break
        if not query:
            return
        self.proc = subprocess.Popen(
            ["nvidia-smi", "-i", dev, f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in self.proc.stdout:
                try:
                    stamp, mhz, watts, celsius = (v.strip() for v in line.split(","))
                    t = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    self.samples.append((t, float(mhz), float(watts), float(celsius)))
                except ValueError:
                    continue

        threading.Thread(target=read, daemon=True).start()

    def mean(self, t0, t1):
        deadline = time.time() + 2.0  # samples up to t1 may still be on their way
        while time.time() < deadline and not any(x[0] >= t1 for x in list(self.samples)):
            time.sleep(0.05)
        xs = [x[1:] for x in list(self.samples) if t0 <= x[0] <= t1]
        if not xs:
            return None, None, None
        return tuple(statistics.mean(x[i] for x in xs) for i in range(3))

    def stop(self):
        if self.proc:
            self.proc.terminate()


SAMPLER = None
LAST_WINDOW = (0.0, 0.0)  # wall-clock interval of time_ms's last timed runs (after warm-up)


def timed(fn, steps, out):
    """time_ms(fn, steps), with the mean SM clock and power over its timed runs (not the
    warm-up, which for the peer includes torch.compile) into out."""
    ms = time_ms(fn, steps)
    if SAMPLER:
        out["sm_mhz"], out["watts"], out["celsius"] = SAMPLER.mean(*LAST_WINDOW)
        if out["watts"]:
            out["joules_per_step"] = out["watts"] * ms / 1e3
    return ms


def time_isolated_ms(fn, steps, warmup=3):
    """Milliseconds a call of fn from an idle GPU: CUDA events around each call, the
    host waiting for it before the next (the host's launch latency counts in every call),
    median of `steps`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def ceiling_tflops(n=8192, steps=10, out=None, warm=0.0):
    """The dense bf16 GEMM rate (n^3, torch's a @ b). warm > 0: after that many seconds
    of back-to-back GEMMs, i.e. at the clock the board's power cap allows a sustained
    run (the steps' condition), with 100 timed GEMMs (long enough for power samples)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    warm_up(lambda: a @ b, warm)
    ms = timed(lambda: a @ b, 100 if warm else steps, out if out is not None else {})
    return 2 * n**3 / ms / 1e9


def peer_forward(x, w_router, bias, w13, w2, K, router):
    """The PyTorch peer layer: routing in fp32 (router: route's options), grouped GEMMs
    in bf16."""
    T, H = x.shape
    E, twoF, _ = w13.shape
    Fd = twoF // 2
    idx, g = route(x, w_router, bias, K, **router)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    token = order // K
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x[token]
    a = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    h = F.silu(a[:, :Fd]) * a[:, Fd:]
    o = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    o = o * g.flatten()[order].unsqueeze(1).to(o.dtype)
    return torch.zeros_like(x).index_add_(0, token, o)


def fingerprint(t, chunk=1 << 26):
    """Two integer sums over the bits of t (chunked: no full-size temporary), enough to
    tell two runs apart without keeping a copy of every gradient."""
    bits = t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).flatten()
    out = []
    for i in range(0, bits.numel(), chunk):
        c = bits[i : i + chunk].to(torch.int64)
        w = torch.arange(1, c.numel() + 1, device=c.device, dtype=torch.int64) % 65521
        out += [int(c.sum()), int((c * w).sum())]
    return out


def step_fingerprint(y, x, params):
    return [fingerprint(y), fingerprint(x.grad)] + [fingerprint(p.grad) for p in params]


class Problem:
    """One named shape on the GPU: a mok.MoE layer (seeded weights; routing "skewed"
    makes E/32 experts, at least one, hot through bias_select; a mode of shapes.ROUTERS
    is the shape's own router), x and dy, and one training step of mok or of the PyTorch
    peer on them (the same weights, inputs and routing)."""

    def __init__(self, name, routing="uniform", variant=None):
        T, H, Fd, E, K = SHAPES[name]
        torch.manual_seed(0)
        self.K = K
        self.router = ROUTERS.get(name, {}).get(routing, {})
        variant = {k: Fd if v == "F" else v for k, v in (variant or {}).items()}  # "F": the shape's ffn
        self.layer = mok.MoE(H, Fd, E, K, bias_select=True, max_tokens=T, device="cuda",
                             **self.router, **variant, **LAYER_OPTIONS)
        with torch.no_grad():
            self.layer.bias_select.zero_()
            if routing == "skewed":
                self.layer.bias_select[: hot_experts(E)] = 1.0
        self.x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        self.dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        self.params = [p for p in (self.layer.w_router, self.layer.w13, self.layer.w2, self.layer.b_router,
                                   self.layer.b13, self.layer.b2, self.layer.ws13, self.layer.ws2,
                                   self.layer.w_sg) if p is not None]
        self.peer = self.bias = None  # at the first peer_step

    def zero(self):
        self.x.grad = None
        for p in self.params:
            p.grad = None

    def mok_step(self):
        self.zero()
        y = self.layer(self.x)
        y.backward(self.dy)
        return y

    def mok_forward(self):
        with torch.no_grad():
            self.layer(self.x)

    def peer_step(self):
        if self.peer is None:
            self.peer = torch.compile(peer_forward, dynamic=False)
            self.bias = self.layer.bias_select.detach().float()
        self.zero()
        w = self.layer
        y = self.peer(self.x, w.w_router, self.bias, w.w13, w.w2, self.K, self.router)
        y.backward(self.dy)
        return y

    def release(self):
        """Frees the tensors and mok's contexts and workspaces: the next shape starts empty."""
        del self.layer, self.x, self.dy, self.params, self.peer, self.bias
        mok.clear_cache()
        torch.cuda.empty_cache()


def warm_up(step, seconds):
    """Calls step back to back for `seconds`: the board then sits at its power limit, at
    the clock of a sustained run, as in the bench's timed runs (0: nothing)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(5):
            step()
        torch.cuda.synchronize()


def profile_shape(name, routing, warm=0.0, variant=None):
    """MOK_PROFILE=1: the library prints CTA time per task kind at each mok.synchronize().
    warm > 0: the peer's steps run that many seconds first (mok's own would all be
    traced), so the traced step runs at a sustained run's clock."""
    pb = Problem(name, routing, variant=VARIANTS[variant] if variant else None)
    for _ in range(2):
        pb.mok_step()
    mok.synchronize()
    warm_up(pb.peer_step, warm)
    print(f"{name} {routing}: one step", file=sys.stderr, flush=True)
    pb.mok_step()
    mok.synchronize()
    pb.release()


def gpu_profile(label, step, steps, in_order=False, warm=0.0):
    """`steps` calls of step under torch.profiler: the CUDA-event time of a call against
    the sum of the GPU's kernel and memset times, each kernel by name, and the GPU's idle
    time inside the call. in_order: also the first call's kernels in launch order.
    warm: seconds of back-to-back calls first (a sustained run's clock)."""
    from torch.profiler import ProfilerActivity, profile

    time_ms(step, 1)  # warm-up calls, outside the profile
    warm_up(step, warm)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = time_isolated_ms(step, steps, warmup=0)
    gpu = [e for e in prof.events() if e.device_type.name == "CUDA"]
    back_to_back_gaps(label, step, steps)
    by_name = {}
    for e in gpu:
        by_name.setdefault(e.name, []).append(e.device_time_total / 1e3)  # us -> ms
    busy = sum(sum(v) for v in by_name.values()) / steps
    print(f"{label}: step {wall:.2f} ms (CUDA events, median of {steps}); GPU busy "
          f"{busy:.2f} ms a step; idle inside the step {wall - busy:.2f} ms")
    for n, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(v) / steps:9.3f} ms a step  x{len(v) / steps:4.1f}  {n[:100]}")
    if in_order:
        per_step = len(gpu) // steps
        first = sorted(gpu, key=lambda e: e.time_range.start)[:per_step]
        print(f"  one step in launch order ({per_step} kernels):")
        for e in first:
            print(f"    {e.device_time_total / 1e3:8.3f} ms  {e.name[:100]}")


def back_to_back_gaps(label, step, steps):
    """`steps` calls of step back to back (as time_ms runs them) under torch.profiler:
    the wall time a step (CUDA events), the host's time to issue a step, the GPU's
    kernel time a step, and where on the GPU's timeline it sat idle (the gaps between
    one kernel's end and the next's start, summed a step by the pair of names)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        host = (time.perf_counter() - t0) * 1e3 / steps
        b.record()
        b.synchronize()
    wall = a.elapsed_time(b) / steps
    gpu = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    busy = sum(e.device_time_total for e in gpu) / 1e3 / steps
    gaps, end, prev = {}, None, None
    for e in gpu:
        if end is not None and e.time_range.start > end:
            key = (prev[:40], e.name[:40])
            gaps[key] = gaps.get(key, 0.0) + (e.time_range.start - end) / 1e3 / steps
        if end is None or e.time_range.end > end:
            end, prev = e.time_range.end, e.name
    print(f"{label} back to back ({steps} steps): {wall:.3f} ms a step (CUDA events); host issues a step in "
          f"{host:.3f} ms; GPU busy {busy:.3f} ms a step; idle between kernels {sum(gaps.values()):.3f} ms a step")
    for (p, n), g in sorted(gaps.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {g:8.3f} ms a step idle between  {p}  ->  {n}")


def kernel_times(name, steps=5, warm=0.0):
    """Where a step's wall time goes on the GPU, mok's and the peer's (the first question
    of docs/PERF.md's "what to try next"): gpu_profile of each; the peer's kernels also
    in launch order, so that each grouped GEMM's time can be set against its FLOPs
    (forward: gate|up 4 R H F, down 2 R H F; backward twice each; R = T K)."""
    T, H, Fd, E, K = SHAPES[name]
    R = T * K
    print(f"{name}: GEMM GFLOP a step: forward gate|up {4 * R * H * Fd / 1e9:.0f}, down {2 * R * H * Fd / 1e9:.0f}")
    pb = Problem(name)
    gpu_profile(f"{name} mok", pb.mok_step, steps, warm=warm)
    gpu_profile(f"{name} peer", pb.peer_step, steps, in_order=True, warm=warm)
    pb.release()


def bench_shape(name, routing, steps, ceiling, mok_only=False, rounds=1):
    T, H, Fd, E, K = SHAPES[name]
    base = torch.cuda.memory_allocated()  # (not this shape's: peaks are counted above it)
    pb = Problem(name, routing)
    x, params, mok_step, peer_step = pb.x, pb.params, pb.mok_step, pb.peer_step
    result = {"shape": name, "routing": routing, "T": T, "H": H, "F": Fd, "E": E, "K": K}
    fl = step_flops(T, H, Fd, E, K)

    # ---- mok ----
    torch.cuda.reset_peak_memory_stats()
    power = {}
    ms = timed(mok_step, steps, power)
    mem = torch.cuda.max_memory_allocated() - base
    ms_iso = time_isolated_ms(mok_step, steps)
    ms_fwd = time_ms(pb.mok_forward, steps)
    y1 = mok_step().detach()
    ref = [y1.float(), x.grad.float()]  # for the peer's difference to mok
    f1 = step_fingerprint(y1, x, params)
    f2 = step_fingerprint(mok_step(), x, params)
    result["mok"] = {"ms": ms, "isolated_ms": ms_iso, "forward_ms": ms_fwd, "tflops": fl / ms / 1e9, "forward_tflops": fl / 3 / ms_fwd / 1e9,
                     "peak_gib": mem / 2**30, "deterministic": f1 == f2,
                     "bits": hashlib.sha1(repr(f1).encode()).hexdigest()[:12], **power}
    pb.zero()

    # ---- PyTorch peer (not with mok_only: A/B runs of two builds) ----
    result["ceiling_tflops"] = ceiling
    if mok_only:
        del x, params, mok_step, peer_step, ref
        pb.release()
        return result
    try:
        # the peer's peak without mok's memory: mok's contexts (their workspaces, cached by
        # the binding) are freed and the reference waits in host memory (until 2026-12-01
        # the peer's peak counted both: docs/PERF.md, fifteenth session)
        ref = [r.cpu() for r in ref]
        mok.clear_cache()
        torch.cuda.reset_peak_memory_stats()
        power_p = {}
        ms_p = timed(peer_step, steps, power_p)
        mem_p = torch.cuda.max_memory_allocated() - base
        ms_p_iso = time_isolated_ms(peer_step, steps)
        y1 = peer_step().detach()
        err = [float((a.float().cpu() - b).norm() / b.norm()) for a, b in zip([y1, x.grad], ref)]
        f1 = step_fingerprint(y1, x, params)
        f2 = step_fingerprint(peer_step(), x, params)
        result["peer"] = {"ms": ms_p, "isolated_ms": ms_p_iso, "tflops": fl / ms_p / 1e9, "peak_gib": mem_p / 2**30,
                          "deterministic": f1 == f2, "rel_diff_y_dx_vs_mok": err, **power_p}
    except Exception as e:  # report, do not hide
        result["peer"] = {"error": repr(e)[:300]}
    # ---- rounds > 1: mok and the peer timed again, in turn (the peer first in odd
    # rounds, so neither always runs on a GPU the other just warmed); ms is then the
    # median over the rounds, and the rounds' ratios show the run-to-run spread that a
    # difference between the two must exceed
    if rounds > 1 and "error" not in result["peer"]:
        m, p = result["mok"], result["peer"]
        m["ms_rounds"], p["ms_rounds"] = [m["ms"]], [p["ms"]]
        for r in range(1, rounds):
            for who, step in ([("peer", peer_step), ("mok", mok_step)] if r % 2 else
                              [("mok", mok_step), ("peer", peer_step)]):
                result[who]["ms_rounds"].append(time_ms(step, steps))
        m["ms"], p["ms"] = statistics.median(m["ms_rounds"]), statistics.median(p["ms_rounds"])
        m["tflops"], p["tflops"] = fl / m["ms"] / 1e9, fl / p["ms"] / 1e9
        result["ratio_rounds"] = [b / a for a, b in zip(m["ms_rounds"], p["ms_rounds"])]
    del x, params, mok_step, peer_step, ref
    pb.release()
    return result


def bench_variants(names, steps, rounds):
    """--variants: per shape, mok's step with every variant off, then with each of
    shapes.VARIANTS, in turn (the order reversed in odd rounds), `rounds` times; a line a
    variant: median ms, its ratio to variants off, the rounds' ratios, determinism."""
    rows = []
    for name in names:
        kinds = ["off", *VARIANTS]
        ms = {k: [] for k in kinds}
        det = {}
        for r in range(rounds):
            for k in (kinds if r % 2 == 0 else kinds[::-1]):
                pb = Problem(name, variant=VARIANTS.get(k))
                ms[k].append(time_ms(pb.mok_step, steps))
                if r == 0:
                    f1 = step_fingerprint(pb.mok_step(), pb.x, pb.params)
                    det[k] = f1 == step_fingerprint(pb.mok_step(), pb.x, pb.params)
                pb.release()
        off = statistics.median(ms["off"])
        for k in kinds:
            ratios = [a / b for a, b in zip(ms[k], ms["off"])]
            m = statistics.median(ms[k])
            rows.append({"shape": name, "variant": k, "ms": m, "ms_rounds": ms[k], "x_off": m / off,
                         "ratio_rounds": ratios, "deterministic": det[k]})
            print(f"{name:15} {k:15} | {m:8.3f} ms  x off {m / off:6.3f}  (rounds {min(ratios):.3f}-{max(ratios):.3f})"
                  f"  det {'yes' if det[k] else 'no'}")
            sys.stdout.flush()
    return rows


def routings(name, uniform_only, only=""):
    """The routing modes a shape is timed with: uniform, then skewed and the shape's own
    routers (shapes.ROUTERS) unless uniform_only; with only (a comma-separated list),
    those of them named there."""
    modes = ["uniform"] if uniform_only else ["uniform", "skewed", *ROUTERS.get(name, {})]
    return [m for m in modes if m in only.split(",")] if only else modes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default="")
    ap.add_argument("--uniform-only", action="store_true")
    ap.add_argument("--profile", action="store_true", help="mok only: CTA time per task kind (MOK_PROFILE=1)")
    ap.add_argument("--variant", default="", choices=["", *VARIANTS],
                    help="--profile: the layer with this one of shapes.VARIANTS")
    ap.add_argument("--mok-only", action="store_true",
                    help="no peer: A/B runs of two builds (bench/gpu_session.sh ab), alternating in one call; "
                    "prints a digest of mok's outputs and gradients, equal when two builds give the same bits")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time mok and the peer this many times per row, in turn; ms is the median, and the "
                    "rounds' peer/mok ratios are printed (their spread) and kept in the JSON")
    ap.add_argument("--commit", default="", help="commit to print when the tree has no .git")
    ap.add_argument("--kernel-times", action="store_true",
                    help="mok and peer: per step, the GPU's kernel times against the step's wall time (torch.profiler)")
    ap.add_argument("--recompute-gate-up", action="store_true",
                    help="mok.MoE(recompute_gate_up=True): gate|up computed again in backward, not kept")
    ap.add_argument("--keep-saved", action="store_true",
                    help="mok.MoE(reuse_saved=False): the backward leaves the saved tensor as it is (more memory)")
    ap.add_argument("--warm", type=float, default=0.0,
                    help="--profile, --kernel-times: seconds of back-to-back steps before the measured one(s), "
                    "so that they run at a sustained run's clock (default 0: from idle, near full clock)")
    ap.add_argument("--routings", default="",
                    help="only these routing modes (comma-separated: uniform, skewed, a shape's own from shapes.ROUTERS)")
    ap.add_argument("--variants", action="store_true",
                    help="mok only: each shape with shapes.VARIANTS off and each on, in turn, --rounds times")
    args = ap.parse_args()
    LAYER_OPTIONS.update(recompute_gate_up=args.recompute_gate_up, reuse_saved=not args.keep_saved)
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if args.variants:
        print(f"GPU {torch.cuda.get_device_name()}, commit {commit or '?'}: mok's step, variants off and on")
        rows = bench_variants(args.shapes.split(","), args.steps, max(1, args.rounds))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit, "rows": rows}, f, indent=1)
        return
    if args.kernel_times:
        for name in args.shapes.split(","):
            kernel_times(name, warm=args.warm)
        return
    if args.profile:
        for name in args.shapes.split(","):
            for routing in routings(name, args.uniform_only, args.routings):
                profile_shape(name, routing, args.warm, args.variant)
        return
    global SAMPLER
    SAMPLER = GpuSampler()
    ceiling_power = {}
    ceiling = ceiling_tflops(out=ceiling_power)
    sustained_power = {}
    sustained = ceiling_tflops(out=sustained_power, warm=3.0)
    # (the ceiling's power is in the JSON only: 10 GEMMs are too short for 50 ms samples)
    print(f"GPU {torch.cuda.get_device_name()}, commit {commit or '?'}, dense bf16 8192^3 ceiling {ceiling:.0f} TFLOP/s"
          + "".join(f", mok with {k}" for k, v in LAYER_OPTIONS.items() if v))
    print(f"  (sustained, after 3 s of GEMMs: {sustained:.0f} TFLOP/s at {sustained_power.get('sm_mhz') or 0:.0f} MHz, "
          f"{sustained_power.get('watts') or 0:.0f} W; ceil% below is of the first figure)")
    hdr = (f"{'shape':15} {'routing':8} | {'mok ms':>8} {'iso ms':>7} {'TFLOP/s':>8} {'fwd TF/s':>8} {'ceil%':>6} "
           f"{'GiB':>6} {'det':>4} | {'peer ms':>8} {'iso ms':>7} {'TFLOP/s':>8} {'GiB':>6} {'det':>4} | {'x peer':>6}")
    print(hdr)
    print("-" * len(hdr))
    rows = []
    for name in args.shapes.split(","):
        for routing in routings(name, args.uniform_only, args.routings):
            r = bench_shape(name, routing, args.steps, ceiling, args.mok_only, args.rounds)
            rows.append(r)
            m, p = r["mok"], r.get("peer", {})  # (no peer with --mok-only)
            det = lambda d: "yes" if d else "no"  # noqa: E731
            line = (f"{name:15} {r['routing']:8} | {m['ms']:8.2f} {m['isolated_ms']:7.2f} {m['tflops']:8.0f} "
                    f"{m['forward_tflops']:8.0f} {100*m['tflops']/ceiling:5.0f}% {m['peak_gib']:6.2f} {det(m['deterministic']):>4} | ")
            if args.mok_only:
                line += f"mok's bits {m['bits']}"
            elif "error" in p:
                line += f"peer failed: {p['error']}"
            else:
                line += (f"{p['ms']:8.2f} {p['isolated_ms']:7.2f} {p['tflops']:8.0f} {p['peak_gib']:6.2f} "
                         f"{det(p['deterministic']):>4} | {p['ms']/m['ms']:6.2f}")
                if "ratio_rounds" in r:
                    rr = r["ratio_rounds"]
                    line += f"  ({len(rr)} rounds: {min(rr):.3f}-{max(rr):.3f})"
            print(line)
            if m.get("watts") and p.get("watts"):
                print(f"{'':24} | SM {m['sm_mhz']:4.0f} MHz, {m['watts']:3.0f} W, {m['celsius']:2.0f} C, "
                      f"{m['joules_per_step']:6.2f} J a step{'':10} | SM {p['sm_mhz']:4.0f} MHz, {p['watts']:3.0f} W, "
                      f"{p['celsius']:2.0f} C, {p['joules_per_step']:6.2f} J a step")
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit, "ceiling_tflops": ceiling,
                       "ceiling_power": ceiling_power, "ceiling_sustained_tflops": sustained,
                       "ceiling_sustained_power": sustained_power, **LAYER_OPTIONS, "rows": rows}, f,
                      indent=1)
    SAMPLER.stop()


if __name__ == "__main__":
    main()
