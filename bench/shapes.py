"""The named MoE shapes of the benchmarks (DESIGN.md section 7): tokens per GPU, H, F,
E, K. tools/mok.c carries the same table for the C command."""
SHAPES = {
    "qwen3-30b-a3b": (16384, 2048, 768, 128, 8),
    "gpt-oss-120b": (16384, 2880, 2880, 128, 4),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
    "deepseek-v3": (8192, 7168, 2048, 256, 8),
    "kimi-k2": (8192, 7168, 2048, 384, 8),
    "qwen3.5": (16384, 4096, 1024, 512, 10),
}

# Routing modes beside "uniform" and "skewed" (bench_moe.py): a shape's own router where
# it is not the default one (softmax, normalised, bias_select zero). "groups":
# DeepSeek-V3's group-limited routing (sigmoid scores, the best 4 of 8 groups by their
# top-2 sums, weights normalised then scaled by 2.5), mok.MoE's options and the peer's.
ROUTERS = {
    "deepseek-v3": {"groups": dict(score="sigmoid", route_scale=2.5, n_group=8, topk_group=4)},
}

# The router and expert variants whose cost bench_moe.py --variants measures (mok.MoE's
# options; docs/PERF.md's cost table): each alone, gpt-oss's three together, and
# DeepSeek-V3's group-limited router (8 groups, every named shape's E a multiple of 8);
# "shared" adds a shared expert of the shape's ffn size (none of the named shapes has
# one) and "shared_gate" the same with Qwen2-MoE's sigmoid gate, so the gate's own cost
# is shared_gate's time over shared's.
VARIANTS = {
    "router_bias": dict(router_bias=True),
    "expert_bias": dict(expert_bias=True),
    "clamped_swiglu": dict(swiglu_limit=7.0),
    "gpt-oss": dict(router_bias=True, expert_bias=True, swiglu_limit=7.0),
    "groups": dict(score="sigmoid", route_scale=2.5, n_group=8, topk_group=4),
    "shared": dict(shared_ffn="F"),
    "shared_gate": dict(shared_ffn="F", shared_gate=True),
}


def step_flops(T, H, F, E, K):
    """A training step's FLOPs (forward + backward): 3 x the forward's 6 T K H F (three
    expert projections) + 2 T H E (router), DESIGN.md section 7."""
    return 3 * (6 * T * K * H * F + 2 * T * H * E)


def hot_experts(E):
    """Skewed routing in the benchmarks: the first E/32 experts (at least one) get a
    selection bias that makes them every token's first choices."""
    return max(1, E // 32)
